// CPU kernels of the jax_cgx codec (see cpu_codec.h) and their FFI handlers.
//
// How the kernels are fast without changing a single bit of the result:
//   * A row is processed in spans that start at a bucket start or at a
//     multiple of 8 elements inside a bucket, so each starts on a byte of the
//     packed stream and 8 levels always fill exactly `bits` bytes. Small
//     buckets (B a multiple of 8) share spans, so packing runs over many at
//     once; buckets longer than kPiece are processed in pieces.
//   * Each step is its own simple loop over L1-resident data (min/max, levels,
//     bit packing, decoding, dtype conversion), written so that GCC
//     auto-vectorizes it. Most loop bodies are the codec_math.h functions
//     themselves; where GCC would not vectorize those (min/max, the level
//     computation, f16 conversions) the body spells out the same operations
//     in a vectorizable form, and the scratch tests compare every kernel with
//     a scalar loop over codec_math.h (the f16 conversions over all inputs).
//     Vectorization only runs lanes side by side: IEEE operations, no
//     contraction (-ffp-contract=off, no fast-math), so the bits are equal.
//   * Packing works on 64-bit words: 8 levels, one per byte, are squeezed into
//     the low 8*bits bits with three shift-and-mask steps (and unpacking is the
//     reverse), which vectorizes as plain 64-bit lane operations.
//   * The row kernels are compiled three times, for baseline x86-64, AVX2 and
//     AVX-512, and the best variant the CPU supports is picked once at run
//     time (JAX_CGX_CPU_ISA overrides it).
// The min/max pass reads raw values and flushes only the result: flush() is
// monotonic (it maps (-2^-126, 2^-126) to +0 and keeps everything else), so
// flush(min x) == min flush(x), and likewise for max; NaNs are skipped by the
// comparisons and tracked separately.
#include "xla_ffi/cpu_codec.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/codec_math.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the bit packing below assumes a little-endian host"
#endif

#if defined(__GNUC__) && defined(__x86_64__)
#define CGX_X86_VARIANTS 1
#else
#define CGX_X86_VARIANTS 0
#endif

