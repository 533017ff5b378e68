#pragma once
/// @file
/// The non-template bodies of dtrain/error.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/error.hpp, not this file.

#include <dtrain/error.hpp>

namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE std::pair<int, std::string> current_failure() {
  try {
    throw;
  } catch (const program_error& e) {
    return {e.exit_status(), e.what()};
  } catch (const config_error& e) {
    return {config_error_exit_status, e.what()};
  } catch (const std::exception& e) {
    return {1, e.what()};
  } catch (...) {
    return {1, "an exception that is not a std::exception"};
  }
}

}  // namespace detail
}  // namespace dtrain
