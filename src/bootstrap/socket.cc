#include "bootstrap/socket.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <memory>

#include "epcomm/error.hpp"

namespace epcomm {
namespace bootstrap {

int Deadline::remainingMs() const {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end_ - Clock::now()).count();
  if (left <= 0) return 0;
  return left > INT_MAX ? INT_MAX : static_cast<int>(left);
}

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = other.release();
  }
  return *this;
}

int Socket::release() {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

void Socket::close() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

std::string IoResult::describe() const {
  switch (status) {
    case IoStatus::kOk:
      return "ok";
    case IoStatus::kClosed:
      return "connection closed";
    case IoStatus::kTimeout:
      return "timed out";
    case IoStatus::kError:
      return std::strerror(err);
  }
  return "unknown";
}

static bool isClosedErrno(int err) { return err == EPIPE || err == ECONNRESET || err == ENOTCONN; }

// Waits until `fd` is ready for `events` or the deadline passes. Returns kOk when ready (or when poll reports
// POLLHUP/POLLERR: the following send/recv call then reports the precise error).
static IoResult waitReady(int fd, short events, const Deadline& deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, deadline.remainingMs());
    if (rc > 0) return {};
    if (rc == 0) return {IoStatus::kTimeout, 0};
    if (errno != EINTR) return {IoStatus::kError, errno};
  }
}

IoResult sendAll(int fd, const void* data, size_t len, const Deadline& deadline) {
  const char* p = static_cast<const char*>(data);
  while (len > 0) {
    ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      IoResult r = waitReady(fd, POLLOUT, deadline);
      if (!r.ok()) return r;
      continue;
    }
    int err = n < 0 ? errno : EPIPE;
    return {isClosedErrno(err) ? IoStatus::kClosed : IoStatus::kError, err};
  }
  return {};
}

IoResult recvAll(int fd, void* data, size_t len, const Deadline& deadline) {
  char* p = static_cast<char*>(data);
  while (len > 0) {
    ssize_t n = ::recv(fd, p, len, 0);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return {IoStatus::kClosed, 0};
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      IoResult r = waitReady(fd, POLLIN, deadline);
      if (!r.ok()) return r;
      continue;
    }
    return {isClosedErrno(errno) ? IoStatus::kClosed : IoStatus::kError, errno};
  }
  return {};
}

HostPort parseHostPort(const std::string& text) {
  HostPort hp;
  size_t colon = text.rfind(':');
  EPCOMM_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < text.size(), kInvalidArgument,
               "bootstrap address '" << text << "' is not host:port");
  hp.host = text.substr(0, colon);
  hp.port = text.substr(colon + 1);
  if (hp.host.size() >= 2 && hp.host.front() == '[' && hp.host.back() == ']') {
    hp.host = hp.host.substr(1, hp.host.size() - 2);
  }
  char* end = nullptr;
  long port = std::strtol(hp.port.c_str(), &end, 10);
  EPCOMM_CHECK(end != nullptr && *end == '\0' && port >= 1 && port <= 65535, kInvalidArgument,
               "bootstrap address '" << text << "' has no valid port (1..65535)");
  return hp;
}

namespace {
struct AddrInfoDeleter {
  void operator()(addrinfo* ai) const { freeaddrinfo(ai); }
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoDeleter>;

AddrInfoPtr resolve(const HostPort& addr, bool passive, std::string* why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(addr.host.c_str(), addr.port.c_str(), &hints, &res);
  if (rc != 0) {
    *why = std::string("cannot resolve '") + addr.host + "': " + gai_strerror(rc);
    return nullptr;
  }
  return AddrInfoPtr(res);
}

std::string formatAddress(const sockaddr* sa) {
  char host[INET6_ADDRSTRLEN] = {0};
  int port = 0;
  if (sa->sa_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  } else if (sa->sa_family == AF_INET6) {
    auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}
}  // namespace

void configureStream(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags >= 0) fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

Socket listenOn(const HostPort& addr, int backlog) {
  std::string why;
  AddrInfoPtr res = resolve(addr, true, &why);
  EPCOMM_CHECK(res != nullptr, kBootstrap, "rank 0 cannot listen on " << addr.host << ":" << addr.port << ": " << why);
  int lastErr = 0;
  for (addrinfo* ai = res.get(); ai != nullptr; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!s.valid()) {
      lastErr = errno;
      continue;
    }
    int one = 1;
    setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(s.fd(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(s.fd(), backlog) != 0) {
      lastErr = errno;
      continue;
    }
    configureStream(s.fd());
    return s;
  }
  EPCOMM_THROW(kBootstrap,
               "rank 0 cannot listen on " << addr.host << ":" << addr.port << ": " << std::strerror(lastErr));
}

Socket connectOnce(const HostPort& addr, const Deadline& deadline, std::string* why) {
  AddrInfoPtr res = resolve(addr, false, why);
  if (res == nullptr) return Socket();
  for (addrinfo* ai = res.get(); ai != nullptr; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!s.valid()) {
      *why = std::strerror(errno);
      continue;
    }
    configureStream(s.fd());
    int rc = ::connect(s.fd(), ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno != EINPROGRESS && errno != EINTR) {
      *why = std::strerror(errno);
      continue;
    }
    if (rc != 0) {
      IoResult wait = waitReady(s.fd(), POLLOUT, deadline);
      if (!wait.ok()) {
        *why = wait.describe();
        continue;
      }
      int err = 0;
      socklen_t len = sizeof(err);
      if (getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
      if (err != 0) {
        *why = std::strerror(err);
        continue;
      }
    }
    return s;
  }
  return Socket();
}

Socket acceptOne(int listenFd, std::string* peer) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  for (;;) {
    int fd = ::accept4(listenFd, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC);
    if (fd >= 0) {
      configureStream(fd);
      *peer = formatAddress(reinterpret_cast<sockaddr*>(&ss));
      return Socket(fd);
    }
    // EAGAIN: nothing pending; ECONNABORTED and friends: the client gave up, which is not our error.
    if (errno != EINTR) return Socket();
  }
}

}  // namespace bootstrap
}  // namespace epcomm
