// The GPU `proxy` backend: the proxy protocol of SPEC 1.2 (src/proxy/) with GPU kernels in place of the host
// backend's CPU loops. Kernels pack and unpack the proxy channel's buffers, which are pinned host memory mapped into
// the GPU (the staging path of providers without FI_HMEM: tcp, shm); one proxy thread per object follows flags the
// kernels write into host-mapped memory, runs the channel's exchanges over the TransferEngine and announces arrivals
// the same way. Peers on this rank's node (EPCOMM_PROXY_LOCAL_SIZE) get their entries and combine rows GPU to GPU over
// NVLink instead (CUDA IPC regions, proxy_local.hpp); only their control goes through the channel. Calls are
// stream-ordered, never synchronise the host, and replay in CUDA graphs (the proxy thread serves rounds on its own).
// docs/proxy.md has the design.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epcomm/all_to_all.hpp"
#include "proxy/proxy_channel.hpp"

namespace epcomm {
namespace gpuproxy {

/// See the file comment. Tensors live on the object's CUDA device (EPCOMM_LOCAL_RANK, else rank % devices).
class ProxyAllToAll final : public AllToAll {
 public:
  /// Collective over `bootstrap`: creates the channel (engine, pinned and mapped buffers), the device scratch and the
  /// proxy thread. Throws kUnavailable without a CUDA device or usable provider.
  ProxyAllToAll(const Config& config, Bootstrap& bootstrap, const proxy::ChannelOptions& options = {});
  /// Waits for the device's work (the proxy thread keeps serving it), stops the proxy thread, releases everything.
  ~ProxyAllToAll() override;

  void dispatch(const DispatchArgs& args) override;
  void combine(const CombineArgs& args) override;
  /// cudaDeviceSynchronize, then rethrows a recorded error (kernel or proxy thread).
  void synchronize() override;
  const Config& config() const override;
  const char* backendName() const override { return "proxy"; }
  uint64_t bufferBytes() const override;
  /// Elastic ranks (docs/proxy.md, "Elastic ranks"): the proxy channel's mask. With EPCOMM_ELASTIC=1 a peer lost
  /// mid-round is masked once the others agree: the call that finds the round lost throws, the object goes on from the
  /// next dispatch. Needs every peer over the fabric: with same-node peers over NVLink (EPCOMM_PROXY_LOCAL_SIZE > 1)
  /// creation with EPCOMM_ELASTIC=1 and setActiveRanks throw kUnavailable.
  std::vector<int32_t> activeRanks() const override;
  /// Between rounds: waits for the device (cudaDeviceSynchronize: graph replays of this object included), then agrees
  /// on the mask with the others.
  void setActiveRanks(const std::vector<int32_t>& mask) override;
  uint64_t droppedTokens() const override;

  /// Fabric operations issued so far, per peer.
  proxy::ChannelStats stats() const;
  /// The protocol's sizes (private area, entry bytes, ...).
  const proxy::ProtocolSizes& sizes() const;
  /// Provider the engine runs on ("tcp;ofi_rxm", "shm", ...).
  std::string providerName() const;
  /// How data moves between the GPU and the NIC, e.g. "staging: pinned host memory mapped into the GPU (provider
  /// tcp;ofi_rxm has no FI_HMEM)".
  const std::string& memoryPath() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gpuproxy
}  // namespace epcomm
