// Python module jax_cgx._cuda: exports the CUDA FFI handlers as capsules, keyed
// by target name, for jax.ffi.register_ffi_target(..., platform="CUDA").
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

// Defined by XLA_FFI_DEFINE_HANDLER_SYMBOL in xla_ffi/cuda_handlers.cc.
extern "C" {
XLA_FFI_Error* CudaQuantize(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CudaDequantize(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CudaDequantizeSum(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CudaDequantizeSumRequantize(XLA_FFI_CallFrame* call_frame);
}

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_cuda, m) {
  m.doc() = "jax_cgx CUDA kernels (XLA FFI handlers)";
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_cgx_quantize"] = Capsule(CudaQuantize);
    targets["jax_cgx_dequantize"] = Capsule(CudaDequantize);
    targets["jax_cgx_dequantize_sum"] = Capsule(CudaDequantizeSum);
    targets["jax_cgx_dequantize_sum_requantize"] = Capsule(CudaDequantizeSumRequantize);
    return targets;
  });
}
