// One rank of epcomm-bench: creates each configuration's AllToAll through the public factory (so every backend is
// measured alike), times dispatch and combine eager, device-only, split into halves and as CUDA graphs, times the
// baselines on the same bytes, and hands rank 0's numbers to the Report.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "baselines.hpp"
#include "epcomm/all_to_all.hpp"
#include "epcomm/bootstrap.hpp"
#include "options.hpp"
#include "report.hpp"
#include "timing.hpp"

namespace epcomm {
namespace bench {

/// Collective: creates the object on every rank, or on none (then *whyNot names the first rank that failed and why).
std::unique_ptr<AllToAll> createOnAll(const Config& c, Bootstrap& bs, const std::string& backend, std::string* whyNot);

class Bench {
 public:
  Bench(const Options& o, Bootstrap& bootstrap) : o_(o), bs_(bootstrap) {}
  ~Bench();
  Bench(const Bench&) = delete;
  Bench& operator=(const Bench&) = delete;

  /// Every configuration x token count of the options. Collective; throws on a failure of this rank.
  void run();

 private:
  void setUpGpu();
  void runOne(const std::string& name, uint32_t tokens);
  /// --fp8: the dispatch of bf16 tokens that arrive as fp8 + scales, cast by the dispatch (fused) and / or by a cast
  /// kernel before an fp8 dispatch (separate), on the same tokens, with a check that both give the same bits
  /// (fp8_bench.cc).
  void runFp8Cast(const std::string& name, uint32_t tokens);
  /// The method's floor (--floor): an empty kernel, and a one-flag exchange between ranks (floor.cc).
  void measureFloor();
  /// Host backend: whether all ranks' tensors and buffers fit in this machine's memory (rank 0 decides).
  bool hostFits(const std::string& name, const Config& c);
  void phase(const std::string& name, uint32_t tokens, const char* what) const;

  Options o_;
  Bootstrap& bs_;
  int rank_ = 0, world_ = 1;
  bool gpu_ = false;        // GPU tensors and CUDA-event timing (every backend but host)
  bool sharedGpu_ = false;  // two ranks run on one GPU
  int gpus_ = 0;            // distinct GPUs of the job
  int device_ = -1;
  std::string gpuName_, machine_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<Timer> timer_;
  std::unique_ptr<NcclBaseline> nccl_;
  std::unique_ptr<Report> report_;  // rank 0 only
};

}  // namespace bench
}  // namespace epcomm
