#pragma once
/// @file
/// DistributedDataParallel<Model, Policy>: averages a model's gradients over
/// the ranks while the backward pass is still running. Gradients live in
/// flat buckets; the moment a bucket's last gradient is marked ready its
/// allreduce starts — on the NCCL stream after an event on the compute
/// stream, or on a communication thread for the host engines (MPI, Gloo).

#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/cuda.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/context.hpp>
#include <dtrain/ddp/agreement.hpp>
#include <dtrain/ddp/bucket.hpp>
#include <dtrain/ddp/options.hpp>
#include <dtrain/ddp/parameter.hpp>
#include <dtrain/ddp/storage.hpp>
#include <dtrain/error.hpp>
#include <dtrain/policy.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
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
  /// A user reduction: must leave the mean over ranks in `bucket.data` once
  /// the returned work completes (e.g. `return comm.allreduce(b.data, b.data, reduce_op::avg);`).
  using comm_hook = std::function<work(communicator_type&, gradient_bucket&)>;
  static constexpr bool on_device = std::is_same_v<typename Policy::backend_type, backend::nccl>;

  /// Collective over ctx's communicator; see the other constructor.
  DistributedDataParallel(context<Policy>& ctx, Model& model, ddp_options options = {})
      : DistributedDataParallel(ctx.communicator(), model, std::move(options)) {}

  /// Collective: checks that every rank holds the same parameters (names,
  /// counts, types; config_error naming the first difference and the ranks),
  /// copies rank 0's values to all, lays the gradients out in buckets and,
  /// for MPI and Gloo, starts the communication thread. Buckets travel on a
  /// split of `comm` of their own: the caller may use `comm` at any time.
  DistributedDataParallel(communicator_type& comm, Model& model, ddp_options options = {})
      : comm_(comm.split(0, comm.rank())),
        model_(model),
        options_(std::move(options)),
        rank_(comm.rank()),
        size_(comm.size()) {
    for (auto&& p : model.parameters()) params_.push_back(static_cast<parameter>(p));
    if constexpr (model_with_buffers<Model>) {
      for (auto&& b : model.buffers()) buffers_.push_back(static_cast<parameter>(b));
    }
    detail::agree_on_model(
        comm_, params_, buffers_,
        detail::model_problem(params_, buffers_, options_, rank_, communicator_type::name,
                              on_device, device_of_communicator()));
    if (options_.broadcast_parameters) detail::broadcast_values(comm_, params_, buffers_);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      by_name_.emplace(params_[i].name, i);
      by_data_.emplace(params_[i].values.data, i);
      original_.push_back(params_[i].gradient);
    }
    marked_.assign(params_.size(), 0);
    touched_.assign(params_.size(), 0);
    lay_out(detail::reverse_order(params_.size()));
#if DTRAIN_HAS_CUDA()
    // The buckets were filled on the legacy default stream; the user's stream may not wait for it.
    if constexpr (on_device) DTRAIN_CUDA_CHECK(cudaStreamSynchronize(nullptr));
