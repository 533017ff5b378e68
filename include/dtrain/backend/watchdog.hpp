#pragma once
/// @file
/// `watchdog`: a host thread that follows work nobody waits for on the host
/// (collectives on CUDA streams), as ProcessGroupNCCL's watchdog does. Each
/// piece of work must finish within its collective timeout counted from when
/// it was handed over; past it the watchdog calls the engine's timeout hook
/// (NCCL: abort the communicator, which frees the stuck stream) and keeps the
/// timeout_error naming the collective for the owner to report.

#include <dtrain/backend/work.hpp>
#include <dtrain/config.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/names.hpp>
#include <dtrain/env/variables.hpp>
#include <dtrain/error.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace dtrain {

namespace detail {
/// Where a watchdog's failure goes when nothing reported it: its owner was
/// destroyed normally after its last call (a training function that returns
/// right after a step on CUDA streams, whose buckets then time out while the
/// owner's destructor follows them). While a late_failure_hold exists (run()
/// holds one around the training function), the first such failure is kept
/// for it to take(), and run() fails the rank with it, as if the training
/// function had thrown it; with none, the watchdog prints it to stderr.
class late_failure_hold {
 public:
  late_failure_hold();
  late_failure_hold(const late_failure_hold&) = delete;
  late_failure_hold& operator=(const late_failure_hold&) = delete;
  ~late_failure_hold();
  /// The first failure kept since, or null; it is then no longer kept.
  [[nodiscard]] std::exception_ptr take() noexcept;
};
/// Keeps `e` for a late_failure_hold; false when there is none.
[[nodiscard]] DTRAIN_DETAIL_INLINE bool keep_late_failure(std::exception_ptr e) noexcept;
}  // namespace detail

class watchdog {
 public:
  using clock = std::chrono::steady_clock;

  /// Reads DTRAIN_WATCHDOG_HEARTBEAT (seconds; config_error naming it when
  /// malformed): how long the thread may stay stuck past a collective's
  /// deadline (an abort or a device query that does not return: NCCL's own
  /// threads, a driver hang) before a monitor ends the process with a
  /// message, as ProcessGroupNCCL's heartbeat monitor does. Default 60 s.
  watchdog();
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;
  /// Waits for the work still watched (each within what is left of its
  /// timeout), then stops the thread. Destroyed while an exception unwinds
  /// (its owner failed), it abandons that work first (abandon()): a failing
  /// rank does not wait out a collective timeout for peers that may be gone.
  /// Otherwise a failure that failure() and drain() never returned is not
  /// lost: it goes to run() (detail::late_failure_hold), which fails the
  /// rank with it, or without run() to stderr.
  ~watchdog();

  /// Gives up on every piece of work watched and not yet finished
  /// (work::abandon(): NCCL aborts its communicators at once). The owner's
  /// failure, not the work's, is then the one to report.
  void abandon() noexcept;

  /// Follows `w` from now on: it must finish within its timeout (work::timeout()).
  /// Work is waited for in the order it was handed over (one stream runs it in order).
  void watch(work w);

  /// The first failure seen (a timeout_error naming the collective, or the
  /// engine's error), or null. Never blocks on the work.
  [[nodiscard]] std::exception_ptr failure() const;

  /// Blocks until every piece of work handed over so far has finished, or
  /// until one has failed (each bounded by its timeout); returns failure().
  std::exception_ptr drain();

 private:
  struct entry {
    work handle;
    clock::time_point deadline;
    std::chrono::milliseconds timeout;
  };

  void follow();
  void monitor();

  void settle(std::exception_ptr failed);

  mutable std::mutex mutex_;
  std::condition_variable wake_;     // work to follow, or stop
  std::condition_variable settled_;  // a piece of work finished
  std::deque<entry> queue_;
  std::uint64_t watched_ = 0;
  std::uint64_t finished_ = 0;
  bool stopping_ = false;
  std::exception_ptr failure_;
  mutable bool reported_ = false;  // failure() or drain() returned failure_ (mutex_)
  work current_;                   // the work the thread follows now (mutex_)
  // The thread must be done with current_ by then (deadline + heartbeat), or
  // the monitor ends the process; max() while it follows nothing (mutex_).
  clock::time_point stuck_after_ = clock::time_point::max();
  std::chrono::milliseconds heartbeat_{60'000};
  bool followed_out_ = false;  // the thread has ended: the monitor ends too (mutex_)
  int unwinding_at_start_ = std::uncaught_exceptions();
  std::condition_variable monitor_wake_;
  std::thread thread_;
  std::thread monitor_;
};

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/backend/watchdog-inl.hpp>
#endif
