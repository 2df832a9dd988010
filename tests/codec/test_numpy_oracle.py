"""The codec against tests/support/numpy_oracle.py, an oracle written from docs/format.md alone.

jax_cgx.quantize / dequantize / dequantize_sum_requantize (and the row functions with ``valid``
counts), on the kernels and on the pure-JAX reference, equal the oracle bit for bit: payload,
metadata (computed by the oracle from the data: min, scale, flags), decoded values, on varied
data (ranges from 1e-3 to 1e3, constant and zero stretches, NaN, infinities, values beyond 2^125,
subnormals, -0), every width 1..8, buckets 3, 64 and 512, float32/bfloat16/float16, nearest and
stochastic rounding. One compiled program per dtype and implementation runs every width.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import numpy_oracle as oracle
import pytest
from bitwise import assert_same_bits

import jax_cgx
from jax_cgx import CompressionConfig
from jax_cgx._src import codec

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
BUCKETS = (3, 64, 512)
N = 1100  # two whole buckets of 512 and a short one; 366 + 2/3 buckets of 3
W = 3  # encodings summed by dequantize_sum_requantize
KEY = jax.random.key(36)


def configs(d: int):
    """Every width; across the three dtypes every width meets every bucket size and both roundings."""
    return tuple((bits, BUCKETS[(bits + d) % 3], (bits + d) % 2 == 1, bits % 4 == d) for bits in range(1, 9))


def data(dtype, seed: int) -> np.ndarray:
    """``[W + 1, N]``: values of many magnitudes, constant and zero stretches, and the special ones."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((W + 1, N)).astype(np.float32)
    x *= np.float32(10.0) ** rng.integers(-3, 4, size=x.shape).astype(np.float32)
    x[:, 5:25] = 1.5
    x[:, 25:35] = 0.0
    x[0, 40:50] = [np.nan, np.inf, -np.inf, 3e38, -3e38, 1e-40, -0.0, 2.0**126, -2.0**125, 7.0]
    x[1, 530:533] = [np.inf, 1.0, 2.0]  # +inf with finite values
    x[1, 600:603] = [-np.inf, np.inf, -1.0]  # both infinities (1 bit: a NaN bucket)
    x[2, 700:710] = rng.uniform(-3.4e38, 3.4e38, 10)  # a wide bucket
    x[3, 900:903] = [np.inf, np.inf, np.inf]  # only infinities
    x[3, 1000:1100] = rng.uniform(1e4, 6e4, 100)  # float16's top, where sums overflow to inf
    # A last bucket (of 512) of values at the flush threshold: subnormals in [2^-127, 2^-126)
    # become +0, the smallest normals stay (a reference flushing only below 2^-127 survived).
    x[2, 1024:1100] = rng.choice(np.float32([1e-38, -1e-38, 8e-39, 1.5e-38, -2e-38, 2.0**-126]), 76)
    with np.errstate(over="ignore"):
        return np.array(jnp.asarray(x, dtype))


@functools.partial(jax.jit, static_argnames=("configs", "impl"))
def _run_all(x, valid, addend, key, configs, impl):
    """For each config: quantize/dequantize of row 0, quantize_rows of all rows with ``valid`` counts,
    and dequantize_sum_requantize of the W encodings of rows 1..W with ``addend``."""
    out = []
    for bits, bucket, stochastic, skip in configs:
        cfg = CompressionConfig(bits=bits, bucket_size=bucket, stochastic=stochastic, skip_incomplete_buckets=skip, min_size=16)
        q = jax_cgx.quantize(x[0], cfg, key=key, impl=impl)
        decoded = jax_cgx.dequantize(q, impl=impl)
        seeds = jax.random.bits(key, (x.shape[0], 2), jnp.uint32)
        rows = codec.quantize_rows(x, seeds, bits=bits, bucket_size=bucket, stochastic=stochastic, m=N, impl=impl,
                                   valid=valid)
        stacked = jax.vmap(lambda v: jax_cgx.quantize(v, cfg, key=key, impl=impl))(x[1:])  # noqa: B023
        summed, summed_out = jax_cgx.dequantize_sum_requantize(stacked, addend, stochastic=stochastic, key=key,
                                                               impl=impl)
        out.append(dict(q=q, decoded=decoded, rows=rows, seeds=seeds, stacked=stacked, summed=summed,
                        summed_out=summed_out))
    return out


def _check(name, got, want):
    assert_same_bits(np.asarray(got), np.asarray(want), name)


# The kernels on every dtype and width; the pure-JAX reference (which compiles ~30x slower, and which
# tests/codec/test_codec.py compares with the kernels everywhere) on one config (4 bits, B=512, stochastic).
CASES = [(dtype, "kernel", None) for dtype in DTYPES] + [("bf16", "reference", (3,))]


