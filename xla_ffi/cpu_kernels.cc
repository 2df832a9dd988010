// CPU kernels of the jax_cgx codec (see cpu_kernels.h): bucketing, row loops
// and run-time ISA dispatch; their building blocks are in cpu_kernel_ops.h.
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
#include "xla_ffi/cpu_kernels.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "xla_ffi/codec_math.h"
#include "xla_ffi/cpu_kernel_ops.h"

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

// ------------------------------------------------------------ row kernels

// `valid`: the row's first `valid` elements set its buckets' ranges; later
// ones (padding) are encoded within those ranges but never widen them.
struct QuantizeRow {
  const void* x;
  FloatType x_type;
  int64_t m, bucket, valid;
  uint32_t seed0, seed1;
  uint32_t index_base;  // stochastic rounding draws for element index_base + i
  uint8_t* payload;
  float* meta;
};

struct DequantizeRow {
  const uint8_t* payload;
  const float* meta;
  int64_t m, bucket;
  void* out;
  FloatType out_type;
  float out_scale;  // decoded values times this (1: as decoded)
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
  uint32_t index_base;  // as QuantizeRow's
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
  auto set_meta = [&](int64_t k, const MinMax& range, auto&& rescan) {
    const BucketMeta meta = meta_of<kBits>(range, rescan);
    a.meta[2 * k] = meta.min;
    a.meta[2 * k + 1] = meta.scale;
    return meta;
  };
  // Levels of elements [first, first + n) of bucket meta, from x.
  auto levels_of = [&](const BucketMeta& meta, const float* x, int64_t n, int64_t first,
                       uint8_t* levels) {
    encode_bucket<kBits, kStochastic>(meta, x, n, a.seed0, a.seed1, a.index_base + static_cast<uint32_t>(first),
                                      levels);
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
        const int64_t count = in_range(a.valid, start + off, len);
        minmax_update<kLanes>(x + off, count, range);
        const auto rescan = [&](BucketRange& r) { range_update(x + off, count, r); };
        levels_of(set_meta(k, range, rescan), x + off, len, start + off, levels + off);
      }
      if constexpr (kBits != 8) pack<kBits>(words, n, dst);
    } else {  // one long bucket: min/max over all pieces, then encode them
      MinMax range;
      for (int64_t s = 0; s < n; s += kPiece) {
        const int64_t len = std::min(kPiece, n - s);
        minmax_update<kLanes>(fetch(start + s, len), in_range(a.valid, start + s, len), range);
      }
      const auto rescan = [&](BucketRange& r) {
        for (int64_t s = 0; s < n; s += kPiece) {
          const int64_t len = std::min(kPiece, n - s);
          range_update(fetch(start + s, len), in_range(a.valid, start + s, len), r);
        }
      };
      const BucketMeta meta = set_meta(k0, range, rescan);
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
        decode_store(levels + off, std::min(B, len - off), a.meta[2 * k], a.meta[2 * k + 1], kBits,
                     element_ptr(a.out, a.out_type, start + s + off), a.out_type, tmp + off, a.out_scale);
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
        decode_accumulate(levels + off, std::min(B, len - off), meta[2 * k], meta[2 * k + 1], kBits,
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
  auto set_meta = [&](int64_t k, const MinMax& range, auto&& rescan) {
    const BucketMeta meta = meta_of<kBits>(range, rescan);
    a.meta_out[2 * k] = meta.min;
    a.meta_out[2 * k + 1] = meta.scale;
    return meta;
  };
  // Requantizes acc[off, off + len) (row elements from `first`) with meta:
  // levels to levels[off..], decoded values to out, kSpan at a time. acc is
  // dead after encoding and serves as decode_store's buffer.
  auto requantize = [&](const BucketMeta& meta, int64_t off, int64_t len, int64_t first,
                        uint8_t* levels) {
    for (int64_t t = 0; t < len; t += kSpan) {
      const int64_t i = off + t, n = std::min(kSpan, len - t);
      encode_bucket<kBits, kStochastic>(meta, acc + i, n, a.seed0, a.seed1,
                                        a.index_base + static_cast<uint32_t>(first + t), levels + i);
      decode_store(levels + i, n, meta.min, meta.scale, kBits,
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
        const int64_t count = in_range(a.valid, start + off, len);
        minmax_update<kLanes>(acc + off, count, range);
        const auto rescan = [&](BucketRange& r) { range_update(acc + off, count, r); };
        requantize(set_meta(k, range, rescan), off, len, start + off, levels);
      }
      if constexpr (kBits != 8) pack<kBits>(words, n, dst);
    } else {  // one long bucket: min/max over all pieces, then encode them
      MinMax range;
      for (int64_t s = 0; s < n; s += kPiece) {
        const int64_t len = std::min(kPiece, n - s);
        sum_into_acc(k0, k1, s, len);
        minmax_update<kLanes>(acc, in_range(a.valid, start + s, len), range);
      }
      const auto rescan = [&](BucketRange& r) {  // summed again, as below
        for (int64_t s = 0; s < n; s += kPiece) {
          const int64_t len = std::min(kPiece, n - s);
          sum_into_acc(k0, k1, s, len);
          range_update(acc, in_range(a.valid, start + s, len), r);
        }
      };
      const BucketMeta meta = set_meta(k0, range, rescan);
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
              bool stochastic, uint8_t* payload, float* meta, int64_t index_base) {
  if (m == 0) return;
  const QuantizeFn fn = kernels().quantize[bits - 1][stochastic ? 1 : 0];
  const int64_t p = payload_bytes(m, bucket_size, bits);
  const int64_t nb = bucket_count(m, bucket_size);
  for (int64_t r = 0; r < rows; ++r) {
    if (valid != nullptr && valid[r] <= 0) {
      // Nothing real: every bucket gets (0, 0), and inverse_scale(0) = 0 puts every
      // element, finite or not, at level 0 (codec_math.h). Those bytes, without
      // reading x: SRA and the reduce-scatter mark the chunk a rank keeps this way.
      std::memset(payload + r * p, 0, static_cast<size_t>(p));
      std::memset(meta + r * nb * 2, 0, static_cast<size_t>(nb) * 2 * sizeof(float));
      continue;
    }
    QuantizeRow row{element_ptr(x, x_type, r * n),
                    x_type,
                    m,
                    bucket_size,
                    valid != nullptr ? valid[r] : m,
                    stochastic ? seeds[2 * r] : 0u,
                    stochastic ? seeds[2 * r + 1] : 0u,
                    static_cast<uint32_t>(index_base),
                    payload + r * p,
                    meta + r * nb * 2};
    fn(row);
  }
}

void dequantize(const uint8_t* payload, const float* meta, int64_t rows, int64_t m, int bits,
                int64_t bucket_size, void* out, FloatType out_type, float out_scale) {
  if (m == 0) return;
  const DequantizeFn fn = kernels().dequantize[bits - 1];
  const int64_t p = payload_bytes(m, bucket_size, bits);
  const int64_t nb = bucket_count(m, bucket_size);
  for (int64_t r = 0; r < rows; ++r) {
    DequantizeRow row{payload + r * p, meta + r * nb * 2, m, bucket_size,
                      element_ptr(out, out_type, r * m), out_type, out_scale};
    fn(row);
  }
}

namespace {
void reduce(const uint8_t* payload, const float* meta, int64_t rows, int64_t inputs, int64_t m,
            int bits, int64_t bucket_size, const void* addend, FloatType addend_type,
            const uint32_t* seeds, const int32_t* valid, bool requantize, bool stochastic,
            int64_t index_base, uint8_t* payload_out, float* meta_out, void* out,
            FloatType out_type) {
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
                  static_cast<uint32_t>(index_base),
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
         /*requantize=*/false, /*stochastic=*/false, 0, nullptr, nullptr, out, out_type);
}

void dequantize_sum_requantize(const uint8_t* payload, const float* meta, int64_t rows,
                               int64_t inputs, int64_t m, int bits, int64_t bucket_size,
                               const void* addend, FloatType addend_type, const uint32_t* seeds,
                               const int32_t* valid, bool stochastic, uint8_t* payload_out,
                               float* meta_out, void* out, FloatType out_type, int64_t index_base) {
  reduce(payload, meta, rows, inputs, m, bits, bucket_size, addend, addend_type, seeds, valid,
         /*requantize=*/true, stochastic, index_base, payload_out, meta_out, out, out_type);
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
