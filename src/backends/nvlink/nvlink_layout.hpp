// Geometry of the nvlink backend's peer-mapped buffer: one region per rank, identical on every rank, so a sender
// computes the address of its slot on any peer with no coordination. Host and device code share this header.
#pragma once

#include <cstdint>

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
///                                       (counts and route: plain slots only, empty in line mode)
///   rawIdx      u64 [W][Ts][K]          line mode: the sender's expert indices, tagWord(send round, index or
///                                       0xFFFFFFFF); each receiver ranks the tokens itself (computeLineTables)
///   payload     u8 [W][Ts][slotBytes]   token bytes then scales (line mode: as tagged lines), slot = token
///                                       index / D (pull: a sender stages its own tokens in slots [rank][*] of
///                                       its own region, read by receivers)
///   weights     u64 [W][Ts][K]          router weights pushed by the token's sender at combine start, each
///                                       tagged with the sender's combine round (round << 32 | f32 bits)
///   partials    u8 [W][T][partialBytes] per expert rank e: sum over e's experts of w * y for token t
struct Geometry {
  uint32_t worldSize, rank, dpSize, numExperts, numLocalExperts, topK;
  uint32_t maxTokens;       ///< T
  uint32_t slotsPerSender;  ///< Ts = ceil(T / D)
  uint32_t hiddenDim;       ///< H
  uint32_t hiddenBytes;     ///< dispatch payload bytes per token
  uint32_t scaleBytes;      ///< dispatch scale bytes per token
  uint32_t slotBytes;       ///< roundUp(hiddenBytes + scaleBytes, 16)
  uint32_t partialBytes;    ///< H * 4 (room for fp32 partials)
  uint32_t blocks;          ///< B: blocks of every kernel, equal on every rank (flags count B signals per round)
  uint32_t routeBlocks;     ///< R: blocks sharing the routing scan (R route signals per sender per round)
  uint32_t threads;         ///< threads per block (kMaxThreads or kSmallThreads), equal on every rank
  uint32_t routeChunk;      ///< tokens per routing block, a multiple of threads
  uint32_t pull;            ///< 1: a sender stages its tokens in its own region and receivers read them over NVLink
  uint32_t pushQuarters;    ///< pull mode: slots j with j % 4 < pushQuarters are pushed into the receivers anyway
                            ///< (0-4; 0 in push mode)
  uint32_t lines;           ///< 1: line mode (push mode only, see makeGeometry): slots hold tagged 128-byte lines
  uint32_t linesPerSlot;    ///< line mode: 16-byte chunks of a token's stream / 7, rounded up
  uint64_t offFlags, offNumTokens, offCounts, offRoute, offRawIdx, offPayload, offWeights, offPartials, totalBytes;
};

/// Warps per block of g's kernels.
EPCOMM_HD uint32_t blockWarps(const Geometry& g) { return g.threads / 32; }

/// Line mode (after NCCL's LL128): a slot is a run of 128-byte lines, each 112 bytes (seven 16-byte chunks) of the
/// token's stream (its payload bytes, then its scale words) and 16 bytes holding the sender's round. A warp stores a
/// line as 8 lanes x 16 bytes in one instruction and a receiver reads it the same way; once the tag carries the
/// round, the line's data is there too, with no fence and no flag between them (measured on 2x H200:
/// `nvlink-line-probe`, docs/nvlink.md). 112 rather than NCCL's 120 data bytes keeps every chunk 16-byte aligned in
/// the rows, so the receivers copy with whole-vector stores.
constexpr uint32_t kLineBytes = 128;
constexpr uint32_t kLineData = 112;

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

