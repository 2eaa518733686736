"""Target features for training and diagnostics, computed once with transformers and cached.

For every sequence (prompt + regenerated response) of a data split the target's forward pass
gives:
    labels      [T]              the target's greedy next token at each position
    aux         [T, A * hidden]  the input of each aux layer (what vLLM hands EAGLE-3)
    k.L, v.L    [T, KVH, d]      K (after RoPE) and V that the target caches for layer L: the
                                 exact contents of vLLM's paged cache that a drafter reads
    teacher_ids, teacher_logits  [T, K]  with `teacher_topk` K: the target's K most likely next
                                 tokens and their logits, the soft targets of training
Shards of `shard_size` sequences are safetensors files written beside and renamed into place, so
a killed extraction resumes at the first missing shard. A shard that the same extraction of
another data set already holds, the same token ids in the same order (a grown data set starts
with the smaller one's records, `data.py`), is linked from there instead of recomputed.
`manifest.json` records the target, the layers, the dtype and the measured throughput of
extraction and of loading back.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import torch

from kvshot_vllm.data import read_records
from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.config import TargetSpec
from kvshot_vllm.models.drafter import TargetFeatures
from kvshot_vllm.models.files import target_spec

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class FeatureSpec:
    aux_layers: tuple[int, ...]
    kv_layers: tuple[int, ...]
    max_len: int = 1024
    dtype: str = "bfloat16"  # what is stored
    shard_size: int = 16
    # What the target's forward runs in: bf16 is 2.5x fp32 on AMX (bench/results/
    # train_speed.md), and its labels are the greedy tokens of a bf16 engine, which is what
    # vLLM serves on such CPUs by default (README, "CPU notes").
    forward_dtype: str = "float32"
    # 0: the target's greedy token alone (`labels`); K: also its top K (`TrainConfig.soft_targets`)
    teacher_topk: int = 0

    def dir_name(self, split: str) -> str:
        aux = "-".join(map(str, self.aux_layers))
        kv = "-".join(map(str, self.kv_layers))
        forward = "" if self.forward_dtype == "float32" else f"-fwd-{self.forward_dtype}"
        teacher = f"-top{self.teacher_topk}" if self.teacher_topk else ""
        return f"{split}-aux{aux}-kv{kv}-len{self.max_len}-{self.dtype}{forward}{teacher}"


def bytes_per_token(spec: FeatureSpec, target: TargetSpec) -> int:
    """What one token's features take in a shard: the aux hidden states, K and V of each KV
    layer, the label and the token id (int32), and the teacher's top K ids and logits."""
    size = DTYPES[spec.dtype].itemsize
    kv = 2 * target.num_kv_heads * target.head_dim * size
    return (len(spec.aux_layers) * target.hidden_size * size + len(spec.kv_layers) * kv + 4 + 4
            + spec.teacher_topk * (4 + size))


def check_room(out: Path, need: int) -> None:
    """Refuse an extraction that would fill the disk hours in, before it starts."""
    free = shutil.disk_usage(out).free
    if need > free:
        raise KVShotError(
            f"the features to extract into {out} need about {need / 1e9:.1f} GB and its disk has "
            f"{free / 1e9:.1f} GB free; free some, or have the training compute them as batches "
            f"ask (`kvshot train --features live`), which stores nothing")


def sequences(dataset_dir: Path, split: str, max_len: int) -> list[tuple[str, list[int], int]]:
    """(id, token ids, prompt length) per record of the split, cut to `max_len` tokens."""
    path = Path(dataset_dir) / f"{split}.jsonl"
    records = read_records(path)
    if not records:
        raise KVShotError(f"no {split} records in {path}; run `kvshot data prepare` first")
    out = []
    for r in records:
        ids = (r["prompt_token_ids"] + r["response_token_ids"])[:max_len]
        if len(ids) >= len(r["prompt_token_ids"]) + 2:  # at least two response tokens
            out.append((r["id"], ids, len(r["prompt_token_ids"])))
    return out


