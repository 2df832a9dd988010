"""compressed_psum over float32's whole range, against psum on 8 virtual CPU devices.

Where psum's result is finite, ours is finite and within a bound derived from the data; a sum that
overflows is an infinity of psum's sign; an infinity or a NaN in the inputs is never returned as a
finite number. (The per-bucket rules: tests/codec/test_range.py and docs/format.md.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from allreduce_cases import W, mesh_1d, per_device, psum_1d
from bitwise import assert_same_bits

from jax_cgx import CompressionConfig

KEY = jax.random.key(11)
N = 2 * W * 64
F32_MAX = float(np.finfo(np.float32).max)


def plain_psum(xs):
    """What psum gives in float32 (its infinities, its NaNs)."""
    return np.asarray(jnp.sum(jnp.asarray(xs, jnp.float32), axis=0))


def assert_like_psum(xs, out, bits, stochastic=False, ring=False):
    """out: every replica's result. Replicas bitwise equal; psum's non-finite values kept; the rest
    finite and within a bound from the data. SRA: every rank's quantization step (its finite values'
    range over the levels) plus the re-quantized sum's, halved for nearest rounding. Ring: W + 1
    re-quantizations of partial sums, each spanning at most every rank's range plus the error so far."""
    for i in range(1, W):
        assert_same_bits(out[i], out[0], f"replica {i} vs replica 0")
    y = np.asarray(out[0], np.float64)
    want = plain_psum(xs)
    for kind, mask in (("+inf", want == np.inf), ("-inf", want == -np.inf)):
        np.testing.assert_array_equal(y[mask], want[mask], err_msg=f"psum's {kind} must stay {kind}")
    assert np.all(np.isnan(y[np.isnan(want)])), "psum's NaN must not come back finite"
    finite = np.isfinite(want)
    assert np.all(np.isfinite(y[finite])), f"{np.sum(~np.isfinite(y[finite]))} values where psum is finite"
    x64 = np.asarray(xs, np.float64)
    levels = (1 << bits) - 1
    spread = lambda a: np.ptp(a[np.isfinite(a)]) if np.isfinite(a).any() else 0.0  # noqa: E731
    first = sum(spread(row) for row in x64) / levels
    exact = np.where(np.isfinite(x64).all(axis=0), x64.sum(axis=0), np.nan)
    second = (spread(exact) + 2 * first) / levels
    factor = 1.0 if stochastic else 0.5
    rounding = W * 2.0**-23 * np.abs(x64).sum(axis=0, where=np.isfinite(x64))
    if ring:
        total, err = sum(spread(row) for row in x64), 0.0
        for _ in range(W + 1):
            err += factor * (total + 2 * err) / levels
        bound = err * (1 + 1e-3) + rounding
    else:
        bound = factor * (first + second) * (1 + 1e-3) + rounding
    keep = finite & np.isfinite(exact)
    err = np.abs(y[keep] - exact[keep])
    assert np.all(err <= bound[keep]), f"error {err.max():.4g} above bound"


def uniform(scale, seed=0):
    return np.random.default_rng(seed).uniform(-scale, scale, (W, N)).astype(np.float32)


CASES = [
    ("sra", 4, "auto", False),
    ("sra", 8, "auto", True),
    ("ring", 4, "auto", False),
    ("sra", 4, "reference", False),
]


@pytest.mark.parametrize("algorithm,bits,impl,stochastic", CASES)
def test_large_finite_values_stay_finite(algorithm, bits, impl, stochastic):
    """The probe: every device uniform in +-1e37 gave 32768 of 32768 NaN."""
    config = CompressionConfig(bits=bits, bucket_size=64, algorithm=algorithm, stochastic=stochastic, min_size=16)
    mesh, ring = mesh_1d(), algorithm == "ring"
    for xs in (uniform(1e37), uniform(F32_MAX / W, seed=1)):
        assert_like_psum(xs, psum_1d(per_device(xs, mesh), KEY, config, impl=impl), bits, stochastic, ring)
    # 3e38 on one rank, zeros elsewhere (all NaN before).
    xs = np.zeros((W, N), np.float32)
    xs[3] = uniform(3e38, seed=2)[0]
    assert_like_psum(xs, psum_1d(per_device(xs, mesh), KEY, config, impl=impl), bits, stochastic, ring)


@pytest.mark.parametrize("algorithm,bits,impl,stochastic", CASES)
def test_overflow_and_non_finite_inputs(algorithm, bits, impl, stochastic):
    config = CompressionConfig(bits=bits, bucket_size=64, algorithm=algorithm, stochastic=stochastic, min_size=16)
    xs = uniform(1.0, seed=3)
    xs[:, 5], xs[:, 200] = 3e38, -3e38  # sums past the largest float: +inf, -inf
    xs[2, 300] = np.inf  # one rank's inf
    xs[5, 400] = -np.inf
    out = psum_1d(per_device(xs, mesh_1d()), KEY, config, impl=impl)
    assert_like_psum(xs, out, bits, stochastic, algorithm == "ring")
    y = np.asarray(out[0])
    assert (y[5], y[200], y[300], y[400]) == (np.inf, -np.inf, np.inf, -np.inf)
    # A NaN poisons the buckets it passes through (docs/format.md): never a finite result there.
    xs[6, 500] = np.nan
    out = psum_1d(per_device(xs, mesh_1d()), KEY, config, impl=impl)
    for i in range(1, W):
        assert_same_bits(out[i], out[0], f"replica {i} vs replica 0")
    nan = np.flatnonzero(np.isnan(out[0]))
    assert 500 in nan and nan.min() > 500 - 2 * 64 and nan.max() < 500 + 2 * 64, nan


def test_bfloat16_whole_range():
    xs = np.asarray(jnp.asarray(uniform(F32_MAX / W, seed=4), jnp.bfloat16))
    config = CompressionConfig(bits=4, bucket_size=64, min_size=16)
    out = psum_1d(per_device(xs, mesh_1d()), KEY, config)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert_like_psum(np.asarray(xs, np.float32), np.asarray(out, np.float32), 4)
