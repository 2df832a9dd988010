// XLA FFI handlers of the jax_cgx CUDA targets (see xla_ffi/README.md).
//
// Each handler validates its buffers and attributes, derives the row layout
// and enqueues the kernels of cuda/codec_kernels.cu on XLA's stream. Bad input
// is reported as INVALID_ARGUMENT naming the buffer, a failed launch as
// INTERNAL; nothing aborts and nothing waits for the GPU.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "cuda/codec_kernels.h"

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_cgx::cuda {
namespace {

// ------------------------------------------------------------- validation

std::string DimsString(const ffi::AnyBuffer& b) {
  std::string s = "[";
  const auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

ffi::Error Invalid(std::string_view target, const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string(target) + ": " + message);
}

ffi::Error CudaFailure(std::string_view target, cudaError_t err) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string(target) +
                                                   ": CUDA kernel launch failed: " +
                                                   cudaGetErrorString(err));
}

// Checks rank and that dims[i] == want[i] wherever want[i] >= 0.
ffi::Error CheckShape(std::string_view target, const char* name, const ffi::AnyBuffer& b,
                      std::initializer_list<int64_t> want, const char* meaning) {
  const auto dims = b.dimensions();
  bool ok = dims.size() == want.size();
  if (ok) {
    size_t i = 0;
    for (int64_t w : want) {
      if (w >= 0 && dims[i] != w) ok = false;
      ++i;
    }
  }
  if (!ok) {
    return Invalid(target, std::string(name) + " must have shape " + meaning + ", got " +
                               DimsString(b));
  }
  return ffi::Error::Success();
}

std::string DTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "s8";
    case ffi::DataType::S16: return "s16";
    case ffi::DataType::S32: return "s32";
    case ffi::DataType::S64: return "s64";
    case ffi::DataType::U8: return "u8";
    case ffi::DataType::U16: return "u16";
    case ffi::DataType::U32: return "u32";
    case ffi::DataType::U64: return "u64";
    case ffi::DataType::F16: return "f16";
    case ffi::DataType::F32: return "f32";
    case ffi::DataType::F64: return "f64";
    case ffi::DataType::BF16: return "bf16";
    default: return "dtype code " + std::to_string(static_cast<int>(t));
  }
}

ffi::Error CheckType(std::string_view target, const char* name, const ffi::AnyBuffer& b,
                     ffi::DataType want, const char* want_name) {
  if (b.element_type() != want) {
    return Invalid(target, std::string(name) + " must have dtype " + want_name + ", got " +
                               DTypeName(b.element_type()));
  }
  return ffi::Error::Success();
}

ffi::Error FloatTypeOf(std::string_view target, const char* name, const ffi::AnyBuffer& b,
                       FloatType* out) {
  switch (b.element_type()) {
    case ffi::DataType::F32:
      *out = FloatType::kF32;
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      *out = FloatType::kBF16;
      return ffi::Error::Success();
    case ffi::DataType::F16:
      *out = FloatType::kF16;
      return ffi::Error::Success();
    default:
      return Invalid(target, std::string(name) + " must have dtype f32, bf16 or f16, got " +
                                 DTypeName(b.element_type()));
  }
}

ffi::Error CheckAttrs(std::string_view target, int32_t bits, int64_t bucket_size) {
  if (bits < 1 || bits > 8) {
    return Invalid(target, "attribute bits must be in 1..8, got " + std::to_string(bits));
  }
  if (bucket_size < 1) {
    return Invalid(target, "attribute bucket_size must be >= 1, got " + std::to_string(bucket_size));
  }
  return ffi::Error::Success();
}

