"""vLLM drafters that read the target's paged KV cache in place (run with method "eagle3").

A KV-reuse layer attends for the token a row carries (EAGLE's row at position p carries token
p + 1 = q) over keys [0, q]:

    target K/V of verified tokens   read in place from the target layer's paged cache
    draft K/V of the others         the drafter's own projections (bonus token, drafts)

Design choice (a) of docs/architecture.md: the drafter writes its own K/V into the *target* layer's
cache at speculative slots, then one call of vLLM's attention op covers both parts. In each
draft forward exactly one row per request carries a token that is not verified: the last one
(step 0: the bonus token, or in the padded drafter batch a token past the scheduled ones; step
j: draft j). Only that row's K/V is written, at slot q >= V (V = verified length). Such slots
hold only rejected or not-yet-verified data: the target's next pass writes them before it reads
them, prefix caching hashes only blocks of verified tokens, and the scheduler allocated them as
lookahead slots of the same request. Metadata: `backend.py`.

The cross-attention layers are `Attention` layers declared with `kv_sharing_target_layer_name`:
vLLM allocates no cache for them and binds their `kv_cache` to the target layer's tensor.

The layers and their math are the paradigm's own definition (`models/drafter.DraftLayers`), the
one training runs; this module gives it vLLM's paged attention (`PagedAttention`,
`PagedContext`) and vLLM's EAGLE-3 shell (embedding, fc, norm, lm_head, the proposer's hooks).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from torch.library import Library

from vllm.config import CompilationMode, VllmConfig, get_current_vllm_config
from vllm.compilation.decorators import support_torch_compile
from vllm.distributed import (get_tensor_model_parallel_rank,
                              get_tensor_model_parallel_world_size,
                              tensor_model_parallel_all_reduce)
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.logger import init_logger
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import unified_kv_cache_update
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.platforms import current_platform
from vllm.utils.torch_utils import direct_register_custom_op

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.budget import CompressedMemory
from kvshot_vllm.models.config import DrafterConfig, TargetSpec, load_drafter_config
from kvshot_vllm.models.drafter import DraftAttention, check_drafter_weights
from kvshot_vllm.models.files import verify_checkpoint
from kvshot_vllm.models.layers import SelectiveScan, SwiGLU
from kvshot_vllm.models.parallel import Linear, TensorParallel, shard_weights, tensor_parallel
from kvshot_vllm.models.registry import STOCK_EAGLE3_ARCH
from kvshot_vllm.serving.backend import (DraftCacheViewBuilderMixin, DraftKVBuilderMixin,
                                         MemoryRead, block_rows, cached_blocks, draft_backend,
                                         draft_plan, memory_read, platform_backend)
from kvshot_vllm.serving.checks import check_against_target

# Under the "vllm." namespace: loggers outside it are silent in vLLM worker processes.
logger = init_logger(f"vllm.{__name__}")


def _worker_rank() -> TensorParallel:
    """This worker's rank in the served target's tensor-parallel group."""
    return TensorParallel(get_tensor_model_parallel_rank(),
                          get_tensor_model_parallel_world_size(),
                          tensor_model_parallel_all_reduce)


def target_attention_name(layer: int) -> str:
    """vLLM's name of a Llama/Qwen3 target layer's attention (the cache we read)."""
    return f"model.layers.{layer}.self_attn.attn"


# RoPE in place: (positions [T], q [T, heads * d], k [T, kv_heads * d]) -> (q, k)
Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# A draft pass's logits: hidden states [T, hidden] -> [T, vocab]
Logits = Callable[[torch.Tensor], torch.Tensor]


def platform_kernel(op: CustomOp) -> Callable:
    """A vLLM custom op's kernel for this platform. The drafter's layers run eagerly, outside
    the graph vLLM compiles, but vLLM disables its custom ops when it compiles (inductor fuses
    their torch-native forms there); called eagerly, RoPE's native form is a dozen small ops,
    10x the kernel's time at a draft pass's rows (`python bench/rope_kernel.py`)."""
    if current_platform.is_cpu():
        return op.forward_cpu
    if current_platform.is_rocm():
        return op.forward_hip
    return op.forward_cuda if current_platform.is_cuda() else op.forward_native


class PagedDraftAttention(DraftAttention):
    """A drafter attention served over vLLM's paged caches, [T, in] -> [T, hidden]: q/k/v, RoPE
    and o_proj in the drafter's graph, and what lies between (`attend`) behind the custom op
    `kvshot::paged_draft_attention`. What `attend` does depends on this pass's attention
    metadata (the builder's plan, a view's memory), which torch.compile cannot trace; the op
    is opaque to it, as vLLM's own attention op is, so the rest of a layer compiles."""

    # a cross-attention's query and own key sit at the position of the carried token
    position_offset = 0

    def __init__(self, in_size: int, target: TargetSpec, rope: Rotate, groups: int = 1,
                 target_layers: list[int] | None = None,
                 memory: CompressedMemory | None = None) -> None:
        super().__init__(in_size, target, groups, target_layers, memory)
        self.rope = rope

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x)
        q, k = self.rope(positions + self.position_offset, q, k)
        out = x.new_empty(x.shape[0], self.groups * self.heads * self.head_dim)
        torch.ops.kvshot.paged_draft_attention(q, k, v, out, self.op_name)
        return self.o_proj(out)

    @property
    def op_name(self) -> str:
        """The vLLM layer through which the op finds this module (`_owner`)."""
        return self.attns()[0].layer_name

    def attns(self) -> list[Attention]:
        raise NotImplementedError

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor
               ) -> None:
        """q [T, groups * heads * d], k, v [T, groups * kv_heads * d] (rotated) -> out
        [T, groups * heads * d], in this pass's forward context."""
        raise NotImplementedError

    def _own(self) -> None:
        """Make this module the one the op calls for its vLLM layer."""
        object.__setattr__(self.attns()[0], "kvshot_owner", self)


