// Dispatch and combine kernels of the nvlink backend. See docs/nvlink.md for the protocol and the measurements
// behind the choices; nvlink_layout.hpp for the buffer layout.
//
// Ordering argument used throughout: a block's threads store into a peer's region (weak stores), then
// __syncthreads(), then thread 0 issues fence.acq_rel.sys and a red.release.sys add on the peer's flag. The receiver
// polls the flag with ld.acquire.sys, then __syncthreads(), and its threads read the data with ordinary loads:
// barrier + fence cumulativity make every store of the sending block visible before the flag increment.
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
using device::ldAcquireSys;
using device::ldGlobalNc16;
using device::redAddReleaseSys;
using device::st16;

// 16-byte vectors per lane held in registers by one copy step (8 x 16 B x 32 lanes = 4 KiB in flight per warp).
constexpr int kUnroll = 8;
// Vectors per lane per combine work unit (see combineSendBody).
constexpr int kChunkU = 4;

__device__ __forceinline__ uint64_t* flagPtr(char* base, const Geometry& g, int which, uint32_t sender) {
  return reinterpret_cast<uint64_t*>(base + g.offFlags) + which * g.worldSize + sender;
}

__device__ __forceinline__ bool aborted(const DeviceState& st) {
  return *reinterpret_cast<volatile int32_t*>(st.claimed) != 0;
}

// The first error wins; later ones are dropped (the host reports one and the object refuses further use).
__device__ void recordError(const DeviceState& st, int32_t phase, int32_t rank, int32_t peer, int64_t a, int64_t b) {
  if (atomicCAS(st.claimed, 0, 1) != 0) return;
  volatile ErrorRecord* r = st.hostError;
  r->rank = rank;
  r->peer = peer;
  r->block = static_cast<int32_t>(blockIdx.x);
  r->a = a;
  r->b = b;
  __threadfence_system();
  r->code = phase;
  __threadfence_system();
}

// Spins until *flag >= expected; on timeout records (phase, peer) and returns false. Never traps.
__device__ bool waitFlag(const uint64_t* flag, uint64_t expected, const DeviceState& st, int32_t phase, int32_t rank,
                         int32_t peer) {
  if (ldAcquireSys(flag) >= expected) return true;
  const uint64_t start = globalTimerNs();
  for (uint32_t i = 1;; ++i) {
    uint64_t v = ldAcquireSys(flag);
    if (v >= expected) return true;
    if ((i & 255) == 0) {
      if (aborted(st)) return false;
      if (globalTimerNs() - start > st.timeoutNs) {
        recordError(st, phase, rank, peer, static_cast<int64_t>(v), static_cast<int64_t>(expected));
        return false;
      }
    }
  }
}

// Block-wide: waits until flag `which` from every rank reached `expected`. Returns false (in every thread) if any
// wait failed.
__device__ bool waitAllRanks(char* local, const Geometry& g, int which, uint64_t expected, const DeviceState& st,
                             int32_t phase) {
  bool ok = true;
  if (threadIdx.x < g.worldSize) {
    ok = waitFlag(flagPtr(local, g, which, threadIdx.x), expected, st, phase, static_cast<int32_t>(g.rank),
                  static_cast<int32_t>(threadIdx.x));
  }
  return __syncthreads_and(ok ? 1 : 0) != 0;
}

// Thread 0 of a block: after the block's stores, signals flag `which` of every rank (one increment per block).
__device__ void signalAllRanks(char* const* peers, const Geometry& g, int which) {
  __syncthreads();
  if (threadIdx.x == 0) {
    fenceAcqRelSys();
    for (uint32_t d = 0; d < g.worldSize; ++d) redAddReleaseSys(flagPtr(peers[d], g, which, g.rank), 1);
  }
}

__device__ __forceinline__ int64_t loadIndex(const void* base, int kind, const int64_t* strides, uint32_t t,
                                             uint32_t k) {
  return decodeIndex(base, kind, static_cast<int64_t>(t) * strides[0] + static_cast<int64_t>(k) * strides[1]);
}

