#pragma once
/// @file
/// store_server: the key-value store every rank meets at. It admits
/// connections (caps, eviction of strangers, the token handshake), reads each
/// request, hands it to the handler of its operation, and writes the reply:
/// one coroutine per connection (server_connection.hpp) on an epoll reactor,
/// on one background thread. What the store holds and what its operations
/// mean is kv_state (kv_state.hpp).

#include <dtrain/config.hpp>
#include <dtrain/detail/sys.hpp>
#include <dtrain/error.hpp>
#include <dtrain/rendezvous/operations.hpp>
#include <dtrain/rendezvous/options.hpp>
#include <dtrain/rendezvous/protocol.hpp>
#include <dtrain/rendezvous/reactor.hpp>
#include <dtrain/rendezvous/server_connection.hpp>
#include <dtrain/rendezvous/server_limits.hpp>
#include <dtrain/rendezvous/socket.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <sys/epoll.h>
#include <sys/socket.h>

namespace dtrain {

/// A snapshot of what the server is doing, for tests and diagnostics.
struct store_server_stats {
  std::size_t connections = 0;         ///< open connections, handshaken or not
  std::size_t waiting = 0;             ///< connections blocked in get / wait
  std::uint64_t closed_for_cause = 0;  ///< connections closed for bad input or timeouts
  std::uint64_t refused = 0;           ///< connections closed at accept (caps, descriptors)
  std::uint64_t closed_idle = 0;       ///< connections closed after the idle timeout
  std::uint64_t stored_bytes = 0;      ///< keys and values held
  std::uint64_t buffered_bytes = 0;    ///< requests, replies and waits in flight
};

/// Serves the store on `address:port` from a background thread until stop()
/// or destruction. Construction binds and listens, so a port in use is a
/// rendezvous_error thrown here; port 0 picks a free port (see port()).
/// Bad input from a client closes that connection with a logged reason;
/// everyone else is still served. stop() answers every pending get / wait
/// with an error and closes every connection.
///
/// What clients can make it hold is capped (store_limits): connections,
/// stored bytes, bytes in flight, keys in a wait. Connections silent for
/// the idle timeout are closed. Rejections are logged a few in full, then as
/// one summary line every 10 s. The address is the interface to listen on:
/// dtrain::run and the node agent pass the one MASTER_ADDR names (loopback
/// for a single-node job), not every interface.
class store_server {
 public:
  explicit store_server(std::string address = "127.0.0.1", int port = 0,
                        store_options options = {});
  store_server(const store_server&) = delete;
  store_server& operator=(const store_server&) = delete;
  ~store_server() { stop(); }

  /// The port it listens on (the one picked when constructed with 0).
  [[nodiscard]] int port() const noexcept { return port_; }
  [[nodiscard]] const std::string& address() const noexcept { return address_; }
  [[nodiscard]] std::string endpoint() const { return detail::endpoint_text(address_, port_); }

  /// Callable from any thread.
  [[nodiscard]] store_server_stats stats() const noexcept;

  /// Wakes every waiter with an error, closes every connection, joins the thread. Idempotent.
  void stop();

 private:
  using steady = detail::steady;
  using status = detail::wire::status;
  using violation = detail::wire::violation;

  /// A client's connection: its I/O, and where it stands in admission.
  struct connection {
    connection(store_server& s, detail::unique_fd fd, std::string peer)
        : io(s.reactor_, s.budget_, std::move(fd), std::move(peer), s.options_.io_timeout) {}
    detail::server_connection io;
    bool in_request = false;
    bool authenticated = false;
    bool evicted = false;
    bool listed = false;  // in unproven_, at `unproven`, until the handshake succeeds
    std::list<connection*>::iterator unproven{};
    detail::task<void> job;
  };

  void log(const std::string& message) const;

  // ---- admission: listening, accepting, the caps, the handshake ----------

  void listen_on(int port);

  void serve_until_stopped();

  // Destroys the connections whose coroutine has finished (it cannot free its own frame).
  void reap();

  detail::task<void> accept_loop();

  /// Starts serving an accepted connection, or refuses it at the cap. At the
  /// cap, a connection that has not proven its token yet makes room: a flood
  /// of strangers cannot lock the job's own ranks out.
  void admit(detail::unique_fd fd, const sockaddr* peer);

