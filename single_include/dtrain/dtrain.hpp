// dtrain: header-only C++20 data-parallel distributed training.
// Single-header distribution, generated from include/dtrain/ by
// tools/amalgamate.cmake. Do not edit; run `cmake -P tools/amalgamate.cmake`.
// SPDX-License-Identifier: MIT

#ifndef DTRAIN_SINGLE_INCLUDE_DTRAIN_HPP
#define DTRAIN_SINGLE_INCLUDE_DTRAIN_HPP

// ---- begin dtrain/dtrain.hpp ----
/// @file
/// The one header users include. It only includes; it has no code of its own.

// ---- begin dtrain/config.hpp ----
/// @file
/// Version and the engine switches. The engines are opt-in: the CMake target
/// dtrain::dtrain defines DTRAIN_WITH_MPI / DTRAIN_WITH_GLOO / DTRAIN_WITH_NCCL
/// for the engines it found; a user of the single header defines them before
/// including it. Test them with the function-like macros below, so that a typo
/// is a compile error rather than a silently false `#if`.

#define DTRAIN_VERSION_MAJOR 0
#define DTRAIN_VERSION_MINOR 1
#define DTRAIN_VERSION_PATCH 0
#define DTRAIN_VERSION_STRING "0.1.0"

#if defined(DTRAIN_WITH_MPI) && (DTRAIN_WITH_MPI + 0)
#define DTRAIN_HAS_MPI() 1
#else
#define DTRAIN_HAS_MPI() 0
#endif

#if defined(DTRAIN_WITH_GLOO) && (DTRAIN_WITH_GLOO + 0)
#define DTRAIN_HAS_GLOO() 1
#else
#define DTRAIN_HAS_GLOO() 0
#endif

#if defined(DTRAIN_WITH_NCCL) && (DTRAIN_WITH_NCCL + 0)
#define DTRAIN_HAS_NCCL() 1
#else
#define DTRAIN_HAS_NCCL() 0
#endif
// ---- end dtrain/config.hpp ----
// ---- begin dtrain/env/discover.hpp ----
/// @file
/// discover_world(): who this process is, as a pure function of (environment,
/// argv, options). See the README's launcher table for what each launcher
/// sets and how dtrain reads it.

// ---- begin dtrain/detail/parse.hpp ----
/// @file
/// Strict readers for the small values launchers hand us: counts, ports and
/// `host:port`. Each failure is a config_error that quotes the variable and its
/// value, because the person reading it has to find which launcher set what.

// ---- begin dtrain/env/environment.hpp ----
/// @file
/// A snapshot of environment variables. World discovery is a pure function of
/// such a snapshot and argv, so every launcher can be tested from a captured
/// environment without touching the process's own.

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
  [[nodiscard]] static environment from_process() {
    std::map<std::string, std::string, std::less<>> vars;
    for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
      std::string_view text(*entry);
      if (auto eq = text.find('='); eq != std::string_view::npos && eq > 0) {
        vars.emplace(std::string(text.substr(0, eq)), std::string(text.substr(eq + 1)));
      }
    }
    return environment(std::move(vars));
  }

  /// The value of `name`, or nullopt when unset. A variable set to the empty
  /// string is returned as an empty view: set-but-empty is not the same as unset.
  [[nodiscard]] std::optional<std::string_view> get(std::string_view name) const {
    if (auto it = vars_.find(name); it != vars_.end()) return std::string_view(it->second);
    return std::nullopt;
  }

  [[nodiscard]] bool contains(std::string_view name) const {
    return vars_.find(name) != vars_.end();
  }

  /// A copy with `name` set to `value`, for launchers that derive a child's environment.
  [[nodiscard]] environment with(std::string name, std::string value) const {
    auto vars = vars_;
    vars.insert_or_assign(std::move(name), std::move(value));
    return environment(std::move(vars));
  }

  /// A copy without `name`.
  [[nodiscard]] environment without(std::string_view name) const {
    auto vars = vars_;
    if (auto it = vars.find(name); it != vars.end()) vars.erase(it);
    return environment(std::move(vars));
  }

  [[nodiscard]] const std::map<std::string, std::string, std::less<>>& vars() const noexcept {
    return vars_;
  }

 private:
  std::map<std::string, std::string, std::less<>> vars_;
};

}  // namespace dtrain
// ---- end dtrain/env/environment.hpp ----
// ---- begin dtrain/error.hpp ----
/// @file
/// The error hierarchy. Every failure dtrain reports is a dtrain::error; the
/// children are the cases a caller can act on.

#include <stdexcept>
#include <string>

namespace dtrain {

/// Root of every exception dtrain throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Bad environment, argv or options. The message names each variable involved
/// and its value (`RANK=7 is not below WORLD_SIZE=4`). `dtrain_whoami` and
/// `dtrain::run` exit with status 2 on it.
class config_error : public error {
 public:
  using error::error;
};

/// A blocking or awaited operation ran past its timeout; the message says what
/// it waited for and how long.
class timeout_error : public error {
 public:
  using error::error;
};

/// The rendezvous store could not be reached, served or trusted.
class rendezvous_error : public error {
 public:
  using error::error;
};

/// A collective engine (MPI, Gloo, NCCL, CUDA) reported a failure. Keeps the
/// engine's own code next to the message.
class backend_error : public error {
 public:
  backend_error(const std::string& what, int engine_code)
      : error(what), engine_code_(engine_code) {}

  /// The engine's own status code (MPI error class, ncclResult_t, cudaError_t).
  [[nodiscard]] int engine_code() const noexcept { return engine_code_; }

 private:
  int engine_code_;
};

}  // namespace dtrain
// ---- end dtrain/error.hpp ----

#include <charconv>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

namespace dtrain::detail {

/// A value together with the text that stated it, e.g. {3, "RANK=3"}.
template <class T>
struct sourced {
  T value;
  std::string origin;
};
using sourced_int = sourced<int>;
using sourced_text = sourced<std::string>;

/// `NAME=value`, with the value in quotes when it is empty or has blanks, so
/// that `RANK=" 3"` in a message shows the stray space.
inline std::string assignment(std::string_view name, std::string_view value) {
  bool quote = value.empty() || value.find_first_of(" \t\r\n") != std::string_view::npos;
  std::string out(name);
  out += '=';
  if (quote) out += '"';
  out += value;
  if (quote) out += '"';
  return out;
}

/// Parses a non-negative decimal integer that fits an int. `what` is how the
/// message names the input, usually assignment(name, text).
inline int parse_non_negative(const std::string& what, std::string_view text) {
  if (!text.empty() && text.front() == '-' && text.size() > 1 &&
      text.find_first_not_of("0123456789", 1) == std::string_view::npos) {
    throw config_error(what + " is negative: ranks, sizes and indices count from 0");
  }
  if (text.empty() || text.find_first_not_of("0123456789") != std::string_view::npos) {
    throw config_error(what + " is not a non-negative integer");
  }
  int value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec == std::errc::result_out_of_range) {
    throw config_error(what + " is too large (the limit is " +
                       std::to_string(std::numeric_limits<int>::max()) + ")");
  }
  if (ec != std::errc() || end != text.data() + text.size()) {
    throw config_error(what + " is not a non-negative integer");
  }
  return value;
}

/// Checks that a port is in 1..65535.
inline int check_port(const std::string& what, int port) {
  if (port < 1 || port > 65535) throw config_error(what + " is outside the port range 1-65535");
  return port;
}

/// Reads an integer variable; nullopt when unset, config_error when set but
/// empty or not a non-negative integer.
inline std::optional<sourced_int> read_int(const environment& env, std::string_view name) {
  auto text = env.get(name);
  if (!text) return std::nullopt;
  auto origin = assignment(name, *text);
  if (text->empty()) throw config_error(std::string(name) + " is set but empty");
  return sourced_int{parse_non_negative(origin, *text), origin};
}

