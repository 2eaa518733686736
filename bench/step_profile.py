"""Where a speculative engine step's time goes (issue 13, item 1), for no speculation, ngram,
stock EAGLE-3 and every plugin drafter, at concurrency 1 and 16.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and is stepped by hand, so
each engine step is timed whole; timers wrapped around the worker's methods split it into:

    scheduling + IPC            the engine step less the worker's time
    input preparation           GPUModelRunner._prepare_inputs
    target forward              the target model's forward (1 token, or k + 1 to verify)
    logits                      the target's compute_logits
    sampling                    GPUModelRunner._sample (the rejection sampler under speculation)
    proposer input preparation  the proposer's prepare_inputs / set_inputs_first_pass
    drafter layers              the drafter model's forward, every pass
    drafter lm_head             the drafter's compute_logits, every pass
    proposer rest               propose() less the three above (ngram: all of it)
    worker rest                 execute_model + sample_tokens less everything above

Figures are means over the timed steps after a warm-up request, in ms per engine step and per
output token. Drafting cost does not depend on the weights, so the plugin's drafters are
untrained (with the `full` preset's draft vocabulary) unless a serving config names a trained
one; tokens per step (the acceptance) does, and is reported beside. The engine runs eager by
default, so that on a GPU forwards are not hidden in CUDA graph replays (the timers synchronize
there); `--modes eager compiled` runs each configuration both ways and adds a table of the
ratios (compiled: vLLM's torch.compile path, about a minute of compilation per engine start on
2 cores).

    python bench/step_profile.py [--configs none ngram eagle3 kv hybrid block] [--k 3]
        [--levels 1 16] [--max-tokens 64] [--modes eager [compiled]]
        [--out bench/results/step_profile]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker runs here: timers read directly

STAGES = ("scheduling + IPC", "input preparation", "target forward", "logits", "sampling",
          "proposer input preparation", "drafter layers", "drafter lm_head", "proposer rest",
          "worker rest")


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timers:
    """Seconds spent in each wrapped call, summed by name."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)

    def wrap(self, owner, method: str, name: str) -> None:
        original = getattr(owner, method)

        def timed(*args, **kwargs):
            _sync()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                _sync()
                self.total[name] += time.perf_counter() - start

        setattr(owner, method, timed)


def install(worker) -> Timers:
    runner, timers = worker.model_runner, Timers()
    for method, name in (("execute_model", "worker"), ("sample_tokens", "worker"),
                         ("_prepare_inputs", "input preparation"), ("_sample", "sampling")):
        timers.wrap(runner, method, name)
    timers.wrap(runner.model, "forward", "target forward")
    timers.wrap(runner.model, "compute_logits", "logits")
    drafter = getattr(runner, "drafter", None)
    if drafter is not None:
        timers.wrap(drafter, "propose", "propose")
        for method in ("prepare_inputs", "prepare_inputs_padded", "set_inputs_first_pass"):
            if hasattr(drafter, method):
                timers.wrap(drafter, method, "proposer input preparation")
        model = getattr(drafter, "model", None)
        if model is not None:
            timers.wrap(model, "forward", "drafter layers")
            timers.wrap(model, "compute_logits", "drafter lm_head")
    return timers


def stages(t: dict[str, float], engine_s: float) -> dict[str, float]:
    """Per-stage seconds from the timers' sums and the engine steps' wall time."""
    out = {name: t.get(name, 0.0) for name in STAGES}
    proposer = ("proposer input preparation", "drafter layers", "drafter lm_head")
    out["proposer rest"] = t.get("propose", 0.0) - sum(out[n] for n in proposer)
    inside = ("input preparation", "target forward", "logits", "sampling")
    out["worker rest"] = t.get("worker", 0.0) - sum(out[n] for n in inside) - t.get("propose", 0.0)
    out["scheduling + IPC"] = engine_s - t.get("worker", 0.0)
    return out


