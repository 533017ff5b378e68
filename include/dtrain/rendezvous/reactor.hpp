#pragma once
/// @file
/// A small epoll reactor for C++20 coroutines, and the task type the store's
/// server is written in. One thread runs the reactor; every coroutine runs on
/// it, so the server's state needs no locks.

#include <dtrain/config.hpp>
#include <dtrain/detail/sys.hpp>
#include <dtrain/error.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <coroutine>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include <sys/epoll.h>
#include <sys/eventfd.h>

namespace dtrain::detail {

using steady = std::chrono::steady_clock;

/// A lazily started coroutine returning T, awaitable from another task.
///
/// Awaiting a task runs it at once on the awaiter's stack, as a call would.
/// If it finishes without suspending, its frame has returned before the
/// awaiter goes on, so a loop over requests that never suspend (a client
/// pipelining thousands of them) keeps a bounded stack. This does not rest
/// on the compiler turning symmetric transfer into a tail call, which GCC
/// does only at -O2: the store must not crash at -O0 or under sanitizers.
/// Only a task that suspended (on the reactor) resumes its awaiter from its
/// final suspension, one frame deep per level of nesting.
template <class T = void>
class task;

namespace task_impl {

struct promise_base {
  std::coroutine_handle<> continuation{};
  std::exception_ptr error{};
  bool running_inline = false;  // started by an awaiter that is still on the stack below it

  struct final_awaiter {
    bool await_ready() const noexcept { return false; }
    template <class P>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<P> h) const noexcept {
      const promise_base& p = h.promise();
      // Finished inline: the awaiter's await_suspend is below us and goes on by returning.
      if (p.running_inline || !p.continuation) return std::noop_coroutine();
      return p.continuation;
    }
    void await_resume() const noexcept {}
  };

  std::suspend_always initial_suspend() const noexcept { return {}; }
  final_awaiter final_suspend() const noexcept { return {}; }
  void unhandled_exception() noexcept { error = std::current_exception(); }
};

template <class T>
struct promise : promise_base {
  std::optional<T> value{};
  task<T> get_return_object() noexcept;
  void return_value(T v) { value = std::move(v); }
  T take() {
    if (error) std::rethrow_exception(error);
    return std::move(*value);
  }
};

template <>
struct promise<void> : promise_base {
  task<void> get_return_object() noexcept;
  void return_void() const noexcept {}
  void take() const {
    if (error) std::rethrow_exception(error);
  }
};

}  // namespace task_impl

template <class T>
class task {
 public:
  using promise_type = task_impl::promise<T>;
  using handle_type = std::coroutine_handle<promise_type>;

  task() = default;
  explicit task(handle_type h) noexcept : h_(h) {}
  task(task&& other) noexcept : h_(std::exchange(other.h_, {})) {}
  task& operator=(task&& other) noexcept {
    if (this != &other) {
      if (h_) h_.destroy();
      h_ = std::exchange(other.h_, {});
    }
    return *this;
  }
  task(const task&) = delete;
  task& operator=(const task&) = delete;
  ~task() {
    if (h_) h_.destroy();
  }

  /// Runs a top-level task until its first suspension.
  void start() { h_.resume(); }
  [[nodiscard]] bool done() const noexcept { return !h_ || h_.done(); }
  /// The exception a finished top-level task ended with, if any.
  [[nodiscard]] std::exception_ptr error() const noexcept {
    return h_ ? h_.promise().error : nullptr;
  }

  auto operator co_await() && noexcept {
    struct awaiter {
      handle_type h;
      bool await_ready() const noexcept { return false; }
      // Runs the task now; true (stay suspended) only if it suspended before finishing.
      bool await_suspend(std::coroutine_handle<> caller) noexcept {
        auto& p = h.promise();
        p.continuation = caller;
        p.running_inline = true;
        h.resume();
        if (h.done()) return false;
        p.running_inline = false;  // from now on its final suspension resumes the caller
        return true;
      }
      T await_resume() { return h.promise().take(); }
    };
    return awaiter{h_};
  }

 private:
  handle_type h_{};
};

namespace task_impl {
template <class T>
task<T> promise<T>::get_return_object() noexcept {
  return task<T>(std::coroutine_handle<promise<T>>::from_promise(*this));
}
inline task<void> promise<void>::get_return_object() noexcept {
  return task<void>(std::coroutine_handle<promise<void>>::from_promise(*this));
}
}  // namespace task_impl

/// Why a suspended coroutine was resumed.
enum class wake { none, io, timeout, event, stop };

/// The pending wait of one coroutine chain (one connection, or the acceptor).
struct wait_slot {
  std::coroutine_handle<> handle{};
  wake reason = wake::none;
  int fd = -1;
  bool io_armed = false;
  bool has_timer = false;
  std::multimap<steady::time_point, wait_slot*>::iterator timer{};
};

/// epoll, a timer queue and a ready queue. Not thread-safe except
/// request_stop(); everything else is called on the thread that runs it.
class reactor {
 public:
  reactor();
  reactor(const reactor&) = delete;
  reactor& operator=(const reactor&) = delete;

  /// Watches `fd` for `slot` (disarmed until a wait arms it).
  void add(int fd, wait_slot& slot);

  /// Stops watching the slot's fd and forgets the slot; pending events for it are dropped.
  void remove(wait_slot& slot);

  /// Awaitable: suspends until `slot`'s fd has `events` (0: none), the
  /// deadline passes, wake_up(slot) is called, or the reactor stops.
  struct until {
    reactor& r;
    wait_slot& slot;
    std::uint32_t events;
    std::optional<steady::time_point> deadline;

    bool await_ready() const noexcept { return r.stopping_; }
    void await_suspend(std::coroutine_handle<> h);
    wake await_resume();
  };

  until wait(wait_slot& slot, std::uint32_t events, std::optional<steady::time_point> deadline) {
    return until{*this, slot, events, deadline};
  }

  /// Resumes a suspended slot with wake::event, after the running coroutine suspends.
  void wake_up(wait_slot& slot) { make_ready(slot, wake::event); }
  /// Resumes a suspended slot with wake::stop, as stop_all does for one slot.
  void cancel(wait_slot& slot) { make_ready(slot, wake::stop); }

  /// One round: resume what is ready, wait for I/O or the next timer (at most
  /// `cap`), dispatch. Returns false once a stop was requested.
  bool run_once(std::chrono::milliseconds cap);

  /// Thread-safe: makes run_once return false soon.
  void request_stop() noexcept;
  [[nodiscard]] bool stop_requested() const noexcept { return stop_flag_.load(); }

  /// After a stop: every await completes at once with wake::stop, and every
  /// suspended slot is resumed so its coroutine can say goodbye and finish.
  void stop_all(const std::vector<wait_slot*>& suspended);

 private:
  void arm(wait_slot& slot, std::uint32_t events);

  void disarm(wait_slot& slot);

  void make_ready(wait_slot& slot, wake why);

  void drain_ready();

  unique_fd epoll_;
  unique_fd wakeup_;
  std::atomic<bool> stop_flag_{false};
  bool stopping_ = false;
  std::uint64_t next_id_ = 1;
  std::unordered_map<std::uint64_t, wait_slot*> slots_;
  std::unordered_map<const wait_slot*, std::uint64_t> ids_;
  std::multimap<steady::time_point, wait_slot*> timers_;
  std::deque<wait_slot*> ready_;
};

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/rendezvous/reactor-inl.hpp>
#endif