/// Reads a text variable; nullopt when unset, config_error when set but empty
/// or when it has blanks (a host name never does; a stray space is a typo).
inline std::optional<sourced_text> read_text(const environment& env, std::string_view name) {
  auto text = env.get(name);
  if (!text) return std::nullopt;
  auto origin = assignment(name, *text);
  if (text->empty()) throw config_error(std::string(name) + " is set but empty");
  if (text->find_first_of(" \t\r\n") != std::string_view::npos) {
    throw config_error(origin + " contains blanks");
  }
  return sourced_text{std::string(*text), origin};
}

/// Reads MASTER_PORT-style variables: an integer in 1..65535.
inline std::optional<sourced_int> read_port(const environment& env, std::string_view name) {
  auto port = read_int(env, name);
  if (port) check_port(port->origin, port->value);
  return port;
}

/// A host with an optional port.
struct host_port {
  std::string host;
  std::optional<int> port;
};

/// Splits `host:port`, `[v6addr]:port`, `host` or a bare IPv6 address. `what`
/// names the input for messages.
inline host_port split_host_port(const std::string& what, std::string_view text) {
  if (text.empty()) throw config_error(what + " has an empty address");
  std::string_view host = text;
  std::string_view port;
  bool has_port = false;
  if (text.front() == '[') {
    auto close = text.find(']');
    if (close == std::string_view::npos || close == 1) {
      throw config_error(what + " has an unbalanced or empty '[' address");
    }
    host = text.substr(1, close - 1);
    auto rest = text.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') throw config_error(what + " has text after ']' that is not ':port'");
      port = rest.substr(1);
      has_port = true;
    }
  } else if (auto colon = text.find(':'); colon != std::string_view::npos &&
                                          text.find(':', colon + 1) == std::string_view::npos) {
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    has_port = true;
  }
  if (host.empty()) throw config_error(what + " has an empty host");
  host_port out{std::string(host), std::nullopt};
  if (has_port) {
    out.port =
        check_port(what, parse_non_negative(what + " (port '" + std::string(port) + "')", port));
  }
  return out;
}

}  // namespace dtrain::detail
// ---- end dtrain/detail/parse.hpp ----
// ---- begin dtrain/env/launchers.hpp ----
/// @file
/// One reader per launcher. Each turns that launcher's variables into an
/// `observation`: what it says about this process, each value with the
/// variable that said it. discover_world() (env/discover.hpp) reconciles them.

// ---- begin dtrain/detail/hostlist.hpp ----
/// @file
/// Slurm's compressed notations: host lists (`gpu-[01-03,07],cpu5`) and task
/// counts per node (`2(x3),1`). Parsed without expanding, so a hostile or
/// enormous list costs nothing until someone asks for its hosts.


#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::detail {

/// A parsed Slurm host list.
class hostlist {
 public:
  /// Parses `text`; `what` names it in messages (`SLURM_STEP_NODELIST=...`).
  static hostlist parse(std::string_view text, const std::string& what) {
    hostlist list;
    if (text.empty()) throw config_error(what + " is an empty host list");
    std::size_t start = 0;
    int depth = 0;
    for (std::size_t i = 0; i <= text.size(); ++i) {
      if (i < text.size() && text[i] == '[') {
        if (++depth > 1)
          throw config_error(what + " has nested '[' at offset " + std::to_string(i));
      } else if (i < text.size() && text[i] == ']') {
        if (--depth < 0)
          throw config_error(what + " has ']' without '[' at offset " + std::to_string(i));
      } else if (i == text.size() || (text[i] == ',' && depth == 0)) {
        if (depth != 0) throw config_error(what + " has '[' without ']'");
        list.patterns_.push_back(parse_pattern(text.substr(start, i - start), what));
        start = i + 1;
      }
    }
    return list;
  }

  /// Number of hosts, saturating at SIZE_MAX for absurd lists.
  [[nodiscard]] std::size_t size() const {
    std::size_t total = 0;
    for (const auto& p : patterns_) total = saturating_add(total, pattern_size(p));
    return total;
  }

  /// The first host: what Slurm-aware launchers use as the master.
  [[nodiscard]] std::string front() const {
    std::string host;
    for (const auto& pc : patterns_.front()) {
      host += pc.ranges.empty() ? pc.literal : pc.ranges.front().format(pc.ranges.front().first);
    }
    return host;
  }

  /// All hosts in order; config_error past `limit` hosts.
  [[nodiscard]] std::vector<std::string> expand(std::size_t limit = 1u << 20) const {
    if (size() > limit) {
      throw config_error("host list of " + std::to_string(size()) + " hosts exceeds the limit of " +
                         std::to_string(limit));
    }
    std::vector<std::string> hosts;
    for (const auto& p : patterns_) {
      std::vector<std::string> partial{""};
      for (const auto& pc : p) {
        std::vector<std::string> next;
        if (pc.ranges.empty()) {
          for (auto& s : partial) next.push_back(s + pc.literal);
        } else {
          for (auto& s : partial) {
            for (const auto& r : pc.ranges) {
              for (std::uint64_t n = r.first; n <= r.last; ++n) next.push_back(s + r.format(n));
            }
          }
        }
        partial = std::move(next);
      }
      hosts.insert(hosts.end(), partial.begin(), partial.end());
    }
    return hosts;
  }

 private:
  struct range {
    std::uint64_t first;
    std::uint64_t last;
    std::size_t width;  // digits of the lower bound as written: "01-10" pads to 2

    [[nodiscard]] std::string format(std::uint64_t n) const {
      std::string digits = std::to_string(n);
      if (digits.size() < width) digits.insert(0, width - digits.size(), '0');
      return digits;
    }
    [[nodiscard]] std::size_t count() const { return static_cast<std::size_t>(last - first + 1); }
  };
  // A piece is literal text, or a bracket of ranges when `ranges` is not empty.
  struct piece {
    std::string literal;
    std::vector<range> ranges;
  };
  using pattern = std::vector<piece>;

  static std::size_t saturating_add(std::size_t a, std::size_t b) {
    return a > std::numeric_limits<std::size_t>::max() - b ? std::numeric_limits<std::size_t>::max()
                                                           : a + b;
  }
  static std::size_t saturating_mul(std::size_t a, std::size_t b) {
    return b != 0 && a > std::numeric_limits<std::size_t>::max() / b
               ? std::numeric_limits<std::size_t>::max()
               : a * b;
  }
  static std::size_t pattern_size(const pattern& p) {
    std::size_t n = 1;
    for (const auto& pc : p) {
      if (pc.ranges.empty()) continue;
      std::size_t in_bracket = 0;
      for (const auto& r : pc.ranges) in_bracket = saturating_add(in_bracket, r.count());
      n = saturating_mul(n, in_bracket);
    }
    return n;
  }

  static std::uint64_t parse_bound(std::string_view digits, const std::string& what) {
    if (digits.empty() || digits.size() > 18 ||
        digits.find_first_not_of("0123456789") != std::string_view::npos) {
      throw config_error(what + " has a bad range bound '" + std::string(digits) + "'");
    }
    return std::stoull(std::string(digits));
  }

