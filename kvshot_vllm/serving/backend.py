"""Attention metadata for the cross-attention layers that read the target's paged cache.

vLLM's draft metadata lets a row at EAGLE position p see keys [0, p]. A row at position p carries
token p + 1, and a KV-reuse layer attends like the target would for that token: keys [0, p + 1],
where slot p + 1 holds either the target's K/V (a verified token) or the drafter's own K/V, which
the drafter writes there just before it attends (see drafter.py). So the builder here serves
seq_lens + 1 for every draft step, and names the slot of each request's last row: the one token
per request per step that is never verified.

The builder is a subclass of the platform backend's builder (CPU here, FlashAttention on GPUs),
so scheduling metadata is still computed by the backend itself, for the adjusted lengths. A
subclass also gives the cross layers their own attention group in the proposer.

For a block drafter, draft pass 0 also gets the metadata of its whole block (`_build_block`).
A drafter with a `kv_budget` reads a sparse view of the target's cache: the same pages through
a shorter block table (`_in_view`, `models/budget.py`); with `draft_cache`, a hybrid's EAGLE-3
self-attention reads the same view of its own cache (`DraftCacheViewBuilderMixin`). A retrieval
view's length is known here, but which blocks it holds depends on the drafter's query: the
drafter's first attention over target K/V chooses them in draft pass 0 (`RetrievalChoice`),
writing them into that pass's view tables, and the later passes' tables are built with them.
A view with a memory also hands its layers a `MemoryRead`: the view's pages, and the blocks whose
memory slots (kept per physical block, `BlockSummaries`) they attend beside them.
The contract between this builder and the drafter layers is `DraftKVPlan`
(docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Any

import torch

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.budget import (KVBudget, dropped_blocks, left_out_blocks, memory_chunks,
                                       retrieve, retrieved_block_table, view_block_table)
from kvshot_vllm.models.config import DrafterConfig, load_drafter_config

PAD_SLOT = -1


@dataclasses.dataclass
class RetrievalChoice:
    """A retrieval view's blocks for one proposal (`budget.retrieve`): chosen once, in draft
    pass 0, by the drafter's first attention over target K/V (the training side's choice: its
    first group's query of each request's first draft row, against that layer's cache)."""

    budget: KVBudget
    verified: torch.Tensor  # [n] long: V per request
    block_table: torch.Tensor  # [n, W]: the requests' whole block tables
    view_tables: list[torch.Tensor]  # the view tables of pass 0's metadata, patched in place
    summaries: BlockSummaries  # the builder's, kept across proposals
    blocks: torch.Tensor | None = None  # [n, C] block indices once chosen (-1: none)

    def choose(self, query: torch.Tensor, attn) -> None:
        """query [n, H, d] (rotated) of each request's first draft row; attn: the vLLM attention
        layer reading the target layer's paged cache. A no-op once chosen (later layers, later
        passes)."""
        if self.blocks is not None:
            return
        budget, n = self.budget, self.verified.shape[0]
        first = budget.sink_blocks
        gap = int(left_out_blocks(self.verified, budget).max()) if n else 0
        cache = attn.kv_cache
        means = self.summaries.read(
            ("mean key", cache.data_ptr()), cache.shape[0], self.block_table[:, first:first + gap],
            lambda stale: cached_blocks(attn, stale[None], "k")[0, :, 0].float().mean(2))
        means = means.transpose(1, 2)  # [n, KVH, B, d]
        self.blocks = retrieve(query.unsqueeze(1), means, self.verified.unsqueeze(1),
                               budget).squeeze(1)
        for table in self.view_tables:
            retrieved_block_table(table[:n], self.block_table, self.blocks, budget)


