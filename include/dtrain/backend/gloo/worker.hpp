#pragma once
/// @file
/// How a gloo_communicator runs its collectives: Gloo's calls block, so each
/// communicator queues them for one worker thread, in submission order (all
/// ranks submit in the same order, so the queues stay matched), and its work
/// handles report their completion. Used by backend/gloo/gloo.hpp; compiles to
/// nothing without Gloo.

#include <dtrain/config.hpp>

#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/gloo/shm.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/error.hpp>

#if DTRAIN_HAS_GLOO()

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/logging.h>
#include <gloo/context.h>
#include <gloo/math.h>
#include <gloo/transport/device.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::detail {

template <class T>
inline constexpr bool is_half_float = std::same_as<T, float16> || std::same_as<T, bfloat16>;

/// Gloo's element-wise reduction (c = a op b; c may be a or b) for T and op.
/// Gloo's own functions for native types; reduce_host for our 16-bit floats,
/// which Gloo does not know. avg reduces as sum; the caller divides.
template <element T>
::gloo::AllreduceOptions::Func gloo_reduce_function(reduce_op op) {
  if constexpr (is_half_float<T>) {
    return [op](void* c, const void* a, const void* b, std::size_t n) {
      auto* out = static_cast<T*>(c);
      const auto* x = static_cast<const T*>(a);
      const auto* y = static_cast<const T*>(b);
      if (out == y) {  // every reduce_op commutes
        reduce_host(out, x, n, op);
        return;
      }
      if (out != x) std::memcpy(out, x, n * sizeof(T));
      reduce_host(out, y, n, op);
    };
  } else {
    using function = void (*)(void*, const void*, const void*, std::size_t);
    switch (op) {
      case reduce_op::min: return static_cast<function>(&::gloo::min<T>);
      case reduce_op::max: return static_cast<function>(&::gloo::max<T>);
      case reduce_op::prod: return static_cast<function>(&::gloo::product<T>);
      case reduce_op::sum:
      case reduce_op::avg: break;
    }
    return static_cast<function>(&::gloo::sum<T>);
  }
}

struct gloo_state;

/// What the worker runs for one collective: Gloo's call for `call`, with
/// Gloo's timeout for this run. Each collective of gloo_communicator is one.
using gloo_runner = void (*)(gloo_state& s, const collective_call& call,
                             std::chrono::milliseconds timeout);

class gloo_work;

/// What the communicator, its worker thread and its work handles share.
struct gloo_state {
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{};
  bool check = false;
  std::shared_ptr<::gloo::transport::Device> device;
  std::shared_ptr<::gloo::Context> context;
#if DTRAIN_HAS_SHM()
  shm_segment shm;  // valid: every rank runs on this host, and allreduces go through it
#endif
  std::string shm_text = "off";  // for describe(): "on (...)" or "off (why)"

  /// One queued collective: plain fields (the buffers stay the caller's).
  struct task {
    std::shared_ptr<gloo_work> work;
    signature sig{};
    collective_call call{};
    gloo_runner run = nullptr;
  };
  std::mutex mutex;
  std::condition_variable wake;      // the worker: a task to run, or stop
  std::condition_variable finished;  // waiters: a task finished
  std::deque<task> queue;            // guarded by mutex
  bool running = false;              // guarded by mutex: a task is running (worker or waiter)
  bool stopping = false;             // guarded by mutex
  // Numbers the collectives; issued under mutex, so the numbers follow the queue.
  std::shared_ptr<collective_ring> ring = std::make_shared<collective_ring>();
  std::atomic<bool> unusable{false};
  failure_cause failure;  // guarded by mutex: the first failure

  /// Records the first failure without allocating: the timeout hook and
  /// gloo_execute, both noexcept, call these.
  void mark_unusable(std::exception_ptr why) noexcept;
  void mark_unusable(const collective_info& call, const char* how) noexcept;
  [[nodiscard]] std::string unusable_text();
};

DTRAIN_DETAIL_INLINE void gloo_execute(gloo_state& s, gloo_state::task& t,
                                       std::chrono::milliseconds timeout) noexcept;

class gloo_work final : public work_state {
 public:
  gloo_work(const collective_info& info, std::chrono::milliseconds timeout,
            std::weak_ptr<gloo_state> owner)
      : work_state(info, timeout), owner_(std::move(owner)) {}

  bool poll() override { return done_.load(std::memory_order_acquire); }

