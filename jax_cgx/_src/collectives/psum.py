"""compressed_psum / compressed_pmean: ``lax.psum`` / ``lax.pmean`` that move fewer bytes.

A pytree goes through three lanes, leaf by leaf (:mod:`jax_cgx._src.collectives.plan`): exact
(``lax.psum``), half (a ``psum`` in 16 bits) and quantized: leaves of one dtype and config
are fused into buffers of at most ``fusion_buffer_mb`` and each buffer is reduced by the
compressed primitive (:mod:`jax_cgx._src.exchange.all_reduce`), or, under ``policy="auto"``
where the cost model predicts no gain, by ``psum`` (:mod:`jax_cgx._src.policy.pricing`).

With ``skip_incomplete_buckets`` the last ``n mod bucket_size`` values of a buffer
take the exact lane, as in torch_cgx.

``return_residual=True`` also returns each rank's share of the compression error, for
error feedback (docs/algorithm.md, "Error feedback").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_cgx._src import compat
from jax_cgx._src.arguments import check_bool
from jax_cgx._src.codec import Impl, check_impl
from jax_cgx._src.collectives import shards
from jax_cgx._src.collectives.plan import ConfigSpec, LeafConfigs, check_varying, leaf_configs, make_plan
from jax_cgx._src.config import CompressionConfig
from jax_cgx._src.exchange.all_reduce import compressed_sum
from jax_cgx._src.exchange.hierarchical import reduce_hierarchical

__all__ = ["compressed_psum", "compressed_pmean", "ConfigSpec"]

def _inner_world(axes: tuple) -> int | None:
    """The inner (last) axis's size: what a hierarchical config sums within a node."""
    return lax.axis_size(axes[-1]) if len(axes) > 1 else None


def _world_size(axes: tuple, api: str) -> int:
    compat.check_axis_names(axes, api)
    return math.prod(lax.axis_size(a) for a in axes)


