// The GPU proxy backend's object state (ProxyAllToAll::Impl), shared by its translation units: proxy_all_to_all.cc
// (setup, the calls, the proxy thread, errors) and proxy_elastic_ranks.cc (elastic ranks). Private to the backend.
#pragma once

#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/proxy/proxy_all_to_all.hpp"
#include "backends/proxy/proxy_args.hpp"
#include "backends/proxy/proxy_kernels.hpp"
#include "backends/proxy/proxy_local.hpp"
#include "core/call_order.hpp"
#include "core/cuda_resources.hpp"
#include "epcomm/error.hpp"
#include "proxy/proxy_channel.hpp"

namespace epcomm {
namespace gpuproxy {

struct ProxyAllToAll::Impl {
  Impl(const Config& config, Bootstrap& bootstrap, const proxy::ChannelOptions& options);
  ~Impl() { release(); }

  void release();
  void proxyLoop();
  // Waits for the device's flag of step `step` (2 x round, + 1 for a combine); meanwhile sends this rank's refusal of
  // that step (refused()), if any.
  bool waitDevice(const uint64_t* word, uint64_t want, uint64_t step);
  // A call whose send half was refused (`e`, nothing launched): the proxy thread tells the peers (noticeRefused) once
  // it waits for that step, i.e. after the exchanges of every step before it (their round numbers are the channel's).
  void refused(bool doSend, bool combine, const Error& e);
  void sendRefusal(uint64_t step);
  // The first error of this rank's kernels (checkUsable): the proxy thread tells the peers (noticeAbandoned) at its
  // next wait for the device, so that their waits for this rank end at once.
  void sendFailure();
  void checkUsable();
  KernelContext context() const;
  // After a kernel launch on `stream` (rc: its cudaError_t): throws kCuda naming `what` if it failed, else marks it
  // for synchronize() (unless the stream is capturing a graph).
  void launched(int rc, void* stream, const char* what);
  // Kernels wait for the proxy at most twice this long (ms): twice EPCOMM_TIMEOUT_MS, whose waits in the proxy fire
  // first; with elastic ranks as long as the channel's bound on an exchange that loses a peer and agrees on the mask.
  int64_t kernelWaitMs() const;

  // ---- Elastic ranks (proxy_elastic_ranks.cc; docs/proxy.md "Elastic ranks") ----
  // Starts the proxy thread (it serves from proxyRound on).
  void startProxy();
  // Stops the proxy thread while it waits for the device between rounds (no exchange runs then); startProxy resumes.
  void pauseProxy();
  // Runs one exchange of the proxy thread; false when the round was lost to a peer and the ranks agreed to go on
  // (elastic): the kernels waiting for it stop (the mailbox's abort word) and the thread ends, and the caller's next
  // call recovers (recoverFromLoss).
  template <typename Exchange>
  bool exchangeOrLose(Exchange exchange);
  // The caller's side of a lost round: once this rank's kernels have stopped, the device state and the call order are
  // reset as a new object's (the round counters restart; the channel's next exchange is its epoch's round 0), the
  // agreed mask is written for the kernels, the proxy thread restarts, and the call throws `lost` (the object goes
  // on). A rank its peers masked stays unusable.
  [[noreturn]] void recoverFromLoss(std::exception_ptr lost);
  // Writes the channel's mask into the tables' masked words (host and device copy) for the route kernel of the next
  // round; no kernel of this object runs.
  void publishMask();

  Config config;
  Bootstrap* boot = nullptr;  // for the collective teardown of the NVLink regions (outlives the object)
  int device = -1;
  uint32_t blocks = 1;
  uint32_t localSize = 1;
  LocalGeometry lg{};  // same-node peers over NVLink (lg.size 0: none)
  LocalPeers local;
  std::string path;
  std::unique_ptr<proxy::ProxyChannel> channel;
  proxy::ProtocolSizes sizes;
  TableGeometry tg{};
  ScratchGeometry sg{};
  std::vector<void*> pinned;  // the channel's buffers, registered with cudaHostRegister
  ChannelView view{};
  Mailbox* mailbox = nullptr;  // host pointer (mapped)
  Mailbox* mailboxDev = nullptr;
  uint32_t* tables = nullptr;  // host pointer (mapped)
  TraceRound* trace = nullptr;
  TraceRound* traceDev = nullptr;
  int64_t clockLo = 0, clockHi = 0;
  uint8_t* scratch = nullptr;
  CallOrder order;
  cuda::LaunchMarks marks;       // the object's outstanding work, per stream (synchronize)
  int32_t combineSendType = -1;  // expertY of the last combine send half (the receive half reads rows of it)

  std::thread thread;
  std::atomic<bool> stop{false};
  std::atomic<bool> pause{false};  // pauseProxy: the proxy thread ends at its next wait for the device
  uint64_t proxyRound = 0;         // the round the proxy thread serves next (its own while it runs)
  std::atomic<uint64_t> roundsServed{0};
  uint64_t traceRound = 0;     // proxy thread only: the round being stamped
  uint64_t dispatchSends = 0;  // dispatch send halves launched (caller's thread)
  // A refused call for the proxy thread to tell the peers about (under mu): step as in waitDevice.
  std::atomic<bool> refusalPending{false};
  uint64_t refusalStep = 0;
  std::string refusalMessage;
  std::atomic<bool> failurePending{false};
  std::string failureMessage;  // under mu
  std::mutex mu;
  std::exception_ptr proxyError;  // the proxy thread's failure, rethrown by the next call
  std::exception_ptr lostRound;   // elastic ranks: a round the proxy thread lost to a peer (under mu)
  std::string failed;             // once set, every call throws it
  ErrorCode failedCode = ErrorCode::kInternal;
};

}  // namespace gpuproxy
}  // namespace epcomm
