"""Padding never widens a bucket (docs/algorithm.md, "Padding").

SRA and the ring pad a buffer to ``W`` equal chunks, and the hierarchical path pads it
to ``W_inner`` equal shards. Those padding values must not take part in any bucket's
range: every quantization is told how many of its row's values are real (the codec's
``valid`` counts). The properties checked here:

- the codec with ``valid=v`` writes exactly the metadata, and for the real values the
  levels, of quantizing only the first ``v`` values (an incomplete last bucket), on the
  kernel and the reference alike;
- constant inputs come out exact at every width, every size around the chunk boundaries,
  for SRA, ring and hierarchical, nearest and stochastic;
- the error stays within docs/algorithm.md's bound computed from the data's own buckets
  (each rank's real values and the exact sums; no scale read back from the algorithm),
  for non-centered data (100 +- 1) at sizes around every chunk boundary.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from allreduce_cases import W, mesh_1d, mesh_2d
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cgx
from jax_cgx._src import codec
from jax_cgx._src.codec import reference as _reference
from jax_cgx._src.codec.quantized import num_buckets
from jax_cgx._src.exchange.chunks import chunk_length

# ----------------------------------------------------------------- the codec


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("bits", [1, 4, 8])
def test_valid_count_encodes_like_an_incomplete_bucket(bits, stochastic):
    """quantize(x, valid=v) == quantize(x[:v]) on the real values; padding takes no part."""
    m, bucket = 200, 64
    rng = np.random.default_rng(bits)
    x = jnp.asarray(100 + rng.standard_normal((5, m)), jnp.float32)
    x = x.at[:, 150:].set(0.0)  # padding far outside the real values' range
    seeds = jnp.asarray(rng.integers(0, 2**32, (5, 2)), jnp.uint32)
    valid = jnp.asarray([200, 150, 129, 1, 0], jnp.int32)
    args = dict(bits=bits, bucket_size=bucket, stochastic=stochastic, m=m)
    kernel = codec.quantize_rows(x, seeds, impl="kernel", valid=valid, **args)
    reference = codec.quantize_rows(x, seeds, impl="reference", valid=valid, **args)
    for got, want in zip(kernel, reference):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    payload, meta = (np.asarray(a) for a in kernel)
    decoded = np.asarray(codec.dequantize_rows(*kernel, bits=bits, bucket_size=bucket, m=m,
                                               dtype=jnp.float32, impl="kernel"))
    for r, v in enumerate(np.asarray(valid)):
        nb = num_buckets(int(v), bucket)
        if v:
            p, mt = _reference.quantize(x[r : r + 1, :v], seeds[r : r + 1], bits=bits, bucket_size=bucket,
                                        stochastic=stochastic, m=int(v))
            np.testing.assert_array_equal(meta[r, :nb], np.asarray(mt[0]))
            prefix = np.asarray(_reference.dequantize(p, mt, bits=bits, bucket_size=bucket, m=int(v),
                                                      dtype=jnp.float32))[0]
            np.testing.assert_array_equal(decoded[r, :v], prefix)
        # Buckets holding nothing real: (0, 0), decoding to zeros.
        np.testing.assert_array_equal(meta[r, nb:], 0.0)
        np.testing.assert_array_equal(decoded[r, nb * bucket :], 0.0)
        # Padding inside the last real bucket decodes within that bucket's range.
        if v % bucket:
            k = nb - 1
            lo, scale = meta[r, k]
            inside = decoded[r, v : (k + 1) * bucket]
            assert np.all(inside >= lo) and np.all(inside <= lo + scale * ((1 << bits) - 1))


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("bits", [1, 3, 8])
def test_a_row_with_nothing_real_encodes_as_zeros(bits, stochastic):
    """valid=0: every byte of payload and metadata is zero, whatever the row holds (NaN,
    infinities, huge values): the kernel's shortcut for the chunk SRA and the reduce-scatter
    keep, and the reference's arithmetic, agree."""
    m, bucket = 300, 64
    x = np.random.default_rng(bits).standard_normal((3, m)).astype(np.float32) * 1e30
    x[:, :5] = [np.nan, np.inf, -np.inf, 3e38, -0.0]
    seeds = jnp.asarray(np.random.default_rng(0).integers(0, 2**32, (3, 2)), jnp.uint32)
    valid = jnp.asarray([0, m, 0], jnp.int32)
    args = dict(bits=bits, bucket_size=bucket, stochastic=stochastic, m=m)
    kernel = codec.quantize_rows(jnp.asarray(x), seeds, impl="kernel", valid=valid, **args)
    reference = codec.quantize_rows(jnp.asarray(x), seeds, impl="reference", valid=valid, **args)
    for got, want in zip(kernel, reference):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for part in kernel:
        assert not np.asarray(part)[[0, 2]].view(np.uint8).any()


