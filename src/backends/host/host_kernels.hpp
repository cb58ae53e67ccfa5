// The "device side" of the proxy protocol as CPU loops: the four steps the GPU proxy backend runs as kernels
// (count + pack, unpack, pack expert outputs, weighted sum). Each takes one argument struct of raw pointers and
// protocol sizes, like a kernel would; none of them touches the fabric.
#pragma once

#include <cstdint>

#include "core/validate.hpp"
#include "epcomm/all_to_all.hpp"
#include "proxy/protocol.hpp"

namespace epcomm {
namespace host {

/// Dispatch-send: range-check the indices of every token < boundM (each rank of a DP group checks the same
/// tokens, so all of them report a bad index), count this rank's tokens per expert and per destination rank, and
/// pack one entry per (token, destination rank) into the destination's send slot after the head. With a cast
/// (Config::dispatchCast) the entry's payload and scales are the token's bf16 row cast to fp8 (castFp8Row), once per
/// token.
struct DispatchSendParams {
  const proxy::ProtocolSizes* sizes;
  const DispatchArgs* args;
  CheckedDispatch checked;
  uint32_t boundM;
  /// sendSlots[p]: send slot of rank p (sizes->sendSlotBytes).
  uint8_t* const* sendSlots;
  DispatchCast cast = DispatchCast::kNone;
  /// Elastic ranks: W entries, 0 = masked (its entries are not packed; the counts still include them); null = all.
  const uint8_t* active = nullptr;
};
void dispatchSendKernel(const DispatchSendParams& p);

/// Dispatch-recv: copy every received entry to its rows of outExpertX / outExpertXScale (slot order: sender rank,
/// then token) and write outExpertNumTokens. Rows that receive no token are not written.
struct DispatchRecvParams {
  const proxy::ProtocolSizes* sizes;
  const proxy::RoundLayout* layout;
  const DispatchArgs* args;
  CheckedDispatch checked;
  const uint8_t* recvBuffer;   ///< The channel's receive buffer (other senders' entries).
  const uint8_t* ownSendSlot;  ///< This rank's send slot to itself (its own entries, read in place).
};
void dispatchRecvKernel(const DispatchRecvParams& p);

/// Combine-send: for every DP group g, copy the rows of g's senders, local expert major, from expertY into
/// the combine send buffer at layout->combineSendStart(g) (rowBytes = H * itemsize each).
struct CombineSendParams {
  const proxy::ProtocolSizes* sizes;
  const proxy::RoundLayout* layout;
  const CombineArgs* args;
  CheckedCombine checked;
  uint8_t* combineSendBuffer;  ///< The channel's combine send buffer.
};
void combineSendKernel(const CombineSendParams& p);

/// Combine-recv: outTokens[t] = (accumulate ? outTokens[t] : 0) + sum_k w[t,k] * y(t,k) in fp32, k ascending,
/// rounded once to the output dtype (the reference's order, so the result is bitwise equal), for t < boundM.
/// y(t,k) is found in owner p's rows from this rank's own indices; they must match what the DP
/// group dispatched (checked against the routing counts: kInvalidArgument otherwise). A position whose expert's rank
/// or whose token's sending rank the layout masks (elastic ranks) is left out and counted in *dropped.
struct CombineRecvParams {
  const proxy::ProtocolSizes* sizes;
  const proxy::RoundLayout* layout;
  const CombineArgs* args;
  CheckedCombine checked;
  uint32_t boundM;
  DType yDtype;
  const uint8_t* combineSendBuffer;  ///< Rows this rank sent its own group (read in place).
  const uint8_t* combineRecvBuffer;  ///< Rows from the other owners.
  uint64_t* dropped = nullptr;       ///< If given, incremented by the positions left out (masked ranks).
};
void combineRecvKernel(const CombineRecvParams& p);

}  // namespace host
}  // namespace epcomm
