// Elastic ranks on the GPU proxy backend (docs/proxy.md, "Elastic ranks"; docs/failures.md): the active-ranks mask is
// the proxy channel's (src/proxy/proxy_elastic.cc: the agreement among the survivors, the writes and waits that skip
// masked ranks); this file is what the GPU side adds. The kernels read the mask from the round's tables (the route
// kernel drops the positions of masked ranks before anything is counted or packed, the combine receive leaves them out
// of its sums and counts them); a round the channel loses to a peer stops this rank's kernels, and the caller's next
// call resets the device state as a new object's and goes on with the agreed mask.
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <vector>

#include "backends/proxy/proxy_impl.hpp"
#include "core/cuda_check.hpp"

namespace epcomm {
namespace gpuproxy {

namespace {

// Makes `device` current for the scope (the caller's current device comes back after).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) EPCOMM_CHECK_CUDA(cudaSetDevice(device));
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace

int64_t ProxyAllToAll::Impl::kernelWaitMs() const {
  const int64_t t = channel->timeoutMs();
  if (!channel->elastic()) return t;
  // The channel's bound on an exchange that loses peers (ProxyChannel::waitJob's): its own waits, the agreement (a
  // timeout for each member that does not answer) and the dispatch once more. Kernels wait twice the value.
  return ((6 + 2 * static_cast<int64_t>(config.worldSize)) * t + 1000) / 2;
}

void ProxyAllToAll::Impl::startProxy() {
  pause = false;
  thread = std::thread([this] { proxyLoop(); });
}

void ProxyAllToAll::Impl::pauseProxy() {
  pause = true;
  if (thread.joinable()) thread.join();
  pause = false;
}

void ProxyAllToAll::Impl::publishMask() {
  const std::vector<uint8_t> active = channel->activeRanks();
  std::vector<uint32_t> words(1 + config.worldSize, 0);
  for (uint32_t r = 0; r < config.worldSize; ++r) {
    words[1 + r] = active[r] ? 0u : 1u;
    words[0] += words[1 + r];
  }
  std::memcpy(tables + tg.offMasked, words.data(), 4 * words.size());
  DeviceScope scope(device);
  EPCOMM_CHECK_CUDA(
      cudaMemcpy(scratch + sg.offTables + 4ull * tg.offMasked, words.data(), 4 * words.size(), cudaMemcpyHostToDevice));
}

void ProxyAllToAll::Impl::recoverFromLoss(std::exception_ptr lost) {
  ErrorCode code = ErrorCode::kPeerFailure;
  std::string message;
  try {
    std::rethrow_exception(lost);
  } catch (const Error& e) {
    code = e.code();
    message = e.message();
  } catch (const std::exception& e) {
    message = e.what();
  }
  message = "proxy backend rank " + std::to_string(config.rank) + ": " + message;
  // The proxy thread raised the abort word, then ended: this rank's kernels that wait stop, and every kernel after
  // them returns at once (the object is halted on the device).
  if (thread.joinable()) thread.join();
  DeviceScope scope(device);
  const cudaError_t synced = cudaDeviceSynchronize();
  if (synced != cudaSuccess) {
    failedCode = ErrorCode::kCuda;
    failed = message + "; waiting for this rank's kernels to stop failed: " + cudaGetErrorString(synced);
    detail::throwError(failedCode, failed + " [this AllToAll object is unusable]", __FILE__, __LINE__);
  }
  // As a new object's: the round counters, block counters, claim word, bound and arrival relays (the scratch below
  // the per-round arrays, which every round rewrites), and the mailbox but its drop count.
  EPCOMM_CHECK_CUDA(cudaMemset(scratch + sg.offSeq, 0, sg.offExperts - sg.offSeq));
  const uint64_t dropped = __atomic_load_n(&mailbox->dropped, __ATOMIC_ACQUIRE);
  std::memset(static_cast<void*>(mailbox), 0, sizeof(Mailbox));
  mailbox->dropped = dropped;
  order.reset();
  dispatchSends = 0;
  combineSendType = -1;
  proxyRound = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    refusalPending = false;
    refusalMessage.clear();
    failurePending = false;
    failureMessage.clear();
  }
  publishMask();
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  startProxy();
  detail::throwError(code, message, __FILE__, __LINE__);
}

std::vector<int32_t> ProxyAllToAll::activeRanks() const {
  const std::vector<uint8_t> mask = impl_->channel->activeRanks();
  return std::vector<int32_t>(mask.begin(), mask.end());
}

uint64_t ProxyAllToAll::droppedTokens() const { return __atomic_load_n(&impl_->mailbox->dropped, __ATOMIC_ACQUIRE); }

void ProxyAllToAll::setActiveRanks(const std::vector<int32_t>& mask) {
  Impl& m = *impl_;
  m.checkUsable();
  const uint32_t me = m.config.rank;
  EPCOMM_CHECK(m.lg.size == 0, kUnavailable,
               "proxy backend rank " << me << ": setActiveRanks needs every peer over the fabric, but " << m.lg.size
                                     << " ranks of this node exchange entries and combine rows over NVLink (CUDA IPC), "
                                        "whose kernels cannot skip a masked node peer; set "
                                        "EPCOMM_PROXY_LOCAL_SIZE=1 for elastic ranks (docs/proxy.md, \"Elastic "
                                        "ranks\")");
  EPCOMM_CHECK(m.order.state() == CallOrder::State::kIdle, kInvalidArgument,
               "proxy backend rank " << me << ": setActiveRanks while the object is '"
                                     << CallOrder::name(m.order.state()) << "' (call it between rounds)");
  std::vector<uint8_t> m8(mask.size());
  for (size_t r = 0; r < mask.size(); ++r) {
    EPCOMM_CHECK(mask[r] == 0 || mask[r] == 1, kInvalidArgument,
                 "setActiveRanks: entry " << r << " is " << mask[r] << " (1 = active, 0 = masked)");
    m8[r] = static_cast<uint8_t>(mask[r]);
  }
  // The agreement runs on this thread, with the proxy thread stopped between rounds: no kernel of this object may
  // still wait for it (nor read the mask that changes).
  {
    DeviceScope scope(m.device);
    EPCOMM_CHECK_CUDA(cudaDeviceSynchronize());
  }
  m.checkUsable();
  m.pauseProxy();
  try {
    m.channel->setActiveRanks(m8);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kInvalidArgument) {
      m.startProxy();  // a bad mask, refused before anything was sent: the object goes on as it was
    } else {
      m.failedCode = e.code();
      m.failed = "proxy backend rank " + std::to_string(me) + ": setActiveRanks: " + e.message();
    }
    throw;
  }
  if (!m.channel->activeRanks()[me]) {
    // It left: the others go on without it; every later call says so (the proxy thread stays stopped).
    m.failedCode = ErrorCode::kInvalidArgument;
    m.failed = "proxy backend rank " + std::to_string(me) +
               ": this rank left the object (setActiveRanks masked it) and takes no part in its rounds";
    return;
  }
  m.publishMask();
  m.startProxy();
}

}  // namespace gpuproxy
}  // namespace epcomm
