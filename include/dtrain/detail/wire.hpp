#pragma once
/// @file
/// The one binary format of everything dtrain sends between processes: the
/// store's protocol (rendezvous/protocol.hpp) and every value dtrain keeps in
/// the store or broadcasts (launch/protocol.hpp, env/placement.hpp, the rings
/// of diagnostics/desync.hpp). Little-endian integers; bytes16 / bytes32 are a
/// u16 / u32 length followed by that many bytes. Every read is bounds checked.

#include <dtrain/config.hpp>
#include <dtrain/error.hpp>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace dtrain::detail::wire {

/// A request or reply that breaks the protocol; the connection is closed.
struct violation : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Appends little-endian fields to a buffer.
class writer {
 public:
  explicit writer(std::string& out) : out_(out) {}
  writer& u8(std::uint8_t v);
  writer& u16(std::uint16_t v) { return le(v, 2); }
  writer& u32(std::uint32_t v) { return le(v, 4); }
  writer& u64(std::uint64_t v) { return le(v, 8); }
  writer& i64(std::int64_t v) { return le(static_cast<std::uint64_t>(v), 8); }
  writer& bytes16(std::string_view s);
  writer& bytes32(std::string_view s);

 private:
  writer& le(std::uint64_t v, int n);
  std::string& out_;
};

#if DTRAIN_DETAIL_BODIES()
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
#endif  // DTRAIN_DETAIL_BODIES()

/// Reads little-endian fields from a received body; every read is bounds
/// checked and throws `violation` naming what was cut short.
class reader {
 public:
  explicit reader(std::string_view in) : in_(in) {}
  std::uint8_t u8(const char* what) { return static_cast<std::uint8_t>(le(1, what)); }
  std::uint16_t u16(const char* what) { return static_cast<std::uint16_t>(le(2, what)); }
  std::uint32_t u32(const char* what) { return static_cast<std::uint32_t>(le(4, what)); }
  std::uint64_t u64(const char* what) { return le(8, what); }
  std::int64_t i64(const char* what) { return static_cast<std::int64_t>(le(8, what)); }
  std::string_view bytes32(const char* what, std::uint32_t limit) {
    return sized(u32(what), what, limit);
  }
  std::string_view bytes16(const char* what, std::uint32_t limit) {
    return sized(u16(what), what, limit);
  }
  /// A bytes32 field bounded only by what is left of the input.
  std::string_view bytes32(const char* what) { return take(u32(what), what); }
  [[nodiscard]] bool at_end() const noexcept { return pos_ == in_.size(); }
  void finish(const char* what) const;

 private:
  std::string_view sized(std::uint32_t n, const char* what, std::uint32_t limit);
  std::string_view take(std::size_t n, const char* what);
  std::uint64_t le(int n, const char* what);
  std::string_view in_;
  std::size_t pos_ = 0;
};

#if DTRAIN_DETAIL_BODIES()
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
#endif  // DTRAIN_DETAIL_BODIES()

/// Decodes `value`, which `where` ("store key dtrain/agent/0/failure", "rank
/// 0's broadcast") should hold as `what` ("a node agent's failure record"):
/// `read(reader&)` reads the fields and every byte must be used. A short, long
/// or otherwise malformed value (a codec throws `violation` for a field out of
/// range) becomes a rendezvous_error naming where, what and what was wrong.
template <class Read>
auto decode_value(std::string_view where, std::string_view value, std::string_view what,
                  Read&& read) {
  try {
    reader r(value);
    auto out = std::forward<Read>(read)(r);
    r.finish("the value");
    return out;
  } catch (const violation& e) {
    throw rendezvous_error(std::string(where) + " does not hold " + std::string(what) + " (" +
                           std::to_string(value.size()) + " bytes): " + e.what() +
                           "; another program, or another dtrain version, wrote it");
  }
}

/// A value of one int64 (a rank, a port, a present-flag).
DTRAIN_DETAIL_INLINE std::string encode_int(std::int64_t v);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string encode_int(std::int64_t v) {
  std::string out;
  writer(out).i64(v);
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()
inline std::int64_t decode_int(std::string_view where, std::string_view value,
                               std::string_view what) {
  return decode_value(where, value, what, [](reader& r) { return r.i64("the number"); });
}

/// A value of one text (a reason, a token).
DTRAIN_DETAIL_INLINE std::string encode_text(std::string_view text);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string encode_text(std::string_view text) {
  std::string out;
  writer(out).bytes32(text);
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string decode_text(std::string_view where, std::string_view value,
                                             std::string_view what);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string decode_text(std::string_view where, std::string_view value,
                                             std::string_view what) {
  return decode_value(where, value, what,
                      [](reader& r) { return std::string(r.bytes32("the text")); });
}
#endif  // DTRAIN_DETAIL_BODIES()

/// A value that one rank produced for every rank, or why it could not
/// (broadcast_or_fail, rendezvous/broadcast.hpp): u8 1 and the value as
/// bytes32, or u8 0 and the producer's error message as bytes32.
struct outcome {
  bool ok = true;
  std::string text;  ///< ok: the value; else the producer's error message

  [[nodiscard]] std::string encode() const;
  /// `where` and `what` name the value in the error when it is not an outcome.
  [[nodiscard]] static outcome decode(std::string_view where, std::string_view value,
                                      std::string_view what);
};

#if DTRAIN_DETAIL_BODIES()
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
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail::wire
