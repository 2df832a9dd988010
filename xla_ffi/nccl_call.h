// What every nccl-backend handler (xla_ffi/nccl_allreduce.cc, xla_ffi/nccl_sharded.cc)
// shares: its call (buffers, plan, streams) and the steps of its segment
// schedule on the two streams (quantizing and exchanging the peers' chunks, the
// all-gather, decoding); and around the schedule: check CUDA and NCCL return
// codes, keep NCCL groups balanced, find the communicator of the call and
// refuse an unusable one, and leave a failed call's communicator marked broken
// with XLA's stream joined.
//
// Streams. Kernels run on XLA's stream; NCCL runs on the communicator's side
// stream; events order the two per segment (exchange::RunSegments's order), so
// quantizing segment s+1 overlaps moving segment s. The side stream's first
// operation waits for work enqueued on XLA's stream during the call, so it
// never touches the workspace before XLA is done with its previous use; XLA's
// stream waits for the side stream's last operation. Nothing here allocates
// device memory or waits on the host.
//
// The macros return `Internal(target, ...)`, the custom call's name passed in.
#ifndef JAX_CGX_XLA_FFI_NCCL_CALL_H_
#define JAX_CGX_XLA_FFI_NCCL_CALL_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cuda_kernels.h"
#include "xla_ffi/exchange_plan.h"
#include "xla_ffi/ffi_support.h"
#include "xla_ffi/nccl_api.h"
#include "xla_ffi/nccl_comms.h"

