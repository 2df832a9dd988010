// The communicator registry (see nccl_comms.h).
//
// Creating and destroying communicators runs on a short-lived thread of its
// own: it switches CUDA devices freely there without touching the calling
// (Python) thread's current device or creating a context on a GPU the process
// does not use.
#include "xla_ffi/nccl_comms.h"

#include <map>
#include <shared_mutex>
#include <thread>

#include "xla_ffi/nccl_api.h"

namespace jax_cgx::nccl {
namespace {

using Key = std::pair<int64_t, int>;

std::shared_mutex g_mu;
// Never destroyed: at interpreter exit NCCL may be gone before static
// destructors run; jax_cgx/nccl/ aborts the communicators from atexit.
auto* g_comms = new std::map<Key, std::shared_ptr<Communicator>>();

std::string CudaText(const char* what, cudaError_t err) {
  return std::string(what) + " failed: " + cudaGetErrorString(err);
}

// Runs fn on a new thread and waits for it.
template <typename Fn>
void OnOwnThread(Fn&& fn) {
  std::thread worker(std::forward<Fn>(fn));
  worker.join();
}

void ReleaseCudaResources(Communicator& c) {
  for (int s = 0; s < kMaxSegments; ++s) {
    for (cudaEvent_t ev : {c.quantized[s], c.exchanged[s], c.reduced[s], c.gathered[s]}) {
      if (ev != nullptr) cudaEventDestroy(ev);
    }
  }
  if (c.joined != nullptr) cudaEventDestroy(c.joined);
  if (c.stream != nullptr) cudaStreamDestroy(c.stream);
}

std::string CreateCudaResources(Communicator& c) {
  cudaError_t err = cudaSetDevice(c.ordinal);
  if (err != cudaSuccess) return CudaText("cudaSetDevice", err);
  err = cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking);
  if (err != cudaSuccess) return CudaText("cudaStreamCreateWithFlags", err);
  for (int s = 0; s < kMaxSegments; ++s) {
    for (cudaEvent_t* ev : {&c.quantized[s], &c.exchanged[s], &c.reduced[s], &c.gathered[s]}) {
      err = cudaEventCreateWithFlags(ev, cudaEventDisableTiming);
      if (err != cudaSuccess) return CudaText("cudaEventCreateWithFlags", err);
    }
  }
  err = cudaEventCreateWithFlags(&c.joined, cudaEventDisableTiming);
  if (err != cudaSuccess) return CudaText("cudaEventCreateWithFlags", err);
  return "";
}

std::string InitOnThisThread(int world, const ncclUniqueId& id,
                             std::vector<std::shared_ptr<Communicator>>& made,
                             const std::string& description) {
  const NcclApi& api = *Nccl();
  // Every device must be usable before the group starts: a failure inside the
  // group would leave the ranks already queued waiting for one that never joins.
  for (auto& c : made) {
    const cudaError_t err = cudaSetDevice(c->ordinal);
    if (err != cudaSuccess) return CudaText(("cudaSetDevice(" + std::to_string(c->ordinal) + ")").c_str(), err);
  }
  // Blocking communicators whatever NCCL_COMM_BLOCKING says: the handler
  // treats ncclInProgress as an error.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  // Several local ranks of one group are initialized inside one NCCL group
  // call (one thread drives them all).
  ncclResult_t rc = api.GroupStart();
  if (rc != ncclSuccess) return "ncclGroupStart: " + NcclErrorText(rc, nullptr);
  std::string error;
  for (auto& c : made) {
    cudaSetDevice(c->ordinal);
    rc = api.CommInitRankConfig(&c->comm, world, id, c->rank, &config);
    if (rc != ncclSuccess) {
      error = "ncclCommInitRank(rank " + std::to_string(c->rank) + " of " + std::to_string(world) +
              " on device " + std::to_string(c->ordinal) + "): " + NcclErrorText(rc, nullptr);
      break;
    }
  }
  rc = api.GroupEnd();
  if (error.empty() && rc != ncclSuccess) {
    error = "ncclCommInitRank (" + description + "): " + NcclErrorText(rc, nullptr);
  }
  if (error.empty()) {
    for (auto& c : made) {
      error = CreateCudaResources(*c);
      if (!error.empty()) break;
    }
  }
  if (!error.empty()) {
    for (auto& c : made) {
      if (c->comm != nullptr) api.CommAbort(c->comm);
      cudaSetDevice(c->ordinal);
      ReleaseCudaResources(*c);
    }
  }
  return error;
}

}  // namespace

