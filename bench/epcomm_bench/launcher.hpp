// epcomm-bench's launcher: starts one process per rank on this host and reports how each one ended.
#pragma once

#include "options.hpp"

namespace epcomm {
namespace bench {

/// Starts o.world ranks (0: one per GPU, 4 without a GPU) as fork + exec of this binary, each with EPCOMM_RANK,
/// EPCOMM_WORLD_SIZE, EPCOMM_BOOTSTRAP (a free local port), EPCOMM_LOCAL_RANK (the CUDA device: rank % GPUs, so
/// several ranks share a GPU when there are more ranks than GPUs) and EPBENCH_CHILD. Waits for all of them, prints
/// every failed rank's message with how it ended, kills the survivors of a failure once they outlived their own
/// timeouts, then draws --plot. Returns the process exit code (0: every rank succeeded).
int launchRanks(int argc, char** argv, const Options& o);

}  // namespace bench
}  // namespace epcomm
