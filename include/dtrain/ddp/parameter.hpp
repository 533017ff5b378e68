#pragma once
/// @file
/// `dtrain::parameter`: how a model shows DistributedDataParallel its
/// parameters — name, values, gradient, element count and type, device —
/// without dtrain knowing the model's types. Models return a range of them
/// from `parameters()` (and, for state that is not trained but must match
/// across ranks, from `buffers()`).

#include <dtrain/backend/types.hpp>
#include <dtrain/error.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <ranges>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace dtrain {

/// One parameter as dtrain sees it: a view, never an owner.
struct parameter {
  /// Unique within the model; errors and mismatches across ranks name it.
  std::string name;
  /// The values: data, element count, element type, host or device memory.
  buffer values;
  /// Where the gradient is now (values.count elements of values.type); may
  /// be null for a rebindable parameter (dtrain then provides zeroed storage).
  void* gradient = nullptr;
  /// The CUDA device of device memory; -1 for host memory.
  int device = -1;

  /// Set by param() when the model keeps its gradient as a
  /// pointer dtrain may repoint into its own flat bucket storage.
  void* gradient_slot = nullptr;
  void (*rebind)(void* slot, void* storage) noexcept = nullptr;
  /// Set by param(name, T*& values, count, T*& gradient): the model's
  /// pointer to its values, which sharding::parameters (ZeRO stage 3) points
  /// into DDP's storage while the values are gathered, and between them at
  /// a place with no memory behind it, where a read or a write is named
  /// (on the host; null on a GPU) (through `rebind_values`; a pointer's is
  /// `rebind`'s, a LibTorch tensor's moves the tensor's storage).
  void* values_slot = nullptr;
  void (*rebind_values)(void* slot, void* storage) noexcept = nullptr;
  /// The dimensions the model gives the values (a tensor's sizes), for
  /// messages: a model that differs across ranks is named by them
  /// (`[64, 16]` against `[65, 16]`). Empty: a flat list of values.count.
  std::vector<std::size_t> shape = {};
  /// ZeRO stage 3 (ddp_options::sharding = parameters): the unit of the
  /// model (a layer, a block) this parameter belongs to, whatever label the
  /// model gives it (the same on every rank); no bucket holds parameters of
  /// two units, so a unit's gather() makes no other unit's values whole.
  /// -1 (none): buckets are cut by bucket_cap_mb only. Other stages ignore it.
  std::int64_t unit = -1;

  [[nodiscard]] bool rebindable() const noexcept {
    return gradient_slot != nullptr && rebind != nullptr;
  }
  [[nodiscard]] bool values_rebindable() const noexcept {
    return values_slot != nullptr && rebind_values != nullptr && rebindable();
  }
  [[nodiscard]] std::size_t bytes() const noexcept { return values.bytes(); }
};

namespace detail {

template <class V>
using range_element = std::remove_cv_t<std::ranges::range_value_t<V>>;

template <element T>
void rebind_pointer(void* slot, void* storage) noexcept {
  *static_cast<T**>(slot) = static_cast<T*>(storage);
}

/// A random-access list of parameters: a std::vector or std::span of them,
/// or basic_ddp::parameters().
template <class R>
concept parameter_list =
    std::ranges::random_access_range<const R> && std::ranges::sized_range<const R> &&
    std::convertible_to < std::ranges::range_reference_t<const R>,
const parameter& > ;

/// Entry `i` of a parameter_list (an index without -Wsign-conversion's complaint).
template <parameter_list Params>
[[nodiscard]] const parameter& parameter_at(const Params& params, std::size_t i) {
  return std::ranges::begin(params)[static_cast<std::ranges::range_difference_t<const Params>>(i)];
}

template <class V>
concept element_range =
    std::ranges::contiguous_range<V> && std::ranges::sized_range<V> && element<range_element<V>>;

/// The parameters `pick(i)` selects, for a message: their names quoted and
/// comma-separated, the first `shown` of them and then " and N more".
struct picked_names {
  std::string names;
  std::size_t count = 0;
};
template <parameter_list Params, class Pick>
[[nodiscard]] picked_names pick_names(const Params& params, Pick&& pick, std::size_t shown = 8) {
  picked_names out;
  for (std::size_t i = 0; i < std::ranges::size(params); ++i) {
    if (!pick(i)) continue;
    if (out.count < shown) {
      out.names += out.count ? ", '" : "'";
      out.names += parameter_at(params, i).name;
      out.names += "'";
    }
    ++out.count;
  }
  if (out.count > shown) out.names += " and " + std::to_string(out.count - shown) + " more";
  return out;
}

}  // namespace detail

