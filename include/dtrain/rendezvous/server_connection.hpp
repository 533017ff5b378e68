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

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void held_bytes::release() {
  if (n_ == 0) return;
  budget_.give_back(reactor_, n_);
  n_ = 0;
}
#endif  // DTRAIN_DETAIL_BODIES()

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

 private:
  reactor& reactor_;
  byte_budget& budget_;
  unique_fd fd_;
  wait_slot slot_;
  std::string peer_;
  std::chrono::milliseconds io_timeout_;
  kv_waiter waiter_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE server_connection::server_connection(reactor& r, byte_budget& budget,
                                                          unique_fd fd, std::string peer,
                                                          std::chrono::milliseconds io_timeout)
    : reactor_(r),
      budget_(budget),
      fd_(std::move(fd)),
      peer_(std::move(peer)),
      io_timeout_(io_timeout),
      waiter_([this] { reactor_.wake_up(slot_); }) {
  int one = 1;
  ::setsockopt(fd_.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  reactor_.add(fd_.get(), slot_);
}

DTRAIN_DETAIL_INLINE task<bool> server_connection::read_exact(
    std::string& out, std::size_t n, std::optional<steady::time_point> deadline, bool eof_ok,
    const char* what) {
  const std::size_t start = out.size();
  char chunk[16384];
  while (out.size() - start < n) {
    std::size_t want = std::min(sizeof chunk, n - (out.size() - start));
    ssize_t got = ::recv(fd_.get(), chunk, want, 0);
    if (got > 0) {
      // Grows with what arrives, not with what was declared.
      out.append(chunk, static_cast<std::size_t>(got));
      continue;
    }
    if (got == 0) {
      if (eof_ok && out.size() == start) co_return false;
      throw wire::violation(
          std::string(what) + " cut short: the client closed the connection after " +
          std::to_string(out.size() - start) + " of " + std::to_string(n) + " bytes");
    }
    if (errno == EINTR) continue;
    if (errno == ECONNRESET && eof_ok && out.size() == start) co_return false;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      throw std::system_error(errno, std::generic_category(), std::string("reading ") + what);
    }
    auto w = co_await wait(EPOLLIN | EPOLLRDHUP, deadline);
    if (w == wake::stop) throw server_stopping{};
    if (w == wake::timeout && eof_ok && out.size() == start) throw client_idle{};
    if (w == wake::timeout) {
      throw wire::violation(
          std::string(what) + " not complete within " + std::to_string(io_timeout_.count()) +
          " ms (" + std::to_string(out.size() - start) + " of " + std::to_string(n) + " bytes)");
    }
  }
  co_return true;
}

DTRAIN_DETAIL_INLINE task<void> server_connection::write_all(std::string_view data) {
  auto deadline = io_deadline();
  while (!data.empty()) {
    ssize_t sent = ::send(fd_.get(), data.data(), data.size(), MSG_NOSIGNAL);
    if (sent > 0) {
      data.remove_prefix(static_cast<std::size_t>(sent));
      continue;
    }
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0 && (errno == EPIPE || errno == ECONNRESET)) throw client_gone{};
    if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      throw std::system_error(errno, std::generic_category(), "sending a reply");
    }
    auto w = co_await wait(EPOLLOUT, deadline);
    if (w == wake::stop) throw server_stopping{};
    if (w == wake::timeout)
      throw wire::violation("the client did not read its reply within the io timeout");
  }
}

DTRAIN_DETAIL_INLINE task<void> server_connection::reserve(held_bytes& held, std::uint64_t n,
                                                           steady::time_point deadline,
                                                           const std::string& what) {
  if (n > budget_.cap()) {
    throw wire::violation(what + " exceeds the store's buffer cap of " +
                          std::to_string(budget_.cap()) +
                          " bytes (store_limits::max_buffered_bytes)");
  }
  while (!budget_.try_take(n)) {
    budget_.wait_here(slot_);
    auto w = co_await wait(0, deadline);
    budget_.stop_waiting(slot_);
    if (w == wake::stop) throw server_stopping{};
    if (w == wake::timeout) {
      throw wire::violation(
          what + " waited for the store's buffer (" + std::to_string(budget_.used()) + " of " +
          std::to_string(budget_.cap()) + " bytes held by other connections) past the io timeout");
    }
  }
  held.add(n);
}

DTRAIN_DETAIL_INLINE hangup server_connection::peek() const {
  char byte;
  ssize_t n = ::recv(fd_.get(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n > 0) return hangup::request;
  if (n == 0) return hangup::orderly;
  return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? hangup::none : hangup::broken;
}

DTRAIN_DETAIL_INLINE void server_connection::say_goodbye() {
  std::string body;
  wire::writer(body)
      .u8(static_cast<std::uint8_t>(wire::status::shutting_down))
      .bytes32("the store server is shutting down");
  auto frame = wire::frame(body);
  (void)!::send(fd_.get(), frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
