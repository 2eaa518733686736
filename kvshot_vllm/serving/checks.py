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
    if budget is not None and budget.memory is not None:
        raise KVShotError("kv_budget.memory: a compressed draft memory is trained and diagnosed "
                          "offline (kvshot train / kvshot diagnose) but not served yet; serve "
                          "the drafter without it (a streaming kv_budget, or none)")