// One overload set, `param`, makes every view. Where the values are is
// told by their type: a contiguous range (std::vector, std::array, std::span,
// a C array) is host memory, a device_span GPU memory. The third argument
// says how the gradient is kept: a pointer dtrain may repoint (T*&), a buffer
// the model keeps (a range, or a device_span), or none (a buffer: state that
// is not trained, returned from buffers()).

/// A host parameter whose gradient the model keeps as a pointer (`float* grad`):
/// dtrain may point it into its flat bucket storage (no copies; the gradient's
/// current values move along). Read gradients through that pointer after
/// construction and after each synchronize(): the first rebuild moves them.
template <detail::element_range V>
[[nodiscard]] parameter param(std::string name, V& values, detail::range_element<V>*& gradient) {
  using T = detail::range_element<V>;
  return {.name = std::move(name),
          .values = {const_cast<T*>(std::ranges::data(values)), std::ranges::size(values),
                     dtype_of<T>, memory::host},
          .gradient = gradient,
          .device = -1,
          .gradient_slot = &gradient,
          .rebind = &detail::rebind_pointer<T>};
}

/// A host parameter whose values and gradient the model keeps as pointers
/// (`float* w; float* grad_w;`), for ddp_options::sharding = parameters (ZeRO
/// stage 3): DDP copies the `count` values `values` points to at construction
/// (the model may free that storage afterwards; null: the shard starts at
/// zero, for the model to write through shard()), keeps this rank's shard of
/// them, and points `values` at the whole values while
/// DistributedDataParallel::gather() holds them (otherwise at a place with
/// no memory, where a read or a write ends the rank with a message that
/// names the parameter; null on a GPU). The
/// gradient is a bucket view, as with param(name, values, gradient). Other
/// stages use it as param(name, std::span(values, count), gradient).
template <element T>
[[nodiscard]] parameter param(std::string name, T*& values, std::size_t count, T*& gradient) {
  return {.name = std::move(name),
          .values = {values, count, dtype_of<T>, memory::host},
          .gradient = gradient,
          .device = -1,
          .gradient_slot = &gradient,
          .rebind = &detail::rebind_pointer<T>,
          .values_slot = &values,
          .rebind_values = &detail::rebind_pointer<T>};
}

/// The same for CUDA memory of `device` (ZeRO stage 3 on GPUs): `values`
/// and `gradient` are device pointers; DDP copies the values on its stream
/// at construction, holds its shard in GPU memory and points `values` into
/// its gathered bucket (GPU memory) while gather() holds it. Other stages
/// use it as param(name, device_span<T>{values, count, device}, gradient).
template <element T>
[[nodiscard]] parameter param(std::string name, T*& values, std::size_t count, T*& gradient,
                              int device) {
  return {.name = std::move(name),
          .values = {values, count, dtype_of<T>, memory::device, device},
          .gradient = gradient,
          .device = device,
          .gradient_slot = &gradient,
          .rebind = &detail::rebind_pointer<T>,
          .values_slot = &values,
          .rebind_values = &detail::rebind_pointer<T>};
}

