// XLA FFI handlers of the CPU targets (see xla_ffi/README.md): each validates
// its buffers and attributes with xla_ffi/ffi_support.h and calls the kernels
// of xla_ffi/cpu_kernels.h. Bad input is an INVALID_ARGUMENT error naming the
// buffer; nothing aborts.
#include "xla_ffi/cpu_handlers.h"

#include <cstdint>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_kernels.h"
#include "xla_ffi/ffi_support.h"

namespace {

namespace ffi = xla::ffi;
using jax_cgx::cpu::bucket_count;
using jax_cgx::cpu::FloatType;
using jax_cgx::cpu::payload_bytes;
using jax_cgx::ffi_support::CheckAddendShape;
using jax_cgx::ffi_support::CheckCodecAttrs;
using jax_cgx::ffi_support::CheckFloatRows;
using jax_cgx::ffi_support::CheckFloatType;
using jax_cgx::ffi_support::CheckOutScale;
using jax_cgx::ffi_support::CheckShape;
using jax_cgx::ffi_support::CheckValidShape;
using jax_cgx::ffi_support::Dims;
using jax_cgx::ffi_support::InvalidArgument;
using jax_cgx::ffi_support::ShapeString;

// meta [R, (W,) nb, 2] and payload [R, (W,) P] holding m elements per row
// (no W axis when inputs < 0).
ffi::Error CheckPacked(std::string_view target, const char* payload_name, Dims payload_dims,
                       const char* meta_name, Dims meta_dims, int64_t rows, int64_t inputs,
                       int64_t m, int64_t bucket_size, int32_t bits) {
  return jax_cgx::ffi_support::CheckPacked(target, payload_name, payload_dims, meta_name, meta_dims,
                                           rows, inputs, m, bucket_count(m, bucket_size),
                                           payload_bytes(m, bucket_size, bits), bucket_size, bits);
}

// valid: [R] counts or [0]; the data pointer or nullptr (every element valid).
ffi::Error ValidCounts(std::string_view target, const ffi::Buffer<ffi::S32>& valid, int64_t rows,
                       const int32_t** out) {
  bool per_row = false;
  CGX_RETURN_IF_ERROR(CheckValidShape(target, valid.dimensions(), rows, &per_row));
  *out = per_row ? valid.typed_data() : nullptr;
  return ffi::Error::Success();
}

ffi::Error QuantizeImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seeds, ffi::Buffer<ffi::S32> valid,
                        ffi::Result<ffi::Buffer<ffi::U8>> payload,
                        ffi::Result<ffi::Buffer<ffi::F32>> meta, int32_t bits, int64_t bucket_size,
                        bool stochastic) {
  constexpr std::string_view kTarget = "jax_cgx_quantize";
  CGX_RETURN_IF_ERROR(CheckCodecAttrs(kTarget, bits, bucket_size));
  FloatType xt;
  int64_t rows, n;
  CGX_RETURN_IF_ERROR(CheckFloatRows(kTarget, "x", x, "[R, n]", &xt, &rows, &n));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "seeds", seeds.dimensions(), {rows, 2}, "[R, 2]"));
  const int32_t* counts;
  CGX_RETURN_IF_ERROR(ValidCounts(kTarget, valid, rows, &counts));
  // meta's bucket count nb picks m = min(n, nb * B): all of x, or whole
  // buckets only (skipping an incomplete last one, or more).
  const Dims md = meta->dimensions();
  const int64_t max_nb = bucket_count(n, bucket_size);
  if (md.size() != 3 || md[0] != rows || md[2] != 2 || md[1] < 0 || md[1] > max_nb) {
    return InvalidArgument(kTarget, "meta has shape " + ShapeString(md) +
                                        ", expected [R, nb, 2] with R = " + std::to_string(rows) +
                                        " and nb <= ceil(n/B) = " + std::to_string(max_nb) +
                                        " (n = " + std::to_string(n) +
                                        ", bucket_size = " + std::to_string(bucket_size) + ")");
  }
  const int64_t m = md[1] == max_nb ? n : md[1] * bucket_size;  // nb < ceil(n/B): nb*B < n
  CGX_RETURN_IF_ERROR(CheckPacked(kTarget, "payload", payload->dimensions(), "meta", md, rows, -1,
                                  m, bucket_size, bits));
  jax_cgx::cpu::quantize(x.untyped_data(), xt, rows, n, m, seeds.typed_data(), counts, bits,
                         bucket_size, stochastic, payload->typed_data(), meta->typed_data());
  return ffi::Error::Success();
}

ffi::Error DequantizeImpl(ffi::Buffer<ffi::U8> payload, ffi::Buffer<ffi::F32> meta,
                          ffi::Result<ffi::AnyBuffer> out, int32_t bits, int64_t bucket_size, float scale) {
  constexpr std::string_view kTarget = "jax_cgx_dequantize";
  CGX_RETURN_IF_ERROR(CheckCodecAttrs(kTarget, bits, bucket_size));
  CGX_RETURN_IF_ERROR(CheckOutScale(kTarget, scale));
  FloatType ot;
  int64_t rows, m;
  CGX_RETURN_IF_ERROR(CheckFloatRows(kTarget, "out", *out, "[R, m]", &ot, &rows, &m));
  CGX_RETURN_IF_ERROR(CheckPacked(kTarget, "payload", payload.dimensions(), "meta",
                                  meta.dimensions(), rows, -1, m, bucket_size, bits));
  jax_cgx::cpu::dequantize(payload.typed_data(), meta.typed_data(), rows, m, bits, bucket_size,
                           out->untyped_data(), ot, scale);
  return ffi::Error::Success();
}

