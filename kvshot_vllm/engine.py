"""Building vLLM engines with settings that work on both the CPU build and GPUs.

Everything that starts vLLM (data regeneration, checks, tests, the bench) goes through here, so
the CPU quirks (KV cache sized by an env var, a memory fraction the NUMA node must satisfy, the
cache root) are handled once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

CPU_KV_CACHE_GIB = "1"
CPU_MEMORY_FRACTION = 0.3


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def cpu_has_native_bf16() -> bool:
    """Without AVX512-BF16 or AMX, bf16 matmuls are emulated: fp32 is much faster for batched
    decoding, a little slower at batch 1 (bench/cpu_dtype_speed.py)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_dtype() -> str:
    return "auto" if not on_cpu() or cpu_has_native_bf16() else "float32"


def configure_vllm_env(data_dir: Path | None = None) -> None:
    """Environment defaults for vLLM and every process it spawns (explicit settings win)."""
    if data_dir is not None:
        os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(data_dir) / "vllm-cache"))
    if on_cpu():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)


def engine_kwargs(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` / `vllm serve` suited to this machine."""
    kwargs: dict[str, Any] = {"seed": 0, "dtype": default_dtype()}
    if on_cpu():
        kwargs.update(gpu_memory_utilization=CPU_MEMORY_FRACTION, enforce_eager=True)
    kwargs.update(overrides)
    return kwargs


def make_llm(model: str | Path, data_dir: Path | None = None, **overrides: Any):
    """A `vllm.LLM` for `model` with this machine's defaults and `overrides`."""
    configure_vllm_env(data_dir)
    from vllm import LLM

    return LLM(model=str(model), **engine_kwargs(**overrides))


def spec_decode_counters(llm) -> dict[str, Any]:
    """vLLM's speculative-decoding counters of an offline engine (drafts, draft tokens,
    accepted tokens, accepted per position) and its preemptions, without the "vllm:" prefix."""
    return {m.name.removeprefix("vllm:spec_decode_"): getattr(m, "values", None)
            or getattr(m, "value", 0) for m in llm.get_metrics()
            if m.name.startswith(("vllm:spec_decode", "vllm:num_preemptions"))}
