// Host tests of cuda/codec_kernels.cu: the exact kernel bodies run under the
// fiber emulation of emu.h and are compared, byte for byte, with a naive
// scalar implementation of the format written from the spec (README +
// codec_math.h), independent of the kernels' helpers.
#include <cmath>
#include <cstring>
#include <random>
#include <string>

#include "emu.h"

using namespace jax_cgx;
using namespace jax_cgx::cuda;
using namespace jax_cgx::cuda::detail;

#include "ref.h"

// Which variant of the quantizing bodies run_quantize runs (all are tested:
// main alternates; the build-time JAX_CGX_CODEC_PIPELINE and
// JAX_CGX_CODEC_WIDTHS pick the GPU's): the segment body's prefetch, and the
// width as a constant (with_width) where the layout's is 4 or 8.
bool g_prefetch = false;
bool g_const_width = false;

template <class Src, class Sink, int G, int kBits>
void run_segments(const Src& src, const Sink& sink, const RowLayout& l, const QuantOut& q, int lanes) {
  if (g_prefetch) {
    quantize_segments<Src, Sink, G, true, kBits>(src, sink, l, q, lanes);
  } else {
    quantize_segments<Src, Sink, G, false, kBits>(src, sink, l, q, lanes);
  }
}

template <class Src, class Sink, int kBits>
void run_plan(const Src& src, const Sink& sink, const RowLayout& l, const QuantOut& q, const QuantizePlan& p) {
  static MinMax partial[kWarpsPerBlock];
  switch (p.groups) {
    case 1: run_segments<Src, Sink, 1, kBits>(src, sink, l, q, p.lanes); break;
    case 2: run_segments<Src, Sink, 2, kBits>(src, sink, l, q, p.lanes); break;
    case 4: run_segments<Src, Sink, 4, kBits>(src, sink, l, q, p.lanes); break;
    default: quantize_blocks<Src, Sink, kBits>(src, sink, l, q, partial); break;
  }
}

// Runs a quantizing body under emulation with the launcher's plan.
template <class Src, class Sink>
void run_quantize(const Src& src, const Sink& sink, const RowLayout& l, const QuantOut& q,
                  int grid_cap, int block_threads) {
  const QuantizePlan p = plan_quantize(l);
  const int grid = static_cast<int>(std::min<int64_t>(grid_for(l.rows * l.buckets, p.buckets_per_block), grid_cap));
  const int width = g_const_width && (l.bits == 4 || l.bits == 8) ? l.bits : 0;
  emu_rt::launch(grid, block_threads, [&]() {
    if (width == 4) {
      run_plan<Src, Sink, 4>(src, sink, l, q, p);
    } else if (width == 8) {
      run_plan<Src, Sink, 8>(src, sink, l, q, p);
    } else {
      run_plan<Src, Sink, 0>(src, sink, l, q, p);
    }
  });
}

const char* type_name(FloatType t) {
  return t == FloatType::kF32 ? "f32" : (t == FloatType::kBF16 ? "bf16" : "f16");
}

template <class E>
FloatType type_of() {
  if constexpr (std::is_same_v<E, F32Type>) return FloatType::kF32;
  if constexpr (std::is_same_v<E, BF16Type>) return FloatType::kBF16;
  return FloatType::kF16;
}

// ------------------------------------------------------- quantize tests

