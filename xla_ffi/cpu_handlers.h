// XLA FFI handlers of the CPU targets (xla_ffi/cpu_handlers.cc), registered
// for platform "cpu" by jax_cgx._cpu (xla_ffi/cpu_module.cc). All bind the
// attributes bits (int32) and bucket_size (int64); the two that quantize
// (CpuQuantize, CpuDequantizeSumRequantize) also bind stochastic (bool).
#ifndef JAX_CGX_XLA_FFI_CPU_HANDLERS_H_
#define JAX_CGX_XLA_FFI_CPU_HANDLERS_H_

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* CpuQuantize(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CpuDequantize(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CpuDequantizeSum(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CpuDequantizeSumRequantize(XLA_FFI_CallFrame* call_frame);
// The tcp backend's all-reduce, started and awaited (xla_ffi/tcp_allreduce.cc).
XLA_FFI_Error* CpuTcpAllreduceStart(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CpuTcpAllreduceDone(XLA_FFI_CallFrame* call_frame);
}

#endif  // JAX_CGX_XLA_FFI_CPU_HANDLERS_H_
