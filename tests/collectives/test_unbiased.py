"""Stochastic rounding keeps the compressed collectives unbiased (docs/algorithm.md: stochastic
rounding "keeps the result unbiased"; docs/format.md: a value rounds up with probability equal to
its fractional position).

For compressed_psum (SRA and the ring), compressed_psum_scatter and compressed_all_gather, the mean
of K results (K keys, one jitted program: the keys are vmapped) must lie within a statistical bound
of the exact result, derived from the data alone: each quantization adds an error of conditional
mean zero and variance at most ``scale^2 / 4`` (a Bernoulli choice between two levels one scale
apart), the errors of different quantizations and elements are uncorrelated, so the mean of K
results has per-element variance at most ``sum over the element's quantizations of scale^2/4 / K``.
Each scale is bounded from the data as in the error bounds (codec_cases.step_bound): a rank's by its
bucket's range, a re-quantized sum's by the exact sum's range widened by twice the error before it.
Allowed deterministic bias: the 23-bit truncation of the fractional position (2^-23 of a scale per
quantization) and float32 rounding of the sums.

The data make nearest rounding biased: every bucket spans [0, 3] (a step of 1 at 2 bits; rank r's
3 sits at its own position, so sums do not pile up) and its other values lie at 0.2..0.4 of a step,
which nearest rounding always takes down. Each test also runs the check on nearest rounding's result
and requires it to fail: the check detects a biased rounding, not only passes an unbiased one.
"""

import jax
import numpy as np
import pytest
from allreduce_cases import W, mesh_1d, per_device
from codec_cases import step_bound
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx import CompressionConfig

K = 256  # keys
B = 64
BITS = 2
N = W * 2 * B  # SRA / ring: chunks of 2 buckets (the chunk rule's multiple of 16 is 128 here)
M = 2 * B  # psum_scatter / all_gather: values per block or shard


def biased_for_nearest(rows: int, n: int, seed: int) -> np.ndarray:
    """``[rows, n]`` float32: buckets of B spanning [0, 3], row r's 3 at position 1 + r % (B - 1)."""
    x = np.random.default_rng(seed).uniform(0.2, 0.4, (rows, n // B, B))
    x[:, :, 0] = 0.0
    for r in range(rows):
        x[r, :, 1 + r % (B - 1)] = 3.0
    return x.reshape(rows, n).astype(np.float32)


def bucket_steps(a: np.ndarray) -> np.ndarray:
    """Per element of ``a[..., n]`` (buckets of B from index 0): the bound of its bucket's scale."""
    blocks = a.reshape(*a.shape[:-1], -1, B)
    return np.repeat(step_bound(np.ptp(blocks, axis=-1), BITS), B, axis=-1)


def bucket_max(a: np.ndarray) -> np.ndarray:
    return np.repeat(a.reshape(*a.shape[:-1], -1, B).max(-1), B, axis=-1)


def check_unbiased(mean: np.ndarray, exact: np.ndarray, var: np.ndarray, bias: np.ndarray, k: int = K):
    """Whether the mean of k results is unbiased within the statistical bound: per element within
    5.5 standard errors (sqrt(var / k)), pooled over the n elements within 5 standard errors of the
    pooled mean (sqrt(mean(var) / (k n))), plus the allowed deterministic bias. Returns
    ``(ok, worst per-element excess in standard errors, pooled deviation in standard errors)``."""
    dev = np.asarray(mean, np.float64) - exact
    se = np.sqrt(var / k)
    per_element = np.max((np.abs(dev) - bias) / se)
    pooled = (abs(dev.mean()) - bias.mean()) / np.sqrt(var.mean() / (k * dev.size))
    return bool(per_element <= 5.5 and pooled <= 5.0), float(per_element), float(pooled)


def assert_unbiased_and_nearest_detected(samples, nearest, exact, var, bias):
    samples = np.asarray(samples, np.float64)
    assert len({s.tobytes() for s in samples[:8]}) == 8, "different keys must round differently"
    ok, per_element, pooled = check_unbiased(samples.mean(0), exact, var, bias, samples.shape[0])
    assert ok, f"biased: worst element {per_element:.2f} standard errors, pooled {pooled:.2f}"
    ok, per_element, pooled = check_unbiased(nearest, exact, var, bias, samples.shape[0])
    assert not ok, f"nearest rounding passed ({per_element:.2f}, {pooled:.2f}): the check cannot see a bias"


def _vmapped(fn, xs, keys, out_spec=P("d")):
    """``fn(x, key)`` on device i's ``xs[i]``, for every key (vmapped): ``[W, K, ...]``."""
    body = lambda x, ks: jax.vmap(lambda k: fn(x[0], k))(ks)[None]  # noqa: E731
    f = jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=(P("d"), P()), out_specs=out_spec))
    return np.asarray(f(per_device(xs, mesh_1d()), keys))