__device__ __forceinline__ uint32_t effectiveBound(const int32_t* boundM, uint32_t m) {
  if (boundM == nullptr) return m;
  int32_t b = *boundM;
  if (b < 0) return 0;
  return static_cast<uint32_t>(b) < m ? static_cast<uint32_t>(b) : m;
}

// Per receiver: for each local expert, the first row of each sender's tokens (senderBase[s][le]) and the expert's
// first row (rowBase[le]: 0 in the batched layout, where the expert stride does the work; the padded prefix sum in
// the packed layout). Deterministic: rows ordered by (sender, token).
struct RowTables {
  int32_t* senderBase;  // [W][L]
  int32_t* total;       // [L]
  int32_t* rowBase;     // [L]
};

__device__ RowTables computeRows(char* local, const Geometry& g, int32_t* smem, bool packed, uint32_t padding) {
  const uint32_t W = g.worldSize, L = g.numLocalExperts;
  RowTables rt{smem, smem + W * L, smem + (W + 1) * L};
  const int32_t* counts = reinterpret_cast<const int32_t*>(local + g.offCounts);
  for (uint32_t le = threadIdx.x; le < L; le += blockDim.x) {
    int32_t acc = 0;
    for (uint32_t s = 0; s < W; ++s) {
      rt.senderBase[s * L + le] = acc;
      acc += counts[s * L + le];
    }
    rt.total[le] = acc;
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const uint32_t lane = threadIdx.x;
    int32_t carry = 0;
    for (uint32_t c = 0; c < L; c += 32) {
      const uint32_t le = c + lane;
      int32_t v = 0;
      if (packed && le < L) v = static_cast<int32_t>(roundUpPow2(static_cast<uint64_t>(rt.total[le]), padding));
      int32_t inc = v;
      for (int o = 1; o < 32; o <<= 1) {
        int32_t n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= static_cast<uint32_t>(o)) inc += n;
      }
      if (le < L) rt.rowBase[le] = carry + inc - v;
      carry += __shfl_sync(0xffffffffu, inc, 31);
    }
  }
  __syncthreads();
  return rt;
}

// ---------------------------------------------------------------------------------------------------------------
// Dispatch

