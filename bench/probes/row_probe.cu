// expand-row-probe: how long does a decode-sized expansion's row writing take on one GPU, and does it depend on how
// far apart the rows lie? The question behind the nvlink dispatch's slow expansions at decode: a warp's unit of 2 KB,
// stored into ~4 expert rows, took 2-5 us in the traces even with every byte local. In the batched layout ([L, R, H])
// each expert's rows start ~1.8 MB apart, so one round touches ~L different 2 MB pages; in the packed layout the same
// rows are ~7 MB back to back.
//
// One GPU. `blocks` blocks of 512 threads; warp w takes unit w (token w / pieces, piece w % pieces) of
// `tokens` tokens, loads its 2 KB (4 x 16 bytes per lane) and stores them into each of the token's rows (K / 2 distinct
// local experts out of L, drawn with a fixed seed; row positions in token order, as the dispatch assigns them).
// Each launch is timed inside the kernel (%globaltimer: last block's end minus first block's start). Rows of four
// modes, `samples` launches each: {batched, packed} x {TLB warm (the same launch just before), after a kernel that
// touched one word in every 2 MB of an 8 GiB buffer}, then both layouts with the rows written by bulk stores (TMA,
// `expandBulk`), and with half the rows each way (`expandBulk<true>`). Prints median and 90th percentile.
//
// With `routed` each token has the rows of its experts among K = 8 drawn from two ranks' (0-8, 4 on average), as at
// EP2.
//
//   expand-row-probe [tokens (default 256)] [blocks (default 66)] [samples (default 50)] [routed]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "epcomm/device/ptx.cuh"
#include "probe_check.hpp"

namespace {

constexpr uint32_t kThreads = 512, kWarps = kThreads / 32;
constexpr uint32_t kL = 128, kRowsPerExpert = 256, kRowBytes = 7168, kUnitBytes = 2048;
constexpr uint32_t kMaxRows = 8;  // rows per token at most (K = 8)
constexpr uint32_t kPieces = (kRowBytes + kUnitBytes - 1) / kUnitBytes;
constexpr uint64_t kThrashBytes = 8ull << 30, kPage = 2ull << 20;

using epcomm::device::globalTimerNs;
using epcomm::device::laneMaskLt;

// rowOff[t * kMaxRows + i]: byte offset of token t's i-th row in dst, or -1 (fewer rows).
__global__ void expand(const int4* src, char* dst, const int64_t* rowOff, uint32_t tokens, uint64_t* stamps) {
  const uint64_t t0 = globalTimerNs();
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t w = (threadIdx.x / 32) * gridDim.x + blockIdx.x;  // block-fastest, as the dispatch spreads units
  for (uint32_t u = w; u < tokens * kPieces; u += gridDim.x * kWarps) {
    const uint32_t t = u / kPieces, p = u % kPieces;
    int4 v[4];
    const uint32_t vecs = min(kUnitBytes, kRowBytes - p * kUnitBytes) / 16;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t c = lane + 32 * i;
      if (c < vecs) v[i] = src[(static_cast<uint64_t>(t) * kRowBytes + p * kUnitBytes) / 16 + c];
    }
    const int64_t off = lane < kMaxRows ? rowOff[t * kMaxRows + lane] : -1;
    for (uint32_t m = __ballot_sync(0xffffffffu, off >= 0); m != 0; m &= m - 1) {
      int4* row = reinterpret_cast<int4*>(dst + __shfl_sync(0xffffffffu, off, __ffs(m) - 1) + p * kUnitBytes);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t c = lane + 32 * i;
        if (c < vecs) row[c] = v[i];
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    stamps[2 * blockIdx.x] = t0;
    stamps[2 * blockIdx.x + 1] = globalTimerNs();
  }
}

// The same units, but each warp's 2 KB go from registers into its shared-memory slice once and the TMA unit stores
// them into the rows (cp.async.bulk, one instruction per row): do bulk stores leave an SM faster than 16 vector
// stores per lane? With kHalfVector both paths leave the SM at once: of a unit's rows (in lane order) the odd ones go
// by bulk stores and the even ones by vector stores from registers. Does an SM write rows faster when its LSU and its
// TMA unit share them?
template <bool kHalfVector>
__global__ void expandBulk(const int4* src, char* dst, const int64_t* rowOff, uint32_t tokens, uint64_t* stamps) {
  extern __shared__ int4 stage[];  // [kWarps][kUnitBytes / 16]
  const uint64_t t0 = globalTimerNs();
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int4* mine = stage + warp * (kUnitBytes / 16);
  const uint32_t w = warp * gridDim.x + blockIdx.x;
  for (uint32_t u = w; u < tokens * kPieces; u += gridDim.x * kWarps) {
    const uint32_t t = u / kPieces, p = u % kPieces;
    const uint32_t vecs = min(kUnitBytes, kRowBytes - p * kUnitBytes) / 16;
    // The slice is free again once the previous unit's bulk stores have read it.
    if (lane < kMaxRows) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    __syncwarp();
    int4 v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t c = lane + 32 * i;
      if (c < vecs) {
        v[i] = src[(static_cast<uint64_t>(t) * kRowBytes + p * kUnitBytes) / 16 + c];
        mine[c] = v[i];
      }
    }
    const int64_t off = lane < kMaxRows ? rowOff[t * kMaxRows + lane] : -1;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    const uint32_t rowsMask = __ballot_sync(0xffffffffu, off >= 0);
    if (off >= 0 && (!kHalfVector || (__popc(rowsMask & laneMaskLt()) & 1))) {
      const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(mine));
      char* row = dst + off + p * kUnitBytes;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(row), "r"(s), "r"(vecs * 16)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    if constexpr (kHalfVector) {
      uint32_t i = 0;
      for (uint32_t m = rowsMask; m != 0; m &= m - 1, ++i) {
        if (i & 1) continue;
        int4* row = reinterpret_cast<int4*>(dst + __shfl_sync(0xffffffffu, off, __ffs(m) - 1) + p * kUnitBytes);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint32_t c = lane + 32 * k;
          if (c < vecs) row[c] = v[k];
        }
      }
    }
  }
  if (lane < kMaxRows) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    stamps[2 * blockIdx.x] = t0;
    stamps[2 * blockIdx.x + 1] = globalTimerNs();
  }
}

