// Dispatch and combine kernels of the nvlink backend. See docs/nvlink.md for the protocol and the measurements
// behind the choices; nvlink_layout.hpp for the buffer layout.
//
// Ordering argument used throughout: a block's threads store into a peer's region (weak stores), then
// __syncthreads(), then thread 0 issues fence.acq_rel.sys and a red.release.sys add on the peer's flag. The receiver
// polls the flag with ld.acquire.sys, then __syncthreads(), and its threads read the data with ordinary loads:
// barrier + fence cumulativity make every store of the sending block visible before the flag increment. Tagged words
// (the round in the same 8 bytes) and line mode's tagged lines need neither: the value and its round arrive together.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "backends/nvlink/nvlink_kernels.hpp"
#include "epcomm/device/ptx.cuh"

namespace epcomm {
namespace nvlink {

namespace {

using device::fenceAcqRelSys;
using device::globalTimerNs;
using device::laneMaskLt;
using device::ldAcquireGpu;
using device::ldAcquireSys;
using device::ldGlobalNc16;
using device::ldRelaxedGpu;
using device::ldRelaxedSys;
using device::ldVolatile16;
using device::prefetchL2;
using device::redAddRelaxedSys;
using device::st16;
using device::stRelaxedSys;
using device::stRelaxedSys2;

// Vectors per lane per combine work unit (see combineSendBody).
constexpr int kChunkU = 4;

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

// The first error wins; later ones are dropped (the host reports one and the object refuses further use).
// Scalar arguments: as a __noinline__ function taking `const DeviceState&` it made every kernel copy its parameters to
// local memory (ptxas: 440-520 bytes of stack) and decode got ~10 us slower (docs/nvlink.md).
__device__ __forceinline__ void recordErrorAt(int32_t* claimed, ErrorRecord* hostError, int32_t phase, int32_t rank,
                                              int32_t peer, int64_t a, int64_t b) {
  if (atomicCAS(claimed, 0, 1) != 0) return;
  volatile ErrorRecord* r = hostError;
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
                                            int64_t b) {
  recordErrorAt(st.claimed, st.hostError, phase, rank, peer, a, b);
}

// The check every 256 polls of a spin that began at `start`: true when it is to stop, because another wait failed
// (the kernel is aborting) or because `patience` x EPCOMM_TIMEOUT_MS passed; then `expired` is true and the caller
// records its error, which names what did not arrive. Line mode's spins use it. (spinSlow makes the same two checks
// itself: through this helper it took one register more, and the kernel for every path, at its limit, spilled.)
__device__ __forceinline__ bool spinStops(const DeviceState& st, uint64_t start, uint32_t patience, bool& expired) {
  expired = false;
  if (aborted(st)) return true;
  expired = globalTimerNs() - start > patience * st.timeoutNs;
  return expired;
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

// The spin of spinOn once the word was not ready at the first look: out of line, so every wait inlines one load and
// a compare, and the loop, its timeout checks and the error record exist once per kernel (code size: instruction
// fetch bounded the decode dispatch, docs/nvlink.md, fourteenth and fifteenth passes). Returns the last value seen.
// Every 256 polls it checks whether another wait failed (then it stops) and whether `patience` x EPCOMM_TIMEOUT_MS
// passed: then it records (phase, peer, the value or tag seen, want) and stops. Never traps.
template <bool kTagged>
__device__ __noinline__ uint64_t spinSlow(const uint64_t* word, uint64_t want, int32_t* claimed, ErrorRecord* hostError,
                                          uint64_t timeoutNs, uint32_t who) {
  const uint64_t start = globalTimerNs();
  for (uint32_t i = 1;; ++i) {
    const uint64_t v = loadWaited<kTagged>(word);
    if (waitedReady<kTagged>(v, want)) return v;
    if ((i & 255) == 0) {
      if (abortedAt(claimed)) return v;
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

// Bit r set for every rank r.
__device__ __forceinline__ uint32_t allRanksMask(const Geometry& g) {
  return g.worldSize >= 32 ? 0xffffffffu : (1u << g.worldSize) - 1;
}

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
  for (uint32_t d = 0; d < g.worldSize; ++d) redAddRelaxedSys(flagPtr(peers[d], g, which, g.rank), 1);
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
// Line mode: not a work queue but the round's gate, counting the warps that stored their indices (openGate).
constexpr int kQueueLineIndices = 2;

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
    *queueOf(st, kQueueLineIndices, round + 1) = 0;
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

// Per receiver: for each local expert, the first row of each sender's tokens (senderBase[s][le]) and the expert's
// first row (rowBase[le]: 0 in the batched layout, where the expert stride does the work; the padded prefix sum in
// the packed layout). Deterministic: rows ordered by (sender, token).
struct RowTables {
  int32_t* senderBase;  // [W][L]
  int32_t* total;       // [L]
  int32_t* rowBase;     // [L]
  int32_t* tokens;      // [W]: tokens each sender sent this round (its n_s)
  bool ok;              // false: a sender's counts never arrived (recorded); nothing else is valid
};

// Work items over the tokens that were actually sent (sum of n_s, not W x Ts slots: an engine sizes maxNumTokens
// for its largest batch and decodes far fewer): item -> (sender s, its token j). `skip`: a sender left out (the own
// rank for the peers' share), or W for none.
__device__ __forceinline__ uint32_t sentTokens(const RowTables& rt, uint32_t W, uint32_t skip) {
  uint32_t n = 0;
  for (uint32_t s = 0; s < W; ++s) n += s == skip ? 0 : static_cast<uint32_t>(rt.tokens[s]);
  return n;
}
__device__ __forceinline__ void sentItem(const RowTables& rt, uint32_t W, uint32_t skip, uint32_t item, uint32_t& s,
                                         uint32_t& j) {
  j = item;
  for (s = 0; s + 1 < W; ++s) {
    const uint32_t n = s == skip ? 0 : static_cast<uint32_t>(rt.tokens[s]);
    if (j < n) return;
    j -= n;
  }
}

// Barriers of the threads [first, blockDim.x) of a block (first a multiple of 32): the block's barrier when first is
// 0, else named barrier 1 over those threads only (the fused dispatch's own-token blocks in pull mode build their
// row tables without warp 0, which waits for its pushes' fence meanwhile). groupAnd: the barrier and the AND of `v`.
constexpr uint32_t kGroupBarrier = 1;
constexpr uint32_t kHandoffBarrier = 2;  // warp 0 waits there for the others' row tables (arrive / sync)
__device__ __forceinline__ bool groupAnd(uint32_t first, bool v) {
  if (first == 0) return __syncthreads_and(v ? 1 : 0) != 0;
  uint32_t r;
  asm volatile("{ .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.and.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q; }"
               : "=r"(r)
               : "r"(v ? 1u : 0u), "n"(kGroupBarrier), "r"(blockDim.x - first)
               : "memory");
  return r != 0;
}
__device__ __forceinline__ void groupSync(uint32_t first) {
  if (first == 0) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;" ::"n"(kGroupBarrier), "r"(blockDim.x - first) : "memory");
  }
}

// The group [first, blockDim.x): the first row of every local expert from the experts' row totals. Batched layout:
// 0 (the expert stride does the work), stored by the whole group. Packed: the prefix sum of the padded totals, by the
// group's first warp: each lane sums a run of ceil(L / 32) consecutive experts, one warp scan of the 32 sums, then
// each lane writes its run's bases. (It was a scan per 32 experts, a chain of L / 32 x 5 dependent shuffles: ~1.2 us
// for 256 experts on H200, which every receiver of the batched layout also spent on its way to its tables until it
// got its own path; docs/nvlink.md, twenty-second pass.) The caller synchronises afterwards.
__device__ void expertRowBases(const int32_t* total, int32_t* rowBase, uint32_t L, bool packed, uint32_t padding,
                               uint32_t first = 0) {
  if (threadIdx.x < first) return;
  if (!packed) {
    for (uint32_t le = threadIdx.x - first; le < L; le += blockDim.x - first) rowBase[le] = 0;
    return;
  }
  if (threadIdx.x >= first + 32) return;
  const uint32_t lane = threadIdx.x - first, run = (L + 31) / 32;
  const uint32_t lo = min(L, lane * run), hi = min(L, lo + run);
  auto padded = [&](uint32_t le) {
    return static_cast<int32_t>(roundUpPow2(static_cast<uint64_t>(total[le]), padding));
  };
  int32_t sum = 0;
  for (uint32_t le = lo; le < hi; ++le) sum += padded(le);
  int32_t inc = sum;
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t n = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= static_cast<uint32_t>(o)) inc += n;
  }
  int32_t base = inc - sum;
  for (uint32_t le = lo; le < hi; ++le) {
    rowBase[le] = base;
    base += padded(le);
  }
}

// The row tables' places in smem (computeRows fills them; a thread that did not take part gets them here with its
// group's result in `ok`).
__device__ __forceinline__ RowTables rowTablesAt(const Geometry& g, int32_t* smem, bool ok) {
  const uint32_t W = g.worldSize, L = g.numLocalExperts;
  return RowTables{smem, smem + W * L, smem + (W + 1) * L, smem + (W + 2) * L, ok};
}

// Thread `tid` of a group: tid < W polls sender tid's token count of dispatch `round` (a tagged word) into tokens[tid];
// with `routeFlag` > 0 (the combine after a line-mode dispatch, whose receivers saw no flag) threads 32 .. 32 + W
// wait until every rank's dispatch flag reaches it: the acquire that orders this combine's stores into the peers'
// buffers after the peers' previous reads of them (docs/nvlink.md, Combine send). The caller's barrier orders it
// before what follows. Returns this thread's success.
__device__ bool pollSenders(char* local, const Geometry& g, int32_t* tokens, uint32_t round, const DeviceState& st,
                            uint64_t routeFlag, uint32_t tid) {
  const uint32_t W = g.worldSize;
  const int32_t rank = static_cast<int32_t>(g.rank);
  bool ok = true;
  if (tid < W) {
    uint32_t n = 0;
    ok = waitTagged(reinterpret_cast<const uint64_t*>(local + g.offNumTokens) + tid, round, st, kPhaseDispatchRecv,
                    rank, static_cast<int32_t>(tid), n);
    tokens[tid] = static_cast<int32_t>(n);
  }
  // Another warp, so the two polls overlap.
  if (routeFlag > 0 && tid >= 32 && tid < 32 + W) {
    const uint32_t s = tid - 32;
    ok = waitFlag(flagPtr(local, g, kFlagDispatch, s), routeFlag, st, kPhaseDispatchRecv, rank, static_cast<int32_t>(s),
                  patienceFor(g, s));
  }
  return ok;
}

// Block-wide (the dispatch's receivers). The counts and token counts are tagged words (tagWord) of the senders'
// dispatch `round`: every thread polls its share, so the tables are ready as soon as the words land (no route flag,
// no fence behind the payload). `first`: only the threads [first, blockDim.x) take part (groupAnd); rowTablesAt()
// gives the others the result.
__device__ RowTables computeRows(char* local, const Geometry& g, int32_t* smem, bool packed, uint32_t padding,
                                 uint32_t round, const DeviceState& st, uint32_t first = 0) {
  const uint32_t W = g.worldSize, L = g.numLocalExperts;
  const uint32_t tid = threadIdx.x - first, threads = blockDim.x - first;
  RowTables rt = rowTablesAt(g, smem, true);
  const uint64_t* counts = reinterpret_cast<const uint64_t*>(local + g.offCounts);
  const int32_t rank = static_cast<int32_t>(g.rank);
  // The token counts by the group's last W threads, the counts from its first: thread 0 polled both one after the
  // other, a round trip more before the tables (W = 1 trace, docs/nvlink.md, twenty-second pass).
  bool ok = pollSenders(local, g, rt.tokens, round, st, 0, threads - 1 - tid);
  for (uint32_t le = tid; le < L; le += threads) {
    int32_t acc = 0;
    for (uint32_t s = 0; s < W && ok; ++s) {
      uint32_t c = 0;
      ok = waitTagged(counts + s * L + le, round, st, kPhaseDispatchRecv, rank, static_cast<int32_t>(s), c);
      rt.senderBase[s * L + le] = acc;
      acc += static_cast<int32_t>(c);
    }
    rt.total[le] = acc;
  }
  rt.ok = groupAnd(first, ok);
  if (!rt.ok) return rt;
  expertRowBases(rt.total, rt.rowBase, L, packed, padding, first);
  groupSync(first);
  return rt;
}

// ---------------------------------------------------------------------------------------------------------------
// Dispatch

// Routing blocks of the send half (R = g.routeBlocks; decode: 1): per-expert positions of this rank's tokens (a
// stable counting sort by expert, in token order) and counts, written into every receiver with the token's K routing
// entries. Positions are computed here, by the one rank that knows its tokens, so the receiver needs only a W x L
// prefix sum. Routing block c owns tokens [c * routeChunk, (c + 1) * routeChunk); with R > 1 each first counts its
// chunk per expert, publishes the histogram in routeScratch, waits for the other routing blocks of this rank (same
// GPU) and starts its positions at the sum of the earlier chunks' counts. `round`: this send's number (1-based).
// Line mode sends only the token count (its receivers rank the tokens themselves, and the combine takes each entry's
// row from rowSlots); the pass still checks every index. Returns false if the wait for the other routing blocks timed
// out (recorded).
__device__ bool dispatchRouting(const DispatchKernelArgs& a, uint32_t n, int32_t* smem, uint32_t chunk,
                                uint32_t round) {
  const Geometry& g = a.g;
  const uint32_t E = g.numExperts, L = g.numLocalExperts, K = g.topK, W = g.worldSize, D = g.dpSize;
  const uint32_t R = g.routeBlocks;
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t lo = min(n, chunk * g.routeChunk), hi = min(n, lo + g.routeChunk);
  const bool emit = !g.lines;                          // entries and counts (see above)
  const uint32_t warps = blockWarps(g);                // the scan tables' rows, as sharedBytes(g) sized them
  uint32_t* bits = reinterpret_cast<uint32_t*>(smem);  // [warps][E]: lanes of the warp's 32 tokens per expert
  int32_t* base = smem + warps * E;                    // [warps][E]: tokens before this warp's 32
  int32_t* running = smem + 2 * warps * E;             // [E]
  // The token count first: the receivers' row tables need it with the counts.
  if (chunk == 0 && threadIdx.x < W) {
    stRelaxedSys(reinterpret_cast<uint64_t*>(a.peers[threadIdx.x] + g.offNumTokens) + g.rank, tagWord(round, n));
  }
  for (uint32_t i = threadIdx.x; i < warps * E; i += blockDim.x) bits[i] = 0;
  for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) running[e] = 0;
  __syncthreads();
  tracePoint(a.st, kTrRouteSetup);
  // One pass = up to blockDim.x tokens, one per lane of `tokenWarps` warps. When the pass has fewer tokens than the
  // block has threads (decode: 128 tokens, 4 of 16 warps), the other warps take a share of the token's entry pairs
  // (k0, k0 + 1): warp = group * tokenWarps + token warp, group g marks and emits pairs g, g + groups, ... So a thread
  // does K / (2 * groups) pairs instead of K / 2 (decode K = 8: one pair), and the scan runs over tokenWarps rows.
  // A repeated expert finds its own lane bit already set: atomicOr's old value marks it (dupMask, k < 64), so no
  // k^2 re-reading of the token's indices. Which of a token's repeats carries the mark may differ between runs
  // (different warps); exactly one does not, all have the same position, and neither expansion nor combine
  // depends on which one it is.
  auto pass = [&](uint32_t jb, bool emitEntries) {
    const uint32_t tokenWarps = static_cast<uint32_t>(ceilDiv(min(hi - jb, blockDim.x), 32));
    const uint32_t pairs = (K + 1) / 2, groups = min(pairs, warps / tokenWarps);
    const uint32_t tw = warp % tokenWarps, group = warp / tokenWarps;
    const uint32_t j = jb + tw * 32 + lane;
    const bool active = j < hi && group < groups;
    const uint32_t t = j * D + g.rank % D;
    // Compact code: loops are not unrolled and the token's indices are re-read (L1 hits after the first load)
    // instead of kept in an unrolled register array. A/B on 2x H200: decode dispatch 1-2 us faster than the unrolled
    // form (docs/nvlink.md, third pass).
    auto index = [&](uint32_t k) { return loadIndex(a.indices, a.indexKind, a.indexStrides, t, k); };
    uint64_t dupMask = 0;
    auto mark = [&](uint32_t k, int64_t e) {
      if (e < -1 || e >= static_cast<int64_t>(E)) {
        recordError(a.st, kPhaseBadIndex, static_cast<int32_t>(g.rank), -1, t,
                    (static_cast<int64_t>(k) << 32) | static_cast<uint32_t>(e));
        return;
      }
      if (e < 0) return;
      const uint32_t old = atomicOr(&bits[tw * E + static_cast<uint32_t>(e)], 1u << lane);
      if (old & (1u << lane)) dupMask |= 1ull << k;
    };
    if (active) {
#pragma unroll 1
      for (uint32_t k = 2 * group; k < K; k += 2 * groups) {
        mark(k, index(k));
        if (k + 1 < K) mark(k + 1, index(k + 1));
      }
    }
    __syncthreads();
    tracePoint(a.st, kTrRouteMarked);
    for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) {
      int32_t r = running[e];
#pragma unroll 1
      for (uint32_t w = 0; w < tokenWarps; ++w) {
        base[w * E + e] = r;
        r += __popc(bits[w * E + e]);
      }
      running[e] = r;
    }
    __syncthreads();
    tracePoint(a.st, kTrRouteScanned);
    if (emitEntries && active) {
      // Entries k0 and k0 + 1 travel as one 16-byte store per receiver (odd K: the last pair's second entry is
      // padding); the pairs of consecutive tokens are adjacent (routeIndex), so the warp's stores are coalesced.
      auto emit = [&](uint32_t k0, int64_t e0, int64_t e1) {
        const int64_t ek[2] = {e0, e1};
        int32_t le[2] = {-1, -1}, pos[2] = {0, 0};
        uint32_t owner[2] = {W, W};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t k = k0 + h;
          if (k < K && ek[h] >= 0 && ek[h] < static_cast<int64_t>(E)) {
            const uint32_t ue = static_cast<uint32_t>(ek[h]);
            le[h] = static_cast<int32_t>(ue % L) | ((dupMask >> k) & 1 ? kDupBit : 0);
            pos[h] = base[tw * E + ue] + __popc(bits[tw * E + ue] & laneMaskLt());
            owner[h] = ue / L;
          }
        }
        const uint64_t off = g.offRoute + routeIndex(K, g.slotsPerSender, g.rank, j, k0) * sizeof(uint64_t);
        for (uint32_t d = 0; d < W; ++d) {
          const RouteEntry e0{d == owner[0] ? le[0] : -1, d == owner[0] ? pos[0] : 0};
          const RouteEntry e1{d == owner[1] ? le[1] : -1, d == owner[1] ? pos[1] : 0};
          stRelaxedSys2(reinterpret_cast<uint64_t*>(a.peers[d] + off), tagWord(round, packEntry(e0)),
                        tagWord(round, packEntry(e1)));
        }
      };
#pragma unroll 1
      for (uint32_t k0 = 2 * group; k0 < K; k0 += 2 * groups) emit(k0, index(k0), k0 + 1 < K ? index(k0 + 1) : -1);
    }
    __syncthreads();
    tracePoint(a.st, kTrRouteEmitted);
    for (uint32_t i = threadIdx.x; i < tokenWarps * E; i += blockDim.x) bits[i] = 0;
    __syncthreads();
  };
  // This rank's count of expert e's tokens, into e's rank (tagged: the receivers poll it).
  auto emitCount = [&](uint32_t e, int32_t count) {
    stRelaxedSys(reinterpret_cast<uint64_t*>(a.peers[e / L] + g.offCounts) + g.rank * L + e % L,
                 tagWord(round, static_cast<uint32_t>(count)));
  };
  // After counting its chunk: publish the histogram, wait for the other routing blocks, start the positions at the
  // earlier chunks' total.
  auto publishChunk = [&]() -> bool {
    for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) a.st.routeScratch[chunk * E + e] = running[e];
    __syncthreads();
    bool ok = true;
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(reinterpret_cast<unsigned long long*>(a.st.routeArrived), 1ull);
      ok = waitFlag(a.st.routeArrived, static_cast<uint64_t>(round) * R, a.st, kPhaseRouteSync,
                    static_cast<int32_t>(g.rank), static_cast<int32_t>(g.rank));
    }
    if (__syncthreads_and(ok ? 1 : 0) == 0) return false;
    for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) {
      int32_t before = 0;
      for (uint32_t c = 0; c < chunk; ++c) before += __ldcg(a.st.routeScratch + c * E + e);
      // The last chunk's block knows every chunk's histogram now: the receivers' counts go out before the positions
      // (prefill: ~10 us earlier), so the receivers' row tables, and with them the expansion of each rank's own
      // tokens, do not wait for the whole routing pass.
      if (chunk == R - 1 && emit) emitCount(e, before + running[e]);
      running[e] = before;
    }
    __syncthreads();
    tracePoint(a.st, kTrRouteCounts);
    return true;
  };
  // Phase 0 (R > 1 only) counts the chunk, phase 1 emits positions. One call site of `pass`, so its code exists
  // once: only the routing blocks run it, so each instruction is an i-cache miss on first use.
  for (uint32_t phase = R > 1 ? 0 : 1; phase < 2; ++phase) {
    if (phase == 1 && R > 1 && !publishChunk()) return false;
    for (uint32_t jb = lo; jb < hi; jb += blockDim.x) pass(jb, phase == 1 && emit);
  }
  // One routing block: after its positions its running counts are this rank's totals per expert, the receivers'
  // counts (with several, the last one sent them after the counting phase).
  if (R == 1 && emit) {
    for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) emitCount(e, running[e]);
  }
  return true;
}

