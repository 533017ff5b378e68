#pragma once
/// @file
/// basic_ddp<Policy>: everything of DistributedDataParallel that does not
/// depend on the model's type. It is built from the parameter and buffer
/// lists, and averages the gradients over the ranks while the backward pass
/// is still running. Gradients live in flat buckets in the backend's memory
/// space; the moment a bucket's last gradient is marked ready its allreduce
/// starts — on a communication thread for host memory (MPI, Gloo), or on the
/// communicator's stream after an event on the compute stream for CUDA
/// (NCCL), followed by a watchdog. Metadata (model agreement, the rebuild
/// order) goes over the host control plane, never through a device engine.
///
/// Every member that is more than a line or two is defined out of the class,
/// as a non-inline template member: a compiled library may then hold
/// `template class dtrain::basic_ddp<P>;` and its users
/// `extern template class dtrain::basic_ddp<P>;`, and none of those bodies
/// is compiled again in the users' translation units (GCC instantiates
/// in-class members of an extern template at -O2 anyway, out-of-class ones not).

#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/control.hpp>
#include <dtrain/backend/memory.hpp>
#include <dtrain/backend/ring.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/ddp/agreement.hpp>
#include <dtrain/ddp/bucket.hpp>
#include <dtrain/ddp/options.hpp>
#include <dtrain/ddp/parameter.hpp>
#include <dtrain/ddp/runner.hpp>
#include <dtrain/ddp/storage.hpp>
#include <dtrain/ddp/timeline.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/placement.hpp>
#include <dtrain/env/world.hpp>
#include <dtrain/error.hpp>
#include <dtrain/topology/flat.hpp>
#include <dtrain/topology/layout.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
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
/// runtime (agent, store server) that context.hpp brings.
template <class C, class Policy>
concept ddp_context = requires(C& c) {
  { c.communicator() } -> std::same_as<typename Policy::communicator_type&>;
  { c.control_plane() } -> std::convertible_to<control_plane>;
  { c.world() } -> std::convertible_to<const world&>;
};

