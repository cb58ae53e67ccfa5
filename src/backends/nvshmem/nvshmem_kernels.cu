// Dispatch and combine kernels of the nvshmem backend: NVSHMEM put-with-signal and signal operations only, and bounded
// polling of local signal words. See docs/nvshmem.md for the protocol, nvshmem_layout.hpp for the buffers. One kernel
// per call, templated on the halves it runs (<kSend, kRecv>): a fused call runs both in one launch, the send phase's
// blocks first.
//
// Ordering: NVSHMEM's put-with-signal updates the remote signal only once the data has landed. A receiver polls the
// signal word in its own memory with ld.acquire.sys; after a block (or warp) barrier every thread of the block (warp)
// reads the data with ordinary loads (acquire + barrier cumulativity). Signals are SET to the round, a counter per work
// slot kept in device memory, so every round has fresh values, nothing is ever reset, and CUDA-graph replays stay
// correct.
//
// Who may write what, when (the combine is the barrier of the round):
//   - a sender overwrites a receiver's dispatch region only in its next dispatch, which follows its combine-recv,
//     which waited for every rank's doneSig: that rank's combine-send finished reading this round's records and
//     weights;
//   - an expert rank overwrites a token rank's partials only in its next combine-send, which waits for every rank's
//     next weights, put by each rank's next combine-send, which follows that rank's combine-recv of this round;
//   - a rank reuses its own staging for the next round only after the same two waits, which imply that the puts out
//     of it have landed (every put of a round is waited for by its receiver before that receiver's doneSig).
//
// Waits inside one launch only point to lower blocks: a fused call's receive blocks come after its send blocks, and
// combine-send's blocks wait for this rank's own weights, which block 0 puts before it waits. The GPU starts a launch's
// blocks in index order, so a waiting block never keeps the block it waits for from starting. At most kMaxWaitBlocks
// blocks of a phase wait, and kMinBlocksPerSm blocks fit an SM, so the waiting blocks of two ranks sharing a GPU under
// MPS leave room for the blocks they wait for. A wait that cannot end still ends: EPCOMM_TIMEOUT_MS, then a named
// error.
#include <cuda_runtime.h>

#include "backends/nvshmem/nvshmem_combine.cuh"
#include "backends/nvshmem/nvshmem_device.cuh"
#include "backends/nvshmem/nvshmem_dispatch.cuh"
#include "backends/nvshmem/nvshmem_kernels.hpp"

namespace epcomm {
namespace nvshmem {

namespace {

// Blocks of 256 threads that one SM holds at once (the launch bound caps registers at 80 a thread).
constexpr int kMinBlocksPerSm = 3;

// Send half: blocks [0, W x C), one pack-and-put unit each. Receive half: the next recvBlocks blocks.
template <bool kSend, bool kRecv>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) dispatchKernel(const DispatchKernelArgs a) {
  extern __shared__ uint32_t sm[];
  const uint32_t sendBlocks = kSend ? packUnits(a.g) : 0;
  if (kSend && blockIdx.x < sendBlocks) {
    packPutUnit(a, blockIdx.x, sm);
  } else if (kRecv) {
    dispatchRecvPhase(a, blockIdx.x - sendBlocks, sm);
  }
}

// Send half: blocks [0, sendBlocks). Receive half: the next combineBlocks blocks. kY: expertY's CombineType, kOut:
// outTokens' (kTypeF32 for a half that does not run).
template <bool kSend, bool kRecv, int kY, int kOut>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) combineKernel(const CombineKernelArgs a) {
  extern __shared__ uint32_t sm[];
  const uint32_t sendBlocks = kSend ? a.g.sendBlocks : 0;
  if (kSend && blockIdx.x < sendBlocks) {
    combineSendPhase<kY>(a, blockIdx.x, sm);
  } else if (kRecv) {
    combineRecvPhase<kOut>(a, blockIdx.x - sendBlocks);
  }
}

template <bool kSend, bool kRecv, int kY, int kOut>
int launchCombineTyped(const CombineKernelArgs& a, cudaStream_t s) {
  const uint32_t blocks = combineLaunchBlocks(a.g, kSend, kRecv);
  combineKernel<kSend, kRecv, kY, kOut><<<blocks, kThreads, static_cast<uint32_t>(combineSharedBytes(a.g)), s>>>(a);
  return static_cast<int>(cudaGetLastError());
}

// The instantiation for the call's types: expertY's when the send half runs, outTokens' when the receive half does.
template <bool kSend, bool kRecv, int kY>
int launchCombineOut(const CombineKernelArgs& a, cudaStream_t s) {
  if constexpr (kRecv) {
    switch (a.outType) {
      case kTypeBf16:
        return launchCombineTyped<kSend, kRecv, kY, kTypeBf16>(a, s);
      case kTypeF16:
        return launchCombineTyped<kSend, kRecv, kY, kTypeF16>(a, s);
      default:
        return launchCombineTyped<kSend, kRecv, kY, kTypeF32>(a, s);
    }
  } else {
    return launchCombineTyped<kSend, kRecv, kY, kTypeF32>(a, s);
  }
}

template <bool kSend, bool kRecv>
int launchCombineHalves(const CombineKernelArgs& a, cudaStream_t s) {
  if constexpr (kSend) {
    switch (a.yType) {
      case kTypeBf16:
        return launchCombineOut<kSend, kRecv, kTypeBf16>(a, s);
      case kTypeF16:
        return launchCombineOut<kSend, kRecv, kTypeF16>(a, s);
      default:
        return launchCombineOut<kSend, kRecv, kTypeF32>(a, s);
    }
  } else {
    return launchCombineOut<kSend, kRecv, kTypeF32>(a, s);
  }
}

}  // namespace

int launchDispatch(const DispatchKernelArgs& a, bool send, bool recv, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const uint32_t blocks = dispatchBlocks(a.g, send, recv);
  const uint32_t smem = static_cast<uint32_t>(dispatchSharedBytes(a.g, send, recv));
  if (send && recv) {
    dispatchKernel<true, true><<<blocks, kThreads, smem, s>>>(a);
  } else if (send) {
    dispatchKernel<true, false><<<blocks, kThreads, smem, s>>>(a);
  } else {
    dispatchKernel<false, true><<<blocks, kThreads, smem, s>>>(a);
  }
  return static_cast<int>(cudaGetLastError());
}

int launchCombine(const CombineKernelArgs& a, bool send, bool recv, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (send && recv) return launchCombineHalves<true, true>(a, s);
  if (send) return launchCombineHalves<true, false>(a, s);
  return launchCombineHalves<false, true>(a, s);
}

int configureKernels(const Geometry& g) {
  const int smem = static_cast<int>(dispatchSharedBytes(g, true, true));
  for (const void* fn : {reinterpret_cast<const void*>(dispatchKernel<true, true>),
                         reinterpret_cast<const void*>(dispatchKernel<true, false>),
                         reinterpret_cast<const void*>(dispatchKernel<false, true>)}) {
    // The limit belongs to the kernel, not to the object: only ever raised, so that an object with smaller tables
    // does not lower it under another one of the process.
    cudaFuncAttributes attr{};
    cudaError_t e = cudaFuncGetAttributes(&attr, fn);
    if (e == cudaSuccess && attr.maxDynamicSharedSizeBytes < smem) {
      e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    }
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  return 0;
}

}  // namespace nvshmem
}  // namespace epcomm
