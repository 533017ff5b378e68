#pragma once
/// @file
/// What collectives move: element types (with portable float16 / bfloat16),
/// reduction operations, and `buffer`, a view whose type is known at run time.

#include <dtrain/config.hpp>
#include <dtrain/error.hpp>

#include <bit>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#if DTRAIN_HAS_CUDA()
#include <cuda_runtime.h>
#endif

namespace dtrain {

/// IEEE 754 binary16, stored as its bits. Converts to and from float with
/// round-to-nearest-even; arithmetic goes through float.
struct float16 {
  std::uint16_t bits = 0;

  float16() = default;
  explicit float16(float f) noexcept : bits(from_float(f)) {}
  explicit operator float() const noexcept { return to_float(bits); }
  friend bool operator==(float16 a, float16 b) noexcept { return a.bits == b.bits; }

  static std::uint16_t from_float(float f) noexcept;

  static float to_float(std::uint16_t h) noexcept;
};

/// bfloat16: the top half of a float32, rounded to nearest even.
struct bfloat16 {
  std::uint16_t bits = 0;

  bfloat16() = default;
  explicit bfloat16(float f) noexcept : bits(from_float(f)) {}
  explicit operator float() const noexcept { return to_float(bits); }
  friend bool operator==(bfloat16 a, bfloat16 b) noexcept { return a.bits == b.bits; }

  static std::uint16_t from_float(float f) noexcept;
  static float to_float(std::uint16_t b) noexcept {
    return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
  }
};

/// The element types every engine moves.
enum class dtype : std::uint8_t { float32, float64, float16, bfloat16, int32, int64, uint8 };

template <class T>
concept element = std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, float16> ||
    std::same_as<T, bfloat16> || std::same_as<T, std::int32_t> || std::same_as<T, std::int64_t> ||
    std::same_as<T, std::uint8_t>;

template <element T>
inline constexpr dtype dtype_of = std::same_as<T, float>          ? dtype::float32
                                  : std::same_as<T, double>       ? dtype::float64
                                  : std::same_as<T, float16>      ? dtype::float16
                                  : std::same_as<T, bfloat16>     ? dtype::bfloat16
                                  : std::same_as<T, std::int32_t> ? dtype::int32
                                  : std::same_as<T, std::int64_t> ? dtype::int64
                                                                  : dtype::uint8;

[[nodiscard]] constexpr std::size_t size_of(dtype t) noexcept {
  switch (t) {
    case dtype::float64:
    case dtype::int64: return 8;
    case dtype::float32:
    case dtype::int32: return 4;
    case dtype::float16:
    case dtype::bfloat16: return 2;
    case dtype::uint8: return 1;
  }
  return 0;
}

[[nodiscard]] constexpr std::string_view to_string(dtype t) noexcept {
  switch (t) {
    case dtype::float32: return "float32";
    case dtype::float64: return "float64";
    case dtype::float16: return "float16";
    case dtype::bfloat16: return "bfloat16";
    case dtype::int32: return "int32";
    case dtype::int64: return "int64";
    case dtype::uint8: return "uint8";
  }
  return "unknown";
}

[[nodiscard]] constexpr bool is_floating(dtype t) noexcept {
  return t == dtype::float32 || t == dtype::float64 || t == dtype::float16 || t == dtype::bfloat16;
}

/// Reductions. `avg` is the sum divided by the number of ranks, for
/// floating-point types only (an integer mean would silently truncate).
enum class reduce_op : std::uint8_t { sum, avg, min, max, prod };

[[nodiscard]] constexpr std::string_view to_string(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::avg: return "avg";
    case reduce_op::min: return "min";
    case reduce_op::max: return "max";
    case reduce_op::prod: return "prod";
  }
  return "unknown";
}

/// Where a buffer lives.
enum class memory : std::uint8_t { host, device };

