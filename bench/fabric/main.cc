// epcomm-fabric-bench: TransferEngine latency (ping-pong of write-with-immediate) and bandwidth (size sweep with
// several writes in flight) between two processes on this host, per provider, beside fi_pingpong's numbers on the
// same provider measured in the same run. Prints a table and JSON lines; asserts nothing about time.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "epcomm/error.hpp"
#include "epcomm/fabric/transfer_engine.hpp"
#include "fork_group.hpp"

namespace {

using namespace epcomm;
using namespace epcomm::fabric;
namespace fg = epcomm::bench::forkgroup;

struct Args {
  std::vector<std::string> providers = {"tcp", "shm"};
  uint64_t minSize = 8;
  uint64_t maxSize = 64ull << 20;
  int inflight = 8;
  double secondsPerPoint = 0.25;
  std::string rev;
  std::string json;
  bool baseline = true;
  int port = 47700;
  uint64_t crossSize = 8ull << 20;  ///< bytes each rank writes to the other in the crossing mode (0: skip it)
  double crossSkewUs = 20;          ///< how much later rank 1 posts than rank 0 in the crossing mode
  uint64_t crossPieces = 1;         ///< crossing mode: writes per round, each size / pieces bytes with an immediate
  double crossPaceUs = 0;           ///< crossing mode: piece j is posted j * pace us after the first (a pack's rate)
};

struct Row {
  std::string tool, provider, mode;
  uint64_t size = 0;
  uint64_t iters = 0;
  double latencyUs = 0;
  double gbps = 0;
  double postUs = -1;  ///< crossing mode: median time the later rank's post call took
};

std::string shell(const std::string& cmd) {
  std::string out;
  FILE* f = popen(cmd.c_str(), "r");
  if (f == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  pclose(f);
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

std::string machine() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string cpu = "unknown cpu";
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  }
  return std::string(host) + " / " + cpu + " x" + std::to_string(sysconf(_SC_NPROCESSORS_ONLN));
}

std::string jsonEscape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o;
}

std::string sizeText(uint64_t s) {
  if (s >= (1ull << 20) && s % (1ull << 20) == 0) return std::to_string(s >> 20) + "M";
  if (s >= 1024 && s % 1024 == 0) return std::to_string(s >> 10) + "K";
  return std::to_string(s);
}

std::vector<uint64_t> sweep(const Args& a) {
  std::vector<uint64_t> sizes;
  for (uint64_t s = a.minSize; s <= a.maxSize; s *= 4) sizes.push_back(s);
  if (sizes.empty() || sizes.back() != a.maxSize) sizes.push_back(a.maxSize);
  // 64 KiB is where the bandwidth goal starts: always measure it.
  if (a.minSize <= 65536 && a.maxSize >= 65536 && std::find(sizes.begin(), sizes.end(), 65536) == sizes.end()) {
    sizes.insert(std::upper_bound(sizes.begin(), sizes.end(), 65536), 65536);
  }
  return sizes;
}

uint64_t itersFor(uint64_t size, double seconds, double assumedGBps) {
  // Enough iterations for ~`seconds` at the assumed rate, bounded for tiny and huge sizes.
  double perIterUs = 20.0 + static_cast<double>(size) / (assumedGBps * 1e3);
  uint64_t n = static_cast<uint64_t>(seconds * 1e6 / perIterUs);
  return std::max<uint64_t>(5, std::min<uint64_t>(n, 20000));
}