def paged_draft_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          layer_name: str) -> None:
    """`PagedDraftAttention.attend` of the module that owns vLLM layer `layer_name`, found as
    vLLM's attention op finds its layer: in the engine's forward context."""
    layer = get_forward_context().no_compile_layers[layer_name]
    layer.kvshot_owner.attend(q, k, v, out)


def _paged_draft_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, layer_name: str) -> None:
    return None


# The op's library lives as long as the module: the op is unregistered with it.
_KVSHOT_OPS = Library("kvshot", "FRAGMENT")
direct_register_custom_op("paged_draft_attention", paged_draft_attention, mutates_args=["out"],
                          fake_impl=_paged_draft_attention_fake, target_lib=_KVSHOT_OPS)


class TargetKVAttention(PagedDraftAttention):
    """The training side's cross-attention (same projections and weight names), attending
    through vLLM's paged attention op over the target's cache of the sampled layers: one
    attention per sampled layer over that layer's KV heads, outputs concatenated and projected."""

    position_offset = 1

    def __init__(self, in_size: int, target: TargetSpec, kv_layers: list[int], first_index: int,
                 rope: Rotate, cache_config, memory: CompressedMemory | None) -> None:
        super().__init__(in_size, target, rope, len(kv_layers), kv_layers, memory)
        backend = draft_backend(platform_backend(), DraftKVBuilderMixin)
        # One vLLM attention per sampled layer, sharing that target layer's cache. A layer name
        # must hold exactly one integer (vLLM derives the layer index from it).
        self.attn = nn.ModuleList(
            Attention(self.heads, self.head_dim, self.head_dim**-0.5,
                      num_kv_heads=self.kv_heads, cache_config=cache_config,
                      prefix=f"kvshot_cross.{first_index + s}.attn",
                      kv_sharing_target_layer_name=target_attention_name(layer),
                      attn_backend=backend)
            for s, layer in enumerate(kv_layers)
        )
        self._own()

    def attns(self) -> list[Attention]:
        return list(self.attn)

    def attend(self, q, k, v, out) -> None:
        t, groups, d = q.shape[0], self.groups, self.head_dim
        q = q.view(t, groups, self.heads, d)
        k = k.view(t, groups, self.kv_heads, d)
        v = v.view(t, groups, self.kv_heads, d)
        outs = q.new_empty(groups, t, self.heads, d)  # each group's, contiguous for the kernel
        unused_kv = q.new_zeros(t, self.kv_heads, d)  # the cache is the target layer's
        written, memory = None, None
        for s, attn in enumerate(self.attn):
            metadata = _metadata(attn.layer_name)
            plan = draft_plan(metadata)
            if plan is not None and plan.retrieval is not None:
                # the first such layer's first group chooses a retrieval view's blocks
                plan.retrieval.choose(q[plan.first_rows, s], attn)
            if plan is not None:
                if written is None or written[0] is not plan:
                    # every group's K/V of the rows to write, [groups, n, KVH, d] each, once
                    written = (plan, *(z[plan.write_rows].transpose(0, 1).contiguous()
                                       for z in (k, v)))
                attn.impl.do_kv_cache_update(attn, written[1][s], written[2][s], attn.kv_cache,
                                             plan.write_slots)
            read = memory_read(metadata)
            if read is None:
                # the backend's own attention, as vLLM's attention op calls it (the wrappers
                # around that call cost more than the kernel at a draft pass's rows)
                attn.impl.forward(attn, q[:, s], unused_kv, unused_kv, attn.kv_cache, metadata,
                                  output=outs[s])
                continue
            if memory is None:
                memory = memory_slots(self, self.attns(), read)
            outs[s] = attend_with_memory(q[:, s], attn, read, memory[:, :, s])
        out.view(t, groups, self.heads, d).copy_(outs.transpose(0, 1))


