// nvlink-queue-probe: how late does a small message cross NVLink while bulk stores fill the same direction? The
// question behind prefill dispatch's late routes: the routing entries and flags that
// a sender stores into a receiver wait behind the bulk it pushes, but a receiver could instead *read* them from the
// sender's memory, whose responses travel in the same direction as that bulk.
//
// One process, two GPUs with peer access. GPU 0 ("sender") runs `bulk` blocks that store 16-byte vectors into GPU 1's
// memory until told to stop (0 blocks: idle link). Meanwhile one thread measures, `samples` times, in clock cycles of
// its own SM (converted with the SM clock):
//   push: GPU 0 stores a word into GPU 1 (behind the bulk); a thread on GPU 1 copies it back into GPU 0 (the idle
//         direction); GPU 0 times the round trip.
//   read: a thread on GPU 1 loads a word of GPU 0's memory (request in the idle direction, response in the bulk's).
// Prints median and 90th percentile of each. Exit status 77 (skipped) without two GPUs with peer access.
//
//   nvlink-queue-probe [bulk blocks (default 64)] [samples (default 200)]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "epcomm/device/ptx.cuh"
#include "probe_check.hpp"

namespace {

constexpr uint64_t kBulkBytes = 256ull << 20;  // ring the bulk blocks store into, over and over
constexpr uint64_t kExit = ~0ull;

using epcomm::device::ldRelaxedSys;
using epcomm::device::stRelaxedSys;

// GPU 0: stores into the peer's ring until *stop (checked every 64 vectors per thread).
__global__ void bulk(int4* ring, uint64_t vectors, const uint64_t* stop) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const int4 v = make_int4(1, 2, 3, static_cast<int>(threadIdx.x));
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x, n = 0;; i += stride, ++n) {
    if ((n & 63) == 0 && ldRelaxedSys(stop) != 0) return;
    ring[i % vectors] = v;
  }
}

// GPU 1: copies every new value of its local `flag` into the sender's `ack` until kExit (or ~10 s).
__global__ void echo(const uint64_t* flag, uint64_t* ack) {
  const long long start = clock64();
  uint64_t last = 0;
  for (;;) {
    const uint64_t v = ldRelaxedSys(flag);
    if (v == kExit) return;
    if (v != last) {
      stRelaxedSys(ack, v);
      last = v;
    }
    if (clock64() - start > 20000000000ll) return;
  }
}

// Waits `cycles` (so the bulk is in flight before the first sample).
__device__ void pause(long long cycles) {
  const long long t = clock64();
  while (clock64() - t < cycles) {
  }
}

// GPU 0: round trips of a word stored into GPU 1 (behind the bulk) and echoed back; then stops the bulk and the echo.
__global__ void pushRtt(uint64_t* peerFlag, const uint64_t* ack, long long* samples, int n, long long delay,
                        uint64_t* stop) {
  pause(delay);
  for (int s = 1; s <= n; ++s) {
    const long long t0 = clock64();
    stRelaxedSys(peerFlag, static_cast<uint64_t>(s));
    while (ldRelaxedSys(ack) != static_cast<uint64_t>(s)) {
      if (clock64() - t0 > 4000000000ll) break;  // ~2 s: give up on this sample
    }
    samples[s - 1] = clock64() - t0;
    pause(2000);
  }
  stRelaxedSys(stop, 1);
  stRelaxedSys(peerFlag, kExit);
}

// GPU 1: latencies of loads of a word in GPU 0's memory; then stops the bulk (a store into GPU 0).
__global__ void readLatency(const uint64_t* peerWord, long long* samples, int n, long long delay, uint64_t* peerStop,
                            uint64_t* sink) {
  pause(delay);
  uint64_t sum = 0;
  for (int s = 0; s < n; ++s) {
    const long long t0 = clock64();
    sum += ldRelaxedSys(peerWord + (s & 7) * 32);  // 8 different 256-byte-apart words, each a fresh round trip
    samples[s] = clock64() - t0;
    pause(2000);
  }
  *sink = sum;
  stRelaxedSys(peerStop, 1);
}

struct Stats {
  double median, p90;
};

Stats summarize(std::vector<long long> v, double cyclesPerUs) {
  std::sort(v.begin(), v.end());
  return Stats{v[v.size() / 2] / cyclesPerUs, v[v.size() * 9 / 10] / cyclesPerUs};
}

}  // namespace

