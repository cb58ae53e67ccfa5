// Dispatch and combine kernels of the nvlink backend, and the tables that pick a kernel instantiation per call. See
// docs/nvlink.md for the protocol and the measurements behind the choices; nvlink_layout.hpp for the buffer layout.
//
// One translation unit: the .cuh parts hold the device code by concern (nvlink_wait: flags and bounded waits;
// nvlink_rows: the receivers' row tables; nvlink_routing: the dispatch's send half; nvlink_dispatch: its expansion, the
// fused dispatch and the dispatch kernel; nvlink_combine: the combine kernel) and are compiled here together, without
// relocatable device code, so the compiler sees every kernel's callees at once and inlines as for a single file.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "backends/nvlink/nvlink_combine.cuh"
#include "backends/nvlink/nvlink_dispatch.cuh"
#include "backends/nvlink/nvlink_kernels.hpp"

namespace epcomm {
namespace nvlink {

namespace {

template <bool kSend, bool kRecv, typename YT, typename OT>
const void* combineFn() {
  return reinterpret_cast<const void*>(combineKernel<kSend, kRecv, YT, OT>);
}

template <bool kSend, bool kRecv, typename YT>
const void* combineFnOut(int outType) {
  switch (outType) {
    case kTypeBf16:
      return combineFn<kSend, kRecv, YT, __nv_bfloat16>();
    case kTypeF16:
      return combineFn<kSend, kRecv, YT, __half>();
    default:
      return combineFn<kSend, kRecv, YT, float>();
  }
}

// A kernel with the send half for expertY's type YT: the fused one (and outTokens' type) or the send-only one.
template <bool kRecv, typename YT>
const void* combineFnSend(int outType) {
  if constexpr (kRecv) {
    return combineFnOut<true, true, YT>(outType);
  } else {
    return combineFn<true, false, YT, float>();
  }
}

// The partials between the halves are fp32 (combineSendBody), so the send-only kernel depends on expertY's type
// alone, the receive-only kernel on outTokens' alone, and the fused kernel on both.
template <bool kSend, bool kRecv>
const void* combineFnMode(int yType, int outType) {
  if constexpr (!kSend) {
    return combineFnOut<false, true, float>(outType);
  } else {
    switch (yType) {
      case kTypeBf16:
        return combineFnSend<kRecv, __nv_bfloat16>(outType);
      case kTypeF16:
        return combineFnSend<kRecv, __half>(outType);
      default:
        return combineFnSend<kRecv, float>(outType);
    }
  }
}

template <bool kCast>
const void* dispatchFnSend(bool doRecv, int kind) {
  if (doRecv) {
    switch (kind) {
      case kFusedPush:
        return reinterpret_cast<const void*>(dispatchKernel<true, true, kFusedPush, kCast>);
      case kFusedPull:
        return reinterpret_cast<const void*>(dispatchKernel<true, true, kFusedPull, kCast>);
      default:
        return reinterpret_cast<const void*>(dispatchKernel<true, true, kFusedAny, kCast>);
    }
  }
  return reinterpret_cast<const void*>(dispatchKernel<true, false, kFusedAny, kCast>);
}

// The dispatch kernel for these halves; `kind`: the fused kernel's mode (FusedKind, fusedDispatchKind); `cast`: a
// kernel whose send half casts (Config::dispatchCast; the receive half is the same either way).
const void* dispatchFnFor(bool doSend, bool doRecv, int kind = kFusedAny, bool cast = false) {
  if (!doSend) return reinterpret_cast<const void*>(dispatchKernel<false, true>);
  return cast ? dispatchFnSend<true>(doRecv, kind) : dispatchFnSend<false>(doRecv, kind);
}

// The combine kernel for these halves and element types.
const void* combineFnFor(bool doSend, bool doRecv, int yType, int outType) {
  return doSend && doRecv ? combineFnMode<true, true>(yType, outType)
         : doSend         ? combineFnMode<true, false>(yType, outType)
                          : combineFnMode<false, true>(yType, outType);
}

}  // namespace

KernelLaunch dispatchLaunch(const DispatchKernelArgs& args, bool doSend, bool doRecv) {
  return KernelLaunch{
      dispatchFnFor(doSend, doRecv, doSend && doRecv ? fusedDispatchKind(args.g) : kFusedAny, args.cast != 0),
      args.g.blocks, args.g.threads, sharedBytes(args.g)};
}

KernelLaunch combineLaunch(const CombineKernelArgs& args, bool doSend, bool doRecv, int yType, int outType) {
  return KernelLaunch{combineFnFor(doSend, doRecv, yType, outType), args.g.blocks, args.g.threads, sharedBytes(args.g)};
}

int launchKernel(const KernelLaunch& l, const void* args, void* stream) {
  void* params[] = {const_cast<void*>(args)};
  return static_cast<int>(
      cudaLaunchKernel(l.fn, dim3(l.blocks), dim3(l.threads), params, l.smemBytes, static_cast<cudaStream_t>(stream)));
}

int configureKernels(uint32_t bytes) {
  if (bytes <= 48 * 1024) return 0;
  // Every kernel the launch selectors can return (a combine half that does not run ignores its type: set more than
  // once).
  constexpr bool kHalves[3][2] = {{true, true}, {true, false}, {false, true}};
  auto raise = [bytes](const void* fn) {
    return cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  };
  for (const auto& h : kHalves) {
    cudaError_t e = cudaSuccess;
    for (bool cast : {false, true}) {
      if (e == cudaSuccess) e = raise(dispatchFnFor(h[0], h[1], kFusedAny, cast));
      for (int kind = kFusedPush; kind <= kFusedPull && e == cudaSuccess && h[0] && h[1]; ++kind) {
        e = raise(dispatchFnFor(true, true, kind, cast));
      }
    }
    for (int yt = kTypeBf16; yt <= kTypeF32 && e == cudaSuccess; ++yt) {
      for (int ot = kTypeBf16; ot <= kTypeF32 && e == cudaSuccess; ++ot) e = raise(combineFnFor(h[0], h[1], yt, ot));
    }
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  return 0;
}

}  // namespace nvlink
}  // namespace epcomm
