"""Autoregressive test-time training (TTT) of a drafter, resumable after a kill.

Each batch runs the drafter's 7-step chain over every position (`Drafter.chain`); step j is
scored against the target's greedy token at p + 2 + j with weight 0.8^j. AdamW, linear warmup
then cosine decay, gradient clipping, bf16 autocast where the CPU has native bf16.

A run directory holds:
    run.json        the drafter config, the training config and the features it trains on
    state.pt        model, optimizer, schedule and step (every `checkpoint_every` steps, on
                    Ctrl-C and on SIGTERM); a rerun continues from it and gives the same weights
                    as a run that was never interrupted
    metrics.jsonl   one line per log interval: loss and accuracy per draft step, learning rate,
                    gradient norms of the query and K/V projections, the hybrid's gate
    checkpoint/     config.json + model.safetensors that vLLM loads, refreshed with state.pt
    snapshots/      with `snapshot_every`: step-N/, the checkpoint after N steps, the points
                    of the learning curve (`training.curve`)
"""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from safetensors import safe_open

from kvshot_vllm.allocator import memory_is_low, release_freed_memory
from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.budget import KVBudget
from kvshot_vllm.models.config import DrafterConfig, validated
from kvshot_vllm.models.drafter import Drafter, TargetFeatures, build_drafter
from kvshot_vllm.models.files import checkpoint_files, tensor_file
from kvshot_vllm.models.weights import save_checkpoint
from kvshot_vllm.training.features import SplitFeatures
from kvshot_vllm.training.schedule import TrainingData

# one line per log interval in a run directory (and in a drafter `kvshot ship` made of it)
METRICS_LOG = "metrics.jsonl"


class MultiView(BaseModel):
    """BudgetDraft's multi-view training: each step also runs the chain under one sparse view
    of the target's K/V, its budget drawn from `budgets`, and aligns that view's draft
    distribution with the full view's (KL, weight `weight`), so that one drafter serves any
    budget (`budget.py`) at little loss of acceptance."""

    model_config = ConfigDict(extra="forbid")

    # budget in tokens -> probability (BudgetDraft's distribution)
    budgets: dict[int, float] = Field(default_factory=lambda: {256: 0.4, 512: 0.3, 1024: 0.2,
                                                               2048: 0.1})
    weight: float = Field(0.5, ge=0)
    # the block size of the cache the drafter will be served from (a view is whole blocks)
    block_size: int = Field(32, gt=0)
    sink_tokens: int | None = None
    # the views also cover the drafter's own self-attention cache (`KVBudget.draft_cache`)
    draft_cache: bool = False
    # which blocks a view keeps (`KVBudget.policy`)
    policy: Literal["streaming", "retrieval"] = "streaming"

    @model_validator(mode="after")
    def _valid_views(self) -> "MultiView":
        if not self.budgets or min(self.budgets.values()) <= 0:
            raise ValueError(f"budgets {self.budgets}: give at least one, each with a "
                             f"probability > 0")
        for tokens in self.budgets:  # each must make a view
            self.view(tokens)
        return self

    def view(self, tokens: int) -> KVBudget:
        return KVBudget(tokens=tokens, block_size=self.block_size, sink_tokens=self.sink_tokens,
                        draft_cache=self.draft_cache, policy=self.policy)

    def draw(self, seed: int, step: int) -> KVBudget:
        """The view of optimizer step `step`: a function of the step, so a resumed run draws
        what an uninterrupted one does."""
        g = torch.Generator().manual_seed(seed * 100003 + step + 7)
        tokens = list(self.budgets)
        i = int(torch.multinomial(torch.tensor([self.budgets[t] for t in tokens]), 1,
                                  generator=g))
        return self.view(tokens[i])


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(ge=1, description="optimizer steps")
    batch_size: int = Field(4, ge=1, description="sequences per step")
    ttt_steps: int = Field(7, ge=1, le=16)
    step_weight: float = Field(0.8, gt=0)
    lr: float = Field(1e-3, gt=0)
    warmup: int = Field(20, ge=0)
    weight_decay: float = 0.0
    clip: float = Field(0.5, gt=0)
    draft_vocab_size: int | None = Field(8192, description="None: the target's vocabulary")
    autocast: bool | None = Field(None, description="bf16 autocast; None: where native")
    bucket: int = Field(32, ge=1, description="batches per length bucket (`batch_order`); "
                        "1: batches of random lengths")
    loss_rows_only: bool = Field(True, description="compute the chain only for the rows a "
                                 "draft step scores (`first_scored_row`); False: every row, "
                                 "for comparison (bench/train_speed.py)")
    checkpoint_every: int = Field(50, ge=1)
    snapshot_every: int | None = Field(None, ge=1, description="also keep the servable "
                                       "checkpoint every N steps under snapshots/ "
                                       "(`kvshot curve`)")
    log_every: int = Field(10, ge=1)
    seed: int = 0
    soft_targets: int = Field(0, ge=0, le=256, description="0: cross-entropy against the "
                              "target's greedy token; K: against the target's distribution over "
                              "its K most likely tokens in the draft vocabulary (soft targets, as "
                              "speculators trains), from features that hold them")
    multi_view: MultiView | None = Field(None, description="also train sparse views of the "
                                         "target's K/V (`MultiView`)")
    objective: Literal["ttt", "distill"] = Field(
        "ttt", description="ttt: cross-entropy against the target's tokens; distill: KL of the "
        "chain under the drafter's kv_budget (with a memory) from the same drafter's chain over "
        "the full K/V, the teacher (issue 16)")
    train: Literal["all", "memory"] = Field(
        "all", description="memory: only the memory adaptors learn; the rest stays as the "
        "warm start gave it (and the full-view teacher of `distill` with it)")

    @model_validator(mode="after")
    def _distill_memory_only(self) -> "TrainConfig":
        if self.objective == "distill" and self.train != "memory":
            raise ValueError("objective 'distill' trains the memory adaptor against the drafter's "
                             "own full view, which must stay fixed: set train 'memory'")
        return self


