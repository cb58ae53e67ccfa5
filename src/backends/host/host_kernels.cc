#include "backends/host/host_kernels.hpp"

#include <cstring>
#include <vector>

#include "core/dtype_convert.hpp"
#include "core/fp8_cast.hpp"
#include "core/layout.hpp"
#include "epcomm/error.hpp"

namespace epcomm {
namespace host {

namespace {

// Entry metadata (see ProtocolSizes): u32 token, u16 n, u16 localExpert[n].
struct EntryMeta {
  uint32_t token;
  uint16_t n;
};

inline const uint16_t* entryExperts(const uint8_t* meta) { return reinterpret_cast<const uint16_t*>(meta + 6); }

// Element access of the combine's float tensors, one type per dtype, so that the weighted sum is compiled once
// per (expertY, outTokens) dtype pair with no dtype switch inside the loops. `base` is a row, `i` an element.
struct Bf16Io {
  static float load(const uint8_t* base, size_t i) {
    return bitsFloat(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(base)[i]) << 16);
  }
  // floatToBf16 written as a select instead of a branch, so the loop vectorises; the same bits.
  static void store(uint8_t* base, size_t i, float v) {
    const uint32_t u = floatBits(v);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quietNan = (u >> 16) | 0x40u;
    reinterpret_cast<uint16_t*>(base)[i] = static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? quietNan : rounded);
  }
};
struct F32Io {
  static float load(const uint8_t* base, size_t i) { return reinterpret_cast<const float*>(base)[i]; }
  static void store(uint8_t* base, size_t i, float v) { reinterpret_cast<float*>(base)[i] = v; }
};
// fp16 and anything else: the generic conversions (fp16 has subnormals to decode; not on the hot path).
struct AnyIo {
  DType dtype;
  float load(const uint8_t* base, size_t i) const { return loadAsFloat(dtype, base, i); }
  void store(uint8_t* base, size_t i, float v) const { storeFromFloat(dtype, base, i, v); }
};

// Elements per block of the weighted sum: the fp32 accumulator of one block stays in L1 (registers for the
// vector loop) while the K rows stream through, and full blocks have a constant trip count, which GCC
// vectorises at -O2.
constexpr uint32_t kSumBlock = 64;

// out[h0 .. h0+n) = (accumulate ? out : 0) + sum_j w[j] * rows[j][h] for one block, j ascending: per element the
// reference's fp32 operations in the reference's order (separate multiply and add, -ffp-contract=off), so the
// vector lanes give the same bits as a scalar loop. kN > 0: n = kN at compile time.
template <uint32_t kN, class YIo, class OutIo>
inline void weightedSumBlock(const YIo& yIo, const OutIo& outIo, uint8_t* out, bool accumulate, const float* w,
                             const uint8_t* const* rows, uint32_t numTerms, size_t h0, size_t n) {
  if (kN > 0) n = kN;
  float acc[kSumBlock];
  if (accumulate) {
    for (size_t i = 0; i < n; ++i) acc[i] = outIo.load(out, h0 + i);
  } else {
    for (size_t i = 0; i < n; ++i) acc[i] = 0.0f;
  }
  for (uint32_t j = 0; j < numTerms; ++j) {
    const float wj = w[j];
    const uint8_t* y = rows[j];
    for (size_t i = 0; i < n; ++i) acc[i] += wj * yIo.load(y, h0 + i);
  }
  for (size_t i = 0; i < n; ++i) outIo.store(out, h0 + i, acc[i]);
}

// One output row: full blocks, then the tail.
template <class YIo, class OutIo>
void weightedSumRow(const YIo& yIo, const OutIo& outIo, uint8_t* out, bool accumulate, const float* w,
                    const uint8_t* const* rows, uint32_t numTerms, uint32_t H) {
  size_t h0 = 0;
  for (; h0 + kSumBlock <= H; h0 += kSumBlock) {
    weightedSumBlock<kSumBlock>(yIo, outIo, out, accumulate, w, rows, numTerms, h0, kSumBlock);
  }
  if (h0 < H) weightedSumBlock<0>(yIo, outIo, out, accumulate, w, rows, numTerms, h0, H - h0);
}

}  // namespace

