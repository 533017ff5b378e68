#pragma once
/// @file
/// The NCCL backend: `nccl_communicator` runs collectives on device memory, on
/// a CUDA stream of its own that is ordered after the caller's stream with
/// events. Host C++ only (nccl.h and the CUDA runtime API): g++ builds it, and
/// so does nvcc. Compiles to nothing unless DTRAIN_HAS_NCCL().

#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/cuda.hpp>
#include <dtrain/backend/mpi.hpp>
#include <dtrain/backend/nccl_engine.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/config.hpp>
#include <dtrain/error.hpp>
#include <dtrain/rendezvous/broadcast.hpp>
#include <dtrain/rendezvous/store.hpp>

#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#if DTRAIN_HAS_NCCL()
#include <cuda_runtime.h>
#include <nccl.h>

namespace dtrain {

namespace detail {
/// An id's bytes as broadcast_or_fail carries them; nccl_unique_id_from reads them back.
inline std::string nccl_unique_id_text(const ncclUniqueId& id) {
  return std::string(id.internal, sizeof id.internal);
}
/// What creating a communicator is called in its errors.
inline std::string nccl_creating(int rank, int size, int device) {
  return "creating the NCCL communicator of rank " + std::to_string(rank) + " of " +
         std::to_string(size) + " on CUDA device " + std::to_string(device);
}
/// Checks `device` and makes it current, as creating the communicator does
/// (and with the same errors).
inline void nccl_claim_device(int rank, int size, int device,
                              const std::optional<std::string>& visible) {
  nccl_check_placement(rank, size, device);
  try {
    nccl_select_device(device, rank, size, visible);
  } catch (const backend_error& e) {
    throw nccl_with_context(nccl_creating(rank, size, device), e);
  }
}
}  // namespace detail

/// A group of ranks, one CUDA device each, that runs NCCL collectives.
///
/// Every collective takes device buffers (a host buffer is a config_error) and
/// an optional `stream` of the caller's (default 0, the default stream as the
/// calling translation unit sees it). It is enqueued on this communicator's own
/// non-blocking stream after everything already on `stream`, and returns at
/// once with a work handle whose test() / wait() poll a completion event and
/// NCCL's asynchronous error state. The caller's stream does not wait for the
/// result: call `stream_wait(stream)` (no host block) or `work.wait()` (host
/// block) before using it. A wait that times out aborts the communicator
/// (ncclCommAbort): later calls throw backend_error, and work still on the
/// device for it is lost; create a new communicator (in practice: restart).
///
/// Check mode (options.collectives.check, DTRAIN_CHECK_COLLECTIVES=1): before
/// each collective the ranks gather what each passed (operation, count, type,
/// op or root) with an unchecked ncclAllGather of 4 int64 per rank through
/// device scratch memory, and the host waits for it (within the collective
/// timeout). A difference throws backend_error on every rank, naming the first
/// rank that differs, and the collective does not run. allreduce_many is
/// compared as one call (op, total elements, first type).
///
/// Use one communicator from one thread at a time, like NCCL's own; work
/// handles may be tested and waited on from any thread. Not for CUDA graph
/// capture. Move-only.
class nccl_communicator {
 public:
  static constexpr bool reaches_device_memory = true;
  /// NCCL reads and writes GPU memory only: host data goes over the host control plane.
  static constexpr bool reaches_host_memory = false;
  static constexpr std::string_view name = "nccl";
  /// Collectives are enqueued on stream(), ordered after the caller's stream:
  /// a topology can enqueue the steps of one collective at once, each after the last.
  static constexpr bool stream_ordered = true;

