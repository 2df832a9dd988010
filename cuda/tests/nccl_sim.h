// The simulated runtime of cuda/tests/nccl_sim.cc: W ranks' XLA and side streams
// as op queues with CUDA event semantics, scalar stubs of the codec launchers that
// honour RowLayout (index_base included), NCCL group/send/recv/all-gather through
// FIFO mailboxes, bounds-checked device allocations, and the scheduler that runs
// the queues in random interleavings. Definitions, not declarations: included
// once, by nccl_sim.cc, after the handlers it stands under.
#ifndef JAX_CGX_CUDA_TESTS_NCCL_SIM_H_
#define JAX_CGX_CUDA_TESTS_NCCL_SIM_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cassert>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "xla_ffi/codec_math.h"
#include "xla_ffi/cuda_kernels.h"
#include "xla_ffi/nccl_api.h"
#include "xla_ffi/nccl_comms.h"

using namespace jax_cgx;
using cuda::FloatType;
using cuda::RowLayout;

static std::mt19937 g_rng(1234);
static long g_fail = 0;
#define EXPECT(c, ...)                                  \
  do {                                                  \
    if (!(c)) {                                         \
      ++g_fail;                                         \
      if (g_fail < 40) {                                \
        fprintf(stderr, "FAIL %d: ", __LINE__);         \
        fprintf(stderr, __VA_ARGS__);                   \
        fprintf(stderr, "\n");                          \
      }                                                 \
    }                                                   \
  } while (0)

// ------------------------------------------------------------ codec stubs
static float to_f32(FloatType t, const void* p, int64_t i) {
  switch (t) {
    case FloatType::kF32: return static_cast<const float*>(p)[i];
    case FloatType::kBF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}
static void from_f32(FloatType t, void* p, int64_t i, float v) {
  switch (t) {
    case FloatType::kF32: static_cast<float*>(p)[i] = v; return;
    case FloatType::kBF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); return;
    default: static_cast<uint16_t*>(p)[i] = f32_to_f16(v); return;
  }
}
static void put_bits(uint8_t* s, int64_t pos, uint32_t level, int bits) {
  for (int b = 0; b < bits; ++b)
    if ((level >> b) & 1u) s[(pos + b) / 8] |= uint8_t(1u << ((pos + b) % 8));
}
static uint32_t get_bits(const uint8_t* s, int64_t pos, int bits) {
  uint32_t v = 0;
  for (int b = 0; b < bits; ++b) v |= ((s[(pos + b) / 8] >> ((pos + b) % 8)) & 1u) << b;
  return v;
}
static int64_t blen(const RowLayout& l, int64_t k) { return k == l.buckets - 1 ? l.elems - k * l.bucket : l.bucket; }

// Row r's elements that set its buckets' ranges (cuda::ValidCounts).
static int64_t valid_count(const cuda::ValidCounts& v, int64_t r) {
  if (v.rows) return v.rows[r];
  return (v.total_dev ? *v.total_dev : v.total) - (v.first + r * v.row_step);
}

// vals: rows of l.elems f32 values (contiguous, stride given)
static void quantize_f32(const RowLayout& l, const std::function<float(int64_t, int64_t)>& val,
                         const uint32_t* seeds, bool stoch, uint8_t* payload, float* meta,
                         const cuda::ValidCounts& valid) {
  for (int64_t r = 0; r < l.rows; ++r) {
    const int64_t count = valid_count(valid, r);
    for (int64_t k = 0; k < l.buckets; ++k) {
      const int64_t len = blen(l, k);
      BucketRange range;
      for (int64_t j = 0; j < len && k * l.bucket + j < count; ++j) range_add(range, val(r, k * l.bucket + j));
      const BucketMeta m = make_meta(range, l.bits);
      meta[(r * l.buckets + k) * 2] = m.min;
      meta[(r * l.buckets + k) * 2 + 1] = m.scale;
      uint8_t* s = payload + r * l.row_bytes + k * l.bucket_bytes;
      std::memset(s, 0, packed_bytes(len, l.bits));
      for (int64_t j = 0; j < len; ++j) {
        const uint32_t random23 =
            stoch ? random_bits(seeds[2 * r], seeds[2 * r + 1], uint32_t(l.index_base + k * l.bucket + j)) : 0u;
        put_bits(s, j * l.bits, encode_level(val(r, k * l.bucket + j), m, l.bits, stoch, random23), l.bits);
      }
    }
  }
}
static float decoded(const RowLayout& l, const uint8_t* payload_row, const float* meta_row, int64_t i) {
  const int64_t k = i / l.bucket, j = i % l.bucket;
  const uint32_t lev = get_bits(payload_row + k * l.bucket_bytes, j * l.bits, l.bits);
  return decode_level(lev, meta_row[2 * k], meta_row[2 * k + 1], l.bits);
}

