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

  /// Every step started (an eager sequence on streams): `stream` waits for
  /// each step's collective alone; false otherwise, or where a step cannot.
  bool stream_wait(stream_handle stream) override;

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

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/topology/sequence-inl.hpp>
#endif
