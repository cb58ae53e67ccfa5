#include "backends/host/host_all_to_all.hpp"

#include <vector>

#include "backends/backends.hpp"
#include "backends/host/host_kernels.hpp"
#include "core/env.hpp"
#include "core/routing_digest.hpp"
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
  HostOptions opts = options;
  if (opts.elastic < 0) opts.elastic = envInt("EPCOMM_ELASTIC") != 0 ? 1 : 0;
  channel_ = std::make_unique<proxy::ProxyChannel>(config_, bootstrap, opts);
}

HostAllToAll::~HostAllToAll() {
  // Peers that may still wait for this rank (a round in progress, a refused send half) learn at once that it left.
  if (order_.state() != CallOrder::State::kIdle || refusedSend_) {
    // A peer keeps the latest notice of this rank only: a refusal's message travels on in this one.
    channel_->noticeAbandoned(refusedSend_ ? "it destroyed its object after refusing " + refusedMessage_
                                           : std::string("it destroyed its object while '") +
                                                 CallOrder::name(order_.state()) + "'");
  }
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
  order_.checkDispatch(args.doSend, args.doRecv);
  const proxy::ProtocolSizes& s = channel_->sizes();
  CheckedDispatch checked;
  try {
    checked = checkDispatchArgs(config_, args, MemoryKind::kHost, -1, /*appliesCast=*/true);
    if (args.doSend) {
      // Everything that can refuse the call runs before anything is posted: a refused call sends nothing.
      std::vector<uint8_t*> slots(s.worldSize);
      for (uint32_t p = 0; p < s.worldSize; ++p) slots[p] = channel_->sendSlot(p);
      const uint32_t bound = boundOf(args.boundM, checked.m, "dispatch");
      DispatchSendParams params{&s, &args, checked, bound, slots.data(), config_.dispatchCast};
      const std::vector<uint8_t> active = channel_->activeRanks();  // elastic ranks: masked slots are not packed
      params.active = active.data();
      dispatchSendKernel(params);
      routingDigest_ = routingDigestOf(args.indices.data, checked.indexKind, checked.indexStrides[0],
                                       checked.indexStrides[1], config_.expertsPerToken, bound);
      routingBound_ = bound;
    }
  } catch (const Error& e) {
    if (args.doSend) {
      refusedSend_ = true;
      refusedMessage_ = "dispatch: " + e.message();
      channel_->noticeRefused(false, e.message());
    }
    throw;
  }
  if (args.doSend) {
    channel_->postDispatch();
    refusedSend_ = false;
    order_.dispatched(true, false);
  }
  if (args.doRecv) {
    try {
      channel_->waitDispatch();
    } catch (const Error&) {
      afterFailedWait();
      throw;
    }
    DispatchRecvParams params{&s,      &channel_->layout(),    &args,
                              checked, channel_->recvBuffer(), channel_->sendSlot(config_.rank)};
    dispatchRecvKernel(params);
    order_.dispatched(false, true);
  }
}

void HostAllToAll::checkSameRouting(const CombineArgs& args, const CheckedCombine& checked, uint32_t bound) const {
  const uint32_t K = config_.expertsPerToken, E = config_.numExperts;
  const uint64_t digest =
      routingDigestOf(args.indices.data, checked.indexKind, checked.indexStrides[0], checked.indexStrides[1], K, bound);
  if (digest == routingDigest_) return;
  // Name what differs where it can be named without the dispatched indices: an index out of range, boundM.
  for (uint32_t t = 0; t < bound; ++t) {
    for (uint32_t k = 0; k < K; ++k) {
      const int64_t e =
          decodeIndex(args.indices.data, checked.indexKind, t * checked.indexStrides[0] + k * checked.indexStrides[1]);
      EPCOMM_CHECK(e >= -1 && e < static_cast<int64_t>(E), kInvalidArgument,
                   "rank " << config_.rank << " token " << t << " position k=" << k << " has expert index " << e
                           << ", outside [0, " << E << ") and not -1");
    }
  }
  EPCOMM_CHECK(bound == routingBound_, kInvalidArgument,
               "host backend rank " << config_.rank << " combine: boundM = " << bound << " but the dispatch had "
                                    << routingBound_ << " (combine must use the routing that was dispatched)");
  EPCOMM_THROW(kInvalidArgument, "host backend rank "
                                     << config_.rank
                                     << " combine: indices differ from the dispatched ones (routing digest); combine "
                                        "must use the indices that were dispatched");
}

void HostAllToAll::combine(const CombineArgs& args) {
  channel_->rethrowIfBroken();
  order_.checkCombine(args.doSend, args.doRecv);
  const proxy::ProtocolSizes& s = channel_->sizes();
  CheckedCombine checked;
  uint32_t bound = 0;
  try {
    checked = checkCombineArgs(config_, args, MemoryKind::kHost, -1);
    if (args.doRecv) {
      bound = boundOf(args.boundM, checked.m, "combine");
      checkSameRouting(args, checked, bound);
    }
    if (args.doSend) {
      const uint64_t rowBytes = static_cast<uint64_t>(config_.hiddenDim) * dtypeSize(args.expertY.dtype);
      CombineSendParams params{&s, &channel_->layout(), &args, checked, channel_->combineSendBufferFor(rowBytes)};
      combineSendKernel(params);
    }
  } catch (const Error& e) {
    if (args.doSend) {
      refusedSend_ = true;
      refusedMessage_ = "combine: " + e.message();
      channel_->noticeRefused(true, e.message());
    }
    throw;
  }
  if (args.doSend) {
    yDtype_ = args.expertY.dtype;
    channel_->postCombine(yDtype_);
    refusedSend_ = false;
    order_.combined(true, false);
  }
  if (args.doRecv) {
    try {
      channel_->waitCombine();
    } catch (const Error&) {
      afterFailedWait();
      throw;
    }
    CombineRecvParams params{&s,
                             &channel_->layout(),
                             &args,
                             checked,
                             bound,
                             yDtype_,
                             channel_->combineSendBuffer(),
                             channel_->combineRecvBuffer()};
    params.dropped = &droppedTokens_;
    combineRecvKernel(params);
    order_.combined(false, true);
  }
}

void HostAllToAll::afterFailedWait() {
  if (!channel_->takeLostRound()) return;
  order_.reset();
  refusedSend_ = false;
}

std::vector<int32_t> HostAllToAll::activeRanks() const {
  const std::vector<uint8_t> mask = channel_->activeRanks();
  return std::vector<int32_t>(mask.begin(), mask.end());
}

void HostAllToAll::setActiveRanks(const std::vector<int32_t>& mask) {
  channel_->rethrowIfBroken();
  EPCOMM_CHECK(order_.state() == CallOrder::State::kIdle, kInvalidArgument,
               "host backend rank " << config_.rank << ": setActiveRanks while the object is '"
                                    << CallOrder::name(order_.state()) << "' (call it between rounds)");
  std::vector<uint8_t> m(mask.size());
  for (size_t r = 0; r < mask.size(); ++r) {
    EPCOMM_CHECK(mask[r] == 0 || mask[r] == 1, kInvalidArgument,
                 "setActiveRanks: entry " << r << " is " << mask[r] << " (1 = active, 0 = masked)");
    m[r] = static_cast<uint8_t>(mask[r]);
  }
  channel_->setActiveRanks(m);
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
