#include "core/abort_board.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "core/log.hpp"

namespace epcomm {

namespace {

constexpr size_t kNameBytes = 64;

AbortNote* noteAt(uint8_t* slot) { return reinterpret_cast<AbortNote*>(slot + kAbortNoteOffset); }
uint32_t* wordAt(uint8_t* slot) { return reinterpret_cast<uint32_t*>(slot + kAbortWordOffset); }

// Maps `bytes` of the shared memory object `name` (created: O_EXCL, zero-filled by ftruncate); null when it fails.
uint8_t* mapShared(const char* name, uint64_t bytes, bool create) {
  int fd = -1;
  if (create) {
    fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 && errno == EEXIST) {
      // Left by a process that died before unlinking it (its pid is ours now): it is nobody's any more.
      shm_unlink(name);
      fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    }
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      close(fd);
      shm_unlink(name);
      fd = -1;
    }
  } else {
    fd = shm_open(name, O_RDWR, 0600);
  }
  if (fd < 0) return nullptr;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    if (create) shm_unlink(name);
    return nullptr;
  }
  return static_cast<uint8_t*>(p);
}

}  // namespace

AbortBoard::~AbortBoard() {
  if (owned_) munmap(page_, bytes_);
}

void AbortBoard::open(Bootstrap& bootstrap) {
  rank_ = static_cast<uint32_t>(bootstrap.rank());
  world_ = static_cast<uint32_t>(bootstrap.worldSize());
  const uint64_t page = static_cast<uint64_t>(std::max(4096L, sysconf(_SC_PAGESIZE)));
  bytes_ = (kAbortPageHeader + static_cast<uint64_t>(world_) * kAbortSlotBytes + page - 1) / page * page;

  // 1. Where every rank runs: the lowest rank of each host creates its page.
  std::vector<char> hosts(kNameBytes * world_, 0);
  char mine[kNameBytes] = {0};
  gethostname(mine, kNameBytes - 1);
  bootstrap.allGather(mine, hosts.data(), kNameBytes);
  auto host = [&](uint32_t r) {
    return std::string(hosts.data() + r * kNameBytes, strnlen(hosts.data() + r * kNameBytes, kNameBytes));
  };
  uint32_t leader = rank_;
  for (uint32_t r = 0; r < world_; ++r) {
    if (host(r) == host(rank_)) {
      leader = r;
      break;
    }
  }
  char name[kNameBytes] = {0};
  if (leader == rank_ && world_ > 1) {
    static std::atomic<uint32_t> objects{0};
    std::snprintf(name, sizeof(name), "/epcomm-abort-%d-%u", static_cast<int>(getpid()), objects.fetch_add(1));
    page_ = mapShared(name, bytes_, true);
    if (page_ == nullptr) {
      EPCOMM_LOG(kWarn, "rank " << rank_ << ": no shared memory for the abort board (" << name << ": "
                                << std::strerror(errno)
                                << "): peers' refused calls end this node's waits at the timeout");
      name[0] = 0;
    }
  }
  // 2. The page's name: every other rank of the host maps its leader's.
  std::vector<char> names(kNameBytes * world_, 0);
  bootstrap.allGather(name, names.data(), kNameBytes);
  const char* theirs = names.data() + leader * kNameBytes;
  if (leader != rank_ && theirs[0] != 0) page_ = mapShared(theirs, bytes_, false);
  const bool isShared = page_ != nullptr && theirs[0] != 0;
  if (page_ == nullptr) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      if (leader == rank_ && name[0] != 0) shm_unlink(name);
      EPCOMM_THROW(kUnavailable, "rank " << rank_ << ": cannot map " << bytes_
                                         << " bytes for the error record: " << std::strerror(errno));
    }
    page_ = static_cast<uint8_t*>(p);
  }
  owned_ = true;
  // This rank's process, for peers that find their wait timed out (deadPeers): written before step 3, so every peer
  // reads it after its own step 3.
  const ProcessIdentity self = thisProcessIdentity();
  std::memcpy(slot(rank_) + kAbortProcessOffset, &self, sizeof(self));
  // 3. Who mapped which page: a rank's abort reaches exactly the peers that mapped its leader's page. After this step
  // every rank of the host has opened the name, so the leader removes it (nothing stays behind in /dev/shm).
  struct Mapped {
    char leaderName[kNameBytes];
    uint8_t ok;
  } me{};
  std::memcpy(me.leaderName, theirs, kNameBytes);
  me.ok = isShared ? 1 : 0;
  std::vector<Mapped> all(world_);
  bootstrap.allGather(&me, all.data(), sizeof(Mapped));
  if (leader == rank_ && name[0] != 0) shm_unlink(name);
  shared_.assign(world_, 0);
  for (uint32_t r = 0; r < world_; ++r) {
    shared_[r] =
        r != rank_ && isShared && all[r].ok != 0 && std::strncmp(all[r].leaderName, me.leaderName, kNameBytes) == 0 ? 1
                                                                                                                    : 0;
  }
  // A peer is watched only if its process could be seen alive now: one in another pid namespace (or whose identity
  // could not be read) is never named dead.
  processes_.assign(world_, ProcessIdentity{});
  for (uint32_t r = 0; r < world_; ++r) {
    if (shared_[r] == 0) continue;
    ProcessIdentity theirs;
    std::memcpy(&theirs, slot(r) + kAbortProcessOffset, sizeof(theirs));
    if (processState(theirs) == ProcessState::kAlive) processes_[r] = theirs;
  }
}

