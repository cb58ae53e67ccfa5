// TCP rendezvous: a star through rank 0. Every collective is a gather of framed messages at rank 0 followed by
// one reply from rank 0 to every other rank. Rank 0 sees every rank in every collective, so it is the rank that
// can say which peer is missing or misbehaving; on any failure it sends that diagnosis to every other rank
// (an abort frame) before it throws, so all ranks report the same cause.
#include <poll.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bootstrap/socket.hpp"
#include "core/env.hpp"
#include "core/log.hpp"
#include "epcomm/bootstrap.hpp"
#include "epcomm/error.hpp"

namespace epcomm {
namespace bootstrap {
namespace {

// Changes whenever the frame layout or the protocol changes, so mixed builds fail loudly at the hello.
constexpr uint32_t kMagic = 0x45504231;  // "EPB1"
// An abort message longer than this is a corrupt frame, not a diagnosis.
constexpr uint64_t kMaxAbortMessage = 64 * 1024;

enum class Op : uint16_t { kHello = 1, kWelcome = 2, kAllGather = 3, kBarrier = 4, kBroadcast = 5, kAbort = 6 };

// Every message is this header followed by `payload` bytes. Native byte order: the ranks of one job share an
// architecture, and a mismatch would show up as a bad magic.
struct FrameHeader {
  uint32_t magic;
  uint16_t op;
  uint16_t code;     // kAbort: the ErrorCode every rank raises.
  int32_t rank;      // The sender's rank.
  int32_t root;      // kBroadcast: the root; kHello: the sender's world size; else -1.
  uint64_t seq;      // Collective number, counted from 1 on every rank: detects collectives called out of order.
  uint64_t bytes;    // The collective's size argument (same on every rank).
  uint64_t payload;  // Bytes that follow the header.
};
static_assert(sizeof(FrameHeader) == 40, "FrameHeader must have no padding");

const char* opName(uint16_t op) {
  switch (static_cast<Op>(op)) {
    case Op::kHello:
      return "hello";
    case Op::kWelcome:
      return "rendezvous";
    case Op::kAllGather:
      return "allGather";
    case Op::kBarrier:
      return "barrier";
    case Op::kBroadcast:
      return "broadcast";
    case Op::kAbort:
      return "abort";
  }
  return "unknown operation";
}

// One collective call, as every rank must agree on it.
struct Collective {
  Op op;
  uint64_t seq;
  uint64_t bytes;
  int root;

  static Collective fromHeader(const FrameHeader& h) {
    return {static_cast<Op>(h.op), h.seq, h.bytes, static_cast<int>(h.root)};
  }
  bool matches(const FrameHeader& h) const {
    return h.op == static_cast<uint16_t>(op) && h.seq == seq && h.bytes == bytes && h.root == root;
  }
  // "allGather #3 (8 bytes)", "broadcast #4 (16 bytes from rank 1)", "barrier #2", "the rendezvous".
  std::string describe() const {
    std::ostringstream oss;
    if (op == Op::kWelcome || op == Op::kHello) return "the rendezvous";
    oss << opName(static_cast<uint16_t>(op)) << " #" << seq;
    if (op == Op::kAllGather) oss << " (" << bytes << " bytes)";
    if (op == Op::kBroadcast) oss << " (" << bytes << " bytes from rank " << root << ")";
    return oss.str();
  }
};

FrameHeader makeHeader(Op op, int rank, int root, uint64_t seq, uint64_t bytes, uint64_t payload) {
  FrameHeader h{};
  h.magic = kMagic;
  h.op = static_cast<uint16_t>(op);
  h.code = 0;
  h.rank = rank;
  h.root = root;
  h.seq = seq;
  h.bytes = bytes;
  h.payload = payload;
  return h;
}

// "rank 3" or "ranks 2, 3".
std::string rankList(const std::vector<int>& ranks) {
  std::ostringstream oss;
  oss << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) oss << (i ? ", " : "") << ranks[i];
  return oss.str();
}

ErrorCode codeFromWire(uint16_t code) {
  if (code >= static_cast<uint16_t>(ErrorCode::kInvalidArgument) &&
      code <= static_cast<uint16_t>(ErrorCode::kInternal)) {
    return static_cast<ErrorCode>(code);
  }
  return ErrorCode::kBootstrap;
}

// Where rank 0 puts (gather) or takes (reply) one rank's bytes of a collective.
struct Span {
  void* data;
  size_t size;
};

class TcpBootstrap final : public Bootstrap {
 public:
  TcpBootstrap(const std::string& address, int rank, int worldSize, int64_t timeoutMs)
      : address_(address), rank_(rank), world_(worldSize), timeoutMs_(timeoutMs) {
    if (world_ == 1) return;
    HostPort hp = parseHostPort(address_);
    if (rank_ == 0) {
      acceptAll(hp);
    } else {
      connectToRoot(hp);
    }
    EPCOMM_LOG(kDebug, "bootstrap: rank " << rank_ << " of " << world_ << " joined the rendezvous at " << address_);
  }

