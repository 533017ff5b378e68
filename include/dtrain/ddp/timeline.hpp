#pragma once
/// @file
/// DistributedDataParallel's timeline: a Chrome trace (JSON that Perfetto and
/// chrome://tracing open) of one rank's steps, mark_ready calls, buckets and
/// waits, written when DTRAIN_TIMELINE (or ddp_options::timeline) names a file.
/// On CUDA streams a third track holds device time: each bucket from the
/// point its gradients are ready on the compute stream to its collective's
/// completion (ddp/device_spans.hpp times them), on the host's clock.
/// Off, a recorder is one null pointer: no allocation and no clock read, one
/// branch per recording point. On, spans go into a buffer per track, each
/// with its own (uncontended: one thread per track) mutex, and the file is
/// written at the end, so nothing is formatted or written during a step.

#include <dtrain/config.hpp>
#include <dtrain/detail/json.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/names.hpp>
#include <dtrain/env/variables.hpp>
#include <dtrain/error.hpp>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain::detail {

/// The file rank `rank` writes for DTRAIN_TIMELINE=`path`: the rank goes before
/// the extension of the file name (trace.json -> trace.rank3.json), or is
/// appended with ".json" when the name has none (trace -> trace.rank3.json).
DTRAIN_DETAIL_INLINE std::string timeline_file(std::string_view path, int rank);

/// One rank's recorder. Default-constructed it is off and records nothing.
/// Recording is thread-safe; write() must not race with recording of the same
/// step (call it between steps, or after the communication thread is joined).
class timeline {
 public:
  /// The tracks, as Chrome trace threads of the rank's process.
  enum class track : std::uint8_t { training = 1, communication = 2, device = 3 };

  timeline() noexcept = default;

  /// On: records for `rank` of `size` and writes timeline_file(path, rank).
  /// Creates the file now, so that a path that cannot be written is a
  /// config_error before training starts (naming the path and the rank).
  timeline(std::string_view path, int rank, int size, std::vector<std::string> parameter_names);

  /// The recorder DistributedDataParallel gets: on when DTRAIN_TIMELINE in
  /// `env` (which wins) or `option` names a file, naming the spans of `params`
  /// by their names.
  template <class Parameters>
  static timeline of(const environment& env, const std::string& option, int rank, int size,
                     const Parameters& params) {
    const std::string path = read_setting(env, timeline_variable, option);
    if (path.empty()) return {};
    std::vector<std::string> names;
    for (const auto& p : params) names.push_back(p.name);
    return timeline(path, rank, size, std::move(names));
  }

  [[nodiscard]] bool on() const noexcept { return state_ != nullptr; }
  /// The file this rank writes; empty when off.
  [[nodiscard]] std::string_view file() const noexcept {
    return state_ ? std::string_view(state_->file) : std::string_view();
  }

  /// Nanoseconds on the steady clock (shared by the processes of a host, so
  /// that their traces line up when merged).
  [[nodiscard]] static std::int64_t now() noexcept;

  /// A span from its construction to its destruction; nothing when off.
  class scope {
   public:
    scope(timeline& t, void (timeline::*done)(std::int64_t, std::uint64_t, std::uint64_t),
          std::uint64_t index, std::uint64_t detail = 0) noexcept
        : t_(t.on() ? &t : nullptr), done_(done), index_(index), detail_(detail) {
      if (t_) start_ = now();
    }
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;
    ~scope() {
      if (t_) (t_->*done_)(start_, index_, detail_);
    }

   private:
    timeline* t_;
    void (timeline::*done_)(std::int64_t, std::uint64_t, std::uint64_t);
    std::uint64_t index_;
    std::uint64_t detail_;
    std::int64_t start_ = 0;
  };

