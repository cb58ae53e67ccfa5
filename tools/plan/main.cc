// epcomm-plan: prints every buffer a configuration needs before anything is allocated; also prints the EPCOMM_*
// environment table (--env) and runs the CPU reference on the standard configurations (--reference).
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "core/dtype_convert.hpp"
#include "core/env.hpp"
#include "epcomm/config.hpp"
#include "epcomm/error.hpp"
#include "epcomm/plan.hpp"
#include "reference/reference.hpp"

namespace {

constexpr int kExitUsage = 2;

const char* const kUsage =
    "usage: epcomm-plan --config NAME --world W [--dp D] [--rank R] [--backend nvlink|nvshmem|proxy|host]\n"
    "                   [--layout batched|packed] [--padding N] [--tokens T]\n"
    "       epcomm-plan --env\n"
    "       epcomm-plan --reference [--world W] [--dp D] [--layout batched|packed] [--padding N] [--tokens T]\n"
    "\n"
    "  --config NAME   standard configuration: decode, prefill, small, qwen3\n"
    "  --world W       number of ranks (--reference: default 4)\n"
    "  --dp D          ranks per DP group (default 1)\n"
    "  --rank R        rank to plan for (default 0)\n"
    "  --backend B     add the backend's own buffers (default: the caller's outputs only)\n"
    "  --layout L      dispatch output layout (default batched; --reference: packed)\n"
    "  --padding N     expert row padding, a power of two (default 1)\n"
    "  --tokens T      max tokens per rank (default: the configuration's; --reference: at most 256)\n"
    "  --env           print the EPCOMM_* environment variables as a markdown table\n"
    "  --reference     run the CPU reference dispatch + combine on every standard configuration with random\n"
    "                  routing and print the counts and times\n";

[[noreturn]] void usageError(const std::string& message) {
  std::cerr << "epcomm-plan: " << message << "\n(epcomm-plan --help prints the usage)\n";
  std::exit(kExitUsage);
}

uint32_t parseUint(const std::string& flag, const std::string& value) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(value.c_str(), &end, 10);
  if (value.empty() || value[0] == '-' || *end != '\0' || errno != 0 || v > 0xFFFFFFFFull) {
    usageError(flag + " needs a non-negative integer, got '" + value + "'");
  }
  return static_cast<uint32_t>(v);
}

struct Options {
  std::string config;
  bool haveWorld = false;
  uint32_t world = 0;
  uint32_t dp = 1;
  uint32_t rank = 0;
  std::string backend;
  bool haveLayout = false;
  epcomm::Layout layout = epcomm::Layout::kBatched;
  uint32_t padding = 1;
  bool haveTokens = false;
  uint32_t tokens = 0;
  bool env = false;
  bool reference = false;
};

Options parseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usageError(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      std::exit(0);
    } else if (arg == "--config") {
      o.config = value();
    } else if (arg == "--world") {
      o.world = parseUint(arg, value());
      o.haveWorld = true;
    } else if (arg == "--dp") {
      o.dp = parseUint(arg, value());
    } else if (arg == "--rank") {
      o.rank = parseUint(arg, value());
    } else if (arg == "--backend") {
      o.backend = value();
      if (o.backend != "nvlink" && o.backend != "nvshmem" && o.backend != "proxy" && o.backend != "host") {
        usageError("--backend must be nvlink, nvshmem, proxy or host, got '" + o.backend + "'");
      }
    } else if (arg == "--layout") {
      const std::string v = value();
      if (v == "batched") {
        o.layout = epcomm::Layout::kBatched;
      } else if (v == "packed") {
        o.layout = epcomm::Layout::kPacked;
      } else {
        usageError("--layout must be batched or packed, got '" + v + "'");
      }
      o.haveLayout = true;
    } else if (arg == "--padding") {
      o.padding = parseUint(arg, value());
    } else if (arg == "--tokens") {
      o.tokens = parseUint(arg, value());
      o.haveTokens = true;
    } else if (arg == "--env") {
      o.env = true;
    } else if (arg == "--reference") {
      o.reference = true;
    } else {
      usageError("unknown argument '" + arg + "'");
    }
  }
  if (o.env || o.reference) return o;
  if (o.config.empty()) usageError("--config is required");
  if (!o.haveWorld) usageError("--world is required");
  return o;
}

