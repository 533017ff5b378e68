#pragma once
/// @file
/// The definitions of dtrain/torch/module_ddp.hpp's members: included by it
/// header-only and in dtrain::torch's compiled part (src/torch.cpp), not in a
/// file that only links that part (DTRAIN_TORCH_BODIES(),
/// dtrain/torch/module_ddp.hpp). Include dtrain/torch.hpp, not this file.

#include <dtrain/torch/module_ddp.hpp>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

namespace dtrain::torch {

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

}  // namespace detail

template <class Policy>
module_ddp<Policy>::module_ddp(dtrain::context<Policy>& ctx,
                               std::shared_ptr<::torch::nn::Module> module, ddp_options options,
                               module_options extra)
    : module_(std::move(module)), extra_(extra), rank_(ctx.communicator().rank()) {
  build(ctx, std::move(options));
}

template <class Policy>
module_ddp<Policy>::~module_ddp() {
  release_units();  // before the core goes (the gathers point at it)
  for (slot& s : slots_) {
    if (s.accumulator) s.accumulator->del_post_hook(s.hook_key);
  }
}

template <class Policy>
typename module_ddp<Policy>::stream_type module_ddp<Policy>::current_stream() {
  if constexpr (memory_space::on_stream) {
#if DTRAIN_TORCH_CUDA()
    return c10::cuda::getCurrentCUDAStream().stream();
#else
    static_assert(!memory_space::on_stream,
                  "dtrain::torch over a CUDA backend needs LibTorch's CUDA headers "
                  "(c10/cuda/impl/cuda_cmake_macros.h): a LibTorch built with CUDA");
#endif
  } else {
    return stream_type{};
  }
}

/// The module's parameters and buffers as dtrain sees them, or (a module this
/// rank cannot take) why not.
template <class Policy>
std::string module_ddp<Policy>::collect(const ddp_options& options, std::vector<parameter>& params,
                                        std::vector<parameter>& buffers) {
  if (!options.gradient_as_bucket_view) {
    return "dtrain::torch::DistributedDataParallel on rank " + std::to_string(rank_) +
           ": ddp_options::gradient_as_bucket_view = false is not supported; every .grad() "
           "is a view of dtrain's bucket storage (no copies), and stays one after synchronize()";
  }
  try {
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
    slots_ = std::vector<slot>(trained);  // never resized: rebind points into it
    for (const auto& [key, t] : named) {
      const std::string what =
          (t.requires_grad() ? "parameter '" : "frozen parameter '") + key + "'";
      const buffer values = detail::buffer_of(t, what, rank_);
      if (!t.requires_grad()) {
        buffers.push_back(
            {.name = key, .values = values, .device = values.device, .shape = detail::shape_of(t)});
        continue;
      }
      if (!t.is_leaf()) {
        throw config_error("dtrain::torch::DistributedDataParallel on rank " +
                           std::to_string(rank_) + ": " + what +
                           " is not a leaf tensor, so autograd keeps no gradient for it");
      }
      detail::gradient_slot& gradient = slots_[params.size()].gradient;
      gradient.param = t;
      gradient.original = t.grad();
      void* place = nullptr;
      if (gradient.original.defined()) {
        const buffer g = detail::buffer_of(gradient.original, "the gradient of " + what, rank_);
        if (g.count != values.count || g.type != values.type || g.where != values.where) {
          throw config_error("dtrain::torch::DistributedDataParallel on rank " +
                             std::to_string(rank_) + ": the gradient of " + what +
                             " does not match it (shape, type or device)");
        }
        place = g.data;
      }
      parameter p{.name = key,
                  .values = values,
                  .gradient = place,
                  .device = values.device,
                  .gradient_slot = &gradient,
                  .rebind = &detail::rebind_gradient,
                  .shape = detail::shape_of(t)};
      if (options.sharding == sharding::parameters) {
        // Stage 3: DDP keeps the values and moves the tensor's storage, which
        // must then be the tensor's alone.
        if (t.storage_offset() != 0 || t.storage().nbytes() != t.nbytes()) {
          throw config_error("dtrain::torch::DistributedDataParallel on rank " +
                             std::to_string(rank_) + ": " + what +
                             " shares its storage with other tensors (a view or a slice), "
                             "which ddp_options::sharding = parameters cannot take from it: "
                             "give it storage of its own (.clone())");
        }
        detail::value_slot& v = slots_[params.size()].values;
        v.storage = t.storage();
        v.device = t.device();
        p.values_slot = &v;
        p.rebind_values = &detail::rebind_values;
      }
      params.push_back(std::move(p));
    }
    if (options.sharding == sharding::parameters) {
      // Stage 3: no bucket holds two units (a unit's gather brings it alone).
      find_units();
      for (std::size_t i = 0; i < params.size(); ++i)
        params[i].unit =
            units_of_[i].empty() ? -1 : static_cast<std::int64_t>(units_of_[i].front());
    }
    for (const auto& item : module_->named_buffers(/*recurse=*/true)) {
      // An optional buffer left unset, or one registered twice.
      if (!item.value().defined() || !seen.insert(item.value().unsafeGetTensorImpl()).second)
        continue;
      const buffer values = detail::buffer_of(item.value(), "buffer '" + item.key() + "'", rank_);
      buffers.push_back({.name = item.key(),
                         .values = values,
                         .device = values.device,
                         .shape = detail::shape_of(item.value())});
      buffer_tensors_.push_back(item.value());  // broadcast by each forward(), as PyTorch does
    }
  } catch (const config_error& e) {
    return e.what();
  }
  return {};
}

