"""The embedded target: GGUF -> HF conversion, loaded by transformers and vLLM alike."""

from __future__ import annotations

from pathlib import Path

import torch

from kvshot_vllm.target import prepare_target
from tests.conftest import assert_one_line_error, run_kvshot

PROMPT = "The three primary colors are"


def test_vllm_greedy_matches_transformers_fp32(target_fp32: Path, data_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvshot_vllm.engine import make_llm

    tok = AutoTokenizer.from_pretrained(target_fp32)
    ids = tok(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(target_fp32, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):]
    llm = make_llm(target_fp32, data_dir, dtype="float32", max_model_len=256)
    out = llm.generate(TokensPrompt(prompt_token_ids=ids),
                       SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    del llm
    assert list(out[0].outputs[0].token_ids) == hf.tolist()
    assert "red" in tok.decode(hf).lower()  # a real pretrained model, not noise


def test_prepare_is_idempotent(target_fp32: Path, data_dir: Path) -> None:
    before = (target_fp32 / "model.safetensors").stat().st_mtime_ns
    path, reused = prepare_target(data_dir, dtype="float32")
    assert reused and path == target_fp32
    assert (target_fp32 / "model.safetensors").stat().st_mtime_ns == before
    assert (target_fp32 / "tokenizer.json").is_file()
    assert "im_start" in (target_fp32 / "chat_template.jinja").read_text()


def test_fresh_drafter_takes_the_target_lm_head_rows_of_its_vocabulary(target_fp32: Path,
                                                                      tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from kvshot_vllm.models.files import target_lm_head

    proc = run_kvshot("drafter", "init", "--target", str(target_fp32), "--paradigm", "kv",
                      "--draft-vocab-size", "4096", "--out", str(tmp_path / "kv"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    weights = load_file(tmp_path / "kv" / "model.safetensors")
    head = target_lm_head(target_fp32).float()
    assert weights["lm_head.weight"].shape == (4096, head.shape[1])
    assert torch.equal(weights["lm_head.weight"], head[:4096])
    assert not weights["d2t"].any()  # draft token i is target token i


def test_missing_gguf(tmp_path: Path) -> None:
    proc = run_kvshot("target", "prepare", "--data-dir", str(tmp_path),
                      "--gguf", str(tmp_path / "nope.gguf"))
    assert_one_line_error(proc, "GGUF file not found")


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    assert_one_line_error(
        run_kvshot("target", "prepare", "--data-dir", str(tmp_path), "--gguf", str(bad)),
        "not a GGUF file")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 40)
    assert_one_line_error(
        run_kvshot("target", "prepare", "--data-dir", str(tmp_path), "--gguf", str(truncated)),
        "cannot read GGUF")


def test_unwritable_data_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    proc = run_kvshot("target", "prepare", "--data-dir", str(blocker / "sub"))
    assert_one_line_error(proc, "is not writable")
