// createBootstrapFromEnv in fresh processes: the environment is parsed once per process (env()), so every case
// runs this binary again (posix_spawn) with its own EPCOMM_* variables, in the child role selected by argv[1].
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "epcomm/bootstrap.hpp"
#include "epcomm/error.hpp"
#include "support/multiprocess.hpp"

extern char** environ;

namespace epcomm {
namespace {

constexpr const char* kChildFlag = "--bootstrap-env-child";

// The child role: join the bootstrap described by the environment, allGather the ranks, print the outcome.
int childMain() {
  try {
    std::unique_ptr<Bootstrap> bs = createBootstrapFromEnv();
    int rank = bs->rank();
    std::vector<int> all(bs->worldSize(), -1);
    bs->allGather(&rank, all.data(), sizeof(int));
    for (int r = 0; r < bs->worldSize(); ++r) {
      if (all[r] != r) {
        std::printf("wrong allGather result at rank %d: slot %d holds %d\n", rank, r, all[r]);
        return 2;
      }
    }
    std::printf("ok rank %d of %d\n", rank, bs->worldSize());
    return 0;
  } catch (const Error& e) {
    std::printf("error %s: %s\n", errorCodeName(e.code()), e.message().c_str());
    return 3;
  }
}

struct Child {
  pid_t pid = -1;
  int out = -1;  // Read end of the child's stdout+stderr.
};

// Starts this binary in the child role with the parent's environment minus every EPCOMM_* variable, plus `vars`.
Child spawnChild(const std::map<std::string, std::string>& vars) {
  std::vector<std::string> envStrings;
  for (char** p = environ; *p != nullptr; ++p) {
    if (std::strncmp(*p, "EPCOMM_", 7) != 0) envStrings.emplace_back(*p);
  }
  for (const auto& kv : vars) envStrings.push_back(kv.first + "=" + kv.second);
  std::vector<char*> envp;
  for (std::string& s : envStrings) envp.push_back(&s[0]);
  envp.push_back(nullptr);

  int fds[2];
  if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 2);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  posix_spawn_file_actions_addclose(&actions, fds[1]);
  std::string self = "/proc/self/exe";
  std::string flag = kChildFlag;
  char* argv[] = {&self[0], &flag[0], nullptr};
  Child c;
  int rc = posix_spawn(&c.pid, "/proc/self/exe", &actions, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    throw std::runtime_error(std::string("posix_spawn failed: ") + std::strerror(rc));
  }
  c.out = fds[0];
  return c;
}

struct ChildResult {
  int exitCode = -1;  // -1: killed after the deadline or by a signal.
  std::string output;
};

// Collects the child's output until it exits; kills it after `deadlineMs`.
ChildResult finish(Child c, int64_t deadlineMs) {
  ChildResult r;
  auto start = std::chrono::steady_clock::now();
  char buf[4096];
  for (;;) {
    auto elapsed =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
    if (elapsed >= deadlineMs) {
      ::kill(c.pid, SIGKILL);
      r.output += "\n[killed after " + std::to_string(deadlineMs) + " ms]";
      break;
    }
    pollfd p{c.out, POLLIN, 0};
    int rc = ::poll(&p, 1, static_cast<int>(deadlineMs - elapsed));
    if (rc <= 0) continue;
    ssize_t n = ::read(c.out, buf, sizeof(buf));
    if (n <= 0) break;  // EOF: the child exited (or closed its output).
    r.output.append(buf, static_cast<size_t>(n));
  }
  ::close(c.out);
  int status = 0;
  while (::waitpid(c.pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) r.exitCode = WEXITSTATUS(status);
  return r;
}

ChildResult runChild(const std::map<std::string, std::string>& vars) { return finish(spawnChild(vars), 30000); }

void expectEnvError(const std::map<std::string, std::string>& vars, const std::string& needle) {
  ChildResult r = runChild(vars);
  EXPECT_EQ(r.exitCode, 3) << r.output;
  EXPECT_NE(r.output.find("error invalid_argument: " + needle), std::string::npos)
      << "'" << needle << "' not in: " << r.output;
}

TEST(BootstrapFromEnv, MissingAddressIsNamed) {
  expectEnvError({{"EPCOMM_RANK", "0"}, {"EPCOMM_WORLD_SIZE", "1"}}, "EPCOMM_BOOTSTRAP is not set");
}

TEST(BootstrapFromEnv, MissingRankIsNamed) {
  expectEnvError({{"EPCOMM_BOOTSTRAP", "127.0.0.1:1"}, {"EPCOMM_WORLD_SIZE", "2"}}, "EPCOMM_RANK is not set");
}

TEST(BootstrapFromEnv, MissingWorldSizeIsNamed) {
  expectEnvError({{"EPCOMM_BOOTSTRAP", "127.0.0.1:1"}, {"EPCOMM_RANK", "0"}}, "EPCOMM_WORLD_SIZE is not set");
}

TEST(BootstrapFromEnv, NonIntegerIsNamed) {
  expectEnvError({{"EPCOMM_BOOTSTRAP", "127.0.0.1:1"}, {"EPCOMM_RANK", "0"}, {"EPCOMM_WORLD_SIZE", "four"}},
                 "environment variable EPCOMM_WORLD_SIZE='four' is not an integer");
}

TEST(BootstrapFromEnv, RankOutOfRangeIsNamed) {
  expectEnvError({{"EPCOMM_BOOTSTRAP", "127.0.0.1:1"}, {"EPCOMM_RANK", "2"}, {"EPCOMM_WORLD_SIZE", "2"}},
                 "EPCOMM_RANK=2 is not below EPCOMM_WORLD_SIZE=2");
}

TEST(BootstrapFromEnv, BadAddressIsNamed) {
  expectEnvError({{"EPCOMM_BOOTSTRAP", "nohost"}, {"EPCOMM_RANK", "0"}, {"EPCOMM_WORLD_SIZE", "2"}},
                 "bootstrap address 'nohost' is not host:port");
}

TEST(BootstrapFromEnv, ThreeRanksJoin) {
  constexpr int kWorld = 3;
  std::string address = "127.0.0.1:" + std::to_string(test::freeTcpPort());
  std::vector<Child> children;
  for (int r = 0; r < kWorld; ++r) {
    children.push_back(spawnChild({{"EPCOMM_BOOTSTRAP", address},
                                   {"EPCOMM_RANK", std::to_string(r)},
                                   {"EPCOMM_WORLD_SIZE", std::to_string(kWorld)},
                                   {"EPCOMM_TIMEOUT_MS", "8000"}}));
  }
  for (int r = 0; r < kWorld; ++r) {
    ChildResult res = finish(children[r], 60000);
    EXPECT_EQ(res.exitCode, 0) << "rank " << r << ": " << res.output;
    EXPECT_NE(res.output.find("ok rank " + std::to_string(r) + " of 3"), std::string::npos) << res.output;
  }
}

}  // namespace
}  // namespace epcomm

// Our own main (it takes precedence over gtest_main's): the same binary is the test and, with kChildFlag, a rank.
int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], epcomm::kChildFlag) == 0) return epcomm::childMain();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
