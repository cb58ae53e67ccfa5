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

  /// Fabric operations issued so far, per peer.
  HostStats stats() const { return channel_->stats(); }
  /// The protocol's sizes (private area, entry bytes, ...).
  const proxy::ProtocolSizes& sizes() const { return channel_->sizes(); }
  /// Provider the engine runs on ("tcp", "shm", ...).
  std::string providerName() const { return channel_->providerName(); }

 private:
  uint32_t boundOf(const int32_t* boundM, uint32_t m, const char* op) const;

  Config config_;
  std::unique_ptr<proxy::ProxyChannel> channel_;
  /// Where the object is in the dispatch -> combine alternation (each may be split into send and recv); a dispatch
  /// may repeat without a combine in between (as this backend always allowed).
  CallOrder order_;
  DType yDtype_ = DType::kInvalid;
};

}  // namespace host
}  // namespace epcomm
