// Elastic ranks on the nvlink backend: how the active ranks of a node agree on a new mask without the bootstrap
// (whose rank 0 may be the dead one). Every rank has two 64-bit words in its slot of the object's abort board (shared
// memory of the node, core/abort_board.hpp): its proposal and its barrier counter. Plain C++ over those words, so that
// a unit test can run it on ordinary memory.
//
// Agreement (epoch e): a rank publishes (e, its view: the ranks it keeps), then folds in every member's proposal of
// epoch e (the views intersect), publishes again whenever its view shrank, and adopts the view once every member's
// proposal equals its own. A member that is known dead (the liveness callback: its process is gone) leaves the view at
// once; one that publishes nothing for epoch e within the timeout leaves it then. Two ranks that keep each other
// adopted the same view: each saw the other's final proposal equal to its own, and views only shrink.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace epcomm {
namespace nvlink {

/// A proposal word: epoch (16 bits, never 0 once published) << 32 | view (bit r: rank r kept). 0: none yet.
inline uint64_t proposalWord(uint32_t epoch, uint32_t view) {
  return static_cast<uint64_t>(epoch & 0xffff) << 32 | view;
}
inline uint32_t proposalEpoch(uint64_t w) { return static_cast<uint32_t>(w >> 32) & 0xffff; }
inline uint32_t proposalView(uint64_t w) { return static_cast<uint32_t>(w); }
/// The epoch after `e` (16 bits, skipping 0).
inline uint32_t nextEpoch(uint32_t e) { return (e & 0xffff) == 0xffff ? 1 : (e & 0xffff) + 1; }

class ElasticAgreement {
 public:
  /// `proposals[r]`, `barriers[r]`: rank r's words (shared memory). `alive(r)`: false once rank r is known dead.
  ElasticAgreement(std::vector<uint64_t*> proposals, std::vector<uint64_t*> barriers, uint32_t rank, int64_t timeoutMs,
                   std::function<bool(uint32_t)> alive);

  struct Result {
    uint32_t view = 0;     ///< the adopted active ranks (this rank's bit set), or 0 when this rank was masked
    std::string maskedBy;  ///< when masked: which rank's proposal left this rank out
  };
  /// Agrees on the next epoch among the ranks of `view` (this rank included), starting from `view`. Blocks until
  /// every member agreed (or was left out). Never throws.
  Result agree(uint32_t view);
  /// This rank leaves: publishes the next epoch with `view` (without this rank), then waits (bounded by the timeout)
  /// until every rank of `view` has reached `barrierValue` on its barrier word (it has adopted the view and stopped
  /// touching this rank's memory) or is dead. Returns the ranks that did not.
  uint32_t leave(uint32_t view, uint64_t barrierValue);
  /// A barrier of the ranks in `members` (this rank included): bumps this rank's counter and waits, bounded by the
  /// timeout, until every other member's counter reached it or the member is dead. Returns the members that did not
  /// arrive (0: all did).
  uint32_t barrier(uint32_t members);
  /// The value this rank's barrier counter will have after its next barrier.
  uint64_t nextBarrier() const { return barrierSeq_ + 1; }
  uint32_t epoch() const { return epoch_; }

 private:
  uint64_t load(const uint64_t* w) const;
  void store(uint64_t* w, uint64_t v);
  uint32_t waitBarriers(uint32_t members, uint64_t value);

  std::vector<uint64_t*> proposals_, barriers_;
  uint32_t rank_, world_;
  int64_t timeoutMs_;
  std::function<bool(uint32_t)> alive_;
  uint32_t epoch_ = 0;
  uint64_t barrierSeq_ = 0;
};

/// Text of a mask's ranks: "ranks 0, 2" / "rank 1" / "no rank".
std::string rankSet(uint32_t mask, uint32_t world);

/// The view that setActiveRanks(`mask`) asks for (bit r: mask[r] is 1), checked against the `world` ranks and the
/// active ranks `live`: throws Error(kInvalidArgument) naming the entry when the mask has another size, an entry that
/// is not 0 or 1, makes a masked rank active again, or leaves no rank active.
uint32_t requestedView(const std::vector<int32_t>& mask, uint32_t world, uint32_t live);

}  // namespace nvlink
}  // namespace epcomm