// Line mode: 16-byte vectors per lane in one work unit of dispatchLines and expandLines (a warp instruction moves 4
// lines, so a unit is kLinesPerUnit = 16 lines; fewer registers than 8 vectors per lane, which the fused kernel, at
// its register limit, cannot spare).
constexpr int kLineUnroll = kLinesPerUnit / 4;

// Send half, payload. Work unit = (token, piece of 32 * unitVectors(g) vectors), so a decode-sized batch spreads over
// many warps; each unit issues all its loads (expert indices, payload vectors, scales) before the first store, so a
// unit costs one memory latency, then its stores go out once per destination *rank*. `destMask`: the ranks this call
// may store into (the fused kernel leaves its own rank out). `kFilter`: which slots (SlotFilter; the fused kernel
// splits pull mode's pushed and staged slots between two groups of blocks). A template argument, so push mode's loop
// is the plain one.
template <int kFilter>
__device__ void dispatchPayload(const DispatchKernelArgs& a, uint32_t n, uint32_t warpId, uint32_t numWarps,
                                uint32_t destMask) {
  const Geometry& g = a.g;
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t K = g.topK, L = g.numLocalExperts, D = g.dpSize;
  const uint32_t units = g.hiddenBytes / 16, scaleWords = g.scaleBytes / 4;
  const uint32_t pieces = tokenPieces(g);
  for (uint32_t wu = warpId; wu < filteredSlots(g, n, kFilter) * pieces; wu += numWarps) {
    const uint32_t j = filteredSlot(g, wu / pieces, kFilter), piece = wu % pieces;
    const uint32_t t = j * D + g.rank % D;
    const uint8_t* src = a.x + static_cast<int64_t>(t) * a.xRowStrideBytes;
    int64_t e0 = -1;
    if (lane < K) e0 = loadIndex(a.indices, a.indexKind, a.indexStrides, t, lane);
    int4 v[kUnroll];
    const uint32_t vpl = unitVectors(g), u0 = piece * 32 * vpl + lane;
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const uint32_t u = u0 + i * 32;
      if (i < vpl && u < units) v[i] = ldGlobalNc16(src + static_cast<uint64_t>(u) * 16);
    }
    // The last piece also carries the scales (its payload share is the smallest); the first 64 words are loaded
    // with the payload, any further ones after it.
    const bool scales = piece == pieces - 1;
    uint32_t sc[2] = {0, 0};
    if (scales) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint32_t c = lane + 32 * i;
        if (c < scaleWords) {
          sc[i] = *reinterpret_cast<const uint32_t*>(a.xScale + static_cast<int64_t>(t) * a.xScaleStrideBytes[0] +
                                                     static_cast<int64_t>(c) * a.xScaleStrideBytes[1]);
        }
      }
    }
    uint32_t ranks = 0;
    if (e0 >= 0 && e0 < static_cast<int64_t>(g.numExperts)) ranks = 1u << (static_cast<uint32_t>(e0) / L);
    for (uint32_t k = lane + 32; k < K; k += 32) {
      const int64_t e = loadIndex(a.indices, a.indexKind, a.indexStrides, t, k);
      if (e >= 0 && e < static_cast<int64_t>(g.numExperts)) ranks |= 1u << (static_cast<uint32_t>(e) / L);
    }
    ranks = __reduce_or_sync(0xffffffffu, ranks) & destMask;
    if (ranks == 0) continue;
    // Pull (all but the pushed share): one copy, into this rank's own slot, which every receiver of the token reads.
    if (!pushedSlot(g, j)) ranks = 1u << g.rank;
    const uint64_t slotOff = g.offPayload + (static_cast<uint64_t>(g.rank) * g.slotsPerSender + j) * g.slotBytes;
    for (uint32_t m = ranks; m != 0; m &= m - 1) {
      uint8_t* dst = reinterpret_cast<uint8_t*>(a.peers[__ffs(m) - 1]) + slotOff;
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        const uint32_t u = u0 + i * 32;
        if (i < vpl && u < units) st16(dst + static_cast<uint64_t>(u) * 16, v[i]);
      }
      if (scales) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const uint32_t c = lane + 32 * i;
          if (c < scaleWords) *reinterpret_cast<uint32_t*>(dst + g.hiddenBytes + c * 4) = sc[i];
        }
      }
    }
    if (scales) {
      for (uint32_t c = lane + 64; c < scaleWords; c += 32) {
        const uint32_t w =
            *reinterpret_cast<const uint32_t*>(a.xScale + static_cast<int64_t>(t) * a.xScaleStrideBytes[0] +
                                               static_cast<int64_t>(c) * a.xScaleStrideBytes[1]);
        for (uint32_t m = ranks; m != 0; m &= m - 1) {
          *reinterpret_cast<uint32_t*>(a.peers[__ffs(m) - 1] + slotOff + g.hiddenBytes + c * 4) = w;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Line mode (g.lines; nvlink_layout.hpp): the payload travels as tagged 128-byte lines and the senders' expert indices
// as tagged words, so a receiver needs no flag and no fence: it ranks every sender's tokens itself as soon as their
// indices land (computeLineTables), and copies each line as soon as its tag carries the round (expandLines).
//
// A token's stream is its payload bytes, then its scale words, in 16-byte chunks (hiddenBytes is a multiple of 16).
// In one warp instruction lanes 8q .. 8q + 7 move one line l: lane 8q + i (i < 7) chunk 7 l + i, lane 8q + 7 the tag.

// Chunks of a token's stream.
__device__ __forceinline__ uint32_t streamChunks(const Geometry& g) {
  return static_cast<uint32_t>(ceilDiv(g.hiddenBytes + g.scaleBytes, 16));
}

// Line of instruction i of unit `piece` that this lane's group of 8 moves (vpl = kLineUnroll).
__device__ __forceinline__ uint32_t lineOf(uint32_t piece, uint32_t vpl, uint32_t i, uint32_t lane) {
  return (piece * vpl + i) * 4 + lane / 8;
}

// Chunk c of token t's stream: a payload vector of x, or four scale words (0 past the last).
__device__ __forceinline__ int4 loadChunk(const DispatchKernelArgs& a, uint32_t t, uint32_t c) {
  const Geometry& g = a.g;
  const uint32_t h = g.hiddenBytes / 16, words = g.scaleBytes / 4;
  if (c < h) return ldGlobalNc16(a.x + static_cast<int64_t>(t) * a.xRowStrideBytes + static_cast<uint64_t>(c) * 16);
  const uint8_t* row = a.xScale + static_cast<int64_t>(t) * a.xScaleStrideBytes[0];
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t k = (c - h) * 4 + i;
    w[i] = k < words ? *reinterpret_cast<const uint32_t*>(row + static_cast<int64_t>(k) * a.xScaleStrideBytes[1]) : 0u;
  }
  return make_int4(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]), static_cast<int>(w[3]));
}

