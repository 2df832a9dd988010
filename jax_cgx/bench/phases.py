"""Where the time of one compressed all-reduce goes: each phase of SRA timed as its own program.

    python -m jax_cgx.launch -n 2 benchmarks/allreduce_phases.py --size-mib 64 --bits 4
    python benchmarks/netem/run.py -p 2 --rate 1gbit --script benchmarks/allreduce_phases.py -- --size-mib 64 --bits 4

(``benchmarks/allreduce_phases.py`` is ``python -m jax_cgx.bench phases`` as a script.)

Every process (one device each) times, on buffers shaped as the all-reduce of ``--size-mib``
of float32 at ``--bits`` shapes them: the whole ``compressed_psum`` and ``psum``; quantizing
the W chunks; the ``all_to_all`` and the ``all_gather`` of the packed chunks (cut into
``--segments`` messages, 0 = as the xla backend cuts them by default); the fused
dequantize-sum-requantize; decoding the W gathered chunks; and ``x * 2`` of the buffer (one
read and one write: the memory's pace). Medians of ``--repeats`` blocking calls. The gap
between the whole and the sum of the phases is what the program spends around them (copies,
slices, allocation). docs/results.md uses it to explain the all-reduce's time.

``--two-level`` (nodes of ``JAX_CGX_LOCAL_COUNT`` processes, ``benchmarks/netem/run.py --nodes N
--per-node M``, or of ``--per-node`` devices) times the hierarchical form's parts instead, on the ``("node", "local")`` mesh, every
node at once as in the all-reduce: the exact reduce-scatter inside each node (ppermutes and a
local sum on CPUs of several processes), the compressed all-reduce of its shard across the nodes,
the all-gather inside; beside them the whole hierarchical and flat ``compressed_psum``, ``psum``,
and the psum inside each node that ``policy="auto"`` measures the inside with. docs/multinode.md
uses it to check the cost model's hierarchical terms.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx._src import codec
from jax_cgx._src.codec.quantized import META_BYTES
from jax_cgx._src.exchange import wire as _wire
from jax_cgx._src.exchange.chunks import chunk_length, row_plan
from jax_cgx._src.exchange.hierarchical import hierarchical_shard, reduce_scatter_exact
from jax_cgx.bench._table import print_table, save
from jax_cgx.bench.allreduce import median_time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mib", type=float, default=64, help="float32 buffer per process (default: %(default)s)")
    p.add_argument("--bits", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--bucket-size", type=int, default=jax_cgx.CompressionConfig.bucket_size, help="(default: %(default)s)")
    p.add_argument("--segments", type=int, default=0,
                   help="messages per collective phase, 0: the xla backend's default (default: %(default)s)")
    p.add_argument("-n", "--repeats", type=int, default=7, help="(default: %(default)s)")
    p.add_argument("--two-level", action="store_true",
                   help="the hierarchical form's parts on a (node, local) mesh of nodes of JAX_CGX_LOCAL_COUNT processes")
    p.add_argument("--per-node", type=int, default=0,
                   help="with --two-level: devices per node (default: JAX_CGX_LOCAL_COUNT x this process's devices)")
    p.add_argument("--output", help="process 0 writes the phases to this .json or .csv file")
    p.add_argument("--no-progress", action="store_true", help="accepted for benchmarks/netem/run.py; no effect")


def main(args: argparse.Namespace) -> dict:
    jax_cgx.distributed.initialize()
    if getattr(args, "two_level", False):
        return _two_level(args)
    devices = jax.devices()
    w = len(devices)
    mesh = jax.make_mesh((w,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    sharded = NamedSharding(mesh, P("d"))
    n, bits, bucket = int(args.size_mib * 2**20) // 4, args.bits, args.bucket_size
    c = chunk_length(n, w, bucket, False)
    p, nb, codec_args, k = row_plan(c, bits, bucket, "kernel", args.segments, _wire.message_cap([devices[0].platform]))
    wire_len = p + nb * META_BYTES
    seeds = jnp.zeros((w, 2), jnp.uint32)

    per_device = functools.partial(_per_device, mesh, P("d"))
    median_ms = functools.partial(_median_ms, repeats=args.repeats)
    x = _global_array(sharded, w * c, np.float32, _normal)
    wire = _global_array(sharded, w * wire_len, np.uint8, lambda r, m, t: np.zeros((1, m), t))
    config = jax_cgx.CompressionConfig(bits=bits, bucket_size=bucket, fusion_buffer_mb=1024, min_size=0,
                                       pipeline_segments=args.segments)

    def fused(v):
        payload = jnp.zeros((1, w, p), jnp.uint8) + v[0].astype(jnp.uint8)
        meta = jnp.ones((1, w, nb, 2), jnp.float32)
        return codec.dequantize_sum_requantize_rows(payload, meta, v[:c][None], seeds[:1], stochastic=False,
                                                    dtype=jnp.float32, **codec_args)[0].reshape(-1)

    def decode(v):
        payload = jnp.zeros((w, p), jnp.uint8) + v[0].astype(jnp.uint8)
        meta = jnp.ones((w, nb, 2), jnp.float32)
        return codec.dequantize_rows(payload, meta, dtype=jnp.float32, **codec_args).reshape(-1)

    phases = {
        "quantize": (per_device(lambda v: codec.quantize_rows(v.reshape(w, c), seeds, stochastic=False,
                                                              **codec_args)[0].reshape(-1)), x),
        "all_to_all": (per_device(lambda b: _wire.all_to_all(b.reshape(1, w, wire_len), "d", k).reshape(-1)), wire),
        "dequantize_sum_requantize": (per_device(fused), x),
        "all_gather": (per_device(lambda b: _wire.all_gather(b[None, :wire_len], "d", k).reshape(-1)), wire),
        "decode": (per_device(decode), x),
    }
    result = {name: median_ms(fn, arg) for name, (fn, arg) in phases.items()}
    result["sum of phases"] = sum(result.values())
    result["compressed_psum"] = median_ms(per_device(lambda v: jax_cgx.compressed_psum(v, "d", config)), x)
    result["psum"] = median_ms(per_device(lambda v: lax.psum(v, "d")), x)
    result["x * 2"] = median_ms(per_device(lambda v: v * 2), x)
    _report(result, f"compressed_psum phases: {w} x {devices[0].platform}, {args.size_mib:g} MiB float32, "
                    f"{bits} bits, bucket {bucket}, {k} message(s) per collective, median of {args.repeats}",
            args, dict(devices=w, size_mib=args.size_mib, bits=bits, bucket_size=bucket, messages=k))
    return result


def _per_device(mesh, spec, f):
    """``f`` on each device's row of arrays laid out by ``spec`` over ``mesh``, jitted."""
    return jax.jit(jax.shard_map(lambda v: f(v[0])[None], mesh=mesh, in_specs=spec, out_specs=spec))


