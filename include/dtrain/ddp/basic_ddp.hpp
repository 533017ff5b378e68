#pragma once
/// @file
/// basic_ddp<Policy>: the one core of DistributedDataParallel (c10d's Reducer
/// is the model). It owns each parameter's and each bucket's state
/// (ddp/state.hpp) under one lock, and averages the gradients over the ranks
/// while the backward pass is still running: the moment a bucket's last
/// gradient is marked ready its allreduce starts, on a communication thread
/// for host memory (MPI, Gloo) or on the communicator's stream after the
/// compute stream (NCCL), followed by a watchdog (ddp/runner.hpp). Metadata
/// (model agreement, the rebuild order) goes over the host control plane.
/// DistributedDataParallel<Model, Policy> and dtrain::torch's wrapper are thin
/// layers over it: they feed it parameters and marks, and ask it the rest.
///
/// What a sharding stage (ZeRO 1-3) changes lives in one part behind one seam,
/// detail::ddp_sharding (ddp/sharding.hpp): the core asks it to reduce a
/// ready bucket and tells it where the step ends, and never branches on the
/// stage itself.
///
/// Every member that is more than a line or two is defined out of the class
/// (here, in ddp/basic_ddp_buckets.hpp and in ddp/basic_ddp_step.hpp; the
/// sharding part's in ddp/sharding_part.hpp), as a
/// non-inline template member: a compiled library may then hold `template
/// class dtrain::basic_ddp<P>;` and its users `extern template class
/// dtrain::basic_ddp<P>;`, and none of those bodies is compiled again in the
/// users' translation units (GCC instantiates in-class members of an extern
/// template at -O2 anyway, out-of-class ones not).

#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/memory.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/control/plane.hpp>
#include <dtrain/control/verdict.hpp>
#include <dtrain/ddp/agreement.hpp>
#include <dtrain/ddp/bucket.hpp>
#include <dtrain/ddp/device_spans.hpp>
#include <dtrain/ddp/options.hpp>
#include <dtrain/ddp/parameter.hpp>
#include <dtrain/ddp/runner.hpp>
#include <dtrain/ddp/sharding.hpp>
#include <dtrain/ddp/state.hpp>
#include <dtrain/ddp/storage.hpp>
#include <dtrain/ddp/straggler.hpp>
#include <dtrain/ddp/timeline.hpp>
#include <dtrain/diagnostics/flight.hpp>
#include <dtrain/diagnostics/metrics.hpp>
#include <dtrain/diagnostics/ring.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/placement.hpp>
#include <dtrain/env/variables.hpp>
#include <dtrain/env/world.hpp>
#include <dtrain/error.hpp>
#include <dtrain/topology/flat.hpp>
#include <dtrain/topology/layout.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

namespace dtrain {

/// What a DDP takes its communicator, host control plane and world from:
/// dtrain::context<Policy>. A concept, so that DDP does not include the
/// runtime (agent, store server) that runtime/context.hpp brings. A context with an
/// `environment()` (the snapshot dtrain::context took at start) gives DDP
/// the variables it reads (DTRAIN_TIMELINE).
template <class C, class Policy>
concept ddp_context = requires(C& c) {
  { c.communicator() } -> std::same_as<typename Policy::communicator_type&>;
  { c.control_plane() } -> std::convertible_to<control_plane>;
  { c.world() } -> std::convertible_to<const world&>;
};

namespace detail {
/// The environment snapshot of `ctx`, or (a context without one) of the process now.
template <class Context>
environment environment_of(Context& ctx) {
  if constexpr (requires {
                  { ctx.environment() } -> std::convertible_to<const environment&>;
                }) {
    return ctx.environment();
  } else {
    return environment::from_process();
  }
}
}  // namespace detail

/// The model-free core of DistributedDataParallel, over the communicator of
/// `Policy`, built from the parameters (and buffers) as dtrain sees them.
///
/// Per step: mark each parameter ready (mark_ready) as soon as its gradient
/// is final, or all at once after the backward pass (mark_all_ready), then
/// synchronize(); gradients then hold the mean over ranks. Every member may
/// be called from any thread (autograd's hooks mark from theirs): one lock
/// serialises them. Between mark_ready and synchronize() a gradient belongs
/// to dtrain: do not touch it.
template <class Policy>
class basic_ddp {
 public:
  using communicator_type = typename Policy::communicator_type;
  /// The communicators a bucket's allreduce runs on (topology::flat::group,
  /// topology::hierarchical::group), split from DDP's own communicator.
  using topology_group =
      typename Policy::topology_type::template group<typename Policy::communicator_type>;
  /// Where gradients and buckets live: host_memory, or cuda_memory for NCCL.
  using memory_space = typename Policy::memory_space;
  /// The compute stream's type (cudaStream_t for CUDA; a null placeholder on the host).
  using stream_type = typename memory_space::stream_type;
  /// A user reduction: must leave the mean over ranks in `bucket.data` once
  /// the returned work completes (e.g. `return comm.allreduce(b.data, b.data, reduce_op::avg);`).
  using comm_hook = std::function<work(communicator_type&, gradient_bucket&)>;
  static constexpr bool on_device = memory_space::where == memory::device;
  /// With ddp_options::find_unused_parameters, the parameters that no rank
  /// marked in this many first synchronized steps are named once on rank 0's
  /// stderr (ddp_options::report_unused_parameters = false silences it).
  static constexpr std::size_t unused_report_steps = 2;

