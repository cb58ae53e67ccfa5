#include "backends/proxy/proxy_trace.hpp"

#include <time.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <vector>

namespace epcomm {
namespace gpuproxy {

uint64_t hostNowNs() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

namespace {

struct Phase {
  const char* name;
  uint64_t TraceRound::*from;
  uint64_t TraceRound::*to;
  const char* clocks;  // "gpu", "host" or "gpu->host" / "host->gpu" (two clocks)
};

const Phase kPhases[] = {
    {"dispatch: kernel pack (route + pack)", &TraceRound::packStart, &TraceRound::packReady, "gpu"},
    {"dispatch:   route kernel", &TraceRound::packStart, &TraceRound::routeEnd, "gpu"},
    {"dispatch:   route end -> pack kernel begins", &TraceRound::routeEnd, &TraceRound::packEntered, "gpu"},
    {"dispatch:   pack kernel", &TraceRound::packEntered, &TraceRound::packReady, "gpu"},
    {"dispatch: proxy sees the flag", &TraceRound::packReady, &TraceRound::proxySeen, "gpu->host"},
    {"dispatch: proxy post (flag seen -> heads posted)", &TraceRound::proxySeen, &TraceRound::proxyPosted, "host"},
    {"dispatch:   channel (flag seen -> post call begins)", &TraceRound::proxySeen, &TraceRound::proxyPosting, "host"},
    {"dispatch:   post call (engine + provider, heads)", &TraceRound::proxyPosting, &TraceRound::proxyPosted, "host"},
    {"dispatch: reaction (flag -> first fabric post)", &TraceRound::packReady, &TraceRound::proxyPosted, "gpu->host"},
    {"dispatch: wire (posted -> all peers in, tables out)", &TraceRound::proxyPosted, &TraceRound::proxyArrived,
     "host"},
    {"dispatch: kernel sees arrival", &TraceRound::proxyArrived, &TraceRound::unpackStart, "host->gpu"},
    {"dispatch: kernel unpack (rank + copy)", &TraceRound::unpackStart, &TraceRound::unpackEnd, "gpu"},
    {"dispatch:   rank kernel (arrival seen -> last block)", &TraceRound::unpackStart, &TraceRound::rankEnd, "gpu"},
    {"dispatch:   rank end -> copy kernel begins", &TraceRound::rankEnd, &TraceRound::copyEntered, "gpu"},
    {"dispatch:   copy kernel", &TraceRound::copyEntered, &TraceRound::unpackEnd, "gpu"},
    {"combine: kernel pack", &TraceRound::combStart, &TraceRound::combReady, "gpu"},
    {"combine: proxy sees the flag", &TraceRound::combReady, &TraceRound::combSeen, "gpu->host"},
    {"combine: proxy post (flag seen -> rows posted)", &TraceRound::combSeen, &TraceRound::combPosted, "host"},
    {"combine:   channel (flag seen -> post call begins)", &TraceRound::combSeen, &TraceRound::combPosting, "host"},
    {"combine:   post call (engine + provider, rows)", &TraceRound::combPosting, &TraceRound::combPosted, "host"},
    {"combine: reaction (flag -> first fabric post)", &TraceRound::combReady, &TraceRound::combPosted, "gpu->host"},
    {"combine: wire (posted -> all owners in)", &TraceRound::combPosted, &TraceRound::combArrived, "host"},
    {"combine: kernel sees arrival", &TraceRound::combArrived, &TraceRound::sumStart, "host->gpu"},
    {"combine: kernel weighted sum", &TraceRound::sumStart, &TraceRound::sumEnd, "gpu"},
};

}  // namespace

std::string traceSummary(const TraceRound* ring, uint64_t rounds, int rank, int64_t clockLo, int64_t clockHi) {
  std::ostringstream oss;
  const uint64_t n = std::min<uint64_t>(rounds, kTraceRounds);
  // A device stamp in host time: minus the middle of the measured offset window; rows across the two clocks are
  // good to half its width.
  const double offset = (static_cast<double>(clockLo) + static_cast<double>(clockHi)) / 2.0;
  oss << "epcomm proxy trace, rank " << rank << ": " << rounds << " rounds (" << n
      << " recorded); globaltimer - realtime in [" << clockLo / 1000.0 << ", " << clockHi / 1000.0
      << "] us at creation: rows across the two clocks are good to +-" << (clockHi - clockLo) / 2000.0 << " us\n";
  char line[256];
  std::snprintf(line, sizeof line, "  %-52s %10s %10s %6s  %s\n", "phase", "median us", "p90 us", "n", "clock");
  oss << line;
  for (const Phase& p : kPhases) {
    std::vector<double> us;
    for (uint64_t i = 0; i < n; ++i) {
      const TraceRound& r = ring[i];
      const uint64_t a = r.*(p.from), b = r.*(p.to);
      if (a == 0 || b == 0) continue;
      double d = static_cast<double>(b) - static_cast<double>(a);
      if (std::strcmp(p.clocks, "gpu->host") == 0) d += offset;
      if (std::strcmp(p.clocks, "host->gpu") == 0) d -= offset;
      us.push_back(d / 1000.0);
    }
    if (us.empty()) continue;
    std::sort(us.begin(), us.end());
    std::snprintf(line, sizeof line, "  %-52s %10.1f %10.1f %6zu  %s\n", p.name, us[us.size() / 2],
                  us[std::min(us.size() - 1, us.size() * 9 / 10)], us.size(), p.clocks);
    oss << line;
  }
  return oss.str();
}

std::string traceDump(const std::string& prefix, const TraceRound* ring, uint64_t rounds, int rank, int64_t clockLo,
                      int64_t clockHi) {
  const std::string path = prefix + ".rank" + std::to_string(rank) + ".jsonl";
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return "epcomm proxy trace: cannot write " + path + ": " + std::strerror(errno);
  const int64_t offset = (clockLo + clockHi) / 2;
  const uint64_t n = std::min<uint64_t>(rounds, kTraceRounds);
  struct Stamp {
    const char* name;
    uint64_t TraceRound::*at;
    bool device;
  };
  static const Stamp kStamps[] = {
      {"packStart", &TraceRound::packStart, true},      {"packReady", &TraceRound::packReady, true},
      {"proxySeen", &TraceRound::proxySeen, false},     {"proxyPosting", &TraceRound::proxyPosting, false},
      {"proxyPosted", &TraceRound::proxyPosted, false}, {"proxyArrived", &TraceRound::proxyArrived, false},
      {"unpackStart", &TraceRound::unpackStart, true},  {"unpackEnd", &TraceRound::unpackEnd, true},
      {"combStart", &TraceRound::combStart, true},      {"combReady", &TraceRound::combReady, true},
      {"combSeen", &TraceRound::combSeen, false},       {"combPosting", &TraceRound::combPosting, false},
      {"combPosted", &TraceRound::combPosted, false},   {"combArrived", &TraceRound::combArrived, false},
      {"sumStart", &TraceRound::sumStart, true},        {"sumEnd", &TraceRound::sumEnd, true},
      {"routeEnd", &TraceRound::routeEnd, true},        {"packEntered", &TraceRound::packEntered, true},
      {"rankEnd", &TraceRound::rankEnd, true},          {"copyEntered", &TraceRound::copyEntered, true},
  };
  // Rounds in the order they ran: the ring holds the last n of `rounds`.
  for (uint64_t round = rounds - n; round < rounds; ++round) {
    const TraceRound& r = ring[round % kTraceRounds];
    std::fprintf(f, "{\"rank\":%d,\"round\":%llu", rank, static_cast<unsigned long long>(round));
    for (const Stamp& s : kStamps) {
      const uint64_t v = r.*(s.at);
      const long long host = v == 0 ? 0 : static_cast<long long>(v) - (s.device ? offset : 0);
      std::fprintf(f, ",\"%s\":%lld", s.name, host);
    }
    std::fprintf(f, "}\n");
  }
  const bool ok = std::fclose(f) == 0;
  return ok ? "" : "epcomm proxy trace: writing " + path + " failed";
}

}  // namespace gpuproxy
}  // namespace epcomm