/// The model-free core of DistributedDataParallel, over the communicator of
/// `Policy`, built from the parameters (and buffers) as dtrain sees them.
///
/// Per step: mark each parameter ready (mark_ready) as soon as its gradient
/// is final, or all at once after the backward pass (mark_all_ready), then
/// synchronize(); gradients then hold the mean over ranks. Not thread-safe:
/// call it from one thread at a time. Another thread may call mark_ready
/// while the training thread waits for it (autograd's hooks during
/// backward(), as dtrain/torch.hpp does), but never two at once. Between
/// mark_ready and synchronize() a gradient belongs to dtrain: do not touch it.
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
  /// data (NCCL). The policy's topology groups the ranks by ctx.world()'s nodes.
  template <ddp_context<Policy> Context>
  basic_ddp(Context& ctx, std::vector<parameter> parameters, std::vector<parameter> buffers = {},
            ddp_options options = {})
      : basic_ddp(ctx.communicator(), ctx.control_plane(), std::move(parameters),
                  std::move(buffers), std::move(options), node_layout::of(ctx.world())) {}

  /// Collective over `comm`, which carries the metadata too (MPI, Gloo: a
  /// communicator that reaches host memory). A device-only backend (NCCL)
  /// needs the constructor with a control plane.
  /// (A template only so that an explicit instantiation of the class for NCCL
  /// does not trip the static_assert.)
  template <std::same_as<communicator_type> Comm>
  basic_ddp(Comm& comm, std::vector<parameter> parameters, std::vector<parameter> buffers = {},
            ddp_options options = {})
      : basic_ddp(comm, nullptr, std::move(parameters), std::move(buffers), std::move(options),
                  std::nullopt) {
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
                  std::nullopt) {}

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
    if (index >= params_.size()) no_such_index(index);
    ready(index);
  }
  /// Marks the parameter called `name` ready.
  void mark_ready(std::string_view name) {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) no_such_name(name);
    ready(it->second);
  }
  /// Marks `p` ready, found by its values' address.
  void mark_ready(const parameter& p) {
    auto it = by_data_.find(p.values.data);
    if (it == by_data_.end()) not_a_parameter(p);
    ready(it->second);
  }
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
  void flush_timeline() const { timeline_.write(); }

  /// The stream the backward pass runs on (CUDA; default: the legacy default
  /// stream). Set it before a step, not between mark_ready and synchronize()
  /// (config_error): buckets launched in a step are ordered after it.
  void set_stream(stream_type compute) requires(memory_space::on_stream) { change_stream(compute); }
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
      if (ddp_) --ddp_->no_sync_depth_;
    }

   private:
    friend class basic_ddp;
    explicit no_sync_guard(basic_ddp& ddp) noexcept : ddp_(&ddp) { ++ddp.no_sync_depth_; }
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

  /// The buckets, in launch order.
  [[nodiscard]] const std::vector<bucket_info>& buckets() const noexcept { return info_; }
  /// Whether the one rebuild from the observed ready order has happened.
  [[nodiscard]] bool buckets_rebuilt() const noexcept { return rebuilt_; }
  /// The parameters as dtrain sees them, gradient pointers current.
  [[nodiscard]] std::span<const parameter> parameters() const noexcept { return params_; }
  /// Synchronized steps completed.
  [[nodiscard]] std::size_t steps() const noexcept { return steps_; }
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
            std::vector<parameter> buffers, ddp_options options, std::optional<node_layout> layout)
      : basic_ddp(comm, &control, std::move(parameters), std::move(buffers), std::move(options),
                  layout) {}

 private:
  template <class>
  friend class detail::thread_runner;
  template <class>
  friend class detail::stream_runner;

  /// What DDP keeps per parameter (the Reducer's VariableIndex): the slot in
  /// its bucket and this step's state.
  struct variable {
    void* original = nullptr;  // the model's own gradient pointer, given back at the end
    std::size_t bucket = 0;
    std::size_t offset = 0;  // bytes into the bucket
    bool view = false;       // the gradient lives in the bucket
    bool marked = false;     // this step
    bool touched = false;    // since the last synchronized step, no_sync() micro-steps included
    bool zeroed = false;     // copy mode, unused this step: its slice was zeroed, skip copy-in
    bool used = false;       // marked by this rank in some step so far (find_unused_parameters)
  };
  struct bucket_state {
    detail::flat_storage<memory_space> grads;
    detail::flat_storage<memory_space> wire;   // the 16-bit copy, with compression
    detail::flat_storage<memory_space> shard;  // the topology's scratch (hierarchical)
    std::size_t moved = 0;    // elements the collective moves: the slots, padded to the topology
    std::size_t pending = 0;  // parameters not yet marked this step
    bool ready = false;
    std::uint64_t span = 0;        // its timeline span, from launch to completion
    std::int64_t span_reduce = 0;  // when its reduction started (timeline on)
  };
  using runner_type = std::conditional_t<memory_space::on_stream, detail::stream_runner<basic_ddp>,
                                         detail::thread_runner<basic_ddp>>;
  // The control plane DDP makes for itself over its own communicator (host backends).
  using own_channel_type =
      std::conditional_t<communicator_type::reaches_host_memory,
                         communicator_channel<communicator_type>, std::monostate>;

  basic_ddp(communicator_type& comm, control_plane* given, std::vector<parameter> parameters,
            std::vector<parameter> buffers, ddp_options options, std::optional<node_layout> layout);

  own_channel_type make_own_channel();
  control_plane control_for(control_plane* given);
  node_layout layout_of(const std::optional<node_layout>& given);
  static int device_of(communicator_type& comm);
  void lay_out(std::span<const std::size_t> order);

  bool compressed(const bucket_info& b) const noexcept {
    return options_.compression != gradient_compression::none && b.type == dtype::float32;
  }

  // The hot path of mark_ready; what it throws is built out of line.
  void ready(std::size_t i) {
    check_usable();
    variable& v = vars_[i];
    const auto span = timeline_.mark_ready(i, v.bucket);
    if (no_sync_depth_ > 0) {
      v.touched = true;
      return;
    }
    if (v.marked) marked_twice(i);
    v.marked = v.touched = true;
    any_marked_ = true;
    if (recording()) ready_order_.push_back(i);
    bucket_state& b = buckets_[v.bucket];
    if (--b.pending == 0) {
      b.ready = true;
      if (options_.overlap) launch_ready();
    }
  }
  [[noreturn]] void no_such_index(std::size_t index) const;
  [[noreturn]] void no_such_name(std::string_view name) const;
  [[noreturn]] void not_a_parameter(const parameter& p) const;
  [[noreturn]] void marked_twice(std::size_t i) const;

  bool recording() const noexcept { return options_.rebuild_buckets && !rebuilt_ && steps_ == 0; }
  /// World size 1 without a hook: nothing to send (ddp_options::always_reduce).
  bool alone() const noexcept { return size_ == 1 && !hook_ && !options_.always_reduce; }

  void change_stream(stream_type compute);
  void synchronize_on(stream_type compute);
  void launch_ready();
  void finish_alone(std::size_t b);
  void complete_marks();
  void report_unused();
  void zero_contribution(std::size_t i);

  // The runner's steps (detail::thread_runner, detail::stream_runner).
  void prepare_bucket(std::size_t b);
  work reduce(std::size_t b);
  void finish_bucket(std::size_t b);
  /// Streams: the compute stream waits (on the device) for every collective so far.
  void order_after_buckets() {
    if constexpr (memory_space::on_stream) topo_.stream_wait(stream_);
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

  void check_usable() const {
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
  std::string problem_;
  std::vector<parameter> params_;
  std::vector<parameter> buffers_;
  std::vector<variable> vars_;  // per parameter, indexed like params_
  std::unordered_map<std::string_view, std::size_t> by_name_;
  std::unordered_map<const void*, std::size_t> by_data_;
  std::vector<bucket_info> info_;
  std::vector<bucket_state> buckets_;
  std::vector<std::size_t> ready_order_;
  std::size_t next_launch_ = 0;
  std::size_t steps_ = 0;
  bool rebuilt_ = false;
  bool any_marked_ = false;
  int no_sync_depth_ = 0;
  bool in_bulk_ = false;  // mark_all_ready() or synchronize() launching: no thread wake-up
  bool broken_ = false;
  std::string broken_message_;
  comm_hook hook_;
  stream_type stream_ = nullptr;
  detail::timeline timeline_;          // off unless DTRAIN_TIMELINE or options_.timeline
  std::optional<runner_type> runner_;  // last: it calls back into everything above
};

// ---------------------------------------------------------------------------
// Out of class: see the file comment.

template <class Policy>
basic_ddp<Policy>::basic_ddp(communicator_type& comm, control_plane* given,
                             std::vector<parameter> parameters, std::vector<parameter> buffers,
                             ddp_options options, std::optional<node_layout> layout)
    : comm_(comm.split(0, comm.rank())),
      own_channel_(make_own_channel()),
      control_(control_for(given)),
      topo_(comm_, control_, layout_of(layout)),
      options_(std::move(options)),
      rank_(comm.rank()),
      size_(comm.size()),
      params_(std::move(parameters)),
      buffers_(std::move(buffers)) {
  device_ = device_of(comm_);
  if (options_.compression != gradient_compression::none && !compression_available()) {
    // Every rank of the same program sees the same; the agreement below stops them all alike.
    problem_ = "DistributedDataParallel on rank " + std::to_string(rank_) + ": " +
               std::string(detail::device_casts_missing);
  }
  try {
    timeline_ = detail::timeline::of(options_.timeline, rank_, size_, params_);
  } catch (const config_error& e) {
    if (problem_.empty()) problem_ = e.what();  // the agreement stops every rank
  }
  detail::agree_on_model(control_, params_, buffers_,
                         problem_.empty()
                             ? detail::model_problem(params_, buffers_, options_, rank_,
                                                     communicator_type::name, on_device, device_)
                             : problem_);
  if (options_.broadcast_parameters) {
    detail::broadcast_values(control_, params_, buffers_, [&](const buffer& values) {
      if constexpr (memory_space::on_stream) {
        comm_.broadcast(values, 0, stream_).wait();
      } else {
        comm_.broadcast(values, 0).wait();
      }
    });
  }
  vars_.resize(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    by_name_.emplace(params_[i].name, i);
    by_data_.emplace(params_[i].values.data, i);
    vars_[i].original = params_[i].gradient;
  }
  lay_out(detail::reverse_order(params_.size()));
  // The buckets were zeroed and filled on the compute stream: complete before the first step.
  memory_space::synchronize(device_, stream_);
  runner_.emplace(*this);
}

template <class Policy>
basic_ddp<Policy>::~basic_ddp() {
  runner_.reset();  // joins the thread, or waits out the watchdog
  timeline_.write_at_exit();
  try {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!vars_[i].view) continue;
      parameter& p = params_[i];
      if (vars_[i].original)
        memory_space::copy(vars_[i].original, p.gradient, p.bytes(), p.device, stream_);
      p.rebind(p.gradient_slot, vars_[i].original);
    }
    memory_space::synchronize(device_, stream_);  // before the buckets are freed
  } catch (...) {
    // A device that failed already reported it; the model's pointers are what they are.
  }
}

