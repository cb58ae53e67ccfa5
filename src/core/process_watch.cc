#include "core/process_watch.hpp"

#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434  // the same number on every architecture (Linux 5.3)
#endif

namespace epcomm {

ProcessWatch::ProcessWatch(const ProcessIdentity& id) : pid_(id.pid) {
  const ProcessIdentity self = thisProcessIdentity();
  if (id.pid <= 0 || id.pid == self.pid || id.pidNamespace == 0 || id.pidNamespace != self.pidNamespace) return;
  const long fd = syscall(SYS_pidfd_open, static_cast<pid_t>(id.pid), 0);
  // No pidfd (ENOSYS, EPERM in a sandbox): no watch, but a process already gone (ESRCH) is known. With one, the pid may
  // already name another process (the peer's exited and the pid was reused): its start time tells.
  if (fd >= 0) fd_ = static_cast<int>(fd);
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
