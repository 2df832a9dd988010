"""What :func:`~jax_cgx.data_parallel_value_and_grad` does with mesh axes besides the data axes.

Tensor parallelism and FSDP shard the parameters over axes such as ``"model"``, ``"fsdp"`` or
``"tensor"``, which the step leaves to XLA's partitioner: it runs the loss sharded as the
parameters and the batch are. Only the data axes are mapped by hand. Each parameter's spec over
the other axes (:func:`param_specs`) goes to :func:`~jax_cgx.compressed_pmean`, which compresses
every device's own shard of its gradient (:mod:`jax_cgx._src.collectives.shards`), so the
gradient keeps its parameter's sharding.

``Explicit`` axes need one more step (:func:`data_shard_map`): jax lowers a ``shard_map`` manual
over some axes with the ``Explicit`` others closed to the partitioner, as replicated, so every
parameter and gradient would be gathered over them at its boundary, compressed or not. The step
runs with them ``Auto`` instead (``jax.sharding.auto_axes``), their specs read off the
parameters' types first, and each gradient leaves with its parameter's sharding.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jax_cgx._src import compat
from jax_cgx._src.collectives.shards import checked_spec, per_leaf, spec_of
from jax_cgx._src.data_parallel.checks import API

__all__ = ["model_axes", "param_specs", "data_shard_map"]


def _axis_type(mesh, axis: str):
    return dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()))).get(axis)


def model_axes(mesh, axes: tuple) -> tuple[str, ...]:
    """The mesh axes besides ``axes`` (tensor, FSDP), when together they span more than one device."""
    rest = tuple(a for a in mesh.axis_names if a not in axes)
    return rest if math.prod(mesh.shape[a] for a in rest) > 1 else ()


def param_specs(params, given, mesh, axes: tuple, model: tuple):
    """Each parameter's ``PartitionSpec`` over the ``model`` axes (a pytree like ``params``; None
    where unknown), checked (:func:`~jax_cgx._src.collectives.shards.checked_spec`): ``given`` (a
    prefix of ``params``), else the parameter's type where the axes are ``Explicit``, else the
    ``NamedSharding`` of an array (``grad_fn`` called outside ``jax.jit``)."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    explicit = any(_axis_type(mesh, a) == AxisType.Explicit for a in model)

    def spec(path, s, p):
        where = f"params{jax.tree_util.keystr(path)}"
        s = spec_of(s, API, where, "param_specs")
        if s is None:
            typed = getattr(getattr(jax.typeof(p), "sharding", None), "spec", None)
            sharding = None if compat.is_tracer(p) else getattr(p, "sharding", None)
            if explicit and typed is not None:
                s = typed  # the type is the sharding, replicated included
            elif isinstance(sharding, jax.sharding.NamedSharding):
                s = sharding.spec
            else:
                return None  # Auto axes under jit: compressed_pmean says it reduces such a leaf whole
        return checked_spec(API, where, s, jnp.shape(p), axes, model, mesh)

    given = per_leaf(API, given, params, "param_specs", "params")
    return treedef.unflatten([spec(path, s, p) for (path, p), s in zip(with_paths, given)])


def data_shard_map(body, mesh, axes: tuple, model: tuple, specs, *, in_specs, out_specs):
    """``jax.shard_map(body)`` manual over ``axes`` alone, the ``model`` axes left to the
    partitioner; ``Explicit`` model axes made ``Auto`` for it, the gradients (``body``'s last
    result) leaving with ``specs`` (their parameters')."""
    explicit = tuple(a for a in model if _axis_type(mesh, a) == AxisType.Explicit)
    if not explicit:
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=frozenset(axes))
    # The mesh as the step sees it: its Explicit model axes Auto (what auto_axes makes the context).
    step_mesh = mesh.update(axis_types=tuple(AxisType.Auto if a in explicit else t
                                             for a, t in zip(mesh.axis_names, mesh.axis_types)))
    mapped = jax.shard_map(body, mesh=step_mesh, in_specs=in_specs, out_specs=out_specs, axis_names=frozenset(axes))
    grad_specs = jax.tree.map(lambda s: P() if s is None else s, specs, is_leaf=lambda s: s is None)
    out_sharding = (*out_specs[:-1], grad_specs)

    def run(*args):
        with jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh)):
            return jax.sharding.auto_axes(mapped, axes=explicit, out_sharding=out_sharding)(*args)

    return run