#define CGX_CUDA(target, expr)                                                               \
  do {                                                                                       \
    const cudaError_t _cgx_err = (expr);                                                     \
    if (_cgx_err != cudaSuccess) {                                                           \
      return ::jax_cgx::ffi_support::Internal((target), std::string(#expr) + " failed: " +   \
                                                            cudaGetErrorString(_cgx_err));   \
    }                                                                                        \
  } while (0)

#define CGX_NCCL(target, expr, comm)                                                          \
  do {                                                                                        \
    const ncclResult_t _cgx_rc = (expr);                                                      \
    if (_cgx_rc != ncclSuccess) {                                                             \
      return ::jax_cgx::ffi_support::Internal(                                                \
          (target), std::string(#expr) + " failed: " + ::jax_cgx::nccl::NcclErrorText(_cgx_rc, (comm))); \
    }                                                                                         \
  } while (0)

namespace jax_cgx::nccl {

// An open ncclGroupStart that is always closed: NCCL's group depth is per
// thread and shared with XLA's own collectives, so an error return inside a
// group must still end it.
class NcclGroup {
 public:
  explicit NcclGroup(const NcclApi& api) : api_(api) {}
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  ~NcclGroup() {
    if (open_) api_.GroupEnd();
  }
  ncclResult_t Start() {
    const ncclResult_t rc = api_.GroupStart();
    open_ = rc == ncclSuccess;
    return rc;
  }
  ncclResult_t End() {
    open_ = false;
    return api_.GroupEnd();
  }

 private:
  const NcclApi& api_;
  bool open_ = false;
};

// A kernel launch's status as the handler's error.
inline xla::ffi::Error Launched(std::string_view target, cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    return ffi_support::Internal(target, std::string(what) + " launch failed: " + cudaGetErrorString(err));
  }
  return xla::ffi::Error::Success();
}

// Inside an open NCCL group on comm's side stream: send one encoding (payload
// and metadata, as bytes) to rank `to`, receive one from rank `from`.
inline xla::ffi::Error SendRecvEncoding(std::string_view target, const NcclApi& api, const Communicator& comm,
                                        const uint8_t* send_payload, const float* send_meta, uint8_t* recv_payload,
                                        float* recv_meta, size_t row_bytes, size_t meta_bytes, int to, int from) {
  CGX_NCCL(target, api.Send(send_payload, row_bytes, ncclUint8, to, comm.comm, comm.stream), comm.comm);
  CGX_NCCL(target, api.Send(send_meta, meta_bytes, ncclUint8, to, comm.comm, comm.stream), comm.comm);
  CGX_NCCL(target, api.Recv(recv_payload, row_bytes, ncclUint8, from, comm.comm, comm.stream), comm.comm);
  CGX_NCCL(target, api.Recv(recv_meta, meta_bytes, ncclUint8, from, comm.comm, comm.stream), comm.comm);
  return xla::ffi::Error::Success();
}

// On comm's side stream, as one NCCL group: the in-place all-gather of W
// encodings, slot j from rank j (payload rows at `payload`, metadata rows at `meta`).
inline xla::ffi::Error AllGatherEncodings(std::string_view target, const NcclApi& api, const Communicator& comm,
                                          uint8_t* payload, float* meta, size_t row_bytes, size_t meta_bytes) {
  uint8_t* meta_bytes_base = reinterpret_cast<uint8_t*>(meta);
  NcclGroup group(api);
  CGX_NCCL(target, group.Start(), comm.comm);
  CGX_NCCL(target,
           api.AllGather(payload + comm.rank * row_bytes, payload, row_bytes, ncclUint8, comm.comm, comm.stream),
           comm.comm);
  CGX_NCCL(target,
           api.AllGather(meta_bytes_base + comm.rank * meta_bytes, meta_bytes_base, meta_bytes, ncclUint8, comm.comm,
                         comm.stream),
           comm.comm);
  CGX_NCCL(target, group.End(), comm.comm);
  return xla::ffi::Error::Success();
}

// The workspace result: u8, rank 1, at least `bytes` (its plan's size) long.
inline xla::ffi::Error CheckWorkspace(std::string_view target, const xla::ffi::AnyBuffer& workspace, int64_t bytes) {
  CGX_RETURN_IF_ERROR(ffi_support::CheckDType(target, "workspace", workspace.element_type(), xla::ffi::DataType::U8));
  CGX_RETURN_IF_ERROR(ffi_support::CheckShape(target, "workspace", workspace.dimensions(), {-1}, "rank 1 [bytes]"));
  if (workspace.dimensions()[0] < bytes) {
    return ffi_support::InvalidArgument(target, "workspace has " + std::to_string(workspace.dimensions()[0]) +
                                                    " bytes, needs " + std::to_string(bytes));
  }
  return xla::ffi::Error::Success();
}

// NCCL loaded and the communicator of (comm_key, ordinal) registered with
// `world` ranks: *api and *comm, or why not (what the user does about it).
inline xla::ffi::Error FindCall(std::string_view target, int64_t comm_key, int32_t ordinal, int64_t world,
                                const NcclApi** api, std::shared_ptr<Communicator>* comm) {
  *api = Nccl();
  if (*api == nullptr) {
    return ffi_support::Internal(target, "NCCL is not loaded in this process; call jax_cgx.nccl.setup(mesh) first");
  }
  *comm = FindCommunicator(comm_key, ordinal);
  if (*comm == nullptr) {
    return ffi_support::Internal(
        target, "device " + std::to_string(ordinal) + " has no jax_cgx NCCL communicator for this collective (key " +
                    std::to_string(comm_key) + "): call jax_cgx.nccl.setup(mesh) on every process with the mesh " +
                    "this program runs on, before running it");
  }
  if ((*comm)->world != world) {
    return ffi_support::Internal(target, "communicator '" + (*comm)->description + "' has " +
                                             std::to_string((*comm)->world) + " ranks but the collective has " +
                                             std::to_string(world));
  }
  return xla::ffi::Error::Success();
}

// With comm.mu held: refuse a communicator an earlier call left out of step,
// or one NCCL reports failed.
inline xla::ffi::Error CheckUsable(std::string_view target, const NcclApi& api, const Communicator& comm) {
  if (comm.broken) {
    return ffi_support::Internal(
        target, "communicator '" + comm.description + "' is unusable: an earlier call failed midway (its ranks " +
                    "may be out of step) or it was torn down; call jax_cgx.nccl.teardown(abort=True) and " +
                    "jax_cgx.nccl.setup(mesh) again on every process");
  }
  ncclResult_t async_error = ncclSuccess;
  const ncclResult_t rc = api.CommGetAsyncError(comm.comm, &async_error);
  if (rc != ncclSuccess) {
    return ffi_support::Internal(target, "ncclCommGetAsyncError failed: " + NcclErrorText(rc, comm.comm));
  }
  if (async_error != ncclSuccess) {
    return ffi_support::Internal(target, "communicator '" + comm.description + "' failed earlier: " +
                                             NcclErrorText(async_error, comm.comm));
  }
  return xla::ffi::Error::Success();
}

// Auto segmentation (pipeline_segments=0): one segment per chunk. On the GPU the
// kernels quantize 256 MiB in ~0.3 ms, so cutting a chunk to overlap quantizing with
// sending hides almost nothing, while every segment costs its own NCCL calls; where
// two processes share a GPU each call waits for the other's turn on it. Measured
// on an H100 (docs/gpu-results.md, 2026-11-27), 256 MiB 4-bit all-reduce over 2 ranks:
// 8 segments 73.9 ms, one 30.3 ms (the xla backend 26-31 ms); under MPS level.
// pipeline_segments > 0 still cuts as asked.
inline constexpr int64_t kAutoSegmentBytes = int64_t{16} << 20;
inline constexpr int kAutoMaxSegments = 1;

// The plan shape (exchange_plan.h) of a nccl call with these encoding slots per segment.
inline exchange::Shape ShapeOf(int64_t send_slots, int64_t recv_slots, int64_t gathered_slots) {
  // Alignment, auto segmentation, the slots, no headers.
  return exchange::Shape{256, kAutoSegmentBytes, kAutoMaxSegments, send_slots, recv_slots, gathered_slots, 0};
}

using exchange::Plan;
using exchange::Region;
using exchange::Segment;

// One call's buffers, the communicator it runs on and its custom call's name.
struct Call : exchange::Buffers {
  std::string_view target;
  Communicator& comm;
  const NcclApi& api;
  cudaStream_t main;  // XLA's stream
  cuda::FloatType type;
  const uint32_t* seeds;
  bool stochastic;
  const int32_t* valid;  // [1], device: x's first valid[0] values are real; nullptr: all are
  float out_scale = 1.0f;  // the decoded output times this (1/W for compressed_pmean)

  // One row of segment s (index_base: its offset in the chunk).
  cuda::RowLayout Layout(const Segment& s) const {
    cuda::RowLayout l = cuda::MakeRowLayout(1, s.length, plan.bucket, plan.bits);
    l.index_base = s.offset;
    return l;
  }
  // Which values of segment s of chunks j, j+1, ... (rows of a launch) set
  // their buckets' ranges: padding never widens a bucket.
  cuda::ValidCounts Valid(int64_t j, const Segment& s) const {
    cuda::ValidCounts v;
    if (valid == nullptr) return v;
    v.total_dev = valid;
    v.first = j * plan.chunk + s.offset;
    v.row_step = plan.chunk;
    return v;
  }
  int Peer(int64_t offset) const {
    return static_cast<int>(((comm.rank + offset) % plan.world + plan.world) % plan.world);
  }
  xla::ffi::Error Launched(cudaError_t err, const char* what) const { return nccl::Launched(target, err, what); }
};

// XLA stream: segment s of chunks [a, b) (one source: x or the staged tail)
// into send slots a..b-1, each with its seed row j.
inline xla::ffi::Error QuantizeChunks(const Call& c, const Segment& s, int64_t a, int64_t b) {
  cuda::RowLayout l = c.Layout(s);
  l.rows = b - a;
  return c.Launched(cuda::LaunchQuantize(c.main, l, c.type, c.ChunkIn(a) + c.Bytes(s.offset), c.plan.chunk,
                                         c.seeds + 2 * a, c.stochastic, c.Payload(s.send, s, a),
                                         c.Meta(s.send, s, a), c.Valid(a, s)),
                    "quantize");
}

// Inside an open NCCL group on the side stream: send the encoding in slot
// `send_slot` of s.send to rank `to` and receive one into slot `recv_slot` of
// s.recv from rank `from` (payload and metadata, as bytes).
inline xla::ffi::Error SendRecv(const Call& c, const Segment& s, int64_t send_slot, int to, int64_t recv_slot,
                                int from) {
  return SendRecvEncoding(c.target, c.api, c.comm, c.Payload(s.send, s, send_slot), c.Meta(s.send, s, send_slot),
                          c.Payload(s.recv, s, recv_slot), c.Meta(s.recv, s, recv_slot), s.payload_bytes,
                          s.meta_bytes(), to, from);
}

// The Send step of exchange::RunSegments for a point-to-point exchange:
// XLA's stream quantizes segment s of every peer's chunk (our own is never
// sent: it enters the sum exactly), then the side stream sends slot j to rank
// j and receives slot j from it, for every peer j, as one NCCL group.
inline xla::ffi::Error SendToPeers(const Call& c, int i, const Segment& s) {
  Communicator& comm = c.comm;
  const int me = comm.rank;
  for (const auto& [a, b] : exchange::PeersOf(c.plan, me)) CGX_RETURN_IF_ERROR(QuantizeChunks(c, s, a, b));
  CGX_CUDA(c.target, cudaEventRecord(comm.quantized[i], c.main));
  CGX_CUDA(c.target, cudaStreamWaitEvent(comm.stream, comm.quantized[i], 0));
  NcclGroup group(c.api);
  CGX_NCCL(c.target, group.Start(), comm.comm);
  for (int j = 0; j < c.plan.world; ++j) {
    if (j != me) CGX_RETURN_IF_ERROR(SendRecv(c, s, j, j, j, j));
  }
  CGX_NCCL(c.target, group.End(), comm.comm);
  CGX_CUDA(c.target, cudaEventRecord(comm.exchanged[i], comm.stream));
  return xla::ffi::Error::Success();
}

// Side stream: after `ready` (XLA stream), all-gather every rank's encoding of
// segment s (slot j of s.gathered from rank j), then record `done`.
inline xla::ffi::Error Gather(const Call& c, const Segment& s, cudaEvent_t ready, cudaEvent_t done) {
  const Region& g = s.gathered;
  CGX_CUDA(c.target, cudaStreamWaitEvent(c.comm.stream, ready, 0));
  CGX_RETURN_IF_ERROR(AllGatherEncodings(c.target, c.api, c.comm, c.Payload(g, s, 0), c.Meta(g, s, 0),
                                         s.payload_bytes, s.meta_bytes()));
  CGX_CUDA(c.target, cudaEventRecord(done, c.comm.stream));
  return xla::ffi::Error::Success();
}

// XLA stream: after `gathered`, decode the W gathered encodings of segment s
// into the output (chunk j into ChunkOut(j)).
inline xla::ffi::Error DecodeGathered(const Call& c, const Segment& s, cudaEvent_t gathered) {
  CGX_CUDA(c.target, cudaStreamWaitEvent(c.main, gathered, 0));
  const Plan& p = c.plan;
  // A whole-chunk segment decodes into consecutive rows: one launch per
  // destination (the output, the staged tail); otherwise one per chunk.
  const bool whole = s.length == p.chunk;
  for (int64_t a = 0; a < p.world;) {
    const int64_t b = !whole ? a + 1 : (a < p.full_chunks ? p.full_chunks : p.world);
    cuda::RowLayout l = c.Layout(s);
    l.rows = b - a;
    CGX_RETURN_IF_ERROR(c.Launched(cuda::LaunchDequantize(c.main, l, c.Payload(s.gathered, s, a),
                                                          c.Meta(s.gathered, s, a), c.type,
                                                          c.ChunkOut(a) + c.Bytes(s.offset), c.out_scale),
                                   "dequantize"));
    a = b;
  }
  return xla::ffi::Error::Success();
}

// After a schedule failed midway: work may be queued on the side stream, so XLA
// must not reuse the call's buffers before it is done (XLA's stream waits for
// it), and the ranks are now out of step (the communicator is marked broken).
inline xla::ffi::Error Failed(Communicator& comm, cudaStream_t xla_stream, xla::ffi::Error error) {
  comm.broken = true;
  if (cudaEventRecord(comm.joined, comm.stream) == cudaSuccess) cudaStreamWaitEvent(xla_stream, comm.joined, 0);
  return error;
}

}  // namespace jax_cgx::nccl

#endif  // JAX_CGX_XLA_FFI_NCCL_CALL_H_
