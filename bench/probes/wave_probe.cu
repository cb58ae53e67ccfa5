// wave-probe: the decode dispatch's skeleton, to ask whether sending the payload in waves, each with its own fence and
// flag, lets the receivers expand the first wave while the next one is still on the link.
//
//   wave-probe [iters (default 200)] [tokens (default 128)]
//
// One process, two GPUs with peer access, one host thread per GPU, both sending to each other at once and timed the
// benchmark's way (device synchronize, a spin barrier of the two threads, event, launch, event). One kernel per GPU,
// 66 blocks of 512 threads:
//   blocks [0, 33)   warps 1-15 store this GPU's `tokens` slots (7392 bytes each: a decode token with its scales)
//                    into the peer's staging in `waves` waves of consecutive tokens; after each wave they arrive at a
//                    named barrier on which warp 0 waits, whose thread 0 then fences (fence.acq_rel.sys) and adds 1
//                    to the peer's flag of that wave (relaxed, system scope) while warps 1-15 go on to the next wave.
//                    Wave w > 0 is held until `gate` ns after the block started (the routing pass that the
//                    receivers' row tables need: its words would cross between the waves). Then warps 1-15, wave by
//                    wave, wait for the peer's flag of the wave (33 adds; thread 32 polls) and expand that wave's
//                    tokens into 4 local rows each (unit = token x quarter of the slot, one per warp,
//                    block-fastest), as the backend's peers' expansion does;
//   blocks [33, 66)  wait for the peer's flag of wave `ownAfter` (0: start at once) and until `ownGate` ns after their
//                    start, then expand this GPU's own tokens into 4 rows each (as the own-token blocks do once their
//                    row tables are in); with `join` (one wave) they then wait for the peer's flag and take every
//                    other unit of the peers' expansion (the payload blocks the rest).
// Every flag wait gives up after 1 s (the configuration is then reported as failed). The last block to finish resets
// the flags. Prints per configuration the median over iterations of the slower GPU's
// event time and of in-kernel stamps (us since the GPU's first block started; "max" over blocks): each wave's fence
// return, each wave's flag seen, and the exit. Never asserts a time: exits 77 without two peer GPUs.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "probe_check.hpp"

namespace {

constexpr uint32_t kThreads = 512, kWarps = kThreads / 32, kBlocks = 66, kSenders = 33;
constexpr uint32_t kSlot = 7392, kVecs = kSlot / 16, kRows = 4, kPieces = 4, kPieceVecs = 128, kMaxWaves = 4;
constexpr int kStamps = 2 + 2 * kMaxWaves + kMaxWaves;  // entry, exit, per wave fenced + stored, per wave flag seen
enum : int { kEntry = 0, kExit = 1, kStored = 2, kFenced = 2 + kMaxWaves, kSeen = 2 + 2 * kMaxWaves };

struct Args {
  const int4* x;               // [tokens][kVecs]
  int4* peerStaging;           // the peer's staging
  uint64_t* peerFlags;         // the peer's flags [kMaxWaves]
  const int4* staging;         // this GPU's staging, written by the peer
  uint64_t* flags;             // [kMaxWaves], added to by the peer
  uint32_t* done;              // blocks finished this round
  uint32_t* expired;           // flag waits that gave up (probe::waitFlagBounded)
  int4* rowsPeer;              // [tokens * kRows][kVecs]
  int4* rowsOwn;               // [tokens * kRows][kVecs]
  unsigned long long* stamps;  // [kBlocks][kStamps]
  uint32_t tokens, waves, ownAfter, expand;
  unsigned long long gateNs;
  uint32_t join;                 // the own blocks take every other unit of the peers' expansion (1 wave only)
  unsigned long long ownGateNs;  // the own blocks start their own rows no earlier than this after their start
};

__device__ __forceinline__ unsigned long long now() { return epcomm::device::globalTimerNs(); }

__device__ __forceinline__ uint32_t waveBegin(const Args& a, uint32_t w) { return a.tokens * w / a.waves; }

// Tokens [t0, t1) of `src` into 4 rows each of `rows`, unit = (token, piece) on warp `gw` of `warps`.
// With `split` = 2 the warps take the units of `parity` only (the other half is another group's).
__device__ void expand(const int4* src, int4* rows, uint32_t t0, uint32_t t1, uint32_t gw, uint32_t warps,
                       uint32_t split = 1, uint32_t parity = 0) {
  const uint32_t lane = threadIdx.x % 32;
  for (uint32_t u = gw * split + parity; u < (t1 - t0) * kPieces; u += warps * split) {
    const uint32_t t = t0 + u / kPieces, p = u % kPieces;
    int4 v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t vec = p * kPieceVecs + i * 32 + lane;
      if (vec < kVecs) v[i] = src[static_cast<uint64_t>(t) * kVecs + vec];
    }
#pragma unroll
    for (uint32_t r = 0; r < kRows; ++r) {
      int4* row = rows + (static_cast<uint64_t>(t) * kRows + r) * kVecs;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t vec = p * kPieceVecs + i * 32 + lane;
        if (vec < kVecs) row[vec] = v[i];
      }
    }
  }
}

