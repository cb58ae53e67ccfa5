// epcomm-host-bench: the host backend (proxy protocol with CPU loops) on W local processes over libfabric tcp/shm,
// on the standard configurations. Prints a table and one JSON line per configuration with the per-round times and
// the fabric operations per peer per round. Reports numbers only; asserts nothing about time.
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backends/host/host_all_to_all.hpp"
#include "epcomm/bootstrap.hpp"
#include "epcomm/error.hpp"
#include "reference/reference.hpp"

namespace epcomm {
namespace {

struct Options {
  std::vector<std::string> configs;
  uint32_t world = 4;
  uint32_t dp = 1;
  uint32_t iters = 20;
  uint32_t warmup = 3;
  int64_t tokens = -1;
  int64_t privateTokens = -1;
  std::string provider = "shm";
  Layout layout = Layout::kPacked;
};

void usage() {
  std::printf(
      "usage: epcomm-host-bench [--config NAME]... [--world W] [--dp D] [--iters N] [--warmup N] [--tokens T]\n"
      "                         [--provider tcp|shm] [--layout packed|batched] [--private-tokens P]\n"
      "  Runs W local processes (default 4) on the host backend. Default configurations: decode, small, qwen3\n"
      "  (prefill only when named: its buffers take several GiB per rank).\n");
}

int freePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = -1;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// One rank's run of one configuration; rank 0 prints.
void runRank(const Options& opt, const std::string& name, uint32_t rank, Bootstrap& bootstrap) {
  Config c = standardConfig(name, opt.world, rank, opt.dp);
  if (opt.tokens > 0) c.maxNumTokens = static_cast<uint32_t>(opt.tokens);
  c.layout = opt.layout;
  host::HostOptions ho;
  ho.provider = opt.provider;
  ho.privateTokens = opt.privateTokens;
  host::HostAllToAll a2a(c, bootstrap, ho);

  const int64_t T = c.maxNumTokens, K = c.expertsPerToken, H = c.hiddenDim, L = c.numLocalExperts();
  const bool fp8 = c.hiddenDimScaleBytes > 0;
  const DType xType = fp8 ? DType::kFp8E4M3 : DType::kBf16;
  const int64_t xCols = c.hiddenDimBytes / dtypeSize(xType), S = c.hiddenDimScaleBytes / 4;
  const int64_t rows = static_cast<int64_t>(c.expertRows());
  reference::HostTensor x(xType, {T, xCols}), xScale, numTokens(DType::kI32, {L}), outX, outScale;
  reference::HostTensor weights(DType::kF32, {T, K}), out(DType::kBf16, {T, H}), y;
  std::memset(x.data<void>(), 0x3A, x.bytes());
  for (int64_t i = 0; i < T * K; ++i) weights.data<float>()[i] = 1.0f / static_cast<float>(K);
  if (fp8) xScale = reference::HostTensor(DType::kF32, {T, S});
  if (c.layout == Layout::kBatched) {
    const int64_t R = static_cast<int64_t>(c.batchedRowsPerExpert());
    outX = reference::HostTensor(xType, {L, R, xCols});
    if (fp8) outScale = reference::HostTensor(DType::kF32, {L, R, S});
    y = reference::HostTensor(DType::kBf16, {L, R, H});
  } else {
    outX = reference::HostTensor(xType, {rows, xCols});
    if (fp8) outScale = reference::HostTensor(DType::kF32, {rows, S});
    y = reference::HostTensor(DType::kBf16, {rows, H});
  }
  std::memset(y.data<void>(), 0x3C, y.bytes());
  // The same tokens in a DP group; fresh routing per iteration from a fixed seed (SPEC 3).
  const uint32_t group = rank / opt.dp;

  std::vector<double> dispatchUs, combineUs;
  const uint32_t total = opt.warmup + opt.iters;
  host::HostStats before;
  for (uint32_t it = 0; it < total; ++it) {
    const std::vector<int32_t> idx = reference::randomIndices(c, static_cast<uint32_t>(T), 1000003ull * it + group);
    reference::HostTensor indices(DType::kI32, {T, K});
    std::memcpy(indices.data<void>(), idx.data(), idx.size() * 4);
    DispatchArgs da;
    da.outExpertNumTokens = numTokens.view();
    da.outExpertX = outX.view();
    da.outExpertXScale = outScale.view();
    da.x = x.view();
    da.xScale = xScale.view();
    da.indices = indices.view();
    CombineArgs ca;
    ca.outTokens = out.view();
    ca.indices = indices.view();
    ca.weights = weights.view();
    ca.expertY = y.view();
    if (it == opt.warmup) before = a2a.stats();
    bootstrap.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    a2a.dispatch(da);
    const auto t1 = std::chrono::steady_clock::now();
    bootstrap.barrier();
    const auto t2 = std::chrono::steady_clock::now();
    a2a.combine(ca);
    const auto t3 = std::chrono::steady_clock::now();
    if (it >= opt.warmup) {
      dispatchUs.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      combineUs.push_back(std::chrono::duration<double, std::micro>(t3 - t2).count());
    }
  }
  const host::HostStats after = a2a.stats();

  // Per iteration, the slowest rank defines the round; then the median over iterations.
  std::vector<double> mine(2 * opt.iters), all(2 * opt.iters * opt.world);
  std::copy(dispatchUs.begin(), dispatchUs.end(), mine.begin());
  std::copy(combineUs.begin(), combineUs.end(), mine.begin() + opt.iters);
  bootstrap.allGather(mine.data(), all.data(), mine.size() * sizeof(double));
  // Operations per peer per round, averaged over this rank's peers.
  double head = 0, bulk = 0, comb = 0, barrier = 0, bytes = 0;
  for (uint32_t p = 0; p < opt.world; ++p) {
    if (p == rank) continue;
    head += after.peers[p].headWrites - before.peers[p].headWrites;
    bulk += after.peers[p].bulkWrites - before.peers[p].bulkWrites;
    comb += after.peers[p].combineWrites - before.peers[p].combineWrites;
    barrier += after.peers[p].barrierImms - before.peers[p].barrierImms;
    bytes += after.peers[p].bytes - before.peers[p].bytes;
  }
  double ops[5] = {head, bulk, comb, barrier, bytes}, allOps[5 * 64] = {0};
  if (opt.world <= 64) bootstrap.allGather(ops, allOps, sizeof(ops));
  if (rank != 0) return;
  std::vector<double> d(opt.iters, 0.0), cmb(opt.iters, 0.0);
  for (uint32_t r = 0; r < opt.world; ++r) {
    for (uint32_t i = 0; i < opt.iters; ++i) {
      d[i] = std::max(d[i], all[r * 2 * opt.iters + i]);
      cmb[i] = std::max(cmb[i], all[r * 2 * opt.iters + opt.iters + i]);
    }
  }
  std::vector<double> roundUs(opt.iters);
  for (uint32_t i = 0; i < opt.iters; ++i) roundUs[i] = d[i] + cmb[i];
  double sum[5] = {0};
  for (uint32_t r = 0; r < opt.world && opt.world <= 64; ++r) {
    for (int j = 0; j < 5; ++j) sum[j] += allOps[r * 5 + j];
  }
  const double perPeerRound = static_cast<double>(opt.world) * (opt.world - 1) * opt.iters;
  const double headPer = sum[0] / perPeerRound, bulkPer = sum[1] / perPeerRound, combPer = sum[2] / perPeerRound;
  const double barrierPer = sum[3] / perPeerRound, bytesPer = sum[4] / perPeerRound;
  const double writesPer = headPer + bulkPer + combPer;
  std::printf("%-8s %5u %3u %-7s %-6s %8u %12.1f %12.1f %12.1f %9.2f %9.2f %9.2f %9.2f %12.0f\n", name.c_str(),
              opt.world, opt.dp, layoutName(c.layout), a2a.providerName().c_str(), a2a.sizes().privateTokens, median(d),
              median(cmb), median(roundUs), headPer, bulkPer, combPer, writesPer, bytesPer);
  std::printf(
      "{\"bench\":\"epcomm\",\"backend\":\"host\",\"config\":\"%s\",\"world\":%u,\"dp\":%u,\"tokens\":%u,"
      "\"layout\":\"%s\",\"provider\":\"%s\",\"private_tokens\":%u,\"iters\":%u,\"dispatch_us\":%.1f,"
      "\"combine_us\":%.1f,\"round_us\":%.1f,\"head_writes_per_peer_round\":%.3f,"
      "\"bulk_writes_per_peer_round\":%.3f,\"combine_writes_per_peer_round\":%.3f,"
      "\"writes_per_peer_round\":%.3f,\"barrier_imms_per_peer_round\":%.3f,\"bytes_per_peer_round\":%.0f}\n",
      name.c_str(), opt.world, opt.dp, c.maxNumTokens, layoutName(c.layout), a2a.providerName().c_str(),
      a2a.sizes().privateTokens, opt.iters, median(d), median(cmb), median(roundUs), headPer, bulkPer, combPer,
      writesPer, barrierPer, bytesPer);
  std::fflush(stdout);
}

int run(const Options& opt) {
  std::printf("epcomm-host-bench: backend=host world=%u dp=%u iters=%u (median over iterations of the slowest rank)\n",
              opt.world, opt.dp, opt.iters);
  std::printf("%-8s %5s %3s %-7s %-6s %8s %12s %12s %12s %9s %9s %9s %9s %12s\n", "config", "W", "D", "layout",
              "fabric", "private", "dispatch_us", "combine_us", "round_us", "head/pr", "bulk/pr", "comb/pr",
              "writes/pr", "bytes/pr");
  std::fflush(stdout);
  int status = 0;
  for (const std::string& name : opt.configs) {
    const int port = freePort();
    const std::string hostPort = "127.0.0.1:" + std::to_string(port);
    std::vector<pid_t> pids;
    for (uint32_t r = 0; r < opt.world; ++r) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int code = 0;
        try {
          std::unique_ptr<Bootstrap> bootstrap = createTcpBootstrap(hostPort, static_cast<int>(r), opt.world);
          runRank(opt, name, r, *bootstrap);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "epcomm-host-bench rank %u (%s): %s\n", r, name.c_str(), e.what());
          code = 1;
        }
        std::fflush(stdout);
        std::fflush(stderr);
        ::_exit(code);
      }
      pids.push_back(pid);
    }
    for (pid_t pid : pids) {
      int st = 0;
      ::waitpid(pid, &st, 0);
      if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) status = 1;
    }
  }
  return status;
}

}  // namespace
}  // namespace epcomm

