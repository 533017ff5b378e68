#pragma once
/// @file
/// The non-template bodies of dtrain/rendezvous/server.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/rendezvous/server.hpp, not this file.

#include <dtrain/rendezvous/server.hpp>

namespace dtrain {

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
        (err == EADDRINUSE ? " (another store or program holds the port: pick another "
                             "MASTER_PORT; dtrun and dtrain::run take a free one on one node "
                             "when none is given)"
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
  operations_.release(c.io);  // its leased keys end with it
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
  if (!detail::same_secret(token, options_.token)) {
    co_await c.io.write_all(reply(status::bad_token));
    throw violation("wrong token (DTRAIN_STORE_TOKEN differs)");
  }
  co_await c.io.write_all(reply(status::ok));
  c.authenticated = true;
  if (std::exchange(c.listed, false)) unproven_.erase(c.unproven);
  co_return true;
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

}  // namespace dtrain
