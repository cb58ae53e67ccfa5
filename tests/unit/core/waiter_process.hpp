// Child processes for the process-liveness tests (abort board, process watch): a forked child that reports its
// identity and waits to be killed, and a bounded poll for what the parent then expects to see.
#pragma once

#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "core/process_liveness.hpp"

namespace epcomm {
namespace test {

// Polls `done` every millisecond for up to `ms`; whether it held.
template <typename F>
bool waitFor(F done, int ms = 10000) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// A child process that sends its identity up a pipe and then waits to be killed; with `leaderExits`, its main thread
// exits (the kernel's exit of one thread: the leader is a zombie) while a second thread keeps the process alive.
inline pid_t forkWaiter(bool leaderExits, ProcessIdentity* id) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(fds[0]);
    const ProcessIdentity mine = thisProcessIdentity();
    if (leaderExits) {
      std::thread([] {
        for (;;) pause();
      }).detach();
    }
    if (write(fds[1], &mine, sizeof(mine)) != static_cast<ssize_t>(sizeof(mine))) _exit(1);
    close(fds[1]);
    if (leaderExits) syscall(SYS_exit, 0);  // this thread only: no unwinding, no exit handlers
    for (;;) pause();
  }
  close(fds[1]);
  const bool ok = pid > 0 && read(fds[0], id, sizeof(*id)) == static_cast<ssize_t>(sizeof(*id));
  close(fds[0]);
  return ok ? pid : -1;
}

}  // namespace test
}  // namespace epcomm
