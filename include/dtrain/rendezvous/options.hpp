#pragma once
/// @file
/// Options of the rendezvous store, server and client alike. Each default is
/// defined here once; each can be overridden by the option and by an
/// environment variable (store_options::from_env).

#include <dtrain/config.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/variables.hpp>
#include <dtrain/error.hpp>

#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace dtrain {

/// Default for every blocking store operation (connect, get, wait, barrier),
/// as c10d's store: 300 s. Environment: DTRAIN_STORE_TIMEOUT (seconds).
inline constexpr std::chrono::milliseconds default_store_timeout{300'000};

/// How long the server gives a new connection to complete its handshake, and
/// a started request frame to arrive whole. Environment: DTRAIN_STORE_IO_TIMEOUT.
inline constexpr std::chrono::milliseconds default_store_io_timeout{30'000};

/// How long the server keeps a connection that sends nothing after its
/// handshake, unless it is in a get / wait it asked for. A client reconnects
/// by itself on its next request. Environment: DTRAIN_STORE_IDLE_TIMEOUT.
inline constexpr std::chrono::milliseconds default_store_idle_timeout{600'000};

/// How often a rank that waits at rendezvous says so: a client still trying
/// to connect, and rank 0 waiting for the others to join (who has, who has
/// not). Environment: DTRAIN_RENDEZVOUS_PROGRESS (seconds).
inline constexpr std::chrono::milliseconds default_rendezvous_progress_interval{5'000};

/// Wire and resource limits, checked before anything is allocated. The
/// defaults fit a 10,000-rank job (two connections per rank, one per agent,
/// a few KiB stored per rank) and bound what a flood can make the server hold
/// to about max_stored_bytes + max_buffered_bytes.
struct store_limits {
  std::uint32_t max_key_size = 4096;          ///< bytes per key
  std::uint32_t max_value_size = 64u << 20;   ///< bytes per value (64 MiB)
  std::uint32_t max_keys_per_request = 4096;  ///< keys in one wait/check: a connection's waiters
  std::uint32_t max_token_size = 1024;        ///< bytes of the shared token
  /// Open connections; more are accepted and closed at once, and the server
  /// also keeps below the process's descriptor limit (RLIMIT_NOFILE), which it
  /// raises towards the hard limit. Environment: DTRAIN_STORE_MAX_CONNECTIONS.
  std::uint32_t max_connections = 32768;
  /// Keys and values held; a set beyond it is refused with an error reply.
  /// Environment: DTRAIN_STORE_MAX_BYTES.
  std::uint64_t max_stored_bytes = std::uint64_t{1} << 30;
  /// Request and reply bytes held for all connections together (a frame in
  /// flight, a reply not yet read, the keys of a pending wait). A connection
  /// that would pass it waits, at most the io timeout, for others to finish.
  std::uint64_t max_buffered_bytes = std::uint64_t{256} << 20;

  /// The largest request frame these limits allow; a larger length prefix
  /// closes the connection before a byte of it is buffered.
  [[nodiscard]] std::uint64_t max_frame_size() const noexcept;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::uint64_t store_limits::max_frame_size() const noexcept {
  std::uint64_t keys = std::uint64_t{max_keys_per_request} * (4u + max_key_size);
  std::uint64_t one = 2u * (4u + std::uint64_t{max_value_size}) + 4u + max_key_size;
  return 64u + (keys > one ? keys : one);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Options of a store server or client. Aggregate: use designated initialisers,
/// e.g. `{.timeout = 30s, .token = "secret"}`.
struct store_options {
  /// Default timeout of connect, get, wait and barrier.
  std::chrono::milliseconds timeout = default_store_timeout;
  /// Server: limit for a handshake or a started frame. Client: how long a
  /// reply may take beyond the operation's own timeout before the server is
  /// presumed dead.
  std::chrono::milliseconds io_timeout = default_store_io_timeout;
  /// Server: how long a connection may stay silent between requests.
  std::chrono::milliseconds idle_timeout = default_store_idle_timeout;
  /// Shared secret; the server serves nothing to a client whose token differs.
  /// Environment: DTRAIN_STORE_TOKEN. dtrain::run and the node agent set one
  /// for every job (see docs/launching.md, "Security"); empty here means none.
  std::string token{};
  store_limits limits{};
  /// Server: where it reports closed connections and their reasons. Empty:
  /// one line on stderr each.
  std::function<void(std::string_view)> log{};
  /// Client and rendezvous: how often a wait that is still going on is
  /// reported; zero (or less) reports nothing.
  std::chrono::milliseconds progress_interval = default_rendezvous_progress_interval;
  /// Client and rendezvous: where such a report goes ("still trying to connect
  /// to the store at HOST:PORT ..."). Empty: one line on stderr, `dtrain: <text>`.
  std::function<void(std::string_view)> progress{};

  /// These options with DTRAIN_STORE_TIMEOUT, DTRAIN_STORE_IO_TIMEOUT,
  /// DTRAIN_RENDEZVOUS_PROGRESS and DTRAIN_STORE_TOKEN from `env` applied on
  /// top (and DTRAIN_STORE_MAX_CONNECTIONS, DTRAIN_STORE_MAX_BYTES): the environment wins, as
  /// NCCL's does, so an operator can tune a job without rebuilding it. Throws
  /// config_error naming the variable on a malformed value.
  [[nodiscard]] store_options with_env(const environment& env) const;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE store_options store_options::with_env(const environment& env) const {
  store_options out = *this;
  if (auto t = detail::read_seconds(env, store_timeout_variable)) out.timeout = *t;
  if (auto t = detail::read_seconds(env, store_io_timeout_variable)) out.io_timeout = *t;
  if (auto t = detail::read_seconds(env, store_idle_timeout_variable)) out.idle_timeout = *t;
  if (auto t = detail::read_seconds(env, rendezvous_progress_variable)) {
    out.progress_interval = *t;
  }
  if (auto n = detail::read_int(env, store_max_connections_variable)) {
    if (n->value < 1) throw config_error(n->origin + " must be at least 1");
    out.limits.max_connections = static_cast<std::uint32_t>(n->value);
  }
  if (auto n = detail::read_int(env, store_max_bytes_variable)) {
    if (n->value < 1) throw config_error(n->origin + " must be at least 1");
    out.limits.max_stored_bytes = static_cast<std::uint64_t>(n->value);
  }
  if (auto secret = env.get(store_token_variable)) out.token = std::string(*secret);
  if (out.token.size() > out.limits.max_token_size) {
    throw config_error(std::string(store_token_variable) + " / token is " +
                       std::to_string(out.token.size()) + " bytes; the limit is " +
                       std::to_string(out.limits.max_token_size));
  }
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

namespace detail {

/// A duration in whole seconds, as progress reports count them: "12 s".
inline std::string whole_seconds(std::chrono::milliseconds t) {
  return std::to_string(std::chrono::duration_cast<std::chrono::seconds>(t).count()) + " s";
}

/// Hands a progress report to `sink` (store_options::progress), or prints it
/// on stderr as `dtrain: <text>` when there is none.
DTRAIN_DETAIL_INLINE void say(const std::function<void(std::string_view)>& sink,
                              const std::string& text);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void say(const std::function<void(std::string_view)>& sink,
                              const std::string& text) {
  if (sink) {
    sink(text);
  } else {
    std::fprintf(stderr, "dtrain: %s\n", text.c_str());
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail

}  // namespace dtrain
