// A short GPU spin queued before the first timing event, so a "device-only" sample excludes the launch latency.
#include <cuda_runtime.h>

#include <cstdint>

namespace {
__global__ void spinKernel(unsigned nanoseconds) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < nanoseconds);
}
}  // namespace

/// Queues one single-thread kernel that spins for `nanoseconds` on `stream`.
void epcommBenchSpin(cudaStream_t stream, unsigned nanoseconds) { spinKernel<<<1, 1, 0, stream>>>(nanoseconds); }
