// The CPU codec's row kernels as a table of entry points per ISA variant
// (cpu_kernels.cc picks one at run time). Each variant is compiled from a file
// of its own (cpu_kernels_baseline.cc, _avx2.cc, _avx512.cc, from the templates
// of cpu_kernel_rows.h), and each file once per part of the eight widths
// (CMakeLists.txt, CGX_KERNEL_PART), so that a build compiles twelve pieces
// side by side: in one file they took three minutes of one core, one file per
// variant about a minute each.
#pragma once

#include <cstdint>

#include "xla_ffi/cpu_kernels.h"

#if defined(__GNUC__) && defined(__x86_64__)
#define CGX_X86_VARIANTS 1
#else
#define CGX_X86_VARIANTS 0
#endif

namespace jax_cgx::cpu {

// Buckets of up to kPiece elements are held whole in the stack buffers
// (16 KiB of f32, 4 KiB of levels), so their input is read once; longer ones
// are processed in pieces of kPiece elements.
constexpr int64_t kPiece = 4096;
// Small buckets are grouped into spans of up to kSpan elements (see
// buckets_per_span), and the reduce kernels sum kSpan elements at a time:
// their loops stream addend, payloads and output through L1 together, and
// measured faster with short runs than with kPiece-long ones.
constexpr int64_t kSpan = 512;
static_assert(kPiece % 8 == 0 && kSpan % 8 == 0 && kPiece % kSpan == 0,
              "pieces and spans must start on whole bytes");

// `valid`: the row's first `valid` elements set its buckets' ranges; later
// ones (padding) are encoded within those ranges but never widen them.
struct QuantizeRow {
  const void* x;
  FloatType x_type;
  int64_t m, bucket, valid;
  uint32_t seed0, seed1;
  uint32_t index_base;  // stochastic rounding draws for element index_base + i
  uint8_t* payload;
  float* meta;
};

struct DequantizeRow {
  const uint8_t* payload;
  const float* meta;
  int64_t m, bucket;
  void* out;
  FloatType out_type;
  float out_scale;  // decoded values times this (1: as decoded)
};

struct ReduceRow {
  const uint8_t* payload;  // input w at payload + w * payload_stride
  int64_t payload_stride;
  const float* meta;  // input w at meta + w * meta_stride
  int64_t meta_stride;
  int64_t inputs;
  int64_t m, bucket, valid;  // valid: as QuantizeRow's, for the requantized sum
  const void* addend;  // nullptr: absent
  FloatType addend_type;
  uint32_t seed0, seed1;
  uint32_t index_base;  // as QuantizeRow's
  uint8_t* payload_out;  // nullptr: no requantization
  float* meta_out;
  void* out;
  FloatType out_type;
};

using QuantizeFn = void (*)(const QuantizeRow&);
using DequantizeFn = void (*)(const DequantizeRow&);
using ReduceFn = void (*)(const ReduceRow&);

// One width's entry points in one variant.
struct WidthKernels {
  QuantizeFn quantize[2];  // [stochastic]
  DequantizeFn dequantize;
  ReduceFn reduce[3];  // [0: sum, 1: requantize nearest, 2: stochastic]
};

struct KernelTable {
  const char* name;
  const WidthKernels* widths[8];  // [bits - 1]
};

// Variant NS's widths, NS_width_1 .. NS_width_8: each defined by the part of
// NS's file that holds it (CGX_DEFINE_WIDTHS), gathered into NS's table by
// CGX_KERNEL_TABLE (cpu_kernels.cc).
#define CGX_DECLARE_WIDTHS(NS)                                                                       \
  extern const WidthKernels NS##_width_1, NS##_width_2, NS##_width_3, NS##_width_4, NS##_width_5, \
      NS##_width_6, NS##_width_7, NS##_width_8;
#define CGX_KERNEL_TABLE(NS)                                                                          \
  KernelTable {                                                                                       \
    #NS, { &NS##_width_1, &NS##_width_2, &NS##_width_3, &NS##_width_4, &NS##_width_5, &NS##_width_6, \
           &NS##_width_7, &NS##_width_8 }                                                             \
  }

CGX_DECLARE_WIDTHS(baseline)
#if CGX_X86_VARIANTS
CGX_DECLARE_WIDTHS(avx2)
CGX_DECLARE_WIDTHS(avx512)
#endif

}  // namespace jax_cgx::cpu
