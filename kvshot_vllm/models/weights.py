"""Weight names and shapes of every drafter paradigm, declared by its modules: used
to initialise, check, save and load checkpoints, by the trainer and by the vLLM drafters alike.

Names follow EAGLE-3 checkpoints (`fc`, `layers.N.self_attn.q_proj`, `norm`, `lm_head`, `d2t`),
which vLLM's EAGLE-3 loader reads; the KV-reuse parts add `kv_layers.N.*` (KV-only) and
`cross.*` / `merge.*` (hybrid).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.config import DrafterConfig, TargetSpec, validated
from kvshot_vllm.models.memory import stretch_bias


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes: the parameters of the paradigm's own module (built on the
    meta device, which allocates nothing), plus d2t where the draft vocabulary is reduced. So
    the modules declare their weights, and a checkpoint holds exactly what they own."""
    from transformers import LlamaConfig

    from kvshot_vllm.models.drafter import Drafter  # which loads checkpoints through this module

    t = cfg.target
    shape_only = LlamaConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_kv_heads, head_dim=t.head_dim, vocab_size=t.vocab_size,
        rms_norm_eps=t.rms_norm_eps,
        rope_parameters={"rope_theta": t.rope_theta, "rope_type": "default"})
    with torch.device("meta"):
        drafter = Drafter(cfg, shape_only, torch.empty(t.vocab_size, t.hidden_size))
    shapes = {name: tuple(p.shape) for name, p in drafter.named_parameters()}
    if cfg.draft_vocab_size != t.vocab_size:
        shapes["d2t"] = (cfg.draft_vocab_size,)
    return shapes


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


def check_drafter_weights(cfg: DrafterConfig, weights: dict[str, torch.Tensor]) -> None:
    """Every expected tensor present with its shape, and no other; a clear error otherwise."""
    expected = expected_shapes(cfg)
    unknown = sorted(set(weights) - set(expected))
    if unknown:
        raise KVShotError(f"drafter checkpoint has weight {unknown[0]!r}, which no "
                          f"{cfg.paradigm} drafter owns" + (f" (and {len(unknown) - 1} more)"
                                                            if len(unknown) > 1 else ""))
    for name, shape in expected.items():
        if name not in weights:
            raise KVShotError(f"drafter checkpoint is missing weight {name!r} "
                              f"(paradigm {cfg.paradigm})")
        if tuple(weights[name].shape) != shape:
            raise KVShotError(f"drafter weight {name!r} has shape {tuple(weights[name].shape)}, "
                              f"expected {shape}")


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


# A shipped drafter's provenance and checksums (`kvshot ship`), checked wherever it is loaded.
MANIFEST = "manifest.json"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_checkpoint(checkpoint: Path) -> None:
    """Every file a checkpoint's manifest lists, present with its sha256; a checkpoint without
    a manifest (a training run's) is not checked."""
    manifest_path = Path(checkpoint) / MANIFEST
    if not manifest_path.is_file():
        return
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise KVShotError(f"{manifest_path} is not a kvshot drafter manifest ({exc})") from None
    for name, entry in files.items():
        path = Path(checkpoint) / name
        if not path.is_file():
            raise KVShotError(f"{path} is missing: {manifest_path} lists it")
        got = sha256_of(path)
        if got != entry["sha256"]:
            raise KVShotError(f"{path} does not match its checksum in {manifest_path} (sha256 "
                              f"{got[:16]}..., expected {entry['sha256'][:16]}...): the file "
                              f"is corrupt or was replaced; restore it (git checkout) or ship "
                              f"it again")


def target_spec(target_dir: Path) -> TargetSpec:
    from transformers import AutoConfig

    return TargetSpec.from_hf_config(AutoConfig.from_pretrained(target_dir), Path(target_dir).name)


def _target_tensor(target_dir: Path, names: tuple[str, ...]) -> torch.Tensor:
    """The first of `names` found in the target's safetensors files."""
    from safetensors import safe_open

    files = sorted(Path(target_dir).glob("*.safetensors"))
    for name in names:
        for f in files:
            with safe_open(f, "pt") as st:
                if name in st.keys():
                    return st.get_tensor(name)
    raise KVShotError(f"none of {', '.join(names)} in the safetensors of {target_dir}")


def target_lm_head(target_dir: Path) -> torch.Tensor:
    """The target's output embedding (tied to the input embedding in SmolLM2)."""
    return _target_tensor(target_dir, ("lm_head.weight", "model.embed_tokens.weight"))


def target_embedding(target_dir: Path) -> torch.Tensor:
    """The target's input embedding, which vLLM's EAGLE-3 drafters share."""
    return _target_tensor(target_dir, ("model.embed_tokens.weight",))


def init_checkpoint(target_dir: Path, out_dir: Path, seed: int = 0, **options) -> Path:
    """A fresh drafter for the target in `target_dir`, with the target's lm_head."""
    cfg = validated({"target": target_spec(target_dir), **options})
    weights = init_weights(cfg, seed=seed, lm_head=target_lm_head(target_dir))
    return save_checkpoint(cfg, weights, out_dir)
