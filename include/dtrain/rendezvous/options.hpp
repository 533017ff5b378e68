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

namespace detail {

/// A duration in whole seconds, as progress reports count them: "12 s".
inline std::string whole_seconds(std::chrono::milliseconds t) {
  return std::to_string(std::chrono::duration_cast<std::chrono::seconds>(t).count()) + " s";
}

/// Hands a progress report to `sink` (store_options::progress), or prints it
/// on stderr as `dtrain: <text>` when there is none.
DTRAIN_DETAIL_INLINE void say(const std::function<void(std::string_view)>& sink,
                              const std::string& text);

}  // namespace detail

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/rendezvous/options-inl.hpp>
#endif