// Named barriers: 1 + w = wave w stored (warps 1-15 arrive, warp 0 waits; one per wave, since the storing warps may
// run waves ahead of the fencing one), 1 + kMaxWaves = the receiving warps 1-15 among themselves.
constexpr uint32_t kReceivers = kThreads - 32;

__global__ void __launch_bounds__(kThreads, 1) waveKernel(const Args a) {
  unsigned long long* st = a.stamps + blockIdx.x * kStamps;
  const unsigned long long t0 = now();
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStamps; ++i) st[i] = 0;
    st[kEntry] = t0;
  }
  __syncthreads();
  const uint32_t warp = threadIdx.x / 32;
  if (blockIdx.x < kSenders) {
    if (warp == 0) {
      // The signaller: after each wave's stores (barrier 1), the fence and the peer's flag of that wave, while the
      // other warps go on storing the next wave.
      for (uint32_t w = 0; w < a.waves; ++w) {
        asm volatile("bar.sync %0, %1;" ::"r"(1 + w), "r"(kThreads) : "memory");
        if (threadIdx.x == 0) {
          st[kStored + w] = now();
          epcomm::device::fenceAcqRelSys();
          epcomm::device::redAddRelaxedSys(a.peerFlags + w, 1);
          st[kFenced + w] = now();
        }
      }
    } else {
      const uint32_t rt = threadIdx.x - 32;
      for (uint32_t w = 0; w < a.waves; ++w) {
        if (w > 0 && a.gateNs > 0) {
          while (now() < t0 + a.gateNs) {
          }
        }
        const uint64_t v0 = static_cast<uint64_t>(waveBegin(a, w)) * kVecs;
        const uint64_t v1 = static_cast<uint64_t>(waveBegin(a, w + 1)) * kVecs;
        for (uint64_t i = v0 + blockIdx.x * kReceivers + rt; i < v1; i += kSenders * kReceivers) {
          a.peerStaging[i] = a.x[i];
        }
        asm volatile("bar.arrive %0, %1;" ::"r"(1 + w), "r"(kThreads) : "memory");
      }
      // Receive wave by wave on warps 1-15 (thread 32 polls), expanding each wave as its flag comes in.
      for (uint32_t w = 0; w < a.waves; ++w) {
        if (rt == 0) {
          probe::waitFlagBounded(a.flags + w, kSenders, a.expired);
          st[kSeen + w] = now();
        }
        asm volatile("bar.sync %0, %1;" ::"r"(1 + kMaxWaves), "r"(kReceivers) : "memory");
        if (a.expand) {
          expand(a.staging, a.rowsPeer, waveBegin(a, w), waveBegin(a, w + 1), (warp - 1) * kSenders + blockIdx.x,
                 kSenders * (kWarps - 1), a.join ? 2 : 1, 0);
        }
      }
    }
  } else {
    if (a.ownAfter > 0) {
      if (threadIdx.x == 0) probe::waitFlagBounded(a.flags + a.ownAfter - 1, kSenders, a.expired);
      __syncthreads();
    }
    if (a.ownGateNs > 0) {
      while (now() < t0 + a.ownGateNs) {
      }
    }
    const uint32_t b = blockIdx.x - kSenders, blocks = kBlocks - kSenders;
    if (a.expand) expand(a.x, a.rowsOwn, 0, a.tokens, warp * blocks + b, blocks * kWarps);
    if (a.join) {
      if (threadIdx.x == 0) {
        probe::waitFlagBounded(a.flags, kSenders, a.expired);
        st[kSeen] = now();
      }
      __syncthreads();
      expand(a.staging, a.rowsPeer, 0, a.tokens, warp * blocks + b, blocks * kWarps, 2, 1);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    st[kExit] = now();
    if (atomicAdd(a.done, 1u) == gridDim.x - 1) {
      for (uint32_t w = 0; w < kMaxWaves; ++w) a.flags[w] = 0;
      *a.done = 0;
    }
  }
}

