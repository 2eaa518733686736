"""Hidden-only drafter: EAGLE-3 as vLLM serves it (`llama_eagle3.py`), for training.

Step 0 fuses the aux hidden states of three target layers with `fc`; later steps feed back the
drafter's own pre-norm output. Layer 0 attends over [norm(embedding), norm(hidden)] (2 x
hidden wide); further layers are plain Llama blocks on the residual stream.

`EagleLayer` and `eagle_forward` serve training and the plugin's vLLM drafters alike (the hybrid
there, `serving.drafter`); they differ only in the self-attention module and how it is called
(`Attend`). Hidden-only checkpoints themselves are served by vLLM's stock EAGLE-3 model, which
this math equals (tests/test_plugin.py, the parity test).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from kvshot_vllm.models.config import DrafterConfig, TargetSpec
from kvshot_vllm.models.drafter import ChainKV, DraftAttention, Drafter, TargetFeatures
from kvshot_vllm.models.layers import RMSNorm, SwiGLU
from kvshot_vllm.models.registry import register_paradigm


# attend(i, self_attn, x): layer i's attention output [..., hidden] for its input x
Attend = Callable[[int, DraftAttention, torch.Tensor], torch.Tensor]


class EagleLayer(nn.Module):
    """vLLM's EAGLE-3 decoder layer (`llama_eagle3.LlamaDecoderLayer`), checkpoint names
    included. `self_attn`: the offline attention by default, vLLM's paged one when served."""

    def __init__(self, target: TargetSpec, index: int,
                 self_attn: Callable[[int], DraftAttention] | None = None) -> None:
        super().__init__()
        h, eps = target.hidden_size, target.rms_norm_eps
        self.first = index == 0
        self.input_layernorm = RMSNorm(h, eps)
        if self.first:
            self.hidden_norm = RMSNorm(h, eps)
        in_size = 2 * h if self.first else h
        self.self_attn = self_attn(in_size) if self_attn else DraftAttention(in_size, target)
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

    def attention(self, positions: torch.Tensor, feats: TargetFeatures,
                  chains: dict[str, ChainKV]) -> Attend:
        """The offline self-attention of this step's rows (the hybrid adds its correction)."""
        rope = self.rope(positions)
        return lambda i, attn, x: attn(x, rope, chains[f"layers.{i}.self_attn"])

    def step(self, embeds, hidden, positions, feats, chains):
        prenorm = eagle_forward(self.layers, embeds, hidden,
                                self.attention(positions, feats, chains))
        return self.norm(prenorm), prenorm
