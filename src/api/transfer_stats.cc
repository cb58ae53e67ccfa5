// transferStats(): the public view of the fabric counters of the backends built on the proxy channel.
#include "epcomm/all_to_all.hpp"

#ifdef EPCOMM_HAVE_HOST_BACKEND
#include "backends/host/host_all_to_all.hpp"
#endif
#ifdef EPCOMM_HAVE_PROXY_BACKEND
#include "backends/proxy/proxy_all_to_all.hpp"
#endif
#if defined(EPCOMM_HAVE_HOST_BACKEND) || defined(EPCOMM_HAVE_PROXY_BACKEND)
#define EPCOMM_TRANSFER_STATS_CHANNEL 1
#include "proxy/proxy_channel.hpp"
#endif

namespace epcomm {

namespace {

#ifdef EPCOMM_TRANSFER_STATS_CHANNEL
TransferStats fromChannel(const proxy::ChannelStats& s, const std::string& provider, uint32_t privateTokens) {
  TransferStats out;
  out.available = true;
  out.provider = provider;
  out.privateTokens = privateTokens;
  out.dispatchRounds = s.dispatchRounds;
  out.combineRounds = s.combineRounds;
  out.peers.reserve(s.peers.size());
  for (const proxy::PeerOps& p : s.peers) {
    out.peers.push_back({p.headWrites, p.bulkWrites, p.combineWrites, p.barrierImms, p.bytes});
  }
  return out;
}
#endif

}  // namespace

TransferStats transferStats(const AllToAll& a2a) {
  // The backends that own a TransferEngine are known here, inside the library; callers see one plain struct.
#ifdef EPCOMM_HAVE_HOST_BACKEND
  if (const auto* h = dynamic_cast<const host::HostAllToAll*>(&a2a)) {
    return fromChannel(h->stats(), h->providerName(), h->sizes().privateTokens);
  }
#endif
#ifdef EPCOMM_HAVE_PROXY_BACKEND
  if (const auto* p = dynamic_cast<const gpuproxy::ProxyAllToAll*>(&a2a)) {
    return fromChannel(p->stats(), p->providerName(), p->sizes().privateTokens);
  }
#endif
  (void)a2a;
  return {};
}

}  // namespace epcomm
