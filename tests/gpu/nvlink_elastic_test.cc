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
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <tuple>

#include "elastic_cases.hpp"
#include "gpu_harness.hpp"
#include "gpu_rounds.hpp"
#include "support/scoped_env.hpp"

namespace epcomm {
namespace gputest {
namespace {

constexpr int64_t kTimeoutMs = 2000;

Scenario elasticScenario(uint32_t world) { return gputest::elasticScenario("nvlink", world); }

// (world, when, victim rank 0 (else the last))
class NvlinkElastic : public ::testing::TestWithParam<std::tuple<uint32_t, KillPoint, bool>> {};

TEST_P(NvlinkElastic, SurvivorsNameTheDeadRankAndGoOn) {
  const uint32_t W = std::get<0>(GetParam());
  const std::string why = whyNotRunnable("nvlink");
  if (!why.empty()) GTEST_SKIP() << why;
  test::ScopedEnv env({{"EPCOMM_TIMEOUT_MS", "2000"}, {"EPCOMM_ELASTIC", "1"}});
  KillCase k;
  k.backend = k.label = "nvlink";
  k.when = std::get<1>(GetParam());
  k.victim = std::get<2>(GetParam()) ? 0 : W - 1;
  k.roundsAfter =
      roundsAfter("NVLINK_ELASTIC_ROUNDS", W == 4 && k.when == KillPoint::kMidCombine && k.victim == 0 ? 1000 : 100);
  k.boundMs = kTimeoutMs + 1000;  // the agreement leaves a peer whose process is gone out at once
  runKillCase(elasticScenario(W), k);
}

INSTANTIATE_TEST_SUITE_P(Kills, NvlinkElastic,
                         ::testing::Combine(::testing::Values(3u, 4u),
                                            ::testing::Values(KillPoint::kMidDispatch, KillPoint::kMidCombine,
                                                              KillPoint::kBetweenRounds),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<NvlinkElastic::ParamType>& info) {
                           return "W" + std::to_string(std::get<0>(info.param)) + "_" +
                                  killPointName(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_Rank0" : "_Last");
                         });

// setActiveRanks by the caller, no death: W = 4, rank 1 masked between rounds. It leaves (its later calls raise); the
// others go on under the mask; everyone destroys its object.
TEST(NvlinkElasticSet, CallerMasksARank) {
  const std::string why = whyNotRunnable("nvlink");
  if (!why.empty()) GTEST_SKIP() << why;
  test::ScopedEnv env({{"EPCOMM_TIMEOUT_MS", "2000"}});  // without EPCOMM_ELASTIC
  runCallerMasksARank(elasticScenario(4), "nvlink", roundsAfter("NVLINK_ELASTIC_ROUNDS", 100));
}

}  // namespace
}  // namespace gputest
}  // namespace epcomm