// Block 0 of the send half: per-expert positions of this rank's tokens (a stable counting sort by expert, in token
// order) and counts, written into every receiver with the token's K routing entries. Positions are computed here,
// by the one rank that knows its tokens, so the receiver needs only a W x L prefix sum.
__device__ void dispatchRouting(const DispatchKernelArgs& a, uint32_t n, int32_t* smem) {
  const Geometry& g = a.g;
  const uint32_t E = g.numExperts, L = g.numLocalExperts, K = g.topK, W = g.worldSize, D = g.dpSize;
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint32_t* bits = reinterpret_cast<uint32_t*>(smem);  // [kWarps][E]: lanes of the warp's 32 tokens per expert
  int32_t* base = smem + kWarps * E;                   // [kWarps][E]: tokens before this warp's 32
  int32_t* running = smem + 2 * kWarps * E;            // [E]
  for (uint32_t i = threadIdx.x; i < kWarps * E; i += blockDim.x) bits[i] = 0;
  for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) running[e] = 0;
  __syncthreads();
  for (uint32_t jb = 0; jb < n; jb += kThreads) {
    const uint32_t j = jb + threadIdx.x;
    const bool active = j < n;
    const uint32_t t = j * D + g.rank % D;
    // A repeated expert finds its own lane bit already set: atomicOr's old value marks it (dupMask, k < 64), so
    // no k^2 re-reading of the token's indices.
    uint64_t dupMask = 0;
    if (active) {
#pragma unroll 8
      for (uint32_t k = 0; k < K; ++k) {
        int64_t e = loadIndex(a.indices, a.indexKind, a.indexStrides, t, k);
        if (e < -1 || e >= static_cast<int64_t>(E)) {
          recordError(a.st, kPhaseBadIndex, static_cast<int32_t>(g.rank), -1, t,
                      (static_cast<int64_t>(k) << 32) | static_cast<uint32_t>(e));
          continue;
        }
        if (e < 0) continue;
        const uint32_t old = atomicOr(&bits[warp * E + static_cast<uint32_t>(e)], 1u << lane);
        if (old & (1u << lane)) dupMask |= 1ull << k;
      }
    }
    __syncthreads();
    for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) {
      int32_t r = running[e];
      for (uint32_t w = 0; w < kWarps; ++w) {
        base[w * E + e] = r;
        r += __popc(bits[w * E + e]);
      }
      running[e] = r;
    }
    __syncthreads();
    if (active) {
#pragma unroll 8
      for (uint32_t k = 0; k < K; ++k) {
        int64_t e = loadIndex(a.indices, a.indexKind, a.indexStrides, t, k);
        RouteEntry entry{-1, 0};
        uint32_t owner = W;
        if (e >= 0 && e < static_cast<int64_t>(E)) {
          const uint32_t ue = static_cast<uint32_t>(e);
          entry.le = static_cast<int32_t>(ue % L) | ((dupMask >> k) & 1 ? kDupBit : 0);
          entry.pos = base[warp * E + ue] + __popc(bits[warp * E + ue] & laneMaskLt());
          owner = ue / L;
        }
        const RouteEntry none{-1, 0};
        const uint64_t off =
            g.offRoute + ((static_cast<uint64_t>(g.rank) * g.slotsPerSender + j) * K + k) * sizeof(RouteEntry);
        for (uint32_t d = 0; d < W; ++d) {
          *reinterpret_cast<RouteEntry*>(a.peers[d] + off) = d == owner ? entry : none;
        }
      }
    }
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < kWarps * E; i += blockDim.x) bits[i] = 0;
    __syncthreads();
  }
  for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) {
    const uint32_t d = e / L;
    reinterpret_cast<int32_t*>(a.peers[d] + g.offCounts)[g.rank * L + e % L] = running[e];
  }
  if (threadIdx.x < W) {
    reinterpret_cast<int32_t*>(a.peers[threadIdx.x] + g.offNumTokens)[g.rank] = static_cast<int32_t>(n);
  }
}

// Copies `units` 16-byte vectors from src to every destination in `dsts` (per-lane offsets held by lanes of
// `dstMask`), kUnroll vectors per lane in flight.
__device__ __forceinline__ void copyToMany(const uint8_t* src, uint32_t units, uint32_t dstMask, uint8_t* dstLane,
                                           bool srcReadOnly) {
  const uint32_t lane = threadIdx.x % 32;
  for (uint32_t u0 = 0; u0 < units; u0 += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const uint32_t u = u0 + i * 32 + lane;
      if (u < units) {
        v[i] = srcReadOnly ? ldGlobalNc16(src + static_cast<uint64_t>(u) * 16)
                           : *reinterpret_cast<const int4*>(src + static_cast<uint64_t>(u) * 16);
      }
    }
    for (uint32_t m = dstMask; m != 0; m &= m - 1) {
      const int b = __ffs(m) - 1;
      uint8_t* dst = reinterpret_cast<uint8_t*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(dstLane), b));
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        const uint32_t u = u0 + i * 32 + lane;
        if (u < units) st16(dst + static_cast<uint64_t>(u) * 16, v[i]);
      }
    }
  }
}

