// Flags, bounded waits, error records and per-launch preamble of the nvlink kernels: the primitives every dispatch
// and combine kernel builds on. Part of nvlink_kernels.cu's translation unit: include it only there.
//
// Ordering argument used throughout: a block's threads store into a peer's region (weak stores), then
// __syncthreads(), then thread 0 issues fence.acq_rel.sys and a red.release.sys add on the peer's flag. The receiver
// polls the flag with ld.acquire.sys, then __syncthreads(), and its threads read the data with ordinary loads:
// barrier + fence cumulativity make every store of the sending block visible before the flag increment. Tagged words
// (the round in the same 8 bytes) need neither: the value and its round arrive together.
#pragma once

#include <cuda_runtime.h>

#include "backends/nvlink/nvlink_kernels.hpp"
#include "core/abort_board.hpp"
#include "epcomm/device/ptx.cuh"

namespace epcomm {
namespace nvlink {
namespace {

using device::fenceAcqRelSys;
using device::globalTimerNs;
using device::laneMaskLt;
using device::ldAcquireSys;
using device::ldGlobalNc16;
using device::ldRelaxedGpu;
using device::ldRelaxedSys;
using device::redAddRelaxedSys;
using device::st16;
using device::stRelaxedSys;
using device::stRelaxedSys2;

// Flag arrays (index `which` of flagPtr), see nvlink_layout.hpp.
constexpr int kFlagDispatch = 0;
constexpr int kFlagCombineDone = 1;

__device__ __forceinline__ uint64_t* flagPtr(char* base, const Geometry& g, int which, uint32_t sender) {
  return reinterpret_cast<uint64_t*>(base + g.offFlags) + which * g.worldSize + sender;
}

// Diagnostics: thread 0 stamps phase `p` of this block when tracing is on (one predicated branch otherwise).
__device__ __forceinline__ void tracePoint(const DeviceState& st, int p) {
  if (st.trace != nullptr && threadIdx.x == 0) st.trace[blockIdx.x * kTracePhases + p] = globalTimerNs();
}

// Global warp number of this thread's warp among `blocks` blocks, block-fastest: work unit i goes to block
// i % blocks, so a few hundred units (decode) spread over every SM instead of filling the first blocks' warps
// (measured with EPCOMM_NVLINK_TRACE, decode T = 128: the last payload block stored at 2.4-2.8 us instead of 3.4-4.8).
__device__ __forceinline__ uint32_t spreadWarp(uint32_t blockRel, uint32_t blocks) {
  return (threadIdx.x / 32) * blocks + blockRel;
}

__device__ __forceinline__ bool abortedAt(const int32_t* claimed) {
  return *reinterpret_cast<const volatile int32_t*>(claimed) != 0;
}
__device__ __forceinline__ bool aborted(const DeviceState& st) { return abortedAt(st.claimed); }

// The abort word next to the error record (core/abort_board.hpp): 0, or s + 1 once peer rank s aborted. Host-mapped:
// read only in the slow path of a wait. An acquire load at system scope: the peer's host set it with a seq_cst store,
// so what was visible to that host before (the stores of the peer's kernels it saw complete, and all they had seen)
// is visible to this thread's loads after one that sees it set (spinSlow's second look).
__device__ __forceinline__ uint32_t peerAbortOf(const ErrorRecord* hostError) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];"
               : "=r"(v)
               : "l"(reinterpret_cast<const char*>(hostError) + kAbortWordOffset)
               : "memory");
  return v;
}

// The first error wins; later ones are dropped (the host reports one and the object refuses further use).
// Scalar arguments: as a __noinline__ function taking `const DeviceState&` it made every kernel copy its parameters to
// local memory (ptxas: 440-520 bytes of stack) and decode got ~10 us slower (docs/nvlink.md).
__device__ __forceinline__ void recordErrorAt(int32_t* claimed, ErrorRecord* hostError, int32_t phase, int32_t rank,
                                              int32_t peer, int64_t a, int64_t b) {
  if (atomicCAS(claimed, 0, 1) != 0) return;
  publishKernelError(hostError, phase, rank, peer, a, b);
}
__device__ __forceinline__ void recordError(const DeviceState& st, int32_t phase, int32_t rank, int32_t peer, int64_t a,
                                            int64_t b) {
  recordErrorAt(st.claimed, st.hostError, phase, rank, peer, a, b);
}

