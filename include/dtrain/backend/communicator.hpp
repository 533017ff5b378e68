#pragma once
/// @file
/// The `communicator` concept that every backend (MPI, Gloo, NCCL) models,
/// the argument checks they share, and the typed collectives users call.

#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/config.hpp>
#include <dtrain/diagnostics/ring.hpp>
#include <dtrain/error.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace dtrain {

/// A group of ranks that runs collectives. Every call is asynchronous and
/// returns a work handle; buffers must stay alive until it completes. All
/// ranks must call the same collectives in the same order.
///
/// `alltoall(in, out)`: `in` and `out` hold size() blocks of the same count;
/// block j of `in` goes to rank j, and block i of `out` comes from rank i (out
/// of place: `in` and `out` must not overlap).
///
/// `split(color, key)` is collective: the ranks that pass the same color form
/// a new communicator, ranked by key (then by rank here). A negative color
/// means the same on every engine (MPI_UNDEFINED, NCCL_SPLIT_NOCOLOR): this
/// rank joins no group, and gets a communicator whose `valid()` is false,
/// `rank()` -1 and `size()` 0, on which every collective is a config_error.
template <class C>
concept communicator = requires(C& c, const C& cc, buffer b, reduce_op op, int root) {
  { cc.rank() } -> std::convertible_to<int>;
  { cc.size() } -> std::convertible_to<int>;
  { c.allreduce(b, b, op) } -> std::same_as<work>;
  { c.broadcast(b, root) } -> std::same_as<work>;
  { c.allgather(b, b) } -> std::same_as<work>;
  { c.reduce_scatter(b, b, op) } -> std::same_as<work>;
  { c.alltoall(b, b) } -> std::same_as<work>;
  { c.barrier() } -> std::same_as<work>;
  { c.split(root, root) } -> std::same_as<C>;
  { cc.valid() } -> std::convertible_to<bool>;
  { C::reaches_device_memory } -> std::convertible_to<bool>;
  { C::reaches_host_memory } -> std::convertible_to<bool>;
  { C::name } -> std::convertible_to<std::string_view>;
};

namespace detail {

inline std::string shape(const buffer& b) {
  return std::to_string(b.count) + " x " + std::string(to_string(b.type));
}

/// What a collective throws on a communicator that is not valid(): one that
/// split() gave this rank for a negative color (`left_out`), or a moved-from one.
[[noreturn]] DTRAIN_DETAIL_INLINE void throw_invalid(const std::string& what, bool left_out);

/// The collectives every engine knows, numbered as check mode sends them.
enum class collective_kind : std::uint8_t {
  other,
  allreduce,
  broadcast,
  allgather,
  reduce_scatter,
  barrier,
  allreduce_many,
  split,
  alltoall
};

/// Their names, indexed by collective_kind ("?": another).
inline constexpr std::string_view collective_kinds[] = {
    "?",       "allreduce",      "broadcast", "allgather", "reduce_scatter",
    "barrier", "allreduce_many", "split",     "alltoall"};

[[nodiscard]] DTRAIN_DETAIL_INLINE std::int64_t collective_kind_code(
    std::string_view kind) noexcept;

/// Where an engine's collectives find their buffers. A buffer elsewhere is a
/// config_error: "input is host memory, and <rule>".
struct memory_reach {
  bool host = true;
  bool device = true;
  std::string_view rule{};  ///< "NCCL reduces device memory only: pass GPU memory ..."
};

/// Checks what one rank can check alone; throws config_error naming the collective and the rank.
struct argument_check {
  std::string what;  // from describe(); empty when `info` describes the call
  const collective_info* info = nullptr;

  argument_check(std::string description) : what(std::move(description)) {}
  argument_check(const collective_info& i) : info(&i) {}

  void same_type(const buffer& in, const buffer& out) const;
  void count(const buffer& b, std::size_t expected, std::string_view which) const;
  void op_fits(reduce_op op, dtype t) const;
  /// `b` (`which`, or "buffer <index>") lives where the engine reaches, and is
  /// not a null pointer with elements (the engine would read them and crash).
  void reachable(const buffer& b, std::string_view which, const memory_reach& reach,
                 std::ptrdiff_t index = -1) const;
  void root(int r, int size) const;
  /// `in` and `out` share no byte (a collective that cannot run in place).
  void apart(const buffer& in, const buffer& out) const;
  [[noreturn]] void fail(const std::string& why) const {
    throw config_error((info ? describe(*info) : what) + ": " + why);
  }

