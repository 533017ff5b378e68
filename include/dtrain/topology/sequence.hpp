#pragma once
/// @file
/// How a topology runs one collective as several on different communicators:
/// `detail::work_sequence`, one work for the steps, and the calls that pass a
/// stream only to engines that take one. Steps on engines that order their
/// collectives on CUDA streams are all enqueued at once, each after the
/// previous one's stream; on host engines each step starts when the one
/// before it has finished, inside test() / wait() of the sequence.

#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/config.hpp>
#include <dtrain/error.hpp>

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::detail {

/// Whether C enqueues its collectives on a device stream of its own, ordered
/// after the stream passed in (NCCL: `stream_ordered`, and `stream()`): the
/// steps of a sequence can then all be enqueued at once.
template <class C>
concept stream_ordered = requires(const C& c) {
  requires C::stream_ordered;
  { c.stream() } -> std::convertible_to<stream_handle>;
};

/// The stream that the next step must follow after a step on `c`: its own
/// stream where it has one, else none (the step has finished on the host).
template <communicator C>
stream_handle stream_after(const C& c) noexcept {
  if constexpr (stream_ordered<C>) {
    return c.stream();
  } else {
    (void)c;
    return nullptr;
  }
}

// The collectives with the caller's stream, for the engines that take one
// (NCCL, MPI with device buffers); the others never see it.
template <communicator C>
work allreduce_on(C& c, buffer in, buffer out, reduce_op op, stream_handle stream) {
  if constexpr (requires { c.allreduce(in, out, op, stream); }) {
    return c.allreduce(in, out, op, stream);
  } else {
    (void)stream;
    return c.allreduce(in, out, op);
  }
}
template <communicator C>
work reduce_scatter_on(C& c, buffer in, buffer out, reduce_op op, stream_handle stream) {
  if constexpr (requires { c.reduce_scatter(in, out, op, stream); }) {
    return c.reduce_scatter(in, out, op, stream);
  } else {
    (void)stream;
    return c.reduce_scatter(in, out, op);
  }
}
template <communicator C>
work allgather_on(C& c, buffer in, buffer out, stream_handle stream) {
  if constexpr (requires { c.allgather(in, out, stream); }) {
    return c.allgather(in, out, stream);
  } else {
    (void)stream;
    return c.allgather(in, out);
  }
}

/// One work for several collectives. `steps[i]` starts collective i and
/// returns its work; it runs on communicator `lane` and needs step `after`
/// finished first (`chain`: the step before it; -1: nothing). Steps of one
/// lane start in list order, whatever finishes when, so every rank issues the
/// same collectives on every communicator in the same order: a lane is a
/// queue, and independent lanes overlap (a pipeline: step k+1 on one
/// communicator while step k runs on another).
///
/// Eager: every step is started now, in list order (engines that order
/// collectives on streams). Otherwise a step starts once it may, from
/// whichever thread tests or waits on the sequence: drive a rank's sequences
/// from one thread, in one order, as it issues collectives. The first failure
/// ends the sequence, with `label` (the whole collective) and the step in its
/// message. A timeout gives up every step still running (NCCL: aborts their
/// communicators).
class work_sequence final : public work_state {
 public:
  static constexpr int chain = -2;
  struct step {
    std::string name;             ///< "cross-node allreduce", for messages
    std::function<work()> start;  ///< starts the collective; may throw
    int lane = 0;                 ///< the communicator it runs on
    int after = chain;            ///< the step it waits for: an index, chain, or -1
  };

  /// Starts what may start now (eager: every step); what a start throws
  /// reaches the caller. The sequence's timeout is its steps' (the
  /// communicators' collective timeout), counted for the whole sequence.
  work_sequence(std::string label, std::vector<step> steps, bool eager,
                std::shared_ptr<void> keep_alive = {});

  bool poll() override;

  bool wait_until(std::chrono::steady_clock::time_point deadline) override;

  void on_timeout() noexcept override;

 private:
  // What the sequence knows of one step.
  struct slot {
    step what;
    work handle;
    bool started = false;
    bool finished = false;
  };

  void start(std::size_t i);

  // Starts, in list order, every step whose predecessor has finished and
  // whose lane has started everything listed before it.
  void start_ready();

  // The one step in flight when exactly one is.
  std::optional<work> only_running_locked();

  // True once every step has finished or one has failed; starts the steps
  // that finished ones let start.
  bool advance_locked();

  // The step's error, with the sequence and the step named; same exception type.
  bool end(const std::exception_ptr& e, std::size_t i);

  std::mutex mutex_;  // the watchdog and the owner may poll at once
  std::vector<slot> slots_;
  std::shared_ptr<void> keep_alive_;  // scratch memory the steps use
  call_label call_label_;             // the caller's, for the steps started later
  bool finished_ = false;
};

#if DTRAIN_DETAIL_BODIES()
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
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
