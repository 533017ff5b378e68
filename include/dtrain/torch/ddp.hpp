#pragma once
/// @file
/// dtrain::torch::DistributedDataParallel: a LibTorch module (torch::nn::Module)
/// made data-parallel in one line, with autograd itself marking gradients ready.
///
/// It is basic_ddp<Policy> (ddp/basic_ddp.hpp) fed from the module:
/// - the parameters that require a gradient come from named_parameters(); the
///   frozen ones and named_buffers() are state to agree on; names, shapes,
///   types and devices are checked across ranks, and rank 0's values broadcast;
/// - each parameter's gradient accumulator gets a post-hook (as c10d's Reducer
///   does) that marks it ready, so buckets are reduced during backward(); once
///   every parameter is ready, an autograd final callback completes the step,
///   so that backward() returns with averaged gradients, as in PyTorch;
/// - each parameter's .grad() is a tensor over dtrain's bucket storage (no copy
///   in or out); a gradient the optimizer dropped (zero_grad with set_to_none)
///   or the user replaced is copied into the bucket when autograd next writes it;
/// - with find_unused_parameters, forward() walks the autograd graph from the
///   outputs, as PyTorch does; the parameters it cannot reach are marked ready
///   (zero contributions) when backward() begins; after the step a parameter
///   that no rank used keeps the .grad() it had (undefined when it had none),
///   as in PyTorch.
///
/// CPU tensors go over Gloo or MPI; CUDA tensors over NCCL, ordered after the
/// current CUDA stream (which needs a LibTorch built with CUDA, and nvcc or
/// DTRAIN_WITH_NCCL for dtrain).

#include <dtrain/dtrain.hpp>
#include <dtrain/torch/tensor.hpp>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>
// CUDA tensors: the current stream comes from LibTorch's CUDA headers, which
// a CPU-only LibTorch lacks or ships incomplete (Debian's libtorch-dev).
#if DTRAIN_HAS_CUDA() && __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#include <c10/cuda/CUDAStream.h>
#define DTRAIN_TORCH_CUDA() 1
#else
#define DTRAIN_TORCH_CUDA() 0
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

namespace dtrain::torch {

/// What dtrain::torch::DistributedDataParallel adds to ddp_options.
struct module_options {
  /// PyTorch DDP's broadcast_buffers: every forward() through the wrapper
  /// (with gradients enabled) first copies rank 0's named_buffers() (batch-norm
  /// running statistics) to every rank. Construction copies them, and the
  /// frozen parameters, anyway (ddp_options::broadcast_parameters).
  bool broadcast_buffers = true;
};

namespace detail {

/// The post-hook on a gradient accumulator: once autograd has written the
/// parameter's gradient, it is ready.
template <class Owner>
class ready_hook final : public ::torch::autograd::FunctionPostHook {
 public:
  ready_hook(Owner* owner, std::size_t index) noexcept : owner_(owner), index_(index) {}
  ::torch::autograd::variable_list operator()(
      const ::torch::autograd::variable_list& outputs,
      const ::torch::autograd::variable_list& /*inputs*/) override {
    owner_->gradient_written(index_);
    return outputs;
  }

 private:
  Owner* owner_;
  std::size_t index_;
};

inline void collect_outputs(const ::torch::Tensor& t, std::vector<::torch::Tensor>& out) {
  out.push_back(t);
}
inline void collect_outputs(const std::vector<::torch::Tensor>& ts,
                            std::vector<::torch::Tensor>& out) {
  out.insert(out.end(), ts.begin(), ts.end());
}
template <class... T>
void collect_outputs(const std::tuple<T...>& t, std::vector<::torch::Tensor>& out) {
  std::apply([&](const auto&... each) { (collect_outputs(each, out), ...); }, t);
}
template <class T>
void collect_outputs(const T&, std::vector<::torch::Tensor>&) {}  // not a tensor: nothing to walk

}  // namespace detail

/// A LibTorch module (a ModuleHolder such as `Net`, `torch::nn::Sequential`,
/// or a std::shared_ptr to a module) trained data-parallel over the
/// communicator of `Policy`. Not movable: autograd's hooks point at it.
///
/// Per step, as with PyTorch's DDP: `ddp(x)`, then backward(), which returns
/// once every .grad() holds the mean over ranks; then the optimizer.
/// `ddp->forward(x)` calls the module alone (no buffer broadcast, no graph
/// walk for find_unused_parameters). synchronize() completes a step that
/// backward() could not: one with parameters that got no gradient.
template <class Policy, class Module>
class DistributedDataParallel {
  static_assert(!std::is_base_of_v<::torch::nn::Module, Module>,
                "dtrain::torch::DistributedDataParallel: pass the module holder (a TORCH_MODULE "
                "type such as `Net`) or a std::shared_ptr to the module, not the module itself "
                "(it would be copied)");
  using core_type = basic_ddp<Policy>;

