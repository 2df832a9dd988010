// CUDA kernels of the jax_cgx codec.
//
// Every value these kernels write is the one a scalar loop over
// xla_ffi/codec_math.h produces: the same per-element functions, the same
// min/max (order-independent, hence exact under any reduction tree) and the
// same accumulation order. Build with --fmad=false (CMakeLists.txt does).
//
// Work decomposition
//   * An element group is 8 consecutive elements of a bucket. Its 8 levels fill
//     exactly `bits` whole bytes of the bucket's LSB-first bit stream, so every
//     lane packs and unpacks whole bytes on its own; a bucket's last group may
//     be short, and its missing levels are 0 (the zero padding bits).
//   * quantize and dequantize_sum_requantize need each bucket's min/max first.
//     Buckets of up to 32*8*4 = 1024 elements go to a segment of 1..32 lanes of
//     a warp (sized to the bucket) that keeps the bucket in registers and reduces
//     with shuffles: the input is read once. Larger buckets go to a whole block
//     that reads the bucket twice (min/max, then encode); the second read comes
//     from L2 for all but huge buckets.
//   * Packed bytes are written as whole 32-bit words where aligned: lanes trade
//     their group bytes with shuffles so that lane j writes word j of the
//     segment's span (coalesced for every bit width, not only 1, 2, 4 and 8).
//   * dequantize(_sum) needs no reduction: one thread per element group, over a
//     flattened (row, bucket, group) index advanced without divisions.
//
// All index arithmetic is int64: rows * buckets may exceed 2^31, and payload
// offsets may exceed 2^31 bytes. Grids are capped and every kernel loops.
//
// The kernel bodies are __host__ __device__ templates over a few thread
// primitives (thread_pos, shuffles, block barrier). On the device these are the
// CUDA intrinsics; a host test may define JAX_CGX_HOST_EMULATION and provide
// them (cooperative fibers that meet at each shuffle and barrier) to run the
// exact kernel code on the CPU against a scalar reference.
//
// Files: cuda/codec_device.cuh (the building blocks), cuda/quantize_kernels.cuh
// (the bucket-quantizing kernels); this file adds the decoding kernel and the
// launchers of xla_ffi/cuda_kernels.h, and is the one source file.
//
// Parts: CMakeLists.txt compiles this file once per JAX_CGX_CUDA_PART, so that
// the pieces compile side by side (whole, it was a build's longest step on a
// many-core machine): 0, LaunchQuantize and its float32 kernels; 1, its
// bfloat16 and float16 kernels; 2, the decoding kernel and the summing
// launchers. Compiled with no part (the tests, which include it or name it) it
// is all of them.
#include "xla_ffi/cuda_kernels.h"

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/codec_device.cuh"
#include "cuda/quantize_kernels.cuh"
#include "xla_ffi/codec_math.h"

#if !defined(JAX_CGX_CUDA_PART)
#define CGX_CUDA_PART(p) 1
#elif JAX_CGX_CUDA_PART >= 0 && JAX_CGX_CUDA_PART <= 2
#define CGX_CUDA_PART(p) (JAX_CGX_CUDA_PART == (p))
#else
#error "JAX_CGX_CUDA_PART must be 0, 1 or 2"
#endif