// Checks payload[..., P] and meta[..., nb, 2] against the layout of l.elems
// values per row (ranks and leading dimensions are checked by the caller).
ffi::Error CheckPacked(std::string_view target, const char* payload_name,
                       const ffi::AnyBuffer& payload, const char* meta_name,
                       const ffi::AnyBuffer& meta, const RowLayout& l, int64_t bucket_size) {
  const auto pd = payload.dimensions();
  const auto md = meta.dimensions();
  const std::string of = " per row for " + std::to_string(l.elems) + " values at bits=" +
                         std::to_string(l.bits) + ", bucket_size=" + std::to_string(bucket_size);
  if (pd[pd.size() - 1] != l.row_bytes) {
    return Invalid(target, std::string(payload_name) + " " + DimsString(payload) + " must have " +
                               std::to_string(l.row_bytes) + " bytes" + of);
  }
  if (md[md.size() - 2] != l.buckets) {
    return Invalid(target, std::string(meta_name) + " " + DimsString(meta) + " must have " +
                               std::to_string(l.buckets) + " buckets" + of);
  }
  return ffi::Error::Success();
}

#define CGX_RETURN_IF_ERROR(expr)            \
  do {                                       \
    ffi::Error _cgx_err = (expr);            \
    if (_cgx_err.failure()) return _cgx_err; \
  } while (0)

// ceil(a / b) for a >= 0, b >= 1, without overflow.
int64_t CeilDiv(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// valid: s32 [R] counts (each row's elements that set its buckets' ranges,
// see ValidCounts) or [0] (all of them).
ffi::Error ValidOperand(std::string_view target, const ffi::AnyBuffer& valid, int64_t rows,
                        ValidCounts* out) {
  CGX_RETURN_IF_ERROR(CheckType(target, "valid", valid, ffi::DataType::S32, "s32"));
  const auto dims = valid.dimensions();
  if (dims.size() != 1 || (dims[0] != rows && dims[0] != 0)) {
    return Invalid(target, "valid must have shape [R] (R = " + std::to_string(rows) +
                               ") or [0] (every element valid), got " + DimsString(valid));
  }
  *out = ValidCounts{};
  if (dims[0] != 0) out->rows = static_cast<const int32_t*>(valid.untyped_data());
  return ffi::Error::Success();
}

// --------------------------------------------------------------- handlers

// jax_cgx_quantize: x[R, n] float, seeds[R, 2] u32, valid[R|0] s32 ->
// payload[R, P] u8, meta[R, nb, 2] f32.
ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer seeds,
                        ffi::AnyBuffer valid, ffi::Result<ffi::AnyBuffer> payload, ffi::Result<ffi::AnyBuffer> meta,
                        int32_t bits, int64_t bucket_size, bool stochastic) {
  constexpr std::string_view kTarget = "jax_cgx_quantize";
  CGX_RETURN_IF_ERROR(CheckAttrs(kTarget, bits, bucket_size));
  FloatType x_type;
  CGX_RETURN_IF_ERROR(FloatTypeOf(kTarget, "x", x, &x_type));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "x", x, {-1, -1}, "[R, n]"));
  const int64_t rows = x.dimensions()[0];
  const int64_t n = x.dimensions()[1];
  CGX_RETURN_IF_ERROR(CheckType(kTarget, "seeds", seeds, ffi::DataType::U32, "u32"));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "seeds", seeds, {rows, 2}, "[R, 2] (R from x)"));
  ValidCounts counts;
  CGX_RETURN_IF_ERROR(ValidOperand(kTarget, valid, rows, &counts));
  CGX_RETURN_IF_ERROR(CheckType(kTarget, "payload", *payload, ffi::DataType::U8, "u8"));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "payload", *payload, {rows, -1}, "[R, P] (R from x)"));
  CGX_RETURN_IF_ERROR(CheckType(kTarget, "meta", *meta, ffi::DataType::F32, "f32"));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "meta", *meta, {rows, -1, 2}, "[R, nb, 2] (R from x)"));
  // meta's nb chooses m: all of x's n values (nb = ceil(n/B)), or only the
  // whole buckets (nb = floor(n/B), the incomplete last bucket skipped).
  const int64_t nb = meta->dimensions()[1];
  const int64_t nb_all = CeilDiv(n, bucket_size);
  const int64_t nb_whole = n / bucket_size;
  if (nb != nb_all && nb != nb_whole) {
    return Invalid(kTarget, "meta " + DimsString(*meta) + " must have " + std::to_string(nb_all) +
                                " buckets (all " + std::to_string(n) + " values) or " +
                                std::to_string(nb_whole) +
                                " (whole buckets only) per row at bucket_size=" +
                                std::to_string(bucket_size));
  }
  const int64_t m = nb == nb_all ? n : nb * bucket_size;
  const RowLayout l = MakeRowLayout(rows, m, bucket_size, bits);
  CGX_RETURN_IF_ERROR(CheckPacked(kTarget, "payload", *payload, "meta", *meta, l, bucket_size));
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
                          ffi::Result<ffi::AnyBuffer> out, int32_t bits, int64_t bucket_size) {
  constexpr std::string_view kTarget = "jax_cgx_dequantize";
  CGX_RETURN_IF_ERROR(CheckAttrs(kTarget, bits, bucket_size));
  FloatType out_type;
  CGX_RETURN_IF_ERROR(FloatTypeOf(kTarget, "out", *out, &out_type));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "out", *out, {-1, -1}, "[R, m]"));
  const int64_t rows = out->dimensions()[0];
  const int64_t m = out->dimensions()[1];
  CGX_RETURN_IF_ERROR(CheckType(kTarget, "payload", payload, ffi::DataType::U8, "u8"));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "payload", payload, {rows, -1}, "[R, P] (R from out)"));
  CGX_RETURN_IF_ERROR(CheckType(kTarget, "meta", meta, ffi::DataType::F32, "f32"));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "meta", meta, {rows, -1, 2}, "[R, nb, 2] (R from out)"));
  const RowLayout l = MakeRowLayout(rows, m, bucket_size, bits);
  CGX_RETURN_IF_ERROR(CheckPacked(kTarget, "payload", payload, "meta", meta, l, bucket_size));
  if (rows == 0 || m == 0) return ffi::Error::Success();
  const cudaError_t err =
      LaunchDequantize(stream, l, static_cast<const uint8_t*>(payload.untyped_data()),
                       static_cast<const float*>(meta.untyped_data()), out_type, out->untyped_data());
  if (err != cudaSuccess) return CudaFailure(kTarget, err);
  return ffi::Error::Success();
}

