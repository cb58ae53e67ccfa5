// Churn: many objects created and destroyed in one set of processes, two in flight at a time, each round checked
// against the reference; open file descriptors, threads and resident memory at the end are those after the first
// ten objects (fabric endpoints hold sockets or shared memory: they show in the file descriptors and memory).
//
// CHURN_OBJECTS sets the count (default 200, the full run is 2,000). The heap check compares the second half with a
// bound per object, and the providers' retained memory per endpoint settles over the first ~100 objects: on a 2-core
// VM, shm grew ~800 B per object between objects 50 and 99 (a 1 KiB bound: under load some runs went over it), ~300 B
// between 150 and 299.
#include <gtest/gtest.h>

#include <malloc.h>
#include <unistd.h>
#include <algorithm>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>

#include "epcomm/error.hpp"
#include "epcomm/fabric/transfer_engine.hpp"
#include "host_harness.hpp"
#include "support/fabric_probe.hpp"
#include "support/multiprocess.hpp"
#include "support/process_usage.hpp"
#include "support/scoped_env.hpp"

namespace epcomm {
namespace test {
namespace {

struct Usage : ProcessUsage {
  int64_t residentKiB = 0;
};

Usage usage() {
  Usage u;
  u.fds = openFds();
  u.threads = threadCount();
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  u.residentKiB = resident * (sysconf(_SC_PAGESIZE) / 1024);
  u.heapBytes = heapInUse();  // one arena, see the test
  return u;
}

class HostChurn : public ::testing::TestWithParam<std::string> {};

TEST_P(HostChurn, ObjectsComeAndGoTwoInFlight) {
  const std::string provider = GetParam();
  if (!providerAvailable(provider)) GTEST_SKIP() << "libfabric provider '" << provider << "' is not usable here";
  const uint32_t n = static_cast<uint32_t>(envNumber("CHURN_OBJECTS", 200));
  Scenario sc;
  sc.W = 3;
  sc.E = 6;
  sc.K = 2;
  sc.T = 4;
  sc.H = 16;
  sc.route = RouteMode::kMasked;
  sc.options.provider = provider;
  RunOptions opts;
  opts.deadlineMs = 120000 + static_cast<int64_t>(n) * 1000;
  const auto start = std::chrono::steady_clock::now();
  RunResult result = runRanks(
      sc.W,
      [&](int rank, Bootstrap& bootstrap) {
        // One malloc arena: glibc otherwise gives new threads (each object's progress and proxy threads) arenas of
        // their own, and its in-use count would miss them.
        mallopt(M_ARENA_MAX, 1);
        std::unique_ptr<host::HostAllToAll> older;
        // Measured with no object alive and every rank past its teardown: what an object holds (buffers, provider
        // pools of ~100 MB resident over tcp, sockets, threads) is gone then, and what remains is what leaked.
        auto quiescent = [&] {
          older.reset();
          bootstrap.barrier();
          return usage();
        };
        Usage early, mid;
        for (uint32_t i = 0; i < n; ++i) {
          Scenario s = sc;
          s.seed = i;
          auto newer = std::make_unique<host::HostAllToAll>(s.config(rank), bootstrap, s.options);
          // Both in flight: the older one's round runs after the newer one was created.
          if (older) ASSERT_TRUE(checkedRound(*older, s, rank, 2 * i + 1)) << "object " << i - 1;
          ASSERT_TRUE(checkedRound(*newer, s, rank, 2 * i)) << "object " << i;
          older = std::move(newer);  // the one before is destroyed here
          if (i == 9) early = quiescent();
          if (i == n / 2) mid = quiescent();
        }
        const Usage late = quiescent();
        expectNoGrowth(early, mid, late, n);
        if (rank == 0) {
          std::printf(
              "%s: %u objects, fds %d -> %d, threads %d -> %d, heap in use %lld -> %lld -> %lld B, resident %lld "
              "-> %lld KiB\n",
              GetParam().c_str(), n, early.fds, late.fds, early.threads, late.threads,
              static_cast<long long>(early.heapBytes), static_cast<long long>(mid.heapBytes),
              static_cast<long long>(late.heapBytes), static_cast<long long>(early.residentKiB),
              static_cast<long long>(late.residentKiB));
        }
      },
      opts);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%s: %u objects created and destroyed (two in flight) in %.1f s\n", provider.c_str(), n, s);
  EXPECT_TRUE(result.allOk()) << result.summary();
}

INSTANTIATE_TEST_SUITE_P(Host, HostChurn, ::testing::Values("tcp", "shm"), [](const auto& info) { return info.param; });

}  // namespace
}  // namespace test
}  // namespace epcomm