// A waited-on word: a flag (acquire loads), ready once it reached `want`, or a tagged word (tagWord, relaxed loads),
// ready once its tag is `want`.
template <bool kTagged>
__device__ __forceinline__ uint64_t loadWaited(const uint64_t* word) {
  return kTagged ? ldRelaxedSys(word) : ldAcquireSys(word);
}
template <bool kTagged>
__device__ __forceinline__ bool waitedReady(uint64_t v, uint64_t want) {
  return kTagged ? (v >> 32) == want : v >= want;
}

// Records that a peer aborted (its abort word is set), for the wait `who` (as spinSlow's). Out of line: the slow path
// of every wait stays as small as before.
__device__ __noinline__ void recordPeerAbort(int32_t* claimed, ErrorRecord* hostError, uint32_t who) {
  recordErrorAt(claimed, hostError, kPhasePeerAbort, static_cast<int32_t>((who >> 8) & 0xff),
                static_cast<int32_t>(peerAbortOf(hostError)) - 1, static_cast<int64_t>(who & 0xff),
                static_cast<int64_t>((who >> 16) & 0xff));
}

// The spin of spinOn once the word was not ready at the first look: out of line, so every wait inlines one load and
// a compare, and the loop, its timeout checks and the error record exist once per kernel (code size: instruction
// fetch bounded the decode dispatch, docs/nvlink.md). Returns the last value seen.
// Every 256 polls it checks whether another wait failed (then it stops) and whether `patience` x EPCOMM_TIMEOUT_MS
// passed: then it records (phase, peer, the value or tag seen, want) and stops; and whether a peer aborted (its abort
// word): then, unless the word is ready at one more look, it records that and stops. Never traps.
template <bool kTagged>
__device__ __noinline__ uint64_t spinSlow(const uint64_t* word, uint64_t want, int32_t* claimed, ErrorRecord* hostError,
                                          uint64_t timeoutNs, uint32_t who) {
  const uint64_t start = globalTimerNs();
  for (uint32_t i = 1;; ++i) {
    const uint64_t v = loadWaited<kTagged>(word);
    if (waitedReady<kTagged>(v, want)) return v;
    if ((i & 255) == 0) {
      if (abortedAt(claimed)) return v;
      // A peer that refused its call (or whose object failed) set this rank's abort word (core/abort_board.hpp):
      // recorded as (kPhasePeerAbort, the peer; the phase and peer of this wait), and the wait stops, unless the word
      // is ready at a second look after the abort word. An abort says that the round will not complete, not that
      // this wait's data will not come: a rank that refuses its combine after its dispatch's synchronize() has
      // delivered all of that dispatch, and a peer still inside that dispatch finishes it (its combine then reports
      // the abort). v may be older than the abort word (a kernel on a GPU shared by several processes is preempted
      // between any two instructions): the word loaded again after the acquire in peerAbortOf shows every store and
      // flag increment that the aborting rank's host saw its kernels complete before it raised the abort.
      if (peerAbortOf(hostError) != 0) {
        const uint64_t again = loadWaited<kTagged>(word);
        if (waitedReady<kTagged>(again, want)) return again;
        recordPeerAbort(claimed, hostError, who);
        return again;
      }
      if (globalTimerNs() - start > (who >> 24) * timeoutNs) {
        recordErrorAt(claimed, hostError, static_cast<int32_t>(who & 0xff), static_cast<int32_t>((who >> 8) & 0xff),
                      static_cast<int32_t>((who >> 16) & 0xff), static_cast<int64_t>(kTagged ? v >> 32 : v),
                      static_cast<int64_t>(want));
        return v;
      }
    }
  }
}

