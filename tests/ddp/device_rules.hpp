// A backend with NCCL's rules on host memory, so that the GPU path of
// DistributedDataParallel runs here without a GPU:
//   - the communicator accepts device buffers only (a host buffer is the
//     config_error NCCL's own check gives) and reaches no host memory, so
//     metadata must go over the control plane;
//   - collectives take a stream and return at once; stream_wait() is where
//     the "device" catches up; on_timeout() aborts, as ncclCommAbort does;
//   - buckets live in `device_rules_memory`: host bytes tagged memory::device,
//     handled by the stream runner with its watchdog.
// Underneath, a Gloo communicator moves the bytes.
#pragma once

#include <dtrain/dtrain.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace device_rules {

/// Host bytes that DDP must treat as GPU memory of device 0, ordered on a "stream".
struct memory : dtrain::host_memory {
  static constexpr dtrain::memory where = dtrain::memory::device;
  static constexpr bool on_stream = true;
};

struct shared_state {
  std::atomic<bool> aborted{false};
  std::mutex mutex;
  std::vector<dtrain::work> outstanding;  // what stream_wait() catches up on
};

/// One collective: done when Gloo's is; aborted by the watchdog's timeout.
class rules_work final : public dtrain::detail::work_state {
 public:
  rules_work(std::string what, std::chrono::milliseconds timeout, dtrain::work inner,
             std::shared_ptr<shared_state> state)
      : work_state(std::move(what), timeout), inner_(std::move(inner)), state_(std::move(state)) {}
  bool poll() override {
    std::lock_guard lock(mutex_);  // the watchdog and stream_wait() poll alike
    if (state_->aborted) {
      fail(std::make_exception_ptr(
          dtrain::backend_error(description() + ": the communicator was aborted", 0)));
      return true;
    }
    if (!inner_.test()) return false;
    if (auto e = inner_.exception()) fail(e);
    return true;
  }
  void on_timeout() noexcept override { state_->aborted = true; }

 private:
  std::mutex mutex_;
  dtrain::work inner_;
  std::shared_ptr<shared_state> state_;
};

class communicator {
 public:
  static constexpr bool reaches_device_memory = true;
  static constexpr bool reaches_host_memory = false;
  static constexpr std::string_view name = "device-rules";
  using stream_type = dtrain::stream_handle;  // what a hook passes on (gradient_bucket::stream)

  communicator(dtrain::gloo_communicator inner, std::chrono::milliseconds timeout)
      : inner_(std::make_unique<dtrain::gloo_communicator>(std::move(inner))), timeout_(timeout) {}

  [[nodiscard]] int rank() const { return inner_->rank(); }
  [[nodiscard]] int size() const { return inner_->size(); }
  [[nodiscard]] int device() const noexcept { return 0; }
  /// Every host buffer any of DDP's code sent here.
  [[nodiscard]] static std::atomic<int>& host_buffers_seen() {
    static std::atomic<int> seen{0};
    return seen;
  }

  dtrain::work allreduce(dtrain::buffer in, dtrain::buffer out, dtrain::reduce_op op,
                         stream_type = nullptr) {
    check(in, "allreduce");
    check(out, "allreduce");
    return track("allreduce", inner_->allreduce(host(in), host(out), op));
  }
  dtrain::work broadcast(dtrain::buffer data, int root, stream_type = nullptr) {
    check(data, "broadcast");
    return track("broadcast", inner_->broadcast(host(data), root));
  }
  dtrain::work allgather(dtrain::buffer in, dtrain::buffer out, stream_type = nullptr) {
    check(in, "allgather");
    check(out, "allgather");
    return track("allgather", inner_->allgather(host(in), host(out)));
  }
  dtrain::work reduce_scatter(dtrain::buffer in, dtrain::buffer out, dtrain::reduce_op op,
                              stream_type = nullptr) {
    check(in, "reduce_scatter");
    check(out, "reduce_scatter");
    return track("reduce_scatter", inner_->reduce_scatter(host(in), host(out), op));
  }
  dtrain::work barrier(stream_type = nullptr) { return track("barrier", inner_->barrier()); }
  communicator split(int color, int key) {
    return communicator(inner_->split(color, key), timeout_);
  }

  /// The "device" catches up: blocks until every collective so far is done,
  /// or throws once the communicator was aborted (by the watchdog).
  void stream_wait(stream_type) {
    std::vector<dtrain::work> pending;
    {
      std::lock_guard lock(state_->mutex);
      pending.swap(state_->outstanding);
    }
    for (dtrain::work& w : pending) {
      while (!w.test()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (auto e = w.exception()) std::rethrow_exception(e);
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
  dtrain::work track(const char* what, dtrain::work inner) {
    dtrain::work w(std::make_shared<rules_work>(
        std::string(what) + " on rank " + std::to_string(rank()) + " (device-rules)", timeout_,
        std::move(inner), state_));
    std::lock_guard lock(state_->mutex);
    state_->outstanding.push_back(w);
    return w;
  }

  std::unique_ptr<dtrain::gloo_communicator> inner_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<shared_state> state_ = std::make_shared<shared_state>();
};

static_assert(dtrain::communicator<communicator>);

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
    return communicator(
        dtrain::gloo_communicator(
            *s.store, s.rank, s.size,
            dtrain::gloo_options{.collectives = inner, .master_addr = s.master_addr}),
        s.collectives.timeout);
  }
};
