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

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE sigpipe_blocked::sigpipe_blocked() noexcept {
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  ::pthread_sigmask(SIG_BLOCK, &pipe, &previous_);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The file mapped at `address` in this process (/proc/self/maps), or empty.
DTRAIN_DETAIL_INLINE std::string mapped_file_of(const void* address);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string mapped_file_of(const void* address) {
  std::FILE* maps = std::fopen("/proc/self/maps", "r");
  if (!maps) return {};
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  std::string found;
  char line[4096];
  while (found.empty() && std::fgets(line, sizeof line, maps)) {
    unsigned long long begin = 0, end = 0;
    int path_at = 0;
    if (std::sscanf(line, "%llx-%llx %*s %*s %*s %*s %n", &begin, &end, &path_at) < 2) continue;
    if (at < begin || at >= end || path_at <= 0) continue;
    found = line + path_at;
    while (!found.empty() && (found.back() == '\n' || found.back() == ' ')) found.pop_back();
  }
  std::fclose(maps);
  return found;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Refuses, naming the library, a process where Gloo's functions resolve to
/// a LibTorch's own copy of Gloo (pytorch.org's and PyPI's LibTorch export
/// one) rather than to the libgloo whose headers dtrain was compiled
/// against: another version, whose calls crash. It happens when LibTorch
/// comes before libgloo on the link line.
DTRAIN_DETAIL_INLINE void check_gloo_library(int rank);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void check_gloo_library(int rank) {
  using create_device =
      std::shared_ptr<::gloo::transport::Device> (*)(const ::gloo::transport::tcp::attr&);
  const create_device create = &::gloo::transport::tcp::CreateDevice;
  const void* code = nullptr;
  std::memcpy(&code, &create, sizeof code);
  const std::string file = mapped_file_of(code);
  const std::string base = file.substr(file.find_last_of('/') + 1);
  if (!base.starts_with("libtorch")) return;
  throw config_error(
      "gloo_communicator on rank " + std::to_string(rank) + ": Gloo's functions resolve to " +
      file +
      ", the copy of Gloo inside LibTorch, not to the libgloo dtrain was compiled against "
      "(another version: its calls would crash). Link libgloo before LibTorch (CMake: "
      "list dtrain::gloo before the torch libraries), "
      "or use dtrain's MPI or NCCL engine with this LibTorch");
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Whether a communicator may use shared memory: off, where it can, or required.
enum class shm_mode : char { off = '0', automatic = 'a', required = '1' };

DTRAIN_DETAIL_INLINE shm_mode shm_mode_of(const gloo_options& o);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE shm_mode shm_mode_of(const gloo_options& o) {
  std::optional<bool> on = o.shared_memory;
  if (!on) on = read_flag(o.env, gloo_shm_variable);
  if (!on) return shm_mode::automatic;
  return *on ? shm_mode::required : shm_mode::off;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// What tells this host apart from the ranks' point of view: the boot, the
/// host name, and the network and mount namespaces (ranks in other ones, as
/// on hosts simulated with network namespaces, are other hosts: their
/// traffic is what is being tested, and /dev/shm may differ).
DTRAIN_DETAIL_INLINE std::string shm_host_identity();
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string shm_host_identity() {
  std::string id;
  if (std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char boot[64] = {};
    if (std::fgets(boot, sizeof boot, f)) id += boot;
    std::fclose(f);
  }
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) == 0) id += host;
  for (const char* ns : {"/proc/self/ns/net", "/proc/self/ns/mnt"}) {
    char link[128] = {};
    const auto n = ::readlink(ns, link, sizeof link - 1);
    id += "|";
    if (n > 0) id.append(link, static_cast<std::size_t>(n));
  }
  return id;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// A fixed-size record of text for Gloo's allgather and broadcast: a status
/// byte, then text cut at `record_bytes` - 2.
inline constexpr std::size_t shm_record_bytes = 256;
DTRAIN_DETAIL_INLINE void shm_put(std::uint8_t* record, char status, const std::string& text);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void shm_put(std::uint8_t* record, char status, const std::string& text) {
  std::memset(record, 0, shm_record_bytes);
  record[0] = static_cast<std::uint8_t>(status);
  std::memcpy(record + 1, text.data(), std::min(text.size(), shm_record_bytes - 2));
}
#endif  // DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string shm_text_of(const std::uint8_t* record);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string shm_text_of(const std::uint8_t* record) {
  const char* text = reinterpret_cast<const char*>(record + 1);
  return std::string(text, ::strnlen(text, shm_record_bytes - 1));
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Sets up s.shm over the freshly connected Gloo context, collectively (every
/// rank calls it; all reach the same decision from the same allgathered
/// records), and returns the describe() text. Throws config_error when a
/// rank requires shared memory and it cannot be used.
DTRAIN_DETAIL_INLINE std::string gloo_join_shm(gloo_state& s, shm_mode mode);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string gloo_join_shm(gloo_state& s, shm_mode mode) {
  if (s.size == 1) return "off (a world of one)";
#if !DTRAIN_HAS_SHM()
  if (mode == shm_mode::required) {
    throw config_error("DTRAIN_GLOO_SHM=1 (or gloo_options::shared_memory) on rank " +
                       std::to_string(s.rank) + ": this platform has no shared-memory path");
  }
  return "off (not on this platform)";
#else
  const auto ranks = static_cast<std::size_t>(s.size);
  const auto everyone = [&](const std::uint8_t* own, std::vector<std::uint8_t>& into) {
    into.assign(ranks * shm_record_bytes, 0);
    gloo_run_allgather_tcp(s,
                           buffer{const_cast<std::uint8_t*>(own), shm_record_bytes, dtype::uint8},
                           buffer{into.data(), into.size(), dtype::uint8}, s.timeout);
  };
  const auto record = [&](const std::vector<std::uint8_t>& records, int r) {
    return records.data() + static_cast<std::size_t>(r) * shm_record_bytes;
  };
  std::uint8_t mine[shm_record_bytes];
  std::vector<std::uint8_t> all;
  // 1. Does every rank allow it, and run on this host?
  shm_put(mine, static_cast<char>(mode), shm_host_identity());
  everyone(mine, all);
  int required_by = -1;
  std::string why_not;
  for (int r = 0; r < s.size; ++r) {
    const auto m = static_cast<shm_mode>(record(all, r)[0]);
    if (m == shm_mode::required && required_by < 0) required_by = r;
    if (m == shm_mode::off && why_not.empty())
      why_not =
          "DTRAIN_GLOO_SHM=0 or gloo_options::shared_memory = false on rank " + std::to_string(r);
  }
  for (int r = 1; r < s.size && why_not.empty(); ++r) {
    if (shm_text_of(record(all, r)) != shm_text_of(record(all, 0)))
      why_not = "ranks 0 and " + std::to_string(r) + " run on different hosts";
  }
  // 2. Rank 0 makes the segment and tells the others its name, or why not.
  if (why_not.empty()) {
    if (s.rank == 0) {
      try {
        const std::string name = "/dtrain-gloo-" + new_store_token();
        s.shm = shm_segment::create(name, s.size);
        shm_put(mine, 'y', name);
      } catch (const shm_failure& e) {
        shm_put(mine, 'n', std::string("rank 0: ") + e.what());
      }
    }
    gloo_run_broadcast(s, buffer{mine, shm_record_bytes, dtype::uint8}, 0, s.timeout);
    if (mine[0] != 'y') why_not = shm_text_of(mine);
  }
  // 3. The others open it; every rank hears how each fared; rank 0 unlinks.
  if (why_not.empty()) {
    const std::string made = shm_text_of(mine);
    std::uint8_t status[shm_record_bytes];
    shm_put(status, 'y', "");
    if (s.rank != 0) {
      try {
        s.shm = shm_segment::open(made, s.rank, s.size);
      } catch (const shm_failure& e) {
        shm_put(status, 'n', "rank " + std::to_string(s.rank) + ": " + e.what());
      }
    }
    everyone(status, all);
    if (s.rank == 0) shm_segment::unlink(made);
    for (int r = 0; r < s.size && why_not.empty(); ++r) {
      if (record(all, r)[0] != 'y') why_not = shm_text_of(record(all, r));
    }
  }
  if (!why_not.empty()) {
    s.shm = shm_segment{};
    if (required_by >= 0) {
      throw config_error("DTRAIN_GLOO_SHM=1 (or gloo_options::shared_memory = true) on rank " +
                         std::to_string(required_by) +
                         ", but shared memory cannot be used: " + why_not);
    }
    return "off (" + why_not + ")";
  }
  return "on (" + std::to_string(s.shm.bytes() >> 10) + " KiB segment, " +
         std::to_string(s.shm.slot_bytes() >> 10) + " KiB slots)";
#endif
}
#endif  // DTRAIN_DETAIL_BODIES()

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

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE gloo_self::~gloo_self() {
  if (state) {
    {
      std::lock_guard lock(state->mutex);
      state->stopping = true;
    }
    state->wake.notify_all();
  }
  if (worker.joinable()) worker.join();
}
#endif  // DTRAIN_DETAIL_BODIES()

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

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string gloo_communicator::describe() const {
  if (!self_) return left_out_ ? "gloo, this rank left out by split()" : "gloo, moved from";
  return "gloo rank " + std::to_string(rank()) + " of " + std::to_string(size()) + ", " +
         self_->state->device->str() + " (" + self_->endpoint.origin + "), keys under " +
         self_->keys + ", shared memory " + self_->state->shm_text;
}

DTRAIN_DETAIL_INLINE work gloo_communicator::allreduce(buffer in, buffer out, reduce_op op) {
  return collective(detail::collective_call::allreduce(in, out, op),
                    [](detail::gloo_state& s, const detail::collective_call& c, ms timeout) {
                      detail::visit(c.in.type, [&]<class T>() {
                        detail::gloo_run_allreduce<T>(s, c.in, c.out, reduce_op(c.op), timeout);
                      });
                    });
}

DTRAIN_DETAIL_INLINE work gloo_communicator::broadcast(buffer data, int root) {
  return collective(detail::collective_call::broadcast(data, root),
                    [](detail::gloo_state& s, const detail::collective_call& c, ms timeout) {
                      detail::gloo_run_broadcast(s, c.out, c.root, timeout);
                    });
}

DTRAIN_DETAIL_INLINE work gloo_communicator::reduce_scatter(buffer in, buffer out, reduce_op op) {
  return collective(detail::collective_call::reduce_scatter(in, out, op),
                    [](detail::gloo_state& s, const detail::collective_call& c, ms timeout) {
                      detail::visit(c.in.type, [&]<class T>() {
                        detail::gloo_run_reduce_scatter<T>(s, c.in, c.out, reduce_op(c.op),
                                                           timeout);
                      });
                    });
}

DTRAIN_DETAIL_INLINE work gloo_communicator::barrier() {
  return collective(detail::collective_call::barrier(),
                    [](detail::gloo_state& s, const detail::collective_call&, ms timeout) {
                      detail::gloo_run_barrier(s, timeout);
                    });
}

DTRAIN_DETAIL_INLINE gloo_communicator gloo_communicator::split(int color, int key) {
  std::int64_t mine[2] = {color, key};
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(size()));
  buffer in{mine, 2, dtype::int64, memory::host};
  buffer out{all.data(), all.size(), dtype::int64, memory::host};
  // An allgather of (color, key), told apart from a user's in check mode.
  // Throws when not valid().
  const detail::collective_call exchange{
      .kind = detail::collective_kind::split, .in = in, .out = out};
  collective(exchange, &run_allgather).wait();
  // Every rank counts the split, left out or not: the next one's keys must agree.
  const auto number = self_->splits++;
  if (color < 0) return gloo_communicator(left_out_tag{});
  std::vector<std::pair<std::int64_t, int>> members;  // (key, rank here)
  for (int r = 0; r < size(); ++r) {
    if (all[2 * static_cast<std::size_t>(r)] == color)
      members.emplace_back(all[2 * static_cast<std::size_t>(r) + 1], r);
  }
  std::sort(members.begin(), members.end());
  int new_rank = 0;
  while (members[static_cast<std::size_t>(new_rank)].second != rank()) ++new_rank;
  std::string keys = self_->keys + "/split/" + std::to_string(number) + "/" + std::to_string(color);
  gloo_communicator child(self_->store, new_rank, static_cast<int>(members.size()), self_->options,
                          self_->endpoint, std::move(keys));
  child.self_->state->ring = self_->state->ring->make_child(color);
  return child;
}

DTRAIN_DETAIL_INLINE gloo_communicator::gloo_communicator(
    std::shared_ptr<const detail::gloo_store_ref> store, int rank, int size, gloo_options options) {
  if (size < 1)
    throw config_error("gloo_communicator: size " + std::to_string(size) + " must be at least 1");
  if (rank < 0 || rank >= size) {
    throw config_error("gloo_communicator: rank " + std::to_string(rank) + " is not below size " +
                       std::to_string(size));
  }
  (void)detail::shm_mode_of(options);  // a bad DTRAIN_GLOO_SHM fails before the store counts
  auto endpoint =
      detail::choose_gloo_endpoint(options.interface, options.master_addr, options.env, size);
  // Every rank counts the communicators it made under this prefix, so the
  // n-th one of every rank meets under the same namespace.
  const std::int64_t n = store->add(options.prefix + "/made/" + std::to_string(rank), 1) - 1;
  std::string keys = options.prefix + "/" + std::to_string(n);
  connect(std::move(store), rank, size, std::move(options), std::move(endpoint), std::move(keys));
}

DTRAIN_DETAIL_INLINE void gloo_communicator::connect(
    std::shared_ptr<const detail::gloo_store_ref> store, int rank, int size, gloo_options options,
    detail::gloo_endpoint endpoint, std::string keys) {
  // Gloo 0.5 writes to its sockets without MSG_NOSIGNAL: a peer that died
  // would kill this process with SIGPIPE. Its threads and the worker start
  // with SIGPIPE blocked (threads inherit the mask); such a write then fails
  // with EPIPE, which Gloo reports as an error.
  detail::sigpipe_blocked quiet;
  detail::check_gloo_library(rank);
  const detail::shm_mode shm = detail::shm_mode_of(options);  // DTRAIN_GLOO_SHM=bad fails here
  auto state = std::make_shared<detail::gloo_state>();
  state->rank = rank;
  state->size = size;
  state->timeout = options.collectives.timeout;
  state->check = options.collectives.check;
  const std::string where = "connecting gloo rank " + std::to_string(rank) + " of " +
                            std::to_string(size) + " (interface: " + endpoint.origin +
                            "; store keys under " + keys + "/): ";
  try {
    ::gloo::transport::tcp::attr attr;
    if (!endpoint.iface.empty()) {
      attr.iface = endpoint.iface;
    } else {
      attr.hostname = endpoint.hostname;
    }
    DTRAIN_GLOO_CHECK(state->device = ::gloo::transport::tcp::CreateDevice(attr));
    auto context = std::make_shared<::gloo::rendezvous::Context>(rank, size);
    context->setTimeout(state->timeout);
    detail::gloo_store_adapter adapter(*store, keys, state->timeout);
    DTRAIN_GLOO_CHECK(context->connectFullMesh(adapter, state->device));
    state->context = context;
    // Once every rank has connected, every rank has read every address: a
    // barrier proves it, and the addresses can leave the store.
    detail::gloo_run_barrier(*state, state->timeout);
    for (const auto& key : adapter.written()) store->erase(key);
    state->shm_text = detail::gloo_join_shm(*state, shm);
  } catch (const timeout_error& e) {
    throw timeout_error(where + e.what());
  } catch (const rendezvous_error& e) {
    throw rendezvous_error(where + e.what());
  } catch (const error&) {
    throw;
  } catch (const std::exception& e) {  // Gloo's, through DTRAIN_GLOO_CHECK
    throw backend_error(where + "Gloo: " + e.what(), 0);
  }
  self_ = std::make_unique<detail::gloo_self>();
  self_->state = state;
  self_->store = std::move(store);
  self_->options = std::move(options);
  self_->endpoint = std::move(endpoint);
  self_->keys = std::move(keys);
  self_->worker = std::thread([state] { detail::gloo_serve(state); });
}

DTRAIN_DETAIL_INLINE work gloo_communicator::collective(const detail::collective_call& call,
                                                        detail::gloo_runner run) {
  const detail::collective_info what = call.info(name, rank(), size());
  if (!self_) detail::throw_invalid(detail::describe(what), left_out_);
  detail::check_arguments(call, what, host_memory);
  detail::gloo_state& s = *self_->state;
  if (s.unusable.load()) throw backend_error(detail::describe(what) + ": " + s.unusable_text(), 0);
  std::unique_lock lock(s.mutex);
  const std::int64_t seq = detail::record(*s.ring, what);
  if (!call.moves_data() && !s.check) {
    s.ring->settle(seq, detail::call_state::completed);
    return work{};
  }
  auto w = std::make_shared<detail::gloo_work>(what, s.timeout, self_->state);
  w->track(s.ring, seq);
  s.queue.push_back({w, detail::signature_of(seq, what), call, run});
  const bool idle = !s.running;
  lock.unlock();
  if (idle) s.wake.notify_one();
  return work(std::move(w));
}
#endif  // DTRAIN_DETAIL_BODIES()

static_assert(communicator<gloo_communicator>);

}  // namespace dtrain

#endif  // DTRAIN_HAS_GLOO()
