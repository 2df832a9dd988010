"""This process's NCCL communicator families.

The nccl backend's :class:`~jax_cgx._src.backends.groups.Families` (:data:`connected`): the
families whose communicators :func:`jax_cgx.nccl.setup` created here, and their generations.
The backend reads it when choosing and lowering (:mod:`jax_cgx._src.nccl.backend`); set-up and
teardown write it holding :data:`lock`.
"""

from __future__ import annotations

from jax_cgx._src.backends.groups import Families
from jax_cgx._src.backends.protocol import CommunicatorInfo
from jax_cgx._src.nccl import library

__all__ = ["CommunicatorInfo", "communicators", "connected", "lock", "lookup"]

connected = Families()
# Set-up and teardown write holding it (jax_cgx._src.nccl.lifecycle).
lock = connected.lock


def lookup(mesh, axes) -> int | None:
    """The family key when :func:`jax_cgx.nccl.setup` created communicators for ``(mesh, axes)`` here.

    ``mesh`` may be a concrete ``jax.sharding.Mesh`` or an ``AbstractMesh``; an abstract
    mesh matches the registered meshes with the same axis names and sizes, and gives a
    key only when exactly one matches. ``None`` when there is no such family.

    Args:
      mesh: a ``jax.sharding.Mesh`` or ``AbstractMesh`` (None: no key).
      axes: the reduction's axis name, or a tuple of them (in the order given to :func:`setup
        <jax_cgx.nccl.setup>`'s ``axes``).

    Returns:
      The family key, a non-negative ``int`` below 2^63; None where no such family was set up here
      (also for axes the mesh lacks, or an object that is not a mesh).
    """
    return connected.find(mesh, axes)[0]


def communicators() -> list[CommunicatorInfo]:
    """Every communicator registered in the CUDA extension (empty without NCCL support).

    Returns:
      A list of :class:`~jax_cgx.nccl.CommunicatorInfo`, one per (family, local device).
    """
    if not library.compiled():
        return []
    return [CommunicatorInfo(*row) for row in library.binding().nccl_communicators()]
