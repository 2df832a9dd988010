"""Run N processes of a script on this machine, wired for ``jax_cgx.distributed.initialize``.

    python -m jax_cgx.launch -n 4 [--devices-per-process K] [--timeout SECONDS] [--grace SECONDS]
                             script.py [args...]

- Starts the coordinator on a free port of 127.0.0.1 and gives each process its rank in
  ``JAX_CGX_PROCESS_ID`` / ``JAX_CGX_NUM_PROCESSES`` / ``JAX_CGX_LOCAL_RANK`` /
  ``JAX_CGX_LOCAL_COUNT`` / ``JAX_CGX_COORDINATOR``; with ``--devices-per-process K``
  (K >= 1), each process sees K simulated CPU devices (``XLA_FLAGS``).
- Prefixes every line of output with the rank.
- If a process fails (a non-zero status, or killed by a signal), stops the others and
  exits with its status (128 + N for signal N), naming the process. A script that calls
  ``jax_cgx.distributed.initialize()`` ends at once on an uncaught exception or a non-zero
  ``sys.exit``, instead of waiting in jax's shutdown barrier for the other processes.
- ``--timeout SECONDS`` limits the whole job: when it passes, the launcher names the
  processes still running, stops them and exits with 124 (as timeout(1) does).
- Stopping means SIGTERM, then SIGKILL after ``--grace`` seconds (default 5). jax catches
  SIGTERM (its preemption notice) and keeps running, so a process past
  ``jax.distributed.initialize`` usually ends only at the SIGKILL.
- Ctrl-C or SIGTERM to the launcher stops every process the same way and exits with
  128 + the signal. No process is left behind: each one runs in its own process group,
  and the whole group is signalled; on Linux the processes are also killed if the
  launcher itself is killed (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every process finds in its environment (read by jax_cgx.distributed.detect):
# rank, world size, local rank, local count, then the coordinator's address.
RANK_VARIABLES = ("JAX_CGX_PROCESS_ID", "JAX_CGX_NUM_PROCESSES", "JAX_CGX_LOCAL_RANK", "JAX_CGX_LOCAL_COUNT")
COORDINATOR_VARIABLE = "JAX_CGX_COORDINATOR"


def _environment(rank: int, n: int, port: int, devices: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(zip(RANK_VARIABLES, (str(rank), str(n), str(rank), str(n))))
    env.update({COORDINATOR_VARIABLE: f"127.0.0.1:{port}", "PYTHONUNBUFFERED": "1"})
    if devices is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    return env


def _find_prctl():
    # Resolved here, in the parent: after fork, with pump threads running, the child must
    # not load libraries or allocate, only make the call.
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the signal handling below still applies
        return None


_PRCTL = _find_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_launcher() -> None:
    """In the child, before exec: be killed if the launcher dies, even by SIGKILL (Linux)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"{prefix}{line}")
        out.flush()
    stream.close()