class PagedSelfAttention(PagedDraftAttention):
    """The training side's EAGLE-3 self-attention through vLLM's paged op, with a cache of its
    own (the drafter's K/V of every position it has run, as stock EAGLE-3 keeps them)."""

    def __init__(self, in_size: int, target: TargetSpec, layer: int, rope: Rotate,
                 cache_config, viewed: bool, memory: CompressedMemory | None) -> None:
        super().__init__(in_size, target, rope, memory=memory)
        # viewed: it reads the drafter's view of its cache (`KVBudget.draft_cache`)
        backend = draft_backend(platform_backend(), DraftCacheViewBuilderMixin) if viewed else None
        self.attn = Attention(self.heads, self.head_dim, self.head_dim**-0.5,
                              num_kv_heads=self.kv_heads, cache_config=cache_config,
                              prefix=f"model.layers.{layer}.self_attn.attn", attn_backend=backend)
        self._own()

    def attns(self) -> list[Attention]:
        return [self.attn]

    def attend(self, q, k, v, out) -> None:
        read = memory_read(_metadata(self.attn.layer_name))
        if read is None:
            out.copy_(self.attn(q, k, v))
            return
        # the kernel's own write of this pass's K/V, then the view and memory in torch
        unified_kv_cache_update(k.reshape(-1, self.kv_heads, self.head_dim),
                                v.reshape(-1, self.kv_heads, self.head_dim), self.attn.layer_name)
        memory = memory_slots(self, [self.attn], read)[:, :, 0]
        out.copy_(attend_with_memory(q.reshape(-1, self.heads, self.head_dim), self.attn,
                                     read, memory).flatten(1))


def memory_slots(module: DraftAttention, attns: list[Attention], read: MemoryRead
                 ) -> torch.Tensor:
    """The memory slots of the chunks each request's view leaves out (one chunk per cache
    block) of the caches `attns` read, [n, M, len(attns), KVH, slots, 2d] (keys, then values).
    Each block's are made once (`BlockSummaries`) from the K/V cached in it, by `module`'s
    adaptor over every cache's heads side by side, as training makes them."""

    def summarise(blocks: torch.Tensor) -> torch.Tensor:  # [m] -> [m, caches * KVH, slots, 2d]
        kv = torch.cat([cached_blocks(attn, blocks) for attn in attns], dim=2)
        k_mem, v_mem = module.memory(kv[:, 0], kv[:, 1])  # each [m, caches * KVH, slots, d]
        return torch.cat([k_mem, v_mem], dim=-1)

    slots = read.summaries.read(("memory", id(module)), attns[0].kv_cache.shape[0],
                                read.chunks, summarise)
    return slots.unflatten(2, (len(attns), module.kv_heads))


