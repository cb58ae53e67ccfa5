#include "core/validate.hpp"

#include <string>
#include <vector>

#include "epcomm/error.hpp"

namespace epcomm {

namespace {

std::string where(MemoryKind memory, int device) {
  return memory == MemoryKind::kCuda ? "cuda:" + std::to_string(device) : std::string("host");
}

// A tensor with a zero dimension holds no element: frameworks give it any strides (numpy (0, 0)) and may give it
// no storage (torch's empty CUDA tensors have a null data pointer), and nothing ever reads through it.
bool hasNoElements(const TensorView& t) {
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 0) return true;
  }
  return false;
}

void checkMemory(const char* name, const TensorView& t, MemoryKind memory, int device) {
  EPCOMM_CHECK(t.data != nullptr || hasNoElements(t), kInvalidArgument, name << " has a null data pointer");
  EPCOMM_CHECK(
      t.memory == memory && (memory == MemoryKind::kHost || t.device == device), kInvalidArgument,
      name << " lives in " << where(t.memory, t.device) << " memory but this backend needs " << where(memory, device));
}

void checkDims(const char* name, const TensorView& t, int ndim) {
  EPCOMM_CHECK(t.ndim == ndim, kInvalidArgument, name << " must have " << ndim << " dimensions, got " << t.toString());
}

void checkDim(const char* name, const TensorView& t, int d, int64_t expected, const char* meaning) {
  EPCOMM_CHECK(t.shape[d] == expected, kInvalidArgument,
               name << " dimension " << d << " must be " << expected << " (" << meaning << "), got " << t.toString());
}

void checkInnerContiguous(const char* name, const TensorView& t) {
  if (hasNoElements(t)) return;
  EPCOMM_CHECK(t.strides[t.ndim - 1] == 1, kInvalidArgument,
               name << " must be contiguous in its last dimension, got " << t.toString());
}

void checkAligned(const char* name, const TensorView& t, int64_t alignBytes) {
  if (hasNoElements(t)) return;
  EPCOMM_CHECK(reinterpret_cast<uintptr_t>(t.data) % alignBytes == 0, kInvalidArgument,
               name << " data pointer " << t.data << " is not " << alignBytes << "-byte aligned");
  const int64_t item = dtypeSize(t.dtype);
  for (int d = 0; d + 1 < t.ndim; ++d) {
    EPCOMM_CHECK((t.strides[d] * item) % alignBytes == 0, kInvalidArgument,
                 name << " stride " << d << " (" << t.strides[d] * item << " bytes) is not a multiple of " << alignBytes
                      << " bytes: " << t.toString());
  }
}

void checkNonNegativeStrides(const char* name, const TensorView& t) {
  if (hasNoElements(t)) return;
  for (int d = 0; d < t.ndim; ++d) {
    EPCOMM_CHECK(t.strides[d] >= 0, kInvalidArgument, name << " has a negative stride: " << t.toString());
  }
}

// Checks the expert-side tensor (outExpertX / expertY / outExpertXScale) for the configured layout; `cols` is
// the expected last dimension. Returns {expert stride, row stride} in elements.
void checkExpertTensor(const Config& c, const char* name, const TensorView& t, int64_t cols, const char* colMeaning) {
  if (c.layout == Layout::kBatched) {
    checkDims(name, t, 3);
    checkDim(name, t, 0, c.numLocalExperts(), "local experts L = E / W");
    checkDim(name, t, 1, static_cast<int64_t>(c.batchedRowsPerExpert()), "rows per expert");
    checkDim(name, t, 2, cols, colMeaning);
  } else {
    checkDims(name, t, 2);
    checkDim(name, t, 0, static_cast<int64_t>(c.packedRows()), "packed rows");
    checkDim(name, t, 1, cols, colMeaning);
  }
  checkNonNegativeStrides(name, t);
}

void checkIndices(const Config& c, const char* name, const TensorView& t, int64_t m) {
  checkDims(name, t, 2);
  checkDim(name, t, 0, m, "tokens m");
  checkDim(name, t, 1, c.expertsPerToken, "experts per token K");
  checkNonNegativeStrides(name, t);
  (void)indexKindOf(t.dtype);
}

bool sameView(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.ndim != b.ndim || a.memory != b.memory || a.device != b.device) {
    return false;
  }
  for (int d = 0; d < TensorView::kMaxDims; ++d) {
    if (a.shape[d] != b.shape[d] || a.strides[d] != b.strides[d]) return false;
  }
  return true;
}

}  // namespace

