"""Shared inputs and jitted entry points for the codec tests (CPU and GPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_cgx

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
BUCKETS = (1, 3, 64, 500, 512, 4096)
BITS = tuple(range(1, 9))
# Relative rounding of one value in each dtype (half an ulp, doubled for safety).
EPS = {np.dtype(jnp.float32): 2.0**-23, np.dtype(jnp.bfloat16): 2.0**-8, np.dtype(jnp.float16): 2.0**-10}


@functools.partial(jax.jit, static_argnames=("config", "impl"))
def roundtrip(x, key, config, impl):
    q = jax_cgx.quantize(x, config, key=key, impl=impl)
    return q, jax_cgx.dequantize(q, impl=impl)


@functools.partial(jax.jit, static_argnames=("configs", "impl"))
def roundtrip_all(x, key, configs, impl):
    """:func:`roundtrip` for several configs in one program (one compilation, not one each)."""
    out = []
    for config in configs:
        q = jax_cgx.quantize(x, config, key=key, impl=impl)
        out.append((q, jax_cgx.dequantize(q, impl=impl)))
    return out


@functools.partial(jax.jit, static_argnames=("impl",))
def sum_plain(q, addend, impl):
    return jax_cgx.dequantize_sum(q, addend, dtype=jnp.float32, impl=impl)


@functools.partial(jax.jit, static_argnames=("stochastic", "impl"))
def sum_requantize(q, addend, key, stochastic, impl):
    return jax_cgx.dequantize_sum_requantize(q, addend, stochastic=stochastic, key=key, impl=impl)


def sample(n: int, dtype, seed: int = 0) -> np.ndarray:
    """Values with varied scales per region, a constant stretch, and a zero stretch."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    x *= np.float32(10.0) ** rng.integers(-3, 4, size=n).astype(np.float32)
    if n >= 40:
        x[5:25] = np.float32(1.5)
        x[25:35] = 0.0
    return np.array(jnp.asarray(x, dtype))  # a writable copy


def flushed(x) -> np.ndarray:
    """The values the codec quantizes, as float64: subnormals and -0 flushed to +0 (docs/format.md)."""
    x64 = np.asarray(x, np.float64)
    return np.where(np.abs(x64) < 2.0**-126, 0.0, x64)


def decodes_to_nan(values, bits: int) -> bool:
    """Whether a bucket of ``values`` decodes to NaN, from the data (docs/format.md, "Metadata"): it
    holds a NaN, or its infinities leave its distinct finite values no step (``span < 0``, or
    ``span == 0`` with ``mx > mn``; ``span = 2^bits - 1`` less one per sign of infinity present)."""
    v = flushed(values)
    finite = v[np.isfinite(v)]
    span = (1 << bits) - 1 - int(np.any(v == np.inf)) - int(np.any(v == -np.inf))
    spread = finite.size > 0 and finite.max() > finite.min()
    return bool(np.any(np.isnan(v)) or (finite.size and (span < 0 or (span == 0 and spread))))


def step_bound(spread, bits: int, span=None):
    """An upper bound of a bucket's scale from the range of its finite values, never from the codec.

    docs/format.md, "Error": ``scale <= (mx - mn) / span * (1 + 2^-15)`` (``span = 2^bits - 1``
    levels between finite values; the factor is the scale's rounding up to 16 significant
    bits), and at least the floor ``2^-100`` when ``mx > mn``; 0 for a degenerate bucket.
    """
    span = (1 << bits) - 1 if span is None else span
    spread = np.asarray(spread, np.float64)
    return np.where(spread > 0, np.maximum(spread / span * (1 + 2.0**-15), 2.0**-100), 0.0)


def bucket_scales(x, m: int, bucket_size: int, bits: int) -> np.ndarray:
    """An upper bound of the scale of the bucket holding each of the first m values, from the data:
    the bucket's range over ``2^bits - 1`` levels (:func:`step_bound`). Finite inputs only (the
    whole range, infinities and NaN: tests/codec/test_range.py)."""
    x64 = flushed(np.asarray(x).reshape(-1)[:m])
    assert np.all(np.isfinite(x64)), "bucket_scales: finite inputs only"
    buckets = -(-m // bucket_size)
    padded = np.full(buckets * bucket_size, np.nan)
    padded[:m] = x64
    padded = padded.reshape(buckets, bucket_size)
    with np.errstate(invalid="ignore"):
        spread = np.nanmax(padded, axis=1, initial=-np.inf) - np.nanmin(padded, axis=1, initial=np.inf)
    return np.repeat(step_bound(spread, bits), bucket_size)[:m]


def error_bound(x, out, m, bucket_size, bits, stochastic):
    """Per-element ``|decoded - x|`` and its bound (docs/format.md, "Error"), scales from the data:
    scale/2 (nearest) or scale (stochastic), plus f32 rounding (1e-4 of the scale), the output dtype's
    rounding, and the flush of values below 2^-126."""
    scale = bucket_scales(x, m, bucket_size, bits)
    x64 = np.asarray(np.asarray(x).reshape(-1)[:m], np.float64)
    out64 = np.asarray(np.asarray(out).reshape(-1)[:m], np.float64)
    # The decoded value is rounded once to the output's dtype.
    rounding = EPS[np.dtype(out.dtype)] * np.maximum(np.abs(x64), np.abs(out64)) + 2.0**-125
    factor = 1.0 if stochastic else 0.5
    return np.abs(out64 - x64), scale * (factor + 1e-4) + rounding
