// Elastic ranks on the nvlink backend (EPCOMM_ELASTIC=1, docs/failures.md "Elastic ranks"): W = 3 and 4 ranks (on GPU
// r % devices, so they share a one-GPU machine), one killed with SIGKILL in the middle of a dispatch, in the middle
// of a combine, or between two rounds; rank 0 (the bootstrap's server) or the last rank. Every survivor's failing call
// must name the dead rank within EPCOMM_TIMEOUT_MS + 1 s, and the same object must go on: NVLINK_ELASTIC_ROUNDS more
// rounds on every survivor (default 1,000 where rank 0 dies mid-combine at W = 4, 100 in the other cases, so that the
// file fits scripts/gpu-check), each equal to the CPU reference under the mask, with droppedTokens
// counting the positions left out. Then the object is destroyed among the survivors (its teardown must not wait for the
// dead rank). setActiveRanks by the caller, without a death: the rank it masks leaves, the others go on the same way.
//
// GPU: ctest --test-dir build -R NvlinkElastic (or build/tests/gpu/nvlink_elastic_test), with NVLINK_TEST_SHARE_GPU=1
// where the ranks share one GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "epcomm/error.hpp"
#include "gpu_harness.hpp"
#include "gpu_rounds.hpp"
#include "support/multiprocess.hpp"
#include "support/scoped_env.hpp"

