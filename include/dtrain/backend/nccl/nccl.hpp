#pragma once
/// @file
/// The NCCL backend: `nccl_communicator` runs collectives on device memory, on
/// a CUDA stream of its own that is ordered after the caller's stream with
/// events. Host C++ only (nccl.h and the CUDA runtime API): g++ builds it, and
/// so does nvcc. Compiles to nothing unless DTRAIN_HAS_NCCL().

#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/cuda.hpp>
#include <dtrain/backend/mpi/mpi.hpp>
#include <dtrain/backend/nccl/engine.hpp>
#include <dtrain/backend/nccl/init_outcomes.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/config.hpp>
#include <dtrain/detail/sys.hpp>
#include <dtrain/detail/wire.hpp>
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
#include <vector>

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
DTRAIN_DETAIL_INLINE std::string nccl_creating(int rank, int size, int device);
/// Checks `device` and makes it current, as creating the communicator does
/// (and with the same errors).
template <class Api>
void nccl_claim_device(int rank, int size, int device, const std::optional<std::string>& visible) {
  nccl_check_placement(rank, size, device);
  try {
    nccl_select_device<Api>(device, rank, size, visible);
  } catch (const backend_error& e) {
    throw nccl_with_context(nccl_creating(rank, size, device), e);
  }
}

/// Where a rank's GPU is, as the check that no two ranks share one compares it.
struct nccl_gpu {
  std::string uuid;  ///< "GPU-...", as nvidia-smi -L prints it
  std::string pci_bus;
  std::string host;
  int device = -1;      ///< the CUDA ordinal this rank used
  std::string visible;  ///< its CUDA_VISIBLE_DEVICES, or "<unset>"

  [[nodiscard]] std::string encode() const;
  [[nodiscard]] static nccl_gpu decode(std::string_view where, std::string_view value);
};

/// The first two ranks of `gpus` (indexed by rank) on one GPU, as a
/// config_error's text; empty when every rank has its own.
DTRAIN_DETAIL_INLINE std::string nccl_shared_gpu_problem(const std::vector<nccl_gpu>& gpus);
/// The same from every rank's record (indexed by rank: where it was read,
/// and the wire::outcome the rank published). Throws rendezvous_error
/// "rank R cannot use its GPU: <why>" for a rank that has none.
DTRAIN_DETAIL_INLINE std::string nccl_shared_gpu_problem(
    const std::vector<std::pair<std::string, std::string>>& records);
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
template <class Api>
class basic_nccl_communicator {
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
  /// Before NCCL starts, every rank publishes which GPU it has (UUID, PCI
  /// bus id, host) and rank 0 compares them: two ranks on one GPU are a
  /// config_error on every rank that names the GPU, both ranks and their
  /// CUDA_VISIBLE_DEVICES (NCCL would refuse them later, or run them slowly).
  ///
  /// Then every rank publishes how its init ended, under
  /// "<store_key>/init/<rank>" (ok, or its error), and while it waits for
  /// init it looks for a peer's failure (every 0.2 s, from a thread of its
  /// own): a rank whose init failed never joins, so the others stop waiting
  /// and fail at once naming it, rather than at init_timeout.
  ///
  /// Throws config_error for a bad rank, size or device, and for a GPU
  /// shared by two ranks; timeout_error (the store's, or the init's) when a
  /// rank does not show up; rendezvous_error for a malformed id in the
  /// store, on every other rank at once when rank 0 cannot select its
  /// device or create the id (with rank 0's own message), and when another
  /// rank's init failed ("rank R failed: " and its message); backend_error
  /// for CUDA and NCCL failures.
  template <store Store>
  basic_nccl_communicator(Store& store, int rank, int size, int device, nccl_options options = {})
      // `options` is copied, not moved: the arguments are evaluated in no set order.
      // Rank 0 claims its device first: if it has none, nobody waits for its id.
      : basic_nccl_communicator(
            meet(store, rank, size, device, options), rank, size, device, options,
            detail::nccl_init_outcomes<Store>(store, options.store_key, rank, size)) {}

