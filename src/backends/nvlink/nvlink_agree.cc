#include "backends/nvlink/nvlink_agree.hpp"

#include <chrono>
#include <sstream>
#include <thread>

#include "epcomm/error.hpp"

namespace epcomm {
namespace nvlink {

namespace {

int64_t nowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void pause() { std::this_thread::sleep_for(std::chrono::microseconds(50)); }

}  // namespace

ElasticAgreement::ElasticAgreement(std::vector<uint64_t*> proposals, std::vector<uint64_t*> barriers, uint32_t rank,
                                   int64_t timeoutMs, std::function<bool(uint32_t)> alive)
    : proposals_(std::move(proposals)),
      barriers_(std::move(barriers)),
      rank_(rank),
      world_(static_cast<uint32_t>(proposals_.size())),
      timeoutMs_(timeoutMs),
      alive_(std::move(alive)) {}

uint64_t ElasticAgreement::load(const uint64_t* w) const { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }
void ElasticAgreement::store(uint64_t* w, uint64_t v) { __atomic_store_n(w, v, __ATOMIC_RELEASE); }

ElasticAgreement::Result ElasticAgreement::agree(uint32_t view) {
  const uint32_t e = nextEpoch(epoch_);
  const uint32_t me = 1u << rank_;
  view |= me;
  store(proposals_[rank_], proposalWord(e, view));
  int64_t deadline = nowMs() + timeoutMs_;
  Result result;
  for (;;) {
    uint32_t v = view;
    for (uint32_t s = 0; s < world_; ++s) {
      if (s == rank_ || !((v >> s) & 1)) continue;
      if (!alive_(s)) {
        v &= ~(1u << s);
        continue;
      }
      const uint64_t w = load(proposals_[s]);
      if (proposalEpoch(w) != e) continue;
      if (!(proposalView(w) & me)) {
        epoch_ = e;
        result.maskedBy = "rank " + std::to_string(s) + " proposed the active " + rankSet(proposalView(w), world_);
        return result;
      }
      v &= proposalView(w);
    }
    if (v != view) {
      view = v;
      store(proposals_[rank_], proposalWord(e, view));
      deadline = nowMs() + timeoutMs_;
      continue;
    }
    uint32_t waiting = 0, silent = 0;
    for (uint32_t s = 0; s < world_; ++s) {
      if (s == rank_ || !((view >> s) & 1)) continue;
      const uint64_t w = load(proposals_[s]);
      if (w != proposalWord(e, view)) waiting |= 1u << s;
      if (proposalEpoch(w) != e) silent |= 1u << s;
    }
    if (waiting == 0) break;
    if (nowMs() > deadline) {
      // Members that published nothing for this epoch leave first; ones that did but disagree get another period.
      view &= ~(silent != 0 ? silent : waiting);
      store(proposals_[rank_], proposalWord(e, view));
      deadline = nowMs() + timeoutMs_;
      continue;
    }
    pause();
  }
  epoch_ = e;
  result.view = view;
  return result;
}

uint32_t ElasticAgreement::leave(uint32_t view, uint64_t barrierValue) {
  const uint32_t e = nextEpoch(epoch_);
  view &= ~(1u << rank_);
  store(proposals_[rank_], proposalWord(e, view));
  epoch_ = e;
  return waitBarriers(view, barrierValue);
}

uint32_t ElasticAgreement::barrier(uint32_t members) {
  ++barrierSeq_;
  store(barriers_[rank_], barrierSeq_);
  return waitBarriers(members & ~(1u << rank_), barrierSeq_);
}

uint32_t ElasticAgreement::waitBarriers(uint32_t members, uint64_t value) {
  const int64_t deadline = nowMs() + timeoutMs_;
  for (;;) {
    uint32_t missing = 0;
    for (uint32_t s = 0; s < world_; ++s) {
      if (s == rank_ || !((members >> s) & 1)) continue;
      if (load(barriers_[s]) >= value || !alive_(s)) continue;
      missing |= 1u << s;
    }
    if (missing == 0 || nowMs() > deadline) return missing;
    pause();
  }
}

std::string rankSet(uint32_t mask, uint32_t world) {
  std::ostringstream oss;
  int n = 0;
  for (uint32_t r = 0; r < world; ++r) {
    if ((mask >> r) & 1) oss << (n++ == 0 ? "" : ", ") << r;
  }
  if (n == 0) return "no rank";
  return (n == 1 ? "rank " : "ranks ") + oss.str();
}

uint32_t requestedView(const std::vector<int32_t>& mask, uint32_t world, uint32_t live) {
  EPCOMM_CHECK(mask.size() == world, kInvalidArgument,
               "setActiveRanks: the mask has " << mask.size() << " entries for " << world << " ranks");
  uint32_t want = 0;
  for (uint32_t r = 0; r < world; ++r) {
    EPCOMM_CHECK(mask[r] == 0 || mask[r] == 1, kInvalidArgument,
                 "setActiveRanks: entry " << r << " is " << mask[r] << " (1 = active, 0 = masked)");
    EPCOMM_CHECK(mask[r] == 0 || ((live >> r) & 1u), kInvalidArgument,
                 "setActiveRanks: rank " << r
                                         << " is masked already and cannot be made active again (a rank that comes "
                                            "back needs a new object with every rank)");
    if (mask[r] != 0) want |= 1u << r;
  }
  EPCOMM_CHECK(want != 0, kInvalidArgument, "setActiveRanks: the mask leaves no rank active");
  return want;
}

}  // namespace nvlink
}  // namespace epcomm
