#pragma once
/// @file
/// dtrain::checkpoint for LibTorch programs: a torch::nn module's parameters
/// and buffers, a torch::optim optimizer's state and the torch sampler's
/// position, registered with one call each, saved and resumed by the same
/// protocol as every other entry (dtrain/checkpoint/checkpoint.hpp).
///
///   dtrain::checkpoint ckpt(ctx, {.dir = "ckpt", .every = 100});
///   dtrain::torch::add_module(ckpt, model);          // "fc1.weight", "bn.running_mean", ...
///   dtrain::torch::add_optimizer(ckpt, optimizer);   // "optimizer"
///   dtrain::torch::add_sampler(ckpt, sampler);       // "sampler"
///   ckpt.restore();
///
/// CPU tensors are saved as typed values, so restore() checks their names,
/// shapes and types against the checkpoint before it changes anything. A
/// tensor on a GPU (or not contiguous, or of a type dtrain does not move, as
/// bool) is copied to the host at a save and back at restore(); its shape and
/// type are checked when it is loaded.

#include <dtrain/checkpoint.hpp>
#include <dtrain/dtrain.hpp>
#include <dtrain/torch/sampler.hpp>
#include <dtrain/torch/tensor.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace dtrain::torch {

namespace detail {

/// A GPU tensor as bytes: u8 dtype, u32 dimensions, u64 each, then the values.
inline std::string device_tensor_bytes(const ::torch::Tensor& t) {
  const ::torch::Tensor host = t.detach().to(::torch::kCPU).contiguous();
  std::string out;
  const auto type = static_cast<std::uint8_t>(host.scalar_type());
  const auto dims = static_cast<std::uint32_t>(host.dim());
  out.append(reinterpret_cast<const char*>(&type), sizeof type);
  out.append(reinterpret_cast<const char*>(&dims), sizeof dims);
  for (const std::int64_t d : host.sizes()) out.append(reinterpret_cast<const char*>(&d), sizeof d);
  out.append(static_cast<const char*>(host.data_ptr()), host.nbytes());
  return out;
}

inline void load_device_tensor(::torch::Tensor& t, std::string_view bytes,
                               const std::string& name) {
  std::uint8_t type = 0;
  std::uint32_t dims = 0;
  auto bad = [&](const std::string& why) {
    return checkpoint_error("checkpoint: tensor '" + name + "' cannot be loaded: " + why);
  };
  if (bytes.size() < sizeof type + sizeof dims) throw bad("its record is cut short");
  std::memcpy(&type, bytes.data(), sizeof type);
  std::memcpy(&dims, bytes.data() + sizeof type, sizeof dims);
  bytes.remove_prefix(sizeof type + sizeof dims);
  if (bytes.size() < dims * sizeof(std::int64_t)) throw bad("its shape is cut short");
  std::vector<std::int64_t> sizes(dims);
  std::memcpy(sizes.data(), bytes.data(), dims * sizeof(std::int64_t));
  bytes.remove_prefix(dims * sizeof(std::int64_t));
  if (static_cast<c10::ScalarType>(type) != t.scalar_type() || sizes != t.sizes().vec()) {
    throw bad("the checkpoint holds " +
              std::string(c10::toString(static_cast<c10::ScalarType>(type))) + " " +
              c10::str(c10::IntArrayRef(sizes)) + ", the module " +
              std::string(c10::toString(t.scalar_type())) + " " + c10::str(t.sizes()));
  }
  if (bytes.size() != t.nbytes()) throw bad("its values have the wrong length");
  ::torch::NoGradGuard no_grad;
  const ::torch::Tensor host = ::torch::from_blob(const_cast<char*>(bytes.data()), t.sizes(),
                                                  ::torch::TensorOptions().dtype(t.scalar_type()));
  t.copy_(host);
}

/// One tensor of a module as the entry `full`: typed values on the host,
/// bytes (copied to and from the host) otherwise.
inline void add_tensor(dtrain::checkpoint& ckpt, const std::string& full,
                       const ::torch::Tensor& t) {
  if (!t.defined()) return;
  if (t.numel() > 0 &&
      (t.storage().data() == nullptr || dtrain::detail::value_fence::holds(t.storage().data()))) {
    // ZeRO stage 3: DDP holds the values, each rank its shard.
    throw config_error("dtrain::torch::add_module: tensor '" + full +
                       "' has no values on this rank (ddp_options::sharding = parameters "
                       "holds them in DDP, each rank its shard): register the module with "
                       "add_module(ckpt, ddp), which saves them as one sharded entry");
  }
  const bool plain = t.is_cpu() && t.layout() == c10::kStrided && t.is_contiguous() &&
                     element_of(t.scalar_type()).has_value();
  if (!plain) {  // on a GPU, strided, or of a type dtrain has no name for: as bytes
    ::torch::Tensor target = t;
    ckpt.add(
        full, [target] { return device_tensor_bytes(target); },
        [target, full](std::string_view bytes) mutable {
          load_device_tensor(target, bytes, full);
        });
    return;
  }
  ckpt.add(full, buffer_of(t, "tensor '" + full + "'", 0), checkpoint_scope::replicated,
           shape_of(t));
}

}  // namespace detail

