// A rank whose engine holds an error (its write to a dead rank failed) tells a live peer why it gives a round up, and
// destroys its channel right after: the notice still reaches the live peer, which fails at once with the rank's
// message instead of running into its timeout (docs/failures.md: "fail fast, together"). The channel's teardown waits
// (bounded) for its notices to the peers not known lost, and skips only those whose writes failed.
// Real processes over tcp (tcp;ofi_rxm) and shm; HOST_NOTICE_REPEATS (default 2) repeats each case.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "channel_cases.hpp"
#include "epcomm/error.hpp"
#include "host_harness.hpp"
#include "proxy/protocol.hpp"
#include "proxy/proxy_channel.hpp"
#include "support/fabric_probe.hpp"
#include "support/multiprocess.hpp"

namespace epcomm {
namespace test {
namespace {

constexpr uint32_t kWorld = 3;
constexpr uint32_t kTeller = 0;      // has the engine error, tells, destroys its channel
constexpr uint32_t kListener = 1;    // live: waits for the teller's dispatch
constexpr uint32_t kVictim = 2;      // dies
constexpr int64_t kShortMs = 1000;   // the teller's (and the victim's) timeout: its write to the dead rank fails soon
constexpr int64_t kLongMs = 30000;   // the listener's timeout: only the notice ends its wait well before it
constexpr int kVictimLivesMs = 800;  // after its round-2 post: the listener's round-2 heads reach it first
constexpr uint64_t kStrayBytes = 64 * 1024;  // above shm's inject size: a write to a dead rank never completes there
const char* const kWhy = "the teller gives round 2 up after its write to the dead rank failed";

class ChannelNotice : public ::testing::TestWithParam<std::string> {};

TEST_P(ChannelNotice, ReachesLivePeerAfterEngineError) {
  const std::string provider = GetParam();
  SKIP_WITHOUT(provider);
  const char* env = std::getenv("HOST_NOTICE_REPEATS");
  const int repeats = env != nullptr ? std::max(1, std::atoi(env)) : 2;
  for (int rep = 0; rep < repeats; ++rep) {
    RunOptions ro;
    ro.deadlineMs = 60000;
    RunResult result = runRanks(
        kWorld,
        [&](int r, Bootstrap& bootstrap) {
          const uint32_t rank = static_cast<uint32_t>(r);
          proxy::ChannelOptions o;
          o.provider = provider;
          o.timeoutMs = rank == kListener ? kLongMs : kShortMs;
          o.bulkOverFabric.assign(kWorld, false);  // heads and immediates only
          if (rank == kVictim) {
            // Round 2's head post: the victim dies a moment later, once the listener's heads reached it.
            auto posts = std::make_shared<int>(0);
            o.onPosted = [posts](proxy::Phase phase) {
              if (phase != proxy::Phase::kHead || ++*posts != 3) return;
              std::this_thread::sleep_for(std::chrono::milliseconds(kVictimLivesMs));
              raise(SIGKILL);
            };
          }
          auto ch = std::make_unique<proxy::ProxyChannel>(channelConfig(kWorld, rank), bootstrap, o);
          // A region of the teller's, and the victim's target for the teller's stray write (through the channel's
          // own engine, so that the error is the channel's engine's).
          std::vector<uint8_t> stray(kStrayBytes, 1);
          auto strayMr = ch->engine().registerMemory(stray.data(), stray.size());
          const auto descs = allGatherBlobs(bootstrap, strayMr->desc().serialize());
          for (uint64_t round = 0; round < 2; ++round) {
            packHeads(*ch, 3);
            ch->postDispatch();
            ch->waitDispatch();
            ch->combineSendBufferFor(2ull * 64);
            ch->postCombine(DType::kBf16);
            ch->waitCombine();
          }
          if (rank == kVictim) {
            packHeads(*ch, 3);
            ch->postDispatch();
            std::this_thread::sleep_for(std::chrono::seconds(10));  // its proxy thread kills it
            raise(SIGKILL);
          }
          if (rank == kTeller) {
            // The victim is gone (the listener's round-2 heads reached it first); a write to it fails, and the
            // engine keeps the error.
            std::this_thread::sleep_for(std::chrono::milliseconds(kVictimLivesMs + 700));
            const fabric::PeerId victim = kVictim - 1;  // the channel's PeerIds skip its own rank
            const auto dst = fabric::MemoryDesc::deserialize(descs[kVictim].data(), descs[kVictim].size());
            ch->engine().write(victim, *strayMr, 0, dst, 0, kStrayBytes, false, 0, fabric::Completion{});
            const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(4 * kShortMs);
            bool failed = false;
            while (!failed && std::chrono::steady_clock::now() < until) {
              try {
                ch->engine().checkErrors();
                std::this_thread::sleep_for(std::chrono::milliseconds(5));
              } catch (const Error& e) {
                failed = true;
                std::printf("rank %u: engine error: %s\n", rank, e.message().c_str());
              }
            }
            ASSERT_TRUE(failed) << "the write to the dead rank did not fail";
            // Refuses round 2 and destroys the channel at once: the notice is in flight while the channel goes.
            ch->noticeRefused(false, kWhy);
            strayMr.reset();
            const auto start = std::chrono::steady_clock::now();
            ch.reset();
            // The teardown waits for the notice to the listener, not for the one to the victim (whose write failed):
            // that one would hold it to its bound, min(timeout, 2 s).
            const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            std::printf("rank %u: channel destroyed in %.0f ms\n", rank, sec * 1e3);
            EXPECT_LT(sec, 0.8 * kShortMs / 1000.0);
            return;
          }
          // The listener: round 2's heads reach the victim while it lives; then it waits for the teller's.
          packHeads(*ch, 3);
          ch->postDispatch();
          const auto start = std::chrono::steady_clock::now();
          try {
            ch->waitDispatch();
            ADD_FAILURE() << "round 2 completed without the teller";
          } catch (const Error& e) {
            const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            std::printf("rank %u: raised after %.0f ms: %s\n", rank, sec * 1e3, e.message().c_str());
            EXPECT_EQ(e.code(), ErrorCode::kPeerFailure) << e.what();
            EXPECT_NE(e.message().find("rank 0 aborted dispatch: " + std::string(kWhy)), std::string::npos) << e.what();
            // The teller told it within ~2.5 s of its post (the victim's life, the failed write): far below the
            // listener's own timeout, which it would wait out without the notice.
            EXPECT_LT(sec, kLongMs / 3000.0) << e.what();
          }
          strayMr.reset();
          ch.reset();
        },
        ro);
    ASSERT_EQ(result.ranks.size(), static_cast<size_t>(kWorld));
    EXPECT_EQ(result.ranks[kVictim].signal, SIGKILL) << "repeat " << rep << ": " << result.summary();
    EXPECT_TRUE(result.ranks[kTeller].ok()) << "repeat " << rep << ": " << result.summary();
    EXPECT_TRUE(result.ranks[kListener].ok()) << "repeat " << rep << ": " << result.summary();
    if (::testing::Test::HasFailure()) break;
  }
}

INSTANTIATE_TEST_SUITE_P(Host, ChannelNotice, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace test
}  // namespace epcomm
