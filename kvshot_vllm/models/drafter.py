"""One drafter model for every paradigm, and the interface its math is written against.

A paradigm (`hidden.py`, `kv_only.py`, `hybrid.py`, `block.py`) is a `DraftLayers`: the layers
it adds to a drafter model and their math for one draft step, defined once. Two models run that
definition, each with its own attention back-end:

- training and diagnostics: `Drafter` here, offline attention over cached K/V tensors
  (`OfflineAttention` builds the modules, `OfflineContext` calls them);
- serving: vLLM's drafter (`serving/drafter.py`), the same modules with vLLM's paged attention
  op reading the target's cache in place.

`Drafter` runs a whole draft chain over every position of a sequence at once (test-time
training, TTT): at draft step j, row p carries token p + 1 + j at vLLM position p + j and
predicts token p + 2 + j. What a row may attend is what the vLLM drafter of that row would see
(`layers.draft_attention`): the verified prefix (target K/V of positions <= p, or the drafter's
own step-0 keys of rows <= p) plus the keys this row produced earlier in its own chain.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Protocol

import torch
import torch.nn as nn

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.budget import (CompressedMemory, KVBudget, block_means, kept_keys,
                                       retrieve, rows_verified)
from kvshot_vllm.models.config import (DrafterConfig, TargetSpec, check_fits_target,
                                       load_drafter_config)
from kvshot_vllm.models.layers import RMSNorm, SelectiveScan, draft_attention, rotate
from kvshot_vllm.models.memory import ChunkMemory
from kvshot_vllm.models.parallel import (ColumnParallel, Linear, RowParallel, fused, local_heads,
                                         shard_weights)
from kvshot_vllm.models.files import target_embedding, target_spec, verify_checkpoint


@dataclass
class ChainKV:
    """The K/V one attention module has produced in the current draft chain."""

    ctx: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # self-attention: step-0 keys
    diag: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    # per group: the compressed memory of the context (a view with a memory), made once
    memory: list[tuple[torch.Tensor, torch.Tensor]] | None = None


@dataclass
class RetrievedBlocks:
    """A retrieval view's choice for the current draft chain (`budget.retrieve`): made once, at
    the chain's first step by its first attention over target K/V, and read by all of them."""

    blocks: torch.Tensor | None = None  # [B, R, C] block indices, rows as at step 0

    def choose(self, query: torch.Tensor, keys: torch.Tensor, view: KVBudget) -> torch.Tensor:
        """query [B, R, H, d] of this step's rows, keys [B, KVH, T, d] (group 0's target
        layer) -> the blocks of those rows' views [B, R, C]."""
        r, t = query.shape[1], keys.shape[2]
        if self.blocks is None:
            self.blocks = retrieve(query, block_means(keys, view),
                                   rows_verified(t, r, query.device), view)
        return self.blocks[:, -r:]