// Crossing writes: each round both ranks write `size` bytes with an immediate to each other, rank 1 `skew` us after
// rank 0 (as two ranks of an all-to-all whose kernels finish a little apart), and wait for the peer's write and their
// own completion. What it shows: whether a post waits while the engine moves the peer's incoming bytes (a provider
// that copies inside its progress call, like shm's CMA read of a large write). Row: round time and rank 1's post
// call, medians. With pieces > 1 each rank splits its bytes into that many writes, each with an immediate, posted
// `pace` us apart (as a kernel that hands over its rows in pieces while it packs): whether the provider moves pieces
// as fast as one write (the round against the one-write round of the same size).
Row crossing(const Args& a, fg::Comm& comm, TransferEngine& engine, PeerId peer, const MemoryRegion& region,
             const MemoryDesc& remote, const std::string& prov) {
  const uint64_t size = a.crossSize;
  const uint64_t iters = std::max<uint64_t>(20, itersFor(size, 4 * a.secondsPerPoint, 2.0));
  std::vector<double> round, post;
  std::atomic<uint64_t> done{0};
  Completion c;
  c.counter = &done;
  for (uint64_t i = 0; i < iters + 3; ++i) {
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    if (comm.rank() == 1) {
      while (std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() < a.crossSkewUs) {
      }
    }
    const uint64_t n = a.crossPieces, piece = size / n;
    const auto p0 = std::chrono::steady_clock::now();
    auto p1 = p0;
    for (uint64_t j = 0; j < n; ++j) {
      if (j > 0) {
        while (std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - p0).count() <
               a.crossPaceUs * static_cast<double>(j)) {
        }
      }
      const uint64_t off = j * piece, len = j + 1 == n ? size - off : piece;
      engine.write(peer, region, off, remote, a.maxSize + off, len, true, 5, c);
      if (j == 0) p1 = std::chrono::steady_clock::now();
    }
    engine.waitImm(5, n, "crossing write from the peer");
    engine.waitCounter(done, (i + 1) * n, "crossing write's local completion");
    const auto t1 = std::chrono::steady_clock::now();
    if (i < 3) continue;  // warm-up
    round.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    post.push_back(std::chrono::duration<double, std::micro>(p1 - p0).count());
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  // Rank 1's post is the one that can land inside rank 0's write; rank 0 reports it (and the slower round).
  double mine[2] = {median(round), median(post)};
  auto all = comm.allGather(std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(mine),
                                                 reinterpret_cast<const uint8_t*>(mine) + sizeof mine));
  double theirs[2];
  std::memcpy(theirs, all[1].data(), sizeof theirs);
  Row r{"epcomm-fabric-bench", prov, "crossing", size, iters, std::max(mine[0], theirs[0]), 0, theirs[1]};
  r.gbps = static_cast<double>(size) * 8.0 / (r.latencyUs * 1e3);
  return r;
}

// One provider: two forked ranks; rank 0 writes its rows to `outPath`.
void runEngine(const Args& a, const std::string& provider, const std::string& outPath) {
  auto results = fg::run(2, [&](fg::Comm& comm) {
    EngineOptions o;
    o.provider = provider;
    o.timeoutMs = 60000;
    auto engine = TransferEngine::create(o);
    auto addrs = comm.allGather(engine->address());
    PeerId peer = engine->addPeer(addrs[1 - comm.rank()]);
    std::vector<uint8_t> mem(2 * a.maxSize, static_cast<uint8_t>(comm.rank()));
    auto region = engine->registerMemory(mem.data(), mem.size());
    auto descs = comm.allGather(region->desc().serialize());
    MemoryDesc remote = MemoryDesc::deserialize(descs[1 - comm.rank()].data(), descs[1 - comm.rank()].size());
    std::vector<Row> rows;
    const std::string prov = engine->providerName();
    std::atomic<uint64_t> done{0};
    uint64_t posted = 0;
    for (uint64_t size : sweep(a)) {
      // Latency: ping-pong of write-with-immediate; one-way latency = round trip / 2 (fi_pingpong's usec/xfer).
      const uint64_t iters = itersFor(size, a.secondsPerPoint, 1.0);
      const uint64_t warm = std::max<uint64_t>(2, iters / 10);
      comm.barrier();
      auto t0 = std::chrono::steady_clock::now();
      for (uint64_t i = 0; i < warm + iters; ++i) {
        if (i == warm) t0 = std::chrono::steady_clock::now();
        if (comm.rank() == 0) {
          engine->write(peer, *region, 0, remote, a.maxSize, size, true, 1, {});
          engine->waitImm(2, 1, "pong");
        } else {
          engine->waitImm(1, 1, "ping");
          engine->write(peer, *region, 0, remote, a.maxSize, size, true, 2, {});
        }
      }
      double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      Row lat{"epcomm-fabric-bench", prov, "pingpong", size, iters, us / (2.0 * iters), 0};
      lat.gbps = size * 8.0 / (lat.latencyUs * 1e3);
      // Bandwidth: `inflight` writes outstanding, the receiver counts immediates and acknowledges the last.
      const uint64_t n =
          std::max<uint64_t>(static_cast<uint64_t>(a.inflight) * 2, itersFor(size, a.secondsPerPoint, 2.0));
      comm.barrier();
      t0 = std::chrono::steady_clock::now();
      if (comm.rank() == 0) {
        Completion c;
        c.counter = &done;
        for (uint64_t i = 0; i < n; ++i) {
          if (posted - done.load(std::memory_order_acquire) >= static_cast<uint64_t>(a.inflight)) {
            engine->waitCounter(done, posted - a.inflight + 1, "bandwidth window");
          }
          // Same source and destination for every write, as fi_pingpong and ib_write_bw reuse their buffers.
          engine->write(peer, *region, 0, remote, a.maxSize, size, true, 3, c);
          ++posted;
        }
        engine->waitCounter(done, posted, "bandwidth drain");
        engine->waitImm(4, 1, "bandwidth acknowledgement");
      } else {
        engine->waitImm(3, n, "bandwidth stream");
        engine->immediate(peer, 4, {});
      }
      us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      Row bw{"epcomm-fabric-bench", prov, "stream", size, n, us / n, 0};
      bw.gbps = static_cast<double>(size) * n * 8.0 / (us * 1e3);
      rows.push_back(lat);
      rows.push_back(bw);
    }
    if (a.crossSize > 0) rows.push_back(crossing(a, comm, *engine, peer, *region, remote, prov));
    comm.barrier("end");
    if (comm.rank() == 0) {
      std::ofstream out(outPath);
      for (const Row& r : rows) {
        out << r.tool << ' ' << r.provider << ' ' << r.mode << ' ' << r.size << ' ' << r.iters << ' ' << r.latencyUs
            << ' ' << r.gbps << ' ' << r.postUs << '\n';
      }
    }
  });
  for (const auto& r : results) {
    if (!r.ok())
      std::fprintf(stderr, "epcomm-fabric-bench: %s rank %d failed: %s\n", provider.c_str(), r.rank, r.error.c_str());
  }
}