namespace jax_cgx::cuda {
namespace detail {

template <class E>
cudaError_t launch_quantize_array(cudaStream_t stream, const RowLayout& l, const void* x,
                                  int64_t row_stride, const QuantOut& q) {
  const auto* px = static_cast<const typename E::Storage*>(x);
  if (groups_aligned16(x, l.rows, row_stride, l, sizeof(typename E::Storage))) {
    return launch_quantize(stream, l, ArrayInput<E, true>{px, row_stride}, NoOutput{}, q);
  }
  return launch_quantize(stream, l, ArrayInput<E, false>{px, row_stride}, NoOutput{}, q);
}

// Each instantiation in its part (the others only call it).
#if CGX_CUDA_PART(1)
template cudaError_t launch_quantize_array<BF16Type>(cudaStream_t, const RowLayout&, const void*, int64_t,
                                                     const QuantOut&);
template cudaError_t launch_quantize_array<F16Type>(cudaStream_t, const RowLayout&, const void*, int64_t,
                                                    const QuantOut&);
#else
extern template cudaError_t launch_quantize_array<BF16Type>(cudaStream_t, const RowLayout&, const void*, int64_t,
                                                            const QuantOut&);
extern template cudaError_t launch_quantize_array<F16Type>(cudaStream_t, const RowLayout&, const void*, int64_t,
                                                           const QuantOut&);
#endif

inline bool valid_type(FloatType t) {
  return t == FloatType::kF32 || t == FloatType::kBF16 || t == FloatType::kF16;
}

}  // namespace detail

#if CGX_CUDA_PART(0)
cudaError_t LaunchQuantize(cudaStream_t stream, const RowLayout& layout, FloatType x_type,
                           const void* x, int64_t x_row_stride, const uint32_t* seeds,
                           bool stochastic, uint8_t* payload, float* meta,
                           const ValidCounts& valid) {
  using namespace detail;
  if (layout.rows <= 0 || layout.elems <= 0) return cudaSuccess;
  if (stochastic && seeds == nullptr) return cudaErrorInvalidValue;
  const QuantOut q{payload, meta, seeds, stochastic, valid};
  switch (x_type) {
    case FloatType::kF32:
      return launch_quantize_array<F32Type>(stream, layout, x, x_row_stride, q);
    case FloatType::kBF16:
      return launch_quantize_array<BF16Type>(stream, layout, x, x_row_stride, q);
    case FloatType::kF16:
      return launch_quantize_array<F16Type>(stream, layout, x, x_row_stride, q);
  }
  return cudaErrorInvalidValue;
}
#endif

#if CGX_CUDA_PART(2)
namespace detail {

// ------------------------------------------------------------ decoding kernel

// dequantize_sum: one thread per element group.
CGX_HD void dequantize_sum_groups(const SumInput& src, const ArrayOutput& sink, const RowLayout& l) {
  const ThreadPos tp = thread_pos();
  const int64_t groups = groups_in(l.bucket);
  GroupCursor c = GroupCursor::start(tp.block * tp.block_threads + tp.thread,
                                     tp.grid_blocks * tp.block_threads, l.buckets, groups);
  for (; c.r < l.rows; c.advance(l.buckets, groups)) {
    const int cnt[1] = {group_count(bucket_len(l, c.k), c.g)};
    if (cnt[0] == 0) continue;  // padding group of a short last bucket
    float v[1][kGroup];
    src.load<1>(l, c.r, c.k, c.g, 0, cnt, v);
    sink.store(l, c.r, c.k * l.bucket + c.g * kGroup, cnt[0], v[0]);
  }
}

__global__ void __launch_bounds__(kThreads)
    dequantize_sum_kernel(SumInput src, ArrayOutput sink, RowLayout l) {
  dequantize_sum_groups(src, sink, l);
}

// ---------------------------------------------------------------- launchers

// The source and sink of the two summing launchers; 16-byte paths where aligned.
SumInput MakeSumInput(const RowLayout& layout, int64_t inputs, const uint8_t* payload,
                      const float* meta, FloatType addend_type, const void* addend) {
  return SumInput{payload, meta, inputs, addend, addend_type,
                  addend != nullptr && groups_aligned16(addend, layout.rows, layout.elems, layout,
                                                        FloatTypeBytes(addend_type))};
}

ArrayOutput MakeArrayOutput(const RowLayout& layout, FloatType out_type, void* out, float scale = 1.0f) {
  return ArrayOutput{out, out_type,
                     groups_aligned16(out, layout.rows, layout.elems, layout, FloatTypeBytes(out_type)), scale};
}

cudaError_t launch_dequantize_sum(cudaStream_t stream, const RowLayout& layout, int64_t inputs,
                                  const uint8_t* payload, const float* meta, FloatType addend_type,
                                  const void* addend, FloatType out_type, void* out, float out_scale) {
  if (layout.rows <= 0 || layout.elems <= 0) return cudaSuccess;
  if (!valid_type(out_type) || (addend != nullptr && !valid_type(addend_type))) {
    return cudaErrorInvalidValue;
  }
  const SumInput src = MakeSumInput(layout, inputs, payload, meta, addend_type, addend);
  const ArrayOutput sink = MakeArrayOutput(layout, out_type, out, out_scale);
  const int64_t groups = layout.rows * layout.buckets * groups_in(layout.bucket);
  dequantize_sum_kernel<<<loop_grid<&dequantize_sum_kernel>(groups, kThreads), kThreads, 0, stream>>>(src, sink,
                                                                                                      layout);
  return cudaGetLastError();
}

}  // namespace detail

cudaError_t LaunchDequantizeSum(cudaStream_t stream, const RowLayout& layout, int64_t inputs,
                                const uint8_t* payload, const float* meta, FloatType addend_type,
                                const void* addend, FloatType out_type, void* out) {
  return detail::launch_dequantize_sum(stream, layout, inputs, payload, meta, addend_type, addend, out_type, out,
                                       1.0f);
}

cudaError_t LaunchDequantize(cudaStream_t stream, const RowLayout& layout, const uint8_t* payload,
                             const float* meta, FloatType out_type, void* out, float out_scale) {
  return detail::launch_dequantize_sum(stream, layout, 1, payload, meta, FloatType::kF32, nullptr, out_type, out,
                                       out_scale);
}

cudaError_t LaunchDequantizeSumRequantize(cudaStream_t stream, const RowLayout& layout,
                                          int64_t inputs, const uint8_t* payload,
                                          const float* meta, FloatType addend_type,
                                          const void* addend, const uint32_t* seeds,
                                          bool stochastic, uint8_t* out_payload,
                                          float* out_meta, FloatType out_type, void* out,
                                          const ValidCounts& valid) {
  using namespace detail;
  if (layout.rows <= 0 || layout.elems <= 0) return cudaSuccess;
  if (!valid_type(out_type) || (addend != nullptr && !valid_type(addend_type))) {
    return cudaErrorInvalidValue;
  }
  if (stochastic && seeds == nullptr) return cudaErrorInvalidValue;
  const SumInput src = MakeSumInput(layout, inputs, payload, meta, addend_type, addend);
  const QuantOut q{out_payload, out_meta, seeds, stochastic, valid};
  if (out == nullptr) return launch_quantize(stream, layout, src, NoOutput{}, q);
  return launch_quantize(stream, layout, src, MakeArrayOutput(layout, out_type, out), q);
}
#endif  // CGX_CUDA_PART(2)

}  // namespace jax_cgx::cuda
