"""Tensor-parallel drafter layers (`models/parallel.py`): the ranks' sharded math equals the
unsharded drafter's, for every registered paradigm, on one process.

vLLM's CPU build cannot serve the embedded target at tensor-parallel size 2 (SmolLM2-135M has 9
attention heads and 3 KV heads, and vLLM requires the heads to split evenly), so the ranks run
here as threads of one process whose all-reduce is a barrier that sums their partial outputs,
each rank reading only its own KV heads of the target's cache, as under a served TP target.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import LlamaConfig

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.config import TargetSpec, validated
from kvshot_vllm.models.drafter import Drafter, TargetFeatures
from kvshot_vllm.models.parallel import Linear, TensorParallel, tensor_parallel
from kvshot_vllm.models.registry import paradigm_names
from kvshot_vllm.models.weights import init_weights

# SmolLM2-135M's head layout (9 query heads, 3 KV heads), shrunk; and a 4 / 2 one.
NINE_BY_THREE = LlamaConfig(hidden_size=36, intermediate_size=48, num_hidden_layers=6,
                            num_attention_heads=9, num_key_value_heads=3, head_dim=4,
                            vocab_size=40, rms_norm_eps=1e-6)
FOUR_BY_TWO = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          vocab_size=40, rms_norm_eps=1e-6)

CASES = [(name, {}) for name in paradigm_names()] + [("block", {"ssm_state_size": 4}),
                                                     ("kv", {"num_layers": 2})]


class ThreadAllReduce:
    """An all-reduce among `size` threads: every rank gets the sum of all ranks' tensors, added
    in rank order (so every rank gets the same bits)."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=120)
        self.parts: list[torch.Tensor | None] = [None] * size

    def of_rank(self, rank: int):
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x
            self.barrier.wait()
            total = torch.stack(self.parts).sum(0)
            self.barrier.wait()  # nobody overwrites a part before every rank has summed
            return total

        return all_reduce


def _one_at_a_time(gemm, lock: threading.Lock):
    def locked(*args):
        with lock:
            return gemm(*args)

    return locked


def drafter_of(paradigm: str, options: dict, hf: LlamaConfig,
               tp: TensorParallel = TensorParallel()) -> Drafter:
    cfg = validated({"paradigm": paradigm, "target": TargetSpec.from_hf_config(hf, "tiny"),
                     **options})
    embed = torch.randn(hf.vocab_size, hf.hidden_size, generator=torch.Generator().manual_seed(0))
    with tensor_parallel(tp):
        drafter = Drafter(cfg, hf, embed)
    drafter.load_checkpoint_weights(init_weights(cfg, seed=1, std=0.3))  # full tensors
    return drafter.eval()


def features(drafter: Drafter, hf: LlamaConfig, t: int) -> TargetFeatures:
    g = torch.Generator().manual_seed(2)
    cfg, kvh, d = drafter.cfg, hf.num_key_value_heads, hf.head_dim
    kv = {layer: (torch.randn(1, kvh, t, d, generator=g), torch.randn(1, kvh, t, d, generator=g))
          for layer in cfg.kv_layers}
    return TargetFeatures(torch.randint(0, hf.vocab_size, (1, t), generator=g),
                          torch.randn(1, t, len(cfg.aux_layers) * hf.hidden_size, generator=g), kv)


def rank_view(feats: TargetFeatures, rank: int, size: int) -> TargetFeatures:
    """What rank `rank` of a TP target has: its own KV heads of each layer's cache."""
    def own(x: torch.Tensor) -> torch.Tensor:
        return x.chunk(size, dim=1)[rank]

    return TargetFeatures(feats.input_ids, feats.aux_hidden,
                          {n: (own(k), own(v)) for n, (k, v) in feats.target_kv.items()})


@pytest.mark.parametrize("fuse", [False, True], ids=["", "fused"])
@pytest.mark.parametrize("hf,size", [(NINE_BY_THREE, 3), (FOUR_BY_TWO, 2)],
                         ids=["9x3-tp3", "4x2-tp2"])
@pytest.mark.parametrize("paradigm,options", CASES)
def test_sharded_ranks_draft_what_the_unsharded_drafter_drafts(paradigm, options, hf, size, fuse):
    """fused: each rank's layers as served (`fuse_for_decoding`: q/k/v and gate/up of its shards
    in one matmul each, on the platform's kernels) against the unsharded, unfused drafter."""
    from kvshot_vllm.serving.drafter import fuse_for_decoding

    t, steps = 10, 4
    full = drafter_of(paradigm, options, hf)
    feats = features(full, hf, t)
    with torch.no_grad():
        expected = [full.lm_head(x) for x in full.chain(feats, steps)]

    reduce = ThreadAllReduce(size)
    ranks = [drafter_of(paradigm, options, hf, TensorParallel(r, size, reduce.of_rank(r)))
             for r in range(size)]
    if fuse:
        # vLLM's CPU kernels are not safe to call from several threads at once (a served rank is
        # a process of its own): here the ranks are threads, so their matmuls take turns.
        lock = threading.Lock()
        for rank in ranks:
            fuse_for_decoding([rank])
            linears = [m for m in rank.modules() if isinstance(m, Linear)]
            # layers computed inside a fused one get no packed copy of their weights
            packed = [m.gemm is not torch.nn.functional.linear for m in linears]
            assert packed == [not m.fused_away for m in linears] and any(packed)
            assert any(m.fused_away for m in linears)
            for linear in linears:
                linear.gemm = _one_at_a_time(linear.gemm, lock)
    attn = next(m for n, m in ranks[0].named_modules() if n.endswith(("self_attn", "cross")))
    assert (attn.heads, attn.kv_heads) == (hf.num_attention_heads // size,
                                           hf.num_key_value_heads // size)
    results: list = [None] * size

    def run(r: int) -> None:
        try:
            with torch.no_grad():
                results[r] = [ranks[r].lm_head(x)
                              for x in ranks[r].chain(rank_view(feats, r, size), steps)]
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            reduce.barrier.abort()
            results[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for r, got in enumerate(results):
        if isinstance(got, BaseException):
            raise got
        for j in range(steps):
            torch.testing.assert_close(got[j], expected[j], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"rank {r}, draft step {j}: {m}")
        assert [x.argmax(-1).tolist() for x in got] == [x.argmax(-1).tolist() for x in expected]


def test_heads_that_do_not_split_are_refused_by_name() -> None:
    with pytest.raises(KVShotError, match="9 attention heads do not split over tensor-parallel "
                                          "size 2"):
        drafter_of("kv", {}, NINE_BY_THREE, TensorParallel(0, 2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's CPU kernels serve CPU builds")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_platform_gemm_computes_what_torch_computes(dtype, tol) -> None:
    """Served on a CPU, the drafter's linear layers (row-parallel ones included) multiply with
    vLLM's prepacked kernels (`use_platform_gemm`): the same products as torch's, at the row
    counts of a draft pass."""
    from kvshot_vllm.models.parallel import ColumnParallel, RowParallel
    from kvshot_vllm.serving.drafter import use_platform_gemm

    torch.manual_seed(0)
    layers = torch.nn.Sequential(ColumnParallel(64, 96, groups=3), RowParallel(96, 64)).to(dtype)
    xs = [torch.randn(rows, 64, dtype=dtype) for rows in (1, 4, 16)]
    with torch.no_grad():
        expected = [layers(x) for x in xs]
        use_platform_gemm([layers])
        assert all(m.gemm is not torch.nn.functional.linear for m in layers)
        for x, want in zip(xs, expected):
            torch.testing.assert_close(layers(x), want, rtol=tol, atol=tol)
