// Copyright epcomm authors. Errors: one exception type with a code, a message and the throw site.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace epcomm {

/// What went wrong, coarse enough to branch on.
enum class ErrorCode : int {
  kInvalidArgument = 1,  ///< A tensor or argument does not match the contract (shape, dtype, stride, range).
  kInvalidConfig,        ///< A Config field or combination of fields is invalid.
  kNotBuilt,             ///< The requested backend or feature was not compiled into this build.
  kUnavailable,          ///< Built, but the machine lacks what it needs (no GPU, no RDMA device, ...).
  kCuda,                 ///< A CUDA runtime/driver call failed.
  kNccl,                 ///< An NCCL call failed.
  kFabric,               ///< A libfabric call failed.
  kVerbs,                ///< A libibverbs call failed.
  kSystem,               ///< A POSIX call failed (socket, mmap, ...).
  kBootstrap,            ///< Rendezvous failed: a rank never joined, a peer closed its connection.
  kTimeout,              ///< A wait exceeded EPCOMM_TIMEOUT_MS; the message names the peer and phase.
  kPeerFailure,          ///< A peer died or reported an error.
  kDeviceError,          ///< A kernel detected a bad input (e.g. an expert index out of range).
  kInternal,             ///< A bug in epcomm.
};

/// Short stable name of an ErrorCode ("invalid_argument", "timeout", ...).
const char* errorCodeName(ErrorCode code);

/// The one exception type of epcomm. what() reads "epcomm <code> at <file>:<line>: <message>", where <file> is the
/// throw site relative to the project root ("src/core/config.cc").
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message, const char* file, int line);
  ErrorCode code() const { return code_; }
  /// The message without the code and location prefix.
  const std::string& message() const { return message_; }
  const char* file() const { return file_; }
  int line() const { return line_; }

 private:
  ErrorCode code_;
  std::string message_;
  const char* file_;
  int line_;
};

namespace detail {
[[noreturn]] void throwError(ErrorCode code, const std::string& message, const char* file, int line);
}  // namespace detail

}  // namespace epcomm

/// Throws epcomm::Error; `msg` is a stream expression: EPCOMM_THROW(kInvalidArgument, "x has " << n << " rows").
#define EPCOMM_THROW(code, msg)                                                                     \
  do {                                                                                              \
    std::ostringstream epcomm_oss_;                                                                 \
    epcomm_oss_ << msg;                                                                             \
    ::epcomm::detail::throwError(::epcomm::ErrorCode::code, epcomm_oss_.str(), __FILE__, __LINE__); \
  } while (0)

/// Throws epcomm::Error with `code` unless `cond` holds.
#define EPCOMM_CHECK(cond, code, msg) \
  do {                                \
    if (!(cond)) {                    \
      EPCOMM_THROW(code, msg);        \
    }                                 \
  } while (0)
