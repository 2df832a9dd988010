// Shared by emu_test.cu and device_test.cu: a naive scalar implementation of
// the jax_cgx format (README + codec_math.h), test data and small utilities.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "xla_ffi/codec_math.h"

using namespace jax_cgx;

struct F32T { using Storage = float; static float to_f32(float v) { return v; } static float from_f32(float f) { return f; } };
struct BF16T { using Storage = uint16_t; static float to_f32(uint16_t v) { return bf16_to_f32(v); } static uint16_t from_f32(float f) { return f32_to_bf16(f); } };
struct F16T { using Storage = uint16_t; static float to_f32(uint16_t v) { return f16_to_f32(v); } static uint16_t from_f32(float f) { return f32_to_f16(f); } };

static long g_checks = 0;
static long g_failures = 0;

#define CHECK(cond, ...)                                        \
  do {                                                          \
    ++g_checks;                                                 \
    if (!(cond)) {                                              \
      ++g_failures;                                             \
      if (g_failures < 30) {                                    \
        std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
        std::fprintf(stderr, __VA_ARGS__);                      \
        std::fprintf(stderr, "\n");                             \
      }                                                         \
    }                                                           \
  } while (0)

// ------------------------------------------------------------ reference

namespace ref {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t row_bytes(int64_t m, int64_t B, int bits) {
  return (m / B) * ceil_div(B * bits, 8) + ceil_div((m % B) * bits, 8);
}

void put_bits(uint8_t* stream, int64_t pos, uint32_t level, int bits) {
  for (int b = 0; b < bits; ++b) {
    if ((level >> b) & 1u) stream[(pos + b) / 8] |= static_cast<uint8_t>(1u << ((pos + b) % 8));
  }
}

uint32_t get_bits(const uint8_t* stream, int64_t pos, int bits) {
  uint32_t v = 0;
  for (int b = 0; b < bits; ++b) v |= ((stream[(pos + b) / 8] >> ((pos + b) % 8)) & 1u) << b;
  return v;
}

struct Packed {
  std::vector<uint8_t> payload;  // [R, P]
  std::vector<float> meta;       // [R, nb, 2]
};

// Quantizes the first m of each row of vals[R, stride] (f32 values). With
// `valid` (one count per row), only a row's first valid[r] values set its
// buckets' ranges; a bucket with none gets (0, 0) (make_meta of an empty range).
Packed quantize(const std::vector<float>& vals, int64_t R, int64_t stride, int64_t m, int64_t B,
                int bits, bool stochastic, const std::vector<uint32_t>& seeds,
                const std::vector<int32_t>* valid = nullptr) {
  const int64_t P = row_bytes(m, B, bits);
  const int64_t nb = ceil_div(m, B);
  const int64_t bb = ceil_div(B * bits, 8);
  Packed out;
  out.payload.assign(R * P, 0);
  out.meta.assign(R * nb * 2, 0.0f);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t k = 0; k < nb; ++k) {
      const int64_t start = k * B;
      const int64_t len = std::min(B, m - start);
      BucketRange range;
      const int64_t count = valid != nullptr ? (*valid)[r] : m;
      for (int64_t j = 0; j < len && start + j < count; ++j) range_add(range, vals[r * stride + start + j]);
      const BucketMeta meta = make_meta(range, bits);
      out.meta[(r * nb + k) * 2] = meta.min;
      out.meta[(r * nb + k) * 2 + 1] = meta.scale;
      uint8_t* stream = out.payload.data() + r * P + k * bb;
      for (int64_t j = 0; j < len; ++j) {
        const uint32_t random23 =
            stochastic ? random_bits(seeds[2 * r], seeds[2 * r + 1], static_cast<uint32_t>(start + j)) : 0u;
        put_bits(stream, j * bits, encode_level(vals[r * stride + start + j], meta, bits, stochastic, random23),
                 bits);
      }
    }
  }
  return out;
}

// Decoded f32 values [R, m] of packed rows (payload row stride P, meta row stride nb*2,
// starting at the given offsets so that [R, W, ...] inputs can be addressed).
float decoded(const uint8_t* payload, const float* meta, int64_t m, int64_t B, int bits,
              int64_t i) {
  const int64_t k = i / B, j = i % B;
  (void)m;
  const uint32_t level = get_bits(payload + k * ceil_div(B * bits, 8), j * bits, bits);
  return decode_level(level, meta[2 * k], meta[2 * k + 1], bits);
}

}  // namespace ref

// ---------------------------------------------------------------- helpers

