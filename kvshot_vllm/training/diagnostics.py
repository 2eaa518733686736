"""KVShot's step-wise diagnostics of trained drafters on the held-out split.

Greedy chain drafting of K steps (default 7) from every response position:
    a_k        P(draft k accepted | drafts 0..k-1 accepted): the draft equals the target's
               greedy token. Counted only where the data's next tokens are the target's greedy
               tokens, so the drafter's inputs are exactly what vLLM would feed it.
    MAT        1 + sum_k prod_{i<=k} a_i: expected tokens per target forward with a chain of K
               (the accepted drafts plus the target's own token), i.e. vLLM's
               accepted / drafts + 1 for k = K.
    retention  a_{K-1} / a_0. A weak drafter's chains rarely reach step K-1, so reports also
               compare a_d / a_0 at the deepest step d where every drafter still has
               MIN_CHAINS chains (`common_depth`): ratios of a_k resting on a handful of
               chains are noise.
From the training log (metrics.jsonl, beside a run's checkpoint or inside a shipped drafter):
training time, the hybrid's gate over training, and gradient RMS of the query against the K/V
projections.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from pathlib import Path

import torch

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.budget import KVBudget
from kvshot_vllm.models.drafter import Drafter, load_drafter
from kvshot_vllm.training.features import FeatureSet, SplitFeatures
from kvshot_vllm.training.ttt import METRICS_LOG, chain_predictions, shifted

MIN_CHAINS = 50  # chains a step needs before its a_k is compared or plotted
PREFIXES = (1024, 4096, 7168)  # prefix lengths of the draft-side memory table (bf16 K/V)


@torch.no_grad()
def stepwise_acceptance(drafter: Drafter, features: SplitFeatures, steps: int = 7,
                        batch_size: int = 4, progress: bool = True) -> dict:
    from tqdm import tqdm

    cfg = drafter.cfg
    features.check_layers(cfg.aux_layers, cfg.kv_layers, cfg.uses_aux_hidden)
    alive = torch.zeros(steps, dtype=torch.long)
    accepted = torch.zeros(steps, dtype=torch.long)
    order = sorted(range(len(features)), key=features.length)  # similar lengths pad less
    device = next(drafter.parameters()).device
    for start in tqdm(range(0, len(order), batch_size), desc=f"diagnose {cfg.paradigm}",
                      disable=not progress):
        feats, labels, trainable = features.batch(order[start:start + batch_size],
                                                  cfg.kv_layers, cfg.uses_aux_hidden)
        feats, labels, trainable = feats.to(device), labels.to(device), trainable.to(device)
        ids = feats.input_ids
        chain_ok = torch.ones_like(trainable)
        for j, (_, _, hit, mask) in enumerate(
                chain_predictions(drafter, feats, labels, trainable, steps)):
            if j > 0:  # draft j-1 accepted = the target's greedy token is the next input
                chain_ok &= shifted(ids, 1 + j) == shifted(labels, j)
            rows = slice(chain_ok.shape[1] - mask.shape[1], None)  # the rows the chain computed
            counted = mask & chain_ok[:, rows]
            alive[j] += int(counted.sum())
            accepted[j] += int((counted & hit).sum())
            chain_ok[:, rows] &= hit
    return summarize(accepted.tolist(), alive.tolist())


def summarize(accepted: list[int], alive: list[int]) -> dict:
    a = [acc / n if n else 0.0 for acc, n in zip(accepted, alive)]
    mat = 1 + sum(math.prod(a[: k + 1]) for k in range(len(a)))
    return {"a": a, "mat": mat, "retention": a[-1] / a[0] if a[0] else 0.0,
            "accepted": accepted, "alive": alive}


def training_stats(checkpoint: Path) -> dict | None:
    """Training time, gate and gradient statistics of the run that wrote `checkpoint`, from its
    log: beside a run's checkpoint, inside a shipped drafter (`kvshot ship` carries it)."""
    logs = [p / METRICS_LOG for p in (Path(checkpoint), Path(checkpoint).parent)]
    metrics = next((log for log in logs if log.is_file()), None)
    if metrics is None:
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    grads = {k: sum(r["grad_rms"].get(k, 0.0) for r in rows) / len(rows)
             for k in rows[-1]["grad_rms"]}
    stats = {"steps": rows[-1]["step"], "final_loss": rows[-1]["loss"],
             "train_s": rows[-1]["s_per_step"] * rows[-1]["step"], "grad_rms": grads,
             "gate": [{"step": r["step"], **r["gate"]} for r in rows if r.get("gate")] or None}
    for kind in ("cross", "self"):
        if f"{kind}.q" in grads and grads[f"{kind}.q"] > 0:
            stats[f"{kind}_kv_over_q"] = grads[f"{kind}.kv"] / grads[f"{kind}.q"]
    return stats


