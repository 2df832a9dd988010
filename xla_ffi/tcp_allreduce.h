// The tcp backend's compressed all-reduce: one XLA FFI custom call per
// fusion-buffer row on CPU, jax_cgx_tcp_allreduce (see xla_ffi/README.md).
//
// It computes exactly what the xla backend's SRA lowering computes
// (jax_cgx/_src/exchange/sra.py), with the same CPU kernels on the same bytes,
// so results are bitwise equal; the transport (jax_cgx's TCP connections,
// xla_ffi/tcp_comms.h) and the schedule (segments pipelined between the codec
// and the wire) differ.
#ifndef JAX_CGX_XLA_FFI_TCP_ALLREDUCE_H_
#define JAX_CGX_XLA_FFI_TCP_ALLREDUCE_H_

#include <cstdint>
#include <string>

#include "xla_ffi/exchange_plan.h"

namespace jax_cgx::tcp {

// Auto segmentation (segments = 0) aims at this many bytes of input per chunk segment.
inline constexpr int64_t kAutoSegmentBytes = int64_t{1} << 20;

// What every call sends each peer first: the peer checks that both run the
// same reduction, so ranks whose programs differ (or run their reductions in
// different orders) get an error instead of each other's bytes.
struct Header {
  uint32_t magic = 0;
  uint32_t bits = 0;
  int64_t site = 0;  // which call of the program (jax_cgx/_src/tcp/backend.py numbers them)
  int64_t n = 0;
  int64_t chunk = 0;
  int64_t bucket = 0;
  int64_t elem_bytes = 0;
  int64_t segments = 0;
};

// Fills *plan (xla_ffi/exchange_plan.h) for a call: per segment, W slots each
// of send (slot j: chunk j, for rank j), recv (slot j: our chunk, from rank j;
// our own slot decodes to +0) and gathered (slot j: the re-quantized sum of
// chunk j, from rank j); before them the W Headers (slot j: from rank j; ours
// in our slot). Returns "" or what is wrong with the arguments.
std::string MakeAllreducePlan(int64_t n, int64_t world, int64_t chunk, int bits, int64_t bucket_size,
                              int64_t elem_bytes, int64_t segments, exchange::Plan* plan);

}  // namespace jax_cgx::tcp

#endif  // JAX_CGX_XLA_FFI_TCP_ALLREDUCE_H_
