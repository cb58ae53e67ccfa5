// Shared by the single-process probes (bench/probes/*_probe.cu): the
// exit status for "this machine cannot run the probe" (ctest's SKIP_RETURN_CODE), a CUDA call check that prints the
// failure and returns 2 from main, the one- and two-GPU checks and the span of per-block time stamps.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "epcomm/device/ptx.cuh"

namespace probe {

constexpr int kSkipped = 77;

// 0 when there is a GPU, else kSkipped (the reason printed as `name`'s).
inline int oneGpu(const char* name) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) {
    std::printf("%s: no GPU, skipped\n", name);
    return kSkipped;
  }
  return 0;
}

// 0 when GPUs 0 and 1 exist and can access each other's memory, else kSkipped (the reason printed as `name`'s).
inline int twoPeerGpus(const char* name) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  if (count < 2) {
    std::printf("%s: needs 2 GPUs, this machine has %d: skipped\n", name, count);
    return kSkipped;
  }
  int can01 = 0, can10 = 0;
  if (cudaDeviceCanAccessPeer(&can01, 0, 1) != cudaSuccess || cudaDeviceCanAccessPeer(&can10, 1, 0) != cudaSuccess ||
      can01 == 0 || can10 == 0) {
    std::printf("%s: GPUs 0 and 1 cannot access each other: skipped\n", name);
    return kSkipped;
  }
  return 0;
}

// In us: the last block's end minus the first block's start, from `blocks` (start, end) %globaltimer pairs.
inline double stampSpanUs(const std::vector<uint64_t>& stamps, uint64_t blocks) {
  uint64_t lo = ~0ull, hi = 0;
  for (uint64_t b = 0; b < blocks; ++b) {
    lo = std::min(lo, stamps[2 * b]);
    hi = std::max(hi, stamps[2 * b + 1]);
  }
  return (hi - lo) / 1e3;
}

// The median of `v` (0 when empty).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// One thread of a two-GPU probe's kernel: waits until *flag >= want (acquire, system scope), at most 1 s; on expiry it
// adds 1 to *expired (the host reports the run as failed) and returns, so a peer that never signals cannot hang it.
__device__ __forceinline__ void waitFlagBounded(const uint64_t* flag, uint64_t want, uint32_t* expired) {
  const uint64_t start = epcomm::device::globalTimerNs();
  while (epcomm::device::ldAcquireSys(flag) < want) {
    if (epcomm::device::globalTimerNs() - start > 1000000000ull) {
      atomicAdd(expired, 1u);
      return;
    }
  }
}

// Host side of waitFlagBounded: false (printed, and the count cleared for the next run) when any wait of GPU `dev`'s
// kernels gave up since the last look.
inline bool noExpiredWaits(const char* name, int dev, uint32_t* expired) {
  uint32_t n = 0;
  if (cudaMemcpy(&n, expired, sizeof(n), cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  if (n == 0) return true;
  std::fprintf(stderr, "%s: GPU %d: %u waits for the peer's flag gave up after 1 s\n", name, dev, n);
  cudaMemset(expired, 0, sizeof(uint32_t));
  return false;
}

// The two host threads of a two-GPU probe (one per GPU) meet here before each timed iteration. `broken` (a thread
// failed) releases every wait for good, so the other thread cannot spin forever.
struct PairBarrier {
  std::atomic<int> count{0};
  std::atomic<int> phase{0};
  std::atomic<bool> broken{false};
  void arrive() {
    const int p = phase.load();
    if (count.fetch_add(1) == 1) {
      count.store(0);
      phase.store(p + 1);
    } else {
      while (phase.load() == p && !broken.load()) {
      }
    }
  }
};

}  // namespace probe

#define PROBE_CHECK(expr)                                                                          \
  do {                                                                                             \
    cudaError_t e_ = (expr);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s: %s (%s:%d)\n", #expr, cudaGetErrorString(e_), __FILE__, __LINE__); \
      return 2;                                                                                    \
    }                                                                                              \
  } while (0)

// As PROBE_CHECK, in a function that returns bool (false on the failure).
#define PROBE_OK(expr)                                                                             \
  do {                                                                                             \
    cudaError_t e_ = (expr);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s: %s (%s:%d)\n", #expr, cudaGetErrorString(e_), __FILE__, __LINE__); \
      return false;                                                                                \
    }                                                                                              \
  } while (0)