  /// Collective over ctx's communicator (a dtrain::context<Policy>); metadata
  /// goes over ctx's control plane where the communicator cannot carry host
  /// data (NCCL). The policy's topology groups the ranks by ctx.world()'s
  /// nodes; DTRAIN_TIMELINE is read from ctx's environment snapshot.
  template <ddp_context<Policy> Context>
  basic_ddp(Context& ctx, std::vector<parameter> parameters, std::vector<parameter> buffers = {},
            ddp_options options = {})
      : basic_ddp(ctx.communicator(), ctx.control_plane(), std::move(parameters),
                  std::move(buffers), std::move(options), node_layout::of(ctx.world()),
                  detail::environment_of(ctx)) {
    if constexpr (requires { ctx.flight_note(); }) flight_note_ = ctx.flight_note();
  }

  /// Collective over `comm`, which carries the metadata too (MPI, Gloo: a
  /// communicator that reaches host memory). A device-only backend (NCCL)
  /// needs the constructor with a control plane. Without a context, the
  /// variables DDP reads (DTRAIN_TIMELINE, DTRAIN_NODE_NAME) come from a
  /// snapshot of the process environment taken here.
  /// (A template only so that an explicit instantiation of the class for NCCL
  /// does not trip the static_assert.)
  template <std::same_as<communicator_type> Comm>
  basic_ddp(Comm& comm, std::vector<parameter> parameters, std::vector<parameter> buffers = {},
            ddp_options options = {})
      : basic_ddp(comm, nullptr, std::move(parameters), std::move(buffers), std::move(options),
                  std::nullopt, environment::from_process()) {
    static_assert(std::same_as<Comm, communicator_type> && communicator_type::reaches_host_memory,
                  "this backend moves device memory only, and DistributedDataParallel's metadata "
                  "(model agreement, bucket order) is host data: construct it from the context, "
                  "or pass a control plane: DistributedDataParallel(comm, "
                  "dtrain::control_plane(channel), model) with a dtrain::store_channel");
  }

  /// Collective: checks that every rank holds the same parameters (names,
  /// counts, types; config_error naming the first difference and the ranks)
  /// over `control`, copies rank 0's values to all (complete when this
  /// returns), lays the gradients out in buckets, and starts the bucket
  /// runner. Buckets travel on a split of `comm` of their own: the caller may
  /// use `comm` at any time. `control` carries the metadata when `comm` cannot
  /// (device-only backends; otherwise DDP's own split of `comm` does), and must
  /// outlive this object. With topology::hierarchical and no context, ranks
  /// are grouped into nodes by node name (DTRAIN_NODE_NAME, else the host name).
  basic_ddp(communicator_type& comm, control_plane control, std::vector<parameter> parameters,
            std::vector<parameter> buffers = {}, ddp_options options = {})
      : basic_ddp(comm, &control, std::move(parameters), std::move(buffers), std::move(options),
                  std::nullopt, environment::from_process()) {}

  basic_ddp(const basic_ddp&) = delete;
  basic_ddp& operator=(const basic_ddp&) = delete;

  /// Waits for buckets still in flight (each within its timeout), then gives
  /// the model its gradients back: bucket views are copied to the model's own
  /// buffers (or set to null where it had none), since the buckets go with
  /// this object.
  ~basic_ddp();

  /// Marks parameter `index` (its position in parameters()) ready for this
  /// step. Throws dtrain::error naming it when it was marked already.
  void mark_ready(std::size_t index) {
    if (index >= vars_.size()) no_such_index(index);
    mark(index);
  }
  /// Marks the parameter called `name` ready.
  void mark_ready(std::string_view name) {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) no_such_name(name);
    mark(it->second);
  }
  /// Marks `p` ready, found by its values' address (by its name with
  /// sharding::parameters, whose values move).
  void mark_ready(const parameter& p) { mark(index_of(p)); }
  /// Marks each of a braced list ready: `mark_ready({"fc2.w", "fc2.b"})`.
  /// (Without these, `{"a", "b"}` would build one string_view from the two
  /// pointers as an iterator range.)
  void mark_ready(std::initializer_list<std::string_view> names) {
    for (std::string_view n : names) mark_ready(n);
  }
  /// `mark_ready({4, 5})`: by index.
  void mark_ready(std::initializer_list<std::size_t> indices) {
    for (std::size_t i : indices) mark_ready(i);
  }
  /// `mark_ready({p, q})`: by parameter.
  void mark_ready(std::initializer_list<std::reference_wrapper<const parameter>> params) {
    for (const parameter& p : params) mark_ready(p);
  }
  /// Marks each of `params` ready: parameters, indices or names.
  template <std::ranges::input_range R>
  requires(!std::convertible_to<R, std::string_view>) void mark_ready(R&& params) {
    for (auto&& p : params) mark_ready(p);
  }
  /// Marks every parameter not yet marked in this step, last parameter
  /// first (the order a backward pass finishes them). After the whole
  /// backward pass, `ddp.mark_all_ready(); ddp.synchronize();` is the minimal
  /// correct step (no overlap: the buckets are queued here without waking the
  /// communication thread, and synchronize() reduces them on its own thread).
  void mark_all_ready();

  /// Completes the step: launches what is left and leaves the mean over ranks
  /// in every gradient. Host memory: waits until every bucket is averaged
  /// (bounded by the collective timeout). CUDA: the host waits for nothing;
  /// the compute stream waits for the averaged gradients, and a watchdog
  /// bounds every bucket by the collective timeout (its timeout_error is
  /// thrown here or by the next call). Throws dtrain::error naming the
  /// parameters that were never marked (unless find_unused_parameters), or
  /// the engine's error. Inside no_sync() it does nothing.
  void synchronize();

  /// Writes the timeline (DTRAIN_TIMELINE, ddp_options::timeline) recorded so
  /// far; the destructor writes it too. Call it between steps. Throws
  /// dtrain::error naming the file and the rank when it cannot be written.
  void flush_timeline() const {
    const std::lock_guard lock(mutex_);
    device_spans_.flush();  // the buckets still on the device, a second at most
    timeline_.write();
  }

