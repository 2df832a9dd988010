// CPU kernels of the jax_cgx codec (see cpu_kernels.h): the public entry
// points and run-time ISA dispatch. The row loops are in cpu_kernel_rows.h,
// compiled once per ISA by cpu_kernels_{baseline,avx2,avx512}.cc (each in four
// parts of two widths: cpu_kernel_table.h); their building blocks are in
// cpu_kernel_ops.h.
//
// How the kernels are fast without changing a single bit of the result:
//   * A row is processed in spans that start at a bucket start or at a
//     multiple of 8 elements inside a bucket, so each starts on a byte of the
//     packed stream and 8 levels always fill exactly `bits` bytes. Small
//     buckets (B a multiple of 8) share spans, so packing runs over many at
//     once; buckets longer than kPiece are processed in pieces.
//   * Each step is its own simple loop over L1-resident data (min/max, levels,
//     bit packing, decoding, dtype conversion), written so that GCC
//     auto-vectorizes it. Most loop bodies are the codec_math.h functions
//     themselves; where GCC would not vectorize those (min/max, the level
//     computation, f16 conversions) the body spells out the same operations
//     in a vectorizable form, and the scratch tests compare every kernel with
//     a scalar loop over codec_math.h (the f16 conversions over all inputs).
//     Vectorization only runs lanes side by side: IEEE operations, no
//     contraction (-ffp-contract=off, no fast-math), so the bits are equal.
//   * Packing works on 64-bit words: 8 levels, one per byte, are squeezed into
//     the low 8*bits bits with three shift-and-mask steps (and unpacking is the
//     reverse), which vectorizes as plain 64-bit lane operations.
//   * The row kernels are compiled three times, for baseline x86-64, AVX2 and
//     AVX-512, and the best variant the CPU supports is picked once at run
//     time (JAX_CGX_CPU_ISA overrides it).
// The min/max pass reads raw values and flushes only the result: flush() is
// monotonic (it maps (-2^-126, 2^-126) to +0 and keeps everything else), so
// flush(min x) == min flush(x), and likewise for max; NaNs are skipped by the
// comparisons and tracked separately.
#include "xla_ffi/cpu_kernels.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "xla_ffi/codec_math.h"
#include "xla_ffi/cpu_kernel_table.h"

