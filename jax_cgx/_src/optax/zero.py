"""``sharded``: an optax optimizer with its state sharded over the devices (ZeRO-1/2), the
gradients reduce-scattered and the parameters all-gathered, both optionally compressed.

**Not an optax GradientTransformation**: ``update(grads, state)`` returns the new *parameters*, not
updates for ``optax.apply_updates``, and takes no parameters. The parameters live in the state (each
device's full-precision master block of them) and come out of the all-gather of those blocks; the
ones the step was given play no part. Updates would not carry that: ``params + (new - params)`` is
not ``new`` in floating point (243 of 30,000 values differ after 30 exact Adam steps of
tests/optax/test_sharded_optimizer.py's problem), and anything done to updates or parameters
outside (a further transformation, a checkpoint loaded into the parameters only) would be
overwritten by the next step's all-gather without a word.

Data-parallel training keeps a full copy of the optimizer state on every device: for Adam,
twice the parameters. ZeRO shards it: device ``j`` keeps only block ``j`` of every parameter
(flattened and padded to a multiple of ``W``), in full precision (the *master* shard), and
the optimizer's state for it. A step, inside ``shard_map``:

1. each device's own gradient (differentiate a copy of the parameters typed as varying);
2. ``compressed_psum_scatter`` of the gradients: device ``j`` gets the mean of block ``j``,
   each contribution quantized once (``grad_config``);
3. the optimizer updates the master shard;
4. ``compressed_all_gather`` of the master shards gives every device the new parameters,
   bitwise the same everywhere; with ``param_config`` they are quantized for the forward
   pass only (DeepSpeed ZeRO++'s qwZ): the master shards stay exact, so the error does not
   accumulate from step to step.

With ``error_feedback=True`` each device also keeps what quantizing its gradient blocks
lost (the reduce-scatter's residual, ``return_residual=True``) and adds it to its next
gradient: the applied means then add up to the true ones minus the last residual. It costs
a gradient-sized buffer per device. As for ``compressed_mean``, it pays with SGD, whose
update is linear in the gradient, and much less with Adam (docs/training.md).

The wrapped optimizer sees this device's flat, padded 1-D shards, so it must be elementwise
(SGD, momentum, Adam, AdamW without a shape-based mask, schedules): a transformation that
looks at a whole leaf or the whole tree (``clip_by_global_norm``, adafactor's factored
moments, LAMB/LARS trust ratios, masks on ``ndim``) would see only its shard, differently on
every device. Floating parameters are kept in float32 in the master shard whatever their
dtype (the all-gather casts back), so bfloat16 models keep small updates.

A step whose mean gradient is not finite on any device is skipped on every device (the
state is left bitwise unchanged, ``skipped`` counts it), so one bad batch cannot poison
the master parameters, the optimizer's moments or the residuals.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cgx._src import compat
from jax_cgx._src.collectives.all_gather import compressed_all_gather
from jax_cgx._src.collectives.plan import ConfigSpec, check_varying, lane, leaf_configs
from jax_cgx._src.collectives.reduce_scatter import compressed_psum_scatter
from jax_cgx._src.config import CompressionConfig
from jax_cgx._src.optax import checks

__all__ = ["ShardedState", "ShardedOptimizer", "sharded"]


class ShardedState(NamedTuple):
    """This device's part of a :func:`sharded` optimizer's state."""

    #: This device's block of every parameter, flat, in full precision.
    master: Any
    #: The wrapped optimizer's state for ``master``.
    inner: Any
    #: The steps skipped because the mean gradient was not finite (int32).
    skipped: jax.Array
    #: What quantizing this device's gradient lost (error feedback), flat and padded; ``()`` without.
    residual: Any = ()


class ShardedOptimizer(NamedTuple):
    """``init(params) -> state`` and ``update(grads, state, key=None) -> (params, state)``, both
    inside ``shard_map``; ``state_specs(params, mesh)`` gives the state's ``PartitionSpec``\\ s.

    Not an optax ``GradientTransformation``: ``update`` returns the new parameters, not updates
    (see :func:`sharded`).

    Made by :func:`sharded`; built by hand it takes the three functions in order.

    Args:
      init: the ``init`` function (below).
      update: the ``update`` function (below).
      state_specs: the ``state_specs`` function (below).
    """

    #: ``init(params) -> ShardedState``, inside ``shard_map``.
    init: Callable[..., ShardedState]
    #: ``update(grads, state, key=None) -> (params, state)``, inside ``shard_map``.
    update: Callable[..., tuple[Any, ShardedState]]
    #: ``state_specs(params, mesh) -> ShardedState`` of ``PartitionSpec``: ``shard_map``'s specs of the state.
    state_specs: Callable[..., ShardedState]


_EXACT = CompressionConfig(bits=32)


def sharded(optimizer: optax.GradientTransformation, axis_name, *, grad_config: ConfigSpec = _EXACT,
            param_config: ConfigSpec = _EXACT, error_feedback: bool = False) -> ShardedOptimizer:
    """``optimizer`` with its state sharded over ``axis_name`` (ZeRO-1/2), for use in ``shard_map``.

    Unlike an optax ``GradientTransformation``, ``update(grads, state)`` returns the new
    parameters, not updates: the state holds them (each device's full-precision master block),
    and they come out of an all-gather of it, bitwise the same on every device. Use them as the
    next step's parameters; the step does not read the ones it was given, so nothing done to
    them outside survives the next step (module docstring: why updates cannot say the same).

    Args:
      optimizer: an elementwise optax transformation (it sees this device's flat shards; see
        the module docstring).
      axis_name: the data-parallel mesh axis (or axes).
      grad_config: the gradients' reduce-scatter (:func:`~jax_cgx.compressed_psum_scatter`);
        default exact. A config, a pytree of them, a function of the leaf's path, or None (as for
        :func:`~jax_cgx.compressed_psum`: ``CompressionConfig()``'s defaults unless ``CGX_*`` are set).
      param_config: the parameters' all-gather (:func:`~jax_cgx.compressed_all_gather`),
        default exact; compressing it quantizes the forward pass's weights only.
      error_feedback: carry each device's reduce-scatter residual into its next gradient.

    Returns:
      A :class:`ShardedOptimizer`. Use it as::

          opt = jax_cgx.optax.sharded(optax.adam(1e-3), "data", grad_config=CompressionConfig(bits=4))
          specs = opt.state_specs(params, mesh)
          state = jax.jit(jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

          def step(params, state, batch):               # in shard_map(in_specs=(P(), specs, P("data")))
              mine = jax.lax.pcast(params, "data", to="varying")
              loss, grads = jax.value_and_grad(loss_fn)(mine, batch)
              params, state = opt.update(grads, state)  # the new parameters, not updates
              return params, state, jax.lax.pmean(loss, "data")

      docs/guide.md ("ZeRO: jax_cgx.optax.sharded") has it complete, mesh and data included.

    Raises:
      TypeError: ``optimizer`` without callable ``init`` and ``update``.
      ValueError: ``axis_name`` empty or not axis names; ``error_feedback`` not a bool.
    """
    fn = "jax_cgx.optax.sharded"
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        raise TypeError(f"{fn}: optimizer must be an optax.GradientTransformation (with init and update), "
                        f"got {type(optimizer).__name__}; e.g. sharded(optax.adam(1e-3), 'data')")
    axes = checks.check_axes(fn, axis_name)
    error_feedback = checks.check_bool(fn, "error_feedback", error_feedback)

    def world() -> int:
        return math.prod(lax.axis_size(a) for a in axes)

    def flat_padded(x, w: int):
        n = x.size
        k = -(-n // w)
        return jnp.pad(x.reshape(-1), (0, w * k - n))

    def master_dtype(p):
        return p.astype(jnp.float32) if jnp.issubdtype(p.dtype, jnp.floating) else p

    def check_gradients(leaves) -> None:
        if not compat.check_vma_enabled():
            return
        for g in leaves:
            if not set(axes) <= compat.varying_axes(jax.typeof(g)):
                raise ValueError(
                    "jax_cgx.optax.sharded: update() needs each device's own gradient, but got one that is the "
                    f"same on every device over {axes} (already summed by JAX): differentiate a varying copy of "
                    f"the parameters, jax.lax.pcast(params, {axes if len(axes) > 1 else axes[0]!r}, to='varying')")

    def init(params) -> ShardedState:
        w = world()
        me = lax.axis_index(axes)

        def shard(p):
            if not jnp.size(p):  # an empty parameter: nothing to keep (orbax refuses zero-size arrays)
                return checks.placeholder()
            flat = flat_padded(master_dtype(p), w)
            k = flat.size // w
            return lax.dynamic_slice_in_dim(flat, me * k, k)

        def zeros(p):
            return compat.ensure_varying(jnp.zeros_like(flat_padded(p, w)), axes) if jnp.size(p) else checks.placeholder()

        master = jax.tree.map(shard, params)
        residual = jax.tree.map(zeros, params) if error_feedback else ()
        return ShardedState(master, optimizer.init(master), jnp.zeros((), jnp.int32), residual)

    def update(grads, state: ShardedState, key: jax.Array | None = None):
        w = world()
        leaves, treedef = jax.tree.flatten(grads)
        check_gradients(leaves)
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        # Empty leaves are placeholders (no leaves): every collective and tree.map below passes them by.
        flat = treedef.unflatten([flat_padded(g, w) if g.size else checks.placeholder() for g in leaves])
        if error_feedback:
            # Checked before the residual is added: a per-device residual would type an already
            # summed gradient (replicated params not pcast) as varying, and hide the mistake.
            entries = jax.tree_util.tree_flatten_with_path(flat)[0]
            paths, values = [p for p, _ in entries], [v for _, v in entries]
            configs = leaf_configs(grad_config, flat, paths, "jax_cgx.optax.sharded")
            check_varying("jax_cgx.optax.sharded", paths, values,
                          [lane(p, v, c, "jax_cgx.optax.sharded") for p, v, c in zip(paths, values, configs)], axes,
                          mean=True)
            flat = jax.tree.map(jnp.add, flat, state.residual)
            summed, residual = compressed_psum_scatter(flat, axes, grad_config, tiled=True, key=keys[0],
                                                       return_residual=True)
        else:
            summed, residual = compressed_psum_scatter(flat, axes, grad_config, tiled=True, key=keys[0]), ()
        mean = jax.tree.map(lambda s, m: (s / w).astype(m.dtype), summed, state.master)
        finite = jnp.all(jnp.array([jnp.isfinite(jnp.sum(m * 0)) for m in jax.tree.leaves(mean)] or [True]))
        # Every device skips, or none: over the model axes too where the parameters are split over
        # them (a shard skipped alone would leave its parameter half updated).
        over = tuple(sorted(set(axes).union(*(compat.varying_axes(jax.typeof(m)) for m in jax.tree.leaves(mean)))
                            if compat.check_vma_enabled() else axes))
        finite = lax.psum(finite.astype(jnp.int32), over) == math.prod(lax.axis_size(a) for a in over)
        updates, inner = optimizer.update(mean, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        state = ShardedState(jax.tree.map(keep, master, state.master), jax.tree.map(keep, inner, state.inner),
                             state.skipped + (1 - finite.astype(jnp.int32)),
                             jax.tree.map(keep, residual, state.residual))
        # In the parameters' dtype; typed invariant: the same bits on every device, so they leave shard_map as P().
        working = treedef.unflatten([m.astype(g.dtype) if g.size else m
                                     for m, g in zip(treedef.flatten_up_to(state.master), leaves)])
        gathered = compressed_all_gather(working, axes, param_config, tiled=True, to="invarying", key=keys[1])
        params = treedef.unflatten([g[:x.size].reshape(x.shape) if x.size else jnp.zeros(x.shape, x.dtype)
                                    for g, x in zip(treedef.flatten_up_to(gathered), leaves)])
        return params, state

    def state_specs(params, mesh, param_specs=None) -> ShardedState:
        """PartitionSpecs of the state of ``params`` on ``mesh``: ``P(axis)`` for what differs per
        device (the master shards, the optimizer's moments), ``P()`` for the rest (step counts).

        ``param_specs``: where the ``shard_map`` also splits the parameters over model axes
        (tensor parallelism, FSDP), their ``PartitionSpec``\\ s (a pytree like ``params``). A
        per-device leaf is then split over those axes first and ``axis_name`` after
        (``P(("model", "data"))``): the global array holds each model shard's flat, padded
        parameter in turn, which :func:`~jax_cgx.optax.resize_state` lays out again for another
        data-axis size."""
        varying = {}

        def probe(params):
            state = init(params)
            varying["state"] = jax.tree.map(lambda s: compat.varying_axes(jax.typeof(s)), state)
            return jnp.zeros(())

        if param_specs is None:
            jax.eval_shape(jax.shard_map(probe, mesh=mesh, in_specs=P(), out_specs=P()), params)
        else:  # placed as the specs say (shard_map takes Explicit axes from the arguments' types)
            placed = jax.tree.map(lambda p, spec: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p),
                                                                       sharding=NamedSharding(mesh, spec)),
                                  params, param_specs, is_leaf=lambda x: isinstance(x, P))
            jax.eval_shape(jax.shard_map(probe, mesh=mesh, in_specs=(param_specs,), out_specs=P()), placed)

        def spec(over) -> P:
            if not set(axes) & over:
                return P()
            joined = (*(a for a in mesh.axis_names if a in over and a not in axes), *axes)
            return P(joined[0] if len(joined) == 1 else joined)

        return jax.tree.map(spec, varying["state"], is_leaf=lambda v: isinstance(v, frozenset))

    return ShardedOptimizer(init, update, state_specs)
