// Elastic ranks, host side of the index mask (nvlink_elastic.cu's kernel) that the nvlink and nvshmem backends run
// before their kernels while a rank is masked: the call's indices with the masked ranks' positions set to -1, in
// scratch of the object's own, and the count of the positions dropped (droppedTokens).
#pragma once

#include <cstdint>

#include "core/cuda_resources.hpp"
#include "epcomm/config.hpp"
#include "epcomm/tensor.hpp"

namespace epcomm {
namespace nvlink {

class IndexMask {
 public:
  /// Launches the mask of `indices` (m rows) under the active ranks `live` on `stream`, into the dispatch's or the
  /// combine's (`combine`) scratch, allocated at the first call; `count`: the positions dropped are added to
  /// dropped(). Points `out`, `kind`, `strides` at the masked copy (int32, contiguous). Throws Error.
  void apply(const Config& config, uint32_t live, const TensorView& indices, uint32_t m, const int32_t* boundM,
             bool count, void* stream, bool combine, const void*& out, int32_t& kind, int64_t (&strides)[2]);
  /// Positions dropped so far by counted launches that completed.
  uint64_t dropped() const { return hostDrops_ ? *static_cast<const volatile uint64_t*>(hostDrops_.get()) : 0; }

 private:
  cuda::DeviceMemory scratch_;  // int32 [maxNumTokens][K] for a dispatch, the same for a combine, the counter's words
  cuda::PinnedMemory hostDrops_;
  uint64_t* hostDropsDev_ = nullptr;
};

}  // namespace nvlink
}  // namespace epcomm