/// After the core is built: the step's stream, the gradients' views, the hooks.
template <class Policy>
void module_ddp<Policy>::attach([[maybe_unused]] stream_type stream) {
  if constexpr (memory_space::on_stream) core_->set_stream(stream);
  check_slots("laying the gradients out");
  // Every parameter is ready: the step completes as backward() ends, as in PyTorch.
  core_->on_all_marked([this] {
    ::torch::autograd::Engine::get_default_engine().queue_callback([this] { complete_step(); });
  });
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    slot& s = slots_[i];
    s.accumulator = ::torch::autograd::impl::grad_accumulator(s.gradient.param);
    if (!s.accumulator) {
      throw config_error("dtrain::torch::DistributedDataParallel on rank " + std::to_string(rank_) +
                         ": parameter '" + name_of(i) + "' has no gradient accumulator");
    }
    s.hook_key =
        s.accumulator->add_post_hook(std::make_unique<detail::ready_hook<module_ddp>>(this, i));
  }
}

template <class Policy>
const std::string& module_ddp<Policy>::name_of(std::size_t i) const {
  return dtrain::detail::parameter_at(core_->parameters(), i).name;
}

template <class Policy>
void module_ddp<Policy>::check_slots(const char* when) {
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
template <class Policy>
void module_ddp<Policy>::expose(std::size_t i, bool written) {
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

template <class Policy>
void module_ddp<Policy>::gradient_written(std::size_t i) {
  if (core_->declared_unused(i)) {
    throw error("dtrain::torch::DistributedDataParallel on rank " + std::to_string(rank_) +
                ": autograd wrote the gradient of parameter '" + name_of(i) +
                "', which the graph walk after ddp(x) found unused in this step "
                "(and sent as zero); with find_unused_parameters, "
                "a parameter that gets a gradient must be reached from the outputs of the last "
                "ddp(x) before backward()");
  }
  if (core_->marked(i) && !core_->accumulating()) {
    // A gradient for the next step: this one was never completed.
    throw error(no_gradient_message("autograd wrote the gradient of '" + name_of(i) +
                                    "' for the next one"));
  }
  expose(i, true);
  core_->mark_ready(i);  // the step's last one queues complete_step() (on_all_marked)
  if (units_of_.empty()) return;
  // Stage 3: a unit whose gradients are all written is done with its values.
  for (const std::size_t u : units_of_[i]) {
    unit& part = units_[u];
    if (part.in_backward && ++part.written == part.members.size()) {
      part.held.clear();
      part.in_backward = false;
      part.written = 0;
    }
  }
}

/// Stage 3: the units, in the order of the module's forward (from slots_,
/// before the core exists).
template <class Policy>
void module_ddp<Policy>::find_units() {
  std::unordered_map<const void*, std::size_t> index;  // a parameter's TensorImpl: its index
  for (std::size_t i = 0; i < slots_.size(); ++i)
    index.emplace(slots_[i].gradient.param.unsafeGetTensorImpl(), i);
  units_of_.assign(slots_.size(), {});
  auto add_unit = [&](const ::torch::nn::Module& part) {
    unit u;
    for (const ::torch::Tensor& p : part.parameters(/*recurse=*/true)) {
      const auto it = index.find(p.unsafeGetTensorImpl());
      if (it == index.end()) continue;  // frozen: whole on every rank
      if (std::find(u.members.begin(), u.members.end(), it->second) == u.members.end())
        u.members.push_back(it->second);
    }
    for (const std::size_t i : u.members) units_of_[i].push_back(units_.size());
    units_.push_back(std::move(u));
  };
  if (const auto seq = std::dynamic_pointer_cast<::torch::nn::SequentialImpl>(module_)) {
    // In the order its forward() runs them (that of begin(), not of children()).
    for (const ::torch::nn::AnyModule& child : *seq) add_unit(*child.ptr());
  } else {
    add_unit(*module_);
  }
  // A torch::nn::Sequential without children: one unit all the same, so
  // that shards_values() says stage 3.
  if (units_.empty()) add_unit(*module_);
}

template <class Policy>
void module_ddp<Policy>::enter_unit(std::size_t u) {
  unit& part = units_[u];
  if (part.members.empty()) return;
  part.held.push_back(core_->gather(part.members));
}

template <class Policy>
void module_ddp<Policy>::leave_unit(std::size_t u, const std::vector<::torch::Tensor>& outputs) {
  unit& part = units_[u];
  if (part.members.empty() || part.held.empty()) return;
  bool backward = false;
  if (::torch::GradMode::is_enabled()) {
    for (const ::torch::Tensor& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      backward = true;
      // Before autograd runs the unit's last operation backward: its values whole again.
      t.register_hook([this, u](const ::torch::Tensor&) { unit_backward(u); });
    }
  }
  // Given back now, unless the backward needs them and keeps them (a module of one unit).
  if (!backward || (extra_.reshard_after_forward && units_.size() > 1)) part.held.pop_back();
}

/// Stage 3: unit u's backward begins (a hook on its output, on autograd's thread).
template <class Policy>
void module_ddp<Policy>::unit_backward(std::size_t u) {
  unit& part = units_[u];
  if (part.in_backward) return;  // another of its outputs got there first
  part.held.push_back(core_->gather(part.members));
  part.in_backward = true;
  part.written = 0;
}

template <class Policy>
void module_ddp<Policy>::release_units() noexcept {
  for (unit& part : units_) {
    part.held.clear();
    part.in_backward = false;
    part.written = 0;
  }
}

/// Ends the step: the buckets are averaged, and every .grad() of a parameter
/// some rank used is its bucket view again.
template <class Policy>
void module_ddp<Policy>::complete_step() {
  release_units();  // nothing stays whole past the step (the optimizer changes the shard)
  if constexpr (memory_space::on_stream) {
    core_->synchronize(current_stream());
  } else {
    core_->synchronize();
  }
  check_slots("after the step's buckets were reduced");
  const std::vector<bool> used = core_->used_anywhere();
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    // PyTorch: a parameter no rank used keeps its .grad() untouched.
    if (used[i]) expose(i);
  }
}

template <class Policy>
void module_ddp<Policy>::synchronize() {
  if (core_->accumulating() || core_->idle()) return;
  if (!core_->options().find_unused_parameters && core_->unmarked() > 0) {
    core_->check_usable();
    throw error(no_gradient_message("synchronize() cannot complete it without zeros for them"));
  }
  complete_step();
}

template <class Policy>
typename module_ddp<Policy>::core_type::no_sync_guard module_ddp<Policy>::no_sync() {
  check_step_closed("no_sync() was called");
  return core_->no_sync();
}

template <class Policy>
void module_ddp<Policy>::zero_grad() {
  check_step_closed("zero_grad() was called");
  core_->zero_grad();
}

/// Throws when the step is open (`what` the user did cannot start the next
/// one), or when the core is unusable after a failure.
template <class Policy>
void module_ddp<Policy>::check_step_closed(const std::string& what) const {
  core_->check_usable();
  if (core_->step_open() && !core_->accumulating()) throw error(no_gradient_message(what));
}

/// Why the step is still open, after `what`: the parameters that got no
/// gradient, and what to do about them.
template <class Policy>
std::string module_ddp<Policy>::no_gradient_message(const std::string& what) const {
  const auto [names, count] = dtrain::detail::pick_names(
      core_->parameters(), [&](std::size_t i) { return !core_->marked(i); });
  std::string out = "dtrain::torch::DistributedDataParallel on rank " + std::to_string(rank_) +
                    ": step " + std::to_string(core_->steps()) + " is not complete, and " + what +
                    ": backward() gave no gradient to " + std::to_string(count) + " of " +
                    std::to_string(slots_.size()) + " parameters (" + names + ")";
  if (count == 0) {
    out +=
        "; every parameter got its gradient, but the backward() "
        "that gave the last ones ended before it could complete the step "
        "(an error inside autograd?); call ddp.synchronize() to complete it";
  } else if (core_->options().find_unused_parameters) {
    out +=
        "; with find_unused_parameters, run the forward pass through ddp(x), "
        "whose graph walk finds the parameters a step does not use, or call ddp.synchronize() "
        "after backward() (it sends zeros for them)";
  } else {
    out +=
        "; they took no part in computing the loss: if parts of the model sit out some steps, "
        "set ddp_options::find_unused_parameters = true (as for PyTorch's DDP)";
  }
  return out;
}

template <class Policy>
void module_ddp<Policy>::before_forward() {
  check_step_closed("ddp(x) began the next one");
  release_units();  // a forward whose backward never came (evaluation, an abandoned loss)
  if constexpr (memory_space::on_stream) core_->set_stream(current_stream());
  // Not under NoGradGuard: evaluation often runs on one rank only.
  if (extra_.broadcast_buffers && core_->size() > 1 && !buffer_tensors_.empty() &&
      ::torch::GradMode::is_enabled()) {
    broadcast_buffers();
  }
}

template <class Policy>
bool module_ddp<Policy>::walks_graph() const {
  return core_->options().find_unused_parameters && !core_->accumulating() &&
         ::torch::GradMode::is_enabled();
}

template <class Policy>
void module_ddp<Policy>::prepare_for_backward(const std::vector<::torch::Tensor>& outputs) {
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
  std::vector<std::size_t> unused;
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    if (!seen.contains(slots_[i].accumulator.get())) unused.push_back(i);
  }
  core_->prepare_for_backward(unused);
}

