// The bucket-quantizing kernels of cuda/codec_kernels.cu: a bucket's min/max
// is reduced, then its levels are encoded and packed. LaunchQuantize runs them
// on the rows of x, LaunchDequantizeSumRequantize on summed decoded inputs
// (the Src of the templates); Sink optionally receives the decoded values.
// Included by cuda/codec_kernels.cu alone (it instantiates the __global__
// templates); the building blocks are in cuda/codec_device.cuh.
#ifndef JAX_CGX_CUDA_QUANTIZE_KERNELS_CUH_
#define JAX_CGX_CUDA_QUANTIZE_KERNELS_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/codec_device.cuh"
#include "xla_ffi/cuda_kernels.h"
#include "xla_ffi/codec_math.h"

namespace jax_cgx::cuda {
namespace detail {

// -------------------------------------------------------- kernel bodies

// The layout a body works with: `l` with its width the constant kBits where
// kBits != 0 (the launcher dispatches on l.bits). Every helper is inlined, so
// the packing shifts, word plans and byte counts then fold to constants.
template <int kBits>
CGX_HD RowLayout with_width(const RowLayout& l) {
  RowLayout c = l;
  if constexpr (kBits != 0) c.bits = kBits;
  return c;
}

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
  t.meta = make_meta(range_of(mm), l.bits);
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

// One bucket's values as a lane of its segment holds them: groups sl, sl + lanes,
// ... (cnt[i] elements each). Lanes past the last bucket hold nothing (len 0).
template <int G>
struct BucketValues {
  int64_t len;
  int cnt[G];
  float v[G][kGroup];
};

template <class Src, int G>
CGX_HD void load_bucket(const Src& src, const RowLayout& l, const BucketCursor& cur, int sl,
                        int lanes, BucketValues<G>& b) {
  b.len = cur.r < l.rows ? bucket_len(l, cur.k) : 0;
  CGX_UNROLL
  for (int i = 0; i < G; ++i) b.cnt[i] = group_count(b.len, sl + static_cast<int64_t>(i) * lanes);
  src.template load<G>(l, cur.r, cur.k, sl, lanes, b.cnt, b.v);
}

// Buckets of at most lanes*G*8 elements: each aligned segment of `lanes`
// lanes of a warp quantizes one bucket per iteration with the bucket in
// registers (lane j holds groups j, j + lanes, ...; G > 1 only when lanes = 32).
// kPrefetch: the loads of the segment's next bucket are issued before the
// current one is reduced and encoded, so a warp has two buckets' reads in
// flight and the memory latency hides behind its own arithmetic (worth it
// when warps loop, i.e. on a grid of resident blocks: see launch_segments).
// kBits: 0, or l.bits as a constant (with_width).
template <class Src, class Sink, int G, bool kPrefetch, int kBits = 0>
CGX_HD void quantize_segments(const Src& src, const Sink& sink, const RowLayout& layout,
                              const QuantOut& q, int segment_lanes) {
  const RowLayout l = with_width<kBits>(layout);
  const int lanes = G > 1 ? kWarpSize : segment_lanes;  // plan_quantize: G > 1 only on whole warps
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
  BucketValues<G> ahead;
  if constexpr (kPrefetch) load_bucket<Src, G>(src, l, cur, sl, lanes, ahead);
  // `first` is uniform over the warp, so all lanes run every iteration (the
  // shuffles need them); lanes past the last bucket idle through it.
  for (int64_t first = warp * per_warp; first < total; first += step) {
    BucketCursor next = cur;
    next.advance(l.buckets);
    BucketValues<G> b;
    if constexpr (kPrefetch) {
      b = ahead;
      load_bucket<Src, G>(src, l, next, sl, lanes, ahead);  // past the end: loads nothing
    } else {
      load_bucket<Src, G>(src, l, cur, sl, lanes, b);
    }
    const bool active = cur.r < l.rows;
    const int64_t limit = active ? q.range_limit(l, cur.r, cur.k) : 0;
    MinMax mm = minmax_empty();
    CGX_UNROLL
    for (int i = 0; i < G; ++i) {
      const int64_t first_elem = (sl + static_cast<int64_t>(i) * lanes) * kGroup;
      CGX_UNROLL
      for (int e = 0; e < kGroup; ++e) {
        if (e < b.cnt[i] && first_elem + e < limit) minmax_add(mm, b.v[i][e]);
      }
    }
    segment_minmax(mm, lanes);
    const BucketTarget t = begin_bucket(l, q, active, cur.r, cur.k, b.len, mm, sl == 0);
    CGX_UNROLL
    for (int i = 0; i < G; ++i) {
      // Round i: groups i*lanes .. i*lanes + lanes-1, lane sl holding i*lanes + sl.
      const int64_t round_first = static_cast<int64_t>(i) * lanes;
      encode_round(sink, l, plan, t, cur.r, cur.k, round_first + sl, round_first * l.bits, b.cnt[i],
                   b.v[i]);
    }
    cur = next;
  }
}

// Larger buckets: one block per bucket and iteration. Pass 1 reduces min/max
// over the bucket, pass 2 reads it again (from L2) and encodes; warp w of the
// block handles groups g0 + 32w .. g0 + 32w + 31 of each pass-2 round.
// `partial` is __shared__ storage for one MinMax per warp.
template <class Src, class Sink, int kBits = 0>
CGX_HD void quantize_blocks(const Src& src, const Sink& sink, const RowLayout& layout,
                            const QuantOut& q, MinMax* partial) {
  const RowLayout l = with_width<kBits>(layout);
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

// ------------------------------------------------------------------ kernels
//
// Variants of the kernels, chosen at build time so that
// cuda/tests/device_test.cu can time them side by side (tools/gpu_check.sh,
// stage kernels); docs/gpu-results.md has each one's prediction and outcome.
//   JAX_CGX_CODEC_PIPELINE=1       grids of resident blocks whose threads loop
//                                  (the cursors' divisions are paid once, not
//                                  per bucket or group); quantizing from an
//                                  array (not the summing kernels, whose loads
//                                  decode) also prefetches the next bucket
//   JAX_CGX_QUANTIZE_MIN_BLOCKS=N  ask ptxas for registers that let N blocks
//                                  of kThreads reside on a multiprocessor, for
//                                  the segment kernels of <= 2 register groups
//                                  (4 groups spill under 3: they keep 1)
//   JAX_CGX_CODEC_WIDTHS=1         a kernel per common width (4 and 8 bits)
//                                  with the width a constant: the generic
//                                  kernels shift by run-time multiples of
//                                  bits (64-bit shifts, emulated), size word
//                                  plans and byte counts per bucket, and
//                                  branch on the width per group; other
//                                  widths keep the generic kernels
// (Their defaults are set in xla_ffi/cuda_kernels.h.)
constexpr bool kCodecPipeline = JAX_CGX_CODEC_PIPELINE != 0;
constexpr bool kCodecWidths = JAX_CGX_CODEC_WIDTHS != 0;

template <class Src, class Sink, int G, int kBits>
__global__ void __launch_bounds__(kThreads, G > 2 ? 1 : JAX_CGX_QUANTIZE_MIN_BLOCKS)
    quantize_segments_kernel(Src src, Sink sink, RowLayout l, QuantOut q, int lanes) {
  quantize_segments<Src, Sink, G, kCodecPipeline && Src::kPrefetch, kBits>(src, sink, l, q, lanes);
}

template <class Src, class Sink, int kBits>
__global__ void __launch_bounds__(kThreads)
    quantize_blocks_kernel(Src src, Sink sink, RowLayout l, QuantOut q) {
  __shared__ MinMax partial[kWarpsPerBlock];
  quantize_blocks<Src, Sink, kBits>(src, sink, l, q, partial);
}

// ---------------------------------------------------------------- launching

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

// Blocks of kKernel that the current device holds at once, asked once per
// kernel and process (an occupancy query, no synchronization); kMaxBlocks if
// the runtime cannot say. Only the grid's size depends on it, never a result.
template <auto kKernel>
int64_t resident_blocks() {
  static const int64_t blocks = [] {
    int device = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads, 0) != cudaSuccess ||
        sms * per_sm <= 0) {
      (void)cudaGetLastError();  // not the launch's error to report
      return kMaxBlocks;
    }
    return int64_t{sms} * per_sm;
  }();
  return blocks;
}

// The grid of a looping kernel over `items`: grid_for's, and under
// JAX_CGX_CODEC_PIPELINE no more blocks than the device holds at once.
template <auto kKernel>
unsigned loop_grid(int64_t items, int64_t items_per_block) {
  const unsigned grid = grid_for(items, items_per_block);
  if constexpr (kCodecPipeline) {
    const int64_t resident = resident_blocks<kKernel>();
    if (resident < grid) return static_cast<unsigned>(resident);
  }
  return grid;
}

template <class Src, class Sink, int G, int kBits>
void launch_segments(cudaStream_t stream, const RowLayout& l, const Src& src, const Sink& sink,
                     const QuantOut& q, const QuantizePlan& p) {
  constexpr auto kernel = &quantize_segments_kernel<Src, Sink, G, kBits>;
  kernel<<<loop_grid<kernel>(l.rows * l.buckets, p.buckets_per_block), kThreads, 0, stream>>>(src, sink, l, q,
                                                                                                p.lanes);
}

template <class Src, class Sink, int kBits>
void launch_quantize_width(cudaStream_t stream, const RowLayout& l, const Src& src, const Sink& sink,
                           const QuantOut& q) {
  const QuantizePlan p = plan_quantize(l);
  switch (p.groups) {
    case 1:
      launch_segments<Src, Sink, 1, kBits>(stream, l, src, sink, q, p);
      break;
    case 2:
      launch_segments<Src, Sink, 2, kBits>(stream, l, src, sink, q, p);
      break;
    case kMaxRegisterGroups:
      launch_segments<Src, Sink, kMaxRegisterGroups, kBits>(stream, l, src, sink, q, p);
      break;
    default:
      quantize_blocks_kernel<Src, Sink, kBits><<<grid_for(l.rows * l.buckets, 1), kThreads, 0, stream>>>(
          src, sink, l, q);
      break;
  }
}

template <class Src, class Sink>
cudaError_t launch_quantize(cudaStream_t stream, const RowLayout& l, const Src& src,
                            const Sink& sink, const QuantOut& q) {
  if (kCodecWidths && l.bits == 4) {
    launch_quantize_width<Src, Sink, kCodecWidths ? 4 : 0>(stream, l, src, sink, q);
  } else if (kCodecWidths && l.bits == 8) {
    launch_quantize_width<Src, Sink, kCodecWidths ? 8 : 0>(stream, l, src, sink, q);
  } else {
    launch_quantize_width<Src, Sink, 0>(stream, l, src, sink, q);
  }
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace jax_cgx::cuda

#endif  // JAX_CGX_CUDA_QUANTIZE_KERNELS_CUH_
