// The nvlink backend's buffer geometry, on the host (no GPU): how many blocks share the routing scan, and the
// route table's index (every (sender, token, k) its own slot inside the region, pairs 16-byte aligned).
#include "backends/nvlink/nvlink_layout.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <vector>

#include "epcomm/config.hpp"

namespace epcomm {
namespace {

Config make(uint32_t tokens, uint32_t world, uint32_t k, uint32_t dp = 1) {
  Config c = standardConfig("decode", world, 0, dp);
  c.maxNumTokens = tokens;
  c.expertsPerToken = k;
  return c;
}

TEST(NvlinkLayout, PullOnlyForLargeBatchesOnSeveralRanks) {
  // Decode (128 tokens of 7 KB: 256 units of 4 KiB) pushes on 66 blocks (1056 warps); prefill (4096 tokens: 8192
  // units) pulls on 132 blocks; one rank never pulls. The bound: pull from one unit per warp on.
  EXPECT_EQ(nvlink::makeGeometry(make(128, 2, 8), 66).pull, 0u);
  EXPECT_EQ(nvlink::makeGeometry(make(512, 2, 8), 66).pull, 0u);
  EXPECT_EQ(nvlink::makeGeometry(make(4096, 2, 8), 132).pull, 1u);
  EXPECT_EQ(nvlink::makeGeometry(make(4096, 1, 8), 132).pull, 0u);
  EXPECT_EQ(nvlink::makeGeometry(make(527, 2, 8), 66).pull, 0u);  // 527 x 2 units < 66 x 16 warps
  EXPECT_EQ(nvlink::makeGeometry(make(528, 2, 8), 66).pull, 1u);
}

// The fused dispatch's roles: (B - R) / W own-token blocks (at least one), and room for them only with a payload block
// too when there are peers.
TEST(NvlinkLayout, FusedDispatchRoles) {
  const nvlink::Geometry decode = nvlink::makeGeometry(make(128, 2, 8), 66);
  EXPECT_EQ(decode.routeBlocks, 1u);
  EXPECT_EQ(nvlink::fusedOwnBlocks(decode), 32u);  // (66 - 1) / 2
  EXPECT_TRUE(nvlink::fusedRolesFit(decode));
  const nvlink::Geometry tight = nvlink::makeGeometry(make(32, 2, 8), 2);
  EXPECT_EQ(nvlink::fusedOwnBlocks(tight), 1u);
  EXPECT_FALSE(nvlink::fusedRolesFit(tight));  // routing + own-token block, no payload block
  EXPECT_TRUE(nvlink::fusedRolesFit(nvlink::makeGeometry(make(32, 1, 8), 2)));  // one rank needs no payload block
}

// One fused dispatch kernel per mode: push (static shares) at decode, pull at prefill; the kernel that takes every path
// when a push round is large enough for the own-token blocks to join the peers' expansion (many ranks), or when the
// roles do not fit.
TEST(NvlinkLayout, FusedDispatchKindPerMode) {
  EXPECT_EQ(nvlink::fusedDispatchKind(nvlink::makeGeometry(make(128, 2, 8), 66)), nvlink::kFusedPush);
  EXPECT_EQ(nvlink::fusedDispatchKind(nvlink::makeGeometry(make(512, 2, 8), 66)), nvlink::kFusedPush);
  EXPECT_EQ(nvlink::fusedDispatchKind(nvlink::makeGeometry(make(128, 1, 8), 66)), nvlink::kFusedPush);
  EXPECT_EQ(nvlink::fusedDispatchKind(nvlink::makeGeometry(make(4096, 2, 8), 132)), nvlink::kFusedPull);
  // Eight ranks, 512 tokens each on 66 blocks: push (1024 units < 1056 warps), and the peers' 7 x 512 tokens of 2
  // units are more than 4 units per warp of the 58 blocks beside the own-token ones.
  const nvlink::Geometry wide = nvlink::makeGeometry(make(512, 8, 8), 66);
  EXPECT_EQ(wide.pull, 0u);
  EXPECT_EQ(nvlink::fusedDispatchKind(wide), nvlink::kFusedAny);
  EXPECT_EQ(nvlink::fusedDispatchKind(nvlink::makeGeometry(make(32, 2, 8), 2)), nvlink::kFusedAny);
}

// Pull mode pushes a share of every sender's slots all the same (slots j % 4 < kPushQuarters); push mode pushes every
// slot. The slot filters split a sender's n slots into the pushed and the pulled ones, each exactly once and in
// ascending order, for every n and any share.
TEST(NvlinkLayout, PullModePushesAShareOfTheSlots) {
  EXPECT_EQ(nvlink::makeGeometry(make(4096, 2, 8), 132).pushQuarters, nvlink::kPushQuarters);
  EXPECT_EQ(nvlink::makeGeometry(make(128, 2, 8), 66).pushQuarters, 0u);
  const nvlink::Geometry push = nvlink::makeGeometry(make(128, 2, 8), 66);
  for (uint32_t j = 0; j < 8; ++j) EXPECT_TRUE(nvlink::pushedSlot(push, j));
  EXPECT_EQ(nvlink::filteredSlots(push, 37, nvlink::kAllSlots), 37u);
  for (uint32_t q = 0; q <= 4; ++q) {
    nvlink::Geometry g = nvlink::makeGeometry(make(4096, 2, 8), 132);
    g.pushQuarters = q;
    for (uint32_t n : {0u, 1u, 2u, 3u, 4u, 5u, 7u, 8u, 13u, 4096u}) {
      std::vector<uint32_t> pushed, pulled;
      for (uint32_t i = 0; i < nvlink::filteredSlots(g, n, nvlink::kPushedSlots); ++i) {
        pushed.push_back(nvlink::filteredSlot(g, i, nvlink::kPushedSlots));
      }
      for (uint32_t i = 0; i < nvlink::filteredSlots(g, n, nvlink::kPulledSlots); ++i) {
        pulled.push_back(nvlink::filteredSlot(g, i, nvlink::kPulledSlots));
      }
      std::vector<uint32_t> wantPushed, wantPulled;
      for (uint32_t j = 0; j < n; ++j) (nvlink::pushedSlot(g, j) ? wantPushed : wantPulled).push_back(j);
      EXPECT_EQ(pushed, wantPushed) << "q = " << q << ", n = " << n;
      EXPECT_EQ(pulled, wantPulled) << "q = " << q << ", n = " << n;
      EXPECT_EQ(wantPushed.size(), (n / 4) * q + std::min(n % 4, q)) << "q = " << q << ", n = " << n;
    }
  }
}

TEST(NvlinkLayout, RoutingBlocksFollowTheTokenCount) {
  // Decode: one routing block; a 4096-token prefill on 132 blocks: 8 blocks of 512 tokens.
  EXPECT_EQ(nvlink::makeGeometry(make(128, 2, 8), 66).routeBlocks, 1u);
  const nvlink::Geometry p = nvlink::makeGeometry(make(4096, 2, 8), 132);
  EXPECT_EQ(p.routeBlocks, 8u);
  EXPECT_EQ(p.routeChunk, 512u);
  // Capped at a quarter of the blocks (the fused kernel keeps payload and expansion blocks): 16384 tokens on 16
  // blocks -> 4 routing blocks of 4096 tokens each.
  const nvlink::Geometry c = nvlink::makeGeometry(make(16384, 2, 8), 16);
  EXPECT_EQ(c.routeBlocks, 4u);
  EXPECT_EQ(c.routeChunk, 4096u);
  // One block: it routes everything itself.
  EXPECT_EQ(nvlink::makeGeometry(make(1300, 2, 8), 1).routeBlocks, 1u);
  // Every token slot belongs to some routing block's chunk.
  for (uint32_t tokens : {1u, 511u, 512u, 513u, 1300u, 4096u, 5000u}) {
    for (uint32_t blocks : {1u, 4u, 8u, 66u, 132u}) {
      const nvlink::Geometry g = nvlink::makeGeometry(make(tokens, 2, 8), blocks);
      EXPECT_GE(static_cast<uint64_t>(g.routeBlocks) * g.routeChunk, g.slotsPerSender) << tokens << " " << blocks;
      EXPECT_EQ(g.routeChunk % g.threads, 0u);
      EXPECT_GE(g.routeBlocks, 1u);
      EXPECT_LE(g.routeBlocks, blocks / 4 > 0 ? blocks / 4 : 1u);
    }
  }
}

TEST(NvlinkLayout, SmallBlocksHalveTheRoutingPassAndItsSharedMemory) {
  // 256-thread blocks (small batches): a routing pass covers 256 tokens, its scan tables have 8 warps' rows, and the
  // kernel's warps (blocks x 8) are what 66 blocks of 512 threads had.
  const nvlink::Geometry big = nvlink::makeGeometry(make(128, 2, 8), 66);
  const nvlink::Geometry small = nvlink::makeGeometry(make(128, 2, 8), 132, nvlink::kSmallThreads);
  EXPECT_EQ(big.threads, nvlink::kMaxThreads);
  EXPECT_EQ(nvlink::blockWarps(small), 8u);
  EXPECT_EQ(small.blocks * nvlink::blockWarps(small), big.blocks * nvlink::blockWarps(big));
  EXPECT_EQ(small.routeChunk, 256u);
  EXPECT_LT(nvlink::sharedBytes(small), nvlink::sharedBytes(big));
  EXPECT_EQ(nvlink::unitVectors(small), nvlink::unitVectors(big));
  EXPECT_EQ(nvlink::fusedDispatchKind(small), nvlink::fusedDispatchKind(big));
  // 300 tokens at 256 threads: two passes, still one routing block.
  const nvlink::Geometry two = nvlink::makeGeometry(make(300, 2, 8), 132, nvlink::kSmallThreads);
  EXPECT_EQ(two.routeBlocks, 2u);
  EXPECT_EQ(two.routeChunk, 256u);
}

TEST(NvlinkLayout, RouteIndexIsABijectionIntoTheRouteArea) {
  for (uint32_t k : {1u, 2u, 5u, 8u}) {
    const Config c = make(40, 4, k, 2);
    const nvlink::Geometry g = nvlink::makeGeometry(c, 66);
    const uint64_t slots = (g.offPayload - g.offRoute) / sizeof(uint64_t);
    std::set<uint64_t> seen;
    for (uint32_t s = 0; s < g.worldSize; ++s) {
      for (uint32_t j = 0; j < g.slotsPerSender; ++j) {
        for (uint32_t kk = 0; kk < k; ++kk) {
          const uint64_t i = nvlink::routeIndex(k, g.slotsPerSender, s, j, kk);
          EXPECT_LT(i, slots);
          EXPECT_TRUE(seen.insert(i).second) << "k=" << k << " s=" << s << " j=" << j << " kk=" << kk;
          if (kk % 2 == 0) EXPECT_EQ((g.offRoute + i * sizeof(uint64_t)) % 16, 0u);  // 16-byte pair store
          if (kk % 2 == 1) EXPECT_EQ(i, nvlink::routeIndex(k, g.slotsPerSender, s, j, kk - 1) + 1);
        }
        // Consecutive tokens' pairs are adjacent (what makes a warp's stores coalesce).
        if (j > 0) {
          EXPECT_EQ(nvlink::routeIndex(k, g.slotsPerSender, s, j, 0),
                    nvlink::routeIndex(k, g.slotsPerSender, s, j - 1, 0) + 2);
        }
      }
    }
  }
}

// Routing entries travel as tagged words (the round in the high half, the entry packed in the low half); every entry
// the kernels write must come back unchanged, and an empty one must stay distinguishable from local expert 0x7FFE.
TEST(NvlinkLayout, PackedEntriesRoundTrip) {
  const std::vector<nvlink::RouteEntry> entries = {
      {-1, 0}, {0, 0}, {1, 65535}, {0x7FFE, 12345}, {5 | nvlink::kDupBit, 7}, {0x7FFE | nvlink::kDupBit, 65535}};
  for (const nvlink::RouteEntry& e : entries) {
    const uint64_t word = nvlink::tagWord(0xABCDEF01u, nvlink::packEntry(e));
    EXPECT_EQ(static_cast<uint32_t>(word >> 32), 0xABCDEF01u);
    const nvlink::RouteEntry back = nvlink::unpackEntry(static_cast<uint32_t>(word));
    EXPECT_EQ(back.le, e.le) << "le " << e.le << " pos " << e.pos;
    EXPECT_EQ(back.pos, e.le < 0 ? 0 : e.pos) << "le " << e.le << " pos " << e.pos;
  }
}

TEST(NvlinkLayout, TaggedEntriesLimitTokensPerSender) {
  EXPECT_TRUE(nvlink::fitsTaggedEntries(nvlink::makeGeometry(make(65536, 2, 8), 66)));
  EXPECT_FALSE(nvlink::fitsTaggedEntries(nvlink::makeGeometry(make(65537, 2, 8), 66)));
  EXPECT_TRUE(nvlink::fitsTaggedEntries(nvlink::makeGeometry(make(131072, 2, 8, 2), 66)));  // 65536 per DP rank
}

}  // namespace
}  // namespace epcomm