def diagnose(checkpoints: dict[str, Path], target_dir: Path, features: FeatureSet,
             steps: int = 7, progress: bool = True, views: Sequence[KVBudget] = (),
             batch_size: int = 4, served_k: int = 0) -> dict:
    """One row per checkpoint, under its own view (`kv_budget`, e.g. a compressed memory) if it
    was trained with one; with `views`, also NAME@TOKENS per view for each full-view drafter
    that reads target KV: the same drafter reading that sparse view of it (`budget.py`),
    NAME@TOKENS+own where the view also covers the drafter's own cache (the only view of a
    hidden-only drafter), NAME@TOKENS+retrieval for a retrieval view. With `served_k`, each
    row also holds the counters vLLM would report at k = served_k (`simulated_vllm_counters`)."""
    results = {}
    for name, ckpt in checkpoints.items():
        drafter = load_drafter(ckpt, target_dir).eval()
        spec = drafter.cfg.spec
        own = [(name, None)] + [
            (f"{name}@{v.tokens}" + ("+own" if v.draft_cache and spec.self_attention else "")
             + ("+retrieval" if v.policy == "retrieval" else ""), v)
            for v in views if drafter.cfg.kv_budget is None
            and (spec.reads_target_kv or v.draft_cache and spec.self_attention)]
        for label, view in own:
            with drafter.viewing(view) if view else nullcontext():
                acceptance = stepwise_acceptance(drafter, features, steps, batch_size,
                                                 progress=progress)
                served = ({"k": served_k, **simulated_vllm_counters(drafter, features,
                                                                     served_k, batch_size)}
                          if served_k else None)
                held = {str(n): drafter.draft_side_bytes(n) for n in PREFIXES}
                read = drafter.view.model_dump() if drafter.view else None
            results[label] = {"checkpoint": str(ckpt), "paradigm": drafter.cfg.paradigm,
                              "num_layers": drafter.cfg.num_layers, "view": read, **acceptance,
                              "served": served, "draft_side_bytes": held,
                              "training": training_stats(ckpt)}
    return results


def common_depth(results: dict) -> int:
    """The deepest step at which every drafter has at least MIN_CHAINS chains."""
    alive = [r["alive"] for r in results.values()]
    depth = 0
    while depth + 1 < len(alive[0]) and all(n[depth + 1] >= MIN_CHAINS for n in alive):
        depth += 1
    return depth