  int rank() const override { return rank_; }
  int worldSize() const override { return world_; }

  void allGather(const void* send, void* recv, size_t bytes) override {
    checkUsable();
    EPCOMM_CHECK(bytes == 0 || (send != nullptr && recv != nullptr), kInvalidArgument,
                 "allGather of " << bytes << " bytes with a null buffer on rank " << rank_);
    EPCOMM_CHECK(bytes <= SIZE_MAX / static_cast<size_t>(world_), kInvalidArgument,
                 "allGather of " << bytes << " bytes per rank overflows size_t");
    char* out = static_cast<char*>(recv);
    Collective c{Op::kAllGather, ++seq_, bytes, -1};
    if (rank_ == 0 || world_ == 1) {
      if (bytes > 0) std::memmove(out, send, bytes);
      if (world_ == 1) return;
      gatherAtRoot(c, [&](int r) { return Span{out + r * bytes, bytes}; });
      replyFromRoot(c, [&](int) { return Span{out, bytes * world_}; });
    } else {
      sendToRoot(c, send, bytes);
      receiveFromRoot(c, out, bytes * world_);
    }
  }

  void barrier() override {
    checkUsable();
    Collective c{Op::kBarrier, ++seq_, 0, -1};
    if (world_ == 1) return;
    if (rank_ == 0) {
      gatherAtRoot(c, [](int) { return Span{nullptr, 0}; });
      replyFromRoot(c, [](int) { return Span{nullptr, 0}; });
    } else {
      sendToRoot(c, nullptr, 0);
      receiveFromRoot(c, nullptr, 0);
    }
  }

  void broadcast(void* data, size_t bytes, int root) override {
    checkUsable();
    EPCOMM_CHECK(root >= 0 && root < world_, kInvalidArgument,
                 "broadcast root " << root << " is outside [0, " << world_ << ")");
    EPCOMM_CHECK(bytes == 0 || data != nullptr, kInvalidArgument,
                 "broadcast of " << bytes << " bytes with a null buffer on rank " << rank_);
    Collective c{Op::kBroadcast, ++seq_, bytes, root};
    if (world_ == 1) return;
    // The root's bytes travel to rank 0 (unless it is rank 0) and from there to every rank but the root. Every
    // other rank still sends an empty frame so that rank 0 checks that all ranks agree on root and size.
    if (rank_ == 0) {
      gatherAtRoot(c, [&](int r) { return r == root ? Span{data, bytes} : Span{nullptr, 0}; });
      replyFromRoot(c, [&](int r) { return r == root ? Span{nullptr, 0} : Span{data, bytes}; });
    } else {
      sendToRoot(c, rank_ == root ? data : nullptr, rank_ == root ? bytes : 0);
      receiveFromRoot(c, data, rank_ == root ? 0 : bytes);
    }
  }

 private:
  // After a failure the streams are out of step; every later call repeats the first error instead of guessing.
  void checkUsable() const {
    if (failed_) {
      ::epcomm::detail::throwError(
          failCode_,
          "the bootstrap of rank " + std::to_string(rank_) + " is unusable after an earlier error: " + failMessage_,
          __FILE__, __LINE__);
    }
  }