template <class Policy>
void basic_ddp<Policy>::no_such_index(std::size_t index) const {
  throw error("DistributedDataParallel::mark_ready: parameter #" + std::to_string(index) +
              " does not exist on rank " + std::to_string(rank_) + " (the model has " +
              std::to_string(params_.size()) + ")");
}

template <class Policy>
void basic_ddp<Policy>::no_such_name(std::string_view name) const {
  throw error("DistributedDataParallel::mark_ready: rank " + std::to_string(rank_) +
              " has no parameter named '" + std::string(name) + "'");
}

template <class Policy>
void basic_ddp<Policy>::not_a_parameter(const parameter& p) const {
  throw error("DistributedDataParallel::mark_ready: parameter '" + p.name + "' on rank " +
              std::to_string(rank_) +
              " is not one of the model's parameters (its values are elsewhere)");
}

template <class Policy>
void basic_ddp<Policy>::marked_twice(std::size_t i) const {
  throw error("DistributedDataParallel::mark_ready: parameter '" + params_[i].name + "' (#" +
              std::to_string(i) + ") was marked ready twice in step " + std::to_string(steps_) +
              " on rank " + std::to_string(rank_) +
              "; mark each gradient once per step (accumulate inside no_sync())");
}

template <class Policy>
void basic_ddp<Policy>::mark_all_ready() {
  // Last first, as a backward pass finishes them and as the first layout
  // fills the buckets: recorded for the rebuild, this order changes nothing.
  // The backward pass is over: the caller reduces these buckets itself in
  // synchronize(), without waking the communication thread.
  in_bulk_ = true;
  try {
    for (std::size_t i = params_.size(); i-- > 0;) {
      if (!vars_[i].marked) ready(i);
    }
  } catch (...) {
    in_bulk_ = false;
    throw;
  }
  in_bulk_ = false;
}

