"""Multi-process setup: ``jax.distributed.initialize`` that knows launchers.

:func:`initialize` reads who this process is from, in order: explicit arguments,
``python -m jax_cgx.launch`` (``JAX_CGX_*`` variables), Open MPI (``OMPI_COMM_WORLD_*``),
MPICH/PMI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``) and SLURM (``SLURM_PROCID``...).
It then starts jax's distributed runtime, selects gloo for CPU collectives, and, when
several processes share a node, gives each one GPU (its local rank). By default a failing
process (an uncaught exception, a non-zero ``sys.exit``) then ends at once with its status
instead of waiting in jax's shutdown barrier for the others. In a plain single-process run
it does nothing.
"""

from jax_cgx._src.distributed.placement import ProcessInfo, detect
from jax_cgx._src.distributed.runtime import initialize

__all__ = ["ProcessInfo", "detect", "initialize"]
