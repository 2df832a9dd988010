"""Gradient means over a mapped axis as optax transformations: ``compressed_mean`` and ``cast_mean``.

``compressed_mean`` averages with :func:`jax_cgx.compressed_pmean` (bucketed max-min
quantization, torch_cgx's algorithm), reducing small leaves exactly as torch_cgx's layer
filter does, with optional **error feedback**: every rank keeps what the compression lost
and adds it to its next gradient, so that nothing is lost for good (docs/algorithm.md,
"Error feedback").

``cast_mean`` is PyTorch DDP's ``fp16_compress_hook`` / ``bf16_compress_hook``: a sum in
16-bit floats.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jax_cgx._src import compat
from jax_cgx._src.codec import Impl, check_impl
from jax_cgx._src.collectives import compressed_pmean
from jax_cgx._src.collectives.plan import check_varying, lane, leaf_configs
from jax_cgx._src.config import CompressionConfig, default_config
from jax_cgx._src.optax import checks

__all__ = [
    "CompressedMeanState",
    "compressed_mean",
    "CastMeanState",
    "cast_mean",
]


class CompressedMeanState(NamedTuple):
    """State of :func:`compressed_mean`."""

    #: int32 scalar, the number of updates so far (the same on every rank); the stochastic-rounding
    #: key of a step folds it in. With error feedback or stochastic rounding a step whose mean is
    #: non-finite does not count (see "Non-finite steps").
    count: jax.Array
    #: With ``error_feedback``, this rank's error-feedback residual: a pytree like the parameters,
    #: each leaf in the parameter's dtype (zeros at init; it differs between ranks), except that
    #: leaves the layer filter always reduces exactly (``ndim <= 1``, fewer than ``layer_min_size``
    #: elements, non-float) hold ``optax.MaskedNode()`` (no leaves): they never lose anything.
    #: Without error feedback: ``()``.
    residual: Any


class CastMeanState(NamedTuple):
    """State of :func:`cast_mean`: none (an empty NamedTuple)."""


def _is_config(c) -> bool:
    return c is None or isinstance(c, CompressionConfig)


def _filtered(leaf, layer_min_size: int) -> bool:
    """torch_cgx's layer filter: reduce biases, norms, small and non-float leaves exactly."""
    shape = jnp.shape(leaf)
    return (
        len(shape) <= 1
        or math.prod(shape) < layer_min_size
        or not jnp.issubdtype(jnp.result_type(leaf), jnp.floating)
    )


def layer_filter(config, layer_min_size: int = 1024):
    """``compressed_mean``'s per-leaf config: ``None`` (reduce exactly) for what torch_cgx's layer
    filter keeps out (leaves of ndim <= 1, fewer than ``layer_min_size`` elements, non-float),
    ``config`` (or ``config(path, leaf)`` when it is a function) for the rest.

    A ``config`` for :func:`jax_cgx.compressed_pmean`, :func:`jax_cgx.bytes_on_wire` or
    :func:`jax_cgx.reduce_in_backward` that treats leaves as ``compressed_mean`` does.

    Args:
      config: a :class:`~jax_cgx.CompressionConfig` (or a config function) for the leaves kept in.
      layer_min_size: leaves with fewer values are reduced exactly.

    Returns:
      A config function ``(path, leaf) -> CompressionConfig | None``.
    """

    def leaf_config(path, leaf):
        if _filtered(leaf, layer_min_size):
            return None
        return config(path, leaf) if callable(config) else config

    return leaf_config


