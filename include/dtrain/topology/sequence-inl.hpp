#pragma once
/// @file
/// The non-template bodies of dtrain/topology/sequence.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/topology/sequence.hpp, not this file.

#include <dtrain/topology/sequence.hpp>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE work_sequence::work_sequence(std::string label, std::vector<step> steps,
                                                  bool eager, std::shared_ptr<void> keep_alive)
    : work_state(std::move(label), std::chrono::milliseconds(0)),
      keep_alive_(std::move(keep_alive)),
      call_label_(current_call_label()) {
  if (steps.empty()) throw dtrain::error("work_sequence: no steps (" + description() + ")");
  for (std::size_t i = 0; i < steps.size(); ++i) {
    int& a = steps[i].after;
    if (a == chain) a = static_cast<int>(i) - 1;
    if (a >= static_cast<int>(i)) {
      throw dtrain::error("work_sequence: step " + std::to_string(i) + " waits for a later one (" +
                          description() + ")");
    }
    slots_.push_back({std::move(steps[i]), {}, false, false});
  }
  if (eager) {
    for (std::size_t i = 0; i < slots_.size(); ++i) start(i);
  } else {
    start_ready();
  }
}

DTRAIN_DETAIL_INLINE bool work_sequence::poll() {
  std::lock_guard lock(mutex_);
  return advance_locked();
}

DTRAIN_DETAIL_INLINE bool work_sequence::wait_until(
    std::chrono::steady_clock::time_point deadline) {
  backoff pause;
  for (;;) {
    std::optional<work> only;
    {
      std::lock_guard lock(mutex_);
      if (advance_locked()) return true;
      only = only_running_locked();
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      std::lock_guard lock(mutex_);
      return advance_locked();
    }
    if (only) {
      // One step in flight, and nothing else can start before it ends: the
      // engine's own wait (Gloo runs a collective that is next in line on
      // this thread; MPI progresses inside its test).
      (void)only->finish_within(left);
    } else {
      pause();  // several in flight: poll them all, so that each finished one lets the next start
    }
  }
}

DTRAIN_DETAIL_INLINE void work_sequence::on_timeout() noexcept {
  std::lock_guard lock(mutex_);
  for (slot& s : slots_) {
    if (!s.started || s.handle.test()) continue;
    try {
      s.handle.give_up(s.handle.timeout());  // the engine's abort
    } catch (...) {
    }
  }
}

DTRAIN_DETAIL_INLINE bool work_sequence::stream_wait(stream_handle stream) {
  std::lock_guard lock(mutex_);
  for (slot& s : slots_) {
    if (!s.started) return false;  // a lazy sequence: its later steps are not enqueued yet
  }
  for (slot& s : slots_) {
    if (!s.handle.stream_wait(stream)) return false;
  }
  return true;
}

DTRAIN_DETAIL_INLINE void work_sequence::start(std::size_t i) {
  slot& s = slots_[i];
  label_scope label(
      call_label_);  // a later step, started by whichever thread polls, keeps the caller's label
  s.handle = s.what.start();
  s.started = true;
  // A step that completed at once (nothing to move) has no limit of its own.
  if (s.handle.timeout() > timeout()) set_timeout(s.handle.timeout());
}

DTRAIN_DETAIL_INLINE void work_sequence::start_ready() {
  std::vector<char> lane_blocked;
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    const auto lane = static_cast<std::size_t>(slots_[i].what.lane);
    if (lane >= lane_blocked.size()) lane_blocked.resize(lane + 1, 0);
    if (slots_[i].started) continue;
    const int a = slots_[i].what.after;
    const bool ready = a < 0 || slots_[static_cast<std::size_t>(a)].finished;
    if (ready && !lane_blocked[lane]) {
      start(i);
    } else {
      lane_blocked[lane] = 1;
    }
  }
}

DTRAIN_DETAIL_INLINE std::optional<work> work_sequence::only_running_locked() {
  std::optional<work> found;
  int running = 0;
  for (const slot& s : slots_) {
    if (s.started && !s.finished) {
      found = s.handle;
      ++running;
    }
  }
  if (running != 1) return std::nullopt;
  return found;
}

DTRAIN_DETAIL_INLINE bool work_sequence::advance_locked() {
  if (finished_) return true;
  for (;;) {
    bool progress = false;
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      slot& s = slots_[i];
      if (!s.started || s.finished || !s.handle.test()) continue;
      if (auto e = s.handle.exception()) return end(e, i);
      s.finished = true;
      progress = true;
    }
    if (std::all_of(slots_.begin(), slots_.end(), [](const slot& s) { return s.finished; })) {
      finished_ = true;
      return true;
    }
    if (!progress) return false;
    try {
      start_ready();
    } catch (...) {
      std::size_t failed = 0;
      while (failed < slots_.size() && slots_[failed].started) ++failed;
      return end(std::current_exception(), failed);
    }
  }
}

DTRAIN_DETAIL_INLINE bool work_sequence::end(const std::exception_ptr& e, std::size_t i) {
  const std::string where = description() + ", step " + std::to_string(i + 1) + " of " +
                            std::to_string(slots_.size()) + " (" + slots_[i].what.name + "): ";
  try {
    std::rethrow_exception(e);
  } catch (const config_error& x) {
    fail(std::make_exception_ptr(config_error(where + x.what())));
  } catch (const timeout_error& x) {
    fail(std::make_exception_ptr(timeout_error(where + x.what())));
  } catch (const backend_error& x) {
    fail(std::make_exception_ptr(backend_error(where + x.what(), x.engine_code())));
  } catch (const rendezvous_error& x) {
    fail(std::make_exception_ptr(rendezvous_error(where + x.what())));
  } catch (const std::exception& x) {
    fail(std::make_exception_ptr(dtrain::error(where + x.what())));
  } catch (...) {
    fail(e);
  }
  finished_ = true;
  return true;
}

}  // namespace dtrain::detail
