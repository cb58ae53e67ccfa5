// Small kernels of the benchmark: a GPU spin queued before the first timing event (so a "device-only" sample
// excludes the launch latency), and the floor probes of --floor (an empty launch; one flag exchange between ranks).
#include <cuda_runtime.h>

#include <cstdint>

#include "epcomm/device/ptx.cuh"

namespace {
__global__ void spinKernel(unsigned nanoseconds) {
  const uint64_t start = epcomm::device::globalTimerNs();
  while (epcomm::device::globalTimerNs() - start < nanoseconds) {
  }
}

__global__ void emptyKernel() {}

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

/// An empty kernel of `blocks` blocks of 512 threads.
void epcommBenchEmpty(cudaStream_t stream, int blocks) { emptyKernel<<<blocks, 512, 0, stream>>>(); }

/// The one-flag exchange of --floor (see flagPingKernel), `blocks` blocks of 512 threads.
void epcommBenchFlagPing(cudaStream_t stream, int blocks, uint64_t* nextFlag, const uint64_t* myFlag, uint64_t round) {
  flagPingKernel<<<blocks, 512, 0, stream>>>(nextFlag, myFlag, round);
}