// Stores chunk c of a token's stream into its expert row (payload at rowOff of outX, scales at scaleOff of outScale).
__device__ __forceinline__ void storeChunk(const DispatchKernelArgs& a, int64_t rowOff, int64_t scaleOff, uint32_t c,
                                           int4 v) {
  const Geometry& g = a.g;
  const uint32_t h = g.hiddenBytes / 16, words = g.scaleBytes / 4;
  if (c < h) {
    st16(a.outX + rowOff + static_cast<uint64_t>(c) * 16, v);
    return;
  }
  const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                         static_cast<uint32_t>(v.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t k = (c - h) * 4 + i;
    if (k < words) *reinterpret_cast<uint32_t*>(a.outScale + scaleOff + k * a.outScaleStrideBytes[2]) = w[i];
  }
}

// A line's 16 bytes per lane, stored and loaded in one instruction per warp (the pattern `nvlink-line-probe` checks).
__device__ __forceinline__ void stLine16(void* p, int4 v) {
  asm volatile("st.volatile.global.v4.s32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// The tag lane's 16 bytes: the round in the second 8 (the first 8 unused).
__device__ __forceinline__ int4 lineTag(uint32_t round) { return make_int4(0, 0, static_cast<int>(round), 0); }
__device__ __forceinline__ bool tagIs(int4 v, uint32_t round) {
  return static_cast<uint32_t>(v.z) == round && v.w == 0;
}

// Line mode: the round's gate (kQueueLineIndices). Each warp that sends indices counts itself once it issued them;
// the payload warps store nothing before every such warp did, so the indices cross the links ahead of the payload
// instead of among it (measured on 2x H200: without the gate the last indices landed with the payload, ~5 us later).
// A heuristic ordering only (stores issued, not landed): correctness rests on the tags.
__device__ __forceinline__ void openGate(const DeviceState& st, uint32_t round) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) atomicAdd(queueOf(st, kQueueLineIndices, round), 1u);
}

// Waits until `senders` warps opened the gate of `round`. False (in every lane) on a timeout (recorded) or another
// wait's failure.
__device__ bool waitGate(const DispatchKernelArgs& a, uint32_t round, uint32_t senders) {
  bool ok = true;
  if (threadIdx.x % 32 == 0) {
    const int32_t* gate = reinterpret_cast<const int32_t*>(queueOf(a.st, kQueueLineIndices, round));
    if (static_cast<uint32_t>(ldAcquireGpu(gate)) < senders) {
      const uint64_t start = globalTimerNs();
      for (uint32_t i = 1; static_cast<uint32_t>(ldAcquireGpu(gate)) < senders; ++i) {
        bool expired;
        if ((i & 255) == 0 && spinStops(a.st, start, 2, expired)) {
          if (expired) {
            recordError(a.st, kPhaseRouteSync, static_cast<int32_t>(a.g.rank), static_cast<int32_t>(a.g.rank),
                        ldAcquireGpu(gate), senders);
          }
          ok = false;
          break;
        }
      }
    }
  }
  return __shfl_sync(0xffffffffu, ok ? 1 : 0, 0) != 0;
}

// Warps of sendLineIndices' numWarps that have index words (they open the gate): the payload waits for this many.
__device__ __forceinline__ uint32_t lineIndexWarps(uint32_t n, uint32_t K, uint32_t numWarps) {
  return min(numWarps, static_cast<uint32_t>(ceilDiv(static_cast<uint64_t>(n) * K, 32)));
}

// Line mode: every token's K expert indices, as tagged words of `round`, into every rank (its own too), then the warp
// opens the gate (the token count goes out first thing in the routing pass). The fused kernel's own-token blocks call
// it first thing; the split send half's payload warps before their payload.
__device__ void sendLineIndices(const DispatchKernelArgs& a, uint32_t n, uint32_t warpId, uint32_t numWarps,
                                uint32_t round) {
  const Geometry& g = a.g;
  const uint32_t lane = threadIdx.x % 32, K = g.topK, W = g.worldSize, D = g.dpSize, Ts = g.slotsPerSender;
  for (uint32_t i = warpId * 32 + lane; i < n * K; i += numWarps * 32) {
    const uint32_t j = i / K, k = i % K;
    const int64_t e = loadIndex(a.indices, a.indexKind, a.indexStrides, j * D + g.rank % D, k);
    const uint64_t word =
        tagWord(round, e >= 0 && e < static_cast<int64_t>(g.numExperts) ? static_cast<uint32_t>(e) : 0xFFFFFFFFu);
    const uint64_t off = g.offRawIdx + ((static_cast<uint64_t>(g.rank) * Ts + j) * K + k) * sizeof(uint64_t);
    for (uint32_t d = 0; d < W; ++d) stRelaxedSys(reinterpret_cast<uint64_t*>(a.peers[d] + off), word);
  }
  // Only the warps that had index words count themselves (lineIndexWarps): when every warp of every block did, the
  // atomics on the one word held the gate until ~3 us (decode T = 128: 720 warps, 32 of them with indices).
  if (warpId < lineIndexWarps(n, K, numWarps)) openGate(a.st, round);
}

// Send half, line mode: per work unit (token, piece) the unit's lines into every rank in `destMask` that has one of
// the token's experts. The indices travel separately (sendLineIndices): the warp waits for the gate (`gateWarps` index
// senders) before its first unit, whose payload it meanwhile asks L2 for.
__device__ void dispatchLines(const DispatchKernelArgs& a, uint32_t n, uint32_t warpId, uint32_t numWarps,
                              uint32_t destMask, uint32_t round, uint32_t gateWarps) {
  const Geometry& g = a.g;
  const uint32_t lane = threadIdx.x % 32, K = g.topK, L = g.numLocalExperts, D = g.dpSize, Ts = g.slotsPerSender;
  const uint32_t pieces = linePieces(g), vpl = kLineUnroll, chunks = streamChunks(g);
  if (warpId >= n * pieces) return;
  {
    // While the gate is shut: the first unit's payload into L2 (a hint; no registers held across the wait).
    const uint32_t j = warpId / pieces, piece = warpId % pieces, h = g.hiddenBytes / 16;
    const uint32_t c0 = min(piece * vpl * 28, h), c1 = min((piece + 1) * vpl * 28, h);
    if (lane == 0 && c1 > c0) {
      prefetchL2(a.x + static_cast<int64_t>(j * D + g.rank % D) * a.xRowStrideBytes + static_cast<uint64_t>(c0) * 16,
                 (c1 - c0) * 16);
    }
    if (!waitGate(a, round, gateWarps)) return;
  }
  for (uint32_t wu = warpId; wu < n * pieces; wu += numWarps) {
    const uint32_t j = wu / pieces, piece = wu % pieces;
    const uint32_t t = j * D + g.rank % D;
    int64_t e0 = -1;
    if (lane < K) e0 = loadIndex(a.indices, a.indexKind, a.indexStrides, t, lane);
    int4 v[kLineUnroll];
#pragma unroll
    for (int i = 0; i < kLineUnroll; ++i) {
      const uint32_t l = lineOf(piece, vpl, i, lane), c = l * 7 + lane % 8;
      if (l < g.linesPerSlot) {
        v[i] = lane % 8 == 7 ? lineTag(round) : c < chunks ? loadChunk(a, t, c) : make_int4(0, 0, 0, 0);
      }
    }
    const bool valid = e0 >= 0 && e0 < static_cast<int64_t>(g.numExperts);
    const uint32_t ranks = __reduce_or_sync(0xffffffffu, valid ? 1u << (static_cast<uint32_t>(e0) / L) : 0u) & destMask;
    const uint64_t slotOff = g.offPayload + (static_cast<uint64_t>(g.rank) * Ts + j) * g.slotBytes;
    for (uint32_t m = ranks; m != 0; m &= m - 1) {
      char* dst = a.peers[__ffs(m) - 1] + slotOff;
#pragma unroll
      for (int i = 0; i < kLineUnroll; ++i) {
        const uint32_t l = lineOf(piece, vpl, i, lane);
        if (l < g.linesPerSlot) stLine16(dst + l * kLineBytes + (lane % 8) * 16, v[i]);
      }
    }
  }
}

// Line mode: the receiver's view of one round (smem, lineTableBytes): tokens of every sender in (sender, token)
// order numbered from 0 (sender s's first is first[s]); for routing entry k of token number u, entLe[u K + k] is
// the local expert (-1: none here, or a repeat of an earlier k of the token); its row is rowOf().
struct LineTables {
  int32_t* first;    // [W + 1]
  int32_t* total;    // [L] rows of each local expert
  int32_t* rowBase;  // [L]
  uint32_t* bits;    // [ceil(W Ts / 32)][L]: bit u % 32 of [u / 32][le] set when token u has a row of expert le
  int32_t* before;   // [ceil(W Ts / 32)][L]: rows of expert le taken by tokens before u / 32 * 32
  int32_t* entLe;    // [W Ts K]
  uint32_t L;
  bool ok;  // false: a sender's indices never arrived (recorded); nothing else is valid
};

// Row (within expert le's rows) of token number u.
__device__ __forceinline__ int32_t rowOf(const LineTables& lt, uint32_t u, uint32_t le) {
  const uint32_t w = (u / 32) * lt.L + le;
  return lt.rowBase[le] + lt.before[w] + __popc(lt.bits[w] & ((1u << (u % 32)) - 1));
}

// Sender of token number u (first[s] <= u < first[s + 1]).
__device__ __forceinline__ uint32_t senderOf(const LineTables& lt, uint32_t u) {
  uint32_t s = 0;
  while (u >= static_cast<uint32_t>(lt.first[s + 1])) ++s;
  return s;
}

