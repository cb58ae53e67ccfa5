// The baselines epcomm-bench prints beside each backend's times: NCCL's all-to-all of the dispatch's bytes (GPU
// backends), and a dense all-to-all over the TransferEngine of the dispatch's and of the combine's bytes (backends
// built on a fabric: host, proxy; the host rows have no other, as NCCL needs GPUs).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "epcomm/bootstrap.hpp"
#include "timing.hpp"

namespace epcomm {
namespace bench {

/// Collective: how many distinct GPUs (host and device UUID) the ranks of `bootstrap` run on; fewer than the ranks
/// when some share a GPU.
int distinctGpus(Bootstrap& bootstrap, int device);

/// NCCL's all-to-all (grouped send/recv) over all ranks. Unavailable, with the reason, when the benchmark was built
/// without NCCL, when two ranks share a GPU (NCCL refuses duplicate GPUs), or when a rank could not initialise.
class NcclBaseline {
 public:
  /// Collective. `sharedGpu`: some ranks share a GPU (distinctGpus() < ranks; every rank passes the same).
  NcclBaseline(Bootstrap& bootstrap, bool sharedGpu);
  ~NcclBaseline();
  NcclBaseline(const NcclBaseline&) = delete;
  NcclBaseline& operator=(const NcclBaseline&) = delete;

  bool available() const { return comm_ != nullptr; }
  /// Why the baseline is unavailable ("" when it is available).
  const std::string& whyNot() const { return whyNot_; }

  /// Times (Timer::samples, then agree) one all-to-all in which this rank sends sendBytes[p] bytes to rank p and
  /// receives what every peer sends it. -1 when unavailable. Collective.
  double time(Timer& timer, cudaStream_t stream, const std::vector<uint64_t>& sendBytes, int iters, int warmup);

 private:
  Bootstrap& bs_;
  void* comm_ = nullptr;  // ncclComm_t
  std::string whyNot_;
};

/// The dense all-to-all of `sendBytes` (bytes to each peer) over a TransferEngine created for this call (provider:
/// EPCOMM_FABRIC_PROVIDER, else the probe order, as the host and proxy backends choose theirs), timed like dispatch:
/// barrier, steady clock, median, maximum over ranks. *provider receives the engine's provider. -1 when the benchmark
/// was built without a TransferEngine. `label` names the configuration in errors. Collective.
double fabricA2aTime(Bootstrap& bootstrap, Timer& timer, const std::vector<uint64_t>& sendBytes,
                     const std::string& label, int iters, int warmup, std::string* provider);

}  // namespace bench
}  // namespace epcomm
