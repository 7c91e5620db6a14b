"""Keep freed host memory in the process on CPU devices, so tensor allocations stop page-faulting.

On the CPU path every op's output is a fresh host allocation. glibc serves blocks over its mmap
threshold (128 KiB at start) with mmap and gives them back on free, and trims the heap top on free: the
next step's tensors of the same sizes fault their pages in again. On the 2-vCPU VM these sessions run
on, page faults are expensive: `x.float(); x.pow(2)` on a 2,048 x 576 activation took 5.5 ms instead of
0.3 ms, and a 2,048-token prefill step of SmolLM2-135M ran ~23% faster with the settings below
(`benchmarks/decode_profile.py`, alternating runs). The settings are what vLLM's CPU guide gets from
preloading tcmalloc, without the preload: blocks up to 32 MiB (glibc's cap) come from the heap, and the
heap keeps up to 1 GiB of freed memory instead of returning it.

Process-wide, applied once by the engine on CPU. Skipped where the user tunes malloc themselves
(`MALLOC_*_` environment variables, or another allocator in `LD_PRELOAD`) and on non-glibc platforms.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Apply the settings (once per process); True when they are in effect."""
    if any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
        return False
    if any(a in os.environ.get("LD_PRELOAD", "") for a in ("tcmalloc", "jemalloc", "mimalloc")):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    return bool(ok) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