class BlockSummaries:
    """Summaries of physical cache blocks computed from their cached K/V (a retrieval view's
    mean keys, a memory's slots), each kept across proposals: a proposal summarises only the
    blocks it has not seen (a new request's prompt, a block that just left the recent window),
    so its cost stops growing with the context.

    A block's K/V change only when something writes them: the target, through the slots of its
    step (`invalidate`, given them at every proposal's pass 0, before any summary is read), or
    a drafter writing its own K/V at positions past the verified ones, which lie in the recent
    window and which the target overwrites before the block can enter a gap. A freed block is
    written by its next owner before it can be read (a prefix-cache hit reuses the same K/V,
    hence the same summary). vLLM skips the proposal of a step with a request near
    max_model_len; the slots that step wrote are not seen, so a block reallocated then may keep
    a stale summary: the drafts are worse, the output is not (every draft is verified)."""

    def __init__(self) -> None:
        # per summary (its key): values [num_blocks, ...], fresh [num_blocks] bool
        self._kept: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = {}

    def invalidate(self, slot_mapping: torch.Tensor, block_size: int) -> None:
        """Forget the summaries of the blocks holding `slot_mapping`'s slots (PAD_SLOT: none)."""
        # nothing summarised yet (a drafter without a retrieval view or a memory): no work in
        # every pass 0
        if not self._kept:
            return
        blocks = torch.div(slot_mapping[slot_mapping >= 0], block_size, rounding_mode="floor")
        for _, fresh in self._kept.values():
            fresh[blocks.long()] = False

    def read(self, key: Hashable, num_blocks: int, blocks: torch.Tensor,
             summarise: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The `key` summaries of `blocks` [...] (entries < 0: none, read as block 0's) of a
        cache of `num_blocks` -> [..., *summary]; summarise(stale [m] long) -> [m, *summary]
        makes those not kept."""
        blocks = blocks.long()
        real = blocks[blocks >= 0]
        kept = self._kept.get(key)
        stale = (real if kept is None else real[~kept[1][real]]).unique()
        if kept is None or stale.numel():
            new = summarise(stale)
            if kept is None:
                kept = self._kept[key] = (
                    new.new_zeros(num_blocks, *new.shape[1:]),
                    torch.zeros(num_blocks, dtype=torch.bool, device=new.device))
            kept[0][stale] = new
            kept[1][stale] = True
        return kept[0][blocks.clamp(min=0)]


@dataclasses.dataclass
class MemoryRead:
    """What a layer whose view has a memory (`KVBudget.memory`, one chunk per cache block)
    reads in one draft pass: the exact keys of the view (sink and recent window, the rows' own
    K/V included) through its block table, and the slots of the blocks it leaves out, kept per
    physical block in `summaries` (`BlockSummaries`)."""

    summaries: BlockSummaries
    block_table: torch.Tensor  # [n, W] the view's blocks
    seq_lens: torch.Tensor  # [n] keys in view (exact), up to and including the last row's
    query_start_loc: torch.Tensor  # [n + 1] the rows of each request in the pass
    chunks: torch.Tensor  # [n, M] the summarised blocks after the sink; -1 past a request's
    # where the view's K/V sit in a cache of each layout (`cached_blocks`): one index serves
    # every layer of the pass
    _exact_index: dict = dataclasses.field(default_factory=dict)

    def exact_kv(self, attn) -> torch.Tensor:
        """The K/V of the view's blocks in `attn`'s cache: [n, 2, KVH, W * block_size, d], W
        the longest view's blocks."""
        cache = attn.kv_cache
        layout = (type(attn.impl), cache.shape, cache.dtype)
        if layout not in self._exact_index:
            width = -(-int(self.seq_lens.max()) // cache.shape[2]) if self.seq_lens.numel() else 0
            self._exact_index[layout] = block_elements(attn, self.block_table[:, :width])
        index = self._exact_index[layout]
        kv = torch.take(cache, index)  # [n, W, 2, KVH, block_size, d]
        return kv.permute(0, 2, 3, 1, 4, 5).flatten(3, 4)


@dataclasses.dataclass
class DraftKVPlan:
    """What a KV-reuse layer needs, beyond vLLM's attention metadata, in one draft pass.

    Row p of a pass carries the token at position p + 1 and attends keys [0, p + 1]. Exactly
    one row per request carries a token whose K/V is not in the cache (the bonus token, a
    draft, or a block row): the layer writes that row's own K/V at its slot, then attends.
    """

    write_rows: torch.Tensor  # [n] long: per request, the index of that row in the pass
    write_slots: torch.Tensor  # [n] long: its cache slot (position S - 1), PAD_SLOT past the
    #                            model length, where vLLM allocated nothing
    # per request, the row carrying its first draft's token (the bonus token): the row whose
    # query chooses a retrieval view
    first_rows: torch.Tensor
    # a retrieval view's choice (pass 0: still to be made)
    retrieval: RetrievalChoice | None = None
    # Pass 0 of a one-block drafter: the metadata of its whole block (`block_layout`), whose
    # own plan writes every block row.
    block: Any | None = None


def draft_plan(metadata: Any) -> DraftKVPlan | None:
    """The plan attached to a layer's attention metadata by `DraftKVBuilderMixin`; None for
    metadata that this builder did not make (dummy and profile runs)."""
    return getattr(metadata, "kvshot_plan", None)


def memory_read(metadata: Any) -> MemoryRead | None:
    """What a layer whose view has a memory reads besides `metadata` (`ViewBuilderMixin`);
    None without a memory, and for metadata that no view builder made (dummy and profile
    runs, which attend through the kernel)."""
    return getattr(metadata, "kvshot_memory", None)


def write_slots(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                max_model_len: int) -> torch.Tensor:
    """Slot of token position seq_len - 1 (the last row's carried token) per request; PAD_SLOT
    past the model length, where vLLM allocated nothing."""
    pos = (seq_lens - 1).long()
    inside = pos < max_model_len
    pos = torch.where(inside, pos, torch.zeros_like(pos))
    blocks = block_table.gather(1, (pos // block_size).unsqueeze(1)).squeeze(1).long()
    slots = blocks * block_size + pos % block_size
    return torch.where(inside, slots, torch.full_like(slots, PAD_SLOT))


class ViewBuilderMixin:
    """A drafter's view of a paged cache (`budget.py`): the same pages, fewer of them."""

    @functools.cached_property
    def _summaries(self) -> BlockSummaries:
        return BlockSummaries()

    def _in_view(self, cad, verified: torch.Tensor):
        """`cad` with each request's block table and key counts cut to the drafter's view of
        its V verified keys: nothing copied. The rows' keys all follow the dropped blocks, so
        the kernel's causal bounds shift with the key counts. A retrieval view's table holds
        the last blocks of the gap where its chosen ones go (`RetrievalChoice`). verified [n]."""
        budget = self._budget
        if budget is None:
            return cad
        n = cad.num_reqs
        dropped = torch.zeros(cad.block_table_tensor.shape[0], dtype=torch.long,
                              device=verified.device)
        dropped[:n] = dropped_blocks(verified.long(), budget)
        seq_lens = cad.seq_lens[:n] - (dropped[:n] * budget.block_size).to(cad.seq_lens.dtype)
        return dataclasses.replace(
            cad, seq_lens=seq_lens, max_seq_len=int(seq_lens.max()) if n else 0,
            block_table_tensor=view_block_table(cad.block_table_tensor, dropped, budget))

    def _build_in_view(self, cad, verified: torch.Tensor):
        """The base builder's draft metadata for `cad` in the drafter's view (all of it without
        a budget), as vLLM's default `build_for_drafting` builds it; with a memory, what the
        layers read besides it (`kvshot_memory`, a `MemoryRead`)."""
        view = self._in_view(cad, verified)
        md = self.build(common_prefix_len=0, common_attn_metadata=view, fast_build=True)
        budget = self._budget
        md.kvshot_memory = None
        if budget is not None and budget.memory is not None:
            n = cad.num_reqs
            summarised = memory_chunks(verified.long(), budget)
            index = torch.arange(int(summarised.max()) if n else 0, device=verified.device)
            chunks = cad.block_table_tensor[:n, budget.sink_blocks:][:, :index.shape[0]].long()
            md.kvshot_memory = MemoryRead(
                self._summaries, view.block_table_tensor[:n], view.seq_lens[:n],
                view.query_start_loc[:n + 1],
                torch.where(index < summarised.unsqueeze(1), chunks, -1))
        return md

    # whose cache the layers of this builder read: the target's, or the drafter's own
    _reads_target: bool

    @functools.cached_property
    def _budget(self) -> KVBudget | None:
        """The drafter's view of this cache (`KVBudget.of_cache`); None: all of it."""
        cfg = drafter_config(self.vllm_config)
        budget = cfg.kv_budget if cfg is not None else None
        return budget.of_cache(target=self._reads_target) if budget is not None else None


class DraftCacheViewBuilderMixin(ViewBuilderMixin):
    """Mixed into the builder of a hybrid's EAGLE-3 self-attention when its budget covers the
    drafter's own cache (`KVBudget.draft_cache`): draft pass j's rows read the view of their
    V = seq_len - j verified keys. In pass 0 every row of a request gets its last row's view;
    rows before it are not sampled, and one layer's K/V, written for every row, do not depend
    on what the layer reads (hence one layer only, `config.py`)."""

    _reads_target = False

    def build_for_drafting(self, common_attn_metadata, draft_index: int):
        cad = common_attn_metadata
        if draft_index == 0:
            # pass 0 writes the drafter's K/V of the step's tokens, at the target's slots
            self._summaries.invalidate(cad.slot_mapping, self.kv_cache_spec.block_size)
        return self._build_in_view(cad, cad.seq_lens[:cad.num_reqs] - draft_index)


class DraftKVBuilderMixin(ViewBuilderMixin):
    """Mixed into a backend's metadata builder; see the module docstring."""

    _reads_target = True

    _block_pass = None  # a one-block drafter's pass-0 metadata, what its later passes get
    _retrieval: RetrievalChoice | None = None  # a retrieval view's choice, this proposal's

    def build_for_drafting(self, common_attn_metadata, draft_index: int):
        if draft_index > 0 and self._block_rows and self._block_pass is not None:
            # Passes 1.. of a one-block drafter attend nothing: they hand out the rows of pass
            # 0's block, so the metadata vLLM asks for is not built again.
            return self._block_pass
        cad = common_attn_metadata
        n = cad.num_reqs
        # one key more than vLLM's rows see: the token each row carries (CPU fix 3 keeps
        # vLLM's own lengths right in every draft step)
        seq_lens = cad.seq_lens[:n] + 1
        cad = dataclasses.replace(cad, seq_lens=seq_lens, max_seq_len=int(seq_lens.max()) if n else 0)
        # draft pass j's last row carries the token at V + j (V: verified length)
        verified = seq_lens - 1 - draft_index
        md = self._build_in_view(cad, verified)
        last_rows = cad.query_start_loc[1 : n + 1].long() - 1
        if draft_index == 0:
            # pass 0's slots are those the target wrote in this step
            self._summaries.invalidate(cad.slot_mapping, self.kv_cache_spec.block_size)
        if self._budget is not None and self._budget.policy == "retrieval":
            if draft_index == 0:
                self._retrieval = RetrievalChoice(self._budget, verified.long(),
                                                  cad.block_table_tensor[:n], [md.block_table],
                                                  self._summaries)
            elif self._retrieval.blocks is not None:
                retrieved_block_table(md.block_table[:n], cad.block_table_tensor[:n],
                                      self._retrieval.blocks, self._budget)
        rows = self._block_rows
        md.kvshot_plan = DraftKVPlan(
            write_rows=last_rows,
            write_slots=write_slots(cad.block_table_tensor[:n], seq_lens,
                                    self.kv_cache_spec.block_size,
                                    self.vllm_config.model_config.max_model_len),
            first_rows=last_rows, retrieval=self._retrieval if draft_index == 0 else None,
            block=self._build_block(cad, rows, verified) if draft_index == 0 and rows else None)
        self._block_pass = md
        return md

    @functools.cached_property
    def _block_rows(self) -> int:
        return block_rows(self.vllm_config)

    def _build_block(self, cad, k: int, verified: torch.Tensor):
        """Metadata for a block drafter's whole proposal in draft pass 0 (`block_layout`)."""
        n = cad.num_reqs
        starts, lens, slots = block_layout(
            cad.seq_lens[:n], cad.block_table_tensor[:n], k, self.kv_cache_spec.block_size,
            self.vllm_config.model_config.max_model_len)
        block = dataclasses.replace(
            cad, query_start_loc=starts.to(cad.query_start_loc.device), query_start_loc_cpu=starts,
            seq_lens=lens, num_actual_tokens=n * k, max_query_len=k,
            max_seq_len=int(lens.max()) if n else 0, slot_mapping=slots, positions=None,
            seq_lens_cpu_upper_bound=None if cad.seq_lens_cpu_upper_bound is None
            else lens.cpu())
        md = self._build_in_view(block, verified)
        retrieval = self._retrieval
        if retrieval is not None:
            retrieval.view_tables.append(md.block_table)
        md.kvshot_plan = DraftKVPlan(write_rows=torch.arange(n * k, device=slots.device),
                                     write_slots=slots,
                                     first_rows=torch.arange(n, device=slots.device) * k,
                                     retrieval=retrieval)
        return md


def block_layout(seq_lens: torch.Tensor, block_table: torch.Tensor, k: int, block_size: int,
                 max_model_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k rows per request in one causal pass, given the step-0 key counts S (`seq_lens`): row j
    writes its own K/V at the slot of position S - 1 + j and sees keys [0, S + j), i.e. the
    target's prefix and block rows 0..j. Returns query starts [n + 1] (int32), key counts [n]
    (the last row's: S + k - 1) and write slots [n * k], rows in request order."""
    n = seq_lens.shape[0]
    slots = torch.stack([write_slots(block_table, seq_lens + j, block_size, max_model_len)
                         for j in range(k)], dim=1).flatten()
    starts = torch.arange(n + 1, dtype=torch.int32) * k
    return starts, (seq_lens + k - 1).to(seq_lens.dtype), slots


def drafter_config(vllm_config) -> DrafterConfig | None:
    """The served drafter's kvshot config; None for other drafters."""
    spec = vllm_config.speculative_config
    kvshot = getattr(spec.draft_model_config.hf_config, "kvshot", None) if spec else None
    return load_drafter_config({"kvshot": kvshot}) if kvshot is not None else None


def block_rows(vllm_config) -> int:
    """Rows per proposal that a block drafter computes in draft pass 0; 0 for other drafters."""
    cfg = drafter_config(vllm_config)
    one_block = cfg is not None and cfg.spec.one_block
    return vllm_config.speculative_config.num_speculative_tokens if one_block else 0


@functools.cache
def draft_backend(base_backend: type, mixin: type) -> type:
    """A subclass of `base_backend` whose builder is `mixin` + the base builder: the cross
    layers' (`DraftKVBuilderMixin`) or a viewed draft cache's (`DraftCacheViewBuilderMixin`).
    A backend of its own also gives those layers their own attention group in the proposer.

    get_name() is inherited: vLLM maps it through AttentionBackendEnum.
    """
    base_builder = base_backend.get_builder_cls()
    prefix = mixin.__name__.removesuffix("BuilderMixin")
    builder = type(f"{prefix}{base_builder.__name__}", (mixin, base_builder), {})
    return type(f"{prefix}{base_backend.__name__}", (base_backend,),
                {"get_builder_cls": staticmethod(lambda: builder), "__module__": __name__})


def cached_blocks(attn, blocks: torch.Tensor, parts: str = "kv") -> torch.Tensor:
    """The keys ("k") and/or values ("v") of `blocks` in `attn`'s paged cache, read in place:
    blocks [...] -> [..., len(parts), KVH, block_size, d], in logical order."""
    return torch.take(attn.kv_cache, block_elements(attn, blocks, parts))


def block_elements(attn, blocks: torch.Tensor, parts: str = "kv") -> torch.Tensor:
    """Where `cached_blocks` reads: indices into `attn`'s flattened cache,
    [..., len(parts), KVH, block_size, d]. Where keys and values sit inside a block is the
    backend's business (the CPU kernels store keys dimension-major); `kv_positions` finds out
    from the backend itself, and only those elements are read."""
    cache = attn.kv_cache
    positions = kv_positions(attn)[["kv".index(part) for part in parts]]
    return blocks.long().view(*blocks.shape, 1, 1, 1, 1) * cache[0].numel() + positions


_kv_positions: dict[tuple, torch.Tensor] = {}


def kv_positions(attn) -> torch.Tensor:
    """Where the backend's cache update puts each key and value element inside a cache block,
    as an index [2 (key, value), KVH, block_size, d] into the block's flattened logical
    [KVH, block_size, 2d] tensor. Found by writing probe K/V (each element's head, token and
    dimension, one at a time: small integers, exact in any float dtype) into a scratch block
    with `attn`'s own update."""
    cache = attn.kv_cache
    kv_heads, block_size, width = cache.shape[1:]
    d = width // 2
    cached = (type(attn.impl), kv_heads, block_size, width, cache.dtype, str(cache.device))
    if cached not in _kv_positions:
        shape = (block_size, kv_heads, d)
        slots = torch.arange(block_size, device=cache.device)
        index = torch.empty(2, kv_heads, block_size, d, dtype=torch.long, device=cache.device)
        for part in range(2):  # key, value
            codes = []
            for axis in (1, 0, 2):  # head, token, dimension
                code = torch.arange(1, shape[axis] + 1, dtype=cache.dtype, device=cache.device)
                code = code.view([-1 if i == axis else 1 for i in range(3)]).expand(shape)
                kv = [torch.zeros(shape, dtype=cache.dtype, device=cache.device)] * 2
                kv[part] = code.contiguous()
                scratch = torch.zeros((1, *cache.shape[1:]), dtype=cache.dtype,
                                      device=cache.device)
                attn.impl.do_kv_cache_update(attn, *kv, scratch, slots)
                codes.append(scratch.flatten().long() - 1)  # -1: not this part's element
            head, token, dim = codes
            where = (head >= 0).nonzero().flatten()
            if where.numel() != kv_heads * block_size * d:
                raise KVShotError(f"cannot locate the keys and values in "
                                  f"{type(attn.impl).__name__}'s cache blocks (a quantized KV "
                                  f"cache?); retrieval views and memories need them")
            index[part, head[where], token[where], dim[where]] = where
        _kv_positions[cached] = index
    return _kv_positions[cached]


def platform_backend() -> type:
    """The backend vLLM uses for the target's attention on this platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return CPUAttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    return FlashAttentionBackend
