#include "timing.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>

#include "bench_cuda.hpp"
#include "kernels.hpp"

namespace epcomm {
namespace bench {

namespace {
double nowUs() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

double median(std::vector<double> v) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

Timer::Timer(Bootstrap& bootstrap, bool gpu, cudaStream_t stream, const std::string& barrier, int64_t timeoutMs)
    : bs_(bootstrap), gpu_(gpu), stream_(stream), barrierName_("tcp") {
  // The shared-memory barrier needs every rank on this host.
  char host[64] = {0};
  gethostname(host, sizeof(host) - 1);
  const int world = bs_.worldSize();
  std::vector<char> all(64 * static_cast<size_t>(world));
  bs_.allGather(host, all.data(), 64);
  bool oneNode = true;
  for (int r = 0; r < world; ++r) oneNode = oneNode && std::strncmp(all.data() + 64 * r, host, 64) == 0;
  if (oneNode) {
    char name[64];
    std::snprintf(name, sizeof(name), "/epbench-%d-%ld", static_cast<int>(getpid()),
                  static_cast<long>(std::time(nullptr)));
    bs_.broadcast(name, sizeof(name), 0);
    shm_ = std::make_unique<ShmBarrier>(bs_, name, timeoutMs);
    if (barrier == "shm") barrierName_ = "shm";
  }
  if (gpu_) {
    BENCH_CUDA(cudaEventCreate(&e0_));
    BENCH_CUDA(cudaEventCreate(&e1_));
  }
}

Timer::~Timer() {
  if (e0_ != nullptr) cudaEventDestroy(e0_);
  if (e1_ != nullptr) cudaEventDestroy(e1_);
}

void Timer::barrier() {
  if (barrierName_ == "shm") {
    shm_->wait();
  } else {
    bs_.barrier();
  }
}

std::vector<double> Timer::samples(const std::function<void()>& fn, int iters, int warmup, bool spinFirst,
                                   const std::function<void()>& after) {
  return run(fn, iters, warmup, spinFirst, after, gpu_);
}

std::vector<double> Timer::hostClockSamples(const std::function<void()>& fn, int iters, int warmup,
                                            const std::function<void()>& after) {
  return run(fn, iters, warmup, false, after, false);
}

std::vector<double> Timer::run(const std::function<void()>& fn, int iters, int warmup, bool spinFirst,
                               const std::function<void()>& after, bool events) {
  std::vector<double> us;
  hostUs_.clear();
  for (int i = 0; i < warmup + iters; ++i) {
    if (gpu_) BENCH_CUDA(cudaDeviceSynchronize());
    barrier();
    double t;
    if (!events) {
      const double a = nowUs();
      fn();
      t = nowUs() - a;
    } else {
      if (spinFirst) epcommBenchSpin(stream_, 20000);
      BENCH_CUDA(cudaEventRecord(e0_, stream_));
      const double h0 = nowUs();
      fn();
      const double host = nowUs() - h0;
      BENCH_CUDA(cudaEventRecord(e1_, stream_));
      if (i >= warmup) hostUs_.push_back(host);
      BENCH_CUDA(cudaEventSynchronize(e1_));
      float ms = 0;
      BENCH_CUDA(cudaEventElapsedTime(&ms, e0_, e1_));
      t = ms * 1000.0;
    }
    if (after) after();
    if (i >= warmup) us.push_back(t);
  }
  return us;
}

void Timer::interleaved(const std::vector<std::function<void()>>& fns, int iters, int warmup, bool spinFirst,
                        std::vector<std::vector<double>>* out, std::vector<std::vector<double>>* hostOut) {
  out->assign(fns.size(), {});
  if (hostOut != nullptr) hostOut->assign(fns.size(), {});
  for (int i = 0; i < warmup + iters; ++i) {
    for (size_t f = 0; f < fns.size(); ++f) {
      const std::vector<double> s = samples(fns[f], 1, 0, spinFirst);
      if (i < warmup) continue;
      (*out)[f].push_back(s[0]);
      if (hostOut != nullptr && !hostUs_.empty()) (*hostOut)[f].push_back(hostUs_[0]);
    }
  }
}

std::vector<double> Timer::perRank(const std::vector<double>& samples) {
  double mine = median(samples);
  std::vector<double> all(bs_.worldSize());
  bs_.allGather(&mine, all.data(), sizeof(double));
  return all;
}

double Timer::agree(const std::vector<double>& samples) {
  const std::vector<double> all = perRank(samples);
  return *std::max_element(all.begin(), all.end());
}

// After each round every rank reads the steady clock (CLOCK_MONOTONIC: one clock per node); per round the spread
// max - min over ranks.
std::vector<Skew> Timer::measureSkew(int rounds) {
  std::vector<Skew> out;
  const int world = bs_.worldSize();
  for (const char* kind : {"tcp", "shm"}) {
    const bool shm = std::strcmp(kind, "shm") == 0;
    if (shm && shm_ == nullptr) continue;
    std::vector<double> t(rounds);
    for (int i = 0; i < rounds; ++i) {
      if (shm) {
        shm_->wait();
      } else {
        bs_.barrier();
      }
      t[i] = nowUs();
    }
    std::vector<double> all(static_cast<size_t>(rounds) * world);
    bs_.allGather(t.data(), all.data(), rounds * sizeof(double));
    std::vector<double> spread(rounds);
    for (int i = 0; i < rounds; ++i) {
      double lo = all[i], hi = all[i];
      for (int r = 1; r < world; ++r) {
        lo = std::min(lo, all[static_cast<size_t>(r) * rounds + i]);
        hi = std::max(hi, all[static_cast<size_t>(r) * rounds + i]);
      }
      spread[i] = hi - lo;
    }
    std::sort(spread.begin(), spread.end());
    out.push_back({kind, spread[rounds / 2], spread[rounds * 9 / 10], rounds});
  }
  return out;
}

}  // namespace bench
}  // namespace epcomm
