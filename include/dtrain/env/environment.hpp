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

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE environment environment::from_process() {
  std::map<std::string, std::string, std::less<>> vars;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string_view text(*entry);
    if (auto eq = text.find('='); eq != std::string_view::npos && eq > 0) {
      vars.emplace(std::string(text.substr(0, eq)), std::string(text.substr(eq + 1)));
    }
  }
  return environment(std::move(vars));
}

DTRAIN_DETAIL_INLINE std::optional<std::string_view> environment::get(std::string_view name) const {
  if (auto it = vars_.find(name); it != vars_.end()) return std::string_view(it->second);
  return std::nullopt;
}

DTRAIN_DETAIL_INLINE environment environment::with(std::string name, std::string value) const {
  auto vars = vars_;
  vars.insert_or_assign(std::move(name), std::move(value));
  return environment(std::move(vars));
}

DTRAIN_DETAIL_INLINE environment environment::without(std::string_view name) const {
  auto vars = vars_;
  if (auto it = vars.find(name); it != vars.end()) vars.erase(it);
  return environment(std::move(vars));
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
