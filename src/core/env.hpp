// Every EPCOMM_* environment variable is declared and read here, once per process.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace epcomm {

/// One documented environment variable.
struct EnvVar {
  const char* name;
  const char* defaultValue;
  const char* description;
};

/// The table of every EPCOMM_* variable (the README's list is generated from it by `epcomm-plan --env`).
const std::vector<EnvVar>& envVars();

/// Values of the variables, parsed once on first use. Unknown EPCOMM_* variables produce a warning.
struct Env {
  std::string logLevel;        ///< EPCOMM_LOG_LEVEL
  int64_t timeoutMs;           ///< EPCOMM_TIMEOUT_MS: every wait on host and device is bounded by this.
  std::string bootstrap;       ///< EPCOMM_BOOTSTRAP: host:port of rank 0's rendezvous listener.
  int rank;                    ///< EPCOMM_RANK (-1 when unset)
  int worldSize;               ///< EPCOMM_WORLD_SIZE (-1 when unset)
  int localRank;               ///< EPCOMM_LOCAL_RANK (-1 when unset): picks the CUDA device.
  std::string backend;         ///< EPCOMM_BACKEND: default backend name for the factory ("auto").
  std::string fabricProvider;  ///< EPCOMM_FABRIC_PROVIDER: libfabric provider ("" = probe).
  int64_t privateTokens;       ///< EPCOMM_PRIVATE_TOKENS: host/proxy private area per sender (-1 = derived).
  int proxyCpu;                ///< EPCOMM_PROXY_CPU: core to pin progress/proxy threads to (-1 = none).
  int nvlinkBlocks;            ///< EPCOMM_NVLINK_BLOCKS: blocks of every nvlink kernel (0 = auto).
  int nvlinkThreads;           ///< EPCOMM_NVLINK_THREADS: threads per nvlink block, 256 or 512 (0 = auto).
  int nvlinkTrace;             ///< EPCOMM_NVLINK_TRACE: per-block phase stamps, summary at destruction (2: per block).
  bool nvlinkGraphLaunch;      ///< EPCOMM_NVLINK_GRAPH_LAUNCH: eager launches through cached one-node graphs.
};

/// The process-wide parsed environment (read on first call; thread-safe).
const Env& env();

/// Reads and checks the variables now, uncached (env() keeps the first result). Throws kInvalidArgument naming the
/// variable for a value that is not an integer or outside its range.
Env readEnv();

/// Reads a variable by name through the table above (throws kInternal for a name not in the table).
std::string envString(const char* name);
int64_t envInt(const char* name);

}  // namespace epcomm