def compressed_mean(
    axis_name,
    config: CompressionConfig | None = None,
    *,
    layer_min_size: int = 1024,
    error_feedback: bool = False,
    seed: int = 0,
    impl: Impl = "auto",
) -> optax.GradientTransformation:
    """The mean of the updates over ``axis_name``, through the compressed all-reduce.

    ``update`` returns :func:`jax_cgx.compressed_pmean` of the updates: bitwise identical on
    every rank. Use it inside ``jax.shard_map`` / ``jax.pmap`` where ``axis_name`` is
    bound, in place of ``jax.lax.pmean(grads, axis_name)``, first in an ``optax.chain``::

        tx = optax.chain(compressed_mean("data", CompressionConfig(bits=4)), optax.adam(1e-3))

    The updates are each device's own gradients: under ``shard_map(check_vma=True)`` a
    compressed leaf typed invariant over ``axis_name`` (the gradient with respect to replicated
    parameters, which JAX has already summed) raises a ``ValueError`` naming the fix,
    ``jax.lax.pcast(params, axis_name, to="varying")`` before differentiating.

    **Layer filter** (torch_cgx's): leaves with ``ndim <= 1`` (biases, norm scales,
    scalars), fewer than ``layer_min_size`` elements, or a non-float dtype are averaged
    exactly, as ``lax.pmean`` does; the others are compressed with ``config`` (itself
    subject to ``config.min_size``, ``bits=16``/``32``, ...). Implemented as
    :func:`~jax_cgx.compressed_pmean` with a per-leaf config (``None`` for filtered leaves), so
    compressed leaves of one dtype share fusion buffers.

    **Stochastic rounding** keys: step ``t`` uses
    ``jax.random.fold_in(jax.random.key(seed), t)``, the same on every rank
    (:func:`~jax_cgx.compressed_psum` folds in each rank's index).

    **Error feedback** (``error_feedback=True``): rank ``r`` keeps a residual ``e_r``
    (zeros at init). Each step it compresses ``c_r = g_r + e_r`` instead of its gradient
    ``g_r`` and stores the exact residual :func:`~jax_cgx.compressed_pmean` returns,
    ``e_r' = `` this rank's share of the compression error of the sum, in the units of the
    gradients (``sum_r e_r' = sum_r c_r - W * mean``, not divided by ``W``). Writing
    ``E_t = sum_r e_r`` after step ``t``, the applied update is
    ``u_t = (sum_r g_r,t + E_{t-1} - E_t) / W``, so over ``T`` steps the sum telescopes::

        sum_{t<=T} u_t  ==  sum_{t<=T} mean_r(g_r,t)  -  mean_r(e_r,T)

    (up to float32 rounding): the applied updates never drift from the true means by more
    than the current residual's mean, which is one step's compression error of the mean
    (at most half a quantization step per value with nearest rounding), however many steps
    were taken. Without error feedback the per-step errors add up instead. For bfloat16
    and float16 leaves the residual is kept in the leaf's dtype (rounded to it).

    **Non-finite steps.** If the mean is non-finite anywhere (an inf or NaN in any rank's
    gradient, which the all-reduce propagates to every rank alike), that step's update is
    non-finite. With error feedback or stochastic rounding the state is then left bitwise
    unchanged (the residuals and the count, on every rank), so the next finite step gives
    exactly the update it would have given had the bad step never happened. Without either,
    no later update depends on the state, so the mean is not checked (a pass over it every
    step: 20-30 ms for 67 MB of gradients on a 2-vCPU machine) and the count counts the bad
    step too. To skip such steps put
    ``optax.apply_if_finite`` *after* ``compressed_mean``, around the optimizer:
    ``optax.chain(compressed_mean(...), optax.apply_if_finite(optax.adam(lr), 5))``.
    Wrapping ``compressed_mean`` itself (or any transformation with a collective) in
    ``apply_if_finite`` tests each rank's own gradient: ranks with finite and non-finite
    gradients would disagree on whether to run the collective.

    **Clipping.** Put ``optax.clip_by_global_norm`` *after* ``compressed_mean`` in the chain, so it
    clips the mean; before it, it clips each rank's own gradient (nothing in the state shows it is
    there, so this cannot be checked). The compressed mean's norm is larger than the exact mean's
    (1.00x at 8 bits, 1.02-1.05x at 4, 1.3-1.8x at 2 on a transformer: docs/flax.md, "Where to clip").

    Args:
      axis_name: the mapped axis (or a tuple of axes) to average over.
      config: a :class:`~jax_cgx.CompressionConfig`; a pytree of them matching the updates (or a prefix of
        them; ``None``: reduce exactly), such as :func:`jax_cgx.adaptive.choose_bits`'s plan; a
        function ``(path, leaf) -> CompressionConfig | None`` (``None``: reduce exactly); each
        applied to the leaves the layer filter keeps; or
        ``None`` for ``CompressionConfig()``'s defaults (4 bits), or, where torch_cgx's
        ``CGX_*`` variables are set, ``CompressionConfig.from_env()`` (torch_cgx's meaning:
        compression is off unless ``CGX_COMPRESSION_QUANTIZATION_BITS`` is set); read once, when
        ``compressed_mean`` is called, and logged (INFO).
      layer_min_size: leaves with fewer elements are averaged exactly.
      error_feedback: keep and re-inject the compression error (see above).
      seed: seed of the stochastic-rounding keys.
      impl: codec implementation: ``"auto"``, ``"kernel"`` or ``"reference"``.

    Returns:
      An ``optax.GradientTransformation``: ``init(params)`` makes a :class:`CompressedMeanState`;
      ``update(updates, state, params=None)`` returns ``(mean, new_state)``, ``mean`` a pytree like
      the updates.

    Raises:
      ValueError: an unknown ``impl``; ``layer_min_size`` not an integer >= 0; ``error_feedback`` not a
        bool; ``seed`` not an integer in the int64 range; ``axis_name`` empty or not axis names.
      TypeError: ``config`` not a :class:`~jax_cgx.CompressionConfig`, a pytree of them, a function or
        None.

    The state (:class:`CompressedMeanState`) has fixed shapes and dtypes, so the
    transformation composes with ``jit``, ``optax.chain``, ``optax.MultiSteps`` (which runs
    the inner update, and so the exchange, on every micro-step and keeps the state of the
    last one) and ``optax.apply_if_finite`` as above. ``update`` raises a ``ValueError``
    naming the leaf and both shapes if the state does not belong to the updates (built for
    other parameters, with another ``error_feedback`` or ``layer_min_size``, or given the
    wrong ``shard_map`` specs). Complex leaves are non-float: averaged exactly. ``init``
    uses no collective (it may run outside ``shard_map``). With error feedback the residual
    differs per rank: under ``jax.pmap`` that is automatic; across ``jax.shard_map`` calls
    pass the state with the specs of :func:`jax_cgx.optax.state_specs`. Residuals are
    computed by the ``xla`` backend (``backend="nccl"`` raises with error feedback;
    ``"auto"`` picks ``xla``).

    Examples:
      >>> import optax
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> tx = optax.chain(jax_cgx.optax.compressed_mean("data", jax_cgx.CompressionConfig(bits=4)), optax.sgd(0.1))
      >>> def step(params, grads):  # inside shard_map: each device's own gradient
      ...     params, grads = params[0], grads[0]
      ...     updates, _ = tx.update(grads, tx.init(params), params)
      ...     return optax.apply_updates(params, updates)[None]
      >>> f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
      >>> rows = NamedSharding(mesh, P("data"))
      >>> grads = jnp.arange(8.0)[:, None] * jnp.ones((8, 1024))  # device i's gradient: all i
      >>> new = f(jax.device_put(jnp.ones((8, 1024)), rows), jax.device_put(grads, rows))
      >>> np.asarray(new)[0, :3]  # 1 - 0.1 * mean(0..7); a constant bucket is exact
      array([0.65, 0.65, 0.65], dtype=float32)
    """
    check_impl(impl)
    layer_min_size = checks.check_int("compressed_mean", "layer_min_size", layer_min_size, minimum=0)
    error_feedback = checks.check_bool("compressed_mean", "error_feedback", error_feedback)
    seed = checks.check_seed("compressed_mean", seed)
    if config is None:
        config = default_config("compressed_mean")
    tree_config = None
    if not (isinstance(config, CompressionConfig) or callable(config)):
        if not jax.tree.leaves(config, is_leaf=_is_config) or not all(
                _is_config(c) for c in jax.tree.leaves(config, is_leaf=_is_config)):
            raise TypeError(
                "compressed_mean: config must be a CompressionConfig, a pytree of them (None: exact) matching "
                "the updates, a function (path, leaf) -> CompressionConfig | None, or None; got "
                f"{type(config).__name__}"
            )
        tree_config = config  # e.g. jax_cgx.adaptive.choose_bits's plan: resolved against the updates' paths
    axes = checks.check_axes("compressed_mean", axis_name)

    leaf_config = layer_filter(config, layer_min_size) if tree_config is None else None

    def init_fn(params):
        count = jnp.zeros([], jnp.int32)
        if not error_feedback:
            return CompressedMeanState(count, ())

        def zeros(p):
            if _filtered(p, layer_min_size):
                return checks.placeholder()
            return checks.typed_like(jnp.zeros(jnp.shape(p), jnp.result_type(p)), p, axes, per_rank=True)

        return CompressedMeanState(count, jax.tree.map(zeros, params))

    def residual_shape(g):
        return checks.PLACEHOLDER_SHAPE if _filtered(g, layer_min_size) else jnp.shape(g)

    def update_fn(updates, state, params=None):
        del params
        checks.check_state_type("compressed_mean", state, CompressedMeanState)
        checks.check_count("compressed_mean", state.count)
        if error_feedback:
            old = checks.state_leaves("compressed_mean", "residual", updates, state.residual, residual_shape)
        elif not (isinstance(state.residual, tuple) and len(state.residual) == 0):
            raise ValueError(
                "compressed_mean: state.residual holds residuals (a state built with error_feedback=True) "
                "but this compressed_mean has error_feedback=False: build the state with this "
                "transformation's init, or pass error_feedback=True."
            )
        flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
        if tree_config is None:
            configs = {jax.tree_util.keystr(path): leaf_config(path, leaf) for path, leaf in flat}
        else:
            given = leaf_configs(tree_config, updates, [p for p, _ in flat], "compressed_mean")
            configs = {jax.tree_util.keystr(path): None if _filtered(leaf, layer_min_size) else c
                       for (path, leaf), c in zip(flat, given)}
        spec = lambda path, leaf: configs[jax.tree_util.keystr(path)]  # noqa: E731
        # Before the residual is added: a per-rank residual would type an already summed gradient varying.
        check_varying("compressed_mean", [p for p, _ in flat], [g for _, g in flat],
                      [lane(p, g, spec(p, g), "compressed_mean") for p, g in flat], axes, mean=True)
        key = None
        if any(c is not None and c.stochastic for c in configs.values()):
            key = jax.random.fold_in(jax.random.key(seed), state.count)
        if not error_feedback:
            mean = compressed_pmean(updates, axes, spec, key=key, impl=impl)
            if key is None:  # nothing later depends on the state: no pass over the mean to check it
                return mean, CompressedMeanState(optax.safe_increment(state.count), ())
            finite = checks.step_is_finite(mean, state.count, axes)
            return mean, CompressedMeanState(_next_count(state.count, finite), ())

        leaves = [leaf for _, leaf in flat]
        carried = [not _filtered(g, layer_min_size) for g in leaves]
        compensated = [g + e.astype(g.dtype) if c else g for g, e, c in zip(leaves, old, carried)]
        mean, lost = compressed_pmean(
            treedef.unflatten(compensated), axes, spec, key=key, impl=impl, return_residual=True
        )
        # The mean is bitwise the same on every rank: all ranks agree on whether it is finite.
        finite = checks.step_is_finite(mean, state.count, axes)
        residual = [
            compat.ensure_varying(jnp.where(finite, new.astype(e.dtype), e), axes) if c else e
            for new, e, c in zip(treedef.flatten_up_to(lost), old, carried)
        ]
        return mean, CompressedMeanState(_next_count(state.count, finite), treedef.unflatten(residual))

    return optax.GradientTransformation(init_fn, update_fn)


