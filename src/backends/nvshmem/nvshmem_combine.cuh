// The nvshmem combine: the send half puts this rank's router weights to every rank, then forms per received record
// and piece of the hidden dimension the fp32 sum over its local experts of w x y and puts it to the token's DP group
// with its own signal; the receive half adds the partials of each (token, piece) in ascending rank order and rounds
// once. Part of nvshmem_kernels.cu's translation unit: include it only there.
#pragma once

#include "backends/nvshmem/nvshmem_device.cuh"

namespace epcomm {
namespace nvshmem {
namespace {

// Puts this rank's router weights of every token it dispatched into rank d (slot order), signal SET to the round, from
// d's own staging copy. Every rank gets them, tokens or not: the signal is also this rank's "I entered the combine"
// (see combineSendPhase). One block.
__device__ void putWeights(const CombineKernelArgs& a, uint32_t d) {
  const Geometry& g = a.g;
  const uint32_t K = g.topK, D = g.dpSize, Ts = g.slotsPerSender;
  uint64_t* seq = seqOf(a.st, g, kWeights);
  const uint64_t round = seq[d] + 1;
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
    putSignalBlock(dst, stage, static_cast<size_t>(n) * K * 4, sig, round, static_cast<int>(d));
  } else if (threadIdx.x == 0) {
    signalSet(sig, round, static_cast<int>(d));
  }
  __syncthreads();
  if (threadIdx.x == 0) seq[d] = round;
}

// Combine-send work unit, one warp: piece p (elements [p x kPieceElems, ...) of H) of received record c of sender s.
// acc = sum over the record's entries k on this rank, k ascending, of w[k] x y[row(k)] in fp32 (a repeated expert's
// entries share a row, each with its own weight); stored into the record's staging partial, then put to every rank of
// the token's DP group, signal (this rank, token, piece) SET to the round. The unit's slice of each row is prefetched
// into L2 first, then each row's kCombineVectors loads per lane are issued together: the rows are summed one after
// the other, and without the prefetch each would start with a memory latency.
template <int kY>
__device__ void combinePiece(const CombineKernelArgs& a, uint32_t s, uint32_t c, uint32_t p, uint64_t round) {
  const Geometry& g = a.g;
  const uint32_t K = g.topK, Ts = g.slotsPerSender, D = g.dpSize, T = g.maxTokens, H = g.hiddenDim;
  const uint32_t lane = threadIdx.x % 32;
  const char* rec = a.st.sym + g.offDispRecv + static_cast<uint64_t>(s) * g.regionBytes + recordOffset(g, c);
  const uint32_t j = reinterpret_cast<const uint32_t*>(rec + g.metaOffset)[kMetaSlot];
  const uint32_t t = j * D + s % D;
  const int2* rows = reinterpret_cast<const int2*>(a.st.scratch + g.offRows) + (static_cast<uint64_t>(s) * Ts + c) * K;
  const float* w = reinterpret_cast<const float*>(a.st.sym + g.offWeightRecv) + (static_cast<uint64_t>(s) * Ts + j) * K;
  const uint32_t h0 = p * kPieceElems, elems = min(kPieceElems, H - h0);
  const uint32_t sliceBytes = (elems * elemBytes<kY>()) & ~15u;
  // Entries k = lane and lane + 32 (K <= 64): element offset of the row's piece and the weight.
  int64_t yOff[2] = {-1, -1};
  float wk[2] = {0.f, 0.f};
  uint32_t valid[2];
#pragma unroll
  for (uint32_t h = 0; h < 2; ++h) {
    const uint32_t k = h * 32 + lane;
    if (k < K) {
      const int2 r = rows[k];
      if (r.x >= 0) {
        yOff[h] = static_cast<int64_t>(r.x) * a.yExpertStride + static_cast<int64_t>(r.y) * a.yRowStride + h0;
        wk[h] = w[k];
        if (sliceBytes > 0) device::prefetchL2(a.y + yOff[h] * elemBytes<kY>(), sliceBytes);
      }
    }
    valid[h] = __ballot_sync(kFullMask, yOff[h] >= 0);
  }
  float acc[kCombineVectors][4];
#pragma unroll
  for (uint32_t u = 0; u < kCombineVectors; ++u) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[u][i] = 0.f;
  }
  // Lane's elements of vector u: [h0 + e(u), +4), e(u) = (u x 32 + lane) x 4; lanes past H skip memory accesses only.
#pragma unroll
  for (uint32_t h = 0; h < 2; ++h) {
    for (uint32_t m = valid[h]; m != 0; m &= m - 1) {
      const int b = __ffs(m) - 1;
      const uint8_t* row = a.y + __shfl_sync(kFullMask, yOff[h], b) * elemBytes<kY>();
      const float wv = __shfl_sync(kFullMask, wk[h], b);
      float yv[kCombineVectors][4];
#pragma unroll
      for (uint32_t u = 0; u < kCombineVectors; ++u) {
        const uint32_t e = (u * 32 + lane) * 4;
        if (e < elems) load4<kY, true>(row + static_cast<uint64_t>(e) * elemBytes<kY>(), yv[u]);
      }
#pragma unroll
      for (uint32_t u = 0; u < kCombineVectors; ++u) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[u][i] = fmaf(wv, yv[u][i], acc[u][i]);
      }
    }
  }
  float* partial = reinterpret_cast<float*>(a.st.sym + g.offCombStage) + (static_cast<uint64_t>(s) * Ts + c) * H + h0;
#pragma unroll
  for (uint32_t u = 0; u < kCombineVectors; ++u) {
    const uint32_t e = (u * 32 + lane) * 4;
    if (e < elems) store4<kTypeF32>(partial + e, acc[u]);
  }
  __syncwarp();
  float* dst = reinterpret_cast<float*>(a.st.sym + g.offCombRecv) + (static_cast<uint64_t>(g.rank) * T + t) * H + h0;
  uint64_t* sig =
      reinterpret_cast<uint64_t*>(a.st.sym + g.offCombSig) + (static_cast<uint64_t>(g.rank) * T + t) * g.pieces + p;
  const uint32_t first = (s / D) * D;
  for (uint32_t r = first; r < first + D; ++r) {
    if (liveRank(a.st, r)) putSignalWarp(dst, partial, static_cast<size_t>(elems) * 4, sig, round, static_cast<int>(r));
  }
}