namespace jax_cgx::cpu {
namespace {

// Buckets of up to kPiece elements are held whole in the stack buffers
// (16 KiB of f32, 4 KiB of levels), so their input is read once; longer ones
// are processed in pieces of kPiece elements.
constexpr int64_t kPiece = 4096;
// Small buckets are grouped into spans of up to kSpan elements (see
// buckets_per_span), and the reduce kernels sum kSpan elements at a time:
// their loops stream addend, payloads and output through L1 together, and
// measured faster with short runs than with kPiece-long ones.
constexpr int64_t kSpan = 512;
static_assert(kPiece % 8 == 0 && kSpan % 8 == 0 && kPiece % kSpan == 0,
              "pieces and spans must start on whole bytes");

int64_t type_size(FloatType t) { return t == FloatType::kF32 ? 4 : 2; }

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

const void* element_ptr(const void* base, FloatType t, int64_t i) {
  return static_cast<const char*>(base) + i * type_size(t);
}
void* element_ptr(void* base, FloatType t, int64_t i) {
  return static_cast<char*>(base) + i * type_size(t);
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

template <int kBits>
inline BucketMeta meta_of(const MinMax& r) {
  return make_meta(flush(r.mn), flush(r.mx), r.nan, kBits);
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

// out[i] = decode(lv[i]) in the output type. 16-bit outputs go through the
// f32 buffer tmp: two simple loops vectorize better than one fused loop.
inline void decode_store(const uint8_t* __restrict lv, int64_t n, float mn, float scale, void* out,
                         FloatType t, float* __restrict tmp) {
  float* __restrict d = t == FloatType::kF32 ? static_cast<float*>(out) : tmp;
  for (int64_t i = 0; i < n; ++i) d[i] = decode(lv[i], mn, scale);
  if (t != FloatType::kF32) store_f32(tmp, n, out, t);
}

// sum[i] = accumulate(acc[i], decode(lv[i])); sum may be acc itself.
inline void decode_accumulate(const uint8_t* __restrict lv, int64_t n, float mn, float scale,
                              const float* acc, float* sum) {
  for (int64_t i = 0; i < n; ++i) sum[i] = accumulate(acc[i], decode(lv[i], mn, scale));
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

// ------------------------------------------------------------ row kernels

// `valid`: the row's first `valid` elements set its buckets' ranges; later
// ones (padding) are encoded within those ranges but never widen them.
struct QuantizeRow {
  const void* x;
  FloatType x_type;
  int64_t m, bucket, valid;
  uint32_t seed0, seed1;
  uint8_t* payload;
  float* meta;
};

struct DequantizeRow {
  const uint8_t* payload;
  const float* meta;
  int64_t m, bucket;
  void* out;
  FloatType out_type;
};

struct ReduceRow {
  const uint8_t* payload;  // input w at payload + w * payload_stride
  int64_t payload_stride;
  const float* meta;  // input w at meta + w * meta_stride
  int64_t meta_stride;
  int64_t inputs;
  int64_t m, bucket, valid;  // valid: as QuantizeRow's, for the requantized sum
  const void* addend;  // nullptr: absent
  FloatType addend_type;
  uint32_t seed0, seed1;
  uint8_t* payload_out;  // nullptr: no requantization
  float* meta_out;
  void* out;
  FloatType out_type;
};

// Bytes between bucket starts. Only meaningful when a row has two or more
// buckets (then bucket < m and nothing overflows).
int64_t bucket_stride(int64_t m, int64_t bucket, int bits) {
  return m > bucket ? packed_bytes(bucket, bits) : 0;
}

// A row is processed in spans: a run of whole small buckets of at most kSpan
// elements in all, or a single bucket (processed in pieces if longer than
// kPiece). Several buckets share a span only when B is a multiple of 8: then
// consecutive buckets are contiguous in the packed stream and one pack/unpack
// covers them all, which keeps small buckets cheap.
int64_t buckets_per_span(int64_t bucket) {
  return bucket % 8 == 0 && bucket <= kSpan ? kSpan / bucket : 1;
}

// How many of the n elements from row index `first` enter a bucket's range.
inline int64_t in_range(int64_t valid, int64_t first, int64_t n) {
  return std::clamp<int64_t>(valid - first, 0, n);
}

template <int kLanes, int kBits, bool kStochastic>
void quantize_row_impl(const QuantizeRow& a) {
  alignas(64) float conv[kPiece];
  alignas(64) uint64_t words[kPiece / 8];
  uint8_t* const lv = reinterpret_cast<uint8_t*>(words);
  const int64_t B = a.bucket, nb = bucket_count(a.m, B), stride = bucket_stride(a.m, B, kBits);
  // f32 input is read in place; 16-bit input is converted span by span.
  auto fetch = [&](int64_t first, int64_t n) -> const float* {
    if (a.x_type == FloatType::kF32) return static_cast<const float*>(a.x) + first;
    load_f32(element_ptr(a.x, a.x_type, first), a.x_type, n, conv);
    return conv;
  };
  auto set_meta = [&](int64_t k, const MinMax& range) {
    const BucketMeta meta = meta_of<kBits>(range);
    a.meta[2 * k] = meta.min;
    a.meta[2 * k + 1] = meta.scale;
    return meta;
  };
  // Levels of elements [first, first + n) of bucket meta, from x.
  auto levels_of = [&](const BucketMeta& meta, const float* x, int64_t n, int64_t first,
                       uint8_t* levels) {
    if (is_nan(meta.min)) {  // non-finite bucket: every level is 0
      std::memset(levels, 0, n);
    } else {
      encode<kBits, kStochastic>(x, n, meta.min, inverse_scale(meta.scale), a.seed0, a.seed1,
                                 static_cast<uint32_t>(first), levels);
    }
  };

  const int64_t group = buckets_per_span(B);
  for (int64_t k0 = 0; k0 < nb; k0 += group) {
    const int64_t k1 = std::min(nb, k0 + group), start = k0 * B;
    const int64_t n = std::min(k1 * B, a.m) - start;
    uint8_t* dst = a.payload + k0 * stride;
    if (n <= kPiece) {  // whole buckets
      const float* x = fetch(start, n);
      uint8_t* levels = kBits == 8 ? dst : lv;
      for (int64_t k = k0, off = 0; k < k1; ++k, off += B) {
        const int64_t len = std::min(B, n - off);
        MinMax range;
        minmax_update<kLanes>(x + off, in_range(a.valid, start + off, len), range);
        levels_of(set_meta(k, range), x + off, len, start + off, levels + off);
      }
      if constexpr (kBits != 8) pack<kBits>(words, n, dst);
    } else {  // one long bucket: min/max over all pieces, then encode them
      MinMax range;
      for (int64_t s = 0; s < n; s += kPiece) {
        const int64_t len = std::min(kPiece, n - s);
        minmax_update<kLanes>(fetch(start + s, len), in_range(a.valid, start + s, len), range);
      }
      const BucketMeta meta = set_meta(k0, range);
      for (int64_t s = 0; s < n; s += kPiece) {
        const int64_t len = std::min(kPiece, n - s);
        uint8_t* piece_dst = dst + s * kBits / 8;
        levels_of(meta, fetch(start + s, len), len, start + s, kBits == 8 ? piece_dst : lv);
        if constexpr (kBits != 8) pack<kBits>(words, len, piece_dst);
      }
    }
  }
}

template <int kBits>
void dequantize_row_impl(const DequantizeRow& a) {
  alignas(64) float tmp[kPiece];
  alignas(64) uint64_t words[kPiece / 8];
  const int64_t B = a.bucket, nb = bucket_count(a.m, B), stride = bucket_stride(a.m, B, kBits);
  const int64_t group = buckets_per_span(B);
  for (int64_t k0 = 0; k0 < nb; k0 += group) {
    const int64_t k1 = std::min(nb, k0 + group), start = k0 * B;
    const int64_t n = std::min(k1 * B, a.m) - start;
    // Pieces of kPiece elements; with several buckets per span there is one.
    for (int64_t s = 0; s < n; s += kPiece) {
      const int64_t len = std::min(kPiece, n - s);
      const uint8_t* levels = unpack<kBits>(a.payload + k0 * stride + s * kBits / 8, len, words);
      for (int64_t k = k0, off = 0; k < k1; ++k, off += B) {
        decode_store(levels + off, std::min(B, len - off), a.meta[2 * k], a.meta[2 * k + 1],
                     element_ptr(a.out, a.out_type, start + s + off), a.out_type, tmp + off);
      }
    }
  }
}

template <int kLanes, int kBits, bool kRequantize, bool kStochastic>
void reduce_row_impl(const ReduceRow& a) {
  alignas(64) float acc[kPiece];
  alignas(64) uint64_t words[kPiece / 8];
  uint8_t* const lv = reinterpret_cast<uint8_t*>(words);
  const int64_t B = a.bucket, nb = bucket_count(a.m, B), stride = bucket_stride(a.m, B, kBits);

  // Sums the len <= kSpan elements of buckets [k0, k1) that start s elements
  // into bucket k0 (s > 0 only when k1 == k0 + 1): sum = flush(addend) or 0,
  // then sum = accumulate(sum, decode(input w)) for w = 0..W-1. Partial sums
  // live in part; the last step writes to sum (part itself, or straight into
  // an f32 output).
  auto sum_span = [&](int64_t k0, int64_t k1, int64_t s, int64_t len, float* part, float* sum) {
    const int64_t first = k0 * B + s;
    if (a.addend != nullptr) {
      load_flushed(element_ptr(a.addend, a.addend_type, first), a.addend_type, len, part);
    } else {
      std::fill(part, part + len, 0.0f);
    }
    for (int64_t w = 0; w < a.inputs; ++w) {
      const float* meta = a.meta + w * a.meta_stride;
      const uint8_t* levels =
          unpack<kBits>(a.payload + w * a.payload_stride + k0 * stride + s * kBits / 8, len, words);
      float* dst = w + 1 == a.inputs ? sum : part;
      for (int64_t k = k0, off = 0; k < k1; ++k, off += B) {
        decode_accumulate(levels + off, std::min(B, len - off), meta[2 * k], meta[2 * k + 1],
                          part + off, dst + off);
      }
    }
    if (a.inputs == 0 && sum != part) std::memcpy(sum, part, len * sizeof(float));
  };
  // acc[0, n) = the sums of the n <= kPiece elements from s into bucket k0.
  auto sum_into_acc = [&](int64_t k0, int64_t k1, int64_t s, int64_t n) {
    for (int64_t t = 0; t < n; t += kSpan) {
      sum_span(k0, k1, s + t, std::min(kSpan, n - t), acc + t, acc + t);
    }
  };
  auto set_meta = [&](int64_t k, const MinMax& range) {
    const BucketMeta meta = meta_of<kBits>(range);
    a.meta_out[2 * k] = meta.min;
    a.meta_out[2 * k + 1] = meta.scale;
    return meta;
  };
  // Requantizes acc[off, off + len) (row elements from `first`) with meta:
  // levels to levels[off..], decoded values to out, kSpan at a time. acc is
  // dead after encoding and serves as decode_store's buffer.
  auto requantize = [&](const BucketMeta& meta, int64_t off, int64_t len, int64_t first,
                        uint8_t* levels) {
    const float inv = inverse_scale(meta.scale);
    for (int64_t t = 0; t < len; t += kSpan) {
      const int64_t i = off + t, n = std::min(kSpan, len - t);
      if (is_nan(meta.min)) {
        std::memset(levels + i, 0, n);
      } else {
        encode<kBits, kStochastic>(acc + i, n, meta.min, inv, a.seed0, a.seed1,
                                   static_cast<uint32_t>(first + t), levels + i);
      }
      decode_store(levels + i, n, meta.min, meta.scale,
                   element_ptr(a.out, a.out_type, first + t), a.out_type, acc + i);
    }
  };

  const int64_t group = buckets_per_span(B);
  for (int64_t k0 = 0; k0 < nb; k0 += group) {
    const int64_t k1 = std::min(nb, k0 + group), start = k0 * B;
    const int64_t n = std::min(k1 * B, a.m) - start;
    if constexpr (!kRequantize) {
      for (int64_t s = 0; s < n; s += kSpan) {
        const int64_t len = std::min(kSpan, n - s);
        void* out = element_ptr(a.out, a.out_type, start + s);
        if (a.out_type == FloatType::kF32) {
          sum_span(k0, k1, s, len, acc, static_cast<float*>(out));
        } else {
          sum_span(k0, k1, s, len, acc, acc);
          store_f32(acc, len, out, a.out_type);
        }
      }
    } else if (n <= kPiece) {  // whole buckets
      uint8_t* dst = a.payload_out + k0 * stride;
      uint8_t* levels = kBits == 8 ? dst : lv;
      sum_into_acc(k0, k1, 0, n);
      for (int64_t k = k0, off = 0; k < k1; ++k, off += B) {
        const int64_t len = std::min(B, n - off);
        MinMax range;
        minmax_update<kLanes>(acc + off, in_range(a.valid, start + off, len), range);
        requantize(set_meta(k, range), off, len, start + off, levels);
      }
      if constexpr (kBits != 8) pack<kBits>(words, n, dst);
    } else {  // one long bucket: min/max over all pieces, then encode them
      MinMax range;
      for (int64_t s = 0; s < n; s += kPiece) {
        const int64_t len = std::min(kPiece, n - s);
        sum_into_acc(k0, k1, s, len);
        minmax_update<kLanes>(acc, in_range(a.valid, start + s, len), range);
      }
      const BucketMeta meta = set_meta(k0, range);
      for (int64_t s = 0; s < n; s += kPiece) {
        const int64_t len = std::min(kPiece, n - s);
        // Summed again: the same operations in the same order give the same
        // acc, and no bucket-sized buffer is needed.
        sum_into_acc(k0, k1, s, len);
        uint8_t* piece_dst = a.payload_out + k0 * stride + s * kBits / 8;
        requantize(meta, 0, len, start + s, kBits == 8 ? piece_dst : lv);
        if constexpr (kBits != 8) pack<kBits>(words, len, piece_dst);
      }
    }
  }
}

// ------------------------------------------------------------ ISA variants

using QuantizeFn = void (*)(const QuantizeRow&);
using DequantizeFn = void (*)(const DequantizeRow&);
using ReduceFn = void (*)(const ReduceRow&);

struct KernelTable {
  const char* name;
  QuantizeFn quantize[8][2];  // [bits - 1][stochastic]
  DequantizeFn dequantize[8];
  ReduceFn reduce[8][3];  // [bits - 1][0: sum, 1: requantize nearest, 2: stochastic]
};

// One variant: entry points with the given target attributes. `flatten`
// inlines the whole kernel into them, so every loop is vectorized for that
// target. LANES: lanes of the min/max vectors, one register of the target.
#define CGX_DEFINE_VARIANT(NS, LANES, ATTRS)                                                       \
  namespace NS {                                                                                   \
  template <int kBits, bool kStochastic>                                                           \
  ATTRS void quantize_row(const QuantizeRow& a) {                                                  \
    quantize_row_impl<LANES, kBits, kStochastic>(a);                                               \
  }                                                                                                \
  template <int kBits>                                                                             \
  ATTRS void dequantize_row(const DequantizeRow& a) {                                              \
    dequantize_row_impl<kBits>(a);                                                                 \
  }                                                                                                \
  template <int kBits, bool kRequantize, bool kStochastic>                                         \
  ATTRS void reduce_row(const ReduceRow& a) {                                                      \
    reduce_row_impl<LANES, kBits, kRequantize, kStochastic>(a);                                    \
  }                                                                                                \
  template <int... kBits>                                                                          \
  constexpr KernelTable make_table(std::integer_sequence<int, kBits...>) {                         \
    return KernelTable{#NS,                                                                        \
                       {{&quantize_row<kBits, false>, &quantize_row<kBits, true>}...},             \
                       {&dequantize_row<kBits>...},                                                \
                       {{&reduce_row<kBits, false, false>, &reduce_row<kBits, true, false>,        \
                         &reduce_row<kBits, true, true>}...}};                                     \
  }                                                                                                \
  constexpr KernelTable kTable = make_table(std::integer_sequence<int, 1, 2, 3, 4, 5, 6, 7, 8>{}); \
  }

CGX_DEFINE_VARIANT(baseline, 4, __attribute__((flatten)))
#if CGX_X86_VARIANTS
CGX_DEFINE_VARIANT(avx2, 8, __attribute__((target("avx2"), flatten)))
// prefer-vector-width=512: otherwise GCC may stay with 256-bit vectors.
CGX_DEFINE_VARIANT(avx512, 16, __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,"
                                                   "prefer-vector-width=512"),
                                           flatten)))
#endif
#undef CGX_DEFINE_VARIANT

// Best first.
const KernelTable* const kVariants[] = {
#if CGX_X86_VARIANTS
    &avx512::kTable,
    &avx2::kTable,
#endif
    &baseline::kTable,
};

bool cpu_supports(const KernelTable* t) {
#if CGX_X86_VARIANTS
  if (t == &avx512::kTable) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  if (t == &avx2::kTable) return __builtin_cpu_supports("avx2");
#endif
  return t == &baseline::kTable;
}

// The best supported variant, or the named one; nullptr if unknown/unsupported.
const KernelTable* find_variant(const char* name) {
  const bool any = name == nullptr || std::strcmp(name, "auto") == 0;
  for (const KernelTable* t : kVariants) {
    if (!any && std::strcmp(name, t->name) != 0) continue;
    return cpu_supports(t) ? t : nullptr;
  }
  return nullptr;
}

std::atomic<const KernelTable*> g_variant{nullptr};

const KernelTable& kernels() {
  const KernelTable* t = g_variant.load(std::memory_order_acquire);
  if (t == nullptr) {
    const KernelTable* chosen = find_variant(std::getenv("JAX_CGX_CPU_ISA"));
    if (chosen == nullptr) chosen = find_variant(nullptr);
    // Another thread may have chosen first; both picked from the same rules.
    g_variant.compare_exchange_strong(t, chosen, std::memory_order_acq_rel);
    t = g_variant.load(std::memory_order_acquire);
  }
  return *t;
}

}  // namespace

// ------------------------------------------------------------ public API

int64_t bucket_count(int64_t m, int64_t bucket_size) {
  return m / bucket_size + (m % bucket_size != 0 ? 1 : 0);
}

int64_t payload_bytes(int64_t m, int64_t bucket_size, int bits) {
  const int64_t nb = bucket_count(m, bucket_size);
  if (nb == 0) return 0;
  if (nb == 1) return jax_cgx::packed_bytes(m, bits);
  // nb >= 2 means bucket_size < m: the products below cannot overflow.
  return (nb - 1) * jax_cgx::packed_bytes(bucket_size, bits) +
         jax_cgx::packed_bytes(m - (nb - 1) * bucket_size, bits);
}

void quantize(const void* x, FloatType x_type, int64_t rows, int64_t n, int64_t m,
              const uint32_t* seeds, const int32_t* valid, int bits, int64_t bucket_size,
              bool stochastic, uint8_t* payload, float* meta) {
  if (m == 0) return;
  const QuantizeFn fn = kernels().quantize[bits - 1][stochastic ? 1 : 0];
  const int64_t p = payload_bytes(m, bucket_size, bits);
  const int64_t nb = bucket_count(m, bucket_size);
  for (int64_t r = 0; r < rows; ++r) {
    QuantizeRow row{element_ptr(x, x_type, r * n),
                    x_type,
                    m,
                    bucket_size,
                    valid != nullptr ? valid[r] : m,
                    stochastic ? seeds[2 * r] : 0u,
                    stochastic ? seeds[2 * r + 1] : 0u,
                    payload + r * p,
                    meta + r * nb * 2};
    fn(row);
  }
}

void dequantize(const uint8_t* payload, const float* meta, int64_t rows, int64_t m, int bits,
                int64_t bucket_size, void* out, FloatType out_type) {
  if (m == 0) return;
  const DequantizeFn fn = kernels().dequantize[bits - 1];
  const int64_t p = payload_bytes(m, bucket_size, bits);
  const int64_t nb = bucket_count(m, bucket_size);
  for (int64_t r = 0; r < rows; ++r) {
    DequantizeRow row{payload + r * p, meta + r * nb * 2, m, bucket_size,
                      element_ptr(out, out_type, r * m), out_type};
    fn(row);
  }
}

namespace {
void reduce(const uint8_t* payload, const float* meta, int64_t rows, int64_t inputs, int64_t m,
            int bits, int64_t bucket_size, const void* addend, FloatType addend_type,
            const uint32_t* seeds, const int32_t* valid, bool requantize, bool stochastic,
            uint8_t* payload_out,
            float* meta_out, void* out, FloatType out_type) {
  if (m == 0) return;
  const int mode = requantize ? (stochastic ? 2 : 1) : 0;
  const ReduceFn fn = kernels().reduce[bits - 1][mode];
  const int64_t p = payload_bytes(m, bucket_size, bits);
  const int64_t nb = bucket_count(m, bucket_size);
  for (int64_t r = 0; r < rows; ++r) {
    ReduceRow row{payload + r * inputs * p,
                  p,
                  meta + r * inputs * nb * 2,
                  nb * 2,
                  inputs,
                  m,
                  bucket_size,
                  valid != nullptr ? valid[r] : m,
                  addend != nullptr ? element_ptr(addend, addend_type, r * m) : nullptr,
                  addend_type,
                  mode == 2 ? seeds[2 * r] : 0u,
                  mode == 2 ? seeds[2 * r + 1] : 0u,
                  requantize ? payload_out + r * p : nullptr,
                  requantize ? meta_out + r * nb * 2 : nullptr,
                  element_ptr(out, out_type, r * m),
                  out_type};
    fn(row);
  }
}
}  // namespace

void dequantize_sum(const uint8_t* payload, const float* meta, int64_t rows, int64_t inputs,
                    int64_t m, int bits, int64_t bucket_size, const void* addend,
                    FloatType addend_type, void* out, FloatType out_type) {
  reduce(payload, meta, rows, inputs, m, bits, bucket_size, addend, addend_type, nullptr, nullptr,
         /*requantize=*/false, /*stochastic=*/false, nullptr, nullptr, out, out_type);
}

void dequantize_sum_requantize(const uint8_t* payload, const float* meta, int64_t rows,
                               int64_t inputs, int64_t m, int bits, int64_t bucket_size,
                               const void* addend, FloatType addend_type, const uint32_t* seeds,
                               const int32_t* valid, bool stochastic, uint8_t* payload_out,
                               float* meta_out, void* out, FloatType out_type) {
  reduce(payload, meta, rows, inputs, m, bits, bucket_size, addend, addend_type, seeds, valid,
         /*requantize=*/true, stochastic, payload_out, meta_out, out, out_type);
}

const char* active_isa() { return kernels().name; }

bool isa_supported(const char* name) { return name != nullptr && find_variant(name) != nullptr; }

bool set_isa(const char* name) {
  const KernelTable* t = find_variant(name);
  if (t == nullptr) return false;
  g_variant.store(t, std::memory_order_release);
  return true;
}

int64_t piece_elements() { return kPiece; }

}  // namespace jax_cgx::cpu

