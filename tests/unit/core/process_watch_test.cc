// ProcessWatch (core/process_watch.hpp): a process of this host is seen to exit at once, before its parent reaps it;
// what cannot be watched (this process, another PID namespace, an empty identity) never reads as exited. Whether a
// process runs on this host at all is the caller's to know (the libfabric engine compares host keys).
#include "core/process_watch.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "waiter_process.hpp"

namespace epcomm {
namespace {

using test::forkWaiter;
using test::waitFor;

bool watchable() { return thisProcessIdentity().pidNamespace != 0; }

TEST(ProcessWatch, SeesAKilledProcessBeforeItIsReaped) {
  if (!watchable()) GTEST_SKIP() << "/proc shows no PID namespace of this process";
  ProcessIdentity id;
  const pid_t pid = forkWaiter(false, &id);
  ASSERT_GT(pid, 0);
  const ProcessWatch w(id);
  EXPECT_EQ(w.pid(), pid);
  EXPECT_FALSE(w.exited());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(w.exited()) << "a live process read as exited";
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  EXPECT_TRUE(waitFor([&] { return w.exited(); }, 2000))
      << "the killed child (a zombie, not reaped yet) was not seen to exit";
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(w.exited());
}

TEST(ProcessWatch, AProcessGoneBeforeTheWatchReadsAsExited) {
  if (!watchable()) GTEST_SKIP() << "/proc shows no PID namespace of this process";
  ProcessIdentity id;
  const pid_t pid = forkWaiter(false, &id);
  ASSERT_GT(pid, 0);
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(ProcessWatch(id).exited()) << "reaped child";
  // Its pid given to another process: the start time differs.
  ProcessIdentity reused = thisProcessIdentity();
  reused.pid = static_cast<int64_t>(getppid());
  reused.startTicks += 1;
  EXPECT_TRUE(ProcessWatch(reused).exited()) << "a pid that now names a later process";
}

TEST(ProcessWatch, WhatCannotBeWatchedNeverReadsAsExited) {
  ProcessIdentity id;
  const pid_t pid = forkWaiter(false, &id);
  ASSERT_GT(pid, 0);
  ProcessIdentity otherNamespace = id, unknownNamespace = id;
  otherNamespace.pidNamespace += 1;  // its pid means nothing here
  unknownNamespace.pidNamespace = 0;
  const ProcessWatch self(thisProcessIdentity());
  const ProcessWatch elsewhere(otherNamespace);
  const ProcessWatch unknown(unknownNamespace);
  const ProcessWatch empty(ProcessIdentity{});
  const ProcessWatch none;
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  for (const ProcessWatch* w : {&self, &elsewhere, &unknown, &empty, &none}) EXPECT_FALSE(w->exited());
}

}  // namespace
}  // namespace epcomm