int indexKindOf(DType dtype) {
  switch (dtype) {
    case DType::kI32:
      return 0;
    case DType::kU32:
      return 1;
    case DType::kI64:
      return 2;
    default:
      break;
  }
  EPCOMM_THROW(kInvalidArgument, "indices must be int32, uint32 or int64, got " << dtypeName(dtype));
}

std::vector<std::string> dispatchCastBackends() { return {"nvlink", "host"}; }

CheckedDispatch checkDispatchArgs(const Config& c, const DispatchArgs& a, MemoryKind memory, int device,
                                  bool appliesCast) {
  CheckedDispatch out;
  EPCOMM_CHECK(a.doSend || a.doRecv, kInvalidArgument, "dispatch called with doSend = doRecv = false");
  // The cast: the sender's x is bf16 [m, H]; the wire and the outputs are the fp8 dispatch's (Config::validate
  // checked hiddenDimBytes = H and the scale bytes), with the scales computed instead of given.
  const bool cast = c.dispatchCast != DispatchCast::kNone;
  const char* castName = dispatchCastName(c.dispatchCast);
  EPCOMM_CHECK(!cast || appliesCast, kUnavailable,
               "config.dispatchCast = " << castName
                                        << ": the proxy and nvshmem backends do not cast in their dispatch (nvlink and "
                                           "host do); create the object with dispatchCast = none and dispatch fp8 x "
                                           "with its scales, cast beforehand (reference::castFp8Blocks on the CPU)");
  const bool wantScale = c.hiddenDimScaleBytes > 0;
  const int64_t scaleCols = c.hiddenDimScaleBytes / 4;
  if (a.doSend) {
    checkMemory("x", a.x, memory, device);
    checkDims("x", a.x, 2);
    const int64_t item = dtypeSize(a.x.dtype);
    EPCOMM_CHECK(item > 0, kInvalidArgument, "x has an invalid dtype");
    EPCOMM_CHECK(a.x.shape[0] <= c.maxNumTokens, kInvalidArgument,
                 "x has " << a.x.shape[0] << " tokens, more than maxNumTokens = " << c.maxNumTokens);
    if (cast) {
      EPCOMM_CHECK(a.x.dtype == DType::kBf16, kInvalidArgument,
                   "x must be bf16 with config.dispatchCast = " << castName << " (the dispatch casts it to fp8), got "
                                                                << a.x.toString());
      checkDim("x", a.x, 1, c.hiddenDim, "hiddenDim H: the dispatch casts bf16 x");
    } else {
      EPCOMM_CHECK(a.x.shape[1] * item == c.hiddenDimBytes, kInvalidArgument,
                   "x rows are " << a.x.shape[1] * item << " bytes (" << a.x.toString()
                                 << ") but hiddenDimBytes = " << c.hiddenDimBytes);
    }
    checkInnerContiguous("x", a.x);
    checkAligned("x", a.x, 16);
    out.m = static_cast<uint32_t>(a.x.shape[0]);
    out.xRowStrideBytes = a.x.strides[0] * item;
    checkMemory("indices", a.indices, memory, device);
    checkIndices(c, "indices", a.indices, out.m);
    out.indexKind = indexKindOf(a.indices.dtype);
    out.indexStrides[0] = a.indices.strides[0];
    out.indexStrides[1] = a.indices.strides[1];
    if (cast) {
      EPCOMM_CHECK(!a.xScale.defined(), kInvalidArgument,
                   "xScale given but config.dispatchCast = " << castName << " computes the scales: pass none");
    } else if (wantScale) {
      EPCOMM_CHECK(a.xScale.defined(), kInvalidArgument,
                   "xScale is required: hiddenDimScaleBytes = " << c.hiddenDimScaleBytes);
      checkMemory("xScale", a.xScale, memory, device);
      checkDims("xScale", a.xScale, 2);
      EPCOMM_CHECK(dtypeSize(a.xScale.dtype) == 4, kInvalidArgument,
                   "xScale must have a 4-byte dtype (fp32), got " << a.xScale.toString());
      checkDim("xScale", a.xScale, 0, out.m, "tokens m");
      checkDim("xScale", a.xScale, 1, scaleCols, "hiddenDimScaleBytes / 4");
      checkNonNegativeStrides("xScale", a.xScale);
      out.scaleStrides[0] = a.xScale.strides[0];
      out.scaleStrides[1] = a.xScale.strides[1];
    } else {
      EPCOMM_CHECK(!a.xScale.defined(), kInvalidArgument, "xScale given but hiddenDimScaleBytes = 0");
    }
  }
  if (a.doRecv) {
    checkMemory("outExpertNumTokens", a.outExpertNumTokens, memory, device);
    checkDims("outExpertNumTokens", a.outExpertNumTokens, 1);
    checkDim("outExpertNumTokens", a.outExpertNumTokens, 0, c.numLocalExperts(), "local experts L = E / W");
    EPCOMM_CHECK(a.outExpertNumTokens.dtype == DType::kI32, kInvalidArgument,
                 "outExpertNumTokens must be int32, got " << dtypeName(a.outExpertNumTokens.dtype));
    EPCOMM_CHECK(a.outExpertNumTokens.strides[0] == 1, kInvalidArgument, "outExpertNumTokens must be contiguous");
    checkMemory("outExpertX", a.outExpertX, memory, device);
    const int64_t item = dtypeSize(a.outExpertX.dtype);
    EPCOMM_CHECK(item > 0, kInvalidArgument,
                 "outExpertX has an unsupported dtype (" << dtypeName(a.outExpertX.dtype)
                                                         << "); dispatch moves bytes: any dtype of 1, 2 or 4 bytes "
                                                            "(uint8, fp8, bf16, fp16, fp32, int32) whose rows hold "
                                                            "hiddenDimBytes");
    EPCOMM_CHECK(!cast || a.outExpertX.dtype == DType::kFp8E4M3, kInvalidArgument,
                 "outExpertX must be fp8_e4m3 with config.dispatchCast = " << castName << ", got "
                                                                           << dtypeName(a.outExpertX.dtype));
    EPCOMM_CHECK(c.hiddenDimBytes % item == 0, kInvalidArgument,
                 "outExpertX has dtype " << dtypeName(a.outExpertX.dtype) << " (" << item
                                         << " bytes), which does not divide hiddenDimBytes = " << c.hiddenDimBytes);
    checkExpertTensor(c, "outExpertX", a.outExpertX, c.hiddenDimBytes / item, "hiddenDimBytes / itemsize");
    checkInnerContiguous("outExpertX", a.outExpertX);
    checkAligned("outExpertX", a.outExpertX, 16);
    if (c.layout == Layout::kBatched) {
      out.outExpertStrideBytes = a.outExpertX.strides[0] * item;
      out.outRowStrideBytes = a.outExpertX.strides[1] * item;
    } else {
      out.outRowStrideBytes = a.outExpertX.strides[0] * item;
    }
    if (wantScale) {
      EPCOMM_CHECK(a.outExpertXScale.defined(), kInvalidArgument,
                   "outExpertXScale is required: hiddenDimScaleBytes = " << c.hiddenDimScaleBytes);
      checkMemory("outExpertXScale", a.outExpertXScale, memory, device);
      EPCOMM_CHECK(dtypeSize(a.outExpertXScale.dtype) == 4, kInvalidArgument,
                   "outExpertXScale must have a 4-byte dtype (fp32), got " << a.outExpertXScale.toString());
      EPCOMM_CHECK(!cast || a.outExpertXScale.dtype == DType::kF32, kInvalidArgument,
                   "outExpertXScale must be fp32 with config.dispatchCast = " << castName << ", got "
                                                                              << a.outExpertXScale.toString());
      checkExpertTensor(c, "outExpertXScale", a.outExpertXScale, scaleCols, "hiddenDimScaleBytes / 4");
      for (int d = 0; d < a.outExpertXScale.ndim; ++d) out.outScaleStrides[d] = a.outExpertXScale.strides[d];
    } else {
      EPCOMM_CHECK(!a.outExpertXScale.defined(), kInvalidArgument, "outExpertXScale given but hiddenDimScaleBytes = 0");
    }
  }
  return out;
}

