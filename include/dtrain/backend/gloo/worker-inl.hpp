#pragma once
/// @file
/// The non-template bodies of dtrain/backend/gloo/worker.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/backend/gloo/worker.hpp, not this file.

#include <dtrain/backend/gloo/worker.hpp>

#if DTRAIN_HAS_GLOO()
namespace dtrain::detail {

DTRAIN_DETAIL_INLINE void gloo_state::mark_unusable(std::exception_ptr why) noexcept {
  std::lock_guard lock(mutex);
  if (!unusable.exchange(true)) failure.set(std::move(why));
}

DTRAIN_DETAIL_INLINE void gloo_state::mark_unusable(const collective_info& call,
                                                    const char* how) noexcept {
  std::lock_guard lock(mutex);
  if (!unusable.exchange(true)) failure.set(call, how);
}

DTRAIN_DETAIL_INLINE std::string gloo_state::unusable_text() {
  std::lock_guard lock(mutex);
  return "the communicator is unusable since an earlier failure (" + failure.text() +
         "); ranks cannot fall back into step after a failed collective, "
         "so make a new communicator";
}

DTRAIN_DETAIL_INLINE bool gloo_work::wait_until(std::chrono::steady_clock::time_point deadline) {
  auto s = owner_.lock();
  if (!s) return poll();
  std::unique_lock lock(s->mutex);
  for (;;) {
    if (poll()) return true;
    const auto now = std::chrono::steady_clock::now();
    // (Rounded up: a timeout of 5 s, a few microseconds in, is still 5000 ms in messages.)
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - now);
    if (left.count() <= 0) return poll();
    if (!s->running && !s->queue.empty() && s->queue.front().work.get() == this) {
      gloo_state::task t = std::move(s->queue.front());
      s->queue.pop_front();
      s->running = true;
      lock.unlock();
      gloo_execute(*s, t, std::min(left, s->timeout));
      lock.lock();
      s->running = false;
      lock.unlock();
      s->wake.notify_one();
      s->finished.notify_all();
      return true;
    }
    s->finished.wait_until(lock, deadline);
  }
}

DTRAIN_DETAIL_INLINE void gloo_work::finish(std::exception_ptr e) noexcept {
  if (e) fail(std::move(e));
  done_.store(true, std::memory_order_release);
}

DTRAIN_DETAIL_INLINE std::exception_ptr gloo_failure(const std::exception_ptr& e,
                                                     const std::string& what) {
  std::string message;
  try {
    std::rethrow_exception(e);
  } catch (const error&) {
    return e;  // already dtrain's (a signature mismatch), with its context
  } catch (const shm_failure& x) {
    if (x.timed_out()) {
      return std::make_exception_ptr(
          timeout_error(what + " timed out (" + x.what() +
                        "); a peer is slow, dead or called a different collective "
                        "(DTRAIN_CHECK_COLLECTIVES=1 compares what every rank passed)"));
    }
    return std::make_exception_ptr(backend_error(
        what + " failed (" + x.what() + "); look for the first error on the other ranks", 0));
  } catch (const std::exception& x) {
    message = x.what();
  } catch (...) {
    message = "an exception that is not a std::exception";
  }
  std::string lower = message;
  for (auto& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower.find("timed out") != std::string::npos || lower.find("timeout") != std::string::npos) {
    return std::make_exception_ptr(
        timeout_error(what + " timed out in Gloo (" + message +
                      "); a peer is slow, dead or called a different collective "
                      "(DTRAIN_CHECK_COLLECTIVES=1 compares what every rank passed)"));
  }
  return std::make_exception_ptr(
      backend_error(what + " failed in Gloo: " + message +
                        "; a peer rank may have died or closed its communicator: "
                        "look for the first error on the other ranks",
                    0));
}

DTRAIN_DETAIL_INLINE void gloo_run_broadcast(gloo_state& s, buffer b, int root,
                                             std::chrono::milliseconds timeout) {
  if (s.size == 1) return;
  ::gloo::BroadcastOptions opts(s.context);
  opts.setOutput(static_cast<std::uint8_t*>(b.data), b.bytes());
  opts.setRoot(root);
  opts.setTimeout(timeout);
  DTRAIN_GLOO_CHECK(::gloo::broadcast(opts));
}

DTRAIN_DETAIL_INLINE void gloo_run_allgather_tcp(gloo_state& s, buffer in, buffer out,
                                                 std::chrono::milliseconds timeout) {
  auto* block =
      static_cast<std::uint8_t*>(out.data) + static_cast<std::size_t>(s.rank) * in.bytes();
  if (s.size == 1) {
    if (in.data != block) std::memcpy(block, in.data, in.bytes());
    return;
  }
  ::gloo::AllgatherOptions opts(s.context);
  if (in.data != block) opts.setInput(static_cast<std::uint8_t*>(in.data), in.bytes());
  opts.setOutput(static_cast<std::uint8_t*>(out.data), out.bytes());
  opts.setTimeout(timeout);
  DTRAIN_GLOO_CHECK(::gloo::allgather(opts));
}

