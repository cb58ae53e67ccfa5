// Kernels of the GPU proxy backend and what they share with its proxy thread: the host-mapped mailbox (flags both
// ways, the error record, trace stamps), the per-round tables the proxy publishes for the unpack and combine kernels,
// and the device scratch. No CUDA headers here, so the host class and the planner compile with the C++ compiler.
//
// Hand-off (docs/proxy.md): a send kernel packs the channel's send buffer (pinned host memory mapped into the GPU),
// then its last block fences at system scope and stores the round into `dispatchReady` / `combineReady` with release
// semantics. The proxy thread polls that word, runs the exchange over the TransferEngine, writes the round's tables
// and then `dispatchArrived` / `combineArrived` (release); the receive kernel polls it with ld.acquire.sys. All
// counters are monotone round numbers kept by the device (CUDA graphs replay correctly).
//
// Same-node peers (LocalGeometry, EPCOMM_PROXY_LOCAL_SIZE > 1): the heads and immediates still go through the
// channel, but entries and combine rows go GPU to GPU: the send kernels store them into the node peers' device
// regions (CUDA IPC) and raise a flag there; the receive kernels wait for those flags as well as for the proxy.
#pragma once

#include <cstdint>

#include "core/combine_type.hpp"
#include "core/error_record.hpp"
#include "core/layout.hpp"
#include "proxy/protocol.hpp"

