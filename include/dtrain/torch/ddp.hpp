#pragma once
/// @file
/// dtrain::torch::DistributedDataParallel: a LibTorch module (torch::nn::Module)
/// made data-parallel in one line, with autograd itself marking gradients ready.
/// It holds the module and forwards to it; the rest is module_ddp<Policy>
/// (torch/module_ddp.hpp: tensors, hooks, the final callback) over DDP's one
/// core, dtrain::basic_ddp<Policy>.
///
/// CPU tensors go over Gloo or MPI; CUDA tensors over NCCL, ordered after the
/// current CUDA stream (which needs a LibTorch built with CUDA, and nvcc or
/// DTRAIN_WITH_NCCL for dtrain).

#include <dtrain/dtrain.hpp>
#include <dtrain/torch/compiled.hpp>
#include <dtrain/torch/module_ddp.hpp>

#include <torch/torch.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace dtrain::torch {

namespace detail {

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

/// Whether Module (a holder or a shared_ptr) is a torch::nn::Sequential,
/// whose children DistributedDataParallel runs itself at ZeRO stage 3.
template <class Module>
constexpr bool is_sequential = [] {
  if constexpr (requires { typename Module::ContainedType; }) {
    return std::is_base_of_v<::torch::nn::SequentialImpl, typename Module::ContainedType>;
  } else if constexpr (requires { typename Module::element_type; }) {
    return std::is_base_of_v<::torch::nn::SequentialImpl, typename Module::element_type>;
  } else {
    return false;
  }
}();

/// The module behind a holder (`Net`, `torch::nn::Sequential`) or a shared_ptr.
template <class Module>
std::shared_ptr<::torch::nn::Module> module_pointer(const Module& m) {
  if constexpr (requires { m.ptr(); }) {
    return m.ptr();
  } else {
    return m;
  }
}

}  // namespace detail

/// A LibTorch module (a ModuleHolder such as `Net`, `torch::nn::Sequential`,
/// or a std::shared_ptr to a module) trained data-parallel over the
/// communicator of `Policy`. Not movable: autograd's hooks point at it.
///
/// Per step, as with PyTorch's DDP: `ddp(x)`, then backward(), which returns
/// once every .grad() holds the mean over ranks; then the optimizer.
/// `ddp->forward(x)` calls the module alone (no buffer broadcast, no graph
/// walk for find_unused_parameters; at ZeRO stage 3 no gather: the values
/// are not there). synchronize() completes a step that
/// backward() could not: one with parameters that got no gradient.
template <class Policy, class Module>
class DistributedDataParallel {
  static_assert(!std::is_base_of_v<::torch::nn::Module, Module>,
                "dtrain::torch::DistributedDataParallel: pass the module holder "
                "(a TORCH_MODULE type such as `Net`) or a std::shared_ptr to the module, "
                "not the module itself (it would be copied)");
  static_assert(!DTRAIN_TORCH_HAS_SEPARATE_COMPILATION() || detail::in_torch_part<Policy>,
                "dtrain::torch::DistributedDataParallel: with DTRAIN_TORCH_SEPARATE_COMPILATION "
                "(CMake's dtrain::torch), only the standard policies are compiled "
                "(DTRAIN_TORCH_FOR_EACH_COMPILED_POLICY in dtrain/torch/compiled.hpp); "
                "for a policy of your own, build this file header-only "
                "(link dtrain::header_only and torch rather than dtrain::torch)");

 public:
  using core_type = dtrain::basic_ddp<Policy>;
  using communicator_type = typename Policy::communicator_type;
  using memory_space = typename Policy::memory_space;
  static constexpr bool on_device = core_type::on_device;
  /// Made only by no_sync(), which refuses to start one while a step is not complete.
  using no_sync_guard = typename core_type::no_sync_guard;

  /// Collective over ctx's communicator: checks that every rank holds the
  /// same module (config_error naming the first parameter that differs),
  /// copies rank 0's parameters and buffers to every rank, lays the
  /// gradients out in buckets and hooks every parameter's gradient accumulator.
  template <ddp_context<Policy> Context>
  DistributedDataParallel(Context& ctx, Module module, ddp_options options = {},
                          module_options extra = {})
      : module_(std::move(module)),
        ddp_(ctx, detail::module_pointer(module_), std::move(options), extra) {}

  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

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
    ddp_.before_forward();
    decltype(auto) out = call_module(std::forward<Args>(args)...);
    if (ddp_.walks_graph()) {
      std::vector<::torch::Tensor> outputs;
      detail::collect_outputs(out, outputs);
      if (!outputs.empty()) ddp_.prepare_for_backward(outputs);
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
    ddp_.prepare_for_backward(outputs);
  }

