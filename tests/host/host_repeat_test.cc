// Fresh objects over libfabric tcp, again and again: W = 4, E = 8, K = 3, bf16, H = 1024, T = 256, batched,
// padding 16, four checked rounds per object. Each object brings up new endpoints, so every repeat runs rxm's
// connection setup with the first writes of a round racing it from all four ranks.
//
// EPCOMM_TEST_REPEATS sets the count (the default keeps CI short); `ctest -L stress` runs 2,000.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "epcomm/error.hpp"
#include "epcomm/fabric/transfer_engine.hpp"
#include "host_harness.hpp"
#include "support/multiprocess.hpp"

namespace epcomm {
namespace test {
namespace {

uint32_t repeats(uint32_t fallback) {
  const char* v = std::getenv("HOST_REPEATS");
  return v != nullptr && *v != '\0' ? static_cast<uint32_t>(std::strtoul(v, nullptr, 10)) : fallback;
}

bool tcpAvailable() {
  RunResult r = runProcesses(1, [](int) {
    fabric::EngineOptions eo;
    eo.provider = "tcp";
    try {
      fabric::TransferEngine::create(eo);
    } catch (const Error&) {
      _exit(3);
    }
  });
  return r.allOk();
}

Scenario tcpScenario() {
  Scenario sc;
  sc.W = 4;
  sc.E = 8;
  sc.K = 3;
  sc.H = 1024;
  sc.T = 256;
  sc.xDtype = DType::kBf16;
  sc.yDtype = DType::kBf16;
  sc.outDtype = DType::kBf16;
  sc.padding = 16;
  sc.layout = Layout::kBatched;
  sc.options.provider = "tcp";
  sc.options.timeoutMs = 10000;
  return sc;
}

// Four rounds on a fresh object; the last one is compared with the reference (the others move the same bytes).
void fourRounds(const Scenario& base, uint32_t i, int rank, Bootstrap& bootstrap) {
  Scenario sc = base;
  sc.seed = 1000 + i;
  host::HostAllToAll a2a(sc.config(rank), bootstrap, sc.options);
  for (uint32_t round = 0; round < 4; ++round) {
    try {
      if (round < 3) {
        const std::vector<RankInputs> in = makeRound(sc, round);
        DispatchOutputs mine(sc);
        a2a.dispatch(dispatchArgs(in[rank], mine));
        reference::HostTensor out = copyOf(in[rank].outInit);
        a2a.combine(combineArgs(in[rank], out));
      } else {
        ASSERT_TRUE(checkedRound(a2a, sc, rank, round)) << "object " << i;
      }
    } catch (const Error& e) {
      FAIL() << "object " << i << " round " << round << ": " << e.what();
    }
  }
}

// Every object in a fresh set of processes (each its own bootstrap): the first connections of each process.
TEST(HostRepeat, FreshProcessesOverTcp) {
  if (!tcpAvailable()) GTEST_SKIP() << "libfabric provider 'tcp' is not usable here";
  const uint32_t n = repeats(10);
  const Scenario base = tcpScenario();
  RunOptions opts;
  opts.deadlineMs = 60000;
  const auto start = std::chrono::steady_clock::now();
  uint32_t failed = 0;
  for (uint32_t i = 0; i < n; ++i) {
    RunResult result = runRanks(
        base.W, [&](int rank, Bootstrap& bootstrap) { fourRounds(base, i, rank, bootstrap); }, opts);
    if (!result.allOk()) {
      ++failed;
      ADD_FAILURE() << "object " << i << ":\n" << result.summary();
    }
    if ((i + 1) % 50 == 0) std::fprintf(stderr, "%u of %u objects, %u failed\n", i + 1, n, failed);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%u fresh process sets x 4 rounds over tcp in %.1f s: %u failed\n", n, s, failed);
}

// Every object in the same processes: connection setup of new endpoints next to the torn-down ones.
TEST(HostRepeat, FreshObjectsOverTcp) {
  if (!tcpAvailable()) GTEST_SKIP() << "libfabric provider 'tcp' is not usable here";
  const uint32_t n = repeats(10);
  const Scenario base = tcpScenario();
  RunOptions opts;
  opts.deadlineMs = 60000 + static_cast<int64_t>(n) * 4000;
  const auto start = std::chrono::steady_clock::now();
  RunResult result = runRanks(
      base.W,
      [&](int rank, Bootstrap& bootstrap) {
        for (uint32_t i = 0; i < n; ++i) {
          fourRounds(base, i, rank, bootstrap);
          if (::testing::Test::HasFatalFailure()) return;
          if (rank == 0 && (i + 1) % 50 == 0) std::fprintf(stderr, "%u of %u objects\n", i + 1, n);
        }
      },
      opts);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%u fresh objects x 4 rounds over tcp in %.1f s\n", n, s);
  EXPECT_TRUE(result.allOk()) << result.summary();
}

}  // namespace
}  // namespace test
}  // namespace epcomm
