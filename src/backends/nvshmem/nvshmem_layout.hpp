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
/// Threads per block of every kernel.
constexpr uint32_t kThreads = 256;
constexpr uint32_t kWarps = kThreads / 32;
/// Most blocks of a phase that waits (dispatch-recv, combine-send, combine-recv): an H200 (132 SMs, three of these
/// blocks each) holds the waiting blocks of both phases of a fused call of two ranks sharing it, with room to spare.
constexpr uint32_t kMaxWaitBlocks = 128;
/// Blocks that pack and put one destination's records, at most (all ranks use the same count: a receiver waits for
/// one signal per chunk).
constexpr uint32_t kChunkBlocks = 64;
/// 16-byte vectors per lane of a dispatch-recv work unit: a piece of a record is 32 x kCopyVectors vectors (2 KiB),
/// loaded together, then stored into each of the record's rows.
constexpr uint32_t kCopyVectors = 4;
/// Four-element vectors per lane of a combine work unit: a piece of a token's hidden dimension is
/// 32 x kCombineVectors x 4 = 512 elements (H % 4 == 0), and each piece of a partial travels with its own signal.
constexpr uint32_t kCombineVectors = 4;
constexpr uint32_t kPieceElems = 32 * kCombineVectors * 4;
/// Routing entry flag: the expert repeats an earlier position of the same token (delivered once; combine applies its
/// weight to the same row).
constexpr int32_t kDupBit = 0x40000000;

/// A region (what one sender sends one receiver per round) starts with a header of u32 words: the number of records
/// that follow at word kHeaderRecords, the sender's tokens for each of the receiver's local experts at words
/// kHeaderCounts + le.
constexpr uint32_t kHeaderRecords = 0;
constexpr uint32_t kHeaderCounts = 4;
/// A record's metadata (after its payload and scales) is u32 words: the sender's slot j at word 0 (token
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
///   combSig    u64 [W][T][P]       piece p of expert rank d's partial of token t arrived (SET to the combine round)
///   dispRecv   [W][region]         sender s's records for this rank: a header, then up to Ts records
///   weightRecv f32 [W][Ts][K]      sender s's router weights of its slots
///   combRecv   f32 [W][T][H]       expert rank d's weighted partial of token t
///   dispStage  [W][region]         this rank's records for destination d (the puts' local source)
///   weightStage f32 [W][Ts][K]     this rank's router weights, one copy per destination (each put's own source)
///   combStage  f32 [W][Ts][H]      partials of the records received from sender s (the puts' local source)
///
/// A record is the token's payload (hiddenBytes), its scales (scaleBytes), padding to 16, then its metadata padded to
/// 16. Device scratch (cudaMalloc, private): the rows of every received entry int2 [W][Ts][K] {local expert, row},
/// per-block round counters u64 [kKernels][kSeqStride], and a few u64 words (kWord*).
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
  uint32_t copyPieces;      ///< dispatch-recv work units per record: ceil(hiddenBytes / 16 / (32 x kCopyVectors))
  uint32_t pieces;          ///< P: combine pieces per token, ceil(H / kPieceElems)
  uint32_t recvBlocks;      ///< blocks of the dispatch-recv phase
  uint32_t sendBlocks;      ///< blocks of the combine-send phase
  uint32_t combineBlocks;   ///< blocks of the combine-recv phase
  uint32_t packed;          ///< 1: packed layout, 0: batched
  uint32_t padding;         ///< expertPadding
  uint64_t batchedRows;     ///< R = Config::batchedRowsPerExpert()
  uint64_t regionBytes;     ///< headerBytes + Ts * recordBytes
  uint64_t offDispSig, offWeightSig, offDoneSig, offCombSig, offDispRecv, offWeightRecv, offCombRecv, offDispStage,
      offWeightStage, offCombStage, symmetricBytes;
  uint64_t offRows, offSeq, offWords, scratchBytes;
};

/// Round counters (in DeviceState::scratch) of each phase, one per work slot that runs once per call of its half: a
/// pack-and-put unit (W x C), a weights destination (W), a dispatch-recv, combine-send or combine-recv block. A slot
/// reads its counter at entry and stores the new round at exit, so no two blocks race on one word and the slots agree
/// whether the half runs alone or fused with the other.
enum Kernel : int { kPackPut = 0, kDispatchRecv = 1, kWeights = 2, kCombineSend = 3, kCombineRecv = 4, kKernels = 5 };
/// Pack-and-put has W x C <= max(kChunkBlocks, W) units, the weights W, the waiting phases kMaxWaitBlocks blocks.
constexpr uint32_t kSeqStride = 1024;
static_assert(kMaxRanks <= kSeqStride && kChunkBlocks <= kSeqStride && kMaxWaitBlocks <= kSeqStride,
              "every work slot needs a round counter");
