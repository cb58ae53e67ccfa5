// The `host` backend: the proxy protocol of SPEC 1.2 with CPU loops in place of the GPU kernels, on host memory.
// It is the reference implementation of the protocol across real processes, the CI backend and the default on
// machines without GPUs.
#pragma once

#include <memory>
#include <string>

#include "core/call_order.hpp"
#include "core/validate.hpp"
#include "epcomm/all_to_all.hpp"
#include "proxy/proxy_channel.hpp"

namespace epcomm {
namespace host {

/// Knobs of the host backend beyond the Config (the factory uses the defaults: environment variables).
using HostOptions = proxy::ChannelOptions;

/// Fabric operations per round, for benchmarks and tests.
using HostStats = proxy::ChannelStats;

/// See the file comment. Tensors live in host memory. dispatch/combine with doSend only return once the data is
/// posted (the proxy thread moves it); doRecv blocks, bounded by the timeout.
///
/// Errors: a call refused by a check (arguments, call order, expert indices, boundM, combine indices that differ
/// from the dispatched ones) sends nothing and leaves the object as it was, so the corrected call goes on; a refused
/// send half also tells the peers (their waits for this rank end at once with its message, see
/// ProxyChannel::noticeRefused). An error of the exchange itself (timeout, transfer, a peer that gave up) leaves the
/// object unusable: every later call rethrows it; destroy the object and create a new one. With elastic ranks
/// (HostOptions::elastic, EPCOMM_ELASTIC=1) a peer lost that way is masked once the others agree: the call throws, the
/// object goes on with the others from the next dispatch (docs/failures.md, "Elastic ranks").
class HostAllToAll final : public AllToAll {
 public:
  /// Collective over `bootstrap`.
  HostAllToAll(const Config& config, Bootstrap& bootstrap, const HostOptions& options = {});
  ~HostAllToAll() override;

  void dispatch(const DispatchArgs& args) override;
  void combine(const CombineArgs& args) override;
  void synchronize() override;
  const Config& config() const override { return config_; }
  const char* backendName() const override { return "host"; }
  uint64_t bufferBytes() const override { return channel_->bufferBytes(); }
  std::vector<int32_t> activeRanks() const override;
  void setActiveRanks(const std::vector<int32_t>& mask) override;
  uint64_t droppedTokens() const override { return droppedTokens_; }

  /// Fabric operations issued so far, per peer.
  HostStats stats() const { return channel_->stats(); }
  /// The protocol's sizes (private area, entry bytes, ...).
  const proxy::ProtocolSizes& sizes() const { return channel_->sizes(); }
  /// Provider the engine runs on ("tcp", "shm", ...).
  std::string providerName() const { return channel_->providerName(); }

 private:
  uint32_t boundOf(const int32_t* boundM, uint32_t m, const char* op) const;
  // Throws kInvalidArgument unless the combine's indices and boundM are those of the last dispatch (digest).
  void checkSameRouting(const CombineArgs& args, const CheckedCombine& checked, uint32_t bound) const;
  // After a receive half threw: a round lost to a peer (elastic ranks) is over, the next call is a dispatch.
  void afterFailedWait();

  Config config_;
  std::unique_ptr<proxy::ProxyChannel> channel_;
  /// Where the object is in the dispatch -> combine alternation (each may be split into send and recv); a dispatch
  /// may repeat without a combine in between (as this backend always allowed).
  CallOrder order_;
  DType yDtype_ = DType::kInvalid;
  /// routingDigest (core/routing_digest.hpp) of the last dispatch's indices and boundM, which combine must reuse.
  uint64_t routingDigest_ = 0;
  uint32_t routingBound_ = 0;
  /// A send half was refused (peers were told) and not yet followed by one that went through.
  bool refusedSend_ = false;
  std::string refusedMessage_;
  /// Combine positions left out because their rank was masked (elastic ranks).
  uint64_t droppedTokens_ = 0;
};

}  // namespace host
}  // namespace epcomm
