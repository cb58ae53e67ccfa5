#include "epcomm/tensor.hpp"

#include <sstream>

#include "epcomm/error.hpp"

namespace epcomm {

int dtypeSize(DType dtype) {
  switch (dtype) {
    case DType::kU8:
    case DType::kFp8E4M3:
    case DType::kFp8E5M2:
      return 1;
    case DType::kBf16:
    case DType::kF16:
      return 2;
    case DType::kF32:
    case DType::kI32:
    case DType::kU32:
      return 4;
    case DType::kI64:
      return 8;
    case DType::kInvalid:
      return 0;
  }
  return 0;
}

const char* dtypeName(DType dtype) {
  switch (dtype) {
    case DType::kU8:
      return "u8";
    case DType::kFp8E4M3:
      return "fp8_e4m3";
    case DType::kFp8E5M2:
      return "fp8_e5m2";
    case DType::kBf16:
      return "bf16";
    case DType::kF16:
      return "fp16";
    case DType::kF32:
      return "fp32";
    case DType::kI32:
      return "int32";
    case DType::kU32:
      return "uint32";
    case DType::kI64:
      return "int64";
    case DType::kInvalid:
      return "invalid";
  }
  return "invalid";
}

DType dtypeFromName(const std::string& name) {
  for (int i = 1; i <= static_cast<int>(DType::kI64); ++i) {
    if (name == dtypeName(static_cast<DType>(i))) return static_cast<DType>(i);
  }
  EPCOMM_THROW(kInvalidArgument, "unknown dtype '" << name << "'");
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape, MemoryKind memory,
                                  int device) {
  EPCOMM_CHECK(shape.size() <= static_cast<size_t>(kMaxDims), kInvalidArgument,
               "tensor has " << shape.size() << " dimensions, at most " << kMaxDims << " are supported");
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) v.shape[i++] = s;
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.strides[d] = stride;
    stride *= v.shape[d];
  }
  v.memory = memory;
  v.device = device;
  return v;
}

TensorView TensorView::strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               std::initializer_list<int64_t> strides, MemoryKind memory, int device) {
  EPCOMM_CHECK(shape.size() == strides.size(), kInvalidArgument,
               "tensor shape has " << shape.size() << " dimensions but strides have " << strides.size());
  TensorView v = contiguous(data, dtype, shape, memory, device);
  int i = 0;
  for (int64_t s : strides) v.strides[i++] = s;
  return v;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::isContiguous() const {
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::toString() const {
  std::ostringstream oss;
  oss << dtypeName(dtype) << "[";
  for (int d = 0; d < ndim; ++d) oss << (d ? ", " : "") << shape[d];
  oss << "] strides [";
  for (int d = 0; d < ndim; ++d) oss << (d ? ", " : "") << strides[d];
  oss << "] " << (memory == MemoryKind::kCuda ? "cuda:" + std::to_string(device) : std::string("host"));
  return oss.str();
}

}  // namespace epcomm