/// Registers every parameter and buffer of `module` (named as
/// named_parameters() and named_buffers() name them, after `prefix`) as
/// replicated state: DDP keeps them equal on every rank.
inline void add_module(dtrain::checkpoint& ckpt, const ::torch::nn::Module& module,
                       const std::string& prefix = "") {
  for (const auto& item : module.named_parameters(/*recurse=*/true))
    detail::add_tensor(ckpt, prefix + item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/true))
    detail::add_tensor(ckpt, prefix + item.key(), item.value());
}
/// The same for a module holder (`Net model;` made with TORCH_MODULE).
template <class Holder>
requires requires(const Holder& h) { h.ptr(); }
void add_module(dtrain::checkpoint& ckpt, const Holder& module, const std::string& prefix = "") {
  add_module(ckpt, *module.ptr(), prefix);
}

/// Registers the module of a dtrain::torch::DistributedDataParallel. With
/// ddp_options::sharding = parameters (ZeRO stage 3), where each rank holds
/// only its shard of the trained parameters' values, they are one sharded
/// entry `prefix + "parameters"` (each rank saves its ranges, and a job of
/// another world size re-cuts them: checkpoint::add_sharded(name, ddp)),
/// beside the frozen parameters and the buffers, replicated; at the other
/// stages, add_module(ckpt, ddp.module(), prefix). With
/// ddp_options::master_weights the sharded entry holds the float32 master
/// weights (at stages 0-2 it is `prefix + "master"`, beside the module's
/// 16-bit values), from which a restore rounds the values again.
template <class DDP>
requires requires(DDP& d) {
  d.operator->();
  d.core().shard_ranges();
}
void add_module(dtrain::checkpoint& ckpt, DDP& ddp, const std::string& prefix = "") {
  const ::torch::nn::Module& module = *ddp.operator->();
  if (ddp.core().options().sharding != sharding::parameters) {
    add_module(ckpt, module, prefix);
    if (ddp.core().options().master_weights) ckpt.add_sharded(prefix + "master", ddp.core());
    return;
  }
  ckpt.add_sharded(prefix + "parameters", ddp.core());
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) detail::add_tensor(ckpt, prefix + item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true))
    detail::add_tensor(ckpt, prefix + item.key(), item.value());
}

/// Registers a torch::optim optimizer's state (momentum buffers, Adam's
/// moments, step counts), serialised by LibTorch itself (torch::save). An
/// optimizer over a sharded DDP's shard_parameters() holds this rank's shard:
/// register it with the overload that takes the DDP (re-cut for any world
/// size), or pass checkpoint_scope::per_rank (the same world size only).
inline void add_optimizer(dtrain::checkpoint& ckpt, ::torch::optim::Optimizer& optimizer,
                          const std::string& name = "optimizer",
                          checkpoint_scope scope = checkpoint_scope::replicated) {
  ckpt.add(
      name,
      [&optimizer] {
        std::ostringstream out;
        ::torch::save(optimizer, out);
        return std::move(out).str();
      },
      [&optimizer](std::string_view bytes) {
        std::istringstream in{std::string(bytes)};
        ::torch::load(optimizer, in);
      },
      scope);
}

