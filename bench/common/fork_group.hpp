// A tiny multi-process harness for the benchmarks (the tests use tests/support/multiprocess.hpp, which reports
// through GoogleTest): forks W real processes that exchange blobs and meet at barriers through a shared anonymous
// mapping. Header-only; not part of the library.
#pragma once

#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace epcomm {
namespace bench {
namespace forkgroup {

constexpr int kMaxRanks = 8;
constexpr size_t kBlobBytes = 64 * 1024;
constexpr size_t kErrorBytes = 2048;

/// Lives in a MAP_SHARED mapping created before fork.
struct Shared {
  std::atomic<uint32_t> arrived;
  std::atomic<uint32_t> generation;
  uint32_t blobLen[kMaxRanks];
  uint8_t blobs[kMaxRanks][kBlobBytes];
  char errors[kMaxRanks][kErrorBytes];
};

/// Collectives between the forked ranks. Every wait is bounded by timeoutMs (throws std::runtime_error).
class Comm {
 public:
  Comm(Shared* shared, int rank, int world, int64_t timeoutMs)
      : shared_(shared), rank_(rank), world_(world), timeoutMs_(timeoutMs) {}
  int rank() const { return rank_; }
  int world() const { return world_; }

  /// Returns when every rank arrived (sense-reversing barrier on shared atomics).
  void barrier(const char* what = "barrier") {
    uint32_t gen = shared_->generation.load(std::memory_order_acquire);
    if (shared_->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(world_)) {
      shared_->arrived.store(0, std::memory_order_relaxed);
      shared_->generation.fetch_add(1, std::memory_order_acq_rel);
      return;
    }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeoutMs_);
    while (shared_->generation.load(std::memory_order_acquire) == gen) {
      if (std::chrono::steady_clock::now() > deadline) {
        throw std::runtime_error(std::string("fork group: rank ") + std::to_string(rank_) + " timed out in " + what);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  /// Every rank's blob (each at most kBlobBytes).
  std::vector<std::vector<uint8_t>> allGather(const std::vector<uint8_t>& mine) {
    if (mine.size() > kBlobBytes) throw std::runtime_error("fork group: blob too large");
    std::memcpy(shared_->blobs[rank_], mine.data(), mine.size());
    shared_->blobLen[rank_] = static_cast<uint32_t>(mine.size());
    barrier("allGather (publish)");
    std::vector<std::vector<uint8_t>> out(world_);
    for (int r = 0; r < world_; ++r) out[r].assign(shared_->blobs[r], shared_->blobs[r] + shared_->blobLen[r]);
    barrier("allGather (read)");
    return out;
  }

 private:
  Shared* shared_;
  int rank_;
  int world_;
  int64_t timeoutMs_;
};

/// How one rank ended.
struct Result {
  int rank = 0;
  bool exited = false;  ///< Normal exit (else killed by a signal or by the harness timeout).
  int exitCode = -1;
  int signal = 0;
  bool timedOut = false;
  std::string error;  ///< The exception message of a failed rank.
  bool ok() const { return exited && exitCode == 0; }
};

/// Forks `world` processes running body(comm); waits at most timeoutMs for all (then SIGKILLs the rest).
/// Must be called from a process without other threads running libfabric (the children start clean).
inline std::vector<Result> run(int world, const std::function<void(Comm&)>& body, int64_t timeoutMs = 120000) {
  if (world < 1 || world > kMaxRanks) throw std::runtime_error("fork group: bad world size");
  void* mem = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) throw std::runtime_error("fork group: mmap failed");
  auto* shared = new (mem) Shared();
  shared->arrived.store(0);
  shared->generation.store(0);
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids(world, -1);
  for (int r = 0; r < world; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      int code = 0;
      try {
        Comm comm(shared, r, world, timeoutMs);
        body(comm);
      } catch (const std::exception& e) {
        std::snprintf(shared->errors[r], kErrorBytes, "%s", e.what());
        code = 1;
      } catch (...) {
        std::snprintf(shared->errors[r], kErrorBytes, "unknown exception");
        code = 1;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(code);
    }
    pids[r] = pid;
  }
  std::vector<Result> results(world);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeoutMs + 5000);
  int left = world;
  while (left > 0) {
    for (int r = 0; r < world; ++r) {
      if (pids[r] < 0) continue;
      int status = 0;
      pid_t got = waitpid(pids[r], &status, WNOHANG);
      if (got != pids[r]) continue;
      results[r].rank = r;
      results[r].exited = WIFEXITED(status);
      results[r].exitCode = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      results[r].signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
      results[r].error = shared->errors[r];
      pids[r] = -1;
      --left;
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < world; ++r) {
        if (pids[r] < 0) continue;
        kill(pids[r], SIGKILL);
        waitpid(pids[r], nullptr, 0);
        results[r].rank = r;
        results[r].timedOut = true;
        results[r].error = "rank did not finish within the harness timeout (killed)";
        pids[r] = -1;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  munmap(mem, sizeof(Shared));
  return results;
}

}  // namespace forkgroup
}  // namespace bench
}  // namespace epcomm
