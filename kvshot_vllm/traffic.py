"""A fault and soak run against `vllm serve`: real, mixed traffic, abandoned streams and
malformed requests, then what the server is left with.

Each configuration (no speculation first, then the drafters) gets its own `vllm serve` on
127.0.0.1 and the same workload through the `openai` client: chat requests, streaming or not,
greedy, sampled, seeded, with logprobs and with a JSON schema, of prompt lengths up to near
`max_model_len`; a quarter of the streams are dropped by the client after a few chunks; and a
set of malformed requests is mixed in (raw HTTP, since the client would refuse to send some).
Afterwards:
- the server is healthy, and every malformed request got a 4xx with a message;
- every completed greedy response equals no speculation's response to the same request (the
  witness that a drafter's speculative KV writes are never read as verified data);
- every structured-output response that finished parses and validates against its schema;
- once idle, the KV cache usage is back at its starting value and no request is running or
  waiting (aborted requests leaked no blocks);
- once stopped, no process of the server's tree is left.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvshot_vllm.data import chat_prompt
from kvshot_vllm.errors import KVShotError
from kvshot_vllm.harness import acceptance, metric_samples, scrape_counters

KINDS = ("greedy", "sampled", "seeded", "logprobs", "json")
GREEDY_KINDS = ("greedy", "logprobs")  # temperature 0: must equal no speculation
DISCONNECT_FRACTION = 0.25  # of the streaming requests: every fourth
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"topic": {"type": "string", "enum": ["code", "math", "writing", "other"]},
                   "difficult": {"type": "boolean"}},
    "required": ["topic", "difficult"],
    "additionalProperties": False,
}
MODEL = "target"  # the served model name


@dataclass(frozen=True)
class ChatRequest:
    """One well-formed request of the workload; the same ids in every configuration."""
    id: int
    kind: str
    messages: list[dict[str, str]]
    prompt_tokens: int
    max_tokens: int
    stream: bool
    disconnect_after: int | None = None  # chunks read before the client hangs up

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL, "messages": self.messages,
                                "max_tokens": self.max_tokens, "temperature": 0.0}
        if self.kind in ("sampled", "seeded"):
            body.update(temperature=0.8, top_p=0.95)
        if self.kind == "seeded":
            body["seed"] = self.id
        if self.kind == "logprobs":
            body.update(logprobs=True, top_logprobs=2)
        if self.kind == "json":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": ANSWER_SCHEMA}}
        return body


@dataclass(frozen=True)
class Malformed:
    """A request the server must refuse with a 4xx and a message, or, where vLLM's API chooses
    to accept it (`accepted`), answer normally."""
    name: str
    body: bytes
    accepted: bool = False


@dataclass
class Outcome:
    id: int | str
    kind: str
    status: str  # completed | aborted | rejected | error
    latency_s: float
    http_status: int | None = None
    text: str | None = None
    finish_reason: str | None = None
    completion_tokens: int | None = None
    logprobs_ok: bool | None = None
    message: str | None = None
    expected: str | None = None  # malformed requests: "completed" or "rejected"


# ----------------------------------------------------------------------------- the workload


def user_texts(limit: int) -> list[str]:
    """The first human turns of the packaged ShareGPT conversations (any text will do here:
    nothing is trained on it)."""
    from kvshot_vllm.data import SourceStats, iter_sharegpt, packaged_sharegpt

    texts = []
    for conv in iter_sharegpt(packaged_sharegpt(), SourceStats()):
        turn = next((t["value"] for t in conv["conversations"] if t.get("from") == "human"), "")
        if turn.strip():
            texts.append(turn.strip())
        if len(texts) >= limit:
            break
    return texts


def prompt_of_length(tokenizer: Any, texts: list[str], rng: random.Random, tokens: int
                     ) -> tuple[list[dict[str, str]], int]:
    """A one-turn chat of at most `tokens` prompt tokens, chat template included (at least one
    token of content), built from ShareGPT texts joined and cut at a token boundary."""
    overhead = len(chat_prompt(tokenizer, [{"role": "user", "content": ""}]))
    body: list[int] = []
    while len(body) < tokens:
        body += tokenizer.encode("\n\n" + rng.choice(texts), add_special_tokens=False)
    keep = max(1, tokens - overhead)
    while True:  # decoding and re-encoding can merge differently: cut until it fits
        messages = [{"role": "user", "content": tokenizer.decode(body[:keep]).strip() or "Hi."}]
        length = len(chat_prompt(tokenizer, messages))
        if length <= tokens or keep == 1:
            return messages, length
        keep = max(1, keep - (length - tokens))


def workload(tokenizer: Any, num_requests: int, max_model_len: int, seed: int = 0,
             max_new_tokens: int = 48) -> list[ChatRequest]:
    """`num_requests` requests cycling through KINDS, half of them streaming, a quarter of the
    streams dropped mid-way; prompt lengths spread from a few tokens to near the context
    (whatever leaves room for the request's `max_tokens`)."""
    rng = random.Random(seed)
    texts = user_texts(400)
    requests, streams = [], 0
    for i in range(num_requests):
        kind = KINDS[i % len(KINDS)]
        max_tokens = 64 if kind == "json" else rng.randint(8, max_new_tokens)
        room = max_model_len - max_tokens
        # a third short, a third medium, a third up to the edge of the context
        band = (48, 128) if i % 3 == 0 else (128, room // 2) if i % 3 == 1 else (room // 2, room)
        messages, length = prompt_of_length(tokenizer, texts, rng, rng.randint(*band))
        stream = rng.random() < 0.5
        streams += stream
        drop = stream and streams % round(1 / DISCONNECT_FRACTION) == 0
        requests.append(ChatRequest(i, kind, messages, length, max_tokens, stream,
                                    rng.randint(1, 4) if drop else None))
    return requests


def malformed_requests(max_model_len: int) -> list[Malformed]:
    """Prompt over the context, negative and huge max_tokens, an unknown model, a bad parameter
    value, a wrong type, a body that is not JSON, and an unknown parameter."""
    too_long = " ".join(["token"] * (max_model_len + 64))
    chat = [{"role": "user", "content": "Name a colour."}]

    def body(**fields: Any) -> bytes:
        return json.dumps({"model": MODEL, "messages": chat, "max_tokens": 8, **fields}).encode()

    return [
        Malformed("prompt over the context", body(messages=[{"role": "user", "content": too_long}])),
        Malformed("negative max_tokens", body(max_tokens=-1)),
        Malformed("huge max_tokens", body(max_tokens=10 ** 9)),
        Malformed("unknown model", body(model="no-such-model")),
        Malformed("temperature out of range", body(temperature=-1.0)),
        Malformed("messages of the wrong type", body(messages="hello")),
        Malformed("invalid JSON", b'{"model": "target", "messages": [{"role": "user"'),
        # vLLM's request models take extra fields by design (OpenAIBaseModel, extra="allow"):
        # it logs and ignores them, so the check is that the request is answered normally.
        Malformed("unknown parameter", body(frobnicate=1), accepted=True),
    ]


# ----------------------------------------------------------------------------- driving it


async def send(client: Any, req: ChatRequest) -> Outcome:
    """One request through the `openai` client; a stream marked for it is dropped after
    `disconnect_after` chunks by closing the connection."""
    import openai

    start = time.perf_counter()
    body = req.body()
    try:
        if not req.stream:
            reply = await client.chat.completions.create(**body)
            choice = reply.choices[0]
            return Outcome(req.id, req.kind, "completed", time.perf_counter() - start, 200,
                           choice.message.content, choice.finish_reason,
                           reply.usage.completion_tokens,
                           logprobs_ok(req, choice.logprobs.content if choice.logprobs else [],
                                       reply.usage.completion_tokens))
        stream = await client.chat.completions.create(
            **body, stream=True, stream_options={"include_usage": True})
        parts, finish, chunks, usage, lp = [], None, 0, None, []
        async for chunk in stream:
            chunks += 1
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
                if choice.logprobs and choice.logprobs.content:
                    lp += choice.logprobs.content
            if req.disconnect_after is not None and chunks >= req.disconnect_after:
                await stream.close()
                return Outcome(req.id, req.kind, "aborted", time.perf_counter() - start, 200,
                               "".join(parts))
        return Outcome(req.id, req.kind, "completed", time.perf_counter() - start, 200,
                       "".join(parts), finish, usage,
                       logprobs_ok(req, lp, usage))
    except openai.APIStatusError as exc:
        return Outcome(req.id, req.kind, "rejected", time.perf_counter() - start,
                       exc.status_code, message=str(exc)[:300])
    except (openai.APIError, OSError, asyncio.TimeoutError) as exc:
        return Outcome(req.id, req.kind, "error", time.perf_counter() - start,
                       message=f"{type(exc).__name__}: {exc}"[:300])


def logprobs_ok(req: ChatRequest, entries: list | None, tokens: int | None) -> bool | None:
    """A logprobs request has one entry per generated token, each with its top-2."""
    if req.kind != "logprobs":
        return None
    entries = entries or []
    return len(entries) == tokens and all(len(e.top_logprobs) == 2 for e in entries)


async def send_malformed(session: Any, base_url: str, bad: Malformed, tries: int = 2
                         ) -> Outcome:
    """`session` opens a fresh connection for every request (`force_close`): a pooled one that
    the server's keep-alive timeout closes just as it is reused fails before the server reads
    a byte. A connection error is still retried once, since it says nothing about how the
    server answers bad input; a second one is reported."""
    start = time.perf_counter()
    expected = "completed" if bad.accepted else "rejected"
    try:
        async with session.post(base_url + "/v1/chat/completions", data=bad.body,
                                headers={"Content-Type": "application/json"}) as r:
            text = await r.text()
    except OSError as exc:
        if tries > 1:
            return await send_malformed(session, base_url, bad, tries - 1)
        return Outcome(bad.name, "malformed", "error", time.perf_counter() - start,
                       message=f"{type(exc).__name__}: {exc}", expected=expected)
    status = "rejected" if 400 <= r.status < 500 else "completed" if r.status == 200 else "error"
    return Outcome(bad.name, "malformed", status, time.perf_counter() - start, r.status,
                   message="answered" if r.status == 200 else error_message(text),
                   expected=expected)


def error_message(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text[:300]
    err = body.get("error", body) if isinstance(body, dict) else body
    message = err.get("message") if isinstance(err, dict) else None
    return " ".join(str(message if message is not None else err).split())[:300]


async def drive(base_url: str, requests: list[ChatRequest], malformed: list[Malformed],
                concurrency: int, timeout_s: float = 1800.0) -> tuple[list[Outcome], float]:
    """Every request with at most `concurrency` in flight; the malformed ones go out spread
    over the run, among the others."""
    import aiohttp
    import openai

    gate = asyncio.Semaphore(concurrency)
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0,
                                timeout=timeout_s)
    every = max(1, len(requests) // max(1, len(malformed)))
    fresh = aiohttp.TCPConnector(force_close=True)  # see send_malformed
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                     connector=fresh) as session:
        async def one(i: int, req: ChatRequest) -> list[Outcome]:
            async with gate:
                out = [await send(client, req)]
                if i % every == 0 and i // every < len(malformed):
                    out.append(await send_malformed(session, base_url, malformed[i // every]))
                return out

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    await client.close()
    return [o for pair in results for o in pair], time.perf_counter() - start


# ----------------------------------------------------------------------------- the server


def server_gauges(base_url: str) -> dict[str, float]:
    """KV cache usage and the running/waiting request counts from /metrics."""
    wanted = {"vllm:kv_cache_usage_perc": "kv_cache_usage", "vllm:num_requests_running":
              "running", "vllm:num_requests_waiting": "waiting"}
    out: dict[str, float] = {}
    for s in metric_samples(base_url):
        if s.name in wanted:
            out[wanted[s.name]] = out.get(wanted[s.name], 0.0) + s.value
    missing = set(wanted.values()) - set(out)
    if missing:
        raise KVShotError(f"{base_url}/metrics lacks {sorted(missing)}")
    return out


def wait_idle(base_url: str, start: dict[str, float], timeout_s: float = 120.0
              ) -> dict[str, float]:
    """The gauges once nothing runs or waits and the cache usage is back at `start`'s (or at
    the deadline, whatever they are then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = server_gauges(base_url)
        idle = now["running"] == 0 and now["waiting"] == 0
        if (idle and now["kv_cache_usage"] <= start["kv_cache_usage"] + 1e-9) \
                or time.monotonic() > deadline:
            return now
        time.sleep(1.0)


def process_tree(pid: int) -> list[int]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root.pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def survivors(pids: list[int]) -> list[int]:
    import psutil

    return [p for p in pids if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@dataclass
class SoakArgs:
    requests: int = 300
    concurrency: int = 32
    max_model_len: int = 1024
    max_new_tokens: int = 48
    seed: int = 0
    dtype: str = "float32"  # greedy equality with no speculation is exact only in fp32
    startup_timeout_s: float = 900.0
    extra_serve_args: list[str] = field(default_factory=list)


def soak_config(name: str, speculative: dict[str, Any] | None, target: Path, data_dir: Path,
                requests: list[ChatRequest], malformed: list[Malformed], args: SoakArgs,
                log_dir: Path) -> dict[str, Any]:
    """One configuration: serve, warm up, drive the workload, read the server back, stop it."""
    from kvshot_vllm.server import VLLMServer, free_port, serve_command

    port = free_port()
    cmd = serve_command(target, port, speculative_config=speculative,
                        max_model_len=args.max_model_len, served_model_name=MODEL,
                        dtype=args.dtype, max_num_seqs=max(args.concurrency, 8),
                        extra_args=args.extra_serve_args)
    result: dict[str, Any] = {"serve_command": cmd, "speculative_config": speculative,
                              "failed": None}
    server = VLLMServer(cmd, port, log_dir / f"{name}.log", data_dir,
                        startup_timeout_s=args.startup_timeout_s)
    pids: list[int] = []
    try:
        server.start()
        pids = process_tree(server.proc.pid)
        asyncio.run(drive(server.base_url, requests[:1], [], 1))  # warm-up
        before = wait_idle(server.base_url, {"kv_cache_usage": 1.0})
        counters = scrape_counters(server.base_url)
        outcomes, duration = asyncio.run(drive(server.base_url, requests, malformed,
                                               args.concurrency))
        result.update(outcomes=[asdict(o) for o in outcomes], duration_s=duration,
                      alive_after=server.alive(), healthy_after=server.healthy(),
                      acceptance=acceptance(counters, scrape_counters(server.base_url)))
        pids = sorted(set(pids) | set(process_tree(server.proc.pid)))
        result.update(gauges_before=before, gauges_idle=wait_idle(server.base_url, before))
    except KVShotError as exc:
        result["failed"] = f"{exc}; the server's log says: {server.root_cause()}"
    finally:
        server.stop()
    result["processes"] = len(pids)
    result["left_behind"] = survivors(pids)
    return result


# ----------------------------------------------------------------------------- the verdicts


def check(result: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    """Counts, errors by type, latencies, and every check of the module docstring; `problems`
    lists what failed, empty when the configuration passed."""
    import numpy as np

    if result["failed"]:
        return {"problems": [f"failed: {result['failed'].splitlines()[0]}"]}
    outs = [Outcome(**o) for o in result["outcomes"]]
    wellformed = [o for o in outs if o.kind != "malformed"]
    bad = [o for o in outs if o.kind == "malformed"]
    problems = []
    counts = Counter(o.status for o in wellformed)
    if counts["rejected"] or counts["error"]:
        problems.append(f"{counts['rejected'] + counts['error']} well-formed requests failed")
    for o in bad:
        if o.status != o.expected or not o.message:
            problems.append(f"malformed request {o.id!r}: HTTP {o.http_status} "
                            f"{(o.message or '')[:120]!r}")
    if not (result["alive_after"] and result["healthy_after"]):
        problems.append("the server was not healthy after the run")
    idle, before = result["gauges_idle"], result["gauges_before"]
    if idle is None or idle["running"] or idle["waiting"] \
            or idle["kv_cache_usage"] > before["kv_cache_usage"] + 1e-9:
        problems.append(f"not back to idle: before {before}, after {idle}")
    if result["speculative_config"] is not None and not result["acceptance"]:
        problems.append("the server made no drafts: speculation did not run")
    if result["left_behind"]:
        problems.append(f"processes left behind: {result['left_behind']}")
    bad_logprobs = [o.id for o in wellformed if o.logprobs_ok is False]
    if bad_logprobs:
        problems.append(f"logprobs missing or incomplete for requests {bad_logprobs}")
    structured = [o for o in wellformed if o.kind == "json" and o.status == "completed"
                  and o.finish_reason == "stop"]
    invalid = [o.id for o in structured if not valid_json(o.text)]
    if invalid:
        problems.append(f"structured outputs that do not validate: requests {invalid}")
    compared, mismatched = 0, []
    if reference is not None and not reference.get("failed"):
        ref = {o["id"]: o for o in reference["outcomes"]
               if o["kind"] in GREEDY_KINDS and o["status"] == "completed"}
        for o in wellformed:
            if o.kind in GREEDY_KINDS and o.status == "completed" and o.id in ref:
                compared += 1
                if (o.text, o.completion_tokens) != (ref[o.id]["text"],
                                                     ref[o.id]["completion_tokens"]):
                    mismatched.append(o.id)
        if mismatched:
            problems.append(f"greedy responses that differ from no speculation: {mismatched}")
    latencies = [o.latency_s for o in wellformed if o.status == "completed"]
    p50, p99 = np.percentile(latencies, [50, 99]) if latencies else (None, None)
    return {
        "sent": len(wellformed), "completed": counts["completed"], "aborted": counts["aborted"],
        "rejected": counts["rejected"], "errors": counts["error"], "malformed": len(bad),
        "malformed_as_expected": sum(o.status == o.expected for o in bad),
        "errors_by_type": dict(Counter(f"{o.http_status} {o.message.split(':')[0][:60]}"
                                       for o in wellformed if o.status in ("rejected", "error"))),
        "structured_completed": len(structured), "structured_valid": len(structured) - len(invalid),
        "greedy_compared": compared, "greedy_mismatched": len(mismatched),
        "latency_p50_s": p50, "latency_p99_s": p99, "problems": problems,
    }


def valid_json(text: str | None) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text or ""), ANSWER_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def report_lines(data: dict[str, Any]) -> list[str]:
    s = data["settings"]
    lines = [f"Command: `{data['command']}`", "",
             f"Target {Path(data['target']).name} ({s['dtype']}), max_model_len "
             f"{s['max_model_len']}; {s['requests']} chat requests per configuration at "
             f"concurrency {s['concurrency']} (kinds {', '.join(KINDS)}; "
             f"{data['workload']['streaming']} streaming, {data['workload']['disconnects']} "
             f"dropped by the client mid-way; prompt tokens {data['workload']['prompt_tokens']}), "
             f"and {len(data['malformed'])} malformed requests: "
             f"{'; '.join(data['malformed'])}.", "",
             "| config | sent | completed | aborted | rejected | errors | malformed as expected | "
             "JSON valid | greedy = no-spec | latency p50 / p99 s | MAT | KV usage before → "
             "idle | processes left | verdict |", "|" + "---|" * 14]
    for name, r in data["configurations"].items():
        v = r["verdict"]
        if "sent" not in v:
            lines.append(f"| {name} | " + " | " * 12 + f"{'; '.join(v['problems'])} |")
            continue
        g0, g1 = r["gauges_before"], r["gauges_idle"] or {}
        lines.append(
            f"| {name} | {v['sent']} | {v['completed']} | {v['aborted']} | {v['rejected']} | "
            f"{v['errors']} | {v['malformed_as_expected']}/{v['malformed']} | "
            f"{v['structured_valid']}/{v['structured_completed']} | "
            + (f"{v['greedy_compared'] - v['greedy_mismatched']}/{v['greedy_compared']}"
               if name != "none" else "reference")
            + f" | {v['latency_p50_s']:.2f} / {v['latency_p99_s']:.2f} | "
            + (f"{r['acceptance']['mat']:.2f}" if r.get("acceptance") else "-") + " | "
            f"{g0['kv_cache_usage']:.3f} → {g1.get('kv_cache_usage', float('nan')):.3f} | "
            f"{len(r['left_behind'])} | {'pass' if not v['problems'] else '; '.join(v['problems'])} |")
    lines += ["", "What the server said to each malformed request (the first configuration's):", ""]
    first = next(iter(data["configurations"].values()))
    for o in first.get("outcomes", []):
        if o["kind"] == "malformed":
            lines.append(f"- {o['id']}: HTTP {o['http_status']}, \"{o['message']}\"")
    lines += ["", "Well-formed requests that failed, by HTTP status and the start of the "
              "message: " + "; ".join(
                  f"{name}: {r['verdict'].get('errors_by_type') or 'none'}"
                  for name, r in data["configurations"].items()) + "."]
    return lines


def run_soak(configs: dict[str, dict[str, Any] | None], target: Path, data_dir: Path,
             args: SoakArgs, out: Path, command: str, extra_lines: list[str] = (),
             progress=print) -> dict[str, Any]:
    """Every configuration in turn ("none" first: the greedy reference); OUT.json and OUT.md."""
    from transformers import AutoTokenizer

    from kvshot_vllm.results import write_results

    if "none" not in configs:
        raise KVShotError("the soak run needs the 'none' configuration: it is the reference")
    tokenizer = AutoTokenizer.from_pretrained(target)
    requests = workload(tokenizer, args.requests, args.max_model_len, args.seed,
                        args.max_new_tokens)
    malformed = malformed_requests(args.max_model_len)
    log_dir = Path(out).parent / f"{Path(out).name}-logs"
    results: dict[str, dict] = {}
    for name in ["none", *[n for n in configs if n != "none"]]:
        progress(f"== {name}")
        results[name] = soak_config(name, configs[name], target, data_dir, requests, malformed,
                                    args, log_dir)
        results[name]["verdict"] = check(results[name], results.get("none")
                                         if name != "none" else None)
        progress(f"   {results[name]['verdict'].get('problems') or 'pass'}")
    lengths = sorted(r.prompt_tokens for r in requests)
    data = {"command": command, "target": str(target), "settings": asdict(args),
            "workload": {"kinds": dict(Counter(r.kind for r in requests)),
                         "streaming": sum(r.stream for r in requests),
                         "disconnects": sum(r.disconnect_after is not None for r in requests),
                         "prompt_tokens": f"{lengths[0]}..{lengths[-1]}, median "
                                          f"{lengths[len(lengths) // 2]}"},
            "malformed": [m.name for m in malformed], "configurations": results}
    write_results(out, data, [*report_lines(data), "", *extra_lines])
    return data