template <class E>
void test_quantize(std::mt19937& rng, int64_t R, int64_t n, int64_t B, bool skip_tail, int bits,
                   bool stochastic, int x_misalign, int payload_misalign, bool force_scalar,
                   int grid_cap, int block_threads) {
  using S = typename E::Storage;
  const int64_t nb = skip_tail ? n / B : ref::ceil_div(n, B);
  const int64_t m = skip_tail ? nb * B : n;
  const RowLayout l = MakeRowLayout(R, m, B, bits);
  const int64_t P = ref::row_bytes(m, B, bits);
  CHECK(l.row_bytes == P && l.buckets == (m == 0 ? 0 : nb), "layout m=%ld B=%ld bits=%d", (long)m, (long)B, bits);
  if (R == 0 || m == 0) return;

  // Input in storage type; the reference sees the same values as f32.
  Buffer xb(R * n * sizeof(S), x_misalign * sizeof(S));
  S* x = reinterpret_cast<S*>(xb.data);
  std::vector<float> xf(R * n);
  for (int64_t r = 0; r < R; ++r) {
    const std::vector<float> v = make_values(rng, n, B, true);
    for (int64_t i = 0; i < n; ++i) {
      x[r * n + i] = to_storage<E>(v[i]);
      xf[r * n + i] = E::to_f32(x[r * n + i]);
    }
  }
  std::vector<uint32_t> seeds(2 * R);
  for (auto& s : seeds) s = rng();
  // Half the calls mark a random tail of each row as padding (it must not enter the ranges).
  const bool padded = rng() % 2 == 0;
  std::vector<int32_t> valid(R, static_cast<int32_t>(m));
  if (padded) {
    for (auto& v : valid) v = static_cast<int32_t>(rng() % (m + 1));
  }

  const ref::Packed want = ref::quantize(xf, R, n, m, B, bits, stochastic, seeds, &valid);

  Buffer pb(R * P, payload_misalign);
  Buffer mb(R * nb * 2 * sizeof(float), 0);
  QuantOut q{pb.data, reinterpret_cast<float*>(mb.data), seeds.data(), stochastic};
  if (padded) q.valid.rows = valid.data();
  const bool vec = !force_scalar && groups_aligned16(x, R, n, l, sizeof(S));
  if (vec) {
    run_quantize(ArrayInput<E, true>{x, n}, NoOutput{}, l, q, grid_cap, block_threads);
  } else {
    run_quantize(ArrayInput<E, false>{x, n}, NoOutput{}, l, q, grid_cap, block_threads);
  }

  const std::string what = "quantize " + std::string(type_name(type_of<E>())) + " R=" +
                           std::to_string(R) + " n=" + std::to_string(n) + " B=" +
                           std::to_string(B) + " bits=" + std::to_string(bits) +
                           (stochastic ? " stoch" : "") + (vec ? " vec" : " scalar") +
                           (padded ? " padded" : "") +
                           " xmis=" + std::to_string(x_misalign) + " pmis=" +
                           std::to_string(payload_misalign);
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < R * P; ++i)
    if (pb.data[i] != want.payload[i]) { if (first < 0) first = i; ++bad; }
  CHECK(bad == 0, "%s: %ld payload bytes differ, first at %ld (got %02x want %02x)", what.c_str(),
        (long)bad, (long)first, first >= 0 ? pb.data[first] : 0, first >= 0 ? want.payload[first] : 0);
  const float* meta = reinterpret_cast<const float*>(mb.data);
  bad = 0;
  first = -1;
  for (int64_t i = 0; i < R * nb * 2; ++i) {
    const bool same = fbits(meta[i]) == fbits(want.meta[i]);
    if (!same) { if (first < 0) first = i; ++bad; }
  }
  CHECK(bad == 0, "%s: %ld meta floats differ, first at %ld (got %a want %a)", what.c_str(), (long)bad,
        (long)first, first >= 0 ? meta[first] : 0.0f, first >= 0 ? want.meta[first] : 0.0f);
  CHECK(pb.guards_intact() && mb.guards_intact(), "%s: wrote outside payload/meta", what.c_str());
  CHECK(xb.guards_intact(), "%s: x guards", what.c_str());
}

// ------------------------------------------------------ row segments

// Quantizing segments [off, off + len) of a row (off a multiple of B) with
// layout.index_base = off gives exactly the bytes of the whole row's buckets:
// what the NCCL backend's segment pipelining relies on (stochastic included).
template <class E>
void test_segments(std::mt19937& rng, int64_t n, int64_t B, int bits, int64_t buckets_per_segment) {
  using S = typename E::Storage;
  std::vector<S> x(n);
  const std::vector<float> v = make_values(rng, n, B, true);
  for (int64_t i = 0; i < n; ++i) x[i] = to_storage<E>(v[i]);
  std::vector<uint32_t> seeds = {static_cast<uint32_t>(rng()), static_cast<uint32_t>(rng())};
  const RowLayout whole = MakeRowLayout(1, n, B, bits);
  std::vector<uint8_t> payload(whole.row_bytes);
  std::vector<float> meta(2 * whole.buckets);
  run_quantize(ArrayInput<E, false>{x.data(), n}, NoOutput{}, whole,
               QuantOut{payload.data(), meta.data(), seeds.data(), true}, 2, 128);
  for (int64_t k0 = 0; k0 < whole.buckets; k0 += buckets_per_segment) {
    const int64_t off = k0 * whole.bucket;
    const int64_t len = std::min(n, off + buckets_per_segment * whole.bucket) - off;
    RowLayout l = MakeRowLayout(1, len, B, bits);
    l.index_base = off;
    std::vector<uint8_t> sp(l.row_bytes);
    std::vector<float> sm(2 * l.buckets);
    run_quantize(ArrayInput<E, false>{x.data() + off, len}, NoOutput{}, l,
                 QuantOut{sp.data(), sm.data(), seeds.data(), true}, 1, 64);
    const bool same_payload =
        std::memcmp(sp.data(), payload.data() + k0 * whole.bucket_bytes, sp.size()) == 0;
    const bool same_meta = std::memcmp(sm.data(), meta.data() + 2 * k0, sm.size() * sizeof(float)) == 0;
    CHECK(same_payload && same_meta, "segment n=%ld B=%ld bits=%d off=%ld len=%ld: payload %d meta %d",
          (long)n, (long)B, bits, (long)off, (long)len, same_payload, same_meta);
  }
}

