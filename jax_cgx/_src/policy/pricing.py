"""``policy="auto"``: compress a fusion buffer only where it is predicted (or timed) faster.

Every fusion buffer is priced twice by :mod:`jax_cgx._src.policy.cost_model`, as the lax
collective and as the compressed exchange, and is compressed only where that is :data:`MIN_SPEEDUP`
times faster; leaves only in losing buffers are reduced by lax (:mod:`jax_cgx._src.collectives.plan`).
The figures (the link's rate and latency from timed psums over all devices, unless
``link_gbps``/``JAX_CGX_LINK_GBPS`` gives the rate; the codec's rates) are measured once per
process, collectively, and agreed (every process takes the slowest), so that all take the same
decisions: each is a Python bool computed while tracing, static under ``jit``. Near-ties
(:data:`TIE_BAND`), every buffer outside :data:`VALIDATED_PLATFORMS`, and every form over nodes
are settled by timing the buffer itself on the backend that runs it. Figures and decisions are
logged once at INFO on the ``jax_cgx`` logger; the figures are
:mod:`jax_cgx._src.policy.calibration`'s (re-exported here); docs/performance.md ("Never slower: policy='auto'",
"Near-ties timed") and docs/multinode.md tell the whole story; the probes are
:mod:`jax_cgx._src.policy.probes`.
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from jax_cgx._src.config import CompressionConfig, given_link_gbps
from jax_cgx._src.exchange import wire as _wire
from jax_cgx._src.policy import calibration, probes
from jax_cgx._src.policy.calibration import (  # the figures decisions are priced with (re-exported)
    LOCK,
    agree,
    calibrate,
    figures,
    known_figures,
    levels,
    one_process_alone,
    outside_trace,
)
from jax_cgx._src.policy.cost_model import LinkModel, inside_seconds, predict, predict_nodes
from jax_cgx._src.policy.figures import Decision, Figures
from jax_cgx._src.policy.probes import ExchangeFit, Timed

__all__ = ["Figures", "Decision", "ExchangeFit", "Timed", "calibrate", "figures", "known_figures", "one_process_alone",
           "decide", "levels", "reset", "timed", "form_name", "two_level",
           "MIN_SPEEDUP", "TIE_BAND", "VALIDATED_PLATFORMS"]

logger = logging.getLogger("jax_cgx")

# Compress only where the prediction is this much faster than a psum: a psum is exact, and
# near a tie the model cannot tell (a small buffer's exchange and its psum both cost a few
# collectives' fixed costs; at W=2 the model prices them the same).
MIN_SPEEDUP = 1.1
# Predictions closer than this factor are settled by timing the buffer itself (measured link only).
TIE_BAND = 2.0
# ...unless one timing would take longer than this, predicted: psum plus exchange on a validated
# platform, the psum alone elsewhere (its compressed prediction is not trusted there).
_SETTLE_MAX_S = 1.0
# Platforms where the model's predictions were checked against measurements (docs/results.md, "Cost
# model": every median within 25%, on CPUs). Elsewhere the model settles nothing it can time: every
# buffer within _SETTLE_MAX_S and _SETTLE_MAX_BUFFERS is timed, not only near-ties (on the first GPU
# run, docs/gpu-results.md, the model chose psum for a buffer that 4-bit sent 3.66x faster).
VALIDATED_PLATFORMS = frozenset({"cpu"})
# Distinct buffers timed per process at most (each costs two compiles in the first trace); past
# it the model decides. A count, not a time budget: every process must take the same decisions.
_SETTLE_MAX_BUFFERS = 16


# ((platform, values, dtype, backend, op, inner), config) -> (psum seconds, exchange seconds), agreed:
# the buffer apart from the config, whose forms over nodes share one psum timing.
_settled: dict[tuple, tuple[float, float]] = {}
_logged: set = set()


def first_time(key) -> bool:
    """Whether ``key`` (a decision) is seen for the first time since :func:`reset`: each decision
    of this module's and of :mod:`~jax_cgx._src.policy.forms` is logged once."""
    if key in _logged:
        return False
    _logged.add(key)
    return True