std::string InitGroup(int64_t key, int world, const ncclUniqueId& id,
                      const std::vector<Member>& members, const std::string& description) {
  if (Nccl() == nullptr) return "NCCL is not loaded (call jax_cgx.nccl.load() first)";
  if (members.empty()) return "no local members";
  {
    std::shared_lock<std::shared_mutex> lock(g_mu);
    for (const Member& m : members) {
      if (g_comms->count({key, m.ordinal})) {
        return "device " + std::to_string(m.ordinal) + " already has a communicator for key " +
               std::to_string(key) + " (" + description + ")";
      }
      if (m.rank < 0 || m.rank >= world) {
        return "rank " + std::to_string(m.rank) + " is outside 0.." + std::to_string(world - 1);
      }
    }
  }
  std::vector<std::shared_ptr<Communicator>> made;
  for (const Member& m : members) {
    auto c = std::make_shared<Communicator>();
    c->rank = m.rank;
    c->world = world;
    c->ordinal = m.ordinal;
    c->description = description;
    made.push_back(std::move(c));
  }
  std::string error;
  OnOwnThread([&] { error = InitOnThisThread(world, id, made, description); });
  if (!error.empty()) return error;
  std::unique_lock<std::shared_mutex> lock(g_mu);
  for (auto& c : made) (*g_comms)[{key, c->ordinal}] = c;
  return "";
}

int DestroyCommunicators(int64_t key, bool abort, std::string* error) {
  const NcclApi* api = Nccl();
  std::vector<std::shared_ptr<Communicator>> victims;
  {
    std::unique_lock<std::shared_mutex> lock(g_mu);
    for (auto it = g_comms->begin(); it != g_comms->end();) {
      if (key < 0 || it->first.first == key) {
        victims.push_back(std::move(it->second));
        it = g_comms->erase(it);
      } else {
        ++it;
      }
    }
  }
  OnOwnThread([&] {
    for (auto& c : victims) {
      std::lock_guard<std::mutex> busy(c->mu);  // no enqueue in progress
      cudaSetDevice(c->ordinal);
      if (api != nullptr && c->comm != nullptr) {
        const ncclResult_t rc = abort ? api->CommAbort(c->comm) : api->CommDestroy(c->comm);
        if (rc != ncclSuccess && error->empty()) {
          *error = std::string(abort ? "ncclCommAbort" : "ncclCommDestroy") + " (" + c->description +
                   "): " + NcclErrorText(rc, nullptr);
        }
        c->comm = nullptr;
      }
      ReleaseCudaResources(*c);
      c->stream = nullptr;
      c->broken = true;  // a handler still holding it must not use it
    }
  });
  return error->empty() ? static_cast<int>(victims.size()) : -1;
}

std::shared_ptr<Communicator> FindCommunicator(int64_t key, int ordinal) {
  std::shared_lock<std::shared_mutex> lock(g_mu);
  auto it = g_comms->find({key, ordinal});
  return it == g_comms->end() ? nullptr : it->second;
}

std::vector<std::tuple<int64_t, int, int, int, std::string>> ListCommunicators() {
  std::shared_lock<std::shared_mutex> lock(g_mu);
  std::vector<std::tuple<int64_t, int, int, int, std::string>> out;
  for (const auto& [k, c] : *g_comms) out.emplace_back(k.first, k.second, c->rank, c->world, c->description);
  return out;
}

}  // namespace jax_cgx::nccl
