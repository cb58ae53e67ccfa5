// ranksCitedBy: the ranks behind the PeerIds that an engine error cites (the channel names ranks, the engine PeerIds).
#include "proxy/channel_wait.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace epcomm {
namespace proxy {
namespace {

// Rank 0's PeerIds in a world of 4: its peers 1, 2, 3 are PeerIds 0, 1, 2 (its own entry is unused).
const std::vector<uint32_t> kPeerIds = {0, 0, 1, 2};
const std::vector<uint32_t> kPeers = {1, 2, 3};

TEST(RanksCitedBy, MapsTheEnginesPeerIdToTheRank) {
  const std::string m =
      "scatter to peer 1 (NIC 0, provider tcp;ofi_rxm, fi_cq_readerr) failed: Transport endpoint is not connected";
  EXPECT_EQ(ranksCitedBy(m, kPeerIds, kPeers), std::vector<uint32_t>({2}));
  EXPECT_EQ(rankList(ranksCitedBy(m, kPeerIds, kPeers)), "rank 2");
}

TEST(RanksCitedBy, EveryCitedPeerOnceInRankOrder) {
  const std::string m = "write to peer 2 (NIC 0, ...) timed out; write to peer 0 (NIC 0, ...) failed; write to peer 2";
  EXPECT_EQ(ranksCitedBy(m, kPeerIds, kPeers), std::vector<uint32_t>({1, 3}));
}

TEST(RanksCitedBy, NothingWhenNoPeerOfTheGivenRanksIsCited) {
  EXPECT_TRUE(ranksCitedBy("fi_cq_read on NIC 0 (provider tcp) failed: Input/output error", kPeerIds, kPeers).empty());
  EXPECT_TRUE(ranksCitedBy("write to peer 7 (NIC 0)", kPeerIds, kPeers).empty());  // not a peer of these ranks
  EXPECT_TRUE(ranksCitedBy("write to peer 99999999999999999999", kPeerIds, kPeers).empty());  // no overflow
  EXPECT_TRUE(ranksCitedBy("write to peer x", kPeerIds, kPeers).empty());
  EXPECT_EQ(ranksCitedBy("write to peer 1 (NIC 0)", kPeerIds, {3}), std::vector<uint32_t>());  // rank 2 not asked for
}

}  // namespace
}  // namespace proxy
}  // namespace epcomm
