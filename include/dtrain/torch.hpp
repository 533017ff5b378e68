#pragma once
/// @file
/// dtrain::torch::DistributedDataParallel: a LibTorch module (torch::nn::Module)
/// made data-parallel in one line, with autograd itself marking gradients ready.
///
///   #include <dtrain/torch.hpp>   // optional: needs LibTorch; dtrain.hpp never includes it
///   auto ddp = dtrain::torch::DistributedDataParallel(ctx, model);
///   auto loss = loss_fn(ddp(x), y); loss.backward(); ddp.synchronize(); optimizer.step();
///
/// It is basic_ddp<Policy> (ddp/basic_ddp.hpp) fed from the module:
/// - the parameters that require a gradient come from named_parameters(); the
///   frozen ones and named_buffers() are state to agree on; names, shapes,
///   types and devices are checked across ranks, and rank 0's values broadcast;
/// - each parameter's gradient accumulator gets a post-hook (as c10d's Reducer
///   does) that marks it ready, so buckets are reduced during backward();
/// - each parameter's .grad() is a tensor over dtrain's bucket storage (no copy
///   in or out); a gradient the optimizer dropped (zero_grad with set_to_none)
///   or the user replaced is copied into the bucket when autograd next writes it;
/// - with find_unused_parameters, forward() walks the autograd graph from the
///   outputs, as PyTorch does, and marks the parameters it cannot reach ready
///   at once (zero contributions); after synchronize() a parameter that no rank
///   used keeps the .grad() it had (undefined when it had none), as in PyTorch.
///
/// CPU tensors go over Gloo or MPI; CUDA tensors over NCCL, ordered after the
/// current CUDA stream (which needs a LibTorch built with CUDA, and nvcc or
/// DTRAIN_WITH_NCCL for dtrain). Not part of the single header: vendor this
/// file beside it.

#include <dtrain/dtrain.hpp>

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

#include <algorithm>
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

/// The dtrain element type of a LibTorch scalar type, if dtrain moves it.
[[nodiscard]] inline std::optional<dtype> element_of(c10::ScalarType t) noexcept {
  switch (t) {
    case c10::ScalarType::Float: return dtype::float32;
    case c10::ScalarType::Double: return dtype::float64;
    case c10::ScalarType::Half: return dtype::float16;
    case c10::ScalarType::BFloat16: return dtype::bfloat16;
    case c10::ScalarType::Int: return dtype::int32;
    case c10::ScalarType::Long: return dtype::int64;
    case c10::ScalarType::Byte: return dtype::uint8;
    default: return std::nullopt;
  }
}

/// The tensor's memory as a dtrain buffer; config_error naming `what` and
/// the rank when dtrain cannot move it as it is.
[[nodiscard]] inline buffer buffer_of(const ::torch::Tensor& t, const std::string& what, int rank) {
  auto refuse = [&](const std::string& why) {
    throw config_error("dtrain::torch::DistributedDataParallel on rank " + std::to_string(rank) +
                       ": " + what + " " + why);
  };
  if (!t.defined()) refuse("is undefined");
  if (t.layout() != c10::kStrided)
    refuse("is not a dense tensor (sparse tensors are not supported)");
  if (!t.is_contiguous()) {
    refuse("is not contiguous (shape " + c10::str(t.sizes()) + ", strides " +
           c10::str(t.strides()) + "); make it contiguous before wrapping the module");
  }
  const std::optional<dtype> type = element_of(t.scalar_type());
  if (!type)
    refuse(std::string("has element type ") + c10::toString(t.scalar_type()) +
           ", which dtrain does not move");
  if (t.is_cuda()) {
    return {t.data_ptr(), static_cast<std::size_t>(t.numel()), *type, memory::device,
            t.device().index()};
  }
  if (!t.is_cpu())
    refuse("is on device " + t.device().str() + "; dtrain moves CPU and CUDA tensors");
  return {t.data_ptr(), static_cast<std::size_t>(t.numel()), *type, memory::host, -1};
}

/// Where a parameter's .grad() lives while DDP holds it; dtrain::parameter's
/// gradient_slot points here, and rebind_gradient moves .grad() when the
/// buckets are laid out again.
struct gradient_slot {
  ::torch::Tensor param;  // shares the parameter's TensorImpl: .grad() is set through it
  ::torch::Tensor
      original;           // its .grad() when DDP took it (undefined if none): given back at the end
  void* place = nullptr;  // the bucket storage of its gradient now
  std::string failure;    // what went wrong in rebind_gradient (it may not throw)

