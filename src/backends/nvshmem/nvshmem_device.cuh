// Device helpers of the nvshmem kernels: round counters, the error record, bounded waits on signal words, NVSHMEM's
// puts, the combine tensors' vector loads and stores, and the per-sender tables built from the received headers. Part
// of nvshmem_kernels.cu's translation unit: include it only there.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "backends/nvshmem/nvshmem_kernels.hpp"
#include "core/abort_board.hpp"
#include "core/layout.hpp"
#include "epcomm/device/ptx.cuh"

namespace epcomm {
namespace nvshmem {
namespace {

using device::globalTimerNs;
using device::laneMaskLt;
using device::ldAcquireSys;

constexpr uint32_t kFullMask = 0xffffffffu;

// Round counters of `kernel`: one per work slot (see Kernel), read at the slot's entry, stored at its exit.
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
__device__ __forceinline__ int32_t* claimedOf(const DeviceState& st, const Geometry& g) {
  return reinterpret_cast<int32_t*>(wordsOf(st, g) + kWordClaimed);
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

// An expert index outside [-1, E) at (token t, position k): recorded as a device error (the entry is then skipped).
__device__ __forceinline__ void recordBadIndex(const DeviceState& st, const Geometry& g, int32_t phase, int64_t t,
                                               uint32_t k, int64_t e) {
  recordErrorAt(claimedOf(st, g), st.hostError, phase, static_cast<int32_t>(g.rank), -1, t,
                static_cast<int64_t>(k) << 32 | static_cast<uint32_t>(e), -1);
}

// The abort word next to the error record (core/abort_board.hpp): 0, or s + 1 once peer rank s aborted. Host-mapped:
// read only in the slow path of a wait.
__device__ __forceinline__ uint32_t peerAbortOf(const ErrorRecord* hostError) {
  return *reinterpret_cast<const volatile uint32_t*>(reinterpret_cast<const char*>(hostError) + kAbortWordOffset);
}

// Records that a peer aborted (its abort word is set) for a wait in `phase` on `peer`: code kPhasePeerAbort, peer the
// rank that aborted, seen = the wait's phase, wanted = the peer it waited for. Out of line, like the wait's slow path.
__device__ __noinline__ void recordPeerAbort(int32_t* claimed, ErrorRecord* hostError, int32_t phase, int32_t rank,
                                             int32_t peer) {
  recordErrorAt(claimed, hostError, kPhasePeerAbort, rank, static_cast<int32_t>(peerAbortOf(hostError)) - 1, phase,
                peer, -1);
}

// The spin of waitFor once the word was not ready at the first look: out of line, so every wait inlines one load and
// a compare. Every 256 polls it checks whether another wait of this object failed (then it stops) and whether
// EPCOMM_TIMEOUT_MS passed: then it records (phase, peer, value seen, round wanted, detail) and stops; and whether a
// peer aborted (its abort word): then, unless the word is ready at one more look, it records that and stops. Never
// traps.
__device__ __noinline__ bool waitSlow(const uint64_t* word, uint64_t want, int32_t* claimed, ErrorRecord* hostError,
                                      uint64_t timeoutNs, int32_t phase, int32_t rank, int32_t peer, int64_t detail) {
  const uint64_t start = globalTimerNs();
  // A wait for this rank's own signal (its rows for itself) ends when another block of this kernel gets past its own
  // wait for a peer: given twice the bound, it never times out first, so the error names the peer that is missing
  // (seen: a survivor of a killed rank named itself, its combine-recv bound running out with the send half's).
  const uint64_t limitNs = peer == rank ? 2 * timeoutNs : timeoutNs;
  for (uint32_t i = 1;; ++i) {
    const uint64_t v = ldAcquireSys(word);
    if (v >= want) return true;
    if ((i & 255) == 0) {
      if (*reinterpret_cast<volatile int32_t*>(claimed) != 0) return false;
      // A peer that refused its call (or whose object failed) set this rank's abort word: the wait stops, unless the
      // word is ready at one more look. An abort says that the round will not complete, not that this wait's data
      // will not come (a rank that refuses its combine delivered its dispatch), and this thread may have been
      // preempted between its last poll and the look at the abort word (PEs sharing a GPU); the fence makes the
      // abort word's load an acquire of what the aborting rank's host saw its kernels complete.
      if (peerAbortOf(hostError) != 0) {
        __threadfence_system();
        if (ldAcquireSys(word) >= want) return true;
        recordPeerAbort(claimed, hostError, phase, rank, peer);
        return false;
      }
      if (globalTimerNs() - start > limitNs) {
        recordErrorAt(claimed, hostError, phase, rank, peer, static_cast<int64_t>(v), static_cast<int64_t>(want),
                      detail);
        return false;
      }
    }
  }
}

// Waits until the signal word reached `want` (acquire: what the put-with-signal carried is visible afterwards to
// this thread, and to the threads it then meets at a block or warp barrier). False when the wait timed out (recorded)
// or another wait of the object failed.
__device__ __forceinline__ bool waitFor(const uint64_t* word, uint64_t want, const DeviceState& st, const Geometry& g,
                                        int32_t phase, uint32_t peer, int64_t detail) {
  if (ldAcquireSys(word) >= want) return true;
  return waitSlow(word, want, claimedOf(st, g), st.hostError, st.timeoutNs, phase, static_cast<int32_t>(g.rank),
                  static_cast<int32_t>(peer), detail);
}

// Whether rank r takes part in the rounds (DeviceState::live): a masked rank is never put to, signalled or waited for.
__device__ __forceinline__ bool liveRank(const DeviceState& st, uint32_t r) { return r >= 32 || ((st.live >> r) & 1u); }

// Tokens to consider: m, or the device bound when given (clamped to [0, m]).
__device__ __forceinline__ uint32_t boundedM(uint32_t m, const int32_t* boundM) {
  if (boundM == nullptr) return m;
  const int32_t b = *boundM;
  return b <= 0 ? 0u : (static_cast<uint32_t>(b) < m ? static_cast<uint32_t>(b) : m);
}

// NVSHMEM's put-with-signal and signal calls, out of line: their code (the P2P copy, and the proxy and IBGDA paths)
// then does not share a register allocation with the loops around it, which stay free of spills at the launch bound.
__device__ __noinline__ void putSignalWarp(void* dst, const void* src, size_t bytes, uint64_t* sig, uint64_t value,
                                           int pe) {
  nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, sig, value, NVSHMEM_SIGNAL_SET, pe);
}
__device__ __noinline__ void putSignalBlock(void* dst, const void* src, size_t bytes, uint64_t* sig, uint64_t value,
                                            int pe) {
  nvshmemx_putmem_signal_nbi_block(dst, src, bytes, sig, value, NVSHMEM_SIGNAL_SET, pe);
}
__device__ __noinline__ void signalSet(uint64_t* sig, uint64_t value, int pe) {
  nvshmemx_signal_op(sig, value, NVSHMEM_SIGNAL_SET, pe);
}

__device__ __forceinline__ int4 ld16(const void* p) { return *reinterpret_cast<const int4*>(p); }
__device__ __forceinline__ void st16(void* p, int4 v) { *reinterpret_cast<int4*>(p) = v; }

// ----------------------------------------------------------------------------------------------------------------
// Combine tensors: four consecutive elements (8 or 16 bytes, aligned: H % 4 == 0 and rows 16-byte aligned) as fp32.

template <int kType>
struct Elem2;
template <>
struct Elem2<kTypeBf16> {
  using T2 = __nv_bfloat162;
  static __device__ __forceinline__ float2 toF(T2 v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ T2 fromF(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <>
struct Elem2<kTypeF16> {
  using T2 = __half2;
  static __device__ __forceinline__ float2 toF(T2 v) { return __half22float2(v); }
  static __device__ __forceinline__ T2 fromF(float a, float b) { return __floats2half2_rn(a, b); }
};

/// Bytes of one combine element of type kType.
template <int kType>
__host__ __device__ constexpr uint32_t elemBytes() {
  return kType == kTypeF32 ? 4 : 2;
}

// Loads the four elements at `p` as fp32. kOnce: a streaming load (ld.global.cs, evict first) for data read once.
template <int kType, bool kOnce>
__device__ __forceinline__ void load4(const void* p, float (&out)[4]) {
  if constexpr (kType == kTypeF32) {
    const float4 v = kOnce ? __ldcs(reinterpret_cast<const float4*>(p)) : *reinterpret_cast<const float4*>(p);
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
  } else {
    const uint2 raw = kOnce ? __ldcs(reinterpret_cast<const uint2*>(p)) : *reinterpret_cast<const uint2*>(p);
    using T2 = typename Elem2<kType>::T2;
    const float2 lo = Elem2<kType>::toF(*reinterpret_cast<const T2*>(&raw.x));
    const float2 hi = Elem2<kType>::toF(*reinterpret_cast<const T2*>(&raw.y));
    out[0] = lo.x;
    out[1] = lo.y;
    out[2] = hi.x;
    out[3] = hi.y;
  }
}

// Stores four fp32 values at `p`, rounded to nearest even into kType.
template <int kType>
__device__ __forceinline__ void store4(void* p, const float (&in)[4]) {
  if constexpr (kType == kTypeF32) {
    *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
  } else {
    using T2 = typename Elem2<kType>::T2;
    const T2 lo = Elem2<kType>::fromF(in[0], in[1]), hi = Elem2<kType>::fromF(in[2], in[3]);
    uint2 raw;
    raw.x = *reinterpret_cast<const uint32_t*>(&lo);
    raw.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(p) = raw;
  }
}

// ----------------------------------------------------------------------------------------------------------------
// Per-sender tables from the received headers.

// One warp: out[i * stride] = value(0) + ... + value(i - 1) for i < n; returns the sum of all n (in every lane).
template <typename Value>
__device__ __forceinline__ uint32_t warpExclusiveScan(uint32_t n, Value value, uint32_t* out, uint32_t stride) {
  const uint32_t lane = threadIdx.x % 32;
  uint32_t acc = 0;
  for (uint32_t i0 = 0; i0 < n; i0 += 32) {
    const uint32_t i = i0 + lane;
    const uint32_t v = i < n ? value(i) : 0u;
    uint32_t incl = v;
#pragma unroll
    for (uint32_t o = 1; o < 32; o <<= 1) {
      const uint32_t u = __shfl_up_sync(kFullMask, incl, o);
      if (lane >= o) incl += u;
    }
    if (i < n) out[static_cast<uint64_t>(i) * stride] = acc + incl - v;
    acc += __shfl_sync(kFullMask, incl, 31);
  }
  return acc;
}

// One warp, after every sender's header arrived: prefix[s] = the records of the senders before s in `regions`,
// prefix[W] = all W senders' records.
__device__ __forceinline__ void senderPrefix(const char* regions, const Geometry& g, uint32_t* prefix) {
  const uint32_t W = g.worldSize;
  const uint32_t total = warpExclusiveScan(
      W, [&](uint32_t s) { return headerOf(regions, g, s)[kHeaderRecords]; }, prefix, 1);
  if (threadIdx.x % 32 == 0) prefix[W] = total;
}

// Block-wide, after every sender's header arrived: rowBase[s][le] = the first row of sender s's tokens for local expert
// le among that expert's rows (the counts of the earlier senders), expertBase[le] = the expert's first row (packed:
// the padded totals of the earlier experts; batched: 0, each expert has its own block of rows), and the record prefix
// over senders. Block 0 also writes the counts (when `outCounts` is given). Ends with a block barrier.
__device__ void rowTables(const Geometry& g, const char* recv, uint32_t* rowBase, uint32_t* expertBase,
                          uint32_t* prefix, int32_t* outCounts) {
  const uint32_t W = g.worldSize, L = g.numLocalExperts;
  const uint32_t warp = threadIdx.x / 32, warps = blockDim.x / 32;
  // Warp w scans the senders' counts of local experts w, w + warps, ...; the last warp also the record counts.
  for (uint32_t le = warp; le < L; le += warps) {
    const uint32_t total = warpExclusiveScan(
        W, [&](uint32_t s) { return headerOf(recv, g, s)[kHeaderCounts + le]; }, rowBase + le, L);
    if (threadIdx.x % 32 == 0) {
      expertBase[le] = total;
      if (outCounts != nullptr) outCounts[le] = static_cast<int32_t>(total);
    }
  }
  if (warp == warps - 1) senderPrefix(recv, g, prefix);
  __syncthreads();
  if (threadIdx.x < 32) {
    // Warp 0: exclusive scan of the padded totals (packed), zero (batched).
    const uint32_t lane = threadIdx.x, per = (L + 31) / 32;
    const uint32_t lo = min(lane * per, L), hi = min(lo + per, L);
    uint32_t sum = 0;
    for (uint32_t le = lo; le < hi; ++le) sum += static_cast<uint32_t>(roundUpPow2(expertBase[le], g.padding));
    uint32_t incl = sum;
    for (uint32_t o = 1; o < 32; o <<= 1) {
      const uint32_t v = __shfl_up_sync(kFullMask, incl, o);
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

}  // namespace
}  // namespace nvshmem
}  // namespace epcomm
