// Element types of the codec's float buffers (x, addend, out), shared by the
// CPU kernels (xla_ffi/cpu_kernels.h), the CUDA kernels (xla_ffi/cuda_kernels.h)
// and the FFI handlers, which map XLA's dtypes onto it in one place
// (ToFloatType in xla_ffi/ffi_support.h). Plain C++: nvcc includes it too.
#ifndef JAX_CGX_XLA_FFI_FLOAT_TYPE_H_
#define JAX_CGX_XLA_FFI_FLOAT_TYPE_H_

#include <cstdint>

namespace jax_cgx {

enum class FloatType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Bytes of one element.
inline int64_t FloatTypeBytes(FloatType t) { return t == FloatType::kF32 ? 4 : 2; }

// Element i of a buffer of type t.
inline const void* element_ptr(const void* base, FloatType t, int64_t i) {
  return static_cast<const char*>(base) + i * FloatTypeBytes(t);
}
inline void* element_ptr(void* base, FloatType t, int64_t i) {
  return static_cast<char*>(base) + i * FloatTypeBytes(t);
}

}  // namespace jax_cgx

#endif  // JAX_CGX_XLA_FFI_FLOAT_TYPE_H_
