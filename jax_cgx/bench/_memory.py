"""Keep XLA:CPU's large buffers in reused memory while benchmarking.

glibc serves allocations above its mmap threshold (at most 32 MiB) with fresh
``mmap``s and returns them on free, so an XLA:CPU program whose output is 64 MiB
page-faults all of it on every call (about 0.3 ms per MiB here): a cost of the
allocator, not of the kernel, which a plain copy into a preallocated array does not
pay. The same happens below the threshold on XLA's worker threads: glibc gives each
thread its own arena, made of heaps of at most 64 MiB, and a request that does not fit
one is served by ``mmap`` whatever the threshold. ``reuse_large_allocations()`` raises
the threshold and keeps every thread on the main arena, so freed memory is reused, as
``MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_ARENA_MAX=1`` would (measured: ``x * 2``
of 64 MiB under jit, 19-27 ms before, 3.3-4.0 ms after). It must run before XLA starts
its threads (before the first computation). Training loops on CPU can benefit the
same way.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def reuse_large_allocations(limit_bytes: int = 1 << 30) -> bool:
    """Ask glibc to serve allocations below ``limit_bytes`` from its reusable heap."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return (
        bool(mallopt(_M_MMAP_THRESHOLD, limit_bytes))
        and bool(mallopt(_M_TRIM_THRESHOLD, 2 * limit_bytes))
        and bool(mallopt(_M_ARENA_MAX, 1))
    )