// ----------------------------------------------------- device memory registry
struct Alloc { uint8_t* p; size_t n; const char* name; };
static std::vector<Alloc> g_allocs;
static void check_range(const void* p, size_t n, const char* what) {
  const uint8_t* a = static_cast<const uint8_t*>(p);
  for (auto& al : g_allocs)
    if (a >= al.p && a < al.p + al.n) {
      EXPECT(a + n <= al.p + al.n, "%s: [%ld, +%zu) past end of %s (%zu bytes)", what, long(a - al.p), n, al.name, al.n);
      return;
    }
  if (n) EXPECT(false, "%s: pointer not in any allocation", what);
}

// ------------------------------------------------------------ stream model
struct Event { int64_t issued = 0, done = 0; };
struct Op {
  std::function<void()> run;       // kernels, memcpys
  Event* rec = nullptr; int64_t rec_gen = 0;
  Event* wait = nullptr; int64_t wait_gen = 0;
  struct Nccl* group = nullptr;
  std::function<void()> check;     // sentinel
};
struct Stream { std::deque<Op> q; bool inflight = false; int rank; const char* name; int64_t pushed = 0, popped = 0; void push(const Op& o) { q.push_back(o); ++pushed; } void pop() { q.pop_front(); ++popped; } };
static std::map<cudaStream_t, Stream*> g_streams;
static Stream* S(cudaStream_t s) { auto it = g_streams.find(s); assert(it != g_streams.end()); return it->second; }

extern "C" {
cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t s) {
  check_range(p, n, "memset");
  Op op; op.run = [=] { std::memset(p, v, n); }; S(s)->push(op); return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* d, const void* src, size_t n, enum cudaMemcpyKind, cudaStream_t s) {
  check_range(d, n, "memcpy dst"); check_range(src, n, "memcpy src");
  Op op; op.run = [=] { std::memcpy(d, src, n); }; S(s)->push(op); return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  Event* ev = reinterpret_cast<Event*>(e);
  Op op; op.rec = ev; op.rec_gen = ++ev->issued; S(s)->push(op); return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  Event* ev = reinterpret_cast<Event*>(e);
  Op op; op.wait = ev; op.wait_gen = ev->issued; S(s)->push(op); return cudaSuccess;
}
const char* cudaGetErrorString(cudaError_t) { return "sim error"; }
}

