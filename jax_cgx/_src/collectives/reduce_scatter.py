"""``compressed_psum_scatter``: ``lax.psum_scatter`` with each contribution quantized once.

The reduce-scatter of sharded training (FSDP, ZeRO): rank ``j`` ends with the sum over the
ranks of block ``j`` of their inputs. Compressed, it is SRA's first half (docs/algorithm.md), one
fusion buffer at a time by the primitive of :mod:`jax_cgx._src.exchange.reduce_scatter`.

Each contribution is quantized once, and the owner's own not at all: the error of a value
of block ``o`` is at most ``sum over r != o of s_r / 2`` (``s_r`` the scale of rank ``r``'s
bucket holding it; twice that with stochastic rounding), plus float32 rounding. Moves
``(W - 1)/W`` of the compressed buffer per rank, as lax's ring moves of the float one.

Differentiation is ``lax.psum_scatter``'s (``jax.grad`` gives lax's gradient, an
``all_gather``). The module reads top to bottom: leaves as blocks and back, and the pytree API
(lanes, fusion buffers and ``policy="auto"`` as :func:`~jax_cgx.compressed_psum` has them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_cgx._src import compat
from jax_cgx._src.arguments import check_bool
from jax_cgx._src.codec import Impl, check_impl
from jax_cgx._src.collectives.plan import ConfigSpec, check_varying
from jax_cgx._src.collectives.scatter_gather import Leaves, check_key, compressed_buffers, timing_key
from jax_cgx._src.exchange.reduce_scatter import compressed_scatter

__all__ = ["compressed_psum_scatter", "scatter_blocks", "unscatter_block", "unscatter_blocks"]

API = "compressed_psum_scatter"


# ------------------------------------------------------------------ leaves as blocks and back

def check_shape(name: str, shape: tuple, dim: int, tiled: bool, world: int) -> int:
    """``dim`` normalized; raises like lax when the leaf cannot be scattered over ``world`` ranks."""
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"{API}: scatter_dimension={dim} is out of range for leaf {name} of shape {shape}")
    dim %= len(shape)
    if tiled and shape[dim] % world:
        raise ValueError(f"{API}: leaf {name} has {shape[dim]} entries along scatter_dimension {dim}, not divisible "
                         f"by the {world} ranks (tiled=True)")
    if not tiled and shape[dim] != world:
        raise ValueError(f"{API}: leaf {name} has {shape[dim]} entries along scatter_dimension {dim}; with "
                         f"tiled=False it must equal the number of ranks, {world}")
    return dim


def scatter_blocks(leaf, dim: int, world: int):
    """``[W, m]``: row ``j`` is the block rank ``j`` receives, flattened (tiled or not)."""
    return jnp.moveaxis(leaf, dim, 0).reshape(world, -1)


def unscatter_blocks(blocks, shape: tuple, dim: int):
    """The inverse of :func:`scatter_blocks`: ``[W, m]`` back in the leaf's (input) shape."""
    moved = (shape[dim],) + shape[:dim] + shape[dim + 1:]
    return jnp.moveaxis(blocks.reshape(moved), 0, dim)


