// The jax_cgx codec, element by element.
//
// This header is the single definition of the codec's arithmetic. The CPU
// kernels, the CUDA kernels and (transcribed op for op) the pure-JAX reference
// in jax_cgx/codec/reference.py all follow it, and docs/format.md explains it. Every
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

// Bucket values whose magnitude exceeds this are treated as overflow: the
// bucket is encoded as non-finite (decodes to NaN). It keeps every
// intermediate (range, scale, 1/scale) a normal f32.
constexpr float kMaxMagnitude = 0x1p125f;
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

// Round a positive finite f32 up to 16 significant bits (clear the low 8
// mantissa bits, rounding towards +inf), so that level * scale is exact.
CGX_HD float round_scale_up(float s) {
  return bits_float((float_bits(s) + 0xFFu) & ~0xFFu);
}

// Per-bucket metadata, stored as two f32 in this order.
struct BucketMeta {
  float min;
  float scale;
};

// Metadata from a bucket's minimum and maximum (taken over flushed values,
// NaNs ignored) and whether the bucket held a NaN. A bucket with no value in
// its range (mn > mx: every element lies past the row's valid count, i.e. is
// padding) gets (0, 0) and decodes to zeros.
CGX_HD BucketMeta make_meta(float mn, float mx, bool has_nan, int bits) {
  BucketMeta m;
  if (!has_nan && mn > mx) {
    m.min = 0.0f;
    m.scale = 0.0f;
    return m;
  }
  // Written as negated comparisons so that NaN min/max also count as overflow.
  if (has_nan || !(mn >= -kMaxMagnitude) || !(mx <= kMaxMagnitude)) {
    m.min = canonical_nan();
    m.scale = canonical_nan();
    return m;
  }
  m.min = mn;
  if (mx > mn) {
    // range <= 2^126, so nothing overflows. A subnormal product (or its FTZ
    // zero) ends at kMinScale either way. Rounding up to 16 bits leaves
    // max_level * scale >= range in all but f32-rounding corner cases, which
    // the clamp in fixed_position absorbs.
    float s = round_scale_up((mx - mn) * level_step(bits));
    m.scale = s > kMinScale ? s : kMinScale;
  } else {
    m.scale = 0.0f;  // degenerate bucket: every element decodes to min exactly
  }
  return m;
}

// 1/scale, or 0 for a degenerate (or non-finite) bucket.
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

// Accumulation step of dequantize-and-sum (f32, flushed).
CGX_HD float accumulate(float acc, float v) { return flush(acc + v); }

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
