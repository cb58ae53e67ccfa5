// Config::validate (one test per bad field or combination) and the standard configurations of SPEC 3.
#include "epcomm/config.hpp"

#include <gtest/gtest.h>

#include <string>

#include "core/layout.hpp"
#include "expect_error.hpp"

namespace epcomm {
namespace {

using testing::expectError;

// A small valid config every test starts from and breaks in one place.
Config good() {
  Config c;
  c.maxNumTokens = 16;
  c.numExperts = 16;
  c.expertsPerToken = 4;
  c.worldSize = 4;
  c.rank = 1;
  c.dpSize = 2;
  c.hiddenDim = 64;
  c.hiddenDimBytes = 64;
  c.hiddenDimScaleBytes = 8;
  c.expertPadding = 4;
  return c;
}

void expectBad(const Config& c, std::initializer_list<std::string> parts) {
  expectError([&] { c.validate(); }, ErrorCode::kInvalidConfig, parts);
}

TEST(ConfigValidate, GoodConfigPasses) { EXPECT_NO_THROW(good().validate()); }

TEST(ConfigValidate, WorldNotMultipleOfDp) {
  Config c = good();
  c.dpSize = 3;
  expectBad(c, {"worldSize 4", "dpSize 3"});
}

TEST(ConfigValidate, ExpertsNotMultipleOfWorld) {
  Config c = good();
  c.numExperts = 18;
  expectBad(c, {"numExperts 18", "worldSize 4"});
}

TEST(ConfigValidate, TopKExceedsExperts) {
  Config c = good();
  c.numExperts = 8;
  c.expertsPerToken = 9;
  expectBad(c, {"expertsPerToken 9", "numExperts 8"});
}

TEST(ConfigValidate, TopKZero) {
  Config c = good();
  c.expertsPerToken = 0;
  expectBad(c, {"expertsPerToken", "got 0"});
}

TEST(ConfigValidate, TopKAboveSupportedMaximum) {
  Config c = good();
  c.numExperts = 128;
  c.expertsPerToken = kMaxExpertsPerToken + 1;
  expectBad(c, {"expertsPerToken " + std::to_string(kMaxExpertsPerToken + 1), "maximum"});
}

TEST(ConfigValidate, HiddenDimBytesNotMultipleOf16) {
  Config c = good();
  c.hiddenDimBytes = 72;
  expectBad(c, {"hiddenDimBytes 72", "16"});
}

TEST(ConfigValidate, HiddenDimBytesZero) {
  Config c = good();
  c.hiddenDimBytes = 0;
  expectBad(c, {"hiddenDimBytes", "got 0"});
}

TEST(ConfigValidate, ScaleBytesNotMultipleOf4) {
  Config c = good();
  c.hiddenDimScaleBytes = 6;
  expectBad(c, {"hiddenDimScaleBytes 6", "4"});
}

TEST(ConfigValidate, MaxNumTokensZero) {
  Config c = good();
  c.maxNumTokens = 0;
  expectBad(c, {"maxNumTokens", "got 0"});
}

TEST(ConfigValidate, PaddingNotPowerOfTwo) {
  Config c = good();
  c.expertPadding = 12;
  expectBad(c, {"expertPadding 12", "power of two"});
}

TEST(ConfigValidate, PaddingZero) {
  Config c = good();
  c.expertPadding = 0;
  expectBad(c, {"expertPadding 0", "power of two"});
}

TEST(ConfigValidate, RankOutOfRange) {
  Config c = good();
  c.rank = 4;
  expectBad(c, {"rank 4", "worldSize=4"});
}

TEST(ConfigValidate, WorldZero) {
  Config c = good();
  c.worldSize = 0;
  c.rank = 0;
  expectBad(c, {"worldSize", "got 0"});
}

TEST(ConfigValidate, DpZero) {
  Config c = good();
  c.dpSize = 0;
  expectBad(c, {"dpSize", "got 0"});
}

TEST(ConfigValidate, ExpertsZero) {
  Config c = good();
  c.numExperts = 0;
  expectBad(c, {"numExperts", "got 0"});
}

TEST(ConfigValidate, HiddenDimZero) {
  Config c = good();
  c.hiddenDim = 0;
  expectBad(c, {"hiddenDim", "got 0"});
}

TEST(ConfigValidate, HiddenDimNotMultipleOf4) {
  Config c = good();
  c.hiddenDim = 66;
  expectBad(c, {"hiddenDim 66", "multiple of 4"});
}

TEST(ConfigValidate, InvalidLayout) {
  Config c = good();
  c.layout = static_cast<Layout>(7);
  expectBad(c, {"layout 7"});
}

TEST(ConfigValidate, TooManyRows) {
  // 2^24 tokens x 16 groups = 2^28 rows per expert, x 8 local experts = 2^31: one past int32 row indices.
  Config c = good();
  c.maxNumTokens = 1u << 24;
  c.worldSize = 16;
  c.dpSize = 1;
  c.numExperts = 128;
  c.expertPadding = 1;
  expectBad(c, {"maxNumTokens 16777216", "int32"});
  c.maxNumTokens = (1u << 24) - 1;
  EXPECT_NO_THROW(c.validate());
}

TEST(ConfigValidate, MessageCarriesTheWholeConfig) {
  Config c = good();
  c.dpSize = 3;
  expectBad(c, {"(config: E=16 K=4 H=64 bytes=64 scale=8 T=16 W=4 D=3 pad=4 batched rank=1)"});
}

TEST(ConfigDerived, RowsAndGroups) {
  Config c = good();  // W=4, D=2 -> G=2; L=4; T=16; pad 4
  EXPECT_EQ(c.numLocalExperts(), 4u);
  EXPECT_EQ(c.numDpGroups(), 2u);
  EXPECT_EQ(c.dpGroup(), 0u);
  c.rank = 3;
  EXPECT_EQ(c.dpGroup(), 1u);
  EXPECT_EQ(c.batchedRowsPerExpert(), 32u);  // 16 * 2, already a multiple of 4
  c.maxNumTokens = 15;
  EXPECT_EQ(c.batchedRowsPerExpert(), 32u);  // 30 rounded up to 4
  // packed: 15 tokens * 2 groups * min(K=4, L=4) + 4 experts * 3 padding rows
  EXPECT_EQ(c.packedRows(), 15u * 2 * 4 + 4 * 3);
  EXPECT_EQ(c.expertRows(), c.batchedRowsPerExpert());
  c.layout = Layout::kPacked;
  EXPECT_EQ(c.expertRows(), c.packedRows());
  EXPECT_STREQ(layoutName(Layout::kBatched), "batched");
  EXPECT_STREQ(layoutName(Layout::kPacked), "packed");
}

TEST(ConfigDerived, ExpertRowOffsets) {
  Config c = good();
  c.numExperts = 8;
  c.worldSize = 2;  // L = 4
  c.expertPadding = 4;
  const int32_t counts[4] = {3, 0, 5, 8};
  c.layout = Layout::kPacked;
  EXPECT_EQ(c.expertRowOffsets(counts), (std::vector<uint64_t>{0, 4, 4, 12, 20}));
  c.expertPadding = 1;
  EXPECT_EQ(c.expertRowOffsets(counts), (std::vector<uint64_t>{0, 3, 3, 8, 16}));
  c.layout = Layout::kBatched;
  const uint64_t R = c.batchedRowsPerExpert();
  EXPECT_EQ(c.expertRowOffsets(counts), (std::vector<uint64_t>{0, R, 2 * R, 3 * R, 4 * R}));
  const int32_t negative[4] = {1, -1, 0, 0};
  expectError([&] { c.expertRowOffsets(negative); }, ErrorCode::kInvalidArgument, {"local expert 1 has -1 tokens"});
  const int32_t tooMany[4] = {0, 0, static_cast<int32_t>(R + 1), 0};
  expectError([&] { c.expertRowOffsets(tooMany); }, ErrorCode::kInvalidArgument, {"local expert 2 has"});
}

TEST(StandardConfig, Names) {
  int count = 0;
  const char* const* names = standardConfigNames(&count);
  ASSERT_EQ(count, 4);
  EXPECT_STREQ(names[0], "decode");
  EXPECT_STREQ(names[1], "prefill");
  EXPECT_STREQ(names[2], "small");
  EXPECT_STREQ(names[3], "qwen3");
}

TEST(StandardConfig, Decode) {
  Config c = standardConfig("decode", 8, 3, 2);
  EXPECT_EQ(c.numExperts, 256u);
  EXPECT_EQ(c.expertsPerToken, 8u);
  EXPECT_EQ(c.hiddenDim, 7168u);
  EXPECT_EQ(c.hiddenDimBytes, 7168u);      // fp8 e4m3
  EXPECT_EQ(c.hiddenDimScaleBytes, 224u);  // fp32 per 128 elements
  EXPECT_EQ(c.maxNumTokens, 128u);
  EXPECT_EQ(c.worldSize, 8u);
  EXPECT_EQ(c.rank, 3u);
  EXPECT_EQ(c.dpSize, 2u);
  EXPECT_NO_THROW(c.validate());
}

TEST(StandardConfig, Prefill) {
  Config c = standardConfig("prefill", 2);
  EXPECT_EQ(c.numExperts, 256u);
  EXPECT_EQ(c.expertsPerToken, 8u);
  EXPECT_EQ(c.hiddenDim, 7168u);
  EXPECT_EQ(c.hiddenDimBytes, 7168u);
  EXPECT_EQ(c.hiddenDimScaleBytes, 224u);
  EXPECT_EQ(c.maxNumTokens, 4096u);
  EXPECT_EQ(c.rank, 0u);
  EXPECT_EQ(c.dpSize, 1u);
  EXPECT_NO_THROW(c.validate());
}

TEST(StandardConfig, Small) {
  Config c = standardConfig("small", 4);
  EXPECT_EQ(c.numExperts, 64u);
  EXPECT_EQ(c.expertsPerToken, 6u);
  EXPECT_EQ(c.hiddenDim, 2048u);
  EXPECT_EQ(c.hiddenDimBytes, 4096u);  // bf16
  EXPECT_EQ(c.hiddenDimScaleBytes, 0u);
  EXPECT_EQ(c.maxNumTokens, 128u);
  EXPECT_NO_THROW(c.validate());
}

TEST(StandardConfig, Qwen3) {
  Config c = standardConfig("qwen3", 8);
  EXPECT_EQ(c.numExperts, 128u);
  EXPECT_EQ(c.expertsPerToken, 8u);
  EXPECT_EQ(c.hiddenDim, 2048u);
  EXPECT_EQ(c.hiddenDimBytes, 4096u);
  EXPECT_EQ(c.hiddenDimScaleBytes, 0u);
  EXPECT_EQ(c.maxNumTokens, 128u);
  EXPECT_NO_THROW(c.validate());
}

TEST(StandardConfig, UnknownName) {
  expectError([] { standardConfig("mixtral", 8); }, ErrorCode::kInvalidArgument, {"mixtral", "decode"});
}

TEST(StandardConfig, ToString) {
  EXPECT_EQ(standardConfig("decode", 8).toString(),
            "E=256 K=8 H=7168 bytes=7168 scale=224 T=128 W=8 D=1 pad=1 batched rank=0");
}

}  // namespace
}  // namespace epcomm
