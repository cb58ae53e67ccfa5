// What a process holds, for the tests that create and destroy many objects in one set of processes (the host and GPU
// churn tests): open file descriptors, threads and malloc's bytes in use, and the check that none of them grew.
#pragma once

#include <cstdint>

namespace epcomm {
namespace test {

/// What this process holds; a test adds what else it watches (resident memory, the GPU's free memory).
struct ProcessUsage {
  int fds = 0;            ///< open file descriptors
  int threads = 0;        ///< threads
  int64_t heapBytes = 0;  ///< malloc's bytes in use
};

/// Open file descriptors of this process (the entries of /proc/self/fd).
int openFds();

/// Threads of this process (the entries of /proc/self/task).
int threadCount();

/// malloc's bytes in use (mallinfo2): every thread's only with one arena (mallopt(M_ARENA_MAX, 1) before any thread
/// starts; glibc otherwise gives threads arenas of their own, which the count misses).
int64_t heapInUse();

/// The verdict on a process that made `n` objects one after the other, from its usage with no object alive after the
/// first ten (`early`), after object n / 2 (`mid`) and after the last (`late`): as many open file descriptors and
/// threads as after the first ten, and less than 1 KiB of heap grown per object over the second half. GoogleTest
/// expectations.
void expectNoGrowth(const ProcessUsage& early, const ProcessUsage& mid, const ProcessUsage& late, uint32_t n);

}  // namespace test
}  // namespace epcomm
