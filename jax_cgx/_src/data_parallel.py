"""``data_parallel_value_and_grad``: compressed gradient averaging for a plain ``jax.jit`` step.

Most JAX training steps are a ``jax.jit`` of ``jax.value_and_grad`` over a batch sharded along
a mesh axis, and the partitioner inserts the gradient all-reduce itself: by the time the
gradient is a value the program can see, it has been summed in float32 and there is nothing
left to compress. Compressing it needs each device's *own* gradient, which exists only inside
``shard_map``, taken with respect to a copy of the parameters typed as varying over the axis
(``lax.pcast(params, axis, to="varying")``; with the replicated parameters themselves, JAX's
transpose of the implicit broadcast would psum the gradient first).

:func:`data_parallel_value_and_grad` writes that once::

    grad_fn = jax_cgx.data_parallel_value_and_grad(loss_fn, mesh=mesh, config=CompressionConfig(bits=4))

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = grad_fn(params, x, y)          # grads: the compressed mean, replicated
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

``loss_fn(params, *batch)`` is the loss of one device's shard of the batch (a mean over its
rows); every batch argument is split along its leading axis over ``axis_name``. With
``bits=32`` the result is ``jax.value_and_grad(loss_fn)`` of the whole batch, to float32
rounding (the mean of the shards' means).

Optimizer states that differ from device to device (error feedback, top-k and PowerSGD
residuals: :mod:`jax_cgx.optax`) cannot live in a replicated ``jit`` state; those transforms
run inside ``shard_map`` (docs/training.md has the recipe).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_cgx._src.arguments import check_axes, check_bool
from jax_cgx._src.collectives.plan import ConfigSpec
from jax_cgx._src.collectives.psum import compressed_pmean

__all__ = ["data_parallel_value_and_grad"]


def data_parallel_value_and_grad(fun: Callable[..., Any], *, mesh, axis_name: str | tuple[str, ...] = "data",
                                 config: ConfigSpec = None, has_aux: bool = False) -> Callable[..., Any]:
    """``jax.value_and_grad(fun)`` over a batch sharded along ``axis_name``, the gradient
    averaged over the devices with :func:`~jax_cgx.compressed_pmean`.

    Args:
      fun: ``fun(params, *batch) -> loss`` (a scalar; with ``has_aux``, ``(loss, aux)``), the
        loss of one device's shard of the batch.
      mesh: the ``jax.sharding.Mesh`` (or ``AbstractMesh``) the batch is sharded over; its axes
        may be ``Auto`` or ``Explicit``. Only ``axis_name``'s axes are mapped by hand; others
        (a ``"model"`` axis) stay with XLA's partitioner.
      axis_name: the mesh axis (or axes) the batch's leading dimension is split over.
      config: as for :func:`~jax_cgx.compressed_pmean`: a ``CompressionConfig``, a pytree of
        them matching ``params``, a function of a leaf's path, or None (the environment's).
      has_aux: ``fun`` returns ``(loss, aux)``; ``aux`` is averaged over the devices like the
        loss (``lax.pmean``).

    Returns:
      ``grad_fn(params, *batch, key=None)`` returning ``(loss, grads)`` (``((loss, aux), grads)``
      with ``has_aux``), all replicated. Call it inside ``jax.jit`` or on its own. ``params`` is
      replicated; each ``batch`` argument is a pytree whose leaves have a leading dimension
      divisible by the number of devices along ``axis_name``. ``key``: a PRNG key for stochastic
      rounding, the same on every device.
    """
    if not callable(fun):
        raise TypeError(f"data_parallel_value_and_grad: fun must be callable, got {type(fun).__name__}")
    has_aux = check_bool("data_parallel_value_and_grad", "has_aux", has_aux)
    axes = check_axes("data_parallel_value_and_grad", axis_name)
    names = tuple(getattr(mesh, "axis_names", ()))
    missing = [a for a in axes if a not in names]
    if missing:
        raise ValueError(f"data_parallel_value_and_grad: axis {missing[0]!r} is not an axis of the mesh "
                         f"(its axes: {names}); pass axis_name= one of them")
    world = math.prod(mesh.shape[a] for a in axes)
    batch_spec = P(axes if len(axes) > 1 else axes[0])

    def local(params, key, *batch):
        mine = lax.pcast(params, axes, to="varying")
        value, grads = jax.value_and_grad(fun, has_aux=has_aux)(mine, *batch)
        value = jax.tree.map(lambda v: lax.pmean(v, axes), value)
        return value, compressed_pmean(grads, axes, config, key=key)

    def grad_fn(params, *batch, key: jax.Array | None = None):
        if not batch:
            raise TypeError("data_parallel_value_and_grad: grad_fn(params, *batch) needs at least one batch "
                            "argument to split over the devices")
        _check_batch(batch, axes, world)
        # Manual over the data axes only: other mesh axes (e.g. "model") stay with the partitioner.
        mapped = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), *(batch_spec,) * len(batch)),
                               out_specs=P(), axis_names=frozenset(axes))
        return mapped(params, key, *batch)

    return grad_fn


def _check_batch(batch, axes, world: int) -> None:
    for i, arg in enumerate(batch):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            shape = getattr(leaf, "shape", None)
            where = f"batch argument {i}{jax.tree_util.keystr(path)}"
            if shape is None or len(shape) == 0:
                raise ValueError(f"data_parallel_value_and_grad: {where} is a scalar; every batch leaf needs a "
                                 f"leading dimension to split over {axes} (pass constants through fun's closure)")
            if shape[0] % world:
                raise ValueError(f"data_parallel_value_and_grad: {where} has {shape[0]} rows, not divisible by "
                                 f"the {world} devices along {axes}; use a batch size that is a multiple of {world}")
