// epcomm-bench: dispatch / combine latency and bandwidth of any backend, beside NCCL's all-to-all of the same bytes.
//
//   epcomm-bench [--backend nvlink|host|auto] [--world W] [--config decode,prefill,small,qwen3]
//                [--tokens 1,8,32,128,512,4096] [--iters 200] [--warmup 20] [--dp 1] [--json out.jsonl]
//                [--barrier shm|tcp] [--floor]
//
// Starts W processes itself (fork + exec of this binary with EPCOMM_RANK / EPCOMM_WORLD_SIZE / EPCOMM_BOOTSTRAP /
// EPCOMM_LOCAL_RANK), one per GPU. Timing (the issue's method, so numbers compare with the peers measured there):
// before every iteration a device synchronize and a barrier, then CUDA events right around the call (from an idle
// GPU, so the launch is included). The barrier is a shared-memory spin barrier (ranks leave within ~1 us of each
// other; --barrier tcp uses the bootstrap's, which leaves tens of us of skew that every receive wait absorbs); the
// NCCL baseline is timed the same way. The exit skew of both barriers is measured and printed first. "device" rows
// queue a ~20 us GPU spin before the first event so the launch is hidden. Medians over --iters iterations after
// --warmup, the maximum over ranks. Never asserts a time.
//
// --backend host (or auto without a GPU): W = 4 CPU processes, its own defaults (applyHostDefaults), configurations
// that would not fit in the machine's memory are skipped with the numbers, the JSON lines go to stdout after the table,
// and the fabric operations per peer per round follow each row. A failing rank's message is printed by the launcher.
// Without NCCL the baseline of the host rows is the "a2a" column (JSON fabric_a2a_us; nccl_us stays null): the
// dispatch's bytes as one write with immediate to every peer over the same fabric provider (fabric_baseline.hpp),
// on an engine created once per configuration, timed like dispatch (barrier, steady clock, median, max over ranks).
#include <arpa/inet.h>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifdef EPCOMM_BENCH_HAVE_NCCL
#include <nccl.h>
#endif

#include "core/env.hpp"
#include "epcomm/all_to_all.hpp"
#include "epcomm/bootstrap.hpp"
#include "epcomm/error.hpp"
#include "fill.hpp"
#include "reference/reference.hpp"
#include "shm_barrier.hpp"
#include "spin.hpp"
#ifdef EPCOMM_HAVE_HOST_BACKEND
#include "backends/host/host_all_to_all.hpp"
#include "fabric_baseline.hpp"
#endif