 public:
  using communicator_type = typename Policy::communicator_type;
  using memory_space = typename Policy::memory_space;
  static constexpr bool on_device = core_type::on_device;

  /// Collective over ctx's communicator: checks that every rank holds the
  /// same module (config_error naming the first parameter that differs),
  /// copies rank 0's parameters and buffers to every rank, lays the
  /// gradients out in buckets and hooks every parameter's gradient accumulator.
  template <ddp_context<Policy> Context>
  DistributedDataParallel(Context& ctx, Module module, ddp_options options = {},
                          module_options extra = {})
      : module_(std::move(module)),
        extra_(extra),
        find_unused_(options.find_unused_parameters),
        comm_(ctx.communicator().split(0, ctx.communicator().rank())),
        rank_(ctx.communicator().rank()),
        size_(ctx.communicator().size()) {
    std::vector<parameter> params;
    std::vector<parameter> buffers;
    std::string problem;
    if (!options.gradient_as_bucket_view) {
      problem =
          "dtrain::torch::DistributedDataParallel on rank " + std::to_string(rank_) +
          ": ddp_options::gradient_as_bucket_view = false is not supported; every .grad() is a "
          "view of dtrain's bucket storage (no copies), and stays one after synchronize()";
    } else {
      try {
        collect(params, buffers);
      } catch (const config_error& e) {
        problem = e.what();
      }
    }
    // A module this rank cannot take stops every rank, each with a message (not only this one,
    // leaving the others to find it gone), over the control plane basic_ddp agrees on next.
    control_plane control = ctx.control_plane();
    dtrain::detail::agree_on_model(control, {}, {}, problem);
    stream_type stream = current_stream();
    // basic_ddp's report names parameters nobody marked, against a forgotten
    // mark_ready; autograd marks here, and PyTorch reports nothing either.
    options.report_unused_parameters = false;
    core_.emplace(ctx, std::move(params), std::move(buffers), std::move(options));
    if constexpr (memory_space::on_stream) core_->set_stream(stream);
    check_slots("laying the gradients out");
    hook();
  }

  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// Removes the hooks; then basic_ddp gives the gradients back (a .grad()
  /// the module had is restored with the current values, one it lacked
  /// becomes a tensor of its own).
  ~DistributedDataParallel() {
    for (slot_state& s : slots_) {
      if (s.accumulator) s.accumulator->del_post_hook(s.hook_key);
    }
  }

  /// The module: `ddp->forward(x)`, `ddp->parameters()`.
  [[nodiscard]] auto* operator->() noexcept { return &*module_; }
  [[nodiscard]] const auto* operator->() const noexcept { return &*module_; }
  [[nodiscard]] Module& module() noexcept { return module_; }