def _next_count(count, finite):
    """The count after a step: one more after a finite step, unchanged after a non-finite one."""
    return jnp.where(finite, optax.safe_increment(count), count)


def cast_mean(axis_name, dtype=jnp.bfloat16) -> optax.GradientTransformation:
    """The mean of the updates over ``axis_name``, summed in a 16-bit float type.

    PyTorch DDP's ``bf16_compress_hook`` / ``fp16_compress_hook``, leaf by leaf: cast the
    gradient to ``dtype``, divide it by the world size **in** ``dtype`` (before the sum, as
    the hooks do, so that float16 sums do not overflow), ``lax.psum`` in ``dtype``, and cast
    the result back to the leaf's dtype::

        lax.psum(g.astype(dtype) / W, axis_name).astype(g.dtype)

    Non-float leaves (integers, complex) are averaged exactly (``lax.pmean``). Moves half the
    bytes of a float32 mean. The state (:class:`CastMeanState`) is empty, so a non-finite step
    (an inf or NaN on any rank; with float16 also any ``|g|`` above 65504, cast before the
    division as the hooks do) gives a non-finite mean for that step only. ``update`` raises a
    ``ValueError`` for any other state. ``init`` uses no collective.

    Args:
      axis_name: the mapped axis (or a tuple of axes) to average over.
      dtype: the floating type the sum runs in, ``jnp.bfloat16`` (default) or
        ``jnp.float16``.

    Returns:
      An ``optax.GradientTransformation``: ``init(params)`` makes a :class:`CastMeanState`;
      ``update(updates, state, params=None)`` returns ``(mean, state)``, ``mean`` a pytree like the
      updates (float leaves keep their dtype).

    Raises:
      TypeError: ``dtype`` other than bfloat16 or float16.
      ValueError: ``axis_name`` empty or not axis names.

    Examples:
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> tx = jax_cgx.optax.cast_mean("data")  # the mean taken in bfloat16
      >>> def step(g):
      ...     updates, _ = tx.update(g[0], tx.init(g[0]))
      ...     return updates[None]
      >>> grads = jax.device_put(jnp.arange(8.0)[:, None] * jnp.ones((8, 256)), NamedSharding(mesh, P("data")))
      >>> np.asarray(jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(grads))[0, :2]
      array([3.5, 3.5], dtype=float32)
    """
    try:
        dtype = jnp.dtype(dtype) if dtype is not None else None
    except TypeError:
        pass
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise TypeError(f"cast_mean: dtype must be jnp.bfloat16 or jnp.float16 (the 16-bit floating types the sum "
                        f"runs in), got {getattr(dtype, 'name', dtype)!r}; for an exact mean use lax.pmean")
    axes = checks.check_axes("cast_mean", axis_name)

    def init_fn(params):
        del params
        return CastMeanState()

    def update_fn(updates, state, params=None):
        del params
        checks.check_state_type("cast_mean", state, CastMeanState)
        compat.check_axis_names(axes, "cast_mean")
        world = math.prod(lax.axis_size(a) for a in axes)

        def mean(g):
            g = jnp.asarray(g)
            if not jnp.issubdtype(g.dtype, jnp.floating):
                return lax.pmean(g, axes)
            return lax.psum(g.astype(dtype) / world, axes).astype(g.dtype)

        return jax.tree.map(mean, updates), state

    return optax.GradientTransformation(init_fn, update_fn)
