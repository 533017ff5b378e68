#pragma once
/// @file
/// Desync and hang diagnostics. When a collective times out or fails, or a
/// user sends SIGUSR1 to a rank (or to its node agent, which forwards it),
/// every live rank publishes its communicator's ring of last collectives
/// through the store; the rank that asked gathers them for a bounded time and
/// one rank prints one table naming the rank that is behind, the collective
/// it is missing, mismatched calls, and the ranks that did not answer. With a
/// diagnostics directory, each rank also writes its ring there whenever it
/// takes part in a round (diagnostics/flight.hpp): `dtrun --flight-records
/// DIR` prints the same table after the job and its store are gone.

#include <dtrain/config.hpp>
#include <dtrain/detail/sys.hpp>
#include <dtrain/diagnostics/desync.hpp>
#include <dtrain/diagnostics/flight.hpp>
#include <dtrain/diagnostics/ring.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/variables.hpp>
#include <dtrain/error.hpp>
#include <dtrain/launch/protocol.hpp>
#include <dtrain/rendezvous/client.hpp>
#include <dtrain/rendezvous/options.hpp>
#include <dtrain/rendezvous/store.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

namespace dtrain {

/// Options of the diagnostics every rank runs. Aggregate; each field also has
/// an environment variable, which wins.
struct diagnostics_options {
  /// Run the diagnostics thread and catch SIGUSR1. Environment: DTRAIN_DIAGNOSTICS=0 turns it off.
  bool enabled = true;
  /// How long the rank that asked waits for the other rings before it prints
  /// without them (their ranks are then named as not answering).
  /// Environment: DTRAIN_DIAGNOSTICS_WAIT (seconds).
  std::chrono::milliseconds wait{5000};
  /// How often each rank's thread looks for a request in the store.
  std::chrono::milliseconds poll{200};
  /// A directory where each rank writes its flight record
  /// (dtrain_flight_rank<R>.bin: its rings, why and when) whenever it takes
  /// part in a round, even when the store is gone; `dtrun --flight-records
  /// DIR` prints the round's table from them. Empty: none. It must exist.
  /// Environment: DTRAIN_DIAGNOSTICS_DIR.
  std::string dir;

  [[nodiscard]] diagnostics_options with_env(const environment& env) const;
};

namespace detail {

/// The eventfd that SIGUSR1 wakes (-1: none). A plain atomic int, so the
/// handler only loads it and writes 8 bytes: both async-signal-safe.
inline std::atomic<int> diagnostics_signal_fd{-1};

DTRAIN_DETAIL_INLINE void on_diagnostics_signal(int);

/// One rank's part: a thread that publishes this rank's ring whenever a round
/// is asked for, and explain(), which asks for one and returns its summary.
/// Owns its own store connection: the context's may be blocked in a long wait.
class rank_diagnostics {
 public:
  /// Connects to the store at host:port (keys under `prefix`), starts the
  /// thread and catches SIGUSR1 until destroyed. `name` says which
  /// communicator the ring is ("gloo"); `node` is the rank's node name and
  /// `note` what the training adds (DDP's straggler window), for its flight
  /// record. Throws what connecting throws, and config_error when
  /// options.dir is not a directory this rank can write.
  rank_diagnostics(const std::string& host, int port, store_options store, std::string prefix,
                   int rank, int size, std::shared_ptr<collective_ring> ring, std::string name,
                   diagnostics_options options, std::string node,
                   std::shared_ptr<const flight_note> note = nullptr);
  rank_diagnostics(const rank_diagnostics&) = delete;
  rank_diagnostics& operator=(const rank_diagnostics&) = delete;
  /// Stops the thread: at most one store operation, each bounded by the wait.
  /// SIGUSR1 reaches the newest instance; instances end in reverse order
  /// (one per context), and one that is not the newest leaves the signal alone.
  ~rank_diagnostics();

  /// Whether a collective of this rank failed or timed out (the ring says so):
  /// only such a failure is worth a round; a store timeout, say, is not.
  [[nodiscard]] bool collective_failed() const;

  /// Asks every rank for its ring (joining the round another rank opened, if
  /// one is open), waits for them at most options.wait, and returns the
  /// analysis' summary line; one rank of the round prints the whole table on
  /// stderr. `reason` goes in the table's header ("a timeout on rank 0").
  /// Never throws: a store that is gone makes the summary say so.
  std::string explain(const std::string& reason) noexcept;

 private:
  static store_options bounded(store_options o, std::chrono::milliseconds wait);

  void wake() noexcept;

  // The open round, or a new one; one rank opens each round, the others join it.
  std::int64_t join_round();

  // Publishes this rank's rings for `round` (its flight record is written
  // before, once: by explain() with its reason, by serve() for another's round).
  void publish(std::int64_t round);

  // Writes the flight record, when a directory is set (`reason`: why this
  // rank asked; empty when it answers another's round); a failure is said once.
  void record(const std::string& reason) noexcept;

  // Every rank's ring that arrives within the wait; the others did not answer.
  std::vector<rank_publication> gather(std::int64_t round);

  // Publishes the ring for every new round; explains on SIGUSR1. A store that
  // stops answering (its host is gone) ends the polling, not the process.
  void serve();

  store_client client_;
  prefix_store<store_client> store_;
  int rank_;
  int size_;
  std::shared_ptr<collective_ring> ring_;
  std::string name_;
  diagnostics_options options_;
  std::string node_;
  std::shared_ptr<const flight_note> note_;
  std::mutex record_mutex_;  // the explaining thread and the serving one both write
  bool record_failed_ = false;
  int wake_ = -1;
  int previous_fd_ = -1;
  struct sigaction previous_action_ {};
  std::atomic<bool> stopping_{false};
  std::atomic<std::int64_t> published_{0};
  std::thread thread_;  // last: starts once everything above exists
};

}  // namespace detail
}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/diagnostics-inl.hpp>
#endif