def test_valid_count_requantize_kernel_matches_reference():
    """dequantize_sum_requantize with valid counts: kernel and reference, the same bytes."""
    rng = np.random.default_rng(7)
    r, w, m, bucket, bits = 4, 3, 100, 32, 3
    x = jnp.asarray(rng.standard_normal((r * w, m)) + 50, jnp.float32)
    seeds = jnp.asarray(rng.integers(0, 2**32, (r * w, 2)), jnp.uint32)
    args = dict(bits=bits, bucket_size=bucket, m=m)
    payload, meta = codec.quantize_rows(x, seeds, stochastic=False, impl="kernel", **args)
    payload, meta = payload.reshape(r, w, -1), meta.reshape(r, w, -1, 2)
    addend = jnp.asarray(rng.standard_normal((r, m)), jnp.float32)
    valid = jnp.asarray([100, 70, 33, 0], jnp.int32)
    for stochastic in (False, True):
        outs = [
            codec.dequantize_sum_requantize_rows(payload, meta, addend, seeds[:r], stochastic=stochastic,
                                                 dtype=jnp.float32, impl=impl, valid=valid, **args)
            for impl in ("kernel", "reference")
        ]
        for got, want in zip(*outs):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_valid_operand_is_checked():
    x = jnp.zeros((2, 16), jnp.float32)
    seeds = jnp.zeros((2, 2), jnp.uint32)
    with pytest.raises(Exception, match="valid"):
        codec.quantize_rows(x, seeds, bits=4, bucket_size=8, stochastic=False, m=16, impl="kernel",
                            valid=jnp.zeros((3,), jnp.int32))


# ----------------------------------------------------------- the all-reduce


def _sizes(bucket_size: int):
    """1..W*bucket_size+1 around every chunk boundary (chunks are multiples of 16 values here)."""
    sizes = {1, 2, 3, 5, 6, W * bucket_size, W * bucket_size + 1}
    for n in range(16, W * bucket_size + 2, 16):
        sizes.update({n - 1, n, n + 1})
    return sorted(s for s in sizes if 1 <= s <= W * bucket_size + 1)


BUCKET = 32
CONFIGS = {
    "sra": dict(),
    "ring": dict(algorithm="ring"),
}


def _unfused(config):
    """A config per leaf that keeps every leaf its own buffer (configs that differ are never
    fused): one program reduces many sizes, each through its own SRA or ring."""

    def spec(path, leaf):
        return dataclasses.replace(config, fusion_buffer_mb=config.fusion_buffer_mb + path[0].idx / 1024)

    return spec


@functools.partial(jax.jit, static_argnames="config")
def _flat(xs, key, config):
    def body(x, k):
        leaves = [a[0] for a in x]
        return [r[None] for r in jax_cgx.compressed_psum(leaves, "d", _unfused(config), key=k)]

    return jax.shard_map(body, mesh=mesh_1d(), in_specs=(P("d"), P()), out_specs=P("d"))(xs, key)


def _run_flat(xs, config):
    """compressed_psum over the 8 devices of each ``xs[W, n]`` of the list (row i on device i)."""
    xs = [jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(mesh_1d(), P("d"))) for x in xs]
    return [np.asarray(o) for o in _flat(xs, jax.random.key(3), config)]


