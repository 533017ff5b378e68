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
#include <dtrain/rendezvous/security.hpp>
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

  // The handshake's answer: a status and the server's protocol version, and
  // when it is ok this server's instance. (A function, not a lambda: a
  // coroutine frame that holds a lambda's type trips -Wsubobject-linkage
  // where the body is compiled out of line.)
  [[nodiscard]] std::string reply(status s) const {
    std::string body;
    detail::wire::writer w(body);
    w.u8(static_cast<std::uint8_t>(s)).u16(detail::wire::version);
    if (s == status::ok) w.u64(instance_);
    return body;
  }

  // ---- requests: read one, hand it to its operation's handler, write the reply ----

  detail::task<bool> serve_one(connection& c);

  std::string address_;
  store_options options_;
  int port_ = 0;
  // Drawn when it starts; its handshake tells its clients (wire::version).
  std::uint64_t instance_ = detail::new_store_instance();
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

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/rendezvous/server-inl.hpp>
#endif
