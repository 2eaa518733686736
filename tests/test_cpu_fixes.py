"""The workaround of `kvshot_vllm.serving.cpu_fixes` for vLLM's CPU rejection sampler, on
vLLM's own sampling functions (no engine: seconds). The engine-level check is the sampling
test (`tests/test_sampling.py`, slow) and `bench/sampling_controls.py`."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from kvshot_vllm.distribution import chi2_quantile, goodness_of_fit
from kvshot_vllm.serving import cpu_fixes

pytest.importorskip("vllm.utils.cpu_triton_utils", reason="vLLM's CPU build")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

TEMPERATURE, TOP_P = 0.8, 0.95
PROBS = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.07, 0.05, 0.02, 0.01])
REQUESTS, DRAFTS = 20_000, 2


def test_vllm_cpu_expand_still_writes_nothing_into_a_float_output() -> None:
    """The bug the workaround is for: when this fails, vLLM has fixed it, and the workaround
    can go."""
    import vllm._C  # noqa: F401  (the CPU ops)

    out = torch.full((6,), -7.0)
    cpu_fixes.vllm_expand_kernel()(out, torch.tensor([0.8, 0.5]), torch.tensor([3, 6], dtype=torch.int32), 0, 1)
    assert torch.equal(out, torch.full((6,), -7.0))


def test_expand_kernel_fills_each_request_s_tokens() -> None:
    for values, dtype in (([0.8, 0.0, 1.0, 0.7], torch.float32), ([5, 0, 7, 9], torch.int32)):
        out = torch.full((8,), -1, dtype=dtype)
        cu = torch.tensor([3, 3, 5, 6], dtype=torch.int32)  # the second request has none
        cpu_fixes.expand_kernel(out, torch.tensor(values, dtype=dtype), cu, 0, 1)
        want = [values[0]] * 3 + [values[2]] * 2 + [values[3]] + [-1, -1]
        assert out.tolist() == pytest.approx(want), dtype


def exact_probs() -> dict[int, float]:
    """The target distribution after temperature and top-p (vLLM's order: the smallest set of
    most likely tokens whose mass reaches TOP_P)."""
    p = torch.softmax(PROBS.log() / TEMPERATURE, -1)
    order = p.argsort(descending=True)
    keep = (p[order].cumsum(0) - p[order]) < TOP_P
    kept = p[order][keep]
    return {int(t): float(x) for t, x in zip(order[keep], kept / kept.sum())}


def sampled_positions() -> list[Counter]:
    """Tokens at each drafted position, through vLLM's rejection sampler: every request drafts
    the most likely token at each of DRAFTS positions, whose target logits are PROBS."""
    import vllm.v1.sample.rejection_sampler as rs

    logits = PROBS.log().repeat(REQUESTS * DRAFTS, 1).contiguous()
    cu = torch.arange(1, REQUESTS + 1, dtype=torch.int32) * DRAFTS

    class Metadata:  # the fields the rejection sampler reads
        all_greedy, all_random, top_k, generators = False, True, None, {}
        temperature = torch.full((REQUESTS,), TEMPERATURE)
        top_p = torch.full((REQUESTS,), TOP_P)

    torch.manual_seed(0)
    target = rs.apply_sampling_constraints(logits, cu, Metadata())
    out = rs.rejection_sample(torch.zeros(REQUESTS * DRAFTS, dtype=torch.int32),
                              [DRAFTS] * REQUESTS, DRAFTS, cu, None, target,
                              torch.zeros(REQUESTS, 1, dtype=torch.int64), Metadata())
    counts = []
    for j in range(DRAFTS):
        reached = (out[:, :j] == 0).all(1)  # every draft before j accepted
        counts.append(Counter(out[reached, j].tolist()))
    return counts


def fits(counts: list[Counter]) -> bool:
    level = chi2_quantile(1 - 1e-3 / DRAFTS, len(exact_probs()))
    return all(goodness_of_fit(c, exact_probs())[0] < level for c in counts)


def test_rejection_sampler_keeps_the_distribution_only_with_the_fix() -> None:
    """With vLLM's own CPU kernels the sampled tokens at drafted positions do not follow the
    target's distribution; with the workaround they do (chi-square at a 1e-3 false alarm)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils.dispatcher import register_kernels

    current_platform.register_triton_kernel_overrides()  # the CPU kernels, as in a worker
    register_kernels({cpu_fixes.EXPAND_KERNEL: cpu_fixes.vllm_expand_kernel()})
    assert not fits(sampled_positions())
    cpu_fixes.apply()  # registered already: the workaround registers itself again
    assert fits(sampled_positions())


def test_vllm_cpu_runner_still_rewinds_generators_by_offset() -> None:
    """Bug 2 (`cpu_fixes.keep_seeded_streams`): vLLM rewinds a discarded sample's generator with
    an offset, which a CPU generator does not have. When this fails, the workaround can go."""
    import inspect

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "set_offset" in inspect.getsource(GPUModelRunner._bookkeeping_sync)
    with pytest.raises(RuntimeError, match="does not use offset"):
        torch.Generator().get_offset()