# Sized for the embedded default on 2 CPU cores: quick for the demo and tests (minutes); full
# for the data set of `make data-scale` (3,417 sequences): 480 steps of 8 sequences, 1.1
# epochs, about half an hour on 2 cores at the throughput of bench/results/train_speed.md (the
# learning curve of `make train-scale` says how far that is from a plateau).
PRESETS = {
    "quick": TrainConfig(steps=30, batch_size=2, draft_vocab_size=4096, lr=2e-3, warmup=5,
                         checkpoint_every=10, log_every=5),
    "full": TrainConfig(steps=480, batch_size=8, draft_vocab_size=8192, lr=2e-3, warmup=30,
                        checkpoint_every=25, log_every=10),
}


# ----------------------------------------------------------------------------- loss


def shifted(x: torch.Tensor, by: int, fill=0) -> torch.Tensor:
    """x[:, p + by] at column p (fill past the end): the label of draft step by - 1."""
    out = torch.full_like(x, fill)
    if by < x.shape[1]:
        out[:, : x.shape[1] - by] = x[:, by:]
    return out


def first_scored_row(trainable: torch.Tensor, steps: int) -> int:
    """The first row any of `steps` draft steps scores: row p of step j is scored by the label
    at p + 1 + j, so rows before (first trainable position) - steps never are. On multi-turn
    data most rows are prompt, and this is most of the chain's work."""
    scored = trainable.any(0).nonzero()
    return max(0, int(scored[0]) - steps) if len(scored) else 0


def chain_predictions(drafter: Drafter, feats: TargetFeatures, labels: torch.Tensor,
                      trainable: torch.Tensor, steps: int, all_rows: bool = False):
    """Per draft step j: (logits over the draft vocabulary of the scored rows, their target
    labels, hit [B, R]: the draft equals the target's greedy token, scored-row mask [B, R]),
    for the last R rows that the chain computes (all of them with `all_rows`)."""
    out = []
    first_row = 0 if all_rows else first_scored_row(trainable, steps)
    for j, normed in enumerate(drafter.chain(feats, steps, first_row)):
        r = normed.shape[1]
        mask = shifted(trainable, 1 + j, False)[:, -r:]
        target = shifted(labels, 1 + j)[:, -r:][mask]
        logits = drafter.lm_head(normed[mask])
        hit = torch.zeros_like(mask)
        # max's indices are argmax's (the first of tied maxima), by a faster kernel on CPUs
        hit[mask] = drafter.target_ids(logits.max(-1).indices) == target
        out.append((logits, target, hit, mask))
    return out


