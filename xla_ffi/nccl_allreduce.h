// The nccl backend's compressed all-reduce: one XLA FFI custom call per
// fusion-buffer row, jax_cgx_nccl_allreduce (see xla_ffi/README.md).
//
// It computes exactly what the xla backend's lowering of the same primitive
// computes (jax_cgx/_src/exchange/sra.py for SRA, jax_cgx/_src/exchange/ring.py for the ring), with the
// same kernels on the same bytes, so results are bitwise equal; only the
// transport (NCCL point-to-point and all-gather on jax_cgx's communicators)
// and the scheduling (segment pipelining) differ.
#ifndef JAX_CGX_XLA_FFI_NCCL_ALLREDUCE_H_
#define JAX_CGX_XLA_FFI_NCCL_ALLREDUCE_H_

#include <cstdint>
#include <string>

#include "xla_ffi/exchange_plan.h"

namespace jax_cgx::nccl {

enum class Algorithm : int32_t { kSra = 0, kRing = 1 };

// Fills *plan (xla_ffi/exchange_plan.h) for a call: per segment, the slots of
// send (SRA: W, chunk j for rank j; ring: 2, alternate hops), recv (SRA: W,
// chunk `rank` from rank j; ring: 1) and gathered (W: the re-quantized sum of
// chunk j, from rank j). Its workspace_bytes is the size of the extra result
// buffer the lowering allocates (jax_cgx._cuda.nccl_workspace_bytes). Returns
// "" or what is wrong with the arguments.
std::string MakeAllreducePlan(int64_t n, int64_t world, int64_t chunk, int bits, int64_t bucket_size,
                              int64_t elem_bytes, Algorithm algorithm, int64_t segments, exchange::Plan* plan);

}  // namespace jax_cgx::nccl

#endif  // JAX_CGX_XLA_FFI_NCCL_ALLREDUCE_H_
