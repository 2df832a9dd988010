"""NCCL communicators owned by jax_cgx: the Python half of the ``nccl`` backend.

The ``nccl`` backend of :func:`jax_cgx.compressed_psum` (and of
:func:`~jax_cgx.compressed_psum_scatter` and :func:`~jax_cgx.compressed_all_gather`)
runs its exchange as a custom call over NCCL communicators that jax_cgx creates itself,
one per (reduction group, local device). A *reduction group* of a reduction over mesh axes ``axes`` is the set of
devices that share all other mesh coordinates; a *family* is all groups of one
``(mesh, axes)``. Each family has one key (:func:`family_key`); since a device is in
exactly one group of a family, the C++ registry of the CUDA extension finds a
communicator by ``(family key, device ordinal)``, the key being an attribute of the
custom call and the ordinal the one XLA runs the call on.

Nothing is connected until :func:`setup` (on GPUs; elsewhere it raises, saying why):

>>> jax_cgx.nccl.communicators()
[]

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

The package, one module per job (each imports only those above it):

=================  ==================================================================
``library``        the compiled binding (``jax_cgx._cuda``), loading libnccl, the errors
``registry``       this process's families and :func:`lookup`
``unique_ids``     handing NCCL unique ids to the processes of each group (kv or MPI)
``lifecycle``      :func:`setup`, :func:`teardown`, the exit hook
``backend``        ``jax_cgx._src.nccl.backend.NcclBackend``: its custom calls (imports the rest)
=================  ==================================================================

Reduction groups and family keys (:func:`groups`, :func:`family_key`) are shared with the tcp
backend (``jax_cgx._src.backends.groups``).

The compiled functions are reached only through ``library.binding()``; tests replace
that function with a fake to exercise everything but real NCCL on CPU.
"""


from jax_cgx._src.backends.groups import family_key, groups
from jax_cgx._src.nccl import backend as _backend  # noqa: F401  (registers the nccl backend)
from jax_cgx._src.nccl.library import (
    DEFAULT_SONAME,
    LIBRARY_ENV,
    NcclError,
    NcclNotFoundError,
    library_candidates,
    load,
)
from jax_cgx._src.nccl.lifecycle import Communicators, setup, teardown
from jax_cgx._src.nccl.registry import CommunicatorInfo, communicators, lookup
from jax_cgx._src.nccl.unique_ids import DEFAULT_TIMEOUT_S, TIMEOUT_ENV

__all__ = [
    "DEFAULT_SONAME",
    "DEFAULT_TIMEOUT_S",
    "LIBRARY_ENV",
    "TIMEOUT_ENV",
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
    "setup",
    "teardown",
]
