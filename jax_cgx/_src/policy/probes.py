"""Timing this machine for ``policy="auto"`` (:mod:`jax_cgx._src.policy.pricing`).

Three probes: the codec's rates on one device (:func:`measure_rates`), the link and the
compressed exchange's compute over all devices (:func:`measure_link`), and one buffer's
uncompressed and compressed collectives side by side (:func:`time_exchange`, for near-ties).
Each process times its own devices and nothing else; agreeing on the figures across
processes, and caching them, is the policy's part.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_cgx._src import backends, codec
from jax_cgx._src.config import CompressionConfig
from jax_cgx._src.exchange import wire as _wire
from jax_cgx._src.exchange.all_reduce import (  # the primitive: the pytree API would decide again
    compressed_sum,
    reduction,
)
from jax_cgx._src.exchange.hierarchical import reduce_hierarchical
from jax_cgx._src.policy.cost_model import CodecRates, LinkModel, predict

__all__ = ["ExchangeFit", "Timed", "measure_rates", "measure_link", "measure_levels", "time_exchange"]

# The probe's sizes per device: fixed costs dominate the first; the slope between the other two
# gives the rates (measured: a 4 MiB probe put the loopback at 4.5 Gbit/s, where 64 MiB psums ran at 6.7).
_PROBE_BYTES = (64 * 1024, 2**20, 16 * 2**20)
# The codec probe's buffer: large enough to stream from memory, small enough to be quick.
_CODEC_PROBE_VALUES = 2**20
# On a GPU one call on 4 MiB is ~10 us of the device's time but ~0.1 ms of dispatch and wait,
# and whole milliseconds where another process holds the GPU: there the codec is timed on
# 64 MiB, in batches of calls dispatched back to back, as a step runs them. (Measured on an
# H100, 2026-11-27, single calls on 4 MiB: a copy at 1.8 GB/s where it runs at 1.5 TB/s,
# which priced a 64 MiB buffer's fusion copies at 75 ms and kept it uncompressed.)
_GPU_CODEC_PROBE_VALUES = 2**24
_GPU_CODEC_BATCH = 10
_REPEATS = 5
_AXIS = "jax_cgx_link_probe"
# A two-level probe mesh's axes: nodes, and the devices of one node.
_LEVELS = ("jax_cgx_probe_node", "jax_cgx_probe_local")
# Runs of each when timing a buffer: a near-tie needs more than the probe's five.
_SETTLE_REPEATS = 9


@dataclasses.dataclass(frozen=True)
class ExchangeFit:
    """The compressed exchange's own cost besides the wire, measured in place over the real
    devices: ``overhead + F / rate`` seconds for ``F`` bytes of float32 per rank.

    It catches what the codec rates alone miss: XLA's per-collective cost, and on one
    process's virtual CPU devices the threads' rendezvous (measured there: 14 ms for 4 MiB
    per device where the codec rates predict 5 ms). Decisions take the larger of the two.

    Attributes:
      overhead: the fixed cost, in seconds (0.0 where not measured).
      rate: bytes of float32 per rank per second (``inf`` where not measured).
    """

    overhead: float = 0.0
    rate: float = math.inf

    def seconds(self, float32_bytes: float) -> float:
        return self.overhead + float32_bytes / self.rate


# What a near-tie times per device: ``(lax_fn(x, axis), compressed_fn(x, axis, config))``; the
# all-reduce's is built in, the sharded collectives' modules pass theirs.
Timed = tuple[Callable, Callable]


def _times(*fns: Callable[[], object], repeats: int = _REPEATS, summary: Callable = statistics.median
           ) -> list[float]:
    """Each function's seconds (the ``summary`` of its runs, the median by default), their runs
    interleaved so that all see the same machine (a neighbour's burst of work slows them alike)."""
    for fn in fns:
        jax.block_until_ready(fn())  # compile and warm up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            t.append(time.perf_counter() - t0)
    return [summary(t) for t in times]


def _median_time(fn: Callable[[], object]) -> float:
    return _times(fn)[0]


def _batched(fn: Callable[[], object], calls: int) -> Callable[[], object]:
    """``fn`` called ``calls`` times back to back (one stream runs them in order: the last
    result ready means all are)."""
    def run():
        for _ in range(calls - 1):
            fn()
        return fn()
    return run


def measure_rates(device) -> CodecRates:
    """Bytes of float32 per second this device quantizes (4 bits), dequantizes and copies: what it
    can do, the fastest of interleaved runs. With several processes on shared cores a median
    caught whatever a peer did meanwhile (one process timed while the others still compiled, on
    a 2-core machine with 4 processes: copies at 1.5 GB/s instead of 12, which priced a 64 MiB
    buffer's fusion copies at 88 ms and kept it uncompressed, 2x slower); all processes timing at
    once after a barrier measured their contention instead (copies at 1.3-8 GB/s)."""
    config = CompressionConfig(bits=4)
    on_cpu = device.platform == "cpu"
    values, calls = (_CODEC_PROBE_VALUES, 1) if on_cpu else (_GPU_CODEC_PROBE_VALUES, _GPU_CODEC_BATCH)
    x = jax.device_put(jax.random.normal(jax.random.key(0), (values,), jnp.float32), device)
    quantize = jax.jit(lambda a: codec.quantize(a, config))
    dequantize = jax.jit(codec.dequantize)
    copy = jax.jit(lambda a: -a)  # one read and one write of every byte
    q = quantize(x)
    nbytes = x.size * 4 * calls
    quantize_s, dequantize_s, copy_s = _times(
        _batched(lambda: quantize(x), calls), _batched(lambda: dequantize(q), calls), _batched(lambda: copy(x), calls),
        summary=min)
    return CodecRates(quantize=nbytes / quantize_s, dequantize=nbytes / dequantize_s, add=nbytes / copy_s)


def _mesh(devices) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(devices), (_AXIS,))


