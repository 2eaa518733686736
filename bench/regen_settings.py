"""Which engine settings should regenerate the training data? Greedy responses of the target on
the same held-out prompts in fp32 and bf16, eager and compiled, side by side in one run: how
often they agree token for token, where they first part, and how fast each setting generates.

    python bench/regen_settings.py [--num-prompts 48] [--max-new-tokens 192]
                                   [--out bench/results/regen_settings]

fp32 eager is the reference: it is what transformers computes, and the labels of training
(`training/features.py`) come from an fp32 forward.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

from kvshot_vllm.results import write_results

SETTINGS = {  # name -> (dtype, enforce_eager)
    "fp32 eager": ("float32", True),
    "fp32 compiled": ("float32", False),
    "bf16 eager": ("bfloat16", True),
    "bf16 compiled": ("bfloat16", False),
}


def generate(target: Path, data_dir: Path, prompts: list[list[int]], dtype: str, eager: bool,
             max_new_tokens: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvshot_vllm.engine import engine_settings, make_llm

    llm = make_llm(target, data_dir, dtype=dtype, enforce_eager=eager,
                   max_model_len=512 + max_new_tokens, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(inputs[:2], params, use_tqdm=False)  # warm-up (compiles the first shapes)
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    result = {"settings": engine_settings(llm), "seconds": seconds,
              "tokens_per_s": sum(map(len, tokens)) / seconds, "tokens": tokens}
    del llm
    return result


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Identical responses, and the share of each response before the first differing token."""
    def common(x: list[int], y: list[int]) -> int:
        return next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))

    same = sum(x == y for x, y in zip(a, b))
    prefix = [common(x, y) / max(len(x), len(y), 1) for x, y in zip(a, b)]
    return {"identical": same / len(a), "mean_common_prefix": sum(prefix) / len(prefix)}


def main() -> None:
    from transformers import AutoTokenizer

    from kvshot_vllm.data import PrepareArgs, SourceStats, packaged_sharegpt, first_turn_prompts
    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.target import prepare_target

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--out", default="bench/results/regen_settings")
    a = ap.parse_args()
    data_dir = resolve_data_dir()
    target, _ = prepare_target(data_dir, "float32")
    selection = first_turn_prompts(packaged_sharegpt(), AutoTokenizer.from_pretrained(target),
                               PrepareArgs(num_prompts=1, num_heldout=a.num_prompts),
                                   SourceStats())
    prompts = [s.prompt_token_ids for s in selection["heldout"]]
    runs = {}
    for name, (dtype, eager) in SETTINGS.items():
        runs[name] = generate(target, data_dir, prompts, dtype, eager, a.max_new_tokens)
        print(f"{name}: {runs[name]['tokens_per_s']:.1f} tokens/s", flush=True)
    pairs = {f"{x} / {y}": agreement(runs[x]["tokens"], runs[y]["tokens"])
             for x, y in itertools.combinations(SETTINGS, 2)}
    command = " ".join(["python", *sys.argv])
    ref = runs["fp32 eager"]
    lines = [f"Greedy responses of {target.name} on {len(prompts)} held-out ShareGPT prompts, "
             f"{a.max_new_tokens} new tokens at most, batch {len(prompts)}.",
             f"Regenerate: `{command}`", "",
             "| setting | dtype (read back) | custom ops | tokens/s | vs fp32 eager | "
             "identical to fp32 eager | mean common prefix |", "|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        agree = agreement(ref["tokens"], r["tokens"])
        lines.append(f"| {name} | {r['settings']['dtype']} | {r['settings']['custom_ops']} | "
                     f"{r['tokens_per_s']:.1f} | {r['tokens_per_s'] / ref['tokens_per_s']:.2f}x | "
                     f"{agree['identical']:.0%} | {agree['mean_common_prefix']:.0%} |")
    lines += ["", "| pair | identical responses | mean common prefix |", "|---|---|---|"]
    lines += [f"| {pair} | {v['identical']:.0%} | {v['mean_common_prefix']:.0%} |"
              for pair, v in pairs.items()]
    write_results(a.out, {"command": command, "num_prompts": len(prompts),
                          "max_new_tokens": a.max_new_tokens, "runs": runs, "pairs": pairs},
                  lines)


if __name__ == "__main__":
    main()