def test_seeded_request_prefilled_in_chunks(target_fp32, data_dir) -> None:
    """A seeded, sampled request whose prompt is prefilled in chunks of 64 tokens: with vLLM's
    own code the engine core dies at its first partial chunk; with the workaround it finishes,
    with the tokens of an engine that prefilled it in one step (its stream untouched by the
    discarded samples)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvshot_vllm.distribution import chat_prompts
    from kvshot_vllm.engine import make_llm

    prompt = chat_prompts(target_fp32, ["Tell me about the sea. " * 30])[0]
    assert len(prompt) > 3 * 64
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=12)

    def generate(budget: int) -> list[int]:
        llm = make_llm(target_fp32, data_dir, dtype="float32", max_model_len=512,
                       enable_chunked_prefill=True, max_num_batched_tokens=budget,
                       max_num_seqs=4)
        try:
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        finally:
            del llm
        return list(out[0].outputs[0].token_ids)

    chunked = generate(64)
    assert len(chunked) == 12
    assert chunked == generate(512)


def test_vllm_cpu_proposer_still_aliases_draft_lengths() -> None:
    """Bug 3 (`cpu_fixes.separate_draft_lengths`): the non-padded proposer's "device copy" of
    the sequence lengths is the CPU tensor itself, and it bumps both names each draft step.
    When this fails, the workaround can go. Its effect through a real engine: with
    KVSHOT_CPU_FIXES=0, test_plugin.py's parity test finds served EAGLE-3 drafts that differ
    from the training side's; with the fix, none do."""
    import inspect

    from vllm.utils.torch_utils import async_tensor_h2d
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    lengths = torch.tensor([5, 17], dtype=torch.int32)
    assert async_tensor_h2d(lengths, device="cpu").data_ptr() == lengths.data_ptr()
    source = inspect.getsource(SpecDecodeBaseProposer)
    assert "seq_lens_cpu_upper_bound=new_seq_lens_cpu" in source
    assert "seq_lens_cpu_upper_bound += 1" in source


def test_draft_lengths_are_separated() -> None:
    """The patched `prepare_inputs` hands back metadata whose upper bound is a tensor of its
    own, with the same values, and leaves separate tensors alone."""
    from types import SimpleNamespace

    from kvshot_vllm.serving.cpu_fixes import separate_draft_lengths

    lengths = torch.tensor([5, 17])
    apart = torch.tensor([5, 17])

    class Proposer:
        def prepare_inputs(self, bound):
            return SimpleNamespace(seq_lens=lengths, seq_lens_cpu_upper_bound=bound), "indices"

    separate_draft_lengths(Proposer)
    cad, indices = Proposer().prepare_inputs(lengths)
    assert indices == "indices" and cad.seq_lens_cpu_upper_bound.tolist() == [5, 17]
    cad.seq_lens += 1
    assert cad.seq_lens_cpu_upper_bound.tolist() == [5, 17]
    assert Proposer().prepare_inputs(apart)[0].seq_lens_cpu_upper_bound is apart


def _onednn_handle(released: list[int]):
    """A real oneDNN matmul handle whose releases are appended to `released`: (it, its value)."""
    from vllm import _custom_ops as ops

    handler = ops.create_onednn_mm(torch.randn(64, 32), 16)
    dtor = handler.dtor
    handler.dtor = lambda h: (released.append(h), dtor(h))
    return handler, int(handler.handler_tensor)


def _handle_freed_while_traced(released: list[int], release) -> int:
    """The value of a real oneDNN handle (releases appended to `released`) that only the cyclic
    collector can free, freed inside a FakeTensorMode with the Python dispatcher (as while
    torch.compile traces a model), its class's `__del__` being `release`."""
    import gc

    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode

    handler, value = _onednn_handle(released)
    cls, old = type(handler), type(handler).__del__
    cycle = [handler]
    cycle.append(cycle)
    gc.disable()  # so that the handle is freed inside the modes, not at an allocation before
    cls.__del__ = release
    try:
        del handler, cycle
        with FakeTensorMode(), enable_python_dispatcher():
            gc.collect()
    finally:
        cls.__del__ = old
        gc.enable()
    return value


def test_vllm_cpu_onednn_handle_release_still_fails_while_traced() -> None:
    """Bug 4 (`cpu_fixes.release_handles_untraced`): vLLM's own release of a handle freed while
    a model is traced raises inside its `__del__` (the error Python ignores here; inside
    Dynamo formatting it recursed until the worker's stack overflowed), and the handle is never
    released. When this fails, the workaround can go."""
    from vllm import _custom_ops as ops

    cpu_fixes.apply()
    # vLLM's own: what the workaround replaced, or the class's where it is off
    vllm_release = cpu_fixes._replaced.get(cpu_fixes.HANDLE_RELEASE,
                                           ops.CPUDNNLGEMMHandler.__del__)
    released: list[int] = []
    _handle_freed_while_traced(released, vllm_release)
    assert released == []


def test_onednn_handles_freed_while_traced_are_released_after() -> None:
    from vllm import _custom_ops as ops

    cpu_fixes.apply()
    released: list[int] = []
    traced_value = _handle_freed_while_traced(released, ops.CPUDNNLGEMMHandler.__del__)
    assert released == [] and cpu_fixes._unreleased_handles
    later, later_value = _onednn_handle(released)
    del later
    assert sorted(released) == sorted([traced_value, later_value])
    assert not cpu_fixes._unreleased_handles
