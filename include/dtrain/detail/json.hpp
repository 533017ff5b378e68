#pragma once
/// @file
/// A small strict JSON reader (RFC 8259) for TF_CONFIG, and a string writer
/// for the files dtrain writes. A whole JSON library as a dependency of a
/// single-header library, for one variable, is not worth it.
/// Errors are config_errors that quote the input's name and the position.

#include <dtrain/config.hpp>
#include <dtrain/error.hpp>

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

/// The name of a kind, for messages ("expected an array, found a string").
DTRAIN_DETAIL_INLINE const char* kind_name(value::kind k);

namespace impl {

class reader {
 public:
  reader(std::string_view text, std::string_view what) : text_(text), what_(what) {}

  value document();

 private:
  static constexpr int max_depth = 64;

  [[noreturn]] void fail(const std::string& why) const;

  void skip_blanks();

  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return text_[pos_]; }

  void expect_word(std::string_view word);

  value parse_value(int depth);

  void parse_object(value& v, int depth);

  void parse_array(value& v, int depth);

  std::string parse_number();

  unsigned read_hex4();

  static void append_utf8(std::string& out, std::uint32_t cp);

  std::string parse_string();

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

/// Appends `text` to `out` as a JSON string, quoted and escaped (for the
/// files dtrain writes, such as the DDP timeline).
DTRAIN_DETAIL_INLINE void write_string(std::string& out, std::string_view text);

}  // namespace dtrain::detail::json

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/detail/json-inl.hpp>
#endif
