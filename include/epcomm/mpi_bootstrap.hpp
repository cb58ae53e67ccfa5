// Bootstrap over an MPI communicator. Header-only on purpose: libepcomm never depends on MPI; code that already
// uses MPI includes this header and links its own MPI library.
#pragma once

#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "epcomm/bootstrap.hpp"
#include "epcomm/error.hpp"

namespace epcomm {

/// The default bound of every bootstrap wait: EPCOMM_TIMEOUT_MS as read by libepcomm.
int64_t bootstrapTimeoutMs();

/// Bootstrap collectives over a duplicate of an MPI communicator (its traffic never mixes with the application's).
///
/// Every operation is a non-blocking MPI collective polled until the timeout, so a rank that never arrives gives
/// Error(kTimeout) instead of a hang; MPI cannot say which rank is missing, so the message names the operation and
/// this rank only (use the TCP bootstrap for per-rank diagnosis). MPI cannot cancel a collective: after a timeout
/// the object is unusable, and its communicator and staging buffer are deliberately leaked, because the collective
/// may still complete later and write there. That is also why data travels through the staging buffer rather
/// than the caller's buffers, which may be gone by then. Not thread-safe. MPI must be initialised before
/// construction and finalised after destruction.
class MpiBootstrap final : public Bootstrap {
 public:
  /// Collective over `comm`. timeoutMs <= 0 uses EPCOMM_TIMEOUT_MS.
  explicit MpiBootstrap(MPI_Comm comm, int64_t timeoutMs = 0) {
    timeoutMs_ = timeoutMs > 0 ? timeoutMs : bootstrapTimeoutMs();
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Comm_idup(comm, &comm_, &req), "MPI_Comm_idup");
    wait(&req, "communicator duplication");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &world_), "MPI_Comm_size");
  }
  MpiBootstrap(const MpiBootstrap&) = delete;
  MpiBootstrap& operator=(const MpiBootstrap&) = delete;

  ~MpiBootstrap() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    // A timed-out collective may still reference the communicator; leaking it is safer than freeing it.
    if (!failed_ && !finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    if (!failed_) delete staging_;
  }

  int rank() const override { return rank_; }
  int worldSize() const override { return world_; }

  void allGather(const void* send, void* recv, size_t bytes) override {
    checkUsable();
    EPCOMM_CHECK(bytes <= static_cast<size_t>(INT_MAX), kInvalidArgument,
                 "MPI allGather of " << bytes << " bytes per rank exceeds MPI's int count");
    EPCOMM_CHECK(bytes == 0 || (send != nullptr && recv != nullptr), kInvalidArgument,
                 "allGather of " << bytes << " bytes with a null buffer on rank " << rank_);
    EPCOMM_CHECK(bytes <= SIZE_MAX / static_cast<size_t>(world_), kInvalidArgument,
                 "allGather of " << bytes << " bytes per rank overflows size_t");
    char* buf = staging(bytes * world_);
    if (bytes > 0) std::memmove(buf + static_cast<size_t>(rank_) * bytes, send, bytes);
    MPI_Request req = MPI_REQUEST_NULL;
    int n = static_cast<int>(bytes);
    check(MPI_Iallgather(MPI_IN_PLACE, n, MPI_BYTE, buf, n, MPI_BYTE, comm_, &req), "MPI_Iallgather");
    wait(&req, "allGather #" + std::to_string(++seq_) + " (" + std::to_string(bytes) + " bytes)");
    if (bytes > 0) std::memcpy(recv, buf, bytes * world_);
  }

  void barrier() override {
    checkUsable();
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier");
    wait(&req, "barrier #" + std::to_string(++seq_));
  }

  void broadcast(void* data, size_t bytes, int root) override {
    checkUsable();
    EPCOMM_CHECK(root >= 0 && root < world_, kInvalidArgument,
                 "broadcast root " << root << " is outside [0, " << world_ << ")");
    EPCOMM_CHECK(bytes <= static_cast<size_t>(INT_MAX), kInvalidArgument,
                 "MPI broadcast of " << bytes << " bytes exceeds MPI's int count");
    EPCOMM_CHECK(bytes == 0 || data != nullptr, kInvalidArgument,
                 "broadcast of " << bytes << " bytes with a null buffer on rank " << rank_);
    char* buf = staging(bytes);
    if (rank_ == root && bytes > 0) std::memcpy(buf, data, bytes);
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Ibcast(buf, static_cast<int>(bytes), MPI_BYTE, root, comm_, &req), "MPI_Ibcast");
    wait(&req, "broadcast #" + std::to_string(++seq_) + " (" + std::to_string(bytes) + " bytes from rank " +
                   std::to_string(root) + ")");
    if (rank_ != root && bytes > 0) std::memcpy(data, buf, bytes);
  }

 private:
  // At least `bytes` of staging memory (never null, so that MPI gets a valid address even for 0 bytes).
  char* staging(size_t bytes) {
    if (staging_ == nullptr) staging_ = new std::vector<char>();
    if (staging_->size() < bytes || staging_->empty()) staging_->resize(bytes > 0 ? bytes : 1);
    return staging_->data();
  }

  void checkUsable() const {
    EPCOMM_CHECK(!failed_, kBootstrap, "the MPI bootstrap of rank " << rank_ << " is unusable after an earlier error");
  }

  void check(int rc, const char* call) {
    if (rc == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING] = {0};
    int len = 0;
    MPI_Error_string(rc, text, &len);
    failed_ = true;
    EPCOMM_THROW(kBootstrap, call << " failed on rank " << rank_ << ": " << text);
  }

  // Polls `req` until it completes or the timeout passes. A short spin first: most bootstrap collectives finish in
  // microseconds; then sleep between polls so that waiting ranks leave the CPU to the late ones.
  void wait(MPI_Request* req, const std::string& what) {
    auto start = std::chrono::steady_clock::now();
    for (int polls = 0;; ++polls) {
      int done = 0;
      check(MPI_Test(req, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (done) return;
      auto waited = std::chrono::steady_clock::now() - start;
      if (waited > std::chrono::milliseconds(timeoutMs_)) {
        failed_ = true;
        EPCOMM_THROW(kTimeout, "rank " << rank_ << " waited " << timeoutMs_ << " ms in MPI " << what
                                       << ": a rank never arrived (MPI does not say which)");
      }
      if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = -1;
  int world_ = 0;
  int64_t timeoutMs_ = 0;
  uint64_t seq_ = 0;
  bool failed_ = false;
  std::vector<char>* staging_ = nullptr;  // Owned until a timeout; then leaked on purpose (see the class comment).
};

/// A Bootstrap over a duplicate of `comm` (collective over `comm`). See MpiBootstrap.
inline std::unique_ptr<Bootstrap> createMpiBootstrap(MPI_Comm comm = MPI_COMM_WORLD, int64_t timeoutMs = 0) {
  return std::make_unique<MpiBootstrap>(comm, timeoutMs);
}

}  // namespace epcomm
