"""Training under glibc's default malloc against kvshot's kept freed memory (`allocator.py`),
side by side: the same `kvshot train` run in fresh processes, the two settings alternated round
by round so that machine noise hits both alike.

    python bench/train_allocator.py [--dataset DIR] [--init CKPT] [--steps 20] [--rounds 2]
                                    [--out bench/results/train_allocator]

Each run trains the hidden-only drafter from `--init` for `--steps` steps of the `full` preset
(batch of 8) with live bf16 features, as `make train-hidden-v6` does, on the same batches in
every run. Timed: the steps after the first logging window (the first absorbs start-up and
warm-up), from the run's own `s_per_step`. Counted for each whole process (`os.wait4`): minor
page faults, the share of its CPU time spent in the kernel, and its peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvshot_vllm.allocator import ENV_OFF
from kvshot_vllm.paths import resolve_data_dir
from kvshot_vllm.results import write_results
from kvshot_vllm.target import target_dir
from kvshot_vllm.training.ttt import PRESETS

SETTINGS = {"glibc's default": "0", "freed memory kept": "1"}  # name -> KVSHOT_KEEP_FREED_MEMORY


def timed_run(out: Path, train_args: list[str], keep: str) -> dict:
    """One `kvshot train` process: seconds per step after the first logging window, and what
    the kernel counted for the process."""
    proc = subprocess.Popen([sys.executable, "-m", "kvshot_vllm.cli", "train", *train_args,
                             "--out", str(out)], env={**os.environ, ENV_OFF: keep},
                            stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"kvshot train failed in {out}")
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = logged[0], logged[-1]
    steps = last["step"] - first["step"]
    seconds = last["s_per_step"] * last["step"] - first["s_per_step"] * first["step"]
    cpu_s = usage.ru_utime + usage.ru_stime
    return {"s_per_step": seconds / steps, "timed_steps": steps,
            "minor_faults": usage.ru_minflt, "kernel_share": usage.ru_stime / cpu_s,
            "peak_rss_gib": usage.ru_maxrss / 2**20}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", help="default: DATA_DIR/datasets/sharegpt-all-6turns")
    ap.add_argument("--init", help="default: DATA_DIR/drafters/hidden-v5 (`make train-hidden-v6` "
                    "restores it from git)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/train_allocator")
    a = ap.parse_args()
    data_dir = resolve_data_dir()
    dataset = Path(a.dataset or data_dir / "datasets" / "sharegpt-all-6turns")
    init = Path(a.init or data_dir / "drafters" / "hidden-v5")
    if a.steps <= PRESETS["full"].log_every:
        raise SystemExit(f"--steps must exceed the first logging window, "
                         f"{PRESETS['full'].log_every} steps")
    train_args = ["--paradigm", "hidden", "--init", str(init), "--preset", "full",
                  "--steps", str(a.steps), "--target", str(target_dir(data_dir, "float32")),
                  "--dataset", str(dataset), "--forward-dtype", "bfloat16", "--features", "live"]
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name, keep in SETTINGS.items():
                run = timed_run(Path(tmp) / f"{keep}-{r}", train_args, keep)
                runs[name].append(run)
                print(f"round {r}, {name}: {run}", flush=True)
    rows = {name: {key: statistics.median(run[key] for run in rs) for key in rs[0]}
            for name, rs in runs.items()}
    base = rows["glibc's default"]["s_per_step"]
    command = f"python bench/train_allocator.py {' '.join(sys.argv[1:])}"
    lines = [f"Command: `{command}`", "",
             f"`kvshot train {' '.join(train_args)}`, {a.rounds} runs per setting, alternated; "
             f"medians over runs. s/step: steps after the first logging window; faults, kernel "
             f"share and peak memory: the whole process.", "",
             "| malloc | s/step | speed vs glibc's default | minor faults | CPU time in the "
             "kernel | peak RSS GiB |", "|---|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['s_per_step']:.2f} | {base / row['s_per_step']:.2f}x | "
                     f"{row['minor_faults']:,.0f} | {row['kernel_share']:.1%} | "
                     f"{row['peak_rss_gib']:.1f} |")
    write_results(a.out, {"command": command, "train_args": train_args, "settings": SETTINGS,
                          "runs": runs, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
