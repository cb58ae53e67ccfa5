// TransferEngine between 2 to 4 real processes over libfabric's tcp and shm providers: every operation, data
// verified byte for byte, immediate accounting, multi-NIC sharding, failures (dead peer, bad descriptor, bad range).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "epcomm/bootstrap.hpp"
#include "epcomm/error.hpp"
#include "epcomm/fabric/transfer_engine.hpp"
#include "support/multiprocess.hpp"

namespace epcomm {
namespace fabric {
namespace {

// The ranks are real processes forked by tests/support/multiprocess.hpp, joined by the TCP bootstrap; this adapter
// adds variable-size blobs (engine addresses differ in length between processes on shm) and named barriers.
namespace fg {
class Comm {
 public:
  explicit Comm(Bootstrap& b) : b_(b) {}
  int rank() const { return b_.rank(); }
  int world() const { return b_.worldSize(); }
  void barrier(const char* = "barrier") { b_.barrier(); }
  std::vector<std::vector<uint8_t>> allGather(const std::vector<uint8_t>& mine) {
    uint64_t len = mine.size();
    std::vector<uint64_t> lens(world());
    b_.allGather(&len, lens.data(), sizeof(len));
    const uint64_t maxLen = std::max<uint64_t>(1, *std::max_element(lens.begin(), lens.end()));
    std::vector<uint8_t> padded(maxLen, 0), all(maxLen * world());
    std::copy(mine.begin(), mine.end(), padded.begin());
    b_.allGather(padded.data(), all.data(), maxLen);
    std::vector<std::vector<uint8_t>> out(world());
    for (int r = 0; r < world(); ++r) out[r].assign(all.begin() + r * maxLen, all.begin() + r * maxLen + lens[r]);
    return out;
  }

 private:
  Bootstrap& b_;
};

std::vector<test::RankOutcome> run(int world, const std::function<void(Comm&)>& body) {
  test::RunOptions opts;
  opts.deadlineMs = 150000;
  test::RunResult res = test::runRanks(
      world,
      [&](int, Bootstrap& b) {
        Comm comm(b);
        body(comm);
      },
      opts);
  return res.ranks;
}
}  // namespace fg

// Assertion inside a forked rank: throws, and the harness reports the message with the rank.
#define FCHECK(cond, msg)                                                                 \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::ostringstream fcheck_oss_;                                                     \
      fcheck_oss_ << __FILE__ << ":" << __LINE__ << ": check failed: " #cond ": " << msg; \
      throw std::runtime_error(fcheck_oss_.str());                                        \
    }                                                                                     \
  } while (0)

uint8_t pattern(int rank, uint64_t i) { return static_cast<uint8_t>((i * 131u) ^ (i >> 11) ^ (rank * 71u + 5u)); }

void fill(uint8_t* p, uint64_t n, int rank) {
  for (uint64_t i = 0; i < n; ++i) p[i] = pattern(rank, i);
}

// Reports every rank's failure (a killed rank in `mayDie` is expected).
void expectRanks(const std::vector<test::RankOutcome>& results, std::vector<int> mayDie = {}) {
  for (const test::RankOutcome& r : results) {
    bool allowed = std::find(mayDie.begin(), mayDie.end(), r.rank) != mayDie.end();
    if (allowed && !r.exited && r.signal == SIGKILL) continue;
    EXPECT_TRUE(r.ok()) << r.describe();
  }
}

/// One rank's engine connected to every other rank (peer ids in rank order, self excluded).
struct Node {
  std::unique_ptr<TransferEngine> engine;
  std::vector<PeerId> peerOf;  // rank -> PeerId (self: unused)
  std::unique_ptr<MemoryRegion> buf;
  std::vector<MemoryDesc> descOf;  // rank -> that rank's buffer descriptor

  Node(fg::Comm& comm, const EngineOptions& opts, size_t bytes, uint8_t init = 0xEE) {
    engine = TransferEngine::create(opts);
    auto addrs = comm.allGather(engine->address());
    peerOf.assign(comm.world(), 0);
    for (int r = 0; r < comm.world(); ++r) {
      if (r != comm.rank()) peerOf[r] = engine->addPeer(addrs[r]);
    }
    if (bytes > 0) {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      FCHECK(p != MAP_FAILED, "mmap of " << bytes);
      std::memset(p, init, bytes);
      buf = engine->registerMemory(p, bytes);
      auto descs = comm.allGather(buf->desc().serialize());
      for (auto& d : descs) descOf.push_back(MemoryDesc::deserialize(d.data(), d.size()));
    }
  }
  uint8_t* data() { return static_cast<uint8_t*>(buf->data()); }
};

EngineOptions optionsFor(const std::string& provider, int64_t timeoutMs = 30000) {
  EngineOptions o;
  o.provider = provider;
  o.timeoutMs = timeoutMs;
  return o;
}

class FabricTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::string provider() const { return GetParam(); }
};