  /// Completes the step, if backward() has not: every .grad() then holds
  /// the mean over ranks (CUDA: on the current stream). backward() completes
  /// every step in which each parameter got a gradient or was found unused
  /// by ddp(x)'s graph walk; what is left for synchronize() is a step with
  /// parameters that got none: with find_unused_parameters they contribute
  /// zero (after `ddp->forward(x)`, which does not walk the graph), without
  /// it they are a dtrain::error naming them. Does nothing inside no_sync()
  /// or after a step that backward() completed. Throws the engine's error.
  void synchronize() { ddp_.synchronize(); }

  /// Gradient accumulation: `{ auto g = ddp.no_sync(); loss(ddp(x)).backward(); }`;
  /// the next synchronized step averages the sums. Throws dtrain::error while
  /// a step is not complete.
  [[nodiscard]] no_sync_guard no_sync() { return ddp_.no_sync(); }

  /// Zeroes every gradient in place (the bucket storage): no tensor is
  /// dropped, so no copy is needed in the next backward().
  void zero_grad() { ddp_.zero_grad(); }

  /// Replaces the allreduce of each bucket (see basic_ddp::register_comm_hook).
  void register_comm_hook(typename core_type::comm_hook hook) {
    ddp_.core().register_comm_hook(std::move(hook));
  }

  /// Sharding (ddp_options::sharding, ZeRO stages 1-3; docs/sharding.md):
  /// this rank's shard as tensors for a torch::optim optimizer, one 1-D tensor
  /// per piece of core().shard(), over the module's own values (shared
  /// memory; at stage 3 DDP's shard of them), its .grad() the piece's mean
  /// over the ranks. Build the optimizer
  /// on them (`torch::optim::Adam opt(ddp.shard_parameters(), ...)`): its state
  /// is the shard's size. The shard is cut in flat slices of the buckets, as
  /// DeepSpeed's ZeRO, not parameter by parameter as PyTorch's
  /// ZeroRedundancyOptimizer: every rank's shard has the same size however
  /// uneven the parameters are, and it is the core's layout, reduce-scattered
  /// during backward(). Without sharding: every parameter, flattened.
  /// Per-parameter options (param groups) do not carry over: the pieces of
  /// one parameter are separate tensors. With ddp_options::master_weights a
  /// 16-bit parameter's pieces are their float32 master copies (DDP rounds
  /// them into the module's values after the step), whose .grad() is a
  /// float32 copy of the 16-bit mean, made by step() before the optimizer runs.
  [[nodiscard]] const std::vector<::torch::Tensor>& shard_parameters() {
    if (shard_tensors_.empty()) {
      for (const shard_piece& piece : ddp_.core().shard()) {
        ::torch::Tensor values = detail::tensor_over(piece.master);
        values.set_requires_grad(true);  // a leaf over the module's memory, as a parameter is
        ::torch::Tensor mean = detail::tensor_over(piece.gradients);
        ::torch::Tensor gradients =
            mean.scalar_type() == values.scalar_type() ? mean : ::torch::empty_like(values);
        // The piece's mean after backward(), for clipping (master weights: after step()).
        values.mutable_grad() = gradients;
        shard_tensors_.push_back(values);
        shard_gradients_.push_back(gradients);
        shard_means_.push_back(mean);
      }
    }
    return shard_tensors_;
  }
  /// The optimizer's step on this rank's shard (`optimizer` built on
  /// shard_parameters()), then the allgather of the updated values (at
  /// stage 3 none: the next step's gathers read the shard):
  /// once after each backward() (or synchronize()); dtrain::error naming the
  /// rank otherwise, before the optimizer has changed anything. On CUDA the
  /// allgathers are ordered after the current stream at the call (the one
  /// the optimizer runs on, under a CUDAStreamGuard too). With ZeRO stage 2,
  /// from this step until the next backward() a shard tensor's .grad() is
  /// not a gradient: the allgather reused that bucket memory for the values.
  void step(::torch::optim::Optimizer& optimizer) {
    (void)shard_parameters();
    ddp_.follow_current_stream();
    bool stepped = false;
    ddp_.core().optimizer_step([&](const shard_piece&) {
      if (std::exchange(stepped, true)) return;  // the optimizer steps over every piece at once
      ::torch::NoGradGuard no_grad;
      // zero_grad() may have dropped them (set_to_none): the gradients are the core's.
      for (std::size_t k = 0; k < shard_tensors_.size(); ++k) {
        // Master weights: the float32 copy of the 16-bit mean the optimizer reads.
        if (!shard_gradients_[k].is_same(shard_means_[k]))
          shard_gradients_[k].copy_(shard_means_[k]);
        shard_tensors_[k].mutable_grad() = shard_gradients_[k];
      }
      optimizer.step();
    });
  }

