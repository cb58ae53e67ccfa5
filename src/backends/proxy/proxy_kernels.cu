// Kernels of the GPU proxy backend: the "device side" of the proxy protocol (docs/protocol.md), writing and reading
// the channel's buffers in the wire format of src/proxy/protocol.hpp, exactly as the host backend's CPU loops do
// (src/backends/host/host_kernels.cc is their executable specification).
//
// Ordering argument (docs/proxy.md): the channel's buffers, the tables and the mailbox are pinned host memory mapped
// into the GPU. A send kernel's blocks store into them, then __syncthreads() and thread 0's fence.acq_rel.sys plus a
// device-scope counter; the last block to arrive fences again and stores the round into the mailbox with
// st.release.sys (fence + barrier cumulativity: every block's stores are visible to the host first). The proxy thread
// writes received data and tables (the engine's copies, its own stores), then the arrival word with a release store;
// a receive block polls it with ld.acquire.sys, __syncthreads(), and its threads read the host memory with
// ld.volatile (relaxed, system scope: never a stale cached copy of an earlier round).
//
// Every wait is bounded: twice EPCOMM_TIMEOUT_MS (the proxy's own waits, which name the missing peer, fire first and
// raise the mailbox's abort word, which stops the kernels' waits at once). A kernel that gives up records an error in
// the host-mapped record and never traps.
#include <cuda_runtime.h>

#include "backends/proxy/proxy_kernels.hpp"
#include "core/dtype_convert.hpp"
#include "core/layout.hpp"
#include "epcomm/device/ptx.cuh"

