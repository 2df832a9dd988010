// XLA FFI handlers of the jax_cgx CUDA targets (see xla_ffi/README.md).
//
// Each handler validates its buffers and attributes, derives the row layout
// and enqueues the kernels of xla_ffi/cuda_kernels.h on XLA's stream. Checks and
// errors are those of xla_ffi/ffi_support.h: bad input is INVALID_ARGUMENT
// naming the buffer, a failed launch INTERNAL; nothing aborts and nothing
// waits for the GPU.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "xla_ffi/cuda_kernels.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_support.h"

namespace ffi = xla::ffi;

namespace jax_cgx::cuda {
namespace {

using ffi_support::CheckDequantizeOperands;
using ffi_support::CheckQuantizeOperands;
using ffi_support::CheckRequantizeOperands;
using ffi_support::CheckSumOperands;
using ffi_support::CodecRows;

ffi::Error CudaFailure(std::string_view target, cudaError_t err) {
  return ffi_support::Internal(
      target, std::string("CUDA kernel launch failed: ") + cudaGetErrorString(err));
}

template <typename T>
const T* In(const ffi::AnyBuffer& b) { return static_cast<const T*>(b.untyped_data()); }
template <typename T>
T* Out(ffi::Result<ffi::AnyBuffer>& b) { return static_cast<T*>(b->untyped_data()); }

ValidCounts Counts(const CodecRows& r) {
  ValidCounts counts{};
  counts.rows = r.valid;
  return counts;
}

// Each handler checks its operands with one call of xla_ffi/ffi_support.h (the CPU handlers make
// the same checks), then launches its kernel on the stream; an empty operand launches nothing.

// jax_cgx_quantize: x[R, n] float, seeds[R, 2] u32, valid[R|0] s32 ->
// payload[R, P] u8, meta[R, nb, 2] f32.
ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer seeds,
                        ffi::AnyBuffer valid, ffi::Result<ffi::AnyBuffer> payload,
                        ffi::Result<ffi::AnyBuffer> meta, int32_t bits, int64_t bucket_size,
                        bool stochastic) {
  constexpr std::string_view kTarget = "jax_cgx_quantize";
  CodecRows r;
  CGX_RETURN_IF_ERROR(
      CheckQuantizeOperands(kTarget, x, seeds, valid, *payload, *meta, bits, bucket_size, &r));
  if (r.rows == 0 || r.m == 0) return ffi::Error::Success();
  const RowLayout l = MakeRowLayout(r.rows, r.m, bucket_size, bits);
  const cudaError_t err = LaunchQuantize(stream, l, r.x_type, x.untyped_data(), r.n, In<uint32_t>(seeds),
                                         stochastic, Out<uint8_t>(payload), Out<float>(meta), Counts(r));
  if (err != cudaSuccess) return CudaFailure(kTarget, err);
  return ffi::Error::Success();
}

// jax_cgx_dequantize: payload[R, P] u8, meta[R, nb, 2] f32 -> out[R, m] float.
ffi::Error DequantizeImpl(cudaStream_t stream, ffi::AnyBuffer payload, ffi::AnyBuffer meta,
                          ffi::Result<ffi::AnyBuffer> out, int32_t bits, int64_t bucket_size, float scale) {
  constexpr std::string_view kTarget = "jax_cgx_dequantize";
  CodecRows r;
  CGX_RETURN_IF_ERROR(CheckDequantizeOperands(kTarget, payload, meta, *out, bits, bucket_size, scale, &r));
  if (r.rows == 0 || r.m == 0) return ffi::Error::Success();
  const RowLayout l = MakeRowLayout(r.rows, r.m, bucket_size, bits);
  const cudaError_t err = LaunchDequantize(stream, l, In<uint8_t>(payload), In<float>(meta), r.out_type,
                                           out->untyped_data(), scale);
  if (err != cudaSuccess) return CudaFailure(kTarget, err);
  return ffi::Error::Success();
}

// jax_cgx_dequantize_sum: payload[R, W, P], meta[R, W, nb, 2], addend[R, m|0] -> out[R, m].
ffi::Error DequantizeSumImpl(cudaStream_t stream, ffi::AnyBuffer payload, ffi::AnyBuffer meta,
                             ffi::AnyBuffer addend, ffi::Result<ffi::AnyBuffer> out, int32_t bits,
                             int64_t bucket_size) {
  constexpr std::string_view kTarget = "jax_cgx_dequantize_sum";
  CodecRows r;
  CGX_RETURN_IF_ERROR(CheckSumOperands(kTarget, payload, meta, addend, *out, bits, bucket_size, &r));
  if (r.rows == 0 || r.m == 0) return ffi::Error::Success();
  const RowLayout l = MakeRowLayout(r.rows, r.m, bucket_size, bits);
  const cudaError_t err = LaunchDequantizeSum(stream, l, r.inputs, In<uint8_t>(payload), In<float>(meta),
                                              r.addend_type, r.addend, r.out_type, out->untyped_data());
  if (err != cudaSuccess) return CudaFailure(kTarget, err);
  return ffi::Error::Success();
}

// jax_cgx_dequantize_sum_requantize: as dequantize_sum plus seeds[R, 2] and
// valid[R|0] -> payload[R, P], meta[R, nb, 2], out[R, m].
ffi::Error DequantizeSumRequantizeImpl(cudaStream_t stream, ffi::AnyBuffer payload,
                                       ffi::AnyBuffer meta, ffi::AnyBuffer addend,
                                       ffi::AnyBuffer seeds, ffi::AnyBuffer valid,
                                       ffi::Result<ffi::AnyBuffer> out_payload,
                                       ffi::Result<ffi::AnyBuffer> out_meta,
                                       ffi::Result<ffi::AnyBuffer> out, int32_t bits,
                                       int64_t bucket_size, bool stochastic) {
  constexpr std::string_view kTarget = "jax_cgx_dequantize_sum_requantize";
  CodecRows r;
  CGX_RETURN_IF_ERROR(CheckSumOperands(kTarget, payload, meta, addend, *out, bits, bucket_size, &r));
  CGX_RETURN_IF_ERROR(
      CheckRequantizeOperands(kTarget, seeds, valid, *out_payload, *out_meta, bits, bucket_size, &r));
  if (r.rows == 0 || r.m == 0) return ffi::Error::Success();
  const RowLayout l = MakeRowLayout(r.rows, r.m, bucket_size, bits);
  const cudaError_t err = LaunchDequantizeSumRequantize(
      stream, l, r.inputs, In<uint8_t>(payload), In<float>(meta), r.addend_type, r.addend,
      In<uint32_t>(seeds), stochastic, Out<uint8_t>(out_payload), Out<float>(out_meta), r.out_type,
      out->untyped_data(), Counts(r));
  if (err != cudaSuccess) return CudaFailure(kTarget, err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cgx::cuda

// Each target's signature is ffi_support.h's (the CPU handlers bind it too), after the stream.
namespace {
auto OnStream() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaQuantize, jax_cgx::cuda::QuantizeImpl,
                              jax_cgx::ffi_support::QuantizeSignature(OnStream()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaDequantize, jax_cgx::cuda::DequantizeImpl,
                              jax_cgx::ffi_support::DequantizeSignature(OnStream()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaDequantizeSum, jax_cgx::cuda::DequantizeSumImpl,
                              jax_cgx::ffi_support::DequantizeSumSignature(OnStream()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaDequantizeSumRequantize, jax_cgx::cuda::DequantizeSumRequantizeImpl,
                              jax_cgx::ffi_support::DequantizeSumRequantizeSignature(OnStream()));
