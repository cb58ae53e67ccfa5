// Soak of the GPU backends: random cases against the CPU reference, in one set of W processes per backend and world
// size (rank r on GPU r % devices, so 2-4 ranks share a one-GPU machine), until a round target or a time bound. A case
// is one or two objects in flight (two streams), each with its own random configuration: experts, K, tokens, hidden
// size, DP groups, every dispatch / expertY / outTokens dtype, index dtypes, both layouts and paddings, masked and
// repeated experts, rounds in which nothing crosses between ranks, ragged m with empty ranks (half of them passing bare
// 0-row views: null data, zero strides), a device boundM, accumulate, fused, split or mixed calls, and eager calls or
// one CUDA graph captured and replayed; then several rounds with new inputs, every output checked. Prints the counts.
//
//   GPU_SOAK_BACKENDS        comma list (default: every GPU backend built and runnable here)
//   GPU_SOAK_WORLDS          comma list of world sizes (default 2,3,4)
//   GPU_SOAK_ROUNDS          object-rounds per backend, spread evenly over the world sizes (default 240)
//   GPU_SOAK_SECONDS         time bound per backend, spread likewise (default 300); with GPU_SOAK_ROUNDS set, a run
//                            that stops short of its rounds fails
//   GPU_SOAK_SEED            seed (default 1): the same seed replays the same cases
//   GPU_SOAK_PAIRS_MAX_WORLD two objects in flight only up to this world size (default 4)
//   GPU_SOAK_CASE_ROUNDS     most rounds of one case (default 40, at least 8): a case runs 8 to this many rounds on
//                            its objects, each with new inputs; long cases spend less of the soak creating objects
// scripts/soak --gpu runs it.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "epcomm/error.hpp"
#include "gpu_harness.hpp"
#include "gpu_rounds.hpp"
#include "support/multiprocess.hpp"
#include "support/scoped_env.hpp"

