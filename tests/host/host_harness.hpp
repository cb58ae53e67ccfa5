// Shared by the host-backend tests: a scenario (config + routing + dtypes), every rank's inputs of one round derived
// from a seed (so every process can run the CPU reference for all ranks), and one checked dispatch/combine round.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backends/host/host_all_to_all.hpp"
#include "core/dtype_convert.hpp"
#include "core/layout.hpp"
#include "reference/reference.hpp"

namespace epcomm {
namespace test {

/// How tokens are routed in a scenario.
enum class RouteMode {
  kUniform,     ///< K distinct experts, uniform.
  kMasked,      ///< Uniform, then about a quarter of the positions set to -1.
  kDuplicates,  ///< Uniform with some positions repeating an earlier expert of the same token.
  kOneRank,     ///< Every expert on rank 0 (the overflow path there).
};

struct Scenario {
  uint32_t W = 2, D = 1, E = 16, K = 4, T = 12, H = 32;
  DType xDtype = DType::kBf16;
  bool scales = false;
  DType yDtype = DType::kBf16, outDtype = DType::kBf16, indexDtype = DType::kI32;
  Layout layout = Layout::kBatched;
  uint32_t padding = 1;
  RouteMode route = RouteMode::kUniform;
  bool ragged = false;  ///< Random m (sometimes 0) and boundM per DP group.
  bool accumulate = false;
  /// A rank with m = 0 describes its 0-row tensors as frameworks may: null data pointer, strides (0, 0).
  bool bareEmpty = false;
  int emptyGroup = -1;  ///< This DP group has m = 0 in every round (-1: none).
  uint64_t seed = 1;
  host::HostOptions options;

