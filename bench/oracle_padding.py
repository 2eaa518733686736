"""The oracle drafter with one sabotaged position, in vLLM's padded and non-padded drafter batch:
per-position acceptance (vLLM's counters) shows what each mode costs a KV-reuse drafter.

    python bench/oracle_padding.py [--out bench/results/oracle_padding]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvshot_vllm.results import write_results

PROMPTS = ["The capital of France is", "Write a poem about the sea:", "def fibonacci(n):",
           "List three colors:", "Explain photosynthesis in simple terms.",
           "What is the difference between a list and a tuple in Python?"]


def acceptance(target: Path, data_dir: Path, oracle: Path, padded: bool, k: int) -> dict:
    from vllm import SamplingParams

    from kvshot_vllm.engine import engine_settings, make_llm

    spec = {"method": "eagle3", "model": str(oracle), "num_speculative_tokens": k,
            "disable_padded_drafter_batch": not padded}
    llm = make_llm(target, data_dir, dtype="float32", max_model_len=512,
                   speculative_config=spec, disable_log_stats=False)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                 use_tqdm=False)
    m = {x.name: getattr(x, "values", None) or getattr(x, "value", 0) for x in llm.get_metrics()}
    settings = engine_settings(llm)
    del llm
    return {"engine": settings, "drafts": m["vllm:spec_decode_num_drafts"],
            "accepted_per_position": m["vllm:spec_decode_num_accepted_tokens_per_pos"]}


def main() -> None:
    from kvshot_vllm.models.oracle import build_oracle
    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.target import prepare_target

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--sabotage-step", type=int, default=1)
    ap.add_argument("--out", default="bench/results/oracle_padding")
    a = ap.parse_args()
    data_dir = resolve_data_dir()
    target, _ = prepare_target(data_dir, "float32")
    oracle = build_oracle(target, data_dir / "bench-drafters" / "oracle-sabotaged",
                          sabotage_step=a.sabotage_step)
    runs = {mode: acceptance(target, data_dir, oracle, mode == "padded", a.k)
            for mode in ("padded", "non-padded")}
    lines = [f"Oracle drafter, k={a.k}, position {a.sabotage_step} spoiled on every other "
             f"proposal. Regenerate: `python bench/oracle_padding.py`", "",
             "| drafter batch | drafts | accepted per position | rate per position |",
             "|---|---|---|---|"]
    for mode, r in runs.items():
        rates = ", ".join(f"{x / r['drafts']:.2f}" for x in r["accepted_per_position"])
        lines.append(f"| {mode} | {r['drafts']} | {r['accepted_per_position']} | {rates} |")
    write_results(a.out, runs, lines)


if __name__ == "__main__":
    main()
