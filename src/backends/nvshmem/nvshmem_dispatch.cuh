// The nvshmem dispatch: the send half's pack-and-put units (each ranks this rank's tokens for its destination, packs
// its chunk of that destination's records and puts it with a signal) and the receive half (row tables from the
// headers, then every record copied into its experts' rows). Part of nvshmem_kernels.cu's translation unit: include it
// only there.
#pragma once

#include "backends/nvshmem/nvshmem_device.cuh"

namespace epcomm {
namespace nvshmem {
namespace {

// Copies the payload and scales of records [lo, hi) of a region (their slots in slots[i - lo]) from x and xScale, the
// block's threads over all their 16-byte vectors with kCopyVectors loads in flight per thread (decode's one record per
// destination is 448 vectors: two per thread instead of 14 loads one after the other in one warp).
__device__ void packPayloads(const DispatchKernelArgs& a, char* region, const uint32_t* slots, uint32_t lo,
                             uint32_t hi) {
  const Geometry& g = a.g;
  const uint32_t vecs = g.hiddenBytes / 16, words = g.scaleBytes / 4, D = g.dpSize;
  const uint32_t total = (hi - lo) * vecs;
  auto token = [&](uint32_t r) { return static_cast<int64_t>(slots[r]) * D + g.rank % D; };
  for (uint32_t v0 = threadIdx.x; v0 < total; v0 += kCopyVectors * blockDim.x) {
    int4 buf[kCopyVectors];
#pragma unroll
    for (uint32_t u = 0; u < kCopyVectors; ++u) {
      const uint32_t v = v0 + u * blockDim.x;
      if (v < total) buf[u] = ld16(a.x + token(v / vecs) * a.xRowStrideBytes + 16ull * (v % vecs));
    }
#pragma unroll
    for (uint32_t u = 0; u < kCopyVectors; ++u) {
      const uint32_t v = v0 + u * blockDim.x;
      if (v < total) st16(region + recordOffset(g, lo + v / vecs) + 16ull * (v % vecs), buf[u]);
    }
  }
  for (uint32_t v = threadIdx.x; v < (hi - lo) * words; v += blockDim.x) {
    const uint32_t r = v / words, w = v % words;
    const uint32_t word = *reinterpret_cast<const uint32_t*>(a.xScale + token(r) * a.xScaleStrideBytes[0] +
                                                             static_cast<int64_t>(w) * a.xScaleStrideBytes[1]);
    reinterpret_cast<uint32_t*>(region + recordOffset(g, lo + r) + g.hiddenBytes)[w] = word;
  }
}

// Pack-and-put unit (d, c) = (unit / C, unit % C), one block; never waits. It ranks this rank's tokens (slot j, token
// t = j * D + rank % D) for destination d: per token whether any of its experts lives on d (then it is one of d's
// records, in token order) and, per local expert of d, the token's position among this rank's tokens for that expert.
// Tokens go in passes of one per thread; per warp and key (d's L local experts, then "goes to d") a bit per lane, then
// the counts of the earlier warps and passes give every position without atomics on counters, so the order is the
// token order. Every unit of d computes the same ranking (no scratch shared between blocks, no second kernel); a unit
// stops once its chunk of records is known, chunk 0 ranks every token (its header carries the counts). The thread of a
// record in the chunk writes its metadata, then the block copies the chunk's payloads and puts [header +] the chunk
// into d's region for this rank, signal SET to the round. An empty chunk only signals.
__device__ void packPutUnit(const DispatchKernelArgs& a, uint32_t unit, uint32_t* sm) {
  const Geometry& g = a.g;
  const uint32_t L = g.numLocalExperts, K = g.topK, D = g.dpSize, E = g.numExperts;
  const uint32_t keys = L + 1, warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const uint32_t d = unit / g.chunks, c = unit % g.chunks;
  uint32_t* bits = sm;                      // [warps][keys]
  uint32_t* base = bits + warps * keys;     // [warps][keys]
  uint32_t* running = base + warps * keys;  // [keys]
  uint32_t* slots = running + keys;         // [chunkRecords]
  uint64_t* seq = seqOf(a.st, g, kPackPut);
  const uint64_t round = seq[unit] + 1;
  char* region = a.st.sym + g.offDispStage + static_cast<uint64_t>(d) * g.regionBytes;
  const uint32_t n = numTokensSentBy(g.rank, boundedM(a.m, a.boundM), D);
  if (unit == 0 && threadIdx.x == 0) wordsOf(a.st, g)[kWordSent] = n;
  if (!liveRank(a.st, d)) {
    // A masked destination gets nothing (its positions were dropped from the indices) and waits for nothing.
    if (threadIdx.x == 0) seq[unit] = round;
    return;
  }
  const uint32_t lo = c * g.chunkRecords, hiMax = lo + g.chunkRecords;
  for (uint32_t i = threadIdx.x; i < keys; i += blockDim.x) running[i] = 0;
  __syncthreads();
  for (uint32_t first = 0; first < n; first += blockDim.x) {
    for (uint32_t i = threadIdx.x; i < warps * keys; i += blockDim.x) bits[i] = 0;
    __syncthreads();
    const uint32_t j = first + threadIdx.x;
    const int64_t t = static_cast<int64_t>(j) * D + g.rank % D;
    auto load = [&](uint32_t k) {
      return decodeIndex(a.indices, a.indexKind, t * a.indexStrides[0] + static_cast<int64_t>(k) * a.indexStrides[1]);
    };
    uint64_t here = 0, dup = 0;  // positions k whose expert is on d; those that repeat an earlier k
    if (j < n) {
      for (uint32_t k = 0; k < K; ++k) {
        const int64_t e = load(k);
        if (e < -1 || e >= static_cast<int64_t>(E)) {
          recordBadIndex(a.st, g, kPhaseBadIndex, t, k, e);
          continue;
        }
        if (e < 0 || static_cast<uint32_t>(e) / L != d) continue;
        here |= 1ull << k;
        if (isRepeatOfEarlier(load, k, e)) {
          dup |= 1ull << k;
        } else {
          atomicOr(&bits[warp * keys + static_cast<uint32_t>(e) % L], 1u << lane);
        }
      }
      if (here != 0) atomicOr(&bits[warp * keys + L], 1u << lane);
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
    if (here != 0) {
      const uint32_t lt = laneMaskLt();
      const uint32_t i = base[warp * keys + L] + __popc(bits[warp * keys + L] & lt);
      if (i >= lo && i < hiMax) {
        slots[i - lo] = j;
        uint32_t* meta = reinterpret_cast<uint32_t*>(region + recordOffset(g, i) + g.metaOffset);
        meta[kMetaSlot] = j;
        int32_t* entries = reinterpret_cast<int32_t*>(meta + kMetaEntries);
        for (uint32_t k = 0; k < K; ++k) {
          int32_t le = -1, pos = 0;
          if ((here >> k) & 1ull) {
            le = static_cast<int32_t>(static_cast<uint32_t>(load(k)) % L);
            const uint32_t key = warp * keys + static_cast<uint32_t>(le);
            // A repeat has the position of the expert's first occurrence: the same lane's bit, set by that one.
            pos = static_cast<int32_t>(base[key] + __popc(bits[key] & lt));
            if ((dup >> k) & 1ull) le |= kDupBit;
          }
          entries[2 * k] = le;
          entries[2 * k + 1] = pos;
        }
      }
    }
    __syncthreads();
    // Block-uniform: running[] is only written by the next pass's scan, after its barrier.
    if (c > 0 && running[L] >= hiMax) break;
  }
  // Chunk 0 ranked every token: running[] holds d's record count and its tokens per local expert. Another chunk may
  // have stopped early, with running[L] >= hiMax.
  const uint32_t records = running[L];
  const uint32_t hi = min(hiMax, records), from = min(lo, hi);
  if (c == 0) {
    uint32_t* header = headerOf(a.st.sym + g.offDispStage, g, d);
    for (uint32_t le = threadIdx.x; le < L; le += blockDim.x) header[kHeaderCounts + le] = running[le];
    if (threadIdx.x == 0) header[kHeaderRecords] = records;
  }
  packPayloads(a, region, slots, from, hi);
  __syncthreads();
  const uint64_t begin = c == 0 ? 0 : recordOffset(g, from);
  const uint64_t end = hi > from ? recordOffset(g, hi) : (c == 0 ? g.headerBytes : begin);
  uint64_t* sig = reinterpret_cast<uint64_t*>(a.st.sym + g.offDispSig) + g.rank * g.chunks + c;
  char* dst = a.st.sym + g.offDispRecv + static_cast<uint64_t>(g.rank) * g.regionBytes;
  if (end > begin) {
    putSignalBlock(dst + begin, region + begin, end - begin, sig, round, static_cast<int>(d));
  } else if (threadIdx.x == 0) {
    signalSet(sig, round, static_cast<int>(d));
  }
  __syncthreads();
  if (threadIdx.x == 0) seq[unit] = round;
}

// Dispatch-recv work unit: piece p of received record c of sender s. The piece's vectors are loaded together, then
// stored into each of the record's local experts' rows (rows by (sender, token), the reference's order); piece 0
// notes the rows of all K entries for the combine, the last piece copies the scales.
__device__ void expandPiece(const DispatchKernelArgs& a, const uint32_t* rowBase, const uint32_t* expertBase,
                            uint32_t s, uint32_t c, uint32_t p) {
  const Geometry& g = a.g;
  const uint32_t L = g.numLocalExperts, K = g.topK, Ts = g.slotsPerSender;
  const uint32_t lane = threadIdx.x % 32, vecs = g.hiddenBytes / 16, words = g.scaleBytes / 4;
  const char* rec = a.st.sym + g.offDispRecv + static_cast<uint64_t>(s) * g.regionBytes + recordOffset(g, c);
  const int32_t* entries = reinterpret_cast<const int32_t*>(rec + g.metaOffset) + kMetaEntries;
  int2* recRows = reinterpret_cast<int2*>(a.st.scratch + g.offRows) + (static_cast<uint64_t>(s) * Ts + c) * K;
  // Entries k = lane and lane + 32 (K <= 64): the byte offsets of the rows they write (a repeat writes none).
  int64_t rowOff[2] = {-1, -1}, scaleOff[2] = {0, 0};
  uint32_t writes[2];
#pragma unroll
  for (uint32_t h = 0; h < 2; ++h) {
    const uint32_t k = h * 32 + lane;
    if (k < K) {
      const int32_t e = entries[2 * k];
      int2 r = make_int2(-1, 0);
      if (e >= 0) {
        const uint32_t le = static_cast<uint32_t>(e & ~kDupBit);
        const uint32_t row = expertBase[le] + rowBase[s * L + le] + static_cast<uint32_t>(entries[2 * k + 1]);
        r = make_int2(static_cast<int32_t>(le), static_cast<int32_t>(row));
        if ((e & kDupBit) == 0) {
          rowOff[h] =
              static_cast<int64_t>(le) * a.outExpertStrideBytes + static_cast<int64_t>(row) * a.outRowStrideBytes;
          scaleOff[h] = static_cast<int64_t>(le) * a.outScaleStrideBytes[0] +
                        static_cast<int64_t>(row) * a.outScaleStrideBytes[1];
        }
      }
      if (p == 0) recRows[k] = r;
    }
    writes[h] = __ballot_sync(kFullMask, rowOff[h] >= 0);
  }
  const uint32_t v0 = p * 32 * kCopyVectors + lane;
  int4 buf[kCopyVectors];
#pragma unroll
  for (uint32_t u = 0; u < kCopyVectors; ++u) {
    const uint32_t v = v0 + u * 32;
    if (v < vecs) buf[u] = ld16(rec + 16ull * v);
  }
#pragma unroll
  for (uint32_t h = 0; h < 2; ++h) {
    for (uint32_t m = writes[h]; m != 0; m &= m - 1) {
      uint8_t* dst = a.outX + __shfl_sync(kFullMask, rowOff[h], __ffs(m) - 1);
#pragma unroll
      for (uint32_t u = 0; u < kCopyVectors; ++u) {
        const uint32_t v = v0 + u * 32;
        if (v < vecs) st16(dst + 16ull * v, buf[u]);
      }
    }
  }
  if (p == g.copyPieces - 1 && words > 0) {
    const uint32_t* scales = reinterpret_cast<const uint32_t*>(rec + g.hiddenBytes);
#pragma unroll
    for (uint32_t h = 0; h < 2; ++h) {
      for (uint32_t m = writes[h]; m != 0; m &= m - 1) {
        uint8_t* dst = a.outScale + __shfl_sync(kFullMask, scaleOff[h], __ffs(m) - 1);
        for (uint32_t w = lane; w < words; w += 32) {
          *reinterpret_cast<uint32_t*>(dst + static_cast<int64_t>(w) * a.outScaleStrideBytes[2]) = scales[w];
        }
      }
    }
  }
}

// Dispatch-recv phase of block `block` < recvBlocks (of the phase): waits for every chunk of every sender (the row
// tables need every header, and a round's signals must all have been seen before the combine's barrier lets the senders
// reuse them), builds the row tables, then one warp per (record, piece) unit.
__device__ void dispatchRecvPhase(const DispatchKernelArgs& a, uint32_t block, uint32_t* sm) {
  const Geometry& g = a.g;
  const uint32_t W = g.worldSize, L = g.numLocalExperts, C = g.chunks, B = g.recvBlocks, P = g.copyPieces;
  uint32_t* rowBase = sm;
  uint32_t* expertBase = rowBase + W * L;
  uint32_t* prefix = expertBase + L;
  uint64_t* seq = seqOf(a.st, g, kDispatchRecv);
  const uint64_t round = seq[block] + 1;
  const uint64_t* sig = reinterpret_cast<const uint64_t*>(a.st.sym + g.offDispSig);
  bool ok = true;
  for (uint32_t i = threadIdx.x; i < W * C && ok; i += blockDim.x) {
    // A masked sender's region stays as the reset left it (zero: no records).
    if (liveRank(a.st, i / C)) ok = waitFor(sig + i, round, a.st, g, kPhaseDispatchRecv, i / C, i % C);
  }
  if (__syncthreads_and(ok ? 1 : 0) != 0) {
    rowTables(g, a.st.sym + g.offDispRecv, rowBase, expertBase, prefix, block == 0 ? a.outNumTokens : nullptr);
    const uint32_t units = prefix[W] * P;
    for (uint32_t wu = (threadIdx.x / 32) * B + block; wu < units; wu += B * (blockDim.x / 32)) {
      const uint32_t i = wu / P, s = senderOf(prefix, W, i);
      expandPiece(a, rowBase, expertBase, s, i - prefix[s], wu % P);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) seq[block] = round;
}

}  // namespace
}  // namespace nvshmem
}  // namespace epcomm
