"""Shipping a trained drafter into the repository: bf16 weights, its config, and a manifest of
where it came from (the command, data, budget and seed), its training log, and the sha256 of
every file, which `verify_checkpoint` checks wherever the drafter is loaded (training side and
inside vLLM).

    kvshot ship RUN_DIR --name NAME [--out DIR]
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.config import load_drafter_config
from kvshot_vllm.models.files import MANIFEST, sha256_of, verify_checkpoint
from kvshot_vllm.models.weights import save_checkpoint
from kvshot_vllm.training.features import SplitFeatures
from kvshot_vllm.training.schedule import TrainingData
from kvshot_vllm.training.ttt import METRICS_LOG, TrainConfig

# A run directory's record of the command that trained it (`kvshot train` writes it).
COMMAND_FILE = "command.txt"
# Past this a drafter does not belong in git (issue 12: at most about 25 MB each).
MAX_BYTES = 32 * 2**20


def provenance(run_dir: Path) -> dict:
    """What made the run's checkpoint: command, data, budget and seed."""
    run_dir = Path(run_dir)
    if not (run_dir / "run.json").is_file():
        raise KVShotError(f"no training run at {run_dir} (run.json missing)")
    run = json.loads((run_dir / "run.json").read_text())
    cfg = TrainConfig.model_validate(run["train"])
    metrics = [json.loads(line) for line in (run_dir / METRICS_LOG).read_text().splitlines()]
    if not metrics or metrics[-1]["step"] != cfg.steps:
        raise KVShotError(f"{run_dir} has not finished its {cfg.steps} steps; rerun its "
                          f"`kvshot train` command first")
    training = TrainingData.of_run(run)
    sets = [_data_record(part) for part in training.parts]
    if len(sets) > 1:
        for record, weight, steps in zip(sets, training.weights,
                                         training.steps_per_part(cfg.steps)):
            record.update(weight=weight, steps=steps)
    command = run_dir / COMMAND_FILE
    return {
        "command": command.read_text().strip() if command.is_file() else None,
        # one data set's record, or a mix's: its sets', each with its weight and steps
        "data": sets[0] if len(sets) == 1 else {"mix": sets},
        "budget": {"steps": cfg.steps, "batch_size": cfg.batch_size, "lr": cfg.lr,
                   # the drafter's: a warm start's, or grown from it, not the preset's
                   "ttt_steps": cfg.ttt_steps,
                   "draft_vocab_size": run["drafter"]["draft_vocab_size"],
                   **training.trained_tokens(cfg, cfg.steps),
                   "train_s": round(metrics[-1]["s_per_step"] * cfg.steps, 1),
                   # the warm start's budget included; what `kvshot curve` reads
                   "total": _total_budget(run_dir, cfg.steps)},
        "seed": cfg.seed,
        "init": run.get("init"),
    }


def _data_record(features: SplitFeatures) -> dict:
    """A training data set as a manifest records it: how it was made, and its features."""
    dataset = Path(features.params["dataset"])
    data_manifest = dataset / "manifest.json"
    data = json.loads(data_manifest.read_text()) if data_manifest.is_file() else {}
    return {"dataset": dataset.name, "params": data.get("params"),
            "engine": data.get("engine"), "train": (data.get("splits") or {}).get("train"),
            "features": {k: features.params[k] for k in ("forward_dtype", "dtype", "max_len")
                         if k in features.params},
            "sequences": len(features)}


def _total_budget(run_dir: Path, steps: int) -> dict[str, int] | None:
    """Sequences, tokens and loss tokens the checkpoint was trained on, those of its warm
    start included; None when the warm start's are unknown."""
    from kvshot_vllm.training.curve import total_budget

    try:
        return total_budget(run_dir, steps)
    except KVShotError:
        return None


def ship_drafter(run_dir: Path, name: str, out: Path) -> Path:
    """RUN_DIR/checkpoint as a shipped drafter at `out`, written beside and renamed."""
    from safetensors.torch import load_file

    made = provenance(run_dir)
    checkpoint = Path(run_dir) / "checkpoint"
    cfg = load_drafter_config(checkpoint)
    record = {"name": name, "paradigm": cfg.paradigm, "target": cfg.target.name, **made}
    tmp = out.with_name(out.name + ".shipping")
    if tmp.exists():
        shutil.rmtree(tmp)
    save_checkpoint(cfg, load_file(checkpoint / "model.safetensors"), tmp, dtype=torch.bfloat16)
    # the training log, so that `kvshot diagnose` of the shipped drafter still has its gate and
    # gradient statistics once the run is gone
    shutil.copy(Path(run_dir) / METRICS_LOG, tmp / METRICS_LOG)
    files = {f.name: {"sha256": sha256_of(f), "bytes": f.stat().st_size}
             for f in sorted(tmp.iterdir())}
    size = sum(f["bytes"] for f in files.values())
    if size > MAX_BYTES:
        shutil.rmtree(tmp)
        raise KVShotError(f"{name} would ship {size / 2**20:.1f} MiB, over the "
                          f"{MAX_BYTES / 2**20:.0f} MiB a drafter in git may take")
    (tmp / MANIFEST).write_text(json.dumps({**record, "files": files}, indent=2) + "\n")
    verify_checkpoint(tmp)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return out
