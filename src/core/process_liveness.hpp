// Whether a process of this node is still there, judged from an identity it recorded while it ran: its pid, the pid
// namespace the pid belongs to, and its start time (so that another process that got the pid later is not taken for
// it). The abort board records every rank's identity in its slot, so that a rank whose wait timed out can name the
// peer whose process is gone. Linux /proc; wherever the answer is not certain it is kUnknown, never kGone.
#pragma once

#include <cstdint>

namespace epcomm {

/// A process as its peers on the node can recognise it. Plain data (it lives in shared memory).
struct ProcessIdentity {
  int64_t pid = 0;
  uint64_t pidNamespace = 0;  ///< inode of /proc/self/ns/pid; 0 when unreadable
  uint64_t startTicks = 0;    ///< field 22 of /proc/<pid>/stat (clock ticks after boot); 0 when unreadable
};

/// What processState() can tell.
enum class ProcessState {
  kAlive,    ///< the process runs (or is stopped: it may go on)
  kGone,     ///< it exited or is exiting: no /proc entry, a zombie, a SIGKILL pending, or another process on its pid
  kUnknown,  ///< it cannot be seen from here (another pid namespace, /proc unreadable, an identity left empty)
};

/// The calling process's identity; startTicks and pidNamespace are 0 where /proc does not show this process's own
/// namespace (then no peer can judge it).
ProcessIdentity thisProcessIdentity();

/// Whether the process `id` is still there, as seen from the calling process. Reads /proc (a few small files; a
/// process that is exiting costs one more per thread). Never blocks.
ProcessState processState(const ProcessIdentity& id);

}  // namespace epcomm
