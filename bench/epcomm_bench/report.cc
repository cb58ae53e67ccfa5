#include "report.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iostream>
#include <sstream>

namespace epcomm {
namespace bench {

namespace {

std::string num(double v) {
  if (v < 0) return "n/a";
  char b[32];
  std::snprintf(b, sizeof(b), "%.1f", v);
  return b;
}

std::string jnum(double v) {
  if (v < 0) return "null";
  char b[32];
  std::snprintf(b, sizeof(b), "%.3f", v);
  return b;
}

std::string jlist(const std::vector<double>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i > 0 ? "," : "") + jnum(v[i]);
  return s + "]";
}

// "12.3 / 12.9" (rank 0 / rank 1 / ...)
std::string byRank(const std::vector<double>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i > 0 ? " / " : "") + num(v[i]);
  return s;
}

std::string nowUtc() {
  char date[32];
  std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return date;
}

const char* kRowFormat = "%-8s %6s %5s | %9s %9s | %8s %8s %8s %8s | %8s %8s | %8s %9s | %8s %8s %6s | %8s %8s\n";

// (dispatch + combine) / (a2a.d + a2a.c): the target's measure; -1 where a time is missing.
double vsA2a(const Measurement& m) {
  if (m.dispatch < 0 || m.combine < 0 || m.a2aDispatch <= 0 || m.a2aCombine <= 0) return -1;
  return (m.dispatch + m.combine) / (m.a2aDispatch + m.a2aCombine);
}

std::string ratio(double v) {
  if (v < 0) return "n/a";
  char b[32];
  std::snprintf(b, sizeof(b), "%.2f", v);
  return b;
}

}  // namespace

Report::Report(const Options& o, int world, bool gpu, bool sharedGpu, std::string machine, std::string barrier)
    : o_(o),
      world_(world),
      gpu_(gpu),
      sharedGpu_(sharedGpu),
      machine_(std::move(machine)),
      barrier_(std::move(barrier)),
      rev_(revision(o)) {}

void Report::json(const std::string& line) {
  if (!o_.json.empty()) std::ofstream(o_.json, std::ios::app) << line;
}

void Report::header(const std::vector<std::string>& notes) {
  const char* blocks = std::getenv("EPCOMM_NVLINK_BLOCKS");
  const char* localSize = std::getenv("EPCOMM_PROXY_LOCAL_SIZE");  // proxy: same-node peers over NVLink or the fabric
  std::printf(
      "# epcomm-bench  backend=%s world=%d dp=%d iters=%d warmup=%d barrier=%s blocks=%s max-tokens=%s layout=%s "
      "rev=%s machine=%s\n",
      o_.backend.c_str(), world_, o_.dp, o_.iters, o_.warmup, barrier_.c_str(),
      blocks != nullptr && *blocks != '\0' ? blocks : "auto",
      o_.maxTokens > 0 ? std::to_string(o_.maxTokens).c_str() : "T", layoutName(o_.layout), rev_.c_str(),
      machine_.c_str());
  if (o_.backend == "proxy") {
    std::printf("# proxy: EPCOMM_PROXY_LOCAL_SIZE=%s (1: every peer over the fabric; unset: from the host names)\n",
                localSize != nullptr ? localSize : "unset");
  }
  std::printf(
      "# times in us (median, max over ranks); GB/s = cross-rank payload bytes per rank per direction / time\n");
  for (const std::string& n : notes) std::printf("# %s\n", n.c_str());
  std::printf(kRowFormat, "config", "tokens", "graph", "dispatch", "combine", "d.send", "d.recv", "c.send", "c.recv",
              "d.dev", "c.dev", "nccl", "nccl.pplx", "a2a.d", "a2a.c", "vs.a2a", "d.GB/s", "c.GB/s");
  std::fflush(stdout);
}

