"""The oracle drafter: a KV-only drafter made of the target's own layers.

Drafter layer i reads target layer i's paged cache for the verified prefix and its own K/V for
the tokens it drafted. With all layers and correct in-place reads it computes exactly what the
target computes, so vLLM accepts (nearly) every draft: an end-to-end check of the reads, the
masking and the speculative-slot writes. It is a test instrument, not a fast drafter.
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from kvshot_vllm.models.config import validated
from kvshot_vllm.models.files import target_lm_head, target_spec
from kvshot_vllm.models.weights import save_checkpoint

# drafter name suffix <- target name suffix, per layer
LAYER_WEIGHTS = {
    "input_norm.weight": "input_layernorm.weight",
    "post_norm.weight": "post_attention_layernorm.weight",
    "cross.q_proj.weight": "self_attn.q_proj.weight",
    "cross.k_proj.weight": "self_attn.k_proj.weight",
    "cross.v_proj.weight": "self_attn.v_proj.weight",
    "cross.o_proj.weight": "self_attn.o_proj.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}


def build_oracle(target_dir: Path, out_dir: Path, sabotage_step: int | None = None) -> Path:
    spec = target_spec(target_dir)
    n = spec.num_layers
    cfg = validated({"paradigm": "kv", "num_layers": n, "kv_layers": list(range(n)),
                     "kv_layer_map": "aligned", "sabotage_step": sabotage_step, "target": spec})
    target = {}
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        target |= load_file(f)
    weights = {f"kv_layers.{i}.{ours}": target[f"model.layers.{i}.{theirs}"]
               for i in range(n) for ours, theirs in LAYER_WEIGHTS.items()}
    weights["norm.weight"] = target["model.norm.weight"]
    weights["lm_head.weight"] = target_lm_head(target_dir)
    return save_checkpoint(cfg, weights, out_dir)