  /// Which rank the others wait for, as of the last exchange of the ranks'
  /// step records (ddp_options::stragglers; the same figures on every rank).
  /// Rank 0 also says on stderr when a rank becomes slow and when it keeps
  /// pace again. Empty `ranks` when off, at world size 1, or before the first exchange.
  [[nodiscard]] straggler_figures stragglers() const {
    const std::lock_guard lock(mutex_);
    return pace_.figures();
  }

  /// The stream the backward pass runs on (CUDA; default: ddp_options::stream,
  /// whose null is the legacy default stream). Set it before a step, not between mark_ready and
  /// synchronize() (config_error): buckets launched in a step are ordered after it.
  void set_stream(stream_type compute) requires(memory_space::on_stream) {
    const std::lock_guard lock(mutex_);
    change_stream(compute);
  }
  /// set_stream(compute), then synchronize().
  void synchronize(stream_type compute) requires(memory_space::on_stream) {
    synchronize_on(compute);
  }
  /// Blocks the host until every bucket launched so far has been averaged
  /// on the device (each within the collective timeout): for measuring, or
  /// before reading gradients on the host. Throws what a bucket failed with.
  void wait();

  /// While alive, mark_ready only records and nothing is communicated;
  /// gradients accumulate as the caller adds into them, and the next
  /// synchronized step averages the sums. Made only by no_sync(), which
  /// refuses to start one in the middle of a step.
  class no_sync_guard {
   public:
    no_sync_guard(no_sync_guard&& other) noexcept : ddp_(std::exchange(other.ddp_, nullptr)) {}
    no_sync_guard(const no_sync_guard&) = delete;
    no_sync_guard& operator=(const no_sync_guard&) = delete;
    no_sync_guard& operator=(no_sync_guard&&) = delete;
    ~no_sync_guard() {
      if (!ddp_) return;
      const std::lock_guard lock(ddp_->mutex_);
      --ddp_->no_sync_depth_;
    }

   private:
    friend class basic_ddp;
    explicit no_sync_guard(basic_ddp& ddp) noexcept : ddp_(&ddp) {}  // the lock is held
    basic_ddp* ddp_;
  };
  /// Gradient accumulation: `{ auto g = ddp.no_sync(); forward; backward; }`.
  /// Throws dtrain::error in the middle of a step (after mark_ready, before synchronize()).
  [[nodiscard]] no_sync_guard no_sync();

  /// Sets every gradient to zero (between steps only).
  void zero_grad();

  /// Replaces the allreduce of each bucket by `hook` (all ranks must register
  /// the same). Not with gradient compression, which is itself such a reduction.
  void register_comm_hook(comm_hook hook);

  /// What a wrapper that finds the unused parameters itself tells the core
  /// (dtrain::torch walks autograd's graph, as c10d's prepare_for_backward
  /// does): with find_unused_parameters, the parameters listed (indices into
  /// parameters()) are not reached by the coming backward pass. They are
  /// marked ready, contributing zero (or what no_sync() accumulated), as soon
  /// as the step's first other parameter is marked; marking one of them is an
  /// error. The last call before a step counts; between steps only
  /// (dtrain::error otherwise, or without find_unused_parameters).
  void prepare_for_backward(std::span<const std::size_t> unused);

  /// `callback` runs on the marking thread, after the lock is released, when
  /// mark_ready() marks the last parameter of a step outside no_sync() (not
  /// when mark_all_ready() or synchronize() do). dtrain::torch queues
  /// autograd's final callback there, which completes the step.
  void on_all_marked(std::function<void()> callback);

  /// Collective over DDP's communicator, on every rank after the same
  /// synchronize(): per parameter, whether some rank used it (marked it, or
  /// accumulated into it in no_sync()) in the step just completed. One small
  /// sum, computed once per step and only with find_unused_parameters;
  /// without it, or at world size 1, nothing is communicated.
  [[nodiscard]] std::vector<bool> used_anywhere();

  // Sharding (ddp_options::sharding, ZeRO stages 1, 2 and 3): the sharding part
  // (detail::ddp_sharding, ddp/sharding.hpp) answers these.
  // The same calls work without sharding, where a rank's shard is every parameter.

