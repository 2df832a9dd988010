"""NCCL communicators owned by jax_cgx: the Python half of the ``nccl`` backend.

The ``nccl`` backend of :func:`jax_cgx.compressed_psum` runs its exchange as a custom
call over NCCL communicators that jax_cgx creates itself, one per (reduction group,
local device). A *reduction group* of a reduction over mesh axes ``axes`` is the set of
devices that share all other mesh coordinates; a *family* is all groups of one
``(mesh, axes)``. Each family has one key (:func:`family_key`); since a device is in
exactly one group of a family, the C++ registry of the CUDA extension finds a
communicator by ``(family key, device ordinal)``, the key being an attribute of the
custom call and the ordinal the one XLA runs the call on.

Typical use, on every process, after ``jax_cgx.distributed.initialize()`` and before
the first compressed reduction is traced::

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    jax_cgx.nccl.setup(mesh)          # every reduction a program on `mesh` may run

:func:`setup` blocks until every process of every group has joined (NCCL's
``ncclCommInitRank`` is collective). All processes must therefore call it with the same
mesh and axes, in the same order. Multi-process runs exchange NCCL unique ids through
the ``jax.distributed`` key-value store (or ``mpi4py`` under ``mpirun``).

At interpreter exit, the communicators still alive are *aborted* (``ncclCommAbort``),
after ``jax.effects_barrier()``: aborting rather than destroying means a peer that died
cannot hang this process's exit. Call :func:`teardown` to release them earlier.

What the C++ side receives: ``nccl_init(key, world, uid, members, description)`` once
per group that has a device of this process, with ``members`` = ``[(ordinal, rank)]``
of this process's devices in the group, where ``ordinal`` is
``jax.Device.local_hardware_id`` (the CUDA device ordinal XLA runs the device on, which
the FFI handler reads as ``DeviceOrdinal``) and ``rank`` the device's position in the
group (= ``lax.axis_index(axes)``).

Deadlock freedom: every process walks the families and their groups in one global
order (the order of ``axes``, then groups by their other mesh coordinates), publishes
the unique ids of all groups whose rank 0 it owns *before* waiting for any other id, and
then initializes the groups in that order; ``nccl_init`` blocks only on processes that
follow the same order. Key-value store keys are
``jax_cgx/nccl/uid/<family key>/<generation>/<group index>``, the generation counting
how often this process created that family, so a setup after :func:`teardown` gets
fresh ids.

The compiled functions come from ``jax_cgx._cuda`` through :func:`_binding`; tests
replace that function with a fake to exercise everything but real NCCL on CPU.
"""

from __future__ import annotations

import atexit
import base64
import dataclasses
import hashlib
import importlib
import itertools
import json
import logging
import os
import threading
import time
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from jax_cgx.config import BACKENDS

__all__ = [
    "CommunicatorInfo",
    "Communicators",
    "NcclError",
    "NcclNotFoundError",
    "communicators",
    "family_key",
    "groups",
    "library_candidates",
    "load",
    "lookup",
    "select_backend",
    "setup",
    "teardown",
]

log = logging.getLogger("jax_cgx")

LIBRARY_ENV = "JAX_CGX_NCCL_LIBRARY"
TIMEOUT_ENV = "JAX_CGX_NCCL_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_SONAME = "libnccl.so.2"
_KV_PREFIX = "jax_cgx/nccl/uid"
_GPU_PLATFORMS = ("gpu", "cuda")


class NcclError(RuntimeError):
    """The NCCL backend cannot do what was asked (setup, lookup or a failed NCCL call)."""


class NcclNotFoundError(NcclError):
    """NCCL is not available: no CUDA extension, one built without NCCL, or no libnccl."""


class CommunicatorInfo(NamedTuple):
    """One communicator registered in the CUDA extension (see :func:`communicators`)."""

    key: int
    ordinal: int
    rank: int
    world: int
    description: str


@dataclasses.dataclass(frozen=True, repr=False)
class Communicators:
    """What :func:`setup` made available: the families of ``mesh``, axes tuple -> key."""

    mesh: Any
    families: Mapping[tuple[str, ...], int]

    def __repr__(self) -> str:
        fams = ", ".join(f"{axes!r}: {key:#018x}" for axes, key in self.families.items())
        return f"Communicators(mesh={self.mesh!r}, families={{{fams}}})"