epcomm::Config makeConfig(const Options& o, const std::string& name, uint32_t world) {
  epcomm::Config c;
  try {
    c = epcomm::standardConfig(name, world, o.rank, o.dp);
  } catch (const epcomm::Error& e) {
    usageError("--config: " + e.message());
  }
  c.layout = o.layout;
  c.expertPadding = o.padding;
  if (o.haveTokens) c.maxNumTokens = o.tokens;
  try {
    c.validate();
  } catch (const epcomm::Error& e) {
    usageError(e.message());
  }
  return c;
}

void printEnv() {
  std::cout << "| variable | default | meaning |\n|---|---|---|\n";
  for (const epcomm::EnvVar& v : epcomm::envVars()) {
    std::cout << "| `" << v.name << "` | " << (v.defaultValue[0] != '\0' ? "`" + std::string(v.defaultValue) + "`" : "")
              << " | " << v.description << " |\n";
  }
}

void fillRandom(void* data, size_t bytes, uint64_t seed) {
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  auto* p = static_cast<uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    p[i] = static_cast<uint8_t>(state >> 24);
  }
}

// One dispatch + combine round of the reference on `config` (all W ranks in this process), random routing.
void runReference(const std::string& name, const epcomm::Config& config) {
  using epcomm::DType;
  using epcomm::reference::HostTensor;
  const uint32_t W = config.worldSize, G = config.numDpGroups(), T = config.maxNumTokens, K = config.expertsPerToken;
  const int64_t L = config.numLocalExperts(), H = config.hiddenDim, S = config.hiddenDimScaleBytes / 4;
  const bool batched = config.layout == epcomm::Layout::kBatched;
  const int64_t R = static_cast<int64_t>(config.batchedRowsPerExpert()), P = static_cast<int64_t>(config.packedRows());
  auto expertShaped = [&](DType dtype, int64_t cols) {
    return batched ? HostTensor(dtype, {L, R, cols}) : HostTensor(dtype, {P, cols});
  };

  // Ranks of a DP group hold identical tokens: one set of inputs per group, shared by its ranks' views.
  std::vector<HostTensor> x, xScale, indices, weights;
  for (uint32_t g = 0; g < G; ++g) {
    x.push_back(HostTensor(DType::kU8, {T, config.hiddenDimBytes}));
    fillRandom(x.back().data<void>(), x.back().bytes(), 1000 + g);
    xScale.push_back(HostTensor(DType::kF32, {T, S > 0 ? S : 1}));
    indices.push_back(HostTensor(DType::kI32, {T, K}));
    const std::vector<int32_t> idx = epcomm::reference::randomIndices(config, T, 2000 + g);
    std::memcpy(indices.back().data<void>(), idx.data(), idx.size() * sizeof(int32_t));
    weights.push_back(HostTensor(DType::kF32, {T, K}));
    for (uint32_t i = 0; i < T * K; ++i) weights.back().data<float>()[i] = 1.0f / K;
  }
  std::vector<HostTensor> counts, outX, outScale, expertY, outTokens;
  std::vector<epcomm::DispatchArgs> dargs(W);
  std::vector<epcomm::CombineArgs> cargs(W);
  for (uint32_t r = 0; r < W; ++r) {
    const uint32_t g = r / config.dpSize;
    counts.push_back(HostTensor(DType::kI32, {L}));
    outX.emplace_back(expertShaped(DType::kU8, config.hiddenDimBytes));
    expertY.emplace_back(expertShaped(DType::kBf16, H));
    // The experts' outputs are stand-ins: any finite values exercise the same combine path.
    for (size_t i = 0; i < expertY.back().bytes() / 2; ++i) {
      expertY.back().data<uint16_t>()[i] = epcomm::floatToBf16(static_cast<float>(i % 61) * 0.0625f - 1.0f);
    }
    outTokens.push_back(HostTensor(DType::kBf16, {T, H}));
    epcomm::DispatchArgs& d = dargs[r];
    d.outExpertNumTokens = counts.back().view();
    d.outExpertX = outX.back().view();
    d.x = x[g].view();
    d.indices = indices[g].view();
    if (S > 0) {
      outScale.emplace_back(expertShaped(DType::kF32, S));
      d.outExpertXScale = outScale.back().view();
      d.xScale = xScale[g].view();
    }
    epcomm::CombineArgs& c = cargs[r];
    c.outTokens = outTokens.back().view();
    c.indices = indices[g].view();
    c.weights = weights[g].view();
    c.expertY = expertY.back().view();
  }

  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  epcomm::reference::dispatch(config, dargs);
  const auto t1 = Clock::now();
  epcomm::reference::combine(config, cargs);
  const auto t2 = Clock::now();

  uint64_t total = 0;
  int32_t minCount = 0x7FFFFFFF, maxCount = 0;
  for (uint32_t r = 0; r < W; ++r) {
    for (int64_t le = 0; le < L; ++le) {
      const int32_t n = counts[r].data<int32_t>()[le];
      total += n;
      minCount = std::min(minCount, n);
      maxCount = std::max(maxCount, n);
    }
  }
  // Routing has no repeats and no masks, so every (token, expert) pair of every group is one row somewhere.
  const uint64_t expected = static_cast<uint64_t>(G) * T * K;
  std::printf("| %-8s | %5u | %2u | %2u | %-7s | %9llu | %11llu | %5d..%-5d | %11.2f | %10.2f |%s\n", name.c_str(), T,
              W, config.dpSize, epcomm::layoutName(config.layout), static_cast<unsigned long long>(total),
              static_cast<unsigned long long>(expected), minCount, maxCount,
              std::chrono::duration<double, std::milli>(t1 - t0).count(),
              std::chrono::duration<double, std::milli>(t2 - t1).count(), total == expected ? "" : "  MISMATCH");
  if (total != expected) {
    EPCOMM_THROW(kInternal, "reference received " << total << " rows, expected " << expected);
  }
}

