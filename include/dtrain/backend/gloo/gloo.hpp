#pragma once
/// @file
/// gloo_communicator: the communicator concept on Gloo's TCP transport, for
/// host memory. Bootstrapped through dtrain's store, so env:// jobs (torchrun
/// style, no mpirun) run on CPUs. Gloo's calls block, so every communicator
/// runs its collectives on one worker thread, in the order they were
/// submitted; all ranks submit in the same order, so the queues stay matched.

#include <dtrain/config.hpp>

#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/gloo/store.hpp>
#include <dtrain/backend/gloo/worker.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/variables.hpp>
#include <dtrain/error.hpp>
#include <dtrain/rendezvous/security.hpp>
#include <dtrain/rendezvous/store.hpp>

#if DTRAIN_HAS_GLOO()

#include <gloo/context.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <pthread.h>
#include <unistd.h>

namespace dtrain {

/// Options of a gloo_communicator. Aggregate: use designated initialisers,
/// `{.collectives = {.timeout = 30s}, .interface = "eth0"}`.
struct gloo_options {
  /// Timeout (also Gloo's own, so a dead or stuck peer makes Gloo fail) and check mode.
  collective_options collectives{};
  /// Network interface Gloo's TCP transport binds to ("eth0"). Empty:
  /// DTRAIN_GLOO_IFNAME, else GLOO_SOCKET_IFNAME (from `env`), else the
  /// interface whose address reaches `master_addr`.
  std::string interface {};
  /// The host whose route chooses the interface when none is named. Empty:
  /// MASTER_ADDR (from `env`).
  std::string master_addr{};
  /// Where the communicator's keys live in the store. The n-th communicator a
  /// rank makes with one prefix uses `prefix/n`, so every rank must make its
  /// communicators in the same order (as it runs its collectives).
  std::string prefix = "dtrain/gloo";
  /// Allreduces (and reduce_scatters, allgathers) through one shared-memory segment when
  /// every rank of the communicator runs on this host (backend/gloo/shm.hpp), not
  /// through TCP over loopback. true: required (making the communicator fails
  /// when it cannot be used); false: off. Unset: DTRAIN_GLOO_SHM from `env`
  /// (1 required, 0 off), else used wherever it can be. Every rank must
  /// allow it, or none uses it; describe() says which, and why not.
  std::optional<bool> shared_memory{};
  /// The environment snapshot DTRAIN_GLOO_IFNAME, GLOO_SOCKET_IFNAME,
  /// MASTER_ADDR and MASTER_PORT are read from; the communicator never reads
  /// the process's own. dtrain::run passes its snapshot; empty: none is set.
  environment env{};
};

namespace detail {

/// Blocks SIGPIPE in the calling thread while it lives, and in the threads it starts meanwhile.
class sigpipe_blocked {
 public:
  sigpipe_blocked() noexcept;
  ~sigpipe_blocked() { ::pthread_sigmask(SIG_SETMASK, &previous_, nullptr); }
  sigpipe_blocked(const sigpipe_blocked&) = delete;
  sigpipe_blocked& operator=(const sigpipe_blocked&) = delete;

