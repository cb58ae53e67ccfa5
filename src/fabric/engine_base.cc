#include "fabric/engine_base.hpp"

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/env.hpp"
#include "core/log.hpp"
#include "core/polling.hpp"

namespace epcomm {
namespace fabric {

int64_t nowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

uint64_t fnv1a64(const void* data, size_t bytes, uint64_t seed) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t h = seed;
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

void checkHostRange(const void* data, size_t bytes) {
  EPCOMM_CHECK(data != nullptr, kInvalidArgument, "registerMemory: null address for " << bytes << " bytes");
  EPCOMM_CHECK(bytes > 0, kInvalidArgument, "registerMemory: empty range at " << data);
  auto start = reinterpret_cast<uintptr_t>(data);
  EPCOMM_CHECK(start + bytes > start, kInvalidArgument,
               "registerMemory: range [" << data << ", +" << bytes << ") wraps around the address space");
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  uintptr_t first = start & ~(page - 1);
  uintptr_t end = (start + bytes + page - 1) & ~(page - 1);
  std::vector<unsigned char> residency((end - first) / page);
  if (mincore(reinterpret_cast<void*>(first), end - first, residency.data()) != 0) {
    EPCOMM_THROW(kInvalidArgument, "registerMemory: range ["
                                       << data << ", +" << bytes
                                       << ") is not mapped in this process (mincore: " << std::strerror(errno) << ")");
  }
}

void checkRegisterRange(const void* data, size_t bytes, MemoryKind kind) {
  if (kind == MemoryKind::kHost) {
    checkHostRange(data, bytes);
  } else {
    EPCOMM_CHECK(data != nullptr && bytes > 0, kInvalidArgument,
                 "registerMemory: empty or null CUDA range " << data << " +" << bytes);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// MemoryDesc wire format: magic, version, numNics, addr, size, keys[kMaxNics], crc (FNV-1a 32 of the rest).

namespace {
constexpr uint32_t kDescMagic = 0x444d5045;  // "EPMD"
constexpr uint16_t kDescVersion = 1;
constexpr size_t kDescBytes = 4 + 2 + 2 + 8 + 8 + 8 * kMaxNics + 4;

uint32_t descChecksum(const uint8_t* bytes, size_t n) {
  uint64_t h = fnv1a64(bytes, n);
  return static_cast<uint32_t>(h ^ (h >> 32));
}

template <typename T>
void put(std::vector<uint8_t>& out, size_t& pos, T v) {
  std::memcpy(out.data() + pos, &v, sizeof(T));
  pos += sizeof(T);
}
template <typename T>
T get(const uint8_t* in, size_t& pos) {
  T v;
  std::memcpy(&v, in + pos, sizeof(T));
  pos += sizeof(T);
  return v;
}
}  // namespace

std::vector<uint8_t> MemoryDesc::serialize() const {
  std::vector<uint8_t> out(kDescBytes);
  size_t pos = 0;
  put<uint32_t>(out, pos, kDescMagic);
  put<uint16_t>(out, pos, kDescVersion);
  put<uint16_t>(out, pos, static_cast<uint16_t>(numNics));
  put<uint64_t>(out, pos, addr);
  put<uint64_t>(out, pos, size);
  for (int i = 0; i < kMaxNics; ++i) put<uint64_t>(out, pos, keys[i]);
  put<uint32_t>(out, pos, descChecksum(out.data(), pos));
  return out;
}

MemoryDesc MemoryDesc::deserialize(const void* data, size_t bytes) {
  EPCOMM_CHECK(data != nullptr && bytes == kDescBytes, kInvalidArgument,
               "MemoryDesc::deserialize: expected " << kDescBytes << " bytes, got " << bytes);
  const auto* in = static_cast<const uint8_t*>(data);
  size_t pos = 0;
  uint32_t magic = get<uint32_t>(in, pos);
  uint16_t version = get<uint16_t>(in, pos);
  MemoryDesc d;
  d.numNics = get<uint16_t>(in, pos);
  d.addr = get<uint64_t>(in, pos);
  d.size = get<uint64_t>(in, pos);
  for (int i = 0; i < kMaxNics; ++i) d.keys[i] = get<uint64_t>(in, pos);
  uint32_t expected = descChecksum(in, pos);
  d.checksum = get<uint32_t>(in, pos);
  EPCOMM_CHECK(magic == kDescMagic, kInvalidArgument,
               "MemoryDesc::deserialize: bad magic 0x" << std::hex << magic << " (not a MemoryDesc)");
  EPCOMM_CHECK(d.checksum == expected, kInvalidArgument,
               "MemoryDesc::deserialize: checksum mismatch (stored 0x" << std::hex << d.checksum << ", computed 0x"
                                                                       << expected << "): corrupted descriptor");
  EPCOMM_CHECK(version == kDescVersion, kInvalidArgument, "MemoryDesc::deserialize: unsupported version " << version);
  EPCOMM_CHECK(d.numNics >= 1 && d.numNics <= static_cast<uint32_t>(kMaxNics), kInvalidArgument,
               "MemoryDesc::deserialize: numNics " << d.numNics << " outside [1, " << kMaxNics << "]");
  return d;
}

// ---------------------------------------------------------------------------------------------------------------

void OpState::fail(const std::string& message) {
  std::lock_guard<std::mutex> lock(mu);
  if (error.empty()) error = message;
}

std::string OpState::errorText() {
  std::lock_guard<std::mutex> lock(mu);
  return error;
}

EngineBase::EngineBase(const EngineOptions& options) : options_(options) {
  numNics_ = options.numNics;
  EPCOMM_CHECK(numNics_ >= 1 && numNics_ <= kMaxNics, kInvalidArgument,
               "EngineOptions.numNics = " << numNics_ << " outside [1, " << kMaxNics << "]");
  timeoutMs_ = options.timeoutMs > 0 ? options.timeoutMs : env().timeoutMs;
  piecesPerImm_ = options.shardByBytes ? static_cast<uint32_t>(numNics_) : 1u;
  immDirect_.reset(new std::atomic<uint64_t>[kDirectImms]);
  for (uint32_t i = 0; i < kDirectImms; ++i) immDirect_[i].store(0, std::memory_order_relaxed);
}

EngineBase::~EngineBase() { stopProgress(); }

std::shared_ptr<OpState> EngineBase::newOp(PeerId peer, const char* what, Completion done) {
  auto op = std::make_shared<OpState>();
  op->done = std::move(done);
  op->peer = peer;
  op->what = what;
  // An operation fails a margin after the engine's timeout, so a caller waiting with the same bound (on its
  // immediates, its counter) reports its own, more specific timeout first.
  op->deadlineMs = nowMs() + timeoutMs_ + std::max<int64_t>(100, timeoutMs_ / 10);
  return op;
}

void EngineBase::finishOp(const std::shared_ptr<OpState>& op) {
  if (op->reported.exchange(true)) return;
  std::string error = op->errorText();
  if (error.empty()) {
    if (op->done.counter != nullptr) op->done.counter->fetch_add(1, std::memory_order_acq_rel);
  } else {
    recordError(error.find("timed out") != std::string::npos ? ErrorCode::kTimeout : ErrorCode::kFabric, error);
  }
  if (op->done.callback) {
    try {
      op->done.callback(error);
    } catch (const std::exception& e) {
      recordError(ErrorCode::kInternal, std::string("completion callback of ") + op->what + " threw: " + e.what());
    } catch (...) {
      recordError(ErrorCode::kInternal, std::string("completion callback of ") + op->what + " threw");
    }
  }
}

void EngineBase::countImm(uint32_t imm) {
  if (imm < kDirectImms) {
    immDirect_[imm].fetch_add(1, std::memory_order_acq_rel);
  } else {
    std::lock_guard<std::mutex> lock(immMapMu_);
    ++immMap_[imm];
  }
}

uint64_t EngineBase::immCount(uint32_t imm) const {
  uint64_t raw;
  if (imm < kDirectImms) {
    raw = immDirect_[imm].load(std::memory_order_acquire);
  } else {
    std::lock_guard<std::mutex> lock(immMapMu_);
    auto it = immMap_.find(imm);
    raw = it == immMap_.end() ? 0 : it->second;
  }
  return raw / piecesPerImm_;
}

void EngineBase::deliverMessage(uint64_t srcHash, const uint8_t* data, size_t bytes) {
  std::lock_guard<std::mutex> lock(msgMu_);
  messages_[srcHash].emplace_back(data, data + bytes);
}

bool EngineBase::armOp(const std::shared_ptr<OpState>& op, int pieces) {
  op->pending.store(pieces, std::memory_order_release);
  if (pieces > 0) return true;
  finishOp(op);
  return false;
}

std::vector<uint8_t> EngineBase::frameMessage(const void* data, size_t bytes) const {
  std::vector<uint8_t> out(kMsgHeader + bytes);
  const uint32_t len32 = static_cast<uint32_t>(bytes);
  std::memcpy(out.data(), &selfHash_, 8);
  std::memcpy(out.data() + 8, &len32, 4);
  if (bytes > 0) std::memcpy(out.data() + kMsgHeader, data, bytes);
  return out;
}

void EngineBase::deliverFramed(const uint8_t* buf, size_t received) {
  if (received < kMsgHeader) return;
  uint64_t src;
  uint32_t len;
  std::memcpy(&src, buf, 8);
  std::memcpy(&len, buf + 8, 4);
  if (kMsgHeader + len <= received) deliverMessage(src, buf + kMsgHeader, len);
}

void EngineBase::sealDesc(MemoryDesc& desc, const void* data, size_t bytes) const {
  desc.addr = reinterpret_cast<uint64_t>(data);
  desc.size = bytes;
  desc.numNics = static_cast<uint32_t>(numNics_);
  std::vector<uint8_t> wire = desc.serialize();
  std::memcpy(&desc.checksum, wire.data() + wire.size() - 4, 4);
}

void EngineBase::recordError(ErrorCode code, const std::string& message) {
  std::lock_guard<std::mutex> lock(errMu_);
  if (hasError_.load(std::memory_order_relaxed)) return;
  errCode_ = code;
  errMsg_ = message;
  hasError_.store(true, std::memory_order_release);
  EPCOMM_LOG(kWarn, "transfer engine (" << providerName() << "): " << message);
}

void EngineBase::throwRecorded() {
  ErrorCode code;
  std::string msg;
  {
    std::lock_guard<std::mutex> lock(errMu_);
    code = errCode_;
    msg = errMsg_;
  }
  detail::throwError(code, msg, __FILE__, __LINE__);
}

void EngineBase::checkErrors() {
  if (hasError()) throwRecorded();
}

template <typename Done, typename Describe>
void EngineBase::waitUntil(Done done, Describe describe) {
  if (done()) return;
  // While a caller waits it drives progress itself (no thread hand-off on the latency path). The progress thread
  // polls on meanwhile (see progressLoop); whichever of the two holds a completion queue reads it, the other moves on.
  const DriverMark mark(drivers_);
  const int64_t deadline = nowMs() + timeoutMs_;
  uint32_t idle = 0;
  for (uint64_t iter = 1;; ++iter) {
    if (done()) return;
    if (hasError()) throwRecorded();
    if (progressOnce()) {
      idle = 0;
    } else if (++idle > 256) {
      // NOTE: on 2-core CI machines two processes spin at once; yielding keeps ping-pong latency low there.
      sched_yield();
    }
    if ((iter & 255) == 0 && nowMs() > deadline) {
      if (done()) return;
      EPCOMM_THROW(kTimeout, describe() << " after " << timeoutMs_ << " ms (provider " << providerName() << ")");
    }
  }
}

bool EngineBase::driveUntil(const std::function<bool()>& done, int64_t budgetMs) {
  if (done()) return true;
  const DriverMark mark(drivers_);
  const int64_t deadline = nowMs() + budgetMs;
  uint32_t idle = 0;
  for (uint64_t iter = 1;; ++iter) {
    if (done()) return true;
    if (hasError()) throwRecorded();
    if (progressOnce()) {
      idle = 0;
    } else if (++idle > 256) {
      sched_yield();
    }
    if ((iter & 255) == 0 && nowMs() > deadline) return done();
  }
}

void EngineBase::waitImm(uint32_t imm, uint64_t count, const std::string& what) {
  const uint64_t raw = count * piecesPerImm_;
  auto load = [&]() -> uint64_t {
    if (imm < kDirectImms) return immDirect_[imm].load(std::memory_order_acquire);
    std::lock_guard<std::mutex> lock(immMapMu_);
    auto it = immMap_.find(imm);
    return it == immMap_.end() ? 0 : it->second;
  };
  // Take the count atomically so two threads waiting on one value cannot both consume the same arrivals.
  auto take = [&]() -> bool {
    if (imm < kDirectImms) {
      uint64_t cur = immDirect_[imm].load(std::memory_order_acquire);
      while (cur >= raw) {
        if (immDirect_[imm].compare_exchange_weak(cur, cur - raw, std::memory_order_acq_rel)) return true;
      }
      return false;
    }
    std::lock_guard<std::mutex> lock(immMapMu_);
    auto it = immMap_.find(imm);
    if (it == immMap_.end() || it->second < raw) return false;
    it->second -= raw;
    // Every AllToAll object tags its immediates with its own id: a value all of whose arrivals were taken is dropped,
    // so that an engine that outlives many objects does not keep one entry per value each of them used.
    if (it->second == 0) immMap_.erase(it);
    return true;
  };
  waitUntil(take, [&]() -> std::string {
    std::ostringstream oss;
    oss << "waitImm(" << what << "): immediate " << imm << " arrived " << load() / piecesPerImm_ << " of " << count
        << " times";
    return oss.str();
  });
}

void EngineBase::waitCounter(const std::atomic<uint64_t>& counter, uint64_t target, const std::string& what) {
  waitUntil([&] { return counter.load(std::memory_order_acquire) >= target; },
            [&]() -> std::string {
              std::ostringstream oss;
              oss << "waitCounter(" << what << "): " << counter.load() << " of " << target << " completions";
              return oss.str();
            });
}

size_t EngineBase::recv(PeerId peer, void* data, size_t capacity) {
  EPCOMM_CHECK(peer < numPeers(), kInvalidArgument, "recv: unknown peer " << peer);
  const uint64_t hash = peerHash(peer);
  std::vector<uint8_t> msg;
  bool got = false;
  auto take = [&] {
    std::lock_guard<std::mutex> lock(msgMu_);
    auto it = messages_.find(hash);
    if (it == messages_.end() || it->second.empty()) return false;
    msg = std::move(it->second.front());
    it->second.pop_front();
    got = true;
    return true;
  };
  waitUntil(take, [&]() -> std::string {
    std::ostringstream oss;
    oss << "recv: no control message from peer " << peer;
    return oss.str();
  });
  EPCOMM_CHECK(got, kInternal, "recv: wait returned without a message");
  EPCOMM_CHECK(msg.size() <= capacity, kInvalidArgument,
               "recv: message of " << msg.size() << " bytes from peer " << peer << " exceeds capacity " << capacity);
  if (!msg.empty()) std::memcpy(data, msg.data(), msg.size());
  return msg.size();
}

// ---------------------------------------------------------------------------------------------------------------
// Planning.

std::vector<EngineBase::NicPlan> EngineBase::planChunks(PeerId peer, std::vector<Chunk> chunks, bool withImm,
                                                        bool splitBytes) const {
  std::vector<NicPlan> plan(numNics_);
  if (numNics_ == 1 || !options_.shardByBytes) {
    // Sharding by peer: the receiver counts one immediate per operation.
    NicPlan& p = plan[peer % numNics_];
    p.chunks = std::move(chunks);
    p.imm = withImm;
    return plan;
  }
  // Sharding by bytes: every NIC carries its share and its own immediate, so the receiver sees exactly numNics
  // immediates per operation whatever the size (zero-byte immediates on NICs without data) and in any order;
  // immCount divides by numNics. Each piece's data is visible before its own immediate, so no cross-NIC
  // ordering is needed.
  if (splitBytes && chunks.size() == 1) {
    const Chunk c = chunks[0];
    for (int n = 0; n < numNics_; ++n) {
      uint64_t begin = c.length * n / numNics_;
      uint64_t end = c.length * (n + 1) / numNics_;
      if (end > begin) plan[n].chunks.push_back({c.srcOffset + begin, c.dstOffset + begin, end - begin});
    }
  } else {
    for (size_t i = 0; i < chunks.size(); ++i) plan[i % numNics_].chunks.push_back(chunks[i]);
  }
  for (NicPlan& p : plan) p.imm = withImm;
  return plan;
}

void EngineBase::checkTargetRange(const Target& t, const MemoryRegion* src, const std::vector<Chunk>& chunks) const {
  for (const Chunk& c : chunks) {
    EPCOMM_CHECK(c.dstOffset <= t.size && c.length <= t.size - c.dstOffset, kInvalidArgument,
                 "transfer to peer " << t.peer << ": destination [" << c.dstOffset << ", +" << c.length
                                     << ") outside the remote region of " << t.size << " bytes");
    if (c.length == 0) continue;
    EPCOMM_CHECK(src != nullptr, kInvalidArgument, "transfer to peer " << t.peer << ": no source region");
    EPCOMM_CHECK(c.srcOffset <= src->size() && c.length <= src->size() - c.srcOffset, kInvalidArgument,
                 "transfer to peer " << t.peer << ": source [" << c.srcOffset << ", +" << c.length
                                     << ") outside the local region of " << src->size() << " bytes");
  }
}

void EngineBase::write(PeerId peer, const MemoryRegion& src, uint64_t srcOffset, const MemoryDesc& dst,
                       uint64_t dstOffset, uint64_t length, bool withImm, uint32_t imm, Completion done) {
  Target t = makeTarget(peer, dst);
  std::vector<Chunk> chunks;
  if (length > 0) chunks.push_back({srcOffset, dstOffset, length});
  checkTargetRange(t, &src, chunks);
  auto plan = planChunks(peer, std::move(chunks), withImm, true);
  postPlan(t, &src, plan, imm, newOp(peer, withImm ? "write-with-immediate" : "write", std::move(done)));
}

void EngineBase::immediate(PeerId peer, uint32_t imm, Completion done) {
  EPCOMM_CHECK(peer < numPeers(), kInvalidArgument, "immediate: unknown peer " << peer);
  Target t;
  t.peer = peer;
  auto plan = planChunks(peer, {}, true, true);
  postPlan(t, nullptr, plan, imm, newOp(peer, "immediate", std::move(done)));
}

GroupId EngineBase::createGroup(const std::vector<PeerId>& members, const std::vector<MemoryDesc>& dsts) {
  EPCOMM_CHECK(members.size() == dsts.size(), kInvalidArgument,
               "createGroup: " << members.size() << " members but " << dsts.size() << " descriptors");
  auto g = std::make_shared<Group>();
  for (size_t i = 0; i < members.size(); ++i) {
    if (dsts[i].numNics == 0) {
      // A barrier-only group needs no region.
      EPCOMM_CHECK(members[i] < numPeers(), kInvalidArgument, "createGroup: unknown peer " << members[i]);
      Target t;
      t.peer = members[i];
      g->targets.push_back(t);
    } else {
      g->targets.push_back(makeTarget(members[i], dsts[i]));
    }
  }
  std::lock_guard<std::mutex> lock(groupMu_);
  if (!freeGroups_.empty()) {
    const GroupId id = freeGroups_.back();
    freeGroups_.pop_back();
    groups_[id] = std::move(g);
    return id;
  }
  groups_.push_back(std::move(g));
  return static_cast<GroupId>(groups_.size() - 1);
}

void EngineBase::destroyGroup(GroupId group) {
  std::lock_guard<std::mutex> lock(groupMu_);
  EPCOMM_CHECK(group < groups_.size() && groups_[group], kInvalidArgument, "destroyGroup: unknown group " << group);
  groups_[group].reset();  // operations in flight hold their own reference
  freeGroups_.push_back(group);
}

namespace {
// Fires the user's completion once after `members` member completions; the first error wins.
struct Aggregate {
  Completion done;
  std::atomic<int> left{0};
  std::mutex mu;
  std::string error;
};
Completion memberCompletion(const std::shared_ptr<Aggregate>& agg) {
  Completion c;
  c.callback = [agg](const std::string& error) {
    if (!error.empty()) {
      std::lock_guard<std::mutex> lock(agg->mu);
      if (agg->error.empty()) agg->error = error;
    }
    if (agg->left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    std::string err;
    {
      std::lock_guard<std::mutex> lock(agg->mu);
      err = agg->error;
    }
    if (err.empty() && agg->done.counter != nullptr) agg->done.counter->fetch_add(1, std::memory_order_acq_rel);
    if (agg->done.callback) agg->done.callback(err);
  };
  return c;
}
}  // namespace

void EngineBase::scatter(GroupId group, const MemoryRegion& src, const std::vector<std::vector<ScatterSlice>>& slices,
                         bool withImm, uint32_t imm, Completion done) {
  std::shared_ptr<Group> g;
  {
    std::lock_guard<std::mutex> lock(groupMu_);
    EPCOMM_CHECK(group < groups_.size() && groups_[group], kInvalidArgument, "scatter: unknown group " << group);
    g = groups_[group];
  }
  EPCOMM_CHECK(slices.size() == g->targets.size(), kInvalidArgument,
               "scatter: " << slices.size() << " slice lists for a group of " << g->targets.size());
  // Validate everything before posting anything, so a bad slice never leaves a half-sent scatter.
  std::vector<std::vector<Chunk>> chunks(slices.size());
  for (size_t m = 0; m < slices.size(); ++m) {
    for (const ScatterSlice& s : slices[m]) {
      if (s.length > 0) chunks[m].push_back({s.srcOffset, s.dstOffset, s.length});
    }
    checkTargetRange(g->targets[m], &src, chunks[m]);
  }
  auto agg = std::make_shared<Aggregate>();
  agg->done = std::move(done);
  agg->left.store(static_cast<int>(slices.size()));
  if (slices.empty()) {
    agg->left.store(1);
    memberCompletion(agg).callback("");
    return;
  }
  for (size_t m = 0; m < slices.size(); ++m) {
    const Target& t = g->targets[m];
    const bool single = chunks[m].size() == 1;
    auto plan = planChunks(t.peer, std::move(chunks[m]), withImm, single);
    postPlan(t, &src, plan, imm, newOp(t.peer, "scatter", memberCompletion(agg)));
  }
}

void EngineBase::barrier(GroupId group, uint32_t imm, Completion done) {
  std::shared_ptr<Group> g;
  {
    std::lock_guard<std::mutex> lock(groupMu_);
    EPCOMM_CHECK(group < groups_.size() && groups_[group], kInvalidArgument, "barrier: unknown group " << group);
    g = groups_[group];
  }
  auto agg = std::make_shared<Aggregate>();
  agg->done = std::move(done);
  agg->left.store(static_cast<int>(g->targets.size()));
  if (g->targets.empty()) {
    agg->left.store(1);
    memberCompletion(agg).callback("");
    return;
  }
  for (const Target& t : g->targets) {
    auto plan = planChunks(t.peer, {}, true, true);
    postPlan(t, nullptr, plan, imm, newOp(t.peer, "barrier", memberCompletion(agg)));
  }
}

void EngineBase::pagedWrite(PeerId peer, const MemoryRegion& src, uint64_t srcOffset, uint64_t srcStride,
                            const std::vector<uint32_t>& srcPages, const MemoryDesc& dst, uint64_t dstOffset,
                            uint64_t dstStride, const std::vector<uint32_t>& dstPages, uint64_t pageBytes, bool withImm,
                            uint32_t imm, Completion done) {
  EPCOMM_CHECK(srcPages.size() == dstPages.size(), kInvalidArgument,
               "pagedWrite: " << srcPages.size() << " source pages but " << dstPages.size() << " destination pages");
  Target t = makeTarget(peer, dst);
  std::vector<Chunk> chunks;
  chunks.reserve(srcPages.size());
  if (pageBytes > 0) {
    for (size_t i = 0; i < srcPages.size(); ++i) {
      Chunk c{srcOffset + srcPages[i] * srcStride, dstOffset + dstPages[i] * dstStride, pageBytes};
      // Adjacent pages on both sides become one write: fewer work requests for contiguous runs.
      if (!chunks.empty() && chunks.back().srcOffset + chunks.back().length == c.srcOffset &&
          chunks.back().dstOffset + chunks.back().length == c.dstOffset) {
        chunks.back().length += pageBytes;
      } else {
        chunks.push_back(c);
      }
    }
  }
  checkTargetRange(t, &src, chunks);
  auto plan = planChunks(peer, std::move(chunks), withImm, false);
  postPlan(t, &src, plan, imm, newOp(peer, "paged write", std::move(done)));
}

// ---------------------------------------------------------------------------------------------------------------
// Progress thread.

void EngineBase::startProgress() {
  std::vector<uint8_t> addr = address();
  selfHash_ = fnv1a64(addr.data(), addr.size());
  progress_ = std::thread([this] { progressLoop(); });
  if (options_.progressCpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(options_.progressCpu, &set);
    int rc = pthread_setaffinity_np(progress_.native_handle(), sizeof(set), &set);
    if (rc != 0) {
      EPCOMM_LOG(kWarn, "could not pin the fabric progress thread to core " << options_.progressCpu << ": "
                                                                            << std::strerror(rc));
    }
  }
}

void EngineBase::stopProgress() {
  stop_.store(true, std::memory_order_release);
  if (progress_.joinable()) progress_.join();
}

void EngineBase::progressLoop() {
  uint32_t idle = 0;
  while (!stop_.load(std::memory_order_acquire)) {
    try {
      // NOTE: it polls while a caller waits too (that caller polls as well). Stepping back (a 200 us sleep whenever
      // a caller waits) leaves arrivals unread after that caller's wait ends: over shm the receiver's progress call
      // makes the copy of a large write, so a peer's rows that come while this rank's proxy thread is between two
      // waits are copied late. Measured (one H200, proxy backend over shm, two ranks under MPS, decode T = 128, three
      // runs of each alternating): dispatch + combine 1,857-1,977 us (median 1,954) against 1,897-2,091 us (median
      // 2,073) with the step back. With cores to spare a caller driving progress also counts as activity (its wait
      // may hold the completion queue for a whole copy), so the 50 us sleeps below begin only once no caller waits;
      // on a small machine they begin after the idle polls as before (more polling there slowed the host backend).
      const bool worked = progressOnce();
      if (worked || (coresToSpare() && drivers_.load(std::memory_order_relaxed) > 0)) idle = 0;
      if (worked) continue;
      if (++idle < 2000) {
        sched_yield();
      } else {
        // NOTE: nobody waits and nothing moved for a while: poll at 20 kHz instead of burning a core.
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    } catch (const Error& e) {
      recordError(e.code(), e.message());
    } catch (const std::exception& e) {
      recordError(ErrorCode::kInternal, std::string("progress thread: ") + e.what());
    } catch (...) {
      recordError(ErrorCode::kInternal, "progress thread: unknown exception");
    }
  }
}

}  // namespace fabric
}  // namespace epcomm
