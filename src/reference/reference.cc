#include "reference/reference.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/dtype_convert.hpp"
#include "core/fp8_cast.hpp"
#include "core/layout.hpp"
#include "core/validate.hpp"
#include "epcomm/error.hpp"

namespace epcomm {
namespace reference {

namespace {

// The effective token count of one rank: *boundM (host memory) when given, else m.
int32_t effectiveBound(const int32_t* boundM, int64_t m, size_t rank, const char* op) {
  if (boundM == nullptr) return static_cast<int32_t>(m);
  EPCOMM_CHECK(
      *boundM >= 0 && *boundM <= m, kInvalidArgument,
      "reference " << op << ": rank " << rank << " has boundM = " << *boundM << " outside [0, m = " << m << "]");
  return *boundM;
}

int64_t loadIndex(const TensorView& indices, int64_t t, int64_t k) {
  return decodeIndex(indices.data, indexKindOf(indices.dtype), t * indices.strides[0] + k * indices.strides[1]);
}

// Row of (srcRank, token) among the rows of local expert `le` on `owner`, or -1 when it was not dispatched there.
// The rows are sorted by (srcRank, token), so a binary search finds it.
int64_t findRow(const Routing& routing, uint32_t owner, uint32_t le, uint32_t srcRank, uint32_t token) {
  const std::vector<RowSource>& rows = routing.rows[owner][le];
  auto before = [](const RowSource& a, const RowSource& b) {
    return a.srcRank != b.srcRank ? a.srcRank < b.srcRank : a.token < b.token;
  };
  const RowSource key{srcRank, token};
  auto it = std::lower_bound(rows.begin(), rows.end(), key, before);
  if (it == rows.end() || it->srcRank != srcRank || it->token != token) return -1;
  return it - rows.begin();
}

Config checkedConfig(const Config& config, size_t numRanks, const char* op) {
  Config c = config;
  c.rank = 0;
  c.validate();
  EPCOMM_CHECK(numRanks == c.worldSize, kInvalidArgument,
               "reference " << op << ": got arguments for " << numRanks << " ranks but worldSize = " << c.worldSize);
  return c;
}

}  // namespace

Routing buildRouting(const Config& config, const std::vector<TensorView>& indices, const std::vector<int32_t>& boundM) {
  const uint32_t W = config.worldSize, D = config.dpSize, L = config.numLocalExperts(), K = config.expertsPerToken;
  const uint32_t E = config.numExperts;
  EPCOMM_CHECK(indices.size() == W && boundM.size() == W, kInvalidArgument,
               "reference routing: need indices and boundM for " << W << " ranks, got " << indices.size() << " and "
                                                                 << boundM.size());
  // Every index every rank will read, range-checked before anything else.
  for (uint32_t r = 0; r < W; ++r) {
    for (int64_t t = 0; t < boundM[r]; ++t) {
      for (uint32_t k = 0; k < K; ++k) {
        const int64_t e = loadIndex(indices[r], t, k);
        EPCOMM_CHECK(e >= -1 && e < static_cast<int64_t>(E), kInvalidArgument,
                     "rank " << r << " token " << t << " position k=" << k << " has expert index " << e
                             << ", outside [0, " << E << ") and not -1");
      }
    }
  }

  Routing routing;
  routing.rows.assign(W, std::vector<std::vector<RowSource>>(L));
  // Sending ranks ascending, tokens ascending: the documented slot order falls out of the loop order.
  for (uint32_t s = 0; s < W; ++s) {
    for (int64_t t = 0; t < boundM[s]; ++t) {
      if (!sendsToken(s, static_cast<uint32_t>(t), D)) continue;
      auto load = [&](uint32_t j) { return loadIndex(indices[s], t, j); };
      for (uint32_t k = 0; k < K; ++k) {
        const int64_t e = load(k);
        if (e < 0 || isRepeatOfEarlier(load, k, e)) continue;
        const uint32_t ue = static_cast<uint32_t>(e);
        routing.rows[expertOwner(ue, L)][ue % L].push_back(RowSource{s, static_cast<uint32_t>(t)});
      }
    }
  }

  routing.expertRowBase.assign(W, std::vector<uint64_t>(L, 0));
  for (uint32_t r = 0; r < W; ++r) {
    uint64_t packedBase = 0;
    for (uint32_t le = 0; le < L; ++le) {
      if (config.layout == Layout::kBatched) {
        routing.expertRowBase[r][le] = le * config.batchedRowsPerExpert();
      } else {
        routing.expertRowBase[r][le] = packedBase;
        packedBase += roundUpPow2(routing.rows[r][le].size(), config.expertPadding);
      }
    }
  }

  routing.slot.resize(W);
  for (uint32_t r = 0; r < W; ++r) {
    routing.slot[r].assign(static_cast<size_t>(boundM[r]) * K, Routing::Slot{-1, 0});
    const uint32_t group = r / D;
    for (int64_t t = 0; t < boundM[r]; ++t) {
      const uint32_t sender = tokenSender(group, static_cast<uint32_t>(t), D);
      for (uint32_t k = 0; k < K; ++k) {
        const int64_t e = loadIndex(indices[r], t, k);
        if (e < 0) continue;
        const uint32_t owner = expertOwner(static_cast<uint32_t>(e), L), le = static_cast<uint32_t>(e) % L;
        const int64_t i = findRow(routing, owner, le, sender, static_cast<uint32_t>(t));
        EPCOMM_CHECK(i >= 0, kInvalidArgument,
                     "rank " << r << " token " << t << " expert " << e << " was never dispatched by rank " << sender
                             << " of its DP group (indices or boundM differ within the group)");
        routing.slot[r][t * K + k] = Routing::Slot{static_cast<int32_t>(owner), routing.expertRowBase[owner][le] + i};
      }
    }
  }
  return routing;
}

void dispatch(const Config& config, const std::vector<DispatchArgs>& args) {
  const Config c = checkedConfig(config, args.size(), "dispatch");
  const uint32_t W = c.worldSize, L = c.numLocalExperts();
  std::vector<CheckedDispatch> checked(W);
  std::vector<TensorView> indices(W);
  std::vector<int32_t> bounds(W);
  for (uint32_t r = 0; r < W; ++r) {
    DispatchArgs a = args[r];
    a.doSend = a.doRecv = true;
    checked[r] = checkDispatchArgs(c, a, MemoryKind::kHost, -1, /*appliesCast=*/true);
    indices[r] = a.indices;
    bounds[r] = effectiveBound(a.boundM, checked[r].m, r, "dispatch");
  }
  const Routing routing = buildRouting(c, indices, bounds);
  const uint64_t rowsPerExpert = c.batchedRowsPerExpert();
  const uint32_t scaleCols = c.hiddenDimScaleBytes / 4;
  // Each rank's tokens as they travel: x and xScale, or with Config::dispatchCast x cast first (castFp8Row, the cast
  // of reference::castFp8Blocks), into contiguous fp8 rows and scales.
  struct Sent {
    const char* x;
    int64_t xRowStrideBytes;
    const uint32_t* scales;
    int64_t scaleStrides[2];
    std::vector<uint8_t> castX;
    std::vector<float> castScales;
  };
  std::vector<Sent> sent(W);
  for (uint32_t r = 0; r < W; ++r) {
    Sent& s = sent[r];
    s.x = static_cast<const char*>(args[r].x.data);
    s.xRowStrideBytes = checked[r].xRowStrideBytes;
    s.scales = static_cast<const uint32_t*>(args[r].xScale.data);
    s.scaleStrides[0] = checked[r].scaleStrides[0];
    s.scaleStrides[1] = checked[r].scaleStrides[1];
    if (c.dispatchCast == DispatchCast::kNone) continue;
    const uint32_t m = checked[r].m;
    s.castX.resize(static_cast<size_t>(m) * c.hiddenDimBytes);
    s.castScales.resize(static_cast<size_t>(m) * scaleCols);
    for (uint32_t t = 0; t < m; ++t) {
      castFp8Row(DType::kBf16, s.x + t * s.xRowStrideBytes, c.hiddenDim, castPow2(c.dispatchCast),
                 s.castX.data() + static_cast<size_t>(t) * c.hiddenDimBytes,
                 s.castScales.data() + static_cast<size_t>(t) * scaleCols, 1);
    }
    s.x = reinterpret_cast<const char*>(s.castX.data());
    s.xRowStrideBytes = c.hiddenDimBytes;
    s.scales = reinterpret_cast<const uint32_t*>(s.castScales.data());
    s.scaleStrides[0] = scaleCols;
    s.scaleStrides[1] = 1;
  }

  for (uint32_t r = 0; r < W; ++r) {
    const DispatchArgs& out = args[r];
    const CheckedDispatch& oc = checked[r];
    for (uint32_t le = 0; le < L; ++le) {
      const std::vector<RowSource>& rows = routing.rows[r][le];
      static_cast<int32_t*>(out.outExpertNumTokens.data)[le] = static_cast<int32_t>(rows.size());
      for (size_t i = 0; i < rows.size(); ++i) {
        const uint64_t row = routing.expertRowBase[r][le] + i;
        // Batched rows are addressed as (expert, row within expert) so that any expert stride works.
        const int64_t expertIdx = c.layout == Layout::kBatched ? static_cast<int64_t>(row / rowsPerExpert) : 0;
        const int64_t rowIdx = c.layout == Layout::kBatched ? static_cast<int64_t>(row % rowsPerExpert) : row;
        const Sent& in = sent[rows[i].srcRank];
        const int64_t t = rows[i].token;
        const char* src = in.x + t * in.xRowStrideBytes;
        char* dst = static_cast<char*>(out.outExpertX.data) + expertIdx * oc.outExpertStrideBytes +
                    rowIdx * oc.outRowStrideBytes;
        std::memcpy(dst, src, c.hiddenDimBytes);
        if (scaleCols == 0) continue;
        const uint32_t* s = in.scales;
        uint32_t* d = static_cast<uint32_t*>(out.outExpertXScale.data);
        const int64_t* os = oc.outScaleStrides;
        for (uint32_t j = 0; j < scaleCols; ++j) {
          const int64_t dOff = c.layout == Layout::kBatched ? expertIdx * os[0] + rowIdx * os[1] + j * os[2]
                                                            : rowIdx * os[0] + j * os[1];
          d[dOff] = s[t * in.scaleStrides[0] + j * in.scaleStrides[1]];
        }
      }
    }
  }
}

void combine(const Config& config, const std::vector<CombineArgs>& args) {
  const Config c = checkedConfig(config, args.size(), "combine");
  const uint32_t W = c.worldSize, K = c.expertsPerToken, H = c.hiddenDim;
  std::vector<CheckedCombine> checked(W);
  std::vector<TensorView> indices(W);
  std::vector<int32_t> bounds(W);
  for (uint32_t r = 0; r < W; ++r) {
    CombineArgs a = args[r];
    a.doSend = a.doRecv = true;
    checked[r] = checkCombineArgs(c, a, MemoryKind::kHost, -1);
    indices[r] = a.indices;
    bounds[r] = effectiveBound(a.boundM, checked[r].m, r, "combine");
  }
  const Routing routing = buildRouting(c, indices, bounds);
  const uint64_t rowsPerExpert = c.batchedRowsPerExpert();

  std::vector<float> acc(H);
  for (uint32_t r = 0; r < W; ++r) {
    const CombineArgs& a = args[r];
    const CheckedCombine& cc = checked[r];
    const float* weights = static_cast<const float*>(a.weights.data);
    for (int64_t t = 0; t < bounds[r]; ++t) {
      for (uint32_t h = 0; h < H; ++h) {
        acc[h] = a.accumulate ? loadAsFloat(a.outTokens.dtype, a.outTokens.data, t * cc.outRowStride + h) : 0.0f;
      }
      for (uint32_t k = 0; k < K; ++k) {
        const Routing::Slot& slot = routing.slot[r][t * K + k];
        if (slot.owner < 0) continue;
        const float w = weights[t * cc.weightStrides[0] + k * cc.weightStrides[1]];
        const TensorView& y = args[slot.owner].expertY;
        const CheckedCombine& yc = checked[slot.owner];
        const int64_t yOff = c.layout == Layout::kBatched
                                 ? static_cast<int64_t>(slot.row / rowsPerExpert) * yc.yExpertStride +
                                       static_cast<int64_t>(slot.row % rowsPerExpert) * yc.yRowStride
                                 : static_cast<int64_t>(slot.row) * yc.yRowStride;
        for (uint32_t h = 0; h < H; ++h) acc[h] += w * loadAsFloat(y.dtype, y.data, yOff + h);
      }
      for (uint32_t h = 0; h < H; ++h)
        storeFromFloat(a.outTokens.dtype, a.outTokens.data, t * cc.outRowStride + h, acc[h]);
    }
  }
}

std::vector<int32_t> randomIndices(const Config& config, uint32_t m, uint64_t seed) {
  const uint32_t E = config.numExperts, K = config.expertsPerToken;
  EPCOMM_CHECK(K <= E && E > 0, kInvalidArgument, "randomIndices: K = " << K << " must be in [1, E = " << E << "]");
  // splitmix64: tiny, and unlike std:: distributions its output is the same with every standard library.
  uint64_t state = seed;
  auto next = [&state] {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  std::vector<int32_t> experts(E);
  std::vector<int32_t> out(static_cast<size_t>(m) * K);
  for (uint32_t t = 0; t < m; ++t) {
    for (uint32_t e = 0; e < E; ++e) experts[e] = static_cast<int32_t>(e);
    // Partial Fisher-Yates: the first K entries are a uniform K-subset in uniform order.
    for (uint32_t k = 0; k < K; ++k) {
      const uint32_t j = k + static_cast<uint32_t>((static_cast<unsigned __int128>(next()) * (E - k)) >> 64);
      std::swap(experts[k], experts[j]);
      out[static_cast<size_t>(t) * K + k] = experts[k];
    }
  }
  return out;
}

HostTensor::HostTensor(DType dtype, std::initializer_list<int64_t> shape) {
  view_ = TensorView::contiguous(nullptr, dtype, shape);
  bytes_ = static_cast<size_t>(view_.numel()) * dtypeSize(dtype);
  // calloc, not aligned_alloc + memset: a large block comes zeroed from the kernel and its pages are only touched
  // when used (the GPU tests' expert outputs are mostly rows no token reaches). Aligned to 64 bytes by hand.
  const size_t alloc = roundUpPow2(bytes_ > 0 ? bytes_ : 1, 64) + 64;
  void* p = std::calloc(alloc, 1);
  EPCOMM_CHECK(p != nullptr, kSystem, "HostTensor: cannot allocate " << alloc << " bytes for " << view_.toString());
  storage_.reset(p);
  view_.data = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(p) + 63) & ~static_cast<uintptr_t>(63));
}

void HostTensor::Free::operator()(void* p) const { std::free(p); }

}  // namespace reference
}  // namespace epcomm
