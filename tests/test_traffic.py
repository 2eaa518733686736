"""The fault and soak run (`kvshot_vllm/traffic.py`): its verdicts on made-up outcomes, and a
small run against real `vllm serve` processes (no speculation and a KV-reuse drafter, which
writes into the target's cache), which is also the default run's test that a plugin drafter
answers the `openai` client, streaming and not, and moves vLLM's speculative counters. `python bench/soak.py` is the full run: 300 requests at
concurrency 32 for every paradigm."""

from __future__ import annotations

import random
from dataclasses import asdict
from pathlib import Path

import pytest

from kvshot_vllm.models.weights import init_checkpoint
from kvshot_vllm.traffic import (KINDS, Outcome, SoakArgs, check, malformed_requests,
                                 prompt_of_length, run_soak, workload)

IDLE = {"kv_cache_usage": 0.0, "running": 0.0, "waiting": 0.0}


def _result(outcomes: list[Outcome], idle: dict | None = None, **extra) -> dict:
    return {"failed": None, "outcomes": [asdict(o) for o in outcomes], "alive_after": True,
            "healthy_after": True, "gauges_before": IDLE, "gauges_idle": idle or IDLE,
            "left_behind": [], "speculative_config": {"method": "eagle3"},
            "acceptance": {"drafts": 10, "mat": 1.5}, **extra}


def _greedy(i: int, text: str) -> Outcome:
    return Outcome(i, "greedy", "completed", 0.1, 200, text, "length", 4)


def test_check_flags_every_broken_promise() -> None:
    reference = _result([_greedy(0, "a b c"), _greedy(1, "d e f")])
    good = _result([_greedy(0, "a b c"), _greedy(1, "d e f"),
                    Outcome("negative max_tokens", "malformed", "rejected", 0.1, 400,
                            message="max_tokens must be at least 1", expected="rejected")])
    assert check(good, reference)["problems"] == []
    assert check(good, reference)["greedy_compared"] == 2

    def problems(result: dict) -> list[str]:
        return check(result, reference)["problems"]

    assert "differ from no speculation: [1]" in problems(_result([_greedy(0, "a b c"),
                                                                   _greedy(1, "d e X")]))[0]
    accepted = Outcome("prompt over the context", "malformed", "completed", 0.1, 200,
                       message="{}", expected="rejected")
    assert "prompt over the context" in problems(_result([accepted]))[0]
    leak = problems(_result([], idle={**IDLE, "kv_cache_usage": 0.02}))
    assert leak and "not back to idle" in leak[0]
    assert "processes left behind" in problems(_result([], left_behind=[4242]))[0]
    assert "made no drafts" in problems(_result([], acceptance=None))[0]
    bad_json = Outcome(3, "json", "completed", 0.1, 200, '{"topic": "poetry", "difficult": 1}',
                       "stop", 12)
    assert "do not validate: requests [3]" in problems(_result([bad_json]))[0]
    ok_json = Outcome(4, "json", "completed", 0.1, 200, '{"topic": "code", "difficult": false}',
                      "stop", 12)
    assert problems(_result([ok_json])) == []


def test_workload_mixes_kinds_lengths_and_disconnects(target_fp32: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_fp32)
    reqs = workload(tok, 60, 512, seed=1)
    assert [r.id for r in reqs] == list(range(60))
    assert {r.kind for r in reqs} == set(KINDS)
    assert all(r.prompt_tokens + r.max_tokens <= 512 for r in reqs)
    assert max(r.prompt_tokens for r in reqs) > 400 and min(r.prompt_tokens for r in reqs) < 128
    streams = [r for r in reqs if r.stream]
    assert 0 < sum(r.disconnect_after is not None for r in streams) < len(streams)
    assert all(r.disconnect_after is None for r in reqs if not r.stream)
    assert reqs == workload(tok, 60, 512, seed=1)  # the same requests for every configuration
    messages, length = prompt_of_length(tok, ["word " * 50], random.Random(0), 40)
    assert length <= 40 and messages[0]["content"]


def test_small_soak_against_real_servers(target_fp32: Path, data_dir: Path, tmp_path) -> None:
    kv = init_checkpoint(target_fp32, tmp_path / "kv", paradigm="kv")
    configs = {"none": None, "kv": {"method": "eagle3", "model": str(kv),
                                    "num_speculative_tokens": 3,
                                    "disable_padded_drafter_batch": True}}
    out = tmp_path / "soak"
    data = run_soak(configs, target_fp32, data_dir,
                    SoakArgs(requests=20, concurrency=8, max_model_len=512), out, "test")
    for name, r in data["configurations"].items():
        v = r["verdict"]
        assert v["problems"] == [], (name, v["problems"])
        assert v["sent"] == 20 and v["completed"] + v["aborted"] == 20, v
        assert v["malformed"] == len(malformed_requests(512)) == v["malformed_as_expected"]
        assert r["processes"] >= 2 and r["left_behind"] == []
    kv = data["configurations"]["kv"]["verdict"]
    assert kv["greedy_compared"] >= 4 and kv["aborted"] >= 1, kv
    assert data["configurations"]["kv"]["acceptance"]["drafts"] > 0
    assert data["configurations"]["none"]["acceptance"] is None
    report = out.with_suffix(".md").read_text()
    assert "| kv | 20 |" in report and report.rstrip().splitlines()[-1].startswith("Machine: ")


@pytest.mark.slow
def test_soak_every_paradigm(target_fp32: Path, data_dir: Path, tmp_path) -> None:
    """The full run's shape at a tenth of its size, every paradigm (about 10 minutes)."""
    from kvshot_vllm.models.registry import paradigm_names

    configs = {"none": None}
    for p in paradigm_names():
        configs[p] = {"method": "eagle3", "num_speculative_tokens": 3,
                      "model": str(init_checkpoint(target_fp32, tmp_path / p, paradigm=p)),
                      "disable_padded_drafter_batch": p != "hidden"}
    data = run_soak(configs, target_fp32, data_dir,
                    SoakArgs(requests=40, concurrency=16, max_model_len=1024), tmp_path / "soak",
                    "test")
    assert {n: r["verdict"]["problems"] for n, r in data["configurations"].items()} == {
        n: [] for n in configs}
