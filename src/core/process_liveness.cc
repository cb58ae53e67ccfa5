#include "core/process_liveness.hpp"

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace epcomm {

namespace {

// PF_EXITING of the kernel's task flags (field 9 of /proc/<pid>/stat): the task is in do_exit.
constexpr uint64_t kTaskExiting = 0x4;
constexpr uint64_t kSigKillBit = 1ull << (SIGKILL - 1);

struct Stat {
  int64_t pid = 0;
  char state = 0;
  uint64_t flags = 0;
  uint64_t startTicks = 0;
};

// Reads a whole small /proc file into `buf` (NUL-terminated); false when it cannot be opened or read.
bool readSmall(const std::string& path, char* buf, size_t size) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return false;
  const size_t n = std::fread(buf, 1, size - 1, f);
  const bool bad = std::ferror(f) != 0;
  std::fclose(f);
  buf[n] = 0;
  return !bad && n > 0;
}

// Fields 1, 3, 9 and 22 of a /proc/.../stat file; false when it cannot be read or parsed.
bool readStat(const std::string& path, Stat* s) {
  char buf[1024];
  if (!readSmall(path, buf, sizeof(buf))) return false;
  s->pid = std::strtoll(buf, nullptr, 10);
  // The command name (field 2) is in parentheses and may hold spaces and parentheses: fields 3.. follow the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return false;
  ++p;
  for (int field = 3; *p != 0; ++field) {
    while (*p == ' ') ++p;
    if (*p == 0) break;
    if (field == 3) s->state = *p;
    if (field == 9) s->flags = std::strtoull(p, nullptr, 10);
    if (field == 22) {
      s->startTicks = std::strtoull(p, nullptr, 10);
      return s->startTicks != 0;
    }
    while (*p != 0 && *p != ' ') ++p;
  }
  return false;
}

// The signals pending at a task (its own and its thread group's), from its status file; 0 when unreadable.
uint64_t pendingSignals(const std::string& statusPath) {
  char buf[4096];
  if (!readSmall(statusPath, buf, sizeof(buf))) return 0;
  uint64_t pending = 0;
  for (const char* key : {"\nSigPnd:", "\nShdPnd:"}) {
    const char* p = std::strstr(buf, key);
    if (p != nullptr) pending |= std::strtoull(p + std::strlen(key), nullptr, 16);
  }
  return pending;
}

bool zombie(char state) { return state == 'Z' || state == 'X' || state == 'x'; }

uint64_t pidNamespaceOfThisProcess() {
  struct stat st {};
  if (stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

// Whether every task of the process `dir` names (/proc/<pid>) is past the point of return: in do_exit, a zombie, gone,
// or with a SIGKILL pending. A leader that is a zombie while another thread runs (pthread_exit) is no exiting process.
bool everyTaskExiting(const std::string& dir) {
  DIR* d = opendir((dir + "/task").c_str());
  if (d == nullptr) return false;
  bool all = true;
  int tasks = 0;
  while (all) {
    const dirent* e = readdir(d);
    if (e == nullptr) break;
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    ++tasks;
    const std::string task = dir + "/task/" + e->d_name;
    Stat s;
    if (!readStat(task + "/stat", &s)) continue;  // the task was reaped while listed
    const bool ending =
        zombie(s.state) || (s.flags & kTaskExiting) != 0 || (pendingSignals(task + "/status") & kSigKillBit) != 0;
    all = ending;
  }
  closedir(d);
  return all && tasks > 0;
}

}  // namespace

ProcessIdentity thisProcessIdentity() {
  ProcessIdentity id;
  id.pid = static_cast<int64_t>(getpid());
  Stat s;
  // /proc may be mounted for another pid namespace (a container's): then its "self" is not this pid, and no peer could
  // find this process there either.
  if (!readStat("/proc/self/stat", &s) || s.pid != id.pid) return id;
  id.startTicks = s.startTicks;
  id.pidNamespace = pidNamespaceOfThisProcess();
  return id;
}

ProcessState processState(const ProcessIdentity& id) {
  if (id.pid <= 0 || id.startTicks == 0 || id.pidNamespace == 0) return ProcessState::kUnknown;
  // Another pid namespace: its pid means nothing here.
  if (id.pidNamespace != pidNamespaceOfThisProcess()) return ProcessState::kUnknown;
  const std::string dir = "/proc/" + std::to_string(id.pid);
  Stat s;
  if (!readStat(dir + "/stat", &s)) {
    // No entry: gone if the kernel agrees that no process has the pid (not merely an unreadable /proc).
    return kill(static_cast<pid_t>(id.pid), 0) != 0 && errno == ESRCH ? ProcessState::kGone : ProcessState::kUnknown;
  }
  if (s.startTicks != id.startTicks) return ProcessState::kGone;  // its pid belongs to a later process
  // A SIGKILL cannot be caught or ignored: the process dies, although its exit (a GPU context's teardown) may take a
  // while. The thread group's pending set (ShdPnd) holds the one kill() sent until the last thread is gone.
  if ((pendingSignals(dir + "/status") & kSigKillBit) != 0) return ProcessState::kGone;
  if ((zombie(s.state) || (s.flags & kTaskExiting) != 0) && everyTaskExiting(dir)) return ProcessState::kGone;
  return ProcessState::kAlive;
}

}  // namespace epcomm
