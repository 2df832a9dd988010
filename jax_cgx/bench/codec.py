"""Codec throughput against a plain copy of the same buffer, measured side by side.

On CPU the copy is ``numpy.copyto`` (the memory bandwidth a kernel can hope for);
on GPU it is a device-to-device copy (an XLA elementwise kernel reading and writing
every byte once). On CPU a time is the best of ``--repeats`` runs after a warm-up. On
GPU it is the median over ``--repeats`` batches of 20 calls dispatched back to back, per
call: the device's time, as in a training step, not the host's dispatch and wait of a
lone call (which at 256 MiB added about 0.1 ms to every figure). A call whose kernels take
less than one dispatch (tens of microseconds: a few MiB) is still timed at the dispatch.

``reduce`` is the owner's fused step of the all-reduce for ``--world`` W ranks: decode
W encodings of one chunk of ``size / W`` values, add the chunk in full precision and
re-quantize the sum. Its GB/s count the buffer's size (the W decoded chunks), so that
the cost model (``python -m jax_cgx.bench model``) charges ``size / reduce_gbps`` for it.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_cgx
from jax_cgx._src.arguments import integer, number
from jax_cgx._src.config.limits import QUANTIZED_BITS
from jax_cgx.bench._table import print_table, save

_CALLS = 20  # calls per timed batch on a GPU


def _best(fn, repeats: int) -> float:
    """Best wall-clock time of ``fn()`` (which must block) over ``repeats`` runs, after a warm-up."""
    fn()  # warm-up and compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _pipelined(fn, repeats: int) -> float:
    """Median per-call time of ``fn()`` (asynchronous) over batches of calls dispatched back to back."""
    jax.block_until_ready(fn())  # warm-up and compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(_CALLS):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / _CALLS)
    return float(np.median(times))


def _time(fn, platform: str, repeats: int) -> float:
    """Seconds per call of the asynchronous ``fn``: :func:`_best` on CPU, :func:`_pipelined` on GPU."""
    if platform == "cpu":
        return _best(lambda: jax.block_until_ready(fn()), repeats)
    return _pipelined(fn, repeats)


def _copy_time(x: jax.Array, repeats: int) -> float:
    platform = x.devices().pop().platform
    if platform == "cpu":
        src = np.asarray(x)
        dst = np.empty_like(src)
        return _best(lambda: np.copyto(dst, src), repeats)
    copy = jax.jit(lambda a: -a)  # one read and one write of every byte
    return _time(lambda: copy(x), platform, repeats)


def _reduce_time(x: jax.Array, config, world: int, impl: str, repeats: int) -> float:
    """Time of the fused dequantize-sum-requantize of ``world`` encodings of ``x.size / world`` values."""
    chunk = x[: x.size // world]
    keys = jax.random.split(jax.random.key(2), world)  # one per rank (used when rounding stochastically)
    stacked = jax.jit(jax.vmap(lambda a, k: jax_cgx.quantize(a, config, key=k, impl=impl)))(
        jnp.stack([jnp.roll(chunk, i) for i in range(world)]), keys)
    fused = jax.jit(lambda q, a, k: jax_cgx.dequantize_sum_requantize(
        q, a, stochastic=config.stochastic, key=k, impl=impl))
    key = jax.random.key(3)
    return _time(lambda: fused(stacked, chunk, key), x.devices().pop().platform, repeats)


def run(args: argparse.Namespace) -> list[dict]:
    device = jax.devices(args.platform)[0] if args.platform else jax.devices()[0]
    dtype = jnp.dtype(args.dtype)
    records = []
    for mib in args.sizes_mib:
        n = int(mib * 2**20) // dtype.itemsize
        x = jax.device_put(jax.random.normal(jax.random.key(0), (n,), jnp.float32).astype(dtype), device)
        t_copy = _copy_time(x, args.repeats)
        for bits in args.bits:
            config = jax_cgx.CompressionConfig(bits=bits, bucket_size=args.bucket_size, stochastic=args.stochastic)
            quantize = jax.jit(lambda a, k, c=config: jax_cgx.quantize(a, c, key=k, impl=args.impl))
            dequantize = jax.jit(lambda q: jax_cgx.dequantize(q, impl=args.impl))
            key = jax.random.key(1)
            q = quantize(x, key)
            t_q = _time(lambda: quantize(x, key), device.platform, args.repeats)
            t_d = _time(lambda: dequantize(q), device.platform, args.repeats)
            t_r = _reduce_time(x, config, args.world, args.impl, args.repeats)
            nbytes = n * dtype.itemsize
            records.append(
                dict(
                    platform=device.platform,
                    dtype=dtype.name,
                    size_mib=mib,
                    bits=bits,
                    bucket_size=args.bucket_size,
                    stochastic=args.stochastic,
                    copy_ms=t_copy * 1e3,
                    quantize_ms=t_q * 1e3,
                    dequantize_ms=t_d * 1e3,
                    reduce_world=args.world,
                    reduce_ms=t_r * 1e3,
                    quantize_gbps=nbytes / t_q / 1e9,
                    dequantize_gbps=nbytes / t_d / 1e9,
                    reduce_gbps=nbytes / t_r / 1e9,
                    copy_gbps=nbytes / t_copy / 1e9,
                    quantize_over_copy=t_q / t_copy,
                    dequantize_over_copy=t_d / t_copy,
                    compression_ratio=q.compression_ratio,
                )
            )
    return records


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes-mib", type=number(0, above=True), nargs="+", default=[1, 16, 64], help="buffer sizes in MiB")
    p.add_argument("--bits", type=int, choices=QUANTIZED_BITS, nargs="+", default=[2, 4, 8], metavar="BITS")
    p.add_argument("--bucket-size", type=integer(1), default=jax_cgx.CompressionConfig.bucket_size)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--stochastic", action="store_true", help="stochastic rounding")
    p.add_argument("--impl", default="kernel", choices=["kernel", "reference", "auto"])
    p.add_argument("--platform", default=None, help="cpu or gpu (default: jax's default device)")
    p.add_argument("--world", type=integer(1), default=4,
                   help="ranks for the fused dequantize-sum-requantize (reduce) column, default 4")
    p.add_argument("--repeats", type=integer(1), default=10)
    p.add_argument("--output", help="also write the results to this .json or .csv file")


def main(args: argparse.Namespace) -> None:
    records = run(args)
    rows = [
        [
            f"{r['size_mib']:g}",
            str(r["bits"]),
            f"{r['copy_ms']:.2f}",
            f"{r['quantize_ms']:.2f}",
            f"{r['dequantize_ms']:.2f}",
            f"{r['quantize_gbps']:.2f}",
            f"{r['dequantize_gbps']:.2f}",
            f"{r['reduce_gbps']:.2f}",
            f"{r['quantize_over_copy']:.2f}",
            f"{r['dequantize_over_copy']:.2f}",
            f"{r['compression_ratio']:.2f}",
        ]
        for r in records
    ]
    title = (
        f"jax_cgx codec on {records[0]['platform']} ({args.dtype}, bucket {args.bucket_size}, "
        f"{'stochastic' if args.stochastic else 'nearest'}, impl={args.impl}, "
        f"{'reused' if jax_cgx.allocator.applied() else 'fresh'} large buffers)"
    )
    columns = ["MiB", "bits", "copy ms", "quant ms", "dequant ms", "quant GB/s", "dequant GB/s",
               f"reduce GB/s (W={args.world})", "quant/copy", "dequant/copy", "ratio"]
    print_table(title, columns, rows)
    if args.output:
        save(records, args.output)
