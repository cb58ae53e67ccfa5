// Helpers of the proxy channel's waits, shared by proxy_channel.cc and proxy_elastic.cc: clocks, the polling pause,
// rank lists for messages.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/polling.hpp"

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
// cores do not starve each other's progress threads. With cores to spare (core/polling.hpp) it yields for longer, past
// kDriveAfterUs, so that an arrival within that window is seen at once instead of after a 20 us sleep.
class Backoff {
 public:
  void pause() {
    ++n_;
    if (n_ < (coresToSpare() ? 1024u : 64u)) {
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

// Of `ranks`, those whose PeerId (peerIds, indexed by rank) an engine error cites: the engines word a failed operation
// "<what> to peer <PeerId> (NIC ...", and a PeerId is not a rank (the channel's skip its own). Empty when it cites none
// (an error of the engine as a whole).
inline std::vector<uint32_t> ranksCitedBy(const std::string& message, const std::vector<uint32_t>& peerIds,
                                          const std::vector<uint32_t>& ranks) {
  std::vector<uint32_t> cited;
  const std::string key = " to peer ";
  for (size_t at = message.find(key); at != std::string::npos; at = message.find(key, at + key.size())) {
    size_t end = at + key.size();
    uint64_t id = 0;
    while (end < message.size() && message[end] >= '0' && message[end] <= '9' && id < (1ull << 32)) {
      id = id * 10 + static_cast<uint64_t>(message[end++] - '0');
    }
    if (end == at + key.size()) continue;
    for (uint32_t r : ranks) {
      if (peerIds[r] == id && std::find(cited.begin(), cited.end(), r) == cited.end()) cited.push_back(r);
    }
  }
  std::sort(cited.begin(), cited.end());
  return cited;
}

}  // namespace proxy
}  // namespace epcomm
