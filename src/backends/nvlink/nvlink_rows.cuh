// The receivers' row tables of the nvlink kernels: where each sender's tokens go among every local expert's rows.
// Part of nvlink_kernels.cu's translation unit: include it only there.
#pragma once

#include "backends/nvlink/nvlink_wait.cuh"

namespace epcomm {
namespace nvlink {
namespace {

// Per receiver: for each local expert, the first row of each sender's tokens (senderBase[s][le]) and the expert's
// first row (rowBase[le]: 0 in the batched layout, where the expert stride does the work; the padded prefix sum in
// the packed layout). Deterministic: rows ordered by (sender, token).
struct RowTables {
  int32_t* senderBase;  // [W][L]
  int32_t* total;       // [L]
  int32_t* rowBase;     // [L]
  int32_t* tokens;      // [W]: tokens each sender sent this round (its n_s)
  bool ok;              // false: a sender's counts never arrived (recorded); nothing else is valid
};

// Work items over the tokens that were actually sent (sum of n_s, not W x Ts slots: an engine sizes maxNumTokens
// for its largest batch and decodes far fewer): item -> (sender s, its token j). `skip`: a sender left out (the own
// rank for the peers' share), or W for none.
__device__ __forceinline__ uint32_t sentTokens(const RowTables& rt, uint32_t W, uint32_t skip) {
  uint32_t n = 0;
  for (uint32_t s = 0; s < W; ++s) n += s == skip ? 0 : static_cast<uint32_t>(rt.tokens[s]);
  return n;
}
__device__ __forceinline__ void sentItem(const RowTables& rt, uint32_t W, uint32_t skip, uint32_t item, uint32_t& s,
                                         uint32_t& j) {
  j = item;
  for (s = 0; s + 1 < W; ++s) {
    const uint32_t n = s == skip ? 0 : static_cast<uint32_t>(rt.tokens[s]);
    if (j < n) return;
    j -= n;
  }
}

// Barriers of the threads [first, blockDim.x) of a block (first a multiple of 32): the block's barrier when first is
// 0, else named barrier 1 over those threads only (the fused dispatch's own-token blocks in pull mode build their
// row tables without warp 0, which waits for its pushes' fence meanwhile). groupAnd: the barrier and the AND of `v`.
constexpr uint32_t kGroupBarrier = 1;
constexpr uint32_t kHandoffBarrier = 2;  // warp 0 waits there for the others' row tables (arrive / sync)
__device__ __forceinline__ bool groupAnd(uint32_t first, bool v) {
  if (first == 0) return __syncthreads_and(v ? 1 : 0) != 0;
  uint32_t r;
  asm volatile("{ .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.and.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q; }"
               : "=r"(r)
               : "r"(v ? 1u : 0u), "n"(kGroupBarrier), "r"(blockDim.x - first)
               : "memory");
  return r != 0;
}
__device__ __forceinline__ void groupSync(uint32_t first) {
  if (first == 0) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;" ::"n"(kGroupBarrier), "r"(blockDim.x - first) : "memory");
  }
}

// The group [first, blockDim.x): the first row of every local expert from the experts' row totals. Batched layout:
// 0 (the expert stride does the work), stored by the whole group. Packed: the prefix sum of the padded totals, by the
// group's first warp: each lane sums a run of ceil(L / 32) consecutive experts, one warp scan of the 32 sums, then
// each lane writes its run's bases (a scan per 32 experts, a chain of L / 32 x 5 dependent shuffles, took ~1.2 us for
// 256 experts on H200; docs/nvlink.md). The caller synchronises afterwards.
__device__ void expertRowBases(const int32_t* total, int32_t* rowBase, uint32_t L, bool packed, uint32_t padding,
                               uint32_t first = 0) {
  if (threadIdx.x < first) return;
  if (!packed) {
    for (uint32_t le = threadIdx.x - first; le < L; le += blockDim.x - first) rowBase[le] = 0;
    return;
  }
  if (threadIdx.x >= first + 32) return;
  const uint32_t lane = threadIdx.x - first, run = (L + 31) / 32;
  const uint32_t lo = min(L, lane * run), hi = min(L, lo + run);
  auto padded = [&](uint32_t le) {
    return static_cast<int32_t>(roundUpPow2(static_cast<uint64_t>(total[le]), padding));
  };
  int32_t sum = 0;
  for (uint32_t le = lo; le < hi; ++le) sum += padded(le);
  int32_t inc = sum;
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t n = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= static_cast<uint32_t>(o)) inc += n;
  }
  int32_t base = inc - sum;
  for (uint32_t le = lo; le < hi; ++le) {
    rowBase[le] = base;
    base += padded(le);
  }
}

