#pragma once
/// @file
/// LibTorch tensors as dtrain sees them: their memory as a dtrain::buffer
/// (a config_error naming the tensor when dtrain cannot move it), and the
/// slot through which a parameter's .grad() follows its bucket.

#include <dtrain/dtrain.hpp>

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::torch::detail {

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

/// A 1-D tensor over `b`'s memory (not owned), of its type and device.
[[nodiscard]] inline ::torch::Tensor tensor_over(const buffer& b) {
  c10::ScalarType type = c10::ScalarType::Float;
  switch (b.type) {
    case dtype::float32: type = c10::ScalarType::Float; break;
    case dtype::float64: type = c10::ScalarType::Double; break;
    case dtype::float16: type = c10::ScalarType::Half; break;
    case dtype::bfloat16: type = c10::ScalarType::BFloat16; break;
    default:
      throw config_error("dtrain::torch: a " + std::string(to_string(b.type)) +
                         " buffer has no tensor type here (floating point only)");
  }
  const ::torch::Device device =
      b.where == memory::device
          ? ::torch::Device(::torch::kCUDA, static_cast<c10::DeviceIndex>(b.device))
          : ::torch::Device(::torch::kCPU);
  return ::torch::from_blob(b.data, {static_cast<std::int64_t>(b.count)},
                            ::torch::TensorOptions().dtype(type).device(device));
}

/// The tensor's sizes, as dtrain::parameter::shape (messages name `[64, 16]`).
[[nodiscard]] inline std::vector<std::size_t> shape_of(const ::torch::Tensor& t) {
  std::vector<std::size_t> shape;
  for (const std::int64_t d : t.sizes()) shape.push_back(static_cast<std::size_t>(d));
  return shape;
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

/// Where a parameter's values live at ZeRO stage 3 (ddp_options::sharding =
/// parameters): the tensor's storage, which rebind_values points at DDP's
/// whole values while a unit's gather holds them, and between them at the
/// parameter's place in DDP's fence (dtrain/ddp/fence.hpp: a kernel that
/// reads the tensor there ends the process with a message that names it;
/// null on a GPU). The tensor keeps its sizes; its storage, not owned any
/// more, never outlives DDP's memory in use.
struct value_slot {
  c10::Storage storage;
  c10::Device device{c10::kCPU};
};

/// dtrain::parameter::rebind_values for a LibTorch parameter: the storage's
/// data becomes `place` (not owned); the first call frees the module's own
/// allocation, whose values DDP has copied into its shard.
inline void rebind_values(void* slot, void* place) noexcept {
  auto& s = *static_cast<value_slot*>(slot);
  s.storage.set_data_ptr_noswap(c10::DataPtr(place, s.device));
}

}  // namespace dtrain::torch::detail
