"""The learning curve of a training run: held-out step-wise acceptance of its snapshots against
the tokens each was trained on. Whether the curve still rises at the end says whether more data
or steps would still help.

    kvshot curve RUN_DIR [--out PATH]    (the run trained with snapshot_every)
"""

from __future__ import annotations

import json
from pathlib import Path

from kvshot_vllm.allocator import release_freed_memory
from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.files import MANIFEST
from kvshot_vllm.training.diagnostics import stepwise_acceptance
from kvshot_vllm.training.features import SplitFeatures
from kvshot_vllm.training.schedule import TrainingData
from kvshot_vllm.training.ttt import TrainConfig


def snapshots(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, checkpoint) of every complete snapshot of a run, in step order."""
    found = sorted((int(p.name.removeprefix("step-")), p)
                   for p in (Path(run_dir) / "snapshots").glob("step-*")
                   if (p / "model.safetensors").is_file() and (p / "config.json").is_file())
    if not found:
        raise KVShotError(f"{run_dir} has no snapshots; train it with --snapshot-every N")
    return found


def run_tokens(run_dir: Path, step: int) -> dict[str, float]:
    """Sequences, tokens and loss tokens a run's checkpoint of `step` was trained on, those of
    the checkpoint it warm-started from included (recorded when the run started)."""
    run_dir = Path(run_dir)
    run = json.loads((run_dir / "run.json").read_text())
    cfg = TrainConfig.model_validate(run["train"])
    train = TrainingData.of_run(run)
    own = train.trained_tokens(cfg, step)
    own["sequences"] = step * cfg.batch_size
    if run.get("init"):
        # runs from before init_budget was recorded: the init as it is now
        before = run.get("init_budget") or budget_before(Path(run["init"]))
        own = {key: own[key] + before[key] for key in own}
    own["epochs"] = own["sequences"] / len(train)
    return own


def budget_before(init: Path) -> dict[str, int]:
    """Sequences, tokens and loss tokens that a warm start's checkpoint was trained on, its own
    warm starts included: from a shipped drafter's manifest, or followed back through kvshot
    runs."""
    init = Path(init)
    if (init / MANIFEST).is_file():
        return shipped_budget(init)
    return total_budget(*checkpoint_origin(init))


def total_budget(run_dir: Path, step: int) -> dict[str, int]:
    """Sequences, tokens and loss tokens of a run's checkpoint of `step`, its warm start's
    included (what a manifest's budget total and run.json's init_budget hold)."""
    tokens = run_tokens(run_dir, step)
    return {key: int(tokens[key]) for key in ("sequences", "tokens", "loss_tokens")}


def shipped_budget(checkpoint: Path) -> dict[str, int]:
    """A shipped drafter's whole training budget, from its manifest."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    budget = manifest["budget"]
    if budget.get("total"):
        return budget["total"]
    if manifest.get("init"):
        raise KVShotError(f"{checkpoint} was warm-started ({manifest['init']}) and its manifest "
                          f"has no budget total: the tokens before it are unknown")
    return {"sequences": budget["steps"] * budget["batch_size"], "tokens": budget["tokens"],
            "loss_tokens": budget["loss_tokens"]}


def checkpoint_origin(ckpt: Path) -> tuple[Path, int]:
    """(run directory, step) of a kvshot run's checkpoint or snapshot."""
    import torch

    if ckpt.parent.name == "snapshots" and ckpt.name.startswith("step-"):
        return ckpt.parent.parent, int(ckpt.name.removeprefix("step-"))
    run_dir = ckpt.parent
    if ckpt.name != "checkpoint" or not (run_dir / "state.pt").is_file():
        raise KVShotError(f"the run warm-started from {ckpt}, which is not a kvshot run's "
                          f"checkpoint: the tokens it was trained on are unknown, so a curve "
                          f"of this run would undercount them")
    return run_dir, torch.load(run_dir / "state.pt", weights_only=True, mmap=True)["step"]