// kernels
namespace jax_cgx::cuda {
cudaError_t LaunchQuantize(cudaStream_t s, const RowLayout& l0, FloatType t, const void* x, int64_t stride,
                           const uint32_t* seeds, bool st, uint8_t* payload, float* meta,
                           const ValidCounts& valid) {
  RowLayout l = l0;
  const int64_t eb = FloatTypeBytes(t);
  for (int64_t r = 0; r < l.rows; ++r) check_range(static_cast<const char*>(x) + r * stride * eb, l.elems * eb, "quantize x");
  check_range(payload, l.rows * l.row_bytes, "quantize payload");
  check_range(meta, l.rows * l.buckets * 8, "quantize meta");
  if (st) check_range(seeds, l.rows * 8, "quantize seeds");
  Op op;
  op.run = [=] {
    quantize_f32(l, [&](int64_t r, int64_t i) { return to_f32(t, x, r * stride + i); }, seeds, st, payload, meta,
                 valid);
  };
  S(s)->push(op);
  return cudaSuccess;
}
cudaError_t LaunchDequantize(cudaStream_t s, const RowLayout& l, const uint8_t* payload, const float* meta,
                             FloatType ot, void* out, float out_scale) {
  check_range(payload, l.rows * l.row_bytes, "dequantize payload");
  check_range(meta, l.rows * l.buckets * 8, "dequantize meta");
  check_range(out, l.rows * l.elems * FloatTypeBytes(ot), "dequantize out");
  Op op;
  op.run = [=] {
    for (int64_t r = 0; r < l.rows; ++r)
      for (int64_t i = 0; i < l.elems; ++i)
        if (out) {
          const float v = decoded(l, payload + r * l.row_bytes, meta + r * l.buckets * 2, i);
          from_f32(ot, out, r * l.elems + i, out_scale == 1.0f ? v : scale_output(v, out_scale));
        }
  };
  S(s)->push(op);
  return cudaSuccess;
}
cudaError_t LaunchDequantizeSum(cudaStream_t s, const RowLayout& l, int64_t W, const uint8_t* payload,
                                const float* meta, FloatType at, const void* addend, FloatType ot, void* out) {
  check_range(payload, l.rows * W * l.row_bytes, "ds payload");
  check_range(meta, l.rows * W * l.buckets * 8, "ds meta");
  if (addend) check_range(addend, l.rows * l.elems * FloatTypeBytes(at), "ds addend");
  check_range(out, l.rows * l.elems * FloatTypeBytes(ot), "ds out");
  Op op;
  op.run = [=] {
    for (int64_t r = 0; r < l.rows; ++r)
      for (int64_t i = 0; i < l.elems; ++i) {
        float a = 0;
        bool first = true;
        if (addend) { a = flush(to_f32(at, addend, r * l.elems + i)); first = false; }
        for (int64_t w = 0; w < W; ++w) {
          const float d = decoded(l, payload + (r * W + w) * l.row_bytes, meta + (r * W + w) * l.buckets * 2, i);
          a = first ? d : accumulate(a, d);
          first = false;
        }
        from_f32(ot, out, r * l.elems + i, a);
      }
  };
  S(s)->push(op);
  return cudaSuccess;
}
cudaError_t LaunchDequantizeSumRequantize(cudaStream_t s, const RowLayout& l, int64_t W, const uint8_t* payload,
                                          const float* meta, FloatType at, const void* addend,
                                          const uint32_t* seeds, bool st, uint8_t* op_, float* om,
                                          FloatType ot, void* out, const ValidCounts& valid) {
  check_range(payload, l.rows * W * l.row_bytes, "dsr payload");
  check_range(meta, l.rows * W * l.buckets * 8, "dsr meta");
  if (addend) check_range(addend, l.rows * l.elems * FloatTypeBytes(at), "dsr addend");
  check_range(op_, l.rows * l.row_bytes, "dsr out payload");
  check_range(om, l.rows * l.buckets * 8, "dsr out meta");
  if (out) check_range(out, l.rows * l.elems * FloatTypeBytes(ot), "dsr out");
  Op op;
  op.run = [=] {
    std::vector<float> acc(l.rows * l.elems);
    for (int64_t r = 0; r < l.rows; ++r)
      for (int64_t i = 0; i < l.elems; ++i) {
        float a = 0;
        bool first = true;
        if (addend) { a = flush(to_f32(at, addend, r * l.elems + i)); first = false; }
        for (int64_t w = 0; w < W; ++w) {
          const float d = decoded(l, payload + (r * W + w) * l.row_bytes, meta + (r * W + w) * l.buckets * 2, i);
          a = first ? d : accumulate(a, d);
          first = false;
        }
        acc[r * l.elems + i] = a;
      }
    quantize_f32(l, [&](int64_t r, int64_t i) { return acc[r * l.elems + i]; }, seeds, st, op_, om, valid);
    for (int64_t r = 0; r < l.rows; ++r)
      for (int64_t i = 0; i < l.elems; ++i)
        if (out) from_f32(ot, out, r * l.elems + i, decoded(l, op_ + r * l.row_bytes, om + r * l.buckets * 2, i));
  };
  S(s)->push(op);
  return cudaSuccess;
}
}  // namespace jax_cgx::cuda

