// Elastic ranks on the nvshmem backend (EPCOMM_ELASTIC=1, docs/failures.md "Elastic ranks", docs/nvshmem.md): W = 3
// ranks (on GPU r % devices, so they share a one-GPU machine as NVSHMEM PEs), one killed with SIGKILL in the middle of
// a dispatch, in the middle of a combine, or between two rounds; rank 0 (the bootstrap's server) or the last rank; and
// W = 4 in DP groups of 2 (the dead rank's group peer loses the tokens it would have sent). Every survivor's failing
// call must name the dead rank within EPCOMM_TIMEOUT_MS + 1.5 s, and the same object must go on: NVSHMEM_ELASTIC_ROUNDS
// more rounds on every survivor (default 20), each equal to the CPU reference under the mask, with droppedTokens
// counting the positions left out. Then the object is destroyed among the survivors: its teardown must neither wait
// for the dead rank nor call an NVSHMEM collective (the symmetric buffers stay allocated). setActiveRanks by the
// caller, without a death (D = 1 and 2): the rank it masks leaves, the others go on the same way.
//
// GPU: ctest --test-dir build -R NvshmemElastic (or build/tests/gpu/nvshmem_elastic_test).
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

// One kill case: W ranks in DP groups of `dp`, rank `victim` killed at `when`.
void killCase(uint32_t world, uint32_t dp, KillPoint when, uint32_t victim) {
  const std::string why = whyNotRunnable("nvshmem");
  if (!why.empty()) GTEST_SKIP() << why;
  BackendEnv nvshmemEnv("nvshmem");
  test::ScopedEnv env({{"EPCOMM_TIMEOUT_MS", "2000"}, {"EPCOMM_ELASTIC", "1"}});
  KillCase k;
  k.backend = k.label = "nvshmem";
  k.when = when;
  k.victim = victim;
  k.roundsAfter = roundsAfter("NVSHMEM_ELASTIC_ROUNDS", 20);
  // The agreement leaves a rank whose process is gone out at once; the reset of the symmetric buffers and the PEs
  // taking turns on a shared GPU add a little.
  k.boundMs = kTimeoutMs + 1500;
  runKillCase(elasticScenario("nvshmem", world, dp), k);
}

// (when, victim rank 0 (else the last)), W = 3.
class NvshmemElastic : public ::testing::TestWithParam<std::tuple<KillPoint, bool>> {};

TEST_P(NvshmemElastic, SurvivorsNameTheDeadRankAndGoOn) {
  killCase(3, 1, std::get<0>(GetParam()), std::get<1>(GetParam()) ? 0 : 2);
}

INSTANTIATE_TEST_SUITE_P(Kills, NvshmemElastic,
                         ::testing::Combine(::testing::Values(KillPoint::kMidDispatch, KillPoint::kMidCombine,
                                                              KillPoint::kBetweenRounds),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<NvshmemElastic::ParamType>& info) {
                           return std::string("W3_") + killPointName(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_Rank0" : "_Last");
                         });

// W = 4 in DP groups of 2: rank 0 dies mid-combine (its group peer, rank 1, gets no partials for the tokens rank 0
// sent and none from it), or rank 3 mid-dispatch.
TEST(NvshmemElasticDp, W4Dp2MidCombineRank0) { killCase(4, 2, KillPoint::kMidCombine, 0); }
TEST(NvshmemElasticDp, W4Dp2MidDispatchLast) { killCase(4, 2, KillPoint::kMidDispatch, 3); }

// setActiveRanks by the caller, no death: W = 4, rank 1 masked between rounds. It leaves (its later calls raise); the
// others go on under the mask; everyone destroys its object, and the bootstrap stays intact.
class NvshmemElasticSet : public ::testing::TestWithParam<uint32_t> {};

TEST_P(NvshmemElasticSet, CallerMasksARank) {
  const std::string why = whyNotRunnable("nvshmem");
  if (!why.empty()) GTEST_SKIP() << why;
  BackendEnv nvshmemEnv("nvshmem");
  test::ScopedEnv env({{"EPCOMM_TIMEOUT_MS", "2000"}});  // without EPCOMM_ELASTIC
  runCallerMasksARank(elasticScenario("nvshmem", 4, GetParam()), "nvshmem", roundsAfter("NVSHMEM_ELASTIC_ROUNDS", 20));
}

INSTANTIATE_TEST_SUITE_P(Dp, NvshmemElasticSet, ::testing::Values(1u, 2u),
                         [](const ::testing::TestParamInfo<uint32_t>& info) {
                           return "D" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace gputest
}  // namespace epcomm
