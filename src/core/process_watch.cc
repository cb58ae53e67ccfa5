#include "core/process_watch.hpp"

#include <poll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <fstream>
#include <string>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434  // the same number on every architecture (Linux 5.3)
#endif

namespace epcomm {

uint64_t thisHostKey() {
  static const uint64_t key = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string boot;
    struct stat ns {};
    if (!std::getline(in, boot) || boot.empty() || stat("/proc/self/ns/pid", &ns) != 0) return uint64_t{0};
    boot += ":" + std::to_string(static_cast<unsigned long long>(ns.st_ino));
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (unsigned char c : boot) h = (h ^ c) * 1099511628211ull;
    return h == 0 ? uint64_t{1} : h;
  }();
  return key;
}

ProcessWatch::ProcessWatch(uint64_t hostKey, const ProcessIdentity& id) : pid_(id.pid) {
  if (hostKey == 0 || hostKey != thisHostKey() || id.pid <= 0 || id.pid == static_cast<int64_t>(getpid())) return;
  const long fd = syscall(SYS_pidfd_open, static_cast<pid_t>(id.pid), 0);
  if (fd < 0) {
    // ESRCH: no such process any more. Other errors (ENOSYS, EPERM in a sandbox): no watch.
    goneAtStart_ = processState(id) == ProcessState::kGone;
    return;
  }
  fd_ = static_cast<int>(fd);
  // The pid may already name another process (the peer's exited and the pid was reused): its start time tells.
  goneAtStart_ = processState(id) == ProcessState::kGone;
}

ProcessWatch::~ProcessWatch() {
  if (fd_ >= 0) close(fd_);
}

bool ProcessWatch::exited() const {
  if (goneAtStart_) return true;
  if (fd_ < 0) return false;
  pollfd p{fd_, POLLIN, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
}

}  // namespace epcomm