void dispatchSendKernel(const DispatchSendParams& p) {
  const proxy::ProtocolSizes& s = *p.sizes;
  const DispatchArgs& a = *p.args;
  const uint32_t W = s.worldSize, E = s.numExperts, L = s.numLocalExperts, K = s.expertsPerToken, D = s.dpSize;
  const int kind = p.checked.indexKind;
  const int64_t is0 = p.checked.indexStrides[0], is1 = p.checked.indexStrides[1];
  auto load = [&](uint32_t t, uint32_t k) { return decodeIndex(a.indices.data, kind, t * is0 + k * is1); };

  for (uint32_t t = 0; t < p.boundM; ++t) {
    for (uint32_t k = 0; k < K; ++k) {
      const int64_t e = load(t, k);
      EPCOMM_CHECK(e >= -1 && e < static_cast<int64_t>(E), kInvalidArgument,
                   "rank " << s.rank << " token " << t << " position k=" << k << " has expert index " << e
                           << ", outside [0, " << E << ") and not -1");
    }
  }

  std::vector<uint32_t> expertCounts(E, 0), entryCounts(W, 0);
  // Per token: destination ranks in first-use order, and each one's local experts.
  std::vector<uint32_t> owners(K);
  std::vector<uint16_t> les(static_cast<size_t>(K) * K);
  std::vector<uint16_t> numLes(K);
  const uint32_t scaleCols = static_cast<uint32_t>(s.scaleBytes / 4);
  const char* x = static_cast<const char*>(a.x.data);
  const uint32_t* xs = static_cast<const uint32_t*>(a.xScale.data);
  for (uint32_t t = s.rank % D; t < p.boundM; t += D) {
    uint32_t numOwners = 0;
    for (uint32_t k = 0; k < K; ++k) {
      const int64_t e = load(t, k);
      if (e < 0 || isRepeatOfEarlier([&](uint32_t j) { return load(t, j); }, k, e)) continue;
      const uint32_t ue = static_cast<uint32_t>(e), owner = expertOwner(ue, L);
      ++expertCounts[ue];
      uint32_t o = 0;
      while (o < numOwners && owners[o] != owner) ++o;
      if (o == numOwners) {
        owners[numOwners++] = owner;
        numLes[o] = 0;
      }
      les[o * K + numLes[o]++] = static_cast<uint16_t>(ue % L);
    }
    const uint8_t* castEntry = nullptr;  // the token's first entry, which holds its cast payload and scales
    for (uint32_t o = 0; o < numOwners; ++o) {
      const uint32_t dst = owners[o];
      if (p.active != nullptr && !p.active[dst]) continue;  // a masked rank: its slot is never sent
      uint8_t* entry = p.sendSlots[dst] + s.headBytes + static_cast<uint64_t>(entryCounts[dst]++) * s.entryBytes;
      if (p.cast != DispatchCast::kNone) {
        // Cast once per token (the scales follow the payload in the entry), copied into its other entries.
        if (castEntry == nullptr) {
          castFp8Row(DType::kBf16, x + t * p.checked.xRowStrideBytes, static_cast<uint32_t>(s.payloadBytes),
                     castPow2(p.cast), entry, reinterpret_cast<float*>(entry + s.payloadBytes), 1);
          castEntry = entry;
        } else {
          std::memcpy(entry, castEntry, s.payloadBytes + 4ull * scaleCols);
        }
      } else {
        std::memcpy(entry, x + t * p.checked.xRowStrideBytes, s.payloadBytes);
      }
      if (scaleCols > 0 && p.cast == DispatchCast::kNone) {
        // Contiguous scale columns (the usual case): one copy instead of a strided load per scale.
        uint32_t* scales = reinterpret_cast<uint32_t*>(entry + s.payloadBytes);
        const uint32_t* srcScales = xs + t * p.checked.scaleStrides[0];
        if (p.checked.scaleStrides[1] == 1) {
          std::memcpy(scales, srcScales, 4ull * scaleCols);
        } else {
          for (uint32_t j = 0; j < scaleCols; ++j) scales[j] = srcScales[j * p.checked.scaleStrides[1]];
        }
      }
      uint8_t* meta = entry + s.metaOffset;
      const EntryMeta m{t, numLes[o]};
      std::memcpy(meta, &m.token, 4);
      std::memcpy(meta + 4, &m.n, 2);
      std::memcpy(meta + 6, &les[o * K], 2ull * numLes[o]);
    }
  }
  for (uint32_t dst = 0; dst < W; ++dst) {
    std::memcpy(proxy::headExpertCounts(p.sendSlots[dst]), expertCounts.data(), 4ull * E);
    std::memcpy(proxy::headEntryCounts(p.sendSlots[dst], E), entryCounts.data(), 4ull * W);
  }
}

