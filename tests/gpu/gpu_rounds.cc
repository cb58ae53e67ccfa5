#include "gpu_rounds.hpp"

#include <chrono>
#include <cstdlib>
#include <thread>

#include "core/cuda_check.hpp"
#include "epcomm/error.hpp"
#include "support/fabric_probe.hpp"

namespace epcomm {
namespace gputest {

namespace {

bool splits(CallMode mode, uint32_t rank) { return mode == CallMode::kSplit || (mode == CallMode::kMixed && rank % 2); }

}  // namespace

const char* callModeName(CallMode mode) {
  switch (mode) {
    case CallMode::kFused:
      return "fused";
    case CallMode::kSplit:
      return "split";
    default:
      return "mixed";
  }
}

Stream::Stream() { EPCOMM_CHECK_CUDA(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }

Stream::~Stream() {
  if (s_ != nullptr) cudaStreamDestroy(s_);
}

void launchRound(AllToAll& a2a, DeviceTensors& dev, CallMode mode, uint32_t rank, cudaStream_t stream,
                 DeviceBuffer& scratch) {
  dev.dispatch.stream = stream;
  dev.combine.stream = stream;
  if (!splits(mode, rank)) {
    a2a.dispatch(dev.dispatch);
    a2a.combine(dev.combine);
    return;
  }
  // Between the halves the caller's own work runs on the same stream.
  const auto [send, recv] = halves(dev.dispatch);
  a2a.dispatch(send);
  EPCOMM_CHECK_CUDA(cudaMemsetAsync(scratch.get(), 0x11, scratch.bytes(), stream));
  a2a.dispatch(recv);
  const auto [csend, crecv] = halves(dev.combine);
  a2a.combine(csend);
  EPCOMM_CHECK_CUDA(cudaMemsetAsync(scratch.get(), 0x22, scratch.bytes(), stream));
  a2a.combine(crecv);
}

void finishRound(AllToAll& a2a, cudaStream_t stream) {
  EPCOMM_CHECK_CUDA(cudaStreamSynchronize(stream));
  a2a.synchronize();
}

std::string checkedRound(AllToAll& a2a, const Scenario& s, uint32_t rank, DeviceTensors& dev, CallMode mode,
                         cudaStream_t stream, DeviceBuffer& scratch, uint64_t seed) {
  Round r(s, seed);
  r.upload(rank, dev);
  launchRound(a2a, dev, mode, rank, stream, scratch);
  finishRound(a2a, stream);
  return r.check(rank, dev);
}

int64_t tokensOf(const DeviceTensors& dev) { return dev.dispatch.x.shape[0]; }

bool makeEmptyViewsBare(DeviceTensors& dev) {
  if (tokensOf(dev) != 0) return false;
  auto bare = [](TensorView& v) {
    if (!v.defined()) return;
    v.data = nullptr;
    for (int64_t& s : v.strides) s = 0;
  };
  bare(dev.dispatch.x);
  bare(dev.dispatch.xScale);
  bare(dev.dispatch.indices);
  bare(dev.combine.indices);
  bare(dev.combine.weights);
  bare(dev.combine.outTokens);
  return true;
}

CapturedRound::CapturedRound(AllToAll& a2a, DeviceTensors& dev, CallMode mode, uint32_t rank, cudaStream_t stream,
                             DeviceBuffer& scratch) {
  EPCOMM_CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    launchRound(a2a, dev, mode, rank, stream, scratch);
  } catch (...) {
    cudaGraph_t g = nullptr;
    if (cudaStreamEndCapture(stream, &g) == cudaSuccess && g != nullptr) cudaGraphDestroy(g);
    cudaGetLastError();
    throw;
  }
  EPCOMM_CHECK_CUDA(cudaStreamEndCapture(stream, &graph_));
  EPCOMM_CHECK_CUDA(cudaGraphInstantiate(&exec_, graph_, 0));
}

CapturedRound::~CapturedRound() {
  if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  if (graph_ != nullptr) cudaGraphDestroy(graph_);
}

void CapturedRound::replay(cudaStream_t stream) { EPCOMM_CHECK_CUDA(cudaGraphLaunch(exec_, stream)); }

Usage usage() {
  Usage u;
  u.fds = test::openFds();
  u.threads = test::threadCount();
  u.heapBytes = test::heapInUse();
  size_t freeB = 0, totalB = 0;
  EPCOMM_CHECK_CUDA(cudaMemGetInfo(&freeB, &totalB));
  u.gpuFreeBytes = static_cast<int64_t>(freeB);
  return u;
}

int64_t settledGpuFreeBytes(int maxMs) {
  int64_t last = usage().gpuFreeBytes;
  for (int waited = 0; waited < maxMs; waited += 100) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const int64_t now = usage().gpuFreeBytes;
    if (now == last) return now;
    last = now;
  }
  return last;
}

std::vector<std::string> gpuBackendsBuilt() {
  std::vector<std::string> out;
  const std::vector<std::string> built = builtBackends();
  for (const char* b : {"nvlink", "proxy", "nvshmem"}) {
    for (const std::string& x : built) {
      if (x == b) out.push_back(b);
    }
  }
  return out;
}

std::string proxyProvider() {
  const char* p = std::getenv("GPU_TEST_PROXY_PROVIDER");
  if (p != nullptr && *p != '\0') return p;
  return test::providerAvailable("shm") ? "shm" : "tcp";
}

std::string whyNotRunnable(const std::string& backend) {
  bool built = false;
  for (const std::string& b : gpuBackendsBuilt()) built = built || b == backend;
  if (!built) return "the " + backend + " backend is not built";
  if (gpuCount() == 0) return "no CUDA device";
  if (backend == "proxy" && !test::providerAvailable(proxyProvider())) {
    return "libfabric provider '" + proxyProvider() + "' is not usable here";
  }
  return "";
}

BackendEnv::BackendEnv(const std::string& backend, const std::string& provider) {
  std::vector<std::pair<const char*, std::string>> want;
  if (backend == "proxy") {
    want = {{"EPCOMM_FABRIC_PROVIDER", provider.empty() ? proxyProvider() : provider},
            {"EPCOMM_PROXY_LOCAL_SIZE", "1"}};
  } else if (backend == "nvshmem") {
    want = {{"NVSHMEM_REMOTE_TRANSPORT", "none"},
            {"NVSHMEM_DISABLE_NVLS", "1"},
            {"NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo"}};
  }
  for (const auto& [name, value] : want) {
    const char* old = std::getenv(name);
    if (old != nullptr && *old != '\0' && std::string(name) != "EPCOMM_FABRIC_PROVIDER") continue;
    saved_.emplace_back(name, old != nullptr ? std::string(old) : std::string("\x01"));
    setenv(name, value.c_str(), 1);
  }
}

BackendEnv::~BackendEnv() {
  for (const auto& [name, old] : saved_) {
    if (old == "\x01") {
      unsetenv(name.c_str());
    } else {
      setenv(name.c_str(), old.c_str(), 1);
    }
  }
}

Scenario scenarioFor(const std::string& backend, uint32_t world) {
  Scenario s;
  s.world = world;
  s.experts = 16 % world == 0 ? 16 : 4 * world;
  s.oneRounding = backend == "nvlink";
  return s;
}

}  // namespace gputest
}  // namespace epcomm
