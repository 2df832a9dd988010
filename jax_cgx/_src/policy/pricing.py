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
logged once at INFO on the ``jax_cgx`` logger; docs/performance.md ("Never slower: policy='auto'",
"Near-ties timed") and docs/multinode.md tell the whole story; the probes are
:mod:`jax_cgx._src.policy.probes`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from jax_cgx._src.config import CompressionConfig, given_link_gbps, link_gbps_from_env
from jax_cgx._src.exchange import wire as _wire
from jax_cgx._src.policy import probes
from jax_cgx._src.policy.cost_model import CodecRates, LinkModel, inside_seconds, predict, predict_nodes
from jax_cgx._src.policy.figures import Decision, Figures
from jax_cgx._src.policy.figures import gbits as _gbits
from jax_cgx._src.policy.probes import ExchangeFit, Timed

__all__ = ["Figures", "Decision", "ExchangeFit", "Timed", "calibrate", "figures", "decide", "levels", "timed", "form_name",
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


_lock = threading.RLock()
# By platform: what the probe measured over all devices (link, exchange, where it was measured).
_measured_link: dict[str, tuple[LinkModel, ExchangeFit, str]] = {}
_measured_rates: dict[str, CodecRates] = {}
# ((platform, values, dtype, backend, op, inner), config) -> (psum seconds, exchange seconds), agreed:
# the buffer apart from the config, whose forms over nodes share one psum timing.
_settled: dict[tuple, tuple[float, float]] = {}
# (platform, inner, link measured) -> bytes/s per rank (inside a node, across nodes or None where the
# link is given), agreed: the two axes of a reduction over nodes of `inner` devices (probes.measure_levels).
_measured_levels: dict[tuple[str, int, bool], tuple[float, float | None]] = {}
_logged: set = set()


def _outside_trace(fn: Callable):
    """Run ``fn`` on a fresh thread: JAX's trace state is per thread, so what ``fn``
    computes runs eagerly even when we are called while a step is being traced."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jax_cgx_calibrate") as pool:
        return pool.submit(fn).result()


def _agree(values: list[float], slowest: Callable) -> list[float]:
    """Every process's ``values`` gathered, and reduced by ``slowest`` (min or max) per entry."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    gathered = np.asarray(multihost_utils.process_allgather(np.asarray(values, np.float32)))
    return [float(slowest(gathered[:, i])) for i in range(len(values))]


def _cached(platform: str, link_gbps: float | None, source: str | None) -> Figures | None:
    """The figures if everything they need is measured already."""
    rates = _measured_rates.get(platform)
    if rates is None:
        return None
    if link_gbps is not None:
        # A given rate comes without a latency: per-message costs are then not priced at all.
        exchange = _measured_link[platform][1] if platform in _measured_link else ExchangeFit()
        return Figures(LinkModel(link_gbps * 1e9 / 8, 0.0), rates, platform, source, _share(platform), exchange)
    if platform not in _measured_link:
        return None
    link, exchange, measured_source = _measured_link[platform]
    return Figures(link, rates, platform, measured_source, _share(platform), exchange)


def _share(platform: str) -> float:
    """Ranks per core: a process's CPU devices run their kernels on its cores (one thread each)."""
    if platform != "cpu":
        return 1.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1.0, jax.local_device_count("cpu") / cores)


_BAD_ENV = -2.0  # a malformed JAX_CGX_LINK_GBPS, as agreed between processes


def _rate_setting(gbps: float) -> str:
    if gbps == _BAD_ENV:
        return "a malformed JAX_CGX_LINK_GBPS"
    return "not given (measured)" if gbps < 0 else f"{gbps:g} Gbit/s"


def _env_link() -> tuple[float | None, ValueError | None]:
    """``JAX_CGX_LINK_GBPS`` and the error a malformed value raises: a process must not raise
    it before the agreement its peers wait in."""
    try:
        return link_gbps_from_env(), None
    except ValueError as err:
        return None, err


def _given_link(config: CompressionConfig | None) -> tuple[float | None, str | None, ValueError | None]:
    """``(Gbit/s, where it was given, the error of a malformed JAX_CGX_LINK_GBPS)``: the config's link
    rate, else the environment's, else ``(None, None, ...)`` (to be measured)."""
    if config is not None and config.link_gbps is not None:
        return config.link_gbps, "CompressionConfig.link_gbps", None
    env, bad_env = _env_link()
    return env, (None if env is None else "JAX_CGX_LINK_GBPS"), bad_env


