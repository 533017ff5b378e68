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

class watchdog {
 public:
  using clock = std::chrono::steady_clock;

  watchdog() = default;
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;
  /// Waits for the work still watched (each within what is left of its
  /// timeout), then stops the thread.
  ~watchdog();

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

  void settle(std::exception_ptr failed);

  mutable std::mutex mutex_;
  std::condition_variable wake_;     // work to follow, or stop
  std::condition_variable settled_;  // a piece of work finished
  std::deque<entry> queue_;
  std::uint64_t watched_ = 0;
  std::uint64_t finished_ = 0;
  bool stopping_ = false;
  std::exception_ptr failure_;
  std::thread thread_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE watchdog::~watchdog() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

DTRAIN_DETAIL_INLINE void watchdog::watch(work w) {
  const std::chrono::milliseconds timeout = w.timeout();
  {
    std::lock_guard lock(mutex_);
    queue_.push_back({std::move(w), clock::now() + timeout, timeout});
    ++watched_;
    if (!thread_.joinable()) thread_ = std::thread([this] { follow(); });
  }
  wake_.notify_all();
}

DTRAIN_DETAIL_INLINE std::exception_ptr watchdog::failure() const {
  std::lock_guard lock(mutex_);
  return failure_;
}

DTRAIN_DETAIL_INLINE std::exception_ptr watchdog::drain() {
  std::unique_lock lock(mutex_);
  const std::uint64_t target = watched_;
  settled_.wait(lock, [&] { return finished_ >= target || failure_; });
  return failure_;
}

DTRAIN_DETAIL_INLINE void watchdog::follow() {
  for (;;) {
    entry next;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      next = std::move(queue_.front());
      queue_.pop_front();
    }
    const auto left =
        std::max(std::chrono::milliseconds(0),
                 std::chrono::ceil<std::chrono::milliseconds>(next.deadline - clock::now()));
    std::exception_ptr failed;
    bool timed_out = false;
    try {
      if (next.handle.finish_within(left)) {
        failed = next.handle.exception();
      } else {
        timed_out = true;
        try {
          std::rethrow_exception(next.handle.timeout_exception(next.timeout));
        } catch (const timeout_error& e) {
          failed = std::make_exception_ptr(
              timeout_error(std::string("watchdog: ") + e.what() + ", counted from launch"));
        }
      }
    } catch (...) {
      failed = std::current_exception();
    }
    // The failure is known before the abort: an abort may wait on a device
    // that never frees (a stream held by the host), and the owner must hear.
    settle(failed);
    if (timed_out) {
      try {
        next.handle.give_up(next.timeout);
      } catch (...) {
        // Reported above.
      }
    }
  }
}

DTRAIN_DETAIL_INLINE void watchdog::settle(std::exception_ptr failed) {
  {
    std::lock_guard lock(mutex_);
    if (failed && !failure_) failure_ = failed;
    ++finished_;
  }
  settled_.notify_all();
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
