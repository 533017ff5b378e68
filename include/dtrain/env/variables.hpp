#pragma once
/// @file
/// Typed readers of environment variables from a snapshot (dtrain::environment):
/// counts, text, durations, switches and ports. Each failure is a config_error
/// that quotes the variable and its value (detail/parse.hpp does the parsing).

#include <dtrain/config.hpp>
#include <dtrain/detail/parse.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/names.hpp>
#include <dtrain/error.hpp>

#include <charconv>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

namespace dtrain::detail {

/// Reads an integer variable; nullopt when unset, config_error when set but
/// empty or not a non-negative integer.
DTRAIN_DETAIL_INLINE std::optional<sourced_int> read_int(const environment& env,
                                                         std::string_view name);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<sourced_int> read_int(const environment& env,
                                                         std::string_view name) {
  auto text = env.get(name);
  if (!text) return std::nullopt;
  auto origin = assignment(name, *text);
  if (text->empty()) throw config_error(std::string(name) + " is set but empty");
  return sourced_int{parse_non_negative(origin, *text), origin};
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Reads a text variable; nullopt when unset, config_error when set but empty
/// or when it has blanks (a host name never does; a stray space is a typo).
DTRAIN_DETAIL_INLINE std::optional<sourced_text> read_text(const environment& env,
                                                           std::string_view name);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<sourced_text> read_text(const environment& env,
                                                           std::string_view name) {
  auto text = env.get(name);
  if (!text) return std::nullopt;
  auto origin = assignment(name, *text);
  if (text->empty()) throw config_error(std::string(name) + " is set but empty");
  if (text->find_first_of(" \t\r\n") != std::string_view::npos) {
    throw config_error(origin + " contains blanks");
  }
  return sourced_text{std::string(*text), origin};
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Reads a duration variable given in seconds (fractions allowed, e.g.
/// DTRAIN_STORE_TIMEOUT=2.5); nullopt when unset, config_error unless it is a
/// positive number.
DTRAIN_DETAIL_INLINE std::optional<std::chrono::milliseconds> read_seconds(const environment& env,
                                                                           std::string_view name);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<std::chrono::milliseconds> read_seconds(const environment& env,
                                                                           std::string_view name) {
  auto text = env.get(name);
  if (!text) return std::nullopt;
  double seconds = 0;
  auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), seconds);
  if (text->empty() || ec != std::errc() || end != text->data() + text->size() || !(seconds > 0) ||
      seconds > 1e9) {
    throw config_error(assignment(name, *text) + " is not a positive number of seconds");
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000.0 + 0.5));
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Reads a switch: 1/true/yes/on or 0/false/no/off; nullopt when unset.
DTRAIN_DETAIL_INLINE std::optional<bool> read_flag(const environment& env, std::string_view name);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<bool> read_flag(const environment& env, std::string_view name) {
  auto text = env.get(name);
  if (!text) return std::nullopt;
  for (std::string_view yes : {"1", "true", "yes", "on"}) {
    if (*text == yes) return true;
  }
  for (std::string_view no : {"0", "false", "no", "off"}) {
    if (*text == no) return false;
  }
  throw config_error(assignment(name, *text) + " is not 0, 1, true, false, yes, no, on or off");
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Reads MASTER_PORT-style variables: an integer in 1..65535.
DTRAIN_DETAIL_INLINE std::optional<sourced_int> read_port(const environment& env,
                                                          std::string_view name);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<sourced_int> read_port(const environment& env,
                                                          std::string_view name) {
  auto port = read_int(env, name);
  if (port) check_port(port->origin, port->value);
  return port;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
