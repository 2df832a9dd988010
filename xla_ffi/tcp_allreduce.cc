// jax_cgx_tcp_allreduce: the compressed all-reduce (SRA) of one row as one
// CPU custom call over jax_cgx's own TCP connections (xla_ffi/tcp_comms.h).
//
// It computes what the xla backend's lowering of the same primitive computes
// (jax_cgx/_src/exchange/sra.py), with the same CPU kernels on the same
// values, so results are bitwise equal; only the transport and the schedule
// differ. Each chunk is cut into segments of whole buckets; the handler's
// thread runs the codec on one segment while the communicator's I/O thread
// moves the previous ones:
//
//   handler:   Q0 Q1 Q2 ... | R0 R1 R2 ... | U0 U1 U2 ...   Q quantize, R fused
//   I/O:          X0 X1 X2 ...  G0 G1 G2 ...                 dequantize-sum-
//                                                           requantize, U decode;
//                                                           X exchange, G gather
//
// A segment starting at value o of its chunk is encoded with index_base o,
// so stochastic rounding draws what the whole chunk's encoding would.
// The handler only checks its arguments and hands the call to the
// communicator's call thread (asynchronous FFI: it returns a future), so XLA
// goes on with independent work, e.g. the rest of a backward pass, while the
// exchange runs. Allocation per call: the future's small shared state only;
// the call records and the workspace are the communicator's, made once.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/exchange_plan.h"
#include "xla_ffi/cpu_kernels.h"
#include "xla_ffi/ffi_support.h"
#include "xla_ffi/tcp_allreduce.h"
#include "xla_ffi/tcp_comms.h"

namespace ffi = xla::ffi;

namespace jax_cgx::tcp {

using exchange::Plan;
using exchange::Region;
using exchange::Segment;

std::string MakeAllreducePlan(int64_t n, int64_t world, int64_t chunk, int bits, int64_t bucket_size,
                              int64_t elem_bytes, int64_t segments, Plan* plan) {
  // Alignment, auto segmentation, W slots of send, recv and gathered, a Header per rank.
  const exchange::Shape shape{64, kAutoSegmentBytes, exchange::kMaxSegments, world, world, world, sizeof(Header)};
  return exchange::MakePlan(n, world, chunk, bits, bucket_size, elem_bytes, segments, shape, plan);
}

namespace {

constexpr std::string_view kTarget = "jax_cgx_tcp_allreduce";
constexpr std::string_view kStartTarget = "jax_cgx_tcp_allreduce_start";
constexpr std::string_view kDoneTarget = "jax_cgx_tcp_allreduce_done";

using ffi_support::CheckDType;
using ffi_support::CheckOutScale;
using ffi_support::CheckRow;
using ffi_support::CheckRowSeeds;
using ffi_support::CheckShape;
using ffi_support::Internal;
using ffi_support::InvalidArgument;

// One call's buffers and the communicator it runs on.
struct Call : exchange::Buffers {
  Communicator& comm;
  FloatType type;
  const uint32_t* seeds;  // [W + 1, 2]
  bool stochastic;
  int64_t valid;  // x's first `valid` values are real, the rest padding
  float out_scale;  // the decoded output times this (1/W for compressed_pmean)

