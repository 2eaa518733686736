"""Data preparation: deterministic split, no leakage, resumption after a kill, clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvshot_vllm.data import (PrepareArgs, SourceStats, chat_prompt, comparable, differences,
                              packaged_sharegpt, read_records, select_conversations, split_of,
                              user_turns)
from tests.conftest import KVSHOT, assert_one_line_error, run_kvshot

SMALL = ["--num-prompts", "6", "--num-heldout", "2", "--max-new-tokens", "12",
         "--chunk-size", "2", "--max-prompt-tokens", "256", "--max-turns", "2",
         "--dtype", "float32"]
# fp32: a resumed run equals an uninterrupted one only where the engine repeats itself, and a
# bf16 engine on an AMX CPU did not, eager or compiled (README, CPU notes).


def test_split_is_deterministic_and_keeps_conversation_parts_together() -> None:
    ids = [f"conv{i}_{part}" for i in range(400) for part in range(3)]
    first = [split_of(i) for i in ids]
    assert first == [split_of(i) for i in ids]
    for i in range(400):
        assert len({first[3 * i + p] for p in range(3)}) == 1
    held = first.count("heldout") / len(first)
    assert 0.01 < held < 0.12  # about 5%, by hash


def test_selection_has_no_overlap_and_fits_budget(target_bf16: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_bf16)
    args = PrepareArgs(num_prompts=40, num_heldout=10, max_prompt_tokens=200, max_turns=3)
    stats = SourceStats()
    sel = select_conversations(packaged_sharegpt(), tok, args, stats)
    train = {c.id.rsplit("_", 1)[0] for c in sel["train"]}
    held = {c.id.rsplit("_", 1)[0] for c in sel["heldout"]}
    assert len(sel["train"]) == 40 and len(sel["heldout"]) == 10
    assert not train & held
    assert all(len(chat_prompt(tok, [{"role": "user", "content": c.user_turns[0]}])) <= 200
               for c in sel["train"] + sel["heldout"])
    assert all(1 <= len(c.user_turns) <= 3 for c in sel["train"])
    assert any(len(c.user_turns) > 1 for c in sel["train"])  # multi-turn conversations exist
    again = select_conversations(packaged_sharegpt(), tok, args, SourceStats())
    assert [c.id for c in again["train"]] == [c.id for c in sel["train"]]


def test_long_document_prompts_reach_their_bucket(target_bf16: Path) -> None:
    """Long-context prompts (issue 15): one standard-library module each, about the asked
    length, on the asked side of the split."""
    from transformers import AutoTokenizer

    from kvshot_vllm.data import long_document_prompts, split_of

    tok = AutoTokenizer.from_pretrained(target_bf16)
    for tokens in (1024, 4096):
        prompts = long_document_prompts(tok, tokens, 3, split="train")
        assert len(prompts) == 3 and len({p.conversation for p in prompts}) == 3
        for p in prompts:
            assert tokens - 64 <= len(p.prompt_token_ids) <= tokens + 16, len(p.prompt_token_ids)
            assert p.split == "train" == split_of(f"{p.conversation}_0")
            assert p.messages[0]["content"].startswith("Continue this file, ")
    held_out = long_document_prompts(tok, 1024, 50)
    assert held_out and all(p.split == "heldout" for p in held_out)
    assert long_document_prompts(tok, 1024, 0) == []


def test_history_prompts_join_parts_and_end_on_a_user_turn(target_bf16: Path,
                                                            tmp_path: Path) -> None:
    """Long-context histories (issue 15): a conversation's `_N` parts joined again, cut at the
    latest user turn whose prompt fits the bucket, at least 3/4 of it, split by conversation."""
    from transformers import AutoTokenizer

    from kvshot_vllm.data import history_prompts

    tok = AutoTokenizer.from_pretrained(target_bf16)
    word = "lorem ipsum dolor sit amet " * 20  # about 200 tokens a turn

    def turns(n: int, first: str = "human") -> list[dict]:
        other = {"human": "gpt", "gpt": "human"}
        out, who = [], first
        for i in range(n):
            out.append({"from": who, "value": f"{i} {word}"})
            who = other[who]
        return out

    train = [f"conv{i}" for i in range(200) if split_of(f"conv{i}_0") == "train"][:3]
    items = [{"id": f"{train[0]}_0", "conversations": turns(4)},
             {"id": f"{train[0]}_1", "conversations": turns(4)},  # joined: 8 turns
             {"id": f"{train[1]}_0", "conversations": turns(2)},  # too short for the bucket
             {"id": f"{train[2]}_0", "conversations": turns(9)}]
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps(items))
    prompts = history_prompts(source, tok, 1100, 5, "train", SourceStats())
    assert [p.conversation for p in prompts] == [train[0], train[2]]
    for p in prompts:
        assert 825 <= len(p.prompt_token_ids) <= 1100
        assert p.messages[-1]["role"] == "user" and p.turn == (len(p.messages) + 1) // 2
        assert p.prompt_token_ids == chat_prompt(tok, p.messages)
    # the joined conversation's parts: turn 4 (the first of part 1) is its 5th message
    assert len(prompts[0].messages) == 5 and prompts[0].messages[4]["content"].startswith("0 ")
    assert history_prompts(source, tok, 1100, 5, "heldout", SourceStats()) == []


def test_user_turns_keep_only_an_alternating_start() -> None:
    conv = [{"from": "human", "value": "a"}, {"from": "gpt", "value": "x"},
            {"from": "human", "value": " b "}, {"from": "gpt", "value": "y"},
            {"from": "human", "value": "c"}]
    assert user_turns(conv, 5) == ["a", "b", "c"]
    assert user_turns(conv, 2) == ["a", "b"]
    # a turn out of order or empty ends the conversation where it stands
    assert user_turns([conv[0], conv[2], conv[1]], 5) == ["a"]
    assert user_turns([conv[0], {"from": "gpt", "value": " "}, conv[2]], 5) == ["a"]
    assert user_turns([conv[1], conv[0]], 5) == []


def test_settings_differences_name_what_changed() -> None:
    started = {"dtype": "bfloat16", "enforce_eager": False, "custom_ops": ["none"],
               "cpu": {"model": "AMD EPYC", "cores": 2, "isa": ["avx2", "avx512f"]}}
    assert differences(comparable(started), comparable(
        {**started, "cpu": {**started["cpu"], "model": "another name"}})) == []
    assert differences(comparable(started), comparable(
        {**started, "dtype": "float32", "cpu": {**started["cpu"], "isa": ["avx2"]}})) == [
        "cpu.isa: ['avx2', 'avx512f'] -> ['avx2']", "dtype: 'bfloat16' -> 'float32'"]


def test_truncated_sharegpt_is_recovered(tmp_path: Path) -> None:
    from kvshot_vllm.data import iter_sharegpt

    full = [{"id": f"x{i}_0", "conversations": [{"from": "human", "value": "hi"}]}
            for i in range(3)]
    text = json.dumps(full)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.rindex('"hi"') + 2])  # cut inside the last string
    stats = SourceStats()
    assert [c["id"] for c in iter_sharegpt(cut, stats)] == ["x0_0", "x1_0"]
    assert stats.truncated and stats.conversations == 2


def test_resume_after_kill_gives_the_same_file(target_bf16: Path, data_dir: Path,
                                               tmp_path: Path) -> None:
    common = ["--data-dir", str(data_dir), "--target", str(target_bf16), *SMALL]
    reference = tmp_path / "reference"
    proc = run_kvshot("data", "prepare", *common, "--out", str(reference))
    assert proc.returncode == 0, proc.stderr[-3000:]
    finished = {s: (reference / f"{s}.jsonl").read_text() for s in ("train", "heldout")}
    assert '"turn": 2' in finished["train"]
    made = json.loads((reference / "manifest.json").read_text())["last_run"]
    assert made["generated_prompts"] > 0 and made["tokens_per_s"] > 0, made
    # A rerun of a finished data set keeps every turn and regenerates nothing, and the manifest
    # still says what the run that made it generated, and how fast.
    proc = run_kvshot("data", "prepare", *common, "--out", str(reference))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing to regenerate" in proc.stdout, proc.stdout
    assert {s: (reference / f"{s}.jsonl").read_text() for s in finished} == finished
    assert json.loads((reference / "manifest.json").read_text())["last_run"] == made

    # A larger set grown from it takes every reply it answered and regenerates only the rest.
    grown = tmp_path / "grown"
    proc = run_kvshot("data", "prepare", *common, "--num-prompts", "8", "--out", str(grown),
                      "--reuse", str(reference))
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = {r["id"]: r for s in finished for r in read_records(reference / f"{s}.jsonl")}
    after = {r["id"]: r for s in finished for r in read_records(grown / f"{s}.jsonl")}
    assert before.keys() < after.keys()
    assert all(after[i] == r for i, r in before.items())
    last_run = json.loads((grown / "manifest.json").read_text())["last_run"]
    assert last_run["reused_prompts"] == len(before), last_run
    assert last_run["generated_prompts"] == len(after) - len(before), last_run
    assert f"reused {len(before)} replies" in proc.stdout, proc.stdout
    assert_one_line_error(run_kvshot("data", "prepare", *common, "--max-new-tokens", "13",
                                     "--out", str(tmp_path / "other"), "--reuse", str(reference)),
                          "max_new_tokens: 12 -> 13")

    resumed = tmp_path / "resumed"
    victim = subprocess.Popen([*KVSHOT, "data", "prepare", *common, "--out", str(resumed)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    train = resumed / "train.jsonl"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and len(read_records(train)) < 2:
        assert victim.poll() is None, "data prepare ended before it could be killed"
        time.sleep(0.2)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    partial = read_records(train)
    assert 2 <= len(partial) < 6, len(partial)
    with train.open("a") as f:  # a torn write, as a kill in the middle of a line leaves
        f.write('{"id": "torn')

    proc = run_kvshot("data", "prepare", *common, "--out", str(resumed))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for split in ("train", "heldout"):
        assert (resumed / f"{split}.jsonl").read_text() == (reference / f"{split}.jsonl").read_text()
    records = read_records(train)
    assert records[: len(partial)] == partial  # nothing already written was redone
    assert len({r["id"] for r in records}) == len(records)
    assert all(r["response_token_ids"] for r in records)
    manifest = json.loads((resumed / "manifest.json").read_text())
    per_turn = manifest["splits"]["train"]["records_per_turn"]
    assert per_turn["1"] == 6 and 1 <= per_turn.get("2", 0) <= 6, per_turn
    assert manifest["splits"]["train"]["records"] == len(records)
    assert manifest["splits"]["heldout"]["conversations"] == 2
    assert manifest["last_run"]["generated_prompts"] == (
        len(records) + manifest["splits"]["heldout"]["records"] - len(partial))
    assert manifest["target"]["name"] == "SmolLM2-135M-Instruct"
    engine = manifest["engine"]
    assert engine == json.loads((resumed / "engine.json").read_text())
    assert engine["dtype"] in ("float32", "bfloat16") and engine["enforce_eager"] is True
    assert engine["custom_ops"] and engine["cpu"]["model"] and engine["cpu"]["isa"]
    assert "tokens/s" in proc.stdout and "prompts/min" in proc.stdout

    # Turn 2 is prompted with turn 1 and the target's own reply to it, never the original one.
    first = {r["conversation"]: r for r in records if r["turn"] == 1}
    for r in (r for r in records if r["turn"] == 2):
        before = first[r["conversation"]]
        assert r["messages"][:-1] == [*before["messages"], {
            "role": "assistant", "content": before["response_text"].strip()}]
        assert r["prompt_token_ids"][: len(before["prompt_token_ids"])] == \
            before["prompt_token_ids"]
        assert len(r["prompt_token_ids"]) <= 256
    held = {r["conversation"].rsplit("_", 1)[0] for r in read_records(resumed / "heldout.jsonl")}
    assert held and not held & {c.rsplit("_", 1)[0] for c in first}

    # Other settings on the same data set are refused, and the message says which.
    other = "float32" if engine["dtype"] == "bfloat16" else "bfloat16"
    assert_one_line_error(run_kvshot("data", "prepare", *common, "--out", str(resumed),
                                     "--dtype", other),
                          f"dtype: {engine['dtype']!r} -> {other!r}")
    assert_one_line_error(run_kvshot("data", "prepare", *common, "--out", str(resumed),
                                     "--compiled"), "enforce_eager: True -> False")
    (resumed / "engine.json").write_text(json.dumps({**engine, "cpu": {
        **engine["cpu"], "isa": ["a-cpu-from-elsewhere"]}}))
    assert_one_line_error(run_kvshot("data", "prepare", *common, "--out", str(resumed)),
                          "other CPU kernels")


@pytest.mark.slow  # a vLLM engine and transformers' generate: about a minute
def test_transformers_engine_regenerates_what_vllm_does(target_fp32: Path, data_dir: Path,
                                                        tmp_path: Path) -> None:
    """`--engine transformers` (a GPU machine without vLLM, scripts/gpu_train.sh) writes the
    data set vLLM writes: the same records, turn by turn, and in fp32 the same greedy replies,
    up to a rare near-tie that left-padded batching may flip."""
    common = ["--data-dir", str(data_dir), "--target", str(target_fp32), *SMALL,
              "--num-prompts", "3", "--num-heldout", "1"]
    sets = {}
    for engine in ("vllm", "transformers"):
        out = tmp_path / engine
        proc = run_kvshot("data", "prepare", *common, "--engine", engine, "--out", str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        sets[engine] = {r["id"]: r for s in ("train", "heldout")
                        for r in read_records(out / f"{s}.jsonl")}
    ours, vllm = sets["transformers"], sets["vllm"]
    assert ours.keys() == vllm.keys() and any(i.endswith("/t2") for i in ours)
    equal = total = 0
    for rid, r in ours.items():
        assert r["prompt_token_ids"] == vllm[rid]["prompt_token_ids"] or rid.endswith("/t2")
        assert r["finish_reason"] in ("stop", "length") and 0 < len(r["response_token_ids"]) <= 12
        a, b = r["response_token_ids"], vllm[rid]["response_token_ids"]
        equal += sum(x == y for x, y in zip(a, b))
        total += max(len(a), len(b))
    assert equal / total >= 0.9, (equal, total)
    engine = json.loads((tmp_path / "transformers" / "engine.json").read_text())
    assert engine["engine"] == "transformers" and engine["dtype"] == "float32"
    assert_one_line_error(run_kvshot("data", "prepare", *common, "--engine", "transformers",
                                     "--temperature", "0.7", "--out", str(tmp_path / "t")),
                          "greedily only")
    assert_one_line_error(run_kvshot("data", "prepare", *common, "--engine", "transformers",
                                     "--workers", "2", "--out", str(tmp_path / "w")),
                          "the transformers engine runs one")


def test_num_prompts_zero_is_refused(tmp_path: Path) -> None:
    proc = run_kvshot("data", "prepare", "--data-dir", str(tmp_path), "--num-prompts", "0")
    assert_one_line_error(proc, "--num-prompts must be at least 1")


def test_not_sharegpt_is_refused(target_bf16: Path, tmp_path: Path) -> None:
    for name, content in [("obj.json", '{"a": 1}'), ("list.json", '[{"text": "hello"}]'),
                          ("garbage.json", "this is not json")]:
        path = tmp_path / name
        path.write_text(content)
        proc = run_kvshot("data", "prepare", "--data-dir", str(tmp_path), "--target",
                          str(target_bf16), "--sharegpt", str(path), "--num-prompts", "2",
                          "--out", str(tmp_path / f"out-{name}"))
        assert_one_line_error(proc, "not ShareGPT-shaped")


@pytest.mark.slow
def test_ray_workers_produce_the_same_data(target_bf16: Path, data_dir: Path,
                                           tmp_path: Path) -> None:
    common = ["--data-dir", str(data_dir), "--target", str(target_bf16), *SMALL]
    one, two = tmp_path / "one", tmp_path / "two"
    for out, workers in ((one, "1"), (two, "2")):
        proc = run_kvshot("data", "prepare", *common, "--out", str(out), "--workers", workers)
        assert proc.returncode == 0, proc.stderr[-3000:]
    for split in ("train", "heldout"):
        assert (one / f"{split}.jsonl").read_text() == (two / f"{split}.jsonl").read_text()


@pytest.mark.slow
def test_long_data_set_is_one_bucket_of_regenerated_prompts(target_fp32: Path,
                                                            tmp_path: Path) -> None:
    """`kvshot data prepare --long`: a real engine answers each long prompt; the manifest counts
    them; a rerun regenerates nothing."""
    out = tmp_path / "long"
    args = ["data", "prepare", "--long", "512", "--num-prompts", "1", "--num-heldout", "2",
            "--max-new-tokens", "4", "--dtype", "float32", "--target", str(target_fp32),
            "--out", str(out)]
    proc = run_kvshot(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    held = read_records(out / "heldout.jsonl")
    assert len(held) == 2 and all(384 <= len(r["prompt_token_ids"]) <= 512 for r in held)
    assert all(len(r["response_token_ids"]) == 4 for r in held)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["params"]["long_prefix"] == 512
    assert manifest["splits"]["heldout"]["conversations"] == 2
    again = run_kvshot(*args)
    assert again.returncode == 0 and "nothing to regenerate" in again.stdout