def report_lines(results: dict, command: str) -> list[str]:
    steps = len(next(iter(results.values()))["a"])
    d = common_depth(results)  # 0: no step beyond a0 to compare at
    base_name, base = next(iter(results.items()))
    columns = [f"a{k}" for k in range(steps)] + ["MAT", f"MAT vs {base_name}",
                                                 f"retention a{steps - 1}/a0"]
    columns += [f"a{d}/a0"] if d else []
    columns += ["train steps", "train time", "kv/q grad RMS"]
    lines = [f"Command: `{command}`", "",
             "a_k: P(draft k accepted | drafts 0..k-1 accepted), greedy, held-out split; - where "
             "no chain reached step k. MAT = 1 + sum_k prod_{i<=k} a_i (tokens per target "
             "forward, the bonus token included; vLLM's accepted/drafts + 1 at k = "
             f"{steps}). Retention a{steps - 1}/a0 is n/a where fewer than {MIN_CHAINS} chains "
             f"reached step {steps - 1}" + (f"; a{d}/a0 compares every drafter at the deepest "
                                            f"step where each has at least {MIN_CHAINS} chains"
                                            if d else "") + ".", "",
             "| drafter | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1)]
    for name, r in results.items():
        t = r["training"] or {}
        ratio = t.get("cross_kv_over_q", t.get("self_kv_over_q"))
        cells = [f"{a:.3f}" if n else "-" for a, n in zip(r["a"], r["alive"])]
        cells += [f"{r['mat']:.3f}", f"{r['mat'] / base['mat'] - 1:+.1%}",
                  f"{r['retention']:.1%}" if r["alive"][-1] >= MIN_CHAINS
                  else f"n/a (n={r['alive'][-1]})"]
        if d:
            cells.append(f"{r['a'][d] / r['a'][0]:.1%}" if r["a"][0] else "-")
        cells += [str(t.get("steps", "-")), f"{t['train_s'] / 60:.1f} min" if t else "-",
                  f"{ratio:.3f}" if ratio is not None else "-"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Chains counted at each step (a_k rests on this many; few counts mean a_k is "
              "noise):", "", "| drafter | " + " | ".join(f"n{k}" for k in range(steps)) + " |",
              "|" + "---|" * (steps + 1)]
    lines += [f"| {name} | " + " | ".join(str(n) for n in r["alive"]) + " |"
              for name, r in results.items()]
    lines += served_lines(results)
    lines += draft_memory_lines(results)
    gates = {n: r["training"]["gate"] for n, r in results.items()
             if r["training"] and r["training"]["gate"]}
    if gates:
        lines += ["", "Hybrid gate over training (mean, |mean|, p10 / p50 / p90 over channels):",
                  "", "| drafter | step | mean | abs mean | p10 | p50 | p90 |",
                  "|---|---|---|---|---|---|---|"]
        for name, rows in gates.items():
            for g in rows:
                lines.append(f"| {name} | {g['step']} | {g['mean']:.4f} | {g['abs_mean']:.4f} "
                             f"| {g['p10']:.4f} | {g['p50']:.4f} | {g['p90']:.4f} |")
    grads = {n: r["training"]["grad_rms"] for n, r in results.items() if r["training"]}
    if grads:
        lines += ["", "Gradient RMS per element, averaged over training (self: EAGLE-3 "
                  "self-attention; cross: attention over target KV; kv: draft-side K/V "
                  "projections):", "", "| drafter | self.q | self.kv | cross.q | cross.kv |",
                  "|---|---|---|---|---|"]
        for name, g in grads.items():
            lines.append(f"| {name} | " + " | ".join(
                f"{g[k]:.2e}" if k in g else "-"
                for k in ("self.q", "self.kv", "cross.q", "cross.kv")) + " |")
    return lines


def served_lines(results: dict) -> list[str]:
    """vLLM's acceptance as simulated over every held-out response, where it was (`--served-k`)."""
    served = {n: r["served"] for n, r in results.items() if r.get("served")}
    if not served:
        return []
    k = next(iter(served.values()))["k"]
    lines = ["", f"As a server counts it at k = {k} (simulated: greedy generation of every "
             "held-out response, each proposal starting after the last one's accepted drafts and bonus "
             "token, so where the previous one missed; a_k above starts at every position). "
             "Acceptance at position j = accepted drafts at j / proposals; acceptance length = "
             "1 + accepted / proposals:", "",
             "| drafter | proposals | " + " | ".join(f"pos {j}" for j in range(k))
             + " | acceptance length |", "|" + "---|" * (k + 3)]
    for name, s in served.items():
        n = s["num_drafts"]
        lines.append(f"| {name} | {n} | " + " | ".join(f"{a / n:.3f}" for a in
                                                      s["accepted_per_pos"])
                     + f" | {acceptance_length(s):.2f} |")
    return lines


def acceptance_length(counters: dict) -> float:
    """Tokens per proposal, the bonus token included, from vLLM-style counters."""
    return 1 + sum(counters["accepted_per_pos"]) / max(counters["num_drafts"], 1)


def draft_memory_lines(results: dict) -> list[str]:
    """The draft-side K/V a request holds for its prefix, per drafter and view, against the
    first drafter's, where any drafter holds some."""
    held = {n: r["draft_side_bytes"] for n, r in results.items() if r.get("draft_side_bytes")}
    if not any(any(h.values()) for h in held.values()):
        return []
    base_name = next(iter(results))
    base = held.get(base_name, {})
    prefixes = sorted({int(p) for h in held.values() for p in h})
    lines = ["", "Draft-side K/V per request for its prefix (bf16): the drafter's own cache (all "
             "of it, or its view's exact keys plus memory slots) and the memory slots of "
             "summarised target caches, whose exact keys are read in place. A served streaming "
             "view does not free the keys it leaves out yet: this is what it would hold if it "
             f"did. In brackets: against {base_name}.", "",
             "| drafter | " + " | ".join(f"{p} tokens" for p in prefixes) + " |",
             "|" + "---|" * (len(prefixes) + 1)]
    for name, h in held.items():
        cells = []
        for p in map(str, prefixes):
            cut = f" ({h[p] / base[p] - 1:+.0%})" if base.get(p) and name != base_name else ""
            cells.append(f"{h[p] / 1024:.0f} KiB{cut}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def plot(results: dict, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    top = 0.0
    for name, r in results.items():
        measured = [(k, a) for k, (a, n) in enumerate(zip(r["a"], r["alive"])) if n >= MIN_CHAINS]
        if measured:
            ax.plot(*zip(*measured), marker="o", label=f"{name} (MAT {r['mat']:.2f})")
            top = max(top, *(a for _, a in measured))
    ax.set_title(f"steps with at least {MIN_CHAINS} chains", fontsize=9)
    ax.set_xlabel("draft step k")
    ax.set_ylabel("a_k = P(accept k | 0..k-1 accepted)")
    ax.set_ylim(0, min(1.0, 1.2 * top + 0.05))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def write_report(results: dict, out: Path, command: str) -> None:
    """OUT.json, OUT.md (the tables) and OUT.png (a_k against k, all drafters)."""
    from kvshot_vllm.results import write_results

    out = Path(out)
    write_results(out, {"command": command, "drafters": results}, report_lines(results, command)
                  + ["", f"![a_k against k]({out.with_suffix('.png').name})"])
    plot(results, out.with_suffix(".png"))
    print(f"report: {out.with_suffix('.md')} ({out.with_suffix('.json').name}, "
          f"{out.with_suffix('.png').name})")


def rewrite_report(out: Path) -> None:
    """OUT.md and OUT.png again from OUT.json, e.g. after a change to the report's format."""
    path = Path(out).with_suffix(".json")
    if not path.is_file():
        raise KVShotError(f"no diagnostics at {path}")
    data = json.loads(path.read_text())
    write_report(data["drafters"], Path(out), data["command"])


def simulated_vllm_counters(drafter: Drafter, features: SplitFeatures, k: int,
                            batch_size: int = 4) -> dict:
    """vLLM's spec-decode counters as the offline drafter predicts them for greedy generation
    of each held-out response: proposals start at the last prompt position, and after n
    accepted drafts the next one starts n + 1 tokens later, as in vLLM. So unlike the chain of
    `stepwise_acceptance`, which starts at every response position, proposals start where the
    last one missed, often in harder text: this is the acceptance a server reports."""
    proposals = [n for i, hits in proposal_hits(drafter, features, k, batch_size)
                 for n in served_proposals(hits, features.prompt_length(i), features.length(i))]
    return counters(proposals, k)


def counters(proposals: list[int], k: int) -> dict:
    """vLLM's spec-decode counters of proposals that accepted these many drafts each."""
    return {"num_drafts": len(proposals),
            "accepted_per_pos": [sum(n > j for n in proposals) for j in range(k)]}


@torch.no_grad()
def proposal_hits(drafter: Drafter, features: SplitFeatures, k: int,
                  batch_size: int = 4) -> Iterator[tuple[int, torch.Tensor]]:
    """Per sequence i of `features`: hits [k, T], hits[j, p] = draft j of a proposal anchored
    at position p is the target's token, from the last prompt position on."""
    cfg = drafter.cfg
    order = sorted(range(len(features)), key=features.length)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        feats, labels, _ = features.batch(idx, cfg.kv_layers, cfg.uses_aux_hidden)
        # drafts are scored by the labels from the last prompt position to the sequence's last;
        # the chain skips the rows before them that no draft needs (most of a multi-turn prompt)
        known = torch.zeros(labels.shape, dtype=torch.bool)
        for r, i in enumerate(idx):
            known[r, features.prompt_length(i) - 1: features.length(i)] = True
        hits = torch.zeros(k, *labels.shape, dtype=torch.bool)  # [k, B, T]
        for hit, (_, _, computed, _) in zip(hits, chain_predictions(
                drafter, feats, labels, known.to(labels.device), k)):
            hit[:, hit.shape[1] - computed.shape[1]:] = computed.cpu()  # the rows it computed
        for r, i in enumerate(idx):
            yield i, hits[:, r]


def served_proposals(hits: torch.Tensor, prompt_len: int, length: int) -> list[int]:
    """Drafts accepted by each proposal of a greedy generation of the response that follows a
    prompt of `prompt_len` tokens, to `length` tokens in all, given hits [k, T]: hits[j, p] =
    draft j anchored at position p is the target's token. The prefill gives the first token;
    each proposal then anchors at the last accepted token and gives its accepted drafts plus a
    bonus token, until the response is complete."""
    k = hits.shape[0]
    out = []
    p = prompt_len - 1
    while p - prompt_len + 2 < length - prompt_len:  # tokens generated < response
        n = 0
        while n < k and bool(hits[n, p]):
            n += 1
        out.append(n)
        p += n + 1
    return out