/// Line mode: lines per work unit (a warp moves 4 lines per instruction, 4 instructions per unit) and units per token.
constexpr uint32_t kLinesPerUnit = 16;
EPCOMM_HD uint32_t linePieces(const Geometry& g) {
  return static_cast<uint32_t>(ceilDiv(g.linesPerSlot, kLinesPerUnit));
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

/// Plain slots: 16-byte vectors per lane held in registers by one copy step (8 x 16 B x 32 lanes = 4 KiB in flight
/// per warp).
constexpr int kUnroll = 8;

/// Plain slots: 16-byte vectors per lane in one work unit of dispatchPayload and expandTokens: kUnroll (4 KiB per
/// warp), or half of that when a full batch at kUnroll has fewer units than the kernel has warps (decode: 7 KB tokens
/// were 2 units, so 128 tokens kept only half the own-token blocks' warps busy, each storing ~4 rows of 4 KiB).
EPCOMM_HD uint32_t unitVectors(const Geometry& g) {
  const uint64_t full = ceilDiv(g.hiddenBytes / 16 == 0 ? 1 : g.hiddenBytes / 16, 32 * kUnroll);
  return static_cast<uint64_t>(g.slotsPerSender) * g.worldSize * full <= static_cast<uint64_t>(g.blocks) * blockWarps(g)
             ? kUnroll / 2
             : kUnroll;
}

/// Plain slots: work units per token of dispatchPayload and expandTokens (pieces of 32 lanes x unitVectors(g)
/// 16-byte vectors; line mode's are linePieces()).
EPCOMM_HD uint32_t tokenPieces(const Geometry& g) {
  const uint32_t units = g.hiddenBytes / 16;
  return units == 0 ? 1 : static_cast<uint32_t>(ceilDiv(units, 32 * unitVectors(g)));
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
/// kernel held every mode (377 KB of SASS; docs/nvlink.md, fourteenth and fifteenth passes).
enum FusedKind : int {
  kFusedAny = 0,    ///< every path: push on dynamic schedules, and the send and receive paths in turn when the
                    ///< roles do not fit (fusedRolesFit)
  kFusedPush = 1,   ///< push mode, every expansion on static shares (decode-sized)
  kFusedPull = 2,   ///< pull mode (prefill-sized), expansions on dynamic schedules
  kFusedLines = 3,  ///< line mode
};

/// The fused dispatch kernel for `g`.
EPCOMM_HD int fusedDispatchKind(const Geometry& g) {
  if (!fusedRolesFit(g)) return kFusedAny;
  if (g.lines != 0) return kFusedLines;
  if (g.pull != 0) return kFusedPull;
  // Push: static shares when the own-token blocks never join the peers' expansion (the peers send at most
  // (W - 1) x Ts tokens).
  const bool joins =
      manyUnitsPerWarp(g, static_cast<uint64_t>(g.worldSize - 1) * g.slotsPerSender, g.blocks - fusedOwnBlocks(g));
  return joins ? kFusedAny : kFusedPush;
}

/// Line mode's lean split of the fused dispatch (fusedDispatchLines), or 0 when the batch is too large for it: P
/// payload blocks, enough for `per` work units per warp of a sender's Ts tokens, and when the other B - R - P blocks
/// (the expanders) have a warp for every `per` units of every sender's tokens, W x Ts x linePieces, they expand all of
/// them and the payload blocks end after their stores. `per` is 1 where that fits, else up to kLeanUnitsPerWarp
/// (decode T = 128 on 2 GPUs: 20 payload and 45 expander blocks, forced line mode 17.8-19.1 us against 21.8 with the
/// general split; docs/nvlink.md, twenty-first pass). g.linesPerSlot must be set.
constexpr uint32_t kLeanUnitsPerWarp = 2;
EPCOMM_HD uint32_t leanLinePayloadBlocks(const Geometry& g) {
  const uint64_t units = static_cast<uint64_t>(g.slotsPerSender) * linePieces(g);
  if (g.blocks < g.routeBlocks + 2) return 0;
  for (uint64_t per = 1; per <= kLeanUnitsPerWarp; ++per) {
    uint64_t p = ceilDiv(units, blockWarps(g) * per);
    if (p < 1) p = 1;
    if (p > g.blocks - g.routeBlocks - 1) p = g.blocks - g.routeBlocks - 1;
    const uint64_t expanderWarps = (g.blocks - g.routeBlocks - p) * static_cast<uint64_t>(blockWarps(g));
    if (units * g.worldSize <= expanderWarps * per) return static_cast<uint32_t>(p);
  }
  return 0;
}

/// Fills a Geometry for `config` with `blocks` blocks per kernel. `pullMode`: 1 pull, 0 push, -1 automatic: pull
/// when a sender's batch has at least one 4 KiB work unit per warp of the kernel (prefill), where the receivers'
/// expansion of the peers' tokens would otherwise start only after the whole NVLink copy landed; push for small
/// batches (decode), where the copy is short and a read over NVLink would add its latency to every unit.
/// `pushQuarters` (pull mode): quarters of every sender's slots pushed all the same, -1 automatic (1): they cross
/// NVLink while the rest is staged locally, which the link would otherwise wait for. Values above 4 clamp to 4 here;
/// EPCOMM_NVLINK_PUSH_QUARTERS outside [-1, 4] is already an error when the environment is read.
/// `lineMode` (push mode with W > 1 and K <= 32 only): 1 on, 0 off, -1 automatic = off. Lean lines saved 0.6-2 us at
/// decode T = 1-64 against the general push kernel (session 11), but the fused push dispatch now runs a kernel of
/// its own (kFusedPush), which is ~1 us faster than lines at decode T = 1-32 and ~2 us at T = 128 with the lean split
/// at two units per warp (docs/nvlink.md, fourteenth, fifteenth and twenty-first passes).
inline Geometry makeGeometry(const Config& c, uint32_t blocks, int pullMode = -1, int pushQuarters = -1,
                             int lineMode = -1, uint32_t threads = kMaxThreads) {
  Geometry g{};
  g.threads = threads;
  g.worldSize = c.worldSize;
  g.rank = c.rank;
  g.dpSize = c.dpSize;
  g.numExperts = c.numExperts;
  g.numLocalExperts = c.numLocalExperts();
  g.topK = c.expertsPerToken;
  g.maxTokens = c.maxNumTokens;
  g.slotsPerSender = static_cast<uint32_t>(ceilDiv(c.maxNumTokens, c.dpSize));
  g.hiddenDim = c.hiddenDim;
  g.hiddenBytes = c.hiddenDimBytes;
  g.scaleBytes = c.hiddenDimScaleBytes;
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
  const bool pull = pullMode >= 0 ? pullMode != 0 : fullUnits >= static_cast<uint64_t>(blocks) * blockWarps(g);
  g.pull = c.worldSize > 1 && pull ? 1 : 0;
  g.pushQuarters = g.pull ? static_cast<uint32_t>(pushQuarters < 0 ? 1 : pushQuarters > 4 ? 4 : pushQuarters) : 0;
  const uint64_t W = c.worldSize, Ts = g.slotsPerSender, K = c.expertsPerToken;
  const bool linesPossible = c.worldSize > 1 && g.pull == 0 && K <= 32;
  g.linesPerSlot = static_cast<uint32_t>(ceilDiv(roundUpPow2(c.hiddenDimBytes + c.hiddenDimScaleBytes, 16), kLineData));
  g.lines = linesPossible && lineMode > 0 ? 1 : 0;
  if (g.lines) {
    g.slotBytes = g.linesPerSlot * kLineBytes;
  } else {
    g.linesPerSlot = 0;
  }
  uint64_t off = 0;
  g.offFlags = off;
  off = align256(off + kNumFlags * W * sizeof(uint64_t));
  g.offNumTokens = off;
  off = align256(off + W * sizeof(uint64_t));
  // Line mode's receivers rank the tokens themselves from the raw indices: no counts, no routing entries.
  g.offCounts = off;
  off = align256(off + (g.lines ? 0 : W * g.numLocalExperts * sizeof(uint64_t)));
  g.offRoute = off;
  off = align256(off + (g.lines ? 0 : W * Ts * roundUpPow2(K, 2) * sizeof(uint64_t)));
  g.offRawIdx = off;
  off = align256(off + (g.lines ? W * Ts * K * sizeof(uint64_t) : 0));
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
constexpr uint32_t kQueues = 3;
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

/// Line mode: the receivers' tables (computeLineTables), i32 words: first token of each sender [W + 1], expert totals
/// and first rows [2][L], per 32 tokens and expert the tokens' bits and the rows before them [2][ceil(W Ts / 32)][L],
/// per routing entry its local expert [W Ts K].
inline uint64_t lineTableBytes(const Geometry& g) {
  const uint64_t W = g.worldSize, L = g.numLocalExperts, Ts = g.slotsPerSender;
  return (W + 1 + 2 * L + 2 * ceilDiv(W * Ts, 32) * L + W * Ts * g.topK) * 4;
}

/// The receivers' row tables (RowTables: sender bases [W][L], totals and first rows [2][L], token counts [W]), i32
/// words.
EPCOMM_HD uint32_t rowTableWords(const Geometry& g) { return (g.worldSize + 2) * g.numLocalExperts + g.worldSize; }

/// Dynamic shared memory of every nvlink kernel: the sender's routing scan (bits and bases per warp per expert,
/// running counts), the receiver's row bases or (line mode) its line tables, whichever is largest.
inline uint32_t sharedBytes(const Geometry& g) {
  const uint64_t scan = (2ull * blockWarps(g) + 1) * g.numExperts * 4;
  const uint64_t rows = (rowTableWords(g) + 1) * 4;  // + the hand-off word of the fused dispatch's own blocks
  uint64_t most = scan > rows ? scan : rows;
  if (g.lines && lineTableBytes(g) > most) most = lineTableBytes(g);
  return static_cast<uint32_t>(most);
}

/// Error record in host-mapped pinned memory, written by a kernel that timed out or saw a bad index; the host reads
/// it (no synchronisation) at the start of the next call. `code` is written last.
struct ErrorRecord {
  int32_t code;   ///< 0 = none, else an ErrorPhase
  int32_t rank;   ///< rank that detected it
  int32_t peer;   ///< peer that never arrived (timeouts), -1 otherwise
  int32_t block;  ///< block that detected it
  int64_t a;      ///< token index (bad index) or the flag value seen (timeout)
  int64_t b;      ///< position k and value (bad index) or the expected flag value (timeout)
};

/// What a kernel was doing when it recorded an error.
enum ErrorPhase : int32_t {
  kPhaseNone = 0,
  kPhaseDispatchRecv = 1,  ///< waiting for a sender's dispatch flag
  kPhaseCombineEnter = 2,  ///< combine-send waiting for a peer to enter combine (its weights)
  kPhaseCombineRecv = 3,   ///< combine-recv waiting for an expert rank's partials
  kPhaseBadIndex = 4,      ///< dispatch-send saw an expert index outside [-1, E)
  kPhaseRouteSync = 5,     ///< dispatch-send's routing blocks waiting for each other (same GPU)
};

}  // namespace nvlink
}  // namespace epcomm
