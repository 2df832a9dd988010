"""Run N processes of a script on this machine, wired for ``jax_cgx.distributed.initialize``.

    python -m jax_cgx.launch -n 4 [--devices-per-process K] script.py [args...]

- Starts the coordinator on a free port of 127.0.0.1 and gives each process its rank in
  ``JAX_CGX_PROCESS_ID`` / ``JAX_CGX_NUM_PROCESSES`` / ``JAX_CGX_LOCAL_RANK`` /
  ``JAX_CGX_LOCAL_COUNT`` / ``JAX_CGX_COORDINATOR``; with ``--devices-per-process K``, each
  process sees K simulated CPU devices (``XLA_FLAGS``).
- Prefixes every line of output with the rank.
- If a process fails, stops the others and exits with its code; Ctrl-C or SIGTERM stops
  every process (SIGTERM, then SIGKILL after ``--grace`` seconds) and leaves no orphans:
  each process runs in its own process group, and the whole group is signalled; on Linux
  the processes are also killed if the launcher itself is killed (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
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


def _environment(rank: int, n: int, port: int, devices: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        JAX_CGX_PROCESS_ID=str(rank),
        JAX_CGX_NUM_PROCESSES=str(n),
        JAX_CGX_LOCAL_RANK=str(rank),
        JAX_CGX_LOCAL_COUNT=str(n),
        JAX_CGX_COORDINATOR=f"127.0.0.1:{port}",
        PYTHONUNBUFFERED="1",
    )
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

    def stop(self, grace: float) -> None:
        """SIGTERM every process group, SIGKILL what is left after ``grace`` seconds."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        self._signal_all(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()


class Job(ProcessGroup):
    """N processes of one script, wired for ``jax_cgx.distributed.initialize``."""

    def __init__(self, argv: list[str], n: int, devices: int | None):
        port = free_port()
        super().__init__([argv] * n, [_environment(rank, n, port, devices) for rank in range(n)])

    def wait(self, grace: float) -> int:
        """Wait for all; on the first failure stop the rest. Returns the job's exit code."""
        code = 0
        while True:
            running = False
            for rank, proc in enumerate(self.procs):
                rc = proc.poll()
                if rc is None:
                    running = True
                elif rc != 0 and code == 0:
                    code = rc if rc > 0 else 128 - rc
                    print(f"jax_cgx.launch: process {rank} exited with {rc}; stopping the others", file=sys.stderr)
                    self.stop(grace)
            if not running or code != 0:
                break
            time.sleep(0.05)
        # Reap whatever a process left in its group (grandchildren) before returning.
        self._signal_all(signal.SIGKILL)
        for pump in self.pumps:
            pump.join(timeout=5)
        return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_cgx.launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", "--nproc", type=int, required=True, help="number of processes")
    parser.add_argument("--devices-per-process", type=int, default=None, help="simulated CPU devices per process")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL when stopping")
    parser.add_argument("script", help="the Python script every process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("-n must be at least 1")
    command = [sys.executable, args.script, *args.args]

    job = Job(command, args.nproc, args.devices_per_process)

    def on_signal(signum, frame):
        print(f"jax_cgx.launch: got {signal.Signals(signum).name}; stopping all processes", file=sys.stderr)
        job.stop(args.grace)
        sys.exit(128 + signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return job.wait(args.grace)


if __name__ == "__main__":
    sys.exit(main())