@torch.inference_mode()
def batched_forward(model, ids: torch.Tensor, spec: FeatureSpec,
                    label_rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The features of right-padded sequences ids [B, T], on the model's device, in
    `spec.dtype`: labels [B, T], aux [B, T, A * hidden], k.L / v.L [B, KVH, T, d], and with
    `spec.teacher_topk` K teacher_ids / teacher_logits [B, T, K]. No attention mask is needed: a
    causal row never sees the padding after it.

    With `label_rows` [B, T] (bool) the labels and the teacher are computed at those positions
    only, zero elsewhere: the output head over 49,152 tokens, and its fp32 copy, would be
    thrown away at every other position, and in multi-turn data most positions are prompt."""
    dtype = DTYPES[spec.dtype]
    out = model.get_decoder()(ids.to(model.device), output_hidden_states=True, use_cache=True)
    last = out.last_hidden_state
    rows = (torch.ones(ids.shape, dtype=torch.bool) if label_rows is None
            else label_rows).to(last.device)
    logits = model.get_output_embeddings()(last[rows]).float()  # [rows, vocab]

    def scattered(values: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        full = torch.zeros(*ids.shape, *values.shape[1:], dtype=out_dtype, device=last.device)
        full[rows] = values.to(out_dtype)
        return full

    # hidden_states[L] is the input of layer L, which is what vLLM collects as aux layer L.
    feats = {"labels": scattered(logits.argmax(-1), torch.int32),
             "aux": torch.cat([out.hidden_states[i] for i in spec.aux_layers], -1).to(dtype)}
    if spec.teacher_topk:
        top = logits.topk(spec.teacher_topk, dim=-1)
        feats["teacher_ids"] = scattered(top.indices, torch.int32)
        feats["teacher_logits"] = scattered(top.values, dtype)
    cache = out.past_key_values
    for layer in spec.kv_layers:
        feats[f"k.{layer}"] = cache.layers[layer].keys.to(dtype)
        feats[f"v.{layer}"] = cache.layers[layer].values.to(dtype)
    return feats


def target_forward(model, ids: list[int], spec: FeatureSpec) -> dict[str, torch.Tensor]:
    """One sequence's features (see the module docstring), in `spec.dtype`, on the CPU."""
    return forward_sequences(model, [ids], spec)[0]


def right_padded(seqs: list[list[int]]) -> torch.Tensor:
    """ids [B, longest] of the sequences, zeros after each one's end."""
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for r, seq in enumerate(seqs):
        ids[r, :len(seq)] = torch.tensor(seq)
    return ids


def forward_sequences(model, seqs: list[list[int]], spec: FeatureSpec,
                      batch_tokens: int = 1) -> list[dict[str, torch.Tensor]]:
    """The features of each sequence (`target_forward`), from padded forwards of up to
    `batch_tokens` tokens (padding included) over sequences of similar lengths: on 2 CPU cores
    a batch of a few runs somewhat faster than one at a time (`EXTRACT_BATCH_TOKENS`)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[dict[str, torch.Tensor]] = [{} for _ in seqs]
    start = 0
    while start < len(order):
        # the longest sequence of a batch is its last: grow it while the padded batch fits
        end = start + 1
        while end < len(order) and (end + 1 - start) * len(seqs[order[end]]) <= batch_tokens:
            end += 1
        group = order[start:end]
        feats = batched_forward(model, right_padded([seqs[i] for i in group]), spec)
        for r, i in enumerate(group):
            n = len(seqs[i])
            out[i] = {name: (t[r, :, :n].transpose(0, 1) if name[:2] in ("k.", "v.")
                             else t[r, :n]).contiguous().cpu() for name, t in feats.items()}
        start = end
    return out


def _claim(out: Path, target_dir: Path, dataset_dir: Path, split: str,
           seqs: list[tuple[str, list[int], int]], spec: FeatureSpec, live: bool = False) -> None:
    """Write `out/params.json`, what the features there are made from; refuse a directory that
    holds features of other data or settings."""
    params = {"target": str(Path(target_dir).resolve()),
              "dataset": str(Path(dataset_dir).resolve()), "split": split,
              "ids": [s[0] for s in seqs], **spec.__dict__, "aux_layers": list(spec.aux_layers),
              "kv_layers": list(spec.kv_layers), **({"live": True} if live else {})}
    out.mkdir(parents=True, exist_ok=True)
    params_path = out / "params.json"
    # settings added to FeatureSpec since a directory was made take their defaults
    defaults = {f.name: f.default for f in fields(FeatureSpec) if f.default is not MISSING}
    if params_path.exists() and {**defaults, **json.loads(params_path.read_text())} != params:
        raise KVShotError(f"{out} holds features made from other data or settings; delete it "
                          f"to rebuild")
    params_path.write_text(json.dumps(params))


def load_target(target_dir: Path, spec: FeatureSpec, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=DTYPES[spec.forward_dtype])
    return model.to(device).eval()


# Padded tokens per extraction forward: 1.16x the tokens/s of one sequence at a time on 2 Intel
# AMX cores, 1.13x at 4096, 1.01x at 8192 (bench/results/feature_speed.md); in bf16 1% of the
# greedy labels then differ from one-at-a-time's, a near-tie either way.
EXTRACT_BATCH_TOKENS = 2048


def extract_features(target_dir: Path, dataset_dir: Path, split: str, out_root: Path,
                     spec: FeatureSpec, device: str = "cpu",
                     batch_tokens: int = EXTRACT_BATCH_TOKENS) -> Path:
    """Features of every sequence of `split`, under `out_root/spec.dir_name(split)`, with the
    target's forward on `device`, in padded batches of up to `batch_tokens` tokens
    (`forward_sequences`)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    out = Path(out_root) / spec.dir_name(split)
    out.mkdir(parents=True, exist_ok=True)
    seqs = sequences(dataset_dir, split, spec.max_len)
    _claim(out, target_dir, dataset_dir, split, seqs, spec)

    shards = [seqs[i:i + spec.shard_size] for i in range(0, len(seqs), spec.shard_size)]
    todo = [i for i in range(len(shards)) if not (out / f"shard-{i:05d}.safetensors").exists()]
    donors = finished_shards(Path(out_root).parent, out, target_dir) if todo else {}
    found = {i: donors[key] for i in todo
             if (key := shard_key([ids for _, ids, _ in shards[i]],
                                  [p for _, _, p in shards[i]])) in donors}
    for i, donor in found.items():
        tmp = out / f"shard-{i:05d}.partial"
        tmp.unlink(missing_ok=True)
        try:
            os.link(donor, tmp)
        except OSError:  # another file system
            shutil.copyfile(donor, tmp)
        tmp.rename(out / f"shard-{i:05d}.safetensors")
    todo = [i for i in todo if i not in found]
    check_room(out, bytes_per_token(spec, target_spec(target_dir))
               * sum(len(ids) for i in todo for _, ids, _ in shards[i]))
    linked = sum(len(shards[i]) for i in found)
    model = None
    tokens, start = 0, time.perf_counter()
    with tqdm(total=sum(len(shards[i]) for i in todo), desc=f"features {split}",
              unit="seq") as bar:
        for i in todo:
            if model is None:
                model = load_target(target_dir, spec, device)
            parts = forward_sequences(model, [ids for _, ids, _ in shards[i]], spec,
                                      batch_tokens)
            tensors = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
            lengths = torch.tensor([len(ids) for _, ids, _ in shards[i]])
            tensors["input_ids"] = torch.tensor([t for _, ids, _ in shards[i] for t in ids],
                                                dtype=torch.int32)
            tensors["offsets"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
            tensors["prompt_len"] = torch.tensor([p for _, _, p in shards[i]], dtype=torch.int32)
            tmp = out / f"shard-{i:05d}.partial"
            save_file(tensors, tmp)
            tmp.rename(out / f"shard-{i:05d}.safetensors")
            tokens += int(lengths.sum())
            bar.update(len(shards[i]))
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
    extract_s = time.perf_counter() - start

    load_start = time.perf_counter()
    feature_set = FeatureSet(out)
    load_s = time.perf_counter() - load_start
    manifest = {"sequences": len(feature_set), "tokens": feature_set.num_tokens,
                "shards": len(shards), "bytes": sum(f.stat().st_size for f in out.glob("shard-*")),
                "last_run": {"linked_sequences": linked,
                             "extracted_tokens": tokens, "extract_s": round(extract_s, 2),
                             "extract_tok_s": round(tokens / extract_s, 1) if tokens else None,
                             "load_s": round(load_s, 3),
                             "load_tok_s": round(feature_set.num_tokens / load_s, 1)}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


def shard_key(seqs: list[list[int]], prompt_lens: list[int]) -> str:
    """What decides a shard's features besides the extraction settings: its sequences' token
    ids and prompt lengths, in order (a digest)."""
    digest = hashlib.sha256()
    for ids, prompt in zip(seqs, prompt_lens):
        digest.update(torch.tensor([prompt, len(ids), *ids], dtype=torch.int32).numpy().tobytes())
    return digest.hexdigest()


def finished_shards(features_root: Path, out: Path, target_dir: Path) -> dict[str, Path]:
    """`shard_key` -> shard file of every finished feature set under `features_root` (one
    directory per data set) made like `out` (the same directory name: the same layers, length,
    dtypes) from the same target, `out` itself excepted."""
    from safetensors import safe_open

    found: dict[str, Path] = {}
    target = str(Path(target_dir).resolve())
    for other in features_root.glob(f"*/{out.name}"):
        if other.resolve() == out.resolve() or not (other / "manifest.json").is_file():
            continue
        if json.loads((other / "params.json").read_text()).get("target") != target:
            continue
        for path in sorted(other.glob("shard-*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                ids, offsets, prompts = (f.get_tensor(n).tolist()
                                         for n in ("input_ids", "offsets", "prompt_len"))
            found[shard_key([ids[a:b] for a, b in zip(offsets, offsets[1:])], prompts)] = path
    return found


class _Shard:
    """One shard file, read lazily: its offsets and prompt lengths are small and kept, every
    other tensor is sliced out of the memory-mapped file on demand. A training set's features
    are tens of GB at scale (bytes per token in the extraction manifest), more than the
    machine's memory, and the page cache keeps what is read often."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = path
        with safe_open(str(path), framework="pt") as f:
            self.offsets = f.get_tensor("offsets")
            self.prompt_len = f.get_tensor("prompt_len")
            self.names = [n for n in f.keys() if n not in ("offsets", "prompt_len")]
        self._file = None

    def rows(self, a: int, b: int) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        if self._file is None:
            self._file = safe_open(str(self.path), framework="pt")
        return {name: self._file.get_slice(name)[a:b] for name in self.names}


class SplitFeatures:
    """What the features of one split are made from (`params.json`), and the checks on it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        params_path = self.path / "params.json"
        if not params_path.is_file():
            raise KVShotError(f"no features at {self.path}; `kvshot train` and `kvshot diagnose` extract them when missing")
        self.params = json.loads(params_path.read_text())
        self.kv_layers = list(self.params["kv_layers"])
        self.aux_layers = list(self.params["aux_layers"])

    def response_token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token occurs in the split's responses, read from its data set: the
        target's greedy tokens as regenerated, counted with no forward (`response_labels`, the
        features' own, differ where a near-tie flipped)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for _, ids, prompt_len in sequences(Path(self.params["dataset"]), self.params["split"],
                                            self.params["max_len"]):
            counts += torch.bincount(torch.tensor(ids[prompt_len:]), minlength=vocab_size)
        return counts

    def check_layers(self, aux_layers: list[int], kv_layers: list[int], uses_aux: bool) -> None:
        missing = sorted(set(kv_layers) - set(self.kv_layers))
        if missing:
            raise KVShotError(f"features at {self.path} hold K/V of layers {self.kv_layers}, "
                              f"not {missing}; extract them with --kv-layers")
        if uses_aux and list(aux_layers) != self.aux_layers:
            raise KVShotError(f"features at {self.path} fuse aux layers {self.aux_layers}, the "
                              f"drafter wants {list(aux_layers)}")


def open_features(path: Path, device: str = "cpu") -> "FeatureSet | LiveFeatures":
    """The features a run trained on (`run.json`'s "features"), cached or live."""
    live = json.loads((Path(path) / "params.json").read_text()).get("live") \
        if (Path(path) / "params.json").is_file() else False
    return LiveFeatures(path, device) if live else FeatureSet(path)


class FeatureSet(SplitFeatures):
    """The cached features of one split, indexed by sequence, read from disk as batches ask."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        files = sorted(self.path.glob("shard-*.safetensors"))
        expected = -(-len(self.params["ids"]) // self.params["shard_size"])
        if len(files) != expected:
            raise KVShotError(f"{self.path} has {len(files)} of {expected} shards; rerun the "
                              f"extraction to finish it")
        self.shards = [_Shard(f) for f in files]
        self.index = [(s, j) for s, shard in enumerate(self.shards)
                      for j in range(len(shard.prompt_len))]

    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_tokens(self) -> int:
        return sum(int(s.offsets[-1]) for s in self.shards)

    def length(self, i: int) -> int:
        s, j = self.index[i]
        off = self.shards[s].offsets
        return int(off[j + 1] - off[j])

    def prompt_length(self, i: int) -> int:
        s, j = self.index[i]
        return int(self.shards[s].prompt_len[j])

    def response_labels(self) -> Iterator[torch.Tensor]:
        """Per sequence, the target's greedy tokens from the last prompt position on."""
        for i in range(len(self)):
            item = self.item(i)
            yield item["labels"][item["prompt_len"] - 1:]

    def item(self, i: int) -> dict[str, torch.Tensor | int]:
        s, j = self.index[i]
        shard = self.shards[s]
        item: dict[str, torch.Tensor | int] = shard.rows(int(shard.offsets[j]),
                                                          int(shard.offsets[j + 1]))
        item["prompt_len"] = int(shard.prompt_len[j])
        return item

    def batch(self, indices: list[int], kv_layers: list[int], uses_aux: bool
              ) -> tuple[TargetFeatures, torch.Tensor, torch.Tensor]:
        """(features, labels [B, T], trainable [B, T]) for sequences `indices`, right-padded.

        trainable[p]: position p's label is a response token the target chose (from the last
        prompt position to the one before the last token).
        """
        items = [self.item(i) for i in indices]
        t = max(len(it["input_ids"]) for it in items)
        b = len(items)
        ids = torch.zeros(b, t, dtype=torch.long)
        labels = torch.zeros(b, t, dtype=torch.long)
        trainable = torch.zeros(b, t, dtype=torch.bool)
        aux = torch.zeros(b, t, items[0]["aux"].shape[-1]) if uses_aux else None
        kvh, d = items[0][f"k.{kv_layers[0]}"].shape[1:] if kv_layers else (0, 0)
        kv = {layer: (torch.zeros(b, kvh, t, d), torch.zeros(b, kvh, t, d)) for layer in kv_layers}
        teacher = None
        if "teacher_ids" in items[0]:
            topk = items[0]["teacher_ids"].shape[-1]
            teacher = (torch.zeros(b, t, topk, dtype=torch.long), torch.zeros(b, t, topk))
        for r, it in enumerate(items):
            n = len(it["input_ids"])
            ids[r, :n] = it["input_ids"].long()
            labels[r, :n] = it["labels"].long()
            trainable[r, it["prompt_len"] - 1: n - 1] = True
            if aux is not None:
                aux[r, :n] = it["aux"].float()
            for layer, (k, v) in kv.items():
                k[r, :, :n] = it[f"k.{layer}"].float().transpose(0, 1)
                v[r, :, :n] = it[f"v.{layer}"].float().transpose(0, 1)
            if teacher is not None:
                teacher[0][r, :n] = it["teacher_ids"].long()
                teacher[1][r, :n] = it["teacher_logits"].float()
        return TargetFeatures(ids, aux, kv, teacher), labels, trainable


class LiveFeatures(SplitFeatures):
    """The features of one split computed by the target on `device` as batches ask for them.
    Nothing is stored but `params.json` (what `ship` and `curve` count a run's tokens from).
    On a GPU the target's forward over a batch costs less than reading 5.8 kB per token of
    cached features back; on 2 CPU cores it costs more than the training step itself
    (bench/results/train_speed.md), so the CPU caches them (`FeatureSet`)."""

    BATCH = 32  # sequences per forward when all of them are read (`response_labels`)

    def __init__(self, path: Path, device: str = "cpu",
                 seqs: list[tuple[str, list[int], int]] | None = None) -> None:
        super().__init__(path)
        p = self.params
        self.spec = FeatureSpec(**{name: tuple(p[name]) if name.endswith("_layers") else p[name]
                                   for name in FeatureSpec.__dataclass_fields__ if name in p})
        self.seqs = seqs or sequences(Path(p["dataset"]), p["split"], self.spec.max_len)
        if [s[0] for s in self.seqs] != p["ids"]:
            raise KVShotError(f"{p['dataset']} no longer holds the {p['split']} sequences that "
                              f"{self.path} was made from; delete it to start over")
        self.device = torch.device(device)
        self._model = None

    @classmethod
    def create(cls, out: Path, target_dir: Path, dataset_dir: Path, split: str,
               spec: FeatureSpec, device: str = "cpu") -> "LiveFeatures":
        seqs = sequences(dataset_dir, split, spec.max_len)
        _claim(out, target_dir, dataset_dir, split, seqs, spec, live=True)
        return cls(out, device, seqs)

    @property
    def model(self):
        if self._model is None:
            self._model = load_target(Path(self.params["target"]), self.spec, self.device)
        return self._model

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for _, ids, _ in self.seqs)

    def length(self, i: int) -> int:
        return len(self.seqs[i][1])

    def prompt_length(self, i: int) -> int:
        return self.seqs[i][2]

    def _padded(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, valid) [B, T] of the right-padded sequences, ids on the CPU."""
        lengths = torch.tensor([self.length(i) for i in indices])
        ids = right_padded([self.seqs[i][1] for i in indices])
        return ids, torch.arange(ids.shape[1]) < lengths[:, None]

    def inputs(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, valid, trainable) [B, T] of the right-padded sequences, on the CPU; trainable
        as in `FeatureSet.batch`."""
        ids, valid = self._padded(indices)
        trainable = torch.zeros_like(valid)
        for r, i in enumerate(indices):
            trainable[r, self.prompt_length(i) - 1:self.length(i) - 1] = True
        return ids, valid, trainable

    def response_labels(self) -> Iterator[torch.Tensor]:
        order = sorted(range(len(self)), key=self.length)
        for start in range(0, len(order), self.BATCH):
            chunk = order[start:start + self.BATCH]
            labels = batched_forward(self.model, self._padded(chunk)[0], self.spec)["labels"]
            labels = labels.cpu()
            for r, i in enumerate(chunk):
                yield labels[r, self.prompt_length(i) - 1:self.length(i)]

    def batch(self, indices: list[int], kv_layers: list[int], uses_aux: bool
              ) -> tuple[TargetFeatures, torch.Tensor, torch.Tensor]:
        """As `FeatureSet.batch`, on the device: past each sequence's end everything is zero,
        as in a batch of cached features."""
        ids, valid, trainable = self.inputs(indices)
        # the chain's draft steps read labels (and the teacher) where `trainable` marks them
        feats = batched_forward(self.model, ids, self.spec, label_rows=trainable)
        ids, valid, trainable = (t.to(self.device) for t in (ids, valid, trainable))
        aux = feats["aux"].float() * valid[..., None] if uses_aux else None
        kv_valid = valid[:, None, :, None]
        kv = {layer: (feats[f"k.{layer}"].float() * kv_valid,
                      feats[f"v.{layer}"].float() * kv_valid) for layer in kv_layers}
        labels = feats["labels"].long() * valid
        teacher = None
        if "teacher_ids" in feats:
            teacher = (feats["teacher_ids"].long() * valid[..., None],
                       feats["teacher_logits"].float() * valid[..., None])
        return TargetFeatures(ids, aux, kv, teacher), labels, trainable
