// The exchange plan and its segment schedule, shared by the nccl backend
// (xla_ffi/nccl_allreduce.cc, xla_ffi/nccl_sharded.cc) and the tcp backend
// (xla_ffi/tcp_allreduce.cc): one Plan, made by one MakePlan from a call's
// shapes and attributes only (so the same on every rank): the checks of the
// arguments, how a chunk is cut into segments of whole buckets (so that a
// segment's encoding is a slice of its chunk's), how the workspace is laid
// out; the addresses of a call's chunks and encodings; and the order in which
// every backend runs the segments of a point-to-point exchange.
// Plain C++ (no XLA, CUDA or NCCL headers): the backends supply the transport.
#ifndef JAX_CGX_XLA_FFI_EXCHANGE_PLAN_H_
#define JAX_CGX_XLA_FFI_EXCHANGE_PLAN_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "xla_ffi/codec_math.h"

namespace jax_cgx::exchange {

// The most segments a chunk is cut into (jax_cgx._src.config.MAX_SEGMENTS).
inline constexpr int kMaxSegments = 64;

inline int64_t CeilDiv(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// "" or what is wrong with a call that reduces a row of n values over world
// ranks, cut into chunks of `chunk` values, each into 0..max_segments segments.
inline std::string CheckArguments(int64_t n, int64_t world, int64_t chunk, int bits, int64_t bucket_size,
                                  int64_t elem_bytes, int64_t segments, int64_t max_segments) {
  if (n < 1) return "the row must hold at least one value, got " + std::to_string(n);
  if (world < 2) return "world must be >= 2, got " + std::to_string(world);
  if (chunk < 1 || chunk > (int64_t{1} << 40) / world || chunk * world < n) {
    return "chunk=" + std::to_string(chunk) + " does not cut " + std::to_string(n) + " values into " +
           std::to_string(world) + " chunks";
  }
  if (!valid_bits(bits)) {
    return "bits must be in " + std::to_string(kMinBits) + ".." + std::to_string(kMaxBits) + ", got " +
           std::to_string(bits);
  }
  if (bucket_size < 1) return "bucket_size must be >= 1, got " + std::to_string(bucket_size);
  if (elem_bytes != 2 && elem_bytes != 4) return "values must be f32, bf16 or f16";
  if (segments < 0 || segments > max_segments) {
    return "segments must be in 0.." + std::to_string(max_segments) + ", got " + std::to_string(segments);
  }
  return "";
}

// A chunk cut into `count` segments of whole buckets: segment s holds values
// [s * values, min(chunk, (s + 1) * values)) of the chunk.
struct ChunkCut {
  int64_t count = 0;
  int64_t values = 0;
};

// `segments` > 0 asks for that many (at most one per bucket); 0 picks about
// `auto_bytes` of input per segment, at most `auto_max` segments.
inline ChunkCut CutChunk(int64_t chunk, int64_t bucket_size, int64_t elem_bytes, int64_t segments,
                         int64_t auto_bytes, int64_t auto_max) {
  const int64_t bucket = std::min(bucket_size, chunk);  // the chunk's last bucket may be short
  const int64_t buckets = CeilDiv(chunk, bucket);
  int64_t wanted = segments;
  if (wanted == 0) wanted = std::clamp<int64_t>(CeilDiv(chunk * elem_bytes, auto_bytes), 1, auto_max);
  wanted = std::min(wanted, buckets);
  const int64_t per_segment = CeilDiv(buckets, wanted);  // buckets
  return ChunkCut{CeilDiv(buckets, per_segment), per_segment * bucket};
}

// Where `slots` encodings of one segment lie in a call's workspace: `slots` rows
// of payload, then `slots` rows of metadata (a (min, scale) pair per bucket).
struct Region {
  int64_t payload = 0;
  int64_t meta = 0;
};

inline int64_t MetaBytes(int64_t buckets) { return buckets * 2 * static_cast<int64_t>(sizeof(float)); }

// Slot `slot` of region r of the workspace at `ws`, for encodings of `row_bytes`
// payload bytes and `buckets` buckets.
inline uint8_t* SlotPayload(char* ws, const Region& r, int64_t row_bytes, int64_t slot) {
  return reinterpret_cast<uint8_t*>(ws + r.payload + slot * row_bytes);
}
inline float* SlotMeta(char* ws, const Region& r, int64_t buckets, int64_t slot) {
  return reinterpret_cast<float*>(ws + r.meta + slot * MetaBytes(buckets));
}

// Lays a call's workspace out region by region, each starting `align`-aligned
// from the workspace's start (which XLA aligns).
class WorkspaceLayout {
 public:
  explicit WorkspaceLayout(int64_t align) : align_(align) {}
  // Offset of a new region of `bytes` bytes.
  int64_t Take(int64_t bytes) {
    const int64_t at = end_;
    end_ += CeilDiv(bytes, align_) * align_;
    return at;
  }
  // A new region of `slots` encodings.
  Region TakeRegion(int64_t slots, int64_t row_bytes, int64_t buckets) {
    Region r;
    r.payload = Take(slots * row_bytes);
    r.meta = Take(slots * MetaBytes(buckets));
    return r;
  }
  // The workspace's size (at least one byte: XLA has no empty results).
  int64_t Bytes() const { return std::max<int64_t>(end_, 1); }

 private:
  int64_t align_;
  int64_t end_ = 0;
};

// One segment: values [offset, offset + length) of every chunk (whole buckets
// of it, so its encoding is a slice of the chunk's), and its encodings.
struct Segment {
  int64_t offset = 0;
  int64_t length = 0;
  int64_t buckets = 0;        // of one encoding
  int64_t payload_bytes = 0;  // of one encoding (its metadata: meta_bytes())
  Region send;      // slot j: for rank j (the nccl ring: 2 slots, alternate hops)
  Region recv;      // slot j: from rank j (the nccl ring: 1 slot)
  Region gathered;  // slot j: the re-quantized sum of chunk j, from rank j
  int64_t meta_bytes() const { return MetaBytes(buckets); }
};

// What a kind of call keeps in its workspace and how it segments: what differs
// between the backends' plans (the values are theirs).
struct Shape {
  int64_t align = 0;                        // each workspace region starts so aligned
  int64_t auto_bytes = 0;                   // segments = 0: about this much input per segment,
  int64_t auto_max = 0;                     //   and at most this many segments
  int64_t send_slots = 0;                   // encodings per segment in each region
  int64_t recv_slots = 0;
  int64_t gathered_slots = 0;
  int64_t header_bytes = 0;                 // a header per rank before the segments (0: none)
};

// The whole schedule of one call: a row of n values reduced over W ranks, cut
// into W chunks of c values (the padded row is W * c). workspace_bytes is the
// size of the workspace the call needs.
struct Plan {
  int64_t n = 0;        // values in the row
  int64_t world = 0;    // W
  int64_t chunk = 0;    // c: values per chunk
  int64_t bucket = 0;
  int bits = 0;
  int64_t elem_bytes = 0;
  int64_t full_chunks = 0;  // chunks entirely inside x: floor(n / c)
  int64_t tail_chunks = 0;  // W - full_chunks: staged through padded copies
  int64_t x_tail = 0;       // workspace offset: tail_chunks * c values, x's tail then zeros
  int64_t out_tail = 0;     // workspace offset: the decoded tail chunks
  int64_t headers = 0;      // workspace offset: W headers of shape.header_bytes (slot j: rank j's)
  int segments = 0;
  Segment segment[kMaxSegments];
  int64_t workspace_bytes = 0;

  // Values of x past its full chunks (staged into the tail, and back).
  int64_t rem() const { return n - full_chunks * chunk; }
};

// Fills *plan for a call of `shape`; returns "" or what is wrong with the
// arguments (as CheckArguments). `segments` > 0 asks for that many segments,
// 0 picks by size (CutChunk).
inline std::string MakePlan(int64_t n, int64_t world, int64_t chunk, int bits, int64_t bucket_size,
                            int64_t elem_bytes, int64_t segments, const Shape& shape, Plan* plan) {
  const std::string bad = CheckArguments(n, world, chunk, bits, bucket_size, elem_bytes, segments, kMaxSegments);
  if (!bad.empty()) return bad;
  Plan& p = *plan;
  p = Plan();
  p.n = n;
  p.world = world;
  p.chunk = chunk;
  p.bucket = bucket_size;
  p.bits = bits;
  p.elem_bytes = elem_bytes;
  p.full_chunks = std::min(world, n / chunk);
  p.tail_chunks = world - p.full_chunks;

  const ChunkCut cut = CutChunk(chunk, bucket_size, elem_bytes, segments, shape.auto_bytes, shape.auto_max);
  p.segments = static_cast<int>(cut.count);

  // An empty region takes no room: a shape without tails or headers lays the
  // segments out from offset 0.
  WorkspaceLayout workspace(shape.align);
  p.x_tail = workspace.Take(p.tail_chunks * chunk * elem_bytes);
  p.out_tail = workspace.Take(p.tail_chunks * chunk * elem_bytes);
  p.headers = workspace.Take(world * shape.header_bytes);
  for (int s = 0; s < p.segments; ++s) {
    Segment& seg = p.segment[s];
    seg.offset = s * cut.values;
    seg.length = std::min(chunk, seg.offset + cut.values) - seg.offset;
    // One encoding's layout is the codec's (codec_math.h), whichever backend runs the plan.
    seg.buckets = bucket_count(seg.length, bucket_size);
    seg.payload_bytes = row_payload_bytes(seg.length, bucket_size, bits);
    seg.send = workspace.TakeRegion(shape.send_slots, seg.payload_bytes, seg.buckets);
    seg.recv = workspace.TakeRegion(shape.recv_slots, seg.payload_bytes, seg.buckets);
    seg.gathered = workspace.TakeRegion(shape.gathered_slots, seg.payload_bytes, seg.buckets);
  }
  p.workspace_bytes = workspace.Bytes();
  return "";
}

// One call's row, output and workspace (host or device addresses), as its
// plan lays them out.
struct Buffers {
  const Plan& plan;
  const char* x;
  char* out;
  char* ws;

  int64_t Bytes(int64_t values) const { return values * plan.elem_bytes; }
  // First value of chunk j of the zero-padded input: x itself, or its staged tail.
  const char* ChunkIn(int64_t j) const {
    return j < plan.full_chunks ? x + Bytes(j * plan.chunk)
                                : ws + plan.x_tail + Bytes((j - plan.full_chunks) * plan.chunk);
  }
  char* ChunkOut(int64_t j) const {
    return j < plan.full_chunks ? out + Bytes(j * plan.chunk)
                                : ws + plan.out_tail + Bytes((j - plan.full_chunks) * plan.chunk);
  }
  uint8_t* Payload(const Region& r, const Segment& s, int64_t slot) const {
    return SlotPayload(ws, r, s.payload_bytes, slot);
  }
  float* Meta(const Region& r, const Segment& s, int64_t slot) const { return SlotMeta(ws, r, s.buckets, slot); }
};

// The chunks rank `me` quantizes for its peers (all but its own), as runs
// [first, second) of consecutive chunks from one source each (x, or the
// staged tail), in order.
struct PeerRuns {
  int count = 0;
  std::pair<int64_t, int64_t> run[4];
  const std::pair<int64_t, int64_t>* begin() const { return run; }
  const std::pair<int64_t, int64_t>* end() const { return run + count; }
};

inline PeerRuns PeersOf(const Plan& p, int64_t me) {
  PeerRuns r;
  for (const auto& [lo, hi] : {std::pair<int64_t, int64_t>{0, me}, std::pair<int64_t, int64_t>{me + 1, p.world}}) {
    const int64_t mid = std::clamp(p.full_chunks, lo, hi);
    if (lo < mid) r.run[r.count++] = {lo, mid};
    if (mid < hi) r.run[r.count++] = {mid, hi};
  }
  return r;
}

// The segment schedule of a point-to-point exchange (SRA, reduce-scatter), as
// every backend runs it, over `steps` (its transport):
//   steps.Send(i, s)    quantize segment s of the peers' chunks, post their exchange;
//   steps.Reduce(i, s)  once s has arrived: reduce our own chunk of it (and post
//                       its all-gather, if the call gathers);
//   steps.Decode(i, s)  once the gathered s has arrived: decode it (or nothing).
// Every segment is sent before the first is reduced, and reduced before the
// first is decoded, so the transport moves segment i while the codec works on
// i + 1. Each step returns an error type with failure(); the first failure ends
// the schedule.
template <class Steps>
auto RunSegments(const Plan& p, Steps& steps) -> decltype(steps.Send(0, p.segment[0])) {
  using Error = decltype(steps.Send(0, p.segment[0]));
  for (int i = 0; i < p.segments; ++i) {
    auto e = steps.Send(i, p.segment[i]);
    if (e.failure()) return e;
  }
  for (int i = 0; i < p.segments; ++i) {
    auto e = steps.Reduce(i, p.segment[i]);
    if (e.failure()) return e;
  }
  for (int i = 0; i < p.segments; ++i) {
    auto e = steps.Decode(i, p.segment[i]);
    if (e.failure()) return e;
  }
  return Error::Success();
}

}  // namespace jax_cgx::exchange

#endif  // JAX_CGX_XLA_FFI_EXCHANGE_PLAN_H_
