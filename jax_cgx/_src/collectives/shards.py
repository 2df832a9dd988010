"""Compressed reductions on meshes with axes left to XLA's partitioner: each device its own shard.

Large models are sharded: tensor parallelism or FSDP over a ``"model"`` (``"fsdp"``, ``"tensor"``)
axis the step leaves to XLA's partitioner (``Auto`` or ``Explicit``), data parallelism over a
``"data"`` axis mapped by hand (``jax.shard_map(..., axis_names={"data"})``). Inside such a
``shard_map`` a gradient is still a global array over the model axes, sharded as its parameter.
XLA's partitioner cannot split jax_cgx's custom calls, so left to it, it gathers the whole gradient
onto every device of the model axes, quantizes it there and returns it replicated: memory for the
whole model on every device, traffic over the model axes, and an optimizer that must reshard.

Here the reduction runs in a nested ``shard_map`` manual over those remaining axes (the *free*
axes), each leaf entering with its own ``PartitionSpec``: every device quantizes and sends only
its shard, over the reduced axes, to the devices holding the same shard, and each result leaves
with its leaf's sharding. A leaf's spec comes from the caller (``specs=``), else from its type
where the axes are ``Explicit``; where it is unknown (``Auto`` axes under ``jax.jit``, whose
shardings are decided after tracing) the leaf is reduced whole on every device, as before, and one
warning says so and how to pass the specs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_cgx._src import compat

__all__ = ["free_axes", "leaf_specs", "per_leaf", "spec_of", "spec_axes", "checked_spec", "split_alike", "on_own_shards", "local_shape", "SpecTree"]

log = logging.getLogger("jax_cgx")

# A PartitionSpec (or NamedSharding) per leaf, a pytree prefix of the leaves, or None.
SpecTree = object

_warned: set = set()


def free_axes() -> tuple[str, ...]:
    """The axes of the enclosing mesh that the trace does not map by hand (``Auto`` or
    ``Explicit``), when together they span more than one device; ``()`` otherwise (outside a mesh,
    inside ``pmap``, a ``shard_map`` manual over every axis, or free axes all of size 1)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    manual = set(getattr(mesh, "manual_axes", ()))
    axes = tuple(a for a in mesh.axis_names if a not in manual)
    return axes if math.prod(mesh.shape[a] for a in axes) > 1 else ()


def _entries(spec) -> list[tuple[str, ...]]:
    """Each dimension's mesh axes, as tuples (``None`` -> ``()``)."""
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]


def spec_axes(spec) -> tuple[str, ...]:
    """Every mesh axis ``spec`` splits some dimension over, in order."""
    return tuple(a for axes in _entries(spec) for a in axes)


def spec_of(given, api: str, where: str, name: str = "specs"):
    """``given`` as a ``PartitionSpec`` (a ``NamedSharding``'s spec; None stays None); a
    ``TypeError`` naming ``where`` for anything else."""
    if given is None or isinstance(given, P):
        return given
    if isinstance(given, NamedSharding):
        return given.spec
    raise TypeError(f"{api}: {name} must hold PartitionSpecs, NamedShardings or None, got {type(given).__name__} "
                    f"for {where}")


def leaf_specs(api: str, paths: Sequence, leaves: Sequence, specs: SpecTree, tree, reduced: tuple,
               free: tuple[str, ...]) -> list[P]:
    """Each leaf's ``PartitionSpec`` over the ``free`` axes, checked against its shape.

    ``specs``: a pytree prefix of ``tree`` holding ``PartitionSpec``\\ s, ``NamedSharding``\\ s or
    None, or None for all. A leaf with None takes the spec of its type where the free axes are
    ``Explicit``; with ``Auto`` free axes it is unknown and taken as replicated (``P()``), which
    one warning per API and axes reports. Axes of the spec that are mapped by hand but not reduced
    are dropped (the leaf is already that axis's block); naming a reduced axis is an error.
    """
    mesh = jax.sharding.get_abstract_mesh()
    given = per_leaf(api, specs, tree)
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    auto = [a for a in free if types.get(a) == AxisType.Auto]
    out, unknown = [], []
    for path, leaf, spec in zip(paths, leaves, given):
        where = f"x{jax.tree_util.keystr(path)}" if path else "x"
        spec = spec_of(spec, api, where)
        if spec is None:
            typed = getattr(jax.typeof(leaf), "sharding", None)
            spec = getattr(typed, "spec", None) or P()
            if auto and not any(set(e) & set(free) for e in _entries(spec)):
                unknown.append(where)
        out.append(checked_spec(api, where, spec, jax.typeof(leaf).shape, reduced, free, mesh))
    if unknown:
        _warn_unknown(api, unknown, auto)
    return out


def per_leaf(api: str, specs: SpecTree, tree, name: str = "specs", of: str = "the reduced tree") -> list:
    """``specs`` (a pytree prefix of ``tree``, or None) broadcast to one entry per leaf of ``tree``
    (``name`` and ``of`` name the two in the error)."""
    if specs is None:
        return [None] * len(jax.tree.leaves(tree))
    is_spec = lambda s: s is None or isinstance(s, (P, NamedSharding))  # noqa: E731
    try:
        full = jax.tree.broadcast(specs, tree, is_leaf=is_spec)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{api}: {name} must be a pytree prefix of {of} holding PartitionSpecs, "
                         f"NamedShardings or None: {err}") from None
    return jax.tree.leaves(full, is_leaf=is_spec)


