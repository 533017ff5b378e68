#pragma once
/// @file
/// DistributedDataParallel<Model, Policy>: averages a model's gradients over
/// the ranks while the backward pass is still running. Gradients live in
/// flat buckets in the backend's memory space; the moment a bucket's last
/// gradient is marked ready its allreduce starts — on a communication thread
/// for host memory (MPI, Gloo), or on the communicator's stream after an
/// event on the compute stream for CUDA (NCCL), followed by a watchdog.
/// Metadata (model agreement, the rebuild order) goes over the host control
/// plane, never through a device engine.

#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/control.hpp>
#include <dtrain/backend/memory.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/context.hpp>
#include <dtrain/ddp/agreement.hpp>
#include <dtrain/ddp/bucket.hpp>
#include <dtrain/ddp/options.hpp>
#include <dtrain/ddp/parameter.hpp>
#include <dtrain/ddp/runner.hpp>
#include <dtrain/ddp/storage.hpp>
#include <dtrain/ddp/timeline.hpp>
#include <dtrain/error.hpp>
#include <dtrain/policy.hpp>
#include <dtrain/topology/layout.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
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

/// Data-parallel training of `Model` (anything with `parameters()`, see
/// trainable_model) over the communicator of `Policy`.
///
/// Per step: mark each parameter ready (mark_ready) as soon as its gradient
/// is final, then synchronize(); gradients then hold the mean over ranks. Not
/// thread-safe: call it from the training thread. Between mark_ready and
/// synchronize() a gradient belongs to dtrain: do not touch it.
template <class Model, class Policy>
class DistributedDataParallel {
  static_assert(
      trainable_model<Model>,
      "DistributedDataParallel<Model, Policy>: Model needs parameters() returning a range of "
      "dtrain::parameter (see dtrain::param and dtrain::device_param)");

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

  /// Collective over ctx's communicator; metadata goes over ctx's control plane
  /// where the communicator cannot carry host data (NCCL). The policy's
  /// topology groups the ranks by ctx.world()'s nodes.
  DistributedDataParallel(context<Policy>& ctx, Model& model, ddp_options options = {})
      : DistributedDataParallel(ctx.communicator(), ctx.control_plane(), model, std::move(options),
                                node_layout::of(ctx.world())) {}

