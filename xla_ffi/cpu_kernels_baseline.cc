// The CPU row kernels compiled for baseline x86-64 (or the target's default ISA) (cpu_kernel_table.h).
#include "xla_ffi/cpu_kernel_rows.h"

namespace jax_cgx::cpu {
CGX_DEFINE_WIDTHS(baseline, 4, __attribute__((flatten)))
}  // namespace jax_cgx::cpu
