"""jax's multi-process runtime started with what the launcher says (:func:`initialize`): the
coordinator's address where jax does not find it (Open MPI 5, MPICH/PMI, one node), gloo for CPU
collectives, one GPU per process, a failing process ending at once."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jax_cgx._src import exits, unmatched
from jax_cgx._src.arguments import check_bool
from jax_cgx._src.distributed.placement import ProcessInfo, detect

__all__ = ["initialize"]

log = logging.getLogger("jax_cgx")


def _one_node_coordinator(info: ProcessInfo, env: Mapping[str, str]) -> str | None:
    """Open MPI 5's job on one node: 127.0.0.1 and a port every rank derives from the job's PMIx
    namespace (``prterun-HOST-PID@JOB``), where Open MPI 4's ``OMPI_MCA_orte_hnp_uri``, which jax
    reads, is gone. None on several nodes or without the namespace."""
    namespace = env.get("PMIX_NAMESPACE")
    if info.local_count != info.process_count or not namespace:
        return None
    return f"127.0.0.1:{20000 + zlib.crc32(namespace.encode()) % 30000}"


def _check_slurm_coordinator() -> None:
    """jax takes the coordinator's host from the first name of ``SLURM_STEP_NODELIST``; a name that
    does not resolve would make every process wait ``initialization_timeout`` (300 s) for it."""
    try:
        from jax._src.clusters import SlurmCluster

        host = SlurmCluster.get_coordinator_address(None, None).rpartition(":")[0]
    except Exception:  # noqa: BLE001 - jax's private helper changed: jax's own error will speak
        return
    try:
        socket.getaddrinfo(host, None)
    except OSError as e:
        raise RuntimeError(
            f"jax_cgx.distributed.initialize: the SLURM node {host!r}, where jax puts the coordinator (the first "
            f"of SLURM_STEP_NODELIST={os.environ.get('SLURM_STEP_NODELIST')!r}), does not resolve ({e}); give the "
            "nodes resolvable names (slurm.conf's NodeName/NodeHostname), or set JAX_COORDINATOR_ADDRESS=host:port"
        ) from None


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
    unmatched_timeout_s: float | None = None,
    **jax_options: Any,
) -> ProcessInfo:
    """Start jax's multi-process runtime with what the launcher says; return this process's place.

    Explicit arguments win over the environment. Under Open MPI 4 and SLURM, jax finds the
    coordinator itself; under MPICH/PMI and Open MPI 5 it comes from ``JAX_COORDINATOR_ADDRESS``,
    else (Open MPI 5, every rank on one node) 127.0.0.1 and a port derived from the job's PMIx
    namespace, else, when mpi4py is installed, rank 0 broadcasts one. With one process and no launcher this
    does nothing and returns ``ProcessInfo(0, 1, 0, 1, None, "single")``.

    Call it first, before anything touches a jax device.

    Devices: with several processes on a node and ``one_gpu_per_process`` (the default),
    each process takes the GPU of its local rank; otherwise (one process per node, or
    ``one_gpu_per_process=False``) it drives every local GPU. ``local_device_ids`` or
    ``JAX_LOCAL_DEVICE_IDS`` overrides both. Other keyword arguments
    (``heartbeat_timeout_seconds``, ``shutdown_timeout_seconds``, ...) go to
    ``jax.distributed.initialize`` as they are: a process that ends long before the others
    waits for them in jax's shutdown barrier for ``shutdown_timeout_seconds`` (jax's default
    300) and is then aborted, so raise it for jobs whose processes may finish far apart.

    With ``exit_on_uncaught_exception`` (the default), a failing process ends at once,
    with its own status, so that the launcher (jax_cgx.launch, mpirun, srun) learns of the
    failure and stops the job. Otherwise the interpreter would run jax's exit hook, whose
    shutdown barrier waits (up to 5 minutes) for peers that are still computing or are
    blocked in a collective with this process:

    - an uncaught exception prints its traceback and exits with status 1;
    - ``sys.exit(n)``, ``exit(n)`` or ``quit(n)`` with a non-zero status (also
      ``sys.exit("message")``: status 1, argparse errors: status 2) exits with that status
      once the ``SystemExit`` reaches the top level uncaught.

    Either way the exit hooks the program registered with :mod:`atexit` after importing
    jax_cgx (loggers, checkpoint writers) run first, in their usual order; only jax's own
    hooks, whose barrier would wait for the peers, are skipped.

    A zero status (the script ends, or ``sys.exit(0)``) runs jax's normal shutdown, which
    waits for the other processes. A process left waiting in a collective its peers never
    run (one step too many) is ended instead, once it has waited ``unmatched_timeout_s``
    (else ``$JAX_CGX_UNMATCHED_TIMEOUT_S``, else 20 s; 0: never) in one jax call after a
    peer finished: it says so, naming the call, and exits with status 1; the finished
    peers leave with status 0 (``jax_cgx._src.unmatched``; docs/checkpointing.md). The hook sees ``sys.exit``, ``exit`` and ``quit`` as
    looked up when called; a ``SystemExit`` from one looked up earlier is found if it is
    still held at exit (absl's ``app.run`` holds it), else, like a ``raise SystemExit(n)``
    statement, it waits in the barrier, and the process says so on stderr. An uncaught
    exception under another ``sys.excepthook`` installed later still exits at once.

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator service; None: from the
        launcher (above).
      num_processes: the number of processes; None: from the launcher.
      process_id: this process's index; None: from the launcher.
      local_device_ids: the local devices this process drives; None: as described above.
      cpu_collectives: jax's CPU collectives for several processes (``"gloo"``); ``None`` or ``""``
        leaves jax's setting alone.
      one_gpu_per_process: with several processes on a node, each takes the GPU of its local rank.
      initialization_timeout: seconds jax waits for every process to join.
      exit_on_uncaught_exception: a failing process ends at once with its status (above).
      unmatched_timeout_s: seconds a process may wait in one collective after a peer finished
        (else ``JAX_CGX_UNMATCHED_TIMEOUT_S``, else 20; 0: never ended).
      **jax_options: passed to ``jax.distributed.initialize`` as they are.

    Returns:
      This process's :class:`ProcessInfo` (``source`` says which launcher it came from).

    Raises:
      ValueError: a launcher's variables that are malformed, out of range or partial (named);
        ``one_gpu_per_process`` or ``exit_on_uncaught_exception`` not a bool; ``unmatched_timeout_s``
        (or ``JAX_CGX_UNMATCHED_TIMEOUT_S``) not a number of seconds in [0, 1e9].
      RuntimeError: no coordinator can be found (MPICH or Open MPI 5 on several nodes without
        ``JAX_COORDINATOR_ADDRESS`` or mpi4py), or SLURM's first node name does not resolve.
    """
    fn = "jax_cgx.distributed.initialize"
    one_gpu_per_process = check_bool(fn, "one_gpu_per_process", one_gpu_per_process)
    exit_on_uncaught_exception = check_bool(fn, "exit_on_uncaught_exception", exit_on_uncaught_exception)
    unmatched_timeout_s = unmatched.timeout_from_env(unmatched_timeout_s, fn)
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
    # jax finds the coordinator itself under SLURM and Open MPI 4 (OMPI_MCA_orte_hnp_uri), not under
    # MPICH or Open MPI 5 (jax issue 14576).
    env = os.environ
    if info.coordinator_address is None and (
            info.source == "mpich" or (info.source == "openmpi" and "OMPI_MCA_orte_hnp_uri" not in env)):
        one_node = _one_node_coordinator(info, env) if info.source == "openmpi" else None
        address = one_node or _coordinator_from_mpi4py()
        if address is None:
            name = "MPICH/PMI" if info.source == "mpich" else f"Open MPI {env.get('OMPI_VERSION', '5')} on several nodes"
            raise RuntimeError(
                f"jax_cgx.distributed.initialize: under {name} the coordinator address is not in "
                "the environment; set JAX_COORDINATOR_ADDRESS=host:port (reachable from every "
                "process: mpirun -x JAX_COORDINATOR_ADDRESS=...), pass coordinator_address=, or install mpi4py"
            )
        log.info("jax_cgx.distributed: %s: coordinator %s (%s)", info.source, address,
                 "every rank on one node: 127.0.0.1, the port from the PMIx namespace" if one_node
                 else "rank 0's, sent by mpi4py")
        info = dataclasses.replace(info, coordinator_address=address)
    if info.coordinator_address is None and info.source == "slurm":
        _check_slurm_coordinator()
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    if local_device_ids is None and not os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        if one_gpu_per_process and info.local_count > 1:
            # Several processes on this node: each takes the GPU of its local rank (ignored on CPU).
            local_device_ids = [info.local_rank]
        else:
            # Every local GPU. Not None: under Open MPI and SLURM, jax would then pick the GPU of
            # the local rank itself (its cluster detection), also for the one process of a node.
            local_device_ids = []
    log.info(
        "jax_cgx.distributed: process %d of %d (local rank %d of %d) via %s, coordinator %s",
        info.process_index, info.process_count, info.local_rank, info.local_count, info.source,
        info.coordinator_address or "(auto)",
    )
    if exit_on_uncaught_exception:
        exits.install(info.process_index)
    jax.distributed.initialize(
        coordinator_address=info.coordinator_address,
        num_processes=info.process_count,
        process_id=info.process_index,
        local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout,
        **jax_options,
    )
    from jax._src import distributed as jax_distributed

    if jax_distributed.global_state.client is not None:  # None only where jax's initialize is stubbed out (tests)
        unmatched.watch(jax_distributed.global_state, info.process_index, info.process_count, unmatched_timeout_s,
                        jax_options.get("shutdown_timeout_seconds", 300))
    return info
