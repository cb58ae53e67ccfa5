// Multi-process test harness: forks one child process per rank, gives each a TCP bootstrap over 127.0.0.1, and
// reports per rank how the child ended. Used by the bootstrap, fabric and host-backend tests.
//
// Typical use inside a TEST():
//
//   epcomm::test::RunResult result = epcomm::test::runRanks(4, [](int rank, epcomm::Bootstrap& bootstrap) {
//     std::vector<int> all(bootstrap.worldSize());
//     bootstrap.allGather(&rank, all.data(), sizeof(int));
//     EXPECT_EQ(all[3], 3);  // gtest assertions work in the children; failures travel to the parent.
//   });
//   EXPECT_TRUE(result.allOk()) << result.summary();
//
// Rules for bodies:
// - Call runRanks/runProcesses from the test's main thread before the test starts any thread: the children are
//   forked without exec, and only the forking thread exists in a child.
// - A child succeeds when its body returns without an exception and without a failed gtest assertion. An
//   exception's what() and the text of failed assertions become RankOutcome::message in the parent.
// - A body may end its process early with _exit(code) to play a rank that crashes (code 0 counts as success).
// - Children never return into GoogleTest: they leave with _exit() after flushing stdout/stderr.
// - A child that runs past RunOptions::deadlineMs is killed (SIGKILL) and reported as timed out, so a test can
//   never hang. Children also die with the parent (PR_SET_PDEATHSIG).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "epcomm/bootstrap.hpp"

namespace epcomm {
namespace test {

/// How one child process ended.
struct RankOutcome {
  int rank = -1;
  bool exited = false;    ///< Exited normally (exitCode is valid).
  int exitCode = -1;      ///< Exit status when `exited`.
  int signal = 0;         ///< Terminating signal when killed by one (SIGKILL after a deadline overrun).
  bool timedOut = false;  ///< The parent killed it for running past the deadline.
  std::string message;    ///< What the child reported: exception what(), failed assertions; empty on success.

  /// Exited with status 0.
  bool ok() const { return exited && exitCode == 0; }
  /// "rank 2: exit 1: <message>" / "rank 1: killed after 60000 ms deadline" / "rank 0: ok".
  std::string describe() const;
};

/// The outcome of every rank, indexed by rank.
struct RunResult {
  std::vector<RankOutcome> ranks;
  /// Every rank exited with status 0.
  bool allOk() const;
  /// One line per rank (describe()), for a gtest failure message.
  std::string summary() const;
};

/// Knobs of a run.
struct RunOptions {
  int64_t bootstrapTimeoutMs = 10000;  ///< Timeout given to createTcpBootstrap (runRanks only).
  int64_t deadlineMs = 120000;         ///< Wall time after which the parent kills the children still running.
};

/// A TCP port on 127.0.0.1 that was free when asked (bound to port 0 and released). Another process could take it
/// in between; in a test that window is harmless.
int freeTcpPort();

/// Forks `world` children and runs body(rank) in child `rank`; waits for all of them (bounded by the deadline).
/// The body sets up whatever it needs (e.g. its own bootstrap, or none, to play a rank that never starts).
RunResult runProcesses(int world, const std::function<void(int rank)>& body, const RunOptions& options = {});

/// Like runProcesses, but each child first joins a TCP bootstrap at 127.0.0.1:<free port> with `world` ranks and
/// runs body(rank, bootstrap). The bootstrap is destroyed (its sockets closed) after the body returns.
RunResult runRanks(int world, const std::function<void(int rank, Bootstrap& bootstrap)>& body,
                   const RunOptions& options = {});

}  // namespace test
}  // namespace epcomm
