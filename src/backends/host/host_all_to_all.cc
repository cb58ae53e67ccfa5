#include "backends/host/host_all_to_all.hpp"

#include <vector>

#include "backends/backends.hpp"
#include "backends/host/host_kernels.hpp"
#include "epcomm/error.hpp"
#include "epcomm/fabric/transfer_engine.hpp"

namespace epcomm {
namespace host {

HostAllToAll::HostAllToAll(const Config& config, Bootstrap& bootstrap, const HostOptions& options) : config_(config) {
  config_.validate();
  EPCOMM_CHECK(
      static_cast<int>(config.worldSize) == bootstrap.worldSize() && static_cast<int>(config.rank) == bootstrap.rank(),
      kInvalidArgument,
      "host backend: config says rank " << config.rank << " of " << config.worldSize << ", the bootstrap "
                                        << bootstrap.rank() << " of " << bootstrap.worldSize());
  channel_ = std::make_unique<proxy::ProxyChannel>(config_, bootstrap, options);
}

HostAllToAll::~HostAllToAll() = default;

const char* HostAllToAll::stateName(State state) {
  switch (state) {
    case State::kIdle:
      return "idle";
    case State::kDispatchSent:
      return "dispatch sent, not received";
    case State::kDispatched:
      return "dispatched";
    case State::kCombineSent:
      return "combine sent, not received";
  }
  return "?";
}

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
  if (args.doSend) {
    EPCOMM_CHECK(state_ == State::kIdle || state_ == State::kDispatched, kInvalidArgument,
                 "host backend rank " << config_.rank << ": dispatch send while the object is '" << stateName(state_)
                                      << "' (dispatch and combine alternate; finish the receive half first)");
    std::vector<uint8_t*> slots(s.worldSize);
    for (uint32_t p = 0; p < s.worldSize; ++p) slots[p] = channel_->sendSlot(p);
    DispatchSendParams params{&s, &args, checked, boundOf(args.boundM, checked.m, "dispatch"), slots.data()};
    dispatchSendKernel(params);
    channel_->postDispatch();
    state_ = State::kDispatchSent;
  }
  if (args.doRecv) {
    EPCOMM_CHECK(state_ == State::kDispatchSent, kInvalidArgument,
                 "host backend rank " << config_.rank << ": dispatch receive while the object is '" << stateName(state_)
                                      << "' (call dispatch with doSend first)");
    channel_->waitDispatch();
    DispatchRecvParams params{&s,      &channel_->layout(),    &args,
                              checked, channel_->recvBuffer(), channel_->sendSlot(config_.rank)};
    dispatchRecvKernel(params);
    state_ = State::kDispatched;
  }
}

void HostAllToAll::combine(const CombineArgs& args) {
  channel_->rethrowIfBroken();
  const CheckedCombine checked = checkCombineArgs(config_, args, MemoryKind::kHost, -1);
  const proxy::ProtocolSizes& s = channel_->sizes();
  if (args.doSend) {
    EPCOMM_CHECK(state_ == State::kDispatched, kInvalidArgument,
                 "host backend rank " << config_.rank << ": combine send while the object is '" << stateName(state_)
                                      << "' (combine follows a completed dispatch)");
    const uint64_t rowBytes = static_cast<uint64_t>(config_.hiddenDim) * dtypeSize(args.expertY.dtype);
    CombineSendParams params{&s, &channel_->layout(), &args, checked, channel_->combineSendBufferFor(rowBytes)};
    combineSendKernel(params);
    yDtype_ = args.expertY.dtype;
    channel_->postCombine(yDtype_);
    state_ = State::kCombineSent;
  }
  if (args.doRecv) {
    EPCOMM_CHECK(state_ == State::kCombineSent, kInvalidArgument,
                 "host backend rank " << config_.rank << ": combine receive while the object is '" << stateName(state_)
                                      << "' (call combine with doSend first)");
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
    state_ = State::kIdle;
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
