// The factory's backend selection: errors for unknown, unbuilt and mismatched requests, and the one-host rule.
#include <gtest/gtest.h>

#include <algorithm>

#include "api/factory_detail.hpp"
#include "epcomm/all_to_all.hpp"
#include "epcomm/error.hpp"
#include "expect_error.hpp"

namespace epcomm {
namespace {

Config smallConfig() {
  Config c = standardConfig("small", 1);
  c.maxNumTokens = 4;
  return c;
}

TEST(Factory, UnknownBackendIsNamed) {
  auto bs = createSelfBootstrap();
  testing::expectError([&] { createAllToAll(smallConfig(), *bs, "warp-drive"); }, ErrorCode::kInvalidArgument,
                       {"unknown backend 'warp-drive'"});
}

TEST(Factory, UnbuiltBackendSaysSoAndListsTheBuiltOnes) {
  // Which backends a build holds depends on the machine (CUDA, libfabric, the NVSHMEM wheel): ask for the first
  // known one that this build lacks; a build that has them all has nothing to refuse.
  const std::vector<std::string> built = builtBackends();
  std::string missing;
  for (const char* name : {"nvlink", "nvshmem", "proxy", "host"}) {
    if (std::find(built.begin(), built.end(), name) == built.end()) {
      missing = name;
      break;
    }
  }
  if (missing.empty()) GTEST_SKIP() << "every backend is built here";
  auto bs = createSelfBootstrap();
  testing::expectError([&] { createAllToAll(smallConfig(), *bs, missing); }, ErrorCode::kNotBuilt,
                       {"'" + missing + "' is not part of this build"});
  for (const std::string& name : built) {
    testing::expectError([&] { createAllToAll(smallConfig(), *bs, missing); }, ErrorCode::kNotBuilt, {name});
  }
}

TEST(Factory, ConfigMustMatchTheBootstrap) {
  auto bs = createSelfBootstrap();
  Config c = standardConfig("small", 2, 1);
  testing::expectError([&] { createAllToAll(c, *bs, "host"); }, ErrorCode::kInvalidArgument,
                       {"config.worldSize = 2 but the bootstrap has 1 ranks"});
}

TEST(Factory, InvalidConfigIsRejectedBeforeAnyBackend) {
  auto bs = createSelfBootstrap();
  Config c = smallConfig();
  c.expertsPerToken = 0;
  testing::expectError([&] { createAllToAll(c, *bs, "auto"); }, ErrorCode::kInvalidConfig, {"expertsPerToken"});
}

TEST(Factory, BuiltBackendsAreKnownNames) {
  for (const std::string& b : builtBackends()) {
    const std::vector<std::string> known = {"nvlink", "nvshmem", "proxy", "host"};
    EXPECT_NE(std::find(known.begin(), known.end(), b), known.end()) << b;
  }
}

TEST(Factory, OneHostRuleNamesTheFirstRankElsewhere) {
  std::string why;
  EXPECT_TRUE(detail::allOnOneHost({"a", "a", "a"}, &why));
  EXPECT_TRUE(detail::allOnOneHost({"a"}, &why));
  EXPECT_FALSE(detail::allOnOneHost({"a", "a", "b", "c"}, &why));
  EXPECT_NE(why.find("rank 0 on 'a', rank 2 on 'b'"), std::string::npos) << why;
}

}  // namespace
}  // namespace epcomm
