"""``skip_not_finite``: ``optax.MultiSteps``' skip test for a step inside ``shard_map``.

``optax.MultiSteps`` accumulates each device's own gradient before the mean inside it. One inf or
NaN there stays in the accumulator for good (optax resets it as ``(1 - emit) * acc``, and
``0 * nan`` is ``nan``): every later mean is non-finite, and through a compressed mean a whole
bucket of it. ``MultiSteps(should_skip_update_fn=...)`` is the cure, but optax's
``skip_not_finite`` judges each device's gradient alone: the devices then disagree on running the
mini-step, whose mean is a collective, and its skip count differs between them (``shard_map``
refuses to return it replicated). This one counts the non-finite values of every device
(``lax.psum`` over the axis), so every device skips the same mini-steps, and its state is the same
everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_cgx._src import compat
from jax_cgx._src.optax import checks

__all__ = ["skip_not_finite"]


def skip_not_finite(axis_name):
    """A ``should_skip_update_fn`` for ``optax.MultiSteps`` around jax_cgx's means, in ``shard_map``:
    every device skips a mini-step where any device's gradient holds an inf or NaN.

    The skipped mini-step leaves the whole state (accumulated gradients, the mean's residuals, the
    optimizer's moments) bitwise as it was, on every device, and its update is zero: training goes
    on as if that batch had never come. The state it adds, ``{"should_skip": bool, "num_not_finite":
    int32}`` (the non-finite values over all devices), is the same on every device, so
    :func:`~jax_cgx.optax.state_specs` gives it ``P()``::

        tx = optax.MultiSteps(optax.chain(jax_cgx.optax.compressed_mean("data", error_feedback=True),
                                          optax.adam(1e-3)),
                              every_k_schedule=4, should_skip_update_fn=jax_cgx.optax.skip_not_finite("data"))

    Args:
      axis_name: the axis (or axes) the mean inside is taken over.

    Returns:
      ``should_skip(updates, gradient_step, params) -> (skip, state)``, as optax's
      ``skip_not_finite`` but agreed over ``axis_name``.

    Raises:
      ValueError: ``axis_name`` empty or not axis names.
    """
    axes = checks.check_axes("jax_cgx.optax.skip_not_finite", axis_name)

    def should_skip(updates, gradient_step, params=None):
        del gradient_step, params
        counts = [jnp.sum(~jnp.isfinite(x)).astype(jnp.int32) for x in jax.tree.leaves(updates)
                  if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
        mine = sum(counts) if counts else jnp.zeros((), jnp.int32)
        # Every device's count, on every device: one decision. (MultiSteps.init evaluates this
        # outside shard_map, for the state's shapes alone.)
        total = lax.psum(mine, axes) if compat.axes_bound(axes) else mine
        skip = total > 0
        return skip, {"should_skip": skip, "num_not_finite": total}

    return should_skip
