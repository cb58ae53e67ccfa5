// The memory planner on the decode configuration at W=8, checked against the numbers worked out by hand.
#include "epcomm/plan.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <string>

#include "epcomm/all_to_all.hpp"
#include "expect_error.hpp"

namespace epcomm {
namespace {

using testing::expectError;

const PlannedBuffer* find(const std::vector<PlannedBuffer>& plan, const std::string& owner, const std::string& name) {
  for (const PlannedBuffer& b : plan) {
    if (b.owner == owner && b.name == name) return &b;
  }
  return nullptr;
}

TEST(Plan, DecodeW8BatchedOutputs) {
  const Config c = standardConfig("decode", 8);
  const std::vector<PlannedBuffer> plan = planBuffers(c, "");
  // L = 256 / 8 = 32 local experts, R = 128 tokens * 8 groups = 1024 rows each.
  ASSERT_EQ(plan.size(), 5u);
  EXPECT_EQ(find(plan, "outputs", "outExpertNumTokens")->bytes, 32u * 4);
  EXPECT_EQ(find(plan, "outputs", "outExpertX")->bytes, 32ull * 1024 * 7168);
  EXPECT_EQ(find(plan, "outputs", "outExpertXScale")->bytes, 32ull * 1024 * 224);
  EXPECT_EQ(find(plan, "outputs", "expertY")->bytes, 32ull * 1024 * 7168 * 2);
  EXPECT_EQ(find(plan, "outputs", "outTokens")->bytes, 128ull * 7168 * 2);
  EXPECT_EQ(find(plan, "outputs", "outExpertX")->memory, "device");
  EXPECT_EQ(find(plan, "outputs", "outExpertX")->note, "payload [L=32, R=1024, 7168 bytes]");
}

TEST(Plan, DecodeW8PackedWithPadding) {
  Config c = standardConfig("decode", 8);
  c.layout = Layout::kPacked;
  c.expertPadding = 64;
  const std::vector<PlannedBuffer> plan = planBuffers(c, "");
  // P = 128 * 8 groups * min(K=8, L=32) + 32 experts * 63 padding rows = 10208.
  EXPECT_EQ(find(plan, "outputs", "outExpertX")->bytes, 10208ull * 7168);
  EXPECT_EQ(find(plan, "outputs", "outExpertXScale")->bytes, 10208ull * 224);
  EXPECT_EQ(find(plan, "outputs", "expertY")->bytes, 10208ull * 7168 * 2);
}

TEST(Plan, NoScaleBufferWithoutScales) {
  const std::vector<PlannedBuffer> plan = planBuffers(standardConfig("small", 8), "");
  EXPECT_EQ(find(plan, "outputs", "outExpertXScale"), nullptr);
  // small: L = 8, R = 128 * 8, bf16 payload of 2048 elements.
  EXPECT_EQ(find(plan, "outputs", "outExpertX")->bytes, 8ull * 1024 * 4096);
}

TEST(Plan, DataParallelGroupsShrinkTheRows) {
  const std::vector<PlannedBuffer> plan = planBuffers(standardConfig("decode", 8, 0, 2), "");
  EXPECT_EQ(find(plan, "outputs", "outExpertX")->bytes, 32ull * 512 * 7168);  // 4 groups
}

TEST(Plan, BackendRows) {
  const Config c = standardConfig("decode", 8);
  const std::vector<std::string> built = builtBackends();
  for (const char* backend : {"host", "nvlink", "nvshmem", "proxy"}) {
    const std::vector<PlannedBuffer> plan = planBuffers(c, backend);
    ASSERT_GT(plan.size(), 5u) << backend;
    EXPECT_EQ(plan[0].owner, "outputs");
    EXPECT_EQ(plan[5].owner, backend);
    // The proxy backend's planner is built everywhere (a machine without a GPU plans a cluster's buffers).
    const bool planned =
        std::string(backend) == "proxy" || std::find(built.begin(), built.end(), backend) != built.end();
    if (!planned) {
      EXPECT_EQ(plan.size(), 6u) << backend;
      EXPECT_EQ(plan[5].note, "not built in this build") << backend;
      EXPECT_EQ(plan[5].bytes, 0u);
    } else {
      uint64_t own = 0;
      for (size_t i = 5; i < plan.size(); ++i) own += plan[i].bytes;
      EXPECT_GT(own, 0u) << backend << " is built but plans no buffers of its own";
    }
  }
  EXPECT_EQ(planBuffers(c, "host")[1].memory, "host");
  EXPECT_EQ(planBuffers(c, "nvlink")[1].memory, "device");
}

TEST(Plan, Errors) {
  expectError([] { planBuffers(standardConfig("decode", 8), "infiniband"); }, ErrorCode::kInvalidArgument,
              {"unknown backend 'infiniband'"});
  expectError([] { planBuffers(standardConfig("decode", 3), ""); }, ErrorCode::kInvalidConfig,
              {"numExperts 256", "worldSize 3"});
}

TEST(Plan, FormatHasEveryRowAndTheTotal) {
  const Config c = standardConfig("decode", 8);
  const std::string text = formatPlan(c, "", planBuffers(c, ""));
  // 128 + 234881024 + 7340032 + 469762048 + 1835008 bytes
  EXPECT_NE(text.find("total per GPU (rank): 680.75 MiB (713818240 bytes)"), std::string::npos) << text;
  EXPECT_NE(text.find("224.00  234881024"), std::string::npos) << text;
  EXPECT_NE(text.find("outExpertXScale"), std::string::npos) << text;
  EXPECT_NE(text.find(c.toString()), std::string::npos) << text;
  // Aligned: in every row, the MiB and bytes columns end where their headers end.
  std::vector<std::string> lines;
  for (size_t pos = 0, next; pos < text.size(); pos = next + 1) {
    next = text.find('\n', pos);
    lines.push_back(text.substr(pos, next - pos));
  }
  ASSERT_GE(lines.size(), 9u);
  const std::string& header = lines[1];
  const size_t mibEnd = header.find("MiB") + 3, bytesEnd = header.find("bytes") + 5;
  int rows = 0;
  for (size_t i = 3; i < lines.size(); ++i) {
    if (lines[i].rfind("outputs", 0) != 0) continue;
    ++rows;
    EXPECT_TRUE(std::isdigit(static_cast<unsigned char>(lines[i][mibEnd - 1])) && lines[i][mibEnd] == ' ') << lines[i];
    EXPECT_TRUE(std::isdigit(static_cast<unsigned char>(lines[i][bytesEnd - 1])) && lines[i][bytesEnd] == ' ')
        << lines[i];
  }
  EXPECT_EQ(rows, 5);
}

}  // namespace
}  // namespace epcomm
