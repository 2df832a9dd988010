"""Compress a gradient-sized array with jax_cgx's codec and show what it costs and saves
=====================================================================================


    python examples/codec_demo.py [--bits 4] [--bucket-size 128] [--mib 16] [--stochastic]

Prints, for each width, the bytes before and after, the error against the per-bucket bound,
and the time of the compiled kernel next to the pure-JAX reference (same bytes, slower).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_cgx


def timed(fn, *args, repeats=5):
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--bucket-size", type=int, default=jax_cgx.CompressionConfig.bucket_size)
    p.add_argument("--mib", type=float, default=16, help="size of the float32 array")
    p.add_argument("--stochastic", action="store_true")
    args = p.parse_args()

    n = int(args.mib * 2**20) // 4
    grads = jax.random.normal(jax.random.key(0), (n,)) * jnp.linspace(1e-3, 1.0, n)
    key = jax.random.key(1)
    print(f"jax_cgx {jax_cgx.__version__} on {jax.devices()[0].platform}: float32[{n}] ({args.mib:g} MiB), "
          f"bucket {args.bucket_size}, {'stochastic' if args.stochastic else 'nearest'} rounding")
    print(f"{'bits':>4} {'bytes':>12} {'ratio':>6} {'max err/scale':>14} {'rel. L2 err':>12} "
          f"{'kernel ms':>10} {'reference ms':>13} {'same bytes':>10}")
    for bits in args.bits:
        config = jax_cgx.CompressionConfig(bits=bits, bucket_size=args.bucket_size, stochastic=args.stochastic)
        fns = {
            impl: jax.jit(lambda x, k, impl=impl: jax_cgx.quantize(x, config, key=k, impl=impl))
            for impl in ("kernel", "reference")
        }
        q = fns["kernel"](grads, key)
        q_ref = fns["reference"](grads, key)
        same = bool(jnp.array_equal(q.payload, q_ref.payload) and jnp.array_equal(q.meta, q_ref.meta))
        restored = jax_cgx.dequantize(q)
        scale = np.repeat(np.asarray(q.meta[:, 1]), args.bucket_size)[:n]
        err = np.abs(np.asarray(restored) - np.asarray(grads))
        rel = float(jnp.linalg.norm(restored - grads) / jnp.linalg.norm(grads))
        t_kernel, t_ref = timed(fns["kernel"], grads, key), timed(fns["reference"], grads, key)
        print(f"{bits:>4} {q.nbytes:>12,} {q.compression_ratio:>6.2f} {float((err / scale).max()):>14.4f} "
              f"{rel:>12.2e} {t_kernel * 1e3:>10.2f} {t_ref * 1e3:>13.2f} {str(same):>10}")


if __name__ == "__main__":
    main()