@dataclass
class ScanState:
    """The recurrent state one `SelectiveScan` carries down the current draft chain."""

    state: torch.Tensor | None = None

    def advance(self, scan: SelectiveScan, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """x, cond [B, R, hidden] -> the scan's residual update for this step's rows (the last R
        of the rows the state was started with, `Drafter.chain`)."""
        if self.state is None:
            self.state = scan.initial_state(cond)
        y, self.state = scan(x, self.state[:, -x.shape[1]:])
        return y


@dataclass
class TargetFeatures:
    """What the target computed for a batch of sequences (see `training.features`)."""

    input_ids: torch.Tensor  # [B, T] long
    aux_hidden: torch.Tensor | None  # [B, T, len(aux_layers) * hidden]
    target_kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (K, V) [B, KVH, T, d]
    # the target's top K next tokens and their logits, (ids, logits) [B, T, K]: soft targets
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None

    def to(self, device: torch.device | str) -> "TargetFeatures":
        return TargetFeatures(
            self.input_ids.to(device),
            None if self.aux_hidden is None else self.aux_hidden.to(device),
            {layer: (k.to(device), v.to(device)) for layer, (k, v) in self.target_kv.items()},
            None if self.teacher is None else tuple(t.to(device) for t in self.teacher))


class Rope(nn.Module):
    """The target's rotary embedding (scaling included), from its HF config."""

    def __init__(self, target_hf_config) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.inner = LlamaRotaryEmbedding(config=target_hf_config)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, head_dim] in fp32."""
        probe = torch.empty(0, dtype=torch.float32, device=positions.device)
        return self.inner(probe, positions)


class DraftAttention(nn.Module):
    """q/k/v/o projections over `groups` side-by-side attentions (checkpoint names q_proj, ...).

    groups = 1, no `target_layers`: an EAGLE-3 self-attention, whose step-0 keys are the context
    of later steps. groups = S: KVShot's head_concat cross-attention, group s attending the
    cached K/V of target layer `target_layers[s]`; the drafter's own keys of every step join as
    the chain's tail.

    With `memory`, the adaptor (`memory.ChunkMemory`, checkpoint names memory.*) that summarises
    the context a view leaves out, for views with that memory.
    """

    def __init__(self, in_size: int, target: TargetSpec, groups: int = 1,
                 target_layers: list[int] | None = None,
                 memory: CompressedMemory | None = None) -> None:
        super().__init__()
        # heads and KV heads of this tensor-parallel rank (all of them on one rank)
        self.groups, self.head_dim = groups, target.head_dim
        self.target_layers = target_layers  # None: a self-attention
        self.heads = local_heads(target.num_attention_heads, "attention heads")
        self.kv_heads = local_heads(target.num_kv_heads, "KV heads")
        q_size = groups * target.num_attention_heads * self.head_dim
        kv_size = groups * target.num_kv_heads * self.head_dim
        self.q_proj = ColumnParallel(in_size, q_size, groups)
        self.k_proj = ColumnParallel(in_size, kv_size, groups)
        self.v_proj = ColumnParallel(in_size, kv_size, groups)
        self.o_proj = RowParallel(q_size, target.hidden_size, groups)
        self.qkv_proj: Linear | None = None  # `fuse`
        self.memory = (ChunkMemory(groups * self.kv_heads, self.head_dim, memory)
                       if memory is not None else None)

    def fuse(self) -> None:
        """q, k and v projections in one matmul (serving, once the weights are loaded)."""
        self.qkv_proj = fused(self.q_proj, self.k_proj, self.v_proj)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., in] -> q [..., groups * heads * d], k and v [..., groups * kv_heads * d]."""
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv = self.k_proj.out_features
        return self.qkv_proj(x).split([self.q_proj.out_features, kv, kv], dim=-1)

    def target_context(self, target_kv: list[tuple[torch.Tensor, torch.Tensor]], rope: "Rope"
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The context each group attends: head_concat reads every sampled layer as cached."""
        return target_kv

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], chain: ChainKV,
                ctx: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                view: KVBudget | None = None,
                retrieved: RetrievedBlocks | None = None) -> torch.Tensor:
        """x [B, T, in] -> [B, T, hidden]. `ctx`: target K/V per group (cross-attention), or None
        for self-attention (the step-0 keys); `view`: the drafter's view (`budget.py`), of which
        this attention reads its cache's part; None: all. `retrieved`: the chain's choice of a
        retrieval view, made here if not yet made."""
        b, t, _ = x.shape
        cos, sin = rope
        q, k, v = self.project(x)
        q = rotate(q.view(b, t, self.groups * self.heads, self.head_dim), cos, sin)
        k = rotate(k.view(b, t, self.groups * self.kv_heads, self.head_dim), cos, sin)
        v = v.view(b, t, self.groups * self.kv_heads, self.head_dim)
        qs, ks, vs = (z.chunk(self.groups, dim=2) for z in (q, k, v))
        own = list(zip(ks, vs))
        if ctx is None and chain.ctx is None:
            chain.ctx = [(k_.transpose(1, 2), v_.transpose(1, 2)) for k_, v_ in own]
        else:
            chain.diag.append(own)
        ctx = ctx if ctx is not None else chain.ctx
        view = view.of_cache(target=self.target_layers is not None) if view else None
        memory = self.chain_memory(ctx, chain, view)
        blocks = None
        if view is not None and view.policy == "retrieval":
            blocks = retrieved.choose(qs[0], ctx[0][0], view)
        outs = [draft_attention(qs[g], ctx[g], [step[g] for step in chain.diag], view, memory[g],
                                blocks)
                for g in range(self.groups)]
        return self.o_proj(torch.cat(outs, dim=-1))

    def chain_memory(self, ctx: list[tuple[torch.Tensor, torch.Tensor]], chain: ChainKV,
                     view: KVBudget | None) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per group, the memory of the context after the sink that `view` reads (None: a
        view without memory): compressed at the chain's first use, as a served drafter holds
        it before it drafts."""
        if view is None or view.memory is None:
            return [None] * self.groups
        if self.memory is None or (self.memory.chunk, self.memory.slots) != (
                view.memory.chunk_tokens, view.memory.slots):
            raise KVShotError(f"a view with memory {view.memory.model_dump()} needs a drafter "
                              f"trained with that memory (kv_budget.memory)")
        if chain.memory is None:
            k, v = (torch.cat(z, dim=1)[:, :, view.sink_tokens:] for z in zip(*ctx))
            k_mem, v_mem = self.memory(k, v)
            chain.memory = list(zip(k_mem.chunk(self.groups, 1), v_mem.chunk(self.groups, 1)))
        return chain.memory


class LinearKVAttention(DraftAttention):
    """KVShot's "linear" projection: the K/V of all sampled layers, concatenated per position,
    projected to one K/V that a single attention reads. With `reapply_rope` the cached keys are
    rotated back to position 0 before the projection and the result rotated again, so that the
    projection cannot mix rotation phases. Training only: no paged-attention kernel computes it
    in place."""

    def __init__(self, in_size: int, target: TargetSpec, target_layers: list[int],
                 reapply_rope: bool, memory: CompressedMemory | None = None) -> None:
        super().__init__(in_size, target, groups=1, target_layers=target_layers, memory=memory)
        kv = target.num_kv_heads * target.head_dim
        self.k_merge = nn.Linear(len(target_layers) * kv, kv, bias=False)
        self.v_merge = nn.Linear(len(target_layers) * kv, kv, bias=False)
        self.reapply_rope = reapply_rope

    def target_context(self, target_kv, rope):
        b, kvh, t, d = target_kv[0][0].shape
        keys = [k.transpose(1, 2) for k, _ in target_kv]  # [B, T, KVH, d]
        if self.reapply_rope:
            cos, sin = rope(torch.arange(t, device=keys[0].device).expand(b, t))
            keys = [rotate(k, cos, -sin) for k in keys]
        k = self.k_merge(torch.cat([k.reshape(b, t, -1) for k in keys], -1)).view(b, t, kvh, d)
        if self.reapply_rope:
            k = rotate(k, cos, sin)
        v = self.v_merge(torch.cat([v.transpose(1, 2).reshape(b, t, -1) for _, v in target_kv],
                                   -1)).view(b, t, kvh, d)
        return [(k.transpose(1, 2), v.transpose(1, 2))]


# ---------------------------------------------------------------------- the attention back-end


class AttentionFactory(Protocol):
    """Builds a paradigm's attention modules for one back-end (`DraftLayers.build`)."""

    def self_attention(self, in_size: int, layer: int) -> DraftAttention:
        """EAGLE-3 layer `layer`'s self-attention over the drafter's own K/V."""

    def cross_attention(self, in_size: int, target_layers: list[int]) -> DraftAttention:
        """An attention over the cached K/V of `target_layers`, read as they are cached."""


class DraftContext(Protocol):
    """How a paradigm's math calls its attention and recurrent modules in one draft step
    (`DraftLayers.forward`): the part of the math that each back-end does its own way."""

    def attend(self, attn: DraftAttention, x: torch.Tensor) -> torch.Tensor:
        """attn's output [..., hidden] for its input rows x [..., in]."""

    def mix(self, scan: SelectiveScan, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """The recurrent mixer's residual update for rows x, conditioned on cond [..., hidden]."""


class OfflineAttention:
    """`AttentionFactory` of training: plain torch attention over cached K/V tensors."""

    def __init__(self, cfg: DrafterConfig) -> None:
        self.cfg = cfg

    def _memory(self, target: bool) -> CompressedMemory | None:
        """The memory adaptor's config of an attention over the target's cache or the drafter's
        own, where the drafter's view summarises that cache."""
        budget = self.cfg.kv_budget
        return budget.memory if budget is not None and budget.summarises(target) else None

    def self_attention(self, in_size: int, layer: int) -> DraftAttention:
        return DraftAttention(in_size, self.cfg.target, memory=self._memory(target=False))

    def cross_attention(self, in_size: int, target_layers: list[int]) -> DraftAttention:
        memory = self._memory(target=True)
        if self.cfg.kv_projection == "linear":
            return LinearKVAttention(in_size, self.cfg.target, target_layers,
                                     self.cfg.reapply_rope, memory)
        return DraftAttention(in_size, self.cfg.target, len(target_layers), target_layers,
                              memory)


class OfflineContext:
    """`DraftContext` of one training-side draft step: each module attends with the K/V its
    chain has produced so far (`chains`), a cross-attention also over the target's cached K/V
    (`feats`), in the drafter's view of it."""

    def __init__(self, drafter: "Drafter", positions: torch.Tensor, feats: TargetFeatures,
                 chains: dict[nn.Module, ChainKV | ScanState], retrieved: RetrievedBlocks) -> None:
        self.drafter, self.positions, self.feats, self.chains = drafter, positions, feats, chains
        self.retrieved = retrieved

    @cached_property
    def self_rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.drafter.rope(self.positions)

    @cached_property
    def cross_rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        # A row at vLLM position p carries the token at p + 1: its query and own key sit there.
        return self.drafter.rope(self.positions + 1)

    def attend(self, attn: DraftAttention, x: torch.Tensor) -> torch.Tensor:
        chain, view = self.chains[attn], self.drafter.view
        if attn.target_layers is None:
            return attn(x, self.self_rope, chain, view=view)
        ctx = attn.target_context([self.feats.target_kv[i] for i in attn.target_layers],
                                  self.drafter.rope)
        return attn(x, self.cross_rope, chain, ctx=ctx, view=view, retrieved=self.retrieved)

    def mix(self, scan: SelectiveScan, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return self.chains[scan].advance(scan, x, cond)


# ---------------------------------------------------------------------- paradigms and the model


class DraftLayers:
    """A paradigm's definition: the layers it adds to a drafter model and their math for one
    draft step. Stateless; the layers live on the model (`Drafter`, or vLLM's drafter), under
    their checkpoint names. Subclasses register with `registry.register_paradigm`.

    A drafter model brings the rest: the embedding, `fc` over the target's aux hidden states
    (paradigms that use them), the final norm and lm_head.
    """

    def build(self, model: nn.Module, cfg: DrafterConfig, attention: AttentionFactory) -> None:
        """Add this paradigm's layers to `model`, their attention modules from `attention`."""
        raise NotImplementedError

    def row_embeds(self, model: nn.Module, j: int, embeds: torch.Tensor) -> torch.Tensor:
        """What the rows of draft step j (block row j) carry, given their tokens' embeddings."""
        return embeds

    def forward(self, model: nn.Module, embeds: torch.Tensor, hidden: torch.Tensor | None,
                ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for rows [..., hidden]: embeds, the hidden input (step 0: fc of the
        aux hidden states; later: what the previous step returned) -> (the output before the
        final norm, the hidden input of the next step)."""
        raise NotImplementedError


class Drafter(nn.Module):
    """The training-side drafter of any paradigm: the target's (frozen) embedding and RoPE, fc
    over the aux hidden states (paradigms that use them), final norm, lm_head over the draft
    vocabulary and d2t, plus the paradigm's layers (`DraftLayers`) with offline attention."""

    def __init__(self, cfg: DrafterConfig, target_hf_config, embed: torch.Tensor) -> None:
        super().__init__()
        t = cfg.target
        self.cfg = cfg
        self.definition = cfg.spec.definition  # the paradigm's layers and math
        self.register_buffer("embed", embed.detach().float(), persistent=False)
        self.rope = Rope(target_hf_config)
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.lm_head = nn.Linear(t.hidden_size, cfg.draft_vocab_size, bias=False)
        if cfg.spec.uses_aux_hidden:
            self.fc = nn.Linear(len(cfg.aux_layers) * t.hidden_size, t.hidden_size, bias=False)
        self.definition.build(self, cfg, OfflineAttention(cfg))
        # draft id i -> target id i + d2t[i] (EAGLE-3's convention, read by vLLM)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        # the view of the K/V that attention reads (`budget.py`); None: all
        self.view = cfg.kv_budget

    @contextmanager
    def viewing(self, view: KVBudget | None) -> Iterator[None]:
        """Inside: the cross-attention reads `view` of the target's K/V, and with
        `view.draft_cache` the self-attention the same view of its own (multi-view training)."""
        kept, self.view = self.view, view
        try:
            yield
        finally:
            self.view = kept

    def draft_side_bytes(self, prefix: int, dtype_bytes: int = 2) -> int:
        """The K/V bytes a request's prefix of `prefix` verified tokens needs on the drafter's
        side under its view: each self-attention's own cache (all of it, or the view's exact
        keys plus memory slots, where a served view frees what it leaves out) and the memory
        slots of each summarised target cache (whose exact keys are read in place)."""
        total = 0
        for m in self.modules():
            if not isinstance(m, DraftAttention):
                continue
            target = m.target_layers is not None
            exact, slots = kept_keys(self.view.of_cache(target) if self.view else None, prefix)
            held = slots if target else exact + slots
            total += held * 2 * m.groups * m.kv_heads * m.head_dim * dtype_bytes  # K and V
        return total

    def new_chains(self) -> dict[nn.Module, ChainKV | ScanState]:
        return {m: ChainKV() if isinstance(m, DraftAttention) else ScanState()
                for m in self.modules() if isinstance(m, (DraftAttention, SelectiveScan))}

    def chain(self, feats: TargetFeatures, steps: int, first_row: int = 0) -> list[torch.Tensor]:
        """Normed outputs [B, R, hidden] of `steps` draft steps, for the last R rows; at step j
        row p drafts token p + 2 + j, given tokens up to p + 1 + j (rows past the end carry
        padding). Rows before `first_row` are not computed (R = T - first_row), but in step 0 of
        a drafter with self-attention, whose later steps attend the step-0 keys of the whole
        prefix: training skips rows without loss."""
        ids = feats.input_ids
        b, t = ids.shape
        hidden = self.fc(feats.aux_hidden) if self.cfg.spec.uses_aux_hidden else None
        chains, retrieved = self.new_chains(), RetrievedBlocks()
        outs = []
        for j in range(steps):
            start = 0 if j == 0 and self.cfg.spec.self_attention else first_row
            tokens = torch.zeros_like(ids)
            tokens[:, : max(t - 1 - j, 0)] = ids[:, 1 + j:]
            positions = torch.arange(j, t + j, device=ids.device).expand(b, t)[:, start:]
            if hidden is not None:
                hidden = hidden[:, start - t:]
            embeds = self.definition.row_embeds(self, j, self.embed[tokens[:, start:]])
            out, hidden = self.definition.forward(
                self, embeds, hidden, OfflineContext(self, positions, feats, chains, retrieved))
            outs.append(self.norm(out))
        return outs

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_ids(self) -> torch.Tensor:
        """[target vocab]: each target token's draft id, -1 where the draft vocabulary lacks
        it (`target_ids` inverted)."""
        vd = self.cfg.draft_vocab_size
        t2d = torch.full((self.cfg.target.vocab_size,), -1, dtype=torch.long,
                         device=self.d2t.device)
        t2d[self.target_ids(torch.arange(vd, device=self.d2t.device))] = torch.arange(
            vd, device=self.d2t.device)
        return t2d

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """Tensors under the checkpoint names of `expected_shapes`."""
        weights = {n: p.detach().cpu() for n, p in self.named_parameters()
                   if not n.startswith("rope.")}
        if self.cfg.draft_vocab_size != self.cfg.target.vocab_size:
            weights["d2t"] = self.d2t.cpu()
        return weights

    def load_checkpoint_weights(self, weights: dict[str, torch.Tensor]) -> None:
        check_drafter_weights(self.cfg, weights)
        weights = shard_weights(self, weights)
        if "d2t" in weights:
            self.d2t.copy_(weights.pop("d2t"))
        self.load_state_dict(weights, strict=False)


def build_drafter(cfg: DrafterConfig, target_dir: Path) -> Drafter:
    """The training-side drafter of `cfg.paradigm` for the target in `target_dir`."""
    from transformers import AutoConfig

    check_fits_target(cfg, target_spec(target_dir))
    return Drafter(cfg, AutoConfig.from_pretrained(target_dir), target_embedding(target_dir))


def load_drafter(checkpoint: Path, target_dir: Path) -> Drafter:
    """A trained checkpoint (config.json + model.safetensors) as a training-side drafter."""
    from safetensors.torch import load_file

    verify_checkpoint(checkpoint)
    cfg = load_drafter_config(checkpoint)
    weights_file = Path(checkpoint) / "model.safetensors"
    if not weights_file.is_file():
        raise KVShotError(f"no model.safetensors in {checkpoint}")
    drafter = build_drafter(cfg, target_dir)
    drafter.load_checkpoint_weights(load_file(weights_file))
    return drafter


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes: the parameters of the paradigm's own module (built on the
    meta device, which allocates nothing), plus d2t where the draft vocabulary is reduced. So
    the modules declare their weights, and a checkpoint holds exactly what they own."""
    from transformers import LlamaConfig

    t = cfg.target
    shape_only = LlamaConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_kv_heads, head_dim=t.head_dim, vocab_size=t.vocab_size,
        rms_norm_eps=t.rms_norm_eps,
        rope_parameters={"rope_theta": t.rope_theta, "rope_type": "default"})
    with torch.device("meta"):
        drafter = Drafter(cfg, shape_only, torch.empty(t.vocab_size, t.hidden_size))
    shapes = {name: tuple(p.shape) for name, p in drafter.named_parameters()}
    if cfg.draft_vocab_size != t.vocab_size:
        shapes["d2t"] = (cfg.draft_vocab_size,)
    return shapes


def check_drafter_weights(cfg: DrafterConfig, weights: dict[str, torch.Tensor]) -> None:
    """Every expected tensor present with its shape, and no other; a clear error otherwise."""
    expected = expected_shapes(cfg)
    unknown = sorted(set(weights) - set(expected))
    if unknown:
        raise KVShotError(f"drafter checkpoint has weight {unknown[0]!r}, which no "
                          f"{cfg.paradigm} drafter owns" + (f" (and {len(unknown) - 1} more)"
                                                            if len(unknown) > 1 else ""))
    for name, shape in expected.items():
        if name not in weights:
            raise KVShotError(f"drafter checkpoint is missing weight {name!r} "
                              f"(paradigm {cfg.paradigm})")
        if tuple(weights[name].shape) != shape:
            raise KVShotError(f"drafter weight {name!r} has shape {tuple(weights[name].shape)}, "
                              f"expected {shape}")