template <class Policy>
void basic_ddp<Policy>::synchronize() {
  if (no_sync_depth_ > 0) return;
  {
    const auto span = timeline_.synchronize(steps_);
    check_usable();
    complete_marks();
    if (auto e = complete_buckets()) fail(e);
    end_step();
  }
  if (options_.find_unused_parameters && options_.report_unused_parameters &&
      steps_ == unused_report_steps)
    report_unused();
}

template <class Policy>
void basic_ddp<Policy>::change_stream(stream_type compute) {
  if (compute == stream_) return;
  if (any_marked_) {
    throw config_error("DistributedDataParallel::set_stream on rank " + std::to_string(rank_) +
                       " in the middle of step " + std::to_string(steps_) +
                       " (after mark_ready, before synchronize()): buckets already launched "
                       "are ordered after the old stream; set the stream before the step");
  }
  memory_space::check_stream(device_, compute);
  // What the old stream still does with the buckets comes first; their
  // storage is released on the new one from now on.
  memory_space::order_after(device_, compute, stream_);
  for (bucket_state& b : buckets_) {
    b.grads.set_stream(compute);
    b.wire.set_stream(compute);
    b.shard.set_stream(compute);
  }
  stream_ = compute;
}

template <class Policy>
void basic_ddp<Policy>::synchronize_on(stream_type compute) {
  if (compute != stream_ && (any_marked_ || next_launch_ > 0) && no_sync_depth_ == 0) {
    throw config_error("DistributedDataParallel::synchronize(stream) on rank " +
                       std::to_string(rank_) + " with a stream other than the one step " +
                       std::to_string(steps_) +
                       " was marked on: call set_stream(stream) before the step instead");
  }
  change_stream(compute);
  synchronize();
}

