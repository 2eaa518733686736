"""Fault and soak run against `vllm serve`, for no speculation and every plugin drafter
(`kvshot_vllm/traffic.py` says what is sent and what is checked).

    python bench/soak.py [--configs none hidden kv hybrid block] [--requests 300]
                         [--concurrency 32] [--out bench/results/soak]

A configuration's drafter is the one its `serving_configs/NAME.json` names when that exists
(the shipped ones), else a freshly initialised one of that paradigm (`kvshot drafter init`,
untrained: what is checked here holds for any drafter, whatever it accepts); the report says
which. fp32, where a greedy response must equal no speculation's exactly. Exit status 1 when a
configuration fails a check.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from kvshot_vllm.models.registry import paradigm_names
from kvshot_vllm.traffic import SoakArgs, run_soak

CONFIGS = Path("serving_configs")


def drafter_for(name: str, target: Path, data_dir: Path, k: int) -> tuple[dict, str]:
    """The speculative config of a paradigm and where its drafter came from."""
    from kvshot_vllm.models.weights import init_checkpoint

    file = CONFIGS / f"{name}.json"
    spec = json.loads(file.read_text()) if file.is_file() else {
        "method": "eagle3", "disable_padded_drafter_batch": name != "hidden"}
    model = Path(spec.get("model", ""))
    if spec.get("model") and (model / "config.json").is_file():
        origin = f"{file}: {model}"
    else:
        model = data_dir / "drafters" / f"soak-{name}"
        if not (model / "config.json").is_file():
            init_checkpoint(target, model, paradigm=name)
        origin = f"untrained, `kvshot drafter init --paradigm {name}`"
    return {**spec, "model": str(model.resolve()), "num_speculative_tokens": k}, origin


def main() -> None:
    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.target import prepare_target

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["none", *paradigm_names()],
                    help="'none' and paradigm names")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", default="bench/results/soak")
    a = ap.parse_args()
    unknown = set(a.configs) - {"none", *paradigm_names()}
    if unknown:
        ap.error(f"unknown configurations {sorted(unknown)}; choose from none "
                 f"{' '.join(paradigm_names())}")
    data_dir = resolve_data_dir()
    target = prepare_target(data_dir, dtype="float32")[0]
    configs, origins = {"none": None}, {}
    for name in a.configs:
        if name != "none":
            configs[name], origins[name] = drafter_for(name, target, data_dir, a.k)
    data = run_soak(configs, target, data_dir,
                    SoakArgs(requests=a.requests, concurrency=a.concurrency,
                             max_model_len=a.max_model_len),
                    Path(a.out), "python bench/soak.py " + shlex.join(sys.argv[1:]),
                    extra_lines=[f"Drafters: {'; '.join(f'{n}: {o}' for n, o in origins.items())}."])
    sys.exit(1 if any(r["verdict"]["problems"] for r in data["configurations"].values()) else 0)


if __name__ == "__main__":
    main()
