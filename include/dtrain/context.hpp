#pragma once
/// @file
/// dtrain::context<Policy>: what a worker's training function is handed by
/// dtrain::run — the complete world, the rendezvous store, the communicator —
/// and owns, torn down in reverse order of construction.

#include <dtrain/backend/control.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/config.hpp>
#include <dtrain/detail/parse.hpp>
#include <dtrain/diagnostics.hpp>
#include <dtrain/env/device.hpp>
#include <dtrain/env/discover.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/placement.hpp>
#include <dtrain/env/variables.hpp>
#include <dtrain/error.hpp>
#include <dtrain/launch/options.hpp>
#include <dtrain/launch/protocol.hpp>
#include <dtrain/launch/worker.hpp>
#include <dtrain/policy.hpp>
#include <dtrain/rendezvous/client.hpp>
#include <dtrain/rendezvous/options.hpp>
#include <dtrain/rendezvous/security.hpp>
#include <dtrain/rendezvous/server.hpp>
#include <dtrain/rendezvous/store.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

#if DTRAIN_HAS_CUDA()
#include <cuda_runtime.h>
#endif

namespace dtrain {

/// Options of dtrain::run. Aggregate: `{.agent = {.nproc_per_node = 4}}`.
/// Each part also reads its environment variables (the environment wins).
struct run_options {
  agent_options agent{};              ///< launch::per_node only
  store_options store{};              ///< DTRAIN_STORE_TIMEOUT, DTRAIN_STORE_TOKEN, ...
  collective_options collectives{};   ///< DTRAIN_COLLECTIVE_TIMEOUT, DTRAIN_CHECK_COLLECTIVES
  diagnostics_options diagnostics{};  ///< DTRAIN_DIAGNOSTICS, DTRAIN_DIAGNOSTICS_WAIT
};

/// Where the store prefix of a job lives; a restart round gets its own.
inline constexpr std::string_view job_store_prefix = "dtrain/job";

/// A worker's view of the job. Built by dtrain::run; not copyable or movable
/// (the communicator and store it owns are shared with no one else).
template <class Policy>
class context {
 public:
  using policy_type = Policy;
  using communicator_type = typename Policy::communicator_type;
  using store_type = prefix_store<store_client>;

  /// Joins the job described by `w` (a worker's world, as discovered): starts
  /// or joins the store, completes the world by grouping ranks by node name,
  /// selects the GPU (NCCL), and builds the communicator. Every wait is bound
  /// by the store or collective timeout. Throws config_error for bad input,
  /// rendezvous_error / backend_error / timeout_error when a peer fails.
  context(dtrain::world w, const environment& env, const run_options& options);
  ~context();
  context(const context&) = delete;
  context& operator=(const context&) = delete;

  /// The complete world, agreed by every rank.
  [[nodiscard]] const dtrain::world& world() const noexcept { return world_; }
  [[nodiscard]] int rank() const noexcept { return *world_.rank; }
  [[nodiscard]] int size() const noexcept { return *world_.world_size; }
  [[nodiscard]] int local_rank() const noexcept { return *world_.local_rank; }
  [[nodiscard]] int local_size() const noexcept { return *world_.local_world_size; }
  [[nodiscard]] int node_rank() const noexcept { return *world_.node_rank; }
  [[nodiscard]] int num_nodes() const noexcept { return *world_.num_nodes; }
  /// Rank 0: the one that logs, evaluates and saves checkpoints.
  [[nodiscard]] bool is_main() const noexcept { return rank() == 0; }
  /// Local rank 0: the one that prepares data once per node.
  [[nodiscard]] bool is_local_main() const noexcept { return local_rank() == 0; }
  /// How many times a per-node agent has restarted the job (0 at first).
  [[nodiscard]] int restart_count() const noexcept { return restart_count_; }
  /// The CUDA device this rank uses with a backend on GPUs (NCCL), chosen by
  /// select_device(): its local rank, or 0 when it sees one GPU; -1 otherwise.
  [[nodiscard]] int device() const noexcept { return device_; }

