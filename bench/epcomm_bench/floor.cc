// epcomm-bench --floor: what any dispatch or combine costs at least when timed this way.
#include <algorithm>
#include <vector>

#include "bench.hpp"
#include "bench_cuda.hpp"
#include "kernels.hpp"

namespace epcomm {
namespace bench {

// An empty kernel, and a kernel whose block 0 stores a flag into the next rank and waits for the previous rank's
// (one flag each way between GPUs), eager and device-only, with as many blocks as the nvlink backend launches for
// decode (half the SMs' worth of 512-thread blocks).
void Bench::measureFloor() {
  constexpr size_t kBytes = 256;
  uint64_t* flags = nullptr;
  BENCH_CUDA(cudaMalloc(&flags, kBytes));
  BENCH_CUDA(cudaMemset(flags, 0, kBytes));
  cudaIpcMemHandle_t mine;
  BENCH_CUDA(cudaIpcGetMemHandle(&mine, flags));
  std::vector<cudaIpcMemHandle_t> all(world_);
  bs_.allGather(&mine, all.data(), sizeof(mine));
  const int next = (rank_ + 1) % world_;
  void* nextFlags = flags;
  if (next != rank_) BENCH_CUDA(cudaIpcOpenMemHandle(&nextFlags, all[next], cudaIpcMemLazyEnablePeerAccess));
  int sms = 0;
  BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
  const int blocks = std::max(1, sms / 2);
  Timer& tm = *timer_;
  uint64_t round = 0;
  auto ping = [&] { epcommBenchFlagPing(stream_, blocks, static_cast<uint64_t*>(nextFlags), flags, ++round); };
  const double empty = tm.agree(tm.samples([&] { epcommBenchEmpty(stream_, blocks); }, o_.iters, o_.warmup));
  const double emptyHost = tm.agree(tm.hostUs());  // host time of the launch call itself
  // The same empty launch with 512 bytes of parameters and 34 KB of dynamic shared memory (decode's dispatch: ~440
  // bytes of arguments, ~34 KB of routing tables): what the launch itself adds for a kernel of that shape.
  constexpr unsigned kLikeSmem = 34u << 10;
  const double emptyLike =
      tm.agree(tm.samples([&] { epcommBenchEmptyLike(stream_, blocks, kLikeSmem); }, o_.iters, o_.warmup));
  const double flag = tm.agree(tm.samples(ping, o_.iters, o_.warmup));
  const double flagDevice = tm.agree(tm.samples(ping, o_.iters, o_.warmup, true));
  BENCH_CUDA(cudaDeviceSynchronize());
  tm.barrier();
  if (next != rank_) BENCH_CUDA(cudaIpcCloseMemHandle(nextFlags));
  tm.barrier();
  BENCH_CUDA(cudaFree(flags));
  if (report_) report_->floor(blocks, empty, emptyHost, emptyLike, kLikeSmem >> 10, flag, flagDevice);
}

}  // namespace bench
}  // namespace epcomm
