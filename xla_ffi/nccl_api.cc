// Run-time loading of NCCL (see nccl_api.h).
#include "xla_ffi/nccl_api.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>

namespace jax_cgx::nccl {
namespace {

std::mutex g_load_mu;
NcclApi g_api;
std::atomic<const NcclApi*> g_loaded{nullptr};

template <typename Fn>
bool Resolve(void* lib, const char* name, Fn* fn, std::string* missing) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*fn == nullptr) {
    if (!missing->empty()) *missing += ", ";
    *missing += name;
    return false;
  }
  return true;
}

}  // namespace

std::string LoadNccl(const std::string& path, int* version) {
  std::lock_guard<std::mutex> lock(g_load_mu);
  if (const NcclApi* api = g_loaded.load()) {
    *version = api->version;
    return "";
  }
  const char* name = path.empty() ? "libnccl.so.2" : path.c_str();
  // RTLD_LOCAL: our symbol lookups go through dlsym; we do not interpose on
  // the NCCL that XLA itself may have loaded (the same file maps once).
  void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    return std::string("cannot load ") + name + ": " + (err ? err : "unknown dlopen error");
  }
  NcclApi api;
  std::string missing;
  Resolve(lib, "ncclGetVersion", &api.GetVersion, &missing);
  Resolve(lib, "ncclGetErrorString", &api.GetErrorString, &missing);
  Resolve(lib, "ncclGetLastError", &api.GetLastError, &missing);
  Resolve(lib, "ncclGetUniqueId", &api.GetUniqueId, &missing);
  Resolve(lib, "ncclCommInitRankConfig", &api.CommInitRankConfig, &missing);
  Resolve(lib, "ncclCommDestroy", &api.CommDestroy, &missing);
  Resolve(lib, "ncclCommAbort", &api.CommAbort, &missing);
  Resolve(lib, "ncclCommGetAsyncError", &api.CommGetAsyncError, &missing);
  Resolve(lib, "ncclGroupStart", &api.GroupStart, &missing);
  Resolve(lib, "ncclGroupEnd", &api.GroupEnd, &missing);
  Resolve(lib, "ncclSend", &api.Send, &missing);
  Resolve(lib, "ncclRecv", &api.Recv, &missing);
  Resolve(lib, "ncclAllGather", &api.AllGather, &missing);
  if (!missing.empty()) {
    dlclose(lib);
    return std::string(name) + " is not a usable NCCL (NCCL >= 2.14 needed): missing " + missing;
  }
  const ncclResult_t rc = api.GetVersion(&api.version);
  if (rc != ncclSuccess) {
    dlclose(lib);
    return std::string(name) + ": ncclGetVersion failed with code " + std::to_string(rc);
  }
  // The library stays loaded for the life of the process (communicators and
  // in-flight kernels refer to it).
  g_api = api;
  g_loaded.store(&g_api);
  *version = api.version;
  return "";
}

const NcclApi* Nccl() { return g_loaded.load(); }

std::string NcclErrorText(ncclResult_t result, ncclComm_t comm) {
  const NcclApi* api = Nccl();
  if (api == nullptr) return "NCCL error " + std::to_string(result) + " (library not loaded)";
  std::string text = api->GetErrorString(result);
  const char* last = api->GetLastError(comm);
  if (last != nullptr && last[0] != '\0') text += ": " + std::string(last);
  return text;
}

}  // namespace jax_cgx::nccl
