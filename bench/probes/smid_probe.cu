// smid-probe: where the block scheduler puts the blocks of a kernel shaped like the nvlink dispatch (one GPU).
//
//   smid-probe
//
// Each block records the SM it runs on (%smid) and its start time, then spins for a while so that every block of
// the grid is resident at once. Dynamic shared memory sets the occupancy the real kernels have through their
// registers: 120 KB for 512-thread blocks (one per SM), 100 KB for 256-thread blocks (two per SM). For each shape
// it prints how many SMs got blocks and the most blocks one SM got; the last case launches two 132-block grids of
// 256 threads on two streams (two objects in flight) and says whether all 264 blocks were resident together. It
// answers whether "132 blocks of 256 threads, two per SM" spreads over every SM or packs two per SM on half of them
// Never asserts: exits 77 without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "epcomm/device/ptx.cuh"
#include "probe_check.hpp"

namespace {

struct Stamp {
  uint32_t sm;
  uint32_t pad;
  uint64_t start, end;
};

using epcomm::device::globalTimerNs;

template <int kThreads, int kPerSm>
__global__ void __launch_bounds__(kThreads, kPerSm) place(Stamp* out, unsigned spinNs) {
  extern __shared__ uint32_t smem[];
  if (threadIdx.x == 0) {
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    const uint64_t t0 = globalTimerNs();
    smem[0] = sm;
    while (globalTimerNs() - t0 < spinNs) {
    }
    out[blockIdx.x] = Stamp{sm, 0, t0, globalTimerNs()};
  }
}

struct Shape {
  const char* name;
  int blocks, threads;
  size_t smem;
};

// SMs used and the most blocks on one SM.
void summarize(const char* name, const std::vector<Stamp>& s, int sms) {
  std::vector<int> per(sms, 0);
  for (const Stamp& x : s) {
    if (x.sm < static_cast<uint32_t>(sms)) ++per[x.sm];
  }
  const int used = static_cast<int>(std::count_if(per.begin(), per.end(), [](int n) { return n > 0; }));
  const int most = *std::max_element(per.begin(), per.end());
  uint64_t lastStart = 0, firstEnd = ~0ull;
  for (const Stamp& x : s) {
    lastStart = std::max(lastStart, x.start);
    firstEnd = std::min(firstEnd, x.end);
  }
  std::printf("%-44s blocks %4zu  SMs used %3d of %d  most blocks on one SM %d  all resident together %s\n", name,
              s.size(), used, sms, most, lastStart < firstEnd ? "yes" : "no");
}

}  // namespace

int main() {
  if (const int skip = probe::oneGpu("smid-probe")) return skip;
  int sms = 0;
  PROBE_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  PROBE_CHECK(cudaFuncSetAttribute(place<512, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 * 1024));
  PROBE_CHECK(cudaFuncSetAttribute(place<256, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
  Stamp* d = nullptr;
  PROBE_CHECK(cudaMalloc(&d, 2 * 4 * static_cast<size_t>(sms) * sizeof(Stamp)));
  const unsigned spin = 50000;  // 50 us: every block of a grid is placed long before the first one ends
  auto run = [&](const char* name, int blocks, int threads) -> int {
    for (int rep = 0; rep < 3; ++rep) {
      if (threads == 512) {
        place<512, 1><<<blocks, 512, 120 * 1024>>>(d, spin);
      } else {
        place<256, 2><<<blocks, 256, 100 * 1024>>>(d, spin);
      }
      PROBE_CHECK(cudaGetLastError());
      PROBE_CHECK(cudaDeviceSynchronize());
      std::vector<Stamp> h(blocks);
      PROBE_CHECK(cudaMemcpy(h.data(), d, blocks * sizeof(Stamp), cudaMemcpyDeviceToHost));
      summarize(name, h, sms);
    }
    return 0;
  };
  if (run("half the SMs x 512 threads (1 per SM)", sms / 2, 512) != 0) return 2;
  if (run("every SM x 512 threads (1 per SM)", sms, 512) != 0) return 2;
  if (run("every SM x 256 threads (up to 2 per SM)", sms, 256) != 0) return 2;
  if (run("two per SM x 256 threads (up to 2 per SM)", 2 * sms, 256) != 0) return 2;
  // Two objects in flight: two grids of `sms` blocks x 256 threads on two streams.
  cudaStream_t a, b;
  PROBE_CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  PROBE_CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  for (int rep = 0; rep < 3; ++rep) {
    place<256, 2><<<sms, 256, 100 * 1024, a>>>(d, spin);
    place<256, 2><<<sms, 256, 100 * 1024, b>>>(d + sms, spin);
    PROBE_CHECK(cudaGetLastError());
    PROBE_CHECK(cudaDeviceSynchronize());
    std::vector<Stamp> h(2 * static_cast<size_t>(sms));
    PROBE_CHECK(cudaMemcpy(h.data(), d, h.size() * sizeof(Stamp), cudaMemcpyDeviceToHost));
    summarize("two grids of every SM x 256 threads, 2 streams", h, sms);
    std::vector<Stamp> first(h.begin(), h.begin() + sms);
    summarize("  the first grid alone", first, sms);
  }
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
  cudaFree(d);
  return 0;
}
