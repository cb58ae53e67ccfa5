// A barrier for the processes of one node through a POSIX shared-memory segment: each rank spins on one shared word,
// so all ranks leave within about a microsecond of the last arrival (the bootstrap's TCP barrier leaves tens of
// microseconds of skew between ranks, which every receive wait of a timed iteration would absorb).
#pragma once

#include <cstdint>
#include <string>

#include "epcomm/bootstrap.hpp"

namespace epcomm {
namespace bench {

/// Sense-reversing spin barrier over a shared-memory segment that all ranks of `bootstrap` map. Construction is
/// collective (rank 0 creates the segment, the others open it; two bootstrap barriers); the name is unlinked as soon
/// as every rank mapped it, so nothing is left behind if a process dies. wait() blocks until every rank entered and
/// throws Error(kTimeout) naming the ranks that did not arrive within `timeoutMs`. Not thread-safe (one caller per
/// process).
class ShmBarrier {
 public:
  /// `name`: segment name shared by the ranks (e.g. "/epbench-<launcher pid>").
  ShmBarrier(Bootstrap& bootstrap, const std::string& name, int64_t timeoutMs);
  ~ShmBarrier();
  ShmBarrier(const ShmBarrier&) = delete;
  ShmBarrier& operator=(const ShmBarrier&) = delete;

  /// Returns when every rank entered this round's wait().
  void wait();

 private:
  struct Shared;
  Shared* shared_ = nullptr;
  int rank_ = 0, world_ = 1;
  uint32_t sense_ = 0;
  uint64_t round_ = 0;
  int64_t timeoutMs_;
};

}  // namespace bench
}  // namespace epcomm
