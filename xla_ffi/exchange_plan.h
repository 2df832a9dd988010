// What the plans of the whole-exchange custom calls share (the nccl backend's
// xla_ffi/nccl_allreduce.cc, the tcp backend's xla_ffi/tcp_allreduce.cc): the
// checks of their arguments, how a chunk is cut into segments of whole
// buckets, so that a segment's encoding is a slice of its chunk's, and how the
// workspace is laid out.
// Plain C++: nvcc includes it too.
#ifndef JAX_CGX_XLA_FFI_EXCHANGE_PLAN_H_
#define JAX_CGX_XLA_FFI_EXCHANGE_PLAN_H_

#include <algorithm>
#include <cstdint>
#include <string>

namespace jax_cgx::exchange {

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
  if (bits < 1 || bits > 8) return "bits must be in 1..8, got " + std::to_string(bits);
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

}  // namespace jax_cgx::exchange

#endif  // JAX_CGX_XLA_FFI_EXCHANGE_PLAN_H_
