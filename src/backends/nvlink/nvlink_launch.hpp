// Eager launches of the nvlink kernels through cached one-node CUDA graphs (EPCOMM_NVLINK_GRAPH_LAUNCH).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "backends/nvlink/nvlink_cuda.hpp"
#include "backends/nvlink/nvlink_kernels.hpp"

namespace epcomm {
namespace nvlink {

/// A call whose kernel and argument bytes repeat (an engine calling with the same buffers every step) is launched as
/// a one-node executable graph made at the second sighting. On 2x H200 that took the host time inside an eager call
/// from 5.2-7.1 to 2.1-3.5 us and decode T = 128 from 21.8-22.2 / 24.0-24.2 to 18.4-19.6 / 20.6-21.2 us (dispatch /
/// combine; docs/nvlink.md). Anything else, and every call on a capturing stream (the caller's own graph then
/// records a plain kernel node), launches plainly. Per object, not thread-safe (like the object).
class GraphLaunchCache {
 public:
  explicit GraphLaunchCache(bool enabled) : enabled_(enabled), seen_(kSeen, ~0ull) { recent_.fill(kNone); }
  GraphLaunchCache(const GraphLaunchCache&) = delete;
  GraphLaunchCache& operator=(const GraphLaunchCache&) = delete;

  /// Launches `l` with the `bytes` bytes at `args` as its parameter on `stream`; returns the cudaError_t.
  int launch(const KernelLaunch& l, const void* args, size_t bytes, cudaStream_t stream);
  /// Graphs launched so far (for tests and the log).
  uint64_t graphLaunches() const { return graphLaunches_; }

 private:
  static constexpr size_t kEntries = 32;  // executable graphs kept (least recently used evicted)
  static constexpr size_t kSeen = 64;     // argument hashes seen once, not yet instantiated
  struct Entry {
    uint64_t hash;
    const void* fn;
    uint32_t smemBytes;
    std::vector<unsigned char> args;
    GraphExec exec;  // an executable graph still in flight when destroyed is freed once it completes
    uint64_t lastUse;
  };
  static constexpr size_t kRecent = 4;  // entries of the last launches, newest first
  static constexpr size_t kNone = ~size_t{0};
  GraphExec instantiate(const KernelLaunch& l, const void* args);
  static bool matches(const Entry& e, const KernelLaunch& l, const void* args, size_t bytes);
  int launchEntry(size_t i, cudaStream_t stream);

  bool enabled_;
  std::vector<Entry> entries_;
  std::vector<uint64_t> seen_;
  // Indices into entries_ of the last kRecent launches' entries: an engine's calls repeat (dispatch and combine
  // alternate), so a launch is found by comparing its bytes with one or two entries, without hashing them.
  std::array<size_t, kRecent> recent_{};
  size_t seenNext_ = 0;
  uint64_t clock_ = 0;
  uint64_t graphLaunches_ = 0;
};

}  // namespace nvlink
}  // namespace epcomm