bool sameArgs(const DispatchArgs& a, const DispatchArgs& b) {
  return sameView(a.outExpertNumTokens, b.outExpertNumTokens) && sameView(a.outExpertX, b.outExpertX) &&
         sameView(a.outExpertXScale, b.outExpertXScale) && sameView(a.x, b.x) && sameView(a.xScale, b.xScale) &&
         sameView(a.indices, b.indices) && a.boundM == b.boundM && a.doSend == b.doSend && a.doRecv == b.doRecv &&
         a.stream == b.stream;
}

bool sameArgs(const CombineArgs& a, const CombineArgs& b) {
  return sameView(a.outTokens, b.outTokens) && sameView(a.indices, b.indices) && sameView(a.weights, b.weights) &&
         sameView(a.expertY, b.expertY) && a.boundM == b.boundM && a.doSend == b.doSend && a.doRecv == b.doRecv &&
         a.accumulate == b.accumulate && a.stream == b.stream;
}

CheckedCombine checkCombineArgs(const Config& c, const CombineArgs& a, MemoryKind memory, int device) {
  CheckedCombine out;
  EPCOMM_CHECK(a.doSend || a.doRecv, kInvalidArgument, "combine called with doSend = doRecv = false");
  if (a.doSend) {
    checkMemory("expertY", a.expertY, memory, device);
    EPCOMM_CHECK(a.expertY.dtype == DType::kBf16 || a.expertY.dtype == DType::kF16 || a.expertY.dtype == DType::kF32,
                 kInvalidArgument, "expertY must be bf16, fp16 or fp32, got " << dtypeName(a.expertY.dtype));
    checkExpertTensor(c, "expertY", a.expertY, c.hiddenDim, "hiddenDim H");
    checkInnerContiguous("expertY", a.expertY);
    checkAligned("expertY", a.expertY, 16);
    if (c.layout == Layout::kBatched) {
      out.yExpertStride = a.expertY.strides[0];
      out.yRowStride = a.expertY.strides[1];
    } else {
      out.yRowStride = a.expertY.strides[0];
    }
  }
  if (a.doRecv) {
    checkMemory("outTokens", a.outTokens, memory, device);
    checkDims("outTokens", a.outTokens, 2);
    EPCOMM_CHECK(
        a.outTokens.dtype == DType::kBf16 || a.outTokens.dtype == DType::kF16 || a.outTokens.dtype == DType::kF32,
        kInvalidArgument, "outTokens must be bf16, fp16 or fp32, got " << dtypeName(a.outTokens.dtype));
    EPCOMM_CHECK(a.outTokens.shape[0] <= c.maxNumTokens, kInvalidArgument,
                 "outTokens has " << a.outTokens.shape[0] << " tokens, more than maxNumTokens = " << c.maxNumTokens);
    checkDim("outTokens", a.outTokens, 1, c.hiddenDim, "hiddenDim H");
    checkInnerContiguous("outTokens", a.outTokens);
    checkAligned("outTokens", a.outTokens, 16);
    out.outRowStride = a.outTokens.strides[0];
    checkMemory("indices", a.indices, memory, device);
    checkDims("indices", a.indices, 2);
    // The tokens are indices' rows. outTokens may have more rows (pplx-kernels' callers pass one buffer of
    // maxNumTokens rows for every batch): rows >= m are never written.
    EPCOMM_CHECK(a.indices.shape[0] <= a.outTokens.shape[0], kInvalidArgument,
                 "indices has " << a.indices.shape[0] << " tokens but outTokens only " << a.outTokens.shape[0]
                                << " rows: indices dimension 0 must be at most " << a.outTokens.shape[0]
                                << " (one outTokens row per token)");
    out.m = static_cast<uint32_t>(a.indices.shape[0]);
    checkIndices(c, "indices", a.indices, out.m);
    out.indexKind = indexKindOf(a.indices.dtype);
    out.indexStrides[0] = a.indices.strides[0];
    out.indexStrides[1] = a.indices.strides[1];
    checkMemory("weights", a.weights, memory, device);
    checkDims("weights", a.weights, 2);
    EPCOMM_CHECK(a.weights.dtype == DType::kF32, kInvalidArgument,
                 "weights must be fp32, got " << dtypeName(a.weights.dtype));
    checkDim("weights", a.weights, 0, out.m, "tokens m");
    checkDim("weights", a.weights, 1, c.expertsPerToken, "experts per token K");
    checkNonNegativeStrides("weights", a.weights);
    out.weightStrides[0] = a.weights.strides[0];
    out.weightStrides[1] = a.weights.strides[1];
  }
  return out;
}

void checkSendHalfWeights(const Config& c, const TensorView& w, int device, const char* backend) {
  // A rank without tokens this round may pass a 0-row tensor without storage (null data): nothing reads it.
  EPCOMM_CHECK((w.data != nullptr || hasNoElements(w)) && w.memory == MemoryKind::kCuda && w.device == device,
               kInvalidArgument,
               backend << " combine send half needs weights on cuda:" << device << ", got " << w.toString());
  EPCOMM_CHECK(w.ndim == 2 && w.dtype == DType::kF32 && w.shape[1] == c.expertsPerToken &&
                   w.shape[0] <= c.maxNumTokens && w.strides[0] >= 0 && w.strides[1] >= 0,
               kInvalidArgument, "weights must be fp32 [m <= maxNumTokens, K], got " << w.toString());
}

}  // namespace epcomm
