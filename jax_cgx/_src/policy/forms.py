"""``policy="auto"``: which form a group of fusion buffers runs in.

A reduction over two axes (nodes, then the devices of one node) can run flat (SRA or ring over
every device) or hierarchical (exact inside the node, SRA or ring across nodes). The forms lie
within the cost model's error of each other, so each is priced by
:func:`jax_cgx._src.policy.pricing.decide` with the links measured per axis and, within its caps,
timed on a two-level probe mesh; the fastest runs (docs/multinode.md).

On the xla backend over gloo (CPU, several processes) with the link's rate not given, the form's
messages are chosen too: cut as the default cuts them (at most 256 KiB, right on a slow link) or
one per collective (right on a fast one, where every message costs a round), whichever the group's
largest buffer was timed faster with (:func:`choose_messages`; the model does not price gloo's
large-message penalty, so only a timing decides).
"""

from __future__ import annotations

import logging

import jax
import numpy as np

from jax_cgx._src.config import CompressionConfig, given_link_gbps
from jax_cgx._src.exchange import wire as _wire
from jax_cgx._src.exchange.chunks import chunk_length, row_plan
from jax_cgx._src.policy import pricing

__all__ = ["SWITCH_SPEEDUP", "forms", "choose_form", "choose_messages"]

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
    """The form (algorithm, flat or hierarchical, and its messages) ``policy="auto"`` runs a group of
    fusion buffers of ``buffers`` values each in: the one whose buffers cost least, each buffer at its
    psum or its compressed exchange as :func:`~jax_cgx._src.policy.pricing.decide` decides (timed
    where it times), unless that is within :data:`SWITCH_SPEEDUP` of the configured form; its messages
    chosen first (:func:`choose_messages`). Logged once with every form's price."""
    if world < 2:
        return config
    # Messages first: they are the transport's (one message can turn a form that loses to psum into
    # the fastest), and every form is then timed the way it will run.
    config = choose_messages(buffers, dtype, world, config, inner_world=inner_world, backend=backend, measure=measure,
                             log=log)
    return _fastest_form(buffers, dtype, world, config, inner_world, backend, measure, residual, log)


def _fastest_form(buffers: list[int], dtype, world: int, config: CompressionConfig, inner_world: int | None,
                  backend: str, measure: bool, residual: bool, log: bool) -> CompressionConfig:
    candidates = forms(config, world, inner_world, residual)
    if len(candidates) == 1:
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
    if log and pricing.first_time(key):  # once, as pricing logs its decisions
        nodes = f" (nodes of {inner_world})" if pricing.two_level(world, inner_world) else ""
        prices = ", ".join(f"{pricing.form_name(c)} {t * 1e3:.3g} ms{' measured' if m else ''}"
                           for t, c, m, _ in priced)
        logger.info("jax_cgx: policy='auto': %s for %d buffer(s) of %s over %d ranks%s (%s; psum %.3g ms)",
                    pricing.form_name(chosen), len(buffers), np.dtype(dtype).name, world, nodes, prices,
                    sum(psums) * 1e3)
    return chosen


def choose_messages(buffers: list[int], dtype, world: int, config: CompressionConfig, *,
                    inner_world: int | None = None, backend: str = "xla", measure: bool = True,
                    log: bool = True) -> CompressionConfig:
    """``config`` as is, or with one message per collective (``pipeline_segments=1``) where that
    timed :data:`SWITCH_SPEEDUP` faster on the group's largest buffer. Only where the default cut
    applies and is unsure: the xla backend on CPU with several processes, ``pipeline_segments=0``,
    the link's rate not given (given, the messages are sized to it), the buffer cut into more than
    one message. Timed whether or not the cut form beat psum: one message may (2x2 CPU nodes at 10
    Gbit/s, 8 bits: psum 134 ms, cut 168, one message 75). Logged once with both timings."""
    largest = max(buffers, default=0)
    if backend != "xla" or config.pipeline_segments or given_link_gbps(config) is not None or not largest:
        return config
    cap = _wire.message_cap([jax.default_backend()])
    chunk = chunk_length(largest, world, config.bucket_size, config.skip_incomplete_buckets)
    if cap is None or row_plan(chunk, config.bits, config.bucket_size, "auto", 0, cap)[3] < 2:
        return config
    one = config.replace(pipeline_segments=1)
    # Both in the same interleaved runs: a choice between two timings taken apart could follow
    # whatever the machine did in between (a peer still compiling on shared cores).
    both = pricing.timed(largest, dtype, world, (config, one), inner_world=inner_world, backend=backend,
                         measure=measure)
    if both is None:
        return config
    cut_s, one_s = both
    chosen = one if one_s * SWITCH_SPEEDUP < cut_s else config
    key = ("messages", largest, np.dtype(dtype).name, world, inner_world, config, backend)
    if log and pricing.first_time(key):
        logger.info("jax_cgx: policy='auto': %s for a %.4g MiB %s buffer over %d ranks (%s: timed %.3g ms "
                    "in messages of at most %d KiB, %.3g ms in one; set link_gbps or JAX_CGX_LINK_GBPS to size them "
                    "to the link instead)",
                    "one message per collective" if chosen is one else "messages cut by size",
                    largest * np.dtype(dtype).itemsize / 2**20,
                    np.dtype(dtype).name, world, pricing.form_name(config, inner_world), cut_s * 1e3, cap // 1024,
                    one_s * 1e3)
    return chosen
