#pragma once
/// @file
/// The non-template bodies of dtrain/env/variables.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/env/variables.hpp, not this file.

#include <dtrain/env/variables.hpp>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE std::optional<sourced_int> read_int(const environment& env,
                                                         std::string_view name) {
  auto text = env.get(name);
  if (!text) return std::nullopt;
  auto origin = assignment(name, *text);
  if (text->empty()) throw config_error(std::string(name) + " is set but empty");
  return sourced_int{parse_non_negative(origin, *text), origin};
}

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

DTRAIN_DETAIL_INLINE std::string read_setting(const environment& env, std::string_view name,
                                              const std::string& option) {
  if (auto v = env.get(name)) return std::string(*v);
  return option;
}

DTRAIN_DETAIL_INLINE std::optional<sourced_int> read_port(const environment& env,
                                                          std::string_view name) {
  auto port = read_int(env, name);
  if (port) check_port(port->origin, port->value);
  return port;
}

}  // namespace dtrain::detail
