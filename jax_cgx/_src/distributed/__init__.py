"""Multi-process start-up: :mod:`~jax_cgx._src.distributed.placement` (who this process is, from
its launcher) and :mod:`~jax_cgx._src.distributed.runtime` (jax's runtime started with it). The
public face is :mod:`jax_cgx.distributed`."""
