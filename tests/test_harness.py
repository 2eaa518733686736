"""The throughput harness against real `vllm serve` processes of the embedded target."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import psutil
import pytest

from kvshot_vllm.engine import default_dtype
from kvshot_vllm.errors import KVShotError
from kvshot_vllm.harness import (SweepArgs, acceptance, bench_config, load_configs, load_prompts,
                                 run_bench, run_load, schedule_lines, scheduled_tokens,
                                 scrape_counters, vllm_bench_serve)
from kvshot_vllm.server import VLLMServer, free_port, serve_command
from kvshot_vllm.models.weights import init_checkpoint
from tests.conftest import assert_one_line_error, run_kvshot


@pytest.fixture(scope="module")
def heldout(tmp_path_factory, target_fp32) -> Path:
    """Four held-out prompts with short responses (their lengths are the output lengths)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_fp32)
    out = tmp_path_factory.mktemp("bench-data")
    questions = ["What is a hash map?", "Name three primary colors.",
                 "Write a haiku about the sea.", "How do I reverse a list in Python?"]
    with (out / "heldout.jsonl").open("w") as f:
        for i, q in enumerate(questions):
            ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                          add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            f.write(json.dumps({"id": str(i), "prompt_token_ids": list(ids),
                                "response_token_ids": [0] * (12 + 2 * i)}) + "\n")
    (out / "train.jsonl").write_text("")
    return out


def _vllm_servers() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] and "serve" in p.info["cmdline"]
            and any("vllm" in part for part in p.info["cmdline"][:2])]


def test_sweep_reports_every_field_and_survives_a_failed_server(
        target_fp32, data_dir, heldout, tmp_path) -> None:
    # A drafter made for another target: its server refuses to start.
    bad = init_checkpoint(target_fp32, tmp_path / "bad", paradigm="kv")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["kvshot"]["target"]["hidden_size"] = 960
    (bad / "config.json").write_text(json.dumps(cfg))
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"broken": {"method": "eagle3", "model": str(bad),
                                            "disable_padded_drafter_batch": True}}))
    configs = load_configs(["broken", "none", "ngram"], Path("serving_configs"), 3, sweep=sweep)
    out = tmp_path / "bench"
    data = run_bench(configs, target_fp32, data_dir, load_prompts(heldout, 64),
                     SweepArgs(levels=[1, 2], requests=2), out, command="test")

    assert data["configurations"]["broken"]["failed"]
    assert "hidden_size" in data["configurations"]["broken"]["failed"]
    assert not _vllm_servers(), "a vllm serve process outlived the sweep"
    for name in ("none", "ngram"):
        r = data["configurations"][name]
        assert r["failed"] is None and r["startup_s"] > 0
        assert set(r["levels"]) == {"1", "2"}
        # what the server resolved, read back from its log: the machine's explicit dtype
        assert r["engine"]["dtype"] == default_dtype() and r["engine"]["custom_ops"], r["engine"]
        for row in r["levels"].values():
            assert row["errors"] == 0 and row["output_tok_s"] > 0 and row["req_s"] > 0
            for key in ("ttft_ms", "tpot_ms", "itl_ms"):
                p = row[key]
                assert 0 < p["p50"] <= p["p90"] <= p["p99"], (key, p)
            assert row["repeats"][0]["output_tokens"] == sum(
                n for _, n in load_prompts(heldout, 64)[: row["repeats"][0]["requests"]])
    # ngram: MAT is accepted / drafts + 1 of the counters' growth, recomputed here
    for row in data["configurations"]["ngram"]["levels"].values():
        acc = row["repeats"][0]["acceptance"]
        assert acc["drafts"] > 0
        assert acc["mat"] == pytest.approx(acc["accepted"] / acc["drafts"] + 1)
        assert sum(acc["per_position"]) * acc["drafts"] == pytest.approx(acc["accepted"])
        assert row["tpot_speedup"] > 0 and row["throughput_speedup"] > 0
        # every step yields one token and its accepted drafts; ngram drafts only on a match
        assert 1 < row["tokens_per_step"] <= row["mat"] and 0 < row["drafting_steps"] <= 1
    assert data["configurations"]["none"]["levels"]["1"].get("mat") is None
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["environment"]["versions"]["torch"] and saved["configurations"]["none"][
        "serve_command"][1] == "serve"
    assert out.with_name("bench-latency-throughput.png").stat().st_size > 10_000
    assert out.with_name("bench-acceptance.png").stat().st_size > 10_000
    report = out.with_suffix(".md").read_text()
    assert "| ngram | 2 |" in report and "Engine settings read back" in report
    # the per-position acceptance beside the proposals it rests on, over both levels
    ngram_levels = data["configurations"]["ngram"]["levels"].values()
    proposals = int(sum(row["drafts"] for row in ngram_levels))
    assert f"| ngram | 0 | {proposals} | " in report and "| none | 0 | - | - |" in report
    assert [data["configurations"][n]["kind"] for n in ("broken", "none", "ngram")] == [
        "kvshot", "none", "ngram"]
    assert "| ngram: TPOT speedup at c = 1 at least 0.75x its acceptance length |" in report
    assert report.rstrip().splitlines()[-1].startswith("Machine: ")


