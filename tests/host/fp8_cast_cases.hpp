// Cases of the dispatch's fp8 cast (Config::dispatchCast), shared by the host and the nvlink tests: every rank's bf16
// inputs from a seed (so every process can compute every rank's expected outputs), output tensors shaped as the
// backends take them, and the expected outputs of the same tokens cast separately (reference::castFp8Blocks) and
// dispatched by the reference without a cast. A backend that casts must give those bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "core/dtype_convert.hpp"
#include "epcomm/all_to_all.hpp"
#include "reference/reference.hpp"

namespace epcomm {
namespace test {

/// One case: the configuration and how its inputs are drawn.
struct CastCase {
  uint32_t W = 2, D = 1, E = 8, K = 3, T = 12, H = 256;
  Layout layout = Layout::kBatched;
  uint32_t padding = 1;
  DispatchCast cast = DispatchCast::kFp8Blocks;
  bool columnMajorScales = false;  ///< outExpertXScale as DeepEP lays it out: a transposed view of [L, S, R]
  bool masked = false;             ///< some indices -1, some repeated within a token
  bool ragged = true;              ///< m per DP group drawn from [0, T] (else T)
  uint64_t seed = 1;

  /// The config of `rank` with dispatchCast = `with` (the wire format is the fp8 dispatch's either way).
  Config config(uint32_t rank, DispatchCast with) const {
    Config c;
    c.maxNumTokens = T;
    c.numExperts = E;
    c.expertsPerToken = K;
    c.worldSize = W;
    c.rank = rank;
    c.dpSize = D;
    c.hiddenDim = H;
    c.hiddenDimBytes = H;
    c.hiddenDimScaleBytes = H / kFp8CastBlock * 4;
    c.expertPadding = padding;
    c.layout = layout;
    c.dispatchCast = with;
    return c;
  }
  Config config(uint32_t rank) const { return config(rank, cast); }
};

inline uint64_t castMix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// One rank's inputs: m tokens of bf16 x [m, H] and int32 indices [m, K].
struct CastInputs {
  uint32_t m = 0;
  reference::HostTensor x, indices;
};

/// Every rank's inputs of round `round` (the ranks of a DP group hold the same tokens), identical in every process.
/// Finite bf16 values whose 128-element blocks span magnitudes from 2^-40 to 2^40: blocks of zeros (the amax floor),
/// blocks below 1e-4, elements 2^-12 under their block's largest (fp8 subnormals), negative zeros, exact ties.
inline std::vector<CastInputs> castInputs(const CastCase& cc, uint32_t round) {
  const uint32_t G = cc.W / cc.D;
  std::vector<CastInputs> all(cc.W);
  for (uint32_t g = 0; g < G; ++g) {
    uint64_t st = cc.seed * 0x100000001B3ull + round * 0x9E37ull + g * 0x7F4A7C15ull;
    const uint32_t m = cc.ragged ? static_cast<uint32_t>(castMix(st) % (cc.T + 1)) : cc.T;
    for (uint32_t d = 0; d < cc.D; ++d) {
      CastInputs& in = all[g * cc.D + d];
      in.m = m;
      in.x = reference::HostTensor(DType::kBf16, {m, cc.H});
      in.indices = reference::HostTensor(DType::kI32, {m, cc.K});
    }
    CastInputs& first = all[g * cc.D];
    uint16_t* x = first.x.data<uint16_t>();
    for (uint32_t t = 0; t < m; ++t) {
      for (uint32_t b = 0; b < cc.H / kFp8CastBlock; ++b) {
        const uint64_t kind = castMix(st) % 8;
        const int scaleExp = static_cast<int>(castMix(st) % 81) - 40;
        for (uint32_t h = b * kFp8CastBlock; h < (b + 1) * kFp8CastBlock; ++h) {
          float v = 0.0f;
          const uint64_t r = castMix(st);
          if (kind == 0) {
            v = (r & 1) ? -0.0f : 0.0f;
          } else if (kind == 1) {
            v = std::ldexp(static_cast<float>(r % 1000) / 1000.0f, -20);  // amax below 1e-4
          } else {
            // 8 significant bits, so bf16 holds them; every 16th element tiny against the block.
            v = std::ldexp(static_cast<float>(static_cast<int>(r % 511) - 255), scaleExp - 8);
            if (h % 16 == 3) v = std::ldexp(v, -12);
          }
          x[static_cast<size_t>(t) * cc.H + h] = floatToBf16(v);
        }
      }
    }
    int32_t* idx = first.indices.data<int32_t>();
    std::vector<int32_t> experts(cc.E);
    for (uint32_t t = 0; t < m; ++t) {
      for (uint32_t e = 0; e < cc.E; ++e) experts[e] = static_cast<int32_t>(e);
      for (uint32_t k = 0; k < cc.K; ++k) {
        const uint32_t j = k + static_cast<uint32_t>(castMix(st) % (cc.E - k));
        std::swap(experts[k], experts[j]);
        int32_t e = experts[k];
        if (cc.masked && castMix(st) % 5 == 0) e = -1;
        if (cc.masked && k > 0 && castMix(st) % 6 == 0) e = experts[castMix(st) % k];
        idx[static_cast<size_t>(t) * cc.K + k] = e;
      }
    }
    for (uint32_t d = 1; d < cc.D; ++d) {
      std::memcpy(all[g * cc.D + d].x.data<uint8_t>(), first.x.data<uint8_t>(), first.x.bytes());
      std::memcpy(all[g * cc.D + d].indices.data<uint8_t>(), first.indices.data<uint8_t>(), first.indices.bytes());
    }
  }
  return all;
}

/// One rank's dispatch outputs in host memory, zero-filled: counts [L] int32, x fp8 (batched [L, R, H] or packed
/// [P, H]) and scales fp32 of the same rows with H / 128 columns (row-major, or columnMajorScales: a transposed view of
/// [L, S, R] storage, DeepEP's layout).
struct CastOutputs {
  reference::HostTensor counts, x, scaleStorage;
  TensorView scales;

