"""Handing NCCL unique ids from each group's rank-0 process to the group's other processes.

Two transports: the ``jax.distributed`` key-value store (``"kv"``) or one MPI allgather
(``"mpi"``, mpi4py under mpirun). Deadlock freedom: a process publishes the ids of every
group whose rank 0 it owns *before* waiting for any id of another process, so no wait
depends on a ``ncclCommInitRank`` that has not happened yet.
"""

from __future__ import annotations

import base64
import os
import time

import jax

from jax_cgx._src.arguments import DEFAULT_TIMEOUT_S, timeout_seconds
from jax_cgx._src.backends.groups import PlannedGroup
from jax_cgx._src.nccl.library import NcclError

__all__ = ["DEFAULT_TIMEOUT_S", "ID_EXCHANGES", "TIMEOUT_ENV", "exchange_ids", "timeout"]

TIMEOUT_ENV = "JAX_CGX_NCCL_TIMEOUT_S"
ID_EXCHANGES = ("auto", "kv", "mpi")


def timeout(timeout_s: float | None, env: str = TIMEOUT_ENV, api: str = "jax_cgx.nccl") -> float:
    """``timeout_s``, else ``$env``, else 300 s (:func:`jax_cgx._src.arguments.timeout_seconds`)."""
    return timeout_seconds(timeout_s, env, api)


def exchange_ids(binding, plan: list[PlannedGroup], process: int, id_exchange: str,
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


# Key-value store keys of the unique ids: <prefix>/<family key>/<generation>/<group index>.
KV_PREFIX = "jax_cgx/nccl/uid"


def _kv_key(g: PlannedGroup) -> str:
    return f"{KV_PREFIX}/{g.key:016x}/{g.generation}/{g.index}"


def _exchange_kv(local: dict, mine: list[PlannedGroup], process: int, timeout_s: float) -> dict:
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
                client.key_value_set_bytes(_kv_key(g), uid)
            else:
                client.key_value_set(_kv_key(g), base64.b64encode(uid).decode())
    out = dict(local)
    deadline = time.monotonic() + timeout_s
    for g in mine:
        if g.root_process == process:
            continue
        remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            if has_bytes:
                uid = bytes(client.blocking_key_value_get_bytes(_kv_key(g), remaining_ms))
            else:
                uid = base64.b64decode(client.blocking_key_value_get(_kv_key(g), remaining_ms))
        except Exception as err:
            raise NcclError(
                f"jax_cgx.nccl.setup: timed out after {timeout_s:g} s waiting for process {g.root_process} "
                f"to publish the NCCL unique id of {g.description} (key-value store key {_kv_key(g)!r}). "
                f"Did process {g.root_process} call jax_cgx.nccl.setup with the same mesh and axes? Every "
                "process must call it with the same arguments in the same order. A slower peer may need "
                f"more time: setup(timeout_s=...) or {TIMEOUT_ENV}. ({type(err).__name__}: {err})"
            ) from err
        out[g.index, g.key] = uid
    return out


def _exchange_mpi(local: dict, mine: list[PlannedGroup], process: int) -> dict:
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

