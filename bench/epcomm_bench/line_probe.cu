// nvlink-line-probe: does a warp's 128-byte store into a peer GPU arrive whole? The question behind a fence-free
// transfer with a flag word inside every 128-byte line (NCCL's LL128 idea, docs/nvlink.md, tenth pass).
//
// One process, two GPUs with peer access. GPU 0 writes `rounds` rounds over `lines` 128-byte lines of GPU 1's
// memory, back to back: 8 lanes store one line as 8 x 16 bytes in one instruction, the last 8 bytes are the round
// and the other 15 words are a function of (round, line, word). GPU 1 reads the lines meanwhile, again 8 lanes x 16
// bytes per line, and checks every line it sees with a round tag: a line whose words belong to another round than
// its tag is torn. Prints lines checked, torn lines and the first torn one. Exit status 1 when a line was torn, 77
// (skipped) without two GPUs with peer access. The nvlink backend's line mode relies on whole lines: ctest runs it
// (label gpu).
//
//   nvlink-line-probe [lines (default 65536)] [rounds (default 200)] [tag-first]
// (tag-first: the control, the round word stored alone before its line; torn lines expected.)
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "probe_check.hpp"

namespace {

__host__ __device__ uint64_t word(uint64_t round, uint64_t line, uint64_t w) {
  return (round * 0x9E3779B97F4A7C15ull) ^ (line << 8) ^ w;
}

// Lane l of each 8-lane group stores bytes [16 l, 16 l + 16) of a line; lane 7's second word is the round.
// `tagFirst` (the probe's control): the round word goes out in a store of its own before the line, so a reader can
// see a line tagged with a round whose data has not landed: the probe must report torn lines then.
__global__ void writer(uint64_t* dst, uint32_t lines, uint32_t rounds, bool tagFirst) {
  const uint32_t lane8 = threadIdx.x % 8;
  const uint32_t group = (blockIdx.x * blockDim.x + threadIdx.x) / 8, groups = gridDim.x * blockDim.x / 8;
  for (uint32_t r = 1; r <= rounds; ++r) {
    for (uint32_t line = group; line < lines; line += groups) {
      const uint64_t a = word(r, line, 2 * lane8);
      const uint64_t b = lane8 == 7 ? r : word(r, line, 2 * lane8 + 1);
      uint64_t* p = dst + line * 16 + 2 * lane8;
      if (tagFirst && lane8 == 7) asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p + 1), "l"(b) : "memory");
      asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
    }
  }
}

// Reads every line until each carries the last round; counts checked and torn lines (first torn one in info). A
// warp takes 4 lines at a time (8 lanes each) and loops until all 4 carry the last round, so its shuffles stay
// warp-wide.
__global__ void reader(const uint64_t* src, uint32_t lines, uint32_t rounds, unsigned long long* checked,
                       unsigned long long* torn, unsigned long long* info, unsigned long long timeoutNs) {
  const uint32_t lane = threadIdx.x % 32, lane8 = lane % 8;
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, warps = gridDim.x * blockDim.x / 32;
  unsigned long long start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (uint32_t base = warp * 4; base < lines; base += warps * 4) {
    const uint32_t line = base + lane / 8;
    bool done = line >= lines;
    while (!__all_sync(0xffffffffu, done)) {
      uint64_t a = 0, b = 0;
      if (!done) {
        asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];"
                     : "=l"(a), "=l"(b)
                     : "l"(src + static_cast<uint64_t>(line) * 16 + 2 * lane8));
      }
      // The group's round: lane 7's second word.
      const uint64_t r = __shfl_sync(0xffffffffu, b, (lane / 8) * 8 + 7);
      bool ok = true;
      if (!done && r != 0) ok = a == word(r, line, 2 * lane8) && (lane8 == 7 || b == word(r, line, 2 * lane8 + 1));
      const uint32_t bad = (__ballot_sync(0xffffffffu, !ok) >> ((lane / 8) * 8)) & 0xffu;
      if (!done && lane8 == 0 && r != 0) {
        atomicAdd(checked, 1ull);
        if (bad != 0 && atomicAdd(torn, 1ull) == 0) {
          info[0] = line;
          info[1] = r;
          info[2] = bad;
        }
      }
      if (r >= rounds) done = true;
      unsigned long long now;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (__shfl_sync(0xffffffffu, now - start > timeoutNs ? 1 : 0, 0) != 0) {
        if (lane == 0) info[3] = 1;
        return;
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const uint32_t lines = argc > 1 ? static_cast<uint32_t>(std::strtoul(argv[1], nullptr, 10)) : 65536;
  const uint32_t rounds = argc > 2 ? static_cast<uint32_t>(std::strtoul(argv[2], nullptr, 10)) : 200;
  const bool tagFirst = argc > 3 && std::string(argv[3]) == "tag-first";
  if (const int skip = probe::twoPeerGpus("nvlink-line-probe")) return skip;
  uint64_t* buf = nullptr;
  unsigned long long* stats = nullptr;
  PROBE_CHECK(cudaSetDevice(1));
  PROBE_CHECK(cudaMalloc(&buf, static_cast<size_t>(lines) * 128));
  PROBE_CHECK(cudaMemset(buf, 0, static_cast<size_t>(lines) * 128));
  PROBE_CHECK(cudaMalloc(&stats, 6 * sizeof(unsigned long long)));
  PROBE_CHECK(cudaMemset(stats, 0, 6 * sizeof(unsigned long long)));
  PROBE_CHECK(cudaDeviceSynchronize());
  PROBE_CHECK(cudaSetDevice(0));
  PROBE_CHECK(cudaDeviceEnablePeerAccess(1, 0));
  // Reader first (it spins until the last round), then the writer on the other GPU.
  PROBE_CHECK(cudaSetDevice(1));
  reader<<<66, 512>>>(buf, lines, rounds, stats, stats + 1, stats + 2, 20ull * 1000 * 1000 * 1000);
  PROBE_CHECK(cudaGetLastError());
  PROBE_CHECK(cudaSetDevice(0));
  writer<<<66, 512>>>(buf, lines, rounds, tagFirst);
  PROBE_CHECK(cudaGetLastError());
  PROBE_CHECK(cudaDeviceSynchronize());
  PROBE_CHECK(cudaSetDevice(1));
  PROBE_CHECK(cudaDeviceSynchronize());
  unsigned long long h[6] = {};
  PROBE_CHECK(cudaMemcpy(h, stats, sizeof(h), cudaMemcpyDeviceToHost));
  std::printf(
      "nvlink-line-probe: %u lines x %u rounds, 128-byte lines stored by 8 lanes x 16 B into the peer: "
      "%llu line reads with a round tag checked, %llu torn%s%s\n",
      lines, rounds, h[0], h[1], h[5] != 0 ? " (reader timed out)" : "",
      tagFirst ? " [control: round word first]" : "");
  if (h[1] != 0) std::printf("first torn: line %llu tagged round %llu, lanes 0x%llx of 8 wrong\n", h[2], h[3], h[4]);
  return h[1] != 0 || h[5] != 0 ? 1 : 0;
}