  CastOutputs(const CastCase& cc, uint32_t rank) {
    const Config c = cc.config(rank);
    const int64_t L = c.numLocalExperts(), R = static_cast<int64_t>(c.batchedRowsPerExpert());
    const int64_t P = static_cast<int64_t>(c.packedRows()), S = cc.H / kFp8CastBlock, H = cc.H;
    const bool batched = cc.layout == Layout::kBatched;
    counts = reference::HostTensor(DType::kI32, {L});
    x = batched ? reference::HostTensor(DType::kFp8E4M3, {L, R, H}) : reference::HostTensor(DType::kFp8E4M3, {P, H});
    if (batched && cc.columnMajorScales) {
      scaleStorage = reference::HostTensor(DType::kF32, {L, S, R});
      scales = TensorView::strided(scaleStorage.data<void>(), DType::kF32, {L, R, S}, {S * R, 1, R});
    } else if (batched) {
      scaleStorage = reference::HostTensor(DType::kF32, {L, R, S});
      scales = scaleStorage.view();
    } else if (cc.columnMajorScales) {
      scaleStorage = reference::HostTensor(DType::kF32, {S, P});
      scales = TensorView::strided(scaleStorage.data<void>(), DType::kF32, {P, S}, {1, P});
    } else {
      scaleStorage = reference::HostTensor(DType::kF32, {P, S});
      scales = scaleStorage.view();
    }
  }

  /// The receive-side views (host memory); `memory` / `device` and the data pointers are the caller's to change.
  void setOutputs(DispatchArgs& a) const {
    a.outExpertNumTokens = counts.view();
    a.outExpertX = x.view();
    a.outExpertXScale = scales;
  }
};

/// The expected outputs of every rank: each rank's x cast by reference::castFp8Blocks (the separate cast), then
/// dispatched by the reference with the config without a cast.
inline std::vector<CastOutputs> separateCastReference(const CastCase& cc, const std::vector<CastInputs>& in) {
  std::vector<reference::HostTensor> q(cc.W), s(cc.W);
  std::vector<CastOutputs> out;
  std::vector<DispatchArgs> args(cc.W);
  for (uint32_t r = 0; r < cc.W; ++r) {
    const int64_t m = in[r].m;
    q[r] = reference::HostTensor(DType::kFp8E4M3, {m, cc.H});
    s[r] = reference::HostTensor(DType::kF32, {m, cc.H / kFp8CastBlock});
    reference::castFp8Blocks(in[r].x.view(), q[r].view(), s[r].view(), kFp8CastBlock,
                             cc.cast == DispatchCast::kFp8BlocksPow2);
    out.emplace_back(cc, r);
  }
  for (uint32_t r = 0; r < cc.W; ++r) {
    out[r].setOutputs(args[r]);
    args[r].x = q[r].view();
    args[r].xScale = s[r].view();
    args[r].indices = in[r].indices.view();
  }
  reference::dispatch(cc.config(0, DispatchCast::kNone), args);
  return out;
}

/// "" when `got` holds `want`'s bits (counts, every fp8 byte and every scale, rows in use or not), else where they
/// differ first.
inline std::string compareCastOutputs(const CastOutputs& got, const CastOutputs& want) {
  std::ostringstream oss;
  auto first = [&](const char* what, const reference::HostTensor& a, const reference::HostTensor& b) {
    if (a.bytes() != b.bytes()) {
      oss << what << ": " << a.bytes() << " bytes against " << b.bytes() << "; ";
      return;
    }
    const uint8_t* p = a.data<uint8_t>();
    const uint8_t* q = b.data<uint8_t>();
    size_t n = 0, at = 0;
    for (size_t i = 0; i < a.bytes(); ++i) {
      if (p[i] != q[i] && n++ == 0) at = i;
    }
    if (n > 0) {
      oss << what << ": " << n << " bytes differ, the first at byte " << at << " (0x" << std::hex
          << static_cast<int>(p[at]) << " against 0x" << static_cast<int>(q[at]) << std::dec << "); ";
    }
  };
  first("outExpertNumTokens", got.counts, want.counts);
  first("outExpertX", got.x, want.x);
  first("outExpertXScale", got.scaleStorage, want.scaleStorage);
  return oss.str();
}

}  // namespace test
}  // namespace epcomm