def test_server_dying_mid_run_is_reported_and_leaves_nothing_behind(
        target_fp32, data_dir, heldout, tmp_path) -> None:
    """The API server is killed once the first level has run: the configuration is reported
    as failed with the server's death, and none of its processes (the engine core included)
    survives."""
    port, family = free_port(), []

    def kill_server(message: str) -> None:
        for proc in _vllm_servers():
            if str(port) in proc.info["cmdline"] and not family:
                family.extend([proc, *proc.children(recursive=True)])
                proc.kill()
                proc.wait(timeout=30)

    cfg = load_configs(["none"], Path("serving_configs"), 3)["none"]
    result = bench_config(cfg, target_fp32, data_dir, load_prompts(heldout, 64),
                          SweepArgs(levels=[1, 2], requests=2, port=port), tmp_path, kill_server)
    assert len(family) >= 2, "expected the API server and its engine core"
    assert result["failed"] and "died during the run" in result["failed"]
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_bad_bench_input_fails_clearly(target_fp32, data_dir, heldout, tmp_path) -> None:
    common = ["--target", str(target_fp32), "--dataset", str(heldout), "--data-dir",
              str(data_dir), "--out", str(tmp_path / "b")]
    assert_one_line_error(run_kvshot("bench", "--configs", "warp-drive", *common),
                          "unknown configuration 'warp-drive'")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert_one_line_error(run_kvshot("bench", "--configs", "none", "--port", str(port),
                                         *common), f"port {port} on 127.0.0.1 is already in use")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "train.jsonl").write_text("")
    (empty / "heldout.jsonl").write_text("")
    assert_one_line_error(run_kvshot("bench", "--configs", "none", "--target", str(target_fp32),
                                     "--dataset", str(empty), "--data-dir", str(data_dir)),
                          "no held-out prompts")


