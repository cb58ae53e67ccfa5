// Dispatch and combine kernels of the nvshmem backend: NVSHMEM put-with-signal and signal operations only, and bounded
// polling of local signal words. See docs/nvshmem.md for the protocol, nvshmem_layout.hpp for the buffers.
//
// Ordering: NVSHMEM's put-with-signal updates the remote signal only once the data has landed. A receiver polls the
// signal word in its own memory with ld.acquire.sys; after a block (or warp) barrier every thread of the block reads
// the data with ordinary loads (acquire + barrier cumulativity). Signals are SET to the round, a per-block counter kept
// in device memory, so every round has fresh values, nothing is ever reset, and CUDA-graph replays stay correct.
//
// Who may write what, when (the combine is the barrier of the round):
//   - a sender overwrites a receiver's dispatch region only in its next dispatch, which follows its combine-recv,
//     which waited for every rank's doneSig: that rank's combine-send finished reading this round's records and
//     weights;
//   - an expert rank overwrites a token rank's partials only in its next combine-send, which waits for every rank's
//     next weights, put by each rank's next combine-send, which follows that rank's combine-recv of this round;
//   - a rank reuses its own staging for the next round only after the same two waits, which imply that the puts out
//     of it have landed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "backends/nvshmem/nvshmem_kernels.hpp"
#include "core/layout.hpp"
#include "epcomm/device/ptx.cuh"