template <class Policy>
void basic_ddp<Policy>::wait() {
  if (auto e = runner_drain()) fail(e);
  memory_space::synchronize(device_, stream_);
}

template <class Policy>
typename basic_ddp<Policy>::no_sync_guard basic_ddp<Policy>::no_sync() {
  if (any_marked_) {
    throw error("DistributedDataParallel::no_sync() on rank " + std::to_string(rank_) +
                " in the middle of a synchronized step (after mark_ready, before synchronize())");
  }
  return no_sync_guard(*this);
}

template <class Policy>
void basic_ddp<Policy>::zero_grad() {
  if (any_marked_ && no_sync_depth_ == 0) {
    throw error("DistributedDataParallel::zero_grad() on rank " + std::to_string(rank_) +
                " in the middle of a step (after mark_ready, before synchronize())");
  }
  for (bucket_state& b : buckets_)
    memory_space::zero(b.grads.data(), b.grads.bytes(), b.grads.device(), stream_);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!vars_[i].view)
      memory_space::zero(params_[i].gradient, params_[i].bytes(), params_[i].device, stream_);
  }
}

template <class Policy>
void basic_ddp<Policy>::register_comm_hook(comm_hook hook) {
  if (any_marked_ || next_launch_ > 0) {
    throw config_error("DistributedDataParallel::register_comm_hook on rank " +
                       std::to_string(rank_) + " in the middle of step " + std::to_string(steps_) +
                       " (after mark_ready, before synchronize()): register it between steps");
  }
  if (options_.compression != gradient_compression::none) {
    throw config_error("DistributedDataParallel::register_comm_hook: ddp_options::compression is " +
                       std::string(to_string(options_.compression)) +
                       "; a hook replaces the reduction, so compress inside the hook instead");
  }
  hook_ = std::move(hook);
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
node_layout basic_ddp<Policy>::layout_of(const std::optional<node_layout>& given) {
  if constexpr (std::is_same_v<typename Policy::topology_type, topology::flat>) {
    return given.value_or(node_layout{});  // flat needs none: nothing collective
  } else {
    if (given) return *given;
    return detail::layout_from_node_names(control_, node_name(environment::from_process()));
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

/// Lays the gradients out in buckets filled in `order`, moving each
/// bucket-view gradient (and its values) to its new place. The old buckets
/// are freed only once the copies out of them are complete.
template <class Policy>
void basic_ddp<Policy>::lay_out(std::span<const std::size_t> order) {
  std::vector<bucket_info> info = detail::assign_buckets(
      params_, order, mib_to_bytes(options_.first_bucket_cap_mb, "first_bucket_cap_mb"),
      mib_to_bytes(options_.bucket_cap_mb, "bucket_cap_mb"));
  std::vector<bucket_state> buckets(info.size());
  for (std::size_t b = 0; b < info.size(); ++b) {
    // A hierarchical topology splits a bucket into equal shards, one per
    // rank of a node: zeros at the end make the count divide (GPU: every
    // shard on bucket_alignment too). The padding stays zero.
    std::size_t unit = topo_.granularity();
    if (unit > 1 && info[b].device >= 0) unit *= bucket_alignment / size_of(info[b].type);
    buckets[b].moved = (info[b].count + unit - 1) / unit * unit;
    buckets[b].grads = detail::flat_storage<memory_space>(buckets[b].moved * size_of(info[b].type),
                                                          info[b].device, stream_);
    if (compressed(info[b]))
      buckets[b].wire = detail::flat_storage<memory_space>(
          buckets[b].moved * size_of(detail::wire_type(options_.compression)), info[b].device,
          stream_);
    if (const std::size_t shard = topo_.shard_count(buckets[b].moved); shard > 0)
      buckets[b].shard = detail::flat_storage<memory_space>(shard * size_of(info[b].type),
                                                            info[b].device, stream_);
    for (std::size_t k = 0; k < info[b].parameters.size(); ++k) {
      const std::size_t i = info[b].parameters[k];
      parameter& p = params_[i];
      variable& v = vars_[i];
      v.bucket = b;
      v.offset = info[b].offsets[k];
      v.view = options_.gradient_as_bucket_view && p.rebindable();
      if (v.view) {
        void* place = buckets[b].grads.data() + v.offset;
        if (p.gradient) memory_space::copy(place, p.gradient, p.bytes(), p.device, stream_);
        p.gradient = place;
        p.rebind(p.gradient_slot, place);
      }
    }
  }
  // The old buckets are released on the compute stream, after the copies
  // out of them and (streams) after every collective on them: the compute
  // stream waits for those already (order_after_buckets). The host does not
  // wait, with CUDA as without.
  info_ = std::move(info);
  buckets_ = std::move(buckets);
  reset_step();
}

/// Launches, in bucket order, every bucket whose turn it is and is ready.
template <class Policy>
void basic_ddp<Policy>::launch_ready() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready) {
    const std::size_t b = next_launch_++;
    try {
      buckets_[b].span = timeline_.bucket_launched(b, info_[b].count);
      if (alone()) {
        finish_alone(b);
      } else if constexpr (memory_space::on_stream) {
        runner_->launch(b);
      } else {
        runner_->launch(b, !in_bulk_);
      }
    } catch (...) {
      fail(std::current_exception());
    }
  }
}

/// World size 1: the bucket's mean is its gradients. Only compression has
/// something to do (round through the wire type, as on more ranks), on the
/// caller's thread or the compute stream; the timeline still sees the bucket.
template <class Policy>
void basic_ddp<Policy>::finish_alone(std::size_t b) {
  if (compressed(info_[b])) {
    prepare_bucket(b);
    finish_bucket(b);
  } else if (timeline_.on()) {
    timeline_.bucket_done(b, buckets_[b].span, detail::timeline::now(), false);
  }
}

/// The unmarked parameters of this step: an error, or (find_unused_parameters)
/// zero contributions, marked now in index order on every rank.
template <class Policy>
void basic_ddp<Policy>::complete_marks() {
  std::vector<std::size_t> missing;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (vars_[i].touched) vars_[i].used = true;  // before the unused are marked below
    if (!vars_[i].marked) missing.push_back(i);
  }
  if (!missing.empty() && !options_.find_unused_parameters) {
    const std::string names =
        detail::pick_names(params_, [&](std::size_t i) { return !vars_[i].marked; }).names;
    throw error("DistributedDataParallel::synchronize: rank " + std::to_string(rank_) +
                " never marked " + std::to_string(missing.size()) + " of " +
                std::to_string(params_.size()) + " parameters ready in step " +
                std::to_string(steps_) + ": " + names +
                "; call mark_ready for every parameter (or mark_all_ready() after the backward "
                "pass), or set ddp_options::find_unused_parameters");
  }
  for (std::size_t i : missing) {
    // Nothing accumulated in no_sync() either: this rank contributes zero.
    if (!vars_[i].touched) zero_contribution(i);
    ready(i);
  }
  for (bucket_state& b : buckets_) b.ready = true;
  in_bulk_ = true;  // synchronize() reduces these on the caller's thread next
  launch_ready();
  in_bulk_ = false;
}

