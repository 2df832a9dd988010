"""Per-leaf bit widths under a byte budget: :func:`choose_bits`.

Uniform widths leave quality on the table: a leaf whose buckets span a wide range loses more at
4 bits than a smooth one at 2. :func:`choose_bits` gives each leaf the width that minimizes the
total expected quantization error of the tree, with the bytes on the wire no more than a uniform
``budget_bits`` would send.

**The error model.** Max-min quantization of a bucket spanning ``[m, m + R]`` to ``b`` bits puts
each value on a grid of step ``s = R / (2^b - 1)``. A value a fraction ``f`` of a step above a grid
point errs by ``s min(f, 1 - f)`` under nearest rounding, and by ``s^2 f (1 - f)`` in expected square
under stochastic rounding. :func:`expected_errors` sums that over every value of a leaf, for every
candidate width: computed on the leaves' devices from the values themselves (one fused pass per
leaf and width), so heavy-tailed buckets, where most values sit in one grid cell, are weighed as
they are; the host receives one small array. (It leaves out the codec's rounding of each
bucket's scale to 16 bits, a relative change below ``2^-7`` per bucket, and the encoding of buckets
beyond ``2^125``.) A leaf sent exact (``None``: ``lax.psum`` in float32) has no error.

**The objectives** weigh those errors three ways: ``"squared"`` sums them; ``"relative"`` divides
each leaf's sum by the leaf's mean square; ``"adam"`` divides each value's error ``e`` by its own
square plus that error, ``e / (g^2 + e)``, and sums: the share of noise in the value's step when an
optimizer divides each value by its own running scale (Adam), at most 1 per value. Only the last
sees small values drowned in a bucket whose range large ones set.

**The bytes.** A quantized leaf of ``N`` values sends ``N b / 8`` bytes of payload and 8 per bucket;
an exact one ``4 N``. Every exchange (the SRA all_to_all and all_gather, or a ring all-reduce) moves
``2 (W - 1) / W`` times those bytes, so the comparison is the same for any number of ranks and
:func:`choose_bits` needs none.

**Bucket sizes.** With ``bucket_sizes``, a leaf's options are every (width, bucket size) pair: a
smaller bucket costs 8 bytes more per bucket but shrinks a heavy-tailed leaf's ranges (and makes
the all-zero buckets of an embedding's unused rows exact), a finer knob than whole bits
(docs/training.md). The budget stays uniform ``budget_bits`` at ``config``'s bucket size.

**The solver** is exact (:mod:`jax_cgx._src.adaptive.solver`). Its plan is compared with the uniform
``budget_bits`` plan (where that is a candidate) and the better one returned.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_cgx._src.adaptive.arguments import (
    OBJECTIVES,
    base_config,
    check_bucket_sizes,
    check_budget,
    check_candidates,
    check_objective,
    is_width,
)
from jax_cgx._src.adaptive.solver import solve
from jax_cgx._src.collectives.plan import lane
from jax_cgx._src.config import CompressionConfig

__all__ = ["CANDIDATES", "OBJECTIVES", "LeafPlan", "choose_bits", "describe", "expected_errors", "leaf_bytes",
           "leaf_errors"]

CANDIDATES = (2, 3, 4, 5, 6, 8)  # the widths a leaf may get, by default
EXACT = 32  # a leaf sent exact (config None), in a plan's "bits"
_META_BYTES = 8  # per bucket: its minimum and scale


class LeafPlan(NamedTuple):
    """One leaf's choice: its path, values, bits (``EXACT`` = 32: sent exact), predicted error,
    bytes and bucket size (None when sent exact).

    Made by :func:`choose_bits` (``return_plan=True``) and :class:`~jax_cgx.adaptive.Planner`
    (``Planner.plans``); a plan built by hand (to compare with one, or to pass to
    :func:`describe` or :func:`jax_cgx.explain`) takes the fields in order.

    Args:
      path: the leaf's path, as ``jax.tree_util.keystr`` writes it.
      size: its number of values.
      bits: its width, 1..8, or ``EXACT`` (32).
      error: its predicted error.
      bytes: the bytes it sends.
      bucket_size: its bucket size; None (the default) when sent exact.
    """

    #: The leaf's path in the pytree (``jax.tree_util.keystr``).
    path: str
    #: Its number of values.
    size: int
    #: The bits per value chosen (``EXACT``, 32: sent exact).
    bits: int
    #: The predicted error of the plan's objective for this leaf.
    error: float
    #: The bytes it sends (payload and bucket metadata).
    bytes: int
    #: The bucket size chosen (None when sent exact).
    bucket_size: int | None = None

    @property
    def choice(self) -> tuple[int, int | None]:
        """``(bits, bucket_size)``: what a plan is compared and keyed by."""
        return self.bits, self.bucket_size


def leaf_bytes(size: int, bits: float, bucket_size: int | None) -> int:
    """Bytes of a leaf of ``size`` values sent at ``bits`` in buckets of ``bucket_size`` (``EXACT``:
    float32, no metadata, any bucket size; a fractional width: the budget of a uniform one), as
    :func:`choose_bits` counts them.

    Args:
      size: the leaf's number of values.
      bits: bits per value (``EXACT``, 32: sent exact in float32).
      bucket_size: values per bucket; ignored (may be None) for ``EXACT``.

    Returns:
      ``ceil(size * bits / 8)`` payload bytes plus 8 per bucket, an ``int``; ``4 * size`` for
      ``EXACT``.
    """
    if bits == EXACT:
        return 4 * size
    return math.ceil(size * bits / 8) + _META_BYTES * -(-size // bucket_size)


def leaf_errors(grads, config: CompressionConfig | Callable | None = None, candidates: Sequence[int] = CANDIDATES,
                axis_name=None, objective: str = "squared", bucket_sizes: Sequence[int] | None = None,
                second_moment=None) -> jax.Array:
    """``[leaf, option]``: :func:`expected_errors` of the leaves :func:`choose_bits` plans (those
    ``config`` compresses), at each candidate width (sorted) in each of ``bucket_sizes`` (sorted;
    None: ``config``'s), bucket size major, as a JAX array: usable under ``jit`` and inside
    ``shard_map``. With ``axis_name``, averaged over it (``lax.pmean`` of this small array): every
    device then holds the same errors, of the devices' own gradients, to pass to
    :func:`choose_bits` (``errors=``) or :meth:`Planner.observe <jax_cgx.adaptive.Planner.observe>`.

    ``second_moment`` (``objective="adam"`` only): a pytree like ``grads`` of the optimizer's running
    mean square of each value, e.g. Adam's bias-corrected ``nu`` (Adam divides by its square root),
    to weigh each value's error against instead of the value's own square: ``e / (nu + e)``.

    Args:
      grads: a pytree of arrays (traced or concrete).
      config: as for :func:`choose_bits`: its bucket size and rounding, and which leaves are
        planned; None: ``CompressionConfig()``.
      candidates: the widths, 1..8.
      axis_name: a mapped axis name (or tuple of them) to average the errors over; None (the
        default): this device's errors alone.
      objective: ``"squared"``, ``"relative"`` or ``"adam"``, as for :func:`choose_bits`.
      bucket_sizes: the bucket sizes; None: ``config``'s.
      second_moment: see above; None (the default): each value's own square.

    Returns:
      A float32 array of shape ``[planned leaves, len(bucket_sizes) * len(candidates)]`` (duplicates
      dropped), leaves in flattening order.

    Raises:
      ValueError: ``candidates`` not widths in 1..8 or empty; ``bucket_sizes`` empty or out of
        1..2^31-1; an unknown ``objective``; ``second_moment`` without ``objective="adam"``, or not
        of the gradient's structure and shapes; a config function giving the leaves different
        configs.
      TypeError: ``config`` not a :class:`~jax_cgx.CompressionConfig`, a config function or None, or a
        config function returning something else.
    """
    cands = check_candidates(candidates, "leaf_errors")
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(grads)
    base, own = base_config(config, "leaf_errors", with_paths)
    buckets = check_bucket_sizes(bucket_sizes, base, "leaf_errors")
    objective = check_objective(objective, "leaf_errors")
    scales = _second_moments(second_moment, treedef, [v for _, v in with_paths], objective)
    rows = [jnp.concatenate([_errors(v, bucket, base.stochastic, cands, objective, scale) for bucket in buckets])
            for (p, v), scale, c in zip(with_paths, scales, own) if lane(p, v, c, "leaf_errors") == "quantized"]
    out = jnp.stack(rows) if rows else jnp.zeros((0, len(buckets) * len(cands)), jnp.float32)
    return jax.lax.pmean(out, axis_name) if axis_name is not None else out


def _second_moments(second_moment, treedef, leaves, objective: str) -> list:
    """``second_moment``'s leaves, checked against the gradient's (None: a None per leaf)."""
    if second_moment is None:
        return [None] * len(leaves)
    if objective != "adam":
        raise ValueError(f"leaf_errors: second_moment is for objective='adam', not {objective!r}")
    with_paths, structure = jax.tree_util.tree_flatten_with_path(second_moment)
    if structure != treedef:
        raise ValueError(f"leaf_errors: second_moment must have the gradient's structure {treedef}, got {structure}")
    for (path, m), g in zip(with_paths, leaves):
        if np.shape(m) != np.shape(g):
            raise ValueError(f"leaf_errors: second_moment{jax.tree_util.keystr(path)} has shape {np.shape(m)}, the "
                             f"gradient's leaf {np.shape(g)}")
    return [m for _, m in with_paths]


def expected_errors(leaves: Sequence[jax.Array], config: CompressionConfig, widths: Sequence[int],
                    objective: str = "squared") -> np.ndarray:
    """``[leaf, width]``: the squared error (expected, for stochastic rounding) of quantizing each
    leaf to each width with ``config``'s bucket size and rounding (module docstring).

    Computed on the leaves' devices; one float per leaf and width comes to the host.

    Args:
      leaves: the arrays (concrete: the result comes to the host).
      config: its ``bucket_size`` and ``stochastic`` (expected error of stochastic rounding) are used.
      widths: the widths, 1..8, in the order of the result's columns.
      objective: ``"squared"`` (the default), ``"relative"`` or ``"adam"`` (module docstring).

    Returns:
      A float64 numpy array of shape ``[len(leaves), len(widths)]``.

    Raises:
      ValueError: an unknown ``objective``; a width not in 1..8.
    """
    if not all(is_width(b) for b in widths):
        raise ValueError(f"expected_errors: widths must be quantized widths, integers in 1..8, got {widths!r} "
                         "(a leaf kept exact has no quantization error to estimate)")
    widths = tuple(int(b) for b in widths)
    objective = check_objective(objective, "expected_errors")
    rows = [_errors(leaf, config.bucket_size, config.stochastic, widths, objective) for leaf in leaves]
    return np.asarray(jax.device_get(jnp.stack(rows)), np.float64) if rows else np.zeros((0, len(widths)))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _errors(leaf, bucket_size: int, stochastic: bool, widths: tuple[int, ...], objective: str = "squared",
            second_moment=None):
    x = jnp.ravel(leaf).astype(jnp.float32)
    n = x.size
    pad = -n % bucket_size
    # The last bucket holds n % bucket_size values: padding it with its own first value keeps its range.
    x = jnp.concatenate([x, jnp.broadcast_to(x[n - (n % bucket_size or bucket_size)], (pad,))]) if pad else x
    buckets = x.reshape(-1, bucket_size)
    low = buckets.min(axis=1, keepdims=True)
    high = buckets.max(axis=1, keepdims=True)
    span = high - low
    within = jnp.arange(buckets.size).reshape(buckets.shape) < n  # the padding counts for nothing
    # Every width at once, along a last axis: one reduction per leaf and bucket size, where a loop
    # over the widths made one each and the planner's step compiled 3-4x slower.
    levels = jnp.asarray([2**b - 1 for b in widths], jnp.float32)
    step = span[..., None] / levels  # [bucket, 1, width]
    t = jnp.where(step > 0, (buckets - low)[..., None] / jnp.where(step > 0, step, 1), 0.0)
    # The bucket's maximum is on the grid (its top level); float32's division can put it a hair off,
    # an error no objective should see (under "adam" a zero maximum would count as a drowned value).
    t = jnp.where((buckets == high)[..., None], levels, t)
    f = t - jnp.floor(t)
    per_value = (f * (1 - f) if stochastic else jnp.minimum(f, 1 - f) ** 2) * step * step
    if objective == "adam":  # each value's error against its square: the noise's share of its Adam step
        if second_moment is None:
            square = buckets * buckets
        else:  # the optimizer's running square; the padding is masked below, zeros will do
            square = jnp.pad(jnp.ravel(second_moment).astype(jnp.float32), (0, pad)).reshape(buckets.shape)
        noisy = per_value > 0
        per_value = jnp.where(noisy, per_value / jnp.where(noisy, square[..., None] + per_value, 1), 0.0)
    out = jnp.sum(jnp.where(within[..., None], per_value, 0.0), axis=(0, 1))
    if objective == "relative":  # in units of the leaf's mean square: an optimizer normalizing each leaf
        mean_square = jnp.sum(jnp.where(within, buckets * buckets, 0.0)) / n
        out = jnp.where(mean_square > 0, out / jnp.where(mean_square > 0, mean_square, 1), 0.0)
    return out


def choose_bits(grads, *, budget_bits: float = 4.0, candidates: Sequence[int] = CANDIDATES,
                bucket_sizes: Sequence[int] | None = None, config: CompressionConfig | Callable | None = None,
                exact: bool = True, return_plan: bool = False, errors=None, objective: str = "squared"):
    """Bit widths (and bucket sizes) per leaf minimizing the expected quantization error within
    uniform ``budget_bits``' bytes.

    Args:
      grads: a pytree of arrays (a reduced gradient: the same on every process, so every process
        chooses the same plan; concrete, not traced: a plan is a static config).
      budget_bits: the uniform width whose bytes the plan may not exceed (bucket metadata counted,
        at ``config``'s bucket size).
      candidates: the widths a leaf may get, 1..8.
      bucket_sizes: the bucket sizes a leaf may get (each leaf then chooses a width and a bucket
        size); None: ``config``'s bucket size for every leaf.
      config: every other setting (bucket size, rounding, backend, policy, ...); None:
        ``CompressionConfig()``; or a config function such as
        ``jax_cgx.optax.layer_filter(config, 1024)`` (the leaves it sends exact stay exact, the rest
        are planned on the one CompressionConfig it gives them). Leaves it would not compress
        (integers, fewer than ``min_size`` values) keep it and stay outside the budget.
      exact: a leaf may be sent exact (config ``None``) where that is worth its bytes.
      return_plan: also return one :class:`LeafPlan` per leaf.
      objective: ``"squared"``: the total squared error; ``"relative"``: each leaf's squared error
        in units of its mean square (the error in the step of an optimizer that normalizes each
        leaf's gradient by its size), so leaves of small gradients are not starved of bits;
        ``"adam"``: the sum over values of each value's squared error ``e`` against its own square,
        ``e / (g^2 + e)``: the share of noise in that value's step under an optimizer that divides
        each value by its own running scale, as Adam does (at most 1: a value drowned in noise is
        lost however loud the noise). It sees what the leaf-wide objectives average away: small
        values sharing a bucket with large ones. For Adam the one to use: on our word transformer
        its plans put the least noise into Adam's steps, and within 4-bit's bytes trained closest
        to uncompressed by the median of 3 seeds (docs/training.md).
      errors: :func:`leaf_errors` of the devices' own gradients, averaged over the devices, with the
        same candidates and bucket sizes (then ``grads`` gives only the structure, shapes and
        dtypes). The averaged gradient itself, when it comes from a compressed mean, lies on the
        quantization grid of the widths it was sent with, so its errors at those widths read as
        zero: plan from the devices' own gradients.

    Returns:
      A pytree like ``grads`` of ``CompressionConfig`` (``config`` with ``bits`` and
      ``bucket_size`` set) or ``None``, usable wherever jax_cgx takes a config pytree; with
      ``return_plan``, ``(configs, plans)``.

    Raises:
      ValueError: bad arguments, ``budget_bits`` below every candidate, or a leaf that is not
        finite (its error cannot be weighed: choose from a finite gradient).

    Examples:
      >>> k1, k2 = jax.random.split(jax.random.key(0))
      >>> grads = {"w": jax.random.normal(k1, (256, 256)), "b": 100 * jax.random.normal(k2, (4096,))}
      >>> {path: c.bits for path, c in jax_cgx.adaptive.choose_bits(grads, budget_bits=4).items()}
      {'b': 8, 'w': 3}
    """
    configs, plans, _ = _choose(grads, budget_bits, candidates, config, exact, "choose_bits", errors=errors,
                                objective=objective, bucket_sizes=bucket_sizes)
    return (configs, plans) if return_plan else configs


def _choose(grads, budget_bits, candidates, config, exact: bool, api: str, current: Sequence[tuple] | None = None,
            errors=None, objective: str = "squared", bucket_sizes: Sequence[int] | None = None):
    """``(configs, plans, error of current)``: :func:`choose_bits`'s plan, and the error the choices
    ``current`` (one ``(bits, bucket_size)`` per planned leaf, in order) would have on this gradient
    (None without them)."""
    budget_bits, cands = check_budget(budget_bits, candidates, api)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(grads)
    base, own = base_config(config, api, with_paths)
    buckets = check_bucket_sizes(bucket_sizes, base, api)
    paths = [p for p, _ in with_paths]
    leaves = [v for _, v in with_paths]
    chosen = [i for i, (p, v, c) in enumerate(zip(paths, leaves, own)) if lane(p, v, c, api) == "quantized"]
    quantized = [(b, bucket) for bucket in buckets for b in cands]  # leaf_errors' columns, in order
    choices = quantized + ([(EXACT, None)] if exact else [])
    if current is not None and not set(current) <= set(choices):
        raise ValueError(f"{api}: the current choices {sorted(set(current), key=str)} are not all among {choices}")
    if errors is None:
        for path, leaf in zip(paths, leaves):
            if isinstance(leaf, jax.core.Tracer):
                raise TypeError(f"{api}: leaf {jax.tree_util.keystr(path)} is traced; call it outside jit on the "
                                "averaged gradient, or pass errors= from leaf_errors (a plan is a static config)")
        # leaf_errors' own columns (bucket size major), so errors= from it plans the same.
        errors = np.asarray(jax.device_get(leaf_errors(grads, config, cands, None, objective, buckets)), np.float64)
    else:
        errors = np.asarray(errors, np.float64)
        if errors.shape != (len(chosen), len(quantized)):
            raise ValueError(f"{api}: errors has shape {errors.shape}; this gradient and config need "
                             f"{(len(chosen), len(quantized))} (leaves to plan, candidates x bucket sizes): compute "
                             "it with leaf_errors and the same config, candidates and bucket sizes")
    for i, row in zip(chosen, errors):
        if not np.all(np.isfinite(row)):
            raise ValueError(f"{api}: leaf {jax.tree_util.keystr(paths[i])} is not finite (its buckets' spans are "
                             "inf or nan); choose from a finite gradient")
    sizes = [int(np.size(leaves[i])) for i in chosen]
    options = [_all(n, dict(zip(quantized, row)), choices) for n, row in zip(sizes, errors)]
    try:
        picks = solve(options, sum(leaf_bytes(n, budget_bits, base.bucket_size) for n in sizes))
    except ValueError as err:
        raise ValueError(f"{api}: budget_bits={budget_bits} (in buckets of {base.bucket_size}) with candidates "
                         f"{list(cands)} and bucket sizes {list(buckets)}: {err}") from None
    uniform_choice = (int(budget_bits), base.bucket_size)
    if int(budget_bits) == budget_bits and uniform_choice in quantized:
        uniform = [next(o for o in opts if o[2] == uniform_choice) for opts in options]
        if sum(o[1] for o in uniform) < sum(o[1] for o in picks):
            picks = uniform
    before = None
    if current is not None:
        if len(current) != len(chosen):
            raise ValueError(f"{api}: the gradient has {len(chosen)} leaves to plan, the current plan {len(current)}")
        before = sum(next(o[1] for o in opts if o[2] == c) for opts, c in zip(options, current))
    out: list[CompressionConfig | None] = []
    plans = []
    by_leaf = dict(zip(chosen, picks))
    for i, (path, leaf) in enumerate(zip(paths, leaves)):
        if i not in by_leaf:
            out.append(own[i])
            continue
        nbytes, err, (bits, bucket) = by_leaf[i]
        out.append(None if bits == EXACT else base.replace(bits=bits, bucket_size=bucket))
        plans.append(LeafPlan(jax.tree_util.keystr(path), int(np.size(leaf)), bits, err, nbytes, bucket))
    return treedef.unflatten(out), plans, before


def _all(n: int, errors: dict[tuple, float], choices) -> list[tuple[int, float, tuple]]:
    """A leaf's options: (bytes, error, (bits, bucket size)) for each choice."""
    return [(leaf_bytes(n, b, bucket), 0.0 if b == EXACT else float(errors[b, bucket]), (b, bucket))
            for b, bucket in choices]


def describe(plans: Sequence[LeafPlan]) -> str:
    """A table of a plan: per leaf its bits, bucket size, predicted error and bytes, and the totals.

    Args:
      plans: the plan's :class:`LeafPlan`\\ s, as :func:`choose_bits` (``return_plan=True``) or
        ``Planner.plans`` gives them.

    Returns:
      The table as a ``str``, one line per leaf after a header, then a line of totals.
    """
    rows = [f"{'leaf':<40} {'values':>10} {'bits':>5} {'bucket':>7} {'pred. error':>12} {'bytes':>10}"]
    for p in plans:
        bits = "exact" if p.bits == EXACT else str(p.bits)
        bucket = "" if p.bucket_size is None else str(p.bucket_size)
        rows.append(f"{p.path:<40} {p.size:>10} {bits:>5} {bucket:>7} {p.error:>12.4g} {p.bytes:>10}")
    rows.append(f"{'total':<40} {sum(p.size for p in plans):>10} {'':>5} {'':>7} {sum(p.error for p in plans):>12.4g} "
                f"{sum(p.bytes for p in plans):>10}")
    return "\n".join(rows)
