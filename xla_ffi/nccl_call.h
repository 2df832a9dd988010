// What every nccl-backend handler (xla_ffi/nccl_allreduce.cc, xla_ffi/nccl_sharded.cc)
// does around its schedule: check CUDA and NCCL return codes, keep NCCL groups
// balanced, find the communicator of the call and refuse an unusable one, and
// leave a failed call's communicator marked broken with XLA's stream joined.
//
// The macros return `Internal(kTarget, ...)`: each handler's file defines its own
// `kTarget` (the custom call's name) where it uses them.
#ifndef JAX_CGX_XLA_FFI_NCCL_CALL_H_
#define JAX_CGX_XLA_FFI_NCCL_CALL_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_support.h"
#include "xla_ffi/nccl_api.h"
#include "xla_ffi/nccl_comms.h"

#define CGX_CUDA(expr)                                                                       \
  do {                                                                                       \
    const cudaError_t _cgx_err = (expr);                                                     \
    if (_cgx_err != cudaSuccess) {                                                           \
      return ::jax_cgx::ffi_support::Internal(kTarget, std::string(#expr) + " failed: " +    \
                                                           cudaGetErrorString(_cgx_err));    \
    }                                                                                        \
  } while (0)

#define CGX_NCCL(expr, comm)                                                                  \
  do {                                                                                        \
    const ncclResult_t _cgx_rc = (expr);                                                      \
    if (_cgx_rc != ncclSuccess) {                                                             \
      return ::jax_cgx::ffi_support::Internal(                                                \
          kTarget, std::string(#expr) + " failed: " + ::jax_cgx::nccl::NcclErrorText(_cgx_rc, (comm))); \
    }                                                                                         \
  } while (0)

namespace jax_cgx::nccl {

// An open ncclGroupStart that is always closed: NCCL's group depth is per
// thread and shared with XLA's own collectives, so an error return inside a
// group must still end it.
class NcclGroup {
 public:
  explicit NcclGroup(const NcclApi& api) : api_(api) {}
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  ~NcclGroup() {
    if (open_) api_.GroupEnd();
  }
  ncclResult_t Start() {
    const ncclResult_t rc = api_.GroupStart();
    open_ = rc == ncclSuccess;
    return rc;
  }
  ncclResult_t End() {
    open_ = false;
    return api_.GroupEnd();
  }

 private:
  const NcclApi& api_;
  bool open_ = false;
};

// A kernel launch's status as the handler's error.
inline xla::ffi::Error Launched(std::string_view target, cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    return ffi_support::Internal(target, std::string(what) + " launch failed: " + cudaGetErrorString(err));
  }
  return xla::ffi::Error::Success();
}

// Inside an open NCCL group on comm's side stream: send one encoding (payload
// and metadata, as bytes) to rank `to`, receive one from rank `from`.
inline xla::ffi::Error SendRecvEncoding(std::string_view target, const NcclApi& api, const Communicator& comm,
                                        const uint8_t* send_payload, const float* send_meta, uint8_t* recv_payload,
                                        float* recv_meta, size_t row_bytes, size_t meta_bytes, int to, int from) {
  const std::string_view kTarget = target;
  CGX_NCCL(api.Send(send_payload, row_bytes, ncclUint8, to, comm.comm, comm.stream), comm.comm);
  CGX_NCCL(api.Send(send_meta, meta_bytes, ncclUint8, to, comm.comm, comm.stream), comm.comm);
  CGX_NCCL(api.Recv(recv_payload, row_bytes, ncclUint8, from, comm.comm, comm.stream), comm.comm);
  CGX_NCCL(api.Recv(recv_meta, meta_bytes, ncclUint8, from, comm.comm, comm.stream), comm.comm);
  return xla::ffi::Error::Success();
}

// On comm's side stream, as one NCCL group: the in-place all-gather of W
// encodings, slot j from rank j (payload rows at `payload`, metadata rows at `meta`).
inline xla::ffi::Error AllGatherEncodings(std::string_view target, const NcclApi& api, const Communicator& comm,
                                          uint8_t* payload, float* meta, size_t row_bytes, size_t meta_bytes) {
  const std::string_view kTarget = target;
  uint8_t* meta_bytes_base = reinterpret_cast<uint8_t*>(meta);
  NcclGroup group(api);
  CGX_NCCL(group.Start(), comm.comm);
  CGX_NCCL(api.AllGather(payload + comm.rank * row_bytes, payload, row_bytes, ncclUint8, comm.comm, comm.stream),
           comm.comm);
  CGX_NCCL(api.AllGather(meta_bytes_base + comm.rank * meta_bytes, meta_bytes_base, meta_bytes, ncclUint8, comm.comm,
                         comm.stream),
           comm.comm);
  CGX_NCCL(group.End(), comm.comm);
  return xla::ffi::Error::Success();
}

// The workspace result: u8, rank 1, at least `bytes` (its plan's size) long.
inline xla::ffi::Error CheckWorkspace(std::string_view target, const xla::ffi::AnyBuffer& workspace, int64_t bytes) {
  CGX_RETURN_IF_ERROR(ffi_support::CheckDType(target, "workspace", workspace.element_type(), xla::ffi::DataType::U8));
  CGX_RETURN_IF_ERROR(ffi_support::CheckShape(target, "workspace", workspace.dimensions(), {-1}, "rank 1 [bytes]"));
  if (workspace.dimensions()[0] < bytes) {
    return ffi_support::InvalidArgument(target, "workspace has " + std::to_string(workspace.dimensions()[0]) +
                                                    " bytes, needs " + std::to_string(bytes));
  }
  return xla::ffi::Error::Success();
}

// NCCL loaded and the communicator of (comm_key, ordinal) registered with
// `world` ranks: *api and *comm, or why not (what the user does about it).
inline xla::ffi::Error FindCall(std::string_view target, int64_t comm_key, int32_t ordinal, int64_t world,
                                const NcclApi** api, std::shared_ptr<Communicator>* comm) {
  *api = Nccl();
  if (*api == nullptr) {
    return ffi_support::Internal(target, "NCCL is not loaded in this process; call jax_cgx.nccl.setup(mesh) first");
  }
  *comm = FindCommunicator(comm_key, ordinal);
  if (*comm == nullptr) {
    return ffi_support::Internal(
        target, "device " + std::to_string(ordinal) + " has no jax_cgx NCCL communicator for this collective (key " +
                    std::to_string(comm_key) + "): call jax_cgx.nccl.setup(mesh) on every process with the mesh " +
                    "this program runs on, before running it");
  }
  if ((*comm)->world != world) {
    return ffi_support::Internal(target, "communicator '" + (*comm)->description + "' has " +
                                             std::to_string((*comm)->world) + " ranks but the collective has " +
                                             std::to_string(world));
  }
  return xla::ffi::Error::Success();
}

// With comm.mu held: refuse a communicator an earlier call left out of step,
// or one NCCL reports failed.
inline xla::ffi::Error CheckUsable(std::string_view target, const NcclApi& api, const Communicator& comm) {
  if (comm.broken) {
    return ffi_support::Internal(
        target, "communicator '" + comm.description + "' is unusable: an earlier call failed midway (its ranks " +
                    "may be out of step) or it was torn down; call jax_cgx.nccl.teardown(abort=True) and " +
                    "jax_cgx.nccl.setup(mesh) again on every process");
  }
  ncclResult_t async_error = ncclSuccess;
  const ncclResult_t rc = api.CommGetAsyncError(comm.comm, &async_error);
  if (rc != ncclSuccess) {
    return ffi_support::Internal(target, "ncclCommGetAsyncError failed: " + NcclErrorText(rc, comm.comm));
  }
  if (async_error != ncclSuccess) {
    return ffi_support::Internal(target, "communicator '" + comm.description + "' failed earlier: " +
                                             NcclErrorText(async_error, comm.comm));
  }
  return xla::ffi::Error::Success();
}

// After a schedule failed midway: work may be queued on the side stream, so XLA
// must not reuse the call's buffers before it is done (XLA's stream waits for
// it), and the ranks are now out of step (the communicator is marked broken).
inline xla::ffi::Error Failed(Communicator& comm, cudaStream_t xla_stream, xla::ffi::Error error) {
  comm.broken = true;
  if (cudaEventRecord(comm.joined, comm.stream) == cudaSuccess) cudaStreamWaitEvent(xla_stream, comm.joined, 0);
  return error;
}

}  // namespace jax_cgx::nccl

#endif  // JAX_CGX_XLA_FFI_NCCL_CALL_H_