def _two_level_mesh(devices, inner: int) -> jax.sharding.Mesh:
    """``devices`` as nodes of ``inner`` consecutive devices: how ``jax.make_mesh((nodes, inner),
    ...)`` lays out ``jax.devices()`` (process by process)."""
    return jax.sharding.Mesh(np.array(devices).reshape(-1, inner), _LEVELS)


def _over(mesh, body, values: int, dtype) -> Callable[[], jax.Array]:
    """``body`` (a per-device function) compiled over ``mesh``, ready to run on ``values`` values per device."""
    spec = jax.sharding.PartitionSpec(tuple(mesh.axis_names))
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    make = jax.jit(lambda: jnp.ones((mesh.size * values,), dtype) * 0.5,
                   out_shardings=jax.sharding.NamedSharding(mesh, spec))
    x = make()
    return lambda: fn(x)


def _time_over(mesh, body, values: int, dtype) -> float:
    """Median seconds of ``body`` (a per-device function) over ``values`` values per device."""
    return _median_time(_over(mesh, body, values, dtype))


def _psum_bandwidth(slope: float, ranks: int, rates: CodecRates, share: float) -> float:
    """Bytes/s each rank sends, from a ring psum's seconds per byte over ``ranks``: its
    ``2 (W-1)/W`` bytes sent per byte, the slope the adds (``share (W-1)/W S/add``) do not explain."""
    wire_slope = slope - share * (ranks - 1) / ranks / rates.add
    return 2 * (ranks - 1) / ranks / wire_slope if wire_slope > 0 else float("inf")


