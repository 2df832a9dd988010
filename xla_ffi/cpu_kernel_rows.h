// The CPU codec's row kernels, as templates over the vector lanes, the width
// and the rounding; a variant file instantiates them for its ISA with
// CGX_DEFINE_WIDTHS, the widths of one part at a time (cpu_kernel_table.h says
// why). How they are fast without changing a bit of the result: cpu_kernels.cc.
#pragma once

#include <algorithm>
#include <cstring>

#include "xla_ffi/codec_math.h"
#include "xla_ffi/cpu_kernel_ops.h"
#include "xla_ffi/cpu_kernel_table.h"

namespace jax_cgx::cpu {
namespace {

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

}  // namespace
}  // namespace jax_cgx::cpu

// The widths this object holds (as CGX_PART_WIDTHS(F, NS): F(NS, bits) for
// each). CMakeLists.txt compiles each variant's file once per part,
// CGX_KERNEL_PART = 0..3, two widths each (1 with 8, 2 with 7, ...: the four
// parts measured within 10% of each other's compile time); a build that
// defines no part gets all eight.
#if !defined(CGX_KERNEL_PART)
#define CGX_PART_WIDTHS(F, NS) F(NS, 1) F(NS, 2) F(NS, 3) F(NS, 4) F(NS, 5) F(NS, 6) F(NS, 7) F(NS, 8)
#elif CGX_KERNEL_PART == 0
#define CGX_PART_WIDTHS(F, NS) F(NS, 1) F(NS, 8)
#elif CGX_KERNEL_PART == 1
#define CGX_PART_WIDTHS(F, NS) F(NS, 2) F(NS, 7)
#elif CGX_KERNEL_PART == 2
#define CGX_PART_WIDTHS(F, NS) F(NS, 3) F(NS, 6)
#elif CGX_KERNEL_PART == 3
#define CGX_PART_WIDTHS(F, NS) F(NS, 4) F(NS, 5)
#else
#error "CGX_KERNEL_PART must be 0, 1, 2 or 3"
#endif

// One variant's entry points (namespace NS) with the given target attributes,
// for this part's widths (NS_width_BITS, declared in cpu_kernel_table.h).
// `flatten` inlines the whole kernel into them, so every loop is vectorized
// for that target. LANES: lanes of the min/max vectors, one register of the
// target.
#define CGX_DEFINE_WIDTHS(NS, LANES, ATTRS)                                                      \
  namespace {                                                                                    \
  namespace NS {                                                                                 \
  template <int kBits, bool kStochastic>                                                         \
  ATTRS void quantize_row(const QuantizeRow& a) {                                                \
    quantize_row_impl<LANES, kBits, kStochastic>(a);                                             \
  }                                                                                              \
  template <int kBits>                                                                           \
  ATTRS void dequantize_row(const DequantizeRow& a) {                                            \
    dequantize_row_impl<kBits>(a);                                                               \
  }                                                                                              \
  template <int kBits, bool kRequantize, bool kStochastic>                                       \
  ATTRS void reduce_row(const ReduceRow& a) {                                                    \
    reduce_row_impl<LANES, kBits, kRequantize, kStochastic>(a);                                  \
  }                                                                                              \
  }                                                                                              \
  }                                                                                              \
  CGX_PART_WIDTHS(CGX_DEFINE_WIDTH, NS)

#define CGX_DEFINE_WIDTH(NS, BITS)                                                                 \
  const WidthKernels NS##_width_##BITS = {                                                         \
      {&NS::quantize_row<BITS, false>, &NS::quantize_row<BITS, true>},                             \
      &NS::dequantize_row<BITS>,                                                                   \
      {&NS::reduce_row<BITS, false, false>, &NS::reduce_row<BITS, true, false>,                    \
       &NS::reduce_row<BITS, true, true>}};
