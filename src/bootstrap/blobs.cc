#include <algorithm>
#include <cstring>

#include "epcomm/bootstrap.hpp"

namespace epcomm {

std::vector<std::vector<uint8_t>> allGatherBlobs(Bootstrap& bootstrap, const std::vector<uint8_t>& mine) {
  const int world = bootstrap.worldSize();
  uint64_t len = mine.size();
  std::vector<uint64_t> lens(world);
  bootstrap.allGather(&len, lens.data(), sizeof(len));
  const uint64_t maxLen = *std::max_element(lens.begin(), lens.end());
  std::vector<uint8_t> padded(maxLen, 0), all(maxLen * world);
  if (!mine.empty()) std::memcpy(padded.data(), mine.data(), mine.size());
  if (maxLen > 0) bootstrap.allGather(padded.data(), all.data(), maxLen);
  std::vector<std::vector<uint8_t>> out(world);
  for (int r = 0; r < world; ++r) out[r].assign(all.begin() + r * maxLen, all.begin() + r * maxLen + lens[r]);
  return out;
}

}  // namespace epcomm