def test_vllm_bench_serve_agrees_with_the_harness(target_fp32, data_dir, heldout, tmp_path) -> None:
    """vLLM's own client (`vllm bench serve`) and the harness, the same prompts twice over on
    one server with the shipped drafter, greedy and fp32 at c = 1 (so both runs draft the same
    tokens), report the same acceptance length and per-position acceptance."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_fp32)
    prompts = [(tok.decode(ids), n) for ids, n in load_prompts(heldout, 64)] * 2
    cfg = load_configs(["hidden"], Path("serving_configs"), 3)["hidden"]
    port = free_port()
    cmd = serve_command(target_fp32, port, cfg.speculative, dtype="float32", max_model_len=512,
                        served_model_name="target")
    with VLLMServer(cmd, port, tmp_path / "serve.log", data_dir) as server:
        asyncio.run(run_load(server.base_url, "target", prompts[:1], 1, 1))  # warm-up
        before = scrape_counters(server.base_url)
        outputs, _ = asyncio.run(run_load(server.base_url, "target", prompts, 1, len(prompts)))
        ours = acceptance(before, scrape_counters(server.base_url))
        theirs = vllm_bench_serve(server.base_url, "target", target_fp32, prompts, 1,
                                  tmp_path / "vllm-bench")
    assert all(o.success for o in outputs) and theirs["completed"] == len(prompts)
    assert theirs["total_output_tokens"] == sum(o.output_tokens for o in outputs)
    assert ours["drafts"] > 20 and ours["accepted"] > 0, ours
    assert theirs["spec_decode_num_drafts"] == ours["drafts"]
    assert theirs["spec_decode_accepted_tokens"] == ours["accepted"]
    assert theirs["spec_decode_acceptance_length"] == pytest.approx(ours["mat"], rel=1e-12)
    assert theirs["spec_decode_per_position_acceptance_rates"] == pytest.approx(
        ours["per_position"], rel=1e-12)


def test_goal_lines_judge_each_goal_from_the_run() -> None:
    """Issue 13's goals are judged from the run's own rows: ngram's TPOT speedup against its
    MAT, the best plugin drafter against 1.5x and against stock EAGLE-3, its c = 16 throughput;
    a goal whose configurations are missing or failed is left out."""
    from kvshot_vllm.harness import goal_lines

    def result(kind, **levels):
        return {"kind": kind, "failed": None, "levels": {
            str(c): dict(zip(("tpot_speedup", "mat", "throughput_speedup"), v))
            for c, v in ((int(k[1:]), v) for k, v in levels.items())}}

    results = {"none": result("none", c1=(1.0, None, 1.0)),
               "ngram": result("ngram", c1=(1.6, 2.0, 1.5)),
               "hidden": result("stock", c1=(1.24, 1.4, 1.2)),
               "hybrid": result("kvshot", c1=(1.1, 1.5, 1.0), c16=(0.5, 1.5, 0.7)),
               "block": result("kvshot", c1=(1.3, 1.4, 1.2), c16=(0.9, 1.4, 1.1)),
               "kv": {**result("kvshot", c1=(2.0, 2.0, 2.0)), "failed": "died"}}
    results["ngram"]["levels"]["1"].update(tokens_per_step=1.7, drafting_steps=0.7)
    table = {line.split(" | ")[0].lstrip("| "): line.rsplit(" | ", 2)[1:]
             for line in goal_lines(results) if line.startswith("| ") and "---" not in line}
    assert table["ngram: TPOT speedup at c = 1 at least 0.75x its acceptance length"] == [
        "1.60x at MAT 2.00: 0.80x; 0.94x its 1.70 tokens per step, drafting in 70% of steps",
        "yes |"]
    assert table["best plugin drafter (block): TPOT at c = 1 at least 1.5x no speculation"] == [
        "1.30x", "no |"]
    assert table["block: TPOT at c = 1 above stock EAGLE-3 (hidden)"] == [
        "1.30x against 1.24x", "yes |"]
    assert table["block: throughput at c = 16 no worse than no speculation"] == ["1.10x", "yes |"]
    assert len(table) == 5  # the header and four goals: the failed kv drafter is not "best"
    assert goal_lines({"none": results["none"]}) == []


def test_a_batch_size_schedule_drafts_the_bench_k() -> None:
    """The shipped KV-reuse and block configs speculate only at small batch sizes (vLLM's
    num_speculative_tokens_per_batch_size); `--k` sets how many tokens they draft there,
    `--draft-at-every-batch-size` drops the schedule, and a report says where it held a
    configuration back."""
    spec = load_configs(["hybrid"], Path("serving_configs"), 5)["hybrid"].speculative
    assert spec["num_speculative_tokens"] == 5
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 1, 5], [2, 2, 0]]
    # measuring acceptance over many requests at once: k at every batch size
    everywhere = load_configs(["hybrid", "ngram"], Path("serving_configs"), 5,
                              every_batch_size=True)
    assert "num_speculative_tokens_per_batch_size" not in everywhere["hybrid"].speculative
    assert everywhere["hybrid"].speculative["num_speculative_tokens"] == 5
    assert everywhere["ngram"].speculative == load_configs(
        ["ngram"], Path("serving_configs"), 5)["ngram"].speculative
    # vLLM's lookup: the range holding the batch size, else the last range before it
    assert [scheduled_tokens(spec["num_speculative_tokens_per_batch_size"], b)
            for b in (1, 2, 16)] == [5, 0, 0]
    assert [scheduled_tokens([[1, 2, 3], [5, 5, 0]], b) for b in (3, 4, 5, 9)] == [3, 3, 0, 0]
    assert [scheduled_tokens([[2, 4, 3]], b) for b in (1, 2, 9)] == [0, 3, 3]
    # and a report says where a schedule kept a configuration from drafting
    levels = {"1": {}, "4": {}, "16": {}}
    results = {"hybrid": {"speculative_config": spec, "levels": levels},
               "everywhere": {"speculative_config": everywhere["hybrid"].speculative,
                              "levels": levels},
               "none": {"speculative_config": None, "levels": levels}}
    note = schedule_lines(results)
    assert len(note) == 2 and "hybrid's" in note[1] and "c = 4, 16," in note[1]
    assert "everywhere" not in note[1]


def test_a_new_name_for_a_checkpoint_serves_its_paradigms_config(tmp_path) -> None:
    """`--model NAME=DIR` with a NAME no config has: DIR's paradigm's serving config with DIR as
    its drafter, so two versions of a drafter run side by side without a sweep file. A
    checkpoint without the plugin's paradigm is refused by name."""
    shipped = Path("drafters/smollm2-135m-instruct")
    configs = load_configs(["kv", "kv-next", "hidden-next"], Path("serving_configs"), 4,
                           {"kv-next": str(shipped / "kv"), "hidden-next": str(shipped / "hidden")})
    assert configs["kv-next"].speculative == {**configs["kv"].speculative,
                                              "model": str(shipped / "kv")}
    hidden = json.loads(Path("serving_configs/hidden.json").read_text())
    assert configs["hidden-next"].speculative["model"] == str(shipped / "hidden")
    assert configs["hidden-next"].speculative.keys() == hidden.keys()
    assert "disable_padded_drafter_batch" not in configs["hidden-next"].speculative
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(KVShotError, match="names no paradigm"):
        load_configs(["other"], Path("serving_configs"), 3, {"other": str(foreign)})
    # stock EAGLE-3 keeps its own config and stays served without the plugin
    stock = load_configs(["eagle3"], Path("serving_configs"), 3,
                         {"eagle3": str(shipped / "hidden")})
    assert not stock["eagle3"].plugin and stock["eagle3"].speculative["model"] == str(
        shipped / "hidden")
    with pytest.raises(KVShotError, match="unknown configuration 'nameless'"):
        load_configs(["nameless"], Path("serving_configs"), 3)


