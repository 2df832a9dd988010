"""Multi-process setup: ``jax.distributed.initialize`` that knows launchers.

:func:`initialize` reads who this process is from, in order: explicit arguments,
``python -m jax_cgx.launch`` (``JAX_CGX_*`` variables), Open MPI (``OMPI_COMM_WORLD_*``),
MPICH/PMI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``) and SLURM (``SLURM_PROCID``...).
It then starts jax's distributed runtime, selects gloo for CPU collectives, and, when
several processes share a node, gives each one GPU (its local rank). In a plain
single-process run it does nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import traceback
from collections.abc import Mapping, Sequence

import jax

__all__ = ["ProcessInfo", "detect", "initialize"]

log = logging.getLogger("jax_cgx")


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits in the job."""

    process_index: int
    process_count: int
    local_rank: int
    local_count: int
    coordinator_address: str | None
    source: str  # "arguments", "jax_cgx.launch", "openmpi", "mpich", "slurm" or "single"


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def detect(env: Mapping[str, str] | None = None) -> ProcessInfo:
    """This process's rank, world size and local rank, read from the launcher's environment."""
    env = os.environ if env is None else env
    sources = [
        ("jax_cgx.launch", "JAX_CGX_PROCESS_ID", "JAX_CGX_NUM_PROCESSES", "JAX_CGX_LOCAL_RANK", "JAX_CGX_LOCAL_COUNT"),
        ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
         "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
    ]
    for source, rank_var, size_var, local_var, local_size_var in sources:
        rank, size = _int(env, rank_var), _int(env, size_var)
        if rank is None or size is None:
            continue
        local = _int(env, local_var)
        # SLURM_NTASKS_PER_NODE may read "4(x2)"; only a plain count is used.
        try:
            local_count = _int(env, local_size_var)
        except ValueError:
            local_count = None
        coordinator = env.get("JAX_CGX_COORDINATOR") or env.get("JAX_COORDINATOR_ADDRESS")
        return ProcessInfo(rank, size, local if local is not None else 0, local_count or 1, coordinator, source)
    return ProcessInfo(0, 1, 0, 1, None, "single")


def _coordinator_from_mpi4py() -> str | None:
    """Rank 0 picks a free port on its host and broadcasts it (MPICH and other MPIs)."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    address = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            address = f"{socket.gethostname()}:{s.getsockname()[1]}"
    return comm.bcast(address, root=0)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    *,
    cpu_collectives: str = "gloo",
    one_gpu_per_process: bool = True,
    initialization_timeout: int = 300,
    exit_on_uncaught_exception: bool = True,
) -> ProcessInfo:
    """Start jax's multi-process runtime with what the launcher says; return this process's place.

    Explicit arguments win over the environment. Under Open MPI and SLURM, jax finds the
    coordinator itself; under MPICH/PMI it comes from ``JAX_COORDINATOR_ADDRESS`` or, when
    mpi4py is installed, rank 0 broadcasts one. With one process and no launcher this
    does nothing and returns ``ProcessInfo(0, 1, 0, 1, None, "single")``.

    Call it first, before anything touches a jax device.

    With ``exit_on_uncaught_exception`` (the default), an uncaught exception prints its
    traceback and ends the process at once with status 1. Otherwise the interpreter would
    run jax's exit hook, whose shutdown barrier waits (up to 5 minutes) for peers that
    are still computing, and the launcher (jax_cgx.launch, mpirun, srun) would not learn
    of the failure in time to stop the job.
    """
    info = detect()
    if any(v is not None for v in (coordinator_address, num_processes, process_id)):
        info = dataclasses.replace(
            info,
            process_index=info.process_index if process_id is None else process_id,
            process_count=info.process_count if num_processes is None else num_processes,
            coordinator_address=coordinator_address or info.coordinator_address,
            source="arguments",
        )
    if info.process_count == 1 and info.source in ("single", "arguments") and coordinator_address is None:
        log.debug("jax_cgx.distributed: single process, nothing to initialize")
        return info
    if info.coordinator_address is None and info.source == "mpich":
        address = _coordinator_from_mpi4py()
        if address is None:
            raise RuntimeError(
                "jax_cgx.distributed.initialize: under MPICH/PMI the coordinator address is not in "
                "the environment; set JAX_COORDINATOR_ADDRESS=host:port (reachable from every "
                "process), pass coordinator_address=, or install mpi4py"
            )
        info = dataclasses.replace(info, coordinator_address=address)
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    if local_device_ids is None and one_gpu_per_process and info.local_count > 1:
        # Several processes on this node: each takes the GPU of its local rank (ignored on CPU).
        local_device_ids = [info.local_rank]
    log.info(
        "jax_cgx.distributed: process %d of %d (local rank %d of %d) via %s, coordinator %s",
        info.process_index, info.process_count, info.local_rank, info.local_count, info.source,
        info.coordinator_address or "(auto)",
    )
    if exit_on_uncaught_exception:
        _exit_on_uncaught_exception(info.process_index)
    jax.distributed.initialize(
        coordinator_address=info.coordinator_address,
        num_processes=info.process_count,
        process_id=info.process_index,
        local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout,
    )
    return info


def _exit_on_uncaught_exception(rank: int) -> None:
    previous = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt):
            previous(kind, value, tb)
        else:
            print(f"jax_cgx: process {rank} failed:", file=sys.stderr)
            traceback.print_exception(kind, value, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip jax's blocking shutdown barrier: let the launcher see the failure now

    sys.excepthook = hook