namespace epcomm {
namespace {

#define BENCH_CUDA(expr)                                                                 \
  do {                                                                                   \
    cudaError_t e_ = (expr);                                                             \
    if (e_ != cudaSuccess) EPCOMM_THROW(kCuda, #expr << ": " << cudaGetErrorString(e_)); \
  } while (0)

struct Options {
  std::string backend = "auto";
  int world = 0;
  std::vector<std::string> configs = {"decode", "prefill", "small", "qwen3"};
  std::vector<uint32_t> tokens = {1, 8, 32, 128, 512, 4096};
  int iters = 200;
  int warmup = 20;
  int dp = 1;
  std::string json;
  std::string rev;
  std::string barrier = "shm";
  bool floor = false;      // --floor: also time an empty launch and a one-flag exchange (the method's floor)
  uint32_t maxTokens = 0;  // --max-tokens: the object's capacity (maxNumTokens) when above T, as engines size it
  Layout layout = Layout::kBatched;  // --layout: of outExpertX / expertY (the standard configurations' default)
  // Given on the command line (else the host backend substitutes its own defaults, see applyHostDefaults).
  bool configsSet = false, tokensSet = false, itersSet = false, warmupSet = false;
};

// The host backend runs every rank as CPU processes (4 by default, often on fewer cores): the GPU set (4 configs
// up to 4096 tokens, 200 iterations) would take many minutes, and decode at 4096 tokens needs ~26 GiB per rank
// (expertY alone is L x 16384 x H bf16), which the out-of-memory killer answers with SIGKILL. Prefill (4096 tokens)
// only when named.
void applyHostDefaults(Options& o) {
  if (!o.configsSet) o.configs = {"decode", "small", "qwen3"};
  if (!o.tokensSet) o.tokens = {1, 32, 128};
  if (!o.itersSet) o.iters = 50;
  if (!o.warmupSet) o.warmup = 5;
}

std::vector<std::string> splitList(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      EPCOMM_CHECK(i + 1 < argc, kInvalidArgument, a << " needs a value");
      return argv[++i];
    };
    if (a == "--backend") {
      o.backend = next();
    } else if (a == "--world") {
      o.world = std::stoi(next());
    } else if (a == "--config") {
      o.configs = splitList(next());
      o.configsSet = true;
    } else if (a == "--tokens") {
      o.tokensSet = true;
      o.tokens.clear();
      for (const std::string& t : splitList(next())) o.tokens.push_back(static_cast<uint32_t>(std::stoul(t)));
    } else if (a == "--iters") {
      o.iters = std::stoi(next());
      o.itersSet = true;
    } else if (a == "--warmup") {
      o.warmup = std::stoi(next());
      o.warmupSet = true;
    } else if (a == "--dp") {
      o.dp = std::stoi(next());
    } else if (a == "--json") {
      o.json = next();
    } else if (a == "--rev") {
      o.rev = next();
    } else if (a == "--barrier") {
      o.barrier = next();
      EPCOMM_CHECK(o.barrier == "shm" || o.barrier == "tcp", kInvalidArgument,
                   "--barrier must be shm or tcp, got '" << o.barrier << "'");
    } else if (a == "--floor") {
      o.floor = true;
    } else if (a == "--max-tokens") {
      o.maxTokens = static_cast<uint32_t>(std::stoul(next()));
    } else if (a == "--layout") {
      const std::string l = next();
      EPCOMM_CHECK(l == "batched" || l == "packed", kInvalidArgument,
                   "--layout must be batched or packed, got '" << l << "'");
      o.layout = l == "batched" ? Layout::kBatched : Layout::kPacked;
    } else if (a == "-h" || a == "--help") {
      std::cout << "epcomm-bench [--backend nvlink|host|auto] [--world W] [--config decode,prefill,small,qwen3]\n"
                   "             [--tokens 1,8,32,128,512,4096] [--iters 200] [--warmup 20] [--dp 1]\n"
                   "             [--json out.jsonl] [--rev GIT_REV] [--barrier shm|tcp] [--floor] [--max-tokens N]\n"
                   "             [--layout batched|packed]\n"
                   "  --max-tokens: create each object for max(T, N) tokens (an engine's capacity) and send T\n"
                   "  --layout: outExpertX / expertY as [L, rows per expert, ...] (default) or experts back to back\n"
                   "  --floor: also time, with the same method, an empty kernel and a one-flag exchange between\n"
                   "  ranks (half the SMs' blocks of 512 threads, as the library launches): the floor of the method;\n"
                   "  and one thread's 8 x 16-byte stores into the peer's and into the own memory (in-kernel time);\n"
                   "  the empty kernel's launch call is also timed on the host (eager rows print the host time\n"
                   "  inside the calls as well)\n"
                   "  --backend host (and auto without a GPU): defaults --config decode,small,qwen3 --tokens 1,32,128\n"
                   "  --iters 50 --warmup 5; prefill only when named\n";
      std::exit(0);
    } else {
      EPCOMM_THROW(kInvalidArgument, "unknown argument '" << a << "' (see --help)");
    }
  }
  return o;
}

std::string gitRev(const Options& o) {
  if (!o.rev.empty()) return o.rev;
  if (const char* r = std::getenv("EPBENCH_REV")) return r;
  std::string out;
  if (FILE* p = popen("git rev-parse --short HEAD 2>/dev/null", "r")) {
    char buf[64] = {0};
    if (fgets(buf, sizeof(buf), p) != nullptr) out = buf;
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out.empty() ? "unknown" : out;
}

double median(std::vector<double> v) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// One configuration's tensors on one rank, in device memory (GPU backends) or host memory (host backend).
struct Tensors {
  bool device = true;
  std::vector<void*> owned;
  DispatchArgs d;
  CombineArgs c;
  void* alloc(size_t bytes) {
    void* p = nullptr;
    bytes = bytes < 256 ? 256 : bytes;
    if (device) {
      BENCH_CUDA(cudaMalloc(&p, bytes));
    } else {
      p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
      EPCOMM_CHECK(p != nullptr, kSystem, "out of host memory");
    }
    owned.push_back(p);
    return p;
  }
  void fill(void* dst, const void* src, size_t bytes) {
    if (device) {
      BENCH_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    } else {
      std::memcpy(dst, src, bytes);
    }
  }
  ~Tensors() {
    for (void* p : owned) {
      if (device) {
        cudaFree(p);
      } else {
        std::free(p);
      }
    }
  }
};

struct Measurement {
  double dispatch = -1, combine = -1, dSend = -1, dRecv = -1, cSend = -1, cRecv = -1, dDev = -1, cDev = -1;
  double nccl = -1, ncclPplx = -1;
  double fabricA2a = -1;          // host backend: dense all-to-all of the same bytes over the same fabric provider
  double dHost = -1, cHost = -1;  // eager, GPU: host time spent inside the dispatch / combine call (median)
  // Eager, GPU: each rank's own median of dispatch and of combine, and of the host time inside dispatch (the max over
  // ranks above hides which rank waited: a rank whose kernel starts earlier waits for its peers' data).
  std::vector<double> dRanks, cRanks, dHostRanks;
};

class Bench {
 public:
  Bench(const Options& o, Bootstrap& bs) : o_(o), bs_(bs) {}

  void run() {
    rank_ = bs_.rank();
    world_ = bs_.worldSize();
    hostMode_ = o_.backend == "host";
    if (!hostMode_) {
      int count = 0;
      if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        EPCOMM_CHECK(o_.backend == "auto", kUnavailable, "no CUDA device for backend " << o_.backend);
        hostMode_ = true;
        cudaGetLastError();
      } else {
        BENCH_CUDA(cudaSetDevice(rank_ % count));
        BENCH_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
        cudaDeviceProp prop;
        BENCH_CUDA(cudaGetDeviceProperties(&prop, rank_ % count));
        gpuName_ = prop.name;
        initNccl();
      }
    }
    if (hostMode_) applyHostDefaults(o_);
    char host[128] = {0};
    gethostname(host, sizeof(host) - 1);
    machine_ = std::string(host) + (hostMode_ ? " (cpu)" : " " + std::to_string(world_) + "x " + gpuName_);
    setupBarrier();
    if (rank_ == 0) printHeader();
    measureSkew();
    if (o_.floor && !hostMode_) measureFloor();
    for (const std::string& name : o_.configs) {
      for (uint32_t T : o_.tokens) runOne(name, T);
    }
    if (rank_ == 0 && !hostJson_.empty()) {
      std::printf("# JSON lines (backend=host): one per table row, then the fabric operations per configuration\n");
      for (const std::string& j : hostJson_) {
        if (j.rfind("{\"backend\"", 0) == 0) std::fputs(j.c_str(), stdout);
      }
      for (const std::string& j : hostJson_) {
        if (j.rfind("{\"backend\"", 0) != 0) std::fputs(j.c_str(), stdout);
      }
      std::fflush(stdout);
    }
#ifdef EPCOMM_BENCH_HAVE_NCCL
    if (nccl_ != nullptr) ncclCommDestroy(nccl_);
#endif
  }

 private:
  void initNccl() {
#ifdef EPCOMM_BENCH_HAVE_NCCL
    ncclUniqueId id;
    if (rank_ == 0) ncclGetUniqueId(&id);
    bs_.broadcast(&id, sizeof(id), 0);
    if (ncclCommInitRank(&nccl_, world_, id, rank_) != ncclSuccess) nccl_ = nullptr;
#endif
  }

  // One node (every rank on this host) and --barrier shm: the shared-memory spin barrier, else the bootstrap's.
  void setupBarrier() {
    char host[64] = {0};
    gethostname(host, sizeof(host) - 1);
    std::vector<char> all(64 * static_cast<size_t>(world_));
    bs_.allGather(host, all.data(), 64);
    bool oneNode = true;
    for (int r = 0; r < world_; ++r) oneNode = oneNode && std::strncmp(all.data() + 64 * r, host, 64) == 0;
    if (!oneNode) return;
    char name[64];
    std::snprintf(name, sizeof(name), "/epbench-%d-%ld", static_cast<int>(getpid()),
                  static_cast<long>(std::time(nullptr)));
    bs_.broadcast(name, sizeof(name), 0);
    shm_ = std::make_unique<bench::ShmBarrier>(bs_, name, env().timeoutMs);
  }

  void barrier() {
    if (shm_ != nullptr && o_.barrier == "shm") {
      shm_->wait();
    } else {
      bs_.barrier();
    }
  }

  // Exit skew of each barrier: after each of 200 rounds every rank reads CLOCK_MONOTONIC (one clock per node); per
  // round the spread max - min over ranks; median and p90 printed (and written as one JSON line).
  void measureSkew() {
    const int rounds = 200;
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
        t[i] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
      }
      std::vector<double> all(static_cast<size_t>(rounds) * world_);
      bs_.allGather(t.data(), all.data(), rounds * sizeof(double));
      std::vector<double> spread(rounds);
      for (int i = 0; i < rounds; ++i) {
        double lo = all[i], hi = all[i];
        for (int r = 1; r < world_; ++r) {
          lo = std::min(lo, all[static_cast<size_t>(r) * rounds + i]);
          hi = std::max(hi, all[static_cast<size_t>(r) * rounds + i]);
        }
        spread[i] = hi - lo;
      }
      std::sort(spread.begin(), spread.end());
      const double med = spread[rounds / 2], p90 = spread[rounds * 9 / 10];
      if (rank_ != 0) continue;
      std::printf("# barrier %s: exit skew between ranks median %.1f us, p90 %.1f us (%d rounds)%s\n", kind, med, p90,
                  rounds, o_.barrier == kind ? "  <- used for timing" : "");
      std::fflush(stdout);
      if (o_.json.empty()) continue;
      std::ofstream f(o_.json, std::ios::app);
      f << "{\"bench\":\"epcomm-barrier-skew\",\"barrier\":\"" << kind << "\",\"world\":" << world_
        << ",\"skew_median_us\":" << jnum(med) << ",\"skew_p90_us\":" << jnum(p90) << ",\"rounds\":" << rounds
        << ",\"used\":" << (o_.barrier == kind ? "true" : "false") << ",\"rev\":\"" << gitRev(o_) << "\",\"machine\":\""
        << machine_ << "\"}\n";
    }
  }

  void sync() {
    if (!hostMode_) BENCH_CUDA(cudaDeviceSynchronize());
    barrier();
  }

  // The method's floor: an empty kernel, and a kernel whose block 0 stores a flag into the next rank and waits for
  // the previous rank's (one NVLink flag each way), eager and device-only, as many blocks as the library launches
  // for decode. What any dispatch or combine costs at least when timed this way.
  void measureFloor() {
    // 256 bytes of flags, then the store probe's target area (8 stores 2 KB apart, as the routing pass's pairs at
    // T = 128), then its result words.
    constexpr size_t kProbeOff = 256, kProbeBytes = 64 << 10, kBytes = kProbeOff + kProbeBytes + 64;
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
    int dev = 0, sms = 0;
    BENCH_CUDA(cudaGetDevice(&dev));
    BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const int blocks = std::max(1, sms / 2);
    uint64_t round = 0;
    auto ping = [&] { epcommBenchFlagPing(stream_, blocks, static_cast<uint64_t*>(nextFlags), flags, ++round); };
    const double empty = agree(timeIt([&] { epcommBenchEmpty(stream_, blocks); }, false));
    const double emptyHost = agree(hostUs_);  // host time of the launch call itself
    // The same empty launch with 512 bytes of parameters and 34 KB of dynamic shared memory (decode's dispatch:
    // ~440 bytes of arguments, 33.8 KB of routing tables): what the launch itself adds for a kernel of that shape.
    constexpr unsigned kLikeSmem = 34u << 10;
    const double emptyLike = agree(timeIt([&] { epcommBenchEmptyLike(stream_, blocks, kLikeSmem); }, false));
    const double flag = agree(timeIt(ping, false));
    const double flagDevice = agree(timeIt(ping, true));
    // Store probe: in-kernel time of thread 0's 8 stores (issue) and of the system fence after them, into the next
    // rank's memory and into its own; median over iterations, max over ranks.
    uint64_t* probeOut = reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(flags) + kProbeOff + kProbeBytes);
    auto probe = [&](void* base) {
      std::vector<double> issue, fence;
      for (int i = 0; i < o_.iters; ++i) {
        sync();
        epcommBenchStoreProbe(stream_, blocks, static_cast<char*>(base) + kProbeOff, 8, 2048, probeOut);
        uint64_t ns[2] = {0, 0};
        BENCH_CUDA(cudaMemcpy(ns, probeOut, sizeof(ns), cudaMemcpyDeviceToHost));
        issue.push_back(ns[0] / 1e3);
        fence.push_back(ns[1] / 1e3);
      }
      return std::make_pair(agree(issue), agree(fence));
    };
    const auto peerStores = probe(nextFlags);
    const auto ownStores = probe(flags);
    sync();
    if (next != rank_) BENCH_CUDA(cudaIpcCloseMemHandle(nextFlags));
    barrier();
    BENCH_CUDA(cudaFree(flags));
    if (rank_ != 0) return;
    std::printf(
        "# floor (%d blocks of 512 threads, median, max over ranks): empty kernel %.1f us (launch call %.1f us on the"
        " host; %.1f us with 512 B of"
        " parameters and %u KB of shared memory); one flag each way %.1f us eager, %.1f us device-only\n"
        "# store probe (one thread, 8 x 16 B, 2 KB apart; in-kernel us): into the peer %.2f issue + %.2f fence; into"
        " the own GPU %.2f issue + %.2f fence\n",
        blocks, empty, emptyHost, emptyLike, kLikeSmem >> 10, flag, flagDevice, peerStores.first, peerStores.second,
        ownStores.first, ownStores.second);
    std::fflush(stdout);
    std::ostringstream f;
    f << "{\"bench\":\"epcomm-floor\",\"world\":" << world_ << ",\"blocks\":" << blocks << ",\"empty_us\":" << empty
      << ",\"empty_host_us\":" << emptyHost << ",\"empty_like_us\":" << emptyLike << ",\"flag_us\":" << flag
      << ",\"flag_device_us\":" << flagDevice << ",\"peer_store_issue_us\":" << peerStores.first
      << ",\"peer_store_fence_us\":" << peerStores.second << ",\"own_store_issue_us\":" << ownStores.first
      << ",\"own_store_fence_us\":" << ownStores.second << ",\"iters\":" << o_.iters << ",\"rev\":\"" << gitRev(o_)
      << "\",\"machine\":\"" << machine_ << "\"}\n";
    if (!o_.json.empty()) std::ofstream(o_.json, std::ios::app) << f.str();
  }

  // Times `fn` per iteration: barrier + device sync, then events around the call (or a steady clock on the host).
  // With events, hostUs_ receives the host time spent inside `fn` (from an idle GPU it is part of the event time).
  std::vector<double> timeIt(const std::function<void()>& fn, bool spinFirst, const std::function<void()>& after = {}) {
    std::vector<double> us;
    hostUs_.clear();
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    if (!hostMode_) {
      BENCH_CUDA(cudaEventCreate(&e0));
      BENCH_CUDA(cudaEventCreate(&e1));
    }
    for (int i = 0; i < o_.warmup + o_.iters; ++i) {
      sync();
      double t;
      if (hostMode_) {
        auto a = std::chrono::steady_clock::now();
        fn();
        t = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count();
      } else {
        if (spinFirst) epcommBenchSpin(stream_, 20000);
        BENCH_CUDA(cudaEventRecord(e0, stream_));
        const auto h0 = std::chrono::steady_clock::now();
        fn();
        const double host = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count();
        BENCH_CUDA(cudaEventRecord(e1, stream_));
        if (i >= o_.warmup) hostUs_.push_back(host);
        BENCH_CUDA(cudaEventSynchronize(e1));
        float ms = 0;
        BENCH_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        t = ms * 1000.0;
      }
      if (after) after();
      if (i >= o_.warmup) us.push_back(t);
    }
    if (e0 != nullptr) cudaEventDestroy(e0);
    if (e1 != nullptr) cudaEventDestroy(e1);
    return us;
  }

  // Max over ranks of each rank's median.
  double agree(const std::vector<double>& samples) { return maxOf(perRank(samples)); }
  static double maxOf(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }
  // Every rank's median, by rank.
  std::vector<double> perRank(const std::vector<double>& samples) {
    double mine = median(samples);
    std::vector<double> all(world_);
    bs_.allGather(&mine, all.data(), sizeof(double));
    return all;
  }

  // Host backend: every rank is a process of this machine, so all of them must fit in its memory at once; a
  // configuration that does not is skipped with the numbers (else the out-of-memory killer ends the ranks with
  // SIGKILL, which leaves no message). Rank 0 decides (MemAvailable differs between reads), everybody follows.
  bool hostFits(const std::string& name, const Config& c) {
    const uint64_t T = c.maxNumTokens, K = c.expertsPerToken, H = c.hiddenDim, S = c.hiddenDimScaleBytes / 4;
    const uint64_t rows =
        c.layout == Layout::kBatched ? c.numLocalExperts() * c.batchedRowsPerExpert() : c.expertRows();
    // What runOne allocates: x (and its staging copy), scales, indices, weights, expertY, outExpertX(+scales), out.
    const uint64_t tensors = 2 * T * c.hiddenDimBytes + T * S * 4 + 2 * T * K * 4 + rows * H * 2 +
                             rows * (c.hiddenDimBytes + S * 4) + T * H * 2;
    uint64_t backend = 0;
#ifdef EPCOMM_HAVE_HOST_BACKEND
    try {
      const proxy::ProtocolSizes ps = proxy::computeSizes(c, -1);
      backend = ps.sendBytes + ps.recvBytes + ps.combineSendBytes + ps.combineRecvBytes;
    } catch (const Error&) {
      // createAllToAll reports the configuration's error itself.
    }
#endif
    const uint64_t perRank = tensors + backend;
    uint64_t availKb = 0;
    if (std::ifstream meminfo("/proc/meminfo"); meminfo) {
      std::string key;
      uint64_t value = 0;
      std::string unit;
      while (meminfo >> key >> value >> unit) {
        if (key == "MemAvailable:") {
          availKb = value;
          break;
        }
      }
    }
    // 85%: the launcher, the fabric and the page cache need some too.
    int fits = availKb == 0 || perRank * world_ <= availKb * 1024 / 100 * 85;
    bs_.broadcast(&fits, sizeof(fits), 0);
    if (!fits && rank_ == 0) {
      const double gib = 1024.0 * 1024.0 * 1024.0;
      std::fprintf(stderr,
                   "skip %s T=%u: the host backend needs about %.1f GiB per rank (tensors %.1f GiB, registered "
                   "buffers %.1f GiB) x %d ranks, more than 85%% of the %.1f GiB this machine has available\n",
                   name.c_str(), c.maxNumTokens, perRank / gib, tensors / gib, backend / gib, world_,
                   availKb * 1024.0 / gib);
    }
    return fits != 0;
  }

  void runOne(const std::string& name, uint32_t T) {
    const bool trace = std::getenv("EPBENCH_TRACE") != nullptr;
    auto phase = [&](const char* what) {
      if (trace) std::fprintf(stderr, "[rank %d] %s T=%u: %s\n", rank_, name.c_str(), T, what);
    };
    Config c = standardConfig(name, world_, rank_, o_.dp);
    c.maxNumTokens = std::max(T, o_.maxTokens);
    c.layout = o_.layout;
    if (hostMode_ && !hostFits(name, c)) return;
    std::unique_ptr<AllToAll> a2a;
    try {
      a2a = createAllToAll(c, bs_, o_.backend);
    } catch (const Error& e) {
      if (rank_ == 0) std::cerr << "skip " << name << " T=" << T << ": " << e.what() << "\n";
      return;
    }
    const std::string backend = a2a->backendName();
    Tensors ts;
    ts.device = !hostMode_;
    const MemoryKind mk = hostMode_ ? MemoryKind::kHost : MemoryKind::kCuda;
    int dev = -1;
    if (!hostMode_) BENCH_CUDA(cudaGetDevice(&dev));
    const uint32_t K = c.expertsPerToken, L = c.numLocalExperts(), H = c.hiddenDim, S = c.hiddenDimScaleBytes / 4;
    // Batched: L * R rows in all (expertRows() is the rows of one expert there).
    const int64_t rows =
        static_cast<int64_t>(c.layout == Layout::kBatched ? L * c.batchedRowsPerExpert() : c.expertRows());
    const DType xType = c.hiddenDimBytes == H ? DType::kFp8E4M3 : DType::kBf16;
    const int64_t xCols = c.hiddenDimBytes / dtypeSize(xType);
    // Inputs: one DP group's tokens (identical on its ranks), uniform top-k routing without repeats, fixed seed.
    const uint32_t group = c.dpGroup();
    std::vector<int32_t> idx = reference::randomIndices(c, T, 12345 + group);
    std::mt19937 rng(777 + group);
    std::vector<uint8_t> xh(static_cast<size_t>(T) * c.hiddenDimBytes);
    for (auto& b : xh) b = static_cast<uint8_t>(rng() & 0x7f);
    std::vector<float> sh(static_cast<size_t>(T) * S + 1, 1.0f), wh(static_cast<size_t>(T) * K, 1.0f / K);
    void* x = ts.alloc(xh.size());
    ts.fill(x, xh.data(), xh.size());
    void* xs = S ? ts.alloc(sh.size() * 4) : nullptr;
    if (xs) ts.fill(xs, sh.data(), sh.size() * 4);
    void* ind = ts.alloc(idx.size() * 4);
    ts.fill(ind, idx.data(), idx.size() * 4);
    void* w = ts.alloc(wh.size() * 4);
    ts.fill(w, wh.data(), wh.size() * 4);
    // expertY (prefill: 15 GB) is generated in place, on the GPU or the host, the same values (fill.hpp).
    const uint64_t yElems = static_cast<uint64_t>(rows) * H, ySeed = 999 + group;
    void* y = ts.alloc(yElems * 2);
    if (hostMode_) {
      uint16_t* yp = static_cast<uint16_t*>(y);
      for (uint64_t i = 0; i < yElems; ++i) yp[i] = epcommBenchNearOne(ySeed, i);
    } else {
      epcommBenchFillNearOne(stream_, static_cast<uint16_t*>(y), yElems, ySeed);
      BENCH_CUDA(cudaStreamSynchronize(stream_));
      BENCH_CUDA(cudaGetLastError());
    }
    void* counts = ts.alloc(L * 4);
    void* ox = ts.alloc(static_cast<size_t>(rows) * c.hiddenDimBytes);
    void* os = S ? ts.alloc(static_cast<size_t>(rows) * S * 4) : nullptr;
    void* out = ts.alloc(static_cast<size_t>(T) * H * 2);
    const bool batched = c.layout == Layout::kBatched;
    const int64_t R = static_cast<int64_t>(c.batchedRowsPerExpert());
    auto expert = [&](void* p, DType t, int64_t cols) {
      return batched ? TensorView::contiguous(p, t, {L, R, cols}, mk, dev)
                     : TensorView::contiguous(p, t, {rows, cols}, mk, dev);
    };
    DispatchArgs& d = ts.d;
    d.outExpertNumTokens = TensorView::contiguous(counts, DType::kI32, {L}, mk, dev);
    d.outExpertX = expert(ox, xType, xCols);
    if (S) {
      d.outExpertXScale = expert(os, DType::kF32, S);
      d.xScale = TensorView::contiguous(xs, DType::kF32, {T, S}, mk, dev);
    }
    d.x = TensorView::contiguous(x, xType, {T, xCols}, mk, dev);
    d.indices = TensorView::contiguous(ind, DType::kI32, {T, K}, mk, dev);
    d.stream = stream_;
    CombineArgs& cb = ts.c;
    cb.outTokens = TensorView::contiguous(out, DType::kBf16, {T, H}, mk, dev);
    cb.indices = d.indices;
    cb.weights = TensorView::contiguous(w, DType::kF32, {T, K}, mk, dev);
    cb.expertY = expert(y, DType::kBf16, H);
    cb.stream = stream_;

    Measurement eager, graph;
    auto dispatchOnce = [&] { a2a->dispatch(d); };
    auto combineOnce = [&] { a2a->combine(cb); };
    // Combine must follow a dispatch on the object: pairTimes alternates them and times each separately.
    std::vector<double> dispatchSamples, combineSamples, dispatchHost, combineHost;
    phase("eager");
    pairTimes(dispatchOnce, combineOnce, false, &dispatchSamples, &combineSamples, &dispatchHost, &combineHost);
    eager.dRanks = perRank(dispatchSamples);
    eager.cRanks = perRank(combineSamples);
    eager.dispatch = maxOf(eager.dRanks);
    eager.combine = maxOf(eager.cRanks);
    if (!hostMode_) {
      eager.dHostRanks = perRank(dispatchHost);
      eager.dHost = maxOf(eager.dHostRanks);
      eager.cHost = agree(combineHost);
      phase("device-only");
      pairTimes(dispatchOnce, combineOnce, true, &dispatchSamples, &combineSamples);
      eager.dDev = agree(dispatchSamples);
      eager.cDev = agree(combineSamples);
    }
    // Send and recv halves separately.
    DispatchArgs dsend = d, drecv = d;
    dsend.doRecv = false;
    drecv.doSend = false;
    CombineArgs csend = cb, crecv = cb;
    csend.doRecv = false;
    crecv.doSend = false;
    std::vector<double> a1, a2, a3, a4;
    phase("split");
    quadTimes([&] { a2a->dispatch(dsend); }, [&] { a2a->dispatch(drecv); }, [&] { a2a->combine(csend); },
              [&] { a2a->combine(crecv); }, &a1, &a2, &a3, &a4);
    eager.dSend = agree(a1);
    eager.dRecv = agree(a2);
    eager.cSend = agree(a3);
    eager.cRecv = agree(a4);
    // NCCL all-to-all of the same bytes (per peer: tokens with >= 1 expert there; pplx: one copy per expert).
    uint64_t bytesRank = 0, bytesPplx = 0;
    std::vector<uint64_t> perPeer(world_, 0), perPeerPplx(world_, 0);
    const uint64_t tokBytes = c.hiddenDimBytes + c.hiddenDimScaleBytes;
    for (uint32_t t = 0; t < T; ++t) {
      if (t % c.dpSize != rank_ % c.dpSize) continue;
      uint32_t mask = 0;
      for (uint32_t k = 0; k < K; ++k) {
        const uint32_t owner = static_cast<uint32_t>(idx[t * K + k]) / L;
        mask |= 1u << owner;
        if (owner != static_cast<uint32_t>(rank_)) perPeerPplx[owner] += tokBytes;
      }
      for (int p = 0; p < world_; ++p) {
        if (p != rank_ && (mask >> p & 1)) perPeer[p] += tokBytes;
      }
    }
    for (int p = 0; p < world_; ++p) {
      bytesRank += perPeer[p];
      bytesPplx += perPeerPplx[p];
    }
    if (!hostMode_) {
      phase("nccl");
      eager.nccl = ncclTime(perPeer);
      eager.ncclPplx = ncclTime(perPeerPplx);
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
      auto gdo = [&] { BENCH_CUDA(cudaGraphLaunch(xd, stream_)); };
      auto gco = [&] { BENCH_CUDA(cudaGraphLaunch(xc, stream_)); };
      phase("graph");
      pairTimes(gdo, gco, false, &dispatchSamples, &combineSamples);
      graph.dispatch = agree(dispatchSamples);
      graph.combine = agree(combineSamples);
      pairTimes(gdo, gco, true, &dispatchSamples, &combineSamples);
      graph.dDev = agree(dispatchSamples);
      graph.cDev = agree(combineSamples);
      graph.nccl = eager.nccl;
      graph.ncclPplx = eager.ncclPplx;
      cudaGraphExecDestroy(xd);
      cudaGraphExecDestroy(xc);
      cudaGraphDestroy(gd);
      cudaGraphDestroy(gc);
    } else {
      // No NCCL without GPUs: the baseline is the same bytes as one write per peer over the same fabric provider.
      phase("fabric a2a");
      eager.fabricA2a = fabricA2aTime(*a2a, perPeer, name + " T=" + std::to_string(T));
    }
    a2a->synchronize();
    std::string hostOpsLine;
#ifdef EPCOMM_HAVE_HOST_BACKEND
    // Host backend: fabric operations per peer per round, as rank 0 issued them (the protocol's claim: the bulk is
    // one write per peer; 2 writes per peer per round without overflow, 3 with).
    if (auto* h = dynamic_cast<host::HostAllToAll*>(a2a.get())) {
      const host::HostStats st = h->stats();
      double ops[4] = {0, 0, 0, 0}, bytes = 0;
      for (int p = 0; p < world_; ++p) {
        ops[0] += st.peers[p].headWrites;
        ops[1] += st.peers[p].bulkWrites;
        ops[2] += st.peers[p].combineWrites;
        ops[3] += st.peers[p].barrierImms;
        bytes += st.peers[p].bytes;
      }
      const double n = static_cast<double>(std::max<uint64_t>(st.dispatchRounds, 1)) * std::max(world_ - 1, 1);
      if (rank_ == 0) {
        char line[512];
        std::snprintf(line, sizeof(line),
                      "# host fabric ops per peer per round (%s, %llu rounds, private area %u tokens): head %.2f, "
                      "bulk %.2f, combine %.2f, barrier %.2f, writes %.2f, bytes %.0f\n",
                      name.c_str(), static_cast<unsigned long long>(st.dispatchRounds), h->sizes().privateTokens,
                      ops[0] / n, ops[1] / n, ops[2] / n, ops[3] / n, (ops[0] + ops[1] + ops[2]) / n, bytes / n);
        hostOpsLine = line;
        std::snprintf(line, sizeof(line),
                      "{\"bench\":\"epcomm-fabric-ops\",\"backend\":\"host\",\"config\":\"%s\",\"world\":%d,"
                      "\"tokens\":%u,\"private_tokens\":%u,\"head_writes_per_peer_round\":%.3f,"
                      "\"bulk_writes_per_peer_round\":%.3f,\"combine_writes_per_peer_round\":%.3f,"
                      "\"barrier_imms_per_peer_round\":%.3f,\"writes_per_peer_round\":%.3f,"
                      "\"bytes_per_peer_round\":%.0f}\n",
                      name.c_str(), world_, T, h->sizes().privateTokens, ops[0] / n, ops[1] / n, ops[2] / n, ops[3] / n,
                      (ops[0] + ops[1] + ops[2]) / n, bytes / n);
        hostJson_.push_back(line);
        if (!o_.json.empty()) std::ofstream(o_.json, std::ios::app) << line;
      }
    }
#endif
    // Bytes crossing NVLink per direction, averaged over ranks (for GB/s).
    uint64_t sumBytes = 0;
    {
      std::vector<uint64_t> all(world_);
      bs_.allGather(&bytesRank, all.data(), sizeof(uint64_t));
      for (uint64_t b : all) sumBytes += b;
    }
    const double avgBytes = static_cast<double>(sumBytes) / world_;
    uint64_t combineBytes = 0;
    for (int p = 0; p < world_; ++p) combineBytes += perPeer[p] / tokBytes * H * 2;
    if (rank_ == 0) {
      report(backend, name, c, T, false, eager, avgBytes, bytesPplx, combineBytes, a2a->bufferBytes());
      if (!hostMode_) report(backend, name, c, T, true, graph, avgBytes, bytesPplx, combineBytes, a2a->bufferBytes());
      if (!hostOpsLine.empty()) std::cout << hostOpsLine << std::flush;
    }
    a2a.reset();
  }

  // Alternating dispatch / combine, each timed separately (combine needs the dispatch before it).
  void pairTimes(const std::function<void()>& dfn, const std::function<void()>& cfn, bool spin, std::vector<double>* ds,
                 std::vector<double>* cs, std::vector<double>* dHost = nullptr, std::vector<double>* cHost = nullptr) {
    ds->clear();
    cs->clear();
    const int iters = o_.iters, warm = o_.warmup;
    Options saved = o_;
    o_.iters = 1;
    o_.warmup = 0;
    for (int i = 0; i < warm + iters; ++i) {
      std::vector<double> a = timeIt(dfn, spin);
      const double ah = hostUs_.empty() ? -1 : hostUs_[0];
      std::vector<double> b = timeIt(cfn, spin);
      const double bh = hostUs_.empty() ? -1 : hostUs_[0];
      if (i >= warm) {
        ds->push_back(a[0]);
        cs->push_back(b[0]);
        if (dHost != nullptr && ah >= 0) dHost->push_back(ah);
        if (cHost != nullptr && bh >= 0) cHost->push_back(bh);
      }
    }
    o_ = saved;
  }

  void quadTimes(const std::function<void()>& f1, const std::function<void()>& f2, const std::function<void()>& f3,
                 const std::function<void()>& f4, std::vector<double>* r1, std::vector<double>* r2,
                 std::vector<double>* r3, std::vector<double>* r4) {
    const int iters = o_.iters, warm = o_.warmup;
    Options saved = o_;
    o_.iters = 1;
    o_.warmup = 0;
    for (int i = 0; i < warm + iters; ++i) {
      std::vector<double> a = timeIt(f1, false), b = timeIt(f2, false), c = timeIt(f3, false), d = timeIt(f4, false);
      if (i >= warm) {
        r1->push_back(a[0]);
        r2->push_back(b[0]);
        r3->push_back(c[0]);
        r4->push_back(d[0]);
      }
    }
    o_ = saved;
  }

  double ncclTime(const std::vector<uint64_t>& perPeer) {
#ifdef EPCOMM_BENCH_HAVE_NCCL
    if (nccl_ == nullptr) return -1;
    // Receive sizes: what each peer sends to us.
    std::vector<uint64_t> all(static_cast<size_t>(world_) * world_);
    bs_.allGather(perPeer.data(), all.data(), world_ * sizeof(uint64_t));
    uint64_t sendTotal = 0, recvTotal = 0;
    for (int p = 0; p < world_; ++p) {
      sendTotal += perPeer[p];
      recvTotal += all[static_cast<size_t>(p) * world_ + rank_];
    }
    void *sb = nullptr, *rb = nullptr;
    BENCH_CUDA(cudaMalloc(&sb, sendTotal + 256));
    BENCH_CUDA(cudaMalloc(&rb, recvTotal + 256));
    auto fn = [&] {
      ncclGroupStart();
      uint64_t so = 0, ro = 0;
      for (int p = 0; p < world_; ++p) {
        if (p == rank_) continue;
        const uint64_t s = perPeer[p], r = all[static_cast<size_t>(p) * world_ + rank_];
        if (s) ncclSend(static_cast<char*>(sb) + so, s, ncclUint8, p, nccl_, stream_);
        if (r) ncclRecv(static_cast<char*>(rb) + ro, r, ncclUint8, p, nccl_, stream_);
        so += s;
        ro += r;
      }
      ncclGroupEnd();
    };
    double t = agree(timeIt(fn, false));
    cudaFree(sb);
    cudaFree(rb);
    return t;
#else
    (void)perPeer;
    return -1;
#endif
  }

  // Host: median (max over ranks) of the dense all-to-all of `perPeer` bytes over a TransferEngine of the host
  // backend's provider, created here once for the configuration and timed like dispatch (barrier, steady clock).
  // The engine resolves its provider as the host backend's channel does (EPCOMM_FABRIC_PROVIDER, else the probe).
  double fabricA2aTime(AllToAll& a2a, const std::vector<uint64_t>& perPeer, const std::string& label) {
#ifdef EPCOMM_HAVE_HOST_BACKEND
    bench::FabricA2aBaseline base(bs_, perPeer, env().timeoutMs, label);
    fabricProvider_ = base.providerName();
    if (auto* h = dynamic_cast<host::HostAllToAll*>(&a2a); h != nullptr && rank_ == 0) {
      if (h->providerName() != fabricProvider_) {
        std::fprintf(stderr, "note %s: the a2a baseline runs on provider %s, the host backend on %s\n", label.c_str(),
                     fabricProvider_.c_str(), h->providerName().c_str());
      }
    }
    // Timed: post, then every peer's data has arrived; the local completions of the writes (their sources may be
    // reused) are awaited after the clock stops, as dispatch leaves its own to the proxy thread. agree() gathers
    // after every rank's last round completed, so the engines may go away after it.
    return agree(timeIt([&] { base.run(); }, false, [&] { base.drain(); }));
#else
    (void)a2a;
    (void)perPeer;
    (void)label;
    return -1;
#endif
  }

  static std::string num(double v) {
    if (v < 0) return "n/a";
    char b[32];
    std::snprintf(b, sizeof(b), "%.1f", v);
    return b;
  }
  static std::string jnum(double v) {
    if (v < 0) return "null";
    char b[32];
    std::snprintf(b, sizeof(b), "%.3f", v);
    return b;
  }
  static std::string jlist(const std::vector<double>& v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i > 0 ? "," : "") + jnum(v[i]);
    return s + "]";
  }
  // "12.3 / 12.9" (rank 0 / rank 1 / ...)
  static std::string byRank(const std::vector<double>& v) {
    std::string s;
    for (size_t i = 0; i < v.size(); ++i) s += (i > 0 ? " / " : "") + num(v[i]);
    return s;
  }

  void printHeader() {
    const int blocks = env().nvlinkBlocks;
    std::printf(
        "# epcomm-bench  backend=%s world=%d dp=%d iters=%d warmup=%d barrier=%s blocks=%s max-tokens=%s layout=%s "
        "rev=%s machine=%s\n",
        o_.backend.c_str(), world_, o_.dp, o_.iters, o_.warmup, shm_ != nullptr ? o_.barrier.c_str() : "tcp",
        blocks > 0 ? std::to_string(blocks).c_str() : "auto",
        o_.maxTokens > 0 ? std::to_string(o_.maxTokens).c_str() : "T", layoutName(o_.layout), gitRev(o_).c_str(),
        machine_.c_str());
    std::printf(
        "# times in us (median, max over ranks); GB/s = cross-rank payload bytes per rank per direction / time\n");
    if (hostMode_) {
      std::printf(
          "# host: no NCCL; the a2a column is the baseline: a dense all-to-all of the same bytes (one write with "
          "immediate to every peer, wait for every peer's) over the same fabric provider, timed like dispatch\n");
    }
    std::printf("%-8s %6s %5s | %9s %9s | %8s %8s %8s %8s | %8s %8s | %8s %9s | %8s %8s\n", "config", "tokens", "graph",
                "dispatch", "combine", "d.send", "d.recv", "c.send", "c.recv", "d.dev", "c.dev",
                hostMode_ ? "a2a" : "nccl", "nccl.pplx", "d.GB/s", "c.GB/s");
    std::fflush(stdout);
  }

  void report(const std::string& backend, const std::string& name, const Config& c, uint32_t T, bool isGraph,
              const Measurement& m, double bytes, uint64_t bytesPplx, uint64_t combineBytes, uint64_t bufBytes) {
    const double dGb = m.dispatch > 0 ? bytes / (m.dispatch * 1e3) : -1;
    const double cGb = m.combine > 0 ? combineBytes / (m.combine * 1e3) : -1;
    std::printf("%-8s %6u %5s | %9s %9s | %8s %8s %8s %8s | %8s %8s | %8s %9s | %8s %8s\n", name.c_str(), T,
                isGraph ? "yes" : "no", num(m.dispatch).c_str(), num(m.combine).c_str(),
                isGraph ? "-" : num(m.dSend).c_str(), isGraph ? "-" : num(m.dRecv).c_str(),
                isGraph ? "-" : num(m.cSend).c_str(), isGraph ? "-" : num(m.cRecv).c_str(), num(m.dDev).c_str(),
                num(m.cDev).c_str(), num(hostMode_ ? m.fabricA2a : m.nccl).c_str(), num(m.ncclPplx).c_str(),
                num(dGb).c_str(), num(cGb).c_str());
    if (m.dHost >= 0) {
      std::printf("#   host time inside the eager calls (median, max over ranks): dispatch %.1f us, combine %.1f us\n",
                  m.dHost, m.cHost);
      std::printf("#   eager medians by rank: dispatch %s, combine %s; host time inside dispatch %s\n",
                  byRank(m.dRanks).c_str(), byRank(m.cRanks).c_str(), byRank(m.dHostRanks).c_str());
    }
    std::fflush(stdout);
    if (o_.json.empty() && !hostMode_) return;
    // Host: the JSON lines also go to stdout, after the table (hostJson_), as the issue asks of the main job.
    std::ostringstream f;
    char date[32];
    std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    f << "{\"backend\":\"" << backend << "\",\"world\":" << world_ << ",\"dp\":" << c.dpSize << ",\"config\":\"" << name
      << "\",\"layout\":\"" << layoutName(c.layout) << "\",\"tokens\":" << T << ",\"max_tokens\":" << c.maxNumTokens
      << ",\"graph\":" << (isGraph ? "true" : "false") << ",\"dispatch_us\":" << jnum(m.dispatch)
      << ",\"combine_us\":" << jnum(m.combine) << ",\"dispatch_send_us\":" << jnum(isGraph ? -1 : m.dSend)
      << ",\"dispatch_recv_us\":" << jnum(isGraph ? -1 : m.dRecv)
      << ",\"combine_send_us\":" << jnum(isGraph ? -1 : m.cSend)
      << ",\"combine_recv_us\":" << jnum(isGraph ? -1 : m.cRecv) << ",\"dispatch_device_us\":" << jnum(m.dDev)
      << ",\"combine_device_us\":" << jnum(m.cDev) << ",\"nccl_us\":" << jnum(m.nccl)
      << ",\"nccl_pplx_us\":" << jnum(m.ncclPplx);
    if (m.dHost >= 0) {
      f << ",\"dispatch_host_us\":" << jnum(m.dHost) << ",\"combine_host_us\":" << jnum(m.cHost)
        << ",\"dispatch_us_by_rank\":" << jlist(m.dRanks) << ",\"combine_us_by_rank\":" << jlist(m.cRanks)
        << ",\"dispatch_host_us_by_rank\":" << jlist(m.dHostRanks);
    }
    if (hostMode_)
      f << ",\"fabric_a2a_us\":" << jnum(m.fabricA2a) << ",\"fabric_provider\":\"" << fabricProvider_ << "\"";
    f << ",\"dispatch_bytes_per_rank\":" << static_cast<uint64_t>(bytes) << ",\"pplx_bytes_rank0\":" << bytesPplx
      << ",\"combine_bytes_rank0\":" << combineBytes << ",\"buffer_bytes\":" << bufBytes << ",\"barrier\":\""
      << (shm_ != nullptr ? o_.barrier : "tcp") << "\",\"nvlink_blocks_env\":\""
      << (env().nvlinkBlocks > 0 ? std::to_string(env().nvlinkBlocks) : std::string()) << "\",\"iters\":" << o_.iters
      << ",\"warmup\":" << o_.warmup << ",\"rev\":\"" << gitRev(o_) << "\",\"machine\":\"" << machine_
      << "\",\"date\":\"" << date << "\"}\n";
    if (!o_.json.empty()) std::ofstream(o_.json, std::ios::app) << f.str();
    if (hostMode_) hostJson_.push_back(f.str());
  }

  Options o_;
  Bootstrap& bs_;
  std::unique_ptr<bench::ShmBarrier> shm_;
  int rank_ = 0, world_ = 1;
  bool hostMode_ = false;
  std::vector<std::string> hostJson_;  // host: JSON lines printed after the table
  std::vector<double> hostUs_;         // GPU: host microseconds inside fn of the last timeIt, per timed iteration
  std::string fabricProvider_;         // host: provider of the fabric all-to-all baseline
  cudaStream_t stream_ = nullptr;
  std::string gpuName_ = "cpu", machine_;
