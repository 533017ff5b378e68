#pragma once
/// @file
/// store_server: the key-value store every rank meets at. One coroutine per
/// connection on an epoll reactor, on one background thread.

#include <dtrain/detail/sys.hpp>
#include <dtrain/error.hpp>
#include <dtrain/rendezvous/options.hpp>
#include <dtrain/rendezvous/protocol.hpp>
#include <dtrain/rendezvous/reactor.hpp>
#include <dtrain/rendezvous/server_limits.hpp>
#include <dtrain/rendezvous/socket.hpp>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
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
  explicit store_server(std::string address = "127.0.0.1", int port = 0, store_options options = {})
      : address_(std::move(address)),
        options_(std::move(options)),
        budget_(options_.limits.max_buffered_bytes),
        connection_cap_(detail::connection_capacity(options_.limits.max_connections)) {
    listen_on(port);
    thread_ = std::thread([this] { serve_until_stopped(); });
  }
  store_server(const store_server&) = delete;
  store_server& operator=(const store_server&) = delete;
  ~store_server() { stop(); }

  /// The port it listens on (the one picked when constructed with 0).
  [[nodiscard]] int port() const noexcept { return port_; }
  [[nodiscard]] const std::string& address() const noexcept { return address_; }
  [[nodiscard]] std::string endpoint() const { return detail::endpoint_text(address_, port_); }

  [[nodiscard]] store_server_stats stats() const noexcept {
    return {connection_count_.load(), waiting_.load(),     closed_for_cause_.load(),
            refused_.load(),          closed_idle_.load(), stored_bytes_.load(),
            buffered_bytes_.load()};
  }

  /// Wakes every waiter with an error, closes every connection, joins the thread. Idempotent.
  void stop() {
    reactor_.request_stop();
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct connection {
    detail::unique_fd fd;
    detail::wait_slot slot;
    std::string peer;
    bool in_request = false;
    bool authenticated = false;
    bool evicted = false;
    bool listed = false;  // in unproven_, at `unproven`, until the handshake succeeds
    std::list<connection*>::iterator unproven{};
    detail::task<void> job;
  };

  struct peer_gone {};  // the client closed its end: not an error
  struct stopping {};   // the server is stopping
  struct idle {};       // nothing arrived within the idle (or handshake) timeout

  /// Bytes a connection holds against the shared budget, given back when it goes.
  class held_bytes {
   public:
    explicit held_bytes(store_server& s) : s_(s) {}
    held_bytes(const held_bytes&) = delete;
    held_bytes& operator=(const held_bytes&) = delete;
    ~held_bytes() { release(); }
    void add(std::uint64_t n) { n_ += n; }
    void release() {
      if (n_ == 0) return;
      s_.budget_.give_back(s_.reactor_, n_);
      s_.buffered_bytes_ = s_.budget_.used();
      n_ = 0;
    }

   private:
    store_server& s_;
    std::uint64_t n_ = 0;
  };

  using steady = detail::steady;
  using op = detail::wire::op;
  using status = detail::wire::status;
  using violation = detail::wire::violation;

  void log(const std::string& message) const {
    std::string line = "[dtrain store " + endpoint() + "] " + message;
    if (options_.log) {
      options_.log(line);
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  }

  void listen_on(int port) {
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
          (err == EADDRINUSE ? " (another store or program holds the port: pick another "
                               "MASTER_PORT, or port 0 for a free one)"
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

  void serve_until_stopped() {
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
    for (auto& [raw, c] : connections_) suspended.push_back(&c->slot);
    reactor_.stop_all(suspended);
    reap();
    connections_.clear();
    connection_count_ = 0;
    reactor_.remove(accept_slot_);
    listen_.reset();
  }

  void reap() {
    for (connection* c : finished_) {
      reactor_.remove(c->slot);
      --connection_count_;  // first: whoever sees the socket close sees the count without it
      connections_.erase(c);
    }
    finished_.clear();
  }

  detail::task<void> accept_loop() {
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
      // At the cap, a connection that has not proven its token yet makes room:
      // a flood of strangers cannot lock the job's own ranks out.
      if (fd >= 0 && connection_count_ >= connection_cap_ && !unproven_.empty()) {
        connection* oldest = unproven_.front();
        unproven_.pop_front();
        oldest->listed = false;
        oldest->evicted = true;
        reactor_.cancel(oldest->slot);
      } else if (fd >= 0 && connection_count_ >= connection_cap_) {
        ::close(fd);
        ++refused_;
        if (rejections_.note(detail::rejection::over_connection_cap)) {
          log("refused a connection from " +
              detail::endpoint_text(reinterpret_cast<sockaddr*>(&peer)) + ": " +
              std::to_string(connection_cap_) +
              " connections are open (store_limits::max_connections, "
              "DTRAIN_STORE_MAX_CONNECTIONS, or the descriptor limit)");
        }
        continue;
      }
      if (fd >= 0) {
        auto c = std::make_unique<connection>();
        c->fd.reset(fd);
        c->peer = detail::endpoint_text(reinterpret_cast<sockaddr*>(&peer));
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        reactor_.add(fd, c->slot);
        connection* raw = c.get();
        connections_.emplace(raw, std::move(c));
        raw->unproven = unproven_.insert(unproven_.end(), raw);
        raw->listed = true;
        ++connection_count_;
        raw->job = serve(*raw);
        raw->job.start();
        continue;
      }
      int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      detail::wake w;
      if ((err == EMFILE || err == ENFILE) && spare_.refuse_one(listen_.get())) {
        // Keep the queue moving: the client learns at once instead of hanging in it.
        ++refused_;
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

  detail::task<void> serve(connection& c) {
    std::string reason;
    try {
      if (co_await handshake(c)) {
        while (co_await serve_one(c)) {
        }
      }
    } catch (const peer_gone&) {
    } catch (const stopping&) {
      if (c.evicted) {
        ++refused_;
        if (rejections_.note(detail::rejection::over_connection_cap)) {
          log("closed connection from " + c.peer + " before its handshake: " +
              std::to_string(connection_cap_) + " connections are open and a new one came");
        }
      } else if (c.in_request) {
        say_goodbye(c);
      }
    } catch (const idle&) {
      if (c.authenticated) {
        ++closed_idle_;
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
    if (!reason.empty()) {
      ++closed_for_cause_;
      if (rejections_.note(c.authenticated ? detail::rejection::protocol
                                           : detail::rejection::handshake)) {
        log("closed connection from " + c.peer + ": " + reason);
      }
    }
    if (std::exchange(c.listed, false)) unproven_.erase(c.unproven);
    finished_.push_back(&c);
  }

  // Best effort, without waiting: the client blocked in get / wait learns why.
  void say_goodbye(connection& c) {
    std::string body;
    detail::wire::writer(body)
        .u8(static_cast<std::uint8_t>(status::shutting_down))
        .bytes32("the store server is shutting down");
    auto frame = detail::wire::frame(body);
    (void)!::send(c.fd.get(), frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  }

  steady::time_point io_deadline() const { return steady::now() + options_.io_timeout; }

  /// Appends exactly `n` bytes from the connection to `out`. Returns false on
  /// a clean end of stream before the first byte when `eof_ok`.
  detail::task<bool> read_exact(connection& c, std::string& out, std::size_t n,
                                std::optional<steady::time_point> deadline, bool eof_ok,
                                const char* what) {
    const std::size_t start = out.size();
    char chunk[16384];
    while (out.size() - start < n) {
      std::size_t want = std::min(sizeof chunk, n - (out.size() - start));
      ssize_t got = ::recv(c.fd.get(), chunk, want, 0);
      if (got > 0) {
        out.append(chunk, static_cast<std::size_t>(
                              got));  // grows with what arrives, not with what was declared
        continue;
      }
      if (got == 0) {
        if (eof_ok && out.size() == start) co_return false;
        throw violation(std::string(what) + " cut short: the client closed the connection after " +
                        std::to_string(out.size() - start) + " of " + std::to_string(n) + " bytes");
      }
      if (errno == EINTR) continue;
      if (errno == ECONNRESET && eof_ok && out.size() == start) co_return false;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        throw std::system_error(errno, std::generic_category(), std::string("reading ") + what);
      }
      auto w = co_await reactor_.wait(c.slot, EPOLLIN | EPOLLRDHUP, deadline);
      if (w == detail::wake::stop) throw stopping{};
      if (w == detail::wake::timeout && eof_ok && out.size() == start) throw idle{};
      if (w == detail::wake::timeout) {
        throw violation(std::string(what) + " not complete within " +
                        std::to_string(options_.io_timeout.count()) + " ms (" +
                        std::to_string(out.size() - start) + " of " + std::to_string(n) +
                        " bytes)");
      }
    }
    co_return true;
  }

  detail::task<void> write_all(connection& c, std::string_view data) {
    auto deadline = io_deadline();
    while (!data.empty()) {
      ssize_t sent = ::send(c.fd.get(), data.data(), data.size(), MSG_NOSIGNAL);
      if (sent > 0) {
        data.remove_prefix(static_cast<std::size_t>(sent));
        continue;
      }
      if (sent < 0 && errno == EINTR) continue;
      if (sent < 0 && (errno == EPIPE || errno == ECONNRESET)) throw peer_gone{};
      if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
        throw std::system_error(errno, std::generic_category(), "sending a reply");
      }
      auto w = co_await reactor_.wait(c.slot, EPOLLOUT, deadline);
      if (w == detail::wake::stop) throw stopping{};
      if (w == detail::wake::timeout)
        throw violation("the client did not read its reply within the io timeout");
    }
  }

  detail::task<bool> handshake(connection& c) {
    auto deadline = io_deadline();
    std::string hello;
    if (!co_await read_exact(c, hello, 8, deadline, true, "handshake")) co_return false;
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
    co_await read_exact(c, token, token_size, deadline, false, "token");
    auto reply = [&](status s) {
      std::string body;
      detail::wire::writer(body).u8(static_cast<std::uint8_t>(s)).u16(detail::wire::version);
      return body;
    };
    if (version != detail::wire::version) {
      co_await write_all(c, reply(status::bad_version));
      throw violation("client speaks protocol version " + std::to_string(version) +
                      ", this server " + std::to_string(detail::wire::version));
    }
    if (!same_secret(token, options_.token)) {
      co_await write_all(c, reply(status::bad_token));
      throw violation("wrong token (DTRAIN_STORE_TOKEN differs)");
    }
    co_await write_all(c, reply(status::ok));
    c.authenticated = true;
    if (std::exchange(c.listed, false)) unproven_.erase(c.unproven);
    co_return true;
  }

  // Compares without an early exit, so timing does not reveal the token.
  static bool same_secret(std::string_view a, std::string_view b) {
    unsigned char diff = a.size() == b.size() ? 0 : 1;
    for (std::size_t i = 0; i < a.size(); ++i) {
      diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
    }
    return diff == 0;
  }

  detail::task<bool> serve_one(connection& c) {
    std::string head;
    if (!co_await read_exact(c, head, 1, steady::now() + options_.idle_timeout, true, "request"))
      co_return false;
    auto deadline = io_deadline();
    co_await read_exact(c, head, 3, deadline, false, "request length");
    std::uint32_t length = detail::wire::frame_length(head);
    if (length == 0) throw violation("empty request frame");
    if (length > options_.limits.max_frame_size()) {
      throw violation("request frame of " + std::to_string(length) +
                      " bytes exceeds the limit of " +
                      std::to_string(options_.limits.max_frame_size()));
    }
    held_bytes held(*this);
    co_await reserve(c, held, length, deadline,
                     "a request of " + std::to_string(length) + " bytes");
    std::string body;
    co_await read_exact(c, body, length, deadline, false, "request body");
    c.in_request = true;
    std::string reply = co_await execute(c, held, body);
    c.in_request = false;
    co_await write_all(c, detail::wire::frame(reply));
    co_return true;
  }

  /// Takes `n` bytes from the shared budget for `held`, waiting until the
  /// deadline for other connections to give some back.
  detail::task<void> reserve(connection& c, held_bytes& held, std::uint64_t n,
                             steady::time_point deadline, const std::string& what) {
    if (n > budget_.cap()) {
      throw violation(what + " exceeds the store's buffer cap of " + std::to_string(budget_.cap()) +
                      " bytes (store_limits::max_buffered_bytes)");
    }
    while (!budget_.try_take(n)) {
      budget_.wait_here(c.slot);
      auto w = co_await reactor_.wait(c.slot, 0, deadline);
      budget_.stop_waiting(c.slot);
      if (w == detail::wake::stop) throw stopping{};
      if (w == detail::wake::timeout) {
        throw violation(what + " waited for the store's buffer (" + std::to_string(budget_.used()) +
                        " of " + std::to_string(budget_.cap()) +
                        " bytes held by other connections) past the io timeout");
      }
    }
    held.add(n);
    buffered_bytes_ = budget_.used();
  }

  static steady::time_point deadline_after(std::uint64_t ms) {
    constexpr std::uint64_t ten_years = 10ull * 365 * 24 * 3600 * 1000;
    return steady::now() + std::chrono::milliseconds(std::min(ms, ten_years));
  }

  static std::string reply(status s) { return std::string(1, static_cast<char>(s)); }

  static std::string refusal(std::string_view message) {
    std::string body;
    detail::wire::writer(body).u8(static_cast<std::uint8_t>(status::error)).bytes32(message);
    return body;
  }

  /// Reserves, before a reply that copies the value at `key` is built, what
  /// that reply will hold until the client reads it. Returns false when the
  /// key is gone meanwhile. Loops because the value may change while it waits.
  detail::task<bool> reserve_value(connection& c, held_bytes& held, std::string_view key,
                                   std::uint64_t& reserved) {
    for (;;) {
      auto it = data_.find(key);
      if (it == data_.end()) co_return false;
      if (it->second.size() <= reserved) co_return true;
      const std::uint64_t more = it->second.size() - reserved;
      co_await reserve(c, held, more, io_deadline(),
                       "a reply of " + std::to_string(it->second.size()) + " bytes");
      reserved += more;
    }
  }

  detail::task<std::string> execute(connection& c, held_bytes& held, std::string_view body) {
    const auto& limits = options_.limits;
    detail::wire::reader r(body);
    auto code = r.u8("op");
    std::string out = reply(status::ok);
    detail::wire::writer w(out);
    switch (static_cast<op>(code)) {
      case op::set: {
        auto key = r.bytes32("key", limits.max_key_size);
        auto value = r.bytes32("value", limits.max_value_size);
        r.finish("set request");
        if (!store(key, value)) co_return over_capacity("set", key, value.size());
        break;
      }
      case op::get: {
        auto key = r.bytes32("key", limits.max_key_size);
        auto ms = r.u64("timeout");
        r.finish("get request");
        std::vector<std::string_view> keys{key};
        const auto deadline = deadline_after(ms);
        std::uint64_t reserved = 0;
        do {
          if (!co_await wait_for(c, held, keys, deadline)) co_return reply(status::timeout);
        } while (!co_await reserve_value(c, held, key, reserved));
        w.bytes32(data_.find(key)->second);
        break;
      }
      case op::add: {
        auto key = r.bytes32("key", limits.max_key_size);
        auto delta = r.i64("delta");
        r.finish("add request");
        std::int64_t current = 0;
        if (auto it = data_.find(key); it != data_.end()) {
          const std::string& text = it->second;
          auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), current);
          if (ec != std::errc() || end != text.data() + text.size()) {
            co_return refusal("add(\"" + std::string(key) +
                              "\"): the key holds a value that is not an integer");
          }
        }
        std::int64_t next = 0;
        if (__builtin_add_overflow(current, delta, &next)) {
          co_return refusal("add(\"" + std::string(key) + "\"): the counter would overflow");
        }
        if (!store(key, std::to_string(next))) co_return over_capacity("add", key, 20);
        w.i64(next);
        break;
      }
      case op::compare_set: {
        auto key = r.bytes32("key", limits.max_key_size);
        auto expected = r.bytes32("expected value", limits.max_value_size);
        auto desired = r.bytes32("desired value", limits.max_value_size);
        r.finish("compare_set request");
        std::uint64_t reserved = 0;
        (void)co_await reserve_value(c, held, key, reserved);  // the reply may copy the value
        auto it = data_.find(key);
        bool matches = it == data_.end() ? expected.empty() : it->second == expected;
        if (matches && !store(key, desired))
          co_return over_capacity("compare_set", key, desired.size());
        it = data_.find(key);
        w.bytes32(it == data_.end() ? std::string_view{} : std::string_view(it->second));
        break;
      }
      case op::wait: {
        auto keys = detail::wire::read_keys(r, limits);
        auto ms = r.u64("timeout");
        r.finish("wait request");
        if (!co_await wait_for(c, held, keys, deadline_after(ms))) co_return reply(status::timeout);
        break;
      }
      case op::check: {
        auto keys = detail::wire::read_keys(r, limits);
        r.finish("check request");
        bool all = true;
        for (auto k : keys) all = all && data_.contains(k);
        w.u8(all ? 1 : 0);
        break;
      }
      case op::erase: {
        auto key = r.bytes32("key", limits.max_key_size);
        r.finish("erase request");
        if (auto it = data_.find(key); it != data_.end()) {
          stored_bytes_ -= it->first.size() + it->second.size();
          data_.erase(it);
          w.u8(1);
        } else {
          w.u8(0);
        }
        break;
      }
      case op::num_keys:
        r.finish("num_keys request");
        w.u64(data_.size());
        break;
      case op::ping: r.finish("ping request"); break;
      default: throw violation("unknown operation " + std::to_string(code));
    }
    co_return out;
  }

  std::string over_capacity(const char* what, std::string_view key, std::size_t value_size) const {
    return refusal(std::string(what) + "(\"" + std::string(key.substr(0, 200)) + "\") of " +
                   std::to_string(value_size) + " bytes: the store holds " +
                   std::to_string(stored_bytes_.load()) + " bytes and its cap is " +
                   std::to_string(options_.limits.max_stored_bytes) +
                   " (store_limits::max_stored_bytes, DTRAIN_STORE_MAX_BYTES)");
  }

  /// Sets key to value and wakes its waiters; false, changing nothing, when
  /// the stored bytes would pass their cap.
  bool store(std::string_view key, std::string_view value) {
    auto it = data_.find(key);
    const std::uint64_t before = it == data_.end() ? 0 : key.size() + it->second.size();
    const std::uint64_t after = stored_bytes_ - before + key.size() + value.size();
    if (after > options_.limits.max_stored_bytes && after > stored_bytes_) return false;
    stored_bytes_ = after;
    if (it != data_.end()) {
      it->second.assign(value);
    } else {
      data_.emplace(std::string(key), std::string(value));
    }
    if (auto w = key_waiters_.find(key); w != key_waiters_.end()) {
      auto waiters = std::move(w->second);
      key_waiters_.erase(w);
      for (connection* c : waiters) reactor_.wake_up(c->slot);
    }
    return true;
  }

  /// Waits until every key exists (true) or the deadline passes (false).
  /// Watches the connection meanwhile: a client that goes away is cleaned up.
  detail::task<bool> wait_for(connection& c, held_bytes& held,
                              const std::vector<std::string_view>& keys,
                              steady::time_point deadline) {
    bool charged = false;
    for (;;) {
      std::vector<std::string> missing;
      for (auto k : keys) {
        if (!data_.contains(k)) missing.emplace_back(k);
      }
      if (missing.empty()) co_return true;
      if (!charged) {
        // A wait holds a copy of each missing key twice (here and in key_waiters_).
        std::uint64_t bytes = 0;
        for (const auto& k : missing) bytes += 2 * (k.size() + 64);
        co_await reserve(c, held, bytes, io_deadline(),
                         "a wait on " + std::to_string(missing.size()) + " keys");
        charged = true;
        continue;  // keys may have been set while it waited for the budget
      }
      for (const auto& k : missing) key_waiters_[k].push_back(&c);
      ++waiting_;
      auto w = co_await reactor_.wait(c.slot, EPOLLIN | EPOLLRDHUP, deadline);
      --waiting_;
      for (const auto& k : missing) {
        auto it = key_waiters_.find(k);
        if (it == key_waiters_.end()) continue;
        std::erase(it->second, &c);
        if (it->second.empty()) key_waiters_.erase(it);
      }
      switch (w) {
        case detail::wake::event: continue;
        case detail::wake::timeout: co_return false;
        case detail::wake::stop: throw stopping{};
        case detail::wake::io: {
          char byte;
          ssize_t n = ::recv(c.fd.get(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
          if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
            log("client " + c.peer + " disconnected while waiting for \"" + missing.front() + "\"");
            throw peer_gone{};
          }
          if (n > 0) throw violation("sent a new request while its wait was pending");
          continue;
        }
        case detail::wake::none: continue;
      }
    }
  }

  std::string address_;
  store_options options_;
  int port_ = 0;
  detail::reactor reactor_;
  detail::unique_fd listen_;
  detail::wait_slot accept_slot_;
  std::unordered_map<connection*, std::unique_ptr<connection>> connections_;
  std::vector<connection*> finished_;
  std::list<connection*> unproven_;  // connections before their handshake, oldest first
  // Transparent hashing: look keys up by string_view without copying them.
  struct key_hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept {
      return std::hash<std::string_view>{}(s);
    }
  };
  std::unordered_map<std::string, std::string, key_hash, std::equal_to<>> data_;
  std::unordered_map<std::string, std::vector<connection*>, key_hash, std::equal_to<>> key_waiters_;
  detail::byte_budget budget_;
  std::size_t connection_cap_;
  detail::spare_descriptor spare_;
  detail::rejection_log rejections_;
  std::atomic<std::size_t> connection_count_{0};
  std::atomic<std::uint64_t> refused_{0};
  std::atomic<std::uint64_t> closed_idle_{0};
  std::atomic<std::uint64_t> stored_bytes_{0};
  std::atomic<std::uint64_t> buffered_bytes_{0};
  std::atomic<std::size_t> waiting_{0};
  std::atomic<std::uint64_t> closed_for_cause_{0};
  std::thread thread_;
};

}  // namespace dtrain