// Spins on *word until it is ready (waitedReady). `v`: the last value seen. False when the wait stopped (spinSlow): it
// timed out (recorded) or another wait failed.
static_assert(kMaxRanks <= 256, "spinOn passes ranks to spinSlow in a byte");
template <bool kTagged>
__device__ __forceinline__ bool spinOn(const uint64_t* word, uint64_t want, const DeviceState& st, int32_t phase,
                                       int32_t rank, int32_t peer, uint32_t patience, uint64_t& v) {
  v = loadWaited<kTagged>(word);
  if (waitedReady<kTagged>(v, want)) return true;
  // (phase, rank, peer, patience) in one word, a byte each (ranks < kMaxRanks, peers >= 0), so the call
  // passes fewer registers (the fused combine kernels are at their register limit).
  const uint32_t who = static_cast<uint32_t>(phase) | static_cast<uint32_t>(rank) << 8 |
                       static_cast<uint32_t>(peer) << 16 | patience << 24;
  v = spinSlow<kTagged>(word, want, st.claimed, st.hostError, st.timeoutNs, who);
  return waitedReady<kTagged>(v, want);
}

// Spins until *flag >= expected (see spinOn). `patience`: the timeout in units of EPCOMM_TIMEOUT_MS. A wait on this
// rank's own blocks passes 2: when they are late, they are themselves waiting for a peer, and their wait, which
// times out first, is the error worth reporting (it names the peer). Without that the two timed out together and
// either could be recorded first (a fused combine-recv named its own rank when the peer never entered combine).
__device__ bool waitFlag(const uint64_t* flag, uint64_t expected, const DeviceState& st, int32_t phase, int32_t rank,
                         int32_t peer, uint32_t patience = 1) {
  uint64_t v;
  return spinOn<false>(flag, expected, st, phase, rank, peer, patience, v);
}

// Spins until the tagged word (tagWord) carries `round`, then returns its value in `value` (see spinOn).
__device__ bool waitTagged(const uint64_t* word, uint32_t round, const DeviceState& st, int32_t phase, int32_t rank,
                           int32_t peer, uint32_t& value) {
  uint64_t v;
  if (!spinOn<true>(word, round, st, phase, rank, peer, 1, v)) return false;
  value = static_cast<uint32_t>(v);
  return true;
}

// The patience of a wait on flag `which` of rank `peer` (see waitFlag).
__device__ __forceinline__ uint32_t patienceFor(const Geometry& g, uint32_t peer) {
  return peer == g.rank && g.worldSize > 1 ? 2 : 1;
}

// Block-wide: waits for flag `which` of every rank in `mask` to reach `expected`. False (in every thread) on failure.
__device__ bool waitRanks(char* local, const Geometry& g, int which, uint32_t mask, uint64_t expected,
                          const DeviceState& st, int32_t phase) {
  bool ok = true;
  if (threadIdx.x < g.worldSize && ((mask >> threadIdx.x) & 1)) {
    ok = waitFlag(flagPtr(local, g, which, threadIdx.x), expected, st, phase, static_cast<int32_t>(g.rank),
                  static_cast<int32_t>(threadIdx.x), patienceFor(g, threadIdx.x));
  }
  return __syncthreads_and(ok ? 1 : 0) != 0;
}

// Bit r set for every active rank r (every rank unless elastic ranks masked some: Geometry::live).
__device__ __forceinline__ uint32_t allRanksMask(const Geometry& g) { return g.live; }

// Whether rank r is active (Geometry::live): a masked rank is never stored into, signalled or waited for.
__device__ __forceinline__ bool liveRank(const Geometry& g, uint32_t r) { return ((g.live >> r) & 1u) != 0; }

// Block-wide: waitRanks over every rank.
__device__ bool waitAllRanks(char* local, const Geometry& g, int which, uint64_t expected, const DeviceState& st,
                             int32_t phase) {
  return waitRanks(local, g, which, allRanksMask(g), expected, st, phase);
}