# ------------------------------------------------------------- the binding


def _binding():
    """The compiled NCCL functions: ``jax_cgx._cuda``, or None without the CUDA extension.

    The object has ``nccl_compiled``, ``nccl_load``, ``nccl_unique_id``, ``nccl_init``,
    ``nccl_destroy`` and ``nccl_communicators``; tests monkeypatch this function.
    """
    from jax_cgx.codec import kernels as _ffi

    return _ffi._cuda


def _rebuild_hint() -> str:
    return (
        "Rebuild jax_cgx on a machine with nvcc and the NCCL headers: "
        "`pip install nvidia-nccl-cu13` (or set NCCL_HOME to an NCCL install), then "
        "`JAX_CGX_CUDA=ON pip install .` from a source checkout"
    )


def _require_nccl_binding():
    """The binding, or NcclNotFoundError saying why it cannot run NCCL and how to fix it."""
    binding = _binding()
    if binding is None:
        from jax_cgx.codec import kernels as _ffi

        why = getattr(_ffi, "_CUDA_IMPORT_ERROR", None)
        raise NcclNotFoundError(
            "jax_cgx.nccl: the nccl backend needs jax_cgx's CUDA extension (jax_cgx._cuda), "
            f"which this install lacks ({why}). {_rebuild_hint()}. Or use backend='xla'."
        )
    compiled = getattr(binding, "nccl_compiled", None)  # absent in an extension older than the backend
    if compiled is None or not compiled():
        raise NcclNotFoundError(
            "jax_cgx.nccl: jax_cgx's CUDA extension was built without NCCL support (nccl.h was "
            f"not found at build time). {_rebuild_hint()}. Or use backend='xla'."
        )
    return binding


def _nccl_compiled() -> bool:
    binding = _binding()
    try:
        return binding is not None and bool(binding.nccl_compiled())
    except Exception:  # pragma: no cover - a broken extension
        return False


# ------------------------------------------------------------- loading libnccl


def _wheel_libraries() -> list[str]:
    """libnccl.so.2 of the nvidia-nccl-cu13 wheel (the one jax[cuda13] installs), if present."""
    found: list[str] = []
    try:
        wheel = importlib.import_module("nvidia.nccl")
        for root in list(getattr(wheel, "__path__", [])):
            found.append(os.path.join(root, "lib", DEFAULT_SONAME))
    except ImportError:
        pass
    if not any(os.path.exists(p) for p in found):
        # Another layout of the wheel: ask its file list.
        try:
            from importlib import metadata

            for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
                try:
                    files = metadata.files(dist) or []
                except metadata.PackageNotFoundError:
                    continue
                for f in files:
                    if f.name == DEFAULT_SONAME:
                        path = str(f.locate())
                        if path not in found:
                            found.append(path)
        except Exception:  # pragma: no cover - unusual metadata
            pass
    return found


def library_candidates() -> list[str]:
    """Where libnccl is looked for, in order.

    1. ``$JAX_CGX_NCCL_LIBRARY`` (a file path), when set;
    2. ``libnccl.so.2`` of the ``nvidia-nccl-cu13`` wheel
       (``nvidia.nccl.__path__[0]/lib/libnccl.so.2``), when installed;
    3. ``""``: the dynamic loader's default search for ``libnccl.so.2``.
    """
    candidates: list[str] = []
    env = os.environ.get(LIBRARY_ENV, "")
    if env:
        candidates.append(env)
    for path in _wheel_libraries():
        if path not in candidates:
            candidates.append(path)
    candidates.append("")
    return candidates


_load_lock = threading.Lock()
_loaded: tuple[Any, int] | None = None  # (binding, ncclGetVersion code)