  // How many values of segment s of chunk j set their buckets' ranges.
  int32_t Valid(int64_t j, const Segment& s) const {
    return static_cast<int32_t>(std::clamp<int64_t>(valid - (j * plan.chunk + s.offset), 0, s.length));
  }
};

ffi::Error Transport(const std::string& error) {
  if (error.empty()) return ffi::Error::Success();
  return Internal(kTarget, error);
}

// Posts the exchange of one slot with `peer`: our slot `peer` of `send` goes
// out, its encoding for us lands in slot `peer` of `recv` (payload, then metadata).
ffi::Error Exchange(const Call& c, const Segment& s, const Region& send, int64_t send_slot, const Region& recv,
                    int peer) {
  Communicator& comm = c.comm;
  CGX_RETURN_IF_ERROR(Transport(comm.PostSend(peer, c.Payload(send, s, send_slot), s.payload_bytes)));
  CGX_RETURN_IF_ERROR(Transport(comm.PostSend(peer, c.Meta(send, s, send_slot), s.meta_bytes())));
  CGX_RETURN_IF_ERROR(Transport(comm.PostRecv(peer, c.Payload(recv, s, peer), s.payload_bytes)));
  return Transport(comm.PostRecv(peer, c.Meta(recv, s, peer), s.meta_bytes()));
}

// Segment s of chunks [a, b) (none of them past the staged tail boundary) into send slots a..b-1.
void QuantizeChunks(const Call& c, const Segment& s, int64_t a, int64_t b) {
  const Plan& p = c.plan;
  for (int64_t j = a; j < b; ++j) c.comm.counts[static_cast<size_t>(j)] = c.Valid(j, s);
  // Rows are windows of stride `chunk` (the kernels' n) into x or the staged tail.
  cpu::quantize(c.ChunkIn(a) + c.Bytes(s.offset), c.type, b - a, p.chunk, s.length, c.seeds + 2 * a,
                c.comm.counts.data() + a, p.bits, p.bucket, c.stochastic, c.Payload(s.send, s, a),
                c.Meta(s.send, s, a), s.offset);
}
constexpr uint32_t kHeaderMagic = 0x63677831;  // "cgx1"

Header HeaderOf(const Plan& p, int64_t site) {
  Header h;
  h.magic = kHeaderMagic;
  h.site = site;
  h.bits = static_cast<uint32_t>(p.bits);
  h.n = p.n;
  h.chunk = p.chunk;
  h.bucket = p.bucket;
  h.elem_bytes = p.elem_bytes;
  h.segments = p.segments;
  return h;
}

std::string Describe(const Header& h) {
  return "call " + std::to_string(h.site) + " of the program: n=" + std::to_string(h.n) + ", chunk=" + std::to_string(h.chunk) + ", bits=" + std::to_string(h.bits) +
         ", bucket_size=" + std::to_string(h.bucket) + ", " + std::to_string(h.elem_bytes) + "-byte values, " +
         std::to_string(h.segments) + " segments";
}

// Receives (already posted) are the header, then 2 per segment of the
// exchange, then 2 per segment of the all-gather.
int64_t ExchangedBy(int segment) { return 1 + 2 * (segment + 1); }
int64_t GatheredBy(const Plan& p, int segment) { return 1 + 2 * p.segments + 2 * (segment + 1); }

ffi::Error CheckHeader(const Call& c, int peer) {
  const Header* headers = reinterpret_cast<const Header*>(c.ws + c.plan.headers);
  const Header& mine = headers[c.comm.rank];
  const Header& theirs = headers[peer];
  if (std::memcmp(&mine, &theirs, sizeof(Header)) == 0) return ffi::Error::Success();
  return Internal(kTarget, "rank " + std::to_string(peer) + " of '" + c.comm.description + "' runs a different " +
                           "reduction (" + (theirs.magic == kHeaderMagic ? Describe(theirs) : "not a jax_cgx call") +
                           ") than this rank (" + Describe(mine) + "): the ranks' programs differ, or run their " +
                           "compressed reductions in different orders");
}

// The steps of exchange::RunSegments on the handler's thread; the I/O thread
// moves what they post.
struct SraSteps {
  const Call& c;

  // Quantize segment s of every peer's chunk and post its exchange; the I/O
  // thread sends it while segment s+1 is quantized.
  ffi::Error Send(int, const Segment& s) const {
    const int me = c.comm.rank;
    for (const auto& [a, b] : exchange::PeersOf(c.plan, me)) QuantizeChunks(c, s, a, b);
    for (int j = 0; j < c.plan.world; ++j) {
      if (j != me) CGX_RETURN_IF_ERROR(Exchange(c, s, s.send, j, s.recv, j));
    }
    return ffi::Error::Success();
  }

