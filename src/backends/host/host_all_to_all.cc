#include "backends/host/host_all_to_all.hpp"

#include <vector>

#include "backends/backends.hpp"
#include "backends/host/host_kernels.hpp"
#include "epcomm/error.hpp"
#include "epcomm/fabric/transfer_engine.hpp"

namespace epcomm {
namespace host {

HostAllToAll::HostAllToAll(const Config& config, Bootstrap& bootstrap, const HostOptions& options)
    : config_(config), order_("host", config.rank, true) {
  config_.validate();
  EPCOMM_CHECK(
      static_cast<int>(config.worldSize) == bootstrap.worldSize() && static_cast<int>(config.rank) == bootstrap.rank(),
      kInvalidArgument,
      "host backend: config says rank " << config.rank << " of " << config.worldSize << ", the bootstrap "
                                        << bootstrap.rank() << " of " << bootstrap.worldSize());
  channel_ = std::make_unique<proxy::ProxyChannel>(config_, bootstrap, options);
}

HostAllToAll::~HostAllToAll() = default;

uint32_t HostAllToAll::boundOf(const int32_t* boundM, uint32_t m, const char* op) const {
  if (boundM == nullptr) return m;
  EPCOMM_CHECK(
      *boundM >= 0 && static_cast<uint32_t>(*boundM) <= m, kInvalidArgument,
      "host backend rank " << config_.rank << " " << op << ": boundM = " << *boundM << " outside [0, m = " << m << "]");
  return static_cast<uint32_t>(*boundM);
}

void HostAllToAll::dispatch(const DispatchArgs& args) {
  channel_->rethrowIfBroken();
  const CheckedDispatch checked = checkDispatchArgs(config_, args, MemoryKind::kHost, -1);
  const proxy::ProtocolSizes& s = channel_->sizes();
  order_.checkDispatch(args.doSend, args.doRecv);
  if (args.doSend) {
    std::vector<uint8_t*> slots(s.worldSize);
    for (uint32_t p = 0; p < s.worldSize; ++p) slots[p] = channel_->sendSlot(p);
    DispatchSendParams params{&s, &args, checked, boundOf(args.boundM, checked.m, "dispatch"), slots.data()};
    dispatchSendKernel(params);
    channel_->postDispatch();
    order_.dispatched(true, false);
  }
  if (args.doRecv) {
    channel_->waitDispatch();
    DispatchRecvParams params{&s,      &channel_->layout(),    &args,
                              checked, channel_->recvBuffer(), channel_->sendSlot(config_.rank)};
    dispatchRecvKernel(params);
    order_.dispatched(false, true);
  }
}

void HostAllToAll::combine(const CombineArgs& args) {
  channel_->rethrowIfBroken();
  const CheckedCombine checked = checkCombineArgs(config_, args, MemoryKind::kHost, -1);
  const proxy::ProtocolSizes& s = channel_->sizes();
  order_.checkCombine(args.doSend, args.doRecv);
  if (args.doSend) {
    const uint64_t rowBytes = static_cast<uint64_t>(config_.hiddenDim) * dtypeSize(args.expertY.dtype);
    CombineSendParams params{&s, &channel_->layout(), &args, checked, channel_->combineSendBufferFor(rowBytes)};
    combineSendKernel(params);
    yDtype_ = args.expertY.dtype;
    channel_->postCombine(yDtype_);
    order_.combined(true, false);
  }
  if (args.doRecv) {
    channel_->waitCombine();
    CombineRecvParams params{&s,
                             &channel_->layout(),
                             &args,
                             checked,
                             boundOf(args.boundM, checked.m, "combine"),
                             yDtype_,
                             channel_->combineSendBuffer(),
                             channel_->combineRecvBuffer()};
    combineRecvKernel(params);
    order_.combined(false, true);
  }
}

void HostAllToAll::synchronize() {
  // Every call either finished its work or left it to a receive half that waits; only a recorded error remains.
  channel_->rethrowIfBroken();
}

}  // namespace host

namespace backends {

bool hostUsable(std::string* whyNot) {
  try {
    if (!fabric::TransferEngine::probe().empty()) return true;
    if (whyNot) *whyNot = "no libfabric provider is usable on this machine (probe found none)";
  } catch (const Error& e) {
    if (whyNot) *whyNot = std::string("TransferEngine probe failed: ") + e.message();
  }
  return false;
}

std::unique_ptr<AllToAll> createHost(const Config& config, Bootstrap& bootstrap) {
  return std::make_unique<host::HostAllToAll>(config, bootstrap);
}

std::vector<PlannedBuffer> planHost(const Config& config) {
  const proxy::ProtocolSizes s = proxy::computeSizes(config, -1);
  const std::string W = std::to_string(s.worldSize);
  const std::string entry = std::to_string(s.entryBytes) + " B/entry";
  const std::string mem = "host (registered)";
  std::vector<PlannedBuffer> plan;
  plan.push_back({"host", "dispatch send", mem, s.sendBytes,
                  W + " slots x (head " + std::to_string(s.headBytes) + " B + " + std::to_string(s.maxSendTokens) +
                      " entries x " + entry + ")"});
  plan.push_back({"host", "dispatch receive", mem, s.recvBytes,
                  W + " private areas x " + std::to_string(s.privateTokens) + " tokens (EPCOMM_PRIVATE_TOKENS) + " +
                      std::to_string(s.overflowEntries) + " overflow entries"});
  plan.push_back({"host", "combine send", mem, s.combineSendBytes,
                  std::to_string(s.combineSendInitialRows) + " rows x " + std::to_string(config.hiddenDim) +
                      " x 2 B (expected G x T x K / W + 25% + 4, bf16); grows on demand up to " +
                      std::to_string(s.combineSendRows) +
                      " rows (G x T x min(K, L)) x fp32 = " + std::to_string(s.combineSendBytesMax) + " B"});
  plan.push_back({"host", "combine receive", mem, s.combineRecvBytes,
                  std::to_string(s.combineRecvRows) + " rows x " + std::to_string(s.combineRowBytesMax) +
                      " B (T x K, fp32 capacity)"});
  return plan;
}

}  // namespace backends
}  // namespace epcomm
