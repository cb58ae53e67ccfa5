// Geometry of the nvlink backend's peer-mapped buffer: one region per rank, identical on every rank, so a sender
// computes the address of its slot on any peer with no coordination. Host and device code share this header.
#pragma once

#include <cstdint>

#include "core/error_record.hpp"
#include "core/kernel_args.hpp"
#include "core/layout.hpp"
#include "epcomm/config.hpp"

namespace epcomm {
namespace nvlink {

/// Most ranks one node can have (peer pointers travel by value in the kernel argument structs).
constexpr uint32_t kMaxRanks = 16;
/// Threads per block of the nvlink kernels (Geometry::threads): 512 (16 warps), or 256 for small batches, where
/// twice the blocks spread the same warps over every SM (chooseThreads in nvlink_backend.cc). The kernels' launch
/// bound is 512 threads, one block per SM: at most 128 registers a thread, so two 256-thread blocks fit an SM too.
constexpr uint32_t kMaxThreads = 512;
constexpr uint32_t kSmallThreads = 256;

/// One routing entry of a dispatched token, as the sender writes it into the receiver's buffer: which local expert
/// of the receiver (or -1) and the token's position among the sender's tokens for that expert. `le` has kDupBit set
/// when an earlier k of the same token named the same expert (delivered once; combine still applies its weight).
struct RouteEntry {
  int32_t le;
  int32_t pos;
};
constexpr int32_t kDupBit = 0x40000000;

/// Flag arrays per region (see Geometry): dispatch, combine-done.
constexpr uint32_t kNumFlags = 2;

/// Tagged words (NCCL's LL pattern): the round that wrote a value travels in the same 8-byte word (high 32 bits),
/// stored and loaded single-copy atomic, so a receiver polls the word itself instead of a flag behind a fence.
EPCOMM_HD uint64_t tagWord(uint32_t round, uint32_t value) { return (static_cast<uint64_t>(round) << 32) | value; }

/// A routing entry in the low 32 bits of a tagged word: position (16 bits) and local-expert field (16 bits:
/// 0xFFFF none, else the local expert with 0x8000 for kDupBit). Hence fitsTaggedEntries().
EPCOMM_HD uint32_t packEntry(RouteEntry e) {
  if (e.le < 0) return 0xFFFF0000u;
  const uint32_t field = static_cast<uint32_t>(e.le & ~kDupBit) | ((e.le & kDupBit) != 0 ? 0x8000u : 0u);
  return (field << 16) | (static_cast<uint32_t>(e.pos) & 0xFFFFu);
}
EPCOMM_HD RouteEntry unpackEntry(uint32_t v) {
  const uint32_t field = v >> 16;
  if (field == 0xFFFFu) return RouteEntry{-1, 0};
  return RouteEntry{static_cast<int32_t>(field & 0x7FFFu) | ((field & 0x8000u) != 0 ? kDupBit : 0),
                    static_cast<int32_t>(v & 0xFFFFu)};
}

/// Byte offsets and sizes inside one rank's peer-mapped region. All offsets are 256-byte aligned.
///
///   flags       u64 dispatchFlag[W], combineDoneFlag[W] (monotone counters, never reset)
///   numTokens   u64 [W]                 tokens sender s sent this round (its n_s), tagWord(send round, n_s)
///   counts      u64 [W][L]              tokens sender s routed to each local expert, tagWord(send round, count)
///   route       u64 [W][K/2][Ts][2]     per sent token: its K entries as seen from this rank (see routeIndex),
///                                       tagWord(send round, packEntry(entry)); all three polled by the receivers
///   payload     u8 [W][Ts][slotBytes]   token bytes then scales, slot = token index / D (pull: a sender stages
///                                       its own tokens in slots [rank][*] of its own region, read by receivers)
///   weights     u64 [W][Ts][K]          router weights pushed by the token's sender at combine start, each
///                                       tagged with the sender's combine round (round << 32 | f32 bits)
///   partials    u8 [W][T][partialBytes] per expert rank e: fp32 sum over e's experts of w * y for token t
struct Geometry {
  uint32_t worldSize, rank, dpSize, numExperts, numLocalExperts, topK;
  uint32_t maxTokens;       ///< T
  uint32_t slotsPerSender;  ///< Ts = ceil(T / D)
  uint32_t hiddenDim;       ///< H
  uint32_t hiddenBytes;     ///< dispatch payload bytes per token
  uint32_t scaleBytes;      ///< dispatch scale bytes per token
  uint32_t slotBytes;       ///< roundUp(hiddenBytes + scaleBytes, 16)
  uint32_t partialBytes;    ///< H * 4: fp32 partials, whatever expertY's type
  uint32_t blocks;          ///< B: blocks of every kernel, equal on every rank (flags count B signals per round)
  uint32_t routeBlocks;     ///< R: blocks sharing the routing scan (R route signals per sender per round)
  uint32_t threads;         ///< threads per block (kMaxThreads or kSmallThreads), equal on every rank
  uint32_t routeChunk;      ///< tokens per routing block, a multiple of threads
  uint32_t pull;            ///< 1: a sender stages its tokens in its own region and receivers read them over NVLink
  uint32_t pushQuarters;    ///< pull mode: slots j with j % 4 < pushQuarters are pushed into the receivers anyway
                            ///< (kPushQuarters; 0 in push mode)
  /// Active ranks, bit r for rank r (elastic ranks, docs/failures.md): the kernels store into, signal and wait for
  /// these only. Every rank unless a mask dropped some (it fills the padding before the 64-bit offsets).
  uint32_t live;
  uint64_t offFlags, offNumTokens, offCounts, offRoute, offPayload, offWeights, offPartials, totalBytes;
};

/// Warps per block of g's kernels.
EPCOMM_HD uint32_t blockWarps(const Geometry& g) { return g.threads / 32; }

EPCOMM_HD uint64_t align256(uint64_t x) { return roundUpPow2(x, 256); }

/// Whether sender slot j travels by push (stored into the receivers' regions) rather than by pull: every slot in
/// push mode, slots j % 4 < pushQuarters in pull mode.
EPCOMM_HD bool pushedSlot(const Geometry& g, uint32_t j) { return g.pull == 0 || j % 4 < g.pushQuarters; }

/// Which of a sender's n slots one copy pass handles: all of them, or in pull mode only the pushed or the pulled ones.
enum SlotFilter : int { kAllSlots = 0, kPushedSlots = 1, kPulledSlots = 2 };

/// The slots j % 4 in [first, first + quarters) of filter `f` (pull mode).
EPCOMM_HD void slotQuarters(const Geometry& g, int f, uint32_t& first, uint32_t& quarters) {
  first = f == kPulledSlots ? g.pushQuarters : 0;
  quarters = f == kPulledSlots ? 4 - g.pushQuarters : g.pushQuarters;
}

/// Number of slots j < n that filter `f` selects.
EPCOMM_HD uint32_t filteredSlots(const Geometry& g, uint32_t n, int f) {
  if (f == kAllSlots) return n;
  uint32_t first = 0, quarters = 0;
  slotQuarters(g, f, first, quarters);
  const uint32_t rest = n % 4 > first ? n % 4 - first : 0;
  return (n / 4) * quarters + (rest < quarters ? rest : quarters);
}

/// The i-th slot (ascending) that filter `f` selects.
EPCOMM_HD uint32_t filteredSlot(const Geometry& g, uint32_t i, int f) {
  if (f == kAllSlots) return i;
  uint32_t first = 0, quarters = 0;
  slotQuarters(g, f, first, quarters);
  return (i / quarters) * 4 + first + i % quarters;
}

/// Whether every routing entry fits packEntry(): positions below 2^16 (Ts <= 65536) and local experts below 0x7FFF.
inline bool fitsTaggedEntries(const Geometry& g) { return g.slotsPerSender <= 65536u && g.numLocalExperts < 0x7FFFu; }

/// Index (in tagged 8-byte words, from offRoute) of entry k of sender s's token slot j. Entries k = 2p, 2p + 1 form a
/// 16-byte pair and pairs are laid out [s][p][j]: consecutive tokens' pairs are adjacent, so a warp of routing
/// threads (one token each) writes whole 128-byte lines across NVLink instead of 16 bytes every 64.
EPCOMM_HD uint64_t routeIndex(uint32_t K, uint32_t Ts, uint32_t s, uint32_t j, uint32_t k) {
  const uint64_t pairs = (K + 1) / 2;
  return ((static_cast<uint64_t>(s) * pairs + k / 2) * Ts + j) * 2 + (k & 1);
}

/// The fused dispatch's own-token blocks: about (B - R) / W, the own tokens' share of the expansion (at least one).
EPCOMM_HD uint32_t fusedOwnBlocks(const Geometry& g) {
  if (g.blocks <= g.routeBlocks) return 0;
  const uint32_t own = (g.blocks - g.routeBlocks) / g.worldSize;
  return own > 0 ? own : 1;
}

/// Whether the grid has room for the fused dispatch's roles: a payload block (when there are peers) and an own-token
/// block besides the R routing blocks. Otherwise the fused call runs the send and the receive paths one after the
/// other.
EPCOMM_HD bool fusedRolesFit(const Geometry& g) {
  return g.blocks >= g.routeBlocks + 2 || (g.worldSize == 1 && g.blocks >= g.routeBlocks + 1);
}

/// 16-byte vectors per lane held in registers by one copy step (8 x 16 B x 32 lanes = 4 KiB in flight
/// per warp).
constexpr int kUnroll = 8;

/// 16-byte vectors per lane in one work unit of dispatchPayload and expandTokens: kUnroll (4 KiB per
/// warp), or half of that when a full batch at kUnroll has fewer units than the kernel has warps (decode: 7 KB tokens
/// were 2 units, so 128 tokens kept only half the own-token blocks' warps busy, each storing ~4 rows of 4 KiB).
EPCOMM_HD uint32_t unitVectors(const Geometry& g) {
  const uint64_t full = ceilDiv(g.hiddenBytes / 16 == 0 ? 1 : g.hiddenBytes / 16, 32 * kUnroll);
  return static_cast<uint64_t>(g.slotsPerSender) * g.worldSize * full <= static_cast<uint64_t>(g.blocks) * blockWarps(g)
             ? kUnroll / 2
             : kUnroll;
}

/// Work units per token of dispatchPayload and expandTokens (pieces of 32 lanes x unitVectors(g) 16-byte vectors).
EPCOMM_HD uint32_t tokenPieces(const Geometry& g) {
  const uint32_t units = g.hiddenBytes / 16;
  return units == 0 ? 1 : static_cast<uint32_t>(ceilDiv(units, 32 * unitVectors(g)));
}

/// 16-byte fp8 vectors per lane of a unit that casts (Config::dispatchCast; the cast kernels' send halves and their
/// expansion of this rank's own tokens): each reads 32 bytes of bf16, so half of kUnroll keeps the bytes in flight, and
/// the registers that hold them, those of a copy unit.
constexpr int kCastUnroll = kUnroll / 2;

/// unitVectors and tokenPieces of the unit loops of kernels that cast (kCast) or copy. A unit loop and whatever
/// predicts its units (firstOwnEntries) take the same kCast.
template <bool kCast>
EPCOMM_HD uint32_t unitVectorsOf(const Geometry& g) {
  return kCast ? static_cast<uint32_t>(kCastUnroll) : unitVectors(g);
}
template <bool kCast>
EPCOMM_HD uint32_t tokenPiecesOf(const Geometry& g) {
  if (!kCast) return tokenPieces(g);
  const uint32_t units = g.hiddenBytes / 16;  // >= 8: a cast token has at least 128 elements
  return static_cast<uint32_t>(ceilDiv(units, 32 * kCastUnroll));
}

/// Whether the own-token blocks of the fused dispatch also expand the peers' tokens: only for more than
/// kJoinUnitsPerWarp work units per warp of the other blocks (prefill). Decided from the received token counts
/// (valid once every rank's routes are in), so every block decides the same. Measured on 2x H200: without the own
/// blocks decode T = 512 (2 units per warp) dispatched in 34.6 us instead of 37.9, but prefill T = 4096 (16 per warp)
/// in 148.8 / 153.0 us (eager / graph) instead of 145.1 / 142.8.
constexpr uint32_t kJoinUnitsPerWarp = 4;

/// Whether expanding `tokens` tokens gives the warps of `blocks` blocks more than kJoinUnitsPerWarp work units each:
/// a prefill-sized round, expanded on a dynamic schedule (expandTokens).
EPCOMM_HD bool manyUnitsPerWarp(const Geometry& g, uint64_t tokens, uint32_t blocks) {
  return tokens * tokenPieces(g) > static_cast<uint64_t>(kJoinUnitsPerWarp) * blocks * blockWarps(g);
}

/// The fused dispatch kernels, each holding one mode's code only: instruction fetch bounded the dispatch while one
/// kernel held every mode (377 KB of SASS; docs/nvlink.md).
enum FusedKind : int {
  kFusedAny = 0,   ///< every path: push on dynamic schedules, and the send and receive paths in turn when the
                   ///< roles do not fit (fusedRolesFit)
  kFusedPush = 1,  ///< push mode, every expansion on static shares (decode-sized)
  kFusedPull = 2,  ///< pull mode (prefill-sized), expansions on dynamic schedules
};

/// The fused dispatch kernel for `g`.
EPCOMM_HD int fusedDispatchKind(const Geometry& g) {
  if (!fusedRolesFit(g)) return kFusedAny;
  if (g.pull != 0) return kFusedPull;
  // Push: static shares when the own-token blocks never join the peers' expansion (the peers send at most
  // (W - 1) x Ts tokens).
  const bool joins =
      manyUnitsPerWarp(g, static_cast<uint64_t>(g.worldSize - 1) * g.slotsPerSender, g.blocks - fusedOwnBlocks(g));
  return joins ? kFusedAny : kFusedPush;
}

/// Pull mode's pushed share: slots j with j % 4 < kPushQuarters cross NVLink while the rest is staged locally, which
/// the link would otherwise wait for (prefill T = 4096 on 2x H200: dispatch 124.5 us against 144.5 with no slot pushed
/// and 141.1 with half of them; docs/nvlink.md).
constexpr uint32_t kPushQuarters = 1;

/// Fills a Geometry for `config` with `blocks` blocks of `threads` threads per kernel. Pull mode when W > 1 and a
/// sender's batch has at least one 4 KiB work unit per warp of the kernel (prefill), where the receivers' expansion of
/// the peers' tokens would otherwise start only after the whole NVLink copy landed; push for small batches (decode),
/// where the copy is short and a read over NVLink would add its latency to every unit.
inline Geometry makeGeometry(const Config& c, uint32_t blocks, uint32_t threads = kMaxThreads) {
  Geometry g{};
  g.threads = threads;
  packConfigShape(g, c);
  g.slotBytes = static_cast<uint32_t>(roundUpPow2(c.hiddenDimBytes + c.hiddenDimScaleBytes, 16));
  g.partialBytes = c.hiddenDim * 4;
  g.blocks = blocks;
  // One routing block per `threads` tokens (decode: 1), at most a quarter of the blocks, so the fused kernel keeps
  // payload and expansion blocks.
  const uint64_t passes = ceilDiv(g.slotsPerSender, threads);
  const uint64_t maxRoute = blocks / 4 > 0 ? blocks / 4 : 1;
  g.routeBlocks = static_cast<uint32_t>(passes < maxRoute ? passes : maxRoute);
  g.routeChunk = static_cast<uint32_t>(ceilDiv(passes, g.routeBlocks) * threads);
  const uint64_t fullUnits = ceilDiv(c.hiddenDimBytes > 0 ? c.hiddenDimBytes : 1, 4096) * g.slotsPerSender;
  g.pull = c.worldSize > 1 && fullUnits >= static_cast<uint64_t>(blocks) * blockWarps(g) ? 1 : 0;
  g.pushQuarters = g.pull ? kPushQuarters : 0;
  g.live = c.worldSize >= 32 ? 0xffffffffu : (1u << c.worldSize) - 1;
  const uint64_t W = c.worldSize, Ts = g.slotsPerSender, K = c.expertsPerToken;
  uint64_t off = 0;
  g.offFlags = off;
  off = align256(off + kNumFlags * W * sizeof(uint64_t));
  g.offNumTokens = off;
  off = align256(off + W * sizeof(uint64_t));
  g.offCounts = off;
  off = align256(off + W * g.numLocalExperts * sizeof(uint64_t));
  g.offRoute = off;
  off = align256(off + W * Ts * roundUpPow2(K, 2) * sizeof(uint64_t));
  g.offPayload = off;
  off = align256(off + W * Ts * g.slotBytes);
  g.offWeights = off;
  off = align256(off + W * Ts * K * sizeof(uint64_t));
  g.offPartials = off;
  off = align256(off + W * static_cast<uint64_t>(c.maxNumTokens) * g.partialBytes);
  g.totalBytes = off;
  return g;
}

/// Device memory beside the peer-mapped region (not shared): the per-block round counters u32 [4][B] followed by
/// 256 bytes whose first word is the error claim and whose bytes [kQueueOffset, kQueueOffset + 8 kQueues) are the
/// work queues u32 [kQueues][2], and the routing blocks' arrival counter (256 bytes) followed by their histograms
/// i32 [R][E].
constexpr uint32_t kQueues = 2;
constexpr uint32_t kQueueOffset = 64;
static_assert(kQueueOffset + kQueues * 2 * sizeof(uint32_t) <= 256, "work queues must fit the counters' tail");
inline uint64_t roundCounterBytes(const Geometry& g) { return 4ull * g.blocks * sizeof(uint32_t) + 256; }
inline uint64_t routeScratchBytes(const Geometry& g) {
  return 256 + static_cast<uint64_t>(g.routeBlocks) * g.numExperts * 4;
}

/// The dispatch's rows for the combine (DeviceState::rowSlots): u64 [W][Ts][K], device memory beside the region.
inline uint64_t rowSlotBytes(const Geometry& g) {
  return static_cast<uint64_t>(g.worldSize) * g.slotsPerSender * g.topK * sizeof(uint64_t);
}
/// A rowSlots word: the entry's local expert and its row there, or kNoRowSlot (the expert is on another rank; the
/// buffer starts filled with it).
constexpr uint64_t kNoRowSlot = ~0ull;
EPCOMM_HD uint64_t rowSlot(uint32_t le, uint32_t row) { return static_cast<uint64_t>(le) << 32 | row; }

/// The receivers' row tables (RowTables: sender bases [W][L], totals and first rows [2][L], token counts [W]), i32
/// words.
EPCOMM_HD uint32_t rowTableWords(const Geometry& g) { return (g.worldSize + 2) * g.numLocalExperts + g.worldSize; }

/// Dynamic shared memory of every nvlink kernel: the sender's routing scan (bits and bases per warp per expert,
/// running counts) or the receiver's row tables, whichever is larger.
inline uint32_t sharedBytes(const Geometry& g) {
  const uint64_t scan = (2ull * blockWarps(g) + 1) * g.numExperts * 4;
  const uint64_t rows = (rowTableWords(g) + 1) * 4;  // + the hand-off word of the fused dispatch's own blocks
  return static_cast<uint32_t>(scan > rows ? scan : rows);
}

/// Error record in host-mapped pinned memory, written by a kernel that timed out or saw a bad index; the host reads
/// it (no synchronisation) at the start of the next call. `code` is an ErrorPhase; a, b: the token index and
/// position k << 32 | value (bad index), or the flag value seen and the one expected (timeout).
using ErrorRecord = KernelErrorRecord;

/// What a kernel was doing when it recorded an error.
enum ErrorPhase : int32_t {
  kPhaseNone = 0,
  kPhaseDispatchRecv = 1,  ///< waiting for a sender's dispatch flag
  kPhaseCombineEnter = 2,  ///< combine-send waiting for a peer to enter combine (its weights)
  kPhaseCombineRecv = 3,   ///< combine-recv waiting for an expert rank's partials
  kPhaseBadIndex = 4,      ///< dispatch-send saw an expert index outside [-1, E)
  kPhaseRouteSync = 5,     ///< dispatch-send's routing blocks waiting for each other (same GPU)
  kPhasePeerAbort = 6,     ///< a wait saw a peer's abort word (peer = that rank; a = the wait's phase, b = its peer)
};

}  // namespace nvlink
}  // namespace epcomm