// Shared validation of the reduce targets' operands: payload[R, W, P],
// meta[R, W, nb, 2], addend[R, m] or [R, 0]; R and m come from `out`.
struct SumOperands {
  RowLayout layout;
  int64_t inputs = 0;
  const void* addend = nullptr;
  FloatType addend_type = FloatType::kF32;
};

ffi::Error CheckSumOperands(std::string_view target, const ffi::AnyBuffer& payload,
                            const ffi::AnyBuffer& meta, const ffi::AnyBuffer& addend,
                            int64_t rows, int64_t m, int32_t bits, int64_t bucket_size,
                            SumOperands* ops) {
  CGX_RETURN_IF_ERROR(CheckType(target, "payload", payload, ffi::DataType::U8, "u8"));
  CGX_RETURN_IF_ERROR(CheckShape(target, "payload", payload, {rows, -1, -1}, "[R, W, P] (R from out)"));
  const int64_t inputs = payload.dimensions()[1];
  CGX_RETURN_IF_ERROR(CheckType(target, "meta", meta, ffi::DataType::F32, "f32"));
  CGX_RETURN_IF_ERROR(
      CheckShape(target, "meta", meta, {rows, inputs, -1, 2}, "[R, W, nb, 2] (R from out, W from payload)"));
  FloatType addend_type;
  CGX_RETURN_IF_ERROR(FloatTypeOf(target, "addend", addend, &addend_type));
  CGX_RETURN_IF_ERROR(CheckShape(target, "addend", addend, {rows, -1}, "[R, m] or [R, 0] (R from out)"));
  const int64_t addend_len = addend.dimensions()[1];
  if (addend_len != m && addend_len != 0) {
    return Invalid(target, "addend " + DimsString(addend) + " must have " + std::to_string(m) +
                               " (present) or 0 (absent) values per row, like out");
  }
  ops->layout = MakeRowLayout(rows, m, bucket_size, bits);
  CGX_RETURN_IF_ERROR(CheckPacked(target, "payload", payload, "meta", meta, ops->layout, bucket_size));
  ops->inputs = inputs;
  ops->addend = addend_len == m && m > 0 ? addend.untyped_data() : nullptr;
  ops->addend_type = addend_type;
  return ffi::Error::Success();
}

