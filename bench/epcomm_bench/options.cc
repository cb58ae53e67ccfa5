#include "options.hpp"

#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "epcomm/error.hpp"

namespace epcomm {
namespace bench {

namespace {

std::vector<std::string> splitList(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// std::stoul and friends throw std::invalid_argument with the message "stoul": name the option and its value.
long long number(const std::string& option, const std::string& value, long long lo, long long hi) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  EPCOMM_CHECK(used == value.size() && !value.empty(), kInvalidArgument,
               option << " needs an integer, got '" << value << "'");
  EPCOMM_CHECK(v >= lo && v <= hi, kInvalidArgument, option << " must be in [" << lo << ", " << hi << "], got " << v);
  return v;
}

}  // namespace

const char* usage() {
  return "epcomm-bench: dispatch / combine times of one backend beside NCCL's all-to-all of the same bytes\n"
         "\n"
         "  epcomm-bench [--backend auto|nvlink|nvshmem|proxy|host] [--world W] [--config decode,prefill,small,qwen3]\n"
         "               [--tokens 1,8,32,128,512,4096] [--iters 200] [--warmup 20] [--dp 1] [--json out.jsonl]\n"
         "               [--plot out.png] [--rev GIT_REV] [--barrier shm|tcp] [--floor] [--max-tokens N]\n"
         "               [--layout batched|packed] [--fp8 fused|separate|both]\n"
         "\n"
         "  Starts W processes (one per GPU by default; 4 without a GPU), rank r on GPU r % GPUs. Times in us:\n"
         "  median over --iters after --warmup, the maximum over ranks; a table, then JSON lines (--json).\n"
         "  --backend host (and auto without a GPU): defaults --config decode,small,qwen3 --tokens 1,32,128\n"
         "      --iters 50 --warmup 5; prefill only when named; the JSON lines also go to stdout\n"
         "  --max-tokens N: create each object for max(T, N) tokens (an engine's capacity) and send T\n"
         "  --layout: outExpertX / expertY as [L, rows per expert, ...] (default) or experts back to back\n"
         "  --floor: also time an empty kernel and a one-flag exchange between ranks (the method's floor)\n"
         "  --fp8 MODE: the fp8 configurations (decode, prefill) dispatch bf16 tokens that arrive as fp8 e4m3 + fp32\n"
         "      scales per 128 (DeepEP's low-latency use_fp8): fused = the dispatch casts (Config::dispatchCast),\n"
         "      separate = a cast kernel, then the dispatch of its fp8 output, both = the two in the same run, on the\n"
         "      same tokens (and a check that their outputs are the same bits); other configurations are skipped\n"
         "  --plot FILE.png: after the run, draw time against tokens (scripts/plot; needs matplotlib)\n"
         "  --list-backends: print the backends this build contains and exit\n"
         "\n"
         "  Several ranks per GPU (W above the GPU count) run and check the protocol, but the ranks' contexts\n"
         "  take turns on the GPU: the times are protocol costs, not link times. The NCCL baseline is skipped\n"
         "  (NCCL refuses two ranks on one GPU). Under CUDA MPS the ranks' kernels run side by side; give each\n"
         "  rank 1/W of the SMs so that every rank's kernels fit at once (bench/README.md):\n"
         "    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log\n"
         "    mkdir -p /tmp/mps /tmp/mps-log; nvidia-cuda-mps-control -d\n"
         "    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 epcomm-bench --backend nvlink --world 2 ...\n"
         "    echo quit | nvidia-cuda-mps-control\n"
         "\n"
         "  Environment: EPCOMM_* (README), EPBENCH_TRACE=1 (each rank prints its phases to stderr).\n";
}

Options parseOptions(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      EPCOMM_CHECK(i + 1 < argc, kInvalidArgument, a << " needs a value (see --help)");
      return argv[++i];
    };
    if (a == "--backend") {
      o.backend = next();
    } else if (a == "--world") {
      o.world = static_cast<int>(number(a, next(), 1, 1 << 16));
    } else if (a == "--config") {
      o.configs = splitList(next());
      o.configsSet = true;
    } else if (a == "--tokens") {
      o.tokensSet = true;
      o.tokens.clear();
      for (const std::string& t : splitList(next()))
        o.tokens.push_back(static_cast<uint32_t>(number(a, t, 1, 1 << 30)));
    } else if (a == "--iters") {
      o.iters = static_cast<int>(number(a, next(), 1, 1 << 24));
      o.itersSet = true;
    } else if (a == "--warmup") {
      o.warmup = static_cast<int>(number(a, next(), 0, 1 << 24));
      o.warmupSet = true;
    } else if (a == "--dp") {
      o.dp = static_cast<int>(number(a, next(), 1, 1 << 16));
    } else if (a == "--json") {
      o.json = next();
    } else if (a == "--plot") {
      o.plot = next();
    } else if (a == "--rev") {
      o.rev = next();
    } else if (a == "--barrier") {
      o.barrier = next();
      EPCOMM_CHECK(o.barrier == "shm" || o.barrier == "tcp", kInvalidArgument,
                   "--barrier must be shm or tcp, got '" << o.barrier << "'");
    } else if (a == "--floor") {
      o.floor = true;
    } else if (a == "--max-tokens") {
      o.maxTokens = static_cast<uint32_t>(number(a, next(), 0, 1 << 30));
    } else if (a == "--layout") {
      const std::string l = next();
      EPCOMM_CHECK(l == "batched" || l == "packed", kInvalidArgument,
                   "--layout must be batched or packed, got '" << l << "'");
      o.layout = l == "batched" ? Layout::kBatched : Layout::kPacked;
    } else if (a == "--fp8") {
      o.fp8 = next();
      EPCOMM_CHECK(o.fp8 == "fused" || o.fp8 == "separate" || o.fp8 == "both", kInvalidArgument,
                   "--fp8 must be fused, separate or both, got '" << o.fp8 << "'");
    } else if (a == "-h" || a == "--help") {
      o.help = true;
    } else if (a == "--list-backends") {
      o.listBackends = true;
    } else {
      EPCOMM_THROW(kInvalidArgument, "unknown argument '" << a << "' (see --help)");
    }
  }
  EPCOMM_CHECK(!o.configs.empty(), kInvalidArgument, "--config names no configuration");
  int known = 0;
  const char* const* names = standardConfigNames(&known);
  for (const std::string& c : o.configs) {
    bool found = false;
    std::string list;
    for (int i = 0; i < known; ++i) {
      found = found || c == names[i];
      list += std::string(i ? ", " : "") + names[i];
    }
    EPCOMM_CHECK(found, kInvalidArgument, "--config: unknown configuration '" << c << "' (" << list << ")");
  }
  EPCOMM_CHECK(!o.tokens.empty(), kInvalidArgument, "--tokens names no token count");
  return o;
}

void applyHostDefaults(Options& o) {
  if (!o.configsSet) o.configs = {"decode", "small", "qwen3"};
  if (!o.tokensSet) o.tokens = {1, 32, 128};
  if (!o.itersSet) o.iters = 50;
  if (!o.warmupSet) o.warmup = 5;
}

int64_t timeoutMsFromEnv() {
  const char* v = std::getenv("EPCOMM_TIMEOUT_MS");
  const long long ms = v != nullptr ? std::atoll(v) : 0;
  return ms > 0 ? ms : 10000;
}

std::string revision(const Options& o) {
  if (!o.rev.empty()) return o.rev;
  if (const char* r = std::getenv("EPBENCH_REV")) return r;
  std::string out;
  if (FILE* p = popen("git rev-parse --short HEAD 2>/dev/null", "r")) {
    char buf[64] = {0};
    if (fgets(buf, sizeof(buf), p) != nullptr) out = buf;
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out.empty() ? "unknown" : out;
}

}  // namespace bench
}  // namespace epcomm