  /// PyTorch's `ddp(x)`: the module's forward(), preceded by the buffer
  /// broadcast (module_options::broadcast_buffers) and followed, with
  /// find_unused_parameters, by the walk of the autograd graph from the
  /// outputs (tensors, vectors and tuples of them) that finds the
  /// parameters it does not reach: they are ready as soon as backward()
  /// begins. Throws dtrain::error naming the parameters that got no
  /// gradient when the previous step was left incomplete.
  template <class... Args>
  decltype(auto) forward(Args&&... args) {
    before_forward();
    decltype(auto) out = module_->forward(std::forward<Args>(args)...);
    if (find_unused_ && no_sync_depth_ == 0 && ::torch::GradMode::is_enabled()) {
      std::vector<::torch::Tensor> outputs;
      detail::collect_outputs(out, outputs);
      if (!outputs.empty()) prepare_for_backward(outputs);
    }
    return out;
  }
  template <class... Args>
  decltype(auto) operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  /// With find_unused_parameters: every parameter that the graph behind
  /// `outputs` does not reach is marked ready (with a zero contribution) when
  /// backward() begins. forward() calls it; call it yourself after
  /// `ddp->forward(x)` when the outputs are of another shape. The last call
  /// before backward() counts, as in PyTorch.
  void prepare_for_backward(const std::vector<::torch::Tensor>& outputs) {
    std::unordered_set<const ::torch::autograd::Node*> seen;
    std::vector<::torch::autograd::Node*> stack;
    for (const ::torch::Tensor& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      if (::torch::autograd::Node* fn = t.grad_fn().get()) {
        if (seen.insert(fn).second) stack.push_back(fn);
      } else if (const auto acc = ::torch::autograd::impl::try_get_grad_accumulator(t)) {
        seen.insert(acc.get());  // an output that is a parameter itself: used
      }
    }
    while (!stack.empty()) {
      ::torch::autograd::Node* node = stack.back();
      stack.pop_back();
      for (const ::torch::autograd::Edge& edge : node->next_edges()) {
        if (edge.function && seen.insert(edge.function.get()).second)
          stack.push_back(edge.function.get());
      }
    }
    const std::lock_guard lock(mutex_);
    for (slot_state& s : slots_) s.walked_unused = !seen.contains(s.accumulator.get());
  }

  /// Completes the step, if backward() has not: every .grad() then holds
  /// the mean over ranks (CUDA: on the current stream). backward() completes
  /// every step in which each parameter got a gradient or was found unused
  /// by ddp(x)'s graph walk; what is left for synchronize() is a step with
  /// parameters that got none: with find_unused_parameters they contribute
  /// zero (after `ddp->forward(x)`, which does not walk the graph), without
  /// it they are a dtrain::error naming them. Does nothing inside no_sync()
  /// or after a step that backward() completed. Throws the engine's error.
  void synchronize() {
    const std::lock_guard lock(mutex_);
    if (no_sync_depth_ > 0 || completed_) return;
    if (!find_unused_ && unready_ > 0) {
      throw error(no_gradient_message("synchronize() cannot complete it without zeros for them"));
    }
    complete_step();
  }

  /// Gradient accumulation: `{ auto g = ddp.no_sync(); loss(ddp(x)).backward(); }`;
  /// the next synchronized step averages the sums. Made only by no_sync(),
  /// which refuses to start one while a step is not complete.
  class no_sync_guard {
   public:
    no_sync_guard(no_sync_guard&& other) noexcept
        : core_(std::move(other.core_)), depth_(std::exchange(other.depth_, nullptr)) {}
    no_sync_guard(const no_sync_guard&) = delete;
    no_sync_guard& operator=(const no_sync_guard&) = delete;
    no_sync_guard& operator=(no_sync_guard&&) = delete;
    ~no_sync_guard() {
      if (depth_) --*depth_;
    }

   private:
    friend class DistributedDataParallel;
    explicit no_sync_guard(DistributedDataParallel& ddp)
        : core_((ddp.check_step_closed("no_sync() was called"), ddp.core_->no_sync())),
          depth_(&ddp.no_sync_depth_) {
      ++*depth_;
    }
    typename core_type::no_sync_guard core_;
    int* depth_;
  };
  [[nodiscard]] no_sync_guard no_sync() { return no_sync_guard(*this); }

  /// Zeroes every gradient in place (the bucket storage): no tensor is
  /// dropped, so no copy is needed in the next backward().
  void zero_grad() {
    const std::lock_guard lock(mutex_);
    check_step_closed("zero_grad() was called");
    core_->zero_grad();
  }