// ------------------------------------------------------------ NCCL model
struct P2p { bool send; void* buf; size_t bytes; int peer; };
struct Nccl { std::vector<P2p> ops; int rank; std::vector<std::pair<int, size_t>> pending_recv; };
struct Rank;
struct SimComm { int rank, world; int depth = 0; Nccl* group = nullptr; cudaStream_t stream = nullptr; };
static std::map<std::pair<int, int>, std::deque<std::vector<uint8_t>>> g_mail;  // (src,dst)
static std::vector<SimComm> g_sc;
static SimComm* SC(ncclComm_t c) { return reinterpret_cast<SimComm*>(c); }

static thread_local SimComm* t_group_comm = nullptr;
static int t_depth = 0;
static std::vector<P2p> t_ops;
static SimComm* t_comm = nullptr;
static cudaStream_t t_stream = nullptr;

ncclResult_t sGroupStart() { ++t_depth; return ncclSuccess; }
ncclResult_t sGroupEnd() {
  if (--t_depth > 0) return ncclSuccess;
  if (!t_ops.empty()) {
    Nccl* g = new Nccl{t_ops, t_comm->rank, {}};
    Op op; op.group = g; S(t_stream)->push(op);
  }
  t_ops.clear(); t_comm = nullptr;
  return ncclSuccess;
}
static void add(ncclComm_t c, cudaStream_t s, P2p p) {
  if (t_depth == 0) { fprintf(stderr, "op outside group\n"); abort(); }
  if (t_comm && t_comm != SC(c)) abort();
  if (t_stream && t_comm && t_stream != s) abort();
  t_comm = SC(c); t_stream = s;
  EXPECT(s == SC(c)->stream, "nccl op on a stream other than the side stream");
  check_range(p.buf, p.bytes, p.send ? "nccl send" : "nccl recv");
  t_ops.push_back(p);
}
ncclResult_t sSend(const void* b, size_t n, ncclDataType_t dt, int peer, ncclComm_t c, cudaStream_t s) {
  EXPECT(dt == ncclUint8, "dtype"); EXPECT(peer != SC(c)->rank && peer >= 0 && peer < SC(c)->world, "send peer %d", peer);
  add(c, s, {true, const_cast<void*>(b), n, peer}); return ncclSuccess;
}
ncclResult_t sRecv(void* b, size_t n, ncclDataType_t dt, int peer, ncclComm_t c, cudaStream_t s) {
  EXPECT(dt == ncclUint8, "dtype"); EXPECT(peer != SC(c)->rank && peer >= 0 && peer < SC(c)->world, "recv peer %d", peer);
  add(c, s, {false, b, n, peer}); return ncclSuccess;
}
ncclResult_t sAllGather(const void* sb, void* rb, size_t n, ncclDataType_t dt, ncclComm_t c, cudaStream_t s) {
  SimComm* sc = SC(c);
  EXPECT(dt == ncclUint8, "dtype");
  EXPECT(static_cast<const uint8_t*>(sb) == static_cast<uint8_t*>(rb) + sc->rank * n, "allgather not in place");
  check_range(rb, n * sc->world, "allgather recvbuf");
  for (int j = 0; j < sc->world; ++j)
    if (j != sc->rank) add(c, s, {true, const_cast<void*>(sb), n, j});
  for (int j = 0; j < sc->world; ++j)
    if (j != sc->rank) add(c, s, {false, static_cast<uint8_t*>(rb) + j * n, n, j});
  return ncclSuccess;
}
ncclResult_t sAsync(ncclComm_t, ncclResult_t* r) { *r = ncclSuccess; return ncclSuccess; }
const char* sErr(ncclResult_t) { return "sim nccl"; }
const char* sLast(ncclComm_t) { return ""; }

static nccl::NcclApi g_api;
namespace jax_cgx::nccl {
const NcclApi* Nccl() { return &g_api; }
std::string NcclErrorText(ncclResult_t, ncclComm_t) { return "sim"; }
static std::vector<Communicator*> g_comm_by_ordinal;
std::shared_ptr<Communicator> FindCommunicator(int64_t, int ordinal) { return std::shared_ptr<Communicator>(g_comm_by_ordinal[ordinal], [](Communicator*) {}); }
}  // namespace jax_cgx::nccl

