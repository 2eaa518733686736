"""Load-time checks of a drafter against the target vLLM serves: refuse to start, with a
message that names the mismatch, rather than fail later."""

from __future__ import annotations

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.config import DrafterConfig, TargetSpec, check_fits_target


def check_against_target(cfg: DrafterConfig, target_hf_config) -> None:
    check_fits_target(cfg, TargetSpec.from_hf_config(target_hf_config, name="the served target"))
    if cfg.kv_projection != "head_concat":
        raise KVShotError("kv_projection 'linear' mixes the K/V of several target layers under "
                          "one softmax and cannot read the paged cache in place; serve a "
                          "head_concat drafter")