int runReferenceAll(const Options& o) {
  const uint32_t world = o.haveWorld ? o.world : 4;
  Options opts = o;
  if (!o.haveLayout) opts.layout = epcomm::Layout::kPacked;  // packed keeps prefill-sized buffers small
  int count = 0;
  const char* const* names = epcomm::standardConfigNames(&count);
  std::printf(
      "| config   |     T |  W |  D | layout  | rows recv | (t,e) pairs | per expert  | dispatch ms | combine ms |\n");
  std::printf(
      "|----------|-------|----|----|---------|-----------|-------------|-------------|-------------|------------|\n");
  for (int i = 0; i < count; ++i) {
    epcomm::Config probe = epcomm::standardConfig(names[i], world, 0, o.dp);
    if (!o.haveTokens) {
      opts.haveTokens = true;
      opts.tokens = std::min<uint32_t>(probe.maxNumTokens, 256);
    }
    const epcomm::Config config = makeConfig(opts, names[i], world);
    runReference(names[i], config);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parseArgs(argc, argv);
  try {
    if (o.env) {
      printEnv();
      return 0;
    }
    if (o.reference) return runReferenceAll(o);
    const epcomm::Config config = makeConfig(o, o.config, o.world);
    const std::vector<epcomm::PlannedBuffer> plan = epcomm::planBuffers(config, o.backend);
    std::cout << epcomm::formatPlan(config, o.backend, plan);
    return 0;
  } catch (const epcomm::Error& e) {
    std::cerr << "epcomm-plan: " << e.what() << "\n";
    return 1;
  }
}
