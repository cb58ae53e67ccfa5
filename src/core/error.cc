#include "epcomm/error.hpp"

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

Error::Error(ErrorCode code, const std::string& message, const char* file, int line)
    : std::runtime_error(formatWhat(code, message, file, line)),
      code_(code),
      message_(message),
      file_(file),
      line_(line) {}

namespace detail {
void throwError(ErrorCode code, const std::string& message, const char* file, int line) {
  throw Error(code, message, file, line);
}
}  // namespace detail

}  // namespace epcomm