  // As segment i arrives: sum it with our own chunk in full precision (our
  // own slot decodes to +0), re-quantize, and post its all-gather. The fused
  // kernel's decoded output is our chunk of the result (of a sum; a mean's is
  // decoded again, scaled, once the all-gather is posted).
  ffi::Error Reduce(int i, const Segment& s) const {
    const Plan& p = c.plan;
    Communicator& comm = c.comm;
    const int me = comm.rank;
    for (int j = 0; j < p.world; ++j) {
      if (j == me) continue;
      if (i == 0) {  // the header first: a peer running another reduction sends other sizes
        CGX_RETURN_IF_ERROR(Transport(comm.WaitRecvs(j, 1)));
        CGX_RETURN_IF_ERROR(CheckHeader(c, j));
      }
      CGX_RETURN_IF_ERROR(Transport(comm.WaitRecvs(j, ExchangedBy(i))));
    }
    std::memset(c.Meta(s.recv, s, me), 0, s.meta_bytes());
    const int32_t own_valid = c.Valid(me, s);
    cpu::dequantize_sum_requantize(c.Payload(s.recv, s, 0), c.Meta(s.recv, s, 0), 1, p.world, s.length, p.bits,
                                   p.bucket, c.ChunkIn(me) + c.Bytes(s.offset), c.type, c.seeds + 2 * p.world,
                                   &own_valid, c.stochastic, c.Payload(s.gathered, s, me),
                                   c.Meta(s.gathered, s, me), c.ChunkOut(me) + c.Bytes(s.offset), c.type,
                                   s.offset);
    for (int j = 0; j < p.world; ++j) {
      if (j != me) CGX_RETURN_IF_ERROR(Exchange(c, s, s.gathered, me, s.gathered, j));
    }
    if (c.out_scale != 1.0f) {
      // A mean: our chunk of the output is the scaled decode of the encoding we send, as every
      // peer decodes it (the fused kernel's output is the unscaled sum). After the sends are
      // posted, off the peers' path; the sends only read slot `me`, and receives never write it.
      cpu::dequantize(c.Payload(s.gathered, s, me), c.Meta(s.gathered, s, me), 1, s.length, p.bits, p.bucket,
                      c.ChunkOut(me) + c.Bytes(s.offset), c.type, c.out_scale);
    }
    return ffi::Error::Success();
  }

  // Decode every peer's reduced chunk of segment i as it arrives.
  ffi::Error Decode(int i, const Segment& s) const {
    const Plan& p = c.plan;
    for (int j = 0; j < p.world; ++j) {
      if (j == c.comm.rank) continue;
      CGX_RETURN_IF_ERROR(Transport(c.comm.WaitRecvs(j, GatheredBy(p, i))));
      cpu::dequantize(c.Payload(s.gathered, s, j), c.Meta(s.gathered, s, j), 1, s.length, p.bits, p.bucket,
                      c.ChunkOut(j) + c.Bytes(s.offset), c.type, c.out_scale);
    }
    return ffi::Error::Success();
  }
};

ffi::Error RunSra(const Call& c, int64_t site) {
  const Plan& p = c.plan;
  Communicator& comm = c.comm;
  const int me = comm.rank;
  // Every stream starts with the call's header.
  Header* headers = reinterpret_cast<Header*>(c.ws + p.headers);
  headers[me] = HeaderOf(p, site);
  for (int j = 0; j < p.world; ++j) {
    if (j == me) continue;
    CGX_RETURN_IF_ERROR(Transport(comm.PostSend(j, &headers[me], sizeof(Header))));
    CGX_RETURN_IF_ERROR(Transport(comm.PostRecv(j, &headers[j], sizeof(Header))));
  }
  SraSteps steps{c};
  CGX_RETURN_IF_ERROR(exchange::RunSegments(p, steps));
  // Our sends read the workspace, which the next call overwrites.
  return Transport(comm.WaitSends());
}

// One call, from its start to its done custom call. XLA keeps x, out and
// seeds alive and untouched until the done call's future completes (they are
// the done call's operands too). The record is reused once both the call
// thread and the done handler are through with it.
class PendingCall final : public Task {
 public:
  explicit PendingCall(Communicator* comm) : comm_(comm) {}
  Plan plan;
  FloatType type = FloatType::kF32;
  const char* x = nullptr;
  char* out = nullptr;
  const uint32_t* seeds = nullptr;
  bool stochastic = false;
  int64_t valid = 0;
  float out_scale = 1.0f;
  int64_t site = 0;
  std::atomic<bool> busy{false};

