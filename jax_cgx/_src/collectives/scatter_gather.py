"""What ``compressed_psum_scatter`` and ``compressed_all_gather`` share: the pytree's lanes,
quantized leaves fused into buffers, ``policy="auto"``'s decision per buffer, one key per
buffer, and the checks of a config.

Each leaf takes a lane, as in ``compressed_psum`` (:func:`jax_cgx._src.collectives.plan.lane`):
"exact" (``lax`` itself), "half" (``lax`` in 16 bits) or "quantized". Quantized leaves of
one dtype and config are fused, in order, into buffers of whole leaves holding at most
``fusion_buffer_mb`` (a larger leaf is a buffer of its own): a buffer is one exchange, and
its leaves share buckets only where one leaf ends and the next begins.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import jax
import numpy as np
from jax import lax

from jax_cgx._src import backends, codec, compat
from jax_cgx._src.collectives.plan import ConfigSpec, Group, lane, leaf_configs, varying_beyond
from jax_cgx._src.config import CompressionConfig
from jax_cgx._src.policy import pricing

__all__ = ["Leaves", "fuse", "buffer_keys", "buffers", "compressed_buffers", "copied", "decide", "check_config",
           "check_key", "timing_key"]

log = logging.getLogger("jax_cgx")
_logged: set = set()


class Leaves:
    """A pytree's leaves, their configs and lanes, and the fusion groups of the quantized ones."""

    def __init__(self, x, config: ConfigSpec, api: str, axes: tuple | None = None):
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(x)
        self.paths = [p for p, _ in flat]
        self.leaves = [v if isinstance(v, jax.ShapeDtypeStruct) else jax.numpy.asarray(v) for _, v in flat]
        self.configs = leaf_configs(config, x, self.paths, api)
        self.lanes = [lane(p, v, c, api) for p, v, c in zip(self.paths, self.leaves, self.configs)]
        self.groups: dict[Group, list[int]] = {}
        for i, (kind, leaf, c) in enumerate(zip(self.lanes, self.leaves, self.configs)):
            if kind == "quantized":
                check_config(c, api)
                self.groups.setdefault(Group(np.dtype(leaf.dtype), c, varying_beyond(leaf, axes)), []).append(i)

    def name(self, i: int) -> str:
        return jax.tree_util.keystr(self.paths[i]) or "(root)"