// Block-wide. Polls every sender's token count and expert indices (tagged words of `round`) and ranks the tokens per
// local expert exactly as dispatchRouting does on the senders (rows by sender, then token; a token's repeated expert
// gets one row), the order of the plain path's rows. `smem` is free on entry.
__device__ LineTables computeLineTables(const DispatchKernelArgs& a, int32_t* smem, uint32_t round) {
  const Geometry& g = a.g;
  const uint32_t W = g.worldSize, L = g.numLocalExperts, K = g.topK, Ts = g.slotsPerSender;
  const uint32_t words = static_cast<uint32_t>(ceilDiv(static_cast<uint64_t>(W) * Ts, 32)) * L;
  LineTables lt{};
  lt.first = smem;
  lt.total = lt.first + W + 1;
  lt.rowBase = lt.total + L;
  lt.bits = reinterpret_cast<uint32_t*>(lt.rowBase + L);
  lt.before = reinterpret_cast<int32_t*>(lt.bits + words);
  lt.entLe = lt.before + words;
  lt.L = L;
  uint32_t* bits = lt.bits;
  int32_t* before = lt.before;
  const char* local = a.peers[g.rank];
  const uint64_t* raw = reinterpret_cast<const uint64_t*>(local + g.offRawIdx);
  const int32_t rank = static_cast<int32_t>(g.rank);
  __syncthreads();  // the caller's last use of smem
  bool ok = pollSenders(a.peers[g.rank], g, lt.first + 1, round, a.st, 0, threadIdx.x);
  for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) bits[i] = 0;
  if (__syncthreads_and(ok ? 1 : 0) == 0) return lt;
  if (threadIdx.x == 0) {
    lt.first[0] = 0;
    for (uint32_t s = 0; s < W; ++s) lt.first[s + 1] += lt.first[s];
  }
  __syncthreads();
  tracePoint(a.st, kTrPeersIn);
  const uint32_t entries = static_cast<uint32_t>(lt.first[W]) * K;
  // Mark: bit u % 32 of bits[u / 32][le] for every token u with an entry for local expert le. A repeated expert finds
  // its bit set already (atomicOr's old value) and gets no row; which of the repeats does may differ between runs,
  // but all would write the same row with the same bytes. Four entries per thread per pass, their loads together.
  constexpr int kBatch = 4;
  for (uint32_t i0 = 0; i0 < entries && ok; i0 += kBatch * blockDim.x) {
    const uint64_t* p[kBatch];
    uint64_t w[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const uint32_t i = i0 + b * blockDim.x + threadIdx.x, u = i / K;
      if (i < entries) {
        const uint32_t s = senderOf(lt, u);
        p[b] = raw + (static_cast<uint64_t>(s) * Ts + u - static_cast<uint32_t>(lt.first[s])) * K + i % K;
        w[b] = ldRelaxedSys(p[b]);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const uint32_t i = i0 + b * blockDim.x + threadIdx.x, u = i / K;
      if (i >= entries || !ok) continue;
      uint32_t e = static_cast<uint32_t>(w[b]);
      if ((w[b] >> 32) != round) {
        ok = waitTagged(p[b], round, a.st, kPhaseDispatchRecv, rank, static_cast<int32_t>(senderOf(lt, u)), e);
      }
      int32_t le = -1;
      if (ok && e != 0xFFFFFFFFu && e / L == g.rank) {
        const uint32_t bit = 1u << (u % 32);
        if ((atomicOr(&bits[(u / 32) * L + e % L], bit) & bit) == 0) le = static_cast<int32_t>(e % L);
      }
      lt.entLe[i] = le;
    }
  }
  if (__syncthreads_and(ok ? 1 : 0) == 0) return lt;
  tracePoint(a.st, kTrRoutesIn);
  const uint32_t groups = static_cast<uint32_t>(ceilDiv(entries / K, 32));
  for (uint32_t le = threadIdx.x; le < L; le += blockDim.x) {
    int32_t r = 0;
    for (uint32_t w = 0; w < groups; ++w) {
      before[w * L + le] = r;
      r += __popc(bits[w * L + le]);
    }
    lt.total[le] = r;
  }
  __syncthreads();
  expertRowBases(lt.total, lt.rowBase, L, a.packed != 0, a.padding);
  __syncthreads();
  lt.ok = true;
  return lt;
}

// Polls this lane's 16 bytes of line l (`have`: the lane has a line) until every line of the warp's instruction
// carries `round`; false (in every lane) if sender `s` timed out (recorded) or another wait failed.
__device__ __forceinline__ bool pollLines(const DispatchKernelArgs& a, const char* slot, uint32_t l, bool have,
                                          uint32_t round, uint32_t s, int4& v) {
  const uint32_t lane = threadIdx.x % 32;
  const char* p = slot + l * kLineBytes + (lane % 8) * 16;
  auto ready = [&] { return !have || lane % 8 != 7 || tagIs(v, round); };
  if (__all_sync(0xffffffffu, ready())) return true;
  const uint64_t start = globalTimerNs();
  for (uint32_t it = 1;; ++it) {
    if (have) v = ldVolatile16(p);
    if (__all_sync(0xffffffffu, ready())) return true;
    if ((it & 255) == 0) {
      // Lane 0 decides for the warp, so the warp never stops without the error recorded.
      bool stop = false;
      if (lane == 0) {
        bool expired;
        stop = spinStops(a.st, start, 1, expired);
        if (expired) {
          recordError(a.st, kPhaseDispatchRecv, static_cast<int32_t>(a.g.rank), static_cast<int32_t>(s), -1,
                      static_cast<int64_t>(round));
        }
      }
      if (__shfl_sync(0xffffffffu, stop, 0)) return false;
    }
  }
}

// Line mode: expands tokens into their expert rows with the rows of computeLineTables, a unit's chunks laid out as its
// lines. kOwn: this rank's own tokens (fused kernel), straight from x; else the tokens of every sender (or every
// other one, `skipOwn`) from their lines in this rank's region, each polled until it carries the round. Static
// schedule.
template <bool kOwn>
__device__ void expandLines(const DispatchKernelArgs& a, const LineTables& lt, uint32_t warpId, uint32_t numWarps,
                            uint32_t round, bool skipOwn) {
  const Geometry& g = a.g;
  const uint32_t lane = threadIdx.x % 32, K = g.topK, W = g.worldSize, D = g.dpSize, Ts = g.slotsPerSender;
  const uint32_t pieces = linePieces(g), vpl = kLineUnroll, chunks = streamChunks(g);
  const uint32_t ownFirst = static_cast<uint32_t>(lt.first[g.rank]);
  const uint32_t ownN = static_cast<uint32_t>(lt.first[g.rank + 1]) - ownFirst;
  const uint32_t items = kOwn ? ownN : static_cast<uint32_t>(lt.first[W]) - (skipOwn ? ownN : 0);
  const char* local = a.peers[g.rank];
  for (uint32_t wu = warpId; wu < items * pieces; wu += numWarps) {
    const uint32_t item = wu / pieces, piece = wu % pieces;
    const uint32_t u = kOwn ? ownFirst + item : (skipOwn && item >= ownFirst ? item + ownN : item);
    const uint32_t s = senderOf(lt, u), j = u - static_cast<uint32_t>(lt.first[s]);
    // The token's rows here first: a token with none here was not sent here (its lines never come).
    int64_t rowOff = -1, scaleOff = 0;
    if (lane < K) {
      const int32_t le = lt.entLe[u * K + lane];
      if (le >= 0) {
        const int64_t idx = rowOf(lt, u, static_cast<uint32_t>(le));
        rowOff = le * a.outExpertStrideBytes + idx * a.outRowStrideBytes;
        scaleOff = le * a.outScaleStrideBytes[0] + idx * a.outScaleStrideBytes[1];
      }
    }
    // The combine's rows (DeviceState::rowSlots), a repeated expert's entries too, from the raw indices (complete).
    if (piece == 0 && lane < K) {
      const uint64_t at = (static_cast<uint64_t>(s) * Ts + j) * K + lane;
      const uint32_t e = static_cast<uint32_t>(reinterpret_cast<const uint64_t*>(local + g.offRawIdx)[at]);
      uint64_t slot = kNoRowSlot;
      if (e != 0xFFFFFFFFu && e / g.numLocalExperts == g.rank) {
        const uint32_t le = e % g.numLocalExperts;
        slot = rowSlot(le, static_cast<uint32_t>(rowOf(lt, u, le)));
      }
      a.st.rowSlots[at] = slot;
    }
    const uint32_t rows = __ballot_sync(0xffffffffu, rowOff >= 0);
    if (rows == 0) continue;
    int4 v[kLineUnroll];
    if constexpr (kOwn) {
      const uint32_t t = j * D + g.rank % D;
#pragma unroll
      for (int i = 0; i < kLineUnroll; ++i) {
        const uint32_t c = lineOf(piece, vpl, i, lane) * 7 + lane % 8;
        if (lane % 8 != 7 && c < chunks) v[i] = loadChunk(a, t, c);
      }
    } else {
      const char* slot = local + g.offPayload + (static_cast<uint64_t>(s) * Ts + j) * g.slotBytes;
#pragma unroll
      for (int i = 0; i < kLineUnroll; ++i) {
        const uint32_t l = lineOf(piece, vpl, i, lane);
        v[i] = make_int4(0, 0, 0, 0);
        if (l < g.linesPerSlot) v[i] = ldVolatile16(slot + l * kLineBytes + (lane % 8) * 16);
      }
      bool ok = true;
#pragma unroll
      for (int i = 0; i < kLineUnroll; ++i) {
        const uint32_t l = lineOf(piece, vpl, i, lane);
        if (ok) ok = pollLines(a, slot, l, l < g.linesPerSlot, round, s, v[i]);
      }
      if (!ok) return;
    }
    for (uint32_t m = rows; m != 0; m &= m - 1) {
      const int b = __ffs(m) - 1;
      const int64_t ro = __shfl_sync(0xffffffffu, rowOff, b), so = __shfl_sync(0xffffffffu, scaleOff, b);
#pragma unroll
      for (int i = 0; i < kLineUnroll; ++i) {
        const uint32_t c = lineOf(piece, vpl, i, lane) * 7 + lane % 8;
        if (lane % 8 != 7 && c < chunks) storeChunk(a, ro, so, c, v[i]);
      }
    }
  }
}

// Fused dispatch in line mode. Roles (R = g.routeBlocks): blocks [0, R) route (the token count first, every index
// checked) and raise the dispatch flag that the combine waits for, blocks [R, R + P) store this rank's tokens into the
// other ranks as lines, blocks [R + P, B) (the expanders) first send this rank's indices, then build the line tables
// (once the senders' indices land, ahead of their payload) and expand. Nothing waits for a flag or a fence.
//   Small batches (leanLinePayloadBlocks: every sender's units fit the expanders' warps, one or two each, with P just
//   enough blocks for as many units per warp of this rank's tokens): the expanders expand every token, this rank's from
//   x and the peers' line by line as they land; the routing and payload blocks end after their stores. Building the
//   tables right after the payload stores was their slowest step (trace, decode T = 32: tables at 8.2 us against 5.6 on
//   the expanders: loads queue behind a block's own NVLink stores). Otherwise P = `payloadBlocks` (as in fusedDispatch)
//   and those blocks also expand the peers' tokens.
__device__ void fusedDispatchLines(const DispatchKernelArgs& a, int32_t* smem, uint32_t n, uint32_t round,
                                   uint32_t sendRound, uint32_t payloadBlocks) {
  const Geometry& g = a.g;
  const uint32_t B = gridDim.x, R = g.routeBlocks;
  const uint32_t pieces = linePieces(g), leanPayload = leanLinePayloadBlocks(g);
  const bool lean = leanPayload > 0;
  const uint32_t P = lean ? leanPayload : payloadBlocks;
  const uint32_t firstLocal = R + P;
  const uint32_t ownWarp = spreadWarp(blockIdx.x - firstLocal, B - firstLocal),
                 ownWarps = (B - firstLocal) * blockWarps(g);
  if (blockIdx.x < R) {
    if (!dispatchRouting(a, n, smem, blockIdx.x, sendRound)) return;
    tracePoint(a.st, kTrRouted);
    signalAllRanks(a.peers, g, kFlagDispatch);  // for the combine (pollSenders)
    if (lean) return;
  } else if (blockIdx.x < firstLocal) {
    dispatchLines(a, n, spreadWarp(blockIdx.x - R, P), P * blockWarps(g), allRanksMask(g) & ~(1u << g.rank), sendRound,
                  lineIndexWarps(n, g.topK, ownWarps));
    tracePoint(a.st, kTrStored);
    if (lean) return;
  } else {
    sendLineIndices(a, n, ownWarp, ownWarps, sendRound);
    tracePoint(a.st, kTrRouted);
  }
  const LineTables lt = computeLineTables(a, smem, round);
  if (!lt.ok) return;
  tracePoint(a.st, kTrRows);
  if (blockIdx.x >= firstLocal) {
    if (blockIdx.x == firstLocal) {
      for (uint32_t le = threadIdx.x; le < g.numLocalExperts; le += blockDim.x) a.outNumTokens[le] = lt.total[le];
    }
    expandLines<true>(a, lt, ownWarp, ownWarps, round, false);
    tracePoint(a.st, kTrOwnDone);
    if (!lean) return;
    // The peers' units continue where this rank's left off, so the warps' unit counts differ by at most one.
    const uint32_t ownUnits = (static_cast<uint32_t>(lt.first[g.rank + 1] - lt.first[g.rank]) * pieces) % ownWarps;
    expandLines<false>(a, lt, (ownWarp + ownWarps - ownUnits) % ownWarps, ownWarps, round, true);
    return;
  }
  expandLines<false>(a, lt, spreadWarp(blockIdx.x, firstLocal), firstLocal * blockWarps(g), round, true);
}

