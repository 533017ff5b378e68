#pragma once
/// @file
/// The non-template bodies of dtrain/env/environment.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/env/environment.hpp, not this file.

#include <dtrain/env/environment.hpp>

namespace dtrain {

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

}  // namespace dtrain
