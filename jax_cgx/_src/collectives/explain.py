"""``jax_cgx.explain``: how ``compressed_psum`` reduces a pytree, leaf by leaf, and why.

It builds the same plan as :func:`~jax_cgx._src.collectives.compressed_psum`
(:mod:`jax_cgx._src.collectives.plan`) and prints each leaf's lane and fusion buffers, and each
buffer's predicted times as a ``psum`` and compressed (:mod:`jax_cgx._src.policy.cost_model`
with this machine's figures, :mod:`jax_cgx._src.policy.pricing`), whatever the policy: under
``"auto"`` the cheaper one is what runs, under ``"always"`` the table shows what "auto"
would do. Getting the figures the first time is collective (every process measures and
they agree), so call it on every process, or after the first step.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import TextIO

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_cgx._src import backends, compat
from jax_cgx._src.arguments import check_bool
from jax_cgx._src.collectives import reduce_scatter, scatter_gather, shards
from jax_cgx._src.collectives.plan import ConfigSpec, check_ranks, leaf_configs, make_plan
from jax_cgx._src.collectives.shards import SpecTree
from jax_cgx._src.policy import pricing

__all__ = ["explain", "Explanation", "LeafReport", "BufferReport"]


@dataclasses.dataclass(frozen=True)
class BufferReport:
    """One fusion buffer: its size, the policy, the decision and the two times (ms), predicted
    by the cost model or, for a near-tie on a measured link (any buffer off CPU), timed (``priced``:
    "model" or "timed on <backend>")."""

    index: int
    dtype: str
    bits: int
    values: int
    policy: str
    compressed: bool
    psum_ms: float
    compressed_ms: float
    priced: str = "model"
    form: str = "sra"  # how it is reduced: "sra", "ring", "hierarchical sra", ... (policy="auto" over nodes chooses)

    @property
    def mib(self) -> float:
        return self.values * np.dtype(self.dtype).itemsize / 2**20


@dataclasses.dataclass(frozen=True)
class LeafReport:
    """One leaf: how it is reduced (``"exact"``, ``"half"``, ``"compressed"``, ``"psum (auto)"``
    or, for a leaf across buffers of both kinds, ``"mixed (auto)"``), the fusion buffers it
    was priced in (none for the exact and half lanes), its width and bucket size where it is
    quantized and, given ``plans``, an adaptive plan's predicted error and bytes for it."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    how: str
    buffers: tuple[int, ...]
    bits: int | None = None
    bucket_size: int | None = None
    predicted_error: float | None = None
    planned_bytes: int | None = None
    split_over: tuple[str, ...] = ()  # model axes each device holds a shard of it over (its own exchanged)
    shard: tuple[int, ...] | None = None  # one device's block of it, where split


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found; ``str()`` gives the tables it prints.

    Made by :func:`explain`, not by users.

    Attributes:
      world: the number of ranks of the reduction.
      leaves: a :class:`~jax_cgx._src.collectives.explain.LeafReport` per leaf of ``x``, in
        flattening order.
      buffers: a :class:`~jax_cgx._src.collectives.explain.BufferReport` per fusion buffer (none
        for one rank).
      figures: the cost model's figures the buffers were priced with; None where none are known
        (the policy is not ``"auto"`` and the machine is not measured yet).
      op: ``"psum"``, ``"psum_scatter"`` or ``"all_gather"``; for the last two a buffer's
        ``psum_ms`` is that ``lax`` collective's.
      axes: the reduced axis names, where ``explain`` was given ``axis_name`` (else empty).
      model_axes: the mesh axes left to XLA's partitioner, over which each device reduces its own
        shards (else empty).
    """

    world: int
    leaves: list[LeafReport]
    buffers: list[BufferReport]
    figures: pricing.Figures | None
    op: str = "psum"  # or "psum_scatter", "all_gather": then a buffer's psum_ms is that lax collective's
    axes: tuple[str, ...] = ()  # the reduced axes, where named
    model_axes: tuple[str, ...] = ()  # axes left to XLA's partitioner: each device reduces its own shards

    def __str__(self) -> str:
        over = f" over {self.axes} ({self.world} ranks)" if self.axes else f" over {self.world} ranks"
        lines = [f"{_API[self.op]}{over}"]
        if self.model_axes:
            lines.append(f"  model axes {self.model_axes}: left to XLA's partitioner; each device compresses and "
                         "sends its own shard of each leaf (buffers are per device)")
        if self.figures is not None:
            lines.append(f"  figures: {self.figures.describe()}")
        planned = any(r.predicted_error is not None for r in self.leaves)
        split = bool(self.model_axes)
        lines.append(_table(
            ["leaf", "shape"] + (["split over", "shard"] if split else []) + ["dtype", "MiB", "reduced as", "bits",
                                                                              "bucket"]
            + (["predicted error", "planned bytes"] if planned else []) + ["buffers"],
            [[r.path or "(root)", str(r.shape)]
             + ([",".join(r.split_over) or "-", str(r.shard or r.shape)] if split else [])
             + [r.dtype, f"{r.nbytes / 2**20:.4g}", r.how, _or_dash(r.bits), _or_dash(r.bucket_size)]
             + ([_or_dash(r.predicted_error, "{:.4g}"), _or_dash(r.planned_bytes)] if planned else [])
             + [",".join(map(str, r.buffers)) or "-"] for r in self.leaves]))
        if self.buffers:
            lines.append(_table(
                ["buffer", "dtype", "bits", "MiB", "policy", "form", "compressed",
                 "psum ms" if self.op == "psum" else "lax ms", "compressed ms", "speedup", "priced"],
                [[str(b.index), b.dtype, str(b.bits), f"{b.mib:.4g}", b.policy, b.form, "yes" if b.compressed else "no"]
                 + ([f"{b.psum_ms:.3g}", f"{b.compressed_ms:.3g}", f"{b.psum_ms / b.compressed_ms:.2f}x"]
                    if b.priced != "not priced" else ["-", "-", "-"]) + [b.priced]
                 for b in self.buffers]))
            if any(b.priced == "not priced" for b in self.buffers):
                lines.append("  not priced: the policy is not 'auto' and this machine is not measured yet "
                             "(jax_cgx.calibrate() measures it; policy='auto' does on its first use)")
        return "\n".join(lines)


def _table(columns: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    out = ["  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    out += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def _or_dash(value, form: str = "{}") -> str:
    return "-" if value is None else form.format(value)


def _priced(d: pricing.Decision | None) -> str:
    return "not priced" if d is None else f"timed on {d.backend}" if d.measured else "model"


def _figures_for(config) -> pricing.Figures | None:
    """What a buffer is priced with: measured for policy="auto" (what it decides with), and for any
    other policy only what is known already: explain measures nothing it was not asked to."""
    return pricing.figures(config) if config.policy == "auto" else pricing.known_figures(config)


_API = {"psum": "compressed_psum", "psum_scatter": "compressed_psum_scatter", "all_gather": "compressed_all_gather"}


def explain(x, axis_name=None, config: ConfigSpec = None, *, world: int | None = None,
            inner_world: int | None = None, op: str = "psum", scatter_dimension: int = 0, tiled: bool = False,
            file: TextIO | None = sys.stdout,
            plans: Sequence | None = None, specs: SpecTree = None, mesh=None) -> Explanation:
    """Print, and return, how ``compressed_psum(x, axis_name, config)`` reduces each leaf
    (``op="psum_scatter"`` / ``"all_gather"``: how ``compressed_psum_scatter`` /
    ``compressed_all_gather`` would, ``x`` being each rank's input).

    Args:
      x: a pytree of arrays or ``jax.ShapeDtypeStruct`` objects.
      axis_name: the mapped axis name(s), inside ``shard_map`` / ``pmap`` (their size is the
        number of ranks); outside, give ``world`` instead.
      config: as for :func:`~jax_cgx.compressed_psum`.
      world: the number of ranks the sum runs over (instead of ``axis_name``).
      inner_world: the inner axis's size, for hierarchical configs given ``world``.
      op: the collective: "psum", "psum_scatter" or "all_gather".
      scatter_dimension: with ``op="psum_scatter"``, as for
        :func:`~jax_cgx.compressed_psum_scatter`: a leaf it would refuse is refused here, with its
        error.
      tiled: with ``op="psum_scatter"``, as for :func:`~jax_cgx.compressed_psum_scatter` (likewise).
      file: where to print (``None``: only return the :class:`Explanation`).
      plans: the :class:`~jax_cgx.adaptive.LeafPlan` table of the plan ``config`` came from
        (``choose_bits(..., return_plan=True)``, ``Planner.plans``): each planned leaf's predicted
        error and bytes join the leaf table (matched by path; a path the tree lacks is an error).
      specs: on a mesh with model axes left to XLA's partitioner (tensor parallelism, FSDP), how
        each leaf is split over them, as for :func:`~jax_cgx.compressed_psum`: each device's shard
        is what it compresses, so the plan and the prices are the shards'. Inside a ``shard_map``
        over the data axes alone the model axes are the mesh's others (a leaf's ``Explicit`` type
        gives its spec where ``specs`` does not); outside, give ``mesh=`` too.
      mesh: with ``specs`` outside ``shard_map``: the mesh whose axes the specs name.

    Returns:
      An :class:`Explanation`: a :class:`~jax_cgx._src.collectives.explain.LeafReport` per leaf and
      a :class:`~jax_cgx._src.collectives.explain.BufferReport` per fusion buffer, with the figures
      they were priced with; the same tables are printed to ``file`` unless it is ``None``.

    Raises:
      ValueError: an unknown ``op``; both or neither of ``axis_name`` and ``world``; ``world`` or
        ``inner_world`` not a positive int, or ``inner_world`` not dividing ``world``; ``mesh``
        without ``specs``; ``plans`` naming a path the tree lacks; a leaf that
        ``compressed_psum_scatter`` would refuse (``op="psum_scatter"``).
      NameError: an axis of ``axis_name`` that is not bound (outside ``shard_map``/``pmap``).
      NotImplementedError: model axes (``specs``) with an ``op`` other than ``"psum"``.

    Examples:
      >>> report = jax_cgx.explain({"w": jnp.zeros((1024, 1024)), "b": jnp.zeros(8)}, world=8, file=None)
      >>> [(leaf.path, leaf.how) for leaf in report.leaves]  # "b" is below min_size (1024): summed exactly
      [("['b']", 'exact'), ("['w']", 'compressed')]
    """
    if op not in _API:
        raise ValueError(f"explain: op must be one of {tuple(_API)}, got {op!r}")
    if (axis_name is None) == (world is None):
        raise ValueError("explain: give axis_name (inside shard_map or pmap) or world= (the number of ranks), "
                         "not both")
    if axis_name is not None:
        axes = compat.axes_tuple(axis_name)
        compat.check_axis_names(axes, "explain")
        world = int(np.prod([jax.lax.axis_size(a) for a in axes]))
        inner_world = jax.lax.axis_size(axes[-1]) if len(axes) > 1 else None
    else:
        axes = None
    world, inner_world = check_ranks("explain", world, inner_world)
    model_axes, split, shard_shapes = _model_shards(x, axes, specs, mesh)
    if model_axes and op != "psum":
        raise NotImplementedError(f"explain: model axes {model_axes} are priced for op='psum'; for {op!r} give "
                                  "each device's shard as x")
    if op != "psum":
        result = _explain_sharded(x, config, world, op, scatter_dimension, tiled)
        result = dataclasses.replace(result, leaves=_with_plans(result.leaves, plans), axes=axes or ())
        if file is not None:
            print(result, file=file)
        return result
    flat = jax.tree_util.tree_flatten_with_path(x)[0]
    paths, leaves = [p for p, _ in flat], [v for _, v in flat]
    if model_axes:  # each device plans its own shards, leaves split alike fused together
        configs = leaf_configs(config, x, paths, "explain")
        local = [jax.ShapeDtypeStruct(shape, v.dtype) for v, shape in zip(leaves, shard_shapes)]
        plans_of = [(members, make_plan([paths[i] for i in members], [local[i] for i in members],
                                        [configs[i] for i in members], [local[i] for i in members], world,
                                        inner_world, axes, measure=False, api="explain"))
                    for members in shards.split_alike(split)]
    else:
        plans_of = [(list(range(len(leaves))),
                     make_plan(paths, leaves, config, x, world, inner_world, axes, measure=False, api="explain"))]
    buffers: list[BufferReport] = []
    leaf_buffers: dict[int, list[int]] = {}
    lanes: dict[int, str] = {}
    leaf_config: dict[int, object] = {}
    sizes: dict[int, int] = {}
    figures = None
    for members_of, plan in plans_of:
        figures = _report_plan(plan, members_of, world, inner_world, buffers, leaf_buffers, figures)
        for j, i in enumerate(members_of):
            lanes[i], leaf_config[i], sizes[i] = plan.lanes[j], plan.configs[j], plan.sizes[j]

    leaves_out = []
    for i, (path, leaf) in enumerate(zip(paths, leaves)):
        mine = leaf_buffers.get(i, [])
        if lanes[i] == "auto-psum":
            how = "psum (auto)"
        elif lanes[i] != "quantized":
            how = lanes[i]
        elif world == 1:
            how = "exact"
        else:
            kinds = {buffers[b].compressed for b in mine}
            how = "compressed" if kinds == {True} else "psum (auto)" if kinds == {False} else "mixed (auto)"
        dtype = np.dtype(leaf.dtype)
        over = shards.spec_axes(split[i]) if model_axes else ()
        leaves_out.append(LeafReport(jax.tree_util.keystr(path), tuple(np.shape(leaf)), dtype.name,
                                     sizes[i] * dtype.itemsize, how, tuple(mine),
                                     *_width(lanes[i] if world > 1 else "exact", leaf_config[i]),
                                     split_over=over, shard=tuple(shard_shapes[i]) if over else None))
    result = Explanation(world, _with_plans(leaves_out, plans), buffers, figures, axes=axes or (),
                         model_axes=model_axes)
    if file is not None:
        print(result, file=file)
    return result


def _model_shards(x, axes, specs, mesh):
    """``(model axes, each leaf's spec, each leaf's shard shape)`` where the reduction leaves model
    axes to XLA's partitioner (inside a shard_map over the data axes, or ``specs`` and ``mesh``
    given); ``((), None, None)`` otherwise."""
    flat = jax.tree_util.tree_flatten_with_path(x)[0]
    paths, leaves = [p for p, _ in flat], [v for _, v in flat]
    if mesh is not None:
        if specs is None:
            raise ValueError("explain: mesh= is for specs= (how each leaf is split over the mesh's model axes): "
                             "give both, or neither")
        given = [shards.spec_of(s, "explain", f"x{jax.tree_util.keystr(p)}") or P()
                 for p, s in zip(paths, shards.per_leaf("explain", specs, x))]
        named = {a for s in given for a in shards.spec_axes(s)}
        free = tuple(a for a in mesh.axis_names if a in named and a not in (axes or ()))
        split = [shards.checked_spec("explain", f"x{jax.tree_util.keystr(p)}", s, np.shape(v), axes or (), free, mesh)
                 for p, v, s in zip(paths, leaves, given)]
    else:
        free = shards.free_axes() if axes is not None else ()
        if not free:
            return (), None, None
        split = shards.leaf_specs("explain", paths, leaves, specs, x, axes, free)
        mesh = jax.sharding.get_abstract_mesh()
    return free, split, [shards.local_shape(np.shape(v), s, mesh) for v, s in zip(leaves, split)]


def _report_plan(plan, members_of, world, inner_world, buffers, leaf_buffers, figures):
    """The buffers of ``plan`` (of the leaves ``members_of``) appended to ``buffers``, each leaf's
    buffer indices to ``leaf_buffers``; the figures they were priced with."""
    for group, members in (plan.groups.items() if world > 1 else ()):  # one rank: nothing moves, all exact
        bounds = np.cumsum([0] + [plan.sizes[i] for i in members])
        decisions = plan.decisions.get(group)
        for k, ((start, stop), copied) in enumerate(zip(plan.buffers(group), plan.copied(group))):
            d = decisions[k] if decisions else None
            known = _figures_for(group.config)
            if d is None and known is not None:  # "always": what "auto" would have predicted, if measured already
                d = pricing.decide(stop - start, group.dtype, world, group.config, inner_world=inner_world,
                                  backend=backends.get(plan.backends.get(group, "xla")).timed_as, log=False,
                                  measure=False, copied=copied)
            figures = figures or known
            index = len(buffers)
            buffers.append(BufferReport(
                index, group.dtype.name, group.config.bits, stop - start, group.config.policy,
                decisions is None or decisions[k].compress,
                0.0 if d is None else d.psum_s * 1e3, 0.0 if d is None else d.compressed_s * 1e3, _priced(d),
                pricing.form_name(group.config, inner_world)))
            for j, i in enumerate(members):
                if bounds[j] < stop and bounds[j + 1] > start:
                    leaf_buffers.setdefault(members_of[i], []).append(index)
    for group, values, d, moved in plan.dissolved:  # priced once, lost: their leaves are psum'd one by one
        for i in moved:
            leaf_buffers.setdefault(members_of[i], []).append(len(buffers))
        buffers.append(BufferReport(len(buffers), group.dtype.name, group.config.bits, values, "auto", False,
                                    d.psum_s * 1e3, d.compressed_s * 1e3, _priced(d),
                                    pricing.form_name(group.config, inner_world)))
        figures = figures or _figures_for(group.config)
    return figures


def _explain_sharded(x, config: ConfigSpec, world: int, op: str, scatter_dimension: int, tiled: bool) -> Explanation:
    """:func:`explain` for the reduce-scatter or the all-gather: their lanes and fusion buffers
    (:mod:`jax_cgx._src.collectives.scatter_gather`), each buffer priced as that collective."""
    leaves = scatter_gather.Leaves(x, config, _API[op])
    if op == "psum_scatter":  # what compressed_psum_scatter refuses, refused with its words
        tiled = check_bool("explain", "tiled", tiled)
        for i, leaf in enumerate(leaves.leaves):
            reduce_scatter.check_shape(leaves.name(i), tuple(np.shape(leaf)), scatter_dimension, tiled, world)
    buffers: list[BufferReport] = []
    leaf_buffers: dict[int, int] = {}
    figures = None
    for group, members in (scatter_gather.buffers(leaves, world, op) if world > 1 else []):
        values = sum(leaves.leaves[i].size for i in members)
        # Under "always", what "auto" would have predicted where the machine is measured already;
        # timings only where taken before (collective).
        known = _figures_for(group.config)
        d = None if known is None else pricing.decide(values, group.dtype, world, group.config, op=op, log=False,
                                                      measure=False, copied=scatter_gather.copied(members, world, op))
        figures = figures or known
        compress = group.config.policy != "auto" or d.compress
        for i in members:
            leaf_buffers[i] = len(buffers)
        buffers.append(BufferReport(len(buffers), group.dtype.name, group.config.bits, values, group.config.policy,
                                    compress, 0.0 if d is None else d.psum_s * 1e3,
                                    0.0 if d is None else d.compressed_s * 1e3, _priced(d)))
    reports = []
    for i, (kind, leaf) in enumerate(zip(leaves.lanes, leaves.leaves)):
        mine = leaf_buffers.get(i)
        how = kind if kind != "quantized" else (
            "exact" if mine is None else "compressed" if buffers[mine].compressed else "lax (auto)")
        dtype = np.dtype(leaf.dtype)
        reports.append(LeafReport(leaves.name(i), tuple(np.shape(leaf)), dtype.name, leaf.size * dtype.itemsize, how,
                                  () if mine is None else (mine,), *_width(kind, leaves.configs[i])))
    return Explanation(world, reports, buffers, figures, op)


def _width(kind: str, config) -> tuple[int | None, int | None]:
    """A quantized leaf's ``(bits, bucket_size)``; ``(None, None)`` for the other lanes."""
    return (config.bits, config.bucket_size) if kind == "quantized" else (None, None)


def _with_plans(reports: list[LeafReport], plans) -> list[LeafReport]:
    """``reports`` with each planned leaf's predicted error and bytes (``plans``: LeafPlans, by path)."""
    if plans is None:
        return reports
    by_path = {p.path: p for p in plans}
    unknown = sorted(set(by_path) - {r.path for r in reports})
    if unknown:
        raise ValueError(f"explain: plans name leaves the tree lacks: {unknown} (plans of another tree? they "
                         "come from choose_bits(..., return_plan=True) or Planner.plans of this gradient)")
    return [dataclasses.replace(r, predicted_error=float(by_path[r.path].error), planned_bytes=int(by_path[r.path].bytes))
            if r.path in by_path else r for r in reports]