/// A host parameter whose gradient buffer the model owns and keeps: dtrain
/// copies it in before the reduction and the mean back after.
template <detail::element_range V, detail::element_range G>
[[nodiscard]] parameter param(std::string name, V& values, G& gradient) {
  using T = detail::range_element<V>;
  static_assert(std::same_as<T, detail::range_element<G>>,
                "a parameter and its gradient must have the same element type");
  if (std::ranges::size(gradient) != std::ranges::size(values)) {
    throw config_error("parameter '" + name + "' has " + std::to_string(std::ranges::size(values)) +
                       " values but a gradient of " + std::to_string(std::ranges::size(gradient)));
  }
  return {.name = std::move(name),
          .values = {const_cast<T*>(std::ranges::data(values)), std::ranges::size(values),
                     dtype_of<T>, memory::host},
          .gradient = const_cast<T*>(std::ranges::data(gradient))};
}

/// Host state that is not trained but must agree across ranks (running
/// statistics, step counters), for buffers(): broadcast from rank 0 at construction.
template <detail::element_range V>
[[nodiscard]] parameter param(std::string name, V& values) {
  using T = detail::range_element<V>;
  return {.name = std::move(name),
          .values = {const_cast<T*>(std::ranges::data(values)), std::ranges::size(values),
                     dtype_of<T>, memory::host}};
}

/// A CUDA parameter whose gradient pointer dtrain may point into its flat
/// bucket storage: `param("w", device_span<float>{w, n, dev}, grad_w)`.
template <element T>
[[nodiscard]] parameter param(std::string name, device_span<T> values, T*& gradient) {
  return {.name = std::move(name),
          .values = values.as_buffer(),
          .gradient = gradient,
          .device = values.device,
          .gradient_slot = &gradient,
          .rebind = &detail::rebind_pointer<T>};
}

/// A CUDA parameter whose gradient buffer the model keeps (copy-in, copy-out).
template <element T>
[[nodiscard]] parameter param(std::string name, device_span<T> values, device_span<T> gradient) {
  if (gradient.count != values.count) {
    throw config_error("parameter '" + name + "' has " + std::to_string(values.count) +
                       " values but a gradient of " + std::to_string(gradient.count));
  }
  return {.name = std::move(name),
          .values = values.as_buffer(),
          .gradient = gradient.data,
          .device = values.device};
}

/// Device state that must agree across ranks, for buffers().
template <element T>
[[nodiscard]] parameter param(std::string name, device_span<T> values) {
  return {.name = std::move(name), .values = values.as_buffer(), .device = values.device};
}

// The names before param() was one overload set; kept for existing code.

/// param(name, device_span<T>{values, count, device}, gradient).
template <element T>
[[nodiscard]] parameter device_param(std::string name, T* values, T*& gradient, std::size_t count,
                                     int device) {
  return param(std::move(name), device_span<T>{values, count, device}, gradient);
}

/// param(name, device_span<T>{values, count, device}, device_span<T>{gradient, count, device}).
template <element T>
[[nodiscard]] parameter device_param_copy(std::string name, T* values, T* gradient,
                                          std::size_t count, int device) {
  return param(std::move(name), device_span<T>{values, count, device},
               device_span<T>{gradient, count, device});
}

/// param(name, values).
template <detail::element_range V>
[[nodiscard]] parameter model_buffer(std::string name, V& values) {
  return param(std::move(name), values);
}

/// param(name, device_span<T>{values, count, device}).
template <element T>
[[nodiscard]] parameter device_buffer(std::string name, T* values, std::size_t count, int device) {
  return param(std::move(name), device_span<T>{values, count, device});
}

/// A range whose elements convert to dtrain::parameter.
template <class R>
concept parameter_range = std::ranges::input_range<R> &&
    std::convertible_to<std::ranges::range_reference_t<R>, parameter>;

/// What DistributedDataParallel wraps: anything with `parameters()`, and
/// optionally `buffers()`, each a range of dtrain::parameter.
template <class M>
concept trainable_model = requires(M& m) {
  { m.parameters() } -> parameter_range;
};

template <class M>
concept model_with_buffers = trainable_model<M> && requires(M& m) {
  { m.buffers() } -> parameter_range;
};

}  // namespace dtrain