  /// Creates the communicator of `rank` of `size` on CUDA `device` (normally
  /// the local rank; it becomes the calling thread's current device). Rank 0
  /// selects its device and creates the NCCL unique id, and sets it in `store`
  /// under `options.store_key` (broadcast_or_fail); the others get it, waiting
  /// as long as the store's timeout allows. Then ncclCommInitRankConfig,
  /// non-blocking, waited for at most `options.init_timeout`.
  ///
  /// Throws config_error for a bad rank, size or device; timeout_error (the
  /// store's, or the init's) when a rank does not show up; rendezvous_error
  /// for a malformed id in the store, and on every other rank at once when
  /// rank 0 cannot select its device or create the id (with rank 0's own
  /// message); backend_error for CUDA and NCCL failures.
  template <store Store>
  nccl_communicator(Store& store, int rank, int size, int device, nccl_options options = {})
      // `options` is copied, not moved: the arguments are evaluated in no set order.
      // Rank 0 claims its device first: if it has none, nobody waits for its id.
      : nccl_communicator(exchange_unique_id(store, rank, size, options.store_key,
                                             [&] {
                                               detail::nccl_claim_device(
                                                   rank, size, device,
                                                   options.cuda_visible_devices);
                                             }),
                          rank, size, device, options) {}

  /// Creates the communicator from an id every rank already has (from
  /// new_unique_id() on one rank, shared by any means: broadcast_nccl_unique_id
  /// under MPI). Throws as the constructor above.
  nccl_communicator(const ncclUniqueId& id, int rank, int size, int device,
                    nccl_options options = {})
      : rank_(rank), size_(size) {
    detail::nccl_claim_device(rank, size, device, options.cuda_visible_devices);
    const std::string what = detail::nccl_creating(rank, size, device);
    try {
      auto s = detail::nccl_shared::create(rank, size, device, std::move(options));
      ncclConfig_t config = s->config();
      try {
        DTRAIN_NCCL_CHECK(ncclCommInitRankConfig(&s->comm, size, id, rank, &config));
      } catch (...) {
        if (s->comm) (void)ncclCommAbort(s->comm);
        s->comm = nullptr;
        throw;
      }
      // Non-blocking: NCCL connects the ranks in the background; a rank that
      // never comes would otherwise hang this call for ever.
      s->wait(what, s->options.init_timeout,
              "every rank must start and reach the others' network "
              "interfaces (NCCL_SOCKET_IFNAME); NCCL_DEBUG=INFO shows where it stopped",
              [] { return true; });
      shared_ = std::move(s);
    } catch (const backend_error& e) {
      throw detail::nccl_with_context(what, e);
    }
  }

  nccl_communicator(nccl_communicator&&) noexcept = default;
  nccl_communicator& operator=(nccl_communicator&&) noexcept = default;
  nccl_communicator(const nccl_communicator&) = delete;
  nccl_communicator& operator=(const nccl_communicator&) = delete;
  /// Waits for this communicator's collectives (at most the collective
  /// timeout, then aborts), then ncclCommFinalize + ncclCommDestroy. Work
  /// handles still alive keep the communicator alive until they go.
  ~nccl_communicator() = default;

  /// A new NCCL unique id (ncclGetUniqueId; needs no GPU). Throws backend_error.
  [[nodiscard]] static ncclUniqueId new_unique_id() {
    ncclUniqueId id{};
    DTRAIN_NCCL_CHECK(ncclGetUniqueId(&id));
    return id;
  }

  /// Rank 0 calls `prepare()`, creates an id and sets it under `key`; every
  /// other rank gets it (the store's timeout applies). When rank 0 fails (in
  /// `prepare`, or creating the id), it sets its error under `key` instead
  /// and throws it; every other rank throws rendezvous_error at once, with
  /// rank 0's message (broadcast_or_fail, rendezvous/broadcast.hpp). Throws
  /// config_error for a bad rank, rendezvous_error for a value that is not an
  /// id, and what the store throws.
  template <store Store, class Prepare = void (*)()>
  [[nodiscard]] static ncclUniqueId exchange_unique_id(
      Store& store, int rank, int size, std::string_view key = default_nccl_store_key,
      Prepare&& prepare = [] {}) {
    detail::nccl_check_rank(rank, size);
    const std::string value = detail::broadcast_or_fail(
        detail::store_relay<Store>(store, std::string(key), rank), "the NCCL unique id", [&] {
          prepare();
          return detail::nccl_unique_id_text(new_unique_id());
        });
    return detail::nccl_unique_id_from(value, key);
  }