namespace epcomm {
namespace gpuproxy {

/// What a kernel was doing when it recorded an error (ErrorRecord::code).
enum ErrorPhase : int32_t {
  kPhaseNone = 0,
  kPhaseBadIndex = 1,         ///< dispatch-send: an expert index outside [-1, E) (the entry is skipped)
  kPhaseDispatchArrival = 2,  ///< dispatch-recv: the proxy never announced the peers' tokens
  kPhaseCombineArrival = 3,   ///< combine-recv: the proxy never announced the owners' rows
  kPhaseCorruptEntry = 4,     ///< dispatch-recv: an entry names more experts than it may, or the counts disagree
  kPhaseCombineIndex = 5,     ///< combine-recv: an index differs from the one dispatched (or beyond its boundM)
  kPhaseCombineBadIndex = 6,  ///< combine-recv: an expert index outside [-1, E)
  kPhaseLocalDispatch = 7,    ///< dispatch-recv: a same-node sender's entries never arrived over NVLink
  kPhaseLocalCombine = 8,     ///< combine-recv: a same-node owner's rows never arrived over NVLink
};

/// Written once by the first kernel that fails (host-mapped, read by the next API call). `code` is an ErrorPhase;
/// peer: the sender or owner involved; a, b: the token or entry index and the position and index, or the flag value
/// seen and the one expected (timeouts).
using ErrorRecord = KernelErrorRecord;

/// Stamps of one round (EPCOMM_PROXY_TRACE): device stamps are %globaltimer ns, host stamps CLOCK_REALTIME ns.
struct TraceRound {
  uint64_t packStart;     ///< device: dispatch route kernel entered
  uint64_t packReady;     ///< device: dispatchReady stored
  uint64_t proxySeen;     ///< host: the proxy saw dispatchReady
  uint64_t proxyPosting;  ///< host: the heads' post call begins
  uint64_t proxyPosted;   ///< host: the heads were posted (first fabric operation)
  uint64_t proxyArrived;  ///< host: every peer's tokens in, tables written, dispatchArrived stored
  uint64_t unpackStart;   ///< device: the rank kernel saw dispatchArrived
  uint64_t unpackEnd;     ///< device: the copy kernel's last block finished
  uint64_t combStart;     ///< device: combine-send entered
  uint64_t combReady;     ///< device: combineReady stored
  uint64_t combSeen;      ///< host: the proxy saw combineReady
  uint64_t combPosting;   ///< host: the rows' post call begins
  uint64_t combPosted;    ///< host: combine rows posted
  uint64_t combArrived;   ///< host: every owner's rows in, combineArrived stored
  uint64_t sumStart;      ///< device: combine-recv saw combineArrived
  uint64_t sumEnd;        ///< device: combine-recv's last block finished
  uint64_t routeEnd;      ///< device: the dispatch route kernel finished (heads stored and fenced)
  uint64_t packEntered;   ///< device: the dispatch pack kernel's block 0 began
  uint64_t rankEnd;       ///< device: the rank kernel's last block finished
  uint64_t copyEntered;   ///< device: the copy kernel's block 0 began
};
constexpr uint32_t kTraceRounds = 1024;  ///< ring of per-round records (round % kTraceRounds)

/// The host-mapped control block of one object (cudaHostAlloc, mapped). Each direction on its own cache lines.
struct Mailbox {
  // Kernels -> proxy.
  alignas(64) uint64_t dispatchReady;  ///< rounds whose send slots (heads + entries) are packed
  uint64_t combineReady;               ///< rounds whose combine rows are packed
  int32_t combineType;                 ///< expertY of the combine being published (CombineType)
  // Proxy -> kernels.
  alignas(64) uint64_t dispatchArrived;  ///< rounds whose peers' tokens are in and whose tables are written
  uint64_t combineArrived;               ///< rounds whose owners' rows are in
  int32_t abort;  ///< 1: the proxy failed or lost the round (the next API call throws); kernels stop waiting
  alignas(64) ErrorRecord error;  ///< written by the first failing kernel
  /// Elastic ranks: combine positions left out because their rank was masked, so far (the combine receive's last
  /// block copies the device total here; droppedTokens reads it).
  alignas(64) uint64_t dropped;
};

/// Geometry of the per-round tables (u32 words, host-mapped, written by the proxy before dispatchArrived):
///   entries[W]            entries sender s sent this rank
///   entryStart[W + 1]     prefix sum of entries (work items of the copy kernel)
///   overflowStart[W]      where s's overflow starts in this rank's overflow region (entries)
///   slotOffset[L][W + 1]  rows of local expert le from senders before s (RoundLayout::slotOffset)
///   outputRowBase[L]      first row of le in outExpertX / expertY
///   localRows[L]          rows of le this round (outExpertNumTokens)
///   sendCum[G * L + 1]    combine send buffer: first row of piece (g, le) (rows of group g's senders for le)
///   recvStart[W]          combine: first row of owner p's message (p == rank: 0, in the scratch's own rows, or with
///                         the NVLink path at its combine receive offset in this rank's region)
///   rowBase[D][E]         combine: row of the first token of group sender d for expert e in owner e / L's message
///   sendDest[G]           combine: where this rank's message lands in a combine receive buffer of group g (rows)
///   masked[1 + W]         elastic ranks: [0] the number of masked ranks, [1 + r] 1 when rank r is masked (the mask
///                         the round's RoundLayout was built with; all 0 while every rank is active)
///
/// Elastic ranks: the route kernel and the combine receive drop the positions whose token's sending rank or whose
/// expert's rank is masked, as the host backend and the CPU reference do. Both read `masked` from the device copy of
/// the tables (ScratchGeometry::offTables): the combine receive its own round's, the route kernel the last round's
/// (the mask changes between rounds only; after an agreement that no round carried, the host writes the copy).
struct TableGeometry {
  uint32_t W, L, G, D, E;
  uint32_t offEntries, offEntryStart, offOverflowStart, offSlotOffset, offOutputRowBase, offLocalRows, offSendCum,
      offRecvStart, offRowBase, offSendDest, offMasked, words;
};
inline TableGeometry tableGeometry(const proxy::ProtocolSizes& s) {
  TableGeometry t{};
  t.W = s.worldSize;
  t.L = s.numLocalExperts;
  t.G = s.numDpGroups();
  t.D = s.dpSize;
  t.E = s.numExperts;
  uint32_t at = 0;
  t.offEntries = at;
  at += t.W;
  t.offEntryStart = at;
  at += t.W + 1;
  t.offOverflowStart = at;
  at += t.W;
  t.offSlotOffset = at;
  at += t.L * (t.W + 1);
  t.offOutputRowBase = at;
  at += t.L;
  t.offLocalRows = at;
  at += t.L;
  t.offSendCum = at;
  at += t.G * t.L + 1;
  t.offRecvStart = at;
  at += t.W;
  t.offRowBase = at;
  at += t.D * t.E;
  t.offSendDest = at;
  at += t.G;
  t.offMasked = at;
  at += 1 + t.W;
  t.words = at;
  return t;
}
/// The round tables in bytes, in whole 16-byte words: the rank kernel loads them 16 bytes at a time (the padding is
/// never read as a table). Both the host-mapped tables and the scratch's device copy have this size.
EPCOMM_HD uint64_t tableBytes(const TableGeometry& t) { return 16ull * ((t.words + 3u) / 4u); }
/// Tables up to this size the rank kernel loads whole into shared memory, in one pass of 16-byte loads from host
/// memory; larger ones it reads where it uses them (4-byte loads: more PCIe requests from one SM).
constexpr uint64_t kRankSharedTableBytes = 32768;
/// Dynamic shared memory of the rank kernel: the tables, or 0 when they do not fit.
EPCOMM_HD uint64_t rankSharedBytes(const TableGeometry& t) {
  return tableBytes(t) <= kRankSharedTableBytes ? tableBytes(t) : 0;
}

/// Same-node peers over NVLink (EPCOMM_PROXY_LOCAL_SIZE > 1; ranks are grouped by node, rank / size). Every rank of a
/// node allocates one region of device memory (cudaMalloc), exports it with a CUDA IPC handle over the bootstrap and
/// maps its node peers' regions (no privileges, as the nvlink backend). Senders and owners of the node store into the
/// receiver's region and then raise their flag there (st.release.sys after the last block's system fence); the
/// receiver's kernels wait for those flags as well as for the proxy's arrival word. Local index i = rank - first. The
/// channel moves no bulk for these peers (ChannelOptions::bulkOverFabric) but still their heads and immediates, so the
/// RoundLayout, the tables and the proxy's waits are those of the fabric path. A rank is its own node peer: its own
/// entries and rows go through its own region too.
struct LocalGeometry {
  uint32_t size;             ///< ranks of this node; 0: no NVLink path (every peer over the fabric)
  uint32_t first;            ///< the node's first rank
  uint64_t offDispatchFlag;  ///< u64 [size]: rounds whose entries node sender i stored here (monotone)
  uint64_t offCombineFlag;   ///< u64 [size]: rounds whose combine rows node owner i stored here (monotone)
  uint64_t offEntries;       ///< [size][maxSendTokens entries]: node sender i's entries for this rank, by entry index
  uint64_t senderBytes;      ///< maxSendTokens * entryBytes
  uint64_t offRows;          ///< [combineRecvRows][combineRowBytesMax]: node owners' rows, at the channel's offsets
  uint64_t bytes;
  /// Whether rank r is on this node (and the NVLink path is on).
  EPCOMM_HD bool has(uint32_t r) const { return r - first < size; }
};
/// `size` ranks per node (<= 1: no NVLink path); `rank`: this rank.
inline LocalGeometry localGeometry(const proxy::ProtocolSizes& s, uint32_t size, uint32_t rank) {
  auto align = [](uint64_t x) { return (x + 255) & ~uint64_t{255}; };
  LocalGeometry g{};
  if (size <= 1) return g;
  g.size = size;
  g.first = rank / size * size;
  uint64_t at = 0;
  g.offDispatchFlag = at;
  at += 8ull * size;
  g.offCombineFlag = at;
  at = align(at + 8ull * size);
  g.offEntries = at;
  g.senderBytes = static_cast<uint64_t>(s.maxSendTokens) * s.entryBytes;
  at = align(at + size * g.senderBytes);
  g.offRows = at;
  at = align(at + s.combineRecvRows * s.combineRowBytesMax);
  g.bytes = at;
  return g;
}

/// Warps of the single-block ranking kernels (route, rank): each takes a contiguous chunk of the tokens (entries).
constexpr uint32_t kRankWarps = 32;
/// Dynamic shared memory of the route kernel: its per-warp counts (u32 [kRankWarps][max(E, W)]) when they fit in
/// 48 KiB (max(E, W) <= 384), else 0 and they stay in the scratch (offHist).
EPCOMM_HD uint64_t routeSharedBytes(const proxy::ProtocolSizes& s) {
  const uint64_t bytes = 4ull * kRankWarps * (s.numExperts > s.worldSize ? s.numExperts : s.worldSize);
  return bytes <= 49152 ? bytes : 0;
}

/// Device scratch of one object (cudaMalloc), by offsets in bytes from its base.
struct ScratchGeometry {
  uint64_t offSeq;       ///< u32 [4]: rounds completed by dispatch-send, dispatch-recv, combine-send, combine-recv
  uint64_t offDone;      ///< u32 [4]: blocks of the running launch that finished (last-block detection)
  uint64_t offClaimed;   ///< i32: the first failing kernel claims it (then every kernel bails out)
  uint64_t offBound;     ///< u32: the dispatch's token bound this round
  uint64_t offArrived;   ///< u64 [2]: block 0's copy of dispatchArrived / combineArrived, which the other blocks poll
  uint64_t offExperts;   ///< i32 [T][K]: the group tokens' experts, -1 masked / repeated / out of range / >= bound
  uint64_t offPos;       ///< u64 [T][K]: ((e + 1) << 32) | row of (t, k) among its group sender's rows of e; 0 none
  uint64_t offEntryOf;   ///< u32 [T][K]: own tokens: entry index in the owner's send slot (first k per owner)
  uint64_t offHist;      ///< u32 [kRankWarps][max(E, W)]: per-chunk counts of the route kernel
  uint64_t offCounts;    ///< u32 [max(E, W)]: the route kernel's totals (head counts)
  uint64_t offRecvHist;  ///< u32 [W][kRankWarps][L]: per-chunk counts of the rank kernel (one block per sender)
  uint64_t offEntryN;    ///< u32 [W][maxSend]: local experts each received entry names
  uint64_t offRowOf;     ///< u32 [W][maxSend][maxLocalPerEntry]: output row of each received entry's experts
  uint64_t offTables;    ///< tableBytes(): the rank kernel's device copy of the round's tables, which
                         ///< the copy and combine kernels read (one PCIe read per word per round, not per block)
  uint64_t offLocal;     ///< pointer [localSize]: the node ranks' regions as this process maps them (LocalGeometry)
  /// Without the NVLink path (localSize 0), this rank's own entries and combine rows stay in device memory (with it,
  /// they are in its region): they never cross PCIe. The pack kernel writes own entries here (by entry index), the
  /// combine send kernel own rows (the message to this rank's group, from row 0), and the receive kernels read them.
  uint64_t offOwnEntries;  ///< [maxSendTokens entries]
  uint64_t offOwnRows;     ///< [maxNumTokens * min(K, L) rows][combineRowBytesMax]
  uint64_t offDropped;     ///< u64: elastic ranks, combine positions dropped so far (device total)
  uint64_t bytes;
};
inline ScratchGeometry scratchGeometry(const proxy::ProtocolSizes& s, uint32_t maxNumTokens, uint32_t localSize = 0) {
  auto align = [](uint64_t x) { return (x + 255) & ~uint64_t{255}; };
  const uint64_t TK = static_cast<uint64_t>(maxNumTokens) * s.expertsPerToken;
  ScratchGeometry g{};
  uint64_t at = 0;
  g.offSeq = at;
  at += 16;
  g.offDone = at;
  at += 16;
  g.offClaimed = at;
  at += 4;
  g.offBound = at;
  at += 4;
  g.offArrived = at;  // 40: 8-byte aligned
  at = align(at + 16);
  g.offExperts = at;
  at = align(at + 4 * TK);
  g.offPos = at;
  at = align(at + 8 * TK);
  g.offEntryOf = at;
  at = align(at + 4 * TK);
  const uint64_t keys = s.numExperts > s.worldSize ? s.numExperts : s.worldSize;
  g.offHist = at;
  at = align(at + 4ull * kRankWarps * keys);
  g.offCounts = at;
  at = align(at + 4ull * keys);
  g.offRecvHist = at;
  at = align(at + 4ull * s.worldSize * kRankWarps * s.numLocalExperts);
  g.offEntryN = at;
  at = align(at + 4ull * s.worldSize * s.maxSendTokens);
  g.offRowOf = at;
  at = align(at + 4ull * s.worldSize * s.maxSendTokens * s.maxLocalPerEntry);
  g.offTables = at;
  at = align(at + tableBytes(tableGeometry(s)));
  g.offLocal = at;
  at = align(at + 8ull * localSize);
  const bool own = localSize == 0;
  g.offOwnEntries = at;
  at = align(at + (own ? static_cast<uint64_t>(s.maxSendTokens) * s.entryBytes : 0));
  g.offOwnRows = at;
  at = align(at + (own ? static_cast<uint64_t>(maxNumTokens) * s.maxLocalPerEntry * s.combineRowBytesMax : 0));
  g.offDropped = at;
  at = align(at + 8);
  g.bytes = at;
  return g;
}

/// Where a kernel finds the object's shared state.
struct DeviceState {
  uint8_t* scratch;    ///< device scratch (ScratchGeometry)
  Mailbox* mailbox;    ///< device pointer of the host-mapped mailbox
  TraceRound* trace;   ///< device pointer of the host-mapped trace ring, or null (tracing off)
  uint64_t timeoutNs;  ///< EPCOMM_TIMEOUT_MS; a kernel waits twice that for the proxy (whose own waits fire first)
  ScratchGeometry sg;
  LocalGeometry lg;       ///< same-node peers (lg.size 0: none)
  uint8_t* localMine;     ///< this rank's region (lg), or null
  uint8_t* const* local;  ///< device array [lg.size] in the scratch: every node rank's region as mapped here
};

/// Buffers of the channel as the GPU sees them (device pointers of the pinned, mapped host buffers).
struct ChannelView {
  uint8_t* send;         ///< dispatch send buffer: W send slots
  const uint8_t* recv;   ///< dispatch receive buffer: private slots + overflow
  uint8_t* combineSend;  ///< combine send buffer (fixed, worst case)
  const uint8_t* combineRecv;
  const uint32_t* tables;  ///< per-round tables (TableGeometry)
};

/// Dispatch send half: route (one block) then pack (many blocks; the last one signals dispatchReady).
struct DispatchSendArgs {
  proxy::ProtocolSizes sizes;
  TableGeometry tg;
  DeviceState st;
  ChannelView ch;
  const uint8_t* x;
  int64_t xRowStrideBytes;
  const uint8_t* xScale;
  int64_t xScaleStrides[2];  ///< elements (4 bytes)
  const void* indices;
  int32_t indexKind;
  int64_t indexStrides[2];
  uint32_t m;
  uint32_t maxNumTokens;
  const int32_t* boundM;  ///< nullable device scalar
};

/// Dispatch receive half: rank (one block per sender) then copy (many blocks).
struct DispatchRecvArgs {
  proxy::ProtocolSizes sizes;
  TableGeometry tg;
  DeviceState st;
  ChannelView ch;
  int32_t* outNumTokens;
  uint8_t* outX;
  int64_t outExpertStrideBytes;  ///< 0 for packed
  int64_t outRowStrideBytes;
  uint8_t* outScale;
  int64_t outScaleStrides[3];  ///< elements: expert (0 for packed), row, column
};

/// Combine send half: copies the rows of every DP group into the combine send buffer; the last block signals.
struct CombineSendArgs {
  proxy::ProtocolSizes sizes;
  TableGeometry tg;
  DeviceState st;
  ChannelView ch;
  const uint8_t* y;
  int64_t yExpertStride;  ///< elements; 0 for packed
  int64_t yRowStride;     ///< elements
  int32_t yType;          ///< CombineType
  uint32_t itemBytes;
  uint32_t hidden;
};

/// Combine receive half: the weighted sums.
struct CombineRecvArgs {
  proxy::ProtocolSizes sizes;
  TableGeometry tg;
  DeviceState st;
  ChannelView ch;
  uint32_t hidden;
  int32_t yType, outType;  ///< CombineType
  uint8_t* out;
  int64_t outRowStride;  ///< elements
  const void* indices;
  int32_t indexKind;
  int64_t indexStrides[2];
  const float* weights;
  int64_t weightStrides[2];
  uint32_t m;
  const int32_t* boundM;
  int32_t accumulate;
};

/// Launchers: each enqueues its kernels on `stream` and returns the cudaError_t of the launches (0 = success).
/// `blocks`: blocks of the multi-block kernels.
int launchDispatchSend(const DispatchSendArgs& a, uint32_t blocks, void* stream);
int launchDispatchRecv(const DispatchRecvArgs& a, uint32_t blocks, void* stream);
int launchCombineSend(const CombineSendArgs& a, uint32_t blocks, void* stream);
int launchCombineRecv(const CombineRecvArgs& a, uint32_t blocks, void* stream);
/// The trace's clock check: a one-thread kernel that answers `n` requests of the host in cell[0] (host-mapped) with
/// %globaltimer in cell[1] (see proxy_kernels.cu).
int launchClockProbe(uint64_t* cell, uint32_t n, void* stream);
/// Dynamic shared memory of the combine receive kernel (rowBase, recvStart, the token's terms).
uint64_t combineRecvSharedBytes(const proxy::ProtocolSizes& sizes);
/// Dynamic shared memory of the combine send kernel (piece starts) and of the copy kernel (entry and overflow starts).
inline uint64_t combineSendSharedBytes(const proxy::ProtocolSizes& s) {
  return 4ull * (2ull * s.numDpGroups() * s.numLocalExperts + 1 + s.numDpGroups());
}
inline uint64_t copySharedBytes(const proxy::ProtocolSizes& s) { return 4ull * (2ull * s.worldSize + 1); }
/// Raises the dynamic shared-memory limit of the kernels that use it to `bytes` (needed above 48 KiB); cudaError_t.
int configureKernels(uint32_t bytes);

}  // namespace gpuproxy
}  // namespace epcomm
