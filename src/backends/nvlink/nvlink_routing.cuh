// Send half of the nvlink dispatch: the routing scan (per-expert positions and counts of this rank's tokens) and the
// payload copy into the receivers' staging slots. Part of nvlink_kernels.cu's translation unit: include it only there.
#pragma once

#include <cuda_fp8.h>

#include "backends/nvlink/nvlink_rows.cuh"
#include "core/fp8_cast.hpp"

namespace epcomm {
namespace nvlink {
namespace {

// Routing blocks of the send half (R = g.routeBlocks; decode: 1): per-expert positions of this rank's tokens (a
// stable counting sort by expert, in token order) and counts, written into every receiver with the token's K routing
// entries. Positions are computed here, by the one rank that knows its tokens, so the receiver needs only a W x L
// prefix sum. Routing block c owns tokens [c * routeChunk, (c + 1) * routeChunk); with R > 1 each first counts its
// chunk per expert, publishes the histogram in routeScratch, waits for the other routing blocks of this rank (same
// GPU) and starts its positions at the sum of the earlier chunks' counts. `round`: this send's number (1-based).
// Returns false if the wait for the other routing blocks timed out (recorded).
__device__ bool dispatchRouting(const DispatchKernelArgs& a, uint32_t n, int32_t* smem, uint32_t chunk,
                                uint32_t round) {
  const Geometry& g = a.g;
  const uint32_t E = g.numExperts, L = g.numLocalExperts, K = g.topK, W = g.worldSize, D = g.dpSize;
  const uint32_t R = g.routeBlocks;
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t lo = min(n, chunk * g.routeChunk), hi = min(n, lo + g.routeChunk);
  const uint32_t warps = blockWarps(g);                // the scan tables' rows, as sharedBytes(g) sized them
  uint32_t* bits = reinterpret_cast<uint32_t*>(smem);  // [warps][E]: lanes of the warp's 32 tokens per expert
  int32_t* base = smem + warps * E;                    // [warps][E]: tokens before this warp's 32
  int32_t* running = smem + 2 * warps * E;             // [E]
  // The token count first: the receivers' row tables need it with the counts.
  if (chunk == 0 && threadIdx.x < W && liveRank(g, threadIdx.x)) {
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
    // form (docs/nvlink.md).
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
          if (!liveRank(g, d)) continue;
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
    if (!liveRank(g, e / L)) return;
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
      if (chunk == R - 1) emitCount(e, before + running[e]);
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
    for (uint32_t jb = lo; jb < hi; jb += blockDim.x) pass(jb, phase == 1);
  }
  // One routing block: after its positions its running counts are this rank's totals per expert, the receivers'
  // counts (with several, the last one sent them after the counting phase).
  if (R == 1) {
    for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) emitCount(e, running[e]);
  }
  return true;
}

// Scale words c = lane and lane + 32 (those below scaleWords) of a token whose word c is at scaleSrc + c * scaleStride:
// the ones loaded with the payload (any further ones are copied after it).
__device__ __forceinline__ void loadFirstScales(const uint8_t* scaleSrc, int64_t scaleStride, uint32_t lane,
                                                uint32_t scaleWords, uint32_t (&sc)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t c = lane + 32 * i;
    if (c < scaleWords) sc[i] = *reinterpret_cast<const uint32_t*>(scaleSrc + static_cast<int64_t>(c) * scaleStride);
  }
}

// Config::dispatchCast in the dispatch (core/fp8_cast.hpp): lane's 16-byte fp8 vectors u = u0 + 32 i (i <
// kCastUnroll = unitVectorsOf<true>(g), u < units) of a work unit, cast from the token's bf16 row `src` (32 bytes per
// vector) into v[i], and into scale[i] the scale of vector u's 128-element block. A block's 8 vectors lie in 8
// consecutive lanes (u0 is the lane plus a multiple of 32, units a multiple of 8), so its amax is their max over three
// xor shuffles, which every lane runs. All loads are issued before the first conversion, like the copy's (2 x 4 x 16 B
// per lane: the registers the copy's 8 vectors take). The conversion is the hardware's (round to nearest even;
// saturating, which changes nothing here: |x * inv| rounds to at most 448 for finite x).
__device__ __forceinline__ void castUnit(const uint8_t* src, uint32_t u0, uint32_t units, bool pow2, int4 (&v)[kUnroll],
                                         float (&scale)[kCastUnroll]) {
  int4 raw[2 * kCastUnroll];
#pragma unroll
  for (int i = 0; i < kCastUnroll; ++i) {
    const uint32_t u = u0 + i * 32;
    raw[2 * i] = raw[2 * i + 1] = make_int4(0, 0, 0, 0);
    if (u < units) {
      raw[2 * i] = ldGlobalNc16(src + static_cast<uint64_t>(u) * 32);
      raw[2 * i + 1] = ldGlobalNc16(src + static_cast<uint64_t>(u) * 32 + 16);
    }
  }
  auto lo = [](int w) { return __uint_as_float(static_cast<uint32_t>(w) << 16); };
  auto hi = [](int w) { return __uint_as_float(static_cast<uint32_t>(w) & 0xFFFF0000u); };
#pragma unroll
  for (int i = 0; i < kCastUnroll; ++i) {
    {
      const int w[8] = {raw[2 * i].x,     raw[2 * i].y,     raw[2 * i].z,     raw[2 * i].w,
                        raw[2 * i + 1].x, raw[2 * i + 1].y, raw[2 * i + 1].z, raw[2 * i + 1].w};
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fmaxf(fabsf(lo(w[j])), fabsf(hi(w[j]))));
#pragma unroll
      for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      const Fp8BlockScale s = fp8BlockScale(amax, pow2);
      scale[i] = s.scale;
      uint32_t q[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        // Elements 4j .. 4j + 3: the low half of each bf16 pair first, so byte k of the vector is element k.
        const uint32_t a = __nv_cvt_float2_to_fp8x2(
            make_float2(__fmul_rn(lo(w[2 * j]), s.inv), __fmul_rn(hi(w[2 * j]), s.inv)), __NV_SATFINITE, __NV_E4M3);
        const uint32_t b = __nv_cvt_float2_to_fp8x2(
            make_float2(__fmul_rn(lo(w[2 * j + 1]), s.inv), __fmul_rn(hi(w[2 * j + 1]), s.inv)), __NV_SATFINITE,
            __NV_E4M3);
        q[j] = a | b << 16;
      }
      v[i] = make_int4(static_cast<int>(q[0]), static_cast<int>(q[1]), static_cast<int>(q[2]), static_cast<int>(q[3]));
    }
  }
}