 private:
  static std::string name(std::string_view which, std::ptrdiff_t index) {
    return index < 0 ? std::string(which) : std::string(which) + " " + std::to_string(index);
  }
};

/// One collective as an engine receives it. Every engine's chain checks it
/// (check_arguments), numbers it in its ring and compares it in check mode
/// from this one description, so a call reads the same on MPI, Gloo and NCCL.
struct collective_call {
  collective_kind kind = collective_kind::barrier;
  buffer in{};   ///< broadcast: the data
  buffer out{};  ///< broadcast: the data
  int op = -1;   ///< a reduce_op, or -1
  int root = -1;
  std::span<const buffer> many{};  ///< allreduce_many: each buffer reduced in place

  [[nodiscard]] static collective_call allreduce(buffer in, buffer out, reduce_op op) noexcept {
    return {collective_kind::allreduce, in, out, static_cast<int>(op), -1, {}};
  }
  [[nodiscard]] static collective_call broadcast(buffer data, int root) noexcept {
    return {collective_kind::broadcast, data, data, -1, root, {}};
  }
  [[nodiscard]] static collective_call allgather(buffer in, buffer out) noexcept {
    return {collective_kind::allgather, in, out, -1, -1, {}};
  }
  [[nodiscard]] static collective_call reduce_scatter(buffer in, buffer out,
                                                      reduce_op op) noexcept {
    return {collective_kind::reduce_scatter, in, out, static_cast<int>(op), -1, {}};
  }
  [[nodiscard]] static collective_call alltoall(buffer in, buffer out) noexcept {
    return {collective_kind::alltoall, in, out, -1, -1, {}};
  }
  [[nodiscard]] static collective_call barrier() noexcept { return {}; }
  [[nodiscard]] static collective_call allreduce_many(std::span<const buffer> buffers,
                                                      reduce_op op) noexcept {
    return {collective_kind::allreduce_many, {}, {}, static_cast<int>(op), -1, buffers};
  }

  /// What the ring, check mode and messages say of it: the elements every
  /// rank must agree on (the input's; reduce_scatter: the output's;
  /// allreduce_many: all of them, with the first buffer's type).
  [[nodiscard]] collective_info info(std::string_view engine, int rank, int size) const noexcept;

  /// False for a call with no elements: it completes at once (after its
  /// signature is compared, in check mode). A barrier always moves.
  [[nodiscard]] bool moves_data() const noexcept;
};

/// The argument checks of every engine, per collective: buffers where the
/// engine reaches (`reach`), types and counts that fit, an op the type allows,
/// a root that is a rank. `info` names the call (call.info()).
DTRAIN_DETAIL_INLINE void check_arguments(const collective_call& call, const collective_info& info,
                                          const memory_reach& reach);

/// What a rank passed to its `seq`-th collective on a communicator, compared
/// across ranks in check mode: the ring's fingerprint (call_record) as int64s,
/// built and compared the same way by every engine.
struct signature {
  std::int64_t seq = 0;   ///< the communicator's sequence number, as in its ring
  std::int64_t kind = 0;  ///< collective_kind_code()
  std::int64_t count = 0;
  std::int64_t type = 0;  ///< a dtype
  std::int64_t op = -1;   ///< a reduce_op, or -1
  std::int64_t root = -1;
  static constexpr std::size_t fields = 6;
  friend bool operator==(const signature&, const signature&) = default;
};

/// The signature of collective number `seq`, described by `info`.
[[nodiscard]] DTRAIN_DETAIL_INLINE signature signature_of(std::int64_t seq,
                                                          const collective_info& info) noexcept;

/// How check mode names a call, for every engine: "collective #3:
/// allreduce(sum, float32 × 5)" (the ring's describe_call).
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string describe_collective(const signature& s);

/// Gathers every rank's signature with `gather` (an allgather of int64s that
/// is not itself checked) and throws backend_error naming the first rank
/// whose call differs from this one's. `what` names this call (what_text()),
/// put into words only then.
template <class What, class Gather>
void compare_signatures(const signature& mine, int rank, int size, const What& what,
                        Gather&& gather) {
  const std::int64_t fields[signature::fields] = {mine.seq,  mine.kind, mine.count,
                                                  mine.type, mine.op,   mine.root};
  std::vector<std::int64_t> all(static_cast<std::size_t>(size) * signature::fields);
  gather(std::span<const std::int64_t>(fields), std::span<std::int64_t>(all));
  for (int r = 0; r < size; ++r) {
    const std::int64_t* f = &all[static_cast<std::size_t>(r) * signature::fields];
    const signature theirs{f[0], f[1], f[2], f[3], f[4], f[5]};
    if (theirs != mine) {
      throw backend_error(what_text(what) + ": rank " + std::to_string(r) + " called " +
                              describe_collective(theirs) + ", rank " + std::to_string(rank) +
                              " called " + describe_collective(mine),
                          0);
    }
  }
}

}  // namespace detail

