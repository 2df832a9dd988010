// CUDA kernels of the jax_cgx codec.
//
// Every value these kernels write is the one a scalar loop over
// xla_ffi/codec_math.h produces: the same per-element functions, the same
// min/max (order-independent, hence exact under any reduction tree) and the
// same accumulation order. Build with --fmad=false (CMakeLists.txt does).
//
// Work decomposition
//   * An element group is 8 consecutive elements of a bucket. Its 8 levels fill
//     exactly `bits` whole bytes of the bucket's LSB-first bit stream, so every
//     lane packs and unpacks whole bytes on its own; a bucket's last group may
//     be short, and its missing levels are 0 (the zero padding bits).
//   * quantize and dequantize_sum_requantize need each bucket's min/max first.
//     Buckets of up to 32*8*4 = 1024 elements go to a segment of 1..32 lanes of
//     a warp (sized to the bucket) that keeps the bucket in registers and reduces
//     with shuffles: the input is read once. Larger buckets go to a whole block
//     that reads the bucket twice (min/max, then encode); the second read comes
//     from L2 for all but huge buckets.
//   * Packed bytes are written as whole 32-bit words where aligned: lanes trade
//     their group bytes with shuffles so that lane j writes word j of the
//     segment's span (coalesced for every bit width, not only 1, 2, 4 and 8).
//   * dequantize(_sum) needs no reduction: one thread per element group, over a
//     flattened (row, bucket, group) index advanced without divisions.
//
// All index arithmetic is int64: rows * buckets may exceed 2^31, and payload
// offsets may exceed 2^31 bytes. Grids are capped and every kernel loops.
//
// The kernel bodies are __host__ __device__ templates over a few thread
// primitives (thread_pos, shuffles, block barrier). On the device these are the
// CUDA intrinsics; a host test may define JAX_CGX_HOST_EMULATION and provide
// them (cooperative fibers that meet at each shuffle and barrier) to run the
// exact kernel code on the CPU against a scalar reference.
#include "cuda/codec_kernels.h"

#include <cuda_runtime.h>

#include <cstdint>

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

// Running min/max of flush(x) with NaNs set aside. min and max of a set do not
// depend on the order they are taken in, so any reduction tree gives the bits
// a scalar loop gives. (flush maps -0 to +0, so signed zeros never tie.)
struct MinMax {  // a plain aggregate: it also lives in __shared__ memory
  float mn, mx;
  uint32_t nan;
};

CGX_HD MinMax minmax_empty() { return MinMax{bits_float(0x7F800000u), bits_float(0xFF800000u), 0u}; }

CGX_HD void minmax_add(MinMax& s, float x) {
  const float f = flush(x);
  if (f != f) {
    s.nan = 1u;
  } else {
    s.mn = f < s.mn ? f : s.mn;
    s.mx = f > s.mx ? f : s.mx;
  }
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
  bool finite;  // false: a NaN/overflow bucket, whose levels are all 0
  bool stochastic;
  uint32_t seed0, seed1;
  int bits;
};

CGX_HD Encoder make_encoder(const BucketMeta& m, int bits, bool stochastic, uint32_t seed0,
                            uint32_t seed1) {
  Encoder c;
  c.mn = m.min;
  c.inv = inverse_scale(m.scale);
  c.top = static_cast<float>(max_level(bits));
  c.finite = m.min == m.min;  // make_meta sets min to NaN exactly for bad buckets
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
      const int32_t fixed = fixed_position(v[e], c.mn, c.inv, c.top);
      level = c.stochastic
                  ? level_stochastic(fixed, random_bits(c.seed0, c.seed1, index0 + static_cast<uint32_t>(e)))
                  : level_nearest(fixed);
    }
    levels[e] = level;
  }
  return pack_group(levels, c.bits);
}

