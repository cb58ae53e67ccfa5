// Kernels of the GPU proxy backend: the "device side" of the proxy protocol (docs/protocol.md), writing and reading
// the channel's buffers in the wire format of src/proxy/protocol.hpp, exactly as the host backend's CPU loops do
// (src/backends/host/host_kernels.cc is their executable specification).
//
// One translation unit: the .cuh parts hold the device code by concern (proxy_wait: mailbox and arrival waits, error
// records, the last-block hand-off and trace stamps; proxy_dispatch: the dispatch kernels; proxy_combine: the combine
// kernels) and are compiled here together, without relocatable device code; proxy_wait.cuh gives the ordering
// argument and the bound on every wait.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "backends/proxy/proxy_combine.cuh"
#include "backends/proxy/proxy_dispatch.cuh"
#include "backends/proxy/proxy_kernels.hpp"

namespace epcomm {
namespace gpuproxy {

namespace {

// Clock check (one thread): n times, waits for the host's request cell[0] = 2i + 1, stores %globaltimer into cell[1]
// and acknowledges with cell[0] = 2i + 2. The host keeps the request whose round trip was shortest. Each wait gives up
// after a second (the host then reports the clocks as not compared).
__global__ void clockProbeKernel(uint64_t* cell, uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) {
    const uint64_t start = globalTimerNs();
    while (ldAcquireSys(cell) != 2ull * i + 1) {
      if (globalTimerNs() - start > 1000000000ull) return;
    }
    *reinterpret_cast<volatile uint64_t*>(cell + 1) = globalTimerNs();
    stReleaseSys(cell, 2ull * i + 2);
  }
}

template <int kY>
const void* combineRecvFor(int outType) {
  switch (outType) {
    case kTypeBf16:
      return reinterpret_cast<const void*>(&combineRecvKernel<kY, kTypeBf16>);
    case kTypeF16:
      return reinterpret_cast<const void*>(&combineRecvKernel<kY, kTypeF16>);
    default:
      return reinterpret_cast<const void*>(&combineRecvKernel<kY, kTypeF32>);
  }
}

int launch(const void* fn, uint32_t blocks, uint32_t threads, size_t smem, const void* args, void* stream) {
  void* params[] = {const_cast<void*>(args)};
  return static_cast<int>(
      cudaLaunchKernel(fn, dim3(blocks), dim3(threads), params, smem, static_cast<cudaStream_t>(stream)));
}

// Whether the current device has programmatic dependent launch (sm_90 and later), asked once per device.
bool dependentLaunchOk() {
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices];  // 0 not asked yet, 1 yes, -1 no
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kDevices) return false;
  int k = known[dev].load(std::memory_order_relaxed);
  if (k == 0) {
    int major = 0;
    k = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9 ? 1 : -1;
    known[dev].store(k, std::memory_order_relaxed);
  }
  return k > 0;
}

// A kernel that depends only on the one launched just before it on the stream (programmatic dependent launch): its
// blocks may be scheduled while that one still runs (once its blocks allow it: allowDependentGrids) and wait for it in
// waitPreviousGrid, which saves the launch gap between the two (~2.5 us under MPS). Captured into CUDA graphs as a
// programmatic edge. Before sm_90, an ordinary launch.
int launchAfter(const void* fn, uint32_t blocks, uint32_t threads, size_t smem, const void* args, void* stream) {
  if (!dependentLaunchOk()) return launch(fn, blocks, threads, smem, args, stream);
  void* params[] = {const_cast<void*>(args)};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return static_cast<int>(cudaLaunchKernelExC(&cfg, fn, params));
}

// Blocks of a multi-block kernel whose warps each take one of `items` work items: no more than the items need
// (a decode round keeps most SMs free, and every block's exit costs a system-scope fence), at most `blocks`.
uint32_t blocksFor(uint64_t items, uint32_t threads, uint32_t blocks) {
  const uint64_t warps = threads / 32;
  const uint64_t need = (items + warps - 1) / warps;
  return static_cast<uint32_t>(std::max<uint64_t>(1, std::min<uint64_t>(blocks, need)));
}

// Work items of kChunkBytes in a row of `bytes`.
uint64_t chunksOf(uint64_t bytes) { return std::max<uint64_t>(1, (bytes + kChunkBytes - 1) / kChunkBytes); }

}  // namespace

int launchDispatchSend(const DispatchSendArgs& a, uint32_t blocks, void* stream) {
  int rc = launch(reinterpret_cast<const void*>(&dispatchRouteKernel), 1, kRankThreads, routeSharedBytes(a.sizes), &a,
                  stream);
  if (rc != 0) return rc;
  // One warp per own token of the call (at most m of them).
  const uint32_t D = a.sizes.dpSize;
  const uint64_t own = (static_cast<uint64_t>(a.m) + D - 1) / D;
  return launchAfter(reinterpret_cast<const void*>(&dispatchPackKernel),
                     blocksFor(own * chunksOf(a.sizes.payloadBytes), kCopyThreads, blocks), kCopyThreads, 0, &a,
                     stream);
}

