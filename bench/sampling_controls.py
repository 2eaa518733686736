"""Where a sampled-distribution difference comes from: the two-sample test of
`kvshot_vllm.distribution` for a no-speculation reference against each control.

    python bench/sampling_controls.py [--configs ...] [--out bench/results/sampling_controls]

Controls: a second no-speculation engine (the test's own false alarms), no speculation without
prefix caching, the oracle (a KV-reuse drafter that writes into the target's cache) with and
without prefix caching, and the shipped hidden-only drafter (vLLM's own EAGLE-3 layers).
`--without-cpu-fixes` runs every engine with vLLM's CPU rejection-sampler kernel as it ships
(`kvshot_vllm/serving/cpu_fixes.py` says what is wrong with it).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from kvshot_vllm.distribution import (ALPHA, NEW_TOKENS, QUESTIONS, SAMPLES, chat_prompts,
                                      chi2_quantile, differs, homogeneity, sample)
from kvshot_vllm.results import write_results
from kvshot_vllm.serving import cpu_fixes

SHIPPED_HIDDEN = Path("drafters/smollm2-135m-instruct/hidden")


def spec(model: Path) -> dict:
    return {"method": "eagle3", "model": str(model), "num_speculative_tokens": 3,
            "disable_padded_drafter_batch": True}


def worst(samples: dict, reference: dict) -> tuple[float, int]:
    """The largest chi-square statistic over prompts and positions, with its df."""
    from collections import Counter

    return max((homogeneity(Counter(s[j] for s in samples[p]),
                            Counter(s[j] for s in reference[p]))
                for p in reference for j in range(1, NEW_TOKENS)), key=lambda x: x[0])


def top_share(samples: dict, reference: dict) -> float:
    """How often a configuration samples the reference's most frequent token, over prompts and
    positions 1.., relative to the reference: above 1, speculation favours likely tokens."""
    from collections import Counter

    ours = theirs = 0
    for p in reference:
        for j in range(1, NEW_TOKENS):
            top, count = Counter(s[j] for s in reference[p]).most_common(1)[0]
            theirs += count
            ours += sum(s[j] == top for s in samples[p])
    return ours / theirs


def main() -> None:
    from kvshot_vllm.models.oracle import build_oracle
    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.target import prepare_target

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=[
        "none-again", "none-no-prefix-cache", "oracle", "oracle-no-prefix-cache", "hidden"])
    ap.add_argument("--without-cpu-fixes", action="store_true")
    ap.add_argument("--out", default="bench/results/sampling_controls")
    a = ap.parse_args()
    if a.without_cpu_fixes:
        os.environ[cpu_fixes.ENV] = "0"  # the engines' processes inherit it
    data_dir = resolve_data_dir()
    target = prepare_target(data_dir, dtype="float32")[0]
    prompts = chat_prompts(target, QUESTIONS)
    oracle = build_oracle(target, data_dir / "drafters" / "oracle-sampling")
    configs = {
        "none-again": (None, {}),
        "none-no-prefix-cache": (None, {"enable_prefix_caching": False}),
        "oracle": (spec(oracle), {}),
        "oracle-no-prefix-cache": (spec(oracle), {"enable_prefix_caching": False}),
        "hidden": (spec(SHIPPED_HIDDEN.resolve()), {}),
    }
    reference = sample(target, data_dir, prompts, None)[0]
    tests = len(prompts) * (NEW_TOKENS - 1)
    rows = {}
    for name in a.configs:
        speculative, engine = configs[name]
        start = time.perf_counter()
        got = sample(target, data_dir, prompts, speculative, **engine)[0]
        stat, df = worst(got, reference)
        rows[name] = {"failed": differs(got, reference), "worst_chi2": stat, "worst_df": df,
                      "top_share": top_share(got, reference),
                      "limit": chi2_quantile(1 - ALPHA / tests, df), "s": time.perf_counter() - start}
        print(name, rows[name], flush=True)
    flag = " --without-cpu-fixes" if a.without_cpu_fixes else ""
    lines = [f"Command: `python bench/sampling_controls.py --configs {' '.join(a.configs)}"
             f"{flag} --out {a.out}`", "",
             f"Each configuration against one no-speculation engine (fp32, prefix caching on): "
             f"{SAMPLES} samples of the first {NEW_TOKENS} tokens of {len(prompts)} chat prompts "
             f"at temperature 0.8, top-p 0.95; chi-square homogeneity per prompt and position "
             f"1..{NEW_TOKENS - 1}, false-alarm rate {ALPHA} for each configuration "
             f"(Bonferroni over its {tests} comparisons).", "",
             "| configuration | differing (prompt, position) | worst chi2 (df) | its limit | "
             "reference's top token, relative frequency | s |",
             "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {len(r['failed'])} of {tests} | {r['worst_chi2']:.1f} "
                     f"({r['worst_df']}) | {r['limit']:.1f} | {r['top_share']:.2f} | "
                     f"{r['s']:.0f} |")
    write_results(Path(a.out), {"configs": rows, "samples": SAMPLES, "alpha": ALPHA,
                                "cpu_fixes": not a.without_cpu_fixes}, lines)


if __name__ == "__main__":
    main()