  // Records the error, tells every other rank (from rank 0), and throws.
  [[noreturn]] void fail(ErrorCode code, const std::string& message, int line) {
    failed_ = true;
    failCode_ = code;
    failMessage_ = message;
    if (rank_ == 0) {
      for (Socket& s : peers_) {
        if (s.valid()) sendAbort(s.fd(), code, message);
      }
    }
    ::epcomm::detail::throwError(code, message, __FILE__, line);
  }

  // Best effort: the peer may already be gone, and a short bound keeps a stuck peer from delaying the error.
  void sendAbort(int fd, ErrorCode code, const std::string& message) {
    FrameHeader h = makeHeader(Op::kAbort, rank_, -1, seq_, 0, message.size());
    h.code = static_cast<uint16_t>(code);
    Deadline d(std::min<int64_t>(timeoutMs_, 1000));
    if (sendAll(fd, &h, sizeof(h), d).ok()) sendAll(fd, message.data(), message.size(), d);
  }

  // ---- rendezvous ----

  void acceptAll(const HostPort& hp) {
    Socket listener = listenOn(hp, world_);
    peers_.resize(world_);
    std::vector<std::string> from(world_);
    struct Pending {
      Socket sock;
      std::string from;
    };
    std::vector<Pending> pending;
    Deadline deadline(timeoutMs_);
    int joined = 0;
    while (joined < world_ - 1) {
      std::vector<pollfd> fds;
      fds.push_back({listener.fd(), POLLIN, 0});
      for (Pending& p : pending) fds.push_back({p.sock.fd(), POLLIN, 0});
      int rc = ::poll(fds.data(), fds.size(), deadline.remainingMs());
      if (rc < 0 && errno == EINTR) continue;
      if (rc < 0) fail(ErrorCode::kSystem, std::string("rank 0: poll failed: ") + std::strerror(errno), __LINE__);
      if (rc == 0) {
        std::vector<int> missing;
        for (int r = 1; r < world_; ++r) {
          if (!peers_[r].valid()) missing.push_back(r);
        }
        fail(ErrorCode::kBootstrap,
             "rank 0 waited " + std::to_string(timeoutMs_) + " ms for the rendezvous at " + address_ + ": " +
                 rankList(missing) + " never joined",
             __LINE__);
      }
      // Hellos first, from the back, so that erasing keeps the remaining indices valid.
      for (size_t i = pending.size(); i-- > 0;) {
        if (fds[i + 1].revents == 0) continue;
        Pending p = std::move(pending[i]);
        pending.erase(pending.begin() + static_cast<long>(i));
        int r = admit(std::move(p.sock), p.from, from, deadline);
        if (r > 0) {
          from[r] = p.from;
          ++joined;
        }
      }
      if (fds[0].revents != 0) {
        for (;;) {
          std::string peer;
          Socket s = acceptOne(listener.fd(), &peer);
          if (!s.valid()) break;
          pending.push_back({std::move(s), peer});
        }
      }
    }
    Deadline sendDeadline(timeoutMs_);
    FrameHeader welcome = makeHeader(Op::kWelcome, 0, -1, 0, 0, 0);
    for (int r = 1; r < world_; ++r) {
      IoResult io = sendAll(peers_[r].fd(), &welcome, sizeof(welcome), sendDeadline);
      if (!io.ok()) {
        fail(ErrorCode::kBootstrap,
             "rank " + std::to_string(r) + " closed its connection during the rendezvous (" + io.describe() + ")",
             __LINE__);
      }
    }
  }