// ------------------------------------------------------------ FFI handlers

namespace {

namespace ffi = xla::ffi;
using jax_cgx::cpu::bucket_count;
using jax_cgx::cpu::FloatType;
using jax_cgx::cpu::payload_bytes;

using Dims = ffi::Span<const int64_t>;

std::string shape_str(const int64_t* dims, size_t rank) {
  std::string s = "[";
  for (size_t i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}
std::string shape_str(Dims dims) { return shape_str(dims.begin(), dims.size()); }
std::string shape_str(std::initializer_list<int64_t> dims) {
  return shape_str(dims.begin(), dims.size());
}

std::string dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F64: return "float64";
    default: return "dtype code " + std::to_string(static_cast<int>(t));
  }
}

// Argument checks of one target; failures are "<target>: <message>"
// InvalidArgument errors.
struct Checker {
  const char* target;

  ffi::Error fail(const std::string& msg) const {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(target) + ": " + msg);
  }

  ffi::Error attrs(int32_t bits, int64_t bucket_size) const {
    if (bits < 1 || bits > 8) {
      return fail("attribute bits must be in 1..8, got " + std::to_string(bits));
    }
    if (bucket_size < 1) {
      return fail("attribute bucket_size must be >= 1, got " + std::to_string(bucket_size));
    }
    return ffi::Error::Success();
  }

  ffi::Error float_type(const char* name, ffi::DataType t, FloatType* out) const {
    switch (t) {
      case ffi::DataType::F32: *out = FloatType::kF32; return ffi::Error::Success();
      case ffi::DataType::BF16: *out = FloatType::kBF16; return ffi::Error::Success();
      case ffi::DataType::F16: *out = FloatType::kF16; return ffi::Error::Success();
      default:
        return fail(std::string(name) + " must be float32, bfloat16 or float16, got " +
                    dtype_name(t));
    }
  }

  // Buffer `name` must have exactly the dims `want` (-1: any extent);
  // `expected` describes them in the message.
  ffi::Error shape(const char* name, Dims dims, std::initializer_list<int64_t> want,
                   const std::string& expected) const {
    bool ok = dims.size() == want.size();
    for (size_t i = 0; ok && i < want.size(); ++i) {
      ok = want.begin()[i] < 0 || dims[i] == want.begin()[i];
    }
    if (ok) return ffi::Error::Success();
    return fail(std::string(name) + " has shape " + shape_str(dims) + ", expected " + expected);
  }

  // valid: [R] counts (each row's elements that set its buckets' ranges) or
  // [0] (all of them). Returns the data pointer or nullptr.
  ffi::Error valid_counts(const ffi::Buffer<ffi::S32>& valid, int64_t rows,
                          const int32_t** out) const {
    const Dims d = valid.dimensions();
    if (d.size() != 1 || (d[0] != rows && d[0] != 0)) {
      return fail("valid has shape " + shape_str(d) + ", expected [R] = " + shape_str({rows}) +
                  " or [0] (every element valid)");
    }
    *out = d[0] == 0 ? nullptr : valid.typed_data();
    return ffi::Error::Success();
  }

  // meta [R, (W,) nb, 2] and payload [R, (W,) P] holding m elements per row
  // (no W axis when inputs < 0).
  ffi::Error packed(const char* payload_name, Dims payload_dims, const char* meta_name,
                    Dims meta_dims, int64_t rows, int64_t inputs, int64_t m, int64_t bucket_size,
                    int32_t bits) const {
    const int64_t nb = bucket_count(m, bucket_size), p = payload_bytes(m, bucket_size, bits);
    const std::string note = " (m = " + std::to_string(m) + ", bucket_size = " +
                             std::to_string(bucket_size) + ", bits = " + std::to_string(bits) + ")";
    ffi::Error err;
    if (inputs < 0) {
      err = shape(meta_name, meta_dims, {rows, nb, 2},
                  "[R, nb, 2] = " + shape_str({rows, nb, 2}) + note);
      if (err.success()) {
        err = shape(payload_name, payload_dims, {rows, p},
                    "[R, P] = " + shape_str({rows, p}) + note);
      }
    } else {
      err = shape(meta_name, meta_dims, {rows, inputs, nb, 2},
                  "[R, W, nb, 2] = " + shape_str({rows, inputs, nb, 2}) + note);
      if (err.success()) {
        err = shape(payload_name, payload_dims, {rows, inputs, p},
                    "[R, W, P] = " + shape_str({rows, inputs, p}) + note);
      }
    }
    return err;
  }
};

