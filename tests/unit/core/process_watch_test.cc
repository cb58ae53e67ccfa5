// ProcessWatch (core/process_watch.hpp): a process of this host is seen to exit at once, before its parent reaps it;
// what cannot be watched (this process, another host, an empty identity) never reads as exited.
#include "core/process_watch.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

namespace epcomm {
namespace {

// A child that sends its identity up a pipe and waits to be killed.
pid_t forkWaiter(ProcessIdentity* id) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(fds[0]);
    const ProcessIdentity mine = thisProcessIdentity();
    if (write(fds[1], &mine, sizeof(mine)) != static_cast<ssize_t>(sizeof(mine))) _exit(1);
    close(fds[1]);
    for (;;) pause();
  }
  close(fds[1]);
  const bool ok = pid > 0 && read(fds[0], id, sizeof(*id)) == static_cast<ssize_t>(sizeof(*id));
  close(fds[0]);
  return ok ? pid : -1;
}

bool exitsWithin(const ProcessWatch& w, int ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (!w.exited()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

TEST(ProcessWatch, SeesAKilledProcessBeforeItIsReaped) {
  if (thisHostKey() == 0) GTEST_SKIP() << "no /proc/sys/kernel/random/boot_id here";
  ProcessIdentity id;
  const pid_t pid = forkWaiter(&id);
  ASSERT_GT(pid, 0);
  ProcessWatch w(thisHostKey(), id);
  EXPECT_EQ(w.pid(), pid);
  EXPECT_FALSE(w.exited());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(w.exited()) << "a live process read as exited";
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  EXPECT_TRUE(exitsWithin(w, 2000)) << "the killed child (a zombie, not reaped yet) was not seen to exit";
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(w.exited());
}

TEST(ProcessWatch, AProcessGoneBeforeTheWatchReadsAsExited) {
  if (thisHostKey() == 0) GTEST_SKIP() << "no /proc/sys/kernel/random/boot_id here";
  ProcessIdentity id;
  const pid_t pid = forkWaiter(&id);
  ASSERT_GT(pid, 0);
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(ProcessWatch(thisHostKey(), id).exited()) << "reaped child";
  // Its pid given to another process: the start time differs.
  ProcessIdentity reused = thisProcessIdentity();
  reused.pid = static_cast<int64_t>(getppid());
  reused.startTicks += 1;
  EXPECT_TRUE(ProcessWatch(thisHostKey(), reused).exited()) << "a pid that now names a later process";
}

TEST(ProcessWatch, WhatCannotBeWatchedNeverReadsAsExited) {
  ProcessIdentity id;
  const pid_t pid = forkWaiter(&id);
  ASSERT_GT(pid, 0);
  const ProcessWatch self(thisHostKey(), thisProcessIdentity());
  const ProcessWatch elsewhere(thisHostKey() + 1, id);  // another host: its pid means nothing here
  const ProcessWatch unknownHost(0, id);
  const ProcessWatch empty(thisHostKey(), ProcessIdentity{});
  const ProcessWatch none;
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  for (const ProcessWatch* w : {&self, &elsewhere, &unknownHost, &empty, &none}) EXPECT_FALSE(w->exited());
}

}  // namespace
}  // namespace epcomm
