// A backend with NCCL's rules on host memory, so that the GPU path of
// DistributedDataParallel runs here without a GPU:
//   - the communicator accepts device buffers only (a host buffer is the
//     config_error NCCL's own check gives) and reaches no host memory, so
//     metadata must go over the control plane;
//   - collectives take a stream and return at once; each communicator runs
//     them in order on a "stream" of its own (a thread), after everything
//     enqueued so far on the stream passed in (another communicator's
//     stream(), as NCCL orders after a cudaStream_t), so topology::hierarchical
//     enqueues its steps at once as it does on NCCL; stream_wait() is where
//     the "device" catches up; on_timeout() aborts, as ncclCommAbort does;
//   - buckets live in `device_rules_memory`: host bytes tagged memory::device,
//     handled by the stream runner with its watchdog;
//   - DEVICE_RULES_COLLECTIVE_MS=n: each collective takes n ms more on its
//     stream, and those that complete are logged with their times
//     (communicator::ran(), for the timeline's device spans).
// Underneath, a Gloo communicator moves the bytes.
#pragma once

#include <dtrain/dtrain.hpp>

#include "../support/fake_stream.hpp"
#include "../support/trace_check.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace device_rules {

class rules_work;

using fake_device::fake_stream;
using fake_device::handle_of;
using fake_device::register_stream;
using fake_device::stream_of;

struct shared_state {
  std::atomic<bool> aborted{false};
};