def load() -> int:
    """Load libnccl into the CUDA extension (once) and return its version code (e.g. 23203).

    Tries :func:`library_candidates` in order. Raises :class:`NcclNotFoundError` when the
    CUDA extension is missing or was built without NCCL, or when no candidate loads.
    """
    global _loaded
    with _load_lock:
        binding = _require_nccl_binding()
        if _loaded is not None and _loaded[0] is binding:
            return _loaded[1]
        env = os.environ.get(LIBRARY_ENV, "")
        tried: list[str] = []
        for path in library_candidates():
            try:
                version = int(binding.nccl_load(path))
            except Exception as err:  # RuntimeError with dlerror's text
                tried.append(f"{path or DEFAULT_SONAME + ' (default search)'}: {err}")
                continue
            if env and path != env:
                log.warning("jax_cgx.nccl: %s=%s did not load (%s); using %s", LIBRARY_ENV, env, tried[0],
                            path or DEFAULT_SONAME)
            log.debug("jax_cgx.nccl: loaded NCCL %d from %s", version, path or DEFAULT_SONAME)
            _loaded = (binding, version)
            return version
        raise NcclNotFoundError(
            "jax_cgx.nccl: cannot load the NCCL library. Tried:\n  " + "\n  ".join(tried) + "\n"
            "Install it with `pip install 'jax_cgx[cuda]'` (the nvidia-nccl-cu13 wheel), or set "
            f"{LIBRARY_ENV}=/path/to/libnccl.so.2."
        )


# ------------------------------------------------------------- groups and keys


