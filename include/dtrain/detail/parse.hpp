#pragma once
/// @file
/// Strict parsers for the small values launchers hand us: counts, ports and
/// `host:port`. Each failure is a config_error that quotes the variable and its
/// value, because the person reading it has to find which launcher set what.
/// Text in, value out: reading them from an environment is env/variables.hpp.

#include <dtrain/config.hpp>
#include <dtrain/error.hpp>

#include <charconv>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

namespace dtrain::detail {

/// A value together with the text that stated it, e.g. {3, "RANK=3"}.
template <class T>
struct sourced {
  T value;
  std::string origin;
};
using sourced_int = sourced<int>;
using sourced_text = sourced<std::string>;

/// Stores `v` in `slot`, or checks that it says the same as what is there:
/// two sources that disagree are a config_error naming both, e.g.
/// `PET_NNODES=2 and DTRAIN_NNODES=3 disagree about the number of nodes`.
template <class T>
void agree(std::optional<sourced<T>>& slot,
           const std::type_identity_t<std::optional<sourced<T>>>& v, std::string_view what) {
  if (!v) return;
  if (!slot) {
    slot = v;
  } else if (!(slot->value == v->value)) {
    throw config_error(slot->origin + " and " + v->origin + " disagree about " + std::string(what));
  }
}

/// `NAME=value`, with the value in quotes when it is empty or has blanks, so
/// that `RANK=" 3"` in a message shows the stray space.
DTRAIN_DETAIL_INLINE std::string assignment(std::string_view name, std::string_view value);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string assignment(std::string_view name, std::string_view value) {
  bool quote = value.empty() || value.find_first_of(" \t\r\n") != std::string_view::npos;
  std::string out(name);
  out += '=';
  if (quote) out += '"';
  out += value;
  if (quote) out += '"';
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Parses a non-negative decimal integer that fits an int. `what` is how the
/// message names the input, usually assignment(name, text).
DTRAIN_DETAIL_INLINE int parse_non_negative(const std::string& what, std::string_view text);
#if DTRAIN_DETAIL_BODIES()
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
#endif  // DTRAIN_DETAIL_BODIES()

/// Checks that a port is in 1..65535.
DTRAIN_DETAIL_INLINE int check_port(const std::string& what, int port);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE int check_port(const std::string& what, int port) {
  if (port < 1 || port > 65535) throw config_error(what + " is outside the port range 1-65535");
  return port;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Splits `text` at every `separator` (an empty text gives no pieces).
DTRAIN_DETAIL_INLINE std::vector<std::string> split(std::string_view text, char separator);
#if DTRAIN_DETAIL_BODIES()
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
#endif  // DTRAIN_DETAIL_BODIES()

/// A host with an optional port.
struct host_port {
  std::string host;
  std::optional<int> port;
};

/// Splits `host:port`, `[v6addr]:port`, `host` or a bare IPv6 address. `what`
/// names the input for messages.
DTRAIN_DETAIL_INLINE host_port split_host_port(const std::string& what, std::string_view text);
#if DTRAIN_DETAIL_BODIES()
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
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