def _calibrate_platform(platform: str, link_gbps: float | None, source: str | None) -> Figures:
    """Measure what is missing and agree on it with every process; runs on a fresh thread."""
    t0 = time.perf_counter()
    if platform not in _measured_rates:
        r = probes.measure_rates(jax.local_devices(backend=platform)[0])
        # The link rates given travel with the rates: a process given one would skip the link
        # probe that the others run collectively, and their programs would no longer match. The
        # environment's is compared even when this call has its own (or none, as calibrate()):
        # a later call without one falls back to it.
        given = -1.0 if link_gbps is None else link_gbps
        env, bad_env = _env_link()
        env = _BAD_ENV if bad_env else -1.0 if env is None else env
        q, d, a, low, neg_high, env_low, neg_env_high = _agree(
            [r.quantize, r.dequantize, r.add, given, -given, env, -env], np.min)
        if bad_env:  # raised after the agreement, which the other processes wait in
            raise bad_env
        for lo, hi, where in ((low, -neg_high, "the rate each uses here"), (env_low, -neg_env_high, "JAX_CGX_LINK_GBPS")):
            if lo != hi:
                raise ValueError(
                    f"policy='auto': the processes disagree on the link rate ({_rate_setting(lo)} on one, "
                    f"{_rate_setting(hi)} on another; compared: {where}). Set JAX_CGX_LINK_GBPS "
                    "(or CompressionConfig.link_gbps) to the same value on every process, or on none.")
        _measured_rates[platform] = CodecRates(quantize=q, dequantize=d, add=a)
    if link_gbps is None and platform not in _measured_link:
        devices = jax.devices(platform)
        link, fit = probes.measure_link(devices, _measured_rates[platform], _share(platform))
        # The slowest link, the longest latency, the slowest exchange.
        bandwidth, neg_latency, neg_overhead, rate = _agree(
            [link.bandwidth, -link.latency, -fit.overhead, fit.rate], np.min)
        _measured_link[platform] = (LinkModel(bandwidth, -neg_latency), ExchangeFit(-neg_overhead, rate),
                                    f"measured over {len(devices)} devices")
    fig = _cached(platform, link_gbps, source)
    logger.info("jax_cgx: policy='auto' calibrated in %.2f s: %s", time.perf_counter() - t0, fig.describe())
    return fig


_alone = threading.local()


@contextlib.contextmanager
def one_process_alone():
    """While in it, figures that would have to be measured (collectively) raise instead: for
    what one process may call alone (``bytes_on_wire``), where measuring would hang."""
    _alone.on = True
    try:
        yield
    finally:
        _alone.on = False


def figures(config: CompressionConfig | None = None, platform: str | None = None) -> Figures:
    """The figures ``config`` is decided with on ``platform`` (default: JAX's default backend).

    The link rate is ``config.link_gbps``, else ``JAX_CGX_LINK_GBPS``, else measured; the
    codec rates are measured. Measurements run once per process and are collective (every
    process must call this, directly or through a first trace); later calls are free.

    Args:
      config: the config whose ``link_gbps`` is read; None (the default): the environment's
        ``JAX_CGX_LINK_GBPS``, else measured.
      platform: the JAX platform (``"cpu"``, ``"gpu"``, ...); None (the default):
        ``jax.default_backend()``.

    Returns:
      The :class:`~jax_cgx.cost_model.Figures` ``config`` is decided with on ``platform``.

    Raises:
      ValueError: a malformed ``JAX_CGX_LINK_GBPS`` (raised after the processes agree), or link rates
        that differ between the processes.
    """
    platform = platform or jax.default_backend()
    link_gbps, source, bad_env = _given_link(config)
    if bad_env and platform in _measured_rates:  # agreed on already: no peer waits for us
        raise bad_env
    with _lock:
        fig = _cached(platform, link_gbps, source)
        if fig is None and getattr(_alone, "on", False) and jax.process_count() > 1:
            raise RuntimeError(
                "jax_cgx: policy='auto' has not measured this machine yet, and measuring is collective (every "
                "process takes part): one process cannot do it alone. Call jax_cgx.calibrate() on every "
                "process first (or run a step that compresses)")
        if fig is None:
            fig = _outside_trace(lambda: _calibrate_platform(platform, link_gbps, source))
    return fig


