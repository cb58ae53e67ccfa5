#include "launcher.hpp"

#include <arpa/inet.h>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "plot.hpp"

namespace epcomm {
namespace bench {

namespace {

int freePort() {
  // Bind port 0 on localhost and release it; the children's rendezvous takes it right after.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  int port = 29500;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}

// GPUs this process would see, counted in a child: the launcher forks the ranks and must not initialise CUDA itself.
int countGpus() {
  pid_t pid = fork();
  if (pid == 0) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    _exit(n > 250 ? 250 : n);
  }
  int st = 0;
  if (pid < 0 || waitpid(pid, &st, 0) != pid) return 0;
  return WIFEXITED(st) ? WEXITSTATUS(st) : 0;
}

std::string readAll(int fd) {
  std::string msg;
  char buf[4096];
  ssize_t n;
  while (fd >= 0 && (n = read(fd, buf, sizeof(buf))) > 0) msg.append(buf, static_cast<size_t>(n));
  while (!msg.empty() && (msg.back() == '\n' || msg.back() == '\r')) msg.pop_back();
  return msg;
}

// How rank r ended, with its message ("" when it succeeded).
std::string failure(int r, pid_t got, int st, const std::string& msg, bool killedByUs, int firstFailed) {
  if (got > 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0) return "";
  std::ostringstream line;
  line << "epcomm-bench: rank " << r << " failed";
  if (got < 0) {
    line << " (waitpid: " << std::strerror(errno) << ")";
  } else if (WIFEXITED(st)) {
    line << " (exit code " << WEXITSTATUS(st) << ")";
  } else if (WIFSIGNALED(st)) {
    line << " (killed by signal " << WTERMSIG(st) << ", " << strsignal(WTERMSIG(st)) << ")";
  }
  if (!msg.empty()) {
    line << ": " << msg;
  } else if (killedByUs) {
    line << ": killed by the launcher after rank " << firstFailed << " failed";
  } else if (got > 0 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) {
    line << ": no message; SIGKILL from outside is usually the kernel's out-of-memory killer (see dmesg)";
  } else {
    line << ": no message";
  }
  return line.str();
}

}  // namespace

int launchRanks(int argc, char** argv, const Options& o) {
  const int gpus = countGpus();
  const int world = o.world > 0 ? o.world : (gpus > 0 ? gpus : 4);
  if (gpus > 0 && world > gpus && o.backend != "host") {
    std::cout << "# " << world << " ranks on " << gpus << " GPU(s): rank r runs on GPU r % " << gpus
              << "; ranks that share a GPU measure protocol costs, not link times (bench/README.md)\n"
              << std::flush;
  }
  const std::string addr = "127.0.0.1:" + std::to_string(freePort());
  const std::string rev = revision(o);
  // --plot without --json: the ranks write their JSON lines to a file of the launcher's, which the plot reads.
  std::vector<char*> args(argv, argv + argc);
  std::string json = o.json;
  std::string jsonFlag = "--json";
  if (!o.plot.empty() && json.empty()) {
    json = "/tmp/epcomm-bench-" + std::to_string(getpid()) + ".jsonl";
    args.push_back(&jsonFlag[0]);
    args.push_back(&json[0]);
  }
  args.push_back(nullptr);

  std::vector<pid_t> kids;
  // One pipe per rank: a failing rank writes its error there (EPBENCH_ERR_FD) and the launcher prints it as the
  // rank exits, with the rank and how it ended (a rank killed by a signal cannot write anything).
  std::vector<int> errFds;
  for (int r = 0; r < world; ++r) {
    int fds[2] = {-1, -1};
    if (pipe2(fds, O_CLOEXEC) != 0) fds[0] = fds[1] = -1;
    pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // a launcher that dies takes its ranks along
      if (fds[1] >= 0) {
        fcntl(fds[1], F_SETFD, 0);
        setenv("EPBENCH_ERR_FD", std::to_string(fds[1]).c_str(), 1);
      }
      setenv("EPCOMM_RANK", std::to_string(r).c_str(), 1);
      setenv("EPCOMM_WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("EPCOMM_LOCAL_RANK", std::to_string(gpus > 0 ? r % gpus : r).c_str(), 1);
      setenv("EPCOMM_BOOTSTRAP", addr.c_str(), 1);
      setenv("EPBENCH_CHILD", "1", 1);
      setenv("EPBENCH_REV", rev.c_str(), 1);
      setenv("NCCL_NVLS_ENABLE", "0", 1);
      setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
      execv("/proc/self/exe", args.data());
      _exit(127);
    }
    if (fds[1] >= 0) close(fds[1]);
    if (fds[0] >= 0) fcntl(fds[0], F_SETFL, O_NONBLOCK);
    kids.push_back(pid);
    errFds.push_back(fds[0]);
  }

  // After the first failure the survivors name the dead rank within their own timeouts; a rank still running well
  // past that is stuck and is killed, so the launcher never hangs.
  const int64_t graceMs = 3 * timeoutMsFromEnv() + 10000;
  int failed = 0, firstFailed = -1, alive = world;
  std::vector<bool> done(world, false), killedByUs(world, false);
  auto firstFailure = std::chrono::steady_clock::time_point{};
  while (alive > 0) {
    bool reaped = false;
    for (int r = 0; r < world; ++r) {
      if (done[r]) continue;
      int st = 0;
      const pid_t got = waitpid(kids[r], &st, WNOHANG);
      if (got == 0) continue;
      done[r] = true;
      --alive;
      reaped = true;
      const std::string msg = readAll(errFds[r]);
      if (errFds[r] >= 0) close(errFds[r]);
      const std::string line = failure(r, got, st, msg, killedByUs[r], firstFailed);
      if (line.empty()) continue;
      ++failed;
      if (firstFailed < 0) {
        firstFailed = r;
        firstFailure = std::chrono::steady_clock::now();
      }
      std::cerr << line << "\n" << std::flush;
    }
    if (alive == 0) break;
    if (firstFailed >= 0 && std::chrono::steady_clock::now() - firstFailure > std::chrono::milliseconds(graceMs)) {
      for (int r = 0; r < world; ++r) {
        if (done[r] || killedByUs[r]) continue;
        std::cerr << "epcomm-bench: rank " << r << " still running " << graceMs / 1000 << " s after rank "
                  << firstFailed << " failed: killing it\n";
        kill(kids[r], SIGKILL);
        killedByUs[r] = true;  // the loop reaps it as failed
      }
    }
    if (!reaped) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (failed) std::cerr << "epcomm-bench: " << failed << " rank(s) failed\n";
  int rc = failed ? 1 : 0;
  if (!o.plot.empty()) {
    std::string why;
    if (drawPlot(json, o.plot, &why)) {
      std::cout << "# plot: " << o.plot << "\n";
    } else {
      std::cerr << "epcomm-bench: no plot drawn (" << why << "); the JSON lines are in " << json << "\n";
      rc = 1;
    }
    if (o.json.empty() && rc == 0) unlink(json.c_str());
  }
  return rc;
}

}  // namespace bench
}  // namespace epcomm
