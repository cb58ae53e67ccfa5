// The nvlink combine: the send half sums each token's weighted expert outputs and sends one fp32 partial per expert
// rank, the receive half adds the partials in a fixed order and rounds once. Part of nvlink_kernels.cu's translation
// unit: include it only there.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backends/nvlink/nvlink_rows.cuh"

namespace epcomm {
namespace nvlink {
namespace {

// Vectors per lane per combine work unit (see combineSendBody).
constexpr int kChunkU = 4;
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

// Which senders' tokens one call of combineSendBody handles.
enum CombineSenders : int {
  kAllSenders = 0,
  kOwnSender = 1,     // this rank's own tokens: its weights are in `a.weights`, its partial stays here (D == 1)
  kOtherSenders = 2,  // every other sender's tokens (their weights pushed by their senders, tagged)
};

// Send half of combine. The routing blocks first push this rank's router weights to every other rank (tagged with the
// round); every block then sums its experts' weighted outputs per token in fp32 (a peer's token once that peer's
// weights for it carry this round's tag) and sends one fp32 partial per (token, DP-group rank). YT: expertY's element
// type.
// NOTE: the partials are fp32 whatever expertY's type, so a token's output is one rounding of an fp32 sum of all its
// weighted expert outputs, as in pplx-kernels and DeepEP. Partials in a 16-bit expertY's type would halve their
// NVLink bytes but round each expert rank's sum once more: an fp16 output then differs from the peers' by an ulp at
// times.
// Returns false (in every lane) when a peer's weights never arrived (recorded); the caller then skips its signal.
template <typename YT, int N>
__device__ bool combineSendBody(const CombineKernelArgs& a, const RowTables& rt, int senders, uint32_t round,
                                uint32_t warpId, uint32_t numWarps) {
  const Geometry& g = a.g;
  char* local = a.peers[g.rank];
  const uint32_t K = g.topK, W = g.worldSize, Ts = g.slotsPerSender, D = g.dpSize;
  const uint64_t* weights = reinterpret_cast<const uint64_t*>(local + g.offWeights);
  const YT* y = reinterpret_cast<const YT*>(a.y);
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
    // Per-lane destination: fp32 partial slot of (this expert rank, token t) on rank group0 + lane.
    uint8_t* dstLane = lane < D ? reinterpret_cast<uint8_t*>(a.peers[group0 + lane]) + g.offPartials +
                                      (static_cast<uint64_t>(g.rank) * g.maxTokens + t) * g.partialBytes
                                : nullptr;
    const uint32_t dstMask = (D >= 32 ? 0xffffffffu : ((1u << D) - 1)) & (g.live >> group0);
    // This unit's vectors of a row: [v0, v0 + 32 * kChunkU), cut at the row's end.
    const uint32_t v0 = chunk * 32 * kChunkU;
    const uint32_t sliceBytes = min(32u * kChunkU, units - v0) * static_cast<uint32_t>(N * sizeof(YT));
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
          if (u < units) toF<YT, N>(loadOnce<YT, N>(y + off + static_cast<int64_t>(u) * N), yv[c]);
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
      float* dst = reinterpret_cast<float*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(dstLane), b));
#pragma unroll
      for (int c = 0; c < kChunkU; ++c) {
        const uint32_t u = u0 + c * 32;
        if (u < units) storeF<float, N>(dst + static_cast<uint64_t>(u) * N, acc[c]);
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

// Receive half of combine: outTokens (OT) = (accumulate ? outTokens : 0) + the fp32 partials, rounded once.
template <typename OT, int N>
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
      return reinterpret_cast<const float*>(local + g.offPartials +
                                            (static_cast<uint64_t>(e) * g.maxTokens + t) * g.partialBytes);
    };
    for (uint32_t m = ranks; m != 0;) {
      const int e1 = __ffs(m) - 1;
      m &= m - 1;
      const bool two = m != 0;
      const int e2 = two ? __ffs(m) - 1 : e1;
      if (two) m &= m - 1;
      const float* p1 = partialOf(e1);
      const float* p2 = partialOf(e2);
      Vec<float, N> r1[kChunkU], r2[kChunkU];
#pragma unroll
      for (int c = 0; c < kChunkU; ++c) {
        const uint32_t u = u0 + c * 32;
        if (u < units) r1[c] = loadOnce<float, N>(p1 + static_cast<uint64_t>(u) * N);
      }
      if (two) {
#pragma unroll
        for (int c = 0; c < kChunkU; ++c) {
          const uint32_t u = u0 + c * 32;
          if (u < units) r2[c] = loadOnce<float, N>(p2 + static_cast<uint64_t>(u) * N);
        }
      }
#pragma unroll
      for (int c = 0; c < kChunkU; ++c) {
        float pv[N];
        toF<float, N>(r1[c], pv);
#pragma unroll
        for (int i = 0; i < N; ++i) acc[c][i] += pv[i];
      }
      if (two) {
#pragma unroll
        for (int c = 0; c < kChunkU; ++c) {
          float pv[N];
          toF<float, N>(r2[c], pv);
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

// YT: expertY's element type (the send half's), OT: outTokens' (the receive half's); a kernel without a half takes
// float for that half's type.
template <bool kSend, bool kRecv, typename YT, typename OT>
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
          if (d != g.rank && liveRank(g, d)) stRelaxedSys(reinterpret_cast<uint64_t*>(a.peers[d] + off), word);
        }
      }
      tracePoint(a.st, kTrRouted);
    }
    // The senders' token counts of this combine's round (dispatch and combine alternate); the rows come from the
    // dispatch (rowSlots), so no row tables.
    RowTables rt = rowTablesAt(g, smem, true);
    rt.ok = __syncthreads_and(pollSenders(a.peers[g.rank], g, rt.tokens, seq, a.st, threadIdx.x) ? 1 : 0) != 0;
    if (!rt.ok) return;
    tracePoint(a.st, kTrRows);
    // With D == 1 this rank's own tokens have their partials here, on this rank, read only by its own combine-recv
    // (earlier on this stream), and their weights are the caller's. Two warp groups then run at once: warps
    // [0, ownWarps) sum the own tokens (local HBM only), the others the peers' tokens (their partials cross NVLink),
    // so the link is busy from the first peer weight on instead of after the own pass (which left it idle: decode
    // T = 128, own pass to 3.2-6.8 us, then the peers' partials stored by 7.6-12.1). Work splits by token count:
    // 1 / W of the warps for the own tokens. The R routing blocks, which pushed the weights, leave the own pass out
    // (with an equal share they finished it last, trace).
    auto body = [&](int senders, uint32_t warpId, uint32_t numWarps) {
      return wide ? combineSendBody<YT, 8>(a, rt, senders, seq, warpId, numWarps)
                  : combineSendBody<YT, 4>(a, rt, senders, seq, warpId, numWarps);
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
      combineRecvBody<OT, 8>(a, firstRanks, bound);
    } else {
      combineRecvBody<OT, 4>(a, firstRanks, bound);
    }
    __syncthreads();
    tracePoint(a.st, kTrExit);
    if (threadIdx.x == 0) a.st.seq[kSeqCombineRecv * B + blockIdx.x] = seq;
  }
}

}  // namespace
}  // namespace nvlink
}  // namespace epcomm
