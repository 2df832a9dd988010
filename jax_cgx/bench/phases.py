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
"""

from __future__ import annotations

import argparse

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
from jax_cgx.bench._table import print_table, save
from jax_cgx.bench.allreduce import median_time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mib", type=float, default=64, help="float32 buffer per process (default: %(default)s)")
    p.add_argument("--bits", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--bucket-size", type=int, default=512, help="(default: %(default)s)")
    p.add_argument("--segments", type=int, default=0,
                   help="messages per collective phase, 0: the xla backend's default (default: %(default)s)")
    p.add_argument("-n", "--repeats", type=int, default=7, help="(default: %(default)s)")
    p.add_argument("--output", help="process 0 writes the phases to this .json or .csv file")
    p.add_argument("--no-progress", action="store_true", help="accepted for benchmarks/netem/run.py; no effect")


def main(args: argparse.Namespace) -> dict:
    jax_cgx.distributed.initialize()
    devices = jax.devices()
    w = len(devices)
    mesh = jax.make_mesh((w,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    sharded = NamedSharding(mesh, P("d"))
    n, bits, bucket = int(args.size_mib * 2**20) // 4, args.bits, args.bucket_size
    c = chunk_length(n, w, bucket, False)
    p, nb, codec_args, k = row_plan(c, bits, bucket, "kernel", args.segments, _wire.message_cap([devices[0].platform]))
    wire_len = p + nb * META_BYTES
    seeds = jnp.zeros((w, 2), jnp.uint32)

    def per_device(f):
        return jax.jit(jax.shard_map(lambda v: f(v[0])[None], mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    def median_ms(fn, x):
        return 1e3 * median_time(fn, x, args.repeats, warmup=2)

    def global_array(length, dtype, fill):
        return jax.make_array_from_callback((w, length), sharded, lambda idx: fill(idx[0].start or 0, length, dtype))

    x = global_array(w * c, np.float32, lambda r, m, t: np.random.default_rng(r).standard_normal((1, m)).astype(t))
    wire = global_array(w * wire_len, np.uint8, lambda r, m, t: np.zeros((1, m), t))
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
    if jax.process_index() == 0:
        print_table(f"compressed_psum phases: {w} x {devices[0].platform}, {args.size_mib:g} MiB float32, "
                    f"{bits} bits, bucket {bucket}, {k} message(s) per collective, median of {args.repeats}",
                    ["phase", "ms"], [[name, f"{ms:.1f}"] for name, ms in result.items()])
        if args.output:
            save([dict(phase=name, ms=ms, devices=w, size_mib=args.size_mib, bits=bits, bucket_size=bucket,
                       messages=k) for name, ms in result.items()], args.output)
    return result
