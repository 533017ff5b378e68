#pragma once
/// @file
/// The store's wire protocol. All integers are little-endian.
///
///   handshake   client → server: magic u32 "DTRZ", version u16, token: bytes16
///               server → client: status u8, version u16, and when the status is
///                                 ok, the server's instance u64 (drawn at random
///                                 when it starts: a client that reconnects tells
///                                 a restarted server, which holds none of its
///                                 keys, from the one it joined)
///   request     length u32 (of the body), body: op u8, then the op's fields
///   response    length u32, body: status u8, then the payload
///
/// bytes16 / bytes32 are a u16 / u32 length followed by that many bytes. A
/// length beyond the configured limits closes the connection before anything
/// is allocated for it.

#include <dtrain/config.hpp>
#include <dtrain/detail/wire.hpp>
#include <dtrain/rendezvous/options.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::detail::wire {

inline constexpr std::uint32_t magic = 0x5a525444;  // "DTRZ" as little-endian bytes
inline constexpr std::uint16_t version = 2;

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
  lease = 10,       ///< key, value → ok: set, and erased when this connection closes
};

/// Leased keys one connection may hold (op::lease): a node agent needs one.
inline constexpr std::size_t max_leases_per_connection = 4;
/// The largest value of a leased key: the connection keeps a copy of it.
inline constexpr std::size_t max_lease_value = 4096;

enum class status : std::uint8_t {
  ok = 0,
  timeout = 1,        ///< a wait expired on the server
  error = 2,          ///< the request was understood and refused; bytes32 message follows
  shutting_down = 3,  ///< the server is stopping; bytes32 message follows
  bad_version = 4,    ///< handshake only
  bad_token = 5,      ///< handshake only
};

/// A frame: u32 length, then the body.
DTRAIN_DETAIL_INLINE std::string frame(const std::string& body);

/// The decoded u32 at the start of `header` (4 bytes).
inline std::uint32_t frame_length(std::string_view header) {
  return reader(header).u32("frame length");
}

/// Keys of a wait/check request, bounded by the limits.
DTRAIN_DETAIL_INLINE std::vector<std::string_view> read_keys(reader& r, const store_limits& limits);

}  // namespace dtrain::detail::wire

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/rendezvous/protocol-inl.hpp>
#endif
