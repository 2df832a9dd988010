// The tcp backend's compressed all-reduce: one XLA FFI custom call per
// fusion-buffer row on CPU, jax_cgx_tcp_allreduce (see xla_ffi/README.md).
//
// It computes exactly what the xla backend's SRA lowering computes
// (jax_cgx/collectives/sra.py), with the same CPU kernels on the same bytes,
// so results are bitwise equal; the transport (jax_cgx's TCP connections,
// xla_ffi/tcp_comms.h) and the schedule (segments pipelined between the codec
// and the wire) differ.
#ifndef JAX_CGX_XLA_FFI_TCP_ALLREDUCE_H_
#define JAX_CGX_XLA_FFI_TCP_ALLREDUCE_H_

#include <cstdint>
#include <string>

#include "xla_ffi/exchange_plan.h"

namespace jax_cgx::tcp {

// The most segments a chunk is cut into (jax_cgx.config.MAX_SEGMENTS).
inline constexpr int kMaxSegments = 64;
// Auto segmentation (segments = 0) aims at this many bytes of input per chunk segment.
inline constexpr int64_t kAutoSegmentBytes = int64_t{1} << 20;

using exchange::Region;  // W encodings of one segment in the workspace

// One segment: values [offset, offset + length) of every chunk (whole buckets
// of it, so its encoding is a slice of the chunk's), and its encodings.
struct Segment {
  int64_t offset = 0;
  int64_t length = 0;
  int64_t buckets = 0;
  int64_t payload_bytes = 0;
  Region send;      // slot j: chunk j, for rank j
  Region recv;      // slot j: our chunk, from rank j (our own slot decodes to +0)
  Region gathered;  // slot j: the re-quantized sum of chunk j, from rank j
  int64_t meta_bytes() const { return exchange::MetaBytes(buckets); }
};

// What every call sends each peer first: the peer checks that both run the
// same reduction, so ranks whose programs differ (or run their reductions in
// different orders) get an error instead of each other's bytes.
struct Header {
  uint32_t magic = 0;
  uint32_t bits = 0;
  int64_t site = 0;  // which call of the program (jax_cgx/tcp/lowering.py numbers them)
  int64_t n = 0;
  int64_t chunk = 0;
  int64_t bucket = 0;
  int64_t elem_bytes = 0;
  int64_t segments = 0;
};

// The whole schedule of one call, from its shapes and attributes only (the
// same on every rank).
struct Plan {
  int64_t n = 0;        // values in the row
  int64_t world = 0;    // W
  int64_t chunk = 0;    // c: values per chunk (the padded row is W * c)
  int64_t bucket = 0;
  int bits = 0;
  int64_t elem_bytes = 0;
  int64_t full_chunks = 0;  // chunks entirely inside x: floor(n / c)
  int64_t tail_chunks = 0;  // W - full_chunks: staged through padded copies
  int64_t x_tail = 0;       // workspace offset: tail_chunks * c values, x's tail then zeros
  int64_t out_tail = 0;     // workspace offset: the decoded tail chunks
  int64_t headers = 0;      // workspace offset: W Headers (slot j: from rank j; ours in our slot)
  int segments = 0;
  Segment segment[kMaxSegments];
  int64_t workspace_bytes = 0;
};

// Fills *plan; returns "" or what is wrong with the arguments.
std::string MakePlan(int64_t n, int64_t world, int64_t chunk, int bits, int64_t bucket_size,
                     int64_t elem_bytes, int64_t segments, Plan* plan);

}  // namespace jax_cgx::tcp

#endif  // JAX_CGX_XLA_FFI_TCP_ALLREDUCE_H_