#endif
    if constexpr (!on_device) thread_ = std::thread([this] { serve(); });
  }

  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// Waits for buckets still in flight, then gives the model its gradients
  /// back: bucket views are copied to the model's own buffers (or set to null
  /// where it had none), since the buckets go with this object.
  ~DistributedDataParallel() {
    if constexpr (!on_device) {
      {
        std::lock_guard lock(mutex_);
        stopping_ = true;
      }
      wake_.notify_all();
      thread_.join();
    }
    try {
      for (std::size_t i = 0; i < params_.size(); ++i) {
        if (!slots_[i].view) continue;
        parameter& p = params_[i];
        // The legacy default stream: the user's own stream may be gone already.
        if (original_[i])
          detail::copy_bytes(original_[i], p.gradient, p.bytes(), p.device, nullptr);
        p.rebind(p.gradient_slot, original_[i]);
      }
#if DTRAIN_HAS_CUDA()
      if constexpr (on_device) (void)cudaStreamSynchronize(nullptr);
#endif
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

  /// Completes the step: launches what is left, waits until every bucket is
  /// averaged (bounded by the collective timeout), and leaves the mean over
  /// ranks in every gradient. Throws dtrain::error naming the parameters that
  /// were never marked (unless find_unused_parameters), or the engine's error.
  /// Inside no_sync() it does nothing. NCCL: the host waits for nothing; the
  /// compute stream (set_stream) waits for the averaged gradients.
  void synchronize() {
    if (no_sync_depth_ > 0) return;
    check_usable();
    complete_marks();
    if constexpr (on_device) {
#if DTRAIN_HAS_CUDA()
      comm_.stream_wait(stream_);
      for (std::size_t b = 0; b < buckets_.size(); ++b) finish_bucket(b);
      for (bucket_state& b : buckets_) {
        if (b.handle.test()) {
          if (auto e = b.handle.exception()) fail(e);
        }
      }
#endif
    } else {
      std::unique_lock lock(mutex_);
      done_wake_.wait(lock, [&] { return done_ == buckets_.size(); });
      if (failure_) {
        auto e = failure_;
        lock.unlock();
        fail(e);
      }
    }
    end_step();
  }

#if DTRAIN_HAS_CUDA()
  /// NCCL: the stream the backward pass runs on (default: the legacy default
  /// stream). Buckets are ordered after the work on it when they are
  /// launched; synchronize() makes it wait for the averaged gradients.
  void set_stream(cudaStream_t compute) { stream_ = compute; }
  /// set_stream(compute), then synchronize().
  void synchronize(cudaStream_t compute) {
    stream_ = compute;
    synchronize();
  }
#endif

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
      detail::zero_bytes(b.grads.data(), b.grads.bytes(), b.grads.device(), stream_);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!slots_[i].view)
        detail::zero_bytes(params_[i].gradient, params_[i].bytes(), params_[i].device, stream_);
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

 private:
  struct slot {
    std::size_t bucket = 0;
    std::size_t offset = 0;  // bytes into the bucket
    bool view = false;       // the gradient lives in the bucket
  };
  struct bucket_state {
    detail::flat_storage grads;
    detail::flat_storage wire;  // the 16-bit copy, with compression
    std::size_t pending = 0;    // parameters not yet marked this step
    bool ready = false;
    work handle;
  };

  int device_of_communicator() const {
    if constexpr (on_device) return comm_.device();
    return -1;
  }

  /// Lays the gradients out in buckets filled in `order`, moving each
  /// bucket-view gradient (and its values) to its new place.
  void lay_out(std::span<const std::size_t> order) {
    std::vector<bucket_info> info = detail::assign_buckets(
        params_, order, mib_to_bytes(options_.first_bucket_cap_mb, "first_bucket_cap_mb"),
        mib_to_bytes(options_.bucket_cap_mb, "bucket_cap_mb"));
    std::vector<bucket_state> buckets(info.size());
    std::vector<slot> slots(params_.size());
    for (std::size_t b = 0; b < info.size(); ++b) {
      buckets[b].grads = detail::flat_storage(info[b].bytes, info[b].device);
      if (compressed(info[b]))
        buckets[b].wire = detail::flat_storage(
            info[b].count * size_of(detail::wire_type(options_.compression)), info[b].device);
      std::size_t offset = 0;
      for (std::size_t i : info[b].parameters) {
        parameter& p = params_[i];
        slots[i] = {b, offset, options_.gradient_as_bucket_view && p.rebindable()};
        if (slots[i].view) {
          void* place = buckets[b].grads.data() + offset;
          if (p.gradient) detail::copy_bytes(place, p.gradient, p.bytes(), p.device, stream_);
          p.gradient = place;
          p.rebind(p.gradient_slot, place);
        }
        offset += p.bytes();
      }
    }
    info_ = std::move(info);
    buckets_ = std::move(buckets);  // frees the old buckets (cudaFree waits for the copies)
    slots_ = std::move(slots);
    reset_step();
  }

  bool compressed(const bucket_info& b) const noexcept {
    return options_.compression != gradient_compression::none && b.type == dtype::float32;
  }

  void ready(std::size_t i) {
    check_usable();
    if (no_sync_depth_ > 0) {
      touched_[i] = 1;
      return;
    }
    if (marked_[i]) {
      throw error("DistributedDataParallel::mark_ready: parameter '" + params_[i].name + "' (#" +
                  std::to_string(i) + ") was marked ready twice in step " + std::to_string(steps_) +
                  " on rank " + std::to_string(rank_) +
                  "; mark each gradient once per step (accumulate inside no_sync())");
    }
    marked_[i] = touched_[i] = 1;
    any_marked_ = true;
    if (recording()) ready_order_.push_back(i);
    bucket_state& b = buckets_[slots_[i].bucket];
    if (--b.pending == 0) {
      b.ready = true;
      if (options_.overlap) launch_ready();
    }
  }

  bool recording() const noexcept { return options_.rebuild_buckets && !rebuilt_ && steps_ == 0; }

  /// Launches, in bucket order, every bucket whose turn it is and is ready.
  void launch_ready() {
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready) launch(next_launch_++);
  }

  /// The unmarked parameters of this step: an error, or (find_unused_parameters)
  /// zero contributions, marked now in index order on every rank.
  void complete_marks() {
    std::vector<std::size_t> missing;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!marked_[i]) missing.push_back(i);
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
      if (!touched_[i]) zero_contribution(i);
      ready(i);
    }
    for (bucket_state& b : buckets_) b.ready = true;
    launch_ready();
  }

  void zero_contribution(std::size_t i) {
    parameter& p = params_[i];
    if (slots_[i].view) {
      detail::zero_bytes(p.gradient, p.bytes(), p.device, stream_);
    } else {
      // Copy-mode: the bucket's slice is what travels; the model's buffer gets the mean after.
      detail::zero_bytes(buckets_[slots_[i].bucket].grads.data() + slots_[i].offset, p.bytes(),
                         p.device, stream_);
      skip_copy_in_[i] = 1;
    }
  }

  /// Starts bucket b's reduction: a queue entry for the communication thread,
  /// or (NCCL) the collective itself, ordered after the compute stream.
  void launch(std::size_t b) {
    if constexpr (on_device) {
      prepare_bucket(b);
      buckets_[b].handle = reduce(b);
    } else {
      {
        std::lock_guard lock(mutex_);
        queue_.push_back(b);
      }
      wake_.notify_one();
    }
  }

  /// Copy-in and compression: what must happen before the collective.
  void prepare_bucket(std::size_t b) {
    bucket_state& s = buckets_[b];
    for (std::size_t i : info_[b].parameters) {
      if (slots_[i].view || skip_copy_in_[i]) continue;
      detail::copy_bytes(s.grads.data() + slots_[i].offset, params_[i].gradient, params_[i].bytes(),
                         info_[b].device, stream_);
    }
    if (!compressed(info_[b])) return;
    const float scale = 1.0f / static_cast<float>(size_);  // pre-divide: the sum is the mean
    detail::compress(s.wire.data(), reinterpret_cast<const float*>(s.grads.data()), info_[b].count,
                     scale, options_.compression, info_[b].device, stream_);
  }

  /// The collective of bucket b (or the user's hook).
  work reduce(std::size_t b) {
    bucket_state& s = buckets_[b];
    const bucket_info& info = info_[b];
    const memory where = info.device < 0 ? memory::host : memory::device;
    buffer data{s.grads.data(), info.count, info.type, where};
    reduce_op op = reduce_op::avg;
    if (compressed(info)) {
      data = {s.wire.data(), info.count, detail::wire_type(options_.compression), where};
      op = reduce_op::sum;
    }
    if (hook_) {
      gradient_bucket view{
          .index = b, .data = data, .world_size = size_, .parameters = info.parameters};
#if DTRAIN_HAS_CUDA()
      view.stream = stream_;
#endif
      return hook_(comm_, view);
    }
    if constexpr (on_device) {
      return comm_.allreduce(data, data, op, stream_);
    } else {
      return comm_.allreduce(data, data, op);
    }
  }

  /// Decompression and copy-out: what must happen after the collective.
  void finish_bucket(std::size_t b) {
    bucket_state& s = buckets_[b];
    const bucket_info& info = info_[b];
    if (compressed(info)) {
      detail::decompress(reinterpret_cast<float*>(s.grads.data()), s.wire.data(), info.count,
                         options_.compression, info.device, stream_);
    }
    for (std::size_t i : info.parameters) {
      if (slots_[i].view) continue;
      detail::copy_bytes(params_[i].gradient, s.grads.data() + slots_[i].offset, params_[i].bytes(),
                         info.device, stream_);
    }
  }

  /// The communication thread (MPI, Gloo): reduces buckets in launch order.
  void serve() {
    for (;;) {
      std::size_t b = 0;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and nothing left in flight
        b = queue_.front();
        queue_.pop_front();
        if (failure_) {  // the communicator failed already: do not wait for it again
          ++done_;
          done_wake_.notify_all();
          continue;
        }
      }
      std::exception_ptr failed;
      try {
        prepare_bucket(b);
        work w = reduce(b);
        w.wait();  // bounded by the collective timeout
        finish_bucket(b);
      } catch (...) {
        failed = std::current_exception();
      }
      {
        std::lock_guard lock(mutex_);
        if (failed && !failure_) failure_ = failed;
        ++done_;
      }
      done_wake_.notify_all();
    }
  }

  /// After every bucket is averaged: the one rebuild, then a fresh step.
  void end_step() {
    const bool rebuild = recording();
    ++steps_;
    if (rebuild) {
      // Rank 0's order wins, so that every rank lays its buckets out alike.
      std::vector<std::int64_t> order(ready_order_.begin(), ready_order_.end());
      broadcast(comm_, std::span<std::int64_t>(order), 0).wait();
      std::vector<std::size_t> agreed(order.begin(), order.end());
      detail::check_order(agreed, params_.size(),
                          "rank 0's ready order (sent to rank " + std::to_string(rank_) + ")");
      rebuilt_ = true;
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
    std::fill(marked_.begin(), marked_.end(), 0);
    std::fill(touched_.begin(), touched_.end(), 0);
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      buckets_[b].pending = info_[b].parameters.size();
      buckets_[b].ready = false;
      buckets_[b].handle = work();
    }
    ready_order_.clear();
    skip_copy_in_.assign(params_.size(), 0);
    next_launch_ = 0;
    any_marked_ = false;
    std::lock_guard lock(mutex_);
    done_ = 0;
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
  Model& model_;
  ddp_options options_;
  int rank_;
  int size_;
  std::vector<parameter> params_;
  std::vector<parameter> buffers_;
  std::vector<void*> original_;  // the model's own gradient pointers, given back at the end
  std::unordered_map<std::string_view, std::size_t> by_name_;
  std::unordered_map<const void*, std::size_t> by_data_;
  std::vector<bucket_info> info_;
  std::vector<bucket_state> buckets_;
  std::vector<slot> slots_;
  std::vector<char> marked_;   // this step
  std::vector<char> touched_;  // since the last synchronized step, no_sync() micro-steps included
  std::vector<std::size_t> ready_order_;
  std::vector<char>
      skip_copy_in_;  // zeroed unused copy-mode slices (the thread reads its bucket's only)
  std::size_t next_launch_ = 0;
  std::size_t steps_ = 0;
  bool rebuilt_ = false;
  bool any_marked_ = false;
  int no_sync_depth_ = 0;
  bool broken_ = false;
  std::string broken_message_;
  comm_hook hook_;
  detail::compute_stream stream_ = nullptr;
  // The communication thread (MPI, Gloo) and what it shares with the caller.
  std::mutex mutex_;
  std::condition_variable wake_;       // work for the thread, or stop
  std::condition_variable done_wake_;  // a bucket finished
  std::deque<std::size_t> queue_;
  std::size_t done_ = 0;
  bool stopping_ = false;
  std::exception_ptr failure_;
  std::thread thread_;
};

}  // namespace dtrain