void dispatchRecvKernel(const DispatchRecvParams& p) {
  const proxy::ProtocolSizes& s = *p.sizes;
  const proxy::RoundLayout& lay = *p.layout;
  const DispatchArgs& a = *p.args;
  const CheckedDispatch& c = p.checked;
  const uint32_t W = s.worldSize, L = s.numLocalExperts, me = s.rank;
  const bool batched = s.layout == Layout::kBatched;
  const uint64_t R = s.batchedRowsPerExpert;
  const uint32_t scaleCols = static_cast<uint32_t>(s.scaleBytes / 4);
  int32_t* numTokens = static_cast<int32_t*>(a.outExpertNumTokens.data);
  for (uint32_t le = 0; le < L; ++le) numTokens[le] = static_cast<int32_t>(lay.localExpertRows(le));

  char* out = static_cast<char*>(a.outExpertX.data);
  uint32_t* outScale = static_cast<uint32_t*>(a.outExpertXScale.data);
  // Scale columns are usually contiguous: one copy per row instead of a strided store per scale.
  const int64_t scaleColStride = scaleCols == 0 ? 1 : c.outScaleStrides[batched ? 2 : 1];
  std::vector<uint64_t> next(L);
  for (uint32_t src = 0; src < W; ++src) {
    for (uint32_t le = 0; le < L; ++le) next[le] = lay.slotOffset(le, src);
    const uint32_t n = lay.entries(src, me);
    for (uint32_t j = 0; j < n; ++j) {
      const uint8_t* entry =
          src == me ? p.ownSendSlot + s.headBytes + j * s.entryBytes : p.recvBuffer + lay.recvEntryOffset(s, src, j);
      const uint8_t* meta = entry + s.metaOffset;
      uint16_t numLocal;
      std::memcpy(&numLocal, meta + 4, 2);
      EPCOMM_CHECK(numLocal >= 1 && numLocal <= s.maxLocalPerEntry, kInternal,
                   "rank " << me << ": entry " << j << " from rank " << src << " names " << numLocal
                           << " local experts (corrupt receive buffer)");
      const uint16_t* experts = entryExperts(meta);
      for (uint16_t i = 0; i < numLocal; ++i) {
        const uint32_t le = experts[i];
        EPCOMM_CHECK(le < L && next[le] < lay.slotOffset(le, src + 1), kInternal,
                     "rank " << me << ": entry " << j << " from rank " << src << " overruns local expert " << le);
        const uint64_t row = lay.outputRowBase(le) + next[le]++;
        const int64_t expertIdx = batched ? static_cast<int64_t>(row / R) : 0;
        const int64_t rowIdx = batched ? static_cast<int64_t>(row % R) : static_cast<int64_t>(row);
        std::memcpy(out + expertIdx * c.outExpertStrideBytes + rowIdx * c.outRowStrideBytes, entry, s.payloadBytes);
        if (scaleCols == 0) continue;
        const uint32_t* scales = reinterpret_cast<const uint32_t*>(entry + s.payloadBytes);
        const int64_t* os = c.outScaleStrides;
        uint32_t* dstScale = outScale + (batched ? expertIdx * os[0] + rowIdx * os[1] : rowIdx * os[0]);
        if (scaleColStride == 1) {
          std::memcpy(dstScale, scales, 4ull * scaleCols);
        } else {
          for (uint32_t k = 0; k < scaleCols; ++k) dstScale[k * scaleColStride] = scales[k];
        }
      }
    }
    for (uint32_t le = 0; le < L; ++le) {
      EPCOMM_CHECK(next[le] == lay.slotOffset(le, src + 1), kInternal,
                   "rank " << me << ": rank " << src << " announced " << lay.expertCount(src, me * L + le)
                           << " rows for local expert " << le << " but its entries carry "
                           << next[le] - lay.slotOffset(le, src));
    }
  }
}