  /// Creates the communicator from an id every rank already has (from
  /// new_unique_id() on one rank, shared by any means: broadcast_nccl_unique_id
  /// under MPI). Throws as the constructor above; with no store, no rank
  /// hears of another's failed init (it waits init_timeout).
  basic_nccl_communicator(const ncclUniqueId& id, int rank, int size, int device,
                          nccl_options options = {})
      : basic_nccl_communicator(id, rank, size, device, std::move(options),
                                detail::nccl_init_alone{}) {}

#if DTRAIN_HAS_MPI()
  /// Creates the communicator of every rank of `comm` (collective: rank and
  /// size are `comm`'s), for jobs started by mpirun that have no store. Rank
  /// 0 selects its device, creates the id and MPI_Bcasts it (when it cannot,
  /// every rank fails at once with its message); then every rank's GPU is
  /// gathered to rank 0, and two ranks on one GPU are the store constructor's
  /// config_error on every rank. Then init, as the id constructor. MPI
  /// errors are checked only if `comm` returns them (MPI_ERRORS_RETURN).
  /// Throws as the id constructor, and what MPI reports.
  basic_nccl_communicator(MPI_Comm comm, int device, nccl_options options = {})
      : basic_nccl_communicator(meet(comm, device, options), detail::mpi_rank(comm),
                                detail::mpi_size(comm), device, options) {}

  /// Rank `root` of `comm` calls `prepare()`, creates an id and MPI_Bcasts
  /// it; every rank returns it. When the root fails, it throws its own error
  /// and every other rank rendezvous_error with the root's message, at once
  /// (broadcast_or_fail). Collective; throws what MPI reports.
  template <class Prepare = void (*)()>
  [[nodiscard]] static ncclUniqueId exchange_unique_id(
      MPI_Comm comm, int root = 0, Prepare&& prepare = [] {}) {
    detail::mpi_relay relay(comm, root);
    const std::string value = detail::broadcast_or_fail(relay, "the NCCL unique id", [&] {
      prepare();
      return detail::nccl_unique_id_text(new_unique_id());
    });
    return detail::nccl_unique_id_from(value, relay.where());
  }
#endif  // DTRAIN_HAS_MPI()

  basic_nccl_communicator(basic_nccl_communicator&&) noexcept = default;
  basic_nccl_communicator& operator=(basic_nccl_communicator&&) noexcept = default;
  basic_nccl_communicator(const basic_nccl_communicator&) = delete;
  basic_nccl_communicator& operator=(const basic_nccl_communicator&) = delete;
  /// Waits for this communicator's collectives (at most the collective
  /// timeout, then aborts), then ncclCommFinalize + ncclCommDestroy. Work
  /// handles still alive keep the communicator alive until they go.
  ~basic_nccl_communicator() = default;