  /// DDP's core: the buckets, the rebuild, the parameter names in dtrain's
  /// order, the step's state, the communicator.
  [[nodiscard]] const core_type& core() const noexcept { return ddp_.core(); }
  [[nodiscard]] core_type& core() noexcept { return ddp_.core(); }
  [[nodiscard]] std::vector<bucket_info> buckets() const { return ddp_.core().buckets(); }
  [[nodiscard]] std::size_t steps() const noexcept { return ddp_.core().steps(); }
  /// Writes the timeline (DTRAIN_TIMELINE, ddp_options::timeline) so far.
  void flush_timeline() const { ddp_.core().flush_timeline(); }
  /// Which rank the others wait for (ddp_options::stragglers; see basic_ddp::stragglers()).
  [[nodiscard]] straggler_figures stragglers() const { return ddp_.core().stragglers(); }

 private:
  /// The module's forward; at ZeRO stage 3 each unit inside its gather: a
  /// torch::nn::Sequential's children one by one (as its forward() runs
  /// them), any other module as one unit.
  template <class... Args>
  decltype(auto) call_module(Args&&... args) {
    if (ddp_.shards_values()) {
      if constexpr (detail::is_sequential<Module>) {
        return run_units(std::forward<Args>(args)...);
      } else {
        unit_scope scope(ddp_, 0);
        decltype(auto) out = module_->forward(std::forward<Args>(args)...);
        std::vector<::torch::Tensor> outputs;
        detail::collect_outputs(out, outputs);
        scope.leave(outputs);
        return out;
      }
    }
    return module_->forward(std::forward<Args>(args)...);
  }

  /// Stage 3: unit u gathered while one lives (given back if its forward throws).
  class unit_scope {
   public:
    unit_scope(module_ddp<Policy>& ddp, std::size_t u) : ddp_(ddp), unit_(u) {
      ddp_.enter_unit(unit_);
    }
    unit_scope(const unit_scope&) = delete;
    unit_scope& operator=(const unit_scope&) = delete;
    ~unit_scope() {
      if (!left_) ddp_.release_units();
    }
    void leave(const std::vector<::torch::Tensor>& outputs) {
      left_ = true;
      ddp_.leave_unit(unit_, outputs);
    }

   private:
    module_ddp<Policy>& ddp_;
    std::size_t unit_;
    bool left_ = false;
  };

  /// Stage 3 over a torch::nn::Sequential: SequentialImpl::forward's loop,
  /// each child inside its unit's gather.
  template <class... Args>
  ::torch::Tensor run_units(Args&&... args) {
    auto& seq = *module_;
    if (seq.is_empty()) return module_->forward(std::forward<Args>(args)...);  // its error
    std::size_t u = 0;
    std::optional<::torch::nn::AnyValue> value;
    for (auto it = seq.begin(); it != seq.end(); ++it, ++u) {
      unit_scope scope(ddp_, u);
      if (u == 0) {
        value.emplace(it->any_forward(std::forward<Args>(args)...));
      } else {
        value.emplace(it->any_forward(std::move(*value)));
      }
      std::vector<::torch::Tensor> outputs;
      if (const ::torch::Tensor* t = value->template try_get<::torch::Tensor>())
        outputs.push_back(*t);
      scope.leave(outputs);
    }
    return value->template get<::torch::Tensor>();
  }

  Module module_;
  module_ddp<Policy> ddp_;
  std::vector<::torch::Tensor> shard_tensors_, shard_gradients_;  // shard_parameters()
  std::vector<::torch::Tensor>
      shard_means_;  // the core's means (gradients but with master weights)
};

template <class Context, class Module>
DistributedDataParallel(Context&, Module, ddp_options = {}, module_options = {})
    -> DistributedDataParallel<typename Context::policy_type, Module>;

}  // namespace dtrain::torch
