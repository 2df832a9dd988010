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

using ffi_support::CheckAddendShape;
using ffi_support::CheckCodecAttrs;
using ffi_support::CheckOutScale;
using ffi_support::CheckDType;
using ffi_support::CheckFloatRows;
using ffi_support::CheckFloatType;
using ffi_support::CheckShape;
using ffi_support::CheckValidShape;
using ffi_support::InvalidArgument;
using ffi_support::ShapeString;

// ------------------------------------------------------------- validation

ffi::Error CudaFailure(std::string_view target, cudaError_t err) {
  return ffi_support::Internal(
      target, std::string("CUDA kernel launch failed: ") + cudaGetErrorString(err));
}

// payload[R, (W,) P] and meta[R, (W,) nb, 2] against the layout l of each
// row (no W axis when inputs < 0).
ffi::Error CheckPacked(std::string_view target, const char* payload_name,
                       const ffi::AnyBuffer& payload, const char* meta_name,
                       const ffi::AnyBuffer& meta, int64_t inputs, const RowLayout& l,
                       int64_t bucket_size) {
  return ffi_support::CheckPacked(target, payload_name, payload.dimensions(), meta_name,
                                  meta.dimensions(), l.rows, inputs, l.elems, l.buckets,
                                  l.row_bytes, bucket_size, l.bits);
}

// ceil(a / b) for a >= 0, b >= 1, without overflow.
int64_t CeilDiv(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// valid: s32 [R] counts (each row's elements that set its buckets' ranges,
// see ValidCounts) or [0] (all of them).
ffi::Error ValidOperand(std::string_view target, const ffi::AnyBuffer& valid, int64_t rows,
                        ValidCounts* out) {
  CGX_RETURN_IF_ERROR(CheckDType(target, "valid", valid.element_type(), ffi::DataType::S32));
  bool per_row = false;
  CGX_RETURN_IF_ERROR(CheckValidShape(target, valid.dimensions(), rows, &per_row));
  *out = ValidCounts{};
  if (per_row) out->rows = static_cast<const int32_t*>(valid.untyped_data());
  return ffi::Error::Success();
}

// --------------------------------------------------------------- handlers

// jax_cgx_quantize: x[R, n] float, seeds[R, 2] u32, valid[R|0] s32 ->
// payload[R, P] u8, meta[R, nb, 2] f32.
ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer seeds,
                        ffi::AnyBuffer valid, ffi::Result<ffi::AnyBuffer> payload,
                        ffi::Result<ffi::AnyBuffer> meta, int32_t bits, int64_t bucket_size,
                        bool stochastic) {
  constexpr std::string_view kTarget = "jax_cgx_quantize";
  CGX_RETURN_IF_ERROR(CheckCodecAttrs(kTarget, bits, bucket_size));
  FloatType x_type;
  int64_t rows, n;
  CGX_RETURN_IF_ERROR(CheckFloatRows(kTarget, "x", x, "[R, n]", &x_type, &rows, &n));
  CGX_RETURN_IF_ERROR(CheckDType(kTarget, "seeds", seeds.element_type(), ffi::DataType::U32));
  CGX_RETURN_IF_ERROR(
      CheckShape(kTarget, "seeds", seeds.dimensions(), {rows, 2}, "[R, 2] (R from x)"));
  ValidCounts counts;
  CGX_RETURN_IF_ERROR(ValidOperand(kTarget, valid, rows, &counts));
  CGX_RETURN_IF_ERROR(CheckDType(kTarget, "payload", payload->element_type(), ffi::DataType::U8));
  CGX_RETURN_IF_ERROR(CheckDType(kTarget, "meta", meta->element_type(), ffi::DataType::F32));
  CGX_RETURN_IF_ERROR(
      CheckShape(kTarget, "meta", meta->dimensions(), {rows, -1, 2}, "[R, nb, 2] (R from x)"));
  // meta's nb chooses m: all of x's n values (nb = ceil(n/B)), or only the
  // whole buckets (nb = floor(n/B), the incomplete last bucket skipped).
  const int64_t nb = meta->dimensions()[1];
  const int64_t nb_all = CeilDiv(n, bucket_size);
  const int64_t nb_whole = n / bucket_size;
  if (nb != nb_all && nb != nb_whole) {
    return InvalidArgument(kTarget, "meta has shape " + ShapeString(meta->dimensions()) +
                                        ", expected [R, nb, 2] with nb = " +
                                        std::to_string(nb_all) + " (all " + std::to_string(n) +
                                        " values) or " + std::to_string(nb_whole) +
                                        " (whole buckets only) at bucket_size = " +
                                        std::to_string(bucket_size));
  }
  const int64_t m = nb == nb_all ? n : nb * bucket_size;
  const RowLayout l = MakeRowLayout(rows, m, bucket_size, bits);
  CGX_RETURN_IF_ERROR(
      CheckPacked(kTarget, "payload", *payload, "meta", *meta, -1, l, bucket_size));
  if (rows == 0 || m == 0) return ffi::Error::Success();
  const cudaError_t err = LaunchQuantize(
      stream, l, x_type, x.untyped_data(), n, static_cast<const uint32_t*>(seeds.untyped_data()),
      stochastic, static_cast<uint8_t*>(payload->untyped_data()),
      static_cast<float*>(meta->untyped_data()), counts);
  if (err != cudaSuccess) return CudaFailure(kTarget, err);
  return ffi::Error::Success();
}

