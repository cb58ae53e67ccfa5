#include "proxy/protocol.hpp"

#include <algorithm>

#include "core/env.hpp"
#include "epcomm/error.hpp"

namespace epcomm {
namespace proxy {

const char* phaseName(Phase phase) {
  switch (phase) {
    case Phase::kHead:
      return "head (routing counts)";
    case Phase::kBulk:
      return "bulk (tokens: the private area's, then the overflow)";
    case Phase::kBarrier:
      return "barrier";
    case Phase::kCombineBf16:
    case Phase::kCombineF16:
    case Phase::kCombineF32:
      return "combine rows";
    case Phase::kNotice:
      return "notice";
    case Phase::kConnect:
      return "hello (connection setup)";
  }
  return "?";
}

Phase combinePhase(DType dtype) {
  switch (dtype) {
    case DType::kBf16:
      return Phase::kCombineBf16;
    case DType::kF16:
      return Phase::kCombineF16;
    case DType::kF32:
      return Phase::kCombineF32;
    default:
      break;
  }
  EPCOMM_THROW(kInvalidArgument, "expertY must be bf16, fp16 or fp32, got " << dtypeName(dtype));
}

uint32_t derivedPrivateTokens(const Config& c) {
  const uint64_t maxSend = ceilDiv(c.maxNumTokens, c.dpSize);
  const uint64_t expected = ceilDiv(maxSend * c.expertsPerToken, c.worldSize);
  const uint64_t withMargin = expected + expected / 4 + 4;
  return static_cast<uint32_t>(std::min<uint64_t>(withMargin, maxSend));
}

uint64_t derivedCombineSendRows(const Config& c) {
  const uint64_t tokens = static_cast<uint64_t>(c.numDpGroups()) * c.maxNumTokens;
  const uint64_t worst = tokens * std::min(c.expertsPerToken, c.numLocalExperts());
  const uint64_t expected = ceilDiv(tokens * c.expertsPerToken, c.worldSize);
  return std::min<uint64_t>(expected + expected / 4 + 4, worst);
}

ProtocolSizes computeSizes(const Config& c, int64_t privateTokens) {
  c.validate();
  EPCOMM_CHECK(c.worldSize <= kMaxRanks, kInvalidConfig,
               "worldSize " << c.worldSize << " exceeds the " << kMaxRanks << " ranks the immediate tags can name");
  ProtocolSizes s;
  s.worldSize = c.worldSize;
  s.rank = c.rank;
  s.dpSize = c.dpSize;
  s.numExperts = c.numExperts;
  s.numLocalExperts = c.numLocalExperts();
  s.expertsPerToken = c.expertsPerToken;
  s.maxSendTokens = static_cast<uint32_t>(ceilDiv(c.maxNumTokens, c.dpSize));
  if (privateTokens < 0) privateTokens = env().privateTokens;
  s.privateTokens = privateTokens < 0 ? derivedPrivateTokens(c)
                                      : static_cast<uint32_t>(std::min<int64_t>(privateTokens, s.maxSendTokens));
  s.maxLocalPerEntry = std::min(c.expertsPerToken, s.numLocalExperts);
  EPCOMM_CHECK(s.numLocalExperts <= 0xFFFF, kInvalidConfig,
               "the host/proxy protocol names local experts with 16 bits; L = " << s.numLocalExperts);
  s.payloadBytes = c.hiddenDimBytes;
  s.scaleBytes = c.hiddenDimScaleBytes;
  s.metaOffset = s.payloadBytes + s.scaleBytes;
  s.entryBytes = roundUpPow2(s.metaOffset + 4 + 2 + 2ull * s.maxLocalPerEntry, 16);
  s.headBytes = roundUpPow2(4ull * (c.numExperts + c.worldSize), 16);
  s.sendSlotBytes = s.headBytes + s.maxSendTokens * s.entryBytes;
  s.privateSlotBytes = s.headBytes + s.privateTokens * s.entryBytes;
  s.overflowEntries = static_cast<uint64_t>(c.worldSize) * (s.maxSendTokens - s.privateTokens);
  s.sendBytes = c.worldSize * s.sendSlotBytes;
  s.recvBytes = c.worldSize * s.privateSlotBytes + s.overflowEntries * s.entryBytes;
  s.combineRowBytesMax = static_cast<uint64_t>(c.hiddenDim) * s.combineElemBytes;
  s.combineSendRows = static_cast<uint64_t>(c.numDpGroups()) * c.maxNumTokens * s.maxLocalPerEntry;
  s.combineRecvRows = static_cast<uint64_t>(c.maxNumTokens) * std::min(c.expertsPerToken, c.numExperts);
  s.combineSendInitialRows = derivedCombineSendRows(c);
  s.combineSendBytes = s.combineSendInitialRows * c.hiddenDim * 2ull;
  s.combineSendBytesMax = s.combineSendRows * s.combineRowBytesMax;
  s.combineRecvBytes = s.combineRecvRows * s.combineRowBytesMax;
  s.layout = c.layout;
  s.expertPadding = c.expertPadding;
  s.batchedRowsPerExpert = c.batchedRowsPerExpert();
  return s;
}

uint32_t RoundLayout::overflowEntries(uint32_t s, uint32_t p) const {
  const uint32_t n = entries(s, p);
  return n > private_ ? n - private_ : 0;
}

void RoundLayout::build(const ProtocolSizes& sizes, std::vector<uint32_t> counts, const std::vector<uint8_t>& active) {
  W_ = sizes.worldSize;
  E_ = sizes.numExperts;
  L_ = sizes.numLocalExperts;
  D_ = sizes.dpSize;
  G_ = W_ / D_;
  rank_ = sizes.rank;
  private_ = sizes.privateTokens;
  stride_ = static_cast<size_t>(E_) + W_;
  EPCOMM_CHECK(counts.size() == stride_ * W_, kInternal,
               "round layout: " << counts.size() << " counts for " << W_ << " heads of " << stride_);
  EPCOMM_CHECK(active.empty() || active.size() == W_, kInternal,
               "round layout: a mask of " << active.size() << " ranks for " << W_);
  counts_ = std::move(counts);
  active_ = active.empty() ? std::vector<uint8_t>(W_, 1) : active;
  // Masked ranks (elastic ranks): a masked sender's head is not read (it never arrived, or is stale), and nothing
  // is counted towards a masked rank's experts, so that every active rank derives the same offsets without them.
  // Every active sender marks the ranks it masks; a mark that differs from this rank's mask means the two ranks
  // agreed on different masks, and the round must not go on with offsets that differ.
  for (uint32_t s = 0; s < W_; ++s) {
    uint32_t* row = counts_.data() + static_cast<size_t>(s) * stride_;
    if (!active_[s]) {
      std::fill(row, row + stride_, 0u);
      continue;
    }
    for (uint32_t q = 0; q < W_; ++q) {
      const bool marked = row[E_ + q] == kMaskedEntries;
      EPCOMM_CHECK(marked == !active_[q], kPeerFailure,
                   "rank " << rank_ << ": rank " << s << "'s head " << (marked ? "masks" : "does not mask") << " rank "
                           << q << " but this rank " << (active_[q] ? "does not" : "does")
                           << " (the ranks agreed on different masks)");
      if (active_[q]) continue;
      row[E_ + q] = 0;
      std::fill(row + static_cast<size_t>(q) * L_, row + static_cast<size_t>(q + 1) * L_, 0u);
    }
  }

  // Overflow: on every receiver p, senders' remaining entries back to back in sender order, so each sender
  // knows where its one bulk write goes as soon as it has every head.
  overflowStart_.assign(static_cast<size_t>(W_) * W_, 0);
  for (uint32_t p = 0; p < W_; ++p) {
    uint64_t at = 0;
    for (uint32_t s = 0; s < W_; ++s) {
      overflowStart_[static_cast<size_t>(s) * W_ + p] = at;
      at += overflowEntries(s, p);
    }
    EPCOMM_CHECK(at <= sizes.overflowEntries, kInternal,
                 "overflow of rank " << p << " needs " << at << " entries, the buffer has " << sizes.overflowEntries);
  }

  slotOffset_.assign(static_cast<size_t>(L_) * (W_ + 1), 0);
  for (uint32_t le = 0; le < L_; ++le) {
    uint64_t at = 0;
    for (uint32_t s = 0; s < W_; ++s) {
      slotOffset_[static_cast<size_t>(le) * (W_ + 1) + s] = at;
      at += expertCount(s, rank_ * L_ + le);
    }
    slotOffset_[static_cast<size_t>(le) * (W_ + 1) + W_] = at;
  }

  combineRows_.assign(static_cast<size_t>(W_) * G_, 0);
  for (uint32_t s = 0; s < W_; ++s) {
    const uint32_t g = s / D_;
    for (uint32_t e = 0; e < E_; ++e) combineRows_[static_cast<size_t>(e / L_) * G_ + g] += expertCount(s, e);
  }
  combineSendStart_.assign(G_, 0);
  uint64_t at = 0;
  for (uint32_t g = 0; g < G_; ++g) {
    combineSendStart_[g] = at;
    at += combineRows(rank_, g);
  }
  EPCOMM_CHECK(at <= sizes.combineSendRows, kInternal,
               "combine send needs " << at << " rows, the buffer has " << sizes.combineSendRows);
  // Every rank of group g receives the owners' messages back to back in owner order.
  combineRecvStartIn_.assign(static_cast<size_t>(G_) * W_, 0);
  for (uint32_t g = 0; g < G_; ++g) {
    at = 0;
    for (uint32_t p = 0; p < W_; ++p) {
      combineRecvStartIn_[static_cast<size_t>(g) * W_ + p] = at;
      at += combineRows(p, g);
    }
    EPCOMM_CHECK(
        at <= sizes.combineRecvRows, kInternal,
        "combine receive of group " << g << " needs " << at << " rows, the buffer has " << sizes.combineRecvRows);
  }
  combineRecvStart_.assign(W_, 0);
  for (uint32_t p = 0; p < W_; ++p) combineRecvStart_[p] = combineRecvStartIn(rank_ / D_, p);

  // An owner's message to group g is expert-major: local expert le's rows from g's senders form one contiguous
  // range of that expert's rows (senders of a group are consecutive ranks).
  const uint32_t g = rank_ / D_;
  combineExpertStart_.assign(E_, 0);
  for (uint32_t p = 0; p < W_; ++p) {
    at = 0;
    for (uint32_t le = 0; le < L_; ++le) {
      combineExpertStart_[p * L_ + le] = at;
      for (uint32_t s = g * D_; s < (g + 1) * D_; ++s) at += expertCount(s, p * L_ + le);
    }
  }

  outputRowBase_.assign(L_, 0);
  at = 0;
  for (uint32_t le = 0; le < L_; ++le) {
    if (sizes.layout == Layout::kBatched) {
      outputRowBase_[le] = le * sizes.batchedRowsPerExpert;
    } else {
      outputRowBase_[le] = at;
      at += roundUpPow2(localExpertRows(le), sizes.expertPadding);
    }
  }
}

}  // namespace proxy
}  // namespace epcomm
