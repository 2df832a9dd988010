// On-GPU test and benchmark of the launchers in cuda/codec_kernels.cu against
// the scalar reference of ref.h. Needs a GPU; build:
//   nvcc -std=c++17 -O3 --fmad=false --expt-relaxed-constexpr -arch=sm_90
//     -I<repo> -I<repo>/cuda/tests device_test.cu <repo>/cuda/codec_kernels.cu -o device_test
//   ./device_test            # correctness sweep
//   ./device_test bench      # bandwidth of the operations against a copy
//   ./device_test profile    # each operation once, bucket 512, 4 bits (for ncu)
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>

#include "xla_ffi/cuda_kernels.h"
#include "ref.h"

using jax_cgx::cuda::FloatType;
using jax_cgx::cuda::MakeRowLayout;
using jax_cgx::cuda::RowLayout;

#define CUDA_OK(expr)                                                                 \
  do {                                                                                \
    cudaError_t _e = (expr);                                                          \
    if (_e != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(_e)); \
      std::exit(2);                                                                   \
    }                                                                                 \
  } while (0)

// Device copy of a host buffer at a byte offset from a 256-byte aligned base.
struct DevBuf {
  uint8_t* base = nullptr;
  uint8_t* ptr = nullptr;
  size_t n = 0;
  DevBuf(size_t bytes, size_t offset, const void* init = nullptr) : n(bytes) {
    CUDA_OK(cudaMalloc(&base, bytes + offset + 64));
    CUDA_OK(cudaMemset(base, 0xA5, bytes + offset + 64));
    ptr = base + offset;
    if (init && bytes) CUDA_OK(cudaMemcpy(ptr, init, bytes, cudaMemcpyHostToDevice));
  }
  ~DevBuf() { cudaFree(base); }
  std::vector<uint8_t> get() const {
    std::vector<uint8_t> h(n);
    if (n) CUDA_OK(cudaMemcpy(h.data(), ptr, n, cudaMemcpyDeviceToHost));
    return h;
  }
};

template <class E> FloatType ft() {
  if constexpr (std::is_same_v<E, F32T>) return FloatType::kF32;
  if constexpr (std::is_same_v<E, BF16T>) return FloatType::kBF16;
  return FloatType::kF16;
}

static bool same_float_bits(const void* a, const void* b, size_t size, size_t n, int64_t* first) {
  for (size_t i = 0; i < n; ++i) {
    float fa, fb;
    if (size == 4) {
      uint32_t ua, ub;
      std::memcpy(&ua, (const uint8_t*)a + 4 * i, 4);
      std::memcpy(&ub, (const uint8_t*)b + 4 * i, 4);
      fa = bits_float(ua), fb = bits_float(ub);
      if (ua == ub || (fa != fa && fb != fb)) continue;
    } else {
      uint16_t ua, ub;
      std::memcpy(&ua, (const uint8_t*)a + 2 * i, 2);
      std::memcpy(&ub, (const uint8_t*)b + 2 * i, 2);
      if (ua == ub) continue;
      // NaN in either 16-bit format: exponent all ones and mantissa != 0
      const bool nan_a = ((ua & 0x7F80) == 0x7F80 && (ua & 0x7F)) || ((ua & 0x7C00) == 0x7C00 && (ua & 0x3FF));
      const bool nan_b = ((ub & 0x7F80) == 0x7F80 && (ub & 0x7F)) || ((ub & 0x7C00) == 0x7C00 && (ub & 0x3FF));
      if (nan_a && nan_b) continue;
    }
    *first = static_cast<int64_t>(i);
    return false;
  }
  return true;
}

