"""Pure-JAX reference of the codec: the test oracle and the fallback.

Every function transcribes xla_ffi/codec_math.h op for op, so that this code,
the CPU kernels and the CUDA kernels produce the same bytes. All functions work on
rows: ``x[R, n]``, ``payload[R, P]``, ``meta[R, nb, 2]`` (see xla_ffi/README.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_F32 = jnp.float32
_U32 = jnp.uint32
MAX_MAGNITUDE = np.float32(2.0**125)
MAX_FINITE = np.float32(np.finfo(np.float32).max)
WIDE_DOWN = np.float32(2.0**-4)
WIDE_UP = np.float32(16.0)
MIN_SCALE = np.float32(2.0**-100)
MIN_NORMAL = np.float32(2.0**-126)
FRAC_BITS = 23
FRAC_SCALE = np.float32(2.0**FRAC_BITS)
# Flags in the low 8 bits of a bucket's scale field (codec_math.h, docs/format.md).
FLAG_POS_INF, FLAG_NEG_INF, FLAG_WIDE, FLAG_MASK = 1, 2, 4, 0xFF


def max_level(bits: int) -> int:
    return (1 << bits) - 1


def level_step(bits: int) -> np.float32:
    return np.float32(1.0) / np.float32(max_level(bits))


def span_step(span, bits: int):
    """``f32(1 / span)`` per bucket, for the spans a bucket can have (``L``, ``L - 1``, ``L - 2``)."""
    top = max_level(bits)
    steps = [np.float32(1.0) / np.float32(k) if k > 0 else np.float32(0) for k in (top - 1, top - 2)]
    return jnp.where(span == top, level_step(bits), jnp.where(span == top - 1, steps[0], steps[1]))


def flush(x):
    return jnp.where(jnp.abs(x) < MIN_NORMAL, _F32(0), x)


def round_scale_up(s):
    u = lax.bitcast_convert_type(s, _U32)
    return lax.bitcast_convert_type((u + _U32(0xFF)) & _U32(0xFFFFFF00), _F32)


def _with_flags(scale, flags):
    return lax.bitcast_convert_type(lax.bitcast_convert_type(scale, _U32) | flags, _F32)


def meta_flags(scale_field):
    return lax.bitcast_convert_type(scale_field, _U32) & _U32(FLAG_MASK)


def meta_scale(scale_field):
    return lax.bitcast_convert_type(lax.bitcast_convert_type(scale_field, _U32) & _U32(~FLAG_MASK & 0xFFFFFFFF), _F32)


def _span(flags, bits: int):
    """Levels between the infinities' reserved ones (int32; may be negative)."""
    neg = ((flags & _U32(FLAG_NEG_INF)) != 0).astype(jnp.int32)
    pos = ((flags & _U32(FLAG_POS_INF)) != 0).astype(jnp.int32)
    return max_level(bits) - neg - pos


def make_meta(mn, mx, has_nan, pos_inf, neg_inf, bits: int):
    """Metadata of buckets whose finite values span ``[mn, mx]`` (``mn > mx``: none) and which hold
    a NaN, +inf, -inf (codec_math.h's ``make_meta(BucketRange)``)."""
    any_finite = mn <= mx
    flags = jnp.where(pos_inf, _U32(FLAG_POS_INF), _U32(0)) | jnp.where(neg_inf, _U32(FLAG_NEG_INF), _U32(0))
    span = _span(flags, bits)
    bad = has_nan | (any_finite & ((span < 0) | ((span == 0) & (mx > mn))))
    wide = any_finite & (~(mn >= -MAX_MAGNITUDE) | ~(mx <= MAX_MAGNITUDE))
    flags = flags | jnp.where(wide, _U32(FLAG_WIDE), _U32(0))
    mn = jnp.where(any_finite, jnp.where(wide, flush(mn * WIDE_DOWN), mn), _F32(0))
    mx = jnp.where(any_finite, jnp.where(wide, flush(mx * WIDE_DOWN), mx), _F32(0))
    s = round_scale_up((mx - mn) * span_step(span, bits))
    s = jnp.where(s > MIN_SCALE, s, MIN_SCALE)
    scale = _with_flags(jnp.where(mx > mn, s, _F32(0)), flags)
    nan = _F32(np.nan)
    return jnp.where(bad, nan, mn), jnp.where(bad, nan, scale)


