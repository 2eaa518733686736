"""Sparse views of the target's KV for a drafter's cross-attention, and optionally of the
drafter's own self-attention cache (BudgetDraft; issue 15).

A drafter that reads the target's cache in place can read less of it. A view keeps, of the
verified prefix, its first blocks (StreamingLLM's attention sinks) and its most recent window,
so a draft step attends at most `tokens` verified keys, plus the proposal's own, whatever the
length of the prefix. A view is chosen once per proposal and kept through its draft steps; a
streaming view is a function of the verified length V alone. Positions >= V (the bonus token's and the drafts'
own K/V) are always in view.

With the `retrieval` policy (TriForce's and Quest's chunk retrieval, a chunk being a cache
block), the blocks between the sink and a shorter recent window are not all dropped: the
`retrieved_blocks` of them whose mean key scores highest against the drafter's query stay in
view. The query is that of the proposal's first draft row (the row carrying the bonus token), at
the first attention over target K/V, group 0 (its first sampled layer), summed over heads; one
choice per proposal, shared by every layer and head, because a served view is one block table
per request. Choosing reads the mean keys of the gap, one layer's, once per proposal (served,
each block's mean is kept between proposals: serving/backend.BlockSummaries), against a full
view's every layer's K and V in every pass.

Views are whole cache blocks, so that vLLM serves one as a shorter block table with no K/V
copied (`serving/backend.py`), and training masks exactly the same keys
(`layers.draft_attention`). The verifier keeps the full cache.

With `draft_cache`, a hybrid's EAGLE-3 self-attention reads the same view of its own cache (the
drafter's keys of the verified positions), as BudgetDraft budgets its drafter's cache: then no
read of a draft step grows with the prefix. It is a hidden-only drafter's only view.

With a `memory` (issue 16, memory-augmented drafting), what the view leaves out is not dropped
but summarised: each whole chunk of left-out keys becomes a few learned memory slots
(`memory.ChunkMemory`), so a draft step reads the sink, the memory and an exact recent window.
Only whole chunks are summarised; the blocks of a chunk not yet wholly left out stay in the exact
window, which is therefore between `tokens` and `tokens + chunk_tokens - block_size` keys long.
Served, a chunk is one cache block, whose slots the view builder keeps per physical block
(docs/architecture.md).
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

    # streaming: sink blocks plus the most recent window (StreamingLLM); retrieval: sink, a
    # shorter recent window, and the best-scoring blocks between them (TriForce, Quest)
    policy: Literal["streaming", "retrieval"] = "streaming"
    # verified keys in view: the sink, the recent window and (retrieval) the retrieved blocks
    tokens: int = Field(gt=0)
    # retrieval: the exact recent window; the rest of `tokens` after the sink is retrieved.
    # Default: two blocks. Streaming's window is all of `tokens` after the sink.
    recent_tokens: int | None = Field(None, gt=0)
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
        if self.policy == "streaming" and self.recent_tokens is not None:
            raise ValueError("recent_tokens is the retrieval policy's recent window; a "
                             "streaming view's window is tokens - sink_tokens")
        if self.policy == "retrieval":
            if self.recent_tokens is None:
                self.recent_tokens = 2 * self.block_size
            if self.tokens - self.sink_tokens - self.recent_tokens < self.block_size:
                raise ValueError(f"a retrieval view of {self.tokens} tokens leaves no block to "
                                 f"retrieve after its sink ({self.sink_tokens}) and recent "
                                 f"window ({self.recent_tokens})")
            for what in ("memory", "draft_cache"):
                if getattr(self, what):
                    raise ValueError(f"{what} is not implemented for the retrieval policy (its "
                                     f"choice is made for the target's cache); use streaming")
        for name in ("tokens", "sink_tokens", "recent_tokens"):
            if getattr(self, name) is not None and getattr(self, name) % self.block_size:
                raise ValueError(f"{name} {getattr(self, name)} is not a multiple of "
                                 f"block_size {self.block_size}: a view is whole cache blocks")
        # Two recent blocks keep the rows of a proposal's first pass (up to k + 1 before V,
        # k < block_size) inside the window, where their keys are the training side's.
        if self.window_blocks < 2:
            raise ValueError(f"the recent window ({self.window_blocks * self.block_size} "
                             f"tokens) is less than two blocks of {self.block_size}")
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
        """Blocks of the exact recent window (the partial last block included)."""
        window = self.recent_tokens if self.policy == "retrieval" else (
            self.tokens - self.sink_tokens)
        return window // self.block_size

    @property
    def retrieved_blocks(self) -> int:
        """Blocks between the sink and the recent window that a retrieval view keeps."""
        if self.policy != "retrieval":
            return 0
        return (self.tokens - self.sink_tokens - self.recent_tokens) // self.block_size

    @property
    def chunk_blocks(self) -> int:
        """Cache blocks per memory chunk."""
        return self.memory.chunk_tokens // self.block_size


def rows_verified(num_keys: int, rows: int, device: torch.device | str) -> torch.Tensor:
    """V of each of the last `rows` training rows over `num_keys` context positions: row p
    (position p) drafts after p + 1 verified keys. -> [rows] long."""
    return torch.arange(num_keys - rows + 1, num_keys + 1, device=device)


def left_out_blocks(verified: torch.Tensor, budget: KVBudget) -> torch.Tensor:
    """Blocks between the sink and the recent window, per request: the view of V verified keys
    is blocks [0, sink) and [sink + gap, ...), plus (retrieval) the `retrieved_blocks` chosen
    among the gap. verified [...] long -> gap [...] long. With a memory, whole chunks only
    (`memory_chunks` of them, each summarised)."""
    last = (verified - 1).div(budget.block_size, rounding_mode="floor")
    gap = (last - budget.window_blocks + 1 - budget.sink_blocks).clamp(min=0)
    if budget.memory is None:
        return gap
    return gap.div(budget.chunk_blocks, rounding_mode="floor") * budget.chunk_blocks


def memory_chunks(verified: torch.Tensor, budget: KVBudget) -> torch.Tensor:
    """How many chunks after the sink are summarised in the memory of V verified keys: those
    left out of the exact view. verified [...] long -> [...] long."""
    return left_out_blocks(verified, budget).div(budget.chunk_blocks, rounding_mode="floor")


def visible_keys(verified: torch.Tensor, num_keys: int, budget: KVBudget,
                 retrieved: torch.Tensor | None = None) -> torch.Tensor:
    """Which of keys [0, num_keys) are in view. verified [..., R] long, retrieved [..., R, C]
    (`retrieve`'s block indices; a retrieval view needs them) -> [..., R, num_keys] bool."""
    gap = left_out_blocks(verified, budget)
    block = torch.arange(num_keys, device=verified.device) // budget.block_size
    seen = (block < budget.sink_blocks) | (block >= budget.sink_blocks + gap.unsqueeze(-1))
    if budget.policy == "retrieval":
        if retrieved is None:
            raise ValueError("a retrieval view needs the retrieved blocks")
        seen = seen | (block == retrieved.unsqueeze(-1)).any(-2)
    return seen


def block_means(keys: torch.Tensor, budget: KVBudget) -> torch.Tensor:
    """What a retrieval view scores: the mean key of each whole block after the sink.
    keys [..., KVH, T, d] (rotated, as cached) -> [..., KVH, W, d] fp32, W whole blocks."""
    bs, first = budget.block_size, budget.sink_blocks
    whole = max(keys.shape[-2] // bs, first)
    return keys[..., first * bs:whole * bs, :].unflatten(-2, (whole - first, bs)).float().mean(-2)


def retrieve(query: torch.Tensor, means: torch.Tensor, verified: torch.Tensor, budget: KVBudget
             ) -> torch.Tensor:
    """The blocks of the gap (`left_out_blocks`) that a retrieval view keeps: those whose mean
    key (`block_means`) scores highest against `query`, summed over heads (GQA: each query head
    against its KV head's means); all of the gap where it holds no more than
    `retrieved_blocks`.

    query [..., R, H, d] (rotated, as attention reads it); means [..., KVH, W, d] (at least the
    blocks of each row's gap); verified [..., R] long (or [R]).
    Returns block indices [..., R, retrieved_blocks] long, ascending; -1 where the gap is
    shorter.
    """
    h, d = query.shape[-2:]
    kvh, width = means.shape[-3], means.shape[-2]
    grouped = query.float().unflatten(-2, (kvh, h // kvh)).sum(-2)  # [..., R, KVH, d]
    scores = torch.einsum("...rkd,...kwd->...rw", grouped, means)
    c = budget.retrieved_blocks
    if width < c:  # fewer whole blocks than the view keeps: all of them are the gap's at most
        scores = torch.nn.functional.pad(scores, (0, c - width))
    gap = left_out_blocks(verified, budget).unsqueeze(-1)
    in_gap = torch.arange(scores.shape[-1], device=scores.device) < gap
    order = scores.masked_fill(~in_gap, float("-inf")).topk(c, dim=-1).indices
    chosen = torch.where(in_gap.expand_as(scores).gather(-1, order), order + budget.sink_blocks,
                         torch.full_like(order, -1))
    return chosen.sort(dim=-1).values


def dropped_blocks(verified: torch.Tensor, budget: KVBudget) -> torch.Tensor:
    """Blocks of the gap that a view does not read: all of it, but the retrieved ones.
    verified [...] long -> [...] long."""
    return (left_out_blocks(verified, budget) - budget.retrieved_blocks).clamp(min=0)


def view_block_table(block_table: torch.Tensor, dropped: torch.Tensor, budget: KVBudget
                     ) -> torch.Tensor:
    """The block table of each request's view: the sink blocks, then the blocks after the
    `dropped` ones (`dropped_blocks`). A retrieval view's first `retrieved_blocks` after the
    sink are then the last of its gap, which `retrieved_block_table` replaces with the chosen
    ones. block_table [n, W], dropped [n] -> [n, W] (entries past a request's view length are
    unused)."""
    width = block_table.shape[1]
    index = torch.arange(width, device=block_table.device).expand_as(block_table)
    source = torch.where(index < budget.sink_blocks, index,
                         index + dropped.unsqueeze(1).to(index))
    return block_table.gather(1, source.clamp(max=width - 1))


def retrieved_block_table(view_table: torch.Tensor, block_table: torch.Tensor,
                          retrieved: torch.Tensor, budget: KVBudget) -> None:
    """Writes a retrieval view's chosen blocks (`retrieve`) into its table (`view_block_table`),
    in place, for the requests whose gap holds more than `retrieved_blocks` (the others read
    their whole gap). view_table, block_table [n, W], retrieved [n, C]."""
    cut = (retrieved >= 0).all(-1)
    if cut.any():
        first = budget.sink_blocks
        view_table[cut, first:first + retrieved.shape[1]] = block_table[cut].gather(
            1, retrieved[cut])


def kept_keys(budget: KVBudget | None, verified: int) -> tuple[int, int]:
    """(exact keys in view, memory slots) a draft step reads of one cache holding V verified
    keys; without a view, all of them."""
    if budget is None:
        return verified, 0
    v = torch.tensor([verified])
    exact = verified - int(dropped_blocks(v, budget)) * budget.block_size
    slots = int(memory_chunks(v, budget)) * budget.memory.slots if budget.memory else 0
    return exact, slots