// -------------------------------------------- dequantize_sum(_requantize)

template <class EA, class EO>
void test_sum(std::mt19937& rng, int64_t R, int64_t W, int64_t m, int64_t B, int bits,
              bool with_addend, bool requantize, bool stochastic, int misalign, int grid_cap,
              int block_threads, float out_scale = 1.0f) {
  using SA = typename EA::Storage;
  using SO = typename EO::Storage;
  const RowLayout l = MakeRowLayout(R, m, B, bits);
  const int64_t P = ref::row_bytes(m, B, bits), nb = ref::ceil_div(m, B);
  if (R == 0 || m == 0) return;
  const Inputs in = make_inputs(rng, R, W, m, B, bits, true);
  // Inputs at a misaligned offset exercise the byte paths of load_packed.
  Buffer ib(in.payload.size(), misalign);
  if (!in.payload.empty()) std::memcpy(ib.data, in.payload.data(), in.payload.size());
  Buffer imb(in.meta.size() * sizeof(float), 0);
  if (!in.meta.empty()) std::memcpy(imb.data, in.meta.data(), in.meta.size() * sizeof(float));

  Buffer ab(R * m * sizeof(SA), misalign % 2 ? sizeof(SA) : 0);
  SA* addend = reinterpret_cast<SA*>(ab.data);
  std::vector<float> af(R * m, 0.0f);
  if (with_addend) {
    for (int64_t r = 0; r < R; ++r) {
      const std::vector<float> v = make_values(rng, m, B, true);
      for (int64_t i = 0; i < m; ++i) {
        addend[r * m + i] = to_storage<EA>(v[i]);
        af[r * m + i] = EA::to_f32(addend[r * m + i]);
      }
    }
  }
  std::vector<uint32_t> seeds(2 * R);
  for (auto& s : seeds) s = rng();

  // reference sums
  std::vector<float> acc(R * m);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < m; ++i) {
      float a = with_addend ? flush(af[r * m + i]) : 0.0f;
      for (int64_t w = 0; w < W; ++w) {
        a = accumulate(a, ref::decoded(in.payload.data() + (r * W + w) * P,
                                       in.meta.data() + (r * W + w) * nb * 2, m, B, bits, i));
      }
      acc[r * m + i] = a;
    }
  }

  Buffer ob(R * m * sizeof(SO), (misalign / 2) % 2 ? sizeof(SO) : 0);
  SO* out = reinterpret_cast<SO*>(ob.data);
  const SumInput src{ib.data, reinterpret_cast<const float*>(imb.data), W,
                     with_addend ? static_cast<const void*>(addend) : nullptr, type_of<EA>(),
                     with_addend && groups_aligned16(addend, R, m, l, sizeof(SA))};
  const ArrayOutput sink{out, type_of<EO>(), groups_aligned16(out, R, m, l, sizeof(SO)), out_scale};
  const std::string what = std::string(requantize ? "dsr" : "dsum") + " add=" +
                           (with_addend ? type_name(type_of<EA>()) : "none") + " out=" +
                           type_name(type_of<EO>()) + " R=" + std::to_string(R) + " W=" +
                           std::to_string(W) + " m=" + std::to_string(m) + " B=" +
                           std::to_string(B) + " bits=" + std::to_string(bits) +
                           (stochastic ? " stoch" : "") + " mis=" + std::to_string(misalign) +
                           " scale=" + std::to_string(out_scale) +
                           (sink.vec ? " ovec" : "") + (src.addend_vec ? " avec" : "");

  std::vector<float> want_out(R * m);
  if (requantize) {
    // Half the calls mark a random tail of each row as padding.
    std::vector<int32_t> valid(R, static_cast<int32_t>(m));
    const bool padded = rng() % 2 == 0;
    if (padded) {
      for (auto& v : valid) v = static_cast<int32_t>(rng() % (m + 1));
    }
    const ref::Packed want = ref::quantize(acc, R, m, m, B, bits, stochastic, seeds, &valid);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < m; ++i)
        want_out[r * m + i] = ref::decoded(want.payload.data() + r * P, want.meta.data() + r * nb * 2, m, B, bits, i);
    Buffer pb(R * P, misalign);
    Buffer mb(R * nb * 2 * sizeof(float), 0);
    QuantOut q{pb.data, reinterpret_cast<float*>(mb.data), seeds.data(), stochastic};
    if (padded) q.valid.rows = valid.data();
    run_quantize(src, sink, l, q, grid_cap, block_threads);
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < R * P; ++i)
      if (pb.data[i] != want.payload[i]) { if (first < 0) first = i; ++bad; }
    CHECK(bad == 0, "%s: %ld payload bytes differ, first at %ld", what.c_str(), (long)bad, (long)first);
    const float* meta = reinterpret_cast<const float*>(mb.data);
    bad = 0;
    for (int64_t i = 0; i < R * nb * 2; ++i) bad += fbits(meta[i]) != fbits(want.meta[i]);
    CHECK(bad == 0, "%s: %ld meta differ", what.c_str(), (long)bad);
    CHECK(pb.guards_intact() && mb.guards_intact(), "%s: wrote outside payload/meta", what.c_str());
  } else {
    // The output scale (a mean's 1/W) multiplies the f32 sum before its one rounding.
    for (int64_t i = 0; i < R * m; ++i) want_out[i] = out_scale == 1.0f ? acc[i] : scale_output(acc[i], out_scale);
    emu_rt::launch(static_cast<int>(std::min<int64_t>(grid_for(R * nb * groups_in(l.bucket), kThreads), grid_cap)),
                   block_threads, [&]() { dequantize_sum_groups(src, sink, l); });
  }
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < R * m; ++i) {
    const SO w = EO::from_f32(want_out[i]);
    // NaN's sign and payload are unspecified (docs/format.md): inf + -inf and a NaN
    // bucket's canonical NaN meet in either order.
    const bool both_nan = std::isnan(EO::to_f32(w)) && std::isnan(EO::to_f32(out[i]));
    const bool same = std::memcmp(&w, &out[i], sizeof(SO)) == 0 || both_nan;
    if (!same) { if (first < 0) first = i; ++bad; }
  }
  CHECK(bad == 0, "%s: %ld out values differ, first at %ld (got %a want %a)", what.c_str(), (long)bad,
        (long)first, first >= 0 ? EO::to_f32(out[first]) : 0.0f, first >= 0 ? want_out[first] : 0.0f);
  CHECK(ob.guards_intact() && ib.guards_intact() && ab.guards_intact(), "%s: guards", what.c_str());
}

