"""What the drafters read from disk besides their own weights: the target's config and tensors
from its directory, and a shipped checkpoint's manifest of checksums (`kvshot ship`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.config import TargetSpec


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


def checkpoint_files(checkpoint: Path) -> list[Path]:
    """The safetensors of a checkpoint: the file itself, or those of its directory."""
    path = Path(checkpoint)
    return [path] if path.is_file() else sorted(path.glob("*.safetensors"))


def tensor_file(checkpoint: Path, name: str) -> Path | None:
    """The safetensors file of `checkpoint` (a file, or a directory of them) holding `name`."""
    from safetensors import safe_open

    for f in checkpoint_files(checkpoint):
        with safe_open(f, "pt") as st:
            if name in st.keys():
                return f
    return None


def _target_tensor(target_dir: Path, names: tuple[str, ...]) -> torch.Tensor:
    """The first of `names` found in the target's safetensors files."""
    from safetensors import safe_open

    for name in names:
        if (f := tensor_file(target_dir, name)) is not None:
            with safe_open(f, "pt") as st:
                return st.get_tensor(name)
    raise KVShotError(f"none of {', '.join(names)} in the safetensors of {target_dir}")


def target_lm_head(target_dir: Path) -> torch.Tensor:
    """The target's output embedding (tied to the input embedding in SmolLM2)."""
    return _target_tensor(target_dir, ("lm_head.weight", "model.embed_tokens.weight"))


def target_embedding(target_dir: Path) -> torch.Tensor:
    """The target's input embedding, which vLLM's EAGLE-3 drafters share."""
    return _target_tensor(target_dir, ("model.embed_tokens.weight",))
