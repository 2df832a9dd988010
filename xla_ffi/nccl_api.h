// NCCL, loaded at run time.
//
// jax_cgx compiles against nccl.h (for its types) but does not link libnccl:
// `import jax_cgx` must work on machines without NCCL or without a GPU. The
// Python side (jax_cgx/nccl/) finds the library (the nvidia-nccl-cu13 wheel
// that jax[cuda13] installs, or the system's) and calls LoadNccl once; every
// NCCL call then goes through the function table returned by Nccl().
#ifndef JAX_CGX_XLA_FFI_NCCL_API_H_
#define JAX_CGX_XLA_FFI_NCCL_API_H_

#include <nccl.h>

#include <string>

namespace jax_cgx::nccl {

// The NCCL entry points jax_cgx uses, with nccl.h's exact signatures.
struct NcclApi {
  decltype(&::ncclGetVersion) GetVersion;
  decltype(&::ncclGetErrorString) GetErrorString;
  decltype(&::ncclGetLastError) GetLastError;
  decltype(&::ncclGetUniqueId) GetUniqueId;
  decltype(&::ncclCommInitRankConfig) CommInitRankConfig;
  decltype(&::ncclCommDestroy) CommDestroy;
  decltype(&::ncclCommAbort) CommAbort;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&::ncclGroupStart) GroupStart;
  decltype(&::ncclGroupEnd) GroupEnd;
  decltype(&::ncclSend) Send;
  decltype(&::ncclRecv) Recv;
  decltype(&::ncclAllGather) AllGather;
  int version = 0;  // ncclGetVersion of the loaded library, e.g. 23203
};

// Loads NCCL from `path` ("" = the dynamic loader's search for libnccl.so.2).
// Idempotent: once a library is loaded, later calls return its version and
// ignore `path`. Returns "" on success, else what went wrong.
std::string LoadNccl(const std::string& path, int* version);

// The loaded API, or nullptr before a successful LoadNccl.
const NcclApi* Nccl();

// "<ncclGetErrorString(result)>" plus NCCL's last error message for `comm`
// (may be nullptr) when it has one.
std::string NcclErrorText(ncclResult_t result, ncclComm_t comm);

}  // namespace jax_cgx::nccl

#endif  // JAX_CGX_XLA_FFI_NCCL_API_H_