  // Filled in by the start handler; the call thread runs it next.
  void Started() {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = waited_ = false;
    result_ = ffi::Error::Success();
  }

  void Run() override {
    ffi::Error result = Execute();
    {
      std::lock_guard<std::mutex> lock(mu_);
      finished_ = true;
      result_ = std::move(result);
      if (!waited_) return;  // the done handler takes the result when it comes
    }
    comm_->SubmitFinish(this);
  }

  // On the finishing thread, when the done handler was waiting.
  void Finish() override {
    ffi::Promise promise = std::move(promise_);
    ffi::Error result = std::move(result_);
    busy.store(false, std::memory_order_release);
    Complete(promise, std::move(result));
  }

  // The done handler: a future that completes when the call has.
  ffi::Future Done() {
    ffi::Promise promise;
    ffi::Future future(promise);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!finished_) {
        waited_ = true;
        promise_ = std::move(promise);
        return future;
      }
    }
    ffi::Error result = std::move(result_);
    busy.store(false, std::memory_order_release);
    Complete(promise, std::move(result));
    return future;
  }

 private:
  static void Complete(ffi::Promise& promise, ffi::Error result) {
    if (result.failure()) {
      promise.SetError(std::move(result));
    } else {
      promise.SetAvailable();
    }
  }
  ffi::Error Execute();
  // Not owned: the record lives in the communicator's slots, and the
  // communicator's destructor runs every queued call before its members go.
  Communicator* comm_;
  std::mutex mu_;
  bool finished_ = false;  // the call thread is through
  bool waited_ = false;    // the done handler is waiting (promise_ is set)
  ffi::Error result_;
  ffi::Promise promise_;
};

ffi::Error PendingCall::Execute() {
  Communicator& comm = *comm_;
  if (comm.broken) {
    return Internal(kTarget, "communicator '" + comm.description + "' is unusable: an earlier call failed " +
                             "midway (its ranks may be out of step) or it was torn down; call " +
                             "jax_cgx.tcp.teardown() and jax_cgx.tcp.setup(mesh) again on every process");
  }
  if (static_cast<int64_t>(comm.workspace.size()) < plan.workspace_bytes) {
    comm.workspace.resize(static_cast<size_t>(plan.workspace_bytes));  // grows once per larger row
  }
  comm.Reset();
  const Call call{{plan, x, out, comm.workspace.data()}, comm, type, seeds, stochastic, valid, out_scale};
  // Zero padding: chunks past x's end are read from a staged copy of x's tail.
  const int64_t rem = plan.rem();
  if (plan.tail_chunks > 0) {
    std::memset(call.ws + plan.x_tail, 0, call.Bytes(plan.tail_chunks * plan.chunk));
    if (rem > 0) std::memcpy(call.ws + plan.x_tail, x + call.Bytes(plan.full_chunks * plan.chunk), call.Bytes(rem));
  }
  ffi::Error result = RunSra(call, site);
  if (result.failure()) {
    // The ranks are out of step: no later call may use these connections.
    comm.broken = true;
    comm.Abort("an earlier call failed");
    return result;
  }
  if (plan.tail_chunks > 0 && rem > 0) {
    std::memcpy(out + call.Bytes(plan.full_chunks * plan.chunk), call.ws + plan.out_tail, call.Bytes(rem));
  }
  return ffi::Error::Success();
}

