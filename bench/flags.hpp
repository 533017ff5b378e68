// What the benchmarks share: reading their flags, and the median of the rounds.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain_bench {

/// A benchmark's command line: a bad flag or value is its message and exit status 2.
struct flag_reader {
  std::string_view program;  ///< the name in the messages: "dtrain_bench_checkpoint"

  [[noreturn]] void fail(const std::string& what) const {
    std::fprintf(stderr, "%s: %s\n", std::string(program).c_str(), what.c_str());
    std::exit(2);
  }
  /// Walks `--flag value` pairs: `--help` prints `usage` and exits 0; each
  /// pair goes to handle(flag, value), which returns false for a flag it
  /// does not know (fail()); a flag without a value fails.
  template <class Handle>
  void each(int argc, char** argv, const char* usage, Handle&& handle) const {
    for (int i = 1; i < argc; ++i) {
      const std::string_view flag = argv[i];
      if (flag == "--help") {
        std::printf("%s\n", usage);
        std::exit(0);
      }
      if (i + 1 >= argc) fail(std::string(flag) + " needs a value");
      if (!handle(flag, std::string_view(argv[++i]))) fail("unknown flag " + std::string(flag));
    }
  }
  /// `text` as a number above zero, or fail() naming the flag.
  template <class T>
  T positive(std::string_view flag, std::string_view text) const {
    T v{};
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc{} || end != text.data() + text.size() || v <= T{})
      fail(std::string(flag) + " takes a positive number, not '" + std::string(text) + "'");
    return v;
  }
};

/// The median (the upper one of an even count).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace dtrain_bench