  static pattern parse_pattern(std::string_view text, const std::string& what) {
    if (text.empty()) throw config_error(what + " has an empty host name");
    pattern p;
    std::size_t i = 0;
    while (i < text.size()) {
      if (text[i] != '[') {
        auto next = text.find('[', i);
        p.push_back(piece{std::string(text.substr(i, next - i)), {}});
        i = next == std::string_view::npos ? text.size() : next;
        continue;
      }
      auto close = text.find(']', i);
      auto body = text.substr(i + 1, close - i - 1);
      if (body.empty()) throw config_error(what + " has an empty '[]'");
      piece bracket;
      std::size_t s = 0;
      while (s <= body.size()) {
        auto comma = body.find(',', s);
        auto item =
            body.substr(s, comma == std::string_view::npos ? std::string_view::npos : comma - s);
        auto dash = item.find('-');
        auto lo = item.substr(0, dash);
        auto hi = dash == std::string_view::npos ? lo : item.substr(dash + 1);
        range r{parse_bound(lo, what), parse_bound(hi, what), lo.size()};
        if (r.last < r.first) {
          throw config_error(what + " has a descending range '" + std::string(item) + "'");
        }
        bracket.ranges.push_back(r);
        if (comma == std::string_view::npos) break;
        s = comma + 1;
      }
      p.push_back(std::move(bracket));
      i = close + 1;
    }
    return p;
  }

  std::vector<pattern> patterns_;
};

/// Expands Slurm's tasks-per-node notation (`2(x3),1` → 2,2,2,1). `what`
/// names it in messages; config_error past `limit` nodes.
inline std::vector<int> parse_tasks_per_node(std::string_view text, const std::string& what,
                                             std::size_t limit = 1u << 20) {
  std::vector<int> counts;
  if (text.empty()) throw config_error(what + " is empty");
  std::size_t start = 0;
  while (start <= text.size()) {
    auto comma = text.find(',', start);
    auto item = text.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    int repeat = 1;
    auto paren = item.find('(');
    if (paren != std::string_view::npos) {
      if (item.size() < paren + 4 || item.substr(paren, 2) != "(x" || item.back() != ')') {
        throw config_error(what + " has a malformed item '" + std::string(item) +
                           "' (expected N or N(xM))");
      }
      repeat = parse_non_negative(what + " (repeat count in '" + std::string(item) + "')",
                                  item.substr(paren + 2, item.size() - paren - 3));
      item = item.substr(0, paren);
    }
    int count = parse_non_negative(what + " (task count '" + std::string(item) + "')", item);
    if (repeat == 0 || count == 0) {
      throw config_error(what + " lists a node with zero tasks or a zero repeat");
    }
    if (counts.size() + static_cast<std::size_t>(repeat) > limit) {
      throw config_error(what + " describes more than " + std::to_string(limit) + " nodes");
    }
    counts.insert(counts.end(), static_cast<std::size_t>(repeat), count);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return counts;
}

}  // namespace dtrain::detail
// ---- end dtrain/detail/hostlist.hpp ----
// ---- begin dtrain/detail/json.hpp ----
/// @file
/// A small strict JSON reader (RFC 8259) for TF_CONFIG. A whole JSON library as
/// a dependency of a single-header library, for one variable, is not worth it.
/// Errors are config_errors that quote the input's name and the position.


#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::detail::json {

struct member;

/// A parsed JSON value. Numbers keep their text; as_index() reads the integers
/// that TF_CONFIG needs without a round trip through double.
struct value {
  enum class kind { null, boolean, number, string, array, object };

  kind type = kind::null;
  bool boolean = false;
  std::string text;  // the string's content, or the number as written
  std::vector<value> items;
  std::vector<member> members;  // in document order; keys are unique

  [[nodiscard]] const value* find(std::string_view key) const;
  [[nodiscard]] bool is(kind k) const noexcept { return type == k; }
};

struct member {
  std::string key;
  value val;
};

inline const value* value::find(std::string_view key) const {
  for (const auto& m : members) {
    if (m.key == key) return &m.val;
  }
  return nullptr;
}

/// The name of a kind, for messages ("expected an array, found a string").
inline const char* kind_name(value::kind k) {
  switch (k) {
    case value::kind::null: return "null";
    case value::kind::boolean: return "a boolean";
    case value::kind::number: return "a number";
    case value::kind::string: return "a string";
    case value::kind::array: return "an array";
    case value::kind::object: return "an object";
  }
  return "a value";
}

namespace impl {

class reader {
 public:
  reader(std::string_view text, std::string_view what) : text_(text), what_(what) {}

  value document() {
    skip_blanks();
    value v = parse_value(0);
    skip_blanks();
    if (pos_ != text_.size()) fail("unexpected text after the JSON value");
    return v;
  }

 private:
  static constexpr int max_depth = 64;

  [[noreturn]] void fail(const std::string& why) const {
    std::size_t line = 1, column = 1;
    for (std::size_t i = 0; i < pos_ && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    std::string near(text_.substr(pos_ < text_.size() ? pos_ : text_.size(), 16));
    for (char& c : near) {
      if (static_cast<unsigned char>(c) < 0x20) c = ' ';
    }
    throw config_error(
        std::string(what_) + " is not valid JSON: " + why + " at offset " + std::to_string(pos_) +
        " (line " + std::to_string(line) + ", column " + std::to_string(column) + ")" +
        (near.empty() ? std::string(", at the end of the text") : ", near '" + near + "'"));
  }

  void skip_blanks() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\n' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }

  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return text_[pos_]; }

  void expect_word(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) fail("expected '" + std::string(word) + "'");
    pos_ += word.size();
  }

  value parse_value(int depth) {
    if (depth > max_depth) fail("nesting deeper than " + std::to_string(max_depth) + " levels");
    if (at_end()) fail("expected a value");
    value v;
    switch (peek()) {
      case '{': parse_object(v, depth); break;
      case '[': parse_array(v, depth); break;
      case '"':
        v.type = value::kind::string;
        v.text = parse_string();
        break;
      case 't':
        expect_word("true");
        v.type = value::kind::boolean;
        v.boolean = true;
        break;
      case 'f':
        expect_word("false");
        v.type = value::kind::boolean;
        break;
      case 'n': expect_word("null"); break;
      default:
        if (peek() == '-' || (peek() >= '0' && peek() <= '9')) {
          v.type = value::kind::number;
          v.text = parse_number();
        } else {
          fail("expected a value");
        }
    }
    return v;
  }

