"""How ``compressed_psum`` reduces each leaf of a pytree: its lane, its fusion buffer, and
whether that buffer is compressed.

Leaves go through three lanes:

- **exact**: integer leaves, leaves smaller than ``min_size``, leaves whose config
  is ``None`` or has ``bits=32``: a plain ``lax.psum``;
- **half**: ``bits=16``: a ``lax.psum`` in bfloat16 (or float16);
- **quantized**: ``bits`` 1..8: leaves of one dtype and config form a :class:`Group`,
  whose values are cut into fusion buffers of at most ``fusion_buffer_mb``. On CPUs a leaf
  of at least :data:`ALONE_SHARE` of a buffer is a buffer of its own (the group's first),
  exchanged where it lies, with no copy into a fusion buffer and back out of it.

Under ``policy="always"`` every buffer is compressed. Under ``policy="auto"`` each buffer is
priced (:func:`jax_cgx._src.policy.pricing.decide`). Leaves that lie only in buffers that lose
leave the group for the **auto-psum** lane, a ``psum`` leaf by leaf, as without jax_cgx (no
fusion-buffer copies); the rest are fused again and their buffers priced once more (one
that still loses, e.g. a small last buffer, is ``psum``'d as a buffer). The plan is pure
Python, built while tracing from shapes and configs: the same on every rank, static under
``jit``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Union

import jax
import numpy as np

from jax_cgx._src import backends, compat
from jax_cgx._src.codec import SUPPORTED_DTYPES
from jax_cgx._src.config import MAX_FUSION_BUFFERS, CompressionConfig, check_environment, default_config
from jax_cgx._src.exchange.all_reduce import reduction
from jax_cgx._src.policy import forms, pricing

__all__ = ["ConfigSpec", "Group", "Plan", "make_plan", "check_ranks", "leaf_configs", "LeafConfigs", "lane",
           "check_varying"]

# A config for every leaf, a pytree of configs (None = reduce exactly), or a function
# of the leaf's path and value (torch_cgx's layer-wise hook).
ConfigSpec = Union[
    CompressionConfig, None, Callable[[tuple, jax.Array], "CompressionConfig | None"], Any
]


# On CPUs a leaf of at least this share of a fusion buffer is a buffer (or, past the capacity,
# buffers) of its own: copying it into a fusion buffer and back out costs more than the fixed
# costs of the exchange it shares. Measured on the MLP step of docs/performance.md (2 processes,
# 1 Gbit/s, 4 bits): copies 27 -> 12 ms a step, the step 3.80x -> 4.17x pmean; fused into one
# 64.1 MiB buffer instead, XLA:CPU's concatenates of the five gradients took 130 ms. On GPUs a
# copy costs microseconds and each buffer is more collectives (NCCL calls, which wait for turns
# where ranks share a GPU): leaves stay fused there.
ALONE_SHARE = 0.25
ALONE_PLATFORMS = frozenset({"cpu"})


def alone_values(capacity: int, platform: str) -> float:
    """Values from which a leaf is a buffer of its own: :data:`ALONE_SHARE` of a buffer of
    ``capacity`` values, rounded up, on :data:`ALONE_PLATFORMS`; infinite elsewhere."""
    return -(-capacity // round(1 / ALONE_SHARE)) if platform in ALONE_PLATFORMS else math.inf


def alone_first(members: Sequence[int], sizes: Sequence[int], alone: float) -> list[int]:
    """``members`` (indices into ``sizes``) with those of at least ``alone`` values first, each
    part in its given order: the order a group's values are concatenated in."""
    return sorted(members, key=lambda i: sizes[i] < alone)


def fusion_spans(sizes: Sequence[int], capacity: int, alone: float) -> list[tuple[int, int]]:
    """``(start, stop)`` of each fusion buffer over the concatenation of leaves of ``sizes``: each
    leading leaf of at least ``alone`` values on its own (cut at ``capacity``), then the others cut
    into buffers of at most ``capacity`` values (a leaf may straddle two)."""
    spans, start, k = [], 0, 0
    while k < len(sizes) and sizes[k] >= alone:
        spans += [(a, min(a + capacity, start + sizes[k])) for a in range(start, start + sizes[k], capacity)]
        start, k = start + sizes[k], k + 1
    total = start + sum(sizes[k:])
    return spans + [(a, min(a + capacity, total)) for a in range(start, total, capacity)]


class _Repeated(list):
    """One config repeated for the leaves of the subtree it covers (not a pytree node)."""


