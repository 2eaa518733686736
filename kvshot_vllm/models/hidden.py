"""Hidden-only drafter: EAGLE-3 as vLLM serves it (`llama_eagle3.py`), for training.

Step 0 fuses the aux hidden states of three target layers with `fc`; later steps feed back the
drafter's own pre-norm output. Layer 0 attends over [norm(embedding), norm(hidden)] (2 x
hidden wide); further layers are plain Llama blocks on the residual stream.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kvshot_vllm.models.config import DrafterConfig, TargetSpec
from kvshot_vllm.models.drafter import ChainKV, DraftAttention, Drafter, TargetFeatures
from kvshot_vllm.models.layers import RMSNorm, SwiGLU
from kvshot_vllm.models.registry import register_paradigm


class EagleLayer(nn.Module):
    def __init__(self, target: TargetSpec, index: int) -> None:
        super().__init__()
        h, eps = target.hidden_size, target.rms_norm_eps
        self.first = index == 0
        self.input_layernorm = RMSNorm(h, eps)
        if self.first:
            self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = DraftAttention(2 * h if self.first else h, target)
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


@register_paradigm("hidden", reads_target_kv=False, uses_aux_hidden=True, self_attention=True)
class HiddenDrafter(Drafter):
    """Hidden-only (EAGLE-3): fused target hidden states, self-attention over its own KV."""

    first_step_needs_all_rows = True

    def __init__(self, cfg: DrafterConfig, target_hf_config, embed: torch.Tensor) -> None:
        super().__init__(cfg, target_hf_config, embed)
        h = cfg.target.hidden_size
        self.fc = nn.Linear(len(cfg.aux_layers) * h, h, bias=False)
        self.layers = nn.ModuleList(EagleLayer(cfg.target, i) for i in range(cfg.num_layers))

    def first_hidden(self, feats: TargetFeatures) -> torch.Tensor:
        return self.fc(feats.aux_hidden)

    def first_attention(self, x: torch.Tensor, rope, positions: torch.Tensor,
                        feats: TargetFeatures, chains: dict[str, ChainKV]) -> torch.Tensor:
        """Layer 0's attention output (the hybrid adds its cross-attention correction here)."""
        return self.layers[0].self_attn(x, rope, chains["layers.0.self_attn"])

    def step(self, embeds, hidden, positions, feats, chains):
        rope = self.rope(positions)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer.attn_input(embeds, hidden, residual)
            if i == 0:
                attn = self.first_attention(x, rope, positions, feats, chains)
            else:
                attn = layer.self_attn(x, rope, chains[f"layers.{i}.self_attn"])
            hidden, residual = layer.finish(attn, residual)
        prenorm = hidden + residual
        return self.norm(prenorm), prenorm