/// A buffer whose element type is known at run time: what the engines see.
struct buffer {
  void* data = nullptr;
  std::size_t count = 0;
  dtype type = dtype::float32;
  memory where = memory::host;
  /// The CUDA device of device memory, when known (a device_span states it);
  /// -1: host memory, or the caller's current device.
  int device = -1;

  [[nodiscard]] std::size_t bytes() const noexcept { return count * size_of(type); }
};

/// Views host memory as a buffer.
template <element T>
[[nodiscard]] buffer host_buffer(std::span<T> s) noexcept {
  return {const_cast<std::remove_const_t<T>*>(s.data()), s.size(), dtype_of<std::remove_const_t<T>>,
          memory::host};
}
template <element T>
[[nodiscard]] buffer host_buffer(std::span<const T> s) noexcept {
  return {const_cast<T*>(s.data()), s.size(), dtype_of<T>, memory::host};
}

/// A CUDA stream where CUDA is compiled in (cudaStream_t), else a pointer
/// that is always null: how collectives that can order themselves after the
/// caller's GPU work take the caller's stream (null: the legacy default stream).
#if DTRAIN_HAS_CUDA()
using stream_handle = cudaStream_t;
#else
using stream_handle = void*;
#endif

/// A span of device (GPU) memory: pointer, count and the CUDA device. The
/// type says where the data lives, so a backend that cannot reach device
/// memory rejects it at compile time (and NCCL rejects a std::span).
template <class T>
requires element<std::remove_const_t<T>>
struct device_span {
  T* data = nullptr;
  std::size_t count = 0;
  int device = -1;  ///< the CUDA device it was allocated on; -1: not stated

  [[nodiscard]] buffer as_buffer() const noexcept {
    return {const_cast<std::remove_const_t<T>*>(data), count, dtype_of<std::remove_const_t<T>>,
            memory::device, device};
  }
  [[nodiscard]] std::size_t size() const noexcept { return count; }
  /// The read-only view, for the inputs of allgather and reduce_scatter.
  template <class U = T>
  requires(!std::is_const_v<U>) [[nodiscard]] operator device_span<const U>() const noexcept {
    return {data, count, device};
  }
};

namespace detail {

/// Reduces `in` into `inout` element-wise on the host (the engines' custom
/// paths: 16-bit floats under MPI and Gloo). avg reduces as sum; the caller
/// divides once at the end.
template <element T>
void reduce_host(T* inout, const T* in, std::size_t n, reduce_op op) noexcept {
  if constexpr (std::same_as<T, float16> || std::same_as<T, bfloat16>) {
    for (std::size_t i = 0; i < n; ++i) {
      float a = static_cast<float>(inout[i]), b = static_cast<float>(in[i]);
      float r = op == reduce_op::min    ? std::fmin(a, b)
                : op == reduce_op::max  ? std::fmax(a, b)
                : op == reduce_op::prod ? a * b
                                        : a + b;
      inout[i] = T(r);
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      T a = inout[i], b = in[i];
      inout[i] = op == reduce_op::min    ? (b < a ? b : a)
                 : op == reduce_op::max  ? (a < b ? b : a)
                 : op == reduce_op::prod ? static_cast<T>(a * b)
                                         : static_cast<T>(a + b);
    }
  }
}

/// Calls f.template operator()<T>() for the buffer's element type.
template <class F>
decltype(auto) visit(dtype t, F&& f) {
  switch (t) {
    case dtype::float32: return f.template operator()<float>();
    case dtype::float64: return f.template operator()<double>();
    case dtype::float16: return f.template operator()<float16>();
    case dtype::bfloat16: return f.template operator()<bfloat16>();
    case dtype::int32: return f.template operator()<std::int32_t>();
    case dtype::int64: return f.template operator()<std::int64_t>();
    case dtype::uint8: return f.template operator()<std::uint8_t>();
  }
  return f.template operator()<float>();
}

/// Divides every element by `n` (the avg of a host buffer reduced as sum).
DTRAIN_DETAIL_INLINE void divide_host(buffer b, int n) noexcept;

}  // namespace detail
}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/backend/types-inl.hpp>
#endif
