// The timing method of epcomm-bench and its statistics: before every sample a device synchronize and a barrier
// of all ranks, then CUDA events right around the call (from an idle GPU, so the launch is included) or, for the
// host backend, a steady clock. A sample set becomes one number as the median per rank, then the maximum over ranks.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "epcomm/bootstrap.hpp"
#include "shm_barrier.hpp"

namespace epcomm {
namespace bench {

/// Median of `v` (-1 when empty).
double median(std::vector<double> v);

/// Exit skew of a barrier between ranks: per round the spread of the ranks' exit times, median and p90.
struct Skew {
  std::string barrier;  ///< "shm" or "tcp"
  double medianUs = -1, p90Us = -1;
  int rounds = 0;
};

/// One rank's timer. Every method that takes samples or agrees on a number is collective: all ranks call it in the
/// same order.
class Timer {
 public:
  /// `gpu`: time with CUDA events on `stream`; else with a steady clock. `barrier`: "shm" (the shared-memory spin
  /// barrier, when every rank runs on this host) or "tcp" (the bootstrap's). Collective.
  Timer(Bootstrap& bootstrap, bool gpu, cudaStream_t stream, const std::string& barrier, int64_t timeoutMs);
  ~Timer();
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  /// The barrier the samples use: "shm" or "tcp" (shm falls back to tcp when the ranks span hosts).
  const std::string& barrierName() const { return barrierName_; }
  void barrier();

  /// Samples of `fn`, iters after warmup: device synchronize + barrier, then the timed call. `spinFirst` queues a
  /// ~20 us GPU spin before the first event, so the launch is hidden ("device-only" samples). `after` runs untimed
  /// after each sample. With events, hostUs() then holds the host time spent inside `fn` per kept sample.
  std::vector<double> samples(const std::function<void()>& fn, int iters, int warmup, bool spinFirst = false,
                              const std::function<void()>& after = {});
  const std::vector<double>& hostUs() const { return hostUs_; }
  /// As samples(), on the steady clock whatever the backend (for work that never touches the GPU).
  std::vector<double> hostClockSamples(const std::function<void()>& fn, int iters, int warmup,
                                       const std::function<void()>& after = {});

  /// Calls fns[0], fns[1], ... in turn, iters + warmup times, one sample each (e.g. dispatch then combine, which
  /// must follow it); out[i] receives fns[i]'s kept samples and, when hostOut is given, (*hostOut)[i] the host time
  /// inside it.
  void interleaved(const std::vector<std::function<void()>>& fns, int iters, int warmup, bool spinFirst,
                   std::vector<std::vector<double>>* out, std::vector<std::vector<double>>* hostOut = nullptr);

  /// Every rank's median of its samples, by rank.
  std::vector<double> perRank(const std::vector<double>& samples);
  /// The maximum over ranks of each rank's median.
  double agree(const std::vector<double>& samples);

  /// Exit skew of the tcp barrier and (when used) of the shm barrier, `rounds` rounds each.
  std::vector<Skew> measureSkew(int rounds);

 private:
  std::vector<double> run(const std::function<void()>& fn, int iters, int warmup, bool spinFirst,
                          const std::function<void()>& after, bool events);

  Bootstrap& bs_;
  bool gpu_;
  cudaStream_t stream_;
  std::unique_ptr<ShmBarrier> shm_;
  std::string barrierName_;
  std::vector<double> hostUs_;
  cudaEvent_t e0_ = nullptr, e1_ = nullptr;
};

}  // namespace bench
}  // namespace epcomm
