// XLA FFI handlers of the CPU targets (see xla_ffi/README.md): each checks its
// operands with one call of xla_ffi/ffi_support.h (the checks the CUDA handlers
// make too) and calls the kernels of xla_ffi/cpu_kernels.h. Bad input is an
// INVALID_ARGUMENT error naming the buffer; nothing aborts.
#include "xla_ffi/cpu_handlers.h"

#include <cstdint>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_kernels.h"
#include "xla_ffi/ffi_support.h"

namespace {

namespace ffi = xla::ffi;
using jax_cgx::ffi_support::CheckDequantizeOperands;
using jax_cgx::ffi_support::CheckQuantizeOperands;
using jax_cgx::ffi_support::CheckRequantizeOperands;
using jax_cgx::ffi_support::CheckSumOperands;
using jax_cgx::ffi_support::CodecRows;

template <typename T>
const T* In(const ffi::AnyBuffer& b) { return static_cast<const T*>(b.untyped_data()); }
template <typename T>
T* Out(ffi::Result<ffi::AnyBuffer>& b) { return static_cast<T*>(b->untyped_data()); }

ffi::Error QuantizeImpl(ffi::AnyBuffer x, ffi::AnyBuffer seeds, ffi::AnyBuffer valid,
                        ffi::Result<ffi::AnyBuffer> payload, ffi::Result<ffi::AnyBuffer> meta, int32_t bits,
                        int64_t bucket_size, bool stochastic) {
  CodecRows r;
  CGX_RETURN_IF_ERROR(
      CheckQuantizeOperands("jax_cgx_quantize", x, seeds, valid, *payload, *meta, bits, bucket_size, &r));
  jax_cgx::cpu::quantize(x.untyped_data(), r.x_type, r.rows, r.n, r.m, In<uint32_t>(seeds), r.valid, bits,
                         bucket_size, stochastic, Out<uint8_t>(payload), Out<float>(meta));
  return ffi::Error::Success();
}

ffi::Error DequantizeImpl(ffi::AnyBuffer payload, ffi::AnyBuffer meta, ffi::Result<ffi::AnyBuffer> out,
                          int32_t bits, int64_t bucket_size, float scale) {
  CodecRows r;
  CGX_RETURN_IF_ERROR(
      CheckDequantizeOperands("jax_cgx_dequantize", payload, meta, *out, bits, bucket_size, scale, &r));
  jax_cgx::cpu::dequantize(In<uint8_t>(payload), In<float>(meta), r.rows, r.m, bits, bucket_size,
                           out->untyped_data(), r.out_type, scale);
  return ffi::Error::Success();
}

ffi::Error DequantizeSumImpl(ffi::AnyBuffer payload, ffi::AnyBuffer meta, ffi::AnyBuffer addend,
                             ffi::Result<ffi::AnyBuffer> out, int32_t bits, int64_t bucket_size) {
  CodecRows r;
  CGX_RETURN_IF_ERROR(
      CheckSumOperands("jax_cgx_dequantize_sum", payload, meta, addend, *out, bits, bucket_size, &r));
  jax_cgx::cpu::dequantize_sum(In<uint8_t>(payload), In<float>(meta), r.rows, r.inputs, r.m, bits, bucket_size,
                               r.addend, r.addend_type, out->untyped_data(), r.out_type);
  return ffi::Error::Success();
}

ffi::Error DequantizeSumRequantizeImpl(ffi::AnyBuffer payload, ffi::AnyBuffer meta, ffi::AnyBuffer addend,
                                       ffi::AnyBuffer seeds, ffi::AnyBuffer valid,
                                       ffi::Result<ffi::AnyBuffer> payload_out,
                                       ffi::Result<ffi::AnyBuffer> meta_out, ffi::Result<ffi::AnyBuffer> out,
                                       int32_t bits, int64_t bucket_size, bool stochastic) {
  constexpr std::string_view kTarget = "jax_cgx_dequantize_sum_requantize";
  CodecRows r;
  CGX_RETURN_IF_ERROR(CheckSumOperands(kTarget, payload, meta, addend, *out, bits, bucket_size, &r));
  CGX_RETURN_IF_ERROR(
      CheckRequantizeOperands(kTarget, seeds, valid, *payload_out, *meta_out, bits, bucket_size, &r));
  jax_cgx::cpu::dequantize_sum_requantize(In<uint8_t>(payload), In<float>(meta), r.rows, r.inputs, r.m, bits,
                                          bucket_size, r.addend, r.addend_type, In<uint32_t>(seeds), r.valid,
                                          stochastic, Out<uint8_t>(payload_out), Out<float>(meta_out),
                                          out->untyped_data(), r.out_type);
  return ffi::Error::Success();
}

}  // namespace

// Each target's signature is ffi_support.h's, which the CUDA handlers bind too.
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuQuantize, QuantizeImpl, jax_cgx::ffi_support::QuantizeSignature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuDequantize, DequantizeImpl,
                              jax_cgx::ffi_support::DequantizeSignature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuDequantizeSum, DequantizeSumImpl,
                              jax_cgx::ffi_support::DequantizeSumSignature(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuDequantizeSumRequantize, DequantizeSumRequantizeImpl,
                              jax_cgx::ffi_support::DequantizeSumRequantizeSignature(ffi::Ffi::Bind()));
