// Non-owning tensor views passed to dispatch/combine. No framework types: torch/numpy/DLPack adapt to this.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

namespace epcomm {

/// Element type of a tensor.
enum class DType : int {
  kInvalid = 0,
  kU8,
  kFp8E4M3,
  kFp8E5M2,
  kBf16,
  kF16,
  kF32,
  kI32,
  kU32,
  kI64,
};

/// Bytes per element (0 for kInvalid).
int dtypeSize(DType dtype);
/// "bf16", "fp8_e4m3", ...
const char* dtypeName(DType dtype);
/// Inverse of dtypeName; throws kInvalidArgument for an unknown name.
DType dtypeFromName(const std::string& name);

/// Where a tensor's memory lives.
enum class MemoryKind : int { kHost = 0, kCuda = 1 };

/// A strided view: `data` points at element [0, ..., 0]; strides are in elements. Up to 4 dimensions.
/// An empty view (data == nullptr && ndim == 0) means "not given".
struct TensorView {
  static constexpr int kMaxDims = 4;
  void* data = nullptr;
  DType dtype = DType::kInvalid;
  int ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t strides[kMaxDims] = {0, 0, 0, 0};
  MemoryKind memory = MemoryKind::kHost;
  int device = -1;  ///< CUDA device ordinal for kCuda, -1 for host memory.

  /// A contiguous (row-major) view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               MemoryKind memory = MemoryKind::kHost, int device = -1);
  /// A view with explicit strides (in elements).
  static TensorView strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                            std::initializer_list<int64_t> strides, MemoryKind memory = MemoryKind::kHost,
                            int device = -1);

  bool defined() const { return data != nullptr || ndim > 0; }
  int64_t numel() const;
  /// Row-major with no gaps.
  bool isContiguous() const;
  /// "bf16[128, 7168] strides [7168, 1] cuda:0"
  std::string toString() const;
};

}  // namespace epcomm
