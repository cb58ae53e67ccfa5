#include "epcomm/config.hpp"

#include <algorithm>
#include <sstream>

#include "core/agreement.hpp"
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

const char* dispatchCastName(DispatchCast cast) {
  switch (cast) {
    case DispatchCast::kNone:
      return "none";
    case DispatchCast::kFp8Blocks:
      return "fp8_blocks";
    case DispatchCast::kFp8BlocksPow2:
      return "fp8_blocks_pow2";
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
  EPCOMM_CHECK(dispatchCast == DispatchCast::kNone || dispatchCast == DispatchCast::kFp8Blocks ||
                   dispatchCast == DispatchCast::kFp8BlocksPow2,
               kInvalidConfig,
               "dispatchCast " << static_cast<int>(dispatchCast)
                               << " is not none (0), fp8_blocks (1) or fp8_blocks_pow2 (2)" << self);
  if (dispatchCast != DispatchCast::kNone) {
    // The wire format is the fp8 dispatch's: one byte per element, then one fp32 scale per block.
    const char* cast = dispatchCastName(dispatchCast);
    EPCOMM_CHECK(hiddenDim % kFp8CastBlock == 0, kInvalidConfig,
                 "dispatchCast = " << cast << " needs hiddenDim % " << kFp8CastBlock
                                   << " == 0, got hiddenDim = " << hiddenDim << self);
    EPCOMM_CHECK(hiddenDimBytes == hiddenDim, kInvalidConfig,
                 "dispatchCast = " << cast << " sends fp8 e4m3: hiddenDimBytes must be hiddenDim = " << hiddenDim
                                   << ", got " << hiddenDimBytes << self);
    EPCOMM_CHECK(hiddenDimScaleBytes == hiddenDim / kFp8CastBlock * 4, kInvalidConfig,
                 "dispatchCast = " << cast << " sends one fp32 scale per " << kFp8CastBlock
                                   << " elements: hiddenDimScaleBytes must be hiddenDim / " << kFp8CastBlock
                                   << " * 4 = " << hiddenDim / kFp8CastBlock * 4 << ", got " << hiddenDimScaleBytes
                                   << self);
  }
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

std::vector<uint64_t> Config::expertRowOffsets(const int32_t* numTokens) const {
  const uint32_t L = numLocalExperts();
  std::vector<uint64_t> offsets(L + 1, 0);
  uint64_t at = 0;
  for (uint32_t le = 0; le < L; ++le) {
    EPCOMM_CHECK(numTokens[le] >= 0 && static_cast<uint64_t>(numTokens[le]) <= expertRows(), kInvalidArgument,
                 "expertRowOffsets: local expert " << le << " has " << numTokens[le] << " tokens, outside [0, "
                                                   << expertRows() << "] (" << layoutName(layout) << " layout)");
    if (layout == Layout::kBatched) {
      offsets[le] = le * batchedRowsPerExpert();
    } else {
      offsets[le] = at;
      at += roundUpPow2(static_cast<uint64_t>(numTokens[le]), expertPadding);
    }
  }
  offsets[L] = layout == Layout::kBatched ? totalExpertRows() : at;
  EPCOMM_CHECK(offsets[L] <= totalExpertRows(), kInvalidArgument,
               "expertRowOffsets: the counts need " << offsets[L] << " packed rows, more than " << totalExpertRows());
  return offsets;
}

std::string Config::toString() const {
  std::ostringstream oss;
  oss << "E=" << numExperts << " K=" << expertsPerToken << " H=" << hiddenDim << " bytes=" << hiddenDimBytes
      << " scale=" << hiddenDimScaleBytes << " T=" << maxNumTokens << " W=" << worldSize << " D=" << dpSize
      << " pad=" << expertPadding << " " << layoutName(layout);
  if (dispatchCast != DispatchCast::kNone) oss << " cast=" << dispatchCastName(dispatchCast);
  oss << " rank=" << rank;
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

// ---------------------------------------------------------------------------------------------------------------
// Settings every rank must agree on (core/agreement.hpp).

namespace {

// "name\0value\0" per setting: names and values never contain a NUL.
std::vector<uint8_t> serializeSettings(const std::vector<AgreedSetting>& settings) {
  std::vector<uint8_t> out;
  for (const AgreedSetting& s : settings) {
    out.insert(out.end(), s.name.begin(), s.name.end());
    out.push_back(0);
    out.insert(out.end(), s.value.begin(), s.value.end());
    out.push_back(0);
  }
  return out;
}

std::vector<AgreedSetting> parseSettings(const std::vector<uint8_t>& bytes) {
  std::vector<AgreedSetting> out;
  size_t pos = 0;
  auto next = [&]() {
    const size_t end = std::find(bytes.begin() + pos, bytes.end(), uint8_t{0}) - bytes.begin();
    std::string field(reinterpret_cast<const char*>(bytes.data()) + pos, end - pos);
    pos = end < bytes.size() ? end + 1 : end;
    return field;
  };
  while (pos < bytes.size()) {
    AgreedSetting s;
    s.name = next();
    s.value = next();
    out.push_back(std::move(s));
  }
  return out;
}

uint64_t digestOf(const std::vector<uint8_t>& bytes) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a 64
  for (uint8_t b : bytes) {
    h ^= b;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

std::string settingsDifference(const std::vector<AgreedSetting>& a, int rankA, const std::vector<AgreedSetting>& b,
                               int rankB) {
  std::ostringstream oss;
  for (const AgreedSetting& sa : a) {
    const auto it = std::find_if(b.begin(), b.end(), [&](const AgreedSetting& sb) { return sb.name == sa.name; });
    if (it == b.end()) {
      oss << sa.name << " is " << sa.value << " on rank " << rankA << " but not set on rank " << rankB
          << " (another epcomm build?)";
      return oss.str();
    }
    if (it->value != sa.value) {
      oss << sa.name << " is " << sa.value << " on rank " << rankA << " but " << it->value << " on rank " << rankB;
      return oss.str();
    }
  }
  for (const AgreedSetting& sb : b) {
    const auto it = std::find_if(a.begin(), a.end(), [&](const AgreedSetting& sa) { return sa.name == sb.name; });
    if (it == a.end()) {
      oss << sb.name << " is not set on rank " << rankA << " but " << sb.value << " on rank " << rankB
          << " (another epcomm build?)";
      return oss.str();
    }
  }
  return "";
}

void checkSettingsAgree(Bootstrap& bootstrap, const std::string& what, const std::vector<AgreedSetting>& settings) {
  const int world = bootstrap.worldSize();
  if (world <= 1) return;
  const std::vector<uint8_t> mine = serializeSettings(settings);
  const uint64_t digest = digestOf(mine);
  std::vector<uint64_t> digests(world);
  bootstrap.allGather(&digest, digests.data(), sizeof(digest));
  bool same = true;
  for (uint64_t d : digests) same = same && d == digests[0];
  if (same) return;
  // Every rank saw the same digests, so every rank takes this path and gathers the settings themselves.
  const std::vector<std::vector<uint8_t>> all = allGatherBlobs(bootstrap, mine);
  const std::vector<AgreedSetting> first = parseSettings(all[0]);
  for (int r = 1; r < world; ++r) {
    const std::string diff = settingsDifference(first, 0, parseSettings(all[r]), r);
    if (!diff.empty()) EPCOMM_THROW(kInvalidConfig, what << " mismatch: " << diff);
  }
  EPCOMM_THROW(kInvalidConfig, what << " mismatch between ranks (same settings, different digests)");
}

std::vector<AgreedSetting> configSettings(const Config& c) {
  return {
      {"max_num_tokens", std::to_string(c.maxNumTokens)},
      {"num_experts", std::to_string(c.numExperts)},
      {"experts_per_token", std::to_string(c.expertsPerToken)},
      {"world_size", std::to_string(c.worldSize)},
      {"dp_size", std::to_string(c.dpSize)},
      {"hidden_dim", std::to_string(c.hiddenDim)},
      {"hidden_dim_bytes", std::to_string(c.hiddenDimBytes)},
      {"hidden_dim_scale_bytes", std::to_string(c.hiddenDimScaleBytes)},
      {"expert_padding", std::to_string(c.expertPadding)},
      {"layout", layoutName(c.layout)},
      {"dispatch_cast", dispatchCastName(c.dispatchCast)},
  };
}

}  // namespace epcomm
