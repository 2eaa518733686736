"""KV-only drafter: Llama blocks whose attention is a cross-attention over the target's cached
K/V of the sampled layers (plus the drafter's own K/V for the tokens of its chain). No target
hidden state: a row sees its token's embedding and the target's cache, nothing else."""

from __future__ import annotations

import torch
import torch.nn as nn

from kvshot_vllm.models.config import DrafterConfig
from kvshot_vllm.models.drafter import (ChainKV, DraftAttention, Drafter, TargetFeatures,
                                        cross_attention)
from kvshot_vllm.models.layers import RMSNorm, SelectiveScan, SwiGLU
from kvshot_vllm.models.registry import register_paradigm


def cross_attend(cross: DraftAttention, x: torch.Tensor, positions: torch.Tensor, rope_fn,
                 feats: TargetFeatures, layers: list[int], chain: ChainKV) -> torch.Tensor:
    """A row at vLLM position p carries the token at p + 1: its query and own key sit there."""
    ctx = cross.target_context([feats.target_kv[i] for i in layers], rope_fn)
    return cross(x, rope_fn(positions + 1), chain, ctx=ctx)


class KVLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, num_reads: int) -> None:
        super().__init__()
        target = cfg.target
        h, eps = target.hidden_size, target.rms_norm_eps
        self.input_norm = RMSNorm(h, eps)
        self.cross = cross_attention(h, cfg, num_reads)
        self.post_norm = RMSNorm(h, eps)
        self.mlp = SwiGLU(h, target.intermediate_size)
        self.ssm = SelectiveScan(h, cfg.ssm_state_size, eps) if cfg.ssm_state_size else None


@register_paradigm("kv", reads_target_kv=True, uses_aux_hidden=False, self_attention=False)
class KVOnlyDrafter(Drafter):
    """KV-only: cross-attention over the target's cached K/V, no target hidden state."""

    def __init__(self, cfg: DrafterConfig, target_hf_config, embed: torch.Tensor) -> None:
        super().__init__(cfg, target_hf_config, embed)
        self.reads = cfg.layer_reads()
        self.kv_layers = nn.ModuleList(KVLayer(cfg, len(r)) for r in self.reads)

    def step(self, embeds, hidden, positions, feats, chains):
        x = embeds
        for i, (layer, reads) in enumerate(zip(self.kv_layers, self.reads)):
            x = x + cross_attend(layer.cross, layer.input_norm(x), positions, self.rope, feats,
                                 reads, chains[f"kv_layers.{i}.cross"])
            if layer.ssm is not None:  # block drafters only: `hidden` is their conditioning
                x = x + chains[f"kv_layers.{i}.ssm"].advance(layer.ssm, x, hidden)
            x = x + layer.mlp(layer.post_norm(x))
        return self.norm(x), x
