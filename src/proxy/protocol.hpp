// The multi-node proxy protocol of SPEC 1.2, written once: buffer sizes, wire formats, immediate tags and the
// per-round layout (offsets) derived from the routing counts. Shared by the host backend (CPU loops) and the
// future GPU `proxy` backend (kernels): both fill and read the same buffers through these formulas.
// docs/protocol.md describes the protocol in prose.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/layout.hpp"
#include "epcomm/config.hpp"
#include "epcomm/tensor.hpp"

namespace epcomm {
namespace proxy {

/// What an immediate announces. Combine phases carry the dtype of expertY so that a rank can tell a peer that
/// used another dtype from a peer that is late.
enum class Phase : uint32_t {
  kHead = 0,         ///< Routing counts (the head) have landed.
  kBulk = 1,         ///< Tokens have landed: the sender's private-area entries, or its overflow share (two writes).
  kBarrier = 2,      ///< The sender finished reading its receive buffer (dispatch followed by dispatch).
  kCombineBf16 = 3,  ///< Combine rows (bf16) from an expert owner have landed.
  kCombineF16 = 4,
  kCombineF32 = 5,
  kNotice = 6,   ///< The sender gave up a round, or refused a call of it: its notice (NoticeWire) has landed.
  kConnect = 7,  ///< Connection setup at creation: the (lower) sender's connection to this rank is up.
};

/// "head", "bulk", "barrier", "combine".
const char* phaseName(Phase phase);
/// The combine phase of an expertY dtype (bf16, fp16, fp32); throws kInvalidArgument for others.
Phase combinePhase(DType dtype);

/// Bits of an immediate value: [31:16] object id, [15:13] phase, [12] round parity, [11:0] sender rank.
/// The sender is in the tag so that a receiver counts arrivals per peer (and names the missing one); the object
/// id lets several AllToAll objects share one engine; the parity separates consecutive rounds.
constexpr uint32_t kMaxRanks = 1u << 12;
constexpr uint32_t kMaxObjectIds = 1u << 16;

/// Encodes an immediate value.
inline uint32_t encodeImm(uint32_t objectId, Phase phase, uint32_t round, uint32_t sender) {
  return (objectId << 16) | (static_cast<uint32_t>(phase) << 13) | ((round & 1u) << 12) | (sender & (kMaxRanks - 1));
}

/// Fields of an immediate value.
struct ImmFields {
  uint32_t objectId;
  Phase phase;
  uint32_t parity;
  uint32_t sender;
};
inline ImmFields decodeImm(uint32_t imm) {
  return ImmFields{imm >> 16, static_cast<Phase>((imm >> 13) & 7u), (imm >> 12) & 1u, imm & (kMaxRanks - 1)};
}

/// A notice: what a rank that refuses a call of a round, or gives the round up, writes into every peer's notice slot
/// for it (kNoticeBytes per sender) before the immediate (kNotice, parity 0, sender). Peers waiting for that rank
/// raise its message at once instead of running into the timeout. `seq` is written at both ends, so a reader can
/// tell a slot that a newer notice is overwriting (it reads again later).
constexpr uint32_t kNoticeBytes = 512;
struct NoticeWire {
  uint32_t seq;     ///< 1, 2, ... per sender and object.
  uint32_t round;   ///< The round the notice is about (the channel's round number).
  uint8_t kind;     ///< 0: dispatch, 1: combine, 2: the sender left (destroyed its object mid-round).
  uint8_t fatal;    ///< 0: a refused call (nothing was sent; the round goes on if it calls again), 1: round lost.
  uint16_t length;  ///< Bytes of text.
  int32_t code;     ///< The sender's ErrorCode.
  char text[kNoticeBytes - 20];
  uint32_t seqEnd;  ///< == seq once the whole notice has landed.
};
static_assert(sizeof(NoticeWire) == kNoticeBytes, "a notice fills its slot");

/// Elastic ranks (docs/failures.md): the ranks of an object agree on a new active-ranks mask by writing these records
/// into each other's agreement slots (two per sender, by the parity of the proposed epoch, so that a record for the
/// next epoch never overwrites the one for this epoch) before the immediate (kConnect, parity 1, sender). A record is
/// the sender's proposal: the ranks it still believes alive (its view), the earliest round step it knows lost, and
/// why. `seq` is written at both ends, as in NoticeWire.
constexpr uint32_t kAgreeBytes = 1024;
constexpr uint64_t kNoLostStep = ~0ull;  ///< AgreeWire::lostStep when no round was lost (a caller's mask change).
struct AgreeWire {
  uint32_t seq;       ///< 1, 2, ... per sender and object.
  uint32_t epoch;     ///< The epoch the record proposes (the sender's current epoch + 1).
  uint64_t lostStep;  ///< 2 * round + (0 dispatch, 1 combine), rounds counted from the start of the sender's epoch.
  int32_t code;       ///< ErrorCode of the loss (0 for a caller's mask change).
  uint16_t length;    ///< Bytes of text.
  uint16_t reserved;
  char text[480];
  uint64_t view[kMaxRanks / 64];  ///< Bit r: the sender believes rank r alive and active.
  uint32_t seqEnd;                ///< == seq once the whole record has landed.
  uint32_t pad;
};
static_assert(sizeof(AgreeWire) == kAgreeBytes, "a record fills its slot");

/// entryCounts[q] of a head whose sender has rank q masked: receivers check that every head marks exactly the ranks
/// they mask (so ranks that disagree on the mask fail the round instead of computing different offsets).
constexpr uint32_t kMaskedEntries = 0xFFFFFFFFu;

/// Sizes of one object's registered buffers and wire formats. Pure arithmetic on the Config.
///
/// Dispatch wire format. A sender packs, for every destination rank p, one *send slot*:
///   head  = [u32 expertCounts[E]] [u32 entryCounts[W]]  (padded to 16 bytes); the same head goes to every peer.
///   entry = [payload hiddenDimBytes] [scales hiddenDimScaleBytes] [u32 token] [u16 n] [u16 localExpert[n]]
///           (padded to 16 bytes): one entry per (token, destination rank), however many of p's experts it uses.
/// entryCounts[p] entries follow the head, tokens ascending. The receiver's buffer holds one *private slot* per
/// sender ([head][privateTokens entries]) and one shared *overflow* region of entries.
///
/// Combine wire format: rows of H elements of expertY's dtype; owner p sends group g the rows of g's senders,
/// local expert major, then (sender, token) order: exactly a contiguous range of each expert's rows.
struct ProtocolSizes {
  uint32_t worldSize = 0;
  uint32_t rank = 0;
  uint32_t dpSize = 1;
  uint32_t numExperts = 0;
  uint32_t numLocalExperts = 0;
  uint32_t expertsPerToken = 0;
  uint32_t maxSendTokens = 0;     ///< Entries one sender can send one peer: ceil(maxNumTokens / D).
  uint32_t privateTokens = 0;     ///< Entries of each sender's private area on each receiver.
  uint32_t maxLocalPerEntry = 0;  ///< min(K, L): local experts one entry can name.
  uint64_t payloadBytes = 0;      ///< hiddenDimBytes.
  uint64_t scaleBytes = 0;        ///< hiddenDimScaleBytes.
  uint64_t metaOffset = 0;        ///< Offset of the entry's metadata (token, n, experts).
  uint64_t entryBytes = 0;
  uint64_t headBytes = 0;
  uint64_t sendSlotBytes = 0;       ///< head + maxSendTokens entries.
  uint64_t privateSlotBytes = 0;    ///< head + privateTokens entries.
  uint64_t overflowEntries = 0;     ///< W * (maxSendTokens - privateTokens).
  uint64_t sendBytes = 0;           ///< Dispatch send buffer: W send slots.
  uint64_t recvBytes = 0;           ///< Dispatch receive buffer: W private slots + overflow.
  uint64_t combineElemBytes = 4;    ///< Largest expertY element the combine receive buffer holds (fp32).
  uint64_t combineRowBytesMax = 0;  ///< H * combineElemBytes.
  uint64_t combineSendRows = 0;     ///< Rows an owner may have to send (worst case): G * maxNumTokens * min(K, L).
  uint64_t combineRecvRows = 0;     ///< Rows a rank can receive: maxNumTokens * min(K, E).
  /// Combine send buffer at creation: the expected rows (derivedCombineSendRows) in 2-byte elements (bf16 / fp16).
  /// It is local (never a write's destination), so the channel grows it when a round needs more rows or wider
  /// elements, up to combineSendBytesMax.
  uint64_t combineSendInitialRows = 0;
  uint64_t combineSendBytes = 0;     ///< Initial bytes of the combine send buffer.
  uint64_t combineSendBytesMax = 0;  ///< combineSendRows * combineRowBytesMax: what fixed sizing would take.
  uint64_t combineRecvBytes = 0;
  Layout layout = Layout::kBatched;  ///< Output layout (where unpacked rows go).
  uint32_t expertPadding = 1;
  uint64_t batchedRowsPerExpert = 0;