  /// -1 and 0 for a rank that split() left out (negative color).
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  /// False when moved from, or when split() left this rank out.
  [[nodiscard]] bool valid() const noexcept { return shared_ != nullptr; }
  [[nodiscard]] int device() const noexcept { return shared_ ? shared_->device : -1; }
  /// The stream every collective runs on (to order more work after them on the device).
  [[nodiscard]] cudaStream_t stream() const noexcept {
    return shared_ ? shared_->stream.get() : nullptr;
  }
  /// The NCCL communicator, for calls dtrain does not wrap (and benchmarks against the raw engine).
  [[nodiscard]] ncclComm_t native_handle() const noexcept {
    return shared_ ? shared_->comm : nullptr;
  }
  /// Whether a timeout, an engine error or abort() ended this communicator.
  [[nodiscard]] bool aborted() const {
    if (!shared_) return false;
    std::lock_guard lock(shared_->mutex);
    return shared_->aborted;
  }

  /// ncclCommAbort now: pending collectives end (their work fails) and every
  /// later call throws. For a rank that learns a peer is gone.
  void abort() noexcept {
    if (!shared_) return;
    std::lock_guard lock(shared_->mutex);
    shared_->abort_locked(0, "abort() was called", rank_);
  }

  /// In place or out of place (`in` and `out` may be the same buffer): `out`
  /// becomes the reduction over all ranks of `in`. avg is ncclAvg.
  work allreduce(buffer in, buffer out, reduce_op op, cudaStream_t stream = nullptr) {
    return collective(
        detail::collective_call::allreduce(in, out, op), stream,
        [&](ncclComm_t comm, cudaStream_t own) {
          DTRAIN_NCCL_CHECK(ncclAllReduce(in.data, out.data, in.count, detail::nccl_type(in.type),
                                          detail::nccl_op(op, size_), comm, own));
        });
  }

  /// `data` on every rank becomes root's.
  work broadcast(buffer data, int root, cudaStream_t stream = nullptr) {
    return collective(
        detail::collective_call::broadcast(data, root), stream,
        [&](ncclComm_t comm, cudaStream_t own) {
          DTRAIN_NCCL_CHECK(ncclBroadcast(data.data, data.data, data.count,
                                          detail::nccl_type(data.type), root, comm, own));
        });
  }

  /// `out` (size() × in.count elements) becomes every rank's `in`, in rank
  /// order. In place when `in` is this rank's block of `out`.
  work allgather(buffer in, buffer out, cudaStream_t stream = nullptr) {
    return collective(detail::collective_call::allgather(in, out), stream,
                      [&](ncclComm_t comm, cudaStream_t own) {
                        DTRAIN_NCCL_CHECK(ncclAllGather(in.data, out.data, in.count,
                                                        detail::nccl_type(in.type), comm, own));
                      });
  }

  /// `in` (size() × out.count elements) is reduced over ranks; rank r gets block r in `out`.
  work reduce_scatter(buffer in, buffer out, reduce_op op, cudaStream_t stream = nullptr) {
    return collective(detail::collective_call::reduce_scatter(in, out, op), stream,
                      [&](ncclComm_t comm, cudaStream_t own) {
                        DTRAIN_NCCL_CHECK(ncclReduceScatter(in.data, out.data, out.count,
                                                            detail::nccl_type(out.type),
                                                            detail::nccl_op(op, size_), comm, own));
                      });
  }