def ttt_loss(drafter: Drafter, feats: TargetFeatures, labels: torch.Tensor,
             trainable: torch.Tensor, cfg: TrainConfig, t2d: torch.Tensor,
             view: KVBudget | None = None) -> tuple[torch.Tensor, list[float]]:
    """Weighted cross-entropy over the chain, and the accuracy of each step. Targets outside
    the draft vocabulary (t2d = -1) leave the loss but count as misses, as in vLLM.

    With a sparse `view` (multi-view training), plus `cfg.multi_view.weight` times the
    step-weighted KL divergence of the chain under that view from the full view's, whose
    distribution is the teacher (no gradient through it). With `cfg.objective` distill, that
    divergence alone, of the drafter's own view from its full view."""
    all_rows = not cfg.loss_rows_only
    if cfg.objective == "distill":
        with torch.no_grad(), drafter.viewing(None):
            teacher = [p[0] for p in chain_predictions(drafter, feats, labels, trainable,
                                                       cfg.ttt_steps, all_rows)]
        student = chain_predictions(drafter, feats, labels, trainable, cfg.ttt_steps, all_rows)
        accs = [hit[mask].float().mean().item() if mask.any() else float("nan")
                for _, _, hit, mask in student]
        return chain_kl(student, teacher, cfg), accs
    total, weights, accs, full = 0.0, 0.0, [], []
    for j, (logits, target, hit, mask) in enumerate(
            chain_predictions(drafter, feats, labels, trainable, cfg.ttt_steps, all_rows)):
        if cfg.soft_targets:
            # the top K of features that may hold more (sorted, most likely first)
            teacher = (shifted(t[..., :cfg.soft_targets], 1 + j)[:, -mask.shape[1]:][mask]
                       for t in feats.teacher)
            step_loss = soft_cross_entropy(logits, *teacher, t2d)
        else:
            step_loss = hard_cross_entropy(logits, target, t2d)
        if step_loss is not None:
            total = total + cfg.step_weight**j * step_loss
            weights += cfg.step_weight**j
        accs.append(hit[mask].float().mean().item() if mask.any() else float("nan"))
        full.append(logits)
    loss = total / max(weights, 1e-9)
    if view is None:
        return loss, accs
    with drafter.viewing(view):
        sparse = chain_predictions(drafter, feats, labels, trainable, cfg.ttt_steps, all_rows)
    return loss + cfg.multi_view.weight * chain_kl(sparse, full, cfg), accs


def hard_cross_entropy(logits: torch.Tensor, target: torch.Tensor, t2d: torch.Tensor
                       ) -> torch.Tensor | None:
    """Cross-entropy of draft logits [N, draft vocab] against the target's tokens [N] that are
    in the draft vocabulary (None: none is), in fp32. The other rows are ignored, not cut out: a
    boolean index would copy the logits, forward and backward."""
    draft_label = t2d[target]  # -1: not in the draft vocabulary
    if not (draft_label >= 0).any():
        return None
    return F.cross_entropy(logits.float(), draft_label, ignore_index=-1)


