"""The tests' device meshes: one call instead of each file's copy of ``jax.make_mesh``'s arguments."""

import math

import jax
from jax.sharding import AxisType


def device_mesh(shape, names, axis_type: AxisType = AxisType.Explicit) -> jax.sharding.Mesh:
    """``jax.make_mesh(shape, names)`` over the first ``prod(shape)`` devices, every axis of
    ``axis_type`` (``Explicit``: ``jax.make_mesh``'s default; ``Auto``: ``jax.sharding.Mesh``'s)."""
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape),
                         devices=jax.devices()[:math.prod(shape)])
