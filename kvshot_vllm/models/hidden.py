"""Hidden-only drafter: EAGLE-3 as vLLM serves it (`llama_eagle3.py`).

Step 0 fuses the aux hidden states of three target layers with `fc`; later steps feed back the
drafter's own pre-norm output. Layer 0 attends over [norm(embedding), norm(hidden)] (2 x
hidden wide); further layers are plain Llama blocks on the residual stream.

Hidden-only checkpoints are served by vLLM's stock EAGLE-3 model, which this math equals
(tests/test_plugin.py, the parity test); the hybrid (`hybrid.py`) builds on this definition.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from kvshot_vllm.models.config import DrafterConfig, TargetSpec
from kvshot_vllm.models.drafter import AttentionFactory, DraftAttention, DraftContext, DraftLayers
from kvshot_vllm.models.layers import RMSNorm, SwiGLU
from kvshot_vllm.models.registry import register_paradigm


# attend(i, self_attn, x): layer i's attention output [..., hidden] for its input x
Attend = Callable[[int, DraftAttention, torch.Tensor], torch.Tensor]


class EagleLayer(nn.Module):
    """vLLM's EAGLE-3 decoder layer (`llama_eagle3.LlamaDecoderLayer`), checkpoint names
    included, its self-attention from the model's back-end."""

    def __init__(self, target: TargetSpec, index: int, attention: AttentionFactory) -> None:
        super().__init__()
        h, eps = target.hidden_size, target.rms_norm_eps
        self.first = index == 0
        self.input_layernorm = RMSNorm(h, eps)
        if self.first:
            self.hidden_norm = RMSNorm(h, eps)
        in_size = 2 * h if self.first else h
        self.self_attn = attention.self_attention(in_size, index)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = SwiGLU(h, target.intermediate_size)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor,
                   residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input, residual): vLLM's pre-attention norms of layer 0 and of the rest."""
        if self.first:
            return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1), hidden
        residual = hidden + residual
        return self.input_layernorm(residual), residual

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = attn_out + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


def eagle_forward(layers: nn.ModuleList, embeds: torch.Tensor, hidden: torch.Tensor,
                  attend: Attend) -> torch.Tensor:
    """One draft step of EAGLE-3 layers: embeds, hidden [..., hidden] -> the pre-norm output
    (what the next step gets as its hidden state)."""
    residual = None
    for i, layer in enumerate(layers):
        x, residual = layer.attn_input(embeds, hidden, residual)
        hidden, residual = layer.finish(attend(i, layer.self_attn, x), residual)
    return hidden + residual


@register_paradigm("hidden", reads_target_kv=False, uses_aux_hidden=True, self_attention=True)
class Hidden(DraftLayers):
    """Hidden-only (EAGLE-3): fused target hidden states, self-attention over its own KV."""

    def build(self, model, cfg: DrafterConfig, attention: AttentionFactory) -> None:
        model.layers = nn.ModuleList(EagleLayer(cfg.target, i, attention)
                                     for i in range(cfg.num_layers))

    def attend(self, model, ctx: DraftContext) -> Attend:
        """The layers' attention (the hybrid adds its correction to layer 0's)."""
        return lambda i, attn, x: ctx.attend(attn, x)

    def forward(self, model, embeds, hidden, ctx):
        prenorm = eagle_forward(model.layers, embeds, hidden, self.attend(model, ctx))
        return prenorm, prenorm
