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
// The side stream's first operation waits for work XLA's stream enqueued during
// this call (so it never touches the workspace before XLA is done with its
// previous use), and XLA's stream waits for the side stream's last operation.
// Nothing here allocates device memory or waits on the host.
#include "xla_ffi/nccl_sharded.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "xla_ffi/cuda_kernels.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/exchange_plan.h"
#include "xla_ffi/ffi_support.h"
#include "xla_ffi/nccl_api.h"
#include "xla_ffi/nccl_call.h"
#include "xla_ffi/nccl_comms.h"

namespace ffi = xla::ffi;

namespace jax_cgx::nccl {

// Auto segmentation aims at this many bytes of input per block segment.
inline constexpr int64_t kShardedSegmentBytes = int64_t{16} << 20;
inline constexpr int kShardedMaxAutoSegments = 8;

std::string MakeShardedPlan(ShardedOp op, int64_t m, int64_t world, int bits, int64_t bucket_size,
                            int64_t elem_bytes, int64_t segments, ShardedPlan* plan) {
  if (op != ShardedOp::kReduceScatter && op != ShardedOp::kAllGather) {
    return "op must be 0 (reduce-scatter) or 1 (all-gather), got " + std::to_string(static_cast<int>(op));
  }
  if (m < 1) return "a block must hold at least one value, got " + std::to_string(m);
  const std::string bad = exchange::CheckArguments(m * world, world, m, bits, bucket_size, elem_bytes, segments,
                                                    kMaxSegments);
  if (!bad.empty()) return bad;
  ShardedPlan& p = *plan;
  p = ShardedPlan();
  p.op = op;
  p.m = m;
  p.world = world;
  p.bits = bits;
  p.elem_bytes = elem_bytes;
  const exchange::ChunkCut cut = exchange::CutChunk(m, bucket_size, elem_bytes, segments, kShardedSegmentBytes,
                                                    kShardedMaxAutoSegments);
  p.segments = static_cast<int>(cut.count);
  exchange::WorkspaceLayout workspace(256);
  for (int s = 0; s < p.segments; ++s) {
    ShardedSegment& seg = p.segment[s];
    seg.offset = s * cut.values;
    seg.length = std::min(m, seg.offset + cut.values) - seg.offset;
    seg.layout = cuda::MakeRowLayout(1, seg.length, bucket_size, bits);
    seg.layout.index_base = seg.offset;
    seg.slots = workspace.TakeRegion(world, seg.layout.row_bytes, seg.layout.buckets);
    if (op == ShardedOp::kReduceScatter) seg.recv = workspace.TakeRegion(world, seg.layout.row_bytes, seg.layout.buckets);
  }
  p.workspace_bytes = workspace.Bytes();
  return "";
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

// One call's buffers and the communicator it runs on.
struct Call {
  std::string_view target;
  const ShardedPlan& plan;
  Communicator& comm;
  const NcclApi& api;
  cudaStream_t main;  // XLA's stream
  cuda::FloatType type;
  const char* x;
  char* out;
  char* ws;
  const uint32_t* seeds;  // [W, 2] (reduce-scatter) or [1, 2] (all-gather)
  bool stochastic;

  int64_t Bytes(int64_t values) const { return values * plan.elem_bytes; }
  uint8_t* Payload(const exchange::Region& r, const ShardedSegment& s, int64_t slot) const {
    return exchange::SlotPayload(ws, r, s.layout.row_bytes, slot);
  }
  float* Meta(const exchange::Region& r, const ShardedSegment& s, int64_t slot) const {
    return exchange::SlotMeta(ws, r, s.layout.buckets, slot);
  }
  int64_t MetaBytes(const ShardedSegment& s) const { return exchange::MetaBytes(s.layout.buckets); }
};

// Segment s of blocks [a, b) of x (rows at stride m) into slots a..b-1, seed row j each.
ffi::Error QuantizeBlocks(const Call& c, const ShardedSegment& s, int64_t a, int64_t b) {
  if (a >= b) return ffi::Error::Success();
  cuda::RowLayout l = s.layout;
  l.rows = b - a;
  return Launched(c.target,
                  cuda::LaunchQuantize(c.main, l, c.type, c.x + c.Bytes(a * c.plan.m + s.offset), c.plan.m,
                                       c.seeds + 2 * a, c.stochastic, c.Payload(s.slots, s, a),
                                       c.Meta(s.slots, s, a)),
                  "quantize");
}

// Reduce-scatter (scatter_rows): block j goes to rank j; the owner sums the W
// encodings of its block (its own slot with zeroed metadata, so it adds +0 as
// in the xla backend) onto its own block in full precision.
ffi::Error RunReduceScatter(const Call& c) {
  const std::string_view kTarget = c.target;
  const ShardedPlan& p = c.plan;
  Communicator& comm = c.comm;
  const int me = comm.rank;
  for (int i = 0; i < p.segments; ++i) {
    const ShardedSegment& s = p.segment[i];
    // Our own block is never sent: it enters the sum exactly.
    CGX_RETURN_IF_ERROR(QuantizeBlocks(c, s, 0, me));
    CGX_RETURN_IF_ERROR(QuantizeBlocks(c, s, me + 1, p.world));
    CGX_CUDA(cudaEventRecord(comm.quantized[i], c.main));
    CGX_CUDA(cudaStreamWaitEvent(comm.stream, comm.quantized[i], 0));
    NcclGroup group(c.api);
    CGX_NCCL(group.Start(), comm.comm);
    for (int j = 0; j < p.world; ++j) {
      if (j == me) continue;
      CGX_RETURN_IF_ERROR(SendRecvEncoding(c.target, c.api, comm, c.Payload(s.slots, s, j), c.Meta(s.slots, s, j),
                                           c.Payload(s.recv, s, j), c.Meta(s.recv, s, j), s.layout.row_bytes,
                                           c.MetaBytes(s), j, j));
    }
    CGX_NCCL(group.End(), comm.comm);
    CGX_CUDA(cudaEventRecord(comm.exchanged[i], comm.stream));
  }
  for (int i = 0; i < p.segments; ++i) {
    const ShardedSegment& s = p.segment[i];
    CGX_CUDA(cudaStreamWaitEvent(c.main, comm.exchanged[i], 0));
    // Our own slot receives nothing: zero it, metadata (0, 0) decoding to +0 (the payload too, so
    // that nothing reads uninitialized memory).
    CGX_CUDA(cudaMemsetAsync(c.Payload(s.recv, s, me), 0, s.layout.row_bytes, c.main));
    CGX_CUDA(cudaMemsetAsync(c.Meta(s.recv, s, me), 0, c.MetaBytes(s), c.main));
    CGX_RETURN_IF_ERROR(Launched(
        c.target,
        cuda::LaunchDequantizeSum(c.main, s.layout, p.world, c.Payload(s.recv, s, 0), c.Meta(s.recv, s, 0), c.type,
                                  c.x + c.Bytes(me * p.m + s.offset), c.type, c.out + c.Bytes(s.offset)),
        "dequantize_sum"));
  }
  return ffi::Error::Success();
}

// All-gather (gather_rows): the owner quantizes its shard into its slot, the
// slots are all-gathered in place, and every rank decodes all W.
ffi::Error RunAllGather(const Call& c) {
  const std::string_view kTarget = c.target;
  const ShardedPlan& p = c.plan;
  Communicator& comm = c.comm;
  const int me = comm.rank;
  for (int i = 0; i < p.segments; ++i) {
    const ShardedSegment& s = p.segment[i];
    CGX_RETURN_IF_ERROR(Launched(
        c.target,
        cuda::LaunchQuantize(c.main, s.layout, c.type, c.x + c.Bytes(s.offset), p.m, c.seeds, c.stochastic,
                             c.Payload(s.slots, s, me), c.Meta(s.slots, s, me)),
        "quantize"));
    CGX_CUDA(cudaEventRecord(comm.quantized[i], c.main));
    CGX_CUDA(cudaStreamWaitEvent(comm.stream, comm.quantized[i], 0));
    CGX_RETURN_IF_ERROR(AllGatherEncodings(c.target, c.api, comm, c.Payload(s.slots, s, 0), c.Meta(s.slots, s, 0),
                                           s.layout.row_bytes, c.MetaBytes(s)));
    CGX_CUDA(cudaEventRecord(comm.gathered[i], comm.stream));
  }
  for (int i = 0; i < p.segments; ++i) {
    const ShardedSegment& s = p.segment[i];
    CGX_CUDA(cudaStreamWaitEvent(c.main, comm.gathered[i], 0));
    // A whole-shard segment decodes the W shards as consecutive rows of out; otherwise one launch per shard.
    const int64_t rows = s.length == p.m ? p.world : 1;
    for (int64_t j = 0; j < p.world; j += rows) {
      cuda::RowLayout l = s.layout;
      l.rows = rows;
      CGX_RETURN_IF_ERROR(Launched(c.target,
                                   cuda::LaunchDequantize(c.main, l, c.Payload(s.slots, s, j), c.Meta(s.slots, s, j),
                                                          c.type, c.out + c.Bytes(j * p.m + s.offset)),
                                   "dequantize"));
    }
  }
  return ffi::Error::Success();
}

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
  ShardedPlan plan;
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
  const Call call{target, plan, *comm, *api, stream, type, static_cast<const char*>(x.untyped_data()),
                  static_cast<char*>(out->untyped_data()), static_cast<char*>(workspace->untyped_data()),
                  static_cast<const uint32_t*>(seeds.untyped_data()), stochastic};
  ffi::Error result = scatter ? RunReduceScatter(call) : RunAllGather(call);
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
