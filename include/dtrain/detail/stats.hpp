#pragma once
/// @file
/// Small statistics on measured times, shared by the parts that judge them
/// (the straggler watch, the memory tier's interval).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace dtrain::detail {

/// The median of `values` (the lower of the two middle ones for an even
/// count); 0 when there are none.
inline std::int64_t median(std::vector<std::int64_t> values) {
  if (values.empty()) return 0;
  const auto mid = values.begin() + static_cast<std::ptrdiff_t>((values.size() - 1) / 2);
  std::nth_element(values.begin(), mid, values.end());
  return *mid;
}

}  // namespace dtrain::detail