namespace jax_cgx::cpu {
namespace {

const KernelTable kBaselineKernels = CGX_KERNEL_TABLE(baseline);
#if CGX_X86_VARIANTS
const KernelTable kAvx2Kernels = CGX_KERNEL_TABLE(avx2);
const KernelTable kAvx512Kernels = CGX_KERNEL_TABLE(avx512);
#endif

// Best first.
const KernelTable* const kVariants[] = {
#if CGX_X86_VARIANTS
    &kAvx512Kernels,
    &kAvx2Kernels,
#endif
    &kBaselineKernels,
};

bool cpu_supports(const KernelTable* t) {
#if CGX_X86_VARIANTS
  if (t == &kAvx512Kernels) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  if (t == &kAvx2Kernels) return __builtin_cpu_supports("avx2");
#endif
  return t == &kBaselineKernels;
}

// The best supported variant, or the named one; nullptr if unknown/unsupported.
const KernelTable* find_variant(const char* name) {
  const bool any = name == nullptr || std::strcmp(name, "auto") == 0;
  for (const KernelTable* t : kVariants) {
    if (!any && std::strcmp(name, t->name) != 0) continue;
    return cpu_supports(t) ? t : nullptr;
  }
  return nullptr;
}

std::atomic<const KernelTable*> g_variant{nullptr};

const KernelTable& kernels() {
  const KernelTable* t = g_variant.load(std::memory_order_acquire);
  if (t == nullptr) {
    const KernelTable* chosen = find_variant(std::getenv("JAX_CGX_CPU_ISA"));
    if (chosen == nullptr) chosen = find_variant(nullptr);
    // Another thread may have chosen first; both picked from the same rules.
    g_variant.compare_exchange_strong(t, chosen, std::memory_order_acq_rel);
    t = g_variant.load(std::memory_order_acquire);
  }
  return *t;
}

}  // namespace

// ------------------------------------------------------------ public API

void quantize(const void* x, FloatType x_type, int64_t rows, int64_t n, int64_t m,
              const uint32_t* seeds, const int32_t* valid, int bits, int64_t bucket_size,
              bool stochastic, uint8_t* payload, float* meta, int64_t index_base) {
  if (m == 0) return;
  const QuantizeFn fn = kernels().widths[bits - 1]->quantize[stochastic ? 1 : 0];
  const int64_t p = row_payload_bytes(m, bucket_size, bits);
  const int64_t nb = bucket_count(m, bucket_size);
  for (int64_t r = 0; r < rows; ++r) {
    if (valid != nullptr && valid[r] <= 0) {
      // Nothing real: every bucket gets (0, 0), and inverse_scale(0) = 0 puts every
      // element, finite or not, at level 0 (codec_math.h). Those bytes, without
      // reading x: SRA and the reduce-scatter mark the chunk a rank keeps this way.
      std::memset(payload + r * p, 0, static_cast<size_t>(p));
      std::memset(meta + r * nb * 2, 0, static_cast<size_t>(nb) * 2 * sizeof(float));
      continue;
    }
    QuantizeRow row{element_ptr(x, x_type, r * n),
                    x_type,
                    m,
                    bucket_size,
                    valid != nullptr ? valid[r] : m,
                    stochastic ? seeds[2 * r] : 0u,
                    stochastic ? seeds[2 * r + 1] : 0u,
                    static_cast<uint32_t>(index_base),
                    payload + r * p,
                    meta + r * nb * 2};
    fn(row);
  }
}

void dequantize(const uint8_t* payload, const float* meta, int64_t rows, int64_t m, int bits,
                int64_t bucket_size, void* out, FloatType out_type, float out_scale) {
  if (m == 0) return;
  const DequantizeFn fn = kernels().widths[bits - 1]->dequantize;
  const int64_t p = row_payload_bytes(m, bucket_size, bits);
  const int64_t nb = bucket_count(m, bucket_size);
  for (int64_t r = 0; r < rows; ++r) {
    DequantizeRow row{payload + r * p, meta + r * nb * 2, m, bucket_size,
                      element_ptr(out, out_type, r * m), out_type, out_scale};
    fn(row);
  }
}

namespace {
void reduce(const uint8_t* payload, const float* meta, int64_t rows, int64_t inputs, int64_t m,
            int bits, int64_t bucket_size, const void* addend, FloatType addend_type,
            const uint32_t* seeds, const int32_t* valid, bool requantize, bool stochastic,
            int64_t index_base, uint8_t* payload_out, float* meta_out, void* out,
            FloatType out_type) {
  if (m == 0) return;
  const int mode = requantize ? (stochastic ? 2 : 1) : 0;
  const ReduceFn fn = kernels().widths[bits - 1]->reduce[mode];
  const int64_t p = row_payload_bytes(m, bucket_size, bits);
  const int64_t nb = bucket_count(m, bucket_size);
  for (int64_t r = 0; r < rows; ++r) {
    ReduceRow row{payload + r * inputs * p,
                  p,
                  meta + r * inputs * nb * 2,
                  nb * 2,
                  inputs,
                  m,
                  bucket_size,
                  valid != nullptr ? valid[r] : m,
                  addend != nullptr ? element_ptr(addend, addend_type, r * m) : nullptr,
                  addend_type,
                  mode == 2 ? seeds[2 * r] : 0u,
                  mode == 2 ? seeds[2 * r + 1] : 0u,
                  static_cast<uint32_t>(index_base),
                  requantize ? payload_out + r * p : nullptr,
                  requantize ? meta_out + r * nb * 2 : nullptr,
                  element_ptr(out, out_type, r * m),
                  out_type};
    fn(row);
  }
}
}  // namespace

void dequantize_sum(const uint8_t* payload, const float* meta, int64_t rows, int64_t inputs,
                    int64_t m, int bits, int64_t bucket_size, const void* addend,
                    FloatType addend_type, void* out, FloatType out_type) {
  reduce(payload, meta, rows, inputs, m, bits, bucket_size, addend, addend_type, nullptr, nullptr,
         /*requantize=*/false, /*stochastic=*/false, 0, nullptr, nullptr, out, out_type);
}

void dequantize_sum_requantize(const uint8_t* payload, const float* meta, int64_t rows,
                               int64_t inputs, int64_t m, int bits, int64_t bucket_size,
                               const void* addend, FloatType addend_type, const uint32_t* seeds,
                               const int32_t* valid, bool stochastic, uint8_t* payload_out,
                               float* meta_out, void* out, FloatType out_type, int64_t index_base) {
  reduce(payload, meta, rows, inputs, m, bits, bucket_size, addend, addend_type, seeds, valid,
         /*requantize=*/true, stochastic, index_base, payload_out, meta_out, out, out_type);
}

const char* active_isa() { return kernels().name; }

bool isa_supported(const char* name) { return name != nullptr && find_variant(name) != nullptr; }

bool set_isa(const char* name) {
  const KernelTable* t = find_variant(name);
  if (t == nullptr) return false;
  g_variant.store(t, std::memory_order_release);
  return true;
}

int64_t piece_elements() { return kPiece; }

}  // namespace jax_cgx::cpu
