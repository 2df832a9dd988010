// Device building blocks of the jax_cgx CUDA kernels (cuda/codec_kernels.cu):
// constants and thread primitives, index cursors, element loads and stores,
// the min/max reduction, level encoding and decoding, packed byte write-out,
// and the kernels' inputs and outputs. The per-element arithmetic is
// xla_ffi/codec_math.h; cuda/codec_kernels.cu explains the work decomposition.
//
// Everything is __host__ __device__ (CGX_HD) over a few thread primitives, so
// cuda/tests/emu.h can run it on the CPU (JAX_CGX_HOST_EMULATION).
#ifndef JAX_CGX_CUDA_CODEC_DEVICE_CUH_
#define JAX_CGX_CUDA_CODEC_DEVICE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "xla_ffi/cuda_kernels.h"
#include "xla_ffi/codec_math.h"

namespace jax_cgx::cuda {
namespace detail {

// ---------------------------------------------------------------- constants

// Full unrolling keeps per-group arrays in registers (a dynamically indexed
// array lives in local memory). The pragma means nothing to the host compiler.
#if defined(__CUDA_ARCH__)
#define CGX_UNROLL _Pragma("unroll")
#else
#define CGX_UNROLL
#endif

constexpr int kGroup = 8;                      // elements per packing group
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int kThreads = 256;                  // block size of every kernel
constexpr int kWarpsPerBlock = kThreads / kWarpSize;
constexpr int kMaxRegisterGroups = 4;          // groups a lane keeps in registers
constexpr int64_t kMaxBlocks = int64_t{1} << 16;  // grid cap; kernels grid-stride

// ------------------------------------------------------- thread primitives

struct ThreadPos {
  int64_t thread;         // threadIdx.x
  int64_t block;          // blockIdx.x
  int64_t block_threads;  // blockDim.x
  int64_t grid_blocks;    // gridDim.x
};

#if !defined(__CUDA_ARCH__) && defined(JAX_CGX_HOST_EMULATION)
// Provided by the host emulation test (see the file comment).
namespace emu {
ThreadPos position();
uint32_t shfl(uint32_t v, int src_lane, int width);
uint32_t shfl_xor(uint32_t v, int lane_mask);
void sync_block();
}  // namespace emu
#endif

CGX_HD ThreadPos thread_pos() {
#if defined(__CUDA_ARCH__)
  return ThreadPos{threadIdx.x, blockIdx.x, blockDim.x, gridDim.x};
#elif defined(JAX_CGX_HOST_EMULATION)
  return emu::position();
#else
  return ThreadPos{0, 0, 1, 1};  // host pass of nvcc: kernels never run here
#endif
}

// __shfl_sync over the full warp; src_lane is taken modulo width, within the
// caller's aligned segment of `width` lanes.
CGX_HD uint32_t warp_shfl(uint32_t v, int src_lane, int width) {
#if defined(__CUDA_ARCH__)
  return __shfl_sync(kFullMask, v, src_lane, width);
#elif defined(JAX_CGX_HOST_EMULATION)
  return emu::shfl(v, src_lane, width);
#else
  (void)src_lane;
  (void)width;
  return v;
#endif
}

CGX_HD uint32_t warp_shfl_xor(uint32_t v, int lane_mask) {
#if defined(__CUDA_ARCH__)
  return __shfl_xor_sync(kFullMask, v, lane_mask);
#elif defined(JAX_CGX_HOST_EMULATION)
  return emu::shfl_xor(v, lane_mask);
#else
  (void)lane_mask;
  return v;
#endif
}

CGX_HD void block_sync() {
#if defined(__CUDA_ARCH__)
  __syncthreads();
#elif defined(JAX_CGX_HOST_EMULATION)
  emu::sync_block();
#endif
}

// ------------------------------------------------------------ small helpers

CGX_HD int64_t groups_in(int64_t len) { return (len + kGroup - 1) / kGroup; }

// Elements (0..8) of group g of a bucket holding len elements.
CGX_HD int group_count(int64_t len, int64_t g) {
  const int64_t c = len - g * kGroup;
  return c <= 0 ? 0 : (c >= kGroup ? kGroup : static_cast<int>(c));
}

// Elements in bucket k of a row (only the last bucket may be short).
CGX_HD int64_t bucket_len(const RowLayout& l, int64_t k) {
  return k == l.buckets - 1 ? l.elems - k * l.bucket : l.bucket;
}

// Levels of one group, element e at bits [e*bits, (e+1)*bits) of the result:
// the group's `bits` bytes of the bucket stream, as a little-endian integer.
CGX_HD uint64_t pack_group(const uint32_t (&levels)[kGroup], int bits) {
  uint64_t packed = 0;
  CGX_UNROLL
  for (int e = 0; e < kGroup; ++e) packed |= static_cast<uint64_t>(levels[e]) << (e * bits);
  return packed;
}

CGX_HD uint32_t group_level(uint64_t packed, int e, int bits) {
  return static_cast<uint32_t>(packed >> (e * bits)) & max_level(bits);
}

// ------------------------------------------------------------ index cursors
//
// Grid-stride loops advance a flat index by a constant step. Rather than
// dividing the index by the row/bucket extents on every iteration (a 64-bit
// division costs dozens of instructions), the position is kept in mixed radix
// and the step is added digit by digit with carries.

// Bucket q = r*buckets + k.
struct BucketCursor {
  int64_t r, k;
  int64_t step_r, step_k;

