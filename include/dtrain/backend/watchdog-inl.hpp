#pragma once
/// @file
/// The non-template bodies of dtrain/backend/watchdog.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/backend/watchdog.hpp, not this file.

#include <dtrain/backend/watchdog.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

namespace dtrain {

namespace detail {

struct late_failures {
  std::mutex mutex;
  int holds = 0;
  std::exception_ptr first;
};

DTRAIN_DETAIL_INLINE late_failures& the_late_failures() {
  static late_failures slot;
  return slot;
}

DTRAIN_DETAIL_INLINE late_failure_hold::late_failure_hold() {
  late_failures& slot = the_late_failures();
  std::lock_guard lock(slot.mutex);
  ++slot.holds;
}

DTRAIN_DETAIL_INLINE late_failure_hold::~late_failure_hold() {
  late_failures& slot = the_late_failures();
  std::lock_guard lock(slot.mutex);
  if (--slot.holds == 0) slot.first = nullptr;
}

DTRAIN_DETAIL_INLINE std::exception_ptr late_failure_hold::take() noexcept {
  late_failures& slot = the_late_failures();
  std::lock_guard lock(slot.mutex);
  return std::exchange(slot.first, nullptr);
}

DTRAIN_DETAIL_INLINE bool keep_late_failure(std::exception_ptr e) noexcept {
  late_failures& slot = the_late_failures();
  std::lock_guard lock(slot.mutex);
  if (slot.holds == 0) return false;
  if (!slot.first) slot.first = std::move(e);
  return true;
}

}  // namespace detail

DTRAIN_DETAIL_INLINE watchdog::watchdog() {
  // This one variable, not a copy of the whole environment per watchdog.
  const std::string name(watchdog_heartbeat_variable);
  if (const char* value = std::getenv(name.c_str())) {
    if (auto t = detail::read_seconds(environment{{name, value}}, name)) heartbeat_ = *t;
  }
}

DTRAIN_DETAIL_INLINE watchdog::~watchdog() {
  if (std::uncaught_exceptions() > unwinding_at_start_) abandon();
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  // The monitor still watches the thread while it finishes (or is stuck),
  // and stops as soon as it has.
  if (thread_.joinable()) thread_.join();
  {
    std::lock_guard lock(mutex_);
    followed_out_ = true;
  }
  monitor_wake_.notify_all();
  if (monitor_.joinable()) monitor_.join();
  if (!failure_ || reported_ || std::uncaught_exceptions() > unwinding_at_start_) return;
  if (detail::keep_late_failure(failure_)) return;
  try {
    std::rethrow_exception(failure_);
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "dtrain: %s (found by a watchdog after its owner's last call, which could not "
                 "report it: wait for the work before destroying its owner, or use dtrain::run)\n",
                 e.what());
  } catch (...) {
    std::fprintf(stderr, "dtrain: a watchdog's work failed after its owner's last call\n");
  }
}

DTRAIN_DETAIL_INLINE void watchdog::watch(work w) {
  const std::chrono::milliseconds timeout = w.timeout();
  {
    std::lock_guard lock(mutex_);
    queue_.push_back({std::move(w), clock::now() + timeout, timeout});
    ++watched_;
    if (!thread_.joinable()) {
      thread_ = std::thread([this] { follow(); });
      monitor_ = std::thread([this] { monitor(); });
    }
  }
  wake_.notify_all();
}

DTRAIN_DETAIL_INLINE void watchdog::abandon() noexcept {
  std::deque<work> left;
  {
    std::lock_guard lock(mutex_);
    try {
      left.push_back(current_);
      for (const entry& e : queue_) left.push_back(e.handle);
    } catch (...) {
      // No memory to copy the handles: what was copied is abandoned below,
      // the rest stays bounded by its timeout.
    }
  }
  for (work& w : left) w.abandon();
}

DTRAIN_DETAIL_INLINE std::exception_ptr watchdog::failure() const {
  std::lock_guard lock(mutex_);
  if (failure_) reported_ = true;
  return failure_;
}

DTRAIN_DETAIL_INLINE std::exception_ptr watchdog::drain() {
  std::unique_lock lock(mutex_);
  const std::uint64_t target = watched_;
  settled_.wait(lock, [&] { return finished_ >= target || failure_; });
  if (failure_) reported_ = true;
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
      current_ = next.handle;
      stuck_after_ = next.deadline + heartbeat_;
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
    std::lock_guard lock(mutex_);
    stuck_after_ = clock::time_point::max();
    current_ = work();
  }
}

DTRAIN_DETAIL_INLINE void watchdog::monitor() {
  std::unique_lock lock(mutex_);
  for (;;) {
    const auto tick = std::min(heartbeat_ / 4, std::chrono::milliseconds(1000));
    monitor_wake_.wait_for(lock, std::max(tick, std::chrono::milliseconds(10)),
                           [&] { return followed_out_; });
    if (followed_out_) return;
    if (clock::now() < stuck_after_) continue;
    // The thread is stuck inside an engine's poll or abort: nothing dtrain
    // can do reaches it any more. The launcher can only restart a process
    // that ends.
    const std::string what = current_.description();
    std::fprintf(stderr,
                 "dtrain: the watchdog following %s is stuck %.1f s past its deadline: "
                 "the engine's abort or the device does not return (NCCL's threads, a "
                 "driver hang); ending the process (%s)\n",
                 what.c_str(), static_cast<double>(heartbeat_.count()) / 1000.0,
                 std::string(watchdog_heartbeat_variable).c_str());
    std::fflush(stderr);
    std::_Exit(1);
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

}  // namespace dtrain
