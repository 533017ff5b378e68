#pragma once
/// @file
/// The non-template bodies of dtrain/runtime/run.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/runtime/run.hpp, not this file.

#include <dtrain/runtime/run.hpp>

namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE int report_failure(const std::string& who,
                                        const std::pair<int, std::string>& failure) {
  std::fprintf(stderr, "%s dtrain: %s\n", who.c_str(), failure.second.c_str());
  return failure.first;
}

DTRAIN_DETAIL_INLINE std::string own_executable() {
  std::vector<char> path(4096);
  ssize_t n = DTRAIN_SYSCALL(::readlink("/proc/self/exe", path.data(), path.size() - 1));
  return std::string(path.data(), static_cast<std::size_t>(n));
}

}  // namespace detail
}  // namespace dtrain
