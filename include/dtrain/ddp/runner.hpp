#pragma once
/// @file
/// How DistributedDataParallel's buckets travel, chosen from the memory space
/// of the backend: `thread_runner` for host memory (a communication thread
/// reduces buckets while the caller computes), `stream_runner` for CUDA
/// streams (the caller enqueues, the device orders, a watchdog follows).
/// Both call the same three steps of their owner: prepare_bucket(b) (copy-in,
/// compression), reduce(b) (the collective, a work), finish_bucket(b)
/// (decompression, copy-out), and for streams order_after_buckets().

#include <dtrain/backend/watchdog.hpp>
#include <dtrain/backend/work.hpp>

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

namespace dtrain::detail {

/// A thread of its own reduces buckets in launch order: each is prepared,
/// reduced and waited for (within the collective timeout), then finished.
template <class Owner>
class thread_runner {
 public:
  explicit thread_runner(Owner& owner) : owner_(owner), thread_([this] { serve(); }) {}
  thread_runner(const thread_runner&) = delete;
  thread_runner& operator=(const thread_runner&) = delete;
  /// Finishes what is queued (each bounded by its timeout), then joins.
  ~thread_runner() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  void launch(std::size_t bucket) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(bucket);
    }
    wake_.notify_one();
  }

  /// Waits until the `count` buckets of this step are done; then the next
  /// step starts counting from zero. Returns the first failure, or null.
  std::exception_ptr complete(std::size_t count) {
    std::unique_lock lock(mutex_);
    done_wake_.wait(lock, [&] { return done_ == count; });
    done_ = 0;
    return failure_;
  }

 private:
  void serve() {
    for (;;) {
      std::size_t b = 0;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and nothing left in flight
        b = queue_.front();
        queue_.pop_front();
        if (failure_) {  // the communicator failed already: do not wait for it again
          ++done_;
          done_wake_.notify_all();
          continue;
        }
      }
      std::exception_ptr failed;
      try {
        owner_.prepare_bucket(b);
        work w = owner_.reduce(b);
        w.wait();  // bounded by the collective timeout
        owner_.finish_bucket(b);
      } catch (...) {
        failed = std::current_exception();
      }
      {
        std::lock_guard lock(mutex_);
        if (failed && !failure_) failure_ = failed;
        ++done_;
      }
      done_wake_.notify_all();
    }
  }

  Owner& owner_;
  std::mutex mutex_;
  std::condition_variable wake_;       // work for the thread, or stop
  std::condition_variable done_wake_;  // a bucket finished
  std::deque<std::size_t> queue_;
  std::size_t done_ = 0;
  bool stopping_ = false;
  std::exception_ptr failure_;
  std::thread thread_;  // last: starts once everything above exists
};

/// The caller's thread enqueues each bucket on the device (after the compute
/// stream); the host never waits for a bucket. A watchdog follows every
/// collective and, past its timeout, aborts the communicator (which frees
/// the stream) and keeps the timeout_error; complete() and the next
/// launch() report it.
template <class Owner>
class stream_runner {
 public:
  explicit stream_runner(Owner& owner) : owner_(owner) {}

  void launch(std::size_t bucket) {
    if (auto e = watchdog_.failure()) std::rethrow_exception(e);
    owner_.prepare_bucket(bucket);
    watchdog_.watch(owner_.reduce(bucket));
  }

  /// Orders the compute stream after every bucket and enqueues their
  /// finishing work there; the host does not wait. Returns the watchdog's
  /// failure so far, or null.
  std::exception_ptr complete(std::size_t count) {
    if (auto e = watchdog_.failure()) return e;
    try {
      owner_.order_after_buckets();
      for (std::size_t b = 0; b < count; ++b) owner_.finish_bucket(b);
    } catch (...) {
      // The watchdog's timeout says more than the aborted communicator's error it
      // causes; it is recorded just after the abort, so let the watchdog settle.
      if (auto e = watchdog_.drain()) return e;
      return std::current_exception();
    }
    return watchdog_.failure();
  }

  /// Blocks until every bucket launched so far has completed on the device
  /// (each within its timeout); returns the first failure, or null.
  std::exception_ptr drain() { return watchdog_.drain(); }

 private:
  Owner& owner_;
  watchdog watchdog_;
};

}  // namespace dtrain::detail