// Send half, payload: one warp per token, the token's bytes and scales cross NVLink once per destination rank.
__device__ void dispatchPayload(const DispatchKernelArgs& a, uint32_t n, uint32_t warpId, uint32_t numWarps) {
  const Geometry& g = a.g;
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t K = g.topK, L = g.numLocalExperts, D = g.dpSize;
  for (uint32_t j = warpId; j < n; j += numWarps) {
    const uint32_t t = j * D + g.rank % D;
    uint32_t ranks = 0;
    for (uint32_t k = lane; k < K; k += 32) {
      int64_t e = loadIndex(a.indices, a.indexKind, a.indexStrides, t, k);
      if (e >= 0 && e < static_cast<int64_t>(g.numExperts)) ranks |= 1u << (static_cast<uint32_t>(e) / L);
    }
    ranks = __reduce_or_sync(0xffffffffu, ranks);
    if (ranks == 0) continue;
    const uint64_t slotOff = g.offPayload + (static_cast<uint64_t>(g.rank) * g.slotsPerSender + j) * g.slotBytes;
    uint8_t* dstLane = lane < g.worldSize ? reinterpret_cast<uint8_t*>(a.peers[lane]) + slotOff : nullptr;
    copyToMany(a.x + static_cast<int64_t>(t) * a.xRowStrideBytes, g.hiddenBytes / 16, ranks, dstLane, true);
    for (uint32_t c = lane; c < g.scaleBytes / 4; c += 32) {
      const uint32_t v =
          *reinterpret_cast<const uint32_t*>(a.xScale + static_cast<int64_t>(t) * a.xScaleStrideBytes[0] +
                                             static_cast<int64_t>(c) * a.xScaleStrideBytes[1]);
      for (uint32_t m = ranks; m != 0; m &= m - 1) {
        const int d = __ffs(m) - 1;
        *reinterpret_cast<uint32_t*>(a.peers[d] + slotOff + g.hiddenBytes + c * 4) = v;
      }
    }
  }
}

// Recv half: expands every received token into its expert rows (HBM to HBM, local).
__device__ void dispatchExpand(const DispatchKernelArgs& a, int32_t* smem) {
  const Geometry& g = a.g;
  char* local = a.peers[g.rank];
  const RowTables rt = computeRows(local, g, smem, a.packed != 0, a.padding);
  const uint32_t L = g.numLocalExperts, K = g.topK, W = g.worldSize, Ts = g.slotsPerSender;
  if (blockIdx.x == 0) {
    for (uint32_t le = threadIdx.x; le < L; le += blockDim.x) a.outNumTokens[le] = rt.total[le];
  }
  const int32_t* numTokens = reinterpret_cast<const int32_t*>(local + g.offNumTokens);
  const RouteEntry* route = reinterpret_cast<const RouteEntry*>(local + g.offRoute);
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t warpId = blockIdx.x * kWarps + threadIdx.x / 32, numWarps = gridDim.x * kWarps;
  for (uint32_t item = warpId; item < W * Ts; item += numWarps) {
    const uint32_t s = item / Ts, j = item % Ts;
    if (j >= static_cast<uint32_t>(numTokens[s])) continue;
    const uint8_t* slot =
        reinterpret_cast<const uint8_t*>(local + g.offPayload) + (static_cast<uint64_t>(s) * Ts + j) * g.slotBytes;
    for (uint32_t k0 = 0; k0 < K; k0 += 32) {
      const uint32_t k = k0 + lane;
      int64_t rowOff = -1, scaleOff = 0;
      if (k < K) {
        const RouteEntry e = route[(static_cast<uint64_t>(s) * Ts + j) * K + k];
        if (e.le >= 0 && (e.le & kDupBit) == 0) {
          const int64_t idx = rt.rowBase[e.le] + rt.senderBase[s * L + e.le] + e.pos;
          rowOff = e.le * a.outExpertStrideBytes + idx * a.outRowStrideBytes;
          scaleOff = e.le * a.outScaleStrideBytes[0] + idx * a.outScaleStrideBytes[1];
        }
      }
      const uint32_t rows = __ballot_sync(0xffffffffu, rowOff >= 0);
      if (rows == 0) continue;
      copyToMany(slot, g.hiddenBytes / 16, rows, rowOff >= 0 ? a.outX + rowOff : nullptr, false);
      for (uint32_t m = rows; m != 0; m &= m - 1) {
        const int b = __ffs(m) - 1;
        const int64_t so = __shfl_sync(0xffffffffu, scaleOff, b);
        for (uint32_t c = lane; c < g.scaleBytes / 4; c += 32) {
          *reinterpret_cast<uint32_t*>(a.outScale + so + c * a.outScaleStrideBytes[2]) =
              *reinterpret_cast<const uint32_t*>(slot + g.hiddenBytes + c * 4);
        }
      }
    }
  }
}