def checked_spec(api: str, where: str, spec: P, shape: Sequence[int], reduced: tuple, free: tuple, mesh) -> P:
    """``spec`` of the value ``where`` (of ``shape``) over the ``free`` axes of ``mesh``, after
    checking it can be reduced over ``reduced`` shard by shard: a ``ValueError`` that says why not."""
    shape = tuple(shape)
    entries = _entries(spec)
    if len(entries) > len(shape):
        raise ValueError(f"{api}: {where} has shape {shape} but its spec {spec} names {len(entries)} dimensions")
    kept = []
    for dim, axes in enumerate(entries):
        if hit := [a for a in axes if a in reduced]:
            raise ValueError(
                f"{api}: {where} is sharded over {hit[0]!r} (spec {spec}), an axis it is reduced over: every device "
                f"along {hit[0]!r} must hold the whole leaf to sum it with the others. Shard parameters over a "
                f"separate mesh axis (FSDP: a ('data', 'fsdp') mesh, the batch over both, parameters over 'fsdp', "
                f"axis_name='data')")
        if unknown := [a for a in axes if a not in mesh.axis_names]:
            raise ValueError(f"{api}: {where}'s spec {spec} names {unknown[0]!r}, not an axis of the mesh "
                             f"{tuple(mesh.axis_names)}")
        axes = tuple(a for a in axes if a in free)
        ways = math.prod(mesh.shape[a] for a in axes)
        if shape[dim] % ways:
            raise ValueError(f"{api}: {where} has {shape[dim]} entries in dimension {dim}, which its spec {spec} "
                             f"splits over {axes} ({ways} devices): not divisible. Each device exchanges its own "
                             "shard, so the shards must be equal: pad the parameter or choose a spec that divides it")
        kept.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while kept and kept[-1] is None:
        kept.pop()
    return P(*kept)


def _warn_unknown(api: str, where: list[str], auto: list[str]) -> None:
    key = (api, tuple(auto))
    if key in _warned:
        return
    _warned.add(key)
    shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
    log.warning(
        "jax_cgx: %s: how %s %s sharded over the Auto mesh axes %s is not known while jax.jit traces: %s "
        "reduced whole on every device (XLA gathers %s over %s first). Pass the specs the parameters are sharded "
        "with (data_parallel_value_and_grad(param_specs=...), compressed_pmean(specs=...); flax: "
        "nn.get_partition_spec(params)), P() for a replicated leaf, or use Explicit axes",
        api, shown, "is" if len(where) == 1 else "are", tuple(auto), "it is" if len(where) == 1 else "they are",
        "it" if len(where) == 1 else "them", tuple(auto))


def split_alike(specs: Sequence[P]) -> list[list[int]]:
    """The leaves (indices) grouped by the axes their specs split them over, groups in the order
    of their first leaf. Only leaves of one group may share a fusion buffer: a bucket spans
    leaves, and a leaf replicated over an axis must decode to the same bits on each of that
    axis' devices, which a bucket shared with another device's shard of a split leaf would not."""
    groups: dict[frozenset, list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault(frozenset(spec_axes(spec)), []).append(i)
    return list(groups.values())


def _splits(shape: Sequence[int], spec: P, mesh) -> list[tuple[int, tuple[str, ...], int]]:
    """``(size, axes, ways)`` per dimension of a ``shape`` array sharded as ``spec`` on ``mesh``
    (None: the context's): the mesh axes it is split over and into how many blocks."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes)) if hasattr(mesh, "axis_sizes") else dict(mesh.shape)
    entries = _entries(spec) + [()] * (len(shape) - len(spec))
    return [(n, axes, math.prod(sizes[a] for a in axes)) for n, axes in zip(shape, entries)]


def local_shape(shape: Sequence[int], spec: P, mesh=None) -> tuple[int, ...]:
    """The shape of one device's block of a ``shape`` array sharded as ``spec``."""
    return tuple(n // ways for n, _, ways in _splits(shape, spec, mesh))


def check_divides(shape: Sequence[int], spec: P, mesh, what: str) -> None:
    """A ``ValueError`` naming ``what`` where a dimension of ``shape`` does not split evenly over
    the mesh axes ``spec`` puts it on (``shard_map`` refuses such an array)."""
    for dim, (n, axes, ways) in enumerate(_splits(shape, spec, mesh)):
        if n % ways:
            raise ValueError(f"{what}: dimension {dim} of size {n} does not split evenly over the mesh axes "
                             f"{axes} ({ways} blocks), as spec {spec} asks: shard_map would refuse it; pad it "
                             "or choose a spec whose axes divide it")


def on_own_shards(fn: Callable, leaves: list, specs: list[P], key, free: tuple[str, ...], *, outputs: int = 1):
    """``fn(leaves, key)`` run on each device's own block of ``leaves`` (sharded as ``specs``
    over the ``free`` axes, mapped by hand for it): its result, ``outputs`` lists like
    ``leaves`` (one: a list), leaves with the same specs."""
    out_specs = specs if outputs == 1 else tuple([specs] * outputs)
    body = (lambda ls: fn(ls, None)) if key is None else (lambda ls, k: fn(ls, k))
    in_specs = (specs,) if key is None else (specs, P())
    # Under jit: a shard_map eagerly run inside another's eager body takes its arguments as the
    # outer body's local blocks (jax 0.10.2), so the nested one is always traced.
    mapped = jax.jit(jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, axis_names=frozenset(free),
                                   check_vma=compat.check_vma_enabled()))
    return mapped(list(leaves)) if key is None else mapped(list(leaves), key)