// ---------------------------------------------------------------------------------------------------------------

// Each rank sends from its source half to the next rank's destination half; sizes 0 B .. 64 MiB, with an
// immediate riding on the write (even sizes) or a write, completion wait, then a separate immediate (odd).
void writeEverySize(fg::Comm& comm, const EngineOptions& opts) {
  const uint64_t kMax = 64ull << 20;
  const uint64_t kHalf = kMax + 4096;
  Node node(comm, opts, 2 * kHalf);
  fill(node.data(), kHalf, comm.rank());  // source half: [0, kHalf)
  comm.barrier();
  const int to = (comm.rank() + 1) % comm.world();
  const int from = (comm.rank() + comm.world() - 1) % comm.world();
  const std::vector<uint64_t> sizes = {0, 1, 3, 8, 63, 64, 65, 4095, 4096, 4097, 65536, 65537, (1 << 20) + 7, kMax};
  std::atomic<uint64_t> done{0};
  for (size_t i = 0; i < sizes.size(); ++i) {
    const uint64_t size = sizes[i];
    const uint64_t srcOff = size == kMax ? 0 : 5 + i;
    const uint64_t dstOff = size == kMax ? 0 : 11 + 3 * i;
    const uint32_t imm = 100 + static_cast<uint32_t>(i);
    Completion c;
    c.counter = &done;
    if (i % 2 == 0) {
      node.engine->write(node.peerOf[to], *node.buf, srcOff, node.descOf[to], kHalf + dstOff, size, true, imm, c);
      node.engine->waitCounter(done, i + 1, "write " + std::to_string(size));
    } else {
      node.engine->write(node.peerOf[to], *node.buf, srcOff, node.descOf[to], kHalf + dstOff, size, false, 0, c);
      node.engine->waitCounter(done, i + 1, "write " + std::to_string(size));
      node.engine->immediate(node.peerOf[to], imm, {});
    }
    node.engine->waitImm(imm, 1, "size " + std::to_string(size) + " from rank " + std::to_string(from));
    const uint8_t* dst = node.data() + kHalf + dstOff;
    for (uint64_t j = 0; j < size; ++j) {
      FCHECK(dst[j] == pattern(from, srcOff + j), "size " << size << ": byte " << j << " is " << int(dst[j])
                                                          << ", expected " << int(pattern(from, srcOff + j)));
    }
    FCHECK(dst[size] == 0xEE, "size " << size << ": byte after the write was overwritten");
    if (dstOff > 0) FCHECK(dst[-1] == 0xEE, "size " << size << ": byte before the write was overwritten");
    std::memset(node.data() + kHalf + dstOff, 0xEE, size);
    comm.barrier();  // the next size reuses the destination
  }
  FCHECK(node.engine->immCount(100) == 0, "immediate 100 counted twice");
  node.engine->checkErrors();
  comm.barrier("end");
}

TEST_P(FabricTest, WriteEverySizeTwoProcesses) {
  const std::string prov = provider();
  expectRanks(fg::run(2, [&](fg::Comm& comm) { writeEverySize(comm, optionsFor(prov)); }));
}

TEST_P(FabricTest, ImmediateCountingManyInFlight) {
  const std::string prov = provider();
  expectRanks(fg::run(3, [&](fg::Comm& comm) {
    Node node(comm, optionsFor(prov), 64 * 1024);
    fill(node.data(), 4096, comm.rank());
    comm.barrier();
    const int kOps = 400;
    const int kValues = 5;
    std::atomic<uint64_t> done{0};
    uint64_t posted = 0;
    // Everything is posted before anyone waits: arrivals precede waits and interleave across values and peers.
    for (int k = 0; k < kOps; ++k) {
      for (int r = 0; r < comm.world(); ++r) {
        if (r == comm.rank()) continue;
        const uint32_t imm = 1000 + k % kValues;
        Completion c;
        c.counter = &done;
        if (k % 2 == 0) {
          uint64_t dstOff = 4096 * (1 + comm.rank()) + (k % 64) * 8;
          node.engine->write(node.peerOf[r], *node.buf, 0, node.descOf[r], dstOff, 8 + k % 200, true, imm, c);
        } else {
          node.engine->immediate(node.peerOf[r], imm, c);
        }
        ++posted;
      }
    }
    for (int v = 0; v < kValues; ++v) {
      uint64_t expect = (kOps / kValues) * (comm.world() - 1);
      node.engine->waitImm(1000 + v, expect, "value " + std::to_string(v));
    }
    node.engine->waitCounter(done, posted, "issued operations");
    comm.barrier();
    for (int v = 0; v < kValues; ++v) {
      FCHECK(node.engine->immCount(1000 + v) == 0,
             "value " << v << " counted " << node.engine->immCount(1000 + v) << " extra times");
    }
    // A large immediate value takes the map path.
    node.engine->immediate(node.peerOf[(comm.rank() + 1) % comm.world()], 0x80000001u, {});
    node.engine->waitImm(0x80000001u, 1, "large immediate value");
    comm.barrier("end");
  }));
}