  /// The pieces of the parameters this rank updates, with their averaged
  /// gradients: after synchronize(), an elementwise optimizer updates each
  /// piece's values (state at piece.state_offset), then gather_parameters().
  /// Without sharding (or on one rank): every parameter, whole.
  [[nodiscard]] std::span<const shard_piece> shard() const noexcept { return shards_.pieces(); }
  /// This rank's shard as ranges of the whole model's elements (the
  /// parameters concatenated in index order): `global` where a piece starts
  /// there, `local` its state_offset. For checkpoint::add_sharded, which
  /// re-cuts sharded optimizer state for another world size.
  [[nodiscard]] std::vector<shard_range> shard_ranges() const {
    std::vector<std::uint64_t> first(vars_.size() + 1, 0);
    for (std::size_t i = 0; i < vars_.size(); ++i)
      first[i + 1] = first[i] + vars_[i].param.values.count;
    std::vector<shard_range> out;
    out.reserve(shard().size());
    for (const shard_piece& p : shard())
      out.push_back({first[p.parameter] + p.offset, p.state_offset, p.values.count});
    return out;
  }
  /// Elements of the whole model (every parameter's), the `total` of shard_ranges().
  [[nodiscard]] std::uint64_t model_elements() const noexcept {
    std::uint64_t n = 0;
    for (const variable& v : vars_) n += v.param.values.count;
    return n;
  }
  /// What DDP holds itself on this rank (buckets, shards, scratch), in bytes.
  [[nodiscard]] ddp_memory_use memory_use() const {
    ddp_memory_use use;
    for (const bucket& b : buckets_) {
      use.buckets += b.grads.bytes();
      use.scratch += b.wire.bytes() + b.shard.bytes() + b.accumulate.bytes();
    }
    const std::lock_guard lock(mutex_);
    shards_.add_memory(use);
    return use;
  }
  /// Stage 3: the allgathers of values so far on this rank (gather_counts).
  [[nodiscard]] dtrain::gather_counts gather_counts() const {
    const std::lock_guard lock(mutex_);
    return shards_.gather_counts();
  }
  /// Elements of this rank's shard: the size of an elementwise optimizer's
  /// state array (per state: Adam keeps two).
  [[nodiscard]] std::size_t shard_elements() const noexcept { return shards_.shard_elements(); }
  /// The values of this rank's pieces (shard()), each at its state_offset,
  /// copied into `out` in host memory: shard_elements() elements of the
  /// pieces' type (one type: a config_error names the rank otherwise). At
  /// stage 3 DDP's shard of the values, for checkpoint::add_sharded(name,
  /// ddp). With ddp_options::master_weights the pieces' `master` (float32
  /// for 16-bit parameters). On a GPU after the compute stream, which the
  /// host waits for.
  void download_shard_values(std::span<std::byte> out) { shards_.download_values(out); }
  /// `in` (as download_shard_values() writes it) into the pieces' values
  /// (their `master`, then rounded into the 16-bit values);
  /// on a GPU on the compute stream, which the host waits for. At stage 3
  /// the whole copies of the old values (prefetched) are dropped; while a
  /// gather() guard holds some it throws config_error, naming the rank.
  void upload_shard_values(std::span<const std::byte> in) { shards_.upload_values(in); }
  /// Collective, between steps: the whole model's values on rank `root`
  /// (an export for inference, FSDP's full state dict with rank0_only and
  /// offload_to_cpu), in bounded memory: one bucket at a time is made whole
  /// (at stage 3 an allgather of that bucket alone; other stages hold the
  /// values whole already) and copied to host memory on `root`, where
  /// `visit(param, bytes)` is called for each of its parameters (bytes:
  /// param.values.bytes() of host memory, valid during the call). Every
  /// parameter once, bucket by bucket; other ranks call nothing. At most
  /// one bucket (bucket_cap_mb, or the largest parameter) is whole beyond
  /// what gather() guards hold. What `visit` throws is rethrown on `root`
  /// once every bucket's collective is done (no rank is left waiting).
  template <class Visit>
  requires std::invocable<Visit&, const parameter&, std::span<const std::byte>>
  void export_parameters(Visit&& visit, int root = 0) {
    if (root < 0 || root >= size_) {
      throw config_error("DistributedDataParallel::export_parameters on rank " +
                         std::to_string(rank_) + ": root " + std::to_string(root) +
                         " is not a rank of " + std::to_string(size_));
    }
    {
      const std::lock_guard lock(mutex_);
      check_usable_locked();
      check_between_steps("export_parameters()");
    }
    std::vector<std::byte> host;
    std::exception_ptr thrown;  // visit's: the other ranks' allgathers still get this rank's part
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      shards_.whole_bucket_to_host(b, host, rank_ == root && !thrown);
      if (rank_ != root || thrown) continue;
      try {
        for (const std::size_t i : buckets_[b].info.parameters) {
          const parameter& p = vars_[i].param;
          visit(p, std::span<const std::byte>(host.data() + vars_[i].offset, p.values.bytes()));
        }
      } catch (...) {
        thrown = std::current_exception();
      }
    }
    if (thrown) std::rethrow_exception(thrown);
  }
  /// The optimizer's step over this rank's shard, then the values' allgather:
  /// `update(piece)` for each piece of shard(), then gather_parameters().
  /// Once after each synchronize() (dtrain::error otherwise, naming the rank:
  /// a step on gradients that were not averaged would be silently wrong).
  /// Sharded, each bucket's allgather starts as soon as its pieces are
  /// updated, while the update goes on with the next bucket's.
  template <class Update>
  requires std::invocable<Update&, const shard_piece&>
  void optimizer_step(Update&& update) { shards_.update_and_gather("optimizer_step()", update); }
  /// Collective: every rank's updated shard to every rank (an allgather per
  /// bucket), so that every rank holds all the values again; DDP's gradient
  /// buckets are its scratch and are zeroed after. Once after each
  /// synchronize(), after this rank's update of its shard. Nothing to send
  /// without sharding or on one rank.
  void gather_parameters() {
    auto nothing = [](const shard_piece&) {};  // this rank updated its pieces itself
    shards_.update_and_gather("gather_parameters()", nothing);
  }
  /// The L2 norm of the averaged gradients of the whole model, the same on
  /// every rank (collective with sharding: each rank sums its shard's
  /// squares). For clipping: scale the pieces' gradients by max_norm / norm.
  /// After synchronize(), before gather_parameters(). float32, float64,
  /// bfloat16 and float16 gradients, their squares summed in double.
  [[nodiscard]] double gradient_norm() { return shards_.gradient_norm(); }
  /// Collective: whether `mine` is true on any rank, on every rank (to skip a
  /// step together when some rank found an inf or a NaN).
  [[nodiscard]] bool any_rank(bool mine);

  /// sharding::parameters (ZeRO stage 3): while one lives, the values of the
  /// buckets it holds are whole on this rank, and the model's value pointers
  /// point at them; when the last one holding a bucket goes, the pointers
  /// point at DDP's fence (no memory: a use is named; null on a GPU) and the
  /// memory is given back. Made by gather().
  using gathered_parameters = typename detail::ddp_sharding<Policy>::held_values;
  /// Collective, with sharding::parameters: allgathers the values of the
  /// buckets that hold `params` (parameters, indices into parameters(), or
  /// names), unless a live guard holds them already, and points the model's
  /// value pointers there until the returned guard goes. Hold one around a
  /// part's forward and around its backward up to and past its mark_ready:
  /// `{ auto held = ddp.gather(model.layer_parameters(l)); ...layer l... }`.
  /// Every rank gathers the same parts in the same order (the allgathers
  /// run in order with the buckets' reduce-scatters). Other stages: the
  /// values are whole already, and the guard does nothing.
  template <std::ranges::input_range R>
  requires(!std::convertible_to<R, std::string_view>) [[nodiscard]] gathered_parameters
      gather(R&& params) {
    std::vector<std::size_t> indices;
    for (auto&& p : params) indices.push_back(index_of(p));
    return shards_.gather(indices);
  }
  /// gather({"fc1.weight", "fc1.bias"}).
  [[nodiscard]] gathered_parameters gather(std::initializer_list<std::string_view> names) {
    std::vector<std::size_t> indices;
    for (std::string_view n : names) indices.push_back(index_of(n));
    return shards_.gather(indices);
  }
  /// gather({4, 5}): by index.
  [[nodiscard]] gathered_parameters gather(std::initializer_list<std::size_t> indices) {
    std::vector<std::size_t> checked;
    for (std::size_t i : indices) checked.push_back(index_of(i));
    return shards_.gather(checked);
  }

  /// Throws dtrain::error naming the failure after which this DDP cannot be
  /// used (an engine's error, a timeout); nothing when it is usable.
  void check_usable() const {
    const std::lock_guard lock(mutex_);
    check_usable_locked();
  }

  /// The state of the current step: whether parameter i is marked ready in it.
  [[nodiscard]] bool marked(std::size_t i) const;
  /// Whether prepare_for_backward() listed parameter i for the current step.
  [[nodiscard]] bool declared_unused(std::size_t i) const;
  /// Parameters not yet marked ready in the current step.
  [[nodiscard]] std::size_t unmarked() const;
  /// Some parameter was marked ready outside no_sync() and the step is not
  /// complete: no_sync(), zero_grad() and the next step must wait for synchronize().
  [[nodiscard]] bool step_open() const;
  /// Nothing was marked or accumulated since the last completed step.
  [[nodiscard]] bool idle() const;
  /// Inside no_sync().
  [[nodiscard]] bool accumulating() const;

  // What DDP is: these never wait for the lock, so that a communication hook
  // (which runs while synchronize() holds it) may ask them. The layout and
  // gradient pointers change only in synchronize(), at the first step's rebuild.

  /// The buckets, in launch order (a copy of the current layout).
  [[nodiscard]] std::vector<bucket_info> buckets() const;
  /// Whether the one rebuild from the observed ready order has happened.
  [[nodiscard]] bool buckets_rebuilt() const noexcept {
    return rebuilt_.load(std::memory_order_relaxed);
  }
  /// The parameters as dtrain sees them, gradient pointers current: a
  /// random-access view (`parameters()[i].name`, `.size()`, range-for).
  [[nodiscard]] detail::parameter_view parameters() const noexcept {
    return detail::parameters_of(vars_);
  }
  /// Synchronized steps completed.
  [[nodiscard]] std::size_t steps() const noexcept {
    return steps_.load(std::memory_order_relaxed);
  }
  /// The options DDP was built with.
  [[nodiscard]] const ddp_options& options() const noexcept { return options_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  /// The communicator the buckets travel on: DDP's own split of the user's.
  [[nodiscard]] communicator_type& communicator() noexcept { return comm_; }
  /// How buckets are reduced: the policy's topology over communicator()
  /// (describe(), and for topology::hierarchical hierarchical() and why_flat()).
  [[nodiscard]] const topology_group& topology() const noexcept { return topo_; }
  /// Whether float32 buckets can be compressed here: always on the host; on
  /// a GPU when some translation unit of the program was compiled by nvcc.
  [[nodiscard]] static bool compression_available() noexcept {
    return memory_space::casts_available();
  }

 protected:
  // For DistributedDataParallel's context constructor (the layout from the world).
  basic_ddp(communicator_type& comm, control_plane control, std::vector<parameter> parameters,
            std::vector<parameter> buffers, ddp_options options, std::optional<node_layout> layout,
            const environment& env)
      : basic_ddp(comm, &control, std::move(parameters), std::move(buffers), std::move(options),
                  layout, env) {}

 private:
  template <class>
  friend class detail::thread_runner;
  template <class>
  friend class detail::stream_runner;
  friend class detail::ddp_sharding<Policy>;

  using variable = detail::ddp_variable;
  using bucket = detail::ddp_bucket<memory_space>;
  using runner_type = std::conditional_t<memory_space::on_stream, detail::stream_runner<basic_ddp>,
                                         detail::thread_runner<basic_ddp>>;
  // The control plane DDP makes for itself over its own communicator (host backends).
  using own_channel_type =
      std::conditional_t<communicator_type::reaches_host_memory,
                         communicator_channel<communicator_type>, std::monostate>;

  basic_ddp(communicator_type& comm, control_plane* given, std::vector<parameter> parameters,
            std::vector<parameter> buffers, ddp_options options, std::optional<node_layout> layout,
            const environment& env);

  own_channel_type make_own_channel();
  control_plane control_for(control_plane* given);
  node_layout layout_of(const std::optional<node_layout>& given, const environment& env);
  static int device_of(communicator_type& comm);
  void lay_out(std::span<const std::size_t> order);

  bool compressed(const bucket_info& b) const noexcept {
    return options_.compression != gradient_compression::none && b.type == dtype::float32;
  }
  static bool has_16bit(const std::vector<parameter>& parameters) noexcept {
    return std::ranges::any_of(parameters, [](const parameter& p) {
      return p.values.type == dtype::bfloat16 || p.values.type == dtype::float16;
    });
  }
  /// The options every rank must share, compared at construction (with the model).
  std::string agreed_options() const {
    std::string agreed = shards_.agreed_options();
    // What shapes the collectives: the buckets' cut (a rank with other caps
    // sends other counts, which Gloo's shared memory would sum unchecked),
    // the used-parameter counts' allreduce, and the rebuild after step 1.
    agreed += ", ddp_options::bucket_cap_mb = " +
              std::to_string(mib_to_bytes(options_.bucket_cap_mb, "bucket_cap_mb")) +
              " bytes, first_bucket_cap_mb = " +
              std::to_string(mib_to_bytes(options_.first_bucket_cap_mb, "first_bucket_cap_mb")) +
              " bytes";
    if (options_.find_unused_parameters) agreed += ", ddp_options::find_unused_parameters = true";
    if (!options_.rebuild_buckets) agreed += ", ddp_options::rebuild_buckets = false";
    if (!pace_.setting().automatic()) agreed += ", " + pace_.setting().describe();
    if (options_.compression != gradient_compression::none)
      agreed += ", ddp_options::compression = " + std::string(to_string(options_.compression));
    if (options_.accumulate != accumulation::wire)
      agreed += ", ddp_options::accumulate = " + std::string(to_string(options_.accumulate));
    return agreed;
  }
  /// The type bucket `b` travels in: compression's, else its own.
  dtype wire_type(const bucket_info& b) const noexcept {
    return compressed(b) ? detail::wire_type(options_.compression) : b.type;
  }
  /// Whether bucket `b` is reduced with float32 accumulation (16-bit on the wire).
  bool accumulated(const bucket_info& b) const noexcept {
    const dtype wire = wire_type(b);
    return options_.accumulate == accumulation::float32 &&
           (wire == dtype::bfloat16 || wire == dtype::float16);
  }
  /// The float32 sum of an accumulated reduction: the memory space's, on the stream it is given.
  detail::accumulate_sum accumulate_sum() const {
    return [device = device_](buffer out, buffer in, std::size_t blocks, float divisor,
                              stream_handle stream) {
      typename memory_space::stream_type on{};
      if constexpr (!std::is_same_v<typename memory_space::stream_type, std::nullptr_t>)
        on = static_cast<typename memory_space::stream_type>(stream);
      else
        (void)stream;
      memory_space::accumulate(out.data, out.type, in.data, in.type, blocks, out.count, divisor,
                               device, on);
    };
  }

  // Marking (ddp/basic_ddp_step.hpp). mark() takes the lock and runs the
  // all-marked callback after releasing it; the others run under the lock.
  void mark(std::size_t i);
  bool ready(std::size_t i);
  void record_mark(std::size_t i, bool by_rank);
  [[noreturn]] void no_such_index(std::size_t index) const;
  [[noreturn]] void no_such_name(std::string_view name) const;
  [[noreturn]] void not_a_parameter(const parameter& p) const;
  [[noreturn]] void marked_twice(std::size_t i) const;
  void check_between_steps(const char* what) const;

  std::size_t index_of(std::size_t index) const {
    if (index >= vars_.size()) no_such_index(index);
    return index;
  }
  std::size_t index_of(std::string_view name) const {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) no_such_name(name);
    return it->second;
  }
  std::size_t index_of(const parameter& p) const {
    if (shards_.values_move()) {
      auto it = by_name_.find(p.name);
      if (it == by_name_.end()) not_a_parameter(p);
      return it->second;
    }
    auto it = by_data_.find(p.values.data);
    if (it == by_data_.end()) not_a_parameter(p);
    return it->second;
  }

  /// The first step's ready order lays the buckets out again, once
  /// (not where the sharding part keeps the layout it was built with).
  bool recording() const noexcept {
    return options_.rebuild_buckets && !shards_.fixed_layout() && !rebuilt_ && steps_ == 0;
  }
  /// World size 1 without a hook (nor ddp_options::always_reduce): no bucket travels.
  bool sends_nothing() const noexcept { return size_ == 1 && !hook_ && !options_.always_reduce; }

  void change_stream(stream_type compute);
  std::string take_stream();
  void synchronize_on(stream_type compute);
  void synchronize_locked();
  void launch_ready();
  void finish_alone(std::size_t b);
  void complete_marks();
  std::vector<bool> used_anywhere_locked();
  void report_unused();
  void zero_contribution(std::size_t i);

  // The runner's steps (detail::thread_runner, detail::stream_runner). They
  // run without the lock: they touch only bucket b and its parameters'
  // places, which nothing changes while b is in flight.
  void prepare_bucket(std::size_t b);
  work reduce(std::size_t b);
  /// Streams: bucket b's collective `w` is enqueued (its device span, timeline on).
  void reduce_enqueued(std::size_t b, work& w);
  void finish_bucket(std::size_t b);
  /// Streams: the compute stream waits (on the device) for every collective so far.
  void order_after_buckets() {
    if constexpr (memory_space::on_stream) topo_.stream_wait(stream_);
  }
  /// Every rank's `mine`, in rank order (a per-step scalar: a norm's part, a
  /// flag). Over the control plane where DDP's communicator reaches host
  /// memory (its own channel); otherwise on the device through DDP's
  /// communicator, one allgather and one host sync (NCCL: never the store).
  std::vector<std::int64_t> gather_scalar(std::int64_t mine) {
    return gather_values(std::span<const std::int64_t>(&mine, 1));
  }
  /// gather_scalar() of several: every rank's `mine` (the same length on
  /// every rank), one after the other in rank order.
  std::vector<std::int64_t> gather_values(std::span<const std::int64_t> mine);
  /// The straggler watch's exchange after a step (every rank together).
  void exchange_pace();
  /// This rank's metrics file (ddp_options::metrics_dir), when a second has
  /// passed since the last (`always`: now). Throws dtrain::error naming it;
  /// after a step, a failure is said once and the metrics stop (not the training).
  void write_metrics(bool always);
  /// Host values through a collective of DDP's communicator: `collective` gets
  /// them as a buffer in the engine's memory space (the values themselves in
  /// host memory; else a device copy, brought back after one host sync).
  template <class T, class Collective>
  void through_engine(std::span<T> values, dtype type, Collective&& collective) {
    if constexpr (memory_space::where == memory::host) {
      collective(buffer{values.data(), values.size(), type, memory::host, -1});
    } else {
      const std::size_t bytes = values.size_bytes();
      const detail::flat_storage<memory_space> staged(bytes, device_, stream_);
      memory_space::upload(staged.data(), values.data(), bytes, device_, stream_);
      collective(buffer{staged.data(), values.size(), type, memory::device, device_});
      memory_space::download(values.data(), staged.data(), bytes, device_, stream_);
      memory_space::synchronize(device_, stream_);
    }
  }
  /// `data` summed over DDP's communicator in place, ordered after the compute stream.
  work sum_in_place(const buffer& data) {
    if constexpr (memory_space::on_stream) {
      return comm_.allreduce(data, data, reduce_op::sum, stream_);
    } else {
      return comm_.allreduce(data, data, reduce_op::sum);
    }
  }

  // The compute stream for engines that order after it; null for host memory.
  stream_handle on_stream_or_null() const noexcept {
    if constexpr (memory_space::on_stream) {
      return stream_;
    } else {
      return nullptr;
    }
  }

  std::exception_ptr complete_buckets();
  std::exception_ptr runner_drain();
  void end_step();
  std::vector<std::size_t> layout_order() const;
  void reset_step();

  void check_usable_locked() const {
    if (broken_) unusable();
  }
  [[noreturn]] void unusable() const;
  [[noreturn]] void fail(std::exception_ptr e);

  // A communicator of its own (a split of the user's), so that collectives the
  // user issues during a step cannot interleave with the buckets' differently on different ranks.
  communicator_type comm_;
  own_channel_type own_channel_;
  control_plane control_;
  topology_group topo_;  // after control_: made over it
  ddp_options options_;
  int rank_;
  int size_;
  int device_ = -1;
  std::vector<variable> vars_;  // never resized after construction: parameters() views it
  std::vector<parameter> buffers_;
  std::unordered_map<std::string_view, std::size_t> by_name_;
  std::unordered_map<const void*, std::size_t> by_data_;
  std::vector<bucket> buckets_;
  // The current step.
  std::vector<std::size_t> ready_order_;  // recorded for the rebuild
  std::size_t next_launch_ = 0;
  std::size_t unmarked_ = 0;
  bool any_marked_ = false;      // outside no_sync()
  bool any_touched_ = false;     // marked or accumulated since the last completed step
  bool unused_pending_ = false;  // prepare_for_backward() listed some, not yet marked
  int no_sync_depth_ = 0;
  bool in_bulk_ = false;  // mark_all_ready() or synchronize() launching: no thread wake-up
  // Across steps.
  std::atomic<std::size_t> steps_ = 0;  // read without the lock: steps()
  std::atomic<bool> rebuilt_ = false;
  std::vector<std::int32_t> used_counts_;  // used_anywhere() of step used_step_
  std::size_t used_step_ = 0;              // 0: none yet (a step's count is taken after it)
  bool broken_ = false;
  std::string broken_message_;
  /// ZeRO's stages (none too): the reduction of a ready bucket, the shard,
  /// stage 3's gathers. After the state above, which it reads.
  detail::ddp_sharding<Policy> shards_{*this};
  comm_hook hook_;
  std::function<void()> all_marked_;
  stream_type stream_ = nullptr;
  detail::timeline timeline_;  // off unless DTRAIN_TIMELINE or options_.timeline
  // The buckets' device time (streams with a device timer, timeline on); after timeline_.
  mutable detail::device_spans<memory_space> device_spans_;
  detail::straggler_watch pace_;  // off when options_.stragglers is, or at world size 1
  // The context's line in this rank's flight records: the watch's last window (null: none).
  std::shared_ptr<detail::flight_note> flight_note_;
  struct metrics_state {
    std::string file;              // empty: off
    std::string labels;            // rank="0",node="n1"
    double restarts = 0;           // DTRAIN_RESTART_COUNT
    std::int64_t written = 0;      // steady ns of the last write; 0: none yet
    std::uint64_t step_bytes = 0;  // the gradients' bytes, averaged each step
    std::uint64_t bytes = 0;       // so far
  } metrics_;
  mutable std::mutex mutex_;           // everything above that changes during a step
  std::optional<runner_type> runner_;  // last: it calls back into everything above
};

