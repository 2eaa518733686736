"""One config for every drafter paradigm, shared by training and serving.

A drafter checkpoint is a directory with `config.json` and `model.safetensors`. `config.json` is
an EAGLE-3 config that vLLM understands (architecture name ending in "Eagle3", `draft_vocab_size`,
`target_hidden_size`, `eagle_config`), plus a `kvshot` block: the paradigm, its options and the
identity of the target it was trained for. Hidden-only checkpoints use vLLM's own architecture
name, so they also load in stock vLLM without the plugin; those with a view of their own cache
(`kv_budget`) do not, since stock vLLM would read all of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from kvshot_vllm.errors import KVShotError, first_validation_error
from kvshot_vllm.models.budget import KVBudget
from kvshot_vllm.models.registry import (KVSHOT_ARCH, Paradigm, choices_message, paradigm,
                                         paradigm_names)


class TargetSpec(BaseModel):
    """What a drafter needs to know about its target; checked against the served target."""

    model_config = ConfigDict(extra="forbid")

    name: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    intermediate_size: int

    @classmethod
    def from_hf_config(cls, cfg, name: str) -> "TargetSpec":
        rope = getattr(cfg, "rope_parameters", None) or {}
        return cls(
            name=name,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            num_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
            rms_norm_eps=cfg.rms_norm_eps,
            intermediate_size=cfg.intermediate_size,
        )

    def mismatches(self, other: "TargetSpec") -> list[str]:
        """Fields that differ, as 'field: drafter X vs target Y' (the name is informative only)."""
        return [
            f"{k}: drafter was trained for {getattr(self, k)}, target has {getattr(other, k)}"
            for k in ("hidden_size", "vocab_size", "num_layers", "num_kv_heads", "head_dim")
            if getattr(self, k) != getattr(other, k)
        ]


class DrafterConfig(BaseModel):
    """The `kvshot` block of a checkpoint's config.json."""

    model_config = ConfigDict(extra="forbid")

    # A registered paradigm (`registry.py`).
    paradigm: str
    # EAGLE-3 self-attention layers (hidden, hybrid) or KV-reuse layers (kv).
    num_layers: int = Field(1, ge=1, le=128)
    # Target layers whose cached K/V the cross-attention reads; default: 3 uniformly spaced.
    kv_layers: list[int] = Field(default_factory=list)
    # Target layers whose hidden states EAGLE-3 fuses (low, middle, high as in EAGLE-3).
    aux_layers: list[int] = Field(default_factory=list)
    # head_concat: one attention per sampled layer over its own heads (maps onto the paged
    # attention op, so it is served in place); linear: project the concatenated K/V of all
    # sampled layers (KVShot's best offline variant; not computable in place, training only).
    kv_projection: Literal["head_concat", "linear"] = "head_concat"
    # KV-only: "shared" = every drafter layer reads all kv_layers; "aligned" = drafter layer i
    # reads target layer kv_layers[i] only (the oracle: a copy of the target's own layers).
    kv_layer_map: Literal["shared", "aligned"] = "shared"
    reapply_rope: bool = False
    # Block drafters: H-Spec's recurrent mixer (`layers.SelectiveScan`) after each layer's
    # attention, with this state size per channel; 0: attention only.
    ssm_state_size: int = Field(0, ge=0, le=64)
    gate_init: float = 0.5
    # A sparse view of the target's KV for the cross-attention (`budget.py`); None: all of it.
    kv_budget: KVBudget | None = None
    draft_vocab_size: int | None = None
    # Test hook: spoil this draft position on every other proposal (see the oracle tests).
    sabotage_step: int | None = None
    target: TargetSpec

    @field_validator("paradigm")
    @classmethod
    def _registered(cls, name: str) -> str:
        if name not in paradigm_names():
            raise ValueError(choices_message())
        return name

    @property
    def spec(self) -> Paradigm:
        """What the paradigm is (`registry.Paradigm`)."""
        return paradigm(self.paradigm)

    @model_validator(mode="after")
    def _fill_and_check(self) -> "DrafterConfig":
        n = self.target.num_layers
        if not self.kv_layers and self.spec.reads_target_kv:
            self.kv_layers = default_layers(n, 3)
        if not self.aux_layers:
            eagle3 = [2, n // 2, n - 3]  # EAGLE-3's (and vLLM's) default, where distinct
            self.aux_layers = eagle3 if n > 6 else default_layers(n, 3)
        for name in ("kv_layers", "aux_layers"):
            bad = [i for i in getattr(self, name) if not 0 <= i < n]
            if bad:
                raise ValueError(f"{name} {bad} out of range for a target with {n} layers")
        if len(set(self.aux_layers)) != len(self.aux_layers):
            # vLLM collects each target layer's hidden state once, so fc would get fewer
            raise ValueError(f"aux_layers {self.aux_layers} repeat a layer")
        if not self.spec.reads_target_kv and self.kv_layers:
            raise ValueError(f"a {self.paradigm} drafter reads no target KV: kv_layers must be "
                             f"empty")
        if self.kv_layer_map == "aligned" and (
                self.paradigm != "kv" or len(self.kv_layers) != self.num_layers):
            raise ValueError("kv_layer_map 'aligned' needs a KV-only drafter with one kv_layer "
                             "per drafter layer")
        if self.kv_budget is not None and not self.spec.reads_target_kv:
            if not self.kv_budget.draft_cache:
                raise ValueError(f"kv_budget: a {self.paradigm} drafter reads no target KV; its "
                                 f"budget can only view its own cache (draft_cache: true)")
            if self.kv_budget.memory is not None and self.kv_budget.memory.caches != "draft":
                raise ValueError(f"kv_budget.memory.caches {self.kv_budget.memory.caches!r}: a "
                                 f"{self.paradigm} drafter reads no target KV to summarise")
        if self.kv_budget is not None and self.kv_budget.draft_cache:
            if not self.spec.self_attention:
                raise ValueError(f"kv_budget.draft_cache: a {self.paradigm} drafter has no "
                                 f"cache of its own")
            # One layer's K/V depend on its inputs only; a second layer's would be computed
            # under a prefill chunk's last view at the chunk's other rows (`serving/backend.py`).
            if self.num_layers != 1:
                raise ValueError(f"kv_budget.draft_cache: served exactly for one EAGLE-3 layer, "
                                 f"not {self.num_layers}")
        if self.ssm_state_size and not self.spec.one_block:
            raise ValueError("ssm_state_size: the recurrent mixer belongs to block drafters")
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.target.vocab_size
        if not 0 < self.draft_vocab_size <= self.target.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in "
                             f"(0, {self.target.vocab_size}]")
        return self

    def layer_reads(self) -> list[list[int]]:
        """The target layers whose cache each KV-only drafter layer reads."""
        if self.kv_layer_map == "aligned":
            return [[layer] for layer in self.kv_layers]
        return [list(self.kv_layers)] * self.num_layers

    @property
    def reads_only_kv(self) -> bool:
        """Layers that attend the target's cache, and no self-attention (KV-only, block)."""
        return self.spec.reads_target_kv and not self.spec.self_attention

    @property
    def eagle_layers(self) -> int:
        """Self-attention (EAGLE-3) layers: none in KV-only and block drafters."""
        return self.num_layers if self.spec.self_attention else 0

    @property
    def uses_aux_hidden(self) -> bool:
        return self.spec.uses_aux_hidden

    @property
    def architecture(self) -> str:
        """The paradigm's, but the plugin's for any view: stock vLLM's EAGLE-3 would read a
        hidden-only drafter's whole cache."""
        return KVSHOT_ARCH if self.kv_budget is not None else self.spec.architecture

    def to_hf_config(self) -> dict:
        """config.json: vLLM's EAGLE-3 keys plus the `kvshot` block."""
        t = self.target
        return {
            "architectures": [self.architecture],
            "model_type": "llama",
            "hidden_size": t.hidden_size,
            "intermediate_size": t.intermediate_size,
            "num_hidden_layers": self.eagle_layers,
            "num_attention_heads": t.num_attention_heads,
            "num_key_value_heads": t.num_kv_heads,
            "head_dim": t.head_dim,
            "vocab_size": t.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": t.hidden_size,
            "max_position_embeddings": 32768,
            "rms_norm_eps": t.rms_norm_eps,
            "rope_parameters": {"rope_theta": t.rope_theta, "rope_type": "default"},
            "tie_word_embeddings": False,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": self.aux_layers,
                "use_aux_hidden_state": self.uses_aux_hidden,
            },
            "kvshot": self.model_dump(mode="json"),
        }


