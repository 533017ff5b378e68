#pragma once
/// @file
/// The non-template bodies of dtrain/detail/parse.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/detail/parse.hpp, not this file.

#include <dtrain/detail/parse.hpp>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE std::string assignment(std::string_view name, std::string_view value) {
  bool quote = value.empty() || value.find_first_of(" \t\r\n") != std::string_view::npos;
  std::string out(name);
  out += '=';
  if (quote) out += '"';
  out += value;
  if (quote) out += '"';
  return out;
}

DTRAIN_DETAIL_INLINE int parse_non_negative(const std::string& what, std::string_view text) {
  if (!text.empty() && text.front() == '-' && text.size() > 1 &&
      text.find_first_not_of("0123456789", 1) == std::string_view::npos) {
    throw config_error(what + " is negative: ranks, sizes and indices count from 0");
  }
  if (text.empty() || text.find_first_not_of("0123456789") != std::string_view::npos) {
    throw config_error(what + " is not a non-negative integer");
  }
  int value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec == std::errc::result_out_of_range) {
    throw config_error(what + " is too large (the limit is " +
                       std::to_string(std::numeric_limits<int>::max()) + ")");
  }
  if (ec != std::errc() || end != text.data() + text.size()) {
    throw config_error(what + " is not a non-negative integer");
  }
  return value;
}

DTRAIN_DETAIL_INLINE int check_port(const std::string& what, int port) {
  if (port < 1 || port > 65535) throw config_error(what + " is outside the port range 1-65535");
  return port;
}

DTRAIN_DETAIL_INLINE std::vector<std::string> split(std::string_view text, char separator) {
  std::vector<std::string> out;
  if (text.empty()) return out;
  std::size_t start = 0;
  while (true) {
    auto end = text.find(separator, start);
    out.emplace_back(text.substr(start, end == std::string_view::npos ? end : end - start));
    if (end == std::string_view::npos) return out;
    start = end + 1;
  }
}

DTRAIN_DETAIL_INLINE host_port split_host_port(const std::string& what, std::string_view text) {
  if (text.empty()) throw config_error(what + " has an empty address");
  std::string_view host = text;
  std::string_view port;
  bool has_port = false;
  if (text.front() == '[') {
    auto close = text.find(']');
    if (close == std::string_view::npos || close == 1) {
      throw config_error(what + " has an unbalanced or empty '[' address");
    }
    host = text.substr(1, close - 1);
    auto rest = text.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') throw config_error(what + " has text after ']' that is not ':port'");
      port = rest.substr(1);
      has_port = true;
    }
  } else if (auto colon = text.find(':'); colon != std::string_view::npos &&
                                          text.find(':', colon + 1) == std::string_view::npos) {
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    has_port = true;
  }
  if (host.empty()) throw config_error(what + " has an empty host");
  host_port out{std::string(host), std::nullopt};
  if (has_port) {
    out.port =
        check_port(what, parse_non_negative(what + " (port '" + std::string(port) + "')", port));
  }
  return out;
}

}  // namespace dtrain::detail