def profile(target: Path, data_dir: Path, spec: dict | None,
            prompt_sets: dict[str, list[list[int]]], level: int, max_tokens: int,
            cached_prefixes: bool = False, **settings) -> dict[str, dict]:
    """Run each set of prompts, `level` at a time, through one engine stepped by hand: per set,
    the mean time per engine step by stage, tokens per step and the acceptance length. With
    `cached_prefixes`, each prompt is prefilled before it is timed and served from the prefix
    cache then, so that the steps timed are decode steps. `settings`: engine settings over this
    bench's (max_model_len 2048)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvshot_vllm.engine import engine_settings, make_llm, spec_decode_counters

    llm = make_llm(target, data_dir, speculative_config=spec, max_num_seqs=level,
                   **{"max_model_len": 2048, "disable_log_stats": False, **settings})
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    first = next(iter(prompt_sets.values()))[0]
    llm.generate([TokensPrompt(prompt_token_ids=first)], params, use_tqdm=False)  # warm-up
    timers = llm.collective_rpc(install)[0]
    results = {}
    for name, prompts in prompt_sets.items():
        if cached_prefixes:
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                         SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        timers.total.clear()
        before = spec_decode_counters(llm) if spec else {}
        steps, engine_s, tokens = 0, 0.0, 0
        for start in range(0, len(prompts), level):  # `level` requests in flight at a time
            for i, p in enumerate(prompts[start:start + level]):
                engine.add_request(f"{name}-{start + i}", TokensPrompt(prompt_token_ids=p),
                                    params)
            while engine.has_unfinished_requests():
                t0 = time.perf_counter()
                outputs = engine.step()
                engine_s += time.perf_counter() - t0
                steps += 1
                tokens += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
        split = stages(dict(timers.total), engine_s)
        after = spec_decode_counters(llm) if spec else {}
        result = {"engine": engine_settings(llm), "steps": steps, "output_tokens": tokens,
                  "tokens_per_step": tokens / steps, "ms_per_step": 1e3 * engine_s / steps,
                  "ms_per_token": 1e3 * engine_s / tokens,
                  "stage_ms_per_step": {n: 1e3 * s / steps for n, s in split.items()},
                  "stage_ms_per_token": {n: 1e3 * s / tokens for n, s in split.items()}}
        if spec:
            drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
            accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
            result["acceptance_length"] = 1 + accepted / drafts if drafts else None
        results[name] = result
    del llm
    return results


def plot(runs: dict[str, dict[int, dict]], levels: list[int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(levels), figsize=(6 * len(levels), 4.5), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, level in zip(axes[0], levels):
        names = [n for n in runs if level in runs[n]]
        left = [0.0] * len(names)
        for i, stage in enumerate(STAGES):
            widths = [max(runs[n][level]["stage_ms_per_token"][stage], 0.0) for n in names]
            ax.barh(names, widths, left=left, color=colors[i % 10], label=stage)
            left = [a + b for a, b in zip(left, widths)]
        ax.set_title(f"concurrency {level}")
        ax.set_xlabel("ms per output token")
        ax.invert_yaxis()
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(out.with_suffix(".png"), dpi=120)


def mode_ratios(runs: dict[str, dict[int, dict]], names: list[str], levels: list[int]
                ) -> list[str]:
    """Per configuration and concurrency: ms per token eager and compiled, compiled's speedup
    over eager, and each mode's speedup over no speculation in the same mode."""
    lines = ["", "Eager against compiled (ms per output token; speedup = ratio of ms per token):",
             "", "| config | c | eager | compiled | compiled vs eager | vs none, eager | "
             "vs none, compiled |", "|---|---|---|---|---|---|---|"]
    for name in names:
        for level in levels:
            eager, compiled = (runs[f"{name} {m}"][level]["ms_per_token"]
                               for m in ("eager", "compiled"))
            base = {m: runs.get(f"none {m}", {}).get(level, {}).get("ms_per_token")
                    for m in ("eager", "compiled")}
            vs_none = [f"{base[m] / t:.2f}x" if base[m] else "-"
                       for m, t in (("eager", eager), ("compiled", compiled))]
            lines.append(f"| {name} | {level} | {eager:.2f} | {compiled:.2f} | "
                         f"{eager / compiled:.2f}x | {' | '.join(vs_none)} |")
    return lines