  CGX_HD static BucketCursor start(int64_t q, int64_t step, int64_t buckets) {
    BucketCursor c;
    c.r = q / buckets;
    c.k = q - c.r * buckets;
    c.step_r = step / buckets;
    c.step_k = step - c.step_r * buckets;
    return c;
  }
  CGX_HD void advance(int64_t buckets) {
    k += step_k;  // < 2*buckets
    r += step_r;
    if (k >= buckets) {
      k -= buckets;
      ++r;
    }
  }
};

// Group f = (r*buckets + k)*groups + g, where every bucket counts `groups`
// groups (the last bucket of a row, if short, has empty trailing groups).
struct GroupCursor {
  int64_t r, k, g;
  int64_t step_r, step_k, step_g;

  CGX_HD static GroupCursor start(int64_t f, int64_t step, int64_t buckets, int64_t groups) {
    GroupCursor c;
    c.g = f % groups;
    const int64_t q = f / groups;
    c.r = q / buckets;
    c.k = q - c.r * buckets;
    c.step_g = step % groups;
    const int64_t step_q = step / groups;
    c.step_r = step_q / buckets;
    c.step_k = step_q - c.step_r * buckets;
    return c;
  }
  CGX_HD void advance(int64_t buckets, int64_t groups) {
    g += step_g;
    int64_t carry = 0;
    if (g >= groups) {
      g -= groups;
      carry = 1;
    }
    k += step_k + carry;  // <= 2*buckets - 1
    r += step_r;
    if (k >= buckets) {
      k -= buckets;
      ++r;
    }
  }
};

// ----------------------------------------------------------- element types

struct F32Type {
  using Storage = float;
  CGX_HD static float to_f32(float v) { return v; }
  CGX_HD static float from_f32(float f) { return f; }
};
struct BF16Type {
  using Storage = uint16_t;
  CGX_HD static float to_f32(uint16_t v) { return bf16_to_f32(v); }
  CGX_HD static uint16_t from_f32(float f) { return f32_to_bf16(f); }
};
struct F16Type {
  using Storage = uint16_t;
  CGX_HD static float to_f32(uint16_t v) { return f16_to_f32(v); }
  CGX_HD static uint16_t from_f32(float f) { return f32_to_f16(f); }
};

// Loads a group of cnt (<= 8) elements as f32; missing elements read as 0.
// `vec` promises p is 16-byte aligned, which makes a full group one (16-bit
// types) or two (f32) 16-byte loads.
template <class E>
CGX_HD void load_group(const typename E::Storage* p, int cnt, bool vec, float (&v)[kGroup]) {
  if (vec && cnt == kGroup) {
    if constexpr (sizeof(typename E::Storage) == 4) {
      const float4 a = reinterpret_cast<const float4*>(p)[0];
      const float4 b = reinterpret_cast<const float4*>(p)[1];
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
      v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
      const uint4 u = *reinterpret_cast<const uint4*>(p);
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
      CGX_UNROLL
      for (int i = 0; i < 4; ++i) {  // little endian: element 2i is the low half
        v[2 * i] = E::to_f32(static_cast<uint16_t>(w[i] & 0xFFFFu));
        v[2 * i + 1] = E::to_f32(static_cast<uint16_t>(w[i] >> 16));
      }
    }
    return;
  }
  CGX_UNROLL
  for (int e = 0; e < kGroup; ++e) v[e] = e < cnt ? E::to_f32(p[e]) : 0.0f;
}

// Stores the first cnt values of a group, rounded to E (nearest even).
template <class E>
CGX_HD void store_group(typename E::Storage* p, int cnt, bool vec, const float (&v)[kGroup]) {
  if (vec && cnt == kGroup) {
    if constexpr (sizeof(typename E::Storage) == 4) {
      reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
      uint32_t w[4];
      CGX_UNROLL
      for (int i = 0; i < 4; ++i) {
        w[i] = static_cast<uint32_t>(E::from_f32(v[2 * i])) |
               (static_cast<uint32_t>(E::from_f32(v[2 * i + 1])) << 16);
      }
      *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    return;
  }
CGX_UNROLL
  for (int e = 0; e < kGroup; ++e)
    if (e < cnt) p[e] = E::from_f32(v[e]);
}

// The same for a buffer whose element type is known only at run time (addend
// and out: one uniform branch per group is cheaper than more instantiations).
CGX_HD void load_group_any(FloatType t, const void* base, int64_t index, int cnt, bool vec,
                           float (&v)[kGroup]) {
  switch (t) {
    case FloatType::kF32:
      load_group<F32Type>(static_cast<const float*>(base) + index, cnt, vec, v);
      return;
    case FloatType::kBF16:
      load_group<BF16Type>(static_cast<const uint16_t*>(base) + index, cnt, vec, v);
      return;
    case FloatType::kF16:
      load_group<F16Type>(static_cast<const uint16_t*>(base) + index, cnt, vec, v);
      return;
  }
}

CGX_HD void store_group_any(FloatType t, void* base, int64_t index, int cnt, bool vec,
                            const float (&v)[kGroup]) {
  switch (t) {
    case FloatType::kF32:
      store_group<F32Type>(static_cast<float*>(base) + index, cnt, vec, v);
      return;
    case FloatType::kBF16:
      store_group<BF16Type>(static_cast<uint16_t*>(base) + index, cnt, vec, v);
      return;
    case FloatType::kF16:
      store_group<F16Type>(static_cast<uint16_t*>(base) + index, cnt, vec, v);
      return;
  }
}

// The `nbytes` (<= 8) packed bytes of a group, little endian. A whole group
// of a power-of-two width is one load when its address allows it; otherwise
// bytes (the L1 cache serves the neighbours' bytes of the same line).
CGX_HD uint64_t load_packed(const uint8_t* p, int nbytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (nbytes == 8 && (a & 7u) == 0) return *reinterpret_cast<const uint64_t*>(p);
  if (nbytes == 4 && (a & 3u) == 0) return *reinterpret_cast<const uint32_t*>(p);
  if (nbytes == 2 && (a & 1u) == 0) return *reinterpret_cast<const uint16_t*>(p);
  uint64_t v = 0;
  CGX_UNROLL
  for (int i = 0; i < 8; ++i)
    if (i < nbytes) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// ------------------------------------------------------- min/max reduction

// Running min/max of the finite values of flush(x), with NaNs and infinities
// set aside as flags (codec_math.h's BucketRange). min and max of a set do not
// depend on the order they are taken in, so any reduction tree gives the bits
// a scalar loop gives. (flush maps -0 to +0, so signed zeros never tie.)
constexpr uint32_t kSawNan = 1u, kSawPosInf = 2u, kSawNegInf = 4u;
struct MinMax {  // a plain aggregate: it also lives in __shared__ memory
  float mn, mx;
  uint32_t nan;  // kSaw* bits
};

CGX_HD MinMax minmax_empty() { return MinMax{bits_float(0x7F800000u), bits_float(0xFF800000u), 0u}; }

CGX_HD void minmax_add(MinMax& s, float x) {
  const float f = flush(x);
  if (f != f) {
    s.nan |= kSawNan;
  } else if (abs_f32(f) > kMaxFinite) {
    s.nan |= f > 0.0f ? kSawPosInf : kSawNegInf;
  } else {
    s.mn = f < s.mn ? f : s.mn;
    s.mx = f > s.mx ? f : s.mx;
  }
}

CGX_HD BucketRange range_of(const MinMax& s) {
  BucketRange r;
  r.mn = s.mn;
  r.mx = s.mx;
  r.nan = (s.nan & kSawNan) != 0u;
  r.pos_inf = (s.nan & kSawPosInf) != 0u;
  r.neg_inf = (s.nan & kSawNegInf) != 0u;
  return r;
}

CGX_HD void minmax_merge(MinMax& s, const MinMax& o) {
  s.mn = o.mn < s.mn ? o.mn : s.mn;
  s.mx = o.mx > s.mx ? o.mx : s.mx;
  s.nan |= o.nan;
}

// Butterfly over each aligned segment of `lanes` (a power of two) lanes:
// afterwards every lane of a segment holds the segment's result. Must be
// reached by all 32 lanes (lanes is uniform across the warp).
CGX_HD void segment_minmax(MinMax& s, int lanes) {
  for (int off = lanes >> 1; off > 0; off >>= 1) {
    MinMax o;
    o.mn = bits_float(warp_shfl_xor(float_bits(s.mn), off));
    o.mx = bits_float(warp_shfl_xor(float_bits(s.mx), off));
    o.nan = warp_shfl_xor(s.nan, off);
    minmax_merge(s, o);
  }
}

// ---------------------------------------------------------------- encoding

// Per-bucket constants of level computation.
struct Encoder {
  float mn, inv, top;
  bool finite;  // false: a NaN bucket, whose levels are all 0
  uint32_t flags;  // a flagged bucket's (codec_math.h): encoded by flagged_level
  bool stochastic;
  uint32_t seed0, seed1;
  int bits;
};

CGX_HD Encoder make_encoder(const BucketMeta& m, int bits, bool stochastic, uint32_t seed0,
                            uint32_t seed1) {
  Encoder c;
  c.mn = m.min;
  c.inv = inverse_scale(meta_scale(m.scale));
  c.top = static_cast<float>(max_level(bits));
  c.finite = m.min == m.min;  // make_meta sets min to NaN exactly for bad buckets
  c.flags = meta_flags(m.scale);
  c.stochastic = stochastic;
  c.seed0 = seed0;
  c.seed1 = seed1;
  c.bits = bits;
  return c;
}

// Packed levels of the first cnt values of a group whose first element is
// element `index0` of its row (the stochastic counter); other levels are 0.
CGX_HD uint64_t encode_group(const Encoder& c, const float (&v)[kGroup], int cnt, uint32_t index0) {
  uint32_t levels[kGroup];
  CGX_UNROLL
  for (int e = 0; e < kGroup; ++e) {
    uint32_t level = 0;
    if (c.finite && e < cnt) {
      const uint32_t random23 =
          c.stochastic ? random_bits(c.seed0, c.seed1, index0 + static_cast<uint32_t>(e)) : 0u;
      if (c.flags != 0u) {  // uniform over a bucket's lanes
        level = flagged_level(v[e], c.mn, c.inv, c.flags, c.bits, c.stochastic, random23);
      } else {
        const int32_t fixed = fixed_position(v[e], c.mn, c.inv, c.top);
        level = c.stochastic ? level_stochastic(fixed, random23) : level_nearest(fixed);
      }
    }
    levels[e] = level;
  }
  return pack_group(levels, c.bits);
}

// `scale` is the metadata's scale field (flags and all).
CGX_HD void decode_group(uint64_t packed, float mn, float scale, int bits, float (&d)[kGroup]) {
  if (const uint32_t flags = meta_flags(scale); flags != 0u) {  // uniform over a bucket's lanes
    const float s = meta_scale(scale);
    CGX_UNROLL
    for (int e = 0; e < kGroup; ++e) d[e] = flagged_decode(group_level(packed, e, bits), mn, s, flags, bits);
    return;
  }
  CGX_UNROLL
  for (int e = 0; e < kGroup; ++e) d[e] = decode(group_level(packed, e, bits), mn, scale);
}

// --------------------------------------------------- packed byte write-out
//
// A segment of L lanes holding L consecutive groups (lane j: group j, `bits`
// bytes) owns a contiguous span of L*bits bytes. Written lane by lane, each
// lane's bytes are `bits` apart from its neighbours': a byte-strided store
// for most widths. Instead lane j assembles 32-bit word j (and j + L) of the
// span from the one to four groups it overlaps, fetched with shuffles, and
// stores it whole when it is aligned and fully inside the bucket.

// Word w of a span starts in group 4w / bits, `shift` bits into it.
struct WordSource {
  int group;
  int shift;
};

CGX_HD WordSource word_source(int w, int bits) {
  WordSource s;
  s.group = (4 * w) / bits;
  s.shift = 8 * (4 * w - s.group * bits);  // 0 <= shift < 8*bits
  return s;
}

// Word from groups (group, group+1, ...) = p[0..3]; each p[t] has no bits above
// its 8*bits. Group t covers bits [8*bits*t - shift, ...) of the word, so only
// t < 4 (bits == 1) or t < 2 (bits >= 2) can reach its 32 bits.
CGX_HD uint32_t assemble_word(const uint64_t (&p)[4], int shift, int bits) {
  uint64_t w = p[0] >> shift;
  CGX_UNROLL
  for (int t = 1; t < 4; ++t) {
    const int at = 8 * bits * t - shift;  // > 0
    if (at < 32) w |= p[t] << at;
  }
  return static_cast<uint32_t>(w);
}

// Stores the low n (clamped to 0..4) bytes of word at p; one 32-bit store when
// all four are wanted and p is aligned.
CGX_HD void write_word(uint8_t* p, uint32_t word, int n) {
  if (n <= 0) return;
  if (n >= 4 && (reinterpret_cast<uintptr_t>(p) & 3u) == 0) {
    *reinterpret_cast<uint32_t*>(p) = word;
    return;
  }
  CGX_UNROLL
  for (int i = 0; i < 4 && i < n; ++i) p[i] = static_cast<uint8_t>(word >> (8 * i));
}

// What a lane writes in every round: words lane and lane + L of the span.
// Fixed for a kernel, so the divisions happen once per thread.
struct WordPlan {
  int lanes;  // L: lanes per segment (power of two)
  int lane;   // this lane's index in its segment
  int bits;
  int words;  // ceil(L*bits/4) words in a span; each lane writes <= 2 of them
  WordSource src[2];
};

CGX_HD WordPlan make_word_plan(int lane, int lanes, int bits) {
  WordPlan p;
  p.lanes = lanes;
  p.lane = lane;
  p.bits = bits;
  p.words = (lanes * bits + 3) / 4;
  CGX_UNROLL
  for (int t = 0; t < 2; ++t) p.src[t] = word_source(lane + lanes * t, bits);
  return p;
}

CGX_HD uint64_t shfl_packed(uint64_t v, int src_group, int lanes, bool wide) {
  const uint32_t lo = warp_shfl(static_cast<uint32_t>(v), src_group, lanes);
  // `wide` is uniform over the warp, so every lane takes the same branch.
  const uint32_t hi = wide ? warp_shfl(static_cast<uint32_t>(v >> 32), src_group, lanes) : 0u;
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// One round: the segment's lanes hold `packed` for groups 0..L-1 of a span that
// starts at dst; the first `valid` bytes of the span belong to the bucket (the
// rest is the next bucket's, or past the bucket's groups). Lanes whose groups
// are past the bucket must pass packed = 0. Reached by all 32 lanes.
CGX_HD void store_round(uint8_t* dst, int64_t valid, uint64_t packed, const WordPlan& plan) {
  const int span = plan.lanes * plan.bits;
  const int nvalid = valid <= 0 ? 0 : (valid >= span ? span : static_cast<int>(valid));
  const bool wide = plan.bits > 4;  // a group's bytes fit in 32 bits up to 4 bits
  CGX_UNROLL
  for (int t = 0; t < 2; ++t) {
    if (plan.lanes * t >= plan.words) break;  // uniform: words lane + L*t >= words for all
    const WordSource s = plan.src[t];
    // Groups at s.group + i >= L wrap around to other lanes' groups; their
    // bits only land in bytes at or beyond span, which are never stored.
    uint64_t p[4];
    p[0] = shfl_packed(packed, s.group, plan.lanes, wide);
    p[1] = shfl_packed(packed, s.group + 1, plan.lanes, wide);
    if (plan.bits == 1) {
      p[2] = shfl_packed(packed, s.group + 2, plan.lanes, false);
      p[3] = shfl_packed(packed, s.group + 3, plan.lanes, false);
    } else {
      p[2] = 0;
      p[3] = 0;
    }
    const int w = plan.lane + plan.lanes * t;
    write_word(dst + 4 * w, assemble_word(p, s.shift, plan.bits), nvalid - 4 * w);
  }
}

// ------------------------------------------------------------------ inputs
//
// A quantizing kernel reads its f32 values through an input; load() fills the
// groups g0, g0 + gstep, ... (cnt[i] elements each, 0 = none) of bucket k of
// row r. Lanes of finished segments pass all-zero counts and must not read.

// quantize: the rows of x.
template <class E, bool kVec>
struct ArrayInput {
  static constexpr bool kPrefetch = true;  // plain loads: worth issuing a bucket ahead
  const typename E::Storage* x;
  int64_t row_stride;  // n (x may be longer than the m elements encoded)

  template <int G>
  CGX_HD void load(const RowLayout& l, int64_t r, int64_t k, int64_t g0, int64_t gstep,
                   const int (&cnt)[G], float (&v)[G][kGroup]) const {
    CGX_UNROLL
    for (int i = 0; i < G; ++i) {
      if (cnt[i] > 0) {
        const int64_t e0 = k * l.bucket + (g0 + i * gstep) * kGroup;
        load_group<E>(x + r * row_stride + e0, cnt[i], kVec, v[i]);
      } else {
        CGX_UNROLL
        for (int e = 0; e < kGroup; ++e) v[i][e] = 0.0f;
      }
    }
  }
};

// dequantize_sum(_requantize): acc = flush(addend) (or the first decoded
// input), then acc = accumulate(acc, decode(input w)) for w = 0..W-1.
// Without an addend, starting from decode(input 0) instead of
// accumulate(+0, decode(input 0)) gives the same bits: decode's result is
// flushed, so +0 + d == d (+0 stays +0, NaN stays NaN).
struct SumInput {
  static constexpr bool kPrefetch = false;  // its loads decode and add: nothing to hide
  const uint8_t* payload;  // [R, W, P]
  const float* meta;       // [R, W, nb, 2]
  int64_t inputs;          // W
  const void* addend;      // [R, m] or nullptr
  FloatType addend_type;
  bool addend_vec;         // addend groups are 16-byte aligned

  template <int G>
  CGX_HD void load(const RowLayout& l, int64_t r, int64_t k, int64_t g0, int64_t gstep,
                   const int (&cnt)[G], float (&v)[G][kGroup]) const {
    bool any = false;
    CGX_UNROLL
    for (int i = 0; i < G; ++i) {
      any = any || cnt[i] > 0;
      CGX_UNROLL
      for (int e = 0; e < kGroup; ++e) v[i][e] = 0.0f;
    }
    if (!any) return;  // r, k may be out of range: touch nothing
    if (addend != nullptr) {
      CGX_UNROLL
      for (int i = 0; i < G; ++i) {
        if (cnt[i] == 0) continue;
        const int64_t e0 = k * l.bucket + (g0 + i * gstep) * kGroup;
        load_group_any(addend_type, addend, r * l.elems + e0, cnt[i], addend_vec, v[i]);
        CGX_UNROLL
        for (int e = 0; e < kGroup; ++e) v[i][e] = flush(v[i][e]);
      }
    }
    for (int64_t w = 0; w < inputs; ++w) {
      const int64_t rw = r * inputs + w;
      const uint8_t* bucket = payload + rw * l.row_bytes + k * l.bucket_bytes;
      const float* bm = meta + 2 * (rw * l.buckets + k);
      const float mn = bm[0];
      const float scale = bm[1];
      const bool first = w == 0 && addend == nullptr;
      CGX_UNROLL
      for (int i = 0; i < G; ++i) {
        if (cnt[i] == 0) continue;
        const int64_t g = g0 + i * gstep;
        // A short last group owns only ceil(cnt*bits/8) bytes: read no more.
        const uint64_t packed =
            load_packed(bucket + g * l.bits, static_cast<int>(packed_bytes(cnt[i], l.bits)));
        float d[kGroup];
        decode_group(packed, mn, scale, l.bits, d);
        CGX_UNROLL
        for (int e = 0; e < kGroup; ++e) v[i][e] = first ? d[e] : accumulate(v[i][e], d[e]);
      }
    }
  }
};

// ----------------------------------------------------------------- outputs

// quantize writes no decoded values.
struct NoOutput {
  static constexpr bool kEnabled = false;
  CGX_HD void store(const RowLayout&, int64_t, int64_t, int, const float (&)[kGroup]) const {}
};

// out[R, m] of any float type.
struct ArrayOutput {
  static constexpr bool kEnabled = true;
  void* out;
  FloatType type;
  bool vec;                // out groups are 16-byte aligned
  float scale = 1.0f;      // values are stored times this (scale_output: a mean's 1/W)

  CGX_HD void store(const RowLayout& l, int64_t r, int64_t e0, int cnt,
                    const float (&v)[kGroup]) const {
    if (scale == 1.0f) {
      store_group_any(type, out, r * l.elems + e0, cnt, vec, v);
      return;
    }
    float scaled[kGroup];
    for (int i = 0; i < kGroup; ++i) scaled[i] = scale_output(v[i], scale);
    store_group_any(type, out, r * l.elems + e0, cnt, vec, scaled);
  }
};

// Where quantized buckets go.
struct QuantOut {
  uint8_t* payload;       // [R, P]
  float* meta;            // [R, nb, 2]
  const uint32_t* seeds;  // [R, 2], read only when stochastic
  bool stochastic;
  ValidCounts valid;      // which elements set the ranges

  // Elements of bucket (r, k) that enter its range: those before this bound.
  CGX_HD int64_t range_limit(const RowLayout& l, int64_t r, int64_t k) const {
    int64_t count;
    if (valid.rows != nullptr) {
      count = valid.rows[r];
    } else {
      const int64_t total = valid.total_dev != nullptr ? *valid.total_dev : valid.total;
      count = total - (valid.first + r * valid.row_step);
    }
    return count - k * l.bucket;
  }
};

// ---------------------------------------------------------- launch geometry

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline unsigned grid_for(int64_t items, int64_t items_per_block) {
  int64_t blocks = ceil_div(items, items_per_block);
  if (blocks < 1) blocks = 1;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<unsigned>(blocks);
}

// Whether every full group of a [rows, row_stride] buffer of elem_bytes-sized
// elements, cut into l's buckets, starts on a 16-byte boundary.
inline bool groups_aligned16(const void* base, int64_t rows, int64_t row_stride,
                             const RowLayout& l, int64_t elem_bytes) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  if (rows > 1 && (row_stride * elem_bytes) % 16 != 0) return false;
  if (l.buckets > 1 && (l.bucket * elem_bytes) % 16 != 0) return false;
  return true;  // and kGroup * elem_bytes is a multiple of 16
}

}  // namespace detail
}  // namespace jax_cgx::cuda

#endif  // JAX_CGX_CUDA_CODEC_DEVICE_CUH_