#if defined(EXACT_BUFFERS)
// Exact-size allocations, so that AddressSanitizer flags any read or write
// past the end (the misaligned prefix is poisoned by hand).
#include <sanitizer/asan_interface.h>
#include <cstdlib>
struct Buffer {
  uint8_t* base = nullptr;
  uint8_t* data = nullptr;
  size_t size = 0, misalign = 0;
  Buffer(size_t n, size_t mis, uint8_t fill = 0xA5) : size(n), misalign(mis) {
    void* p = nullptr;
    if (posix_memalign(&p, 64, n + mis ? n + mis : 1) != 0) std::abort();
    base = static_cast<uint8_t*>(p);
    std::memset(base, fill, n + mis);
    data = base + mis;
    ASAN_POISON_MEMORY_REGION(base, mis);
  }
  Buffer(const Buffer&) = delete;
  ~Buffer() {
    ASAN_UNPOISON_MEMORY_REGION(base, misalign);
    std::free(base);
  }
  bool guards_intact(uint8_t = 0xA5) const { return true; }
};
#else
struct Buffer {  // 64-byte aligned storage with guard bytes around it
  std::vector<uint8_t> raw;
  uint8_t* data = nullptr;
  size_t size = 0;
  size_t offset = 0;
  static constexpr size_t kGuard = 64;
  Buffer(size_t n, size_t misalign, uint8_t fill = 0xA5) {
    raw.assign(n + misalign + 3 * kGuard, fill);
    uintptr_t base = reinterpret_cast<uintptr_t>(raw.data()) + kGuard;
    base = (base + 63) & ~uintptr_t{63};
    data = reinterpret_cast<uint8_t*>(base) + misalign;
    size = n;
    offset = data - raw.data();
  }
  bool guards_intact(uint8_t fill = 0xA5) const {
    for (size_t i = 0; i < offset; ++i)
      if (raw[i] != fill) return false;
    for (size_t i = offset + size; i < raw.size(); ++i)
      if (raw[i] != fill) return false;
    return true;
  }
};

#endif

uint32_t fbits(float f) { return float_bits(f); }

template <class E>
typename E::Storage to_storage(float f) {
  return E::from_f32(f);
}

// Values for one row with per-bucket character.
std::vector<float> make_values(std::mt19937& rng, int64_t n, int64_t B, bool specials) {
  std::vector<float> v(n);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, specials ? 15 : 3);
  std::uniform_int_distribution<int> expo(-3, 3);
  for (int64_t start = 0; start < n; start += B) {
    const int64_t len = std::min(B, n - start);
    const int kind = pick(rng);
    const float scale = std::pow(10.0f, static_cast<float>(expo(rng)));
    const float offset = normal(rng) * scale;
    for (int64_t j = 0; j < len; ++j) {
      float x = normal(rng) * scale;
      switch (kind) {
        case 0: case 1: break;                                  // plain
        case 2: x = x + 3.0f * offset; break;                   // shifted
        case 3: x = (j % 3 == 0) ? 0.0f : x; break;             // zeros mixed in
        case 4: x = 1.5f; break;                                // constant
        case 5: x = (j == len / 2) ? NAN : x; break;            // one NaN
        case 6: x = (j == 0) ? INFINITY : x; break;             // inf
        case 7: x = (j == len - 1) ? 0x1.8p125f : x; break;     // overflow
        case 8: x = (j % 2) ? 0x1p-130f : -0x1p-135f; break;    // subnormals only
        case 9: x = 1.0f + 0x1p-20f * static_cast<float>(j % 5); break;  // tiny range
        case 10: x = (j % 4 == 0) ? -0.0f : x * 1e30f; break;   // big and -0
        case 11: x = 0x1p124f * (normal(rng) > 0 ? 1.0f : -1.0f); break;  // near the wide limit
        case 12: x = (j == 1) ? -INFINITY : (j == len - 1 ? INFINITY : x); break;  // both infinities
        case 13: x = (j % 2) ? 3e38f : -0x1.fffffep127f; break;  // wide, at the largest float
        case 14: x = (j % 7 == 3) ? -INFINITY : x * 3e37f; break;  // wide with -inf
        case 15: x = (j % 3) ? INFINITY : -INFINITY; break;  // nothing finite
      }
      v[start + j] = x;
    }
  }
  return v;
}

// A [R, W, P] stack of packed rows of random data, each [R, m] row quantized
// by the reference (so the inputs are valid packed data).
struct Inputs {
  std::vector<uint8_t> payload;  // [R, W, P]
  std::vector<float> meta;       // [R, W, nb, 2]
};

Inputs make_inputs(std::mt19937& rng, int64_t R, int64_t W, int64_t m, int64_t B, int bits,
                   bool specials) {
  const int64_t P = ref::row_bytes(m, B, bits), nb = ref::ceil_div(m, B);
  Inputs in;
  in.payload.assign(R * W * P, 0);
  in.meta.assign(R * W * nb * 2, 0.0f);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t w = 0; w < W; ++w) {
      const std::vector<float> vals = make_values(rng, m, B, specials);
      const ref::Packed p = ref::quantize(vals, 1, m, m, B, bits, (w % 2) == 1, {1234u + uint32_t(w), 99u});
      std::memcpy(in.payload.data() + (r * W + w) * P, p.payload.data(), P);
      std::memcpy(in.meta.data() + (r * W + w) * nb * 2, p.meta.data(), nb * 2 * sizeof(float));
    }
  }
  return in;
}

