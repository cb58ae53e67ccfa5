// TransferEngine with a peer killed (SIGKILL) in the middle of a round of writes to every peer: the writes between
// the survivors must go on completing in time, and every failure a survivor sees must name the dead peer only. The
// provider refuses (FI_EAGAIN) writes to a dead peer, tcp;ofi_rxm once it saw the connection go and shm once the dead
// peer's command queue is full; the engine queues them per peer, so they may hold no write to another peer.
// Five processes, one engine each (one endpoint, the channel's non-elastic set-up, and two endpoints sharded by peer),
// the victim in the middle; every round writes a large and a small write-with-immediate to every peer, the dead one
// first, so that anything queued behind it would show. DEAD_PEER_REPEATS (default 1) repeats each case.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "epcomm/bootstrap.hpp"
#include "epcomm/error.hpp"
#include "epcomm/fabric/transfer_engine.hpp"
#include "support/fabric_probe.hpp"
#include "support/multiprocess.hpp"

namespace epcomm {
namespace fabric {
namespace {

constexpr int kWorld = 5;
constexpr int kVictim = 2;
constexpr int kRounds = 12;  // rounds the survivors run; the victim dies in round kKillRound
constexpr int kKillRound = 3;
// tcp: 1 MiB. shm: within its inject size. shm completes the operations of an endpoint that need the receiver's
// answer (larger ones) in order, so one to a dead peer holds those behind it to any peer (docs/failures.md).
uint64_t largeBytes(const std::string& provider) { return provider == "shm" ? 4096 : 1 << 20; }
constexpr uint64_t kSmall = 64;  // within the inject size of both providers
constexpr int64_t kEngineTimeoutMs = 4000;
// A round among the survivors must finish well within the engine's timeout: a write held behind one to the dead
// peer waits out that timeout (its deadline: the timeout and 10 %); loaded 2-core machines need the margin.
constexpr int64_t kRoundBoundMs = 2500;

uint8_t pattern(int rank, int round, uint64_t i) {
  return static_cast<uint8_t>((i * 131u) ^ (i >> 9) ^ (rank * 71u + round * 13u + 5u));
}

// Variable-length blobs (engine addresses, descriptors) through the fixed-size bootstrap allGather.
std::vector<std::vector<uint8_t>> allGather(Bootstrap& b, const std::vector<uint8_t>& mine) {
  const int world = b.worldSize();
  uint64_t len = mine.size();
  std::vector<uint64_t> lens(world);
  b.allGather(&len, lens.data(), sizeof(len));
  const uint64_t maxLen = std::max<uint64_t>(1, *std::max_element(lens.begin(), lens.end()));
  std::vector<uint8_t> padded(maxLen, 0), all(maxLen * world);
  std::copy(mine.begin(), mine.end(), padded.begin());
  b.allGather(padded.data(), all.data(), maxLen);
  std::vector<std::vector<uint8_t>> out(world);
  for (int r = 0; r < world; ++r) out[r].assign(all.begin() + r * maxLen, all.begin() + r * maxLen + lens[r]);
  return out;
}

// Immediates: one value per (sender, size), counted by the receiver.
uint32_t largeImm(int sender) { return 100 + static_cast<uint32_t>(sender); }
uint32_t smallImm(int sender) { return 200 + static_cast<uint32_t>(sender); }

// Completions of this rank's writes, per destination rank.
struct PerPeer {
  std::mutex mu;
  std::vector<std::string> error = std::vector<std::string>(kWorld);
  std::vector<std::atomic<uint64_t>> done = std::vector<std::atomic<uint64_t>>(kWorld);
  std::vector<uint64_t> posted = std::vector<uint64_t>(kWorld, 0);
};

// Where the victim dies: after posting its writes of round kKillRound to the first peers, or at a random moment
// (0 to 20 ms into that round).
enum class KillAt { kMidPost, kRandom };

// (provider, endpoints, where the victim dies)
class DeadPeer : public ::testing::TestWithParam<std::tuple<std::string, int, KillAt>> {};

TEST_P(DeadPeer, SurvivorsKeepWritingToEachOtherAndBlameOnlyTheDeadPeer) {
  const std::string provider = std::get<0>(GetParam());
  const int nics = std::get<1>(GetParam());
  const KillAt killAt = std::get<2>(GetParam());
  SKIP_WITHOUT(provider);
  const char* env = std::getenv("DEAD_PEER_REPEATS");
  const int repeats = env != nullptr ? std::max(1, std::atoi(env)) : 1;
  for (int rep = 0; rep < repeats; ++rep) {
    const unsigned seed = static_cast<unsigned>(std::random_device{}());
    test::RunOptions ro;
    ro.deadlineMs = 90000;
    test::RunResult result = test::runRanks(
        kWorld,
        [&](int rank, Bootstrap& bootstrap) {
          EngineOptions eo;
          eo.provider = provider;
          eo.numNics = nics;
          eo.timeoutMs = kEngineTimeoutMs;
          std::unique_ptr<TransferEngine> engine = TransferEngine::create(eo);
          const auto addrs = allGather(bootstrap, engine->address());
          std::vector<PeerId> peerOf(kWorld, 0);
          std::vector<int> rankOf;  // PeerId -> rank
          for (int r = 0; r < kWorld; ++r) {
            if (r == rank) continue;
            peerOf[r] = engine->addPeer(addrs[r]);
            rankOf.push_back(r);
          }
          // Source: two parity slots of kLarge + kSmall; destination: per sender, two parity slots.
          const uint64_t kLarge = largeBytes(provider);
          const uint64_t slot = kLarge + kSmall;
          const uint64_t bytes = 2 * slot + kWorld * 2 * slot;
          void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
          ASSERT_NE(mem, MAP_FAILED);
          auto* base = static_cast<uint8_t*>(mem);
          std::unique_ptr<MemoryRegion> region = engine->registerMemory(mem, bytes);
          const auto descBlobs = allGather(bootstrap, region->desc().serialize());
          std::vector<MemoryDesc> descOf;
          for (const auto& d : descBlobs) descOf.push_back(MemoryDesc::deserialize(d.data(), d.size()));
          auto srcOff = [&](int round) { return static_cast<uint64_t>(round % 2) * slot; };
          auto dstOff = [&](int sender, int round) { return 2 * slot + (sender * 2 + round % 2) * slot; };
          bootstrap.barrier();

          std::mt19937 rng(seed);
          const int killDelayUs = std::uniform_int_distribution<int>(0, 20000)(rng);
          auto writes = std::make_shared<PerPeer>();
          // The victim first, then the others in rank order.
          std::vector<int> order = {kVictim};
          for (int r = 0; r < kWorld; ++r) {
            if (r != kVictim && r != rank) order.push_back(r);
          }
          if (rank == kVictim) order.erase(order.begin());
          std::vector<uint64_t> seenLarge(kWorld, 0), seenSmall(kWorld, 0);
          int64_t slowestMs = 0;
          int slowestRound = -1;

          for (int round = 0; round < kRounds; ++round) {
            const bool victimAlive = round < kKillRound;
            for (uint64_t i = 0; i < slot; ++i) base[srcOff(round) + i] = pattern(rank, round, i);
            if (rank == kVictim && round == kKillRound && killAt == KillAt::kRandom) {
              std::thread([killDelayUs] {
                std::this_thread::sleep_for(std::chrono::microseconds(killDelayUs));
                raise(SIGKILL);
              }).detach();
            }
            const auto start = std::chrono::steady_clock::now();
            for (size_t i = 0; i < order.size(); ++i) {
              const int to = order[i];
              if (rank == kVictim && round == kKillRound && killAt == KillAt::kMidPost && i == 2) raise(SIGKILL);
              for (int part = 0; part < 2; ++part) {
                Completion c;
                c.callback = [writes, to](const std::string& error) {
                  if (!error.empty()) {
                    std::lock_guard<std::mutex> lock(writes->mu);
                    if (writes->error[to].empty()) writes->error[to] = error;
                  }
                  writes->done[to].fetch_add(1);
                };
                ++writes->posted[to];
                const uint64_t off = part == 0 ? 0 : kLarge;
                const uint64_t len = part == 0 ? kLarge : kSmall;
                engine->write(peerOf[to], *region, srcOff(round) + off, descOf[to], dstOff(rank, round) + off, len,
                              true, part == 0 ? largeImm(rank) : smallImm(rank), c);
              }
            }
            // Every live peer's two writes of this round arrive, and this rank's writes to them complete, in time.
            // Polled (immCount) rather than waited for (waitImm): the engine keeps its first failure for good and
            // the wait would throw it.
            auto arrived = [&](int from) {
              return engine->immCount(largeImm(from)) >= 1 && engine->immCount(smallImm(from)) >= 1;
            };
            for (int from = 0; from < kWorld; ++from) {
              if (from == rank || (from == kVictim && !victimAlive)) continue;
              while (!arrived(from) || writes->done[from].load() < writes->posted[from]) {
                const int64_t ms =
                    std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start)
                        .count();
                if (ms > kRoundBoundMs) {
                  std::lock_guard<std::mutex> lock(writes->mu);
                  FAIL() << "rank " << rank << " round " << round << ": rank " << from << "'s writes "
                         << (arrived(from) ? "arrived" : "did not arrive") << ", this rank's writes to it completed "
                         << writes->done[from].load() << " of " << writes->posted[from] << " after " << ms
                         << " ms; error: '" << writes->error[from] << "'";
                }
                std::this_thread::sleep_for(std::chrono::microseconds(100));
              }
              engine->waitImm(largeImm(from), 1, "large write");  // consumes the arrivals; returns at once
              engine->waitImm(smallImm(from), 1, "small write");
              // The survivors stop waiting for the victim in round kKillRound, so they may overwrite a slot before
              // the victim reads it: only the survivors check data (no survivor runs more than a round ahead of
              // another).
              if (rank == kVictim) continue;
              const uint8_t* got = base + dstOff(from, round);
              for (uint64_t i = 0; i < slot; i += 997) {
                ASSERT_EQ(got[i], pattern(from, round, i))
                    << "rank " << rank << " round " << round << " byte " << i << " from rank " << from;
              }
              ASSERT_EQ(got[slot - 1], pattern(from, round, slot - 1));
            }
            const int64_t ms =
                std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
            if (round >= kKillRound && ms > slowestMs) {
              slowestMs = ms;
              slowestRound = round;
            }
            if (rank == kVictim && round == kKillRound) {
              std::this_thread::sleep_for(std::chrono::seconds(5));  // the random kill fires before this ends
              raise(SIGKILL);
            }
          }
          // The writes to the dead peer end (fail, or time out at the engine's deadline); none to a survivor failed.
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(3 * kEngineTimeoutMs);
          while (writes->done[kVictim].load() < writes->posted[kVictim] &&
                 std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
          }
          std::lock_guard<std::mutex> lock(writes->mu);
          EXPECT_EQ(writes->done[kVictim].load(), writes->posted[kVictim])
              << "rank " << rank << ": writes to the dead rank neither completed nor failed";
          for (int r = 0; r < kWorld; ++r) {
            if (r == rank || r == kVictim) continue;
            EXPECT_EQ(writes->error[r], "") << "rank " << rank << ": a write to live rank " << r << " failed";
            EXPECT_EQ(writes->done[r].load(), writes->posted[r]);
          }
          const std::string victimPeer = "peer " + std::to_string(peerOf[kVictim]);
          // Its writes may all have landed before it died (tcp hands them to the kernel); then none fails.
          if (!writes->error[kVictim].empty()) {
            EXPECT_NE(writes->error[kVictim].find(victimPeer), std::string::npos) << writes->error[kVictim];
          }
          try {
            engine->checkErrors();
          } catch (const Error& e) {
            EXPECT_NE(e.message().find(victimPeer), std::string::npos)
                << "rank " << rank << ": the engine's error names another peer than rank " << kVictim << " ("
                << victimPeer << "): " << e.message();
          }
          std::printf("rank %d: slowest round after the kill: %d (%lld ms); dead peer: %s\n", rank, slowestRound,
                      static_cast<long long>(slowestMs),
                      writes->error[kVictim].empty() ? "(no failed write)" : writes->error[kVictim].c_str());
          region.reset();
          engine.reset();
          munmap(mem, bytes);
        },
        ro);
    ASSERT_EQ(result.ranks.size(), static_cast<size_t>(kWorld));
    for (int r = 0; r < kWorld; ++r) {
      if (r == kVictim) {
        EXPECT_EQ(result.ranks[r].signal, SIGKILL) << "repeat " << rep << ": " << result.summary();
      } else {
        EXPECT_TRUE(result.ranks[r].ok()) << "repeat " << rep << " (seed " << seed << "): " << result.summary();
      }
    }
    if (::testing::Test::HasFailure()) break;
  }
}

std::string caseName(const ::testing::TestParamInfo<std::tuple<std::string, int, KillAt>>& info) {
  return std::get<0>(info.param) + "_Nics" + std::to_string(std::get<1>(info.param)) +
         (std::get<2>(info.param) == KillAt::kMidPost ? "_MidPost" : "_Random");
}

INSTANTIATE_TEST_SUITE_P(Tcp, DeadPeer,
                         ::testing::Combine(::testing::Values("tcp"), ::testing::Values(1, 2),
                                            ::testing::Values(KillAt::kMidPost, KillAt::kRandom)),
                         caseName);
// Over shm the victim dies in its own code only: killed at a random moment it can die holding the spin lock of its
// shared-memory region (its progress holds it while it takes the commands peers queued to it), and then every later
// post to it spins in libfabric for good (shm locks the receiver's region with pthread_spin_lock to queue a command):
// 1 of 41 such runs hung two survivors (docs/failures.md).
INSTANTIATE_TEST_SUITE_P(Shm, DeadPeer,
                         ::testing::Combine(::testing::Values("shm"), ::testing::Values(1, 2),
                                            ::testing::Values(KillAt::kMidPost)),
                         caseName);

}  // namespace
}  // namespace fabric
}  // namespace epcomm