TEST_P(FabricTest, ScatterToThreePeers) {
  const std::string prov = provider();
  expectRanks(fg::run(4, [&](fg::Comm& comm) {
    const uint64_t kBytes = 4 << 20;
    Node node(comm, optionsFor(prov), kBytes);
    fill(node.data(), kBytes, comm.rank());
    comm.barrier();
    // Member m (rank m+1) gets three slices of rank 0's buffer at scattered offsets of its own.
    auto slicesFor = [&](int m) {
      std::vector<ScatterSlice> s;
      s.push_back({uint64_t(1000 * m), 17, uint64_t(1 + 100 * m)});
      s.push_back({uint64_t(65536 * (m + 1)), 4096, uint64_t(65536 + m)});
      s.push_back({uint64_t(1 << 20), uint64_t(2 << 20), uint64_t((1 << 20) + 3 * m)});
      return s;
    };
    if (comm.rank() == 0) {
      std::vector<PeerId> members = {node.peerOf[1], node.peerOf[2], node.peerOf[3]};
      std::vector<MemoryDesc> dsts = {node.descOf[1], node.descOf[2], node.descOf[3]};
      GroupId g = node.engine->createGroup(members, dsts);
      std::atomic<uint64_t> done{0};
      std::atomic<int> callbacks{0};
      Completion c;
      c.counter = &done;
      c.callback = [&](const std::string& err) {
        if (err.empty()) callbacks.fetch_add(1);
      };
      node.engine->scatter(g, *node.buf, {slicesFor(0), slicesFor(1), slicesFor(2)}, true, 7, c);
      node.engine->waitCounter(done, 1, "scatter");
      // Second round: member 1 gets no data, only the immediate.
      node.engine->scatter(g, *node.buf, {slicesFor(0), {}, slicesFor(2)}, true, 8, c);
      node.engine->waitCounter(done, 2, "scatter with an empty member");
      FCHECK(callbacks.load() == 2, "scatter callback fired " << callbacks.load() << " times, expected 2");
    } else {
      node.engine->waitImm(7, 1, "scatter from rank 0");
      for (const ScatterSlice& s : slicesFor(comm.rank() - 1)) {
        for (uint64_t j = 0; j < s.length; ++j) {
          FCHECK(node.data()[s.dstOffset + j] == pattern(0, s.srcOffset + j),
                 "slice at " << s.dstOffset << " byte " << j);
        }
      }
      FCHECK(node.data()[16] == pattern(comm.rank(), 16), "byte before the first slice changed");
      node.engine->waitImm(8, 1, "second scatter from rank 0");
    }
    comm.barrier("end");
  }));
}

TEST_P(FabricTest, BarrierRounds) {
  const std::string prov = provider();
  expectRanks(fg::run(4, [&](fg::Comm& comm) {
    Node node(comm, optionsFor(prov), 4096, 0);
    std::vector<PeerId> members;
    for (int r = 0; r < comm.world(); ++r) {
      if (r != comm.rank()) members.push_back(node.peerOf[r]);
    }
    GroupId g = node.engine->createGroup(members, std::vector<MemoryDesc>(members.size()));
    std::vector<uint8_t> src(8);
    auto srcRegion = node.engine->registerMemory(src.data(), src.size());
    std::atomic<uint64_t> done{0};
    uint64_t posted = 0;
    for (uint32_t round = 1; round <= 30; ++round) {
      // Publish the round number into every peer's slot for this rank, wait until written, then barrier.
      std::memset(src.data(), static_cast<int>(round), src.size());
      for (int r = 0; r < comm.world(); ++r) {
        if (r == comm.rank()) continue;
        Completion c;
        c.counter = &done;
        node.engine->write(node.peerOf[r], *srcRegion, 0, node.descOf[r], 8 * comm.rank(), 8, false, 0, c);
        ++posted;
      }
      node.engine->waitCounter(done, posted, "round writes");
      node.engine->barrier(g, 5, {});
      node.engine->waitImm(5, comm.world() - 1, "barrier round " + std::to_string(round));
      for (int r = 0; r < comm.world(); ++r) {
        if (r == comm.rank()) continue;
        FCHECK(node.data()[8 * r] == round,
               "round " << round << ": rank " << r << " slot holds " << int(node.data()[8 * r]));
      }
      // A second barrier keeps a fast rank from overwriting the slots of this round before everyone checked.
      node.engine->barrier(g, 6, {});
      node.engine->waitImm(6, comm.world() - 1, "barrier round " + std::to_string(round) + " (leave)");
    }
    // A destroyed group is unknown (a clear error, nothing posted) and its id goes to the next group.
    node.engine->destroyGroup(g);
    std::string error;
    try {
      node.engine->barrier(g, 7, {});
    } catch (const Error& e) {
      error = e.message();
      FCHECK(e.code() == ErrorCode::kInvalidArgument, "code " << errorCodeName(e.code()));
    }
    FCHECK(error.find("unknown group") != std::string::npos, "barrier on a destroyed group: '" << error << "'");
    FCHECK(node.engine->createGroup(members, std::vector<MemoryDesc>(members.size())) == g, "the id was not reused");
    comm.barrier("end");
  }));
}

