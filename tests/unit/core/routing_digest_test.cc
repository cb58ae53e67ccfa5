// The routing digest that combine compares with the dispatch's: the same routing gives the same digest whatever the
// index dtype, strides or summation order; any change of an expert, of a token's place or of boundM changes it.
#include "core/routing_digest.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

namespace epcomm {
namespace {

constexpr uint32_t kM = 64, kK = 6, kE = 32;

std::vector<int64_t> randomRouting(uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int64_t> idx(kM * kK);
  for (auto& e : idx) e = static_cast<int64_t>(rng() % (kE + 1)) - 1;  // -1 (masked) included
  return idx;
}

uint64_t digestI64(const std::vector<int64_t>& idx, uint32_t bound) {
  return routingDigestOf(idx.data(), 2, kK, 1, kK, bound);
}

TEST(RoutingDigest, SameRoutingAnyDtypeOrStrides) {
  const std::vector<int64_t> idx = randomRouting(1);
  std::vector<int32_t> i32(idx.begin(), idx.end());
  std::vector<uint32_t> u32(idx.size());
  for (size_t i = 0; i < idx.size(); ++i) u32[i] = idx[i] < 0 ? 0xFFFFFFFFu : static_cast<uint32_t>(idx[i]);
  // Column-major copy: strides (1, M).
  std::vector<int64_t> colMajor(idx.size());
  for (uint32_t t = 0; t < kM; ++t) {
    for (uint32_t k = 0; k < kK; ++k) colMajor[k * kM + t] = idx[t * kK + k];
  }
  const uint64_t d = digestI64(idx, kM);
  EXPECT_EQ(routingDigestOf(i32.data(), 0, kK, 1, kK, kM), d);
  EXPECT_EQ(routingDigestOf(u32.data(), 1, kK, 1, kK, kM), d);
  EXPECT_EQ(routingDigestOf(colMajor.data(), 2, 1, kM, kK, kM), d);
}

TEST(RoutingDigest, TermsSumInAnyOrder) {
  const std::vector<int64_t> idx = randomRouting(2);
  std::vector<uint32_t> order(kM * kK);
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937(7));
  uint64_t sum = 0;  // as kernel threads would add them
  for (uint32_t i : order) sum += routingTerm(i / kK, i % kK, idx[i]);
  EXPECT_EQ(routingDigest(sum, kM), digestI64(idx, kM));
}

TEST(RoutingDigest, EveryChangeShows) {
  const std::vector<int64_t> idx = randomRouting(3);
  const uint64_t d = digestI64(idx, kM);
  std::set<uint64_t> seen{d};
  // One expert changed, anywhere (including to and from -1).
  for (uint32_t i = 0; i < idx.size(); i += 7) {
    std::vector<int64_t> changed = idx;
    changed[i] = changed[i] == kE - 1 ? -1 : changed[i] + 1;
    EXPECT_TRUE(seen.insert(digestI64(changed, kM)).second) << "position " << i;
  }
  // Two tokens swapped: every expert keeps its count, the digest still changes.
  for (uint32_t t = 0; t + 1 < kM; t += 5) {
    std::vector<int64_t> swapped = idx;
    std::swap_ranges(swapped.begin() + t * kK, swapped.begin() + (t + 1) * kK, swapped.begin() + (t + 1) * kK);
    if (swapped == idx) continue;
    EXPECT_TRUE(seen.insert(digestI64(swapped, kM)).second) << "tokens " << t << ", " << t + 1;
  }
  // Two positions of one token swapped (the weights follow positions in combine).
  std::vector<int64_t> inToken = idx;
  for (uint32_t t = 0; t < kM; ++t) {
    if (inToken[t * kK] != inToken[t * kK + 1]) {
      std::swap(inToken[t * kK], inToken[t * kK + 1]);
      break;
    }
  }
  EXPECT_TRUE(seen.insert(digestI64(inToken, kM)).second);
  // boundM: fewer tokens, and the same tokens with another bound.
  for (uint32_t bound : {0u, 1u, kM / 2, kM - 1}) EXPECT_TRUE(seen.insert(digestI64(idx, bound)).second) << bound;
  // An empty batch still has a digest of its own, which only boundM = 0 matches.
  EXPECT_EQ(routingDigestOf(nullptr, 0, 0, 0, kK, 0), digestI64(idx, 0));
}

}  // namespace
}  // namespace epcomm
