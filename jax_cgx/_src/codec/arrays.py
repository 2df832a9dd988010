"""The public codec: quantize, dequantize, and the sums the all-reduce needs, on whole arrays.

Each function runs the compiled FFI kernels (``impl="kernel"``), the pure-JAX
reference (``impl="reference"``), or the kernel where one exists for the platform
and the reference elsewhere (``impl="auto"``, the default). All three give the same
bytes. Everything is jittable and vmappable.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_cgx._src import compat
from jax_cgx._src.arguments import check_bool
from jax_cgx._src.codec import reference
from jax_cgx._src.codec.kernels import Impl, check_impl
from jax_cgx._src.codec.quantized import Quantized, num_buckets, payload_bytes, quantized_elements
from jax_cgx._src.codec.rows import dequantize_rows, dequantize_sum_requantize_rows, dequantize_sum_rows, quantize_rows
from jax_cgx._src.config import QUANTIZED_BITS, CompressionConfig

__all__ = ["quantize", "dequantize", "dequantize_sum", "dequantize_sum_requantize", "check_float_dtype",
           "rounding_seeds", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
# Element indices inside a row feed a 32-bit counter hash.
_MAX_ROW = 2**32 - 1


def check_float_dtype(dtype, what: str) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{what}: dtype {dtype} cannot be quantized; jax_cgx compresses float32, "
            "bfloat16 and float16 arrays (cast first, or reduce integer arrays with an "
            "uncompressed lax.psum)"
        )
    return dtype


def rounding_seeds(key, shape: tuple[int, ...], stochastic: bool) -> jax.Array:
    """``uint32[shape]`` seed words for the kernels (pairs: the two 32-bit words the counter-based
    hash uses): drawn from ``key`` for stochastic rounding; zeros for round-to-nearest, which reads
    none, or without a key. So a program rounding to nearest holds no PRNG computation even when a
    key is passed (threefry's loops are a fifth of a small reduction's compiled fusions)."""
    if stochastic and key is not None:
        return jax.random.bits(key, shape, jnp.uint32)
    return jnp.zeros(shape, jnp.uint32)


def _seeds(key, stochastic: bool, what: str) -> jax.Array:
    if stochastic and key is None:
        raise ValueError(
            f"{what}: stochastic rounding needs a PRNG key; pass key=jax.random.key(...) "
            "(or set stochastic=False)"
        )
    return rounding_seeds(key, (2,), stochastic)


# ---------------------------------------------------------- public API


def quantize(
    x: jax.Array, config: CompressionConfig | None = None, *, key=None, impl: Impl = "auto"
) -> Quantized:
    """Compress ``x`` (float32, bfloat16 or float16, any shape) with bucketed max-min quantization.

    Args:
      x: the array.
      config: ``bits`` (1..8), ``bucket_size``, ``stochastic`` and
        ``skip_incomplete_buckets`` are used; defaults to ``CompressionConfig()``.
      key: a ``jax.random`` key, required when ``config.stochastic``.
      impl: ``"auto"``, ``"kernel"`` or ``"reference"``.

    Returns:
      A :class:`Quantized` pytree; :func:`dequantize` restores an array of ``x``'s
      shape and dtype.

    Raises:
      TypeError: ``config`` not a :class:`~jax_cgx.CompressionConfig`; ``x`` not float32, bfloat16 or
        float16; ``key`` not one PRNG key.
      ValueError: ``config.bits`` outside 1..8; an unknown ``impl``; more than 2^32 - 1 values; a
        stochastic config without ``key``.

    Its gradient is zero, as ``jnp.round``'s is; a straight-through estimate is
    ``x + jax.lax.stop_gradient(dequantize(quantize(x)) - x)``.

    Examples:
      >>> x = jnp.linspace(-1.0, 1.0, 1024)
      >>> q = jax_cgx.quantize(x, jax_cgx.CompressionConfig(bits=4, bucket_size=256))
      >>> q.payload.shape, q.meta.shape  # 4 bits per value; (min, scale) per bucket
      ((512,), (4, 2))
      >>> bool(jnp.max(jnp.abs(jax_cgx.dequantize(q) - x)) <= (0.5 / 15) / 2 * 1.0001)  # half a step
      True
    """
    config = CompressionConfig() if config is None else config
    if not isinstance(config, CompressionConfig):
        raise TypeError(f"quantize: config must be a CompressionConfig, got {type(config).__name__}")
    if not config.quantizes:
        raise ValueError(
            f"quantize: config.bits={config.bits} is not a quantization width; use 1..8 "
            "(16 and 32 only make sense for the all-reduce)"
        )
    check_impl(impl)
    compat.check_prng_key(key, "quantize")
    x = jnp.asarray(x)
    dtype = check_float_dtype(x.dtype, "quantize")
    # Rounding to levels: a zero gradient, as jnp.round has, on every implementation (the kernels
    # have no differentiation rule; the reference's gradient would flow through the bucket minimum).
    x = jax.lax.stop_gradient(x)
    n = math.prod(x.shape)
    if n > _MAX_ROW:
        raise ValueError(f"quantize: {n} elements exceed the per-array limit of {_MAX_ROW}")
    m = quantized_elements(n, config.bucket_size, config.skip_incomplete_buckets)
    seeds = _seeds(key, config.stochastic, "quantize")
    rows = x.reshape(1, n)
    payload, meta = quantize_rows(
        rows,
        seeds[None],
        bits=config.bits,
        bucket_size=config.bucket_size,
        stochastic=config.stochastic,
        m=m,
        impl=impl,
    )
    return Quantized(
        payload=payload[0],
        meta=meta[0],
        tail=rows[0, m:],
        shape=tuple(x.shape),
        dtype=dtype,
        bits=config.bits,
        bucket_size=config.bucket_size,
    )


def _check_quantized(q, what: str, stacked: bool) -> None:
    """Check that ``q``'s arrays and static fields agree, before any implementation runs.

    The kernels and the reference would otherwise fail differently (or not at all) on a
    ``Quantized`` whose fields were changed by hand.
    """
    if not isinstance(q, Quantized):
        raise TypeError(f"{what}: expected a jax_cgx.Quantized, got {type(q).__name__}")
    want = 2 if stacked else 1
    if q.payload.ndim != want:
        raise ValueError(
            f"{what}: payload has shape {q.payload.shape}; expected {want} dimension(s)"
            + (" (stack the W inputs along a leading axis)" if stacked else "")
        )

    def bad(problem: str):
        return ValueError(
            f"{what}: inconsistent Quantized: {problem}. Pass a Quantized as jax_cgx.quantize "
            "returns it: its static fields (shape, dtype, bits, bucket_size) describe its arrays "
            "(payload, meta, tail) and must not be changed on their own (docs/format.md)"
        )

    if isinstance(q.bits, bool) or not isinstance(q.bits, (int, np.integer)) or q.bits not in QUANTIZED_BITS:
        raise bad(f"bits={q.bits!r}, expected {QUANTIZED_BITS.start}..{QUANTIZED_BITS.stop - 1}")
    if isinstance(q.bucket_size, bool) or not isinstance(q.bucket_size, (int, np.integer)) or q.bucket_size < 1:
        raise bad(f"bucket_size={q.bucket_size!r}, expected an int >= 1")
    shape = q.shape
    if not isinstance(shape, tuple) or not all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise bad(f"shape={shape!r}, expected a tuple of non-negative ints")
    try:
        dtype = np.dtype(q.dtype)
    except TypeError:
        raise bad(f"dtype={q.dtype!r} is not a dtype") from None
    if dtype not in SUPPORTED_DTYPES:
        raise bad(f"dtype={dtype}, expected float32, bfloat16 or float16")
    if np.dtype(q.tail.dtype) != dtype:
        raise bad(f"dtype={dtype} but the tail holds {np.dtype(q.tail.dtype)} values")
    if np.dtype(q.payload.dtype) != np.uint8:
        raise bad(f"payload is {np.dtype(q.payload.dtype)}, expected uint8")
    if np.dtype(q.meta.dtype) != np.float32:
        raise bad(f"meta is {np.dtype(q.meta.dtype)}, expected float32")
    batch = q.payload.shape[:-1]
    if q.meta.ndim != want + 1 or q.meta.shape[:-2] != batch or q.meta.shape[-1] != 2:
        raise bad(f"meta has shape {q.meta.shape}, expected {batch + ('num_buckets', 2)}")
    if q.tail.ndim != want or q.tail.shape[:-1] != batch:
        raise bad(f"tail has shape {q.tail.shape}, expected {batch + ('tail_length',)}")
    n, t = math.prod(shape), q.tail.shape[-1]
    if t not in (0, n % q.bucket_size):
        raise bad(
            f"tail holds {t} values; {n} values (shape {shape}) in buckets of {q.bucket_size} "
            f"leave 0 or {n % q.bucket_size} uncompressed"
        )
    m = n - t
    p, nb = payload_bytes(m, q.bucket_size, q.bits), num_buckets(m, q.bucket_size)
    if q.payload.shape[-1] != p or q.meta.shape[-2] != nb:
        raise bad(
            f"{m} quantized values at bits={q.bits}, bucket_size={q.bucket_size} take {p} payload "
            f"bytes and {nb} buckets, but payload has {q.payload.shape[-1]} bytes and meta "
            f"{q.meta.shape[-2]} buckets"
        )


def dequantize(q: Quantized, *, impl: Impl = "auto") -> jax.Array:
    """The array ``q`` encodes, in its original shape and dtype.

    Args:
      q: what :func:`~jax_cgx.quantize` returned (or a slice of a stacked one).
      impl: the codec implementation: ``"auto"``, ``"kernel"`` or ``"reference"`` (bitwise the same).

    Returns:
      The decoded array: each value ``min + level * scale`` of its bucket.

    Raises:
      TypeError: ``q`` not a :class:`Quantized`.
      ValueError: ``q``'s fields disagreeing with each other (a ``Quantized`` changed by hand, or a
        stacked one); an unknown ``impl``.
    """
    _check_quantized(q, "dequantize", stacked=False)
    check_impl(impl)
    out = dequantize_rows(
        q.payload[None], q.meta[None], bits=q.bits, bucket_size=q.bucket_size, m=q.num_quantized,
        dtype=q.dtype, impl=impl,
    )
    return jnp.concatenate([out[0], q.tail]).reshape(q.shape)


def _split_addend(addend, q: Quantized, m: int):
    if addend is None:
        return jnp.zeros((1, 0), q.dtype), None
    addend = jnp.asarray(addend)
    check_float_dtype(addend.dtype, "addend")
    if addend.shape != tuple(q.shape):
        raise ValueError(f"addend has shape {addend.shape}; expected {tuple(q.shape)}")
    flat = addend.reshape(1, -1)
    return flat[:, :m], flat[0, m:]


def _sum_tails(tails, addend_tail):
    """The uncompressed tails, accumulated exactly like the kernel accumulates values."""
    acc = jnp.zeros(tails.shape[1:], jnp.float32)
    if addend_tail is not None:
        acc = reference.flush(addend_tail.astype(jnp.float32))
    for i in range(tails.shape[0]):
        # Flushed first, as every input value is (docs/format.md): a subnormal tail value must not
        # depend on the processor's flush-to-zero mode (XLA:CPU's DAZ read it as 0, CUDA does not).
        acc = reference.accumulate(acc, reference.flush(tails[i].astype(jnp.float32)))
    return acc


def dequantize_sum(
    q: Quantized, addend: jax.Array | None = None, *, dtype=None, impl: Impl = "auto"
) -> jax.Array:
    """Decode W stacked arrays and sum them (plus ``addend``), accumulating in float32.

    ``q`` holds W encodings stacked along a leading axis (e.g. from ``jax.vmap(quantize)``).
    The sum is taken in a fixed order (``addend`` first, then inputs 0..W-1), so
    every device computing it gets the same bits. Returns ``q.shape`` in ``dtype``
    (default ``q.dtype``).

    Args:
      q: W encodings of arrays of one shape and config, stacked along a leading axis.
      addend: an array of ``q.shape`` (float32, bfloat16 or float16) added first; None (the default):
        nothing.
      dtype: the result's dtype, float32, bfloat16 or float16; None (the default): ``q.dtype``.
      impl: the codec implementation: ``"auto"``, ``"kernel"`` or ``"reference"`` (bitwise the same).

    Returns:
      The sum, an array of shape ``q.shape`` in ``dtype``.

    Raises:
      TypeError: ``q`` not a :class:`Quantized`; ``addend`` or ``dtype`` not a float type the codec
        takes.
      ValueError: ``q`` not stacked, or its fields disagreeing with each other; ``addend`` not of
        shape ``q.shape``; an unknown ``impl``.
    """
    _check_quantized(q, "dequantize_sum", stacked=True)
    check_impl(impl)
    dtype = check_float_dtype(q.dtype if dtype is None else dtype, "dequantize_sum")
    m = q.num_quantized
    head, tail = _split_addend(addend, q, m)
    out = dequantize_sum_rows(
        q.payload[None], q.meta[None], head, bits=q.bits, bucket_size=q.bucket_size, m=m, dtype=dtype,
        impl=impl,
    )
    tail_sum = _sum_tails(q.tail, tail).astype(dtype)
    return jnp.concatenate([out[0], tail_sum]).reshape(q.shape)


def dequantize_sum_requantize(
    q: Quantized,
    addend: jax.Array | None = None,
    *,
    stochastic: bool = False,
    key=None,
    impl: Impl = "auto",
) -> tuple[Quantized, jax.Array]:
    """Sum W stacked encodings (plus ``addend``) and re-quantize the float32 sum.

    This is the owner's step of the SRA all-reduce (docs/algorithm.md): returns the
    re-quantized sum (same bits and bucket size) and its decoded value, which is what
    every replica will decode from it.

    Args:
      q: W encodings of arrays of one shape and config, stacked along a leading axis.
      addend: an array of ``q.shape`` (float32, bfloat16 or float16) added first; None (the default):
        nothing.
      stochastic: re-quantize with stochastic rounding (then ``key`` is needed) instead of
        round-to-nearest.
      key: a PRNG key, for ``stochastic=True``.
      impl: the codec implementation: ``"auto"``, ``"kernel"`` or ``"reference"`` (bitwise the same).

    Returns:
      ``(summed, decoded)``: ``summed`` a :class:`Quantized` of one array (not stacked) with ``q``'s
      shape, dtype, bits and bucket size, its tail the exact sum of the tails; ``decoded`` what
      :func:`dequantize` gives for ``summed``, an array of ``q.shape`` in ``q.dtype``.

    Raises:
      TypeError: ``q`` not a :class:`Quantized`; ``addend`` not a float type the codec takes; ``key``
        not one PRNG key.
      ValueError: ``stochastic`` not a bool, or True without ``key``; ``q`` not stacked, or its fields
        disagreeing with each other; ``addend`` not of shape ``q.shape``; an unknown ``impl``.
    """
    stochastic = check_bool("dequantize_sum_requantize", "stochastic", stochastic)
    _check_quantized(q, "dequantize_sum_requantize", stacked=True)
    check_impl(impl)
    compat.check_prng_key(key, "dequantize_sum_requantize")
    m = q.num_quantized
    head, tail = _split_addend(addend, q, m)
    seeds = _seeds(key, stochastic, "dequantize_sum_requantize")
    payload, meta, out = dequantize_sum_requantize_rows(
        q.payload[None], q.meta[None], head, seeds[None], bits=q.bits, bucket_size=q.bucket_size,
        stochastic=stochastic, m=m, dtype=q.dtype, impl=impl,
    )
    tail_sum = _sum_tails(q.tail, tail).astype(q.dtype)
    summed = Quantized(
        payload=payload[0],
        meta=meta[0],
        tail=tail_sum,
        shape=q.shape,
        dtype=q.dtype,
        bits=q.bits,
        bucket_size=q.bucket_size,
    )
    return summed, jnp.concatenate([out[0], tail_sum]).reshape(q.shape)