TEST_P(FabricTest, PagedWrite) {
  const std::string prov = provider();
  expectRanks(fg::run(2, [&](fg::Comm& comm) {
    const uint64_t kBytes = 1 << 20;
    Node node(comm, optionsFor(prov), kBytes);
    fill(node.data(), kBytes / 2, comm.rank());
    comm.barrier();
    const int peer = 1 - comm.rank();
    const uint64_t dstBase = kBytes / 2;
    struct Case {
      uint64_t pageBytes, srcStride, dstStride;
      std::vector<uint32_t> src, dst;
    };
    std::vector<Case> cases = {
        {1000, 1024, 2048, {3, 1, 4, 5, 9, 2, 6}, {0, 2, 4, 5, 6, 10, 11}},
        {4096, 4096, 4096, {0, 1, 2, 7, 8, 30}, {40, 41, 42, 43, 50, 51}},  // contiguous runs merge
        {1, 3, 5, {0, 1, 2}, {7, 6, 5}},
    };
    for (size_t k = 0; k < cases.size(); ++k) {
      const Case& c = cases[k];
      std::atomic<uint64_t> done{0};
      Completion comp;
      comp.counter = &done;
      node.engine->pagedWrite(node.peerOf[peer], *node.buf, 128, c.srcStride, c.src, node.descOf[peer], dstBase,
                              c.dstStride, c.dst, c.pageBytes, true, 20 + static_cast<uint32_t>(k), comp);
      node.engine->waitImm(20 + static_cast<uint32_t>(k), 1, "paged write case " + std::to_string(k));
      node.engine->waitCounter(done, 1, "paged write");
      for (size_t i = 0; i < c.src.size(); ++i) {
        for (uint64_t j = 0; j < c.pageBytes; ++j) {
          uint64_t s = 128 + c.src[i] * c.srcStride + j;
          uint64_t d = dstBase + c.dst[i] * c.dstStride + j;
          FCHECK(node.data()[d] == pattern(peer, s), "case " << k << " page " << i << " byte " << j);
        }
      }
      comm.barrier();
      std::memset(node.data() + dstBase, 0xEE, kBytes / 2);
      comm.barrier();
    }
    comm.barrier("end");
  }));
}

TEST_P(FabricTest, SendRecvControlMessages) {
  const std::string prov = provider();
  expectRanks(fg::run(3, [&](fg::Comm& comm) {
    Node node(comm, optionsFor(prov), 0);
    const std::vector<size_t> sizes = {0, 1, 100, 1000, 4096};
    for (int r = 0; r < comm.world(); ++r) {
      if (r == comm.rank()) continue;
      for (size_t k = 0; k < sizes.size(); ++k) {
        std::vector<uint8_t> msg(sizes[k]);
        for (size_t j = 0; j < msg.size(); ++j) msg[j] = static_cast<uint8_t>(comm.rank() * 31 + k * 7 + j);
        node.engine->send(node.peerOf[r], msg.data(), msg.size(), {});
      }
    }
    for (int r = 0; r < comm.world(); ++r) {
      if (r == comm.rank()) continue;
      for (size_t k = 0; k < sizes.size(); ++k) {
        std::vector<uint8_t> got(4096);
        size_t n = node.engine->recv(node.peerOf[r], got.data(), got.size());
        FCHECK(n == sizes[k], "message " << k << " from rank " << r << " has " << n << " bytes");
        for (size_t j = 0; j < n; ++j) FCHECK(got[j] == static_cast<uint8_t>(r * 31 + k * 7 + j), "byte " << j);
      }
    }
    bool threw = false;
    try {
      std::vector<uint8_t> big(8192);
      node.engine->send(node.peerOf[(comm.rank() + 1) % 3], big.data(), big.size(), {});
    } catch (const Error& e) {
      threw = e.code() == ErrorCode::kInvalidArgument;
    }
    FCHECK(threw, "an 8 KiB control message was accepted");
    comm.barrier("end");
  }));
}

