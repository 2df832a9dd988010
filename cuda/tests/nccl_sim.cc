// Host simulation of the nccl backend's handlers (xla_ffi/nccl_allreduce.cc, nccl_sharded.cc), no GPU:
// W ranks, each with an XLA stream and a side stream modelled as op queues run in
// random interleavings with CUDA event semantics; NCCL group/send/recv/all-gather
// through FIFO mailboxes (receive buffers hold garbage while in flight, send buffers
// must not change); scalar codec stubs that honour RowLayout (index_base included);
// every access bounds-checked against exact-size allocations. The output of every
// rank is compared bitwise with a whole-chunk transcription of sra_rows / ring_rows
// (all-reduce) or scatter_rows / gather_rows (reduce-scatter, all-gather).
// Built and run by tests/nccl/test_nccl_simulated.py (with ASan/UBSan).
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
#include "xla_ffi/nccl_allreduce.cc"  // the handlers, in this TU
#include "xla_ffi/nccl_sharded.cc"

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
                             FloatType ot, void* out) {
  check_range(payload, l.rows * l.row_bytes, "dequantize payload");
  check_range(meta, l.rows * l.buckets * 8, "dequantize meta");
  check_range(out, l.rows * l.elems * FloatTypeBytes(ot), "dequantize out");
  Op op;
  op.run = [=] {
    for (int64_t r = 0; r < l.rows; ++r)
      for (int64_t i = 0; i < l.elems; ++i)
        if (out) from_f32(ot, out, r * l.elems + i, decoded(l, payload + r * l.row_bytes, meta + r * l.buckets * 2, i));
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

// ------------------------------------------------------------ reference
struct Case { int64_t n, W, chunk, B; int bits; bool st; int alg; int64_t segs; FloatType t; };

static std::vector<std::vector<float>> reference(const Case& c, const std::vector<std::vector<uint8_t>>& xs,
                                                 const std::vector<std::vector<uint32_t>>& seeds, int64_t valid_n) {
  const int64_t W = c.W, C = c.chunk, eb = cuda::FloatTypeBytes(c.t);
  RowLayout l = cuda::MakeRowLayout(1, C, c.B, c.bits);
  auto chunkval = [&](int r, int64_t j, int64_t i) -> float {
    const int64_t g = j * C + i;
    return g < c.n ? to_f32(c.t, xs[r].data(), g) : 0.0f;
  };
  std::vector<uint8_t> pad(C * eb);
  auto padded_chunk = [&](int r, int64_t j) {
    for (int64_t i = 0; i < C; ++i) from_f32(c.t, pad.data(), i, chunkval(r, j, i));
    return pad;
  };
  // final encodings of chunk j
  std::vector<std::vector<uint8_t>> fp(W, std::vector<uint8_t>(l.row_bytes));
  std::vector<std::vector<float>> fm(W, std::vector<float>(2 * l.buckets));
  // Chunk j's real values: the first valid_n of the row.
  auto real = [&](int64_t j) {
    cuda::ValidCounts v;
    v.total = valid_n;
    v.first = j * C;
    return v;
  };
  auto q = [&](const std::vector<uint8_t>& src, int64_t j, const uint32_t* sd, uint8_t* p, float* m) {
    quantize_f32(l, [&](int64_t, int64_t i) { return to_f32(c.t, src.data(), i); }, sd, c.st, p, m, real(j));
  };
  auto dsr = [&](const std::vector<uint8_t>& P, const std::vector<float>& M, int64_t inputs,
                 const std::vector<uint8_t>& addend, int64_t j, const uint32_t* sd, uint8_t* op, float* om) {
    std::vector<float> acc(C);
    for (int64_t i = 0; i < C; ++i) {
      float a = flush(to_f32(c.t, addend.data(), i));
      for (int64_t w = 0; w < inputs; ++w) a = accumulate(a, decoded(l, P.data() + w * l.row_bytes, M.data() + w * l.buckets * 2, i));
      acc[i] = a;
    }
    quantize_f32(l, [&](int64_t, int64_t i) { return acc[i]; }, sd, c.st, op, om, real(j));
  };
  if (c.alg == 0) {
    for (int o = 0; o < W; ++o) {
      std::vector<uint8_t> P(W * l.row_bytes);
      std::vector<float> M(W * 2 * l.buckets);
      for (int r = 0; r < W; ++r) q(padded_chunk(r, o), o, seeds[r].data() + 2 * o, P.data() + r * l.row_bytes, M.data() + r * 2 * l.buckets);
      for (int64_t k = 0; k < 2 * l.buckets; ++k) M[o * 2 * l.buckets + k] = 0;
      dsr(P, M, W, padded_chunk(o, o), o, seeds[o].data() + 2 * W, fp[o].data(), fm[o].data());
    }
  } else {
    for (int o = 0; o < W; ++o) {
      int r = (o + 1) % W;
      std::vector<uint8_t> P(l.row_bytes);
      std::vector<float> M(2 * l.buckets);
      q(padded_chunk(r, o), o, seeds[r].data(), P.data(), M.data());
      for (int64_t t = 0; t + 1 < W; ++t) {
        r = (o + t + 2) % W;
        const int64_t row = t == W - 2 ? W : t + 1;
        std::vector<uint8_t> P2(l.row_bytes);
        std::vector<float> M2(2 * l.buckets);
        dsr(P, M, 1, padded_chunk(r, o), o, seeds[r].data() + 2 * row, P2.data(), M2.data());
        P = P2; M = M2;
      }
      fp[o] = P; fm[o] = M;
    }
  }
  std::vector<float> out(c.n);
  for (int64_t g = 0; g < c.n; ++g) {
    const int64_t j = g / C, i = g % C;
    std::vector<uint8_t> tmp(eb);
    from_f32(c.t, tmp.data(), 0, decoded(l, fp[j].data(), fm[j].data(), i));
    out[g] = to_f32(c.t, tmp.data(), 0);
  }
  return std::vector<std::vector<float>>(W, out);
}

// ------------------------------------------------------------ driver
static uint8_t* dev_alloc(size_t n, const char* name) {
  uint8_t* p = new uint8_t[n ? n : 1];
  for (size_t i = 0; i < n; ++i) p[i] = uint8_t(g_rng());
  g_allocs.push_back({p, n, name});
  return p;
}

// W ranks: a communicator, an XLA stream and a side stream each; returns the XLA streams.
static std::vector<std::unique_ptr<nccl::Communicator>> g_comms;
static std::vector<std::unique_ptr<Stream>> g_stream_store;
static std::vector<std::unique_ptr<Event>> g_events;
static std::vector<cudaStream_t> setup_ranks(int W) {
  g_comms.clear(); g_stream_store.clear(); g_events.clear(); g_streams.clear(); g_sc.assign(W, SimComm{});
  nccl::g_comm_by_ordinal.assign(W, nullptr);
  std::vector<cudaStream_t> mains(W);
  for (int r = 0; r < W; ++r) {
    auto cm = std::make_unique<nccl::Communicator>();
    cm->rank = r; cm->world = W; cm->ordinal = r;
    g_sc[r].rank = r; g_sc[r].world = W;
    cm->comm = reinterpret_cast<ncclComm_t>(&g_sc[r]);
    auto side = std::make_unique<Stream>(); side->rank = r; side->name = "side";
    auto main = std::make_unique<Stream>(); main->rank = r; main->name = "main";
    cm->stream = reinterpret_cast<cudaStream_t>(side.get());
    g_sc[r].stream = cm->stream;
    mains[r] = reinterpret_cast<cudaStream_t>(main.get());
    g_streams[cm->stream] = side.get();
    g_streams[mains[r]] = main.get();
    for (int s = 0; s < nccl::kMaxSegments; ++s)
      for (cudaEvent_t* e : {&cm->quantized[s], &cm->exchanged[s], &cm->reduced[s], &cm->gathered[s]}) {
        g_events.push_back(std::make_unique<Event>());
        *e = reinterpret_cast<cudaEvent_t>(g_events.back().get());
      }
    nccl::g_comm_by_ordinal[r] = cm.get();
    g_stream_store.push_back(std::move(side)); g_stream_store.push_back(std::move(main));
    g_comms.push_back(std::move(cm));
  }
  return mains;
}

// After rank r's call k returns, XLA's stream may reuse the workspace: nothing may
// be pending on the side stream by the time XLA's stream gets there.
static void push_reuse_check(int r, int k, cudaStream_t main, uint8_t* ws_r, int64_t wsb) {
  Stream* side = S(g_comms[r]->stream);
  const int64_t upto = side->pushed;
  Op chk;
  chk.check = [side, r, k, ws_r, wsb, upto] {
    EXPECT(side->popped >= upto, "rank %d call %d: side stream busy after XLA stream passed the call", r, k);
    for (int64_t i = 0; i < wsb; ++i) ws_r[i] = uint8_t(i * 131 + 7);  // XLA reuses the workspace
  };
  S(main)->push(chk);
}

static void run_case(const Case& c, int calls) {
  const int W = int(c.W);
  const int64_t eb = cuda::FloatTypeBytes(c.t);
  exchange::Plan plan;
  std::string bad = nccl::MakeAllreducePlan(c.n, c.W, c.chunk, c.bits, c.B, eb, nccl::Algorithm(c.alg), c.segs, &plan);
  if (!bad.empty()) { EXPECT(false, "plan: %s", bad.c_str()); return; }
  const int64_t wsb = plan.workspace_bytes;
  std::vector<cudaStream_t> mains = setup_ranks(W);
  g_allocs.clear();
  std::vector<uint8_t*> ws(W);
  for (int r = 0; r < W; ++r) ws[r] = dev_alloc(wsb, "workspace");
  struct Bufs { std::vector<uint8_t*> x, out, sd; std::vector<std::vector<uint8_t>> xh; std::vector<std::vector<uint32_t>> sh; uint8_t* vd; int32_t valid_n; };
  std::vector<Bufs> per(calls);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int k = 0; k < calls; ++k) {
    Bufs& b = per[k];
    // The row's real values: all of them, or (as a hierarchical shard) fewer, the rest padding.
    b.valid_n = static_cast<int32_t>(g_rng() % 3 == 0 ? 1 + g_rng() % c.n : c.n);
    b.vd = dev_alloc(4, "valid");
    std::memcpy(b.vd, &b.valid_n, 4);
    for (int r = 0; r < W; ++r) {
      b.xh.emplace_back(c.n * eb);
      for (int64_t i = 0; i < c.n; ++i) from_f32(c.t, b.xh[r].data(), i, (g_rng() % 7 == 0) ? 0.f : nd(g_rng) * (1 + r));
      b.sh.emplace_back(2 * (W + 1));
      for (auto& s : b.sh[r]) s = g_rng();
      b.x.push_back(dev_alloc(c.n * eb, "x"));
      std::memcpy(b.x[r], b.xh[r].data(), c.n * eb);
      b.out.push_back(dev_alloc(c.n * eb, "out"));
      b.sd.push_back(dev_alloc(8 * (W + 1), "seeds"));
      std::memcpy(b.sd[r], b.sh[r].data(), 8 * (W + 1));
    }
  }
  const ffi::DataType dt = c.t == FloatType::kF32 ? ffi::DataType::F32 : (c.t == FloatType::kBF16 ? ffi::DataType::BF16 : ffi::DataType::F16);
  for (int k = 0; k < calls; ++k) {
    for (int r = 0; r < W; ++r) {
      int64_t xd[1] = {c.n}, sdd[2] = {c.W + 1, 2}, wd[1] = {wsb}, vdd[1] = {1};
      XLA_FFI_Buffer vb{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, XLA_FFI_DataType_S32, per[k].vd, 1, vdd};
      XLA_FFI_Buffer xb{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, XLA_FFI_DataType(dt), per[k].x[r], 1, xd};
      XLA_FFI_Buffer ob{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, XLA_FFI_DataType(dt), per[k].out[r], 1, xd};
      XLA_FFI_Buffer sb{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, XLA_FFI_DataType_U32, per[k].sd[r], 2, sdd};
      XLA_FFI_Buffer wb{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, XLA_FFI_DataType_U8, ws[r], 1, wd};
      ffi::Error e = nccl::NcclAllreduceImpl(mains[r], r, ffi::AnyBuffer(&xb), ffi::AnyBuffer(&sb), ffi::AnyBuffer(&vb),
                                             ffi::Result<ffi::AnyBuffer>(ffi::AnyBuffer(&ob)),
                                             ffi::Result<ffi::AnyBuffer>(ffi::AnyBuffer(&wb)), 7, c.W, c.chunk,
                                             c.bits, c.B, c.st, c.alg, c.segs);
      EXPECT(e.success(), "handler failed: %s", e.message().c_str());
      EXPECT(t_depth == 0, "group left open");
      push_reuse_check(r, k, mains[r], ws[r], wsb);
    }
  }
  run_all();
  for (int k = 0; k < calls; ++k) {
    auto want = reference(c, per[k].xh, per[k].sh, per[k].valid_n);
    for (int r = 0; r < W; ++r) {
      int64_t bad_i = -1, nbad = 0;
      for (int64_t i = 0; i < c.n; ++i) {
        const float got = to_f32(c.t, per[k].out[r], i);
        if (float_bits(got) != float_bits(want[r][i])) { if (bad_i < 0) bad_i = i; ++nbad; }
      }
      EXPECT(nbad == 0, "n=%ld W=%ld chunk=%ld B=%ld bits=%d st=%d alg=%d segs=%ld(%d) type=%d call %d rank %d: %ld mismatches, first at %ld",
             long(c.n), long(c.W), long(c.chunk), long(c.B), c.bits, c.st, c.alg, long(c.segs), plan.segments, int(c.t), k, r,
             long(nbad), long(bad_i));
    }
  }
  for (auto& b : per) {
    for (int r = 0; r < W; ++r) { delete[] b.x[r]; delete[] b.out[r]; delete[] b.sd[r]; }
    delete[] b.vd;
  }
  for (int r = 0; r < W; ++r) delete[] ws[r];
}

static int64_t chunk_length(int64_t n, int64_t w, int64_t B, bool whole) {
  const int64_t per = (n + w - 1) / w;
  const int64_t align = (whole || per >= 64 * B) ? B : 16;
  return (per + align - 1) / align * align;
}

// ------------------------------------------------------- reduce-scatter, all-gather
struct ShardedCase { nccl::ShardedOp op; int64_t m, W, B; int bits; bool st; int64_t segs; FloatType t; };

// What the xla backend computes (scatter_rows / gather_rows): blocks padded to
// an aligned length c whose padding never enters a bucket, for every rank.
static std::vector<std::vector<float>> sharded_reference(const ShardedCase& c,
                                                         const std::vector<std::vector<uint8_t>>& xs,
                                                         const std::vector<std::vector<uint32_t>>& seeds) {
  const bool scatter = c.op == nccl::ShardedOp::kReduceScatter;
  const int64_t W = c.W, m = c.m;
  const int64_t C = scatter ? chunk_length(W * m, W, c.B, false) : chunk_length(m, 1, c.B, false);
  const RowLayout l = cuda::MakeRowLayout(1, C, c.B, c.bits);
  cuda::ValidCounts real;
  real.total = m;
  // Block j of rank r (its shard for all-gather), padded to C, encoded with seed row j.
  auto encode = [&](int r, int64_t j, std::vector<uint8_t>* P, std::vector<float>* M) {
    P->assign(l.row_bytes, 0);
    M->assign(2 * l.buckets, 0.f);
    const int64_t base = scatter ? j * m : 0;
    quantize_f32(l, [&](int64_t, int64_t i) { return i < m ? to_f32(c.t, xs[r].data(), base + i) : 0.f; },
                 seeds[r].data() + 2 * (scatter ? j : 0), c.st, P->data(), M->data(), real);
  };
  auto rounded = [&](float v) {
    std::vector<uint8_t> tmp(cuda::FloatTypeBytes(c.t));
    from_f32(c.t, tmp.data(), 0, v);
    return to_f32(c.t, tmp.data(), 0);
  };
  std::vector<std::vector<float>> out(W);
  std::vector<uint8_t> P;
  std::vector<float> M;
  if (scatter) {
    for (int o = 0; o < W; ++o) {
      std::vector<float> acc(m);
      for (int64_t i = 0; i < m; ++i) acc[i] = flush(to_f32(c.t, xs[o].data(), o * m + i));
      for (int r = 0; r < W; ++r) {
        if (r != o) encode(r, o, &P, &M);
        // The owner's own slot has zeroed metadata: it adds +0.
        for (int64_t i = 0; i < m; ++i) acc[i] = accumulate(acc[i], r == o ? 0.f : decoded(l, P.data(), M.data(), i));
      }
      for (int64_t i = 0; i < m; ++i) out[o].push_back(rounded(acc[i]));
    }
    return out;
  }
  std::vector<float> all;
  for (int r = 0; r < W; ++r) {
    encode(r, 0, &P, &M);
    for (int64_t i = 0; i < m; ++i) all.push_back(rounded(decoded(l, P.data(), M.data(), i)));
  }
  return std::vector<std::vector<float>>(W, all);
}

static void run_sharded_case(const ShardedCase& c, int calls) {
  const bool scatter = c.op == nccl::ShardedOp::kReduceScatter;
  const int W = int(c.W);
  const int64_t eb = cuda::FloatTypeBytes(c.t);
  exchange::Plan plan;
  const std::string bad = nccl::MakeShardedPlan(c.op, c.m, c.W, c.bits, c.B, eb, c.segs, &plan);
  if (!bad.empty()) { EXPECT(false, "plan: %s", bad.c_str()); return; }
  const int64_t wsb = plan.workspace_bytes;
  const int64_t x_len = scatter ? W * c.m : c.m, out_len = scatter ? c.m : W * c.m, seed_rows = scatter ? W : 1;
  std::vector<cudaStream_t> mains = setup_ranks(W);
  g_allocs.clear();
  std::vector<uint8_t*> ws(W);
  for (int r = 0; r < W; ++r) ws[r] = dev_alloc(wsb, "workspace");
  struct Bufs { std::vector<uint8_t*> x, out, sd; std::vector<std::vector<uint8_t>> xh; std::vector<std::vector<uint32_t>> sh; };
  std::vector<Bufs> per(calls);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& b : per) {
    for (int r = 0; r < W; ++r) {
      b.xh.emplace_back(x_len * eb);
      for (int64_t i = 0; i < x_len; ++i) from_f32(c.t, b.xh[r].data(), i, (g_rng() % 7 == 0) ? 0.f : nd(g_rng) * (1 + r));
      b.sh.emplace_back(2 * seed_rows);
      for (auto& v : b.sh[r]) v = g_rng();
      b.x.push_back(dev_alloc(x_len * eb, "x"));
      std::memcpy(b.x[r], b.xh[r].data(), x_len * eb);
      b.out.push_back(dev_alloc(out_len * eb, "out"));
      b.sd.push_back(dev_alloc(8 * seed_rows, "seeds"));
      std::memcpy(b.sd[r], b.sh[r].data(), 8 * seed_rows);
    }
  }
  const XLA_FFI_DataType dt = c.t == FloatType::kF32 ? XLA_FFI_DataType_F32
                              : (c.t == FloatType::kBF16 ? XLA_FFI_DataType_BF16 : XLA_FFI_DataType_F16);
  for (int k = 0; k < calls; ++k) {
    for (int r = 0; r < W; ++r) {
      int64_t blocks[2] = {c.W, c.m}, row[1] = {c.m}, sdd[2] = {seed_rows, 2}, wd[1] = {wsb};
      XLA_FFI_Buffer xb{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, dt, per[k].x[r], scatter ? 2 : 1, scatter ? blocks : row};
      XLA_FFI_Buffer ob{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, dt, per[k].out[r], scatter ? 1 : 2, scatter ? row : blocks};
      XLA_FFI_Buffer sb{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, XLA_FFI_DataType_U32, per[k].sd[r], 2, sdd};
      XLA_FFI_Buffer wb{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, XLA_FFI_DataType_U8, ws[r], 1, wd};
      auto impl = scatter ? nccl::sharded::ReduceScatterImpl : nccl::sharded::AllGatherImpl;
      ffi::Error e = impl(mains[r], r, ffi::AnyBuffer(&xb), ffi::AnyBuffer(&sb),
                          ffi::Result<ffi::AnyBuffer>(ffi::AnyBuffer(&ob)), ffi::Result<ffi::AnyBuffer>(ffi::AnyBuffer(&wb)),
                          7, c.W, c.bits, c.B, c.st, c.segs);
      EXPECT(e.success(), "handler failed: %s", e.message().c_str());
      EXPECT(t_depth == 0, "group left open");
      push_reuse_check(r, k, mains[r], ws[r], wsb);
    }
  }
  run_all();
  for (int k = 0; k < calls; ++k) {
    auto want = sharded_reference(c, per[k].xh, per[k].sh);
    for (int r = 0; r < W; ++r) {
      int64_t bad_i = -1, nbad = 0;
      for (int64_t i = 0; i < out_len; ++i) {
        if (float_bits(to_f32(c.t, per[k].out[r], i)) != float_bits(want[r][i])) { if (bad_i < 0) bad_i = i; ++nbad; }
      }
      EXPECT(nbad == 0, "%s m=%ld W=%ld B=%ld bits=%d st=%d segs=%ld(%d) type=%d call %d rank %d: %ld mismatches, first at %ld",
             scatter ? "reduce-scatter" : "all-gather", long(c.m), long(c.W), long(c.B), c.bits, c.st, long(c.segs),
             plan.segments, int(c.t), k, r, long(nbad), long(bad_i));
    }
  }
  for (auto& b : per)
    for (int r = 0; r < W; ++r) { delete[] b.x[r]; delete[] b.out[r]; delete[] b.sd[r]; }
  for (int r = 0; r < W; ++r) delete[] ws[r];
}