  void parse_object(value& v, int depth) {
    v.type = value::kind::object;
    ++pos_;  // '{'
    skip_blanks();
    if (!at_end() && peek() == '}') {
      ++pos_;
      return;
    }
    for (;;) {
      skip_blanks();
      if (at_end() || peek() != '"') fail("expected a string key");
      std::size_t key_pos = pos_;
      std::string key = parse_string();
      if (v.find(key) != nullptr) {
        pos_ = key_pos;
        fail("duplicate key \"" + key + "\"");
      }
      skip_blanks();
      if (at_end() || peek() != ':') fail("expected ':' after an object key");
      ++pos_;
      skip_blanks();
      value item = parse_value(depth + 1);
      v.members.push_back(member{std::move(key), std::move(item)});
      skip_blanks();
      if (at_end()) fail("expected ',' or '}'");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == '}') {
        ++pos_;
        return;
      }
      fail("expected ',' or '}'");
    }
  }

  void parse_array(value& v, int depth) {
    v.type = value::kind::array;
    ++pos_;  // '['
    skip_blanks();
    if (!at_end() && peek() == ']') {
      ++pos_;
      return;
    }
    for (;;) {
      skip_blanks();
      v.items.push_back(parse_value(depth + 1));
      skip_blanks();
      if (at_end()) fail("expected ',' or ']'");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == ']') {
        ++pos_;
        return;
      }
      fail("expected ',' or ']'");
    }
  }

  std::string parse_number() {
    std::size_t start = pos_;
    auto digits = [&] {
      std::size_t first = pos_;
      while (!at_end() && peek() >= '0' && peek() <= '9') ++pos_;
      return pos_ - first;
    };
    if (peek() == '-') ++pos_;
    if (at_end()) fail("expected a digit");
    if (peek() == '0') {
      ++pos_;
      if (!at_end() && peek() >= '0' && peek() <= '9') fail("leading zeros are not allowed");
    } else if (digits() == 0) {
      fail("expected a digit");
    }
    if (!at_end() && peek() == '.') {
      ++pos_;
      if (digits() == 0) fail("expected a digit after '.'");
    }
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      ++pos_;
      if (!at_end() && (peek() == '+' || peek() == '-')) ++pos_;
      if (digits() == 0) fail("expected a digit in the exponent");
    }
    return std::string(text_.substr(start, pos_ - start));
  }

  unsigned read_hex4() {
    if (text_.size() - pos_ < 4) fail("expected four hex digits after \\u");
    unsigned code = 0;
    for (int i = 0; i < 4; ++i) {
      char c = text_[pos_++];
      code <<= 4;
      if (c >= '0' && c <= '9') {
        code |= static_cast<unsigned>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        code |= static_cast<unsigned>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        code |= static_cast<unsigned>(c - 'A' + 10);
      } else {
        --pos_;
        fail("expected four hex digits after \\u");
      }
    }
    return code;
  }

  static void append_utf8(std::string& out, std::uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    for (;;) {
      if (at_end()) fail("unterminated string");
      char c = text_[pos_];
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) fail("unescaped control character in a string");
      if (c != '\\') {
        out += c;
        ++pos_;
        continue;
      }
      ++pos_;
      if (at_end()) fail("unterminated escape");
      char e = text_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          std::uint32_t cp = read_hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (text_.substr(pos_, 2) != "\\u") fail("a high surrogate must be followed by \\u");
            pos_ += 2;
            std::uint32_t low = read_hex4();
            if (low < 0xDC00 || low > 0xDFFF) fail("invalid low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("a low surrogate without a high one");
          }
          append_utf8(out, cp);
          break;
        }
        default: --pos_; fail(std::string("invalid escape '\\") + e + "'");
      }
    }
  }

  std::string_view text_;
  std::string_view what_;
  std::size_t pos_ = 0;
};

}  // namespace impl

/// Parses one JSON document. `what` names the input in messages ("TF_CONFIG").
/// Throws config_error quoting the offset, line and column of the first error.
inline value parse(std::string_view text, std::string_view what) {
  return impl::reader(text, what).document();
}

}  // namespace dtrain::detail::json
// ---- end dtrain/detail/json.hpp ----
// ---- begin dtrain/env/world.hpp ----
/// @file
/// `dtrain::world`: who this process is in the job, as the launcher told it.
/// A plain value; discover_world() (env/discover.hpp) builds it.

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace dtrain {

/// The launcher whose variables identified this process.
enum class launcher {
  none,       ///< no launcher variables: a single process
  env,        ///< env:// (torchrun, dtrun, Azure ML PyTorch, Kubeflow, Lightning-style NODE_RANK)
  open_mpi,   ///< Open MPI's mpirun (OMPI_COMM_WORLD_*)
  hydra,      ///< MPICH / Intel MPI Hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID)
  slurm,      ///< srun (SLURM_PROCID, SLURM_NTASKS, ...)
  horovod,    ///< horovodrun (HOROVOD_RANK, ...)
  tf_config,  ///< TF_CONFIG (Kubeflow TFJob, Azure ML TensorFlow jobs)
};

/// The launcher's name as whoami and describe() print it.
[[nodiscard]] constexpr std::string_view to_string(launcher l) noexcept {
  switch (l) {
    case launcher::none: return "none";
    case launcher::env: return "env";
    case launcher::open_mpi: return "open_mpi";
    case launcher::hydra: return "hydra";
    case launcher::slurm: return "slurm";
    case launcher::horovod: return "horovod";
    case launcher::tf_config: return "tf_config";
  }
  return "unknown";
}

/// What this process is in the job. Only workers hold a data-parallel rank.
enum class process_role {
  worker,            ///< a data-parallel rank
  node_agent,        ///< a per-node launcher process that starts the workers of its node
  parameter_server,  ///< TF_CONFIG task type "ps"
  evaluator,         ///< TF_CONFIG task type "evaluator"
};

[[nodiscard]] constexpr std::string_view to_string(process_role r) noexcept {
  switch (r) {
    case process_role::worker: return "worker";
    case process_role::node_agent: return "agent";
    case process_role::parameter_server: return "ps";
    case process_role::evaluator: return "evaluator";
  }
  return "unknown";
}

/// Who this process is. A field the environment does not determine is
/// nullopt — unknown, never guessed; the runtime completes the node fields at
/// rendezvous by grouping ranks by host name.
struct world {
  std::optional<int> rank;              ///< 0 .. world_size-1; unknown for agents, ps, evaluators
  std::optional<int> world_size;        ///< number of data-parallel workers in the job
  std::optional<int> local_rank;        ///< rank among the workers on this node
  std::optional<int> local_world_size;  ///< workers on this node
  std::optional<int> node_rank;         ///< index of this node, 0 .. num_nodes-1
  std::optional<int> num_nodes;         ///< nodes in the job
  std::optional<std::string> master_addr;  ///< where the rendezvous store listens
  std::optional<int> master_port;
  launcher source = launcher::none;
  process_role role = process_role::worker;

  /// The fields, in the order describe() and to_json() print them.
  enum class field : std::size_t {
    rank,
    world_size,
    local_rank,
    local_world_size,
    node_rank,
    num_nodes,
    master_addr,
    master_port,
  };
  static constexpr std::size_t field_count = 8;
  static constexpr std::array<std::string_view, field_count> field_names{
      "rank",      "world_size", "local_rank",  "local_world_size",
      "node_rank", "num_nodes",  "master_addr", "master_port"};

  /// Where each known field came from, e.g. "RANK=3" or
  /// "SLURM_STEP_TASKS_PER_NODE=2(x3),1 at SLURM_NODEID=3"; empty when unknown.
  std::array<std::string, field_count> origins{};
  /// Remarks for logs: outer launchers seen, variables deliberately not used.
  std::string notes;

  [[nodiscard]] const std::string& origin(field f) const {
    return origins[static_cast<std::size_t>(f)];
  }

  /// True when every rank and node field is known (master fields excluded:
  /// a single process needs none, and mpirun jobs agree on one through MPI).
  [[nodiscard]] bool complete() const noexcept {
    return rank && world_size && local_rank && local_world_size && node_rank && num_nodes;
  }

  /// One or two lines for logs: each field with the variable it came from.
  [[nodiscard]] std::string describe() const {
    std::string out = "dtrain world from ";
    out += to_string(source);
    if (role != process_role::worker) {
      out += " (";
      out += to_string(role);
      out += ')';
    }
    out += ':';
    std::array<std::string, field_count> values;
    const std::array<const std::optional<int>*, 6> numbers{
        &rank, &world_size, &local_rank, &local_world_size, &node_rank, &num_nodes};
    for (std::size_t i = 0; i < numbers.size(); ++i) {
      values[i] = *numbers[i] ? std::to_string(**numbers[i]) : "?";
    }
    values[6] = master_addr.value_or("?");
    values[7] = master_port ? std::to_string(*master_port) : "?";
    // Consecutive fields with one origin share one parenthesis.
    for (std::size_t i = 0; i < field_count; ++i) {
      out += i == 0 ? " " : ", ";
      out += field_names[i];
      out += '=';
      out += values[i];
      if (i + 1 == field_count || origins[i + 1] != origins[i]) {
        out += origins[i].empty() ? std::string(" (unknown)") : " (" + origins[i] + ")";
      }
    }
    if (!notes.empty()) {
      out += "\n  note: ";
      out += notes;
    }
    return out;
  }
};

namespace detail {

/// Appends `text` as a JSON string literal.
inline void append_json_string(std::string& out, std::string_view text) {
  static constexpr char hex[] = "0123456789abcdef";
  out += '"';
  for (char c : text) {
    auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20) {
      out += "\\u00";
      out += hex[u >> 4];
      out += hex[u & 0xF];
    } else {
      out += c;
    }
  }
  out += '"';
}

}  // namespace detail

