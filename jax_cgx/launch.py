"""Run N processes of a script on this machine, wired for :func:`jax_cgx.distributed.initialize`:
``python -m jax_cgx.launch -n N script.py [args...]`` (``--help``, and the docs' launcher page, say
everything it does). The command is :func:`main`; :class:`ProcessGroup` and :class:`Job` start and
watch processes for other tools (``benchmarks/netem/run.py``), :func:`describe_status` and
:func:`exit_code` say what a wait status means.

The implementation is in ``jax_cgx._src.launch``.
"""

import sys

from jax_cgx._src.launch.cli import main
from jax_cgx._src.launch.processes import (
    BIND_VARIABLE,
    MAX_PROCESSES,
    TIMEOUT_EXIT,
    Job,
    ProcessGroup,
    describe_status,
    exit_code,
    free_port,
    process_state,
)

__all__ = ["BIND_VARIABLE", "MAX_PROCESSES", "TIMEOUT_EXIT", "Job", "ProcessGroup", "describe_status", "exit_code",
           "free_port", "main", "process_state"]

if __name__ == "__main__":
    sys.exit(main())