DTRAIN_DETAIL_INLINE void gloo_run_allgather(gloo_state& s, buffer in, buffer out,
                                             std::chrono::milliseconds timeout) {
#if DTRAIN_HAS_SHM()
  if (s.size > 1 && s.shm.valid()) {  // every rank on this host: no TCP
    s.shm.allgather(in.data, out.data, in.bytes(), timeout);
    return;
  }
#endif
  gloo_run_allgather_tcp(s, in, out, timeout);
}

DTRAIN_DETAIL_INLINE void gloo_run_alltoall(gloo_state& s, buffer in, buffer out,
                                            std::chrono::milliseconds timeout) {
#if DTRAIN_HAS_SHM()
  if (s.size > 1 && s.shm.valid()) {  // every rank on this host: no TCP
    s.shm.alltoall(in.data, out.data, in.bytes() / static_cast<std::size_t>(s.size), timeout);
    return;
  }
#endif
  if (s.size == 1) {
    std::memcpy(out.data, in.data, in.bytes());
    return;
  }
  ::gloo::AlltoallOptions opts(s.context);
  opts.setInput(static_cast<std::uint8_t*>(in.data), in.bytes());
  opts.setOutput(static_cast<std::uint8_t*>(out.data), out.bytes());
  opts.setTimeout(timeout);
  DTRAIN_GLOO_CHECK(::gloo::alltoall(opts));
}

DTRAIN_DETAIL_INLINE void gloo_run_barrier(gloo_state& s, std::chrono::milliseconds timeout) {
  if (s.size == 1) return;
  ::gloo::BarrierOptions opts(s.context);
  opts.setTimeout(timeout);
  DTRAIN_GLOO_CHECK(::gloo::barrier(opts));
}

DTRAIN_DETAIL_INLINE void gloo_check_signature(gloo_state& s, const signature& sig,
                                               const collective_info& what,
                                               std::chrono::milliseconds timeout) {
  compare_signatures(
      sig, s.rank, s.size, what,
      [&](std::span<const std::int64_t> mine, std::span<std::int64_t> all) {
        buffer in{const_cast<std::int64_t*>(mine.data()), mine.size(), dtype::int64, memory::host};
        buffer out{all.data(), all.size(), dtype::int64, memory::host};
        gloo_run_allgather_tcp(s, in, out, timeout);
      });
}

DTRAIN_DETAIL_INLINE void gloo_run_task(gloo_state& s, const gloo_state::task& t,
                                        std::chrono::milliseconds timeout) {
  try {
    if (s.unusable.load()) {
      throw backend_error(t.work->description() + " was not run: " + s.unusable_text(), 0);
    }
    if (s.check) gloo_check_signature(s, t.sig, t.work->info(), timeout);
    if (t.call.moves_data()) t.run(s, t.call, timeout);
  } catch (...) {
    const std::exception_ptr failure =
        gloo_failure(std::current_exception(), t.work->description());
#if DTRAIN_HAS_SHM()
    bool timed_out = false;
    try {
      std::rethrow_exception(failure);
    } catch (const timeout_error&) {
      timed_out = true;
    } catch (...) {
    }
    s.shm.abandon(message_of(failure), timed_out);
#endif
    std::rethrow_exception(failure);
  }
}

DTRAIN_DETAIL_INLINE void gloo_execute(gloo_state& s, gloo_state::task& t,
                                       std::chrono::milliseconds timeout) noexcept {
  std::exception_ptr failure;
  try {
    gloo_run_task(s, t, timeout);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    s.mark_unusable(failure);
#if DTRAIN_HAS_SHM()
    s.shm.abandon();  // peers waiting in the segment stop (a no-op once gloo_run_task did)
#endif
  }
  t.work->finish(std::move(failure));
}

DTRAIN_DETAIL_INLINE void gloo_serve(const std::shared_ptr<gloo_state>& s) {
  for (;;) {
    gloo_state::task t;
    {
      std::unique_lock lock(s->mutex);
      s->wake.wait(lock, [&] {
        return (s->stopping && s->queue.empty()) || (!s->running && !s->queue.empty());
      });
      if (s->queue.empty()) return;
      t = std::move(s->queue.front());
      s->queue.pop_front();
      s->running = true;
    }
    gloo_execute(*s, t, s->timeout);
    {
      std::lock_guard lock(s->mutex);
      s->running = false;
    }
    s->finished.notify_all();
  }
}

}  // namespace dtrain::detail
#endif
