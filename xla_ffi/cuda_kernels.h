// Host interface of the jax_cgx CUDA codec kernels, implemented by
// cuda/codec_kernels.cu (as xla_ffi/cpu_kernels.h is of the CPU kernels).
//
// Plain C++: the FFI handlers (xla_ffi/cuda_handlers.cc, the nccl backend)
// include it without nvcc. cuda/ includes it and xla_ffi/'s other plain
// headers (codec_math.h, float_type.h); xla_ffi/ includes nothing of cuda/.
// Every launcher only enqueues work on `stream` and returns the launch status
// (cudaGetLastError); nothing here allocates, synchronizes or blocks the host.
// The byte format and the per-element arithmetic are those of
// xla_ffi/README.md and xla_ffi/codec_math.h.
#ifndef JAX_CGX_XLA_FFI_CUDA_KERNELS_H_
#define JAX_CGX_XLA_FFI_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "xla_ffi/codec_math.h"
#include "xla_ffi/float_type.h"

// Build-time variants of the quantizing kernels (cuda/quantize_kernels.cuh
// says what each does; cuda/tests/device_test.cu times them side by side).
// The pipelined grid is the default since it measured fastest on an H100
// (docs/gpu-results.md, 2026-11-27, 256 MiB: dequantize 75-81% of a copy's
// bandwidth where the per-bucket grid reached 60-69%; quantize 37-42% in both).
#ifndef JAX_CGX_CODEC_PIPELINE
#define JAX_CGX_CODEC_PIPELINE 1
#endif
// 3 blocks per multiprocessor for the kernels of at most two register groups
// (buckets up to 512): on the same H100 run, quantize 42% of a copy against
// 37% with 1 and the fused dequantize-sum-requantize 35% against 27%, at
// bucket 512; ptxas fits every such kernel in 80 registers without spilling
// (2026-11-28). Four groups (bucket 1024) spill at 80 and keep 1 (29% against 39%).
#ifndef JAX_CGX_QUANTIZE_MIN_BLOCKS
#define JAX_CGX_QUANTIZE_MIN_BLOCKS 3
#endif
// 1: the quantizing kernels are also compiled for 4 and 8 bits as constants
// (prepared on 2026-11-28 without a GPU, not yet timed: off until a device run
// says it wins).
#ifndef JAX_CGX_CODEC_WIDTHS
#define JAX_CGX_CODEC_WIDTHS 0
#endif

namespace jax_cgx::cuda {

// Element type of a float buffer (x, addend, out): xla_ffi/float_type.h.
using ::jax_cgx::FloatType;
using ::jax_cgx::FloatTypeBytes;

// Bucket geometry of one row, shared by all rows of a call.
struct RowLayout {
  int64_t rows = 0;          // R
  int64_t elems = 0;         // m: elements per row covered by buckets
  int64_t bucket = 0;        // B, clamped to m (the same layout when nb <= 1)
  int64_t buckets = 0;       // nb = ceil(m / bucket)
  int64_t bucket_bytes = 0;  // ceil(bucket*bits/8): payload stride between buckets
  int64_t row_bytes = 0;     // P: payload bytes per row
  int bits = 0;              // 1..8
  // Index of each row's first element in the row it was cut from: the counter
  // of stochastic rounding is index_base + position, so quantizing a segment
  // [off, off + m) of a longer row (index_base = off, off a multiple of the
  // bucket size) gives the bytes of that row's buckets. 0 for whole rows.
  int64_t index_base = 0;
};

// The layout of rows of m elements cut into buckets of bucket_size (>= 1).
// bits must be in 1..8; m >= 0. Callers validate shapes against it.
inline RowLayout MakeRowLayout(int64_t rows, int64_t m, int64_t bucket_size, int bits) {
  RowLayout l;
  l.rows = rows;
  l.elems = m;
  l.bits = bits;
  if (m <= 0) return l;  // no buckets, no payload
  // With a single bucket its size does not matter; clamping keeps every later
  // product (bucket*bits, bucket*8) far from int64 overflow.
  l.bucket = bucket_size < m ? bucket_size : m;
  l.buckets = (m - 1) / l.bucket + 1;
  l.bucket_bytes = packed_bytes(l.bucket, bits);
  l.row_bytes = row_payload_bytes(m, bucket_size, bits);  // the layout of docs/format.md, as the CPU's
  return l;
}

// Which elements of each row set its buckets' ranges: row r's first
// Count(r) elements. Later ones are padding: they are encoded inside the
// ranges the valid ones set and never widen them; a bucket with no valid
// element gets metadata (0, 0). Count(r) is rows[r] when `rows` is set (device
// memory), else (*total_dev when set (device memory), else total) minus
// (first + r * row_step): rows cut at a stride from one longer row whose first
// `total` elements are real. The default: every element is valid.
struct ValidCounts {
  const int32_t* rows = nullptr;
  const int32_t* total_dev = nullptr;
  int64_t total = int64_t{1} << 62;
  int64_t first = 0;
  int64_t row_step = 0;
};

// quantize: x[R, x_row_stride] (the first layout.elems of each row are encoded),
// seeds[R, 2] (read only when stochastic) -> payload[R, P] u8, meta[R, nb, 2] f32.
cudaError_t LaunchQuantize(cudaStream_t stream, const RowLayout& layout, FloatType x_type,
                           const void* x, int64_t x_row_stride, const uint32_t* seeds,
                           bool stochastic, uint8_t* payload, float* meta,
                           const ValidCounts& valid = ValidCounts{});

// dequantize: payload[R, P], meta[R, nb, 2] -> out[R, m] (decode of every level,
// times out_scale when it is not 1: scale_output in codec_math.h).
cudaError_t LaunchDequantize(cudaStream_t stream, const RowLayout& layout, const uint8_t* payload,
                             const float* meta, FloatType out_type, void* out, float out_scale = 1.0f);

// dequantize_sum: payload[R, W, P], meta[R, W, nb, 2], addend[R, m] (nullptr when
// absent) -> out[R, m]. (LaunchDequantize is the case W = 1 without addend.)
cudaError_t LaunchDequantizeSum(cudaStream_t stream, const RowLayout& layout, int64_t inputs,
                                const uint8_t* payload, const float* meta, FloatType addend_type,
                                const void* addend, FloatType out_type, void* out);

// dequantize_sum_requantize: as LaunchDequantizeSum, then the f32 sums are
// quantized like an f32 input of LaunchQuantize into out_payload[R, P] and
// out_meta[R, nb, 2], and out[R, m] receives the decoded re-quantized sums
// (out may be nullptr when they are not wanted: nothing is written then).
cudaError_t LaunchDequantizeSumRequantize(cudaStream_t stream, const RowLayout& layout,
                                          int64_t inputs, const uint8_t* payload,
                                          const float* meta, FloatType addend_type,
                                          const void* addend, const uint32_t* seeds,
                                          bool stochastic, uint8_t* out_payload,
                                          float* out_meta, FloatType out_type, void* out,
                                          const ValidCounts& valid = ValidCounts{});

}  // namespace jax_cgx::cuda

#endif  // JAX_CGX_XLA_FFI_CUDA_KERNELS_H_