struct Side {
  int dev = 0;
  int4 *x = nullptr, *staging = nullptr, *rowsPeer = nullptr, *rowsOwn = nullptr;
  uint64_t* flags = nullptr;
  uint32_t *done = nullptr, *expired = nullptr;
  unsigned long long* stamps = nullptr;
  cudaStream_t s = nullptr;
};

struct Config {
  const char* name;
  uint32_t waves, ownAfter, expand;
  unsigned long long gateNs;
  uint32_t join;
  unsigned long long ownGateNs;
};

bool setup(Side& side, int dev, uint32_t tokens) {
  side.dev = dev;
  PROBE_OK(cudaSetDevice(dev));
  PROBE_OK(cudaDeviceEnablePeerAccess(1 - dev, 0));
  const size_t slots = static_cast<size_t>(tokens) * kSlot;
  PROBE_OK(cudaMalloc(&side.x, slots));
  PROBE_OK(cudaMalloc(&side.staging, slots));
  PROBE_OK(cudaMalloc(&side.rowsPeer, slots * kRows));
  PROBE_OK(cudaMalloc(&side.rowsOwn, slots * kRows));
  PROBE_OK(cudaMalloc(&side.flags, kMaxWaves * sizeof(uint64_t)));
  PROBE_OK(cudaMalloc(&side.done, sizeof(uint32_t)));
  PROBE_OK(cudaMalloc(&side.expired, sizeof(uint32_t)));
  PROBE_OK(cudaMalloc(&side.stamps, kBlocks * kStamps * sizeof(unsigned long long)));
  PROBE_OK(cudaMemset(side.x, 1 + dev, slots));
  PROBE_OK(cudaMemset(side.flags, 0, kMaxWaves * sizeof(uint64_t)));
  PROBE_OK(cudaMemset(side.done, 0, sizeof(uint32_t)));
  PROBE_OK(cudaMemset(side.expired, 0, sizeof(uint32_t)));
  PROBE_OK(cudaStreamCreateWithFlags(&side.s, cudaStreamNonBlocking));
  return true;
}

// Per iteration: event time and the stamps reduced to {fenced max, seen max} per wave and the exit max (us).
struct Sample {
  double event = 0, exit = 0, fenced[kMaxWaves] = {}, seen[kMaxWaves] = {};
};

