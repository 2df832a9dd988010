"""``compressed_all_gather``: ``lax.all_gather`` with each shard quantized once, by its owner.

The parameter all-gather of sharded training (FSDP, ZeRO-3; DeepSpeed's qwZ). Every rank
quantizes its shard (the kernels' ``valid`` counts keep the alignment padding out of every
bucket), the encodings are all-gathered, and every rank decodes all ``W`` of them with the
same kernel, its own included: every replica holds bitwise the same result, which a rank
keeping its own shard in full precision would break. The error of a value of rank ``r``'s
shard is at most ``s_r / 2`` (``s_r`` its bucket's scale; ``s_r`` with stochastic
rounding). Moves ``(W - 1)/W`` of the gathered compressed bytes per rank.

One fusion buffer at a time by the primitive of :mod:`jax_cgx._src.exchange.all_gather`;
differentiation is ``lax.all_gather``'s (``jax.grad`` gives lax's gradient, a ``psum_scatter``).
The module holds the pytree API (lanes, fusion buffers and ``policy="auto"`` as
:func:`~jax_cgx.compressed_psum` has them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_cgx._src import compat
from jax_cgx._src.arguments import check_bool
from jax_cgx._src.codec import Impl, check_impl
from jax_cgx._src.collectives.plan import ConfigSpec
from jax_cgx._src.collectives.scatter_gather import Leaves, check_key, compressed_buffers, timing_key
from jax_cgx._src.exchange.all_gather import compressed_gather, lax_all_gather

__all__ = ["compressed_all_gather"]

API = "compressed_all_gather"


# ------------------------------------------------------------------ the API

def _gathered(rows, shape: tuple, axis: int, tiled: bool):
    """``rows[W, m]`` (rank ``j``'s shard flattened in row ``j``) as ``lax.all_gather`` lays it out."""
    world = rows.shape[0]
    stacked = jnp.moveaxis(rows.reshape((world, *shape)), 0, axis)
    if not tiled:
        return stacked
    return stacked.reshape(shape[:axis] + (world * shape[axis],) + shape[axis + 1:])


# What policy="auto" times a near-tie with (jax_cgx._src.policy.pricing.Timed); any key will do.
_TIMED = (lambda v, axis: lax.all_gather(v, axis, tiled=True),
          lambda v, axis, config: compressed_all_gather(v, axis, config, tiled=True, key=timing_key(config)))


def compressed_all_gather(x, axis_name, config: ConfigSpec = None, *, axis: int = 0, tiled: bool = False,
                          to: str = "varying", key: jax.Array | None = None, impl: Impl = "auto"):
    """``jax.lax.all_gather`` of a pytree, compressed: each shard quantized once, by its owner.

    The semantics of ``lax.all_gather``: ``tiled=False`` stacks the ranks' leaves along a new
    dimension ``axis``; ``tiled=True`` concatenates them along ``axis``. Leaves take the lanes
    of :func:`~jax_cgx.compressed_psum`: ``bits=32`` (or a ``None`` config, integer and small
    leaves) is exactly ``lax.all_gather``, ``bits=16`` the same in ``half_dtype``, and the
    quantized leaves of one dtype and config are fused into buffers of whole leaves of at
    most ``fusion_buffer_mb``. Every replica gets bitwise the same result. With
    ``policy="auto"`` a buffer the cost model finds faster uncompressed goes to
    ``lax.all_gather`` instead (logged once).

    Args:
      x: a pytree of arrays, this rank's shards (inside ``shard_map`` or ``pmap``).
      axis_name: the mapped axis name(s) to gather over.
      config: as for :func:`~jax_cgx.compressed_psum`.
      axis: where the ranks' dimension goes (``tiled=False``) or which dimension grows (``tiled=True``).
      tiled: as for ``lax.all_gather``.
      to: as for ``lax.all_gather`` under ``shard_map(check_vma=True)``: ``"varying"`` (lax's
        default type) or ``"invarying"``: the result typed the same on every rank, so it can
        leave ``shard_map`` with ``out_specs=P()`` (every replica does hold the same bits).
      key: a PRNG key for stochastic rounding, the same on every rank (each folds in its index).
      impl: the codec implementation: "auto", "kernel" or "reference" (bitwise the same).

    Returns:
      A pytree like ``x``: each leaf the ranks' shards in rank order, stacked along a new
      dimension ``axis`` (``tiled=False``) or concatenated along ``axis`` (``tiled=True``), in
      the leaf's dtype, bitwise the same on every rank.

    Raises:
      ValueError: ``to`` neither ``"varying"`` nor ``"invarying"``; ``tiled`` not a bool; an unknown
        ``impl``; a scalar leaf with ``tiled=True``; ``axis`` out of range for a leaf; a stochastic
        config without ``key``.
      NameError: an axis of ``axis_name`` that is not bound (outside ``shard_map``/``pmap``).
      TypeError: ``key`` that is not one PRNG key.

    Examples:
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> g = jax.jit(jax.shard_map(lambda v: jax_cgx.compressed_all_gather(v, "data", tiled=True, to="invarying"),
      ...                           mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> g(jax.device_put(jnp.ones((8, 256)), NamedSharding(mesh, P("data")))).shape
      (8, 256)
    """
    tiled = check_bool(API, "tiled", tiled)
    check_impl(impl)
    compat.check_prng_key(key, API)
    if to not in ("varying", "invarying"):
        raise ValueError(f"{API}: to must be 'varying' or 'invarying' (as for lax.all_gather), got {to!r}")
    invariant = to == "invarying"
    axes = compat.axes_tuple(axis_name)
    compat.check_axis_names(axes, API)
    world = int(np.prod([lax.axis_size(a) for a in axes]))
    leaves = Leaves(x, config, API, axes)
    axes_of = []
    for i, leaf in enumerate(leaves.leaves):
        ndim = leaf.ndim + (0 if tiled else 1)
        if tiled and leaf.ndim == 0:
            raise ValueError(f"{API}: leaf {leaves.name(i)} is a scalar; tiled=True needs a dimension to concatenate")
        if not -ndim <= axis < ndim:
            raise ValueError(f"{API}: axis={axis} is out of range for leaf {leaves.name(i)} of shape {leaf.shape} "
                             f"(tiled={tiled})")
        axes_of.append(axis % ndim)
    check_key(leaves, key, API)
    compressed, uncompressed = [], set()
    if leaves.groups and world > 1:
        compressed, uncompressed = compressed_buffers(leaves, axes, world, "all_gather", key, 1, API, "all_gather",
                                                      _TIMED, impl)
    out: list = [None] * len(leaves.leaves)
    for i, (kind, leaf) in enumerate(zip(leaves.lanes, leaves.leaves)):
        # One rank: nothing moves, exact. policy="auto" may leave a buffer's leaves to lax.
        if kind == "exact" or (kind == "quantized" and (world == 1 or i in uncompressed)):
            out[i] = lax_all_gather(compat.ensure_varying(leaf, axes), axes, axes_of[i], tiled, invariant)
        elif kind == "half":
            half = compat.ensure_varying(leaf.astype(jnp.dtype(leaves.configs[i].half_dtype)), axes)
            out[i] = lax_all_gather(half, axes, axes_of[i], tiled, invariant).astype(leaf.dtype)
    if compressed:
        for group, members, seeds, backend in compressed:
            cfg = group.config
            flat = [leaves.leaves[i].reshape(-1) for i in members]
            joined = flat[0] if len(flat) == 1 else lax.optimization_barrier(jnp.concatenate(flat))
            joined = compat.ensure_varying(joined, axes)
            rows = compressed_gather(joined, seeds[:, 0], axes, world, cfg, impl=impl, backend=backend,
                                     invariant=invariant)
            start = 0
            for i, piece in zip(members, flat):
                shard = rows[:, start:start + piece.size]
                out[i] = _gathered(shard, leaves.leaves[i].shape, axes_of[i], tiled)
                start += piece.size
    return leaves.treedef.unflatten(out)
