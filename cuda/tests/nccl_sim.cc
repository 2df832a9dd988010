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

#include "xla_ffi/nccl_allreduce.cc"  // the handlers, in this TU
#include "xla_ffi/nccl_sharded.cc"
#include "cuda/tests/nccl_sim.h"  // the simulated streams, codec and NCCL

// ------------------------------------------------------------ reference
// scale: 1 (compressed_psum) or 1/W (compressed_pmean's output scale).
struct Case { int64_t n, W, chunk, B; int bits; bool st; int alg; int64_t segs; FloatType t; float scale; };

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
    const float v = decoded(l, fp[j].data(), fm[j].data(), i);
    from_f32(c.t, tmp.data(), 0, c.scale == 1.0f ? v : scale_output(v, c.scale));
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
                                             c.bits, c.B, c.st, c.alg, c.segs, c.scale);
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
      EXPECT(nbad == 0, "n=%ld W=%ld chunk=%ld B=%ld bits=%d st=%d alg=%d segs=%ld(%d) type=%d scale=%g call %d rank %d: %ld mismatches, first at %ld",
             long(c.n), long(c.W), long(c.chunk), long(c.B), c.bits, c.st, c.alg, long(c.segs), plan.segments, int(c.t),
             double(c.scale), k, r,
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
    c.scale = g_rng() % 2 ? 1.0f : 1.0f / static_cast<float>(c.W);
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
