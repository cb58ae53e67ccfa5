// The CPU reference against hand-worked cases (every number below was worked out on paper from the semantics in
// include/epcomm/all_to_all.hpp) and property tests with random routing.
#include "reference/reference.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <ostream>
#include <vector>

#include "core/dtype_convert.hpp"
#include "core/layout.hpp"
#include "expect_error.hpp"

namespace epcomm {
namespace reference {
namespace {

using testing::expectError;

constexpr uint8_t kSentinel = 0xEE;

// Every rank's tensors for one dispatch + combine round, held in this process.
struct World {
  Config config;
  uint32_t m = 0;
  std::vector<HostTensor> x, xScale, indices, weights, counts, outX, outScale, expertY, outTokens;
  std::vector<int32_t> bound;  // per rank; -1 = boundM not given

  World(const Config& c, uint32_t tokens, DType xDtype = DType::kU8, DType yDtype = DType::kF32,
        DType outDtype = DType::kF32)
      : config(c), m(tokens) {
    const uint32_t W = c.worldSize;
    const int64_t L = c.numLocalExperts(), R = static_cast<int64_t>(c.batchedRowsPerExpert());
    const int64_t P = static_cast<int64_t>(c.packedRows()), S = c.hiddenDimScaleBytes / 4;
    const bool batched = c.layout == Layout::kBatched;
    auto expertShaped = [&](DType d, int64_t cols) {
      return batched ? HostTensor(d, {L, R, cols}) : HostTensor(d, {P, cols});
    };
    for (uint32_t r = 0; r < W; ++r) {
      x.push_back(HostTensor(xDtype, {m, c.hiddenDimBytes / dtypeSize(xDtype)}));
      xScale.push_back(HostTensor(DType::kF32, {m, S > 0 ? S : 1}));
      indices.push_back(HostTensor(DType::kI32, {m, c.expertsPerToken}));
      weights.push_back(HostTensor(DType::kF32, {m, c.expertsPerToken}));
      counts.push_back(HostTensor(DType::kI32, {L}));
      outX.push_back(expertShaped(DType::kU8, c.hiddenDimBytes));
      std::memset(outX.back().data<void>(), kSentinel, outX.back().bytes());
      outScale.push_back(expertShaped(DType::kF32, S > 0 ? S : 1));
      expertY.push_back(expertShaped(yDtype, c.hiddenDim));
      outTokens.push_back(HostTensor(outDtype, {m, c.hiddenDim}));
      bound.push_back(-1);
    }
  }

  void setIndices(uint32_t r, const std::vector<std::vector<int32_t>>& rows) {
    for (size_t t = 0; t < rows.size(); ++t) {
      for (size_t k = 0; k < rows[t].size(); ++k)
        indices[r].data<int32_t>()[t * config.expertsPerToken + k] = rows[t][k];
    }
  }
  void setWeights(uint32_t r, const std::vector<std::vector<float>>& rows) {
    for (size_t t = 0; t < rows.size(); ++t) {
      for (size_t k = 0; k < rows[t].size(); ++k) weights[r].data<float>()[t * config.expertsPerToken + k] = rows[t][k];
    }
  }
  // Payload bytes of (rank, token): all 0x10 * r + t + 1; scales 100 * r + t + 0.5 * j.
  void fillTokenPattern() {
    for (uint32_t r = 0; r < config.worldSize; ++r) {
      for (uint32_t t = 0; t < m; ++t) {
        std::memset(x[r].data<uint8_t>() + t * config.hiddenDimBytes, 0x10 * r + t + 1, config.hiddenDimBytes);
        for (uint32_t j = 0; j < config.hiddenDimScaleBytes / 4; ++j) {
          xScale[r].data<float>()[t * (config.hiddenDimScaleBytes / 4) + j] = 100.0f * r + t + 0.5f * j;
        }
      }
    }
  }
  bool hasScale() const { return config.hiddenDimScaleBytes > 0; }

  std::vector<DispatchArgs> dispatchArgs() {
    std::vector<DispatchArgs> args(config.worldSize);
    for (uint32_t r = 0; r < config.worldSize; ++r) {
      args[r].outExpertNumTokens = counts[r].view();
      args[r].outExpertX = outX[r].view();
      args[r].x = x[r].view();
      args[r].indices = indices[r].view();
      if (hasScale()) {
        args[r].outExpertXScale = outScale[r].view();
        args[r].xScale = xScale[r].view();
      }
      args[r].boundM = bound[r] >= 0 ? &bound[r] : nullptr;
    }
    return args;
  }
  std::vector<CombineArgs> combineArgs() {
    std::vector<CombineArgs> args(config.worldSize);
    for (uint32_t r = 0; r < config.worldSize; ++r) {
      args[r].outTokens = outTokens[r].view();
      args[r].indices = indices[r].view();
      args[r].weights = weights[r].view();
      args[r].expertY = expertY[r].view();
      args[r].boundM = bound[r] >= 0 ? &bound[r] : nullptr;
    }
    return args;
  }
  void dispatch() { reference::dispatch(config, dispatchArgs()); }
  void combine() { reference::combine(config, combineArgs()); }