// jax_cgx_dequantize_sum: payload[R, W, P], meta[R, W, nb, 2], addend[R, m|0] -> out[R, m].
ffi::Error DequantizeSumImpl(cudaStream_t stream, ffi::AnyBuffer payload, ffi::AnyBuffer meta,
                             ffi::AnyBuffer addend, ffi::Result<ffi::AnyBuffer> out, int32_t bits,
                             int64_t bucket_size) {
  constexpr std::string_view kTarget = "jax_cgx_dequantize_sum";
  CGX_RETURN_IF_ERROR(CheckAttrs(kTarget, bits, bucket_size));
  FloatType out_type;
  CGX_RETURN_IF_ERROR(FloatTypeOf(kTarget, "out", *out, &out_type));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "out", *out, {-1, -1}, "[R, m]"));
  const int64_t rows = out->dimensions()[0];
  const int64_t m = out->dimensions()[1];
  SumOperands ops;
  CGX_RETURN_IF_ERROR(
      CheckSumOperands(kTarget, payload, meta, addend, rows, m, bits, bucket_size, &ops));
  if (rows == 0 || m == 0) return ffi::Error::Success();
  const cudaError_t err = LaunchDequantizeSum(
      stream, ops.layout, ops.inputs, static_cast<const uint8_t*>(payload.untyped_data()),
      static_cast<const float*>(meta.untyped_data()), ops.addend_type, ops.addend, out_type,
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
  CGX_RETURN_IF_ERROR(CheckAttrs(kTarget, bits, bucket_size));
  FloatType out_type;
  CGX_RETURN_IF_ERROR(FloatTypeOf(kTarget, "out", *out, &out_type));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "out", *out, {-1, -1}, "[R, m]"));
  const int64_t rows = out->dimensions()[0];
  const int64_t m = out->dimensions()[1];
  SumOperands ops;
  CGX_RETURN_IF_ERROR(
      CheckSumOperands(kTarget, payload, meta, addend, rows, m, bits, bucket_size, &ops));
  CGX_RETURN_IF_ERROR(CheckType(kTarget, "seeds", seeds, ffi::DataType::U32, "u32"));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "seeds", seeds, {rows, 2}, "[R, 2] (R from out)"));
  ValidCounts counts;
  CGX_RETURN_IF_ERROR(ValidOperand(kTarget, valid, rows, &counts));
  CGX_RETURN_IF_ERROR(CheckType(kTarget, "result payload", *out_payload, ffi::DataType::U8, "u8"));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "result payload", *out_payload, {rows, ops.layout.row_bytes},
                                 "[R, P] like the input payload rows"));
  CGX_RETURN_IF_ERROR(CheckType(kTarget, "result meta", *out_meta, ffi::DataType::F32, "f32"));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "result meta", *out_meta, {rows, ops.layout.buckets, 2},
                                 "[R, nb, 2] like the input meta rows"));
  if (rows == 0 || m == 0) return ffi::Error::Success();
  const cudaError_t err = LaunchDequantizeSumRequantize(
      stream, ops.layout, ops.inputs, static_cast<const uint8_t*>(payload.untyped_data()),
      static_cast<const float*>(meta.untyped_data()), ops.addend_type, ops.addend,
      static_cast<const uint32_t*>(seeds.untyped_data()), stochastic,
      static_cast<uint8_t*>(out_payload->untyped_data()),
      static_cast<float*>(out_meta->untyped_data()), out_type, out->untyped_data(), counts);
  if (err != cudaSuccess) return CudaFailure(kTarget, err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_cgx::cuda

// Attributes as jax_cgx/_ffi.py passes them: bits and bucket_size everywhere,
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
                                  .Attr<int64_t>("bucket_size"));

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
