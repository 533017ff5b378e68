#pragma once
/// @file
/// The non-template bodies of dtrain/detail/wire.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/detail/wire.hpp, not this file.

#include <dtrain/detail/wire.hpp>

namespace dtrain::detail::wire {

DTRAIN_DETAIL_INLINE writer& writer::u8(std::uint8_t v) {
  out_ += static_cast<char>(v);
  return *this;
}

DTRAIN_DETAIL_INLINE writer& writer::bytes16(std::string_view s) {
  u16(static_cast<std::uint16_t>(s.size()));
  out_.append(s);
  return *this;
}

DTRAIN_DETAIL_INLINE writer& writer::bytes32(std::string_view s) {
  u32(static_cast<std::uint32_t>(s.size()));
  out_.append(s);
  return *this;
}

DTRAIN_DETAIL_INLINE writer& writer::le(std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xff);
  return *this;
}

DTRAIN_DETAIL_INLINE void reader::finish(const char* what) const {
  if (pos_ != in_.size()) {
    throw violation(std::string(what) + " has " + std::to_string(in_.size() - pos_) +
                    " unexpected trailing bytes");
  }
}

DTRAIN_DETAIL_INLINE std::string_view reader::sized(std::uint32_t n, const char* what,
                                                    std::uint32_t limit) {
  if (n > limit) {
    throw violation(std::string(what) + " of " + std::to_string(n) +
                    " bytes exceeds the limit of " + std::to_string(limit));
  }
  return take(n, what);
}

DTRAIN_DETAIL_INLINE std::string_view reader::take(std::size_t n, const char* what) {
  if (in_.size() - pos_ < n) throw violation(std::string(what) + " is truncated");
  auto out = in_.substr(pos_, n);
  pos_ += n;
  return out;
}

DTRAIN_DETAIL_INLINE std::uint64_t reader::le(int n, const char* what) {
  auto bytes = take(static_cast<std::size_t>(n), what);
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i)
    v = (v << 8) | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
  return v;
}

DTRAIN_DETAIL_INLINE std::string encode_int(std::int64_t v) {
  std::string out;
  writer(out).i64(v);
  return out;
}

DTRAIN_DETAIL_INLINE std::string encode_text(std::string_view text) {
  std::string out;
  writer(out).bytes32(text);
  return out;
}

DTRAIN_DETAIL_INLINE std::string decode_text(std::string_view where, std::string_view value,
                                             std::string_view what) {
  return decode_value(where, value, what,
                      [](reader& r) { return std::string(r.bytes32("the text")); });
}

DTRAIN_DETAIL_INLINE std::string outcome::encode() const {
  std::string out;
  writer(out).u8(ok ? 1 : 0).bytes32(text);
  return out;
}

DTRAIN_DETAIL_INLINE outcome outcome::decode(std::string_view where, std::string_view value,
                                             std::string_view what) {
  return decode_value(where, value, what, [](reader& r) {
    outcome o;
    const std::uint8_t flag = r.u8("the ok flag");
    if (flag > 1) throw violation("the ok flag is " + std::to_string(flag) + ", not 0 or 1");
    o.ok = flag == 1;
    o.text = std::string(r.bytes32(o.ok ? "the value" : "the producer's error"));
    return o;
  });
}

}  // namespace dtrain::detail::wire
