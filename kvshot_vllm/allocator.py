"""glibc's malloc, set to keep the memory torch frees for the next step.

By default glibc serves every allocation above its mmap threshold (128 KiB, rising to at most
32 MiB) with a fresh mmap and unmaps it on free. A CPU training step allocates and frees
hundreds of such tensors (activations, attention scores, logits over the draft vocabulary),
so each step faults every one of their pages in again, zeroed by the kernel. With mmap off and
the heap trimmed only when asked (training does at every checkpoint), freed pages are reused
as they are; between trims the process keeps its peak footprint instead of returning it after
every step, unless the machine runs short of memory (`memory_is_low`: then training trims at
once). `python bench/train_allocator.py` measures both side by side on real training
runs: faults, time in the kernel, step time, peak memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# Off switch, for the bench that compares the two.
ENV_OFF = "KVSHOT_KEEP_FREED_MEMORY"
# Below this share of the machine's memory available, kept memory is handed back at once: a
# kept heap grows with the largest batches between two checkpoints, and an out-of-memory kill
# loses the steps since the last one.
LOW_MEMORY_SHARE = 0.15


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library, looked up once (find_library runs ldconfig, and training releases memory
    at every checkpoint)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "gnu_get_libc_version"):
        return None  # another C library (musl, macOS) with its own allocator
    return libc


def keep_freed_memory() -> bool:
    """Make this process's glibc malloc keep freed memory for reuse (no mmap for large blocks,
    no trimming of the heap). Large blocks asked for in another thread's arena fall back to the
    main heap. Returns whether it applied: not off glibc, nor with KVSHOT_KEEP_FREED_MEMORY=0."""
    libc = _glibc()
    if os.environ.get(ENV_OFF, "1") == "0" or libc is None:
        return False
    # mallopt returns 1 on success; the trim threshold is an int, so its largest value
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def release_freed_memory() -> None:
    """Hand the kept heap's free pages back to the kernel (glibc's malloc_trim). Steps of other
    sizes leave free fragments that a kept heap would hold resident for the rest of a run, so a
    long training run's memory kept growing; released at every checkpoint, they cost one step's
    faults per checkpoint instead."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def memory_is_low(meminfo: str | None = None) -> bool:
    """Whether less than LOW_MEMORY_SHARE of the machine's memory is available (/proc/meminfo,
    or its text `meminfo`); False where there is none to read."""
    if meminfo is None:
        try:
            with open("/proc/meminfo") as f:
                meminfo = f.read()
        except OSError:
            return False
    fields = {line.split(":")[0]: int(line.split()[1]) for line in meminfo.splitlines()
              if line.startswith(("MemTotal:", "MemAvailable:"))}
    if len(fields) < 2:
        return False
    return fields["MemAvailable"] < LOW_MEMORY_SHARE * fields["MemTotal"]