template <class E>
void quantize_case(std::mt19937& rng, int64_t R, int64_t n, int64_t B, bool skip, int bits, bool st,
                   int xoff, int poff) {
  using S = typename E::Storage;
  const int64_t nb = skip ? n / B : ref::ceil_div(n, B);
  const int64_t m = skip ? nb * B : n;
  const RowLayout l = MakeRowLayout(R, m, B, bits);
  if (m == 0) return;
  std::vector<S> x(R * n);
  std::vector<float> xf(R * n);
  for (int64_t r = 0; r < R; ++r) {
    auto v = make_values(rng, n, B, true);
    for (int64_t i = 0; i < n; ++i) x[r * n + i] = E::from_f32(v[i]), xf[r * n + i] = E::to_f32(x[r * n + i]);
  }
  std::vector<uint32_t> seeds(2 * R);
  for (auto& s : seeds) s = rng();
  const auto want = ref::quantize(xf, R, n, m, B, bits, st, seeds);
  DevBuf dx(x.size() * sizeof(S), xoff * sizeof(S), x.data());
  DevBuf ds(seeds.size() * 4, 0, seeds.data());
  DevBuf dp(R * l.row_bytes, poff), dm(R * nb * 8, 0);
  CUDA_OK(jax_cgx::cuda::LaunchQuantize(nullptr, l, ft<E>(), dx.ptr, n, (const uint32_t*)ds.ptr, st, dp.ptr,
                                        (float*)dm.ptr));
  CUDA_OK(cudaDeviceSynchronize());
  const auto gp = dp.get(), gm = dm.get();
  int64_t first = -1;
  const bool ok_p = gp == want.payload;
  const bool ok_m = same_float_bits(gm.data(), want.meta.data(), 4, want.meta.size(), &first);
  CHECK(ok_p && ok_m, "quantize R=%ld n=%ld B=%ld bits=%d st=%d skip=%d xoff=%d poff=%d: payload %s meta %s",
        (long)R, (long)n, (long)B, bits, st, skip, xoff, poff, ok_p ? "ok" : "DIFF", ok_m ? "ok" : "DIFF");
}

template <class EA, class EO>
void sum_case(std::mt19937& rng, int64_t R, int64_t W, int64_t m, int64_t B, int bits, bool with_addend,
              bool requant, bool st, int off) {
  using SA = typename EA::Storage;
  using SO = typename EO::Storage;
  const RowLayout l = MakeRowLayout(R, m, B, bits);
  const int64_t P = l.row_bytes, nb = l.buckets;
  const Inputs in = make_inputs(rng, R, W, m, B, bits, true);
  std::vector<SA> a(R * m);
  std::vector<float> af(R * m, 0.0f);
  if (with_addend) {
    for (int64_t r = 0; r < R; ++r) {
      auto v = make_values(rng, m, B, true);
      for (int64_t i = 0; i < m; ++i) a[r * m + i] = EA::from_f32(v[i]), af[r * m + i] = EA::to_f32(a[r * m + i]);
    }
  }
  std::vector<uint32_t> seeds(2 * R);
  for (auto& s : seeds) s = rng();
  std::vector<float> acc(R * m);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < m; ++i) {
      float x = with_addend ? flush(af[r * m + i]) : 0.0f;
      for (int64_t w = 0; w < W; ++w)
        x = accumulate(x, ref::decoded(in.payload.data() + (r * W + w) * P, in.meta.data() + (r * W + w) * nb * 2, m,
                                       B, bits, i));
      acc[r * m + i] = x;
    }
  DevBuf dpay(in.payload.size(), off, in.payload.data());
  DevBuf dmeta(in.meta.size() * 4, 0, in.meta.data());
  DevBuf dadd(a.size() * sizeof(SA), (off % 2) * sizeof(SA), a.data());
  DevBuf dseeds(seeds.size() * 4, 0, seeds.data());
  DevBuf dout(R * m * sizeof(SO), ((off / 2) % 2) * sizeof(SO));
  std::vector<float> want_out = acc;
  bool ok_p = true, ok_m = true;
  int64_t first = -1;
  if (requant) {
    const auto want = ref::quantize(acc, R, m, m, B, bits, st, seeds);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < m; ++i)
        want_out[r * m + i] = ref::decoded(want.payload.data() + r * P, want.meta.data() + r * nb * 2, m, B, bits, i);
    DevBuf op(R * P, off), om(R * nb * 8, 0);
    CUDA_OK(jax_cgx::cuda::LaunchDequantizeSumRequantize(
        nullptr, l, W, dpay.ptr, (const float*)dmeta.ptr, ft<EA>(), with_addend ? dadd.ptr : nullptr,
        (const uint32_t*)dseeds.ptr, st, op.ptr, (float*)om.ptr, ft<EO>(), dout.ptr));
    CUDA_OK(cudaDeviceSynchronize());
    ok_p = op.get() == want.payload;
    const auto gm = om.get();
    ok_m = same_float_bits(gm.data(), want.meta.data(), 4, want.meta.size(), &first);
  } else if (W == 1 && !with_addend) {
    CUDA_OK(jax_cgx::cuda::LaunchDequantize(nullptr, l, dpay.ptr, (const float*)dmeta.ptr, ft<EO>(), dout.ptr));
  } else {
    CUDA_OK(jax_cgx::cuda::LaunchDequantizeSum(nullptr, l, W, dpay.ptr, (const float*)dmeta.ptr, ft<EA>(),
                                               with_addend ? dadd.ptr : nullptr, ft<EO>(), dout.ptr));
  }
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<SO> wo(R * m);
  for (int64_t i = 0; i < R * m; ++i) wo[i] = EO::from_f32(want_out[i]);
  const auto go = dout.get();
  const bool ok_o = same_float_bits(go.data(), wo.data(), sizeof(SO), wo.size(), &first);
  CHECK(ok_p && ok_m && ok_o, "%s R=%ld W=%ld m=%ld B=%ld bits=%d add=%d st=%d off=%d: payload %s meta %s out %s (first %ld)",
        requant ? "dsr" : "dsum", (long)R, (long)W, (long)m, (long)B, bits, with_addend, st, off, ok_p ? "ok" : "DIFF",
        ok_m ? "ok" : "DIFF", ok_o ? "ok" : "DIFF", (long)first);
}