// Combine-send phase of block `block` < sendBlocks (of the phase). First the weights of destinations rank + block,
// rank + block + sendBlocks, ... (mod W; no wait before them, so every block's share goes out whatever the others do,
// and this rank's own, which every block waits for, come from block 0); then it waits for every rank's weights (so
// every rank finished its last combine-recv: its partial buffers are free, and every put of the round into this rank
// has landed before its doneSig below), then one warp per (record, piece) unit. The last block to finish SETs doneSig
// on every rank: this rank no longer reads what they sent it this round. Masked ranks (DeviceState::live) are skipped
// throughout: no weights, partials or doneSig go to them, and no wait is for them.
template <int kY>
__device__ void combineSendPhase(const CombineKernelArgs& a, uint32_t block, uint32_t* prefix) {
  const Geometry& g = a.g;
  const uint32_t W = g.worldSize, B = g.sendBlocks, P = g.pieces;
  for (uint32_t i = block; i < W; i += B) {
    if (liveRank(a.st, (g.rank + i) % W)) putWeights(a, (g.rank + i) % W);
  }
  uint64_t* seq = seqOf(a.st, g, kCombineSend);
  const uint64_t round = seq[block] + 1;
  const uint64_t* wsig = reinterpret_cast<const uint64_t*>(a.st.sym + g.offWeightSig);
  bool ok = true;
  for (uint32_t s = threadIdx.x; s < W && ok; s += blockDim.x) {
    if (liveRank(a.st, s)) ok = waitFor(wsig + s, round, a.st, g, kPhaseCombineWeights, s, -1);
  }
  if (__syncthreads_and(ok ? 1 : 0) != 0) {
    if (threadIdx.x < 32) senderPrefix(a.st.sym + g.offDispRecv, g, prefix);
    __syncthreads();
    const uint32_t units = prefix[W] * P;
    for (uint32_t wu = (threadIdx.x / 32) * B + block; wu < units; wu += B * (blockDim.x / 32)) {
      const uint32_t i = wu / P, s = senderOf(prefix, W, i);
      combinePiece<kY>(a, s, i - prefix[s], wu % P, round);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t* words = wordsOf(a.st, g);
    __threadfence();
    const uint64_t before = atomicAdd(reinterpret_cast<unsigned long long*>(&words[kWordCombineSendDone]), 1ull);
    if (before + 1 == round * B) {
      uint64_t* done = reinterpret_cast<uint64_t*>(a.st.sym + g.offDoneSig) + g.rank;
      for (uint32_t d = 0; d < W; ++d) {
        if (liveRank(a.st, d)) signalSet(done, round, static_cast<int>(d));
      }
    }
    seq[block] = round;
  }
}

// Combine-recv work unit, one warp: piece p of token t. The distinct ranks owning the token's experts, ascending
// (lane q holds the q-th in mine[0], the (32 + q)-th in mine[1]); lane q waits for its rank's signal of (t, p); after
// the warp barrier every lane reads the partials (acquire + barrier cumulativity) and adds them in that order to
// `accumulate ? out : 0` in fp32, rounded once into the output type. False when a wait failed (recorded).
template <int kOut>
__device__ bool combineRecvPiece(const CombineKernelArgs& a, uint32_t t, uint32_t p, uint64_t round) {
  const Geometry& g = a.g;
  const uint32_t K = g.topK, T = g.maxTokens, H = g.hiddenDim, E = g.numExperts, P = g.pieces;
  const uint32_t lane = threadIdx.x % 32;
  constexpr uint32_t kNone = 0xffffffffu;
  uint32_t owner[2] = {kNone, kNone};
#pragma unroll
  for (uint32_t h = 0; h < 2; ++h) {
    const uint32_t k = h * 32 + lane;
    if (k < K) {
      const int64_t e =
          decodeIndex(a.indices, a.indexKind, static_cast<int64_t>(t) * a.indexStrides[0] + k * a.indexStrides[1]);
      if (e < -1 || e >= static_cast<int64_t>(E)) {
        recordBadIndex(a.st, g, kPhaseBadIndexCombine, t, k, e);
      } else if (e >= 0) {
        owner[h] = static_cast<uint32_t>(e) / g.numLocalExperts;
      }
    }
  }
  uint32_t mine[2] = {kNone, kNone}, count = 0;
  for (;;) {
    const uint32_t o = __reduce_min_sync(kFullMask, min(owner[0], owner[1]));
    if (o == kNone) break;
    if (count < 32) {
      if (lane == count) mine[0] = o;
    } else if (lane == count - 32) {
      mine[1] = o;
    }
    if (owner[0] == o) owner[0] = kNone;
    if (owner[1] == o) owner[1] = kNone;
    ++count;
  }
  const uint64_t* combSig = reinterpret_cast<const uint64_t*>(a.st.sym + g.offCombSig);
  bool ok = true;
#pragma unroll
  for (uint32_t h = 0; h < 2; ++h) {
    if (h * 32 + lane < count && ok) {
      ok = waitFor(combSig + (static_cast<uint64_t>(mine[h]) * T + t) * P + p, round, a.st, g, kPhaseCombineRecv,
                   mine[h], t);
    }
  }
  if (!__all_sync(kFullMask, ok)) return false;
  __syncwarp();
  const uint32_t h0 = p * kPieceElems, elems = min(kPieceElems, H - h0);
  uint8_t* row = a.out + (static_cast<int64_t>(t) * a.outRowStride + h0) * elemBytes<kOut>();
  float acc[kCombineVectors][4];
#pragma unroll
  for (uint32_t u = 0; u < kCombineVectors; ++u) {
    const uint32_t e = (u * 32 + lane) * 4;
    if (a.accumulate && e < elems) {
      load4<kOut, false>(row + static_cast<uint64_t>(e) * elemBytes<kOut>(), acc[u]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[u][i] = 0.f;
    }
  }
  const float* combRecv = reinterpret_cast<const float*>(a.st.sym + g.offCombRecv);
  auto partialOf = [&](uint32_t q) {
    const uint32_t o = __shfl_sync(kFullMask, q < 32 ? mine[0] : mine[1], q % 32);
    return combRecv + (static_cast<uint64_t>(o) * T + t) * H + h0;
  };
  // Two ranks' partials per step (2 x kCombineVectors loads in flight per lane), added in rank order.
  for (uint32_t q = 0; q < count; q += 2) {
    const bool two = q + 1 < count;
    const float* p1 = partialOf(q);
    const float* p2 = partialOf(two ? q + 1 : q);
    float r1[kCombineVectors][4], r2[kCombineVectors][4];
#pragma unroll
    for (uint32_t u = 0; u < kCombineVectors; ++u) {
      const uint32_t e = (u * 32 + lane) * 4;
      if (e < elems) {
        load4<kTypeF32, true>(p1 + e, r1[u]);
        if (two) load4<kTypeF32, true>(p2 + e, r2[u]);
      }
    }
#pragma unroll
    for (uint32_t u = 0; u < kCombineVectors; ++u) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[u][i] += r1[u][i];
    }
    if (two) {
#pragma unroll
      for (uint32_t u = 0; u < kCombineVectors; ++u) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[u][i] += r2[u][i];
      }
    }
  }
#pragma unroll
  for (uint32_t u = 0; u < kCombineVectors; ++u) {
    const uint32_t e = (u * 32 + lane) * 4;
    if (e < elems) store4<kOut>(row + static_cast<uint64_t>(e) * elemBytes<kOut>(), acc[u]);
  }
  return true;
}

