"""Sparse views of the target's KV for a drafter's cross-attention, and optionally of the
drafter's own self-attention cache (BudgetDraft; issue 15).

A drafter that reads the target's cache in place can read less of it. A view keeps, of the
verified prefix, its first blocks (StreamingLLM's attention sinks) and its most recent window,
so a draft step attends at most `tokens` verified keys, plus the proposal's own, whatever the
length of the prefix. The view is a function of the verified length V alone: chosen once per
proposal and kept through its draft steps. Positions >= V (the bonus token's and the drafts'
own K/V) are always in view.

Views are whole cache blocks, so that vLLM serves one as a shorter block table with no K/V
copied (`serving/backend.py`), and training masks exactly the same keys
(`layers.draft_attention`). The verifier keeps the full cache.

With `draft_cache`, a hybrid's EAGLE-3 self-attention reads the same view of its own cache (the
drafter's keys of the verified positions), as BudgetDraft budgets its drafter's cache: then no
read of a draft step grows with the prefix.

With a `memory` (issue 16, memory-augmented drafting), what the view leaves out is not dropped
but summarised: each whole chunk of left-out keys becomes a few learned memory slots
(`memory.ChunkMemory`), so a draft step reads the sink, the memory and an exact recent window.
Only whole chunks are summarised; the blocks of a chunk not yet wholly left out stay in the exact
window, which is therefore between `tokens` and `tokens + chunk_tokens - block_size` keys long.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator


class CompressedMemory(BaseModel):
    """The `memory` of a view: each chunk of `chunk_tokens` left-out keys as `slots` summaries."""

    model_config = ConfigDict(extra="forbid")

    chunk_tokens: int = Field(64, gt=0)
    slots: int = Field(4, gt=0)
    # which caches are summarised: the target's (read by cross-attention), the drafter's own
    # (with `draft_cache`), or both; a cache not summarised is a plain streaming view
    caches: Literal["target", "draft", "both"] = "target"

    @model_validator(mode="after")
    def _compresses(self) -> "CompressedMemory":
        if self.slots >= self.chunk_tokens:
            raise ValueError(f"slots {self.slots} must be fewer than chunk_tokens "
                             f"{self.chunk_tokens}: a memory compresses")
        return self


class KVBudget(BaseModel):
    """The `kv_budget` field of a drafter config."""

    model_config = ConfigDict(extra="forbid")

    # streaming: sink blocks plus the most recent window (StreamingLLM)
    policy: Literal["streaming"] = "streaming"
    # verified keys in view: the sink plus the recent window
    tokens: int = Field(gt=0)
    # the first keys, always in view (attention sinks); default: one block
    sink_tokens: int | None = Field(None, ge=0)
    # the paged cache's block size: a view is whole blocks (vLLM: --block-size)
    block_size: int = Field(gt=0)
    # also view the drafter's own self-attention cache (a hybrid's EAGLE-3 layer)
    draft_cache: bool = False
    # summarise the left-out keys instead of dropping them (None: dropped)
    memory: CompressedMemory | None = None

    @model_validator(mode="after")
    def _whole_blocks(self) -> "KVBudget":
        if self.sink_tokens is None:
            self.sink_tokens = self.block_size
        for name in ("tokens", "sink_tokens"):
            if getattr(self, name) % self.block_size:
                raise ValueError(f"{name} {getattr(self, name)} is not a multiple of "
                                 f"block_size {self.block_size}: a view is whole cache blocks")
        # Two recent blocks keep the rows of a proposal's first pass (up to k + 1 before V,
        # k < block_size) inside the window, where their keys are the training side's.
        if self.tokens - self.sink_tokens < 2 * self.block_size:
            raise ValueError(f"tokens {self.tokens} leave less than two blocks of "
                             f"{self.block_size} after the sink ({self.sink_tokens})")
        if self.memory is not None and self.memory.chunk_tokens % self.block_size:
            raise ValueError(f"memory.chunk_tokens {self.memory.chunk_tokens} is not a multiple "
                             f"of block_size {self.block_size}: a chunk is whole cache blocks")
        if self.memory is not None and self.memory.caches != "target" and not self.draft_cache:
            raise ValueError(f"memory.caches {self.memory.caches!r} summarises the drafter's own "
                             f"cache, which only a view with draft_cache reads")
        return self

    def of_cache(self, target: bool) -> "KVBudget | None":
        """What this view reads of the target's cache (target) or of the drafter's own: None
        where it reads all of it (the drafter's own without `draft_cache`), without the memory
        where the memory does not summarise that cache."""
        if not target and not self.draft_cache:
            return None
        if self.memory is None or self.memory.caches in ("both", "target" if target else "draft"):
            return self
        return self.model_copy(update={"memory": None})

    def summarises(self, target: bool) -> bool:
        view = self.of_cache(target)
        return view is not None and view.memory is not None

    @property
    def sink_blocks(self) -> int:
        return self.sink_tokens // self.block_size

    @property
    def window_blocks(self) -> int:
        return (self.tokens - self.sink_tokens) // self.block_size

    @property
    def chunk_blocks(self) -> int:
        """Cache blocks per memory chunk."""
        return self.memory.chunk_tokens // self.block_size


def left_out_blocks(verified: torch.Tensor, budget: KVBudget) -> torch.Tensor:
    """Blocks left out of view right after the sink, per request: the view of V verified keys
    is blocks [0, sink) and [sink + gap, ...). verified [...] long -> gap [...] long. With a
    memory, whole chunks only (`memory_chunks` of them, each summarised)."""
    last = (verified - 1).div(budget.block_size, rounding_mode="floor")
    gap = (last - budget.window_blocks + 1 - budget.sink_blocks).clamp(min=0)
    if budget.memory is None:
        return gap
    return gap.div(budget.chunk_blocks, rounding_mode="floor") * budget.chunk_blocks


def memory_chunks(verified: torch.Tensor, budget: KVBudget) -> torch.Tensor:
    """How many chunks after the sink are summarised in the memory of V verified keys: those
    left out of the exact view. verified [...] long -> [...] long."""
    return left_out_blocks(verified, budget).div(budget.chunk_blocks, rounding_mode="floor")


def visible_keys(verified: torch.Tensor, num_keys: int, budget: KVBudget) -> torch.Tensor:
    """Which of keys [0, num_keys) are in view. verified [R] long -> [R, num_keys] bool."""
    gap = left_out_blocks(verified, budget)
    block = torch.arange(num_keys, device=verified.device) // budget.block_size
    return (block < budget.sink_blocks) | (block >= budget.sink_blocks + gap.unsqueeze(-1))


def view_block_table(block_table: torch.Tensor, gap: torch.Tensor, budget: KVBudget
                     ) -> torch.Tensor:
    """The block table of each request's view: the sink blocks, then the blocks after the gap.
    block_table [n, W], gap [n] -> [n, W] (entries past a request's view length are unused)."""
    width = block_table.shape[1]
    index = torch.arange(width, device=block_table.device).expand_as(block_table)
    source = torch.where(index < budget.sink_blocks, index, index + gap.unsqueeze(1).to(index))
    return block_table.gather(1, source.clamp(max=width - 1))


def kept_keys(budget: KVBudget | None, verified: int) -> tuple[int, int]:
    """(exact keys in view, memory slots) a draft step reads of one cache holding V verified
    keys; without a view, all of them."""
    if budget is None:
        return verified, 0
    v = torch.tensor([verified])
    exact = int(visible_keys(v, verified, budget).sum())
    slots = int(memory_chunks(v, budget)) * budget.memory.slots if budget.memory else 0
    return exact, slots
