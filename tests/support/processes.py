"""Running several test processes to completion, and never leaving one behind."""

import pathlib
import subprocess
import sys

# The folder of the worker scripts the tests start (this one).
SUPPORT = pathlib.Path(__file__).resolve().parent


def run_all(commands, timeout: float, envs=None, **popen) -> list[tuple[int, str]]:
    """Start every command, wait for all, return ``(returncode, combined output)`` each.

    ``envs``: one environment per command (default: inherit). On a timeout or any
    error, processes still running are killed before raising.
    """
    envs = envs or [popen.pop("env", None)] * len(commands)
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, **popen)
        for cmd, env in zip(commands, envs)
    ]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, log) for p, log in zip(procs, logs)]


def worker_commands(script, nproc: int, out_dir, *args: str) -> list[list[str]]:
    """The command lines of ``nproc`` processes of the worker ``script`` (a file here, or a path),
    which takes ``PROCESS_ID NUM_PROCESSES PORT OUT_DIR`` and then ``args``, on one free coordinator
    port: for :func:`run_all`."""
    from jax_cgx.launch import free_port

    port = free_port()
    return [[sys.executable, str(SUPPORT / script), str(i), str(nproc), str(port), str(out_dir), *args]
            for i in range(nproc)]


def run_workers(script: str, nproc: int, out_dir, timeout: float = 300) -> None:
    """Run ``nproc`` processes of the worker ``script`` (a file here, taking ``PROCESS_ID
    NUM_PROCESSES PORT OUT_DIR``) on one coordinator port; each must exit 0 (its log's tail says
    why not)."""
    for returncode, log in run_all(worker_commands(script, nproc, out_dir), timeout=timeout):
        assert returncode == 0, log[-4000:]