/// Rank 0's buffers to every rank, bit for bit, in one collective per
/// device: their bytes, rank 0's and zeros elsewhere, summed as uint8 (x +
/// 0 = x). An allreduce rather than a broadcast: it takes the engine's
/// fastest path (Gloo's shared memory on one host; its broadcast is TCP),
/// and the buffers of a model are small.
template <class Policy>
void module_ddp<Policy>::broadcast_buffers() {
  const ::torch::NoGradGuard no_grad;
  std::vector<bool> done(buffer_tensors_.size(), false);
  for (std::size_t first = 0; first < buffer_tensors_.size(); ++first) {
    if (done[first]) continue;
    const ::torch::Device device = buffer_tensors_[first].device();
    std::vector<::torch::Tensor> group, bytes;
    std::int64_t total = 0;
    for (std::size_t i = first; i < buffer_tensors_.size(); ++i) {
      const ::torch::Tensor& t = buffer_tensors_[i];
      if (done[i] || t.device() != device) continue;
      done[i] = true;
      group.push_back(t);
      bytes.push_back(t.reshape({-1}).view(::torch::kUInt8));
      total += bytes.back().numel();
    }
    ::torch::Tensor flat =
        rank_ == 0 ? ::torch::cat(bytes)
                   : ::torch::zeros({total},
                                    ::torch::TensorOptions().dtype(::torch::kUInt8).device(device));
    sum_in_place(detail::buffer_of(flat, "the buffers", rank_));
    if (rank_ == 0) continue;
    std::int64_t at = 0;
    for (std::size_t k = 0; k < group.size(); ++k) {
      const std::int64_t n = bytes[k].numel();
      group[k].view({-1}).view(::torch::kUInt8).copy_(flat.narrow(0, at, n));
      at += n;
    }
  }
}

/// Sums `b` over the ranks in place (the core's communicator; CUDA: on the
/// current stream), and waits.
template <class Policy>
void module_ddp<Policy>::sum_in_place(const buffer& b) {
  if constexpr (memory_space::on_stream) {
    core_->communicator().allreduce(b, b, reduce_op::sum, current_stream()).wait();
  } else {
    core_->communicator().allreduce(b, b, reduce_op::sum).wait();
  }
}

}  // namespace dtrain::torch