// Checks the buffers and attributes, finds the communicator and a free call
// record, and fills it in.
ffi::Error Prepare(int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer seeds, ffi::AnyBuffer valid,
                   ffi::Result<ffi::AnyBuffer> out, int64_t comm_key, int64_t site, int64_t world, int64_t chunk,
                   int32_t bits, int64_t bucket_size, bool stochastic, int64_t segments, float scale,
                   std::shared_ptr<Communicator>* found, PendingCall** record, int64_t* ticket) {
  CGX_RETURN_IF_ERROR(CheckOutScale(kStartTarget, scale));
  FloatType type = FloatType::kF32;
  int64_t n = 0;
  CGX_RETURN_IF_ERROR(CheckRow(kStartTarget, x, *out, &type, &n));
  Plan plan;
  const std::string bad =
      MakeAllreducePlan(n, world, chunk, bits, bucket_size, FloatTypeBytes(type), segments, &plan);
  if (!bad.empty()) return InvalidArgument(kStartTarget, bad);
  CGX_RETURN_IF_ERROR(CheckRowSeeds(kStartTarget, seeds, valid, world));
  std::shared_ptr<Communicator> comm = FindCommunicator(comm_key, ordinal);
  if (comm == nullptr) {
    return Internal(kStartTarget, "device " + std::to_string(ordinal) + " has no jax_cgx tcp communicator for this " +
                             "reduction (key " + std::to_string(comm_key) + "): call jax_cgx.tcp.setup(mesh) on " +
                             "every process with the mesh this program runs on, before running it");
  }
  if (comm->world != world) {
    return Internal(kStartTarget, "communicator '" + comm->description + "' has " + std::to_string(comm->world) +
                             " ranks but the reduction has " + std::to_string(world));
  }
  PendingCall* call = nullptr;
  {
    std::lock_guard<std::mutex> lock(comm->slots_mu);
    for (size_t i = 0; i < comm->slots.size(); ++i) {
      auto* c = static_cast<PendingCall*>(comm->slots[i].get());
      if (!c->busy.load(std::memory_order_acquire)) {
        call = c;
        *ticket = static_cast<int64_t>(i);
        break;
      }
    }
    if (call == nullptr) {  // more calls pending than ever before: one more record, kept
      comm->slots.push_back(std::make_unique<PendingCall>(comm.get()));
      call = static_cast<PendingCall*>(comm->slots.back().get());
      *ticket = static_cast<int64_t>(comm->slots.size() - 1);
    }
    call->busy.store(true, std::memory_order_relaxed);
  }
  call->plan = plan;
  call->type = type;
  call->x = static_cast<const char*>(x.untyped_data());
  call->out = static_cast<char*>(out->untyped_data());
  call->seeds = static_cast<const uint32_t*>(seeds.untyped_data());
  call->stochastic = stochastic;
  call->valid = std::clamp<int64_t>(*static_cast<const int32_t*>(valid.untyped_data()), 0, n);
  call->out_scale = scale;
  call->site = site;
  *found = std::move(comm);
  *record = call;
  return ffi::Error::Success();
}

