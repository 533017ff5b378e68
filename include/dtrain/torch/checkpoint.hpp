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
#include <sstream>
#include <string>
#include <string_view>
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

}  // namespace detail

/// Registers every parameter and buffer of `module` (named as
/// named_parameters() and named_buffers() name them, after `prefix`) as
/// replicated state: DDP keeps them equal on every rank.
inline void add_module(dtrain::checkpoint& ckpt, const ::torch::nn::Module& module,
                       const std::string& prefix = "") {
  auto add_tensor = [&](const std::string& name, const ::torch::Tensor& t) {
    const std::string full = prefix + name;
    if (!t.defined()) return;
    const bool plain = t.is_cpu() && t.layout() == c10::kStrided && t.is_contiguous() &&
                       dtrain::torch::detail::element_of(t.scalar_type()).has_value();
    if (!plain) {  // on a GPU, strided, or of a type dtrain has no name for: as bytes
      ::torch::Tensor target = t;
      ckpt.add(
          full, [target] { return detail::device_tensor_bytes(target); },
          [target, full](std::string_view bytes) mutable {
            detail::load_device_tensor(target, bytes, full);
          });
      return;
    }
    ckpt.add(full, dtrain::torch::detail::buffer_of(t, "tensor '" + full + "'", 0),
             checkpoint_scope::replicated, dtrain::torch::detail::shape_of(t));
  };
  for (const auto& item : module.named_parameters(/*recurse=*/true))
    add_tensor(item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/true))
    add_tensor(item.key(), item.value());
}
/// The same for a module holder (`Net model;` made with TORCH_MODULE).
template <class Holder>
requires requires(const Holder& h) { h.ptr(); }
void add_module(dtrain::checkpoint& ckpt, const Holder& module, const std::string& prefix = "") {
  add_module(ckpt, *module.ptr(), prefix);
}

/// Registers a torch::optim optimizer's state (momentum buffers, Adam's
/// moments, step counts), serialised by LibTorch itself (torch::save). An
/// optimizer over a sharded DDP's shard_parameters() holds this rank's shard:
/// pass checkpoint_scope::per_rank.
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

/// Registers the sampler's position in the global sample order.
inline void add_sampler(dtrain::checkpoint& ckpt, distributed_sampler& sampler,
                        const std::string& name = "sampler") {
  ckpt.add(sampler.shard(), name);
}

}  // namespace dtrain::torch