bool sideLoop(Side& me, const Side& peer, uint32_t tokens, const Config& c, int iters, probe::PairBarrier& bar,
              std::vector<Sample>& out) {
  PROBE_OK(cudaSetDevice(me.dev));
  Args a{me.x,      peer.staging, peer.flags, me.staging, me.flags, me.done,  me.expired, me.rowsPeer, me.rowsOwn,
         me.stamps, tokens,       c.waves,    c.ownAfter, c.expand, c.gateNs, c.join,     c.ownGateNs};
  cudaEvent_t e0, e1;
  PROBE_OK(cudaEventCreate(&e0));
  PROBE_OK(cudaEventCreate(&e1));
  std::vector<unsigned long long> h(kBlocks * kStamps);
  for (int i = 0; i < iters + 20; ++i) {
    PROBE_OK(cudaDeviceSynchronize());
    bar.arrive();
    PROBE_OK(cudaEventRecord(e0, me.s));
    waveKernel<<<kBlocks, kThreads, 0, me.s>>>(a);
    PROBE_OK(cudaGetLastError());
    PROBE_OK(cudaEventRecord(e1, me.s));
    PROBE_OK(cudaEventSynchronize(e1));
    if (i < 20) continue;
    Sample s;
    float ms = 0;
    PROBE_OK(cudaEventElapsedTime(&ms, e0, e1));
    s.event = ms * 1e3;
    PROBE_OK(cudaMemcpy(h.data(), me.stamps, h.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    unsigned long long first = ~0ull;
    for (uint32_t b = 0; b < kBlocks; ++b) first = std::min(first, h[b * kStamps + kEntry]);
    auto rel = [&](unsigned long long t) { return t == 0 ? 0.0 : (t - first) / 1e3; };
    for (uint32_t b = 0; b < kBlocks; ++b) {
      const unsigned long long* st = &h[b * kStamps];
      s.exit = std::max(s.exit, rel(st[kExit]));
      for (uint32_t w = 0; w < kMaxWaves; ++w) {
        s.fenced[w] = std::max(s.fenced[w], rel(st[kFenced + w]));
        s.seen[w] = std::max(s.seen[w], rel(st[kSeen + w]));
      }
    }
    out.push_back(s);
  }
  PROBE_OK(cudaEventDestroy(e0));
  PROBE_OK(cudaEventDestroy(e1));
  return probe::noExpiredWaits("wave-probe", me.dev, me.expired);
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::max(1, std::atoi(argv[1])) : 200;
  const uint32_t tokens = argc > 2 ? static_cast<uint32_t>(std::max(4, std::atoi(argv[2]))) : 128;
  if (const int skip = probe::twoPeerGpus("wave-probe")) return skip;
  Side side[2];
  for (int d = 0; d < 2; ++d) {
    if (!setup(side[d], d, tokens)) return 2;
  }
  const Config configs[] = {
      {"1 wave, no rows", 1, 1, 0, 0},
      {"2 waves, no rows", 2, 1, 0, 0},
      {"4 waves, no rows", 4, 1, 0, 0},
      {"2 waves, gate 3.5, no rows", 2, 1, 0, 3500},
      {"1 wave", 1, 1, 1, 0},
      {"1 wave, own at once", 1, 0, 1, 0},
      {"2 waves", 2, 1, 1, 0},
      {"2 waves, gate 2.5", 2, 1, 1, 2500},
      {"2 waves, gate 3.5", 2, 1, 1, 3500},
      {"2 waves, own after 2", 2, 2, 1, 0},
      {"4 waves", 4, 1, 1, 0},
      {"4 waves, gate 3.5", 4, 1, 1, 3500},
      {"1 wave, own after 1, join", 1, 1, 1, 0, 1, 0},
      {"1 wave, own at once, join", 1, 0, 1, 0, 1, 0},
      {"1 wave, own at 2, join", 1, 0, 1, 0, 1, 2000},
      {"1 wave, own at 3, join", 1, 0, 1, 0, 1, 3000},
      {"1 wave, own at 4, join", 1, 0, 1, 0, 1, 4000},
  };
  std::printf("wave-probe: %u tokens of %u bytes per direction (%.2f MB), 4 rows each, %d iterations; medians, us\n",
              tokens, kSlot, tokens * kSlot / 1e6, iters);
  std::printf("%-26s %7s | %6s %6s %6s %6s | %6s %6s %6s %6s | %6s\n", "config", "event", "fence0", "fence1", "fence2",
              "fence3", "seen0", "seen1", "seen2", "seen3", "exit");
  int status = 0;
  for (const Config& c : configs) {
    probe::PairBarrier bar;
    std::vector<Sample> out[2];
    bool ok[2] = {false, false};
    std::thread t1([&] {
      ok[1] = sideLoop(side[1], side[0], tokens, c, iters, bar, out[1]);
      if (!ok[1]) bar.broken.store(true);
    });
    ok[0] = sideLoop(side[0], side[1], tokens, c, iters, bar, out[0]);
    if (!ok[0]) bar.broken.store(true);
    t1.join();
    if (!ok[0] || !ok[1]) {
      std::printf("%-26s failed\n", c.name);
      status = 1;
      break;
    }
    std::vector<double> ev, ex, fe[kMaxWaves], se[kMaxWaves];
    for (size_t i = 0; i < out[0].size(); ++i) {
      const Sample &s0 = out[0][i], &s1 = out[1][i];
      ev.push_back(std::max(s0.event, s1.event));
      ex.push_back(std::max(s0.exit, s1.exit));
      for (uint32_t w = 0; w < kMaxWaves; ++w) {
        fe[w].push_back(std::max(s0.fenced[w], s1.fenced[w]));
        se[w].push_back(std::max(s0.seen[w], s1.seen[w]));
      }
    }
    std::printf("%-26s %7.2f | %6.2f %6.2f %6.2f %6.2f | %6.2f %6.2f %6.2f %6.2f | %6.2f\n", c.name, probe::median(ev),
                probe::median(fe[0]), probe::median(fe[1]), probe::median(fe[2]), probe::median(fe[3]),
                probe::median(se[0]), probe::median(se[1]), probe::median(se[2]), probe::median(se[3]),
                probe::median(ex));
  }
  return status;
}
