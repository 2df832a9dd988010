"""``resize_state``: an optax state saved on ``W`` devices, made a state for ``W'`` devices.

A job that comes back from a preemption on fewer or more devices restores its checkpoint, whose
per-device leaves (error-feedback residuals, top-k's momentum and velocity, PowerSGD's error, a
``MultiSteps`` accumulator, the ZeRO optimizer's shards) are global arrays laid out for ``W``
devices: ``shard_map`` refuses them on ``W'``. This module lays them out again, keeping what can be
kept exactly in aggregate (docs/checkpointing.md has the table):

- **per-device leaves of the means** (``CompressedMeanState.residual``, ``TopKState.u`` and ``v`` of a
  compressed leaf, ``PowerSGDState.error``, ``MultiStepsState.acc_grads`` around a mean): every new
  device gets the old devices' mean. The next reduction applies ``sum_r e_r / W`` of them, and
  ``W' * mean / W' == sum_r e_r / W``: the feedback it applies is unchanged (up to float32 rounding
  of the mean); how it was split between devices is not (it cannot be: the devices are others);
- **replicated leaves** (counts, PowerSGD's ``Q``, top-k's momentum of an exact leaf's mean, every
  optax state after the mean) are kept as they are;
- **the ZeRO state** (:class:`~jax_cgx.optax.ShardedState`): the master shards and the wrapped
  optimizer's per-parameter state are one flat array per parameter, padded to a multiple of the
  device count: unpadded and padded again, exactly; its error-feedback residuals (each device's
  whole flat gradient) get the old devices' mean, as above.

Everything is ``jax.numpy`` on global arrays, so it runs eagerly, under ``jax.jit`` (with the new
mesh's shardings as ``out_shardings``) and under ``jax.eval_shape``, which gives the saved layout's
shapes for orbax's restore target from the new state's (see :func:`resize_state`).
"""

from __future__ import annotations

import logging
import math
from collections import Counter

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jax_cgx._src.collectives.shards import spec_axes
from jax_cgx._src.optax import checks
from jax_cgx._src.optax.mean import CastMeanState, CompressedMeanState
from jax_cgx._src.optax.powersgd import PowerSGDState
from jax_cgx._src.optax.topk import TopKState
from jax_cgx._src.optax.zero import ShardedState

__all__ = ["resize_state"]

log = logging.getLogger("jax_cgx")

_FN = "jax_cgx.optax.resize_state"
_MEANS = (CompressedMeanState, CastMeanState, PowerSGDState, TopKState)
_NODES = (*_MEANS, ShardedState, optax.MultiStepsState)


