"""Why vLLM serves in fp32 on CPUs without native bf16: decode throughput of the target in bf16
and fp32, side by side in one run (greedy, 64 new tokens, batch 1/8/16).

    python bench/cpu_dtype_speed.py [--out bench/results/cpu_dtype_speed]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvshot_vllm.results import write_results

from kvshot_vllm.engine import cpu_has_native_bf16

PROMPTS = [f"Tell me a long story about a dragon, number {i}." for i in range(16)]


def throughput(target: Path, data_dir: Path, dtype: str, batches: list[int]) -> dict:
    from vllm import SamplingParams

    from kvshot_vllm.engine import engine_settings, make_llm

    llm = make_llm(target, data_dir, dtype=dtype, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(PROMPTS[:1], params, use_tqdm=False)  # warm-up
    result: dict = {"engine": engine_settings(llm)}
    for n in batches:
        start = time.perf_counter()
        llm.generate(PROMPTS[:n], params, use_tqdm=False)
        result[n] = n * 64 / (time.perf_counter() - start)
    del llm
    return result


def main() -> None:
    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.target import prepare_target

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/cpu_dtype_speed")
    a = ap.parse_args()
    data_dir = resolve_data_dir()
    target, _ = prepare_target(data_dir, "bfloat16")
    batches = [1, 8, 16]
    runs = {dtype: throughput(target, data_dir, dtype, batches) for dtype in ("bfloat16", "float32")}
    lines = [f"Decode throughput (tokens/s) of {target.name} in vLLM on this CPU "
             f"(native bf16: {cpu_has_native_bf16()}). Regenerate: `python bench/cpu_dtype_speed.py`",
             "", "| batch | bfloat16 | float32 | fp32 / bf16 |", "|---|---|---|---|"]
    for n in batches:
        bf, fp = runs["bfloat16"][n], runs["float32"][n]
        lines.append(f"| {n} | {bf:.1f} | {fp:.1f} | {fp / bf:.2f}x |")
    write_results(a.out, runs, lines)


if __name__ == "__main__":
    main()
