"""Fresh and saved drafter checkpoints: initial weights for the names and shapes the modules
declare (`drafter.expected_shapes`), written as config.json + model.safetensors, by the trainer
and by `kvshot drafter init` alike; vLLM's drafters load the same files.

Names follow EAGLE-3 checkpoints (`fc`, `layers.N.self_attn.q_proj`, `norm`, `lm_head`, `d2t`),
which vLLM's EAGLE-3 loader reads; the KV-reuse parts add `kv_layers.N.*` (KV-only) and
`cross.*` / `merge.*` (hybrid).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.config import DrafterConfig, validated
from kvshot_vllm.models.drafter import check_drafter_weights, expected_shapes
from kvshot_vllm.models.files import target_lm_head, target_spec
from kvshot_vllm.models.memory import stretch_bias


def init_weights(cfg: DrafterConfig, seed: int = 0, std: float = 0.02,
                 lm_head: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Fresh weights: norms at one, the gate at `gate_init`, projections N(0, std), a memory
    adaptor as the mean of each slot's stretch; `lm_head` (e.g. the target's, restricted to the
    draft vocabulary) if given."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        elif name == "merge.gate":
            weights[name] = torch.full(shape, cfg.gate_init)
        elif name.endswith("_merge.weight"):  # start as the mean of the sampled layers' K/V
            out_size, in_size = shape
            weights[name] = torch.eye(out_size).repeat(1, in_size // out_size) * out_size / in_size
        elif name.endswith(".A_log"):  # Mamba's S4D-real init: decay rates 1..N
            weights[name] = torch.log(torch.arange(1, shape[1] + 1.0)).repeat(shape[0], 1)
        elif name.endswith(".D"):
            weights[name] = torch.ones(shape)
        elif name == "d2t":
            weights[name] = torch.zeros(shape, dtype=torch.long)
        elif name.endswith("memory.query"):
            weights[name] = torch.zeros(shape)
        elif name.endswith("memory.bias"):
            weights[name] = stretch_bias(*shape)
        else:
            weights[name] = torch.randn(shape, generator=gen) * std
    if lm_head is not None:
        weights["lm_head.weight"] = lm_head.detach().float().clone()
    return weights


def save_checkpoint(cfg: DrafterConfig, weights: dict[str, torch.Tensor], out_dir: Path,
                    dtype: torch.dtype = torch.float32) -> Path:
    """config.json + model.safetensors, written beside and renamed: never half a checkpoint."""
    from safetensors.torch import save_file

    check_drafter_weights(cfg, weights)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = {n: (w if w.dtype == torch.long else w.to(dtype)).contiguous()
               for n, w in weights.items()}
    save_file(tensors, tmp / "model.safetensors")
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf_config(), indent=2))
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def init_checkpoint(target_dir: Path, out_dir: Path, seed: int = 0, **options) -> Path:
    """A fresh drafter for the target in `target_dir`, with the target's lm_head (its first
    `draft_vocab_size` rows: a fresh d2t maps draft token i to target token i)."""
    cfg = validated({"target": target_spec(target_dir), **options})
    lm_head = target_lm_head(target_dir)[: cfg.draft_vocab_size]
    weights = init_weights(cfg, seed=seed, lm_head=lm_head)
    return save_checkpoint(cfg, weights, out_dir)
