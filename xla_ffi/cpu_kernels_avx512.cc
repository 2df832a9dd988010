// The CPU row kernels compiled for AVX-512 (cpu_kernel_table.h).
#include "xla_ffi/cpu_kernel_rows.h"

#if CGX_X86_VARIANTS
namespace jax_cgx::cpu {
// prefer-vector-width=512: otherwise GCC may stay with 256-bit vectors.
CGX_DEFINE_WIDTHS(avx512, 16,
                  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512"), flatten)))
}  // namespace jax_cgx::cpu
#endif
