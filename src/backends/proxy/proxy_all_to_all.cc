#include "backends/proxy/proxy_all_to_all.hpp"

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "backends/backends.hpp"
#include "backends/proxy/proxy_args.hpp"
#include "backends/proxy/proxy_impl.hpp"
#include "backends/proxy/proxy_kernels.hpp"
#include "backends/proxy/proxy_local.hpp"
#include "backends/proxy/proxy_trace.hpp"
#include "core/agreement.hpp"
#include "core/call_order.hpp"
#include "core/cuda_check.hpp"
#include "core/env.hpp"
#include "core/log.hpp"
#include "core/validate.hpp"
#include "epcomm/error.hpp"
#include "epcomm/fabric/transfer_engine.hpp"

namespace epcomm {
namespace gpuproxy {

namespace {

// The host half of the hand-off's memory ordering: the kernels store with st.release.sys and load with ld.acquire.sys.
uint64_t loadAcquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void storeRelease(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

const char* kernelPhaseName(int32_t phase) {
  switch (phase) {
    case kPhaseBadIndex:
      return "dispatch-send (expert index check)";
    case kPhaseDispatchArrival:
      return "dispatch-recv (waiting for the proxy thread to announce the peers' tokens)";
    case kPhaseCombineArrival:
      return "combine-recv (waiting for the proxy thread to announce the owners' rows)";
    case kPhaseCorruptEntry:
      return "dispatch-recv (reading the received entries)";
    case kPhaseCombineIndex:
      return "combine-recv (finding each token's rows)";
    case kPhaseCombineBadIndex:
      return "combine-recv (expert index check)";
    case kPhaseLocalDispatch:
      return "dispatch-recv (waiting for a same-node sender's entries over NVLink)";
    case kPhaseLocalCombine:
      return "combine-recv (waiting for a same-node owner's rows over NVLink)";
    default:
      return "unknown";
  }
}

}  // namespace

ProxyAllToAll::Impl::Impl(const Config& c, Bootstrap& bootstrap, const proxy::ChannelOptions& options)
    : config(c), boot(&bootstrap), order("proxy", c.rank, false) {
  config.validate();
  EPCOMM_CHECK(static_cast<int>(c.worldSize) == bootstrap.worldSize() && static_cast<int>(c.rank) == bootstrap.rank(),
               kInvalidArgument,
               "proxy backend: config says rank " << c.rank << " of " << c.worldSize << ", the bootstrap "
                                                  << bootstrap.rank() << " of " << bootstrap.worldSize());
  try {
    device = pickDevice(c, "proxy backend: ");
    EPCOMM_CHECK_CUDA(cudaSetDevice(device));
    int sms = 0;
    EPCOMM_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    blocks = static_cast<uint32_t>(std::max(1, sms));

    // Ranks per node: the node's peers (ranks rank / localSize * localSize, ...) get their entries and combine rows
    // over NVLink, GPU to GPU; the channel carries only their heads and immediates (ChannelOptions::bulkOverFabric).
    constexpr size_t kHost = 64;
    std::vector<char> names(kHost * c.worldSize, 0);
    char mine[kHost] = {0};
    gethostname(mine, kHost - 1);
    bootstrap.allGather(mine, names.data(), kHost);
    std::vector<std::string> hosts(c.worldSize);
    for (uint32_t r = 0; r < c.worldSize; ++r)
      hosts[r].assign(names.data() + r * kHost, strnlen(names.data() + r * kHost, kHost));
    std::string note;
    localSize = chooseLocalSize(envInt("EPCOMM_PROXY_LOCAL_SIZE"), hosts, &note);
    // Both ends of a pair must take the same path (a rank could have another EPCOMM_PROXY_LOCAL_SIZE).
    checkSettingsAgree(
        bootstrap, "proxy backend",
        {{"ranks per node (EPCOMM_PROXY_LOCAL_SIZE, or counted from the host names)", std::to_string(localSize)}});
    if (!note.empty()) EPCOMM_LOG(kInfo, "proxy backend: " << note);

    proxy::ChannelOptions opts = options;
    if (localSize > 1) {
      const uint32_t first = c.rank / localSize * localSize;
      opts.bulkOverFabric.assign(c.worldSize, true);
      for (uint32_t r = first; r < first + localSize; ++r) opts.bulkOverFabric[r] = false;
    }
    opts.externalDriver = true;
    opts.fixedCombineSend = true;
    opts.onBuffer = [this](uint8_t* data, uint64_t bytes) {
      // Pinned and mapped before the engine registers it and before any peer can write into it.
      EPCOMM_CHECK_CUDA(cudaHostRegister(data, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
      pinned.push_back(data);
    };
    const bool tracing = envInt("EPCOMM_PROXY_TRACE") != 0;
    if (tracing) {
      opts.onPosted = [this](proxy::Phase phase) {
        TraceRound& r = trace[traceRound % kTraceRounds];
        (phase == proxy::Phase::kHead ? r.proxyPosted : r.combPosted) = hostNowNs();
      };
      opts.onPosting = [this](proxy::Phase phase) {
        TraceRound& r = trace[traceRound % kTraceRounds];
        (phase == proxy::Phase::kHead ? r.proxyPosting : r.combPosting) = hostNowNs();
      };
    }
    // Elastic ranks (EPCOMM_ELASTIC=1, as the host backend): a peer lost mid-round is masked once the others agree.
    if (opts.elastic < 0) opts.elastic = envInt("EPCOMM_ELASTIC") != 0 ? 1 : 0;
    channel = std::make_unique<proxy::ProxyChannel>(config, bootstrap, opts);
    // Every rank agreed on elastic (the channel checks it) and on the ranks per node: all refuse here together.
    EPCOMM_CHECK(!channel->elastic() || localSize <= 1, kUnavailable,
                 "proxy backend: elastic ranks (EPCOMM_ELASTIC=1) need every peer over the fabric, but "
                     << localSize
                     << " ranks per node exchange entries and combine rows over NVLink (CUDA IPC), whose kernels "
                        "wait for every node peer and cannot skip a masked one; set EPCOMM_PROXY_LOCAL_SIZE=1 or "
                        "leave EPCOMM_ELASTIC unset (docs/proxy.md, \"Elastic ranks\")");
    sizes = channel->sizes();
    tg = tableGeometry(sizes);
    lg = localGeometry(sizes, localSize, c.rank);
    sg = scratchGeometry(sizes, config.maxNumTokens, lg.size);
    EPCOMM_CHECK(sizes.combineSendRows < (1ull << 31) && sizes.combineRecvRows < (1ull << 31) &&
                     config.totalExpertRows() < (1ull << 31),
                 kInvalidConfig, "proxy backend: row counts of " << config.toString() << " exceed 32 bits");

    auto mapped = [](void* host) {
      void* dev = nullptr;
      EPCOMM_CHECK_CUDA(cudaHostGetDevicePointer(&dev, host, 0));
      return static_cast<uint8_t*>(dev);
    };
    view.send = mapped(channel->sendSlot(0));
    view.recv = mapped(const_cast<uint8_t*>(channel->recvBuffer()));
    view.combineSend = mapped(channel->combineSendBuffer());
    view.combineRecv = mapped(const_cast<uint8_t*>(channel->combineRecvBuffer()));
    EPCOMM_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&mailbox), sizeof(Mailbox),
                                    cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(static_cast<void*>(mailbox), 0, sizeof(Mailbox));
    mailboxDev = reinterpret_cast<Mailbox*>(mapped(mailbox));
    EPCOMM_CHECK_CUDA(
        cudaHostAlloc(reinterpret_cast<void**>(&tables), tableBytes(tg), cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(tables, 0, tableBytes(tg));
    view.tables = reinterpret_cast<const uint32_t*>(mapped(tables));
    if (tracing) {
      EPCOMM_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&trace), sizeof(TraceRound) * kTraceRounds,
                                      cudaHostAllocMapped | cudaHostAllocPortable));
      std::memset(static_cast<void*>(trace), 0, sizeof(TraceRound) * kTraceRounds);
      traceDev = reinterpret_cast<TraceRound*>(mapped(trace));
    }
    EPCOMM_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&scratch), sg.bytes));
    EPCOMM_CHECK_CUDA(cudaMemset(scratch, 0, sg.bytes));

