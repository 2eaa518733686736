"""Hybrid drafter (KVShot): EAGLE-3, whose first attention gets a cross-attention over the
target's cached K/V merged by the gated delta rule (`layers.GatedDelta`). Warm-starts from a
hidden-only checkpoint: the EAGLE-3 weights are kept, the cross branch and gate are fresh."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvshot_vllm.models.config import DrafterConfig
from kvshot_vllm.models.drafter import cross_attention
from kvshot_vllm.models.hidden import Attend, HiddenDrafter
from kvshot_vllm.models.kv_only import cross_attend
from kvshot_vllm.models.layers import GatedDelta
from kvshot_vllm.models.registry import register_paradigm


@register_paradigm("hybrid", reads_target_kv=True, uses_aux_hidden=True, self_attention=True)
class HybridDrafter(HiddenDrafter):
    """Hybrid (KVShot): EAGLE-3 plus a gated cross-attention correction over target KV."""

    def __init__(self, cfg: DrafterConfig, target_hf_config, embed: torch.Tensor) -> None:
        super().__init__(cfg, target_hf_config, embed)
        h = cfg.target.hidden_size
        self.cross = cross_attention(2 * h, cfg, len(cfg.kv_layers))
        self.merge = GatedDelta(h, cfg.gate_init)

    def attention(self, positions, feats, chains):
        return corrected(self.merge, super().attention(positions, feats, chains),
                         lambda x: cross_attend(self, self.cross, x, positions, feats,
                                                self.cfg.kv_layers, chains["cross"]))


def corrected(merge: GatedDelta, attend: Attend,
              cross: Callable[[torch.Tensor], torch.Tensor]) -> Attend:
    """The hybrid's attention: layer 0's self-attention output merged with `cross(x)`, its
    cross-attention over target K/V (training and serving pass their own back-ends)."""

    def attend_corrected(i: int, attn, x: torch.Tensor) -> torch.Tensor:
        out = attend(i, attn, x)
        return merge(out, cross(x)) if i == 0 else out

    return attend_corrected
