// epcomm-bench's command line.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epcomm/config.hpp"

namespace epcomm {
namespace bench {

/// What the command line asks for. The launcher and every rank parse the same arguments.
struct Options {
  std::string backend = "auto";  ///< Passed to createAllToAll: auto, nvlink, nvshmem, proxy or host.
  int world = 0;                 ///< Ranks to start; 0: one per GPU (4 without a GPU).
  std::vector<std::string> configs = {"decode", "prefill", "small", "qwen3"};
  std::vector<uint32_t> tokens = {1, 8, 32, 128, 512, 4096};
  int iters = 200;
  int warmup = 20;
  int dp = 1;
  std::string json;             ///< --json: JSON lines appended here.
  std::string plot;             ///< --plot: PNG drawn from the JSON lines after the run (scripts/plot).
  std::string rev;              ///< --rev: the revision to report (else EPBENCH_REV, else git rev-parse).
  std::string barrier = "shm";  ///< shm: the shared-memory spin barrier; tcp: the bootstrap's.
  bool floor = false;           ///< --floor: also time an empty launch and a one-flag exchange (the method's floor).
  uint32_t maxTokens = 0;       ///< --max-tokens: the object's capacity (maxNumTokens) when above T.
  Layout layout = Layout::kBatched;  ///< --layout: of outExpertX / expertY.
  /// --fp8: "" (off), "fused", "separate" or "both": the fp8 configurations (decode, prefill) dispatch bf16 tokens that
  /// arrive as fp8 + scales, cast by the dispatch itself (Config::dispatchCast) and / or by a cast kernel before an fp8
  /// dispatch, timed in the same run (Bench::runFp8Cast).
  std::string fp8;
  bool help = false;          ///< -h / --help: print usage() and exit 0.
  bool listBackends = false;  ///< --list-backends: print the backends of this build and exit 0.
  // Given on the command line (else the host backend substitutes its own defaults, see applyHostDefaults).
  bool configsSet = false, tokensSet = false, itersSet = false, warmupSet = false;
};

/// Parses argv. Throws Error(kInvalidArgument) naming the bad argument.
Options parseOptions(int argc, char** argv);

/// The --help text.
const char* usage();

/// The host backend's defaults for what the command line left out: CPU processes (often more than cores) cannot
/// run the GPU set in reasonable time, and decode at 4096 tokens needs ~26 GiB per rank (expertY alone is
/// L x 16384 x H bf16). Prefill (4096 tokens) runs only when named.
void applyHostDefaults(Options& o);

/// EPCOMM_TIMEOUT_MS (the library's bound of every wait; 10000 when unset), for the benchmark's own waits.
int64_t timeoutMsFromEnv();

/// The revision to report: --rev, else EPBENCH_REV (set by the launcher), else `git rev-parse --short HEAD`.
std::string revision(const Options& o);

}  // namespace bench
}  // namespace epcomm