  /// The rendezvous store, under this job's (and restart round's) prefix.
  [[nodiscard]] store_type& store() noexcept { return *store_; }
  [[nodiscard]] communicator_type& communicator() noexcept { return *communicator_; }
  /// The host control plane: small blocking collectives through the store,
  /// for metadata that must not travel on a device engine (DistributedDataParallel's
  /// model agreement and bucket order; your own checksums). Every rank calls the
  /// same operations in the same order; each waits at most the store timeout.
  [[nodiscard]] dtrain::control_plane control_plane() noexcept;

  /// Waits until every rank has called barrier(), at most the collective
  /// timeout (DTRAIN_COLLECTIVE_TIMEOUT); throws timeout_error after it.
  void barrier();

  /// Asks every rank for its ring of last collectives (what SIGUSR1 does) and
  /// returns the analysis' first line ("rank 2 is at #41 ...: rank 2 never
  /// started #42"); one rank prints the whole table on stderr. Waits at most
  /// DTRAIN_DIAGNOSTICS_WAIT for the rings. Never throws.
  std::string explain_stall(const std::string& reason);

  /// Called by run() when this rank fails: a collective that timed out or
  /// failed (a peer is stuck, behind, gone or called differently) is
  /// explained; other failures (a store timeout) are not.
  std::optional<std::string> explain_failure(const std::exception_ptr& failure);

  /// Called by run() when this rank fails (an exception, or a non-zero status
  /// from the user's function), before anything is torn down: under a node
  /// agent the failure is recorded in the agent's store while the peers still
  /// run, so the agent names this rank, not a peer that failed because of it.
  void record_failure(int status, const std::string& what) noexcept;

  /// Called by run() after the user's function returned normally: the store's
  /// host (rank 0 under per-process launch) waits, at most the store timeout,
  /// until every rank is done with the store before it stops serving.
  void finish();

 private:
  /// Agent's store (per-node workers), else rank 0 hosts one at MASTER_ADDR:MASTER_PORT.
  void open_store(const environment& env) {
    if (auto agent = env.get(agent_store_variable)) {
      auto where =
          detail::split_host_port(detail::assignment(agent_store_variable, *agent), *agent);
      if (!where.port) {
        throw config_error(detail::assignment(agent_store_variable, *agent) + " has no port");
      }
      client_.emplace(where.host, *where.port, store_options_);
      store_endpoint_ = {where.host, *where.port};
      store_.emplace(*client_,
                     std::string(job_store_prefix) + "/" + std::to_string(restart_count_));
      under_agent_ = true;
      return;
    }
    std::optional<std::string> host = world_.master_addr;
    // Without an address nobody else can be told a fixed port either: rank 0
    // picks a free one (and MPI carries it), unless MASTER_PORT names one.
    int port = world_.master_port.value_or(host ? default_master_port : 0);
    if (!host && size() == 1) host = "127.0.0.1";  // a single process hosts its own store
    const bool one_node = single_node(host);
    if constexpr (uses_mpi) share_token_over_mpi();
    if (store_options_.token.empty()) choose_token(env, host, port, one_node);
    const std::string bind = detail::store_bind_address(env, host.value_or("0.0.0.0"), !one_node);
    if (rank() == 0) {
      try {
        if (token_file_) token_file_->publish(store_options_.token);
        server_.emplace(bind, port, store_options_);
        port = server_->port();
      } catch (const std::exception& e) {
        // The others are waiting to hear where the store is: tell them it is not.
        if (!host) (void)agree_store_address(port, e.what());
        throw;
      }
    }
    if (!host) host = agree_store_address(port);
    const std::string where = rank() == 0 ? detail::local_store_address(bind) : *host;
    store_endpoint_ = {where, port};
    if (token_file_ && rank() != 0) {
      connect_with_token_file(where, port);
    } else {
      client_.emplace(where, port, store_options_);
    }
    store_.emplace(*client_, std::string(job_store_prefix));
  }

  /// Whether every rank is known to run on this host: one process, a node
  /// count or local size that says so, or a loopback MASTER_ADDR (127.x, ::1, localhost).
  [[nodiscard]] bool single_node(const std::optional<std::string>& host) const {
    if (size() == 1 || world_.num_nodes == 1) return true;
    if (world_.local_world_size && *world_.local_world_size == size()) return true;
    // Only a loopback address itself: a host name that resolves to loopback
    // here (Debian's 127.0.1.1) may name this host for the other nodes.
    return host && (*host == "localhost" || detail::is_loopback_address(*host));
  }

