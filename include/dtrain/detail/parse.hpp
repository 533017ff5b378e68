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

/// Parses a non-negative decimal integer that fits an int. `what` is how the
/// message names the input, usually assignment(name, text).
DTRAIN_DETAIL_INLINE int parse_non_negative(const std::string& what, std::string_view text);

/// Checks that a port is in 1..65535.
DTRAIN_DETAIL_INLINE int check_port(const std::string& what, int port);

/// Splits `text` at every `separator` (an empty text gives no pieces).
DTRAIN_DETAIL_INLINE std::vector<std::string> split(std::string_view text, char separator);

/// A host with an optional port.
struct host_port {
  std::string host;
  std::optional<int> port;
};

/// Splits `host:port`, `[v6addr]:port`, `host` or a bare IPv6 address. `what`
/// names the input for messages.
DTRAIN_DETAIL_INLINE host_port split_host_port(const std::string& what, std::string_view text);

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/detail/parse-inl.hpp>
#endif