// Typed collectives. A contiguous range (std::vector, std::array,
// std::span, a C array) is host memory and a device_span GPU memory; each backend states which it
// reaches, and a wrong pairing is a compile error (the engine's own run-time check is the second
// line).

namespace detail {
template <communicator C>
inline constexpr bool host_ok = C::reaches_host_memory;
template <communicator C>
inline constexpr bool device_ok = C::reaches_device_memory;
}  // namespace detail

#define DTRAIN_HOST_ONLY_MESSAGE                                                             \
  "this backend moves host memory only (std::span): copy device data to the host first, or " \
  "use backend::nccl (or MPI built with CUDA) for device_span"
#define DTRAIN_DEVICE_ONLY_MESSAGE                                                            \
  "this backend moves GPU memory only (device_span): NCCL cannot read a host std::span; put " \
  "the data on the device, or send host data over the host control plane (the store, or an "  \
  "MPI/Gloo communicator)"

namespace detail {
/// Host data a typed collective takes: any contiguous sized range of a
/// dtrain element type (std::vector, std::array, std::span, a C array).
template <class R>
concept host_range = std::ranges::contiguous_range<R> && std::ranges::sized_range<R> &&
    element<std::remove_cv_t<std::ranges::range_value_t<R>>>;
/// A host_range whose elements may be written (an output).
template <class R>
concept writable_host_range =
    host_range<R> && !std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<R>>>;
template <host_range R>
using host_element = std::remove_cv_t<std::ranges::range_value_t<R>>;

/// The buffer a host range is, by its data and size (no copy).
template <host_range R>
[[nodiscard]] buffer host_view(R&& r) noexcept {
  using T = host_element<R>;
  return {const_cast<T*>(std::ranges::data(r)), std::ranges::size(r), dtype_of<T>, memory::host};
}
/// `In` is `T` or `const T`: an input span may be read-only.
template <class In, class T>
concept element_or_const = std::same_as<std::remove_const_t<In>, T>;
}  // namespace detail

/// In place: every rank's `data` becomes the reduction over all ranks.
/// `data`: a std::vector, std::array, std::span or C array of an element type.
template <communicator C, detail::host_range R>
work allreduce(C& c, R&& data, reduce_op op = reduce_op::sum) {
  static_assert(detail::host_ok<C>, DTRAIN_DEVICE_ONLY_MESSAGE);
  static_assert(detail::writable_host_range<R>,
                "allreduce in place writes `data`: pass it non-const");
  return c.allreduce(detail::host_view(data), detail::host_view(data), op);
}
/// Out of place: `out` becomes the reduction of every rank's `in` (same element type).
template <communicator C, detail::host_range In, detail::host_range Out>
work allreduce(C& c, const In& in, Out&& out, reduce_op op = reduce_op::sum) {
  static_assert(detail::host_ok<C>, DTRAIN_DEVICE_ONLY_MESSAGE);
  static_assert(std::same_as<detail::host_element<In>, detail::host_element<Out>>,
                "allreduce: `in` and `out` must have the same element type");
  static_assert(detail::writable_host_range<Out>, "allreduce writes `out`: pass it non-const");
  return c.allreduce(detail::host_view(in), detail::host_view(out), op);
}
template <communicator C, element T>
work allreduce(C& c, device_span<T> data, reduce_op op = reduce_op::sum) {
  static_assert(detail::device_ok<C>, DTRAIN_HOST_ONLY_MESSAGE);
  return c.allreduce(data.as_buffer(), data.as_buffer(), op);
}

