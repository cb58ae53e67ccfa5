// The abort board of the GPU backends (core/abort_board.hpp) on the CPU: ranks forked on one host share its page, a
// rank's raise() sets every peer's abort word and its note reads back on the peers, withdraw() clears the words. The
// liveness of the ranks' processes (core/process_liveness.hpp) with real processes: a rank killed with SIGKILL is
// named by deadPeers() (a zombie, or reaped), a stopped one or one whose main thread exited is not.
#include "core/abort_board.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "support/multiprocess.hpp"
#include "waiter_process.hpp"

namespace epcomm {
namespace {

uint32_t abortWord(const AbortBoard& b, uint32_t r) {
  return __atomic_load_n(reinterpret_cast<const uint32_t*>(b.slot(r) + kAbortWordOffset), __ATOMIC_ACQUIRE);
}

// The state letter of /proc/<pid>/stat (its main thread's), 0 when unreadable.
char procState(pid_t pid) {
  char path[64], buf[1024];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return 0;
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* p = std::strrchr(buf, ')');
  return p != nullptr && p[1] == ' ' ? p[2] : 0;
}

using test::forkWaiter;
using test::waitFor;

TEST(ProcessLiveness, OwnIdentityAndWhatCannotBeTold) {
  const ProcessIdentity me = thisProcessIdentity();
  EXPECT_EQ(me.pid, static_cast<int64_t>(getpid()));
  ASSERT_NE(me.startTicks, 0u) << "this test needs /proc of its own pid namespace";
  ASSERT_NE(me.pidNamespace, 0u);
  EXPECT_EQ(processState(me), ProcessState::kAlive);
  EXPECT_EQ(processState(ProcessIdentity{}), ProcessState::kUnknown);
  ProcessIdentity elsewhere = me;
  elsewhere.pidNamespace += 1;
  EXPECT_EQ(processState(elsewhere), ProcessState::kUnknown) << "a pid of another namespace means nothing here";
  ProcessIdentity reused = me;
  reused.startTicks += 1;
  EXPECT_EQ(processState(reused), ProcessState::kGone) << "the pid belongs to another process than the one recorded";
}

// A child: alive, stopped (alive), killed (a zombie: gone), reaped (gone). Another whose main thread exited while a
// second thread runs: alive until killed.
TEST(ProcessLiveness, KilledStoppedAndLeaderlessChildren) {
  ProcessIdentity id;
  const pid_t pid = forkWaiter(false, &id);
  ASSERT_GT(pid, 0);
  EXPECT_EQ(id.pid, static_cast<int64_t>(pid));
  EXPECT_EQ(processState(id), ProcessState::kAlive);
  ASSERT_EQ(kill(pid, SIGSTOP), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, WUNTRACED), pid);
  ASSERT_TRUE(WIFSTOPPED(status));
  EXPECT_EQ(processState(id), ProcessState::kAlive) << "a stopped process may go on";
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  EXPECT_EQ(processState(id), ProcessState::kGone) << "killed (SIGKILL pending, exiting or a zombie)";
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT), 0);  // a zombie, not reaped
  EXPECT_EQ(procState(pid), 'Z');
  EXPECT_EQ(processState(id), ProcessState::kGone) << "a zombie";
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_EQ(processState(id), ProcessState::kGone) << "reaped";

  ProcessIdentity leaderless;
  const pid_t other = forkWaiter(true, &leaderless);
  ASSERT_GT(other, 0);
  EXPECT_TRUE(waitFor([&] { return procState(other) == 'Z'; })) << "the main thread did not exit";
  EXPECT_EQ(processState(leaderless), ProcessState::kAlive) << "its second thread runs";
  ASSERT_EQ(kill(other, SIGKILL), 0);
  EXPECT_EQ(processState(leaderless), ProcessState::kGone);
  ASSERT_EQ(waitpid(other, &status, 0), other);
  EXPECT_EQ(processState(leaderless), ProcessState::kGone);
}

