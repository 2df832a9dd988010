"""The local launcher, ``python -m jax_cgx.launch``: :mod:`~jax_cgx._src.launch.cli` (the command
line, its help, the job's end), :mod:`~jax_cgx._src.launch.processes` (the processes, their
statuses), :mod:`~jax_cgx._src.launch.ends` (their ends in the order they happen) and
:mod:`~jax_cgx._src.launch.mps` (``--mps``). The public face is :mod:`jax_cgx.launch`."""
