"""RoPE of the plugin's draft layers: vLLM's torch-native form against the platform kernel.

The plugin's layers run eagerly, outside the graph vLLM compiles, and vLLM disables its custom
ops when it compiles, so an eager call of its RoPE ran the native form (a dozen small torch
ops); the served drafters now call the platform kernel (`serving/drafter.platform_kernel`).
Side by side in one run, on the target's heads, for one attention (an EAGLE-3 self-attention)
and three side by side (a cross-attention over three sampled target layers), at the rows of one
draft pass: 1 (concurrency 1), 4 (a block drafter's rows), 16 (concurrency 16).

    python bench/rope_kernel.py [--out bench/results/rope_kernel]
"""

from __future__ import annotations

import argparse

import torch

from cpu_gemm import ROWS, median_us

GROUPS = (1, 3)


def main() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from kvshot_vllm.engine import default_dtype
    from kvshot_vllm.models.files import target_spec
    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.results import write_results
    from kvshot_vllm.serving.drafter import platform_kernel
    from kvshot_vllm.target import prepare_target

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/rope_kernel")
    a = ap.parse_args()
    spec = target_spec(prepare_target(resolve_data_dir(), "float32")[0])
    dtype = torch.float32 if default_dtype() == "float32" else torch.bfloat16
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(spec.head_dim, max_position=4096,
                        rope_parameters={"rope_theta": spec.rope_theta, "rope_type": "default"},
                        dtype=dtype)
        kernel = platform_kernel(rope)
        runs = {}
        for groups in GROUPS:
            q_size = groups * spec.num_attention_heads * spec.head_dim
            kv_size = groups * spec.num_kv_heads * spec.head_dim
            for rows in ROWS:
                # q and k as the layers have them: views of one fused projection's output
                qkv = torch.randn(rows, q_size + 2 * kv_size, dtype=dtype)
                q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
                positions = torch.randint(0, 4096, (rows,))
                runs[f"{groups}x{rows}"] = {
                    "native": median_us(lambda: rope.forward_native(positions, q, k)),
                    "kernel": median_us(lambda: kernel(positions, q, k))}
    lines = [f"RoPE of the plugin's draft layers on {spec.num_attention_heads} query / "
             f"{spec.num_kv_heads} KV heads of {spec.head_dim}, {str(dtype).removeprefix('torch.')}"
             f": vLLM's torch-native form against the platform kernel, microseconds per call "
             f"(median of 7 x 200 calls), torch threads {torch.get_num_threads()}.",
             "Regenerate: `python bench/rope_kernel.py`", "",
             "| attentions side by side | rows | native us | kernel us | speedup |",
             "|---|---|---|---|---|"]
    for key, t in runs.items():
        groups, rows = key.split("x")
        lines.append(f"| {groups} | {rows} | {t['native']:.1f} | {t['kernel']:.1f} | "
                     f"{t['native'] / t['kernel']:.2f}x |")
    write_results(a.out, {"runs": runs, "dtype": str(dtype), "rows": ROWS,
                          "torch_threads": torch.get_num_threads()}, lines)


if __name__ == "__main__":
    main()
