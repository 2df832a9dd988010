// Python module jax_cgx._cpu: exports the CPU FFI handlers as capsules for
// jax.ffi.register_ffi_target(name, capsule, platform="cpu").
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "xla_ffi/cpu_handlers.h"
#include "xla_ffi/cpu_kernels.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule handler_capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_cpu, m) {
  m.doc() = "jax_cgx CPU kernels (XLA FFI handlers for platform 'cpu').";

  m.def(
      "registrations",
      []() {
        nb::dict d;
        d["jax_cgx_quantize"] = handler_capsule(CpuQuantize);
        d["jax_cgx_dequantize"] = handler_capsule(CpuDequantize);
        d["jax_cgx_dequantize_sum"] = handler_capsule(CpuDequantizeSum);
        d["jax_cgx_dequantize_sum_requantize"] = handler_capsule(CpuDequantizeSumRequantize);
        return d;
      },
      "Target name -> FFI handler capsule, for jax.ffi.register_ffi_target(..., platform='cpu').");

  m.def(
      "kernel_info",
      []() {
        namespace cpu = jax_cgx::cpu;
        nb::dict d;
        d["isa"] = std::string(cpu::active_isa());
        nb::list supported;
        for (const char* name : {"avx512", "avx2", "baseline"}) {
          if (cpu::isa_supported(name)) supported.append(std::string(name));
        }
        d["isa_supported"] = supported;
        d["piece_elements"] = cpu::piece_elements();
        d["threads"] = 1;  // kernels run on the calling thread
        d["compiler"] = std::string(__VERSION__);
        return d;
      },
      "Facts about the CPU kernels for benchmark logs: the active ISA variant ('avx512', 'avx2' "
      "or 'baseline'), the variants this CPU supports, and build details.");

  m.def(
      "set_isa",
      [](const std::string& name) { return jax_cgx::cpu::set_isa(name.c_str()); },
      nb::arg("name"),
      "Selects the kernel variant ('auto', 'avx512', 'avx2', 'baseline') for this process; "
      "returns False if the name is unknown or the CPU lacks it. For tests and benchmarks "
      "(the environment variable JAX_CGX_CPU_ISA sets the initial choice).");
}
