// jax_cgx_nccl_allreduce: the compressed all-reduce of one row as one custom
// call on jax_cgx's NCCL communicators (see nccl_allreduce.h).
//
// Streams. Kernels run on XLA's stream; NCCL runs on the communicator's side
// stream; events order the two per segment, so quantizing segment s+1
// overlaps sending segment s, and reducing s+1 overlaps gathering s:
//
//   XLA stream:  Q0 Q1 ... | D0 D1 ... | U0 U1 ...      Q quantize, D fused
//   side stream:    X0 X1 ...| G0 G1 ...                 dequantize-sum-requantize,
//                                                        U decode; X exchange,
//                                                        G all-gather
//
// (nccl_call.h has the streams' contract.)
#include "xla_ffi/nccl_allreduce.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <utility>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cuda_kernels.h"
#include "xla_ffi/exchange_plan.h"
#include "xla_ffi/ffi_support.h"
#include "xla_ffi/nccl_api.h"
#include "xla_ffi/nccl_call.h"
#include "xla_ffi/nccl_comms.h"

namespace ffi = xla::ffi;

namespace jax_cgx::nccl {

std::string MakeAllreducePlan(int64_t n, int64_t world, int64_t chunk, int bits, int64_t bucket_size,
                              int64_t elem_bytes, Algorithm algorithm, int64_t segments, Plan* plan) {
  const bool ring = algorithm == Algorithm::kRing;
  const exchange::Shape shape = ShapeOf(ring ? 2 : world, ring ? 1 : world, world);
  std::string bad = exchange::MakePlan(n, world, chunk, bits, bucket_size, elem_bytes, segments, shape, plan);
  if (bad.empty() && algorithm != Algorithm::kSra && !ring) {
    bad = "algorithm must be 0 (sra) or 1 (ring), got " + std::to_string(static_cast<int>(algorithm));
  }
  return bad;
}

namespace {

constexpr std::string_view kTarget = "jax_cgx_nccl_allreduce";

using ffi_support::CheckRow;
using ffi_support::CheckRowSeeds;
using ffi_support::InvalidArgument;

// ---------------------------------------------------------------- schedule

// Zero padding: chunks past x's end are read from a staged copy of x's tail.
// (Padding never enters a bucket's range: the launches' ValidCounts.)
ffi::Error StageTail(const Call& c) {
  const Plan& p = c.plan;
  if (p.tail_chunks == 0) return ffi::Error::Success();
  CGX_CUDA(kTarget, cudaMemsetAsync(c.ws + p.x_tail, 0, c.Bytes(p.tail_chunks * p.chunk), c.main));
  const int64_t rem = p.rem();
  if (rem > 0) {
    CGX_CUDA(kTarget, cudaMemcpyAsync(c.ws + p.x_tail, c.x + c.Bytes(p.full_chunks * p.chunk), c.Bytes(rem),
                                      cudaMemcpyDeviceToDevice, c.main));
  }
  return ffi::Error::Success();
}

ffi::Error UnstageTail(const Call& c) {
  const Plan& p = c.plan;
  const int64_t rem = p.rem();
  if (p.tail_chunks == 0 || rem <= 0) return ffi::Error::Success();
  CGX_CUDA(kTarget, cudaMemcpyAsync(c.out + c.Bytes(p.full_chunks * p.chunk), c.ws + p.out_tail, c.Bytes(rem),
                                    cudaMemcpyDeviceToDevice, c.main));
  return ffi::Error::Success();
}

// Decodes `inputs` encodings (slots of `in`) plus chunk k of x in full
// precision, re-quantizes into slot `dst_slot` of `dst`.
ffi::Error ReduceInto(const Call& c, const Segment& s, const Region& in, int64_t inputs, int64_t k,
                      int64_t seed_row, const Region& dst, int64_t dst_slot) {
  return c.Launched(cuda::LaunchDequantizeSumRequantize(
                        c.main, c.Layout(s), inputs, c.Payload(in, s, 0), c.Meta(in, s, 0), c.type,
                        c.ChunkIn(k) + c.Bytes(s.offset), c.seeds + 2 * seed_row, c.stochastic,
                        c.Payload(dst, s, dst_slot), c.Meta(dst, s, dst_slot), c.type, nullptr, c.Valid(k, s)),
                    "dequantize_sum_requantize");
}

// SRA (jax_cgx/_src/exchange/sra.py) as the steps of exchange::RunSegments:
// every rank quantizes its W chunks, chunk j goes to rank j, the owner sums
// the W encodings (its own with zeroed metadata) plus its chunk in full
// precision and re-quantizes; then all-gather and decode.
struct SraSteps {
  const Call& c;
  ffi::Error Send(int i, const Segment& s) const { return SendToPeers(c, i, s); }
  ffi::Error Reduce(int i, const Segment& s) const {
    Communicator& comm = c.comm;
    const int me = comm.rank;
    const int64_t w = c.plan.world;
    CGX_CUDA(kTarget, cudaStreamWaitEvent(c.main, comm.exchanged[i], 0));
    // Our own chunk enters in full precision: its slot must decode to +0.
    CGX_CUDA(kTarget, cudaMemsetAsync(c.Meta(s.recv, s, me), 0, s.meta_bytes(), c.main));
    CGX_RETURN_IF_ERROR(ReduceInto(c, s, s.recv, w, me, w, s.gathered, me));
    CGX_CUDA(kTarget, cudaEventRecord(comm.reduced[i], c.main));
    return Gather(c, s, comm.reduced[i], comm.gathered[i]);
  }
  ffi::Error Decode(int i, const Segment& s) const { return DecodeGathered(c, s, c.comm.gathered[i]); }
};

// Side stream: send slot `slot` of `send` to the next rank, receive the
// previous rank's encoding into `recv`, after `ready`.
ffi::Error RingHop(const Call& c, const Segment& s, int64_t slot, cudaEvent_t ready, cudaEvent_t done) {
  Communicator& comm = c.comm;
  const int next = c.Peer(1), prev = c.Peer(-1);
  CGX_CUDA(kTarget, cudaStreamWaitEvent(comm.stream, ready, 0));
  NcclGroup group(c.api);
  CGX_NCCL(kTarget, group.Start(), comm.comm);
  CGX_RETURN_IF_ERROR(SendRecv(c, s, slot, next, 0, prev));
  CGX_NCCL(kTarget, group.End(), comm.comm);
  CGX_CUDA(kTarget, cudaEventRecord(done, comm.stream));
  return ffi::Error::Success();
}

// Ring (jax_cgx/_src/exchange/ring.py): rank r quantizes chunk r-1 (seed row 0) and sends
// it on; at hop t it receives chunk r-t-2, adds its own copy in full precision
// and re-quantizes (seed row t+1), and at the last hop (t = W-2, chunk r) uses
// seed row W, giving the final encoding of chunk r; then all-gather, decode.
ffi::Error RunRing(const Call& c) {
  const Plan& p = c.plan;
  Communicator& comm = c.comm;
  const int me = comm.rank;
  for (int i = 0; i < p.segments; ++i) {
    const Segment& s = p.segment[i];
    const int64_t first = c.Peer(-1);
    CGX_RETURN_IF_ERROR(c.Launched(
        cuda::LaunchQuantize(c.main, c.Layout(s), c.type, c.ChunkIn(first) + c.Bytes(s.offset), p.chunk, c.seeds,
                             c.stochastic, c.Payload(s.send, s, 0), c.Meta(s.send, s, 0), c.Valid(first, s)),
        "quantize"));
    CGX_CUDA(kTarget, cudaEventRecord(comm.quantized[i], c.main));
    CGX_RETURN_IF_ERROR(RingHop(c, s, 0, comm.quantized[i], comm.exchanged[i]));
  }
  for (int64_t t = 0; t + 1 < p.world; ++t) {
    const bool last = t + 2 == p.world;
    const int64_t k = c.Peer(-t - 2);
    for (int i = 0; i < p.segments; ++i) {
      const Segment& s = p.segment[i];
      CGX_CUDA(kTarget, cudaStreamWaitEvent(c.main, comm.exchanged[i], 0));
      if (last) {
        CGX_RETURN_IF_ERROR(ReduceInto(c, s, s.recv, 1, k, p.world, s.gathered, me));
      } else {
        CGX_RETURN_IF_ERROR(ReduceInto(c, s, s.recv, 1, k, t + 1, s.send, (t + 1) % 2));
      }
      CGX_CUDA(kTarget, cudaEventRecord(comm.reduced[i], c.main));
      if (last) {
        CGX_RETURN_IF_ERROR(Gather(c, s, comm.reduced[i], comm.gathered[i]));
      } else {
        CGX_RETURN_IF_ERROR(RingHop(c, s, (t + 1) % 2, comm.reduced[i], comm.exchanged[i]));
      }
    }
  }
  for (int i = 0; i < p.segments; ++i) CGX_RETURN_IF_ERROR(DecodeGathered(c, p.segment[i], comm.gathered[i]));
  return ffi::Error::Success();
}

// ----------------------------------------------------------------- handler

ffi::Error NcclAllreduceImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer seeds,
                             ffi::AnyBuffer valid, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                             int64_t comm_key, int64_t world, int64_t chunk, int32_t bits,
                             int64_t bucket_size, bool stochastic, int32_t algorithm, int64_t segments,
                             float scale) {
  CGX_RETURN_IF_ERROR(ffi_support::CheckOutScale(kTarget, scale));
  cuda::FloatType type = cuda::FloatType::kF32;
  int64_t n = 0;
  CGX_RETURN_IF_ERROR(CheckRow(kTarget, x, *out, &type, &n));
  Plan plan;
  const std::string bad = MakeAllreducePlan(n, world, chunk, bits, bucket_size, cuda::FloatTypeBytes(type),
                                            static_cast<Algorithm>(algorithm), segments, &plan);
  if (!bad.empty()) return InvalidArgument(kTarget, bad);
  CGX_RETURN_IF_ERROR(CheckRowSeeds(kTarget, seeds, valid, world));
  CGX_RETURN_IF_ERROR(CheckWorkspace(kTarget, *workspace, plan.workspace_bytes));
  const NcclApi* api = nullptr;
  std::shared_ptr<Communicator> comm;
  CGX_RETURN_IF_ERROR(FindCall(kTarget, comm_key, ordinal, world, &api, &comm));
  std::lock_guard<std::mutex> lock(comm->mu);
  CGX_RETURN_IF_ERROR(CheckUsable(kTarget, *api, *comm));
  const Call call{{plan, static_cast<const char*>(x.untyped_data()), static_cast<char*>(out->untyped_data()),
                   static_cast<char*>(workspace->untyped_data())},
                  kTarget, *comm, *api, stream, type, static_cast<const uint32_t*>(seeds.untyped_data()), stochastic,
                  static_cast<const int32_t*>(valid.untyped_data()), scale};
  CGX_RETURN_IF_ERROR(StageTail(call));
  SraSteps sra{call};
  ffi::Error result =
      static_cast<Algorithm>(algorithm) == Algorithm::kSra ? exchange::RunSegments(plan, sra) : RunRing(call);
  if (result.failure()) return Failed(*comm, stream, std::move(result));
  return UnstageTail(call);
}

}  // namespace
}  // namespace jax_cgx::nccl

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaNcclAllreduce, jax_cgx::nccl::NcclAllreduceImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // x[n]
                                  .Arg<ffi::AnyBuffer>()  // seeds[W + 1, 2]
                                  .Arg<ffi::AnyBuffer>()  // valid[1]
                                  .Ret<ffi::AnyBuffer>()  // out[n]
                                  .Ret<ffi::AnyBuffer>()  // workspace[bytes]
                                  .Attr<int64_t>("comm_key")
                                  .Attr<int64_t>("world")
                                  .Attr<int64_t>("chunk")
                                  .Attr<int32_t>("bits")
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<bool>("stochastic")
                                  .Attr<int32_t>("algorithm")
                                  .Attr<int64_t>("segments")
                                  .Attr<float>("scale"));  // 1, or 1/W for a mean
