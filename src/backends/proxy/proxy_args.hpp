// Host-side glue of the proxy backend that needs no CUDA: the kernels' argument structs filled from a call's checked
// tensors, and the per-round tables the proxy thread writes from the channel's RoundLayout.
#pragma once

#include <cstdint>

#include "backends/proxy/proxy_kernels.hpp"
#include "core/validate.hpp"
#include "epcomm/all_to_all.hpp"

namespace epcomm {
namespace gpuproxy {

/// What every kernel of one object gets besides the call's tensors (device pointers).
struct KernelContext {
  proxy::ProtocolSizes sizes;
  TableGeometry tg;
  DeviceState st;
  ChannelView ch;
  uint32_t maxNumTokens = 0;
  uint32_t hidden = 0;
};

DispatchSendArgs dispatchSendArgs(const KernelContext& ctx, const DispatchArgs& a, const CheckedDispatch& c);
DispatchRecvArgs dispatchRecvArgs(const KernelContext& ctx, const DispatchArgs& a, const CheckedDispatch& c);
CombineSendArgs combineSendArgs(const KernelContext& ctx, const CombineArgs& a, const CheckedCombine& c);
/// `yType`: the CombineType of the expertY the send half packed.
CombineRecvArgs combineRecvArgs(const KernelContext& ctx, const CombineArgs& a, const CheckedCombine& c, int32_t yType);

/// Writes the tables of the round described by `layout` (this rank's view) into `tables` (tg.words u32, see
/// TableGeometry). `ownRowsInRegion`: the NVLink path is on, so this rank's own combine rows are in its region (at
/// the combine receive offsets), not in the scratch's own rows (ScratchGeometry::offOwnRows, from row 0). Throws
/// kInternal when the layout's combine offsets disagree with the pieces the kernels pack.
void writeTables(const proxy::RoundLayout& layout, const TableGeometry& tg, uint32_t rank, bool ownRowsInRegion,
                 uint32_t* tables);

}  // namespace gpuproxy
}  // namespace epcomm
