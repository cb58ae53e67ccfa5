// The protocol arithmetic alone (one process): immediate tags, buffer sizes, and the offsets of a round.
#include <gtest/gtest.h>

#include <set>

#include "proxy/protocol.hpp"

namespace epcomm {
namespace proxy {
namespace {

Config smallConfig(uint32_t W, uint32_t D, uint32_t rank) {
  Config c;
  c.maxNumTokens = 8;
  c.numExperts = 2 * W;
  c.expertsPerToken = 2;
  c.worldSize = W;
  c.rank = rank;
  c.dpSize = D;
  c.hiddenDim = 16;
  c.hiddenDimBytes = 32;
  c.hiddenDimScaleBytes = 8;
  c.expertPadding = 4;
  c.layout = Layout::kPacked;
  return c;
}

TEST(ProxyProtocol, ImmediatesAreDistinctAndRoundTrip) {
  std::set<uint32_t> seen;
  for (uint32_t obj : {0u, 1u, 65535u}) {
    for (Phase ph : {Phase::kHead, Phase::kBulk, Phase::kBarrier, Phase::kCombineBf16, Phase::kCombineF32}) {
      for (uint32_t round : {0u, 1u}) {
        for (uint32_t s : {0u, 5u, kMaxRanks - 1}) {
          const uint32_t imm = encodeImm(obj, ph, round, s);
          EXPECT_TRUE(seen.insert(imm).second);
          const ImmFields f = decodeImm(imm);
          EXPECT_EQ(f.objectId, obj);
          EXPECT_EQ(f.phase, ph);
          EXPECT_EQ(f.parity, round);
          EXPECT_EQ(f.sender, s);
        }
      }
    }
  }
}

TEST(ProxyProtocol, SizesFollowTheConfig) {
  const Config c = smallConfig(4, 2, 1);
  const ProtocolSizes s = computeSizes(c, 3);
  EXPECT_EQ(s.maxSendTokens, 4u);  // ceil(8 / D)
  EXPECT_EQ(s.privateTokens, 3u);
  EXPECT_EQ(s.entryBytes % 16, 0u);
  EXPECT_GE(s.entryBytes, 32u + 8u + 4u + 2u + 2u * 2u);
  EXPECT_EQ(s.headBytes, 4u * (8 + 4) + 0u);
  EXPECT_EQ(s.overflowEntries, 4u * (4 - 3));
  EXPECT_EQ(s.recvBytes, 4 * (s.headBytes + 3 * s.entryBytes) + 4 * s.entryBytes);
  EXPECT_EQ(computeSizes(c, 100).privateTokens, 4u) << "clamped to the most a sender can send";
  // Derived: expected entries per sender plus margin, never more than a sender can send.
  Config big = smallConfig(64, 1, 0);
  big.maxNumTokens = 128;
  big.numExperts = 256;
  big.expertsPerToken = 8;
  EXPECT_EQ(derivedPrivateTokens(big), 16u + 4u + 4u);
  EXPECT_EQ(derivedPrivateTokens(smallConfig(2, 1, 0)), 8u);
  // Combine send: expected rows (G x T x K / W + 25% + 4) in 2-byte elements at creation, the worst case in fp32
  // only as the bound of growth. 64 ranks, 128 tokens, K = 8 of 256 experts: 128 x 64 x 8 / 64 = 1024 expected.
  const ProtocolSizes b = computeSizes(big, -1);
  EXPECT_EQ(b.combineSendInitialRows, 1024u + 256u + 4u);
  EXPECT_EQ(b.combineSendRows, 64u * 128u * 4u);  // G x T x min(K, L = 4)
  EXPECT_EQ(b.combineSendBytes, b.combineSendInitialRows * big.hiddenDim * 2);
  EXPECT_EQ(b.combineSendBytesMax, b.combineSendRows * big.hiddenDim * 4);
  EXPECT_EQ(derivedCombineSendRows(smallConfig(1, 1, 0)), computeSizes(smallConfig(1, 1, 0), -1).combineSendRows)
      << "capped at the worst case";
}

TEST(ProxyProtocol, RoundLayoutOffsets) {
  // W = 2, D = 1, E = 4 (L = 2), private area 1 entry.
  const Config c = smallConfig(2, 1, 1);
  const ProtocolSizes s = computeSizes(c, 1);
  const uint32_t stride = 4 + 2;
  std::vector<uint32_t> counts(2 * stride, 0);
  // Sender 0: experts {0:1, 1:0, 2:3, 3:2}, entries {to 0: 1, to 1: 4}.
  uint32_t h0[] = {1, 0, 3, 2, 1, 4};
  // Sender 1: experts {0:2, 1:2, 2:1, 3:0}, entries {to 0: 3, to 1: 1}.
  uint32_t h1[] = {2, 2, 1, 0, 3, 1};
  std::copy(h0, h0 + stride, counts.begin());
  std::copy(h1, h1 + stride, counts.begin() + stride);
  RoundLayout lay;
  lay.build(s, counts);
  EXPECT_EQ(lay.overflowEntries(0, 1), 3u);
  EXPECT_EQ(lay.overflowEntries(1, 0), 2u);
  EXPECT_EQ(lay.overflowStart(0, 1), 0u);
  EXPECT_EQ(lay.overflowStart(1, 1), 3u);
  // Rank 1's local experts 0 and 1 are global 2 and 3.
  EXPECT_EQ(lay.slotOffset(0, 1), 3u);
  EXPECT_EQ(lay.localExpertRows(0), 4u);
  EXPECT_EQ(lay.localExpertRows(1), 2u);
  EXPECT_EQ(lay.outputRowBase(0), 0u);
  EXPECT_EQ(lay.outputRowBase(1), 4u);  // 4 rows, padding 4
  // Combine: owner 0 holds rows of experts 0, 1: from group 1 (sender 1) 2 + 2 rows.
  EXPECT_EQ(lay.combineRows(0, 1), 4u);
  EXPECT_EQ(lay.combineRows(1, 1), 1u);
  EXPECT_EQ(lay.combineRecvStart(0), 0u);
  EXPECT_EQ(lay.combineRecvStart(1), 4u);
  EXPECT_EQ(lay.combineExpertStart(1), 2u);  // owner 0's message to group 1: expert 0's 2 rows first
  EXPECT_EQ(lay.combineSendStart(0), 0u);
  EXPECT_EQ(lay.combineSendStart(1), 5u);  // rank 1 sends group 0 the 3 + 2 rows of sender 0
  const uint64_t off = lay.recvEntryOffset(s, 0, 2);
  EXPECT_EQ(off, s.overflowOffset() + 1 * s.entryBytes);
}

}  // namespace
}  // namespace proxy
}  // namespace epcomm
