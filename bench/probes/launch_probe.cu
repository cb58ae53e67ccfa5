// launch-probe: what each way of launching one kernel costs when timed the benchmark's way (one GPU).
//
//   launch-probe [iters]
//
// The kernel has the decode dispatch's shape (66 blocks of 512 threads on an H200: half the SMs, 448 bytes of
// parameters, 34 KB of dynamic shared memory) and does nothing. For each launch path it prints the medians of
//   eager:  device synchronize, event, launch, event (from an idle GPU, so the host's launch call is inside),
//   host:   the host time of the launch call alone,
//   device: as eager with a 20 us GPU spin queued before the first event (the launch call hidden).
// Paths: cudaLaunchKernel, cudaLaunchKernelEx, cuLaunchKernel (argument pointers, and one argument buffer),
// cudaGraphLaunch and cuGraphLaunch of a one-node graph. Also the same rows for an empty 1-block kernel and for
// nothing between the events. Never asserts a time: exits 77 without a GPU.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "kernels.hpp"
#include "probe_check.hpp"

namespace {

struct Params {
  uint64_t words[56];  // 448 bytes, the dispatch kernel's argument block
};

__global__ void emptyParams(const Params) {}
__global__ void emptyBare() {}

struct Row {
  double eager, host, device;
};

// Times `launch` as the benchmark does; returns false on a CUDA error (printed).
bool timeLaunch(const std::function<cudaError_t()>& launch, cudaStream_t s, int iters, Row& row) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<double> eager, host, device;
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = 0; i < iters + 20; ++i) {
      cudaDeviceSynchronize();
      if (pass == 1) epcommBenchSpin(s, 20000);
      cudaEventRecord(e0, s);
      const auto h0 = std::chrono::steady_clock::now();
      const cudaError_t e = launch();
      const double h = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count();
      cudaEventRecord(e1, s);
      cudaEventSynchronize(e1);
      if (e != cudaSuccess) {
        std::fprintf(stderr, "launch-probe: launch failed: %s\n", cudaGetErrorString(e));
        return false;
      }
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      if (i < 20) continue;
      (pass == 0 ? eager : device).push_back(ms * 1e3);
      if (pass == 0) host.push_back(h);
    }
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  row = Row{probe::median(eager), probe::median(host), probe::median(device)};
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 500;
  if (const int skip = probe::oneGpu("launch-probe")) return skip;
  int sms = 0;
  PROBE_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int blocks = std::max(1, sms / 2);
  const unsigned smem = 34u << 10;
  cudaStream_t s;
  PROBE_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Params params{};
  void* args[] = {&params};

  CUfunction fn = nullptr;
  PROBE_CHECK(cudaGetFuncBySymbol(reinterpret_cast<cudaFunction_t*>(&fn), reinterpret_cast<const void*>(&emptyParams)));
  size_t bufBytes = sizeof(Params);
  void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &params, CU_LAUNCH_PARAM_BUFFER_SIZE, &bufBytes,
                   CU_LAUNCH_PARAM_END};

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  PROBE_CHECK(cudaGraphCreate(&graph, 0));
  cudaKernelNodeParams kp{};
  kp.func = reinterpret_cast<void*>(&emptyParams);
  kp.gridDim = dim3(blocks);
  kp.blockDim = dim3(512);
  kp.sharedMemBytes = smem;
  kp.kernelParams = args;
  cudaGraphNode_t node;
  PROBE_CHECK(cudaGraphAddKernelNode(&node, graph, nullptr, 0, &kp));
  PROBE_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  PROBE_CHECK(cudaGraphUpload(exec, s));

  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(512);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;

  struct Path {
    const char* name;
    std::function<cudaError_t()> launch;
  };
  const CUstream cs = reinterpret_cast<CUstream>(s);
  std::vector<Path> paths = {
      {"nothing between the events", [] { return cudaSuccess; }},
      {"<<<1, 32>>> bare",
       [&] {
         emptyBare<<<1, 32, 0, s>>>();
         return cudaGetLastError();
       }},
      {"<<<>>> bare, dispatch grid",
       [&] {
         emptyBare<<<blocks, 512, 0, s>>>();
         return cudaGetLastError();
       }},
      {"cudaLaunchKernel",
       [&] {
         return cudaLaunchKernel(reinterpret_cast<const void*>(&emptyParams), dim3(blocks), dim3(512), args, smem, s);
       }},
      {"cudaLaunchKernelEx", [&] { return cudaLaunchKernelEx(&cfg, emptyParams, params); }},
      {"cuLaunchKernel (argument pointers)",
       [&] { return static_cast<cudaError_t>(cuLaunchKernel(fn, blocks, 1, 1, 512, 1, 1, smem, cs, args, nullptr)); }},
      {"cuLaunchKernel (one argument buffer)",
       [&] { return static_cast<cudaError_t>(cuLaunchKernel(fn, blocks, 1, 1, 512, 1, 1, smem, cs, nullptr, extra)); }},
      {"cudaGraphLaunch (one node)", [&] { return cudaGraphLaunch(exec, s); }},
      {"cuGraphLaunch (one node)",
       [&] { return static_cast<cudaError_t>(cuGraphLaunch(reinterpret_cast<CUgraphExec>(exec), cs)); }},
  };
  std::printf("# launch-probe: %d blocks x 512 threads, %zu B of parameters, %u KB of shared memory; medians of %d\n",
              blocks, sizeof(Params), smem >> 10, iters);
  std::printf("%-40s %10s %10s %10s\n", "path", "eager us", "host us", "device us");
  for (const Path& p : paths) {
    Row r{};
    if (!timeLaunch(p.launch, s, iters, r)) return 2;
    std::printf("%-40s %10.2f %10.2f %10.2f\n", p.name, r.eager, r.host, r.device);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  return 0;
}
