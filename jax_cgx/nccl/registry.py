"""This process's communicator families, and the choice of backend they decide.

The registry is the nccl backend's :class:`~jax_cgx.nccl.groups.Families`: the families
whose communicators :func:`jax_cgx.nccl.setup` created here, and their generations.
:func:`select_backend` reads it at lowering time; setup and teardown write it holding
:data:`lock`.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from jax_cgx.config import BACKENDS
from jax_cgx.nccl import library
from jax_cgx.nccl.groups import Families
from jax_cgx.nccl.library import NcclError

__all__ = ["CommunicatorInfo", "communicators", "lock", "lookup", "select_backend"]

log = logging.getLogger("jax_cgx")

_families = Families()
# Set-up and teardown write holding it (jax_cgx.nccl.lifecycle).
lock = _families.lock
families_of = _families.of
generation = _families.generation
advance_generation = _families.advance_generation
record = _families.record
forget = _families.forget
empty = _families.empty
reset = _families.reset


# ------------------------------------------------------------- reading

def lookup(mesh, axes) -> int | None:
    """The family key when :func:`jax_cgx.nccl.setup` created communicators for ``(mesh, axes)`` here.

    ``mesh`` may be a concrete ``jax.sharding.Mesh`` or an ``AbstractMesh``; an abstract
    mesh matches the registered meshes with the same axis names and sizes, and gives a
    key only when exactly one matches. ``None`` when there is no such family.
    """
    return _lookup(mesh, axes)[0]


def _lookup(mesh, axes) -> tuple[int | None, str]:
    """(key or None, why not)."""
    return _families.find(mesh, axes)


def select_backend(requested: str, platform: str, mesh, axes) -> tuple[str, str]:
    """Which backend runs a compressed reduction over ``axes`` of ``mesh`` on CUDA: ``(backend, reason)``.

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
    if requested == "tcp":
        raise ValueError(
            f"jax_cgx: backend='tcp' runs on CPU devices only, but this computation is lowered for {platform!r}. "
            "Use backend='auto' or 'xla' (or 'nccl' on CUDA GPUs)."
        )
    if platform != "cuda":
        if requested == "nccl":
            raise NcclError(
                f"jax_cgx: backend='nccl' runs on CUDA GPUs only, but this computation is lowered for "
                f"{platform!r}. Use backend='auto' (nccl where available, else xla) or backend='xla'."
            )
        return "xla", f"platform is {platform}"
    if not library.compiled():
        if requested == "nccl":
            library.require_binding()  # raises with the rebuild hint
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



class CommunicatorInfo(NamedTuple):
    """One communicator registered in the CUDA extension (see :func:`communicators`)."""

    key: int
    ordinal: int
    rank: int
    world: int
    description: str


def communicators() -> list[CommunicatorInfo]:
    """Every communicator registered in the CUDA extension (empty without NCCL support)."""
    if not library.compiled():
        return []
    return [CommunicatorInfo(*row) for row in library.binding().nccl_communicators()]