  /// A tensor over the bucket storage, shaped and typed like the parameter.
  [[nodiscard]] ::torch::Tensor view() const {
    return ::torch::from_blob(
        place, param.sizes(),
        ::torch::TensorOptions().dtype(param.scalar_type()).device(param.device()));
  }
};

/// dtrain::parameter::rebind for a LibTorch parameter. `storage` is the new
/// bucket place; at the end it is the original gradient's storage, or null.
inline void rebind_gradient(void* slot, void* storage) noexcept {
  auto& s = *static_cast<gradient_slot*>(slot);
  try {
    ::torch::Tensor& grad = s.param.mutable_grad();
    const bool had = grad.defined();  // an undefined .grad() stays so (the parameter is unused)
    if (storage == nullptr) {
      // DDP ends and the module had no gradient of its own: keep the values.
      if (had) grad = grad.clone();
    } else if (s.original.defined() && storage == s.original.data_ptr()) {
      if (had) grad = s.original;
    } else {
      s.place = storage;
      if (had) grad = s.view();
    }
  } catch (const std::exception& e) {
    if (s.failure.empty()) s.failure = e.what();
  }
}

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
/// Per step: `ddp(x)` (or `ddp->forward(x)`, which skips the graph walk of
/// find_unused_parameters and the buffer broadcast), backward(), then
/// synchronize(): every .grad() then holds the mean over ranks.
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
    // leaving the others to find it gone).
    agree_on(ctx, problem);
    stream_type stream = current_stream();
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
    for (std::size_t i = 0; i < accumulators_.size(); ++i) {
      if (accumulators_[i]) accumulators_[i]->del_post_hook(hook_keys_[i]);
    }
  }

  /// The module: `ddp->forward(x)`, `ddp->parameters()`.
  [[nodiscard]] auto* operator->() noexcept { return &*module_; }
  [[nodiscard]] const auto* operator->() const noexcept { return &*module_; }
  [[nodiscard]] Module& module() noexcept { return module_; }

  /// PyTorch's `ddp(x)`: the module's forward(), preceded by the buffer
  /// broadcast (module_options::broadcast_buffers) and followed, with
  /// find_unused_parameters, by the walk of the autograd graph from the
  /// outputs (tensors, vectors and tuples of them) that marks the
  /// parameters it does not reach ready at once.
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

  /// With find_unused_parameters: marks ready now every parameter that the
  /// graph behind `outputs` does not reach (forward() calls it; call it
  /// yourself after `ddp->forward(x)` when the outputs are of another shape).
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
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      if (seen.contains(accumulators_[i].get())) continue;
      // Unused in this step: contributes zero, or what it accumulated in no_sync().
      if (!touched_[i]) slots_[i].view().zero_();
      walked_unused_[i] = true;
      core_->mark_ready(i);
    }
  }

  /// Completes the step: every .grad() holds the mean over ranks (CUDA: on
  /// the current stream). Throws dtrain::error naming a parameter autograd
  /// never reached (without find_unused_parameters), or the engine's error.
  /// Inside no_sync() it does nothing.
  void synchronize() {
    const std::lock_guard lock(mutex_);
    if (no_sync_depth_ > 0) return;
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
    std::fill(touched_.begin(), touched_.end(), false);
    std::fill(walked_unused_.begin(), walked_unused_.end(), false);
  }

  /// Gradient accumulation: `{ auto g = ddp.no_sync(); loss(ddp(x)).backward(); }`;
  /// the next synchronized step averages the sums.
  class no_sync_guard {
   public:
    explicit no_sync_guard(DistributedDataParallel& ddp)
        : core_(ddp.core_->no_sync()), depth_(&ddp.no_sync_depth_) {
      ++*depth_;
    }
    no_sync_guard(no_sync_guard&& other) noexcept
        : core_(std::move(other.core_)), depth_(std::exchange(other.depth_, nullptr)) {}
    no_sync_guard(const no_sync_guard&) = delete;
    no_sync_guard& operator=(const no_sync_guard&) = delete;
    no_sync_guard& operator=(no_sync_guard&&) = delete;
    ~no_sync_guard() {
      if (depth_) --*depth_;
    }

   private:
    typename core_type::no_sync_guard core_;
    int* depth_;
  };
  [[nodiscard]] no_sync_guard no_sync() { return no_sync_guard(*this); }

  /// Zeroes every gradient in place (the bucket storage): no tensor is
  /// dropped, so no copy is needed in the next backward().
  void zero_grad() {
    const std::lock_guard lock(mutex_);
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
    if (walked_unused_[i]) {
      throw error("dtrain::torch::DistributedDataParallel on rank " + std::to_string(rank_) +
                  ": autograd wrote the gradient of parameter '" + core_->parameters()[i].name +
                  "', which the graph walk after ddp(x) found unused in this step (and sent as "
                  "zero); with find_unused_parameters, a parameter that gets a gradient must be "
                  "reached from the outputs of ddp(x) (one ddp(x) per backward())");
    }
    expose(i, true);
    touched_[i] = true;
    core_->mark_ready(i);
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
    slots_ = std::vector<detail::gradient_slot>(trained);  // never resized: rebind points here
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
      detail::gradient_slot& slot = slots_[params.size()];
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
    touched_.assign(slots_.size(), false);
    walked_unused_.assign(slots_.size(), false);
  }

  /// Collective: throws config_error on every rank when some rank has a
  /// problem (that rank's own message; the others name it).
  template <class Context>
  void agree_on(Context& ctx, const std::string& problem) {
    if constexpr (communicator_type::reaches_host_memory) {
      communicator_channel<communicator_type> channel(comm_);
      control_plane control(channel);
      dtrain::detail::agree_on_model(control, {}, {}, problem);
    } else {
      control_plane control = ctx.control_plane();
      dtrain::detail::agree_on_model(control, {}, {}, problem);
    }
  }

  void hook() {
    accumulators_.resize(slots_.size());
    hook_keys_.resize(slots_.size());
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      // The parameter holds its accumulator weakly: keeping it here keeps the hook.
      accumulators_[i] = ::torch::autograd::impl::grad_accumulator(slots_[i].param);
      if (!accumulators_[i]) {
        throw config_error("dtrain::torch::DistributedDataParallel on rank " +
                           std::to_string(rank_) + ": parameter '" + core_->parameters()[i].name +
                           "' has no gradient accumulator");
      }
      hook_keys_[i] = accumulators_[i]->add_post_hook(
          std::make_unique<detail::ready_hook<DistributedDataParallel>>(this, i));
    }
  }

  void check_slots(const char* when) {
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      if (slots_[i].failure.empty()) continue;
      throw error("dtrain::torch::DistributedDataParallel on rank " + std::to_string(rank_) +
                  ": could not point the .grad() of parameter '" + core_->parameters()[i].name +
                  "' at its bucket " + when + ": " + slots_[i].failure);
    }
  }

  /// Makes parameter i's .grad() the bucket view; `keep` copies a gradient
  /// autograd wrote elsewhere (the optimizer had set it to none) into it.
  void expose(std::size_t i, bool keep = false) {
    detail::gradient_slot& s = slots_[i];
    ::torch::Tensor& grad = s.param.mutable_grad();
    if (grad.defined() && grad.data_ptr() == s.place) return;
    ::torch::Tensor view = s.view();
    if (keep && grad.defined()) view.copy_(grad);
    grad = view;
  }

  void before_forward() {
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
    for (std::size_t i = 0; i < slots_.size(); ++i) counts[i] = touched_[i] ? 1 : 0;
    if (size_ == 1 || counts.empty()) return counts;
    ::torch::Tensor t =
        ::torch::from_blob(counts.data(), {static_cast<std::int64_t>(counts.size())},
                           ::torch::TensorOptions().dtype(::torch::kInt32));
    if constexpr (on_device) t = t.to(slots_[0].param.device());
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

  // Declared in this order: the slots outlive core_, whose destructor gives
  // the gradients back through them.
  Module module_;
  module_options extra_;
  bool find_unused_;
  communicator_type comm_;  // a split of the user's: buffers and the used counts
  int rank_;
  int size_;
  std::vector<detail::gradient_slot> slots_;
  std::vector<::torch::Tensor> buffer_tensors_;
  std::vector<bool> touched_;        // written by autograd since the last synchronized step
  std::vector<bool> walked_unused_;  // marked unused by this step's graph walk
  int no_sync_depth_ = 0;
  std::mutex mutex_;  // autograd may run hooks on several threads (CPU and each GPU)
  std::optional<core_type> core_;
  // shared_ptr<Node> in LibTorch 1.13, an intrusive_ptr in later versions.
  using accumulator_ptr =
      decltype(::torch::autograd::impl::grad_accumulator(std::declval<const ::torch::Tensor&>()));
  std::vector<accumulator_ptr> accumulators_;
  std::vector<std::uintptr_t> hook_keys_;
};