// One thread: signals flag `which` of every rank (one increment per block) after the block's stores, which the caller
// has ordered before it (a block barrier). One system fence, then relaxed adds: the fence + strong write is the
// release pattern (red.release would add a fence per add).
__device__ void signalRanks(char* const* peers, const Geometry& g, int which) {
  fenceAcqRelSys();
  for (uint32_t d = 0; d < g.worldSize; ++d) {
    if (liveRank(g, d)) redAddRelaxedSys(flagPtr(peers[d], g, which, g.rank), 1);
  }
}
// Block-wide: the barrier after the block's stores, then thread 0 signals (signalRanks).
__device__ void signalAllRanks(char* const* peers, const Geometry& g, int which) {
  __syncthreads();
  if (threadIdx.x == 0) signalRanks(peers, g, which);
}

// Dynamic schedules of the dispatch's expansions: work queues (DeviceState::queues), one counter per queue and
// round parity. (Combine keeps static shares: with queues its prefill send took 16 us longer, docs/nvlink.md.)
constexpr int kQueueDispatchOwn = 0;
constexpr int kQueueDispatchPeers = 1;
static_assert(kQueueDispatchPeers < static_cast<int>(kQueues), "DeviceState::queues holds kQueues queues");

__device__ __forceinline__ uint32_t* queueOf(const DeviceState& st, int queue, uint32_t round) {
  return st.queues + queue * 2 + (round & 1);
}

// Thread 0 of block 0 of a dispatch send (or fused) kernel of round `round` clears the queues of round + 1. Their
// last user was round - 1's kernel, which ended before this one started (one stream), and round + 1's kernels start
// after this one ends. Every dispatch has a send kernel, so every round clears its successor's queues.
__device__ __forceinline__ void clearNextQueues(const DeviceState& st, uint32_t round) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *queueOf(st, kQueueDispatchOwn, round + 1) = 0;
    *queueOf(st, kQueueDispatchPeers, round + 1) = 0;
  }
}

__device__ __forceinline__ int64_t loadIndex(const void* base, int kind, const int64_t* strides, uint32_t t,
                                             uint32_t k) {
  return decodeIndex(base, kind, static_cast<int64_t>(t) * strides[0] + static_cast<int64_t>(k) * strides[1]);
}

// The words a kernel's blocks read before their first step: the block's two round counters of the kernel's kind, the
// device token bound (INT32_MAX without one) and whether an earlier kernel failed. Loaded together, one round trip;
// loaded one after the other (the error claim, its branch, then the counters and the bound) they were two before the
// first payload load, routing pass or poll of every block.
struct Preamble {
  uint32_t seqSend, seqRecv;
  int32_t bound;
  bool aborted;
};
__device__ __forceinline__ Preamble loadPreamble(const DeviceState& st, int sendCounter, int recvCounter,
                                                 const int32_t* boundM) {
  const uint32_t B = gridDim.x;
  Preamble p;
  p.seqSend = ldRelaxedGpu(st.seq + sendCounter * B + blockIdx.x);
  p.seqRecv = ldRelaxedGpu(st.seq + recvCounter * B + blockIdx.x);
  p.bound = boundM != nullptr ? static_cast<int32_t>(ldRelaxedGpu(boundM)) : INT32_MAX;
  // abortedAt's load, written as asm like the three above so that the four stay in this order, before any use.
  uint32_t claim;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(claim) : "l"(st.claimed));
  p.aborted = claim != 0;
  return p;
}

// Tokens of a call with `m` rows and the preamble's bound.
__device__ __forceinline__ uint32_t effectiveBound(int32_t bound, uint32_t m) {
  if (bound < 0) return 0;
  return static_cast<uint32_t>(bound) < m ? static_cast<uint32_t>(bound) : m;
}

}  // namespace
}  // namespace nvlink
}  // namespace epcomm