// Two endpoints of one provider stand in for two NICs.
void twoNics(fg::Comm& comm, const std::string& prov, bool byBytes) {
  EngineOptions o = optionsFor(prov);
  o.numNics = 2;
  o.shardByBytes = byBytes;
  const uint64_t kBytes = 16 << 20;
  Node node(comm, o, 2 * kBytes);
  FCHECK(node.engine->numNics() == 2, "engine drives " << node.engine->numNics() << " NICs");
  FCHECK(node.buf->desc().numNics == 2, "descriptor has " << node.buf->desc().numNics << " keys");
  fill(node.data(), kBytes, comm.rank());
  comm.barrier();
  const std::vector<uint64_t> sizes = {0, 1, 4097, (1 << 20) + 1, kBytes};
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::atomic<uint64_t> done{0};
    for (int r = 0; r < comm.world(); ++r) {
      if (r == comm.rank()) continue;
      Completion c;
      c.counter = &done;
      // Each sender writes to its own slice of the receiver so that several senders do not overlap.
      uint64_t size = std::min<uint64_t>(sizes[i], kBytes / comm.world());
      node.engine->write(node.peerOf[r], *node.buf, 0, node.descOf[r], kBytes + comm.rank() * (kBytes / comm.world()),
                         size, true, 300 + static_cast<uint32_t>(i), c);
      node.engine->immediate(node.peerOf[r], 400, c);
    }
    node.engine->waitImm(300 + static_cast<uint32_t>(i), comm.world() - 1, "sharded write");
    node.engine->waitImm(400, comm.world() - 1, "sharded immediate");
    node.engine->waitCounter(done, 2 * (comm.world() - 1), "sharded writes");
    uint64_t size = std::min<uint64_t>(sizes[i], kBytes / comm.world());
    for (int r = 0; r < comm.world(); ++r) {
      if (r == comm.rank()) continue;
      const uint8_t* d = node.data() + kBytes + r * (kBytes / comm.world());
      for (uint64_t j = 0; j < size; ++j)
        FCHECK(d[j] == pattern(r, j), "size " << size << " from " << r << " byte " << j);
    }
    FCHECK(node.engine->immCount(400) == 0, "immediate 400 over-counted");
    comm.barrier();
    std::memset(node.data() + kBytes, 0xEE, kBytes);
    comm.barrier();
  }
  // Groups and paged writes follow the same sharding.
  if (comm.rank() == 0) {
    std::vector<PeerId> members;
    std::vector<MemoryDesc> dsts;
    std::vector<std::vector<ScatterSlice>> slices;
    for (int r = 1; r < comm.world(); ++r) {
      members.push_back(node.peerOf[r]);
      dsts.push_back(node.descOf[r]);
      slices.push_back({{0, kBytes, 3000}, {5000, kBytes + 8192, 70000}});
    }
    GroupId g = node.engine->createGroup(members, dsts);
    std::atomic<uint64_t> done{0};
    Completion c;
    c.counter = &done;
    node.engine->scatter(g, *node.buf, slices, true, 500, c);
    node.engine->barrier(g, 501, c);
    node.engine->pagedWrite(node.peerOf[1], *node.buf, 0, 4096, {1, 3, 5, 7}, node.descOf[1], kBytes + (1 << 20), 4096,
                            {0, 1, 2, 3}, 4096, true, 502, c);
    node.engine->waitCounter(done, 3, "sharded group operations");
  } else {
    node.engine->waitImm(500, 1, "sharded scatter");
    node.engine->waitImm(501, 1, "sharded barrier");
    for (uint64_t j = 0; j < 3000; ++j) FCHECK(node.data()[kBytes + j] == pattern(0, j), "scatter byte " << j);
    for (uint64_t j = 0; j < 70000; ++j) FCHECK(node.data()[kBytes + 8192 + j] == pattern(0, 5000 + j), "byte " << j);
    if (comm.rank() == 1) {
      node.engine->waitImm(502, 1, "sharded paged write");
      for (uint64_t p = 0; p < 4; ++p) {
        for (uint64_t j = 0; j < 4096; ++j) {
          FCHECK(node.data()[kBytes + (1 << 20) + p * 4096 + j] == pattern(0, (2 * p + 1) * 4096 + j), "page " << p);
        }
      }
    }
  }
  node.engine->checkErrors();
  comm.barrier("end");
}