int main(int argc, char** argv) {
  epcomm::Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--config") {
      opt.configs.push_back(next());
    } else if (a == "--world") {
      opt.world = static_cast<uint32_t>(std::stoul(next()));
    } else if (a == "--dp") {
      opt.dp = static_cast<uint32_t>(std::stoul(next()));
    } else if (a == "--iters") {
      opt.iters = static_cast<uint32_t>(std::stoul(next()));
    } else if (a == "--warmup") {
      opt.warmup = static_cast<uint32_t>(std::stoul(next()));
    } else if (a == "--tokens") {
      opt.tokens = std::stoll(next());
    } else if (a == "--private-tokens") {
      opt.privateTokens = std::stoll(next());
    } else if (a == "--provider") {
      opt.provider = next();
    } else if (a == "--layout") {
      opt.layout = next() == "batched" ? epcomm::Layout::kBatched : epcomm::Layout::kPacked;
    } else if (a == "--help" || a == "-h") {
      epcomm::usage();
      return 0;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      epcomm::usage();
      return 2;
    }
  }
  if (opt.configs.empty()) opt.configs = {"decode", "small", "qwen3"};
  if (opt.iters == 0 || opt.world == 0 || opt.world % opt.dp != 0) {
    std::fprintf(stderr, "need --iters > 0 and --world a multiple of --dp\n");
    return 2;
  }
  return epcomm::run(opt);
}