// ------------------------------------------------------------ unit tests

void test_units(std::mt19937& rng) {
  // pack_group / group_level against the naive bit stream, every width and count.
  for (int bits = 1; bits <= 8; ++bits) {
    for (int trial = 0; trial < 2000; ++trial) {
      uint32_t lv[kGroup];
      const int cnt = 1 + trial % 8;
      for (int e = 0; e < kGroup; ++e) lv[e] = e < cnt ? rng() & max_level(bits) : 0u;
      const uint64_t p = pack_group(lv, bits);
      uint8_t stream[8] = {0};
      for (int e = 0; e < cnt; ++e) ref::put_bits(stream, e * bits, lv[e], bits);
      uint8_t got[8];
      for (int i = 0; i < 8; ++i) got[i] = static_cast<uint8_t>(p >> (8 * i));
      CHECK(std::memcmp(got, stream, 8) == 0, "pack_group bits=%d", bits);
      CHECK(bits == 8 || (p >> (8 * bits)) == 0, "pack_group spills above its bytes");
      for (int e = 0; e < cnt; ++e) CHECK(group_level(p, e, bits) == lv[e], "group_level");
      // load_packed of the group's bytes at every alignment and length
      alignas(16) uint8_t buf[32];
      for (int off = 0; off < 16; ++off) {
        const int nbytes = static_cast<int>(packed_bytes(cnt, bits));
        std::memset(buf, 0xEE, sizeof buf);
        std::memcpy(buf + off, stream, nbytes);
        uint64_t expect = 0;
        for (int i = 0; i < nbytes; ++i) expect |= uint64_t(stream[i]) << (8 * i);
        CHECK(load_packed(buf + off, nbytes) == expect, "load_packed off=%d n=%d", off, nbytes);
      }
    }
  }
  // word_source/assemble_word: words of a span of random groups, every width
  // and span length, against the naive byte concatenation.
  for (int bits = 1; bits <= 8; ++bits) {
    for (int lanes = 1; lanes <= 32; lanes *= 2) {
      for (int trial = 0; trial < 50; ++trial) {
        std::vector<uint64_t> p(lanes);
        std::vector<uint8_t> span(lanes * bits + 16, 0);
        for (int j = 0; j < lanes; ++j) {
          uint64_t v = (uint64_t(rng()) << 32) | rng();
          if (bits < 8) v &= (uint64_t{1} << (8 * bits)) - 1;
          p[j] = v;
          for (int i = 0; i < bits; ++i) span[j * bits + i] = static_cast<uint8_t>(v >> (8 * i));
        }
        const int words = (lanes * bits + 3) / 4;
        for (int w = 0; w < words; ++w) {
          const WordSource s = word_source(w, bits);
          uint64_t q[4];
          for (int t = 0; t < 4; ++t) q[t] = p[(s.group + t) % lanes];  // the shuffle's wrap-around
          if (bits != 1) q[2] = q[3] = 0;
          const uint32_t word = assemble_word(q, s.shift, bits);
          for (int i = 0; i < 4; ++i) {
            if (4 * w + i >= lanes * bits) break;  // past the span: never stored
            CHECK(static_cast<uint8_t>(word >> (8 * i)) == span[4 * w + i],
                  "assemble_word bits=%d lanes=%d w=%d byte %d", bits, lanes, w, i);
          }
        }
      }
    }
  }
  // Cursors against division.
  for (int trial = 0; trial < 20000; ++trial) {
    const int64_t nb = 1 + rng() % 50, groups = 1 + rng() % 40;
    const int64_t step = 1 + rng() % 3000;
    const int64_t start = rng() % 3000;
    BucketCursor bc = BucketCursor::start(start, step, nb);
    GroupCursor gc = GroupCursor::start(start, step, nb, groups);
    for (int64_t i = 0; i < 20; ++i) {
      const int64_t q = start + i * step;
      CHECK(bc.r == q / nb && bc.k == q % nb, "BucketCursor");
      CHECK(gc.g == q % groups && gc.k == (q / groups) % nb && gc.r == q / groups / nb, "GroupCursor");
      bc.advance(nb);
      gc.advance(nb, groups);
    }
  }
  // Huge positions (rows * buckets > 2^31, payload offsets > 2^32).
  {
    const int64_t nb = 3'000'000'019, groups = 128;
    const int64_t step = int64_t{1} << 24;
    GroupCursor gc = GroupCursor::start(int64_t{5} << 40, step, nb, groups);
    for (int i = 0; i < 1000; ++i) {
      const int64_t f = (int64_t{5} << 40) + i * step;
      CHECK(gc.g == f % groups && gc.k == (f / groups) % nb && gc.r == f / groups / nb, "GroupCursor big");
      gc.advance(nb, groups);
    }
  }
  // MakeRowLayout vs the reference formula; clamping of huge bucket sizes.
  for (int bits = 1; bits <= 8; ++bits) {
    for (int64_t m = 0; m < 300; m += 7) {
      for (int64_t B : {1, 2, 3, 7, 8, 9, 64, 100, 299, 1000}) {
        const RowLayout l = MakeRowLayout(2, m, B, bits);
        CHECK(l.row_bytes == ref::row_bytes(m, B, bits), "row_bytes");
        CHECK(l.buckets == ref::ceil_div(m, B), "buckets");
        if (l.buckets > 1) CHECK(l.bucket == B, "bucket");
      }
    }
    const RowLayout l = MakeRowLayout(1, 10, int64_t{1} << 62, bits);
    CHECK(l.buckets == 1 && l.bucket == 10 && l.row_bytes == ref::ceil_div(10 * bits, 8), "clamped");
  }
  // plan_quantize covers each bucket: lanes*groups*8 >= bucket.
  for (int64_t B = 1; B < 3000; ++B) {
    const RowLayout l = MakeRowLayout(1, 5000, B, 4);
    const QuantizePlan p = plan_quantize(l);
    if (p.groups > 0) {
      CHECK(int64_t{p.lanes} * p.groups * kGroup >= B, "plan covers B=%ld", (long)B);
      CHECK(p.groups == 1 || p.lanes == 32, "G>1 needs full warps");
    } else {
      CHECK(B > kMaxRegisterGroups * kWarpSize * kGroup, "blocks only for big buckets");
    }
  }
}

