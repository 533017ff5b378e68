#pragma once
/// @file
/// The non-template bodies of dtrain/ddp/bucket.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/ddp/bucket.hpp, not this file.

#include <dtrain/ddp/bucket.hpp>

namespace dtrain {

DTRAIN_DETAIL_INLINE std::size_t mib_to_bytes(double mib, std::string_view option) {
  if (!(mib > 0) || mib > 1e9) {
    throw config_error("ddp_options::" + std::string(option) + " = " + std::to_string(mib) +
                       " is not a bucket size in MiB (it must be above 0)");
  }
  return std::max<std::size_t>(1, static_cast<std::size_t>(mib * 1024.0 * 1024.0));
}
}  // namespace dtrain

namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE std::vector<std::size_t> reverse_order(std::size_t n) {
  std::vector<std::size_t> order(n);
  for (std::size_t i = 0; i < n; ++i) order[i] = n - 1 - i;
  return order;
}

DTRAIN_DETAIL_INLINE void check_order(std::span<const std::size_t> order, std::size_t n,
                                      std::string_view what) {
  std::vector<char> seen(n, 0);
  if (order.size() != n) {
    throw backend_error(std::string(what) + " lists " + std::to_string(order.size()) +
                            " parameters, the model has " + std::to_string(n),
                        0);
  }
  for (std::size_t i : order) {
    if (i >= n || seen[i]) {
      throw backend_error(std::string(what) + " names parameter #" + std::to_string(i) +
                              (i >= n ? " of " + std::to_string(n) : " twice"),
                          0);
    }
    seen[i] = 1;
  }
}

}  // namespace detail
}  // namespace dtrain
