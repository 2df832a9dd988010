// The tcp backend's communicators and their I/O thread (see tcp_comms.h).
#include "xla_ffi/tcp_comms.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>

namespace jax_cgx::tcp {

namespace {

using Clock = std::chrono::steady_clock;

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

void CloseFd(int fd) {
  if (fd >= 0) ::close(fd);
}

std::string Configure(int fd) {
  const int one = 1;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) return Errno("TCP_NODELAY");
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) return Errno("O_NONBLOCK");
  return "";
}

std::mutex g_registry_mu;
std::map<std::pair<int64_t, int>, std::shared_ptr<Communicator>> g_registry;

}  // namespace

// ------------------------------------------------------------ Communicator

Communicator::Communicator(int rank_, int world_, std::vector<int> sockets, std::string description_,
                           double timeout_s)
    : rank(rank_),
      world(world_),
      description(std::move(description_)),
      counts(static_cast<size_t>(world_)),
      sockets_(std::move(sockets)),
      timeout_s_(timeout_s),
      send_(static_cast<size_t>(world_)),
      recv_(static_cast<size_t>(world_)) {
  for (Queue& q : send_) q.ring.resize(kQueueDepth);
  for (Queue& q : recv_) q.ring.resize(kQueueDepth);
  if (::pipe2(wake_, O_NONBLOCK | O_CLOEXEC) == 0) {
    io_ = std::thread([this] { Run(); });
  } else {  // every call fails with this error
    error_ = Errno("pipe2");
    broken = true;
  }
}

Communicator::~Communicator() {
  // Calls still queued or running fail fast (their waits see the error) and
  // complete their futures; then both threads stop.
  Abort("the communicator was destroyed");
  calls_.Stop();
  finisher_.Stop();  // after the calls: they may submit finishes
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  Wake();
  if (io_.joinable()) io_.join();
  for (int fd : sockets_) CloseFd(fd);
  CloseFd(wake_[0]);
  CloseFd(wake_[1]);
}

void Communicator::Submit(Task* task) { calls_.Submit(task); }

void Communicator::SubmitFinish(Task* task) { finisher_.Submit(task); }

TaskThread::TaskThread(void (Task::*method)()) : method_(method), thread_([this] { Loop(); }) {}

void TaskThread::Submit(Task* task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(task);
  }
  cv_.notify_one();
}

void TaskThread::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void TaskThread::Loop() {
  while (true) {
    Task* task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and every task has run
      task = queue_.front();
      queue_.pop_front();
    }
    (task->*method_)();
  }
}

void Communicator::Wake() {
  const char byte = 1;
  if (wake_[1] >= 0) {
    [[maybe_unused]] ssize_t ignored = ::write(wake_[1], &byte, 1);
  }
}

void Communicator::Fail(std::string why) {
  if (error_.empty()) error_ = std::move(why);
  progress_.notify_all();
}

void Communicator::Abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Fail(why);
  }
  Wake();
}

void Communicator::Reset() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto* queues : {&send_, &recv_}) {
    for (Queue& q : *queues) q.posted = q.done = q.offset = 0;
  }
  last_progress_ = Clock::now();
}

std::string Communicator::Post(std::vector<Queue>& queues, int peer, char* data, int64_t bytes) {
  if (peer < 0 || peer >= world || peer == rank) return "bad peer " + std::to_string(peer);
  if (bytes <= 0) return "";
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.empty()) return error_;
    Queue& q = queues[static_cast<size_t>(peer)];
    if (q.posted >= kQueueDepth) return "more than " + std::to_string(kQueueDepth) + " transfers in one call";
    q.ring[static_cast<size_t>(q.posted)] = Transfer{data, bytes};
    ++q.posted;
  }
  Wake();
  return "";
}

std::string Communicator::PostSend(int peer, const void* data, int64_t bytes) {
  return Post(send_, peer, const_cast<char*>(static_cast<const char*>(data)), bytes);
}

