#pragma once
/// @file
/// The non-template bodies of dtrain/rendezvous/options.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/rendezvous/options.hpp, not this file.

#include <dtrain/rendezvous/options.hpp>

namespace dtrain {

DTRAIN_DETAIL_INLINE std::uint64_t store_limits::max_frame_size() const noexcept {
  std::uint64_t keys = std::uint64_t{max_keys_per_request} * (4u + max_key_size);
  std::uint64_t one = 2u * (4u + std::uint64_t{max_value_size}) + 4u + max_key_size;
  return 64u + (keys > one ? keys : one);
}

DTRAIN_DETAIL_INLINE store_options store_options::with_env(const environment& env) const {
  store_options out = *this;
  if (auto t = detail::read_seconds(env, store_timeout_variable)) out.timeout = *t;
  if (auto t = detail::read_seconds(env, store_io_timeout_variable)) out.io_timeout = *t;
  if (auto t = detail::read_seconds(env, store_idle_timeout_variable)) out.idle_timeout = *t;
  if (auto t = detail::read_seconds(env, rendezvous_progress_variable)) {
    out.progress_interval = *t;
  }
  if (auto n = detail::read_int(env, store_max_connections_variable)) {
    if (n->value < 1) throw config_error(n->origin + " must be at least 1");
    out.limits.max_connections = static_cast<std::uint32_t>(n->value);
  }
  if (auto n = detail::read_int(env, store_max_bytes_variable)) {
    if (n->value < 1) throw config_error(n->origin + " must be at least 1");
    out.limits.max_stored_bytes = static_cast<std::uint64_t>(n->value);
  }
  if (auto secret = env.get(store_token_variable)) out.token = std::string(*secret);
  if (out.token.size() > out.limits.max_token_size) {
    throw config_error(std::string(store_token_variable) + " / token is " +
                       std::to_string(out.token.size()) + " bytes; the limit is " +
                       std::to_string(out.limits.max_token_size));
  }
  return out;
}
}  // namespace dtrain

namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE void say(const std::function<void(std::string_view)>& sink,
                              const std::string& text) {
  if (sink) {
    sink(text);
  } else {
    std::fprintf(stderr, "dtrain: %s\n", text.c_str());
  }
}

}  // namespace detail
}  // namespace dtrain