int main(int argc, char** argv) {
  g_api.GetErrorString = sErr; g_api.GetLastError = sLast; g_api.CommGetAsyncError = sAsync;
  g_api.GroupStart = sGroupStart; g_api.GroupEnd = sGroupEnd; g_api.Send = sSend; g_api.Recv = sRecv;
  g_api.AllGather = sAllGather;
  int cases = argc > 1 ? atoi(argv[1]) : 300;
  const FloatType types[3] = {FloatType::kF32, FloatType::kBF16, FloatType::kF16};
  for (int i = 0; i < cases; ++i) {
    Case c;
    c.W = 2 + g_rng() % 5;
    c.n = 1 + g_rng() % (i % 3 == 0 ? 40 : 3000);
    c.B = std::vector<int64_t>{1, 3, 8, 16, 24, 64, 100, 512, 5000}[g_rng() % 9];
    c.bits = 1 + g_rng() % 8;
    c.st = g_rng() % 2;
    c.alg = g_rng() % 2;
    c.segs = std::vector<int64_t>{0, 1, 2, 3, 5, 64}[g_rng() % 6];
    c.t = types[g_rng() % 3];
    c.chunk = chunk_length(c.n, c.W, c.B, g_rng() % 2);
    if (g_rng() % 5 == 0) c.chunk += g_rng() % 50;  // arbitrary larger chunk
    run_case(c, 1 + g_rng() % 2);
    ShardedCase sc;
    sc.op = i % 2 ? nccl::ShardedOp::kReduceScatter : nccl::ShardedOp::kAllGather;
    sc.W = 2 + g_rng() % 5;
    sc.m = 1 + g_rng() % (i % 3 == 0 ? 40 : 1500);
    sc.B = std::vector<int64_t>{1, 3, 8, 16, 24, 64, 100, 512, 5000}[g_rng() % 9];
    sc.bits = 1 + g_rng() % 8;
    sc.st = g_rng() % 2;
    sc.segs = std::vector<int64_t>{0, 1, 2, 3, 5, 64}[g_rng() % 6];
    sc.t = types[g_rng() % 3];
    run_sharded_case(sc, 1 + g_rng() % 2);
  }
  printf("%s: %ld failures\n", g_fail ? "FAILED" : "ok", g_fail);
  return g_fail != 0;
}
