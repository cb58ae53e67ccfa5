#include "core/env.hpp"

#include <cstdlib>
#include <cstring>

#include "core/log.hpp"
#include "epcomm/error.hpp"

extern char** environ;

namespace epcomm {

const std::vector<EnvVar>& envVars() {
  static const std::vector<EnvVar> vars = {
      {"EPCOMM_LOG_LEVEL", "warn", "error, warn, info or debug"},
      {"EPCOMM_TIMEOUT_MS", "10000",
       "bound of every wait (host and GPU; the nvlink kernels give a wait on their own rank's blocks twice that, so "
       "the error names the peer that held them up); a timeout names the peer and phase"},
      {"EPCOMM_BOOTSTRAP", "", "host:port of rank 0's TCP rendezvous"},
      {"EPCOMM_RANK", "-1", "this process's rank for the TCP rendezvous"},
      {"EPCOMM_WORLD_SIZE", "-1", "number of ranks for the TCP rendezvous"},
      {"EPCOMM_LOCAL_RANK", "-1", "rank within the node; selects the CUDA device"},
      {"EPCOMM_BACKEND", "auto", "backend chosen by the factory: auto, nvlink, nvshmem, proxy, host"},
      {"EPCOMM_FABRIC_PROVIDER", "", "libfabric provider for the TransferEngine (empty: probe efa, verbs, tcp, shm)"},
      {"EPCOMM_PRIVATE_TOKENS", "-1", "host/proxy backend: tokens in each sender's private area (-1: derived)"},
      {"EPCOMM_ELASTIC", "0",
       "host backend: 1 = a peer that times out, whose writes fail or that leaves is masked once the other ranks "
       "agree, and the object goes on without it (docs/failures.md, Elastic ranks); 0 = the object becomes unusable"},
      {"EPCOMM_PROXY_CPU", "-1", "core to pin the progress/proxy thread to (-1: not pinned)"},
      {"EPCOMM_PROXY_LOCAL_SIZE", "0",
       "proxy backend: ranks per node, grouped by rank (rank / size is the node); a node's peers exchange entries and "
       "combine rows GPU to GPU over NVLink (CUDA IPC), their heads and immediates over the fabric (0: counted from "
       "the bootstrap's host names; 1: every peer over the fabric)"},
      {"EPCOMM_PROXY_TRACE", "0",
       "proxy backend diagnostics: 1 stamps every round's phases (kernel pack, proxy post, wire, unpack) and prints "
       "medians at destruction"},
      {"EPCOMM_PROXY_TRACE_FILE", "",
       "proxy backend diagnostics, with EPCOMM_PROXY_TRACE=1: also writes every recorded round's stamps (ns, host "
       "clock CLOCK_REALTIME, device stamps moved onto it) as JSON lines to <value>.rank<r>.jsonl when the object is "
       "destroyed (a later object's file replaces an earlier one's), so that ranks on one host can be set side by "
       "side"},
      {"EPCOMM_NVLINK_BLOCKS", "0", "nvlink backend: thread blocks per kernel (0: automatic)"},
      {"EPCOMM_NVLINK_THREADS", "0", "nvlink backend: threads per block, 256 or 512 (0: automatic)"},
      {"EPCOMM_NVLINK_GRAPH_LAUNCH", "1",
       "nvlink backend: 1 = an eager call whose arguments repeat launches its kernel as a cached one-node CUDA graph "
       "(made at the second such call; calls on a capturing stream always launch plainly), 0 = plain launches"},
      {"EPCOMM_NVLINK_TRACE", "0",
       "nvlink backend diagnostics: 1 stamps every kernel's phases per block and prints a summary at destruction, 2 "
       "also every block's median stamps of the fused dispatch"},
      {"EPCOMM_FABRIC_DOMAIN", "", "libfabric domain (interface) for the TransferEngine, e.g. lo (empty: first IPv4)"},
      {"EPCOMM_IB_DEVICE", "", "libibverbs TransferEngine: RDMA device name (empty: first device)"},
      {"EPCOMM_IB_PORT", "1", "libibverbs TransferEngine: port number"},
      {"EPCOMM_IB_GID_INDEX", "0", "libibverbs TransferEngine: GID index (RoCE needs the right one, often 3)"},
      {"EPCOMM_IB_SL", "0", "libibverbs TransferEngine: InfiniBand service level"},
  };
  return vars;
}

static const EnvVar& findVar(const char* name) {
  for (const EnvVar& v : envVars()) {
    if (std::strcmp(v.name, name) == 0) return v;
  }
  EPCOMM_THROW(kInternal, "environment variable " << name << " is not declared in src/core/env.cc");
}

std::string envString(const char* name) {
  const EnvVar& var = findVar(name);
  const char* value = std::getenv(name);
  return value != nullptr ? std::string(value) : std::string(var.defaultValue);
}

int64_t envInt(const char* name) {
  std::string value = envString(name);
  if (value.empty()) return 0;
  char* end = nullptr;
  long long parsed = std::strtoll(value.c_str(), &end, 10);
  EPCOMM_CHECK(end != nullptr && *end == '\0', kInvalidArgument,
               "environment variable " << name << "='" << value << "' is not an integer");
  return parsed;
}

// envInt, checked to lie in [lo, hi].
static int64_t envIntIn(const char* name, int64_t lo, int64_t hi) {
  const int64_t v = envInt(name);
  EPCOMM_CHECK(v >= lo && v <= hi, kInvalidArgument,
               "environment variable " << name << "=" << v << " is out of range [" << lo << ", " << hi << "]");
  return v;
}

Env readEnv() {
  Env e;
  e.logLevel = envString("EPCOMM_LOG_LEVEL");
  e.timeoutMs = envInt("EPCOMM_TIMEOUT_MS");
  EPCOMM_CHECK(e.timeoutMs > 0, kInvalidArgument, "EPCOMM_TIMEOUT_MS must be positive, got " << e.timeoutMs);
  e.bootstrap = envString("EPCOMM_BOOTSTRAP");
  e.rank = static_cast<int>(envInt("EPCOMM_RANK"));
  e.worldSize = static_cast<int>(envInt("EPCOMM_WORLD_SIZE"));
  e.localRank = static_cast<int>(envInt("EPCOMM_LOCAL_RANK"));
  e.backend = envString("EPCOMM_BACKEND");
  e.fabricProvider = envString("EPCOMM_FABRIC_PROVIDER");
  e.privateTokens = envInt("EPCOMM_PRIVATE_TOKENS");
  e.proxyCpu = static_cast<int>(envInt("EPCOMM_PROXY_CPU"));
  e.nvlinkBlocks = static_cast<int>(envIntIn("EPCOMM_NVLINK_BLOCKS", 0, 1 << 16));
  e.nvlinkThreads = static_cast<int>(envIntIn("EPCOMM_NVLINK_THREADS", 0, 512));
  e.nvlinkTrace = static_cast<int>(envIntIn("EPCOMM_NVLINK_TRACE", 0, 2));
  e.nvlinkGraphLaunch = envIntIn("EPCOMM_NVLINK_GRAPH_LAUNCH", 0, 1) != 0;
  for (char** p = environ; p != nullptr && *p != nullptr; ++p) {
    if (std::strncmp(*p, "EPCOMM_", 7) != 0) continue;
    std::string name(*p, std::strchr(*p, '=') != nullptr ? std::strchr(*p, '=') - *p : std::strlen(*p));
    bool known = false;
    for (const EnvVar& v : envVars()) known = known || name == v.name;
    if (!known) EPCOMM_LOG(kWarn, "unknown environment variable " << name << " (see README for the list)");
  }
  return e;
}

const Env& env() {
  static const Env e = readEnv();
  return e;
}

}  // namespace epcomm
