#pragma once
/// @file
/// The non-template bodies of dtrain/detail/json.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/detail/json.hpp, not this file.

#include <dtrain/detail/json.hpp>

namespace dtrain::detail::json {

DTRAIN_DETAIL_INLINE const value* value::find(std::string_view key) const {
  for (const auto& m : members) {
    if (m.key == key) return &m.val;
  }
  return nullptr;
}

DTRAIN_DETAIL_INLINE const char* kind_name(value::kind k) {
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
}  // namespace dtrain::detail::json

namespace dtrain::detail::json {
namespace impl {

DTRAIN_DETAIL_INLINE value reader::document() {
  skip_blanks();
  value v = parse_value(0);
  skip_blanks();
  if (pos_ != text_.size()) fail("unexpected text after the JSON value");
  return v;
}

DTRAIN_DETAIL_INLINE void reader::fail(const std::string& why) const {
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

DTRAIN_DETAIL_INLINE void reader::skip_blanks() {
  while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' ||
                                 text_[pos_] == '\r')) {
    ++pos_;
  }
}

DTRAIN_DETAIL_INLINE void reader::expect_word(std::string_view word) {
  if (text_.substr(pos_, word.size()) != word) fail("expected '" + std::string(word) + "'");
  pos_ += word.size();
}

DTRAIN_DETAIL_INLINE value reader::parse_value(int depth) {
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

DTRAIN_DETAIL_INLINE void reader::parse_object(value& v, int depth) {
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

DTRAIN_DETAIL_INLINE void reader::parse_array(value& v, int depth) {
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

DTRAIN_DETAIL_INLINE std::string reader::parse_number() {
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

DTRAIN_DETAIL_INLINE unsigned reader::read_hex4() {
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

DTRAIN_DETAIL_INLINE void reader::append_utf8(std::string& out, std::uint32_t cp) {
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

DTRAIN_DETAIL_INLINE std::string reader::parse_string() {
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
}  // namespace impl
}  // namespace dtrain::detail::json

namespace dtrain::detail::json {

DTRAIN_DETAIL_INLINE void write_string(std::string& out, std::string_view text) {
  out += '"';
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          constexpr char hex[] = "0123456789abcdef";
          out += "\\u00";
          out += hex[(c >> 4) & 0xF];
          out += hex[c & 0xF];
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

}  // namespace dtrain::detail::json
