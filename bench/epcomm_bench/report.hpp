// epcomm-bench's output: the table on stdout and one JSON line per row (--json; for the host backend also stdout
// after the table). Rank 0 writes; the other ranks never call it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epcomm/all_to_all.hpp"
#include "epcomm/config.hpp"
#include "options.hpp"
#include "timing.hpp"

namespace epcomm {
namespace bench {

/// One table row's numbers, in us (median, maximum over ranks); -1 = not measured.
struct Measurement {
  double dispatch = -1, combine = -1;                     ///< The whole call.
  double dSend = -1, dRecv = -1, cSend = -1, cRecv = -1;  ///< Its send and receive halves (eager only).
  double dDev = -1, cDev = -1;                            ///< Device-only: the launch hidden behind a GPU spin.
  double nccl = -1, ncclPplx = -1;  ///< NCCL all-to-all of the dispatch's bytes (pplx: one copy per expert).
  /// Dense all-to-all over the backend's fabric provider of the dispatch's bytes and of the combine's bytes.
  double a2aDispatch = -1, a2aCombine = -1;
  double dHost = -1, cHost = -1;  ///< GPU, eager: host time spent inside the dispatch / combine call.
  /// GPU, eager: each rank's median of dispatch, combine and the host time inside dispatch (the maximum over ranks
  /// above hides which rank waited: a rank whose kernel starts earlier waits for its peers' data).
  std::vector<double> dRanks, cRanks, dHostRanks;
};

/// What a row measured.
struct RowInfo {
  std::string backend, config;
  Config c;
  uint32_t tokens = 0;
  bool graph = false;
  double dispatchBytes = 0;    ///< Cross-rank payload bytes per rank (average over ranks), one direction.
  uint64_t pplxBytes = 0;      ///< Rank 0's bytes with one copy per expert.
  double combineBytes = 0;     ///< The combine's cross-rank row bytes per rank (average over ranks).
  uint64_t combineBytes0 = 0;  ///< Rank 0's combine row bytes.
  uint64_t bufferBytes = 0;    ///< AllToAll::bufferBytes().
  std::string fabricProvider;  ///< Provider of the a2a baseline ("" when not run).
};

/// One row of --fp8: the dispatch of bf16 tokens that arrive as fp8 + scales, by one path (us, median, max over ranks;
/// -1 = not measured).
struct Fp8Row {
  std::string backend, config;
  Config c;
  uint32_t tokens = 0;
  std::string mode;         ///< "fused" (the dispatch casts) or "separate" (cast kernel, then the fp8 dispatch)
  double dispatch = -1;     ///< Eager, launch(es) included: the dispatch, or the cast and the dispatch.
  double dispatchDev = -1;  ///< The same with the launches hidden behind a GPU spin.
  double graph = -1;        ///< Replayed from one CUDA graph (separate: the cast and the dispatch in it).
  double cast = -1;         ///< Separate: the cast kernel alone, eager.
  double combine = -1;      ///< The combine that follows, eager (the same work either way).
  int sameBits = -1;        ///< 1: this path's outputs are the other's bits (both run); 0: they differ; -1: not checked
};

/// Rank 0's writer.
class Report {
 public:
  /// `gpu`: GPU tensors and CUDA-event timing; else the host backend's table. `sharedGpu`: two ranks run on one GPU.
  Report(const Options& o, int world, bool gpu, bool sharedGpu, std::string machine, std::string barrier);

  /// The header and the table's column names; `notes` are printed as "# " lines before them.
  void header(const std::vector<std::string>& notes);
  void skew(const Skew& s);
  /// The --floor line and its JSON.
  void floor(int blocks, double emptyUs, double emptyHostUs, double emptyLikeUs, unsigned likeSmemKb, double flagUs,
             double flagDeviceUs);
  void row(const RowInfo& r, const Measurement& m);
  /// Fabric operations per peer per round (TransferStats of rank 0's object), after the row.
  void fabricOps(const std::string& backend, const std::string& config, uint32_t tokens, const TransferStats& st);
  /// --fp8: the table's header (once, before the first row) and a row, with its JSON line.
  void fp8Row(const Fp8Row& r);
  /// Host backend: the JSON lines, after the table.
  void finish();

 private:
  void json(const std::string& line);

  Options o_;
  int world_;
  bool gpu_, sharedGpu_;
  std::string machine_, barrier_, rev_;
  std::vector<std::string> rows_, extras_;  // host: JSON lines printed after the table (rows, then the rest)
  bool fp8Header_ = false;
};

}  // namespace bench
}  // namespace epcomm
