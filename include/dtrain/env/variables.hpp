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

/// Reads a text variable; nullopt when unset, config_error when set but empty
/// or when it has blanks (a host name never does; a stray space is a typo).
DTRAIN_DETAIL_INLINE std::optional<sourced_text> read_text(const environment& env,
                                                           std::string_view name);

/// Reads a duration variable given in seconds (fractions allowed, e.g.
/// DTRAIN_STORE_TIMEOUT=2.5); nullopt when unset, config_error unless it is a
/// positive number.
DTRAIN_DETAIL_INLINE std::optional<std::chrono::milliseconds> read_seconds(const environment& env,
                                                                           std::string_view name);

/// Reads a switch: 1/true/yes/on or 0/false/no/off; nullopt when unset.
DTRAIN_DETAIL_INLINE std::optional<bool> read_flag(const environment& env, std::string_view name);

/// A setting that a variable and an option both give (a file, a directory):
/// the variable when set, which wins, even empty (`DTRAIN_TIMELINE=` turns an
/// option's timeline off); else the option.
DTRAIN_DETAIL_INLINE std::string read_setting(const environment& env, std::string_view name,
                                              const std::string& option);

/// Reads MASTER_PORT-style variables: an integer in 1..65535.
DTRAIN_DETAIL_INLINE std::optional<sourced_int> read_port(const environment& env,
                                                          std::string_view name);

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/env/variables-inl.hpp>
#endif
