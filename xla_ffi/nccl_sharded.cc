// jax_cgx_nccl_reduce_scatter and jax_cgx_nccl_all_gather: the compressed
// collectives of sharded training as one custom call each on jax_cgx's NCCL
// communicators (see nccl_sharded.h).
//
// Streams, as in nccl_allreduce.cc: kernels run on XLA's stream, NCCL on the
// communicator's side stream, events order the two per segment, so quantizing
// segment s+1 overlaps moving segment s, and decoding s overlaps moving s+1:
//
//   reduce-scatter  XLA stream:  Q0 Q1 ... | S0 S1 ...    Q quantize the peers' blocks,
//                   side stream:    X0 X1 ...             X point-to-point exchange,
//                                                         S decode-and-sum into out
//   all-gather      XLA stream:  Q0 Q1 ... | D0 D1 ...    Q quantize the own shard,
//                   side stream:    G0 G1 ...             G all-gather, D decode all W
//
// (nccl_call.h has the streams' contract.)
#include "xla_ffi/nccl_sharded.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cuda_kernels.h"
#include "xla_ffi/exchange_plan.h"
#include "xla_ffi/ffi_support.h"
#include "xla_ffi/nccl_api.h"
#include "xla_ffi/nccl_call.h"
#include "xla_ffi/nccl_comms.h"

namespace ffi = xla::ffi;

