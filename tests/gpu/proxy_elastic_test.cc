// Elastic ranks on the GPU proxy backend (EPCOMM_ELASTIC=1, docs/proxy.md "Elastic ranks"): W = 3 and 4 ranks (on GPU
// r % devices, so they share a one-GPU machine: W = 3 over shm, W = 4 over tcp), every peer over the fabric (
// EPCOMM_PROXY_LOCAL_SIZE=1), one killed with SIGKILL in the middle of a dispatch, in the middle of a combine, or
// between two rounds; rank 0 (the bootstrap's server) or the last rank. Every survivor's failing call must name the
// dead rank within twice EPCOMM_TIMEOUT_MS + 1 s (the channel waits a timeout for the dead rank, then the survivors
// agree), and the same object must go on: PROXY_ELASTIC_ROUNDS more rounds on every survivor (default 20), each equal
// to the CPU reference under the mask, with droppedTokens counting the positions left out. Then the object is
// destroyed among the survivors (its teardown must not wait for the dead rank). setActiveRanks by the caller, without a
// death (D = 1 and 2): the rank it masks leaves, the others go on the same way. Same-node peers over NVLink refuse
// elastic ranks (kUnavailable).
//
// GPU: ctest --test-dir build -R ProxyElastic (or build/tests/gpu/proxy_elastic_test).
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "elastic_cases.hpp"
#include "epcomm/error.hpp"
#include "gpu_harness.hpp"
#include "gpu_rounds.hpp"
#include "support/fabric_probe.hpp"
#include "support/multiprocess.hpp"
#include "support/scoped_env.hpp"