int main(int argc, char** argv) {
  const int bulkBlocks = argc > 1 ? std::atoi(argv[1]) : 64;
  const int n = argc > 2 ? std::max(10, std::atoi(argv[2])) : 200;
  if (const int skip = probe::twoPeerGpus("nvlink-queue-probe")) return skip;
  int clock0 = 0, clock1 = 0;  // kHz
  PROBE_CHECK(cudaDeviceGetAttribute(&clock0, cudaDevAttrClockRate, 0));
  PROBE_CHECK(cudaDeviceGetAttribute(&clock1, cudaDevAttrClockRate, 1));
  // GPU 1: the ring, the flag; GPU 0: ack, stop, the word GPU 1 reads.
  int4* ring = nullptr;
  uint64_t *flag = nullptr, *ctl0 = nullptr, *sink = nullptr;
  long long *samples0 = nullptr, *samples1 = nullptr;
  PROBE_CHECK(cudaSetDevice(1));
  PROBE_CHECK(cudaDeviceEnablePeerAccess(0, 0));
  PROBE_CHECK(cudaMalloc(&ring, kBulkBytes));
  PROBE_CHECK(cudaMalloc(&flag, 256));
  PROBE_CHECK(cudaMalloc(&samples1, n * sizeof(long long)));
  PROBE_CHECK(cudaMalloc(&sink, 8));
  PROBE_CHECK(cudaSetDevice(0));
  PROBE_CHECK(cudaDeviceEnablePeerAccess(1, 0));
  PROBE_CHECK(cudaMalloc(&ctl0, 4096));  // [0] ack, [32] stop, [64..] the words GPU 1 reads
  PROBE_CHECK(cudaMalloc(&samples0, n * sizeof(long long)));
  cudaStream_t s0a, s0b, s1;
  PROBE_CHECK(cudaStreamCreateWithFlags(&s0a, cudaStreamNonBlocking));
  PROBE_CHECK(cudaStreamCreateWithFlags(&s0b, cudaStreamNonBlocking));
  PROBE_CHECK(cudaSetDevice(1));
  PROBE_CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  uint64_t* ack = ctl0;
  uint64_t* stop = ctl0 + 32;
  const uint64_t* words = ctl0 + 64;
  const long long delay0 = static_cast<long long>(clock0) * 20;  // 20 us
  const long long delay1 = static_cast<long long>(clock1) * 20;
  std::vector<long long> h(n);
  std::printf(
      "nvlink-queue-probe: GPU 0 stores into GPU 1 with %d blocks x 512 threads (0: idle); latencies in us "
      "(median / p90 of %d samples)\n",
      bulkBlocks, n);
  for (int withBulk = 0; withBulk < 2; ++withBulk) {
    const int blocks = withBulk ? bulkBlocks : 0;
    for (int mode = 0; mode < 2; ++mode) {
      PROBE_CHECK(cudaSetDevice(1));
      PROBE_CHECK(cudaMemset(flag, 0, 256));
      PROBE_CHECK(cudaDeviceSynchronize());
      PROBE_CHECK(cudaSetDevice(0));
      PROBE_CHECK(cudaMemset(ctl0, 0, 4096));
      PROBE_CHECK(cudaDeviceSynchronize());
      if (blocks > 0) {
        bulk<<<blocks, 512, 0, s0a>>>(ring, kBulkBytes / 16, stop);
        PROBE_CHECK(cudaGetLastError());
      }
      if (mode == 0) {
        PROBE_CHECK(cudaSetDevice(1));
        echo<<<1, 1, 0, s1>>>(flag, ack);
        PROBE_CHECK(cudaGetLastError());
        PROBE_CHECK(cudaSetDevice(0));
        pushRtt<<<1, 1, 0, s0b>>>(flag, ack, samples0, n, delay0, stop);
        PROBE_CHECK(cudaGetLastError());
      } else {
        PROBE_CHECK(cudaSetDevice(1));
        readLatency<<<1, 1, 0, s1>>>(words, samples1, n, delay1, stop, sink);
        PROBE_CHECK(cudaGetLastError());
      }
      PROBE_CHECK(cudaSetDevice(1));
      PROBE_CHECK(cudaDeviceSynchronize());
      PROBE_CHECK(cudaSetDevice(0));
      PROBE_CHECK(cudaDeviceSynchronize());
      if (mode == 0) {
        PROBE_CHECK(cudaMemcpy(h.data(), samples0, n * sizeof(long long), cudaMemcpyDeviceToHost));
      } else {
        PROBE_CHECK(cudaSetDevice(1));
        PROBE_CHECK(cudaMemcpy(h.data(), samples1, n * sizeof(long long), cudaMemcpyDeviceToHost));
      }
      const Stats st = summarize(h, (mode == 0 ? clock0 : clock1) / 1000.0);
      std::printf("  %-4s %-5s: %7.2f / %7.2f us  (%s)\n", mode == 0 ? "push" : "read", withBulk ? "bulk" : "idle",
                  st.median, st.p90,
                  mode == 0 ? "GPU 0 -> GPU 1 store, echoed back over the idle direction: round trip"
                            : "GPU 1 loads GPU 0's memory: the response crosses in the bulk's direction");
    }
  }
  return 0;
}
