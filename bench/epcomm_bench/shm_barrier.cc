#include "shm_barrier.hpp"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <sstream>

#include "epcomm/error.hpp"

namespace epcomm {
namespace bench {

namespace {
constexpr int kMaxRanks = 64;
}

struct ShmBarrier::Shared {
  std::atomic<uint32_t> count;                           // ranks arrived in the current round
  std::atomic<uint32_t> sense;                           // flipped by the last arrival
  alignas(64) std::atomic<uint64_t> arrived[kMaxRanks];  // last round each rank entered (names the missing ones)
};

ShmBarrier::ShmBarrier(Bootstrap& bootstrap, const std::string& name, int64_t timeoutMs)
    : rank_(bootstrap.rank()), world_(bootstrap.worldSize()), timeoutMs_(timeoutMs) {
  static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
                "process-shared atomics must be lock-free");
  EPCOMM_CHECK(world_ <= kMaxRanks, kInvalidArgument, "shm barrier supports " << kMaxRanks << " ranks, got " << world_);
  const size_t bytes = sizeof(Shared);
  if (rank_ == 0) {
    shm_unlink(name.c_str());  // a stale segment of a crashed run
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EPCOMM_CHECK(fd >= 0, kSystem, "shm_open(" << name << ", create) failed: " << std::strerror(errno));
    const bool sized = ftruncate(fd, static_cast<off_t>(bytes)) == 0;
    void* p = sized ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    close(fd);
    EPCOMM_CHECK(p != MAP_FAILED, kSystem, "mapping shm segment " << name << " failed: " << std::strerror(errno));
    shared_ = new (p) Shared();  // zero-filled by ftruncate; placement-new makes the atomics live objects
  }
  bootstrap.barrier();
  if (rank_ != 0) {
    int fd = shm_open(name.c_str(), O_RDWR, 0600);
    EPCOMM_CHECK(fd >= 0, kSystem, "shm_open(" << name << ") failed on rank " << rank_ << ": " << std::strerror(errno));
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    EPCOMM_CHECK(p != MAP_FAILED, kSystem, "mapping shm segment " << name << " failed: " << std::strerror(errno));
    shared_ = static_cast<Shared*>(p);
  }
  bootstrap.barrier();
  if (rank_ == 0) shm_unlink(name.c_str());
}

ShmBarrier::~ShmBarrier() {
  if (shared_ != nullptr) munmap(shared_, sizeof(Shared));
}

void ShmBarrier::wait() {
  sense_ ^= 1u;
  ++round_;
  shared_->arrived[rank_].store(round_, std::memory_order_relaxed);
  if (shared_->count.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(world_)) {
    shared_->count.store(0, std::memory_order_relaxed);
    shared_->sense.store(sense_, std::memory_order_release);
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  for (uint32_t i = 1; shared_->sense.load(std::memory_order_acquire) != sense_; ++i) {
    // Pure spinning first (a free core wakes within ~0.1 us); then yield between polls, so on a machine with fewer
    // free cores than ranks the rank we wait for gets to run.
    if (i > 4096) sched_yield();
    if ((i & 4095) != 0) continue;
    if (std::chrono::steady_clock::now() - start > std::chrono::milliseconds(timeoutMs_)) {
      std::ostringstream missing;
      for (int r = 0; r < world_; ++r) {
        if (shared_->arrived[r].load(std::memory_order_relaxed) < round_) missing << " " << r;
      }
      EPCOMM_THROW(kTimeout, "rank " << rank_ << ": shm barrier round " << round_ << " timed out after " << timeoutMs_
                                     << " ms waiting for rank(s)" << missing.str());
    }
  }
}

}  // namespace bench
}  // namespace epcomm
