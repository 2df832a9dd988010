"""``policy="auto"``'s figures: this machine's link and codec, measured once per process,
collectively, and agreed (every process takes the slowest), or the link given
(``link_gbps``/``JAX_CGX_LINK_GBPS``): :func:`figures`, :func:`calibrate`, :func:`levels` (over
nodes). What they decide is :mod:`jax_cgx._src.policy.pricing`'s.
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

from jax_cgx._src.config import CompressionConfig, given_link
from jax_cgx._src.policy import probes
from jax_cgx._src.policy.cost_model import CodecRates, LinkModel
from jax_cgx._src.policy.figures import Figures
from jax_cgx._src.policy.figures import gbits as _gbits
from jax_cgx._src.policy.probes import ExchangeFit

__all__ = ["LOCK", "agree", "calibrate", "figures", "forget", "known_figures", "levels", "one_process_alone",
           "outside_trace"]

logger = logging.getLogger("jax_cgx")


# One lock for the measurements and the decisions priced with them (pricing takes it too).
LOCK = threading.RLock()
# By platform: what the probe measured over all devices (link, exchange, where it was measured).
_measured_link: dict[str, tuple[LinkModel, ExchangeFit, str]] = {}
_measured_rates: dict[str, CodecRates] = {}
# (platform, inner, link measured) -> bytes/s per rank (inside a node, across nodes or None where the
# link is given), agreed: the two axes of a reduction over nodes of `inner` devices (probes.measure_levels).
_measured_levels: dict[tuple[str, int, bool], tuple[float, float | None]] = {}


def outside_trace(fn: Callable):
    """Run ``fn`` on a fresh thread: JAX's trace state is per thread, so what ``fn``
    computes runs eagerly even when we are called while a step is being traced."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jax_cgx_calibrate") as pool:
        return pool.submit(fn).result()


def agree(values: list[float], slowest: Callable) -> list[float]:
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
        env, _, bad_env = given_link(None)  # the environment's alone
        env = _BAD_ENV if bad_env else -1.0 if env is None else env
        q, d, a, low, neg_high, env_low, neg_env_high = agree(
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
        bandwidth, neg_latency, neg_overhead, rate = agree(
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
    link_gbps, source, bad_env = given_link(config)
    if bad_env and platform in _measured_rates:  # agreed on already: no peer waits for us
        raise bad_env
    with LOCK:
        fig = _cached(platform, link_gbps, source)
        if fig is None and getattr(_alone, "on", False) and jax.process_count() > 1:
            raise RuntimeError(
                "jax_cgx: policy='auto' has not measured this machine yet, and measuring is collective (every "
                "process takes part): one process cannot do it alone. Call jax_cgx.calibrate() on every "
                "process first (or run a step that compresses)")
        if fig is None:
            fig = outside_trace(lambda: _calibrate_platform(platform, link_gbps, source))
    return fig


def known_figures(config: CompressionConfig | None = None, platform: str | None = None) -> Figures | None:
    """:func:`figures` where everything they need is measured (or given) already, else None: never
    measures (what a report on a policy other than "auto" may price with)."""
    platform = platform or jax.default_backend()
    link_gbps, source, _ = given_link(config)
    with LOCK:
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
    with LOCK:
        fig = _cached(platform, None, None)
        return fig if fig is not None else outside_trace(lambda: _calibrate_platform(platform, None, None))


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
    with LOCK:
        if key not in _measured_levels and measure:
            t0 = time.perf_counter()

            def agreed() -> tuple[float, float | None]:
                measured = probes.measure_levels(devices, inner_world, fig.rates, fig.share, across=fig.link_measured)
                known = agree([v for v in measured if v is not None], np.min)
                return known[0], (known[1] if len(known) > 1 else None)

            _measured_levels[key] = inside, across = outside_trace(agreed)
            crossing = (f"{_gbits(across)} per rank across nodes (every rank at once)" if across is not None
                        else f"across nodes the given link ({fig.link_source})")
            logger.info("jax_cgx: policy='auto': nodes of %d devices measured in %.2f s: %s per rank inside a node, "
                        "%s", inner_world, time.perf_counter() - t0, _gbits(inside), crossing)
        return _measured_levels.get(key)


def forget() -> None:
    """Forget every measurement (:func:`jax_cgx._src.policy.pricing.reset` forgets the decisions too)."""
    with LOCK:
        _measured_link.clear()
        _measured_rates.clear()
        _measured_levels.clear()