/// dtrain::distributed_sampler as a torch::data sampler (for
/// torch::data::make_data_loader, or next() by hand): this rank's shard of
/// each epoch, the same number of batches on every rank. Call set_epoch(e)
/// before each epoch to reshuffle.
class distributed_sampler final
    : public ::torch::data::samplers::Sampler<std::vector<std::size_t>> {
 public:
  distributed_sampler(std::size_t dataset_size, const world& w, sampler_options options = {})
      : distributed_sampler(dataset_size, w.rank.value_or(-1), w.world_size.value_or(0), options) {}
  distributed_sampler(std::size_t dataset_size, int rank, int world_size,
                      sampler_options options = {})
      : shard_(dataset_size, rank, world_size, options),
        options_(options),
        dataset_size_(dataset_size),
        rank_(rank),
        world_size_(world_size) {}

  /// Reshuffles for `epoch` and starts over.
  void set_epoch(std::uint64_t epoch) {
    shard_.set_epoch(epoch);
    next_ = 0;
  }
  /// Starts the epoch over; a new dataset size lays the shards out again.
  void reset(::torch::optional<std::size_t> new_size) override {
    if (new_size && *new_size != dataset_size_) {
      const std::uint64_t epoch = shard_.epoch();
      shard_ = dtrain::distributed_sampler(*new_size, rank_, world_size_, options_);
      dataset_size_ = *new_size;
      shard_.set_epoch(epoch);
    }
    next_ = 0;
  }
  /// The next `batch_size` indices of this rank's shard (fewer at its end);
  /// none when the epoch is over.
  ::torch::optional<std::vector<std::size_t>> next(std::size_t batch_size) override {
    const auto all = shard_.indices();
    if (next_ >= all.size()) return ::torch::nullopt;
    const std::size_t n = std::min(batch_size, all.size() - next_);
    std::vector<std::size_t> out(all.begin() + static_cast<std::ptrdiff_t>(next_),
                                 all.begin() + static_cast<std::ptrdiff_t>(next_ + n));
    next_ += n;
    return out;
  }
  void save(::torch::serialize::OutputArchive& archive) const override {
    archive.write("epoch", ::torch::tensor(static_cast<std::int64_t>(shard_.epoch())),
                  /*is_buffer=*/true);
    archive.write("index", ::torch::tensor(static_cast<std::int64_t>(next_)), /*is_buffer=*/true);
  }
  void load(::torch::serialize::InputArchive& archive) override {
    ::torch::Tensor epoch = ::torch::empty({}, ::torch::kInt64);
    ::torch::Tensor index = ::torch::empty({}, ::torch::kInt64);
    archive.read("epoch", epoch, /*is_buffer=*/true);
    archive.read("index", index, /*is_buffer=*/true);
    set_epoch(static_cast<std::uint64_t>(epoch.item<std::int64_t>()));
    next_ = static_cast<std::size_t>(index.item<std::int64_t>());
  }

  /// Samples per rank and epoch.
  [[nodiscard]] std::size_t size() const noexcept { return shard_.size(); }
  [[nodiscard]] const dtrain::distributed_sampler& shard() const noexcept { return shard_; }

 private:
  dtrain::distributed_sampler shard_;
  sampler_options options_;
  std::size_t dataset_size_;
  int rank_;
  int world_size_;
  std::size_t next_ = 0;
};

template <class Context, class Module>
DistributedDataParallel(Context&, Module, ddp_options = {}, module_options = {})
    -> DistributedDataParallel<typename Context::policy_type, Module>;

}  // namespace dtrain::torch