TEST_P(FabricTest, TwoNicsShardByPeer) {
  const std::string prov = provider();
  expectRanks(fg::run(3, [&](fg::Comm& comm) { twoNics(comm, prov, false); }));
}

TEST_P(FabricTest, TwoNicsShardByBytes) {
  const std::string prov = provider();
  expectRanks(fg::run(3, [&](fg::Comm& comm) { twoNics(comm, prov, true); }));
}

TEST_P(FabricTest, PeerKilledMidTransfer) {
  const std::string prov = provider();
  auto results = fg::run(2, [&](fg::Comm& comm) {
    Node node(comm, optionsFor(prov, 3000), 8 << 20);
    comm.barrier();
    if (comm.rank() == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(150));
      raise(SIGKILL);
    }
    // Stream writes at the victim until the engine reports the failure; bounded well below the harness timeout.
    std::atomic<uint64_t> done{0};
    std::string error;
    ErrorCode code = ErrorCode::kInternal;
    const auto start = std::chrono::steady_clock::now();
    uint64_t posted = 0;
    try {
      while (std::chrono::steady_clock::now() - start < std::chrono::seconds(30)) {
        Completion c;
        c.counter = &done;
        node.engine->write(node.peerOf[1], *node.buf, 0, node.descOf[1], 0, 4 << 20, true, 1, c);
        ++posted;
        node.engine->waitCounter(done, posted, "write to rank 1");
      }
    } catch (const Error& e) {
      error = e.message();
      code = e.code();
    }
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    FCHECK(!error.empty(), "no error after " << posted << " writes to a dead peer in " << secs << " s");
    FCHECK(code == ErrorCode::kFabric || code == ErrorCode::kTimeout || code == ErrorCode::kPeerFailure,
           "unexpected error code " << errorCodeName(code) << ": " << error);
    FCHECK(error.find("peer 0") != std::string::npos || error.find("rank 1") != std::string::npos,
           "error does not name the peer: " << error);
    // A wait for the dead peer's immediates times out and names what it waited for.
    bool timedOut = false;
    try {
      node.engine->waitImm(77, 1, "immediate from rank 1");
    } catch (const Error& e) {
      timedOut = true;
      // Either its own timeout (naming what it waited for) or the engine's recorded failure (naming the peer).
      const std::string m = e.message();
      FCHECK(m.find("rank 1") != std::string::npos || m.find("peer 0") != std::string::npos,
             "waitImm error names neither the peer nor the wait: " << m);
    }
    FCHECK(timedOut, "waitImm on a dead peer returned");
    std::fprintf(stderr, "[rank 0] dead peer reported after %.2f s: %s\n", secs, error.c_str());
  });
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[1].signal, SIGKILL) << "the victim should have been killed";
  expectRanks(results, {1});
}