namespace detail {

/// The key a torch::optim optimizer files a parameter's state under: the
/// tensor's implementation, as a pointer (LibTorch 2) or its printed address
/// (LibTorch 1.13's c10::guts::to_string).
template <class Map>
[[nodiscard]] typename Map::key_type optimizer_state_key(const Map& /*state*/,
                                                         const ::torch::Tensor& p) {
  using key = typename Map::key_type;
  if constexpr (std::is_same_v<key, std::string>) {
    std::ostringstream out;
    out << static_cast<const void*>(p.unsafeGetTensorImpl());
    return out.str();
  } else {
    return static_cast<key>(p.unsafeGetTensorImpl());
  }
}

/// What a sharded optimizer's state is made of, per optimizer class: its
/// per-parameter tensors (each the piece's size) and a step count.
enum class sharded_optimizer_kind { sgd, adam, adamw };

struct sharded_optimizer_layout {
  sharded_optimizer_kind kind = sharded_optimizer_kind::sgd;
  std::vector<std::string> fields;  ///< state tensors, by the names LibTorch gives them
};

inline sharded_optimizer_layout sharded_layout_of(::torch::optim::Optimizer& optimizer,
                                                  const std::string& name, int rank) {
  sharded_optimizer_layout out;
  if (optimizer.param_groups().empty()) {
    throw config_error("dtrain::torch::add_optimizer on rank " + std::to_string(rank) +
                       ": optimizer '" + name + "' has no parameter groups");
  }
  auto first_options = [&]() -> ::torch::optim::OptimizerOptions& {
    return optimizer.param_groups().front().options();
  };
  if (dynamic_cast<::torch::optim::SGD*>(&optimizer)) {
    out.kind = sharded_optimizer_kind::sgd;
    if (static_cast<::torch::optim::SGDOptions&>(first_options()).momentum() != 0)
      out.fields = {"momentum_buffer"};
  } else if (dynamic_cast<::torch::optim::AdamW*>(&optimizer)) {
    out.kind = sharded_optimizer_kind::adamw;
    out.fields = {"exp_avg", "exp_avg_sq"};
    if (static_cast<::torch::optim::AdamWOptions&>(first_options()).amsgrad())
      out.fields.push_back("max_exp_avg_sq");
  } else if (dynamic_cast<::torch::optim::Adam*>(&optimizer)) {
    out.kind = sharded_optimizer_kind::adam;
    out.fields = {"exp_avg", "exp_avg_sq"};
    if (static_cast<::torch::optim::AdamOptions&>(first_options()).amsgrad())
      out.fields.push_back("max_exp_avg_sq");
  } else {
    throw config_error("dtrain::torch::add_optimizer on rank " + std::to_string(rank) +
                       ": optimizer '" + name +
                       "' over a sharded DDP is re-cut across world sizes for torch::optim::SGD, "
                       "Adam and AdamW; "
                       "for another optimizer pass checkpoint_scope::per_rank instead of the DDP "
                       "(its state then resumes on the same world size only)");
  }
  return out;
}

/// The state tensor `field` of one parameter's state, and its step count
/// (null for SGD, which keeps none).
template <class State>
::torch::Tensor& adam_field(State& s, const std::string& field) {
  if (field == "exp_avg") return s.exp_avg();
  if (field == "exp_avg_sq") return s.exp_avg_sq();
  return s.max_exp_avg_sq();
}
inline ::torch::Tensor& state_field(::torch::optim::OptimizerParamState& state,
                                    sharded_optimizer_kind kind, const std::string& field) {
  switch (kind) {
    case sharded_optimizer_kind::sgd:
      return static_cast<::torch::optim::SGDParamState&>(state).momentum_buffer();
    case sharded_optimizer_kind::adam:
      return adam_field(static_cast<::torch::optim::AdamParamState&>(state), field);
    case sharded_optimizer_kind::adamw: break;
  }
  return adam_field(static_cast<::torch::optim::AdamWParamState&>(state), field);
}
inline std::int64_t state_step(::torch::optim::OptimizerParamState& state,
                               sharded_optimizer_kind kind) {
  switch (kind) {
    case sharded_optimizer_kind::sgd: return 1;  // SGD's state exists once it has stepped
    case sharded_optimizer_kind::adam:
      return static_cast<std::int64_t>(static_cast<::torch::optim::AdamParamState&>(state).step());
    case sharded_optimizer_kind::adamw: break;
  }
  return static_cast<std::int64_t>(static_cast<::torch::optim::AdamWParamState&>(state).step());
}
inline std::unique_ptr<::torch::optim::OptimizerParamState> fresh_state(sharded_optimizer_kind kind,
                                                                        std::int64_t step) {
  switch (kind) {
    case sharded_optimizer_kind::sgd: return std::make_unique<::torch::optim::SGDParamState>();
    case sharded_optimizer_kind::adam: {
      auto s = std::make_unique<::torch::optim::AdamParamState>();
      s->step(step);
      return s;
    }
    case sharded_optimizer_kind::adamw: break;
  }
  auto s = std::make_unique<::torch::optim::AdamWParamState>();
  s->step(step);
  return s;
}

/// The host copies of a sharded optimizer's state that the checkpoint saves
/// and restores: one array of shard_elements() per state tensor, indexed by
/// the pieces' state_offset, the step count and each group's learning rate.
struct sharded_optimizer_state {
  ::torch::optim::Optimizer* optimizer = nullptr;
  sharded_optimizer_layout layout;
  std::vector<::torch::Tensor> pieces;         ///< shard_parameters()
  std::vector<std::size_t> offsets;            ///< each piece's state_offset
  dtype type = dtype::float32;                 ///< of every piece
  std::vector<std::vector<std::byte>> arrays;  ///< per field
  std::int64_t step = 0;                       ///< 0: the optimizer has not stepped
  std::vector<double> lr;                      ///< per param group