// Which tokens expandTokens() writes and where it reads them.
enum ExpandMode : int {
  kExpandAll = 0,    // every sender's tokens, from the staging slots (recv half of a split dispatch)
  kExpandOwn = 1,    // this rank's own tokens, straight from x / xScale (fused dispatch: no staging round trip)
  kExpandPeers = 2,  // the other senders' tokens, from the staging slots (fused dispatch)
};

// Entry k of sender s's token j in this rank's routing area, polled until it carries `round` (tagged words: see
// computeRows). A timeout (recorded) leaves it empty; the kernel then ends and the host reports the error.
__device__ __forceinline__ RouteEntry pollEntry(const DispatchKernelArgs& a, uint32_t s, uint32_t j, uint32_t k,
                                                uint32_t round) {
  const Geometry& g = a.g;
  const uint64_t* route = reinterpret_cast<const uint64_t*>(a.peers[g.rank] + g.offRoute);
  uint32_t v = 0;
  if (!waitTagged(route + routeIndex(g.topK, g.slotsPerSender, s, j, k), round, a.st, kPhaseDispatchRecv,
                  static_cast<int32_t>(g.rank), static_cast<int32_t>(s), v)) {
    return RouteEntry{-1, 0};
  }
  return unpackEntry(v);
}

// Row groups of a static expansion: when the units (token, piece) are fewer than the warps, each unit is split further
// by its entries (entry k to group k % G), so a token's rows are written by G warps at once instead of one after the
// other by one (W = 1, decode T = 32: one warp's 8 rows took 1.8 us after its loads; docs/nvlink.md, twenty-second
// pass). Only with at least 4 warps per unit: with 2 (W = 1, T = 128) the second load of every piece cost more than
// the shorter chains gained (+0.2 us).
__device__ __forceinline__ uint32_t rowGroups(uint32_t units, uint32_t numWarps, uint32_t K) {
  if (units == 0 || 4 * units > numWarps) return 1;
  return min(K, numWarps / units);
}

// The token (item) of work unit `wu` of an expansion with `groups` row groups and `pieces` pieces per token: units
// run group-fastest, then piece, then token (expandTokens; firstOwnEntries polls the first unit's entries ahead).
__device__ __forceinline__ uint32_t unitItem(uint32_t wu, uint32_t groups, uint32_t pieces) {
  return wu / groups / pieces;
}

// Expands received tokens into their expert rows (HBM to HBM, local). Work unit = (sender, token, piece) as in
// dispatchPayload, over the tokens actually sent (rt.tokens); the unit's loads (routing entries, payload vectors,
// scales) are issued together before its stores; a static schedule with warps to spare splits each unit further by
// its entries (rowGroups). `nOwn`: this rank's token count (kExpandOwn).
// Schedule: static (units warpId, warpId + numWarps, ...), or with kDynamic from `queue`, a counter shared by every
// warp of the schedule: lane 0 takes the next unit and asks for the following one while the current one runs, so
// the atomic's round trip overlaps the work. A static split ends when its slowest warp does: at prefill the units
// differ (1 to K expert rows per token) and the fused kernel's own-token blocks join the peers' tokens late (trace:
// exits over 73-133 us); with queues the warps that finish early take over the rest instead of idling. Decode keeps
// the static split (one or two units per warp; the first would wait for an atomic). A compile-time choice, so the
// static loop is the code it was (decode dispatch measured ~0.5-1 us slower in every build with the queues, this
// one included; why is open: docs/nvlink.md, eighth pass).
// `pre` (static schedule only, when `havePre`): the entries of the warp's first unit, polled by firstOwnEntries()
// before the wait that preceded this call.
template <bool kDynamic>
__device__ void expandTokens(const DispatchKernelArgs& a, const RowTables& rt, int mode, uint32_t nOwn, uint32_t* queue,
                             uint32_t warpId, uint32_t numWarps, uint32_t round, RouteEntry pre = RouteEntry{-1, 0},
                             bool havePre = false) {
  const Geometry& g = a.g;
  char* local = a.peers[g.rank];
  const uint32_t L = g.numLocalExperts, K = g.topK, W = g.worldSize, Ts = g.slotsPerSender, D = g.dpSize;
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t units = g.hiddenBytes / 16, scaleWords = g.scaleBytes / 4;
  const uint32_t pieces = tokenPieces(g);
  const uint32_t skip = mode == kExpandPeers ? g.rank : W;
  auto entry = [&](uint32_t s, uint32_t j, uint32_t k) { return pollEntry(a, s, j, k, round); };
  const uint32_t tokenUnits = (mode == kExpandOwn ? nOwn : sentTokens(rt, W, skip)) * pieces;
  const uint32_t groups = kDynamic ? 1 : rowGroups(tokenUnits, numWarps, K);
  const uint32_t total = tokenUnits * groups;
  const bool leader = lane == 0;
  uint32_t wu = warpId;
  if constexpr (kDynamic) wu = __shfl_sync(0xffffffffu, leader ? atomicAdd(queue, 1u) : 0u, 0);
  while (wu < total) {
    uint32_t next = wu + numWarps;
    if constexpr (kDynamic) next = leader ? atomicAdd(queue, 1u) : 0u;
    const uint32_t group = wu % groups, item = unitItem(wu, groups, pieces), piece = wu / groups % pieces;
    uint32_t s = g.rank, j = item;
    if (mode != kExpandOwn) sentItem(rt, W, skip, item, s, j);
    const uint8_t* src;
    const uint8_t* scaleSrc;
    int64_t scaleStride;
    if (mode == kExpandOwn) {
      const int64_t t = static_cast<int64_t>(j) * D + g.rank % D;
      src = a.x + t * a.xRowStrideBytes;
      scaleSrc = a.xScale + t * a.xScaleStrideBytes[0];
      scaleStride = a.xScaleStrideBytes[1];
    } else {
      // Pulled slot: sender s staged the token in its own region (read over NVLink); pushed: it stored it into ours.
      const char* region = pushedSlot(g, j) ? local : a.peers[s];
      src = reinterpret_cast<const uint8_t*>(region + g.offPayload) + (static_cast<uint64_t>(s) * Ts + j) * g.slotBytes;
      scaleSrc = src + g.hiddenBytes;
      scaleStride = 4;
    }
    int4 v[kUnroll];
    const uint32_t vpl = unitVectors(g), u0 = piece * 32 * vpl + lane;
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const uint32_t u = u0 + i * 32;
      if (i < vpl && u < units) v[i] = *reinterpret_cast<const int4*>(src + static_cast<uint64_t>(u) * 16);
    }
    const bool scales = piece == pieces - 1;
    uint32_t sc[2] = {0, 0};
    if (scales) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint32_t c = lane + 32 * i;
        if (c < scaleWords) sc[i] = *reinterpret_cast<const uint32_t*>(scaleSrc + c * scaleStride);
      }
    }
    // The entries last: their poll (a loop the loads above cannot move past) overlaps the payload's latency.
    RouteEntry e0{-1, 0};
    if (havePre && !kDynamic) {
      e0 = pre;
      havePre = false;
    } else if (lane < K) {
      e0 = entry(s, j, lane);
    }
    for (uint32_t k0 = 0; k0 < K; k0 += 32) {
      const RouteEntry e = k0 == 0 ? e0 : k0 + lane < K ? entry(s, j, k0 + lane) : RouteEntry{-1, 0};
      int64_t rowOff = -1, scaleOff = 0;
      uint64_t slot = kNoRowSlot;
      const bool mine = (k0 + lane) % groups == group;  // this unit's share of the token's entries
      if (e.le >= 0 && mine) {
        const int32_t le = e.le & ~kDupBit;
        const int64_t idx = rt.rowBase[le] + rt.senderBase[s * L + le] + e.pos;
        slot = rowSlot(static_cast<uint32_t>(le), static_cast<uint32_t>(idx));
        if ((e.le & kDupBit) == 0) {
          rowOff = le * a.outExpertStrideBytes + idx * a.outRowStrideBytes;
          scaleOff = le * a.outScaleStrideBytes[0] + idx * a.outScaleStrideBytes[1];
        }
      }
      if (piece == 0 && k0 + lane < K && mine) {
        a.st.rowSlots[(static_cast<uint64_t>(s) * Ts + j) * K + k0 + lane] = slot;
      }
      for (uint32_t m = __ballot_sync(0xffffffffu, rowOff >= 0); m != 0; m &= m - 1) {
        const int b = __ffs(m) - 1;
        uint8_t* dst = a.outX + __shfl_sync(0xffffffffu, rowOff, b);
#pragma unroll
        for (int i = 0; i < kUnroll; ++i) {
          const uint32_t u = u0 + i * 32;
          if (i < vpl && u < units) {
            // Prefill-sized rounds: the rows are not read again here, so streaming stores (evict first) leave
            // L2 to the staged tokens that the peers still pull.
            if constexpr (kDynamic) {
              __stcs(reinterpret_cast<int4*>(dst + static_cast<uint64_t>(u) * 16), v[i]);
            } else {
              st16(dst + static_cast<uint64_t>(u) * 16, v[i]);
            }
          }
        }
        if (scales) {
          const int64_t so = __shfl_sync(0xffffffffu, scaleOff, b);
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const uint32_t c = lane + 32 * i;
            if (c < scaleWords) *reinterpret_cast<uint32_t*>(a.outScale + so + c * a.outScaleStrideBytes[2]) = sc[i];
          }
          for (uint32_t c = lane + 64; c < scaleWords; c += 32) {
            *reinterpret_cast<uint32_t*>(a.outScale + so + c * a.outScaleStrideBytes[2]) =
                *reinterpret_cast<const uint32_t*>(scaleSrc + c * scaleStride);
          }
        }
      }
    }
    if constexpr (kDynamic) next = __shfl_sync(0xffffffffu, next, 0);
    wu = next;
  }
}

// The entries (lane k < K) of the first unit (warpId) of a static kExpandOwn schedule over `nOwn` own tokens,
// polled while the other ranks' counts are not in (own entries need only this rank's routing): the entries' round
// trip (~0.4 us at decode, trace) leaves the unit's chain after the counts. `have`: whether the warp has a unit
// (else nothing was polled). Polling the peers' first entries before their payload flag the same way delayed
// decode T = 128 (docs/nvlink.md, ninth pass).
__device__ RouteEntry firstOwnEntries(const DispatchKernelArgs& a, uint32_t nOwn, uint32_t warpId, uint32_t numWarps,
                                      uint32_t round, bool& have) {
  const Geometry& g = a.g;
  const uint32_t units = nOwn * tokenPieces(g), groups = rowGroups(units, numWarps, g.topK);
  have = warpId < units * groups;
  if (!have || threadIdx.x % 32 >= g.topK) return RouteEntry{-1, 0};
  return pollEntry(a, g.rank, unitItem(warpId, groups, tokenPieces(g)), threadIdx.x % 32, round);
}

// The row tables built by the threads [first, blockDim.x) while warp 0 does something else (a fence that waits for
// the link), handed to warp 0 at the hand-off barrier: the group calls rowsForHandoff (first > 0: it publishes the
// result word and arrives), warp 0 handedRows (it waits there). With first == 0 every thread builds them.
__device__ RowTables rowsForHandoff(const DispatchKernelArgs& a, uint32_t round, int32_t* smem, uint32_t first) {
  const Geometry& g = a.g;
  const RowTables rt = computeRows(a.peers[g.rank], g, smem, a.packed != 0, a.padding, round, a.st, first);
  if (first > 0) {
    if (threadIdx.x == first) smem[rowTableWords(g)] = rt.ok ? 1 : 0;
    groupSync(first);  // the word before the hand-off
    asm volatile("bar.arrive %0, %1;" ::"n"(kHandoffBarrier), "r"(blockDim.x) : "memory");
  }
  return rt;
}
__device__ RowTables handedRows(const Geometry& g, int32_t* smem) {
  asm volatile("bar.sync %0, %1;" ::"n"(kHandoffBarrier), "r"(blockDim.x) : "memory");
  return rowTablesAt(g, smem, smem[rowTableWords(g)] != 0);
}