__global__ void thrash(uint32_t* buf, uint64_t words, uint64_t strideWords) {
  for (uint64_t i = (blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x) * strideWords; i < words;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x * strideWords) {
    buf[i] += 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const uint32_t tokens = argc > 1 ? static_cast<uint32_t>(std::atoi(argv[1])) : 256;
  const uint32_t blocks = argc > 2 ? static_cast<uint32_t>(std::atoi(argv[2])) : 66;
  const int samples = argc > 3 ? std::atoi(argv[3]) : 50;
  // "routed": each token draws K = 8 distinct experts of 2 L (two ranks' experts) and has a row for those below L
  // (0-8 rows, 4 on average, as at EP2); otherwise exactly 4 distinct local experts per token.
  const bool routed = argc > 4 && std::string(argv[4]) == "routed";
  if (const int skip = probe::oneGpu("expand-row-probe")) return skip;
  if (tokens == 0 || tokens > kRowsPerExpert || blocks == 0 || samples <= 0) {
    std::fprintf(stderr, "expand-row-probe: tokens in [1, %u], blocks and samples > 0\n", kRowsPerExpert);
    return 2;
  }
  // Each token's local experts (kL means none); rows per expert in token order (the dispatch's stable order).
  std::mt19937 rng(12345);
  std::vector<uint32_t> experts(static_cast<size_t>(tokens) * kMaxRows, kL), slot(experts.size(), 0);
  std::vector<uint32_t> count(kL, 0);
  uint64_t rows = 0;
  for (uint32_t t = 0; t < tokens; ++t) {
    std::vector<uint32_t> pick;
    while (pick.size() < (routed ? kMaxRows : 4)) {
      const uint32_t e = rng() % (routed ? 2 * kL : kL);
      if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
    }
    uint32_t i = 0;
    for (uint32_t e : pick) {
      if (e >= kL) continue;
      experts[t * kMaxRows + i] = e;
      slot[t * kMaxRows + i] = count[e]++;
      ++i;
      ++rows;
    }
  }
  std::vector<uint64_t> first(kL + 1, 0);
  for (uint32_t e = 0; e < kL; ++e) first[e + 1] = first[e] + count[e];
  std::vector<int64_t> batched(experts.size(), -1), packed(experts.size(), -1);
  for (size_t i = 0; i < experts.size(); ++i) {
    if (experts[i] == kL) continue;
    batched[i] = (static_cast<int64_t>(experts[i]) * kRowsPerExpert + slot[i]) * kRowBytes;
    packed[i] = static_cast<int64_t>(first[experts[i]] + slot[i]) * kRowBytes;
  }
  PROBE_CHECK(cudaSetDevice(0));
  int4* src = nullptr;
  char* dst = nullptr;
  int64_t *offB = nullptr, *offP = nullptr;
  uint64_t* stamps = nullptr;
  uint32_t* junk = nullptr;
  PROBE_CHECK(cudaMalloc(&src, static_cast<size_t>(tokens) * kRowBytes));
  PROBE_CHECK(cudaMemset(src, 1, static_cast<size_t>(tokens) * kRowBytes));
  PROBE_CHECK(cudaMalloc(&dst, static_cast<size_t>(kL) * kRowsPerExpert * kRowBytes));
  PROBE_CHECK(cudaMemset(dst, 0, static_cast<size_t>(kL) * kRowsPerExpert * kRowBytes));
  PROBE_CHECK(cudaMalloc(&offB, batched.size() * 8));
  PROBE_CHECK(cudaMalloc(&offP, packed.size() * 8));
  PROBE_CHECK(cudaMemcpy(offB, batched.data(), batched.size() * 8, cudaMemcpyHostToDevice));
  PROBE_CHECK(cudaMemcpy(offP, packed.data(), packed.size() * 8, cudaMemcpyHostToDevice));
  PROBE_CHECK(cudaMalloc(&stamps, 2 * blocks * sizeof(uint64_t)));
  PROBE_CHECK(cudaMalloc(&junk, kThrashBytes));
  PROBE_CHECK(cudaMemset(junk, 0, kThrashBytes));
  std::vector<uint64_t> host(2 * blocks);
  std::printf("expand-row-probe: %u tokens, %s rows of %u B (%.1f MB of rows), %u blocks x %u threads, %d samples\n",
              tokens, routed ? "0-8 (routed)" : "4", kRowBytes, rows * kRowBytes / 1e6, blocks, kThreads, samples);
  const char* names[2] = {"batched", "packed"};
  const int64_t* offs[2] = {offB, offP};
  // `samples` rounds (after 5 unrecorded ones) of prepare(), launch(), each followed by a device sync; prints the
  // median and 90th percentile of the launch's in-kernel time. Returns 2 on a CUDA error (printed).
  auto measure = [&](const char* layout, const char* what, auto prepare, auto launch) -> int {
    std::vector<double> us;
    for (int s = -5; s < samples; ++s) {
      prepare();
      PROBE_CHECK(cudaDeviceSynchronize());
      launch();
      PROBE_CHECK(cudaDeviceSynchronize());
      PROBE_CHECK(cudaMemcpy(host.data(), stamps, host.size() * 8, cudaMemcpyDeviceToHost));
      if (s >= 0) us.push_back(probe::stampSpanUs(host, blocks));
    }
    std::sort(us.begin(), us.end());
    std::printf("%-8s %-25s median %6.2f us  p90 %6.2f us\n", layout, what, us[us.size() / 2], us[us.size() * 9 / 10]);
    return 0;
  };
  for (int thrashFirst = 0; thrashFirst < 2; ++thrashFirst) {
    for (int layout = 0; layout < 2; ++layout) {
      auto launch = [&] { expand<<<blocks, kThreads>>>(src, dst, offs[layout], tokens, stamps); };
      auto prepare = [&] {
        if (thrashFirst) {
          thrash<<<264, 256>>>(junk, kThrashBytes / 4, kPage / 4);
        } else {
          launch();
        }
      };
      if (measure(names[layout], thrashFirst ? "after an 8 GiB touch" : "warm (same launch before)", prepare, launch)) {
        return 2;
      }
    }
  }
  // Bulk stores (expandBulk), then half the rows each way (expandBulk<true>), TLB warm (the previous sample's
  // launch), both layouts.
  using Kernel = void (*)(const int4*, char*, const int64_t*, uint32_t, uint64_t*);
  const Kernel bulk[2] = {expandBulk<false>, expandBulk<true>};
  const char* bulkNames[2] = {"bulk stores (TMA), warm", "half TMA, half vector"};
  for (int mode = 0; mode < 2; ++mode) {
    PROBE_CHECK(cudaFuncSetAttribute(bulk[mode], cudaFuncAttributeMaxDynamicSharedMemorySize, kWarps * kUnitBytes));
    for (int layout = 0; layout < 2; ++layout) {
      auto launch = [&] {
        bulk[mode]<<<blocks, kThreads, kWarps * kUnitBytes>>>(src, dst, offs[layout], tokens, stamps);
      };
      if (measure(
              names[layout], bulkNames[mode], [] {}, launch))
        return 2;
    }
  }
  return 0;
}
