// Pieces of the factory's backend selection that are pure functions, so unit tests reach them directly.
#pragma once

#include <string>
#include <vector>

namespace epcomm {
namespace detail {

/// True iff every rank runs on the same host; otherwise *whyNot names rank 0's host and the first rank elsewhere.
/// `hostOfRank[r]` is rank r's hostname.
bool allOnOneHost(const std::vector<std::string>& hostOfRank, std::string* whyNot);

}  // namespace detail
}  // namespace epcomm