def unscatter_block(block, shape: tuple, dim: int, tiled: bool, world: int):
    """A received block ``[m]`` in the leaf's output shape: ``dim`` dropped, or divided by ``world`` (tiled)."""
    moved = (shape[dim] // world,) if tiled else ()
    rest = shape[:dim] + shape[dim + 1:]
    out = block.reshape(moved + rest)
    return jnp.moveaxis(out, 0, dim) if tiled else out


# ------------------------------------------------------------------ the API

# What policy="auto" times a near-tie with (jax_cgx._src.policy.pricing.Timed); any key will do.
_TIMED = (functools.partial(lax.psum_scatter, tiled=True),
          lambda v, axis, config: compressed_psum_scatter(v, axis, config, tiled=True, key=timing_key(config)))


def compressed_psum_scatter(x, axis_name, config: ConfigSpec = None, *, scatter_dimension: int = 0,
                            tiled: bool = False, key: jax.Array | None = None, impl: Impl = "auto",
                            return_residual: bool = False):
    """``jax.lax.psum_scatter`` of a pytree, compressed: each contribution quantized at most once.

    The semantics, shapes and conventions of ``lax.psum_scatter``: with ``tiled=False`` every
    leaf's ``scatter_dimension`` has one entry per rank and is removed from the result; with
    ``tiled=True`` it is a multiple of the number of ranks and is divided by it. Leaves take
    the lanes of :func:`~jax_cgx.compressed_psum`: ``bits=32`` (or a ``None`` config, integer
    and small leaves) is exactly ``lax.psum_scatter``, ``bits=16`` the same in ``half_dtype``,
    and the quantized leaves of one dtype and config are fused into buffers of whole leaves
    of at most ``fusion_buffer_mb``. With ``policy="auto"`` a buffer the cost model finds
    faster uncompressed goes to ``lax.psum_scatter`` instead (logged once).

    Args:
      x: a pytree of arrays (inside ``shard_map`` or ``pmap``).
      axis_name: the mapped axis name(s) to reduce over.
      config: as for :func:`~jax_cgx.compressed_psum`: a :class:`~jax_cgx.CompressionConfig`, a
        pytree of them (or ``None`` per leaf), a function ``(path, leaf) -> config``, or ``None``
        (``CompressionConfig()``'s defaults, or torch_cgx's where its ``CGX_*`` variables are set).
      scatter_dimension: the dimension each leaf is split along.
      tiled: as for ``lax.psum_scatter``.
      key: a PRNG key for stochastic rounding, the same on every rank (each folds in its index).
      impl: the codec implementation: "auto", "kernel" or "reference" (bitwise the same).
      return_residual: also return this rank's share of the compression error, shaped like
        ``x``: what quantizing its blocks lost (zero for its own block and the exact lanes; the
        cast error in the 16-bit lane). Summed over the ranks, the residuals of block ``o`` are
        ``sum_r x_r[o] - out_o`` up to the rounding of the leaf's dtype (float32 for float32
        leaves): what error feedback adds to the next step's input.

    Returns:
      The pytree of this rank's blocks, summed over ``axis_name`` (with ``return_residual``,
      ``(sums, residuals)``); the error of a compressed value is bounded by the scales of its
      peers' buckets (module docstring).

    Raises:
      ValueError: under ``shard_map(check_vma=True)``, for a leaf that would be compressed but
        is typed invariant over ``axis_name``, as :func:`~jax_cgx.compressed_psum` does. Also for
        ``tiled`` or ``return_residual`` not a bool, an unknown ``impl``, ``scatter_dimension`` out of
        range for a leaf, a leaf whose ``scatter_dimension`` is not the number of ranks
        (``tiled=False``) or a multiple of it (``tiled=True``), or a stochastic config without ``key``.
      NameError: an axis of ``axis_name`` that is not bound (outside ``shard_map``/``pmap``).
      TypeError: ``key`` that is not one PRNG key.

    Examples:
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda v: jax_cgx.compressed_psum_scatter(v[0], "data", tiled=True)[None],
      ...                           mesh=mesh, in_specs=P("data"), out_specs=P("data")))
      >>> f(jax.device_put(jnp.ones((8, 8 * 256)), NamedSharding(mesh, P("data")))).shape  # each rank's block
      (8, 256)
    """
    tiled, return_residual = check_bool(API, "tiled", tiled), check_bool(API, "return_residual", return_residual)
    check_impl(impl)
    compat.check_prng_key(key, API)
    axes = compat.axes_tuple(axis_name)
    compat.check_axis_names(axes, API)
    world = int(np.prod([lax.axis_size(a) for a in axes]))
    leaves = Leaves(x, config, API, axes)
    dims = [check_shape(leaves.name(i), leaf.shape, scatter_dimension, tiled, world)
            for i, leaf in enumerate(leaves.leaves)]
    check_key(leaves, key, API)
    check_varying(API, leaves.paths, leaves.leaves, leaves.lanes, axes)
    compressed, uncompressed = [], set()
    if leaves.groups and world > 1:
        compressed, uncompressed = compressed_buffers(leaves, axes, world, "psum_scatter", key, world, API,
                                                      "psum_scatter", _TIMED, impl, return_residual)
    out: list = [None] * len(leaves.leaves)
    res: list = [None] * len(leaves.leaves)
    for i, (kind, leaf) in enumerate(zip(leaves.lanes, leaves.leaves)):
        # One rank: nothing moves, exact. policy="auto" may leave a buffer's leaves to lax.
        if not leaf.size:  # nothing to sum (XLA refuses an empty reduce-scatter): its empty block
            shape = list(leaf.shape)
            if tiled:
                shape[dims[i]] //= world
            else:
                del shape[dims[i]]
            out[i] = compat.ensure_varying(jnp.zeros(shape, leaf.dtype), axes)
            res[i] = jnp.zeros_like(leaf)
        elif kind == "exact" or (kind == "quantized" and (world == 1 or i in uncompressed)):
            out[i] = lax.psum_scatter(leaf, axes, scatter_dimension=dims[i], tiled=tiled)
            res[i] = jnp.zeros_like(leaf)
        elif kind == "half":
            half = leaf.astype(jnp.dtype(leaves.configs[i].half_dtype))
            out[i] = lax.psum_scatter(half, axes, scatter_dimension=dims[i], tiled=tiled).astype(leaf.dtype)
            res[i] = (leaf.astype(jnp.float32) - half.astype(jnp.float32)).astype(leaf.dtype)
    if compressed:
        for group, members, seeds, backend in compressed:
            cfg = group.config
            blocks = [scatter_blocks(leaves.leaves[i], dims[i], world) for i in members]
            joined = blocks[0] if len(blocks) == 1 else lax.optimization_barrier(jnp.concatenate(blocks, axis=1))
            if return_residual:
                summed, lost = compressed_scatter(joined, seeds, axes, world, cfg, impl=impl, backend=backend,
                                                  residual=True)
            else:
                summed = compressed_scatter(joined, seeds, axes, world, cfg, impl=impl, backend=backend)
            start = 0
            for i, block in zip(members, blocks):
                m, shape = block.shape[1], leaves.leaves[i].shape
                out[i] = unscatter_block(summed[start:start + m], shape, dims[i], tiled, world)
                if return_residual:
                    res[i] = unscatter_blocks(lost[:, start:start + m], shape, dims[i])
                start += m
    if return_residual:
        return leaves.treedef.unflatten(out), leaves.treedef.unflatten(res)
    return leaves.treedef.unflatten(out)
