// The jax_cgx codec, element by element.
//
// This header is the single definition of the codec's arithmetic. The CPU
// kernels, the CUDA kernels and (transcribed op for op) the pure-JAX reference
// in jax_cgx/_src/codec/reference.py all follow it, and docs/format.md explains it. Every
// function here is written so that its result does not depend on:
//   * FMA contraction: the only product that feeds an addition
//     (level * scale in decode) is exact, because `scale` carries at most 16
//     significant bits and `level` at most 8;
//   * flush-to-zero / denormals-are-zero modes (XLA:CPU runs with FTZ/DAZ,
//     CUDA without): every value that could be subnormal is flushed to +0
//     explicitly, and the ranges are chosen so that no other intermediate
//     can become subnormal;
//   * divisions a compiler might rewrite: the only division is 1 / scale,
//     once per bucket; range / levels is written as a multiplication by the
//     f32 constant 1/levels (XLA rewrites x / broadcast(c) as x * (1/c)).
// Build without -ffast-math / --use_fast_math; NaN payloads are the only bits
// left unspecified.
#ifndef JAX_CGX_CODEC_MATH_H_
#define JAX_CGX_CODEC_MATH_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define CGX_HD __host__ __device__ __forceinline__
#else
#define CGX_HD inline
#endif

namespace jax_cgx {

// Finite bucket values beyond this magnitude make a bucket *wide*: its finite
// values are encoded scaled by kWideDown (exact for normal results), which
// brings them within it. It keeps every intermediate (range, scale, 1/scale)
// a normal f32.
constexpr float kMaxMagnitude = 0x1p125f;
constexpr float kWideDown = 0x1p-4f;
constexpr float kWideUp = 16.0f;
constexpr float kMaxFinite = 0x1.fffffep127f;
// Flags in the low 8 bits of a bucket's scale field, which a scale never uses
// (round_scale_up clears them): 0 for every bucket of finite values within
// kMaxMagnitude, so such buckets read exactly as before the flags existed.
constexpr uint32_t kFlagPosInf = 1u;  // level 2^bits-1 decodes to +inf
constexpr uint32_t kFlagNegInf = 2u;  // level 0 decodes to -inf
constexpr uint32_t kFlagWide = 4u;    // finite values are encoded scaled by kWideDown
constexpr uint32_t kFlagMask = 0xFFu;
// Smallest non-zero scale. With it, 1/scale <= 2^100 and any subnormal
// difference x - min maps to a level fraction below 2^-23, i.e. zero.
constexpr float kMinScale = 0x1p-100f;
// Smallest normal f32; anything smaller in magnitude is flushed to +0.
constexpr float kMinNormal = 0x1p-126f;
// Levels are computed in fixed point with this many fractional bits.
constexpr int kFracBits = 23;
constexpr float kFracScale = 8388608.0f;  // 2^kFracBits

CGX_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

CGX_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// The canonical NaN written into the metadata of a non-finite bucket.
CGX_HD float canonical_nan() { return bits_float(0x7FC00000u); }

CGX_HD float abs_f32(float x) { return bits_float(float_bits(x) & 0x7FFFFFFFu); }

// Subnormals (and -0) become +0; NaN stays NaN.
CGX_HD float flush(float x) { return abs_f32(x) < kMinNormal ? 0.0f : x; }

CGX_HD uint32_t max_level(int bits) { return (1u << bits) - 1u; }

// 1 / max_level(bits), correctly rounded to f32 (a constant per width).
CGX_HD float level_step(int bits) { return 1.0f / static_cast<float>(max_level(bits)); }

// Bytes taken by `count` densely packed `bits`-bit levels.
CGX_HD int64_t packed_bytes(int64_t count, int bits) {
  return (count * bits + 7) / 8;
}

// ------------------------------------------------------------ parameters and row layout

// The widths the codec has: 1..8 bits per value (Python's 16 and 32 are lanes that never reach a
// kernel; jax_cgx/_src/config/limits.py's QUANTIZED_BITS is this range, checked equal by
// tests/codec/test_build.py through the extensions' `codec_bits`).
constexpr int kMinBits = 1;
constexpr int kMaxBits = 8;

CGX_HD bool valid_bits(int64_t bits) { return bits >= kMinBits && bits <= kMaxBits; }

// Buckets of `bucket_size` values (>= 1) that `m` values fill: ceil(m / bucket_size).
CGX_HD int64_t bucket_count(int64_t m, int64_t bucket_size) {
  return m / bucket_size + (m % bucket_size != 0 ? 1 : 0);
}

// Payload bytes of one row of `m` values (docs/format.md): each bucket's levels packed on their own,
// the last bucket holding what is left.
CGX_HD int64_t row_payload_bytes(int64_t m, int64_t bucket_size, int bits) {
  const int64_t nb = bucket_count(m, bucket_size);
  if (nb == 0) return 0;
  if (nb == 1) return packed_bytes(m, bits);
  // nb >= 2 means bucket_size < m: the products below cannot overflow.
  return (nb - 1) * packed_bytes(bucket_size, bits) + packed_bytes(m - (nb - 1) * bucket_size, bits);
}

// Round a positive finite f32 up to 16 significant bits (clear the low 8
// mantissa bits, rounding towards +inf), so that level * scale is exact.
CGX_HD float round_scale_up(float s) {
  return bits_float((float_bits(s) + 0xFFu) & ~0xFFu);
}

// Per-bucket metadata, stored as two f32 in this order. `scale` is the scale
// field: the scale with the bucket's flags in its low 8 bits.
struct BucketMeta {
  float min;
  float scale;
};

CGX_HD uint32_t meta_flags(float scale_field) { return float_bits(scale_field) & kFlagMask; }
// The scale itself (0, or a normal float with 16 significant bits; NaN stays NaN).
CGX_HD float meta_scale(float scale_field) { return bits_float(float_bits(scale_field) & ~kFlagMask); }

// What a bucket's values set: min and max of its finite flushed values
// (mn > mx when there is none), and whether it held a NaN, +inf or -inf.
struct BucketRange {
  float mn = bits_float(0x7F800000u);
  float mx = bits_float(0xFF800000u);
  bool nan = false, pos_inf = false, neg_inf = false;
};

CGX_HD void range_add(BucketRange& r, float x) {
  const float f = flush(x);
  if (f != f) {
    r.nan = true;
  } else if (abs_f32(f) > kMaxFinite) {
    (f > 0.0f ? r.pos_inf : r.neg_inf) = true;
  } else {
    r.mn = f < r.mn ? f : r.mn;
    r.mx = f > r.mx ? f : r.mx;
  }
}

// f32(1 / span): a constant per width when span == max_level(bits).
CGX_HD float span_step(int span, int bits) {
  return span == static_cast<int>(max_level(bits)) ? level_step(bits) : 1.0f / static_cast<float>(span);
}

// Metadata of a bucket (docs/format.md, "Metadata"):
//   * a NaN, or infinities that leave no level for distinct finite values
//     (1-bit buckets), make it a NaN bucket (min and scale NaN): decodes to NaN;
//   * +inf takes level 2^bits-1 and -inf level 0 (flags), the finite values
//     the levels between: span = max_level - #infinity signs of them;
//   * finite values beyond +-kMaxMagnitude make it wide (flag): min and scale
//     then describe the finite values times kWideDown;
//   * no element at all (every element is padding): (0, 0), decodes to zeros.
CGX_HD BucketMeta make_meta(const BucketRange& r, int bits) {
  BucketMeta m;
  const bool any_finite = r.mn <= r.mx;
  const int span = static_cast<int>(max_level(bits)) - (r.neg_inf ? 1 : 0) - (r.pos_inf ? 1 : 0);
  if (r.nan || (any_finite && (span < 0 || (span == 0 && r.mx > r.mn)))) {
    m.min = canonical_nan();
    m.scale = canonical_nan();
    return m;
  }
  uint32_t flags = (r.pos_inf ? kFlagPosInf : 0u) | (r.neg_inf ? kFlagNegInf : 0u);
  float mn = 0.0f, mx = 0.0f;
  if (any_finite) {
    mn = r.mn;
    mx = r.mx;
    if (!(mn >= -kMaxMagnitude) || !(mx <= kMaxMagnitude)) {
      flags |= kFlagWide;
      mn = flush(mn * kWideDown);
      mx = flush(mx * kWideDown);
    }
  }
  m.min = mn;
  float s = 0.0f;  // degenerate bucket (or none finite): every finite element decodes to min exactly
  if (mx > mn) {
    // range <= 2^126, so nothing overflows. A subnormal product (or its FTZ
    // zero) ends at kMinScale either way. Rounding up to 16 bits leaves
    // span * scale >= range in all but f32-rounding corner cases, which
    // the clamp in fixed_position absorbs.
    s = round_scale_up((mx - mn) * span_step(span, bits));
    s = s > kMinScale ? s : kMinScale;
  }
  m.scale = bits_float(float_bits(s) | flags);
  return m;
}

// The same for a range of finite values only (mn > mx: empty).
CGX_HD BucketMeta make_meta(float mn, float mx, bool has_nan, int bits) {
  BucketRange r;
  r.mn = mn;
  r.mx = mx;
  r.nan = has_nan;
  return make_meta(r, bits);
}

// 1/scale, or 0 for a degenerate (or non-finite) bucket. Takes meta_scale(field)
// (the same bits as the field when the bucket has no flags).
CGX_HD float inverse_scale(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

// Counter-based hash: murmur3's 32-bit finalizer.
CGX_HD uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// 23 uniformly distributed random bits for element `index` of a row quantized
// with seed words (seed0, seed1).
CGX_HD uint32_t random_bits(uint32_t seed0, uint32_t seed1, uint32_t index) {
  return mix32(mix32(index ^ seed0) ^ seed1) >> (32 - kFracBits);
}

// Fixed-point position of x inside its bucket: floor(t * 2^23) where
// t = clamp((flush(x) - min) * inv_scale, 0, max_level). t <= 255 so the
// result fits in int32; the conversion truncates.
CGX_HD int32_t fixed_position(float x, float mn, float inv_scale, float max_level_f) {
  float t = (flush(x) - mn) * inv_scale;
  t = t > 0.0f ? t : 0.0f;
  t = t < max_level_f ? t : max_level_f;
  return static_cast<int32_t>(t * kFracScale);
}

// Nearest rounding (ties away from zero, i.e. floor(t + 1/2), computed exactly).
CGX_HD uint32_t level_nearest(int32_t fixed) {
  return static_cast<uint32_t>(fixed + (1 << (kFracBits - 1))) >> kFracBits;
}

// Stochastic rounding: up with probability equal to the fractional part.
CGX_HD uint32_t level_stochastic(int32_t fixed, uint32_t random23) {
  uint32_t f = static_cast<uint32_t>(fixed);
  return (f >> kFracBits) + ((f & ((1u << kFracBits) - 1u)) > random23 ? 1u : 0u);
}

// Decoded value of a level. level * scale is exact, so a fused multiply-add
// gives the same bits as a separate multiply and add.
CGX_HD float decode(uint32_t level, float mn, float scale) {
  return flush(mn + static_cast<float>(level) * scale);
}

// A flagged bucket's level of x (meta_flags(scale_field) != 0; see make_meta):
// infinities to their reserved levels, finite values (scaled if wide) between
// them with the usual fixed-point rounding. inv = inverse_scale(meta_scale(field)).
CGX_HD uint32_t flagged_level(float x, float mn, float inv, uint32_t flags, int bits, bool stochastic,
                              uint32_t random23) {
  float f = flush(x);
  if ((flags & kFlagPosInf) != 0u && f > kMaxFinite) return max_level(bits);
  if ((flags & kFlagNegInf) != 0u && f < -kMaxFinite) return 0u;
  if ((flags & kFlagWide) != 0u) f = flush(f * kWideDown);
  const int span = static_cast<int>(max_level(bits)) - ((flags & kFlagNegInf) != 0u ? 1 : 0) -
                   ((flags & kFlagPosInf) != 0u ? 1 : 0);
  const int32_t fixed = fixed_position(f, mn, inv, static_cast<float>(span > 0 ? span : 0));
  const uint32_t level = stochastic ? level_stochastic(fixed, random23) : level_nearest(fixed);
  return level + ((flags & kFlagNegInf) != 0u ? 1u : 0u);
}

// A flagged bucket's decoded value of a level: +-inf for the reserved levels,
// else decode() of the finite part, scaled back (kept finite) if wide.
CGX_HD float flagged_decode(uint32_t level, float mn, float scale, uint32_t flags, int bits) {
  if ((flags & kFlagPosInf) != 0u && level == max_level(bits)) return bits_float(0x7F800000u);
  if ((flags & kFlagNegInf) != 0u) {
    if (level == 0u) return bits_float(0xFF800000u);
    level -= 1u;
  }
  float v = decode(level, mn, scale);
  if ((flags & kFlagWide) != 0u) {
    v = v * kWideUp;  // exact, but past the largest finite float when the range ends near it
    v = v < -kMaxFinite ? -kMaxFinite : (v > kMaxFinite ? kMaxFinite : v);
  }
  return v;
}

// Any bucket's level of x (scalar; the kernels branch per bucket instead).
CGX_HD uint32_t encode_level(float x, const BucketMeta& m, int bits, bool stochastic, uint32_t random23) {
  if (m.min != m.min) return 0u;  // NaN bucket
  const uint32_t flags = meta_flags(m.scale);
  const float inv = inverse_scale(meta_scale(m.scale));
  if (flags != 0u) return flagged_level(x, m.min, inv, flags, bits, stochastic, random23);
  const int32_t fixed = fixed_position(x, m.min, inv, static_cast<float>(max_level(bits)));
  return stochastic ? level_stochastic(fixed, random23) : level_nearest(fixed);
}

// Any bucket's decoded value of a level, from its metadata fields.
CGX_HD float decode_level(uint32_t level, float mn, float scale_field, int bits) {
  const uint32_t flags = meta_flags(scale_field);
  if (flags != 0u) return flagged_decode(level, mn, meta_scale(scale_field), flags, bits);
  return decode(level, mn, scale_field);
}

// Accumulation step of dequantize-and-sum (f32, flushed).
CGX_HD float accumulate(float acc, float v) { return flush(acc + v); }

// A decoded value times the output scale (dequantize's `scale` attribute:
// 1/W for compressed_pmean), a subnormal product flushed to a zero of its
// sign: what XLA:CPU computes for `sum / W` in f32 (it multiplies by the
// reciprocal of a constant divisor, and its FTZ keeps the sign), but before
// the one rounding to a 16-bit output type.
CGX_HD float scale_output(float v, float out_scale) {
  const float r = v * out_scale;
  return abs_f32(r) < kMinNormal ? bits_float(float_bits(r) & 0x80000000u) : r;
}

// ---- 16-bit float conversions (round to nearest even), host and device ----

CGX_HD float bf16_to_f32(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

CGX_HD uint16_t f32_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

CGX_HD float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return bits_float(sign | 0x7F800000u | (man << 13));
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
  // zero or subnormal: man * 2^-24, exact in f32
  float v = static_cast<float>(man) * 0x1p-24f;
  return bits_float(sign | float_bits(v));
}

CGX_HD uint16_t f32_to_f16(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to >= 65520: inf
  if (a >= 0x38800000u) {                                               // normal f16
    uint32_t r = a - 0x38000000u;                                       // rebias exponent 127 -> 15
    r += 0xFFFu + ((r >> 13) & 1u);
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  if (a < 0x33000000u) return sign;  // below half the smallest subnormal: +-0
  // subnormal f16: shift the full significand, round to nearest even
  uint32_t e = a >> 23;
  uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  uint32_t shift = 126u - e;  // 14..24
  uint32_t q = m >> shift;
  uint32_t rem = m & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

}  // namespace jax_cgx

#endif  // JAX_CGX_CODEC_MATH_H_
