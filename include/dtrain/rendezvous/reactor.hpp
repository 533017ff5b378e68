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

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE reactor::reactor()
    : epoll_(DTRAIN_SYSCALL(::epoll_create1(EPOLL_CLOEXEC))),
      wakeup_(DTRAIN_SYSCALL(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK))) {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;  // id 0 is the wakeup eventfd
  DTRAIN_SYSCALL(::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, wakeup_.get(), &ev));
}

DTRAIN_DETAIL_INLINE void reactor::add(int fd, wait_slot& slot) {
  slot.fd = fd;
  std::uint64_t id = next_id_++;
  ids_[&slot] = id;
  slots_[id] = &slot;
  epoll_event ev{};
  ev.events = EPOLLONESHOT;
  ev.data.u64 = id;
  DTRAIN_SYSCALL(::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev));
}

DTRAIN_DETAIL_INLINE void reactor::remove(wait_slot& slot) {
  disarm(slot);
  if (slot.fd >= 0) ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, slot.fd, nullptr);
  if (auto it = ids_.find(&slot); it != ids_.end()) {
    slots_.erase(it->second);
    ids_.erase(it);
  }
  std::erase(ready_, &slot);
}

DTRAIN_DETAIL_INLINE void reactor::until::await_suspend(std::coroutine_handle<> h) {
  slot.handle = h;
  slot.reason = wake::none;
  if (events != 0) r.arm(slot, events);
  if (deadline) {
    slot.timer = r.timers_.emplace(*deadline, &slot);
    slot.has_timer = true;
  }
}

DTRAIN_DETAIL_INLINE wake reactor::until::await_resume() {
  if (r.stopping_) {
    r.disarm(slot);
    return wake::stop;
  }
  r.disarm(slot);
  return slot.reason;
}

DTRAIN_DETAIL_INLINE bool reactor::run_once(std::chrono::milliseconds cap) {
  drain_ready();
  if (stop_requested()) return false;
  int timeout = static_cast<int>(cap.count());
  if (!timers_.empty()) {
    auto until_next =
        std::chrono::ceil<std::chrono::milliseconds>(timers_.begin()->first - steady::now());
    timeout = static_cast<int>(std::clamp<std::int64_t>(until_next.count(), 0, timeout));
  }
  epoll_event events[256];
  int n = ::epoll_wait(epoll_.get(), events, 256, timeout);
  if (n < 0 && errno != EINTR) DTRAIN_SYSCALL(n);
  for (int i = 0; i < n; ++i) {
    if (events[i].data.u64 == 0) {
      std::uint64_t drained = 0;
      (void)!::read(wakeup_.get(), &drained, sizeof drained);
      continue;
    }
    auto it = slots_.find(events[i].data.u64);
    if (it == slots_.end()) continue;
    it->second->io_armed = false;  // EPOLLONESHOT disarmed it
    make_ready(*it->second, wake::io);
  }
  auto now = steady::now();
  while (!timers_.empty() && timers_.begin()->first <= now) {
    wait_slot* slot = timers_.begin()->second;
    timers_.erase(timers_.begin());
    slot->has_timer = false;
    make_ready(*slot, wake::timeout);
  }
  drain_ready();
  return !stop_requested();
}

DTRAIN_DETAIL_INLINE void reactor::request_stop() noexcept {
  stop_flag_.store(true);
  std::uint64_t one = 1;
  (void)!::write(wakeup_.get(), &one, sizeof one);
}

DTRAIN_DETAIL_INLINE void reactor::stop_all(const std::vector<wait_slot*>& suspended) {
  stopping_ = true;
  for (wait_slot* s : suspended) make_ready(*s, wake::stop);
  drain_ready();
}

DTRAIN_DETAIL_INLINE void reactor::arm(wait_slot& slot, std::uint32_t events) {
  epoll_event ev{};
  ev.events = events | EPOLLONESHOT;
  ev.data.u64 = ids_.at(&slot);
  DTRAIN_SYSCALL(::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, slot.fd, &ev));
  slot.io_armed = true;
}

DTRAIN_DETAIL_INLINE void reactor::disarm(wait_slot& slot) {
  if (slot.io_armed) {
    epoll_event ev{};
    ev.events = EPOLLONESHOT;
    ev.data.u64 = ids_.at(&slot);
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, slot.fd, &ev);
    slot.io_armed = false;
  }
  if (slot.has_timer) {
    timers_.erase(slot.timer);
    slot.has_timer = false;
  }
}

DTRAIN_DETAIL_INLINE void reactor::make_ready(wait_slot& slot, wake why) {
  if (!slot.handle || slot.reason != wake::none) return;  // not waiting, or already woken
  slot.reason = why;
  ready_.push_back(&slot);
}

DTRAIN_DETAIL_INLINE void reactor::drain_ready() {
  while (!ready_.empty()) {
    wait_slot* slot = ready_.front();
    ready_.pop_front();
    auto h = std::exchange(slot->handle, {});
    if (h) h.resume();
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