std::string Communicator::PostRecv(int peer, void* data, int64_t bytes) {
  return Post(recv_, peer, static_cast<char*>(data), bytes);
}

std::string Communicator::Wait(const std::vector<Queue>& queues, int peer, int64_t n) {
  std::unique_lock<std::mutex> lock(mu_);
  auto satisfied = [&] {
    if (peer >= 0) return queues[static_cast<size_t>(peer)].done >= n;
    return std::all_of(queues.begin(), queues.end(), [](const Queue& q) { return q.done >= q.posted; });
  };
  while (error_.empty() && !satisfied()) {
    progress_.wait_for(lock, std::chrono::milliseconds(500));
    const double idle = std::chrono::duration<double>(Clock::now() - last_progress_).count();
    if (error_.empty() && !satisfied() && idle > timeout_s_) {
      Fail("no bytes moved for " + std::to_string(static_cast<int>(idle)) + " s (" +
           (peer >= 0 ? "waiting for rank " + std::to_string(peer) : std::string("sending")) +
           "): a peer may have died or be running a different program; the timeout is "
           "JAX_CGX_TCP_TIMEOUT_S / jax_cgx.tcp.setup(timeout_s=...)");
    }
  }
  return error_;
}

std::string Communicator::WaitRecvs(int peer, int64_t n) { return Wait(recv_, peer, n); }

std::string Communicator::WaitSends() { return Wait(send_, -1, 0); }