 private:
  sigset_t previous_{};
};

/// The file mapped at `address` in this process (/proc/self/maps), or empty.
DTRAIN_DETAIL_INLINE std::string mapped_file_of(const void* address);

/// Refuses, naming the library, a process where Gloo's functions resolve to
/// a LibTorch's own copy of Gloo (pytorch.org's and PyPI's LibTorch export
/// one) rather than to the libgloo whose headers dtrain was compiled
/// against: another version, whose calls crash. It happens when LibTorch
/// comes before libgloo on the link line.
DTRAIN_DETAIL_INLINE void check_gloo_library(int rank);

/// Whether a communicator may use shared memory: off, where it can, or required.
enum class shm_mode : char { off = '0', automatic = 'a', required = '1' };

DTRAIN_DETAIL_INLINE shm_mode shm_mode_of(const gloo_options& o);

/// What tells this host apart from the ranks' point of view: the boot, the
/// host name, and the network and mount namespaces (ranks in other ones, as
/// on hosts simulated with network namespaces, are other hosts: their
/// traffic is what is being tested, and /dev/shm may differ).
DTRAIN_DETAIL_INLINE std::string shm_host_identity();

/// A fixed-size record of text for Gloo's allgather and broadcast: a status
/// byte, then text cut at `record_bytes` - 2.
inline constexpr std::size_t shm_record_bytes = 256;
DTRAIN_DETAIL_INLINE void shm_put(std::uint8_t* record, char status, const std::string& text);
DTRAIN_DETAIL_INLINE std::string shm_text_of(const std::uint8_t* record);

/// Sets up s.shm over the freshly connected Gloo context, collectively (every
/// rank calls it; all reach the same decision from the same allgathered
/// records), and returns the describe() text. Throws config_error when a
/// rank requires shared memory and it cannot be used.
DTRAIN_DETAIL_INLINE std::string gloo_join_shm(gloo_state& s, shm_mode mode);

/// Everything a gloo_communicator owns; one allocation, so the communicator moves cheaply.
struct gloo_self {
  std::shared_ptr<gloo_state> state;
  std::thread worker;
  std::shared_ptr<const gloo_store_ref> store;
  gloo_options options;
  gloo_endpoint endpoint;
  std::string keys;         // this communicator's namespace in the store
  std::int64_t splits = 0;  // split() calls so far: names the children's namespaces

  gloo_self() = default;
  gloo_self(const gloo_self&) = delete;
  gloo_self& operator=(const gloo_self&) = delete;
  // Runs what is queued (the peers expect it), then stops the worker. A
  // collective stuck on a hung peer ends with Gloo's timeout.
  ~gloo_self();
};

}  // namespace detail

/// A communicator on Gloo (TCP), on host memory. Every call returns at once
/// with a work handle; the collective runs on this communicator's worker
/// thread after those submitted before it. Buffers must stay alive and
/// untouched until the work completes. Calls may come from several threads;
/// every rank must still make them in the same order.
///
/// Errors: config_error for arguments (thrown by the call); from work::wait,
/// backend_error with Gloo's message (a peer died: at once) and timeout_error
/// (Gloo's own timeout, the collective timeout). After any failure or timeout
/// the communicator is unusable: later calls throw backend_error saying so.
/// Destruction runs what is still queued and waits for the collective in
/// flight, which Gloo cannot abort: at most its timeout.
///
/// float16 and bfloat16 reduce through dtrain's own element-wise functions
/// (Gloo knows neither of dtrain's types); reduce_scatter is an allreduce and
/// a copy (see gloo_run_reduce_scatter).
class gloo_communicator {
 public:
  static constexpr bool reaches_device_memory = false;
  static constexpr bool reaches_host_memory = true;
  static constexpr std::string_view name = "gloo";

  /// Joins the group of `size` ranks that meet in `store`, which must outlive
  /// this communicator and every split of it. Blocks until every rank has
  /// connected; the store's waits use the collective timeout. Throws
  /// config_error (rank, size, interface), timeout_error or rendezvous_error
  /// (the store), backend_error (Gloo could not connect).
  template <store S>
  gloo_communicator(S& store, int rank, int size, gloo_options options = {})
      : gloo_communicator(std::make_shared<const detail::gloo_store_ref>(store), rank, size,
                          std::move(options)) {}

  gloo_communicator(gloo_communicator&&) noexcept = default;
  gloo_communicator& operator=(gloo_communicator&&) noexcept = default;
  ~gloo_communicator() = default;

  /// -1 and 0 for a rank that split() left out (negative color).
  [[nodiscard]] int rank() const noexcept { return self_ ? self_->state->rank : -1; }
  [[nodiscard]] int size() const noexcept { return self_ ? self_->state->size : 0; }
  /// False when moved from, or when split() left this rank out.
  [[nodiscard]] bool valid() const noexcept { return self_ != nullptr; }
  /// Only while valid().
  [[nodiscard]] const gloo_options& options() const noexcept { return self_->options; }
  /// This communicator's last collectives, for desync diagnostics (null when not valid()).
  [[nodiscard]] std::shared_ptr<detail::collective_ring> ring() const noexcept {
    return self_ ? self_->state->ring : nullptr;
  }

