#include "bench.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <vector>

#include "bench_cuda.hpp"
#include "epcomm/all_to_all.hpp"
#include "epcomm/error.hpp"
#include "epcomm/plan.hpp"
#include "inputs.hpp"

namespace epcomm {
namespace bench {

// A backend that fails on some ranks only (before its own collectives) would leave the ranks calling different
// collectives next; here every rank learns who failed and why, and all of them skip the configuration together.
std::unique_ptr<AllToAll> createOnAll(const Config& c, Bootstrap& bs, const std::string& backend, std::string* whyNot) {
  std::unique_ptr<AllToAll> a2a;
  std::string err;
  try {
    a2a = createAllToAll(c, bs, backend);
  } catch (const Error& e) {
    err = e.what();
  }
  constexpr size_t kMsg = 480;
  std::vector<char> mine(kMsg, 0), all(kMsg * static_cast<size_t>(bs.worldSize()));
  std::strncpy(mine.data(), err.c_str(), kMsg - 1);
  try {
    bs.allGather(mine.data(), all.data(), kMsg);
  } catch (const Error& e) {
    // The ranks no longer call the same collectives (one failed inside the backend's setup while the others went on).
    if (err.empty()) throw;
    EPCOMM_THROW(kBootstrap, "rank " << bs.rank() << " could not create the " << backend << " backend (" << err
                                     << ") while other ranks went on: " << e.what());
  }
  for (int r = 0; r < bs.worldSize(); ++r) {
    const char* msg = all.data() + kMsg * static_cast<size_t>(r);
    if (*msg != '\0') {
      *whyNot = "rank " + std::to_string(r) + ": " + msg;
      return nullptr;
    }
  }
  return a2a;
}

namespace {

// The device the backends use: EPCOMM_LOCAL_RANK when set (the launcher sets rank % GPUs), else rank % GPUs.
int pickDevice(int rank, int count) {
  const char* local = std::getenv("EPCOMM_LOCAL_RANK");
  const int dev = local != nullptr && *local != '\0' && std::atoi(local) >= 0 ? std::atoi(local) : rank % count;
  EPCOMM_CHECK(dev < count, kUnavailable,
               "rank " << rank << ": EPCOMM_LOCAL_RANK = " << dev << " but this process sees " << count << " GPUs");
  return dev;
}

}  // namespace

Bench::~Bench() {
  nccl_.reset();
  timer_.reset();
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void Bench::phase(const std::string& name, uint32_t tokens, const char* what) const {
  if (std::getenv("EPBENCH_TRACE") != nullptr)
    std::fprintf(stderr, "[rank %d] %s T=%u: %s\n", rank_, name.c_str(), tokens, what);
}

void Bench::setUpGpu() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    EPCOMM_CHECK(o_.backend == "auto", kUnavailable, "rank " << rank_ << ": no CUDA device for backend " << o_.backend);
    return;  // auto without a GPU: the host backend
  }
  gpu_ = true;
  device_ = pickDevice(rank_, count);
  BENCH_CUDA(cudaSetDevice(device_));
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, device_));
  gpuName_ = prop.name;
  gpus_ = distinctGpus(bs_, device_);
  sharedGpu_ = gpus_ < world_;
  nccl_ = std::make_unique<NcclBaseline>(bs_, sharedGpu_);
}

void Bench::run() {
  rank_ = bs_.rank();
  world_ = bs_.worldSize();
  if (o_.backend != "host") setUpGpu();
  if (!gpu_) applyHostDefaults(o_);
  char host[128] = {0};
  gethostname(host, sizeof(host) - 1);
  machine_ = std::string(host) + (gpu_ ? " " + std::to_string(gpus_) + "x " + gpuName_ : " (cpu)");
  timer_ = std::make_unique<Timer>(bs_, gpu_, stream_, o_.barrier, timeoutMsFromEnv());
  if (rank_ == 0) {
    report_ = std::make_unique<Report>(o_, world_, gpu_, sharedGpu_, machine_, timer_->barrierName());
    std::vector<std::string> notes;
    if (sharedGpu_) {
      notes.push_back(
          "ranks share a GPU: the times are protocol costs, not link times (without CUDA MPS the "
          "ranks' contexts take turns on the GPU)");
    }
    if (gpu_ && !nccl_->available()) notes.push_back("nccl: not measured, " + nccl_->whyNot());
    if (!gpu_) {
      notes.push_back(
          "host: no NCCL; the baselines are a2a.d and a2a.c: a dense all-to-all of the dispatch's and of the "
          "combine's bytes (one write with immediate to every peer, wait for every peer's) over the same fabric "
          "provider; vs.a2a = (dispatch + combine) / (a2a.d + a2a.c)");
    }
    report_->header(notes);
  }
  for (const Skew& s : timer_->measureSkew(200)) {
    if (report_) report_->skew(s);
  }
  if (o_.floor && gpu_) measureFloor();
  for (const std::string& name : o_.configs) {
    for (uint32_t T : o_.tokens) {
      if (o_.fp8.empty()) {
        runOne(name, T);
      } else {
        runFp8Cast(name, T);
      }
    }
  }
  if (report_) report_->finish();
}