class _Resizer:
    """One walk over a state: the new leaves, and a tally of what was done for the log line."""

    def __init__(self, params, world: int, shards: list[int] | None = None):
        with_paths, self.param_def = jax.tree_util.tree_flatten_with_path(params)
        self.param_leaves = [leaf for _, leaf in with_paths]
        self.param_paths = [p for p, _ in with_paths]
        # How many model shards each parameter is split into (1: not split).
        self.shards = shards or [1] * len(self.param_leaves)
        self.world = world
        self.old_worlds: set[int] = set()
        self.done: Counter = Counter()

    # --- per-device leaves of the means: each new device gets the old devices' mean ------------

    def averaged(self, what: str, tree, path):
        """``tree`` (like the parameters; placeholders kept) with each leaf's devices averaged."""
        if _empty(tree):  # no per-device state kept (error_feedback=False)
            return tree
        out = []
        names = [jax.tree_util.keystr((*path, *p)) for p in self.param_paths]
        for p, leaf, name in zip(self.param_leaves, self.param_def.flatten_up_to(tree), names):
            if checks.is_placeholder(leaf):
                out.append(leaf)
                continue
            out.append(self._average_devices(leaf, _shape(p), name))
            self.done[what] += 1
        return self.param_def.unflatten(out)

    def _average_devices(self, leaf, shape, name: str):
        """A global ``(W * m, ...)`` leaf (``W`` devices' ``(m, ...)`` blocks): the blocks' mean,
        repeated for ``self.world`` devices."""
        got = tuple(jnp.shape(leaf))
        if not shape or not shape[0] or len(got) != len(shape) or got[1:] != tuple(shape[1:]) or got[0] % shape[0]:
            raise ValueError(f"{_FN}: {name} has shape {got}, which is not a stack of per-device blocks of the "
                             f"parameter's shape {tuple(shape)}: pass the parameters this state was built for, and "
                             "the state as saved (global arrays, as shard_map with jax_cgx.optax.state_specs gives them)")
        old = got[0] // shape[0]
        self.old_worlds.add(old)
        mean = _device_mean(jnp.reshape(leaf, (old, *shape)))
        return jnp.concatenate([mean] * self.world, axis=0) if self.world > 1 else mean

    # --- the ZeRO state: flat, padded per parameter ----------------------------------------------

    def sharded(self, state: ShardedState, path) -> ShardedState:
        master = self.param_def.flatten_up_to(state.master)
        sizes = [math.prod(_shape(p)) for p in self.param_leaves]
        # An empty parameter's entries are placeholders: nothing to lay out.
        lengths = [None if checks.is_placeholder(m) else int(jnp.shape(m)[0]) for m in master]
        new = [m if checks.is_placeholder(m) else self._repad(m, n, k)
               for m, n, k in zip(master, sizes, self.shards)]
        self.done["ZeRO master shards"] += len(new)

        def inner(node):  # every parameter-like subtree of the wrapped optimizer's state is re-padded
            try:
                leaves = self.param_def.flatten_up_to(node)
            except (ValueError, TypeError):
                return None
            if all(checks.is_placeholder(x) if length is None else getattr(x, "shape", None) == (length,)
                   for x, length in zip(leaves, lengths)):
                self.done["ZeRO optimizer state leaves"] += len(leaves)
                return self.param_def.unflatten([x if length is None else self._repad(x, n, k)
                                                 for x, n, k, length in zip(leaves, sizes, self.shards, lengths)])
            return None

        def walk(node):
            resized = inner(node)
            if resized is not None:
                return resized
            children, rebuild = _children(node)
            if children is None:  # a leaf outside any parameter-like subtree: replicated, kept
                if any(length is not None and jnp.shape(node)[:1] == (length,) and length > 1 for length in lengths):
                    raise ValueError(f"{_FN}: the state at {jax.tree_util.keystr(path)}.inner holds a leaf of shape "
                                     f"{jnp.shape(node)} outside a parameter-like subtree: cannot tell how to lay it "
                                     "out again (the wrapped optimizer must be elementwise; see jax_cgx.optax.sharded)")
                return node
            return rebuild([walk(c) for c in children])

        residual = state.residual
        if not _empty(residual):
            res = self.param_def.flatten_up_to(residual)
            residual = self.param_def.unflatten([r if length is None else self._zero_residual(r, n, length, k)
                                                 for r, n, length, k in zip(res, sizes, lengths, self.shards)])
            self.done["ZeRO error-feedback residuals"] += len(res)
        return ShardedState(self.param_def.unflatten(new), walk(state.inner), state.skipped, residual)

    def _repad(self, flat, n: int, shards: int = 1):
        """A flat parameter padded for one device count, padded for ``self.world`` instead; split
        over ``shards`` model shards, each shard's flat values in turn (ZeRO's ``state_specs``)."""
        local = n // shards
        k = -(-local // self.world)
        rows = jnp.reshape(flat, (shards, -1))[:, :local]
        return jnp.reshape(jnp.pad(rows, ((0, 0), (0, self.world * k - local))), (-1,))

    def _zero_residual(self, flat, n: int, length: int, shards: int = 1):
        """Each device's whole flat gradient residual (``W * length`` in all; per model shard, its
        devices' in turn): their mean, re-padded, once per new device."""
        total = int(jnp.shape(flat)[0])
        if total % length:
            raise ValueError(f"{_FN}: a ZeRO residual of length {total} is not a whole number of devices' "
                             f"flat gradients of length {length}")
        old = total // length
        self.old_worlds.add(old)
        local = n // shards
        blocks = jnp.reshape(flat, (shards, old, length // shards))[:, :, :local]
        mean = jax.vmap(_device_mean)(blocks)  # (shards, local)
        k = -(-local // self.world)
        padded = jnp.pad(mean, ((0, 0), (0, self.world * k - local)))
        return jnp.reshape(jnp.tile(padded[:, None, :], (1, self.world, 1)), (-1,))


def _check_laid_out_as_params(state, resizer: _Resizer) -> None:
    """Every subtree of ``state`` with the parameters' structure, outside jax_cgx's per-device
    leaves (an optax state after the mean: Adam's moments), has their shapes: else the state is of
    other parameters, which averaging per-device blocks would not notice."""
    if resizer.param_def.num_nodes <= 1:  # a single array: any leaf has its structure
        return

    def visit(node, path):
        if isinstance(node, (*_MEANS, ShardedState)):
            return  # their per-device leaves are checked as they are laid out again
        if isinstance(node, optax.MultiStepsState):
            visit(node.inner_opt_state, (*path, jax.tree_util.GetAttrKey("inner_opt_state")))
            return
        if jax.tree.structure(node) == resizer.param_def:
            for p, leaf, where in zip(resizer.param_leaves, jax.tree.leaves(node), resizer.param_paths):
                if _shape(leaf) != _shape(p):
                    raise ValueError(
                        f"{_FN}: the state at {jax.tree_util.keystr(path)}{jax.tree_util.keystr(where)} has shape "
                        f"{_shape(leaf)} where the parameter has {_shape(p)}: it is the state of other parameters; pass "
                        "the parameters it was built for")
            return
        leaves_with_keys, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        if len(leaves_with_keys) == 1 and leaves_with_keys[0][1] is node:
            return
        for key, child in leaves_with_keys:
            visit(child, (*path, *key))

    visit(state, ())


def _model_shards(params, param_specs, mesh, axes: tuple) -> list[int] | None:
    """How many model shards each parameter's spec splits it into on ``mesh`` (None: no specs)."""
    if param_specs is None:
        return None
    if mesh is None:
        raise ValueError(f"{_FN}: param_specs needs mesh= too (the sizes of the model axes the specs name)")
    specs = jax.tree.leaves(param_specs, is_leaf=lambda s: isinstance(s, P))
    if len(specs) != len(jax.tree.leaves(params)):
        raise ValueError(f"{_FN}: param_specs must hold one PartitionSpec per parameter, got {len(specs)} for "
                         f"{len(jax.tree.leaves(params))} parameters")
    sizes = dict(mesh.shape)
    out = []
    for spec in specs:
        named = spec_axes(spec)
        if unknown := [a for a in named if a not in sizes or a in axes]:
            raise ValueError(f"{_FN}: the parameter spec {spec} names {unknown[0]!r}, which is not a model axis of "
                             f"the mesh {tuple(sizes)} (the data axis is {axes})")
        out.append(math.prod(sizes[a] for a in named))
    return out


def _device_mean(blocks):
    """The mean of the devices' blocks (axis 0), summed in at least float32 (complex leaves keep their
    imaginary part), in the blocks' dtype; one device's block comes back bitwise."""
    wide = jnp.promote_types(blocks.dtype, jnp.float32)
    return (jnp.sum(blocks.astype(wide), axis=0) / blocks.shape[0]).astype(blocks.dtype)


def _empty(tree) -> bool:
    return isinstance(tree, tuple) and len(tree) == 0


def _shape(x) -> tuple:
    return tuple(getattr(x, "shape", None) or jnp.shape(x))


def _children(node):
    """``(children, rebuild)`` of a pytree node, ``(None, None)`` for a leaf."""
    leaves, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1 and leaves[0] is node:
        return None, None
    return leaves, treedef.unflatten


def resize_state(state, params, axis_name, *, world: int, saved_world: int | None = None, param_specs=None,
                 mesh=None):
    """``state``, saved on ``W`` devices, laid out for ``world`` devices (``W`` read off its shapes).

    ``state`` is any optax state holding jax_cgx's (alone, in ``optax.chain``, ``named_chain``,
    ``inject_hyperparams``, ``MultiSteps``, nested) or a :class:`~jax_cgx.optax.ShardedState`, as
    global arrays: what ``shard_map`` with :func:`~jax_cgx.optax.state_specs` (or the ZeRO
    optimizer's ``state_specs``) returns, and what an orbax checkpoint of it restores. ``params``:
    the parameters (or ``jax.ShapeDtypeStruct``\\ s) it was built for. Returns the state for a
    mesh of ``world`` devices along ``axis_name``, to pass into ``shard_map`` with the same specs.

    What is kept and what is not (one INFO line says what was done):

    - error feedback (``compressed_mean``'s residuals, PowerSGD's error, top-k's velocity) and the
      other per-device leaves (top-k's momentum, a ``MultiSteps`` accumulator before a mean): each
      new device gets the mean of the old devices' leaves, so the sum the next reduction applies,
      ``sum_r e_r / W``, is unchanged (to float32 rounding); which device held what is not kept;
    - counts, PowerSGD's warm-start ``Q``, the state of optax transformations after the mean:
      kept bitwise;
    - the ZeRO optimizer: master parameters and the wrapped optimizer's moments kept bitwise
      (re-padded); its residuals averaged as above.

    Restoring a checkpoint saved on 8 devices onto 4 with orbax (the saved layout's shapes come
    from the new state's, through this function under ``jax.eval_shape``)::

        new = jax.eval_shape(init_on_the_new_mesh, params)                 # the state for 4 devices
        saved = jax.eval_shape(lambda s: resize_state(s, params, "data", world=8), new)
        replicated = NamedSharding(mesh, P())
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), saved)
        restored = orbax.checkpoint.StandardCheckpointer().restore(path, target)
        state = jax.jit(lambda s: resize_state(s, params, "data", world=4), out_shardings=shardings)(restored)

    Parameters also split over model axes (tensor parallelism, FSDP) keep their split: only the
    data axis changes. The means' per-device leaves need nothing more (``state_specs`` puts the data
    axis first); the ZeRO state holds each model shard's flat parameter in turn, so give it
    ``param_specs`` (the parameters' ``PartitionSpec``\\ s) and the ``mesh`` (whose model axes
    say how many shards each spec makes).

    ``saved_world``: the device count the state was saved on, if known (say, in the checkpoint's
    metadata). ``W`` is otherwise read off the per-device leaves, which cannot tell the state of a
    ``(64, 64)`` parameter on 8 devices from that of a ``(32, 64)`` one on 16: given, every leaf must
    agree with it. Without it, the state's leaves laid out as the parameters (Adam's moments, say)
    must have the parameters' shapes.

    Raises a ``ValueError`` naming the leaf when a per-device leaf is not a stack of the
    parameter's blocks, when the per-device leaves disagree on ``W`` (or with ``saved_world``), or
    when a leaf laid out as the parameters has another shape: the state of other parameters.

    Args:
      state: the optax state as saved: global arrays (or ``jax.ShapeDtypeStruct``\\ s under
        ``jax.eval_shape``), laid out for ``W`` devices.
      params: the parameters (or ``jax.ShapeDtypeStruct``\\ s) the state was built for.
      axis_name: the data axis (or a tuple of axes) the state's per-device leaves are split over.
      world: the number of devices along ``axis_name`` to lay the state out for (>= 1).
      saved_world: ``W``, where known (see above); None (the default): read off the state.
      param_specs: for a ZeRO state of parameters split over model axes, a ``PartitionSpec`` per
        parameter; None (the default): no model axes.
      mesh: with ``param_specs``, the mesh whose model axes they name.

    Returns:
      A state with the structure of ``state``, its per-device leaves laid out for ``world``
      devices; ``state`` itself where it was saved on ``world`` devices already.

    Raises:
      ValueError: as above; ``world`` or ``saved_world`` not an integer >= 1; ``axis_name`` empty or
        not axis names; ``param_specs`` without ``mesh``, not one spec per parameter, or naming an
        axis that is not a model axis of ``mesh``.
    """
    world = checks.check_int(_FN, "world", world, minimum=1)
    if saved_world is not None:
        saved_world = checks.check_int(_FN, "saved_world", saved_world, minimum=1)
    axes = checks.check_axes(_FN, axis_name)
    resizer = _Resizer(params, world, _model_shards(params, param_specs, mesh, axes))

    def node(path, x):
        if isinstance(x, CompressedMeanState):
            return x._replace(residual=resizer.averaged("compressed_mean residuals", x.residual,
                                                        (*path, jax.tree_util.GetAttrKey("residual"))))
        if isinstance(x, TopKState):
            # u is per device where v is (a compressed leaf); elsewhere it is the momentum of the mean.
            entries = resizer.param_def.flatten_up_to(x.v)
            u_entries = resizer.param_def.flatten_up_to(x.u)
            per_device = [checks.placeholder() if checks.is_placeholder(v) else u for u, v in zip(u_entries, entries)]
            averaged_u = resizer.param_def.flatten_up_to(resizer.averaged(
                "top-k momenta", resizer.param_def.unflatten(per_device), (*path, jax.tree_util.GetAttrKey("u"))))
            u = [a if not checks.is_placeholder(v) else u for a, u, v in zip(averaged_u, u_entries, entries)]
            return TopKState(x.count, resizer.param_def.unflatten(u),
                             resizer.averaged("top-k velocities", x.v, (*path, jax.tree_util.GetAttrKey("v"))))
        if isinstance(x, PowerSGDState):
            return x._replace(error=resizer.averaged("PowerSGD errors", x.error,
                                                     (*path, jax.tree_util.GetAttrKey("error"))))
        if isinstance(x, ShardedState):
            return resizer.sharded(x, path)
        if isinstance(x, optax.MultiStepsState):
            inner = jax.tree_util.tree_map_with_path(node, x.inner_opt_state, is_leaf=lambda n: isinstance(n, _NODES))
            holds_mean = any(isinstance(n, _MEANS) for n in jax.tree.leaves(
                x.inner_opt_state, is_leaf=lambda n: isinstance(n, _MEANS)))
            acc = x.acc_grads
            if holds_mean:  # before the mean: each device's own running mean
                acc = resizer.averaged("MultiSteps accumulators", acc, (*path, jax.tree_util.GetAttrKey("acc_grads")))
            return x._replace(inner_opt_state=inner, acc_grads=acc)
        return x

    _check_laid_out_as_params(state, resizer)
    out = jax.tree_util.tree_map_with_path(node, state, is_leaf=lambda n: isinstance(n, _NODES))
    if len(resizer.old_worlds) > 1:
        raise ValueError(f"{_FN}: the state's per-device leaves were laid out for different device counts "
                         f"{sorted(resizer.old_worlds)}: it is not one saved state of these parameters")
    if saved_world is not None and resizer.old_worlds and resizer.old_worlds != {saved_world}:
        raise ValueError(f"{_FN}: the state's per-device leaves are laid out for {resizer.old_worlds.pop()} devices "
                         f"with these parameters, not the saved_world={saved_world} given: it is the state of other "
                         "parameters (or of another device count)")
    old = next(iter(resizer.old_worlds), None)
    what = ", ".join(f"{n} {k}" for k, n in sorted(resizer.done.items())) or "no per-device leaves"
    if old is None and not resizer.done:
        log.info("jax_cgx: %s: no per-device leaves; the state is kept as it is", _FN)
    elif old is None:  # ZeRO shards without residuals: re-padded, whatever the old count was
        log.info("jax_cgx: %s: laid out for %d devices: %s re-padded exactly; counts and replicated leaves kept",
                 _FN, world, what)
    elif old == world:  # averaging would merge what each device holds: nothing to do
        log.info("jax_cgx: %s: the state was saved on %d devices already; kept as it is", _FN, world)
        return state
    else:
        log.info("jax_cgx: %s: %d -> %d devices: %s laid out again (per-device leaves: each new device holds the old "
                 "devices' mean, so the error feedback the next step applies is unchanged; ZeRO shards re-padded "
                 "exactly); counts and replicated leaves kept", _FN, old, world, what)
    return out