__device__ bool ownBlocksJoin(const Geometry& g, const RowTables& rt, uint32_t firstLocal) {
  return manyUnitsPerWarp(g, sentTokens(rt, g.worldSize, g.rank), firstLocal);
}

// Fused dispatch with roles, so this rank's own tokens never wait for NVLink (R = g.routeBlocks):
//   blocks [0, R)         routing scan (entries and counts as tagged words in every rank), signal "dispatch";
//   blocks [R, R + P)     copy this rank's tokens to the *other* ranks' staging (pull mode: all but the pushed
//                         share, into this rank's own staging), signal "dispatch";
//   blocks [R + P, B)     push mode: signal "dispatch" at once (they store nothing into peers); pull mode: push the
//                         pushed share into the peers first, then signal. Poll every rank's counts, expand this
//                         rank's own tokens straight from x (HBM to HBM, overlapping the NVLink copy);
//   blocks [0, R + P)     then poll every rank's counts, build the row tables, wait for the other ranks'
//                         "dispatch" flags and expand their tokens from staging.
// The own-token blocks take part in the peers' expansion only when it is large (ownBlocksJoin; both expansions then
// run on dynamic schedules): as one of the last steps of every block it had them start their share only after their
// own tokens, and they finished last (trace, decode T = 128: exit of the last block 18 us against 12-14 us for the
// others). Their count (dispatchKernel) is about (B - R) / W, the own tokens' share of the expansion. Own staging
// slots are not written (nothing else reads them). `sendRound`: this send's number (1-based). `kKind` (FusedKind):
// the push kernel has static shares only; the pull kernel dynamic ones only (the own-token blocks' share too when they
// do not join: the same result, and one expansion's code less); kFusedAny every path, chosen from g.
template <int kKind>
__device__ void fusedDispatch(const DispatchKernelArgs& a, int32_t* smem, uint32_t n, uint32_t round,
                              uint32_t sendRound, uint32_t payloadBlocks) {
  const Geometry& g = a.g;
  const bool pull = kKind == kFusedPull || (kKind == kFusedAny && g.pull);
  constexpr bool kStatic = kKind == kFusedPush;
  constexpr bool kDynamic = kKind == kFusedPull;
  const uint32_t B = gridDim.x, R = g.routeBlocks;
  char* local = a.peers[g.rank];
  const uint32_t firstLocal = R + payloadBlocks;
  const uint32_t peerRanks = allRanksMask(g) & ~(1u << g.rank);
  if (blockIdx.x >= firstLocal) {
    // Pull mode: these blocks push the pushed share of this rank's tokens into the peers, while the routes are not
    // yet in (prefill: ~20 us in which they only waited) and the payload blocks stage the rest locally.
    if (pull && g.pushQuarters > 0) {
      dispatchPayload<kPushedSlots>(a, n, spreadWarp(blockIdx.x - firstLocal, B - firstLocal),
                                    (B - firstLocal) * blockWarps(g), peerRanks);
    }
    // Pull mode: warp 0 alone signals. Its fence returns once the pushed share has landed (prefill: ~20 us), and the
    // other warps meanwhile build the row tables and start on this rank's own tokens (warp 0 joins them after).
    const uint32_t first = pull ? 32u : 0u;
    signalAllRanks(a.peers, g, kFlagDispatch);  // its barrier: every warp's pushes before the fence (cumulative)
    const uint32_t ownWarp = spreadWarp(blockIdx.x - firstLocal, B - firstLocal),
                   ownWarps = (B - firstLocal) * blockWarps(g);
    // Push mode (decode-sized): the first unit's entries while the other ranks' counts are not in.
    bool havePre = false;
    RouteEntry pre{-1, 0};
    if (!pull) pre = firstOwnEntries(a, n, ownWarp, ownWarps, round, havePre);
    // Every rank's counts for this rank's experts, polled as they land (tagged words): no route flag.
    // (first == 0: push kernels, where the comparison is constant)
    const RowTables rt =
        first == 0 || threadIdx.x >= first ? rowsForHandoff(a, round, smem, first) : handedRows(g, smem);
    if (!rt.ok) return;
    tracePoint(a.st, kTrRoutesIn);
    if (blockIdx.x == firstLocal) {
      for (uint32_t le = threadIdx.x; le < g.numLocalExperts; le += blockDim.x) a.outNumTokens[le] = rt.total[le];
    }
    // When they join the peers' expansion (prefill) both expansions run on dynamic schedules (expandTokens).
    const bool join = !kStatic && ownBlocksJoin(g, rt, firstLocal);
    if (!kDynamic && !join) {
      expandTokens<false>(a, rt, kExpandOwn, n, nullptr, ownWarp, ownWarps, round, pre, havePre);
      tracePoint(a.st, kTrOwnDone);
      return;
    }
    expandTokens<true>(a, rt, kExpandOwn, n, queueOf(a.st, kQueueDispatchOwn, round), ownWarp, ownWarps, round);
    tracePoint(a.st, kTrOwnDone);
    if (!join) return;
    // The row tables are still in smem (expandTokens only reads them).
    if (!waitRanks(local, g, kFlagDispatch, peerRanks, static_cast<uint64_t>(round) * g.blocks, a.st,
                   kPhaseDispatchRecv)) {
      return;
    }
    tracePoint(a.st, kTrPeersIn);
    expandTokens<true>(a, rt, kExpandPeers, n, queueOf(a.st, kQueueDispatchPeers, round), 0, 0, round);
    return;
  }
  const bool router = blockIdx.x < R;
  if (router) {
    if (!dispatchRouting(a, n, smem, blockIdx.x, sendRound)) return;
    tracePoint(a.st, kTrRouted);
  } else {
    const uint32_t warp = spreadWarp(blockIdx.x - R, payloadBlocks), warps = payloadBlocks * blockWarps(g);
    if (pull) {
      dispatchPayload<kPulledSlots>(a, n, warp, warps, peerRanks);
    } else {
      dispatchPayload<kAllSlots>(a, n, warp, warps, peerRanks);
    }
    tracePoint(a.st, kTrStored);
  }
  // The block's share of the B dispatch increments (the routes are tagged words). Thread 0's fence returns only once
  // the link has drained the copy (decode T = 128: ~3 us after the last store), so warps 1-15 meanwhile poll every
  // rank's counts and build the row tables, and warp 0 takes them at the hand-off (rowsForHandoff). When thread 0
  // still polled its share of the counts after its fence, the tables were in ~1.4 us after it (trace; decode T = 128
  // -1.2 to -1.5 us eager, docs/nvlink.md, sixteenth pass). signalAllRanks' barrier orders every warp's stores before
  // the fence (cumulative) and the routing tables' last reads in smem before the rebuild.
  signalAllRanks(a.peers, g, kFlagDispatch);
  tracePoint(a.st, router ? kTrRouteSignalled : kTrSignalled);
  if (peerRanks == 0) return;
  const RowTables rt = threadIdx.x < 32 ? handedRows(g, smem) : rowsForHandoff(a, round, smem, 32);
  if (!rt.ok) return;
  tracePoint(a.st, kTrRows);
  if (!waitRanks(local, g, kFlagDispatch, peerRanks, static_cast<uint64_t>(round) * g.blocks, a.st,
                 kPhaseDispatchRecv)) {
    return;
  }
  tracePoint(a.st, kTrPeersIn);
  if (kDynamic || (!kStatic && ownBlocksJoin(g, rt, firstLocal))) {
    expandTokens<true>(a, rt, kExpandPeers, n, queueOf(a.st, kQueueDispatchPeers, round), 0, 0, round);
  } else {
    expandTokens<false>(a, rt, kExpandPeers, n, nullptr, spreadWarp(blockIdx.x, firstLocal), firstLocal * blockWarps(g),
                        round);
  }
}

