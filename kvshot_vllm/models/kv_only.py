"""KV-only drafter: Llama blocks whose attention is a cross-attention over the target's cached
K/V of the sampled layers (plus the drafter's own K/V for the tokens of its chain). No target
hidden state: a row sees its token's embedding and the target's cache, nothing else."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from kvshot_vllm.models.config import DrafterConfig
from kvshot_vllm.models.drafter import (ChainKV, DraftAttention, Drafter, TargetFeatures,
                                        cross_attention)
from kvshot_vllm.models.layers import RMSNorm, SelectiveScan, SwiGLU
from kvshot_vllm.models.registry import register_paradigm


def cross_attend(drafter: Drafter, cross: DraftAttention, x: torch.Tensor,
                 positions: torch.Tensor, feats: TargetFeatures, layers: list[int],
                 chain: ChainKV) -> torch.Tensor:
    """A row at vLLM position p carries the token at p + 1: its query and own key sit there.
    It reads the drafter's view of the target's K/V."""
    ctx = cross.target_context([feats.target_kv[i] for i in layers], drafter.rope)
    return cross(x, drafter.rope(positions + 1), chain, ctx=ctx, view=drafter.view)


class KVLayer(nn.Module):
    """A KV-only drafter layer (Llama block): pre-norm cross-attention over target KV, for block
    drafters H-Spec's recurrent mixer, then an MLP. Training and serving run this one class;
    they differ in the attention over target K/V (`cross`: offline over cached tensors, or
    vLLM's paged op in place) and in how the caller feeds it (`forward`)."""

    def __init__(self, cfg: DrafterConfig, cross: DraftAttention) -> None:
        super().__init__()
        target = cfg.target
        h, eps = target.hidden_size, target.rms_norm_eps
        self.input_norm = RMSNorm(h, eps)
        self.cross = cross
        self.post_norm = RMSNorm(h, eps)
        self.mlp = SwiGLU(h, target.intermediate_size)
        self.ssm = SelectiveScan(h, cfg.ssm_state_size, eps) if cfg.ssm_state_size else None

    def forward(self, x: torch.Tensor, attend: Callable[[DraftAttention, torch.Tensor], torch.Tensor],
                mix: Callable[[SelectiveScan, torch.Tensor], torch.Tensor] | None = None
                ) -> torch.Tensor:
        """x [..., hidden]; `attend(cross, normed x)` runs the cross-attention for these rows,
        `mix(ssm, x)` the recurrent mixer's residual update (block drafters)."""
        x = x + attend(self.cross, self.input_norm(x))
        if self.ssm is not None:
            x = x + mix(self.ssm, x)
        return x + self.mlp(self.post_norm(x))


@register_paradigm("kv", reads_target_kv=True, uses_aux_hidden=False, self_attention=False)
class KVOnlyDrafter(Drafter):
    """KV-only: cross-attention over the target's cached K/V, no target hidden state."""

    def __init__(self, cfg: DrafterConfig, target_hf_config, embed: torch.Tensor) -> None:
        super().__init__(cfg, target_hf_config, embed)
        self.reads = cfg.layer_reads()
        self.kv_layers = nn.ModuleList(
            KVLayer(cfg, cross_attention(cfg.target.hidden_size, cfg, len(r))) for r in self.reads)

    def step(self, embeds, hidden, positions, feats, chains):
        x = embeds
        for i, (layer, reads) in enumerate(zip(self.kv_layers, self.reads)):
            x = layer(x, lambda cross, h: cross_attend(self, cross, h, positions, feats, reads,
                                                       chains[f"kv_layers.{i}.cross"]),
                      # block drafters only: `hidden` is their conditioning
                      lambda ssm, x: chains[f"kv_layers.{i}.ssm"].advance(ssm, x, hidden))
        return self.norm(x), x
