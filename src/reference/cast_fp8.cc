// reference::castFp8Blocks: the per-block fp8 e4m3 cast of DeepEP's low-latency dispatch, on the CPU.
#include <cstdint>

#include "core/fp8_cast.hpp"
#include "epcomm/error.hpp"
#include "epcomm/reference.hpp"

namespace epcomm {
namespace reference {

namespace {

void checkHost2d(const char* name, const TensorView& t, int64_t rows, int64_t cols) {
  EPCOMM_CHECK(t.data != nullptr || rows * cols == 0, kInvalidArgument, name << " has a null data pointer");
  EPCOMM_CHECK(t.memory == MemoryKind::kHost, kInvalidArgument,
               name << " must be in host memory (the CPU cast), got " << t.toString());
  EPCOMM_CHECK(t.ndim == 2 && t.shape[0] == rows && t.shape[1] == cols, kInvalidArgument,
               name << " must have shape [" << rows << ", " << cols << "], got " << t.toString());
  EPCOMM_CHECK(t.strides[0] >= 0 && t.strides[1] >= 0, kInvalidArgument,
               name << " has a negative stride: " << t.toString());
}

}  // namespace

void castFp8Blocks(const TensorView& x, const TensorView& out, const TensorView& scales, int blockSize,
                   bool roundScale) {
  EPCOMM_CHECK(blockSize > 0, kInvalidArgument, "castFp8Blocks: blockSize must be positive, got " << blockSize);
  EPCOMM_CHECK(x.ndim == 2, kInvalidArgument, "x must have 2 dimensions [tokens, hidden], got " << x.toString());
  EPCOMM_CHECK(x.dtype == DType::kBf16 || x.dtype == DType::kF16 || x.dtype == DType::kF32, kInvalidArgument,
               "x must be bf16, fp16 or fp32, got " << dtypeName(x.dtype));
  const int64_t m = x.shape[0], H = x.shape[1];
  EPCOMM_CHECK(H % blockSize == 0, kInvalidArgument,
               "x has " << H << " columns, not a multiple of the block size " << blockSize);
  checkHost2d("x", x, m, H);
  checkHost2d("out", out, m, H);
  EPCOMM_CHECK(out.dtype == DType::kFp8E4M3, kInvalidArgument, "out must be fp8_e4m3, got " << dtypeName(out.dtype));
  checkHost2d("scales", scales, m, H / blockSize);
  EPCOMM_CHECK(scales.dtype == DType::kF32, kInvalidArgument, "scales must be fp32, got " << dtypeName(scales.dtype));
  EPCOMM_CHECK(
      H <= 1 || (x.strides[1] == 1 && out.strides[1] == 1), kInvalidArgument,
      "x and out must be contiguous in their last dimension, got " << x.toString() << " and " << out.toString());
  float* s = static_cast<float*>(scales.data);
  uint8_t* q = static_cast<uint8_t*>(out.data);
  const int64_t itemBytes = dtypeSize(x.dtype);
  for (int64_t t = 0; t < m; ++t) {
    castFp8Row(x.dtype, static_cast<const char*>(x.data) + t * x.strides[0] * itemBytes, static_cast<uint32_t>(H),
               roundScale, q + t * out.strides[0], s + t * scales.strides[0], scales.strides[1],
               static_cast<uint32_t>(blockSize));
  }
}

}  // namespace reference
}  // namespace epcomm