/// One collective: done once its stream has run it; aborted by the watchdog's timeout.
class rules_work final : public dtrain::detail::work_state {
 public:
  rules_work(std::string what, std::chrono::milliseconds timeout,
             std::shared_ptr<shared_state> state)
      : work_state(std::move(what), timeout), state_(std::move(state)) {}
  bool poll() override {
    if (*done_) return true;
    if (state_->aborted) {
      std::lock_guard lock(mutex_);
      fail(std::make_exception_ptr(
          dtrain::backend_error(description() + ": the communicator was aborted", 0)));
      return true;
    }
    return false;
  }
  void on_timeout() noexcept override { state_->aborted = true; }
  /// `waiter` waits for this collective alone, not for what its stream took
  /// after it; counted (waits_for_one()). A fake stream waits as CUDA's does
  /// for an event (a task of its own, the host goes on); the null stream is
  /// the host, which waits here.
  bool stream_wait(dtrain::stream_handle waiter) override {
    ++waits_for_one();
    if (auto s = stream_of(waiter)) {
      s->enqueue({}, [done = done_, state = state_] {
        while (!*done && !state->aborted)
          std::this_thread::sleep_for(std::chrono::microseconds(100));
      });
      return true;
    }
    while (!*done_) {
      if (state_->aborted) {
        throw dtrain::backend_error(description() + ": the communicator was aborted", 0);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return true;
  }
  /// How many times a stream waited for one collective (work::stream_wait).
  [[nodiscard]] static std::atomic<int>& waits_for_one() {
    static std::atomic<int> count{0};
    return count;
  }
  void finish(std::exception_ptr e) {
    if (e) {
      std::lock_guard lock(mutex_);
      fail(e);
    }
    *done_ = true;
  }

 private:
  std::mutex mutex_;
  // Shared with the stream tasks that wait for it (stream_wait), which may outlive this.
  std::shared_ptr<std::atomic<bool>> done_ = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<shared_state> state_;
};

class communicator {
 public:
  static constexpr bool reaches_device_memory = true;
  static constexpr bool reaches_host_memory = false;
  static constexpr std::string_view name = "device-rules";
  /// Collectives run on stream(), after the stream they are given: as NCCL's.
  static constexpr bool stream_ordered = true;
  using stream_type = dtrain::stream_handle;  // what a hook passes on (gradient_bucket::stream)

  communicator(dtrain::gloo_communicator inner, std::chrono::milliseconds timeout)
      : inner_(std::make_unique<dtrain::gloo_communicator>(std::move(inner))), timeout_(timeout) {
    register_stream(stream_);
    const std::lock_guard lock(communicator_streams_mutex());
    communicator_streams().push_back(handle_of(stream_));
  }
  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;
  /// Lets the stream finish what it holds (aborted tasks end at once): they use inner_.
  ~communicator() {
    static const std::atomic<bool> never{false};
    if (stream_) stream_->synchronize(never);
  }

  [[nodiscard]] int rank() const { return inner_->rank(); }
  [[nodiscard]] int size() const { return inner_->size(); }
  [[nodiscard]] bool valid() const { return inner_ && inner_->valid(); }
  [[nodiscard]] int device() const noexcept { return 0; }
  /// How many times a stream other than a communicator's (a compute stream)
  /// waited for every collective so far (stream_wait()); the hierarchical
  /// topology's waits of one level's stream for the other's are not counted.
  [[nodiscard]] static std::atomic<int>& waits_for_all() {
    static std::atomic<int> count{0};
    return count;
  }
  [[nodiscard]] static bool is_communicator_stream(stream_type s) {
    const std::lock_guard lock(communicator_streams_mutex());
    const auto& all = communicator_streams();
    return std::find(all.begin(), all.end(), s) != all.end();
  }
  /// The collectives that completed, with their times (DEVICE_RULES_COLLECTIVE_MS).
  [[nodiscard]] static std::vector<dtrain_test::collective_run>& ran() {
    static std::vector<dtrain_test::collective_run> all;
    return all;
  }
  [[nodiscard]] static std::mutex& ran_mutex() {
    static std::mutex m;
    return m;
  }
  /// Every host buffer any of DDP's code sent here.
  [[nodiscard]] static std::atomic<int>& host_buffers_seen() {
    static std::atomic<int> seen{0};
    return seen;
  }

  dtrain::work allreduce(dtrain::buffer in, dtrain::buffer out, dtrain::reduce_op op,
                         stream_type after = nullptr) {
    check(in, "allreduce");
    check(out, "allreduce");
    return enqueue("allreduce", after,
                   [=, g = inner_.get()] { return g->allreduce(host(in), host(out), op); });
  }
  dtrain::work broadcast(dtrain::buffer data, int root, stream_type after = nullptr) {
    check(data, "broadcast");
    return enqueue("broadcast", after,
                   [=, g = inner_.get()] { return g->broadcast(host(data), root); });
  }
  dtrain::work allgather(dtrain::buffer in, dtrain::buffer out, stream_type after = nullptr) {
    check(in, "allgather");
    check(out, "allgather");
    return enqueue("allgather", after,
                   [=, g = inner_.get()] { return g->allgather(host(in), host(out)); });
  }
  dtrain::work reduce_scatter(dtrain::buffer in, dtrain::buffer out, dtrain::reduce_op op,
                              stream_type after = nullptr) {
    check(in, "reduce_scatter");
    check(out, "reduce_scatter");
    return enqueue("reduce_scatter", after,
                   [=, g = inner_.get()] { return g->reduce_scatter(host(in), host(out), op); });
  }
  dtrain::work alltoall(dtrain::buffer in, dtrain::buffer out, stream_type after = nullptr) {
    check(in, "alltoall");
    check(out, "alltoall");
    return enqueue("alltoall", after,
                   [=, g = inner_.get()] { return g->alltoall(host(in), host(out)); });
  }
  dtrain::work barrier(stream_type after = nullptr) {
    return enqueue("barrier", after, [g = inner_.get()] { return g->barrier(); });
  }
  /// As ncclCommSplit: waits for this communicator's stream first.
  communicator split(int color, int key) {
    stream_->synchronize(state_->aborted);
    return communicator(inner_->split(color, key), timeout_);
  }

  /// The stream collectives run on, to order other work after them.
  [[nodiscard]] stream_type stream() const noexcept { return handle_of(stream_); }

  /// The "device" catches up: blocks until every collective so far is done,
  /// or throws once the communicator was aborted (by the watchdog).
  void stream_wait(stream_type waiter) {
    if (!is_communicator_stream(waiter)) ++waits_for_all();
    stream_->synchronize(state_->aborted);
    if (state_->aborted) {
      throw dtrain::backend_error(
          "device-rules communicator of rank " + std::to_string(rank()) + " was aborted", 0);
    }
  }

 private:
  static void check(const dtrain::buffer& b, const char* what) {
    if (b.where != dtrain::memory::device) {
      ++host_buffers_seen();
      throw dtrain::config_error(std::string(what) +
                                 ": input is host memory, and NCCL reduces device memory only "
                                 "(device-rules test communicator)");
    }
  }
  static dtrain::buffer host(dtrain::buffer b) {
    b.where = dtrain::memory::host;
    return b;
  }
  // Enqueues `launch` on this communicator's stream, after what `after` holds now.
  template <class Launch>
  dtrain::work enqueue(const char* what, stream_type after, Launch launch) {
    auto w = std::make_shared<rules_work>(
        std::string(what) + " on rank " + std::to_string(rank()) + " (device-rules)", timeout_,
        state_);
    fake_stream::marker wait_for;
    if (auto s = stream_of(after)) wait_for = s->now(s);
    auto state = state_;
    const char* slow = std::getenv("DEVICE_RULES_COLLECTIVE_MS");
    const int slow_ms = slow ? std::atoi(slow) : 0;
    stream_->enqueue(wait_for, [w, state, wait_for, launch, slow_ms] {
      if (auto other = wait_for.stream.lock()) other->reached(wait_for.count, state->aborted);
      std::exception_ptr failure;
      try {
        if (state->aborted) throw dtrain::backend_error("aborted before it ran", 0);
        const std::int64_t started = dtrain::detail::timeline::now();
        dtrain::work inner = launch();
        while (!inner.test()) {
          if (state->aborted) throw dtrain::backend_error("aborted while it ran", 0);
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
        failure = inner.exception();
        if (slow_ms > 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
          const std::lock_guard lock(ran_mutex());
          ran().push_back({started, dtrain::detail::timeline::now()});
        }
      } catch (...) {
        failure = std::current_exception();
      }
      w->finish(failure);
    });
    return dtrain::work(std::move(w));
  }

  std::unique_ptr<dtrain::gloo_communicator> inner_;
  std::chrono::milliseconds timeout_;
  // The handles of every communicator's stream so far, for waits_for_all().
  static std::mutex& communicator_streams_mutex() {
    static std::mutex m;
    return m;
  }
  static std::vector<stream_type>& communicator_streams() {
    static std::vector<stream_type> all;
    return all;
  }

  std::shared_ptr<shared_state> state_ = std::make_shared<shared_state>();
  std::shared_ptr<fake_stream> stream_ =
      std::make_shared<fake_stream>();  // last: its tasks use inner_
};

static_assert(dtrain::communicator<communicator>);

/// Host bytes that DDP must treat as GPU memory of device 0, ordered on a
/// "stream" (a stream_handle naming a fake_stream, or null). The copies and
/// casts run at once on the host; synchronize() and order_after() wait for
/// what a fake stream holds, so DDP's ordering after the compute stream (its
/// first broadcast, a stream change) is what it is on CUDA.
struct memory {
  using stream_type = dtrain::stream_handle;
  using host = dtrain::host_memory;
  static constexpr dtrain::memory where = dtrain::memory::device;
  static constexpr bool on_stream = true;

  /// The timeline's device time on fake streams (cuda_memory's device_timer
  /// over events): an event is a stamp of the host's steady clock, taken when
  /// its stream reaches it (at once on the null stream, which is the host).
  class device_timer {
   public:
    struct stamp {
      std::atomic<std::int64_t> ns{-1};
    };
    using event = std::shared_ptr<stamp>;  // shared with the task that stamps it
    explicit device_timer(int /*device*/) : stream_(std::make_shared<fake_stream>()) {
      register_stream(stream_);
    }
    [[nodiscard]] stream_type stream() const noexcept { return handle_of(stream_); }
    [[nodiscard]] event record(stream_type on) {
      auto e = std::make_shared<stamp>();
      if (auto s = stream_of(on)) {
        s->enqueue({}, [e] { e->ns = dtrain::detail::timeline::now(); });
      } else {
        e->ns = dtrain::detail::timeline::now();
      }
      return e;
    }
    [[nodiscard]] bool reached(const event& e) const noexcept { return e->ns >= 0; }
    [[nodiscard]] double elapsed_ns(const event& from, const event& to) const noexcept {
      return static_cast<double>(to->ns - from->ns);
    }
    void release(const event&) noexcept {}  // the last owner frees it

   private:
    std::shared_ptr<fake_stream> stream_;
  };

  [[nodiscard]] static void* allocate(std::size_t bytes, int device, stream_type) {
    return host::allocate(bytes, device, nullptr);
  }
  static void release(void* data, int device, stream_type) noexcept {
    host::release(data, device, nullptr);
  }
  static void zero(void* data, std::size_t bytes, int device, stream_type) {
    host::zero(data, bytes, device, nullptr);
  }
  static void copy(void* dst, const void* src, std::size_t bytes, int device, stream_type) {
    host::copy(dst, src, bytes, device, nullptr);
  }
  static void upload(void* dst, const void* src, std::size_t bytes, int device, stream_type) {
    host::upload(dst, src, bytes, device, nullptr);
  }
  static void download(void* dst, const void* src, std::size_t bytes, int device, stream_type) {
    host::download(dst, src, bytes, device, nullptr);
  }
  static void compress(void* out, const float* in, std::size_t n, float scale, dtrain::dtype wire,
                       int device, stream_type) {
    host::compress(out, in, n, scale, wire, device, nullptr);
  }
  static void decompress(float* out, const void* in, std::size_t n, dtrain::dtype wire, int device,
                         stream_type) {
    host::decompress(out, in, n, wire, device, nullptr);
  }
  /// On the stream it is given (a communicator's, after its alltoall), as a
  /// kernel is: the sum must not run before the blocks arrive.
  static void accumulate(void* out, dtrain::dtype out_type, const void* in, dtrain::dtype in_type,
                         std::size_t blocks, std::size_t count, float divisor, int,
                         stream_type stream) {
    auto sum = [=] {
      dtrain::detail::host_accumulate(out, out_type, in, in_type, blocks, count, divisor);
    };
    if (auto s = stream_of(stream)) {
      s->enqueue({}, sum);
    } else {
      sum();
    }
  }
  static void synchronize(int, stream_type stream) {
    static const std::atomic<bool> never{false};
    if (auto s = stream_of(stream)) s->synchronize(never);
  }
  [[nodiscard]] static bool casts_available() noexcept { return true; }
  static void check_stream(int, stream_type) noexcept {}
  /// The host waits for `before` (stricter than CUDA's event, which the device waits for).
  static void order_after(int device, stream_type waiter, stream_type before) {
    if (waiter != before) synchronize(device, before);
  }
};

/// The backend tag.
struct backend {
  static constexpr bool available = true;
  static constexpr std::string_view name = "device-rules";
};

}  // namespace device_rules

template <>
struct dtrain::backend_traits<device_rules::backend> {
  using communicator = device_rules::communicator;
  using memory_space = device_rules::memory;
  static constexpr bool uses_gpus = false;
  static constexpr bool needs_store = true;
  template <class Store>
  static communicator make(const communicator_setup<Store>& s) {
    // Gloo's own timeout is longer, so that the watchdog is what ends a hung collective.
    dtrain::collective_options inner = s.collectives;
    inner.timeout = s.collectives.timeout * 3;
    dtrain::gloo_options options{.collectives = inner, .master_addr = s.master_addr, .env = *s.env};
    return communicator(dtrain::gloo_communicator(*s.store, s.rank, s.size, std::move(options)),
                        s.collectives.timeout);
  }
};