def _mesh_parts(mesh) -> tuple[np.ndarray, tuple[str, ...]]:
    """A concrete mesh's device array and axis names (anything with ``devices``/``axis_names``)."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        raise TypeError(
            f"jax_cgx.nccl: {mesh!r} is an AbstractMesh, which has no devices; pass the concrete "
            "jax.sharding.Mesh the program runs on"
        )
    devices = np.asarray(mesh.devices, dtype=object)
    names = tuple(mesh.axis_names)
    if devices.ndim != len(names):
        raise ValueError(f"jax_cgx.nccl: mesh devices of shape {devices.shape} do not match axes {names}")
    return devices, names


def _normalize_axes(axes, names: tuple[str, ...]) -> tuple[str, ...]:
    tup = (axes,) if isinstance(axes, str) else tuple(axes)
    if not tup:
        raise ValueError("jax_cgx.nccl: a reduction needs at least one mesh axis; got ()")
    unknown = [a for a in tup if a not in names]
    if unknown:
        raise ValueError(f"jax_cgx.nccl: axes {unknown} are not axes of the mesh (its axes: {names})")
    if len(set(tup)) != len(tup):
        raise ValueError(f"jax_cgx.nccl: axes {tup} name an axis twice")
    return tup


def _groups_array(devices: np.ndarray, names: tuple[str, ...], axes: tuple[str, ...]) -> np.ndarray:
    """[group, rank] array of devices: other axes (mesh order) major, then ``axes`` in given order."""
    other = [i for i, n in enumerate(names) if n not in axes]
    reduced = [names.index(a) for a in axes]
    world = int(np.prod([devices.shape[i] for i in reduced], dtype=np.int64))
    return devices.transpose(other + reduced).reshape(-1, world)


def groups(mesh, axes) -> list[list[Any]]:
    """The reduction groups of a reduction over ``axes`` (a name or tuple of names of ``mesh``).

    A group is the devices sharing all other mesh coordinates. Within a group, position
    is rank: the linear index over ``axes`` in the given order, first axis major, which
    is what ``lax.axis_index(axes)`` returns inside ``shard_map``. Groups are ordered by
    their other coordinates, in mesh order.
    """
    devices, names = _mesh_parts(mesh)
    return [list(g) for g in _groups_array(devices, names, _normalize_axes(axes, names))]


def _mesh_ident(devices: np.ndarray, names: tuple[str, ...]) -> tuple:
    return (tuple(int(d.id) for d in devices.flat), names, tuple(int(s) for s in devices.shape))


def _key_of(ident: tuple, axes: tuple[str, ...]) -> int:
    ids, names, shape = ident
    blob = json.dumps({"devices": list(ids), "names": list(names), "shape": list(shape), "axes": list(axes)},
                      separators=(",", ":"))
    digest = hashlib.blake2b(blob.encode(), digest_size=8, person=b"jax_cgx.nccl").digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def family_key(mesh, axes) -> int:
    """A stable non-negative 63-bit key of the reductions over ``axes`` on ``mesh``.

    Hashes (blake2b) the mesh's device ids in mesh order, its axis names and shape, and
    the axes tuple: equal on every process and across runs. Every group of the family
    shares it; the C++ registry tells groups apart by device ordinal.
    """
    devices, names = _mesh_parts(mesh)
    return _key_of(_mesh_ident(devices, names), _normalize_axes(axes, names))


# ------------------------------------------------------------- registry


_lock = threading.RLock()
# mesh ident -> {axes tuple: family key}, for families whose communicators exist here.
_registry: dict[tuple, dict[tuple[str, ...], int]] = {}
# family key -> how many times this process created it (part of the key-value store keys).
_generations: dict[int, int] = {}
_atexit_registered = False


def lookup(mesh, axes) -> int | None:
    """The family key when :func:`setup` created communicators for ``(mesh, axes)`` here.

    ``mesh`` may be a concrete ``jax.sharding.Mesh`` or an ``AbstractMesh``; an abstract
    mesh matches the registered meshes with the same axis names and sizes, and gives a
    key only when exactly one matches. ``None`` when there is no such family.
    """
    return _lookup(mesh, axes)[0]


def _lookup(mesh, axes) -> tuple[int | None, str]:
    """(key or None, why not)."""
    if mesh is None:
        return None, "no mesh (the reduction is not inside shard_map over a mesh)"
    with _lock:
        if isinstance(mesh, jax.sharding.AbstractMesh):
            names = tuple(mesh.axis_names)
            sizes = tuple(int(s) for s in mesh.axis_sizes)
            matches = [fams for (ids, n, shape), fams in _registry.items() if n == names and shape == sizes]
            if not matches:
                return None, "no communicators for this mesh"
            if len(matches) > 1:
                return None, (f"{len(matches)} meshes with axes {dict(zip(names, sizes))} have communicators "
                              "and the abstract mesh cannot tell them apart")
            fams = matches[0]
        else:
            try:
                devices, names = _mesh_parts(mesh)
            except (TypeError, ValueError, AttributeError) as err:
                return None, f"not a mesh ({err})"
            fams = _registry.get(_mesh_ident(devices, names))
            if fams is None:
                return None, "no communicators for this mesh"
        try:
            tup = _normalize_axes(axes, names)
        except ValueError as err:
            return None, str(err)
        key = fams.get(tup)
        if key is None:
            return None, f"communicators exist for this mesh, but not for axes {tup} (set up: {sorted(fams)})"
        return key, ""


def select_backend(requested: str, platform: str, mesh, axes) -> tuple[str, str]:
    """Which backend runs a compressed reduction over ``axes`` of ``mesh``: ``(backend, reason)``.

    ``requested`` is ``CompressionConfig.backend`` ("auto", "xla" or "nccl"), ``platform``
    the lowering platform ("cuda", "cpu", ...). ``"nccl"`` raises :class:`NcclError` when it
    cannot be honoured; ``"auto"`` picks ``"nccl"`` only on CUDA with NCCL compiled in and
    communicators set up for ``(mesh, axes)``.
    """
    if requested not in BACKENDS:
        raise ValueError(f"jax_cgx: backend must be one of {BACKENDS}, got {requested!r}")
    choice = _select(requested, platform, mesh, axes)
    log.debug("jax_cgx: backend %s for axes %r on %s (requested %s): %s", choice[0], axes, platform, requested,
              choice[1])
    return choice


def _select(requested: str, platform: str, mesh, axes) -> tuple[str, str]:
    if requested == "xla":
        return "xla", "requested"
    if platform != "cuda":
        if requested == "nccl":
            raise NcclError(
                f"jax_cgx: backend='nccl' runs on CUDA GPUs only, but this computation is lowered for "
                f"{platform!r}. Use backend='auto' (nccl where available, else xla) or backend='xla'."
            )
        return "xla", f"platform is {platform}"
    if not _nccl_compiled():
        if requested == "nccl":
            _require_nccl_binding()  # raises with the rebuild hint
        return "xla", "jax_cgx's CUDA extension has no NCCL support"
    key, why = _lookup(mesh, axes)
    if key is not None:
        return "nccl", f"communicators set up for axes {axes!r} on this mesh"
    if requested == "nccl":
        raise NcclError(
            f"jax_cgx: backend='nccl': no NCCL communicator for axes {axes!r} of mesh {mesh!r} ({why}); "
            "call jax_cgx.nccl.setup(mesh) (on every process, before the first call of the compiled "
            "function), or use backend='auto' or 'xla'."
        )
    return "xla", f"{why}; call jax_cgx.nccl.setup(mesh) to use nccl"


# ------------------------------------------------------------- setup


@dataclasses.dataclass(frozen=True)
class _Group:
    axes: tuple[str, ...]
    key: int
    generation: int
    index: int
    count: int
    devices: tuple[Any, ...]  # rank order

    @property
    def world(self) -> int:
        return len(self.devices)

    @property
    def root_process(self) -> int:
        return int(self.devices[0].process_index)

    @property
    def processes(self) -> frozenset[int]:
        return frozenset(int(d.process_index) for d in self.devices)

    @property
    def description(self) -> str:
        ids = [int(d.id) for d in self.devices]
        return f"jax_cgx axes={self.axes!r} group {self.index} of {self.count}, devices {ids}"

    @property
    def kv_key(self) -> str:
        return f"{_KV_PREFIX}/{self.key:016x}/{self.generation}/{self.index}"

    def members(self, process: int) -> list[tuple[int, int]]:
        out = []
        for rank, d in enumerate(self.devices):
            if int(d.process_index) == process:
                ordinal = getattr(d, "local_hardware_id", None)
                if ordinal is None:
                    raise NcclError(f"jax_cgx.nccl: device {d!r} has no local_hardware_id (CUDA ordinal)")
                out.append((int(ordinal), rank))
        return out


def _families(names: tuple[str, ...], axes) -> list[tuple[str, ...]]:
    if axes is None:
        return [c for r in range(1, len(names) + 1) for c in itertools.combinations(names, r)]
    if isinstance(axes, str) or (isinstance(axes, tuple) and all(isinstance(a, str) for a in axes)):
        axes = [axes]  # one reduction, as in psum(x, axis_name)
    out: list[tuple[str, ...]] = []
    for a in axes:
        tup = _normalize_axes(a, names)
        if tup not in out:
            out.append(tup)
    return out


def _check_devices(devices: np.ndarray) -> None:
    platforms = sorted({str(getattr(d, "platform", "?")) for d in devices.flat})
    if any(p not in _GPU_PLATFORMS for p in platforms):
        raise NcclError(
            f"jax_cgx.nccl: NCCL communicators need CUDA devices; the mesh has {', '.join(platforms)} devices. "
            "Use backend='xla' (or 'auto') on other platforms, and set up NCCL only on a mesh of GPUs."
        )


def _timeout(timeout_s: float | None) -> float:
    if timeout_s is not None:
        return float(timeout_s)
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None


def setup(mesh, axes=None, *, id_exchange: str = "auto", timeout_s: float | None = None) -> Communicators:
    """Create the NCCL communicators of every reduction a program on ``mesh`` may run.

    Call on every process, with the same arguments and in the same order, before the
    first compressed reduction with backend "nccl"/"auto" is compiled. It blocks until
    every process of every group has joined.

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

    Returns the families of this call (axes tuple -> key). Families already set up are
    kept, so calling again is cheap. Raises :class:`NcclError` (or
    :class:`NcclNotFoundError`) with what went wrong and how to fix it.
    """
    global _atexit_registered
    if id_exchange not in ("auto", "kv", "mpi"):
        raise ValueError(f"jax_cgx.nccl.setup: id_exchange must be 'auto', 'kv' or 'mpi', got {id_exchange!r}")
    devices, names = _mesh_parts(mesh)
    _check_devices(devices)
    ident = _mesh_ident(devices, names)
    wanted: dict[tuple[str, ...], int] = {}
    for fam in _families(names, axes):
        world = int(np.prod([devices.shape[names.index(a)] for a in fam], dtype=np.int64))
        if world == 1:
            log.debug("jax_cgx.nccl: axes %r have one device per group; no communicators", fam)
            continue
        wanted[fam] = _key_of(ident, fam)
    with _lock:
        have = _registry.get(ident, {})
        new = [fam for fam in wanted if fam not in have]
        if new:
            binding = _require_nccl_binding()
            load()
            process = jax.process_index()
            plan: list[_Group] = []
            for fam in new:
                key = wanted[fam]
                gen = _generations.get(key, 0)
                arr = _groups_array(devices, names, fam)
                plan.extend(_Group(fam, key, gen, i, len(arr), tuple(g)) for i, g in enumerate(arr))
            uids = _exchange_ids(binding, plan, process, id_exchange, _timeout(timeout_s))
            if not _atexit_registered:
                atexit.register(_at_exit)
                _atexit_registered = True
            for fam in new:
                key = wanted[fam]
                _generations[key] = _generations.get(key, 0) + 1
                for g in plan:
                    if g.axes != fam:
                        continue
                    members = g.members(process)
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
                _registry.setdefault(ident, {})[fam] = key
                log.debug("jax_cgx.nccl: communicators for axes %r (key %#x)", fam, key)
    return Communicators(mesh, types.MappingProxyType(dict(wanted)))


def _destroy_quietly(binding, key: int) -> None:
    try:
        binding.nccl_destroy(key, True)
    except Exception as err:  # pragma: no cover - best effort after a failure
        log.warning("jax_cgx.nccl: aborting the communicators of key %#x failed: %s", key, err)


# ------------------------------------------------------------- unique ids


def _exchange_ids(binding, plan: list[_Group], process: int, id_exchange: str,
                  timeout_s: float) -> dict[tuple[int, int], bytes]:
    """The unique id of every group of ``plan`` that has a device of this process."""
    mine = [g for g in plan if process in g.processes]
    local = {(g.index, g.key): bytes(binding.nccl_unique_id())
             for g in mine if g.root_process == process}
    # Decided on the global plan, the same on every process: MPI's exchange is a collective.
    if not any(len(g.processes) > 1 for g in plan):
        return local
    method = _exchange_method(id_exchange)
    if method == "kv":
        return _exchange_kv(local, mine, process, timeout_s)
    return _exchange_mpi(local, mine, process)


def _kv_client():
    from jax._src import distributed

    return distributed.global_state.client


def _under_mpirun() -> bool:
    return any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def _exchange_method(id_exchange: str) -> str:
    if id_exchange != "auto":
        return id_exchange
    if _kv_client() is not None:
        return "kv"
    if _under_mpirun():
        try:
            import mpi4py  # noqa: F401

            return "mpi"
        except ImportError:
            pass
    raise NcclError(
        "jax_cgx.nccl.setup: several processes, but no way to exchange NCCL unique ids: "
        "jax.distributed is not initialized and this is not an mpirun job with mpi4py. Call "
        "jax_cgx.distributed.initialize() first (or pass id_exchange='mpi' under mpirun with mpi4py)."
    )


def _exchange_kv(local: dict, mine: list[_Group], process: int, timeout_s: float) -> dict:
    client = _kv_client()
    if client is None:
        raise NcclError(
            "jax_cgx.nccl.setup: id_exchange='kv' needs jax.distributed; call "
            "jax_cgx.distributed.initialize() (or jax.distributed.initialize()) first"
        )
    has_bytes = hasattr(client, "key_value_set_bytes") and hasattr(client, "blocking_key_value_get_bytes")
    # Publish every id this process roots before waiting for any: no wait depends on an init.
    for g in mine:
        if g.root_process == process and len(g.processes) > 1:
            uid = local[g.index, g.key]
            if has_bytes:
                client.key_value_set_bytes(g.kv_key, uid)
            else:
                client.key_value_set(g.kv_key, base64.b64encode(uid).decode())
    out = dict(local)
    deadline = time.monotonic() + timeout_s
    for g in mine:
        if g.root_process == process:
            continue
        remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            if has_bytes:
                uid = bytes(client.blocking_key_value_get_bytes(g.kv_key, remaining_ms))
            else:
                uid = base64.b64decode(client.blocking_key_value_get(g.kv_key, remaining_ms))
        except Exception as err:
            raise NcclError(
                f"jax_cgx.nccl.setup: timed out after {timeout_s:g} s waiting for process {g.root_process} "
                f"to publish the NCCL unique id of {g.description} (key-value store key {g.kv_key!r}). "
                f"Did process {g.root_process} call jax_cgx.nccl.setup with the same mesh and axes? Every "
                "process must call it with the same arguments in the same order. A slower peer may need "
                f"more time: setup(timeout_s=...) or {TIMEOUT_ENV}. ({type(err).__name__}: {err})"
            ) from err
        out[g.index, g.key] = uid
    return out


def _exchange_mpi(local: dict, mine: list[_Group], process: int) -> dict:
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise NcclError(f"jax_cgx.nccl.setup: id_exchange='mpi' needs mpi4py ({err}); pip install mpi4py") from err
    comm = MPI.COMM_WORLD
    nprocs = jax.process_count()
    if comm.Get_size() != nprocs:
        raise NcclError(
            f"jax_cgx.nccl.setup: MPI.COMM_WORLD has {comm.Get_size()} ranks but jax has {nprocs} processes; "
            "run one jax process per MPI rank, or use id_exchange='kv'"
        )
    # One collective for all groups: every process learns every id, keyed by group.
    gathered = comm.allgather((process, {k: v for k, v in local.items()}))
    indices = [p for p, _ in gathered]
    if indices != list(range(nprocs)):
        raise NcclError(
            f"jax_cgx.nccl.setup: MPI ranks 0..{nprocs - 1} are jax processes {indices}; jax's process index "
            "must equal the MPI rank (initialize jax.distributed with process_id=MPI rank, e.g. via "
            "jax_cgx.distributed.initialize()), or use id_exchange='kv'"
        )
    published: dict = {}
    for _, ids in gathered:
        published.update(ids)
    out = dict(local)
    for g in mine:
        if (g.index, g.key) not in out:
            if (g.index, g.key) not in published:  # pragma: no cover - a root that skipped setup
                raise NcclError(f"jax_cgx.nccl.setup: process {g.root_process} published no id for {g.description}")
            out[g.index, g.key] = published[g.index, g.key]
    return out


# ------------------------------------------------------------- teardown and inspection


def teardown(mesh=None, *, abort: bool = False) -> int:
    """Destroy the communicators of ``mesh`` (all when None) and forget them.

    ``abort=True`` uses ``ncclCommAbort`` (never waits for peers). No computation that
    uses them may still be running: block on its results first. Call on every process.
    Returns how many communicators the extension released.
    """
    with _lock:
        binding = _binding()
        if mesh is None:
            keys = None
            found = bool(_registry)
        else:
            devices, names = _mesh_parts(mesh)
            fams = _registry.get(_mesh_ident(devices, names), {})
            keys = sorted(set(fams.values()))
            found = bool(keys)
        if not found or binding is None:
            if mesh is None:
                _registry.clear()
            return 0
        try:
            jax.effects_barrier()
        except Exception:  # pragma: no cover - best effort
            pass
        if keys is None:
            count = int(binding.nccl_destroy(-1, abort))
            _registry.clear()
        else:
            count = sum(int(binding.nccl_destroy(k, abort)) for k in keys)
            del _registry[_mesh_ident(devices, names)]
        return count


def communicators() -> list[CommunicatorInfo]:
    """Every communicator registered in the CUDA extension (empty without NCCL support)."""
    if not _nccl_compiled():
        return []
    return [CommunicatorInfo(*(row)) for row in _binding().nccl_communicators()]


def _at_exit() -> None:
    """Abort (not destroy) what is left, after the last effects: a dead peer cannot hang exit.

    Registered at the first :func:`setup`, so it runs before jax's own exit hook (registered
    when jax was imported), which clears the backends and shuts jax.distributed down. It
    takes no lock: a daemon thread stuck in :func:`setup` must not block the exit.
    """
    if not _registry:
        return
    _registry.clear()
    binding = _binding()
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