  // A connection's whole life: the handshake, then its requests until it goes.
  detail::task<void> serve(connection& c);

  detail::task<bool> handshake(connection& c);

  // Compares without an early exit, so timing does not reveal the token.
  static bool same_secret(std::string_view a, std::string_view b);

  // The handshake's answer: a status and the server's protocol version. (A
  // function, not a lambda: a coroutine frame that holds a lambda's type
  // trips -Wsubobject-linkage where the body is compiled out of line.)
  static std::string reply(status s) {
    std::string body;
    detail::wire::writer(body).u8(static_cast<std::uint8_t>(s)).u16(detail::wire::version);
    return body;
  }

  // ---- requests: read one, hand it to its operation's handler, write the reply ----

  detail::task<bool> serve_one(connection& c);

  std::string address_;
  store_options options_;
  int port_ = 0;
  detail::reactor reactor_;
  detail::unique_fd listen_;
  detail::wait_slot accept_slot_;
  detail::store_operations operations_;
  detail::byte_budget budget_;
  std::size_t connection_cap_;
  detail::spare_descriptor spare_;
  detail::rejection_log rejections_;
  // After the reactor, the operations and the budget, which they use: destroyed first.
  std::unordered_map<connection*, std::unique_ptr<connection>> connections_;
  std::vector<connection*> finished_;
  std::list<connection*> unproven_;  // connections before their handshake, oldest first
  // Counts that stats() reads from other threads (the other figures come from
  // operations_ and budget_): with the reactor's stop request, all that the
  // threads share. The reactor thread writes each after the change it reports
  // (a connection is uncounted before its socket closes) and never reads them.
  struct {
    std::atomic<std::size_t> connections{0};         // accepted and not yet finished
    std::atomic<std::uint64_t> refused{0};           // refused at accept, or evicted unproven
    std::atomic<std::uint64_t> closed_idle{0};       // closed after the idle timeout
    std::atomic<std::uint64_t> closed_for_cause{0};  // closed for bad input or a timeout
  } published_;
  std::thread thread_;  // last: starts once everything above exists
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE store_server::store_server(std::string address, int port,
                                                store_options options)
    : address_(std::move(address)),
      options_(std::move(options)),
      operations_(options_.limits),
      budget_(options_.limits.max_buffered_bytes),
      connection_cap_(detail::connection_capacity(options_.limits.max_connections)) {
  listen_on(port);
  thread_ = std::thread([this] { serve_until_stopped(); });
}

DTRAIN_DETAIL_INLINE store_server_stats store_server::stats() const noexcept {
  return {published_.connections.load(),
          operations_.waiting(),
          published_.closed_for_cause.load(),
          published_.refused.load(),
          published_.closed_idle.load(),
          operations_.stored_bytes(),
          budget_.used()};
}

DTRAIN_DETAIL_INLINE void store_server::stop() {
  reactor_.request_stop();
  if (thread_.joinable()) thread_.join();
}

DTRAIN_DETAIL_INLINE void store_server::log(const std::string& message) const {
  std::string line = "[dtrain store " + endpoint() + "] " + message;
  if (options_.log) {
    options_.log(line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

DTRAIN_DETAIL_INLINE void store_server::listen_on(int port) {
  detail::address_list addrs;
  if (int rc = detail::resolve(address_, port, true, addrs); rc != 0) {
    throw rendezvous_error("cannot listen on " + detail::endpoint_text(address_, port) + ": " +
                           ::gai_strerror(rc));
  }
  const addrinfo* a = addrs.head;
  detail::unique_fd fd(
      DTRAIN_SYSCALL(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)));
  int one = 1;
  DTRAIN_SYSCALL(::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one));
  if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
    int err = errno;
    throw rendezvous_error(
        "cannot listen on " + detail::endpoint_text(address_, port) + ": " + std::strerror(err) +
        (err == EADDRINUSE ? " (another store or program holds the port: "
                             "pick another MASTER_PORT, or port 0 for a free one)"
                           : ""));
  }
  DTRAIN_SYSCALL(::listen(fd.get(), 65535));  // the kernel caps it at somaxconn
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  DTRAIN_SYSCALL(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len));
  port_ = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                      : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  listen_ = std::move(fd);
  reactor_.add(listen_.get(), accept_slot_);
}

DTRAIN_DETAIL_INLINE void store_server::serve_until_stopped() {
  detail::task<void> acceptor = accept_loop();
  acceptor.start();
  try {
    while (reactor_.run_once(std::chrono::milliseconds(1000))) {
      reap();
      if (auto line = rejections_.summary(steady::now())) log(*line);
    }
  } catch (const std::exception& e) {
    log(std::string("reactor failed, stopping: ") + e.what());
  }
  std::vector<detail::wait_slot*> suspended{&accept_slot_};
  for (auto& [raw, c] : connections_) suspended.push_back(&c->io.slot());
  reactor_.stop_all(suspended);
  reap();
  connections_.clear();
  published_.connections = 0;
  reactor_.remove(accept_slot_);
  listen_.reset();
}

DTRAIN_DETAIL_INLINE void store_server::reap() {
  for (connection* c : finished_) connections_.erase(c);
  finished_.clear();
}

DTRAIN_DETAIL_INLINE detail::task<void> store_server::accept_loop() {
  for (std::uint64_t accepted = 1;; ++accepted) {
    // Now and then, let the reactor run a round (and reap what was closed)
    // before the next accept, so that a backlog of thousands cannot starve it.
    if (accepted % 64 == 0 &&
        co_await reactor_.wait(accept_slot_, EPOLLIN, std::nullopt) == detail::wake::stop) {
      co_return;
    }
    sockaddr_storage peer{};
    socklen_t len = sizeof peer;
    int fd = ::accept4(listen_.get(), reinterpret_cast<sockaddr*>(&peer), &len,
                       SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      admit(detail::unique_fd(fd), reinterpret_cast<sockaddr*>(&peer));
      continue;
    }
    int err = errno;
    if (err == EINTR || err == ECONNABORTED) continue;
    detail::wake w;
    if ((err == EMFILE || err == ENFILE) && spare_.refuse_one(listen_.get())) {
      // Keep the queue moving: the client learns at once instead of hanging in it.
      ++published_.refused;
      if (rejections_.note(detail::rejection::out_of_descriptors)) {
        log(std::string("refused a connection: ") + std::strerror(err));
      }
      continue;
    }
    if (err == EAGAIN || err == EWOULDBLOCK) {
      w = co_await reactor_.wait(accept_slot_, EPOLLIN, std::nullopt);
    } else {
      // Out of descriptors or memory: say so, and try again shortly instead of spinning.
      log(std::string("cannot accept a connection: ") + std::strerror(err) +
          "; retrying in 100 ms");
      w = co_await reactor_.wait(accept_slot_, 0, steady::now() + std::chrono::milliseconds(100));
    }
    if (w == detail::wake::stop) co_return;
  }
}

DTRAIN_DETAIL_INLINE void store_server::admit(detail::unique_fd fd, const sockaddr* peer) {
  if (connections_.size() >= connection_cap_) {
    if (unproven_.empty()) {
      fd.reset();
      ++published_.refused;
      if (rejections_.note(detail::rejection::over_connection_cap)) {
        log("refused a connection from " + detail::endpoint_text(peer) + ": " +
            std::to_string(connection_cap_) +
            " connections are open (store_limits::max_connections, DTRAIN_STORE_MAX_CONNECTIONS, "
            "or the descriptor limit)");
      }
      return;
    }
    connection* oldest = unproven_.front();
    unproven_.pop_front();
    oldest->listed = false;
    oldest->evicted = true;
    reactor_.cancel(oldest->io.slot());
  }
  auto owned = std::make_unique<connection>(*this, std::move(fd), detail::endpoint_text(peer));
  connection* c = owned.get();
  connections_.emplace(c, std::move(owned));
  c->unproven = unproven_.insert(unproven_.end(), c);
  c->listed = true;
  ++published_.connections;
  c->job = serve(*c);
  c->job.start();
}

DTRAIN_DETAIL_INLINE detail::task<void> store_server::serve(connection& c) {
  std::string reason;  // why the server closed it, to log
  bool idle = false;
  try {
    if (co_await handshake(c)) {
      while (co_await serve_one(c)) {
      }
    }
  } catch (const detail::client_gone& gone) {
    if (!gone.broken_while.empty() && rejections_.note(detail::rejection::broken)) {
      log("client " + c.io.peer() + " disconnected while " + gone.broken_while);
    }
  } catch (const detail::server_stopping&) {
    if (c.evicted) {
      ++published_.refused;
      if (rejections_.note(detail::rejection::over_connection_cap)) {
        log("closed connection from " + c.io.peer() + " before its handshake: " +
            std::to_string(connection_cap_) + " connections are open and a new one came");
      }
    } else if (c.in_request) {
      c.io.say_goodbye();
    }
  } catch (const detail::client_idle&) {
    if (c.authenticated) {
      idle = true;
      rejections_.note(detail::rejection::idle);
    } else {
      reason = "handshake not complete within " + std::to_string(options_.io_timeout.count()) +
               " ms (nothing was sent)";
    }
  } catch (const violation& e) {
    reason = std::string("protocol violation: ") + e.what();
  } catch (const std::exception& e) {
    reason = e.what();
  }
  // First: whoever sees it counted as closed, or its socket closed (at the
  // reap), sees the connection count without it.
  --published_.connections;
  if (idle) ++published_.closed_idle;
  if (!reason.empty()) {
    ++published_.closed_for_cause;
    if (rejections_.note(c.authenticated ? detail::rejection::protocol
                                         : detail::rejection::handshake)) {
      log("closed connection from " + c.io.peer() + ": " + reason);
    }
  }
  if (std::exchange(c.listed, false)) unproven_.erase(c.unproven);
  finished_.push_back(&c);
}

DTRAIN_DETAIL_INLINE detail::task<bool> store_server::handshake(connection& c) {
  auto deadline = c.io.io_deadline();
  std::string hello;
  if (!co_await c.io.read_exact(hello, 8, deadline, true, "handshake")) co_return false;
  detail::wire::reader r(hello);
  auto magic = r.u32("magic");
  if (magic != detail::wire::magic) {
    char hex[16];
    std::snprintf(hex, sizeof hex, "0x%08x", magic);
    throw violation(std::string("bad magic ") + hex + ": not a dtrain store client");
  }
  auto version = r.u16("version");
  auto token_size = r.u16("token length");
  if (token_size > options_.limits.max_token_size) {
    throw violation("token of " + std::to_string(token_size) + " bytes exceeds the limit of " +
                    std::to_string(options_.limits.max_token_size));
  }
  std::string token;
  co_await c.io.read_exact(token, token_size, deadline, false, "token");
  if (version != detail::wire::version) {
    co_await c.io.write_all(reply(status::bad_version));
    throw violation("client speaks protocol version " + std::to_string(version) + ", this server " +
                    std::to_string(detail::wire::version));
  }
  if (!same_secret(token, options_.token)) {
    co_await c.io.write_all(reply(status::bad_token));
    throw violation("wrong token (DTRAIN_STORE_TOKEN differs)");
  }
  co_await c.io.write_all(reply(status::ok));
  c.authenticated = true;
  if (std::exchange(c.listed, false)) unproven_.erase(c.unproven);
  co_return true;
}

DTRAIN_DETAIL_INLINE bool store_server::same_secret(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

DTRAIN_DETAIL_INLINE detail::task<bool> store_server::serve_one(connection& c) {
  std::string head;
  if (!co_await c.io.read_exact(head, 1, steady::now() + options_.idle_timeout, true, "request"))
    co_return false;
  auto deadline = c.io.io_deadline();
  co_await c.io.read_exact(head, 3, deadline, false, "request length");
  std::uint32_t length = detail::wire::frame_length(head);
  if (length == 0) throw violation("empty request frame");
  if (length > options_.limits.max_frame_size()) {
    throw violation("request frame of " + std::to_string(length) + " bytes exceeds the limit of " +
                    std::to_string(options_.limits.max_frame_size()));
  }
  detail::held_bytes held(budget_, reactor_);
  co_await c.io.reserve(held, length, deadline,
                        "a request of " + std::to_string(length) + " bytes");
  std::string body;
  co_await c.io.read_exact(body, length, deadline, false, "request body");
  detail::wire::reader fields(body);
  detail::store_request q{c.io, held, fields};
  std::string reply;
  c.in_request = true;
  try {
    reply = co_await operations_.handle(q);
  } catch (const detail::store_refusal& e) {
    reply = detail::store_operations::refusal(e.what());  // the connection stays
  }
  c.in_request = false;
  co_await c.io.write_all(detail::wire::frame(reply));
  co_return true;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
