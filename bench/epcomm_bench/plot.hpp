// --plot: draws epcomm-bench's JSON lines with scripts/plot (Python + matplotlib).
#pragma once

#include <string>

namespace epcomm {
namespace bench {

/// Runs `python3 <plot script> --out png json` and waits for it. The script is EPBENCH_PLOT if set, else
/// epcomm-bench-plot next to this executable (installed), else scripts/plot of the source tree this binary was built
/// from. Returns false with *why set when there is no script, no python3, or the script failed (it prints its own
/// reason, e.g. that matplotlib is missing).
bool drawPlot(const std::string& json, const std::string& png, std::string* why);

}  // namespace bench
}  // namespace epcomm
