"""Run N processes of a script on this machine, wired for ``jax_cgx.distributed.initialize``.

    python -m jax_cgx.launch -n 4 [--devices-per-process K] [--timeout SECONDS] [--grace SECONDS]
                             [--mps] script.py [args...]

- Starts the coordinator on a free port of 127.0.0.1, listening there only
  (``JAX_COORDINATOR_BIND_ADDRESS``; jax's default is every interface), and gives each process
  its rank in ``JAX_CGX_PROCESS_ID`` / ``JAX_CGX_NUM_PROCESSES`` / ``JAX_CGX_LOCAL_RANK`` /
  ``JAX_CGX_LOCAL_COUNT`` / ``JAX_CGX_COORDINATOR``; with ``--devices-per-process K``
  (K >= 1), each process sees K simulated CPU devices (``XLA_FLAGS``).
- At most ``MAX_PROCESSES`` processes (the larger of 256 and 4 per CPU core): each is a
  whole Python interpreter with JAX, so a larger ``-n`` is refused before anything starts.
  Simulate more devices with ``--devices-per-process``, or use several machines.
- ``--mps``: processes sharing one GPU run under a private CUDA MPS daemon (``jax_cgx._src.launch.mps``).
- Standard input goes to process 0 only; the others read ``/dev/null`` (as mpirun does), so
  piped input is never split between processes by which reads first.
- Prefixes every line of output with the rank (bytes that are not UTF-8 are replaced, and
  output keeps flowing, unread, if the launcher's own output is closed: ``| head``).
- If a process fails (a non-zero status, or killed by a signal), stops the others and
  exits with the status (128 + N for signal N) of the process that failed first, naming it
  and any that failed after it before they were stopped. A script that calls
  ``jax_cgx.distributed.initialize()`` ends at once on an uncaught exception or a non-zero
  ``sys.exit``, instead of waiting in jax's shutdown barrier for the other processes; it says
  so first (``jax_cgx: process N failed``), and the process that said so first is the one
  named, even where a peer it brought down (its connections reset by its exit hooks) ended
  before it.
- A process that stops responding is named, not only the processes it brought down: when jax's
  coordination service aborts the healthy processes because one stopped sending heartbeats
  (SIGABRT, after about 100 s), the launcher names the process jax's log names, and any process
  the kernel shows stopped (SIGSTOP, a debugger); the exit status is still the first failure's.
- ``--timeout SECONDS`` limits the whole job: when it passes, the launcher names the
  processes still running, stops them and exits with 124 (as timeout(1) does).
- Stopping means SIGTERM, then SIGKILL after ``--grace`` seconds (default 5). jax catches
  SIGTERM (its preemption notice) and keeps running, so a process past
  ``jax.distributed.initialize`` usually ends only at the SIGKILL.
- Ctrl-C, SIGTERM, SIGHUP (a closed terminal or ssh session) or SIGQUIT to the launcher
  stops every process the same way and exits with 128 + the signal. No process is left
  behind: each one runs in its own process group, and the whole group is signalled; on
  Linux the processes are also killed if the launcher itself is killed (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from jax_cgx._src.arguments import integer, number
from jax_cgx._src.launch import mps
from jax_cgx._src.launch.processes import MAX_PROCESSES, TIMEOUT_EXIT, Job, say

_OUTER_SIZES = {"OMPI_COMM_WORLD_SIZE": "mpirun (Open MPI)", "PMI_SIZE": "mpirun (MPICH)",
                "SLURM_STEP_NUM_TASKS": "srun"}


def _outer_job(env) -> str | None:
    """Which launcher started this process among others ("started by srun (...=4)"), if any."""
    for variable, name in _OUTER_SIZES.items():
        try:
            size = int(env.get(variable, "1"))
        except ValueError:
            continue
        if size > 1:
            return f"started by {name} ({variable}={size})"
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m jax_cgx.launch``: start the job its command line describes and wait for it
    (the module docstring says what the launcher does).

    Args:
      argv: the command line after the program's name; None (the default): ``sys.argv[1:]``.

    Returns:
      The launcher's exit status: 0 when every process exited with 0; else the status of the
      process that failed first (128 + N for signal N); 124 when ``--timeout`` passed; 2 when the
      MPS daemon of ``--mps`` could not be run.

    Raises:
      SystemExit: a bad command line (argparse's status 2; also ``-n`` above ``MAX_PROCESSES``, or the
        launcher itself one of several processes of mpirun or srun); a signal to the launcher
        (status 128 + the signal, once the processes are stopped).
      OSError: a process could not be started.
    """
    parser = argparse.ArgumentParser(
        # The docstring's reST literals (``x``) read as plain text in a terminal and on the docs page.
        prog="python -m jax_cgx.launch", description=__doc__.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", "--nproc", type=integer(1), required=True, metavar="N",
                        help=f"number of processes (at least 1, at most {MAX_PROCESSES} here)")
    parser.add_argument("--devices-per-process", type=integer(1), default=None, metavar="K",
                        help="simulated CPU devices per process (at least 1; leave out on GPUs)")
    parser.add_argument("--timeout", type=number(0, above=True), default=None, metavar="SECONDS",
                        help=f"stop every process and exit {TIMEOUT_EXIT} if the job is still running after "
                             "this many seconds (default: no limit)")
    parser.add_argument("--grace", type=number(0), default=5.0, metavar="SECONDS",
                        help="seconds between SIGTERM and SIGKILL when stopping (default 5)")
    parser.add_argument("--mps", action="store_true",
                        help="run the processes under a private CUDA MPS daemon (several processes sharing "
                             "one GPU: their kernels run side by side instead of taking turns)")
    parser.add_argument("script", help="the Python script every process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    raw = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(raw)
    if args.nproc > MAX_PROCESSES:
        parser.error(f"argument -n/--nproc: {args.nproc} processes is more than this launcher starts on one "
                     f"machine (at most {MAX_PROCESSES}: the larger of 256 and 4 per CPU core, {os.cpu_count()} "
                     "here); each is a whole Python interpreter with JAX. Simulate more devices with "
                     "--devices-per-process K (N processes x K devices), or run on several machines under "
                     "mpirun or srun (docs/distributed.md)")
    tail = len(raw) - len(args.args)
    if tail >= 2 and raw[tail - 1] == "--" and raw[tail - 2] == args.script:
        args.args.insert(0, "--")  # argparse took the script's own leading "--" for its end of options
    if outer := _outer_job(os.environ):
        parser.error(f"this launcher is one of several processes {outer}: each would start a job of its own. "
                     "Run the script under that launcher directly (jax_cgx.distributed.initialize() reads "
                     "each process's rank from it), or start python -m jax_cgx.launch once")
    try:
        with mps.daemon(say) if args.mps else contextlib.nullcontext():  # the processes its clients
            return _run([sys.executable, args.script, *args.args], args)
    except mps.MpsError as e:
        say(str(e))
        return 2


def _run(command: list[str], args: argparse.Namespace) -> int:
    job = Job(command, args.nproc, args.devices_per_process)

    def on_signal(signum, frame):
        say(f"got {signal.Signals(signum).name}; stopping all processes")
        job._stop(args.grace)
        sys.exit(128 + signum)

    # Ctrl-C, kill, a closed terminal or ssh session (SIGHUP), Ctrl-backslash (SIGQUIT).
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), on_signal)
    return job.wait(args.grace, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
