"""What a drafter costs inside vLLM, side by side against stock EAGLE-3 with the same k:

- drafting time per proposal and per draft step (median over proposals, batch of one request),
  measured around the proposer's `propose()` in the worker process;
- KV cache bytes per token the drafter adds (KV-reuse cross layers should add zero);
- the number of max-length sequences vLLM admits in the same KV cache space.

Drafting cost does not depend on the weights, so untrained drafters are measured, with the
draft vocabulary of the trained ones (`--draft-vocab`, default the `full` preset's; lm_head is
most of a pass's weight reads, so a smaller one weighs the layers more).

Stock EAGLE-3 is served twice: with vLLM's default greedy drafts (the argmax over the target's
vocabulary) and as the serving configs serve every drafter, with
`"use_local_argmax_reduction": true` (the argmax over the draft vocabulary, mapped through
d2t), so that the plugin's layers compare like for like.

With `--torch-matmul-too`, the plugin's drafters are also served as before their decode
kernels (`KVSHOT_TORCH_MATMUL=1`: projections unfused, torch's matmul); with
`--eager-layers-too`, as before their layers were compiled (`KVSHOT_EAGER_LAYERS=1`); each in
the same run.

    python bench/drafter_cost.py [--k 3] [--draft-vocab 8192] [--drafters kv hybrid ...]
        [--torch-matmul-too] [--eager-layers-too] [--out bench/results/drafter_cost]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from kvshot_vllm.models.registry import paradigm_names
from kvshot_vllm.results import write_results
from kvshot_vllm.training.ttt import PRESETS
from kvshot_vllm.serving.drafter import EAGER_LAYERS_ENV, TORCH_MATMUL_ENV

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # timer installed by rpc

STOCK = "stock EAGLE-3 (hidden-only)"
LOCAL_STOCK = "stock EAGLE-3 + local argmax"
PLUGIN_DRAFTERS = {"kv": "KV-only, 1 layer", "hybrid": "hybrid",
                   "hybrid-1": "hybrid, 1 target layer read",
                   "block": "block-parallel, 1 layer",
                   "block-ssm": "block-parallel + recurrent mixer"}
PROMPTS = [
    "Explain how a hash map works, with an example in Python.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between TCP and UDP?",
    "Give me a recipe for a vegetarian lasagna.",
]


def _install_timer(worker) -> None:
    drafter = worker.model_runner.drafter
    original = drafter.propose
    drafter.kvshot_times = []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = original(*args, **kwargs)
        drafter.kvshot_times.append(time.perf_counter() - start)
        return out

    drafter.propose = timed


def _read_timer(worker) -> list[float]:
    return list(worker.model_runner.drafter.kvshot_times)


def weight_mib(drafter: Path) -> float:
    """The drafter's weights in MiB as served (bf16; d2t / t2d excluded): on a CPU a decode
    pass costs about a read of the weights it uses, and a small draft vocabulary leaves the
    layers most of them."""
    from safetensors import safe_open

    with safe_open(drafter / "model.safetensors", "pt") as f:
        return sum(2 * math.prod(f.get_slice(n).get_shape())
                   for n in f.keys() if n not in ("d2t", "t2d")) / 2**20


def measure(target: Path, data_dir: Path, drafter: Path | None, k: int, max_tokens: int,
            max_model_len: int, local_argmax: bool = True) -> dict:
    from vllm import SamplingParams

    from kvshot_vllm.engine import engine_settings, make_llm

    spec = None
    if drafter is not None:
        spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": k,
                "use_local_argmax_reduction": local_argmax}
        if json.loads((drafter / "config.json").read_text())["kvshot"]["paradigm"] != "hidden":
            spec["disable_padded_drafter_batch"] = True
    llm = make_llm(target, data_dir, speculative_config=spec, max_model_len=max_model_len,
                   max_num_seqs=1)
    cache = llm.llm_engine.vllm_config.cache_config
    capacity_tokens = cache.num_gpu_blocks * cache.block_size
    cache_bytes = float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
    result = {"engine": engine_settings(llm), "kv_capacity_tokens": capacity_tokens,
              "kv_bytes_per_token": cache_bytes / capacity_tokens,
              "max_concurrent_sequences": capacity_tokens // max_model_len}
    if spec is not None:
        llm.collective_rpc(_install_timer)
        result["weights_mib"] = weight_mib(drafter)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for prompt in PROMPTS:  # one request at a time: drafting latency at concurrency 1
        llm.generate(prompt, params, use_tqdm=False)
    result["generate_s"] = time.perf_counter() - start
    if spec is not None:
        times = llm.collective_rpc(_read_timer)[0][1:]  # the first call warms up
        result["proposals"] = len(times)
        result["proposal_ms_median"] = 1e3 * statistics.median(times)
        result["draft_step_ms_median"] = result["proposal_ms_median"] / k
    del llm
    return result


def main() -> None:
    from kvshot_vllm.engine import configure_vllm_env
    from kvshot_vllm.models.weights import init_checkpoint
    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.target import prepare_target

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--draft-vocab", type=int, default=PRESETS["full"].draft_vocab_size,
                    help="the drafters' draft vocabulary (default: the full preset's)")
    ap.add_argument("--torch-matmul-too", action="store_true",
                    help="also serve the plugin's drafters unfused on torch's matmul")
    ap.add_argument("--eager-layers-too", action="store_true",
                    help="also serve the plugin's drafters with their layers eager")
    ap.add_argument("--drafters", nargs="+", choices=list(PLUGIN_DRAFTERS),
                    default=[n for n in PLUGIN_DRAFTERS if n != "hybrid-1"],
                    help="the plugin's drafters to serve beside stock EAGLE-3 (default: all "
                    "but hybrid-1, the hybrid reading one target layer instead of three)")
    ap.add_argument("--out", default="bench/results/drafter_cost")
    a = ap.parse_args()

    data_dir = resolve_data_dir()
    configure_vllm_env(data_dir)
    target, _ = prepare_target(data_dir, "bfloat16")
    root = data_dir / "bench-drafters" / f"vocab-{a.draft_vocab}"
    drafters = {p: init_checkpoint(target, root / p, paradigm=p, draft_vocab_size=a.draft_vocab)
                for p in paradigm_names()}
    drafters["block-ssm"] = init_checkpoint(target, root / "block-ssm", paradigm="block",
                                            ssm_state_size=8, draft_vocab_size=a.draft_vocab)
    drafters["hybrid-1"] = init_checkpoint(target, root / "hybrid-1", paradigm="hybrid",
                                           kv_layers=[29], draft_vocab_size=a.draft_vocab)
    runs = {"no speculation": measure(target, data_dir, None, a.k, a.max_tokens,
                                      a.max_model_len),
            STOCK: measure(target, data_dir, drafters["hidden"], a.k, a.max_tokens,
                           a.max_model_len, local_argmax=False)}
    print(STOCK, runs[STOCK], flush=True)
    # the plugin's drafters also served as before a change, in the same run
    variants = {label: env for wanted, label, env in (
        (a.torch_matmul_too, "torch matmul", TORCH_MATMUL_ENV),
        (a.eager_layers_too, "eager layers", EAGER_LAYERS_ENV)) if wanted}
    for name, label in [("hidden", LOCAL_STOCK),
                        *((n, PLUGIN_DRAFTERS[n]) for n in PLUGIN_DRAFTERS if n in a.drafters)]:
        runs[label] = measure(target, data_dir, drafters[name], a.k, a.max_tokens,
                              a.max_model_len)
        print(label, runs[label], flush=True)
        for variant, env_name in variants.items() if name != "hidden" else ():
            os.environ[env_name] = "1"
            try:
                runs[f"{label} ({variant})"] = measure(target, data_dir, drafters[name], a.k,
                                                       a.max_tokens, a.max_model_len)
            finally:
                del os.environ[env_name]

    base, stock, local = runs["no speculation"], runs[STOCK], runs[LOCAL_STOCK]
    for r in runs.values():
        # every layer with a cache stores each token: what the drafter adds per token
        r["drafter_kv_bytes_per_token"] = r["kv_bytes_per_token"] - base["kv_bytes_per_token"]
        if "draft_step_ms_median" in r:
            r["draft_step_vs_stock_eagle3"] = (r["draft_step_ms_median"]
                                               / stock["draft_step_ms_median"])
            r["draft_step_vs_local_argmax_eagle3"] = (r["draft_step_ms_median"]
                                                      / local["draft_step_ms_median"])
    env = {"python": sys.version.split()[0], "platform": platform.platform(),
           "dtype": runs["no speculation"]["engine"]["dtype"],
           "k": a.k, "draft_vocab": a.draft_vocab,
           "kv_cache_gib": os.environ["VLLM_CPU_KVCACHE_SPACE"],
           "max_model_len": a.max_model_len, "command": " ".join(["python", *sys.argv])}
    lines = [f"Drafter cost on {target.name}, k={a.k}, draft vocabulary {a.draft_vocab}, "
             f"dtype {env['dtype']}, {env['kv_cache_gib']} GiB KV cache, "
             f"max_model_len {a.max_model_len}.",
             f"Regenerate: `{env['command']}`", "",
             f"vs stock EAGLE-3: against vLLM's EAGLE-3 path (argmax over the target's "
             f"vocabulary); vs EAGLE-3 + local argmax: against the same layers with the "
             f"drafters' sampling.", "",
             "| configuration | proposal ms (median) | draft step ms | vs stock EAGLE-3 "
             "| vs EAGLE-3 + local argmax | weights MiB | drafter KV bytes/token "
             "| KV capacity (tokens) | max concurrent seqs |",
             "|---|---|---|---|---|---|---|---|---|"]

    def cell(r: dict, key: str, form: str, unit: str = "") -> str:
        return format(r[key], form) + unit if key in r else "-"

    for name, r in runs.items():
        lines.append(f"| {name} | {cell(r, 'proposal_ms_median', '.2f')} "
                     f"| {cell(r, 'draft_step_ms_median', '.2f')} "
                     f"| {cell(r, 'draft_step_vs_stock_eagle3', '.2f', 'x')} "
                     f"| {cell(r, 'draft_step_vs_local_argmax_eagle3', '.2f', 'x')} "
                     f"| {cell(r, 'weights_mib', '.1f')} "
                     f"| {r['drafter_kv_bytes_per_token']:.0f} | "
                     f"{r['kv_capacity_tokens']} | {r['max_concurrent_sequences']} |")
    write_results(a.out, {"env": env, "runs": runs}, lines)


if __name__ == "__main__":
    main()