def check_fits_target(cfg: DrafterConfig, target: TargetSpec) -> None:
    """Refuse a drafter made for another target, naming every field that differs."""
    problems = cfg.target.mismatches(target)
    problems += [f"sampled layer {i} out of range for a target with {target.num_layers} layers"
                 for i in cfg.kv_layers + cfg.aux_layers if not 0 <= i < target.num_layers]
    if problems:
        raise KVShotError(f"kvshot drafter (trained for {cfg.target.name}) does not fit "
                          f"{target.name}: " + "; ".join(problems))


def default_layers(num_target_layers: int, count: int) -> list[int]:
    """`count` uniformly spaced layers, first and last included."""
    if count == 1:
        return [num_target_layers - 1]
    step = (num_target_layers - 1) / (count - 1)
    return sorted({round(i * step) for i in range(count)})


def load_drafter_config(checkpoint: str | Path | dict) -> DrafterConfig:
    """The `kvshot` block of a checkpoint (dir, config.json path or dict), validated."""
    if isinstance(checkpoint, dict):
        raw, where = checkpoint, "config"
    else:
        path = Path(checkpoint)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise KVShotError(f"no drafter config at {path}")
        raw, where = json.loads(path.read_text()), str(path)
    block = raw.get("kvshot")
    if block is None:
        raise KVShotError(f"{where} has no 'kvshot' block: not a kvshot drafter checkpoint")
    return validated(block, where)


def validated(fields: dict, where: str = "drafter config") -> DrafterConfig:
    """A DrafterConfig, or a one-line error naming the first bad field."""
    try:
        return DrafterConfig.model_validate(fields)
    except ValidationError as exc:
        loc, msg = first_validation_error(exc)
        raise KVShotError(f"invalid {where}: {loc or 'config'}: {msg}") from None
