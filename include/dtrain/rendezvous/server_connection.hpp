#pragma once
/// @file
/// One client's connection on the store server: its socket, the slot its
/// coroutine waits on, and the reads and writes of that coroutine, each
/// bounded by a deadline, with the bytes it buffers taken from the budget
/// that every connection shares. Runs on the server's reactor thread.

#include <dtrain/config.hpp>
#include <dtrain/detail/sys.hpp>
#include <dtrain/rendezvous/kv_state.hpp>
#include <dtrain/rendezvous/protocol.hpp>
#include <dtrain/rendezvous/reactor.hpp>
#include <dtrain/rendezvous/server_limits.hpp>
#include <dtrain/rendezvous/socket.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <sys/epoll.h>
#include <sys/socket.h>

namespace dtrain::detail {

/// Why a connection's coroutine ends, thrown from its I/O; none is a protocol violation.
struct client_gone {         ///< the client closed its end, or its connection broke
  std::string broken_while;  ///< what the server was doing when it broke ("" when closed)
};
struct server_stopping {};  ///< the server is stopping, or closed this connection to make room
struct client_idle {};      ///< nothing arrived within the idle (or handshake) timeout

/// Bytes a request holds against the shared budget, given back when it ends.
class held_bytes {
 public:
  held_bytes(byte_budget& budget, reactor& r) : budget_(budget), reactor_(r) {}
  held_bytes(const held_bytes&) = delete;
  held_bytes& operator=(const held_bytes&) = delete;
  ~held_bytes() { release(); }
  void add(std::uint64_t n) { n_ += n; }
  void release();

 private:
  byte_budget& budget_;
  reactor& reactor_;
  std::uint64_t n_ = 0;
};

/// What a look at a waiting client's socket found.
enum class hangup {
  none,     ///< nothing arrived
  request,  ///< bytes arrived: a new request while one is pending
  orderly,  ///< the client closed its end (it exited, or gave up the wait)
  broken,   ///< the connection was reset or failed
};

/// The socket of one accepted client and its I/O on the reactor.
class server_connection {
 public:
  using steady = detail::steady;

  /// Watches `fd` (from accept) on `r`; `peer` is its address for messages.
  server_connection(reactor& r, byte_budget& budget, unique_fd fd, std::string peer,
                    std::chrono::milliseconds io_timeout);
  server_connection(const server_connection&) = delete;
  server_connection& operator=(const server_connection&) = delete;
  ~server_connection() { reactor_.remove(slot_); }

  [[nodiscard]] const std::string& peer() const noexcept { return peer_; }
  [[nodiscard]] wait_slot& slot() noexcept { return slot_; }
  /// This connection as a waiter for keys (kv_state::watch): resumes its coroutine.
  [[nodiscard]] const kv_waiter& waiter() const noexcept { return waiter_; }
  [[nodiscard]] steady::time_point io_deadline() const { return steady::now() + io_timeout_; }

  /// Suspends until the socket has `events`, the deadline passes, the slot is
  /// woken, or the server stops.
  reactor::until wait(std::uint32_t events, std::optional<steady::time_point> deadline) {
    return reactor_.wait(slot_, events, deadline);
  }

  /// Appends exactly `n` bytes from the client to `out`. Returns false on a
  /// clean end of stream before the first byte when `eof_ok` (a request
  /// boundary); throws client_idle when nothing came by the deadline there.
  task<bool> read_exact(std::string& out, std::size_t n, std::optional<steady::time_point> deadline,
                        bool eof_ok, const char* what);

  /// Sends all of `data` within the io timeout.
  task<void> write_all(std::string_view data);

  /// Takes `n` bytes from the shared budget for `held`, waiting until the
  /// deadline for other connections to give some back. `what` names the
  /// bytes in the violation thrown when they never come.
  task<void> reserve(held_bytes& held, std::uint64_t n, steady::time_point deadline,
                     const std::string& what);

  /// Looks, without reading, at the socket of a client that waits for a reply.
  [[nodiscard]] hangup peek() const;

  /// Best effort, without waiting: a client blocked in get / wait learns why
  /// the server went away.
  void say_goodbye();

  /// The keys this client leased (wire::op::lease) and their values: the
  /// server erases each when the connection ends, however it ends, unless
  /// another client has set the key to another value since.
  [[nodiscard]] std::vector<std::pair<std::string, std::string>>& leases() noexcept {
    return leases_;
  }

 private:
  reactor& reactor_;
  byte_budget& budget_;
  unique_fd fd_;
  wait_slot slot_;
  std::string peer_;
  std::chrono::milliseconds io_timeout_;
  kv_waiter waiter_;
  std::vector<std::pair<std::string, std::string>> leases_;
};

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/rendezvous/server_connection-inl.hpp>
#endif
