#pragma once
/// @file
/// How DistributedDataParallel's buckets travel, chosen from the memory space
/// of the backend: `thread_runner` for host memory (a communication thread
/// reduces buckets while the caller computes; the caller takes over what is
/// left once it waits), `stream_runner` for CUDA
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
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace dtrain::detail {

/// A task of the owner's queued in order with the buckets (post_in_order()):
/// `done` once it ran, or was dropped after a failure; what it threw is kept
/// for wait(). The runner's lock guards both.
struct posted_task {
  bool done = false;
  std::exception_ptr thrown;
  work collective;  ///< streams: the collective enqueued, for its owner to order after it
};

/// Buckets are reduced one at a time, in launch order: each is prepared,
/// reduced and waited for (within the collective timeout), then finished.
/// A thread of its own takes the buckets launched while the caller is still
/// computing. Once the caller is in complete(), the queue is the caller's: it
/// reduces what is left on its own thread (after the bucket the thread holds,
/// if any), and the thread takes nothing more. The last buckets of a step
/// (launched as the backward pass ends) then cost no thread wake-up, which on
/// a loaded machine can cost more than the collective.
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

  /// Queues `bucket`; `wake` false leaves the thread asleep, for a bucket the
  /// caller is about to reduce itself in complete() (launched by
  /// mark_all_ready() or synchronize(): nothing left to overlap with).
  void launch(std::size_t bucket, bool wake = true) {
    bool idle = false;
    {
      std::lock_guard lock(mutex_);
      queue_.push_back({bucket, {}, {}});
      idle = !busy_;
    }
    if (idle && wake) wake_.notify_one();  // a busy thread takes it next by itself
  }

  /// Queues `task` (a collective of the owner's, as stage 3's allgather of a
  /// bucket's values: it returns the collective's work, which the runner
  /// waits for within its timeout) after everything launched before it, so
  /// that every rank issues its collectives in the same order, and returns
  /// at once: the thread runs it while the caller computes (stage 3's
  /// prefetch), or the caller in wait(). A task that throws fails the runner
  /// (the ranks' collectives are out of step): nothing queued after it runs.
  /// After a failure the task does not run.
  std::shared_ptr<posted_task> post_in_order(std::function<work()> task) {
    auto posted = std::make_shared<posted_task>();
    bool idle = false;
    {
      std::lock_guard lock(mutex_);
      queue_.push_back({0, std::move(task), posted});
      idle = !busy_;
    }
    if (idle) wake_.notify_one();
    return posted;
  }

  /// Returns once `posted` ran, rethrowing what it threw, or the failure
  /// that dropped it; runs queued work itself while the thread is idle.
  void wait(const std::shared_ptr<posted_task>& posted) {
    std::unique_lock lock(mutex_);
    ++tasks_waiting_;
    while (!posted->done) {
      if (!busy_ && !queue_.empty()) {
        run_front(lock);
      } else if (failure_ && !busy_) {
        break;  // dropped, or never to run: nothing runs after a failure
      } else {
        done_wake_.wait(lock);
      }
    }
    --tasks_waiting_;
    if (posted->thrown) std::rethrow_exception(posted->thrown);
    if (!posted->done) std::rethrow_exception(failure_);
  }

  /// Whether `posted` ran or will never run (a failure): its buffers are
  /// free to go.
  bool settled(const std::shared_ptr<posted_task>& posted) {
    std::lock_guard lock(mutex_);
    return posted->done || (failure_ && !busy_);
  }

  /// Blocks the caller while more than `most` launched buckets are not yet
  /// reduced, reducing one itself when the thread is idle (each bounded by
  /// the collective timeout; at once after a failure): bounds the gradient
  /// memory in flight when the backward pass writes faster than the buckets
  /// travel. The step is bound by the communication then anyway.
  void throttle(std::size_t most) {
    std::unique_lock lock(mutex_);
    while (!failure_ && queue_.size() + (busy_ ? 1 : 0) > most) {
      if (!busy_ && !queue_.empty()) {
        run_front(lock);
      } else {
        ++throttled_;
        done_wake_.wait(lock);
        --throttled_;
      }
    }
  }

  /// Waits until the `count` buckets of this step are done, reducing queued
  /// ones on the calling thread while the runner's thread is idle; then the
  /// next step starts counting from zero. Returns the first failure, or null.
  std::exception_ptr complete(std::size_t count) {
    std::unique_lock lock(mutex_);
    completing_ = true;
    while (done_ != count) {
      if (!busy_ && !queue_.empty()) {
        run_front(lock);
      } else {
        done_wake_.wait(lock);
      }
    }
    completing_ = false;
    done_ = 0;
    return failure_;
  }

 private:
  void serve() {
    std::unique_lock lock(mutex_);
    for (;;) {
      if (!completing_ && !busy_ && !queue_.empty()) {
        run_front(lock);
      } else if (stopping_ && queue_.empty() && !busy_) {
        return;  // nothing left in flight
      } else {
        wake_.wait(lock);
      }
    }
  }

  /// Reduces the bucket at the front of the queue; `lock` is held on entry
  /// and on return, and released while the bucket travels.
  void run_front(std::unique_lock<std::mutex>& lock) {
    item front = std::move(queue_.front());
    queue_.pop_front();
    if (front.task) {  // post_in_order's: not a bucket of the step
      if (!failure_) {
        busy_ = true;
        lock.unlock();
        std::exception_ptr thrown;
        try {
          front.task().wait();  // bounded by the collective timeout
        } catch (...) {
          thrown = std::current_exception();
        }
        lock.lock();
        busy_ = false;
        if (thrown) {
          front.posted->thrown = thrown;  // for its waiter
          if (!failure_) failure_ = thrown;
        }
      } else {
        front.posted->thrown = failure_;  // dropped unrun
      }
      front.posted->done = true;
      done_wake_.notify_all();
      return;
    }
    const std::size_t b = front.bucket;
    std::exception_ptr failed;
    if (!failure_) {  // once the communicator failed, do not wait for it again
      busy_ = true;
      lock.unlock();
      try {
        owner_.prepare_bucket(b);
        work w = owner_.reduce(b);
        w.wait();  // bounded by the collective timeout
        owner_.finish_bucket(b);
      } catch (...) {
        failed = std::current_exception();
      }
      lock.lock();
      busy_ = false;
    }
    if (failed && !failure_) failure_ = failed;
    ++done_;
    // Once the caller waits in complete(), the queue is the caller's: the
    // thread finishes the bucket it holds and hands over (one wake-up).
    if (completing_ || throttled_ > 0 || tasks_waiting_ > 0) done_wake_.notify_all();
  }

  struct item {
    std::size_t bucket = 0;
    std::function<work()> task;  ///< set: post_in_order's task instead of a bucket
    std::shared_ptr<posted_task> posted;
  };

  Owner& owner_;
  std::mutex mutex_;
  std::condition_variable wake_;       // the thread: a bucket to reduce, or stop
  std::condition_variable done_wake_;  // the caller in complete(): the thread let go of a bucket
  std::deque<item> queue_;
  std::size_t done_ = 0;
  bool busy_ = false;        // a bucket is being reduced (by the thread or the caller)
  bool completing_ = false;  // the caller is in complete(): the queue is its own
  int throttled_ = 0;        // callers waiting in throttle()
  int tasks_waiting_ = 0;    // callers waiting in wait()
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

  /// Enqueues `bucket` on the device now (`wake` is the thread runner's:
  /// there is no thread to wake here).
  void launch(std::size_t bucket, bool /*wake*/ = true) {
    if (auto e = watchdog_.failure()) std::rethrow_exception(e);
    owner_.prepare_bucket(bucket);
    work collective = owner_.reduce(bucket);
    watchdog_.watch(collective);  // first: followed even if what comes next throws
    owner_.reduce_enqueued(bucket, collective);
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

  /// The device orders the buckets; the host does not wait for them.
  void throttle(std::size_t /*most*/) noexcept {}

  /// Enqueues `task`'s collective now (the device keeps the order of what is
  /// enqueued) under the watchdog, as a bucket's; the host does not wait.
  std::shared_ptr<posted_task> post_in_order(const std::function<work()>& task) {
    if (auto e = watchdog_.failure()) std::rethrow_exception(e);
    auto posted = std::make_shared<posted_task>();
    posted->collective = task();
    watchdog_.watch(posted->collective);
    posted->done = true;
    return posted;
  }
  /// The task is enqueued already: the watchdog's failure, if any, is
  /// thrown. The owner orders its compute stream after the collective
  /// (posted->collective.stream_wait(), or order_after_buckets()) before
  /// using what it wrote.
  void wait(const std::shared_ptr<posted_task>& /*posted*/) {
    if (auto e = watchdog_.failure()) std::rethrow_exception(e);
  }
  /// Enqueued: once the owner's compute stream is ordered after it, its
  /// buffers may go (a stream-ordered free on that stream).
  bool settled(const std::shared_ptr<posted_task>& /*posted*/) const noexcept { return true; }

 private:
  Owner& owner_;
  watchdog watchdog_;
};

}  // namespace dtrain::detail