  /// Offset of send slot p in the send buffer.
  EPCOMM_HD uint64_t sendSlotOffset(uint32_t p) const { return p * sendSlotBytes; }
  /// Offset of sender s's private slot in the receive buffer.
  EPCOMM_HD uint64_t privateSlotOffset(uint32_t s) const { return s * privateSlotBytes; }
  /// Offset of the overflow region in the receive buffer.
  EPCOMM_HD uint64_t overflowOffset() const { return static_cast<uint64_t>(worldSize) * privateSlotBytes; }
  EPCOMM_HD uint32_t numDpGroups() const { return worldSize / dpSize; }
};

/// Entry metadata, at ProtocolSizes::metaOffset of an entry: u32 token, u16 n, u16 localExpert[n].
constexpr uint32_t kEntryTokenOffset = 0;
constexpr uint32_t kEntryCountOffset = 4;
constexpr uint32_t kEntryExpertsOffset = 6;

/// Offset in the receive buffer of entry j from sender s (not this rank): the first privateTokens entries are in s's
/// private slot, the rest in the overflow region from `overflowStart` (s's start there, in entries; see
/// RoundLayout::overflowStart). Usable in kernels.
EPCOMM_HD uint64_t recvEntryOffset(const ProtocolSizes& sizes, uint32_t s, uint32_t j, uint64_t overflowStart) {
  return j < sizes.privateTokens
             ? sizes.privateSlotOffset(s) + sizes.headBytes + j * sizes.entryBytes
             : sizes.overflowOffset() + (overflowStart + j - sizes.privateTokens) * sizes.entryBytes;
}

/// The default private area: the expected entries from one sender, maxSendTokens * K / W (each token reaches a
/// given rank with probability about K * L / E = K / W), plus a quarter and 4 entries of margin, at most
/// maxSendTokens.
uint32_t derivedPrivateTokens(const Config& config);

/// The combine send rows an owner expects per round: G * maxNumTokens * K / W (each routed expert is one of this
/// rank's L with probability L / E = 1 / W), plus a quarter and 4 rows of margin, at most the worst case
/// G * maxNumTokens * min(K, L).
uint64_t derivedCombineSendRows(const Config& config);

/// Sizes for `config`; privateTokens < 0 means EPCOMM_PRIVATE_TOKENS, and when that is also < 0 the derived
/// default. Throws kInvalidConfig when the world is too large for the immediate tags.
ProtocolSizes computeSizes(const Config& config, int64_t privateTokens);

/// Head accessors over a head's bytes.
EPCOMM_HD uint32_t* headExpertCounts(void* head) { return static_cast<uint32_t*>(head); }
EPCOMM_HD uint32_t* headEntryCounts(void* head, uint32_t numExperts) {
  return static_cast<uint32_t*>(head) + numExperts;
}

/// The offsets of one round, computed from every sender's head once all heads are in (by every rank, each for
/// itself, in the proxy, off the data path). Owns a copy of the counts: the receive buffer may be overwritten by
/// the next round while combine still needs them.
class RoundLayout {
 public:
  /// counts: W rows of (E + W) u32, sender s's head at row s. `active` (W entries, 1 = active; empty = all active):
  /// a masked sender's row and every count towards a masked rank's experts count as zero, so no offset depends on
  /// them. Throws kPeerFailure when a head's marks of masked ranks (kMaskedEntries) differ from `active`.
  void build(const ProtocolSizes& sizes, std::vector<uint32_t> counts, const std::vector<uint8_t>& active = {});
  /// The mask the layout was built with (W entries; all 1 when built without one).
  const std::vector<uint8_t>& active() const { return active_; }
  /// Whether rank r took part in the round.
  bool isActive(uint32_t r) const { return active_[r] != 0; }

