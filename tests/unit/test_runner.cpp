// DistributedDataParallel's host bucket runner (ddp/runner.hpp): throttle(),
// which stage 2's transient buckets use to bound the gradient memory in
// flight, waits for the buckets ahead of it, reduces them itself when the
// runner's thread is asleep, and never outlives a failure.
#include "support.hpp"

#include <dtrain/dtrain.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {

/// An owner whose bucket b is held in prepare_bucket(b) until open(b); it
/// records which thread reduced each bucket.
struct gated_owner {
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<bool> opened;
  std::vector<std::thread::id> reduced_by;
  std::size_t failing = static_cast<std::size_t>(-1);  // this bucket's preparation throws

  explicit gated_owner(std::size_t buckets) : opened(buckets, false), reduced_by(buckets) {}

  void open(std::size_t b) {
    {
      const std::lock_guard lock(mutex);
      opened[b] = true;
    }
    changed.notify_all();
  }
  void prepare_bucket(std::size_t b) {
    if (b == failing) throw std::runtime_error("bucket failed");
    std::unique_lock lock(mutex);
    changed.wait(lock, [&] { return opened[b]; });
    reduced_by[b] = std::this_thread::get_id();
  }
  dtrain::work reduce(std::size_t /*b*/) { return {}; }  // complete at once
  void finish_bucket(std::size_t /*b*/) {}
};

}  // namespace

TEST_CASE("runner: throttle waits until no more than `most` launched buckets are left") {
  gated_owner owner(5);
  dtrain::detail::thread_runner<gated_owner> runner(owner);
  for (std::size_t b = 0; b < 5; ++b) runner.launch(b);
  std::atomic<bool> through{false};
  std::thread caller([&] {
    runner.throttle(2);
    through = true;
  });
  owner.open(0);
  owner.open(1);  // bucket 2 held, 3 and 4 queued: 3 left
  std::this_thread::sleep_for(50ms);
  CHECK_FALSE(through.load());
  owner.open(2);  // bucket 3 held, 4 queued: 2 left
  caller.join();
  CHECK(through.load());
  owner.open(3);
  owner.open(4);
  CHECK(runner.complete(5) == nullptr);
}

TEST_CASE("runner: throttle does not wait for a thread that was not woken") {
  gated_owner owner(4);
  for (std::size_t b = 0; b < 4; ++b) owner.open(b);
  dtrain::detail::thread_runner<gated_owner> runner(owner);
  // Not woken: the runner's thread sleeps on (unless it had not gone to sleep
  // yet), so the caller must reduce them itself rather than wait forever.
  for (std::size_t b = 0; b < 4; ++b) runner.launch(b, /*wake=*/false);
  runner.throttle(1);
  {
    const std::lock_guard lock(owner.mutex);
    for (std::size_t b = 0; b < 3; ++b) CHECK(owner.reduced_by[b] != std::thread::id());
  }
  CHECK(runner.complete(4) == nullptr);
}

TEST_CASE("runner: throttle returns once a bucket has failed, and complete() reports it") {
  gated_owner owner(4);
  owner.failing = 0;
  dtrain::detail::thread_runner<gated_owner> runner(owner);
  for (std::size_t b = 0; b < 4; ++b) runner.launch(b);
  runner.throttle(0);  // would wait for every bucket; the failure ends the wait
  const std::exception_ptr failed = runner.complete(4);
  REQUIRE(failed != nullptr);
  CHECK_THROWS_WITH_AS(std::rethrow_exception(failed), "bucket failed", std::runtime_error);
}
