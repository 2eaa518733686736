"""`vllm serve` (the console script the setup repairs) answers the openai client on 127.0.0.1."""

from __future__ import annotations

import subprocess
from pathlib import Path

from kvshot_vllm.server import VLLMServer, free_port, serve_command, vllm_executable


def test_vllm_console_script_works() -> None:
    out = subprocess.run([vllm_executable(), "--version"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith("0.32")


def test_serve_answers_openai_chat(target_bf16: Path, data_dir: Path, tmp_path: Path) -> None:
    import openai

    port = free_port()
    cmd = serve_command(target_bf16, port, max_model_len=512, served_model_name="smollm2")
    with VLLMServer(cmd, port, tmp_path / "serve.log", data_dir) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        reply = client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=16,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0
    assert not server.alive()
