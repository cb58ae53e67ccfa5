// Settings that every rank of one object must give alike (the Config but the rank, and backend knobs such as the
// host backend's private area), checked once at construction over the bootstrap. Without the check, ranks that
// disagree construct fine and then fail in the first round with errors that do not say why, or give wrong results.
//
// For backend authors: call checkSettingsAgree in the backend's constructor, collectively (every rank, same
// settings in the same order), before anything is exchanged that depends on them:
//
//   checkSettingsAgree(bootstrap, "nvshmem backend", {{"EPCOMM_NVSHMEM_QUEUES", std::to_string(queues)}});
//
// A mismatch throws Error(kInvalidConfig) on every rank, naming the setting and both values.
#pragma once

#include <string>
#include <vector>

#include "epcomm/bootstrap.hpp"
#include "epcomm/config.hpp"

namespace epcomm {

/// One setting every rank must agree on: a name (as the user knows it: a Config field in the Python API's spelling,
/// an EPCOMM_* variable) and its value as text.
struct AgreedSetting {
  std::string name;
  std::string value;
};

/// Collective over `bootstrap`. Every rank gathers every rank's 64-bit digest of `settings`; only when they differ
/// are the settings themselves exchanged, and every rank throws the same Error(kInvalidConfig):
/// "<what> mismatch: <name> is <value> on rank <i> but <value> on rank <j>" for the first differing setting (rank i
/// is rank 0, or the lowest rank that has the setting). kBootstrap / kTimeout from the bootstrap itself.
void checkSettingsAgree(Bootstrap& bootstrap, const std::string& what, const std::vector<AgreedSetting>& settings);

/// The settings of `config` that every rank must agree on: every field but `rank`, named as in the Python API
/// (max_num_tokens, num_experts, ..., layout, dispatch_cast).
std::vector<AgreedSetting> configSettings(const Config& config);

/// The first difference between two ranks' settings, or "" when they agree: "<name> is <a> on rank <rankA> but <b>
/// on rank <rankB>". Pure function (the exchange is checkSettingsAgree's).
std::string settingsDifference(const std::vector<AgreedSetting>& a, int rankA, const std::vector<AgreedSetting>& b,
                               int rankB);

}  // namespace epcomm