// `profile`: launch each operation once, for a profiler, and time nothing.
static bool g_profile = false;

// Median over 7 batches of 20 launches, timed with events, in ms per launch.
template <class Fn>
static float time_ms(Fn fn) {
  if (g_profile) {
    fn();
    CUDA_OK(cudaDeviceSynchronize());
    return 1.0f;
  }
  cudaEvent_t e0, e1;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));
  fn();  // warm-up
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> ms(7);
  for (float& t : ms) {
    CUDA_OK(cudaEventRecord(e0));
    for (int i = 0; i < 20; ++i) fn();
    CUDA_OK(cudaEventRecord(e1));
    CUDA_OK(cudaEventSynchronize(e1));
    CUDA_OK(cudaEventElapsedTime(&t, e0, e1));
    t /= 20;
  }
  CUDA_OK(cudaEventDestroy(e0));
  CUDA_OK(cudaEventDestroy(e1));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// The codec against a device-to-device copy of the same buffer, in one run
// (issue 13: each operation at >= 85% of the copy's bandwidth, bytes read
// plus written). 256 MiB of float32; dsr(W=4) is the owner's fused step of
// a 4-rank all-reduce of that buffer: 4 encodings of a quarter of it plus
// its own quarter in, the re-quantized encoding and the decoded sum out.
static void bench() {
  const int64_t n = int64_t{1} << 26;  // 64M values: 256 MiB of float32
  DevBuf x(n * 4, 0), o(n * 4, 0), seeds(64, 0);
  {
    std::vector<float> h(1 << 20);
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    for (auto& v : h) v = nd(rng);
    for (int64_t i = 0; i < n; i += h.size()) {
      CUDA_OK(cudaMemcpy(x.ptr + 4 * i, h.data(), 4 * h.size(), cudaMemcpyHostToDevice));
    }
  }
  const float t_copy = time_ms([&] { CUDA_OK(cudaMemcpyAsync(o.ptr, x.ptr, n * 4, cudaMemcpyDeviceToDevice)); });
  const double copy_gbs = 2.0 * n * 4 / t_copy / 1e6;
  std::printf("variant: JAX_CGX_CODEC_PIPELINE=%d JAX_CGX_QUANTIZE_MIN_BLOCKS=%d JAX_CGX_CODEC_WIDTHS=%d\n",
              JAX_CGX_CODEC_PIPELINE, JAX_CGX_QUANTIZE_MIN_BLOCKS, JAX_CGX_CODEC_WIDTHS);
  std::printf("copy 256 MiB: %.3f ms, %.0f GB/s read + written\n", t_copy, copy_gbs);
  std::printf("%-10s %5s %4s %9s %8s %8s\n", "op", "B", "bits", "ms", "GB/s", "of copy");
  auto row = [&](const char* op, int64_t B, int bits, float ms, double bytes) {
    if (g_profile) return;  // nothing was timed
    const double gbs = bytes / ms / 1e6;
    std::printf("%-10s %5ld %4d %9.3f %8.0f %7.0f%%\n", op, (long)B, bits, ms, gbs, 100.0 * gbs / copy_gbs);
  };
  for (int64_t B : {int64_t{128}, int64_t{512}, int64_t{1024}, int64_t{4096}}) {
    for (int bits : {4, 8}) {
      if (g_profile && (B != 512 || bits != 4)) continue;
      const RowLayout l = MakeRowLayout(1, n, B, bits);
      const double enc = l.row_bytes + l.buckets * 8.0;
      DevBuf p(l.row_bytes, 0), m(l.buckets * 8, 0);
      const float tq = time_ms([&] {
        CUDA_OK(jax_cgx::cuda::LaunchQuantize(nullptr, l, FloatType::kF32, x.ptr, n, (const uint32_t*)seeds.ptr,
                                              false, p.ptr, (float*)m.ptr));
      });
      row("quantize", B, bits, tq, n * 4.0 + enc);
      const float td = time_ms([&] {
        CUDA_OK(jax_cgx::cuda::LaunchDequantize(nullptr, l, p.ptr, (const float*)m.ptr, FloatType::kF32, o.ptr));
      });
      row("dequantize", B, bits, td, enc + n * 4.0);
      // dsr(W=4): rows of a quarter of the buffer; 4 inputs (the encodings of the buffer's 4
      // quarters, laid out [1, 4, P] and [1, 4, nb, 2]) and the first quarter as the addend.
      const int64_t W = 4, c = n / W;
      const RowLayout lc = MakeRowLayout(1, c, B, bits);
      const double enc_c = lc.row_bytes + lc.buckets * 8.0;
      DevBuf pin(W * lc.row_bytes, 0), min_(W * lc.buckets * 8, 0), pout(lc.row_bytes, 0), mout(lc.buckets * 8, 0);
      for (int64_t w = 0; w < W; ++w) {
        CUDA_OK(jax_cgx::cuda::LaunchQuantize(nullptr, lc, FloatType::kF32, x.ptr + 4 * w * c, c,
                                              (const uint32_t*)seeds.ptr, false, pin.ptr + w * lc.row_bytes,
                                              (float*)min_.ptr + 2 * w * lc.buckets));
      }
      const float tr = time_ms([&] {
        CUDA_OK(jax_cgx::cuda::LaunchDequantizeSumRequantize(
            nullptr, lc, W, pin.ptr, (const float*)min_.ptr, FloatType::kF32, x.ptr, (const uint32_t*)seeds.ptr,
            false, pout.ptr, (float*)mout.ptr, FloatType::kF32, o.ptr));
      });
      row("dsr(W=4)", B, bits, tr, W * enc_c + c * 4.0 + enc_c + c * 4.0);
    }
  }
}