#define CGX_RETURN_IF_ERROR(expr)             \
  do {                                        \
    ffi::Error cgx_err_ = (expr);             \
    if (cgx_err_.failure()) return cgx_err_;  \
  } while (0)

ffi::Error QuantizeImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seeds, ffi::Buffer<ffi::S32> valid,
                        ffi::Result<ffi::Buffer<ffi::U8>> payload,
                        ffi::Result<ffi::Buffer<ffi::F32>> meta, int32_t bits, int64_t bucket_size,
                        bool stochastic) {
  const Checker c{"jax_cgx_quantize"};
  CGX_RETURN_IF_ERROR(c.attrs(bits, bucket_size));
  FloatType xt;
  CGX_RETURN_IF_ERROR(c.float_type("x", x.element_type(), &xt));
  CGX_RETURN_IF_ERROR(c.shape("x", x.dimensions(), {-1, -1}, "rank 2 [R, n]"));
  const int64_t rows = x.dimensions()[0], n = x.dimensions()[1];
  CGX_RETURN_IF_ERROR(c.shape("seeds", seeds.dimensions(), {rows, 2}, "[R, 2]"));
  const int32_t* counts;
  CGX_RETURN_IF_ERROR(c.valid_counts(valid, rows, &counts));
  // meta's bucket count nb picks m = min(n, nb * B): all of x, or whole
  // buckets only (skipping an incomplete last one, or more).
  const Dims md = meta->dimensions();
  const int64_t max_nb = bucket_count(n, bucket_size);
  if (md.size() != 3 || md[0] != rows || md[2] != 2 || md[1] < 0 || md[1] > max_nb) {
    return c.fail("meta has shape " + shape_str(md) + ", expected [R, nb, 2] with R = " +
                  std::to_string(rows) + " and nb <= ceil(n/B) = " + std::to_string(max_nb) +
                  " (n = " + std::to_string(n) + ", bucket_size = " + std::to_string(bucket_size) +
                  ")");
  }
  const int64_t m = md[1] == max_nb ? n : md[1] * bucket_size;  // nb < ceil(n/B): nb*B < n
  CGX_RETURN_IF_ERROR(
      c.packed("payload", payload->dimensions(), "meta", md, rows, -1, m, bucket_size, bits));
  jax_cgx::cpu::quantize(x.untyped_data(), xt, rows, n, m, seeds.typed_data(), counts, bits,
                         bucket_size, stochastic, payload->typed_data(), meta->typed_data());
  return ffi::Error::Success();
}