/// The world as one JSON object on one line (no newline), with the keys rank,
/// world_size, local_rank, local_world_size, node_rank, num_nodes,
/// master_addr, master_port (null when unknown), source, and role when the
/// process is not a plain worker. This is what `dtrain_whoami` prints.
[[nodiscard]] inline std::string to_json(const world& w) {
  std::string out = "{";
  auto key = [&](std::string_view name) {
    if (out.size() > 1) out += ',';
    detail::append_json_string(out, name);
    out += ':';
  };
  auto number = [&](std::string_view name, const std::optional<int>& v) {
    key(name);
    out += v ? std::to_string(*v) : "null";
  };
  number("rank", w.rank);
  number("world_size", w.world_size);
  number("local_rank", w.local_rank);
  number("local_world_size", w.local_world_size);
  number("node_rank", w.node_rank);
  number("num_nodes", w.num_nodes);
  key("master_addr");
  if (w.master_addr) {
    detail::append_json_string(out, *w.master_addr);
  } else {
    out += "null";
  }
  number("master_port", w.master_port);
  key("source");
  detail::append_json_string(out, to_string(w.source));
  if (w.role != process_role::worker) {
    key("role");
    detail::append_json_string(out, to_string(w.role));
  }
  out += '}';
  return out;
}

}  // namespace dtrain
// ---- end dtrain/env/world.hpp ----

#include <array>
#include <cstddef>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain {

/// Port used when a launcher names a master host but no port, and
/// MASTER_PORT is unset (torchrun's default). Under Slurm the default is
/// slurm_default_port(SLURM_JOB_ID) instead, so two jobs sharing a node differ.
inline constexpr int default_master_port = 29500;

/// 20000 + job id mod 10000: a port that two Slurm jobs on one node are unlikely to share.
[[nodiscard]] constexpr int slurm_default_port(long long job_id) noexcept {
  return 20000 + static_cast<int>(job_id % 10000);
}

namespace detail {

using field = world::field;
constexpr std::size_t count_fields = 6;  // rank .. num_nodes

/// What one launcher (or one loose variable) says about this process.
struct observation {
  launcher source = launcher::none;
  std::array<std::optional<sourced_int>, count_fields> counts{};
  // A master derived from a host list (TF_CONFIG, Slurm): used only when no
  // variable names the master explicitly.
  std::optional<sourced_text> fallback_addr;
  std::optional<sourced_int> fallback_port;
  process_role role = process_role::worker;
  std::string note;

  std::optional<sourced_int>& operator[](field f) { return counts[static_cast<std::size_t>(f)]; }
  const std::optional<sourced_int>& operator[](field f) const {
    return counts[static_cast<std::size_t>(f)];
  }
  /// A launcher, as opposed to loose variables like LOCAL_RANK alone: it says how many processes
  /// there are.
  [[nodiscard]] bool is_launcher() const { return (*this)[field::world_size].has_value(); }
};

/// Reads NAME_RANK/NAME_SIZE-style pairs: both or neither.
inline void read_rank_and_size(const environment& env, observation& o, std::string_view rank_var,
                               std::string_view size_var) {
  o[field::rank] = read_int(env, rank_var);
  o[field::world_size] = read_int(env, size_var);
  if (o[field::rank].has_value() != o[field::world_size].has_value()) {
    const auto& set = o[field::rank] ? o[field::rank] : o[field::world_size];
    throw config_error(set->origin + " is set but " +
                       std::string(o[field::rank] ? size_var : rank_var) +
                       " is not; the launcher sets both");
  }
}

/// Stores `v` in `slot`, or checks that it agrees with what is there.
inline void agree(std::optional<sourced_int>& slot, const std::optional<sourced_int>& v,
                  std::string_view what) {
  if (!v) return;
  if (!slot) {
    slot = v;
  } else if (slot->value != v->value) {
    throw config_error(slot->origin + " and " + v->origin + " disagree about " + std::string(what));
  }
}

/// env:// — torchrun, dtrun, Azure ML PyTorch jobs, Kubeflow PyTorchJob. Also
/// loose LOCAL_RANK / NODE_RANK, which other launchers' users often export.
inline observation read_env_url(const environment& env) {
  observation o;
  o.source = launcher::env;
  read_rank_and_size(env, o, "RANK", "WORLD_SIZE");
  o[field::local_rank] = read_int(env, "LOCAL_RANK");
  o[field::local_world_size] = read_int(env, "LOCAL_WORLD_SIZE");
  o[field::node_rank] = read_int(env, "GROUP_RANK");  // torchrun's name for the node index
  agree(o[field::node_rank], read_int(env, "NODE_RANK"), "the node rank");
  o[field::num_nodes] = read_int(env, "GROUP_WORLD_SIZE");
  const auto& ws = o[field::world_size];
  const auto& nodes = o[field::num_nodes];
  const auto& local = o[field::local_world_size];
  // torchrun starts the same number of workers on every node.
  if (ws && nodes && nodes->value > 0 && ws->value % nodes->value != 0) {
    throw config_error(ws->origin + " is not divisible into " + nodes->origin +
                       " nodes with the same number of workers each");
  }
  if (ws && nodes && local && ws->value != nodes->value * local->value) {
    throw config_error(ws->origin + " is not " + local->origin + " workers per node times " +
                       nodes->origin + " nodes");
  }
  return o;
}

/// Hugging Face style `--local_rank=N`, `--local_rank N`, `--local-rank=N`,
/// `--local-rank N` (the old torch.distributed.launch without --use_env).
/// `args` excludes the program name; scanning stops at `--`.
inline std::optional<sourced_int> read_argv_local_rank(std::span<const std::string_view> args) {
  std::optional<sourced_int> found;
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string_view a = args[i];
    if (a == "--") break;
    for (std::string_view flag :
         {std::string_view("--local_rank"), std::string_view("--local-rank")}) {
      std::optional<std::string_view> text;
      std::string origin;
      if (a == flag) {
        if (i + 1 >= args.size()) throw config_error("argv " + std::string(flag) + " has no value");
        text = args[i + 1];
        origin = "argv " + std::string(flag) + " " + std::string(*text);
      } else if (a.size() > flag.size() && a.substr(0, flag.size()) == flag &&
                 a[flag.size()] == '=') {
        text = a.substr(flag.size() + 1);
        origin = "argv " + std::string(a);
      }
      if (!text) continue;
      agree(found, sourced_int{parse_non_negative(origin, *text), origin}, "the local rank");
    }
  }
  return found;
}

/// The variables of a launcher that states rank, size, local rank and local size.
struct rank_variables {
  std::string_view rank, size, local_rank, local_size;
};

/// Reads a launcher that states rank, size, local rank and local size.
inline observation read_ranks(const environment& env, launcher source,
                              const rank_variables& names) {
  observation o;
  o.source = source;
  read_rank_and_size(env, o, names.rank, names.size);
  o[field::local_rank] = read_int(env, names.local_rank);
  o[field::local_world_size] = read_int(env, names.local_size);
  return o;
}

/// Open MPI's mpirun. OMPI_COMM_WORLD_NODE_RANK is deliberately not read: it
/// is the rank among this node's processes (like the local rank), not the
/// node's index, and Open MPI gives no node index at all.
inline observation read_open_mpi(const environment& env) {
  return read_ranks(env, launcher::open_mpi,
                    {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                     "OMPI_COMM_WORLD_LOCAL_SIZE"});
}

