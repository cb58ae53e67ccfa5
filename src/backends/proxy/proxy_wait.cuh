// Mailbox and arrival waits, error records, the last-block hand-off, trace stamps, and the small warp helpers of the
// GPU proxy backend's kernels: the primitives every dispatch and combine kernel builds on. Part of proxy_kernels.cu's
// translation unit: include it only there.
//
// Ordering argument (docs/proxy.md): the channel's buffers, the tables and the mailbox are pinned host memory mapped
// into the GPU. A send kernel's blocks store into them, then __syncthreads() and thread 0's fence.acq_rel.sys plus a
// device-scope counter; the last block to arrive fences again and stores the round into the mailbox with
// st.release.sys (fence + barrier cumulativity: every block's stores are visible to the host first). The proxy thread
// writes received data and tables (the engine's copies, its own stores), then the arrival word with a release store;
// a receive block polls it with ld.acquire.sys, __syncthreads(), and its threads read the host memory with
// ld.volatile (relaxed, system scope: never a stale cached copy of an earlier round).
//
// Same-node peers (LocalGeometry): their entries and rows are stored into this rank's device region by their own
// kernels, whose last block fences at system scope and stores the round into this rank's flag for them
// (st.release.sys); block 0 of a receive kernel, after the proxy's arrival word, waits for every node peer's flag with
// ld.acquire.sys before it relays the round, so the relay covers both. The entries and rows are read with ld.volatile.
//
// Every wait is bounded: twice EPCOMM_TIMEOUT_MS (the proxy's own waits, which name the missing peer, fire first and
// raise the mailbox's abort word, which stops the kernels' waits at once). A kernel that gives up records an error in
// the host-mapped record and never traps.
#pragma once

#include <cuda_runtime.h>

#include "backends/proxy/proxy_kernels.hpp"
#include "core/layout.hpp"
#include "epcomm/device/ptx.cuh"