  // Reads the hello of one accepted connection. Returns its rank once it is stored in peers_, or -1 when the
  // connection is dropped (not an epcomm bootstrap, or gone before it said hello). Throws on a misconfigured job.
  int admit(Socket sock, const std::string& peer, const std::vector<std::string>& from, const Deadline& deadline) {
    FrameHeader h{};
    IoResult io = recvAll(sock.fd(), &h, sizeof(h), deadline);
    if (!io.ok()) {
      EPCOMM_LOG(kDebug,
                 "bootstrap: rank 0 dropped a connection from " << peer << " before its hello: " << io.describe());
      return -1;
    }
    if (h.magic != kMagic || h.op != static_cast<uint16_t>(Op::kHello)) {
      EPCOMM_LOG(kWarn, "bootstrap: rank 0 ignored a connection from "
                            << peer << ": not an epcomm bootstrap hello of this version (magic 0x" << std::hex
                            << h.magic << ")");
      return -1;
    }
    int r = h.rank;
    std::string problem;
    if (h.root != world_) {
      problem = "rank " + std::to_string(r) + " (from " + peer + ") was started with world size " +
                std::to_string(h.root) + " but rank 0 with world size " + std::to_string(world_);
    } else if (r < 1 || r >= world_) {
      problem = "a process at " + peer + " joined as rank " + std::to_string(r) + ", outside [1, " +
                std::to_string(world_) + ")";
    } else if (peers_[r].valid()) {
      problem = "rank " + std::to_string(r) + " joined twice (from " + from[r] + " and from " + peer + ")";
    }
    if (!problem.empty()) {
      sendAbort(sock.fd(), ErrorCode::kBootstrap, problem);
      fail(ErrorCode::kBootstrap, problem, __LINE__);
    }
    peers_[r] = std::move(sock);
    return r;
  }

  void connectToRoot(const HostPort& hp) {
    Deadline deadline(timeoutMs_);
    std::string why;
    int attempts = 0;
    int backoffMs = 10;
    for (;;) {
      ++attempts;
      root_ = connectOnce(hp, deadline, &why);
      if (root_.valid()) break;
      if (deadline.expired()) {
        fail(ErrorCode::kBootstrap,
             "rank " + std::to_string(rank_) + " could not reach rank 0 at " + address_ + " within " +
                 std::to_string(timeoutMs_) + " ms (" + std::to_string(attempts) + " attempts, last error: " + why +
                 ")",
             __LINE__);
      }
      // Rank 0 may simply not listen yet: retry with a growing pause.
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(backoffMs, deadline.remainingMs())));
      backoffMs = std::min(backoffMs * 2, 200);
    }
    FrameHeader hello = makeHeader(Op::kHello, rank_, world_, 0, 0, 0);
    IoResult io = sendAll(root_.fd(), &hello, sizeof(hello), Deadline(timeoutMs_));
    if (!io.ok()) {
      fail(ErrorCode::kBootstrap,
           "rank " + std::to_string(rank_) + " could not say hello to rank 0 at " + address_ + ": " + io.describe(),
           __LINE__);
    }
    receiveFromRoot(Collective{Op::kWelcome, 0, 0, -1}, nullptr, 0);
  }

  // ---- collectives ----

  // Rank 0: receives one frame of collective `c` from every other rank, in arrival order, into span(r).
  template <typename SpanFn>
  void gatherAtRoot(const Collective& c, SpanFn span) {
    Deadline deadline(timeoutMs_);
    std::vector<int> waiting;
    for (int r = 1; r < world_; ++r) waiting.push_back(r);
    while (!waiting.empty()) {
      std::vector<pollfd> fds;
      for (int r : waiting) fds.push_back({peers_[r].fd(), POLLIN, 0});
      int rc = ::poll(fds.data(), fds.size(), deadline.remainingMs());
      if (rc < 0 && errno == EINTR) continue;
      if (rc < 0) fail(ErrorCode::kSystem, std::string("rank 0: poll failed: ") + std::strerror(errno), __LINE__);
      if (rc == 0) {
        fail(ErrorCode::kTimeout,
             "rank 0 waited " + std::to_string(timeoutMs_) + " ms in " + c.describe() + ": " + rankList(waiting) +
                 " never arrived",
             __LINE__);
      }
      std::vector<int> still;
      for (size_t i = 0; i < waiting.size(); ++i) {
        int r = waiting[i];
        if (fds[i].revents == 0) {
          still.push_back(r);
          continue;
        }
        FrameHeader h{};
        checkIo(recvAll(peers_[r].fd(), &h, sizeof(h), deadline), r, c);
        Span s = span(r);
        if (h.magic != kMagic) {
          fail(ErrorCode::kBootstrap,
               "rank 0 received a corrupt frame from rank " + std::to_string(r) + " during " + c.describe(), __LINE__);
        }
        if (!c.matches(h) || h.payload != s.size) {
          fail(ErrorCode::kBootstrap,
               "collective mismatch: rank " + std::to_string(r) + " called " + Collective::fromHeader(h).describe() +
                   " while rank 0 called " + c.describe() + " (every rank must call the same collectives in order)",
               __LINE__);
        }
        checkIo(recvAll(peers_[r].fd(), s.data, s.size, deadline), r, c);
      }
      waiting.swap(still);
    }
  }