namespace jax_cgx::nccl {

std::string MakeShardedPlan(ShardedOp op, int64_t m, int64_t world, int bits, int64_t bucket_size,
                            int64_t elem_bytes, int64_t segments, Plan* plan) {
  if (op != ShardedOp::kReduceScatter && op != ShardedOp::kAllGather) {
    return "op must be 0 (reduce-scatter) or 1 (all-gather), got " + std::to_string(static_cast<int>(op));
  }
  if (m < 1) return "a block must hold at least one value, got " + std::to_string(m);
  const bool scatter = op == ShardedOp::kReduceScatter;
  const exchange::Shape shape = ShapeOf(scatter ? world : 0, scatter ? world : 0, scatter ? 0 : world);
  return exchange::MakePlan(m * world, world, m, bits, bucket_size, elem_bytes, segments, shape, plan);
}

// Its own namespace: cuda/tests/nccl_sim.cc compiles this file and
// nccl_allreduce.cc as one translation unit.
namespace sharded {
namespace {

using ffi_support::CheckDType;
using ffi_support::CheckFloatType;
using ffi_support::CheckShape;
using ffi_support::InvalidArgument;

constexpr std::string_view kReduceScatter = "jax_cgx_nccl_reduce_scatter";
constexpr std::string_view kAllGather = "jax_cgx_nccl_all_gather";

// Reduce-scatter (scatter_rows) as the steps of exchange::RunSegments: block j
// goes to rank j; the owner sums the W encodings of its block (its own slot
// with zeroed metadata, so it adds +0 as in the xla backend) onto its own
// block in full precision.
struct ReduceScatterSteps {
  const Call& c;
  ffi::Error Send(int i, const Segment& s) const { return SendToPeers(c, i, s); }
  ffi::Error Reduce(int i, const Segment& s) const {
    const Plan& p = c.plan;
    const int me = c.comm.rank;
    CGX_CUDA(c.target, cudaStreamWaitEvent(c.main, c.comm.exchanged[i], 0));
    // Our own slot receives nothing: zero it, metadata (0, 0) decoding to +0 (the payload too, so
    // that nothing reads uninitialized memory).
    CGX_CUDA(c.target, cudaMemsetAsync(c.Payload(s.recv, s, me), 0, s.payload_bytes, c.main));
    CGX_CUDA(c.target, cudaMemsetAsync(c.Meta(s.recv, s, me), 0, s.meta_bytes(), c.main));
    return c.Launched(cuda::LaunchDequantizeSum(c.main, c.Layout(s), p.world, c.Payload(s.recv, s, 0),
                                                c.Meta(s.recv, s, 0), c.type, c.ChunkIn(me) + c.Bytes(s.offset),
                                                c.type, c.out + c.Bytes(s.offset)),
                      "dequantize_sum");
  }
  ffi::Error Decode(int, const Segment&) const { return ffi::Error::Success(); }
};

// All-gather (gather_rows) as the steps of exchange::RunSegments: the owner
// quantizes its shard into its slot, the slots are all-gathered in place, and
// every rank decodes all W.
struct AllGatherSteps {
  const Call& c;
  ffi::Error Send(int i, const Segment& s) const {
    Communicator& comm = c.comm;
    CGX_RETURN_IF_ERROR(c.Launched(
        cuda::LaunchQuantize(c.main, c.Layout(s), c.type, c.x + c.Bytes(s.offset), c.plan.chunk, c.seeds,
                             c.stochastic, c.Payload(s.gathered, s, comm.rank), c.Meta(s.gathered, s, comm.rank)),
        "quantize"));
    CGX_CUDA(c.target, cudaEventRecord(comm.quantized[i], c.main));
    return Gather(c, s, comm.quantized[i], comm.gathered[i]);
  }
  ffi::Error Reduce(int, const Segment&) const { return ffi::Error::Success(); }
  ffi::Error Decode(int i, const Segment& s) const { return DecodeGathered(c, s, c.comm.gathered[i]); }
};

// Both handlers: check the buffers against the plan, find the communicator, run.
// x and out: [W, m] and [m] (reduce-scatter) or [m] and [W, m] (all-gather).
ffi::Error Run(ShardedOp op, cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer seeds,
               ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace, int64_t comm_key,
               int64_t world, int32_t bits, int64_t bucket_size, bool stochastic, int64_t segments) {
  const bool scatter = op == ShardedOp::kReduceScatter;
  const std::string_view target = scatter ? kReduceScatter : kAllGather;
  cuda::FloatType type = cuda::FloatType::kF32;
  CGX_RETURN_IF_ERROR(CheckFloatType(target, "x", x.element_type(), &type));
  CGX_RETURN_IF_ERROR(CheckDType(target, "out", out->element_type(), x.element_type()));
  if (scatter) {
    CGX_RETURN_IF_ERROR(CheckShape(target, "x", x.dimensions(), {world, -1}, "[world, m] (block j for rank j)"));
  } else {
    CGX_RETURN_IF_ERROR(CheckShape(target, "x", x.dimensions(), {-1}, "[m] (this rank's shard)"));
  }
  const int64_t m = x.dimensions()[scatter ? 1 : 0];
  if (scatter) {
    CGX_RETURN_IF_ERROR(CheckShape(target, "out", out->dimensions(), {m}, "[m] (this rank's block)"));
  } else {
    CGX_RETURN_IF_ERROR(CheckShape(target, "out", out->dimensions(), {world, m}, "[world, m] (every rank's shard)"));
  }
  Plan plan;
  const std::string bad =
      MakeShardedPlan(op, m, world, bits, bucket_size, cuda::FloatTypeBytes(type), segments, &plan);
  if (!bad.empty()) return InvalidArgument(target, bad);
  CGX_RETURN_IF_ERROR(CheckDType(target, "seeds", seeds.element_type(), ffi::DataType::U32));
  const int64_t seed_rows = scatter ? world : 1;
  CGX_RETURN_IF_ERROR(CheckShape(target, "seeds", seeds.dimensions(), {seed_rows, 2},
                                 scatter ? "[world, 2] (one row per block)" : "[1, 2]"));
  CGX_RETURN_IF_ERROR(CheckWorkspace(target, *workspace, plan.workspace_bytes));
  const NcclApi* api = nullptr;
  std::shared_ptr<Communicator> comm;
  CGX_RETURN_IF_ERROR(FindCall(target, comm_key, ordinal, world, &api, &comm));
  std::lock_guard<std::mutex> lock(comm->mu);
  CGX_RETURN_IF_ERROR(CheckUsable(target, *api, *comm));
  const Call call{{plan, static_cast<const char*>(x.untyped_data()), static_cast<char*>(out->untyped_data()),
                   static_cast<char*>(workspace->untyped_data())},
                  target, *comm, *api, stream, type, static_cast<const uint32_t*>(seeds.untyped_data()), stochastic,
                  nullptr};
  ReduceScatterSteps reduce_scatter{call};
  AllGatherSteps all_gather{call};
  ffi::Error result =
      scatter ? exchange::RunSegments(plan, reduce_scatter) : exchange::RunSegments(plan, all_gather);
  if (result.failure()) return Failed(*comm, stream, std::move(result));
  return ffi::Error::Success();
}

ffi::Error ReduceScatterImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer seeds,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace, int64_t comm_key,
                             int64_t world, int32_t bits, int64_t bucket_size, bool stochastic, int64_t segments) {
  return Run(ShardedOp::kReduceScatter, stream, ordinal, x, seeds, out, workspace, comm_key, world, bits,
             bucket_size, stochastic, segments);
}

ffi::Error AllGatherImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer seeds,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace, int64_t comm_key,
                         int64_t world, int32_t bits, int64_t bucket_size, bool stochastic, int64_t segments) {
  return Run(ShardedOp::kAllGather, stream, ordinal, x, seeds, out, workspace, comm_key, world, bits, bucket_size,
             stochastic, segments);
}

// The two handlers take the same arguments: x, seeds -> out, workspace.
auto ShardedBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()  // x
      .Arg<ffi::AnyBuffer>()  // seeds
      .Ret<ffi::AnyBuffer>()  // out
      .Ret<ffi::AnyBuffer>()  // workspace[bytes]
      .Attr<int64_t>("comm_key")
      .Attr<int64_t>("world")
      .Attr<int32_t>("bits")
      .Attr<int64_t>("bucket_size")
      .Attr<bool>("stochastic")
      .Attr<int64_t>("segments");
}

}  // namespace
}  // namespace sharded
}  // namespace jax_cgx::nccl

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaNcclReduceScatter, jax_cgx::nccl::sharded::ReduceScatterImpl,
                              jax_cgx::nccl::sharded::ShardedBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaNcclAllGather, jax_cgx::nccl::sharded::AllGatherImpl,
                              jax_cgx::nccl::sharded::ShardedBinding());
