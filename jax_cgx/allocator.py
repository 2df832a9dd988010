"""Large host buffers from reused memory: jax_cgx's default on glibc, set when it is imported.

glibc serves allocations above its mmap threshold (at most 32 MiB) with fresh ``mmap``s
and returns them on free, so an XLA:CPU program whose output is 64 MiB page-faults all of
it on every call (about 0.3 ms per MiB on our machines): a cost of the allocator, not of
the computation. The same happens below the threshold on XLA's worker threads: glibc
gives each thread its own arena, made of heaps of at most 64 MiB, and a request that does
not fit one is served by ``mmap`` whatever the threshold. A training step on CPU allocates
its gradients, fusion buffers and encodings afresh each step, so the faults show up as
slow and uneven steps (docs/performance.md).

:func:`reuse_large_allocations` raises the threshold to 1 GiB, keeps freed memory up to
2 GiB in the process, and keeps every thread on the main arena, as
``MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=2147483648 MALLOC_ARENA_MAX=1``
would (``x * 2`` of 64 MiB under jit: 16384 page faults and 25-40 ms per call before; after, once the
heap holds enough freed space (about 9 calls), none and 6-7 ms). ``import
jax_cgx`` calls it once. That is early enough only before other threads exist: a thread that
has malloc'd has its own arena, which it keeps, and threads born later are spread over the
arenas that exist, whose heaps hold at most 64 MiB, so larger buffers are fresh ``mmap``s
there whatever the threshold. ``jax.distributed.initialize()`` starts 15 such threads (its RPC
client): a 64 MiB 4-bit ``compressed_pmean`` written with ``import jax_cgx`` after it ran 1.26x
slower at 1 Gbit/s (docs/performance.md). So ``import jax_cgx`` warns once, with the fix, when
it comes after ``jax.distributed.initialize()`` or after JAX made its devices, and
``python -m jax_cgx.launch`` starts every process with :data:`~jax_cgx.allocator.ENVIRONMENT` (glibc's own
variables for the same settings, read at process start: no import order matters); under
``mpirun`` pass them with ``-x``. The cost: the process keeps up to 2 GiB of freed memory
instead of returning it to the system, and all threads share one arena. Opt out with
``JAX_CGX_REUSE_ALLOCATIONS=0`` in the environment; elsewhere than glibc nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

__all__ = ["ENV", "ENVIRONMENT", "apply_default", "applied", "reuse_large_allocations", "wanted"]

log = logging.getLogger("jax_cgx")

ENV = "JAX_CGX_REUSE_ALLOCATIONS"

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_applied = False

# What reuse_large_allocations() sets, as glibc's environment variables (read once, at process
# start, before any thread exists).
_LIMIT = 1 << 30  # reuse_large_allocations's default and largest threshold
ENVIRONMENT = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(_LIMIT), "MALLOC_TRIM_THRESHOLD_": str(2 * _LIMIT)}


def reuse_large_allocations(limit_bytes: int = _LIMIT) -> bool:
    """Ask glibc to serve allocations below ``limit_bytes`` from its reusable heap.

    Returns whether glibc took every setting (False elsewhere than glibc: nothing changed).

    Args:
      limit_bytes: the mmap threshold, in bytes, 1..2^30 (default 2^30, 1 GiB); freed memory up to
        twice it is kept, and every thread shares the main arena.

    Returns:
      True where glibc took every setting; False where it refused one, or elsewhere than glibc.

    Raises:
      ValueError: ``limit_bytes`` not an int in 1..2^30.
    """
    global _applied
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or not 0 < limit_bytes <= _LIMIT:
        raise ValueError(f"reuse_large_allocations: limit_bytes must be an int in 1..2**30, got {limit_bytes!r}")
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = (
        bool(mallopt(_M_MMAP_THRESHOLD, limit_bytes))
        and bool(mallopt(_M_TRIM_THRESHOLD, 2 * limit_bytes))
        and bool(mallopt(_M_ARENA_MAX, 1))
    )
    _applied = _applied or ok
    return ok


def applied() -> bool:
    """Whether this process reuses large allocations (set by jax_cgx or by a call here).

    Returns:
      True once a call of :func:`reuse_large_allocations` (``import jax_cgx``'s included) took every
      setting.
    """
    return _applied


def wanted(environ=None) -> bool:
    """Whether ``JAX_CGX_REUSE_ALLOCATIONS`` (default 1) asks for reused large allocations; a
    ``ValueError`` naming it for any other value than 1/0/true/false.

    Args:
      environ: the variables to read (default: ``os.environ``).

    Returns:
      False for ``0`` or ``false`` (any case, spaces around ignored); True otherwise (unset, empty,
      ``1`` or ``true``).

    Raises:
      ValueError: any other value.
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV, "1").strip().lower()
    if raw not in ("0", "1", "false", "true", ""):
        raise ValueError(f"{ENV}={env.get(ENV)!r} must be 1 (the default: reuse large allocations) or 0 (glibc's "
                         "default of fresh mmaps)")
    return raw not in ("0", "false")


def apply_default(environ=None) -> bool:
    """What ``import jax_cgx`` does: :func:`reuse_large_allocations` unless ``JAX_CGX_REUSE_ALLOCATIONS=0``.

    Logs a WARNING, with the fix, where it comes after ``jax.distributed.initialize()`` or after JAX
    made its devices (unless ``MALLOC_ARENA_MAX=1`` is set).

    Args:
      environ: the variables to read (default: ``os.environ``).

    Returns:
      What :func:`reuse_large_allocations` returned; False where the variable turned it off.

    Raises:
      ValueError: ``JAX_CGX_REUSE_ALLOCATIONS`` neither 1/0 nor true/false (:func:`wanted`).
    """
    env = os.environ if environ is None else environ
    if not wanted(env):
        log.debug("jax_cgx: %s=0, glibc's allocator left as it is", ENV)
        return False
    ok = reuse_large_allocations()
    log.debug("jax_cgx: large allocations reused: %s", ok)
    if ok and env.get("MALLOC_ARENA_MAX") != "1" and (late := _jax_started()):
        log.warning(
            "jax_cgx was imported after %s: threads started before keep malloc arenas of their own, where every "
            "buffer of 64 MiB or more is a fresh mmap, page-faulted on each call (a 64 MiB compressed_pmean ran 1.26x "
            "slower). Import jax_cgx before it (jax_cgx.distributed.initialize() does), or start the processes with "
            "MALLOC_ARENA_MAX=1 in their environment (python -m jax_cgx.launch does; mpirun -x MALLOC_ARENA_MAX=1); "
            "%s=0 silences this", late, ENV)
    return ok


def _jax_started() -> str | None:
    """What JAX started before jax_cgx was imported that has threads of its own, or None.

    Reads jax's private state (absent attributes read as not started): there is no public
    "initialized" query for either."""
    if "jax" not in sys.modules:
        return None
    distributed = sys.modules.get("jax._src.distributed")
    if getattr(getattr(distributed, "global_state", None), "client", None) is not None:
        return "jax.distributed.initialize()"
    if getattr(sys.modules.get("jax._src.xla_bridge"), "_backends", None):
        return "JAX made its devices (jax.devices(), or a first computation)"
    return None