ffi::Error DequantizeImpl(ffi::Buffer<ffi::U8> payload, ffi::Buffer<ffi::F32> meta,
                          ffi::Result<ffi::AnyBuffer> out, int32_t bits, int64_t bucket_size) {
  const Checker c{"jax_cgx_dequantize"};
  CGX_RETURN_IF_ERROR(c.attrs(bits, bucket_size));
  FloatType ot;
  CGX_RETURN_IF_ERROR(c.float_type("out", out->element_type(), &ot));
  CGX_RETURN_IF_ERROR(c.shape("out", out->dimensions(), {-1, -1}, "rank 2 [R, m]"));
  const int64_t rows = out->dimensions()[0], m = out->dimensions()[1];
  CGX_RETURN_IF_ERROR(c.packed("payload", payload.dimensions(), "meta", meta.dimensions(), rows, -1,
                               m, bucket_size, bits));
  jax_cgx::cpu::dequantize(payload.typed_data(), meta.typed_data(), rows, m, bits, bucket_size,
                           out->untyped_data(), ot);
  return ffi::Error::Success();
}

// Shared checks of the two reduce targets; fills rows, inputs, m, types.
struct ReduceShapes {
  int64_t rows, inputs, m;
  FloatType addend_type, out_type;
  bool has_addend;
};