@pytest.fixture(autouse=True)
def _fresh_caches():
    """Each test compiles a program per size; drop them afterwards (hundreds of live
    8-device executables in one process exhaust XLA:CPU)."""
    yield
    jax.clear_caches()


def _meta_scale(lo, hi, bits):
    """The scale make_meta gives a bucket whose values span [lo, hi] (float32, as the codec)."""
    lo, hi = np.float32(lo), np.float32(hi)
    if not hi > lo:
        return 0.0
    s = np.float32(hi - lo) * np.float32(np.float32(1) / np.float32((1 << bits) - 1))
    u = (np.asarray(s, np.float32).view(np.uint32) + np.uint32(0xFF)) & np.uint32(0xFFFFFF00)
    return float(max(u.view(np.float32), np.float32(2.0**-100)))


def _data_bound(xs, chunk, bucket, bits, stochastic, algorithm):
    """docs/algorithm.md's bound per value, from the data alone.

    Each rank's scale comes from the range of its own real values in the bucket. A re-quantized
    (partial) sum's scale comes from the range of the exact (partial) sums of the bucket's real
    values widened by twice the error already bounded (a sum is within that error of its
    exact value). Padding plays no part anywhere.
    """
    xs = np.asarray(xs, np.float64)
    w, n = xs.shape
    factor = 1.0 if stochastic else 0.5
    bound = np.zeros(n)
    for o in range(w):
        for start in range(o * chunk, min((o + 1) * chunk, n), bucket):
            stop = min(start + bucket, (o + 1) * chunk, n)
            v = xs[:, start:stop]
            scale = [_meta_scale(v[r].min(), v[r].max(), bits) for r in range(w)]
            if algorithm == "sra":
                err = sum(factor * scale[r] for r in range(w) if r != o)
                exact = v.sum(0)
                err += factor * _meta_scale(exact.min() - 2 * err, exact.max() + 2 * err, bits)
            else:  # chunk o starts at rank o+1 and is re-quantized at ranks o+2, ..., o+W
                ranks = [(o + 1 + h) % w for h in range(w)]
                err = factor * scale[ranks[0]]
                partial = v[ranks[0]].copy()
                for r in ranks[1:]:
                    partial = partial + v[r]
                    err += factor * _meta_scale(partial.min() - 2 * err, partial.max() + 2 * err, bits)
            bound[start:stop] = err
    exact = xs.sum(0)
    rounding = 2.0**-22 * (np.abs(xs).sum(0) + np.abs(exact)) * w
    return np.abs(exact), bound * (1 + 1e-4) + rounding


@pytest.mark.slow
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("algorithm", ["sra", "ring"])
def test_every_size_around_the_chunk_boundaries(algorithm, stochastic):
    """At every size around the chunk boundaries, with one compiled program per width: a constant
    buffer sums exactly (1, 2, 4 and 8 bits), and non-centered data (100 +- 1) obeys the bound
    computed from the data (2, 4 and 8 bits). Both inputs go through the same program, which is
    what makes this test cost half what two tests would: compiling ~55 reductions per width."""
    rng = np.random.default_rng(11)
    sizes = _sizes(BUCKET)
    for bits in (1, 2, 4, 8):
        config = jax_cgx.CompressionConfig(bits=bits, bucket_size=BUCKET, min_size=0, stochastic=stochastic,
                                           **CONFIGS[algorithm])
        for n, out in zip(sizes, _run_flat([np.full((W, n), 1.5) for n in sizes], config)):
            np.testing.assert_array_equal(out, np.full((W, n), 1.5 * W, np.float32), err_msg=f"bits={bits} n={n}")
        if bits == 1:
            continue
        inputs = [(100 + rng.uniform(-1, 1, (W, n))).astype(np.float32) for n in sizes]
        for n, xs, out in zip(sizes, inputs, _run_flat(inputs, config)):
            assert (out == out[0]).all(), "replicas differ"
            chunk = chunk_length(n, W, BUCKET, False)
            _, bound = _data_bound(xs, chunk, BUCKET, bits, stochastic, algorithm)
            err = np.abs(out[0].astype(np.float64) - xs.astype(np.float64).sum(0))
            worst = int(np.argmax(err - bound))
            assert (err <= bound).all(), f"bits={bits} n={n}: error {err[worst]} > bound {bound[worst]} at {worst}"