def reset() -> None:
    """Forget the measured figures and logged decisions (tests; a changed network)."""
    with LOCK:
        calibration.forget()
        _settled.clear()
        _logged.clear()


def _time_exchange(devices, values: int, dtype, config: CompressionConfig, backend: str, bodies: Timed | None = None,
                   inner: int | None = None, psum_s: float | None = None, rivals: tuple = ()) -> tuple[float, ...]:
    """:func:`~jax_cgx._src.policy.probes.time_exchange`, the slowest process's."""
    return tuple(agree(list(probes.time_exchange(devices, values, dtype, config, backend, bodies, inner, psum_s,
                                                  rivals)), np.max))


def two_level(world: int, inner_world: int | None) -> bool:
    """A reduction over nodes of ``inner_world`` ranks: two axes, each with more than one rank."""
    return inner_world is not None and 1 < inner_world < world


def _names(op: str) -> tuple[str, str]:
    """Log lines' prefix and uncompressed collective: ("", "psum") or ("psum_scatter: ", "lax.psum_scatter")."""
    return ("", "psum") if op == "psum" else (f"{op}: ", f"lax.{op}")


def _settle(values: int, dtype, world: int, config: CompressionConfig, backend: str, fig: Figures,
            measure: bool = True, op: str = "psum", bodies: Timed | None = None,
            inner_world: int | None = None, rivals: tuple[CompressionConfig, ...] = ()) -> tuple[float, float] | None:
    """The measured ``(psum, exchange)`` seconds of this buffer, or None where it cannot be
    timed alone: the reduction does not span every device, or is hierarchical over one level
    (``inner_world``: over nodes of that many devices, timed on a two-level mesh), or
    ``_SETTLE_MAX_BUFFERS`` were timed already. ``measure=False``: only what was timed before
    (timing is collective; :func:`jax_cgx.explain` may run on one process). ``rivals``: forms a
    choice weighs against ``config``, timed (where not yet) in the same interleaved runs and kept."""
    devices = jax.devices(fig.platform)
    inner = inner_world if two_level(world, inner_world) and op == "psum" else None
    if len(devices) != world or (config.hierarchical and inner is None) or (inner and len(devices) % inner):
        return None
    buffer = (fig.platform, values, np.dtype(dtype).name, backend, op, inner)
    key = (buffer, config)
    with LOCK:
        if key not in _settled and not measure:
            return None
        if key not in _settled and len(_settled) >= _SETTLE_MAX_BUFFERS:
            if first_time("settle-cap"):
                logger.info("jax_cgx: policy='auto': %d buffer sizes timed already; the cost model decides "
                            "the rest", _SETTLE_MAX_BUFFERS)
            return None
        if key not in _settled:
            if op != "psum" and bodies is None:
                raise ValueError(f"policy: timing a {op} buffer needs its programs (decide(..., bodies=...))")
            t0 = time.perf_counter()
            # Another form of this buffer (over nodes, or its messages) timed its psum already: not again.
            same = [t for (b, _), t in _settled.items() if b == buffer]
            rivals = tuple(r for r in dict.fromkeys(rivals) if r != config and (buffer, r) not in _settled)
            psum_s, *exchange_s = outside_trace(lambda: _time_exchange(
                devices, values, dtype, config, backend, bodies, inner, same[0][0] if same else None, rivals))
            for c, e in zip((config, *rivals), exchange_s, strict=True):
                _settled[(buffer, c)] = (psum_s, e)
            prefix, lax_name = _names(op)
            named = inner or rivals  # then each form by name: "sra 95 ms; sra, 1 message 52 ms"
            exchanges = "; ".join(f"{form_name(c, inner) + ' ' if named else ''}{e * 1e3:.3g} ms"
                                  for c, e in zip((config, *rivals), exchange_s))
            logger.info("jax_cgx: policy='auto': %stimed a %.4g MiB %s buffer over %d ranks%s in %.2f s (%s %.3g ms, "
                        "compressed exchange on %s: %s)", prefix, values * np.dtype(dtype).itemsize / 2**20,
                        np.dtype(dtype).name, world, f" (nodes of {inner})" if inner else "",
                        time.perf_counter() - t0, lax_name, psum_s * 1e3, backend, exchanges)
        return _settled[key]


