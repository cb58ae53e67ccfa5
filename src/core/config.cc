#include "epcomm/config.hpp"

#include <sstream>

#include "core/layout.hpp"
#include "epcomm/error.hpp"

namespace epcomm {

const char* layoutName(Layout layout) {
  switch (layout) {
    case Layout::kBatched:
      return "batched";
    case Layout::kPacked:
      return "packed";
  }
  return "invalid";
}

void Config::validate() const {
  const std::string self = " (config: " + toString() + ")";
  EPCOMM_CHECK(worldSize > 0, kInvalidConfig, "worldSize must be > 0, got 0" << self);
  EPCOMM_CHECK(rank < worldSize, kInvalidConfig,
               "rank " << rank << " is out of range [0, worldSize=" << worldSize << ")" << self);
  EPCOMM_CHECK(dpSize > 0, kInvalidConfig, "dpSize must be > 0, got 0" << self);
  EPCOMM_CHECK(worldSize % dpSize == 0, kInvalidConfig,
               "worldSize " << worldSize << " is not a multiple of dpSize " << dpSize << self);
  EPCOMM_CHECK(numExperts > 0, kInvalidConfig, "numExperts must be > 0, got 0" << self);
  EPCOMM_CHECK(numExperts % worldSize == 0, kInvalidConfig,
               "numExperts " << numExperts << " is not a multiple of worldSize " << worldSize << self);
  EPCOMM_CHECK(expertsPerToken > 0, kInvalidConfig, "expertsPerToken must be > 0, got 0" << self);
  EPCOMM_CHECK(expertsPerToken <= numExperts, kInvalidConfig,
               "expertsPerToken " << expertsPerToken << " exceeds numExperts " << numExperts << self);
  EPCOMM_CHECK(
      expertsPerToken <= kMaxExpertsPerToken, kInvalidConfig,
      "expertsPerToken " << expertsPerToken << " exceeds the supported maximum " << kMaxExpertsPerToken << self);
  EPCOMM_CHECK(maxNumTokens > 0, kInvalidConfig, "maxNumTokens must be > 0, got 0" << self);
  EPCOMM_CHECK(hiddenDim > 0, kInvalidConfig, "hiddenDim must be > 0, got 0" << self);
  EPCOMM_CHECK(hiddenDimBytes > 0, kInvalidConfig, "hiddenDimBytes must be > 0, got 0" << self);
  EPCOMM_CHECK(hiddenDimBytes % 16 == 0, kInvalidConfig,
               "hiddenDimBytes " << hiddenDimBytes << " is not a multiple of 16" << self);
  EPCOMM_CHECK(hiddenDimScaleBytes % 4 == 0, kInvalidConfig,
               "hiddenDimScaleBytes " << hiddenDimScaleBytes << " is not a multiple of 4" << self);
  EPCOMM_CHECK(hiddenDim % 4 == 0, kInvalidConfig,
               "hiddenDim " << hiddenDim << " is not a multiple of 4 (combine moves 8-byte bf16 vectors)" << self);
  EPCOMM_CHECK(expertPadding > 0 && (expertPadding & (expertPadding - 1)) == 0, kInvalidConfig,
               "expertPadding " << expertPadding << " is not a power of two" << self);
  EPCOMM_CHECK(layout == Layout::kBatched || layout == Layout::kPacked, kInvalidConfig,
               "layout " << static_cast<int>(layout) << " is not batched (0) or packed (1)" << self);
  EPCOMM_CHECK(totalExpertRows() < (1ull << 31), kInvalidConfig,
               "maxNumTokens " << maxNumTokens << " x worldSize / dpSize gives " << totalExpertRows()
                               << " rows per rank, over the int32 limit" << self);
}

uint64_t Config::batchedRowsPerExpert() const {
  return roundUpPow2(static_cast<uint64_t>(maxNumTokens) * numDpGroups(), expertPadding);
}

uint64_t Config::packedRows() const {
  return packedRowsFor(maxNumTokens, numDpGroups(), numLocalExperts(), expertsPerToken, expertPadding);
}

uint64_t Config::expertRows() const { return layout == Layout::kBatched ? batchedRowsPerExpert() : packedRows(); }

uint64_t Config::totalExpertRows() const {
  return layout == Layout::kBatched ? numLocalExperts() * batchedRowsPerExpert() : packedRows();
}

std::string Config::toString() const {
  std::ostringstream oss;
  oss << "E=" << numExperts << " K=" << expertsPerToken << " H=" << hiddenDim << " bytes=" << hiddenDimBytes
      << " scale=" << hiddenDimScaleBytes << " T=" << maxNumTokens << " W=" << worldSize << " D=" << dpSize
      << " pad=" << expertPadding << " " << layoutName(layout) << " rank=" << rank;
  return oss.str();
}

static const char* const kStandardNames[] = {"decode", "prefill", "small", "qwen3"};

const char* const* standardConfigNames(int* count) {
  *count = 4;
  return kStandardNames;
}

Config standardConfig(const std::string& name, uint32_t worldSize, uint32_t rank, uint32_t dpSize) {
  Config c;
  c.worldSize = worldSize;
  c.rank = rank;
  c.dpSize = dpSize;
  if (name == "decode" || name == "prefill") {
    c.numExperts = 256;
    c.expertsPerToken = 8;
    c.hiddenDim = 7168;
    c.hiddenDimBytes = 7168;                 // fp8 e4m3
    c.hiddenDimScaleBytes = 7168 / 128 * 4;  // one fp32 scale per 128 elements
    c.maxNumTokens = name == "decode" ? 128 : 4096;
  } else if (name == "small") {
    c.numExperts = 64;
    c.expertsPerToken = 6;
    c.hiddenDim = 2048;
    c.hiddenDimBytes = 2048 * 2;  // bf16
    c.maxNumTokens = 128;
  } else if (name == "qwen3") {
    c.numExperts = 128;
    c.expertsPerToken = 8;
    c.hiddenDim = 2048;
    c.hiddenDimBytes = 2048 * 2;  // bf16
    c.maxNumTokens = 128;
  } else {
    EPCOMM_THROW(kInvalidArgument, "unknown standard config '" << name << "' (decode, prefill, small, qwen3)");
  }
  return c;
}

}  // namespace epcomm