// The I/O thread: poll every connection with pending transfers and move as
// many bytes as the sockets take, both directions at once. Locks mu_ only to
// read and update queue state, never during a system call.
void Communicator::Run() {
  std::vector<pollfd> fds;
  std::vector<int> peer_of;
  fds.reserve(static_cast<size_t>(world) + 1);
  peer_of.reserve(static_cast<size_t>(world) + 1);
  while (true) {
    fds.clear();
    peer_of.clear();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      if (error_.empty()) {
        for (int j = 0; j < world; ++j) {
          if (j == rank) continue;
          short events = 0;
          if (send_[static_cast<size_t>(j)].done < send_[static_cast<size_t>(j)].posted) events |= POLLOUT;
          if (recv_[static_cast<size_t>(j)].done < recv_[static_cast<size_t>(j)].posted) events |= POLLIN;
          if (events != 0) {
            fds.push_back(pollfd{sockets_[static_cast<size_t>(j)], events, 0});
            peer_of.push_back(j);
          }
        }
      }
    }
    fds.push_back(pollfd{wake_[0], POLLIN, 0});
    const int rc = ::poll(fds.data(), fds.size(), 1000);
    if (rc < 0) {
      if (errno == EINTR) continue;
      std::lock_guard<std::mutex> lock(mu_);
      Fail(Errno("poll"));
      continue;
    }
    if (fds.back().revents != 0) {
      char sink[64];
      while (::read(wake_[0], sink, sizeof(sink)) > 0) {
      }
    }
    for (size_t i = 0; i + 1 < fds.size(); ++i) {
      const short ev = fds[i].revents;
      if (ev == 0) continue;
      const int j = peer_of[i], fd = fds[i].fd;
      std::string failure;
      // Receive while bytes are there, then send while the socket takes them.
      for (const bool sending : {false, true}) {
        if (!failure.empty()) break;
        if (!sending && (ev & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
        if (sending && (ev & (POLLOUT | POLLERR)) == 0) continue;
        std::vector<Queue>& queues = sending ? send_ : recv_;
        while (true) {
          char* at;
          int64_t left;
          {
            std::lock_guard<std::mutex> lock(mu_);
            Queue& q = queues[static_cast<size_t>(j)];
            if (q.done >= q.posted) break;
            const Transfer& t = q.ring[static_cast<size_t>(q.done)];
            at = t.data + q.offset;
            left = t.bytes - q.offset;
          }
          const ssize_t k = sending ? ::send(fd, at, static_cast<size_t>(left), MSG_NOSIGNAL | MSG_DONTWAIT)
                                    : ::recv(fd, at, static_cast<size_t>(left), MSG_DONTWAIT);
          if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
          if (k <= 0) {
            failure = k == 0 ? "rank " + std::to_string(j) + " closed the connection"
                             : Errno(std::string(sending ? "sending to" : "receiving from") + " rank " +
                                     std::to_string(j));
            break;
          }
          std::lock_guard<std::mutex> lock(mu_);
          Queue& q = queues[static_cast<size_t>(j)];
          q.offset += k;
          last_progress_ = Clock::now();
          if (q.offset == q.ring[static_cast<size_t>(q.done)].bytes) {
            q.offset = 0;
            ++q.done;
            progress_.notify_all();
          }
        }
      }
      if (!failure.empty()) {
        std::lock_guard<std::mutex> lock(mu_);
        Fail(failure + " (communicator '" + description + "')");
      }
    }
  }
}

// ------------------------------------------------------------ set-up

std::string AdoptGroup(int64_t key, int world, std::vector<Member> members, const std::string& description,
                       double timeout_s) {
  std::string error;
  for (const Member& m : members) {
    if (!error.empty()) break;
    if (m.rank < 0 || m.rank >= world) {
      error = "rank " + std::to_string(m.rank) + " out of range";
    } else if (static_cast<int>(m.sockets.size()) != world) {
      error = "got " + std::to_string(m.sockets.size()) + " sockets for " + std::to_string(world) + " ranks";
    } else {
      for (int j = 0; j < world && error.empty(); ++j) {
        const int fd = m.sockets[static_cast<size_t>(j)];
        if ((fd >= 0) != (j != m.rank)) {
          error = "rank " + std::to_string(m.rank) + ": " +
                  (fd >= 0 ? std::string("a socket to itself") : "no socket to rank " + std::to_string(j));
        } else if (fd >= 0) {
          error = Configure(fd);
        }
      }
    }
  }
  if (!error.empty()) {
    for (const Member& m : members) {
      for (int fd : m.sockets) CloseFd(fd);
    }
    return error;
  }
  std::lock_guard<std::mutex> lock(g_registry_mu);
  for (Member& m : members) {
    const auto where = std::make_pair(key, m.ordinal);
    auto comm = std::make_shared<Communicator>(m.rank, world, std::move(m.sockets),
                                               description + " rank " + std::to_string(m.rank), timeout_s);
    if (g_registry.count(where) != 0) {
      error = "device " + std::to_string(m.ordinal) + " already has a communicator for this key";
      continue;
    }
    g_registry.emplace(where, std::move(comm));
  }
  return error;
}

int DestroyCommunicators(int64_t key) {
  std::vector<std::shared_ptr<Communicator>> gone;
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    for (auto it = g_registry.begin(); it != g_registry.end();) {
      if (key < 0 || it->first.first == key) {
        gone.push_back(std::move(it->second));
        it = g_registry.erase(it);
      } else {
        ++it;
      }
    }
  }
  // A handler still inside a call gets an error instead of waiting for peers;
  // the last reference (ours, or that handler's) stops the I/O thread.
  for (auto& comm : gone) comm->Abort("the communicator was torn down (jax_cgx.tcp.teardown)");
  return static_cast<int>(gone.size());
}

std::shared_ptr<Communicator> FindCommunicator(int64_t key, int ordinal) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  const auto it = g_registry.find({key, ordinal});
  return it == g_registry.end() ? nullptr : it->second;
}

std::vector<std::tuple<int64_t, int, int, int, std::string>> ListCommunicators() {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  std::vector<std::tuple<int64_t, int, int, int, std::string>> out;
  for (const auto& [where, comm] : g_registry) {
    out.emplace_back(where.first, where.second, comm->rank, comm->world, comm->description);
  }
  return out;
}

}  // namespace jax_cgx::tcp
