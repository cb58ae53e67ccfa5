#include "core/log.hpp"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace epcomm {

static std::atomic<int> gLogRank{-1};

LogLevel logLevel() {
  // Read directly (not through env()) so that env parsing itself may log.
  static const LogLevel level = [] {
    const char* v = std::getenv("EPCOMM_LOG_LEVEL");
    if (v == nullptr) return LogLevel::kWarn;
    if (std::strcmp(v, "error") == 0) return LogLevel::kError;
    if (std::strcmp(v, "info") == 0) return LogLevel::kInfo;
    if (std::strcmp(v, "debug") == 0) return LogLevel::kDebug;
    return LogLevel::kWarn;
  }();
  return level;
}

void setLogRank(int rank) { gLogRank.store(rank); }

void logLine(LogLevel level, const std::string& message) {
  static std::mutex mutex;
  static const char* names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
  char host[64] = {0};
  gethostname(host, sizeof(host) - 1);
  int rank = gLogRank.load();
  std::lock_guard<std::mutex> lock(mutex);
  if (rank >= 0) {
    std::fprintf(stderr, "%s:%d:%d epcomm %s %s\n", host, static_cast<int>(getpid()), rank,
                 names[static_cast<int>(level)], message.c_str());
  } else {
    std::fprintf(stderr, "%s:%d:- epcomm %s %s\n", host, static_cast<int>(getpid()), names[static_cast<int>(level)],
                 message.c_str());
  }
}

}  // namespace epcomm
