"""``policy="auto"`` over nodes: which form a group of fusion buffers runs in.

A reduction over two axes (nodes, then the devices of one node) can run flat (SRA or ring over
every device) or hierarchical (exact inside the node, SRA or ring across nodes). The forms lie
within the cost model's error of each other, so each is priced by
:func:`jax_cgx._src.policy.pricing.decide` with the links measured per axis and, within its caps,
timed on a two-level probe mesh; the fastest runs (docs/multinode.md).
"""

from __future__ import annotations

import logging

import numpy as np

from jax_cgx._src.config import CompressionConfig
from jax_cgx._src.policy import pricing

__all__ = ["SWITCH_SPEEDUP", "forms", "choose_form"]

logger = logging.getLogger("jax_cgx")

# policy="auto" switches a group to another form only where it is priced this much faster than the
# configured one (forms within a few percent are a tie: keep what the user wrote).
SWITCH_SPEEDUP = 1.05


def forms(config: CompressionConfig, world: int, inner_world: int | None, residual: bool = False
          ) -> list[CompressionConfig]:
    """The forms ``policy="auto"`` weighs for ``config``'s group, the configured one first: over
    nodes (two axes), flat and hierarchical SRA and ring; over one axis only the configured form
    (there the model's validated choice is compress or not, and SRA and ring differ in bits).
    Error feedback's residuals keep the configured level (flat or hierarchical)."""
    if not pricing.two_level(world, inner_world):
        return [config]
    levels_ = (config.hierarchical,) if residual else (False, True)
    out = [config]
    for hierarchical in levels_:
        for algorithm in ("sra", "ring"):
            c = config.replace(algorithm=algorithm, hierarchical=hierarchical)
            if c not in out:
                out.append(c)
    return out


def choose_form(buffers: list[int], dtype, world: int, config: CompressionConfig, *,
                inner_world: int | None = None, backend: str = "xla", measure: bool = True, residual: bool = False,
                log: bool = True) -> CompressionConfig:
    """The form (algorithm, flat or hierarchical) ``policy="auto"`` runs a group of fusion buffers
    of ``buffers`` values each in: the one whose buffers cost least, each buffer at its psum or its
    compressed exchange as :func:`~jax_cgx._src.policy.pricing.decide` decides (timed where it
    times), unless that is within :data:`SWITCH_SPEEDUP` of the configured form. Logged once with
    every form's price."""
    candidates = forms(config, world, inner_world, residual)
    if len(candidates) == 1 or world < 2:
        return config
    priced, psums = [], None
    for c in candidates:
        ds = [pricing.decide(v, dtype, world, c, inner_world=inner_world, backend=backend, log=False, measure=measure)
              for v in buffers]
        # One psum price per buffer for every form, the first form's (the same op: a psum's own
        # noise must not pick the form).
        psums = psums or [d.psum_s for d in ds]
        priced.append((sum(d.compressed_s if d.compress else p for d, p in zip(ds, psums)), c,
                       any(d.measured for d in ds), any(d.compress for d in ds)))
    best = min(priced, key=lambda p: p[0])
    chosen = best[1] if best[3] and best[0] * SWITCH_SPEEDUP < priced[0][0] else config
    key = ("form", tuple(buffers), np.dtype(dtype).name, world, inner_world, config, backend)
    if log and key not in pricing._logged:  # once, as pricing logs its decisions
        pricing._logged.add(key)
        nodes = f" (nodes of {inner_world})" if pricing.two_level(world, inner_world) else ""
        prices = ", ".join(f"{pricing.form_name(c)} {t * 1e3:.3g} ms{' measured' if m else ''}"
                           for t, c, m, _ in priced)
        logger.info("jax_cgx: policy='auto': %s for %d buffer(s) of %s over %d ranks%s (%s; psum %.3g ms)",
                    pricing.form_name(chosen), len(buffers), np.dtype(dtype).name, world, nodes, prices,
                    sum(psums) * 1e3)
    return chosen