/// `data` on every rank becomes root's.
template <communicator C, detail::host_range R>
work broadcast(C& c, R&& data, int root) {
  static_assert(detail::host_ok<C>, DTRAIN_DEVICE_ONLY_MESSAGE);
  static_assert(detail::writable_host_range<R>, "broadcast writes `data`: pass it non-const");
  return c.broadcast(detail::host_view(data), root);
}
template <communicator C, element T>
work broadcast(C& c, device_span<T> data, int root) {
  static_assert(detail::device_ok<C>, DTRAIN_HOST_ONLY_MESSAGE);
  return c.broadcast(data.as_buffer(), root);
}

/// `out` (size() × in.size() elements) becomes every rank's `in`, in rank order.
template <communicator C, detail::host_range In, detail::host_range Out>
work allgather(C& c, const In& in, Out&& out) {
  static_assert(detail::host_ok<C>, DTRAIN_DEVICE_ONLY_MESSAGE);
  static_assert(std::same_as<detail::host_element<In>, detail::host_element<Out>>,
                "allgather: `in` and `out` must have the same element type");
  static_assert(detail::writable_host_range<Out>, "allgather writes `out`: pass it non-const");
  return c.allgather(detail::host_view(in), detail::host_view(out));
}
template <communicator C, element T, detail::element_or_const<T> In>
work allgather(C& c, device_span<In> in, device_span<T> out) {
  static_assert(detail::device_ok<C>, DTRAIN_HOST_ONLY_MESSAGE);
  return c.allgather(in.as_buffer(), out.as_buffer());
}

/// `in` (size() × out.size() elements) is reduced over ranks; rank r receives block r in `out`.
template <communicator C, detail::host_range In, detail::host_range Out>
work reduce_scatter(C& c, const In& in, Out&& out, reduce_op op = reduce_op::sum) {
  static_assert(detail::host_ok<C>, DTRAIN_DEVICE_ONLY_MESSAGE);
  static_assert(std::same_as<detail::host_element<In>, detail::host_element<Out>>,
                "reduce_scatter: `in` and `out` must have the same element type");
  static_assert(detail::writable_host_range<Out>, "reduce_scatter writes `out`: pass it non-const");
  return c.reduce_scatter(detail::host_view(in), detail::host_view(out), op);
}
template <communicator C, element T, detail::element_or_const<T> In>
work reduce_scatter(C& c, device_span<In> in, device_span<T> out, reduce_op op = reduce_op::sum) {
  static_assert(detail::device_ok<C>, DTRAIN_HOST_ONLY_MESSAGE);
  return c.reduce_scatter(in.as_buffer(), out.as_buffer(), op);
}

/// `in` and `out` (size() blocks of the same count each, apart): block j of
/// `in` goes to rank j; block i of `out` comes from rank i.
template <communicator C, detail::host_range In, detail::host_range Out>
work alltoall(C& c, const In& in, Out&& out) {
  static_assert(detail::host_ok<C>, DTRAIN_DEVICE_ONLY_MESSAGE);
  static_assert(std::same_as<detail::host_element<In>, detail::host_element<Out>>,
                "alltoall: `in` and `out` must have the same element type");
  static_assert(detail::writable_host_range<Out>, "alltoall writes `out`: pass it non-const");
  return c.alltoall(detail::host_view(in), detail::host_view(out));
}
template <communicator C, element T, detail::element_or_const<T> In>
work alltoall(C& c, device_span<In> in, device_span<T> out) {
  static_assert(detail::device_ok<C>, DTRAIN_HOST_ONLY_MESSAGE);
  return c.alltoall(in.as_buffer(), out.as_buffer());
}

#undef DTRAIN_HOST_ONLY_MESSAGE
#undef DTRAIN_DEVICE_ONLY_MESSAGE

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/backend/communicator-inl.hpp>
#endif
