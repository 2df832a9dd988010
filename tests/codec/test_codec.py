"""The codec: bitwise parity CPU kernel vs pure-JAX reference, and its error bounds."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_same_bits
from codec_cases import (
    BITS,
    BUCKETS,
    DTYPES,
    bucket_scales,
    decodes_to_nan,
    error_bound,
    roundtrip,
    roundtrip_all,
    sample,
    sum_plain,
    sum_requantize,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_cgx
from jax_cgx import CompressionConfig

KEY = jax.random.key(1234)


def check_parity_all(x, configs, key=KEY):
    """Kernel and reference give the same bytes for every config; returns the kernel's results."""
    configs = tuple(configs)
    kernel = roundtrip_all(x, key, configs, "kernel")
    reference = roundtrip_all(x, key, configs, "reference")
    for config, (q_k, y_k), (q_r, y_r) in zip(configs, kernel, reference, strict=True):
        what = f"n={x.size} {x.dtype} {config}"
        assert_same_bits(q_k.payload, q_r.payload, "payload " + what)
        assert_same_bits(q_k.meta, q_r.meta, "meta " + what)
        assert_same_bits(q_k.tail, q_r.tail, "tail " + what)
        assert_same_bits(y_k, y_r, "decoded " + what)
    return kernel


def check_parity(x, config, key=KEY):
    return check_parity_all(x, [config], key)[0]


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("bucket_size", BUCKETS)
def test_kernel_matches_reference_every_width(bucket_size, dtype, stochastic):
    """Bitwise parity and the error bound, for every width 1..8."""
    n = 2 * bucket_size + 7 if bucket_size < 4096 else bucket_size + 1021
    x = sample(n, dtype, seed=bucket_size)
    configs = [CompressionConfig(bits=b, bucket_size=bucket_size, stochastic=stochastic, min_size=16) for b in BITS]
    for bits, (q, y) in zip(BITS, check_parity_all(x, configs), strict=True):
        err, bound = error_bound(x, np.asarray(y), n, bucket_size, bits, stochastic)
        assert np.all(err <= bound), f"bits={bits}: error {err.max()} above bound"