/// Once, after the first unused_report_steps steps: the parameters that no
/// rank marked are named on rank 0 (a parameter one rank marked is used).
/// Collective over the control plane; every rank reaches it in the same step.
template <class Policy>
void basic_ddp<Policy>::report_unused() {
  const std::size_t words = (params_.size() + 63) / 64;
  if (words == 0) return;
  std::vector<std::int64_t> mine(words, 0);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (vars_[i].used) mine[i / 64] |= std::int64_t{1} << (i % 64);
  }
  std::vector<std::int64_t> all(words * static_cast<std::size_t>(size_));
  if (size_ > 1) {
    control_.allgather(mine, all);
  } else {
    all = mine;
  }
  if (rank_ != 0) return;
  for (std::size_t r = 0; r < static_cast<std::size_t>(size_); ++r) {
    for (std::size_t w = 0; w < words; ++w) mine[w] |= all[r * words + w];
  }
  const auto [names, count] = detail::pick_names(
      params_, [&](std::size_t i) { return (mine[i / 64] & (std::int64_t{1} << (i % 64))) == 0; });
  if (count == 0) return;
  std::fprintf(
      stderr,
      "[rank 0/%d] dtrain: DistributedDataParallel: no rank marked %s %s ready in the first "
      "%zu steps; with find_unused_parameters %s treated as unused and %s zeroed. If a "
      "mark_ready was forgotten, add it (or call mark_all_ready() after the backward "
      "pass); if the parameter is unused on purpose, set "
      "ddp_options::report_unused_parameters = false to silence this\n",
      size_, count == 1 ? "parameter" : "parameters", names.c_str(), unused_report_steps,
      count == 1 ? "it is" : "they are", count == 1 ? "its gradient" : "their gradients");
  std::fflush(stderr);
}