# Requests whose rows in a pass are at most this many (decode passes) attend in one padded
# batch; a pass with a longer one (a prompt's rows) attends request by request.
PADDED_ROWS = 16


def attend_with_memory(q: torch.Tensor, attn, read: MemoryRead, memory: torch.Tensor
                       ) -> torch.Tensor:
    """Attention over a view with a memory (`layers.draft_attention`'s with `memory`): the
    view's exact keys, read in place through its block table, and the memory slots of the
    chunks it leaves out, in one softmax. vLLM's paged op reads one cache through one block
    table, and the CPU op returns no log-sum-exp to merge a second part with, so this runs in
    torch; a step's keys are few (the view's plus `slots` per left-out block).

    q [T, H, d] (rotated); memory [n, M, KVH, slots, 2d] (`memory_slots`, one sampled layer's).
    Row r of a request's R rows sees the view's keys up to its own, seq_len - R + r, as the
    kernel's causal bound, and every slot of its request. -> [T, H, d]."""
    heads, d = q.shape[1:]
    n, kv_heads = memory.shape[0], memory.shape[2]
    exact = read.exact_kv(attn)  # [n, 2, KVH, W * block_size, d]
    width = exact.shape[3]
    slots = memory.permute(0, 2, 1, 3, 4).flatten(2, 3)  # [n, KVH, M * slots, 2d]
    keys = torch.cat([exact[:, 0], slots[..., :d]], dim=2)  # [n, KVH, W * bs + M * slots, d]
    values = torch.cat([exact[:, 1], slots[..., d:]], dim=2)
    starts = read.query_start_loc.long()
    rows = starts[1:] - starts[:-1]
    # per request: its keys in view (the last row's included) and its memory slots
    lens = read.seq_lens.long()
    held = (read.chunks >= 0).sum(-1) * memory.shape[3]
    out = torch.empty_like(q)
    per_request = rows.tolist()
    batches = ([slice(0, n)] if max(per_request, default=0) <= PADDED_ROWS
               else [slice(i, i + 1) for i in range(n) if per_request[i] > 0])
    key = torch.arange(keys.shape[2], device=q.device)
    group = heads // kv_heads
    for batch in batches:
        r = max(per_request[batch])
        row = torch.arange(r, device=q.device)
        real = row < rows[batch, None]  # [b, R]
        index = (starts[batch, None] + row).clamp(max=q.shape[0] - 1)  # [b, R]
        # a row before the view's first key (a long prompt's early rows, never sampled) sees
        # the first one, so that no row attends nothing
        last = (lens[batch, None] - rows[batch, None] + row).clamp(min=0)  # [b, R]
        seen = torch.where(key < width, key <= last.unsqueeze(-1),
                           (key - width < held[batch, None, None]))  # [b, R, keys]
        b = real.shape[0]
        # each KV head's G query heads and R rows as one batch of G * R queries
        qg = q[index].view(b, r, kv_heads, group, d).permute(0, 2, 3, 1, 4)
        scores = qg.reshape(b, kv_heads, group * r, d) @ keys[batch].transpose(2, 3) * d**-0.5
        scores = scores.view(b, kv_heads, group, r, -1).masked_fill(~seen[:, None, None],
                                                                   float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        o = probs.view(b, kv_heads, group * r, -1) @ values[batch]  # [b, KVH, G * R, d]
        o = o.view(b, kv_heads, group, r, d).permute(0, 3, 1, 2, 4).reshape(b, r, heads, d)
        out[index[real]] = o[real]
    return out


class PagedAttention:
    """`AttentionFactory` of serving: vLLM attention layers over paged caches, their layer
    names numbered after the target's layers (each name must be unique and hold one integer)."""

    def __init__(self, cfg: DrafterConfig, rope: Rotate, cache_config) -> None:
        self.target, self.rope, self.cache_config = cfg.target, rope, cache_config
        self.next_cross_index = cfg.target.num_layers + cfg.eagle_layers
        self.view_draft_cache = cfg.kv_budget is not None and cfg.kv_budget.draft_cache
        # the memory adaptor of the attentions over each cache whose view summarises it
        self.memory = {target: cfg.kv_budget.memory if cfg.kv_budget is not None
                       and cfg.kv_budget.summarises(target) else None for target in (True, False)}

    def self_attention(self, in_size: int, layer: int) -> DraftAttention:
        return PagedSelfAttention(in_size, self.target, self.target.num_layers + layer,
                                  self.rope, self.cache_config, self.view_draft_cache,
                                  self.memory[False])

    def cross_attention(self, in_size: int, target_layers: list[int]) -> DraftAttention:
        attn = TargetKVAttention(in_size, self.target, target_layers, self.next_cross_index,
                                 self.rope, self.cache_config, self.memory[True])
        self.next_cross_index += len(target_layers)
        return attn


@dataclass
class PagedContext:
    """`DraftContext` of one vLLM draft pass: the attention metadata of the forward context
    says what each row attends, so a module needs only the rows' positions."""

    positions: torch.Tensor  # [T]
    block_rows: int = 0  # a one-block pass: k rows per request, in order

    def attend(self, attn: DraftAttention, x: torch.Tensor) -> torch.Tensor:
        return attn(x, self.positions)

    def mix(self, scan: SelectiveScan, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """The mixer scans each request's k block rows in order, from their shared cond."""
        k, h = self.block_rows, x.shape[-1]
        return scan.scan(x.view(-1, k, h), cond.view(-1, k, h)[:, 0]).flatten(0, 1)


@contextmanager
def _without_decoder_layers(hf_config) -> Iterator[None]:
    """Inside: vLLM's EAGLE-3 model builds no decoder layers of its own (it builds
    `num_hidden_layers` of them, each with a KV cache); the plugin builds the training side's."""
    layers = hf_config.num_hidden_layers
    hf_config.num_hidden_layers = 0
    try:
        yield
    finally:
        hf_config.num_hidden_layers = layers


@contextmanager
def _block_metadata(layer_names: list[str]) -> Iterator[None]:
    """Inside: these layers attend with their plan's whole-block metadata (`backend.py`)."""
    if not layer_names:
        yield
        return
    mds = get_forward_context().attn_metadata
    mds = mds[0] if isinstance(mds, list) else mds
    saved = {name: mds[name] for name in layer_names}
    mds.update({name: draft_plan(md).block for name, md in saved.items()})
    try:
        yield
    finally:
        mds.update(saved)


# Set to 1: the plugin's layers are served as training runs them, unfused on torch's matmul
# (for side-by-side cost measurements: bench/drafter_cost.py --torch-matmul-too).
TORCH_MATMUL_ENV = "KVSHOT_TORCH_MATMUL"


def fuse_for_decoding(modules: Iterable[nn.Module]) -> None:
    """Once the weights are loaded: projections that read the same input in one matmul each
    (q/k/v, gate/up), every matmul on the platform's kernels (`use_platform_gemm`). A decode
    pass has a few rows, so each matmul costs about a read of its weights plus a call."""
    if os.environ.get(TORCH_MATMUL_ENV) == "1":
        logger.warning("kvshot: %s=1: the drafter's layers run unfused on torch's matmul",
                       TORCH_MATMUL_ENV)
        return
    modules = list(modules)
    for module in modules:
        for part in module.modules():
            if isinstance(part, (DraftAttention, SwiGLU)):
                part.fuse()
    use_platform_gemm(modules)


def use_platform_gemm(modules: Iterable[nn.Module]) -> None:
    """On a CPU, the drafter's linear layers multiply with the kernels vLLM's own layers use
    there (`dispatch_cpu_unquantized_gemm`: oneDNN or sgl with the weights prepacked): at a
    draft pass's row counts a median 2.4x torch's bf16 matmul (`python bench/cpu_gemm.py`).
    Call once the weights are final: the kernels read a packed copy (none is made of a layer
    computed inside a fused one). On GPUs torch's matmul is vLLM's too."""
    if not current_platform.is_cpu():
        return
    for module in modules:
        for linear in module.modules():
            if isinstance(linear, Linear) and not linear.fused_away:
                dispatch_cpu_unquantized_gemm(linear, remove_weight=False)
                linear.gemm = linear.cpu_linear


def _metadata(layer_name: str):
    """This layer's attention metadata in the current forward, None in dummy/profile runs."""
    if not is_forward_context_available():
        return None
    md = get_forward_context().attn_metadata
    md = md[0] if isinstance(md, list) else md
    return md.get(layer_name) if isinstance(md, dict) else None


# Set to 1: the plugin's layers run eagerly where they would be compiled (for side-by-side cost
# measurements: bench/drafter_cost.py --eager-layers-too).
EAGER_LAYERS_ENV = "KVSHOT_EAGER_LAYERS"


def _compiles_drafter_layers(vllm_config: VllmConfig) -> bool:
    """Whether the plugin's layers run compiled: on CPUs, wherever vLLM compiles the target.
    There vLLM traces each model once with dynamo, whole (no CUDA graphs to split for); on
    GPUs its drafter runs in CUDA graphs that the plugin's cache writes are not yet captured
    in (README, known limitations), so the layers stay eager."""
    return (current_platform.is_cpu()
            and vllm_config.compilation_config.mode != CompilationMode.NONE
            and os.environ.get(EAGER_LAYERS_ENV) != "1")


@support_torch_compile(dynamic_arg_dims={"embeds": 0, "hidden": 0, "positions": 0},
                       enable_if=_compiles_drafter_layers)
class DraftLayerStack(nn.Module):
    """A served drafter's own layers (the paradigm's definition) and its final norm, compiled
    as vLLM compiles its own models (`support_torch_compile`: traced once for any number of
    rows, no guards evaluated per call, which at a draft pass's few rows would cost more than
    compiling saves). The attentions stay opaque calls (`kvshot::paged_draft_attention`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", drafter: nn.Module,
                 block_rows: int) -> None:
        super().__init__()
        # not a submodule: the drafter holds this stack, and its weights
        object.__setattr__(self, "drafter", drafter)
        self.block_rows = block_rows

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows embeds, hidden [T, hidden] at positions [T] (a block drafter's: `block_rows`
        a request) -> (the normed output, the hidden state of the next step)."""
        drafter = self.drafter
        out, hidden = drafter.definition.forward(drafter, embeds, hidden,
                                                 PagedContext(positions, self.block_rows))
        return drafter.model.norm(out), hidden


class VerifiedEagle3LlamaForCausalLM(Eagle3LlamaForCausalLM):
    """vLLM's EAGLE-3 drafter, after the checks a kvshot checkpoint allows: its files against a
    shipped drafter's manifest (vLLM's loader reads a corrupt or replaced safetensors file
    without naming it), and its `kvshot` block against the served target. Registered under the
    stock name (`registry.py`), so hidden-only checkpoints also load in vLLM without the plugin,
    unchecked there; other EAGLE-3 checkpoints load as in stock vLLM."""

    # Whether vLLM's own decoder layers run the EAGLE-3 layers (hidden-only checkpoints).
    stock_layers = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        draft = vllm_config.speculative_config.draft_model_config
        if Path(draft.model).is_dir():
            verify_checkpoint(Path(draft.model))
        block = getattr(draft.hf_config, "kvshot", None)
        cfg = load_drafter_config({"kvshot": block}) if block is not None else None
        if cfg is not None and self.stock_layers and cfg.architecture != STOCK_EAGLE3_ARCH:
            # e.g. a kv_budget written into a hidden-only config.json by hand: vLLM's own
            # layers would read the whole cache
            raise KVShotError(f"{draft.model}: its kvshot block is served by the plugin's "
                              f"{cfg.architecture}, but config.json names {STOCK_EAGLE3_ARCH}; "
                              f"let kvshot write config.json (e.g. `kvshot drafter init`)")
        if cfg is not None:
            check_against_target(cfg, vllm_config)
        with nullcontext() if self.stock_layers else _without_decoder_layers(draft.hf_config):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.kvshot = cfg


class KVShotEagle3LlamaForCausalLM(VerifiedEagle3LlamaForCausalLM):
    """KV-only, hybrid and block drafters, and hidden-only ones with a view of their own cache
    (the others are `VerifiedEagle3...`): the paradigm's own layers and math (`DraftLayers`)
    over vLLM's paged attention.

    Subclasses vLLM's EAGLE-3 model because the proposer asserts that class, and reuses its
    fc / norm / lm_head (with d2t) and the proposer's hooks into them.
    """

    stock_layers = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if self.kvshot is None:
            raise KVShotError(f"{vllm_config.speculative_config.draft_model_config.model}: a "
                              f"KVShotLlamaEagle3 checkpoint without its 'kvshot' block")
        target = self.kvshot.target
        stock = {name for name, _ in self.named_children()}
        cache_config = get_current_vllm_config().cache_config
        # The served target's own RoPE (scaling included, e.g. Llama-3.1's), so that drafter
        # queries and keys rotate exactly like the cached target keys they meet.
        target_rope = getattr(vllm_config.model_config.hf_config, "rope_parameters", None)
        self.rope = get_rope(target.head_dim,
                             max_position=vllm_config.model_config.max_model_len + 1,
                             rope_parameters=target_rope or {"rope_theta": target.rope_theta,
                                                             "rope_type": "default"},
                             dtype=vllm_config.model_config.dtype)
        with tensor_parallel(_worker_rank()):
            self._build_layers(vllm_config, cache_config)
        # What this class adds to vLLM's EAGLE-3 model: loaded here by name, the rest by
        # vLLM's loader, which knows the EAGLE-3 names.
        self._own_modules = {name for name, _ in self.named_children()} - stock - {"rope"}
        self._draft_step = 0  # which draft position compute_logits is making
        self._proposals = 0
        if not vllm_config.speculative_config.disable_padded_drafter_batch:
            logger.warning(
                "kvshot: KV-reuse drafter served with the padded drafter batch: after a "
                "rejection the bonus token's own K/V is not yet written when draft 0 is made, "
                "which costs acceptance at position 0 (never correctness). Set "
                '"disable_padded_drafter_batch": true in --speculative-config.')

    def _build_layers(self, vllm_config: VllmConfig, cache_config) -> None:
        """The paradigm's layers, this tensor-parallel rank's shards of them."""
        cfg = self.kvshot
        compiled = _compiles_drafter_layers(vllm_config)
        # compiled: RoPE's torch form, which inductor fuses; eager: the platform's kernel
        rope = self.rope.forward_native if compiled else platform_kernel(self.rope)
        self.definition = cfg.spec.definition  # looked up once: the compiled code reads it
        self.definition.build(self, cfg, PagedAttention(cfg, rope, cache_config))
        self.block_rows = block_rows(vllm_config)
        object.__setattr__(self, "layer_stack", DraftLayerStack(
            vllm_config=vllm_config, drafter=self, block_rows=self.block_rows))
        if cfg.spec.one_block:
            self._max_len = vllm_config.model_config.max_model_len
            self._block: torch.Tensor | None = None  # [n, k, hidden] this proposal's rows
            self._logits: torch.Tensor | None = None  # [n, k, vocab] their logits

    # Called once at the top of every propose(), before draft step 0.
    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self._draft_step = 0
        self._proposals += 1
        return super().combine_hidden_states(hidden_states)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor, inputs_embeds: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.kvshot.spec
        if spec.one_block and self._draft_step > 0:
            return self._block_row(positions.shape[0])
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_input_ids(input_ids)
        if spec.one_block:
            return self._block_forward(inputs_embeds, positions, hidden_states)
        return self.layer_stack(inputs_embeds, hidden_states, positions)

    def _block_forward(self, embeds: torch.Tensor, positions: torch.Tensor,
                       hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft pass 0 of a block drafter computes the whole proposal: per request, k rows at
        positions p .. p + k - 1 (p: the last verified position), row 0 carrying the bonus token
        and rows 1.. the mask, each conditioned on the target's hidden state at p, in one causal
        pass. Passes 1.. hand its rows out (`_block_row`). vLLM's own one-pass proposers
        (parallel_drafting, dflash) prepare their inputs with Triton kernels, which vLLM's CPU
        build lacks, so the block rides on the EAGLE-3 proposer."""
        plan = draft_plan(_metadata(self.kv_layers[0].cross.attn[0].layer_name))
        # Profile and dummy runs have no plan: every row starts a block there (of k rows, the
        # block the compiled layers are traced for).
        last = (plan.write_rows if plan is not None
                else torch.arange(positions.shape[0], device=positions.device))
        k = self.block_rows
        n, h = last.shape[0], embeds.shape[-1]
        rows = torch.stack([self.definition.row_embeds(self, j, embeds[last]) for j in range(k)],
                           1)
        cond = hidden_states[last].unsqueeze(1).expand(n, k, h)
        pos = (positions[last].unsqueeze(1) + torch.arange(k, device=positions.device))
        pos = torch.where(pos < self._max_len, pos, torch.zeros_like(pos)).flatten()
        with _block_metadata(self._cross_layer_names() if plan is not None else []):
            out, _ = self.layer_stack(rows.flatten(0, 1), cond.flatten(0, 1), pos)
        self._block = out.view(n, k, h)
        out = out.new_zeros(positions.shape[0], h)
        out[last] = self._block[:, 0]  # where the proposer samples draft 0
        return out, out

    def _block_row(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Passes 1..: row `_draft_step` of the block, one per request, in the first rows."""
        rows = self._block[:, self._draft_step]
        out = rows.new_zeros(num_tokens, rows.shape[-1])
        out[: rows.shape[0]] = rows
        return out, out

    def _block_logits(self, hidden_states: torch.Tensor, logits_of: Logits) -> torch.Tensor:
        """A block drafter's logits of all k rows in one lm_head call in pass 0 (a small batch
        costs a read of lm_head's weights whatever its rows, so k calls cost about k times
        one); passes 1.. hand out their row. hidden_states [n, hidden]: the rows vLLM samples,
        the block's row `_draft_step` of each request."""
        n, k, _ = self._block.shape
        if hidden_states.shape[0] != n:  # not a proposal's rows (a dummy run): as vLLM would
            return logits_of(hidden_states)
        if self._draft_step == 0:
            self._logits = logits_of(self._block.flatten(0, 1)).unflatten(0, (n, k))
        return self._logits[:, self._draft_step]

    def _cross_layer_names(self) -> list[str]:
        return [attn.layer_name for layer in self.kv_layers for attn in layer.cross.attn]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self._draft_logits(hidden_states, super().compute_logits)

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Greedy drafts with `"use_local_argmax_reduction": true` (the serving configs'): the
        argmax over the draft vocabulary, mapped through d2t (vLLM's `LocalArgmaxMixin`), through
        this drafter's draft positions. vLLM's default scatters every pass's logits over the
        target's vocabulary (49,152 tokens on the embedded target) and takes the argmax there,
        which on a CPU costs more than the draft vocabulary's lm_head."""
        top = self._draft_logits(hidden_states, self._draft_vocab_logits).max(dim=-1).indices
        d2t = self.draft_id_to_target_id
        return top if d2t is None else top + d2t[top]

    def _draft_vocab_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def _draft_logits(self, hidden_states: torch.Tensor, logits_of: Logits) -> torch.Tensor:
        """The logits (`logits_of`'s) of this pass's draft position; the next pass makes the
        next position's."""
        if self.kvshot.spec.one_block and self._block is not None:
            logits = self._block_logits(hidden_states, logits_of)
        else:
            logits = logits_of(hidden_states)
        step, self._draft_step = self._draft_step, self._draft_step + 1
        # Test hook: spoil one draft position on every other proposal, so that a test can see
        # the rejection at exactly that position of vLLM's acceptance counters, and that the
        # next proposal recovers from the stale slots it leaves.
        if step == self.kvshot.sabotage_step and self._proposals % 2 == 0:
            logits = logits.roll(1, dims=-1)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = dict(weights)
        check_drafter_weights(self.kvshot, weights)
        params = dict(self.named_parameters())
        ours = shard_weights(self, {
            n: w for n, w in weights.items()
            if n.split(".")[0] in self._own_modules or "." not in n and n in params})
        for name, w in ours.items():
            with torch.no_grad():
                params[name].copy_(w.to(params[name].dtype))
        super().load_weights((n, w) for n, w in weights.items() if n not in ours)
        fuse_for_decoding(getattr(self, name) for name in self._own_modules)
