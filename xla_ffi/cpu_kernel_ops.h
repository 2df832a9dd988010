// Building blocks of the CPU row kernels (xla_ffi/cpu_kernel_rows.h): dtype
// conversions, min/max over vector lanes, level computation, bit packing.
//
// Private to cpu_kernel_rows.h, its only includer. The definitions have
// internal linkage (an unnamed namespace), so every ISA variant file
// (cpu_kernels_{baseline,avx2,avx512}.cc) inlines its own copy, compiled for
// its target; nothing here is an interface. See cpu_kernels.cc for why each
// loop is written the way it is (vectorization without changing a bit of the
// result).
#ifndef JAX_CGX_XLA_FFI_CPU_KERNEL_OPS_H_
#define JAX_CGX_XLA_FFI_CPU_KERNEL_OPS_H_

#include <cstdint>
#include <cstring>
#include <limits>

#include "xla_ffi/codec_math.h"
#include "xla_ffi/float_type.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the bit packing below assumes a little-endian host"
#endif

namespace jax_cgx::cpu {
namespace {

// Hides v's value from the optimizer; emits no instruction.
inline void opaque(float& v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#else
  asm("" : "+m"(v));
#endif
}

// ------------------------------------------------------------ conversions

// c ? a : b as data flow. Written as ternaries, GCC turns the selections
// below into branches, sinks the float operation of one case into
// its branch and then cannot vectorize the loop (the operation might trap).
inline uint32_t blend(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return (a & mask) | (b & ~mask);
}

// f16_to_f32() of codec_math.h with every case computed and then selected,
// so that the loops over it vectorize. Same bits for all 2^16 inputs.
inline float f16_to_f32_vec(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  const uint32_t inf_nan = sign | 0x7F800000u | (man << 13);
  const uint32_t normal = sign | ((exp + 112u) << 23) | (man << 13);
  // man * 2^-24 is exact and a normal f32: no FTZ/DAZ dependence.
  const uint32_t subnormal =
      sign | float_bits(static_cast<float>(static_cast<int32_t>(man)) * 0x1p-24f);
  return bits_float(blend(exp == 0x1Fu, inf_nan, blend(exp != 0, normal, subnormal)));
}

// f32_to_f16() of codec_math.h, branch-free. Same bits for all 2^32 inputs.
// The subnormal case rounds |f| to a multiple of 2^-24 by adding 0.5f: the
// sum lies in [0.5, 1), where the f32 spacing is 2^-24, so the addition
// rounds to nearest even exactly as the integer code does (a carry into
// 2^-14 gives the smallest normal f16, as there). Inputs below 2^-25 give 0,
// f32 subnormals included, whether or not DAZ treats them as zero.
inline uint16_t f32_to_f16_vec(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t nan = sign | 0x7E00u | ((a >> 13) & 0x3FFu);
  const uint32_t inf = sign | 0x7C00u;
  uint32_t r = a - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xFFFu + ((r >> 13) & 1u);
  const uint32_t normal = sign | (r >> 13);
  const uint32_t subnormal = sign | (float_bits(bits_float(a) + 0.5f) - 0x3F000000u);
  return static_cast<uint16_t>(
      blend(a > 0x7F800000u, nan,
             blend(a >= 0x477FF000u, inf, blend(a >= 0x38800000u, normal, subnormal))));
}

// dst[i] = f32 value of src[i].
inline void load_f32(const void* src, FloatType t, int64_t n, float* __restrict dst) {
  if (t == FloatType::kBF16) {
    const uint16_t* __restrict s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  } else if (t == FloatType::kF16) {
    const uint16_t* __restrict s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32_vec(s[i]);
  } else {
    std::memcpy(dst, src, n * sizeof(float));
  }
}

// dst[i] = flush(src[i]): how dequantize_sum starts from its addend. One
// pass (no memcpy: small library copies per bucket cost more than they save).
inline void load_flushed(const void* src, FloatType t, int64_t n, float* __restrict dst) {
  if (t == FloatType::kBF16) {
    const uint16_t* __restrict s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = flush(bf16_to_f32(s[i]));
  } else if (t == FloatType::kF16) {
    const uint16_t* __restrict s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = flush(f16_to_f32_vec(s[i]));
  } else {
    const float* __restrict s = static_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = flush(s[i]);
  }
}

// dst[i] = src[i] rounded to the output type.
inline void store_f32(const float* __restrict src, int64_t n, void* dst, FloatType t) {
  if (t == FloatType::kBF16) {
    uint16_t* __restrict d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
  } else if (t == FloatType::kF16) {
    uint16_t* __restrict d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16_vec(src[i]);
  } else {
    std::memcpy(dst, src, n * sizeof(float));
  }
}

// ------------------------------------------------------------ min / max

struct MinMax {
  float mn = std::numeric_limits<float>::infinity();
  float mx = -std::numeric_limits<float>::infinity();
  bool nan = false;
};

// GCC does not vectorize a loop-carried float min/max without fast-math, so
// this loop uses GCC vector extensions, each lane doing the scalar comparisons
// of its elements. kLanes matches the variant's register (4 SSE, 8 AVX2, 16
// AVX-512): wider generic vectors get scalarized rather than split.
template <int kLanes>
struct Lanes {
  typedef float F __attribute__((vector_size(4 * kLanes)));
  typedef int32_t I __attribute__((vector_size(4 * kLanes)));
};

template <int kLanes>
struct FloatLanes {
  using type = typename Lanes<kLanes>::F;
};
template <int kLanes>
struct IntLanes {
  using type = typename Lanes<kLanes>::I;
};

// Folds the lanes of a vector pairwise (halves, then quarters, ...): a few
// vector operations instead of one scalar step per lane, which matters for
// small buckets. Fold is order-independent (min, max, or). VT picks the
// vector type: FloatLanes or IntLanes.
template <template <int> class VT, int kLanes, typename Fold>
inline auto fold_lanes(const typename VT<kLanes>::type& v) {
  if constexpr (kLanes == 1) {
    return v[0];
  } else {
    using Half = typename VT<kLanes / 2>::type;
    Half lo, hi, both;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
    Fold()(lo, hi, both);
    return fold_lanes<VT, kLanes / 2, Fold>(both);
  }
}
// Lane-wise operations (results by reference: no vectors passed by value).
struct MinOp {
  template <typename V>
  void operator()(const V& a, const V& b, V& out) const { out = a < b ? a : b; }
};
struct MaxOp {
  template <typename V>
  void operator()(const V& a, const V& b, V& out) const { out = a > b ? a : b; }
};
struct OrOp {
  template <typename V>
  void operator()(const V& a, const V& b, V& out) const { out = a | b; }
};

// Folds x[0..n) into r (raw values; the caller flushes the final min/max).
// Lanes keep their own running min/max; min and max of non-NaN values do not
// depend on the order, and NaNs fail every comparison, so they are skipped.
template <int kLanes>
inline void minmax_update(const float* __restrict x, int64_t n, MinMax& r) {
  using VF = typename Lanes<kLanes>::F;
  using VI = typename Lanes<kLanes>::I;
  int64_t i = 0;
  if (n >= 2 * kLanes) {
    constexpr float kInf = std::numeric_limits<float>::infinity();
    VF mn0 = VF{} + kInf, mn1 = mn0, mx0 = VF{} - kInf, mx1 = mx0;
    VI nan0 = VI{}, nan1 = VI{};
    for (; i + 2 * kLanes <= n; i += 2 * kLanes) {  // two chains per step for ILP
      VF v0, v1;
      std::memcpy(&v0, x + i, sizeof v0);
      std::memcpy(&v1, x + i + kLanes, sizeof v1);
      mn0 = v0 < mn0 ? v0 : mn0;
      mn1 = v1 < mn1 ? v1 : mn1;
      mx0 = v0 > mx0 ? v0 : mx0;
      mx1 = v1 > mx1 ? v1 : mx1;
      nan0 |= v0 != v0;
      nan1 |= v1 != v1;
    }
    const VF mn = mn0 < mn1 ? mn0 : mn1, mx = mx0 > mx1 ? mx0 : mx1;
    const VI nan = nan0 | nan1;
    const float lo = fold_lanes<FloatLanes, kLanes, MinOp>(mn);
    const float hi = fold_lanes<FloatLanes, kLanes, MaxOp>(mx);
    r.mn = lo < r.mn ? lo : r.mn;
    r.mx = hi > r.mx ? hi : r.mx;
    r.nan |= fold_lanes<IntLanes, kLanes, OrOp>(nan) != 0;
  }
  for (; i < n; ++i) {
    const float v = x[i];
    r.mn = v < r.mn ? v : r.mn;
    r.mx = v > r.mx ? v : r.mx;
    r.nan |= v != v;
  }
}

// The fast pass's min/max include infinities; a bucket that holds one (rare)
// needs its finite range: `rescan(BucketRange&)` adds its in-range values to it
// (range_add, one by one).
inline bool holds_infinity(const MinMax& r) { return r.mn < -kMaxFinite || r.mx > kMaxFinite; }

inline void range_update(const float* x, int64_t n, BucketRange& r) {
  for (int64_t i = 0; i < n; ++i) range_add(r, x[i]);
}

template <int kBits, class Rescan>
inline BucketMeta meta_of(const MinMax& r, Rescan&& rescan) {
  if (!holds_infinity(r)) return make_meta(flush(r.mn), flush(r.mx), r.nan, kBits);
  BucketRange finite;
  rescan(finite);
  return make_meta(finite, kBits);
}

inline bool is_nan(float f) { return f != f; }

// ------------------------------------------------------------ levels

// lv[i] = level of x[i]; element x[i] has row index index0 + i.
template <int kBits, bool kStochastic>
inline void encode(const float* __restrict x, int64_t n, float mn, float inv, uint32_t seed0,
                   uint32_t seed1, uint32_t index0, uint8_t* __restrict lv) {
  // fixed_position() spelled out with opaque clamp bounds. With the literal
  // bounds GCC threads the clamped cases into branches that hold the
  // multiply and the conversion, which it may not speculate (they could trap
  // under -ftrapping-math), and the loop stays scalar except on AVX-512.
  // The operations and their order are those of fixed_position().
  float zero = 0.0f, max_f = static_cast<float>(max_level(kBits));
  opaque(zero);
  opaque(max_f);
  uint32_t index = index0;  // a 32-bit counter: vector lanes of 32 bits, not 64
  for (int64_t i = 0; i < n; ++i, ++index) {
    float t = (flush(x[i]) - mn) * inv;
    t = t > zero ? t : zero;
    t = t < max_f ? t : max_f;
    const int32_t fixed = static_cast<int32_t>(t * kFracScale);
    uint32_t level;
    if constexpr (kStochastic) {
      level = level_stochastic(fixed, random_bits(seed0, seed1, index));
    } else {
      level = level_nearest(fixed);
    }
    lv[i] = static_cast<uint8_t>(level);
  }
}

// encode() for a flagged bucket (infinities or wide values; make_meta): scalar.
template <int kBits, bool kStochastic>
inline void encode_flagged(const float* x, int64_t n, float mn, float inv, uint32_t flags, uint32_t seed0,
                           uint32_t seed1, uint32_t index0, uint8_t* lv) {
  uint32_t index = index0;
  for (int64_t i = 0; i < n; ++i, ++index) {
    const uint32_t random23 = kStochastic ? random_bits(seed0, seed1, index) : 0u;
    lv[i] = static_cast<uint8_t>(flagged_level(x[i], mn, inv, flags, kBits, kStochastic, random23));
  }
}

// Levels of x[0..n) (row indices from index0) in the bucket of `meta`.
template <int kBits, bool kStochastic>
inline void encode_bucket(const BucketMeta& meta, const float* __restrict x, int64_t n, uint32_t seed0,
                          uint32_t seed1, uint32_t index0, uint8_t* __restrict lv) {
  const uint32_t flags = meta_flags(meta.scale);
  const float inv = inverse_scale(meta_scale(meta.scale));
  if (is_nan(meta.min)) {  // non-finite bucket: every level is 0
    std::memset(lv, 0, n);
  } else if (flags != 0u) {
    encode_flagged<kBits, kStochastic>(x, n, meta.min, inv, flags, seed0, seed1, index0, lv);
  } else {
    encode<kBits, kStochastic>(x, n, meta.min, inv, seed0, seed1, index0, lv);
  }
}

// out[i] = decode(lv[i]) in the output type. 16-bit outputs go through the
// f32 buffer tmp: two simple loops vectorize better than one fused loop.
// `scale` is the metadata's scale field: a flagged bucket (rare) is decoded
// by a scalar loop, every other one by the plain vectorizable loop.
// out_scale != 1: out[i] = flush(decode(lv[i]) * out_scale), rounded once to
// the output type (compressed_pmean's 1/W, applied where the sum is decoded
// instead of in a pass of its own; see scale_output in codec_math.h).
inline void decode_store(const uint8_t* __restrict lv, int64_t n, float mn, float scale, int bits,
                         void* out, FloatType t, float* __restrict tmp, float out_scale = 1.0f) {
  float* __restrict d = t == FloatType::kF32 ? static_cast<float*>(out) : tmp;
  if (const uint32_t flags = meta_flags(scale); flags != 0u) {
    const float s = meta_scale(scale);
    for (int64_t i = 0; i < n; ++i) d[i] = flagged_decode(lv[i], mn, s, flags, bits);
  } else {
    for (int64_t i = 0; i < n; ++i) d[i] = decode(lv[i], mn, scale);
  }
  if (out_scale != 1.0f) {
    for (int64_t i = 0; i < n; ++i) d[i] = scale_output(d[i], out_scale);
  }
  if (t != FloatType::kF32) store_f32(tmp, n, out, t);
}

// sum[i] = accumulate(acc[i], decode(lv[i])); sum may be acc itself.
inline void decode_accumulate(const uint8_t* __restrict lv, int64_t n, float mn, float scale, int bits,
                              const float* acc, float* sum) {
  if (const uint32_t flags = meta_flags(scale); flags != 0u) {
    const float s = meta_scale(scale);
    for (int64_t i = 0; i < n; ++i) sum[i] = accumulate(acc[i], flagged_decode(lv[i], mn, s, flags, bits));
  } else {
    for (int64_t i = 0; i < n; ++i) sum[i] = accumulate(acc[i], decode(lv[i], mn, scale));
  }
}

// ------------------------------------------------------------ bit packing

// Bits [lo, lo + width) of every `lane`-bit lane of a 64-bit word.
constexpr uint64_t lane_mask(int lane, int lo, int width) {
  const uint64_t field = (width >= 64 ? ~uint64_t{0} : (uint64_t{1} << width) - 1) << lo;
  uint64_t mask = 0;
  for (int s = 0; s < 64; s += lane) mask |= field << s;
  return mask;
}

// 8 levels, one per byte (each < 2^kBits), to 8*kBits dense bits: merge
// neighbouring fields pairwise, doubling the field width each step.
template <int kBits>
inline uint64_t compress(uint64_t w) {
  constexpr int b = kBits;
  w = (w & lane_mask(16, 0, b)) | ((w >> (8 - b)) & lane_mask(16, b, b));
  w = (w & lane_mask(32, 0, 2 * b)) | ((w >> (16 - 2 * b)) & lane_mask(32, 2 * b, 2 * b));
  w = (w & lane_mask(64, 0, 4 * b)) | ((w >> (32 - 4 * b)) & lane_mask(64, 4 * b, 4 * b));
  return w;
}

// The inverse of compress; bits of w above 8*kBits are ignored.
template <int kBits>
inline uint64_t expand(uint64_t w) {
  constexpr int b = kBits;
  w = (w & lane_mask(64, 0, 4 * b)) | ((w << (32 - 4 * b)) & lane_mask(64, 32, 4 * b));
  w = (w & lane_mask(32, 0, 2 * b)) | ((w << (16 - 2 * b)) & lane_mask(32, 16, 2 * b));
  w = (w & lane_mask(16, 0, b)) | ((w << (8 - b)) & lane_mask(16, 8, b));
  return w;
}

template <int kBits>
struct GroupWord;  // an unsigned integer of kBits bytes, where one exists
template <> struct GroupWord<1> { using type = uint8_t; };
template <> struct GroupWord<2> { using type = uint16_t; };
template <> struct GroupWord<4> { using type = uint32_t; };

// Packs the n levels held bytewise in w (n rounded up to whole words is
// available; the slack is zeroed here) into packed_bytes(n, kBits) bytes at
// out. kBits < 8: for 8 bits the levels already are the packed bytes.
template <int kBits>
inline void pack(uint64_t* __restrict w, int64_t n, uint8_t* __restrict out) {
  static_assert(kBits >= 1 && kBits < 8, "8-bit levels need no packing");
  constexpr int64_t b = kBits;
  const int64_t groups = (n + 7) / 8;
  const int64_t nbytes = packed_bytes(n, kBits);
  uint8_t* lv = reinterpret_cast<uint8_t*>(w);
  for (int64_t i = n; i % 8 != 0; ++i) lv[i] = 0;  // unused high bits must be zero
  int64_t g = 0;
  if constexpr (b == 1 || b == 2 || b == 4) {
    // A group is exactly one narrow integer: compress and store in one
    // vectorized loop.
    using U = typename GroupWord<kBits>::type;
    for (; (g + 1) * b <= nbytes; ++g) {
      const U v = static_cast<U>(compress<kBits>(w[g]));
      std::memcpy(out + g * b, &v, b);
    }
  } else {
    // Compress in place (vectorized), then overlapping 8-byte stores: the
    // next group overwrites the (zero) slack bytes. Only while the store
    // stays inside this piece's bytes.
    for (int64_t i = 0; i < groups; ++i) w[i] = compress<kBits>(w[i]);
    for (; g * b + 8 <= nbytes; ++g) std::memcpy(out + g * b, &w[g], 8);
  }
  for (; g * b < nbytes; ++g) {  // the last groups, byte-exact
    uint64_t v = w[g];
    if constexpr (b == 1 || b == 2 || b == 4) v = compress<kBits>(v);
    std::memcpy(out + g * b, &v, std::min(b, nbytes - g * b));
  }
}

// The levels of the n elements packed at in, one per byte. For 8 bits that
// is `in` itself; otherwise they are unpacked into w (whole words).
template <int kBits>
inline const uint8_t* unpack(const uint8_t* __restrict in, int64_t n, uint64_t* __restrict w) {
  if constexpr (kBits == 8) {
    (void)n;
    (void)w;
    return in;
  } else {
    constexpr int64_t b = kBits;
    const int64_t groups = (n + 7) / 8;
    const int64_t nbytes = packed_bytes(n, kBits);
    int64_t g = 0;
    if constexpr (b == 1 || b == 2 || b == 4) {
      // Load and expand in one vectorized loop (a separate expand pass would
      // reload words right after narrow stores to them: store-forwarding
      // stalls that show in small buckets).
      using U = typename GroupWord<kBits>::type;
      for (; (g + 1) * b <= nbytes; ++g) {
        U v;
        std::memcpy(&v, in + g * b, b);
        w[g] = expand<kBits>(v);
      }
    } else {
      // Overlapping 8-byte loads; expand() drops the neighbour's bits.
      for (; g * b + 8 <= nbytes; ++g) std::memcpy(&w[g], in + g * b, 8);
      for (int64_t i = 0; i < g; ++i) w[i] = expand<kBits>(w[i]);
    }
    for (; g < groups; ++g) {
      uint64_t v = 0;
      std::memcpy(&v, in + g * b, std::min(b, nbytes - g * b));
      w[g] = expand<kBits>(v);
    }
    return reinterpret_cast<const uint8_t*>(w);
  }
}

}  // namespace
}  // namespace jax_cgx::cpu

#endif  // JAX_CGX_XLA_FFI_CPU_KERNEL_OPS_H_