// fi_pingpong on the same provider and size; parses "bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec".
bool runPingpong(const std::string& provider, uint64_t size, uint64_t iters, int port, Row* row) {
  std::string common =
      "fi_pingpong -p '" + provider + "' -e rdm -I " + std::to_string(iters) + " -S " + std::to_string(size) + " ";
  std::string server = "timeout 120 " + common + "-B " + std::to_string(port) + " >/dev/null 2>&1 &";
  if (std::system(server.c_str()) != 0) return false;
  usleep(300000);
  std::string out = shell("timeout 120 " + common + "-P " + std::to_string(port) + " 127.0.0.1 2>&1");
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::vector<std::string> f;
    std::string w;
    while (ls >> w) f.push_back(w);
    if (f.size() < 8 || f[0] == "bytes") continue;
    row->tool = "fi_pingpong";
    row->provider = provider;
    row->mode = "pingpong";
    row->size = size;
    row->iters = iters;
    row->gbps = std::atof(f[5].c_str()) * 8.0 / 1000.0;
    row->latencyUs = std::atof(f[6].c_str());
    return true;
  }
  std::fprintf(stderr, "fi_pingpong %s size %llu: no result:\n%s\n", provider.c_str(),
               static_cast<unsigned long long>(size), out.c_str());
  return false;
}

