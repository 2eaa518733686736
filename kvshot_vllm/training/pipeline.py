"""The training pipeline as the CLI runs it: features on demand, a training run per drafter,
and KVShot's comparison (`study`) of every paradigm on the same data and budget."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from kvshot_vllm.errors import KVShotError, first_validation_error
from kvshot_vllm.models.config import DrafterConfig, default_layers, validated
from kvshot_vllm.models.files import target_spec
from kvshot_vllm.training.features import (FeatureSet, FeatureSpec, LiveFeatures,
                                           extract_features)
from kvshot_vllm.training.schedule import TrainingData
from kvshot_vllm.training.ttt import PRESETS, TrainConfig, Trainer

# What the features hold by default: the aux layers EAGLE-3 fuses and every layer a default
# KV-reuse drafter reads, so that all paradigms train on one extraction.
MAX_LEN = 1024


def sequence_limit(dataset: Path) -> int:
    """The feature length that holds every sequence of `dataset`: MAX_LEN, or for a long-context
    data set (`kvshot data prepare --long`) its prompts and replies whole."""
    params = Path(dataset) / "params.json"
    p = json.loads(params.read_text()) if params.is_file() else {}
    if p.get("long_prefix") is None:
        return MAX_LEN
    return max(MAX_LEN, p["long_prefix"] + p["max_new_tokens"])


def feature_spec(target_dir: Path, kv_layers: list[int] | None = None,
                 max_len: int = MAX_LEN, forward_dtype: str = "float32",
                 teacher_topk: int = 0) -> FeatureSpec:
    n = target_spec(target_dir).num_layers
    probe = validated({"paradigm": "kv", "target": target_spec(target_dir)})
    return FeatureSpec(aux_layers=tuple(probe.aux_layers),
                       kv_layers=tuple(kv_layers or default_layers(n, 3)), max_len=max_len,
                       forward_dtype=forward_dtype, teacher_topk=teacher_topk)


def features_for(data_dir: Path, target_dir: Path, dataset: Path, split: str,
                 spec: FeatureSpec, device: str = "cpu", live: bool = False
                 ) -> FeatureSet | LiveFeatures:
    """The features of `split`: computed on `device` as batches ask with `live`, else cached,
    extracted first (on `device`) if missing or unfinished."""
    root = data_dir / "features" / Path(dataset).name
    path = root / spec.dir_name(split)
    if live:
        return LiveFeatures.create(path.with_name(path.name + "-live"), target_dir, dataset,
                                   split, spec, device)
    if not (path / "manifest.json").is_file():
        extract_features(target_dir, dataset, split, root, spec, device)
    return FeatureSet(path)


def train_config(preset: str, **overrides) -> TrainConfig:
    if preset not in PRESETS:
        raise KVShotError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    fields = {**PRESETS[preset].model_dump(), **{k: v for k, v in overrides.items()
                                                 if v is not None}}
    try:
        return TrainConfig.model_validate(fields)
    except ValidationError as exc:  # pydantic's first message, on one line
        loc, msg = first_validation_error(exc)
        raise KVShotError(f"invalid training settings: {loc or 'settings'}: {msg}") from None


def drafter_config(target_dir: Path, cfg: TrainConfig, init: Path | None = None,
                   **options) -> DrafterConfig:
    """The drafter's config; a warm start fixes the draft vocabulary to the checkpoint's unless
    the options give one (a larger one grows it, `ttt.grown_vocabulary`)."""
    fields = {k: v for k, v in options.items() if v is not None}
    vocab = cfg.draft_vocab_size
    if init is not None:
        src = json.loads((Path(init) / "config.json").read_text()) \
            if (Path(init) / "config.json").is_file() else {}
        vocab = src.get("draft_vocab_size", vocab)
    return validated({"target": target_spec(target_dir), "draft_vocab_size": vocab, **fields})


def train(data_dir: Path, target_dir: Path, datasets: list[Path], run_dir: Path,
          cfg: TrainConfig, init: Path | None = None, progress: bool = True,
          forward_dtype: str = "float32", device: str = "cpu", live_features: bool = False,
          mix: list[float] | None = None, **options) -> Path:
    """Train on the training split of one data set, or of several in the proportions `mix`
    (`TrainingData`; default: as many steps from each as it has sequences)."""
    dcfg = drafter_config(target_dir, cfg, init, **options)
    layers = sorted(set(dcfg.kv_layers) | set(default_layers(dcfg.target.num_layers, 3)))
    parts = [features_for(data_dir, target_dir, dataset, "train",
                          feature_spec(target_dir, layers, sequence_limit(dataset),
                                       forward_dtype=forward_dtype,
                                       teacher_topk=cfg.soft_targets),
                          device, live=live_features)
             for dataset in datasets]
    trainer = Trainer(run_dir, dcfg, cfg, target_dir, TrainingData(parts, mix), init=init,
                      device=device)
    if trainer.fresh is not None:
        # modules by their top name, a memory adaptor by its own (it may sit inside a layer)
        fresh = {n[: n.index(".memory.") + 7] if ".memory." in n else n.split(".")[0]
                 for n in trainer.fresh}
        print(f"warm start from {init}: fresh {', '.join(sorted(fresh)) or 'nothing'}")
    return trainer.train(progress=progress)


# The KVShot comparison: name -> (drafter options, warm start from another run's checkpoint)
STUDY = {
    "hidden": ({"paradigm": "hidden"}, None),
    "kv-1L": ({"paradigm": "kv", "num_layers": 1}, None),
    "kv-2L": ({"paradigm": "kv", "num_layers": 2}, None),
    "hybrid": ({"paradigm": "hybrid"}, None),
    "hybrid-warm": ({"paradigm": "hybrid"}, "hidden"),
    "block": ({"paradigm": "block"}, None),
    "block-ssm": ({"paradigm": "block", "ssm_state_size": 8}, None),
}


def run_study(data_dir: Path, target_dir: Path, dataset: Path, preset: str, out: Path,
              command: str, only: list[str] | None = None,
              forward_dtype: str = "float32") -> dict:
    """Train the study's drafters (finished runs are reused), then diagnose them together."""
    from kvshot_vllm.training.diagnostics import diagnose, write_report

    names = only or list(STUDY)
    unknown = sorted(set(names) - set(STUDY))
    if unknown:
        raise KVShotError(f"unknown study drafters {unknown}; choose from {list(STUDY)}")
    cfg = train_config(preset)
    runs = data_dir / "runs" / f"study-{preset}"
    ckpts = {}
    for name in names:
        options, warm_from = STUDY[name]
        init = None
        if warm_from is not None:
            init = ckpts.get(warm_from) or runs / warm_from / "checkpoint"
            if not (init / "config.json").is_file():
                raise KVShotError(f"{name} warm-starts from {warm_from}: train it first")
        print(f"== {name}")
        ckpts[name] = train(data_dir, target_dir, [dataset], runs / name, cfg, init=init,
                            forward_dtype=forward_dtype, **options)
    features = features_for(data_dir, target_dir, dataset, "heldout",
                            feature_spec(target_dir, forward_dtype=forward_dtype))
    results = diagnose(ckpts, target_dir, features)
    for name, (_, warm_from) in STUDY.items():
        if name in results:
            results[name]["warm_start"] = warm_from
    write_report(results, out, command)
    return results