template <class Policy>
void basic_ddp<Policy>::zero_contribution(std::size_t i) {
  parameter& p = params_[i];
  variable& v = vars_[i];
  if (v.view || (alone() && !compressed(info_[v.bucket]))) {
    // World size 1 leaves a copy-mode gradient where it is: zero it there.
    memory_space::zero(p.gradient, p.bytes(), p.device, stream_);
  } else {
    // Copy-mode: the bucket's slice is what travels; the model's buffer gets the mean after.
    memory_space::zero(buckets_[v.bucket].grads.data() + v.offset, p.bytes(), p.device, stream_);
    v.zeroed = true;
  }
}

/// Copy-in and compression: what must happen before the collective.
template <class Policy>
void basic_ddp<Policy>::prepare_bucket(std::size_t b) {
  bucket_state& s = buckets_[b];
  if (timeline_.on()) s.span_reduce = detail::timeline::now();
  for (std::size_t i : info_[b].parameters) {
    const variable& v = vars_[i];
    if (v.view || v.zeroed) continue;
    memory_space::copy(s.grads.data() + v.offset, params_[i].gradient, params_[i].bytes(),
                       info_[b].device, stream_);
  }
  if (!compressed(info_[b])) return;
  const float scale = 1.0f / static_cast<float>(size_);  // pre-divide: the sum is the mean
  memory_space::compress(s.wire.data(), reinterpret_cast<const float*>(s.grads.data()),
                         info_[b].count, scale, detail::wire_type(options_.compression),
                         info_[b].device, stream_);
}

/// The collective of bucket b (or the user's hook), ordered after the compute stream.
template <class Policy>
work basic_ddp<Policy>::reduce(std::size_t b) {
  detail::label_scope label("bucket",
                            static_cast<std::int64_t>(b));  // names it in desync diagnostics
  bucket_state& s = buckets_[b];
  const bucket_info& info = info_[b];
  buffer data{s.grads.data(), s.moved, info.type, memory_space::where, s.grads.device()};
  reduce_op op = reduce_op::avg;
  if (compressed(info)) {
    data = {s.wire.data(), s.moved, detail::wire_type(options_.compression), memory_space::where,
            s.grads.device()};
    op = reduce_op::sum;
  }
  if (hook_) {
    gradient_bucket view{.index = b,
                         .data = data,
                         .world_size = size_,
                         .parameters = info.parameters,
                         .stream = stream_};
    view.data.count = info.count;  // the hook sees the slots, not the topology's padding
    return hook_(comm_, view);
  }
  const buffer shard{s.shard.data(), topo_.shard_count(s.moved), data.type, memory_space::where,
                     s.grads.device()};
  return topo_.allreduce(data, shard, op, on_stream_or_null());
}