class ProcessGroup:
    """Processes, each the leader of its own process group, output prefixed with its rank.

    Also used by benchmarks/netem/run.py, which starts its ranks inside network namespaces.
    """

    def __init__(self, commands: list[list[str]], envs: list[dict[str, str]], cwd=None):
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        width = len(str(len(commands) - 1))
        for rank, (argv, env) in enumerate(zip(commands, envs)):
            proc = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # our own group: we signal it, the terminal does not
                preexec_fn=_die_with_launcher if _PRCTL is not None else None,
            )
            self.procs.append(proc)
            pump = threading.Thread(target=_pump, args=(proc.stdout, f"[{rank:>{width}}] ", sys.stdout), daemon=True)
            pump.start()
            self.pumps.append(pump)

    def _signal_all(self, sig: int) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, grace: float) -> list[int]:
        """SIGTERM every process group, SIGKILL what is left after ``grace`` seconds.

        Returns the ranks that were still running at the SIGKILL.
        """
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        killed = [rank for rank, p in enumerate(self.procs) if p.poll() is None]
        self._signal_all(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        return killed


TIMEOUT_EXIT = 124  # the job ran past --timeout (as timeout(1) exits)


def _ranks(ranks: list[int]) -> str:
    return ("process " if len(ranks) == 1 else "processes ") + ", ".join(map(str, ranks))


def _say(message: str) -> None:
    print(f"jax_cgx.launch: {message}", file=sys.stderr, flush=True)


class Job(ProcessGroup):
    """N processes of one script, wired for ``jax_cgx.distributed.initialize``."""

    def __init__(self, argv: list[str], n: int, devices: int | None):
        port = free_port()
        self.started = time.monotonic()
        super().__init__([argv] * n, [_environment(rank, n, port, devices) for rank in range(n)])

    def _stop(self, grace: float) -> None:
        killed = self.stop(grace)
        if killed:
            _say(f"{_ranks(killed)} still running {grace:g} s after SIGTERM (--grace); killed")

    def wait(self, grace: float, timeout: float | None = None) -> int:
        """Wait for all; on the first failure, or at ``timeout`` seconds, stop the rest.

        Returns the job's exit code: 0, the failed process's status (128 + N for signal N),
        or ``TIMEOUT_EXIT``.
        """
        deadline = None if timeout is None else self.started + timeout
        code = 0
        while True:
            codes = [proc.poll() for proc in self.procs]
            failed = [(rank, rc) for rank, rc in enumerate(codes) if rc not in (None, 0)]
            if failed:
                rank, rc = failed[0]
                code = rc if rc > 0 else 128 - rc
                if rc > 0:
                    how = f"exited with {rc}"
                else:
                    try:
                        how = f"was killed by {signal.Signals(-rc).name} (status {code})"
                    except ValueError:
                        how = f"was killed by signal {-rc} (status {code})"
                running = [r for r, c in enumerate(codes) if c is None]
                _say(f"process {rank} {how}; see its output above (lines starting [{rank}])"
                     + (f"; stopping {_ranks(running)}" if running else ""))
                self._stop(grace)
                break
            running = [rank for rank, rc in enumerate(codes) if rc is None]
            if not running:
                break
            if deadline is not None and time.monotonic() >= deadline:
                _say(f"--timeout {timeout:g} s passed with {_ranks(running)} still running; stopping "
                     f"them (SIGTERM, then SIGKILL after --grace {grace:g} s). Their output above shows "
                     "where they were; raise --timeout if the job needs longer")
                self._stop(grace)
                code = TIMEOUT_EXIT
                break
            time.sleep(0.05)
        # Reap whatever a process left in its group (grandchildren) before returning.
        self._signal_all(signal.SIGKILL)
        for pump in self.pumps:
            pump.join(timeout=5)
        return code


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seconds(minimum_exclusive: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not math.isfinite(value) or value < 0 or (minimum_exclusive and value == 0):
            bound = "greater than 0" if minimum_exclusive else "0 or more"
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds, {bound}; got {text}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_cgx.launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", "--nproc", type=_count, required=True, metavar="N",
                        help="number of processes (at least 1)")
    parser.add_argument("--devices-per-process", type=_count, default=None, metavar="K",
                        help="simulated CPU devices per process (at least 1; leave out on GPUs)")
    parser.add_argument("--timeout", type=_seconds(minimum_exclusive=True), default=None, metavar="SECONDS",
                        help=f"stop every process and exit {TIMEOUT_EXIT} if the job is still running after "
                             "this many seconds (default: no limit)")
    parser.add_argument("--grace", type=_seconds(minimum_exclusive=False), default=5.0, metavar="SECONDS",
                        help="seconds between SIGTERM and SIGKILL when stopping (default 5)")
    parser.add_argument("script", help="the Python script every process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = [sys.executable, args.script, *args.args]

    job = Job(command, args.nproc, args.devices_per_process)

    def on_signal(signum, frame):
        _say(f"got {signal.Signals(signum).name}; stopping all processes")
        job._stop(args.grace)
        sys.exit(128 + signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return job.wait(args.grace, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
