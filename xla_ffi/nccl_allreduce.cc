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
// The side stream's first operation waits for work enqueued on XLA's stream
// during this call, so it never touches the workspace before XLA is done with
// its previous use; XLA's stream waits for the last all-gather, so everything
// is finished, as far as XLA can tell, when the call's stream work is.
// Nothing here allocates device memory or waits on the host.
#include "xla_ffi/nccl_allreduce.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <utility>
#include <string>
#include <string_view>

#include "xla_ffi/cuda_kernels.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/exchange_plan.h"
#include "xla_ffi/ffi_support.h"
#include "xla_ffi/nccl_api.h"
#include "xla_ffi/nccl_call.h"
#include "xla_ffi/nccl_comms.h"

namespace ffi = xla::ffi;

namespace jax_cgx::nccl {

std::string MakePlan(int64_t n, int64_t world, int64_t chunk, int bits, int64_t bucket_size,
                     int64_t elem_bytes, Algorithm algorithm, int64_t segments, Plan* plan) {
  const std::string bad = exchange::CheckArguments(n, world, chunk, bits, bucket_size, elem_bytes, segments,
                                                    kMaxSegments);
  if (!bad.empty()) return bad;
  if (algorithm != Algorithm::kSra && algorithm != Algorithm::kRing) {
    return "algorithm must be 0 (sra) or 1 (ring), got " + std::to_string(static_cast<int>(algorithm));
  }
  Plan& p = *plan;
  p = Plan();
  p.n = n;
  p.world = world;
  p.chunk = chunk;
  p.bucket = bucket_size;
  p.bits = bits;
  p.elem_bytes = elem_bytes;
  p.algorithm = algorithm;
  p.full_chunks = std::min(world, n / chunk);
  p.tail_chunks = world - p.full_chunks;

  // Segments are runs of whole buckets of a chunk (exchange_plan.h).
  const exchange::ChunkCut cut = exchange::CutChunk(chunk, bucket_size, elem_bytes, segments, kAutoSegmentBytes,
                                                    kAutoMaxSegments);
  p.segments = static_cast<int>(cut.count);

  exchange::WorkspaceLayout workspace(256);
  p.x_tail = workspace.Take(p.tail_chunks * chunk * elem_bytes);
  p.out_tail = workspace.Take(p.tail_chunks * chunk * elem_bytes);
  const int64_t send_slots = algorithm == Algorithm::kSra ? world : 2;
  const int64_t recv_slots = algorithm == Algorithm::kSra ? world : 1;
  for (int s = 0; s < p.segments; ++s) {
    Segment& seg = p.segment[s];
    seg.offset = s * cut.values;
    seg.length = std::min(chunk, seg.offset + cut.values) - seg.offset;
    seg.layout = cuda::MakeRowLayout(1, seg.length, bucket_size, bits);
    seg.layout.index_base = seg.offset;
    auto region = [&](int64_t slots) { return workspace.TakeRegion(slots, seg.layout.row_bytes, seg.layout.buckets); };
    seg.send = region(send_slots);
    seg.recv = region(recv_slots);
    seg.gathered = region(world);
  }
  p.workspace_bytes = workspace.Bytes();
  return "";
}

namespace {

constexpr std::string_view kTarget = "jax_cgx_nccl_allreduce";

using ffi_support::CheckDType;
using ffi_support::CheckFloatType;
using ffi_support::CheckShape;
using ffi_support::InvalidArgument;

// ---------------------------------------------------------------- schedule

// One call's buffers and the communicator it runs on.
struct Call {
  const Plan& plan;
  Communicator& comm;
  const NcclApi& api;
  cudaStream_t main;  // XLA's stream
  cuda::FloatType type;
  const char* x;
  char* out;
  char* ws;
  const uint32_t* seeds;  // [W + 1, 2]
  bool stochastic;
  const int32_t* valid;  // [1], device: x's first valid[0] values are real, the rest padding

