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
import optax
from jax.sharding import PartitionSpec as P

from jax_cgx._src.optax import checks
from jax_cgx._src.optax.mean import CastMeanState, CompressedMeanState
from jax_cgx._src.optax.powersgd import PowerSGDState
from jax_cgx._src.optax.topk import TopKState

__all__ = ["state_specs"]

_MEANS = (CompressedMeanState, CastMeanState, PowerSGDState, TopKState)  # the states of jax_cgx's means
_NODES = (*_MEANS, optax.MultiStepsState)  # what the walk stops at; everything else is a plain leaf


def _holds_a_mean(tree) -> bool:
    return any(isinstance(n, _MEANS) for n in jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, _MEANS)))


def state_specs(state, axis_name):
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

    Raises a ``ValueError`` for a ``MultiSteps`` accumulator of a scalar parameter: it differs
    between devices but has no axis for ``shard_map`` to split.
    """
    axes = checks.check_axes("jax_cgx.optax.state_specs", axis_name)
    split = P(axes[0] if len(axes) == 1 else axes)

    def per_device(x):  # placeholders (optax.MaskedNode) have no leaves: tree.map passes over them
        return split

    def replicated(tree):
        return jax.tree.map(lambda _: P(), tree)

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
            return CompressedMeanState(P(), jax.tree.map(per_device, x.residual))
        if isinstance(x, TopKState):  # u is per device only where v is: a compressed leaf
            u = jax.tree.map(lambda u, v: u if checks.is_placeholder(u) else split if not checks.is_placeholder(v)
                             else P(), x.u, x.v, is_leaf=checks.is_placeholder)
            return TopKState(P(), u, jax.tree.map(per_device, x.v))
        if isinstance(x, PowerSGDState):
            return PowerSGDState(P(), replicated(x.q), jax.tree.map(per_device, x.error))
        if isinstance(x, CastMeanState):
            return x
        if isinstance(x, optax.MultiStepsState):
            inner = jax.tree_util.tree_map_with_path(
                node, x.inner_opt_state, is_leaf=lambda n: isinstance(n, _NODES))
            if not _holds_a_mean(x.inner_opt_state):  # after the mean: it accumulates means
                return replicated(x)._replace(inner_opt_state=inner)
            at = (*path, jax.tree_util.GetAttrKey("acc_grads"))
            acc = jax.tree_util.tree_map_with_path(lambda p, g: accumulated((*at, *p), g), x.acc_grads)
            return replicated(x)._replace(inner_opt_state=inner, acc_grads=acc)
        return P()

    return jax.tree_util.tree_map_with_path(node, state, is_leaf=lambda n: isinstance(n, _NODES))


# The names under which the helper was first published, one per transformation; the walk is the
# same for every state, so they are the same function.
compressed_mean_state_specs = state_specs
topk_state_specs = state_specs