  // Rank 0: sends the result of collective `c` to every other rank.
  template <typename SpanFn>
  void replyFromRoot(const Collective& c, SpanFn span) {
    Deadline deadline(timeoutMs_);
    for (int r = 1; r < world_; ++r) {
      Span s = span(r);
      FrameHeader h = makeHeader(c.op, 0, c.root, c.seq, c.bytes, s.size);
      checkIo(sendAll(peers_[r].fd(), &h, sizeof(h), deadline), r, c);
      checkIo(sendAll(peers_[r].fd(), s.data, s.size, deadline), r, c);
    }
  }

  // Turns a failed transfer with rank `peer` during `c` into an Error naming both ranks.
  void checkIo(const IoResult& io, int peer, const Collective& c) {
    if (io.ok()) return;
    std::string me = "rank " + std::to_string(rank_);
    std::string other = "rank " + std::to_string(peer);
    switch (io.status) {
      case IoStatus::kClosed:
        fail(ErrorCode::kBootstrap, other + " closed its connection during " + c.describe() + " (seen by " + me + ")",
             __LINE__);
      case IoStatus::kTimeout:
        fail(ErrorCode::kTimeout,
             me + " waited " + std::to_string(timeoutMs_) + " ms in " + c.describe() + " for a transfer with " + other +
                 " to finish",
             __LINE__);
      default:
        fail(ErrorCode::kBootstrap,
             me + " lost its connection to " + other + " during " + c.describe() + ": " + io.describe(), __LINE__);
    }
  }

  // Ranks > 0: sends this rank's frame of collective `c`.
  void sendToRoot(const Collective& c, const void* data, size_t size) {
    FrameHeader h = makeHeader(c.op, rank_, c.root, c.seq, c.bytes, size);
    Deadline deadline(timeoutMs_);
    IoResult io = sendAll(root_.fd(), &h, sizeof(h), deadline);
    if (io.ok()) io = sendAll(root_.fd(), data, size, deadline);
    if (io.ok()) return;
    // Rank 0 may have aborted and closed: its abort frame, if still readable, says why.
    readAbortIfAny(c);
    checkIo(io, 0, c);
  }

  // Ranks > 0: receives rank 0's reply to `c` into data (exactly `size` bytes expected).
  void receiveFromRoot(const Collective& c, void* data, size_t size) {
    // Twice the timeout: rank 0 bounds its own wait by one timeout from when it enters, so a rank that entered
    // earlier still hears rank 0's diagnosis (which rank is missing) instead of timing out first with less to say.
    Deadline deadline(2 * timeoutMs_);
    FrameHeader h{};
    IoResult io = recvAll(root_.fd(), &h, sizeof(h), deadline);
    if (io.status == IoStatus::kTimeout) {
      fail(ErrorCode::kTimeout,
           "rank " + std::to_string(rank_) + " waited " + std::to_string(2 * timeoutMs_) + " ms in " + c.describe() +
               " for rank 0's reply (rank 0 or another rank never arrived)",
           __LINE__);
    }
    checkIo(io, 0, c);
    handleRootFrame(h, c, size);
    checkIo(recvAll(root_.fd(), data, size, deadline), 0, c);
  }

  void handleRootFrame(const FrameHeader& h, const Collective& c, size_t size) {
    if (h.magic != kMagic) {
      fail(ErrorCode::kBootstrap,
           "rank " + std::to_string(rank_) + " received a corrupt frame from rank 0 during " + c.describe(), __LINE__);
    }
    if (h.op == static_cast<uint16_t>(Op::kAbort)) {
      std::string message = "(no reason given)";
      if (h.payload <= kMaxAbortMessage) {
        std::string text(h.payload, '\0');
        if (recvAll(root_.fd(), &text[0], text.size(), Deadline(timeoutMs_)).ok()) message = text;
      }
      fail(codeFromWire(h.code),
           message + " (reported by rank 0 to rank " + std::to_string(rank_) + " during " + c.describe() + ")",
           __LINE__);
    }
    if (!c.matches(h) || h.payload != size) {
      fail(ErrorCode::kBootstrap,
           "collective mismatch: rank 0 answered " + Collective::fromHeader(h).describe() + " while rank " +
               std::to_string(rank_) + " called " + c.describe() +
               " (every rank must call the same collectives in order)",
           __LINE__);
    }
  }

