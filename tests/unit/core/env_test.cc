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
       {Case{"EPCOMM_NVLINK_THREADS", "513"}, Case{"EPCOMM_NVLINK_THREADS", "-1"}, Case{"EPCOMM_NVLINK_BLOCKS", "-1"},
        Case{"EPCOMM_NVLINK_GRAPH_LAUNCH", "2"}, Case{"EPCOMM_NVLINK_TRACE", "3"}, Case{"EPCOMM_NVLINK_TRACE", "-1"}}) {
    ScopedEnv set({{c.name, c.value}});
    testing::expectError([] { readEnv(); }, ErrorCode::kInvalidArgument, {c.name, c.value, "out of range"});
  }
  {
    ScopedEnv set({{"EPCOMM_NVLINK_BLOCKS", "two"}});
    testing::expectError([] { readEnv(); }, ErrorCode::kInvalidArgument,
                         {"EPCOMM_NVLINK_BLOCKS", "'two'", "not an integer"});
  }
}

TEST(Env, ValuesInRangeAreRead) {
  ScopedEnv set({{"EPCOMM_NVLINK_THREADS", "256"}, {"EPCOMM_NVLINK_TRACE", "2"}});
  const Env e = readEnv();
  EXPECT_EQ(e.nvlinkThreads, 256);
  EXPECT_EQ(e.nvlinkTrace, 2);
  EXPECT_EQ(e.nvlinkBlocks, 0);      // default: automatic
  EXPECT_TRUE(e.nvlinkGraphLaunch);  // default: cached launch graphs on
  ScopedEnv off({{"EPCOMM_NVLINK_GRAPH_LAUNCH", "0"}, {"EPCOMM_NVLINK_BLOCKS", "132"}});
  EXPECT_FALSE(readEnv().nvlinkGraphLaunch);
  EXPECT_EQ(readEnv().nvlinkBlocks, 132);
}

}  // namespace
}  // namespace epcomm