// The row tables' places in smem (computeRows fills them; a thread that did not take part gets them here with its
// group's result in `ok`).
__device__ __forceinline__ RowTables rowTablesAt(const Geometry& g, int32_t* smem, bool ok) {
  const uint32_t W = g.worldSize, L = g.numLocalExperts;
  return RowTables{smem, smem + W * L, smem + (W + 1) * L, smem + (W + 2) * L, ok};
}

// Thread `tid` of a group: tid < W polls sender tid's token count of dispatch `round` (a tagged word) into tokens[tid].
// The caller's barrier orders it before what follows. Returns this thread's success.
__device__ bool pollSenders(char* local, const Geometry& g, int32_t* tokens, uint32_t round, const DeviceState& st,
                            uint32_t tid) {
  bool ok = true;
  if (tid < g.worldSize) {
    uint32_t n = 0;
    if (liveRank(g, tid)) {
      ok = waitTagged(reinterpret_cast<const uint64_t*>(local + g.offNumTokens) + tid, round, st, kPhaseDispatchRecv,
                      static_cast<int32_t>(g.rank), static_cast<int32_t>(tid), n);
    }
    tokens[tid] = static_cast<int32_t>(n);
  }
  return ok;
}

// Block-wide (the dispatch's receivers). The counts and token counts are tagged words (tagWord) of the senders'
// dispatch `round`: every thread polls its share, so the tables are ready as soon as the words land (no route flag,
// no fence behind the payload). `first`: only the threads [first, blockDim.x) take part (groupAnd); rowTablesAt()
// gives the others the result.
__device__ RowTables computeRows(char* local, const Geometry& g, int32_t* smem, bool packed, uint32_t padding,
                                 uint32_t round, const DeviceState& st, uint32_t first = 0) {
  const uint32_t W = g.worldSize, L = g.numLocalExperts;
  const uint32_t tid = threadIdx.x - first, threads = blockDim.x - first;
  RowTables rt = rowTablesAt(g, smem, true);
  const uint64_t* counts = reinterpret_cast<const uint64_t*>(local + g.offCounts);
  const int32_t rank = static_cast<int32_t>(g.rank);
  // The token counts by the group's last W threads, the counts from its first: thread 0 polled both one after the
  // other, a round trip more before the tables (W = 1 trace, docs/nvlink.md).
  bool ok = pollSenders(local, g, rt.tokens, round, st, threads - 1 - tid);
  for (uint32_t le = tid; le < L; le += threads) {
    int32_t acc = 0;
    for (uint32_t s = 0; s < W && ok; ++s) {
      uint32_t c = 0;
      if (liveRank(g, s)) {
        ok = waitTagged(counts + s * L + le, round, st, kPhaseDispatchRecv, rank, static_cast<int32_t>(s), c);
      }
      rt.senderBase[s * L + le] = acc;
      acc += static_cast<int32_t>(c);
    }
    rt.total[le] = acc;
  }
  rt.ok = groupAnd(first, ok);
  if (!rt.ok) return rt;
  expertRowBases(rt.total, rt.rowBase, L, packed, padding, first);
  groupSync(first);
  return rt;
}

}  // namespace
}  // namespace nvlink
}  // namespace epcomm
