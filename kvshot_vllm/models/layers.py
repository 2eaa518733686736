"""Pure-torch pieces of the drafters whose math must be the same in training and in vLLM."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SwiGLU(nn.Module):
    """Llama MLP with the checkpoint names gate_proj / up_proj / down_proj."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GatedDelta(nn.Module):
    """Hybrid merge (KVShot, App. B): a = o_self + gate * W (o_cross - o_self).

    The cross-attention is a correction of the self-attention path, not a replacement; the gate
    is element-wise and shared by all draft steps. gate -> 0 gives back plain EAGLE-3.
    """

    def __init__(self, hidden: int, gate_init: float) -> None:
        super().__init__()
        self.delta_proj = nn.Linear(hidden, hidden, bias=False)
        self.gate = nn.Parameter(torch.full((hidden,), gate_init))

    def forward(self, o_self: torch.Tensor, o_cross: torch.Tensor) -> torch.Tensor:
        return o_self + self.gate * self.delta_proj(o_cross - o_self)
