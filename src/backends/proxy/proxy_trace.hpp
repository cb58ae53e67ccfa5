// Phase times of the proxy backend (EPCOMM_PROXY_TRACE=1): kernels and the proxy thread stamp every round into a
// host-mapped ring (TraceRound); at destruction the object prints, per phase, the median and 90th percentile over the
// rounds recorded. Device stamps are %globaltimer, host stamps CLOCK_REALTIME: phases that cross from one clock to
// the other (the proxy's reaction to a kernel's flag, a kernel's reaction to the proxy's) are only as good as the two
// clocks' agreement, which the summary states (measured once at creation).
#pragma once

#include <cstdint>
#include <string>

#include "backends/proxy/proxy_kernels.hpp"

namespace epcomm {
namespace gpuproxy {

/// CLOCK_REALTIME in ns (the host side of the stamps).
uint64_t hostNowNs();

/// The summary table of `rounds` rounds in `ring` (host pointer, kTraceRounds records). `clockLo` / `clockHi`:
/// bounds of (globaltimer - realtime) measured at creation, in ns.
std::string traceSummary(const TraceRound* ring, uint64_t rounds, int rank, int64_t clockLo, int64_t clockHi);

/// Writes the recorded rounds' stamps to `<prefix>.rank<rank>.jsonl`, one JSON object per round, every stamp in
/// host ns (device stamps minus the middle of the clock offset window; 0 = not stamped). Returns "" or what failed.
std::string traceDump(const std::string& prefix, const TraceRound* ring, uint64_t rounds, int rank, int64_t clockLo,
                      int64_t clockHi);

}  // namespace gpuproxy
}  // namespace epcomm