// ------------------------------------------------------------ scheduler
// Executes all queues in a random interleaving. NCCL groups: start = deposit
// sends (snapshot) + poison recv buffers; completion = all recvs matched.
struct Inflight { Nccl* g; std::vector<uint64_t> send_sums; std::vector<int64_t> idx; };
static std::map<std::pair<int,int>, int64_t> g_sent, g_posted;
static std::map<std::pair<int,int>, std::vector<std::vector<uint8_t>>> g_msgs;
static uint64_t sum(const void* p, size_t n) { uint64_t h = 1469598103934665603ull; for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const uint8_t*>(p)[i]) * 1099511628211ull; return h; }
static std::map<Stream*, Inflight> g_inflight;

static bool try_step(Stream* st) {
  if (st->q.empty()) return false;
  Op& op = st->q.front();
  if (op.wait) {
    if (op.wait->done < op.wait_gen) return false;
    st->pop(); return true;
  }
  if (op.rec) { op.rec->done = std::max(op.rec->done, op.rec_gen); st->pop(); return true; }
  if (op.check) { op.check(); st->pop(); return true; }
  if (op.run) { op.run(); st->pop(); return true; }
  if (op.group) {
    Nccl* g = op.group;
    if (!st->inflight) {  // start: post sends and recvs
      Inflight in{g, {}};
      for (auto& p : g->ops)
        if (p.send) {
          auto key = std::make_pair(g->rank, p.peer);
          in.idx.push_back(g_sent[key]++);
          g_msgs[key].emplace_back(static_cast<uint8_t*>(p.buf), static_cast<uint8_t*>(p.buf) + p.bytes);
          in.send_sums.push_back(sum(p.buf, p.bytes));
        } else {
          auto key = std::make_pair(p.peer, g->rank);
          in.idx.push_back(g_posted[key]++);
          std::memset(p.buf, 0xCD, p.bytes);  // in flight: garbage until received
        }
      g_inflight[st] = in;
      st->inflight = true;
      return true;
    }
    // completion (rendezvous): every send's receiver has posted, every recv's sender has posted
    Inflight& in = g_inflight[st];
    for (size_t o = 0; o < g->ops.size(); ++o) {
      const auto& p = g->ops[o];
      if (p.send) { if (g_posted[{g->rank, p.peer}] <= in.idx[o]) return false; }
      else if (g_sent[{p.peer, g->rank}] <= in.idx[o]) return false;
    }
    size_t si = 0;
    for (size_t o = 0; o < g->ops.size(); ++o) {
      const auto& p = g->ops[o];
      if (p.send) {
        EXPECT(sum(p.buf, p.bytes) == in.send_sums[si], "rank %d: send buffer modified while in flight", g->rank);
        ++si;
      } else {
        auto& m = g_msgs[{p.peer, g->rank}][in.idx[o]];
        EXPECT(m.size() == p.bytes, "rank %d recv from %d: %zu bytes sent, %zu expected", g->rank, p.peer, m.size(), p.bytes);
        std::memcpy(p.buf, m.data(), std::min(p.bytes, m.size()));
      }
    }
    g_inflight.erase(st);
    st->inflight = false;
    delete g;
    st->pop();
    return true;
  }
  abort();
}
static void run_all() {
  std::vector<Stream*> all;
  for (auto& [k, v] : g_streams) all.push_back(v);
  for (;;) {
    std::vector<Stream*> ready;
    bool any = false;
    for (auto* s : all) if (!s->q.empty()) any = true;
    if (!any) break;
    std::shuffle(all.begin(), all.end(), g_rng);
    bool progressed = false;
    for (auto* s : all) {
      if (try_step(s)) { progressed = true; break; }
    }
    if (!progressed) { EXPECT(false, "DEADLOCK"); for (auto* s : all) s->q.clear(); break; }
  }
  for (auto& [k, v] : g_sent) EXPECT(v == g_posted[k], "unmatched messages %d->%d: %ld sent, %ld received", k.first, k.second, long(v), long(g_posted[k]));
  g_sent.clear(); g_posted.clear(); g_msgs.clear();
}

#endif  // JAX_CGX_CUDA_TESTS_NCCL_SIM_H_
