"""`vllm serve` (the console script the setup repairs) answers the openai client on 127.0.0.1."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from kvshot_vllm.server import VLLMServer, free_port, serve_command, vllm_executable

QUESTION = [{"role": "user", "content": "What is the capital of Japan?"}]
# The smallest gap, in nats, between the top two next tokens along the greedy answer that the
# test accepts. fp32 kernels differ by ~1e-5; bf16 ones by ~1e-1, which is why an answer's text
# is only asserted in fp32 and on a prompt whose margin was checked first (README, CPU notes).
MIN_MARGIN = 0.5


def greedy_with_margin(target: Path, messages: list[dict], max_new_tokens: int):
    """transformers' fp32 greedy answer (up to the end of turn) and its smallest top-2 margin."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    ids, answer, margins = torch.tensor([ids["input_ids"]]), [], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            top = model(ids).logits[0, -1].float().log_softmax(-1).topk(2)
            margins.append((top.values[0] - top.values[1]).item())
            if top.indices[0].item() == tok.eos_token_id:
                break
            answer.append(top.indices[0].item())
            ids = torch.cat([ids, top.indices[:1].view(1, 1)], 1)
    return tok.decode(answer), min(margins)


def test_vllm_console_script_works() -> None:
    out = subprocess.run([vllm_executable(), "--version"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith("0.32")


def test_serve_answers_openai_chat(target_fp32: Path, data_dir: Path, tmp_path: Path) -> None:
    import openai

    expected, margin = greedy_with_margin(target_fp32, QUESTION, 16)
    assert margin > MIN_MARGIN, (expected, margin)  # else the test would measure a near-tie
    assert "Tokyo" in expected
    port = free_port()
    cmd = serve_command(target_fp32, port, max_model_len=512, served_model_name="smollm2",
                        dtype="float32")
    with VLLMServer(cmd, port, tmp_path / "serve.log", data_dir) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        reply = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=16,
                                               messages=QUESTION)
        settings = server.engine_settings()
    assert reply.choices[0].message.content == expected
    assert reply.usage.completion_tokens > 0
    assert settings["dtype"] == "float32" and settings["custom_ops"], settings
    assert not server.alive()