int main(int argc, char** argv) {
  if (argc > 1 && (std::string(argv[1]) == "bench" || std::string(argv[1]) == "profile")) {
    g_profile = std::string(argv[1]) == "profile";
    bench();
    return 0;
  }
  std::mt19937 rng(7);
  int cfg = 0;
  for (int64_t B : {1, 3, 8, 13, 64, 100, 256, 500, 512, 1000, 1024, 1025, 4096, 70000}) {
    for (int bits = 1; bits <= 8; ++bits) {
      ++cfg;
      const bool st = cfg % 2;
      const int64_t R = 1 + cfg % 3;
      const int64_t n = (cfg % 4 == 0) ? 3 * B : 3 * B + 1 + (cfg * 7) % B;
      quantize_case<F32T>(rng, R, n, B, cfg % 5 == 0, bits, st, 0, 0);
      quantize_case<BF16T>(rng, R, n, B, false, bits, !st, 1, 3);
      quantize_case<F16T>(rng, R, n, B, false, bits, st, 0, 1);
      sum_case<F32T, F32T>(rng, R, cfg % 4, n, B, bits, cfg % 3 == 0, false, st, cfg % 4);
      sum_case<BF16T, F16T>(rng, R, 1, n, B, bits, false, false, st, 0);
      sum_case<F16T, BF16T>(rng, R, 1 + cfg % 3, n, B, bits, cfg % 2 == 0, true, st, cfg % 4);
    }
    std::printf("B=%ld: %ld checks, %ld failures\n", (long)B, g_checks, g_failures);
  }
  std::printf("TOTAL: %ld checks, %ld failures\n", g_checks, g_failures);
  return g_failures != 0;
}