  /// mark_ready of parameter `index` (in `bucket`), on the training track. The
  /// first mark of a step opens the step's span.
  [[nodiscard]] scope mark_ready(std::size_t index, std::size_t bucket) noexcept {
    return scope(*this, &timeline::mark_done, index, bucket);
  }
  /// synchronize() of step `step`; when it ends, the step's span ends too.
  [[nodiscard]] scope synchronize(std::size_t step) noexcept {
    return scope(*this, &timeline::synchronize_done, step);
  }
  /// The wait for the buckets inside synchronize().
  [[nodiscard]] scope wait(std::size_t buckets) noexcept {
    return scope(*this, &timeline::wait_done, buckets);
  }

  /// Bucket `bucket` of `elements` is launched: returns the id of its span
  /// (0 when off), which bucket_done() closes.
  std::uint64_t bucket_launched(std::size_t bucket, std::size_t elements);
  /// The reduction of bucket `bucket` (span `id`) ran from `started` (prepare)
  /// to now (finished); `on_thread`: on the communication thread, which gets a
  /// span of its own (on CUDA streams the host only enqueues, so no such span).
  void bucket_done(std::size_t bucket, std::uint64_t id, std::int64_t started, bool on_thread);
  /// Bucket `bucket` (span `id`) on the device, times on this clock (now()):
  /// ready on the compute stream at `start`, its collective complete at
  /// `end`. A span on the device track; the bucket's span ends at `end`.
  void device_done(std::size_t bucket, std::uint64_t id, std::int64_t start, std::int64_t end);
  /// How far the device clock's tie to this one may be off (ns), for the file.
  void device_clock(std::int64_t uncertainty_ns);

  /// Writes the file (everything recorded so far). Throws dtrain::error naming
  /// the file and the rank when it cannot be written.
  void write() const;
  /// write(), for destructors: a failure is one line on stderr, never an exception.
  void write_at_exit() const noexcept;

  /// At most this many events per track are kept (about 48 MiB); the rest are
  /// counted, and the file says how many were dropped.
  static constexpr std::size_t max_events = std::size_t{1} << 20;
  static constexpr std::size_t chunk_events = 4096;

 private:
  enum class kind : std::uint8_t {
    step,
    mark,
    synchronize,
    wait,
    reduce,
    bucket_begin,
    bucket_end,
    device
  };

  struct event {
    kind what = kind::step;
    std::int64_t start = 0;  // ns, steady clock
    std::int64_t end = 0;
    std::uint64_t index = 0;   // step, parameter or bucket
    std::uint64_t detail = 0;  // mark: its bucket; bucket_begin: elements; wait: buckets
    std::uint64_t id = 0;      // bucket_begin / bucket_end
  };

  struct buffer {
    mutable std::mutex mutex;
    // Fixed chunks, not one vector: growing never copies what was recorded
    // (a doubling vector costs a step its whole history once in a while).
    std::vector<std::vector<event>> chunks;
    std::size_t count = 0;
    std::size_t dropped = 0;
  };

  struct state {
    std::string file;
    std::string setting;
    int rank = 0;
    int size = 1;
    std::vector<std::string> names;
    std::array<buffer, 3> tracks;
    std::int64_t device_clock = -1;  // ns; -1: no device track
    std::int64_t step_start = -1;    // training thread only
    std::uint64_t launches = 0;      // training thread only
  };

  void append(track t, const event& e);

  void mark_done(std::int64_t start, std::uint64_t index, std::uint64_t bucket);
  void wait_done(std::int64_t start, std::uint64_t, std::uint64_t buckets) {
    append(track::training, {.what = kind::wait, .start = start, .end = now(), .detail = buckets});
  }
  void synchronize_done(std::int64_t start, std::uint64_t step, std::uint64_t);

  static void microseconds(std::string& out, std::int64_t ns);

  std::string name_of(const event& e) const;

  static const char* category_of(kind k);

  void render_event(std::string& out, track t, const event& e) const;

  void metadata(std::string& out, const char* what, int tid, std::string_view name) const;

  std::string render() const;

  std::unique_ptr<state> state_;
};

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/ddp/timeline-inl.hpp>
#endif