  /// Where it runs, for logs: "gloo rank 1 of 4, tcp, pci=, iface=lo, speed=-1, addr=[127.0.0.1]
  /// (the address that reaches MASTER_ADDR=127.0.0.1 (127.0.0.1)), keys under dtrain/gloo/0,
  /// shared memory on (3076 KiB segment, 1024 KiB slots)", or "shared memory off (why)".
  [[nodiscard]] std::string describe() const;

  /// Gloo's context, for interop and benchmarks against raw Gloo calls. Use
  /// it only while no work of this communicator is outstanding.
  [[nodiscard]] std::shared_ptr<::gloo::Context> gloo_context() const {
    return self_ ? self_->state->context : nullptr;
  }

  /// `out` becomes the reduction of every rank's `in` (in place when they are the same buffer).
  work allreduce(buffer in, buffer out, reduce_op op);

  /// `data` on every rank becomes root's.
  work broadcast(buffer data, int root);

  /// `out` (size() × in.count elements) becomes every rank's `in`, in rank order.
  work allgather(buffer in, buffer out) {
    return collective(detail::collective_call::allgather(in, out), &run_allgather);
  }

  /// `in` (size() × out.count elements) is reduced over ranks; rank r receives block r.
  work reduce_scatter(buffer in, buffer out, reduce_op op);

  /// Block j of `in` (size() blocks) to rank j; block i of `out` from rank i
  /// (out of place). Through the shared-memory segment on one host, else
  /// Gloo's alltoall over its TCP pairs.
  work alltoall(buffer in, buffer out) {
    return collective(detail::collective_call::alltoall(in, out), &run_alltoall);
  }

  /// Completes once every rank has called barrier().
  work barrier();

  /// A communicator of the ranks that pass the same `color`, ranked by
  /// (key, rank here). Collective over this communicator: every rank calls it,
  /// in the same place among its collectives. Blocks until the new group has
  /// connected, through the same store, under a namespace of its own. A
  /// negative color leaves this rank out: it gets a communicator with valid()
  /// false (see the `communicator` concept).
  gloo_communicator split(int color, int key);

 private:
  struct left_out_tag {};
  explicit gloo_communicator(left_out_tag) noexcept : left_out_(true) {}

  // A new group: chooses the endpoint, then takes the next namespace under the prefix.
  gloo_communicator(std::shared_ptr<const detail::gloo_store_ref> store, int rank, int size,
                    gloo_options options);

  gloo_communicator(std::shared_ptr<const detail::gloo_store_ref> store, int rank, int size,
                    gloo_options options, detail::gloo_endpoint endpoint, std::string keys) {
    connect(std::move(store), rank, size, std::move(options), std::move(endpoint), std::move(keys));
  }

  void connect(std::shared_ptr<const detail::gloo_store_ref> store, int rank, int size,
               gloo_options options, detail::gloo_endpoint endpoint, std::string keys);

  using ms = std::chrono::milliseconds;

  static void run_allgather(detail::gloo_state& s, const detail::collective_call& c, ms timeout) {
    detail::gloo_run_allgather(s, c.in, c.out, timeout);
  }

  static void run_alltoall(detail::gloo_state& s, const detail::collective_call& c, ms timeout) {
    detail::gloo_run_alltoall(s, c.in, c.out, timeout);
  }

  static constexpr detail::memory_reach host_memory{
      .host = true,
      .device = false,
      .rule =
          "gloo reduces host memory only: copy device data to the host first, "
          "or use backend::nccl"};

  // Every collective, in this order: a left-out rank fails first; then the
  // argument checks every engine shares; a broken communicator; the ring's
  // number and the signature check mode compares (on the worker, before the
  // collective); then the queue, in submission order. Nothing moves for a
  // zero-length call: complete at once, except in check mode.
  work collective(const detail::collective_call& call, detail::gloo_runner run);

  std::unique_ptr<detail::gloo_self> self_;
  bool left_out_ = false;  // split() gave this rank a negative color
};

static_assert(communicator<gloo_communicator>);

}  // namespace dtrain

#endif  // DTRAIN_HAS_GLOO()

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/backend/gloo/gloo-inl.hpp>
#endif