namespace epcomm {
namespace gputest {
namespace {

uint64_t splitmix(uint64_t& st) {
  uint64_t z = (st += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

template <typename T>
T pick(uint64_t& st, std::initializer_list<T> options) {
  return options.begin()[splitmix(st) % options.size()];
}

std::vector<std::string> listFromEnv(const char* name, const std::vector<std::string>& fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  std::vector<std::string> out;
  std::stringstream ss(v);
  for (std::string item; std::getline(ss, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// One object of a case.
struct ObjectPlan {
  Scenario s;
  CallMode mode = CallMode::kFused;
  bool graph = false;  // one graph captured at the first round, replayed every round
  bool bare = false;   // an empty rank passes bare 0-row views (eager calls only)
};

struct SoakCase {
  std::vector<ObjectPlan> objects;
  uint32_t rounds = 1;
};

Scenario randomScenario(uint64_t& st, const std::string& backend, uint32_t W) {
  Scenario s = scenarioFor(backend, W);
  std::vector<uint32_t> dps;
  for (uint32_t d = 1; d <= W; ++d) {
    if (W % d == 0) dps.push_back(d);
  }
  s.dp = splitmix(st) % 2 == 0 ? 1 : dps[splitmix(st) % dps.size()];
  s.experts = W * pick<uint32_t>(st, {1, 2, 3, 4, 6, 8});
  s.topK = 1 + static_cast<uint32_t>(splitmix(st) % std::min<uint32_t>(s.experts, 8));
  // Small rounds (the reference of every rank is computed on every rank): many of them per second.
  s.maxTokens = pick<uint32_t>(st, {1, 2, 3, 4, 8, 16, 32});
  s.hidden = pick<uint32_t>(st, {64, 128, 256, 512});
  s.xType = pick(st, {DType::kFp8E4M3, DType::kBf16, DType::kF16, DType::kF32});
  s.scales = s.xType == DType::kFp8E4M3 || splitmix(st) % 4 == 0;
  s.yType = pick(st, {DType::kBf16, DType::kF16, DType::kF32});
  s.outType = pick(st, {DType::kBf16, DType::kF16, DType::kF32});
  s.indexType = pick(st, {DType::kI32, DType::kU32, DType::kI64});
  s.layout = splitmix(st) % 2 == 0 ? Layout::kBatched : Layout::kPacked;
  s.padding = pick<uint32_t>(st, {1, 2, 4, 16});
  s.masked = splitmix(st) % 2 == 0;
  s.ownExperts = s.dp == 1 && splitmix(st) % 10 == 0;
  s.ragged = splitmix(st) % 4 != 0;
  s.deviceBound = splitmix(st) % 3 == 0;
  s.accumulate = splitmix(st) % 3 == 0;
  s.seed = splitmix(st) % 1000000007ull;
  return s;
}

SoakCase randomCase(uint64_t& st, const std::string& backend, uint32_t W, uint32_t pairsMaxWorld, uint32_t caseRounds) {
  SoakCase c;
  const bool pair = W <= pairsMaxWorld && splitmix(st) % 3 == 0;
  for (int i = 0; i < (pair ? 2 : 1); ++i) {
    ObjectPlan p;
    p.s = randomScenario(st, backend, W);
    p.mode = pick(st, {CallMode::kFused, CallMode::kFused, CallMode::kSplit, CallMode::kMixed});
    p.graph = splitmix(st) % 4 == 0;
    if (p.graph) {
      p.s.ragged = false;  // m is part of the captured calls; the token count varies through *boundM
      p.s.deviceBound = true;
    }
    p.bare = !p.graph && splitmix(st) % 2 == 0;
    c.objects.push_back(p);
  }
  c.rounds = 8 + static_cast<uint32_t>(splitmix(st) % (caseRounds - 7));
  return c;
}

std::string describe(const ObjectPlan& p) {
  const Scenario& s = p.s;
  std::ostringstream oss;
  oss << "W=" << s.world << " D=" << s.dp << " E=" << s.experts << " K=" << s.topK << " T=" << s.maxTokens
      << " H=" << s.hidden << " x=" << dtypeName(s.xType) << (s.scales ? "+scales" : "") << " y=" << dtypeName(s.yType)
      << " out=" << dtypeName(s.outType) << " idx=" << dtypeName(s.indexType)
      << (s.layout == Layout::kPacked ? " packed" : " batched") << " pad=" << s.padding << (s.masked ? " masked" : "")
      << (s.ownExperts ? " own" : "") << (s.ragged ? " ragged" : "") << (s.deviceBound ? " bound" : "")
      << (s.accumulate ? " acc" : "") << " " << callModeName(p.mode) << (p.graph ? " graph" : "")
      << (p.bare ? " bare" : "") << " seed=" << s.seed;
  return oss.str();
}

// Counts of one rank (summed over ranks at the end where marked).
struct Counts {
  uint64_t cases = 0, objectRounds = 0, pairRounds = 0, graphRounds = 0, splitRounds = 0;
  uint64_t emptyRankRounds = 0, bareRankRounds = 0;  // summed over ranks: a rank with no tokens in an object-round
  uint64_t failures = 0;
};

struct LiveObject {
  ObjectPlan plan;
  std::unique_ptr<AllToAll> a2a;
  DeviceTensors dev;
  std::unique_ptr<CapturedRound> graph;
};

// Runs case `c` on this rank. Mismatches are collected (the rank keeps its calls in step with its peers); an exception
// (a timeout, a refused call) ends the case. Returns "" or what failed.
std::string runCase(const SoakCase& c, const std::string& backend, uint32_t rank, Bootstrap& bootstrap,
                    cudaStream_t streams[2], DeviceBuffer& scratch, Counts& n) {
  std::vector<LiveObject> objs(c.objects.size());
  std::string failed;
  try {
    for (size_t i = 0; i < objs.size(); ++i) {
      objs[i].plan = c.objects[i];
      objs[i].a2a = createAllToAll(scenarioConfig(objs[i].plan.s, rank), bootstrap, backend);
      allocateDevice(objs[i].plan.s, rank, objs[i].dev);
    }
    for (uint32_t round = 0; round < c.rounds; ++round) {
      std::vector<std::unique_ptr<Round>> rounds;
      for (size_t i = 0; i < objs.size(); ++i) {
        LiveObject& o = objs[i];
        rounds.push_back(std::make_unique<Round>(o.plan.s, o.plan.s.seed * 1000 + round));
        rounds.back()->upload(rank, o.dev);
        if (tokensOf(o.dev) == 0) ++n.emptyRankRounds;
        if (o.plan.bare && makeEmptyViewsBare(o.dev)) ++n.bareRankRounds;
        if (o.plan.graph) {
          if (!o.graph) {
            o.graph = std::make_unique<CapturedRound>(*o.a2a, o.dev, o.plan.mode, rank, streams[i], scratch);
          }
          o.graph->replay(streams[i]);
        } else {
          launchRound(*o.a2a, o.dev, o.plan.mode, rank, streams[i], scratch);
        }
      }
      for (size_t i = 0; i < objs.size(); ++i) {
        LiveObject& o = objs[i];
        finishRound(*o.a2a, streams[i]);
        const std::string err = rounds[i]->check(rank, o.dev);
        if (!err.empty() && failed.empty()) {
          failed = "rank " + std::to_string(rank) + " object " + std::to_string(i) + " round " + std::to_string(round) +
                   ":\n" + err;
        }
        ++n.objectRounds;
        n.pairRounds += objs.size() > 1 ? 1 : 0;
        n.graphRounds += o.plan.graph ? 1 : 0;
        n.splitRounds += o.plan.mode != CallMode::kFused ? 1 : 0;
      }
    }
  } catch (const std::exception& e) {
    failed += std::string(failed.empty() ? "" : "\n") + "rank " + std::to_string(rank) + ": " + e.what();
  }
  for (LiveObject& o : objs) o.graph.reset();  // each graph before its object
  return failed;
}

// Runs the soak of `backend` on `world` ranks for at most `rounds` object-rounds and `seconds`; returns rank 0's
// counts.
Counts soak(const std::string& backend, uint32_t world, uint64_t rounds, double seconds, uint64_t seed,
            uint32_t pairsMaxWorld, uint32_t caseRounds) {
  char path[] = "/tmp/epcomm-gpu-soak-XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  if (fd >= 0) close(fd);
  test::RunOptions o;
  o.deadlineMs = static_cast<int64_t>(seconds * 1000) + 240000;
  test::RunResult result = test::runRanks(
      static_cast<int>(world),
      [&](int r, Bootstrap& bootstrap) {
        const uint32_t rank = static_cast<uint32_t>(r);
        useRankDevice(r);
        Stream s1, s2;
        cudaStream_t streams[2] = {s1.get(), s2.get()};
        DeviceBuffer scratch(1 << 16);
        uint64_t st = seed * 0x2545F4914F6CDD1Dull + world * 7919 + std::hash<std::string>()(backend);
        Counts n;
        const auto start = std::chrono::steady_clock::now();
        auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
        for (;;) {
          // Rank 0 decides from its clock; every rank draws the same cases, so the round counts agree.
          int32_t go = n.objectRounds < rounds && elapsed() < seconds ? 1 : 0;
          bootstrap.broadcast(&go, sizeof(go), 0);
          if (go == 0) break;
          const SoakCase c = randomCase(st, backend, world, pairsMaxWorld, caseRounds);
          ++n.cases;
          const std::string err = runCase(c, backend, rank, bootstrap, streams, scratch, n);
          int32_t bad = err.empty() ? 0 : 1;
          std::vector<int32_t> all(world);
          bootstrap.allGather(&bad, all.data(), sizeof(bad));
          bool anyBad = false;
          for (int32_t b : all) anyBad = anyBad || b != 0;
          if (!anyBad) continue;
          ++n.failures;
          std::ostringstream what;
          for (size_t i = 0; i < c.objects.size(); ++i) what << "\n  object " << i << ": " << describe(c.objects[i]);
          ADD_FAILURE() << backend << " case " << n.cases << " (" << c.rounds << " rounds):" << what.str() << "\n"
                        << (err.empty() ? "(this rank matched; a peer failed)" : err);
          break;  // a failed case may leave the ranks out of step
        }
        uint64_t mine[2] = {n.emptyRankRounds, n.bareRankRounds};
        std::vector<uint64_t> all(2 * world);
        bootstrap.allGather(mine, all.data(), sizeof(mine));
        if (rank != 0) return;
        n.emptyRankRounds = n.bareRankRounds = 0;
        for (uint32_t q = 0; q < world; ++q) {
          n.emptyRankRounds += all[2 * q];
          n.bareRankRounds += all[2 * q + 1];
        }
        std::ofstream out(path);
        out << n.cases << " " << n.objectRounds << " " << n.pairRounds << " " << n.graphRounds << " " << n.splitRounds
            << " " << n.emptyRankRounds << " " << n.bareRankRounds << " " << n.failures << "\n";
      },
      o);
  EXPECT_TRUE(result.allOk()) << backend << " W=" << world << ":\n" << result.summary();
  Counts n;
  std::ifstream in(path);
  in >> n.cases >> n.objectRounds >> n.pairRounds >> n.graphRounds >> n.splitRounds >> n.emptyRankRounds >>
      n.bareRankRounds >> n.failures;
  unlink(path);
  if (!result.allOk() && n.failures == 0) n.failures = 1;
  return n;
}

TEST(GpuSoak, RandomRoundsAgainstTheReference) {
  std::vector<std::string> backends;
  std::string skipped;
  for (const std::string& b : listFromEnv("GPU_SOAK_BACKENDS", gpuBackendsBuilt())) {
    const std::string why = whyNotRunnable(b);
    if (why.empty()) {
      backends.push_back(b);
    } else {
      skipped += " " + b + ": " + why + ";";
    }
  }
  if (backends.empty()) GTEST_SKIP() << "no GPU backend can run here:" << skipped;
  std::vector<uint32_t> worlds;
  for (const std::string& w : listFromEnv("GPU_SOAK_WORLDS", {"2", "3", "4"})) {
    worlds.push_back(static_cast<uint32_t>(std::stoul(w)));
  }
  ASSERT_FALSE(worlds.empty());
  const bool roundsGiven = std::getenv("GPU_SOAK_ROUNDS") != nullptr;
  const uint64_t rounds = test::envNumber("GPU_SOAK_ROUNDS", 240);
  const double seconds = static_cast<double>(test::envNumber("GPU_SOAK_SECONDS", 300));
  const uint64_t seed = test::envNumber("GPU_SOAK_SEED", 1);
  const uint32_t pairsMaxWorld = static_cast<uint32_t>(test::envNumber("GPU_SOAK_PAIRS_MAX_WORLD", 4));
  const uint32_t caseRounds = static_cast<uint32_t>(test::envNumber("GPU_SOAK_CASE_ROUNDS", 40));
  ASSERT_GE(caseRounds, 8u) << "GPU_SOAK_CASE_ROUNDS must be at least 8";
  std::printf("gpu soak: backends");
  for (const std::string& b : backends) std::printf(" %s", b.c_str());
  std::printf(", worlds");
  for (uint32_t w : worlds) std::printf(" %u", w);
  std::printf(", %llu rounds and %.0f s per backend, seed %llu%s\n", static_cast<unsigned long long>(rounds), seconds,
              static_cast<unsigned long long>(seed), skipped.empty() ? "" : (", skipped:" + skipped).c_str());
  for (const std::string& backend : backends) {
    BackendEnv env(backend);
    Counts total;
    const auto start = std::chrono::steady_clock::now();
    for (size_t wi = 0; wi < worlds.size(); ++wi) {
      const uint32_t W = worlds[wi];
      // This world's share: what the earlier ones left of the rounds, over the worlds still to run.
      const uint64_t share =
          (rounds - std::min(rounds, total.objectRounds) + (worlds.size() - wi) - 1) / (worlds.size() - wi);
      const auto t0 = std::chrono::steady_clock::now();
      const Counts n = soak(backend, W, share, seconds / worlds.size(), seed, pairsMaxWorld, caseRounds);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf(
          "gpu soak %s W=%u: %llu object-rounds in %llu cases (%llu with two objects in flight, %llu graph replays, "
          "%llu split or mixed), %llu rank-rounds without tokens (%llu as bare views), %llu failed, %.0f s (%.0f "
          "rounds/s)\n",
          backend.c_str(), W, static_cast<unsigned long long>(n.objectRounds), static_cast<unsigned long long>(n.cases),
          static_cast<unsigned long long>(n.pairRounds), static_cast<unsigned long long>(n.graphRounds),
          static_cast<unsigned long long>(n.splitRounds), static_cast<unsigned long long>(n.emptyRankRounds),
          static_cast<unsigned long long>(n.bareRankRounds), static_cast<unsigned long long>(n.failures), s,
          s > 0 ? n.objectRounds / s : 0.0);
      std::fflush(stdout);
      total.cases += n.cases;
      total.objectRounds += n.objectRounds;
      total.failures += n.failures;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("gpu soak %s: %llu object-rounds in %llu cases, %llu failed, %.0f s\n", backend.c_str(),
                static_cast<unsigned long long>(total.objectRounds), static_cast<unsigned long long>(total.cases),
                static_cast<unsigned long long>(total.failures), s);
    std::fflush(stdout);
    EXPECT_EQ(total.failures, 0u) << backend;
    if (roundsGiven && total.failures == 0) {
      EXPECT_GE(total.objectRounds, rounds)
          << backend << ": the time bound (GPU_SOAK_SECONDS = " << seconds << ") ended the soak first";
    }
  }
}

}  // namespace
}  // namespace gputest
}  // namespace epcomm
