// The nccl backend's compressed all-reduce: one XLA FFI custom call per
// fusion-buffer row, jax_cgx_nccl_allreduce (see xla_ffi/README.md).
//
// It computes exactly what the xla backend's lowering of the same primitive
// computes (jax_cgx/collectives/sra.py for SRA, jax_cgx/collectives/ring.py for the ring), with the
// same kernels on the same bytes, so results are bitwise equal; only the
// transport (NCCL point-to-point and all-gather on jax_cgx's communicators)
// and the scheduling (segment pipelining) differ.
#ifndef JAX_CGX_XLA_FFI_NCCL_ALLREDUCE_H_
#define JAX_CGX_XLA_FFI_NCCL_ALLREDUCE_H_

#include <cstdint>
#include <string>

#include "xla_ffi/cuda_kernels.h"
#include "xla_ffi/exchange_plan.h"
#include "xla_ffi/nccl_comms.h"

namespace jax_cgx::nccl {

enum class Algorithm : int32_t { kSra = 0, kRing = 1 };

// Auto segmentation aims at this many bytes of input per chunk segment.
inline constexpr int64_t kAutoSegmentBytes = int64_t{16} << 20;
inline constexpr int kAutoMaxSegments = 8;

using exchange::Region;  // slots of encodings in the workspace

// One segment: values [offset, offset + length) of every chunk (whole buckets
// of it, so its encoding is a slice of the chunk's), and its encodings.
struct Segment {
  int64_t offset = 0;
  int64_t length = 0;
  cuda::RowLayout layout;  // one row of `length` values; index_base = offset
  Region send;      // SRA: W slots (chunk j for rank j); ring: 2 slots (alternate hops)
  Region recv;      // SRA: W slots (chunk `rank` from rank j); ring: 1 slot
  Region gathered;  // W slots: the re-quantized sum of chunk j, from rank j
};

// The whole schedule of one call, computed from its shapes and attributes
// only (the same on every rank). workspace_bytes is the size of the extra
// result buffer the lowering allocates (jax_cgx._cuda.nccl_workspace_bytes).
struct Plan {
  int64_t n = 0;        // values in the row
  int64_t world = 0;    // W
  int64_t chunk = 0;    // c: values per chunk (the padded row is W * c)
  int64_t bucket = 0;
  int bits = 0;
  int64_t elem_bytes = 0;
  Algorithm algorithm = Algorithm::kSra;
  int64_t full_chunks = 0;  // chunks entirely inside x: floor(n / c)
  int64_t tail_chunks = 0;  // W - full_chunks: staged through padded copies
  int64_t x_tail = 0;       // workspace offset: tail_chunks * c values, x's tail then zeros
  int64_t out_tail = 0;     // workspace offset: the decoded tail chunks
  int segments = 0;
  Segment segment[kMaxSegments];
  int64_t workspace_bytes = 0;
};

// Fills *plan; returns "" or what is wrong with the arguments.
std::string MakePlan(int64_t n, int64_t world, int64_t chunk, int bits, int64_t bucket_size,
                     int64_t elem_bytes, Algorithm algorithm, int64_t segments, Plan* plan);

}  // namespace jax_cgx::nccl

#endif  // JAX_CGX_XLA_FFI_NCCL_ALLREDUCE_H_