    const uint64_t smem =
        std::max({combineRecvSharedBytes(sizes), combineSendSharedBytes(sizes), copySharedBytes(sizes)});
    if (smem > 48 * 1024) {
      int smemMax = 0;
      EPCOMM_CHECK_CUDA(cudaDeviceGetAttribute(&smemMax, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
      EPCOMM_CHECK(smem <= static_cast<uint64_t>(smemMax), kInvalidConfig,
                   "proxy kernels would need " << smem << " bytes of shared memory for " << config.toString()
                                               << ", the device allows " << smemMax);
      const int rc = configureKernels(static_cast<uint32_t>(smem));
      EPCOMM_CHECK(rc == 0, kCuda,
                   "cudaFuncSetAttribute(max dynamic shared memory "
                       << smem << ") failed: " << cudaGetErrorString(static_cast<cudaError_t>(rc)));
    }

    // The memory path: a provider that registers GPU memory (FI_HMEM: efa, verbs with GPUDirect RDMA) could let the
    // NIC read and write GPU memory; tcp and shm (and Debian's libfabric, built without CUDA) cannot.
    bool gpuDirect = false;
    try {
      auto mr = channel->engine().registerMemory(scratch, sg.bytes, MemoryKind::kCuda, device);
      gpuDirect = mr != nullptr;
    } catch (const Error&) {
      gpuDirect = false;
    }
    path = "staging: the channel's buffers are pinned host memory mapped into the GPU (provider " +
           channel->providerName() +
           (gpuDirect ? " can register GPU memory (FI_HMEM); the GPU-direct path is not built, docs/proxy.md)"
                      : " registers no GPU memory)");
    if (lg.size > 0) {
      path += "; ranks " + std::to_string(lg.first) + " to " + std::to_string(lg.first + lg.size - 1) +
              " (this node) exchange entries and combine rows over NVLink (CUDA IPC), only heads and immediates over "
              "the fabric";
    }

    // The last collective step of the setup: a failure anywhere fails every rank here together.
    if (lg.size > 0) {
      local.open(lg, c.rank, device, bootstrap);
      EPCOMM_CHECK_CUDA(cudaMemcpy(scratch + sg.offLocal, local.regions().data(), sizeof(uint8_t*) * lg.size,
                                   cudaMemcpyHostToDevice));
    }

    if (tracing) {
      // Clock check for the phases that cross clocks: %globaltimer read between two host stamps, the shortest of
      // 64 round trips through host-mapped memory (a few us wide, where one launch and synchronize is ~1 ms).
      constexpr uint32_t kProbes = 64;
      uint64_t* cell = &trace[0].packStart;  // cell[0] = packStart, cell[1] = packReady: cleared below
      cell[0] = cell[1] = 0;
      const int rc = launchClockProbe(&traceDev[0].packStart, kProbes, nullptr);
      EPCOMM_CHECK(rc == 0, kCuda, "clock probe launch failed: " << cudaGetErrorString(static_cast<cudaError_t>(rc)));
      int64_t best = -1;
      for (uint32_t i = 0; i < kProbes; ++i) {
        const uint64_t t0 = hostNowNs();
        __atomic_store_n(&cell[0], 2ull * i + 1, __ATOMIC_RELEASE);
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
        bool answered = true;
        while (__atomic_load_n(&cell[0], __ATOMIC_ACQUIRE) != 2ull * i + 2) {
          if (std::chrono::steady_clock::now() > deadline) {
            answered = false;
            break;
          }
        }
        if (!answered) break;
        const uint64_t t1 = hostNowNs();
        const uint64_t g = __atomic_load_n(&cell[1], __ATOMIC_ACQUIRE);
        if (best < 0 || static_cast<int64_t>(t1 - t0) < best) {
          best = static_cast<int64_t>(t1 - t0);
          clockLo = static_cast<int64_t>(g - t1);
          clockHi = static_cast<int64_t>(g - t0);
        }
      }
      EPCOMM_CHECK_CUDA(cudaDeviceSynchronize());
      cell[0] = cell[1] = 0;
      if (best < 0) clockLo = clockHi = 0;  // the probe never answered: the cross-clock rows stay raw
    }
    EPCOMM_CHECK_CUDA(cudaDeviceSynchronize());
    startProxy();
    EPCOMM_LOG(kInfo, "proxy backend: device " << device << ", " << blocks << " blocks, provider "
                                               << channel->providerName() << ", " << path << ", local size "
                                               << localSize << ", " << config.toString());
  } catch (...) {
    release();
    throw;
  }
}

void ProxyAllToAll::Impl::release() {
  if (device >= 0) {
    cudaSetDevice(device);
    // Kernels still queued are served by the proxy thread (or give up after their bounded waits).
    cudaDeviceSynchronize();
  }
  stop = true;
  if (channel) channel->requestStop();
  if (thread.joinable()) thread.join();
  // After the device synchronisation above: no kernel of this rank stores into a node peer's region any more.
  local.close(*boot);
  if (trace != nullptr && roundsServed.load() > 0) {
    std::fputs(traceSummary(trace, roundsServed.load(), static_cast<int>(config.rank), clockLo, clockHi).c_str(),
               stderr);
    const std::string dump = envString("EPCOMM_PROXY_TRACE_FILE");
    if (!dump.empty()) {
      const std::string failed =
          traceDump(dump, trace, roundsServed.load(), static_cast<int>(config.rank), clockLo, clockHi);
      if (!failed.empty()) std::fprintf(stderr, "%s\n", failed.c_str());
    }
  }
  for (void* p : pinned) cudaHostUnregister(p);
  pinned.clear();
  channel.reset();
  if (mailbox != nullptr) cudaFreeHost(mailbox);
  if (tables != nullptr) cudaFreeHost(tables);
  if (trace != nullptr) cudaFreeHost(trace);
  if (scratch != nullptr) cudaFree(scratch);
  mailbox = nullptr;
  tables = nullptr;
  trace = nullptr;
  scratch = nullptr;
  cudaGetLastError();
}

// Idle wait for the device's next flag: unbounded (the caller decides when the next round comes), ends on
// destruction. NOTE: it spins (pause) for 2 ms after the last activity, then yields until 50 ms, then sleeps 50 us
// per poll: a decode loop's rounds follow each other within the spin, so the proxy's reaction is a few polls of a
// host cache line; an idle object costs no core.
bool ProxyAllToAll::Impl::waitDevice(const uint64_t* word, uint64_t want, uint64_t step) {
  const auto start = std::chrono::steady_clock::now();
  for (uint32_t i = 0;; ++i) {
    if (loadAcquire(word) >= want) {
      // The step's call was made again with good arguments before its refusal went out: nothing to tell.
      if (refusalPending.load(std::memory_order_acquire)) {
        std::lock_guard<std::mutex> lock(mu);
        if (refusalStep <= step) refusalPending = false;
      }
      return true;
    }
    if (stop.load(std::memory_order_relaxed) || pause.load(std::memory_order_relaxed)) return false;
    if ((i & 255) != 255) {
      cpuRelax();
      continue;
    }
    if (refusalPending.load(std::memory_order_acquire)) sendRefusal(step);
    if (failurePending.load(std::memory_order_acquire)) sendFailure();
    const auto idle = std::chrono::steady_clock::now() - start;
    if (idle < std::chrono::milliseconds(2)) continue;
    if (idle < std::chrono::milliseconds(50)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

void ProxyAllToAll::Impl::refused(bool doSend, bool combine, const Error& e) {
  if (!doSend || config.worldSize == 1) return;
  std::lock_guard<std::mutex> lock(mu);
  refusalStep = combine ? 2 * (dispatchSends > 0 ? dispatchSends - 1 : 0) + 1 : 2 * dispatchSends;
  refusalMessage = e.message();
  refusalPending = true;
}

void ProxyAllToAll::Impl::sendRefusal(uint64_t step) {
  std::string message;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!refusalPending.load() || refusalStep != step) return;  // a later step's: the proxy thread is not there yet
    refusalPending = false;
    message.swap(refusalMessage);
  }
  // On the exchanging thread, between exchanges: the channel's round is this step's. The peers' exchanges of the step
  // end at once with the message (their kernels cannot wait on for a repeat: their objects are lost).
  channel->noticeRefused(step % 2 == 1, message);
}

void ProxyAllToAll::Impl::sendFailure() {
  std::string message;
  {
    std::lock_guard<std::mutex> lock(mu);
    failurePending = false;
    message.swap(failureMessage);
  }
  channel->noticeAbandoned("its object failed: " + message);
}

template <typename Exchange>
bool ProxyAllToAll::Impl::exchangeOrLose(Exchange exchange) {
  try {
    exchange();
    return true;
  } catch (const Error&) {
    if (!channel->takeLostRound()) throw;
    {
      std::lock_guard<std::mutex> lock(mu);
      lostRound = std::current_exception();
    }
    __atomic_store_n(&mailbox->abort, 1, __ATOMIC_RELEASE);
    return false;
  }
}

void ProxyAllToAll::Impl::proxyLoop() {
  uint64_t& round = proxyRound;
  try {
    for (;;) {
      traceRound = round;
      if (!waitDevice(&mailbox->dispatchReady, round + 1, 2 * round)) return;
      if (trace != nullptr) trace[round % kTraceRounds].proxySeen = hostNowNs();
      if (!exchangeOrLose([&] { channel->exchangeDispatch(); })) return;
      writeTables(channel->layout(), tg, config.rank, lg.size > 0, tables);
      if (trace != nullptr) trace[round % kTraceRounds].proxyArrived = hostNowNs();
      storeRelease(&mailbox->dispatchArrived, round + 1);
      if (!waitDevice(&mailbox->combineReady, round + 1, 2 * round + 1)) return;
      if (trace != nullptr) trace[round % kTraceRounds].combSeen = hostNowNs();
      const int32_t type = __atomic_load_n(&mailbox->combineType, __ATOMIC_ACQUIRE);
      if (!exchangeOrLose([&] { channel->exchangeCombine(combineDtype(type)); })) return;
      if (trace != nullptr) trace[round % kTraceRounds].combArrived = hostNowNs();
      storeRelease(&mailbox->combineArrived, round + 1);
      ++round;
      roundsServed.fetch_add(1);
    }
  } catch (...) {
    // Never let an exception escape the thread: the next call on the object rethrows it; the kernels waiting for
    // this thread stop at once.
    {
      std::lock_guard<std::mutex> lock(mu);
      proxyError = std::current_exception();
    }
    __atomic_store_n(&mailbox->abort, 1, __ATOMIC_RELEASE);
  }
}

void ProxyAllToAll::Impl::checkUsable() {
  if (failed.empty()) {
    std::exception_ptr lost;
    {
      std::lock_guard<std::mutex> lock(mu);
      lost.swap(lostRound);
    }
    if (lost) recoverFromLoss(lost);
    std::exception_ptr err;
    {
      std::lock_guard<std::mutex> lock(mu);
      err = proxyError;
    }
    if (err) {
      try {
        std::rethrow_exception(err);
      } catch (const Error& e) {
        failedCode = e.code();
        failed = "proxy backend rank " + std::to_string(config.rank) + ": " + e.message();
      } catch (const std::exception& e) {
        failedCode = ErrorCode::kInternal;
        failed =
            std::string("proxy backend rank ") + std::to_string(config.rank) + ": proxy thread failed: " + e.what();
      }
    }
  }
  if (failed.empty()) {
    const volatile ErrorRecord* r = &mailbox->error;
    const int32_t code = r->code;
    if (code == 0) return;
    std::atomic_thread_fence(std::memory_order_acquire);
    std::ostringstream oss;
    oss << "proxy backend rank " << r->rank << ": ";
    switch (code) {
      case kPhaseBadIndex:
      case kPhaseCombineBadIndex:
        failedCode = ErrorCode::kDeviceError;
        oss << "expert index " << static_cast<int32_t>(r->b & 0xffffffff) << " at token " << r->a << ", position "
            << (r->b >> 32) << " is outside [-1, " << config.numExperts << ") (phase " << kernelPhaseName(code)
            << "); the entry was skipped";
        break;
      case kPhaseCombineIndex:
        failedCode = ErrorCode::kInvalidArgument;
        oss << "token " << r->a << " position " << (r->b >> 32) << " names expert " << (r->b & 0xffffffff)
            << ", which that token was not dispatched to (phase " << kernelPhaseName(code)
            << "): combine must use the indices and boundM that were dispatched";
        break;
      case kPhaseLocalDispatch:
      case kPhaseLocalCombine:
        failedCode = ErrorCode::kTimeout;
        oss << "timed out after " << 2 * kernelWaitMs() << " ms in phase " << kernelPhaseName(code)
            << " waiting for rank " << r->peer << " (round " << r->b << ", its flag says " << r->a
            << "; the proxy thread reported no error)";
        break;
      case kPhaseCorruptEntry:
        failedCode = ErrorCode::kInternal;
        oss << "corrupt receive buffer: sender rank " << r->peer << ", entry or expert " << r->a << ", value " << r->b
            << " (phase " << kernelPhaseName(code) << ")";
        break;
      default:
        failedCode = ErrorCode::kTimeout;
        oss << "timed out after " << 2 * kernelWaitMs() << " ms in phase " << kernelPhaseName(code) << " (round "
            << r->b << ", announced " << r->a << "; the proxy thread reported no error)";
        break;
    }
    failed = oss.str();
    if (config.worldSize > 1) {
      std::lock_guard<std::mutex> lock(mu);
      failureMessage = failed;
      failurePending = true;
    }
  }
  detail::throwError(failedCode, failed + " [this AllToAll object is unusable]", __FILE__, __LINE__);
}

void ProxyAllToAll::Impl::launched(int rc, void* stream, const char* what) {
  checkLaunch(rc, "proxy backend ", config.rank, what);
  marks.markLaunch(static_cast<cudaStream_t>(stream), "proxy backend ", config.rank, what);
}

KernelContext ProxyAllToAll::Impl::context() const {
  KernelContext ctx;
  ctx.sizes = sizes;
  ctx.tg = tg;
  ctx.st = DeviceState{};
  ctx.st.scratch = scratch;
  ctx.st.mailbox = mailboxDev;
  ctx.st.trace = traceDev;
  ctx.st.timeoutNs = static_cast<uint64_t>(kernelWaitMs()) * 1000000ull;
  ctx.st.sg = sg;
  ctx.st.lg = lg;
  ctx.st.localMine = local.mine();
  ctx.st.local = lg.size > 0 ? reinterpret_cast<uint8_t* const*>(scratch + sg.offLocal) : nullptr;
  ctx.ch = view;
  ctx.maxNumTokens = config.maxNumTokens;
  ctx.hidden = config.hiddenDim;
  return ctx;
}

ProxyAllToAll::ProxyAllToAll(const Config& config, Bootstrap& bootstrap, const proxy::ChannelOptions& options)
    : impl_(std::make_unique<Impl>(config, bootstrap, options)) {}

ProxyAllToAll::~ProxyAllToAll() = default;

void ProxyAllToAll::dispatch(const DispatchArgs& a) {
  Impl& m = *impl_;
  m.checkUsable();
  // A call out of order tells no peer: they are not waiting for it (its step is not theirs).
  m.order.checkDispatch(a.doSend, a.doRecv);
  CheckedDispatch c;
  try {
    c = checkDispatchArgs(m.config, a, MemoryKind::kCuda, m.device);
  } catch (const Error& e) {
    m.refused(a.doSend, false, e);
    throw;
  }
  checkCurrentDevice(m.device, m.config.rank, "proxy backend ");
  if (a.doSend) {
    const int rc = launchDispatchSend(dispatchSendArgs(m.context(), a, c), m.blocks, a.stream);
    m.launched(rc, a.stream, "dispatch send");
    ++m.dispatchSends;
  }
  if (a.doRecv) {
    const int rc = launchDispatchRecv(dispatchRecvArgs(m.context(), a, c), m.blocks, a.stream);
    m.launched(rc, a.stream, "dispatch receive");
  }
  m.order.dispatched(a.doSend, a.doRecv);
}

void ProxyAllToAll::combine(const CombineArgs& a) {
  Impl& m = *impl_;
  m.checkUsable();
  m.order.checkCombine(a.doSend, a.doRecv);
  CheckedCombine c;
  try {
    c = checkCombineArgs(m.config, a, MemoryKind::kCuda, m.device);
  } catch (const Error& e) {
    m.refused(a.doSend, true, e);
    throw;
  }
  checkCurrentDevice(m.device, m.config.rank, "proxy backend ");
  if (a.doSend) {
    const CombineSendArgs k = combineSendArgs(m.context(), a, c);
    const int rc = launchCombineSend(k, m.blocks, a.stream);
    m.launched(rc, a.stream, "combine send");
    m.combineSendType = k.yType;
  }
  if (a.doRecv) {
    const int rc = launchCombineRecv(combineRecvArgs(m.context(), a, c, m.combineSendType), m.blocks, a.stream);
    m.launched(rc, a.stream, "combine receive");
  }
  m.order.combined(a.doSend, a.doRecv);
}

// Waits for the streams this object launched on, up to its last launch on each (LaunchMarks), not for the device.
void ProxyAllToAll::synchronize() {
  impl_->checkUsable();
  const cudaError_t e = impl_->marks.wait();
  EPCOMM_CHECK(e == cudaSuccess, kCuda,
               "proxy backend rank " << impl_->config.rank << ": kernels failed: " << cudaGetErrorString(e) << " ("
                                     << static_cast<int>(e) << ")");
  impl_->checkUsable();
}

const Config& ProxyAllToAll::config() const { return impl_->config; }

uint64_t ProxyAllToAll::bufferBytes() const {
  const Impl& m = *impl_;
  return m.channel->bufferBytes() + sizeof(Mailbox) + tableBytes(m.tg) + m.sg.bytes + m.lg.bytes +
         (m.trace != nullptr ? sizeof(TraceRound) * kTraceRounds : 0);
}

proxy::ChannelStats ProxyAllToAll::stats() const { return impl_->channel->stats(); }
const proxy::ProtocolSizes& ProxyAllToAll::sizes() const { return impl_->sizes; }
std::string ProxyAllToAll::providerName() const { return impl_->channel->providerName(); }
const std::string& ProxyAllToAll::memoryPath() const { return impl_->path; }

}  // namespace gpuproxy

namespace backends {

bool proxyUsable(std::string* whyNot) {
  if (!cudaDeviceSeen(whyNot)) return false;
  try {
    if (!fabric::TransferEngine::probe().empty()) return true;
    if (whyNot != nullptr) *whyNot = "no libfabric provider is usable on this machine (probe found none)";
  } catch (const Error& err) {
    if (whyNot != nullptr) *whyNot = std::string("TransferEngine probe failed: ") + err.message();
  }
  return false;
}

std::unique_ptr<AllToAll> createProxy(const Config& config, Bootstrap& bootstrap) {
  return std::make_unique<gpuproxy::ProxyAllToAll>(config, bootstrap);
}

}  // namespace backends
}  // namespace epcomm
