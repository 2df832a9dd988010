"""Reduction groups and family keys: which devices reduce together, and the key naming them.

A *reduction group* of a reduction over mesh axes ``axes`` is the set of devices that
share all other mesh coordinates; a *family* is all groups of one ``(mesh, axes)``, named
by one :func:`family_key`. The backends that own connections (nccl, tcp) plan their
communicators with these and keep the families they set up in a :class:`Families`. Everything
here reads meshes only, never a transport.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import threading
from typing import Any

import jax
import numpy as np

__all__ = [
    "PlannedGroup",
    "families",
    "family_key",
    "find_family",
    "groups",
    "groups_array",
    "key_of",
    "mesh_ident",
    "mesh_parts",
    "normalize_axes",
    "wanted_families",
]
log = logging.getLogger("jax_cgx")


def mesh_parts(mesh) -> tuple[np.ndarray, tuple[str, ...]]:
    """A concrete mesh's device array and axis names (anything with ``devices``/``axis_names``)."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        raise TypeError(
            f"jax_cgx: {mesh!r} is an AbstractMesh, which has no devices; pass the concrete "
            "jax.sharding.Mesh the program runs on"
        )
    devices = np.asarray(mesh.devices, dtype=object)
    names = tuple(mesh.axis_names)
    if devices.ndim != len(names):
        raise ValueError(f"jax_cgx: mesh devices of shape {devices.shape} do not match axes {names}")
    return devices, names


def normalize_axes(axes, names: tuple[str, ...]) -> tuple[str, ...]:
    """``axes`` (a name or names) as a tuple of ``names``' axes, each once, or ValueError."""
    tup = (axes,) if isinstance(axes, str) else tuple(axes)
    if not tup:
        raise ValueError("jax_cgx: a reduction needs at least one mesh axis; got ()")
    unknown = [a for a in tup if a not in names]
    if unknown:
        raise ValueError(f"jax_cgx: axes {unknown} are not axes of the mesh (its axes: {names})")
    if len(set(tup)) != len(tup):
        raise ValueError(f"jax_cgx: axes {tup} name an axis twice")
    return tup


def groups_array(devices: np.ndarray, names: tuple[str, ...], axes: tuple[str, ...]) -> np.ndarray:
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

    Args:
      mesh: a concrete ``jax.sharding.Mesh``.
      axes: a mesh axis name, or a tuple of them (the rank order).

    Returns:
      A list of groups, each a list of ``jax.Device`` in rank order.

    Raises:
      ValueError: ``axes`` empty, naming an axis twice or one ``mesh`` lacks; ``mesh``'s devices not
        matching its axes.
      TypeError: an ``AbstractMesh`` (it has no devices).
    """
    devices, names = mesh_parts(mesh)
    return [list(g) for g in groups_array(devices, names, normalize_axes(axes, names))]


def mesh_ident(devices: np.ndarray, names: tuple[str, ...]) -> tuple:
    """What tells meshes apart: device ids in mesh order, axis names, shape."""
    return (tuple(int(d.id) for d in devices.flat), names, tuple(int(s) for s in devices.shape))


def key_of(ident: tuple, axes: tuple[str, ...]) -> int:
    """:func:`family_key` from a :func:`mesh_ident` and normalized axes."""
    ids, names, shape = ident
    blob = json.dumps({"devices": list(ids), "names": list(names), "shape": list(shape), "axes": list(axes)},
                      separators=(",", ":"))
    # The salt keeps its first user's name: keys stay what they were for both backends.
    digest = hashlib.blake2b(blob.encode(), digest_size=8, person=b"jax_cgx.nccl").digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def family_key(mesh, axes) -> int:
    """A stable non-negative 63-bit key of the reductions over ``axes`` on ``mesh``.

    Hashes (blake2b) the mesh's device ids in mesh order, its axis names and shape, and
    the axes tuple: equal on every process and across runs. Every group of the family
    shares it; the C++ registry tells groups apart by device ordinal.

    Args:
      mesh: a concrete ``jax.sharding.Mesh``.
      axes: a mesh axis name, or a tuple of them (their order counts).

    Returns:
      The key, an ``int`` in 0..2^63-1.

    Raises:
      ValueError: ``axes`` empty, naming an axis twice or one ``mesh`` lacks; ``mesh``'s devices not
        matching its axes.
      TypeError: an ``AbstractMesh`` (it has no devices).
    """
    devices, names = mesh_parts(mesh)
    return key_of(mesh_ident(devices, names), normalize_axes(axes, names))


def families(names: tuple[str, ...], axes) -> list[tuple[str, ...]]:
    """The axes tuples :func:`jax_cgx.nccl.setup`'s ``axes`` argument names, in order, once each."""
    if axes is None:
        return [c for r in range(1, len(names) + 1) for c in itertools.combinations(names, r)]
    if isinstance(axes, str) or (isinstance(axes, tuple) and all(isinstance(a, str) for a in axes)):
        axes = [axes]  # one reduction, as in psum(x, axis_name)
    out: list[tuple[str, ...]] = []
    for a in axes:
        tup = normalize_axes(a, names)
        if tup not in out:
            out.append(tup)
    return out


