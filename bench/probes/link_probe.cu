// nvlink-link-probe: the bandwidth that one direction of the NVLink between GPU 0 and GPU 1 gives each way a kernel can
// move data across it. The nvlink backend's copies run at ~250-290 GB/s (decode dispatch: 0.94 MB drained in ~3.7 us;
// prefill dispatch: 30 MB per direction in ~120 us) against ~370 GB/s that SM stores are said to reach on this link
// (SPEC 4): is that the link, or the way the kernels store and load?
//
// One process, two GPUs with peer access. `bytes` move from GPU 0 to GPU 1 with `blocks` blocks of 512 threads:
//   push st.v4  GPU 0's threads store 16-byte vectors into GPU 1's memory (a warp: 512 contiguous bytes per store)
//   push bulk   GPU 0's warps store 4 KB chunks from shared memory into GPU 1's memory (cp.async.bulk, the TMA unit)
//   pull ld.v4  GPU 1's threads load 16-byte vectors of GPU 0's memory (the responses cross GPU 0 -> GPU 1)
//   pull bulk   GPU 1's warps load 4 KB chunks of GPU 0's memory into shared memory (cp.async.bulk + mbarrier)
// Timed inside the kernel (%globaltimer): from the first block's start to the last block's end, after each block's
// fence.sc.sys (push: its stores acknowledged by GPU 1). Prints the median over `samples` launches in us and GB/s.
// Exit status 77 (skipped) without two GPUs with peer access.
//
//   nvlink-link-probe [samples (default 20)] [MB list (default 1,8,32)] [blocks list (default 33,66,132)]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "probe_check.hpp"

namespace {

constexpr uint32_t kThreads = 512, kWarps = kThreads / 32, kChunk = 4096;

__device__ __forceinline__ uint64_t globalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The end of every probe kernel: the block's accesses done and (fence) acknowledged, then its two stamps.
__device__ __forceinline__ void finish(uint64_t t0, uint64_t* stamps) {
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("fence.sc.sys;" ::: "memory");
    stamps[2 * blockIdx.x] = t0;
    stamps[2 * blockIdx.x + 1] = globalTimer();
  }
}

__global__ void pushV4(int4* dst, uint64_t vecs, uint64_t* stamps) {
  const uint64_t t0 = globalTimer();
  const int4 v = make_int4(1, 2, 3, static_cast<int>(threadIdx.x));
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < vecs;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    dst[i] = v;
  }
  finish(t0, stamps);
}

__global__ void pushBulk(char* dst, uint64_t chunks, uint64_t* stamps) {
  extern __shared__ int4 slices[];  // [kWarps][kChunk / 16]
  const uint64_t t0 = globalTimer();
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int4* mine = slices + warp * (kChunk / 16);
  for (uint32_t i = lane; i < kChunk / 16; i += 32) mine[i] = make_int4(1, 2, 3, static_cast<int>(i));
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncwarp();
  if (lane == 0) {
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(mine));
    for (uint64_t c = warp * static_cast<uint64_t>(gridDim.x) + blockIdx.x; c < chunks;
         c += static_cast<uint64_t>(gridDim.x) * kWarps) {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + c * kChunk), "r"(s),
                   "r"(kChunk)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
  finish(t0, stamps);
}

__global__ void pullV4(const int4* src, uint64_t vecs, int* sink, uint64_t* stamps) {
  const uint64_t t0 = globalTimer();
  int acc = 0;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < vecs;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const int4 v = src[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x7eadbeef) *sink = acc;  // keeps the loads
  finish(t0, stamps);
}

__global__ void pullBulk(const char* src, uint64_t chunks, int* sink, uint64_t* stamps) {
  extern __shared__ int4 slices[];              // [kWarps][kChunk / 16]
  __shared__ alignas(8) uint64_t mbar[kWarps];  // one per warp
  const uint64_t t0 = globalTimer();
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(slices + warp * (kChunk / 16)));
  const uint32_t m = static_cast<uint32_t>(__cvta_generic_to_shared(&mbar[warp]));
  if (lane == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(m) : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    uint32_t phase = 0;
    for (uint64_t c = warp * static_cast<uint64_t>(gridDim.x) + blockIdx.x; c < chunks;
         c += static_cast<uint64_t>(gridDim.x) * kWarps) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(m), "r"(kChunk) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(s),
                   "l"(src + c * kChunk), "r"(kChunk), "r"(m)
                   : "memory");
      uint32_t done = 0;
      while (done == 0) {
        asm volatile("{ .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(m), "r"(phase)
                     : "memory");
      }
      phase ^= 1;
    }
  }
  __syncwarp();
  if (reinterpret_cast<const int*>(slices)[warp * (kChunk / 4)] == 0x7eadbeef) *sink = 1;
  finish(t0, stamps);
}