namespace epcomm {
namespace gputest {
namespace {

constexpr int64_t kTimeoutMs = 2000;

Scenario elasticScenario(uint32_t world, uint32_t dp = 1) { return gputest::elasticScenario("proxy", world, dp); }

// Skips without a GPU, the proxy backend or the provider.
#define SKIP_UNLESS_PROXY(provider)                  \
  do {                                               \
    const std::string why = whyNotRunnable("proxy"); \
    if (!why.empty()) GTEST_SKIP() << why;           \
    SKIP_WITHOUT(provider);                          \
  } while (0)

// ((world, provider), when, victim rank 0 (else the last)): W = 3 over shm and W = 4 over tcp (each world and each
// provider once, every kill point on each).
using WorldProvider = std::pair<uint32_t, std::string>;
class ProxyElastic : public ::testing::TestWithParam<std::tuple<WorldProvider, KillPoint, bool>> {};

TEST_P(ProxyElastic, SurvivorsNameTheDeadRankAndGoOn) {
  const uint32_t W = std::get<0>(GetParam()).first;
  const std::string provider = std::get<0>(GetParam()).second;
  SKIP_UNLESS_PROXY(provider);
  test::ScopedEnv env({{"EPCOMM_TIMEOUT_MS", "2000"},
                       {"EPCOMM_ELASTIC", "1"},
                       {"EPCOMM_FABRIC_PROVIDER", provider.c_str()},
                       {"EPCOMM_PROXY_LOCAL_SIZE", "1"}});
  KillCase k;
  k.backend = "proxy";
  k.label = "proxy over " + provider;
  k.when = std::get<1>(GetParam());
  k.victim = std::get<2>(GetParam()) ? 0 : W - 1;
  k.roundsAfter = roundsAfter("PROXY_ELASTIC_ROUNDS", 20);
  k.boundMs = 2 * kTimeoutMs + 1000;  // the channel waits a timeout for the dead rank, then the survivors agree
  k.codes.push_back(ErrorCode::kFabric);
  runKillCase(elasticScenario(W), k);
}

INSTANTIATE_TEST_SUITE_P(Kills, ProxyElastic,
                         ::testing::Combine(::testing::Values(WorldProvider{3u, "shm"}, WorldProvider{4u, "tcp"}),
                                            ::testing::Values(KillPoint::kMidDispatch, KillPoint::kMidCombine,
                                                              KillPoint::kBetweenRounds),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<ProxyElastic::ParamType>& info) {
                           const WorldProvider& wp = std::get<0>(info.param);
                           return "W" + std::to_string(wp.first) + "_" + killPointName(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_Rank0_" : "_Last_") + wp.second;
                         });

// setActiveRanks by the caller, no death: W = 4, rank 1 masked between rounds (with D = 2 it is a sender of group 0,
// whose tokens it sent are dropped too). It leaves (its later calls raise); the others go on under the mask; everyone
// destroys its object. Without EPCOMM_ELASTIC, as on the host backend.
class ProxyElasticSet : public ::testing::TestWithParam<std::tuple<uint32_t, std::string>> {};

TEST_P(ProxyElasticSet, CallerMasksARank) {
  const uint32_t dp = std::get<0>(GetParam());
  const std::string provider = std::get<1>(GetParam());
  SKIP_UNLESS_PROXY(provider);
  test::ScopedEnv env(
      {{"EPCOMM_TIMEOUT_MS", "2000"}, {"EPCOMM_FABRIC_PROVIDER", provider.c_str()}, {"EPCOMM_PROXY_LOCAL_SIZE", "1"}});
  runCallerMasksARank(elasticScenario(4, dp), "proxy", roundsAfter("PROXY_ELASTIC_ROUNDS", 20));
}

INSTANTIATE_TEST_SUITE_P(Providers, ProxyElasticSet,
                         ::testing::Combine(::testing::Values(1u, 2u), ::testing::Values("tcp", "shm")),
                         [](const ::testing::TestParamInfo<ProxyElasticSet::ParamType>& info) {
                           return "Dp" + std::to_string(std::get<0>(info.param)) + "_" + std::get<1>(info.param);
                         });

// Same-node peers over NVLink cannot skip a masked rank: with EPCOMM_ELASTIC=1 every rank refuses the object
// (kUnavailable, naming EPCOMM_PROXY_LOCAL_SIZE); without it setActiveRanks refuses, and the object goes on.
TEST(ProxyElasticLocal, NodePeersOverNvlinkRefuseElasticRanks) {
  SKIP_UNLESS_PROXY(std::string("tcp"));
  constexpr uint32_t W = 2;
  for (int elastic = 0; elastic <= 1; ++elastic) {
    test::ScopedEnv env({{"EPCOMM_TIMEOUT_MS", "2000"},
                         {"EPCOMM_ELASTIC", elastic ? "1" : "0"},
                         {"EPCOMM_FABRIC_PROVIDER", "tcp"},
                         {"EPCOMM_PROXY_LOCAL_SIZE", "2"}});
    test::RunOptions o;
    o.deadlineMs = 120000;
    test::RunResult result = test::runRanks(
        static_cast<int>(W),
        [&](int r, Bootstrap& bootstrap) {
          const uint32_t rank = static_cast<uint32_t>(r);
          ElasticRank er(elasticScenario(W), rank);
          Scenario& s = er.s;
          DeviceTensors& dev = er.dev;
          DeviceBuffer& scratch = er.scratch;
          Stream& stream = er.stream;
          std::unique_ptr<AllToAll> a2a;
          try {
            a2a = createAllToAll(scenarioConfig(s, rank), bootstrap, "proxy");
            EXPECT_EQ(elastic, 0) << "created with elastic ranks and node peers over NVLink";
          } catch (const Error& e) {
            EXPECT_EQ(elastic, 1) << e.what();
            EXPECT_EQ(e.code(), ErrorCode::kUnavailable) << e.what();
            EXPECT_NE(e.message().find("EPCOMM_PROXY_LOCAL_SIZE"), std::string::npos) << e.what();
            return;
          }
          ASSERT_EQ(checkedRound(*a2a, s, rank, dev, CallMode::kFused, stream.get(), scratch, 1), "");
          EXPECT_EQ(a2a->activeRanks(), std::vector<int32_t>(W, 1));
          try {
            a2a->setActiveRanks({1, 0});
            ADD_FAILURE() << "setActiveRanks with node peers over NVLink went through";
          } catch (const Error& e) {
            EXPECT_EQ(e.code(), ErrorCode::kUnavailable) << e.what();
          }
          ASSERT_EQ(checkedRound(*a2a, s, rank, dev, CallMode::kFused, stream.get(), scratch, 2), "");
          a2a.reset();
        },
        o);
    EXPECT_TRUE(result.allOk()) << "elastic " << elastic << ": " << result.summary();
  }
}

}  // namespace
}  // namespace gputest
}  // namespace epcomm