// ------------------------------------------------------------ dump mode
//
// `emu_test dump DIR` runs a few cases of the kernel bodies and writes their inputs, seeds and
// outputs to DIR as raw little-endian files, listed one case a line in DIR/cases.txt, for
// tests/codec/test_cuda_emulated.py to compare with tests/support/numpy_oracle.py (written from
// docs/format.md alone: ref.h includes codec_math.h, the code under test).

template <class T>
void write_raw(const std::string& path, const T* data, size_t count) {
  FILE* f = std::fopen(path.c_str(), "wb");
  CHECK(f != nullptr, "cannot write %s", path.c_str());
  if (f == nullptr) return;
  if (count) std::fwrite(data, sizeof(T), count, f);
  std::fclose(f);
}

template <class E>
void dump_quantize(std::mt19937& rng, const std::string& dir, FILE* list, int k, int64_t R, int64_t n,
                   int64_t B, int bits, bool stochastic) {
  using S = typename E::Storage;
  const RowLayout l = MakeRowLayout(R, n, B, bits);
  std::vector<S> x(R * n);
  for (int64_t r = 0; r < R; ++r) {
    const std::vector<float> v = make_values(rng, n, B, true);
    for (int64_t i = 0; i < n; ++i) x[r * n + i] = to_storage<E>(v[i]);
  }
  std::vector<uint32_t> seeds(2 * R);
  for (auto& s : seeds) s = rng();
  std::vector<int32_t> valid(R);
  for (int64_t r = 0; r < R; ++r) valid[r] = r == 0 ? static_cast<int32_t>(n) : static_cast<int32_t>(rng() % (n + 1));
  std::vector<uint8_t> payload(R * l.row_bytes);
  std::vector<float> meta(2 * R * l.buckets);
  QuantOut q{payload.data(), meta.data(), seeds.data(), stochastic};
  q.valid.rows = valid.data();
  run_quantize(ArrayInput<E, false>{x.data(), n}, NoOutput{}, l, q, 2, 128);
  const std::string c = dir + "/case" + std::to_string(k) + "_";
  write_raw(c + "x.bin", x.data(), x.size());
  write_raw(c + "seeds.bin", seeds.data(), seeds.size());
  write_raw(c + "valid.bin", valid.data(), valid.size());
  write_raw(c + "payload.bin", payload.data(), payload.size());
  write_raw(c + "meta.bin", meta.data(), meta.size());
  std::fprintf(list, "%d quantize %s %ld %ld %ld %d %d\n", k, type_name(type_of<E>()), (long)R, (long)n, (long)B,
               bits, stochastic ? 1 : 0);
}