namespace epcomm {
namespace nvshmem {

namespace {

using device::globalTimerNs;
using device::laneMaskLt;
using device::ldAcquireSys;

// Per-block round counters of `kernel`: a block reads its own at entry and stores the new round at exit, so every
// block of a launch agrees on the round without any block racing another on one word.
__device__ __forceinline__ uint64_t* seqOf(const DeviceState& st, const Geometry& g, int kernel) {
  return reinterpret_cast<uint64_t*>(st.scratch + g.offSeq) + kernel * kSeqStride;
}
__device__ __forceinline__ uint64_t* wordsOf(const DeviceState& st, const Geometry& g) {
  return reinterpret_cast<uint64_t*>(st.scratch + g.offWords);
}
__device__ __forceinline__ uint32_t* headerOf(char* regions, const Geometry& g, uint32_t who) {
  return reinterpret_cast<uint32_t*>(regions + static_cast<uint64_t>(who) * g.regionBytes);
}
__device__ __forceinline__ const uint32_t* headerOf(const char* regions, const Geometry& g, uint32_t who) {
  return reinterpret_cast<const uint32_t*>(regions + static_cast<uint64_t>(who) * g.regionBytes);
}

// The first error wins; later ones are dropped (the host reports one and the object refuses further use).
__device__ void recordErrorAt(int32_t* claimed, ErrorRecord* hostError, int32_t phase, int32_t rank, int32_t peer,
                              int64_t seen, int64_t wanted, int64_t detail) {
  if (atomicCAS(claimed, 0, 1) != 0) return;
  volatile ErrorRecord* r = hostError;
  r->rank = rank;
  r->peer = peer;
  r->block = static_cast<int32_t>(blockIdx.x);
  r->seen = seen;
  r->wanted = wanted;
  r->detail = detail;
  __threadfence_system();
  r->code = phase;
  __threadfence_system();
}

__device__ __forceinline__ int32_t* claimedOf(const DeviceState& st, const Geometry& g) {
  return reinterpret_cast<int32_t*>(wordsOf(st, g) + kWordClaimed);
}

// The spin of waitFor once the word was not ready at the first look: out of line, so every wait inlines one load and
// a compare. Every 256 polls it checks whether another wait of this object failed (then it stops) and whether
// EPCOMM_TIMEOUT_MS passed: then it records (phase, peer, value seen, round wanted, detail) and stops. Never traps.
__device__ __noinline__ bool waitSlow(const uint64_t* word, uint64_t want, int32_t* claimed, ErrorRecord* hostError,
                                      uint64_t timeoutNs, int32_t phase, int32_t rank, int32_t peer, int64_t detail) {
  const uint64_t start = globalTimerNs();
  for (uint32_t i = 1;; ++i) {
    const uint64_t v = ldAcquireSys(word);
    if (v >= want) return true;
    if ((i & 255) == 0) {
      if (*reinterpret_cast<volatile int32_t*>(claimed) != 0) return false;
      if (globalTimerNs() - start > timeoutNs) {
        recordErrorAt(claimed, hostError, phase, rank, peer, static_cast<int64_t>(v), static_cast<int64_t>(want),
                      detail);
        return false;
      }
    }
  }
}

// Waits until the signal word reached `want` (acquire: what the put-with-signal carried is visible afterwards). False
// when the wait timed out (recorded) or another wait of the object failed.
__device__ __forceinline__ bool waitFor(const uint64_t* word, uint64_t want, const DeviceState& st, const Geometry& g,
                                        int32_t phase, uint32_t peer, int64_t detail) {
  if (ldAcquireSys(word) >= want) return true;
  return waitSlow(word, want, claimedOf(st, g), st.hostError, st.timeoutNs, phase, static_cast<int32_t>(g.rank),
                  static_cast<int32_t>(peer), detail);
}

// Tokens to consider: m, or the device bound when given (clamped to [0, m]).
__device__ __forceinline__ uint32_t boundedM(uint32_t m, const int32_t* boundM) {
  if (boundM == nullptr) return m;
  const int32_t b = *boundM;
  return b <= 0 ? 0u : (static_cast<uint32_t>(b) < m ? static_cast<uint32_t>(b) : m);
}

__device__ __forceinline__ int4 ld16(const void* p) { return *reinterpret_cast<const int4*>(p); }
__device__ __forceinline__ void st16(void* p, int4 v) { *reinterpret_cast<int4*>(p) = v; }

// Four consecutive elements of a combine tensor as fp32 (8- or 16-byte aligned: H % 4 == 0, rows 16-byte aligned).
template <int kType>
__device__ __forceinline__ float4 load4(const uint8_t* base, int64_t elem) {
  if constexpr (kType == kTypeF32) {
    return *reinterpret_cast<const float4*>(base + elem * 4);
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(base + elem * 2);
    float2 lo, hi;
    if constexpr (kType == kTypeBf16) {
      lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
      hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    } else {
      lo = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
      hi = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
    }
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  }
}

// Stores four fp32 values into a combine tensor, rounded to nearest even.
template <int kType>
__device__ __forceinline__ void store4(uint8_t* base, int64_t elem, float4 v) {
  if constexpr (kType == kTypeF32) {
    *reinterpret_cast<float4*>(base + elem * 4) = v;
  } else {
    uint2 raw;
    if constexpr (kType == kTypeBf16) {
      const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
      raw.x = *reinterpret_cast<const uint32_t*>(&lo);
      raw.y = *reinterpret_cast<const uint32_t*>(&hi);
    } else {
      const __half2 lo = __floats2half2_rn(v.x, v.y), hi = __floats2half2_rn(v.z, v.w);
      raw.x = *reinterpret_cast<const uint32_t*>(&lo);
      raw.y = *reinterpret_cast<const uint32_t*>(&hi);
    }
    *reinterpret_cast<uint2*>(base + elem * 2) = raw;
  }
}

// ----------------------------------------------------------------------------------------------------------------
// Dispatch send.

// One block ranks this rank's tokens: for every token it sends (slot j, token t = j * D + rank % D) and position k,
// the expert (or -1) and the token's position among this rank's tokens for that expert; for every destination the
// tokens it receives, in token order; and each destination's header (record count, tokens per local expert). Tokens
// go in chunks of one per thread; per warp and key (expert, then destination) a bit per lane, then the counts of the
// earlier warps and chunks give every position without atomics on counters, so the order is the token order.
__global__ void __launch_bounds__(kRouteMaxWarps * 32) routeKernel(const DispatchSendArgs a) {
  extern __shared__ uint32_t sm[];
  const Geometry& g = a.g;
  const uint32_t E = g.numExperts, L = g.numLocalExperts, K = g.topK, W = g.worldSize, D = g.dpSize;
  const uint32_t Ts = g.slotsPerSender, keys = E + W, warps = blockDim.x / 32;
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint32_t* bits = sm;
  uint32_t* base = sm + warps * keys;
  uint32_t* running = base + warps * keys;
  int2* route = reinterpret_cast<int2*>(a.st.scratch + g.offRoute);
  int32_t* tokens = reinterpret_cast<int32_t*>(a.st.scratch + g.offTokens);
  const uint32_t n = numTokensSentBy(g.rank, boundedM(a.m, a.boundM), D);
  for (uint32_t i = threadIdx.x; i < keys; i += blockDim.x) running[i] = 0;
  for (uint32_t first = 0; first < n; first += blockDim.x) {
    for (uint32_t i = threadIdx.x; i < warps * keys; i += blockDim.x) bits[i] = 0;
    __syncthreads();
    const uint32_t j = first + threadIdx.x;
    const bool live = j < n;
    if (live) {
      const int64_t t = static_cast<int64_t>(j) * D + g.rank % D;
      auto load = [&](uint32_t k) {
        return decodeIndex(a.indices, a.indexKind, t * a.indexStrides[0] + static_cast<int64_t>(k) * a.indexStrides[1]);
      };
      for (uint32_t k = 0; k < K; ++k) {
        int64_t e = load(k);
        if (e < -1 || e >= static_cast<int64_t>(E)) {
          recordErrorAt(claimedOf(a.st, g), a.st.hostError, kPhaseBadIndex, static_cast<int32_t>(g.rank), -1, t,
                        static_cast<int64_t>(k) << 32 | static_cast<uint32_t>(e), -1);
          e = -1;
        }
        const bool dup = e >= 0 && isRepeatOfEarlier(load, k, e);
        route[j * K + k] = make_int2(static_cast<int32_t>(e), dup ? kDupBit : 0);
        if (e >= 0 && !dup) {
          atomicOr(&bits[warp * keys + static_cast<uint32_t>(e)], 1u << lane);
          atomicOr(&bits[warp * keys + E + static_cast<uint32_t>(e) / L], 1u << lane);
        }
      }
    }
    __syncthreads();
    for (uint32_t key = threadIdx.x; key < keys; key += blockDim.x) {
      uint32_t acc = running[key];
      for (uint32_t w = 0; w < warps; ++w) {
        base[w * keys + key] = acc;
        acc += __popc(bits[w * keys + key]);
      }
      running[key] = acc;
    }
    __syncthreads();
    if (live) {
      const uint32_t lt = laneMaskLt();
      for (uint32_t k = 0; k < K; ++k) {
        int2 r = route[j * K + k];
        if (r.x < 0) continue;
        const uint32_t key = warp * keys + static_cast<uint32_t>(r.x);
        r.y |= static_cast<int32_t>(base[key] + __popc(bits[key] & lt));
        route[j * K + k] = r;
      }
      for (uint32_t d = 0; d < W; ++d) {
        const uint32_t key = warp * keys + E + d;
        const uint32_t word = bits[key];
        if ((word >> lane) & 1u) tokens[d * Ts + base[key] + __popc(word & lt)] = static_cast<int32_t>(j);
      }
    }
    __syncthreads();
  }
  char* stage = a.st.sym + g.offDispStage;
  for (uint32_t key = threadIdx.x; key < E; key += blockDim.x) {
    headerOf(stage, g, key / L)[kHeaderCounts + key % L] = running[key];
  }
  for (uint32_t d = threadIdx.x; d < W; d += blockDim.x) headerOf(stage, g, d)[kHeaderRecords] = running[E + d];
  if (threadIdx.x == 0) wordsOf(a.st, g)[kWordSent] = n;
}

// One warp writes record i of destination d into the staging: payload, scales, slot, the entries seen from d.
__device__ void packRecord(const DispatchSendArgs& a, uint32_t d, uint32_t i, uint32_t lane) {
  const Geometry& g = a.g;
  const uint32_t K = g.topK, L = g.numLocalExperts;
  const int32_t* tokens = reinterpret_cast<const int32_t*>(a.st.scratch + g.offTokens);
  const int2* route = reinterpret_cast<const int2*>(a.st.scratch + g.offRoute);
  char* rec = a.st.sym + g.offDispStage + d * g.regionBytes + recordOffset(g, i);
  const uint32_t j = static_cast<uint32_t>(tokens[d * g.slotsPerSender + i]);
  const int64_t t = static_cast<int64_t>(j) * g.dpSize + g.rank % g.dpSize;
  const uint8_t* src = a.x + t * a.xRowStrideBytes;
  for (uint32_t v = lane; v < g.hiddenBytes / 16; v += 32) st16(rec + 16 * v, ld16(src + 16 * v));
  uint32_t* scales = reinterpret_cast<uint32_t*>(rec + g.hiddenBytes);
  for (uint32_t s = lane; s < g.scaleBytes / 4; s += 32) {
    scales[s] = *reinterpret_cast<const uint32_t*>(a.xScale + t * a.xScaleStrideBytes[0] + s * a.xScaleStrideBytes[1]);
  }
  uint32_t* meta = reinterpret_cast<uint32_t*>(rec + g.metaOffset);
  if (lane == 0) meta[kMetaSlot] = j;
  int32_t* entries = reinterpret_cast<int32_t*>(meta + kMetaEntries);
  for (uint32_t k = lane; k < K; k += 32) {
    const int2 r = route[j * K + k];
    const bool here = r.x >= 0 && static_cast<uint32_t>(r.x) / L == d;
    entries[2 * k] = here ? static_cast<int32_t>(static_cast<uint32_t>(r.x) % L) | (r.y & kDupBit) : -1;
    entries[2 * k + 1] = here ? (r.y & ~kDupBit) : 0;
  }
}

// Block (d, c) packs chunk c of destination d's records into the staging and puts it, with its signal SET to the
// round, into d's region for this rank. Chunk 0 carries the header. An empty chunk only signals. Never waits.
__global__ void __launch_bounds__(kThreads) packPutKernel(const DispatchSendArgs a) {
  const Geometry& g = a.g;
  const uint32_t d = blockIdx.x / g.chunks, c = blockIdx.x % g.chunks;
  uint64_t* seq = seqOf(a.st, g, kPackPut);
  const uint64_t round = seq[blockIdx.x] + 1;
  char* stage = a.st.sym + g.offDispStage + d * g.regionBytes;
  const uint32_t records = headerOf(a.st.sym + g.offDispStage, g, d)[kHeaderRecords];
  const uint32_t lo = min(c * g.chunkRecords, records), hi = min(lo + g.chunkRecords, records);
  for (uint32_t i = lo + threadIdx.x / 32; i < hi; i += kWarps) packRecord(a, d, i, threadIdx.x % 32);
  __syncthreads();
  const uint64_t from = c == 0 ? 0 : recordOffset(g, lo);
  const uint64_t to = hi > lo ? recordOffset(g, hi) : (c == 0 ? g.headerBytes : from);
  uint64_t* sig = reinterpret_cast<uint64_t*>(a.st.sym + g.offDispSig) + g.rank * g.chunks + c;
  char* dst = a.st.sym + g.offDispRecv + g.rank * g.regionBytes;
  if (to > from) {
    nvshmemx_putmem_signal_nbi_block(dst + from, stage + from, to - from, sig, round, NVSHMEM_SIGNAL_SET,
                                     static_cast<int>(d));
  } else if (threadIdx.x == 0) {
    nvshmemx_signal_op(sig, round, NVSHMEM_SIGNAL_SET, static_cast<int>(d));
  }
  __syncthreads();
  if (threadIdx.x == 0) seq[blockIdx.x] = round;
}

// ----------------------------------------------------------------------------------------------------------------
// Dispatch receive.

// One thread: prefix[s] = the records of the senders before s in `regions` (their headers' counts), prefix[W] = all
// W senders' records.
__device__ __forceinline__ void recordPrefix(const char* regions, const Geometry& g, uint32_t W, uint32_t* prefix) {
  uint32_t acc = 0;
  for (uint32_t s = 0; s < W; ++s) {
    prefix[s] = acc;
    acc += headerOf(regions, g, s)[kHeaderRecords];
  }
  prefix[W] = acc;
}

// Block-wide, after every sender's header arrived: rowBase[s][le] = the first row of sender s's tokens for local expert
// le (the counts of the earlier senders, plus in the packed layout the padded totals of the earlier experts), and the
// record prefix over senders. Block 0 also writes the counts (when `outCounts` is given).
__device__ void rowTables(const Geometry& g, const char* recv, uint32_t* rowBase, uint32_t* expertBase,
                          uint32_t* prefix, int32_t* outCounts) {
  const uint32_t W = g.worldSize, L = g.numLocalExperts;
  const char* regions = recv;
  for (uint32_t le = threadIdx.x; le < L; le += blockDim.x) {
    uint32_t acc = 0;
    for (uint32_t s = 0; s < W; ++s) {
      rowBase[s * L + le] = acc;
      acc += headerOf(regions, g, s)[kHeaderCounts + le];
    }
    expertBase[le] = acc;
    if (outCounts != nullptr) outCounts[le] = static_cast<int32_t>(acc);
  }
  if (threadIdx.x == 32) recordPrefix(regions, g, W, prefix);
  __syncthreads();
  if (threadIdx.x < 32) {
    // Warp 0: exclusive scan of the padded totals (packed), zero (batched: each expert has its own block of rows).
    const uint32_t lane = threadIdx.x, per = (L + 31) / 32;
    const uint32_t lo = min(lane * per, L), hi = min(lo + per, L);
    uint32_t sum = 0;
    for (uint32_t le = lo; le < hi; ++le) sum += static_cast<uint32_t>(roundUpPow2(expertBase[le], g.padding));
    uint32_t incl = sum;
    for (uint32_t o = 1; o < 32; o <<= 1) {
      const uint32_t v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    uint32_t acc = incl - sum;
    for (uint32_t le = lo; le < hi; ++le) {
      const uint32_t total = static_cast<uint32_t>(roundUpPow2(expertBase[le], g.padding));
      expertBase[le] = g.packed ? acc : 0;
      acc += total;
    }
  }
  __syncthreads();
}

// The sender of received record i: the largest s with prefix[s] <= i.
__device__ __forceinline__ uint32_t senderOf(const uint32_t* prefix, uint32_t W, uint32_t i) {
  uint32_t lo = 0, hi = W;
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (prefix[mid] <= i) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Waits for every chunk of every sender, builds the row tables, then one warp per record copies it into each of its
// local experts' rows (rows by (sender, token), the reference's order) and notes the rows for the combine.
__global__ void __launch_bounds__(kThreads) dispatchRecvKernel(const DispatchRecvArgs a) {
  extern __shared__ uint32_t sm[];
  const Geometry& g = a.g;
  const uint32_t W = g.worldSize, L = g.numLocalExperts, K = g.topK, Ts = g.slotsPerSender, C = g.chunks;
  uint32_t* rowBase = sm;
  uint32_t* expertBase = rowBase + W * L;
  uint32_t* prefix = expertBase + L;
  uint64_t* seq = seqOf(a.st, g, kDispatchRecv);
  const uint64_t round = seq[blockIdx.x] + 1;
  const uint64_t* sig = reinterpret_cast<const uint64_t*>(a.st.sym + g.offDispSig);
  bool ok = true;
  for (uint32_t i = threadIdx.x; i < W * C && ok; i += blockDim.x) {
    ok = waitFor(sig + i, round, a.st, g, kPhaseDispatchRecv, i / C, i % C);
  }
  if (__syncthreads_and(ok ? 1 : 0) != 0) {
    const char* recv = a.st.sym + g.offDispRecv;
    rowTables(g, recv, rowBase, expertBase, prefix, blockIdx.x == 0 ? a.outNumTokens : nullptr);
    int2* rows = reinterpret_cast<int2*>(a.st.scratch + g.offRows);
    const uint32_t lane = threadIdx.x % 32, totalWarps = gridDim.x * kWarps;
    const uint32_t n = prefix[W];
    const uint32_t scaleWords = g.scaleBytes / 4;
    for (uint32_t i = (threadIdx.x / 32) * gridDim.x + blockIdx.x; i < n; i += totalWarps) {
      const uint32_t s = senderOf(prefix, W, i), c = i - prefix[s];
      const char* rec = recv + s * g.regionBytes + recordOffset(g, c);
      const int32_t* entries = reinterpret_cast<const int32_t*>(rec + g.metaOffset) + kMetaEntries;
      int2* recRows = rows + (static_cast<uint64_t>(s) * Ts + c) * K;
      for (uint32_t k = lane; k < K; k += 32) {
        const int32_t e = entries[2 * k];
        int2 r = make_int2(-1, 0);
        if (e >= 0) {
          const uint32_t le = static_cast<uint32_t>(e & ~kDupBit);
          r = make_int2(static_cast<int32_t>(le),
                        static_cast<int32_t>(expertBase[le] + rowBase[s * L + le] + entries[2 * k + 1]));
        }
        recRows[k] = r;
      }
      for (uint32_t k = 0; k < K; ++k) {
        const int32_t e = entries[2 * k];
        if (e < 0 || (e & kDupBit) != 0) continue;
        const uint32_t le = static_cast<uint32_t>(e);
        const uint64_t row = expertBase[le] + rowBase[s * L + le] + static_cast<uint32_t>(entries[2 * k + 1]);
        uint8_t* dst = a.outX + le * a.outExpertStrideBytes + static_cast<int64_t>(row) * a.outRowStrideBytes;
        for (uint32_t v = lane; v < g.hiddenBytes / 16; v += 32) st16(dst + 16 * v, ld16(rec + 16 * v));
        const uint32_t* scales = reinterpret_cast<const uint32_t*>(rec + g.hiddenBytes);
        for (uint32_t w = lane; w < scaleWords; w += 32) {
          *reinterpret_cast<uint32_t*>(a.outScale + le * a.outScaleStrideBytes[0] +
                                       static_cast<int64_t>(row) * a.outScaleStrideBytes[1] +
                                       w * a.outScaleStrideBytes[2]) = scales[w];
        }
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) seq[blockIdx.x] = round;
}

// ----------------------------------------------------------------------------------------------------------------
// Combine send.

// Block d puts this rank's router weights of every token it dispatched into d (slot order), signal SET to the round.
// Every rank gets them, tokens or not: the signal is also this rank's "I entered the combine" (see combineSendKernel).
__global__ void __launch_bounds__(kThreads) weightsKernel(const CombineSendArgs a) {
  const Geometry& g = a.g;
  const uint32_t d = blockIdx.x, K = g.topK, D = g.dpSize, Ts = g.slotsPerSender;
  uint64_t* seq = seqOf(a.st, g, kWeights);
  const uint64_t round = seq[blockIdx.x] + 1;
  const uint32_t n = static_cast<uint32_t>(wordsOf(a.st, g)[kWordSent]);
  float* stage = reinterpret_cast<float*>(a.st.sym + g.offWeightStage) + static_cast<uint64_t>(d) * Ts * K;
  for (uint32_t i = threadIdx.x; i < n * K; i += blockDim.x) {
    const int64_t t = static_cast<int64_t>(i / K) * D + g.rank % D;
    stage[i] = a.weights[t * a.weightStrides[0] + static_cast<int64_t>(i % K) * a.weightStrides[1]];
  }
  __syncthreads();
  float* dst = reinterpret_cast<float*>(a.st.sym + g.offWeightRecv) + static_cast<uint64_t>(g.rank) * Ts * K;
  uint64_t* sig = reinterpret_cast<uint64_t*>(a.st.sym + g.offWeightSig) + g.rank;
  if (n > 0) {
    nvshmemx_putmem_signal_nbi_block(dst, stage, static_cast<size_t>(n) * K * 4, sig, round, NVSHMEM_SIGNAL_SET,
                                     static_cast<int>(d));
  } else if (threadIdx.x == 0) {
    nvshmemx_signal_op(sig, round, NVSHMEM_SIGNAL_SET, static_cast<int>(d));
  }
  __syncthreads();
  if (threadIdx.x == 0) seq[blockIdx.x] = round;
}

// Waits for every rank's weights (so every rank finished its last combine-recv: its partial buffers are free), then
// one warp per received record forms sum_k w[k] * y[row(k)] over the token's positions on this rank (k ascending,
// fp32) and puts it to every rank of the token's DP group, signal (this rank, token) SET to the round. The last block
// to finish SETs doneSig on every rank: this rank no longer reads what they sent it this round.
template <int kY>
__global__ void __launch_bounds__(kThreads) combineSendKernel(const CombineSendArgs a) {
  extern __shared__ uint32_t sm[];
  const Geometry& g = a.g;
  const uint32_t W = g.worldSize, K = g.topK, Ts = g.slotsPerSender, D = g.dpSize, T = g.maxTokens, H = g.hiddenDim;
  uint32_t* prefix = sm;
  uint64_t* seq = seqOf(a.st, g, kCombineSend);
  const uint64_t round = seq[blockIdx.x] + 1;
  const uint64_t* wsig = reinterpret_cast<const uint64_t*>(a.st.sym + g.offWeightSig);
  bool ok = true;
  for (uint32_t s = threadIdx.x; s < W && ok; s += blockDim.x) {
    ok = waitFor(wsig + s, round, a.st, g, kPhaseCombineWeights, s, -1);
  }
  if (__syncthreads_and(ok ? 1 : 0) != 0) {
    const char* recv = a.st.sym + g.offDispRecv;
    if (threadIdx.x == 0) recordPrefix(recv, g, W, prefix);
    __syncthreads();
    const int2* rows = reinterpret_cast<const int2*>(a.st.scratch + g.offRows);
    const float* weights = reinterpret_cast<const float*>(a.st.sym + g.offWeightRecv);
    float* stage = reinterpret_cast<float*>(a.st.sym + g.offCombStage);
    float* combRecv = reinterpret_cast<float*>(a.st.sym + g.offCombRecv);
    uint64_t* combSig = reinterpret_cast<uint64_t*>(a.st.sym + g.offCombSig);
    const uint32_t lane = threadIdx.x % 32, totalWarps = gridDim.x * kWarps;
    const uint32_t n = prefix[W];
    for (uint32_t i = (threadIdx.x / 32) * gridDim.x + blockIdx.x; i < n; i += totalWarps) {
      const uint32_t s = senderOf(prefix, W, i), c = i - prefix[s];
      const char* rec = recv + s * g.regionBytes + recordOffset(g, c);
      const uint32_t* meta = reinterpret_cast<const uint32_t*>(rec + g.metaOffset);
      const int32_t* entries = reinterpret_cast<const int32_t*>(meta + kMetaEntries);
      const uint32_t j = meta[kMetaSlot];
      const uint32_t t = j * D + s % D;
      const int2* recRows = rows + (static_cast<uint64_t>(s) * Ts + c) * K;
      const float* w = weights + (static_cast<uint64_t>(s) * Ts + j) * K;
      float* partial = stage + (static_cast<uint64_t>(s) * Ts + c) * H;
      for (uint32_t h = 4 * lane; h < H; h += 128) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (uint32_t k = 0; k < K; ++k) {
          if (entries[2 * k] < 0) continue;
          const int2 r = recRows[k];
          const float wk = w[k];
          const float4 y = load4<kY>(a.y, r.x * a.yExpertStride + static_cast<int64_t>(r.y) * a.yRowStride + h);
          acc.x += wk * y.x;
          acc.y += wk * y.y;
          acc.z += wk * y.z;
          acc.w += wk * y.w;
        }
        *reinterpret_cast<float4*>(partial + h) = acc;
      }
      __syncwarp();
      const uint32_t first = (s / D) * D;
      float* dst = combRecv + (static_cast<uint64_t>(g.rank) * T + t) * H;
      uint64_t* sig = combSig + static_cast<uint64_t>(g.rank) * T + t;
      for (uint32_t r = first; r < first + D; ++r) {
        nvshmemx_putmem_signal_nbi_warp(dst, partial, static_cast<size_t>(H) * 4, sig, round, NVSHMEM_SIGNAL_SET,
                                        static_cast<int>(r));
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t* words = wordsOf(a.st, g);
    __threadfence();
    const uint64_t before = atomicAdd(reinterpret_cast<unsigned long long*>(&words[kWordCombineSendDone]), 1ull);
    if (before + 1 == round * gridDim.x) {
      uint64_t* done = reinterpret_cast<uint64_t*>(a.st.sym + g.offDoneSig) + g.rank;
      for (uint32_t d = 0; d < W; ++d) nvshmemx_signal_op(done, round, NVSHMEM_SIGNAL_SET, static_cast<int>(d));
    }
    seq[blockIdx.x] = round;
  }
}

// ----------------------------------------------------------------------------------------------------------------
// Combine receive.

// Waits for every rank's doneSig (the round's barrier), then one warp per token t < boundM: the distinct ranks owning
// its experts, ascending; waits for each one's partial; out[t] = (accumulate ? out[t] : 0) + the partials in that
// order, in fp32, rounded once into the output type.
template <int kOut>
__global__ void __launch_bounds__(kThreads) combineRecvKernel(const CombineRecvArgs a) {
  __shared__ uint32_t owners[kWarps][kMaxExpertsPerToken];
  const Geometry& g = a.g;
  const uint32_t W = g.worldSize, K = g.topK, T = g.maxTokens, H = g.hiddenDim, E = g.numExperts;
  uint64_t* seq = seqOf(a.st, g, kCombineRecv);
  const uint64_t round = seq[blockIdx.x] + 1;
  const uint64_t* done = reinterpret_cast<const uint64_t*>(a.st.sym + g.offDoneSig);
  bool ok = true;
  for (uint32_t d = threadIdx.x; d < W && ok; d += blockDim.x) {
    ok = waitFor(done + d, round, a.st, g, kPhaseCombineDone, d, -1);
  }
  if (__syncthreads_and(ok ? 1 : 0) != 0) {
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t m = boundedM(a.m, a.boundM);
    const float* combRecv = reinterpret_cast<const float*>(a.st.sym + g.offCombRecv);
    const uint64_t* combSig = reinterpret_cast<const uint64_t*>(a.st.sym + g.offCombSig);
    uint32_t* mine = owners[warp];
    for (uint32_t t = warp * gridDim.x + blockIdx.x; t < m; t += gridDim.x * kWarps) {
      uint32_t count = 0;
      if (lane == 0) {
        // Distinct owner ranks in ascending order (insertion into a sorted list; K is small).
        for (uint32_t k = 0; k < K; ++k) {
          const int64_t e =
              decodeIndex(a.indices, a.indexKind, static_cast<int64_t>(t) * a.indexStrides[0] + k * a.indexStrides[1]);
          if (e < -1 || e >= static_cast<int64_t>(E)) {
            recordErrorAt(claimedOf(a.st, g), a.st.hostError, kPhaseBadIndexCombine, static_cast<int32_t>(g.rank), -1,
                          t, static_cast<int64_t>(k) << 32 | static_cast<uint32_t>(e), -1);
            continue;
          }
          if (e < 0) continue;
          const uint32_t o = static_cast<uint32_t>(e) / g.numLocalExperts;
          uint32_t p = count;
          while (p > 0 && mine[p - 1] > o) --p;
          if (p > 0 && mine[p - 1] == o) continue;
          for (uint32_t q = count; q > p; --q) mine[q] = mine[q - 1];
          mine[p] = o;
          ++count;
        }
      }
      count = __shfl_sync(0xffffffffu, count, 0);
      __syncwarp();
      bool arrived = true;
      if (lane == 0) {
        for (uint32_t q = 0; q < count && arrived; ++q) {
          arrived =
              waitFor(combSig + static_cast<uint64_t>(mine[q]) * T + t, round, a.st, g, kPhaseCombineRecv, mine[q], t);
        }
      }
      if (__shfl_sync(0xffffffffu, arrived ? 1 : 0, 0) == 0) break;
      // Every lane acquires the signals itself (already set): its loads below then see the partials.
      for (uint32_t q = 0; q < count; ++q) (void)ldAcquireSys(combSig + static_cast<uint64_t>(mine[q]) * T + t);
      const int64_t rowElem = static_cast<int64_t>(t) * a.outRowStride;
      for (uint32_t h = 4 * lane; h < H; h += 128) {
        float4 acc = a.accumulate ? load4<kOut>(a.out, rowElem + h) : make_float4(0.f, 0.f, 0.f, 0.f);
        for (uint32_t q = 0; q < count; ++q) {
          const float4 p =
              *reinterpret_cast<const float4*>(combRecv + (static_cast<uint64_t>(mine[q]) * T + t) * H + h);
          acc.x += p.x;
          acc.y += p.y;
          acc.z += p.z;
          acc.w += p.w;
        }
        store4<kOut>(a.out, rowElem + h, acc);
      }
      __syncwarp();
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) seq[blockIdx.x] = round;
}

template <int kY>
int launchCombineSendTyped(const CombineSendArgs& a, cudaStream_t s) {
  combineSendKernel<kY><<<a.g.recvBlocks, kThreads, (a.g.worldSize + 1) * 4, s>>>(a);
  return static_cast<int>(cudaGetLastError());
}

template <int kOut>
int launchCombineRecvTyped(const CombineRecvArgs& a, cudaStream_t s) {
  combineRecvKernel<kOut><<<a.g.combineBlocks, kThreads, 0, s>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int launchDispatchSend(const DispatchSendArgs& a, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const uint32_t smem = static_cast<uint32_t>(routeSharedBytes(a.g.routeWarps, a.g.numExperts, a.g.worldSize));
  routeKernel<<<1, a.g.routeWarps * 32, smem, s>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return static_cast<int>(e);
  packPutKernel<<<packBlocks(a.g), kThreads, 0, s>>>(a);
  return static_cast<int>(cudaGetLastError());
}

int launchDispatchRecv(const DispatchRecvArgs& a, void* stream) {
  dispatchRecvKernel<<<a.g.recvBlocks, kThreads, static_cast<uint32_t>(recvSharedBytes(a.g)),
                       static_cast<cudaStream_t>(stream)>>>(a);
  return static_cast<int>(cudaGetLastError());
}

int launchCombineSend(const CombineSendArgs& a, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  weightsKernel<<<a.g.worldSize, kThreads, 0, s>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return static_cast<int>(e);
  switch (a.yType) {
    case kTypeBf16:
      return launchCombineSendTyped<kTypeBf16>(a, s);
    case kTypeF16:
      return launchCombineSendTyped<kTypeF16>(a, s);
    default:
      return launchCombineSendTyped<kTypeF32>(a, s);
  }
}

int launchCombineRecv(const CombineRecvArgs& a, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (a.outType) {
    case kTypeBf16:
      return launchCombineRecvTyped<kTypeBf16>(a, s);
    case kTypeF16:
      return launchCombineRecvTyped<kTypeF16>(a, s);
    default:
      return launchCombineRecvTyped<kTypeF32>(a, s);
  }
}

int configureKernels(const Geometry& g) {
  const int route = static_cast<int>(routeSharedBytes(g.routeWarps, g.numExperts, g.worldSize));
  cudaError_t e = cudaFuncSetAttribute(routeKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, route);
  if (e != cudaSuccess) return static_cast<int>(e);
  const int recv = static_cast<int>(recvSharedBytes(g));
  e = cudaFuncSetAttribute(dispatchRecvKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, recv);
  if (e != cudaSuccess) return static_cast<int>(e);
  const int send = static_cast<int>((g.worldSize + 1) * 4);
  for (const void* fn : {reinterpret_cast<const void*>(combineSendKernel<kTypeBf16>),
                         reinterpret_cast<const void*>(combineSendKernel<kTypeF16>),
                         reinterpret_cast<const void*>(combineSendKernel<kTypeF32>)}) {
    e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, send);
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  return 0;
}

}  // namespace nvshmem
}  // namespace epcomm
