"""Running several test processes to completion, and never leaving one behind."""

import pathlib
import subprocess

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