/// MPICH / Intel MPI (Hydra). No node index or node count.
inline observation read_hydra(const environment& env) {
  return read_ranks(env, launcher::hydra,
                    {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"});
}

/// The first of `names` that is set, with its name.
inline std::optional<std::pair<std::string_view, std::string_view>> first_set(
    const environment& env, std::initializer_list<std::string_view> names) {
  for (auto name : names) {
    if (auto v = env.get(name)) return std::pair{name, *v};
  }
  return std::nullopt;
}

/// srun. Only inside a job step (SLURM_STEP_ID set): a batch script carries
/// the allocation's SLURM_NTASKS too, but it is one process, and believing
/// otherwise would wait forever for ranks that never start. Step-level
/// variables win over job-level ones, which describe the whole allocation.
inline observation read_slurm(const environment& env) {
  observation o;
  o.source = launcher::slurm;
  if (!env.contains("SLURM_PROCID")) return o;
  if (!env.contains("SLURM_STEP_ID") && !env.contains("SLURM_STEPID")) {
    o.source = launcher::none;
    o.note =
        "SLURM_PROCID is set without SLURM_STEP_ID: a Slurm batch script, not an srun task; "
        "its allocation was not taken as this process's world";
    return o;
  }
  o[field::rank] = read_int(env, "SLURM_PROCID");
  auto ntasks_var = first_set(env, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"});
  if (!ntasks_var) {
    throw config_error(o[field::rank]->origin +
                       " is set but none of SLURM_STEP_NUM_TASKS, SLURM_NTASKS, SLURM_NPROCS is");
  }
  o[field::world_size] = read_int(env, ntasks_var->first);
  o[field::local_rank] = read_int(env, "SLURM_LOCALID");
  o[field::node_rank] = read_int(env, "SLURM_NODEID");
  if (auto nn = first_set(env, {"SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"})) {
    o[field::num_nodes] = read_int(env, nn->first);
  }
  if (auto tpn = first_set(env, {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"})) {
    auto what = assignment(tpn->first, tpn->second);
    auto counts = parse_tasks_per_node(tpn->second, what);
    long long total = 0;
    for (int c : counts) total += c;
    const auto& ws = o[field::world_size];
    if (total != ws->value) {
      throw config_error(what + " adds up to " + std::to_string(total) + " tasks, not " +
                         ws->origin);
    }
    if (const auto& nn = o[field::num_nodes];
        nn && counts.size() != static_cast<std::size_t>(nn->value)) {
      throw config_error(what + " lists " + std::to_string(counts.size()) + " nodes, not " +
                         nn->origin);
    }
    if (const auto& node = o[field::node_rank]) {
      if (static_cast<std::size_t>(node->value) >= counts.size()) {
        throw config_error(node->origin + " is not below the " + std::to_string(counts.size()) +
                           " nodes of " + what);
      }
      o[field::local_world_size] =
          sourced_int{counts[static_cast<std::size_t>(node->value)], what + " at " + node->origin};
    }
  }
  if (auto list = first_set(env, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"})) {
    auto what = assignment(list->first, list->second);
    auto hosts = hostlist::parse(list->second, what);
    if (const auto& nn = o[field::num_nodes]; nn && list->first == "SLURM_STEP_NODELIST" &&
                                              hosts.size() != static_cast<std::size_t>(nn->value)) {
      throw config_error(what + " names " + std::to_string(hosts.size()) + " hosts, not " +
                         nn->origin);
    }
    o.fallback_addr = sourced_text{hosts.front(), "first host of " + what};
    if (auto job = read_int(env, "SLURM_JOB_ID")) {
      o.fallback_port = sourced_int{slurm_default_port(job->value), "default for " + job->origin};
    } else {
      o.fallback_port = sourced_int{default_master_port, "default"};
    }
  }
  return o;
}

/// horovodrun. HOROVOD_CROSS_RANK is the rank among the processes that share
/// this local rank; it is the node index only for local rank 0, or when
/// every node runs the same number of processes (SIZE = LOCAL_SIZE × CROSS_SIZE).
inline observation read_horovod(const environment& env) {
  observation o =
      read_ranks(env, launcher::horovod,
                 {"HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"});
  auto cross_rank = read_int(env, "HOROVOD_CROSS_RANK");
  auto cross_size = read_int(env, "HOROVOD_CROSS_SIZE");
  const auto& ws = o[field::world_size];
  const auto& lr = o[field::local_rank];
  const auto& ls = o[field::local_world_size];
  bool homogeneous = ws && ls && cross_size && ws->value == ls->value * cross_size->value;
  if ((lr && lr->value == 0) || homogeneous) {
    o[field::node_rank] = cross_rank;
    o[field::num_nodes] = cross_size;
  } else if (cross_rank || cross_size) {
    o.note =
        "HOROVOD_CROSS_RANK/CROSS_SIZE not used as node fields: nodes run different numbers "
        "of processes and this is not local rank 0";
  }
  return o;
}

/// The member `key` of `obj` when it has the expected kind; nullptr when absent.
inline const json::value* json_member(const json::value& obj, std::string_view key,
                                      json::value::kind kind, const std::string& where) {
  const json::value* v = obj.find(key);
  if (v && !v->is(kind)) {
    throw config_error("TF_CONFIG " + where + "\"" + std::string(key) + "\" is " +
                       json::kind_name(v->type) + ", expected " + json::kind_name(kind));
  }
  return v;
}

/// TF_CONFIG: {"cluster": {"chief": [...], "worker": [...], "ps": [...],
/// "evaluator": [...]}, "task": {"type": ..., "index": ...}}. Data-parallel
/// ranks are the chief (TF1's "master" too) then the workers; ps and
/// evaluator tasks get their role and no rank.
inline observation read_tf_config(const environment& env) {
  observation o;
  auto text = env.get("TF_CONFIG");
  if (!text) return o;
  o.source = launcher::tf_config;
  auto doc = json::parse(*text, "TF_CONFIG");
  if (!doc.is(json::value::kind::object)) throw config_error("TF_CONFIG is not a JSON object");
  const auto* cluster = json_member(doc, "cluster", json::value::kind::object, "");
  const auto* task = json_member(doc, "task", json::value::kind::object, "");
  if (!cluster) throw config_error("TF_CONFIG has no \"cluster\" object");
  if (!task) throw config_error("TF_CONFIG has no \"task\" object");

  auto hosts = [&](std::string_view key) -> std::vector<std::string> {
    std::vector<std::string> out;
    if (const auto* list = json_member(*cluster, key, json::value::kind::array, "cluster.")) {
      for (const auto& item : list->items) {
        if (!item.is(json::value::kind::string) || item.text.empty()) {
          throw config_error("TF_CONFIG cluster.\"" + std::string(key) +
                             "\" must list \"host:port\" strings");
        }
        out.push_back(item.text);
      }
    }
    return out;
  };
  auto chief = hosts("chief");
  auto master = hosts("master");  // TF1 Estimator's name for the chief
  if (!chief.empty() && !master.empty()) {
    throw config_error("TF_CONFIG lists both cluster.\"chief\" and cluster.\"master\"");
  }
  if (chief.empty()) chief = master;
  if (chief.size() > 1)
    throw config_error("TF_CONFIG lists " + std::to_string(chief.size()) +
                       " chiefs; at most one is allowed");
  auto workers = hosts("worker");
  auto ps = hosts("ps");
  auto evaluators = hosts("evaluator");

  const auto* type = json_member(*task, "type", json::value::kind::string, "task.");
  const auto* index = json_member(*task, "index", json::value::kind::number, "task.");
  if (!type) throw config_error("TF_CONFIG task has no \"type\"");
  std::string_view kind = type->text;
  int idx = 0;
  if (index) {
    idx = parse_non_negative("TF_CONFIG task.index=" + index->text, index->text);
  } else if (kind != "chief" && kind != "master" && kind != "evaluator") {
    throw config_error("TF_CONFIG task of type \"" + type->text + "\" has no \"index\"");
  }
  const std::string task_text =
      "TF_CONFIG task {type: " + type->text + ", index: " + std::to_string(idx) + "}";
  const int world_size = static_cast<int>(chief.size() + workers.size());
  if (world_size == 0) throw config_error("TF_CONFIG cluster has no \"chief\" and no \"worker\"");
  o[field::world_size] =
      sourced_int{world_size, "TF_CONFIG chief + worker count " + std::to_string(world_size)};

  auto check_index = [&](const std::vector<std::string>& list, std::string_view list_name) {
    if (static_cast<std::size_t>(idx) >= list.size()) {
      throw config_error(task_text + " is not below the " + std::to_string(list.size()) +
                         " entries of cluster.\"" + std::string(list_name) + "\"");
    }
  };
  if (kind == "chief" || kind == "master") {
    check_index(chief, kind);
    o[field::rank] = sourced_int{0, task_text};
  } else if (kind == "worker") {
    check_index(workers, "worker");
    o[field::rank] = sourced_int{static_cast<int>(chief.size()) + idx, task_text};
  } else if (kind == "ps") {
    check_index(ps, "ps");
    o.role = process_role::parameter_server;
  } else if (kind == "evaluator") {
    if (!evaluators.empty()) check_index(evaluators, "evaluator");
    o.role = process_role::evaluator;
  } else {
    throw config_error(task_text +
                       " has an unknown type (expected chief, master, worker, ps or evaluator)");
  }
  const std::string& first = chief.empty() ? workers.front() : chief.front();
  const std::string what =
      "TF_CONFIG " + std::string(chief.empty() ? "worker[0]" : "chief[0]") + "=" + first;
  auto hp = split_host_port(what, first);
  o.fallback_addr = sourced_text{hp.host, what};
  if (hp.port) o.fallback_port = sourced_int{*hp.port, what};
  return o;
}

/// The master named outright: MASTER_ADDR / MASTER_PORT, Azure's
/// AZ_BATCH_MASTER_NODE (addr:port, multi-node) and AZ_BATCHAI_MPI_MASTER_NODE
/// (addr, single node). Every source that is set must agree.
struct explicit_master {
  std::optional<sourced_text> addr;
  std::optional<sourced_int> port;
};

inline explicit_master read_explicit_master(const environment& env) {
  explicit_master m;
  auto take_addr = [&](std::optional<sourced_text> v) {
    if (!v) return;
    if (!m.addr) {
      m.addr = std::move(v);
    } else if (m.addr->value != v->value) {
      throw config_error(m.addr->origin + " and " + v->origin +
                         " disagree about the master address");
    }
  };
  take_addr(read_text(env, "MASTER_ADDR"));
  m.port = read_port(env, "MASTER_PORT");
  if (auto batch = read_text(env, "AZ_BATCH_MASTER_NODE")) {
    auto hp = split_host_port(batch->origin, batch->value);
    if (!hp.port) throw config_error(batch->origin + " has no port; expected addr:port");
    take_addr(sourced_text{hp.host, batch->origin});
    agree(m.port, sourced_int{*hp.port, batch->origin}, "the master port");
  }
  take_addr(read_text(env, "AZ_BATCHAI_MPI_MASTER_NODE"));
  return m;
}

}  // namespace detail
}  // namespace dtrain
// ---- end dtrain/env/launchers.hpp ----

#include <array>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain {

/// Whether the process being described is a worker started by the outside
/// launcher, or a per-node agent that starts the workers of its node.
enum class launch_mode { per_process, per_node };

/// What the caller knows beyond the environment. Values given here are
/// checked against the environment like any other source.
struct discover_options {
  launch_mode mode = launch_mode::per_process;
  std::optional<int> nproc_per_node{};  ///< per_node: workers this agent starts
  std::optional<int> nnodes{};          ///< per_node: number of nodes (agents)
  std::optional<int> node_rank{};       ///< per_node: this agent's node
};

namespace detail {

inline constexpr std::array<std::string_view, count_fields> field_phrases{
    "the rank",      "the world size",     "the local rank", "the local world size",
    "the node rank", "the number of nodes"};

inline void agree(observation& into, field f, const std::optional<sourced_int>& v) {
  agree(into[f], v, field_phrases[static_cast<std::size_t>(f)]);
}

/// Every launcher present, innermost first. env:// comes first because it is
/// what an agent (torchrun, dtrun) sets for its workers, or what a user's
/// script copied from the outer launcher; Slurm comes last because mpirun and
/// mpiexec start their daemons through srun inside an allocation.
inline std::vector<observation> read_launchers(const environment& env, const observation& env_url,
                                               std::string& notes) {
  std::vector<observation> found;
  auto keep = [&](observation o) {
    if (!o.note.empty()) notes += (notes.empty() ? "" : "; ") + o.note;
    if (o.is_launcher()) found.push_back(std::move(o));
  };
  keep(env_url);
  keep(read_tf_config(env));
  keep(read_horovod(env));
  keep(read_open_mpi(env));
  keep(read_hydra(env));
  keep(read_slurm(env));
  return found;
}

/// Reconciles the launchers: the first is this process's own; another with
/// the same process count must agree field by field; one with a different
/// count is accepted only as an outer launcher that ran one process per node
/// (torchrun under srun, a node agent under mpirun), and is then not used.
inline observation reconcile(std::vector<observation> launchers, std::string& notes) {
  observation primary = std::move(launchers.front());
  for (std::size_t i = 1; i < launchers.size(); ++i) {
    const observation& other = launchers[i];
    if (other[field::world_size]->value == primary[field::world_size]->value) {
      for (std::size_t f = 0; f < count_fields; ++f) agree(primary, field(f), other.counts[f]);
      if (!primary.fallback_addr) {
        primary.fallback_addr = other.fallback_addr;
        primary.fallback_port = other.fallback_port;
      }
      continue;
    }
    const auto& local = other[field::local_world_size];
    if (local && local->value == 1) {
      notes += std::string(notes.empty() ? "" : "; ") + "outer launcher " +
               std::string(to_string(other.source)) + " ran one process per node (" +
               other[field::world_size]->origin +
               "); its variables describe that process, not this one";
      continue;
    }
    throw config_error(
        primary[field::world_size]->origin + " (" + std::string(to_string(primary.source)) +
        ") and " + other[field::world_size]->origin + " (" + std::string(to_string(other.source)) +
        ") disagree about the world size; an outer launcher is accepted only with the "
        "same process count or with one process per node");
  }
  return primary;
}

inline void fill_master(world& w, const environment& env, const observation& primary) {
  auto m = read_explicit_master(env);
  auto addr = m.addr ? m.addr : primary.fallback_addr;
  auto port = m.port ? m.port : primary.fallback_port;
  if (addr) {
    w.master_addr = addr->value;
    w.origins[static_cast<std::size_t>(field::master_addr)] = addr->origin;
  }
  if (port) {
    w.master_port = port->value;
    w.origins[static_cast<std::size_t>(field::master_port)] = port->origin;
  }
}

inline std::string not_below(const sourced_int& lower, const sourced_int& upper) {
  return lower.origin + " is not below " + upper.origin;
}

/// Derives what follows for certain and checks what must hold.
inline void complete_and_check(observation& o) {
  const auto& ws = o[field::world_size];
  const auto& ls = o[field::local_world_size];
  // Every process is on this node: one node, and the local rank is the rank.
  if (ws && ls && ws->value == ls->value) {
    std::string why = "all " + ws->origin + " processes are local: " + ls->origin;
    agree(o, field::node_rank, sourced_int{0, why});
    agree(o, field::num_nodes, sourced_int{1, why});
    agree(o, field::local_rank, o[field::rank]);
  }
  for (field size : {field::world_size, field::local_world_size, field::num_nodes}) {
    if (const auto& s = o[size]; s && s->value < 1)
      throw config_error(s->origin + " must be at least 1");
  }
  auto check_below = [&](field lower, field upper) {
    if (o[lower] && o[upper] && o[lower]->value >= o[upper]->value) {
      throw config_error(not_below(*o[lower], *o[upper]));
    }
  };
  check_below(field::rank, field::world_size);
  check_below(field::local_rank, field::local_world_size);
  check_below(field::node_rank, field::num_nodes);
  if (ls && ws && ls->value > ws->value) {
    throw config_error(ls->origin + " is larger than " + ws->origin);
  }
  if (const auto& nn = o[field::num_nodes]; nn && ws && nn->value > ws->value) {
    throw config_error(nn->origin + " is larger than " + ws->origin);
  }
  if (const auto& nn = o[field::num_nodes];
      nn && nn->value == 1 && ls && ws && ls->value != ws->value) {
    throw config_error(nn->origin + " says one node, but " + ls->origin + " differs from " +
                       ws->origin);
  }
}

inline world to_world(const observation& o) {
  world w;
  w.source = o.source;
  w.role = o.role;
  std::array<std::optional<int>*, count_fields> slots{
      &w.rank, &w.world_size, &w.local_rank, &w.local_world_size, &w.node_rank, &w.num_nodes};
  for (std::size_t f = 0; f < count_fields; ++f) {
    if (o.counts[f]) {
      *slots[f] = o.counts[f]->value;
      w.origins[f] = o.counts[f]->origin;
    }
  }
  return w;
}

inline world discover_per_process(const environment& env, std::span<const std::string_view> args,
                                  std::string& notes) {
  observation loose = read_env_url(env);
  std::vector<observation> launchers = read_launchers(env, loose, notes);

  observation o;
  if (launchers.empty()) {
    if (loose[field::node_rank] && loose[field::node_rank]->value != 0) {
      throw config_error(
          loose[field::node_rank]->origin +
          " is set, but nothing gives this process's rank and world size (RANK and "
          "WORLD_SIZE, OMPI_COMM_WORLD_*, PMI_*, SLURM_* under srun, HOROVOD_*, "
          "TF_CONFIG). A Lightning-style per-node job needs launch::per_node (dtrun), "
          "which starts the workers of the node");
    }
    const std::string single = "a single process: no launcher variables";
    for (std::size_t f = 0; f < count_fields; ++f) {
      bool is_size = field(f) == field::world_size || field(f) == field::local_world_size ||
                     field(f) == field::num_nodes;
      o.counts[f] = sourced_int{is_size ? 1 : 0, single};
    }
  } else {
    o = reconcile(std::move(launchers), notes);
  }
  // Loose variables (LOCAL_RANK, NODE_RANK, ... without RANK) must agree with the launcher.
  if (!loose.is_launcher()) {
    for (std::size_t f = 0; f < count_fields; ++f) agree(o, field(f), loose.counts[f]);
  }
  agree(o, field::local_rank, read_argv_local_rank(args));
  complete_and_check(o);
  world w = to_world(o);
  fill_master(w, env, o);
  return w;
}

inline world discover_per_node(const environment& env, std::span<const std::string_view> args,
                               const discover_options& opt, std::string& notes) {
  if (auto local = read_argv_local_rank(args)) {
    throw config_error(local->origin +
                       " is a worker's argument; a per-node agent assigns local ranks itself");
  }
  observation loose = read_env_url(env);
  std::vector<observation> launchers = read_launchers(env, loose, notes);

  // The agents' own launcher ran one agent per node: its ranks are node ranks.
  observation node;
  node.role = process_role::node_agent;
  if (!launchers.empty()) {
    observation agents = reconcile(std::move(launchers), notes);
    if (const auto& local = agents[field::local_world_size]; local && local->value != 1) {
      throw config_error("per-node launch runs one agent per node, but " + local->origin);
    }
    if (const auto& lr = agents[field::local_rank]; lr && lr->value != 0) {
      throw config_error("per-node launch runs one agent per node, but " + lr->origin);
    }
    node.source = agents.source;
    node.fallback_addr = agents.fallback_addr;
    node.fallback_port = agents.fallback_port;
    agree(node, field::node_rank, agents[field::rank]);
    agree(node, field::node_rank, agents[field::node_rank]);
    agree(node, field::num_nodes, agents[field::world_size]);
    agree(node, field::num_nodes, agents[field::num_nodes]);
  }
  if (!loose.is_launcher()) {
    if (loose[field::local_rank]) {
      throw config_error(loose[field::local_rank]->origin +
                         " is a worker's variable; a per-node agent assigns local ranks itself");
    }
    agree(node, field::node_rank, loose[field::node_rank]);
    agree(node, field::num_nodes, loose[field::num_nodes]);
    if (node.source == launcher::none && (loose[field::node_rank] || loose[field::num_nodes])) {
      node.source = launcher::env;
    }
  }
  auto option = [](std::string_view name,
                   const std::optional<int>& v) -> std::optional<sourced_int> {
    if (!v) return std::nullopt;
    std::string origin = "option " + std::string(name) + "=" + std::to_string(*v);
    if (*v < 0) throw config_error(origin + " is negative");
    return sourced_int{*v, origin};
  };
  agree(node, field::node_rank, option("node_rank", opt.node_rank));
  agree(node, field::num_nodes, option("nnodes", opt.nnodes));
  agree(node, field::local_world_size, option("nproc_per_node", opt.nproc_per_node));
  if (!node[field::node_rank] && !node[field::num_nodes] && node.source == launcher::none) {
    const std::string single = "a single node: no launcher variables";
    node[field::node_rank] = sourced_int{0, single};
    node[field::num_nodes] = sourced_int{1, single};
  }
  if (node[field::local_world_size] && node[field::num_nodes]) {
    const auto& per = *node[field::local_world_size];
    const auto& nn = *node[field::num_nodes];
    node[field::world_size] = sourced_int{per.value * nn.value, per.origin + " × " + nn.origin};
  }
  complete_and_check(node);
  world w = to_world(node);
  fill_master(w, env, node);
  return w;
}

}  // namespace detail

/// Who this process is, from `env` and `args` (argv without the program
/// name). Throws config_error naming every variable involved, with its value,
/// when a value is malformed or two sources disagree. Never blocks.
[[nodiscard]] inline world discover_world(const environment& env,
                                          std::span<const std::string_view> args = {},
                                          const discover_options& options = {}) {
  std::string notes;
  world w = options.mode == launch_mode::per_node
                ? detail::discover_per_node(env, args, options, notes)
                : detail::discover_per_process(env, args, notes);
  w.notes = std::move(notes);
  return w;
}

/// Same, from the process's own environment and main()'s argc/argv.
[[nodiscard]] inline world discover_world(int argc, const char* const* argv,
                                          const discover_options& options = {}) {
  std::vector<std::string_view> args;
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  return discover_world(environment::from_process(), args, options);
}

}  // namespace dtrain
// ---- end dtrain/env/discover.hpp ----
// ---- end dtrain/dtrain.hpp ----

#endif  // DTRAIN_SINGLE_INCLUDE_DTRAIN_HPP
