#pragma once
/// @file
/// The `communicator` concept that every backend (MPI, Gloo, NCCL) models,
/// the argument checks they share, and the typed collectives users call.

#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/error.hpp>

#include <concepts>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace dtrain {

/// A group of ranks that runs collectives. Every call is asynchronous and
/// returns a work handle; buffers must stay alive until it completes. All
/// ranks must call the same collectives in the same order.
template <class C>
concept communicator = requires(C& c, const C& cc, buffer b, reduce_op op, int root) {
  { cc.rank() } -> std::convertible_to<int>;
  { cc.size() } -> std::convertible_to<int>;
  { c.allreduce(b, b, op) } -> std::same_as<work>;
  { c.broadcast(b, root) } -> std::same_as<work>;
  { c.allgather(b, b) } -> std::same_as<work>;
  { c.reduce_scatter(b, b, op) } -> std::same_as<work>;
  { c.barrier() } -> std::same_as<work>;
  { c.split(root, root) } -> std::same_as<C>;
  { C::reaches_device_memory } -> std::convertible_to<bool>;
  { C::reaches_host_memory } -> std::convertible_to<bool>;
  { C::name } -> std::convertible_to<std::string_view>;
};

namespace detail {

inline std::string shape(const buffer& b) { return std::to_string(b.count) + " x " + std::string(to_string(b.type)); }

/// Checks what one rank can check alone; throws config_error naming the collective and the rank.
struct argument_check {
  std::string what;  // from describe(); empty when `info` describes the call
  const collective_info* info = nullptr;

  argument_check(std::string description) : what(std::move(description)) {}
  argument_check(const collective_info& i) : info(&i) {}

  void same_type(const buffer& in, const buffer& out) const {
    if (in.type != out.type) fail("input is " + std::string(to_string(in.type)) + ", output " + std::string(to_string(out.type)));
    if (in.where != out.where) fail("input and output live in different memories (host and device)");
  }
  void count(const buffer& b, std::size_t expected, std::string_view which) const {
    if (b.count != expected) {
      fail(std::string(which) + " has " + std::to_string(b.count) + " elements, expected " + std::to_string(expected));
    }
  }
  void op_fits(reduce_op op, dtype t) const {
    if (op == reduce_op::avg && !is_floating(t)) {
      fail("avg of " + std::string(to_string(t)) + " would truncate; average floating-point data, or sum and divide");
    }
  }
  void root(int r, int size) const {
    if (r < 0 || r >= size) fail("root " + std::to_string(r) + " is not a rank of this communicator");
  }
  [[noreturn]] void fail(const std::string& why) const {
    throw config_error((info ? describe(*info) : what) + ": " + why);
  }
};

/// What a rank passed to a collective, compared across ranks in check mode.
struct signature {
  std::int64_t collective, count, type, op_or_root;
  friend bool operator==(const signature&, const signature&) = default;
};

/// Gathers every rank's signature with `gather` (an allgather of int64s that
/// is not itself checked) and throws backend_error naming the first rank
/// whose call differs from this one's.
inline void compare_signatures(const signature& mine, int rank, int size, const std::string& what,
                               const std::function<void(std::span<const std::int64_t>, std::span<std::int64_t>)>& gather) {
  const std::int64_t fields[4] = {mine.collective, mine.count, mine.type, mine.op_or_root};
  std::vector<std::int64_t> all(static_cast<std::size_t>(size) * 4);
  gather(fields, all);
  for (int r = 0; r < size; ++r) {
    const std::int64_t* f = &all[static_cast<std::size_t>(r) * 4];
    signature theirs{f[0], f[1], f[2], f[3]};
    if (theirs != mine) {
      throw backend_error(what + ": rank " + std::to_string(r) + " called collective #" + std::to_string(theirs.collective) +
                              " with " + std::to_string(theirs.count) + " x " +
                              std::string(to_string(static_cast<dtype>(theirs.type))) + " (op/root " +
                              std::to_string(theirs.op_or_root) + "), rank " + std::to_string(rank) + " collective #" +
                              std::to_string(mine.collective) + " with " + std::to_string(mine.count) + " x " +
                              std::string(to_string(static_cast<dtype>(mine.type))) + " (op/root " +
                              std::to_string(mine.op_or_root) + ")",
                          0);
    }
  }
}

}  // namespace detail

