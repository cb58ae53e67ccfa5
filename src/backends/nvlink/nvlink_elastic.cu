// Elastic ranks on the nvlink backend: the index mask that drops the positions of masked ranks before a dispatch or
// a combine (docs/failures.md, "Elastic ranks"). The dispatch and combine kernels then need no test of their own in
// their loops over tokens: a dropped position is -1, as if the caller had passed it so.
#include <cuda_runtime.h>

#include <cstdint>

#include "backends/nvlink/nvlink_kernels.hpp"
#include "core/layout.hpp"

namespace epcomm {
namespace nvlink {

namespace {

constexpr uint32_t kMaskThreads = 256;

__global__ void __launch_bounds__(kMaskThreads) maskIndicesKernel(const MaskIndicesArgs a) {
  const uint64_t total = static_cast<uint64_t>(a.m) * a.topK;
  uint32_t bound = a.m;
  if (a.boundM != nullptr) {
    const int32_t b = *a.boundM;
    bound = b < 0 ? 0u : (static_cast<uint32_t>(b) < a.m ? static_cast<uint32_t>(b) : a.m);
  }
  uint32_t drops = 0;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t t = static_cast<uint32_t>(i / a.topK), k = static_cast<uint32_t>(i % a.topK);
    const int64_t e =
        decodeIndex(a.indices, a.indexKind,
                    static_cast<int64_t>(t) * a.indexStrides[0] + static_cast<int64_t>(k) * a.indexStrides[1]);
    int32_t v;
    if (e < -1) {
      v = -2;  // still out of range: the dispatch's index check reports it
    } else if (e >= static_cast<int64_t>(a.numExperts)) {
      v = static_cast<int32_t>(a.numExperts);
    } else if (e < 0) {
      v = -1;
    } else {
      const uint32_t sender = tokenSender(a.group, t, a.dpSize);
      const uint32_t owner = expertOwner(static_cast<uint32_t>(e), a.numLocalExperts);
      const bool dropped = ((a.live >> sender) & 1u) == 0 || ((a.live >> owner) & 1u) == 0;
      v = dropped ? -1 : static_cast<int32_t>(e);
      if (dropped && t < bound) ++drops;
    }
    a.out[i] = v;
  }
  if (a.drops == nullptr) return;
  // The block's count into the device total; the last block to finish copies the total to the host-mapped word (a
  // plain store: system-scope atomics on host memory are not available over every PCIe link).
  __shared__ uint32_t blockDrops;
  __shared__ bool last;
  if (threadIdx.x == 0) blockDrops = 0;
  __syncthreads();
  if (drops != 0) atomicAdd(&blockDrops, drops);
  __syncthreads();
  if (threadIdx.x == 0) {
    if (blockDrops != 0) atomicAdd(a.drops, static_cast<unsigned long long>(blockDrops));
    __threadfence();
    last = atomicAdd(a.drops + 1, 1ull) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last || threadIdx.x != 0) return;
  a.drops[1] = 0;
  *reinterpret_cast<volatile unsigned long long*>(a.hostDrops) = atomicAdd(a.drops, 0ull);
  __threadfence_system();
}

}  // namespace

int launchMaskIndices(const MaskIndicesArgs& args, void* stream) {
  const uint64_t total = static_cast<uint64_t>(args.m) * args.topK;
  if (total == 0) return 0;
  const uint64_t blocks = (total + kMaskThreads - 1) / kMaskThreads;
  maskIndicesKernel<<<static_cast<unsigned>(blocks < 264 ? blocks : 264), kMaskThreads, 0,
                      static_cast<cudaStream_t>(stream)>>>(args);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace nvlink
}  // namespace epcomm