bool Bench::hostFits(const std::string& name, const Config& c) {
  const uint64_t T = c.maxNumTokens, K = c.expertsPerToken, S = c.hiddenDimScaleBytes / 4;
  // The inputs (x and its staging copy, scales, indices, weights), then what the planner lists: the outputs and the
  // backend's registered buffers.
  uint64_t perRank = 2 * T * c.hiddenDimBytes + T * S * 4 + 2 * T * K * 4;
  try {
    for (const PlannedBuffer& b : planBuffers(c, "host")) perRank += b.bytes;
  } catch (const Error&) {
    // createAllToAll reports the configuration's error itself.
  }
  uint64_t availKb = 0;
  if (std::ifstream meminfo("/proc/meminfo"); meminfo) {
    std::string key, unit;
    uint64_t value = 0;
    while (meminfo >> key >> value >> unit) {
      if (key == "MemAvailable:") {
        availKb = value;
        break;
      }
    }
  }
  // 85%: the launcher, the fabric and the page cache need some too. Rank 0 decides (MemAvailable differs between
  // reads), everybody follows.
  int fits = availKb == 0 || perRank * world_ <= availKb * 1024 / 100 * 85;
  bs_.broadcast(&fits, sizeof(fits), 0);
  if (!fits && rank_ == 0) {
    const double gib = 1024.0 * 1024.0 * 1024.0;
    std::fprintf(stderr,
                 "skip %s T=%u: the host backend needs about %.1f GiB per rank x %d ranks, more than 85%% of the "
                 "%.1f GiB this machine has available\n",
                 name.c_str(), c.maxNumTokens, perRank / gib, world_, availKb * 1024.0 / gib);
  }
  return fits != 0;
}

