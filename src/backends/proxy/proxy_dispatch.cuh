// Dispatch kernels of the GPU proxy backend: the send half (routing, then packing the entries into the send slots)
// and the receive half (ranking the received entries, then copying them into their expert rows). Part of
// proxy_kernels.cu's translation unit: include it only there.
#pragma once

#include "backends/proxy/proxy_wait.cuh"

namespace epcomm {
namespace gpuproxy {
namespace {

// ---- Dispatch send -----------------------------------------------------------------------------------------------

// One block of kRankThreads. Checks every index of the tokens < bound (every rank of a DP group checks the same
// tokens); writes the group tokens' experts (deduplicated, -1 for none: masked by the caller, or by the active-ranks
// mask of elastic ranks) and, per (group sender d, expert e), the row of
// each (token, k) among d's rows of e (combine finds its rows with them); for this rank's own tokens, the entry index
// of each (token, owner) in the owner's send slot; and the head (expertCounts, entryCounts) into every send slot.
__global__ void __launch_bounds__(kRankThreads) dispatchRouteKernel(const DispatchSendArgs a) {
  allowDependentGrids();  // the pack kernel's blocks may be scheduled now; they wait for this kernel to finish
  const DeviceState& st = a.st;
  if (blockHalted(st)) return;
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
  extern __shared__ uint32_t shHist[];  // routeSharedBytes(): the per-warp counts, when they fit
  uint32_t* hist = routeSharedBytes(s) != 0 ? shHist : reinterpret_cast<uint32_t*>(st.scratch + st.sg.offHist);

  auto load = [&](uint32_t t, uint32_t k) {
    return decodeIndex(a.indices, a.indexKind,
                       static_cast<int64_t>(t) * a.indexStrides[0] + static_cast<int64_t>(k) * a.indexStrides[1]);
  };
  // 1. Experts of every (t, k) of the call's maxNumTokens rows: masked, repeated, out of range (recorded) and rows
  //    >= bound are -1. pos / entryOf are cleared for all of them (a later combine reads them for its own rows).
  //    Elastic ranks: the last round's mask (TableGeometry::offMasked).
  const uint32_t* masked = maskedWords(st, a.tg);
  const bool anyMasked = masked[0] != 0;
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
      // Elastic ranks: a masked sender's or owner's position is dropped (a repeat of it at j < k is dropped too).
      if (e >= 0 && anyMasked && droppedByMask(masked, me / D, t, D, static_cast<uint32_t>(e), L)) e = -1;
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
    // The first k of each owner among the token's experts (k order, as the host loop's first-use order). With
    // K <= 32 lane k holds (t, k) and the lanes of one owner find each other with one match (the lowest is the first);
    // larger K looks back over j < k. Called by every lane of the warp (uniform loop bounds).
    auto forFirstOfOwner = [&](uint32_t t, auto&& f) {
      if (K <= 32) {
        const int32_t e = lane < K ? experts[t * K + lane] : -1;
        const uint32_t owner = e >= 0 ? static_cast<uint32_t>(e) / L : ~0u;
        const uint32_t same = __match_any_sync(0xffffffffu, owner);
        if (e >= 0 && (same & device::laneMaskLt()) == 0) f(lane, owner);
        return;
      }
      for (uint32_t k = lane; k < K; k += 32) {
        const int32_t e = experts[t * K + k];
        if (e < 0) continue;
        const uint32_t o = static_cast<uint32_t>(e) / L;
        bool first = true;
        for (uint32_t j = 0; j < k && first; ++j) {
          const int32_t g = experts[t * K + j];
          first = !(g >= 0 && static_cast<uint32_t>(g) / L == o);
        }
        if (first) f(k, o);
      }
    };
    for (uint32_t i = begin; i < end; ++i) {
      forFirstOfOwner(d + i * D, [&](uint32_t, uint32_t o) { ++row[o]; });  // one lane per owner
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
      forFirstOfOwner(t, [&](uint32_t k, uint32_t o) { entryOf[t * K + k] = row[o]++; });
      __syncwarp();
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // the heads (host memory) before the pack kernel's signal
    stamp(st, round, &TraceRound::routeEnd);
  }
}

// Many blocks: one warp per (own token, kChunkBytes of its payload) loads that chunk of x once (and, for the first
// chunk, the scales) and stores it into every entry of the token ([payload][scales][u32 token][u16 n][u16 le[n]]): in
// the destinations' send slots, or, for a node peer (st.lg), in that peer's region (this rank's sender area, by entry
// index), or, for this rank itself without the NVLink path, in the scratch's own entries (device memory). The first
// chunk's warp writes the scales and the metadata. The last block raises this rank's dispatch flag in every node rank's
// region, then signals dispatchReady.
__global__ void __launch_bounds__(kCopyThreads) dispatchPackKernel(const DispatchSendArgs a) {
  waitPreviousGrid();  // launched while the route kernel runs: its experts, entries and heads first
  const DeviceState& st = a.st;
  if (blockHalted(st)) return;
  const proxy::ProtocolSizes& s = a.sizes;
  const uint32_t K = s.expertsPerToken, L = s.numLocalExperts, D = s.dpSize, me = s.rank;
  const uint32_t round = *seqWord(st, kSeqDispatchSend);
  if (blockIdx.x == 0 && threadIdx.x == 0) stamp(st, round, &TraceRound::packEntered);
  const uint32_t bound = *reinterpret_cast<const uint32_t*>(st.scratch + st.sg.offBound);
  const int32_t* experts = reinterpret_cast<const int32_t*>(st.scratch + st.sg.offExperts);
  const uint32_t* entryOf = reinterpret_cast<const uint32_t*>(st.scratch + st.sg.offEntryOf);
  const uint32_t n = numTokensSentBy(me, bound, D);
  const uint32_t lane = laneId();
  const uint32_t warps = gridDim.x * (blockDim.x / 32);
  const uint32_t scaleWords = static_cast<uint32_t>(s.scaleBytes / 4);
  const uint32_t chunks = static_cast<uint32_t>((s.payloadBytes + kChunkBytes - 1) / kChunkBytes);
  for (uint32_t u = blockIdx.x + gridDim.x * warpId(); u < n * chunks; u += warps) {
    const uint32_t i = u / chunks, chunk = u % chunks;
    const uint32_t t = me % D + i * D;
    const uint8_t* xRow = a.x + static_cast<int64_t>(t) * a.xRowStrideBytes;
    const uint64_t base = chunk * kChunkBytes + lane * 16ull;
    // Every load before the first store.
    int4 v[kCopyBatch];
#pragma unroll
    for (uint32_t q = 0; q < kCopyBatch; ++q) {
      const uint64_t off = base + q * 32 * 16;
      if (off < s.payloadBytes) v[q] = *reinterpret_cast<const int4*>(xRow + off);
    }
    auto scaleAt = [&](uint32_t c) {
      return *reinterpret_cast<const uint32_t*>(
          a.xScale + 4 * (static_cast<int64_t>(t) * a.xScaleStrides[0] + static_cast<int64_t>(c) * a.xScaleStrides[1]));
    };
    uint32_t sv[kScaleBatch];
#pragma unroll
    for (uint32_t q = 0; q < kScaleBatch; ++q) {
      const uint32_t c = lane + 32 * q;
      if (chunk == 0 && c < scaleWords) sv[q] = scaleAt(c);
    }
    for (uint32_t k0 = 0; k0 < K; k0 += 32) {
      // Lane k holds (t, k0 + k)'s expert and entry index; the warp walks the positions that own an entry.
      const uint32_t kk = k0 + lane;
      const int32_t myE = kk < K ? experts[t * K + kk] : -1;
      const uint32_t myEnt = kk < K ? entryOf[t * K + kk] : ~0u;
      for (uint32_t todo = __ballot_sync(0xffffffffu, myEnt != ~0u); todo != 0; todo &= todo - 1) {
        const uint32_t from = __ffs(todo) - 1;
        const uint32_t k = k0 + from;
        const uint32_t ent = __shfl_sync(0xffffffffu, myEnt, from);
        const uint32_t owner = static_cast<uint32_t>(__shfl_sync(0xffffffffu, myE, from)) / L;
        uint8_t* entry =
            (st.lg.has(owner) ? localRegion(st, owner) + st.lg.offEntries + (me - st.lg.first) * st.lg.senderBytes
                              : (owner == me ? st.scratch + st.sg.offOwnEntries
                                             : a.ch.send + s.sendSlotOffset(owner) + s.headBytes)) +
            static_cast<uint64_t>(ent) * s.entryBytes;
#pragma unroll
        for (uint32_t q = 0; q < kCopyBatch; ++q) {
          const uint64_t off = base + q * 32 * 16;
          if (off < s.payloadBytes) st16(entry + off, v[q]);
        }
        if (chunk != 0) continue;
        uint32_t* scale = reinterpret_cast<uint32_t*>(entry + s.payloadBytes);
#pragma unroll
        for (uint32_t q = 0; q < kScaleBatch; ++q) {
          const uint32_t c = lane + 32 * q;
          if (c < scaleWords) scale[c] = sv[q];
        }
        for (uint32_t c = lane + 32 * kScaleBatch; c < scaleWords; c += 32) scale[c] = scaleAt(c);
        // Metadata: this owner's local experts in k order (from k on: earlier k have other owners).
        uint8_t* meta = entry + s.metaOffset;
        uint32_t count = 0;
        for (uint32_t m0 = k; m0 < K; m0 += 32) {
          const uint32_t mk = m0 + lane;
          const int32_t e = mk < K ? experts[t * K + mk] : -1;
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
  }
  lastBlock(st, kSeqDispatchSend, [&] {
    *seqWord(st, kSeqDispatchSend) = round + 1;
    raiseLocalFlags(st, me, st.lg.offDispatchFlag, round + 1);
    stamp(st, round, &TraceRound::packReady);
    stReleaseSys(&st.mailbox->dispatchReady, round + 1);
  });
}

// ---- Dispatch receive --------------------------------------------------------------------------------------------

__device__ __forceinline__ const uint8_t* entryAt(const DispatchRecvArgs& a, uint32_t src, uint32_t j,
                                                  uint32_t overflowStart) {
  const proxy::ProtocolSizes& s = a.sizes;
  const LocalGeometry& lg = a.st.lg;
  // A node peer's entries (this rank's own too, when the NVLink path is on) are in this rank's region.
  if (lg.has(src)) {
    return a.st.localMine + lg.offEntries + (src - lg.first) * lg.senderBytes + static_cast<uint64_t>(j) * s.entryBytes;
  }
  // This rank's own entries are in device memory (the pack kernel put them there; no loopback, no PCIe).
  if (src == s.rank) return a.st.scratch + a.st.sg.offOwnEntries + static_cast<uint64_t>(j) * s.entryBytes;
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

// Entry metadata as the rank kernel loads it: the first kMetaWords u32 words at metaOffset ([u32 token][u16 n][u16
// le[n]]), all loads issued at once; experts beyond kMetaInWords are read one by one (only when min(K, L) > 13).
constexpr uint32_t kMetaWords = 8;
constexpr uint32_t kMetaInWords = (kMetaWords * 4 - proxy::kEntryExpertsOffset) / 2;
static_assert(proxy::kEntryCountOffset == 4 && proxy::kEntryExpertsOffset == 6, "metadata words as decoded below");

// `vec`: metaOffset is a multiple of 16 (entries are 16-byte aligned and padded), so the words are read with one or
// two 16-byte loads instead of up to eight 4-byte ones (each a PCIe request of its own when the entry is in host
// memory).
__device__ __forceinline__ void loadMeta(const uint8_t* meta, uint32_t words, bool vec, uint32_t (&mw)[kMetaWords]) {
  static_assert(kMetaWords == 8, "two 16-byte loads");
  if (vec) {
    const int4 lo = ldVolatile16(meta);
    const int4 hi = words > 4 ? ldVolatile16(meta + 16) : make_int4(0, 0, 0, 0);
    const int32_t v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (uint32_t q = 0; q < kMetaWords; ++q) mw[q] = static_cast<uint32_t>(v[q]);
    return;
  }
#pragma unroll
  for (uint32_t q = 0; q < kMetaWords; ++q) mw[q] = q < words ? ldVolatileU32(meta + 4 * q) : 0u;
}

// Checks entry (src, j)'s metadata and writes its local experts and their count into the scratch (rowsOf, which the
// ranking then turns into rows; entryCountOf). A count or expert out of range is recorded as a corrupt buffer.
__device__ __forceinline__ void decodeMeta(const DispatchRecvArgs& a, uint32_t src, uint32_t j, const uint8_t* meta,
                                           const uint32_t (&mw)[kMetaWords]) {
  const proxy::ProtocolSizes& s = a.sizes;
  const uint32_t me = s.rank, L = s.numLocalExperts;
  uint32_t count = mw[1] & 0xffffu;
  if (count < 1 || count > s.maxLocalPerEntry) {
    recordError(a.st, kPhaseCorruptEntry, static_cast<int32_t>(me), static_cast<int32_t>(src), j, count, true);
    count = 0;
  }
  uint32_t* rows = rowsOf(a, src, j);
  auto take = [&](uint32_t i, uint32_t le) {
    if (le >= L) {
      recordError(a.st, kPhaseCorruptEntry, static_cast<int32_t>(me), static_cast<int32_t>(src), j, le, true);
      count = i;
    } else {
      rows[i] = le;
    }
  };
#pragma unroll
  for (uint32_t i = 0; i < kMetaInWords; ++i) {
    const uint32_t b = proxy::kEntryExpertsOffset + 2 * i;
    if (i < count) take(i, (mw[b / 4] >> (8 * (b % 4))) & 0xffffu);
  }
  for (uint32_t i = kMetaInWords; i < count; ++i) take(i, ldVolatileU16(meta + proxy::kEntryExpertsOffset + 2 * i));
  *entryCountOf(a, src, j) = count;
}

// One block per sender src (kRankThreads): waits for the proxy's arrival word (and, through block 0, for the node
// senders' flags), reads src's entries' metadata, and gives each (entry, local expert) its output row: rows of local
// expert le are ordered by (sender, token), and an entry's rank among src's entries naming le is its rank among src's
// tokens of that expert. Block 0 also writes outExpertNumTokens. Counts that disagree with src's head are recorded as
// a corrupt receive buffer.
//
// Host memory is a PCIe round trip away (several us under MPS), and one SM has only so many reads of it in flight,
// so the reads are few, wide and issued together. Tables up to kRankSharedTableBytes (every decode configuration):
// one pass in which every thread issues all its loads before using any (up to two 16-byte words of the tables into
// shared memory, this block's share of them into the device copy; the metadata of the entry j = thread in src's
// private area, speculatively, before the count is known); everything else comes from shared memory. Larger tables:
// the same pass with 4-byte loads of what this thread uses (its share of the device copy; le = thread's slot offsets
// and row base; src's entry count and overflow start). Then a second pass for entries beyond the private area
// (overflow) only. Everything after that reads device memory.
__global__ void __launch_bounds__(kRankThreads) dispatchRankKernel(const DispatchRecvArgs a) {
  const DeviceState& st = a.st;
  const proxy::ProtocolSizes& s = a.sizes;
  const TableGeometry& tg = a.tg;
  const uint32_t L = s.numLocalExperts, W = s.worldSize, me = s.rank, src = blockIdx.x, tid = threadIdx.x;
  __shared__ int ok;
  __shared__ uint32_t shN, shOverflow;
  extern __shared__ int4 shTables[];  // rankSharedBytes(): the whole tables, when they fit
  const uint32_t round = *seqWord(st, kSeqDispatchRecv);
  if (tid == 0) {
    ok = !deviceHalted(st) &&
         waitArrival(st, 0, &st.mailbox->dispatchArrived, round + 1, kPhaseDispatchArrival, static_cast<int32_t>(me));
    if (!ok) haltObject(st);
    if (ok && src == 0) stamp(st, round, &TraceRound::unpackStart);
  }
  __syncthreads();
  if (!ok) return;
  // The copy kernel's blocks may be scheduled now (not before the arrival: while this kernel waits, the SMs stay free
  // for the caller's other work); they wait for this kernel to finish.
  allowDependentGrids();
  const uint32_t* tables = a.ch.tables;
  uint32_t* copy = reinterpret_cast<uint32_t*>(st.scratch + st.sg.offTables);  // for the kernels after this one
  const uint32_t spec = min(s.privateTokens, s.maxSendTokens);  // entries read before their count is known
  const uint32_t metaWords = min(kMetaWords, (proxy::kEntryExpertsOffset + 2 * s.maxLocalPerEntry + 3) / 4);
  const bool metaVec = s.metaOffset % 16 == 0;
  const bool inShared = rankSharedBytes(tg) != 0;
  const uint32_t* tv = inShared ? reinterpret_cast<const uint32_t*>(shTables) : tables;  // where le's values are
  uint32_t myFirst = 0, myNext = 0, myBase = 0;  // le = tid (larger tables: kept from the first pass)
  if (inShared) {
    static_assert(kRankSharedTableBytes <= 2 * 16 * kRankThreads, "two 16-byte words of the tables per thread");
    const uint32_t quads = static_cast<uint32_t>(tableBytes(tg) / 16);
    const int4* t4 = reinterpret_cast<const int4*>(tables);
    int4* c4 = reinterpret_cast<int4*>(copy);
    const uint8_t* meta = tid < spec ? entryAt(a, src, tid, 0) + s.metaOffset : nullptr;
    int4 q[2];
    uint32_t mw[kMetaWords];
    // Loads: none of them waits for another.
#pragma unroll
    for (uint32_t h = 0; h < 2; ++h) {
      if (tid + h * blockDim.x < quads) q[h] = ldVolatile16(t4 + tid + h * blockDim.x);
    }
    if (meta != nullptr) loadMeta(meta, metaWords, metaVec, mw);
    // Uses.
    for (uint32_t h = 0; h < 2; ++h) {
      const uint32_t at = tid + h * blockDim.x;
      if (at >= quads) continue;
      shTables[at] = q[h];
      if (at % gridDim.x == src) c4[at] = q[h];  // the device copy: quads src, src + W, ...
    }
    __syncthreads();
    uint32_t nv = tv[tg.offEntries + src];
    if (nv > s.maxSendTokens) {
      if (tid == 0) {
        recordError(st, kPhaseCorruptEntry, static_cast<int32_t>(me), static_cast<int32_t>(src), nv, s.maxSendTokens,
                    true);
      }
      nv = 0;
    }
    if (tid == 0) {
      shN = nv;
      shOverflow = tv[tg.offOverflowStart + src];
    }
    if (src == 0) {
      for (uint32_t le = tid; le < L; le += blockDim.x)
        a.outNumTokens[le] = static_cast<int32_t>(tv[tg.offLocalRows + le]);
    }
    if (meta != nullptr && tid < nv) decodeMeta(a, src, tid, meta, mw);
    for (uint32_t j = tid + blockDim.x; j < min(spec, nv); j += blockDim.x) {  // a private area above kRankThreads
      const uint8_t* mj = entryAt(a, src, j, 0) + s.metaOffset;
      loadMeta(mj, metaWords, metaVec, mw);
      decodeMeta(a, src, j, mj, mw);
    }
    __syncthreads();
  } else {
    const uint32_t* slotOffset = tables + tg.offSlotOffset;
    const uint32_t copyStride = gridDim.x * blockDim.x;
    const uint32_t passes = max(1u, max(max((L + blockDim.x - 1) / blockDim.x, (spec + blockDim.x - 1) / blockDim.x),
                                        (tg.words + copyStride - 1) / copyStride));
    for (uint32_t pass = 0; pass < passes; ++pass) {
      const uint32_t i = pass * blockDim.x + tid;
      const uint32_t ci = pass * copyStride + blockIdx.x * blockDim.x + tid;
      const uint8_t* meta = i < spec ? entryAt(a, src, i, 0) + s.metaOffset : nullptr;  // private: no overflow start
      uint32_t cv = 0, f = 0, nx = 0, b = 0, lr = 0, nv = 0, ov = 0;
      uint32_t mw[kMetaWords];
      // Loads: none of them waits for another.
      if (ci < tg.words) cv = ldVolatileU32(tables + ci);
      if (i < L) {
        f = ldVolatileU32(slotOffset + i * (W + 1) + src);
        nx = ldVolatileU32(slotOffset + i * (W + 1) + src + 1);
        b = ldVolatileU32(tables + tg.offOutputRowBase + i);
        if (src == 0) lr = ldVolatileU32(tables + tg.offLocalRows + i);
      }
      if (meta != nullptr) loadMeta(meta, metaWords, metaVec, mw);
      if (pass == 0 && tid == 0) {
        nv = ldVolatileU32(tables + tg.offEntries + src);
        ov = ldVolatileU32(tables + tg.offOverflowStart + src);
      }
      // Uses.
      if (ci < tg.words) copy[ci] = cv;
      if (i < L) {
        if (pass == 0) {
          myFirst = f;
          myNext = nx;
          myBase = b;
        }
        if (src == 0) a.outNumTokens[i] = static_cast<int32_t>(lr);
      }
      if (pass == 0 && tid == 0) {
        if (nv > s.maxSendTokens) {
          recordError(st, kPhaseCorruptEntry, static_cast<int32_t>(me), static_cast<int32_t>(src), nv, s.maxSendTokens,
                      true);
          nv = 0;
        }
        shN = nv;
        shOverflow = ov;
      }
      __syncthreads();
      if (meta != nullptr && i < shN) decodeMeta(a, src, i, meta, mw);
    }
  }
  const uint32_t n = shN;
  // Entries beyond the private area (in the overflow region, for a fabric sender): a second pass of loads.
  for (uint32_t j = spec + tid; j < n; j += blockDim.x) {
    const uint8_t* meta = entryAt(a, src, j, shOverflow) + s.metaOffset;
    uint32_t mw[kMetaWords];
    loadMeta(meta, metaWords, metaVec, mw);
    decodeMeta(a, src, j, meta, mw);
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
  for (uint32_t le = tid; le < L; le += blockDim.x) {
    uint32_t first = myFirst, next = myNext, base = myBase;
    if (inShared || le >= blockDim.x) {  // shared memory, or L > kRankThreads: not kept from the first pass
      const uint32_t* slotOffset = tv + tg.offSlotOffset;
      first = inShared ? slotOffset[le * (W + 1) + src] : ldVolatileU32(slotOffset + le * (W + 1) + src);
      next = inShared ? slotOffset[le * (W + 1) + src + 1] : ldVolatileU32(slotOffset + le * (W + 1) + src + 1);
      base = inShared ? tv[tg.offOutputRowBase + le] : ldVolatileU32(tv + tg.offOutputRowBase + le);
    }
    uint32_t run = base + first;
    uint32_t c[kRankWarps];  // every load first: one memory round trip, not kRankWarps dependent ones
#pragma unroll
    for (uint32_t v = 0; v < kRankWarps; ++v) c[v] = hist[v * L + le];
#pragma unroll
    for (uint32_t v = 0; v < kRankWarps; ++v) {
      hist[v * L + le] = run;
      run += c[v];
    }
    const uint32_t got = run - first - base;
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
  lastBlock(st, kSeqDispatchRecv, [&] {
    *seqWord(st, kSeqDispatchRecv) = round + 1;
    stamp(st, round, &TraceRound::rankEnd);
  });
}

// Many blocks: one warp per (received entry, kChunkBytes of its payload) copies that chunk from host memory (fabric
// senders) or device memory (node senders; this rank's own entries) into each of the entry's rows; the first chunk's
// warp copies the scales too. Each warp issues all its loads before its first store: one round trip per work item.
__global__ void __launch_bounds__(kCopyThreads) dispatchCopyKernel(const DispatchRecvArgs a) {
  waitPreviousGrid();  // launched while the rank kernel runs: its rows and tables copy first
  const DeviceState& st = a.st;
  extern __shared__ uint32_t entryStart[];  // [W + 1], then overflowStart[W]
  const proxy::ProtocolSizes& s = a.sizes;
  const TableGeometry& tg = a.tg;
  const uint32_t W = s.worldSize;
  if (blockHalted(st)) return;  // the rank kernel gave up: the tables are not this round's
  if (st.trace != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    stamp(st, *seqWord(st, kSeqDispatchRecv) - 1, &TraceRound::copyEntered);  // the rank kernel advanced it
  }
  uint32_t* overflowStart = entryStart + W + 1;
  const uint32_t* tables = deviceTables(st);
  for (uint32_t i = threadIdx.x; i <= W; i += blockDim.x) {
    entryStart[i] = tables[tg.offEntryStart + i];
    if (i < W) overflowStart[i] = tables[tg.offOverflowStart + i];
  }
  __syncthreads();
  const bool batched = s.layout == Layout::kBatched;
  const uint64_t R = s.batchedRowsPerExpert;
  const uint32_t scaleWords = static_cast<uint32_t>(s.scaleBytes / 4);
  const uint32_t lane = laneId();
  const uint32_t warps = gridDim.x * (blockDim.x / 32);
  const uint32_t chunks = static_cast<uint32_t>((s.payloadBytes + kChunkBytes - 1) / kChunkBytes);
  const uint32_t total = entryStart[W] * chunks;
  uint32_t src = 0;
  auto rowAt = [&](uint64_t r, int64_t& e, int64_t& rr) {
    e = batched ? static_cast<int64_t>(r / R) : 0;
    rr = batched ? static_cast<int64_t>(r % R) : static_cast<int64_t>(r);
  };
  for (uint32_t u = blockIdx.x + gridDim.x * warpId(); u < total; u += warps) {
    const uint32_t item = u / chunks, chunk = u % chunks;
    while (entryStart[src + 1] <= item) ++src;  // items ascend per warp: the sender only moves forward
    const uint32_t j = item - entryStart[src];
    const uint8_t* entry = entryAt(a, src, j, overflowStart[src]);
    const uint64_t base = chunk * kChunkBytes + lane * 16ull;
    int4 v[kCopyBatch];
#pragma unroll
    for (uint32_t q = 0; q < kCopyBatch; ++q) {
      const uint64_t off = base + q * 32 * 16;
      if (off < s.payloadBytes) v[q] = ldVolatile16(entry + off);
    }
    uint32_t sv[kScaleBatch];
#pragma unroll
    for (uint32_t q = 0; q < kScaleBatch; ++q) {
      const uint32_t c = lane + 32 * q;
      if (chunk == 0 && c < scaleWords) sv[q] = ldVolatileU32(entry + s.payloadBytes + 4 * c);
    }
    const uint32_t count = *entryCountOf(a, src, j);
    const uint32_t* rows = rowsOf(a, src, j);
    for (uint32_t i = 0; i < count; ++i) {
      int64_t e, rr;
      rowAt(rows[i], e, rr);
      uint8_t* row = a.outX + e * a.outExpertStrideBytes + rr * a.outRowStrideBytes;
#pragma unroll
      for (uint32_t q = 0; q < kCopyBatch; ++q) {
        const uint64_t off = base + q * 32 * 16;
        if (off < s.payloadBytes) st16(row + off, v[q]);
      }
      if (chunk != 0 || scaleWords == 0) continue;
      uint32_t* scale = reinterpret_cast<uint32_t*>(a.outScale) + e * a.outScaleStrides[0] + rr * a.outScaleStrides[1];
#pragma unroll
      for (uint32_t q = 0; q < kScaleBatch; ++q) {
        const uint32_t c = lane + 32 * q;
        if (c < scaleWords) scale[static_cast<int64_t>(c) * a.outScaleStrides[2]] = sv[q];
      }
      for (uint32_t c = lane + 32 * kScaleBatch; c < scaleWords; c += 32) {  // more than 4 x 32 scale words
        scale[static_cast<int64_t>(c) * a.outScaleStrides[2]] = ldVolatileU32(entry + s.payloadBytes + 4 * c);
      }
    }
  }
  if (st.trace != nullptr) {
    const uint32_t round = *seqWord(st, kSeqDispatchRecv) - 1;  // the rank kernel advanced it
    lastBlock(st, kSeqDispatchRecv, [&] { stamp(st, round, &TraceRound::unpackEnd); });
  }
}

}  // namespace
}  // namespace gpuproxy
}  // namespace epcomm
