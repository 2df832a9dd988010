"""Hierarchical all-reduce: uncompressed within a node, compressed across nodes.

torch_cgx's intra/cross-node split (docs/algorithm.md, "Hierarchical"): an uncompressed
reduce-scatter over the inner (intra-node) axis, the compressed all-reduce of each shard
over the outer axes, an all-gather over the inner axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_cgx._src import compat
from jax_cgx._src.config import CompressionConfig
from jax_cgx._src.exchange.all_reduce import compressed_sum
from jax_cgx._src.exchange.chunks import check_buffer_values, wire_bytes_per_rank

__all__ = ["reduce_hierarchical", "reduce_scatter_exact", "hierarchical_shard", "hierarchical_wire_bytes"]


def hierarchical_shard(n: int, inner_world: int, config: CompressionConfig) -> int:
    """Values per intra-node shard: ``n`` padded to a multiple of ``inner_world``.

    With ``skip_incomplete_buckets`` (``n`` is whole buckets) to a multiple of
    ``inner_world`` buckets, so that no bucket mixes values and padding.
    """
    check_buffer_values(n)  # the shards' real-value counts start from n, in int32
    align = inner_world * (config.bucket_size if config.skip_incomplete_buckets else 1)
    return -(-n // align) * align // inner_world


def reduce_hierarchical(head, axes, world, config: CompressionConfig, key, impl, residual=False, *, backend: str,
                        divisor: int = 1):
    """Two-level sum over ``axes = (outer..., inner)``, torch_cgx's intra/cross-node split.

    An uncompressed reduce-scatter over the inner (intra-node) axis leaves every rank a
    shard of the node's sum; the shards are reduced by the compressed primitive over
    the outer axes (each rank with the ranks that hold the same shard on other nodes),
    and an all-gather over the inner axis reassembles the buffer.

    With ``residual``: ``(sum, residual)``; the compressed exchange's residual sits at this
    rank's shard positions of the buffer, zeros elsewhere (the inner reduce-scatter and
    all-gather are exact up to float32 rounding). ``divisor``: the sum divided by it, in the
    compressed exchange's decode (the all-gather moves the divided values).
    """
    inner, outer = axes[-1], axes[:-1]
    inner_world = lax.axis_size(inner)
    outer_world = world // inner_world
    if outer_world == 1:
        # One node: nothing is compressed, an exact sum.
        total = lax.psum(head, axes)
        total = total if divisor == 1 else total / divisor
        return (total, jnp.zeros_like(head)) if residual else total
    n = head.size
    shard_n = hierarchical_shard(n, inner_world, config)
    padded = head
    if shard_n * inner_world != n:
        padded = lax.dynamic_update_slice(jnp.zeros((shard_n * inner_world,), head.dtype), head, (0,))
    shard = reduce_scatter_exact(padded, inner, inner_world)
    # The last shards may end in padding: tell the compressed exchange where the real values end.
    real = jnp.clip(n - lax.axis_index(inner) * shard_n, 0, shard_n)
    reduced = compressed_sum(shard, outer, outer_world, config, key, impl, residual, valid=real, backend=backend,
                             divisor=divisor)
    if residual:
        reduced, lost = reduced
    if compat.check_vma_enabled():
        # The shard varies over the inner axis; the gathered sum does not (like psum's), and
        # its transpose hands each rank its own shard of the cotangent.
        full = compat.all_gather_invariant(reduced, inner)
    else:
        full = lax.all_gather(reduced, inner, axis=0, tiled=True)
    if not residual:
        return full[:n]
    # psum_scatter hands shard i to inner rank i: our residual covers those positions.
    placed = lax.dynamic_update_slice(jnp.zeros_like(padded), lost, (lax.axis_index(inner) * shard_n,))
    return full[:n], placed[:n]


def reduce_scatter_exact(x, inner, inner_world: int):
    """``lax.psum_scatter(x, inner, tiled=True)``, except on CPUs of several processes.

    There XLA runs it on gloo's ReduceScatter, which returns wrong values at the end of rank 0's
    shard for shards of MiBs, with no error (jax-ml/jax#40830; measured on 2 nodes of 2 processes
    at 1 Gbit/s, jax 0.10.2: 8 MiB shards wrong in 2 of 6 calls, a plain lax reduce-scatter too).
    There each rank sends every other rank its block with one ``ppermute`` per shift and adds
    what arrives to its own block (its own first, then shift 1, 2, ...: for 2 ranks bitwise the
    sum in rank order). The same bytes as a reduce-scatter; an ``all_to_all`` and a local sum send
    them too, but slower and less steadily: 71-72 ms against 43-56 for 32 MiB per rank in
    ``python -m jax_cgx.bench phases --two-level`` (2 nodes of 2 processes on 2 cores), 30-72 ms
    against 31-37 in 7 side-by-side runs (docs/multinode.md).
    """
    if compat.trace_platform() != "cpu" or jax.process_count() == 1:
        return lax.psum_scatter(x, inner, scatter_dimension=0, tiled=True)
    blocks = x.reshape(inner_world, -1)
    me = lax.axis_index(inner)
    total = lax.dynamic_index_in_dim(blocks, me, 0, keepdims=False)
    for shift in range(1, inner_world):
        # Block me + shift goes to rank me + shift; ours arrives from rank me - shift.
        outgoing = lax.dynamic_index_in_dim(blocks, (me + shift) % inner_world, 0, keepdims=False)
        total = total + lax.ppermute(outgoing, inner, [(j, (j + shift) % inner_world) for j in range(inner_world)])
    return total


def hierarchical_wire_bytes(n: int, world: int, inner_world: int, cfg: CompressionConfig, itemsize: int):
    """Bytes one rank sends for ``n`` values reduced by :func:`reduce_hierarchical`."""
    outer_world = world // inner_world
    if n == 0:
        return 0
    if outer_world == 1:
        return 2 * (world - 1) / world * n * itemsize  # an exact psum
    shard_n = hierarchical_shard(n, inner_world, cfg)
    inner = 2 * (inner_world - 1) * shard_n * itemsize  # reduce-scatter + all-gather
    return inner + wire_bytes_per_rank(
        shard_n, outer_world, cfg.bits, cfg.bucket_size, cfg.skip_incomplete_buckets
    )
