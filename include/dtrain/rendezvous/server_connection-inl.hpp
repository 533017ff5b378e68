#pragma once
/// @file
/// The non-template bodies of dtrain/rendezvous/server_connection.hpp: included by it in
/// header-only mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/rendezvous/server_connection.hpp, not this file.

#include <dtrain/rendezvous/server_connection.hpp>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE void held_bytes::release() {
  if (n_ == 0) return;
  budget_.give_back(reactor_, n_);
  n_ = 0;
}

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

}  // namespace dtrain::detail