def measure_link(devices, rates: CodecRates, share: float) -> tuple[LinkModel, ExchangeFit]:
    """The link's rate and latency, and the compressed exchange's compute, over ``devices``.

    Times a ``psum`` and a 4-bit compressed sum at three sizes. The psums fit the cost model's
    ``t(S) = 2(W-1)/W S/B + share (W-1)/W S/add + 2(W-1) latency``; what the compressed sums
    take beyond their predicted wire time fits :class:`ExchangeFit`. Rates come from the
    slope between the two larger sizes, fixed costs from the smallest.
    """
    w = len(devices)
    if w < 2:
        return LinkModel(float("inf"), 0.0), ExchangeFit()
    mesh = _mesh(devices)
    config = CompressionConfig(bits=4)

    def timed(body, nbytes: int) -> float:
        return _time_over(mesh, body, nbytes // 4, np.float32)

    sizes = _PROBE_BYTES
    psum = [timed(lambda v: jax.lax.psum(v, _AXIS), n) for n in sizes]
    slope = (psum[2] - psum[1]) / (sizes[2] - sizes[1])
    link = LinkModel(_psum_bandwidth(slope, w, rates, share), max(0.0, psum[0] - slope * sizes[0]) / (2 * (w - 1)))

    compute = []
    for n in sizes:
        t = timed(lambda v: compressed_sum(v, (_AXIS,), w, config, None, "auto", backend="xla"), n)
        wire = predict(n, w, config.bits, config.bucket_size, link, rates,
                       message_cap=_wire.message_cap([devices[0].platform]), algorithm=config.algorithm)["wire"]
        compute.append(max(0.0, t - wire))
    per_byte = (compute[2] - compute[1]) / (sizes[2] - sizes[1])
    fit = ExchangeFit(max(0.0, compute[0] - per_byte * sizes[0]), 1 / per_byte if per_byte > 0 else math.inf)
    return link, fit


def measure_levels(devices, inner: int, rates: CodecRates, share: float,
                   across: bool = True) -> tuple[float, float | None]:
    """Bytes/s per rank ``(inside a node, across nodes)`` for ``devices`` as nodes of ``inner``
    consecutive devices (:func:`_two_level_mesh`); ``across=False``: the inside only (None across).

    Times psums over each axis of the two-level mesh, every group at once (all nodes reduce
    inside at once; every rank of a node crosses at once, sharing what the node has), at the
    probe's two larger sizes, and fits their slopes as :func:`measure_link` does.
    """
    mesh = _two_level_mesh(devices, inner)

    def rate(axis: str, m: int) -> float:
        if m < 2:
            return float("inf")
        t = [_time_over(mesh, lambda v: jax.lax.psum(v, axis), n // 4, np.float32) for n in _PROBE_BYTES[1:]]
        return _psum_bandwidth((t[1] - t[0]) / (_PROBE_BYTES[2] - _PROBE_BYTES[1]), m, rates, share)

    return rate(_LEVELS[1], inner), rate(_LEVELS[0], len(devices) // inner) if across else None


def time_exchange(devices, values: int, dtype, config: CompressionConfig, backend: str,
                  bodies: Timed | None = None, inner: int | None = None, psum_s: float | None = None,
                  rivals: tuple[CompressionConfig, ...] = ()) -> tuple[float, ...]:
    """Median seconds of the uncompressed collective (``bodies``; default psum) and the compressed
    one on ``values`` values per device over ``devices``, on ``backend``, on this process. A
    backend that owns connections connects a mesh of the probe's own for it. ``inner``: over
    both axes of the two-level mesh of nodes of ``inner`` devices (a hierarchical config needs it).
    ``psum_s``: the uncompressed collective's time, known already (another form of the same
    buffer timed it): only the compressed one is timed. ``rivals``: other forms of the same
    buffer, timed in the same interleaved runs (a choice between forms must not hinge on what
    the machine did between two probes); their seconds follow in the result, in order."""
    configs = [c.replace(policy="always", backend=backend) for c in (config, *rivals)]
    world = len(devices)
    if inner is not None:
        mesh = _two_level_mesh(devices, inner)

        def over_nodes(v, axes, c):  # flat over both axes, or exact inside the node and compressed across
            chosen = backends.choose_in_trace(c.backend, reduction(axes[:-1] if c.hierarchical else axes,
                                                                   world // inner if c.hierarchical else world, c))
            if c.hierarchical:
                return reduce_hierarchical(v, axes, world, c, None, "auto", backend=chosen)
            return compressed_sum(v, axes, world, c, None, "auto", backend=chosen)

        lax_fn, compressed_fn = bodies or (jax.lax.psum, over_nodes)
        axis = _LEVELS
    else:
        mesh = _mesh(devices)
        axis = _AXIS
        lax_fn, compressed_fn = bodies or (
            jax.lax.psum,
            lambda v, axis, c: compressed_sum(v, (axis,), world, c, None, "auto", backend=backends.choose_in_trace(
                c.backend, reduction((axis,), world, c))))
    owner = backends.get(backend)
    if owner.families is not None:
        owner.setup(mesh)
    try:
        compressed = [_over(mesh, lambda v, c=c: compressed_fn(v, axis, c), values, dtype) for c in configs]
        if psum_s is not None:
            return psum_s, *_times(*compressed, repeats=_SETTLE_REPEATS)
        return tuple(_times(_over(mesh, lambda v: lax_fn(v, axis), values, dtype), *compressed,
                            repeats=_SETTLE_REPEATS))
    finally:
        if owner.families is not None:
            owner.teardown(mesh)