def wanted_families(devices: np.ndarray, names: tuple[str, ...], axes) -> dict[tuple[str, ...], int]:
    """The families a backend's ``setup(mesh, axes)`` connects, with their keys: those of ``axes``
    (:func:`families`) whose groups hold more than one device (a group of one has nothing to connect)."""
    ident = mesh_ident(devices, names)
    wanted: dict[tuple[str, ...], int] = {}
    for fam in families(names, axes):
        world = int(np.prod([devices.shape[names.index(a)] for a in fam], dtype=np.int64))
        if world == 1:
            log.debug("jax_cgx: axes %r have one device per group; nothing to connect", fam)
            continue
        wanted[fam] = key_of(ident, fam)
    return wanted


def find_family(table: dict[tuple, dict[tuple[str, ...], int]], mesh, axes) -> tuple[int | None, str]:
    """The key of the family of ``(mesh, axes)`` in ``table`` (mesh ident -> {axes: key}), and why not.

    ``mesh`` may be a concrete ``jax.sharding.Mesh`` or an ``AbstractMesh``; an abstract mesh
    matches the meshes of ``table`` with the same axis names and sizes, and gives a key only
    when exactly one matches. Shared by the backends that own communicators (nccl, tcp).
    """
    if mesh is None:
        return None, "no mesh (the reduction is not inside shard_map over a mesh)"
    if isinstance(mesh, jax.sharding.AbstractMesh):
        names = tuple(mesh.axis_names)
        sizes = tuple(int(s) for s in mesh.axis_sizes)
        matches = [fams for (ids, n, shape), fams in table.items() if n == names and shape == sizes]
        if not matches:
            return None, "no communicators for this mesh"
        if len(matches) > 1:
            return None, (f"{len(matches)} meshes with axes {dict(zip(names, sizes))} have communicators "
                          "and the abstract mesh cannot tell them apart")
        fams = matches[0]
    else:
        try:
            devices, names = mesh_parts(mesh)
        except (TypeError, ValueError, AttributeError) as err:
            return None, f"not a mesh ({err})"
        fams = table.get(mesh_ident(devices, names))
        if fams is None:
            return None, "no communicators for this mesh"
    try:
        tup = normalize_axes(axes, names)
    except ValueError as err:
        return None, str(err)
    key = fams.get(tup)
    if key is None:
        return None, f"communicators exist for this mesh, but not for axes {tup} (set up: {sorted(fams)})"
    return key, ""


class Families:
    """One backend's communicator families in this process (nccl and tcp each keep one).

    Maps a mesh (:func:`mesh_ident`) to the families whose communicators were created here
    (axes tuple -> family key), and counts how often each family was created: its
    *generation*, part of the key-value store keys, so that a set-up after a teardown never
    reads an earlier one's entries. Set-up and teardown hold its ``lock`` while they write;
    :meth:`find` takes it to read.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._by_mesh: dict[tuple, dict[tuple[str, ...], int]] = {}
        self._generations: dict[int, int] = {}

    def of(self, ident: tuple) -> dict[tuple[str, ...], int]:
        """The families set up for a mesh: axes tuple -> key (empty when none)."""
        return dict(self._by_mesh.get(ident, {}))

    def generation(self, key: int) -> int:
        """How many times this process created family ``key``."""
        return self._generations.get(key, 0)

    def advance_generation(self, key: int) -> None:
        self._generations[key] = self.generation(key) + 1

    def record(self, ident: tuple, axes: tuple[str, ...], key: int) -> None:
        """Family ``key`` of ``axes`` on mesh ``ident`` has its communicators here."""
        self._by_mesh.setdefault(ident, {})[axes] = key

    def forget(self, ident: tuple | None = None) -> dict[tuple[str, ...], int]:
        """Forget the families of mesh ``ident`` (all when None) and return them (all meshes'
        merged when None); generations are kept."""
        if ident is None:
            gone = {axes: key for fams in self._by_mesh.values() for axes, key in fams.items()}
            self._by_mesh.clear()
            return gone
        return self._by_mesh.pop(ident, {})

    def empty(self) -> bool:
        return not self._by_mesh

    def reset(self) -> None:
        """Forget everything, generations included: a fresh process (for tests)."""
        self._by_mesh.clear()
        self._generations.clear()

    def find(self, mesh, axes) -> tuple[int | None, str]:
        """(the family key of ``(mesh, axes)`` or None, why not): :func:`find_family`."""
        with self.lock:
            return find_family(self._by_mesh, mesh, axes)


@dataclasses.dataclass(frozen=True)
class PlannedGroup:
    """One group of a family that a backend's ``setup`` is about to connect."""

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
