#pragma once
/// @file
/// Device time in DistributedDataParallel's timeline, for memory spaces on
/// streams that name a `device_timer` (CUDA's: backend/cuda.hpp; the tests'
/// fakes have their own). The host only enqueues a bucket's collective, so a
/// span the host closes ends before the device has done anything. Here each
/// bucket gets a span on the timeline's device track, from the point its
/// gradients are ready on the compute stream (an event recorded there when it
/// is launched) to the completion of its collective (an event recorded on the
/// timer's own stream after work::stream_wait(): the compute stream waits for
/// nothing more than before). The events are read without blocking the step
/// (polled at each synchronize()) and waited for, one second at most, only
/// when the timeline is written.
///
/// The clock: a device times its events relative to each other
/// (cudaEventElapsedTime). At start-up, an event reached on an idle stream ties
/// them to the host's steady clock (timeline::now()), within the time the host
/// took to see it reached (the best of a few tries: the uncertainty the file
/// states). Each resolved span moves that reference forward to its own start
/// event, so that the intervals measured stay short (a float's milliseconds
/// keep their precision). Two bounds hold the mapping against drift between
/// the clocks: an event cannot be reached before the host recorded it, nor
/// after the host saw it reached; a time mapped outside them moves the
/// reference by the difference.

#include <dtrain/backend/work.hpp>
#include <dtrain/ddp/timeline.hpp>
#include <dtrain/error.hpp>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace dtrain::detail {

/// A memory space whose device can time its streams (a `device_timer` type).
template <class Space>
concept times_device = requires {
  typename Space::device_timer;
};

/// Off: spaces without a timer (host memory; a user's space on streams
/// without one) keep the host's spans.
template <class Space>
class device_spans {
 public:
  using stream_type = typename Space::stream_type;
  [[nodiscard]] bool on() const noexcept { return false; }
  void start(int /*device*/, int /*rank*/, timeline& /*t*/) noexcept {}
  void begin(std::size_t /*bucket*/, stream_type /*compute*/) noexcept {}
  [[nodiscard]] bool end(std::size_t /*bucket*/, std::uint64_t /*id*/, work& /*w*/) noexcept {
    return false;
  }
  void poll() noexcept {}
  void flush() noexcept {}
};

template <times_device Space>
class device_spans<Space> {
 public:
  using timer = typename Space::device_timer;
  using event = typename timer::event;
  using stream_type = typename Space::stream_type;

  /// How long flush() waits for the device (a hung device leaves host spans).
  static constexpr std::chrono::milliseconds flush_wait{1000};
  /// Calibration tries (the one the host saw soonest is kept).
  static constexpr int calibrations = 5;

  device_spans() = default;
  device_spans(device_spans&&) noexcept = default;
  device_spans& operator=(device_spans&&) noexcept = default;
  ~device_spans() { stop(); }

  [[nodiscard]] bool on() const noexcept { return state_ != nullptr; }

  /// Device time on, for the timeline `t` of rank `rank` on `device` (`t`
  /// outlives this object): the timer's stream and the tie of its clock to
  /// the host's. A device that cannot be timed leaves the timeline with host
  /// spans, said on stderr.
  void start(int device, int rank, timeline& t) noexcept {
    if (!t.on()) return;
    try {
      auto s = std::make_unique<state>(device, rank, t);
      std::int64_t best = -1;
      for (int i = 0; i < calibrations; ++i) {
        const std::int64_t recorded = timeline::now();
        const event e = s->clock.record(s->clock.stream());
        const std::int64_t deadline = recorded + 10'000'000'000;  // 10 s: an idle stream
        while (!s->clock.reached(e)) {
          if (timeline::now() > deadline) {
            s->clock.release(e);
            throw error("an event on an idle stream was not reached within 10 s");
          }
          std::this_thread::yield();
        }
        const std::int64_t seen = timeline::now();
        if (best < 0 || seen - recorded < best) {
          best = seen - recorded;
          if (s->ref) s->clock.release(s->ref);
          s->ref = e;
          s->ref_host = static_cast<double>(recorded) + static_cast<double>(best) / 2;
        } else {
          s->clock.release(e);
        }
      }
      s->uncertainty = (best + 1) / 2;
      t.device_clock(s->uncertainty);
      state_ = std::move(s);
    } catch (const std::exception& e) {
      say(rank, e.what());
    }
  }

  /// Bucket `bucket` is launched: its gradients are ready on `compute` from here.
  void begin(std::size_t bucket, stream_type compute) noexcept {
    if (!state_) return;
    try {
      if (state_->open.size() <= bucket) state_->open.resize(bucket + 1);
      mark& m = state_->open[bucket];
      if (m.e) state_->clock.release(m.e);  // launched before, never reduced (a failure)
      m.recorded = timeline::now();
      m.e = state_->clock.record(compute);
    } catch (const std::exception& e) {
      give_up(e.what());
    }
  }

