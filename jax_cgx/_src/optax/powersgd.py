"""PowerSGD gradient averaging: PyTorch's DDP ``powerSGD_hook`` as an optax transformation.

``powersgd_mean(axis_name, rank)`` replaces ``lax.pmean(grads, axis_name)`` with a rank-``r``
approximation of the mean (Vogels et al., *PowerSGD*, NeurIPS 2019), with the semantics of
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook``:

- the first ``start_iter`` steps are a plain ``lax.pmean`` (PyTorch's warm-up with vanilla
  all-reduce); the state's ``q`` and ``error`` are left untouched then;
- leaves with ``ndim <= 1``, non-floating leaves, and matrices that would not shrink enough are
  averaged uncompressed (``lax.pmean`` in their own dtype). A leaf of shape ``(n, *rest)`` is
  viewed as the matrix ``[n, m]``, ``m = prod(rest)`` (``tensor.view(n, -1)``), and compressed
  when ``(n + m) * r * min_compression_rate < n * m`` with ``r = min(rank, n, m)`` (PyTorch's
  ``_should_compress``, strict);
- for a compressed matrix, in float32, on every rank::

      M = G + E                      (error feedback; E = 0 at first)
      Q = previous step's Q          (warm start; else a fresh seeded normal, orthogonalized)
      P = psum(M Q)                  (PyTorch all-reduces P without dividing it)
      P = gram_schmidt(P, epsilon)   (each column: col / (||col|| + epsilon), then projected out)
      Q = pmean(M^T P)
      out = P Q^T                    (the same on every rank: the estimate of the mean)
      E = M - out                    (error feedback; ``out`` as applied, after the cast to the
                                      leaf's dtype)

The state is ``PowerSGDState(count, q, error)``:

- ``count``: int32 scalar, the number of finite updates so far (warm-up while
  ``count < start_iter``);
- ``q``: a pytree like the gradients. A compressed leaf's entry is its ``[m, r]`` float32 ``Q``
  (the same on every rank) when ``warm_start``; every other entry is ``optax.MaskedNode()``
  (no leaves);
- ``error``: a pytree like the gradients. A compressed leaf's entry is its local error
  ``M - P Q^T`` in float32, in the leaf's shape (different on every rank) when
  ``error_feedback``; every other entry is ``optax.MaskedNode()``.

Shapes and dtypes never change across steps. ``count`` and ``q`` are replicated; ``error`` is
per-rank: under ``jax.shard_map`` give it the spec ``P(axis_name)`` (each rank's error is a slice
of a global array stacked along the leaf's first dimension)
and ``count``/``q`` the spec ``P()``, as :func:`jax_cgx.optax.state_specs` gives them (for this
state alone or inside any optax state); under ``jax.pmap`` every state leaf has the device axis.

Non-finite steps: an inf or NaN in any rank's gradient makes that step's mean non-finite on
every rank (a rank whose local matrix is non-finite sends NaN into the all-reduce of P, and its
NaN or inf also reaches the all-reduce of Q), and such a step leaves the whole state
(``count``, ``q``, ``error``) bitwise unchanged, on every rank alike: the next finite step gives
exactly the update it would have given had the bad step never happened. To skip such steps put
``optax.apply_if_finite`` *after* ``powersgd_mean``, around the optimizer. Wrapped itself in
``optax.apply_if_finite`` (or anything that branches on the local gradients), every rank must
take the same branch: the update holds collectives.

``update`` raises a ``ValueError`` naming the leaf and both shapes when the state does not belong
to the updates (built for other parameters, another ``rank``, ``min_compression_rate``,
``warm_start`` or ``error_feedback``, or given the wrong ``shard_map`` specs). Complex leaves
are non-floating: averaged uncompressed (exactly).

Where this differs from PyTorch:

- the random Qs come from ``jax.random`` (seeded by ``seed`` and the step count), not from
  torch's generator, so the values differ; like PyTorch's, they are the same on every rank, new
  at every step, and orthogonalized before use. The warm-start Q of ``init`` is the one the
  first compressed step would draw, so that step is the same with and without ``warm_start``;
- Gram-Schmidt at every rank (PyTorch switches to ``torch.linalg.qr``, which ignores
  ``epsilon``, for rank > 2 in float32): the columns may differ in sign, P Q^T does not;
- with ``epsilon == 0`` a zero column of P stays zero (PyTorch divides by zero: NaN); a Q
  column that is exactly zero (M^T P = 0, e.g. a zero gradient at a step) restarts from the
  fresh seeded column at the next step instead of staying zero forever;
- the arithmetic is float32 whatever the gradients' dtype (PyTorch computes in the bucket's
  dtype), and the error is ``M - out`` with ``out`` as applied (rounded to the leaf's dtype);
- uncompressed leaves keep no error: in PyTorch they share the bucket's error feedback, whose
  mean over ranks is zero for them, so the result is the same up to rounding;
- ``start_iter`` may be 0 or 1 (PyTorch needs > 1 with error feedback or warm start, for
  DDP's bucket rebuild); the count is per finite ``update`` call, not per DDP iteration over
  buckets;
- a non-finite step leaves the state unchanged (in PyTorch the error and the warm-start Q turn
  NaN, and every later step with them).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jax_cgx._src import compat
from jax_cgx._src.optax import checks

__all__ = ["PowerSGDState", "powersgd_mean", "powersgd_bytes"]


class PowerSGDState(NamedTuple):
    """State of :func:`powersgd_mean` (see the module docstring for the layout)."""

    #: The number of updates so far (an int32 scalar).
    count: jax.Array
    #: The warm start, a pytree like the gradients (``[m, r]`` float32 per compressed leaf, else
    #: ``optax.MaskedNode()``).
    q: Any
    #: This rank's error feedback, a pytree like the gradients (leaf-shaped float32 per compressed
    #: leaf, else ``optax.MaskedNode()``).
    error: Any


def _plan(shape, dtype, rank: int, min_compression_rate: float):
    """``(n, m, r)`` if a leaf of this shape and dtype is compressed, else None (PyTorch's rule)."""
    if len(shape) <= 1 or not jnp.issubdtype(dtype, jnp.floating):
        return None
    n = int(shape[0])
    m = math.prod(int(d) for d in shape[1:])
    r = min(rank, n, m)
    # torch: compressed_size * min_compression_rate < uncompressed_size
    if not (n + m) * r * min_compression_rate < n * m:
        return None
    return n, m, r


_HIGHEST = lax.Precision.HIGHEST


def _matmul(a, b):
    # Full float32 products (no TF32/bf16 passes on GPUs), as PyTorch's default matmul.
    return jnp.matmul(a, b, precision=_HIGHEST)


def _orthogonalize(x: jax.Array, epsilon: float) -> jax.Array:
    """PyTorch's modified Gram-Schmidt on the columns of ``x`` ([k, r], float32).

    Column i becomes ``col / (||col|| + epsilon)`` and is projected out of the columns after
    it. With ``epsilon == 0`` a zero column stays zero (PyTorch would produce NaNs).
    """
    cols = [x[:, i] for i in range(x.shape[1])]
    for i in range(len(cols)):
        norm = jnp.linalg.norm(cols[i])
        if epsilon == 0:
            col = jnp.where(norm > 0, cols[i] / jnp.where(norm > 0, norm, 1.0), 0.0)
        else:
            col = cols[i] / (norm + epsilon)
        cols[i] = col
        for j in range(i + 1, len(cols)):
            cols[j] = cols[j] - jnp.dot(col, cols[j], precision=_HIGHEST) * col
    return jnp.stack(cols, axis=1)


@functools.partial(jax.jit, static_argnames=("seed", "sizes", "epsilon"))
def _fresh_qs(count, *, seed: int, sizes: tuple, epsilon: float) -> list:
    """Seeded normal ``[m, r]`` Qs, orthogonalized: the same on every rank, new for every count.

    One draw of ``sum(m * r)`` normals, cut in order (``sizes``: the ``(m, r)`` of every
    compressed leaf, in flatten order), so the random number generator is compiled once.
    """
    key = jax.random.fold_in(jax.random.key(seed), count)
    z = jax.random.normal(key, (sum(m * r for m, r in sizes),), jnp.float32)
    qs, offset = [], 0
    for m, r in sizes:
        qs.append(_orthogonalize(z[offset : offset + m * r].reshape(m, r), epsilon))
        offset += m * r
    return qs


def _power_iteration(mat: jax.Array, q: jax.Array, axis_name, epsilon: float) -> tuple[jax.Array, jax.Array]:
    """One step of the power iteration on this rank's ``mat[n, m]`` from ``q[m, r]``:
    ``P = orthogonalize(psum(M Q))``, ``Q' = pmean(M^T P)``; returns the rank-``r`` estimate of the
    mean ``P Q'^T`` (float32 ``[n, m]``) and ``Q'``. A non-finite local matrix sends NaN, so every
    rank sees it in P (and in Q': the estimate is non-finite everywhere, whatever Gram-Schmidt does
    with a NaN column)."""
    mq = jnp.where(jnp.all(jnp.isfinite(mat)), _matmul(mat, q), jnp.nan)
    p = _orthogonalize(lax.psum(mq, axis_name), epsilon)
    q = lax.pmean(_matmul(mat.T, p), axis_name)
    return _matmul(p, q.T), q


def _kept_unless(finite, old: list, idx: list, new: list | None) -> list:
    """``old`` (a state's leaves) with leaf ``idx[k]`` replaced by ``new[k]`` where the step is
    ``finite``, kept where it is not; ``new`` None: the state part is unused, ``old`` as it is."""
    out = list(old)
    if new is not None:
        for k, i in enumerate(idx):
            out[i] = jnp.where(finite, new[k], old[i])
    return out


def _varying(x) -> frozenset:
    return compat.varying_axes(jax.typeof(x))


def _cast_varying(x, target: frozenset):
    """Mark ``x`` varying over the axes of ``target`` it is not varying over yet (shard_map)."""
    return compat.ensure_varying(x, tuple(sorted(target)))


def powersgd_mean(
    axis_name,
    rank: int = 1,
    *,
    start_iter: int = 10,
    min_compression_rate: float = 2.0,
    error_feedback: bool = True,
    warm_start: bool = True,
    orthogonalization_epsilon: float = 0.0,
    seed: int = 0,
) -> optax.GradientTransformation:
    """The mean of the gradients over ``axis_name``, PowerSGD-compressed (PyTorch's powerSGD_hook).

    Args:
      axis_name: the mapped axis (or tuple of axes) to average over; bound by ``jax.shard_map``
        or ``jax.pmap`` around the ``update`` call.
      rank: the approximation rank (PyTorch's ``matrix_approximation_rank``).
      start_iter: updates done as a plain ``lax.pmean`` first (``start_powerSGD_iter``).
      min_compression_rate: a matrix is compressed only when ``n*m > rate * r*(n+m)``.
      error_feedback: add the previous step's local error before compressing
        (``use_error_feedback``).
      warm_start: start the power iteration from the previous step's Q (``warm_start``); else
        from a fresh seeded normal each step.
      orthogonalization_epsilon: added to the column norms in Gram-Schmidt.
      seed: seeds the random Qs (the same on every rank).

    Returns:
      An ``optax.GradientTransformation`` with state :class:`PowerSGDState`. ``init`` uses no
      collectives (call it anywhere); ``update`` must run where ``axis_name`` is bound and
      returns the same updates on every rank, in the gradients' dtypes.

    Raises:
      ValueError: ``rank`` not an integer >= 1; ``start_iter`` not an integer >= 0;
        ``min_compression_rate`` or ``orthogonalization_epsilon`` not a finite real >= 0;
        ``error_feedback`` or ``warm_start`` not a bool; ``seed`` not an integer in the int64 range;
        ``axis_name`` empty or not axis names.
    """
    fn = "powersgd_mean"
    rank = checks.check_int(fn, "rank", rank, minimum=1)
    start_iter = checks.check_int(fn, "start_iter", start_iter, minimum=0)
    min_compression_rate = checks.check_real(fn, "min_compression_rate", min_compression_rate, low=0.0)
    eps = checks.check_real(fn, "orthogonalization_epsilon", orthogonalization_epsilon, low=0.0)
    error_feedback = checks.check_bool(fn, "error_feedback", error_feedback)
    warm_start = checks.check_bool(fn, "warm_start", warm_start)
    seed = checks.check_seed(fn, seed)
    axes = checks.check_axes(fn, axis_name)
    axis_set = frozenset(axes)

    def plan_of(x):
        return _plan(jnp.shape(x), jnp.result_type(x), rank, min_compression_rate)

    def init_fn(params):
        leaves, treedef = jax.tree.flatten(params)
        plans = [plan_of(x) for x in leaves]
        idx = [i for i, plan in enumerate(plans) if plan is not None]
        qs = [checks.placeholder() for _ in leaves]
        if warm_start and idx:
            fresh = _fresh_qs(start_iter, seed=seed, sizes=tuple(plans[i][1:] for i in idx), epsilon=eps)
            for i, q in zip(idx, fresh):
                qs[i] = checks.typed_like(q, leaves[i], axes, per_rank=False)  # a mean: the same on every rank
        errors = [
            checks.typed_like(jnp.zeros(jnp.shape(x), jnp.float32), x, axes, per_rank=True)
            if plan is not None and error_feedback else checks.placeholder()
            for x, plan in zip(leaves, plans)
        ]
        return PowerSGDState(count=jnp.zeros([], jnp.int32), q=treedef.unflatten(qs), error=treedef.unflatten(errors))

    def q_shape(x):
        plan = plan_of(x)
        return plan[1:] if plan is not None and warm_start else checks.PLACEHOLDER_SHAPE

    def error_shape(x):
        return jnp.shape(x) if plan_of(x) is not None and error_feedback else checks.PLACEHOLDER_SHAPE

    def update_fn(updates, state, params=None):
        del params
        checks.check_state_type(fn, state, PowerSGDState)
        checks.check_count(fn, state.count)
        q_leaves = checks.state_leaves(fn, "q", updates, state.q, q_shape)
        e_leaves = checks.state_leaves(fn, "error", updates, state.error, error_shape)
        compat.check_axis_names(axes, fn)
        leaves, treedef = jax.tree.flatten(updates)
        plans = [plan_of(x) for x in leaves]
        out = [None if plan is not None else lax.pmean(x, axis_name) for x, plan in zip(leaves, plans)]
        idx = [i for i, plan in enumerate(plans) if plan is not None]
        new_count = optax.safe_increment(state.count)
        if not idx:
            finite = checks.step_is_finite(out, state.count, axes)
            return treedef.unflatten(out), state._replace(count=jnp.where(finite, new_count, state.count))

        grads = [leaves[i] for i in idx]
        qs = [q_leaves[i] for i in idx] if warm_start else None
        errs = [e_leaves[i] for i in idx] if error_feedback else None

        # Under shard_map(check_vma=True) both cond branches must agree on which axes each
        # output varies over: take the union of what the inputs vary over.
        vma = compat.check_vma_enabled()
        if vma:
            t_in = []
            for k, i in enumerate(idx):
                s = _varying(grads[k])
                s |= _varying(qs[k]) if warm_start else frozenset()
                s |= _varying(errs[k]) if error_feedback else frozenset()
                t_in.append(s)
            t_out = [s - axis_set for s in t_in]
            t_q = [t_out[k] | (_varying(qs[k]) if warm_start else frozenset()) for k in range(len(idx))]

        def compressed(operands):
            grads, qs, errs = operands
            fresh = _fresh_qs(state.count, seed=seed, sizes=tuple(plans[i][1:] for i in idx), epsilon=eps)
            outs, new_qs, new_errs = [], [], []
            for k, i in enumerate(idx):
                g = grads[k]
                n, m, r = plans[i]
                mat = g.astype(jnp.float32).reshape(n, m)
                if error_feedback:
                    mat = mat + errs[k].reshape(n, m)
                if warm_start:
                    # A Q column that is exactly zero (M^T P = 0, e.g. a zero gradient) would stay
                    # zero forever; restart it from the fresh seeded column.
                    dead = jnp.all(qs[k] == 0, axis=0, keepdims=True)
                    q = jnp.where(dead, fresh[k], qs[k])
                else:
                    q = fresh[k]
                estimate, q = _power_iteration(mat, q, axis_name, eps)
                o = estimate.reshape(g.shape).astype(g.dtype)
                outs.append(o)
                new_qs.append(q)
                if error_feedback:
                    # What was not applied (for bfloat16/float16 leaves, the output's rounding too).
                    new_errs.append(mat.reshape(g.shape) - o.astype(jnp.float32))
            return finish(outs, new_qs, new_errs)

        def warmup(operands):
            grads, qs, errs = operands
            return finish([lax.pmean(g, axis_name) for g in grads], qs, errs)

        def finish(outs, new_qs, new_errs):
            if vma:
                outs = [_cast_varying(o, t) for o, t in zip(outs, t_out)]
                if warm_start:
                    new_qs = [_cast_varying(q, t) for q, t in zip(new_qs, t_q)]
                if error_feedback:
                    new_errs = [_cast_varying(e, t) for e, t in zip(new_errs, t_in)]
            return outs, (new_qs if warm_start else None), (new_errs if error_feedback else None)

        operands = (grads, qs, errs)
        if start_iter == 0:
            outs, new_qs, new_errs = compressed(operands)
        else:
            outs, new_qs, new_errs = lax.cond(state.count >= start_iter, compressed, warmup, operands)

        for k, i in enumerate(idx):
            out[i] = outs[k]
        # The means are the same on every rank: a non-finite step keeps the whole state, everywhere.
        finite = checks.step_is_finite(out, state.count, axes)
        new_state = PowerSGDState(
            count=jnp.where(finite, new_count, state.count),
            q=treedef.unflatten(_kept_unless(finite, q_leaves, idx, new_qs if warm_start else None)),
            error=treedef.unflatten(_kept_unless(finite, e_leaves, idx, new_errs if error_feedback else None)),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def powersgd_bytes(params, world: int, rank: int = 1, min_compression_rate: float = 2.0) -> int:
    """Bytes one rank sends per step of :func:`powersgd_mean` after the warm-up.

    Every all-reduce (P and Q of each compressed leaf, in float32; each uncompressed leaf in its
    own dtype) is counted as a bandwidth-optimal all-reduce: ``2 (world - 1) / world`` of its
    bytes. ``params`` may hold arrays or ``jax.ShapeDtypeStruct`` objects.

    Args:
      params: the parameters (or gradients): a pytree of arrays or ``jax.ShapeDtypeStruct`` objects.
      world: the number of ranks the mean is over.
      rank: the approximation rank, as for :func:`powersgd_mean`.
      min_compression_rate: as for :func:`powersgd_mean`: which leaves are compressed.

    Returns:
      The bytes one rank sends per step, an ``int`` (rounded down); 0 for ``world=1``.

    Raises:
      ValueError: ``world`` or ``rank`` not an integer >= 1; ``min_compression_rate`` not a finite
        real >= 0.

    Examples:
      >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32), "b": jax.ShapeDtypeStruct((1024,), jnp.float32)}
      >>> jax_cgx.optax.powersgd_bytes(params, world=8, rank=4)  # float32 pmean: 7,347,200
      64512
    """
    world = checks.check_int("powersgd_bytes", "world", world, minimum=1)
    rank = checks.check_int("powersgd_bytes", "rank", rank, minimum=1)
    min_compression_rate = checks.check_real("powersgd_bytes", "min_compression_rate", min_compression_rate, low=0.0)
    total = 0
    for x in jax.tree.leaves(params):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            x = np.asarray(x)
        shape, dtype = tuple(x.shape), np.dtype(x.dtype)
        plan = _plan(shape, dtype, rank, min_compression_rate)
        if plan is None:
            total += math.prod(shape) * dtype.itemsize
        else:
            n, m, r = plan
            total += (n + m) * r * 4
    return total * 2 * (world - 1) // world