// kKind (fused only, fusedDispatchKind() on the host): the kernel for one mode, compiled with that mode's code only
// (FusedKind). The kernel that can take every path is 345 KB of SASS; at decode its blocks spent microseconds
// fetching instructions (a routing pass of cold code, expansion units of 3-4 us with no stores at all, docs/nvlink.md,
// fourteenth pass): the push kernel (71 KB) dispatched T = 128 in 17.3-18.0 us instead of 19.9-20.4, the pull kernel
// (97 KB) prefill T = 4096 in 118.4-119.5 instead of 122.7-125.1 (fifteenth pass).
template <bool kSend, bool kRecv, int kKind = kFusedAny>
__global__ void __launch_bounds__(kMaxThreads, 1) dispatchKernel(const DispatchKernelArgs a) {
  extern __shared__ int32_t smem[];
  tracePoint(a.st, kTrEntry);
  const Preamble pre = loadPreamble(a.st, kSeqDispatchSend, kSeqDispatchRecv, kSend ? a.boundM : nullptr);
  if (pre.aborted) return;
  const Geometry& g = a.g;
  const uint32_t B = gridDim.x;
  if constexpr (kSend && kRecv) {
    // Roles need a payload block (when there are peers) and an own-expansion block besides the routing blocks. The
    // own tokens are about 1 / W of the expansion: that share of the non-routing blocks expands them, the rest push
    // this rank's tokens to the peers and then expand the peers' tokens.
    const uint32_t R = g.routeBlocks;
    const uint32_t payloadBlocks = g.worldSize > 1 && B > R ? B - R - fusedOwnBlocks(g) : 0;
    if (kKind != kFusedAny || fusedRolesFit(g)) {
      const uint32_t seqSend = pre.seqSend;
      const uint32_t round = pre.seqRecv + 1;
      const uint32_t n = numTokensSentBy(g.rank, effectiveBound(pre.bound, a.m), g.dpSize);
      clearNextQueues(a.st, round);
      if (kKind == kFusedLines || (kKind == kFusedAny && g.lines)) {
        fusedDispatchLines(a, smem, n, round, seqSend + 1, payloadBlocks);
      } else {
        fusedDispatch<kKind>(a, smem, n, round, seqSend + 1, payloadBlocks);
      }
      __syncthreads();
      tracePoint(a.st, kTrExit);
      if (threadIdx.x == 0 && !aborted(a.st)) {
        a.st.seq[kSeqDispatchSend * B + blockIdx.x] = seqSend + 1;
        a.st.seq[kSeqDispatchRecv * B + blockIdx.x] = round;
      }
      return;
    }
  }
  if constexpr (kSend) {
    const uint32_t seq = pre.seqSend;
    const uint32_t n = numTokensSentBy(g.rank, effectiveBound(pre.bound, a.m), g.dpSize);
    clearNextQueues(a.st, seq + 1);
    const uint32_t R = g.routeBlocks;
    const bool router = blockIdx.x < R;
    if (router) {
      if (!dispatchRouting(a, n, smem, blockIdx.x, seq + 1)) return;
      tracePoint(a.st, kTrRouted);
    }
    if (!router || B <= R) {  // B <= R only when B == 1: that block also copies
      const uint32_t payloadBlocks = B > R ? B - R : B;
      const uint32_t blk = B > R ? blockIdx.x - R : blockIdx.x;
      if (g.lines) {
        const uint32_t warp = spreadWarp(blk, payloadBlocks), warps = payloadBlocks * blockWarps(g);
        sendLineIndices(a, n, warp, warps, seq + 1);
        dispatchLines(a, n, warp, warps, allRanksMask(g), seq + 1, lineIndexWarps(n, g.topK, warps));
      } else {
        dispatchPayload<kAllSlots>(a, n, spreadWarp(blk, payloadBlocks), payloadBlocks * blockWarps(g),
                                   allRanksMask(g));
      }
      tracePoint(a.st, kTrStored);
    }
    // Routing blocks too: their entries and counts are tagged words, but the receivers' dispatch flag counts B.
    // Line mode: only the R routing blocks signal (for the combine, pollSenders); what the dispatch receivers poll is
    // tagged.
    if (!g.lines || router) {
      signalAllRanks(a.peers, g, kFlagDispatch);
      tracePoint(a.st, kTrSignalled);
    }
    if (threadIdx.x == 0) a.st.seq[kSeqDispatchSend * B + blockIdx.x] = seq + 1;
  }
  if constexpr (kRecv) {
    const uint32_t seq = pre.seqRecv + 1;
    if (g.lines) {
      const LineTables lt = computeLineTables(a, smem, seq);
      if (!lt.ok) return;
      tracePoint(a.st, kTrRows);
      if (blockIdx.x == 0) {
        for (uint32_t le = threadIdx.x; le < g.numLocalExperts; le += blockDim.x) a.outNumTokens[le] = lt.total[le];
      }
      expandLines<false>(a, lt, spreadWarp(blockIdx.x, B), B * blockWarps(g), seq, false);
      __syncthreads();
      tracePoint(a.st, kTrExit);
      if (threadIdx.x == 0) a.st.seq[kSeqDispatchRecv * B + blockIdx.x] = seq;
      return;
    }
    if (!waitAllRanks(a.peers[g.rank], g, kFlagDispatch, static_cast<uint64_t>(seq) * g.blocks, a.st,
                      kPhaseDispatchRecv)) {
      return;
    }
    tracePoint(a.st, kTrPeersIn);
    const RowTables rt = computeRows(a.peers[g.rank], g, smem, a.packed != 0, a.padding, seq, a.st);
    if (!rt.ok) return;
    tracePoint(a.st, kTrRows);
    if (blockIdx.x == 0) {
      for (uint32_t le = threadIdx.x; le < g.numLocalExperts; le += blockDim.x) a.outNumTokens[le] = rt.total[le];
    }
    // Prefill-sized rounds on a dynamic schedule (expandTokens); the send kernel of this round cleared nothing this
    // queue uses: it clears round seq + 1's, and the fused kernel, its only other user, does not run this round.
    if (manyUnitsPerWarp(g, sentTokens(rt, g.worldSize, g.worldSize), B)) {
      expandTokens<true>(a, rt, kExpandAll, 0, queueOf(a.st, kQueueDispatchPeers, seq), 0, 0, seq);
    } else {
      expandTokens<false>(a, rt, kExpandAll, 0, nullptr, spreadWarp(blockIdx.x, B), B * blockWarps(g), seq);
    }
    __syncthreads();
    tracePoint(a.st, kTrExit);
    if (threadIdx.x == 0) a.st.seq[kSeqDispatchRecv * B + blockIdx.x] = seq;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Combine

template <typename T>
struct Elem;
template <>
struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ float toF(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 fromF(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Elem<__half> {
  static __device__ __forceinline__ float toF(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half fromF(float v) { return __float2half_rn(v); }
};
template <>
struct Elem<float> {
  static __device__ __forceinline__ float toF(float v) { return v; }
  static __device__ __forceinline__ float fromF(float v) { return v; }
};

// N consecutive elements of type T as one (or two) vector accesses; N * sizeof(T) is 8, 16 or 32 bytes.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// A Vec read once (expertY in combine-send, the partials in combine-recv): streaming loads (ld.global.cs, evict
// first), so ~0.5 GB of expertY per prefill call does not push out of L2 the partials that the receive pass reads
// back.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> loadOnce(const T* p) {
  Vec<T, N> x;
  if constexpr (sizeof(x) == 8) {
    *reinterpret_cast<int2*>(&x) = __ldcs(reinterpret_cast<const int2*>(p));
  } else {
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(x) / 16); ++i) {
      reinterpret_cast<int4*>(&x)[i] = __ldcs(reinterpret_cast<const int4*>(p) + i);
    }
  }
  return x;
}

template <typename T, int N>
__device__ __forceinline__ void loadF(const T* p, float* out) {
  Vec<T, N> x = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = Elem<T>::toF(x.v[i]);
}

template <typename T, int N>
__device__ __forceinline__ void toF(const Vec<T, N>& x, float* out) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = Elem<T>::toF(x.v[i]);
}

template <typename T, int N>
__device__ __forceinline__ void storeF(T* p, const float* in) {
  Vec<T, N> x;
#pragma unroll
  for (int i = 0; i < N; ++i) x.v[i] = Elem<T>::fromF(in[i]);
  *reinterpret_cast<Vec<T, N>*>(p) = x;
}

// Send half of combine. The routing blocks first push this rank's router weights to every other rank (tagged with the
// round); every block then sums its experts' weighted outputs per token in fp32 (a peer's token once that peer's
// weights for it carry this round's tag) and sends one partial per (token, DP-group rank).
// Which senders' tokens one call of combineSendBody handles.
enum CombineSenders : int {
  kAllSenders = 0,
  kOwnSender = 1,     // this rank's own tokens: its weights are in `a.weights`, its partial stays here (D == 1)
  kOtherSenders = 2,  // every other sender's tokens (their weights pushed by their senders, tagged)
};

// Returns false (in every lane) when a peer's weights never arrived (recorded); the caller then skips its signal.
template <typename PT, int N>
__device__ bool combineSendBody(const CombineKernelArgs& a, const RowTables& rt, int senders, uint32_t round,
                                uint32_t warpId, uint32_t numWarps) {
  const Geometry& g = a.g;
  char* local = a.peers[g.rank];
  const uint32_t K = g.topK, W = g.worldSize, Ts = g.slotsPerSender, D = g.dpSize;
  const uint64_t* weights = reinterpret_cast<const uint64_t*>(local + g.offWeights);
  const PT* y = reinterpret_cast<const PT*>(a.y);
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t units = g.hiddenDim / N;
  // NOTE: one work unit = one token and one chunk of kChunkU units per lane, so a warp keeps kChunkU independent
  // loads in flight per expert row and the rows of one token spread over several warps (a warp walking a whole
  // 7168-element row with one load in flight measured ~100 us for decode).
  const uint32_t chunks = static_cast<uint32_t>(ceilDiv(units, 32 * kChunkU));
  // Items over the tokens actually sent (rt.tokens), not the W x Ts slots.
  const uint32_t skip = senders == kOtherSenders ? g.rank : W;
  const uint32_t items = senders == kOwnSender ? static_cast<uint32_t>(rt.tokens[g.rank]) : sentTokens(rt, W, skip);
  for (uint32_t wu = warpId; wu < items * chunks; wu += numWarps) {
    const uint32_t item = wu / chunks, chunk = wu % chunks;
    uint32_t s = g.rank, j = item;
    if (senders != kOwnSender) sentItem(rt, W, skip, item, s, j);
    const uint32_t t = j * D + s % D;
    const uint32_t group0 = (s / D) * D;
    // Per-lane destination: partial slot of (this expert rank, token t) on rank group0 + lane.
    uint8_t* dstLane = lane < D ? reinterpret_cast<uint8_t*>(a.peers[group0 + lane]) + g.offPartials +
                                      (static_cast<uint64_t>(g.rank) * g.maxTokens + t) * g.partialBytes
                                : nullptr;
    const uint32_t dstMask = D >= 32 ? 0xffffffffu : ((1u << D) - 1);
    // This unit's vectors of a row: [v0, v0 + 32 * kChunkU), cut at the row's end.
    const uint32_t v0 = chunk * 32 * kChunkU;
    const uint32_t sliceBytes = min(32u * kChunkU, units - v0) * static_cast<uint32_t>(N * sizeof(PT));
    // K <= 64: at most two lane groups of routing entries; the sum runs k ascending.
    int64_t yOff[2] = {-1, -1};
    float w[2] = {0.f, 0.f};
    uint32_t valid[2] = {0, 0};
    bool ok = true;
    for (uint32_t h = 0; h < 2; ++h) {
      const uint32_t k = h * 32 + lane;
      if (k < K) {
        // The row the dispatch gave this entry (DeviceState::rowSlots; a repeated expert's entries share it).
        const uint64_t slot = a.st.rowSlots[(static_cast<uint64_t>(s) * Ts + j) * K + k];
        if (slot != kNoRowSlot) {
          const int64_t le = static_cast<int64_t>(slot >> 32), idx = static_cast<uint32_t>(slot);
          yOff[h] = le * a.yExpertStride + idx * a.yRowStride;
          // The unit's slice of this row into L2 now: the rows are summed one after the other below, so without it
          // every row but the first starts with a memory latency (decode: ~4 rows per unit, ~2 units per warp).
          const uint8_t* rowSlice = reinterpret_cast<const uint8_t*>(y + yOff[h] + static_cast<int64_t>(v0) * N);
          if ((reinterpret_cast<uintptr_t>(rowSlice) & 15) == 0 && (sliceBytes & 15) == 0) {
            device::prefetchL2(rowSlice, sliceBytes);
          }
          // Own tokens: the caller's weights. A peer's: its pushed copy, tagged with its round (no entry barrier).
          if (s == g.rank) {
            w[h] =
                a.weights[static_cast<int64_t>(t) * a.weightStrides[0] + static_cast<int64_t>(k) * a.weightStrides[1]];
          } else {
            // A peer's weight for (s, j, k), pushed at the start of its combine-send `round`.
            uint32_t bits = 0;
            ok = waitTagged(weights + (static_cast<uint64_t>(s) * Ts + j) * K + k, round, a.st, kPhaseCombineEnter,
                            static_cast<int32_t>(g.rank), static_cast<int32_t>(s), bits);
            w[h] = __uint_as_float(bits);
          }
        }
      }
      valid[h] = __ballot_sync(0xffffffffu, yOff[h] >= 0);
    }
    if (!__all_sync(0xffffffffu, ok)) return false;
    if ((valid[0] | valid[1]) == 0) continue;
    // Shuffles are warp-uniform; lanes past the row end only skip memory accesses.
    float acc[kChunkU][N];
#pragma unroll
    for (int c = 0; c < kChunkU; ++c) {
#pragma unroll
      for (int i = 0; i < N; ++i) acc[c][i] = 0.f;
    }
    const uint32_t u0 = v0 + lane;
    for (uint32_t h = 0; h < 2; ++h) {
      for (uint32_t m = valid[h]; m != 0; m &= m - 1) {
        const int b = __ffs(m) - 1;
        const int64_t off = __shfl_sync(0xffffffffu, yOff[h], b);
        const float wk = __shfl_sync(0xffffffffu, w[h], b);
        float yv[kChunkU][N];
#pragma unroll
        for (int c = 0; c < kChunkU; ++c) {
          const uint32_t u = u0 + c * 32;
          if (u < units) toF<PT, N>(loadOnce<PT, N>(y + off + static_cast<int64_t>(u) * N), yv[c]);
        }
#pragma unroll
        for (int c = 0; c < kChunkU; ++c) {
#pragma unroll
          for (int i = 0; i < N; ++i) acc[c][i] = fmaf(wk, yv[c][i], acc[c][i]);
        }
      }
    }
    for (uint32_t m = dstMask; m != 0; m &= m - 1) {
      const int b = __ffs(m) - 1;
      PT* dst = reinterpret_cast<PT*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(dstLane), b));
#pragma unroll
      for (int c = 0; c < kChunkU; ++c) {
        const uint32_t u = u0 + c * 32;
        if (u < units) storeF<PT, N>(dst + static_cast<uint64_t>(u) * N, acc[c]);
      }
    }
  }
  return true;
}

// The ranks holding token t's experts (its indices in [0, E)), OR-ed over the warp.
__device__ __forceinline__ uint32_t tokenRanks(const CombineKernelArgs& a, uint32_t t) {
  const Geometry& g = a.g;
  uint32_t ranks = 0;
  for (uint32_t k = threadIdx.x % 32; k < g.topK; k += 32) {
    const int64_t e = loadIndex(a.indices, a.indexKind, a.indexStrides, t, k);
    if (e >= 0 && e < static_cast<int64_t>(g.numExperts)) ranks |= 1u << (static_cast<uint32_t>(e) / g.numLocalExperts);
  }
  return __reduce_or_sync(0xffffffffu, ranks);
}

// tokenRanks of the warp's first combineRecvBody unit (0 without one), loaded before the wait for the partials: the
// indices' round trip then is not in the unit's chain after the flag.
template <int N>
__device__ uint32_t firstRecvRanks(const CombineKernelArgs& a, uint32_t bound) {
  const uint32_t chunks = static_cast<uint32_t>(ceilDiv(a.g.hiddenDim / N, 32 * kChunkU));
  const uint32_t warpId = spreadWarp(blockIdx.x, gridDim.x);
  return warpId < bound * chunks ? tokenRanks(a, bound - 1 - warpId / chunks) : 0;
}

