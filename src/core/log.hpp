// Logging to stderr with prefix host:pid:rank, filtered by EPCOMM_LOG_LEVEL.
#pragma once

#include <sstream>
#include <string>

namespace epcomm {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

/// The level from EPCOMM_LOG_LEVEL (read once).
LogLevel logLevel();
/// Sets the rank shown in the prefix (until set: "-").
void setLogRank(int rank);
/// Writes one line (thread-safe).
void logLine(LogLevel level, const std::string& message);

}  // namespace epcomm

#define EPCOMM_LOG(level, msg)                                                                   \
  do {                                                                                           \
    if (static_cast<int>(::epcomm::LogLevel::level) <= static_cast<int>(::epcomm::logLevel())) { \
      std::ostringstream epcomm_log_oss_;                                                        \
      epcomm_log_oss_ << msg;                                                                    \
      ::epcomm::logLine(::epcomm::LogLevel::level, epcomm_log_oss_.str());                       \
    }                                                                                            \
  } while (0)