template <class EA, class EO>
void dump_sum_requantize(std::mt19937& rng, const std::string& dir, FILE* list, int k, int64_t R, int64_t W,
                         int64_t m, int64_t B, int bits, bool stochastic) {
  using SA = typename EA::Storage;
  using SO = typename EO::Storage;
  const RowLayout l = MakeRowLayout(R, m, B, bits);
  const Inputs in = make_inputs(rng, R, W, m, B, bits, true);
  std::vector<SA> addend(R * m);
  for (int64_t r = 0; r < R; ++r) {
    const std::vector<float> v = make_values(rng, m, B, true);
    for (int64_t i = 0; i < m; ++i) addend[r * m + i] = to_storage<EA>(v[i]);
  }
  std::vector<uint32_t> seeds(2 * R);
  for (auto& s : seeds) s = rng();
  std::vector<int32_t> valid(R);
  for (int64_t r = 0; r < R; ++r) valid[r] = r == 0 ? static_cast<int32_t>(m) : static_cast<int32_t>(rng() % (m + 1));
  std::vector<uint8_t> payload(R * l.row_bytes);
  std::vector<float> meta(2 * R * l.buckets);
  std::vector<SO> out(R * m);
  const SumInput src{in.payload.data(), in.meta.data(), W, addend.data(), type_of<EA>(), false};
  const ArrayOutput sink{out.data(), type_of<EO>(), false};
  QuantOut q{payload.data(), meta.data(), seeds.data(), stochastic};
  q.valid.rows = valid.data();
  run_quantize(src, sink, l, q, 2, 128);
  const std::string c = dir + "/case" + std::to_string(k) + "_";
  write_raw(c + "in_payload.bin", in.payload.data(), in.payload.size());
  write_raw(c + "in_meta.bin", in.meta.data(), in.meta.size());
  write_raw(c + "addend.bin", addend.data(), addend.size());
  write_raw(c + "seeds.bin", seeds.data(), seeds.size());
  write_raw(c + "valid.bin", valid.data(), valid.size());
  write_raw(c + "payload.bin", payload.data(), payload.size());
  write_raw(c + "meta.bin", meta.data(), meta.size());
  write_raw(c + "out.bin", out.data(), out.size());
  std::fprintf(list, "%d dsr %s %s %ld %ld %ld %ld %d %d\n", k, type_name(type_of<EA>()), type_name(type_of<EO>()),
               (long)R, (long)W, (long)m, (long)B, bits, stochastic ? 1 : 0);
}