template <typename PT, typename OT, int N>
__device__ void combineRecvBody(const CombineKernelArgs& a, uint32_t firstRanks, uint32_t bound) {
  const Geometry& g = a.g;
  const char* local = a.peers[g.rank];
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t warpId = spreadWarp(blockIdx.x, gridDim.x), numWarps = gridDim.x * blockWarps(g);
  const uint32_t units = g.hiddenDim / N;
  OT* out = reinterpret_cast<OT*>(a.out);
  const uint32_t chunks = static_cast<uint32_t>(ceilDiv(units, 32 * kChunkU));
  for (uint32_t wu = warpId; wu < bound * chunks; wu += numWarps) {
    // Tokens in descending order: the send pass stored the partials in ascending order, so the last ones stored (the
    // ones L2 still holds at prefill, where the partials are twice its size) are read first.
    const uint32_t t = bound - 1 - wu / chunks, chunk = wu % chunks;
    const uint32_t ranks = wu == warpId ? firstRanks : tokenRanks(a, t);
    OT* row = out + static_cast<int64_t>(t) * a.outRowStride;
    const uint32_t u0 = chunk * 32 * kChunkU + lane;
    float acc[kChunkU][N];
#pragma unroll
    for (int c = 0; c < kChunkU; ++c) {
      const uint32_t u = u0 + c * 32;
      if (a.accumulate && u < units) {
        loadF<OT, N>(row + static_cast<uint64_t>(u) * N, acc[c]);
      } else {
#pragma unroll
        for (int i = 0; i < N; ++i) acc[c][i] = 0.f;
      }
    }
    // Expert ranks in ascending order: a fixed summation order, so results are bitwise reproducible. Two ranks'
    // partials are loaded per step (2 * kChunkU loads in flight per lane), then added in that order.
    auto partialOf = [&](int e) {
      return reinterpret_cast<const PT*>(local + g.offPartials +
                                         (static_cast<uint64_t>(e) * g.maxTokens + t) * g.partialBytes);
    };
    for (uint32_t m = ranks; m != 0;) {
      const int e1 = __ffs(m) - 1;
      m &= m - 1;
      const bool two = m != 0;
      const int e2 = two ? __ffs(m) - 1 : e1;
      if (two) m &= m - 1;
      const PT* p1 = partialOf(e1);
      const PT* p2 = partialOf(e2);
      Vec<PT, N> r1[kChunkU], r2[kChunkU];
#pragma unroll
      for (int c = 0; c < kChunkU; ++c) {
        const uint32_t u = u0 + c * 32;
        if (u < units) r1[c] = loadOnce<PT, N>(p1 + static_cast<uint64_t>(u) * N);
      }
      if (two) {
#pragma unroll
        for (int c = 0; c < kChunkU; ++c) {
          const uint32_t u = u0 + c * 32;
          if (u < units) r2[c] = loadOnce<PT, N>(p2 + static_cast<uint64_t>(u) * N);
        }
      }
#pragma unroll
      for (int c = 0; c < kChunkU; ++c) {
        float pv[N];
        toF<PT, N>(r1[c], pv);
#pragma unroll
        for (int i = 0; i < N; ++i) acc[c][i] += pv[i];
      }
      if (two) {
#pragma unroll
        for (int c = 0; c < kChunkU; ++c) {
          float pv[N];
          toF<PT, N>(r2[c], pv);
#pragma unroll
          for (int i = 0; i < N; ++i) acc[c][i] += pv[i];
        }
      }
    }
#pragma unroll
    for (int c = 0; c < kChunkU; ++c) {
      const uint32_t u = u0 + c * 32;
      if (u < units) storeF<OT, N>(row + static_cast<uint64_t>(u) * N, acc[c]);
    }
  }
}

template <bool kSend, bool kRecv, typename PT, typename OT>
__global__ void __launch_bounds__(kMaxThreads, 1) combineKernel(const CombineKernelArgs a) {
  extern __shared__ int32_t smem[];
  tracePoint(a.st, kTrEntry);
  const Preamble pre = loadPreamble(a.st, kSeqCombineSend, kSeqCombineRecv, a.boundM);
  if (pre.aborted) return;
  const Geometry& g = a.g;
  const uint32_t B = gridDim.x;
  const bool wide = g.hiddenDim % 8 == 0;
  if constexpr (kSend) {
    const uint32_t seq = pre.seqSend + 1;
    const uint32_t R = g.routeBlocks;
    if (blockIdx.x < R) {
      // The first R blocks (as many as route a dispatch: 1 for decode, 8 for a 4096-token prefill, whose weights are
      // 256 KB per rank) push this rank's router weights [n, K] to every other rank, each word tagged with this
      // round: a receiver waits for the words it needs, not for a flag, so there is no fence here and no entry
      // barrier (docs/nvlink.md, "combine without an entry barrier" for why buffer reuse needs none).
      const uint32_t n = numTokensSentBy(g.rank, effectiveBound(pre.bound, a.mSend), g.dpSize);
      const uint32_t K = g.topK;
      for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n * K; i += R * blockDim.x) {
        const uint32_t j = i / K, k = i % K;
        const uint32_t t = j * g.dpSize + g.rank % g.dpSize;
        const float w =
            a.weights[static_cast<int64_t>(t) * a.weightStrides[0] + static_cast<int64_t>(k) * a.weightStrides[1]];
        const uint64_t word = (static_cast<uint64_t>(seq) << 32) | __float_as_uint(w);
        const uint64_t off = g.offWeights + ((static_cast<uint64_t>(g.rank) * g.slotsPerSender + j) * K + k) * 8;
        for (uint32_t d = 0; d < g.worldSize; ++d) {
          if (d != g.rank) stRelaxedSys(reinterpret_cast<uint64_t*>(a.peers[d] + off), word);
        }
      }
      tracePoint(a.st, kTrRouted);
    }
    // The senders' token counts of this combine's round (dispatch and combine alternate); the rows come from the
    // dispatch (rowSlots), so no row tables.
    RowTables rt = rowTablesAt(g, smem, true);
    rt.ok = __syncthreads_and(pollSenders(a.peers[g.rank], g, rt.tokens, seq, a.st,
                                          g.lines ? static_cast<uint64_t>(seq) * g.routeBlocks : 0, threadIdx.x)
                                  ? 1
                                  : 0) != 0;
    if (!rt.ok) return;
    tracePoint(a.st, kTrRows);
    // With D == 1 this rank's own tokens have their partials here, on this rank, read only by its own combine-recv
    // (earlier on this stream), and their weights are the caller's. Two warp groups then run at once: warps
    // [0, ownWarps) sum the own tokens (local HBM only), the others the peers' tokens (their partials cross NVLink),
    // so the link is busy from the first peer weight on instead of after the own pass (which left it idle: decode
    // T = 128, own pass to 3.2-6.8 us, then the peers' partials stored by 7.6-12.1). Work splits by token count:
    // 1 / W of the warps for the own tokens. The R routing blocks, which pushed the weights, leave the own pass out
    // (with an equal share they finished it last; trace of session 4).
    auto body = [&](int senders, uint32_t warpId, uint32_t numWarps) {
      return wide ? combineSendBody<PT, 8>(a, rt, senders, seq, warpId, numWarps)
                  : combineSendBody<PT, 4>(a, rt, senders, seq, warpId, numWarps);
    };
    bool ok = true;
    if (g.dpSize == 1 && g.worldSize > 1) {
      const uint32_t ownWarps = max(1u, blockWarps(g) / g.worldSize), warp = threadIdx.x / 32;
      const uint32_t first = B > R ? R : 0;
      if (warp < ownWarps) {
        if (blockIdx.x >= first)
          ok = body(kOwnSender, warp * (B - first) + (blockIdx.x - first), (B - first) * ownWarps);
      } else {
        ok = body(kOtherSenders, (warp - ownWarps) * B + blockIdx.x, B * (blockWarps(g) - ownWarps));
      }
    } else {
      ok = body(kAllSenders, spreadWarp(blockIdx.x, B), B * blockWarps(g));
    }
    tracePoint(a.st, kTrRoutesIn);
    if (__syncthreads_and(ok ? 1 : 0) == 0) return;
    tracePoint(a.st, kTrStored);
    signalAllRanks(a.peers, g, kFlagCombineDone);
    tracePoint(a.st, kTrSignalled);
    if (threadIdx.x == 0) a.st.seq[kSeqCombineSend * B + blockIdx.x] = seq;
  }
  if constexpr (kRecv) {
    const uint32_t seq = pre.seqRecv + 1;
    const uint32_t bound = effectiveBound(pre.bound, a.m);
    const uint32_t firstRanks = wide ? firstRecvRanks<8>(a, bound) : firstRecvRanks<4>(a, bound);
    if (!waitAllRanks(a.peers[g.rank], g, kFlagCombineDone, static_cast<uint64_t>(seq) * g.blocks, a.st,
                      kPhaseCombineRecv)) {
      return;
    }
    tracePoint(a.st, kTrPeersIn);
    if (wide) {
      combineRecvBody<PT, OT, 8>(a, firstRanks, bound);
    } else {
      combineRecvBody<PT, OT, 4>(a, firstRanks, bound);
    }
    __syncthreads();
    tracePoint(a.st, kTrExit);
    if (threadIdx.x == 0) a.st.seq[kSeqCombineRecv * B + blockIdx.x] = seq;
  }
}

template <bool kSend, bool kRecv, typename PT, typename OT>
const void* combineFn() {
  return reinterpret_cast<const void*>(combineKernel<kSend, kRecv, PT, OT>);
}

template <bool kSend, bool kRecv, typename PT>
const void* combineFnOut(int outType) {
  switch (outType) {
    case kTypeBf16:
      return combineFn<kSend, kRecv, PT, __nv_bfloat16>();
    case kTypeF16:
      return combineFn<kSend, kRecv, PT, __half>();
    default:
      return combineFn<kSend, kRecv, PT, float>();
  }
}

template <bool kSend, bool kRecv>
const void* combineFnMode(int partialType, int outType) {
  if constexpr (kSend && !kRecv) {
    // The send half never touches outTokens: one instantiation per partial type.
    switch (partialType) {
      case kTypeBf16:
        return combineFn<true, false, __nv_bfloat16, __nv_bfloat16>();
      case kTypeF16:
        return combineFn<true, false, __half, __half>();
      default:
        return combineFn<true, false, float, float>();
    }
  } else {
    switch (partialType) {
      case kTypeBf16:
        return combineFnOut<kSend, kRecv, __nv_bfloat16>(outType);
      case kTypeF16:
        return combineFnOut<kSend, kRecv, __half>(outType);
      default:
        return combineFnOut<kSend, kRecv, float>(outType);
    }
  }
}

// The dispatch kernel for these halves; `kind`: the fused kernel's mode (FusedKind, fusedDispatchKind).
const void* dispatchFnFor(bool doSend, bool doRecv, int kind = kFusedAny) {
  if (doSend && doRecv) {
    switch (kind) {
      case kFusedPush:
        return reinterpret_cast<const void*>(dispatchKernel<true, true, kFusedPush>);
      case kFusedPull:
        return reinterpret_cast<const void*>(dispatchKernel<true, true, kFusedPull>);
      case kFusedLines:
        return reinterpret_cast<const void*>(dispatchKernel<true, true, kFusedLines>);
      default:
        return reinterpret_cast<const void*>(dispatchKernel<true, true>);
    }
  }
  return doSend ? reinterpret_cast<const void*>(dispatchKernel<true, false>)
                : reinterpret_cast<const void*>(dispatchKernel<false, true>);
}

// The combine kernel for these halves and element types.
const void* combineFnFor(bool doSend, bool doRecv, int partialType, int outType) {
  return doSend && doRecv ? combineFnMode<true, true>(partialType, outType)
         : doSend         ? combineFnMode<true, false>(partialType, outType)
                          : combineFnMode<false, true>(partialType, outType);
}

}  // namespace

KernelLaunch dispatchLaunch(const DispatchKernelArgs& args, bool doSend, bool doRecv) {
  return KernelLaunch{dispatchFnFor(doSend, doRecv, doSend && doRecv ? fusedDispatchKind(args.g) : kFusedAny),
                      args.g.blocks, args.g.threads, sharedBytes(args.g)};
}

KernelLaunch combineLaunch(const CombineKernelArgs& args, bool doSend, bool doRecv, int partialType, int outType) {
  return KernelLaunch{combineFnFor(doSend, doRecv, partialType, outType), args.g.blocks, args.g.threads,
                      sharedBytes(args.g)};
}

int launchKernel(const KernelLaunch& l, const void* args, void* stream) {
  void* params[] = {const_cast<void*>(args)};
  return static_cast<int>(
      cudaLaunchKernel(l.fn, dim3(l.blocks), dim3(l.threads), params, l.smemBytes, static_cast<cudaStream_t>(stream)));
}

int configureKernels(uint32_t bytes) {
  if (bytes <= 48 * 1024) return 0;
  // Every kernel the launch selectors can return (the send-only combine ignores outType: set more than once).
  constexpr bool kHalves[3][2] = {{true, true}, {true, false}, {false, true}};
  auto raise = [bytes](const void* fn) {
    return cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  };
  for (const auto& h : kHalves) {
    cudaError_t e = raise(dispatchFnFor(h[0], h[1]));
    for (int kind = kFusedPush; kind <= kFusedLines && e == cudaSuccess && h[0] && h[1]; ++kind) {
      e = raise(dispatchFnFor(true, true, kind));
    }
    for (int pt = kTypeBf16; pt <= kTypeF32 && e == cudaSuccess; ++pt) {
      for (int ot = kTypeBf16; ot <= kTypeF32 && e == cudaSuccess; ++ot) e = raise(combineFnFor(h[0], h[1], pt, ot));
    }
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  return 0;
}

}  // namespace nvlink
}  // namespace epcomm
