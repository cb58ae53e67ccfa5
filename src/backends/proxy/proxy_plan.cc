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
  // Ranks per node: EPCOMM_PROXY_LOCAL_SIZE; 0 (counted from the host names at creation) is planned as one node.
  const int64_t wanted = envInt("EPCOMM_PROXY_LOCAL_SIZE");
  const uint32_t localSize = wanted == 0
                                 ? config.worldSize
                                 : (wanted > 0 && config.worldSize % wanted == 0 ? static_cast<uint32_t>(wanted) : 1u);
  const gpuproxy::LocalGeometry lg = gpuproxy::localGeometry(s, localSize, config.rank);
  const gpuproxy::ScratchGeometry sg = gpuproxy::scratchGeometry(s, config.maxNumTokens, lg.size);
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
  if (lg.size == 0) {
    add("same-node peers", "-", 0,
        "none: every peer over the fabric (EPCOMM_PROXY_LOCAL_SIZE = " + std::to_string(wanted) +
            (wanted > 1 ? ", which does not divide the world)" : ")"));
  } else {
    const std::string n = std::to_string(lg.size);
    add("same-node peers", "-", 0,
        n + " ranks per node" +
            (wanted == 0 ? std::string(" (EPCOMM_PROXY_LOCAL_SIZE = 0: from the host names at creation; planned as one "
                                       "node)")
                         : std::string(" (EPCOMM_PROXY_LOCAL_SIZE)")) +
            ": entries and combine rows GPU to GPU over NVLink, stored by the send kernels into the receiver's region "
            "(CUDA IPC); heads and immediates through the channel");
    const std::string region = "device (CUDA IPC, mapped by the node's ranks)";
    add("NVLink flags", region, lg.offEntries, "u64 [2][" + n + "]: rounds each node sender / owner stored here");
    add("NVLink entries", region, lg.offRows - lg.offEntries,
        n + " senders x " + std::to_string(s.maxSendTokens) + " entries x " + entry + ", by entry index");
    add("NVLink combine rows", region, lg.bytes - lg.offRows,
        std::to_string(s.combineRecvRows) + " rows (T x K) x " + std::to_string(s.combineRowBytesMax) +
            " B (fp32), at the channel's combine receive offsets");
  }
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
  add("round tables", "host pinned (mapped)", gpuproxy::tableBytes(tg),
      "u32: entries, offsets and combine row bases of the round, written by the proxy thread");
  add("routing scratch", "device", sg.offHist,
      "round counters, experts i32 [T][K], rows u64 [T][K], entry indices u32 [T][K]");
  add("ranking scratch", "device", sg.offRowOf - sg.offHist,
      "per-chunk counts [32][max(E, W)] and [W][32][L], entry sizes [W][maxSend]");
  add("received rows", "device", sg.offTables - sg.offRowOf,
      "u32 [W][maxSend=" + std::to_string(s.maxSendTokens) + "][min(K, L)=" + std::to_string(s.maxLocalPerEntry) +
          "]: output row of each received entry's experts");
  add("tables copy", "device", sg.offOwnEntries - sg.offTables,
      "the round tables as the copy and combine kernels read them" +
          std::string(lg.size > 0 ? ", the node ranks' region addresses" : ""));
  if (lg.size == 0) {
    add("own entries", "device", sg.offOwnRows - sg.offOwnEntries,
        std::to_string(s.maxSendTokens) + " entries x " + entry +
            ": this rank's entries for itself, which never cross PCIe");
    add("own combine rows", "device", sg.bytes - sg.offOwnRows,
        std::to_string(static_cast<uint64_t>(config.maxNumTokens) * s.maxLocalPerEntry) + " rows (T x min(K, L)) x " +
            std::to_string(s.combineRowBytesMax) + " B (fp32): this rank's rows for its own group, read in place");
  }
  if (envInt("EPCOMM_PROXY_TRACE") != 0) {
    add("trace ring", "host pinned (mapped)", sizeof(gpuproxy::TraceRound) * gpuproxy::kTraceRounds,
        "EPCOMM_PROXY_TRACE: per-round phase stamps");
  }
  return plan;
}

}  // namespace backends
}  // namespace epcomm
