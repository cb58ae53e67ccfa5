// processCpus / coresToSpare: the process's CPUs from its main thread's affinity mask. Each case runs in a forked
// child (coresToSpare caches its value per process).
#include "core/polling.hpp"

#include <gtest/gtest.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

namespace epcomm {
namespace {

constexpr int kNo = 0, kYes = 1, kSetupFailed = 2;

// The first n CPUs of the calling thread's mask.
cpu_set_t firstCpus(int n) {
  cpu_set_t mine, out;
  CPU_ZERO(&mine);
  CPU_ZERO(&out);
  sched_getaffinity(0, sizeof(mine), &mine);
  for (int c = 0, taken = 0; c < CPU_SETSIZE && taken < n; ++c) {
    if (CPU_ISSET(c, &mine)) {
      CPU_SET(c, &out);
      ++taken;
    }
  }
  return out;
}

// Runs fn in a child process; returns its exit status: fn's value (kYes, kNo or kSetupFailed).
template <typename Fn>
int inChild(Fn fn) {
  const pid_t pid = fork();
  if (pid == 0) _exit(fn());
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

int maskCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : -1;
}

TEST(ProcessCpus, IsTheMainThreadsMask) {
  const int cpus = maskCpus();
  ASSERT_GT(cpus, 0);
  EXPECT_EQ(processCpus(), cpus);
  // A process narrowed to one CPU (as by a cpuset or taskset) sees one, and no cores to spare.
  EXPECT_EQ(inChild([] {
              const cpu_set_t one = firstCpus(1);
              if (sched_setaffinity(0, sizeof(one), &one) != 0) return kSetupFailed;
              return processCpus() == 1 && !coresToSpare() ? kYes : kNo;
            }),
            kYes);
}

TEST(ProcessCpus, APinnedThreadDoesNotNarrowIt) {
  // A thread pinned to one CPU (as EPCOMM_PROXY_CPU pins the proxy thread) still reads the whole process's CPUs, also
  // when its call to coresToSpare is the process's first.
  const int cpus = maskCpus();
  ASSERT_GT(cpus, 0);
  EXPECT_EQ(inChild([cpus] {
              int got = kSetupFailed;
              std::thread t([&] {
                const cpu_set_t one = firstCpus(1);
                if (sched_setaffinity(0, sizeof(one), &one) != 0) return;
                got = processCpus() == cpus && coresToSpare() == (cpus >= 8) ? kYes : kNo;
              });
              t.join();
              return got;
            }),
            kYes)
      << cpus << " CPUs in the mask";
}

}  // namespace
}  // namespace epcomm