namespace epcomm {
namespace gputest {
namespace {

constexpr int64_t kTimeoutMs = 2000;

int roundsAfter(int byDefault) {
  const char* v = std::getenv("NVLINK_ELASTIC_ROUNDS");
  return v != nullptr && std::atoi(v) > 0 ? std::atoi(v) : byDefault;
}

enum class When { kMidDispatch, kMidCombine, kBetweenRounds };

const char* whenName(When w) {
  return w == When::kMidDispatch ? "MidDispatch" : w == When::kMidCombine ? "MidCombine" : "BetweenRounds";
}

Scenario elasticScenario(uint32_t world) {
  Scenario s = scenarioFor("nvlink", world);
  s.experts = 4 * world;
  s.topK = 3;
  s.maxTokens = 32;
  s.hidden = 256;
  s.masked = true;
  return s;
}

// `rounds` rounds of `s` (its mask in s.active) from seed `seed0`, each checked against the reference, and the drop
// count of the first few against the reference's.
void roundsUnderMask(AllToAll& a2a, const Scenario& s, uint32_t rank, DeviceTensors& dev, cudaStream_t stream,
                     DeviceBuffer& scratch, uint64_t seed0, int rounds) {
  for (int i = 0; i < rounds; ++i) {
    const uint64_t seed = seed0 + static_cast<uint64_t>(i);
    const uint64_t before = a2a.droppedTokens();
    const std::string err = checkedRound(a2a, s, rank, dev, CallMode::kFused, stream, scratch, seed);
    ASSERT_TRUE(err.empty()) << "rank " << rank << ", round " << i << " under the mask:\n" << err;
    if (i < 8) {
      const Round expected(s, seed);
      EXPECT_EQ(a2a.droppedTokens() - before, expected.dropped(rank)) << "rank " << rank << ", round " << i;
    }
  }
}

class NvlinkElastic : public ::testing::TestWithParam<std::tuple<uint32_t, When, bool>> {};

TEST_P(NvlinkElastic, SurvivorsNameTheDeadRankAndGoOn) {
  const uint32_t W = std::get<0>(GetParam());
  const When when = std::get<1>(GetParam());
  const uint32_t victim = std::get<2>(GetParam()) ? 0 : W - 1;
  const std::string why = whyNotRunnable("nvlink");
  if (!why.empty()) GTEST_SKIP() << why;
  test::ScopedEnv env({{"EPCOMM_TIMEOUT_MS", "2000"}, {"EPCOMM_ELASTIC", "1"}});
  const int rounds = roundsAfter(W == 4 && when == When::kMidCombine && victim == 0 ? 1000 : 100);
  test::RunOptions o;
  o.deadlineMs = 600000;
  test::RunResult result = test::runRanks(
      static_cast<int>(W),
      [&](int r, Bootstrap& bootstrap) {
        const uint32_t rank = static_cast<uint32_t>(r);
        useRankDevice(r);
        Stream stream;
        DeviceBuffer scratch(1 << 16);
        Scenario s = elasticScenario(W);
        DeviceTensors dev;
        allocateDevice(s, rank, dev);
        std::unique_ptr<AllToAll> a2a = createAllToAll(scenarioConfig(s, rank), bootstrap, "nvlink");
        ASSERT_EQ(a2a->activeRanks(), std::vector<int32_t>(W, 1));
        for (uint64_t seed = 1; seed <= 2; ++seed) {
          ASSERT_EQ(checkedRound(*a2a, s, rank, dev, CallMode::kFused, stream.get(), scratch, seed), "");
        }
        EXPECT_EQ(a2a->droppedTokens(), 0u);

        // The round the victim does not finish.
        Round interrupted(s, 3);
        interrupted.upload(rank, dev);
        dev.dispatch.stream = dev.combine.stream = stream.get();
        if (when == When::kMidDispatch) {
          if (rank != victim) a2a->dispatch(dev.dispatch);  // the survivors' kernels wait for the victim's tokens
          bootstrap.barrier();
        } else if (when == When::kMidCombine) {
          a2a->dispatch(dev.dispatch);
          finishRound(*a2a, stream.get());
          if (rank != victim) a2a->combine(dev.combine);  // ... for its weights and partials
          bootstrap.barrier();
        } else {
          a2a->dispatch(dev.dispatch);
          a2a->combine(dev.combine);
          finishRound(*a2a, stream.get());
          bootstrap.barrier();
        }
        if (rank == victim) raise(SIGKILL);
        const auto start = std::chrono::steady_clock::now();
        bool raised = false;
        try {
          if (when == When::kBetweenRounds) {
            interrupted.upload(rank, dev);
            a2a->dispatch(dev.dispatch);
          }
          if (when != When::kMidCombine) a2a->combine(dev.combine);
          finishRound(*a2a, stream.get());
        } catch (const Error& e) {
          raised = true;
          const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          std::printf("W = %u %s, rank %u killed: rank %u raised after %.0f ms: %s\n", W, whenName(when), victim, rank,
                      secs * 1e3, e.what());
          EXPECT_TRUE(e.code() == ErrorCode::kTimeout || e.code() == ErrorCode::kPeerFailure) << e.what();
          EXPECT_NE(e.message().find("without rank " + std::to_string(victim)), std::string::npos) << e.what();
          EXPECT_NE(e.message().find("the object goes on"), std::string::npos) << e.what();
          EXPECT_LT(secs, kTimeoutMs / 1000.0 + 1.0) << e.what();
        }
        ASSERT_TRUE(raised) << "the round completed without rank " << victim;
        std::vector<int32_t> mask(W, 1);
        mask[victim] = 0;
        ASSERT_EQ(a2a->activeRanks(), mask);
        s.active = mask;
        roundsUnderMask(*a2a, s, rank, dev, stream.get(), scratch, 100, rounds);
        a2a.reset();  // among the survivors: must not wait for the dead rank
      },
      o);
  ASSERT_EQ(result.ranks.size(), W);
  for (uint32_t r = 0; r < W; ++r) {
    if (r == victim) {
      EXPECT_EQ(result.ranks[r].signal, SIGKILL) << result.summary();
    } else {
      EXPECT_TRUE(result.ranks[r].ok()) << result.summary();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Kills, NvlinkElastic,
                         ::testing::Combine(::testing::Values(3u, 4u),
                                            ::testing::Values(When::kMidDispatch, When::kMidCombine,
                                                              When::kBetweenRounds),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<NvlinkElastic::ParamType>& info) {
                           return "W" + std::to_string(std::get<0>(info.param)) + "_" +
                                  whenName(std::get<1>(info.param)) + (std::get<2>(info.param) ? "_Rank0" : "_Last");
                         });

// setActiveRanks by the caller, no death: W = 4, rank 1 masked between rounds. It leaves (its later calls raise); the
// others go on under the mask; everyone destroys its object.
TEST(NvlinkElasticSet, CallerMasksARank) {
  const std::string why = whyNotRunnable("nvlink");
  if (!why.empty()) GTEST_SKIP() << why;
  test::ScopedEnv env({{"EPCOMM_TIMEOUT_MS", "2000"}});  // without EPCOMM_ELASTIC
  const int rounds = roundsAfter(100);
  constexpr uint32_t W = 4;
  test::RunOptions o;
  o.deadlineMs = 600000;
  test::RunResult result = test::runRanks(
      static_cast<int>(W),
      [&](int r, Bootstrap& bootstrap) {
        const uint32_t rank = static_cast<uint32_t>(r);
        useRankDevice(r);
        Stream stream;
        DeviceBuffer scratch(1 << 16);
        Scenario s = elasticScenario(W);
        DeviceTensors dev;
        allocateDevice(s, rank, dev);
        std::unique_ptr<AllToAll> a2a = createAllToAll(scenarioConfig(s, rank), bootstrap, "nvlink");
        ASSERT_EQ(checkedRound(*a2a, s, rank, dev, CallMode::kFused, stream.get(), scratch, 1), "");
        const std::vector<int32_t> mask = {1, 0, 1, 1};
        EXPECT_THROW(a2a->setActiveRanks({1, 0, 1}), Error);     // wrong size: refused before anything
        EXPECT_THROW(a2a->setActiveRanks({0, 0, 0, 0}), Error);  // no rank left
        EXPECT_THROW(a2a->setActiveRanks({1, 2, 1, 1}), Error);  // not 0 / 1
        a2a->setActiveRanks(mask);
        EXPECT_EQ(a2a->activeRanks(), mask);
        if (rank == 1) {
          EXPECT_THROW(a2a->dispatch(dev.dispatch), Error) << "the rank that left went on";
        } else {
          EXPECT_THROW(a2a->setActiveRanks({1, 1, 1, 1}), Error);  // a masked rank never comes back
          s.active = mask;
          roundsUnderMask(*a2a, s, rank, dev, stream.get(), scratch, 200, rounds);
        }
        a2a.reset();
        bootstrap.barrier();  // the bootstrap is intact: nobody died
      },
      o);
  EXPECT_TRUE(result.allOk()) << result.summary();
}

}  // namespace
}  // namespace gputest
}  // namespace epcomm
