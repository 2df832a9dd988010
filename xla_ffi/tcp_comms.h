// The tcp backend's communicators: one per (family key, CPU device), a full
// mesh of TCP connections to the other ranks of the device's reduction group,
// and one I/O thread that moves the bytes while the handler's thread runs
// the codec (xla_ffi/tcp_allreduce.cc).
//
// Transfers. A handler posts sends and receives per peer; each direction of
// each connection is a FIFO byte stream, and every rank posts its transfers
// with one peer in the same order (SPMD), so a receive needs no tag: the
// k-th receive from peer j is the k-th send of peer j to us. The I/O thread
// runs them with non-blocking sockets and poll(), both directions of every
// connection at once, and counts completions; the handler waits for counts.
// Nothing here allocates per call: queues are fixed rings sized at creation.
#ifndef JAX_CGX_XLA_FFI_TCP_COMMS_H_
#define JAX_CGX_XLA_FFI_TCP_COMMS_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace jax_cgx::tcp {

// Transfers a handler may have posted per peer and direction at once.
inline constexpr int kQueueDepth = 512;

// Work for a communicator's call thread (xla_ffi/tcp_allreduce.cc: one call).
// Finish() runs on the communicator's finishing thread after
// SubmitFinish(task): it completes XLA's future there, because XLA may run the
// work that waited for it on the completing thread, which must not be the
// call thread (the next call would wait behind that work).
class Task {
 public:
  virtual ~Task() = default;
  virtual void Run() = 0;
  virtual void Finish() {}
};

// A thread that runs one method of the tasks submitted to it, in submission
// order. Stop() lets it drain its queue, then joins it.
class TaskThread {
 public:
  explicit TaskThread(void (Task::*method)());
  ~TaskThread() { Stop(); }
  TaskThread(const TaskThread&) = delete;
  TaskThread& operator=(const TaskThread&) = delete;
  void Submit(Task* task);  // not owned: must live until its method returns
  void Stop();

 private:
  void Loop();
  void (Task::*const method_)();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task*> queue_;
  bool stop_ = false;
  std::thread thread_;
};

class Communicator {
 public:
  // Takes ownership of `sockets` (sockets[rank] == -1) and starts the I/O and call threads.
  Communicator(int rank, int world, std::vector<int> sockets, std::string description,
               double timeout_s);
  ~Communicator();  // fails what is pending, stops both threads, closes the sockets
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  const int rank;
  const int world;
  const std::string description;

  // Runs `task` on the call thread after the tasks submitted before it (the
  // start handler returns at once; XLA waits for the done call's future).
  // `task` is not owned and must live until its Run returns.
  void Submit(Task* task);
  // Runs task->Finish() on the finishing thread, in order.
  void SubmitFinish(Task* task);

  // What the call thread owns while it runs a call:
  // set when a call failed midway (ranks out of step) or the communicator is
  // being destroyed: every later call fails;
  bool broken = false;
  // scratch that lives as long as the communicator, grown (never shrunk):
  // the calls' workspace and per-call small arrays.
  std::vector<char> workspace;
  std::vector<int32_t> counts;
  // The handler's reusable call records (xla_ffi/tcp_allreduce.cc), under
  // slots_mu: as many as were ever pending at once (a backward pass may start
  // one call per layer before the first is done), made once each.
  std::mutex slots_mu;
  std::vector<std::unique_ptr<Task>> slots;

  // Queue a transfer with `peer`; "" or why not (queue full, broken link).
  std::string PostSend(int peer, const void* data, int64_t bytes);
  std::string PostRecv(int peer, void* data, int64_t bytes);
  // Blocks until `n` receives from `peer` (counted since Reset) completed, or
  // all posted sends did (peer < 0 with WaitSends). "" or the error: a
  // transport failure, or no progress for timeout_s.
  std::string WaitRecvs(int peer, int64_t n);
  std::string WaitSends();
  // Starts a call: forgets completed transfers (all queues must be drained).
  void Reset();
  // Fails every pending and later wait with `why` (teardown, a failed call).
  void Abort(const std::string& why);

 private:
  struct Transfer {
    char* data = nullptr;
    int64_t bytes = 0;
  };
  // One direction of one connection: a ring of posted transfers.
  struct Queue {
    std::vector<Transfer> ring;
    int64_t posted = 0;  // transfers posted since Reset
    int64_t done = 0;    // transfers completed since Reset
    int64_t offset = 0;  // bytes of transfer `done` moved so far
  };
  std::string Post(std::vector<Queue>& queues, int peer, char* data, int64_t bytes);
  std::string Wait(const std::vector<Queue>& queues, int peer, int64_t n);
  void Run();                  // the I/O thread
  void Fail(std::string why);  // under mu_
  void Wake();

  std::vector<int> sockets_;
  const double timeout_s_;
  std::mutex mu_;
  std::condition_variable progress_;
  std::vector<Queue> send_, recv_;
  std::string error_;
  std::chrono::steady_clock::time_point last_progress_ = std::chrono::steady_clock::now();
  bool stop_ = false;
  int wake_[2] = {-1, -1};  // a pipe that interrupts the I/O thread's poll()
  std::thread io_;
  // The call thread runs Task::Run, the finishing thread Task::Finish.
  TaskThread calls_{&Task::Run};
  TaskThread finisher_{&Task::Finish};
};

// One of this process's devices in a group: its ordinal, its rank and its
// connected sockets (sockets[rank] == -1, one per other rank).
struct Member {
  int ordinal;
  int rank;
  std::vector<int> sockets;
};

// Registers the communicators of this process's members of one group of
// `world` ranks under `key`, over sockets connected and authenticated by the
// set-up handshake (jax_cgx/_src/tcp/handshake.py: every member connects to the
// ranks below it and accepts the ranks above it; each connection's greeting
// is checked there, in Python). Takes ownership of every socket: they are
// made non-blocking with TCP_NODELAY, or closed on an error.
// Returns "" or an error message.
std::string AdoptGroup(int64_t key, int world, std::vector<Member> members, const std::string& description,
                       double timeout_s);

// Stops and forgets the communicators of `key` (all when key < 0); returns how many.
int DestroyCommunicators(int64_t key);

// The communicator of (key, ordinal), or nullptr.
std::shared_ptr<Communicator> FindCommunicator(int64_t key, int ordinal);

// (key, ordinal, rank, world, description) of every registered communicator.
std::vector<std::tuple<int64_t, int, int, int, std::string>> ListCommunicators();

}  // namespace jax_cgx::tcp

#endif  // JAX_CGX_XLA_FFI_TCP_COMMS_H_