ffi::Error check_reduce(const Checker& c, const ffi::Buffer<ffi::U8>& payload,
                        const ffi::Buffer<ffi::F32>& meta, const ffi::AnyBuffer& addend,
                        const ffi::AnyBuffer& out, int32_t bits, int64_t bucket_size,
                        ReduceShapes* s) {
  CGX_RETURN_IF_ERROR(c.attrs(bits, bucket_size));
  CGX_RETURN_IF_ERROR(c.float_type("out", out.element_type(), &s->out_type));
  CGX_RETURN_IF_ERROR(c.float_type("addend", addend.element_type(), &s->addend_type));
  CGX_RETURN_IF_ERROR(c.shape("out", out.dimensions(), {-1, -1}, "rank 2 [R, m]"));
  s->rows = out.dimensions()[0];
  s->m = out.dimensions()[1];
  CGX_RETURN_IF_ERROR(
      c.shape("payload", payload.dimensions(), {s->rows, -1, -1}, "rank 3 [R, W, P]"));
  s->inputs = payload.dimensions()[1];
  const Dims ad = addend.dimensions();
  if (ad.size() != 2 || ad[0] != s->rows || (ad[1] != s->m && ad[1] != 0)) {
    return c.fail("addend has shape " + shape_str(ad) + ", expected [R, m] = " +
                  shape_str({s->rows, s->m}) + " or [R, 0] (no addend)");
  }
  s->has_addend = ad[1] == s->m;
  return c.packed("payload", payload.dimensions(), "meta", meta.dimensions(), s->rows, s->inputs,
                  s->m, bucket_size, bits);
}

