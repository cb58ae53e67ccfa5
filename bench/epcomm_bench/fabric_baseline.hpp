// The host backend's baseline: a dense all-to-all of the same bytes over the same TransferEngine provider, so the
// host rows of epcomm-bench have a number measured in the same run beside them (NCCL needs GPUs). Each rank writes
// its bytes for every peer as one write-with-immediate into that peer's receive region and waits for its own writes
// and for one immediate from every peer: the least fabric work any all-to-all of these bytes can do, without the
// routing, packing and unpacking that dispatch adds.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epcomm/bootstrap.hpp"
#include "epcomm/fabric/transfer_engine.hpp"

namespace epcomm {
namespace bench {

/// One configuration's all-to-all over its own TransferEngine. Construction is collective over `bootstrap`: it opens
/// the engine (provider "" = EPCOMM_FABRIC_PROVIDER, else the probe order, as the host backend's channel does),
/// registers a send region of sum(sendBytes) and a receive region of what the peers send here, and exchanges
/// addresses and descriptors. Not thread-safe (one caller per process); every rank must call run() equally often.
class FabricA2aBaseline {
 public:
  /// `sendBytes[p]`: bytes this rank sends to rank p (its own entry is ignored); `timeoutMs` bounds every wait
  /// (0: EPCOMM_TIMEOUT_MS); `label` names the configuration in error messages.
  FabricA2aBaseline(Bootstrap& bootstrap, const std::vector<uint64_t>& sendBytes, int64_t timeoutMs,
                    const std::string& label);
  ~FabricA2aBaseline();
  FabricA2aBaseline(const FabricA2aBaseline&) = delete;
  FabricA2aBaseline& operator=(const FabricA2aBaseline&) = delete;

  /// One all-to-all: a write with immediate to every peer (an immediate alone where there are no bytes), then
  /// blocks until those writes completed locally and every peer's immediate arrived. Throws the engine's error
  /// code (kTimeout naming the missing rank, kFabric/kVerbs for a failed transfer) with this rank, the round and
  /// the label in front.
  void run();
  /// Blocks until every write posted so far completed locally (its source may be reused).
  void drain();

  /// Provider the engine runs on ("tcp", "shm", ...).
  std::string providerName() const;

 private:
  std::string where() const;  // rank, label and round, for error messages

  struct Buffer {
    void operator()(uint8_t* p) const;
  };

  int rank_ = 0, world_ = 1;
  std::string label_;
  std::vector<uint64_t> sendBytes_, sendOffset_, dstOffset_;  // per peer: bytes, offset here, offset at the peer
  std::unique_ptr<uint8_t, Buffer> sendBuf_, recvBuf_;
  std::unique_ptr<fabric::TransferEngine> engine_;
  std::unique_ptr<fabric::MemoryRegion> sendMr_, recvMr_;
  std::vector<fabric::PeerId> peerIds_;
  std::vector<fabric::MemoryDesc> recvDescs_;
  std::atomic<uint64_t> sent_{0};
  uint64_t posted_ = 0, round_ = 0;
  int64_t timeoutMs_ = 0;
};

}  // namespace bench
}  // namespace epcomm
