// Combine kernels of the GPU proxy backend: the send half (copying expertY's rows into the combine send buffer) and
// the receive half (each token's weighted sum of its rows, rounded once). Part of proxy_kernels.cu's translation
// unit: include it only there.
#pragma once

#include "backends/proxy/proxy_wait.cuh"
#include "core/dtype_convert.hpp"

namespace epcomm {
namespace gpuproxy {
namespace {

// ---- Combine send ------------------------------------------------------------------------------------------------

// Many blocks, one warp per (row, kChunkBytes of it): row i of the combine send buffer (piece (g, le) = the rows of
// group g's senders for local expert le, pieces in (g, le) order) is a copy of expertY's row of that expert. Group g's
// rows go to the send buffer when a rank of g is reached over the fabric, and into the region of every node rank of g
// (st.lg), at sendDest[g], where the channel would have written them. The last block raises this rank's combine flag in
// every node rank's region, then signals combineReady.
__global__ void __launch_bounds__(kCopyThreads) combineSendKernel(const CombineSendArgs a) {
  const DeviceState& st = a.st;
  extern __shared__ uint32_t smem[];  // sendCum[G * L + 1], srcStart[G * L], sendDest[G]
  if (blockHalted(st)) return;
  const proxy::ProtocolSizes& s = a.sizes;
  const TableGeometry& tg = a.tg;
  const uint32_t L = s.numLocalExperts, W = s.worldSize, D = s.dpSize, pieces = tg.G * L;
  const uint32_t round = *seqWord(st, kSeqCombineSend);
  if (blockIdx.x == 0 && threadIdx.x == 0) stamp(st, round, &TraceRound::combStart);
  uint32_t* sendCum = smem;
  uint32_t* srcStart = smem + pieces + 1;
  uint32_t* sendDest = srcStart + pieces;
  const uint32_t* tables = deviceTables(st);
  for (uint32_t i = threadIdx.x; i <= pieces; i += blockDim.x) {
    sendCum[i] = tables[tg.offSendCum + i];
    if (i < pieces) {
      const uint32_t g = i / L, le = i % L;
      srcStart[i] = tables[tg.offOutputRowBase + le] + tables[tg.offSlotOffset + le * (W + 1) + g * D];
    }
  }
  for (uint32_t g = threadIdx.x; g < tg.G; g += blockDim.x) sendDest[g] = tables[tg.offSendDest + g];
  __syncthreads();
  const LocalGeometry& lg = st.lg;
  const uint32_t me = s.rank;
  const bool batched = s.layout == Layout::kBatched;
  const uint64_t R = s.batchedRowsPerExpert;
  const uint64_t rowBytes = static_cast<uint64_t>(a.hidden) * a.itemBytes;
  const bool vec = rowBytes % 16 == 0;
  const uint32_t lane = laneId();
  const uint32_t warps = gridDim.x * (blockDim.x / 32);
  const uint64_t chunks = vec ? (rowBytes + kChunkBytes - 1) / kChunkBytes : 1;
  const uint64_t total = sendCum[pieces] * chunks;
  uint32_t piece = 0;
  for (uint64_t u = blockIdx.x + gridDim.x * warpId(); u < total; u += warps) {
    const uint32_t i = static_cast<uint32_t>(u / chunks);
    const uint64_t chunk = u % chunks;
    while (sendCum[piece + 1] <= i) ++piece;
    const uint64_t r = srcStart[piece] + (i - sendCum[piece]);
    const int64_t off = batched
                            ? static_cast<int64_t>(r / R) * a.yExpertStride + static_cast<int64_t>(r % R) * a.yRowStride
                            : static_cast<int64_t>(r) * a.yRowStride;
    const uint8_t* src = a.y + off * a.itemBytes;
    // Group g's ranks [g D, g D + D): those on this node get the row in their region, the send buffer serves the rest.
    const uint32_t g = piece / L;
    // Without the NVLink path this rank's own group's rows also go to the scratch's own rows (device memory), which
    // this rank reads; the send buffer then serves the group's other ranks only (D > 1).
    const uint32_t nodeBegin = max(g * D, lg.first), nodeEnd = min(g * D + D, lg.first + lg.size);
    const bool own = lg.size == 0 && g == me / D;
    const bool fabric = lg.size == 0 ? (!own || D > 1) : (nodeBegin != g * D || nodeEnd != g * D + D);
    uint8_t* dst = fabric ? a.ch.combineSend + static_cast<uint64_t>(i) * rowBytes : nullptr;
    uint8_t* ownDst =
        own ? st.scratch + st.sg.offOwnRows + static_cast<uint64_t>(i - sendCum[g * L]) * rowBytes : nullptr;
    const uint64_t localOff = lg.offRows + (static_cast<uint64_t>(sendDest[g]) + i - sendCum[g * L]) * rowBytes;
    if (vec) {
      // One chunk of the row: every load before the first store.
      const uint64_t base = chunk * kChunkBytes + lane * 16ull;
      int4 v[kCopyBatch];
#pragma unroll
      for (uint32_t q = 0; q < kCopyBatch; ++q) {
        const uint64_t b = base + q * 32 * 16;
        if (b < rowBytes) v[q] = *reinterpret_cast<const int4*>(src + b);
      }
#pragma unroll
      for (uint32_t q = 0; q < kCopyBatch; ++q) {
        const uint64_t b = base + q * 32 * 16;
        if (b >= rowBytes) continue;
        if (dst != nullptr) st16(dst + b, v[q]);
        if (ownDst != nullptr) st16(ownDst + b, v[q]);
        for (uint32_t p = nodeBegin; p < nodeEnd; ++p) st16(localRegion(st, p) + localOff + b, v[q]);
      }
    } else {
      for (uint64_t b = lane * 2ull; b < rowBytes; b += 32 * 2) {
        const uint16_t v = *reinterpret_cast<const uint16_t*>(src + b);
        if (dst != nullptr) *reinterpret_cast<uint16_t*>(dst + b) = v;
        if (ownDst != nullptr) *reinterpret_cast<uint16_t*>(ownDst + b) = v;
        for (uint32_t p = nodeBegin; p < nodeEnd; ++p) {
          *reinterpret_cast<uint16_t*>(localRegion(st, p) + localOff + b) = v;
        }
      }
    }
  }
  lastBlock(st, kSeqCombineSend, [&] {
    *seqWord(st, kSeqCombineSend) = round + 1;
    raiseLocalFlags(st, me, st.lg.offCombineFlag, round + 1);
    *reinterpret_cast<volatile int32_t*>(&st.mailbox->combineType) = a.yType;
    stamp(st, round, &TraceRound::combReady);
    // The release store orders combineType (and lastBlock's fences every block's rows) before the flag.
    stReleaseSys(&st.mailbox->combineReady, round + 1);
  });
}

// ---- Combine receive ---------------------------------------------------------------------------------------------

// Conversions are core/dtype_convert.hpp's, the reference's own: the same rounding (nearest even) and NaN bits.
template <int kType>
__device__ __forceinline__ float toFloat(const uint8_t* p) {
  if (kType == kTypeBf16) return bf16ToFloat(ldVolatileU16(p));
  if (kType == kTypeF16) return f16ToFloat(ldVolatileU16(p));
  return bitsFloat(ldVolatileU32(p));
}
template <int kType>
__device__ __forceinline__ float loadOut(const uint8_t* p) {
  if (kType == kTypeBf16) return bf16ToFloat(*reinterpret_cast<const uint16_t*>(p));
  if (kType == kTypeF16) return f16ToFloat(*reinterpret_cast<const uint16_t*>(p));
  return *reinterpret_cast<const float*>(p);
}
template <int kType>
__device__ __forceinline__ void storeOut(uint8_t* p, float v) {
  if (kType == kTypeBf16) {
    *reinterpret_cast<uint16_t*>(p) = floatToBf16(v);
  } else if (kType == kTypeF16) {
    *reinterpret_cast<uint16_t*>(p) = floatToF16(v);
  } else {
    *reinterpret_cast<float*>(p) = v;
  }
}
template <int kType>
__host__ __device__ constexpr uint32_t itemOf() {
  return kType == kTypeF32 ? 4 : 2;
}

// Elements of expertY one thread reads with one 16-byte load.
template <int kY>
__device__ __forceinline__ void unpack16(const int4 v, float* f) {
  const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                         static_cast<uint32_t>(v.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (kY == kTypeF32) {
      f[i] = bitsFloat(w[i]);
    } else {
      const uint16_t lo = static_cast<uint16_t>(w[i] & 0xffff), hi = static_cast<uint16_t>(w[i] >> 16);
      f[2 * i] = kY == kTypeBf16 ? bf16ToFloat(lo) : f16ToFloat(lo);
      f[2 * i + 1] = kY == kTypeBf16 ? bf16ToFloat(hi) : f16ToFloat(hi);
    }
  }
}

// Many blocks: waits for the proxy's arrival word (and the node owners' flags); then for each token t < bound (one
// block per slice of the row at a time) and each element, out = (accumulate ? out : 0) + sum_k w[t,k] * y(t,k) in fp32,
// k ascending, each product and sum rounded separately (no FMA: the reference's operations), rounded once to the output
// type. y(t,k) is the row of (t, k) in its owner's message: rowBase[d][e] (the owner's rows of e from the group's
// senders before d) + the row the dispatch gave (t, k) among its sender's rows of e (the route kernel's pos). Elastic
// ranks: a position whose token's sender or expert's rank is masked (the round's tables) has no term and is counted as
// dropped.
constexpr uint32_t kTermBatch = 8;

template <int kY, int kOut>
__global__ void __launch_bounds__(kSumThreads) combineRecvKernel(const CombineRecvArgs a) {
  const DeviceState& st = a.st;
  extern __shared__ uint32_t smem[];  // rowBase[D * E], recvStart[W], then K term pointers and weights
  const proxy::ProtocolSizes& s = a.sizes;
  const TableGeometry& tg = a.tg;
  const uint32_t K = s.expertsPerToken, E = s.numExperts, L = s.numLocalExperts, W = s.worldSize, D = s.dpSize;
  const uint32_t me = s.rank;
  __shared__ int ok;
  const uint32_t round = *seqWord(st, kSeqCombineRecv);
  if (threadIdx.x == 0) {
    ok = !deviceHalted(st) &&
         waitArrival(st, 1, &st.mailbox->combineArrived, round + 1, kPhaseCombineArrival, static_cast<int32_t>(me));
    if (!ok) haltObject(st);
    if (ok && blockIdx.x == 0) stamp(st, round, &TraceRound::sumStart);
  }
  __syncthreads();
  if (!ok) return;
  uint32_t* rowBase = smem;
  uint32_t* recvStart = rowBase + D * E;
  const uint8_t** termRow = reinterpret_cast<const uint8_t**>((reinterpret_cast<uintptr_t>(recvStart + W + 1) + 7) &
                                                              ~static_cast<uintptr_t>(7));
  float* termW = reinterpret_cast<float*>(termRow + K);
  const uint32_t* tables = deviceTables(st);
  for (uint32_t i = threadIdx.x; i < D * E; i += blockDim.x) rowBase[i] = tables[tg.offRowBase + i];
  for (uint32_t i = threadIdx.x; i < W; i += blockDim.x) recvStart[i] = tables[tg.offRecvStart + i];
  __syncthreads();
  const uint64_t* pos = reinterpret_cast<const uint64_t*>(st.scratch + st.sg.offPos);
  const uint32_t* masked = maskedWords(st, tg);  // elastic ranks: this round's mask
  const bool anyMasked = masked[0] != 0;
  const uint32_t H = a.hidden;
  const uint64_t rowBytes = static_cast<uint64_t>(H) * itemOf<kY>();
  const uint32_t bound = effectiveBound(a.boundM, a.m);
  constexpr uint32_t kVec = 16 / itemOf<kY>();
  const bool vec = rowBytes % 16 == 0;
  auto load = [&](uint32_t t, uint32_t k) {
    return decodeIndex(a.indices, a.indexKind,
                       static_cast<int64_t>(t) * a.indexStrides[0] + static_cast<int64_t>(k) * a.indexStrides[1]);
  };
  // Work items (token, slice of the row): a slice is what the block sums with one 16-byte load per thread and term,
  // so a small round spreads over many blocks and every block's loads of a slice are in flight together.
  const uint32_t sliceElems = vec ? blockDim.x * kVec : H;
  const uint32_t slices = (H + sliceElems - 1) / sliceElems;
  for (uint64_t item = blockIdx.x; item < static_cast<uint64_t>(bound) * slices; item += gridDim.x) {
    const uint32_t t = static_cast<uint32_t>(item / slices);
    const uint32_t h0Begin = static_cast<uint32_t>(item % slices) * sliceElems;
    const uint32_t h0End = min(H, h0Begin + sliceElems);
    for (uint32_t k = threadIdx.x; k < K; k += blockDim.x) {
      const uint8_t* rowPtr = nullptr;
      int64_t e = load(t, k);
      if (e < -1 || e >= static_cast<int64_t>(E)) {
        recordError(st, kPhaseCombineBadIndex, static_cast<int32_t>(me), -1, t,
                    (static_cast<int64_t>(k) << 32) | static_cast<uint32_t>(static_cast<int32_t>(e)), false);
        e = -1;
      }
      if (e >= 0 && anyMasked && droppedByMask(masked, me / D, t, D, static_cast<uint32_t>(e), L)) {
        // Elastic ranks: left out of the sum (the other weights stay as they are), counted once per position.
        if (h0Begin == 0) atomicAdd(reinterpret_cast<unsigned long long*>(st.scratch + st.sg.offDropped), 1ull);
        e = -1;
      }
      if (e >= 0) {
        uint32_t first = k;  // a repeated expert's row is its first position's
        for (uint32_t j = 0; j < k; ++j) {
          if (load(t, j) == e) {
            first = j;
            break;
          }
        }
        const uint64_t v = pos[static_cast<uint64_t>(t) * K + first];
        if ((v >> 32) != static_cast<uint64_t>(e + 1)) {
          recordError(st, kPhaseCombineIndex, static_cast<int32_t>(me), -1, t,
                      (static_cast<int64_t>(k) << 32) | static_cast<uint32_t>(e), false);
        } else {
          const uint32_t owner = static_cast<uint32_t>(e) / L;
          const uint64_t row = recvStart[owner] + rowBase[(t % D) * E + e] + static_cast<uint32_t>(v);
          // A node owner's rows (this rank's own too, when the NVLink path is on) are in this rank's region; without
          // it, this rank's own rows are in the scratch (recvStart[me] = 0), device memory either way.
          rowPtr = (st.lg.has(owner) ? st.localMine + st.lg.offRows
                                     : (owner == me ? st.scratch + st.sg.offOwnRows : a.ch.combineRecv)) +
                   row * rowBytes;
        }
      }
      termRow[k] = rowPtr;
      termW[k] =
          rowPtr != nullptr
              ? a.weights[static_cast<int64_t>(t) * a.weightStrides[0] + static_cast<int64_t>(k) * a.weightStrides[1]]
              : 0.f;
    }
    __syncthreads();
    uint8_t* out = a.out + static_cast<int64_t>(t) * a.outRowStride * itemOf<kOut>();
    if (vec) {
      for (uint32_t h0 = h0Begin + threadIdx.x * kVec; h0 < h0End; h0 += blockDim.x * kVec) {
        float acc[kVec];
#pragma unroll
        for (uint32_t i = 0; i < kVec; ++i)
          acc[i] = a.accumulate ? loadOut<kOut>(out + (h0 + i) * itemOf<kOut>()) : 0.f;
        // kTermBatch terms' loads in flight at once (host memory is a PCIe round trip away), then their sums in k
        // order.
        for (uint32_t k0 = 0; k0 < K; k0 += kTermBatch) {
          int4 v[kTermBatch];
#pragma unroll
          for (uint32_t j = 0; j < kTermBatch; ++j) {
            const uint8_t* y = k0 + j < K ? termRow[k0 + j] : nullptr;
            if (y != nullptr) v[j] = ldVolatile16(y + static_cast<uint64_t>(h0) * itemOf<kY>());
          }
#pragma unroll
          for (uint32_t j = 0; j < kTermBatch; ++j) {
            if (k0 + j >= K || termRow[k0 + j] == nullptr) continue;
            float f[kVec];
            unpack16<kY>(v[j], f);
            const float wk = termW[k0 + j];
#pragma unroll
            for (uint32_t i = 0; i < kVec; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(wk, f[i]));
          }
        }
#pragma unroll
        for (uint32_t i = 0; i < kVec; ++i) storeOut<kOut>(out + (h0 + i) * itemOf<kOut>(), acc[i]);
      }
    } else {
      for (uint32_t h = threadIdx.x; h < H; h += blockDim.x) {
        float acc = a.accumulate ? loadOut<kOut>(out + h * itemOf<kOut>()) : 0.f;
        for (uint32_t k = 0; k < K; ++k) {
          const uint8_t* y = termRow[k];
          if (y == nullptr) continue;
          acc = __fadd_rn(acc, __fmul_rn(termW[k], toFloat<kY>(y + static_cast<uint64_t>(h) * itemOf<kY>())));
        }
        storeOut<kOut>(out + h * itemOf<kOut>(), acc);
      }
    }
    __syncthreads();
  }
  lastBlock(st, kSeqCombineRecv, [&] {
    *seqWord(st, kSeqCombineRecv) = round + 1;
    if (anyMasked) {
      // Every block's drops are in (lastBlock's fences): the total for droppedTokens.
      *reinterpret_cast<volatile unsigned long long*>(&st.mailbox->dropped) =
          atomicAdd(reinterpret_cast<unsigned long long*>(st.scratch + st.sg.offDropped), 0ull);
    }
    stamp(st, round, &TraceRound::sumEnd);
  });
}

}  // namespace
}  // namespace gpuproxy
}  // namespace epcomm
