"""Creating and releasing communicators: :func:`setup`, :func:`teardown`, and the exit hook.

:func:`setup` plans every group of the families asked for, exchanges their unique ids
(:mod:`~jax_cgx._src.nccl.unique_ids`), initializes this process's members in one global
order and records the families (:mod:`~jax_cgx._src.nccl.registry`). At interpreter exit the
communicators still alive are *aborted* after ``jax.effects_barrier()``, so a dead peer
cannot hang this process's exit.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import types
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jax_cgx._src.arguments import check_bool
from jax_cgx._src.backends.groups import PlannedGroup, groups_array, mesh_ident, mesh_parts, wanted_families
from jax_cgx._src.nccl import library, registry
from jax_cgx._src.nccl.library import NcclError
from jax_cgx._src.nccl.unique_ids import ID_EXCHANGES, exchange_ids, timeout

__all__ = ["Communicators", "setup", "teardown"]

log = logging.getLogger("jax_cgx")

_GPU_PLATFORMS = ("gpu", "cuda")
_atexit_registered = False


@dataclasses.dataclass(frozen=True, repr=False)
class Communicators:
    """What :func:`setup` made available: the families of ``mesh``, axes tuple -> key.

    Args:
      mesh: the mesh given to :func:`setup`.
      families: each family of the call, its axes tuple -> its family key (read-only).
    """

    mesh: Any
    families: Mapping[tuple[str, ...], int]

    def __repr__(self) -> str:
        fams = ", ".join(f"{axes!r}: {key:#018x}" for axes, key in self.families.items())
        return f"Communicators(mesh={self.mesh!r}, families={{{fams}}})"


def _check_devices(devices: np.ndarray) -> None:
    platforms = sorted({str(getattr(d, "platform", "?")) for d in devices.flat})
    if any(p not in _GPU_PLATFORMS for p in platforms):
        raise NcclError(
            f"jax_cgx.nccl: NCCL communicators need CUDA devices; the mesh has {', '.join(platforms)} devices. "
            "Use backend='xla' (or 'auto') on other platforms, and set up NCCL only on a mesh of GPUs."
        )


def setup(mesh, axes=None, *, id_exchange: str = "auto", timeout_s: float | None = None) -> Communicators:
    """Create the NCCL communicators of every reduction a program on ``mesh`` may run.

    Call on every process, with the same arguments and in the same order, before the
    first compressed reduction with ``backend="nccl"`` is compiled. It blocks until
    every process of every group has joined. (``backend="auto"`` does not use them: the
    nccl backend measured slower than the xla backend; it warns.)

    Args:
      mesh: a concrete ``jax.sharding.Mesh`` of CUDA devices.
      axes: the reductions: ``None`` (default) for every non-empty subset of
        ``mesh.axis_names`` (in mesh order); a name or a tuple of names for one reduction
        (as ``axis_name`` of ``psum``; a tuple in non-mesh order ranks devices in that
        order); or a list of those. Families whose groups have one device are skipped:
        they exchange nothing.
      id_exchange: how NCCL unique ids reach other processes: ``"kv"`` (the
        ``jax.distributed`` key-value store), ``"mpi"`` (mpi4py), or ``"auto"``: kv when
        ``jax.distributed`` is initialized, else mpi under mpirun with mpi4py installed.
        Ignored with one process.
      timeout_s: how long to wait for another process's unique id (default
        ``$JAX_CGX_NCCL_TIMEOUT_S`` or 300 s).

    Returns:
      A :class:`Communicators`: ``mesh``, and ``families``, each family of ``axes`` whose groups have
      more than one device (those set up before included) -> its family key.

    Raises:
      ValueError: an unknown ``id_exchange``; ``axes`` empty, naming an axis twice or one ``mesh``
        lacks; ``mesh``'s devices not matching its axes; ``timeout_s`` (or
        ``JAX_CGX_NCCL_TIMEOUT_S``) not a number of seconds in (0, 1e9].
      TypeError: an ``AbstractMesh`` (it has no devices).
      NcclError: devices that are not CUDA devices; a unique id exchange or ``ncclCommInitRank`` that
        failed or timed out.
      NcclNotFoundError: no CUDA extension, one built without NCCL, or no libnccl that loads.

    Returns the families of this call (axes tuple -> key). Families already set up are
    kept, so calling again is cheap. Raises :class:`NcclError` (or
    :class:`~jax_cgx._src.nccl.library.NcclNotFoundError`) with what went wrong and how to fix it.
    """
    global _atexit_registered
    if id_exchange not in ID_EXCHANGES:
        raise ValueError(f"jax_cgx.nccl.setup: id_exchange must be 'auto', 'kv' or 'mpi', got {id_exchange!r}")
    devices, names = mesh_parts(mesh)
    _check_devices(devices)
    ident = mesh_ident(devices, names)
    wanted = wanted_families(devices, names, axes)
    with registry.lock:
        have = registry.connected.of(ident)
        new = [fam for fam in wanted if fam not in have]
        if new:
            binding = library.require_binding()
            library.load()
            process = jax.process_index()
            plan: list[PlannedGroup] = []
            for fam in new:
                key = wanted[fam]
                gen = registry.connected.generation(key)
                arr = groups_array(devices, names, fam)
                plan.extend(PlannedGroup(fam, key, gen, i, len(arr), tuple(g)) for i, g in enumerate(arr))
            uids = exchange_ids(binding, plan, process, id_exchange, timeout(timeout_s))
            if not _atexit_registered:
                atexit.register(_at_exit)
                _atexit_registered = True
            for fam in new:
                key = wanted[fam]
                registry.connected.advance_generation(key)
                for g in plan:
                    if g.axes != fam:
                        continue
                    members = _cuda_members(g, process)
                    if not members:
                        continue
                    try:
                        binding.nccl_init(key, g.world, uids[g.index, g.key], members, g.description)
                    except Exception as err:
                        _destroy_quietly(binding, key)
                        raise NcclError(
                            f"jax_cgx.nccl.setup: creating the communicators of {g.description} "
                            f"(members (ordinal, rank) {members} of {g.world}) failed: {err}"
                        ) from err
                registry.connected.record(ident, fam, key)
                log.debug("jax_cgx.nccl: communicators for axes %r (key %#x)", fam, key)
    return Communicators(mesh, types.MappingProxyType(dict(wanted)))


def _cuda_members(g: PlannedGroup, process: int) -> list[tuple[int, int]]:
    """``[(CUDA ordinal, rank)]`` of the group's devices that ``process`` owns."""
    out = []
    for rank, d in enumerate(g.devices):
        if int(d.process_index) == process:
            ordinal = getattr(d, "local_hardware_id", None)
            if ordinal is None:
                raise NcclError(f"jax_cgx.nccl: device {d!r} has no local_hardware_id (CUDA ordinal)")
            out.append((int(ordinal), rank))
    return out


