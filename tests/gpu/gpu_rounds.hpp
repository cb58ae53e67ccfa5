// Helpers of the GPU tests that keep one set of processes for many objects and rounds (lifetime, churn, soak, faults):
// a round's calls in each mode (and one such round checked), a round captured into a CUDA graph and replayed, bare
// 0-row views for an empty rank, the process's resources, and which GPU backends can run here with the environment
// each needs. Builds on gpu_harness.hpp (scenarios, device tensors, the reference check).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "epcomm/all_to_all.hpp"
#include "gpu_harness.hpp"
#include "support/process_usage.hpp"

namespace epcomm {
namespace gputest {

/// How a rank makes a round's calls: dispatch then combine (kFused); each as its send half, a kernel of ours (a memset
/// of the scratch buffer) and its receive half (kSplit); kSplit on the odd ranks and kFused on the others (kMixed).
enum class CallMode { kFused, kSplit, kMixed };
const char* callModeName(CallMode mode);

/// A non-blocking CUDA stream, destroyed with the owner.
class Stream {
 public:
  Stream();
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

/// Launches one round of `rank` on `stream` with `dev`'s arguments (the current round's, see Round::upload) in `mode`;
/// `scratch` takes the memsets between split halves. Does not wait.
void launchRound(AllToAll& a2a, DeviceTensors& dev, CallMode mode, uint32_t rank, cudaStream_t stream,
                 DeviceBuffer& scratch);

/// Waits for `stream`, then for the object (which rethrows a recorded error). Throws Error.
void finishRound(AllToAll& a2a, cudaStream_t stream);

/// One round of `s` with inputs `seed` through `dev` (Round::upload, launchRound in `mode`, finishRound), checked
/// against the reference: "" or what differed. Throws Error when a call fails.
std::string checkedRound(AllToAll& a2a, const Scenario& s, uint32_t rank, DeviceTensors& dev, CallMode mode,
                         cudaStream_t stream, DeviceBuffer& scratch, uint64_t seed);

/// After Round::upload: when this rank has no tokens this round (m = 0), replaces the 0-row views of its calls by bare
/// ones, as numpy and torch hand them over (null data pointer, zero strides). Returns whether it did.
bool makeEmptyViewsBare(DeviceTensors& dev);

/// This rank's token count in the uploaded round (the first dimension of its dispatch's x).
int64_t tokensOf(const DeviceTensors& dev);

/// One round's calls (launchRound) captured on `stream` into a CUDA graph, instantiated. Replays take the contents of
/// the same tensors, so a scenario replayed must not be ragged (m is part of the captured calls; the token count
/// varies through a device boundM). Destroys the graph and its executable with the owner, which may outlive the object
/// (it must not be replayed after the object is gone).
class CapturedRound {
 public:
  CapturedRound(AllToAll& a2a, DeviceTensors& dev, CallMode mode, uint32_t rank, cudaStream_t stream,
                DeviceBuffer& scratch);
  ~CapturedRound();
  CapturedRound(const CapturedRound&) = delete;
  CapturedRound& operator=(const CapturedRound&) = delete;
  /// Launches the graph on `stream`. Throws Error(kCuda).
  void replay(cudaStream_t stream);

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

/// What this process holds (test::ProcessUsage: open file descriptors, threads, malloc's bytes in use), and the
/// device's free memory (cudaMemGetInfo: device-wide, so ranks sharing a GPU read it at a point where none of them
/// allocates).
struct Usage : test::ProcessUsage {
  int64_t gpuFreeBytes = 0;
};
Usage usage();

/// The device's free memory once it stops changing (two equal readings 100 ms apart, at most `maxMs`): a process that
/// died a moment ago may still be giving its memory back.
int64_t settledGpuFreeBytes(int maxMs = 3000);

/// The GPU backends of this build, in the order nvlink, proxy, nvshmem.
std::vector<std::string> gpuBackendsBuilt();

/// "" when `backend` can run here, else why not: not built, no GPU, or (proxy) no usable libfabric provider. Never
/// initialises CUDA or libfabric in the calling process (forked probes).
std::string whyNotRunnable(const std::string& backend);

/// The libfabric provider the proxy backend's tests use: GPU_TEST_PROXY_PROVIDER, else shm when usable, else tcp.
std::string proxyProvider();

/// The environment a backend needs here, set (where the caller has not set it) before the ranks fork and restored
/// afterwards: proxy: every peer over the libfabric provider (EPCOMM_FABRIC_PROVIDER, EPCOMM_PROXY_LOCAL_SIZE = 1);
/// nvshmem: NVLink/P2P only, no NVLS, the unique-ID rendezvous over loopback.
class BackendEnv {
 public:
  explicit BackendEnv(const std::string& backend, const std::string& provider = "");
  ~BackendEnv();
  BackendEnv(const BackendEnv&) = delete;
  BackendEnv& operator=(const BackendEnv&) = delete;

 private:
  std::vector<std::pair<std::string, std::string>> saved_;  // name, old value ("\x01" = unset)
};

/// A scenario the backend's own tests would build: nvlink checks the combine against one final rounding of an fp32
/// sum (as tests/gpu/nvlink_test.cc does), the others against the dtypes' tolerance.
Scenario scenarioFor(const std::string& backend, uint32_t world);

}  // namespace gputest
}  // namespace epcomm