// Rank 1 refuses a dispatch: ranks 0 and 2 see its abort word and its note; after withdraw() the words are clear. Then
// rank 2's object fails (a timeout): the words name rank 2 and its code is kept.
TEST(AbortBoard, RaiseDescribeWithdraw) {
  test::RunResult result = test::runRanks(3, [](int rank, Bootstrap& bootstrap) {
    AbortBoard board;
    board.open(bootstrap);
    ASSERT_NE(board.page(), nullptr);
    EXPECT_EQ(board.bytes() % 4096, 0u);
    const uint32_t me = static_cast<uint32_t>(rank);
    EXPECT_EQ(abortWord(board, me), 0u);
    bootstrap.barrier();
    if (rank == 1) board.raise(kAbortDispatch, 3, ErrorCode::kInvalidArgument, "x has 25 tokens, more than 24");
    bootstrap.barrier();
    if (rank != 1) {
      EXPECT_EQ(abortWord(board, me), 2u) << "rank 1's abort word (1 + 1) at rank " << rank;
      ErrorCode code = ErrorCode::kInternal;
      const std::string text = board.describe(1, &code);
      EXPECT_EQ(text, "rank 1 aborted dispatch (its round 3): x has 25 tokens, more than 24");
      EXPECT_EQ(code, ErrorCode::kPeerFailure);
    } else {
      EXPECT_EQ(abortWord(board, me), 0u) << "a rank does not abort itself";
    }
    bootstrap.barrier();
    if (rank == 1) board.withdraw();
    bootstrap.barrier();
    EXPECT_EQ(abortWord(board, me), 0u) << "after withdraw";
    bootstrap.barrier();
    if (rank == 2) board.raise(kAbortFailed, 4, ErrorCode::kTimeout, std::string(1000, 'y'));
    bootstrap.barrier();
    if (rank != 2) {
      EXPECT_EQ(abortWord(board, me), 3u);
      ErrorCode code = ErrorCode::kInternal;
      const std::string text = board.describe(2, &code);
      EXPECT_EQ(code, ErrorCode::kTimeout);
      EXPECT_EQ(text, "rank 2 failed (its round 4): " + std::string(kAbortTextBytes, 'y')) << "the text is cut";
    }
    bootstrap.barrier();
  });
  EXPECT_TRUE(result.allOk()) << result.summary();
}

// Rank 3 dies of SIGKILL: every survivor names it, and only it, in deadPeers() and in a timeout's message; before,
// nobody is named.
TEST(AbortBoard, DeadPeersNameTheKilledRankOnly) {
  // The survivors meet here before they exit (the bootstrap has a dead rank): a live rank is never seen gone.
  void* shared = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(shared, MAP_FAILED);
  uint32_t* checked = static_cast<uint32_t*>(shared);
  test::RunResult result = test::runRanks(4, [checked](int rank, Bootstrap& bootstrap) {
    AbortBoard board;
    board.open(bootstrap);
    int64_t pid = getpid();
    std::vector<int64_t> pids(4);
    bootstrap.allGather(&pid, pids.data(), sizeof(pid));
    for (uint32_t r = 0; r < 4; ++r) EXPECT_EQ(board.sharedWith(r), r != static_cast<uint32_t>(rank)) << r;
    EXPECT_TRUE(board.deadPeers().empty());
    EXPECT_EQ(board.blameDeadPeers("timed out"), "timed out");
    bootstrap.barrier();
    if (rank == 3) raise(SIGKILL);
    ASSERT_TRUE(waitFor([&] { return !board.deadPeers().empty(); })) << "rank 3's death was not seen";
    EXPECT_EQ(board.deadPeers(), std::vector<uint32_t>{3});
    for (uint32_t r = 0; r < 3; ++r) EXPECT_FALSE(board.peerGone(r)) << r;
    EXPECT_TRUE(board.peerGone(3));
    const std::string blamed = board.blameDeadPeers("rank 0 timed out waiting for peer rank 1");
    EXPECT_EQ(blamed, "rank 0 timed out waiting for peer rank 1; the process of rank 3 has exited (pid " +
                          std::to_string(pids[3]) + "): it is the likely cause");
    EXPECT_EQ(board.blameDeadPeers("rank 1: rank 0 failed: " + blamed + "; more"),
              "rank 1: rank 0 failed: " + blamed + "; more")
        << "a note that named it already";
    __atomic_fetch_add(checked, 1u, __ATOMIC_SEQ_CST);
    EXPECT_TRUE(waitFor([&] { return __atomic_load_n(checked, __ATOMIC_SEQ_CST) == 3; }));
  });
  munmap(shared, 4096);
  ASSERT_EQ(result.ranks.size(), 4u);
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(result.ranks[r].ok()) << result.summary();
  EXPECT_EQ(result.ranks[3].signal, SIGKILL) << result.summary();
}