def inverse_scale(scale):
    """``1 / scale`` correctly rounded (as C++ and nvcc divide), or 0 where ``scale <= 0``.

    Not written as a float division: XLA:GPU lowers f32 ``divide`` to PTX ``div.full``
    (``-nvptx-prec-divf32=1``), which may be off by an ulp, and an ulp here moves values
    across level boundaries. Scales are normal, in ``[MIN_SCALE, 2**126]`` (a range spans
    at most ``2**126``), so the reciprocal's significand is ``2**47 / M`` for the scale's
    24-bit significand ``M``: three exact steps of 32-bit long division, each bringing down
    8 more bits, rounded to nearest even from the remainder. NaN scales are never read.
    """
    u = lax.bitcast_convert_type(scale, _U32)
    exponent = (u >> 23) & _U32(0xFF)
    sig = (u & _U32(0x7FFFFF)) | _U32(0x800000)  # M in [2**23, 2**24)
    q = _U32(1 << 31) // sig  # 2**31 / M: in (2**7, 2**8]
    r = _U32(1 << 31) % sig
    for _ in range(2):  # remainders stay below 2**24, so r << 8 fits in 32 bits
        r = r << 8
        q = (q << 8) | (r // sig)
        r = r % sig
    # q = floor(2**47 / M): exactly 2**24 when M = 2**23 (a power-of-two scale), else 24 bits.
    up = (r << 1 > sig) | ((r << 1 == sig) & ((q & _U32(1)) == 1))
    q = q + up.astype(_U32)  # M > 2**23 keeps q below 2**24 - 1 before rounding: no carry out
    power = q >= _U32(1 << 24)
    bits = jnp.where(power, (_U32(254) - exponent) << 23, ((_U32(253) - exponent) << 23) | (q - _U32(1 << 23)))
    exact = lax.bitcast_convert_type(bits, _F32)
    # Outside the domain (never a scale of make_meta's) plain division, so that the function is total.
    inside = (scale >= MIN_NORMAL) & (scale <= _F32(2.0**126))
    return jnp.where(scale > 0, jnp.where(inside, exact, _F32(1) / scale), _F32(0))


def mix32(h):
    h = h ^ (h >> 16)
    h = h * _U32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * _U32(0xC2B2AE35)
    return h ^ (h >> 16)


def random_bits(seed0, seed1, index):
    return mix32(mix32(index ^ seed0) ^ seed1) >> (32 - FRAC_BITS)


def level_nearest(fixed):
    return (fixed + (1 << (FRAC_BITS - 1))).astype(_U32) >> FRAC_BITS


def level_stochastic(fixed, random23):
    f = fixed.astype(_U32)
    up = (f & _U32((1 << FRAC_BITS) - 1)) > random23
    return (f >> FRAC_BITS) + up.astype(_U32)


def decode(level, mn, scale):
    return flush(mn + level.astype(_F32) * scale)


def flagged_level(x, mn, inv, flags, bits: int, rnd=None):
    """codec_math.h's ``flagged_level`` (any flags, 0 included: then the plain levels)."""
    f = flush(x)
    neg = (flags & _U32(FLAG_NEG_INF)) != 0
    pos = (flags & _U32(FLAG_POS_INF)) != 0
    g = jnp.where((flags & _U32(FLAG_WIDE)) != 0, flush(f * WIDE_DOWN), f)
    top = jnp.maximum(_span(flags, bits), 0).astype(_F32)
    t = (flush(g) - mn) * inv
    t = jnp.where(t > 0, t, _F32(0))
    t = jnp.where(t < top, t, top)
    fixed = (t * FRAC_SCALE).astype(jnp.int32)
    level = level_nearest(fixed) if rnd is None else level_stochastic(fixed, rnd)
    level = level + neg.astype(_U32)
    level = jnp.where(pos & (f > MAX_FINITE), _U32(max_level(bits)), level)
    return jnp.where(neg & (f < -MAX_FINITE), _U32(0), level)


def decode_level(level, mn, scale_field, bits: int):
    """codec_math.h's ``decode_level``: any bucket's decoded value of a level."""
    flags = meta_flags(scale_field)
    neg = (flags & _U32(FLAG_NEG_INF)) != 0
    pos = (flags & _U32(FLAG_POS_INF)) != 0
    v = decode(level - neg.astype(_U32), mn, meta_scale(scale_field))
    up = v * WIDE_UP
    up = jnp.where(up < -MAX_FINITE, -MAX_FINITE, jnp.where(up > MAX_FINITE, MAX_FINITE, up))
    v = jnp.where((flags & _U32(FLAG_WIDE)) != 0, up, v)
    v = jnp.where(pos & (level == max_level(bits)), _F32(np.inf), v)
    return jnp.where(neg & (level == 0), _F32(-np.inf), v)


def accumulate(acc, v):
    return flush(acc + v)


# --------------------------------------------------------------- bucketing
#
# A row of m values is one piece of m // B whole buckets of B values, then (if
# m % B) one piece of a single shorter bucket. Values, indices, payload bytes and
# metadata are all cut into the same pieces.


def _layout(m: int, bucket_size: int):
    """``[(buckets, values per bucket)]`` for the pieces of a row of ``m`` values."""
    full, rest = divmod(m, bucket_size)
    return [(k, length) for k, length in ((full, bucket_size), (1 if rest else 0, rest)) if k]


def _split(a, m: int, bucket_size: int, unit):
    """Cut axis 1 of ``a`` into pieces ``[R, buckets, unit(values per bucket), ...]``."""
    pieces, start = [], 0
    for k, length in _layout(m, bucket_size):
        size = unit(length)
        pieces.append(a[:, start : start + k * size].reshape(a.shape[0], k, size, *a.shape[2:]))
        start += k * size
    return pieces


def _pack(levels, bits: int):
    """``levels[R, k, L]`` -> ``uint8[R, k, ceil(L*bits/8)]``, LSB-first bit stream per bucket."""
    r, k, length = levels.shape
    nbytes = -(-length * bits // 8)
    planes = (levels[..., None] >> jnp.arange(bits, dtype=_U32)) & _U32(1)
    stream = planes.astype(jnp.uint8).reshape(r, k, length * bits)
    stream = jnp.pad(stream, ((0, 0), (0, 0), (0, nbytes * 8 - length * bits)))
    weights = (1 << np.arange(8)).astype(np.uint8)
    return jnp.sum(stream.reshape(r, k, nbytes, 8) * weights, axis=-1, dtype=jnp.uint8)


def _unpack(packed, length: int, bits: int):
    """Inverse of :func:`_pack`: ``uint8[R, k, nbytes]`` -> ``uint32[R, k, length]``."""
    r, k, nbytes = packed.shape
    stream = (packed[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & jnp.uint8(1)
    stream = stream.reshape(r, k, nbytes * 8)[..., : length * bits]
    planes = stream.reshape(r, k, length, bits).astype(_U32)
    return jnp.sum(planes << jnp.arange(bits, dtype=_U32), axis=-1, dtype=_U32)


# -------------------------------------------------------------- the codec


def _bucket_ranges(v, inside, finite):
    """Each bucket's finite minimum and maximum and whether it holds a NaN, +inf, -inf (its real
    values, ``inside``): one reduction of five operands over the bucket axis, not five (a fifth of
    the XLA fusions, so of the compile time, of a quantize)."""
    operands = (jnp.where(finite, v, _F32(np.inf)), jnp.where(finite, v, _F32(-np.inf)),
                jnp.isnan(v) & inside, inside & (v > MAX_FINITE), inside & (v < -MAX_FINITE))
    inits = (_F32(np.inf), _F32(-np.inf), False, False, False)

    def combine(a, b):
        return (jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1]), a[2] | b[2], a[3] | b[3], a[4] | b[4])

    return lax.reduce(operands, inits, combine, (v.ndim - 1,))


def encode(values, seeds, valid=None, *, bits: int, bucket_size: int, stochastic: bool):
    """Quantize f32 rows ``values[R, m]``: returns ``payload[R, P]``, ``meta[R, nb, 2]``.

    ``valid[R]`` (None: ``m``): only row ``r``'s first ``valid[r]`` values set its buckets'
    ranges; the rest (padding) are encoded inside those ranges, never widening them.
    """
    r, m = values.shape
    if m == 0:
        return jnp.zeros((r, 0), jnp.uint8), jnp.zeros((r, 0, 2), _F32)
    values = flush(values)
    index = jnp.broadcast_to(jnp.arange(m, dtype=_U32), (r, m))
    same = lambda length: length  # noqa: E731
    payloads, metas = [], []
    for v, idx in zip(_split(values, m, bucket_size, same), _split(index, m, bucket_size, same)):
        inside = True if valid is None else idx.astype(jnp.int32) < valid.astype(jnp.int32)[:, None, None]
        finite = inside & (jnp.abs(v) <= MAX_FINITE)
        mn, mx, has_nan, pos_inf, neg_inf = _bucket_ranges(v, inside, finite)
        mn, scale = make_meta(mn, mx, has_nan, pos_inf, neg_inf, bits)
        rnd = random_bits(seeds[:, 0, None, None], seeds[:, 1, None, None], idx) if stochastic else None
        inv = inverse_scale(meta_scale(scale))[..., None]
        levels = flagged_level(v, mn[..., None], inv, meta_flags(scale)[..., None], bits, rnd)
        levels = jnp.where(jnp.isnan(mn)[..., None], _U32(0), levels)
        payloads.append(_pack(levels, bits).reshape(r, -1))
        metas.append(jnp.stack([mn, scale], axis=-1))
    return jnp.concatenate(payloads, axis=1), jnp.concatenate(metas, axis=1)


def decode_rows(payload, meta, *, m: int, bits: int, bucket_size: int):
    """f32 values ``[R, m]`` of packed rows ``payload[R, P]``, ``meta[R, nb, 2]``."""
    r = payload.shape[0]
    if m == 0:
        return jnp.zeros((r, 0), _F32)
    packed_pieces = _split(payload, m, bucket_size, lambda length: -(-length * bits // 8))
    meta_pieces = _split(meta, m, bucket_size, lambda length: 1)
    parts = []
    for (k, length), packed, mt in zip(_layout(m, bucket_size), packed_pieces, meta_pieces):
        levels = _unpack(packed, length, bits)
        parts.append(decode_level(levels, mt[:, :, 0, 0, None], mt[:, :, 0, 1, None], bits).reshape(r, -1))
    return jnp.concatenate(parts, axis=1)


def _sum(payload, meta, addend, *, m: int, bits: int, bucket_size: int):
    """f32 ``acc[R, m]``: ``flush(addend)`` (or 0) plus the W decoded inputs, in order."""
    r, w = payload.shape[:2]
    acc = jnp.zeros((r, m), _F32) if addend is None else flush(addend.astype(_F32))
    for i in range(w):
        acc = accumulate(acc, decode_rows(payload[:, i], meta[:, i], m=m, bits=bits, bucket_size=bucket_size))
    return acc


# ------------------------------------------------- the FFI targets, in JAX
#
# Each jitted: called eagerly (tests, a GPU without the CUDA extension) the hundreds of small
# ops would otherwise compile one by one, ~8x slower; inside a traced program it makes no
# difference.


@functools.partial(jax.jit, static_argnames=("bits", "bucket_size", "stochastic", "m"))
def quantize(x, seeds, valid=None, *, bits: int, bucket_size: int, stochastic: bool, m: int):
    """Target ``jax_cgx_quantize``: encodes the first ``m`` values of each row of ``x``."""
    return encode(x[:, :m].astype(_F32), seeds, valid, bits=bits, bucket_size=bucket_size, stochastic=stochastic)


def scale_output(v, scale: float):
    """``v * scale`` in float32, a subnormal product flushed to a zero of its sign (as XLA:CPU's
    FTZ does): a decoded value times the dequantize target's ``scale`` (``1/W`` for
    ``compressed_pmean``; codec_math.h's ``scale_output``)."""
    if scale == 1.0:
        return v
    r = v * _F32(scale)
    return jnp.where(jnp.abs(r) < MIN_NORMAL, jnp.copysign(_F32(0), r), r)


@functools.partial(jax.jit, static_argnames=("bits", "bucket_size", "m", "dtype", "scale"))
def dequantize(payload, meta, *, bits: int, bucket_size: int, m: int, dtype, scale: float = 1.0):
    """Target ``jax_cgx_dequantize``: the decoded values, times ``scale`` before their one
    rounding to ``dtype``."""
    decoded = decode_rows(payload, meta, m=m, bits=bits, bucket_size=bucket_size)
    return scale_output(decoded, scale).astype(dtype)


@functools.partial(jax.jit, static_argnames=("bits", "bucket_size", "m", "dtype"))
def dequantize_sum(payload, meta, addend, *, bits: int, bucket_size: int, m: int, dtype):
    """Target ``jax_cgx_dequantize_sum`` (``addend`` may be None)."""
    return _sum(payload, meta, addend, m=m, bits=bits, bucket_size=bucket_size).astype(dtype)


@functools.partial(jax.jit, static_argnames=("bits", "bucket_size", "stochastic", "m", "dtype"))
def dequantize_sum_requantize(
    payload, meta, addend, seeds, valid=None, *, bits: int, bucket_size: int, stochastic: bool, m: int, dtype
):
    """Target ``jax_cgx_dequantize_sum_requantize``: (payload, meta, decoded re-quantized sum)."""
    acc = _sum(payload, meta, addend, m=m, bits=bits, bucket_size=bucket_size)
    out_payload, out_meta = encode(acc, seeds, valid, bits=bits, bucket_size=bucket_size, stochastic=stochastic)
    out = decode_rows(out_payload, out_meta, m=m, bits=bits, bucket_size=bucket_size)
    return out_payload, out_meta, out.astype(dtype)