// ---------------------------------------------------------------------------
// Out of class: see the file comment. Construction here; the buckets' layout
// and journey in ddp/basic_ddp_buckets.hpp; the step's state machine in
// ddp/basic_ddp_step.hpp.

template <class Policy>
basic_ddp<Policy>::basic_ddp(communicator_type& comm, control_plane* given,
                             std::vector<parameter> parameters, std::vector<parameter> buffers,
                             ddp_options options, std::optional<node_layout> layout,
                             const environment& env)
    : comm_(comm.split(0, comm.rank())),
      own_channel_(make_own_channel()),
      control_(control_for(given)),
      topo_(comm_, control_, layout_of(layout, env)),
      options_(std::move(options)),
      rank_(comm.rank()),
      size_(comm.size()),
      buffers_(std::move(buffers)) {
  device_ = device_of(comm_);
  std::string problem = take_stream();
  if (problem.empty() &&
      (options_.compression != gradient_compression::none || options_.master_weights ||
       (options_.accumulate == accumulation::float32 && has_16bit(parameters))) &&
      !compression_available()) {
    // Every rank of the same program sees the same; the agreement below stops them all alike.
    problem = "DistributedDataParallel on rank " + std::to_string(rank_) + ": " +
              std::string(detail::device_casts_missing);
  }
  try {
    timeline_ = detail::timeline::of(env, options_.timeline, rank_, size_, parameters);
    device_spans_.start(device_, rank_, timeline_);
    pace_ = detail::straggler_watch(detail::straggler_setting::of(env, options_.stragglers, rank_),
                                    options_.stragglers, rank_, size_, node_name_or_unknown(env));
    if (const std::string dir =
            detail::read_setting(env, metrics_dir_variable, options_.metrics_dir);
        !dir.empty()) {
      metrics_.file =
          (std::filesystem::path(dir) / ("dtrain_rank" + std::to_string(rank_) + ".prom")).string();
      metrics_.labels = detail::metrics_text::labels(rank_, node_name_or_unknown(env));
      if (auto restarts = detail::read_int(env, restart_count_variable))
        metrics_.restarts = restarts->value;
      try {
        // A directory that cannot take the file fails now, on every rank.
        detail::write_metrics(metrics_.file, "", rank_);
      } catch (const error& e) {
        throw config_error(e.what());
      }
    }
  } catch (const config_error& e) {
    if (problem.empty()) problem = e.what();  // the agreement stops every rank
  }
  if (problem.empty()) {
    problem = detail::model_problem(parameters, buffers_, options_, rank_, communicator_type::name,
                                    on_device, device_);
  }
  agree_or_throw<config_error>(control_, "set up DistributedDataParallel", problem);
  detail::agree_on_model(control_, parameters, buffers_, agreed_options());
  if (options_.broadcast_parameters) {
    detail::broadcast_values(control_, parameters, buffers_, [&](const buffer& values) {
      if constexpr (memory_space::on_stream) {
        comm_.broadcast(values, 0, stream_).wait();
      } else {
        comm_.broadcast(values, 0).wait();
      }
    });
  }
  vars_.reserve(parameters.size());
  for (parameter& p : parameters) {
    void* original = p.gradient;
    vars_.push_back({.param = std::move(p), .original = original});
  }
  for (std::size_t i = 0; i < vars_.size(); ++i) {
    by_name_.emplace(vars_[i].param.name, i);
    if (vars_[i].param.values.data) by_data_.emplace(vars_[i].param.values.data, i);
  }
  used_counts_.assign(vars_.size(), 0);  // no step yet: nothing used
  lay_out(detail::reverse_order(vars_.size()));
  shards_.take_values();
  // The buckets were zeroed and filled on the compute stream: complete before the first step.
  memory_space::synchronize(device_, stream_);
  for (const variable& v : vars_) metrics_.step_bytes += v.param.bytes();
  runner_.emplace(*this);
}