// jax_cgx_dequantize: payload[R, P] u8, meta[R, nb, 2] f32 -> out[R, m] float.
ffi::Error DequantizeImpl(cudaStream_t stream, ffi::AnyBuffer payload, ffi::AnyBuffer meta,
                          ffi::Result<ffi::AnyBuffer> out, int32_t bits, int64_t bucket_size, float scale) {
  constexpr std::string_view kTarget = "jax_cgx_dequantize";
  CGX_RETURN_IF_ERROR(CheckCodecAttrs(kTarget, bits, bucket_size));
  CGX_RETURN_IF_ERROR(CheckOutScale(kTarget, scale));
  FloatType out_type;
  int64_t rows, m;
  CGX_RETURN_IF_ERROR(CheckFloatRows(kTarget, "out", *out, "[R, m]", &out_type, &rows, &m));
  CGX_RETURN_IF_ERROR(CheckDType(kTarget, "payload", payload.element_type(), ffi::DataType::U8));
  CGX_RETURN_IF_ERROR(CheckDType(kTarget, "meta", meta.element_type(), ffi::DataType::F32));
  const RowLayout l = MakeRowLayout(rows, m, bucket_size, bits);
  CGX_RETURN_IF_ERROR(CheckPacked(kTarget, "payload", payload, "meta", meta, -1, l, bucket_size));
  if (rows == 0 || m == 0) return ffi::Error::Success();
  const cudaError_t err =
      LaunchDequantize(stream, l, static_cast<const uint8_t*>(payload.untyped_data()),
                       static_cast<const float*>(meta.untyped_data()), out_type,
                       out->untyped_data(), scale);
  if (err != cudaSuccess) return CudaFailure(kTarget, err);
  return ffi::Error::Success();
}

// Shared validation of the reduce targets: attributes, out[R, m] float,
// payload[R, W, P], meta[R, W, nb, 2], addend[R, m] or [R, 0].
struct SumOperands {
  RowLayout layout;  // R = layout.rows, m = layout.elems
  int64_t inputs = 0;
  const void* addend = nullptr;
  FloatType addend_type = FloatType::kF32;
  FloatType out_type = FloatType::kF32;
};

ffi::Error CheckSumOperands(std::string_view target, const ffi::AnyBuffer& payload,
                            const ffi::AnyBuffer& meta, const ffi::AnyBuffer& addend,
                            const ffi::AnyBuffer& out, int32_t bits, int64_t bucket_size,
                            SumOperands* ops) {
  CGX_RETURN_IF_ERROR(CheckCodecAttrs(target, bits, bucket_size));
  int64_t rows, m;
  CGX_RETURN_IF_ERROR(CheckFloatRows(target, "out", out, "[R, m]", &ops->out_type, &rows, &m));
  CGX_RETURN_IF_ERROR(CheckDType(target, "payload", payload.element_type(), ffi::DataType::U8));
  CGX_RETURN_IF_ERROR(
      CheckShape(target, "payload", payload.dimensions(), {rows, -1, -1}, "rank 3 [R, W, P]"));
  const int64_t inputs = payload.dimensions()[1];
  CGX_RETURN_IF_ERROR(CheckDType(target, "meta", meta.element_type(), ffi::DataType::F32));
  CGX_RETURN_IF_ERROR(
      CheckShape(target, "meta", meta.dimensions(), {rows, inputs, -1, 2}, "rank 4 [R, W, nb, 2]"));
  FloatType addend_type;
  CGX_RETURN_IF_ERROR(CheckFloatType(target, "addend", addend.element_type(), &addend_type));
  bool has_addend = false;
  CGX_RETURN_IF_ERROR(CheckAddendShape(target, addend.dimensions(), rows, m, &has_addend));
  ops->layout = MakeRowLayout(rows, m, bucket_size, bits);
  CGX_RETURN_IF_ERROR(
      CheckPacked(target, "payload", payload, "meta", meta, inputs, ops->layout, bucket_size));
  ops->inputs = inputs;
  ops->addend = has_addend && m > 0 ? addend.untyped_data() : nullptr;
  ops->addend_type = addend_type;
  return ffi::Error::Success();
}

