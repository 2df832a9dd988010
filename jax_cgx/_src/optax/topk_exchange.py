"""One compressed leaf's exchange in :func:`jax_cgx.optax.topk_mean`: steps 2-5 of DGC.

Given a rank's flat accumulated velocity ``v`` (float32, already momentum-corrected by
``_topk``), :func:`exchange` picks at most ``k_t`` of its elements by a sampled threshold
with DGC's adaptation, sends their values and indices through one ``all_gather``, returns
the mean of every rank's contribution as a dense array, and zeroes what was sent in ``u``
and ``v`` (momentum factor masking). See ``jax_cgx/_src/optax/topk.py``'s docstring for the
algorithm as a whole.

Every size here is static, planned once per leaf by :func:`leaf_plan`: each density of the
schedule is its own ``lax.switch`` branch with its own ``k_t``, so a step always transmits
exactly ``k_t`` slots, padded with value 0 at the out-of-range index ``n``, which every
scatter drops.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_cgx._src.compat import all_gather_invariant
from jax_cgx._src.optax import checks

__all__ = ["LeafPlan", "ceil_count", "leaf_plan", "exchange", "first_true"]

# DGC's threshold adaptation (dgc/compression.py defaults).
_LOWER_BOUND = 0.8
_UPPER_BOUND = 1.3
_MAX_ADAPTATION_ITERS = 10


def ceil_count(r: float, n: int) -> int:
    """``ceil(r * n)`` elements of ``n`` at density ``r``, at least 1 and at most ``n``."""
    return min(n, max(1, math.ceil(round(r * n, 6))))  # round: 0.07 * 100 is 7, not 8


class LeafPlan(NamedTuple):
    """Static sizes of one compressed leaf."""

    n: int
    k_table: tuple  # k_t per phase
    num_samples: int  # s; == n: exact threshold
    ks_table: tuple  # top-k of the samples per phase


def leaf_plan(n: int, ratios: tuple, sample_ratio: float) -> LeafPlan:
    k_table = tuple(ceil_count(r, n) for r in ratios)
    # DGC: at least ceil(2 / ratio) samples, so the sample's top-k has >= 2 elements.
    s = max(math.ceil(sample_ratio * n), max(math.ceil(2.0 / r) for r in ratios))
    s = n if s >= n else s
    ks_table = tuple(ceil_count(r, s) for r in ratios)
    return LeafPlan(n, k_table, s, ks_table)


def exchange(u, v, bad, plan: LeafPlan, phase, key, axes, world, use_momentum):
    """The mean over ``axes`` of every rank's selection of the flat ``v``, and the masked ``(u, v)``.

    ``bad``: this rank's ``v`` is not finite (its selection then poisons the mean on every rank).
    """
    # One branch per distinct ratio, each with its own static k: a step sends exactly
    # ceil(ratio_t * n) slots. All ranks take the same branch (the phase depends on the count).
    distinct = sorted(set(zip(plan.k_table, plan.ks_table)), reverse=True)
    branches = [
        (lambda u, v: _dense_exchange(u, v, axes))
        if k == plan.n
        else (lambda u, v, k=k, ks=ks: _select_and_exchange(u, v, bad, plan, k, ks, key, axes, world, use_momentum))
        for k, ks in distinct
    ]
    if len(branches) == 1:
        return branches[0](u, v)
    branch_of_phase = jnp.asarray([distinct.index(kk) for kk in zip(plan.k_table, plan.ks_table)], jnp.int32)
    return lax.switch(branch_of_phase[phase], branches, u, v)


def _dense_exchange(u, v, axes):
    """Density 1: everything is sent (an exact pmean of v); u is not masked.

    With nothing delayed there is nothing stale to mask, and this makes ``ratio=1`` exactly
    momentum SGD on the mean (the mean of the ranks' momenta is the momentum of the mean),
    which is what DGC's reference does with ``compress_ratio=1`` (no compression).
    """
    return lax.pmean(v, axes), u, jnp.zeros_like(v)


def _select_and_exchange(u, v, bad, plan: LeafPlan, k: int, ks: int, key, axes, world, use_momentum):
    """Select up to ``k`` elements of ``v`` (flat), exchange them, mask them: (mean, u, v)."""
    n = plan.n
    absv = jnp.abs(v)

    # Threshold from a sample of |v| (exact when the sample is the whole leaf).
    if plan.num_samples == n:
        samples = absv
    else:
        samples = absv[jax.random.randint(key, (plan.num_samples,), 0, n)]
    thr = lax.top_k(samples, ks)[0][ks - 1]

    def n_above(t):
        return jnp.sum((absv >= t) & (absv > 0), dtype=jnp.int32)

    count = n_above(thr)
    if plan.num_samples < n:
        # DGC: a sampled threshold that passes too few elements is lowered, at most 10 times.
        def cond(c):
            _, cnt, it = c
            return (cnt < math.ceil(_LOWER_BOUND * k)) & (it < _MAX_ADAPTATION_ITERS)

        def body(c):
            t, _, it = c
            t = t * _LOWER_BOUND
            return t, n_above(t), it + 1

        thr, count, _ = lax.while_loop(cond, body, (thr, count, jnp.zeros((), jnp.int32)))

    def exact_top_k(_):
        # More than 1.3 k candidates: the exact top-k of |v| (all of them candidates).
        return lax.top_k(absv, k)[1].astype(jnp.int32)

    def first_candidates(_):
        mask = (absv >= thr) & (absv > 0)
        return first_true(mask, k)

    idx = lax.cond(count > math.floor(_UPPER_BOUND * k), exact_top_k, first_candidates, None)
    slots = jnp.arange(k, dtype=jnp.int32)
    valid = slots < jnp.minimum(count, k)  # the top-k branch has count > k
    idx = jnp.where(valid, idx, n)  # unused slots: index n (dropped by the scatters), value 0
    vals = jnp.where(valid, v.at[idx].get(mode="fill", fill_value=0.0), 0.0)
    vals = jnp.where(bad, jnp.nan, vals)
    idx = jnp.where(bad, slots, idx)

    # Momentum factor masking: what was sent leaves u and v.
    v = v.at[idx].set(0.0, mode="drop")
    if use_momentum:
        u = u.at[idx].set(0.0, mode="drop")

    # One all-gather per leaf: the values' bits and the indices, as int32[2k] per rank.
    packed = jnp.concatenate([lax.bitcast_convert_type(vals, jnp.int32), idx])
    gathered = all_gather_invariant(packed, axes)  # [world * 2k], rank-major

    def add_rank(r, dense):
        sl_v = lax.bitcast_convert_type(lax.dynamic_slice_in_dim(gathered, 2 * r * k, k), jnp.float32)
        sl_i = lax.dynamic_slice_in_dim(gathered, 2 * r * k + k, k)
        return dense.at[sl_i].add(sl_v, mode="drop")

    # The sum varies over what the gathered slots vary over (a 2-D mesh's other axis).
    zeros = checks.typed_like(jnp.zeros((n,), jnp.float32), gathered, axes, per_rank=False)
    dense = lax.fori_loop(0, world, add_rank, zeros)
    return dense / world, u, v


def first_true(mask, k: int, block: int = 1024):
    """The indices of the first ``k`` True elements of the 1-D ``mask``, padded with ``n``.

    ``jnp.nonzero(mask, size=k, fill_value=n)``, with a two-level prefix sum (rows of
    ``block``, then the row totals): 3-4x faster than ``jnp.nonzero`` on CPU at 1M elements.
    """
    n = mask.shape[0]
    pad = -n % block
    rows = jnp.pad(mask, (0, pad)).reshape(-1, block).astype(jnp.int32)
    within = jnp.cumsum(rows, axis=1)
    before = jnp.cumsum(within[:, -1]) - within[:, -1]
    pos = (within + before[:, None]).reshape(-1)[:n] - 1  # rank among the True elements
    target = jnp.where(mask & (pos < k), pos, k)
    return jnp.full((k,), n, jnp.int32).at[target].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
