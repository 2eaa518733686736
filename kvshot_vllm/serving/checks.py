"""Load-time checks of a drafter against the target vLLM serves: refuse to start, with a
message that names the mismatch, rather than fail later."""

from __future__ import annotations

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.config import DrafterConfig, TargetSpec


def check_against_target(cfg: DrafterConfig, target_hf_config) -> None:
    served = TargetSpec.from_hf_config(target_hf_config, name="served target")
    problems = cfg.target.mismatches(served)
    problems += [f"sampled layer {i} out of range for a target with {served.num_layers} layers"
                 for i in cfg.kv_layers + cfg.aux_layers if not 0 <= i < served.num_layers]
    if problems:
        raise KVShotError(f"kvshot drafter (trained for {cfg.target.name}) does not fit the "
                          f"served target: " + "; ".join(problems))
    if cfg.kv_projection != "head_concat":
        raise KVShotError("kv_projection 'linear' mixes the K/V of several target layers under "
                          "one softmax and cannot read the paged cache in place; serve a "
                          "head_concat drafter")