  void fill() {
    auto& map = optimizer->state();
    step = 0;
    const std::size_t element = size_of(type);
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      const auto it = map.find(optimizer_state_key(map, pieces[k]));
      for (std::size_t f = 0; f < layout.fields.size(); ++f) {
        std::byte* to = arrays[f].data() + offsets[k] * element;
        const std::size_t bytes = static_cast<std::size_t>(pieces[k].numel()) * element;
        const ::torch::Tensor* t =
            it == map.end() ? nullptr : &state_field(*it->second, layout.kind, layout.fields[f]);
        if (t == nullptr || !t->defined()) {
          std::memset(to, 0, bytes);
          continue;
        }
        const ::torch::Tensor host = t->detach().to(::torch::kCPU).contiguous();
        std::memcpy(to, host.data_ptr(), bytes);
      }
      if (it != map.end()) step = std::max(step, state_step(*it->second, layout.kind));
    }
    for (std::size_t g = 0; g < lr.size(); ++g)
      lr[g] = optimizer->param_groups()[g].options().get_lr();
  }

  void apply() {
    for (std::size_t g = 0; g < lr.size(); ++g)
      optimizer->param_groups()[g].options().set_lr(lr[g]);
    auto& map = optimizer->state();
    const std::size_t element = size_of(type);
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      const auto key = optimizer_state_key(map, pieces[k]);
      if (step == 0) {  // saved before the first step: no state, as a fresh optimizer
        map.erase(key);
        continue;
      }
      auto state = fresh_state(layout.kind, step);
      for (std::size_t f = 0; f < layout.fields.size(); ++f) {
        const ::torch::Tensor host =
            ::torch::from_blob(arrays[f].data() + offsets[k] * element, {pieces[k].numel()},
                               ::torch::TensorOptions().dtype(pieces[k].scalar_type()));
        state_field(*state, layout.kind, layout.fields[f]) =
            host.to(pieces[k].device(), /*non_blocking=*/false, /*copy=*/true);
      }
      map[key] = std::move(state);
    }
  }
};

}  // namespace detail

