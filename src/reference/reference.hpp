// The CPU reference of dispatch and combine (SPEC 2.1): given every rank's inputs, produces every rank's outputs.
// It is the oracle of every backend test, so it is written for obviousness, not speed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <vector>

#include "epcomm/all_to_all.hpp"
#include "epcomm/reference.hpp"  // dispatch, combine, randomIndices, castFp8Blocks: the public part

namespace epcomm {
namespace reference {

/// Where one dispatched row came from.
struct RowSource {
  uint32_t srcRank;  ///< The rank that sent the token (tokenSender of its group).
  uint32_t token;    ///< Token index on that rank.
};

/// The routing of one round, derived from every rank's indices and boundM.
struct Routing {
  /// rows[r][le]: rows of local expert le on rank r, in slot order (by srcRank, then token).
  std::vector<std::vector<std::vector<RowSource>>> rows;
  /// Row index of (rank r, local expert le, slot i) inside outExpertX's first dimension(s):
  /// batched: le * batchedRowsPerExpert + i; packed: paddedOffset[r][le] + i.
  std::vector<std::vector<uint64_t>> expertRowBase;
  /// slot[r][t * K + k]: for token t of rank r (t < boundM_r) and position k, the (owner rank, row) of its expert
  /// output; owner = -1 for masked positions.
  struct Slot {
    int32_t owner;
    uint64_t row;
  };
  std::vector<std::vector<Slot>> slot;
};

/// Builds the routing. indices[r] is rank r's [m_r, K] index tensor (host memory), boundM[r] <= m_r its
/// effective token count. Throws Error(kInvalidArgument) for an index outside [-1, E) naming rank, token and
/// position. `config.rank` is ignored.
Routing buildRouting(const Config& config, const std::vector<TensorView>& indices, const std::vector<int32_t>& boundM);

/// An owned, zero-filled, 64-byte aligned, contiguous host tensor; for tests, tools and benchmarks that feed the
/// reference. Move-only.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::initializer_list<int64_t> shape);
  /// The contiguous view of the whole tensor (host memory).
  TensorView view() const { return view_; }
  template <typename T>
  T* data() const {
    return static_cast<T*>(view_.data);
  }
  size_t bytes() const { return bytes_; }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> storage_;
  TensorView view_;
  size_t bytes_ = 0;
};

}  // namespace reference
}  // namespace epcomm
