#include "fabric_baseline.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

#include "epcomm/error.hpp"
#include "options.hpp"

namespace epcomm {
namespace bench {
namespace {

// Immediate of the write from rank s: one value per sender, so a timeout names the rank that did not deliver.
constexpr uint32_t kImmBase = 1;

uint64_t regionBytes(uint64_t bytes) { return (std::max<uint64_t>(bytes, 1) + 4095) / 4096 * 4096; }

// Keeps the engine's code, file and line; puts who/where in front of its message.
[[noreturn]] void rethrowWith(const Error& e, const std::string& context) {
  detail::throwError(e.code(), context + ": " + e.message(), e.file(), e.line());
}

}  // namespace

void FabricA2aBaseline::Buffer::operator()(uint8_t* p) const { std::free(p); }

FabricA2aBaseline::FabricA2aBaseline(Bootstrap& bootstrap, const std::vector<uint64_t>& sendBytes, int64_t timeoutMs,
                                     const std::string& label)
    : rank_(bootstrap.rank()), world_(bootstrap.worldSize()), label_(label), sendBytes_(sendBytes) {
  EPCOMM_CHECK(static_cast<int>(sendBytes_.size()) == world_, kInvalidArgument,
               "fabric all-to-all baseline (" << label_ << "): " << sendBytes_.size() << " send sizes for " << world_
                                              << " ranks");
  sendBytes_[rank_] = 0;  // the local share is no fabric traffic
  // Row s of `all`: what rank s sends to each rank. Rank s's bytes land at the receiver after those of ranks < s.
  std::vector<uint64_t> all(static_cast<size_t>(world_) * world_);
  bootstrap.allGather(sendBytes_.data(), all.data(), world_ * sizeof(uint64_t));
  uint64_t sendTotal = 0, recvTotal = 0;
  sendOffset_.assign(world_, 0);
  dstOffset_.assign(world_, 0);
  for (int p = 0; p < world_; ++p) {
    sendOffset_[p] = sendTotal;
    sendTotal += sendBytes_[p];
    recvTotal += all[static_cast<size_t>(p) * world_ + rank_];
    for (int s = 0; s < rank_; ++s) dstOffset_[p] += all[static_cast<size_t>(s) * world_ + p];
  }
  auto alloc = [&](uint64_t bytes) {
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(4096, regionBytes(bytes)));
    EPCOMM_CHECK(p != nullptr, kSystem,
                 "fabric all-to-all baseline (" << label_ << "): out of host memory for " << bytes << " bytes");
    std::memset(p, 0x5a, regionBytes(bytes));  // pages touched here, not in the timed loop
    return p;
  };
  sendBuf_.reset(alloc(sendTotal));
  recvBuf_.reset(alloc(recvTotal));

  std::ostringstream where;
  where << "fabric all-to-all baseline rank " << rank_ << " (" << label_ << "): setup";
  try {
    fabric::EngineOptions eo;  // provider "": EPCOMM_FABRIC_PROVIDER, else the probe, as the host backend's channel
    eo.numNics = 1;
    timeoutMs_ = timeoutMs > 0 ? timeoutMs : timeoutMsFromEnv();
    eo.timeoutMs = timeoutMs_;
    engine_ = fabric::TransferEngine::create(eo);
    sendMr_ = engine_->registerMemory(sendBuf_.get(), regionBytes(sendTotal));
    recvMr_ = engine_->registerMemory(recvBuf_.get(), regionBytes(recvTotal));
  } catch (const Error& e) {
    rethrowWith(e, where.str());
  }
  const auto addresses = allGatherBlobs(bootstrap, engine_->address());
  const auto descs = allGatherBlobs(bootstrap, recvMr_->desc().serialize());
  peerIds_.assign(world_, 0);
  recvDescs_.resize(world_);
  try {
    for (int r = 0; r < world_; ++r) {
      recvDescs_[r] = fabric::MemoryDesc::deserialize(descs[r].data(), descs[r].size());
      if (r != rank_) peerIds_[r] = engine_->addPeer(addresses[r]);
    }
  } catch (const Error& e) {
    rethrowWith(e, where.str());
  }
  // Nobody writes before every peer has registered its region and added its peers.
  bootstrap.barrier();
}

FabricA2aBaseline::~FabricA2aBaseline() {
  // Writes this rank posted finish (or fail) before their source is deregistered; bounded like every wait.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(2000);
  while (sent_.load() < posted_ && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

std::string FabricA2aBaseline::providerName() const { return engine_->providerName(); }

void FabricA2aBaseline::run() {
  ++round_;
  try {
    for (int i = 1; i < world_; ++i) {
      // Peers in a rotated order, so not every rank writes to rank 0 first.
      const int p = (rank_ + i) % world_;
      fabric::Completion done;
      done.counter = &sent_;
      ++posted_;
      const uint32_t imm = kImmBase + static_cast<uint32_t>(rank_);
      if (sendBytes_[p] == 0) {
        engine_->immediate(peerIds_[p], imm, done);
      } else {
        engine_->write(peerIds_[p], *sendMr_, sendOffset_[p], recvDescs_[p], dstOffset_[p], sendBytes_[p], true, imm,
                       done);
      }
    }
    // Arrivals are polled and the engine's progress thread moves the data, as the host backend's channel waits for
    // its heads: a caller that drives progress itself (waitImm right away) is several times slower here when more
    // ranks than cores spin (W = 4 on 2 cores: ~500 us instead of ~100 us at a few KiB per peer).
    std::vector<int> senders;
    for (int i = 1; i < world_; ++i) senders.push_back((rank_ - i + world_) % world_);
    const auto start = std::chrono::steady_clock::now();
    uint32_t idle = 0;
    while (!senders.empty()) {
      bool arrived = false;
      for (size_t i = 0; i < senders.size();) {
        const uint32_t imm = kImmBase + static_cast<uint32_t>(senders[i]);
        if (engine_->immCount(imm) >= 1) {
          // Consumes the arrival (returns at once), so the value counts afresh next round.
          engine_->waitImm(imm, 1, "write with immediate from rank " + std::to_string(senders[i]));
          senders[i] = senders.back();
          senders.pop_back();
          arrived = true;
        } else {
          ++i;
        }
      }
      if (senders.empty()) break;
      engine_->checkErrors();
      if (std::chrono::steady_clock::now() - start > std::chrono::milliseconds(timeoutMs_)) {
        std::sort(senders.begin(), senders.end());
        std::ostringstream missing;
        for (size_t i = 0; i < senders.size(); ++i) missing << (i ? ", " : "") << senders[i];
        EPCOMM_THROW(kTimeout, "no write with immediate from rank(s) " << missing.str() << " after " << timeoutMs_
                                                                       << " ms (peer dead or stalled?)");
      }
      if (arrived) {
        idle = 0;
      } else if (++idle < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(idle < 2048 ? 20 : 200));
      }
    }
  } catch (const Error& e) {
    rethrowWith(e, where());
  }
}

void FabricA2aBaseline::drain() {
  try {
    engine_->waitCounter(sent_, posted_, "local completion of the writes to the peers");
  } catch (const Error& e) {
    rethrowWith(e, where());
  }
}

std::string FabricA2aBaseline::where() const {
  std::ostringstream oss;
  oss << "fabric all-to-all baseline rank " << rank_ << " (" << label_ << ", round " << round_ << ")";
  return oss.str();
}

}  // namespace bench
}  // namespace epcomm