  /// The store token when DTRAIN_STORE_TOKEN is not set: drawn by this process
  /// (one rank), by rank 0 and sent over MPI (the MPI backend), or by rank 0
  /// and shared through a file only this user can read (one host). A job over
  /// several hosts that none of these reach must set DTRAIN_STORE_TOKEN.
  void choose_token(const environment& env, const std::optional<std::string>& host, int port,
                    bool one_node) {
    if (size() == 1) {
      store_options_.token = detail::new_store_token();
      return;
    }
    if (one_node && host) {
      token_file_.emplace(env, port);
      if (rank() == 0) store_options_.token = detail::new_store_token();
      return;
    }
    if (!host) return;  // open_store reports the missing address first
    throw config_error(
        "rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
        ": this job may span several hosts and no dtrain launcher started it, so its store "
        "needs a shared secret: set DTRAIN_STORE_TOKEN to the same value on every rank (e.g. "
        "mpirun -x DTRAIN_STORE_TOKEN, or export it in the srun / torchrun job script; "
        "`openssl rand -hex 16` makes one), or use the MPI backend, or dtrun (" +
        world_.describe() + ")");
  }

  /// With the MPI backend every rank takes part in one broadcast, whatever its
  /// environment says (a collective must not depend on it): rank 0 sends its
  /// DTRAIN_STORE_TOKEN, or one it draws; a rank that set its own keeps it, and
  /// the store refuses it by name if it differs from rank 0's.
  void share_token_over_mpi() {
#if DTRAIN_HAS_MPI()
    if constexpr (uses_mpi) {
      if (size() == 1) return;
      std::string value;
      if (rank() == 0) {
        value = detail::wire::encode_text(store_options_.token.empty() ? detail::new_store_token()
                                                                       : store_options_.token);
      }
      detail::mpi_broadcast_value(communicator_->native(), 0, value,
                                  "broadcasting the store token");
      const std::string token =
          detail::wire::decode_text("rank 0's broadcast", value, "a store token");
      if (store_options_.token.empty()) store_options_.token = token;
    }
#endif
  }

