// Elastic ranks on the host backend, across real processes (docs/failures.md, "Elastic ranks"): a rank killed with
// SIGKILL mid-round is masked once the survivors agree, and they run 1,000 more rounds whose outputs equal the CPU
// reference under the mask; a rank that leaves (setActiveRanks, or destroying its object mid-round) is masked the
// same way; the drop count, the mask and the argument checks.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "epcomm/error.hpp"
#include "host_harness.hpp"
#include "support/fabric_probe.hpp"
#include "support/multiprocess.hpp"

namespace epcomm {
namespace test {
namespace {

constexpr uint32_t kRoundsAfter = 1000;  // rounds every survivor runs once the mask excludes the dead rank

RunOptions runOptions() {
  RunOptions o;
  o.deadlineMs = 280000;
  return o;
}

Scenario elasticScenario(uint32_t W, uint32_t D) {
  Scenario sc;
  sc.W = W;
  sc.D = D;
  sc.E = 2 * W;
  sc.K = 3;
  sc.T = 8;
  sc.H = 32;
  sc.route = RouteMode::kMasked;
  sc.ragged = true;
  sc.options.provider = "tcp";
  // Each kill costs the survivors one timeout; shorter ones fire on a loaded 2-core machine without any death.
  sc.options.timeoutMs = 3000;
  sc.options.elastic = 1;
  return sc;
}

// The positions of rank `rank`'s combine that `mask` leaves out: tokens < boundM whose expert's rank, or whose
// sending rank, is masked.
uint64_t expectedDropped(const Scenario& sc, const RankInputs& in, uint32_t rank, const std::vector<int32_t>& mask) {
  const uint32_t L = sc.E / sc.W, g = rank / sc.D;
  uint64_t n = 0;
  for (int32_t t = 0; t < in.bound; ++t) {
    const bool senderActive = mask[g * sc.D + t % sc.D] != 0;
    for (uint32_t k = 0; k < sc.K; ++k) {
      const int32_t e = in.indices.data<int32_t>()[t * sc.K + k];
      if (e >= 0 && (!senderActive || mask[e / L] == 0)) ++n;
    }
  }
  return n;
}

// Compares this rank's outputs of a round with the reference under `mask`, bitwise.
bool matchesMasked(const Scenario& sc, uint32_t rank, uint32_t round, const std::vector<RankInputs>& in,
                   const DispatchOutputs& mine, const reference::HostTensor& out, const std::vector<int32_t>& mask) {
  const Config c = sc.config(0);
  std::vector<DispatchOutputs> ref;
  ref.reserve(sc.W);
  std::vector<DispatchArgs> refArgs;
  for (uint32_t r = 0; r < sc.W; ++r) ref.emplace_back(sc);
  for (uint32_t r = 0; r < sc.W; ++r) refArgs.push_back(dispatchArgs(in[r], ref[r]));
  reference::dispatch(c, refArgs, mask);
  std::vector<reference::HostTensor> refOut;
  std::vector<CombineArgs> refCombine;
  for (uint32_t r = 0; r < sc.W; ++r) refOut.push_back(copyOf(in[r].outInit));
  for (uint32_t r = 0; r < sc.W; ++r) refCombine.push_back(combineArgs(in[r], refOut[r]));
  reference::combine(c, refCombine, mask);
  bool ok = true;
  auto same = [&](const reference::HostTensor& a, const reference::HostTensor& b, const char* what) {
    if (a.bytes() == b.bytes() && std::memcmp(a.data<void>(), b.data<void>(), a.bytes()) == 0) return;
    ADD_FAILURE() << "rank " << rank << " round " << round << ": " << what << " differs from the masked reference";
    ok = false;
  };
  same(mine.numTokens, ref[rank].numTokens, "outExpertNumTokens");
  same(mine.x, ref[rank].x, "outExpertX");
  same(out, refOut[rank], "outTokens");
  return ok;
}

// One round on an elastic object. Returns false when a call threw with an error of a lost round (the object goes on);
// a completed round is checked against the reference under the mask the object reports afterwards, and so is the
// drop count.
bool elasticRound(AllToAll& a2a, const Scenario& sc, uint32_t rank, uint32_t round, std::string* error = nullptr) {
  const std::vector<RankInputs> in = makeRound(sc, round);
  DispatchOutputs mine(sc);
  reference::HostTensor out = copyOf(in[rank].outInit);
  const uint64_t droppedBefore = a2a.droppedTokens();
  try {
    a2a.dispatch(dispatchArgs(in[rank], mine));
    a2a.combine(combineArgs(in[rank], out));
  } catch (const Error& e) {
    EXPECT_TRUE(e.code() == ErrorCode::kTimeout || e.code() == ErrorCode::kFabric ||
                e.code() == ErrorCode::kPeerFailure)
        << e.what();
    EXPECT_NE(e.message().find("the object goes on"), std::string::npos) << e.what();
    if (error != nullptr) *error = e.message();
    return false;
  }
  const std::vector<int32_t> mask = a2a.activeRanks();
  EXPECT_TRUE(matchesMasked(sc, rank, round, in, mine, out, mask));
  EXPECT_EQ(a2a.droppedTokens() - droppedBefore, expectedDropped(sc, in[rank], rank, mask)) << "round " << round;
  return true;
}

std::vector<int32_t> allBut(uint32_t W, uint32_t masked) {
  std::vector<int32_t> m(W, 1);
  m[masked] = 0;
  return m;
}

// ---- kill -9 of one rank; the survivors go on without it for 1,000 rounds. ----

enum class KillAt {
  kBeforeDispatch,  ///< after a barrier, before its dispatch of the round: every survivor loses the dispatch
  kBeforeCombine,   ///< after its dispatch: every survivor completes the dispatch and loses the combine
  kAnyTime,         ///< a thread kills it at a random moment while it runs rounds
};

struct KillCase {
  KillAt at;
  uint32_t W, D;
  uint32_t victim;
  int pauseMs;  ///< the survivors wait this long after the kill before the round (the provider has seen it go)
  const char* provider;
  const char* name;
};

class HostElasticKill : public ::testing::TestWithParam<KillCase> {};

TEST_P(HostElasticKill, SurvivorsGoOnWithoutTheDeadRank) {
  const KillCase kc = GetParam();
  SKIP_WITHOUT(kc.provider);
  Scenario sc = elasticScenario(kc.W, kc.D);
  sc.options.provider = kc.provider;
  const uint32_t victim = kc.victim;
  constexpr uint32_t kWarmRounds = 3;
  RunResult result = runRanks(
      sc.W,
      [&](int rank, Bootstrap& bootstrap) {
        host::HostAllToAll a2a(sc.config(rank), bootstrap, sc.options);
        for (uint32_t round = 0; round < kWarmRounds; ++round) ASSERT_TRUE(elasticRound(a2a, sc, rank, round));
        EXPECT_EQ(a2a.activeRanks(), std::vector<int32_t>(sc.W, 1));
        uint32_t round = kWarmRounds;
        // The first round that runs with the agreed mask: the same on every survivor (a survivor whose dispatch ran
        // again after the others lost the combine before it completes it with the mask).
        uint32_t firstMasked = 0;
        if (kc.at != KillAt::kAnyTime) {
          const std::vector<RankInputs> in = makeRound(sc, round);
          DispatchOutputs mine(sc);
          reference::HostTensor out = copyOf(in[rank].outInit);
          if (kc.at == KillAt::kBeforeCombine) a2a.dispatch(dispatchArgs(in[rank], mine));
          bootstrap.barrier();
          if (static_cast<uint32_t>(rank) == victim) raise(SIGKILL);
          std::this_thread::sleep_for(std::chrono::milliseconds(kc.pauseMs));
          const auto start = std::chrono::steady_clock::now();
          try {
            if (kc.at == KillAt::kBeforeDispatch) a2a.dispatch(dispatchArgs(in[rank], mine));
            a2a.combine(combineArgs(in[rank], out));
            ADD_FAILURE() << "the round completed without rank " << victim;
          } catch (const Error& e) {
            const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            EXPECT_NE(e.message().find("without rank " + std::to_string(victim)), std::string::npos) << e.what();
            EXPECT_LT(s, 2 * sc.options.timeoutMs / 1000.0 + 1.0) << e.what();
            std::printf("rank %d: lost the round after %.0f ms: %s\n", rank, s * 1e3, e.message().c_str());
          }
          EXPECT_EQ(a2a.activeRanks(), allBut(sc.W, victim));
          firstMasked = ++round;
        } else {
          // The victim runs rounds until a thread of its own kills it, somewhere in a round.
          if (static_cast<uint32_t>(rank) == victim) {
            std::mt19937 rng(static_cast<uint32_t>(getpid()));
            const int delayMs = 20 + static_cast<int>(rng() % 200);
            std::thread([delayMs] {
              std::this_thread::sleep_for(std::chrono::milliseconds(delayMs));
              raise(SIGKILL);
            }).detach();
          }
          int lost = 0;
          while (a2a.activeRanks() == std::vector<int32_t>(sc.W, 1)) {
            std::string error;
            const bool completed = elasticRound(a2a, sc, rank, round, &error);
            if (!completed) {
              ++lost;
              std::printf("rank %d: lost round %u: %s\n", rank, round, error.c_str());
            }
            ++round;
            firstMasked = completed ? round - 1 : round;
            ASSERT_LT(round, 100000u) << "rank " << victim << " was never masked";
          }
          EXPECT_LE(lost, 1) << "rank " << rank << " lost more than the round of the kill";
          EXPECT_EQ(a2a.activeRanks(), allBut(sc.W, victim));
        }
        // The survivors go on with the mask they agreed on: every round completes and matches the reference.
        for (; round < firstMasked + kRoundsAfter; ++round) {
          std::string error;
          ASSERT_TRUE(elasticRound(a2a, sc, rank, round, &error)) << "round " << round << ": " << error;
        }
        EXPECT_EQ(a2a.activeRanks(), allBut(sc.W, victim));
        EXPECT_GT(a2a.droppedTokens(), 0u);
        std::printf("rank %d: %u rounds in all, %u with the mask from round %u, %llu positions dropped\n", rank, round,
                    kRoundsAfter, firstMasked, static_cast<unsigned long long>(a2a.droppedTokens()));
      },
      runOptions());
  ASSERT_EQ(result.ranks.size(), kc.W);
  for (uint32_t r = 0; r < kc.W; ++r) {
    if (r == victim) {
      EXPECT_EQ(result.ranks[r].signal, SIGKILL) << result.summary();
    } else {
      EXPECT_TRUE(result.ranks[r].ok()) << result.summary();
    }
  }
}

// The paused cases kill a middle rank and let the provider see the connection go before the round: its writes to the
// dead rank are then refused (FI_EAGAIN) and held, which must not hold the writes to the live ranks (one endpoint per
// peer). The kills at any moment land in the middle of transfers.
INSTANTIATE_TEST_SUITE_P(
    Host, HostElasticKill,
    ::testing::Values(KillCase{KillAt::kBeforeDispatch, 4, 1, 3, 0, "tcp", "BeforeDispatchTcp"},
                      KillCase{KillAt::kBeforeCombine, 4, 1, 3, 0, "tcp", "BeforeCombineTcp"},
                      KillCase{KillAt::kBeforeDispatch, 4, 1, 1, 300, "tcp", "MiddleRankPausedTcp"},
                      KillCase{KillAt::kBeforeCombine, 4, 2, 1, 300, "tcp", "MiddleRankPausedDp2Tcp"},
                      KillCase{KillAt::kBeforeDispatch, 3, 1, 2, 0, "shm", "BeforeDispatchShm"},
                      KillCase{KillAt::kBeforeCombine, 4, 2, 1, 300, "shm", "MiddleRankPausedDp2Shm"},
                      KillCase{KillAt::kAnyTime, 4, 1, 3, 0, "shm", "AnyTimeShm"},
                      KillCase{KillAt::kAnyTime, 4, 1, 3, 0, "tcp", "AnyTimeTcp"},
                      KillCase{KillAt::kAnyTime, 4, 2, 1, 0, "tcp", "AnyTimeMiddleDp2Tcp"},
                      KillCase{KillAt::kAnyTime, 4, 2, 3, 0, "shm", "AnyTimeDp2Shm"}),
    [](const auto& info) { return std::string(info.param.name); });

// ---- A rank dies between its combine writes: the rank that missed its rows loses the combine, the ranks that got
// them complete it, and their next dispatch runs again with the agreed mask, so every survivor's next round is the
// same one. ----

TEST(HostElastic, RanksThatCompletedTheLostCombineRunTheirDispatchAgain) {
  SKIP_WITHOUT("tcp");
  Scenario sc = elasticScenario(4, 1);
  constexpr uint32_t kVictim = 3, kMissed = 0, kRound = 3;
  RunResult result = runRanks(
      sc.W,
      [&](int rank, Bootstrap& bootstrap) {
        std::atomic<bool> armed{false};
        host::HostOptions options = sc.options;
        if (static_cast<uint32_t>(rank) == kVictim) {
          options.skipWrite = [&](proxy::Phase phase, uint32_t peer) {
            return armed.load() && phase >= proxy::Phase::kCombineBf16 && peer == kMissed;
          };
          options.onPosted = [&](proxy::Phase phase) {
            if (!armed.load() || phase < proxy::Phase::kCombineBf16) return;
            std::this_thread::sleep_for(std::chrono::milliseconds(100));  // its rows to the others leave first
            raise(SIGKILL);
          };
        }
        host::HostAllToAll a2a(sc.config(rank), bootstrap, options);
        for (uint32_t round = 0; round < kRound; ++round) ASSERT_TRUE(elasticRound(a2a, sc, rank, round));
        armed = true;
        std::string error;
        const bool completed = elasticRound(a2a, sc, rank, kRound, &error);
        if (static_cast<uint32_t>(rank) == kMissed) {
          EXPECT_FALSE(completed) << "rank " << kMissed << " completed the combine without rank " << kVictim
                                  << "'s rows";
          EXPECT_NE(error.find("combine"), std::string::npos) << error;
        } else {
          EXPECT_TRUE(completed) << error;  // it had every row: the round completed with every rank
        }
        // The next round: a fresh dispatch on the rank that lost the combine, the same dispatch run again on the
        // others; it completes everywhere with the agreed mask.
        ASSERT_TRUE(elasticRound(a2a, sc, rank, kRound + 1, &error)) << error;
        EXPECT_EQ(a2a.activeRanks(), allBut(sc.W, kVictim));
        for (uint32_t round = kRound + 2; round < kRound + 2 + kRoundsAfter; ++round) {
          ASSERT_TRUE(elasticRound(a2a, sc, rank, round, &error)) << "round " << round << ": " << error;
        }
      },
      runOptions());
  ASSERT_EQ(result.ranks.size(), 4u);
  EXPECT_EQ(result.ranks[kVictim].signal, SIGKILL) << result.summary();
  for (uint32_t r = 0; r < kVictim; ++r) EXPECT_TRUE(result.ranks[r].ok()) << result.summary();
}

// ---- A rank that destroys its object mid-round is masked at once (its notice), not after the timeout. ----

TEST(HostElastic, RankThatLeavesMidRoundIsMaskedAtOnce) {
  SKIP_WITHOUT("tcp");
  Scenario sc = elasticScenario(3, 1);
  sc.options.timeoutMs = 10000;
  RunResult result = runRanks(
      sc.W,
      [&](int rank, Bootstrap& bootstrap) {
        auto a2a = std::make_unique<host::HostAllToAll>(sc.config(rank), bootstrap, sc.options);
        ASSERT_TRUE(elasticRound(*a2a, sc, rank, 0));
        const std::vector<RankInputs> in = makeRound(sc, 1);
        DispatchOutputs mine(sc);
        a2a->dispatch(dispatchArgs(in[rank], mine));
        bootstrap.barrier();
        if (rank == 2) {
          a2a.reset();  // leaves between dispatch and combine
          return;
        }
        const auto start = std::chrono::steady_clock::now();
        reference::HostTensor out = copyOf(in[rank].outInit);
        try {
          a2a->combine(combineArgs(in[rank], out));
          ADD_FAILURE() << "combine completed without rank 2";
        } catch (const Error& e) {
          const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          EXPECT_EQ(e.code(), ErrorCode::kPeerFailure) << e.what();
          EXPECT_NE(e.message().find("rank 2 left"), std::string::npos) << e.what();
          EXPECT_LT(s, 3.0) << "masking the rank that left took " << s << " s (timeout 10 s)";
        }
        EXPECT_EQ(a2a->activeRanks(), allBut(3, 2));
        for (uint32_t round = 2; round < 40; ++round) ASSERT_TRUE(elasticRound(*a2a, sc, rank, round));
      },
      runOptions());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// ---- setActiveRanks: every rank masks one on purpose between rounds (without EPCOMM_ELASTIC as well). ----

class HostElasticSetMask : public ::testing::TestWithParam<std::tuple<uint32_t, int>> {};

TEST_P(HostElasticSetMask, RanksMaskedOnPurposeAreSkipped) {
  SKIP_WITHOUT("tcp");
  const auto [D, elastic] = GetParam();
  Scenario sc = elasticScenario(4, D);
  sc.options.elastic = elastic;
  const uint32_t leaver = 1;
  RunResult result = runRanks(
      sc.W,
      [&](int rank, Bootstrap& bootstrap) {
        host::HostAllToAll a2a(sc.config(rank), bootstrap, sc.options);
        for (uint32_t round = 0; round < 3; ++round) ASSERT_TRUE(elasticRound(a2a, sc, rank, round));
        a2a.setActiveRanks(allBut(sc.W, leaver));
        EXPECT_EQ(a2a.activeRanks(), allBut(sc.W, leaver));
        if (static_cast<uint32_t>(rank) == leaver) {
          // It left: every call on its object says so.
          const std::vector<RankInputs> in = makeRound(sc, 3);
          DispatchOutputs mine(sc);
          try {
            a2a.dispatch(dispatchArgs(in[rank], mine));
            ADD_FAILURE() << "a dispatch on a rank that left went through";
          } catch (const Error& e) {
            EXPECT_NE(e.message().find("left the object"), std::string::npos) << e.what();
          }
          return;
        }
        for (uint32_t round = 3; round < 60; ++round) ASSERT_TRUE(elasticRound(a2a, sc, rank, round));
        EXPECT_GT(a2a.droppedTokens(), 0u);
        // A second mask: rank 3 too.
        std::vector<int32_t> mask = allBut(sc.W, leaver);
        mask[3] = 0;
        if (rank == 3) {
          a2a.setActiveRanks(mask);
          return;
        }
        a2a.setActiveRanks(mask);
        EXPECT_EQ(a2a.activeRanks(), mask);
        for (uint32_t round = 60; round < 100; ++round) ASSERT_TRUE(elasticRound(a2a, sc, rank, round));
      },
      runOptions());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

INSTANTIATE_TEST_SUITE_P(Host, HostElasticSetMask,
                         ::testing::Combine(::testing::Values(1u, 2u), ::testing::Values(0, 1)), [](const auto& info) {
                           return "Dp" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "Elastic" : "Fixed");
                         });

// ---- Bad masks are refused on the calling rank before anything is sent; the object stays usable. ----

TEST(HostElastic, BadMasksAreRefused) {
  SKIP_WITHOUT("tcp");
  const Scenario sc = elasticScenario(2, 1);
  RunResult result = runRanks(
      sc.W,
      [&](int rank, Bootstrap& bootstrap) {
        host::HostAllToAll a2a(sc.config(rank), bootstrap, sc.options);
        auto refused = [&](const std::vector<int32_t>& mask, const char* expected) {
          try {
            a2a.setActiveRanks(mask);
            ADD_FAILURE() << "setActiveRanks accepted a bad mask";
          } catch (const Error& e) {
            EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
            EXPECT_NE(e.message().find(expected), std::string::npos) << e.what();
          }
        };
        refused({1}, "1 entries for 2 ranks");
        refused({1, 2}, "entry 1 is 2");
        refused({0, 0}, "no rank active");
        const std::vector<RankInputs> in = makeRound(sc, 0);
        DispatchOutputs mine(sc);
        a2a.dispatch(dispatchArgs(in[rank], mine));
        refused({1, 1}, "between rounds");
        reference::HostTensor out = copyOf(in[rank].outInit);
        a2a.combine(combineArgs(in[rank], out));
        ASSERT_TRUE(elasticRound(a2a, sc, rank, 1));
        a2a.setActiveRanks({1, 1});  // no change: an agreement all the same
        ASSERT_TRUE(elasticRound(a2a, sc, rank, 2));
        if (rank == 0) {
          a2a.setActiveRanks({1, 0});
          refused({1, 1}, "cannot be made active again");
          ASSERT_TRUE(elasticRound(a2a, sc, rank, 3));  // alone: every other expert is dropped
        } else {
          a2a.setActiveRanks({1, 0});
        }
      },
      runOptions());
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// ---- Backends without elastic ranks say so. ----

class NoElastic : public AllToAll {
 public:
  void dispatch(const DispatchArgs&) override {}
  void combine(const CombineArgs&) override {}
  void synchronize() override {}
  const Config& config() const override { return config_; }
  const char* backendName() const override { return "nvlink"; }
  uint64_t bufferBytes() const override { return 0; }

 private:
  Config config_;
};

TEST(HostElastic, OtherBackendsReportUnavailable) {
  NoElastic a2a;
  for (int call = 0; call < 3; ++call) {
    try {
      if (call == 0) (void)a2a.activeRanks();
      if (call == 1) a2a.setActiveRanks({1});
      if (call == 2) (void)a2a.droppedTokens();
      ADD_FAILURE() << "call " << call << " did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnavailable) << e.what();
      EXPECT_NE(e.message().find("the nvlink backend does not support elastic ranks"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace test
}  // namespace epcomm
