// The CPU row kernels compiled for AVX2 (cpu_kernel_table.h).
#include "xla_ffi/cpu_kernel_rows.h"

#if CGX_X86_VARIANTS
namespace jax_cgx::cpu {
CGX_DEFINE_WIDTHS(avx2, 8, __attribute__((target("avx2"), flatten)))
}  // namespace jax_cgx::cpu
#endif