def test_tokens_per_step_count_every_decode_step() -> None:
    """Two repeats of 2 requests: 40 tokens after the first ones, 10 drafts accepted in 4
    proposals of 3 (MAT 3.5), so 30 steps, 4/3 tokens a step, 4 of 30 steps drafting."""
    from kvshot_vllm.harness import combine

    def repeat(tokens, accepted, drafts):
        acc = {"drafts": drafts, "accepted": accepted, "draft_tokens": 3 * drafts,
               "mat": accepted / drafts + 1, "per_position": [1.0, 0.75, accepted / drafts - 1.75]}
        return {"requests": 2, "errors": 0, "output_tokens": tokens, "output_tok_s": 1.0,
                "req_s": 1.0, "acceptance": acc,
                **{k: {"p50": 1.0, "p90": 1.0, "p99": 1.0}
                   for k in ("ttft_ms", "tpot_ms", "itl_ms")}}

    out = combine([repeat(22, 5, 2), repeat(22, 5, 2)])
    assert out["mat"] == pytest.approx(3.5)
    assert out["tokens_per_step"] == pytest.approx(40 / 30)
    assert out["drafting_steps"] == pytest.approx(4 / 30)


def test_spread_prompts_sample_the_whole_split(tmp_path) -> None:
    """--spread: N prompts evenly spaced over the held-out split, its first and later ones
    alike; without it, or with N at least the split's size, every prompt in order."""
    rows = [{"prompt_token_ids": [i], "response_token_ids": [7] * (i % 3)} for i in range(13)]
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    answered = [i for i in range(13) if i % 3]  # a record without a response is no prompt
    every = load_prompts(tmp_path, 64)
    assert [ids[0] for ids, _ in every] == answered
    assert [n for _, n in every] == [i % 3 for i in answered]
    spread = load_prompts(tmp_path, 64, spread=3)
    assert [ids[0] for ids, _ in spread] == [answered[0], answered[2], answered[5]]
    assert load_prompts(tmp_path, 64, spread=len(answered)) == every
    assert load_prompts(tmp_path, 1, spread=20) == [(ids, 1) for ids, _ in every]
