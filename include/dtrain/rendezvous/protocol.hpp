#pragma once
/// @file
/// The store's wire protocol. All integers are little-endian.
///
///   handshake   client → server: magic u32 "DTRZ", version u16, token: bytes16
///               server → client: status u8, version u16
///   request     length u32 (of the body), body: op u8, then the op's fields
///   response    length u32, body: status u8, then the payload
///
/// bytes16 / bytes32 are a u16 / u32 length followed by that many bytes. A
/// length beyond the configured limits closes the connection before anything
/// is allocated for it.

#include <dtrain/rendezvous/options.hpp>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::detail::wire {

inline constexpr std::uint32_t magic = 0x5a525444;  // "DTRZ" as little-endian bytes
inline constexpr std::uint16_t version = 1;

enum class op : std::uint8_t {
  set = 1,          ///< key, value → ok
  get = 2,          ///< key, timeout_ms u64 → ok + value | timeout
  add = 3,          ///< key, delta i64 → ok + new value i64
  compare_set = 4,  ///< key, expected, desired → ok + current value
  wait = 5,         ///< count u32, keys, timeout_ms u64 → ok | timeout
  check = 6,        ///< count u32, keys → ok + u8 (all present)
  erase = 7,        ///< key → ok + u8 (existed)
  num_keys = 8,     ///< → ok + u64
  ping = 9,         ///< → ok
};

enum class status : std::uint8_t {
  ok = 0,
  timeout = 1,        ///< a wait expired on the server
  error = 2,          ///< the request was understood and refused; bytes32 message follows
  shutting_down = 3,  ///< the server is stopping; bytes32 message follows
  bad_version = 4,    ///< handshake only
  bad_token = 5,      ///< handshake only
};

/// A request or reply that breaks the protocol; the connection is closed.
struct violation : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Appends little-endian fields to a buffer.
class writer {
 public:
  explicit writer(std::string& out) : out_(out) {}
  writer& u8(std::uint8_t v) {
    out_ += static_cast<char>(v);
    return *this;
  }
  writer& u16(std::uint16_t v) { return le(v, 2); }
  writer& u32(std::uint32_t v) { return le(v, 4); }
  writer& u64(std::uint64_t v) { return le(v, 8); }
  writer& i64(std::int64_t v) { return le(static_cast<std::uint64_t>(v), 8); }
  writer& bytes16(std::string_view s) {
    u16(static_cast<std::uint16_t>(s.size()));
    out_.append(s);
    return *this;
  }
  writer& bytes32(std::string_view s) {
    u32(static_cast<std::uint32_t>(s.size()));
    out_.append(s);
    return *this;
  }

 private:
  writer& le(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xff);
    return *this;
  }
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
  void finish(const char* what) const {
    if (pos_ != in_.size()) {
      throw violation(std::string(what) + " has " + std::to_string(in_.size() - pos_) +
                      " unexpected trailing bytes");
    }
  }

 private:
  std::string_view sized(std::uint32_t n, const char* what, std::uint32_t limit) {
    if (n > limit) {
      throw violation(std::string(what) + " of " + std::to_string(n) +
                      " bytes exceeds the limit of " + std::to_string(limit));
    }
    return take(n, what);
  }
  std::string_view take(std::size_t n, const char* what) {
    if (in_.size() - pos_ < n) throw violation(std::string(what) + " is truncated");
    auto out = in_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  std::uint64_t le(int n, const char* what) {
    auto bytes = take(static_cast<std::size_t>(n), what);
    std::uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i)
      v = (v << 8) | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
    return v;
  }
  std::string_view in_;
  std::size_t pos_ = 0;
};

/// A frame: u32 length, then the body.
inline std::string frame(const std::string& body) {
  std::string out;
  writer(out).u32(static_cast<std::uint32_t>(body.size()));
  out += body;
  return out;
}

/// The decoded u32 at the start of `header` (4 bytes).
inline std::uint32_t frame_length(std::string_view header) {
  return reader(header).u32("frame length");
}

/// Keys of a wait/check request, bounded by the limits.
inline std::vector<std::string_view> read_keys(reader& r, const store_limits& limits) {
  std::uint32_t n = r.u32("key count");
  if (n > limits.max_keys_per_request) {
    throw violation("key count " + std::to_string(n) + " exceeds the limit of " +
                    std::to_string(limits.max_keys_per_request));
  }
  std::vector<std::string_view> keys;  // grows with keys actually present, not with n
  for (std::uint32_t i = 0; i < n; ++i) keys.push_back(r.bytes32("key", limits.max_key_size));
  return keys;
}

}  // namespace dtrain::detail::wire
