// Whether this machine has cores to spare for threads that poll: the proxy and progress threads of every rank on it.
#pragma once

#include <thread>

namespace epcomm {

/// True with 8 or more hardware threads. Waiting threads then keep polling (yielding) where on a smaller machine they
/// sleep between polls, so that ranks sharing a few cores do not starve each other's progress.
inline bool coresToSpare() {
  static const bool spare = std::thread::hardware_concurrency() >= 8;
  return spare;
}

}  // namespace epcomm