void AbortBoard::raise(AbortKind kind, uint32_t round, ErrorCode code, const std::string& text) {
  if (page_ == nullptr) return;
  AbortNote* n = noteAt(slot(rank_));
  const uint32_t s = ++seq_;
  __atomic_store_n(&n->seq, s, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_RELEASE);
  n->round = round;
  n->kind = kind;
  n->code = static_cast<int32_t>(code);
  n->length = static_cast<uint32_t>(std::min<size_t>(text.size(), kAbortTextBytes));
  std::memcpy(n->text, text.data(), n->length);
  __atomic_store_n(&n->seqEnd, s, __ATOMIC_RELEASE);
  for (uint32_t p = 0; p < world_; ++p) {
    if (shared_[p] == 0) continue;
    uint32_t expected = 0;
    // The first rank to abort a peer is the one it names; a later abort leaves the word alone.
    __atomic_compare_exchange_n(wordAt(slot(p)), &expected, rank_ + 1, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  }
  raised_ = true;
}

void AbortBoard::raiseRefusal(bool doSend, AbortKind kind, uint32_t dispatchSends, const Error& e) {
  if (!doSend || world_ == 1) return;
  const uint32_t round = kind == kAbortDispatch || dispatchSends == 0 ? dispatchSends : dispatchSends - 1;
  raise(kind, round, e.code(), e.message());
}

void AbortBoard::withdraw() {
  if (!raised_) return;
  for (uint32_t p = 0; p < world_; ++p) {
    if (shared_[p] == 0) continue;
    uint32_t expected = rank_ + 1;
    __atomic_compare_exchange_n(wordAt(slot(p)), &expected, 0u, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  }
  raised_ = false;
}

std::string AbortBoard::describe(uint32_t sender, ErrorCode* code) const {
  *code = ErrorCode::kPeerFailure;
  std::ostringstream oss;
  oss << "rank " << sender;
  if (page_ == nullptr || sender >= world_) return oss.str() + " aborted";
  const AbortNote* n = noteAt(slot(sender));
  AbortNote copy;
  bool complete = false;
  // The sender wrote the note before the abort word, so it is complete; a newer note may be landing over it.
  for (int attempt = 0; attempt < 1000 && !complete; ++attempt) {
    const uint32_t end = __atomic_load_n(&n->seqEnd, __ATOMIC_ACQUIRE);
    std::memcpy(&copy, n, sizeof(copy));
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    const uint32_t begin = __atomic_load_n(&n->seq, __ATOMIC_RELAXED);
    complete = end != 0 && begin == end;
  }
  if (!complete) return oss.str() + " aborted (its message could not be read)";
  const std::string text(copy.text, std::min<uint32_t>(copy.length, kAbortTextBytes));
  switch (copy.kind) {
    case kAbortDispatch:
      oss << " aborted dispatch (its round " << copy.round << "): " << text;
      break;
    case kAbortCombine:
      oss << " aborted combine (its round " << copy.round << "): " << text;
      break;
    default:
      oss << " failed (its round " << copy.round << "): " << text;
      break;
  }
  const ErrorCode theirs = static_cast<ErrorCode>(copy.code);
  // Bad input was the peer's (its arguments, or an index its kernel found); here it is a peer failure. A timeout, a
  // transfer or CUDA error keeps its code (as the host backend's notices do).
  if (copy.code != 0 && theirs != ErrorCode::kInvalidArgument && theirs != ErrorCode::kInvalidConfig &&
      theirs != ErrorCode::kUnavailable && theirs != ErrorCode::kDeviceError) {
    *code = theirs;
  }
  return oss.str();
}

bool AbortBoard::peerGone(uint32_t r) const {
  return r < processes_.size() && processes_[r].pid != 0 && processState(processes_[r]) == ProcessState::kGone;
}

std::vector<uint32_t> AbortBoard::deadPeers() const {
  std::vector<uint32_t> dead;
  for (uint32_t r = 0; r < processes_.size(); ++r) {
    if (peerGone(r)) dead.push_back(r);
  }
  return dead;
}

std::string AbortBoard::blameDeadPeers(const std::string& message) const {
  const std::vector<uint32_t> dead = deadPeers();
  if (dead.empty()) return message;
  std::ostringstream ranks, pids;
  for (size_t i = 0; i < dead.size(); ++i) {
    ranks << (i == 0 ? "" : ", ") << dead[i];
    pids << (i == 0 ? "" : ", ") << processes_[dead[i]].pid;
  }
  const bool one = dead.size() == 1;
  const std::string cause = std::string(one ? "the process of rank " : "the processes of ranks ") + ranks.str() +
                            (one ? " has exited (pid " : " have exited (pids ") + pids.str() +
                            "): " + (one ? "it is" : "they are") + " the likely cause";
  if (message.find(cause) != std::string::npos) return message;
  return message + "; " + cause;
}

}  // namespace epcomm