template <bool kSend, bool kRecv>
__global__ void __launch_bounds__(kThreads, 1) dispatchKernel(const DispatchKernelArgs a) {
  extern __shared__ int32_t smem[];
  if (aborted(a.st)) return;
  const Geometry& g = a.g;
  const uint32_t B = gridDim.x;
  if constexpr (kSend) {
    const uint32_t seq = a.st.seq[kSeqDispatchSend * B + blockIdx.x];
    const uint32_t n = numTokensSentBy(g.rank, effectiveBound(a.boundM, a.m), g.dpSize);
    if (blockIdx.x == 0) dispatchRouting(a, n, smem);
    if (blockIdx.x != 0 || B == 1) {
      const uint32_t payloadBlocks = B == 1 ? 1 : B - 1;
      const uint32_t blk = B == 1 ? 0 : blockIdx.x - 1;
      dispatchPayload(a, n, blk * kWarps + threadIdx.x / 32, payloadBlocks * kWarps);
    }
    signalAllRanks(a.peers, g, 0);
    if (threadIdx.x == 0) a.st.seq[kSeqDispatchSend * B + blockIdx.x] = seq + 1;
  }
  if constexpr (kRecv) {
    const uint32_t seq = a.st.seq[kSeqDispatchRecv * B + blockIdx.x] + 1;
    if (!waitAllRanks(a.peers[g.rank], g, 0, static_cast<uint64_t>(seq) * g.blocks, a.st, kPhaseDispatchRecv)) {
      return;
    }
    dispatchExpand(a, smem);
    __syncthreads();
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

template <typename T, int N>
__device__ __forceinline__ void loadF(const T* p, float* out) {
  Vec<T, N> x = *reinterpret_cast<const Vec<T, N>*>(p);
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

// Send half of combine. Block 0 first pushes this rank's router weights to every rank and signals "entered combine";
// every block then waits for all ranks to have entered (their weights are here and they finished reading the
// partials of the previous round), sums its experts' weighted outputs per token in fp32 and sends one partial per
// (token, DP-group rank).
template <typename PT, int N>
__device__ void combineSendBody(const CombineKernelArgs& a, int32_t* smem) {
  const Geometry& g = a.g;
  char* local = a.peers[g.rank];
  const RowTables rt = computeRows(local, g, smem, a.packed != 0, a.padding);
  const uint32_t L = g.numLocalExperts, K = g.topK, W = g.worldSize, Ts = g.slotsPerSender, D = g.dpSize;
  const int32_t* numTokens = reinterpret_cast<const int32_t*>(local + g.offNumTokens);
  const RouteEntry* route = reinterpret_cast<const RouteEntry*>(local + g.offRoute);
  const float* weights = reinterpret_cast<const float*>(local + g.offWeights);
  const PT* y = reinterpret_cast<const PT*>(a.y);
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t warpId = blockIdx.x * kWarps + threadIdx.x / 32, numWarps = gridDim.x * kWarps;
  const uint32_t units = g.hiddenDim / N;
  // NOTE: one work unit = one token and one chunk of kChunkU units per lane, so a warp keeps kChunkU independent
  // loads in flight per expert row and the rows of one token spread over several warps (a warp walking a whole
  // 7168-element row with one load in flight measured ~100 us for decode).
  const uint32_t chunks = static_cast<uint32_t>(ceilDiv(units, 32 * kChunkU));
  for (uint32_t wu = warpId; wu < W * Ts * chunks; wu += numWarps) {
    const uint32_t item = wu / chunks, chunk = wu % chunks;
    const uint32_t s = item / Ts, j = item % Ts;
    if (j >= static_cast<uint32_t>(numTokens[s])) continue;
    const uint32_t t = j * D + s % D;
    const uint32_t group0 = (s / D) * D;
    // Per-lane destination: partial slot of (this expert rank, token t) on rank group0 + lane.
    uint8_t* dstLane = lane < D ? reinterpret_cast<uint8_t*>(a.peers[group0 + lane]) + g.offPartials +
                                      (static_cast<uint64_t>(g.rank) * g.maxTokens + t) * g.partialBytes
                                : nullptr;
    const uint32_t dstMask = D >= 32 ? 0xffffffffu : ((1u << D) - 1);
    // K <= 64: at most two lane groups of routing entries; the sum runs k ascending.
    int64_t yOff[2] = {-1, -1};
    float w[2] = {0.f, 0.f};
    uint32_t valid[2] = {0, 0};
    for (uint32_t h = 0; h < 2; ++h) {
      const uint32_t k = h * 32 + lane;
      if (k < K) {
        const RouteEntry e = route[(static_cast<uint64_t>(s) * Ts + j) * K + k];
        if (e.le >= 0) {
          const int32_t le = e.le & ~kDupBit;
          const int64_t idx = rt.rowBase[le] + rt.senderBase[s * L + le] + e.pos;
          yOff[h] = le * a.yExpertStride + idx * a.yRowStride;
          w[h] = weights[(static_cast<uint64_t>(s) * Ts + j) * K + k];
        }
      }
      valid[h] = __ballot_sync(0xffffffffu, yOff[h] >= 0);
    }
    if ((valid[0] | valid[1]) == 0) continue;
    // Shuffles are warp-uniform; lanes past the row end only skip memory accesses.
    float acc[kChunkU][N];
#pragma unroll
    for (int c = 0; c < kChunkU; ++c) {
#pragma unroll
      for (int i = 0; i < N; ++i) acc[c][i] = 0.f;
    }
    const uint32_t u0 = chunk * 32 * kChunkU + lane;
    for (uint32_t h = 0; h < 2; ++h) {
      for (uint32_t m = valid[h]; m != 0; m &= m - 1) {
        const int b = __ffs(m) - 1;
        const int64_t off = __shfl_sync(0xffffffffu, yOff[h], b);
        const float wk = __shfl_sync(0xffffffffu, w[h], b);
        float yv[kChunkU][N];
#pragma unroll
        for (int c = 0; c < kChunkU; ++c) {
          const uint32_t u = u0 + c * 32;
          if (u < units) loadF<PT, N>(y + off + static_cast<int64_t>(u) * N, yv[c]);
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
}

template <typename PT, typename OT, int N>
__device__ void combineRecvBody(const CombineKernelArgs& a) {
  const Geometry& g = a.g;
  const char* local = a.peers[g.rank];
  const uint32_t bound = effectiveBound(a.boundM, a.m);
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t warpId = blockIdx.x * kWarps + threadIdx.x / 32, numWarps = gridDim.x * kWarps;
  const uint32_t units = g.hiddenDim / N;
  OT* out = reinterpret_cast<OT*>(a.out);
  const uint32_t chunks = static_cast<uint32_t>(ceilDiv(units, 32 * kChunkU));
  for (uint32_t wu = warpId; wu < bound * chunks; wu += numWarps) {
    const uint32_t t = wu / chunks, chunk = wu % chunks;
    uint32_t ranks = 0;
    for (uint32_t k = lane; k < g.topK; k += 32) {
      int64_t e = loadIndex(a.indices, a.indexKind, a.indexStrides, t, k);
      if (e >= 0 && e < static_cast<int64_t>(g.numExperts))
        ranks |= 1u << (static_cast<uint32_t>(e) / g.numLocalExperts);
    }
    ranks = __reduce_or_sync(0xffffffffu, ranks);
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
    // Expert ranks in ascending order: a fixed summation order, so results are bitwise reproducible.
    for (uint32_t m = ranks; m != 0; m &= m - 1) {
      const int e = __ffs(m) - 1;
      const PT* p = reinterpret_cast<const PT*>(local + g.offPartials +
                                                (static_cast<uint64_t>(e) * g.maxTokens + t) * g.partialBytes);
      float pv[kChunkU][N];
#pragma unroll
      for (int c = 0; c < kChunkU; ++c) {
        const uint32_t u = u0 + c * 32;
        if (u < units) loadF<PT, N>(p + static_cast<uint64_t>(u) * N, pv[c]);
      }
#pragma unroll
      for (int c = 0; c < kChunkU; ++c) {
#pragma unroll
        for (int i = 0; i < N; ++i) acc[c][i] += pv[c][i];
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
__global__ void __launch_bounds__(kThreads, 1) combineKernel(const CombineKernelArgs a) {
  extern __shared__ int32_t smem[];
  if (aborted(a.st)) return;
  const Geometry& g = a.g;
  const uint32_t B = gridDim.x;
  const bool wide = g.hiddenDim % 8 == 0;
  if constexpr (kSend) {
    const uint32_t seq = a.st.seq[kSeqCombineSend * B + blockIdx.x] + 1;
    if (blockIdx.x == 0) {
      const uint32_t n = numTokensSentBy(g.rank, effectiveBound(a.boundM, a.mSend), g.dpSize);
      const uint32_t K = g.topK;
      for (uint32_t i = threadIdx.x; i < n * K; i += blockDim.x) {
        const uint32_t j = i / K, k = i % K;
        const uint32_t t = j * g.dpSize + g.rank % g.dpSize;
        const float w =
            a.weights[static_cast<int64_t>(t) * a.weightStrides[0] + static_cast<int64_t>(k) * a.weightStrides[1]];
        const uint64_t off = g.offWeights + ((static_cast<uint64_t>(g.rank) * g.slotsPerSender + j) * K + k) * 4;
        for (uint32_t d = 0; d < g.worldSize; ++d) *reinterpret_cast<float*>(a.peers[d] + off) = w;
      }
      signalAllRanks(a.peers, g, 1);
    }
    if (!waitAllRanks(a.peers[g.rank], g, 1, seq, a.st, kPhaseCombineEnter)) return;
    if (wide) {
      combineSendBody<PT, 8>(a, smem);
    } else {
      combineSendBody<PT, 4>(a, smem);
    }
    signalAllRanks(a.peers, g, 2);
    if (threadIdx.x == 0) a.st.seq[kSeqCombineSend * B + blockIdx.x] = seq;
  }
  if constexpr (kRecv) {
    const uint32_t seq = a.st.seq[kSeqCombineRecv * B + blockIdx.x] + 1;
    if (!waitAllRanks(a.peers[g.rank], g, 2, static_cast<uint64_t>(seq) * g.blocks, a.st, kPhaseCombineRecv)) {
      return;
    }
    if (wide) {
      combineRecvBody<PT, OT, 8>(a);
    } else {
      combineRecvBody<PT, OT, 4>(a);
    }
    __syncthreads();
    if (threadIdx.x == 0) a.st.seq[kSeqCombineRecv * B + blockIdx.x] = seq;
  }
}

template <bool kSend, bool kRecv>
int launchDispatchT(const DispatchKernelArgs& args, void* stream) {
  dispatchKernel<kSend, kRecv>
      <<<args.g.blocks, kThreads, sharedBytes(args.g), static_cast<cudaStream_t>(stream)>>>(args);
  return static_cast<int>(cudaGetLastError());
}

template <bool kSend, bool kRecv, typename PT, typename OT>
int launchCombineT(const CombineKernelArgs& args, void* stream) {
  combineKernel<kSend, kRecv, PT, OT>
      <<<args.g.blocks, kThreads, sharedBytes(args.g), static_cast<cudaStream_t>(stream)>>>(args);
  return static_cast<int>(cudaGetLastError());
}

template <bool kSend, bool kRecv, typename PT>
int launchCombineOut(const CombineKernelArgs& args, int outType, void* stream) {
  switch (outType) {
    case kTypeBf16:
      return launchCombineT<kSend, kRecv, PT, __nv_bfloat16>(args, stream);
    case kTypeF16:
      return launchCombineT<kSend, kRecv, PT, __half>(args, stream);
    default:
      return launchCombineT<kSend, kRecv, PT, float>(args, stream);
  }
}

template <bool kSend, bool kRecv>
int launchCombineMode(const CombineKernelArgs& args, int partialType, int outType, void* stream) {
  if constexpr (kSend && !kRecv) {
    // The send half never touches outTokens: one instantiation per partial type.
    switch (partialType) {
      case kTypeBf16:
        return launchCombineT<true, false, __nv_bfloat16, __nv_bfloat16>(args, stream);
      case kTypeF16:
        return launchCombineT<true, false, __half, __half>(args, stream);
      default:
        return launchCombineT<true, false, float, float>(args, stream);
    }
  } else {
    switch (partialType) {
      case kTypeBf16:
        return launchCombineOut<kSend, kRecv, __nv_bfloat16>(args, outType, stream);
      case kTypeF16:
        return launchCombineOut<kSend, kRecv, __half>(args, outType, stream);
      default:
        return launchCombineOut<kSend, kRecv, float>(args, outType, stream);
    }
  }
}

template <typename Kernel>
cudaError_t raiseSmem(Kernel k, uint32_t bytes) {
  return cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

template <bool kSend, bool kRecv, typename PT>
cudaError_t raiseCombine(uint32_t bytes) {
  cudaError_t e = raiseSmem(combineKernel<kSend, kRecv, PT, __nv_bfloat16>, bytes);
  if (e == cudaSuccess) e = raiseSmem(combineKernel<kSend, kRecv, PT, __half>, bytes);
  if (e == cudaSuccess) e = raiseSmem(combineKernel<kSend, kRecv, PT, float>, bytes);
  return e;
}

}  // namespace

int launchDispatch(const DispatchKernelArgs& args, bool doSend, bool doRecv, void* stream) {
  if (doSend && doRecv) return launchDispatchT<true, true>(args, stream);
  if (doSend) return launchDispatchT<true, false>(args, stream);
  return launchDispatchT<false, true>(args, stream);
}

int launchCombine(const CombineKernelArgs& args, bool doSend, bool doRecv, int partialType, int outType, void* stream) {
  if (doSend && doRecv) return launchCombineMode<true, true>(args, partialType, outType, stream);
  if (doSend) return launchCombineMode<true, false>(args, partialType, outType, stream);
  return launchCombineMode<false, true>(args, partialType, outType, stream);
}

int configureKernels(uint32_t bytes) {
  if (bytes <= 48 * 1024) return 0;
  cudaError_t e = raiseSmem(dispatchKernel<true, true>, bytes);
  if (e == cudaSuccess) e = raiseSmem(dispatchKernel<true, false>, bytes);
  if (e == cudaSuccess) e = raiseSmem(dispatchKernel<false, true>, bytes);
  if (e == cudaSuccess) e = raiseSmem(combineKernel<true, false, __nv_bfloat16, __nv_bfloat16>, bytes);
  if (e == cudaSuccess) e = raiseSmem(combineKernel<true, false, __half, __half>, bytes);
  if (e == cudaSuccess) e = raiseSmem(combineKernel<true, false, float, float>, bytes);
  if (e == cudaSuccess) e = raiseCombine<true, true, __nv_bfloat16>(bytes);
  if (e == cudaSuccess) e = raiseCombine<true, true, __half>(bytes);
  if (e == cudaSuccess) e = raiseCombine<true, true, float>(bytes);
  if (e == cudaSuccess) e = raiseCombine<false, true, __nv_bfloat16>(bytes);
  if (e == cudaSuccess) e = raiseCombine<false, true, __half>(bytes);
  if (e == cudaSuccess) e = raiseCombine<false, true, float>(bytes);
  return static_cast<int>(e);
}

}  // namespace nvlink
}  // namespace epcomm
