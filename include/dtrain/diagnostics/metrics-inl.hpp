#pragma once
/// @file
/// The non-template bodies of dtrain/diagnostics/metrics.hpp: included by it in
/// header-only mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/diagnostics/metrics.hpp, not this file.

#include <dtrain/detail/sys.hpp>
#include <dtrain/diagnostics/metrics.hpp>
#include <dtrain/env/names.hpp>
#include <dtrain/error.hpp>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE void metrics_text::add(std::string_view name, std::string_view type,
                                            std::string_view help, double value) {
  char number[64];
  std::snprintf(number, sizeof number, "%.15g", value);
  const std::string n(name);
  text_ += "# HELP " + n + " " + std::string(help) + "\n# TYPE " + n + " " + std::string(type) +
           "\n" + n + "{" + labels_ + "} " + number + "\n";
}

DTRAIN_DETAIL_INLINE std::string metrics_text::quoted(std::string_view value) {
  std::string out = "\"";
  for (const char c : value) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out + "\"";
}

DTRAIN_DETAIL_INLINE void write_metrics(const std::filesystem::path& file, const std::string& text,
                                        int rank) {
  write_file_whole(file.string(), text,
                   std::string(metrics_dir_variable) + " (or ddp_options::metrics_dir)", rank);
}

}  // namespace dtrain::detail
