// One config check at construction: every field but the rank must agree across ranks, and a mismatch is reported
// on every rank, naming the field and both values. Real processes over the TCP bootstrap on 127.0.0.1.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "core/agreement.hpp"
#include "epcomm/all_to_all.hpp"
#include "epcomm/error.hpp"
#include "support/multiprocess.hpp"

namespace epcomm {
namespace {

Config baseConfig(uint32_t world, uint32_t rank) {
  Config c;
  c.maxNumTokens = 16;
  c.numExperts = 12;
  c.expertsPerToken = 3;
  c.worldSize = world;
  c.rank = rank;
  c.dpSize = 1;
  c.hiddenDim = 32;
  c.hiddenDimBytes = 64;
  c.hiddenDimScaleBytes = 0;
  c.expertPadding = 1;
  c.layout = Layout::kBatched;
  return c;
}

TEST(ConfigAgreement, EveryFieldButTheRankIsCompared) {
  const Config a = baseConfig(4, 0);
  const std::vector<std::pair<std::string, std::function<void(Config&)>>> changes = {
      {"max_num_tokens is 16 on rank 0 but 32 on rank 1", [](Config& c) { c.maxNumTokens = 32; }},
      {"num_experts is 12 on rank 0 but 16 on rank 1", [](Config& c) { c.numExperts = 16; }},
      {"experts_per_token is 3 on rank 0 but 2 on rank 1", [](Config& c) { c.expertsPerToken = 2; }},
      {"world_size is 4 on rank 0 but 8 on rank 1", [](Config& c) { c.worldSize = 8; }},
      {"dp_size is 1 on rank 0 but 2 on rank 1", [](Config& c) { c.dpSize = 2; }},
      {"hidden_dim is 32 on rank 0 but 16 on rank 1", [](Config& c) { c.hiddenDim = 16; }},
      {"hidden_dim_bytes is 64 on rank 0 but 32 on rank 1", [](Config& c) { c.hiddenDimBytes = 32; }},
      {"hidden_dim_scale_bytes is 0 on rank 0 but 8 on rank 1", [](Config& c) { c.hiddenDimScaleBytes = 8; }},
      {"expert_padding is 1 on rank 0 but 16 on rank 1", [](Config& c) { c.expertPadding = 16; }},
      {"layout is batched on rank 0 but packed on rank 1", [](Config& c) { c.layout = Layout::kPacked; }},
  };
  for (const auto& [expected, change] : changes) {
    Config b = baseConfig(4, 1);
    change(b);
    EXPECT_EQ(settingsDifference(configSettings(a), 0, configSettings(b), 1), expected);
  }
  // The rank is the one field that differs by design.
  EXPECT_EQ(settingsDifference(configSettings(a), 0, configSettings(baseConfig(4, 3)), 3), "");
  // A field this build does not know (another build on the peer) is named too.
  std::vector<AgreedSetting> more = configSettings(a);
  more.push_back({"future_field", "1"});
  EXPECT_EQ(settingsDifference(configSettings(a), 0, more, 2),
            "future_field is not set on rank 0 but 1 on rank 2 (another epcomm build?)");
}

// Runs createAllToAll on `world` ranks with rank `odd`'s config changed; every rank must throw kInvalidConfig with
// `expected` in its message.
void expectMismatchEverywhere(uint32_t world, uint32_t odd, const std::function<void(Config&)>& change,
                              const std::string& expected) {
  test::RunResult result = test::runRanks(static_cast<int>(world), [&](int rank, Bootstrap& bootstrap) {
    Config c = baseConfig(world, static_cast<uint32_t>(rank));
    if (static_cast<uint32_t>(rank) == odd) change(c);
    try {
      createAllToAll(c, bootstrap, "host");
      ADD_FAILURE() << "rank " << rank << " constructed an object with a mismatched config";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidConfig) << e.what();
      EXPECT_EQ(e.message(), "config mismatch: " + expected) << e.what();
    }
  });
  EXPECT_TRUE(result.allOk()) << result.summary();
}

TEST(ConfigAgreement, HiddenDimMismatchIsReportedOnEveryRank) {
  // Same hidden_dim_bytes (so every tensor shape check passes locally): without the check both ranks computed
  // wrong results silently.
  expectMismatchEverywhere(
      2, 1,
      [](Config& c) {
        c.hiddenDim = 16;
        c.hiddenDimBytes = 64;
      },
      "hidden_dim is 32 on rank 0 but 16 on rank 1");
}

TEST(ConfigAgreement, FieldsThatFailedInTheFirstRoundAreNamedAtConstruction) {
  expectMismatchEverywhere(
      3, 2, [](Config& c) { c.numExperts = 24; }, "num_experts is 12 on rank 0 but 24 on rank 2");
  expectMismatchEverywhere(
      4, 3, [](Config& c) { c.dpSize = 2; }, "dp_size is 1 on rank 0 but 2 on rank 3");
  expectMismatchEverywhere(
      2, 0, [](Config& c) { c.maxNumTokens = 8; }, "max_num_tokens is 8 on rank 0 but 16 on rank 1");
  expectMismatchEverywhere(
      2, 1, [](Config& c) { c.expertsPerToken = 2; }, "experts_per_token is 3 on rank 0 but 2 on rank 1");
  expectMismatchEverywhere(
      2, 1, [](Config& c) { c.hiddenDimScaleBytes = 16; }, "hidden_dim_scale_bytes is 0 on rank 0 but 16 on rank 1");
}

TEST(ConfigAgreement, AgreeingSettingsPassAndKnobsAreComparedToo) {
  test::RunResult result = test::runRanks(3, [&](int rank, Bootstrap& bootstrap) {
    EXPECT_NO_THROW(checkSettingsAgree(bootstrap, "config", configSettings(baseConfig(3, rank))));
    // A backend knob: the same hook, another prefix.
    const std::vector<AgreedSetting> knobs = {{"EPCOMM_SOME_QUEUES", "4"},
                                              {"EPCOMM_SOME_MODE", rank == 1 ? "fast" : "safe"}};
    try {
      checkSettingsAgree(bootstrap, "test backend", knobs);
      ADD_FAILURE() << "a knob mismatch passed";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidConfig);
      EXPECT_EQ(e.message(), "test backend mismatch: EPCOMM_SOME_MODE is safe on rank 0 but fast on rank 1");
    }
    // The bootstrap is still in step after a mismatch: one more collective works.
    int mine = rank, all[3] = {0, 0, 0};
    bootstrap.allGather(&mine, all, sizeof(int));
    EXPECT_EQ(all[2], 2);
  });
  EXPECT_TRUE(result.allOk()) << result.summary();
}

}  // namespace
}  // namespace epcomm
