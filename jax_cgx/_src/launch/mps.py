"""CUDA MPS for processes that share one GPU (``python -m jax_cgx.launch --mps``).

Without MPS, processes on one GPU take turns on it in time slices: each NCCL call of one
waits for the other's turn, so a step of two ranks sharing an H100 paid ~12 ms of fixed
exchange costs (docs/gpu-results.md: the MLP's 4-bit step at 10 Gbit/s, 19.9 ms alone,
7.8 ms under MPS). With MPS their kernels run side by side, as on two GPUs.

The launcher starts a private control daemon (its pipe and log directories in a temporary
folder, so it neither joins nor stops an MPS daemon someone else runs), gives the processes
its directories, and stops it when the job ends, however it ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator

CONTROL = "nvidia-cuda-mps-control"
PIPE_VARIABLE = "CUDA_MPS_PIPE_DIRECTORY"
LOG_VARIABLE = "CUDA_MPS_LOG_DIRECTORY"
_COMMAND_TIMEOUT_S = 30.0


class MpsError(RuntimeError):
    """The MPS control daemon could not be started (what the message says to do about it)."""


def _control_log(log_dir: str) -> str:
    try:
        with open(os.path.join(log_dir, "control.log"), errors="replace") as f:
            lines = f.read().strip().splitlines()
    except OSError:
        return ""
    return "; its control.log ends: " + " | ".join(lines[-3:]) if lines else ""


@contextlib.contextmanager
def daemon(say: Callable[[str], None]) -> Iterator[dict[str, str]]:
    """Run a private MPS control daemon while in the block, with this process's environment set
    (``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_MPS_LOG_DIRECTORY``) so that what it starts are its
    clients; yields those variables. The environment is restored after."""
    exe = shutil.which(CONTROL)
    if exe is None:
        raise MpsError(f"--mps: {CONTROL} is not on PATH. It comes with NVIDIA's driver (the nvidia-utils "
                       "package on most distributions); install it, or leave out --mps (processes sharing a "
                       "GPU then take turns on it)")
    with tempfile.TemporaryDirectory(prefix="jax_cgx_mps_") as root:
        variables = {PIPE_VARIABLE: os.path.join(root, "pipe"), LOG_VARIABLE: os.path.join(root, "log")}
        for path in variables.values():
            os.mkdir(path)
        env = {**os.environ, **variables}
        try:
            started = subprocess.run([exe, "-d"], env=env, capture_output=True, text=True,
                                     timeout=_COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise MpsError(f"--mps: '{CONTROL} -d' did not return within {_COMMAND_TIMEOUT_S:.0f} s"
                           f"{_control_log(variables[LOG_VARIABLE])}") from None
        if started.returncode != 0:
            said = (started.stderr or started.stdout).strip()
            raise MpsError(f"--mps: '{CONTROL} -d' failed with exit status {started.returncode}"
                           f"{': ' + said if said else ''}{_control_log(variables[LOG_VARIABLE])}. MPS needs "
                           "the GPU in the Default or Exclusive_Process compute mode (nvidia-smi -q -d COMPUTE) "
                           "and permission to run it; or leave out --mps")
        say(f"started a CUDA MPS control daemon ({PIPE_VARIABLE}={variables[PIPE_VARIABLE]}): the processes' "
            "kernels share the GPU instead of taking turns")
        before = {name: os.environ.get(name) for name in variables}
        os.environ.update(variables)
        try:
            yield variables
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            try:
                stopped = subprocess.run([exe], input="quit\n", env=env, capture_output=True, text=True,
                                         timeout=_COMMAND_TIMEOUT_S)
                if stopped.returncode != 0:
                    say(f"stopping the MPS daemon: '{CONTROL}' quit exited with {stopped.returncode}"
                        f"{_control_log(variables[LOG_VARIABLE])}")
            except subprocess.TimeoutExpired:
                say(f"stopping the MPS daemon: '{CONTROL}' did not answer 'quit' within "
                    f"{_COMMAND_TIMEOUT_S:.0f} s; it may still run (its pipe: {variables[PIPE_VARIABLE]})")