@pytest.mark.parametrize("n", [0, 1, 2, 13, 97, 1009, 4099, 65537])
@pytest.mark.parametrize("bucket_size", [3, 512])
def test_kernel_matches_reference_sizes(n, bucket_size):
    x = sample(n, jnp.float32, seed=n)
    check_parity_all(
        x,
        [
            CompressionConfig(bits=bits, bucket_size=bucket_size, stochastic=stochastic, min_size=16)
            for bits, stochastic in itertools.product((1, 3, 4, 8), (False, True))
        ],
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_skip_incomplete_buckets_keeps_tail_exact(dtype):
    x = sample(1000, dtype)
    config = CompressionConfig(bits=4, bucket_size=64, skip_incomplete_buckets=True, min_size=16)
    q, y = check_parity(x, config)
    assert q.tail.shape == (1000 - 960,)
    assert q.meta.shape == (15, 2)
    assert_same_bits(np.asarray(y)[960:], x[960:], "uncompressed tail")


@pytest.mark.parametrize("bits", [1, 4])
@pytest.mark.parametrize("m", [6, 8, 10])
def test_rows_encode_their_first_m_values(bits, m):
    """quantize_rows on x[R, n] with m < n (not whole buckets too): the first m values, the
    same bytes from the kernel and the reference as from the first m columns alone."""
    x = jnp.asarray(np.array([[0, 1, 2, 3, 0, 1, 100, -100, 5, 5]], np.float32))
    seeds = jnp.zeros((1, 2), jnp.uint32)
    args = dict(bits=bits, bucket_size=4, stochastic=False, m=m)
    want = jax_cgx._src.codec.quantize_rows(x[:, :m], seeds, impl="reference", **args)
    for impl in ("kernel", "reference"):
        for a, b in zip(jax_cgx._src.codec.quantize_rows(x, seeds, impl=impl, **args), want, strict=True):
            assert_same_bits(a, b, f"{impl} m={m}")


@pytest.mark.parametrize("args", [(-5, 4, 4), (10, -3, 4), (10, 4, 0), (10, 4, 16), (10.0, 4, 4), (10, 4.5, 4)])
def test_size_helpers_refuse_what_is_not_a_size(args):
    with pytest.raises(ValueError, match="payload_bytes: needs integers m >= 0, bucket_size >= 1 and bits in 1..8"):
        jax_cgx._src.codec.payload_bytes(*args)
    if args[2] == 4:
        with pytest.raises(ValueError, match="num_buckets: needs integers"):
            jax_cgx._src.codec.num_buckets(*args[:2])


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_quantize_has_a_zero_gradient_on_every_implementation(impl):
    # As jnp.round's. The kernels had no rule (an error); the reference's gradient flowed through
    # the bucket minimum only. The straight-through estimate the docstring gives works on both.
    x = jnp.linspace(-1.0, 1.0, 16)
    roundtrip = lambda v: jax_cgx.dequantize(jax_cgx.quantize(v, impl=impl), impl=impl)  # noqa: E731
    assert_same_bits(jax.grad(lambda v: roundtrip(v).sum())(x), jnp.zeros_like(x))
    ste = jax.grad(lambda v: (v + jax.lax.stop_gradient(roundtrip(v) - v)).sum())(x)
    assert_same_bits(ste, jnp.ones_like(x))


def test_shapes_and_dtypes_round_trip():
    x = jnp.asarray(sample(6 * 7 * 11, jnp.bfloat16)).reshape(6, 7, 11)
    q, y = roundtrip(x, KEY, CompressionConfig(bits=5, bucket_size=100, min_size=16), "kernel")
    assert y.shape == x.shape and y.dtype == x.dtype
    assert q.shape == (6, 7, 11) and q.dtype == np.dtype(jnp.bfloat16)


# ---------------------------------------------------------------- format


@pytest.mark.parametrize("bits", BITS)
def test_payload_is_dense_per_bucket(bits):
    """A bucket of n values costs exactly ceil(n*bits/8) bytes, plus 8 bytes of metadata."""
    for n, bucket in [(1, 1), (7, 3), (1000, 64), (1000, 500), (513, 512), (5000, 4096)]:
        full, rest = divmod(n, bucket)
        expected = full * -(-bucket * bits // 8) + -(-rest * bits // 8)
        assert jax_cgx.payload_bytes(n, bucket, bits) == expected
        q = jax_cgx.quantize(jnp.zeros(n), CompressionConfig(bits=bits, bucket_size=bucket, min_size=16))
        assert q.payload.shape == (expected,)
        assert q.meta.shape == (-(-n // bucket), 2)
        assert q.nbytes == expected + 8 * q.meta.shape[0]


def _numpy_decode(payload, meta, n, bits, bucket_size):
    """An independent reading of docs/format.md: LSB-first bit stream per bucket."""
    payload, meta = np.asarray(payload), np.asarray(meta)
    per_bucket = -(-bucket_size * bits // 8)
    out = np.empty(n, np.float32)
    for k in range(-(-n // bucket_size)):
        length = min(bucket_size, n - k * bucket_size)
        stream = np.unpackbits(payload[k * per_bucket : k * per_bucket + -(-length * bits // 8)], bitorder="little")
        levels = stream[: length * bits].reshape(length, bits) @ (1 << np.arange(bits))
        if stream[length * bits :].any():
            raise AssertionError("padding bits must be zero")
        mn, scale = meta[k]
        out[k * bucket_size : k * bucket_size + length] = mn + levels.astype(np.float32) * scale
    return out


@pytest.mark.parametrize("bits", BITS)
def test_byte_layout_matches_spec(bits):
    x = sample(1000, jnp.float32, seed=bits)
    for bucket in (3, 64, 500):
        q, y = roundtrip(x, KEY, CompressionConfig(bits=bits, bucket_size=bucket, min_size=16), "kernel")
        np.testing.assert_array_equal(_numpy_decode(q.payload, q.meta, 1000, bits, bucket), np.asarray(y))


# ------------------------------------------------------- special values


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_degenerate_buckets_decode_exactly(dtype):
    x = np.repeat(np.asarray([3.25, -7.0, 0.0, 1e-3], np.float32), 64)
    x = np.asarray(jnp.asarray(x, dtype))
    configs = [CompressionConfig(bits=bits, bucket_size=64, min_size=16) for bits in BITS]
    for bits, (q, y) in zip(BITS, check_parity_all(x, configs), strict=True):
        assert_same_bits(y, x, f"degenerate bits={bits}")
        assert np.all(np.asarray(q.meta[:, 1]) == 0)


@pytest.mark.parametrize("stochastic", [False, True])
def test_nan_bucket_decodes_nan(stochastic):
    """(Infinities and values up to float32's largest: tests/codec/test_range.py.)"""
    x = sample(256, jnp.float32)
    x[70] = np.nan
    q, y = check_parity(x, CompressionConfig(bits=4, bucket_size=64, stochastic=stochastic, min_size=16))
    y = np.asarray(y)
    assert np.all(np.isnan(y[64:128])), "the bucket holding a NaN must decode to NaN"
    assert np.all(np.isfinite(y[:64])) and np.all(np.isfinite(y[128:])), "other buckets stay finite"
    assert np.all(np.isnan(np.asarray(q.meta[1])))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["float32", "float16"])
def test_tiny_values_and_negative_zero(dtype):
    """Subnormals are flushed to +0 identically everywhere; -0 behaves as +0."""
    tiny = np.float32(2.0**-130) if dtype == jnp.float32 else np.float32(2.0**-20)
    x = np.zeros(192, np.float32)
    x[:64] = -0.0
    x[64:128] = tiny * np.arange(64)
    x[128:] = np.linspace(-1, 1, 64)
    x[130] = tiny
    x = np.asarray(jnp.asarray(x, dtype))
    check_parity_all(
        x,
        [
            CompressionConfig(bits=bits, bucket_size=64, stochastic=stochastic, min_size=16)
            for bits in (1, 4, 8)
            for stochastic in (False, True)
        ],
    )


def test_large_range_buckets():
    x = sample(512, jnp.float32)
    x[:64] = np.linspace(-(2.0**124), 2.0**124, 64)
    x[64:128] = np.linspace(2.0**-120, 2.0**-119, 64)
    for q, y in check_parity_all(x, [CompressionConfig(bits=bits, bucket_size=64, min_size=16) for bits in BITS]):
        assert np.all(np.isfinite(np.asarray(y)))


def test_reference_reciprocal_is_correctly_rounded():
    """The reference's 1/scale is IEEE division's bits, by integer arithmetic (XLA:GPU's f32
    divide is PTX div.full, off by an ulp at times): every exponent of a scale, random and
    extreme significands."""
    from jax_cgx._src.codec import reference

    rng = np.random.default_rng(5)
    exponent = rng.integers(-100, 126, 200_000)  # scales lie in [2**-100, 2**126]
    significand = rng.integers(0, 1 << 23, exponent.size, dtype=np.uint32)
    significand[::7] = 0  # powers of two
    significand[1::7] = (1 << 23) - 1
    scale = ((((exponent + 127).astype(np.uint32)) << 23) | significand).view(np.float32)
    scale = np.concatenate([scale, np.float32([2.0**-100, 2.0**126, 1.0, 3.0, 0.0, np.nan])])
    got = np.asarray(jax.jit(reference.inverse_scale)(scale))
    with np.errstate(divide="ignore", invalid="ignore"):
        want = np.where(scale > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
    assert_same_bits(got, want, "1/scale")


# ------------------------------------------------------ stochastic rounding


def test_stochastic_rounding_is_unbiased():
    """E[decode(quantize(x))] = x: the mean over K keys is within 5 standard errors."""
    k, bits = 4096, 2
    x = jnp.asarray(sample(64, jnp.float32, seed=7))
    config = CompressionConfig(bits=bits, bucket_size=64, stochastic=True, min_size=16)
    keys = jax.random.split(jax.random.key(0), k)
    ys = jax.jit(jax.vmap(lambda key: roundtrip(x, key, config, "kernel")[1]))(keys)
    scale = float(bucket_scales(x, 64, 64, bits)[0])  # from the data, not the codec's metadata
    mean = np.asarray(ys, np.float64).mean(axis=0)
    # Each sample is x + scale*(B - f) with B ~ Bernoulli(f): variance <= scale^2/4.
    std_error = scale / (2 * np.sqrt(k))
    assert np.all(np.abs(mean - np.asarray(x)) <= 5 * std_error + 1e-6 * scale)
    # Pooled over the 64 values the bias must be smaller still.
    assert abs((mean - np.asarray(x)).mean()) <= 5 * std_error / 8 + 1e-6 * scale
    # And different keys really give different roundings.
    assert len({np.asarray(y).tobytes() for y in ys[:16]}) > 1


def test_stochastic_needs_a_key():
    with pytest.raises(ValueError, match="PRNG key"):
        jax_cgx.quantize(jnp.ones(10), CompressionConfig(stochastic=True, min_size=16))


def test_same_key_same_bytes_and_raw_keys_work():
    x = jnp.asarray(sample(1000, jnp.float32))
    config = CompressionConfig(bits=3, bucket_size=64, stochastic=True, min_size=16)
    a = jax_cgx.quantize(x, config, key=jax.random.key(5))
    b = jax_cgx.quantize(x, config, key=jax.random.key(5))
    c = jax_cgx.quantize(x, config, key=jax.random.PRNGKey(5))  # legacy uint32[2] key
    assert_same_bits(a.payload, b.payload)
    assert c.payload.shape == a.payload.shape


# ------------------------------------------------------------ transforms


def test_vmap_matches_per_example_calls():
    xs = jnp.asarray(sample(3 * 500, jnp.float32)).reshape(3, 500)
    keys = jax.random.split(KEY, 3)
    config = CompressionConfig(bits=3, bucket_size=64, stochastic=True, min_size=16)
    for impl in ("kernel", "reference"):
        qs, ys = jax.vmap(lambda x, k: roundtrip(x, k, config, impl))(xs, keys)
        for i in range(3):
            q, y = roundtrip(xs[i], keys[i], config, impl)
            assert_same_bits(qs.payload[i], q.payload, f"vmap payload {impl}")
            assert_same_bits(ys[i], y, f"vmap decoded {impl}")
    # An unbatched key is shared by every example (vmap semantics).
    qs, _ = jax.vmap(lambda x: roundtrip(x, KEY, config, "kernel"))(xs)
    assert_same_bits(qs.payload[1], roundtrip(xs[1], KEY, config, "kernel")[0].payload)


def test_nested_vmap():
    xs = jnp.asarray(sample(2 * 3 * 100, jnp.float16)).reshape(2, 3, 100)
    config = CompressionConfig(bits=6, bucket_size=7, min_size=16)
    f = jax.vmap(jax.vmap(lambda x: roundtrip(x, KEY, config, "kernel")[1]))
    g = jax.vmap(jax.vmap(lambda x: roundtrip(x, KEY, config, "reference")[1]))
    assert_same_bits(f(xs), g(xs))


@pytest.mark.parametrize("scale_of", [3, 7, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_dequantize_output_scale_matches_reference(dtype, scale_of):
    """The dequantize target's output scale (compressed_pmean's 1/W): kernel and reference give the
    same bits, every value is ``decode * scale`` (a subnormal product flushed to a zero of its sign,
    as XLA:CPU flushes) rounded once to the dtype, over plain, infinite, wide (near the float32
    limit), NaN and subnormal-result buckets of both signs."""
    from jax_cgx._src.backends import mean_scale
    from jax_cgx._src.codec.rows import dequantize_rows, quantize_rows

    n, bits, bucket = 64 * 7, 4, 64
    x = sample(n, jnp.float32, seed=scale_of)
    x[64] = np.inf
    x[130] = -np.inf
    x[192:256] = np.linspace(-3e38, 3e38, 64, dtype=np.float32)
    x[260] = np.nan
    # Buckets whose minimum (decoded exactly, at level 0) is +-1.5 * 2^-126: scaled, a subnormal product.
    x[320:384] = np.linspace(0, 1, 64, dtype=np.float32)
    x[320] = np.float32(-1.5 * 2.0**-126)
    x[384:448] = np.linspace(1, 2, 64, dtype=np.float32)
    x[384] = np.float32(1.5 * 2.0**-126)
    args = dict(bits=bits, bucket_size=bucket, m=n)
    payload, meta = quantize_rows(jnp.asarray(x)[None], jnp.zeros((1, 2), jnp.uint32), stochastic=False,
                                  impl="kernel", **args)
    scale = mean_scale(scale_of)
    got = {impl: dequantize_rows(payload, meta, dtype=dtype, scale=scale, impl=impl, **args)
           for impl in ("kernel", "reference")}
    assert_same_bits(got["kernel"], got["reference"], "kernel vs reference")
    decoded = np.asarray(dequantize_rows(payload, meta, dtype=jnp.float32, impl="kernel", **args))
    with np.errstate(invalid="ignore", over="ignore"):
        want = decoded * np.float32(scale)
    want = np.where(np.abs(want) < np.float32(2.0**-126), np.copysign(np.float32(0), want), want)
    assert np.signbit(want[0, 320]) and want[0, 320] == 0 and not np.signbit(want[0, 384]) and want[0, 384] == 0
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(np.asarray(got["kernel"], np.float32)), nan)
    assert_same_bits(np.asarray(got["kernel"])[~nan], np.asarray(jnp.asarray(want, dtype))[~nan], "v * scale, flushed")


def test_dequantize_refuses_a_bad_output_scale():
    from jax_cgx._src.codec import kernels

    payload, meta = jnp.zeros((1, 8), jnp.uint8), jnp.zeros((1, 1, 2), jnp.float32)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(Exception, match="scale must be a positive finite float"):
            jax.block_until_ready(kernels.dequantize_p.bind(payload, meta, bits=4, bucket_size=16, m=16,
                                                            dtype=np.dtype(np.float32), scale=bad, strict=True))


# ------------------------------------------------------ the reduce kernels


def _stack(qs):
    return jax.tree.map(lambda *a: jnp.stack(a), *qs)


@pytest.mark.parametrize("w", [1, 3, 8])
@pytest.mark.parametrize("with_addend", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_dequantize_sum_matches_reference(w, with_addend, dtype):
    n, config = 1001, CompressionConfig(bits=4, bucket_size=64, min_size=16)
    xs = [jnp.asarray(sample(n, dtype, seed=s)) for s in range(w)]
    q = _stack([jax_cgx.quantize(x, config) for x in xs])
    addend = jnp.asarray(sample(n, dtype, seed=99)) if with_addend else None
    out_k = sum_plain(q, addend, "kernel")
    assert_same_bits(out_k, sum_plain(q, addend, "reference"), "dequantize_sum")
    # The fixed order: addend first, then each decoded input, in float32.
    expected = np.zeros(n, np.float32) if addend is None else np.asarray(addend, np.float32)
    for i in range(w):
        expected = expected + _numpy_decode(q.payload[i], q.meta[i], n, config.bits, config.bucket_size)
    np.testing.assert_array_equal(np.asarray(out_k), expected)


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("bits", [1, 2, 4, 5, 8])
def test_dequantize_sum_requantize_matches_reference(bits, dtype, stochastic):
    n, config = 777, CompressionConfig(bits=bits, bucket_size=100, skip_incomplete_buckets=bits == 5, min_size=16)
    q = _stack([jax_cgx.quantize(jnp.asarray(sample(n, dtype, seed=s)), config) for s in range(4)])
    addend = jnp.asarray(sample(n, dtype, seed=42))
    s_k, out_k = sum_requantize(q, addend, KEY, stochastic, "kernel")
    s_r, out_r = sum_requantize(q, addend, KEY, stochastic, "reference")
    for field in ("payload", "meta", "tail"):
        assert_same_bits(getattr(s_k, field), getattr(s_r, field), field)
    assert_same_bits(out_k, out_r, "decoded sum")
    # The decoded output is exactly what anyone decoding the re-quantized sum gets.
    assert_same_bits(jax_cgx.dequantize(s_k), out_k, "owner's copy vs everyone's")
    # And it is within the bound of the exact sum.
    exact = np.asarray(sum_plain(q, addend, "kernel"))
    m = n - n % 100 if config.skip_incomplete_buckets else n
    assert s_k.num_quantized == m
    err, bound = error_bound(exact, np.asarray(out_k), m, 100, bits, stochastic)
    assert np.all(err <= bound)


# -------------------------------------------------------------- hypothesis


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 3000),
    bits=st.integers(1, 8),
    bucket_size=st.sampled_from([1, 2, 3, 5, 8, 16, 31, 64, 100, 512]),
    dtype=st.sampled_from(DTYPES),
    stochastic=st.booleans(),
    skip=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_parity_and_bound(n, bits, bucket_size, dtype, stochastic, skip, seed):
    x = sample(n, dtype, seed=seed)
    config = CompressionConfig(
        bits=bits, bucket_size=bucket_size, stochastic=stochastic, skip_incomplete_buckets=skip, min_size=16)
    q, y = check_parity(x, config, key=jax.random.key(seed))
    m = n - n % bucket_size if skip else n
    assert q.num_quantized == m
    err, bound = error_bound(x, np.asarray(y), m, bucket_size, bits, stochastic)
    assert np.all(err <= bound)
    assert q.nbytes == jax_cgx.payload_bytes(m, bucket_size, bits) + 8 * q.meta.shape[0] + (n - m) * x.itemsize


@settings(max_examples=25, deadline=None)
@given(
    values=st.lists(
        st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True), min_size=1, max_size=200
    ),
    bits=st.integers(1, 8),
    bucket_size=st.sampled_from([1, 3, 16, 64]),
)
def test_property_parity_on_arbitrary_floats(values, bits, bucket_size):
    """Any f32 input, special values included, gives the same bytes on kernel and reference."""
    x = np.asarray(values, np.float32)
    _, y = check_parity(x, CompressionConfig(bits=bits, bucket_size=bucket_size, min_size=16))
    # What each bucket decodes to, from the data (not from the metadata under test): NaN where the
    # format says so; elsewhere infinities stay themselves and finite values stay finite.
    y = np.asarray(y)
    for k in range(0, x.size, bucket_size):
        xb, yb = x[k : k + bucket_size], y[k : k + bucket_size]
        if decodes_to_nan(xb, bits):
            assert np.all(np.isnan(yb)), (k, xb, yb)
        else:
            inf = np.isinf(xb)
            np.testing.assert_array_equal(yb[inf], xb[inf])
            assert np.all(np.isfinite(yb[~inf])), (k, xb, yb)


# ------------------------------------------------------------------ errors


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(TypeError, match="int32 cannot be quantized"):
        jax_cgx.quantize(jnp.arange(10), CompressionConfig(min_size=16))
    with pytest.raises(ValueError, match="bits=32 is not a quantization width"):
        jax_cgx.quantize(jnp.ones(10), CompressionConfig(bits=32))
    with pytest.raises(ValueError, match="impl must be one of"):
        jax_cgx.quantize(jnp.ones(10), CompressionConfig(min_size=16), impl="fast")
    with pytest.raises(ValueError, match="stack the W inputs"):
        jax_cgx.dequantize_sum(jax_cgx.quantize(jnp.ones(10)))
    with pytest.raises(TypeError, match="expected a jax_cgx.Quantized"):
        jax_cgx.dequantize(jnp.ones(10))


# ------------------------------------------------- every CPU kernel variant


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_every_cpu_isa_variant_gives_the_same_bytes(isa):
    """The run-time ISA choice (baseline x86-64, AVX2, AVX-512) never changes a bit."""
    from jax_cgx import _cpu

    if isa not in _cpu.kernel_info()["isa_supported"]:
        pytest.skip(f"this CPU has no {isa}")
    assert _cpu.set_isa(isa)
    try:
        x = sample(3001, jnp.bfloat16, seed=11)
        configs = [
            CompressionConfig(bits=bits, bucket_size=bucket, stochastic=stochastic, min_size=16)
            for bits, bucket, stochastic in [(1, 64, False), (3, 500, True), (4, 512, False), (7, 3, True), (8, 4096, False)]
        ]
        # The handler picks its variant each time it runs, so cached programs follow set_isa.
        check_parity_all(x, configs, key=jax.random.key(len(isa)))
        n, config = 1001, CompressionConfig(bits=5, bucket_size=100, min_size=16)
        q = _stack([jax_cgx.quantize(jnp.asarray(sample(n, jnp.float32, seed=s)), config) for s in range(3)])
        addend = jnp.asarray(sample(n, jnp.float16, seed=5))
        assert_same_bits(sum_plain(q, addend, "kernel"), sum_plain(q, addend, "reference"))
        s_k, o_k = sum_requantize(q, addend, KEY, True, "kernel")
        s_r, o_r = sum_requantize(q, addend, KEY, True, "reference")
        assert_same_bits(s_k.payload, s_r.payload)
        assert_same_bits(o_k, o_r)
    finally:
        _cpu.set_isa("auto")