def compressed_psum(
    x,
    axis_name,
    config: ConfigSpec = None,
    *,
    key: jax.Array | None = None,
    impl: Impl = "auto",
    return_residual: bool = False,
    specs: shards.SpecTree = None,
):
    """Sum a pytree over mapped axes, moving quantized bytes instead of full-precision ones.

    Use it wherever ``jax.lax.psum`` works: inside ``jax.shard_map`` (``check_vma``
    on or off) or ``jax.pmap``, under ``jit``, ``grad`` (it differentiates like
    ``psum``), ``vmap`` over other axes, ``scan`` and ``cond``.

    Args:
      x: a pytree of arrays.
      axis_name: a mapped axis name, or a tuple of them.
      config: a :class:`CompressionConfig` for every leaf; ``None`` for
        ``CompressionConfig()``'s defaults (4 bits in buckets of 128, leaves under 1024 values
        exact), or, where torch_cgx's ``CGX_*``
        variables are set, ``CompressionConfig.from_env()`` (torch_cgx's meaning: compression
        is off unless ``CGX_COMPRESSION_QUANTIZATION_BITS`` is set); which one is logged once
        (INFO). A pytree of configs matching ``x`` (``None`` entries are reduced exactly); or
        a function ``(path, leaf) -> CompressionConfig | None``.
      key: a PRNG key, required when any leaf uses stochastic rounding. Every rank
        folds in its axis index, so ranks round independently.
      impl: codec implementation: ``"auto"``, ``"kernel"`` or ``"reference"``.
      return_residual: also return this rank's compression error, for error feedback.
      specs: on a mesh with axes the enclosing ``shard_map`` leaves to XLA's partitioner (a
        ``"model"`` axis of tensor parallelism or FSDP, ``Auto`` or ``Explicit``), how each leaf
        is sharded over them: a ``PartitionSpec`` (or ``NamedSharding``) per leaf, a pytree
        prefix of ``x``, or None (the default: each leaf's type where those axes are
        ``Explicit``; unknown with ``Auto`` axes under ``jax.jit``, where the leaf is reduced
        whole on every device and a warning says so). Every device then quantizes and sends
        only its own shard, and the result keeps the leaf's sharding (docs/guide.md, "Sharded
        models"). Ignored where every mesh axis is mapped by hand.

    Returns:
      A pytree like ``x``: the sum, bitwise identical on every rank. With
      ``return_residual=True``, ``(sum, residual)``: ``sum`` is bitwise the same as
      without it, and ``residual`` is a pytree like ``x`` (same dtypes, different on
      every rank) such that, summed over the ranks of the reduction,
      ``sum_r residual_r == sum_r x_r - sum`` up to float32 rounding (and the rounding of
      the residual to the leaf's dtype, for bfloat16/float16 leaves): every rank holds
      exactly the compression error attributable to it. Per lane: exact leaves and the
      uncompressed tail of ``skip_incomplete_buckets``: zeros; ``bits=16``: the local cast
      error ``x - cast(x)`` (the rounding of the half-precision sum itself is not
      attributable to a rank and is not included); quantized: what each quantization
      this rank ran lost (see docs/algorithm.md, "Error feedback"); a single rank:
      zeros. Residuals are computed by the ``xla`` backend only (``backend="nccl"`` or
      ``"tcp"`` raises); they cannot be differentiated.

    Raises:
      ValueError: under ``shard_map(check_vma=True)``, for a leaf that would be compressed but
        is typed invariant over ``axis_name`` (the same on every device, such as the gradient
        with respect to replicated parameters, which JAX has already summed): the message
        names the fix, ``jax.lax.pcast(params, axis_name, to="varying")`` before
        differentiating. Leaves reduced exactly are ``lax.psum``'s, which sums such a value
        ``W`` times. Also for ``return_residual`` not a bool, an unknown ``impl``, a stochastic
        config without ``key``, or more fusion buffers than ``MAX_FUSION_BUFFERS`` (1024).
      NameError: an axis of ``axis_name`` that is not bound (outside ``shard_map``/``pmap``).
      TypeError: ``key`` that is not one PRNG key.
      NotImplementedError: a compressed leaf reduced over a ``vmap``'s axis.

    Examples:
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> x = jax.device_put(jnp.ones((8, 1000)), NamedSharding(mesh, P("data")))
      >>> f = jax.jit(jax.shard_map(lambda v: jax_cgx.compressed_psum(v, "data", jax_cgx.CompressionConfig(bits=4)),
      ...                           mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> np.asarray(f(x))[0, :4]  # a constant bucket sums exactly
      array([8., 8., 8., 8.], dtype=float32)
    """
    return _sum(x, axis_name, config, key, impl, return_residual, "compressed_psum", specs)


def _divided(total, divisor: int | None):
    """``total / divisor`` for a mean (which makes integer leaves float, as ``lax.pmean`` does,
    even for ``divisor == 1``); ``total`` for a sum (``divisor`` None)."""
    return total if divisor is None else total / divisor