def test_the_issue_example():
    """8 devices, 4 bits, bucket 512, 100 +- 1: 4100 values err like 4096 do (was 12.5 against 0.56)."""
    rng = np.random.default_rng(0)
    errs = {}
    for n in (4096, 4100):
        config = jax_cgx.CompressionConfig(bits=4, bucket_size=512, min_size=0)
        xs = (100 + rng.uniform(-1, 1, (W, n))).astype(np.float32)
        (out,) = _run_flat([xs], config)
        errs[n] = np.abs(out[0].astype(np.float64) - xs.astype(np.float64).sum(0)).max()
        chunk = chunk_length(n, W, 512, False)
        _, bound = _data_bound(xs, chunk, 512, 4, False, "sra")
        assert errs[n] <= bound.max()
    assert errs[4100] < 1.0, errs


# ---------------------------------------------------------------- hierarchical


HIER_MESH = ((2, 4), ("node", "local"))


@functools.partial(jax.jit, static_argnames="config")
def _hier(xs, key, config):
    def body(x, k):
        leaves = [a[0, 0] for a in x]
        out = jax_cgx.compressed_psum(leaves, ("node", "local"), _unfused(config), key=k)
        return [r[None, None] for r in out]

    spec = P("node", "local")
    return jax.shard_map(body, mesh=mesh_2d(*HIER_MESH), in_specs=(spec, P()), out_specs=spec)(xs, key)


def _run_hier(xs, config):
    sharding = NamedSharding(mesh_2d(*HIER_MESH), P("node", "local"))
    xs = [jax.device_put(jnp.asarray(x, jnp.float32), sharding) for x in xs]
    return [np.asarray(o) for o in _hier(xs, jax.random.key(5), config)]


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("algorithm", ["sra", "ring"])
def test_hierarchical_padding(algorithm, stochastic):
    """Shards ending in padding: constants exact, 100 +- 1 within the bound from the node sums."""
    rng = np.random.default_rng(3)
    inner, outer = 4, 2
    for bits in (2, 4):
        config = jax_cgx.CompressionConfig(bits=bits, bucket_size=BUCKET, min_size=0, stochastic=stochastic,
                                           hierarchical=True, **CONFIGS[algorithm])
        sizes = (1, 5, 6, 33, 63, 127, 129, 255, 257)
        constants = _run_hier([np.full((outer, inner, n), 0.75) for n in sizes], config)
        inputs = [(100 + rng.uniform(-1, 1, (outer, inner, n))).astype(np.float32) for n in sizes]
        for n, const, xs, out in zip(sizes, constants, inputs, _run_hier(inputs, config)):
            np.testing.assert_array_equal(const, np.full((outer, inner, n), 0.75 * W, np.float32),
                                          err_msg=f"bits={bits} n={n}")
            out = out.reshape(W, n)
            assert (out == out[0]).all(), "replicas differ"
            nodes = xs.astype(np.float64).sum(1)  # [outer, n]: the inner reduce-scatter's sums
            shard = -(-n // inner)
            err = np.abs(out[0] - nodes.sum(0))
            for i in range(inner):
                lo, hi = i * shard, min((i + 1) * shard, n)
                if lo >= hi:
                    continue
                chunk = chunk_length(shard, outer, BUCKET, False)
                _, bound = _data_bound(nodes[:, lo:hi], chunk, BUCKET, bits, stochastic, algorithm)
                bound += 2.0**-20 * np.abs(xs[..., lo:hi]).sum((0, 1))  # the float32 node sums
                assert (err[lo:hi] <= bound).all(), f"bits={bits} n={n} shard {i}"