  /// Completes once every rank has reached it (and this rank's earlier
  /// collectives, and its work on `stream` before the call, are done): an
  /// allreduce of one int on the device.
  work barrier(cudaStream_t stream = nullptr) {
    return collective(
        detail::collective_call::barrier(), stream, [&](ncclComm_t comm, cudaStream_t own) {
          std::int64_t* word = shared_->barrier_word;
          DTRAIN_NCCL_CHECK(ncclAllReduce(word, word, 1, ncclInt32, ncclSum, comm, own));
        });
  }

  /// Reduces each buffer in place, in one NCCL group (ncclGroupStart/End):
  /// one launch for many buffers, one work for all. Buffers may differ in type.
  /// Check mode compares the op, the number of elements and the first type.
  work allreduce_many(std::span<const buffer> buffers, reduce_op op,
                      cudaStream_t stream = nullptr) {
    return collective(
        detail::collective_call::allreduce_many(buffers, op), stream,
        [&](ncclComm_t comm, cudaStream_t own) {
          DTRAIN_NCCL_CHECK(ncclGroupStart());
          try {
            for (const buffer& b : buffers) {
              if (b.count == 0) continue;
              DTRAIN_NCCL_CHECK(ncclAllReduce(b.data, b.data, b.count, detail::nccl_type(b.type),
                                              detail::nccl_op(op, size_), comm, own));
            }
          } catch (...) {
            (void)ncclGroupEnd();  // a group left open would swallow this thread's next NCCL calls
            throw;
          }
          DTRAIN_NCCL_CHECK(ncclGroupEnd());
        });
  }

  /// Makes `stream` wait, on the device and without blocking the host, for
  /// every collective enqueued on this communicator so far.
  void stream_wait(cudaStream_t stream) {
    const auto what = [this] { return describe("stream_wait", ""); };  // on failure only
    detail::nccl_shared& s = usable(what);
    std::lock_guard lock(s.mutex);
    s.throw_if_aborted(what);
    try {
      detail::device_guard guard(s.device);
      detail::nccl_pooled_event done(s);
      DTRAIN_CUDA_CHECK(cudaEventRecord(done.get(), s.stream.get()));
      DTRAIN_CUDA_CHECK(cudaStreamWaitEvent(stream, done.get(), 0));
    } catch (const backend_error& e) {
      throw detail::nccl_with_context(what(), e);
    }
  }

  /// ncclCommSplit: ranks passing the same `color` form a communicator, ordered
  /// by `key` (then by rank here). A negative color leaves this rank out: it
  /// gets a communicator with valid() false. Collective over this communicator;
  /// waits for this communicator's collectives first (NCCL requires it), and
  /// for the split itself at most options().init_timeout.
  [[nodiscard]] nccl_communicator split(int color, int key) {
    const std::string what =
        describe("split", "color " + std::to_string(color) + ", key " + std::to_string(key));
    detail::nccl_shared& s = usable(what);
    std::lock_guard lock(s.mutex);
    s.throw_if_aborted(what);
    // Numbered in the ring like any collective (as Gloo's split), so that check
    // mode and the desync table name it alike.
    const detail::collective_info call{
        "split", name, rank_, size_, 0, static_cast<std::uint8_t>(dtype::int32), -1, -1};
    const detail::signature sig = detail::signature_of(detail::record(*ring_, call), call);
    auto settle = [&](detail::call_state state) { ring_->settle(sig.seq, state); };
    try {
      detail::device_guard guard(s.device);
      if (s.options.collectives.check) check_signature(s, sig, what);
      s.wait(what + " (waiting for earlier collectives)", s.options.collectives.timeout,
             detail::nccl_timeout_hint, [&] { return detail::nccl_stream_idle(s.stream.get()); });
      // The child's stream and scratch exist before the child does, so that no
      // failure can strand a live NCCL communicator.
      auto child = detail::nccl_shared::create(0, s.size, s.device, s.options);
      ncclConfig_t config = s.config();
      s.split_slot =
          nullptr;  // written by NCCL when the split completes, maybe after the call returns
      DTRAIN_NCCL_CHECK(ncclCommSplit(s.comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key,
                                      &s.split_slot, &config));
      s.wait(what, s.options.init_timeout, detail::nccl_timeout_hint, [] { return true; });
      child->comm = s.split_slot;
      s.split_slot = nullptr;
      if (!child->comm) {
        settle(detail::call_state::completed);
        return nccl_communicator(nullptr, -1, 0);
      }
      child->wait(what, s.options.init_timeout, detail::nccl_timeout_hint, [] { return true; });
      DTRAIN_NCCL_CHECK(ncclCommUserRank(child->comm, &child->rank));
      DTRAIN_NCCL_CHECK(ncclCommCount(child->comm, &child->size));
      const int child_rank = child->rank, child_size = child->size;
      nccl_communicator out(std::move(child), child_rank, child_size);
      out.ring_ = ring_->make_child(color);
      settle(detail::call_state::completed);
      return out;
    } catch (const backend_error& e) {
      settle(detail::call_state::failed);
      throw detail::nccl_with_context(what, e);
    } catch (...) {
      settle(detail::call_state::failed);
      throw;
    }
  }