  // Gloo cannot abort a collective in flight; its own timeout (the same
  // length) ends it. Until then nothing else may run on this communicator.
  void on_timeout() noexcept override {
    if (auto s = owner_.lock()) s->mark_unusable(info(), "did not finish within its timeout");
  }

  /// Blocks until finished or `deadline`; true when finished. When this
  /// collective is next in line and nothing runs, runs it on the calling
  /// thread (with the time left as Gloo's timeout) rather than waking the
  /// worker: submit-then-wait then costs no thread hand-off. Otherwise sleeps
  /// until a collective finishes. Overrides work_state's wait hook, so waiting
  /// sleeps instead of taking the CPU from Gloo's threads.
  bool wait_until(std::chrono::steady_clock::time_point deadline) override;

  void finish(std::exception_ptr e) noexcept;

 private:
  std::atomic<bool> done_{false};
  std::weak_ptr<gloo_state> owner_;
};

/// A failure inside a call into Gloo, with the call as written, file:line
/// and Gloo's message; gloo_failure() turns it into dtrain's errors.
class gloo_exception : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <class F>
void gloo_checked(F&& call, const char* text, const char* file, int line) {
  try {
    call();
  } catch (const error&) {
    throw;  // dtrain's own (the store under connectFullMesh), already with context
  } catch (const ::gloo::EnforceNotMet& e) {  // not a gloo::Exception
    throw gloo_exception(std::string(text) + " (" + file + ":" + std::to_string(line) +
                         "): " + e.what());
  } catch (const std::exception& e) {
    throw gloo_exception(std::string(text) + " (" + file + ":" + std::to_string(line) +
                         "): " + e.what());
  }
}

}  // namespace dtrain::detail

