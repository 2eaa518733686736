"""Compressed draft-side memory (issue 16, memory-augmented drafting): the adaptor that turns
each chunk of cached K/V a view leaves out (`budget.py`) into a few memory slots.

A slot is an attention pooling of its chunk: weights over the chunk's positions from a learned
query against the values (which carry no rotation, so the weights do not depend on where the
chunk sits) plus a learned bias per position in the chunk; the slot's key and value are those
weights applied to the chunk's keys and values. Keys are pooled as cached, rotated: a query's
score against the pooled key is the same weighting of its scores against the chunk's keys.

A chunk's slots depend on that chunk alone, so the memory grows by one chunk's slots when a
chunk leaves the exact window and is never recomputed over the prefix; compressing a prefix
chunk by chunk gives what compressing it at once does (tests/test_memory_unit.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kvshot_vllm.models.budget import CompressedMemory


class ChunkMemory(nn.Module):
    """Pools every chunk of `chunk_tokens` cached keys/values into `slots` (key, value) pairs,
    per KV head: [B, H, n * chunk_tokens, d] -> [B, H, n * slots, d]."""

    def __init__(self, heads: int, head_dim: int, memory: CompressedMemory) -> None:
        super().__init__()
        self.chunk, self.slots = memory.chunk_tokens, memory.slots
        # Initial values (`weights.init_weights`): query 0 and a bias that confines slot j to
        # the j-th stretch of its chunk, i.e. the mean of each stretch.
        self.query = nn.Parameter(torch.zeros(heads, self.slots, head_dim))
        self.bias = nn.Parameter(torch.zeros(self.slots, self.chunk))

    def forward(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, t, d = k.shape
        n = t // self.chunk
        kc = k[:, :, : n * self.chunk].reshape(b, h, n, self.chunk, d)
        vc = v[:, :, : n * self.chunk].reshape(b, h, n, self.chunk, d)
        scores = torch.einsum("hsd,bhncd->bhnsc", self.query.to(vc.dtype), vc) * d**-0.5
        weights = torch.softmax((scores + self.bias).float(), dim=-1).to(vc.dtype)
        k_mem = torch.einsum("bhnsc,bhncd->bhnsd", weights, kc).reshape(b, h, n * self.slots, d)
        v_mem = torch.einsum("bhnsc,bhncd->bhnsd", weights, vc).reshape(b, h, n * self.slots, d)
        return k_mem, v_mem


def stretch_bias(slots: int, chunk: int, outside: float = -8.0) -> torch.Tensor:
    """ChunkMemory.bias at initialisation: 0 where position i of a chunk is in slot j's
    stretch (i * slots // chunk == j), `outside` elsewhere. [slots, chunk]."""
    owner = torch.arange(chunk) * slots // chunk
    return torch.where(owner == torch.arange(slots).unsqueeze(1), 0.0, outside)
