#include "epcomm/error.hpp"

#include <cstring>

namespace epcomm {

const char* errorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "invalid_argument";
    case ErrorCode::kInvalidConfig:
      return "invalid_config";
    case ErrorCode::kNotBuilt:
      return "not_built";
    case ErrorCode::kUnavailable:
      return "unavailable";
    case ErrorCode::kCuda:
      return "cuda";
    case ErrorCode::kNccl:
      return "nccl";
    case ErrorCode::kFabric:
      return "fabric";
    case ErrorCode::kVerbs:
      return "verbs";
    case ErrorCode::kSystem:
      return "system";
    case ErrorCode::kBootstrap:
      return "bootstrap";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kPeerFailure:
      return "peer_failure";
    case ErrorCode::kDeviceError:
      return "device_error";
    case ErrorCode::kInternal:
      return "internal";
  }
  return "unknown";
}

static std::string formatWhat(ErrorCode code, const std::string& message, const char* file, int line) {
  std::ostringstream oss;
  oss << "epcomm " << errorCodeName(code) << " at " << file << ":" << line << ": " << message;
  return oss.str();
}

// The throw site relative to the project (src/core/error.cc, not the build machine's /home/.../src/core/error.cc):
// every source file of the project is compiled under the same root as this one, so its root prefix is dropped.
static const char* projectRelative(const char* file) {
  static const std::string root = [] {
    const std::string self = __FILE__, tail = "src/core/error.cc";
    if (self.size() < tail.size() || self.compare(self.size() - tail.size(), tail.size(), tail) != 0)
      return std::string();
    return self.substr(0, self.size() - tail.size());
  }();
  if (file == nullptr) return "?";
  if (!root.empty() && std::strncmp(file, root.c_str(), root.size()) == 0) return file + root.size();
  return file;
}

Error::Error(ErrorCode code, const std::string& message, const char* file, int line)
    : std::runtime_error(formatWhat(code, message, projectRelative(file), line)),
      code_(code),
      message_(message),
      file_(projectRelative(file)),
      line_(line) {}

namespace detail {
void throwError(ErrorCode code, const std::string& message, const char* file, int line) {
  throw Error(code, message, file, line);
}
}  // namespace detail

}  // namespace epcomm