std::vector<uint64_t> parseList(const char* s, std::vector<uint64_t> fallback) {
  if (s == nullptr) return fallback;
  std::vector<uint64_t> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stoull(item));
  return out.empty() ? fallback : out;
}

}  // namespace

int main(int argc, char** argv) {
  const int samples = argc > 1 ? std::max(1, std::atoi(argv[1])) : 20;
  const std::vector<uint64_t> mbs = parseList(argc > 2 ? argv[2] : nullptr, {1, 8, 32});
  const std::vector<uint64_t> blockCounts = parseList(argc > 3 ? argv[3] : nullptr, {33, 66, 132});
  if (const int skip = probe::twoPeerGpus("nvlink-link-probe")) return skip;
  const uint64_t most = *std::max_element(mbs.begin(), mbs.end()) << 20;
  const uint64_t maxBlocks = *std::max_element(blockCounts.begin(), blockCounts.end());
  char *buf0 = nullptr, *buf1 = nullptr;
  uint64_t *stamps0 = nullptr, *stamps1 = nullptr;
  int *sink0 = nullptr, *sink1 = nullptr;
  const int smem = kWarps * kChunk;
  for (int d = 0; d < 2; ++d) {
    PROBE_CHECK(cudaSetDevice(d));
    PROBE_CHECK(cudaDeviceEnablePeerAccess(1 - d, 0));
    char*& buf = d == 0 ? buf0 : buf1;
    PROBE_CHECK(cudaMalloc(&buf, most));
    PROBE_CHECK(cudaMemset(buf, 1, most));
    PROBE_CHECK(cudaMalloc(d == 0 ? &stamps0 : &stamps1, 2 * maxBlocks * sizeof(uint64_t)));
    PROBE_CHECK(cudaMalloc(d == 0 ? &sink0 : &sink1, sizeof(int)));
    PROBE_CHECK(cudaFuncSetAttribute(pushBulk, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    PROBE_CHECK(cudaFuncSetAttribute(pullBulk, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  std::printf("nvlink-link-probe: GPU 0 -> GPU 1, blocks of %u threads, median of %d launches (in-kernel time)\n",
              kThreads, samples);
  std::printf("%-12s %8s %7s %10s %9s\n", "mode", "MB", "blocks", "us", "GB/s");
  const char* names[4] = {"push st.v4", "push bulk", "pull ld.v4", "pull bulk"};
  std::vector<uint64_t> host(2 * maxBlocks);
  for (uint64_t mb : mbs) {
    const uint64_t bytes = mb << 20;
    for (uint64_t blocks : blockCounts) {
      for (int mode = 0; mode < 4; ++mode) {
        const int dev = mode < 2 ? 0 : 1;  // the kernel runs where the initiating SMs are
        uint64_t* stamps = dev == 0 ? stamps0 : stamps1;
        PROBE_CHECK(cudaSetDevice(dev));
        std::vector<double> us;
        for (int s = -2; s < samples; ++s) {
          const dim3 grid(static_cast<uint32_t>(blocks));
          switch (mode) {
            case 0:
              pushV4<<<grid, kThreads>>>(reinterpret_cast<int4*>(buf1), bytes / 16, stamps);
              break;
            case 1:
              pushBulk<<<grid, kThreads, smem>>>(buf1, bytes / kChunk, stamps);
              break;
            case 2:
              pullV4<<<grid, kThreads>>>(reinterpret_cast<const int4*>(buf0), bytes / 16, sink1, stamps);
              break;
            default:
              pullBulk<<<grid, kThreads, smem>>>(buf0, bytes / kChunk, sink1, stamps);
              break;
          }
          PROBE_CHECK(cudaGetLastError());
          PROBE_CHECK(cudaDeviceSynchronize());
          PROBE_CHECK(cudaMemcpy(host.data(), stamps, 2 * blocks * sizeof(uint64_t), cudaMemcpyDeviceToHost));
          if (s >= 0) us.push_back(probe::stampSpanUs(host, blocks));
        }
        std::sort(us.begin(), us.end());
        const double med = us[us.size() / 2];
        std::printf("%-12s %8llu %7llu %10.2f %9.1f\n", names[mode], static_cast<unsigned long long>(mb),
                    static_cast<unsigned long long>(blocks), med, bytes / med / 1e3);
      }
    }
  }
  return 0;
}