TEST_P(FabricTest, CorruptedDescriptor) {
  const std::string prov = provider();
  expectRanks(fg::run(2, [&](fg::Comm& comm) {
    // Delivery-complete writes: the issuer hears about a key the peer rejects (tcp otherwise completes on send).
    EngineOptions opts = optionsFor(prov, 2000);
    opts.deliveryComplete = true;
    Node node(comm, opts, 1 << 16);
    fill(node.data(), 1 << 15, comm.rank());
    comm.barrier();
    // Deserialization: a flipped bit, a truncated blob and garbage are rejected by the checksum / size checks.
    std::vector<uint8_t> wire = node.buf->desc().serialize();
    for (size_t pos : {size_t(9), size_t(20), wire.size() - 1}) {
      std::vector<uint8_t> bad = wire;
      bad[pos] ^= 0x10;
      bool rejected = false;
      try {
        MemoryDesc::deserialize(bad.data(), bad.size());
      } catch (const Error& e) {
        rejected = e.code() == ErrorCode::kInvalidArgument;
      }
      FCHECK(rejected, "descriptor with byte " << pos << " flipped was accepted");
    }
    bool rejected = false;
    try {
      MemoryDesc::deserialize(wire.data(), wire.size() - 3);
    } catch (const Error& e) {
      rejected = e.code() == ErrorCode::kInvalidArgument && e.message().find("bytes") != std::string::npos;
    }
    FCHECK(rejected, "truncated descriptor accepted");
    MemoryDesc good = MemoryDesc::deserialize(wire.data(), wire.size());
    FCHECK(good.addr == node.buf->desc().addr && good.keys[0] == node.buf->desc().keys[0], "round trip");
    // A descriptor whose key is wrong (but well-formed): the write fails with an error, the data never lands.
    comm.barrier();
    if (comm.rank() == 0) {
      MemoryDesc wrong = node.descOf[1];
      wrong.keys[0] = wrong.keys[0] ^ 0x5a5a5a5aull ^ 0x1000ull;
      std::atomic<int> fired{0};
      std::string err;
      Completion c;
      c.callback = [&](const std::string& e) {
        err = e;
        fired.store(1);
      };
      std::atomic<uint64_t> never{0};
      c.counter = &never;
      node.engine->write(node.peerOf[1], *node.buf, 0, wrong, 0, 1 << 15, false, 0, c);
      bool threw = false;
      try {
        node.engine->waitCounter(never, 1, "write with a wrong key");
      } catch (const Error& e) {
        threw = true;
      }
      FCHECK(threw, "a write with a wrong key completed successfully");
      auto t0 = std::chrono::steady_clock::now();
      while (fired.load() == 0 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      FCHECK(fired.load() == 1 && !err.empty(), "the completion callback did not report the failure");
      FCHECK(err.find("peer 0") != std::string::npos, "error does not name the peer: " << err);
      std::fprintf(stderr, "[rank 0] wrong key: %s\n", err.c_str());
      // Out-of-range offsets against a valid descriptor are rejected before anything is posted.
      bool range = false;
      try {
        node.engine->write(node.peerOf[1], *node.buf, 0, node.descOf[1], (1 << 16) - 10, 11, false, 0, {});
      } catch (const Error& e) {
        range = e.code() == ErrorCode::kInvalidArgument;
      }
      FCHECK(range, "a write past the end of the remote region was accepted");
    }
    comm.barrier();
    if (comm.rank() == 1) {
      for (uint64_t j = 0; j < (1 << 15); ++j) {
        FCHECK(node.data()[j] == pattern(1, j), "byte " << j << " changed by a write with a wrong key");
      }
    }
    comm.barrier("end");
  }));
}

TEST_P(FabricTest, RegisterInvalidRange) {
  const std::string prov = provider();
  expectRanks(fg::run(1, [&](fg::Comm&) {
    auto engine = TransferEngine::create(optionsFor(prov, 2000));
    auto expectCode = [&](ErrorCode want, const char* what, const std::function<void()>& f) {
      try {
        f();
      } catch (const Error& e) {
        FCHECK(e.code() == want, what << ": got " << errorCodeName(e.code()) << ": " << e.message());
        return std::string(e.message());
      }
      FCHECK(false, what << ": no error");
      return std::string();
    };
    expectCode(ErrorCode::kInvalidArgument, "null address", [&] { engine->registerMemory(nullptr, 4096); });
    std::vector<uint8_t> small(64);
    expectCode(ErrorCode::kInvalidArgument, "zero bytes", [&] { engine->registerMemory(small.data(), 0); });
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* p = mmap(nullptr, 4 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    FCHECK(p != MAP_FAILED, "mmap");
    munmap(static_cast<uint8_t*>(p) + 2 * page, 2 * page);
    std::string m =
        expectCode(ErrorCode::kInvalidArgument, "partly unmapped range", [&] { engine->registerMemory(p, 4 * page); });
    FCHECK(m.find("not mapped") != std::string::npos, m);
    expectCode(ErrorCode::kInvalidArgument, "wrapping range",
               [&] { engine->registerMemory(reinterpret_cast<void*>(~uintptr_t(0) - 16), 4096); });
    auto ok = engine->registerMemory(p, 2 * page);
    FCHECK(ok->size() == 2 * page && ok->desc().size == 2 * page, "valid registration");
    std::string cuda = expectCode(ErrorCode::kUnavailable, "CUDA memory without FI_HMEM",
                                  [&] { engine->registerMemory(p, page, MemoryKind::kCuda, 0); });
    FCHECK(cuda.find(engine->providerName()) != std::string::npos, "message does not name the provider: " << cuda);
  }));
}

// Submission from several threads at once, thousands of operations in flight (exercises FI_EAGAIN queueing).
TEST_P(FabricTest, ConcurrentSubmitters) {
  const std::string prov = provider();
  expectRanks(fg::run(2, [&](fg::Comm& comm) {
    const int kThreads = 4;
    const int kOps = 1500;
    const uint64_t kSlot = 4096;
    Node node(comm, optionsFor(prov), 2 * kThreads * kSlot);
    fill(node.data(), kThreads * kSlot, comm.rank());
    comm.barrier();
    const int peer = 1 - comm.rank();
    std::atomic<uint64_t> done{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int k = 0; k < kOps; ++k) {
          Completion c;
          c.counter = &done;
          uint64_t len = 1 + (k * 37 + t) % kSlot;
          node.engine->write(node.peerOf[peer], *node.buf, t * kSlot, node.descOf[peer], (kThreads + t) * kSlot, len,
                             true, 1100 + t, k % 3 == 0 ? c : Completion{});
        }
      });
    }
    for (auto& th : threads) th.join();
    for (int t = 0; t < kThreads; ++t) node.engine->waitImm(1100 + t, kOps, "thread " + std::to_string(t));
    node.engine->waitCounter(done, kThreads * ((kOps + 2) / 3), "concurrent writes");
    for (int t = 0; t < kThreads; ++t) {
      // The largest write of each thread covers what any other of its writes covered with the same bytes.
      uint64_t maxLen = 0;
      for (int k = 0; k < kOps; ++k) maxLen = std::max<uint64_t>(maxLen, 1 + (k * 37 + t) % kSlot);
      for (uint64_t j = 0; j < maxLen; ++j) {
        FCHECK(node.data()[(kThreads + t) * kSlot + j] == pattern(peer, t * kSlot + j),
               "thread " << t << " byte " << j);
      }
    }
    comm.barrier("end");
  }));
}