def learning_curve(run_dir: Path, target_dir: Path, heldout: SplitFeatures,
                   steps: int = 7, progress: bool = True, device: str = "cpu") -> list[dict]:
    """One row per snapshot: its step, the tokens it was trained on (a warm start's
    included), a_k and MAT. Each snapshot's acceptance is kept under RUN_DIR/curve-points/ as
    it is measured (a run at scale has tens of snapshots, minutes each), and a rerun reuses it
    for the same held-out features and chain length."""
    from kvshot_vllm.models.drafter import load_drafter

    rows = []
    for step, ckpt in snapshots(run_dir):
        key = {"checkpoint": str(ckpt.resolve()), "heldout": str(heldout.path.resolve()),
               "steps": steps}
        kept = Path(run_dir) / "curve-points" / f"step-{step:06d}.json"
        acceptance = None
        if kept.is_file():
            found = json.loads(kept.read_text())
            acceptance = found["acceptance"] if found["key"] == key else None
        if acceptance is None:
            drafter = load_drafter(ckpt, target_dir).eval().to(device)
            acceptance = stepwise_acceptance(drafter, heldout, steps, progress=progress)
            kept.parent.mkdir(exist_ok=True)
            partial = kept.with_suffix(".partial")
            partial.write_text(json.dumps({"key": key, "acceptance": acceptance}))
            partial.rename(kept)
            release_freed_memory()  # a snapshot's freed tensors, before the next one's sizes
        rows.append({"step": step, "checkpoint": str(ckpt), **run_tokens(run_dir, step),
                     **acceptance})
    return rows


def report_lines(rows: list[dict], command: str) -> list[str]:
    lines = [f"Command: `{command}`", "",
             "Held-out step-wise acceptance of the run's snapshots (a_k, MAT as in `kvshot "
             "diagnose`); tokens: every token of the sequences trained on so far, loss tokens: "
             "their response positions; epochs, tokens and loss tokens include those of the "
             "checkpoint a warm start began from.", "",
             "| step | epochs | tokens | loss tokens | a0 | a1 | a2 | MAT | n0 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = [f"{x:.3f}" if n else "-" for x, n in zip(r["a"], r["alive"])]
        lines.append(f"| {r['step']} | {r['epochs']:.2f} | {r['tokens']} | {r['loss_tokens']} | "
                     f"{' | '.join(a[:3])} | {r['mat']:.3f} | {r['alive'][0]} |")
    if len(rows) >= 2:
        last, before = rows[-1], rows[-2]
        gain = (last["mat"] - before["mat"]) / max(1, last["loss_tokens"] - before["loss_tokens"])
        lines += ["", f"Last interval: MAT {before['mat']:.3f} -> {last['mat']:.3f} over "
                  f"{last['loss_tokens'] - before['loss_tokens']} more loss tokens "
                  f"({1e6 * gain:+.3f} MAT per million)."]
    return lines


def plot(rows: list[dict], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    tokens = [r["loss_tokens"] for r in rows]
    ax.plot(tokens, [r["mat"] for r in rows], marker="o", label="MAT (7-step chain)")
    ax.set_xlabel("loss tokens trained")
    ax.set_ylabel("MAT")
    ax.grid(alpha=0.3)
    a0 = ax.twinx()
    a0.plot(tokens, [r["a"][0] for r in rows], marker="s", color="tab:orange", label="a0")
    a0.set_ylabel("a0")
    a0.set_ylim(0, 1)
    handles = ax.get_legend_handles_labels()[0] + a0.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def write_curve(rows: list[dict], out: Path, command: str) -> None:
    """OUT.json, OUT.md (the table) and OUT.png (MAT and a0 against training tokens)."""
    from kvshot_vllm.results import write_results

    out = Path(out)
    write_results(out, {"command": command, "snapshots": rows}, report_lines(rows, command)
                  + ["", f"![learning curve]({out.with_suffix('.png').name})"])
    plot(rows, out.with_suffix(".png"))
