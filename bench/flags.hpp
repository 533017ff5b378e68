// What the benchmarks share: reading their flags, the median of the rounds,
// the peak resident memory, and starting themselves again with more flags.
#pragma once

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

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

/// Starts counting the peak resident memory again from now (Linux: "5" to
/// /proc/self/clear_refs resets VmHWM); false where it cannot.
inline bool reset_peak_resident() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

/// The process's peak resident memory (VmHWM), in bytes.
inline std::size_t peak_resident() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::strtoull(line.c_str() + 6, nullptr, 10) * 1024;
  }
  return 0;
}

/// Runs this program again (/proc/self/exe) with its own arguments and
/// `more` appended, and waits: std::system's status, or -1 (with a message
/// naming `program`) when it cannot find itself.
inline int run_self(std::string_view program, int argc, char** argv, const std::string& more) {
  std::array<char, 4096> self{};
  const ssize_t length = readlink("/proc/self/exe", self.data(), self.size() - 1);
  if (length <= 0) {
    std::fprintf(stderr, "%s: cannot find its own executable (/proc/self/exe)\n",
                 std::string(program).c_str());
    return -1;
  }
  std::string command = "'";  // appended, not "'" + string: GCC 12's -Wrestrict misfires at -O3
  command.append(self.data(), static_cast<std::size_t>(length));
  command += "'";
  for (int i = 1; i < argc; ++i) command += std::string(" '") + argv[i] + "'";
  command += " " + more;
  return std::system(command.c_str());
}

}  // namespace dtrain_bench
