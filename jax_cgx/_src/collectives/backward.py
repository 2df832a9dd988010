"""``reduce_in_backward``: a gradient is averaged as soon as the backward pass produces it.

PyTorch DDP reduces a layer's gradient while backward still runs for the layers below it.
In JAX, the same comes from marking each layer's parameters where the forward pass uses
them::

    def apply(params, x):
        for layer in params:
            layer = jax_cgx.reduce_in_backward(layer, "data", config)   # identity forward
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        return x

``reduce_in_backward`` is the identity going forward. Its transpose, which runs the moment
the layer's cotangent is complete (after the layer's own backward, before the layers
below), is ``compressed_pmean`` of that cotangent: the gradient that comes out of
``jax.grad`` is already averaged, one reduction per marked subtree, issued in backward
order. What this buys depends on the platform:

- **GPU**: the reductions sit in the program between the backward layers, and XLA's
  latency-hiding scheduler may run a layer's exchange while computing the next layer's
  gradients (the xla backend's collectives are asynchronous there; the nccl backend's
  custom call runs on the compute stream, so it orders rather than overlaps).
- **CPU**: XLA:CPU runs a process's work in order (one thunk after another), so nothing
  overlaps; the reductions only move earlier. docs/performance.md has the measurement.

Gradients are those of ``compressed_pmean`` applied to each marked subtree's gradient after
``jax.grad`` (bitwise: tests/collectives/test_backward.py). Marking the whole parameter tree
once is exactly ``compressed_pmean(jax.grad(...))``. Under ``shard_map(check_vma=True)`` the
forward also types replicated parameters as varying over the axis (what
``lax.pcast(params, axis, to="varying")`` does in the user guide's recipe), so that the gradient
reaching the transpose is this rank's own, not one JAX has summed already.

Error feedback needs the residual of each step carried into the next, which a transpose
cannot return: use :func:`jax_cgx.optax.compressed_mean` for it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_cgx._src import compat
from jax_cgx._src.codec import Impl, check_impl
from jax_cgx._src.collectives.plan import ConfigSpec, LeafConfigs
from jax_cgx._src.collectives.psum import compressed_pmean
from jax_cgx._src.collectives.shards import SpecTree, per_leaf

__all__ = ["reduce_in_backward"]


def reduce_in_backward(tree, axis_name, config: ConfigSpec = None, *, key: jax.Array | None = None,
                       impl: Impl = "auto", specs: SpecTree = None):
    """The identity on ``tree``, whose gradient is ``compressed_pmean``'d over ``axis_name``.

    Args:
      tree: a pytree of arrays, typically one layer's parameters, where the forward pass
        uses them.
      axis_name: the mapped axis name(s) to average over, as for :func:`compressed_pmean`.
      config: as for :func:`compressed_pmean` (a config, a pytree of them, a function of
        the leaf's path, or None: ``CompressionConfig()``'s defaults, or torch_cgx's where its
        ``CGX_*`` variables are set).
      key: a PRNG key for stochastic rounding; give each marked subtree its own (e.g.
        ``jax.random.fold_in(step_key, layer_index)``), the same on every rank.
      impl: the codec implementation, as for :func:`compressed_pmean`.
      specs: on a mesh with axes the enclosing ``shard_map`` leaves to XLA's partitioner (tensor
        parallelism, FSDP), how each leaf is sharded over them, as for :func:`~jax_cgx.compressed_psum`:
        each device then compresses its own shard of the gradient.

    Returns:
      ``tree`` unchanged (typed as varying over ``axis_name`` under ``check_vma``).

    Raises:
      ValueError: an unknown ``impl``; in the backward pass, what :func:`compressed_pmean` raises.
      NameError: an axis of ``axis_name`` that is not bound (outside ``shard_map``/``pmap``).
      TypeError: ``key`` that is not one PRNG key.

    Examples:
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> def grad_of(w, x):  # x: this device's rows; w's gradient leaves backward averaged over "data"
      ...     loss = lambda w: jnp.sum(x @ jax_cgx.reduce_in_backward(w, "data", jax_cgx.CompressionConfig(bits=8)))
      ...     return jax.grad(loss)(w)
      >>> f = jax.jit(jax.shard_map(grad_of, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
      >>> x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data")))
      >>> f(jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P())), x)[0, :2]
      Array([1., 1.], dtype=float32)
    """
    check_impl(impl)
    compat.check_prng_key(key, "reduce_in_backward")
    axes = compat.axes_tuple(axis_name)
    compat.check_axis_names(axes, "reduce_in_backward")
    leaves, treedef = jax.tree.flatten(tree)
    varying = [compat.is_varying(jax.typeof(v), axes) for v in leaves] if compat.check_vma_enabled() else None
    # One spec per leaf, in a tuple: custom_vjp's static arguments must be hashable.
    leaf_specs = None if specs is None else tuple(per_leaf("reduce_in_backward", specs, tree))
    out = _identity(axes, config, impl, treedef, tuple(varying) if varying is not None else None, leaf_specs, key,
                    *leaves)
    return treedef.unflatten(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _identity(axes, config, impl, treedef, varying, specs, key, *leaves):
    return tuple(compat.ensure_varying(v, axes) for v in leaves) if varying is not None else tuple(leaves)


def _identity_fwd(axes, config, impl, treedef, varying, specs, key, *leaves):
    return _identity(axes, config, impl, treedef, varying, specs, key, *leaves), key


def _identity_bwd(axes, config, impl, treedef, varying, specs, key, cotangents):
    # Integer and bool leaves (a step counter in a marked layer state) have float0 cotangents:
    # no gradient, nothing to reduce. They stay out (None), the paths of the others unchanged.
    none = [jnp.result_type(c) == jax.dtypes.float0 for c in cotangents]
    real = [None if n else compat.ensure_varying(c, axes) for c, n in zip(cotangents, none)]
    if isinstance(config, LeafConfigs):  # resolved for every leaf: keep those of the leaves reduced
        config = LeafConfigs(leaf_config for leaf_config, n in zip(config, none) if not n)
    reduced = compressed_pmean(treedef.unflatten(real), axes, config, key=key, impl=impl,
                               specs=None if specs is None else treedef.unflatten(specs))
    mean = [c if n else m for c, m, n in zip(cotangents, treedef.flatten_up_to(reduced), none)]
    if varying is not None:  # a leaf that came in varying gets a varying cotangent back
        mean = [compat.ensure_varying(m, axes) if v and not n else m for m, v, n in zip(mean, varying, none)]
    return (None, *mean)


_identity.defvjp(_identity_fwd, _identity_bwd)