  /// The collective of `bucket` (timeline span `id`) is `w`: its completion
  /// is timed. False when `w` cannot order a stream after it (a hook's work
  /// on the host): the caller closes the span itself. What
  /// work::stream_wait() throws (an aborted communicator) goes to the caller.
  [[nodiscard]] bool end(std::size_t bucket, std::uint64_t id, work& w) {
    if (!state_ || bucket >= state_->open.size() || !state_->open[bucket].e) return false;
    const mark begun = std::exchange(state_->open[bucket], mark{});
    bool waits = false;
    try {
      waits = w.stream_wait(state_->clock.stream());
    } catch (...) {
      state_->clock.release(begun.e);
      throw;
    }
    if (!waits) {
      state_->clock.release(begun.e);
      return false;
    }
    try {
      const std::int64_t recorded = timeline::now();
      const event done = state_->clock.record(state_->clock.stream());
      state_->pending.push_back({bucket, id, begun, {done, recorded}});
      return true;
    } catch (const std::exception& e) {
      state_->clock.release(begun.e);
      give_up(e.what());
      return false;
    }
  }

  /// The spans whose events the device has reached go to the timeline (never blocks).
  void poll() noexcept {
    if (!state_) return;
    try {
      resolve();
    } catch (const std::exception& e) {
      give_up(e.what());
    }
  }

  /// Waits (flush_wait at most) for the spans still on the device, for a
  /// timeline about to be written; those the device has not reached by then
  /// end at the host's time, said on stderr.
  void flush() noexcept {
    if (!state_) return;
    try {
      const auto deadline = std::chrono::steady_clock::now() + flush_wait;
      resolve();
      while (!state_->pending.empty() && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        resolve();
      }
      if (!state_->pending.empty()) {
        const std::string what = std::to_string(state_->pending.size()) +
                                 " bucket(s) not complete on the device after " +
                                 std::to_string(flush_wait.count()) +
                                 " ms: their spans end at the host's time";
        std::fprintf(stderr, "[rank %d] dtrain: timeline: %s\n", state_->rank, what.c_str());
        close_pending();
      }
    } catch (const std::exception& e) {
      give_up(e.what());
    }
  }

 private:
  struct mark {
    event e{};
    std::int64_t recorded = 0;  // host time just before the record: a lower bound
  };
  struct span {
    std::size_t bucket;
    std::uint64_t id;
    mark begin, end;
  };
  struct state {
    state(int device, int r, timeline& t) : clock(device), rank(r), spans(t) {}
    timer clock;
    int rank;
    timeline& spans;
    event ref{};          // the reference event, reached
    double ref_host = 0;  // its time on the host's clock (ns)
    std::int64_t uncertainty = 0;
    std::vector<mark> open;  // per bucket: launched, not yet reduced
    std::deque<span> pending;
  };

  /// `m`'s time on the host's clock; `seen`: when the host saw it reached.
  std::int64_t map(const mark& m, std::int64_t seen) {
    double t = state_->ref_host + state_->clock.elapsed_ns(state_->ref, m.e);
    const auto low = static_cast<double>(m.recorded), high = static_cast<double>(seen);
    if (t < low) {
      state_->ref_host += low - t;
      t = low;
    } else if (t > high) {
      state_->ref_host -= t - high;
      t = high;
    }
    return std::llround(t);
  }

  void resolve() {
    while (!state_->pending.empty()) {
      span& p = state_->pending.front();
      if (!state_->clock.reached(p.end.e) || !state_->clock.reached(p.begin.e)) return;
      const std::int64_t seen = timeline::now();
      const std::int64_t start = map(p.begin, seen);
      std::int64_t finish = map(p.end, seen);
      if (finish < start) finish = start;
      state_->spans.device_done(p.bucket, p.id, start, finish);
      // The reference moves to this span's start (later events are after it).
      state_->clock.release(state_->ref);
      state_->ref = p.begin.e;
      state_->ref_host = static_cast<double>(start);
      state_->clock.release(p.end.e);
      state_->pending.pop_front();
    }
  }

  void close_pending() noexcept {
    for (span& p : state_->pending) {
      try {
        state_->spans.bucket_done(p.bucket, p.id, 0, false);
      } catch (...) {  // out of memory: the span stays open in the file
      }
      state_->clock.release(p.begin.e);
      state_->clock.release(p.end.e);
    }
    state_->pending.clear();
  }

  static void say(int rank, const char* what) noexcept {
    std::fprintf(stderr,
                 "[rank %d] dtrain: timeline: device time is off (%s); buckets keep host spans\n",
                 rank, what);
  }

  /// A timing call failed: said once, the spans left end at the host's
  /// time, and there is no more device time.
  void give_up(const char* what) noexcept {
    say(state_->rank, what);
    close_pending();
    stop();
  }

  void stop() noexcept {
    if (!state_) return;
    for (mark& m : state_->open)
      if (m.e) state_->clock.release(m.e);
    for (span& p : state_->pending) {
      state_->clock.release(p.begin.e);
      state_->clock.release(p.end.e);
    }
    if (state_->ref) state_->clock.release(state_->ref);
    state_.reset();
  }

  std::unique_ptr<state> state_;
};

}  // namespace dtrain::detail
