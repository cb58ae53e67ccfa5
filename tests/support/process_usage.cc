#include "support/process_usage.hpp"

#include <dirent.h>
#include <gtest/gtest.h>
#include <malloc.h>

namespace epcomm {
namespace test {

namespace {

int countEntries(const char* dir) {
  int n = 0;
  if (DIR* d = opendir(dir)) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.' ? 1 : 0;
    closedir(d);
  }
  return n;
}

}  // namespace

int openFds() { return countEntries("/proc/self/fd"); }

int threadCount() { return countEntries("/proc/self/task"); }

int64_t heapInUse() { return static_cast<int64_t>(mallinfo2().uordblks); }

void expectNoGrowth(const ProcessUsage& early, const ProcessUsage& mid, const ProcessUsage& late, uint32_t n) {
  EXPECT_EQ(late.fds, early.fds) << "open file descriptors after 10 objects vs after " << n;
  EXPECT_EQ(late.threads, early.threads) << "threads after 10 objects vs after " << n;
  // A leak of anything an object allocates (its buffers are pages) grows by kilobytes per object. libfabric 1.17's shm
  // provider keeps ~300 bytes per endpoint until the process exits (freed at exit: valgrind reports no leak).
  const int64_t second = static_cast<int64_t>(n - 1 - n / 2);
  EXPECT_LT(late.heapBytes - mid.heapBytes, 1024 * second)
      << "heap in use grew from " << mid.heapBytes << " B (object " << n / 2 << ") to " << late.heapBytes
      << " B (object " << n - 1 << ")";
}

}  // namespace test
}  // namespace epcomm