  /// Replaces the allreduce of each bucket (see basic_ddp::register_comm_hook).
  void register_comm_hook(typename core_type::comm_hook hook) {
    core_->register_comm_hook(std::move(hook));
  }

  /// The buckets, the rebuild, the parameter names in dtrain's order, the
  /// communicator: what basic_ddp tells.
  [[nodiscard]] const core_type& core() const noexcept { return *core_; }
  [[nodiscard]] core_type& core() noexcept { return *core_; }
  [[nodiscard]] const std::vector<bucket_info>& buckets() const noexcept {
    return core_->buckets();
  }
  [[nodiscard]] std::size_t steps() const noexcept { return core_->steps(); }
  /// Writes the timeline (DTRAIN_TIMELINE, ddp_options::timeline) so far.
  void flush_timeline() const { core_->flush_timeline(); }

  // For detail::ready_hook: runs on an autograd thread (the caller's for CPU
  // tensors, the device's own for CUDA), once autograd wrote parameter i's gradient.
  void gradient_written(std::size_t i) {
    const std::lock_guard lock(mutex_);
    slot_state& s = slots_[i];
    if (s.walked_unused) {
      throw error("dtrain::torch::DistributedDataParallel on rank " + std::to_string(rank_) +
                  ": autograd wrote the gradient of parameter '" + name_of(i) +
                  "', which the graph walk after ddp(x) found unused in this step (and sent as "
                  "zero); with find_unused_parameters, a parameter that gets a gradient must be "
                  "reached from the outputs of the last ddp(x) before backward()");
    }
    if (s.ready && no_sync_depth_ == 0) {
      // A gradient for the next step: this one was never completed.
      throw error(no_gradient_message("autograd wrote the gradient of '" + name_of(i) +
                                      "' for the next one"));
    }
    expose(i, true);
    s.touched = true;
    completed_ = false;
    if (no_sync_depth_ > 0) {
      core_->mark_ready(i);  // recorded as accumulated; nothing is sent
      return;
    }
    if (!step_open()) {
      // As c10d's Reducer: what the graph walk found unused is ready once backward() begins.
      for (std::size_t k = 0; k < slots_.size(); ++k) {
        slot_state& unused = slots_[k];
        if (!unused.walked_unused || unused.ready) continue;
        // Contributes zero, or what it accumulated in no_sync().
        if (!unused.touched) unused.gradient.view().zero_();
        ready(k);
      }
    }
    ready(i);
    if (unready_ == 0) {
      // Every parameter is ready: the step completes as backward() ends, as in PyTorch.
      ::torch::autograd::Engine::get_default_engine().queue_callback([this] {
        const std::lock_guard callback_lock(mutex_);
        complete_step();
      });
    }
  }

 private:
  using stream_type = typename memory_space::stream_type;

  static stream_type current_stream([[maybe_unused]] int device = -1) {
    if constexpr (memory_space::on_stream) {
#if DTRAIN_TORCH_CUDA()
      return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#else
      static_assert(!memory_space::on_stream,
                    "dtrain::torch over a CUDA backend needs LibTorch's CUDA headers "
                    "(c10/cuda/impl/cuda_cmake_macros.h): a LibTorch built with CUDA");
#endif
    } else {
      return stream_type{};
    }
  }