ffi::Error DequantizeSumImpl(ffi::Buffer<ffi::U8> payload, ffi::Buffer<ffi::F32> meta,
                             ffi::AnyBuffer addend, ffi::Result<ffi::AnyBuffer> out, int32_t bits,
                             int64_t bucket_size) {
  const Checker c{"jax_cgx_dequantize_sum"};
  ReduceShapes s;
  CGX_RETURN_IF_ERROR(check_reduce(c, payload, meta, addend, *out, bits, bucket_size, &s));
  jax_cgx::cpu::dequantize_sum(payload.typed_data(), meta.typed_data(), s.rows, s.inputs, s.m,
                               bits, bucket_size, s.has_addend ? addend.untyped_data() : nullptr,
                               s.addend_type, out->untyped_data(), s.out_type);
  return ffi::Error::Success();
}

ffi::Error DequantizeSumRequantizeImpl(ffi::Buffer<ffi::U8> payload, ffi::Buffer<ffi::F32> meta,
                                       ffi::AnyBuffer addend, ffi::Buffer<ffi::U32> seeds,
                                       ffi::Buffer<ffi::S32> valid,
                                       ffi::Result<ffi::Buffer<ffi::U8>> payload_out,
                                       ffi::Result<ffi::Buffer<ffi::F32>> meta_out,
                                       ffi::Result<ffi::AnyBuffer> out, int32_t bits,
                                       int64_t bucket_size, bool stochastic) {
  const Checker c{"jax_cgx_dequantize_sum_requantize"};
  ReduceShapes s;
  CGX_RETURN_IF_ERROR(check_reduce(c, payload, meta, addend, *out, bits, bucket_size, &s));
  CGX_RETURN_IF_ERROR(c.shape("seeds", seeds.dimensions(), {s.rows, 2}, "[R, 2]"));
  const int32_t* counts;
  CGX_RETURN_IF_ERROR(c.valid_counts(valid, s.rows, &counts));
  CGX_RETURN_IF_ERROR(c.packed("payload result", payload_out->dimensions(), "meta result",
                               meta_out->dimensions(), s.rows, -1, s.m, bucket_size, bits));
  jax_cgx::cpu::dequantize_sum_requantize(
      payload.typed_data(), meta.typed_data(), s.rows, s.inputs, s.m, bits, bucket_size,
      s.has_addend ? addend.untyped_data() : nullptr, s.addend_type, seeds.typed_data(), counts,
      stochastic, payload_out->typed_data(), meta_out->typed_data(), out->untyped_data(),
      s.out_type);
  return ffi::Error::Success();
}