int dump(const std::string& dir) {
  std::mt19937 rng(36);
  FILE* list = std::fopen((dir + "/cases.txt").c_str(), "w");
  if (list == nullptr) {
    std::fprintf(stderr, "cannot write %s/cases.txt\n", dir.c_str());
    return 1;
  }
  int k = 0;
  for (int bits = 1; bits <= 8; ++bits) {
    const int64_t B = (bits % 3 == 0) ? 3 : (bits % 3 == 1 ? 64 : 512);
    const bool st = bits % 2 == 0;
    dump_quantize<F32Type>(rng, dir, list, k++, 3, 2 * B + 7, B, bits, st);
    dump_quantize<BF16Type>(rng, dir, list, k++, 2, B + 5, B, bits, !st);
    dump_quantize<F16Type>(rng, dir, list, k++, 2, 3 * B, B, bits, st);
    dump_sum_requantize<F32Type, F32Type>(rng, dir, list, k++, 2, 3, 2 * B + 9, B, bits, st);
    dump_sum_requantize<BF16Type, F16Type>(rng, dir, list, k++, 2, 2, B + 1, B, bits, !st);
  }
  std::fclose(list);
  std::fprintf(stderr, "dump: %d cases in %s, %ld checks, %ld failures\n", k, dir.c_str(), g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}

// ----------------------------------------------------------------- main

int main(int argc, char** argv) {
  if (argc > 2 && std::string(argv[1]) == "dump") return dump(argv[2]);
  const bool quick = argc > 1 && std::string(argv[1]) == "quick";
  std::mt19937 rng(12345);
  test_units(rng);
  std::fprintf(stderr, "units: %ld checks, %ld failures\n", g_checks, g_failures);
  for (int bits : {1, 4, 7, 8}) {
    for (bool const_width : {false, true}) {
      if (const_width && bits != 4 && bits != 8) continue;
      g_prefetch = bits % 2 == 0;
      g_const_width = const_width;
      test_segments<F32Type>(rng, 10 * 64 + 13, 64, bits, 3);
      test_segments<BF16Type>(rng, 7 * 100, 100, bits, 2);
      test_segments<F16Type>(rng, 3 * 5000 + 1, 5000, bits, 1);  // block kernel
    }
  }
  g_prefetch = false;
  g_const_width = false;
  std::fprintf(stderr, "segments: %ld checks, %ld failures\n", g_checks, g_failures);

  if (argc > 1 && std::string(argv[1]) == "big") {
    // Large buckets (block kernel, many pass-2 rounds) and edge cases.
    for (int64_t B : {int64_t{5000}, int64_t{1} << 14, (int64_t{1} << 16) + 3}) {
      for (int bits : {1, 3, 5, 8}) {
        const bool st = bits % 2 == 1;
        test_quantize<F32Type>(rng, 2, 2 * B + 11, B, false, bits, st, 0, 0, false, 2, 256);
        test_quantize<BF16Type>(rng, 1, B + 1, B, false, bits, !st, 0, 1, false, 1, 128);
        test_sum<F32Type, F32Type>(rng, 1, 2, B + 17, B, bits, true, true, st, 0, 2, 256);
        test_sum<F16Type, BF16Type>(rng, 2, 1, B + 3, B, bits, false, false, st, 1, 1, 64);
      }
      std::fprintf(stderr, "big B=%ld done: %ld checks, %ld failures\n", (long)B, g_checks, g_failures);
    }
    for (int bits = 1; bits <= 8; ++bits) {
      test_sum<F32Type, F32Type>(rng, 2, 0, 100, 7, bits, false, false, false, 0, 1, 64);  // W=0: zeros
      test_sum<F32Type, F16Type>(rng, 2, 0, 100, 7, bits, true, true, true, 1, 1, 64);
      test_sum<F32Type, F32Type>(rng, 3, 0, 100, 7, bits, false, true, true, 0, 1, 64);
    }
    std::fprintf(stderr, "TOTAL: %ld checks, %ld failures\n", g_checks, g_failures);
    return g_failures == 0 ? 0 : 1;
  }
  const std::vector<int64_t> buckets = quick
      ? std::vector<int64_t>{1, 3, 8, 13, 64, 100, 257, 1000, 1500}
      : std::vector<int64_t>{1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 100, 127, 128,
                             129, 255, 256, 257, 300, 500, 511, 512, 513, 1000, 1023, 1024, 1025,
                             1500, 2048, 2600};
  int cfg = 0;
  for (int64_t B : buckets) {
    for (int bits = 1; bits <= 8; ++bits) {
      ++cfg;
      const bool stoch = (cfg % 3) == 0;
      const int64_t R = 1 + cfg % 3;
      // n: a partial last bucket (most of the time), or whole buckets.
      const int64_t n = (cfg % 4 == 0) ? 2 * B : 2 * B + 1 + (cfg * 7) % std::max<int64_t>(B, 1);
      const bool skip = (cfg % 5) == 0;
      const int grid_cap = 1 + cfg % 3;
      // The three switches vary independently, also for the even widths (cfg = 8k + bits, k the
      // bucket's index): every combination of them meets 4 and 8 bits within 8 buckets.
      const int block = ((cfg % 2 == 1) != ((cfg / 32) % 2 == 1)) ? 64 : 256;
      g_prefetch = (cfg + cfg / 8) % 2 == 1;
      g_const_width = (cfg / 16) % 2 == 1;  // 4 and 8 bits only
      test_quantize<F32Type>(rng, R, n, B, skip, bits, stoch, 0, 0, false, grid_cap, block);
      test_quantize<BF16Type>(rng, R, n, B, skip, bits, !stoch, 0, cfg % 4, false, grid_cap, block);
      test_quantize<F16Type>(rng, R, n, B, false, bits, stoch, 1, 1, false, grid_cap, block);
      test_quantize<F32Type>(rng, R, n, B, false, bits, stoch, 0, 3, true, 2, 64);
      // a single short bucket (B > n)
      test_quantize<F32Type>(rng, 2, std::max<int64_t>(1, B / 2), B + 3, false, bits, stoch, 0, 0, false, 1, 64);

      const int64_t m = n;
      const int64_t W = cfg % 4;  // 0..3 inputs
      test_sum<F32Type, F32Type>(rng, R, W, m, B, bits, cfg % 2 == 0, false, stoch, cfg % 4, grid_cap, block);
      test_sum<BF16Type, F16Type>(rng, R, 1 + W, m, B, bits, true, false, stoch, 0, grid_cap, block);
      test_sum<F32Type, BF16Type>(rng, 1, 1, m, B, bits, false, false, stoch, 0, grid_cap, 64);  // = dequantize
      // dequantize with compressed_pmean's output scale 1/W
      test_sum<F32Type, BF16Type>(rng, 1, 1, m, B, bits, false, false, stoch, 0, grid_cap, 64, 1.0f / 3.0f);
      test_sum<F32Type, F32Type>(rng, R, 1, m, B, bits, false, false, stoch, cfg % 4, grid_cap, block,
                                 1.0f / static_cast<float>(2 + cfg % 7));
      test_sum<F16Type, F32Type>(rng, R, W, m, B, bits, cfg % 2 == 1, true, stoch, cfg % 4, grid_cap, block);
      test_sum<F32Type, BF16Type>(rng, R, 2, m, B, bits, true, true, !stoch, 0, grid_cap, block);
    }
    std::fprintf(stderr, "B=%ld done: %ld checks, %ld failures\n", (long)B, g_checks, g_failures);
  }
  std::fprintf(stderr, "TOTAL: %ld checks, %ld failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
