#pragma once
/// @file
/// The non-template bodies of dtrain/rendezvous/reactor.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/rendezvous/reactor.hpp, not this file.

#include <dtrain/rendezvous/reactor.hpp>

namespace dtrain::detail {

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

}  // namespace dtrain::detail
