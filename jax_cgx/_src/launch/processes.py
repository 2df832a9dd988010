"""The launcher's processes: each started in its own process group with its rank's environment, its
output prefixed with the rank, watched until the first failure, then the rest stopped and named
(:class:`ProcessGroup`, :class:`Job`); what a wait status means (:func:`describe_status`,
:func:`exit_code`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable as _Callable  # not a public name of this module

from jax_cgx import allocator
from jax_cgx._src import outputs
from jax_cgx._src.distributed.placement import COORDINATOR_VARIABLE, RANK_VARIABLES
from jax_cgx._src.launch import ends


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a coordinator).

    Returns:
      The port number, an ``int``. It is not held: another program may take it before it is used.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The most processes one launch starts: each is a Python interpreter with JAX (hundreds of MB).
MAX_PROCESSES = max(256, 4 * (os.cpu_count() or 1))
BIND_VARIABLE = "JAX_COORDINATOR_BIND_ADDRESS"  # where jax's coordinator service listens (process 0)


def _environment(rank: int, n: int, port: int, devices: int | None) -> dict[str, str]:
    env = dict(os.environ)
    if allocator.wanted(env):
        # glibc reads these at process start: large buffers are reused whatever the script imports first.
        for name, value in allocator.ENVIRONMENT.items():
            env.setdefault(name, value)
    env.update(zip(RANK_VARIABLES, (str(rank), str(n), str(rank), str(n))))
    # One host: the coordinator is reached on loopback, so it listens there only (jax's
    # default, [::]:port, is every interface).
    env.update({COORDINATOR_VARIABLE: f"127.0.0.1:{port}", BIND_VARIABLE: f"127.0.0.1:{port}",
                "PYTHONUNBUFFERED": "1"})
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


def process_state(pid: int) -> str | None:
    """The kernel's state of a process (``R``, ``S``, ``T`` stopped, ``t`` traced, ...); None if unknown.

    Args:
      pid: the process's id.

    Returns:
      The state letter from ``/proc/<pid>/stat``; None where it cannot be read (no such process,
      no ``/proc``).
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    return (data.rpartition(")")[2].split() or [None])[0]  # the command name, in parentheses, may hold spaces


def describe_status(status: int) -> str:
    """A process's end in words: "exited with 3", "was killed by SIGSEGV (status 139)".

    Args:
      status: a ``subprocess.Popen`` returncode: an exit status (>= 0), or ``-N`` for signal ``N``.

    Returns:
      The words, a ``str``.
    """
    if status >= 0:
        return f"exited with {status}"
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    return f"was killed by {name} (status {128 - status})"


def exit_code(status: int) -> int:
    """A Popen returncode as a shell reports it: 128 + N for signal N.

    Args:
      status: a ``subprocess.Popen`` returncode: an exit status (>= 0), or ``-N`` for signal ``N``.

    Returns:
      ``status`` itself where it is >= 0, else ``128 + N``.
    """
    return status if status >= 0 else 128 - status