def main() -> None:
    from kvshot_vllm.data import PrepareArgs, SourceStats, first_turn_prompts, packaged_sharegpt
    from kvshot_vllm.engine import configure_vllm_env, default_dtype
    from kvshot_vllm.harness import load_configs
    from kvshot_vllm.models.weights import init_checkpoint
    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.results import write_results
    from kvshot_vllm.target import prepare_target
    from kvshot_vllm.training.ttt import PRESETS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["none", "ngram", "eagle3", "kv", "hybrid",
                                                     "block"])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--requests", type=int, default=16, help="held-out prompts per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager"],
                    help="vLLM's eager and/or compiled path")
    ap.add_argument("--out", default="bench/results/step_profile")
    a = ap.parse_args()

    data_dir = resolve_data_dir()
    configure_vllm_env(data_dir)
    target, _ = prepare_target(data_dir, default_dtype())
    from transformers import AutoTokenizer

    held_out = first_turn_prompts(packaged_sharegpt(), AutoTokenizer.from_pretrained(target),
                                  PrepareArgs(num_prompts=0, num_heldout=a.requests,
                                              max_prompt_tokens=1024), SourceStats())["heldout"]
    prompts = [s.prompt_token_ids for s in held_out][:a.requests]
    configs_dir = Path(__file__).parents[1] / "serving_configs"
    untrained = {}
    vocab = PRESETS["full"].draft_vocab_size  # the trained drafters'
    for name in a.configs:  # a plugin config whose drafter is not here: an untrained one
        file = configs_dir / f"{name}.json"
        if file.is_file() and not (Path(json.loads(file.read_text())["model"])
                                   / "config.json").is_file():
            untrained[name] = str(init_checkpoint(
                target, data_dir / "bench-drafters" / f"vocab-{vocab}" / name, paradigm=name,
                draft_vocab_size=vocab))
    configs = load_configs(a.configs, configs_dir, a.k, models=untrained)
    runs: dict[str, dict[int, dict]] = {}
    for name, cfg in configs.items():
        for mode in a.modes:
            run = name if len(a.modes) == 1 else f"{name} {mode}"
            runs[run] = {}
            for level in a.levels:
                # a fresh process per engine: vLLM's CPU kernel registration fails in a process
                # that has already run an ngram engine
                with multiprocessing.get_context("spawn").Pool(1) as pool:
                    runs[run][level] = pool.apply(
                        profile, (target, data_dir, cfg.speculative, {"held-out": prompts},
                                  level, a.max_tokens), {"enforce_eager": mode == "eager"}
                    )["held-out"]
                print(run, level, f"{runs[run][level]['ms_per_token']:.2f} ms/token", flush=True)

    command = " ".join(["python", *sys.argv])
    lines = [f"Step-cost profile on {target.name} ({default_dtype()}, {' and '.join(a.modes)}, "
             f"other settings of `engine_kwargs`), k = {a.k}, {len(prompts)} held-out prompts "
             f"per level, {a.max_tokens} greedy tokens each. Untrained: "
             f"{', '.join(untrained) or 'none'}.",
             f"Regenerate: `{command}`", "",
             "Mean ms per engine step by stage (tokens/step: output tokens per engine step):", "",
             "| config | c | tokens/step | MAT | ms/step | ms/token | "
             + " | ".join(STAGES) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(STAGES)]
    for name, by_level in runs.items():
        for level, r in by_level.items():
            mat = r.get("acceptance_length")
            lines.append(f"| {name} | {level} | {r['tokens_per_step']:.2f} | "
                         f"{'-' if mat is None else f'{mat:.2f}'} | {r['ms_per_step']:.1f} | "
                         f"{r['ms_per_token']:.2f} | " + " | ".join(
                             f"{r['stage_ms_per_step'][s]:.2f}" for s in STAGES) + " |")
    if len(a.modes) == 2:
        lines += mode_ratios(runs, list(configs), a.levels)
    lines += ["", f"Plot: `{Path(a.out).with_suffix('.png').name}` (ms per output token by stage)."]
    out = Path(a.out)
    write_results(out, {"command": command, "k": a.k, "levels": a.levels, "untrained": untrained,
                        "runs": runs}, lines)
    plot(runs, a.levels, out)


if __name__ == "__main__":
    main()