  int64_t Bytes(int64_t values) const { return values * plan.elem_bytes; }
  // Which values of segment s of chunks j, j+1, ... (rows of a launch) set
  // their buckets' ranges: padding never widens a bucket.
  cuda::ValidCounts Valid(int64_t j, const Segment& s) const {
    cuda::ValidCounts v;
    v.total_dev = valid;
    v.first = j * plan.chunk + s.offset;
    v.row_step = plan.chunk;
    return v;
  }
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
    return exchange::SlotPayload(ws, r, s.layout.row_bytes, slot);
  }
  float* Meta(const Region& r, const Segment& s, int64_t slot) const {
    return exchange::SlotMeta(ws, r, s.layout.buckets, slot);
  }
  int64_t MetaBytes(const Segment& s) const { return exchange::MetaBytes(s.layout.buckets); }
  int Peer(int64_t offset) const {
    return static_cast<int>(((comm.rank + offset) % plan.world + plan.world) % plan.world);
  }
};

ffi::Error Launched(cudaError_t err, const char* what) { return nccl::Launched(kTarget, err, what); }

// Zero padding: chunks past x's end are read from a staged copy of x's tail.
// (Padding never enters a bucket's range: the launches' ValidCounts.)
ffi::Error StageTail(const Call& c) {
  const Plan& p = c.plan;
  if (p.tail_chunks == 0) return ffi::Error::Success();
  CGX_CUDA(cudaMemsetAsync(c.ws + p.x_tail, 0, c.Bytes(p.tail_chunks * p.chunk), c.main));
  const int64_t rem = p.n - p.full_chunks * p.chunk;
  if (rem > 0) {
    CGX_CUDA(cudaMemcpyAsync(c.ws + p.x_tail, c.x + c.Bytes(p.full_chunks * p.chunk), c.Bytes(rem),
                             cudaMemcpyDeviceToDevice, c.main));
  }
  return ffi::Error::Success();
}

ffi::Error UnstageTail(const Call& c) {
  const Plan& p = c.plan;
  const int64_t rem = p.n - p.full_chunks * p.chunk;
  if (p.tail_chunks == 0 || rem <= 0) return ffi::Error::Success();
  CGX_CUDA(cudaMemcpyAsync(c.out + c.Bytes(p.full_chunks * p.chunk), c.ws + p.out_tail, c.Bytes(rem),
                           cudaMemcpyDeviceToDevice, c.main));
  return ffi::Error::Success();
}

// Segment s of chunks [j0, j1) into send slots j0..j1-1, each with its seed
// row j: one launch per source (x itself, the staged tail).
ffi::Error QuantizeChunks(const Call& c, const Segment& s, int64_t j0, int64_t j1) {
  for (const auto& [a, b] : {std::pair{j0, std::min(j1, c.plan.full_chunks)},
                             std::pair{std::max(j0, c.plan.full_chunks), j1}}) {
    if (a >= b) continue;
    cuda::RowLayout l = s.layout;
    l.rows = b - a;
    CGX_RETURN_IF_ERROR(Launched(
        cuda::LaunchQuantize(c.main, l, c.type, c.ChunkIn(a) + c.Bytes(s.offset), c.plan.chunk, c.seeds + 2 * a,
                             c.stochastic, c.Payload(s.send, s, a), c.Meta(s.send, s, a), c.Valid(a, s)),
        "quantize"));
  }
  return ffi::Error::Success();
}

// Decodes `inputs` encodings (slots of `in`) plus chunk k of x in full
// precision, re-quantizes into slot `dst_slot` of `dst`.
ffi::Error ReduceInto(const Call& c, const Segment& s, const Region& in, int64_t inputs, int64_t k,
                      int64_t seed_row, const Region& dst, int64_t dst_slot) {
  return Launched(cuda::LaunchDequantizeSumRequantize(
                      c.main, s.layout, inputs, c.Payload(in, s, 0), c.Meta(in, s, 0), c.type,
                      c.ChunkIn(k) + c.Bytes(s.offset), c.seeds + 2 * seed_row, c.stochastic,
                      c.Payload(dst, s, dst_slot), c.Meta(dst, s, dst_slot), c.type, nullptr,
                      c.Valid(k, s)),
                  "dequantize_sum_requantize");
}

// Side stream: after `ready` (XLA stream), all-gather every rank's reduced chunk.
ffi::Error AllGather(const Call& c, const Segment& s, cudaEvent_t ready, cudaEvent_t done) {
  const Region& g = s.gathered;
  CGX_CUDA(cudaStreamWaitEvent(c.comm.stream, ready, 0));
  CGX_RETURN_IF_ERROR(AllGatherEncodings(kTarget, c.api, c.comm, c.Payload(g, s, 0), c.Meta(g, s, 0),
                                         s.layout.row_bytes, c.MetaBytes(s)));
  CGX_CUDA(cudaEventRecord(done, c.comm.stream));
  return ffi::Error::Success();
}

// XLA stream: after `gathered`, decode the W reduced chunks into the output.
ffi::Error Decode(const Call& c, const Segment& s, cudaEvent_t gathered) {
  CGX_CUDA(cudaStreamWaitEvent(c.main, gathered, 0));
  const Plan& p = c.plan;
  // A whole-chunk segment decodes into consecutive rows: one launch per
  // destination (the output, the staged tail); otherwise one per chunk.
  const bool whole = s.length == p.chunk;
  for (int64_t a = 0; a < p.world;) {
    const int64_t b = !whole ? a + 1 : (a < p.full_chunks ? p.full_chunks : p.world);
    cuda::RowLayout l = s.layout;
    l.rows = b - a;
    CGX_RETURN_IF_ERROR(Launched(cuda::LaunchDequantize(c.main, l, c.Payload(s.gathered, s, a),
                                                        c.Meta(s.gathered, s, a), c.type,
                                                        c.ChunkOut(a) + c.Bytes(s.offset)),
                                 "dequantize"));
    a = b;
  }
  return ffi::Error::Success();
}

// Inside an open NCCL group on the side stream: send the encoding in slot
// `send_slot` of s.send to rank `to` and receive one into slot `recv_slot` of
// s.recv from rank `from` (payload and metadata, as bytes).
ffi::Error SendRecv(const Call& c, const Segment& s, int64_t send_slot, int to, int64_t recv_slot, int from) {
  return SendRecvEncoding(kTarget, c.api, c.comm, c.Payload(s.send, s, send_slot), c.Meta(s.send, s, send_slot),
                          c.Payload(s.recv, s, recv_slot), c.Meta(s.recv, s, recv_slot), s.layout.row_bytes,
                          c.MetaBytes(s), to, from);
}

// SRA (jax_cgx/collectives/sra.py): every rank quantizes its W chunks, chunk j goes to
// rank j, the owner sums the W encodings (its own with zeroed metadata) plus
// its chunk in full precision and re-quantizes; then all-gather and decode.
ffi::Error RunSra(const Call& c) {
  const Plan& p = c.plan;
  Communicator& comm = c.comm;
  const int me = comm.rank;
  for (int i = 0; i < p.segments; ++i) {
    const Segment& s = p.segment[i];
    // Chunks [0, me) and (me, W): our own chunk is never sent (it enters the sum exactly).
    CGX_RETURN_IF_ERROR(QuantizeChunks(c, s, 0, me));
    CGX_RETURN_IF_ERROR(QuantizeChunks(c, s, me + 1, p.world));
    CGX_CUDA(cudaEventRecord(comm.quantized[i], c.main));
    CGX_CUDA(cudaStreamWaitEvent(comm.stream, comm.quantized[i], 0));
    NcclGroup group(c.api);
    CGX_NCCL(group.Start(), comm.comm);
    for (int j = 0; j < p.world; ++j) {
      if (j != me) CGX_RETURN_IF_ERROR(SendRecv(c, s, j, j, j, j));
    }
    CGX_NCCL(group.End(), comm.comm);
    CGX_CUDA(cudaEventRecord(comm.exchanged[i], comm.stream));
  }
  for (int i = 0; i < p.segments; ++i) {
    const Segment& s = p.segment[i];
    CGX_CUDA(cudaStreamWaitEvent(c.main, comm.exchanged[i], 0));
    // Our own chunk enters in full precision: its slot must decode to +0.
    CGX_CUDA(cudaMemsetAsync(c.Meta(s.recv, s, me), 0, c.MetaBytes(s), c.main));
    CGX_RETURN_IF_ERROR(ReduceInto(c, s, s.recv, p.world, me, p.world, s.gathered, me));
    CGX_CUDA(cudaEventRecord(comm.reduced[i], c.main));
    CGX_RETURN_IF_ERROR(AllGather(c, s, comm.reduced[i], comm.gathered[i]));
  }
  for (int i = 0; i < p.segments; ++i) CGX_RETURN_IF_ERROR(Decode(c, p.segment[i], comm.gathered[i]));
  return ffi::Error::Success();
}

// Side stream: send slot `slot` of `send` to the next rank, receive the
// previous rank's encoding into `recv`, after `ready`.
ffi::Error RingHop(const Call& c, const Segment& s, int64_t slot, cudaEvent_t ready, cudaEvent_t done) {
  Communicator& comm = c.comm;
  const int next = c.Peer(1), prev = c.Peer(-1);
  CGX_CUDA(cudaStreamWaitEvent(comm.stream, ready, 0));
  NcclGroup group(c.api);
  CGX_NCCL(group.Start(), comm.comm);
  CGX_RETURN_IF_ERROR(SendRecv(c, s, slot, next, 0, prev));
  CGX_NCCL(group.End(), comm.comm);
  CGX_CUDA(cudaEventRecord(done, comm.stream));
  return ffi::Error::Success();
}

// Ring (jax_cgx/collectives/ring.py): rank r quantizes chunk r-1 (seed row 0) and sends
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
    CGX_RETURN_IF_ERROR(Launched(
        cuda::LaunchQuantize(c.main, s.layout, c.type, c.ChunkIn(first) + c.Bytes(s.offset), p.chunk, c.seeds,
                             c.stochastic, c.Payload(s.send, s, 0), c.Meta(s.send, s, 0), c.Valid(first, s)),
        "quantize"));
    CGX_CUDA(cudaEventRecord(comm.quantized[i], c.main));
    CGX_RETURN_IF_ERROR(RingHop(c, s, 0, comm.quantized[i], comm.exchanged[i]));
  }
  for (int64_t t = 0; t + 1 < p.world; ++t) {
    const bool last = t + 2 == p.world;
    const int64_t k = c.Peer(-t - 2);
    for (int i = 0; i < p.segments; ++i) {
      const Segment& s = p.segment[i];
      CGX_CUDA(cudaStreamWaitEvent(c.main, comm.exchanged[i], 0));
      if (last) {
        CGX_RETURN_IF_ERROR(ReduceInto(c, s, s.recv, 1, k, p.world, s.gathered, me));
      } else {
        CGX_RETURN_IF_ERROR(ReduceInto(c, s, s.recv, 1, k, t + 1, s.send, (t + 1) % 2));
      }
      CGX_CUDA(cudaEventRecord(comm.reduced[i], c.main));
      if (last) {
        CGX_RETURN_IF_ERROR(AllGather(c, s, comm.reduced[i], comm.gathered[i]));
      } else {
        CGX_RETURN_IF_ERROR(RingHop(c, s, (t + 1) % 2, comm.reduced[i], comm.exchanged[i]));
      }
    }
  }
  for (int i = 0; i < p.segments; ++i) CGX_RETURN_IF_ERROR(Decode(c, p.segment[i], comm.gathered[i]));
  return ffi::Error::Success();
}

