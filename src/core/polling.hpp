// Whether this process has cores to spare for threads that poll: the proxy and progress threads of every rank on it.
#pragma once

#include <sched.h>
#include <unistd.h>

#include <thread>

namespace epcomm {

/// CPUs this process may run on: the affinity mask of its main thread, which a container's cpuset narrows and a pinned
/// proxy thread's does not (the machine's count where the mask cannot be read).
inline int processCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(getpid(), sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::thread::hardware_concurrency());
}

/// True with 8 or more CPUs (processCpus, read at the first call). Waiting threads then keep polling (yielding) where
/// with fewer they sleep between polls, so that ranks sharing a few cores do not starve each other's progress.
inline bool coresToSpare() {
  static const bool spare = processCpus() >= 8;
  return spare;
}

}  // namespace epcomm