def _sum(x, axis_name, config: ConfigSpec, key, impl: Impl, return_residual: bool, api: str, specs=None):
    """:func:`compressed_psum`, for ``api`` (``compressed_psum`` or ``compressed_pmean``: named in
    its errors, and the invariance check words the mean's result as a mean).

    For ``compressed_pmean`` every result is divided by the world size: the exact lanes as
    ``lax.pmean`` does, after the sum; a compressed buffer in the decode that ends its exchange
    (the primitive's ``divisor``), so the mean costs no pass over the result of its own.
    """
    return_residual = check_bool(api, "return_residual", return_residual)
    check_impl(impl)
    compat.check_prng_key(key, api)
    axes = compat.axes_tuple(axis_name)
    world = _world_size(axes, api)
    divisor = world if api == "compressed_pmean" else None
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(x)
    paths = [p for p, _ in leaves_with_paths]
    leaves = [jnp.asarray(v) for _, v in leaves_with_paths]
    if free := shards.free_axes():
        return _sum_own_shards(x, paths, leaves, treedef, axis_name, config, key, impl, return_residual, api, specs,
                               free)
    plan = make_plan(paths, leaves, config, x, world, _inner_world(axes), axes, impl=impl, residual=return_residual,
                     api=api)
    check_varying(api, paths, leaves, plan.lanes, axes, mean=api == "compressed_pmean")

    out: list[jax.Array | None] = [None] * len(leaves)
    res: list[jax.Array | None] = [None] * len(leaves)
    # The uncompressed lanes in one psum each, as lax.psum of a pytree does: one all-reduce of
    # many operands instead of one per leaf (each costs a collective's fixed cost; on gloo
    # about 2 ms, which made policy="auto" 5% slower than pmean with every leaf psum'd).
    exact = [i for i, lane in enumerate(plan.lanes) if lane in ("exact", "auto-psum")]
    for i, total in zip(exact, lax.psum([leaves[i] for i in exact], axes) if exact else []):
        out[i] = _divided(total, divisor)
        if return_residual:
            res[i] = jnp.zeros_like(leaves[i])
    halves = {i: leaves[i].astype(jnp.dtype(plan.configs[i].half_dtype))
              for i, lane in enumerate(plan.lanes) if lane == "half"}
    for (i, half), total in zip(halves.items(), lax.psum(list(halves.values()), axes) if halves else []):
        out[i] = _divided(total.astype(leaves[i].dtype), divisor)
        if return_residual:  # the local cast error; the half-precision sum's rounding is no rank's
            res[i] = (leaves[i].astype(jnp.float32) - half.astype(jnp.float32)).astype(leaves[i].dtype)

    if plan.groups:
        if vmapped := compat.vmapped_axes(axes):
            # The primitive's batching rule says the same; under check_vma jax's pvary would
            # fail first with a bare AssertionError.
            raise NotImplementedError(
                f"{api} over the vmapped axis {vmapped[0]!r} is not supported: vmap "
                "has no wire to compress. Sum the batch dimension outside the vmap (e.g. "
                "x.sum(axis=0)) and pass only mesh axes as axis_name, or map that axis with "
                "jax.shard_map / jax.pmap."
            )
        plan.check_buffer_count()
        if any(g.config.stochastic for g in plan.groups) and key is None:
            raise ValueError(
                f"{api}: stochastic rounding needs a PRNG key; pass "
                "key=jax.random.key(...) (the same on every rank; each rank folds in its index)"
            )
        rank_key = None if key is None else jax.random.fold_in(key, lax.axis_index(axes))
        buffer_index = 0
        for group, members in plan.groups.items():
            spans = plan.buffers(group)
            flat = [leaves[i].reshape(-1) for i in members]
            bounds = np.cumsum([0] + [plan.sizes[i] for i in members])
            reduced, lost = [], []
            for (start, stop), compress in zip(spans, plan.compressed(group)):
                buf_key = None if rank_key is None else jax.random.fold_in(rank_key, buffer_index)
                buffer_index += 1
                buf = _assemble(flat, bounds, start, stop)
                if compress:
                    result = _reduce_buffer(buf, axes, world, group.config, buf_key, impl, return_residual,
                                            backend=plan.backends.get(group, "xla"), divisor=divisor)
                else:
                    result = _divided(lax.psum(buf, axes), divisor)
                    result = (result, jnp.zeros_like(buf)) if return_residual else result
                reduced.append(result[0] if return_residual else result)
                lost.append(result[1] if return_residual else None)
            for j, i in enumerate(members):
                out[i] = _take(reduced, spans, bounds[j], bounds[j + 1]).reshape(leaves[i].shape)
                if return_residual:
                    res[i] = _take(lost, spans, bounds[j], bounds[j + 1]).reshape(leaves[i].shape)
    if return_residual:
        return treedef.unflatten(out), treedef.unflatten(res)
    return treedef.unflatten(out)