// ----------------------------------------------------------------- handler

ffi::Error NcclAllreduceImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer seeds,
                             ffi::AnyBuffer valid, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                             int64_t comm_key, int64_t world, int64_t chunk, int32_t bits,
                             int64_t bucket_size, bool stochastic, int32_t algorithm, int64_t segments) {
  cuda::FloatType type = cuda::FloatType::kF32;
  CGX_RETURN_IF_ERROR(CheckFloatType(kTarget, "x", x.element_type(), &type));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "x", x.dimensions(), {-1}, "rank 1 [n] (one row)"));
  const int64_t n = x.dimensions()[0];
  CGX_RETURN_IF_ERROR(CheckDType(kTarget, "out", out->element_type(), x.element_type()));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "out", out->dimensions(), {n}, "[n] like x"));
  // The plan checks the attributes (world >= 2 among them) before seeds is
  // checked against world.
  Plan plan;
  const std::string bad = MakePlan(n, world, chunk, bits, bucket_size, cuda::FloatTypeBytes(type),
                                   static_cast<Algorithm>(algorithm), segments, &plan);
  if (!bad.empty()) return InvalidArgument(kTarget, bad);
  CGX_RETURN_IF_ERROR(CheckDType(kTarget, "seeds", seeds.element_type(), ffi::DataType::U32));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "seeds", seeds.dimensions(), {world + 1, 2}, "[world + 1, 2]"));
  CGX_RETURN_IF_ERROR(CheckDType(kTarget, "valid", valid.element_type(), ffi::DataType::S32));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "valid", valid.dimensions(), {1},
                                 "[1] (how many of x's values are real, the rest padding)"));
  CGX_RETURN_IF_ERROR(CheckWorkspace(kTarget, *workspace, plan.workspace_bytes));
  const NcclApi* api = nullptr;
  std::shared_ptr<Communicator> comm;
  CGX_RETURN_IF_ERROR(FindCall(kTarget, comm_key, ordinal, world, &api, &comm));
  std::lock_guard<std::mutex> lock(comm->mu);
  CGX_RETURN_IF_ERROR(CheckUsable(kTarget, *api, *comm));
  const Call call{plan, *comm, *api, stream, type, static_cast<const char*>(x.untyped_data()),
                  static_cast<char*>(out->untyped_data()), static_cast<char*>(workspace->untyped_data()),
                  static_cast<const uint32_t*>(seeds.untyped_data()), stochastic,
                  static_cast<const int32_t*>(valid.untyped_data())};
  CGX_RETURN_IF_ERROR(StageTail(call));
  ffi::Error result = plan.algorithm == Algorithm::kSra ? RunSra(call) : RunRing(call);
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
                                  .Attr<int64_t>("segments"));
