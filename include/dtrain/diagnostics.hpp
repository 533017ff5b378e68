#pragma once
/// @file
/// Desync and hang diagnostics. When a collective times out or fails, or a
/// user sends SIGUSR1 to a rank (or to its node agent, which forwards it),
/// every live rank publishes its communicator's ring of last collectives
/// through the store; the rank that asked gathers them for a bounded time and
/// one rank prints one table naming the rank that is behind, the collective
/// it is missing, mismatched calls, and the ranks that did not answer.

#include <dtrain/config.hpp>
#include <dtrain/detail/sys.hpp>
#include <dtrain/diagnostics/desync.hpp>
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

  [[nodiscard]] diagnostics_options with_env(const environment& env) const;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE diagnostics_options
diagnostics_options::with_env(const environment& env) const {
  diagnostics_options out = *this;
  if (auto on = detail::read_flag(env, diagnostics_variable)) out.enabled = *on;
  if (auto t = detail::read_seconds(env, diagnostics_wait_variable)) out.wait = *t;
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

namespace detail {

/// The eventfd that SIGUSR1 wakes (-1: none). A plain atomic int, so the
/// handler only loads it and writes 8 bytes: both async-signal-safe.
inline std::atomic<int> diagnostics_signal_fd{-1};

DTRAIN_DETAIL_INLINE void on_diagnostics_signal(int);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void on_diagnostics_signal(int) {
  const int saved = errno;
  const int fd = diagnostics_signal_fd.load();
  const std::uint64_t one = 1;
  if (fd >= 0) (void)!::write(fd, &one, sizeof one);
  errno = saved;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// One rank's part: a thread that publishes this rank's ring whenever a round
/// is asked for, and explain(), which asks for one and returns its summary.
/// Owns its own store connection: the context's may be blocked in a long wait.
class rank_diagnostics {
 public:
  /// Connects to the store at host:port (keys under `prefix`), starts the
  /// thread and catches SIGUSR1 until destroyed. `name` says which
  /// communicator the ring is ("gloo"). Throws what connecting throws.
  rank_diagnostics(const std::string& host, int port, store_options store, std::string prefix,
                   int rank, int size, std::shared_ptr<collective_ring> ring, std::string name,
                   diagnostics_options options);
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

  void publish(std::int64_t round);

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
  int wake_ = -1;
  int previous_fd_ = -1;
  struct sigaction previous_action_ {};
  std::atomic<bool> stopping_{false};
  std::atomic<std::int64_t> published_{0};
  std::thread thread_;  // last: starts once everything above exists
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE rank_diagnostics::rank_diagnostics(
    const std::string& host, int port, store_options store, std::string prefix, int rank, int size,
    std::shared_ptr<collective_ring> ring, std::string name, diagnostics_options options)
    : client_(host, port, bounded(std::move(store), options.wait)),
      store_(client_, std::move(prefix)),
      rank_(rank),
      size_(size),
      ring_(std::move(ring)),
      name_(std::move(name)),
      options_(options) {
  wake_ = DTRAIN_SYSCALL(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  previous_fd_ = diagnostics_signal_fd.exchange(wake_);
  struct sigaction sa {};
  sa.sa_handler = on_diagnostics_signal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGUSR1, &sa, &previous_action_);
  thread_ = std::thread([this] { serve(); });
}

DTRAIN_DETAIL_INLINE rank_diagnostics::~rank_diagnostics() {
  int mine = wake_;
  if (diagnostics_signal_fd.compare_exchange_strong(mine, previous_fd_)) {
    ::sigaction(SIGUSR1, &previous_action_, nullptr);
  }
  stopping_ = true;
  wake();
  thread_.join();
  ::close(wake_);
}

DTRAIN_DETAIL_INLINE bool rank_diagnostics::collective_failed() const {
  for (const auto& entry : ring_->snapshot_all()) {
    for (const call_record& c : entry.second) {
      if (c.state == call_state::failed || c.state == call_state::timed_out) return true;
    }
  }
  return false;
}

DTRAIN_DETAIL_INLINE std::string rank_diagnostics::explain(const std::string& reason) noexcept {
  try {
    const std::int64_t round = join_round();
    const std::string reason_key = diagnostics_keys::of(round, "reason");
    const std::string why = wire::decode_text(
        "store key " + store_.prefix() + reason_key,
        store_.compare_set(reason_key, "", wire::encode_text(reason)), "a diagnostics reason");
    publish(round);
    const desync_report report = analyse_job(gather(round));
    const std::string header = "collective diagnostics, round " + std::to_string(round) +
                               ", after " + why + " (" + name_ + ", " + std::to_string(size_) +
                               " ranks; printed by rank " + std::to_string(rank_) + ")";
    const std::string table = format_report(header, report);
    const std::string closed = diagnostics_keys::of(round, "closed");
    const std::string me = wire::encode_int(rank_);
    if (store_.compare_set(diagnostics_keys::of(round, "printer"), "", me) == me) {
      std::fputs(table.c_str(), stderr);
      std::fflush(stderr);
      store_.set(closed, present_value());
    } else {
      // This rank may exit next, and a launcher stop the others: not before the table is out.
      store_.wait(std::span<const std::string>(&closed, 1), options_.wait);
    }
    return report.summary;
  } catch (const std::exception& e) {
    return std::string("no diagnostics: ") + e.what();
  }
}

DTRAIN_DETAIL_INLINE store_options rank_diagnostics::bounded(store_options o,
                                                             std::chrono::milliseconds wait) {
  o.timeout = std::min(o.timeout, wait);
  o.io_timeout = std::min(o.io_timeout, wait);
  return o;
}

DTRAIN_DETAIL_INLINE void rank_diagnostics::wake() noexcept {
  const std::uint64_t one = 1;
  (void)!::write(wake_, &one, sizeof one);
}

DTRAIN_DETAIL_INLINE std::int64_t rank_diagnostics::join_round() {
  const std::int64_t current = store_.add("round", 0);
  const std::string closed = diagnostics_keys::of(current, "closed");
  if (current > 0 && !store_.check(std::span<const std::string>(&closed, 1))) return current;
  const std::int64_t next = current + 1;
  const std::string me = wire::encode_int(rank_);
  if (store_.compare_set(diagnostics_keys::open(next), "", me) == me) {
    store_.add("round", 1);  // every rank's thread now publishes for it
  }
  return next;
}

DTRAIN_DETAIL_INLINE void rank_diagnostics::publish(std::int64_t round) {
  store_.set(diagnostics_keys::ring(round, rank_), encode_rings(ring_->snapshot_all()));
  published_ = std::max(published_.load(), round);
}

DTRAIN_DETAIL_INLINE std::vector<rank_publication> rank_diagnostics::gather(std::int64_t round) {
  std::vector<std::string> keys;
  for (int r = 0; r < size_; ++r) keys.push_back(diagnostics_keys::ring(round, r));
  try {
    store_.wait(keys, options_.wait);
  } catch (const timeout_error&) {
    // Some rank is silent: analysed as such below.
  }
  std::vector<rank_publication> ranks;
  for (int r = 0; r < size_; ++r) {
    rank_publication p{r, false, {}};
    const std::string& key = keys[static_cast<std::size_t>(r)];
    if (store_.check(std::span<const std::string>(&key, 1))) {
      if (auto rings = decode_rings(store_.get(key))) {
        p.answered = true;
        p.rings = std::move(*rings);
      }
    }
    ranks.push_back(std::move(p));
  }
  return ranks;
}

DTRAIN_DETAIL_INLINE void rank_diagnostics::serve() {
  pollfd p{wake_, POLLIN, 0};
  bool store_ok = true;
  while (!stopping_) {
    const int ready = ::poll(&p, 1, static_cast<int>(options_.poll.count()));
    if (stopping_) return;
    if (ready > 0) {
      std::uint64_t count = 0;
      (void)!::read(wake_, &count, sizeof count);
      if (!stopping_ && store_ok) {
        const std::string summary = explain("SIGUSR1 on rank " + std::to_string(rank_));
        std::fprintf(stderr, "[rank %d/%d] dtrain: SIGUSR1: %s\n", rank_, size_, summary.c_str());
        std::fflush(stderr);
      }
    }
    if (!store_ok) continue;
    try {
      const std::int64_t round = store_.add("round", 0);
      if (round > published_) publish(round);
    } catch (const std::exception&) {
      store_ok = false;
    }
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail
}  // namespace dtrain