CGX_HD void decode_group(uint64_t packed, float mn, float scale, int bits, float (&d)[kGroup]) {
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
        CGX_UNROLL
        for (int e = 0; e < kGroup; ++e) {
          const float d = decode(group_level(packed, e, l.bits), mn, scale);
          v[i][e] = first ? d : accumulate(v[i][e], d);
        }
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
  bool vec;  // out groups are 16-byte aligned

  CGX_HD void store(const RowLayout& l, int64_t r, int64_t e0, int cnt,
                    const float (&v)[kGroup]) const {
    store_group_any(type, out, r * l.elems + e0, cnt, vec, v);
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

// -------------------------------------------------------- kernel bodies

// Where bucket (r, k) goes once its min/max is reduced: its metadata, level
// encoder, payload bytes and their address. The lane with write_meta set
// stores the metadata. Inactive lanes (no bucket) get bytes = 0.
struct BucketTarget {
  BucketMeta meta;
  Encoder enc;
  uint8_t* dst;   // the bucket's first payload byte
  int64_t bytes;  // ceil(len*bits/8)
};

CGX_HD BucketTarget begin_bucket(const RowLayout& l, const QuantOut& q, bool active, int64_t r,
                                 int64_t k, int64_t len, const MinMax& mm, bool write_meta) {
  BucketTarget t;
  t.meta = make_meta(mm.mn, mm.mx, mm.nan != 0u, l.bits);
  uint32_t seed0 = 0, seed1 = 0;
  t.dst = q.payload;
  t.bytes = 0;
  if (active) {
    if (write_meta) {
      float* bm = q.meta + 2 * (r * l.buckets + k);
      bm[0] = t.meta.min;
      bm[1] = t.meta.scale;
    }
    if (q.stochastic) {
      seed0 = q.seeds[2 * r];
      seed1 = q.seeds[2 * r + 1];
    }
    t.dst = q.payload + r * l.row_bytes + k * l.bucket_bytes;
    t.bytes = packed_bytes(len, l.bits);
  }
  t.enc = make_encoder(t.meta, l.bits, q.stochastic, seed0, seed1);
  return t;
}

// Encodes this lane's group g (cnt values v) of the bucket and writes the
// round of plan.lanes consecutive groups it belongs to, which starts `before`
// bytes into the bucket. Reached by all 32 lanes.
template <class Sink>
CGX_HD void encode_round(const Sink& sink, const RowLayout& l, const WordPlan& plan,
                         const BucketTarget& t, int64_t r, int64_t k, int64_t g, int64_t before,
                         int cnt, const float (&v)[kGroup]) {
  const uint32_t index0 = static_cast<uint32_t>(l.index_base + k * l.bucket + g * kGroup);
  const uint64_t packed = encode_group(t.enc, v, cnt, index0);  // 0 when cnt == 0
  store_round(t.bytes > 0 ? t.dst + before : t.dst, t.bytes - before, packed, plan);
  if constexpr (Sink::kEnabled) {
    if (cnt > 0) {
      float d[kGroup];
      decode_group(packed, t.meta.min, t.meta.scale, l.bits, d);
      sink.store(l, r, k * l.bucket + g * kGroup, cnt, d);
    }
  }
}

// Buckets of at most lanes*G*8 elements: each aligned segment of `lanes`
// lanes of a warp quantizes one bucket per iteration with the bucket in
// registers (lane j holds groups j, j + lanes, ...; G > 1 only when lanes = 32).
template <class Src, class Sink, int G>
CGX_HD void quantize_segments(const Src& src, const Sink& sink, const RowLayout& l,
                              const QuantOut& q, int lanes) {
  const ThreadPos tp = thread_pos();
  const int lane = static_cast<int>(tp.thread % kWarpSize);
  const int seg = lane / lanes;
  const int sl = lane % lanes;
  const int64_t per_warp = kWarpSize / lanes;
  const int64_t warp = (tp.block * tp.block_threads + tp.thread) / kWarpSize;
  const int64_t warps = tp.grid_blocks * tp.block_threads / kWarpSize;
  const int64_t total = l.rows * l.buckets;
  const int64_t step = warps * per_warp;
  const WordPlan plan = make_word_plan(sl, lanes, l.bits);
  BucketCursor cur = BucketCursor::start(warp * per_warp + seg, step, l.buckets);
  // `first` is uniform over the warp, so all lanes run every iteration (the
  // shuffles need them); lanes past the last bucket idle through it.
  for (int64_t first = warp * per_warp; first < total; first += step, cur.advance(l.buckets)) {
    const bool active = cur.r < l.rows;
    const int64_t len = active ? bucket_len(l, cur.k) : 0;
    int cnt[G];
    CGX_UNROLL
    for (int i = 0; i < G; ++i) cnt[i] = group_count(len, sl + static_cast<int64_t>(i) * lanes);
    float v[G][kGroup];
    src.template load<G>(l, cur.r, cur.k, sl, lanes, cnt, v);
    const int64_t limit = active ? q.range_limit(l, cur.r, cur.k) : 0;
    MinMax mm = minmax_empty();
    CGX_UNROLL
    for (int i = 0; i < G; ++i) {
      const int64_t first = (sl + static_cast<int64_t>(i) * lanes) * kGroup;
      CGX_UNROLL
      for (int e = 0; e < kGroup; ++e) {
        if (e < cnt[i] && first + e < limit) minmax_add(mm, v[i][e]);
      }
    }
    segment_minmax(mm, lanes);
    const BucketTarget t = begin_bucket(l, q, active, cur.r, cur.k, len, mm, sl == 0);
    CGX_UNROLL
    for (int i = 0; i < G; ++i) {
      // Round i: groups i*lanes .. i*lanes + lanes-1, lane sl holding i*lanes + sl.
      const int64_t round_first = static_cast<int64_t>(i) * lanes;
      encode_round(sink, l, plan, t, cur.r, cur.k, round_first + sl, round_first * l.bits, cnt[i],
                   v[i]);
    }
  }
}

// Larger buckets: one block per bucket and iteration. Pass 1 reduces min/max
// over the bucket, pass 2 reads it again (from L2) and encodes; warp w of the
// block handles groups g0 + 32w .. g0 + 32w + 31 of each pass-2 round.
// `partial` is __shared__ storage for one MinMax per warp.
template <class Src, class Sink>
CGX_HD void quantize_blocks(const Src& src, const Sink& sink, const RowLayout& l,
                            const QuantOut& q, MinMax* partial) {
  const ThreadPos tp = thread_pos();
  const int lane = static_cast<int>(tp.thread % kWarpSize);
  const int64_t warp = tp.thread / kWarpSize;
  const int64_t nwarps = tp.block_threads / kWarpSize;
  const int64_t total = l.rows * l.buckets;
  const WordPlan plan = make_word_plan(lane, kWarpSize, l.bits);
  for (int64_t b = tp.block; b < total; b += tp.grid_blocks) {  // uniform over the block
    const int64_t r = b / l.buckets;
    const int64_t k = b - r * l.buckets;
    const int64_t len = bucket_len(l, k);
    const int64_t groups = groups_in(len);

    const int64_t limit = q.range_limit(l, r, k);
    MinMax mm = minmax_empty();
    for (int64_t g = tp.thread; g < groups; g += tp.block_threads) {
      const int cnt[1] = {group_count(len, g)};
      float v[1][kGroup];
      src.template load<1>(l, r, k, g, 0, cnt, v);
      CGX_UNROLL
      for (int e = 0; e < kGroup; ++e) {
        if (e < cnt[0] && g * kGroup + e < limit) minmax_add(mm, v[0][e]);
      }
    }
    segment_minmax(mm, kWarpSize);
    if (lane == 0) partial[warp] = mm;
    block_sync();
    mm = partial[0];
    for (int64_t i = 1; i < nwarps; ++i) minmax_merge(mm, partial[i]);
    block_sync();  // partial is rewritten for the next bucket

    const BucketTarget t = begin_bucket(l, q, true, r, k, len, mm, tp.thread == 0);
    for (int64_t g0 = 0; g0 < groups; g0 += tp.block_threads) {
      const int64_t g = g0 + tp.thread;
      const int cnt[1] = {group_count(len, g)};
      float v[1][kGroup];
      src.template load<1>(l, r, k, g, 0, cnt, v);
      const int64_t round_first = g0 + warp * kWarpSize;  // this warp's first group
      encode_round(sink, l, plan, t, r, k, g, round_first * l.bits, cnt[0], v[0]);
    }
  }
}

// dequantize_sum: one thread per element group.
CGX_HD void dequantize_sum_groups(const SumInput& src, const ArrayOutput& sink, const RowLayout& l) {
  const ThreadPos tp = thread_pos();
  const int64_t groups = groups_in(l.bucket);
  GroupCursor c = GroupCursor::start(tp.block * tp.block_threads + tp.thread,
                                     tp.grid_blocks * tp.block_threads, l.buckets, groups);
  for (; c.r < l.rows; c.advance(l.buckets, groups)) {
    const int cnt[1] = {group_count(bucket_len(l, c.k), c.g)};
    if (cnt[0] == 0) continue;  // padding group of a short last bucket
    float v[1][kGroup];
    src.load<1>(l, c.r, c.k, c.g, 0, cnt, v);
    sink.store(l, c.r, c.k * l.bucket + c.g * kGroup, cnt[0], v[0]);
  }
}

// ------------------------------------------------------------------ kernels

template <class Src, class Sink, int G>
__global__ void __launch_bounds__(kThreads)
    quantize_segments_kernel(Src src, Sink sink, RowLayout l, QuantOut q, int lanes) {
  quantize_segments<Src, Sink, G>(src, sink, l, q, lanes);
}

template <class Src, class Sink>
__global__ void __launch_bounds__(kThreads)
    quantize_blocks_kernel(Src src, Sink sink, RowLayout l, QuantOut q) {
  __shared__ MinMax partial[kWarpsPerBlock];
  quantize_blocks<Src, Sink>(src, sink, l, q, partial);
}

__global__ void __launch_bounds__(kThreads)
    dequantize_sum_kernel(SumInput src, ArrayOutput sink, RowLayout l) {
  dequantize_sum_groups(src, sink, l);
}

// ---------------------------------------------------------------- launchers

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

// How a quantizing launch covers its buckets: segments of `lanes` lanes with
// `groups` register groups per lane, or (groups == 0) one block per bucket.
struct QuantizePlan {
  int lanes;
  int groups;
  int64_t buckets_per_block;
};

inline QuantizePlan plan_quantize(const RowLayout& l) {
  const int64_t groups = groups_in(l.bucket);
  if (groups <= kWarpSize) {
    int lanes = 1;
    while (lanes < groups) lanes *= 2;
    return QuantizePlan{lanes, 1, int64_t{kWarpsPerBlock} * (kWarpSize / lanes)};
  }
  if (groups <= 2 * kWarpSize) return QuantizePlan{kWarpSize, 2, kWarpsPerBlock};
  if (groups <= kMaxRegisterGroups * kWarpSize) {
    return QuantizePlan{kWarpSize, kMaxRegisterGroups, kWarpsPerBlock};
  }
  return QuantizePlan{kWarpSize, 0, 1};
}

template <class Src, class Sink>
cudaError_t launch_quantize(cudaStream_t stream, const RowLayout& l, const Src& src,
                            const Sink& sink, const QuantOut& q) {
  const QuantizePlan p = plan_quantize(l);
  const unsigned grid = grid_for(l.rows * l.buckets, p.buckets_per_block);
  switch (p.groups) {
    case 1:
      quantize_segments_kernel<Src, Sink, 1><<<grid, kThreads, 0, stream>>>(src, sink, l, q, p.lanes);
      break;
    case 2:
      quantize_segments_kernel<Src, Sink, 2><<<grid, kThreads, 0, stream>>>(src, sink, l, q, p.lanes);
      break;
    case kMaxRegisterGroups:
      quantize_segments_kernel<Src, Sink, kMaxRegisterGroups>
          <<<grid, kThreads, 0, stream>>>(src, sink, l, q, p.lanes);
      break;
    default:
      quantize_blocks_kernel<Src, Sink><<<grid, kThreads, 0, stream>>>(src, sink, l, q);
      break;
  }
  return cudaGetLastError();
}

template <class E>
cudaError_t launch_quantize_array(cudaStream_t stream, const RowLayout& l, const void* x,
                                  int64_t row_stride, const QuantOut& q) {
  const auto* px = static_cast<const typename E::Storage*>(x);
  if (groups_aligned16(x, l.rows, row_stride, l, sizeof(typename E::Storage))) {
    return launch_quantize(stream, l, ArrayInput<E, true>{px, row_stride}, NoOutput{}, q);
  }
  return launch_quantize(stream, l, ArrayInput<E, false>{px, row_stride}, NoOutput{}, q);
}

inline bool valid_type(FloatType t) {
  return t == FloatType::kF32 || t == FloatType::kBF16 || t == FloatType::kF16;
}

}  // namespace detail

cudaError_t LaunchQuantize(cudaStream_t stream, const RowLayout& layout, FloatType x_type,
                           const void* x, int64_t x_row_stride, const uint32_t* seeds,
                           bool stochastic, uint8_t* payload, float* meta,
                           const ValidCounts& valid) {
  using namespace detail;
  if (layout.rows <= 0 || layout.elems <= 0) return cudaSuccess;
  if (stochastic && seeds == nullptr) return cudaErrorInvalidValue;
  const QuantOut q{payload, meta, seeds, stochastic, valid};
  switch (x_type) {
    case FloatType::kF32:
      return launch_quantize_array<F32Type>(stream, layout, x, x_row_stride, q);
    case FloatType::kBF16:
      return launch_quantize_array<BF16Type>(stream, layout, x, x_row_stride, q);
    case FloatType::kF16:
      return launch_quantize_array<F16Type>(stream, layout, x, x_row_stride, q);
  }
  return cudaErrorInvalidValue;
}

namespace detail {

// The source and sink of the two summing launchers; 16-byte paths where aligned.
SumInput MakeSumInput(const RowLayout& layout, int64_t inputs, const uint8_t* payload,
                      const float* meta, FloatType addend_type, const void* addend) {
  return SumInput{payload, meta, inputs, addend, addend_type,
                  addend != nullptr && groups_aligned16(addend, layout.rows, layout.elems, layout,
                                                        FloatTypeBytes(addend_type))};
}

ArrayOutput MakeArrayOutput(const RowLayout& layout, FloatType out_type, void* out) {
  return ArrayOutput{out, out_type,
                     groups_aligned16(out, layout.rows, layout.elems, layout, FloatTypeBytes(out_type))};
}

}  // namespace detail

cudaError_t LaunchDequantizeSum(cudaStream_t stream, const RowLayout& layout, int64_t inputs,
                                const uint8_t* payload, const float* meta, FloatType addend_type,
                                const void* addend, FloatType out_type, void* out) {
  using namespace detail;
  if (layout.rows <= 0 || layout.elems <= 0) return cudaSuccess;
  if (!valid_type(out_type) || (addend != nullptr && !valid_type(addend_type))) {
    return cudaErrorInvalidValue;
  }
  const SumInput src = MakeSumInput(layout, inputs, payload, meta, addend_type, addend);
  const ArrayOutput sink = MakeArrayOutput(layout, out_type, out);
  const int64_t groups = layout.rows * layout.buckets * groups_in(layout.bucket);
  dequantize_sum_kernel<<<grid_for(groups, kThreads), kThreads, 0, stream>>>(src, sink, layout);
  return cudaGetLastError();
}

cudaError_t LaunchDequantize(cudaStream_t stream, const RowLayout& layout, const uint8_t* payload,
                             const float* meta, FloatType out_type, void* out) {
  return LaunchDequantizeSum(stream, layout, 1, payload, meta, FloatType::kF32, nullptr, out_type,
                             out);
}

cudaError_t LaunchDequantizeSumRequantize(cudaStream_t stream, const RowLayout& layout,
                                          int64_t inputs, const uint8_t* payload,
                                          const float* meta, FloatType addend_type,
                                          const void* addend, const uint32_t* seeds,
                                          bool stochastic, uint8_t* out_payload,
                                          float* out_meta, FloatType out_type, void* out,
                                          const ValidCounts& valid) {
  using namespace detail;
  if (layout.rows <= 0 || layout.elems <= 0) return cudaSuccess;
  if (!valid_type(out_type) || (addend != nullptr && !valid_type(addend_type))) {
    return cudaErrorInvalidValue;
  }
  if (stochastic && seeds == nullptr) return cudaErrorInvalidValue;
  const SumInput src = MakeSumInput(layout, inputs, payload, meta, addend_type, addend);
  const QuantOut q{out_payload, out_meta, seeds, stochastic, valid};
  if (out == nullptr) return launch_quantize(stream, layout, src, NoOutput{}, q);
  return launch_quantize(stream, layout, src, MakeArrayOutput(layout, out_type, out), q);
}

}  // namespace jax_cgx::cuda
