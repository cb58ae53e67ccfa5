// Receive half of the nvlink dispatch (the expansion of received tokens into their expert rows), the fused dispatch
// and the dispatch kernel. Part of nvlink_kernels.cu's translation unit: include it only there.
#pragma once

#include "backends/nvlink/nvlink_routing.cuh"

namespace epcomm {
namespace nvlink {
namespace {

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
// other by one (W = 1, decode T = 32: one warp's 8 rows took 1.8 us after its loads; docs/nvlink.md). Only with at
// least 4 warps per unit: with 2 (W = 1, T = 128) the second load of every piece cost more than the shorter chains
// gained (+0.2 us).
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
// one included; why is open: docs/nvlink.md).
// `pre` (static schedule only, when `havePre`): the entries of the warp's first unit, polled by firstOwnEntries()
// before the wait that preceded this call.
// kCast (kernels of Config::dispatchCast): kExpandOwn casts this rank's bf16 tokens as the send half casts the
// peers' (castUnit), and stores their blocks' scales with the rows.
template <bool kDynamic, bool kCast = false>
__device__ void expandTokens(const DispatchKernelArgs& a, const RowTables& rt, int mode, uint32_t nOwn, uint32_t* queue,
                             uint32_t warpId, uint32_t numWarps, uint32_t round, RouteEntry pre = RouteEntry{-1, 0},
                             bool havePre = false) {
  const Geometry& g = a.g;
  char* local = a.peers[g.rank];
  const uint32_t L = g.numLocalExperts, K = g.topK, W = g.worldSize, Ts = g.slotsPerSender, D = g.dpSize;
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t units = g.hiddenBytes / 16, scaleWords = g.scaleBytes / 4;
  const uint32_t pieces = tokenPiecesOf<kCast>(g);
  const uint32_t skip = mode == kExpandPeers ? g.rank : W;
  const bool castOwn = kCast && mode == kExpandOwn;
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
    float castScale[kCastUnroll];
    const uint32_t vpl = unitVectorsOf<kCast>(g), u0 = piece * 32 * vpl + lane;
    if (castOwn) {
      castUnit(src, u0, units, a.cast == static_cast<uint32_t>(DispatchCast::kFp8BlocksPow2), v, castScale);
    } else {
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        const uint32_t u = u0 + i * 32;
        if (i < vpl && u < units) v[i] = *reinterpret_cast<const int4*>(src + static_cast<uint64_t>(u) * 16);
      }
    }
    const bool scales = !castOwn && piece == pieces - 1;
    uint32_t sc[2] = {0, 0};
    if (scales) loadFirstScales(scaleSrc, scaleStride, lane, scaleWords, sc);
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
        if (castOwn) {
          storeCastScales(a.outScale + __shfl_sync(0xffffffffu, scaleOff, b), a.outScaleStrideBytes[2], u0, units,
                          castScale);
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
// decode T = 128 (docs/nvlink.md).
template <bool kCast>
__device__ RouteEntry firstOwnEntries(const DispatchKernelArgs& a, uint32_t nOwn, uint32_t warpId, uint32_t numWarps,
                                      uint32_t round, bool& have) {
  const Geometry& g = a.g;
  const uint32_t units = nOwn * tokenPiecesOf<kCast>(g), groups = rowGroups(units, numWarps, g.topK);
  have = warpId < units * groups;
  if (!have || threadIdx.x % 32 >= g.topK) return RouteEntry{-1, 0};
  return pollEntry(a, g.rank, unitItem(warpId, groups, tokenPiecesOf<kCast>(g)), threadIdx.x % 32, round);
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
template <int kKind, bool kCast>
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
      dispatchPayload<kPushedSlots, kCast>(a, n, spreadWarp(blockIdx.x - firstLocal, B - firstLocal),
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
    if (!pull) pre = firstOwnEntries<kCast>(a, n, ownWarp, ownWarps, round, havePre);
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
      expandTokens<false, kCast>(a, rt, kExpandOwn, n, nullptr, ownWarp, ownWarps, round, pre, havePre);
      tracePoint(a.st, kTrOwnDone);
      return;
    }
    expandTokens<true, kCast>(a, rt, kExpandOwn, n, queueOf(a.st, kQueueDispatchOwn, round), ownWarp, ownWarps, round);
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
      dispatchPayload<kPulledSlots, kCast>(a, n, warp, warps, peerRanks);
    } else {
      dispatchPayload<kAllSlots, kCast>(a, n, warp, warps, peerRanks);
    }
    tracePoint(a.st, kTrStored);
  }
  // The block's share of the B dispatch increments (the routes are tagged words). Thread 0's fence returns only once
  // the link has drained the copy (decode T = 128: ~3 us after the last store), so warps 1-15 meanwhile poll every
  // rank's counts and build the row tables, and warp 0 takes them at the hand-off (rowsForHandoff). When thread 0
  // still polled its share of the counts after its fence, the tables were in ~1.4 us after it (trace; decode T = 128
  // -1.2 to -1.5 us eager, docs/nvlink.md). signalAllRanks' barrier orders every warp's stores before the fence
  // (cumulative) and the routing tables' last reads in smem before the rebuild.
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
// fetching instructions (a routing pass of cold code, expansion units of 3-4 us with no stores at all): the push
// kernel (71 KB) dispatched T = 128 in 17.3-18.0 us instead of 19.9-20.4, the pull kernel (97 KB) prefill T = 4096 in
// 118.4-119.5 instead of 122.7-125.1 (docs/nvlink.md).
// kCast: the kernels of Config::dispatchCast (send halves only), so that the kernels that copy keep their code.
template <bool kSend, bool kRecv, int kKind = kFusedAny, bool kCast = false>
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
      fusedDispatch<kKind, kCast>(a, smem, n, round, seqSend + 1, payloadBlocks);
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
      dispatchPayload<kAllSlots, kCast>(a, n, spreadWarp(blk, payloadBlocks), payloadBlocks * blockWarps(g),
                                        allRanksMask(g));
      tracePoint(a.st, kTrStored);
    }
    // Routing blocks too: their entries and counts are tagged words, but the receivers' dispatch flag counts B.
    signalAllRanks(a.peers, g, kFlagDispatch);
    tracePoint(a.st, kTrSignalled);
    if (threadIdx.x == 0) a.st.seq[kSeqDispatchSend * B + blockIdx.x] = seq + 1;
  }
  if constexpr (kRecv) {
    const uint32_t seq = pre.seqRecv + 1;
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

}  // namespace
}  // namespace nvlink
}  // namespace epcomm
