// Elastic ranks (docs/failures.md, "Elastic ranks"): what AllToAll answers on a backend without them, and the CPU
// reference of their drop semantics.
#include <sstream>
#include <vector>

#include "core/layout.hpp"
#include "core/validate.hpp"
#include "epcomm/all_to_all.hpp"
#include "epcomm/error.hpp"
#include "epcomm/reference.hpp"

namespace epcomm {

namespace {

[[noreturn]] void noElasticRanks(const AllToAll& a2a, const char* call) {
  EPCOMM_THROW(kUnavailable, "the " << a2a.backendName() << " backend does not support elastic ranks (" << call
                                    << "): a dead peer makes its object unusable; destroy it and create a new one "
                                       "among the survivors (docs/failures.md)");
}

// Copies of every rank's indices as int64 [m, K] with the positions the mask drops set to -1: those whose expert is
// on a masked rank, and every position of a token whose sending rank (tokenSender) is masked.
struct MaskedIndices {
  std::vector<std::vector<int64_t>> storage;
  std::vector<TensorView> views;
};

MaskedIndices maskIndices(const Config& config, const std::vector<const TensorView*>& indices,
                          const std::vector<int32_t>& activeRanks) {
  config.validate();
  const uint32_t W = config.worldSize, D = config.dpSize, K = config.expertsPerToken, L = config.numLocalExperts();
  EPCOMM_CHECK(activeRanks.size() == W, kInvalidArgument,
               "reference: activeRanks has " << activeRanks.size() << " entries for " << W << " ranks");
  EPCOMM_CHECK(indices.size() == W, kInvalidArgument,
               "reference: " << indices.size() << " ranks' arguments for " << W << " ranks");
  MaskedIndices out;
  out.storage.resize(W);
  out.views.resize(W);
  for (uint32_t r = 0; r < W; ++r) {
    const TensorView& in = *indices[r];
    EPCOMM_CHECK(in.ndim == 2 && in.shape[1] == K, kInvalidArgument,
                 "reference: rank " << r << " indices must be [m, " << K << "], got " << in.toString());
    const int64_t m = in.shape[0];
    const int kind = indexKindOf(in.dtype);
    std::vector<int64_t>& v = out.storage[r];
    v.assign(static_cast<size_t>(m > 0 ? m * K : 1), -1);
    const uint32_t group = r / D;
    for (int64_t t = 0; t < m; ++t) {
      const bool senderActive = activeRanks[tokenSender(group, static_cast<uint32_t>(t), D)] != 0;
      for (uint32_t k = 0; k < K; ++k) {
        const int64_t e = decodeIndex(in.data, kind, t * in.strides[0] + k * in.strides[1]);
        // Out-of-range indices stay as they are: the reference refuses them as the backends do.
        const bool dropped = e >= 0 && e < static_cast<int64_t>(config.numExperts) &&
                             (!senderActive || activeRanks[expertOwner(static_cast<uint32_t>(e), L)] == 0);
        v[t * K + k] = dropped ? -1 : e;
      }
    }
    out.views[r] = TensorView::contiguous(v.data(), DType::kI64, {m, static_cast<int64_t>(K)});
  }
  return out;
}

}  // namespace

std::vector<int32_t> AllToAll::activeRanks() const { noElasticRanks(*this, "activeRanks"); }

void AllToAll::setActiveRanks(const std::vector<int32_t>&) { noElasticRanks(*this, "setActiveRanks"); }

uint64_t AllToAll::droppedTokens() const { noElasticRanks(*this, "droppedTokens"); }

namespace reference {
namespace {

// Runs the unmasked reference `run` on a copy of `args` whose indices drop what the mask drops (dispatch and combine
// alike: only their argument type differs).
template <typename Args, typename Run>
void runMasked(const Config& config, const std::vector<Args>& args, const std::vector<int32_t>& activeRanks, Run run) {
  std::vector<const TensorView*> indices;
  for (const Args& a : args) indices.push_back(&a.indices);
  const MaskedIndices masked = maskIndices(config, indices, activeRanks);
  std::vector<Args> copy = args;
  for (size_t r = 0; r < copy.size(); ++r) copy[r].indices = masked.views[r];
  run(config, copy);
}

}  // namespace

void dispatch(const Config& config, const std::vector<DispatchArgs>& args, const std::vector<int32_t>& activeRanks) {
  runMasked(config, args, activeRanks, [](const Config& c, const std::vector<DispatchArgs>& a) { dispatch(c, a); });
}

void combine(const Config& config, const std::vector<CombineArgs>& args, const std::vector<int32_t>& activeRanks) {
  runMasked(config, args, activeRanks, [](const Config& c, const std::vector<CombineArgs>& a) { combine(c, a); });
}

}  // namespace reference
}  // namespace epcomm