  /// Rows sender s sent to global expert e.
  uint32_t expertCount(uint32_t s, uint32_t e) const { return counts_[static_cast<size_t>(s) * stride_ + e]; }
  /// Entries sender s sent to rank p.
  uint32_t entries(uint32_t s, uint32_t p) const { return counts_[static_cast<size_t>(s) * stride_ + E_ + p]; }
  /// Entries of s beyond p's private area, and where they start in p's overflow region (in entries).
  uint32_t overflowEntries(uint32_t s, uint32_t p) const;
  uint64_t overflowStart(uint32_t s, uint32_t p) const { return overflowStart_[static_cast<size_t>(s) * W_ + p]; }
  /// This rank's local expert le: rows from senders before s (slot offset of s's rows), and the total.
  uint64_t slotOffset(uint32_t le, uint32_t s) const { return slotOffset_[static_cast<size_t>(le) * (W_ + 1) + s]; }
  uint64_t localExpertRows(uint32_t le) const { return slotOffset(le, W_); }
  /// Rows owner p sends to DP group g in combine.
  uint64_t combineRows(uint32_t p, uint32_t g) const { return combineRows_[static_cast<size_t>(p) * G_ + g]; }
  /// Where this rank packs the rows for group g in its combine send buffer (rows).
  uint64_t combineSendStart(uint32_t g) const { return combineSendStart_[g]; }
  /// Where owner p's rows land in the combine receive buffer of a rank of this rank's group (rows).
  uint64_t combineRecvStart(uint32_t p) const { return combineRecvStart_[p]; }
  /// Where owner p's rows land in the combine receive buffer of any rank of group g (rows).
  uint64_t combineRecvStartIn(uint32_t g, uint32_t p) const {
    return combineRecvStartIn_[static_cast<size_t>(g) * W_ + p];
  }
  /// Rows of owner p's message to this rank's group before local expert le (the message is expert-major), for the
  /// global expert e = p * L + le.
  uint64_t combineExpertStart(uint32_t e) const { return combineExpertStart_[e]; }
  /// First row of local expert le in outExpertX / expertY (batched: le * R; packed: padded prefix sum).
  uint64_t outputRowBase(uint32_t le) const { return outputRowBase_[le]; }
  /// Offset of entry j from sender s in this rank's receive buffer (s != this rank).
  uint64_t recvEntryOffset(const ProtocolSizes& sizes, uint32_t s, uint32_t j) const {
    return proxy::recvEntryOffset(sizes, s, j, overflowStart(s, rank_));
  }
  bool valid() const { return W_ != 0; }

 private:
  uint32_t W_ = 0, E_ = 0, L_ = 0, D_ = 1, G_ = 0, rank_ = 0, private_ = 0;
  size_t stride_ = 0;
  std::vector<uint32_t> counts_;
  std::vector<uint8_t> active_;
  std::vector<uint64_t> overflowStart_;
  std::vector<uint64_t> slotOffset_;
  std::vector<uint64_t> combineRows_;
  std::vector<uint64_t> combineSendStart_;
  std::vector<uint64_t> combineRecvStart_;
  std::vector<uint64_t> combineRecvStartIn_;
  std::vector<uint64_t> combineExpertStart_;
  std::vector<uint64_t> outputRowBase_;
};

}  // namespace proxy
}  // namespace epcomm
