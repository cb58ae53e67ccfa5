#include "backends/nvlink/nvlink_index_mask.hpp"

#include <cuda_runtime.h>

#include "backends/nvlink/nvlink_kernels.hpp"
#include "core/cuda_check.hpp"
#include "core/validate.hpp"
#include "epcomm/error.hpp"

namespace epcomm {
namespace nvlink {

void IndexMask::apply(const Config& config, uint32_t live, const TensorView& indices, uint32_t m, const int32_t* boundM,
                      bool count, void* stream, bool combine, const void*& out, int32_t& kind, int64_t (&strides)[2]) {
  const uint64_t perCall = static_cast<uint64_t>(config.maxNumTokens) * config.expertsPerToken;
  if (!scratch_) {
    scratch_ = cuda::allocDevice(2 * perCall * sizeof(int32_t) + 16);
    EPCOMM_CHECK_CUDA(cudaMemset(scratch_.get(), 0, 2 * perCall * sizeof(int32_t) + 16));
    hostDrops_ = cuda::allocPinnedMapped(sizeof(uint64_t));
    *static_cast<volatile uint64_t*>(hostDrops_.get()) = 0;
    EPCOMM_CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&hostDropsDev_), hostDrops_.get(), 0));
  }
  EPCOMM_CHECK(m <= config.maxNumTokens, kInvalidArgument,
               "rank " << config.rank << ": indices have " << m << " rows, more than maxNumTokens");
  int32_t* scratch = static_cast<int32_t*>(scratch_.get()) + (combine ? perCall : 0);
  MaskIndicesArgs a{};
  a.indices = indices.data;
  a.indexKind = indexKindOf(indices.dtype);
  a.indexStrides[0] = indices.strides[0];
  a.indexStrides[1] = indices.strides[1];
  a.m = m;
  a.topK = config.expertsPerToken;
  a.numExperts = config.numExperts;
  a.numLocalExperts = config.numLocalExperts();
  a.dpSize = config.dpSize;
  a.group = config.rank / config.dpSize;
  a.live = live;
  a.boundM = boundM;
  a.out = scratch;
  if (count) {
    a.drops = reinterpret_cast<unsigned long long*>(static_cast<int32_t*>(scratch_.get()) + 2 * perCall);
    a.hostDrops = reinterpret_cast<unsigned long long*>(hostDropsDev_);
  }
  const int rc = launchMaskIndices(a, stream);
  EPCOMM_CHECK(rc == 0, kCuda,
               "rank " << config.rank << ": the elastic index mask failed to launch: "
                       << cudaGetErrorString(static_cast<cudaError_t>(rc)));
  out = scratch;
  kind = 0;
  strides[0] = config.expertsPerToken;
  strides[1] = 1;
}

}  // namespace nvlink
}  // namespace epcomm