/// Evaluates a call into Gloo, which reports failures by throwing; rethrows
/// them as detail::gloo_exception naming the call, file:line and Gloo's message.
#define DTRAIN_GLOO_CHECK(...) \
  ::dtrain::detail::gloo_checked([&] { __VA_ARGS__; }, #__VA_ARGS__, __FILE__, __LINE__)

namespace dtrain::detail {

/// An exception from Gloo as dtrain's: timeout_error for Gloo's timeouts,
/// backend_error (engine code 0: Gloo has no codes) with Gloo's message otherwise.
DTRAIN_DETAIL_INLINE std::exception_ptr gloo_failure(const std::exception_ptr& e,
                                                     const std::string& what);

// The collectives on host memory, with Gloo's timeout for this run. A world
// of one never calls Gloo. When every rank runs on this host, allreduces and
// allgathers go through the communicator's shared-memory segment
// (backend/gloo/shm.hpp) instead.

/// Up to this many bytes an allreduce over TCP on 3 or more ranks uses Gloo's BCUBE
/// algorithm instead of its ring: recursive halving and doubling, 2·log2(n)
/// sequential steps where the ring takes 2(n−1) (4 against 6 on 4 ranks; a
/// direct exchange in 2 steps when n has no factor 2), with the same bytes
/// per rank on a power of two. Small buckets are all latency, and on a
/// machine with fewer cores than ranks every step waits for a process to be
/// scheduled. Above it the ring, which pipelines 1 MiB segments (BCUBE also
/// allocates a buffer-sized scratch per call), and below one element per rank
/// (the ring then skips its empty hops). Every rank decides alike: the rule
/// depends on the element count, its size and the world size only.
inline constexpr std::size_t gloo_bcube_max_bytes = std::size_t{1} << 20;

template <element T>
void gloo_run_allreduce(gloo_state& s, buffer in, buffer out, reduce_op op,
                        std::chrono::milliseconds timeout) {
#if DTRAIN_HAS_SHM()
  if (s.shm.valid()) {  // every rank on this host: no TCP (avg divides inside)
    s.shm.allreduce(static_cast<const T*>(in.data), static_cast<T*>(out.data), out.count, op,
                    timeout);
    return;
  }
#endif
  if (s.size > 1) {
    ::gloo::AllreduceOptions opts(s.context);
    if (s.size > 2 && out.count > static_cast<std::size_t>(s.size) &&
        out.bytes() <= gloo_bcube_max_bytes)
      opts.setAlgorithm(::gloo::AllreduceOptions::Algorithm::BCUBE);
    if (in.data != out.data) opts.setInput(static_cast<T*>(in.data), in.count);
    opts.setOutput(static_cast<T*>(out.data), out.count);
    opts.setReduceFunction(gloo_reduce_function<T>(op));
    opts.setTimeout(timeout);
    DTRAIN_GLOO_CHECK(::gloo::allreduce(opts));
    if (op == reduce_op::avg) divide_host(out, s.size);
  } else if (in.data != out.data) {
    std::memcpy(out.data, in.data, in.bytes());
  }
}

DTRAIN_DETAIL_INLINE void gloo_run_broadcast(gloo_state& s, buffer b, int root,
                                             std::chrono::milliseconds timeout);

/// Over Gloo's TCP pairs (setting up the shared-memory segment uses this one:
/// a rank may hold the segment before every rank has agreed to use it).
DTRAIN_DETAIL_INLINE void gloo_run_allgather_tcp(gloo_state& s, buffer in, buffer out,
                                                 std::chrono::milliseconds timeout);

/// Through the shared-memory segment when there is one, else over TCP.
DTRAIN_DETAIL_INLINE void gloo_run_allgather(gloo_state& s, buffer in, buffer out,
                                             std::chrono::milliseconds timeout);

DTRAIN_DETAIL_INLINE void gloo_run_barrier(gloo_state& s, std::chrono::milliseconds timeout);

/// Block j of `in` to rank j, block i of `out` from rank i: through the
/// shared-memory segment when there is one, else Gloo's alltoall over TCP.
DTRAIN_DETAIL_INLINE void gloo_run_alltoall(gloo_state& s, buffer in, buffer out,
                                            std::chrono::milliseconds timeout);

// Gloo 0.5.0's only reduce-scatter is the older ReduceScatterHalvingDoubling,
// and on 3 ranks it returned corrupted blocks when two ran back to back (a
// race between consecutive instances: a barrier before or after each one hid
// it). So this is an allreduce of the whole input into a scratch buffer and a
// copy of this rank's block: correct, at twice the traffic of a real
// reduce-scatter (2(n-1)/n of the input per rank instead of (n-1)/n) and one
// input-sized allocation. On one host it is a reduce-scatter through the
// shared-memory segment (shm_segment::reduce_scatter).
template <element T>
void gloo_run_reduce_scatter(gloo_state& s, buffer in, buffer out, reduce_op op,
                             std::chrono::milliseconds timeout) {
  const std::size_t n = out.count;
  const std::size_t offset = static_cast<std::size_t>(s.rank) * n;
  if (s.size == 1) {
    std::memcpy(out.data, in.data, in.bytes());
    return;
  }
#if DTRAIN_HAS_SHM()
  if (s.shm.valid()) {  // every rank on this host: a real reduce-scatter, no scratch
    s.shm.reduce_scatter(static_cast<const T*>(in.data), static_cast<T*>(out.data), n, op, timeout);
    return;
  }
#endif
  std::vector<T> scratch(in.count);
  const reduce_op sum_op = op == reduce_op::avg ? reduce_op::sum : op;  // divide this block only
  gloo_run_allreduce<T>(s, in, buffer{scratch.data(), scratch.size(), in.type}, sum_op, timeout);
  std::memcpy(out.data, scratch.data() + offset, n * sizeof(T));
  if (op == reduce_op::avg) divide_host(out, s.size);
}

/// Check mode: compares what every rank passed, over an allgather that is not itself checked.
DTRAIN_DETAIL_INLINE void gloo_check_signature(gloo_state& s, const signature& sig,
                                               const collective_info& what,
                                               std::chrono::milliseconds timeout);

/// Runs one task's collective (its signature first, in check mode). Throws
/// what failed as dtrain's error (gloo_failure), and tells peers waiting in
/// the shared-memory segment to stop, with a timeout if this was one.
DTRAIN_DETAIL_INLINE void gloo_run_task(gloo_state& s, const gloo_state::task& t,
                                        std::chrono::milliseconds timeout);

/// Runs one task (on the worker, or on a thread waiting for it) and completes
/// its work. A failure, whatever it is (out of memory while putting one into
/// words too), reaches the work's wait() and makes the communicator unusable;
/// so does running after one. Allocates nothing itself: everything that may
/// is inside gloo_run_task, whose exception it catches.

/// The worker: runs the queue in order until the communicator stops and the queue is empty.
DTRAIN_DETAIL_INLINE void gloo_serve(const std::shared_ptr<gloo_state>& s);

}  // namespace dtrain::detail

#endif  // DTRAIN_HAS_GLOO()

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/backend/gloo/worker-inl.hpp>
#endif