  Config config(uint32_t rank) const {
    Config c;
    c.maxNumTokens = T;
    c.numExperts = E;
    c.expertsPerToken = K;
    c.worldSize = W;
    c.rank = rank;
    c.dpSize = D;
    c.hiddenDim = H;
    c.hiddenDimBytes = static_cast<uint32_t>(roundUpPow2(H * dtypeSize(xDtype), 16));
    c.hiddenDimScaleBytes = scales ? 4 * 4 : 0;
    c.expertPadding = padding;
    c.layout = layout;
    return c;
  }
};

inline uint64_t splitmix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// One rank's inputs of one round.
struct RankInputs {
  uint32_t m = 0;
  int32_t bound = 0;
  bool useBound = false;
  bool bareEmpty = false;  ///< See Scenario::bareEmpty.
  reference::HostTensor x, xScale, indices, weights, expertY, outInit;
};

/// Every rank's inputs of round `round`, identical in every process.
inline std::vector<RankInputs> makeRound(const Scenario& sc, uint32_t round) {
  const Config c = sc.config(0);
  const uint32_t G = sc.W / sc.D, L = sc.E / sc.W;
  std::vector<RankInputs> all(sc.W);
  for (uint32_t g = 0; g < G; ++g) {
    uint64_t st = sc.seed * 0x100000001B3ull + round * 0x9E37ull + g * 0x7F4A7C15ull;
    RankInputs in;
    in.m = sc.T;
    in.useBound = false;
    if (sc.ragged) {
      const uint64_t r = splitmix(st) % 5;
      in.m = r == 0 ? 0 : static_cast<uint32_t>(splitmix(st) % (sc.T + 1));
      in.useBound = splitmix(st) % 2 == 0;
    }
    if (static_cast<int>(g) == sc.emptyGroup) in.m = 0;
    in.bound = in.useBound ? static_cast<int32_t>(in.m == 0 ? 0 : splitmix(st) % (in.m + 1)) : in.m;
    const int64_t m = in.m;
    const int64_t xCols = c.hiddenDimBytes / dtypeSize(sc.xDtype);
    in.x = reference::HostTensor(sc.xDtype, {m, xCols});
    for (size_t i = 0; i < in.x.bytes(); ++i) in.x.data<uint8_t>()[i] = static_cast<uint8_t>(splitmix(st));
    if (sc.scales) {
      in.xScale = reference::HostTensor(DType::kF32, {m, 4});
      for (int64_t i = 0; i < m * 4; ++i) in.xScale.data<float>()[i] = static_cast<float>(splitmix(st) % 1000) / 7.0f;
    }
    in.indices = reference::HostTensor(sc.indexDtype, {m, sc.K});
    in.weights = reference::HostTensor(DType::kF32, {m, sc.K});
    std::vector<int64_t> experts(sc.E);
    for (int64_t t = 0; t < m; ++t) {
      const uint32_t pool = sc.route == RouteMode::kOneRank ? L : sc.E;
      for (uint32_t e = 0; e < pool; ++e) experts[e] = e;
      for (uint32_t k = 0; k < sc.K; ++k) {
        const uint32_t j = k + static_cast<uint32_t>(splitmix(st) % (pool - k));
        std::swap(experts[k], experts[j]);
        int64_t e = experts[k];
        if (sc.route == RouteMode::kMasked && splitmix(st) % 4 == 0) e = -1;
        if (sc.route == RouteMode::kDuplicates && k > 0 && splitmix(st) % 3 == 0) e = experts[splitmix(st) % k];
        const int64_t at = t * sc.K + k;
        if (sc.indexDtype == DType::kI32) in.indices.data<int32_t>()[at] = static_cast<int32_t>(e);
        if (sc.indexDtype == DType::kU32) in.indices.data<uint32_t>()[at] = static_cast<uint32_t>(e);
        if (sc.indexDtype == DType::kI64) in.indices.data<int64_t>()[at] = e;
        in.weights.data<float>()[at] = static_cast<float>(splitmix(st) % 2001) / 1000.0f - 1.0f;
      }
    }
    for (uint32_t d = 0; d < sc.D; ++d) {
      RankInputs& r = all[g * sc.D + d];
      r.m = in.m;
      r.bareEmpty = sc.bareEmpty;
      r.bound = in.bound;
      r.useBound = in.useBound;
      auto copy = [](const reference::HostTensor& src) {
        if (!src.view().defined()) return reference::HostTensor();
        const TensorView v = src.view();
        reference::HostTensor t(v.dtype, {v.shape[0], v.shape[1]});
        std::memcpy(t.data<uint8_t>(), src.data<uint8_t>(), src.bytes());
        return t;
      };
      r.x = copy(in.x);
      r.xScale = copy(in.xScale);
      r.indices = copy(in.indices);
      r.weights = copy(in.weights);
    }
  }
  const int64_t rows = static_cast<int64_t>(c.expertRows());
  for (uint32_t r = 0; r < sc.W; ++r) {
    uint64_t st = sc.seed * 31 + round * 0x51ull + r * 0x3779B97Full + 17;
    RankInputs& in = all[r];
    if (sc.layout == Layout::kBatched) {
      in.expertY = reference::HostTensor(sc.yDtype, {L, static_cast<int64_t>(c.batchedRowsPerExpert()), sc.H});
    } else {
      in.expertY = reference::HostTensor(sc.yDtype, {rows, sc.H});
    }
    const int64_t n = in.expertY.view().numel();
    for (int64_t i = 0; i < n; ++i) {
      storeFromFloat(sc.yDtype, in.expertY.data<void>(), i, static_cast<float>(splitmix(st) % 4001) / 100.0f - 20.0f);
    }
    in.outInit = reference::HostTensor(sc.outDtype, {static_cast<int64_t>(in.m), sc.H});
    for (int64_t i = 0; i < static_cast<int64_t>(in.m) * sc.H; ++i) {
      storeFromFloat(sc.outDtype, in.outInit.data<void>(), i, static_cast<float>(splitmix(st) % 200) / 10.0f);
    }
  }
  return all;
}

/// Output tensors of dispatch for one rank, filled with a pattern (rows that receive nothing keep it).
struct DispatchOutputs {
  reference::HostTensor numTokens, x, scale;
  DispatchOutputs(const Scenario& sc) {
    const Config c = sc.config(0);
    const int64_t L = c.numLocalExperts(), R = c.batchedRowsPerExpert(), P = c.packedRows();
    const int64_t cols = c.hiddenDimBytes / dtypeSize(sc.xDtype);
    numTokens = reference::HostTensor(DType::kI32, {L});
    x = sc.layout == Layout::kBatched ? reference::HostTensor(sc.xDtype, {L, R, cols})
                                      : reference::HostTensor(sc.xDtype, {P, cols});
    std::memset(x.data<void>(), 0x5A, x.bytes());
    std::memset(numTokens.data<void>(), 0xFF, numTokens.bytes());
    if (sc.scales) {
      scale = sc.layout == Layout::kBatched ? reference::HostTensor(DType::kF32, {L, R, 4})
                                            : reference::HostTensor(DType::kF32, {P, 4});
      std::memset(scale.data<void>(), 0x77, scale.bytes());
    }
  }
};

/// The view of a per-token tensor of `in`: as given, or bare (null data, strides (0, 0)) when it has no rows and the
/// scenario asks for that.
inline TensorView tokenView(const RankInputs& in, const reference::HostTensor& t) {
  TensorView v = t.view();
  if (in.m == 0 && in.bareEmpty && v.defined()) {
    v.data = nullptr;
    for (int d = 0; d < v.ndim; ++d) v.strides[d] = 0;
  }
  return v;
}

inline DispatchArgs dispatchArgs(const RankInputs& in, const DispatchOutputs& out) {
  DispatchArgs a;
  a.outExpertNumTokens = out.numTokens.view();
  a.outExpertX = out.x.view();
  a.outExpertXScale = out.scale.view();
  a.x = tokenView(in, in.x);
  a.xScale = tokenView(in, in.xScale);
  a.indices = tokenView(in, in.indices);
  a.boundM = in.useBound ? &in.bound : nullptr;
  return a;
}

inline CombineArgs combineArgs(const RankInputs& in, const reference::HostTensor& out) {
  CombineArgs a;
  a.outTokens = tokenView(in, out);
  a.indices = tokenView(in, in.indices);
  a.weights = tokenView(in, in.weights);
  a.expertY = in.expertY.view();
  a.boundM = in.useBound ? &in.bound : nullptr;
  return a;
}

inline reference::HostTensor copyOf(const reference::HostTensor& src) {
  const TensorView v = src.view();
  reference::HostTensor t(v.dtype, {v.shape[0], v.shape[1]});
  std::memcpy(t.data<uint8_t>(), src.data<uint8_t>(), src.bytes());
  return t;
}

/// How a round calls the object.
enum class CallMode {
  kFused,  ///< dispatch(send+recv), combine(send+recv).
  kSplit,  ///< dispatch(send), dispatch(recv), combine(send), combine(recv) as four calls.
};

/// Compares this rank's outputs of round `round` (dispatch outputs `mine`, combine output `out`) bitwise with the
/// CPU reference run for all ranks. Returns false (after gtest failures) on a mismatch.
inline bool matchesReference(const Scenario& sc, uint32_t rank, uint32_t round, const std::vector<RankInputs>& in,
                             const DispatchOutputs& mine, const reference::HostTensor& out) {
  const Config c = sc.config(0);
  std::vector<DispatchOutputs> ref;
  ref.reserve(sc.W);
  std::vector<DispatchArgs> refArgs;
  for (uint32_t r = 0; r < sc.W; ++r) ref.emplace_back(sc);
  for (uint32_t r = 0; r < sc.W; ++r) refArgs.push_back(dispatchArgs(in[r], ref[r]));
  reference::dispatch(c, refArgs);
  std::vector<reference::HostTensor> refOut;
  std::vector<CombineArgs> refCombine;
  for (uint32_t r = 0; r < sc.W; ++r) refOut.push_back(copyOf(in[r].outInit));
  for (uint32_t r = 0; r < sc.W; ++r) {
    refCombine.push_back(combineArgs(in[r], refOut[r]));
    refCombine.back().accumulate = sc.accumulate;
  }
  reference::combine(c, refCombine);

  bool ok = true;
  auto same = [&](const reference::HostTensor& a, const reference::HostTensor& b, const char* what) {
    if (a.bytes() == b.bytes() && std::memcmp(a.data<void>(), b.data<void>(), a.bytes()) == 0) return;
    size_t i = 0;
    while (i < a.bytes() && a.data<uint8_t>()[i] == b.data<uint8_t>()[i]) ++i;
    ADD_FAILURE() << "rank " << rank << " round " << round << ": " << what << " differs from the reference at byte "
                  << i << " of " << a.bytes();
    ok = false;
  };
  same(mine.numTokens, ref[rank].numTokens, "outExpertNumTokens");
  same(mine.x, ref[rank].x, "outExpertX");
  if (sc.scales) same(mine.scale, ref[rank].scale, "outExpertXScale");
  // The combine sums in the reference's order (fp32, k ascending, one rounding), so it is bitwise equal too.
  same(out, refOut[rank], "outTokens");
  return ok;
}

/// Runs round `round` on `a2a` (this process = `rank`), then the reference for all ranks, and compares this
/// rank's outputs bitwise. Returns false (after gtest failures) on a mismatch.
inline bool checkedRound(AllToAll& a2a, const Scenario& sc, uint32_t rank, uint32_t round,
                         CallMode mode = CallMode::kFused) {
  const std::vector<RankInputs> in = makeRound(sc, round);
  DispatchOutputs mine(sc);
  DispatchArgs da = dispatchArgs(in[rank], mine);
  if (mode == CallMode::kFused) {
    a2a.dispatch(da);
  } else {
    da.doRecv = false;
    a2a.dispatch(da);
    da.doSend = false;
    da.doRecv = true;
    a2a.dispatch(da);
  }
  reference::HostTensor out = copyOf(in[rank].outInit);
  CombineArgs ca = combineArgs(in[rank], out);
  ca.accumulate = sc.accumulate;
  if (mode == CallMode::kFused) {
    a2a.combine(ca);
  } else {
    ca.doRecv = false;
    a2a.combine(ca);
    ca.doSend = false;
    ca.doRecv = true;
    a2a.combine(ca);
  }
  return matchesReference(sc, rank, round, in, mine, out);
}

}  // namespace test
}  // namespace epcomm
