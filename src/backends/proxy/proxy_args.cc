#include "backends/proxy/proxy_args.hpp"

#include <cstring>

#include "core/kernel_args.hpp"
#include "epcomm/error.hpp"

namespace epcomm {
namespace gpuproxy {

namespace {

// Zeroed (padding too), then the context's fields.
template <typename Args>
Args withContext(const KernelContext& ctx) {
  Args k;
  std::memset(static_cast<void*>(&k), 0, sizeof k);
  k.sizes = ctx.sizes;
  k.tg = ctx.tg;
  k.st = ctx.st;
  k.ch = ctx.ch;
  return k;
}

}  // namespace

DispatchSendArgs dispatchSendArgs(const KernelContext& ctx, const DispatchArgs& a, const CheckedDispatch& c) {
  DispatchSendArgs k = withContext<DispatchSendArgs>(ctx);
  packDispatchSend(k, a, c, k.xScaleStrides, 1);
  k.maxNumTokens = ctx.maxNumTokens;
  return k;
}

DispatchRecvArgs dispatchRecvArgs(const KernelContext& ctx, const DispatchArgs& a, const CheckedDispatch& c) {
  DispatchRecvArgs k = withContext<DispatchRecvArgs>(ctx);
  packDispatchRecv(k, a, c, ctx.sizes.layout, k.outScaleStrides, 1);
  return k;
}

CombineSendArgs combineSendArgs(const KernelContext& ctx, const CombineArgs& a, const CheckedCombine& c) {
  CombineSendArgs k = withContext<CombineSendArgs>(ctx);
  k.y = static_cast<const uint8_t*>(a.expertY.data);
  k.yExpertStride = c.yExpertStride;
  k.yRowStride = c.yRowStride;
  k.yType = combineType(a.expertY.dtype);
  k.itemBytes = static_cast<uint32_t>(dtypeSize(a.expertY.dtype));
  k.hidden = ctx.hidden;
  return k;
}

CombineRecvArgs combineRecvArgs(const KernelContext& ctx, const CombineArgs& a, const CheckedCombine& c,
                                int32_t yType) {
  CombineRecvArgs k = withContext<CombineRecvArgs>(ctx);
  k.hidden = ctx.hidden;
  k.yType = yType;
  k.outType = combineType(a.outTokens.dtype);
  packCombineRecv(k, a, c);
  k.weights = static_cast<const float*>(a.weights.data);
  k.weightStrides[0] = c.weightStrides[0];
  k.weightStrides[1] = c.weightStrides[1];
  return k;
}

void writeTables(const proxy::RoundLayout& lay, const TableGeometry& tg, uint32_t me, bool ownRowsInRegion,
                 uint32_t* t) {
  const uint32_t W = tg.W, L = tg.L, G = tg.G, D = tg.D, E = tg.E, g = me / D;
  uint32_t at = 0;
  for (uint32_t s = 0; s < W; ++s) {
    t[tg.offEntries + s] = lay.entries(s, me);
    t[tg.offEntryStart + s] = at;
    at += lay.entries(s, me);
    t[tg.offOverflowStart + s] = static_cast<uint32_t>(lay.overflowStart(s, me));
  }
  t[tg.offEntryStart + W] = at;
  for (uint32_t le = 0; le < L; ++le) {
    for (uint32_t s = 0; s <= W; ++s) {
      t[tg.offSlotOffset + le * (W + 1) + s] = static_cast<uint32_t>(lay.slotOffset(le, s));
    }
    t[tg.offOutputRowBase + le] = static_cast<uint32_t>(lay.outputRowBase(le));
    t[tg.offLocalRows + le] = static_cast<uint32_t>(lay.localExpertRows(le));
  }
  // Combine send pieces (g, le): the rows of group g's senders for local expert le, in (g, le) order, which is the
  // protocol's message to group g (expert-major) placed at combineSendStart(g).
  at = 0;
  for (uint32_t gg = 0; gg < G; ++gg) {
    EPCOMM_CHECK(at == lay.combineSendStart(gg), kInternal,
                 "proxy backend: combine send pieces of group " << gg << " start at row " << at << ", the layout says "
                                                                << lay.combineSendStart(gg));
    for (uint32_t le = 0; le < L; ++le) {
      t[tg.offSendCum + gg * L + le] = at;
      at += static_cast<uint32_t>(lay.slotOffset(le, (gg + 1) * D) - lay.slotOffset(le, gg * D));
    }
  }
  t[tg.offSendCum + G * L] = at;
  // Own rows: in the scratch's own rows from row 0, or (NVLink path) in this rank's region where a peer's would be.
  for (uint32_t p = 0; p < W; ++p) {
    t[tg.offRecvStart + p] = p == me && !ownRowsInRegion ? 0u : static_cast<uint32_t>(lay.combineRecvStart(p));
  }
  for (uint32_t gg = 0; gg < G; ++gg) t[tg.offSendDest + gg] = static_cast<uint32_t>(lay.combineRecvStartIn(gg, me));
  uint32_t numMasked = 0;
  for (uint32_t r = 0; r < W; ++r) {
    t[tg.offMasked + 1 + r] = lay.isActive(r) ? 0u : 1u;
    numMasked += lay.isActive(r) ? 0u : 1u;
  }
  t[tg.offMasked] = numMasked;
  for (uint32_t e = 0; e < E; ++e) {
    uint64_t base = lay.combineExpertStart(e);
    for (uint32_t d = 0; d < D; ++d) {
      t[tg.offRowBase + d * E + e] = static_cast<uint32_t>(base);
      base += lay.expertCount(g * D + d, e);
    }
  }
}

}  // namespace gpuproxy
}  // namespace epcomm