  // Sets expertY[r][row][h] = f(r, row, h) for every row of the layout (row = le * R + i when batched).
  template <typename F>
  void fillExpertY(F f) {
    const uint64_t rows = config.layout == Layout::kBatched ? config.numLocalExperts() * config.batchedRowsPerExpert()
                                                            : config.packedRows();
    for (uint32_t r = 0; r < config.worldSize; ++r) {
      for (uint64_t row = 0; row < rows; ++row) {
        for (uint32_t h = 0; h < config.hiddenDim; ++h) {
          storeFromFloat(expertY[r].view().dtype, expertY[r].data<void>(), row * config.hiddenDim + h, f(r, row, h));
        }
      }
    }
  }
  const uint8_t* row(uint32_t r, uint64_t rowIndex) const {
    return outX[r].data<uint8_t>() + rowIndex * config.hiddenDimBytes;
  }
  float scale(uint32_t r, uint64_t rowIndex, uint32_t j) const {
    return outScale[r].data<float>()[rowIndex * (config.hiddenDimScaleBytes / 4) + j];
  }
  float out(uint32_t r, uint32_t t, uint32_t h) const {
    return loadAsFloat(outTokens[r].view().dtype, outTokens[r].data<void>(), t * config.hiddenDim + h);
  }
  int32_t count(uint32_t r, uint32_t le) const { return counts[r].data<int32_t>()[le]; }
};

// Whether every byte of a row equals `value`.
bool rowIs(const World& w, uint32_t r, uint64_t rowIndex, uint8_t value) {
  for (uint32_t b = 0; b < w.config.hiddenDimBytes; ++b) {
    if (w.row(r, rowIndex)[b] != value) return false;
  }
  return true;
}

Config makeConfig(uint32_t W, uint32_t D, uint32_t E, uint32_t K, uint32_t T, uint32_t H, uint32_t bytes,
                  uint32_t scaleBytes, Layout layout = Layout::kBatched, uint32_t padding = 1) {
  Config c;
  c.worldSize = W;
  c.dpSize = D;
  c.numExperts = E;
  c.expertsPerToken = K;
  c.maxNumTokens = T;
  c.hiddenDim = H;
  c.hiddenDimBytes = bytes;
  c.hiddenDimScaleBytes = scaleBytes;
  c.layout = layout;
  c.expertPadding = padding;
  return c;
}

// ---- Case A: W=2, D=1, E=4 (L=2), K=2, T=3, 16 payload bytes, one scale, H=8; batched, R = 6 ----
// rank 0: t0 -> {0, 3}, t1 -> {1, -}, t2 -> {3, 2};  rank 1: t0 -> {2, 0}, t1 -> {-, -}, t2 -> {1, 1} (duplicate)
World caseA(DType yDtype = DType::kF32, DType outDtype = DType::kF32, DType xDtype = DType::kU8) {
  World w(makeConfig(2, 1, 4, 2, 3, 8, 16, 4), 3, xDtype, yDtype, outDtype);
  w.setIndices(0, {{0, 3}, {1, -1}, {3, 2}});
  w.setIndices(1, {{2, 0}, {-1, -1}, {1, 1}});
  w.fillTokenPattern();
  return w;
}

TEST(ReferenceDispatch, CaseAOneRankPerGroup) {
  World w = caseA();
  w.dispatch();
  // rank 0 holds experts 0 (le 0) and 1 (le 1); rank 1 holds experts 2 and 3. Rows by (sender, token).
  EXPECT_EQ(w.count(0, 0), 2);  // (0,0), (1,0)
  EXPECT_EQ(w.count(0, 1), 2);  // (0,1), (1,2): the duplicate expert of (1,2) is delivered once
  EXPECT_EQ(w.count(1, 0), 2);  // (0,2), (1,0)
  EXPECT_EQ(w.count(1, 1), 2);  // (0,0), (0,2)
  const uint64_t R = 6;
  EXPECT_TRUE(rowIs(w, 0, 0, 0x01));
  EXPECT_TRUE(rowIs(w, 0, 1, 0x11));
  EXPECT_TRUE(rowIs(w, 0, R + 0, 0x02));
  EXPECT_TRUE(rowIs(w, 0, R + 1, 0x13));
  EXPECT_TRUE(rowIs(w, 1, 0, 0x03));
  EXPECT_TRUE(rowIs(w, 1, 1, 0x11));
  EXPECT_TRUE(rowIs(w, 1, R + 0, 0x01));
  EXPECT_TRUE(rowIs(w, 1, R + 1, 0x03));
  EXPECT_EQ(w.scale(0, 0, 0), 0.0f);
  EXPECT_EQ(w.scale(0, 1, 0), 100.0f);
  EXPECT_EQ(w.scale(0, R + 1, 0), 102.0f);
  EXPECT_EQ(w.scale(1, 0, 0), 2.0f);
  EXPECT_EQ(w.scale(1, R + 1, 0), 2.0f);
  // Rows past the counts are not written.
  for (uint32_t r = 0; r < 2; ++r) {
    for (uint64_t i = 2; i < R; ++i) {
      EXPECT_TRUE(rowIs(w, r, i, kSentinel)) << r << " " << i;
      EXPECT_TRUE(rowIs(w, r, R + i, kSentinel)) << r << " " << i;
    }
  }
}

TEST(ReferenceRouting, CaseASlots) {
  World w = caseA();
  const Routing routing = buildRouting(w.config, {w.indices[0].view(), w.indices[1].view()}, {3, 3});
  ASSERT_EQ(routing.rows.size(), 2u);
  ASSERT_EQ(routing.rows[1][1].size(), 2u);
  EXPECT_EQ(routing.rows[1][1][0].srcRank, 0u);
  EXPECT_EQ(routing.rows[1][1][0].token, 0u);
  EXPECT_EQ(routing.rows[1][1][1].srcRank, 0u);
  EXPECT_EQ(routing.rows[1][1][1].token, 2u);
  EXPECT_EQ(routing.expertRowBase[0][1], 6u);
  // rank 0 token 0: k=0 expert 0 -> (owner 0, row 0); k=1 expert 3 -> (owner 1, row 6)
  EXPECT_EQ(routing.slot[0][0].owner, 0);
  EXPECT_EQ(routing.slot[0][0].row, 0u);
  EXPECT_EQ(routing.slot[0][1].owner, 1);
  EXPECT_EQ(routing.slot[0][1].row, 6u);
  EXPECT_EQ(routing.slot[0][3].owner, -1);  // rank 0 token 1 k=1 is masked
  // rank 1 token 2: both positions name expert 1 and share its one row (owner 0, row 6 + 1).
  EXPECT_EQ(routing.slot[1][4].owner, 0);
  EXPECT_EQ(routing.slot[1][4].row, 7u);
  EXPECT_EQ(routing.slot[1][5].owner, 0);
  EXPECT_EQ(routing.slot[1][5].row, 7u);
}

TEST(ReferenceCombine, CaseAOneRankPerGroup) {
  World w = caseA();
  w.setWeights(0, {{0.5f, 0.25f}, {2.0f, 7.0f}, {1.0f, -1.0f}});
  w.setWeights(1, {{1.0f, 1.0f}, {3.0f, 3.0f}, {0.5f, 0.25f}});
  w.fillExpertY([](uint32_t r, uint64_t row, uint32_t h) { return 1000.0f * r + 10.0f * row + h; });
  w.combine();
  for (uint32_t h = 0; h < w.config.hiddenDim; ++h) {
    EXPECT_EQ(w.out(0, 0, h), 265.0f + 0.75f * h);  // 0.5 * y0[0] + 0.25 * y1[6]
    EXPECT_EQ(w.out(0, 1, h), 120.0f + 2.0f * h);   // 2 * y0[6]; the masked weight 7 is ignored
    EXPECT_EQ(w.out(0, 2, h), 70.0f);               // 1 * y1[7] - 1 * y1[0]
    EXPECT_EQ(w.out(1, 0, h), 1020.0f + 2.0f * h);  // y1[1] + y0[1]
    EXPECT_EQ(w.out(1, 1, h), 0.0f);                // every position masked
    EXPECT_EQ(w.out(1, 2, h), 52.5f + 0.75f * h);   // (0.5 + 0.25) * y0[7]: both weights of the duplicate
  }
}

TEST(ReferenceDispatch, EveryPayloadDtypeIsCopiedBitwise) {
  for (DType d : {DType::kFp8E4M3, DType::kFp8E5M2, DType::kBf16, DType::kF16, DType::kF32}) {
    World w = caseA(DType::kF32, DType::kF32, d);
    const int64_t cols = 16 / dtypeSize(d);
    for (uint32_t r = 0; r < 2; ++r) {
      for (int64_t i = 0; i < 3 * cols; ++i) {
        storeFromFloat(d, w.x[r].data<void>(), i, 0.125f * static_cast<float>((r * 37 + i * 5) % 29) - 1.5f);
      }
    }
    w.dispatch();
    const uint64_t R = 6;
    const uint8_t* x0 = w.x[0].data<uint8_t>();
    const uint8_t* x1 = w.x[1].data<uint8_t>();
    EXPECT_EQ(std::memcmp(w.row(0, 0), x0 + 0 * 16, 16), 0) << dtypeName(d);
    EXPECT_EQ(std::memcmp(w.row(0, 1), x1 + 0 * 16, 16), 0) << dtypeName(d);
    EXPECT_EQ(std::memcmp(w.row(0, R + 1), x1 + 2 * 16, 16), 0) << dtypeName(d);
    EXPECT_EQ(std::memcmp(w.row(1, R + 1), x0 + 2 * 16, 16), 0) << dtypeName(d);
    // The receiver may view the same bytes in the sender's dtype.
    EXPECT_EQ(loadAsFloat(d, w.row(0, 1), 1), loadAsFloat(d, x1, 1)) << dtypeName(d);
  }
}

TEST(ReferenceDispatch, PayloadDtypeMayDifferBetweenInputAndOutput) {
  World w = caseA(DType::kF32, DType::kF32, DType::kFp8E4M3);
  for (int64_t i = 0; i < 48; ++i) w.x[1].data<uint8_t>()[i] = floatToFp8E4M3(0.5f * (i % 9));
  std::vector<DispatchArgs> args = w.dispatchArgs();
  for (uint32_t r = 0; r < 2; ++r) {
    args[r].outExpertX = TensorView::contiguous(w.outX[r].data<void>(), DType::kBf16, {2, 6, 8});
  }
  reference::dispatch(w.config, args);
  EXPECT_EQ(std::memcmp(w.row(0, 1), w.x[1].data<uint8_t>(), 16), 0);
}

TEST(ReferenceCombine, EveryExpertAndOutputDtype) {
  for (DType y : {DType::kBf16, DType::kF16, DType::kF32}) {
    for (DType o : {DType::kBf16, DType::kF16, DType::kF32}) {
      World w = caseA(y, o);
      w.setWeights(0, {{0.5f, 0.25f}, {1.0f, 0.0f}, {0.25f, 0.5f}});
      w.setWeights(1, {{0.5f, 0.5f}, {1.0f, 1.0f}, {0.5f, 0.25f}});
      // Small multiples of 1/4, weights of 1/4 and 1/2: every product and sum is exact in all three dtypes.
      w.fillExpertY([](uint32_t r, uint64_t row, uint32_t h) { return 0.5f * (row % 8) + 0.25f * h - 1.0f * r; });
      w.combine();
      auto y0 = [](uint64_t row, uint32_t h) { return 0.5f * (row % 8) + 0.25f * h; };
      auto y1 = [](uint64_t row, uint32_t h) { return 0.5f * (row % 8) + 0.25f * h - 1.0f; };
      for (uint32_t h = 0; h < w.config.hiddenDim; ++h) {
        const std::string what = std::string(dtypeName(y)) + " -> " + dtypeName(o);
        EXPECT_EQ(w.out(0, 0, h), 0.5f * y0(0, h) + 0.25f * y1(6, h)) << what;
        EXPECT_EQ(w.out(0, 1, h), y0(6, h)) << what;
        EXPECT_EQ(w.out(0, 2, h), 0.25f * y1(7, h) + 0.5f * y1(0, h)) << what;
        EXPECT_EQ(w.out(1, 0, h), 0.5f * y1(1, h) + 0.5f * y0(1, h)) << what;
        EXPECT_EQ(w.out(1, 1, h), 0.0f) << what;
        EXPECT_EQ(w.out(1, 2, h), 0.75f * y0(7, h)) << what;
      }
    }
  }
}

TEST(ReferenceCombine, RoundsTheFp32SumToNearestEven) {
  // Token 1 of rank 0 has one expert (1, row 6 on rank 0) with weight 1: the output is y rounded once.
  struct Case {
    DType out;
    float y;
    float expected;
  };
  const float kB = 1.0f / 256, kH = 1.0f / 2048;
  for (const Case& c : {Case{DType::kBf16, 1.0f + kB, 1.0f}, Case{DType::kBf16, 1.0f + 3 * kB, 1.0f + 4 * kB},
                        Case{DType::kBf16, 1.0f + kB + kB / 64, 1.0f + 2 * kB}, Case{DType::kF16, 1.0f + kH, 1.0f},
                        Case{DType::kF16, 1.0f + 3 * kH, 1.0f + 4 * kH}}) {
    World w = caseA(DType::kF32, c.out);
    w.setWeights(0, {{0.0f, 0.0f}, {1.0f, 0.0f}, {0.0f, 0.0f}});
    w.fillExpertY([&](uint32_t, uint64_t, uint32_t) { return c.y; });
    w.combine();
    EXPECT_EQ(w.out(0, 1, 0), c.expected) << dtypeName(c.out) << " of " << c.y;
  }
}

TEST(ReferenceCombine, Accumulate) {
  World w = caseA(DType::kF32, DType::kBf16);
  w.setWeights(0, {{0.5f, 0.25f}, {1.0f, 0.0f}, {0.25f, 0.5f}});
  w.setWeights(1, {{0.5f, 0.5f}, {1.0f, 1.0f}, {0.5f, 0.25f}});
  w.fillExpertY([](uint32_t, uint64_t row, uint32_t h) { return static_cast<float>(row) + 0.5f * h; });
  for (uint32_t r = 0; r < 2; ++r) {
    for (size_t i = 0; i < w.outTokens[r].bytes() / 2; ++i) w.outTokens[r].data<uint16_t>()[i] = floatToBf16(2.0f);
  }
  std::vector<CombineArgs> args = w.combineArgs();
  for (CombineArgs& a : args) a.accumulate = true;
  reference::combine(w.config, args);
  for (uint32_t h = 0; h < w.config.hiddenDim; ++h) {
    EXPECT_EQ(w.out(0, 0, h), 2.0f + 0.5f * (0 + 0.5f * h) + 0.25f * (6 + 0.5f * h));
    EXPECT_EQ(w.out(0, 1, h), 2.0f + (6 + 0.5f * h));
    EXPECT_EQ(w.out(1, 1, h), 2.0f);  // every position masked: the old value stays
  }
}

// ---- Case B: W=4, D=2 (groups {0,1}, {2,3}), E=4 (L=1), K=2, T=4, no scales, H=4; batched, R = 8 ----
World caseB(Layout layout = Layout::kBatched, uint32_t padding = 1) {
  World w(makeConfig(4, 2, 4, 2, 4, 4, 16, 0, layout, padding), 4);
  for (uint32_t r : {0u, 1u}) w.setIndices(r, {{0, 1}, {1, 2}, {3, -1}, {0, 3}});
  for (uint32_t r : {2u, 3u}) w.setIndices(r, {{2, -1}, {0, 2}, {1, 0}, {-1, -1}});
  // Unlike real inputs, x differs between the ranks of a group: the rows show which rank sent each token.
  w.fillTokenPattern();
  for (uint32_t r = 0; r < 4; ++r) w.setWeights(r, {{1.0f, 0.5f}, {1.0f, 0.5f}, {1.0f, 0.5f}, {1.0f, 0.5f}});
  return w;
}

TEST(ReferenceDispatch, CaseBTwoRanksPerGroupSplitTheSending) {
  World w = caseB();
  w.dispatch();
  // Token t of group g is sent by rank 2g + t % 2. Rows by (sender, token).
  EXPECT_EQ(w.count(0, 0), 4);  // expert 0: (0,0) (1,3) (2,2) (3,1)
  EXPECT_EQ(w.count(1, 0), 3);  // expert 1: (0,0) (1,1) (2,2)
  EXPECT_EQ(w.count(2, 0), 3);  // expert 2: (1,1) (2,0) (3,1)
  EXPECT_EQ(w.count(3, 0), 2);  // expert 3: (0,2) (1,3)
  const uint8_t want[4][4] = {{0x01, 0x14, 0x23, 0x32},
                              {0x01, 0x12, 0x23, kSentinel},
                              {0x12, 0x21, 0x32, kSentinel},
                              {0x03, 0x14, kSentinel, kSentinel}};
  for (uint32_t r = 0; r < 4; ++r) {
    for (uint32_t i = 0; i < 4; ++i) EXPECT_TRUE(rowIs(w, r, i, want[r][i])) << "rank " << r << " row " << i;
  }
}

TEST(ReferenceCombine, CaseBEveryRankOfTheGroupGetsEveryToken) {
  World w = caseB();
  w.fillExpertY([](uint32_t r, uint64_t row, uint32_t h) { return 100.0f * r + 10.0f * row + h; });
  w.combine();
  for (uint32_t h = 0; h < w.config.hiddenDim; ++h) {
    for (uint32_t r : {0u, 1u}) {
      EXPECT_EQ(w.out(r, 0, h), 50.0f + 1.5f * h);   // y0[0] + 0.5 y1[0]
      EXPECT_EQ(w.out(r, 1, h), 210.0f + 1.5f * h);  // y1[1] + 0.5 y2[0]
      EXPECT_EQ(w.out(r, 2, h), 300.0f + h);         // y3[0]
      EXPECT_EQ(w.out(r, 3, h), 165.0f + 1.5f * h);  // y0[1] + 0.5 y3[1]
    }
    for (uint32_t r : {2u, 3u}) {
      EXPECT_EQ(w.out(r, 0, h), 210.0f + h);         // y2[1]
      EXPECT_EQ(w.out(r, 1, h), 140.0f + 1.5f * h);  // y0[3] + 0.5 y2[2]
      EXPECT_EQ(w.out(r, 2, h), 130.0f + 1.5f * h);  // y1[2] + 0.5 y0[2]
      EXPECT_EQ(w.out(r, 3, h), 0.0f);
    }
  }
}

TEST(ReferenceCombine, IndicesThatDifferWithinAGroupAreReported) {
  World w = caseB();
  w.setIndices(1, {{0, 2}});  // rank 0 sent token 0 to experts {0, 1}, not 2
  w.fillExpertY([](uint32_t, uint64_t, uint32_t) { return 1.0f; });
  expectError([&] { w.combine(); }, ErrorCode::kInvalidArgument,
              {"rank 1 token 0 expert 2", "never dispatched by rank 0"});
}

// ---- Case C: W=2, D=1, E=4 (L=2), K=2, T=3, padding 4 ----
// rank 0: t0 -> {0, 1}, t1 -> {0, -}, t2 -> {3, -};  rank 1: t0 -> {0, -}, t1 -> {1, 3}, t2 -> {-, -}
World caseC(Layout layout) {
  World w(makeConfig(2, 1, 4, 2, 3, 4, 16, 4, layout, 4), 3);
  w.setIndices(0, {{0, 1}, {0, -1}, {3, -1}});
  w.setIndices(1, {{0, -1}, {1, 3}, {-1, -1}});
  w.fillTokenPattern();
  w.setWeights(0, {{1.0f, 0.5f}, {1.0f, 0.5f}, {1.0f, 0.5f}});
  w.setWeights(1, {{1.0f, 0.5f}, {1.0f, 0.5f}, {1.0f, 0.5f}});
  return w;
}

TEST(ReferenceDispatch, PackedLayoutWithPadding) {
  World w = caseC(Layout::kPacked);
  ASSERT_EQ(w.config.packedRows(), 18u);  // 3 tokens * 2 groups * 2 + 2 experts * 3 padding rows
  w.dispatch();
  EXPECT_EQ(w.count(0, 0), 3);  // expert 0: (0,0) (0,1) (1,0) at rows 0..2
  EXPECT_EQ(w.count(0, 1), 2);  // expert 1: (0,0) (1,1) at rows 4..5 (3 rounded up to 4)
  EXPECT_EQ(w.count(1, 0), 0);  // expert 2: nothing, so expert 3 starts at row 0
  EXPECT_EQ(w.count(1, 1), 2);  // expert 3: (0,2) (1,1)
  EXPECT_TRUE(rowIs(w, 0, 0, 0x01));
  EXPECT_TRUE(rowIs(w, 0, 1, 0x02));
  EXPECT_TRUE(rowIs(w, 0, 2, 0x11));
  EXPECT_TRUE(rowIs(w, 0, 3, kSentinel));  // padding is not written
  EXPECT_TRUE(rowIs(w, 0, 4, 0x01));
  EXPECT_TRUE(rowIs(w, 0, 5, 0x12));
  EXPECT_TRUE(rowIs(w, 1, 0, 0x03));
  EXPECT_TRUE(rowIs(w, 1, 1, 0x12));
  EXPECT_TRUE(rowIs(w, 1, 2, kSentinel));
  EXPECT_EQ(w.scale(0, 5, 0), 101.0f);
  EXPECT_EQ(w.scale(1, 0, 0), 2.0f);
  const Routing routing = buildRouting(w.config, {w.indices[0].view(), w.indices[1].view()}, {3, 3});
  EXPECT_EQ(routing.expertRowBase[0][0], 0u);
  EXPECT_EQ(routing.expertRowBase[0][1], 4u);
  EXPECT_EQ(routing.expertRowBase[1][0], 0u);
  EXPECT_EQ(routing.expertRowBase[1][1], 0u);
}

TEST(ReferenceCombine, PackedLayoutWithPadding) {
  World w = caseC(Layout::kPacked);
  w.fillExpertY([](uint32_t r, uint64_t row, uint32_t h) { return 100.0f * r + 10.0f * row + h; });
  w.combine();
  for (uint32_t h = 0; h < w.config.hiddenDim; ++h) {
    EXPECT_EQ(w.out(0, 0, h), 20.0f + 1.5f * h);   // y0[0] + 0.5 y0[4]
    EXPECT_EQ(w.out(0, 1, h), 10.0f + h);          // y0[1]
    EXPECT_EQ(w.out(0, 2, h), 100.0f + h);         // y1[0]
    EXPECT_EQ(w.out(1, 0, h), 20.0f + h);          // y0[2]
    EXPECT_EQ(w.out(1, 1, h), 105.0f + 1.5f * h);  // y0[5] + 0.5 y1[1]
    EXPECT_EQ(w.out(1, 2, h), 0.0f);
  }
}

TEST(ReferenceDispatch, BatchedLayoutWithPadding) {
  World w = caseC(Layout::kBatched);
  ASSERT_EQ(w.config.batchedRowsPerExpert(), 8u);  // 3 * 2 rounded up to 4
  w.dispatch();
  EXPECT_EQ(w.count(0, 0), 3);
  EXPECT_EQ(w.count(0, 1), 2);
  EXPECT_TRUE(rowIs(w, 0, 2, 0x11));
  EXPECT_TRUE(rowIs(w, 0, 8, 0x01));
  EXPECT_TRUE(rowIs(w, 0, 9, 0x12));
  EXPECT_TRUE(rowIs(w, 1, 8, 0x03));
  EXPECT_TRUE(rowIs(w, 1, 9, 0x12));
  EXPECT_TRUE(rowIs(w, 1, 0, kSentinel));
  w.fillExpertY([](uint32_t r, uint64_t row, uint32_t h) { return 100.0f * r + 10.0f * row + h; });
  w.combine();
  EXPECT_EQ(w.out(1, 1, 0), 90.0f + 0.5f * 190.0f);  // y0[9] + 0.5 y1[9]
}

TEST(ReferenceDispatch, BoundMLimitsTheTokens) {
  World w = caseA();
  w.bound = {2, 3};  // rank 0's token 2 is not sent
  w.dispatch();
  EXPECT_EQ(w.count(0, 0), 2);
  EXPECT_EQ(w.count(0, 1), 2);
  EXPECT_EQ(w.count(1, 0), 1);  // expert 2: (1,0) only
  EXPECT_EQ(w.count(1, 1), 1);  // expert 3: (0,0) only
  EXPECT_TRUE(rowIs(w, 1, 0, 0x11));
  EXPECT_TRUE(rowIs(w, 1, 6, 0x01));
  EXPECT_TRUE(rowIs(w, 1, 1, kSentinel));

  World empty = caseA();
  empty.bound = {0, 0};
  empty.dispatch();
  for (uint32_t r = 0; r < 2; ++r) {
    for (uint32_t le = 0; le < 2; ++le) EXPECT_EQ(empty.count(r, le), 0);
  }
}

TEST(ReferenceCombine, BoundMLeavesLaterRowsUntouched) {
  World w = caseA();
  w.bound = {2, 3};
  w.setWeights(0, {{0.5f, 0.25f}, {2.0f, 7.0f}, {1.0f, -1.0f}});
  w.setWeights(1, {{1.0f, 1.0f}, {3.0f, 3.0f}, {0.5f, 0.25f}});
  w.fillExpertY([](uint32_t r, uint64_t row, uint32_t h) { return 1000.0f * r + 10.0f * row + h; });
  for (uint32_t h = 0; h < w.config.hiddenDim; ++h) w.outTokens[0].data<float>()[2 * 8 + h] = 9.0f;
  w.combine();
  for (uint32_t h = 0; h < w.config.hiddenDim; ++h) {
    EXPECT_EQ(w.out(0, 0, h), 265.0f + 0.75f * h);
    EXPECT_EQ(w.out(0, 2, h), 9.0f);
    EXPECT_EQ(w.out(1, 0, h), 1010.0f + 2.0f * h);  // expert 2's only row is now (1,0): y1[0] + y0[1]
  }
}

TEST(ReferenceDispatch, BoundMOutOfRange) {
  World w = caseA();
  w.bound = {4, 3};
  expectError([&] { w.dispatch(); }, ErrorCode::kInvalidArgument, {"rank 0", "boundM = 4"});
  w.bound = {3, -1};
  w.bound[1] = -5;
  std::vector<DispatchArgs> args = w.dispatchArgs();
  args[1].boundM = &w.bound[1];
  expectError([&] { reference::dispatch(w.config, args); }, ErrorCode::kInvalidArgument, {"rank 1", "boundM = -5"});
}

TEST(ReferenceDispatch, OutOfRangeIndexNamesRankTokenPositionAndValue) {
  World w = caseA();
  w.setIndices(1, {{2, 0}, {-1, -1}, {1, 4}});
  expectError([&] { w.dispatch(); }, ErrorCode::kInvalidArgument,
              {"rank 1 token 2 position k=1", "expert index 4", "[0, 4)"});
  w.setIndices(1, {{2, 0}, {-1, -2}, {1, 1}});
  expectError([&] { w.dispatch(); }, ErrorCode::kInvalidArgument, {"rank 1 token 1 position k=1", "index -2"});
  expectError([&] { w.combine(); }, ErrorCode::kInvalidArgument, {"rank 1 token 1 position k=1", "index -2"});
}

TEST(ReferenceDispatch, IndicesPastBoundMAreNotRead) {
  World w = caseA();
  w.setIndices(1, {{2, 0}, {-1, -1}, {1, 99}});
  w.bound = {3, 2};
  EXPECT_NO_THROW(w.dispatch());
}

TEST(ReferenceDispatch, UnsignedAndInt64Indices) {
  World w = caseA();
  w.dispatch();
  // The same routing as uint32 (0xFFFFFFFF = masked) and int64 (-1 = masked) gives the same rows.
  for (DType d : {DType::kU32, DType::kI64}) {
    World v = caseA();
    std::vector<HostTensor> idx;
    std::vector<DispatchArgs> args = v.dispatchArgs();
    for (uint32_t r = 0; r < 2; ++r) {
      idx.push_back(HostTensor(d, {3, 2}));
      for (int i = 0; i < 6; ++i) {
        const int32_t e = w.indices[r].data<int32_t>()[i];
        if (d == DType::kU32) idx.back().data<uint32_t>()[i] = e < 0 ? 0xFFFFFFFFu : static_cast<uint32_t>(e);
        if (d == DType::kI64) idx.back().data<int64_t>()[i] = e;
      }
      args[r].indices = idx.back().view();
    }
    reference::dispatch(v.config, args);
    for (uint32_t r = 0; r < 2; ++r) {
      EXPECT_EQ(std::memcmp(v.counts[r].data<void>(), w.counts[r].data<void>(), v.counts[r].bytes()), 0);
      EXPECT_EQ(std::memcmp(v.outX[r].data<void>(), w.outX[r].data<void>(), v.outX[r].bytes()), 0);
    }
    if (d == DType::kU32) {
      idx[1].data<uint32_t>()[3] = 0xFFFFFFFEu;
      expectError([&] { reference::dispatch(v.config, args); }, ErrorCode::kInvalidArgument,
                  {"rank 1 token 1 position k=1", "4294967294"});
    }
  }
}

TEST(ReferenceDispatch, StridedScalesAndIndices) {
  World w = caseA();
  w.config.hiddenDimScaleBytes = 8;  // two scales per token
  World dense(w.config, 3);
  dense.setIndices(0, {{0, 3}, {1, -1}, {3, 2}});
  dense.setIndices(1, {{2, 0}, {-1, -1}, {1, 1}});
  dense.fillTokenPattern();
  dense.dispatch();

  // The same inputs through column-major xScale / indices and an [S, R, L]-ordered outExpertXScale.
  World s(w.config, 3);
  s.fillTokenPattern();
  std::vector<HostTensor> xs, idx, os;
  std::vector<DispatchArgs> args = s.dispatchArgs();
  for (uint32_t r = 0; r < 2; ++r) {
    xs.push_back(HostTensor(DType::kF32, {2, 3}));
    idx.push_back(HostTensor(DType::kI32, {2, 3}));
    os.push_back(HostTensor(DType::kF32, {2, 6, 2}));
    for (int t = 0; t < 3; ++t) {
      for (int j = 0; j < 2; ++j) xs.back().data<float>()[j * 3 + t] = dense.xScale[r].data<float>()[t * 2 + j];
      for (int k = 0; k < 2; ++k) idx.back().data<int32_t>()[k * 3 + t] = dense.indices[r].data<int32_t>()[t * 2 + k];
    }
    args[r].xScale = TensorView::strided(xs.back().data<void>(), DType::kF32, {3, 2}, {1, 3});
    args[r].indices = TensorView::strided(idx.back().data<void>(), DType::kI32, {3, 2}, {1, 3});
    args[r].outExpertXScale = TensorView::strided(os.back().data<void>(), DType::kF32, {2, 6, 2}, {1, 2, 12});
  }
  reference::dispatch(s.config, args);
  for (uint32_t r = 0; r < 2; ++r) {
    EXPECT_EQ(std::memcmp(s.outX[r].data<void>(), dense.outX[r].data<void>(), s.outX[r].bytes()), 0);
    for (int le = 0; le < 2; ++le) {
      for (int i = 0; i < dense.count(r, le); ++i) {
        for (int j = 0; j < 2; ++j) {
          EXPECT_EQ(os[r].data<float>()[le + 2 * i + 12 * j], dense.scale(r, le * 6 + i, j))
              << r << " " << le << " " << i << " " << j;
        }
      }
    }
  }
  EXPECT_EQ(dense.scale(1, 6 + 1, 1), 2.5f);  // expert 3 row 1 = (0, 2): scale 100*0 + 2 + 0.5
}

TEST(ReferenceCombine, StridedWeights) {
  World w = caseA();
  w.fillExpertY([](uint32_t r, uint64_t row, uint32_t h) { return 1000.0f * r + 10.0f * row + h; });
  std::vector<HostTensor> ws;
  std::vector<CombineArgs> args = w.combineArgs();
  const float w0[3][2] = {{0.5f, 0.25f}, {2.0f, 7.0f}, {1.0f, -1.0f}};
  for (uint32_t r = 0; r < 2; ++r) {
    ws.push_back(HostTensor(DType::kF32, {2, 3}));
    for (int t = 0; t < 3; ++t) {
      for (int k = 0; k < 2; ++k) ws.back().data<float>()[k * 3 + t] = w0[t][k];
    }
    args[r].weights = TensorView::strided(ws.back().data<void>(), DType::kF32, {3, 2}, {1, 3});
  }
  reference::combine(w.config, args);
  EXPECT_EQ(w.out(0, 0, 1), 265.75f);
  EXPECT_EQ(w.out(0, 2, 3), 70.0f);
}

TEST(Reference, WrongNumberOfRanks) {
  World w = caseA();
  std::vector<DispatchArgs> args = w.dispatchArgs();
  args.pop_back();
  expectError([&] { reference::dispatch(w.config, args); }, ErrorCode::kInvalidArgument, {"1 ranks", "worldSize = 2"});
}

TEST(Reference, ValidatesTheConfig) {
  World w = caseA();
  Config bad = w.config;
  bad.numExperts = 5;
  expectError([&] { reference::dispatch(bad, w.dispatchArgs()); }, ErrorCode::kInvalidConfig, {"numExperts 5"});
}

// ---- Property tests: random routing, masks and duplicates; identity experts. ----

struct Params {
  uint32_t dp;
  Layout layout;
  uint32_t padding;
  uint64_t seed;
};

void PrintTo(const Params& p, std::ostream* os) {
  *os << "dp=" << p.dp << " " << layoutName(p.layout) << " pad=" << p.padding << " seed=" << p.seed;
}

class ReferenceProperty : public ::testing::TestWithParam<Params> {};

// W=4, E=16, K=4, T=16, fp32 payload of H=8 values (expertY can be the dispatched rows themselves).
struct RandomWorld {
  World w;
  std::vector<std::vector<int32_t>> groupIndices;
  explicit RandomWorld(const Params& p) : w(makeConfig(4, p.dp, 16, 4, 16, 8, 32, 8, p.layout, p.padding), 16) {
    const Config& c = w.config;
    uint64_t state = p.seed * 7919 + 1;
    auto next = [&state] {
      state ^= state << 13;
      state ^= state >> 7;
      state ^= state << 17;
      return state;
    };
    for (uint32_t g = 0; g < c.numDpGroups(); ++g) {
      std::vector<int32_t> idx = randomIndices(c, 16, p.seed * 100 + g);
      for (uint32_t t = 0; t < 16; ++t) {
        if (next() % 4 == 0) idx[t * 4 + 2] = idx[t * 4 + 0];  // a duplicate expert
        for (uint32_t k = 0; k < 4; ++k) {
          if (next() % 5 == 0) idx[t * 4 + k] = -1;
        }
      }
      if (g == 0) {
        for (uint32_t k = 0; k < 4; ++k) idx[3 * 4 + k] = -1;  // one fully masked token
      }
      const int32_t bound = static_cast<int32_t>(next() % 17);
      std::vector<float> x(16 * 8), scale(16 * 2), weight(16 * 4, 0.0f);
      // Values with few mantissa bits and dyadic weights summing to 1: every partial sum is exact.
      for (float& v : x) v = 0.125f * static_cast<float>(static_cast<int>(next() % 129) - 64);
      for (float& v : scale) v = static_cast<float>(next() % 1000);
      for (uint32_t t = 0; t < 16; ++t) {
        float left = 1.0f;
        int lastUnmasked = -1;
        for (uint32_t k = 0; k < 4; ++k) {
          if (idx[t * 4 + k] < 0) continue;
          weight[t * 4 + k] = left * 0.5f;
          left *= 0.5f;
          lastUnmasked = static_cast<int>(k);
        }
        if (lastUnmasked >= 0) weight[t * 4 + lastUnmasked] += left;
      }
      for (uint32_t r = g * c.dpSize; r < (g + 1) * c.dpSize; ++r) {
        std::memcpy(w.indices[r].data<void>(), idx.data(), idx.size() * 4);
        std::memcpy(w.x[r].data<void>(), x.data(), x.size() * 4);
        std::memcpy(w.xScale[r].data<void>(), scale.data(), scale.size() * 4);
        std::memcpy(w.weights[r].data<void>(), weight.data(), weight.size() * 4);
        std::memset(w.outTokens[r].data<void>(), 0x7F, w.outTokens[r].bytes());
        w.bound[r] = bound;
      }
      groupIndices.push_back(idx);
    }
  }
  // The dispatched rows, viewed as fp32 [.., H]: the identity expert.
  std::vector<CombineArgs> identityCombineArgs() {
    std::vector<CombineArgs> args = w.combineArgs();
    for (uint32_t r = 0; r < w.config.worldSize; ++r) {
      TensorView y = w.outX[r].view();
      y.dtype = DType::kF32;
      y.shape[y.ndim - 1] = w.config.hiddenDim;
      for (int d = 0; d + 1 < y.ndim; ++d) y.strides[d] /= 4;
      args[r].expertY = y;
    }
    return args;
  }
};

TEST_P(ReferenceProperty, CountsMatchDistinctUnmaskedPairs) {
  RandomWorld rw(GetParam());
  rw.w.dispatch();
  const Config& c = rw.w.config;
  uint64_t received = 0, expected = 0;
  for (uint32_t r = 0; r < c.worldSize; ++r) {
    for (uint32_t le = 0; le < c.numLocalExperts(); ++le) received += rw.w.count(r, le);
  }
  for (uint32_t g = 0; g < c.numDpGroups(); ++g) {
    const int32_t bound = rw.w.bound[g * c.dpSize];
    for (int32_t t = 0; t < bound; ++t) {
      for (uint32_t k = 0; k < 4; ++k) {
        const int32_t e = rw.groupIndices[g][t * 4 + k];
        bool repeat = false;
        for (uint32_t j = 0; j < k; ++j) repeat = repeat || rw.groupIndices[g][t * 4 + j] == e;
        if (e >= 0 && !repeat) ++expected;
      }
    }
  }
  EXPECT_EQ(received, expected);
}

TEST_P(ReferenceProperty, ScalesTravelWithTheirRows) {
  RandomWorld rw(GetParam());
  rw.w.dispatch();
  const Config& c = rw.w.config;
  std::vector<TensorView> idx;
  for (uint32_t r = 0; r < c.worldSize; ++r) idx.push_back(rw.w.indices[r].view());
  const Routing routing = buildRouting(c, idx, rw.w.bound);
  for (uint32_t r = 0; r < c.worldSize; ++r) {
    for (uint32_t le = 0; le < c.numLocalExperts(); ++le) {
      for (size_t i = 0; i < routing.rows[r][le].size(); ++i) {
        const RowSource src = routing.rows[r][le][i];
        const uint64_t row = routing.expertRowBase[r][le] + i;
        EXPECT_EQ(tokenSender(src.srcRank / c.dpSize, src.token, c.dpSize), src.srcRank);
        EXPECT_EQ(std::memcmp(rw.w.row(r, row), rw.w.x[src.srcRank].data<uint8_t>() + src.token * 32, 32), 0);
        for (uint32_t j = 0; j < 2; ++j) {
          EXPECT_EQ(rw.w.scale(r, row, j), rw.w.xScale[src.srcRank].data<float>()[src.token * 2 + j]);
        }
      }
    }
  }
}

TEST_P(ReferenceProperty, IdentityExpertsGiveBackTheInput) {
  RandomWorld rw(GetParam());
  rw.w.dispatch();
  reference::combine(rw.w.config, rw.identityCombineArgs());
  const Config& c = rw.w.config;
  for (uint32_t r = 0; r < c.worldSize; ++r) {
    const uint32_t g = r / c.dpSize;
    for (uint32_t t = 0; t < 16; ++t) {
      bool anyExpert = false;
      for (uint32_t k = 0; k < 4; ++k) anyExpert = anyExpert || rw.groupIndices[g][t * 4 + k] >= 0;
      for (uint32_t h = 0; h < 8; ++h) {
        const float got = rw.w.out(r, t, h);
        if (static_cast<int32_t>(t) >= rw.w.bound[r]) {
          EXPECT_EQ(floatBits(got), 0x7F7F7F7Fu) << "row past boundM written: rank " << r << " token " << t;
        } else {
          const float want = anyExpert ? rw.w.x[r].data<float>()[t * 8 + h] : 0.0f;
          EXPECT_EQ(got, want) << "rank " << r << " token " << t << " h " << h;
        }
      }
    }
  }
}

TEST_P(ReferenceProperty, Deterministic) {
  RandomWorld a(GetParam()), b(GetParam());
  a.w.dispatch();
  b.w.dispatch();
  a.w.fillExpertY([](uint32_t r, uint64_t row, uint32_t h) { return 0.1f * r + 0.01f * row + 0.3f * h; });
  b.w.fillExpertY([](uint32_t r, uint64_t row, uint32_t h) { return 0.1f * r + 0.01f * row + 0.3f * h; });
  a.w.combine();
  b.w.combine();
  for (uint32_t r = 0; r < a.w.config.worldSize; ++r) {
    EXPECT_EQ(std::memcmp(a.w.counts[r].data<void>(), b.w.counts[r].data<void>(), a.w.counts[r].bytes()), 0);
    EXPECT_EQ(std::memcmp(a.w.outX[r].data<void>(), b.w.outX[r].data<void>(), a.w.outX[r].bytes()), 0);
    EXPECT_EQ(std::memcmp(a.w.outScale[r].data<void>(), b.w.outScale[r].data<void>(), a.w.outScale[r].bytes()), 0);
    EXPECT_EQ(std::memcmp(a.w.outTokens[r].data<void>(), b.w.outTokens[r].data<void>(), a.w.outTokens[r].bytes()), 0);
  }
}

std::vector<Params> propertyParams() {
  std::vector<Params> out;
  for (uint32_t dp : {1u, 2u}) {
    for (Layout layout : {Layout::kBatched, Layout::kPacked}) {
      for (uint32_t padding : {1u, 4u}) {
        for (uint64_t seed : {1u, 2u, 3u}) out.push_back({dp, layout, padding, seed});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Random, ReferenceProperty, ::testing::ValuesIn(propertyParams()),
                         [](const ::testing::TestParamInfo<Params>& info) {
                           const Params& p = info.param;
                           return "dp" + std::to_string(p.dp) + "_" + layoutName(p.layout) + "_pad" +
                                  std::to_string(p.padding) + "_seed" + std::to_string(p.seed);
                         });

TEST(RandomIndices, UniformTopKWithoutRepeats) {
  Config c = makeConfig(4, 1, 16, 4, 64, 8, 32, 0);
  const std::vector<int32_t> a = randomIndices(c, 64, 5), b = randomIndices(c, 64, 5), other = randomIndices(c, 64, 6);
  ASSERT_EQ(a.size(), 64u * 4);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, other);
  std::vector<int> hits(16, 0);
  for (uint32_t t = 0; t < 64; ++t) {
    for (uint32_t k = 0; k < 4; ++k) {
      const int32_t e = a[t * 4 + k];
      ASSERT_GE(e, 0);
      ASSERT_LT(e, 16);
      ++hits[e];
      for (uint32_t j = 0; j < k; ++j) EXPECT_NE(a[t * 4 + j], e) << "token " << t;
    }
  }
  for (int h : hits) EXPECT_GT(h, 0);  // 256 draws over 16 experts: each appears
}

}  // namespace
}  // namespace reference
}  // namespace epcomm
