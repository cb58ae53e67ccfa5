// planProxy: every buffer of a proxy backend object, by pure arithmetic on the Config (no GPU, no fabric), so that
// `epcomm-plan --backend proxy` runs on machines without either.
#include <string>
#include <vector>

#include "backends/backends.hpp"
#include "backends/proxy/proxy_kernels.hpp"
#include "core/env.hpp"
#include "proxy/protocol.hpp"

namespace epcomm {
namespace backends {

std::vector<PlannedBuffer> planProxy(const Config& config) {
  const proxy::ProtocolSizes s = proxy::computeSizes(config, -1);
  const gpuproxy::TableGeometry tg = gpuproxy::tableGeometry(s);
  const gpuproxy::ScratchGeometry sg = gpuproxy::scratchGeometry(s, config.maxNumTokens);
  const std::string W = std::to_string(s.worldSize);
  const std::string entry = std::to_string(s.entryBytes) + " B/entry";
  auto pages = [](uint64_t bytes) { return roundUpPow2(bytes > 0 ? bytes : 1, 4096); };
  const std::string staged = "host pinned (mapped, registered)";
  std::vector<PlannedBuffer> plan;
  auto add = [&](const std::string& name, const std::string& memory, uint64_t bytes, const std::string& note) {
    plan.push_back(PlannedBuffer{"proxy", name, memory, bytes, note});
  };
  add("memory path", "-", 0,
      "staging through pinned host memory mapped into the GPU (tcp, shm: no FI_HMEM); GPU memory registered with "
      "FI_HMEM (efa, verbs + GPUDirect RDMA) is not built (docs/proxy.md)");
  add("dispatch send", staged, pages(s.sendBytes),
      W + " slots x (head " + std::to_string(s.headBytes) + " B + " + std::to_string(s.maxSendTokens) + " entries x " +
          entry + "), written by the pack kernel");
  add("dispatch receive", staged, pages(s.recvBytes),
      W + " private areas x " + std::to_string(s.privateTokens) + " tokens (EPCOMM_PRIVATE_TOKENS) + " +
          std::to_string(s.overflowEntries) + " overflow entries, read by the copy kernel");
  add("combine send", staged, pages(s.combineSendBytesMax),
      std::to_string(s.combineSendRows) + " rows (G x T x min(K, L)) x " + std::to_string(s.combineRowBytesMax) +
          " B (fp32): fixed at the worst case, since kernels write it through a mapping made once");
  add("combine receive", staged, pages(s.combineRecvBytes),
      std::to_string(s.combineRecvRows) + " rows (T x K) x " + std::to_string(s.combineRowBytesMax) + " B (fp32)");
  add("mailbox", "host pinned (mapped)", sizeof(gpuproxy::Mailbox),
      "ready / arrived round counters both ways, abort word, kernel error record");
  add("round tables", "host pinned (mapped)", 4ull * tg.words,
      "u32: entries, offsets and combine row bases of the round, written by the proxy thread");
  add("routing scratch", "device", sg.offHist,
      "round counters, experts i32 [T][K], rows u64 [T][K], entry indices u32 [T][K]");
  add("ranking scratch", "device", sg.offRowOf - sg.offHist,
      "per-chunk counts [32][max(E, W)] and [W][32][L], entry sizes [W][maxSend]");
  add("received rows", "device", sg.bytes - sg.offRowOf,
      "u32 [W][maxSend=" + std::to_string(s.maxSendTokens) + "][min(K, L)=" + std::to_string(s.maxLocalPerEntry) +
          "]: output row of each received entry's experts");
  if (envInt("EPCOMM_PROXY_TRACE") != 0) {
    add("trace ring", "host pinned (mapped)", sizeof(gpuproxy::TraceRound) * gpuproxy::kTraceRounds,
        "EPCOMM_PROXY_TRACE: per-round phase stamps");
  }
  return plan;
}

}  // namespace backends
}  // namespace epcomm
