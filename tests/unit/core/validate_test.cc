// checkDispatchArgs / checkCombineArgs: every failure path with its message, and what a good call reports.
#include "core/validate.hpp"

#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "expect_error.hpp"
#include "reference/reference.hpp"

namespace epcomm {
namespace {

using reference::HostTensor;
using testing::expectError;

// E=8 K=2 W=2 D=1 H=16, 32 payload bytes (bf16), 2 fp32 scales, T=4: L=4, R=8, P=16.
Config smallConfig(Layout layout = Layout::kBatched) {
  Config c;
  c.maxNumTokens = 4;
  c.numExperts = 8;
  c.expertsPerToken = 2;
  c.worldSize = 2;
  c.dpSize = 1;
  c.hiddenDim = 16;
  c.hiddenDimBytes = 32;
  c.hiddenDimScaleBytes = 8;
  c.layout = layout;
  return c;
}

class ValidateTest : public ::testing::Test {
 protected:
  void SetUp() override { build(Layout::kBatched); }

  void build(Layout layout) {
    config_ = smallConfig(layout);
    const bool batched = layout == Layout::kBatched;
    x_ = HostTensor(DType::kBf16, {3, 16});
    xScale_ = HostTensor(DType::kF32, {3, 2});
    indices_ = HostTensor(DType::kI32, {3, 2});
    counts_ = HostTensor(DType::kI32, {4});
    outX_ = batched ? HostTensor(DType::kBf16, {4, 8, 16}) : HostTensor(DType::kBf16, {16, 16});
    outScale_ = batched ? HostTensor(DType::kF32, {4, 8, 2}) : HostTensor(DType::kF32, {16, 2});
    expertY_ = batched ? HostTensor(DType::kBf16, {4, 8, 16}) : HostTensor(DType::kBf16, {16, 16});
    outTokens_ = HostTensor(DType::kF32, {3, 16});
    weights_ = HostTensor(DType::kF32, {3, 2});
    big_ = HostTensor(DType::kU8, {4096});
    d_ = DispatchArgs{};
    d_.outExpertNumTokens = counts_.view();
    d_.outExpertX = outX_.view();
    d_.outExpertXScale = outScale_.view();
    d_.x = x_.view();
    d_.xScale = xScale_.view();
    d_.indices = indices_.view();
    c_ = CombineArgs{};
    c_.outTokens = outTokens_.view();
    c_.indices = indices_.view();
    c_.weights = weights_.view();
    c_.expertY = expertY_.view();
  }

  void expectDispatchError(const std::function<void(DispatchArgs&)>& breakIt,
                           std::initializer_list<std::string> parts) {
    DispatchArgs a = d_;
    breakIt(a);
    expectError([&] { checkDispatchArgs(config_, a, MemoryKind::kHost, -1); }, ErrorCode::kInvalidArgument, parts);
  }
  void expectCombineError(const std::function<void(CombineArgs&)>& breakIt, std::initializer_list<std::string> parts) {
    CombineArgs a = c_;
    breakIt(a);
    expectError([&] { checkCombineArgs(config_, a, MemoryKind::kHost, -1); }, ErrorCode::kInvalidArgument, parts);
  }
  // A view into the middle of a large buffer, for strided and misaligned views.
  void* bigData(size_t offset = 0) { return big_.data<uint8_t>() + offset; }

