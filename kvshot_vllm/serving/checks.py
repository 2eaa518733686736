"""Load-time checks of a drafter against the target vLLM serves: refuse to start, with a
message that names the mismatch, rather than fail later."""

from __future__ import annotations

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.config import DrafterConfig, TargetSpec, check_fits_target


def check_against_target(cfg: DrafterConfig, vllm_config) -> None:
    check_fits_target(cfg, TargetSpec.from_hf_config(vllm_config.model_config.hf_config,
                                                     name="the served target"))
    budget, max_len = cfg.kv_budget, vllm_config.model_config.max_model_len
    if budget is not None and budget.tokens >= max_len:
        raise KVShotError(f"kv_budget.tokens {budget.tokens} is the whole context or more "
                          f"(max_model_len {max_len}): drop kv_budget to read all of it")
    if budget is not None and budget.block_size != vllm_config.cache_config.block_size:
        raise KVShotError(f"kv_budget.block_size is {budget.block_size} but the cache's blocks "
                          f"are {vllm_config.cache_config.block_size} tokens: serve with "
                          f"--block-size {budget.block_size}")
    if cfg.kv_projection != "head_concat":
        raise KVShotError("kv_projection 'linear' mixes the K/V of several target layers under "
                          "one softmax and cannot read the paged cache in place; serve a "
                          "head_concat drafter")
    memory = budget.memory if budget is not None else None
    if memory is not None and memory.chunk_tokens != budget.block_size:
        raise KVShotError(f"kv_budget.memory.chunk_tokens {memory.chunk_tokens}: a served "
                          f"memory summarises each cache block on its own, so chunk_tokens must "
                          f"be the block size {budget.block_size}")
    if memory is not None and vllm_config.parallel_config.tensor_parallel_size > 1:
        raise KVShotError("kv_budget.memory is not served under tensor parallelism yet: serve "
                          "the drafter at tensor_parallel_size 1, or without the memory")