  /// Collective over `comm`, which carries the metadata too (MPI, Gloo: a
  /// communicator that reaches host memory). A device-only backend (NCCL)
  /// needs the constructor with a control plane.
  /// (A template only so that an explicit instantiation of the class for NCCL
  /// does not trip the static_assert.)
  template <std::same_as<Model> M>
  DistributedDataParallel(communicator_type& comm, M& model, ddp_options options = {})
      : DistributedDataParallel(comm, nullptr, model, std::move(options), std::nullopt) {
    static_assert(std::same_as<M, Model> && communicator_type::reaches_host_memory,
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
  DistributedDataParallel(communicator_type& comm, control_plane control, Model& model,
                          ddp_options options = {})
      : DistributedDataParallel(comm, &control, model, std::move(options), std::nullopt) {}

  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// Waits for buckets still in flight (each within its timeout), then gives
  /// the model its gradients back: bucket views are copied to the model's own
  /// buffers (or set to null where it had none), since the buckets go with
  /// this object.
  ~DistributedDataParallel() {
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

  /// Marks parameter `index` (its position in model.parameters()) ready for
  /// this step. Throws dtrain::error naming it when it was marked already.
  void mark_ready(std::size_t index) {
    if (index >= params_.size()) {
      throw error("DistributedDataParallel::mark_ready: parameter #" + std::to_string(index) +
                  " does not exist on rank " + std::to_string(rank_) + " (the model has " +
                  std::to_string(params_.size()) + ")");
    }
    ready(index);
  }
  /// Marks the parameter called `name` ready.
  void mark_ready(std::string_view name) {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) {
      throw error("DistributedDataParallel::mark_ready: rank " + std::to_string(rank_) +
                  " has no parameter named '" + std::string(name) + "'");
    }
    ready(it->second);
  }
  /// Marks `p` ready, found by its values' address.
  void mark_ready(const parameter& p) {
    auto it = by_data_.find(p.values.data);
    if (it == by_data_.end()) {
      throw error("DistributedDataParallel::mark_ready: parameter '" + p.name + "' on rank " +
                  std::to_string(rank_) +
                  " is not one of the model's parameters (its values are elsewhere)");
    }
    ready(it->second);
  }
  /// Marks each of `params` ready: parameters, indices or names.
  template <std::ranges::input_range R>
  requires(!std::convertible_to<R, std::string_view>) void mark_ready(R&& params) {
    for (auto&& p : params) mark_ready(p);
  }

  /// Completes the step: launches what is left and leaves the mean over ranks
  /// in every gradient. Host memory: waits until every bucket is averaged
  /// (bounded by the collective timeout). CUDA: the host waits for nothing;
  /// the compute stream waits for the averaged gradients, and a watchdog
  /// bounds every bucket by the collective timeout (its timeout_error is
  /// thrown here or by the next call). Throws dtrain::error naming the
  /// parameters that were never marked (unless find_unused_parameters), or
  /// the engine's error. Inside no_sync() it does nothing.
  void synchronize() {
    if (no_sync_depth_ > 0) return;
    const auto span = timeline_.synchronize(steps_);
    check_usable();
    complete_marks();
    if (auto e = complete_buckets()) fail(e);
    end_step();
  }

  /// Writes the timeline (DTRAIN_TIMELINE, ddp_options::timeline) recorded so
  /// far; the destructor writes it too. Call it between steps. Throws
  /// dtrain::error naming the file and the rank when it cannot be written.
  void flush_timeline() const { timeline_.write(); }

  /// The stream the backward pass runs on (CUDA; default: the legacy default
  /// stream). Set it before a step, not between mark_ready and synchronize()
  /// (config_error): buckets launched in a step are ordered after it.
  void set_stream(stream_type compute) requires(memory_space::on_stream) {
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
  /// set_stream(compute), then synchronize().
  void synchronize(stream_type compute) requires(memory_space::on_stream) {
    if (compute != stream_ && (any_marked_ || next_launch_ > 0) && no_sync_depth_ == 0) {
      throw config_error("DistributedDataParallel::synchronize(stream) on rank " +
                         std::to_string(rank_) + " with a stream other than the one step " +
                         std::to_string(steps_) +
                         " was marked on: call set_stream(stream) before the step instead");
    }
    set_stream(compute);
    synchronize();
  }
  /// Blocks the host until every bucket launched so far has been averaged
  /// on the device (each within the collective timeout): for measuring, or
  /// before reading gradients on the host. Throws what a bucket failed with.
  void wait() {
    if (auto e = runner_drain()) fail(e);
    memory_space::synchronize(device_, stream_);
  }

  /// While alive, mark_ready only records and nothing is communicated;
  /// gradients accumulate as the caller adds into them, and the next
  /// synchronized step averages the sums.
  class no_sync_guard {
   public:
    explicit no_sync_guard(DistributedDataParallel& ddp) noexcept : ddp_(&ddp) {
      ++ddp.no_sync_depth_;
    }
    no_sync_guard(no_sync_guard&& other) noexcept : ddp_(std::exchange(other.ddp_, nullptr)) {}
    no_sync_guard(const no_sync_guard&) = delete;
    no_sync_guard& operator=(const no_sync_guard&) = delete;
    no_sync_guard& operator=(no_sync_guard&&) = delete;
    ~no_sync_guard() {
      if (ddp_) --ddp_->no_sync_depth_;
    }

   private:
    DistributedDataParallel* ddp_;
  };
  /// Gradient accumulation: `{ auto g = ddp.no_sync(); forward; backward; }`.
  [[nodiscard]] no_sync_guard no_sync() {
    if (any_marked_) {
      throw error("DistributedDataParallel::no_sync() on rank " + std::to_string(rank_) +
                  " in the middle of a synchronized step (after mark_ready, before synchronize())");
    }
    return no_sync_guard(*this);
  }

  /// Sets every gradient to zero (between steps only).
  void zero_grad() {
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

  /// Replaces the allreduce of each bucket by `hook` (all ranks must register
  /// the same). Not with gradient compression, which is itself such a reduction.
  void register_comm_hook(comm_hook hook) {
    if (options_.compression != gradient_compression::none) {
      throw config_error(
          "DistributedDataParallel::register_comm_hook: ddp_options::compression is " +
          std::string(to_string(options_.compression)) +
          "; a hook replaces the reduction, so compress inside the hook instead");
    }
    hook_ = std::move(hook);
  }

  /// The buckets, in launch order.
  [[nodiscard]] const std::vector<bucket_info>& buckets() const noexcept { return info_; }
  /// Whether the one rebuild from the observed ready order has happened.
  [[nodiscard]] bool buckets_rebuilt() const noexcept { return rebuilt_; }
  /// The parameters as dtrain sees them, gradient pointers current.
  [[nodiscard]] std::span<const parameter> parameters() const noexcept { return params_; }
  /// Synchronized steps completed.
  [[nodiscard]] std::size_t steps() const noexcept { return steps_; }
  [[nodiscard]] Model& module() noexcept { return model_; }
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
  using runner_type =
      std::conditional_t<memory_space::on_stream, detail::stream_runner<DistributedDataParallel>,
                         detail::thread_runner<DistributedDataParallel>>;
  // The control plane DDP makes for itself over its own communicator (host backends).
  using own_channel_type =
      std::conditional_t<communicator_type::reaches_host_memory,
                         communicator_channel<communicator_type>, std::monostate>;

  DistributedDataParallel(communicator_type& comm, control_plane control, Model& model,
                          ddp_options options, std::optional<node_layout> layout)
      : DistributedDataParallel(comm, &control, model, std::move(options), layout) {}

  DistributedDataParallel(communicator_type& comm, control_plane* given, Model& model,
                          ddp_options options, std::optional<node_layout> layout)
      : comm_(comm.split(0, comm.rank())),
        own_channel_(make_own_channel()),
        control_(control_for(given)),
        topo_(comm_, control_, layout_of(layout)),
        model_(model),
        options_(std::move(options)),
        rank_(comm.rank()),
        size_(comm.size()) {
    for (auto&& p : model.parameters()) params_.push_back(static_cast<parameter>(p));
    if constexpr (model_with_buffers<Model>) {
      for (auto&& b : model.buffers()) buffers_.push_back(static_cast<parameter>(b));
    }
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

  own_channel_type make_own_channel() {
    if constexpr (communicator_type::reaches_host_memory) {
      return own_channel_type(comm_);
    } else {
      return {};
    }
  }
  // A communicator that reaches host memory carries the metadata itself (no
  // store traffic, and packed host values of any size); a device-only one uses `given`.
  control_plane control_for([[maybe_unused]] control_plane* given) {
    if constexpr (communicator_type::reaches_host_memory) {
      return control_plane(own_channel_);
    } else {
      return *given;  // the constructors without one do not compile for such a communicator
    }
  }

  // The nodes as the launcher placed them, or (no context) as node names group them.
  node_layout layout_of(const std::optional<node_layout>& given) {
    if constexpr (std::is_same_v<typename Policy::topology_type, topology::flat>) {
      return given.value_or(node_layout{});  // flat needs none: nothing collective
    } else {
      if (given) return *given;
      return detail::layout_from_node_names(control_, node_name(environment::from_process()));
    }
  }

  static int device_of(communicator_type& comm) {
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
  void lay_out(std::span<const std::size_t> order) {
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
      buckets[b].grads = detail::flat_storage<memory_space>(
          buckets[b].moved * size_of(info[b].type), info[b].device, stream_);
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

  bool compressed(const bucket_info& b) const noexcept {
    return options_.compression != gradient_compression::none && b.type == dtype::float32;
  }

  void ready(std::size_t i) {
    check_usable();
    variable& v = vars_[i];
    const auto span = timeline_.mark_ready(i, v.bucket);
    if (no_sync_depth_ > 0) {
      v.touched = true;
      return;
    }
    if (v.marked) {
      throw error("DistributedDataParallel::mark_ready: parameter '" + params_[i].name + "' (#" +
                  std::to_string(i) + ") was marked ready twice in step " + std::to_string(steps_) +
                  " on rank " + std::to_string(rank_) +
                  "; mark each gradient once per step (accumulate inside no_sync())");
    }
    v.marked = v.touched = true;
    any_marked_ = true;
    if (recording()) ready_order_.push_back(i);
    bucket_state& b = buckets_[v.bucket];
    if (--b.pending == 0) {
      b.ready = true;
      if (options_.overlap) launch_ready();
    }
  }

  bool recording() const noexcept { return options_.rebuild_buckets && !rebuilt_ && steps_ == 0; }

  /// Launches, in bucket order, every bucket whose turn it is and is ready.
  void launch_ready() {
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready) {
      try {
        buckets_[next_launch_].span =
            timeline_.bucket_launched(next_launch_, info_[next_launch_].count);
        runner_->launch(next_launch_++);
      } catch (...) {
        fail(std::current_exception());
      }
    }
  }

  /// The unmarked parameters of this step: an error, or (find_unused_parameters)
  /// zero contributions, marked now in index order on every rank.
  void complete_marks() {
    std::vector<std::size_t> missing;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!vars_[i].marked) missing.push_back(i);
    }
    if (!missing.empty() && !options_.find_unused_parameters) {
      std::string names;
      for (std::size_t k = 0; k < missing.size() && k < 8; ++k)
        names += (k ? ", '" : "'") + params_[missing[k]].name + "'";
      if (missing.size() > 8) names += " and " + std::to_string(missing.size() - 8) + " more";
      throw error(
          "DistributedDataParallel::synchronize: rank " + std::to_string(rank_) + " never marked " +
          std::to_string(missing.size()) + " of " + std::to_string(params_.size()) +
          " parameters ready in step " + std::to_string(steps_) + ": " + names +
          "; call mark_ready for every parameter, or set ddp_options::find_unused_parameters");
    }
    for (std::size_t i : missing) {
      // Nothing accumulated in no_sync() either: this rank contributes zero.
      if (!vars_[i].touched) zero_contribution(i);
      ready(i);
    }
    for (bucket_state& b : buckets_) b.ready = true;
    launch_ready();
  }

  void zero_contribution(std::size_t i) {
    parameter& p = params_[i];
    variable& v = vars_[i];
    if (v.view) {
      memory_space::zero(p.gradient, p.bytes(), p.device, stream_);
    } else {
      // Copy-mode: the bucket's slice is what travels; the model's buffer gets the mean after.
      memory_space::zero(buckets_[v.bucket].grads.data() + v.offset, p.bytes(), p.device, stream_);
      v.zeroed = true;
    }
  }

  // The runner's steps (detail::thread_runner, detail::stream_runner).

  /// Copy-in and compression: what must happen before the collective.
  void prepare_bucket(std::size_t b) {
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
  work reduce(std::size_t b) {
    detail::label_scope label("bucket", static_cast<std::int64_t>(b));  // names it in desync diagnostics
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

  // The compute stream for engines that order after it; null for host memory.
  stream_handle on_stream_or_null() const noexcept {
    if constexpr (memory_space::on_stream) {
      return stream_;
    } else {
      return nullptr;
    }
  }

  /// Decompression and copy-out: what must happen after the collective.
  void finish_bucket(std::size_t b) {
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

  /// Streams: the compute stream waits (on the device) for every collective so far.
  void order_after_buckets() {
    if constexpr (memory_space::on_stream) topo_.stream_wait(stream_);
  }

  std::exception_ptr complete_buckets() {
    const auto span = timeline_.wait(buckets_.size());
    return runner_->complete(buckets_.size());
  }

  std::exception_ptr runner_drain() {
    if constexpr (memory_space::on_stream) {
      return runner_->drain();
    } else {
      return nullptr;  // synchronize() waited already
    }
  }

  /// After every bucket is averaged: the one rebuild, then a fresh step.
  void end_step() {
    const bool rebuild = recording();
    ++steps_;
    if (rebuild) {
      // Rank 0's order wins, so that every rank lays its buckets out alike.
      std::vector<std::uint8_t> bytes(ready_order_.size() * sizeof(std::uint64_t));
      for (std::size_t k = 0; k < ready_order_.size(); ++k) {
        const std::uint64_t i = ready_order_[k];
        std::memcpy(bytes.data() + k * sizeof i, &i, sizeof i);
      }
      control_.broadcast(bytes, 0);
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
  std::vector<std::size_t> layout_order() const {
    std::vector<std::size_t> order;
    for (const bucket_info& b : info_)
      order.insert(order.end(), b.parameters.begin(), b.parameters.end());
    return order;
  }

  void reset_step() {
    for (variable& v : vars_) v.marked = v.touched = v.zeroed = false;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      buckets_[b].pending = info_[b].parameters.size();
      buckets_[b].ready = false;
    }
    ready_order_.clear();
    next_launch_ = 0;
    any_marked_ = false;
  }

  void check_usable() const {
    if (broken_) {
      throw error("DistributedDataParallel on rank " + std::to_string(rank_) +
                  " is unusable after an earlier failure: " + broken_message_);
    }
  }

  [[noreturn]] void fail(std::exception_ptr e) {
    broken_ = true;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      broken_message_ = x.what();
      throw;
    }
  }

  // A communicator of its own (a split of the user's), so that collectives the
  // user issues during a step cannot interleave with the buckets' differently on different ranks.
  communicator_type comm_;
  own_channel_type own_channel_;
  control_plane control_;
  topology_group topo_;  // after control_: made over it
  Model& model_;
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
  bool broken_ = false;
  std::string broken_message_;
  comm_hook hook_;
  stream_type stream_ = nullptr;
  detail::timeline timeline_;          // off unless DTRAIN_TIMELINE or options_.timeline
  std::optional<runner_type> runner_;  // last: it calls back into everything above
};

}  // namespace dtrain