  Config config_;
  HostTensor x_, xScale_, indices_, counts_, outX_, outScale_, expertY_, outTokens_, weights_, big_;
  DispatchArgs d_;
  CombineArgs c_;
};

TEST_F(ValidateTest, GoodDispatchBatched) {
  const CheckedDispatch c = checkDispatchArgs(config_, d_, MemoryKind::kHost, -1);
  EXPECT_EQ(c.m, 3u);
  EXPECT_EQ(c.indexKind, 0);
  EXPECT_EQ(c.indexStrides[0], 2);
  EXPECT_EQ(c.indexStrides[1], 1);
  EXPECT_EQ(c.xRowStrideBytes, 32);
  EXPECT_EQ(c.scaleStrides[0], 2);
  EXPECT_EQ(c.scaleStrides[1], 1);
  EXPECT_EQ(c.outRowStrideBytes, 32);
  EXPECT_EQ(c.outExpertStrideBytes, 8 * 32);
  EXPECT_EQ(c.outScaleStrides[0], 16);
  EXPECT_EQ(c.outScaleStrides[1], 2);
  EXPECT_EQ(c.outScaleStrides[2], 1);
}

TEST_F(ValidateTest, GoodDispatchPacked) {
  build(Layout::kPacked);
  const CheckedDispatch c = checkDispatchArgs(config_, d_, MemoryKind::kHost, -1);
  EXPECT_EQ(c.outRowStrideBytes, 32);
  EXPECT_EQ(c.outExpertStrideBytes, 0);
  EXPECT_EQ(c.outScaleStrides[0], 2);
  EXPECT_EQ(c.outScaleStrides[1], 1);
}

TEST_F(ValidateTest, GoodDispatchStridedIndicesAndScales) {
  d_.indices = TensorView::strided(indices_.data<void>(), DType::kI64, {3, 2}, {1, 3});
  d_.xScale = TensorView::strided(bigData(), DType::kF32, {3, 2}, {5, 7});
  d_.outExpertXScale = TensorView::strided(bigData(), DType::kF32, {4, 8, 2}, {3, 50, 1});
  const CheckedDispatch c = checkDispatchArgs(config_, d_, MemoryKind::kHost, -1);
  EXPECT_EQ(c.indexKind, 2);
  EXPECT_EQ(c.indexStrides[0], 1);
  EXPECT_EQ(c.indexStrides[1], 3);
  EXPECT_EQ(c.scaleStrides[0], 5);
  EXPECT_EQ(c.scaleStrides[1], 7);
  EXPECT_EQ(c.outScaleStrides[0], 3);
  EXPECT_EQ(c.outScaleStrides[1], 50);
}

TEST_F(ValidateTest, SendOnlyNeedsNoOutputs) {
  d_.doRecv = false;
  d_.outExpertNumTokens = TensorView{};
  d_.outExpertX = TensorView{};
  d_.outExpertXScale = TensorView{};
  EXPECT_NO_THROW(checkDispatchArgs(config_, d_, MemoryKind::kHost, -1));
}

TEST_F(ValidateTest, RecvOnlyNeedsNoInputs) {
  d_.doSend = false;
  d_.x = TensorView{};
  d_.xScale = TensorView{};
  d_.indices = TensorView{};
  EXPECT_NO_THROW(checkDispatchArgs(config_, d_, MemoryKind::kHost, -1));
}

TEST_F(ValidateTest, DispatchNeitherSendNorRecv) {
  expectDispatchError([](DispatchArgs& a) { a.doSend = a.doRecv = false; }, {"doSend = doRecv = false"});
}

TEST_F(ValidateTest, XNullData) {
  expectDispatchError([](DispatchArgs& a) { a.x.data = nullptr; }, {"x has a null data pointer"});
}

// m = 0: a rank with no tokens this step still takes part in the round. Frameworks describe 0-row tensors freely:
// numpy's np.zeros((0, H)) can arrive with strides (0, 0), torch's empty CUDA tensors with a null data pointer.
TEST_F(ValidateTest, EmptyBatchWithAnyStridesOrNullData) {
  for (bool nullData : {false, true}) {
    for (int64_t stride : {int64_t{0}, int64_t{3}, int64_t{16}}) {
      DispatchArgs d = d_;
      CombineArgs c = c_;
      void* data = nullData ? nullptr : bigData(1);  // misaligned too: no element is ever read through it
      d.x = TensorView::strided(data, DType::kBf16, {0, 16}, {stride, stride});
      d.xScale = TensorView::strided(data, DType::kF32, {0, 2}, {stride, stride});
      d.indices = TensorView::strided(data, DType::kI64, {0, 2}, {stride, stride});
      c.outTokens = TensorView::strided(data, DType::kF32, {0, 16}, {stride, stride});
      c.indices = d.indices;
      c.weights = TensorView::strided(data, DType::kF32, {0, 2}, {stride, stride});
      const CheckedDispatch cd = checkDispatchArgs(config_, d, MemoryKind::kHost, -1);
      EXPECT_EQ(cd.m, 0u);
      const CheckedCombine cc = checkCombineArgs(config_, c, MemoryKind::kHost, -1);
      EXPECT_EQ(cc.m, 0u);
    }
  }
}

TEST_F(ValidateTest, EmptyBatchStillChecksShapesDtypesAndMemory) {
  auto empty = [](DType dtype, int64_t cols) { return TensorView::strided(nullptr, dtype, {0, cols}, {0, 0}); };
  expectDispatchError([&](DispatchArgs& a) { a.x = empty(DType::kBf16, 8); }, {"x rows are 16 bytes"});
  expectDispatchError(
      [&](DispatchArgs& a) {
        a.x = empty(DType::kBf16, 16);
        a.indices = empty(DType::kI32, 3);
      },
      {"indices dimension 1 must be 2"});
  expectDispatchError(
      [&](DispatchArgs& a) {
        a.x = empty(DType::kBf16, 16);
        a.x.memory = MemoryKind::kCuda;
        a.x.device = 0;
      },
      {"x lives in cuda:0 memory"});
  expectCombineError(
      [&](CombineArgs& a) {
        a.outTokens = empty(DType::kF32, 16);
        a.indices = empty(DType::kI32, 2);
        a.weights = empty(DType::kBf16, 2);
      },
      {"weights must be fp32"});
  // A 0-row tensor is given; a tensor with rows still needs its data.
  expectDispatchError([](DispatchArgs& a) { a.indices.data = nullptr; }, {"indices has a null data pointer"});
}

TEST_F(ValidateTest, XWrongMemoryKind) {
  expectDispatchError(
      [](DispatchArgs& a) {
        a.x.memory = MemoryKind::kCuda;
        a.x.device = 0;
      },
      {"x lives in cuda:0 memory", "needs host"});
}

TEST_F(ValidateTest, XOnWrongDevice) {
  DispatchArgs a = d_;
  for (TensorView* t : {&a.x, &a.xScale, &a.indices}) {
    t->memory = MemoryKind::kCuda;
    t->device = 1;
  }
  a.doRecv = false;
  expectError([&] { checkDispatchArgs(config_, a, MemoryKind::kCuda, 0); }, ErrorCode::kInvalidArgument,
              {"x lives in cuda:1 memory", "needs cuda:0"});
}

TEST_F(ValidateTest, XWrongRank) {
  expectDispatchError([&](DispatchArgs& a) { a.x = TensorView::contiguous(x_.data<void>(), DType::kBf16, {48}); },
                      {"x must have 2 dimensions"});
}

TEST_F(ValidateTest, XInvalidDtype) {
  expectDispatchError([](DispatchArgs& a) { a.x.dtype = DType::kInvalid; }, {"x has an invalid dtype"});
}

TEST_F(ValidateTest, XTooManyTokens) {
  HostTensor x5(DType::kBf16, {5, 16});
  expectDispatchError([&](DispatchArgs& a) { a.x = x5.view(); }, {"x has 5 tokens", "maxNumTokens = 4"});
}

TEST_F(ValidateTest, XRowBytesMismatch) {
  expectDispatchError([](DispatchArgs& a) { a.x.dtype = DType::kF32; }, {"x rows are 64 bytes", "hiddenDimBytes = 32"});
}

TEST_F(ValidateTest, XNotContiguousInside) {
  expectDispatchError(
      [&](DispatchArgs& a) {
        a.x = TensorView::strided(bigData(), DType::kBf16, {3, 16}, {64, 2});
      },
      {"x must be contiguous in its last dimension"});
}

TEST_F(ValidateTest, XMisalignedPointer) {
  expectDispatchError([&](DispatchArgs& a) { a.x.data = bigData(8); }, {"x data pointer", "not 16-byte aligned"});
}

TEST_F(ValidateTest, XRowStrideNotMultipleOf16) {
  expectDispatchError(
      [&](DispatchArgs& a) {
        a.x = TensorView::strided(bigData(), DType::kBf16, {3, 16}, {20, 1});
      },
      {"x stride 0 (40 bytes)", "multiple of 16"});
}

TEST_F(ValidateTest, IndicesNegativeStride) {
  expectDispatchError([](DispatchArgs& a) { a.indices.strides[0] = -2; }, {"indices has a negative stride"});
}

TEST_F(ValidateTest, IndicesWrongMemory) {
  expectDispatchError(
      [](DispatchArgs& a) {
        a.indices.memory = MemoryKind::kCuda;
        a.indices.device = 0;
      },
      {"indices lives in cuda:0 memory"});
}

TEST_F(ValidateTest, IndicesWrongRank) {
  expectDispatchError([](DispatchArgs& a) { a.indices.ndim = 1; }, {"indices must have 2 dimensions"});
}

TEST_F(ValidateTest, IndicesWrongTokens) {
  expectDispatchError([](DispatchArgs& a) { a.indices.shape[0] = 2; }, {"indices dimension 0 must be 3", "tokens m"});
}

TEST_F(ValidateTest, IndicesWrongK) {
  expectDispatchError([](DispatchArgs& a) { a.indices.shape[1] = 3; },
                      {"indices dimension 1 must be 2", "experts per token K"});
}

TEST_F(ValidateTest, IndicesWrongDtype) {
  expectDispatchError([](DispatchArgs& a) { a.indices.dtype = DType::kF32; },
                      {"indices must be int32, uint32 or int64, got fp32"});
}

TEST_F(ValidateTest, XScaleMissing) {
  expectDispatchError([](DispatchArgs& a) { a.xScale = TensorView{}; },
                      {"xScale is required", "hiddenDimScaleBytes = 8"});
}

TEST_F(ValidateTest, XScaleUnexpected) {
  config_.hiddenDimScaleBytes = 0;
  expectDispatchError([](DispatchArgs& a) { a.outExpertXScale = TensorView{}; },
                      {"xScale given but hiddenDimScaleBytes = 0"});
}

TEST_F(ValidateTest, XScaleWrongMemory) {
  expectDispatchError(
      [](DispatchArgs& a) {
        a.xScale.memory = MemoryKind::kCuda;
        a.xScale.device = 0;
      },
      {"xScale lives in cuda:0 memory"});
}

TEST_F(ValidateTest, XScaleWrongRank) {
  expectDispatchError([](DispatchArgs& a) { a.xScale.ndim = 3; }, {"xScale must have 2 dimensions"});
}

TEST_F(ValidateTest, XScaleWrongDtype) {
  expectDispatchError([](DispatchArgs& a) { a.xScale.dtype = DType::kBf16; }, {"xScale must have a 4-byte dtype"});
}

TEST_F(ValidateTest, XScaleWrongTokens) {
  expectDispatchError([](DispatchArgs& a) { a.xScale.shape[0] = 4; }, {"xScale dimension 0 must be 3"});
}

TEST_F(ValidateTest, XScaleWrongColumns) {
  expectDispatchError([](DispatchArgs& a) { a.xScale.shape[1] = 3; },
                      {"xScale dimension 1 must be 2", "hiddenDimScaleBytes / 4"});
}

TEST_F(ValidateTest, XScaleNegativeStride) {
  expectDispatchError([](DispatchArgs& a) { a.xScale.strides[1] = -1; }, {"xScale has a negative stride"});
}

TEST_F(ValidateTest, CountsWrongMemory) {
  expectDispatchError(
      [](DispatchArgs& a) {
        a.outExpertNumTokens.memory = MemoryKind::kCuda;
        a.outExpertNumTokens.device = 0;
      },
      {"outExpertNumTokens lives in cuda:0 memory"});
}

TEST_F(ValidateTest, CountsWrongRank) {
  expectDispatchError([](DispatchArgs& a) { a.outExpertNumTokens.ndim = 2; },
                      {"outExpertNumTokens must have 1 dimensions"});
}

TEST_F(ValidateTest, CountsWrongLength) {
  expectDispatchError([](DispatchArgs& a) { a.outExpertNumTokens.shape[0] = 8; },
                      {"outExpertNumTokens dimension 0 must be 4", "local experts"});
}

TEST_F(ValidateTest, CountsWrongDtype) {
  expectDispatchError([](DispatchArgs& a) { a.outExpertNumTokens.dtype = DType::kU32; },
                      {"outExpertNumTokens must be int32, got uint32"});
}

TEST_F(ValidateTest, CountsNotContiguous) {
  expectDispatchError([](DispatchArgs& a) { a.outExpertNumTokens.strides[0] = 2; },
                      {"outExpertNumTokens must be contiguous"});
}

TEST_F(ValidateTest, OutXWrongMemory) {
  expectDispatchError(
      [](DispatchArgs& a) {
        a.outExpertX.memory = MemoryKind::kCuda;
        a.outExpertX.device = 0;
      },
      {"outExpertX lives in cuda:0 memory"});
}

// A dtype epcomm does not know (float64 from a framework) is named as unsupported, not as a size mismatch.
TEST_F(ValidateTest, OutXInvalidDtype) {
  expectDispatchError([](DispatchArgs& a) { a.outExpertX.dtype = DType::kInvalid; },
                      {"outExpertX has an unsupported dtype (invalid)"});
}

TEST_F(ValidateTest, OutXBatchedWrongRank) {
  expectDispatchError([](DispatchArgs& a) { a.outExpertX.ndim = 2; }, {"outExpertX must have 3 dimensions"});
}

TEST_F(ValidateTest, OutXBatchedWrongExperts) {
  expectDispatchError([](DispatchArgs& a) { a.outExpertX.shape[0] = 3; },
                      {"outExpertX dimension 0 must be 4", "local experts L = E / W"});
}

TEST_F(ValidateTest, OutXBatchedWrongRows) {
  expectDispatchError([](DispatchArgs& a) { a.outExpertX.shape[1] = 4; },
                      {"outExpertX dimension 1 must be 8", "rows per expert"});
}

TEST_F(ValidateTest, OutXBatchedWrongColumns) {
  expectDispatchError([](DispatchArgs& a) { a.outExpertX.dtype = DType::kU8; },
                      {"outExpertX dimension 2 must be 32", "hiddenDimBytes / itemsize"});
}

TEST_F(ValidateTest, OutXPackedWrongRows) {
  build(Layout::kPacked);
  expectDispatchError([](DispatchArgs& a) { a.outExpertX.shape[0] = 15; },
                      {"outExpertX dimension 0 must be 16", "packed rows"});
}

TEST_F(ValidateTest, OutXPackedGivenBatchedShape) {
  build(Layout::kPacked);
  HostTensor batched(DType::kBf16, {4, 8, 16});
  expectDispatchError([&](DispatchArgs& a) { a.outExpertX = batched.view(); }, {"outExpertX must have 2 dimensions"});
}

TEST_F(ValidateTest, OutXNegativeStride) {
  expectDispatchError([](DispatchArgs& a) { a.outExpertX.strides[0] = -128; }, {"outExpertX has a negative stride"});
}

TEST_F(ValidateTest, OutXNotContiguousInside) {
  expectDispatchError([](DispatchArgs& a) { a.outExpertX.strides[2] = 2; },
                      {"outExpertX must be contiguous in its last dimension"});
}

TEST_F(ValidateTest, OutXMisaligned) {
  expectDispatchError([](DispatchArgs& a) { a.outExpertX.data = static_cast<char*>(a.outExpertX.data) + 4; },
                      {"outExpertX data pointer", "not 16-byte aligned"});
}

TEST_F(ValidateTest, OutXRowStrideNotMultipleOf16) {
  expectDispatchError([](DispatchArgs& a) { a.outExpertX.strides[1] = 20; },
                      {"outExpertX stride 1 (40 bytes)", "multiple of 16"});
}

TEST_F(ValidateTest, OutScaleMissing) {
  expectDispatchError([](DispatchArgs& a) { a.outExpertXScale = TensorView{}; },
                      {"outExpertXScale is required", "hiddenDimScaleBytes = 8"});
}

TEST_F(ValidateTest, OutScaleUnexpected) {
  config_.hiddenDimScaleBytes = 0;
  expectDispatchError([](DispatchArgs& a) { a.xScale = TensorView{}; },
                      {"outExpertXScale given but hiddenDimScaleBytes = 0"});
}

TEST_F(ValidateTest, OutScaleWrongMemory) {
  expectDispatchError(
      [](DispatchArgs& a) {
        a.outExpertXScale.memory = MemoryKind::kCuda;
        a.outExpertXScale.device = 0;
      },
      {"outExpertXScale lives in cuda:0 memory"});
}

TEST_F(ValidateTest, OutScaleWrongDtype) {
  expectDispatchError([](DispatchArgs& a) { a.outExpertXScale.dtype = DType::kF16; },
                      {"outExpertXScale must have a 4-byte dtype"});
}

TEST_F(ValidateTest, OutScaleWrongShape) {
  expectDispatchError([](DispatchArgs& a) { a.outExpertXScale.shape[2] = 4; },
                      {"outExpertXScale dimension 2 must be 2", "hiddenDimScaleBytes / 4"});
}

TEST_F(ValidateTest, GoodCombine) {
  const CheckedCombine c = checkCombineArgs(config_, c_, MemoryKind::kHost, -1);
  EXPECT_EQ(c.m, 3u);
  EXPECT_EQ(c.indexKind, 0);
  EXPECT_EQ(c.weightStrides[0], 2);
  EXPECT_EQ(c.weightStrides[1], 1);
  EXPECT_EQ(c.outRowStride, 16);
  EXPECT_EQ(c.yRowStride, 16);
  EXPECT_EQ(c.yExpertStride, 8 * 16);
}

TEST_F(ValidateTest, GoodCombinePackedStridedWeights) {
  build(Layout::kPacked);
  c_.weights = TensorView::strided(bigData(), DType::kF32, {3, 2}, {1, 3});
  c_.indices = TensorView::strided(indices_.data<void>(), DType::kU32, {3, 2}, {1, 3});
  const CheckedCombine c = checkCombineArgs(config_, c_, MemoryKind::kHost, -1);
  EXPECT_EQ(c.indexKind, 1);
  EXPECT_EQ(c.weightStrides[0], 1);
  EXPECT_EQ(c.weightStrides[1], 3);
  EXPECT_EQ(c.yExpertStride, 0);
  EXPECT_EQ(c.yRowStride, 16);
}

TEST_F(ValidateTest, CombineNeitherSendNorRecv) {
  expectCombineError([](CombineArgs& a) { a.doSend = a.doRecv = false; }, {"doSend = doRecv = false"});
}

TEST_F(ValidateTest, CombineSendOnlyNeedsOnlyExpertY) {
  c_.doRecv = false;
  c_.outTokens = TensorView{};
  c_.weights = TensorView{};
  c_.indices = TensorView{};
  EXPECT_NO_THROW(checkCombineArgs(config_, c_, MemoryKind::kHost, -1));
}

TEST_F(ValidateTest, ExpertYWrongMemory) {
  expectCombineError(
      [](CombineArgs& a) {
        a.expertY.memory = MemoryKind::kCuda;
        a.expertY.device = 0;
      },
      {"expertY lives in cuda:0 memory"});
}

TEST_F(ValidateTest, ExpertYWrongDtype) {
  expectCombineError([](CombineArgs& a) { a.expertY.dtype = DType::kFp8E4M3; },
                     {"expertY must be bf16, fp16 or fp32, got fp8_e4m3"});
}

TEST_F(ValidateTest, ExpertYWrongShape) {
  expectCombineError([](CombineArgs& a) { a.expertY.shape[2] = 32; },
                     {"expertY dimension 2 must be 16", "hiddenDim H"});
}

TEST_F(ValidateTest, ExpertYNotContiguousInside) {
  expectCombineError([](CombineArgs& a) { a.expertY.strides[2] = 2; },
                     {"expertY must be contiguous in its last dimension"});
}

TEST_F(ValidateTest, ExpertYMisaligned) {
  expectCombineError([](CombineArgs& a) { a.expertY.data = static_cast<char*>(a.expertY.data) + 2; },
                     {"expertY data pointer", "not 16-byte aligned"});
}

TEST_F(ValidateTest, OutTokensWrongMemory) {
  expectCombineError(
      [](CombineArgs& a) {
        a.outTokens.memory = MemoryKind::kCuda;
        a.outTokens.device = 0;
      },
      {"outTokens lives in cuda:0 memory"});
}

TEST_F(ValidateTest, OutTokensWrongRank) {
  expectCombineError([](CombineArgs& a) { a.outTokens.ndim = 3; }, {"outTokens must have 2 dimensions"});
}

TEST_F(ValidateTest, OutTokensWrongDtype) {
  expectCombineError([](CombineArgs& a) { a.outTokens.dtype = DType::kI32; },
                     {"outTokens must be bf16, fp16 or fp32, got int32"});
}

TEST_F(ValidateTest, OutTokensTooManyTokens) {
  HostTensor out5(DType::kF32, {5, 16});
  expectCombineError([&](CombineArgs& a) { a.outTokens = out5.view(); },
                     {"outTokens has 5 tokens", "maxNumTokens = 4"});
}

TEST_F(ValidateTest, OutTokensWrongHidden) {
  expectCombineError([](CombineArgs& a) { a.outTokens.shape[1] = 8; }, {"outTokens dimension 1 must be 16"});
}

TEST_F(ValidateTest, OutTokensNotContiguousInside) {
  expectCombineError([](CombineArgs& a) { a.outTokens.strides[1] = 2; },
                     {"outTokens must be contiguous in its last dimension"});
}

TEST_F(ValidateTest, OutTokensMisaligned) {
  expectCombineError([](CombineArgs& a) { a.outTokens.data = static_cast<char*>(a.outTokens.data) + 4; },
                     {"outTokens data pointer", "not 16-byte aligned"});
}

TEST_F(ValidateTest, OutTokensRowStrideNotMultipleOf16) {
  expectCombineError([](CombineArgs& a) { a.outTokens.strides[0] = 17; },
                     {"outTokens stride 0 (68 bytes)", "multiple of 16"});
}

TEST_F(ValidateTest, CombineIndicesWrongTokens) {
  expectCombineError([](CombineArgs& a) { a.indices.shape[0] = 4; },
                     {"indices has 4 tokens but outTokens only 3 rows", "indices dimension 0 must be at most 3"});
}

// pplx-kernels' callers pass one outTokens buffer of maxNumTokens rows for every batch: the tokens are indices'
// rows, and weights follow indices.
TEST_F(ValidateTest, CombineOutTokensMayHaveMoreRowsThanIndices) {
  HostTensor out4(DType::kF32, {4, 16});
  c_.outTokens = out4.view();
  const CheckedCombine c = checkCombineArgs(config_, c_, MemoryKind::kHost, -1);
  EXPECT_EQ(c.m, 3u);
  EXPECT_EQ(c.outRowStride, 16);
  expectCombineError(
      [&](CombineArgs& a) {
        a.outTokens = out4.view();
        a.weights.shape[0] = 4;
      },
      {"weights dimension 0 must be 3"});
}

TEST_F(ValidateTest, CombineIndicesWrongMemory) {
  expectCombineError(
      [](CombineArgs& a) {
        a.indices.memory = MemoryKind::kCuda;
        a.indices.device = 0;
      },
      {"indices lives in cuda:0 memory"});
}

TEST_F(ValidateTest, WeightsWrongMemory) {
  expectCombineError(
      [](CombineArgs& a) {
        a.weights.memory = MemoryKind::kCuda;
        a.weights.device = 0;
      },
      {"weights lives in cuda:0 memory"});
}

TEST_F(ValidateTest, WeightsWrongRank) {
  expectCombineError([](CombineArgs& a) { a.weights.ndim = 1; }, {"weights must have 2 dimensions"});
}

TEST_F(ValidateTest, WeightsWrongDtype) {
  expectCombineError([](CombineArgs& a) { a.weights.dtype = DType::kBf16; }, {"weights must be fp32, got bf16"});
}

TEST_F(ValidateTest, WeightsWrongTokens) {
  expectCombineError([](CombineArgs& a) { a.weights.shape[0] = 2; }, {"weights dimension 0 must be 3"});
}

TEST_F(ValidateTest, WeightsWrongK) {
  expectCombineError([](CombineArgs& a) { a.weights.shape[1] = 1; }, {"weights dimension 1 must be 2"});
}

TEST_F(ValidateTest, WeightsNegativeStride) {
  expectCombineError([](CombineArgs& a) { a.weights.strides[0] = -2; }, {"weights has a negative stride"});
}

// A copy of `base` is the same call, and each change of `base`, alone, makes one that sameArgs tells apart from it
// (both ways round).
template <typename Args>
void expectEachChangeDiffers(const Args& base, const std::vector<std::function<void(Args&)>>& changes) {
  const Args copy = base;
  EXPECT_TRUE(sameArgs(base, copy));
  for (size_t i = 0; i < changes.size(); ++i) {
    Args a = base;
    changes[i](a);
    EXPECT_FALSE(sameArgs(base, a)) << "change " << i;
    EXPECT_FALSE(sameArgs(a, base)) << "change " << i;
  }
}

// sameArgs: a copy is the same call; any one field changed (a view's pointer, dtype, rank, shape, stride, memory or
// device, the bound, a flag, the stream) is not.
TEST_F(ValidateTest, SameDispatchArgsFieldByField) {
  const int32_t bound = 2;
  int streamTag = 0;
  const std::vector<std::function<void(DispatchArgs&)>> changes = {
      [&](DispatchArgs& a) { a.x.data = bigData(); },
      [](DispatchArgs& a) { a.x.dtype = DType::kF16; },
      [](DispatchArgs& a) { a.x.ndim = 3; },
      [](DispatchArgs& a) { a.x.shape[0] = 2; },
      [](DispatchArgs& a) { a.x.strides[0] = 32; },
      [](DispatchArgs& a) { a.x.memory = MemoryKind::kCuda; },
      [](DispatchArgs& a) { a.x.device = 1; },
      [](DispatchArgs& a) { a.xScale.strides[1] = 3; },
      [](DispatchArgs& a) { a.indices.shape[3] = 1; },
      [](DispatchArgs& a) { a.outExpertNumTokens.data = nullptr; },
      [](DispatchArgs& a) { a.outExpertX.strides[1] = 64; },
      [](DispatchArgs& a) { a.outExpertXScale.shape[2] = 1; },
      [&](DispatchArgs& a) { a.boundM = &bound; },
      [](DispatchArgs& a) { a.doSend = false; },
      [](DispatchArgs& a) { a.doRecv = false; },
      [&](DispatchArgs& a) { a.stream = &streamTag; },
  };
  expectEachChangeDiffers(d_, changes);
}

TEST_F(ValidateTest, SameCombineArgsFieldByField) {
  const int32_t bound = 2;
  int streamTag = 0;
  const std::vector<std::function<void(CombineArgs&)>> changes = {
      [&](CombineArgs& a) { a.outTokens.data = bigData(); },
      [](CombineArgs& a) { a.outTokens.dtype = DType::kBf16; },
      [](CombineArgs& a) { a.indices.strides[1] = 2; },
      [](CombineArgs& a) { a.weights.shape[0] = 2; },
      [](CombineArgs& a) { a.weights.device = 0; },
      [](CombineArgs& a) { a.expertY.ndim = 2; },
      [&](CombineArgs& a) { a.boundM = &bound; },
      [](CombineArgs& a) { a.doSend = false; },
      [](CombineArgs& a) { a.doRecv = false; },
      [](CombineArgs& a) { a.accumulate = true; },
      [&](CombineArgs& a) { a.stream = &streamTag; },
  };
  expectEachChangeDiffers(c_, changes);
}

TEST(IndexKind, Dtypes) {
  EXPECT_EQ(indexKindOf(DType::kI32), 0);
  EXPECT_EQ(indexKindOf(DType::kU32), 1);
  EXPECT_EQ(indexKindOf(DType::kI64), 2);
  expectError([] { indexKindOf(DType::kBf16); }, ErrorCode::kInvalidArgument, {"got bf16"});
}

}  // namespace
}  // namespace epcomm
