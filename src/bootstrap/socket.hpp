// Small POSIX TCP helpers for the bootstrap: every blocking operation is bounded by a deadline.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace epcomm {
namespace bootstrap {

using Clock = std::chrono::steady_clock;

/// A point in time after which a socket operation gives up.
class Deadline {
 public:
  /// Expires `ms` milliseconds from now (clamped to 30 days, so a huge EPCOMM_TIMEOUT_MS cannot overflow the clock).
  explicit Deadline(int64_t ms)
      : end_(Clock::now() + std::chrono::milliseconds(ms < kMaxMs ? (ms > 0 ? ms : 0) : kMaxMs)) {}
  /// Milliseconds left, clamped to [0, INT32_MAX] so that it can be passed to poll().
  int remainingMs() const;
  bool expired() const { return Clock::now() >= end_; }

 private:
  static constexpr int64_t kMaxMs = int64_t{30} * 24 * 3600 * 1000;
  Clock::time_point end_;
};

/// Owns one file descriptor; closes it on destruction. Move-only.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& other) noexcept : fd_(other.release()) {}
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() { close(); }

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release();
  void close();

 private:
  int fd_ = -1;
};

/// Outcome of a bounded transfer; the caller turns it into an Error that names the peer and the phase.
enum class IoStatus {
  kOk,
  kClosed,   ///< The peer closed the connection (EOF, EPIPE, ECONNRESET).
  kTimeout,  ///< The deadline passed first.
  kError,    ///< Another errno; see IoResult::err.
};

struct IoResult {
  IoStatus status = IoStatus::kOk;
  int err = 0;  ///< errno for kError/kClosed, 0 otherwise.
  bool ok() const { return status == IoStatus::kOk; }
  /// "closed", "timed out" or strerror(err).
  std::string describe() const;
};

/// Writes all `len` bytes of `data` to the non-blocking socket `fd` (MSG_NOSIGNAL: a closed peer is an error, not
/// a SIGPIPE).
IoResult sendAll(int fd, const void* data, size_t len, const Deadline& deadline);

/// Reads exactly `len` bytes into `data` from the non-blocking socket `fd`.
IoResult recvAll(int fd, void* data, size_t len, const Deadline& deadline);

/// Host and port parsed from "host:port" or "[v6addr]:port".
struct HostPort {
  std::string host;
  std::string port;
};

/// Parses `text`; throws kInvalidArgument when it is not host:port with a port in [1, 65535].
HostPort parseHostPort(const std::string& text);

/// A listening, non-blocking socket bound to `addr` with SO_REUSEADDR; throws kBootstrap naming the address.
Socket listenOn(const HostPort& addr, int backlog);

/// Connects a non-blocking socket to `addr` once, waiting at most until `deadline`. On failure returns an invalid
/// Socket and stores the reason in *why (the caller retries: rank 0 may not listen yet).
Socket connectOnce(const HostPort& addr, const Deadline& deadline, std::string* why);

/// Accepts one pending connection on the listening socket (non-blocking; invalid Socket when none is pending).
/// *peer receives "ip:port" of the other end.
Socket acceptOne(int listenFd, std::string* peer);

/// Makes `fd` non-blocking and sets TCP_NODELAY (bootstrap messages are small and latency-bound).
void configureStream(int fd);

}  // namespace bootstrap
}  // namespace epcomm
