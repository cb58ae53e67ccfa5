// The fields that every GPU backend's kernel arguments carry under the same names (nvlink, nvshmem, proxy), filled
// once here from a checked call: the backends' argument structs differ in what else they hold, not in these.
#pragma once

#include <cstdint>

#include "core/layout.hpp"
#include "core/validate.hpp"
#include "epcomm/all_to_all.hpp"

namespace epcomm {

/// The geometry fields that come straight from the config: ranks, experts, K, T, the slots per sender Ts = ceil(T / D)
/// and the dispatch's bytes per token. `G`: a backend's geometry with these members (uint32_t).
template <typename G>
void packConfigShape(G& g, const Config& c) {
  g.worldSize = c.worldSize;
  g.rank = c.rank;
  g.dpSize = c.dpSize;
  g.numExperts = c.numExperts;
  g.numLocalExperts = c.numLocalExperts();
  g.topK = c.expertsPerToken;
  g.maxTokens = c.maxNumTokens;
  g.slotsPerSender = static_cast<uint32_t>(ceilDiv(c.maxNumTokens, c.dpSize));
  g.hiddenDim = c.hiddenDim;
  g.hiddenBytes = c.hiddenDimBytes;
  g.scaleBytes = c.hiddenDimScaleBytes;
}

/// The routing of a dispatch send half or a combine receive half: indices with their kind and strides, the call's
/// tokens m and boundM. `K`: kernel arguments with members indices, indexKind, indexStrides[2], m and boundM.
template <typename K, typename Args, typename Checked>
void packRouting(K& k, const Args& a, const Checked& c) {
  k.indices = a.indices.data;
  k.indexKind = c.indexKind;
  k.indexStrides[0] = c.indexStrides[0];
  k.indexStrides[1] = c.indexStrides[1];
  k.m = c.m;
  k.boundM = a.boundM;
}

/// A dispatch send half: x and its row stride, xScale with its strides into `scaleStrides` (multiplied by
/// `scaleUnit`: 4 for bytes, 1 for 4-byte elements), and the routing.
template <typename K>
void packDispatchSend(K& k, const DispatchArgs& a, const CheckedDispatch& c, int64_t (&scaleStrides)[2],
                      int64_t scaleUnit) {
  k.x = static_cast<const uint8_t*>(a.x.data);
  k.xRowStrideBytes = c.xRowStrideBytes;
  k.xScale = static_cast<const uint8_t*>(a.xScale.data);
  scaleStrides[0] = c.scaleStrides[0] * scaleUnit;
  scaleStrides[1] = c.scaleStrides[1] * scaleUnit;
  packRouting(k, a, c);
}

/// A dispatch receive half: outExpertNumTokens, outExpertX and its strides, and outExpertXScale with its strides into
/// `scaleStrides` as [expert, row, column] (expert 0 for the packed layout), multiplied by `scaleUnit` as above.
template <typename K>
void packDispatchRecv(K& k, const DispatchArgs& a, const CheckedDispatch& c, Layout layout, int64_t (&scaleStrides)[3],
                      int64_t scaleUnit) {
  k.outNumTokens = static_cast<int32_t*>(a.outExpertNumTokens.data);
  k.outX = static_cast<uint8_t*>(a.outExpertX.data);
  k.outExpertStrideBytes = c.outExpertStrideBytes;
  k.outRowStrideBytes = c.outRowStrideBytes;
  k.outScale = static_cast<uint8_t*>(a.outExpertXScale.data);
  if (layout == Layout::kPacked) {
    scaleStrides[0] = 0;
    scaleStrides[1] = c.outScaleStrides[0] * scaleUnit;
    scaleStrides[2] = c.outScaleStrides[1] * scaleUnit;
  } else {
    for (int d = 0; d < 3; ++d) scaleStrides[d] = c.outScaleStrides[d] * scaleUnit;
  }
}

/// A combine receive half: outTokens and its row stride, the routing, and accumulate.
template <typename K>
void packCombineRecv(K& k, const CombineArgs& a, const CheckedCombine& c) {
  k.out = static_cast<uint8_t*>(a.outTokens.data);
  k.outRowStride = c.outRowStride;
  packRouting(k, a, c);
  k.accumulate = a.accumulate ? 1 : 0;
}

}  // namespace epcomm
