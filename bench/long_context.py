"""What a draft step costs as the prefix grows, with the full view of the target's KV and with a
sparse budget (issue 15, item 4), on long real documents: the starts of Python standard-library
modules at about 1K, 2K, 4K and 7K tokens, to be continued, or with `--heldout` the held-out
prompts of the long data sets (histories and modules no drafter trained on).

For each configuration one engine runs every bucket (`step_profile.profile`, the same stages),
timing decode steps: each prompt is prefilled first and then served from the prefix cache. The
configurations: no speculation, ngram (prompt lookup, the harness's settings), stock EAGLE-3
with the shipped hidden-only drafter (its own draft cache covers the whole prefix), and the
KV-only and hybrid drafters reading the target's cache in place, each with the full view and
with a `--budget`-token view (streaming, @B; retrieval, @B+retrieval; streaming with a
compressed memory of the blocks it leaves out, @B+memory, issue 16), and the hybrid also with
the streaming view of its own EAGLE-3 cache (@B+own, `KVBudget.draft_cache`). Drafting time
does not depend on the weights, so the plugin's drafters are untrained; `--trained NAME=DIR`
adds a trained drafter as it is (NAME) and with the `--budget`-token views that apply to it
(NAME@B, NAME@B+retrieval and NAME@B+memory for one that reads target KV, NAME@B+own for one
with its own cache: a hybrid, or a hidden-only drafter, whose only view it is), for the
acceptance side (item 4): tokens per step and acceptance length per bucket, served.
`--configs` keeps only the named configurations. Also per configuration: the bytes of
draft-side cache each request holds for its prefix, and the target K/V a draft step reads.

    python bench/long_context.py [--buckets 1024 2048 4096 7168] [--requests 2] [--budget 256]
        [--levels 1] [--max-tokens 32] [--trained NAME=DIR ...] [--configs NAME ...]
        [--heldout] [--out bench/results/long_context]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from pathlib import Path

import torch

from step_profile import profile

BLOCK_SIZE = 32  # the smallest vLLM's CPU attention takes: the finest view
MEMORY_SLOTS = 4  # a +memory view summarises each left-out cache block in this many slots


def plugin_drafters(target: Path, root: Path, budget: int) -> dict[str, Path]:
    """Untrained KV-only and hybrid drafters, full view and budgeted."""
    from kvshot_vllm.models.weights import init_checkpoint

    out = {}
    for paradigm in ("kv", "hybrid"):
        out[paradigm] = init_checkpoint(target, root / paradigm, paradigm=paradigm)
        out.update(with_budgets(paradigm, out[paradigm], root, budget))
    return out


def with_budgets(name: str, ckpt: Path, root: Path, budget: int) -> dict[str, Path]:
    """Copies of a drafter whose config reads through a `budget`-token view: of the target's
    KV, streaming (NAME@B), retrieval (NAME@B+retrieval) and streaming with a compressed memory
    of what it leaves out (NAME@B+memory, `MEMORY_SLOTS` per cache block), and for a drafter
    with its own cache NAME@B+own, the streaming view of its cache too (a hidden-only drafter's
    only view). Weights as they are, a memory adaptor the drafter lacks as initialised (the
    mean of each slot's stretch of its block), one the view lacks left out; no manifest, as the
    config is not the shipped one."""
    from safetensors.torch import load_file

    from kvshot_vllm.models.config import load_drafter_config, validated
    from kvshot_vllm.models.weights import init_weights, save_checkpoint

    cfg = load_drafter_config(ckpt)
    views = {}
    if cfg.spec.reads_target_kv:
        views = {f"{name}@{budget}": {}, f"{name}@{budget}+retrieval": {"policy": "retrieval"},
                 f"{name}@{budget}+memory": {"memory": {"chunk_tokens": BLOCK_SIZE,
                                                        "slots": MEMORY_SLOTS}}}
    if cfg.spec.self_attention:
        views[f"{name}@{budget}+own"] = {"draft_cache": True}
    weights = {n: w for f in ckpt.glob("*.safetensors") for n, w in load_file(f).items()}
    out = {}
    for view, fields in views.items():
        out[view] = root / view.replace("@", "-").replace("+", "-")
        viewed = validated({**cfg.model_dump(), "kv_budget": {
            "tokens": budget, "block_size": BLOCK_SIZE, **fields}})
        # the architecture too: a hidden-only drafter with a view is the plugin's to serve
        fresh = init_weights(viewed)  # the names the view's drafter has
        save_checkpoint(viewed, {**fresh, **{n: w for n, w in weights.items() if n in fresh}},
                        out[view], dtype=weights["lm_head.weight"].dtype)
    return out


def kv_bytes(ckpt: Path | None, prefix: int, dtype_bytes: int, k: int) -> tuple[int, int]:
    """(draft-side cache bytes a request holds for its prefix: its own cache, which vLLM
    allocates whole, and a memory's slots of the target's cache; K/V bytes of the prefix one
    draft step reads: the target's and its own cache's, exact or summarised, and a retrieval
    view's choice, which reads one layer's mean key (fp32) of each block of the gap once per
    proposal of k steps; the means are kept across proposals, so each block's keys are read
    once) of a drafter; (0, 0) without one."""
    from kvshot_vllm.models.budget import kept_keys, left_out_blocks
    from kvshot_vllm.models.config import load_drafter_config

    if ckpt is None:
        return 0, 0
    cfg = load_drafter_config(ckpt)
    per_token = 2 * cfg.target.num_kv_heads * cfg.target.head_dim * dtype_bytes  # K and V
    budget = cfg.kv_budget
    own, cross = cfg.eagle_layers * per_token, len(cfg.kv_layers) * per_token
    own_exact, own_slots = kept_keys(budget and budget.of_cache(target=False), prefix)
    cross_exact, cross_slots = kept_keys(budget and budget.of_cache(target=True), prefix)
    choice = 0
    if budget is not None and budget.policy == "retrieval":
        gap = int(left_out_blocks(torch.tensor(prefix), budget))
        choice = cfg.target.num_kv_heads * cfg.target.head_dim * 4 * gap // k
    return (own * prefix + cross * cross_slots,
            own * (own_exact + own_slots) + cross * (cross_exact + cross_slots) + choice)


def check_cache_holds(target: Path, buckets: dict[str, list[list[int]]], max_tokens: int,
                      dtype: str) -> None:
    """Refuse a run whose largest bucket's prompts do not all fit the CPU KV cache at once
    (the target's layers, and one more for a drafter's own): its timed decode steps would
    prefill evicted prefixes again, and time that."""
    from kvshot_vllm.engine import on_cpu
    from kvshot_vllm.models.files import target_spec

    if not on_cpu():
        return
    t = target_spec(target)
    per_token = 2 * (t.num_layers + 1) * t.num_kv_heads * t.head_dim * (2 if dtype == "bfloat16"
                                                                         else 4)
    need = max(sum(len(p) + max_tokens for p in prompts) for prompts in buckets.values())
    space = float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
    if need * per_token > 0.9 * space:
        raise SystemExit(f"the largest bucket's prompts need {need * per_token / 2**30:.1f} GiB "
                         f"of KV cache at once, more than 90% of VLLM_CPU_KVCACHE_SPACE "
                         f"({space / 2**30:g} GiB): set it higher, or pass fewer --requests")


def bucket_prompts(target: Path, data_dir: Path, buckets: list[int], count: int,
                   heldout: bool) -> dict[str, list[list[int]]]:
    """Up to `count` prompts (token ids) per bucket: with `heldout`, the held-out records of the
    long data sets (`kvshot data prepare --long B`: multi-turn histories and modules that no
    drafter trained on, as an acceptance side needs); else the starts of standard-library
    modules of either split, as many as the cost side wants."""
    from transformers import AutoTokenizer

    from kvshot_vllm.data import long_document_prompts, read_records

    if not heldout:
        tok = AutoTokenizer.from_pretrained(target)
        return {str(b): [s.prompt_token_ids for s in long_document_prompts(tok, b, count,
                                                                          split=None)]
                for b in buckets}
    out = {}
    for b in buckets:
        records = read_records(data_dir / "datasets" / f"long-{b}" / "heldout.jsonl")
        if not records:
            raise SystemExit(f"--heldout: no held-out prompts at {data_dir}/datasets/long-{b}; "
                             f"`kvshot data prepare --long {b}` writes them (`make data-long` "
                             f"for its buckets)")
        out[str(b)] = [r["prompt_token_ids"] for r in records[:count]]
    return out


def main() -> None:
    from kvshot_vllm.engine import configure_vllm_env, default_dtype
    from kvshot_vllm.harness import load_configs
    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.results import write_results
    from kvshot_vllm.target import prepare_target

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--buckets", type=int, nargs="+", default=[1024, 2048, 4096, 7168])
    ap.add_argument("--requests", type=int, default=2, help="prompts per bucket")
    ap.add_argument("--budget", type=int, default=256, help="view size of the budgeted drafters")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--levels", type=int, nargs="+", default=[1])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--trained", nargs="+", default=[], metavar="NAME=DIR",
                    help="trained drafters to add, full view and budgeted")
    ap.add_argument("--configs", nargs="+", help="run only these configurations")
    ap.add_argument("--heldout", action="store_true",
                    help="prompts from the long data sets' held-out split (DATA_DIR/datasets/"
                         "long-B), which no drafter trained on, for acceptance; default: "
                         "module starts of either split, for cost")
    ap.add_argument("--out", default="bench/results/long_context")
    a = ap.parse_args()
    trained = dict(t.split("=", 1) for t in a.trained)

    data_dir = resolve_data_dir()
    # the KV cache size is part of the command when given: `check_cache_holds`
    cache_space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    configure_vllm_env(data_dir)
    dtype = default_dtype()
    target, _ = prepare_target(data_dir, dtype)
    buckets = bucket_prompts(target, data_dir, a.buckets, a.requests, a.heldout)
    lengths = {b: sum(map(len, p)) / len(p) for b, p in buckets.items()}
    shipped = Path(__file__).parents[1] / "drafters/smollm2-135m-instruct/hidden"
    root = data_dir / "bench-drafters" / "long"
    drafters: dict[str, Path | None] = {"none": None, "ngram": None, "eagle3": shipped,
                                        **plugin_drafters(target, root, a.budget)}
    for name, ckpt in trained.items():
        drafters[name] = Path(ckpt)
        drafters.update(with_budgets(name, Path(ckpt), root, a.budget))
    if a.configs:
        unknown = set(a.configs) - set(drafters)
        if unknown:
            ap.error(f"unknown configurations {sorted(unknown)}; choose from {list(drafters)}")
        drafters = {n: c for n, c in drafters.items() if n in a.configs}
    max_len = max(a.buckets) + a.max_tokens + 2 * a.k + 64
    check_cache_holds(target, buckets, a.max_tokens, dtype)
    runs: dict[str, dict[int, dict]] = {}
    ngram = load_configs(["ngram"], Path(__file__).parents[1] / "serving_configs", a.k)["ngram"]
    for name, ckpt in drafters.items():
        spec = ngram.speculative if name == "ngram" else ckpt and {
            "method": "eagle3", "model": str(ckpt), "num_speculative_tokens": a.k,
            **({} if name == "eagle3" else {"disable_padded_drafter_batch": True})}
        runs[name] = {}
        for level in a.levels:
            with multiprocessing.get_context("spawn").Pool(1) as pool:  # see step_profile
                runs[name][level] = pool.apply(profile, (target, data_dir, spec, buckets, level,
                                                         a.max_tokens, True),
                                               {"max_model_len": max_len,
                                                "block_size": BLOCK_SIZE,
                                                "enable_prefix_caching": True})
            print(name, level, {b: round(r["ms_per_token"], 2)
                                for b, r in runs[name][level].items()}, flush=True)

    dtype_bytes = 2 if dtype == "bfloat16" else 4
    untrained = [n for n in drafters if n not in ("none", "ngram", "eagle3")
                 and n.split("@")[0] not in trained]
    some_run = next(iter(next(iter(runs.values()))[a.levels[0]].values()))
    mode = "eager" if some_run["engine"]["enforce_eager"] else "compiled"
    command = " ".join([*([f"VLLM_CPU_KVCACHE_SPACE={cache_space}"] if cache_space else []),
                        "python", *sys.argv])
    source = ("held-out records of the long data sets" if a.heldout
              else "starts of standard-library modules")
    counts = " / ".join(str(len(p)) for p in buckets.values())
    lines = [f"Draft-step cost against prefix length on {target.name} ({dtype}), k = {a.k}, "
             f"block size {BLOCK_SIZE}, {counts} prompts per bucket ({source}), "
             f"{a.max_tokens} greedy tokens each, prefixes prefilled before "
             f"they are timed (decode steps), {mode}. Untrained: {', '.join(untrained) or 'none'}"
             f"; trained: eagle3 (the shipped hidden-only drafter)"
             + "".join(f", {n} ({c})" for n, c in trained.items()) + ".",
             f"Regenerate: `{command}`", "",
             "drafter layers: ms per engine step in the drafter's forward passes (all k); "
             "draft cache: the drafter's own cache and a memory's slots for the prefix, per "
             "request; KV read: the prefix's K/V one draft step reads, the target's and its own "
             "cache's, exact or summarised.", ""]
    for level in a.levels:
        lines += [f"Concurrency {level}:", "",
                  "| config | prefix | tokens/step | MAT | ms/token | target forward ms/step | "
                  "drafter layers ms/step | draft cache | KV read per draft step |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, by_level in runs.items():
            for b, r in by_level[level].items():
                own, read = kv_bytes(drafters[name], int(lengths[b]), dtype_bytes, a.k)
                stage = r["stage_ms_per_step"]
                mat = r.get("acceptance_length")
                lines.append(f"| {name} | {lengths[b]:.0f} | {r['tokens_per_step']:.2f} | "
                             f"{'-' if mat is None else f'{mat:.2f}'} | "
                             f"{r['ms_per_token']:.2f} | {stage['target forward']:.2f} | "
                             f"{stage['drafter layers']:.2f} | {own / 2**10:.0f} KiB | "
                             f"{read / 2**10:.0f} KiB |")
        lines.append("")
        if len(a.buckets) > 1:
            first, last = str(a.buckets[0]), str(a.buckets[-1])
            growth = {name: (by_level[level][last]["stage_ms_per_step"]["drafter layers"]
                             / by_level[level][first]["stage_ms_per_step"]["drafter layers"])
                      for name, by_level in runs.items() if drafters[name] is not None}
            lines += [f"Drafter layers, {a.buckets[-1]}-token bucket over {a.buckets[0]}: "
                      + ", ".join(f"{n} {g:.2f}x" for n, g in growth.items()), ""]
    out = Path(a.out)
    write_results(out, {"command": command, "k": a.k, "budget": a.budget,
                        "prefix_tokens": lengths, "runs": runs,
                        "drafters": {n: str(c) if c else None for n, c in drafters.items()}},
                  lines + [f"![drafter layers against prefix]({out.with_suffix('.png').name})"])
    plot(runs, lengths, a.levels[0], out.with_suffix(".png"))


def plot(runs: dict, lengths: dict[str, float], level: int, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, by_level in runs.items():
        xs = [lengths[b] for b in by_level[level]]
        axes[0].plot(xs, [r["stage_ms_per_step"]["drafter layers"]
                          for r in by_level[level].values()], marker="o", label=name)
        axes[1].plot(xs, [r["ms_per_token"] for r in by_level[level].values()], marker="o",
                     label=name)
    axes[0].set_ylabel("drafter layers, ms per engine step")
    axes[1].set_ylabel("ms per output token")
    for ax in axes:
        ax.set_xlabel("prefix tokens")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"concurrency {level}")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