// Typed collectives. A std::span is host memory and a device_span GPU
// memory; each backend states which it reaches, and a wrong pairing is a
// compile error (the engine's own run-time check is the second line).

namespace detail {
template <communicator C>
inline constexpr bool host_ok = C::reaches_host_memory;
template <communicator C>
inline constexpr bool device_ok = C::reaches_device_memory;
}  // namespace detail

#define DTRAIN_HOST_ONLY_MESSAGE                                                              \
  "this backend moves host memory only (std::span): copy device data to the host first, or " \
  "use backend::nccl (or MPI built with CUDA) for device_span"
#define DTRAIN_DEVICE_ONLY_MESSAGE                                                             \
  "this backend moves GPU memory only (device_span): NCCL cannot read a host std::span; put " \
  "the data on the device, or send host data over the host control plane (the store, or an " \
  "MPI/Gloo communicator)"

/// In place: every rank's `data` becomes the reduction over all ranks.
template <communicator C, element T>
work allreduce(C& c, std::span<T> data, reduce_op op = reduce_op::sum) {
  static_assert(detail::host_ok<C>, DTRAIN_DEVICE_ONLY_MESSAGE);
  return c.allreduce(host_buffer(data), host_buffer(data), op);
}
/// Out of place: `out` becomes the reduction of every rank's `in`.
template <communicator C, element T>
work allreduce(C& c, std::span<const T> in, std::span<T> out, reduce_op op = reduce_op::sum) {
  static_assert(detail::host_ok<C>, DTRAIN_DEVICE_ONLY_MESSAGE);
  return c.allreduce(host_buffer(in), host_buffer(out), op);
}
template <communicator C, element T>
work allreduce(C& c, device_span<T> data, reduce_op op = reduce_op::sum) {
  static_assert(detail::device_ok<C>, DTRAIN_HOST_ONLY_MESSAGE);
  return c.allreduce(data.as_buffer(), data.as_buffer(), op);
}

/// `data` on every rank becomes root's.
template <communicator C, element T>
work broadcast(C& c, std::span<T> data, int root) {
  static_assert(detail::host_ok<C>, DTRAIN_DEVICE_ONLY_MESSAGE);
  return c.broadcast(host_buffer(data), root);
}
template <communicator C, element T>
work broadcast(C& c, device_span<T> data, int root) {
  static_assert(detail::device_ok<C>, DTRAIN_HOST_ONLY_MESSAGE);
  return c.broadcast(data.as_buffer(), root);
}

/// `out` (size() × in.size() elements) becomes every rank's `in`, in rank order.
template <communicator C, element T>
work allgather(C& c, std::span<const T> in, std::span<T> out) {
  static_assert(detail::host_ok<C>, DTRAIN_DEVICE_ONLY_MESSAGE);
  return c.allgather(host_buffer(in), host_buffer(out));
}
template <communicator C, class In, element T>
requires std::same_as<std::remove_const_t<In>, T>
work allgather(C& c, device_span<In> in, device_span<T> out) {
  static_assert(detail::device_ok<C>, DTRAIN_HOST_ONLY_MESSAGE);
  return c.allgather(in.as_buffer(), out.as_buffer());
}

/// `in` (size() × out.size() elements) is reduced over ranks; rank r receives block r in `out`.
template <communicator C, element T>
work reduce_scatter(C& c, std::span<const T> in, std::span<T> out, reduce_op op = reduce_op::sum) {
  static_assert(detail::host_ok<C>, DTRAIN_DEVICE_ONLY_MESSAGE);
  return c.reduce_scatter(host_buffer(in), host_buffer(out), op);
}
template <communicator C, class In, element T>
requires std::same_as<std::remove_const_t<In>, T>
work reduce_scatter(C& c, device_span<In> in, device_span<T> out, reduce_op op = reduce_op::sum) {
  static_assert(detail::device_ok<C>, DTRAIN_HOST_ONLY_MESSAGE);
  return c.reduce_scatter(in.as_buffer(), out.as_buffer(), op);
}

#undef DTRAIN_HOST_ONLY_MESSAGE
#undef DTRAIN_DEVICE_ONLY_MESSAGE

}  // namespace dtrain
