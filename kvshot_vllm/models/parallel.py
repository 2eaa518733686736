"""Tensor parallelism of the drafter layers, in plain torch, so that training (one rank) and a
drafter served beside a tensor-parallel target (one rank per vLLM worker) run the same modules.

The split is Megatron's, as vLLM's Llama uses it: q/k/v and the MLP's gate/up projections are
column-parallel (a rank holds its own heads, its slice of the intermediate size); o_proj and
down_proj are row-parallel (a rank multiplies its slice, and the partial outputs are summed over
the ranks). Under a tensor-parallel target each rank's paged cache holds only that rank's KV
heads; the rank's query heads are exactly the ones grouped with those KV heads, so a sharded
cross-attention reads its own rank's cache and nothing else. Norms, the hybrid's gate, the
recurrent mixer and EAGLE-3's fc are small and replicated.

Why not vLLM's `ColumnParallelLinear` / `RowParallelLinear`: they need vLLM's distributed state
at construction, which training has not got, and they shard an output only as one contiguous
range, while a head-concat cross-attention's projection is `groups` blocks (one per sampled
layer) each split over the ranks. The all-reduce is vLLM's when served (`serving/drafter.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kvshot_vllm.errors import KVShotError


def _unreduced(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among the ranks that shard one drafter."""

    rank: int = 0
    size: int = 1
    # Sums a row-parallel layer's partial outputs over the ranks (every rank gets the sum).
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = _unreduced


_current = TensorParallel()


@contextmanager
def tensor_parallel(tp: TensorParallel) -> Iterator[None]:
    """Inside: the drafter modules built are this rank's shards (one rank outside)."""
    global _current
    saved, _current = _current, tp
    try:
        yield
    finally:
        _current = saved


def local_heads(total: int, what: str) -> int:
    """This rank's share of `total` attention heads, or a clear error if they do not split."""
    size = _current.size
    if total % size:
        raise KVShotError(f"the drafter's {total} {what} do not split over tensor-parallel size "
                          f"{size}: serve it with a tensor-parallel size that divides {total}")
    return total // size


class Linear(nn.Linear):
    """A drafter's linear layer (no bias) whose matmul a back-end may swap after loading:
    serving on a CPU multiplies with vLLM's prepacked kernels, as vLLM's own layers do
    (`serving/drafter.py`, `use_platform_gemm`); training keeps torch's `F.linear`."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        # Computed inside a `fused` layer: its own weight is kept (its checkpoint name) but
        # no longer multiplied with.
        self.fused_away = False
        self.gemm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] = (
            F.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight, None)


def fused(*linears: Linear) -> Linear:
    """One layer computing `linears`' outputs side by side, their weights concatenated (this
    rank's shards of column-parallel layers stay this rank's): one matmul where a decode batch
    of a few rows pays a call per layer. Built once the weights are final (serving)."""
    weight = torch.cat([m.weight.detach() for m in linears])
    out = Linear(weight.shape[1], weight.shape[0]).to(weight)
    with torch.no_grad():
        out.weight.copy_(weight)
    for m in linears:
        m.fused_away = True
    return out


class ColumnParallel(Linear):
    """Output features split over the ranks. The output is `groups` side-by-side blocks (the
    heads of each sampled layer); each block is split evenly, rank r keeping part r of each."""

    def __init__(self, in_features: int, out_features: int, groups: int = 1) -> None:
        self.tp, self.groups = _current, groups
        super().__init__(in_features, out_features // self.tp.size)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """[out, in] -> this rank's [out / size, in]."""
        blocks = full.unflatten(0, (self.groups, self.tp.size, -1))
        return blocks[:, self.tp.rank].flatten(0, 1)


class RowParallel(Linear):
    """Input features split over the ranks (as `ColumnParallel` split the outputs feeding
    them); the partial products are all-reduced, so every rank gets the full output."""

    def __init__(self, in_features: int, out_features: int, groups: int = 1) -> None:
        self.tp, self.groups = _current, groups
        super().__init__(in_features // self.tp.size, out_features)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """[out, in] -> this rank's [out, in / size]."""
        blocks = full.unflatten(1, (self.groups, self.tp.size, -1))
        return blocks[:, :, self.tp.rank].flatten(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


def shard_weights(model: nn.Module, weights: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
    """Full checkpoint tensors -> what this rank's `model` holds under the same names."""
    sharded = {name: m for name, m in model.named_modules()
               if isinstance(m, (ColumnParallel, RowParallel))}
    out = {}
    for name, w in weights.items():
        owner, _, leaf = name.rpartition(".")
        module = sharded.get(owner)
        out[name] = module.shard(w) if module is not None and leaf == "weight" else w
    return out
