"""``state_specs``: the ``shard_map`` PartitionSpecs of any optax state that holds jax_cgx's.

jax_cgx's transformations keep some state per device (what each device's compression left out:
error-feedback residuals, top-k's momentum and velocity, PowerSGD's error). Under ``jax.shard_map``
that state must enter and leave with a spec that splits it over the data axis, and everything else
with a replicated one. One walk over the state pytree gives both, whatever optax container the
states sit in (``chain``, ``named_chain``, ``inject_hyperparams``, ``MultiSteps``,
``apply_if_finite``, nested).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jax_cgx._src.collectives.shards import check_divides, local_shape, spec_axes
from jax_cgx._src.optax import checks
from jax_cgx._src.optax.mean import CastMeanState, CompressedMeanState
from jax_cgx._src.optax.powersgd import PowerSGDState
from jax_cgx._src.optax.topk import TopKState

__all__ = ["state_specs", "shard_shapes"]

_MEANS = (CompressedMeanState, CastMeanState, PowerSGDState, TopKState)  # the states of jax_cgx's means
_NODES = (*_MEANS, optax.MultiStepsState)  # what the walk stops at; everything else is a plain leaf


def _holds_a_mean(tree) -> bool:
    return any(isinstance(n, _MEANS) for n in jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, _MEANS)))


def state_specs(state, axis_name, param_specs=None):
    """PartitionSpecs of an optax ``state`` for ``jax.shard_map``'s ``in_specs`` and ``out_specs``.

    ``state`` is any optax state (it may be abstract: ``jax.eval_shape(tx.init, params)``) that
    holds states of jax_cgx's transformations anywhere: alone, or in ``optax.chain``,
    ``named_chain``, ``inject_hyperparams``, ``MultiSteps``, ``apply_if_finite``, nested. The
    result has the structure of ``state``, one spec per leaf::

        tx = optax.chain(compressed_mean("data", config, error_feedback=True), optax.adam(1e-3))
        specs = state_specs(jax.eval_shape(tx.init, params), "data")
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    **Per device**, ``P(axis_name)`` (the global array is the devices' arrays concatenated along
    axis 0, so a leaf of shape ``(m, ...)`` is a global ``(W * m, ...)`` array):

    - :class:`CompressedMeanState`: the error-feedback residuals;
    - :class:`TopKState`: the compressed leaves' momentum ``u`` and velocity ``v``;
    - :class:`PowerSGDState`: the compressed leaves' error;
    - ``optax.MultiStepsState`` around one of jax_cgx's means: ``acc_grads``, the running mean of
      each device's own gradients, taken before the mean inside averages them.

    **Replicated**, ``P()``: every other leaf. That is jax_cgx's step counts, top-k's momentum of an uncompressed leaf's mean and PowerSGD's ``Q`` (means, the
    same on every device), and all the state of optax's own transformations. The latter is right for
    a transformation that runs *after* jax_cgx's mean (``adam`` in the chain above,
    ``apply_if_finite``, schedules, ``inject_hyperparams``' hyperparameters): it is computed from the
    mean, the same on every device, so its state is too. A transformation chained *before* the mean
    sees each device's own gradient, and its state (``optax.trace``'s momentum, say) differs between
    devices, which no walk of the state can tell: put jax_cgx's mean first in the chain, as the
    transformations are meant to be used. Under ``shard_map``'s default ``check_vma=True`` the
    mistake does not pass silently: ``shard_map`` refuses to return a value that varies over
    ``axis_name`` with the spec ``P()``.

    Where a transformation keeps nothing for a leaf its state holds ``optax.MaskedNode()``, a node
    without leaves; the specs hold it too.

    **Parameters sharded over model axes** (tensor parallelism, FSDP: a ``shard_map`` over
    ``("data", "model")`` whose ``in_specs`` split the parameters over ``"model"``): pass their
    specs as ``param_specs`` (a ``PartitionSpec`` per parameter, or a pytree prefix of them). A
    per-device leaf is then each device's block of its parameter's shard, and its spec splits
    axis 0 over ``axis_name`` first and the parameter's own axes after, the others as the
    parameter does: ``P(None, "model")`` gives ``P("data", "model")``, ``P("model", None)`` gives
    ``P(("data", "model"), None)``. The state to pass is then one device's: the transformations
    see each device's shards, and their layer filters (``layer_min_size``, ``min_size``) judge
    those, so build it from :func:`shard_shapes`::

        local = jax_cgx.optax.shard_shapes(params, param_specs, mesh)
        specs = state_specs(jax.eval_shape(tx.init, local), "data", param_specs=param_specs)

    PowerSGD's factors would be each shard's: refused there.
    Replicated leaves of a transformation after the mean (Adam's
    moments) follow the parameters they belong to where their structure is the parameters'
    (``P()`` otherwise: give that state its specs yourself).

    Raises a ``ValueError`` for a ``MultiSteps`` accumulator of a scalar parameter: it differs
    between devices but has no axis for ``shard_map`` to split.

    Args:
      state: the optax state, concrete or abstract (``jax.ShapeDtypeStruct`` leaves).
      axis_name: the data axis (or a tuple of axes) jax_cgx's transformations average over, as
        given to them.
      param_specs: ``None`` (the default: parameters not sharded over model axes), or a
        ``PartitionSpec`` per parameter (a pytree like the parameters, or a prefix of it).

    Returns:
      A pytree with the structure of ``state``: a ``PartitionSpec`` per leaf (``optax.MaskedNode()``
      kept where the state holds one).

    Raises:
      ValueError: ``axis_name`` empty or not axis names; a ``MultiSteps`` accumulator of a scalar
        parameter (above); a spec of ``param_specs`` that names an axis of ``axis_name``.
      TypeError: ``param_specs`` with a leaf that is not a ``PartitionSpec``.
      NotImplementedError: a :class:`PowerSGDState` in ``state`` given ``param_specs``.
    """
    axes = checks.check_axes("jax_cgx.optax.state_specs", axis_name)
    split = P(axes[0] if len(axes) == 1 else axes)
    params = _ParamSpecs(axes, param_specs)

    def per_device(tree):  # placeholders (optax.MaskedNode) have no leaves: tree.map passes over them
        return params.map(tree, params.split_first) if params else jax.tree.map(lambda _: split, tree)

    def replicated(tree):
        return jax.tree.map(lambda _: P(), tree)

    def of_params(tree):  # the same on every data device, sharded as the parameters
        return params.map(tree, lambda spec: spec) if params else replicated(tree)

    def accumulated(path, g):
        if not getattr(g, "shape", ()):
            raise ValueError(
                f"jax_cgx.optax.state_specs: the MultiSteps state's {jax.tree_util.keystr(path)} accumulates each "
                "device's own gradient of a scalar parameter: it differs between devices but has no axis to split "
                f"over {axis_name!r}. Give that parameter the shape (1,)."
            )
        return split

    def node(path, x):
        if isinstance(x, CompressedMeanState):
            return CompressedMeanState(P(), per_device(x.residual))
        if isinstance(x, TopKState):  # u is per device only where v is: a compressed leaf
            u = jax.tree.map(lambda u, own, mean, v: u if checks.is_placeholder(u) else own
                             if not checks.is_placeholder(v) else mean,
                             x.u, per_device(x.u), of_params(x.u), x.v, is_leaf=checks.is_placeholder)
            return TopKState(P(), u, per_device(x.v))
        if isinstance(x, PowerSGDState):
            if params:
                raise NotImplementedError(
                    "jax_cgx.optax.state_specs: PowerSGD with parameters sharded over model axes (param_specs) is not "
                    "supported: its factors would be of each device's shard. Use compressed_mean or topk_mean there")
            return PowerSGDState(P(), replicated(x.q), per_device(x.error))
        if isinstance(x, CastMeanState):
            return x
        if isinstance(x, optax.MultiStepsState):
            inner = jax.tree_util.tree_map_with_path(node, x.inner_opt_state, is_leaf=stop)
            if not _holds_a_mean(x.inner_opt_state):  # after the mean: it accumulates means
                return replicated(x)._replace(inner_opt_state=inner, acc_grads=of_params(x.acc_grads))
            if params:
                return replicated(x)._replace(inner_opt_state=inner, acc_grads=per_device(x.acc_grads))
            at = (*path, jax.tree_util.GetAttrKey("acc_grads"))
            acc = jax.tree_util.tree_map_with_path(lambda p, g: accumulated((*at, *p), g), x.acc_grads)
            return replicated(x)._replace(inner_opt_state=inner, acc_grads=acc)
        if params and params.shaped_like(x):  # an optax state after the mean with the parameters' structure
            return of_params(x)
        return P()

    def stop(n):
        return isinstance(n, _NODES) or (bool(params) and params.shaped_like(n))

    return jax.tree_util.tree_map_with_path(node, state, is_leaf=stop)


def shard_shapes(params, param_specs, mesh):
    r"""``jax.ShapeDtypeStruct``\ s of one device's shard of each parameter sharded as
    ``param_specs`` (a pytree of ``PartitionSpec``\ s like ``params``) on ``mesh``: what a
    transformation sees inside a ``shard_map`` that splits the parameters over model axes, for
    ``jax.eval_shape(tx.init, ...)`` before :func:`state_specs`.

    Args:
      params: the parameters: a pytree of arrays or ``jax.ShapeDtypeStruct``\ s.
      param_specs: a ``PartitionSpec`` per parameter, a pytree with the structure of ``params``.
      mesh: the mesh the specs name the axes of (a ``jax.sharding.Mesh`` or ``AbstractMesh``).

    Returns:
      A pytree like ``params`` of ``jax.ShapeDtypeStruct``: each parameter's dtype, and its shape with
      every dimension divided by the sizes of the mesh axes its spec splits it over.

    Raises:
      ValueError: a dimension that the sizes of its mesh axes do not divide (``shard_map`` would
        refuse the parameter), named by its path.

    Examples:
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
      >>> jax_cgx.optax.shard_shapes({"w": jnp.zeros((16, 64))}, {"w": P(None, "model")}, mesh)["w"].shape
      (16, 32)
    """
    def shard(path, p, spec):
        check_divides(jnp.shape(p), spec, mesh, f"jax_cgx.optax.shard_shapes: params{jax.tree_util.keystr(path)}")
        return jax.ShapeDtypeStruct(local_shape(jnp.shape(p), spec, mesh), jnp.result_type(p))

    return jax.tree_util.tree_map_with_path(shard, params, param_specs, is_leaf=lambda x: isinstance(x, P))


class _ParamSpecs:
    """The parameters' specs over model axes, and the specs of state laid out like them."""

    def __init__(self, axes: tuple, param_specs):
        self.axes = axes
        self.treedef = None
        if param_specs is None:
            return
        is_spec = lambda s: isinstance(s, P)  # noqa: E731
        leaves, self.treedef = jax.tree.flatten(param_specs, is_leaf=is_spec)
        self.spec_leaves = leaves
        if not all(is_spec(s) for s in leaves):
            raise TypeError("jax_cgx.optax.state_specs: param_specs must be a pytree of PartitionSpecs, one per "
                            f"parameter, got {[type(s).__name__ for s in leaves if not is_spec(s)][:1]}")
        for spec in leaves:
            if set(axes) & set(spec_axes(spec)):
                raise ValueError(f"jax_cgx.optax.state_specs: the parameter spec {spec} names {axes}, the axis the "
                                 "mean is taken over: shard parameters over a separate axis (FSDP: 'fsdp')")

    def __bool__(self) -> bool:
        return self.treedef is not None

    def shaped_like(self, tree) -> bool:
        try:
            return jax.tree.structure(tree) == self.treedef and self.treedef.num_leaves > 0
        except Exception:  # noqa: BLE001 - an unhashable or odd node is simply not the parameters' tree
            return False

    def map(self, tree, fn):
        """``fn(spec)`` at each parameter's place in ``tree`` (laid out like the parameters;
        placeholders kept)."""
        entries = self.treedef.flatten_up_to(tree)
        return self.treedef.unflatten([e if checks.is_placeholder(e) else fn(spec)
                                       for e, spec in zip(entries, self.spec_leaves)])

    def split_first(self, spec: P) -> P:
        """A per-device leaf's spec: axis 0 split over the data axes first, then as ``spec`` splits it."""
        entries = list(spec) or [None]
        first = entries[0]
        first = () if first is None else (first,) if isinstance(first, str) else tuple(first)
        joined = (*self.axes, *first)
        return P(joined[0] if len(joined) == 1 else joined, *entries[1:])


# The names under which the helper was first published, one per transformation; the walk is the
# same for every state, so they are the same function.
compressed_mean_state_specs = state_specs
topk_state_specs = state_specs