template <class Policy>
basic_ddp<Policy>::~basic_ddp() {
  runner_.reset();  // joins the thread, or waits out the watchdog
  device_spans_.flush();
  timeline_.write_at_exit();
  if (!metrics_.file.empty()) {
    try {
      write_metrics(true);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[rank %d/%d] dtrain: %s\n", rank_, size_, e.what());
    }
  }
  try {
    shards_.give_back_values();  // stage 3: the values go with this object
    for (variable& v : vars_) {
      if (!v.view) continue;
      parameter& p = v.param;
      if (v.original) memory_space::copy(v.original, p.gradient, p.bytes(), p.device, stream_);
      p.rebind(p.gradient_slot, v.original);
    }
    memory_space::synchronize(device_, stream_);  // before the buckets are freed
  } catch (...) {
    // A device that failed already reported it; the model's pointers are what they are.
  }
}

template <class Policy>
typename basic_ddp<Policy>::own_channel_type basic_ddp<Policy>::make_own_channel() {
  if constexpr (communicator_type::reaches_host_memory) {
    return own_channel_type(comm_);
  } else {
    return {};
  }
}

// A communicator that reaches host memory carries the metadata itself (no
// store traffic, and packed host values of any size); a device-only one uses `given`.
template <class Policy>
control_plane basic_ddp<Policy>::control_for([[maybe_unused]] control_plane* given) {
  if constexpr (communicator_type::reaches_host_memory) {
    return control_plane(own_channel_);
  } else {
    return *given;  // the constructors without one do not compile for such a communicator
  }
}

// The nodes as the launcher placed them, or (no context) as node names group them.
template <class Policy>
node_layout basic_ddp<Policy>::layout_of(const std::optional<node_layout>& given,
                                         [[maybe_unused]] const environment& env) {
  if constexpr (std::is_same_v<typename Policy::topology_type, topology::flat>) {
    return given.value_or(node_layout{});  // flat needs none: nothing collective
  } else {
    if (given) return *given;
    return detail::layout_from_node_names(control_, node_name(env));
  }
}

template <class Policy>
int basic_ddp<Policy>::device_of(communicator_type& comm) {
  if constexpr (on_device) {
    return comm.device();
  } else {
    (void)comm;
    return -1;
  }
}

}  // namespace dtrain

#include <dtrain/ddp/basic_ddp_buckets.hpp>
#include <dtrain/ddp/basic_ddp_step.hpp>
#include <dtrain/ddp/sharding_part.hpp>
