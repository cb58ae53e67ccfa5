#include "elastic_cases.hpp"

#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "gpu_rounds.hpp"
#include "support/multiprocess.hpp"

namespace epcomm {
namespace gputest {

const char* killPointName(KillPoint when) {
  return when == KillPoint::kMidDispatch  ? "MidDispatch"
         : when == KillPoint::kMidCombine ? "MidCombine"
                                          : "BetweenRounds";
}

int roundsAfter(const char* variable, int byDefault) {
  const char* v = std::getenv(variable);
  return v != nullptr && std::atoi(v) > 0 ? std::atoi(v) : byDefault;
}

Scenario elasticScenario(const std::string& backend, uint32_t world, uint32_t dp) {
  Scenario s = scenarioFor(backend, world);
  s.dp = dp;
  s.experts = 4 * world;
  s.topK = 3;
  s.maxTokens = 32;
  s.hidden = 256;
  s.masked = true;
  return s;
}

ElasticRank::ElasticRank(const Scenario& scenario, uint32_t rank)
    : device(useRankDevice(static_cast<int>(rank))), scratch(1 << 16), s(scenario) {
  allocateDevice(s, rank, dev);
}

void roundsUnderMask(AllToAll& a2a, const Scenario& s, uint32_t rank, DeviceTensors& dev, cudaStream_t stream,
                     DeviceBuffer& scratch, uint64_t seed0, int rounds) {
  for (int i = 0; i < rounds; ++i) {
    const uint64_t seed = seed0 + static_cast<uint64_t>(i);
    const uint64_t before = a2a.droppedTokens();
    const std::string err = checkedRound(a2a, s, rank, dev, CallMode::kFused, stream, scratch, seed);
    ASSERT_TRUE(err.empty()) << "rank " << rank << ", round " << i << " under the mask:\n" << err;
    if (i < 8) {
      const Round expected(s, seed);
      EXPECT_EQ(a2a.droppedTokens() - before, expected.dropped(rank)) << "rank " << rank << ", round " << i;
    }
  }
}

namespace {

// The round the victim does not finish, on every rank: the survivors' calls up to the point where they wait for it.
void startInterruptedRound(AllToAll& a2a, DeviceTensors& dev, KillPoint when, uint32_t rank, uint32_t victim,
                           cudaStream_t stream, Bootstrap& bootstrap) {
  if (when == KillPoint::kMidDispatch) {
    if (rank != victim) a2a.dispatch(dev.dispatch);  // the survivors wait for the victim's tokens
  } else if (when == KillPoint::kMidCombine) {
    a2a.dispatch(dev.dispatch);
    finishRound(a2a, stream);
    if (rank != victim) a2a.combine(dev.combine);  // ... for its expert outputs
  } else {
    a2a.dispatch(dev.dispatch);
    a2a.combine(dev.combine);
    finishRound(a2a, stream);
  }
  bootstrap.barrier();
}

}  // namespace

void runKillCase(const Scenario& s0, const KillCase& k) {
  const uint32_t W = s0.world;
  test::RunOptions o;
  o.deadlineMs = 600000;
  test::RunResult result = test::runRanks(
      static_cast<int>(W),
      [&](int r, Bootstrap& bootstrap) {
        const uint32_t rank = static_cast<uint32_t>(r);
        ElasticRank er(s0, rank);
        Scenario& s = er.s;
        DeviceTensors& dev = er.dev;
        DeviceBuffer& scratch = er.scratch;
        Stream& stream = er.stream;
        std::unique_ptr<AllToAll> a2a = createAllToAll(scenarioConfig(s, rank), bootstrap, k.backend);
        ASSERT_EQ(a2a->activeRanks(), std::vector<int32_t>(W, 1));
        for (uint64_t seed = 1; seed <= 2; ++seed) {
          ASSERT_EQ(checkedRound(*a2a, s, rank, dev, CallMode::kFused, stream.get(), scratch, seed), "");
        }
        EXPECT_EQ(a2a->droppedTokens(), 0u);

        Round interrupted(s, 3);
        interrupted.upload(rank, dev);
        dev.dispatch.stream = dev.combine.stream = stream.get();
        startInterruptedRound(*a2a, dev, k.when, rank, k.victim, stream.get(), bootstrap);
        if (rank == k.victim) raise(SIGKILL);
        const auto start = std::chrono::steady_clock::now();
        bool raised = false;
        try {
          if (k.when == KillPoint::kBetweenRounds) {
            interrupted.upload(rank, dev);
            a2a->dispatch(dev.dispatch);
          }
          if (k.when != KillPoint::kMidCombine) a2a->combine(dev.combine);
          finishRound(*a2a, stream.get());
        } catch (const Error& e) {
          raised = true;
          const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
          std::printf("%s: W = %u %s, rank %u killed: rank %u raised after %.0f ms: %s\n", k.label.c_str(), W,
                      killPointName(k.when), k.victim, rank, ms, e.what());
          EXPECT_NE(std::find(k.codes.begin(), k.codes.end(), e.code()), k.codes.end()) << e.what();
          EXPECT_NE(e.message().find("without rank " + std::to_string(k.victim)), std::string::npos) << e.what();
          EXPECT_NE(e.message().find("the object goes on"), std::string::npos) << e.what();
          EXPECT_LT(ms, static_cast<double>(k.boundMs)) << e.what();
        }
        ASSERT_TRUE(raised) << "the round completed without rank " << k.victim;
        std::vector<int32_t> mask(W, 1);
        mask[k.victim] = 0;
        ASSERT_EQ(a2a->activeRanks(), mask);
        s.active = mask;
        roundsUnderMask(*a2a, s, rank, dev, stream.get(), scratch, 100, k.roundsAfter);
        a2a.reset();  // among the survivors: must not wait for the dead rank
      },
      o);
  ASSERT_EQ(result.ranks.size(), W);
  for (uint32_t r = 0; r < W; ++r) {
    if (r == k.victim) {
      EXPECT_EQ(result.ranks[r].signal, SIGKILL) << result.summary();
    } else {
      EXPECT_TRUE(result.ranks[r].ok()) << result.summary();
    }
  }
}

void runCallerMasksARank(const Scenario& s0, const std::string& backend, int rounds) {
  constexpr uint32_t W = 4;
  ASSERT_EQ(s0.world, W);
  test::RunOptions o;
  o.deadlineMs = 600000;
  test::RunResult result = test::runRanks(
      static_cast<int>(W),
      [&](int r, Bootstrap& bootstrap) {
        const uint32_t rank = static_cast<uint32_t>(r);
        ElasticRank er(s0, rank);
        Scenario& s = er.s;
        DeviceTensors& dev = er.dev;
        DeviceBuffer& scratch = er.scratch;
        Stream& stream = er.stream;
        std::unique_ptr<AllToAll> a2a = createAllToAll(scenarioConfig(s, rank), bootstrap, backend);
        ASSERT_EQ(checkedRound(*a2a, s, rank, dev, CallMode::kFused, stream.get(), scratch, 1), "");
        const std::vector<int32_t> mask = {1, 0, 1, 1};
        EXPECT_THROW(a2a->setActiveRanks({1, 0, 1}), Error);     // wrong size: refused before anything
        EXPECT_THROW(a2a->setActiveRanks({0, 0, 0, 0}), Error);  // no rank left
        EXPECT_THROW(a2a->setActiveRanks({1, 2, 1, 1}), Error);  // not 0 / 1
        ASSERT_EQ(checkedRound(*a2a, s, rank, dev, CallMode::kFused, stream.get(), scratch, 2), "")
            << "a refused mask left the object as it was";
        a2a->setActiveRanks(mask);
        EXPECT_EQ(a2a->activeRanks(), mask);
        if (rank == 1) {
          EXPECT_THROW(a2a->dispatch(dev.dispatch), Error) << "the rank that left went on";
        } else {
          EXPECT_THROW(a2a->setActiveRanks({1, 1, 1, 1}), Error);  // a masked rank never comes back
          s.active = mask;
          roundsUnderMask(*a2a, s, rank, dev, stream.get(), scratch, 200, rounds);
        }
        a2a.reset();
        bootstrap.barrier();  // the bootstrap is intact: nobody died
      },
      o);
  EXPECT_TRUE(result.allOk()) << result.summary();
}

}  // namespace gputest
}  // namespace epcomm