void Report::skew(const Skew& s) {
  const bool used = s.barrier == barrier_;
  std::printf("# barrier %s: exit skew between ranks median %.1f us, p90 %.1f us (%d rounds)%s\n", s.barrier.c_str(),
              s.medianUs, s.p90Us, s.rounds, used ? "  <- used for timing" : "");
  std::fflush(stdout);
  std::ostringstream f;
  f << "{\"bench\":\"epcomm-barrier-skew\",\"barrier\":\"" << s.barrier << "\",\"world\":" << world_
    << ",\"skew_median_us\":" << jnum(s.medianUs) << ",\"skew_p90_us\":" << jnum(s.p90Us) << ",\"rounds\":" << s.rounds
    << ",\"used\":" << (used ? "true" : "false") << ",\"rev\":\"" << rev_ << "\",\"machine\":\"" << machine_ << "\"}\n";
  json(f.str());
}

void Report::floor(int blocks, double emptyUs, double emptyHostUs, double emptyLikeUs, unsigned likeSmemKb,
                   double flagUs, double flagDeviceUs) {
  std::printf(
      "# floor (%d blocks of 512 threads, median, max over ranks): empty kernel %.1f us (launch call %.1f us on the "
      "host; %.1f us with 512 B of parameters and %u KB of shared memory); one flag each way %.1f us eager, %.1f us "
      "device-only\n",
      blocks, emptyUs, emptyHostUs, emptyLikeUs, likeSmemKb, flagUs, flagDeviceUs);
  std::fflush(stdout);
  std::ostringstream f;
  f << "{\"bench\":\"epcomm-floor\",\"world\":" << world_ << ",\"blocks\":" << blocks << ",\"empty_us\":" << emptyUs
    << ",\"empty_host_us\":" << emptyHostUs << ",\"empty_like_us\":" << emptyLikeUs << ",\"flag_us\":" << flagUs
    << ",\"flag_device_us\":" << flagDeviceUs << ",\"iters\":" << o_.iters << ",\"rev\":\"" << rev_
    << "\",\"machine\":\"" << machine_ << "\"}\n";
  json(f.str());
}

