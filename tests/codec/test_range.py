"""The codec over float32's whole range: infinities, and finite values up to the largest float.

The expected outcome of every bucket is derived from the data alone (docs/format.md,
"Metadata"), never from the metadata under test: a bucket holding a NaN decodes to NaN; an
infinity decodes to itself; finite values decode finite, within half a step (nearest) or a step
(stochastic) of the range their bucket spans, where the levels left to finite values are
``2^bits - 1`` minus one per sign of infinity present. A bucket whose infinities leave no level
for distinct finite values (1-bit buckets) decodes to NaN, loudly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_same_bits
from codec_cases import BITS, EPS, decodes_to_nan, roundtrip_all, step_bound, sum_requantize

from jax_cgx import CompressionConfig

KEY = jax.random.key(3)
B = 64
F32_MAX = float(np.finfo(np.float32).max)


def buckets(dtype) -> np.ndarray:
    """Buckets of B values that each exercise one corner of the range."""
    big = F32_MAX if dtype != np.float16 else 65504.0
    rng = np.random.default_rng(0)
    normal = lambda: rng.standard_normal(B)  # noqa: E731
    rows = [
        rng.uniform(-1.0, 1.0, B) * 0.9 * big,  # wide: values beyond 2^125 (float16: its own largest)
        np.r_[normal()[:-1], np.inf],
        np.r_[-np.inf, normal()[1:]],
        np.r_[np.inf, normal()[2:], -np.inf],
        np.where(rng.random(B) < 0.5, np.inf, -np.inf),  # nothing finite
        np.r_[rng.uniform(-1.0, 1.0, B - 1) * 0.9 * big, np.inf],  # wide and an infinity
        np.r_[big, -big, rng.uniform(-1.0, 1.0, B - 2) * big],  # the clamp at the largest float
        np.r_[np.full(B - 1, 5.0), np.inf],  # degenerate finite part: representable at 1 bit
        np.r_[rng.uniform(0.0, 1.0, B - 1) * big, -np.inf],
        np.r_[np.nan, normal()[1:-1], np.inf],  # a NaN wins
    ]
    return np.asarray(jnp.asarray(np.concatenate(rows).astype(np.float32), dtype))


def check_bucket(x, y, bits, stochastic, what):
    x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if decodes_to_nan(x64, bits):
        assert np.all(np.isnan(y64)), f"{what}: must decode to NaN"
        return
    inf = np.isinf(x64)
    np.testing.assert_array_equal(y64[inf], x64[inf], err_msg=f"{what}: infinities decode to themselves")
    finite = x64[~inf]
    if not finite.size:
        return
    assert np.all(np.isfinite(y64[~inf])), f"{what}: finite values must decode finite"
    span = (1 << bits) - 1 - int(np.any(x64 == np.inf)) - int(np.any(x64 == -np.inf))
    step = step_bound(finite.max() - finite.min(), bits, span) if span > 0 else 0.0
    factor = 1.0 if stochastic else 0.5
    rounding = EPS[np.dtype(y.dtype)] * np.maximum(np.abs(finite), np.abs(y64[~inf]))
    err = np.abs(y64[~inf] - finite)
    bound = step * (factor + 1e-4) + rounding
    assert np.all(err <= bound), f"{what}: error {err.max():.4g} above bound {bound[np.argmax(err - bound)]:.4g}"


def run_both(x, configs):
    """Kernel and reference, bitwise equal; the kernel's results."""
    configs = tuple(configs)
    kernel = roundtrip_all(x, KEY, configs, "kernel")
    reference = roundtrip_all(x, KEY, configs, "reference")
    for config, (q_k, y_k), (q_r, y_r) in zip(configs, kernel, reference):
        assert_same_bits(q_k.payload, q_r.payload, f"payload {config}")
        assert_same_bits(q_k.meta, q_r.meta, f"meta {config}")
        assert_same_bits(y_k, y_r, f"decoded {config}")
    return kernel


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16], ids=lambda d: np.dtype(d).name)
def test_whole_range_every_width(dtype, stochastic):
    x = buckets(dtype)
    # Every width in float32; in the 16-bit types, the widths where the levels run short (1, 2)
    # and two common ones (the conversions are the same for all).
    widths = BITS if dtype == np.float32 else (1, 2, 4, 8)
    configs = [CompressionConfig(bits=b, bucket_size=B, stochastic=stochastic, min_size=16) for b in widths]
    for bits, (_, y) in zip(widths, run_both(x, configs)):
        y = np.asarray(y)
        for k in range(x.size // B):
            part = slice(k * B, (k + 1) * B)
            check_bucket(x[part], y[part], bits, stochastic, f"bits={bits} bucket {k}")


def test_normal_buckets_keep_their_bytes():
    """Buckets of finite values within 2^125 carry no flags: the scale field is the scale."""
    x = np.random.default_rng(1).standard_normal(4 * B).astype(np.float32) * 1e30
    for q, _ in run_both(x, [CompressionConfig(bits=b, bucket_size=B, min_size=16) for b in BITS]):
        assert np.all(np.asarray(q.meta[:, 1]).view(np.uint32) & 0xFF == 0)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_overflowing_sum_is_infinite(stochastic):
    """The fused sum-and-requantize: a sum past float32's range is inf of its sign, as psum's is."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal(4 * B).astype(np.float32)
    x[3], x[70], x[140] = 3e38, -3e38, 1e38
    config = CompressionConfig(bits=4, bucket_size=B, stochastic=stochastic, min_size=16)
    results = []
    for impl in ("kernel", "reference"):
        ((q, _),) = roundtrip_all(x, KEY, (config,), impl)
        stacked = jax.tree.map(lambda a: a[None], q)  # one quantized input, plus x as the addend
        results.append(sum_requantize(stacked, jnp.asarray(x), KEY, stochastic, impl))
    (q_k, y_k), (q_r, y_r) = results
    assert_same_bits(q_k.meta, q_r.meta, "meta")
    assert_same_bits(y_k, y_r, "decoded sum")
    y = np.asarray(y_k)
    assert y[3] == np.inf and y[70] == -np.inf, (y[3], y[70])
    assert np.isfinite(np.delete(y, [3, 70])).all(), "every sum within range stays finite"
    # x[140] + decode(x[140]): one quantization of the input's bucket, one of the sum's.
    bucket = np.asarray(x[128:192], np.float64)
    spread = bucket.max() - bucket.min()
    factor = 1.0 if stochastic else 0.5
    assert abs(y[140] - 2e38) <= factor * (spread + 2 * spread) / 15 * (1 + 1e-3)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_long_buckets(stochastic):
    """Buckets longer than the CPU kernels' 4096-value pieces: infinities found across pieces."""
    n, bucket = 9000, 8192
    x = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    x[100], x[5000], x[6000], x[8500] = np.inf, 3e38, -1e38, -np.inf
    configs = tuple(CompressionConfig(bits=b, bucket_size=bucket, stochastic=stochastic, min_size=16) for b in (1, 4, 8))
    for config, (q, y) in zip(configs, run_both(x, configs)):
        y = np.asarray(y)
        for part in (slice(0, bucket), slice(bucket, n)):
            check_bucket(x[part], y[part], config.bits, stochastic, f"bits={config.bits} {part}")
    # The fused reduce re-sums a long bucket for its finite range: x + decode(x) overflows at 5000.
    q, _ = run_both(x, configs[1:2])[0]
    stacked = jax.tree.map(lambda a: a[None], q)
    sums = [sum_requantize(stacked, jnp.asarray(x), KEY, stochastic, impl) for impl in ("kernel", "reference")]
    assert_same_bits(sums[0][1], sums[1][1], "decoded sum")
    y = np.asarray(sums[0][1])
    assert (y[100], y[5000], y[8500]) == (np.inf, np.inf, -np.inf)
    assert np.isfinite(np.delete(y, [100, 5000, 8500])).all()