/// Decompression and copy-out: what must happen after the collective.
template <class Policy>
void basic_ddp<Policy>::finish_bucket(std::size_t b) {
  bucket_state& s = buckets_[b];
  const bucket_info& info = info_[b];
  if (compressed(info)) {
    memory_space::decompress(reinterpret_cast<float*>(s.grads.data()), s.wire.data(), info.count,
                             detail::wire_type(options_.compression), info.device, stream_);
  }
  for (std::size_t i : info.parameters) {
    const variable& v = vars_[i];
    if (v.view) continue;
    memory_space::copy(params_[i].gradient, s.grads.data() + v.offset, params_[i].bytes(),
                       info.device, stream_);
  }
  timeline_.bucket_done(b, s.span, s.span_reduce, !memory_space::on_stream);
}

template <class Policy>
std::exception_ptr basic_ddp<Policy>::complete_buckets() {
  if (alone()) return nullptr;  // each bucket was finished as it was launched
  const auto span = timeline_.wait(buckets_.size());
  return runner_->complete(buckets_.size());
}

template <class Policy>
std::exception_ptr basic_ddp<Policy>::runner_drain() {
  if constexpr (memory_space::on_stream) {
    return runner_->drain();
  } else {
    return nullptr;  // synchronize() waited already
  }
}

/// After every bucket is averaged: the one rebuild, then a fresh step.
template <class Policy>
void basic_ddp<Policy>::end_step() {
  const bool rebuild = recording();
  ++steps_;
  if (rebuild) {
    // Rank 0's order wins, so that every rank lays its buckets out alike.
    std::vector<std::uint8_t> bytes(ready_order_.size() * sizeof(std::uint64_t));
    for (std::size_t k = 0; k < ready_order_.size(); ++k) {
      const std::uint64_t i = ready_order_[k];
      std::memcpy(bytes.data() + k * sizeof i, &i, sizeof i);
    }
    if (size_ > 1) control_.broadcast(bytes, 0);
    std::vector<std::size_t> agreed(ready_order_.size());
    for (std::size_t k = 0; k < agreed.size(); ++k) {
      std::uint64_t i = 0;
      std::memcpy(&i, bytes.data() + k * sizeof i, sizeof i);
      agreed[k] = static_cast<std::size_t>(i);
    }
    detail::check_order(agreed, params_.size(),
                        "rank 0's ready order (sent to rank " + std::to_string(rank_) + ")");
    rebuilt_ = true;
    // The buckets of this step are done with (host memory) or ordered
    // before everything that follows on the compute stream (streams), where
    // lay_out() copies out of them and releases them.
    if (agreed != layout_order()) lay_out(agreed);
  }
  reset_step();
}

/// The parameters in the order the current buckets hold them.
template <class Policy>
std::vector<std::size_t> basic_ddp<Policy>::layout_order() const {
  std::vector<std::size_t> order;
  for (const bucket_info& b : info_)
    order.insert(order.end(), b.parameters.begin(), b.parameters.end());
  return order;
}

template <class Policy>
void basic_ddp<Policy>::reset_step() {
  for (variable& v : vars_) v.marked = v.touched = v.zeroed = false;
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    buckets_[b].pending = info_[b].parameters.size();
    buckets_[b].ready = false;
  }
  ready_order_.clear();
  next_launch_ = 0;
  any_marked_ = false;
}

template <class Policy>
void basic_ddp<Policy>::unusable() const {
  throw error("DistributedDataParallel on rank " + std::to_string(rank_) +
              " is unusable after an earlier failure: " + broken_message_);
}

template <class Policy>
void basic_ddp<Policy>::fail(std::exception_ptr e) {
  broken_ = true;
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    broken_message_ = x.what();
    throw;
  }
}

}  // namespace dtrain
