#include "epcomm/plan.hpp"

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>

#include "backends/backends.hpp"
#include "epcomm/error.hpp"

namespace epcomm {

namespace {

std::string shapeNote(const Config& c, const std::string& cols, const char* dtype) {
  std::ostringstream oss;
  oss << dtype << " ";
  if (c.layout == Layout::kBatched) {
    oss << "[L=" << c.numLocalExperts() << ", R=" << c.batchedRowsPerExpert() << ", " << cols << "]";
  } else {
    oss << "[P=" << c.packedRows() << ", " << cols << "]";
  }
  return oss.str();
}

PlannedBuffer notBuilt(const std::string& backend) {
  return PlannedBuffer{backend, "(backend)", "-", 0, "not built in this build"};
}

std::string mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

}  // namespace

std::vector<PlannedBuffer> planBuffers(const Config& config, const std::string& backend) {
  config.validate();
  const bool known =
      backend.empty() || backend == "nvlink" || backend == "nvshmem" || backend == "proxy" || backend == "host";
  EPCOMM_CHECK(known, kInvalidArgument,
               "unknown backend '" << backend << "' for the planner (nvlink, nvshmem, proxy, host, or empty)");
  const Config& c = config;
  const uint64_t L = c.numLocalExperts();
  // Outputs live where the backend computes: host memory for the host backend, the GPU for every other one.
  const std::string memory = backend == "host" ? "host" : "device";
  const uint64_t rows = c.layout == Layout::kBatched ? L * c.batchedRowsPerExpert() : c.packedRows();

  std::vector<PlannedBuffer> plan;
  plan.push_back({"outputs", "outExpertNumTokens", memory, L * 4, "int32 [L=" + std::to_string(L) + "]"});
  plan.push_back({"outputs", "outExpertX", memory, rows * c.hiddenDimBytes,
                  shapeNote(c, std::to_string(c.hiddenDimBytes) + " bytes", "payload")});
  if (c.hiddenDimScaleBytes > 0) {
    plan.push_back({"outputs", "outExpertXScale", memory, rows * c.hiddenDimScaleBytes,
                    shapeNote(c, "S=" + std::to_string(c.hiddenDimScaleBytes / 4), "fp32")});
  }
  plan.push_back(
      {"outputs", "expertY", memory, rows * c.hiddenDim * 2, shapeNote(c, "H=" + std::to_string(c.hiddenDim), "bf16")});
  plan.push_back({"outputs", "outTokens", memory, static_cast<uint64_t>(c.maxNumTokens) * c.hiddenDim * 2,
                  "bf16 [T=" + std::to_string(c.maxNumTokens) + ", H=" + std::to_string(c.hiddenDim) + "]"});

  std::vector<PlannedBuffer> own;
  if (backend == "host") {
#ifdef EPCOMM_HAVE_HOST_BACKEND
    own = backends::planHost(c);
#else
    own.push_back(notBuilt(backend));
#endif
  } else if (backend == "nvlink") {
#ifdef EPCOMM_HAVE_NVLINK_BACKEND
    own = backends::planNvlink(c);
#else
    own.push_back(notBuilt(backend));
#endif
  } else if (backend == "nvshmem") {
#ifdef EPCOMM_HAVE_NVSHMEM_BACKEND
    own = backends::planNvshmem(c);
#else
    own.push_back(notBuilt(backend));
#endif
  } else if (backend == "proxy") {
    own = backends::planProxy(c);  // built everywhere (arithmetic), whether or not this build runs the backend
  }
  plan.insert(plan.end(), own.begin(), own.end());
  return plan;
}

std::string formatPlan(const Config& config, const std::string& backend, const std::vector<PlannedBuffer>& plan) {
  const char* headers[] = {"owner", "buffer", "memory", "MiB", "bytes", "shape / note"};
  std::vector<std::vector<std::string>> cells;
  uint64_t total = 0;
  std::map<std::string, uint64_t> byMemory;
  for (const PlannedBuffer& b : plan) {
    cells.push_back({b.owner, b.name, b.memory, mib(b.bytes), std::to_string(b.bytes), b.note});
    total += b.bytes;
    if (b.bytes > 0) byMemory[b.memory] += b.bytes;
  }
  size_t width[6];
  for (int i = 0; i < 6; ++i) {
    width[i] = std::string(headers[i]).size();
    for (const auto& row : cells) width[i] = std::max(width[i], row[i].size());
  }
  std::ostringstream oss;
  oss << "epcomm plan: " << config.toString() << " backend=" << (backend.empty() ? "(outputs only)" : backend) << "\n";
  auto emit = [&](const std::vector<std::string>& row) {
    for (int i = 0; i < 6; ++i) {
      // Numbers are right-aligned, text left-aligned; the last column is not padded.
      const bool number = i == 3 || i == 4;
      const std::string pad(width[i] - row[i].size(), ' ');
      oss << (i ? "  " : "") << (number ? pad + row[i] : (i == 5 ? row[i] : row[i] + pad));
    }
    oss << "\n";
  };
  emit({headers[0], headers[1], headers[2], headers[3], headers[4], headers[5]});
  emit({std::string(width[0], '-'), std::string(width[1], '-'), std::string(width[2], '-'), std::string(width[3], '-'),
        std::string(width[4], '-'), std::string(width[5], '-')});
  for (const auto& row : cells) emit(row);
  oss << "total per GPU (rank): " << mib(total) << " MiB (" << total << " bytes)";
  if (!byMemory.empty()) {
    oss << ":";
    bool first = true;
    for (const auto& kv : byMemory) {
      oss << (first ? " " : ", ") << kv.first << " " << mib(kv.second) << " MiB";
      first = false;
    }
  }
  oss << "\n";
  return oss.str();
}

}  // namespace epcomm