namespace epcomm {
namespace gpuproxy {

namespace {

using device::fenceAcqRelSys;
using device::globalTimerNs;
using device::ldAcquireSys;
using device::ldVolatile16;
using device::st16;
using device::stReleaseSys;

constexpr int kSeqDispatchSend = 0;
constexpr int kSeqDispatchRecv = 1;
constexpr int kSeqCombineSend = 2;
constexpr int kSeqCombineRecv = 3;

constexpr uint32_t kRankThreads = kRankWarps * 32;
constexpr uint32_t kCopyThreads = 512;
constexpr uint32_t kSumThreads = 256;

// Combine element types (CombineSendArgs::yType, CombineRecvArgs::outType): 0 bf16, 1 fp16, 2 fp32.
constexpr int kBf16 = 0;
constexpr int kF16 = 1;
constexpr int kF32 = 2;

// ---- Object state ------------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t* seqWord(const DeviceState& st, int i) {
  return reinterpret_cast<uint32_t*>(st.scratch + st.sg.offSeq) + i;
}
__device__ __forceinline__ uint32_t* doneWord(const DeviceState& st, int i) {
  return reinterpret_cast<uint32_t*>(st.scratch + st.sg.offDone) + i;
}
// Claimed word: bit 0 = an error was recorded, bit 1 = kernels must stop (the object's state is no longer valid).
__device__ __forceinline__ int32_t* claimWord(const DeviceState& st) {
  return reinterpret_cast<int32_t*>(st.scratch + st.sg.offClaimed);
}

__device__ __forceinline__ uint32_t ldVolatileU32(const void* p) {
  uint32_t v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint16_t ldVolatileU16(const void* p) {
  uint16_t v;
  asm volatile("ld.volatile.global.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int32_t ldVolatileI32(const void* p) { return static_cast<int32_t>(ldVolatileU32(p)); }
__device__ __forceinline__ uint64_t ldAcquireGpu64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void stReleaseGpu64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Whether kernels must stop: a kernel of this object halted it, or the proxy thread failed (mailbox abort).
__device__ __forceinline__ bool haltedAt(const int32_t* claim, const Mailbox* mailbox) {
  return (ldVolatileI32(claim) & 2) != 0 || ldVolatileI32(&mailbox->abort) != 0;
}
__device__ __forceinline__ bool halted(const DeviceState& st) { return haltedAt(claimWord(st), st.mailbox); }

// Records the first error of the object (later ones are dropped: the host reports one). `halt`: also stop every
// kernel of the object (a timeout or a corrupt buffer); a bad index only skips what it names. Scalar arguments: a
// reference to the kernel's parameters would make every kernel copy them to local memory.
__device__ __noinline__ void recordErrorAt(int32_t* claim, Mailbox* mailbox, int32_t phase, int32_t rank, int32_t peer,
                                           int64_t a, int64_t b, bool halt) {
  const int32_t old = atomicOr(claim, halt ? 3 : 1);
  if ((old & 1) != 0) return;
  volatile ErrorRecord* r = &mailbox->error;
  r->rank = rank;
  r->peer = peer;
  r->block = static_cast<int32_t>(blockIdx.x);
  r->a = a;
  r->b = b;
  __threadfence_system();
  r->code = phase;
  __threadfence_system();
}
__device__ __forceinline__ void recordError(const DeviceState& st, int32_t phase, int32_t rank, int32_t peer, int64_t a,
                                            int64_t b, bool halt) {
  recordErrorAt(claimWord(st), st.mailbox, phase, rank, peer, a, b, halt);
}

// Thread 0: waits until the mailbox word reaches `want` (ld.acquire.sys), bounded by twice EPCOMM_TIMEOUT_MS; stops
// at once when the object halts. False when it gave up (a timeout is recorded, naming the phase).
__device__ __noinline__ bool waitMailboxAt(int32_t* claim, Mailbox* mailbox, uint64_t timeoutNs, const uint64_t* word,
                                           uint64_t want, int32_t phase, int32_t rank) {
  uint64_t v = ldAcquireSys(word);
  if (v >= want) return true;
  const uint64_t start = globalTimerNs();
  for (uint32_t i = 1;; ++i) {
    __nanosleep(64);
    v = ldAcquireSys(word);
    if (v >= want) return true;
    if ((i & 63) == 0) {
      if (haltedAt(claim, mailbox)) return false;
      if (globalTimerNs() - start > 2 * timeoutNs) {
        recordErrorAt(claim, mailbox, phase, rank, -1, static_cast<int64_t>(v), static_cast<int64_t>(want), true);
        return false;
      }
    }
  }
}
// Thread 0 of every block: waits for the proxy's arrival word `which` (0 dispatch, 1 combine) to reach `want`. Only
// block 0 polls the host word (one PCIe read stream instead of one per block); it relays the value into device
// memory (release at GPU scope after its system-scope acquire: the other blocks' acquire completes the chain) and
// the others poll that. Every block's wait is bounded; when block 0 gives up it halts the object, which stops them.
__device__ __noinline__ bool waitArrivalAt(int32_t* claim, Mailbox* mailbox, uint64_t timeoutNs, uint64_t* relay,
                                           const uint64_t* word, uint64_t want, int32_t phase, int32_t rank) {
  if (blockIdx.x == 0) {
    if (!waitMailboxAt(claim, mailbox, timeoutNs, word, want, phase, rank)) return false;
    stReleaseGpu64(relay, want);
    return true;
  }
  if (ldAcquireGpu64(relay) >= want) return true;
  const uint64_t start = globalTimerNs();
  for (uint32_t i = 1;; ++i) {
    __nanosleep(32);
    if (ldAcquireGpu64(relay) >= want) return true;
    if ((i & 255) == 0) {
      if (haltedAt(claim, mailbox)) return false;
      // Block 0 records the timeout (naming the phase); this bound only guards against it never running.
      if (globalTimerNs() - start > 3 * timeoutNs) {
        recordErrorAt(claim, mailbox, phase, rank, -1, static_cast<int64_t>(ldAcquireGpu64(relay)),
                      static_cast<int64_t>(want), true);
        return false;
      }
    }
  }
}
__device__ __forceinline__ bool waitArrival(const DeviceState& st, int which, const uint64_t* word, uint64_t want,
                                            int32_t phase, int32_t rank) {
  uint64_t* relay = reinterpret_cast<uint64_t*>(st.scratch + st.sg.offArrived) + which;
  return waitArrivalAt(claimWord(st), st.mailbox, st.timeoutNs, relay, word, want, phase, rank);
}

// Every block of a launch calls this last (all threads). The last block to arrive runs `last` (thread 0), after
// every block's stores are visible at system scope, and resets the arrival counter for the next launch.
template <typename Last>
__device__ __forceinline__ void lastBlock(const DeviceState& st, int which, Last last) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  fenceAcqRelSys();
  const uint32_t arrived = atomicAdd(doneWord(st, which), 1u);
  if (arrived + 1 != gridDim.x) return;
  fenceAcqRelSys();
  *doneWord(st, which) = 0;
  last();
}

__device__ __forceinline__ void stamp(const DeviceState& st, uint32_t round, uint64_t TraceRound::*field) {
  if (st.trace != nullptr) {
    volatile uint64_t* p = &(st.trace[round % kTraceRounds].*field);
    *p = globalTimerNs();
  }
}

__device__ __forceinline__ uint32_t effectiveBound(const int32_t* boundM, uint32_t m) {
  if (boundM == nullptr) return m;
  const int32_t b = *boundM;
  if (b < 0) return 0;
  return static_cast<uint32_t>(b) < m ? static_cast<uint32_t>(b) : m;
}

__device__ __forceinline__ uint32_t laneId() { return threadIdx.x & 31; }
__device__ __forceinline__ uint32_t warpId() { return threadIdx.x >> 5; }

// The chunk [begin, end) of `n` items that warp w of kRankWarps ranks: chunks are contiguous and in warp order, so
// per-chunk counts and their prefix give every item its rank in item order (deterministic, no atomics).
__device__ __forceinline__ void warpChunk(uint32_t n, uint32_t w, uint32_t& begin, uint32_t& end) {
  const uint32_t chunk = (n + kRankWarps - 1) / kRankWarps;
  begin = min(n, w * chunk);
  end = min(n, begin + chunk);
}

// Exclusive prefix over the kRankWarps rows of hist[w][key] for every key (threads over keys); returns nothing,
// leaves each key's total in totals[key] when totals != null.
__device__ __forceinline__ void prefixOverWarps(uint32_t* hist, uint32_t keys, uint32_t* totals, uint32_t base) {
  for (uint32_t key = threadIdx.x; key < keys; key += blockDim.x) {
    uint32_t run = base;
    for (uint32_t w = 0; w < kRankWarps; ++w) {
      const uint32_t c = hist[w * keys + key];
      hist[w * keys + key] = run;
      run += c;
    }
    if (totals != nullptr) totals[key] = run - base;
  }
}

// ---- Dispatch send -----------------------------------------------------------------------------------------------

// One block of kRankThreads. Checks every index of the tokens < bound (every rank of a DP group checks the same
// tokens); writes the group tokens' experts (deduplicated, -1 masked) and, per (group sender d, expert e), the row of
// each (token, k) among d's rows of e (combine finds its rows with them); for this rank's own tokens, the entry index
// of each (token, owner) in the owner's send slot; and the head (expertCounts, entryCounts) into every send slot.
__global__ void __launch_bounds__(kRankThreads) dispatchRouteKernel(const DispatchSendArgs a) {
  const DeviceState& st = a.st;
  if (halted(st)) return;
  const proxy::ProtocolSizes& s = a.sizes;
  const uint32_t K = s.expertsPerToken, E = s.numExperts, L = s.numLocalExperts, W = s.worldSize, D = s.dpSize;
  const uint32_t me = s.rank, T = a.maxNumTokens;
  const uint32_t round = *seqWord(st, kSeqDispatchSend);
  if (threadIdx.x == 0) stamp(st, round, &TraceRound::packStart);
  const uint32_t bound = effectiveBound(a.boundM, a.m);
  if (threadIdx.x == 0) *reinterpret_cast<uint32_t*>(st.scratch + st.sg.offBound) = bound;
  int32_t* experts = reinterpret_cast<int32_t*>(st.scratch + st.sg.offExperts);
  uint64_t* pos = reinterpret_cast<uint64_t*>(st.scratch + st.sg.offPos);
  uint32_t* entryOf = reinterpret_cast<uint32_t*>(st.scratch + st.sg.offEntryOf);
  uint32_t* hist = reinterpret_cast<uint32_t*>(st.scratch + st.sg.offHist);

  auto load = [&](uint32_t t, uint32_t k) {
    return decodeIndex(a.indices, a.indexKind,
                       static_cast<int64_t>(t) * a.indexStrides[0] + static_cast<int64_t>(k) * a.indexStrides[1]);
  };
  // 1. Experts of every (t, k) of the call's maxNumTokens rows: masked, repeated, out of range (recorded) and rows
  //    >= bound are -1. pos / entryOf are cleared for all of them (a later combine reads them for its own rows).
  for (uint32_t i = threadIdx.x; i < T * K; i += blockDim.x) {
    const uint32_t t = i / K, k = i % K;
    int64_t e = -1;
    if (t < bound) {
      e = load(t, k);
      if (e < -1 || e >= static_cast<int64_t>(E)) {
        recordError(st, kPhaseBadIndex, static_cast<int32_t>(me), -1, t,
                    (static_cast<int64_t>(k) << 32) | static_cast<uint32_t>(static_cast<int32_t>(e)), false);
        e = -1;
      }
      for (uint32_t j = 0; j < k && e >= 0; ++j) {
        if (load(t, j) == e) e = -1;  // delivered once, at its first position
      }
    }
    experts[i] = static_cast<int32_t>(e);
    pos[i] = 0;
    entryOf[i] = ~0u;
  }
  __syncthreads();

  const uint32_t w = warpId(), lane = laneId();
  // 2. Rows per (group sender d, expert e): tokens t = d, d + D, ... in order, ranked per expert.
  for (uint32_t d = 0; d < D; ++d) {
    const uint32_t n = numTokensSentBy(d, bound, D);
    uint32_t begin, end;
    warpChunk(n, w, begin, end);
    uint32_t* row = hist + w * E;
    for (uint32_t e = lane; e < E; e += 32) row[e] = 0;
    __syncwarp();
    for (uint32_t i = begin; i < end; ++i) {
      const uint32_t t = d + i * D;
      for (uint32_t k = lane; k < K; k += 32) {
        const int32_t e = experts[t * K + k];
        if (e >= 0) ++row[e];  // a token's experts are distinct: no two lanes share e
      }
      __syncwarp();
    }
    __syncthreads();
    uint32_t* counts = reinterpret_cast<uint32_t*>(st.scratch + st.sg.offCounts);
    prefixOverWarps(hist, E, counts, 0);
    __syncthreads();
    if (d == me % D) {
      // Head, part 1: rows this rank sends each expert, the same in every send slot.
      for (uint32_t i = threadIdx.x; i < W * E; i += blockDim.x) {
        const uint32_t p = i / E, e = i % E;
        proxy::headExpertCounts(a.ch.send + s.sendSlotOffset(p))[e] = counts[e];
      }
    }
    for (uint32_t i = begin; i < end; ++i) {
      const uint32_t t = d + i * D;
      for (uint32_t k = lane; k < K; k += 32) {
        const int32_t e = experts[t * K + k];
        if (e >= 0) pos[t * K + k] = (static_cast<uint64_t>(e + 1) << 32) | row[e]++;
      }
      __syncwarp();
    }
    __syncthreads();
  }

  // 3. Entries per destination rank, for this rank's own tokens: one per (token, owner), tokens ascending.
  {
    const uint32_t d = me % D;
    const uint32_t n = numTokensSentBy(me, bound, D);
    uint32_t begin, end;
    warpChunk(n, w, begin, end);
    uint32_t* row = hist + w * W;
    for (uint32_t p = lane; p < W; p += 32) row[p] = 0;
    __syncwarp();
    // The first k of each owner among the token's experts (k order, as the host loop's first-use order).
    auto firstOfOwner = [&](uint32_t t, uint32_t k, int32_t e) {
      const uint32_t o = static_cast<uint32_t>(e) / L;
      for (uint32_t j = 0; j < k; ++j) {
        const int32_t f = experts[t * K + j];
        if (f >= 0 && static_cast<uint32_t>(f) / L == o) return false;
      }
      return true;
    };
    for (uint32_t i = begin; i < end; ++i) {
      const uint32_t t = d + i * D;
      for (uint32_t k = lane; k < K; k += 32) {
        const int32_t e = experts[t * K + k];
        if (e >= 0 && firstOfOwner(t, k, e)) ++row[static_cast<uint32_t>(e) / L];
      }
      __syncwarp();
    }
    __syncthreads();
    uint32_t* counts = reinterpret_cast<uint32_t*>(st.scratch + st.sg.offCounts);
    prefixOverWarps(hist, W, counts, 0);
    __syncthreads();
    // Head, part 2: entries this rank sends each rank.
    for (uint32_t i = threadIdx.x; i < W * W; i += blockDim.x) {
      const uint32_t p = i / W, q = i % W;
      proxy::headEntryCounts(a.ch.send + s.sendSlotOffset(p), E)[q] = counts[q];
    }
    for (uint32_t i = begin; i < end; ++i) {
      const uint32_t t = d + i * D;
      for (uint32_t k = lane; k < K; k += 32) {
        const int32_t e = experts[t * K + k];
        if (e >= 0 && firstOfOwner(t, k, e)) entryOf[t * K + k] = row[static_cast<uint32_t>(e) / L]++;
      }
      __syncwarp();
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) __threadfence_system();  // the heads (host memory) before the pack kernel's signal
}

// Many blocks: one warp per own token packs its entries ([payload][scales][u32 token][u16 n][u16 le[n]]) into the
// destinations' send slots; the last block signals dispatchReady.
__global__ void __launch_bounds__(kCopyThreads) dispatchPackKernel(const DispatchSendArgs a) {
  const DeviceState& st = a.st;
  if (halted(st)) return;
  const proxy::ProtocolSizes& s = a.sizes;
  const uint32_t K = s.expertsPerToken, L = s.numLocalExperts, D = s.dpSize, me = s.rank;
  const uint32_t round = *seqWord(st, kSeqDispatchSend);
  const uint32_t bound = *reinterpret_cast<const uint32_t*>(st.scratch + st.sg.offBound);
  const int32_t* experts = reinterpret_cast<const int32_t*>(st.scratch + st.sg.offExperts);
  const uint32_t* entryOf = reinterpret_cast<const uint32_t*>(st.scratch + st.sg.offEntryOf);
  const uint32_t n = numTokensSentBy(me, bound, D);
  const uint32_t lane = laneId();
  const uint32_t warps = gridDim.x * (blockDim.x / 32);
  const uint32_t scaleWords = static_cast<uint32_t>(s.scaleBytes / 4);
  for (uint32_t i = blockIdx.x + gridDim.x * warpId(); i < n; i += warps) {
    const uint32_t t = me % D + i * D;
    const uint8_t* xRow = a.x + static_cast<int64_t>(t) * a.xRowStrideBytes;
    for (uint32_t k = 0; k < K; ++k) {
      const uint32_t ent = entryOf[t * K + k];
      if (ent == ~0u) continue;  // warp-uniform
      const uint32_t owner = static_cast<uint32_t>(experts[t * K + k]) / L;
      uint8_t* entry = a.ch.send + s.sendSlotOffset(owner) + s.headBytes + static_cast<uint64_t>(ent) * s.entryBytes;
      for (uint64_t off = lane * 16ull; off < s.payloadBytes; off += 32 * 16) {
        st16(entry + off, *reinterpret_cast<const int4*>(xRow + off));
      }
      for (uint32_t j = lane; j < scaleWords; j += 32) {
        const uint32_t v =
            *reinterpret_cast<const uint32_t*>(a.xScale + 4 * (static_cast<int64_t>(t) * a.xScaleStrides[0] +
                                                               static_cast<int64_t>(j) * a.xScaleStrides[1]));
        reinterpret_cast<uint32_t*>(entry + s.payloadBytes)[j] = v;
      }
      // Metadata: this owner's local experts in k order (from k on: earlier k have other owners).
      uint8_t* meta = entry + s.metaOffset;
      uint32_t count = 0;
      for (uint32_t k0 = k; k0 < K; k0 += 32) {
        const uint32_t kk = k0 + lane;
        const int32_t e = kk < K ? experts[t * K + kk] : -1;
        const bool mine = e >= 0 && static_cast<uint32_t>(e) / L == owner;
        const uint32_t mask = __ballot_sync(0xffffffffu, mine);
        if (mine) {
          const uint32_t at = count + __popc(mask & ((1u << lane) - 1));
          reinterpret_cast<uint16_t*>(meta + proxy::kEntryExpertsOffset)[at] =
              static_cast<uint16_t>(static_cast<uint32_t>(e) % L);
        }
        count += __popc(mask);
      }
      if (lane == 0) {
        *reinterpret_cast<uint32_t*>(meta + proxy::kEntryTokenOffset) = t;
        *reinterpret_cast<uint16_t*>(meta + proxy::kEntryCountOffset) = static_cast<uint16_t>(count);
      }
    }
  }
  lastBlock(st, kSeqDispatchSend, [&] {
    *seqWord(st, kSeqDispatchSend) = round + 1;
    stamp(st, round, &TraceRound::packReady);
    stReleaseSys(&st.mailbox->dispatchReady, round + 1);
  });
}

// ---- Dispatch receive --------------------------------------------------------------------------------------------

__device__ __forceinline__ const uint8_t* entryAt(const DispatchRecvArgs& a, uint32_t src, uint32_t j,
                                                  uint32_t overflowStart) {
  const proxy::ProtocolSizes& s = a.sizes;
  // This rank's own entries are read in place from its send slot (no loopback), as the host backend does.
  if (src == s.rank)
    return a.ch.send + s.sendSlotOffset(s.rank) + s.headBytes + static_cast<uint64_t>(j) * s.entryBytes;
  return a.ch.recv + proxy::recvEntryOffset(s, src, j, overflowStart);
}

__device__ __forceinline__ uint32_t* entryCountOf(const DispatchRecvArgs& a, uint32_t src, uint32_t j) {
  return reinterpret_cast<uint32_t*>(a.st.scratch + a.st.sg.offEntryN) +
         static_cast<uint64_t>(src) * a.sizes.maxSendTokens + j;
}

__device__ __forceinline__ uint32_t* rowsOf(const DispatchRecvArgs& a, uint32_t src, uint32_t j) {
  return reinterpret_cast<uint32_t*>(a.st.scratch + a.st.sg.offRowOf) +
         (static_cast<uint64_t>(src) * a.sizes.maxSendTokens + j) * a.sizes.maxLocalPerEntry;
}

// One block per sender src (kRankThreads): waits for the proxy's arrival word, reads src's entries' metadata, and
// gives each (entry, local expert) its output row: rows of local expert le are ordered by (sender, token), and an
// entry's rank among src's entries naming le is its rank among src's tokens of that expert. Block 0 also writes
// outExpertNumTokens. Counts that disagree with src's head are recorded as a corrupt receive buffer.
__global__ void __launch_bounds__(kRankThreads) dispatchRankKernel(const DispatchRecvArgs a) {
  const DeviceState& st = a.st;
  const proxy::ProtocolSizes& s = a.sizes;
  const TableGeometry& tg = a.tg;
  const uint32_t L = s.numLocalExperts, W = s.worldSize, me = s.rank, src = blockIdx.x;
  __shared__ int ok;
  const uint32_t round = *seqWord(st, kSeqDispatchRecv);
  if (threadIdx.x == 0) {
    ok = !halted(st) &&
         waitArrival(st, 0, &st.mailbox->dispatchArrived, round + 1, kPhaseDispatchArrival, static_cast<int32_t>(me));
    if (ok && src == 0) stamp(st, round, &TraceRound::unpackStart);
  }
  __syncthreads();
  if (!ok) return;
  const uint32_t* tables = a.ch.tables;
  uint32_t n = ldVolatileU32(tables + tg.offEntries + src);
  if (n > s.maxSendTokens) {
    recordError(st, kPhaseCorruptEntry, static_cast<int32_t>(me), static_cast<int32_t>(src), n, s.maxSendTokens, true);
    n = 0;
  }
  const uint32_t overflowStart = ldVolatileU32(tables + tg.offOverflowStart + src);
  if (src == 0) {
    for (uint32_t le = threadIdx.x; le < L; le += blockDim.x) {
      a.outNumTokens[le] = static_cast<int32_t>(ldVolatileU32(tables + tg.offLocalRows + le));
    }
  }
  // Metadata into the scratch: one pass of parallel loads over host memory.
  for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
    const uint8_t* meta = entryAt(a, src, j, overflowStart) + s.metaOffset;
    uint32_t count = ldVolatileU16(meta + proxy::kEntryCountOffset);
    if (count < 1 || count > s.maxLocalPerEntry) {
      recordError(st, kPhaseCorruptEntry, static_cast<int32_t>(me), static_cast<int32_t>(src), j, count, true);
      count = 0;
    }
    uint32_t* rows = rowsOf(a, src, j);
    for (uint32_t i = 0; i < count; ++i) {
      uint32_t le = ldVolatileU16(meta + proxy::kEntryExpertsOffset + 2 * i);
      if (le >= L) {
        recordError(st, kPhaseCorruptEntry, static_cast<int32_t>(me), static_cast<int32_t>(src), j, le, true);
        le = 0;
        count = i;
      }
      rows[i] = le;
    }
    *entryCountOf(a, src, j) = count;
  }
  __syncthreads();
  uint32_t* hist = reinterpret_cast<uint32_t*>(st.scratch + st.sg.offRecvHist) + src * kRankWarps * L;
  const uint32_t w = warpId(), lane = laneId();
  uint32_t begin, end;
  warpChunk(n, w, begin, end);
  uint32_t* row = hist + w * L;
  for (uint32_t le = lane; le < L; le += 32) row[le] = 0;
  __syncwarp();
  for (uint32_t j = begin; j < end; ++j) {
    const uint32_t count = *entryCountOf(a, src, j);
    const uint32_t* rows = rowsOf(a, src, j);
    for (uint32_t i = lane; i < count; i += 32) ++row[rows[i]];  // an entry's experts are distinct
    __syncwarp();
  }
  __syncthreads();
  for (uint32_t le = threadIdx.x; le < L; le += blockDim.x) {
    const uint32_t first = ldVolatileU32(tables + tg.offSlotOffset + le * (W + 1) + src);
    const uint32_t next = ldVolatileU32(tables + tg.offSlotOffset + le * (W + 1) + src + 1);
    uint32_t run = ldVolatileU32(tables + tg.offOutputRowBase + le) + first;
    for (uint32_t v = 0; v < kRankWarps; ++v) {
      const uint32_t c = hist[v * L + le];
      hist[v * L + le] = run;
      run += c;
    }
    const uint32_t got = run - first - ldVolatileU32(tables + tg.offOutputRowBase + le);
    if (got != next - first) {
      recordError(st, kPhaseCorruptEntry, static_cast<int32_t>(me), static_cast<int32_t>(src),
                  (static_cast<int64_t>(le) << 32) | got, next - first, true);
    }
  }
  __syncthreads();
  for (uint32_t j = begin; j < end; ++j) {
    const uint32_t count = *entryCountOf(a, src, j);
    uint32_t* rows = rowsOf(a, src, j);
    for (uint32_t i = lane; i < count; i += 32) rows[i] = row[rows[i]]++;
    __syncwarp();
  }
  lastBlock(st, kSeqDispatchRecv, [&] { *seqWord(st, kSeqDispatchRecv) = round + 1; });
}

// Many blocks: one warp per received entry copies its payload and scales from host memory into each of its rows.
__global__ void __launch_bounds__(kCopyThreads) dispatchCopyKernel(const DispatchRecvArgs a) {
  const DeviceState& st = a.st;
  extern __shared__ uint32_t entryStart[];  // [W + 1]
  const proxy::ProtocolSizes& s = a.sizes;
  const TableGeometry& tg = a.tg;
  const uint32_t W = s.worldSize;
  if (halted(st)) return;  // the rank kernel gave up: the tables are not this round's
  for (uint32_t i = threadIdx.x; i <= W; i += blockDim.x) {
    entryStart[i] = ldVolatileU32(a.ch.tables + tg.offEntryStart + i);
  }
  __syncthreads();
  const bool batched = s.layout == Layout::kBatched;
  const uint64_t R = s.batchedRowsPerExpert;
  const uint32_t scaleWords = static_cast<uint32_t>(s.scaleBytes / 4);
  const uint32_t lane = laneId();
  const uint32_t warps = gridDim.x * (blockDim.x / 32);
  const uint32_t total = entryStart[W];
  uint32_t src = 0;
  for (uint32_t u = blockIdx.x + gridDim.x * warpId(); u < total; u += warps) {
    while (entryStart[src + 1] <= u) ++src;  // items ascend per warp: the sender only moves forward
    const uint32_t j = u - entryStart[src];
    const uint8_t* entry = entryAt(a, src, j, ldVolatileU32(a.ch.tables + tg.offOverflowStart + src));
    const uint32_t count = *entryCountOf(a, src, j);
    const uint32_t* rows = rowsOf(a, src, j);
    for (uint64_t off = lane * 16ull; off < s.payloadBytes; off += 32 * 16) {
      const int4 v = ldVolatile16(entry + off);
      for (uint32_t i = 0; i < count; ++i) {
        const uint64_t r = rows[i];
        const int64_t e = batched ? static_cast<int64_t>(r / R) : 0;
        const int64_t rr = batched ? static_cast<int64_t>(r % R) : static_cast<int64_t>(r);
        st16(a.outX + e * a.outExpertStrideBytes + rr * a.outRowStrideBytes + off, v);
      }
    }
    for (uint32_t c = lane; c < scaleWords; c += 32) {
      const uint32_t v = ldVolatileU32(entry + s.payloadBytes + 4 * c);
      for (uint32_t i = 0; i < count; ++i) {
        const uint64_t r = rows[i];
        const int64_t e = batched ? static_cast<int64_t>(r / R) : 0;
        const int64_t rr = batched ? static_cast<int64_t>(r % R) : static_cast<int64_t>(r);
        reinterpret_cast<uint32_t*>(a.outScale)[e * a.outScaleStrides[0] + rr * a.outScaleStrides[1] +
                                                static_cast<int64_t>(c) * a.outScaleStrides[2]] = v;
      }
    }
  }
  if (st.trace != nullptr) {
    const uint32_t round = *seqWord(st, kSeqDispatchRecv) - 1;  // the rank kernel advanced it
    lastBlock(st, kSeqDispatchRecv, [&] { stamp(st, round, &TraceRound::unpackEnd); });
  }
}

// ---- Combine send ------------------------------------------------------------------------------------------------

// Many blocks: row i of the combine send buffer (piece (g, le) = the rows of group g's senders for local expert le,
// pieces in (g, le) order) is a copy of expertY's row of that expert; the last block signals combineReady.
__global__ void __launch_bounds__(kCopyThreads) combineSendKernel(const CombineSendArgs a) {
  const DeviceState& st = a.st;
  extern __shared__ uint32_t smem[];  // sendCum[G * L + 1], srcStart[G * L]
  if (halted(st)) return;
  const proxy::ProtocolSizes& s = a.sizes;
  const TableGeometry& tg = a.tg;
  const uint32_t L = s.numLocalExperts, W = s.worldSize, D = s.dpSize, pieces = tg.G * L;
  const uint32_t round = *seqWord(st, kSeqCombineSend);
  if (blockIdx.x == 0 && threadIdx.x == 0) stamp(st, round, &TraceRound::combStart);
  uint32_t* sendCum = smem;
  uint32_t* srcStart = smem + pieces + 1;
  for (uint32_t i = threadIdx.x; i <= pieces; i += blockDim.x) {
    sendCum[i] = ldVolatileU32(a.ch.tables + tg.offSendCum + i);
    if (i < pieces) {
      const uint32_t g = i / L, le = i % L;
      srcStart[i] = ldVolatileU32(a.ch.tables + tg.offOutputRowBase + le) +
                    ldVolatileU32(a.ch.tables + tg.offSlotOffset + le * (W + 1) + g * D);
    }
  }
  __syncthreads();
  const bool batched = s.layout == Layout::kBatched;
  const uint64_t R = s.batchedRowsPerExpert;
  const uint64_t rowBytes = static_cast<uint64_t>(a.hidden) * a.itemBytes;
  const bool vec = rowBytes % 16 == 0;
  const uint32_t lane = laneId();
  const uint32_t warps = gridDim.x * (blockDim.x / 32);
  const uint32_t total = sendCum[pieces];
  uint32_t piece = 0;
  for (uint32_t i = blockIdx.x + gridDim.x * warpId(); i < total; i += warps) {
    while (sendCum[piece + 1] <= i) ++piece;
    const uint64_t r = srcStart[piece] + (i - sendCum[piece]);
    const int64_t off = batched
                            ? static_cast<int64_t>(r / R) * a.yExpertStride + static_cast<int64_t>(r % R) * a.yRowStride
                            : static_cast<int64_t>(r) * a.yRowStride;
    const uint8_t* src = a.y + off * a.itemBytes;
    uint8_t* dst = a.ch.combineSend + static_cast<uint64_t>(i) * rowBytes;
    if (vec) {
      for (uint64_t b = lane * 16ull; b < rowBytes; b += 32 * 16) {
        st16(dst + b, *reinterpret_cast<const int4*>(src + b));
      }
    } else {
      for (uint64_t b = lane * 2ull; b < rowBytes; b += 32 * 2) {
        *reinterpret_cast<uint16_t*>(dst + b) = *reinterpret_cast<const uint16_t*>(src + b);
      }
    }
  }
  lastBlock(st, kSeqCombineSend, [&] {
    *seqWord(st, kSeqCombineSend) = round + 1;
    *reinterpret_cast<volatile int32_t*>(&st.mailbox->combineType) = a.yType;
    stamp(st, round, &TraceRound::combReady);
    fenceAcqRelSys();
    stReleaseSys(&st.mailbox->combineReady, round + 1);
  });
}

// ---- Combine receive ---------------------------------------------------------------------------------------------

// Conversions are core/dtype_convert.hpp's, the reference's own: the same rounding (nearest even) and NaN bits.
template <int kType>
__device__ __forceinline__ float toFloat(const uint8_t* p) {
  if (kType == kBf16) return bf16ToFloat(ldVolatileU16(p));
  if (kType == kF16) return f16ToFloat(ldVolatileU16(p));
  return bitsFloat(ldVolatileU32(p));
}
template <int kType>
__device__ __forceinline__ float loadOut(const uint8_t* p) {
  if (kType == kBf16) return bf16ToFloat(*reinterpret_cast<const uint16_t*>(p));
  if (kType == kF16) return f16ToFloat(*reinterpret_cast<const uint16_t*>(p));
  return *reinterpret_cast<const float*>(p);
}
template <int kType>
__device__ __forceinline__ void storeOut(uint8_t* p, float v) {
  if (kType == kBf16) {
    *reinterpret_cast<uint16_t*>(p) = floatToBf16(v);
  } else if (kType == kF16) {
    *reinterpret_cast<uint16_t*>(p) = floatToF16(v);
  } else {
    *reinterpret_cast<float*>(p) = v;
  }
}
template <int kType>
__host__ __device__ constexpr uint32_t itemOf() {
  return kType == kF32 ? 4 : 2;
}

// Elements of expertY one thread reads with one 16-byte load.
template <int kY>
__device__ __forceinline__ void unpack16(const int4 v, float* f) {
  const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                         static_cast<uint32_t>(v.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (kY == kF32) {
      f[i] = bitsFloat(w[i]);
    } else {
      const uint16_t lo = static_cast<uint16_t>(w[i] & 0xffff), hi = static_cast<uint16_t>(w[i] >> 16);
      f[2 * i] = kY == kBf16 ? bf16ToFloat(lo) : f16ToFloat(lo);
      f[2 * i + 1] = kY == kBf16 ? bf16ToFloat(hi) : f16ToFloat(hi);
    }
  }
}

// Many blocks: waits for the proxy's arrival word; then for each token t < bound (one block at a time) and each
// element, out = (accumulate ? out : 0) + sum_k w[t,k] * y(t,k) in fp32, k ascending, each product and sum rounded
// separately (no FMA: the reference's operations), rounded once to the output type. y(t,k) is the row of (t, k) in
// its owner's message: rowBase[d][e] (the owner's rows of e from the group's senders before d) + the row the
// dispatch gave (t, k) among its sender's rows of e (the route kernel's pos).
template <int kY, int kOut>
__global__ void __launch_bounds__(kSumThreads) combineRecvKernel(const CombineRecvArgs a) {
  const DeviceState& st = a.st;
  extern __shared__ uint32_t smem[];  // rowBase[D * E], recvStart[W], then K term pointers and weights
  const proxy::ProtocolSizes& s = a.sizes;
  const TableGeometry& tg = a.tg;
  const uint32_t K = s.expertsPerToken, E = s.numExperts, L = s.numLocalExperts, W = s.worldSize, D = s.dpSize;
  const uint32_t me = s.rank;
  __shared__ int ok;
  const uint32_t round = *seqWord(st, kSeqCombineRecv);
  if (threadIdx.x == 0) {
    ok = !halted(st) &&
         waitArrival(st, 1, &st.mailbox->combineArrived, round + 1, kPhaseCombineArrival, static_cast<int32_t>(me));
    if (ok && blockIdx.x == 0) stamp(st, round, &TraceRound::sumStart);
  }
  __syncthreads();
  if (!ok) return;
  uint32_t* rowBase = smem;
  uint32_t* recvStart = rowBase + D * E;
  const uint8_t** termRow = reinterpret_cast<const uint8_t**>((reinterpret_cast<uintptr_t>(recvStart + W + 1) + 7) &
                                                              ~static_cast<uintptr_t>(7));
  float* termW = reinterpret_cast<float*>(termRow + K);
  for (uint32_t i = threadIdx.x; i < D * E; i += blockDim.x)
    rowBase[i] = ldVolatileU32(a.ch.tables + tg.offRowBase + i);
  for (uint32_t i = threadIdx.x; i < W; i += blockDim.x)
    recvStart[i] = ldVolatileU32(a.ch.tables + tg.offRecvStart + i);
  __syncthreads();
  const uint64_t* pos = reinterpret_cast<const uint64_t*>(st.scratch + st.sg.offPos);
  const uint32_t H = a.hidden;
  const uint64_t rowBytes = static_cast<uint64_t>(H) * itemOf<kY>();
  const uint32_t bound = effectiveBound(a.boundM, a.m);
  constexpr uint32_t kVec = 16 / itemOf<kY>();
  const bool vec = rowBytes % 16 == 0;
  auto load = [&](uint32_t t, uint32_t k) {
    return decodeIndex(a.indices, a.indexKind,
                       static_cast<int64_t>(t) * a.indexStrides[0] + static_cast<int64_t>(k) * a.indexStrides[1]);
  };
  for (uint32_t t = blockIdx.x; t < bound; t += gridDim.x) {
    for (uint32_t k = threadIdx.x; k < K; k += blockDim.x) {
      const uint8_t* rowPtr = nullptr;
      int64_t e = load(t, k);
      if (e < -1 || e >= static_cast<int64_t>(E)) {
        recordError(st, kPhaseCombineBadIndex, static_cast<int32_t>(me), -1, t,
                    (static_cast<int64_t>(k) << 32) | static_cast<uint32_t>(static_cast<int32_t>(e)), false);
        e = -1;
      }
      if (e >= 0) {
        uint32_t first = k;  // a repeated expert's row is its first position's
        for (uint32_t j = 0; j < k; ++j) {
          if (load(t, j) == e) {
            first = j;
            break;
          }
        }
        const uint64_t v = pos[static_cast<uint64_t>(t) * K + first];
        if ((v >> 32) != static_cast<uint64_t>(e + 1)) {
          recordError(st, kPhaseCombineIndex, static_cast<int32_t>(me), -1, t,
                      (static_cast<int64_t>(k) << 32) | static_cast<uint32_t>(e), false);
        } else {
          const uint32_t owner = static_cast<uint32_t>(e) / L;
          const uint64_t row = recvStart[owner] + rowBase[(t % D) * E + e] + static_cast<uint32_t>(v);
          rowPtr = (owner == me ? a.ch.combineSend : a.ch.combineRecv) + row * rowBytes;
        }
      }
      termRow[k] = rowPtr;
      termW[k] =
          rowPtr != nullptr
              ? a.weights[static_cast<int64_t>(t) * a.weightStrides[0] + static_cast<int64_t>(k) * a.weightStrides[1]]
              : 0.f;
    }
    __syncthreads();
    uint8_t* out = a.out + static_cast<int64_t>(t) * a.outRowStride * itemOf<kOut>();
    if (vec) {
      for (uint32_t h0 = threadIdx.x * kVec; h0 < H; h0 += blockDim.x * kVec) {
        float acc[kVec];
#pragma unroll
        for (uint32_t i = 0; i < kVec; ++i)
          acc[i] = a.accumulate ? loadOut<kOut>(out + (h0 + i) * itemOf<kOut>()) : 0.f;
        for (uint32_t k = 0; k < K; ++k) {
          const uint8_t* y = termRow[k];
          if (y == nullptr) continue;
          float f[kVec];
          unpack16<kY>(ldVolatile16(y + static_cast<uint64_t>(h0) * itemOf<kY>()), f);
          const float wk = termW[k];
#pragma unroll
          for (uint32_t i = 0; i < kVec; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(wk, f[i]));
        }
#pragma unroll
        for (uint32_t i = 0; i < kVec; ++i) storeOut<kOut>(out + (h0 + i) * itemOf<kOut>(), acc[i]);
      }
    } else {
      for (uint32_t h = threadIdx.x; h < H; h += blockDim.x) {
        float acc = a.accumulate ? loadOut<kOut>(out + h * itemOf<kOut>()) : 0.f;
        for (uint32_t k = 0; k < K; ++k) {
          const uint8_t* y = termRow[k];
          if (y == nullptr) continue;
          acc = __fadd_rn(acc, __fmul_rn(termW[k], toFloat<kY>(y + static_cast<uint64_t>(h) * itemOf<kY>())));
        }
        storeOut<kOut>(out + h * itemOf<kOut>(), acc);
      }
    }
    __syncthreads();
  }
  lastBlock(st, kSeqCombineRecv, [&] {
    *seqWord(st, kSeqCombineRecv) = round + 1;
    stamp(st, round, &TraceRound::sumEnd);
  });
}

__global__ void clockProbeKernel(uint64_t* out) { *reinterpret_cast<volatile uint64_t*>(out) = globalTimerNs(); }

template <int kY>
const void* combineRecvFor(int outType) {
  switch (outType) {
    case kBf16:
      return reinterpret_cast<const void*>(&combineRecvKernel<kY, kBf16>);
    case kF16:
      return reinterpret_cast<const void*>(&combineRecvKernel<kY, kF16>);
    default:
      return reinterpret_cast<const void*>(&combineRecvKernel<kY, kF32>);
  }
}

int launch(const void* fn, uint32_t blocks, uint32_t threads, size_t smem, const void* args, void* stream) {
  void* params[] = {const_cast<void*>(args)};
  return static_cast<int>(
      cudaLaunchKernel(fn, dim3(blocks), dim3(threads), params, smem, static_cast<cudaStream_t>(stream)));
}

}  // namespace

int launchDispatchSend(const DispatchSendArgs& a, uint32_t blocks, void* stream) {
  int rc = launch(reinterpret_cast<const void*>(&dispatchRouteKernel), 1, kRankThreads, 0, &a, stream);
  if (rc != 0) return rc;
  return launch(reinterpret_cast<const void*>(&dispatchPackKernel), blocks, kCopyThreads, 0, &a, stream);
}

int launchDispatchRecv(const DispatchRecvArgs& a, uint32_t blocks, void* stream) {
  int rc = launch(reinterpret_cast<const void*>(&dispatchRankKernel), a.sizes.worldSize, kRankThreads, 0, &a, stream);
  if (rc != 0) return rc;
  return launch(reinterpret_cast<const void*>(&dispatchCopyKernel), blocks, kCopyThreads, copySharedBytes(a.sizes), &a,
                stream);
}

int launchCombineSend(const CombineSendArgs& a, uint32_t blocks, void* stream) {
  return launch(reinterpret_cast<const void*>(&combineSendKernel), blocks, kCopyThreads,
                combineSendSharedBytes(a.sizes), &a, stream);
}

uint64_t combineRecvSharedBytes(const proxy::ProtocolSizes& s) {
  const uint64_t words = static_cast<uint64_t>(s.dpSize) * s.numExperts + s.worldSize + 1;
  return ((4 * words + 7) & ~uint64_t{7}) + 12ull * s.expertsPerToken;
}

int launchCombineRecv(const CombineRecvArgs& a, uint32_t blocks, void* stream) {
  const void* fn = nullptr;
  switch (a.yType) {
    case kBf16:
      fn = combineRecvFor<kBf16>(a.outType);
      break;
    case kF16:
      fn = combineRecvFor<kF16>(a.outType);
      break;
    default:
      fn = combineRecvFor<kF32>(a.outType);
      break;
  }
  return launch(fn, blocks, kSumThreads, combineRecvSharedBytes(a.sizes), &a, stream);
}

int configureKernels(uint32_t bytes) {
  const void* fns[] = {
      reinterpret_cast<const void*>(&dispatchCopyKernel),
      reinterpret_cast<const void*>(&combineSendKernel),
      reinterpret_cast<const void*>(&combineRecvKernel<kBf16, kBf16>),
      reinterpret_cast<const void*>(&combineRecvKernel<kBf16, kF16>),
      reinterpret_cast<const void*>(&combineRecvKernel<kBf16, kF32>),
      reinterpret_cast<const void*>(&combineRecvKernel<kF16, kBf16>),
      reinterpret_cast<const void*>(&combineRecvKernel<kF16, kF16>),
      reinterpret_cast<const void*>(&combineRecvKernel<kF16, kF32>),
      reinterpret_cast<const void*>(&combineRecvKernel<kF32, kBf16>),
      reinterpret_cast<const void*>(&combineRecvKernel<kF32, kF16>),
      reinterpret_cast<const void*>(&combineRecvKernel<kF32, kF32>),
  };
  for (const void* fn : fns) {
    const cudaError_t rc =
        cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (rc != cudaSuccess) return static_cast<int>(rc);
  }
  return 0;
}

int launchClockProbe(uint64_t* out, void* stream) {
  return launch(reinterpret_cast<const void*>(&clockProbeKernel), 1, 1, 0, &out, stream);
}

}  // namespace gpuproxy
}  // namespace epcomm
