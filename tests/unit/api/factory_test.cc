// The factory's backend selection: errors for unknown, unbuilt and mismatched requests, and the one-host rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>

#include "api/factory_detail.hpp"
#include "epcomm/all_to_all.hpp"
#include "epcomm/error.hpp"

namespace epcomm {
namespace {

Config smallConfig() {
  Config c = standardConfig("small", 1);
  c.maxNumTokens = 4;
  return c;
}

ErrorCode codeOf(const std::function<void()>& f, std::string* message) {
  try {
    f();
  } catch (const Error& e) {
    *message = e.message();
    return e.code();
  }
  ADD_FAILURE() << "no epcomm::Error thrown";
  return ErrorCode::kInternal;
}

TEST(Factory, UnknownBackendIsNamed) {
  auto bs = createSelfBootstrap();
  std::string msg;
  EXPECT_EQ(codeOf([&] { createAllToAll(smallConfig(), *bs, "warp-drive"); }, &msg), ErrorCode::kInvalidArgument);
  EXPECT_NE(msg.find("unknown backend 'warp-drive'"), std::string::npos) << msg;
}

TEST(Factory, UnbuiltBackendSaysSoAndListsTheBuiltOnes) {
  auto bs = createSelfBootstrap();
  std::string msg;
  EXPECT_EQ(codeOf([&] { createAllToAll(smallConfig(), *bs, "nvshmem"); }, &msg), ErrorCode::kNotBuilt);
  EXPECT_NE(msg.find("'nvshmem' is not part of this build"), std::string::npos) << msg;
  for (const std::string& b : builtBackends()) EXPECT_NE(msg.find(b), std::string::npos) << msg;
}

TEST(Factory, ConfigMustMatchTheBootstrap) {
  auto bs = createSelfBootstrap();
  Config c = standardConfig("small", 2, 1);
  std::string msg;
  EXPECT_EQ(codeOf([&] { createAllToAll(c, *bs, "host"); }, &msg), ErrorCode::kInvalidArgument);
  EXPECT_NE(msg.find("config.worldSize = 2 but the bootstrap has 1 ranks"), std::string::npos) << msg;
}

TEST(Factory, InvalidConfigIsRejectedBeforeAnyBackend) {
  auto bs = createSelfBootstrap();
  Config c = smallConfig();
  c.expertsPerToken = 0;
  std::string msg;
  EXPECT_EQ(codeOf([&] { createAllToAll(c, *bs, "auto"); }, &msg), ErrorCode::kInvalidConfig);
  EXPECT_NE(msg.find("expertsPerToken"), std::string::npos) << msg;
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