// jax_cgx_dequantize_sum: payload[R, W, P], meta[R, W, nb, 2], addend[R, m|0] -> out[R, m].
ffi::Error DequantizeSumImpl(cudaStream_t stream, ffi::AnyBuffer payload, ffi::AnyBuffer meta,
                             ffi::AnyBuffer addend, ffi::Result<ffi::AnyBuffer> out, int32_t bits,
                             int64_t bucket_size) {
  constexpr std::string_view kTarget = "jax_cgx_dequantize_sum";
  SumOperands ops;
  CGX_RETURN_IF_ERROR(
      CheckSumOperands(kTarget, payload, meta, addend, *out, bits, bucket_size, &ops));
  if (ops.layout.rows == 0 || ops.layout.elems == 0) return ffi::Error::Success();
  const cudaError_t err = LaunchDequantizeSum(
      stream, ops.layout, ops.inputs, static_cast<const uint8_t*>(payload.untyped_data()),
      static_cast<const float*>(meta.untyped_data()), ops.addend_type, ops.addend, ops.out_type,
      out->untyped_data());
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
  SumOperands ops;
  CGX_RETURN_IF_ERROR(
      CheckSumOperands(kTarget, payload, meta, addend, *out, bits, bucket_size, &ops));
  const int64_t rows = ops.layout.rows;
  const int64_t m = ops.layout.elems;
  CGX_RETURN_IF_ERROR(CheckDType(kTarget, "seeds", seeds.element_type(), ffi::DataType::U32));
  CGX_RETURN_IF_ERROR(
      CheckShape(kTarget, "seeds", seeds.dimensions(), {rows, 2}, "[R, 2] (R from out)"));
  ValidCounts counts;
  CGX_RETURN_IF_ERROR(ValidOperand(kTarget, valid, rows, &counts));
  CGX_RETURN_IF_ERROR(
      CheckDType(kTarget, "result payload", out_payload->element_type(), ffi::DataType::U8));
  CGX_RETURN_IF_ERROR(
      CheckDType(kTarget, "result meta", out_meta->element_type(), ffi::DataType::F32));
  CGX_RETURN_IF_ERROR(CheckPacked(kTarget, "result payload", *out_payload, "result meta", *out_meta,
                                  -1, ops.layout, bucket_size));
  if (rows == 0 || m == 0) return ffi::Error::Success();
  const cudaError_t err = LaunchDequantizeSumRequantize(
      stream, ops.layout, ops.inputs, static_cast<const uint8_t*>(payload.untyped_data()),
      static_cast<const float*>(meta.untyped_data()), ops.addend_type, ops.addend,
      static_cast<const uint32_t*>(seeds.untyped_data()), stochastic,
      static_cast<uint8_t*>(out_payload->untyped_data()),
      static_cast<float*>(out_meta->untyped_data()), ops.out_type, out->untyped_data(), counts);
  if (err != cudaSuccess) return CudaFailure(kTarget, err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cgx::cuda

// Attributes as jax_cgx/_src/codec/kernels.py passes them: bits and bucket_size everywhere,
// stochastic only for the two quantizing targets (XLA rejects extra or missing
// attributes).
XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaQuantize, jax_cgx::cuda::QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // seeds
                                  .Arg<ffi::AnyBuffer>()  // valid
                                  .Ret<ffi::AnyBuffer>()  // payload
                                  .Ret<ffi::AnyBuffer>()  // meta
                                  .Attr<int32_t>("bits")
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<bool>("stochastic"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaDequantize, jax_cgx::cuda::DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // payload
                                  .Arg<ffi::AnyBuffer>()  // meta
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Attr<int32_t>("bits")
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<float>("scale"));  // 1, or 1/W for a mean

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaDequantizeSum, jax_cgx::cuda::DequantizeSumImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // payload
                                  .Arg<ffi::AnyBuffer>()  // meta
                                  .Arg<ffi::AnyBuffer>()  // addend
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Attr<int32_t>("bits")
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaDequantizeSumRequantize,
                              jax_cgx::cuda::DequantizeSumRequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // payload
                                  .Arg<ffi::AnyBuffer>()  // meta
                                  .Arg<ffi::AnyBuffer>()  // addend
                                  .Arg<ffi::AnyBuffer>()  // seeds
                                  .Arg<ffi::AnyBuffer>()  // valid
                                  .Ret<ffi::AnyBuffer>()  // payload
                                  .Ret<ffi::AnyBuffer>()  // meta
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Attr<int32_t>("bits")
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<bool>("stochastic"));
