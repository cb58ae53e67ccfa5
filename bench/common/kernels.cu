// Small kernels of the benchmarks: a GPU spin queued before the first timing event (so a "device-only" sample
// excludes the launch latency), the fill of expertY (generated in place: prefill's is 15 GB), and the kernels of
// epcomm-bench --floor (an empty launch; one flag exchange between ranks).
#include <cuda_runtime.h>

#include <cstdint>

#include "epcomm/device/ptx.cuh"
#include "fill.hpp"
#include "kernels.hpp"

namespace {
__global__ void spinKernel(unsigned nanoseconds) {
  const uint64_t start = epcomm::device::globalTimerNs();
  while (epcomm::device::globalTimerNs() - start < nanoseconds) {
  }
}

__global__ void emptyKernel() {}

// As large a parameter block as the library's kernels pass (DispatchKernelArgs: ~440 bytes).
struct LikeParams {
  uint64_t words[64];
};
__global__ void emptyLikeKernel(const LikeParams) {}

__global__ void fillNearOneKernel(uint16_t* y, uint64_t n, uint64_t seed) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    y[i] = epcommBenchNearOne(seed, i);
  }
}

// Block 0, thread 0: publishes `round` in the next rank's flag, then waits (at most 1 s) until the previous rank's
// store of `round` reached this rank's flag. The other blocks only make the launch as large as the library's.
__global__ void flagPingKernel(uint64_t* nextFlag, const uint64_t* myFlag, uint64_t round) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  epcomm::device::stReleaseSys(nextFlag, round);
  const uint64_t start = epcomm::device::globalTimerNs();
  while (epcomm::device::ldAcquireSys(myFlag) < round && epcomm::device::globalTimerNs() - start < 1000000000ull) {
  }
}

}  // namespace

/// Queues one single-thread kernel that spins for `nanoseconds` on `stream`.
void epcommBenchSpin(cudaStream_t stream, unsigned nanoseconds) { spinKernel<<<1, 1, 0, stream>>>(nanoseconds); }

/// Fills y[0, n) with epcommBenchNearOne(seed, i) on `stream`.
void epcommBenchFillNearOne(cudaStream_t stream, uint16_t* y, uint64_t n, uint64_t seed) {
  fillNearOneKernel<<<1024, 256, 0, stream>>>(y, n, seed);
}

/// An empty kernel of `blocks` blocks of 512 threads.
void epcommBenchEmpty(cudaStream_t stream, int blocks) { emptyKernel<<<blocks, 512, 0, stream>>>(); }

/// An empty kernel of `blocks` blocks of 512 threads with 512 bytes of parameters and `smemBytes` (<= 48 KB) of
/// dynamic shared memory.
void epcommBenchEmptyLike(cudaStream_t stream, int blocks, unsigned smemBytes) {
  emptyLikeKernel<<<blocks, 512, smemBytes, stream>>>(LikeParams{});
}

/// The one-flag exchange of --floor (see flagPingKernel), `blocks` blocks of 512 threads.
void epcommBenchFlagPing(cudaStream_t stream, int blocks, uint64_t* nextFlag, const uint64_t* myFlag, uint64_t round) {
  flagPingKernel<<<blocks, 512, 0, stream>>>(nextFlag, myFlag, round);
}
