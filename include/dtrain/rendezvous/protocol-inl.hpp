#pragma once
/// @file
/// The non-template bodies of dtrain/rendezvous/protocol.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/rendezvous/protocol.hpp, not this file.

#include <dtrain/rendezvous/protocol.hpp>

namespace dtrain::detail::wire {

DTRAIN_DETAIL_INLINE std::string frame(const std::string& body) {
  std::string out;
  writer(out).u32(static_cast<std::uint32_t>(body.size()));
  out += body;
  return out;
}

DTRAIN_DETAIL_INLINE std::vector<std::string_view> read_keys(reader& r,
                                                             const store_limits& limits) {
  std::uint32_t n = r.u32("key count");
  if (n > limits.max_keys_per_request) {
    throw violation("key count " + std::to_string(n) + " exceeds the limit of " +
                    std::to_string(limits.max_keys_per_request));
  }
  std::vector<std::string_view> keys;  // grows with keys actually present, not with n
  for (std::uint32_t i = 0; i < n; ++i) keys.push_back(r.bytes32("key", limits.max_key_size));
  return keys;
}

}  // namespace dtrain::detail::wire
