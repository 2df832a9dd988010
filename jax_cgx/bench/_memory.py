"""Keep XLA:CPU's large buffers in reused memory while benchmarking.

glibc serves allocations above its mmap threshold (at most 32 MiB) with fresh
``mmap``s and returns them on free, so an XLA:CPU program whose output is 64 MiB
page-faults all of it on every call (about 0.3 ms per MiB here): a cost of the
allocator, not of the kernel, which a plain copy into a preallocated array does not
pay. ``reuse_large_allocations()`` raises the threshold so freed memory is reused,
as ``MALLOC_MMAP_THRESHOLD_`` would. Training loops on CPU can benefit the same way.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


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
    return bool(mallopt(_M_MMAP_THRESHOLD, limit_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * limit_bytes))