void usage() {
  std::printf(
      "usage: epcomm-fabric-bench [--provider tcp,shm] [--min 8] [--max 67108864] [--inflight 8]\n"
      "                           [--seconds 0.25] [--rev REV] [--json FILE] [--no-baseline] [--port 47700]\n"
      "                           [--cross-size 8388608 (0: no crossing rows)] [--cross-skew-us 20]\n"
      "                           [--cross-pieces 1] [--cross-pace-us 0]\n");
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        usage();
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--provider") {
      a.providers.clear();
      std::stringstream ss(val());
      std::string p;
      while (std::getline(ss, p, ',')) a.providers.push_back(p);
    } else if (k == "--min") {
      a.minSize = std::strtoull(val().c_str(), nullptr, 10);
    } else if (k == "--max") {
      a.maxSize = std::strtoull(val().c_str(), nullptr, 10);
    } else if (k == "--inflight") {
      a.inflight = std::atoi(val().c_str());
    } else if (k == "--seconds") {
      a.secondsPerPoint = std::atof(val().c_str());
    } else if (k == "--rev") {
      a.rev = val();
    } else if (k == "--json") {
      a.json = val();
    } else if (k == "--no-baseline") {
      a.baseline = false;
    } else if (k == "--port") {
      a.port = std::atoi(val().c_str());
    } else if (k == "--cross-size") {
      a.crossSize = std::strtoull(val().c_str(), nullptr, 10);
    } else if (k == "--cross-skew-us") {
      a.crossSkewUs = std::atof(val().c_str());
    } else if (k == "--cross-pieces") {
      a.crossPieces = std::strtoull(val().c_str(), nullptr, 10);
    } else if (k == "--cross-pace-us") {
      a.crossPaceUs = std::atof(val().c_str());
    } else {
      usage();
      return k == "--help" || k == "-h" ? 0 : 2;
    }
  }
  if (a.minSize == 0 || a.maxSize < a.minSize || a.inflight < 1 || a.crossSize > a.maxSize || a.crossPieces < 1 ||
      a.crossPieces > std::max<uint64_t>(1, a.crossSize)) {
    usage();
    return 2;
  }
  if (a.rev.empty()) a.rev = shell("git rev-parse --short HEAD 2>/dev/null");
  if (a.rev.empty()) a.rev = "unknown";
  const std::string mach = machine();
  std::vector<Row> all;
  for (const std::string& prov : a.providers) {
    char tmpl[] = "/tmp/epcomm-fabric-bench-XXXXXX";
    int fd = mkstemp(tmpl);
    if (fd >= 0) close(fd);
    runEngine(a, prov, tmpl);
    std::ifstream in(tmpl);
    Row r;
    while (in >> r.tool >> r.provider >> r.mode >> r.size >> r.iters >> r.latencyUs >> r.gbps >> r.postUs) {
      all.push_back(r);
    }
    unlink(tmpl);
    if (!a.baseline) continue;
    int port = a.port;
    for (uint64_t size : sweep(a)) {
      Row b;
      if (runPingpong(prov, size, itersFor(size, a.secondsPerPoint, 1.0), port++, &b)) all.push_back(b);
    }
  }
  // Table: per provider and size, ours beside fi_pingpong.
  std::printf("%-12s %9s | %11s %9s %10s | %11s %9s | %8s %8s\n", "provider", "size", "lat_us", "pp_gbps",
              "stream_gbps", "fi_pp_lat", "fi_pp_gbps", "lat_x", "bw_pct");
  std::map<std::pair<std::string, uint64_t>, std::map<std::string, Row>> byKey;
  std::vector<std::pair<std::string, uint64_t>> order;
  for (const Row& r : all) {
    if (r.mode == "crossing") continue;  // its own lines below the table
    std::string prov = r.tool == "fi_pingpong" ? r.provider : r.provider;
    // Group our provider names ("tcp;ofi_rxm") with the requested fi_pingpong name ("tcp").
    std::string key = prov.substr(0, prov.find(';'));
    auto k = std::make_pair(key, r.size);
    if (byKey.find(k) == byKey.end()) order.push_back(k);
    byKey[k][r.tool + "/" + r.mode] = r;
  }
  for (const auto& k : order) {
    auto& m = byKey[k];
    const Row* lat = m.count("epcomm-fabric-bench/pingpong") ? &m["epcomm-fabric-bench/pingpong"] : nullptr;
    const Row* bw = m.count("epcomm-fabric-bench/stream") ? &m["epcomm-fabric-bench/stream"] : nullptr;
    const Row* pp = m.count("fi_pingpong/pingpong") ? &m["fi_pingpong/pingpong"] : nullptr;
    std::printf("%-12s %9s | %11.2f %9.3f %10.3f | %11.2f %9.3f | %8.2f %7.0f%%\n", k.first.c_str(),
                sizeText(k.second).c_str(), lat ? lat->latencyUs : 0.0, lat ? lat->gbps : 0.0, bw ? bw->gbps : 0.0,
                pp ? pp->latencyUs : 0.0, pp ? pp->gbps : 0.0, (lat && pp) ? lat->latencyUs / pp->latencyUs : 0.0,
                (bw && pp && pp->gbps > 0) ? 100.0 * bw->gbps / pp->gbps : 0.0);
  }
  for (const Row& r : all) {
    if (r.mode != "crossing") continue;
    std::printf(
        "%-12s %9s | crossing writes in %llu piece(s) %.0f us apart, rank 1 posts %.0f us after rank 0: round %.1f us "
        "(%.3f Gb/s each way), rank 1's first post call %.1f us\n",
        r.provider.substr(0, r.provider.find(';')).c_str(), sizeText(r.size).c_str(),
        static_cast<unsigned long long>(a.crossPieces), a.crossPaceUs, a.crossSkewUs, r.latencyUs, r.gbps, r.postUs);
  }
  std::FILE* json = a.json.empty() ? nullptr : std::fopen(a.json.c_str(), "a");
  for (const Row& r : all) {
    char line[1024];
    std::snprintf(
        line, sizeof(line),
        "{\"tool\":\"%s\",\"provider\":\"%s\",\"mode\":\"%s\",\"size\":%llu,\"iters\":%llu,"
        "\"latency_us\":%.3f,\"gbps\":%.4f,\"inflight\":%d,\"post_us\":%.3f,\"rev\":\"%s\",\"machine\":\"%s\"}",
        r.tool.c_str(), jsonEscape(r.provider).c_str(), r.mode.c_str(), static_cast<unsigned long long>(r.size),
        static_cast<unsigned long long>(r.iters), r.latencyUs, r.gbps, r.mode == "stream" ? a.inflight : 1, r.postUs,
        jsonEscape(a.rev).c_str(), jsonEscape(mach).c_str());
    std::printf("%s\n", line);
    if (json != nullptr) std::fprintf(json, "%s\n", line);
  }
  if (json != nullptr) std::fclose(json);
  return 0;
}