def soft_cross_entropy(logits: torch.Tensor, teacher_ids: torch.Tensor,
                       teacher_logits: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor | None:
    """Cross-entropy of draft logits [N, draft vocab] against the target's distribution, known
    over its top K tokens (teacher_ids, teacher_logits [N, K]) and renormalised over those in
    the draft vocabulary; a row with none of them leaves the loss (None: every row does). The
    draft vocabulary cannot hold the rest, so this is the KL divergence from the target's
    distribution as the draft vocabulary sees it, up to the teacher's entropy."""
    draft_ids = t2d[teacher_ids]
    inside = draft_ids >= 0
    keep = inside.any(-1)
    if not keep.any():
        return None
    probs = torch.softmax(teacher_logits[keep].float().masked_fill(~inside[keep], float("-inf")),
                          dim=-1)
    log_q = torch.log_softmax(logits[keep].float(), -1).gather(-1, draft_ids[keep].clamp(min=0))
    return -(probs * log_q).sum(-1).mean()


def chain_kl(student: list, teacher: list[torch.Tensor], cfg: TrainConfig) -> torch.Tensor:
    """Step-weighted KL divergence of a chain's draft distributions (`chain_predictions`) from
    the teacher's logits of the same rows, no gradient through the teacher; averaged over the
    weights of the steps that have rows."""
    kl, weights = 0.0, 0.0
    for j, ((logits, *_), target) in enumerate(zip(student, teacher)):
        if len(logits):
            kl = kl + cfg.step_weight**j * F.kl_div(
                F.log_softmax(logits.float(), -1), F.log_softmax(target.detach().float(), -1),
                log_target=True, reduction="batchmean")
            weights += cfg.step_weight**j
    return kl / max(weights, 1e-9)


# ----------------------------------------------------------------------------- vocabulary


def draft_vocabulary(features: SplitFeatures | TrainingData, size: int, vocab_size: int
                     ) -> torch.Tensor:
    """EAGLE-3's reduced vocabulary: the `size` tokens the target emits most often in the
    training responses, as d2t [size] (draft i -> target i + d2t[i])."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for labels in features.response_labels():
        counts += torch.bincount(labels.long(), minlength=vocab_size)
    return as_d2t(counts.topk(size).indices)


def grown_vocabulary(d2t: torch.Tensor, size: int, counts: torch.Tensor) -> torch.Tensor:
    """A draft vocabulary of `size` tokens that keeps every token of `d2t` and adds the most
    frequent others of `counts` (a warm start's vocabulary grown: its trained rows keep their
    tokens)."""
    kept = torch.arange(len(d2t)) + d2t
    others = counts.clone()
    others[kept] = -1
    return as_d2t(torch.cat([kept, others.topk(size - len(d2t)).indices]))


def as_d2t(token_ids: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's d2t of a set of target tokens: sorted, draft i -> target i + d2t[i]."""
    keep = token_ids.sort().values
    return keep - torch.arange(len(keep))


# ----------------------------------------------------------------------------- statistics


def grad_stats(drafter: Drafter) -> dict[str, float]:
    """Gradient RMS of query and K/V projections (the study's "sparse gradients" of draft-side
    K/V): cross.* for the KV-reuse attention, self.* for EAGLE-3's self-attention."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, p in drafter.named_parameters():
        if p.grad is None or "_proj" not in name or "attn" not in name and "cross" not in name:
            continue
        kind = "cross" if "cross" in name else "self"
        proj = name.split(".")[-2]
        if proj in ("q_proj", "k_proj", "v_proj"):
            groups.setdefault(f"{kind}.{'q' if proj == 'q_proj' else 'kv'}", []).append(p.grad)
    return {k: math.sqrt(sum(float(g.pow(2).sum()) for g in gs) / sum(g.numel() for g in gs))
            for k, gs in groups.items()}


def gate_stats(drafter: Drafter) -> dict[str, float] | None:
    merge = getattr(drafter, "merge", None)
    if merge is None:
        return None
    g = merge.gate.detach().float().cpu()
    q = torch.quantile(g, torch.tensor([0.1, 0.5, 0.9]))
    return {"mean": float(g.mean()), "abs_mean": float(g.abs().mean()), "p10": float(q[0]),
            "p50": float(q[1]), "p90": float(q[2])}


# ----------------------------------------------------------------------------- training


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def warm_start(drafter: Drafter, checkpoint: Path) -> list[str]:
    """Copy every tensor of `checkpoint` whose name and shape match (EAGLE-3 / speculators
    names, `midlayer.` read as `layers.0.`); returns the names left fresh."""
    from safetensors.torch import load_file

    files = checkpoint_files(checkpoint)
    if not files:
        raise KVShotError(f"no safetensors weights at {checkpoint}")
    src: dict[str, torch.Tensor] = {}
    for f in files:
        src |= {n.replace("midlayer.", "layers.0."): t for n, t in load_file(f).items()}
    own = dict(drafter.named_parameters())
    taken = []
    if "d2t" in src and src["d2t"].shape == drafter.d2t.shape:
        drafter.d2t.copy_(src.pop("d2t"))
    elif "d2t" in src:  # a grown vocabulary (`grown_vocabulary`): rows move to their tokens
        theirs = src.pop("d2t")
        rows = drafter.draft_ids()[torch.arange(len(theirs)) + theirs]
        if (rows < 0).any():
            raise KVShotError(f"warm start {checkpoint} has a draft vocabulary of "
                              f"{len(theirs)} that this drafter's {len(drafter.d2t)} does not "
                              f"hold (a warm start may grow its vocabulary, not change it)")
        with torch.no_grad():
            drafter.lm_head.weight[rows] = src.pop("lm_head.weight").float()
        taken.append("lm_head.weight")
    with torch.no_grad():
        for name, tensor in src.items():
            if name in own and own[name].shape == tensor.shape:
                own[name].copy_(tensor.float())
                taken.append(name)
    if not any(n.startswith(("layers.", "kv_layers.", "fc.")) for n in taken):
        raise KVShotError(f"warm start {checkpoint} shares no layer weights with this drafter")
    return sorted(set(own) - set(taken))


class Trainer:
    def __init__(self, run_dir: Path, drafter_cfg: DrafterConfig, cfg: TrainConfig,
                 target_dir: Path, data: SplitFeatures | TrainingData,
                 init: Path | None = None, device: str = "cpu") -> None:
        self.run_dir, self.cfg = Path(run_dir), cfg
        self.data = data if isinstance(data, TrainingData) else TrainingData([data])
        self.device = torch.device(device)
        self.data.check_layers(drafter_cfg.aux_layers, drafter_cfg.kv_layers,
                              drafter_cfg.uses_aux_hidden)
        if cfg.multi_view and not (drafter_cfg.spec.reads_target_kv or cfg.multi_view.draft_cache):
            raise KVShotError(f"multi-view training: a {drafter_cfg.paradigm} drafter reads no "
                              f"target KV; its views can only cover its own cache "
                              f"(--view-draft-cache)")
        if cfg.multi_view and drafter_cfg.kv_budget:
            raise KVShotError("multi-view training trains the full view with sparse ones: "
                              "drop the drafter's kv_budget")
        if cfg.multi_view and cfg.multi_view.draft_cache:  # a view the drafter can be served with
            validated({**drafter_cfg.model_dump(), "kv_budget": cfg.multi_view.draw(0, 0)},
                      "multi-view")
        if cfg.soft_targets > self.data.teacher_topk:
            raise KVShotError(f"soft targets over the top {cfg.soft_targets} tokens need "
                              f"features that hold them; "
                              f"{', '.join(str(p.path) for p in self.data.parts)} hold "
                              f"{self.data.teacher_topk}")
        has_memory = drafter_cfg.kv_budget is not None and drafter_cfg.kv_budget.memory
        if cfg.train == "memory" and not has_memory:
            raise KVShotError("train 'memory': the drafter has no memory adaptor to train (give "
                              "it a kv_budget with a memory)")
        if cfg.train == "memory" and init is None:
            raise KVShotError("train 'memory': the rest of the drafter stays as it is, so warm "
                              "start it from a trained checkpoint (--init)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        run = {"drafter": drafter_cfg.model_dump(mode="json"), "train": cfg.model_dump(),
               **self.data.record(), "target": str(Path(target_dir).resolve()),
               "init": str(init) if init else None}
        run_file = self.run_dir / "run.json"
        if run_file.exists():
            stored = _stored_run(run_file)
            # what the init was trained on, as recorded when the run started
            run["init_budget"] = stored.setdefault("init_budget", None)
            if stored != run:
                raise KVShotError(f"{self.run_dir} holds a run with other settings "
                                  f"({run_file}); choose another --out or delete it")
        else:
            run["init_budget"] = _init_budget(init)
        run_file.write_text(json.dumps(run, indent=2))

        torch.manual_seed(cfg.seed)
        self.state_file = self.run_dir / "state.pt"
        self.drafter = build_drafter(drafter_cfg, target_dir)
        # a resumed run's state holds every weight, a grown vocabulary's included
        resumed = self.state_file.exists()
        self.drafter.load_checkpoint_weights(self._fresh_weights(target_dir, init, resumed))
        self.fresh = warm_start(self.drafter, init) if init and not resumed else None
        # The run's state is device-free (state.pt loads anywhere): a run may resume on another.
        self.drafter.to(self.device)
        if cfg.train == "memory":
            for name, p in self.drafter.named_parameters():
                p.requires_grad_(".memory." in f".{name}")
        self.opt = torch.optim.AdamW([p for p in self.drafter.parameters() if p.requires_grad],
                                     lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = 0
        if self.state_file.exists():
            state = torch.load(self.state_file, weights_only=True, map_location=self.device)
            self.drafter.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
            self.step = state["step"]
            self._drop_metrics_after(self.step)
        # after the state: a resumed run's vocabulary is the one it saved
        self.t2d = self.drafter.draft_ids().to(self.device)

    def _fresh_weights(self, target_dir: Path, init: Path | None, resumed: bool
                       ) -> dict[str, torch.Tensor]:
        """Random layers; lm_head = the target's rows of the draft vocabulary
        (`_draft_vocabulary`)."""
        from kvshot_vllm.models.files import target_lm_head
        from kvshot_vllm.models.weights import init_weights

        cfg = self.drafter.cfg
        head = target_lm_head(target_dir).float()
        weights = init_weights(cfg, seed=self.cfg.seed)
        if cfg.draft_vocab_size == cfg.target.vocab_size:
            weights["lm_head.weight"] = head
        else:
            d2t = self._draft_vocabulary(init, resumed)
            weights["d2t"] = d2t
            weights["lm_head.weight"] = head[d2t + torch.arange(cfg.draft_vocab_size)]
        return weights

    def _draft_vocabulary(self, init: Path | None, resumed: bool) -> torch.Tensor:
        """Chosen from the training labels, unless the run's saved state or the warm start
        brings its own (then the first rows stand in until it is copied): choosing reads every
        label, with live features a target forward over the whole set. A warm start's smaller
        vocabulary grows by the training responses' most frequent other tokens."""
        size, vocab = self.drafter.cfg.draft_vocab_size, self.drafter.cfg.target.vocab_size
        if resumed:
            return torch.zeros(size, dtype=torch.long)
        theirs = None
        file = tensor_file(init, "d2t") if init is not None else None
        if file is not None:
            with safe_open(file, "pt") as st:
                theirs = st.get_tensor("d2t")
        if theirs is not None and len(theirs) == size:
            return torch.zeros(size, dtype=torch.long)
        if theirs is None:
            return draft_vocabulary(self.data, size, vocab)
        if len(theirs) > size:
            raise KVShotError(f"warm start {init} has a draft vocabulary of {len(theirs)}: "
                              f"--draft-vocab-size {size} cannot hold it")
        return grown_vocabulary(theirs, size, self.data.response_token_counts(vocab))

    # ------------------------------------------------------------------ the loop

    def autocast(self) -> bool:
        if self.cfg.autocast is not None:
            return self.cfg.autocast
        from kvshot_vllm.engine import cpu_has_native_bf16

        return self.device.type != "cpu" or cpu_has_native_bf16()

    def save(self) -> None:
        """state.pt and the servable checkpoint, each written beside and renamed."""
        tmp = self.state_file.with_suffix(".partial")
        torch.save({"model": self.drafter.state_dict(), "optimizer": self.opt.state_dict(),
                    "step": self.step}, tmp)
        save_checkpoint(self.drafter.cfg, self.drafter.checkpoint_weights(),
                        self.run_dir / "checkpoint")
        tmp.rename(self.state_file)

    def snapshot(self) -> None:
        """snapshots/step-N: the servable checkpoint now (what it was trained on follows from
        the step, `trained_tokens`)."""
        save_checkpoint(self.drafter.cfg, self.drafter.checkpoint_weights(),
                        self.run_dir / "snapshots" / f"step-{self.step:06d}")

    def _drop_metrics_after(self, step: int) -> None:
        """A killed run logged steps it is about to redo: keep the log as one clean run's."""
        path = self.run_dir / METRICS_LOG
        if path.exists():
            keep = [line for line in path.read_text().splitlines(keepends=True)
                    if line.endswith("\n") and json.loads(line)["step"] <= step]
            path.write_text("".join(keep))

    def log(self, record: dict) -> None:
        with (self.run_dir / METRICS_LOG).open("a") as f:
            f.write(json.dumps(record) + "\n")

    def train(self, progress: bool = True) -> Path:
        from tqdm import tqdm

        cfg = self.cfg
        if self.step >= cfg.steps:
            return self.run_dir / "checkpoint"
        stop = {"signal": None}
        previous = signal.signal(signal.SIGTERM, lambda s, f: stop.update(signal=s))
        window: list[tuple[float, list[float], dict[str, float]]] = []
        start, first_step = time.perf_counter(), self.step
        bar = tqdm(total=cfg.steps, initial=self.step, desc=f"train {self.drafter.cfg.paradigm}",
                   unit="step", disable=not progress)
        try:
            while self.step < cfg.steps and stop["signal"] is None:
                for group in self.opt.param_groups:
                    group["lr"] = lr_at(self.step, cfg)
                feats, labels, trainable = self.data.batch(
                    cfg, self.step, self.drafter.cfg.kv_layers, self.drafter.cfg.uses_aux_hidden)
                feats, labels, trainable = (feats.to(self.device), labels.to(self.device),
                                            trainable.to(self.device))
                with torch.autocast(self.device.type, dtype=torch.bfloat16,
                                    enabled=self.autocast()):
                    loss, accs = ttt_loss(
                        self.drafter, feats, labels, trainable, cfg, self.t2d,
                        cfg.multi_view and cfg.multi_view.draw(cfg.seed, self.step))
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                grads = grad_stats(self.drafter)
                torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.clip)
                self.opt.step()
                self.step += 1
                window.append((loss.item(), accs, grads))
                bar.update(1)
                bar.set_postfix(loss=f"{window[-1][0]:.3f}",
                                acc="/".join(f"{a:.2f}" for a in accs[:4]))
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    self.log(self._summary(window, start, first_step))
                    window = []
                if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                    self.save()
                    release_freed_memory()
                elif memory_is_low():
                    release_freed_memory()
                if cfg.snapshot_every and (self.step % cfg.snapshot_every == 0
                                           or self.step == cfg.steps):
                    self.snapshot()
        except KeyboardInterrupt:
            self.save()
            raise
        finally:
            bar.close()
            signal.signal(signal.SIGTERM, previous)
        if stop["signal"] is not None:
            self.save()
            raise KVShotError(f"training stopped by signal {stop['signal']} at step "
                              f"{self.step}; rerun the same command to continue")
        return self.run_dir / "checkpoint"

    def _summary(self, window, start: float, first_step: int) -> dict:
        n = len(window)
        accs = [sum(w[1][j] for w in window) / n for j in range(len(window[0][1]))]
        grads = {k: sum(w[2].get(k, 0.0) for w in window) / n for k in window[0][2]}
        elapsed = time.perf_counter() - start
        return {"step": self.step, "loss": sum(w[0] for w in window) / n, "acc": accs,
                "lr": lr_at(self.step - 1, self.cfg), "grad_rms": grads,
                "gate": gate_stats(self.drafter),
                "s_per_step": elapsed / max(1, self.step - first_step),
                "device": str(self.device)}


def _init_budget(init: Path | None) -> dict[str, int] | None:
    """What a warm start's checkpoint was trained on, kept in run.json so that the run's
    curve and manifest count it even after that checkpoint is replaced (a shipped drafter is,
    by the run that improves it); None where unknown (a checkpoint from elsewhere)."""
    from kvshot_vllm.training.curve import budget_before

    if init is None:
        return None
    try:
        return budget_before(init)
    except KVShotError:
        return None


def _stored_run(run_file: Path) -> dict:
    """run.json as this version writes it: config fields added since take their defaults."""
    run = json.loads(run_file.read_text())
    run["drafter"] = validated(run["drafter"], str(run_file)).model_dump(mode="json")
    run["train"] = TrainConfig.model_validate(run["train"]).model_dump()
    return run