// The scales castUnit computed, one store per block by the block's first lane: word u / 8 at base + (u / 8) * stride.
__device__ __forceinline__ void storeCastScales(uint8_t* base, int64_t stride, uint32_t u0, uint32_t units,
                                                const float (&scale)[kCastUnroll]) {
  if ((threadIdx.x & 7) != 0) return;
#pragma unroll
  for (int i = 0; i < kCastUnroll; ++i) {
    const uint32_t u = u0 + i * 32;
    if (u < units) *reinterpret_cast<float*>(base + static_cast<int64_t>(u / 8) * stride) = scale[i];
  }
}

// Send half, payload. Work unit = (token, piece of 32 * unitVectors(g) vectors), so a decode-sized batch spreads over
// many warps; each unit issues all its loads (expert indices, payload vectors, scales) before the first store, so a
// unit costs one memory latency, then its stores go out once per destination *rank*. `destMask`: the ranks this call
// may store into (the fused kernel leaves its own rank out). `kFilter`: which slots (SlotFilter; the fused kernel
// splits pull mode's pushed and staged slots between two groups of blocks). A template argument, so push mode's loop
// is the plain one.
// kCast (Config::dispatchCast, the kernels that cast): the unit casts x's bf16 row as it goes (castUnit) and stores
// its blocks' scales.
template <int kFilter, bool kCast = false>
__device__ void dispatchPayload(const DispatchKernelArgs& a, uint32_t n, uint32_t warpId, uint32_t numWarps,
                                uint32_t destMask) {
  const Geometry& g = a.g;
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t K = g.topK, L = g.numLocalExperts, D = g.dpSize;
  const uint32_t units = g.hiddenBytes / 16, scaleWords = g.scaleBytes / 4;
  const uint32_t pieces = tokenPiecesOf<kCast>(g);
  for (uint32_t wu = warpId; wu < filteredSlots(g, n, kFilter) * pieces; wu += numWarps) {
    const uint32_t j = filteredSlot(g, wu / pieces, kFilter), piece = wu % pieces;
    const uint32_t t = j * D + g.rank % D;
    const uint8_t* src = a.x + static_cast<int64_t>(t) * a.xRowStrideBytes;
    int64_t e0 = -1;
    if (lane < K) e0 = loadIndex(a.indices, a.indexKind, a.indexStrides, t, lane);
    int4 v[kUnroll];
    float castScale[kCastUnroll];
    const uint32_t vpl = unitVectorsOf<kCast>(g), u0 = piece * 32 * vpl + lane;
    if constexpr (kCast) {
      castUnit(src, u0, units, a.cast == static_cast<uint32_t>(DispatchCast::kFp8BlocksPow2), v, castScale);
    } else {
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        const uint32_t u = u0 + i * 32;
        if (i < vpl && u < units) v[i] = ldGlobalNc16(src + static_cast<uint64_t>(u) * 16);
      }
    }
    // The last piece also carries the scales (its payload share is the smallest); the first 64 words are loaded
    // with the payload, any further ones after it. A cast computes each piece's scales with it instead.
    const bool scales = !kCast && piece == pieces - 1;
    uint32_t sc[2] = {0, 0};
    if (scales) {
      loadFirstScales(a.xScale + static_cast<int64_t>(t) * a.xScaleStrideBytes[0], a.xScaleStrideBytes[1], lane,
                      scaleWords, sc);
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
      if constexpr (kCast) storeCastScales(dst + g.hiddenBytes, 4, u0, units, castScale);
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

}  // namespace
}  // namespace nvlink
}  // namespace epcomm