/// Registers the state of a torch::optim optimizer built on a sharded DDP's
/// shard_parameters() (SGD, Adam or AdamW) so that it resumes on any world
/// size: each state tensor (momentum_buffer; exp_avg, exp_avg_sq and, with
/// amsgrad, max_exp_avg_sq) as a sharded entry `name.<tensor>` cut as the
/// DDP's shard (checkpoint::add_sharded), the step count and each param
/// group's learning rate replicated. Without sharding: add_optimizer(ckpt,
/// optimizer, name), the optimizer as LibTorch serialises it. config_error
/// naming the rank for an optimizer not built on ddp.shard_parameters(), or
/// of another class.
template <class DDP>
requires requires(DDP& d) {
  { d.shard_parameters() } -> std::convertible_to<const std::vector<::torch::Tensor>&>;
  d.core().shard_ranges();
}
void add_optimizer(dtrain::checkpoint& ckpt, ::torch::optim::Optimizer& optimizer, DDP& ddp,
                   const std::string& name = "optimizer") {
  const auto& core = ddp.core();
  if (core.options().sharding == sharding::none) {
    add_optimizer(ckpt, optimizer, name);
    return;
  }
  const int rank = core.rank();
  auto state = std::make_shared<detail::sharded_optimizer_state>();
  state->optimizer = &optimizer;
  state->pieces = ddp.shard_parameters();
  // The optimizer must hold exactly the shard's tensors, in order.
  std::size_t held = 0;
  bool same = true;
  for (const auto& group : optimizer.param_groups()) {
    for (const ::torch::Tensor& p : group.params()) {
      same = same && held < state->pieces.size() &&
             p.unsafeGetTensorImpl() == state->pieces[held].unsafeGetTensorImpl();
      ++held;
    }
  }
  if (!same || held != state->pieces.size()) {
    throw config_error("dtrain::torch::add_optimizer on rank " + std::to_string(rank) +
                       ": optimizer '" + name + "' holds " + std::to_string(held) +
                       " tensors that are not the sharded DDP's shard_parameters() (" +
                       std::to_string(state->pieces.size()) +
                       " pieces): build it on ddp.shard_parameters()");
  }
  state->layout = detail::sharded_layout_of(optimizer, name, rank);
  const std::vector<shard_piece> pieces(core.shard().begin(), core.shard().end());
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    if (k == 0) state->type = pieces[k].values.type;
    if (pieces[k].values.type != state->type ||
        (state->type != dtype::float32 && state->type != dtype::float64)) {
      throw config_error("dtrain::torch::add_optimizer on rank " + std::to_string(rank) +
                         ": optimizer '" + name + "': the shard holds " +
                         std::string(to_string(pieces[k].values.type)) +
                         " parameters; its state is re-cut for one type, float32 or float64");
    }
    state->offsets.push_back(pieces[k].state_offset);
  }
  const std::size_t elements = core.shard_elements();
  state->arrays.assign(state->layout.fields.size(),
                       std::vector<std::byte>(elements * size_of(state->type)));
  state->lr.assign(optimizer.param_groups().size(), 0.0);
  ckpt.add(name + ".step", state->step);
  ckpt.add(name + ".lr", state->lr);
  for (std::size_t f = 0; f < state->layout.fields.size(); ++f) {
    ckpt.add_sharded(name + "." + state->layout.fields[f],
                     buffer{state->arrays[f].data(), elements, state->type, memory::host},
                     core.shard_ranges(), core.model_elements());
  }
  ckpt.add_hooks([state] { state->fill(); }, [state] { state->apply(); });
}

/// Registers the sampler's position in the global sample order.
inline void add_sampler(dtrain::checkpoint& ckpt, distributed_sampler& sampler,
                        const std::string& name = "sampler") {
  ckpt.add(sampler.shard(), name);
}

}  // namespace dtrain::torch
