#pragma once
/// @file
/// `work`: the handle every asynchronous collective returns.

#include <dtrain/backend/types.hpp>
#include <dtrain/config.hpp>
#include <dtrain/diagnostics/ring.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/variables.hpp>
#include <dtrain/error.hpp>

#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

namespace dtrain {

/// Default limit for one collective to finish, as c10d's 10 minutes.
/// Environment: DTRAIN_COLLECTIVE_TIMEOUT (seconds).
inline constexpr std::chrono::milliseconds default_collective_timeout{600'000};

/// Options every communicator takes. Aggregate: use designated initialisers.
struct collective_options {
  /// What work::wait() without an argument allows.
  std::chrono::milliseconds timeout = default_collective_timeout;
  /// Before each collective, compare what every rank passed (operation, count,
  /// type, root) and report a mismatch instead of corrupting or hanging.
  /// Costs one small allgather per collective. Environment: DTRAIN_CHECK_COLLECTIVES=1.
  bool check = false;

  /// These options with DTRAIN_COLLECTIVE_TIMEOUT and DTRAIN_CHECK_COLLECTIVES applied on top.
  [[nodiscard]] collective_options with_env(const environment& env) const;
};

namespace detail {

/// What a collective is, kept as plain fields so the hot path builds no
/// strings; describe() formats it only when a message needs it.
struct collective_info {
  std::string_view collective;  ///< "allreduce"
  std::string_view engine;      ///< "mpi"
  int rank = 0;
  int size = 1;
  std::size_t count = 0;
  std::uint8_t type = 0;  ///< a dtype
  int op = -1;            ///< a reduce_op, or -1
  int root = -1;          ///< broadcast's root, or -1
};

/// "allreduce(sum, 1024 x float32) on rank 1 of 4 (mpi)"
DTRAIN_DETAIL_INLINE std::string describe(std::string_view what, std::string_view detail, int rank,
                                          int size, std::string_view engine);

DTRAIN_DETAIL_INLINE std::string describe(const collective_info& info);

// What a failure was about, put into words only when a message needs it: a
// text, a collective (described from its fields), or a function that says it.
inline std::string what_text(const std::string& text) { return text; }
inline std::string what_text(const char* text) { return text; }
inline std::string what_text(const collective_info& info) { return describe(info); }
template <class Describe>
requires std::is_invocable_r_v<std::string, const Describe&>
inline std::string what_text(const Describe& describe_it) { return describe_it(); }

/// The message of an exception, whatever its type.
DTRAIN_DETAIL_INLINE std::string message_of(const std::exception_ptr& e);

/// Why a communicator can no longer be used: its first failure. Recorded
/// without allocating, since the hooks that record it (a timeout's, abort())
/// are noexcept, and put into words only when a later call reports it. The
/// owner guards it (one communicator's lock).
class failure_cause {
 public:
  /// A failure that carries its message: an exception, or a text (built by
  /// the caller, where allocating may throw; moving it in does not allocate).
  void set(std::exception_ptr error) noexcept {
    if (!*this) error_ = std::move(error);
  }
  void set(std::string&& text) noexcept;
  /// Collective `call` ended as `how` (a string literal) says: "timed out".
  void set(const collective_info& call, const char* how) noexcept;
  /// `what` (a string literal) happened on `rank`: "abort() was called" on rank 1.
  void set(const char* what, int rank) noexcept;
  [[nodiscard]] explicit operator bool() const noexcept {
    return error_ || has_text_ || how_ != nullptr;
  }
  /// "allreduce(sum, 4 x float32) on rank 0 of 2 (mpi) timed out", the
  /// failure's message, or "abort() was called on rank 1"; empty when none.
  [[nodiscard]] std::string text() const;

 private:
  std::exception_ptr error_;
  std::string text_;
  bool has_text_ = false;
  collective_info call_{};
  const char* how_ = nullptr;
};

/// How a thread waits for work that others (a device, an engine's thread, a
/// peer) finish: spins first (a collective often ends within microseconds),
/// then yields, then sleeps: 20 us at first (an engine that progresses only
/// inside its test call, like MPI's, still gets polled often), `longest`
/// once the wait has gone on for a while.
struct backoff {
  std::chrono::microseconds longest{200};
  unsigned rounds = 0;
  void operator()() {
    ++rounds;
    if (rounds < 64) return;
    if (rounds < 256) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(rounds < 4096 ? std::chrono::microseconds(20) : longest);
  }
};

/// One outstanding collective, as a backend tracks it.
class work_state {
 public:
  explicit work_state(std::string description, std::chrono::milliseconds timeout)
      : description_(std::move(description)), timeout_(timeout) {}
  work_state(const collective_info& info, std::chrono::milliseconds timeout)
      : info_(info), timeout_(timeout) {}
  virtual ~work_state() = default;
  work_state(const work_state&) = delete;
  work_state& operator=(const work_state&) = delete;

  /// Makes progress; true once finished, successfully or not (see error()).
  virtual bool poll() = 0;

  /// Blocks until finished (true) or the deadline passes (false). The default
  /// keeps calling poll(), for engines that advance only inside their test
  /// call (MPI without a progress thread): a short spin, then yields, then
  /// sleeps (detail::backoff), so a long wait costs no core.
  /// Engines that finish on threads of their own (Gloo) override it to sleep
  /// on a condition instead.
  virtual bool wait_until(std::chrono::steady_clock::time_point deadline);
  /// A wait gave up: abort what the engine can abort, and mark the
  /// communicator unusable where it cannot.
  virtual void on_timeout() noexcept {}
  /// The rank gives up on this work before it ended (its owner fails, or is
  /// destroyed while an exception unwinds): abort what the engine can, now,
  /// so that waiting for it takes no timeout. The default does nothing (the
  /// wait stays bounded by the collective timeout).
  virtual void on_abandon() noexcept {}
  /// Engines on streams: makes `stream` wait, on the device, for this
  /// collective's end alone (an event recorded after it), not for what was
  /// enqueued after it; false where the engine cannot (then order after
  /// everything, the communicator's stream_wait()).
  virtual bool stream_wait(stream_handle /*stream*/) { return false; }

  [[nodiscard]] std::exception_ptr error() const noexcept { return error_; }
  /// The collective's fields (empty for work described by a text).
  [[nodiscard]] const collective_info& info() const noexcept { return info_; }
  [[nodiscard]] const std::string& description() const;
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }

  /// Records this collective's end in `ring` as number `seq` (see collective_ring).
  void track(std::shared_ptr<collective_ring> ring, std::int64_t seq) noexcept;
  /// Called by work once it saw the end (or gave up): the ring learns how far it got.
  void settle(call_state state) noexcept {
    if (ring_) ring_->settle(seq_, state);
  }

  /// What every copy of a work handle shares: whether one of them saw the end
  /// (then `poll()` is not called again), and the timeout one of them gave up
  /// with. The first to see the end settles the ring; the rest see it done.
  [[nodiscard]] bool seen_done() const noexcept {
    return seen_done_.load(std::memory_order_acquire);
  }
  void see_done(call_state state) noexcept;
  /// A handle gave up waiting: every copy now reports `timeout`. False when
  /// a copy had seen the end first (nothing is recorded then).
  bool see_timeout(std::exception_ptr timeout) noexcept;
  [[nodiscard]] std::exception_ptr timed_out() const noexcept;

 protected:
  void fail(std::exception_ptr e) noexcept {
    if (!error_) error_ = std::move(e);
  }
  /// For work whose limit is known only once it has started (a sequence takes its first step's).
  void set_timeout(std::chrono::milliseconds timeout) noexcept { timeout_ = timeout; }

 private:
  mutable std::string description_;  // "allreduce(sum, 1024 x float32) on rank 1 of 4 (mpi)"
  collective_info info_{};
  std::chrono::milliseconds timeout_;
  std::exception_ptr error_;
  std::shared_ptr<collective_ring> ring_;
  std::int64_t seq_ = 0;
  std::atomic<bool> seen_done_{false};
  mutable std::mutex end_mutex_;  // orders seen_done_ with timed_out_
  std::exception_ptr timed_out_;
};

/// Numbers a collective in `ring` (the engine's one counter) and returns its sequence number.
inline std::int64_t record(collective_ring& ring, const collective_info& info) {
  return ring.issue(info.collective, static_cast<dtype>(info.type), info.count, info.op, info.root);
}

}  // namespace detail

/// The handle of one asynchronous collective. Cheap to copy: copies share
/// their state, so what one copy saw (the end, a timeout) every copy sees.
class work {
 public:
  /// A handle that is already complete.
  work() = default;
  explicit work(std::shared_ptr<detail::work_state> state) : state_(std::move(state)) {}