// jax_cgx_tcp_allreduce_start: checks its arguments, hands the call to the
// communicator's call thread and returns at once, writing the call's ticket.
// The call thread fills `out` later; only the done call makes it visible.
ffi::Error TcpStartImpl(int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer seeds, ffi::AnyBuffer valid,
                        ffi::AnyBuffer /*after*/, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> ticket,
                        int64_t comm_key, int64_t site, int64_t world, int64_t chunk, int32_t bits,
                        int64_t bucket_size, bool stochastic, int64_t segments, float scale) {
  CGX_RETURN_IF_ERROR(CheckDType(kStartTarget, "ticket", ticket->element_type(), ffi::DataType::S32));
  CGX_RETURN_IF_ERROR(CheckShape(kStartTarget, "ticket", ticket->dimensions(), {1}, "[1]"));
  std::shared_ptr<Communicator> comm;
  PendingCall* call = nullptr;
  int64_t slot = 0;
  CGX_RETURN_IF_ERROR(Prepare(ordinal, x, seeds, valid, out, comm_key, site, world, chunk, bits, bucket_size,
                              stochastic, segments, scale, &comm, &call, &slot));
  call->Started();
  comm->Submit(call);
  *static_cast<int32_t*>(ticket->untyped_data()) = static_cast<int32_t>(slot);
  return ffi::Error::Success();
}

// jax_cgx_tcp_allreduce_done: asynchronous (an FFI future), completes when
// the started call has; its result aliases the start call's `out`. XLA runs
// independent work, e.g. the rest of a backward pass, until something uses it.
ffi::Future TcpDoneImpl(int32_t ordinal, ffi::AnyBuffer /*started*/, ffi::AnyBuffer /*x*/, ffi::AnyBuffer /*seeds*/,
                        ffi::AnyBuffer ticket, ffi::Result<ffi::AnyBuffer> /*out*/, int64_t comm_key) {
  const std::shared_ptr<Communicator> comm = FindCommunicator(comm_key, ordinal);
  const int64_t slot = ticket.element_type() == ffi::DataType::S32 && ticket.element_count() == 1
                           ? *static_cast<const int32_t*>(ticket.untyped_data())
                           : -1;
  PendingCall* call = nullptr;
  if (comm != nullptr) {
    std::lock_guard<std::mutex> lock(comm->slots_mu);
    if (slot >= 0 && slot < static_cast<int64_t>(comm->slots.size())) {
      call = static_cast<PendingCall*>(comm->slots[static_cast<size_t>(slot)].get());
    }
  }
  if (call == nullptr || !call->busy.load(std::memory_order_acquire)) {
    ffi::Promise promise;
    ffi::Future future(promise);
    promise.SetError(Internal(kDoneTarget, "no started call for ticket " + std::to_string(slot) + " on device " +
                                               std::to_string(ordinal) + " (key " + std::to_string(comm_key) +
                                               "): the communicator was torn down, or the ticket is not a start "
                                               "call's"));
    return future;
  }
  return call->Done();
}

}  // namespace
}  // namespace jax_cgx::tcp

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuTcpAllreduceStart, jax_cgx::tcp::TcpStartImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // x[n]
                                  .Arg<ffi::AnyBuffer>()  // seeds[W + 1, 2]
                                  .Arg<ffi::AnyBuffer>()  // valid[1]
                                  .Arg<ffi::AnyBuffer>()  // after: the previous start's ticket (_src/tcp/backend.py)
                                  .Ret<ffi::AnyBuffer>()  // out[n], filled by the call thread
                                  .Ret<ffi::AnyBuffer>()  // ticket s32[1]
                                  .Attr<int64_t>("comm_key")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("world")
                                  .Attr<int64_t>("chunk")
                                  .Attr<int32_t>("bits")
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<bool>("stochastic")
                                  .Attr<int64_t>("segments")
                                  .Attr<float>("scale"));  // 1, or 1/W for a mean

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuTcpAllreduceDone, jax_cgx::tcp::TcpDoneImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // out[n] of the start call (aliased to the result)
                                  .Arg<ffi::AnyBuffer>()  // x[n]: kept alive until the call is done
                                  .Arg<ffi::AnyBuffer>()  // seeds[W + 1, 2]: likewise
                                  .Arg<ffi::AnyBuffer>()  // ticket s32[1]
                                  .Ret<ffi::AnyBuffer>()  // out[n]
                                  .Attr<int64_t>("comm_key"));
