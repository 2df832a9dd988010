// CPU kernels of the jax_cgx codec (xla_ffi/cpu_kernels.cc); their XLA FFI
// handlers are in xla_ffi/cpu_handlers.h.
//
// The per-element arithmetic is codec_math.h; this file only adds the
// bucketing, the bit packing and the loops. Every kernel writes the same bytes
// as a plain scalar loop over the codec_math.h functions (NaN payloads aside,
// which codec_math.h leaves unspecified), whichever ISA variant (baseline
// x86-64, AVX2, AVX-512) is dispatched at run time, with or without FTZ/DAZ.
//
// Byte layout of one row (see xla_ffi/README.md): m elements in
// nb = ceil(m / B) buckets of B consecutive elements; bucket k's packed levels
// start at byte k * ceil(B * bits / 8); element i of a bucket occupies bits
// [i * bits, (i + 1) * bits) of the bucket's bytes, least significant bit
// first; unused high bits of a bucket's last byte are zero.
#ifndef JAX_CGX_XLA_FFI_CPU_KERNELS_H_
#define JAX_CGX_XLA_FFI_CPU_KERNELS_H_

#include <cstdint>

#include "xla_ffi/float_type.h"

namespace jax_cgx::cpu {

using ::jax_cgx::FloatType;

// All kernels take row-major [rows, ...] arrays as in README.md and assume
// validated arguments: bits in 1..8, bucket_size >= 1, consistent sizes.

// x[rows, n] -> payload[rows, P], meta[rows, nb, 2]; encodes the first m <= n
// elements of each row. seeds[rows, 2] is read only when `stochastic`.
// valid[rows] (nullptr: m for every row): only a row's first valid[r]
// elements set its buckets' ranges; later ones (padding) are encoded inside
// those ranges, and a bucket with none gets metadata (0, 0).
// n is also the row stride, so rows may be windows of a longer array.
// index_base: stochastic rounding of a row's element i draws for index
// index_base + i, so a row that is a bucket-aligned window starting at
// element index_base of a longer row encodes exactly as that row would there.
void quantize(const void* x, FloatType x_type, int64_t rows, int64_t n, int64_t m,
              const uint32_t* seeds, const int32_t* valid, int bits, int64_t bucket_size,
              bool stochastic, uint8_t* payload, float* meta, int64_t index_base = 0);

// payload[rows, P], meta[rows, nb, 2] -> out[rows, m]; out_scale != 1 scales
// every decoded value before its one rounding to out_type (scale_output in
// codec_math.h: compressed_pmean's 1/W).
void dequantize(const uint8_t* payload, const float* meta, int64_t rows, int64_t m, int bits,
                int64_t bucket_size, void* out, FloatType out_type, float out_scale = 1.0f);

// payload[rows, W, P], meta[rows, W, nb, 2], optional addend[rows, m]
// (nullptr when absent) -> out[rows, m]; f32 accumulation in order
// addend, input 0, ..., input W-1.
void dequantize_sum(const uint8_t* payload, const float* meta, int64_t rows, int64_t inputs,
                    int64_t m, int bits, int64_t bucket_size, const void* addend,
                    FloatType addend_type, void* out, FloatType out_type);

// As dequantize_sum, then quantizes the f32 sum of each row into
// payload_out[rows, P], meta_out[rows, nb, 2] (valid: as for quantize) and
// writes its decoded value to out[rows, m]. index_base: as for quantize.
void dequantize_sum_requantize(const uint8_t* payload, const float* meta, int64_t rows,
                               int64_t inputs, int64_t m, int bits, int64_t bucket_size,
                               const void* addend, FloatType addend_type, const uint32_t* seeds,
                               const int32_t* valid, bool stochastic, uint8_t* payload_out,
                               float* meta_out, void* out, FloatType out_type,
                               int64_t index_base = 0);

// ISA variants: "avx512", "avx2", "baseline". The active one is the best the
// CPU supports unless the environment variable JAX_CGX_CPU_ISA names another
// (or "auto"), or set_isa() picked one.
const char* active_isa();
// Whether this CPU can run the named variant.
bool isa_supported(const char* name);
// Selects a variant ("auto" = best supported); false (and no change) when the
// name is unknown or the CPU lacks it. Meant for tests and benchmarks.
bool set_isa(const char* name);
// Elements processed per piece of a bucket (stack buffers are this long).
int64_t piece_elements();

}  // namespace jax_cgx::cpu

#endif  // JAX_CGX_XLA_FFI_CPU_KERNELS_H_