class LeafConfigs(tuple):
    """Configs already resolved, one per leaf (:func:`leaf_configs` of a whole tree), handed down to
    the reduction of some of its leaves (a backward bucket, the leaves split alike) and used there as
    they are: a config pytree or function is resolved once, where each leaf's path is known."""


def leaf_configs(config: ConfigSpec, tree, paths: Sequence[tuple], api: str = "compressed_psum"
                 ) -> list[CompressionConfig | None]:
    """Each leaf's config (or None) from a config, a pytree of them or a function of
    ``(path, leaf)``, for the leaves of ``tree`` at ``paths``; a :class:`LeafConfigs` as it is."""
    if isinstance(config, LeafConfigs):
        if len(config) != len(paths):
            raise AssertionError(f"{api}: {len(config)} resolved configs for {len(paths)} leaves")
        return list(config)
    check_environment(config is not None, api)  # a malformed variable raises even where a config is given
    if config is None:
        return [default_config(api)] * len(paths)
    if isinstance(config, CompressionConfig):
        return [config] * len(paths)
    leaves = jax.tree.leaves(tree)
    if callable(config):
        configs = [config(path, leaf) for path, leaf in zip(paths, leaves)]
    else:
        is_cfg = lambda node: node is None or isinstance(node, CompressionConfig)  # noqa: E731
        try:
            # Each config repeated for the leaves of its subtree, in a type of our own: the values' own
            # pytrees may hold lists (a model's layers), which must stay nodes.
            configs = jax.tree.leaves(
                jax.tree.map(lambda given, sub: _Repeated([given] * len(jax.tree.leaves(sub))), config, tree,
                             is_leaf=is_cfg),
                is_leaf=lambda v: isinstance(v, _Repeated),
            )
            configs = [leaf_config for repeated in configs for leaf_config in repeated]
        except ValueError as err:
            raise ValueError(
                f"{api}: the config pytree must match the structure of the values "
                f"(or be a prefix of it): {err}"
            ) from None
    for path, leaf_config in zip(paths, configs):
        if leaf_config is not None and not isinstance(leaf_config, CompressionConfig):
            raise TypeError(
                f"{api}: config for leaf {jax.tree_util.keystr(path)} must be a "
                f"CompressionConfig or None, got {type(leaf_config).__name__}"
            )
    return configs