def _worth_timing(psum: float, compressed: float, platform: str) -> bool:
    """Whether a buffer predicted at ``psum`` and ``compressed`` seconds is timed: a near-tie on a
    platform whose predictions were validated; any buffer elsewhere, its compressed prediction untrusted."""
    tie = psum / TIE_BAND < compressed < psum * TIE_BAND and psum + compressed < _SETTLE_MAX_S
    return tie if platform in VALIDATED_PLATFORMS else psum < _SETTLE_MAX_S


def decide(values: int, dtype, world: int, config: CompressionConfig, *, inner_world: int | None = None,
           platform: str | None = None, backend: str = "xla", log: bool = True, measure: bool = True,
           op: str = "psum", bodies: Timed | None = None, copied: float = 2.0) -> Decision:
    """Whether ``policy="auto"`` compresses a buffer of ``values`` values of ``dtype`` summed over ``world`` ranks.

    ``inner_world``: the inner axis's size for a hierarchical config (its reduce-scatter and
    all-gather run within a node, priced at the rate :func:`levels` measured there; memory
    speed where nothing was measured). ``backend``: the one that will
    run the exchange (its ``timed_as``, :mod:`jax_cgx._src.backends`); near-ties are timed on it, collectively, unless
    ``measure=False`` (then only earlier timings are used). The decision is logged once.

    ``op``: as :func:`~jax_cgx._src.policy.cost_model.predict` takes it; the sharded ones pass
    ``bodies`` (:data:`Timed`) to time near-ties with, their :class:`ExchangeFit` is the
    all-reduce's scaled to their share of its codec work, and ``Decision.psum_s`` is their lax
    time. ``copied``: buffer sizes of fusion copies charged on top of a timing (2: in and out).
    """
    fig = figures(config, platform)
    itemsize = np.dtype(dtype).itemsize
    size = values * itemsize

    def model(nbytes: float, ranks: int, of: str = op, link: LinkModel = fig.link) -> dict[str, float]:
        return predict(nbytes, ranks, config.bits, config.bucket_size, link, fig.rates,
                       segments=config.pipeline_segments, itemsize=itemsize,
                       message_cap=_wire.message_cap([fig.platform], given_link_gbps(config)), share=fig.share, op=of,
                       algorithm=config.algorithm)

    def fitted(p: dict[str, float], nbytes: float, share_of_fit: float = 1.0) -> float:
        """The wire, and the larger of the modelled codec and the measured fit (scaled)."""
        return p["wire"] + max(p["codec"] + p["copies"], share_of_fit * fig.exchange.seconds(nbytes / itemsize * 4))

    def exchange(nbytes: float, ranks: int, link: LinkModel = fig.link) -> float:
        if ranks < 2:
            return 0.0
        p = model(nbytes, ranks, link=link)
        if op == "psum":
            return fitted(p, nbytes)
        # The fit was measured on all-reduces: this collective's share of their compute.
        whole = model(nbytes, ranks, "psum", link)
        return fitted(p, nbytes, (p["codec"] + p["copies"]) / (whole["codec"] + whole["copies"]))

    psum = _predicted_psum(values, dtype, world, config, fig, op)
    # Over nodes (op psum, two axes): each axis's measured link prices its part.
    level = levels(fig, inner_world, measure) if two_level(world, inner_world) and op == "psum" else None
    if config.hierarchical and inner_world and inner_world > 1:
        inside, across = level if level else (None, None)  # before measuring: memory speed
        inner = inside_seconds(size, inner_world, fig.rates, fig.share, inside)
        cross = fig.link if across is None else LinkModel(across, fig.link.latency)
        compressed = inner + exchange(size / inner_world, world // inner_world, cross)
    elif level is not None:  # flat over nodes: SRA's all_to_all crosses at the shared rate, the ring once a step
        p = predict_nodes(size, world // inner_world, inner_world, config.bits, config.bucket_size, fig.link,
                          fig.rates, segments=config.pipeline_segments, itemsize=itemsize,
                          message_cap=_wire.message_cap([fig.platform], given_link_gbps(config)), share=fig.share,
                          cross_bandwidth=level[1], algorithm=config.algorithm)
        compressed = fitted(p, size)
    else:
        compressed = exchange(size, world)
    measured = None
    # Over nodes every form is timed (within the caps): the forms are close and the model was
    # checked on one such topology only, while auto must pick the fastest of four.
    if fig.link_measured and (_worth_timing(psum, compressed, fig.platform)
                              or (level is not None and psum < _SETTLE_MAX_S)):
        measured = _settle(values, dtype, world, config, backend, fig, measure, op, bodies, inner_world)
    if measured is not None:
        # What the step adds to a compressed buffer: its leaves copied in, its result sliced out.
        psum, compressed = measured[0], measured[1] + fig.share * copied * size / fig.rates.add
    decision = Decision(compressed * MIN_SPEEDUP < psum, psum, compressed, measured is not None, backend)
    key = (values, np.dtype(dtype).name, world, inner_world, config, fig, backend, op)
    if log and first_time(key):
        prefix, lax_name = _names(op)  # "compress" or "psum (uncompressed)"; "psum_scatter: lax (...)"
        logger.info("jax_cgx: policy='auto': %s%s a %.4g MiB %s buffer over %d ranks at %d bits "
                    "(%s %.3g ms compressed on %s, %.3g ms %s)", prefix,
                    "compress" if decision.compress else lax_name.split(".")[0] + " (uncompressed)", size / 2**20,
                    np.dtype(dtype).name, world, config.bits, "measured" if decision.measured else "predicted",
                    compressed * 1e3, backend, psum * 1e3, lax_name)
    return decision


def timed(values: int, dtype, world: int, configs: tuple[CompressionConfig, ...], *, inner_world: int | None = None,
          backend: str = "xla", measure: bool = True) -> list[float] | None:
    """The measured seconds of each config's compressed exchange of one buffer of ``values``, the
    configs timed in the same interleaved runs (once, collectively, and agreed); None where they
    are not timed: the link given (not measured), a psum predicted at :data:`_SETTLE_MAX_S` or
    more (a timing would take minutes), or as :func:`_settle` declines."""
    fig = figures(configs[0])
    if not fig.link_measured or _predicted_psum(values, dtype, world, configs[0], fig) >= _SETTLE_MAX_S:
        return None
    measured = [_settle(values, dtype, world, c, backend, fig, measure, inner_world=inner_world, rivals=configs)
                for c in configs]
    return None if None in measured else [m[1] for m in measured]


def _predicted_psum(values: int, dtype, world: int, config: CompressionConfig, fig: Figures, op: str = "psum") -> float:
    """The model's seconds of the lax collective (``op``): what :func:`decide` weighs against, and what caps timing."""
    itemsize = np.dtype(dtype).itemsize
    return predict(values * itemsize, world, config.bits, config.bucket_size, fig.link, fig.rates, itemsize=itemsize,
                   share=fig.share, op=op)["psum"]


def form_name(config: CompressionConfig, inner: int | None = None) -> str:
    """How a config reduces, for log lines: "ring", "sra", "hierarchical sra"; ", 1 message" where
    each collective sends one message per peer (``pipeline_segments=1``)."""
    level = "hierarchical " if config.hierarchical and (inner is None or inner > 1) else ""
    return level + config.algorithm + (", 1 message" if config.pipeline_segments == 1 else "")

