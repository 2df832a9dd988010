"""Where this process sits in a job, read from what started it: ``jax_cgx.launch``, Open MPI, MPICH/PMI,
SLURM (:func:`detect`); the variables ``python -m jax_cgx.launch`` gives its processes."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping

log = logging.getLogger("jax_cgx")

__all__ = ["COORDINATOR_VARIABLE", "RANK_VARIABLES", "ProcessInfo", "detect"]

# What every process of ``python -m jax_cgx.launch`` finds in its environment: rank, world
# size, local rank, local count, then the coordinator's address. (Defined here, not in the
# launcher: importing jax_cgx must not import jax_cgx.launch, or ``python -m`` warns.)
RANK_VARIABLES = ("JAX_CGX_PROCESS_ID", "JAX_CGX_NUM_PROCESSES", "JAX_CGX_LOCAL_RANK", "JAX_CGX_LOCAL_COUNT")
COORDINATOR_VARIABLE = "JAX_CGX_COORDINATOR"


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits in the job.

    Made by :func:`~jax_cgx.distributed.detect` and :func:`~jax_cgx.distributed.initialize`.

    Attributes:
      process_index: this process's rank, 0..process_count-1.
      process_count: the number of processes in the job.
      local_rank: its rank among the processes on its node (0 where the launcher gives none).
      local_count: the number of processes on its node (1 where the launcher gives none).
      coordinator_address: ``host:port`` of process 0's coordinator service, where known (None:
        jax finds it itself, or a single process).
      source: where the above came from: ``"arguments"``, ``"jax_cgx.launch"``, ``"openmpi"``,
        ``"mpich"``, ``"slurm"`` or ``"single"`` (no launcher: process 0 of 1).
    """

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
        raise ValueError(f"{name}={raw!r} is not an integer (a launcher sets it: a rank, or a number of "
                         "processes); unset it, or start the processes with that launcher") from None


def _check_place(source: str, names: tuple[str, ...], rank: int, size: int, local: int | None,
                 local_count: int | None, coordinator: str | None, coordinator_variable: str) -> None:
    """A rank in 0..size-1 of size >= 1 (the local ones alike), and a coordinator host:port."""
    rank_var, size_var, local_var, local_size_var = names
    fix = f"; these come from {source}: start the processes with it, or unset them"
    if size < 1:
        raise ValueError(f"{size_var}={size} must be at least 1{fix}")
    if not 0 <= rank < size:
        raise ValueError(f"{rank_var}={rank} must be in 0..{size - 1} ({size_var}={size}){fix}")
    if local_count is not None and local_count < 1:
        raise ValueError(f"{local_size_var}={local_count} must be at least 1{fix}")
    if local is not None and not 0 <= local < (local_count or size):
        raise ValueError(f"{local_var}={local} must be in 0..{(local_count or size) - 1}{fix}")
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not (host and port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"{coordinator_variable}={coordinator!r} must be host:port (a port in 1..65535), "
                             "e.g. 10.0.0.1:1234")


def detect(env: Mapping[str, str] | None = None) -> ProcessInfo:
    """This process's rank, world size and local rank, read from the launcher's environment.

    A launcher's rank without its size (or the reverse) is an error naming the missing variable,
    not a quiet single-process run. SLURM counts only inside an ``srun`` step: a batch script's
    shell, without the step's size ``SLURM_STEP_NUM_TASKS``, runs as one process.

    Args:
      env: the variables to read (default: ``os.environ``).

    Returns:
      A :class:`ProcessInfo`; ``source="single"`` (process 0 of 1) where no launcher is found.

    Raises:
      ValueError: a launcher's variable malformed, out of range, or set without its partner.

    Examples:
      >>> jax_cgx.distributed.detect()  # a process started on its own
      ProcessInfo(process_index=0, process_count=1, local_rank=0, local_count=1, coordinator_address=None, source='single')
    """
    env = os.environ if env is None else env
    sources = [
        ("jax_cgx.launch", *RANK_VARIABLES),
        ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
         "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        ("slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
    ]
    for source, rank_var, size_var, local_var, local_size_var in sources:
        rank, size = _int(env, rank_var), _int(env, size_var)
        if rank is None and size is None:
            continue
        if rank is None or size is None:
            if source == "slurm":
                log.info("jax_cgx.distributed: a SLURM allocation outside an srun step: one process "
                         "(start the processes with srun to run them as one job)")
                continue
            have, missing = (rank_var, size_var) if size is None else (size_var, rank_var)
            raise ValueError(f"{have} is set but {missing} is not: a partial {source} environment. Start the "
                             f"processes with {source}, or set both (rank and world size), or neither")
        local = _int(env, local_var)
        local_count = _slurm_tasks_here(env) if source == "slurm" else _int(env, local_size_var)
        coordinator_variable = COORDINATOR_VARIABLE if env.get(COORDINATOR_VARIABLE) else "JAX_COORDINATOR_ADDRESS"
        coordinator = env.get(coordinator_variable) or None
        _check_place(source, (rank_var, size_var, local_var, local_size_var), rank, size, local, local_count,
                     coordinator, coordinator_variable)
        return ProcessInfo(rank, size, local if local is not None else 0, local_count or 1, coordinator, source)
    return ProcessInfo(0, 1, 0, 1, None, "single")


def _slurm_tasks_here(env: Mapping[str, str]) -> int | None:
    """The number of this step's tasks on this node: SLURM's tasks-per-node list (``"2(x3),1"``: two on
    each of the first three nodes, one on the fourth) at ``SLURM_NODEID``. (``srun --ntasks=4`` sets no
    ``SLURM_NTASKS_PER_NODE``; without a count each task would take every GPU.)"""
    name = next((n for n in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
                 if env.get(n)), None)
    if name is None:
        return None
    layout, counts = env[name], []
    for part in layout.split(","):
        if not (match := re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())):
            raise ValueError(f"{name}={layout!r} is not SLURM's tasks-per-node list (e.g. '2(x3),1'); start the "
                             "processes with srun, or unset it")
        counts += [int(match[1])] * int(match[2] or 1)
    node = _int(env, "SLURM_NODEID") or 0
    if not 0 <= node < len(counts):
        raise ValueError(f"SLURM_NODEID={node} is outside {name}={layout!r} ({len(counts)} nodes); start the "
                         "processes with srun, or unset them")
    return counts[node]