void combineSendKernel(const CombineSendParams& p) {
  const proxy::ProtocolSizes& s = *p.sizes;
  const proxy::RoundLayout& lay = *p.layout;
  const CombineArgs& a = *p.args;
  const uint32_t L = s.numLocalExperts, D = s.dpSize, G = s.numDpGroups();
  const bool batched = s.layout == Layout::kBatched;
  const uint64_t R = s.batchedRowsPerExpert;
  const int64_t item = dtypeSize(a.expertY.dtype);
  const uint64_t rowBytes = static_cast<uint64_t>(a.expertY.shape[a.expertY.ndim - 1]) * item;
  const char* y = static_cast<const char*>(a.expertY.data);
  for (uint32_t g = 0; g < G; ++g) {
    uint8_t* dst = p.combineSendBuffer + lay.combineSendStart(g) * rowBytes;
    for (uint32_t le = 0; le < L; ++le) {
      // Group g's senders are consecutive ranks, so their rows of one expert are one contiguous range.
      const uint64_t first = lay.slotOffset(le, g * D), last = lay.slotOffset(le, (g + 1) * D);
      for (uint64_t i = first; i < last; ++i) {
        const uint64_t row = lay.outputRowBase(le) + i;
        const int64_t off = batched ? static_cast<int64_t>(row / R) * p.checked.yExpertStride +
                                          static_cast<int64_t>(row % R) * p.checked.yRowStride
                                    : static_cast<int64_t>(row) * p.checked.yRowStride;
        std::memcpy(dst, y + off * item, rowBytes);
        dst += rowBytes;
      }
    }
  }
}