def _destroy_quietly(binding, key: int) -> None:
    try:
        binding.nccl_destroy(key, True)
    except Exception as err:  # pragma: no cover - best effort after a failure
        log.warning("jax_cgx.nccl: aborting the communicators of key %#x failed: %s", key, err)


def teardown(mesh=None, *, abort: bool = False) -> int:
    """Destroy the communicators of ``mesh`` (all when None) and forget them.

    ``abort=True`` uses ``ncclCommAbort`` (never waits for peers). No computation that
    uses them may still be running: block on its results first. Call on every process.
    Returns how many communicators the extension released.

    Args:
      mesh: the mesh whose communicators go (those of every family set up on it); None (the
        default): every communicator of this process.
      abort: ``ncclCommAbort`` instead of ``ncclCommDestroy``.

    Returns:
      The number of communicators released, an ``int`` (0 where none were set up, or without the
      CUDA extension).

    Raises:
      ValueError: ``abort`` not a bool; ``mesh``'s devices not matching its axes.
      TypeError: an ``AbstractMesh``.
    """
    abort = check_bool("jax_cgx.nccl.teardown", "abort", abort)
    with registry.lock:
        binding = library.binding()
        if mesh is None:
            keys = None
            found = not registry.connected.empty()
        else:
            devices, names = mesh_parts(mesh)
            fams = registry.connected.of(mesh_ident(devices, names))
            keys = sorted(set(fams.values()))
            found = bool(keys)
        if not found or binding is None:
            if mesh is None:
                registry.connected.forget()
            return 0
        try:
            jax.effects_barrier()
        except Exception:  # pragma: no cover - best effort
            pass
        if keys is None:
            count = int(binding.nccl_destroy(-1, abort))
            registry.connected.forget()
        else:
            count = sum(int(binding.nccl_destroy(k, abort)) for k in keys)
            registry.connected.forget(mesh_ident(devices, names))
        return count


def _at_exit() -> None:
    """Abort (not destroy) what is left, after the last effects: a dead peer cannot hang exit.

    Registered at the first :func:`setup`, so it runs before jax's own exit hook (registered
    when jax was imported), which clears the backends and shuts jax.distributed down. It
    takes no lock: a daemon thread stuck in :func:`setup` must not block the exit.
    """
    if registry.connected.empty():
        return
    registry.connected.forget()
    binding = library.binding()
    if binding is None:
        return
    try:
        jax.effects_barrier()
    except Exception:
        pass
    try:
        binding.nccl_destroy(-1, True)
    except Exception as err:  # pragma: no cover - exit is best effort
        log.warning("jax_cgx.nccl: aborting communicators at exit failed: %s", err)