void Report::row(const RowInfo& r, const Measurement& m) {
  const double dGb = m.dispatch > 0 ? r.dispatchBytes / (m.dispatch * 1e3) : -1;
  const double cGb = m.combine > 0 ? r.combineBytes / (m.combine * 1e3) : -1;
  const bool g = r.graph;
  std::printf(kRowFormat, r.config.c_str(), std::to_string(r.tokens).c_str(), g ? "yes" : "no", num(m.dispatch).c_str(),
              num(m.combine).c_str(), g ? "-" : num(m.dSend).c_str(), g ? "-" : num(m.dRecv).c_str(),
              g ? "-" : num(m.cSend).c_str(), g ? "-" : num(m.cRecv).c_str(), num(m.dDev).c_str(), num(m.cDev).c_str(),
              num(m.nccl).c_str(), num(m.ncclPplx).c_str(), num(m.a2aDispatch).c_str(), num(m.a2aCombine).c_str(),
              ratio(vsA2a(m)).c_str(), num(dGb).c_str(), num(cGb).c_str());
  if (m.dHost >= 0) {
    std::printf("#   host time inside the eager calls (median, max over ranks): dispatch %.1f us, combine %.1f us\n",
                m.dHost, m.cHost);
    std::printf("#   eager medians by rank: dispatch %s, combine %s; host time inside dispatch %s\n",
                byRank(m.dRanks).c_str(), byRank(m.cRanks).c_str(), byRank(m.dHostRanks).c_str());
  }
  std::fflush(stdout);
  const Config& c = r.c;
  std::ostringstream f;
  f << "{\"backend\":\"" << r.backend << "\",\"world\":" << world_ << ",\"dp\":" << c.dpSize << ",\"config\":\""
    << r.config << "\",\"layout\":\"" << layoutName(c.layout) << "\",\"tokens\":" << r.tokens
    << ",\"max_tokens\":" << c.maxNumTokens << ",\"graph\":" << (g ? "true" : "false")
    << ",\"dispatch_us\":" << jnum(m.dispatch) << ",\"combine_us\":" << jnum(m.combine)
    << ",\"dispatch_send_us\":" << jnum(g ? -1 : m.dSend) << ",\"dispatch_recv_us\":" << jnum(g ? -1 : m.dRecv)
    << ",\"combine_send_us\":" << jnum(g ? -1 : m.cSend) << ",\"combine_recv_us\":" << jnum(g ? -1 : m.cRecv)
    << ",\"dispatch_device_us\":" << jnum(m.dDev) << ",\"combine_device_us\":" << jnum(m.cDev)
    << ",\"nccl_us\":" << jnum(m.nccl) << ",\"nccl_pplx_us\":" << jnum(m.ncclPplx)
    << ",\"fabric_a2a_us\":" << jnum(m.a2aDispatch) << ",\"fabric_a2a_combine_us\":" << jnum(m.a2aCombine)
    << ",\"fabric_a2a_ratio\":" << jnum(vsA2a(m));
  if (!r.fabricProvider.empty()) f << ",\"fabric_provider\":\"" << r.fabricProvider << "\"";
  if (m.dHost >= 0) {
    f << ",\"dispatch_host_us\":" << jnum(m.dHost) << ",\"combine_host_us\":" << jnum(m.cHost)
      << ",\"dispatch_us_by_rank\":" << jlist(m.dRanks) << ",\"combine_us_by_rank\":" << jlist(m.cRanks)
      << ",\"dispatch_host_us_by_rank\":" << jlist(m.dHostRanks);
  }
  const char* blocks = std::getenv("EPCOMM_NVLINK_BLOCKS");
  const char* localSize = std::getenv("EPCOMM_PROXY_LOCAL_SIZE");  // proxy: same-node peers over NVLink or the fabric
  f << ",\"dispatch_bytes_per_rank\":" << static_cast<uint64_t>(r.dispatchBytes)
    << ",\"pplx_bytes_rank0\":" << r.pplxBytes
    << ",\"combine_bytes_per_rank\":" << static_cast<uint64_t>(r.combineBytes)
    << ",\"combine_bytes_rank0\":" << r.combineBytes0 << ",\"buffer_bytes\":" << r.bufferBytes
    << ",\"shared_gpu\":" << (sharedGpu_ ? "true" : "false") << ",\"barrier\":\"" << barrier_
    << "\",\"nvlink_blocks_env\":\"" << (blocks != nullptr ? blocks : "") << "\",\"proxy_local_size_env\":\""
    << (localSize != nullptr ? localSize : "") << "\",\"iters\":" << o_.iters << ",\"warmup\":" << o_.warmup
    << ",\"rev\":\"" << rev_ << "\",\"machine\":\"" << machine_ << "\",\"date\":\"" << nowUtc() << "\"}\n";
  json(f.str());
  if (!gpu_) rows_.push_back(f.str());
}

void Report::fabricOps(const std::string& backend, const std::string& config, uint32_t tokens,
                       const TransferStats& st) {
  double ops[4] = {0, 0, 0, 0}, bytes = 0;
  for (const PeerTransferStats& p : st.peers) {
    ops[0] += p.headWrites;
    ops[1] += p.bulkWrites;
    ops[2] += p.combineWrites;
    ops[3] += p.barrierImms;
    bytes += p.bytes;
  }
  const double n = static_cast<double>(std::max<uint64_t>(st.dispatchRounds, 1)) * std::max(world_ - 1, 1);
  std::printf(
      "# fabric ops per peer per round (%s, %llu rounds, provider %s, private area %u tokens): head %.2f, bulk %.2f, "
      "combine %.2f, barrier %.2f, writes %.2f, bytes %.0f\n",
      config.c_str(), static_cast<unsigned long long>(st.dispatchRounds), st.provider.c_str(), st.privateTokens,
      ops[0] / n, ops[1] / n, ops[2] / n, ops[3] / n, (ops[0] + ops[1] + ops[2]) / n, bytes / n);
  std::fflush(stdout);
  char line[640];
  std::snprintf(line, sizeof(line),
                "{\"bench\":\"epcomm-fabric-ops\",\"backend\":\"%s\",\"config\":\"%s\",\"world\":%d,\"tokens\":%u,"
                "\"provider\":\"%s\",\"private_tokens\":%u,\"head_writes_per_peer_round\":%.3f,"
                "\"bulk_writes_per_peer_round\":%.3f,\"combine_writes_per_peer_round\":%.3f,"
                "\"barrier_imms_per_peer_round\":%.3f,\"writes_per_peer_round\":%.3f,\"bytes_per_peer_round\":%.0f}\n",
                backend.c_str(), config.c_str(), world_, tokens, st.provider.c_str(), st.privateTokens, ops[0] / n,
                ops[1] / n, ops[2] / n, ops[3] / n, (ops[0] + ops[1] + ops[2]) / n, bytes / n);
  json(line);
  if (!gpu_) extras_.push_back(line);
}

