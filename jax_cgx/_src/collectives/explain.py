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

from jax_cgx._src import backends, compat
from jax_cgx._src.arguments import check_bool
from jax_cgx._src.collectives import reduce_scatter, scatter_gather
from jax_cgx._src.collectives.plan import ConfigSpec, check_ranks, make_plan
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


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found; ``str()`` gives the tables it prints."""

    world: int
    leaves: list[LeafReport]
    buffers: list[BufferReport]
    figures: pricing.Figures | None
    op: str = "psum"  # or "psum_scatter", "all_gather": then a buffer's psum_ms is that lax collective's

    def __str__(self) -> str:
        lines = [f"{_API[self.op]} over {self.world} ranks"]
        if self.figures is not None:
            lines.append(f"  figures: {self.figures.describe()}")
        planned = any(r.predicted_error is not None for r in self.leaves)
        lines.append(_table(
            ["leaf", "shape", "dtype", "MiB", "reduced as", "bits", "bucket"]
            + (["predicted error", "planned bytes"] if planned else []) + ["buffers"],
            [[r.path or "(root)", str(r.shape), r.dtype, f"{r.nbytes / 2**20:.4g}", r.how, _or_dash(r.bits),
              _or_dash(r.bucket_size)]
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
            plans: Sequence | None = None) -> Explanation:
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
      scatter_dimension, tiled: with ``op="psum_scatter"``, as for
        :func:`~jax_cgx.compressed_psum_scatter`: a leaf it would refuse is refused here, with its
        error.
      file: where to print (``None``: only return the :class:`Explanation`).
      plans: the :class:`~jax_cgx.adaptive.LeafPlan` table of the plan ``config`` came from
        (``choose_bits(..., return_plan=True)``, ``Planner.plans``): each planned leaf's predicted
        error and bytes join the leaf table (matched by path; a path the tree lacks is an error).

    Examples:
      >>> report = jax_cgx.explain({"w": jnp.zeros((1024, 1024)), "b": jnp.zeros(8)}, world=8, file=None)
      >>> [(leaf.path, leaf.how) for leaf in report.leaves]  # "b" is below min_size: summed exactly
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
    if op != "psum":
        result = _explain_sharded(x, config, world, op, scatter_dimension, tiled)
        result = dataclasses.replace(result, leaves=_with_plans(result.leaves, plans))
        if file is not None:
            print(result, file=file)
        return result
    flat = jax.tree_util.tree_flatten_with_path(x)[0]
    paths, leaves = [p for p, _ in flat], [v for _, v in flat]
    plan = make_plan(paths, leaves, config, x, world, inner_world, axes, measure=False, api="explain")

    buffers: list[BufferReport] = []
    leaf_buffers: dict[int, list[int]] = {}
    figures = None
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
                    leaf_buffers.setdefault(i, []).append(index)
    for group, values, d, moved in plan.dissolved:  # priced once, lost: their leaves are psum'd one by one
        for i in moved:
            leaf_buffers.setdefault(i, []).append(len(buffers))
        buffers.append(BufferReport(len(buffers), group.dtype.name, group.config.bits, values, "auto", False,
                                    d.psum_s * 1e3, d.compressed_s * 1e3, _priced(d),
                                    pricing.form_name(group.config, inner_world)))
        figures = figures or _figures_for(group.config)

    leaves_out = []
    for i, (path, leaf) in enumerate(zip(paths, leaves)):
        mine = leaf_buffers.get(i, [])
        if plan.lanes[i] == "auto-psum":
            how = "psum (auto)"
        elif plan.lanes[i] != "quantized":
            how = plan.lanes[i]
        elif world == 1:
            how = "exact"
        else:
            kinds = {buffers[b].compressed for b in mine}
            how = "compressed" if kinds == {True} else "psum (auto)" if kinds == {False} else "mixed (auto)"
        dtype = np.dtype(leaf.dtype)
        leaves_out.append(LeafReport(jax.tree_util.keystr(path), tuple(np.shape(leaf)), dtype.name,
                                     plan.sizes[i] * dtype.itemsize, how, tuple(mine),
                                     *_width(plan.lanes[i] if world > 1 else "exact", plan.configs[i])))
    result = Explanation(world, _with_plans(leaves_out, plans), buffers, figures)
    if file is not None:
        print(result, file=file)
    return result


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