// Ranks that live on are never named: one stopped (SIGSTOP) and one whose main thread exited while another thread
// goes on (its leader is a zombie); then both are named once killed.
TEST(AbortBoard, StoppedAndLeaderlessRanksAreAlive) {
  test::RunResult result = test::runRanks(3, [](int rank, Bootstrap& bootstrap) {
    AbortBoard board;
    board.open(bootstrap);
    int64_t pid = getpid();
    std::vector<int64_t> pids(3);
    bootstrap.allGather(&pid, pids.data(), sizeof(pid));
    bootstrap.barrier();
    if (rank == 1) {
      raise(SIGSTOP);
      bootstrap.barrier();  // continued by rank 0 once it has checked
      for (;;) pause();
    }
    if (rank == 2) {
      std::thread([&bootstrap] {
        bootstrap.barrier();  // rank 0 has checked
        for (;;) pause();
      }).detach();
      syscall(SYS_exit, 0);  // this thread only
    }
    const pid_t p1 = static_cast<pid_t>(pids[1]), p2 = static_cast<pid_t>(pids[2]);
    ASSERT_TRUE(waitFor([&] { return procState(p1) == 'T' && procState(p2) == 'Z'; }))
        << "rank 1 " << procState(p1) << ", rank 2 " << procState(p2);
    for (int i = 0; i < 20; ++i) {
      const std::vector<uint32_t> dead = board.deadPeers();
      EXPECT_TRUE(dead.empty()) << "named rank " << dead[0];
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_EQ(board.blameDeadPeers("timed out"), "timed out");
    kill(p1, SIGCONT);
    bootstrap.barrier();
    kill(p1, SIGKILL);
    kill(p2, SIGKILL);
    ASSERT_TRUE(waitFor([&] { return board.deadPeers().size() == 2; }));
    EXPECT_EQ(board.deadPeers(), (std::vector<uint32_t>{1, 2}));
    EXPECT_EQ(board.blameDeadPeers("x"), "x; the processes of ranks 1, 2 have exited (pids " + std::to_string(pids[1]) +
                                             ", " + std::to_string(pids[2]) + "): they are the likely cause");
  });
  ASSERT_EQ(result.ranks.size(), 3u);
  EXPECT_TRUE(result.ranks[0].ok()) << result.summary();
  EXPECT_EQ(result.ranks[1].signal, SIGKILL) << result.summary();
  EXPECT_EQ(result.ranks[2].signal, SIGKILL) << result.summary();
}

// One rank: a private page, nothing to tell.
TEST(AbortBoard, OneRank) {
  test::RunResult result = test::runRanks(1, [](int, Bootstrap& bootstrap) {
    AbortBoard board;
    board.open(bootstrap);
    ASSERT_NE(board.page(), nullptr);
    board.raise(kAbortCombine, 0, ErrorCode::kInvalidArgument, "bad");
    EXPECT_EQ(abortWord(board, 0), 0u);
    board.withdraw();
  });
  EXPECT_TRUE(result.allOk()) << result.summary();
}

}  // namespace
}  // namespace epcomm
