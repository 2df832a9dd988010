// jax_cgx's own NCCL communicators: a registry keyed by (family key, device
// ordinal).
//
// A "family" is the set of reduction groups of one reduction over some mesh
// axes (jax_cgx/nccl/ computes its key); each local device belongs to one
// group of a family, so (key, ordinal) names one communicator. The FFI handler
// finds its communicator from the key attribute and the DeviceOrdinal context.
// Each communicator owns a side stream for its NCCL operations and events that
// order that stream against XLA's, created once here, never in a handler.
#ifndef JAX_CGX_XLA_FFI_NCCL_COMMS_H_
#define JAX_CGX_XLA_FFI_NCCL_COMMS_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "xla_ffi/exchange_plan.h"

namespace jax_cgx::nccl {

// Segments a buffer's chunks may be pipelined in (CompressionConfig's bound).
inline constexpr int kMaxSegments = exchange::kMaxSegments;

struct Communicator {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int world = 0;
  int ordinal = 0;
  std::string description;
  cudaStream_t stream = nullptr;  // where this communicator's NCCL work runs
  // Per segment: quantized (XLA stream -> side), exchanged (side -> XLA),
  // reduced (XLA -> side), gathered (side -> XLA).
  cudaEvent_t quantized[kMaxSegments] = {};
  cudaEvent_t exchanged[kMaxSegments] = {};
  cudaEvent_t reduced[kMaxSegments] = {};
  cudaEvent_t gathered[kMaxSegments] = {};
  // After a failed call: the XLA stream waits for whatever the side stream had.
  cudaEvent_t joined = nullptr;
  // Set when a call failed midway: its ranks may be out of step, so later
  // calls refuse to run until the communicator is set up again.
  std::atomic<bool> broken{false};
  // Serializes enqueues on this communicator (one device, normally one thread).
  std::mutex mu;
};

// One device of this process in a group: its CUDA ordinal and rank.
struct Member {
  int ordinal;
  int rank;
};

// Creates the communicators of this process's `members` of one group of
// `world` ranks (blocking until every rank joined) and registers them under
// `key`. Returns "" or an error message. Needs LoadNccl first.
std::string InitGroup(int64_t key, int world, const ncclUniqueId& id,
                      const std::vector<Member>& members, const std::string& description);

// Destroys (ncclCommDestroy) or aborts (ncclCommAbort) the communicators of
// `key` (all keys when key < 0). Returns how many, or -1 and sets *error.
int DestroyCommunicators(int64_t key, bool abort, std::string* error);

// The communicator of (key, ordinal), or nullptr. Shared: a teardown while a
// handler holds it frees it only when the handler is done.
std::shared_ptr<Communicator> FindCommunicator(int64_t key, int ordinal);

// (key, ordinal, rank, world, description) of every registered communicator.
std::vector<std::tuple<int64_t, int, int, int, std::string>> ListCommunicators();

}  // namespace jax_cgx::nccl

#endif  // JAX_CGX_XLA_FFI_NCCL_COMMS_H_
