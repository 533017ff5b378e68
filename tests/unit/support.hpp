#pragma once
// Shared by the unit tests. Tests include only <dtrain/dtrain.hpp>, so the same
// sources also run against the single header.

#include <doctest/doctest.h>
#include <dtrain/dtrain.hpp>

#include <string>
#include <string_view>
#include <vector>

namespace dtrain_test {

/// Runs `f`, which must throw dtrain::config_error, and returns its message.
template <class F>
std::string config_error_text(F&& f) {
  try {
    f();
  } catch (const dtrain::config_error& e) {
    return e.what();
  }
  FAIL("expected a dtrain::config_error, but nothing was thrown");
  return {};
}

/// Discovers the world of a per-process worker from a captured environment.
inline dtrain::world discover(const dtrain::environment& env,
                              std::vector<std::string_view> args = {},
                              const dtrain::discover_options& options = {}) {
  return dtrain::discover_world(env, args, options);
}

inline dtrain::world discover_agent(const dtrain::environment& env,
                                    dtrain::discover_options options = {}) {
  options.mode = dtrain::launch_mode::per_node;
  return dtrain::discover_world(env, {}, options);
}

/// The error message `discover` gives for `env`.
inline std::string discover_error(const dtrain::environment& env,
                                  std::vector<std::string_view> args = {},
                                  const dtrain::discover_options& options = {}) {
  return config_error_text([&] { (void)dtrain::discover_world(env, args, options); });
}

}  // namespace dtrain_test

/// CHECK that `text` contains `part`, printing the whole text when it does not.
#define CHECK_CONTAINS(text, part)                                 \
  CHECK_MESSAGE(std::string(text).find(part) != std::string::npos, \
                "expected to find \"" << (part) << "\" in \"" << (text) << "\"")
