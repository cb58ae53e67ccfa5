// The environment's numeric variables are checked: a value outside its range is an error naming the variable, not a
// silent clamp.
#include "core/env.hpp"

#include <gtest/gtest.h>

#include <cstdlib>

#include "expect_error.hpp"
#include "support/scoped_env.hpp"

namespace epcomm {
namespace {

using test::ScopedEnv;

TEST(Env, OutOfRangeValuesAreErrors) {
  struct Case {
    const char* name;
    const char* value;
  };
  for (const Case& c :
       {Case{"EPCOMM_NVLINK_PUSH_QUARTERS", "5"}, Case{"EPCOMM_NVLINK_PUSH_QUARTERS", "-2"},
        Case{"EPCOMM_NVLINK_PULL", "2"}, Case{"EPCOMM_NVLINK_BLOCKS", "-1"}, Case{"EPCOMM_NVLINK_GRAPH_LAUNCH", "2"},
        Case{"EPCOMM_NVLINK_LINES", "2"}, Case{"EPCOMM_NVLINK_LINES", "-2"}}) {
    ScopedEnv set({{c.name, c.value}});
    testing::expectError([] { readEnv(); }, ErrorCode::kInvalidArgument, {c.name, c.value, "out of range"});
  }
  {
    ScopedEnv set({{"EPCOMM_NVLINK_PUSH_QUARTERS", "two"}});
    testing::expectError([] { readEnv(); }, ErrorCode::kInvalidArgument,
                         {"EPCOMM_NVLINK_PUSH_QUARTERS", "'two'", "not an integer"});
  }
}

TEST(Env, ValuesInRangeAreRead) {
  ScopedEnv set({{"EPCOMM_NVLINK_PUSH_QUARTERS", "4"}, {"EPCOMM_NVLINK_PULL", "0"}});
  const Env e = readEnv();
  EXPECT_EQ(e.nvlinkPushQuarters, 4);
  EXPECT_EQ(e.nvlinkPull, 0);
  EXPECT_EQ(e.nvlinkBlocks, 0);
  EXPECT_EQ(e.nvlinkLines, -1);      // default: line mode automatic
  EXPECT_TRUE(e.nvlinkGraphLaunch);  // default: cached launch graphs on
  ScopedEnv off({{"EPCOMM_NVLINK_GRAPH_LAUNCH", "0"}, {"EPCOMM_NVLINK_LINES", "0"}});
  EXPECT_FALSE(readEnv().nvlinkGraphLaunch);
  EXPECT_EQ(readEnv().nvlinkLines, 0);
}

}  // namespace
}  // namespace epcomm