def fuse(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Consecutive runs of positions whose ``sizes`` (values) add up to at most ``capacity``;
    a size above it is a run of its own."""
    runs: list[list[int]] = []
    total = 0
    for k, n in enumerate(sizes):
        if runs and total + n <= capacity:
            runs[-1].append(k)
            total += n
        else:
            runs.append([k])
            total = n
    return runs


def compressed_buffers(leaves: Leaves, axes, world: int, op: str, key, seeds_per_buffer: int, api: str,
                       lax_name: str, bodies: pricing.Timed, impl: str = "auto", residual: bool = False
                       ) -> tuple[list[tuple[Group, list[int], jax.Array, str]], set[int]]:
    """The fusion buffers to compress, each with its seeds ``uint32[1, seeds_per_buffer, 2]``
    (zeros without a key) and the backend chosen for it (once, here), and the leaves that
    ``policy="auto"`` leaves to lax: those of the buffers it prices faster uncompressed
    (:func:`decide`; ``bodies`` time its near-ties). A buffer's seeds do not depend on the
    other buffers' decisions. Refuses a vmapped axis, which has no wire to compress."""
    if vmapped := compat.vmapped_axes(axes):
        raise NotImplementedError(f"{api} over the vmapped axis {vmapped[0]!r} is not supported: vmap has no "
                                  f"wire to compress; use jax.lax.{lax_name} for that axis")
    planned = buffers(leaves, world, op)
    shape = (1, seeds_per_buffer, 2)
    compressed, uncompressed = [], set()
    for (group, members), k in zip(planned, buffer_keys(key, axes, len(planned))):
        reduction = backends.Reduction(api, op, tuple(axes), world, "sra", impl, residual)
        backend = backends.choose_in_trace(group.config.backend, reduction)
        if not decide(leaves, group, members, world, op, bodies=bodies, backend=backend).compress:
            uncompressed.update(members)
            continue
        seeds = codec.rounding_seeds(k, shape, group.config.stochastic)
        compressed.append((group, members, seeds, backend))
    return compressed, uncompressed


def decide(leaves: Leaves, group: Group, members: list[int], world: int, op: str, *,
           bodies: pricing.Timed | None = None, measure: bool = True, backend: str = "xla") -> pricing.Decision:
    """Whether one buffer is compressed: always, unless its config says ``policy="auto"`` and the
    cost model (or, near a tie, a timing) finds ``op`` faster uncompressed. Collective when it
    measures (every process traces the same buffers); ``measure=False`` uses earlier figures only.
    Priced (and timed) as ``backend`` asks to be (its ``timed_as``)."""
    if group.config.policy != "auto":
        return pricing.Decision(True, 0.0, 0.0)
    values = sum(leaves.leaves[i].size for i in members)  # each rank's input: W blocks, or its shard
    return pricing.decide(values, group.dtype, world, group.config, op=op, bodies=bodies, measure=measure,
                         log=measure, copied=copied(members, world, op), backend=backends.get(backend).timed_as)


def copied(members: list[int], world: int, op: str) -> float:
    """The input sizes a buffer's fusion copies move (pricing.decide's ``copied``): several leaves
    are copied in (the input's size) and sliced out (1/W of it, or W times it); one leaf is not."""
    return 0.0 if len(members) == 1 else 1 + (1 / world if op == "psum_scatter" else world)


def buffer_keys(key, axes, count: int) -> list:
    """One key per buffer, each rank's own (it folds in its index): independent rounding noise."""
    if key is None:
        return [None] * count
    rank_key = jax.random.fold_in(key, lax.axis_index(axes))
    return [jax.random.fold_in(rank_key, b) for b in range(count)]


def timing_key(config: CompressionConfig):
    """The key a timing of ``config``'s exchange runs with: any, when it rounds stochastically."""
    return jax.random.key(0) if config.stochastic else None


def check_config(config: CompressionConfig, api: str) -> None:
    """Refuse what these collectives cannot do; say once what they do differently."""
    if config.hierarchical:
        raise ValueError(f"{api}: hierarchical=True applies to all-reduces only; use hierarchical=False here")
    notes = []
    if config.algorithm != "sra":
        notes.append(f"algorithm={config.algorithm!r} does not apply: the exchange is one all_to_all or all_gather")
    if config.skip_incomplete_buckets:
        notes.append("skip_incomplete_buckets=True does not apply: every block or shard is quantized whole, "
                     "its shorter last bucket too (within the same error bound)")
    for note in notes:
        if (api, note) not in _logged:
            _logged.add((api, note))
            log.info("jax_cgx: %s: %s", api, note)


def check_key(leaves: Leaves, key, api: str) -> None:
    if key is None and any(g.config.stochastic for g in leaves.groups):
        raise ValueError(f"{api}: stochastic rounding needs a PRNG key; pass key=jax.random.key(...) "
                         "(the same on every rank; each rank folds in its index)")


def buffers(leaves: Leaves, world: int, op: str) -> list[tuple[Group, list[int]]]:
    """The fusion buffers of the quantized leaves, in order: ``(group, leaf indices)``.

    Capacity counts what one exchange holds: ``world`` blocks of a psum_scatter input (the
    leaf), ``world`` shards of an all_gather output (``world`` times the leaf)."""
    per = (lambda i: leaves.leaves[i].size // world) if op == "psum_scatter" else (lambda i: leaves.leaves[i].size)
    return [(group, [members[k] for k in run]) for group, members in leaves.groups.items()
            for run in fuse([per(i) for i in members], group.capacity // world)]