void Report::fp8Row(const Fp8Row& r) {
  const char* format = "%-8s %6s %-9s | %9s %9s %9s | %8s | %8s | %s\n";
  if (!fp8Header_) {
    fp8Header_ = true;
    std::printf(
        "# --fp8: dispatch of bf16 tokens that arrive as fp8 e4m3 + fp32 scales per 128 (DeepEP's low-latency "
        "use_fp8). fused: the dispatch casts (Config::dispatchCast); separate: a cast kernel, then the dispatch of its "
        "fp8 output. dispatch / d.dev / graph: the whole path (separate: cast + dispatch), eager with the launches, "
        "with the launches hidden, and replayed from one CUDA graph; cast: the cast kernel alone\n");
    std::printf(format, "config", "tokens", "mode", "dispatch", "d.dev", "graph", "cast", "combine", "same bits");
  }
  const char* same = r.sameBits < 0 ? "-" : r.sameBits ? "yes" : "NO";
  std::printf(format, r.config.c_str(), std::to_string(r.tokens).c_str(), r.mode.c_str(), num(r.dispatch).c_str(),
              num(r.dispatchDev).c_str(), num(r.graph).c_str(), r.mode == "fused" ? "-" : num(r.cast).c_str(),
              num(r.combine).c_str(), same);
  std::fflush(stdout);
  std::ostringstream f;
  f << "{\"bench\":\"epcomm-fp8-cast\",\"backend\":\"" << r.backend << "\",\"world\":" << world_
    << ",\"dp\":" << r.c.dpSize << ",\"config\":\"" << r.config << "\",\"layout\":\"" << layoutName(r.c.layout)
    << "\",\"tokens\":" << r.tokens << ",\"max_tokens\":" << r.c.maxNumTokens << ",\"mode\":\"" << r.mode
    << "\",\"dispatch_us\":" << jnum(r.dispatch) << ",\"dispatch_device_us\":" << jnum(r.dispatchDev)
    << ",\"dispatch_graph_us\":" << jnum(r.graph) << ",\"cast_us\":" << jnum(r.cast)
    << ",\"combine_us\":" << jnum(r.combine) << ",\"same_bits\":"
    << (r.sameBits < 0 ? "null"
        : r.sameBits   ? "true"
                       : "false")
    << ",\"shared_gpu\":" << (sharedGpu_ ? "true" : "false") << ",\"iters\":" << o_.iters << ",\"warmup\":" << o_.warmup
    << ",\"rev\":\"" << rev_ << "\",\"machine\":\"" << machine_ << "\",\"date\":\"" << nowUtc() << "\"}\n";
  json(f.str());
  if (!gpu_) rows_.push_back(f.str());
}

void Report::finish() {
  if (gpu_ || (rows_.empty() && extras_.empty())) return;
  std::printf("# JSON lines: one per table row, then the fabric operations per configuration\n");
  for (const std::string& j : rows_) std::fputs(j.c_str(), stdout);
  for (const std::string& j : extras_) std::fputs(j.c_str(), stdout);
  std::fflush(stdout);
}

}  // namespace bench
}  // namespace epcomm