namespace epcomm {
namespace gpuproxy {
namespace {

using device::allowDependentGrids;
using device::fenceAcqRelSys;
using device::globalTimerNs;
using device::ldAcquireSys;
using device::ldVolatile16;
using device::st16;
using device::stReleaseSys;
using device::waitPreviousGrid;

constexpr int kSeqDispatchSend = 0;
constexpr int kSeqDispatchRecv = 1;
constexpr int kSeqCombineSend = 2;
constexpr int kSeqCombineRecv = 3;

constexpr uint32_t kRankThreads = kRankWarps * 32;
constexpr uint32_t kCopyThreads = 512;
constexpr uint32_t kSumThreads = 256;

// Work items of the copying kernels: one warp moves kChunkBytes of a row (kCopyBatch 16-byte loads per lane, all in
// flight before the first store), and the first chunk's warp also up to kScaleBatch scale words per lane.
constexpr uint32_t kCopyBatch = 4;
constexpr uint64_t kChunkBytes = kCopyBatch * 32 * 16;
constexpr uint32_t kScaleBatch = 4;

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
// Whether kernels must stop, from device memory alone (no PCIe round trip): a kernel halted the object. The proxy's
// abort word reaches the device through the waiting kernels: every wait that gives up (a timeout, the abort word, a
// halt) halts the object (haltObject), so a kernel that did not wait sees it here. A send kernel that follows only
// completed waits may run: the buffer-reuse argument (docs/proxy.md) rests on those waits, not on the proxy's health.
__device__ __forceinline__ bool deviceHalted(const DeviceState& st) { return (ldVolatileI32(claimWord(st)) & 2) != 0; }
// Halts the object without recording an error: a wait that gave up (the error is the proxy's, or the block that
// recorded the timeout has it).
__device__ __forceinline__ void haltObject(const DeviceState& st) { atomicOr(claimWord(st), 2); }
// Every thread of the block calls it (it synchronises the block): thread 0 reads the claim word, the block shares
// the answer.
__device__ __forceinline__ bool blockHalted(const DeviceState& st) {
  __shared__ int stop;
  if (threadIdx.x == 0) stop = deviceHalted(st) ? 1 : 0;
  __syncthreads();
  return stop != 0;
}

// The round's tables as the copy and combine kernels read them: the rank kernel's device copy (see
// ScratchGeometry::offTables), read with plain loads (written by an earlier kernel of the stream).
__device__ __forceinline__ const uint32_t* deviceTables(const DeviceState& st) {
  return reinterpret_cast<const uint32_t*>(st.scratch + st.sg.offTables);
}

// Records the first error of the object (later ones are dropped: the host reports one). `halt`: also stop every
// kernel of the object (a timeout or a corrupt buffer); a bad index only skips what it names. Scalar arguments: a
// reference to the kernel's parameters would make every kernel copy them to local memory.
__device__ __noinline__ void recordErrorAt(int32_t* claim, Mailbox* mailbox, int32_t phase, int32_t rank, int32_t peer,
                                           int64_t a, int64_t b, bool halt) {
  const int32_t old = atomicOr(claim, halt ? 3 : 1);
  if ((old & 1) != 0) return;
  publishKernelError(&mailbox->error, phase, rank, peer, a, b);
}
__device__ __forceinline__ void recordError(const DeviceState& st, int32_t phase, int32_t rank, int32_t peer, int64_t a,
                                            int64_t b, bool halt) {
  recordErrorAt(claimWord(st), st.mailbox, phase, rank, peer, a, b, halt);
}

// Thread 0: waits until `word` (the mailbox's, or a node peer's flag in this rank's region) reaches `want`
// (ld.acquire.sys), bounded by twice EPCOMM_TIMEOUT_MS; stops at once when the object halts. False when it gave up (a
// timeout is recorded, naming the phase and `peer`, -1 for the proxy).
__device__ __noinline__ bool waitMailboxAt(int32_t* claim, Mailbox* mailbox, uint64_t timeoutNs, const uint64_t* word,
                                           uint64_t want, int32_t phase, int32_t rank, int32_t peer = -1) {
  uint64_t v = ldAcquireSys(word);
  if (v >= want) return true;
  const uint64_t start = globalTimerNs();
  for (uint32_t i = 1;; ++i) {
    __nanosleep(64);
    v = ldAcquireSys(word);
    if (v >= want) return true;
    if ((i & 63) == 0) {
      if (haltedAt(claim, mailbox)) {
        // A halt or the proxy's abort says that the round will not complete, not that this word will not come: a
        // node peer that refused its combine had delivered its dispatch, and this thread may have been preempted
        // between its last poll and the look at the abort (several processes share a GPU). One more look after a
        // fence (with the volatile loads of haltedAt, an acquire of what the aborting side saw complete) decides.
        fenceAcqRelSys();
        return ldAcquireSys(word) >= want;
      }
      if (globalTimerNs() - start > 2 * timeoutNs) {
        recordErrorAt(claim, mailbox, phase, rank, peer, static_cast<int64_t>(v), static_cast<int64_t>(want), true);
        return false;
      }
    }
  }
}
// Thread 0 of every block: waits for the proxy's arrival word `which` (0 dispatch, 1 combine) to reach `want`, and
// for the `nFlags` flags of the node peers (ranks firstPeer, ...; phase flagPhase). Only block 0 polls them (one PCIe
// read stream instead of one per block); it relays the value into device memory (release at GPU scope after its
// system-scope acquires: the other blocks' acquire completes the chain) and the others poll that. Every block's wait
// is bounded; when block 0 gives up it halts the object, which stops them.
__device__ __noinline__ bool waitArrivalAt(int32_t* claim, Mailbox* mailbox, uint64_t timeoutNs, uint64_t* relay,
                                           const uint64_t* word, uint64_t want, int32_t phase, int32_t rank,
                                           const uint64_t* flags, uint32_t nFlags, uint32_t firstPeer,
                                           int32_t flagPhase) {
  if (blockIdx.x == 0) {
    if (!waitMailboxAt(claim, mailbox, timeoutNs, word, want, phase, rank)) return false;
    for (uint32_t i = 0; i < nFlags; ++i) {
      if (!waitMailboxAt(claim, mailbox, timeoutNs, flags + i, want, flagPhase, rank,
                         static_cast<int32_t>(firstPeer + i))) {
        return false;
      }
    }
    stReleaseGpu64(relay, want);
    return true;
  }
  if (ldAcquireGpu64(relay) >= want) return true;
  const uint64_t start = globalTimerNs();
  for (uint32_t i = 1;; ++i) {
    __nanosleep(32);
    if (ldAcquireGpu64(relay) >= want) return true;
    if ((i & 255) == 0) {
      if (haltedAt(claim, mailbox)) {
        fenceAcqRelSys();  // one more look, as in waitMailboxAt: block 0 may have relayed before the halt
        return ldAcquireGpu64(relay) >= want;
      }
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
  const uint64_t* flags = st.lg.size == 0
                              ? nullptr
                              : reinterpret_cast<const uint64_t*>(
                                    st.localMine + (which == 0 ? st.lg.offDispatchFlag : st.lg.offCombineFlag));
  return waitArrivalAt(claimWord(st), st.mailbox, st.timeoutNs, relay, word, want, phase, rank, flags, st.lg.size,
                       st.lg.first, which == 0 ? kPhaseLocalDispatch : kPhaseLocalCombine);
}

// Node rank r's region as this process maps it (st.lg.has(r)).
__device__ __forceinline__ uint8_t* localRegion(const DeviceState& st, uint32_t r) { return st.local[r - st.lg.first]; }

// Thread 0 of a send kernel's last block, after lastBlock's system fence: stores `round` into this rank's flag
// (`offFlag`: dispatch or combine) in every node rank's region, releasing every block's stores into them.
__device__ __forceinline__ void raiseLocalFlags(const DeviceState& st, uint32_t me, uint64_t offFlag, uint64_t round) {
  for (uint32_t i = 0; i < st.lg.size; ++i) {
    stReleaseSys(reinterpret_cast<uint64_t*>(st.local[i] + offFlag) + (me - st.lg.first), round);
  }
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

// Elastic ranks: the tables' masked words (TableGeometry::offMasked) in the device copy: [0] how many, [1 + r] rank r.
__device__ __forceinline__ const uint32_t* maskedWords(const DeviceState& st, const TableGeometry& tg) {
  return deviceTables(st) + tg.offMasked;
}
// Whether position (t, e) of a token of DP group `group` is dropped under `masked` (maskedWords): its sending rank
// (tokenSender) or its expert's rank (expertOwner) is masked.
__device__ __forceinline__ bool droppedByMask(const uint32_t* masked, uint32_t group, uint32_t t, uint32_t dpSize,
                                              uint32_t e, uint32_t numLocalExperts) {
  return masked[1 + tokenSender(group, t, dpSize)] != 0 || masked[1 + expertOwner(e, numLocalExperts)] != 0;
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
    uint32_t c[kRankWarps];  // every load first: one memory round trip, not kRankWarps dependent ones
#pragma unroll
    for (uint32_t w = 0; w < kRankWarps; ++w) c[w] = hist[w * keys + key];
    uint32_t run = base;
#pragma unroll
    for (uint32_t w = 0; w < kRankWarps; ++w) {
      hist[w * keys + key] = run;
      run += c[w];
    }
    if (totals != nullptr) totals[key] = run - base;
  }
}

}  // namespace
}  // namespace gpuproxy
}  // namespace epcomm