@pytest.mark.parametrize("dtype, impl, subset", CASES, ids=[f"{d}-{i}" for d, i, _ in CASES])
def test_codec_equals_the_numpy_oracle(dtype, impl, subset):
    d = list(DTYPES).index(dtype)
    cases = configs(d) if subset is None else tuple(configs(d)[k] for k in subset)
    x = data(DTYPES[dtype], seed=d)
    addend = data(DTYPES[dtype], seed=10 + d)[0]
    valid = np.array([N, 1, 513, 0], np.int32)
    got = _run_all(jnp.asarray(x), jnp.asarray(valid), jnp.asarray(addend), KEY, cases, impl)
    words = oracle.seed_words(KEY)
    for (bits, bucket, stochastic, skip), g in zip(cases, got):
        what = f"{dtype} {impl} bits={bits} B={bucket} {'stochastic' if stochastic else 'nearest'}"
        args = dict(bits=bits, bucket_size=bucket)
        seeds = words if stochastic else (0, 0)
        want = oracle.quantize(x[0], stochastic=stochastic, seeds=seeds, skip_incomplete_buckets=skip, **args)
        _check(f"{what}: meta", g["q"].meta, want["meta"])
        _check(f"{what}: payload", g["q"].payload, want["payload"])
        _check(f"{what}: tail", g["q"].tail, want["tail"])
        _check(f"{what}: dequantize", g["decoded"], oracle.dequantize(want, x[0].shape, x.dtype, **args))

        # Rows with valid counts: the padding after them takes no part in any bucket's range.
        row_seeds = np.asarray(g["seeds"]) if stochastic else np.zeros((W + 1, 2), np.uint32)
        payload, meta = oracle.quantize_rows(x, row_seeds, stochastic=stochastic, valid=valid, **args)
        _check(f"{what}: quantize_rows(valid) meta", g["rows"][1], meta)
        _check(f"{what}: quantize_rows(valid) payload", g["rows"][0], payload)

        # The fused sum: W encodings plus an addend, summed in float32, re-quantized with the key's seeds.
        encs = [oracle.quantize(v, stochastic=stochastic, seeds=seeds, skip_incomplete_buckets=skip, **args)
                for v in x[1:]]
        for i, e in enumerate(encs):
            _check(f"{what}: stacked meta {i}", g["stacked"].meta[i], e["meta"])
        m = N - encs[0]["tail"].size
        p, mt, out = oracle.dequantize_sum_requantize_rows(
            np.stack([e["payload"] for e in encs])[None], np.stack([e["meta"] for e in encs])[None], addend[None, :m],
            np.asarray(seeds, np.uint32)[None], stochastic=stochastic, m=m, dtype=x.dtype, **args)
        tail = oracle.to_dtype(oracle.sum_tails(np.stack([e["tail"] for e in encs]), addend[m:]), x.dtype)
        _check(f"{what}: summed meta", g["summed"].meta, mt[0])
        _check(f"{what}: summed payload", g["summed"].payload, p[0])
        _check(f"{what}: summed tail", g["summed"].tail, tail)
        _check(f"{what}: summed decoded", g["summed_out"], np.concatenate([out[0], tail]))


def test_oracle_metadata_cases():
    """The table of docs/format.md, "Metadata", entry by entry (4 bits: L = 15)."""
    def meta(values, real=None, bits=4):
        v = oracle.flush(np.asarray(values, np.float32))[None]
        real = np.ones(v.shape, bool) if real is None else np.asarray(real)[None]
        mn, field = oracle.make_meta(v, real, bits)
        return float(mn[0]), int(field[0])

    nan = int(oracle.CANONICAL_NAN)
    assert np.isnan(meta([1.0, np.nan])[0]) and meta([1.0, np.nan])[1] == nan
    assert meta([1.0, 2.0], real=[False, False]) == (0.0, 0)  # no value at all
    assert meta([np.inf, -np.inf]) == (0.0, 3)  # only infinities: flags
    assert meta([5.0, 5.0, np.inf]) == (5.0, 1)  # degenerate, with a flag
    assert meta([-np.inf, 1.0, 2.0], bits=1)[1] == nan  # span 0 and mx > mn
    mn, field = meta([0.0, 3.0e38])  # wide: scaled by 2^-4, flag 4
    scale = float(np.uint32(field & ~0xFF).view(np.float32))
    assert mn == 0.0 and field & 0xFF == 4
    assert 0 <= scale * 15 * 16 - 3.0e38 <= 3.0e38 * 2.0**-15
