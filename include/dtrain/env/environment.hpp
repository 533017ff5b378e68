#pragma once
/// @file
/// A snapshot of environment variables. World discovery is a pure function of
/// such a snapshot and argv, so every launcher can be tested from a captured
/// environment without touching the process's own.

#include <dtrain/config.hpp>

#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

extern "C" {
extern char** environ;  // POSIX; declared here because <unistd.h> only does so under _GNU_SOURCE
}

namespace dtrain {

/// An immutable name → value map of environment variables.
class environment {
 public:
  environment() = default;

  /// Builds a snapshot from literal pairs, as tests and launchers do.
  environment(std::initializer_list<std::pair<const std::string, std::string>> vars)
      : vars_(vars) {}

  explicit environment(std::map<std::string, std::string, std::less<>> vars)
      : vars_(std::move(vars)) {}

  /// Copies the calling process's environment (`environ`). Entries without '='
  /// are skipped; they cannot be set through setenv and name nothing.
  [[nodiscard]] static environment from_process();

  /// The value of `name`, or nullopt when unset. A variable set to the empty
  /// string is returned as an empty view: set-but-empty is not the same as unset.
  [[nodiscard]] std::optional<std::string_view> get(std::string_view name) const;

  [[nodiscard]] bool contains(std::string_view name) const {
    return vars_.find(name) != vars_.end();
  }

  /// A copy with `name` set to `value`, for launchers that derive a child's environment.
  [[nodiscard]] environment with(std::string name, std::string value) const;

  /// A copy without `name`.
  [[nodiscard]] environment without(std::string_view name) const;

  [[nodiscard]] const std::map<std::string, std::string, std::less<>>& vars() const noexcept {
    return vars_;
  }

 private:
  std::map<std::string, std::string, std::less<>> vars_;
};

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/env/environment-inl.hpp>
#endif