def _sum_own_shards(x, paths, leaves, treedef, axis_name, config, key, impl, return_residual, api, specs, free):
    """:func:`_sum` where mesh axes ``free`` are left to XLA's partitioner: each device reduces
    its own shards (:mod:`~jax_cgx._src.collectives.shards`), leaves split alike fused together."""
    axes = compat.axes_tuple(axis_name)
    leaf_specs = shards.leaf_specs(api, paths, leaves, specs, x, axes, free)
    configs = leaf_configs(config, x, paths, api)  # resolved on the whole tree: a function sees each leaf's path
    groups = shards.split_alike(leaf_specs)

    def own_shards(local, local_key):
        out = [None] * len(local)
        lost = [None] * len(local)
        for g, members in enumerate(groups):
            group_key = local_key if local_key is None or len(groups) == 1 else jax.random.fold_in(local_key, g)
            result = _sum([local[i] for i in members], axis_name, LeafConfigs(configs[i] for i in members), group_key, impl,
                          return_residual, api)
            total, residual = result if return_residual else (result, None)
            for j, i in enumerate(members):
                out[i] = total[j]
                lost[i] = None if residual is None else residual[j]
        return (out, lost) if return_residual else out

    result = shards.on_own_shards(own_shards, leaves, leaf_specs, key, free, outputs=2 if return_residual else 1)
    if return_residual:
        return treedef.unflatten(result[0]), treedef.unflatten(result[1])
    return treedef.unflatten(result)


def _join(parts):
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def _pieces(parts, spans, lo: int, hi: int) -> list[jax.Array]:
    """The slices of ``parts`` (part ``k`` holds values ``spans[k]`` of one concatenation) that
    together hold values ``[lo, hi)``, in order."""
    return [part[max(lo, a) - a : min(hi, b) - a] for part, (a, b) in zip(parts, spans) if a < hi and b > lo]


def _take(parts, spans, lo: int, hi: int) -> jax.Array:
    """Values ``[lo, hi)`` of the concatenation of ``parts`` (part ``k`` holds ``spans[k]``).

    Slices the one or two buffers a leaf lies in, rather than joining all buffers first:
    a leaf inside one buffer is a slice of it, with no copy of the whole (measured: a
    64 MiB join cost 15 ms per step of docs/performance.md's MLP).
    """
    pieces = _pieces(parts, spans, lo, hi)
    if not pieces:
        return parts[0][:0]
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)


def compressed_pmean(
    x,
    axis_name,
    config: ConfigSpec = None,
    *,
    key: jax.Array | None = None,
    impl: Impl = "auto",
    return_residual: bool = False,
    specs: shards.SpecTree = None,
):
    """The mean of a pytree over mapped axes: :func:`compressed_psum` divided by the axis size.

    Bitwise ``compressed_psum(x, ...) / W`` as ``jax.jit`` computes it on CPU for float32 leaves
    (XLA multiplies by ``float32(1 / W)``; on GPU it keeps subnormal quotients, which this flushes
    to zero); a compressed buffer is divided where its sum is decoded,
    in float32 before the one rounding to a bfloat16/float16 leaf's dtype (one rounding fewer
    than dividing the rounded sum), and no pass over the result is spent on the division.

    With ``return_residual=True`` returns ``(mean, residual)`` where ``residual`` is
    :func:`compressed_psum`'s: the residual **of the sum**, in the units of the inputs
    (``sum_r residual_r == sum_r x_r - W * mean``), not divided by ``W``. That is what
    error feedback adds to the next step's inputs (:func:`jax_cgx.optax.compressed_mean`).

    A leaf typed invariant over ``axis_name`` raises as in :func:`compressed_psum`: the mean of a
    gradient JAX has already summed would be ``W`` times the mean gradient. ``specs``: as for
    :func:`compressed_psum`, on a mesh with model axes left to XLA's partitioner.

    Args:
      x: a pytree of arrays, this rank's values.
      axis_name: a mapped axis name, or a tuple of them (the mean is over all of them).
      config: as for :func:`compressed_psum` (``None``: ``CompressionConfig()``, or torch_cgx's
        variables where set).
      key: a PRNG key, required when any leaf uses stochastic rounding.
      impl: the codec implementation: ``"auto"``, ``"kernel"`` or ``"reference"``.
      return_residual: also return this rank's compression error of the sum, for error feedback.
      specs: as for :func:`compressed_psum`.

    Returns:
      A pytree like ``x``: the mean, bitwise identical on every rank; with ``return_residual=True``,
      ``(mean, residual)`` as above.

    Raises:
      ValueError: as :func:`compressed_psum` raises (a compressed leaf typed invariant over
        ``axis_name``, a bad argument).
      NameError: an axis of ``axis_name`` that is not bound (outside ``shard_map``/``pmap``).
      TypeError: ``key`` that is not one PRNG key.
      NotImplementedError: a compressed leaf reduced over a ``vmap``'s axis.

    Examples:
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> x = jax.device_put(jnp.linspace(-1, 1, 8 * 4096).reshape(8, 4096), NamedSharding(mesh, P("data")))
      >>> mean = jax.jit(jax.shard_map(lambda v: jax_cgx.compressed_pmean(v, "data"),  # 4 bits, buckets of 128
      ...                              mesh=mesh, in_specs=P("data"), out_specs=P()))(x)
      >>> bool(np.max(np.abs(np.asarray(mean) - np.asarray(x).mean(axis=0))) < 0.02)
      True
    """
    return _sum(x, axis_name, config, key, impl, return_residual, "compressed_pmean", specs)