  /// A new NCCL unique id (ncclGetUniqueId; needs no GPU). Throws backend_error.
  [[nodiscard]] static ncclUniqueId new_unique_id() {
    ncclUniqueId id{};
    DTRAIN_NCCL_CHECK(Api::ncclGetUniqueId(&id));
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
        detail::store_relay<Store>(store, std::string(key), rank, size), "the NCCL unique id", [&] {
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
    if (!shared_) return nullptr;
    std::lock_guard lock(shared_->mutex);
    return shared_->comm;
  }
  /// Whether a timeout, an engine error or abort() ended this communicator.
  [[nodiscard]] bool aborted() const {
    if (!shared_) return false;
    std::lock_guard lock(shared_->mutex);
    return shared_->aborted;
  }

  /// Aborts now: pending collectives end (their work fails) and every later
  /// call throws. For a rank that learns a peer is gone, or that failed
  /// itself (run() does this when the training function throws). Every other
  /// NCCL communicator of the process is aborted with it (NCCL's abort is not
  /// local to one communicator: detail::nccl_family), as on a timeout or an
  /// asynchronous error. Safe from any thread, while another is inside a
  /// collective: it does not wait for that call, which the abort ends.
  void abort() noexcept {
    if (!shared_) return;
    shared_->abort(0, false, "abort() was called", rank_);
  }

  /// In place or out of place (`in` and `out` may be the same buffer): `out`
  /// becomes the reduction over all ranks of `in`. avg is ncclAvg, except on
  /// float16 and bfloat16 over a number of ranks that is not a power of two:
  /// each element is divided first (into `out`), then summed
  /// (detail::nccl_divides_first; needs dtrain's kernel, an nvcc unit).
  work allreduce(buffer in, buffer out, reduce_op op, cudaStream_t stream = nullptr) {
    const bool divide = divides_first(op, in.type, "allreduce");
    return collective(detail::collective_call::allreduce(in, out, op), stream,
                      [&](ncclComm_t comm, cudaStream_t own) {
                        const void* from = in.data;
                        if (divide) {
                          DTRAIN_CUDA_CHECK(Api::divide(out.data, in.data, in.count, in.type,
                                                        static_cast<float>(size_), own));
                          from = out.data;
                        }
                        DTRAIN_NCCL_CHECK(Api::ncclAllReduce(
                            from, out.data, in.count, detail::nccl_type(in.type),
                            divide ? ncclSum : detail::nccl_op(op, size_), comm, own));
                      });
  }

  /// `data` on every rank becomes root's.
  work broadcast(buffer data, int root, cudaStream_t stream = nullptr) {
    return collective(
        detail::collective_call::broadcast(data, root), stream,
        [&](ncclComm_t comm, cudaStream_t own) {
          DTRAIN_NCCL_CHECK(Api::ncclBroadcast(data.data, data.data, data.count,
                                               detail::nccl_type(data.type), root, comm, own));
        });
  }

  /// `out` (size() × in.count elements) becomes every rank's `in`, in rank
  /// order. In place when `in` is this rank's block of `out`.
  work allgather(buffer in, buffer out, cudaStream_t stream = nullptr) {
    return collective(detail::collective_call::allgather(in, out), stream,
                      [&](ncclComm_t comm, cudaStream_t own) {
                        DTRAIN_NCCL_CHECK(Api::ncclAllGather(
                            in.data, out.data, in.count, detail::nccl_type(in.type), comm, own));
                      });
  }

  /// `in` (size() × out.count elements) is reduced over ranks; rank r gets
  /// block r in `out`. avg as allreduce's, except that the 16-bit average
  /// divides the summed block (`in` is left as it was).
  work reduce_scatter(buffer in, buffer out, reduce_op op, cudaStream_t stream = nullptr) {
    const bool divide = divides_first(op, out.type, "reduce_scatter");
    return collective(
        detail::collective_call::reduce_scatter(in, out, op), stream,
        [&](ncclComm_t comm, cudaStream_t own) {
          DTRAIN_NCCL_CHECK(
              Api::ncclReduceScatter(in.data, out.data, out.count, detail::nccl_type(out.type),
                                     divide ? ncclSum : detail::nccl_op(op, size_), comm, own));
        },
        [&](cudaStream_t own) {
          if (divide)
            DTRAIN_CUDA_CHECK(Api::divide(out.data, out.data, out.count, out.type,
                                          static_cast<float>(size_), own));
        });
  }

  /// Block j of `in` (size() blocks) to rank j; block i of `out` from rank i
  /// (out of place): one group of point-to-point sends and receives.
  work alltoall(buffer in, buffer out, cudaStream_t stream = nullptr) {
    return collective(
        detail::collective_call::alltoall(in, out), stream, [&](ncclComm_t comm, cudaStream_t own) {
          const std::size_t block = in.count / static_cast<std::size_t>(size_);
          DTRAIN_NCCL_CHECK(Api::alltoall(in.data, out.data, block, detail::nccl_type(in.type),
                                          size_of(in.type), size_, comm, own));
        });
  }

  /// Completes once every rank has reached it (and this rank's earlier
  /// collectives, and its work on `stream` before the call, are done): an
  /// allreduce of one int on the device.
  work barrier(cudaStream_t stream = nullptr) {
    return collective(
        detail::collective_call::barrier(), stream, [&](ncclComm_t comm, cudaStream_t own) {
          std::int64_t* word = shared_->barrier_word;
          DTRAIN_NCCL_CHECK(Api::ncclAllReduce(word, word, 1, ncclInt32, ncclSum, comm, own));
        });
  }

  /// Reduces each buffer in place, in one NCCL group (ncclGroupStart/End):
  /// one launch for many buffers, one work for all. Buffers may differ in type.
  /// Check mode compares the op, the number of elements and the first type.
  work allreduce_many(std::span<const buffer> buffers, reduce_op op,
                      cudaStream_t stream = nullptr) {
    for (const buffer& b : buffers) (void)divides_first(op, b.type, "allreduce_many");
    return collective(detail::collective_call::allreduce_many(buffers, op), stream,
                      [&](ncclComm_t comm, cudaStream_t own) {
                        DTRAIN_NCCL_CHECK(Api::ncclGroupStart());
                        try {
                          for (const buffer& b : buffers) {
                            if (b.count == 0) continue;
                            const bool divide = detail::nccl_divides_first(op, b.type, size_);
                            if (divide)
                              DTRAIN_CUDA_CHECK(Api::divide(b.data, b.data, b.count, b.type,
                                                            static_cast<float>(size_), own));
                            DTRAIN_NCCL_CHECK(Api::ncclAllReduce(
                                b.data, b.data, b.count, detail::nccl_type(b.type),
                                divide ? ncclSum : detail::nccl_op(op, size_), comm, own));
                          }
                        } catch (...) {
                          (void)Api::ncclGroupEnd();  // a group left open would swallow this
                                                      // thread's next NCCL calls
                          throw;
                        }
                        DTRAIN_NCCL_CHECK(Api::ncclGroupEnd());
                      });
  }

  /// Makes `stream` wait, on the device and without blocking the host, for
  /// every collective enqueued on this communicator so far.
  void stream_wait(cudaStream_t stream) {
    const auto what = [this] { return describe("stream_wait", ""); };  // on failure only
    detail::nccl_shared<Api>& s = usable(what);
    try {
      detail::basic_device_guard<Api> guard(s.device);
      detail::nccl_pooled_event<Api> done(s);
      s.call(what, [&](ncclComm_t) {
        DTRAIN_CUDA_CHECK(Api::cudaEventRecord(done.get(), s.stream.get()));
        DTRAIN_CUDA_CHECK(Api::cudaStreamWaitEvent(stream, done.get(), 0));
      });
    } catch (const backend_error& e) {
      throw detail::nccl_with_context(what(), e);
    }
  }

  /// ncclCommSplit: ranks passing the same `color` form a communicator, ordered
  /// by `key` (then by rank here). A negative color leaves this rank out: it
  /// gets a communicator with valid() false. Collective over this communicator;
  /// waits for this communicator's collectives first (NCCL requires it), and
  /// for the split itself at most options().init_timeout.
  [[nodiscard]] basic_nccl_communicator split(int color, int key) {
    const std::string what =
        describe("split", "color " + std::to_string(color) + ", key " + std::to_string(key));
    detail::nccl_shared<Api>& s = usable(what);
    s.check_not_aborted(what);
    // Numbered in the ring like any collective (as Gloo's split), so that check
    // mode and the desync table name it alike.
    const detail::collective_info call{
        "split", name, rank_, size_, 0, static_cast<std::uint8_t>(dtype::int32), -1, -1};
    const detail::signature sig = detail::signature_of(detail::record(*ring_, call), call);
    auto settle = [&](detail::call_state state) { ring_->settle(sig.seq, state); };
    try {
      detail::basic_device_guard<Api> guard(s.device);
      if (s.options.collectives.check) check_signature(s, sig, what);
      s.wait(what + " (waiting for earlier collectives)", s.options.collectives.timeout,
             detail::nccl_timeout_hint,
             [&] { return detail::nccl_stream_idle<Api>(s.stream.get()); });
      // The child's stream and scratch exist before the child does, so that no
      // failure can strand a live NCCL communicator.
      auto child = detail::nccl_shared<Api>::create(0, s.size, s.device, s.options);
      ncclConfig_t config = s.config();
      s.split_slot =
          nullptr;  // written by NCCL when the split completes, maybe after the call returns
      s.call(what, [&](ncclComm_t comm) {
        DTRAIN_NCCL_CHECK(Api::ncclCommSplit(comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key,
                                             &s.split_slot, &config));
      });
      s.wait(what, s.options.init_timeout, detail::nccl_timeout_hint, [] { return true; });
      child->comm = s.split_slot;
      s.split_slot = nullptr;
      if (child->comm) detail::nccl_family<Api>::get().join(child);
      if (!child->comm) {
        settle(detail::call_state::completed);
        return basic_nccl_communicator(nullptr, -1, 0);
      }
      child->wait(what, s.options.init_timeout, detail::nccl_timeout_hint, [] { return true; });
      DTRAIN_NCCL_CHECK(Api::ncclCommUserRank(child->comm, &child->rank));
      DTRAIN_NCCL_CHECK(Api::ncclCommCount(child->comm, &child->size));
      const int child_rank = child->rank, child_size = child->size;
      basic_nccl_communicator out(std::move(child), child_rank, child_size);
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
  basic_nccl_communicator(std::shared_ptr<detail::nccl_shared<Api>> shared, int rank,
                          int size) noexcept
      : shared_(std::move(shared)), rank_(rank), size_(size) {}

  // Both public constructors end here: `peers` (nccl_init_outcomes, or
  // nccl_init_alone) hears how this rank's init ended, and watches the others'.
  template <class Peers>
  basic_nccl_communicator(const ncclUniqueId& id, int rank, int size, int device,
                          nccl_options options, Peers&& peers)
      : rank_(rank), size_(size) {
    try {
      shared_ = start(id, device, std::move(options), peers);
    } catch (...) {
      // A rank that fails because a peer did has nothing of its own to tell.
      if (peers.peer_failure().empty()) peers.failed(detail::current_failure().second);
      throw;
    }
    peers.succeeded();
  }

  // ncclCommInitRankConfig on `device`, waited for (at most init_timeout, or
  // until `peers` sees another rank's init fail).
  template <class Peers>
  std::shared_ptr<detail::nccl_shared<Api>> start(const ncclUniqueId& id, int device,
                                                  nccl_options options, Peers& peers) {
    detail::nccl_claim_device<Api>(rank_, size_, device, options.cuda_visible_devices);
    const std::string what = detail::nccl_creating(rank_, size_, device);
    try {
      auto s = detail::nccl_shared<Api>::create(rank_, size_, device, std::move(options));
      ncclConfig_t config = s->config();
      try {
        DTRAIN_NCCL_CHECK(Api::ncclCommInitRankConfig(&s->comm, size_, id, rank_, &config));
        detail::nccl_family<Api>::get().join(s);  // from now on it fails with the others
      } catch (...) {
        if (s->comm) (void)Api::ncclCommAbort(s->comm);
        s->comm = nullptr;
        throw;
      }
      // Non-blocking: NCCL connects the ranks in the background; a rank that
      // never comes would otherwise hang this call for ever. A peer whose
      // init failed never comes: the abort from the watch ends the wait.
      peers.watch(
          [s]() noexcept { s->abort(0, false, "another rank's NCCL init failed", s->rank); });
      std::exception_ptr ended;
      try {
        s->wait(what, s->options.init_timeout,
                "every rank must start and reach the others' network interfaces "
                "(NCCL_SOCKET_IFNAME); NCCL_DEBUG=INFO shows where it stopped",
                [] { return true; });
      } catch (...) {
        ended = std::current_exception();
      }
      peers.stop();
      // A peer's failure explains this rank's, however its wait ended.
      if (!peers.peer_failure().empty())
        throw rendezvous_error(what + " stopped: " + peers.peer_failure());
      if (ended) std::rethrow_exception(ended);
      return s;
    } catch (const backend_error& e) {
      throw detail::nccl_with_context(what, e);
    }
  }

  // The store constructor's meeting: the id from rank 0 (which claims its
  // device first: if it has none, nobody waits for its id), then the check
  // that no two ranks share a GPU.
  template <store Store>
  static ncclUniqueId meet(Store& store, int rank, int size, int device,
                           const nccl_options& options) {
    const ncclUniqueId id = exchange_unique_id(store, rank, size, options.store_key, [&] {
      detail::nccl_claim_device<Api>(rank, size, device, options.cuda_visible_devices);
    });
    check_own_gpus(store, rank, size, device, options);
    return id;
  }

#if DTRAIN_HAS_MPI()
  // The MPI constructor's meeting, as the store's.
  static ncclUniqueId meet(MPI_Comm comm, int device, const nccl_options& options) {
    const int rank = detail::mpi_rank(comm), size = detail::mpi_size(comm);
    const ncclUniqueId id = exchange_unique_id(comm, 0, [&] {
      detail::nccl_claim_device<Api>(rank, size, device, options.cuda_visible_devices);
    });
    check_own_gpus(comm, rank, size, device, options);
    return id;
  }
#endif  // DTRAIN_HAS_MPI()

  // Each rank sets its GPU, or why it has none, under "<store_key>/gpu/<rank>";
  // rank 0 reads them all and says (broadcast_or_fail) which two share one.
  template <store Store>
  static void check_own_gpus(Store& store, int rank, int size, int device,
                             const nccl_options& options) {
    const std::string base = options.store_key + "/gpu/";
    std::exception_ptr failed;
    store.set(base + std::to_string(rank), own_gpu(rank, size, device, options, failed));
    detail::store_relay<Store> relay(store, base + "verdict", rank, size);
    // A rank other than the root fails now (the root reads why); the root
    // fails through the verdict, so that nobody waits for it.
    if (failed && !relay.is_root()) {
      relay.failure_read();  // the root need not stay for this rank: it knows
      std::rethrow_exception(failed);
    }
    const std::string problem =
        detail::broadcast_or_fail(relay, "the check that every rank has a GPU of its own", [&] {
          if (failed) std::rethrow_exception(failed);
          // The ranks publish their GPU as they create their communicator: a
          // rank that never comes is an init that does not finish (init_timeout).
          std::vector<std::string> keys;
          for (int r = 0; r < size; ++r) keys.push_back(base + std::to_string(r));
          try {
            store.wait(keys, options.init_timeout);
          } catch (const timeout_error& e) {
            throw timeout_error("creating the NCCL communicator on rank " + std::to_string(rank) +
                                " of " + std::to_string(size) + " did not finish within " +
                                detail::nccl_seconds(options.init_timeout) +
                                ": not every rank published its GPU (a rank that never started, "
                                "or is slower than nccl_options::init_timeout, " +
                                std::string(nccl_init_timeout_variable) + "): " + e.what());
          }
          std::vector<std::pair<std::string, std::string>> records;
          for (int r = 0; r < size; ++r) {
            const std::string key = base + std::to_string(r);
            records.emplace_back("store key \"" + key + "\"", store.get(key));
          }
          return detail::nccl_shared_gpu_problem(records);
        });
    if (problem.empty()) return;
    // Every rank fails with the same config_error; rank 0, which may host the
    // store, stays until the others have read it.
    if (relay.is_root()) {
      relay.failure_carried();
    } else {
      relay.failure_read();
    }
    throw config_error(problem);
  }

  // This rank's GPU as the checks publish it: a wire::outcome of its
  // nccl_gpu, or of why it has none (then `failed` holds that error).
  static std::string own_gpu(int rank, int size, int device, const nccl_options& options,
                             std::exception_ptr& failed) {
    try {
      detail::nccl_claim_device<Api>(rank, size, device, options.cuda_visible_devices);
      detail::nccl_gpu gpu{.uuid = {},
                           .pci_bus = {},
                           .host = detail::host_name().value_or("<unknown host>"),
                           .device = device,
                           .visible = options.cuda_visible_devices.value_or("<unset>")};
      DTRAIN_CUDA_CHECK(Api::device_identity(device, gpu.uuid, gpu.pci_bus));
      return detail::wire::outcome{true, gpu.encode()}.encode();
    } catch (...) {
      failed = std::current_exception();
      return detail::wire::outcome{false, detail::current_failure().second}.encode();
    }
  }

#if DTRAIN_HAS_MPI()
  // check_own_gpus over MPI: every rank's record gathered to rank 0, which
  // says (broadcast_or_fail) which two share a GPU. Every rank takes part in
  // both steps, even one without a GPU, which then throws its own error.
  static void check_own_gpus(MPI_Comm comm, int rank, int size, int device,
                             const nccl_options& options) {
    std::exception_ptr failed;
    const std::vector<std::string> records =
        detail::mpi_gather_text(comm, own_gpu(rank, size, device, options, failed), 0,
                                "gathering every rank's GPU for the NCCL communicator");
    const std::string problem = detail::broadcast_or_fail(
        detail::mpi_relay(comm, 0), "the check that every rank has a GPU of its own", [&] {
          if (failed) std::rethrow_exception(failed);
          std::vector<std::pair<std::string, std::string>> named;
          for (std::size_t r = 0; r < records.size(); ++r)
            named.emplace_back("rank " + std::to_string(r) + "'s GPU in the MPI gather",
                               records[r]);
          return detail::nccl_shared_gpu_problem(named);
        });
    if (failed) std::rethrow_exception(failed);
    if (!problem.empty()) throw config_error(problem);
  }
#endif  // DTRAIN_HAS_MPI()

  // Whether `op` on `type` divides each element first (nccl_divides_first);
  // config_error, before anything runs, when the program has no divide kernel.
  [[nodiscard]] bool divides_first(reduce_op op, dtype type, std::string_view what) const {
    if (!detail::nccl_divides_first(op, type, size_)) return false;
    if (!Api::can_divide())
      throw detail::nccl_no_divide(describe(what, "avg, " + std::string(to_string(type))), type,
                                   size_);
    return true;
  }

  [[nodiscard]] std::string describe(std::string_view what, std::string_view args) const {
    return detail::describe(what, args, rank_, size_, name);
  }

  // A left-out (or moved-from) communicator fails here, before anything else.
  template <class What>
  detail::nccl_shared<Api>& usable(const What& what) const {
    if (shared_) return *shared_;
    detail::throw_invalid(detail::what_text(what), rank_ < 0);
  }

  // Check mode: every rank's signature, gathered by an (unchecked) ncclAllGather
  // of signature::fields int64 per rank through device scratch memory and a pinned host copy.
  // The host waits for it (at most the collective timeout).
  template <class What>
  void check_signature(detail::nccl_shared<Api>& s, const detail::signature& mine,
                       const What& what) {
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
            s.call(checking, [&](ncclComm_t comm) {
              DTRAIN_CUDA_CHECK(Api::cudaMemcpyAsync(s.device_table + row, host + row,
                                                     width * sizeof(std::int64_t),
                                                     cudaMemcpyHostToDevice, s.stream.get()));
              DTRAIN_NCCL_CHECK(Api::ncclAllGather(s.device_table + row, s.device_table, width,
                                                   ncclInt64, comm, s.stream.get()));
            });
            s.wait(checking, s.options.collectives.timeout, detail::nccl_timeout_hint,
                   [] { return true; });
            detail::nccl_pooled_event<Api> done(s);
            s.call(checking, [&](ncclComm_t) {
              DTRAIN_CUDA_CHECK(Api::cudaMemcpyAsync(host, s.device_table,
                                                     all.size() * sizeof(std::int64_t),
                                                     cudaMemcpyDeviceToHost, s.stream.get()));
              DTRAIN_CUDA_CHECK(Api::cudaEventRecord(done.get(), s.stream.get()));
            });
            s.wait(checking, s.options.collectives.timeout,
                   "a rank did not call this collective, or called fewer collectives than this one",
                   [&] { return detail::nccl_event_done<Api>(done.get()); });
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
  // `finish(own stream)` runs after NCCL's enqueue has completed, before the
  // completion event: device work that must follow the collective.
  template <class Enqueue, class Finish = void (*)(cudaStream_t)>
  work collective(
      const detail::collective_call& call, cudaStream_t caller, Enqueue&& enqueue,
      Finish&& finish = [](cudaStream_t) {}) {
    const detail::collective_info what = call.info(name, rank_, size_);
    detail::nccl_shared<Api>& s = usable(what);
    detail::check_arguments(call, what, detail::nccl_memory);
    s.check_not_aborted(what);
    const std::int64_t seq = detail::record(*ring_, what);
    const bool moves = call.moves_data();
    if (!moves && !s.options.collectives.check) {
      ring_->settle(seq, detail::call_state::completed);
      return work();  // nothing to move, nothing to order
    }
    try {
      detail::basic_device_guard<Api> guard(s.device);
      if (s.options.collectives.check) check_signature(s, detail::signature_of(seq, what), what);
      if (!moves) {
        ring_->settle(seq, detail::call_state::completed);
        return work();
      }
      // At most max_in_flight collectives ahead of the device: a dead peer
      // stops the host here (within the collective timeout), not never.
      s.make_room(what);
      // No lock is held across these calls: any of them can block (a full
      // launch queue, NCCL's work FIFO, a connection to a peer), and an abort
      // from another thread (a watchdog's timeout) is what ends such a call.
      {
        detail::nccl_pooled_event<Api> ready(s);
        s.call(what, [&](ncclComm_t) {
          DTRAIN_CUDA_CHECK(Api::cudaEventRecord(ready.get(), caller));
          DTRAIN_CUDA_CHECK(Api::cudaStreamWaitEvent(s.stream.get(), ready.get(), 0));
        });
      }  // the wait holds the recorded point; the event can be reused at once
      s.call(what, [&](ncclComm_t comm) { enqueue(comm, s.stream.get()); });
      // A non-blocking NCCL may still be enqueueing in the background; nothing
      // may be added to its stream until it is done.
      s.wait(what, s.options.collectives.timeout, detail::nccl_timeout_hint, [] { return true; });
      detail::nccl_pooled_event<Api> done(s);
      s.call(what, [&](ncclComm_t) {
        finish(s.stream.get());
        DTRAIN_CUDA_CHECK(Api::cudaEventRecord(done.get(), s.stream.get()));
        s.fenced();
      });
      auto w = std::make_shared<detail::nccl_work<Api>>(what, s.options.collectives.timeout,
                                                        shared_, done.release());
      w->track(ring_, seq);
      return work(std::move(w));
    } catch (const backend_error& e) {
      throw detail::nccl_with_context(detail::describe(what), e);
    }
  }

  std::shared_ptr<detail::nccl_shared<Api>> shared_;
  std::shared_ptr<detail::collective_ring> ring_ = std::make_shared<detail::collective_ring>();
  int rank_ = -1;
  int size_ = 0;
};

/// The NCCL backend's communicator, on the CUDA runtime and NCCL themselves.
using nccl_communicator = basic_nccl_communicator<detail::nccl_library>;

static_assert(communicator<nccl_communicator>);

#if DTRAIN_HAS_MPI()
/// Rank `root` of `comm` creates an NCCL unique id and MPI_Bcasts it to every
/// rank of `comm` (collective; returns the same id everywhere), for jobs
/// started by mpirun that have no store. If the root cannot create an id, it
/// throws its own error and every other rank throws rendezvous_error with
/// the root's message, rather than waiting (broadcast_or_fail). MPI errors
/// are checked only if `comm` returns them (MPI_ERRORS_RETURN).
DTRAIN_DETAIL_INLINE ncclUniqueId broadcast_nccl_unique_id(MPI_Comm comm, int root = 0);
#endif  // DTRAIN_HAS_MPI()

}  // namespace dtrain

#endif  // DTRAIN_HAS_NCCL()

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/backend/nccl/nccl-inl.hpp>
#endif
