// Soak: random configurations and rounds on the host backend, every output compared bitwise with the CPU reference,
// until a time budget runs out. Each configuration runs in a fresh set of W processes: world and DP sizes, experts,
// K, tokens, hidden sizes, every dispatch / expertY / outTokens dtype, index dtypes, both layouts and paddings,
// masked and repeated experts, skewed routing, empty ranks (bare 0-row views), boundM, accumulate, split halves,
// small private areas (the overflow path), tcp and shm, and sometimes two objects with interleaved halves.
//
//   SOAK_SECONDS  time budget (default 60: the CI run); SOAK_SEED  first seed (default 1). scripts/soak runs it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "epcomm/error.hpp"
#include "epcomm/fabric/transfer_engine.hpp"
#include "host_harness.hpp"
#include "support/fabric_probe.hpp"
#include "support/multiprocess.hpp"

namespace epcomm {
namespace test {
namespace {

uint64_t envNumber(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 10) : fallback;
}

// One soak case: a scenario, how its rounds are called, and optionally a second object in flight with it.
struct SoakCase {
  Scenario a, b;
  bool twoObjects = false;
  CallMode mode = CallMode::kFused;
  uint32_t rounds = 2;
};

template <typename T>
T pick(uint64_t& st, std::initializer_list<T> options) {
  return options.begin()[splitmix(st) % options.size()];
}

Scenario randomScenario(uint64_t& st, uint32_t W, const std::string& provider) {
  Scenario sc;
  sc.W = W;
  std::vector<uint32_t> dps;
  for (uint32_t d = 1; d <= W; ++d) {
    if (W % d == 0) dps.push_back(d);
  }
  sc.D = dps[splitmix(st) % dps.size()];
  sc.E = W * static_cast<uint32_t>(1 + splitmix(st) % 4);
  sc.K = 1 + static_cast<uint32_t>(splitmix(st) % std::min<uint32_t>(sc.E, 6));
  sc.T = 1 + static_cast<uint32_t>(splitmix(st) % 24);
  sc.H = pick<uint32_t>(st, {16, 32, 64, 72, 200});
  sc.xDtype = pick(st, {DType::kFp8E4M3, DType::kBf16, DType::kF16, DType::kF32});
  sc.scales = sc.xDtype == DType::kFp8E4M3 || splitmix(st) % 4 == 0;
  sc.yDtype = pick(st, {DType::kBf16, DType::kF16, DType::kF32});
  sc.outDtype = pick(st, {DType::kBf16, DType::kF16, DType::kF32});
  sc.indexDtype = pick(st, {DType::kI32, DType::kU32, DType::kI64});
  sc.layout = splitmix(st) % 2 == 0 ? Layout::kBatched : Layout::kPacked;
  sc.padding = pick<uint32_t>(st, {1, 2, 4, 16});
  sc.route = pick(st, {RouteMode::kUniform, RouteMode::kMasked, RouteMode::kDuplicates, RouteMode::kMasked,
                       RouteMode::kDuplicates, RouteMode::kOneRank});
  if (sc.route == RouteMode::kOneRank && sc.K > sc.E / W) sc.route = RouteMode::kMasked;  // K distinct of rank 0's L
  sc.ragged = splitmix(st) % 2 == 0;
  sc.bareEmpty = splitmix(st) % 2 == 0;
  sc.emptyGroup = splitmix(st) % 6 == 0 ? static_cast<int>(splitmix(st) % (W / sc.D)) : -1;
  sc.accumulate = splitmix(st) % 3 == 0;
  sc.seed = splitmix(st);
  sc.options.provider = provider;
  sc.options.timeoutMs = 30000;
  const uint32_t maxSend = (sc.T + sc.D - 1) / sc.D;
  sc.options.privateTokens = splitmix(st) % 2 == 0 ? -1 : static_cast<int64_t>(splitmix(st) % (maxSend + 1));
  return sc;
}

std::string describe(const Scenario& sc) {
  std::ostringstream oss;
  oss << "W=" << sc.W << " D=" << sc.D << " E=" << sc.E << " K=" << sc.K << " T=" << sc.T << " H=" << sc.H
      << " x=" << dtypeName(sc.xDtype) << (sc.scales ? "+scales" : "") << " y=" << dtypeName(sc.yDtype)
      << " out=" << dtypeName(sc.outDtype) << " idx=" << dtypeName(sc.indexDtype) << " " << layoutName(sc.layout)
      << " pad=" << sc.padding << " route=" << static_cast<int>(sc.route) << (sc.ragged ? " ragged" : "")
      << (sc.bareEmpty ? " bare" : "") << " empty=" << sc.emptyGroup << (sc.accumulate ? " acc" : "")
      << " P=" << sc.options.privateTokens << " " << sc.options.provider << " seed=" << sc.seed;
  return oss.str();
}

// Round `round` of two objects with their halves interleaved (send a, send b, receive b, receive a, ...).
bool interleavedRound(AllToAll& x, const Scenario& a, AllToAll& y, const Scenario& b, uint32_t rank, uint32_t round) {
  const std::vector<RankInputs> ia = makeRound(a, round), ib = makeRound(b, round);
  DispatchOutputs oa(a), ob(b);
  DispatchArgs da = dispatchArgs(ia[rank], oa), db = dispatchArgs(ib[rank], ob);
  da.doRecv = db.doRecv = false;
  x.dispatch(da);
  y.dispatch(db);
  da.doSend = db.doSend = false;
  da.doRecv = db.doRecv = true;
  y.dispatch(db);
  x.dispatch(da);
  reference::HostTensor outA = copyOf(ia[rank].outInit), outB = copyOf(ib[rank].outInit);
  CombineArgs ca = combineArgs(ia[rank], outA), cb = combineArgs(ib[rank], outB);
  ca.accumulate = a.accumulate;
  cb.accumulate = b.accumulate;
  ca.doRecv = cb.doRecv = false;
  y.combine(cb);
  x.combine(ca);
  ca.doSend = cb.doSend = false;
  ca.doRecv = cb.doRecv = true;
  x.combine(ca);
  y.combine(cb);
  const bool okA = matchesReference(a, rank, round, ia, oa, outA);
  const bool okB = matchesReference(b, rank, round, ib, ob, outB);
  return okA && okB;
}

TEST(HostSoak, RandomRoundsAgainstTheReference) {
  std::vector<std::string> providers;
  for (const char* p : {"tcp", "shm"}) {
    if (providerAvailable(p)) providers.emplace_back(p);
  }
  if (providers.empty()) GTEST_SKIP() << "neither libfabric tcp nor shm is usable here";
  const double budget = static_cast<double>(envNumber("SOAK_SECONDS", 60));
  uint64_t st = envNumber("SOAK_SEED", 1) * 0x2545F4914F6CDD1Dull;
  std::printf("soak: budget %.0f s, seed %llu\n", budget, static_cast<unsigned long long>(envNumber("SOAK_SEED", 1)));
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  uint64_t configs = 0, rounds = 0, twoObjectConfigs = 0, emptyRankConfigs = 0, failures = 0;
  RunOptions opts;
  opts.deadlineMs = 180000;
  while (elapsed() < budget) {
    SoakCase c;
    const uint32_t W = 2 + static_cast<uint32_t>(splitmix(st) % 3);
    const std::string provider = providers[splitmix(st) % providers.size()];
    c.a = randomScenario(st, W, provider);
    c.mode = splitmix(st) % 3 == 0 ? CallMode::kSplit : CallMode::kFused;
    c.rounds = 2 + static_cast<uint32_t>(splitmix(st) % 7);
    c.twoObjects = splitmix(st) % 4 == 0;
    if (c.twoObjects) c.b = randomScenario(st, W, provider);
    RunResult result = runRanks(
        static_cast<int>(W),
        [&](int rank, Bootstrap& bootstrap) {
          host::HostAllToAll x(c.a.config(rank), bootstrap, c.a.options);
          if (!c.twoObjects) {
            for (uint32_t round = 0; round < c.rounds; ++round) {
              ASSERT_TRUE(checkedRound(x, c.a, rank, round, c.mode)) << describe(c.a) << " round " << round;
            }
            return;
          }
          host::HostAllToAll y(c.b.config(rank), bootstrap, c.b.options);
          for (uint32_t round = 0; round < c.rounds; ++round) {
            ASSERT_TRUE(interleavedRound(x, c.a, y, c.b, rank, round)) << describe(c.a) << " | " << describe(c.b);
          }
        },
        opts);
    ++configs;
    rounds += c.rounds * (c.twoObjects ? 2 : 1);
    twoObjectConfigs += c.twoObjects ? 1 : 0;
    emptyRankConfigs += (c.a.ragged || c.a.emptyGroup >= 0) ? 1 : 0;
    if (!result.allOk()) {
      ++failures;
      ADD_FAILURE() << describe(c.a) << (c.twoObjects ? " | " + describe(c.b) : "") << " rounds " << c.rounds
                    << (c.mode == CallMode::kSplit ? " split" : " fused") << ":\n"
                    << result.summary();
    }
  }
  std::printf(
      "soak: %llu configurations (%llu with two objects in flight, %llu with empty ranks), %llu object-rounds, "
      "%llu failed, in %.0f s\n",
      static_cast<unsigned long long>(configs), static_cast<unsigned long long>(twoObjectConfigs),
      static_cast<unsigned long long>(emptyRankConfigs), static_cast<unsigned long long>(rounds),
      static_cast<unsigned long long>(failures), elapsed());
  EXPECT_GT(configs, 0u);
}

}  // namespace
}  // namespace test
}  // namespace epcomm
