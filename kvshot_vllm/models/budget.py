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
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator


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
        return self

    @property
    def sink_blocks(self) -> int:
        return self.sink_tokens // self.block_size

    @property
    def window_blocks(self) -> int:
        return (self.tokens - self.sink_tokens) // self.block_size


def left_out_blocks(verified: torch.Tensor, budget: KVBudget) -> torch.Tensor:
    """Blocks left out of view right after the sink, per request: the view of V verified keys
    is blocks [0, sink) and [sink + gap, ...). verified [...] long -> gap [...] long."""
    last = (verified - 1).div(budget.block_size, rounding_mode="floor")
    return (last - budget.window_blocks + 1 - budget.sink_blocks).clamp(min=0)


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