// Nobody calls wait*: the progress thread alone completes the issuer's operations and counts the receiver's
// immediates (here pinned to core 0).
TEST_P(FabricTest, ProgressThreadAlone) {
  const std::string prov = provider();
  expectRanks(fg::run(2, [&](fg::Comm& comm) {
    EngineOptions o = optionsFor(prov);
    o.progressCpu = 0;
    Node node(comm, o, 1 << 20);
    fill(node.data(), 1 << 19, comm.rank());
    comm.barrier();
    const int peer = 1 - comm.rank();
    std::atomic<int> callbacks{0};
    for (int k = 0; k < 50; ++k) {
      Completion c;
      c.callback = [&](const std::string& err) {
        if (err.empty()) callbacks.fetch_add(1);
      };
      node.engine->write(node.peerOf[peer], *node.buf, 0, node.descOf[peer], 1 << 19, 1 << 18, true, 9, c);
    }
    auto t0 = std::chrono::steady_clock::now();
    while ((callbacks.load() < 50 || node.engine->immCount(9) < 50) &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    FCHECK(callbacks.load() == 50, callbacks.load() << " of 50 callbacks without a waiter");
    FCHECK(node.engine->immCount(9) == 50, node.engine->immCount(9) << " of 50 immediates without a waiter");
    for (uint64_t j = 0; j < (1 << 18); ++j) FCHECK(node.data()[(1 << 19) + j] == pattern(peer, j), "byte " << j);
    comm.barrier("end");
  }));
}

INSTANTIATE_TEST_SUITE_P(Providers, FabricTest, ::testing::Values("tcp", "shm"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// ---------------------------------------------------------------------------------------------------------------

TEST(FabricProbe, ListsTcpAndShm) {
  auto results = fg::run(1, [](fg::Comm&) {
    std::vector<std::string> names = TransferEngine::probe();
    std::string all;
    for (auto& n : names) all += n + " ";
    FCHECK(all.find("tcp") != std::string::npos, "probe: " << all);
    FCHECK(all.find("shm") != std::string::npos, "probe: " << all);
  });
  expectRanks(results);
}

TEST(FabricProbe, UnknownProviderIsUnavailable) {
  expectRanks(fg::run(1, [](fg::Comm&) {
    bool ok = false;
    try {
      TransferEngine::create(optionsFor("no-such-provider"));
    } catch (const Error& e) {
      ok = e.code() == ErrorCode::kUnavailable && e.message().find("no-such-provider") != std::string::npos;
    }
    FCHECK(ok, "an unknown provider did not give kUnavailable naming it");
  }));
}

// The libibverbs engine: without an RDMA device it must say so (skipped, with the reason); with one it runs the
// same byte-for-byte write test as libfabric.
TEST(VerbsEngine, WriteEverySizeTwoProcesses) {
  std::string reason;
  auto probe = fg::run(1, [&](fg::Comm&) {
    try {
      auto e = TransferEngine::create(optionsFor("ibverbs"));
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kUnavailable) throw std::runtime_error("UNAVAILABLE " + e.message());
      throw;
    }
  });
  if (!probe[0].ok()) {
    const std::string& err = probe[0].message;
    auto pos = err.find("UNAVAILABLE ");
    if (pos != std::string::npos) GTEST_SKIP() << err.substr(pos + 12);
    FAIL() << "creating the verbs engine failed: " << err;
  }
  expectRanks(fg::run(2, [&](fg::Comm& comm) { writeEverySize(comm, optionsFor("ibverbs")); }));
}

}  // namespace
}  // namespace fabric
}  // namespace epcomm