  /// This communicator's last collectives, for desync diagnostics.
  [[nodiscard]] std::shared_ptr<detail::collective_ring> ring() const noexcept { return ring_; }

  [[nodiscard]] const nccl_options& options() const {
    static const nccl_options none{};
    return shared_ ? shared_->options : none;
  }

 private:
  nccl_communicator(std::shared_ptr<detail::nccl_shared> shared, int rank, int size) noexcept
      : shared_(std::move(shared)), rank_(rank), size_(size) {}

  [[nodiscard]] std::string describe(std::string_view what, std::string_view args) const {
    return detail::describe(what, args, rank_, size_, name);
  }

  // A left-out (or moved-from) communicator fails here, before anything else.
  template <class What>
  detail::nccl_shared& usable(const What& what) const {
    if (shared_) return *shared_;
    detail::throw_invalid(detail::what_text(what), rank_ < 0);
  }

  // Check mode: every rank's signature, gathered by an (unchecked) ncclAllGather
  // of signature::fields int64 per rank through device scratch memory and a pinned host copy.
  // The host waits for it (at most the collective timeout).
  template <class What>
  void check_signature(detail::nccl_shared& s, const detail::signature& mine, const What& what) {
    const auto checking = [&] {
      return "checking what every rank passed to " + detail::what_text(what);
    };
    detail::compare_signatures(
        mine, s.rank, s.size, what,
        [&](std::span<const std::int64_t> fields, std::span<std::int64_t> all) {
          try {
            std::int64_t* host = s.host_table();
            constexpr std::size_t width = detail::signature::fields;
            const std::size_t row = static_cast<std::size_t>(s.rank) * width;
            std::memcpy(host + row, fields.data(), width * sizeof(std::int64_t));
            DTRAIN_CUDA_CHECK(cudaMemcpyAsync(s.device_table + row, host + row,
                                              width * sizeof(std::int64_t), cudaMemcpyHostToDevice,
                                              s.stream.get()));
            DTRAIN_NCCL_CHECK(ncclAllGather(s.device_table + row, s.device_table, width, ncclInt64,
                                            s.comm, s.stream.get()));
            s.wait(checking, s.options.collectives.timeout, detail::nccl_timeout_hint,
                   [] { return true; });
            DTRAIN_CUDA_CHECK(cudaMemcpyAsync(host, s.device_table,
                                              all.size() * sizeof(std::int64_t),
                                              cudaMemcpyDeviceToHost, s.stream.get()));
            detail::nccl_pooled_event done(s);
            DTRAIN_CUDA_CHECK(cudaEventRecord(done.get(), s.stream.get()));
            s.wait(checking, s.options.collectives.timeout,
                   "a rank did not call this collective, or called fewer collectives than this one",
                   [&] { return detail::nccl_event_done(done.get()); });
            std::memcpy(all.data(), host, all.size() * sizeof(std::int64_t));
          } catch (const backend_error& e) {
            throw detail::nccl_with_context(checking(), e);
          }
        });
  }