def _assemble(flat, bounds, start: int, stop: int) -> jax.Array:
    """Values ``[start, stop)`` of the concatenation of ``flat``, written into one buffer.

    One ``concatenate`` behind an ``optimization_barrier``: one copy of each value, at
    memory speed. Without the barrier XLA:CPU fuses a many-operand concatenate into the
    consumers of the buffer and runs it ~10x slower than a copy (400 ms instead of 30 ms
    per step for 6 leaves of 5 MiB on 8 virtual devices); a chain of
    ``dynamic_update_slice``s into zeros became a slow pad fusion once the algorithm's own
    padding followed it (the comm-bound MLP step of docs/performance.md: 148 ms of copies
    per step, 25 ms with this).
    """
    pieces = _pieces(flat, list(zip(bounds[:-1], bounds[1:])), start, stop)
    return pieces[0] if len(pieces) == 1 else lax.optimization_barrier(jnp.concatenate(pieces))


def _reduce_buffer(buf, axes, world, config: CompressionConfig, key, impl, residual=False, *, backend: str,
                   divisor: int | None = None):
    """One fusion buffer through the compressed primitive (its uncompressed tail, if skipped, through psum).

    With ``config.hierarchical`` the compressed part is reduced in two levels
    (:func:`~jax_cgx._src.exchange.hierarchical.reduce_hierarchical`). With ``residual`` returns ``(sum, residual)``.
    ``backend``: the one the plan chose for the buffer's compressed exchange. ``divisor``: the
    result is the sum divided by it (the residual stays the sum's); None for the sum.
    """
    if config.hierarchical and len(axes) < 2:
        raise ValueError(
            "compressed_psum: hierarchical=True needs a reduction over (cross-node axes..., "
            "intra-node axis), e.g. axis_name=('node', 'local') on a 2-D mesh, but got "
            f"axis_name={axes[0]!r}. The last axis is summed uncompressed within a node and the "
            "others exchange compressed bytes; set hierarchical=False (JAX_CGX_HIERARCHICAL=0) "
            "to compress over a single axis."
        )
    if world == 1:
        # A sum over one rank moves nothing: exact. lax.psum still, for its type (invariant over the
        # axis, as every result of the sum is; XLA drops a one-device all-reduce).
        total = _divided(lax.psum(buf, axes), divisor)
        return (total, jnp.zeros_like(buf)) if residual else total
    n = buf.size
    head_n = (n // config.bucket_size) * config.bucket_size if config.skip_incomplete_buckets else n
    parts, lost = [], []
    if head_n:
        head = buf[:head_n]  # varying over axes under check_vma: its leaves are (check_varying)
        reduce = reduce_hierarchical if config.hierarchical else compressed_sum
        result = reduce(head, axes, world, config, key, impl, residual, backend=backend, divisor=divisor or 1)
        parts.append(result[0] if residual else result)
        lost.append(result[1] if residual else None)
    if head_n < n:
        tail = buf[head_n:]
        parts.append(_divided(lax.psum(tail, axes), divisor))
        lost.append(jnp.zeros_like(tail) if residual else None)  # the exact lane loses nothing
    if residual:
        return _join(parts), _join(lost)
    return _join(parts)
