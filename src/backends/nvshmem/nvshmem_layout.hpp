// Geometry of the nvshmem backend: one symmetric allocation per object (the same offsets on every PE, so a sender
// names any slot on any peer by its local address) and the object's private device scratch. Pure arithmetic, shared by
// the kernels, the host object and the planner (which runs without a GPU). See docs/nvshmem.md.
#pragma once

#include <cstdint>

#include "core/kernel_args.hpp"
#include "core/layout.hpp"
#include "epcomm/config.hpp"

namespace epcomm {
namespace nvshmem {

/// Most ranks an object supports (per-sender tables live in shared memory).
constexpr uint32_t kMaxRanks = 1024;
/// Threads per block of every kernel but the routing one.
constexpr uint32_t kThreads = 256;
constexpr uint32_t kWarps = kThreads / 32;
/// The routing kernel is one block of up to kRouteMaxWarps warps; fewer when numExperts is so large that its
/// per-warp tables would not fit in shared memory.
constexpr uint32_t kRouteMaxWarps = 16;
/// Most blocks of the kernels that wait (dispatch-recv, combine-send, combine-recv). With 256-thread blocks an H200
/// keeps up to 8 blocks on each of its 132 SMs, so two objects in flight never fill the GPU with waiting blocks that
/// would keep the other object's send blocks from running.
constexpr uint32_t kMaxWaitBlocks = 128;
/// Blocks that pack and put one destination's records, at most (all ranks use the same count: a receiver waits for
/// one signal per chunk).
constexpr uint32_t kChunkBlocks = 64;
/// Routing entry flag: the expert repeats an earlier position of the same token (delivered once; combine applies its
/// weight to the same row).
constexpr int32_t kDupBit = 0x40000000;

/// A region (what one sender sends one receiver per round) starts with a header of u32 words: the number of records
/// that follow at word kHeaderRecords, the sender's tokens for each of the receiver's local experts at words
/// kHeaderCounts + le.
constexpr uint32_t kHeaderRecords = 0;
constexpr uint32_t kHeaderCounts = 4;
/// A record's metadata (after its payload and scales) is u32 words: the sender's slot j at word 1 (token
/// t = j * D + sender % D), then from word kMetaEntries K pairs of i32 {local expert | kDupBit, or -1 when position k
/// is not on the receiver; the token's position among the sender's tokens for that expert}.
constexpr uint32_t kMetaSlot = 0;
constexpr uint32_t kMetaEntries = 2;

/// Byte offsets and sizes. Symmetric (nvshmem_malloc, identical on every PE, 256-byte aligned parts):
///
///   dispSig    u64 [W][C]          sender s's chunk c of this round arrived (SET to the dispatch round)
///   weightSig  u64 [W]             sender s's router weights arrived (SET to the combine round)
///   doneSig    u64 [W]             expert rank d finished reading what this rank sent it (SET to the combine round):
///                                  the barrier that lets the next dispatch reuse every buffer
///   combSig    u64 [W][T]          expert rank d's partial of token t arrived (SET to the combine round)
///   dispRecv   [W][region]         sender s's records for this rank: a header, then up to Ts records
///   weightRecv f32 [W][Ts][K]      sender s's router weights of its slots
///   combRecv   f32 [W][T][H]       expert rank d's weighted partial of token t
///   dispStage  [W][region]         this rank's records for destination d (the puts' local source)
///   weightStage f32 [W][Ts][K]     this rank's weights, one copy per destination block
///   combStage  f32 [W][Ts][H]      partials of the records received from sender s (the puts' local source)
///
/// A record is the token's payload (hiddenBytes), its scales (scaleBytes), padding to 16, then its metadata padded to
/// 16. Device scratch (cudaMalloc, private): per-token routing int2 [Ts][K] {expert or -1, position | kDupBit},
/// the tokens of each destination in record order i32 [W][Ts], the rows of every received entry int2 [W][Ts][K]
/// {local expert, row}, per-block round counters u64 [kKernels][kSeqStride], and a few u64 words (kWord*).
struct Geometry {
  uint32_t worldSize, rank, dpSize, numExperts, numLocalExperts, topK;
  uint32_t maxTokens;       ///< T
  uint32_t slotsPerSender;  ///< Ts = ceil(T / D): a sender sends the tokens t with t % D == rank % D, slot t / D
  uint32_t hiddenDim;       ///< H
  uint32_t hiddenBytes;     ///< dispatch payload bytes per token (multiple of 16)
  uint32_t scaleBytes;      ///< dispatch scale bytes per token (multiple of 4)
  uint32_t metaOffset;      ///< the metadata's offset inside a record
  uint32_t recordBytes;     ///< payload + scales + meta, multiple of 16
  uint32_t headerBytes;     ///< a region's header with L counts, multiple of 16
  uint32_t chunks;          ///< C: pack-and-put blocks per destination
  uint32_t chunkRecords;    ///< records per chunk: ceil(Ts / C)
  uint32_t routeWarps;      ///< warps of the routing block
  uint32_t recvBlocks;      ///< blocks of dispatch-recv and combine-send
  uint32_t combineBlocks;   ///< blocks of combine-recv
  uint32_t packed;          ///< 1: packed layout, 0: batched
  uint32_t padding;         ///< expertPadding
  uint64_t batchedRows;     ///< R = Config::batchedRowsPerExpert()
  uint64_t regionBytes;     ///< headerBytes + Ts * recordBytes
  uint64_t offDispSig, offWeightSig, offDoneSig, offCombSig, offDispRecv, offWeightRecv, offCombRecv, offDispStage,
      offWeightStage, offCombStage, symmetricBytes;
  uint64_t offRoute, offTokens, offRows, offSeq, offWords, scratchBytes;
};

/// Kernels that keep per-block round counters (DeviceState::seq), and the stride between their counter arrays.
enum Kernel : int { kPackPut = 0, kDispatchRecv = 1, kWeights = 2, kCombineSend = 3, kCombineRecv = 4, kKernels = 5 };
/// Pack-and-put has W x C <= max(kChunkBlocks, W) blocks, the weights kernel W, the waiting kernels kMaxWaitBlocks.
constexpr uint32_t kSeqStride = 1024;
static_assert(kMaxRanks <= kSeqStride && kChunkBlocks <= kSeqStride && kMaxWaitBlocks <= kSeqStride,
              "every kernel's blocks need a round counter");
/// Words after the counters: the tokens the last dispatch sent (its weights travel in the combine), the combine-send
/// blocks finished (monotone: the last one signals doneSig), the first-error claim.
enum Word : int { kWordSent = 0, kWordCombineSendDone = 1, kWordClaimed = 2, kWords = 64 };

EPCOMM_HD uint64_t align256(uint64_t x) { return roundUpPow2(x, 256); }

/// Byte offset of record i inside a region.
EPCOMM_HD uint64_t recordOffset(const Geometry& g, uint32_t i) {
  return g.headerBytes + static_cast<uint64_t>(i) * g.recordBytes;
}

/// Blocks of the pack-and-put kernel: C per destination.
EPCOMM_HD uint32_t packBlocks(const Geometry& g) { return g.worldSize * g.chunks; }

/// Shared memory of the routing block: per warp and key (E experts, then W destinations) the tokens' bits and the
/// counts before them, and a running count per key.
EPCOMM_HD uint64_t routeSharedBytes(uint32_t warps, uint32_t numExperts, uint32_t worldSize) {
  return (2ull * warps + 1) * (numExperts + worldSize) * 4;
}

/// Shared memory of dispatch-recv and combine-send: row bases u32 [W][L] + expert bases [L] + record prefix [W + 1].
EPCOMM_HD uint64_t recvSharedBytes(const Geometry& g) {
  return (static_cast<uint64_t>(g.worldSize) * g.numLocalExperts + g.numLocalExperts + g.worldSize + 1) * 4;
}

/// The geometry of `c`. `maxSharedBytes`: the opt-in shared memory per block of the GPU (the planner passes an
/// H200's 232448), which bounds the routing block's warps. Returns routeWarps = 0 when even one warp does not fit.
inline Geometry makeGeometry(const Config& c, uint64_t maxSharedBytes) {
  Geometry g{};
  packConfigShape(g, c);
  g.metaOffset =
      static_cast<uint32_t>(roundUpPow2(static_cast<uint64_t>(c.hiddenDimBytes) + c.hiddenDimScaleBytes, 16));
  g.recordBytes = g.metaOffset + static_cast<uint32_t>(roundUpPow2(4ull * kMetaEntries + 8ull * c.expertsPerToken, 16));
  g.headerBytes = static_cast<uint32_t>(roundUpPow2(4ull * kHeaderCounts + 4ull * g.numLocalExperts, 16));
  const uint32_t perDest = kChunkBlocks / c.worldSize > 0 ? kChunkBlocks / c.worldSize : 1;
  g.chunks = perDest < g.slotsPerSender ? perDest : (g.slotsPerSender > 0 ? g.slotsPerSender : 1);
  g.chunkRecords = static_cast<uint32_t>(ceilDiv(g.slotsPerSender, g.chunks));
  g.routeWarps = 0;
  for (uint32_t w = kRouteMaxWarps; w >= 1; w /= 2) {
    if (routeSharedBytes(w, c.numExperts, c.worldSize) <= maxSharedBytes) {
      g.routeWarps = w;
      break;
    }
  }
  const uint64_t W = c.worldSize, Ts = g.slotsPerSender, K = c.expertsPerToken, T = c.maxNumTokens;
  // One warp per received record (at most W x Ts of them), one per token in combine-recv.
  const uint64_t recvBlocks = ceilDiv(W * Ts, kWarps);
  g.recvBlocks = static_cast<uint32_t>(recvBlocks < kMaxWaitBlocks ? recvBlocks : kMaxWaitBlocks);
  const uint64_t combineBlocks = ceilDiv(T, kWarps);
  g.combineBlocks = static_cast<uint32_t>(combineBlocks < kMaxWaitBlocks ? combineBlocks : kMaxWaitBlocks);
  g.packed = c.layout == Layout::kPacked ? 1 : 0;
  g.padding = c.expertPadding;
  g.batchedRows = c.batchedRowsPerExpert();
  g.regionBytes = roundUpPow2(g.headerBytes + Ts * g.recordBytes, 16);

  uint64_t off = 0;
  g.offDispSig = off;
  off = align256(off + W * g.chunks * 8);
  g.offWeightSig = off;
  off = align256(off + W * 8);
  g.offDoneSig = off;
  off = align256(off + W * 8);
  g.offCombSig = off;
  off = align256(off + W * T * 8);
  g.offDispRecv = off;
  off = align256(off + W * g.regionBytes);
  g.offWeightRecv = off;
  off = align256(off + W * Ts * K * 4);
  g.offCombRecv = off;
  off = align256(off + W * T * c.hiddenDim * 4);
  g.offDispStage = off;
  off = align256(off + W * g.regionBytes);
  g.offWeightStage = off;
  off = align256(off + W * Ts * K * 4);
  g.offCombStage = off;
  off = align256(off + W * Ts * c.hiddenDim * 4);
  g.symmetricBytes = off;

  off = 0;
  g.offRoute = off;
  off = align256(off + Ts * K * 8);
  g.offTokens = off;
  off = align256(off + W * Ts * 4);
  g.offRows = off;
  off = align256(off + W * Ts * K * 8);
  g.offSeq = off;
  off = align256(off + static_cast<uint64_t>(kKernels) * kSeqStride * 8);
  g.offWords = off;
  off = align256(off + kWords * 8);
  g.scratchBytes = off;
  return g;
}

}  // namespace nvshmem
}  // namespace epcomm