// Shared checks of the two reduce targets; fills rows, inputs, m, types.
struct ReduceShapes {
  int64_t rows, inputs, m;
  FloatType addend_type, out_type;
  bool has_addend;
};

ffi::Error CheckReduce(std::string_view target, const ffi::Buffer<ffi::U8>& payload,
                       const ffi::Buffer<ffi::F32>& meta, const ffi::AnyBuffer& addend,
                       const ffi::AnyBuffer& out, int32_t bits, int64_t bucket_size,
                       ReduceShapes* s) {
  CGX_RETURN_IF_ERROR(CheckCodecAttrs(target, bits, bucket_size));
  CGX_RETURN_IF_ERROR(CheckFloatRows(target, "out", out, "[R, m]", &s->out_type, &s->rows, &s->m));
  CGX_RETURN_IF_ERROR(CheckFloatType(target, "addend", addend.element_type(), &s->addend_type));
  CGX_RETURN_IF_ERROR(
      CheckShape(target, "payload", payload.dimensions(), {s->rows, -1, -1}, "rank 3 [R, W, P]"));
  s->inputs = payload.dimensions()[1];
  CGX_RETURN_IF_ERROR(CheckAddendShape(target, addend.dimensions(), s->rows, s->m, &s->has_addend));
  return CheckPacked(target, "payload", payload.dimensions(), "meta", meta.dimensions(), s->rows,
                     s->inputs, s->m, bucket_size, bits);
}

ffi::Error DequantizeSumImpl(ffi::Buffer<ffi::U8> payload, ffi::Buffer<ffi::F32> meta,
                             ffi::AnyBuffer addend, ffi::Result<ffi::AnyBuffer> out, int32_t bits,
                             int64_t bucket_size) {
  ReduceShapes s;
  CGX_RETURN_IF_ERROR(
      CheckReduce("jax_cgx_dequantize_sum", payload, meta, addend, *out, bits, bucket_size, &s));
  jax_cgx::cpu::dequantize_sum(payload.typed_data(), meta.typed_data(), s.rows, s.inputs, s.m,
                               bits, bucket_size, s.has_addend ? addend.untyped_data() : nullptr,
                               s.addend_type, out->untyped_data(), s.out_type);
  return ffi::Error::Success();
}

ffi::Error DequantizeSumRequantizeImpl(ffi::Buffer<ffi::U8> payload, ffi::Buffer<ffi::F32> meta,
                                       ffi::AnyBuffer addend, ffi::Buffer<ffi::U32> seeds,
                                       ffi::Buffer<ffi::S32> valid,
                                       ffi::Result<ffi::Buffer<ffi::U8>> payload_out,
                                       ffi::Result<ffi::Buffer<ffi::F32>> meta_out,
                                       ffi::Result<ffi::AnyBuffer> out, int32_t bits,
                                       int64_t bucket_size, bool stochastic) {
  constexpr std::string_view kTarget = "jax_cgx_dequantize_sum_requantize";
  ReduceShapes s;
  CGX_RETURN_IF_ERROR(CheckReduce(kTarget, payload, meta, addend, *out, bits, bucket_size, &s));
  CGX_RETURN_IF_ERROR(CheckShape(kTarget, "seeds", seeds.dimensions(), {s.rows, 2}, "[R, 2]"));
  const int32_t* counts;
  CGX_RETURN_IF_ERROR(ValidCounts(kTarget, valid, s.rows, &counts));
  CGX_RETURN_IF_ERROR(CheckPacked(kTarget, "payload result", payload_out->dimensions(),
                                  "meta result", meta_out->dimensions(), s.rows, -1, s.m,
                                  bucket_size, bits));
  jax_cgx::cpu::dequantize_sum_requantize(
      payload.typed_data(), meta.typed_data(), s.rows, s.inputs, s.m, bits, bucket_size,
      s.has_addend ? addend.untyped_data() : nullptr, s.addend_type, seeds.typed_data(), counts,
      stochastic, payload_out->typed_data(), meta_out->typed_data(), out->untyped_data(),
      s.out_type);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuQuantize, QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()           // x
                                  .Arg<ffi::Buffer<ffi::U32>>()    // seeds
                                  .Arg<ffi::Buffer<ffi::S32>>()    // valid
                                  .Ret<ffi::Buffer<ffi::U8>>()     // payload
                                  .Ret<ffi::Buffer<ffi::F32>>()    // meta
                                  .Attr<int32_t>("bits")
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<bool>("stochastic"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuDequantize, DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // payload
                                  .Arg<ffi::Buffer<ffi::F32>>()  // meta
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Attr<int32_t>("bits")
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<float>("scale"));  // 1, or 1/W for a mean

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuDequantizeSum, DequantizeSumImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // payload
                                  .Arg<ffi::Buffer<ffi::F32>>()  // meta
                                  .Arg<ffi::AnyBuffer>()         // addend
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Attr<int32_t>("bits")
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuDequantizeSumRequantize, DequantizeSumRequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // payload
                                  .Arg<ffi::Buffer<ffi::F32>>()  // meta
                                  .Arg<ffi::AnyBuffer>()         // addend
                                  .Arg<ffi::Buffer<ffi::U32>>()  // seeds
                                  .Arg<ffi::Buffer<ffi::S32>>()  // valid
                                  .Ret<ffi::Buffer<ffi::U8>>()   // payload
                                  .Ret<ffi::Buffer<ffi::F32>>()  // meta
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Attr<int32_t>("bits")
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<bool>("stochastic"));