  void collect(std::vector<parameter>& params, std::vector<parameter>& buffers) {
    // A tensor registered twice (tied weights) is one parameter, under its first name.
    std::vector<std::pair<std::string, ::torch::Tensor>> named;
    std::unordered_set<const void*> seen;
    for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
      if (seen.insert(item.value().unsafeGetTensorImpl()).second)
        named.emplace_back(item.key(), item.value());
    }
    std::size_t trained = 0;
    for (const auto& item : named)
      if (item.second.requires_grad()) ++trained;
    slots_ = std::vector<slot_state>(trained);  // never resized: rebind points into it
    unready_ = trained;
    for (const auto& [key, t] : named) {
      const std::string what =
          (t.requires_grad() ? "parameter '" : "frozen parameter '") + key + "'";
      const buffer values = detail::buffer_of(t, what, rank_);
      if (!t.requires_grad()) {
        buffers.push_back({.name = key, .values = values, .device = values.device});
        continue;
      }
      if (!t.is_leaf()) {
        throw config_error("dtrain::torch::DistributedDataParallel on rank " +
                           std::to_string(rank_) + ": " + what +
                           " is not a leaf tensor, so autograd keeps no gradient for it");
      }
      detail::gradient_slot& slot = slots_[params.size()].gradient;
      slot.param = t;
      slot.original = t.grad();
      void* gradient = nullptr;
      if (slot.original.defined()) {
        const buffer g = detail::buffer_of(slot.original, "the gradient of " + what, rank_);
        if (g.count != values.count || g.type != values.type || g.where != values.where) {
          throw config_error("dtrain::torch::DistributedDataParallel on rank " +
                             std::to_string(rank_) + ": the gradient of " + what +
                             " does not match it (shape, type or device)");
        }
        gradient = g.data;
      }
      params.push_back({.name = key,
                        .values = values,
                        .gradient = gradient,
                        .device = values.device,
                        .gradient_slot = &slot,
                        .rebind = &detail::rebind_gradient});
    }
    for (const auto& item : module_->named_buffers(/*recurse=*/true)) {
      // An optional buffer left unset, or one registered twice.
      if (!item.value().defined() || !seen.insert(item.value().unsafeGetTensorImpl()).second)
        continue;
      const buffer values = detail::buffer_of(item.value(), "buffer '" + item.key() + "'", rank_);
      buffers.push_back({.name = item.key(), .values = values, .device = values.device});
      buffer_tensors_.push_back(item.value());  // broadcast by each forward(), as PyTorch does
    }
  }

