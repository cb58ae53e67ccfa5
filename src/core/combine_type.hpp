// Element types of the GPU backends' combine kernels (nvlink, nvshmem, proxy): expertY and outTokens are read and
// written as one of three types, and each kernel is instantiated per type. No CUDA headers here: the host classes
// and the kernels' argument headers include it.
#pragma once

#include "epcomm/tensor.hpp"

namespace epcomm {

/// Element type of a combine kernel's expertY or outTokens (kernel arguments and the proxy's mailbox carry the code).
enum CombineType : int { kTypeBf16 = 0, kTypeF16 = 1, kTypeF32 = 2 };

/// The CombineType of `t`: bf16 and fp16 by name, every other dtype fp32.
inline int combineType(DType t) {
  switch (t) {
    case DType::kBf16:
      return kTypeBf16;
    case DType::kF16:
      return kTypeF16;
    default:
      return kTypeF32;
  }
}

/// The dtype of CombineType `code` (kTypeF32 for any code other than bf16 and fp16).
inline DType combineDtype(int code) {
  return code == kTypeBf16 ? DType::kBf16 : code == kTypeF16 ? DType::kF16 : DType::kF32;
}

}  // namespace epcomm
