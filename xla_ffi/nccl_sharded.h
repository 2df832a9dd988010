// The nccl backend's collectives of sharded training, one XLA FFI custom call per
// fusion-buffer row each (see xla_ffi/README.md):
//
//   jax_cgx_nccl_reduce_scatter  x[W * m] (block j for rank j), seeds[W, 2] -> out[m]:
//       this rank's block summed over the ranks. Every rank quantizes the W - 1
//       blocks of its peers, the encodings go point to point to their owners, the
//       owner decodes them and adds them to its own block in full precision.
//   jax_cgx_nccl_all_gather      x[m], seeds[1, 2] -> out[W, m]: every rank's
//       shard. The owner quantizes its shard, the encodings are all-gathered and
//       every rank decodes all W of them, its own included.
//
// Each computes exactly what the xla backend's program computes
// (jax_cgx/_src/collectives/reduce_scatter.py scatter_rows, all_gather.py gather_rows)
// with the same kernels, so results are bitwise equal. The xla backend pads each
// block to an aligned length and marks the padding invalid; here a block is
// encoded at its own length, which gives the same metadata and levels for every
// real value (bucket ranges and the stochastic-rounding counter depend only on
// the position in the block) and sends no padding.
#ifndef JAX_CGX_XLA_FFI_NCCL_SHARDED_H_
#define JAX_CGX_XLA_FFI_NCCL_SHARDED_H_

#include <cstdint>
#include <string>

#include "xla_ffi/exchange_plan.h"

namespace jax_cgx::nccl {

enum class ShardedOp : int32_t { kReduceScatter = 0, kAllGather = 1 };

// Fills *plan (xla_ffi/exchange_plan.h) for a call on blocks (reduce-scatter)
// or shards (all-gather) of m values: the plan of a row of W chunks of m, with
// per segment W send and W recv slots (reduce-scatter: sent, slot j for rank j;
// received, slot j from rank j) or W gathered slots (all-gather: slot j from
// rank j). Its workspace_bytes is the size of the extra result the lowering
// allocates (jax_cgx._cuda.nccl_sharded_workspace_bytes). `segments` as
// CompressionConfig.pipeline_segments: 0 picks by size. Returns "" or what is
// wrong with the arguments.
std::string MakeShardedPlan(ShardedOp op, int64_t m, int64_t world, int bits, int64_t bucket_size,
                            int64_t elem_bytes, int64_t segments, exchange::Plan* plan);

}  // namespace jax_cgx::nccl

#endif  // JAX_CGX_XLA_FFI_NCCL_SHARDED_H_
