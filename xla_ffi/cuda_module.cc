// Python module jax_cgx._cuda: exports the CUDA FFI handlers as capsules, keyed
// by target name, for jax.ffi.register_ffi_target(..., platform="CUDA"), and,
// when built with NCCL headers, the communicator management that
// jax_cgx/nccl/ drives.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "xla/ffi/api/c_api.h"
#include "xla_ffi/ffi_support.h"

#if JAX_CGX_HAVE_NCCL
#include "xla_ffi/nccl_allreduce.h"
#include "xla_ffi/nccl_api.h"
#include "xla_ffi/nccl_comms.h"
#include "xla_ffi/nccl_sharded.h"
#endif

namespace nb = nanobind;

// Defined by XLA_FFI_DEFINE_HANDLER_SYMBOL in xla_ffi/cuda_handlers.cc,
// xla_ffi/nccl_allreduce.cc and xla_ffi/nccl_sharded.cc.
extern "C" {
XLA_FFI_Error* CudaQuantize(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CudaDequantize(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CudaDequantizeSum(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CudaDequantizeSumRequantize(XLA_FFI_CallFrame* call_frame);
#if JAX_CGX_HAVE_NCCL
XLA_FFI_Error* CudaNcclAllreduce(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CudaNcclReduceScatter(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CudaNcclAllGather(XLA_FFI_CallFrame* call_frame);
#endif
}

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

#if JAX_CGX_HAVE_NCCL
namespace cgx = jax_cgx::nccl;

void Check(const std::string& error) {
  if (!error.empty()) throw std::runtime_error(error);
}

void DefineNccl(nb::module_& m) {
  m.def("nccl_compiled", []() { return true; });
  m.def(
      "nccl_load",
      [](const std::string& path) {
        int version = 0;
        Check(cgx::LoadNccl(path, &version));
        return version;
      },
      nb::arg("path"), "dlopen NCCL ('' = libnccl.so.2 on the loader's path); returns its version code");
  m.def("nccl_unique_id", []() {
    const cgx::NcclApi* api = cgx::Nccl();
    if (api == nullptr) throw std::runtime_error("NCCL is not loaded");
    ncclUniqueId id;
    const ncclResult_t rc = api->GetUniqueId(&id);
    if (rc != ncclSuccess) throw std::runtime_error("ncclGetUniqueId: " + cgx::NcclErrorText(rc, nullptr));
    return nb::bytes(id.internal, sizeof(id.internal));
  });
  m.def(
      "nccl_init",
      [](int64_t key, int world, nb::bytes uid, const std::vector<std::tuple<int, int>>& members,
         const std::string& description) {
        if (uid.size() != sizeof(ncclUniqueId)) {
          throw std::invalid_argument("uid must be " + std::to_string(sizeof(ncclUniqueId)) + " bytes");
        }
        ncclUniqueId id;
        std::memcpy(id.internal, uid.c_str(), sizeof(id.internal));
        std::vector<cgx::Member> local;
        for (const auto& [ordinal, rank] : members) local.push_back({ordinal, rank});
        std::string error;
        {
          nb::gil_scoped_release release;  // blocks until every rank of the group joined
          error = cgx::InitGroup(key, world, id, local, description);
        }
        Check(error);
      },
      nb::arg("key"), nb::arg("world"), nb::arg("uid"), nb::arg("members"), nb::arg("description"));
  m.def(
      "nccl_destroy",
      [](int64_t key, bool abort) {
        std::string error;
        int count;
        {
          nb::gil_scoped_release release;
          count = cgx::DestroyCommunicators(key, abort, &error);
        }
        Check(error);
        return count;
      },
      nb::arg("key"), nb::arg("abort"));
  m.def("nccl_communicators", []() { return cgx::ListCommunicators(); });
  m.def(
      "nccl_workspace_bytes",
      [](int64_t n, int64_t world, int64_t chunk, int bits, int64_t bucket_size, int64_t elem_bytes,
         int algorithm, int64_t segments) {
        auto plan = std::make_unique<jax_cgx::exchange::Plan>();
        Check(cgx::MakeAllreducePlan(n, world, chunk, bits, bucket_size, elem_bytes,
                                     static_cast<cgx::Algorithm>(algorithm), segments, plan.get()));
        return std::make_tuple(plan->workspace_bytes, plan->segments);
      },
      nb::arg("n"), nb::arg("world"), nb::arg("chunk"), nb::arg("bits"), nb::arg("bucket_size"),
      nb::arg("elem_bytes"), nb::arg("algorithm"), nb::arg("segments"),
      "(workspace bytes, segments) of one jax_cgx_nccl_allreduce call");
  m.def(
      "nccl_sharded_workspace_bytes",
      [](int op, int64_t m, int64_t world, int bits, int64_t bucket_size, int64_t elem_bytes, int64_t segments) {
        auto plan = std::make_unique<jax_cgx::exchange::Plan>();
        Check(cgx::MakeShardedPlan(static_cast<cgx::ShardedOp>(op), m, world, bits, bucket_size, elem_bytes,
                                   segments, plan.get()));
        return std::make_tuple(plan->workspace_bytes, plan->segments);
      },
      nb::arg("op"), nb::arg("m"), nb::arg("world"), nb::arg("bits"), nb::arg("bucket_size"), nb::arg("elem_bytes"),
      nb::arg("segments"),
      "(workspace bytes, segments) of one jax_cgx_nccl_reduce_scatter (op 0) or jax_cgx_nccl_all_gather (op 1) call");
}
#else
void DefineNccl(nb::module_& m) { m.def("nccl_compiled", []() { return false; }); }
#endif

}  // namespace

NB_MODULE(_cuda, m) {
  m.doc() = "jax_cgx CUDA kernels (XLA FFI handlers) and NCCL communicators";
  m.attr("interface_version") = jax_cgx::ffi_support::kInterfaceVersion;
  // The widths the kernels take (xla_ffi/codec_math.h): Python's QUANTIZED_BITS must be this range.
  m.attr("codec_bits") = nb::make_tuple(jax_cgx::kMinBits, jax_cgx::kMaxBits);
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_cgx_quantize"] = Capsule(CudaQuantize);
    targets["jax_cgx_dequantize"] = Capsule(CudaDequantize);
    targets["jax_cgx_dequantize_sum"] = Capsule(CudaDequantizeSum);
    targets["jax_cgx_dequantize_sum_requantize"] = Capsule(CudaDequantizeSumRequantize);
#if JAX_CGX_HAVE_NCCL
    targets["jax_cgx_nccl_allreduce"] = Capsule(CudaNcclAllreduce);
    targets["jax_cgx_nccl_reduce_scatter"] = Capsule(CudaNcclReduceScatter);
    targets["jax_cgx_nccl_all_gather"] = Capsule(CudaNcclAllGather);
#endif
    return targets;
  });
  DefineNccl(m);
}