  /// Reads the token rank 0 wrote, reading again while the store refuses it
  /// (a file left by an earlier job on the same port), within the store timeout.
  void connect_with_token_file(const std::string& where, int port) {
    const auto deadline = std::chrono::steady_clock::now() + store_options_.timeout;
    for (;;) {
      if (auto token = token_file_->read()) {
        store_options_.token = *token;
        try {
          client_.emplace(where, port, store_options_);
          return;
        } catch (const rendezvous_error& e) {
          if (std::string_view(e.what()).find("rejected this client's token") ==
              std::string_view::npos)
            throw;
        }
      }
      if (std::chrono::steady_clock::now() > deadline) {
        throw timeout_error(
            "rank " + std::to_string(rank()) + " found no valid store token in " +
            token_file_->path() +
            " within the store timeout; is rank 0 running "
            "on this host? (set DTRAIN_STORE_TOKEN on every rank to skip the file)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  /// Without MASTER_ADDR, an MPI job learns rank 0's address through MPI;
  /// rank 0 sends `failure` instead when it could not start the store.
  std::string agree_store_address(int& port, const char* failure = nullptr) {
#if DTRAIN_HAS_MPI()
    if constexpr (uses_mpi) {
      std::string value;
      if (rank() == 0) {
        value = (failure ? detail::store_address::failed(failure)
                         : detail::store_address::serving(detail::host_name().value_or("?"), port))
                    .encode();
      }
      detail::mpi_broadcast_value(communicator_->native(), 0, value,
                                  "broadcasting rank 0's store address");
      const detail::store_address got = detail::store_address::decode(value);
      if (!got.ok) {
        if (failure) return {};  // rank 0 rethrows its own error
        throw rendezvous_error("rank 0 could not start the rendezvous store: " + got.failure);
      }
      port = got.port;
      return got.host;
    }
#endif
    {
      (void)port;
      if (failure) return {};
      throw config_error(
          "rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
          " does not know where rank 0's rendezvous store is: set MASTER_ADDR (and MASTER_PORT) to "
          "an address of rank 0's host, or AZ_BATCH_MASTER_NODE=host:port (" +
          world_.describe() + ")");
    }
  }

  /// Every rank reports; rank 0 places them all and publishes the result.
  void complete_world(const environment& env) {
    rank_report mine{node_name(env), world_};
    store_->set(detail::job_keys::report(rank()), mine.encode());
    const std::string table_key(detail::job_keys::placement);
    if (rank() == 0) {
      std::string table;
      try {
        std::vector<rank_report> reports;
        for (int r = 0; r < size(); ++r) {
          const std::string key = detail::job_keys::report(r);
          reports.push_back(rank_report::decode(store_->get(key), "store key " + key));
        }
        table = encode_placements(place_ranks(reports));
      } catch (const config_error& e) {
        store_->set(table_key, encode_placement_error(e.what()));
        throw;
      }
      store_->set(table_key, table);
    }
    const placement p = decode_placement("store key " + store_->prefix() + table_key,
                                         store_->get(table_key), rank(), size());
    const std::string grouped = "grouped by node name at rendezvous";
    auto fill = [&](std::optional<int>& field, dtrain::world::field f, int value) {
      if (!field) world_.origins[static_cast<std::size_t>(f)] = grouped;
      field = value;
    };
    fill(world_.node_rank, dtrain::world::field::node_rank, p.node_rank);
    fill(world_.num_nodes, dtrain::world::field::num_nodes, p.num_nodes);
    fill(world_.local_rank, dtrain::world::field::local_rank, p.local_rank);
    fill(world_.local_world_size, dtrain::world::field::local_world_size, p.local_world_size);
  }

  void make_communicator(const environment& env) {
    if constexpr (traits::uses_gpus) device_ = gpu_of_this_rank(env);
    communicator_setup<store_type> setup{.store = store_ ? &*store_ : nullptr,
                                         .rank = rank(),
                                         .size = size(),
                                         .device = device(),
                                         .collectives = collectives_,
                                         .master_addr = world_.master_addr.value_or(""),
                                         .env = &env};
    communicator_.emplace(traits::make(setup));
    if (communicator_->size() != size() || communicator_->rank() != rank()) {
      throw config_error(std::string(Policy::backend_type::name) + "'s world has rank " +
                         std::to_string(communicator_->rank()) + " of " +
                         std::to_string(communicator_->size()) +
                         ", but the environment says rank " + std::to_string(rank()) + " of " +
                         std::to_string(size()) + " (" + world_.origin(dtrain::world::field::rank) +
                         ", " + world_.origin(dtrain::world::field::world_size) +
                         "); start MPI jobs with mpirun or srun");
    }
  }

  /// Every rank watches for diagnostics rounds on a connection of its own.
  void start_diagnostics(const diagnostics_options& options) {
    if constexpr (requires { communicator_->ring(); }) {
      if (!options.enabled) return;
      std::string prefix = store_->prefix();
      diagnostics_.emplace(store_endpoint_.first, store_endpoint_.second, store_options_,
                           prefix + "diag", rank(), size(), communicator_->ring(),
                           std::string(Policy::backend_type::name), options);
    } else {
      (void)options;
    }
  }

  using traits = typename Policy::traits;

  /// select_device() with the devices this process sees. When CUDA cannot count
  /// them, the local rank: the communicator then reports CUDA's own error.
  int gpu_of_this_rank(const environment& env) const {
#if DTRAIN_HAS_CUDA()
    int visible = 0;
    if (cudaGetDeviceCount(&visible) != cudaSuccess) {
      (void)cudaGetLastError();
      return local_rank();
    }
    try {
      return select_device(local_rank(), local_size(), visible, env.get("CUDA_VISIBLE_DEVICES"));
    } catch (const config_error& e) {
      throw config_error("rank " + std::to_string(rank()) + ": " + e.what());
    }
#else
    (void)env;
    return local_rank();
#endif
  }
  static constexpr bool uses_mpi = std::is_same_v<typename Policy::backend_type, backend::mpi>;

  dtrain::world world_;
  store_options store_options_;
  collective_options collectives_;
  int restart_count_ = 0;
  int device_ = -1;
  bool under_agent_ = false;
  // Declared in the order they are built, so they are torn down in reverse.
  std::optional<detail::token_file> token_file_;
  std::optional<store_server> server_;
  std::optional<store_client> client_;
  std::optional<store_type> store_;
  std::optional<communicator_type> communicator_;
  std::optional<store_channel<store_type>> control_;
  std::pair<std::string, int> store_endpoint_;  // for the diagnostics' own connection
  std::optional<detail::rank_diagnostics> diagnostics_;
};

// What builds, uses and tears down the job is defined out of the class and not
// inline: under `extern template class context<P>` (dtrain/compiled.hpp) none of
// it, nor the store, agent and engine code it calls, is compiled in a user's TU.

template <class Policy>
context<Policy>::context(dtrain::world w, const environment& env, const run_options& options)
    : world_(std::move(w)),
      store_options_(options.store.with_env(env)),
      collectives_(options.collectives.with_env(env)) {
  if (!world_.rank || !world_.world_size) {
    throw config_error("dtrain::run needs a worker's rank and world size; this process is a " +
                       std::string(to_string(world_.role)) + " (" + world_.describe() + ")");
  }
  if (auto r = detail::read_int(env, restart_count_variable)) restart_count_ = r->value;
  if constexpr (!traits::needs_store) {
    // MPI knows its world already, and can tell every rank where rank 0's store is.
    make_communicator(env);
    open_store(env);
    complete_world(env);
  } else {
    open_store(env);
    complete_world(env);
    make_communicator(env);
  }
  control_.emplace(*store_, rank(), size(), "control");
  start_diagnostics(options.diagnostics.with_env(env));
}

template <class Policy>
context<Policy>::~context() = default;

// Out of the class, so that a TU that only declares context<Policy> (separate
// compilation) does not compile the store channel behind it.
template <class Policy>
dtrain::control_plane context<Policy>::control_plane() noexcept {
  return dtrain::control_plane(*control_);
}

template <class Policy>
void context<Policy>::barrier() {
  communicator_->barrier().wait(collectives_.timeout);
}

template <class Policy>
std::string context<Policy>::explain_stall(const std::string& reason) {
  if (!diagnostics_) return "no diagnostics (DTRAIN_DIAGNOSTICS=0, or this backend keeps no ring)";
  return diagnostics_->explain(reason);
}

template <class Policy>
std::optional<std::string> context<Policy>::explain_failure(const std::exception_ptr& failure) {
  if (!diagnostics_ || !diagnostics_->collective_failed()) return std::nullopt;
  try {
    std::rethrow_exception(failure);
  } catch (const timeout_error&) {
    return explain_stall("a timeout on rank " + std::to_string(rank()));
  } catch (const backend_error&) {
    return explain_stall("a failed collective on rank " + std::to_string(rank()));
  } catch (...) {
  }
  return std::nullopt;
}

template <class Policy>
void context<Policy>::record_failure(int status, const std::string& what) noexcept {
  if (!under_agent_ || !client_) return;
  try {
    const detail::collective_progress progress = detail::progress_of(communicator_);
    detail::record_failure(
        *client_, restart_count_,
        {status, false,
         detail::worker_label(rank(), node_rank(), local_rank(), ::getpid()) +
             " exited with status " + std::to_string(status) + (what.empty() ? "" : ": " + what),
         rank(), progress.failed_at, progress.failed_on});
  } catch (...) {
    // The agent still sees the exit status; the reason is only lost from its message.
  }
}

template <class Policy>
void context<Policy>::finish() {
  // Before the communicator closes: a peer that fails because of it finds this record.
  if (under_agent_ && client_) {
    detail::record_exit(
        *client_, restart_count_,
        {rank(), detail::worker_label(rank(), node_rank(), local_rank(), ::getpid()),
         detail::progress_of(communicator_).issued});
  }
  communicator_.reset();
  if (!client_) return;
  const std::string all(detail::job_keys::finished_all);
  if (store_->add(detail::job_keys::finished, 1) == size())
    store_->set(all, detail::present_value());
  if (server_) {
    const std::string keys[] = {all};
    store_->wait(keys);
  }
}

}  // namespace dtrain