#ifdef EPCOMM_BENCH_HAVE_NCCL
  ncclComm_t nccl_ = nullptr;
#endif
};

int freePort() {
  // Bind port 0 on localhost and release it; the children's rendezvous takes it right after.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  int port = 29500;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}

int launcher(int argc, char** argv, const Options& o) {
  int world = o.world;
  if (world <= 0) {
    // Count GPUs in a child: this process forks more children and must not initialise CUDA itself.
    pid_t pid = fork();
    if (pid == 0) {
      int n = 0;
      if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
      _exit(n > 0 ? n : 4);  // no GPU: 4 local processes on the host backend (issue 5)
    }
    int st = 0;
    waitpid(pid, &st, 0);
    world = WIFEXITED(st) ? WEXITSTATUS(st) : 1;
  }
  const std::string addr = "127.0.0.1:" + std::to_string(freePort());
  const std::string rev = gitRev(o);
  std::vector<pid_t> kids;
  // One pipe per rank: a failing rank writes its error there (EPBENCH_ERR_FD) and the launcher prints it as the
  // rank exits, with the rank and how it ended (a rank killed by a signal cannot write anything).
  std::vector<int> errFds;
  for (int r = 0; r < world; ++r) {
    int fds[2] = {-1, -1};
    if (pipe2(fds, O_CLOEXEC) != 0) fds[0] = fds[1] = -1;
    pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // a launcher that dies takes its ranks along
      if (fds[1] >= 0) {
        fcntl(fds[1], F_SETFD, 0);
        setenv("EPBENCH_ERR_FD", std::to_string(fds[1]).c_str(), 1);
      }
      setenv("EPCOMM_RANK", std::to_string(r).c_str(), 1);
      setenv("EPCOMM_WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("EPCOMM_LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("EPCOMM_BOOTSTRAP", addr.c_str(), 1);
      setenv("EPBENCH_CHILD", "1", 1);
      setenv("EPBENCH_REV", rev.c_str(), 1);
      setenv("NCCL_NVLS_ENABLE", "0", 1);
      setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
      execv("/proc/self/exe", argv);
      _exit(127);
    }
    if (fds[1] >= 0) close(fds[1]);
    if (fds[0] >= 0) fcntl(fds[0], F_SETFL, O_NONBLOCK);
    kids.push_back(pid);
    errFds.push_back(fds[0]);
  }
  auto readAll = [](int fd) {
    std::string msg;
    char buf[4096];
    ssize_t n;
    while (fd >= 0 && (n = read(fd, buf, sizeof(buf))) > 0) msg.append(buf, static_cast<size_t>(n));
    while (!msg.empty() && (msg.back() == '\n' || msg.back() == '\r')) msg.pop_back();
    return msg;
  };
  // After the first failure the survivors name the dead rank within their own timeouts; a rank still running well
  // past that is stuck and is killed, so the launcher never hangs.
  const int64_t graceMs = 3 * env().timeoutMs + 10000;
  int failed = 0, firstFailed = -1, alive = world;
  std::vector<bool> done(world, false), killedByUs(world, false);
  auto firstFailure = std::chrono::steady_clock::time_point{};
  while (alive > 0) {
    bool reaped = false;
    for (int r = 0; r < world; ++r) {
      if (done[r]) continue;
      int st = 0;
      const pid_t got = waitpid(kids[r], &st, WNOHANG);
      if (got == 0) continue;
      done[r] = true;
      --alive;
      reaped = true;
      const std::string msg = readAll(errFds[r]);
      if (errFds[r] >= 0) close(errFds[r]);
      if (got > 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0) continue;
      ++failed;
      if (firstFailed < 0) {
        firstFailed = r;
        firstFailure = std::chrono::steady_clock::now();
      }
      std::ostringstream line;
      line << "epcomm-bench: rank " << r << " failed";
      if (got < 0) {
        line << " (waitpid: " << std::strerror(errno) << ")";
      } else if (WIFEXITED(st)) {
        line << " (exit code " << WEXITSTATUS(st) << ")";
      } else if (WIFSIGNALED(st)) {
        line << " (killed by signal " << WTERMSIG(st) << ", " << strsignal(WTERMSIG(st)) << ")";
      }
      if (!msg.empty()) {
        line << ": " << msg;
      } else if (killedByUs[r]) {
        line << ": killed by the launcher after rank " << firstFailed << " failed";
      } else if (got > 0 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) {
        line << ": no message; SIGKILL from outside is usually the kernel's out-of-memory killer (see dmesg)";
      } else {
        line << ": no message";
      }
      std::cerr << line.str() << "\n" << std::flush;
    }
    if (alive == 0) break;
    if (firstFailed >= 0 && std::chrono::steady_clock::now() - firstFailure > std::chrono::milliseconds(graceMs)) {
      for (int r = 0; r < world; ++r) {
        if (done[r] || killedByUs[r]) continue;
        std::cerr << "epcomm-bench: rank " << r << " still running " << graceMs / 1000 << " s after rank "
                  << firstFailed << " failed: killing it\n";
        kill(kids[r], SIGKILL);
        killedByUs[r] = true;  // the loop reaps it as failed
      }
    }
    if (!reaped) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  (void)argc;
  if (failed) std::cerr << "epcomm-bench: " << failed << " rank(s) failed\n";
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace epcomm

int main(int argc, char** argv) {
  try {
    epcomm::Options o = epcomm::parse(argc, argv);
    if (std::getenv("EPBENCH_CHILD") == nullptr) return epcomm::launcher(argc, argv, o);
    if (o.world <= 0) o.world = epcomm::env().worldSize;
    std::unique_ptr<epcomm::Bootstrap> bs = epcomm::createBootstrapFromEnv();
    epcomm::Bench(o, *bs).run();
    return 0;
  } catch (const std::exception& e) {
    // A rank started by the launcher hands its message to the launcher, which prints it with the rank's fate.
    const char* rank = std::getenv("EPCOMM_RANK");
    const char* errFd = std::getenv("EPBENCH_ERR_FD");
    std::string msg = std::string(e.what()) + "\n";
    if (errFd != nullptr && std::getenv("EPBENCH_CHILD") != nullptr) {
      const int fd = std::atoi(errFd);
      if (msg.size() > 16000) msg = msg.substr(0, 16000) + "...\n";  // stays below the pipe's capacity
      if (write(fd, msg.data(), msg.size()) == static_cast<ssize_t>(msg.size())) return 1;
    }
    if (rank != nullptr) msg = "rank " + std::string(rank) + ": " + msg;
    std::cerr << "epcomm-bench: " << msg;
    return 1;
  }
}