@dataclasses.dataclass(frozen=True)
class Group:
    """Leaves reduced together: same dtype, same codec settings, varying over the same other mesh
    axes (``varying``; a leaf replicated over a model axis is not fused with one split over it,
    whose shard differs from device to device: a bucket spanning both would decode the replicated
    leaf differently on each device of that axis)."""

    dtype: np.dtype
    config: CompressionConfig
    varying: frozenset = frozenset()

    @property
    def capacity(self) -> int:
        """Values per fusion buffer."""
        return max(1, self.config.fusion_buffer_bytes // self.dtype.itemsize)


@dataclasses.dataclass
class Plan:
    """How each leaf is reduced: its lane, the fusion groups of quantized leaves, the backend
    each group's compressed exchange runs on, and ``policy="auto"``'s decision for each of a
    group's buffers (None: always compressed)."""

    lanes: list[str]
    configs: list[CompressionConfig | None]
    groups: dict[Group, list[int]]  # the members in the order their values are concatenated
    sizes: list[int]
    platform: str = "cpu"  # where the reduction runs: whether large leaves are buffers of their own
    # Chosen once, while tracing inside a mesh (jax_cgx._src.backends.choose_in_trace); none for one rank (no exchange).
    backends: dict[Group, str] = dataclasses.field(default_factory=dict)
    decisions: dict[Group, list[pricing.Decision | None]] = dataclasses.field(default_factory=dict)
    # policy="auto": the first pricing's losing buffers (group, values, decision, the leaves that
    # moved from them to the auto-psum lane).
    dissolved: list[tuple[Group, int, pricing.Decision, tuple[int, ...]]] = dataclasses.field(default_factory=list)

    def alone(self, group: Group) -> float:
        """Values from which a leaf of ``group`` is a buffer of its own (:func:`alone_values`)."""
        return alone_values(group.capacity, self.platform)

    def buffers(self, group: Group) -> list[tuple[int, int]]:
        """``(start, stop)`` of each fusion buffer over the group's concatenated values (:func:`fusion_spans`)."""
        return fusion_spans([self.sizes[i] for i in self.groups[group]], group.capacity, self.alone(group))

    def copied(self, group: Group) -> list[float]:
        """For each buffer, the buffer sizes its fusion copies move (``pricing.decide``'s ``copied``):
        leaves copied in and sliced out (2); a part of a leaf alone, whose result is joined once (1);
        a whole leaf alone, exchanged where it lies (0)."""
        bounds = set(np.cumsum([0] + [self.sizes[i] for i in self.groups[group]]).tolist())
        alone_stop = sum(self.sizes[i] for i in self.groups[group] if self.sizes[i] >= self.alone(group))
        return [2.0 if stop > alone_stop else 0.0 if start in bounds and stop in bounds else 1.0
                for start, stop in self.buffers(group)]

    def _count_with(self, mb: float) -> int:
        """The buffers every group would need with ``fusion_buffer_mb=mb``."""
        count = 0
        for group, members in self.groups.items():
            cap = max(1, int(mb * 2**20) // group.dtype.itemsize)
            alone = alone_values(cap, self.platform)
            count += len(fusion_spans([self.sizes[i] for i in alone_first(members, self.sizes, alone)], cap, alone))
        return count

    def compressed(self, group: Group) -> list[bool]:
        """Whether each of the group's buffers is compressed."""
        return [d is None or d.compress for d in self.decisions.get(group, [None] * len(self.buffers(group)))]

    def check_buffer_count(self) -> None:
        """Raise a clear error when the quantized leaves need more than ``MAX_FUSION_BUFFERS`` buffers."""
        count, total_bytes = 0, 0
        for group, members in self.groups.items():
            count += len(self.buffers(group))
            total_bytes += sum(self.sizes[i] for i in members) * group.dtype.itemsize
        if count <= MAX_FUSION_BUFFERS:
            return
        mbs = sorted({g.config.fusion_buffer_mb for g in self.groups})
        given = f"fusion_buffer_mb={mbs[0]}" if len(mbs) == 1 else f"fusion_buffer_mb in {mbs}"
        groups = len(self.groups)
        if groups < MAX_FUSION_BUFFERS:
            # A power of two with at most MAX - groups buffers for all groups together (under the
            # rule for leaves alone too, which a larger buffer takes fewer leaves into).
            need = 2.0 ** math.ceil(math.log2(total_bytes / ((MAX_FUSION_BUFFERS - groups) * 2**20)))
            while self._count_with(need) > MAX_FUSION_BUFFERS:
                need *= 2
            fix = (
                f"set fusion_buffer_mb >= {need:g} (CGX_FUSION_BUFFER_SIZE_MB with config=None), "
                "or reduce the values in several calls"
            )
        else:
            fix = (
                f"the values form {groups} fusion groups (leaves of different dtypes or configs "
                "are never fused): use fewer distinct configs, or reduce them in several calls"
            )
        raise ValueError(
            f"compressed_psum: {given} cuts {total_bytes / 2**20:.4g} MiB of quantized values into "
            f"{count} fusion buffers, more than the {MAX_FUSION_BUFFERS} allowed per reduction "
            f"(each buffer is a separate exchange and compile time grows with their number); {fix}"
        )


def check_ranks(api: str, world, inner_world=None) -> tuple[int, int | None]:
    """``world`` (and ``inner_world``, the inner axis of a hierarchical sum, which must divide
    it) as ints; a ``ValueError`` unless they are integers >= 1."""
    for name, value in (("world", world), ("inner_world", inner_world)):
        if name == "inner_world" and value is None:
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{api}: {name} must be a positive int (a number of ranks), got {value!r}")
    if inner_world is not None and world % inner_world:
        raise ValueError(f"{api}: inner_world={inner_world} must divide world={world}")
    return int(world), None if inner_world is None else int(inner_world)


def varying_beyond(leaf, axes) -> frozenset:
    """The mapped axes besides ``axes`` that ``leaf`` varies over, as ``shard_map(check_vma=True)``
    types it (a model axis it is split over); empty without that typing or outside a mesh."""
    if axes is None or not compat.check_vma_enabled() or isinstance(leaf, jax.ShapeDtypeStruct):
        return frozenset()
    return frozenset(compat.varying_axes(jax.typeof(leaf)) - set(axes))


def make_plan(paths, leaves, config: ConfigSpec, tree, world: int | None = None,
              inner_world: int | None = None, axes: tuple | None = None, measure: bool = True, *,
              impl: str = "auto", residual: bool = False, api: str = "compressed_psum") -> Plan:
    """The plan for ``leaves`` (with their ``paths``) of ``tree`` reduced over ``world`` ranks.

    ``world`` None or 1: no decisions are taken (nothing moves). ``inner_world``: the inner
    axis's size, for hierarchical configs' cost. ``axes``: the reduction's axis names while
    tracing inside a mesh (None: outside), which choose the backend each group's exchange runs
    on (with ``impl`` and ``residual``, as :func:`jax_cgx._src.collectives.compressed_psum` takes them). ``measure=False``: ``policy="auto"`` times no near-tie (timing is collective), using only
    earlier timings; for :func:`jax_cgx.explain` and ``bytes_on_wire``, which one process may call.
    ``api``: the public function the plan is for, named in errors and in ``config=None``'s log line.
    """
    configs = leaf_configs(config, tree, paths, api)
    lanes, groups = [], {}
    for i, (path, leaf, leaf_config) in enumerate(zip(paths, leaves, configs)):
        kind = lane(path, leaf, leaf_config, api)
        lanes.append(kind)
        if kind == "quantized":
            groups.setdefault(Group(np.dtype(leaf.dtype), leaf_config, varying_beyond(leaf, axes)), []).append(i)
    plan = Plan(lanes, configs, groups, [int(np.prod(np.shape(leaf))) for leaf in leaves], compat.trace_platform())
    for group, members in groups.items():  # the leaves alone first, in tree order, then the others
        groups[group] = alone_first(members, plan.sizes, plan.alone(group))
    if world is None or world < 2:
        return plan
    for group in groups:
        plan.backends[group] = _backend(group.config, axes, world, inner_world, impl, residual)
    for group in [g for g in groups if g.config.policy == "auto"]:
        group = _choose_form(plan, group, world, inner_world, axes, impl, residual, measure)
        _decide(plan, group, world, inner_world, backends.get(plan.backends[group]).timed_as, measure)
    return plan


def _choose_form(plan: Plan, group: Group, world: int, inner_world: int | None, axes, impl: str, residual: bool,
                 measure: bool) -> Group:
    """``policy="auto"`` over nodes: the group re-keyed to the form (flat or hierarchical, SRA or
    ring) :func:`~jax_cgx._src.policy.forms.choose_form` prices fastest; the group itself where
    that is its own form (or another group already has the chosen config)."""
    sizes = [stop - start for start, stop in plan.buffers(group)]
    chosen = forms.choose_form(sizes, group.dtype, world, group.config, inner_world=inner_world,
                                 backend=backends.get(plan.backends[group]).timed_as, measure=measure,
                                 residual=residual)
    moved = dataclasses.replace(group, config=chosen)
    if chosen == group.config or moved in plan.groups:
        return group
    members = plan.groups.pop(group)
    del plan.backends[group]
    plan.groups[moved] = members
    plan.backends[moved] = _backend(chosen, axes, world, inner_world, impl, residual)
    for i in members:
        plan.configs[i] = chosen
    return moved


def _backend(config: CompressionConfig, axes, world: int, inner_world: int | None, impl: str, residual: bool) -> str:
    """The backend of a group's compressed exchange: over ``axes``, or a hierarchical config's
    outer axes (its inner axis is summed by lax); "xla" outside a mesh (``axes`` None)."""
    if axes is None:
        return "xla"
    if config.hierarchical and len(axes) > 1:
        axes, world = axes[:-1], world // (inner_world or 1)
        if world < 2:  # one node: an exact psum, no exchange
            return "xla"
    return backends.choose_in_trace(config.backend, reduction(axes, world, config, impl, residual))


def _decide(plan: Plan, group: Group, world: int, inner_world: int | None, backend: str, measure: bool) -> None:
    """Price the group's buffers; move leaves only in losing buffers to the auto-psum lane."""

    def price() -> list[pricing.Decision]:
        return [pricing.decide(stop - start, group.dtype, world, group.config, inner_world=inner_world,
                              backend=backend, measure=measure, copied=copied)
                for (start, stop), copied in zip(plan.buffers(group), plan.copied(group))]

    decisions = price()
    if all(d.compress for d in decisions):
        plan.decisions[group] = decisions
        return
    members = plan.groups[group]
    bounds = np.cumsum([0] + [plan.sizes[i] for i in members])
    spans = plan.buffers(group)
    # The buffers each leaf lies in.
    within = {i: [k for k, (a, b) in enumerate(spans) if a < bounds[j + 1] and b > bounds[j]]
              for j, i in enumerate(members)}
    wins = {i: any(decisions[k].compress for k in within[i]) for i in members}
    keep = [i for i in members if wins[i]]
    moved = [i for i in members if not wins[i]]
    for i in moved:
        plan.lanes[i] = "auto-psum"
    # The losing buffers that gave up leaves (one that holds only the tail of a winning leaf stays
    # that leaf's, priced again below).
    losing = [(group, b - a, d, tuple(i for i in moved if k in within[i]))
              for k, ((a, b), d) in enumerate(zip(spans, decisions)) if not d.compress]
    plan.dissolved += [entry for entry in losing if entry[3]]
    if keep:
        plan.groups[group] = keep
        plan.decisions[group] = price()
    else:
        del plan.groups[group]


def lane(path, leaf, config: CompressionConfig | None, api: str = "compressed_psum") -> str:
    """"exact" (psum), "half" (psum in 16 bits) or "quantized" (compressed, fused by dtype and config;
    :func:`make_plan` may move it to "auto-psum")."""
    if config is None or not config.enabled:
        return "exact"
    dtype = np.dtype(leaf.dtype)
    if dtype.kind in "iub":
        return "exact"
    if leaf.size == 0 or leaf.size < config.min_size:  # nothing to compress (min_size may be 0)
        return "exact"
    if dtype not in SUPPORTED_DTYPES:
        # (config=None would not help: it means the default config, which compresses.)
        raise TypeError(
            f"{api}: leaf {jax.tree_util.keystr(path) or '(the whole value)'} has dtype {dtype}, which cannot be "
            "compressed (float32, bfloat16 and float16 can): cast it, or reduce it exactly by giving it None in "
            "a config pytree (or returning None for its path from a config function)"
        )
    return "half" if config.bits == 16 else "quantized"


# The lanes that compress (policy="auto" may send a quantized leaf to psum: it is checked alike,
# so that whether a program raises never depends on timings).
COMPRESSED_LANES = ("quantized", "half", "auto-psum")


def check_varying(api: str, paths, leaves, lanes, axes: tuple, *, mean: bool = False) -> None:
    """Refuse a leaf of a compressed lane that ``shard_map(check_vma=True)`` types as invariant
    over some of ``axes``: the same on every device.

    Summing such a value adds W equal copies and averaging it returns it unchanged: there is
    nothing to compress, and it is almost always a mistake. The gradient with respect to
    replicated parameters is such a value, already summed over the axis by JAX (its transpose
    of the implicit broadcast is a psum), so a mean of it is W times the mean gradient, and
    quantized. No use needs the compressed lane for it: ``W * x`` (psum) and ``x`` (pmean) are
    exact and free. ``lax.psum`` itself sums it silently, and leaves that jax_cgx reduces exactly
    (integer, fewer than ``min_size`` values, a ``None`` config, ``bits=32``) are ``lax.psum`` and
    keep its meaning. Without ``check_vma`` there is no type to read: nothing is checked.
    """
    if not compat.check_vma_enabled():
        return
    vmapped = compat.vmapped_axes(axes)  # no vma types (and refused with their own error)
    bad = []
    for path, leaf, kind in zip(paths, leaves, lanes):
        if kind in COMPRESSED_LANES:
            have = compat.varying_axes(jax.typeof(leaf))
            if missing := tuple(a for a in axes if a not in have and a not in vmapped):
                bad.append((path, missing))
    if not bad:
        return
    path, missing = bad[0]
    axis = repr(missing[0] if len(missing) == 1 else missing)
    copies = math.prod(jax.lax.axis_size(a) for a in missing)
    more = "" if len(bad) == 1 else f" (and {len(bad) - 1} other leaf{'' if len(bad) == 2 else 'ves'})"
    if mean:
        result, again = "averaging it returns it unchanged, up to the compression error", "the mean gradient"
        meant = "If the value itself is what you mean, it needs no mean: it is already the same on every device."
    else:
        result, again = f"summing it adds {copies} equal copies", "the summed gradient"
        meant = f"If {copies} times the value is what you mean, use jax.lax.psum (exact)."
    raise ValueError(
        f"{api}: leaf {jax.tree_util.keystr(path) or '(root)'}{more} is invariant over {axis}: "
        f"shard_map(check_vma=True) types it as the same on every device, so {result}. The gradient with "
        f"respect to replicated parameters is such a value: JAX has already summed it over {axis} (uncompressed), "
        f"and this would give {copies} times {again}. Differentiate with respect to this device's varying copy "
        f"instead: jax.grad(loss_fn)(jax.lax.pcast(params, {axis}, to='varying'), batch) "
        f"(jax_cgx.data_parallel_value_and_grad and jax_cgx.reduce_in_backward do it for you). {meant}"
    )
