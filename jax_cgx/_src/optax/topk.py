"""Deep Gradient Compression (Lin et al., ICLR 2018) as an optax transformation: ``topk_mean``.

Every rank keeps, per compressed leaf, a momentum ``u`` and an accumulated velocity ``v``
(float32, shaped like the parameter). One step on rank ``r`` with local gradient ``g``:

1. momentum correction: ``u = momentum * u + g``; local accumulation: ``v = v + u``
   (Nesterov: ``v = v + g + momentum * u``, see below);
2. threshold: ``thr`` = the ``ceil(ratio_t * s)``-th largest ``|v|`` among ``s`` elements of
   ``|v|`` sampled at random (the key folds in ``seed``, the step count, the rank
   ``lax.axis_index(axis_name)`` and the leaf's index, so ranks sample independently);
   with ``s >= n`` (``sample_ratio=1``, or a small leaf) the whole ``|v|`` is used and
   ``thr`` is exact;
3. selection of at most ``k_t = ceil(ratio_t * n)`` positions with ``|v| >= thr`` (and
   ``v != 0``), with DGC's adaptation: while fewer than ``0.8 k_t`` pass a sampled
   threshold, it is lowered by 0.8 (at most 10 times); if more than ``1.3 k_t`` pass, the
   exact top-``k_t`` of ``|v|`` is taken (they are all candidates); otherwise the first
   ``k_t`` candidates in index order;
4. exchange: ``values[k_t]`` (float32, as bits) and ``indices[k_t]`` (int32) packed
   into one int32 array and sent through one ``lax.all_gather``; every rank scatter-adds the ``W`` contributions into a dense zero
   array, rank by rank in rank order (deterministic, bitwise the same on every replica), and
   divides by ``W``: the mean;
5. momentum factor masking: ``u`` and ``v`` are zeroed at the positions this rank sent.

Shapes are static: the state never changes shape, and each distinct ratio of the schedule
(warm-up phases, then ``ratio``) is its own branch of a ``lax.switch`` with a static
``k_t``, so every step transmits exactly ``k_t`` slots (all ranks take the same branch: it
depends on the step count only). Slots not filled (fewer candidates than ``k_t``) carry
value 0 and the out-of-range index ``n``, which the scatter drops.

Nesterov: DGC's reference code keeps ``u' = momentum * (u' + g)`` and adds ``u' + g`` to
``v``; with ``u' = momentum * u`` that is ``u = momentum * u + g; v += g + momentum * u``
(optax's / PyTorch's form), which is what is implemented -- the same ``v`` every step, and
masking zeroes ``u`` and ``u'`` alike.

Uncompressed leaves (size < ``min_size``, scalars, non-float: integer and complex) are
averaged exactly with ``lax.pmean``; as in DGC's reference (which applies
``compensate(accumulate=False)`` to the all-reduced gradient, and whose ``DGCSGD`` has no
gradient momentum) the momentum of those leaves is also applied here, to the *mean*:
``u = momentum * u + pmean(g)``, update ``u`` (Nesterov: ``pmean(g) + momentum * u``). So every
leaf leaves this transformation already momentum-corrected: follow it with plain SGD, never
with a momentum optimizer::

    tx = optax.chain(
        optax.clip_by_global_norm(1.0),            # optional: DGC's local (per-rank) clipping
        jax_cgx.optax.topk_mean("data", 0.001, momentum=0.9, warmup_steps=500),
        optax.add_decayed_weights(1e-4),           # optional weight decay (not momentum-corrected)
        optax.sgd(0.1),                            # momentum=0: the momentum is inside topk_mean
    )

With ``momentum=0`` the uncompressed leaves are exactly ``lax.pmean`` and keep no state.

Complex leaves are never sparsified (top-k of a complex leaf would have to choose between
magnitudes and components): they are averaged exactly like the other uncompressed leaves, and
their momentum is kept in complex64, so nothing of the imaginary part is lost.

Non-finite gradients: an inf or NaN in any rank's gradient makes the mean non-finite on every
rank (also when the bad element is not selected), and such a step leaves the whole state
(``count``, ``u``, ``v``) bitwise unchanged (on every rank alike): the next finite step gives
exactly the update it would have given had the bad step never happened. To skip those steps
put ``optax.apply_if_finite`` *after* ``topk_mean``, around the optimizer:
``optax.chain(topk_mean(...), optax.apply_if_finite(optax.sgd(lr), 5))``. Do not wrap
``topk_mean`` itself (nor any transformation with a collective) in ``apply_if_finite``: it
tests each rank's own gradient, so ranks could disagree on whether to run the collective.

``update`` raises a ``ValueError`` naming the leaf and both shapes when the state does not
belong to the updates (built for other parameters, another ``min_size`` or ``momentum``, or
given the wrong ``shard_map`` specs).

``optax.MultiSteps(optax.chain(topk_mean(...), ...), k)`` works (the micro-gradients are
averaged locally, the exchange sees their mean), but note that optax's ``MultiSteps`` runs
the inner update, and so the exchange, on every micro-step and keeps only the last one.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jax_cgx._src.optax import checks
from jax_cgx._src.optax.topk_exchange import LeafPlan, ceil_count, exchange, leaf_plan

__all__ = ["TopKState", "topk_mean", "topk_bytes"]


class TopKState(NamedTuple):
    """State of :func:`topk_mean`."""

    #: int32 scalar, finite steps taken (the same on every rank).
    count: jax.Array
    #: Momentum, float32 (complex64 for complex leaves), a pytree like the parameters. Compressed
    #: leaves: this rank's momentum (differs between ranks). Uncompressed leaves: the momentum of
    #: the mean (the same on every rank). ``optax.MaskedNode()`` (no leaves) where no momentum is
    #: kept (``momentum=0``, non-float leaves).
    u: Any
    #: Accumulated velocity, float32, like the parameters for compressed leaves (this rank's),
    #: ``optax.MaskedNode()`` for the others.
    v: Any


def _is_compressed(x, min_size: int) -> bool:
    """Real floating leaves with ``ndim >= 1`` and at least ``min_size`` elements, and at least one
    (an empty leaf has nothing to select; not complex)."""
    shape = jnp.shape(x)
    return (len(shape) >= 1 and math.prod(shape) >= max(min_size, 1)
            and jnp.issubdtype(jnp.result_type(x), jnp.floating))


def _check_precision(tree, min_size: int, use_momentum: bool) -> None:
    """Refuse 64-bit leaves top-k would touch: their momentum and velocity are kept, and their
    values sent, in 32 bits (a float64 mean would come back ~1e-7 off, silently), as
    ``compressed_mean``, ``sharded`` and the jit helper refuse them."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = jnp.result_type(leaf)
        wide = dtype in (jnp.dtype(jnp.float64), jnp.dtype(jnp.complex128))
        if wide and (_is_compressed(leaf, min_size) or use_momentum):
            raise TypeError(
                f"topk_mean: leaf {jax.tree_util.keystr(path)} has dtype {dtype}, which top-k keeps and sends in 32 "
                "bits (its mean would be ~1e-7 off, silently): cast the parameters to float32 (or bfloat16), as "
                "jax_cgx's other transformations need")


