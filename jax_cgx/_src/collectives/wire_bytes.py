"""``bytes_on_wire``: what one rank sends to reduce a pytree, for each op, counted from the same plan
the collectives run (lanes, fusion buffers, ``policy="auto"``'s decisions where measured), without
running anything."""

from __future__ import annotations

import jax
import numpy as np

from jax_cgx._src.codec.quantized import META_BYTES, num_buckets, payload_bytes
from jax_cgx._src.collectives.plan import ConfigSpec, check_ranks, make_plan
from jax_cgx._src.collectives.scatter_gather import Leaves, buffers, decide
from jax_cgx._src.exchange.chunks import chunk_length, wire_bytes_per_rank
from jax_cgx._src.exchange.hierarchical import hierarchical_wire_bytes
from jax_cgx._src.policy import pricing

__all__ = ["WIRE_OPS", "bytes_on_wire"]

WIRE_OPS = ("psum", "psum_scatter", "all_gather")


def bytes_on_wire(x, world: int, config: ConfigSpec = None, *, inner_world: int | None = None,
                  op: str = "psum") -> int:
    """Bytes one rank sends to reduce the pytree ``x`` (arrays or ShapeDtypeStructs) over ``world`` ranks.

    ``op``: ``"psum"`` (:func:`~jax_cgx.compressed_psum`, described below), ``"psum_scatter"``
    (:func:`~jax_cgx.compressed_psum_scatter` of ``x``: ``W-1`` of its ``W`` blocks,
    packed when quantized) or ``"all_gather"`` (:func:`~jax_cgx.compressed_all_gather` of the
    shard ``x``: ``W-1`` copies of it, packed when quantized).

    One process may call it alone: it runs nothing collective. So under ``policy="auto"`` in
    a multi-process job it needs the figures measured first (:func:`jax_cgx.calibrate` on every
    process, or a step that compresses), and raises a ``RuntimeError`` otherwise.

    Uncompressed lanes are counted as a bandwidth-optimal all-reduce, ``2(W-1)/W`` times
    the array's bytes; a quantized buffer as the compressed exchange: ``W-1`` packed
    chunks out in the all_to_all (SRA) or around the ring (``algorithm="ring"``, the
    same bytes) and ``W-1`` in the all_gather (payload plus 8 bytes per bucket).

    Args:
      x: the pytree.
      world: the number of ranks the sum runs over (all reduced axes together).
      config: as for :func:`~jax_cgx.compressed_psum`.
      inner_world: for ``hierarchical`` configs, the size of the inner (last, intra-node)
        axis; required by them, ignored otherwise. A hierarchical buffer is counted as an
        uncompressed reduce-scatter plus all-gather of the (padded) buffer over the inner
        axis, ``2(Wi-1)/Wi`` times its bytes, plus the compressed exchange of one shard
        over the ``world / inner_world`` outer ranks.
      op: the collective counted: ``"psum"`` (the default), ``"psum_scatter"`` or
        ``"all_gather"``, as above.

    Returns:
      The bytes one rank sends, an ``int`` (rounded to the nearest byte); 0 for ``world=1``.

    Raises:
      ValueError: an unknown ``op``; ``world`` or ``inner_world`` not a positive int, or
        ``inner_world`` not dividing ``world``; a hierarchical config without ``inner_world``
        (``op="psum"``); a leaf whose size ``world`` does not divide (``op="psum_scatter"``).
      RuntimeError: ``policy="auto"`` in a multi-process job before the figures were measured.

    Examples:
      >>> jax_cgx.bytes_on_wire(jnp.zeros(1 << 20), 8, jax_cgx.CompressionConfig(bits=4))
      1032192
      >>> jax_cgx.bytes_on_wire(jnp.zeros(1 << 20), 8, jax_cgx.CompressionConfig(bits=32))  # psum's ring
      7340032
    """
    if op not in WIRE_OPS:
        raise ValueError(f"bytes_on_wire: op must be one of {', '.join(map(repr, WIRE_OPS))}, got {op!r}")
    world, inner_world = check_ranks("bytes_on_wire", world, inner_world)
    if op != "psum":
        with pricing.one_process_alone():  # one process may call it: nothing collective
            return _sharded_bytes(x, world, config, op)
    leaves_with_paths = jax.tree_util.tree_flatten_with_path(x)[0]
    paths = [p for p, _ in leaves_with_paths]
    leaves = [v for _, v in leaves_with_paths]
    with pricing.one_process_alone():  # one process may call it: nothing collective
        plan = make_plan(paths, leaves, config, x, world, inner_world, measure=False, api="bytes_on_wire")
    if world <= 1:
        return 0
    ring = 2 * (world - 1) / world
    total = 0.0
    for leaf, lane, c in zip(leaves, plan.lanes, plan.configs):
        if lane in ("exact", "auto-psum"):
            total += ring * leaf.size * np.dtype(leaf.dtype).itemsize
        elif lane == "half":
            total += ring * leaf.size * 2
    for group in plan.groups:
        cfg = group.config
        if cfg.hierarchical and inner_world is None:
            raise ValueError(
                "bytes_on_wire: hierarchical configs need inner_world= (the size of the inner, "
                "intra-node axis)"
            )
        for (start, stop), compress in zip(plan.buffers(group), plan.compressed(group)):
            n = stop - start
            if not compress:
                total += ring * n * group.dtype.itemsize
                continue
            head = (n // cfg.bucket_size) * cfg.bucket_size if cfg.skip_incomplete_buckets else n
            if cfg.hierarchical:
                total += hierarchical_wire_bytes(head, world, inner_world, cfg, group.dtype.itemsize)
            else:
                total += wire_bytes_per_rank(
                    head, world, cfg.bits, cfg.bucket_size, cfg.skip_incomplete_buckets
                )
            total += ring * (n - head) * group.dtype.itemsize
    return int(round(total))


def _sharded_bytes(x, world: int, config: ConfigSpec, op: str) -> int:
    """Bytes one rank sends for ``compressed_psum_scatter`` (``x``: each rank's input) or
    ``compressed_all_gather`` (``x``: each rank's shard): ``W - 1`` blocks or shards, each
    the leaf's bytes over ``W`` (reduce-scatter) or the shard's (all-gather) uncompressed,
    packed (payload plus 8 bytes per bucket) when quantized."""
    if world <= 1:
        return 0
    leaves = Leaves(x, config, "bytes_on_wire")
    if op == "psum_scatter":
        for i, leaf in enumerate(leaves.leaves):
            if leaf.size % world:
                raise ValueError(f"bytes_on_wire: leaf {leaves.name(i)} has {leaf.size} values, which "
                                 f"compressed_psum_scatter cannot split over {world} ranks")
    share = (world - 1) / world if op == "psum_scatter" else world - 1
    total = 0.0
    for leaf, kind in zip(leaves.leaves, leaves.lanes):
        if kind == "exact":
            total += share * leaf.size * np.dtype(leaf.dtype).itemsize
        elif kind == "half":
            total += share * leaf.size * 2
    for group, members in buffers(leaves, world, op):
        if not decide(leaves, group, members, world, op, measure=False).compress:  # lax, uncompressed
            total += share * sum(leaves.leaves[i].size * group.dtype.itemsize for i in members)
            continue
        m = sum(leaves.leaves[i].size for i in members) // (world if op == "psum_scatter" else 1)
        c = chunk_length(m * world, world, group.config.bucket_size, False)
        packed = payload_bytes(c, group.config.bucket_size, group.config.bits)
        total += (world - 1) * (packed + num_buckets(c, group.config.bucket_size) * META_BYTES)
    return int(round(total))
