"""Which sequences each optimizer step trains on: a pure function of the step, so that a resumed
run sees exactly the batches an uninterrupted one would, and a run's token budget follows from
its step count alone (`kvshot curve`, `kvshot ship`).

A run trains on one data set's features or on a mix of several (`TrainingData`): a long-context
set beside ShareGPT's, for example, so that a drafter learns distant context without forgetting
the short conversations it serves. Each step draws its whole batch from one set (a batch pads to
its longest sequence and runs the chain from its shortest prompt on, so 4K sequences beside 1K
ones would waste most of it); each set's share of the steps is its weight, spread evenly; and
each set goes through its own epochs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.training.features import SplitFeatures, open_features

if TYPE_CHECKING:
    from kvshot_vllm.models.drafter import TargetFeatures
    from kvshot_vllm.training.ttt import TrainConfig


def epoch_batches(lengths: list[int], cfg: TrainConfig, epoch: int) -> list[list[int]]:
    """The batches of one epoch, in training order: a seeded permutation cut into groups of
    `cfg.bucket` batches; within a group the sequences are sorted by length before they are cut
    into batches (a batch pads to its longest), and the epoch's batches are shuffled again."""
    n, size = len(lengths), cfg.batch_size
    per_epoch = max(1, n // size)
    g = torch.Generator().manual_seed(cfg.seed * 100003 + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    group = cfg.bucket * size
    order = [i for s in range(0, n, group)
             for i in sorted(perm[s:s + group], key=lambda i: lengths[i])]
    batches = [order[b * size:(b + 1) * size] for b in range(per_epoch)]
    return [batches[b] for b in torch.randperm(per_epoch, generator=g).tolist()]


def batch_order(lengths: list[int], cfg: TrainConfig, step: int) -> list[int]:
    """The sequences of a data set's `step`-th batch (`epoch_batches`)."""
    epoch, k = divmod(step, max(1, len(lengths) // cfg.batch_size))
    return epoch_batches(lengths, cfg, epoch)[k]


def trained_tokens(lengths: list[int], prompt_lens: list[int], cfg: TrainConfig,
                   steps: int) -> dict[str, int]:
    """Tokens of the sequences that a data set's batches 0..steps-1 hold, and of their scored
    (response) positions."""
    per_epoch = max(1, len(lengths) // cfg.batch_size)
    seqs = [i for epoch in range(-(-steps // per_epoch))
            for b in epoch_batches(lengths, cfg, epoch)[: steps - epoch * per_epoch]
            for i in b]
    return {"tokens": sum(lengths[i] for i in seqs),
            "loss_tokens": sum(lengths[i] - prompt_lens[i] for i in seqs)}


def mix_steps(weights: list[float], steps: int) -> list[int]:
    """The data set each of steps 0..steps-1 draws from: set i's share of any stretch of steps
    is weights[i] / sum(weights) to within one step (smooth weighted round robin; ties go to the
    first set)."""
    total = sum(weights)
    credit = [0.0] * len(weights)
    order = []
    for _ in range(steps):
        credit = [c + w / total for c, w in zip(credit, weights)]
        i = max(range(len(weights)), key=credit.__getitem__)
        credit[i] -= 1.0
        order.append(i)
    return order


class TrainingData:
    """The training features of one data set or of a weighted mix of several (module doc)."""

    def __init__(self, parts: list[SplitFeatures], weights: list[float] | None = None) -> None:
        if not parts:
            raise KVShotError("training needs at least one data set")
        if weights is None:  # as one set made of all of them would draw them
            weights = [float(len(p)) for p in parts]
        if len(weights) != len(parts) or any(w <= 0 for w in weights):
            raise KVShotError(f"a mix of {len(parts)} data sets takes {len(parts)} positive "
                              f"weights, got {list(weights)}")
        self.parts, self.weights = list(parts), [float(w) for w in weights]
        self.lengths = [[p.length(i) for i in range(len(p))] for p in self.parts]
        self._mix: list[int] = []  # mix_steps, as far as asked for (a prefix of any longer one)

    @classmethod
    def of_run(cls, run: dict) -> "TrainingData":
        """What a run (its run.json) trained on."""
        paths = run["features"] if isinstance(run["features"], list) else [run["features"]]
        return cls([open_features(Path(p)) for p in paths], run.get("mix"))

    def record(self) -> dict:
        """run.json's record of it: one set as before mixes existed, a mix with its weights."""
        if len(self.parts) == 1:
            return {"features": str(self.parts[0].path.resolve())}
        return {"features": [str(p.path.resolve()) for p in self.parts], "mix": self.weights}

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    @property
    def teacher_topk(self) -> int:
        return min(p.params.get("teacher_topk", 0) for p in self.parts)

    def check_layers(self, aux_layers: list[int], kv_layers: list[int], uses_aux: bool) -> None:
        for part in self.parts:
            part.check_layers(aux_layers, kv_layers, uses_aux)

    def response_labels(self) -> Iterator[torch.Tensor]:
        for part in self.parts:
            yield from part.response_labels()

    def response_token_counts(self, vocab_size: int) -> torch.Tensor:
        return sum(part.response_token_counts(vocab_size) for part in self.parts)

    def _mix_steps(self, steps: int) -> list[int]:
        if len(self._mix) < steps:
            self._mix = mix_steps(self.weights, max(steps, 2 * len(self._mix)))
        return self._mix[:steps]

    def steps_per_part(self, steps: int) -> list[int]:
        order = self._mix_steps(steps)
        return [order.count(i) for i in range(len(self.parts))]

    def batch(self, cfg: TrainConfig, step: int, kv_layers: list[int], uses_aux: bool
              ) -> tuple[TargetFeatures, torch.Tensor, torch.Tensor]:
        """Step `step`'s batch (`SplitFeatures.batch`): its set's next one."""
        order = self._mix_steps(step + 1)
        i = order[-1]
        part_step = order.count(i) - 1
        return self.parts[i].batch(batch_order(self.lengths[i], cfg, part_step), kv_layers,
                                   uses_aux)

    def trained_tokens(self, cfg: TrainConfig, steps: int) -> dict[str, int]:
        """Tokens and loss tokens of steps 0..steps-1, over every set."""
        total = {"tokens": 0, "loss_tokens": 0}
        for part, lengths, n in zip(self.parts, self.lengths, self.steps_per_part(steps)):
            prompts = [part.prompt_length(i) for i in range(len(part))]
            for key, value in trained_tokens(lengths, prompts, cfg, n).items():
                total[key] += value
        return total