int launchDispatchRecv(const DispatchRecvArgs& a, uint32_t blocks, void* stream) {
  int rc = launch(reinterpret_cast<const void*>(&dispatchRankKernel), a.sizes.worldSize, kRankThreads,
                  rankSharedBytes(a.tg), &a, stream);
  if (rc != 0) return rc;
  // One warp per received entry: at most maxSendTokens from each sender.
  const uint64_t entries = static_cast<uint64_t>(a.sizes.worldSize) * a.sizes.maxSendTokens;
  return launchAfter(reinterpret_cast<const void*>(&dispatchCopyKernel),
                     blocksFor(entries * chunksOf(a.sizes.payloadBytes), kCopyThreads, blocks), kCopyThreads,
                     copySharedBytes(a.sizes), &a, stream);
}

int launchCombineSend(const CombineSendArgs& a, uint32_t blocks, void* stream) {
  // One warp per chunk of a row this rank received in the dispatch: at most combineSendRows rows.
  const uint64_t rowBytes = static_cast<uint64_t>(a.hidden) * a.itemBytes;
  const uint64_t chunks = rowBytes % 16 == 0 ? chunksOf(rowBytes) : 1;
  return launch(reinterpret_cast<const void*>(&combineSendKernel),
                blocksFor(a.sizes.combineSendRows * chunks, kCopyThreads, blocks), kCopyThreads,
                combineSendSharedBytes(a.sizes), &a, stream);
}

uint64_t combineRecvSharedBytes(const proxy::ProtocolSizes& s) {
  const uint64_t words = static_cast<uint64_t>(s.dpSize) * s.numExperts + s.worldSize + 1;
  return ((4 * words + 7) & ~uint64_t{7}) + 12ull * s.expertsPerToken;
}

int launchCombineRecv(const CombineRecvArgs& a, uint32_t blocks, void* stream) {
  const void* fn = nullptr;
  switch (a.yType) {
    case kTypeBf16:
      fn = combineRecvFor<kTypeBf16>(a.outType);
      break;
    case kTypeF16:
      fn = combineRecvFor<kTypeF16>(a.outType);
      break;
    default:
      fn = combineRecvFor<kTypeF32>(a.outType);
      break;
  }
  // One block per (token, slice of kSumThreads 16-byte loads) of the call (at most m tokens).
  const uint64_t item = a.yType == kTypeF32 ? 4 : 2;
  const uint64_t rowBytes = a.hidden * item;
  const uint64_t sliceBytes = 16ull * kSumThreads;
  const uint64_t slices = rowBytes % 16 == 0 ? (rowBytes + sliceBytes - 1) / sliceBytes : 1;
  const uint64_t items = std::max<uint64_t>(1, static_cast<uint64_t>(a.m) * slices);
  return launch(fn, static_cast<uint32_t>(std::min<uint64_t>(blocks, items)), kSumThreads,
                combineRecvSharedBytes(a.sizes), &a, stream);
}

int configureKernels(uint32_t bytes) {
  const void* fns[] = {
      reinterpret_cast<const void*>(&dispatchCopyKernel),
      reinterpret_cast<const void*>(&combineSendKernel),
      reinterpret_cast<const void*>(&combineRecvKernel<kTypeBf16, kTypeBf16>),
      reinterpret_cast<const void*>(&combineRecvKernel<kTypeBf16, kTypeF16>),
      reinterpret_cast<const void*>(&combineRecvKernel<kTypeBf16, kTypeF32>),
      reinterpret_cast<const void*>(&combineRecvKernel<kTypeF16, kTypeBf16>),
      reinterpret_cast<const void*>(&combineRecvKernel<kTypeF16, kTypeF16>),
      reinterpret_cast<const void*>(&combineRecvKernel<kTypeF16, kTypeF32>),
      reinterpret_cast<const void*>(&combineRecvKernel<kTypeF32, kTypeBf16>),
      reinterpret_cast<const void*>(&combineRecvKernel<kTypeF32, kTypeF16>),
      reinterpret_cast<const void*>(&combineRecvKernel<kTypeF32, kTypeF32>),
  };
  for (const void* fn : fns) {
    const cudaError_t rc =
        cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (rc != cudaSuccess) return static_cast<int>(rc);
  }
  return 0;
}

int launchClockProbe(uint64_t* cell, uint32_t n, void* stream) {
  clockProbeKernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(cell, n);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace gpuproxy
}  // namespace epcomm