  void readAbortIfAny(const Collective& c) {
    FrameHeader h{};
    if (recvAll(root_.fd(), &h, sizeof(h), Deadline(100)).ok() && h.magic == kMagic &&
        h.op == static_cast<uint16_t>(Op::kAbort)) {
      handleRootFrame(h, c, 0);
    }
  }

  std::string address_;
  int rank_;
  int world_;
  int64_t timeoutMs_;
  uint64_t seq_ = 0;
  std::vector<Socket> peers_;  // Rank 0: peers_[r] is the connection to rank r (peers_[0] unused).
  Socket root_;                // Ranks > 0: the connection to rank 0.
  bool failed_ = false;
  ErrorCode failCode_ = ErrorCode::kBootstrap;
  std::string failMessage_;
};

class SelfBootstrap final : public Bootstrap {
 public:
  int rank() const override { return 0; }
  int worldSize() const override { return 1; }
  void allGather(const void* send, void* recv, size_t bytes) override {
    EPCOMM_CHECK(bytes == 0 || (send != nullptr && recv != nullptr), kInvalidArgument,
                 "allGather of " << bytes << " bytes with a null buffer");
    if (bytes > 0) std::memmove(recv, send, bytes);
  }
  void barrier() override {}
  void broadcast(void* data, size_t bytes, int root) override {
    EPCOMM_CHECK(root == 0, kInvalidArgument, "broadcast root " << root << " is outside [0, 1)");
  }
};

}  // namespace
}  // namespace bootstrap

std::unique_ptr<Bootstrap> createTcpBootstrap(const std::string& hostPort, int rank, int worldSize, int64_t timeoutMs) {
  EPCOMM_CHECK(worldSize >= 1, kInvalidArgument, "bootstrap world size must be at least 1, got " << worldSize);
  EPCOMM_CHECK(rank >= 0 && rank < worldSize, kInvalidArgument,
               "bootstrap rank " << rank << " is outside [0, " << worldSize << ")");
  bootstrap::parseHostPort(hostPort);  // Checked on every rank, even W = 1, so a typo fails early everywhere.
  if (timeoutMs <= 0) timeoutMs = env().timeoutMs;
  return std::make_unique<bootstrap::TcpBootstrap>(hostPort, rank, worldSize, timeoutMs);
}

std::unique_ptr<Bootstrap> createBootstrapFromEnv() {
  const Env& e = env();
  EPCOMM_CHECK(!e.bootstrap.empty(), kInvalidArgument,
               "EPCOMM_BOOTSTRAP is not set (host:port of rank 0's rendezvous listener)");
  EPCOMM_CHECK(e.worldSize >= 1, kInvalidArgument,
               "EPCOMM_WORLD_SIZE is not set (or not positive: " << e.worldSize << ")");
  EPCOMM_CHECK(e.rank >= 0, kInvalidArgument, "EPCOMM_RANK is not set (or negative: " << e.rank << ")");
  EPCOMM_CHECK(e.rank < e.worldSize, kInvalidArgument,
               "EPCOMM_RANK=" << e.rank << " is not below EPCOMM_WORLD_SIZE=" << e.worldSize);
  return createTcpBootstrap(e.bootstrap, e.rank, e.worldSize, e.timeoutMs);
}

// Declared in epcomm/mpi_bootstrap.hpp, which is header-only and cannot reach env() itself.
int64_t bootstrapTimeoutMs() { return env().timeoutMs; }

std::unique_ptr<Bootstrap> createSelfBootstrap() { return std::make_unique<bootstrap::SelfBootstrap>(); }

}  // namespace epcomm
