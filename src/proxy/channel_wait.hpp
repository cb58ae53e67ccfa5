// Helpers of the proxy channel's waits, shared by proxy_channel.cc and proxy_elastic.cc: clocks, the polling pause,
// rank lists for messages.
#pragma once

#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace epcomm {
namespace proxy {

inline int64_t nowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline int64_t nowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// How long the proxy polls (cheap, leaves progress to the engine's thread) before it drives the engine itself
// inside waitImm / waitCounter. Small rounds finish within it, so their latency is that of polling; large rounds
// (milliseconds of transfer on a few shared cores) gain from one driving thread per rank instead of two.
constexpr int64_t kDriveAfterUs = 300;

// Polling pause: yield first (a peer usually answers within microseconds), then sleep so that ranks sharing few
// cores do not starve each other's progress threads.
class Backoff {
 public:
  void pause() {
    ++n_;
    if (n_ < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(n_ < 2048 ? 20 : 200));
    }
  }

 private:
  uint32_t n_ = 0;
};

// "rank 2" / "ranks 1, 3".
inline std::string rankList(const std::vector<uint32_t>& ranks) {
  std::ostringstream oss;
  oss << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) oss << (i ? ", " : "") << ranks[i];
  return oss.str();
}

}  // namespace proxy
}  // namespace epcomm
