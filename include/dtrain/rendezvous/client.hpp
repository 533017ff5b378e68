#pragma once
/// @file
/// store_client: a blocking client of store_server, safe to share between
/// threads (requests are serialised on one connection).

#include <dtrain/config.hpp>
#include <dtrain/detail/sys.hpp>
#include <dtrain/error.hpp>
#include <dtrain/rendezvous/options.hpp>
#include <dtrain/rendezvous/protocol.hpp>
#include <dtrain/rendezvous/socket.hpp>
#include <dtrain/rendezvous/store.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>

namespace dtrain {

/// A connection to a store_server. Every blocking call has a timeout: the
/// options' `timeout` unless the call takes one. Throws timeout_error when it
/// expires (naming what it waited for and how long), rendezvous_error when the
/// server cannot be reached, refuses the client, or goes away (token_error
/// when it refuses the client's token), and config_error at once when its
/// host name does not resolve (a temporary resolver failure, EAI_AGAIN, is
/// retried for 5 s first).
///
/// Thread-safe, but requests on one client run one at a time: a thread blocked
/// in get / wait / barrier holds the connection, so a thread that must set the
/// awaited key meanwhile needs a store_client of its own. A get or wait that
/// the server ends at its timeout leaves the client usable; after a reply that
/// never came or a lost connection it is not (the reply stream cannot be
/// trusted): make a new one. The one exception: a connection the server closed
/// because it was idle (store_options::idle_timeout) is reopened, once, by the
/// next request; the server closes only connections with no request in flight.
/// A closed connection is a lost store, not an idle one, when nothing listens
/// at the address any more (its process ended) or another server does (a new
/// instance, which holds none of the old one's keys): the request fails at once.
class store_client {
 public:
  using milliseconds = std::chrono::milliseconds;

  /// Connects to host:port, retrying with backoff until `options.timeout`:
  /// workers often start before the server does. While it retries it says so
  /// every `options.progress_interval` (options.progress).
  store_client(std::string host, int port, store_options options = {})
      : host_(std::move(host)), port_(port), options_(std::move(options)) {
    connect();
  }

  [[nodiscard]] std::string endpoint() const { return detail::endpoint_text(host_, port_); }
  [[nodiscard]] const store_options& options() const noexcept { return options_; }

  /// Sets key to value, waking everyone waiting for the key.
  void set(std::string_view key, std::string_view value);

  /// The value of `key`, waiting until it exists. Throws timeout_error naming
  /// the key and how long it waited; never returns a sentinel.
  [[nodiscard]] std::string get(std::string_view key) { return get(key, options_.timeout); }
  [[nodiscard]] std::string get(std::string_view key, milliseconds timeout);

  /// Adds `delta` to the integer at key (0 when absent) and returns the new value.
  std::int64_t add(std::string_view key, std::int64_t delta);

  /// Sets key to `desired` if it holds `expected` (a missing key matches an
  /// empty `expected`). Returns the value afterwards; empty if the key does not exist.
  std::string compare_set(std::string_view key, std::string_view expected,
                          std::string_view desired);

  /// Waits until every key exists.
  void wait(std::span<const std::string> keys) { wait(keys, options_.timeout); }
  void wait(std::span<const std::string> keys, milliseconds timeout);

  /// Whether every key exists, without waiting.
  [[nodiscard]] bool check(std::span<const std::string> keys);

  /// Removes key; returns whether it existed.
  bool erase(std::string_view key);

  /// Sets key to value for as long as this client's connection lives: the
  /// server erases it when the connection closes, however it closes (the
  /// process ended or was killed, its host went away). Others check() it to
  /// learn at once that this client is gone. A connection reopened after an
  /// idle close leases its keys again, but not a key another client has set
  /// since (it is theirs now, and no longer this client's lease). At most
  /// detail::wire::max_leases_per_connection keys (the server refuses more).
  void lease(std::string_view key, std::string_view value);

  /// Number of keys in the store (all prefixes).
  [[nodiscard]] std::int64_t num_keys();

