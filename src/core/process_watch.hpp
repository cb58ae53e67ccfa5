// Whether a peer's process on this host has exited, known at once (a pidfd) instead of after a timeout.
//
// The libfabric engine needs it over shm: libfabric's shm (1.17, the Debian and device version) guards each process's
// region with a process-shared spin lock that its owner takes to read its command queue and every writer takes to post
// into it. A process killed while it holds its own region's lock leaves the lock held for good, and every later write
// to that process spins in fi_writemsg / fi_inject_write forever (seen: a rank killed mid-dispatch, and both survivors'
// writes to it spun on that lock in its region until the test's deadline). So the libfabric engine never hands shm a
// write to a peer whose process has exited: the write fails at once, naming the process.
#pragma once

#include <cstdint>

#include "core/process_liveness.hpp"

namespace epcomm {

/// A watch on a process of this host: a pidfd that turns readable once the process exits.
class ProcessWatch {
 public:
  ProcessWatch() = default;
  /// Watches `id`, a process of this host (a pid names nothing on another one: the caller knows where `id` runs), when
  /// it is in this PID namespace and is not this process; else (or on a kernel without pidfd_open, Linux < 5.3)
  /// watches nothing.
  explicit ProcessWatch(const ProcessIdentity& id);
  ~ProcessWatch();
  ProcessWatch(const ProcessWatch&) = delete;
  ProcessWatch& operator=(const ProcessWatch&) = delete;

  /// Whether the process exited (or was gone when the watch began). One poll(2) on the pidfd; false when unwatched.
  bool exited() const;
  int64_t pid() const { return pid_; }

 private:
  int fd_ = -1;
  bool goneAtStart_ = false;
  int64_t pid_ = 0;
};

}  // namespace epcomm