def known_figures(config: CompressionConfig | None = None, platform: str | None = None) -> Figures | None:
    """:func:`figures` where everything they need is measured (or given) already, else None: never
    measures (what a report on a policy other than "auto" may price with)."""
    platform = platform or jax.default_backend()
    link_gbps, source, _ = _given_link(config)
    with _lock:
        return _cached(platform, link_gbps, source)


def calibrate(platform: str | None = None) -> Figures:
    """Measure this machine's link and codec now (collective: call it on every process).

    Optional: ``policy="auto"`` measures on first use, which is in the first trace of a
    step. Calling it at start-up keeps that time out of the first step and logs the
    figures. Measures the link even when ``JAX_CGX_LINK_GBPS`` is set; returns the
    measured figures.

    Args:
      platform: the JAX platform to measure (``"cpu"``, ``"gpu"``, ...); None (the default):
        ``jax.default_backend()``.

    Returns:
      The :class:`~jax_cgx.cost_model.Figures` measured on ``platform``: the link's (measured, not
      given) and the codec's. Measured once per process: later calls return the same figures.

    Raises:
      ValueError: a malformed ``JAX_CGX_LINK_GBPS``, or one that differs between the processes
        (raised after they agree, on every process).
    """
    platform = platform or jax.default_backend()
    with _lock:
        fig = _cached(platform, None, None)
        return fig if fig is not None else _outside_trace(lambda: _calibrate_platform(platform, None, None))


def reset() -> None:
    """Forget the measured figures and logged decisions (tests; a changed network)."""
    with _lock:
        _measured_link.clear()
        _measured_rates.clear()
        _measured_levels.clear()
        _settled.clear()
        _logged.clear()


def _time_exchange(devices, values: int, dtype, config: CompressionConfig, backend: str, bodies: Timed | None = None,
                   inner: int | None = None, psum_s: float | None = None, rivals: tuple = ()) -> tuple[float, ...]:
    """:func:`~jax_cgx._src.policy.probes.time_exchange`, the slowest process's."""
    return tuple(_agree(list(probes.time_exchange(devices, values, dtype, config, backend, bodies, inner, psum_s,
                                                  rivals)), np.max))


def two_level(world: int, inner_world: int | None) -> bool:
    """A reduction over nodes of ``inner_world`` ranks: two axes, each with more than one rank."""
    return inner_world is not None and 1 < inner_world < world


def levels(fig: Figures, inner_world: int, measure: bool = True) -> tuple[float, float | None] | None:
    """Bytes/s per rank ``(inside a node, across nodes)`` over nodes of ``inner_world`` devices
    (:func:`~jax_cgx._src.policy.probes.measure_levels`), measured once and agreed (collective);
    None where ``measure=False`` and nothing was measured before. Where the link is given,
    only the inside is measured (across: None, the given link prices it): the user's rate is the
    network's, and the hierarchical form's inside (loopback TCP between CPU processes, about
    1.4 GB/s on our 2-core machine, NVLink on GPUs) is not memory speed."""
    devices = jax.devices(fig.platform)
    if len(devices) % inner_world:
        return None
    key = (fig.platform, inner_world, fig.link_measured)
    with _lock:
        if key not in _measured_levels and measure:
            t0 = time.perf_counter()

            def agreed() -> tuple[float, float | None]:
                measured = probes.measure_levels(devices, inner_world, fig.rates, fig.share, across=fig.link_measured)
                known = _agree([v for v in measured if v is not None], np.min)
                return known[0], (known[1] if len(known) > 1 else None)

            _measured_levels[key] = inside, across = _outside_trace(agreed)
            crossing = (f"{_gbits(across)} per rank across nodes (every rank at once)" if across is not None
                        else f"across nodes the given link ({fig.link_source})")
            logger.info("jax_cgx: policy='auto': nodes of %d devices measured in %.2f s: %s per rank inside a node, "
                        "%s", inner_world, time.perf_counter() - t0, _gbits(inside), crossing)
        return _measured_levels.get(key)


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
    with _lock:
        if key not in _settled and not measure:
            return None
        if key not in _settled and len(_settled) >= _SETTLE_MAX_BUFFERS:
            if "settle-cap" not in _logged:
                _logged.add("settle-cap")
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
            psum_s, *exchange_s = _outside_trace(lambda: _time_exchange(
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
    if log and key not in _logged:
        _logged.add(key)
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