#undef CGX_RETURN_IF_ERROR

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuQuantize, QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()           // x
                                  .Arg<ffi::Buffer<ffi::U32>>()    // seeds
                                  .Arg<ffi::Buffer<ffi::S32>>()    // valid
                                  .Ret<ffi::Buffer<ffi::U8>>()     // payload
                                  .Ret<ffi::Buffer<ffi::F32>>()    // meta
                                  .Attr<int32_t>("bits")
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<bool>("stochastic"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuDequantize, DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // payload
                                  .Arg<ffi::Buffer<ffi::F32>>()  // meta
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Attr<int32_t>("bits")
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuDequantizeSum, DequantizeSumImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // payload
                                  .Arg<ffi::Buffer<ffi::F32>>()  // meta
                                  .Arg<ffi::AnyBuffer>()         // addend
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Attr<int32_t>("bits")
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuDequantizeSumRequantize, DequantizeSumRequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // payload
                                  .Arg<ffi::Buffer<ffi::F32>>()  // meta
                                  .Arg<ffi::AnyBuffer>()         // addend
                                  .Arg<ffi::Buffer<ffi::U32>>()  // seeds
                                  .Arg<ffi::Buffer<ffi::S32>>()  // valid
                                  .Ret<ffi::Buffer<ffi::U8>>()   // payload
                                  .Ret<ffi::Buffer<ffi::F32>>()  // meta
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Attr<int32_t>("bits")
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<bool>("stochastic"));