def _median_ms(fn, x, repeats: int) -> float:
    return 1e3 * median_time(fn, x, repeats, warmup=2)


def _global_array(sharding, length: int, dtype, fill):
    """One row of ``length`` per device, row ``r`` from ``fill(r, length, dtype)``."""
    rows = sharding.mesh.devices.size
    return jax.make_array_from_callback((rows, length), sharding, lambda idx: fill(idx[0].start or 0, length, dtype))


def _normal(row: int, length: int, dtype):
    return np.random.default_rng(row).standard_normal((1, length)).astype(dtype)


def _report(result: dict, title: str, args: argparse.Namespace, fields: dict) -> None:
    if jax.process_index() == 0:
        print_table(title, ["phase", "ms"], [[name, f"{ms:.1f}"] for name, ms in result.items()])
        if args.output:
            save([dict(phase=name, ms=ms, **fields) for name, ms in result.items()], args.output)


def _two_level(args: argparse.Namespace) -> dict:
    """The hierarchical form's parts, each timed alone over every node at once."""
    devices = jax.devices()
    w = len(devices)
    m = args.per_node or jax_cgx.distributed.detect().local_count * jax.local_device_count()
    if m < 2 or w % m or w == m:
        raise SystemExit(f"--two-level: {w} devices are not several nodes of several devices (nodes of {m}); "
                         "run under benchmarks/netem/run.py --nodes N --per-node M")
    nodes, axes = w // m, ("node", "local")
    mesh = jax.make_mesh((nodes, m), axes, axis_types=(jax.sharding.AxisType.Explicit,) * 2, devices=devices)
    spec = P(axes)
    n = int(args.size_mib * 2**20) // 4
    config = jax_cgx.CompressionConfig(bits=args.bits, bucket_size=args.bucket_size, fusion_buffer_mb=1024,
                                       min_size=0, pipeline_segments=args.segments)
    shard_n = hierarchical_shard(n, m, config)
    per_device = functools.partial(_per_device, mesh, spec)
    median_ms = functools.partial(_median_ms, repeats=args.repeats)
    sharding = NamedSharding(mesh, spec)
    x = _global_array(sharding, shard_n * m, np.float32, _normal)
    shard = _global_array(sharding, shard_n, np.float32, _normal)
    hierarchical = config.replace(hierarchical=True)
    phases = {
        "inside: reduce-scatter": (per_device(lambda v: reduce_scatter_exact(v, "local", m)), x),
        "across: compressed_psum of the shard": (per_device(lambda v: jax_cgx.compressed_psum(v, "node", config)),
                                                  shard),
        "inside: all_gather": (per_device(lambda v: lax.all_gather(v, "local", axis=0, tiled=True)), shard),
    }
    result = {name: median_ms(fn, arg) for name, (fn, arg) in phases.items()}
    result["sum of phases"] = sum(result.values())
    for name, f, arg in [("hierarchical compressed_psum", lambda v: jax_cgx.compressed_psum(v, axes, hierarchical), x),
                         ("flat compressed_psum", lambda v: jax_cgx.compressed_psum(v, axes, config), x),
                         ("psum", lambda v: lax.psum(v, axes), x),
                         ("inside: psum (policy='auto' probes it)", lambda v: lax.psum(v, "local"), x),
                         ("across: psum of the shard", lambda v: lax.psum(v, "node"), shard)]:
        result[name] = median_ms(per_device(f), arg)
    # What each rank sends inside its node per second with every node at once, as policy="auto"
    # measures the inside and the cost model takes it (bench model --inner-gbps); the psum's adds
    # stay in, as the hierarchical form's reduce-scatter does them too.
    inside_gbs = 2 * (m - 1) / m * x.shape[1] * 4 / result["inside: psum (policy='auto' probes it)"] / 1e6
    if jax.process_index() == 0:
        print(f"inside a node, every node at once: {inside_gbs:.3g} GB/s sent per rank (bench model --inner-gbps)")
    _report(result, f"hierarchical compressed_psum phases: {nodes} nodes x {m} {devices[0].platform}, "
                    f"{args.size_mib:g} MiB float32, {args.bits} bits, bucket {args.bucket_size}, "
                    f"median of {args.repeats}",
            args, dict(nodes=nodes, per_node=m, size_mib=args.size_mib, bits=args.bits,
                       bucket_size=args.bucket_size, segments=args.segments, inside_gbs=inside_gbs))
    return result