  /// True once the collective has finished, successfully or not. Never blocks.
  [[nodiscard]] bool test();

  /// Waits for the communicator's timeout; see wait(timeout).
  void wait() { wait(state_ ? state_->timeout() : std::chrono::milliseconds(0)); }

  /// Waits until the collective finishes, then throws its error if it failed
  /// (backend_error). Throws timeout_error naming the collective, the rank and
  /// the time when it is not done within `timeout`; the communicator is then
  /// aborted or marked unusable, as the engine allows.
  void wait(std::chrono::milliseconds timeout);

  /// Waits at most `timeout` and does nothing about it: true once finished
  /// (exception() then says how), false while still running. For a watchdog,
  /// which reports a timeout before it aborts: an abort may itself wait on a
  /// device that never frees.
  [[nodiscard]] bool finish_within(std::chrono::milliseconds timeout);

  /// The timeout_error wait(timeout) throws: the collective, the rank, the time.
  [[nodiscard]] std::exception_ptr timeout_exception(std::chrono::milliseconds timeout) const;

  /// After finish_within(timeout) returned false: aborts what the engine can
  /// abort (or marks the communicator unusable) and throws timeout_exception().
  [[noreturn]] void give_up(std::chrono::milliseconds timeout);

  /// The rank gives up on this collective before it ended (see
  /// work_state::on_abandon): NCCL aborts its communicators at once; other
  /// engines leave the wait bounded by the timeout. No-op when complete.
  void abandon() noexcept {
    if (state_ && !state_->seen_done()) state_->on_abandon();
  }

  /// Engines on streams: `stream` waits, on the device, for this collective
  /// alone (work_state::stream_wait); false where the engine cannot. A
  /// complete handle has nothing to wait for (true).
  bool stream_wait(stream_handle stream) { return state_ ? state_->stream_wait(stream) : true; }

  /// "allreduce(sum, 1024 x float32) on rank 1 of 4 (nccl)"; "no collective" for a complete handle.
  [[nodiscard]] std::string description() const {
    return state_ ? state_->description() : std::string("no collective");
  }

  /// The limit wait() without an argument allows (the communicator's collective timeout).
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept {
    return state_ ? state_->timeout() : std::chrono::milliseconds(0);
  }

  /// The error the collective failed with (or the timeout), once finished; null otherwise.
  [[nodiscard]] std::exception_ptr exception() const noexcept;

 private:
  void ended() noexcept {
    state_->see_done(state_->error() ? detail::call_state::failed : detail::call_state::completed);
  }

  std::shared_ptr<detail::work_state> state_;
};

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/backend/work-inl.hpp>
#endif
