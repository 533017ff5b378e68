// A device stream on the host, for tests that keep CUDA's stream rules
// without a GPU: tests/ddp/device_rules.hpp (DDP's GPU path over Gloo) and
// tests/engines/fake_nccl.hpp (the NCCL engine over a host fake of CUDA and
// NCCL). Streams are named by handles (a cudaStream_t or dtrain's
// stream_handle: the fake_stream's address), found again through a registry.
#pragma once

#include <dtrain/dtrain.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace fake_device {

/// A device stream on the host: a thread that runs what is enqueued in order.
/// A task may first wait until another stream has completed what had been
/// enqueued there when the task was (an event recorded there, waited on here).
class fake_stream {
 public:
  struct marker {
    std::weak_ptr<fake_stream> stream;  // gone: its owner synchronized it before letting go
    std::uint64_t count = 0;
  };
  fake_stream() : thread_([this] { serve(); }) {}
  fake_stream(const fake_stream&) = delete;
  fake_stream& operator=(const fake_stream&) = delete;
  ~fake_stream() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  /// The point a task enqueued elsewhere now must wait for.
  marker now(std::shared_ptr<fake_stream> self) {
    std::lock_guard lock(mutex_);
    return {std::move(self), enqueued_};
  }
  void enqueue(marker after, std::function<void()> task) {
    {
      std::lock_guard lock(mutex_);
      ++enqueued_;
      queue_.push_back({std::move(after), std::move(task)});
    }
    wake_.notify_all();
  }
  /// Blocks until everything enqueued so far has run, or `aborted` (checked every 10 ms).
  void synchronize(const std::atomic<bool>& aborted) {
    std::unique_lock lock(mutex_);
    reach_locked(lock, enqueued_, aborted);
  }
  /// Whether `count` tasks have run here (a query that does not block).
  bool has_reached(std::uint64_t count) {
    std::lock_guard lock(mutex_);
    return completed_ >= count;
  }
  /// How many tasks are enqueued and not yet run.
  std::uint64_t pending() {
    std::lock_guard lock(mutex_);
    return enqueued_ - completed_;
  }
  /// Blocks until `count` tasks have run here, or `aborted`.
  void reached(std::uint64_t count, const std::atomic<bool>& aborted) {
    std::unique_lock lock(mutex_);
    reach_locked(lock, count, aborted);
  }

 private:
  struct task {
    marker after;
    std::function<void()> run;
  };
  void reach_locked(std::unique_lock<std::mutex>& lock, std::uint64_t count,
                    const std::atomic<bool>& aborted) {
    while (completed_ < count && !aborted.load())
      done_wake_.wait_for(lock, std::chrono::milliseconds(10));
  }
  void serve() {
    for (;;) {
      task t;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      t.run();
      t = {};  // what it holds goes before the stream says it is done (its owner may then go)
      {
        std::lock_guard lock(mutex_);
        ++completed_;
      }
      done_wake_.notify_all();
    }
  }
  std::mutex mutex_;
  std::condition_variable wake_, done_wake_;
  std::deque<task> queue_;
  std::uint64_t enqueued_ = 0, completed_ = 0;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once everything above exists
};

/// Every fake_stream handed out as a handle (the communicators' and the tests'
/// compute streams), to find the stream a handle names.
inline std::mutex& streams_mutex() {
  static std::mutex m;
  return m;
}
inline std::vector<std::weak_ptr<fake_stream>>& streams() {
  static std::vector<std::weak_ptr<fake_stream>> all;
  return all;
}
inline dtrain::stream_handle handle_of(const std::shared_ptr<fake_stream>& s) noexcept {
  return reinterpret_cast<dtrain::stream_handle>(s.get());
}
/// Makes `s` findable from its handle; returns the handle.
inline dtrain::stream_handle register_stream(const std::shared_ptr<fake_stream>& s) {
  std::lock_guard lock(streams_mutex());
  std::erase_if(streams(), [](const auto& w) { return w.expired(); });
  streams().push_back(s);
  return handle_of(s);
}
/// The stream a handle names: one of the device-rules streams, or none
/// (null: the legacy default stream, which has nothing to wait for here).
inline std::shared_ptr<fake_stream> stream_of(dtrain::stream_handle handle) {
  if (!handle) return nullptr;
  std::lock_guard lock(streams_mutex());
  for (const auto& weak : streams()) {
    auto s = weak.lock();
    if (s && handle_of(s) == handle) return s;
  }
  return nullptr;
}

}  // namespace fake_device