void Bench::runOne(const std::string& name, uint32_t T) {
  Config c = standardConfig(name, world_, rank_, o_.dp);
  c.maxNumTokens = std::max(T, o_.maxTokens);
  c.layout = o_.layout;
  if (!gpu_ && !hostFits(name, c)) return;
  std::string whyNot;
  std::unique_ptr<AllToAll> a2a = createOnAll(c, bs_, o_.backend, &whyNot);
  if (a2a == nullptr) {
    if (rank_ == 0) std::cerr << "skip " << name << " T=" << T << ": " << whyNot << "\n";
    return;
  }
  const std::string backend = a2a->backendName();
  EPCOMM_CHECK(
      !gpu_ || backend != "host", kInvalidArgument,
      "backend auto chose host on this GPU machine; run with --backend host (CPU tensors) or name a GPU backend");
  Inputs in(c, T, gpu_, stream_);
  const DispatchArgs& d = in.dispatch;
  const CombineArgs& cb = in.combine;
  const int iters = o_.iters, warm = o_.warmup;
  Timer& tm = *timer_;

  Measurement eager, graph;
  // Combine must follow a dispatch on the object: dispatch and combine alternate, each timed on its own.
  std::vector<std::vector<double>> s, h;
  phase(name, T, "eager");
  tm.interleaved({[&] { a2a->dispatch(d); }, [&] { a2a->combine(cb); }}, iters, warm, false, &s, &h);
  eager.dRanks = tm.perRank(s[0]);
  eager.cRanks = tm.perRank(s[1]);
  eager.dispatch = *std::max_element(eager.dRanks.begin(), eager.dRanks.end());
  eager.combine = *std::max_element(eager.cRanks.begin(), eager.cRanks.end());
  if (gpu_) {
    eager.dHostRanks = tm.perRank(h[0]);
    eager.dHost = *std::max_element(eager.dHostRanks.begin(), eager.dHostRanks.end());
    eager.cHost = tm.agree(h[1]);
    phase(name, T, "device-only");
    tm.interleaved({[&] { a2a->dispatch(d); }, [&] { a2a->combine(cb); }}, iters, warm, true, &s);
    eager.dDev = tm.agree(s[0]);
    eager.cDev = tm.agree(s[1]);
  }
  // Send and receive halves separately.
  DispatchArgs dsend = d, drecv = d;
  dsend.doRecv = false;
  drecv.doSend = false;
  CombineArgs csend = cb, crecv = cb;
  csend.doRecv = false;
  crecv.doSend = false;
  phase(name, T, "split");
  tm.interleaved({[&] { a2a->dispatch(dsend); }, [&] { a2a->dispatch(drecv); }, [&] { a2a->combine(csend); },
                  [&] { a2a->combine(crecv); }},
                 iters, warm, false, &s);
  eager.dSend = tm.agree(s[0]);
  eager.dRecv = tm.agree(s[1]);
  eager.cSend = tm.agree(s[2]);
  eager.cRecv = tm.agree(s[3]);

  // The dispatch's bytes: per peer the tokens with at least one expert there (pplx: one copy per expert there). The
  // combine's: per peer one row of expertY's dtype per (token, expert) pair of the peer's group routed here.
  const std::vector<uint64_t> perPeer = in.bytesPerPeer(c, false), perPeerPplx = in.bytesPerPeer(c, true);
  const std::vector<uint64_t> perPeerCombine = in.combineBytesPerPeer(c, dtypeSize(cb.expertY.dtype));
  if (gpu_) {
    phase(name, T, "nccl");
    eager.nccl = nccl_->time(tm, stream_, perPeer, iters, warm);
    eager.ncclPplx = nccl_->time(tm, stream_, perPeerPplx, iters, warm);
    // CUDA graph: dispatch and combine captured separately, each replayed.
    cudaGraph_t gd, gc;
    cudaGraphExec_t xd, xc;
    BENCH_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    a2a->dispatch(d);
    BENCH_CUDA(cudaStreamEndCapture(stream_, &gd));
    BENCH_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    a2a->combine(cb);
    BENCH_CUDA(cudaStreamEndCapture(stream_, &gc));
    BENCH_CUDA(cudaGraphInstantiate(&xd, gd, 0));
    BENCH_CUDA(cudaGraphInstantiate(&xc, gc, 0));
    const std::vector<std::function<void()>> replay = {[&] { BENCH_CUDA(cudaGraphLaunch(xd, stream_)); },
                                                       [&] { BENCH_CUDA(cudaGraphLaunch(xc, stream_)); }};
    phase(name, T, "graph");
    tm.interleaved(replay, iters, warm, false, &s);
    graph.dispatch = tm.agree(s[0]);
    graph.combine = tm.agree(s[1]);
    tm.interleaved(replay, iters, warm, true, &s);
    graph.dDev = tm.agree(s[0]);
    graph.cDev = tm.agree(s[1]);
    graph.nccl = eager.nccl;
    graph.ncclPplx = eager.ncclPplx;
    cudaGraphExecDestroy(xd);
    cudaGraphExecDestroy(xc);
    cudaGraphDestroy(gd);
    cudaGraphDestroy(gc);
  }
  // Backends built on a fabric (host, proxy): the dense all-to-all of each half's bytes over the same provider.
  TransferStats st = transferStats(*a2a);
  std::string provider;
  if (st.available) {
    const std::string label = name + " T=" + std::to_string(T);
    phase(name, T, "fabric a2a of the dispatch's bytes");
    eager.a2aDispatch = fabricA2aTime(bs_, tm, perPeer, label + " dispatch bytes", iters, warm, &provider);
    phase(name, T, "fabric a2a of the combine's bytes");
    eager.a2aCombine = fabricA2aTime(bs_, tm, perPeerCombine, label + " combine bytes", iters, warm, &provider);
    graph.a2aDispatch = eager.a2aDispatch;
    graph.a2aCombine = eager.a2aCombine;
    if (rank_ == 0 && !provider.empty() && provider != st.provider) {
      std::fprintf(stderr, "note %s T=%u: the a2a baseline runs on provider %s, the %s backend on %s\n", name.c_str(),
                   T, provider.c_str(), backend.c_str(), st.provider.c_str());
    }
  }
  a2a->synchronize();
  st = transferStats(*a2a);

  // Bytes crossing between ranks per direction, averaged over ranks (for GB/s).
  uint64_t mine[2] = {0, 0}, bytesPplx = 0;  // this rank's dispatch and combine bytes
  for (int p = 0; p < world_; ++p) {
    mine[0] += perPeer[p];
    mine[1] += perPeerCombine[p];
    bytesPplx += perPeerPplx[p];
  }
  std::vector<uint64_t> all(2 * static_cast<size_t>(world_));
  bs_.allGather(mine, all.data(), sizeof(mine));
  double sum[2] = {0, 0};
  for (int r = 0; r < world_; ++r) {
    sum[0] += static_cast<double>(all[2 * r]);
    sum[1] += static_cast<double>(all[2 * r + 1]);
  }
  if (report_) {
    RowInfo r{backend, name, c, T, false, sum[0] / world_, bytesPplx, sum[1] / world_, mine[1], a2a->bufferBytes(),
              provider};
    report_->row(r, eager);
    if (gpu_) {
      r.graph = true;
      report_->row(r, graph);
    }
    if (st.available) report_->fabricOps(backend, name, T, st);
  }
  a2a.reset();
}

}  // namespace bench
}  // namespace epcomm