/// Words after the counters: the tokens the last dispatch sent (its weights travel in the combine), the combine-send
/// blocks finished (monotone: the last one signals doneSig), the first-error claim.
enum Word : int { kWordSent = 0, kWordCombineSendDone = 1, kWordClaimed = 2, kWords = 64 };

EPCOMM_HD uint64_t align256(uint64_t x) { return roundUpPow2(x, 256); }

/// Byte offset of record i inside a region.
EPCOMM_HD uint64_t recordOffset(const Geometry& g, uint32_t i) {
  return g.headerBytes + static_cast<uint64_t>(i) * g.recordBytes;
}

/// Pack-and-put units: C per destination.
EPCOMM_HD uint32_t packUnits(const Geometry& g) { return g.worldSize * g.chunks; }

/// Shared memory of a pack-and-put unit: per warp and key (the destination's L local experts, then "the token goes to
/// the destination") the tokens' bits and the counts before them, a running count per key, and the slots of the
/// chunk's records.
EPCOMM_HD uint64_t packSharedBytes(uint32_t numLocalExperts, uint32_t chunkRecords) {
  return ((2ull * kWarps + 1) * (numLocalExperts + 1) + chunkRecords) * 4;
}

/// Shared memory of dispatch-recv and combine-send: row bases u32 [W][L] + expert bases [L] + record prefix [W + 1].
EPCOMM_HD uint64_t recvSharedBytes(const Geometry& g) {
  return (static_cast<uint64_t>(g.worldSize) * g.numLocalExperts + g.numLocalExperts + g.worldSize + 1) * 4;
}

/// Dynamic shared memory of the dispatch kernel with the halves it runs (a block runs one phase).
EPCOMM_HD uint64_t dispatchSharedBytes(const Geometry& g, bool send, bool recv) {
  const uint64_t s = send ? packSharedBytes(g.numLocalExperts, g.chunkRecords) : 0;
  const uint64_t r = recv ? recvSharedBytes(g) : 0;
  return s > r ? s : r;
}

/// Dynamic shared memory of the combine kernel: the record prefix of the send phase.
EPCOMM_HD uint64_t combineSharedBytes(const Geometry& g) { return (g.worldSize + 1ull) * 4; }

/// Blocks of a launch: the send phase's, then the receive phase's.
EPCOMM_HD uint32_t dispatchBlocks(const Geometry& g, bool send, bool recv) {
  return (send ? packUnits(g) : 0) + (recv ? g.recvBlocks : 0);
}
EPCOMM_HD uint32_t combineLaunchBlocks(const Geometry& g, bool send, bool recv) {
  return (send ? g.sendBlocks : 0) + (recv ? g.combineBlocks : 0);
}

/// Blocks of a waiting phase with `units` warp-sized work units: one unit per warp, at most kMaxWaitBlocks, at least
/// one.
inline uint32_t waitBlocks(uint64_t units) {
  const uint64_t b = ceilDiv(units, kWarps);
  return static_cast<uint32_t>(b < 1 ? 1 : (b < kMaxWaitBlocks ? b : kMaxWaitBlocks));
}

/// The geometry of `c`.
inline Geometry makeGeometry(const Config& c) {
  Geometry g{};
  packConfigShape(g, c);
  g.metaOffset =
      static_cast<uint32_t>(roundUpPow2(static_cast<uint64_t>(c.hiddenDimBytes) + c.hiddenDimScaleBytes, 16));
  g.recordBytes = g.metaOffset + static_cast<uint32_t>(roundUpPow2(4ull * kMetaEntries + 8ull * c.expertsPerToken, 16));
  g.headerBytes = static_cast<uint32_t>(roundUpPow2(4ull * kHeaderCounts + 4ull * g.numLocalExperts, 16));
  const uint32_t perDest = kChunkBlocks / c.worldSize > 0 ? kChunkBlocks / c.worldSize : 1;
  g.chunks = perDest < g.slotsPerSender ? perDest : (g.slotsPerSender > 0 ? g.slotsPerSender : 1);
  g.chunkRecords = static_cast<uint32_t>(ceilDiv(g.slotsPerSender, g.chunks));
  g.copyPieces = static_cast<uint32_t>(ceilDiv(c.hiddenDimBytes / 16, 32 * kCopyVectors));
  if (g.copyPieces == 0) g.copyPieces = 1;
  g.pieces = static_cast<uint32_t>(ceilDiv(c.hiddenDim, kPieceElems));
  if (g.pieces == 0) g.pieces = 1;
  const uint64_t W = c.worldSize, Ts = g.slotsPerSender, K = c.expertsPerToken, T = c.maxNumTokens;
  // One warp per work unit: (received record, piece) in dispatch-recv and combine-send, (token, piece) in
  // combine-recv; at most W x Ts records arrive.
  g.recvBlocks = waitBlocks(W * Ts * g.copyPieces);
  g.sendBlocks = waitBlocks(W * Ts * g.pieces);
  g.combineBlocks = waitBlocks(T * g.pieces);
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
  off = align256(off + W * T * g.pieces * 8);
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
