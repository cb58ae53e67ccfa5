#include "support/multiprocess.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace epcomm {
namespace test {

namespace {

// A child's report must fit in the pipe buffer (64 KiB on Linux) because the parent reads it only after exit.
constexpr size_t kMaxMessage = 16 * 1024;

[[noreturn]] void childExit(int writeFd, const std::string& message, int code) {
  std::string text = message.size() > kMaxMessage ? message.substr(0, kMaxMessage) + "..." : message;
  size_t off = 0;
  while (off < text.size()) {
    ssize_t n = ::write(writeFd, text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
  ::close(writeFd);
  std::fflush(stdout);
  std::fflush(stderr);
  ::_exit(code);
}

// Runs the body in the child with gtest failures intercepted, then exits; never returns.
[[noreturn]] void runChild(int rank, int writeFd, const std::function<void(int)>& body) {
  // If the test process dies (ctest timeout, crash), the children must not linger.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() == 1) ::_exit(99);  // The parent is already gone.
  std::string message;
  int code = 0;
  ::testing::TestPartResultArray failures;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
    try {
      body(rank);
    } catch (const std::exception& e) {
      message = std::string("uncaught exception: ") + e.what();
      code = 1;
    } catch (...) {
      message = "uncaught exception of unknown type";
      code = 1;
    }
  }
  for (int i = 0; i < failures.size(); ++i) {
    const ::testing::TestPartResult& part = failures.GetTestPartResult(i);
    if (!part.failed()) continue;
    std::ostringstream oss;
    oss << (part.file_name() ? part.file_name() : "?") << ":" << part.line_number() << ": " << part.message();
    // Also print it, so that the child's output reads like a normal gtest failure.
    std::fprintf(stderr, "[rank %d] %s\n", rank, oss.str().c_str());
    message += (message.empty() ? "" : "\n") + oss.str();
    code = 1;
  }
  childExit(writeFd, message, code);
}

std::string readAll(int fd) {
  std::string text;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n > 0) {
      text.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    break;
  }
  return text;
}

// libfabric's shm provider keeps a region per endpoint in /dev/shm named "<pid>:...". A rank that was killed (or
// exited without closing its endpoints) leaves it behind, and a later process that happens to get the same pid fails
// in fi_enable with EBUSY. The rank is reaped, so its pid's regions are stale: remove them.
void removeShmRegionsOf(pid_t pid) {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return;
  const std::string prefix = std::to_string(pid) + ":";
  while (dirent* e = ::readdir(dir)) {
    if (std::strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0) {
      ::unlink((std::string("/dev/shm/") + e->d_name).c_str());
    }
  }
  ::closedir(dir);
}

void recordStatus(RankOutcome* out, int status) {
  if (WIFEXITED(status)) {
    out->exited = true;
    out->exitCode = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    out->signal = WTERMSIG(status);
  }
}

}  // namespace

std::string RankOutcome::describe() const {
  std::ostringstream oss;
  oss << "rank " << rank << ": ";
  if (timedOut) {
    oss << "killed after running past the deadline";
  } else if (ok()) {
    oss << "ok";
  } else if (exited) {
    oss << "exit " << exitCode;
  } else {
    oss << "killed by signal " << signal << " (" << strsignal(signal) << ")";
  }
  if (!message.empty()) oss << ": " << message;
  return oss.str();
}

bool RunResult::allOk() const {
  for (const RankOutcome& r : ranks) {
    if (!r.ok()) return false;
  }
  return !ranks.empty();
}

std::string RunResult::summary() const {
  std::ostringstream oss;
  for (const RankOutcome& r : ranks) oss << r.describe() << "\n";
  return oss.str();
}

int freeTcpPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error(std::string("freeTcpPort: socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    int err = errno;
    ::close(fd);
    throw std::runtime_error(std::string("freeTcpPort: bind: ") + std::strerror(err));
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

RunResult runProcesses(int world, const std::function<void(int rank)>& body, const RunOptions& options) {
  RunResult result;
  result.ranks.resize(world);
  std::vector<pid_t> pids(world, -1);
  std::vector<int> pipes(world, -1);
  std::fflush(stdout);  // Buffered output would otherwise be printed once per child as well.
  std::fflush(stderr);
  for (int r = 0; r < world; ++r) {
    result.ranks[r].rank = r;
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) {
      result.ranks[r].message = std::string("pipe failed: ") + std::strerror(errno);
      continue;
    }
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      // Read ends of the earlier ranks' pipes are of no use here.
      for (int q = 0; q < r; ++q) {
        if (pipes[q] >= 0) ::close(pipes[q]);
      }
      runChild(r, fds[1], body);
    }
    ::close(fds[1]);
    if (pid < 0) {
      result.ranks[r].message = std::string("fork failed: ") + std::strerror(errno);
      ::close(fds[0]);
      continue;
    }
    pids[r] = pid;
    pipes[r] = fds[0];
  }

  auto start = std::chrono::steady_clock::now();
  int running = 0;
  for (pid_t p : pids) running += p > 0 ? 1 : 0;
  while (running > 0) {
    for (int r = 0; r < world; ++r) {
      if (pids[r] <= 0) continue;
      int status = 0;
      pid_t got = ::waitpid(pids[r], &status, WNOHANG);
      if (got == pids[r]) {
        recordStatus(&result.ranks[r], status);
        removeShmRegionsOf(pids[r]);
        pids[r] = -1;
        --running;
      }
    }
    if (running == 0) break;
    auto elapsedMs =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
    if (elapsedMs > options.deadlineMs) {
      for (int r = 0; r < world; ++r) {
        if (pids[r] <= 0) continue;
        ::kill(pids[r], SIGKILL);
        int status = 0;
        while (::waitpid(pids[r], &status, 0) < 0 && errno == EINTR) {
        }
        recordStatus(&result.ranks[r], status);
        removeShmRegionsOf(pids[r]);
        result.ranks[r].timedOut = true;
        pids[r] = -1;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }

  for (int r = 0; r < world; ++r) {
    if (pipes[r] < 0) continue;
    std::string text = readAll(pipes[r]);
    ::close(pipes[r]);
    if (result.ranks[r].timedOut) {
      result.ranks[r].message =
          "still running after " + std::to_string(options.deadlineMs) + " ms" + (text.empty() ? "" : "; " + text);
    } else {
      result.ranks[r].message = text;
    }
  }
  return result;
}

RunResult runRanks(int world, const std::function<void(int rank, Bootstrap& bootstrap)>& body,
                   const RunOptions& options) {
  std::string address = "127.0.0.1:" + std::to_string(freeTcpPort());
  int64_t timeoutMs = options.bootstrapTimeoutMs;
  return runProcesses(
      world,
      [&](int rank) {
        std::unique_ptr<Bootstrap> bootstrap = createTcpBootstrap(address, rank, world, timeoutMs);
        body(rank, *bootstrap);
      },
      options);
}

}  // namespace test
}  // namespace epcomm
