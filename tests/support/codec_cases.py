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


def bucket_scales(meta, m: int, bucket_size: int) -> np.ndarray:
    """The scale of the bucket holding each of the first m values."""
    return np.repeat(np.asarray(meta[:, 1], np.float64), bucket_size)[:m]


def error_bound(x, out, meta, m, bucket_size, stochastic):
    """Per-element bound: scale/2 (nearest) or scale (stochastic), plus f32/dtype rounding."""
    scale = bucket_scales(meta, m, bucket_size)
    x64 = np.asarray(x[:m], np.float64)
    out64 = np.asarray(out[:m], np.float64)
    # The decoded value is rounded once to the output's dtype.
    rounding = EPS[np.dtype(out.dtype)] * np.maximum(np.abs(x64), np.abs(out64))
    factor = 1.0 if stochastic else 0.5
    return np.abs(out64 - x64), scale * (factor + 1e-4) + rounding
