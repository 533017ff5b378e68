#pragma once
/// @file
/// dtrain::context<Policy>: what a worker's training function is handed by
/// dtrain::run — the complete world, the rendezvous store, the communicator —
/// and owns, torn down in reverse order of construction.

#include <dtrain/backend/work.hpp>
#include <dtrain/config.hpp>
#include <dtrain/control/plane.hpp>
#include <dtrain/detail/parse.hpp>
#include <dtrain/diagnostics.hpp>
#include <dtrain/env/device.hpp>
#include <dtrain/env/discover.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/placement.hpp>
#include <dtrain/env/variables.hpp>
#include <dtrain/error.hpp>
#include <dtrain/launch/join.hpp>
#include <dtrain/launch/options.hpp>
#include <dtrain/launch/protocol.hpp>
#include <dtrain/launch/worker.hpp>
#include <dtrain/policy.hpp>
#include <dtrain/rendezvous/broadcast.hpp>
#include <dtrain/rendezvous/client.hpp>
#include <dtrain/rendezvous/options.hpp>
#include <dtrain/rendezvous/security.hpp>
#include <dtrain/rendezvous/server.hpp>
#include <dtrain/rendezvous/store.hpp>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
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
  context(dtrain::world w, const dtrain::environment& env, const run_options& options);
  ~context();
  context(const context&) = delete;
  context& operator=(const context&) = delete;

  /// The complete world, agreed by every rank.
  [[nodiscard]] const dtrain::world& world() const noexcept { return world_; }
  /// The environment this rank was started with: the snapshot run() took,
  /// from which every dtrain variable is read (DistributedDataParallel's too).
  [[nodiscard]] const dtrain::environment& environment() const noexcept { return environment_; }
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
  /// The line DistributedDataParallel keeps in this rank's flight records
  /// (diagnostics_options::dir): its straggler watch's last window.
  [[nodiscard]] const std::shared_ptr<detail::flight_note>& flight_note() const noexcept {
    return flight_note_;
  }
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

  /// Called by run() when this rank fails, after its report: aborts the
  /// communicator where the engine can (NCCL: ncclCommAbort), so that its
  /// collectives still waiting for peers end now. Without it, the
  /// communicator's clean close would wait for them, up to the collective
  /// timeout, and a failed rank would linger that long before its process
  /// exits and the launcher can end the job (ProcessGroupNCCL aborts too
  /// unless shut down cleanly). Later collectives on this context throw.
  void abort_communicator() noexcept {
    if constexpr (requires { communicator_->abort(); }) {
      if (communicator_) communicator_->abort();
    }
  }

  /// Called by run() after the user's function returned normally: the store's
  /// host (rank 0 under per-process launch) waits, at most the store timeout,
  /// until every rank is done with the store before it stops serving.
  void finish();

 private:
  /// Agent's store (per-node workers), else rank 0 hosts one at MASTER_ADDR:MASTER_PORT.
  void open_store(const dtrain::environment& env) {
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
    // picks a free one (and the pre-store channel carries it), unless MASTER_PORT names one.
    int port = world_.master_port.value_or(host ? default_master_port : 0);
    if (!host && size() == 1) host = "127.0.0.1";  // a single process hosts its own store
    const bool one_node = single_node(host);
    choose_token(env, host, port, one_node);
    const std::string bind = detail::store_bind_address(env, host.value_or("0.0.0.0"), !one_node);
    auto serve = [&] {
      if (token_file_) token_file_->publish(store_options_.token);
      server_.emplace(bind, port, store_options_);
      port = server_->port();
    };
    if (!host) {
      host = agree_store_address(serve, port);
    } else if (rank() == 0) {
      serve();
    }
    const std::string where = rank() == 0 ? detail::local_store_address(bind) : *host;
    store_endpoint_ = {where, port};
    if (token_file_ && rank() != 0) {
      detail::connect_with_token_file(client_, *token_file_, where, port, store_options_, rank());
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

  /// Chooses this rank's store token. The first that applies wins:
  ///  1. its own: DTRAIN_STORE_TOKEN, or store_options::token;
  ///  2. rank 0's, sent through the backend's pre-store channel (MPI): rank 0
  ///     sends its own or one it draws. Every rank takes part in that
  ///     broadcast, whatever it holds (a collective must not depend on the
  ///     environment), and one with a token of its own keeps it: the store
  ///     refuses it by name if it differs from rank 0's;
  ///  3. one it draws, in a world of one;
  ///  4. rank 0's through a file only this user can read, when every rank
  ///     runs on this host and the store's address is known: rank 0 draws it,
  ///     the others read it (detail::connect_with_token_file);
  ///  5. none yet when the store's address is unknown: open_store says so.
  /// Otherwise the job may span hosts that none of these reach: config_error,
  /// asking for DTRAIN_STORE_TOKEN.
  void choose_token(const dtrain::environment& env, const std::optional<std::string>& host,
                    int port, bool one_node) {
    std::optional<std::string> from_rank0;
    if constexpr (detail::has_pre_store_relay<traits>) {
      if (size() > 1) {
        from_rank0 = detail::broadcast_or_fail(
            traits::pre_store_relay(*communicator_), "the store token", [&] {
              return store_options_.token.empty() ? detail::new_store_token()
                                                  : store_options_.token;
            });
      }
    }
    if (!store_options_.token.empty()) return;
    if (from_rank0) {
      store_options_.token = std::move(*from_rank0);
      return;
    }
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
        ": this job may span several hosts and no dtrain launcher started it, "
        "so its store needs a shared secret: "
        "set DTRAIN_STORE_TOKEN to the same value on every rank (e.g. "
        "mpirun -x DTRAIN_STORE_TOKEN, or export it in the srun / torchrun job script; "
        "`openssl rand -hex 16` makes one), or use the MPI backend, or dtrun (" +
        world_.describe() + ")");
  }

  /// Without MASTER_ADDR: rank 0 starts the store (`serve`, which sets `port`)
  /// and tells every rank where, through the backend's pre-store channel (or
  /// its failure, which every rank then throws). Returns rank 0's host name.
  /// Without such a channel nobody can know: config_error on every rank.
  template <class Serve>
  std::string agree_store_address(Serve& serve, int& port) {
    if constexpr (detail::has_pre_store_relay<traits>) {
      const detail::store_address got = detail::store_address::decode(detail::broadcast_or_fail(
          traits::pre_store_relay(*communicator_), "the store's address", [&] {
            serve();
            return detail::store_address{detail::host_name().value_or("?"), port}.encode();
          }));
      port = got.port;
      return got.host;
    } else {
      (void)serve;
      (void)port;
      throw config_error(
          "rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
          " does not know where rank 0's rendezvous store is: set MASTER_ADDR (and MASTER_PORT) "
          "to an address of rank 0's host, or AZ_BATCH_MASTER_NODE=host:port (" +
          world_.describe() + ")");
    }
  }

  /// Every rank reports; rank 0 waits for them all (saying who is missing
  /// every progress interval), places them and publishes the result.
  void complete_world(const dtrain::environment& env) {
    detail::rendezvous_wait<store_type> waiting(
        *store_, {.endpoint = client_->endpoint(),
                  .rank = rank(),
                  .size = size(),
                  .timeout = store_options_.timeout,
                  .interval = store_options_.progress_interval,
                  .say = store_options_.progress,
                  .world_size_origin = world_.origin(dtrain::world::field::world_size)});
    waiting.join(rank_report{node_name(env), world_}.encode());
    const std::string table_key(detail::job_keys::placement);
    std::string table;
    if (rank() == 0) {
      waiting.await_everyone();
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
    } else {
      table = waiting.await_answer(table_key);
    }
    const placement p =
        decode_placement("store key " + store_->prefix() + table_key, table, rank(), size());
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

  void make_communicator(const dtrain::environment& env) {
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
  void start_diagnostics(const diagnostics_options& options, const dtrain::environment& env) {
    if constexpr (requires { communicator_->ring(); }) {
      if (!options.enabled) return;
      std::string prefix = store_->prefix();
      diagnostics_.emplace(store_endpoint_.first, store_endpoint_.second, store_options_,
                           prefix + "diag", rank(), size(), communicator_->ring(),
                           std::string(Policy::backend_type::name), options, node_name(env),
                           flight_note_);
    } else {
      (void)options;
      (void)env;
    }
  }

  using traits = typename Policy::traits;

  /// select_device() with the devices this process sees. When CUDA cannot count
  /// them, the local rank: the communicator then reports CUDA's own error.
  int gpu_of_this_rank(const dtrain::environment& env) const {
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

  dtrain::world world_;
  dtrain::environment environment_;
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
  // What DDP adds to this rank's flight records (its straggler window).
  std::shared_ptr<detail::flight_note> flight_note_ = std::make_shared<detail::flight_note>();
  std::optional<detail::rank_diagnostics> diagnostics_;
};

// What builds, uses and tears down the job is defined out of the class and not
// inline: under `extern template class context<P>` (dtrain/runtime/compiled.hpp) none of
// it, nor the store, agent and engine code it calls, is compiled in a user's TU.

template <class Policy>
context<Policy>::context(dtrain::world w, const dtrain::environment& env,
                         const run_options& options)
    : world_(std::move(w)),
      environment_(env),
      store_options_(options.store.with_env(env)),
      collectives_(options.collectives.with_env(env)) {
  if (!world_.rank || !world_.world_size) {
    throw config_error("dtrain::run needs a worker's rank and world size; this process is a " +
                       std::string(to_string(world_.role)) + " (" + world_.describe() + ")");
  }
  if (auto r = detail::read_int(env, restart_count_variable)) restart_count_ = r->value;
  if (!store_options_.progress) {
    // Rendezvous progress goes where this rank's failures go: a rank-prefixed line on stderr.
    store_options_.progress = [label = detail::rank_label(&world_)](std::string_view text) {
      std::fprintf(stderr, "%s dtrain: %.*s\n", label.c_str(), static_cast<int>(text.size()),
                   text.data());
    };
  }
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
  start_diagnostics(options.diagnostics.with_env(env), env);
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
