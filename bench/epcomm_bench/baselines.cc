#include "baselines.hpp"

#include <unistd.h>

#include <cstring>
#include <sstream>

#include "bench_cuda.hpp"
#include "epcomm/error.hpp"
#include "options.hpp"

#ifdef EPBENCH_HAVE_NCCL
#include <nccl.h>
#endif
#ifdef EPBENCH_HAVE_FABRIC
#include "fabric_baseline.hpp"
#endif

namespace epcomm {
namespace bench {

int distinctGpus(Bootstrap& bootstrap, int device) {
  struct Where {
    char host[64];
    char uuid[16];
  } mine{};
  gethostname(mine.host, sizeof(mine.host) - 1);
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, device));
  std::memcpy(mine.uuid, &prop.uuid, sizeof(mine.uuid));
  std::vector<Where> all(bootstrap.worldSize());
  bootstrap.allGather(&mine, all.data(), sizeof(Where));
  int distinct = 0;
  for (size_t a = 0; a < all.size(); ++a) {
    bool seen = false;
    for (size_t b = 0; b < a && !seen; ++b) seen = std::memcmp(&all[a], &all[b], sizeof(Where)) == 0;
    distinct += seen ? 0 : 1;
  }
  return distinct;
}

NcclBaseline::NcclBaseline(Bootstrap& bootstrap, bool sharedGpu) : bs_(bootstrap) {
#ifdef EPBENCH_HAVE_NCCL
  if (sharedGpu) {
    whyNot_ = "ranks share a GPU, which NCCL refuses";
    return;
  }
  ncclUniqueId id;
  if (bs_.rank() == 0) ncclGetUniqueId(&id);
  bs_.broadcast(&id, sizeof(id), 0);
  ncclComm_t comm = nullptr;
  const ncclResult_t rc = ncclCommInitRank(&comm, bs_.worldSize(), id, bs_.rank());
  // Every rank must agree, or the ranks' later collectives would differ.
  int ok = rc == ncclSuccess ? 1 : 0;
  std::vector<int> oks(bs_.worldSize());
  bs_.allGather(&ok, oks.data(), sizeof(int));
  for (int r = 0; r < bs_.worldSize(); ++r) {
    if (oks[r] == 0 && whyNot_.empty()) whyNot_ = "ncclCommInitRank failed on rank " + std::to_string(r);
  }
  if (!whyNot_.empty()) {
    if (comm != nullptr) ncclCommDestroy(comm);
    if (rc != ncclSuccess) whyNot_ += std::string(" (") + ncclGetErrorString(rc) + ")";
    return;
  }
  comm_ = comm;
#else
  (void)sharedGpu;
  whyNot_ = "epcomm-bench was built without NCCL";
#endif
}

NcclBaseline::~NcclBaseline() {
#ifdef EPBENCH_HAVE_NCCL
  if (comm_ != nullptr) ncclCommDestroy(static_cast<ncclComm_t>(comm_));
#endif
}

double NcclBaseline::time(Timer& timer, cudaStream_t stream, const std::vector<uint64_t>& sendBytes, int iters,
                          int warmup) {
#ifdef EPBENCH_HAVE_NCCL
  if (comm_ == nullptr) return -1;
  const int world = bs_.worldSize(), rank = bs_.rank();
  ncclComm_t comm = static_cast<ncclComm_t>(comm_);
  // Receive sizes: what each peer sends to us.
  std::vector<uint64_t> all(static_cast<size_t>(world) * world);
  bs_.allGather(sendBytes.data(), all.data(), world * sizeof(uint64_t));
  uint64_t sendTotal = 0, recvTotal = 0;
  for (int p = 0; p < world; ++p) {
    sendTotal += sendBytes[p];
    recvTotal += all[static_cast<size_t>(p) * world + rank];
  }
  void *sb = nullptr, *rb = nullptr;
  BENCH_CUDA(cudaMalloc(&sb, sendTotal + 256));
  BENCH_CUDA(cudaMalloc(&rb, recvTotal + 256));
  auto fn = [&] {
    ncclGroupStart();
    uint64_t so = 0, ro = 0;
    for (int p = 0; p < world; ++p) {
      if (p == rank) continue;
      const uint64_t s = sendBytes[p], r = all[static_cast<size_t>(p) * world + rank];
      if (s) ncclSend(static_cast<char*>(sb) + so, s, ncclUint8, p, comm, stream);
      if (r) ncclRecv(static_cast<char*>(rb) + ro, r, ncclUint8, p, comm, stream);
      so += s;
      ro += r;
    }
    const ncclResult_t rc = ncclGroupEnd();
    EPCOMM_CHECK(rc == ncclSuccess, kCuda, "NCCL all-to-all failed on rank " << rank << ": " << ncclGetErrorString(rc));
  };
  const double t = timer.agree(timer.samples(fn, iters, warmup));
  cudaFree(sb);
  cudaFree(rb);
  return t;
#else
  (void)timer;
  (void)stream;
  (void)sendBytes;
  (void)iters;
  (void)warmup;
  return -1;
#endif
}

double fabricA2aTime(Bootstrap& bootstrap, Timer& timer, const std::vector<uint64_t>& sendBytes,
                     const std::string& label, int iters, int warmup, std::string* provider) {
#ifdef EPBENCH_HAVE_FABRIC
  FabricA2aBaseline base(bootstrap, sendBytes, timeoutMsFromEnv(), label);
  *provider = base.providerName();
  // Timed: post, then every peer's data has arrived; the local completions of the writes (their sources may be
  // reused) are awaited after the clock stops, as dispatch leaves its own to the proxy thread. agree() gathers after
  // every rank's last round completed, so the engines may go away after it.
  return timer.agree(timer.hostClockSamples([&] { base.run(); }, iters, warmup, [&] { base.drain(); }));
#else
  (void)bootstrap;
  (void)timer;
  (void)sendBytes;
  (void)label;
  (void)iters;
  (void)warmup;
  provider->clear();
  return -1;
#endif
}

}  // namespace bench
}  // namespace epcomm
