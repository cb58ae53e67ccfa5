// Failing together on the GPU backends whose kernels wait for each other (nvlink, nvshmem): one page of host memory
// per object, shared by the ranks of a node (POSIX shared memory; each rank registers its mapping with CUDA, mapped
// into its GPU). Every rank has a slot in it:
//   [0, 128)    its kernels' error record (the backend's own struct; the kernels get this address as `hostError`),
//   [128, 132)  its abort word: 0, or s + 1 once rank s aborted (written by that peer's host, polled by this rank's
//               kernels in the slow path of their waits: a kernel finds it at hostError + kAbortWordOffset),
//   [136, 152)  the nvlink and nvshmem backends' elastic-ranks words (proposal and barrier counter, nvlink_agree.hpp),
//   [152, 176)  its process's identity (core/process_liveness.hpp), written at open(): a peer whose wait timed out
//               can tell whether this rank's process is gone and name it as the likely cause (deadPeers()),
//   [192, 512)  its note: what this rank says when it aborts (written by its host, read by its peers' hosts).
// A rank whose call is refused (an argument check) writes its note and sets the abort word of every peer of its node;
// their kernels stop waiting at their next slow poll and record "aborted by rank s", and their next call raises the
// note. No CUDA here: the backend registers page() itself.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/process_liveness.hpp"
#include "epcomm/bootstrap.hpp"
#include "epcomm/error.hpp"

namespace epcomm {

constexpr uint64_t kAbortSlotBytes = 512;
/// From the start of a rank's slot (its kernels' error record) to its abort word.
constexpr uint64_t kAbortWordOffset = 128;
constexpr uint64_t kAbortProcessOffset = 152;
constexpr uint64_t kAbortNoteOffset = 192;
constexpr uint32_t kAbortTextBytes = 280;

/// What a note is about.
enum AbortKind : int32_t {
  kAbortDispatch = 0,  ///< the rank refused its dispatch (an argument check): nothing was sent
  kAbortCombine = 1,   ///< the rank refused its combine
  kAbortFailed = 2,    ///< the rank's object failed (its kernel timed out or saw a bad input): the round is lost
};

/// A rank's note (in its slot at kAbortNoteOffset). `seq` is written first and `seqEnd` last: a reader that sees
/// them equal (and not 0) read a complete note.
struct AbortNote {
  uint32_t seq;
  uint32_t round;
  int32_t kind;  ///< AbortKind
  int32_t code;  ///< ErrorCode of the rank's own error
  uint32_t length;
  char text[kAbortTextBytes];
  uint32_t seqEnd;
};
static_assert(kAbortNoteOffset + sizeof(AbortNote) <= kAbortSlotBytes, "an abort note fits its slot");
static_assert(kAbortProcessOffset + sizeof(ProcessIdentity) <= kAbortNoteOffset, "a process identity fits its place");

/// See the file comment. Not thread-safe: the object's caller thread only.
class AbortBoard {
 public:
  AbortBoard() = default;
  ~AbortBoard();
  AbortBoard(const AbortBoard&) = delete;
  AbortBoard& operator=(const AbortBoard&) = delete;

  /// Collective over `bootstrap` (three steps): the lowest rank of each host creates the page, its other ranks map it.
  /// Where shared memory cannot be made or opened, the rank gets a private page (its slot works, its peers' aborts
  /// do not reach it: they then end its waits at the timeout). Throws only the bootstrap's errors.
  void open(Bootstrap& bootstrap);
  /// The page (page-aligned, bytes() long, zeroed at creation) and rank r's slot in it.
  uint8_t* page() const { return page_; }
  uint64_t bytes() const { return bytes_; }
  uint8_t* slot(uint32_t r) const { return page_ + kAbortPageHeader + static_cast<uint64_t>(r) * kAbortSlotBytes; }

  /// Writes this rank's note and sets the abort word of every peer that shares the page (a peer aborted by another
  /// rank first keeps that one). Never throws.
  void raise(AbortKind kind, uint32_t round, ErrorCode code, const std::string& text);
  /// A call whose send half an argument check refused (`e`, before anything was launched): raise() for the round
  /// the call belongs to (a dispatch: the next one, `dispatchSends` dispatch send halves having been launched; a
  /// combine: the last dispatch's), so that the peers waiting for this rank's data stop at once instead of at their
  /// timeout. Nothing for a receive half (no peer waits for it) or a world of one. Never throws.
  void raiseRefusal(bool doSend, AbortKind kind, uint32_t dispatchSends, const Error& e);
  /// Takes back what raise() set (this rank calls again with good arguments): a peer whose kernels have not seen it
  /// yet goes on. Never throws.
  void withdraw();
  /// Whether rank r maps this very page (its slot and this rank's are shared memory).
  bool sharedWith(uint32_t r) const { return r < shared_.size() && shared_[r] != 0; }
  /// Whether this rank's abort words are set at its peers (raise without withdraw).
  bool raised() const { return raised_; }
  /// The error a peer that rank `me`'s kernels saw abort raises on `me`: "rank s aborted dispatch (round n): <its
  /// text>" and the code (an argument error of the peer becomes kPeerFailure; a timeout stays kTimeout).
  std::string describe(uint32_t sender, ErrorCode* code) const;

  /// The peers sharing the page whose process is gone (exited, killed, or exiting: processState()), ascending. A
  /// peer whose process this rank could not see at open() (another pid namespace, no /proc) is never named.
  std::vector<uint32_t> deadPeers() const;
  /// Whether peer r is one of deadPeers().
  bool peerGone(uint32_t r) const;
  /// `message` with the dead peers named as the likely cause of a failed wait, for an error of this rank's kernels:
  /// "<message>; the process of rank 2 has exited (pid 4711): it is the likely cause". Unchanged when no peer is dead
  /// or the message already says so (a peer's note that named it).
  std::string blameDeadPeers(const std::string& message) const;

  static constexpr uint64_t kAbortPageHeader = 64;

 private:
  uint8_t* page_ = nullptr;
  uint64_t bytes_ = 0;
  uint32_t rank_ = 0, world_ = 0;
  std::vector<uint8_t> shared_;  // per rank: 1 when it maps this very page (its abort word reaches its kernels)
  std::vector<ProcessIdentity> processes_;  // per peer sharing the page: its process, if seen alive at open()
  bool owned_ = false;                      // page_ is mapped (shared or private): unmapped on destruction
  uint32_t seq_ = 0;
  bool raised_ = false;
};

}  // namespace epcomm