// Combine-recv phase of block `block` < combineBlocks (of the phase): one warp per (token, piece) unit of the tokens t
// < boundM (rows >= boundM are not written), then the round's barrier: every expert rank's doneSig (it finished reading
// what this rank sent it, records and weights, so the next dispatch may overwrite them). The barrier comes last so that
// the sums overlap the peers' last partials; the kernel ends only after it.
template <int kOut>
__device__ void combineRecvPhase(const CombineKernelArgs& a, uint32_t block) {
  const Geometry& g = a.g;
  const uint32_t W = g.worldSize, B = g.combineBlocks, P = g.pieces;
  uint64_t* seq = seqOf(a.st, g, kCombineRecv);
  const uint64_t round = seq[block] + 1;
  const uint32_t units = boundedM(a.m, a.boundM) * P;
  for (uint32_t wu = (threadIdx.x / 32) * B + block; wu < units; wu += B * (blockDim.x / 32)) {
    if (!combineRecvPiece<kOut>(a, wu / P, wu % P, round)) break;
  }
  const uint64_t* done = reinterpret_cast<const uint64_t*>(a.st.sym + g.offDoneSig);
  bool ok = true;
  for (uint32_t d = threadIdx.x; d < W && ok; d += blockDim.x) {
    if (liveRank(a.st, d)) ok = waitFor(done + d, round, a.st, g, kPhaseCombineDone, d, -1);
  }
  __syncthreads();
  if (threadIdx.x == 0) seq[block] = round;
}

}  // namespace
}  // namespace nvshmem
}  // namespace epcomm
