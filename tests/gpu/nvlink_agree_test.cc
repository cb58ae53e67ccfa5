// The nvlink backend's agreement on the active ranks (src/backends/nvlink/nvlink_agree.hpp) on ordinary memory, ranks
// as threads: no GPU. Ranks that all take part agree on the intersection of their views; a rank known dead leaves at
// once, one that never answers after the timeout; a rank left out by the others learns it; leave() and barrier().
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "backends/nvlink/nvlink_agree.hpp"
#include "epcomm/error.hpp"

namespace epcomm {
namespace nvlink {
namespace {

struct Board {
  explicit Board(uint32_t w) : words(2 * w, 0), dead(w) {
    for (auto& d : dead) d = false;
  }
  std::vector<uint64_t> words;
  std::vector<std::atomic<bool>> dead;
  ElasticAgreement agreement(uint32_t rank, int64_t timeoutMs) {
    const uint32_t w = static_cast<uint32_t>(dead.size());
    std::vector<uint64_t*> p(w), b(w);
    for (uint32_t r = 0; r < w; ++r) {
      p[r] = &words[2 * r];
      b[r] = &words[2 * r + 1];
    }
    return ElasticAgreement(p, b, rank, timeoutMs, [this](uint32_t r) { return !dead[r].load(); });
  }
};

TEST(NvlinkAgree, WordsAndText) {
  EXPECT_EQ(proposalEpoch(proposalWord(7, 0b1011)), 7u);
  EXPECT_EQ(proposalView(proposalWord(7, 0b1011)), 0b1011u);
  EXPECT_EQ(nextEpoch(0xffff), 1u);
  EXPECT_EQ(nextEpoch(1), 2u);
  EXPECT_EQ(rankSet(0b1010, 4), "ranks 1, 3");
  EXPECT_EQ(rankSet(0b0100, 4), "rank 2");
  EXPECT_EQ(rankSet(0, 4), "no rank");
}

TEST(NvlinkAgree, IntersectionOfViewsAndDeadRanks) {
  constexpr uint32_t W = 4;
  Board board(W);
  board.dead[3] = true;  // rank 3 is gone: nobody waits for it
  std::vector<uint32_t> views(W, 0);
  std::vector<std::thread> ranks;
  const auto start = std::chrono::steady_clock::now();
  for (uint32_t r = 0; r < 3; ++r) {
    ranks.emplace_back([&, r] {
      ElasticAgreement a = board.agreement(r, 5000);
      // Rank 1 also wants rank 2 gone (setActiveRanks-like): every rank must end without it.
      views[r] = a.agree(r == 1 ? 0b1011 : 0b1111).view;
      EXPECT_EQ(a.barrier(views[r] == 0 ? 0 : views[r]), 0u);
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4)) << "a dead rank was waited for";
  EXPECT_EQ(views[0], 0b0011u);
  EXPECT_EQ(views[1], 0b0011u);
  EXPECT_EQ(views[2], 0u) << "rank 2 must learn that the others left it out";
}

TEST(NvlinkAgree, SilentRankLeavesAfterTheTimeout) {
  constexpr uint32_t W = 3;
  Board board(W);  // rank 2 never answers, but looks alive
  std::vector<uint32_t> views(W, 0);
  std::vector<std::thread> ranks;
  const auto start = std::chrono::steady_clock::now();
  for (uint32_t r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] { views[r] = board.agreement(r, 300).agree(0b111).view; });
  }
  for (auto& t : ranks) t.join();
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, std::chrono::milliseconds(300));
  EXPECT_LT(took, std::chrono::seconds(3));
  EXPECT_EQ(views[0], 0b011u);
  EXPECT_EQ(views[1], 0b011u);
}

TEST(NvlinkAgree, LeaveWaitsForTheOthersBarrier) {
  constexpr uint32_t W = 3;
  Board board(W);
  std::atomic<uint32_t> missing{~0u};
  std::vector<uint32_t> views(W, 0);
  std::thread leaver([&] {
    ElasticAgreement a = board.agreement(2, 5000);
    missing = a.leave(0b011, a.nextBarrier());
  });
  std::vector<std::thread> ranks;
  for (uint32_t r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      ElasticAgreement a = board.agreement(r, 5000);
      views[r] = a.agree(0b111).view;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // unmapping the leaver's region, resetting
      a.barrier(views[r]);
    });
  }
  for (auto& t : ranks) t.join();
  leaver.join();
  EXPECT_EQ(views[0], 0b011u);
  EXPECT_EQ(views[1], 0b011u);
  EXPECT_EQ(missing.load(), 0u);
}

TEST(NvlinkAgree, RequestedViewChecksTheMask) {
  EXPECT_EQ(requestedView({1, 0, 1}, 3, 0b111), 0b101u);
  auto refused = [](const std::vector<int32_t>& mask, uint32_t live, const char* text) {
    try {
      requestedView(mask, 3, live);
      ADD_FAILURE() << "no error, expected: " << text;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(e.message().find(text), std::string::npos) << e.what();
    }
  };
  refused({1, 1}, 0b111, "the mask has 2 entries for 3 ranks");
  refused({1, 2, 1}, 0b111, "entry 1 is 2 (1 = active, 0 = masked)");
  refused({1, 1, 1}, 0b011, "rank 2 is masked already and cannot be made active again");
  refused({0, 0, 0}, 0b111, "the mask leaves no rank active");
}

}  // namespace
}  // namespace nvlink
}  // namespace epcomm