void combineRecvKernel(const CombineRecvParams& p) {
  const proxy::ProtocolSizes& s = *p.sizes;
  const proxy::RoundLayout& lay = *p.layout;
  const CombineArgs& a = *p.args;
  const CheckedCombine& c = p.checked;
  const uint32_t W = s.worldSize, E = s.numExperts, L = s.numLocalExperts, K = s.expertsPerToken, D = s.dpSize;
  const uint32_t me = s.rank, g = me / D;
  const uint32_t H = static_cast<uint32_t>(a.outTokens.shape[1]);
  const uint64_t rowBytes = static_cast<uint64_t>(H) * dtypeSize(p.yDtype);
  const int kind = c.indexKind;
  auto load = [&](uint32_t t, uint32_t k) {
    return decodeIndex(a.indices.data, kind, t * c.indexStrides[0] + k * c.indexStrides[1]);
  };
  for (uint32_t t = 0; t < p.boundM; ++t) {
    for (uint32_t k = 0; k < K; ++k) {
      const int64_t e = load(t, k);
      EPCOMM_CHECK(e >= -1 && e < static_cast<int64_t>(E), kInvalidArgument,
                   "rank " << me << " token " << t << " position k=" << k << " has expert index " << e
                           << ", outside [0, " << E << ") and not -1");
    }
  }

  // Row of (t, k) inside its owner's message: the message is expert-major, then (sender, token) order, so walk the
  // group's tokens in (sender, token) order with one counter per expert, starting where each sender's rows begin.
  std::vector<uint64_t> next(E), start(E);
  std::vector<uint64_t> rowOf(static_cast<size_t>(p.boundM) * K, ~0ull);
  // Elastic ranks: a position whose expert's rank is masked, or whose token's sender is masked, has no row.
  constexpr uint64_t kDropped = ~0ull;
  uint64_t dropped = 0;
  for (uint32_t d = 0; d < D; ++d) {
    const uint32_t sender = g * D + d;
    const bool senderActive = lay.isActive(sender);
    for (uint32_t e = 0; e < E; ++e) {
      start[e] = lay.combineExpertStart(e);
      for (uint32_t s2 = g * D; s2 < sender; ++s2) start[e] += lay.expertCount(s2, e);
      next[e] = start[e];
    }
    for (uint32_t t = d; t < p.boundM; t += D) {
      for (uint32_t k = 0; k < K; ++k) {
        const int64_t e = load(t, k);
        if (e < 0) continue;
        if (!senderActive || !lay.isActive(expertOwner(static_cast<uint32_t>(e), L))) {
          rowOf[static_cast<size_t>(t) * K + k] = kDropped;
          ++dropped;
          continue;
        }
        uint32_t j = 0;
        while (j < k && load(t, j) != e) ++j;
        rowOf[static_cast<size_t>(t) * K + k] = j < k ? rowOf[static_cast<size_t>(t) * K + j] : next[e]++;
      }
    }
    for (uint32_t e = 0; e < E; ++e) {
      EPCOMM_CHECK(next[e] - start[e] == lay.expertCount(sender, e), kInvalidArgument,
                   "rank " << me << ": combine indices/boundM give " << next[e] - start[e] << " tokens of rank "
                           << sender << " for expert " << e << " but rank " << sender << " dispatched "
                           << lay.expertCount(sender, e) << " (combine must use the indices that were dispatched)");
    }
  }

  std::vector<const uint8_t*> ownerBase(W);
  for (uint32_t q = 0; q < W; ++q) {
    ownerBase[q] = q == me ? p.combineSendBuffer + lay.combineSendStart(g) * rowBytes
                           : p.combineRecvBuffer + lay.combineRecvStart(q) * rowBytes;
  }
  const float* w = static_cast<const float*>(a.weights.data);
  const DType outType = a.outTokens.dtype;
  const uint64_t outItem = dtypeSize(outType);
  uint8_t* outBase = static_cast<uint8_t*>(a.outTokens.data);
  std::vector<float> termW(K);
  std::vector<const uint8_t*> termRow(K);
  // The dtype pair is chosen once; each instance's loops are dtype-free.
  auto sumAll = [&](const auto& yIo, const auto& outIo) {
    for (uint32_t t = 0; t < p.boundM; ++t) {
      uint32_t numTerms = 0;
      for (uint32_t k = 0; k < K; ++k) {
        const int64_t e = load(t, k);
        if (e < 0 || rowOf[t * K + k] == kDropped) continue;
        termW[numTerms] = w[t * c.weightStrides[0] + k * c.weightStrides[1]];
        termRow[numTerms++] = ownerBase[expertOwner(static_cast<uint32_t>(e), L)] + rowOf[t * K + k] * rowBytes;
      }
      uint8_t* out = outBase + static_cast<uint64_t>(t) * c.outRowStride * outItem;
      weightedSumRow(yIo, outIo, out, a.accumulate, termW.data(), termRow.data(), numTerms, H);
    }
  };
  auto withOut = [&](const auto& yIo) {
    switch (outType) {
      case DType::kBf16:
        sumAll(yIo, Bf16Io{});
        break;
      case DType::kF32:
        sumAll(yIo, F32Io{});
        break;
      default:
        sumAll(yIo, AnyIo{outType});
        break;
    }
  };
  switch (p.yDtype) {
    case DType::kBf16:
      withOut(Bf16Io{});
      break;
    case DType::kF32:
      withOut(F32Io{});
      break;
    default:
      withOut(AnyIo{p.yDtype});
      break;
  }
  if (p.dropped != nullptr) *p.dropped += dropped;
}

}  // namespace host
}  // namespace epcomm