  // Every collective, in this order: a left-out rank fails first; then the
  // argument checks every engine shares; an aborted communicator; the ring's
  // number (check mode: every rank's signature compared); the stream order
  // (the own stream waits for what `caller` holds now); last the engine's
  // call, `enqueue(comm, own stream)`, and the event the work polls. Nothing
  // is built into words here: `what` describes the call on failure only.
  template <class Enqueue>
  work collective(const detail::collective_call& call, cudaStream_t caller, Enqueue&& enqueue) {
    const detail::collective_info what = call.info(name, rank_, size_);
    detail::nccl_shared& s = usable(what);
    detail::check_arguments(call, what, detail::nccl_memory);
    std::lock_guard lock(s.mutex);
    s.throw_if_aborted(what);
    const std::int64_t seq = detail::record(*ring_, what);
    const bool moves = call.moves_data();
    if (!moves && !s.options.collectives.check) {
      ring_->settle(seq, detail::call_state::completed);
      return work();  // nothing to move, nothing to order
    }
    try {
      detail::device_guard guard(s.device);
      if (s.options.collectives.check) check_signature(s, detail::signature_of(seq, what), what);
      if (!moves) {
        ring_->settle(seq, detail::call_state::completed);
        return work();
      }
      {
        detail::nccl_pooled_event ready(s);
        DTRAIN_CUDA_CHECK(cudaEventRecord(ready.get(), caller));
        DTRAIN_CUDA_CHECK(cudaStreamWaitEvent(s.stream.get(), ready.get(), 0));
      }  // the wait holds the recorded point; the event can be reused at once
      enqueue(s.comm, s.stream.get());
      // A non-blocking NCCL may still be enqueueing in the background; nothing
      // may be added to its stream until it is done.
      s.wait(what, s.options.collectives.timeout, detail::nccl_timeout_hint, [] { return true; });
      detail::nccl_pooled_event done(s);
      DTRAIN_CUDA_CHECK(cudaEventRecord(done.get(), s.stream.get()));
      auto w = std::make_shared<detail::nccl_work>(what, s.options.collectives.timeout, shared_,
                                                   done.release());
      w->track(ring_, seq);
      return work(std::move(w));
    } catch (const backend_error& e) {
      throw detail::nccl_with_context(detail::describe(what), e);
    }
  }

  std::shared_ptr<detail::nccl_shared> shared_;
  std::shared_ptr<detail::collective_ring> ring_ = std::make_shared<detail::collective_ring>();
  int rank_ = -1;
  int size_ = 0;
};

static_assert(communicator<nccl_communicator>);

#if DTRAIN_HAS_MPI()
/// Rank `root` of `comm` creates an NCCL unique id and MPI_Bcasts it to every
/// rank of `comm` (collective; returns the same id everywhere), for jobs
/// started by mpirun that have no store. If the root cannot create an id, it
/// throws its own error and every other rank throws rendezvous_error with
/// the root's message, rather than waiting (broadcast_or_fail). MPI errors
/// are checked only if `comm` returns them (MPI_ERRORS_RETURN).
inline ncclUniqueId broadcast_nccl_unique_id(MPI_Comm comm, int root = 0) {
  detail::mpi_relay relay(comm, root);
  const std::string value = detail::broadcast_or_fail(relay, "the NCCL unique id", [] {
    return detail::nccl_unique_id_text(nccl_communicator::new_unique_id());
  });
  return detail::nccl_unique_id_from(value, relay.where());
}
#endif  // DTRAIN_HAS_MPI()

}  // namespace dtrain

#endif  // DTRAIN_HAS_NCCL()
