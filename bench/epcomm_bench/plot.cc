#include "plot.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <string>

namespace epcomm {
namespace bench {

namespace {

std::string findScript() {
  if (const char* p = std::getenv("EPBENCH_PLOT")) return p;
  char exe[PATH_MAX] = {0};
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n > 0) {
    std::string dir(exe, static_cast<size_t>(n));
    dir = dir.substr(0, dir.rfind('/'));
    const std::string installed = dir + "/epcomm-bench-plot";
    if (access(installed.c_str(), R_OK) == 0) return installed;
  }
#ifdef EPBENCH_SOURCE_DIR
  const std::string source = std::string(EPBENCH_SOURCE_DIR) + "/scripts/plot";
  if (access(source.c_str(), R_OK) == 0) return source;
#endif
  return "";
}

}  // namespace

bool drawPlot(const std::string& json, const std::string& png, std::string* why) {
  const std::string script = findScript();
  if (script.empty()) {
    *why = "scripts/plot not found: set EPBENCH_PLOT to its path";
    return false;
  }
  const pid_t pid = fork();
  if (pid == 0) {
    execlp("python3", "python3", script.c_str(), "--out", png.c_str(), json.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int st = 0;
  if (pid < 0 || waitpid(pid, &st, 0) != pid) {
    *why = "could not start python3";
    return false;
  }
  if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return true;
  if (WIFEXITED(st) && WEXITSTATUS(st) == 127) {
    *why = "python3 not found";
  } else {
    *why = "python3 " + script + " failed (exit " + std::to_string(WIFEXITED(st) ? WEXITSTATUS(st) : -1) + ")";
  }
  return false;
}

}  // namespace bench
}  // namespace epcomm