  /// Blocks until `count` callers have entered barrier `name`. A name can be
  /// reused: each group of `count` arrivals is one generation. On timeout the
  /// timeout_error says how many had arrived.
  void barrier(std::string_view name, int count) { barrier(name, count, options_.timeout); }
  void barrier(std::string_view name, int count, milliseconds timeout);

  /// How many requests this client has sent (each operation above is one,
  /// the handshake none): what a loop costs the store's server, for tests and
  /// diagnostics.
  [[nodiscard]] std::uint64_t requests() const noexcept {
    return requests_.load(std::memory_order_relaxed);
  }

  /// The instance of the server this client joined, as its handshake said:
  /// drawn at random when the server starts, so two clients with the same
  /// instance meet at the same store. A reconnection to a server with another
  /// (restarted at the same address) fails: it holds none of this client's keys.
  [[nodiscard]] std::uint64_t instance() const noexcept { return instance_; }

  /// Round trip without effect; a liveness check.
  void ping() { call(begin(detail::wire::op::ping), milliseconds(0), "ping()"); }

 private:
  static std::string begin(detail::wire::op o) { return std::string(1, static_cast<char>(o)); }

  static std::uint64_t as_ms(milliseconds t) {
    return static_cast<std::uint64_t>(std::max<std::int64_t>(t.count(), 0));
  }

  static std::string seconds(milliseconds t);

  static std::string key_list(std::span<const std::string> keys);

  static std::string lease_body(std::string_view key, std::string_view value);
  // The request of compare_set(), which reopen() sends too.
  static std::string compare_set_body(std::string_view key, std::string_view expected,
                                      std::string_view desired);

  using steady = std::chrono::steady_clock;

  /// How long a temporary resolver failure (EAI_AGAIN) is retried.
  static constexpr milliseconds resolver_retry{5'000};

  void connect() { connect(options_.timeout); }

  // Connects within `patience`, knocking again while the server is not up;
  // with `until_refused`, gives up (rendezvous_error) the first time a
  // connection is refused: nothing listens there any more.
  void connect(milliseconds patience, bool until_refused = false);

  // The handshake; returns why the connection was lost during it (empty on
  // success). A refusal (token, version) throws: knocking again cannot help.
  std::string try_handshake(steady::time_point deadline);

  // One attempt; returns the reason it failed, empty on success, the
  // resolver's error code in `resolver_rc` when the name did not resolve, and
  // in `refused` whether the host refused the connection (nothing listens).
  std::string try_connect(steady::time_point deadline, int& resolver_rc, bool& refused);

  static int remaining_ms(steady::time_point deadline);

  void handshake(steady::time_point connect_deadline);

  // Sends a request and returns the reply payload; nullopt when the server
  // reports that the wait timed out.
  std::optional<std::string> call(const std::string& body, milliseconds server_wait,
                                  const std::string& what);

  [[nodiscard]] bool closed_by_server() const;

  // A new connection within the io timeout; the old one is dropped unread.
  void reopen(const std::string& what);
  // lease()'s keys and values, leased again by reopen() (those nobody took).
  std::vector<std::pair<std::string, std::string>> leases_;

  std::optional<std::string> exchange(const std::string& body, milliseconds server_wait,
                                      const std::string& what);

  void send_all(std::string_view data, steady::time_point deadline, const std::string& what);

  std::string recv_exact(std::size_t size, steady::time_point deadline, const std::string& what);

  void await(short events, steady::time_point deadline, const std::string& what);

  [[noreturn]] void lost(const std::string& what, const std::string& why);

  std::string host_;
  int port_;
  store_options options_;
  std::mutex mutex_;
  detail::unique_fd fd_;
  bool broken_ = false;
  bool refused_ = false;        // the server answered the handshake with a refusal
  std::uint64_t instance_ = 0;  // the server's, from the first handshake (0: none yet)
  bool reply_started_ = false;  // a byte of the current reply (or the handshake's) arrived
  steady::time_point last_reply_ = steady::now();
  std::atomic<std::uint64_t> requests_{0};
};

// The client is a store, alone and under a prefix (checked here, next to it:
// the concept's header does not include an implementation).
static_assert(store<store_client>);
static_assert(store<prefix_store<store_client>>);

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/rendezvous/client-inl.hpp>
#endif
