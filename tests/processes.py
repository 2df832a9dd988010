"""Running several test processes to completion, and never leaving one behind."""

import subprocess


def run_all(commands, timeout: float, **popen) -> list[tuple[int, str]]:
    """Start every command, wait for all, return ``(returncode, combined output)`` each.

    On a timeout or any error, processes still running are killed before raising.
    """
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
        for cmd in commands
    ]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, log) for p, log in zip(procs, logs)]
