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
inline std::int64_t decode_int(std::string_view where, std::string_view value,
                               std::string_view what) {
  return decode_value(where, value, what, [](reader& r) { return r.i64("the number"); });
}

/// A value of one text (a reason, a token).
DTRAIN_DETAIL_INLINE std::string encode_text(std::string_view text);
DTRAIN_DETAIL_INLINE std::string decode_text(std::string_view where, std::string_view value,
                                             std::string_view what);

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

}  // namespace dtrain::detail::wire

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/detail/wire-inl.hpp>
#endif