def _once(fn, xs):
    """``fn(x)`` on device i's ``xs[i]``: ``[W, ...]``."""
    f = jax.jit(jax.shard_map(lambda x: fn(x[0])[None], mesh=mesh_1d(), in_specs=P("d"), out_specs=P("d")))
    return np.asarray(f(per_device(xs, mesh_1d())))


KEYS = jax.random.split(jax.random.key(2024), K)


def _sra_variance(x64):
    """Per element of the buffer: SRA's quantizations of it (W-1 peers', the sum's), scale^2/4 each.
    Chunk o = values [o*2B, (o+1)*2B), owned by rank o, its buckets those of the buffer."""
    steps = bucket_steps(x64)  # [W, N]
    owner = np.arange(N) // (2 * B)
    own = steps[owner, np.arange(N)]
    first = steps.sum(0) - own + W * 2.0**-22 * np.abs(x64).sum(0)  # stochastic: a scale each
    summed = step_bound(np.repeat(np.ptp(x64.sum(0).reshape(-1, B), -1), B) + 2 * bucket_max(first), BITS)
    var = ((steps**2).sum(0) - own**2 + summed**2) / 4
    bias = 2.0**-22 * (steps.sum(0) - own + summed) + W * 2.0**-22 * np.abs(x64).sum(0)
    return var, bias


def _ring_variance(x64):
    """Per element: the ring's W quantizations of its chunk (rank o+1's, then the partial sums')."""
    owner = np.arange(N) // (2 * B)
    cols = np.arange(N)
    partial, err, var, bias = np.zeros(N), np.zeros(N), np.zeros(N), np.zeros(N)
    for h in range(1, W + 1):
        partial = partial + x64[(owner + h) % W, cols]
        step = step_bound(np.repeat(np.ptp(partial.reshape(-1, B), -1), B) + 2 * bucket_max(err), BITS)
        err = err + step + 2.0**-23 * np.abs(partial)
        var, bias = var + step**2 / 4, bias + 2.0**-22 * step + 2.0**-23 * np.abs(partial)
    return var, bias


@pytest.mark.parametrize("algorithm", ["sra", "ring"])
def test_compressed_psum_is_unbiased(algorithm):
    xs = biased_for_nearest(W, N, seed=1)
    config = CompressionConfig(bits=BITS, bucket_size=B, stochastic=True, algorithm=algorithm, min_size=16)
    samples = _vmapped(lambda x, k: jax_cgx.compressed_psum(x, "d", config, key=k), xs, KEYS)  # [W, K, N]
    for r in range(1, W):
        np.testing.assert_array_equal(samples[r], samples[0])
    nearest = config.replace(stochastic=False)
    near = _once(lambda x: jax_cgx.compressed_psum(x, "d", nearest), xs)[0]
    x64 = xs.astype(np.float64)
    var, bias = (_ring_variance if algorithm == "ring" else _sra_variance)(x64)
    assert_unbiased_and_nearest_detected(samples[0], near, x64.sum(0), var, bias)


def test_compressed_psum_scatter_is_unbiased():
    # xs[rank, block, m]: block o goes to rank o, the owner's own block exact, each peer's quantized once.
    xs = biased_for_nearest(W * W, M, seed=2).reshape(W, W, M)
    config = CompressionConfig(bits=BITS, bucket_size=B, stochastic=True, min_size=16)
    samples = _vmapped(lambda x, k: jax_cgx.compressed_psum_scatter(x, "d", config, key=k), xs, KEYS)  # [W, K, M]
    nearest = config.replace(stochastic=False)
    near = _once(lambda x: jax_cgx.compressed_psum_scatter(x, "d", nearest), xs)
    x64 = xs.astype(np.float64)
    for o in range(W):
        steps = bucket_steps(x64[:, o])  # [rank, M]
        peers = np.delete(steps, o, axis=0)
        var = (peers**2).sum(0) / 4
        bias = 2.0**-22 * peers.sum(0) + W * 2.0**-22 * np.abs(x64[:, o]).sum(0)
        assert_unbiased_and_nearest_detected(samples[o], near[o], x64[:, o].sum(0), var, bias)


def test_compressed_all_gather_is_unbiased():
    xs = biased_for_nearest(W, M, seed=3)
    config = CompressionConfig(bits=BITS, bucket_size=B, stochastic=True, min_size=16)
    samples = _vmapped(lambda x, k: jax_cgx.compressed_all_gather(x, "d", config, key=k), xs, KEYS)  # [W, K, W, M]
    for r in range(1, W):
        np.testing.assert_array_equal(samples[r], samples[0])
    nearest = config.replace(stochastic=False)
    near = _once(lambda x: jax_cgx.compressed_all_gather(x, "d", nearest), xs)[0]
    x64 = xs.astype(np.float64)
    steps = bucket_steps(x64)  # [shard, M]
    assert_unbiased_and_nearest_detected(samples[0].reshape(K, -1), near.reshape(-1), x64.reshape(-1),
                                         (steps**2 / 4).reshape(-1), (2.0**-22 * steps).reshape(-1))