def _momentum_dtype(dtype):
    """The dtype of a leaf's momentum: complex64 for complex leaves, float32 for real ones, else None."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.complex64
    return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) else None


def topk_mean(
    axis_name,
    ratio: float = 0.001,
    *,
    sample_ratio: float = 0.01,
    momentum: float = 0.9,
    nesterov: bool = False,
    warmup_steps: int = 0,
    warmup_ratios: tuple = (0.25, 0.0625, 0.015625, 0.004),
    min_size: int = 1024,
    seed: int = 0,
) -> optax.GradientTransformation:
    """The mean over ``axis_name`` of top-k sparsified, momentum-corrected, locally accumulated gradients.

    Deep Gradient Compression (see the module docstring for the exact algorithm). Use inside
    ``jax.shard_map`` / ``jax.pmap`` where ``axis_name`` (a name or a tuple of names) is
    bound, in place of ``lax.pmean`` of the gradients, followed by plain SGD (the momentum
    is applied here, to every leaf).

    Args:
      axis_name: the mapped axis (or axes) to average over.
      ratio: fraction of each compressed leaf's elements a rank sends per step (density),
        in (0, 1]. DGC's 99.9% sparsity is ``ratio=0.001``.
      sample_ratio: fraction of the elements sampled (with replacement) to estimate the
        threshold, in (0, 1]; at least ``ceil(2 / ratio)`` are sampled; when that reaches
        the leaf's size the threshold is exact.
      momentum: momentum of the momentum correction (0 disables it and its state).
      nesterov: Nesterov momentum.
      warmup_steps: DGC's sparsity warm-up: ``warmup_ratios[i]`` is used for steps
        ``[i * warmup_steps, (i + 1) * warmup_steps)``, ``ratio`` after. 0: no warm-up.
      warmup_ratios: densities of the warm-up phases (DGC: 75%, 93.75%, 98.4375%, 99.6%
        sparsity).
      min_size: leaves with fewer elements (and scalars, non-float leaves) are averaged
        exactly (``lax.pmean``).
      seed: seed of the threshold sampling.

    Returns:
      An ``optax.GradientTransformation``: ``init(params)`` makes a :class:`TopKState`;
      ``update(updates, state, params=None)`` returns ``(mean, new_state)``, the momentum-corrected
      mean a pytree like the updates, bitwise the same on every rank. Both raise a ``TypeError`` for
      a float64 or complex128 leaf that top-k would keep or send (in 32 bits).

    Raises:
      ValueError: ``ratio``, ``sample_ratio`` or (with ``warmup_steps``) an entry of
        ``warmup_ratios`` not in (0, 1]; ``warmup_ratios`` empty (with ``warmup_steps``); ``momentum``
        not in [0, 1); ``nesterov`` not a bool, or True with ``momentum=0``;
        ``warmup_steps`` not an integer >= 0; ``min_size`` not an integer >= 1; ``seed`` not an
        integer in the int64 range; ``axis_name`` empty or not axis names.

    The state (:class:`TopKState`) is per rank. Under ``jax.pmap`` that is automatic; across
    ``jax.shard_map`` calls give it the specs of :func:`jax_cgx.optax.state_specs` (or keep the
    training loop inside one ``shard_map``). ``init`` uses no collective.
    """
    fn = "topk_mean"
    ratio = checks.check_real(fn, "ratio", ratio, low=0.0, high=1.0, low_open=True)
    sample_ratio = checks.check_real(fn, "sample_ratio", sample_ratio, low=0.0, high=1.0, low_open=True)
    momentum = checks.check_real(fn, "momentum", momentum, low=0.0)
    if momentum >= 1.0:  # u = momentum * u + g would grow without bound
        raise ValueError(f"{fn}: momentum must be in [0, 1) (DGC's is 0.9), got {momentum}: at 1 or more the "
                         "momentum grows without bound")
    nesterov = checks.check_bool(fn, "nesterov", nesterov)
    if nesterov and momentum == 0.0:
        raise ValueError("topk_mean: nesterov needs momentum > 0")
    warmup_steps = checks.check_int(fn, "warmup_steps", warmup_steps, minimum=0)
    min_size = checks.check_int(fn, "min_size", min_size, minimum=1)
    seed = checks.check_seed(fn, seed)
    if warmup_steps:
        given = warmup_ratios
        iterable = np.iterable(given) and not isinstance(given, (str, bytes))
        warmup_ratios = tuple(given) if iterable else ()
        if not warmup_ratios:
            raise ValueError(f"topk_mean: warmup_ratios must be a non-empty tuple of densities, got {given!r}")
        warmup_ratios = tuple(
            checks.check_real(fn, f"warmup_ratios[{i}]", r, low=0.0, high=1.0, low_open=True)
            for i, r in enumerate(warmup_ratios)
        )
    axes = checks.check_axes(fn, axis_name)
    ratios = (warmup_ratios if warmup_steps else ()) + (ratio,)
    use_momentum = momentum != 0.0

    def keeps_momentum(x) -> bool:
        # Not for an empty leaf: nothing to keep, and orbax refuses to save a zero-size array.
        return use_momentum and _momentum_dtype(jnp.result_type(x)) is not None and math.prod(jnp.shape(x)) > 0

    def init_fn(params):
        _check_precision(params, min_size, use_momentum)

        def u0(p):
            dtype = _momentum_dtype(jnp.result_type(p))
            if keeps_momentum(p):  # per rank where the leaf is compressed, else a mean's
                z = jnp.zeros(jnp.shape(p), dtype)
                return checks.typed_like(z, p, axes, per_rank=_is_compressed(p, min_size))
            return checks.placeholder()

        def v0(p):
            if _is_compressed(p, min_size):
                return checks.typed_like(jnp.zeros(jnp.shape(p), jnp.float32), p, axes, per_rank=True)
            return checks.placeholder()

        return TopKState(jnp.zeros((), jnp.int32), jax.tree.map(u0, params), jax.tree.map(v0, params))

    def u_shape(g):
        return jnp.shape(g) if keeps_momentum(g) else checks.PLACEHOLDER_SHAPE

    def v_shape(g):
        return jnp.shape(g) if _is_compressed(g, min_size) else checks.PLACEHOLDER_SHAPE

    def update_fn(updates, state, params=None):
        del params
        checks.check_state_type(fn, state, TopKState)
        checks.check_count(fn, state.count)
        _check_precision(updates, min_size, use_momentum)
        us = checks.state_leaves(fn, "u", updates, state.u, u_shape)
        vs = checks.state_leaves(fn, "v", updates, state.v, v_shape)
        count = state.count
        if warmup_steps:
            phase = jnp.minimum(count // warmup_steps, len(warmup_ratios))
        else:
            phase = jnp.zeros((), jnp.int32)
        rank = lax.axis_index(axes)
        world = math.prod(lax.axis_size(a) for a in axes)
        step_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), count), rank)

        leaves, treedef = jax.tree.flatten(updates)
        out, new_u, new_v = [], [], []
        for i, (g, u, v) in enumerate(zip(leaves, us, vs)):
            if _is_compressed(g, min_size):
                plan = leaf_plan(int(np.prod(g.shape)), ratios, sample_ratio)
                leaf_key = jax.random.fold_in(step_key, i)
                o, u, v = _compressed_leaf(
                    g, u, v, plan, phase, leaf_key, axes, world, momentum, nesterov, use_momentum
                )
            else:
                o, u = _small_leaf(g, u, axes, momentum, nesterov, keeps_momentum(g))
            out.append(o)
            new_u.append(u)
            new_v.append(v)
        # A non-finite mean (some rank's gradient had an inf or NaN; the mean is the same on
        # every rank) leaves the whole state unchanged on every rank, as apply_if_finite would.
        finite = checks.step_is_finite(out, count, axes)

        def keep_if_finite(new, old):
            return old if checks.is_placeholder(old) else jnp.where(finite, new, old)

        new_state = TopKState(
            jnp.where(finite, optax.safe_int32_increment(count), count),
            treedef.unflatten([keep_if_finite(a, b) for a, b in zip(new_u, us)]),
            treedef.unflatten([keep_if_finite(a, b) for a, b in zip(new_v, vs)]),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def _small_leaf(g, u, axes, momentum, nesterov, use_momentum):
    mean = lax.pmean(g, axes)
    dtype = _momentum_dtype(g.dtype)
    if not (use_momentum and dtype is not None):
        return mean, u
    m32 = mean.astype(dtype)
    u = momentum * u + m32
    out = m32 + momentum * u if nesterov else u
    return out.astype(g.dtype), u


def _compressed_leaf(g, u, v, plan: LeafPlan, phase, key, axes, world, momentum, nesterov, use_momentum):
    g32 = g.astype(jnp.float32).reshape(-1)
    v = v.reshape(-1)
    if use_momentum:
        u = momentum * u.reshape(-1) + g32
        v = v + (g32 + momentum * u if nesterov else u)
    else:
        v = v + g32
    # A non-finite gradient on any rank makes the mean non-finite on every rank (as pmean
    # would), so optax.apply_if_finite sees it even when the bad element is not selected. The
    # accumulator, not the gradient, is checked: a finite gradient can overflow it (3e38 with
    # momentum), and an inf left unsent would be selected, and poison the mean, ever after.
    bad = ~jnp.all(jnp.isfinite(v))
    mean, u, v = exchange(u, v, bad, plan, phase, key, axes, world, use_momentum)
    if use_momentum:
        u = u.reshape(g.shape)
    return mean.reshape(g.shape).astype(g.dtype), u, v.reshape(g.shape)


def topk_bytes(params, world: int, ratio: float = 0.001, min_size: int = 1024) -> int:
    """Bytes one rank sends per step with :func:`topk_mean` at density ``ratio``.

    A compressed leaf (``size >= min_size``, ``ndim >= 1``, real float) sends
    ``k = ceil(ratio * n)`` slots of a float32 value and an int32 index through an all-gather: ``(world - 1) * k * 8``.
    Uncompressed leaves count as a bandwidth-optimal all-reduce: ``2 (world - 1) / world`` of
    their bytes (rounded up), and so do compressed leaves where ``k == n`` (then float32).
    During warm-up phase ``i`` pass ``ratio=warmup_ratios[i]``. ``params``: arrays or
    ``jax.ShapeDtypeStruct``.

    Args:
      params: the parameters (or gradients): a pytree of arrays or ``jax.ShapeDtypeStruct`` objects.
      world: the number of ranks the mean is over.
      ratio: the density, as for :func:`topk_mean`, in (0, 1].
      min_size: as for :func:`topk_mean`: which leaves are compressed.

    Returns:
      The bytes one rank sends per step, an ``int``; 0 for ``world=1``.

    Raises:
      ValueError: ``world`` not an integer >= 1; ``ratio`` not in (0, 1]; ``min_size`` not an
        integer >= 1.

    Examples:
      >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32), "b": jax.ShapeDtypeStruct((1024,), jnp.float32)}
      >>> jax_cgx.optax.topk_bytes(params, world=8, ratio=0.001)
      58856
    """
    world = checks.check_int("topk_bytes", "world", world, minimum=1)
    ratio = checks.check_real("topk_bytes", "ratio", ratio, low=0.0, high=1.0, low_open=True)
    min_size = checks.check_int("topk_bytes", "min_size", min_size, minimum=1)
    sparse, dense = 0, 0
    for p in jax.tree.leaves(params):
        n = math.prod(jnp.shape(p))
        if _is_compressed(p, min_size) and ceil_count(ratio, n) < n:
            sparse += (world - 1) * ceil_count(ratio, n) * 8
        elif _is_compressed(p, min_size):
            dense += n * 4
        else:
            dense += n * jnp.dtype(jnp.result_type(p)).itemsize
    return sparse + -(-2 * (world - 1) * dense // world)
