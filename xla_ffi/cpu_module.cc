// Python module jax_cgx._cpu: exports the CPU FFI handlers as capsules for
// jax.ffi.register_ffi_target(name, capsule, platform="cpu").
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "xla_ffi/cpu_handlers.h"
#include "xla_ffi/ffi_support.h"
#include "xla_ffi/cpu_kernels.h"
#include "xla_ffi/tcp_allreduce.h"
#include "xla_ffi/tcp_comms.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule handler_capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_cpu, m) {
  m.doc() = "jax_cgx CPU kernels (XLA FFI handlers for platform 'cpu').";
  m.attr("interface_version") = jax_cgx::ffi_support::kInterfaceVersion;
  // The widths the kernels take (xla_ffi/codec_math.h): Python's QUANTIZED_BITS must be this range.
  m.attr("codec_bits") = nb::make_tuple(jax_cgx::kMinBits, jax_cgx::kMaxBits);

  m.def(
      "registrations",
      []() {
        nb::dict d;
        d["jax_cgx_quantize"] = handler_capsule(CpuQuantize);
        d["jax_cgx_dequantize"] = handler_capsule(CpuDequantize);
        d["jax_cgx_dequantize_sum"] = handler_capsule(CpuDequantizeSum);
        d["jax_cgx_dequantize_sum_requantize"] = handler_capsule(CpuDequantizeSumRequantize);
        d["jax_cgx_tcp_allreduce_start"] = handler_capsule(CpuTcpAllreduceStart);
        d["jax_cgx_tcp_allreduce_done"] = handler_capsule(CpuTcpAllreduceDone);
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

  // ---- the tcp backend's communicators (jax_cgx/tcp/): set-up, teardown, inspection.
  namespace tcp = jax_cgx::tcp;
  m.def(
      "tcp_adopt",
      [](int64_t key, int world, const std::vector<std::tuple<int, int, std::vector<int>>>& members,
         const std::string& description, double timeout_s) {
        std::vector<tcp::Member> ms;
        for (const auto& [ordinal, rank, sockets] : members) ms.push_back({ordinal, rank, sockets});
        std::string error;
        {
          nb::gil_scoped_release release;
          error = tcp::AdoptGroup(key, world, std::move(ms), description, timeout_s);
        }
        if (!error.empty()) throw std::runtime_error(error);
      },
      nb::arg("key"), nb::arg("world"), nb::arg("members"), nb::arg("description"), nb::arg("timeout_s"),
      "Registers the communicators of this process's members [(ordinal, rank, sockets)] of one group "
      "under key: sockets[j] is a connected socket's file descriptor to rank j (-1 at the member's own "
      "rank), authenticated by jax_cgx.tcp's handshake. Takes ownership of every descriptor (closes "
      "them on an error).");
  m.def(
      "tcp_destroy",
      [](int64_t key) {
        nb::gil_scoped_release release;
        return tcp::DestroyCommunicators(key);
      },
      nb::arg("key"), "Stops the communicators of key (all when key < 0); returns how many.");
  m.def("tcp_communicators", &tcp::ListCommunicators,
        "(key, ordinal, rank, world, description) of every tcp communicator of this process.");
  m.def(
      "tcp_segments",
      [](int64_t n, int64_t world, int64_t chunk, int bits, int64_t bucket_size, int64_t elem_bytes,
         int64_t segments) {
        jax_cgx::exchange::Plan plan;
        const std::string bad =
            tcp::MakeAllreducePlan(n, world, chunk, bits, bucket_size, elem_bytes, segments, &plan);
        if (!bad.empty()) throw std::invalid_argument(bad);
        return plan.segments;
      },
      nb::arg("n"), nb::arg("world"), nb::arg("chunk"), nb::arg("bits"), nb::arg("bucket_size"),
      nb::arg("elem_bytes"), nb::arg("segments"),
      "How many segments jax_cgx_tcp_allreduce cuts each chunk of a row into (segments = 0: by size).");
}
