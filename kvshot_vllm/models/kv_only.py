"""KV-only drafter: Llama blocks whose attention is a cross-attention over the target's cached
K/V of the sampled layers (plus the drafter's own K/V for the tokens of its chain). No target
hidden state: a row sees its token's embedding and the target's cache, nothing else."""

from __future__ import annotations

import torch
import torch.nn as nn

from kvshot_vllm.models.config import DrafterConfig
from kvshot_vllm.models.drafter import AttentionFactory, DraftAttention, DraftContext, DraftLayers
from kvshot_vllm.models.layers import RMSNorm, SelectiveScan, SwiGLU
from kvshot_vllm.models.registry import register_paradigm


class KVLayer(nn.Module):
    """A KV-only drafter layer (Llama block): pre-norm cross-attention over target KV, for block
    drafters H-Spec's recurrent mixer, then an MLP."""

    def __init__(self, cfg: DrafterConfig, cross: DraftAttention) -> None:
        super().__init__()
        target = cfg.target
        h, eps = target.hidden_size, target.rms_norm_eps
        self.input_norm = RMSNorm(h, eps)
        self.cross = cross
        self.post_norm = RMSNorm(h, eps)
        self.mlp = SwiGLU(h, target.intermediate_size)
        self.ssm = SelectiveScan(h, cfg.ssm_state_size, eps) if cfg.ssm_state_size else None

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None, ctx: DraftContext
                ) -> torch.Tensor:
        """x [..., hidden]; cond: the recurrent mixer's conditioning (block drafters)."""
        x = x + ctx.attend(self.cross, self.input_norm(x))
        if self.ssm is not None:
            x = x + ctx.mix(self.ssm, x, cond)
        return x + self.mlp(self.post_norm(x))


@register_paradigm("kv", reads_target_kv=True, uses_aux_hidden=False, self_attention=False)
class KVOnly(DraftLayers):
    """KV-only: cross-attention over the target's cached K/V, no target hidden state."""

    def build(self, model, cfg: DrafterConfig, attention: AttentionFactory) -> None:
        h = cfg.target.hidden_size
        model.kv_layers = nn.ModuleList(KVLayer(cfg, attention.cross_attention(h, reads))
                                        for reads in cfg.layer_reads())

    def forward(self, model, embeds, hidden, ctx):
        x = embeds
        for layer in model.kv_layers:
            x = layer(x, hidden, ctx)
        return x, x