class ProcessGroup:
    """Processes, each the leader of its own process group, output prefixed with its rank.

    Standard input goes to the first process only; the others read ``/dev/null`` (as mpirun
    does: otherwise whichever reads first takes piped input). If a process cannot be started,
    those already started are stopped and the error is raised.

    Also used by benchmarks/netem/run.py, which starts its ranks inside network namespaces.

    Args:
      commands: each process's argument vector (its rank is its index), started at once.
      envs: each process's whole environment, in the same order.
      cwd: the processes' working directory; None (the default): the launcher's.

    Raises:
      ValueError: ``commands`` and ``envs`` of different lengths, or none (nothing is started).
      OSError: a process could not be started (after the ones already started are stopped).
    """

    def __init__(self, commands: list[list[str]], envs: list[dict[str, str]], cwd=None):
        if len(commands) != len(envs) or not commands:
            raise ValueError(f"ProcessGroup: {len(commands)} commands and {len(envs)} environments: give one "
                             "environment per process (and at least one process)")
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        # (rank, returncode) in the order the processes ended, noted as each ends (ends.watch):
        # the first failure is the one that happened first, not the lowest rank.
        self.ended: list[tuple[int, int]] = []
        self._changed = threading.Condition()
        self.heartbeats = outputs.HeartbeatWatch()
        self.announced = outputs.FailureWatch()
        width = len(str(len(commands) - 1))
        for rank, (argv, env) in enumerate(zip(commands, envs)):
            try:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=cwd,
                    stdin=None if rank == 0 else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # our own group: we signal it, the terminal does not
                    preexec_fn=_die_with_launcher if _PRCTL is not None else None,
                )
            except OSError:
                ends.watch(self.procs, self._noted)
                self.stop(0)  # none left behind
                self.close()
                raise
            self.procs.append(proc)
            watch = outputs.both(self.heartbeats.watcher(), self.announced.watcher(rank))
            pump = threading.Thread(target=outputs.copy, args=(proc.stdout, f"[{rank:>{width}}] ", sys.stdout, watch),
                                    daemon=True)
            pump.start()
            self.pumps.append(pump)
        ends.watch(self.procs, self._noted)  # in the order they end (jax_cgx/_src/launch/ends.py says why)

    def _noted(self, rank: int, status: int) -> None:
        with self._changed:
            self.ended.append((rank, status))
            self._changed.notify_all()

    def running(self) -> list[int]:
        with self._changed:
            done = {rank for rank, _ in self.ended}
        return [rank for rank in range(len(self.procs)) if rank not in done]

    def unresponsive(self) -> dict[int, str]:
        """Ranks that stopped responding while still alive, and why the launcher thinks so: jax's
        coordination service said so in the output, or the kernel shows the process stopped."""
        out: dict[int, list[str]] = {}
        running = set(self.running())
        for rank in sorted(r for r in self.heartbeats.unhealthy if 0 <= r < len(self.procs)):
            out.setdefault(rank, []).append("jax's coordination service reported that it stopped sending heartbeats")
        for rank in sorted(running):
            state = process_state(self.procs[rank].pid)
            if state in ("T", "t"):
                out.setdefault(rank, []).append(f"it is stopped (process state {state}: SIGSTOP, Ctrl-Z or a debugger)")
        return {rank: " and ".join(why) for rank, why in sorted(out.items())}

    def failures(self) -> list[tuple[int, int]]:
        """``(rank, returncode)`` of every process that failed so far, the first first: the one
        that said it failed first (:class:`~jax_cgx._src.outputs.FailureWatch`), else the one that ended first."""
        with self._changed:
            failed = [(rank, status) for rank, status in self.ended if status != 0]
        first = self.announced.first()
        # Stable: one killed by a signal that is a cause (a kill, a crash: it says nothing, and its
        # peers fail over its reset connections, and may end first), then the one that said it failed
        # first, the rest as they ended.
        return sorted(failed, key=lambda f: (not _caused_by_signal(f[1]), f[0] != first))

    def wait_for_announced(self, grace: float) -> None:
        """If a process said it failed before the first to end did, and is still ending (running
        its exit hooks), give it ``grace`` seconds to end with its own status."""
        first = self.announced.first()
        if first is not None and first in self.running():
            self._wait(lambda: first not in self.running(), time.monotonic() + grace)

    def _wait(self, done: _Callable[[], bool], deadline: float | None) -> bool:
        """Block, woken by each end noted, until ``done()`` or ``deadline`` (a ``time.monotonic()``);
        True unless it is the deadline that came."""
        with self._changed:
            while not done():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def _all_ended(self) -> bool:
        return len(self.ended) == len(self.procs)

    def wait_for_end_or_failure(self, deadline: float | None = None) -> bool:
        """Block until every process has ended, one has failed, or ``deadline`` (a
        ``time.monotonic()``) passed; True unless it is the deadline that came."""
        return self._wait(lambda: self._all_ended() or any(status != 0 for _, status in self.ended), deadline)

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
        self._wait(self._all_ended, time.monotonic() + grace)
        killed = self.running()
        self._signal_all(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        return killed

    def close(self) -> None:
        """Reap whatever a process left in its group (grandchildren), and the rest of the output."""
        self._signal_all(signal.SIGKILL)
        for pump in self.pumps:
            pump.join(timeout=5)


TIMEOUT_EXIT = 124  # the job ran past --timeout (as timeout(1) exits)
# How long a process that said it failed first may take to end (its exit hooks) before it is stopped.
_ANNOUNCED_GRACE_S = 5.0
# Processes that end within this long of the first failure ended together, as far as blame goes.
_TOGETHER_S = 1.0


def _caused_by_signal(status: int) -> bool:
    """Killed by a signal that starts a failure (SIGKILL, SIGSEGV, ...), not one that ends a process
    because of another's (SIGTERM from a launcher, SIGABRT from jax's heartbeat, SIGPIPE)."""
    return status < 0 and -status not in (signal.SIGTERM, signal.SIGABRT, signal.SIGPIPE, signal.SIGINT)


def say(message: str) -> None:
    try:
        print(f"jax_cgx.launch: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr is gone: the exit status still tells
        pass


class Job(ProcessGroup):
    """N processes of one script, wired for ``jax_cgx.distributed.initialize``.

    Args:
      argv: the command every process runs (``[sys.executable, script, *args]``).
      n: the number of processes.
      devices: simulated CPU devices per process (``XLA_FLAGS``); None: ``XLA_FLAGS`` as inherited.

    Raises:
      OSError: a process could not be started (after the ones already started are stopped).
    """

    def __init__(self, argv: list[str], n: int, devices: int | None):
        port = free_port()
        self.started = time.monotonic()
        super().__init__([argv] * n, [_environment(rank, n, port, devices) for rank in range(n)])

    def _stop(self, grace: float) -> None:
        killed = self.stop(grace)
        if killed:
            say(f"{outputs.processes(killed)} still running {grace:g} s after SIGTERM (--grace); killed")

    def wait(self, grace: float, timeout: float | None = None) -> int:
        """Wait for all; on the first failure, or at ``timeout`` seconds, stop the rest.

        Returns the job's exit code: 0, the status of the process that failed first (128 + N
        for signal N), or ``TIMEOUT_EXIT``.
        """
        deadline = None if timeout is None else self.started + timeout
        code = 0
        if not self.wait_for_end_or_failure(deadline):
            running = self.running()
            for r, why in self.unresponsive().items():
                say(f"process {r} stopped responding: {why}")
            say(f"--timeout {timeout:g} s passed with {outputs.processes(running)} still running; stopping "
                 f"them (SIGTERM, then SIGKILL after --grace {grace:g} s). Their output above shows "
                 "where they were; raise --timeout if the job needs longer")
            self._stop(grace)
            code = TIMEOUT_EXIT
        elif self.failures():
            self.wait_for_announced(_ANNOUNCED_GRACE_S)
            # The peers a failure brings down end within a moment: see them, to name the cause.
            self._wait(self._all_ended, time.monotonic() + _TOGETHER_S)
            for r, _ in self.failures():  # their output read to the end: every failure line seen
                self.pumps[r].join(timeout=2)
            failed = self.failures()
            running = self.running()
            (rank, status), others = failed[0], failed[1:]
            code = exit_code(status)
            self.pumps[rank].join(timeout=2)  # its last lines (jax's heartbeat report) read first
            culprits = {r: why for r, why in self.unresponsive().items() if r not in {f for f, _ in failed}}
            if culprits:
                say("; ".join(f"process {r} stopped responding: {why}" for r, why in culprits.items())
                     + f". Because of it process {rank} {describe_status(status)} (jax aborts the healthy "
                     "processes when one stops sending heartbeats); see the output of "
                     + ", ".join(f"[{r}]" for r in culprits) + " above")
            say(f"process {rank} {describe_status(status)}; see its output above (lines starting [{rank}])"
                 + "".join(f"; then process {r} {describe_status(c)}" for r, c in others)
                 + (f"; stopping {outputs.processes(running)}" if running else ""))
            self._stop(grace)
        self.close()
        return code


# A job launcher's world size, as each of its processes sees it.