  void hook() {
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      slot_state& s = slots_[i];
      // The parameter holds its accumulator weakly: keeping it here keeps the hook.
      s.accumulator = ::torch::autograd::impl::grad_accumulator(s.gradient.param);
      if (!s.accumulator) {
        throw config_error("dtrain::torch::DistributedDataParallel on rank " +
                           std::to_string(rank_) + ": parameter '" + name_of(i) +
                           "' has no gradient accumulator");
      }
      s.hook_key = s.accumulator->add_post_hook(
          std::make_unique<detail::ready_hook<DistributedDataParallel>>(this, i));
    }
  }

  [[nodiscard]] const std::string& name_of(std::size_t i) const {
    return core_->parameters()[i].name;
  }

  void check_slots(const char* when) {
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      const std::string& failure = slots_[i].gradient.failure;
      if (failure.empty()) continue;
      throw error("dtrain::torch::DistributedDataParallel on rank " + std::to_string(rank_) +
                  ": could not point the .grad() of parameter '" + name_of(i) + "' at its bucket " +
                  when + ": " + failure);
    }
  }

  /// Makes parameter i's .grad() the bucket view. `written`: autograd has
  /// just written it, so a gradient elsewhere (the optimizer had set it to
  /// none, or the user replaced it) is copied in, and none at all (an
  /// undefined gradient reached the accumulator) is a zero contribution,
  /// not what the bucket held from the step before.
  void expose(std::size_t i, bool written = false) {
    detail::gradient_slot& s = slots_[i].gradient;
    ::torch::Tensor& grad = s.param.mutable_grad();
    if (grad.defined() && grad.data_ptr() == s.place) return;
    ::torch::Tensor view = s.view();
    if (written) {
      if (grad.defined()) {
        view.copy_(grad);
      } else {
        view.zero_();
      }
    }
    grad = view;
  }

  /// Parameter i is ready in this step (the lock is held).
  void ready(std::size_t i) {
    slots_[i].ready = true;
    --unready_;
    core_->mark_ready(i);
  }

  /// Ends the step (the lock is held): the buckets are averaged, every
  /// .grad() a parameter some rank used is its bucket view again. The next
  /// step starts afresh even when this one failed (basic_ddp then refuses
  /// every further use, naming the failure).
  void complete_step() {
    struct next_step {
      DistributedDataParallel& ddp;
      ~next_step() {
        for (slot_state& s : ddp.slots_) s.touched = s.ready = s.walked_unused = false;
        ddp.unready_ = ddp.slots_.size();
      }
    } at_exit{*this};
    if constexpr (memory_space::on_stream) {
      core_->synchronize(current_stream());
    } else {
      core_->synchronize();
    }
    check_slots("after the step's buckets were reduced");
    std::vector<std::int32_t> used = used_anywhere();
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      // PyTorch: a parameter no rank used keeps its .grad() untouched.
      if (!used.empty() && used[i] == 0) continue;
      expose(i);
    }
    completed_ = true;
  }

  /// Whether some parameter is ready in this step (a gradient arrived outside
  /// no_sync()) and the step is not complete yet.
  [[nodiscard]] bool step_open() const noexcept { return unready_ != slots_.size(); }

  /// Throws when the step is open (`what` the user did cannot start the next one).
  void check_step_closed(const std::string& what) const {
    if (step_open() && no_sync_depth_ == 0) throw error(no_gradient_message(what));
  }

  /// Why the step is still open, after `what`: the parameters that got no
  /// gradient, and what to do about them.
  [[nodiscard]] std::string no_gradient_message(const std::string& what) const {
    const auto [names, count] = dtrain::detail::pick_names(
        core_->parameters(), [&](std::size_t i) { return !slots_[i].ready; });
    std::string out = "dtrain::torch::DistributedDataParallel on rank " + std::to_string(rank_) +
                      ": step " + std::to_string(core_->steps()) + " is not complete, and " + what +
                      ": backward() gave no gradient to " + std::to_string(count) + " of " +
                      std::to_string(slots_.size()) + " parameters (" + names + ")";
    if (count == 0) {
      out +=
          "; every parameter got its gradient, but the backward() that gave the last ones "
          "ended before it could complete the step (an error inside autograd?); call "
          "ddp.synchronize() to complete it";
    } else if (find_unused_) {
      out +=
          "; with find_unused_parameters, run the forward pass through ddp(x), whose graph "
          "walk finds the parameters a step does not use, or call ddp.synchronize() after "
          "backward() (it sends zeros for them)";
    } else {
      out +=
          "; they took no part in computing the loss: if parts of the model sit out some "
          "steps, set ddp_options::find_unused_parameters = true (as for PyTorch's DDP)";
    }
    return out;
  }

  void before_forward() {
    check_step_closed("ddp(x) began the next one");
    if constexpr (memory_space::on_stream) core_->set_stream(current_stream());
    // Not under NoGradGuard: evaluation often runs on one rank only.
    if (extra_.broadcast_buffers && size_ > 1 && !buffer_tensors_.empty() &&
        ::torch::GradMode::is_enabled()) {
      broadcast_buffers();
    }
  }

  /// Rank 0's buffers to every rank, bit for bit, in one collective per
  /// device: their bytes, rank 0's and zeros elsewhere, summed as uint8 (x +
  /// 0 = x). An allreduce rather than a broadcast: it takes the engine's
  /// fastest path (Gloo's shared memory on one host; its broadcast is TCP),
  /// and the buffers of a model are small.
  void broadcast_buffers() {
    const ::torch::NoGradGuard no_grad;
    std::vector<bool> done(buffer_tensors_.size(), false);
    for (std::size_t first = 0; first < buffer_tensors_.size(); ++first) {
      if (done[first]) continue;
      const ::torch::Device device = buffer_tensors_[first].device();
      std::vector<::torch::Tensor> group, bytes;
      for (std::size_t i = first; i < buffer_tensors_.size(); ++i) {
        const ::torch::Tensor& t = buffer_tensors_[i];
        if (done[i] || t.device() != device) continue;
        done[i] = true;
        group.push_back(t);
        bytes.push_back(t.reshape({-1}).view(::torch::kUInt8));
      }
      ::torch::Tensor flat =
          rank_ == 0
              ? ::torch::cat(bytes)
              : ::torch::zeros({total_bytes(bytes)},
                               ::torch::TensorOptions().dtype(::torch::kUInt8).device(device));
      const buffer b = detail::buffer_of(flat, "the buffers", rank_);
      sum_in_place(b);
      if (rank_ == 0) continue;
      std::int64_t at = 0;
      for (std::size_t k = 0; k < group.size(); ++k) {
        const std::int64_t n = bytes[k].numel();
        group[k].view({-1}).view(::torch::kUInt8).copy_(flat.narrow(0, at, n));
        at += n;
      }
    }
  }

  static std::int64_t total_bytes(const std::vector<::torch::Tensor>& bytes) {
    std::int64_t n = 0;
    for (const ::torch::Tensor& b : bytes) n += b.numel();
    return n;
  }

  /// With find_unused_parameters: per parameter, how many ranks used it in
  /// this step (marked by autograd, or in no_sync() micro-steps); else empty.
  std::vector<std::int32_t> used_anywhere() {
    if (!find_unused_) return {};
    std::vector<std::int32_t> counts(slots_.size());
    for (std::size_t i = 0; i < slots_.size(); ++i) counts[i] = slots_[i].touched ? 1 : 0;
    if (size_ == 1 || counts.empty()) return counts;
    ::torch::Tensor t =
        ::torch::from_blob(counts.data(), {static_cast<std::int64_t>(counts.size())},
                           ::torch::TensorOptions().dtype(::torch::kInt32));
    if constexpr (on_device) t = t.to(slots_[0].gradient.param.device());
    const buffer b = detail::buffer_of(t, "the used-parameter counts", rank_);
    sum_in_place(b);
    if constexpr (on_device) {
      t = t.cpu();
      std::memcpy(counts.data(), t.data_ptr(), counts.size() * sizeof(std::int32_t));
    }
    return counts;
  }

  /// Sums `b` over the ranks in place (comm_; CUDA: on the current stream), and waits.
  void sum_in_place(const buffer& b) {
    if constexpr (memory_space::on_stream) {
      comm_.allreduce(b, b, reduce_op::sum, current_stream()).wait();
    } else {
      comm_.allreduce(b, b, reduce_op::sum).wait();
    }
  }

  // shared_ptr<Node> in LibTorch 1.13, an intrusive_ptr in later versions.
  using accumulator_ptr =
      decltype(::torch::autograd::impl::grad_accumulator(std::declval<const ::torch::Tensor&>()));

  /// What the wrapper keeps per trained parameter, indexed like
  /// core().parameters() (c10d's VariableIndex).
  struct slot_state {
    detail::gradient_slot gradient;  // the parameter's gradient_slot points here
    accumulator_ptr accumulator;     // kept: the parameter holds it weakly, and with it the hook
    std::uintptr_t hook_key = 0;
    bool touched = false;  // autograd wrote its gradient since the last step (no_sync() too)
    bool ready = false;    // in this step: autograd wrote it outside no_sync(), or found unused
    bool walked_unused = false;  // the last graph walk before this backward() did not reach it
  };

  // Declared in this order: the slots outlive core_, whose destructor gives
  // the gradients back through them.
  Module module_;
  module_options extra_;
  bool find_unused_;
  communicator_type comm_;  // a split of the user's: buffers and the used counts
  int rank_;
  int size_;
  std::vector<slot_state> slots_;  // never resized after construction
  std::vector<::torch::Tensor> buffer_tensors_;
  std::size_t unready_ = 0;  // parameters not ready in this step
  bool completed_ = false;   // the last step is complete and nothing arrived since
  int no_sync_depth_ = 0;
  std::mutex mutex_;  // autograd may run hooks on several threads (CPU and each GPU)
  std::optional<core_type> core_;
};

template <class Context, class Module>
DistributedDataParallel(Context&, Module, ddp_options = {}, module_options = {})
    -> DistributedDataParallel<typename Context::policy_type, Module>;

}  // namespace dtrain::torch
