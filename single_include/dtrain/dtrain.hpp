// dtrain: header-only C++20 data-parallel distributed training.
// Single-header distribution, generated from include/dtrain/ by
// tools/amalgamate.cmake. Do not edit; run `cmake -P tools/amalgamate.cmake`.
// SPDX-License-Identifier: MIT

#ifndef DTRAIN_SINGLE_INCLUDE_DTRAIN_HPP
#define DTRAIN_SINGLE_INCLUDE_DTRAIN_HPP

// ---- begin dtrain/dtrain.hpp ----
/// @file
/// The one header users include. It only includes; it has no code of its own.
/// dtrain_doctor's host inspection (dtrain/doctor/) and the LibTorch
/// integration (dtrain/torch.hpp) are not part of it: include them directly.

// ---- begin dtrain/backend/communicator.hpp ----
/// @file
/// The `communicator` concept that every backend (MPI, Gloo, NCCL) models,
/// the argument checks they share, and the typed collectives users call.

// ---- begin dtrain/backend/ring.hpp ----
/// @file
/// The ring of a communicator's last collectives: what each rank publishes
/// when a collective times out or SIGUSR1 arrives, so that one table can name
/// the rank that is behind (see backend/desync.hpp). Every engine records into
/// it at the one place that numbers its collectives.

// ---- begin dtrain/backend/types.hpp ----
/// @file
/// What collectives move: element types (with portable float16 / bfloat16),
/// reduction operations, and `buffer`, a view whose type is known at run time.

// ---- begin dtrain/config.hpp ----
/// @file
/// Version and the engine switches. The engines are opt-in: the CMake target
/// dtrain::dtrain defines DTRAIN_WITH_MPI / DTRAIN_WITH_GLOO / DTRAIN_WITH_NCCL
/// for the engines it found; a user of the single header defines them before
/// including it. Test them with the function-like macros below, so that a typo
/// is a compile error rather than a silently false `#if`.

#define DTRAIN_VERSION_MAJOR 0
#define DTRAIN_VERSION_MINOR 1
#define DTRAIN_VERSION_PATCH 0
#define DTRAIN_VERSION_STRING "0.1.0"

#if defined(DTRAIN_WITH_MPI) && (DTRAIN_WITH_MPI + 0)
#define DTRAIN_HAS_MPI() 1
// dtrain calls MPI's C API only. Without these, a plain g++ build against Open
// MPI 4 or MPICH also needs their deprecated C++ bindings (libmpi_cxx). A
// program that wants those bindings includes <mpi.h> before dtrain.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#else
#define DTRAIN_HAS_MPI() 0
#endif

#if defined(DTRAIN_WITH_GLOO) && (DTRAIN_WITH_GLOO + 0)
#define DTRAIN_HAS_GLOO() 1
#else
#define DTRAIN_HAS_GLOO() 0
#endif

#if defined(DTRAIN_WITH_NCCL) && (DTRAIN_WITH_NCCL + 0)
#define DTRAIN_HAS_NCCL() 1
#else
#define DTRAIN_HAS_NCCL() 0
#endif

// CUDA's runtime comes with NCCL (dtrain::dtrain links CUDA::cudart with it),
// or on its own with DTRAIN_WITH_CUDA=1.
#if DTRAIN_HAS_NCCL() || (defined(DTRAIN_WITH_CUDA) && (DTRAIN_WITH_CUDA + 0))
#define DTRAIN_HAS_CUDA() 1
#else
#define DTRAIN_HAS_CUDA() 0
#endif

// Separate compilation (dtrain/compiled.hpp has the whole story). With
// DTRAIN_SEPARATE_COMPILATION=1 a TU uses dtrain's compiled library: its
// non-template functions (the store, the agent, the engines' glue, world
// discovery...) are only declared here, and one TU of the library defines
// them, with DTRAIN_COMPILED_DEFINITIONS=1 (src/core.cpp; by hand, the file
// that writes DTRAIN_INSTANTIATE_COMPILED_POLICIES()). Header-only, every TU
// has them, inline.
#if defined(DTRAIN_SEPARATE_COMPILATION) && (DTRAIN_SEPARATE_COMPILATION + 0)
#define DTRAIN_HAS_SEPARATE_COMPILATION() 1
#else
#define DTRAIN_HAS_SEPARATE_COMPILATION() 0
#endif
#if DTRAIN_HAS_SEPARATE_COMPILATION() && defined(DTRAIN_COMPILED_DEFINITIONS) && \
    (DTRAIN_COMPILED_DEFINITIONS + 0)
#define DTRAIN_DETAIL_BODIES() 1  // the library's definitions TU
#define DTRAIN_DETAIL_INLINE
#elif DTRAIN_HAS_SEPARATE_COMPILATION()
#define DTRAIN_DETAIL_BODIES() 0  // a TU that links the library: declarations only
#define DTRAIN_DETAIL_INLINE
#else
#define DTRAIN_DETAIL_BODIES() 1  // header-only
#define DTRAIN_DETAIL_INLINE inline
#endif
// ---- end dtrain/config.hpp ----
// ---- begin dtrain/error.hpp ----
/// @file
/// The error hierarchy. Every failure dtrain reports is a dtrain::error; the
/// children are the cases a caller can act on.


#include <stdexcept>
#include <string>
#include <utility>

namespace dtrain {

/// Root of every exception dtrain throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Bad environment, argv or options. The message names each variable involved
/// and its value (`RANK=7 is not below WORLD_SIZE=4`). `dtrain_whoami` and
/// `dtrain::run` exit with status 2 on it.
class config_error : public error {
 public:
  using error::error;
};

/// A blocking or awaited operation ran past its timeout; the message says what
/// it waited for and how long.
class timeout_error : public error {
 public:
  using error::error;
};

/// The rendezvous store could not be reached, served or trusted, or the rank
/// that bootstraps a value for every rank (rank 0: the store's address, the
/// store token, the NCCL unique id) failed to provide it.
class rendezvous_error : public error {
 public:
  using error::error;
};

/// The store refused this client's token: the token differs from the one the
/// store was started with (DTRAIN_STORE_TOKEN or store_options::token set
/// differently on some rank, or a token file left by an earlier job). Knocking
/// again with the same token cannot help; reading the token again may.
class token_error : public rendezvous_error {
 public:
  using rendezvous_error::rendezvous_error;
};

/// A collective engine (MPI, Gloo, NCCL, CUDA) reported a failure. Keeps the
/// engine's own code next to the message.
class backend_error : public error {
 public:
  backend_error(const std::string& what, int engine_code)
      : error(what), engine_code_(engine_code) {}

  /// The engine's own status code (MPI error class, ncclResult_t, cudaError_t).
  [[nodiscard]] int engine_code() const noexcept { return engine_code_; }

 private:
  int engine_code_;
};

/// A checkpoint could not be written, found or loaded: the message names the
/// directory or file, the rank and the reason (no space left, a file that is
/// truncated or corrupt, a checkpoint of another model). A failed save leaves
/// the previous checkpoint as it was; a failed load changes nothing.
class checkpoint_error : public error {
 public:
  using error::error;
};

/// A worker's program cannot be started: it is missing (exit_status() 127,
/// as a shell's "command not found") or not executable (126, as a shell's
/// "permission denied"). The agent ends the job with that status.
class program_error : public error {
 public:
  program_error(const std::string& what, int exit_status) : error(what), status_(exit_status) {}
  /// 127 for a missing program, 126 for one that cannot be executed.
  [[nodiscard]] int exit_status() const noexcept { return status_; }

 private:
  int status_;
};

/// Exit status of a process whose input (environment, options) was bad.
inline constexpr int config_error_exit_status = 2;

namespace detail {

/// The exit status and text of the exception in flight (call it in a catch
/// block): a program_error's own status (127 / 126), 2 for a config_error,
/// else 1. The one mapping from failure to exit status: dtrain::run, the
/// node agent and dtrun all end with it.
DTRAIN_DETAIL_INLINE std::pair<int, std::string> current_failure();
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::pair<int, std::string> current_failure() {
  try {
    throw;
  } catch (const program_error& e) {
    return {e.exit_status(), e.what()};
  } catch (const config_error& e) {
    return {config_error_exit_status, e.what()};
  } catch (const std::exception& e) {
    return {1, e.what()};
  } catch (...) {
    return {1, "an exception that is not a std::exception"};
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail

}  // namespace dtrain
// ---- end dtrain/error.hpp ----

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

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::uint16_t float16::from_float(float f) noexcept {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  std::uint32_t sign = (x >> 16) & 0x8000u;
  std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u)
    return static_cast<std::uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to infinity
  if (abs < 0x38800000u) {                                                    // subnormal or zero
    if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);
    std::uint32_t mant = (abs & 0x007fffffu) | 0x00800000u;
    int shift = 126 - static_cast<int>(abs >> 23);  // 14 .. 24
    std::uint32_t half = mant >> shift;
    std::uint32_t rest = mant & ((1u << shift) - 1);
    std::uint32_t mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1u))) ++half;
    return static_cast<std::uint16_t>(sign | half);
  }
  std::uint32_t half = ((abs - 0x38000000u) >> 13);
  std::uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return static_cast<std::uint16_t>(sign | half);
}

DTRAIN_DETAIL_INLINE float float16::to_float(std::uint16_t h) noexcept {
  std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return std::bit_cast<float>(sign);
    float value = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -value : value;
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}
#endif  // DTRAIN_DETAIL_BODIES()

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

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::uint16_t bfloat16::from_float(float f) noexcept {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u)
    return static_cast<std::uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>(x >> 16);
}
#endif  // DTRAIN_DETAIL_BODIES()

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
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void divide_host(buffer b, int n) noexcept {
  visit(b.type, [&]<class T>() {
    if constexpr (std::same_as<T, float16> || std::same_as<T, bfloat16>) {
      auto* p = static_cast<T*>(b.data);
      for (std::size_t i = 0; i < b.count; ++i)
        p[i] = T(static_cast<float>(p[i]) / static_cast<float>(n));
    } else if constexpr (std::floating_point<T>) {
      auto* p = static_cast<T*>(b.data);
      for (std::size_t i = 0; i < b.count; ++i) p[i] /= static_cast<T>(n);
    }
  });
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail
}  // namespace dtrain
// ---- end dtrain/backend/types.hpp ----

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain::detail {

/// Where a collective comes from, when not straight from the user: "bucket" 3.
/// Set by label_scope on the thread that issues the collective.
struct call_label {
  const char* what = nullptr;  ///< a string literal ("bucket"); null: a user call
  std::int64_t index = -1;
};

/// The label the calling thread's collectives are recorded with.
DTRAIN_DETAIL_INLINE call_label& current_call_label() noexcept;
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE call_label& current_call_label() noexcept {
  thread_local call_label label;
  return label;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Labels the collectives this thread issues while it lives ("bucket 3").
class label_scope {
 public:
  label_scope(const char* what, std::int64_t index) noexcept : saved_(current_call_label()) {
    current_call_label() = {what, index};
  }
  explicit label_scope(call_label label) noexcept : saved_(current_call_label()) {
    current_call_label() = label;
  }
  ~label_scope() { current_call_label() = saved_; }
  label_scope(const label_scope&) = delete;
  label_scope& operator=(const label_scope&) = delete;

 private:
  call_label saved_;
};

/// How far one collective got on this rank.
enum class call_state : std::uint8_t { issued, completed, failed, timed_out };

inline constexpr std::string_view to_string(call_state s) noexcept {
  switch (s) {
    case call_state::issued: return "waiting";
    case call_state::completed: return "completed";
    case call_state::failed: return "failed";
    case call_state::timed_out: return "timed out";
  }
  return "?";
}

/// A collective's fingerprint as one rank saw it, "call #N: kind, type,
/// count", with where it came from and how far it got. The same struct for
/// every engine, in the ring, on the wire and in the analysis.
struct call_record {
  std::int64_t seq = 0;  ///< 1 for the communicator's first collective
  std::string kind;      ///< "allreduce"
  dtype type = dtype::float32;
  std::size_t count = 0;
  int op = -1;        ///< a reduce_op, or -1
  int root = -1;      ///< broadcast's root, or -1
  std::string label;  ///< "bucket 3"; empty: a user call
  call_state state = call_state::issued;

  /// What every rank must agree on for the same sequence number.
  [[nodiscard]] bool same_call(const call_record& o) const noexcept {
    return kind == o.kind && type == o.type && count == o.count && op == o.op && root == o.root;
  }
};

/// "allreduce(float32 × 65536, bucket 4)"; the op only when `with_op`.
DTRAIN_DETAIL_INLINE std::string describe_call(const call_record& r, bool with_op = false);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string describe_call(const call_record& r, bool with_op) {
  std::string out = r.kind + "(";
  if (with_op && r.op >= 0) out += std::string(to_string(static_cast<reduce_op>(r.op))) + ", ";
  if (r.kind != "barrier")
    out += std::string(to_string(r.type)) + " \u00d7 " + std::to_string(r.count);
  if (r.root >= 0) out += ", root " + std::to_string(r.root);
  if (!r.label.empty()) out += (r.kind != "barrier" ? ", " : "") + r.label;
  return out + ")";
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The last `capacity` collectives of one communicator. Thread-safe: the
/// engine records from the issuing thread, work handles settle from theirs,
/// the diagnostics thread takes snapshots. One short lock per collective.
class collective_ring {
 public:
  static constexpr std::size_t capacity = 64;
  static constexpr std::size_t kept_splits = 8;

  /// `name` tells the communicator apart from its splits: "world", "world/split 1 (color 0)".
  explicit collective_ring(std::string name = "world") : name_(std::move(name)) {}

  [[nodiscard]] const std::string& name() const noexcept { return name_; }

  /// The ring of a communicator split from this one with `color`. Its name
  /// counts this ring's splits, so every rank that splits in the same order
  /// (as it must) gives the same child the same name. This ring keeps the
  /// last `kept_splits` children, even once their communicators are gone:
  /// where a rank was on them still explains a stall.
  std::shared_ptr<collective_ring> make_child(int color);

  /// This ring and those of its kept splits (recursively), each with its name.
  [[nodiscard]] std::vector<std::pair<std::string, std::vector<call_record>>> snapshot_all() const;

  /// Records a new collective with the calling thread's label; returns its sequence number.
  std::int64_t issue(std::string_view kind, dtype type, std::size_t count, int op, int root);

  /// Marks collective `seq` finished (or failed, or given up); a no-op once it left the ring.
  void settle(std::int64_t seq, call_state state) noexcept;

  /// The recorded collectives, oldest first.
  [[nodiscard]] std::vector<call_record> snapshot() const;

  /// The sequence number of the last collective issued (0: none yet).
  [[nodiscard]] std::int64_t last() const;

 private:
  std::string name_;
  mutable std::mutex mutex_;
  std::array<call_record, capacity> slots_{};
  std::int64_t last_ = 0;
  std::int64_t splits_ = 0;
  std::vector<std::shared_ptr<collective_ring>> children_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::shared_ptr<collective_ring> collective_ring::make_child(int color) {
  std::lock_guard lock(mutex_);
  auto child = std::make_shared<collective_ring>(name_ + "/split " + std::to_string(++splits_) +
                                                 " (color " + std::to_string(color) + ")");
  if (children_.size() == kept_splits) children_.erase(children_.begin());
  children_.push_back(child);
  return child;
}

DTRAIN_DETAIL_INLINE std::vector<std::pair<std::string, std::vector<call_record>>>
collective_ring::snapshot_all() const {
  std::vector<std::pair<std::string, std::vector<call_record>>> out;
  out.emplace_back(name_, snapshot());
  std::vector<std::shared_ptr<collective_ring>> children;
  {
    std::lock_guard lock(mutex_);
    children = children_;
  }
  for (const auto& ring : children) {
    for (auto& entry : ring->snapshot_all()) out.push_back(std::move(entry));
  }
  return out;
}

DTRAIN_DETAIL_INLINE std::int64_t collective_ring::issue(std::string_view kind, dtype type,
                                                         std::size_t count, int op, int root) {
  const call_label label = current_call_label();
  std::lock_guard lock(mutex_);
  const std::int64_t seq = ++last_;
  call_record& r = slots_[static_cast<std::size_t>(seq) % capacity];
  r.seq = seq;
  r.kind.assign(kind);  // short names: no allocation (small-string buffer)
  r.type = type;
  r.count = count;
  r.op = op;
  r.root = root;
  r.label.clear();
  if (label.what) r.label.append(label.what).append(" ").append(std::to_string(label.index));
  r.state = call_state::issued;
  return seq;
}

DTRAIN_DETAIL_INLINE void collective_ring::settle(std::int64_t seq, call_state state) noexcept {
  std::lock_guard lock(mutex_);
  call_record& r = slots_[static_cast<std::size_t>(seq) % capacity];
  if (r.seq == seq && r.state == call_state::issued) r.state = state;
}

DTRAIN_DETAIL_INLINE std::vector<call_record> collective_ring::snapshot() const {
  std::lock_guard lock(mutex_);
  std::vector<call_record> out;
  const std::int64_t first = last_ >= static_cast<std::int64_t>(capacity)
                                 ? last_ - static_cast<std::int64_t>(capacity) + 1
                                 : 1;
  for (std::int64_t s = first; s <= last_; ++s)
    out.push_back(slots_[static_cast<std::size_t>(s) % capacity]);
  return out;
}

DTRAIN_DETAIL_INLINE std::int64_t collective_ring::last() const {
  std::lock_guard lock(mutex_);
  return last_;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/backend/ring.hpp ----
// ---- begin dtrain/backend/work.hpp ----
/// @file
/// `work`: the handle every asynchronous collective returns.

// ---- begin dtrain/env/environment.hpp ----
/// @file
/// A snapshot of environment variables. World discovery is a pure function of
/// such a snapshot and argv, so every launcher can be tested from a captured
/// environment without touching the process's own.


#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

extern "C" {
extern char** environ;  // POSIX; declared here because <unistd.h> only does so under _GNU_SOURCE
}

namespace dtrain {

/// An immutable name → value map of environment variables.
class environment {
 public:
  environment() = default;

  /// Builds a snapshot from literal pairs, as tests and launchers do.
  environment(std::initializer_list<std::pair<const std::string, std::string>> vars)
      : vars_(vars) {}

  explicit environment(std::map<std::string, std::string, std::less<>> vars)
      : vars_(std::move(vars)) {}

  /// Copies the calling process's environment (`environ`). Entries without '='
  /// are skipped; they cannot be set through setenv and name nothing.
  [[nodiscard]] static environment from_process();

  /// The value of `name`, or nullopt when unset. A variable set to the empty
  /// string is returned as an empty view: set-but-empty is not the same as unset.
  [[nodiscard]] std::optional<std::string_view> get(std::string_view name) const;

  [[nodiscard]] bool contains(std::string_view name) const {
    return vars_.find(name) != vars_.end();
  }

  /// A copy with `name` set to `value`, for launchers that derive a child's environment.
  [[nodiscard]] environment with(std::string name, std::string value) const;

  /// A copy without `name`.
  [[nodiscard]] environment without(std::string_view name) const;

  [[nodiscard]] const std::map<std::string, std::string, std::less<>>& vars() const noexcept {
    return vars_;
  }

 private:
  std::map<std::string, std::string, std::less<>> vars_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE environment environment::from_process() {
  std::map<std::string, std::string, std::less<>> vars;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string_view text(*entry);
    if (auto eq = text.find('='); eq != std::string_view::npos && eq > 0) {
      vars.emplace(std::string(text.substr(0, eq)), std::string(text.substr(eq + 1)));
    }
  }
  return environment(std::move(vars));
}

DTRAIN_DETAIL_INLINE std::optional<std::string_view> environment::get(std::string_view name) const {
  if (auto it = vars_.find(name); it != vars_.end()) return std::string_view(it->second);
  return std::nullopt;
}

DTRAIN_DETAIL_INLINE environment environment::with(std::string name, std::string value) const {
  auto vars = vars_;
  vars.insert_or_assign(std::move(name), std::move(value));
  return environment(std::move(vars));
}

DTRAIN_DETAIL_INLINE environment environment::without(std::string_view name) const {
  auto vars = vars_;
  if (auto it = vars.find(name); it != vars.end()) vars.erase(it);
  return environment(std::move(vars));
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
// ---- end dtrain/env/environment.hpp ----
// ---- begin dtrain/env/variables.hpp ----
/// @file
/// Typed readers of environment variables from a snapshot (dtrain::environment):
/// counts, text, durations, switches and ports. Each failure is a config_error
/// that quotes the variable and its value (detail/parse.hpp does the parsing).

// ---- begin dtrain/detail/parse.hpp ----
/// @file
/// Strict parsers for the small values launchers hand us: counts, ports and
/// `host:port`. Each failure is a config_error that quotes the variable and its
/// value, because the person reading it has to find which launcher set what.
/// Text in, value out: reading them from an environment is env/variables.hpp.


#include <charconv>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace dtrain::detail {

/// A value together with the text that stated it, e.g. {3, "RANK=3"}.
template <class T>
struct sourced {
  T value;
  std::string origin;
};
using sourced_int = sourced<int>;
using sourced_text = sourced<std::string>;

/// `NAME=value`, with the value in quotes when it is empty or has blanks, so
/// that `RANK=" 3"` in a message shows the stray space.
DTRAIN_DETAIL_INLINE std::string assignment(std::string_view name, std::string_view value);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string assignment(std::string_view name, std::string_view value) {
  bool quote = value.empty() || value.find_first_of(" \t\r\n") != std::string_view::npos;
  std::string out(name);
  out += '=';
  if (quote) out += '"';
  out += value;
  if (quote) out += '"';
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Parses a non-negative decimal integer that fits an int. `what` is how the
/// message names the input, usually assignment(name, text).
DTRAIN_DETAIL_INLINE int parse_non_negative(const std::string& what, std::string_view text);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE int parse_non_negative(const std::string& what, std::string_view text) {
  if (!text.empty() && text.front() == '-' && text.size() > 1 &&
      text.find_first_not_of("0123456789", 1) == std::string_view::npos) {
    throw config_error(what + " is negative: ranks, sizes and indices count from 0");
  }
  if (text.empty() || text.find_first_not_of("0123456789") != std::string_view::npos) {
    throw config_error(what + " is not a non-negative integer");
  }
  int value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec == std::errc::result_out_of_range) {
    throw config_error(what + " is too large (the limit is " +
                       std::to_string(std::numeric_limits<int>::max()) + ")");
  }
  if (ec != std::errc() || end != text.data() + text.size()) {
    throw config_error(what + " is not a non-negative integer");
  }
  return value;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Checks that a port is in 1..65535.
DTRAIN_DETAIL_INLINE int check_port(const std::string& what, int port);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE int check_port(const std::string& what, int port) {
  if (port < 1 || port > 65535) throw config_error(what + " is outside the port range 1-65535");
  return port;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Splits `text` at every `separator` (an empty text gives no pieces).
DTRAIN_DETAIL_INLINE std::vector<std::string> split(std::string_view text, char separator);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::vector<std::string> split(std::string_view text, char separator) {
  std::vector<std::string> out;
  if (text.empty()) return out;
  std::size_t start = 0;
  while (true) {
    auto end = text.find(separator, start);
    out.emplace_back(text.substr(start, end == std::string_view::npos ? end : end - start));
    if (end == std::string_view::npos) return out;
    start = end + 1;
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

/// A host with an optional port.
struct host_port {
  std::string host;
  std::optional<int> port;
};

/// Splits `host:port`, `[v6addr]:port`, `host` or a bare IPv6 address. `what`
/// names the input for messages.
DTRAIN_DETAIL_INLINE host_port split_host_port(const std::string& what, std::string_view text);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE host_port split_host_port(const std::string& what, std::string_view text) {
  if (text.empty()) throw config_error(what + " has an empty address");
  std::string_view host = text;
  std::string_view port;
  bool has_port = false;
  if (text.front() == '[') {
    auto close = text.find(']');
    if (close == std::string_view::npos || close == 1) {
      throw config_error(what + " has an unbalanced or empty '[' address");
    }
    host = text.substr(1, close - 1);
    auto rest = text.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') throw config_error(what + " has text after ']' that is not ':port'");
      port = rest.substr(1);
      has_port = true;
    }
  } else if (auto colon = text.find(':'); colon != std::string_view::npos &&
                                          text.find(':', colon + 1) == std::string_view::npos) {
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    has_port = true;
  }
  if (host.empty()) throw config_error(what + " has an empty host");
  host_port out{std::string(host), std::nullopt};
  if (has_port) {
    out.port =
        check_port(what, parse_non_negative(what + " (port '" + std::string(port) + "')", port));
  }
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/detail/parse.hpp ----
// ---- begin dtrain/env/names.hpp ----
/// @file
/// Every environment variable of dtrain's own (`DTRAIN_*`), by name, in one
/// place: the code reads and names them only through these constants, and
/// docs/reference.md's table is checked against this list (the test
/// docs.environment_reference). The launchers' variables (RANK, WORLD_SIZE,
/// MASTER_ADDR, OMPI_COMM_WORLD_*, SLURM_*, ...) are read by env/launchers.hpp.

#include <array>
#include <string_view>

namespace dtrain {

// --- the store and rendezvous (rendezvous/options.hpp, rendezvous/security.hpp)

/// The store's shared secret: every client proves it in the handshake.
inline constexpr std::string_view store_token_variable = "DTRAIN_STORE_TOKEN";
/// The address the store listens on instead of the one MASTER_ADDR names
/// ("0.0.0.0": every interface).
inline constexpr std::string_view store_bind_variable = "DTRAIN_STORE_BIND";
/// Seconds of a store client's connect, get, wait and barrier (default 300).
inline constexpr std::string_view store_timeout_variable = "DTRAIN_STORE_TIMEOUT";
/// Seconds one read or write on a store connection may take.
inline constexpr std::string_view store_io_timeout_variable = "DTRAIN_STORE_IO_TIMEOUT";
/// Seconds the store keeps a silent connection open.
inline constexpr std::string_view store_idle_timeout_variable = "DTRAIN_STORE_IDLE_TIMEOUT";
/// The most connections the store holds at once.
inline constexpr std::string_view store_max_connections_variable = "DTRAIN_STORE_MAX_CONNECTIONS";
/// The most bytes of keys and values the store holds.
inline constexpr std::string_view store_max_bytes_variable = "DTRAIN_STORE_MAX_BYTES";
/// Seconds between reports of a rendezvous or connection still waiting.
inline constexpr std::string_view rendezvous_progress_variable = "DTRAIN_RENDEZVOUS_PROGRESS";

// --- world discovery (env/placement.hpp)

/// This node's name for placement (default: the host name).
inline constexpr std::string_view node_name_variable = "DTRAIN_NODE_NAME";

// --- the node agent and dtrun (launch/)

/// Workers per node (dtrun --nproc-per-node).
inline constexpr std::string_view nproc_per_node_variable = "DTRAIN_NPROC_PER_NODE";
/// Nodes in the job (dtrun --nnodes).
inline constexpr std::string_view nnodes_variable = "DTRAIN_NNODES";
/// This node's rank (dtrun --node-rank).
inline constexpr std::string_view node_rank_variable = "DTRAIN_NODE_RANK";
/// Restarts of the whole job after a failure (dtrun --max-restarts).
inline constexpr std::string_view max_restarts_variable = "DTRAIN_MAX_RESTARTS";
/// Seconds between SIGTERM and SIGKILL (dtrun --grace-period).
inline constexpr std::string_view grace_period_variable = "DTRAIN_GRACE_PERIOD";
/// Seconds without an agent's heartbeat before its node is declared lost.
inline constexpr std::string_view heartbeat_timeout_variable = "DTRAIN_HEARTBEAT_TIMEOUT";
/// Switch: prefix every line the workers print with `[rank N] ` (dtrun --tee).
inline constexpr std::string_view tee_variable = "DTRAIN_TEE";
/// A directory for each worker's output, DIR/restart_K/rank_N.log (dtrun --log-dir).
inline constexpr std::string_view log_dir_variable = "DTRAIN_LOG_DIR";
/// Switch: give each worker `--local_rank=N` (dtrun --pass-local-rank).
inline constexpr std::string_view local_rank_arg_variable = "DTRAIN_LOCAL_RANK_ARG";
/// Set by the agent for its workers: the agents' store (HOST:PORT).
inline constexpr std::string_view agent_store_variable = "DTRAIN_AGENT_STORE";
/// Set by the agent for its workers: how many times the job was restarted.
inline constexpr std::string_view restart_count_variable = "DTRAIN_RESTART_COUNT";

// --- collectives and engines (backend/)

/// Seconds a collective may take before it is a timeout_error.
inline constexpr std::string_view collective_timeout_variable = "DTRAIN_COLLECTIVE_TIMEOUT";
/// Switch: compare every collective's signature across ranks before it runs.
inline constexpr std::string_view check_collectives_variable = "DTRAIN_CHECK_COLLECTIVES";
/// Seconds NCCL's communicator set-up may take.
inline constexpr std::string_view nccl_init_timeout_variable = "DTRAIN_NCCL_INIT_TIMEOUT";
/// The network interface Gloo uses (before GLOO_SOCKET_IFNAME).
inline constexpr std::string_view gloo_ifname_variable = "DTRAIN_GLOO_IFNAME";
/// Switch: Gloo's allreduces through shared memory when all ranks share a host.
inline constexpr std::string_view gloo_shm_variable = "DTRAIN_GLOO_SHM";

// --- failure diagnostics and timelines

/// Switch: on a failure, gather and print the ranks' collective tables.
inline constexpr std::string_view diagnostics_variable = "DTRAIN_DIAGNOSTICS";
/// Seconds a failing rank waits for the other ranks' tables.
inline constexpr std::string_view diagnostics_wait_variable = "DTRAIN_DIAGNOSTICS_WAIT";
/// A file for DDP's timeline (one per rank); empty: none.
inline constexpr std::string_view timeline_variable = "DTRAIN_TIMELINE";

// --- the doctor (examples/doctor.cpp)

/// The directory the doctor reads as /sys (to inspect a captured host).
inline constexpr std::string_view sysfs_root_variable = "DTRAIN_SYSFS_ROOT";

namespace detail {

/// Every name above, for checks and listings.
inline constexpr std::array dtrain_variables{
    store_token_variable,
    store_bind_variable,
    store_timeout_variable,
    store_io_timeout_variable,
    store_idle_timeout_variable,
    store_max_connections_variable,
    store_max_bytes_variable,
    rendezvous_progress_variable,
    node_name_variable,
    nproc_per_node_variable,
    nnodes_variable,
    node_rank_variable,
    max_restarts_variable,
    grace_period_variable,
    heartbeat_timeout_variable,
    tee_variable,
    log_dir_variable,
    local_rank_arg_variable,
    agent_store_variable,
    restart_count_variable,
    collective_timeout_variable,
    check_collectives_variable,
    nccl_init_timeout_variable,
    gloo_ifname_variable,
    gloo_shm_variable,
    diagnostics_variable,
    diagnostics_wait_variable,
    timeline_variable,
    sysfs_root_variable,
};

}  // namespace detail
}  // namespace dtrain
// ---- end dtrain/env/names.hpp ----

#include <charconv>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

namespace dtrain::detail {

/// Reads an integer variable; nullopt when unset, config_error when set but
/// empty or not a non-negative integer.
DTRAIN_DETAIL_INLINE std::optional<sourced_int> read_int(const environment& env,
                                                         std::string_view name);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<sourced_int> read_int(const environment& env,
                                                         std::string_view name) {
  auto text = env.get(name);
  if (!text) return std::nullopt;
  auto origin = assignment(name, *text);
  if (text->empty()) throw config_error(std::string(name) + " is set but empty");
  return sourced_int{parse_non_negative(origin, *text), origin};
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Reads a text variable; nullopt when unset, config_error when set but empty
/// or when it has blanks (a host name never does; a stray space is a typo).
DTRAIN_DETAIL_INLINE std::optional<sourced_text> read_text(const environment& env,
                                                           std::string_view name);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<sourced_text> read_text(const environment& env,
                                                           std::string_view name) {
  auto text = env.get(name);
  if (!text) return std::nullopt;
  auto origin = assignment(name, *text);
  if (text->empty()) throw config_error(std::string(name) + " is set but empty");
  if (text->find_first_of(" \t\r\n") != std::string_view::npos) {
    throw config_error(origin + " contains blanks");
  }
  return sourced_text{std::string(*text), origin};
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Reads a duration variable given in seconds (fractions allowed, e.g.
/// DTRAIN_STORE_TIMEOUT=2.5); nullopt when unset, config_error unless it is a
/// positive number.
DTRAIN_DETAIL_INLINE std::optional<std::chrono::milliseconds> read_seconds(const environment& env,
                                                                           std::string_view name);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<std::chrono::milliseconds> read_seconds(const environment& env,
                                                                           std::string_view name) {
  auto text = env.get(name);
  if (!text) return std::nullopt;
  double seconds = 0;
  auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), seconds);
  if (text->empty() || ec != std::errc() || end != text->data() + text->size() || !(seconds > 0) ||
      seconds > 1e9) {
    throw config_error(assignment(name, *text) + " is not a positive number of seconds");
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000.0 + 0.5));
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Reads a switch: 1/true/yes/on or 0/false/no/off; nullopt when unset.
DTRAIN_DETAIL_INLINE std::optional<bool> read_flag(const environment& env, std::string_view name);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<bool> read_flag(const environment& env, std::string_view name) {
  auto text = env.get(name);
  if (!text) return std::nullopt;
  for (std::string_view yes : {"1", "true", "yes", "on"}) {
    if (*text == yes) return true;
  }
  for (std::string_view no : {"0", "false", "no", "off"}) {
    if (*text == no) return false;
  }
  throw config_error(assignment(name, *text) + " is not 0, 1, true, false, yes, no, on or off");
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Reads MASTER_PORT-style variables: an integer in 1..65535.
DTRAIN_DETAIL_INLINE std::optional<sourced_int> read_port(const environment& env,
                                                          std::string_view name);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<sourced_int> read_port(const environment& env,
                                                          std::string_view name) {
  auto port = read_int(env, name);
  if (port) check_port(port->origin, port->value);
  return port;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/env/variables.hpp ----

#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>

namespace dtrain {

/// Default limit for one collective to finish, as c10d's 10 minutes.
/// Environment: DTRAIN_COLLECTIVE_TIMEOUT (seconds).
inline constexpr std::chrono::milliseconds default_collective_timeout{600'000};

/// Options every communicator takes. Aggregate: use designated initialisers.
struct collective_options {
  /// What work::wait() without an argument allows.
  std::chrono::milliseconds timeout = default_collective_timeout;
  /// Before each collective, compare what every rank passed (operation, count,
  /// type, root) and report a mismatch instead of corrupting or hanging.
  /// Costs one small allgather per collective. Environment: DTRAIN_CHECK_COLLECTIVES=1.
  bool check = false;

  /// These options with DTRAIN_COLLECTIVE_TIMEOUT and DTRAIN_CHECK_COLLECTIVES applied on top.
  [[nodiscard]] collective_options with_env(const environment& env) const;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE collective_options collective_options::with_env(const environment& env) const {
  collective_options out = *this;
  if (auto t = detail::read_seconds(env, collective_timeout_variable)) out.timeout = *t;
  if (auto flag = detail::read_flag(env, check_collectives_variable)) out.check = *flag;
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

namespace detail {

/// What a collective is, kept as plain fields so the hot path builds no
/// strings; describe() formats it only when a message needs it.
struct collective_info {
  std::string_view collective;  ///< "allreduce"
  std::string_view engine;      ///< "mpi"
  int rank = 0;
  int size = 1;
  std::size_t count = 0;
  std::uint8_t type = 0;  ///< a dtype
  int op = -1;            ///< a reduce_op, or -1
  int root = -1;          ///< broadcast's root, or -1
};

/// "allreduce(sum, 1024 x float32) on rank 1 of 4 (mpi)"
DTRAIN_DETAIL_INLINE std::string describe(std::string_view what, std::string_view detail, int rank,
                                          int size, std::string_view engine);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string describe(std::string_view what, std::string_view detail, int rank,
                                          int size, std::string_view engine) {
  return std::string(what) + "(" + std::string(detail) + ") on rank " + std::to_string(rank) +
         " of " + std::to_string(size) + " (" + std::string(engine) + ")";
}
#endif  // DTRAIN_DETAIL_BODIES()

DTRAIN_DETAIL_INLINE std::string describe(const collective_info& info);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string describe(const collective_info& info) {
  std::string detail;
  if (info.op >= 0) detail = std::string(to_string(static_cast<reduce_op>(info.op))) + ", ";
  if (info.collective != "barrier") {
    detail +=
        std::to_string(info.count) + " x " + std::string(to_string(static_cast<dtype>(info.type)));
  }
  if (info.root >= 0) detail += ", root " + std::to_string(info.root);
  return describe(info.collective, detail, info.rank, info.size, info.engine);
}
#endif  // DTRAIN_DETAIL_BODIES()

// What a failure was about, put into words only when a message needs it: a
// text, a collective (described from its fields), or a function that says it.
inline std::string what_text(const std::string& text) { return text; }
inline std::string what_text(const char* text) { return text; }
inline std::string what_text(const collective_info& info) { return describe(info); }
template <class Describe>
requires std::is_invocable_r_v<std::string, const Describe&>
inline std::string what_text(const Describe& describe_it) { return describe_it(); }

/// The message of an exception, whatever its type.
DTRAIN_DETAIL_INLINE std::string message_of(const std::exception_ptr& e);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Why a communicator can no longer be used: its first failure. Recorded
/// without allocating, since the hooks that record it (a timeout's, abort())
/// are noexcept, and put into words only when a later call reports it. The
/// owner guards it (one communicator's lock).
class failure_cause {
 public:
  /// A failure that carries its message: an exception, or a text (built by
  /// the caller, where allocating may throw; moving it in does not allocate).
  void set(std::exception_ptr error) noexcept {
    if (!*this) error_ = std::move(error);
  }
  void set(std::string&& text) noexcept;
  /// Collective `call` ended as `how` (a string literal) says: "timed out".
  void set(const collective_info& call, const char* how) noexcept;
  /// `what` (a string literal) happened on `rank`: "abort() was called" on rank 1.
  void set(const char* what, int rank) noexcept;
  [[nodiscard]] explicit operator bool() const noexcept {
    return error_ || has_text_ || how_ != nullptr;
  }
  /// "allreduce(sum, 4 x float32) on rank 0 of 2 (mpi) timed out", the
  /// failure's message, or "abort() was called on rank 1"; empty when none.
  [[nodiscard]] std::string text() const;

 private:
  std::exception_ptr error_;
  std::string text_;
  bool has_text_ = false;
  collective_info call_{};
  const char* how_ = nullptr;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void failure_cause::set(std::string&& text) noexcept {
  if (!*this) {
    text_ = std::move(text);
    has_text_ = true;
  }
}

DTRAIN_DETAIL_INLINE void failure_cause::set(const collective_info& call,
                                             const char* how) noexcept {
  if (!*this) {
    call_ = call;
    how_ = how;
  }
}

DTRAIN_DETAIL_INLINE void failure_cause::set(const char* what, int rank) noexcept {
  if (!*this) {
    call_ = collective_info{};
    call_.rank = rank;
    how_ = what;
  }
}

DTRAIN_DETAIL_INLINE std::string failure_cause::text() const {
  if (error_) return message_of(error_);
  if (has_text_) return text_;
  if (how_ == nullptr) return {};
  if (call_.collective.empty()) return std::string(how_) + " on rank " + std::to_string(call_.rank);
  return describe(call_) + " " + how_;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// How a thread waits for work that others (a device, an engine's thread, a
/// peer) finish: spins first (a collective often ends within microseconds),
/// then yields, then sleeps: 20 us at first (an engine that progresses only
/// inside its test call, like MPI's, still gets polled often), `longest`
/// once the wait has gone on for a while.
struct backoff {
  std::chrono::microseconds longest{200};
  unsigned rounds = 0;
  void operator()() {
    ++rounds;
    if (rounds < 64) return;
    if (rounds < 256) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(rounds < 4096 ? std::chrono::microseconds(20) : longest);
  }
};

/// One outstanding collective, as a backend tracks it.
class work_state {
 public:
  explicit work_state(std::string description, std::chrono::milliseconds timeout)
      : description_(std::move(description)), timeout_(timeout) {}
  work_state(const collective_info& info, std::chrono::milliseconds timeout)
      : info_(info), timeout_(timeout) {}
  virtual ~work_state() = default;
  work_state(const work_state&) = delete;
  work_state& operator=(const work_state&) = delete;

  /// Makes progress; true once finished, successfully or not (see error()).
  virtual bool poll() = 0;

  /// Blocks until finished (true) or the deadline passes (false). The default
  /// keeps calling poll(), for engines that advance only inside their test
  /// call (MPI without a progress thread): a short spin, then yields, then
  /// sleeps (detail::backoff), so a long wait costs no core.
  /// Engines that finish on threads of their own (Gloo) override it to sleep
  /// on a condition instead.
  virtual bool wait_until(std::chrono::steady_clock::time_point deadline);
  /// A wait gave up: abort what the engine can abort, and mark the
  /// communicator unusable where it cannot.
  virtual void on_timeout() noexcept {}

  [[nodiscard]] std::exception_ptr error() const noexcept { return error_; }
  /// The collective's fields (empty for work described by a text).
  [[nodiscard]] const collective_info& info() const noexcept { return info_; }
  [[nodiscard]] const std::string& description() const;
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }

  /// Records this collective's end in `ring` as number `seq` (see collective_ring).
  void track(std::shared_ptr<collective_ring> ring, std::int64_t seq) noexcept;
  /// Called by work once it saw the end (or gave up): the ring learns how far it got.
  void settle(call_state state) noexcept {
    if (ring_) ring_->settle(seq_, state);
  }

  /// What every copy of a work handle shares: whether one of them saw the end
  /// (then `poll()` is not called again), and the timeout one of them gave up
  /// with. The first to see the end settles the ring; the rest see it done.
  [[nodiscard]] bool seen_done() const noexcept {
    return seen_done_.load(std::memory_order_acquire);
  }
  void see_done(call_state state) noexcept;
  /// A handle gave up waiting: every copy now reports `timeout`. False when
  /// a copy had seen the end first (nothing is recorded then).
  bool see_timeout(std::exception_ptr timeout) noexcept;
  [[nodiscard]] std::exception_ptr timed_out() const noexcept;

 protected:
  void fail(std::exception_ptr e) noexcept {
    if (!error_) error_ = std::move(e);
  }
  /// For work whose limit is known only once it has started (a sequence takes its first step's).
  void set_timeout(std::chrono::milliseconds timeout) noexcept { timeout_ = timeout; }

 private:
  mutable std::string description_;  // "allreduce(sum, 1024 x float32) on rank 1 of 4 (mpi)"
  collective_info info_{};
  std::chrono::milliseconds timeout_;
  std::exception_ptr error_;
  std::shared_ptr<collective_ring> ring_;
  std::int64_t seq_ = 0;
  std::atomic<bool> seen_done_{false};
  mutable std::mutex end_mutex_;  // orders seen_done_ with timed_out_
  std::exception_ptr timed_out_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE bool work_state::wait_until(std::chrono::steady_clock::time_point deadline) {
  backoff pause;
  for (;;) {
    if (poll()) return true;
    if (std::chrono::steady_clock::now() > deadline) return poll();
    pause();
  }
}

DTRAIN_DETAIL_INLINE const std::string& work_state::description() const {
  if (description_.empty()) description_ = describe(info_);
  return description_;
}

DTRAIN_DETAIL_INLINE void work_state::track(std::shared_ptr<collective_ring> ring,
                                            std::int64_t seq) noexcept {
  ring_ = std::move(ring);
  seq_ = seq;
}

DTRAIN_DETAIL_INLINE void work_state::see_done(call_state state) noexcept {
  std::lock_guard lock(end_mutex_);
  if (seen_done_.load(std::memory_order_relaxed)) return;
  seen_done_.store(true, std::memory_order_release);
  settle(state);
}

DTRAIN_DETAIL_INLINE bool work_state::see_timeout(std::exception_ptr timeout) noexcept {
  std::lock_guard lock(end_mutex_);
  if (seen_done_.load(std::memory_order_relaxed)) return false;
  timed_out_ = std::move(timeout);
  seen_done_.store(true, std::memory_order_release);
  settle(call_state::timed_out);
  return true;
}

DTRAIN_DETAIL_INLINE std::exception_ptr work_state::timed_out() const noexcept {
  std::lock_guard lock(end_mutex_);
  return timed_out_;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Numbers a collective in `ring` (the engine's one counter) and returns its sequence number.
inline std::int64_t record(collective_ring& ring, const collective_info& info) {
  return ring.issue(info.collective, static_cast<dtype>(info.type), info.count, info.op, info.root);
}

}  // namespace detail

/// The handle of one asynchronous collective. Cheap to copy: copies share
/// their state, so what one copy saw (the end, a timeout) every copy sees.
class work {
 public:
  /// A handle that is already complete.
  work() = default;
  explicit work(std::shared_ptr<detail::work_state> state) : state_(std::move(state)) {}

  /// True once the collective has finished, successfully or not. Never blocks.
  [[nodiscard]] bool test();

  /// Waits for the communicator's timeout; see wait(timeout).
  void wait() { wait(state_ ? state_->timeout() : std::chrono::milliseconds(0)); }

  /// Waits until the collective finishes, then throws its error if it failed
  /// (backend_error). Throws timeout_error naming the collective, the rank and
  /// the time when it is not done within `timeout`; the communicator is then
  /// aborted or marked unusable, as the engine allows.
  void wait(std::chrono::milliseconds timeout);

  /// Waits at most `timeout` and does nothing about it: true once finished
  /// (exception() then says how), false while still running. For a watchdog,
  /// which reports a timeout before it aborts: an abort may itself wait on a
  /// device that never frees.
  [[nodiscard]] bool finish_within(std::chrono::milliseconds timeout);

  /// The timeout_error wait(timeout) throws: the collective, the rank, the time.
  [[nodiscard]] std::exception_ptr timeout_exception(std::chrono::milliseconds timeout) const;

  /// After finish_within(timeout) returned false: aborts what the engine can
  /// abort (or marks the communicator unusable) and throws timeout_exception().
  [[noreturn]] void give_up(std::chrono::milliseconds timeout);

  /// The limit wait() without an argument allows (the communicator's collective timeout).
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept {
    return state_ ? state_->timeout() : std::chrono::milliseconds(0);
  }

  /// The error the collective failed with (or the timeout), once finished; null otherwise.
  [[nodiscard]] std::exception_ptr exception() const noexcept;

 private:
  void ended() noexcept {
    state_->see_done(state_->error() ? detail::call_state::failed : detail::call_state::completed);
  }

  std::shared_ptr<detail::work_state> state_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE bool work::test() {
  if (!state_ || state_->seen_done()) return true;
  if (state_->poll()) ended();
  return state_->seen_done();
}

DTRAIN_DETAIL_INLINE void work::wait(std::chrono::milliseconds timeout) {
  if (!finish_within(timeout)) give_up(timeout);
  if (auto e = exception()) std::rethrow_exception(e);
}

DTRAIN_DETAIL_INLINE bool work::finish_within(std::chrono::milliseconds timeout) {
  if (!state_ || test()) return true;
  if (!state_->wait_until(std::chrono::steady_clock::now() + timeout)) return false;
  ended();
  return true;
}

DTRAIN_DETAIL_INLINE std::exception_ptr work::timeout_exception(
    std::chrono::milliseconds timeout) const {
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%.1f s", static_cast<double>(timeout.count()) / 1000.0);
  return std::make_exception_ptr(timeout_error(
      (state_ ? state_->description() : std::string("a collective")) + " did not finish within " +
      seconds +
      "; a peer is slow, dead or called a different collective (DTRAIN_CHECK_COLLECTIVES=1 "
      "compares what every rank passed)"));
}

DTRAIN_DETAIL_INLINE void work::give_up(std::chrono::milliseconds timeout) {
  auto e = timeout_exception(timeout);
  if (state_ && state_->see_timeout(e)) state_->on_timeout();
  std::rethrow_exception(e);
}

DTRAIN_DETAIL_INLINE std::exception_ptr work::exception() const noexcept {
  if (!state_ || !state_->seen_done()) return nullptr;
  if (auto e = state_->timed_out()) return e;
  return state_->error();
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
// ---- end dtrain/backend/work.hpp ----

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
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void throw_invalid(const std::string& what, bool left_out) {
  throw config_error(what + (left_out ? ": this rank passed a negative color to split() and "
                                        "belongs to no communicator"
                                      : ": the communicator was moved from"));
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The collectives every engine knows, numbered as check mode sends them.
enum class collective_kind : std::uint8_t {
  other,
  allreduce,
  broadcast,
  allgather,
  reduce_scatter,
  barrier,
  allreduce_many,
  split
};

/// Their names, indexed by collective_kind ("?": another).
inline constexpr std::string_view collective_kinds[] = {
    "?",       "allreduce",      "broadcast", "allgather", "reduce_scatter",
    "barrier", "allreduce_many", "split"};

[[nodiscard]] DTRAIN_DETAIL_INLINE std::int64_t collective_kind_code(
    std::string_view kind) noexcept;
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::int64_t collective_kind_code(std::string_view kind) noexcept {
  for (std::size_t i = 1; i < std::size(collective_kinds); ++i) {
    if (collective_kinds[i] == kind) return static_cast<std::int64_t>(i);
  }
  return 0;
}
#endif  // DTRAIN_DETAIL_BODIES()

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
  [[noreturn]] void fail(const std::string& why) const {
    throw config_error((info ? describe(*info) : what) + ": " + why);
  }

 private:
  static std::string name(std::string_view which, std::ptrdiff_t index) {
    return index < 0 ? std::string(which) : std::string(which) + " " + std::to_string(index);
  }
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void argument_check::same_type(const buffer& in, const buffer& out) const {
  if (in.type != out.type)
    fail("input is " + std::string(to_string(in.type)) + ", output " +
         std::string(to_string(out.type)));
  if (in.where != out.where) fail("input and output live in different memories (host and device)");
}

DTRAIN_DETAIL_INLINE void argument_check::count(const buffer& b, std::size_t expected,
                                                std::string_view which) const {
  if (b.count != expected) {
    fail(std::string(which) + " has " + std::to_string(b.count) + " elements, expected " +
         std::to_string(expected));
  }
}

DTRAIN_DETAIL_INLINE void argument_check::op_fits(reduce_op op, dtype t) const {
  if (op == reduce_op::avg && !is_floating(t)) {
    fail("avg of " + std::string(to_string(t)) +
         " would truncate; average floating-point data, or sum and divide");
  }
}

DTRAIN_DETAIL_INLINE void argument_check::reachable(const buffer& b, std::string_view which,
                                                    const memory_reach& reach,
                                                    std::ptrdiff_t index) const {
  const bool on_host = b.where == memory::host;
  if (!(on_host ? reach.host : reach.device)) {
    fail(name(which, index) + (on_host ? " is host memory, and " : " is device memory, and ") +
         std::string(reach.rule));
  }
  if (b.data == nullptr && b.count > 0)
    fail(name(which, index) + " is a null pointer with " + std::to_string(b.count) + " elements");
}

DTRAIN_DETAIL_INLINE void argument_check::root(int r, int size) const {
  if (r < 0 || r >= size) fail("root " + std::to_string(r) + " is not a rank of this communicator");
}
#endif  // DTRAIN_DETAIL_BODIES()

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

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE collective_info collective_call::info(std::string_view engine, int rank,
                                                           int size) const noexcept {
  buffer counted = kind == collective_kind::reduce_scatter ? out : in;
  if (kind == collective_kind::allreduce_many) {
    counted = {};
    if (!many.empty()) counted.type = many.front().type;
    for (const buffer& b : many) counted.count += b.count;
  }
  return {collective_kinds[static_cast<std::size_t>(kind)], engine, rank, size, counted.count,
          static_cast<std::uint8_t>(counted.type),          op,     root};
}

DTRAIN_DETAIL_INLINE bool collective_call::moves_data() const noexcept {
  switch (kind) {
    case collective_kind::barrier:
    case collective_kind::split:
    case collective_kind::other: return true;
    case collective_kind::allreduce:
    case collective_kind::broadcast:
    case collective_kind::allgather: return in.count > 0;
    case collective_kind::reduce_scatter: return out.count > 0;
    case collective_kind::allreduce_many:
      for (const buffer& b : many) {
        if (b.count > 0) return true;
      }
      return false;
  }
  return true;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The argument checks of every engine, per collective: buffers where the
/// engine reaches (`reach`), types and counts that fit, an op the type allows,
/// a root that is a rank. `info` names the call (call.info()).
DTRAIN_DETAIL_INLINE void check_arguments(const collective_call& call, const collective_info& info,
                                          const memory_reach& reach);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void check_arguments(const collective_call& call, const collective_info& info,
                                          const memory_reach& reach) {
  const argument_check check{info};
  const auto ranks = static_cast<std::size_t>(info.size);
  const auto op = static_cast<reduce_op>(call.op);
  switch (call.kind) {
    case collective_kind::allreduce:
      check.reachable(call.in, "input", reach);
      check.reachable(call.out, "output", reach);
      check.same_type(call.in, call.out);
      check.count(call.out, call.in.count, "output");
      check.op_fits(op, call.in.type);
      return;
    case collective_kind::broadcast:
      check.reachable(call.in, "data", reach);
      check.root(call.root, info.size);
      return;
    case collective_kind::allgather:
      check.reachable(call.in, "input", reach);
      check.reachable(call.out, "output", reach);
      check.same_type(call.in, call.out);
      check.count(call.out, call.in.count * ranks, "output");
      return;
    case collective_kind::reduce_scatter:
      check.reachable(call.in, "input", reach);
      check.reachable(call.out, "output", reach);
      check.same_type(call.in, call.out);
      check.count(call.in, call.out.count * ranks, "input");
      check.op_fits(op, call.out.type);
      return;
    case collective_kind::allreduce_many:
      for (std::size_t i = 0; i < call.many.size(); ++i) {
        check.reachable(call.many[i], "buffer", reach, static_cast<std::ptrdiff_t>(i));
        check.op_fits(op, call.many[i].type);
      }
      return;
    case collective_kind::barrier:
    case collective_kind::split:
    case collective_kind::other: return;
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

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
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE signature signature_of(std::int64_t seq,
                                            const collective_info& info) noexcept {
  return {seq,
          collective_kind_code(info.collective),
          static_cast<std::int64_t>(info.count),
          static_cast<std::int64_t>(info.type),
          info.op,
          info.root};
}
#endif  // DTRAIN_DETAIL_BODIES()

/// How check mode names a call, for every engine: "collective #3:
/// allreduce(sum, float32 × 5)" (the ring's describe_call).
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string describe_collective(const signature& s);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string describe_collective(const signature& s) {
  const auto kind = static_cast<std::size_t>(s.kind);
  call_record r;
  r.seq = s.seq;
  r.kind = kind < std::size(collective_kinds) ? collective_kinds[kind] : collective_kinds[0];
  r.type = static_cast<dtype>(s.type);
  r.count = static_cast<std::size_t>(s.count);
  r.op = static_cast<int>(s.op);
  r.root = static_cast<int>(s.root);
  return "collective #" + std::to_string(s.seq) + ": " + describe_call(r, true);
}
#endif  // DTRAIN_DETAIL_BODIES()

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

#undef DTRAIN_HOST_ONLY_MESSAGE
#undef DTRAIN_DEVICE_ONLY_MESSAGE

}  // namespace dtrain
// ---- end dtrain/backend/communicator.hpp ----
// ---- begin dtrain/backend/control.hpp ----
/// @file
/// The host control plane: small blocking collectives on host memory for
/// what is metadata rather than gradients (model agreement, the bucket
/// rebuild order, checksums, bootstrap). A device engine such as NCCL never
/// carries them. Two channels: `store_channel` (over the rendezvous store;
/// works for every backend) and `communicator_channel` (over a communicator
/// that reaches host memory: MPI, Gloo). `control_plane` refers to either.

// ---- begin dtrain/rendezvous/store.hpp ----
/// @file
/// The `store` concept (what bootstraps the engines and runs barriers), and
/// prefix_store, which gives each job, restart round and subsystem its own
/// namespace within one store.

#include <chrono>
#include <concepts>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain {

/// A key-value store that every rank reaches: set / get (waits) / add /
/// compare_set / wait / check / erase, and barrier. Gloo's five-method store
/// is the model.
template <class S>
concept store = requires(S& s, std::string_view key, std::span<const std::string> keys,
                         std::chrono::milliseconds timeout) {
  s.set(key, key);
  { s.get(key) } -> std::convertible_to<std::string>;
  { s.get(key, timeout) } -> std::convertible_to<std::string>;
  { s.add(key, std::int64_t{1}) } -> std::convertible_to<std::int64_t>;
  { s.compare_set(key, key, key) } -> std::convertible_to<std::string>;
  s.wait(keys);
  s.wait(keys, timeout);
  { s.check(keys) } -> std::convertible_to<bool>;
  { s.erase(key) } -> std::convertible_to<bool>;
  { s.num_keys() } -> std::convertible_to<std::int64_t>;
  s.barrier(key, 1);
  s.barrier(key, 1, timeout);
};

/// A view of another store in which every key (and barrier name) is
/// `prefix/key`. Nests: prefix_store(prefix_store(s, "job7"), "restart2").
/// Does not own the underlying store, which must outlive it.
template <store S>
class prefix_store {
 public:
  using milliseconds = std::chrono::milliseconds;

  prefix_store(S& inner, std::string prefix) : inner_(inner), prefix_(std::move(prefix) + "/") {}

  void set(std::string_view key, std::string_view value) { inner_.set(full(key), value); }
  [[nodiscard]] std::string get(std::string_view key) { return inner_.get(full(key)); }
  [[nodiscard]] std::string get(std::string_view key, milliseconds timeout) {
    return inner_.get(full(key), timeout);
  }
  std::int64_t add(std::string_view key, std::int64_t delta) {
    return inner_.add(full(key), delta);
  }
  std::string compare_set(std::string_view key, std::string_view expected,
                          std::string_view desired) {
    return inner_.compare_set(full(key), expected, desired);
  }
  void wait(std::span<const std::string> keys) { inner_.wait(full(keys)); }
  void wait(std::span<const std::string> keys, milliseconds timeout) {
    inner_.wait(full(keys), timeout);
  }
  [[nodiscard]] bool check(std::span<const std::string> keys) { return inner_.check(full(keys)); }
  bool erase(std::string_view key) { return inner_.erase(full(key)); }
  /// Keys in the whole underlying store, not only under this prefix.
  [[nodiscard]] std::int64_t num_keys() { return inner_.num_keys(); }
  void barrier(std::string_view name, int count) { inner_.barrier(full(name), count); }
  void barrier(std::string_view name, int count, milliseconds timeout) {
    inner_.barrier(full(name), count, timeout);
  }

  [[nodiscard]] const std::string& prefix() const noexcept { return prefix_; }

 private:
  std::string full(std::string_view key) const { return prefix_ + std::string(key); }
  std::vector<std::string> full(std::span<const std::string> keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const auto& k : keys) out.push_back(full(k));
    return out;
  }

  S& inner_;
  std::string prefix_;
};

}  // namespace dtrain
// ---- end dtrain/rendezvous/store.hpp ----

#include <concepts>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

namespace dtrain {

/// Blocking host collectives among the ranks of a job. Every rank calls the
/// same operations in the same order; each is bounded by the channel's
/// timeout (the store's, or the communicator's collective timeout).
template <class C>
concept host_channel = requires(C& c, const C& cc, std::span<const std::int64_t> in,
                                std::span<std::int64_t> out, std::span<std::uint8_t> bytes) {
  { cc.rank() } -> std::convertible_to<int>;
  { cc.size() } -> std::convertible_to<int>;
  c.allgather(in, out);   // out: size() * in.size(), in rank order
  c.broadcast(bytes, 0);  // every rank passes the same length
};

/// Host collectives through the rendezvous store: allgather is a key per
/// rank, broadcast one key from the root. The last rank to read a round
/// erases its keys, so the store holds at most one round per channel.
template <store Store>
class store_channel {
 public:
  /// `prefix` names this channel's keys; every rank must use the same one.
  store_channel(Store& store, int rank, int size, std::string prefix = "control")
      : store_(store), rank_(rank), size_(size), prefix_(std::move(prefix) + "/") {}

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }

  void allgather(std::span<const std::int64_t> in, std::span<std::int64_t> out) {
    const std::string round = next_round();
    const std::size_t bytes = in.size_bytes();
    if (out.size() != in.size() * static_cast<std::size_t>(size_)) {
      throw config_error("store_channel::allgather on rank " + std::to_string(rank_) +
                         ": output has " + std::to_string(out.size()) + " elements, expected " +
                         std::to_string(in.size() * static_cast<std::size_t>(size_)));
    }
    store_.set(round + std::to_string(rank_),
               std::string_view(reinterpret_cast<const char*>(in.data()), bytes));
    for (int r = 0; r < size_; ++r) {
      const std::string key = round + std::to_string(r);
      const std::string value = r == rank_
                                    ? std::string(reinterpret_cast<const char*>(in.data()), bytes)
                                    : store_.get(key);
      expect_length(key, value, bytes, r);
      std::memcpy(out.data() + static_cast<std::size_t>(r) * in.size(), value.data(), bytes);
    }
    finish(round, [&] {
      for (int r = 0; r < size_; ++r) store_.erase(round + std::to_string(r));
    });
  }

  void broadcast(std::span<std::uint8_t> data, int root) {
    if (root < 0 || root >= size_) {
      throw config_error("store_channel::broadcast: root " + std::to_string(root) +
                         " is not a rank of " + std::to_string(size_));
    }
    const std::string round = next_round();
    const std::string key = round + "root";
    if (rank_ == root) {
      store_.set(key, std::string_view(reinterpret_cast<const char*>(data.data()), data.size()));
    } else {
      const std::string value = store_.get(key);
      expect_length(key, value, data.size(), root);
      if (!data.empty()) std::memcpy(data.data(), value.data(), data.size());
    }
    finish(round, [&] { store_.erase(key); });
  }

 private:
  std::string next_round() { return prefix_ + std::to_string(++round_) + "/"; }

  void expect_length(const std::string& key, const std::string& value, std::size_t bytes,
                     int from) const {
    if (value.size() != bytes) {
      throw rendezvous_error("control plane: store key " + key + " from rank " +
                             std::to_string(from) + " has " + std::to_string(value.size()) +
                             " bytes, rank " + std::to_string(rank_) + " expected " +
                             std::to_string(bytes) +
                             "; the ranks called different control operations, or another "
                             "program wrote under this prefix");
    }
  }

  template <class Erase>
  void finish(const std::string& round, Erase&& erase) {
    const std::string read = round + "read";
    if (store_.add(read, 1) == size_) {
      erase();
      store_.erase(read);
    }
  }

  Store& store_;
  int rank_;
  int size_;
  std::string prefix_;
  std::uint64_t round_ = 0;
};

/// Host collectives on a communicator that reaches host memory, each waited
/// for within its collective timeout.
template <communicator C>
class communicator_channel {
  static_assert(C::reaches_host_memory,
                "communicator_channel needs a communicator that reaches host memory (MPI, "
                "Gloo); for NCCL use the context's control plane or a store_channel");

 public:
  explicit communicator_channel(C& comm) noexcept : comm_(comm) {}
  [[nodiscard]] int rank() const { return comm_.rank(); }
  [[nodiscard]] int size() const { return comm_.size(); }
  void allgather(std::span<const std::int64_t> in, std::span<std::int64_t> out) {
    dtrain::allgather(comm_, in, out).wait();
  }
  void broadcast(std::span<std::uint8_t> data, int root) {
    if (!data.empty()) dtrain::broadcast(comm_, data, root).wait();
  }

 private:
  C& comm_;
};

class control_plane;

/// A host_channel other than control_plane itself (which copies instead).
template <class C>
concept channel_to_refer_to = host_channel<C> && !std::same_as<C, control_plane>;

/// A reference to any host_channel, for code that must not be a template on
/// it (DistributedDataParallel keeps one). The channel must outlive it.
class control_plane {
 public:
  template <channel_to_refer_to Channel>
  explicit control_plane(Channel& channel) noexcept
      : channel_(&channel),
        rank_(channel.rank()),
        size_(channel.size()),
        allgather_([](void* c, std::span<const std::int64_t> in, std::span<std::int64_t> out) {
          static_cast<Channel*>(c)->allgather(in, out);
        }),
        broadcast_([](void* c, std::span<std::uint8_t> data, int root) {
          static_cast<Channel*>(c)->broadcast(data, root);
        }) {}

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  void allgather(std::span<const std::int64_t> in, std::span<std::int64_t> out) {
    allgather_(channel_, in, out);
  }
  void broadcast(std::span<std::uint8_t> data, int root) { broadcast_(channel_, data, root); }

 private:
  void* channel_;
  int rank_;
  int size_;
  void (*allgather_)(void*, std::span<const std::int64_t>, std::span<std::int64_t>);
  void (*broadcast_)(void*, std::span<std::uint8_t>, int);
};

static_assert(host_channel<control_plane>);

}  // namespace dtrain
// ---- end dtrain/backend/control.hpp ----
// ---- begin dtrain/backend/cuda.hpp ----
/// @file
/// The CUDA runtime as the NCCL backend uses it: DTRAIN_CUDA_CHECK, and owners
/// of a stream, an event and the current device. Host C++ only (the runtime
/// API, never a kernel), so it builds with g++ and with nvcc alike. Compiles
/// to nothing unless DTRAIN_HAS_CUDA().


#include <cstddef>
#include <cstdio>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <utility>

namespace dtrain::detail {

/// The size of the pinned block that stages `bytes`: a power of two, 64 KiB
/// at least, so that a pool of them is reused across calls of varying sizes
/// and wastes at most half of a block.
[[nodiscard]] constexpr std::size_t staging_block_bytes(std::size_t bytes) noexcept {
  std::size_t block = std::size_t{64} << 10;
  while (block < bytes && block <= (~std::size_t{0} >> 1)) block <<= 1;
  return block < bytes ? bytes : block;
}

}  // namespace dtrain::detail

#if DTRAIN_HAS_CUDA()
#include <cuda_runtime.h>

namespace dtrain::detail {

/// A checked call's text as the user reads it: the engine calls the runtime
/// through its seam (`Api::cudaSetDevice(...)`), the message names the
/// function (`cudaSetDevice(...)`).
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string call_as_written(std::string_view call);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string call_as_written(std::string_view call) {
  if (call.starts_with("Api::")) call.remove_prefix(5);
  return std::string(call);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// "CUDA call `cudaSetDevice(3)` failed: cudaErrorInvalidDevice: invalid device ordinal
/// (cudaError_t 101, at file:line)".
DTRAIN_DETAIL_INLINE std::string cuda_error_text(cudaError_t code, const char* call,
                                                 const char* file, int line);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string cuda_error_text(cudaError_t code, const char* call,
                                                 const char* file, int line) {
  return "CUDA call `" + call_as_written(call) + "` failed: " + cudaGetErrorName(code) + ": " +
         cudaGetErrorString(code) + " (cudaError_t " + std::to_string(static_cast<int>(code)) +
         ", at " + file + ":" + std::to_string(line) + ")";
}
#endif  // DTRAIN_DETAIL_BODIES()

[[noreturn]] DTRAIN_DETAIL_INLINE void throw_cuda_error(cudaError_t code, const char* call,
                                                        const char* file, int line);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void throw_cuda_error(cudaError_t code, const char* call, const char* file,
                                           int line) {
  // Clear a non-sticky error, so that the next unrelated call does not report it again.
  (void)cudaGetLastError();
  throw backend_error(cuda_error_text(code, call, file, line), static_cast<int>(code));
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail

/// Evaluates `call` (a CUDA runtime function returning cudaError_t) and throws
/// dtrain::backend_error with the call as written, file:line, the runtime's
/// error name and string, and the code (backend_error::engine_code()).
#define DTRAIN_CUDA_CHECK(call)                                                           \
  do {                                                                                    \
    const cudaError_t dtrain_cuda_status_ = (call);                                       \
    if (dtrain_cuda_status_ != cudaSuccess)                                               \
      ::dtrain::detail::throw_cuda_error(dtrain_cuda_status_, #call, __FILE__, __LINE__); \
  } while (false)

namespace dtrain::detail {

/// Whether this thread has a current CUDA context, asked of the driver
/// (cuCtxGetCurrent, found through the runtime, so nothing links libcuda).
/// The runtime's cudaGetDevice answers 0 on a thread that never used a GPU,
/// and a cudaSetDevice(0) there would create a context on GPU 0 (about half a
/// GiB) for a rank that does not use it. True when the driver cannot say.
[[nodiscard]] DTRAIN_DETAIL_INLINE bool thread_has_cuda_context() noexcept;
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE bool thread_has_cuda_context() noexcept {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12000
  using get_current_fn = int (*)(void**);  // CUresult cuCtxGetCurrent(CUcontext*)
  static const get_current_fn get_current = []() noexcept -> get_current_fn {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t rc =
        cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t rc =
        cudaGetDriverEntryPoint("cuCtxGetCurrent", &fn, cudaEnableDefault, &found);
#endif
    if (rc != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<get_current_fn>(fn);
  }();
  if (get_current == nullptr) return true;
  void* context = nullptr;
  return get_current(&context) == 0 && context != nullptr;
#else
  return true;
#endif
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The CUDA runtime calls the NCCL engine makes, as one narrow seam: the
/// engine's classes take the runtime as a template argument (`Api`), this one
/// in production, a host fake in the tests of NCCL at several ranks
/// (tests/engines/fake_nccl.hpp), so that a blocked call, an abort from
/// another thread or a device failure can happen without a GPU. Each member
/// is the CUDA function of the same name and signature; device_identity and
/// thread_has_context are dtrain's. Error texts (cudaGetErrorName/String) are
/// not part of the seam.
struct cuda_library {
  static cudaError_t cudaGetDeviceCount(int* count) { return ::cudaGetDeviceCount(count); }
  static cudaError_t cudaGetDevice(int* device) { return ::cudaGetDevice(device); }
  static cudaError_t cudaSetDevice(int device) { return ::cudaSetDevice(device); }
  /// The device's UUID ("GPU-xxxxxxxx-..." as nvidia-smi -L prints it) and PCI bus id.
  static cudaError_t device_identity(int device, std::string& uuid, std::string& pci_bus);
  static bool thread_has_context() noexcept { return thread_has_cuda_context(); }
  static cudaError_t cudaGetLastError() { return ::cudaGetLastError(); }
  static cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags) {
    return ::cudaStreamCreateWithFlags(stream, flags);
  }
  static cudaError_t cudaStreamDestroy(cudaStream_t stream) { return ::cudaStreamDestroy(stream); }
  static cudaError_t cudaStreamQuery(cudaStream_t stream) { return ::cudaStreamQuery(stream); }
  static cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags) {
    return ::cudaStreamWaitEvent(stream, event, flags);
  }
  static cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags) {
    return ::cudaEventCreateWithFlags(event, flags);
  }
  static cudaError_t cudaEventDestroy(cudaEvent_t event) { return ::cudaEventDestroy(event); }
  static cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    return ::cudaEventRecord(event, stream);
  }
  static cudaError_t cudaEventQuery(cudaEvent_t event) { return ::cudaEventQuery(event); }
  static cudaError_t cudaMalloc(void** data, std::size_t bytes) {
    return ::cudaMalloc(data, bytes);
  }
  static cudaError_t cudaFree(void* data) { return ::cudaFree(data); }
  static cudaError_t cudaMallocHost(void** data, std::size_t bytes) {
    return ::cudaMallocHost(data, bytes);
  }
  static cudaError_t cudaFreeHost(void* data) { return ::cudaFreeHost(data); }
  static cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes,
                                     cudaMemcpyKind kind, cudaStream_t stream) {
    return ::cudaMemcpyAsync(dst, src, bytes, kind, stream);
  }
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE cudaError_t cuda_library::device_identity(int device, std::string& uuid,
                                                               std::string& pci_bus) {
  cudaDeviceProp prop{};
  if (const cudaError_t e = cudaGetDeviceProperties(&prop, device); e != cudaSuccess) return e;
  static constexpr char hex[] = "0123456789abcdef";
  uuid = "GPU-";
  for (int i = 0; i < 16; ++i) {
    const auto byte = static_cast<unsigned char>(prop.uuid.bytes[i]);
    if (i == 4 || i == 6 || i == 8 || i == 10) uuid += '-';
    uuid += hex[byte >> 4];
    uuid += hex[byte & 15];
  }
  char bus[32];
  std::snprintf(bus, sizeof bus, "%08x:%02x:%02x.0", static_cast<unsigned>(prop.pciDomainID),
                static_cast<unsigned>(prop.pciBusID), static_cast<unsigned>(prop.pciDeviceID));
  pci_bus = bus;
  return cudaSuccess;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// An owned CUDA stream, destroyed with its owner. cudaStreamDestroy does not
/// wait: work still queued on the stream completes, then the stream goes.
template <class Api = cuda_library>
class basic_cuda_stream {
 public:
  basic_cuda_stream() = default;
  basic_cuda_stream(basic_cuda_stream&& other) noexcept
      : stream_(std::exchange(other.stream_, nullptr)) {}
  basic_cuda_stream& operator=(basic_cuda_stream&& other) noexcept {
    if (this != &other) {
      reset();
      stream_ = std::exchange(other.stream_, nullptr);
    }
    return *this;
  }
  basic_cuda_stream(const basic_cuda_stream&) = delete;
  basic_cuda_stream& operator=(const basic_cuda_stream&) = delete;
  ~basic_cuda_stream() { reset(); }

  /// A stream on the current device that does not synchronise with the legacy
  /// default stream: ordering with the caller's streams is explicit (events).
  [[nodiscard]] static basic_cuda_stream non_blocking() {
    basic_cuda_stream s;
    DTRAIN_CUDA_CHECK(Api::cudaStreamCreateWithFlags(&s.stream_, cudaStreamNonBlocking));
    return s;
  }

  [[nodiscard]] cudaStream_t get() const noexcept { return stream_; }
  [[nodiscard]] explicit operator bool() const noexcept { return stream_ != nullptr; }
  /// Gives up ownership.
  [[nodiscard]] cudaStream_t release() noexcept { return std::exchange(stream_, nullptr); }

 private:
  void reset() noexcept {
    if (stream_) (void)Api::cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
};
using cuda_stream = basic_cuda_stream<>;

/// An owned CUDA event without timing (the cheap kind, for ordering and completion).
template <class Api = cuda_library>
class basic_cuda_event {
 public:
  basic_cuda_event() = default;
  explicit basic_cuda_event(cudaEvent_t adopted) noexcept : event_(adopted) {}
  basic_cuda_event(basic_cuda_event&& other) noexcept
      : event_(std::exchange(other.event_, nullptr)) {}
  basic_cuda_event& operator=(basic_cuda_event&& other) noexcept {
    if (this != &other) {
      reset();
      event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
  }
  basic_cuda_event(const basic_cuda_event&) = delete;
  basic_cuda_event& operator=(const basic_cuda_event&) = delete;
  ~basic_cuda_event() { reset(); }

  [[nodiscard]] static basic_cuda_event create() {
    cudaEvent_t e = nullptr;
    DTRAIN_CUDA_CHECK(Api::cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return basic_cuda_event(e);
  }

  [[nodiscard]] cudaEvent_t get() const noexcept { return event_; }
  /// Gives up ownership.
  [[nodiscard]] cudaEvent_t release() noexcept { return std::exchange(event_, nullptr); }

 private:
  void reset() noexcept {
    if (event_) (void)Api::cudaEventDestroy(event_);
    event_ = nullptr;
  }
  cudaEvent_t event_ = nullptr;
};
using cuda_event = basic_cuda_event<>;

/// Makes `device` current for a scope, and restores the previous device
/// after it only where this thread had a context: on a fresh thread (a
/// watchdog, a communication thread) the device stays `device`, so that no
/// context is created on a GPU the rank does not use. Switches only when
/// needed (a cudaSetDevice costs more than a cudaGetDevice).
template <class Api = cuda_library>
class basic_device_guard {
 public:
  explicit basic_device_guard(int device) {
    DTRAIN_CUDA_CHECK(Api::cudaGetDevice(&previous_));
    if (previous_ != device) {
      const bool restore = Api::thread_has_context();
      DTRAIN_CUDA_CHECK(Api::cudaSetDevice(device));
      switched_ = restore;
    }
  }
  /// For destructors and other noexcept paths: failures are ignored.
  basic_device_guard(int device, std::nothrow_t) noexcept {
    if (Api::cudaGetDevice(&previous_) != cudaSuccess) {
      (void)Api::cudaGetLastError();
      return;
    }
    if (previous_ != device) {
      const bool restore = Api::thread_has_context();
      switched_ = Api::cudaSetDevice(device) == cudaSuccess && restore;
    }
  }
  basic_device_guard(const basic_device_guard&) = delete;
  basic_device_guard& operator=(const basic_device_guard&) = delete;
  ~basic_device_guard() {
    if (switched_) (void)Api::cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool switched_ = false;
};
using device_guard = basic_device_guard<>;

/// Pinned (page-locked) host blocks for staging device buffers through host
/// memory, kept for reuse: a cudaMallocHost costs milliseconds, so it happens
/// only when no free block of the size class is left. What the pool holds is
/// bounded by the largest set of stagings in flight at once (each block at most
/// twice its use). Also owns one non-blocking copy stream per device. Thread-safe.
class pinned_pool {
 public:
  pinned_pool() = default;
  pinned_pool(const pinned_pool&) = delete;
  pinned_pool& operator=(const pinned_pool&) = delete;
  ~pinned_pool();

  /// A block of staging_block_bytes(bytes) (null for 0 bytes); give it back with give().
  /// Call under a device_guard for the device being staged.
  [[nodiscard]] void* take(std::size_t bytes);

  /// Returns a block from take(bytes) for reuse.
  void give(void* block, std::size_t bytes) noexcept;

  /// The pool's copy stream on `device` (created on first use, under a guard).
  [[nodiscard]] cudaStream_t copy_stream(int device);

  /// Pinned bytes allocated and not freed: blocks in use and free ones.
  [[nodiscard]] std::size_t held_bytes() const;

 private:
  mutable std::mutex mutex_;
  std::multimap<std::size_t, void*> free_;
  std::map<int, cudaStream_t> streams_;
  std::size_t held_ = 0;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE pinned_pool::~pinned_pool() {
  for (auto& [bytes, block] : free_) (void)cudaFreeHost(block);
  for (auto& [device, stream] : streams_) {
    device_guard on(device, std::nothrow);
    (void)cudaStreamDestroy(stream);
  }
}

DTRAIN_DETAIL_INLINE void* pinned_pool::take(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  const std::size_t size = staging_block_bytes(bytes);
  {
    std::lock_guard lock(mutex_);
    auto it = free_.find(size);
    if (it != free_.end()) {
      void* block = it->second;
      free_.erase(it);
      return block;
    }
  }
  void* block = nullptr;
  DTRAIN_CUDA_CHECK(cudaMallocHost(&block, size));
  std::lock_guard lock(mutex_);
  held_ += size;
  return block;
}

DTRAIN_DETAIL_INLINE void pinned_pool::give(void* block, std::size_t bytes) noexcept {
  if (block == nullptr) return;
  try {
    std::lock_guard lock(mutex_);
    free_.emplace(staging_block_bytes(bytes), block);
  } catch (...) {
    (void)cudaFreeHost(block);
    std::lock_guard lock(mutex_);
    held_ -= staging_block_bytes(bytes);
  }
}

DTRAIN_DETAIL_INLINE cudaStream_t pinned_pool::copy_stream(int device) {
  std::lock_guard lock(mutex_);
  auto it = streams_.find(device);
  if (it != streams_.end()) return it->second;
  device_guard on(device);
  cuda_stream s = cuda_stream::non_blocking();
  cudaStream_t raw = s.get();
  streams_.emplace(device, raw);
  (void)s.release();
  return raw;
}

DTRAIN_DETAIL_INLINE std::size_t pinned_pool::held_bytes() const {
  std::lock_guard lock(mutex_);
  return held_;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail

#endif  // DTRAIN_HAS_CUDA()
// ---- end dtrain/backend/cuda.hpp ----
// ---- begin dtrain/backend/desync.hpp ----
/// @file
/// Desync analysis: from every rank's ring of last collectives (or its
/// silence), which rank is behind, which collective it never started, what
/// the others wait in, and which sequence numbers were called with different
/// arguments. Pure functions over the rings, so they are unit-tested on the
/// host; diagnostics.hpp gathers the rings through the store and prints.

// ---- begin dtrain/detail/wire.hpp ----
/// @file
/// The one binary format of everything dtrain sends between processes: the
/// store's protocol (rendezvous/protocol.hpp) and every value dtrain keeps in
/// the store or broadcasts (launch/protocol.hpp, env/placement.hpp, the rings
/// of backend/desync.hpp). Little-endian integers; bytes16 / bytes32 are a
/// u16 / u32 length followed by that many bytes. Every read is bounds checked.


#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace dtrain::detail::wire {

/// A request or reply that breaks the protocol; the connection is closed.
struct violation : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Appends little-endian fields to a buffer.
class writer {
 public:
  explicit writer(std::string& out) : out_(out) {}
  writer& u8(std::uint8_t v);
  writer& u16(std::uint16_t v) { return le(v, 2); }
  writer& u32(std::uint32_t v) { return le(v, 4); }
  writer& u64(std::uint64_t v) { return le(v, 8); }
  writer& i64(std::int64_t v) { return le(static_cast<std::uint64_t>(v), 8); }
  writer& bytes16(std::string_view s);
  writer& bytes32(std::string_view s);

 private:
  writer& le(std::uint64_t v, int n);
  std::string& out_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE writer& writer::u8(std::uint8_t v) {
  out_ += static_cast<char>(v);
  return *this;
}

DTRAIN_DETAIL_INLINE writer& writer::bytes16(std::string_view s) {
  u16(static_cast<std::uint16_t>(s.size()));
  out_.append(s);
  return *this;
}

DTRAIN_DETAIL_INLINE writer& writer::bytes32(std::string_view s) {
  u32(static_cast<std::uint32_t>(s.size()));
  out_.append(s);
  return *this;
}

DTRAIN_DETAIL_INLINE writer& writer::le(std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xff);
  return *this;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Reads little-endian fields from a received body; every read is bounds
/// checked and throws `violation` naming what was cut short.
class reader {
 public:
  explicit reader(std::string_view in) : in_(in) {}
  std::uint8_t u8(const char* what) { return static_cast<std::uint8_t>(le(1, what)); }
  std::uint16_t u16(const char* what) { return static_cast<std::uint16_t>(le(2, what)); }
  std::uint32_t u32(const char* what) { return static_cast<std::uint32_t>(le(4, what)); }
  std::uint64_t u64(const char* what) { return le(8, what); }
  std::int64_t i64(const char* what) { return static_cast<std::int64_t>(le(8, what)); }
  std::string_view bytes32(const char* what, std::uint32_t limit) {
    return sized(u32(what), what, limit);
  }
  std::string_view bytes16(const char* what, std::uint32_t limit) {
    return sized(u16(what), what, limit);
  }
  /// A bytes32 field bounded only by what is left of the input.
  std::string_view bytes32(const char* what) { return take(u32(what), what); }
  [[nodiscard]] bool at_end() const noexcept { return pos_ == in_.size(); }
  void finish(const char* what) const;

 private:
  std::string_view sized(std::uint32_t n, const char* what, std::uint32_t limit);
  std::string_view take(std::size_t n, const char* what);
  std::uint64_t le(int n, const char* what);
  std::string_view in_;
  std::size_t pos_ = 0;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void reader::finish(const char* what) const {
  if (pos_ != in_.size()) {
    throw violation(std::string(what) + " has " + std::to_string(in_.size() - pos_) +
                    " unexpected trailing bytes");
  }
}

DTRAIN_DETAIL_INLINE std::string_view reader::sized(std::uint32_t n, const char* what,
                                                    std::uint32_t limit) {
  if (n > limit) {
    throw violation(std::string(what) + " of " + std::to_string(n) +
                    " bytes exceeds the limit of " + std::to_string(limit));
  }
  return take(n, what);
}

DTRAIN_DETAIL_INLINE std::string_view reader::take(std::size_t n, const char* what) {
  if (in_.size() - pos_ < n) throw violation(std::string(what) + " is truncated");
  auto out = in_.substr(pos_, n);
  pos_ += n;
  return out;
}

DTRAIN_DETAIL_INLINE std::uint64_t reader::le(int n, const char* what) {
  auto bytes = take(static_cast<std::size_t>(n), what);
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i)
    v = (v << 8) | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
  return v;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Decodes `value`, which `where` ("store key dtrain/agent/0/failure", "rank
/// 0's broadcast") should hold as `what` ("a node agent's failure record"):
/// `read(reader&)` reads the fields and every byte must be used. A short, long
/// or otherwise malformed value (a codec throws `violation` for a field out of
/// range) becomes a rendezvous_error naming where, what and what was wrong.
template <class Read>
auto decode_value(std::string_view where, std::string_view value, std::string_view what,
                  Read&& read) {
  try {
    reader r(value);
    auto out = std::forward<Read>(read)(r);
    r.finish("the value");
    return out;
  } catch (const violation& e) {
    throw rendezvous_error(std::string(where) + " does not hold " + std::string(what) + " (" +
                           std::to_string(value.size()) + " bytes): " + e.what() +
                           "; another program, or another dtrain version, wrote it");
  }
}

/// A value of one int64 (a rank, a port, a present-flag).
DTRAIN_DETAIL_INLINE std::string encode_int(std::int64_t v);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string encode_int(std::int64_t v) {
  std::string out;
  writer(out).i64(v);
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()
inline std::int64_t decode_int(std::string_view where, std::string_view value,
                               std::string_view what) {
  return decode_value(where, value, what, [](reader& r) { return r.i64("the number"); });
}

/// A value of one text (a reason, a token).
DTRAIN_DETAIL_INLINE std::string encode_text(std::string_view text);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string encode_text(std::string_view text) {
  std::string out;
  writer(out).bytes32(text);
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string decode_text(std::string_view where, std::string_view value,
                                             std::string_view what);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string decode_text(std::string_view where, std::string_view value,
                                             std::string_view what) {
  return decode_value(where, value, what,
                      [](reader& r) { return std::string(r.bytes32("the text")); });
}
#endif  // DTRAIN_DETAIL_BODIES()

/// A value that one rank produced for every rank, or why it could not
/// (broadcast_or_fail, rendezvous/broadcast.hpp): u8 1 and the value as
/// bytes32, or u8 0 and the producer's error message as bytes32.
struct outcome {
  bool ok = true;
  std::string text;  ///< ok: the value; else the producer's error message

  [[nodiscard]] std::string encode() const;
  /// `where` and `what` name the value in the error when it is not an outcome.
  [[nodiscard]] static outcome decode(std::string_view where, std::string_view value,
                                      std::string_view what);
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string outcome::encode() const {
  std::string out;
  writer(out).u8(ok ? 1 : 0).bytes32(text);
  return out;
}

DTRAIN_DETAIL_INLINE outcome outcome::decode(std::string_view where, std::string_view value,
                                             std::string_view what) {
  return decode_value(where, value, what, [](reader& r) {
    outcome o;
    const std::uint8_t flag = r.u8("the ok flag");
    if (flag > 1) throw violation("the ok flag is " + std::to_string(flag) + ", not 0 or 1");
    o.ok = flag == 1;
    o.text = std::string(r.bytes32(o.ok ? "the value" : "the producer's error"));
    return o;
  });
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail::wire
// ---- end dtrain/detail/wire.hpp ----

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::detail {

/// One rank's ring as the diagnostics round received it; `answered` false
/// when the rank did not publish in time (its process is gone or frozen).
struct rank_ring {
  int rank = 0;
  bool answered = false;
  std::vector<call_record> calls;  ///< oldest first
};

/// What the analysis found: one line for the person at 3 a.m., and the details.
struct desync_report {
  std::string
      summary;  ///< "rank 2 is at #41 ...; ranks 0, 1, 3 wait in #42 ...: rank 2 never started #42"
  std::vector<std::string> details;  ///< one line per rank, then one per mismatched sequence number
  /// How much the summary explains: 4 a mismatch, 3 a rank behind, 2 a silent
  /// rank while others wait, 1 a silent rank, 0 nothing wrong seen.
  int severity = 0;
};

/// "rank 2", "ranks 0, 1, 3".
DTRAIN_DETAIL_INLINE std::string name_ranks(std::span<const int> ranks);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string name_ranks(std::span<const int> ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(ranks[i]);
  }
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

namespace desync {

DTRAIN_DETAIL_INLINE std::string at(const call_record& r, bool with_op = false);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string at(const call_record& r, bool with_op) {
  // Appended, not `"#" + std::to_string(...)`: GCC 12 reports a false -Wrestrict for that shape
  // at -O2 (bug 105329), which users' -Werror builds would turn into an error.
  std::string out = "#";
  out += std::to_string(r.seq);
  out += ' ';
  out += describe_call(r, with_op);
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

// What differs between two calls with the same sequence number, for the summary.
DTRAIN_DETAIL_INLINE std::string difference(const call_record& a, const call_record& b);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string difference(const call_record& a, const call_record& b) {
  if (a.kind != b.kind) return "the collectives differ";
  if (a.type != b.type) return "the types differ";
  if (a.count != b.count) return "the sizes differ";
  if (a.op != b.op) return "the reduce ops differ";
  return "the roots differ";
}
#endif  // DTRAIN_DETAIL_BODIES()

// Ranks grouped by what they called as number `seq`, the largest group first
// (on a tie the group of the lowest rank): the odd ones out come after.
struct call_group {
  const call_record* call;
  std::vector<int> ranks;
};
DTRAIN_DETAIL_INLINE std::vector<call_group> group_calls(std::span<const rank_ring> rings,
                                                         std::int64_t seq);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::vector<call_group> group_calls(std::span<const rank_ring> rings,
                                                         std::int64_t seq) {
  std::vector<call_group> groups;
  for (const rank_ring& r : rings) {
    for (const call_record& c : r.calls) {
      if (c.seq != seq) continue;
      auto same = std::find_if(groups.begin(), groups.end(),
                               [&](const call_group& g) { return g.call->same_call(c); });
      if (same == groups.end()) {
        groups.push_back({&c, {r.rank}});
      } else {
        same->ranks.push_back(r.rank);
      }
    }
  }
  std::stable_sort(groups.begin(), groups.end(), [](const call_group& a, const call_group& b) {
    return a.ranks.size() > b.ranks.size();
  });
  return groups;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace desync

/// Analyses the rings of every rank of a communicator (`rings[i]` is rank
/// rings[i].rank). Never throws on odd input: a ring may be empty, partial or
/// missing; what cannot be decided is said so.
DTRAIN_DETAIL_INLINE desync_report analyse(std::span<const rank_ring> rings);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE desync_report analyse(std::span<const rank_ring> rings) {
  desync_report report;
  std::vector<int> silent;
  std::vector<const rank_ring*> live;
  for (const rank_ring& r : rings) {
    if (r.answered) {
      live.push_back(&r);
    } else {
      silent.push_back(r.rank);
    }
  }
  auto top = [](const rank_ring& r) -> std::int64_t {
    return r.calls.empty() ? 0 : r.calls.back().seq;
  };

  // One row per rank: the last collective it issued and how far it got.
  for (const rank_ring& r : rings) {
    std::string row = "rank " + std::to_string(r.rank) + ": ";
    if (!r.answered) {
      row += "no answer (process gone, or frozen where its diagnostics thread cannot run)";
    } else if (r.calls.empty()) {
      row += "no collective issued yet";
    } else {
      const call_record& last = r.calls.back();
      row += desync::at(last) + " " + std::string(to_string(last.state));
      if (r.calls.size() > 1) {
        const call_record& before = r.calls[r.calls.size() - 2];
        row +=
            " (before it " + desync::at(before) + " " + std::string(to_string(before.state)) + ")";
      }
    }
    report.details.push_back(std::move(row));
  }

  // Sequence numbers called with different arguments, oldest first.
  std::string mismatch;
  std::int64_t lowest = 0, highest = 0;
  for (const rank_ring* r : live) {
    if (r->calls.empty()) continue;
    lowest = lowest == 0 ? r->calls.front().seq : std::min(lowest, r->calls.front().seq);
    highest = std::max(highest, top(*r));
  }
  for (std::int64_t seq = lowest; seq > 0 && seq <= highest; ++seq) {
    auto groups = desync::group_calls(rings, seq);
    if (groups.size() < 2) continue;
    bool ops = false;
    for (const auto& g : groups) ops = ops || g.call->op != groups[0].call->op;
    std::string line;
    for (std::size_t i = groups.size(); i-- > 0;) {  // the odd ones out first
      if (!line.empty()) line += "; ";
      line += name_ranks(groups[i].ranks);
      line += groups[i].ranks.size() == 1 ? " is in " : " are in ";
      line += desync::at(*groups[i].call, ops);
    }
    line += ": " + desync::difference(*groups.back().call, *groups[0].call) +
            " for the same collective";
    report.details.push_back("mismatch: " + line);
    if (mismatch.empty()) mismatch = line;
  }

  // The rank(s) behind: the lowest last sequence number among those that answered.
  std::string behind;
  if (!live.empty()) {
    std::int64_t low = top(*live.front()), high = low;
    for (const rank_ring* r : live) {
      low = std::min(low, top(*r));
      high = std::max(high, top(*r));
    }
    if (low < high) {
      std::vector<int> late, waiting, past;
      const call_record* missing = nullptr;
      const call_record* last_late = nullptr;
      for (const rank_ring* r : live) {
        if (top(*r) == low) {
          late.push_back(r->rank);
          if (!r->calls.empty() && !last_late) last_late = &r->calls.back();
          continue;
        }
        for (const call_record& c : r->calls) {
          if (c.seq != low + 1) continue;
          if (!missing) missing = &c;
          (c.state == call_state::completed ? past : waiting).push_back(r->rank);
        }
      }
      const bool one = late.size() == 1;
      behind = name_ranks(late) + (one ? " is at " : " are at ") +
               (last_late ? desync::at(*last_late) : std::string("no collective yet"));
      if (!waiting.empty())
        behind += "; " + name_ranks(waiting) + (waiting.size() == 1 ? " waits in " : " wait in ");
      if (waiting.empty() && !past.empty()) behind += "; " + name_ranks(past) + " finished ";
      if (missing) {
        behind += desync::at(*missing);
      } else {
        behind += "; the others are past #" + std::to_string(low + 1) + " (it left their rings)";
      }
      behind += ": " + name_ranks(late) + " never started #" + std::to_string(low + 1);
    }
  }

  std::string gone;
  if (!silent.empty()) {
    gone = name_ranks(silent) + " did not answer (process gone, or frozen)";
    std::vector<int> waiting;
    const call_record* in = nullptr;
    for (const rank_ring* r : live) {
      if (r->calls.empty() || r->calls.back().state == call_state::completed) continue;
      waiting.push_back(r->rank);
      if (!in) in = &r->calls.back();
    }
    if (in)
      gone += "; " + name_ranks(waiting) + (waiting.size() == 1 ? " waits in " : " wait in ") +
              desync::at(*in);
  }

  if (!mismatch.empty()) {
    report.summary = mismatch;
    report.severity = 4;
  } else if (!behind.empty()) {
    report.summary = behind;
    report.severity = 3;
  } else if (!gone.empty()) {
    report.summary = gone;
    report.severity = gone.find(" wait") != std::string::npos ? 2 : 1;
  } else if (!live.empty() && !live.front()->calls.empty()) {
    const call_record& last = live.front()->calls.back();
    report.summary =
        "every rank is at " + desync::at(last) + ": none is behind, and the calls match";
  } else {
    report.summary = "no rank has issued a collective yet";
  }
  if (!gone.empty() && report.summary != gone) report.details.push_back("also: " + gone);
  return report;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The table a diagnostics round prints: `header`, the summary, then the details, indented.
DTRAIN_DETAIL_INLINE std::string format_report(std::string_view header,
                                               const desync_report& report);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string format_report(std::string_view header,
                                               const desync_report& report) {
  std::string out = "dtrain: " + std::string(header) + "\n  " + report.summary + "\n";
  for (const std::string& d : report.details) out += "    " + d + "\n";
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The rings one rank publishes: its world communicator's and its splits', by name.
using named_rings = std::vector<std::pair<std::string, std::vector<call_record>>>;

/// What one rank published in a diagnostics round (`answered` false: nothing in time).
struct rank_publication {
  int rank = 0;
  bool answered = false;
  named_rings rings;
};

/// Rings as they travel through the store (detail/wire.hpp): version u8 (1),
/// ring count u32, then per communicator its name bytes32, call count u32 and
/// per call seq i64, kind bytes32, type u8, count u64, op i64, root i64,
/// state u8, label bytes32.
DTRAIN_DETAIL_INLINE std::string encode_rings(const named_rings& rings);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string encode_rings(const named_rings& rings) {
  std::string out;
  wire::writer w(out);
  w.u8(1).u32(static_cast<std::uint32_t>(rings.size()));
  for (const auto& [name, calls] : rings) {
    w.bytes32(name).u32(static_cast<std::uint32_t>(calls.size()));
    for (const call_record& c : calls) {
      w.i64(c.seq)
          .bytes32(c.kind)
          .u8(static_cast<std::uint8_t>(c.type))
          .u64(c.count)
          .i64(c.op)
          .i64(c.root)
          .u8(static_cast<std::uint8_t>(c.state))
          .bytes32(c.label);
    }
  }
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The rings of encode_rings' value; nothing when it is not such a value (the
/// rank then counts as not answering: diagnostics never throw).
DTRAIN_DETAIL_INLINE std::optional<named_rings> decode_rings(std::string_view value);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<named_rings> decode_rings(std::string_view value) {
  try {
    return wire::decode_value("a diagnostics ring", value, "rings", [](wire::reader& r) {
      if (const auto version = r.u8("the version"); version != 1) {
        throw wire::violation("version " + std::to_string(version) + " is not 1");
      }
      named_rings rings;
      const std::uint32_t count = r.u32("the ring count");
      for (std::uint32_t i = 0; i < count; ++i) {
        auto& [name, calls] =
            rings.emplace_back(std::string(r.bytes32("a ring's name")), std::vector<call_record>{});
        const std::uint32_t n = r.u32("the call count");
        for (std::uint32_t k = 0; k < n; ++k) {
          call_record c;
          c.seq = r.i64("seq");
          c.kind = r.bytes32("kind");
          const std::uint8_t type = r.u8("type");
          if (type > static_cast<std::uint8_t>(dtype::uint8)) throw wire::violation("a bad type");
          c.type = static_cast<dtype>(type);
          c.count = static_cast<std::size_t>(r.u64("count"));
          c.op = static_cast<int>(r.i64("op"));
          c.root = static_cast<int>(r.i64("root"));
          const std::uint8_t state = r.u8("state");
          if (state > static_cast<std::uint8_t>(call_state::timed_out)) {
            throw wire::violation("a bad state");
          }
          c.state = static_cast<call_state>(state);
          c.label = r.bytes32("label");
          calls.push_back(std::move(c));
        }
      }
      return rings;
    });
  } catch (const rendezvous_error&) {
    return std::nullopt;
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Analyses every communicator the ranks published (the world's first, then
/// the splits, by name) and returns the report of the one that explains most
/// (a mismatch, then a rank behind, then silent ranks), its details preceded
/// by the others' findings. Silent ranks count as members of the world and
/// of every split that all answering ranks have (DistributedDataParallel's
/// own split); a split that only some ranks have (a node's) is analysed over them.
DTRAIN_DETAIL_INLINE desync_report analyse_job(std::span<const rank_publication> ranks);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE desync_report analyse_job(std::span<const rank_publication> ranks) {
  std::vector<std::string> names;
  int answering = 0;
  for (const rank_publication& p : ranks) {
    answering += p.answered ? 1 : 0;
    for (const auto& entry : p.rings) {
      if (p.answered && std::find(names.begin(), names.end(), entry.first) == names.end())
        names.push_back(entry.first);
    }
  }
  if (names.empty()) names.push_back("world");
  std::vector<std::pair<std::string, desync_report>> reports;
  for (const std::string& name : names) {
    std::vector<rank_ring> rings;
    for (const rank_publication& p : ranks) {
      if (!p.answered) {
        rings.push_back({p.rank, false, {}});
        continue;
      }
      for (const auto& entry : p.rings) {
        if (entry.first == name) rings.push_back({p.rank, true, entry.second});
      }
    }
    const auto members =
        std::count_if(rings.begin(), rings.end(), [](const rank_ring& r) { return r.answered; });
    if (members < answering) {
      std::erase_if(rings, [](const rank_ring& r) { return !r.answered; });
    }
    reports.emplace_back(name, analyse(rings));
  }
  std::size_t best = 0;
  for (std::size_t i = 1; i < reports.size(); ++i) {
    if (reports[i].second.severity > reports[best].second.severity) best = i;
  }
  desync_report out = reports[best].second;
  if (reports.size() > 1) {
    out.summary += " (on communicator " + reports[best].first + ")";
    out.details.clear();
    for (const auto& [name, report] : reports) {
      out.details.push_back("communicator " + name + ":" +
                            (report.severity > 0 ? " " + report.summary : ""));
      for (const std::string& d : report.details) out.details.push_back("  " + d);
    }
  }
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/backend/desync.hpp ----
// ---- begin dtrain/backend/gloo.hpp ----
/// @file
/// gloo_communicator: the communicator concept on Gloo's TCP transport, for
/// host memory. Bootstrapped through dtrain's store, so env:// jobs (torchrun
/// style, no mpirun) run on CPUs. Gloo's calls block, so every communicator
/// runs its collectives on one worker thread, in the order they were
/// submitted; all ranks submit in the same order, so the queues stay matched.


// ---- begin dtrain/backend/gloo_store.hpp ----
/// @file
/// How a gloo_communicator bootstraps: dtrain's store behind Gloo's store
/// interface, and the choice of the network interface Gloo's TCP transport
/// binds to. Used by backend/gloo.hpp; without Gloo only the rule for the
/// interface variables is left (doctor/network.hpp reports it).

// ---- begin dtrain/detail/net.hpp ----
/// @file
/// What this host's network looks like to a process: its interfaces and
/// their addresses (getifaddrs), what a name resolves to, and which local
/// address reaches a host. Plain facts for the engines' interface choice
/// (backend/gloo_store.hpp) and for the network report (doctor/network.hpp).


#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace dtrain::detail {

/// One address of one interface.
struct interface_address {
  std::string name;     ///< "eth0"
  std::string address;  ///< numeric: "10.0.0.4", "fe80::1"
  bool ipv6 = false;
};

/// Every IPv4 and IPv6 address of every interface (getifaddrs); empty when it fails.
DTRAIN_DETAIL_INLINE std::vector<interface_address> interface_addresses();
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::vector<interface_address> interface_addresses() {
  std::vector<interface_address> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6))
      continue;
    const socklen_t length =
        i->ifa_addr->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    char text[NI_MAXHOST] = {};
    if (::getnameinfo(i->ifa_addr, length, text, sizeof text, nullptr, 0, NI_NUMERICHOST) != 0)
      continue;
    out.push_back({i->ifa_name, text, i->ifa_addr->sa_family == AF_INET6});
  }
  ::freeifaddrs(list);
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Names of the interfaces that carry an IPv4 or IPv6 address, each once.
DTRAIN_DETAIL_INLINE std::vector<std::string> interfaces_with_address();
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::vector<std::string> interfaces_with_address() {
  std::vector<std::string> names;
  for (const auto& a : interface_addresses()) {
    bool seen = false;
    for (const auto& n : names) seen = seen || n == a.name;
    if (!seen) names.push_back(a.name);
  }
  return names;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The numeric addresses `host` resolves to (getaddrinfo), or the resolver's
/// error in `error`.
struct resolved {
  std::vector<std::string> addresses;
  std::string error;  ///< empty on success
};
DTRAIN_DETAIL_INLINE resolved resolve(const std::string& host);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE resolved resolve(const std::string& host) {
  resolved out;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found); rc != 0) {
    out.error = ::gai_strerror(rc);
    return out;
  }
  for (addrinfo* a = found; a; a = a->ai_next) {
    char text[NI_MAXHOST] = {};
    if (::getnameinfo(a->ai_addr, a->ai_addrlen, text, sizeof text, nullptr, 0, NI_NUMERICHOST) !=
        0)
      continue;
    bool seen = false;
    for (const auto& s : out.addresses) seen = seen || s == text;
    if (!seen) out.addresses.emplace_back(text);
  }
  ::freeaddrinfo(found);
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The local address this host sends from to reach host:port (a UDP socket
/// connected there, asked for its own name; nothing is sent), or why not in `error`.
struct route_source {
  std::string address;
  std::string error;  ///< "cannot be resolved (...)" or the socket's error; empty on success
};
DTRAIN_DETAIL_INLINE route_source local_address_to(const std::string& host, int port);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE route_source local_address_to(const std::string& host, int port) {
  route_source out;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port > 0 ? port : 9);
  if (int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    out.error = std::string("cannot be resolved (") + ::gai_strerror(rc) + ")";
    return out;
  }
  std::string why = "no address";
  for (addrinfo* a = found; a && out.address.empty(); a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    sockaddr_storage local{};
    socklen_t length = sizeof local;
    char text[NI_MAXHOST] = {};
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      why = std::strerror(errno);
    } else if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) != 0) {
      why = std::strerror(errno);
    } else if (int rc = ::getnameinfo(reinterpret_cast<sockaddr*>(&local), length, text,
                                      sizeof text, nullptr, 0, NI_NUMERICHOST);
               rc != 0) {
      why = ::gai_strerror(rc);
    } else {
      out.address = text;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  if (out.address.empty()) out.error = "no local address reaches it (" + why + ")";
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Whether a numeric address is a loopback address (127.0.0.0/8, ::1).
inline bool is_loopback_address(const std::string& address) {
  return address.rfind("127.", 0) == 0 || address == "::1" || address.rfind("::ffff:127.", 0) == 0;
}

}  // namespace dtrain::detail
// ---- end dtrain/detail/net.hpp ----
// ---- begin dtrain/detail/sys.hpp ----
/// @file
/// Checked OS calls. Every call into the OS goes through DTRAIN_SYSCALL, which
/// captures file:line, the call as written and strerror(errno).


#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include <ftw.h>
#include <unistd.h>

namespace dtrain::detail {

/// "what: strerror(err) (at file:line)".
DTRAIN_DETAIL_INLINE std::string os_error_text(const std::string& what, int err, const char* file,
                                               int line);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string os_error_text(const std::string& what, int err, const char* file,
                                               int line) {
  return what + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ", at " + file +
         ":" + std::to_string(line) + ")";
}
#endif  // DTRAIN_DETAIL_BODIES()

/// An owned file descriptor, closed on destruction.
class unique_fd {
 public:
  unique_fd() = default;
  explicit unique_fd(int fd) noexcept : fd_(fd) {}
  unique_fd(unique_fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  unique_fd& operator=(unique_fd&& other) noexcept {
    if (this != &other) reset(std::exchange(other.fd_, -1));
    return *this;
  }
  unique_fd(const unique_fd&) = delete;
  unique_fd& operator=(const unique_fd&) = delete;
  ~unique_fd() { reset(); }

  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] explicit operator bool() const noexcept { return fd_ >= 0; }
  /// Gives the descriptor up without closing it.
  [[nodiscard]] int release() noexcept { return std::exchange(fd_, -1); }
  void reset(int fd = -1) noexcept;

 private:
  int fd_ = -1;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void unique_fd::reset(int fd) noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// This machine's host name; nullopt when gethostname fails (each caller
/// decides what that means for it).
DTRAIN_DETAIL_INLINE std::optional<std::string> host_name();
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<std::string> host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return std::nullopt;
  return std::string(name);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Removes `path` and everything under it, as `rm -rf` does (symbolic links
/// are removed, not followed); a path that does not exist is no error.
/// Returns 0, or the errno of the first failure. POSIX (nftw), not
/// std::filesystem::remove_all: PyTorch's wheels export a
/// std::filesystem::remove_all(const path&) of their own from libtorch.so,
/// which wins the symbol lookup in any program linked to that LibTorch, and
/// which called a null pointer there (PyTorch 2.11, CUDA 13).
DTRAIN_DETAIL_INLINE int remove_tree(const char* path);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE int remove_tree(const char* path) {
  // nftw's callback takes no state: the first failure is this thread's.
  static thread_local int first_error = 0;
  first_error = 0;
  auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) {
    if (::remove(p) != 0 && errno != ENOENT && first_error == 0) first_error = errno;
    return 0;  // go on: remove what can be removed
  };
  if (::nftw(path, remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0) {
    return errno == ENOENT ? 0 : errno;
  }
  return first_error;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail

/// Evaluates `call` (an OS call returning -1 on failure) and throws
/// dtrain::error with the call, file:line and strerror(errno) when it fails.
#define DTRAIN_SYSCALL(call)                                                          \
  ([&]() {                                                                            \
    auto dtrain_result_ = (call);                                                     \
    if (dtrain_result_ == -1) {                                                       \
      int dtrain_errno_ = errno;                                                      \
      throw ::dtrain::error(                                                          \
          ::dtrain::detail::os_error_text(#call, dtrain_errno_, __FILE__, __LINE__)); \
    }                                                                                 \
    return dtrain_result_;                                                            \
  }())
// ---- end dtrain/detail/sys.hpp ----


#include <optional>
#include <string>

namespace dtrain::detail {

/// An interface named by a variable, with the variable as it was set.
struct named_interface {
  std::string name;    ///< "eth0"
  std::string origin;  ///< "GLOO_SOCKET_IFNAME=eth0,eth1"
};

/// The interface the environment tells Gloo to use: DTRAIN_GLOO_IFNAME, else
/// the first entry of GLOO_SOCKET_IFNAME (Gloo's TCP device takes one); nullopt
/// when neither is set (then the interface that reaches MASTER_ADDR is used).
DTRAIN_DETAIL_INLINE std::optional<named_interface> gloo_interface_variable(const environment& env);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<named_interface> gloo_interface_variable(
    const environment& env) {
  if (auto v = env.get(gloo_ifname_variable); v && !v->empty()) {
    return named_interface{std::string(*v), assignment(gloo_ifname_variable, *v)};
  }
  if (auto v = env.get("GLOO_SOCKET_IFNAME"); v && !v->empty()) {
    return named_interface{std::string(v->substr(0, v->find(','))),
                           "GLOO_SOCKET_IFNAME=" + std::string(*v)};
  }
  return std::nullopt;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail

#if DTRAIN_HAS_GLOO()

#include <gloo/rendezvous/store.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace dtrain::detail {

/// Any dtrain store, seen through the calls the Gloo backend makes, so that
/// gloo_communicator is one type whatever store bootstrapped it (its splits
/// bootstrap through the same store later). Refers to the store, which must
/// outlive every communicator made from it.
class gloo_store_ref {
 public:
  using milliseconds = std::chrono::milliseconds;

  template <store S>
  explicit gloo_store_ref(S& s)
      : set_([p = &s](std::string_view key, std::string_view value) { p->set(key, value); }),
        get_([p = &s](std::string_view key, milliseconds timeout) {
          return std::string(p->get(key, timeout));
        }),
        wait_([p = &s](std::span<const std::string> keys, milliseconds timeout) {
          p->wait(keys, timeout);
        }),
        add_([p = &s](std::string_view key, std::int64_t delta) {
          return std::int64_t(p->add(key, delta));
        }),
        erase_([p = &s](std::string_view key) { p->erase(key); }) {}

  void set(std::string_view key, std::string_view value) const { set_(key, value); }
  [[nodiscard]] std::string get(std::string_view key, milliseconds timeout) const {
    return get_(key, timeout);
  }
  void wait(std::span<const std::string> keys, milliseconds timeout) const { wait_(keys, timeout); }
  std::int64_t add(std::string_view key, std::int64_t delta) const { return add_(key, delta); }
  void erase(std::string_view key) const { erase_(key); }

 private:
  std::function<void(std::string_view, std::string_view)> set_;
  std::function<std::string(std::string_view, milliseconds)> get_;
  std::function<void(std::span<const std::string>, milliseconds)> wait_;
  std::function<std::int64_t(std::string_view, std::int64_t)> add_;
  std::function<void(std::string_view)> erase_;
};

/// Gloo's five-method store on top of a dtrain store, every key under
/// `prefix/`. Remembers the keys it wrote, so that they can be erased once
/// every rank has connected (a full mesh of N ranks leaves N values of
/// O(N) addresses each).
class gloo_store_adapter final : public ::gloo::rendezvous::Store {
 public:
  gloo_store_adapter(const gloo_store_ref& store, std::string prefix,
                     std::chrono::milliseconds timeout)
      : store_(store), prefix_(std::move(prefix) + "/"), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override;

  std::vector<char> get(const std::string& key) override;

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  [[nodiscard]] const std::vector<std::string>& written() const noexcept { return written_; }

 private:
  const gloo_store_ref& store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
  std::vector<std::string> written_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void gloo_store_adapter::set(const std::string& key,
                                                  const std::vector<char>& data) {
  store_.set(prefix_ + key, std::string_view(data.data(), data.size()));
  written_.push_back(prefix_ + key);
}

DTRAIN_DETAIL_INLINE std::vector<char> gloo_store_adapter::get(const std::string& key) {
  std::string value = store_.get(prefix_ + key, timeout_);
  return {value.begin(), value.end()};
}

DTRAIN_DETAIL_INLINE void gloo_store_adapter::wait(const std::vector<std::string>& keys,
                                                   const std::chrono::milliseconds& timeout) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const auto& k : keys) full.push_back(prefix_ + k);
  // Gloo passes kNoTimeout (0) to mean "the default".
  store_.wait(full, timeout.count() > 0 ? timeout : timeout_);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Where Gloo's TCP transport listens: a named interface, or an address.
struct gloo_endpoint {
  std::string iface;     ///< network interface name ("eth0"), or empty
  std::string hostname;  ///< numeric address to bind, when no interface is named
  std::string origin;    ///< how it was chosen, for messages: "DTRAIN_GLOO_IFNAME=eth0"
};

/// Throws config_error naming `origin` when no interface `name` with an address exists here.
DTRAIN_DETAIL_INLINE void require_interface(const std::string& name, const std::string& origin);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void require_interface(const std::string& name, const std::string& origin) {
  auto names = interfaces_with_address();
  for (const auto& n : names) {
    if (n == name) return;
  }
  std::string known;
  for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
  throw config_error(
      origin + " names no network interface with an IP address on this host (interfaces: " +
      (known.empty() ? std::string("none") : known) +
      "); name one of them, or unset it to use the interface that reaches MASTER_ADDR");
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The local address this host sends from to reach host:port; config_error
/// naming `origin` when there is none.
DTRAIN_DETAIL_INLINE std::string local_address_towards(const std::string& host, int port,
                                                       const std::string& origin);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string local_address_towards(const std::string& host, int port,
                                                       const std::string& origin) {
  const route_source route = local_address_to(host, port);
  if (route.error.rfind("cannot be resolved", 0) == 0) {
    throw config_error(origin + " " + route.error +
                       ", so no interface for Gloo can be chosen from it; set DTRAIN_GLOO_IFNAME");
  }
  if (!route.error.empty()) {
    throw config_error(origin + ": " + route.error + "; set DTRAIN_GLOO_IFNAME");
  }
  return route.address;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Chooses Gloo's endpoint: the `interface` option, else DTRAIN_GLOO_IFNAME,
/// else GLOO_SOCKET_IFNAME (its first entry when a list), else the local
/// address that reaches the master (`master_addr` option, else MASTER_ADDR),
/// else 127.0.0.1 for a world of one and the host name otherwise. A named
/// interface that does not exist is a config_error naming it.
DTRAIN_DETAIL_INLINE gloo_endpoint choose_gloo_endpoint(const std::string& interface_option,
                                                        const std::string& master_option,
                                                        const environment& env, int size);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE gloo_endpoint choose_gloo_endpoint(const std::string& interface_option,
                                                        const std::string& master_option,
                                                        const environment& env, int size) {
  auto named = [](std::string name, std::string origin) {
    require_interface(name, origin);
    return gloo_endpoint{std::move(name), {}, std::move(origin)};
  };
  if (!interface_option.empty())
    return named(interface_option, "gloo_options::interface=" + interface_option);
  if (auto variable = gloo_interface_variable(env)) {
    return named(std::move(variable->name), std::move(variable->origin));
  }
  std::string master = master_option;
  std::string origin = "gloo_options::master_addr=" + master_option;
  if (master.empty()) {
    if (auto v = env.get("MASTER_ADDR"); v && !v->empty()) {
      master = std::string(*v);
      origin = "MASTER_ADDR=" + master;
    }
  }
  if (!master.empty()) {
    const int port = read_port(env, "MASTER_PORT").value_or(sourced_int{0, {}}).value;
    std::string address = local_address_towards(master, port, origin);
    return {{}, address, "the address that reaches " + origin + " (" + address + ")"};
  }
  if (size == 1) return {{}, "127.0.0.1", "127.0.0.1 (a world of one, no MASTER_ADDR)"};
  const std::string host = host_name().value_or("");
  return {{}, host, "the host name " + host + " (no interface named and no MASTER_ADDR)"};
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail

#endif  // DTRAIN_HAS_GLOO()
// ---- end dtrain/backend/gloo_store.hpp ----
// ---- begin dtrain/backend/gloo_worker.hpp ----
/// @file
/// How a gloo_communicator runs its collectives: Gloo's calls block, so each
/// communicator queues them for one worker thread, in submission order (all
/// ranks submit in the same order, so the queues stay matched), and its work
/// handles report their completion. Used by backend/gloo.hpp; compiles to
/// nothing without Gloo.


// ---- begin dtrain/backend/shm.hpp ----
/// @file
/// The same-host path of the Gloo communicator: an allreduce through one
/// shared-memory segment that every rank of a communicator maps, for when all
/// of them run on one host. Gloo has no shared-memory transport (NCCL and
/// Open MPI have theirs), so between processes on one host it sends every
/// byte through TCP over loopback, across the kernel twice per hop. Here each
/// rank copies into its slot the parts of its input that the others reduce,
/// reduces its own part over every rank's data (in rank order) into the
/// result slot and its output, and copies the others' parts of the result
/// out: about two passes over memory, and two waits for the slowest rank.
///
/// The segment (shm_open) is made by rank 0 under a random name with mode
/// 0600 and is unlinked once every rank has opened it (backend/gloo.hpp runs
/// that over Gloo); its size is fixed when it is made: (ranks + 1) slots of
/// shm_slot_bytes(ranks). Ranks wait for each other on futexes, never by
/// spinning for long. Every rank holds a lock on one byte of the segment's
/// file while it lives, which the kernel drops when the process dies: so a
/// waiting rank tells a dead peer from a slow one (and, unlike a pid, in any
/// pid namespace). A rank that gives up (timeout, dead peer) says so in the
/// segment, and the others stop waiting at once. Linux only; this header
/// needs neither Gloo nor MPI, so the unit tests run it between forked
/// processes.



#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#if defined(__linux__)
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#define DTRAIN_HAS_SHM() 1
#else
#define DTRAIN_HAS_SHM() 0
#endif

namespace dtrain::detail {

/// A failure on the shared-memory path: a peer that died, gave up or did not
/// come within the timeout (`timed_out`), or a segment that cannot be made.
class shm_failure : public std::runtime_error {
 public:
  shm_failure(const std::string& what, bool timed_out)
      : std::runtime_error(what), timed_out_(timed_out) {}
  [[nodiscard]] bool timed_out() const noexcept { return timed_out_; }

 private:
  bool timed_out_;
};

/// The bytes of one slot for a group of `ranks`: 1 MiB, less when the
/// (ranks + 1) slots would pass 16 MiB (so 15 ranks or more), never below
/// 4 KiB. A larger allreduce runs as a sequence of slot-sized chunks.
[[nodiscard]] constexpr std::size_t shm_slot_bytes(int ranks) noexcept {
  constexpr std::size_t most = std::size_t{1} << 20;
  constexpr std::size_t budget = std::size_t{16} << 20;
  constexpr std::size_t page = 4096;
  const std::size_t share = budget / (static_cast<std::size_t>(ranks < 1 ? 1 : ranks) + 1);
  const std::size_t slot = share < most ? share / page * page : most;
  return slot < page ? page : slot;
}

/// Calls `loop(f)` with f(x, y) the element-wise `op` on T (avg as sum), so
/// that the op is chosen once per call, not per element.
template <element T, class Loop>
void shm_with_op(reduce_op op, Loop&& loop) {
  switch (op) {
    case reduce_op::min: loop([](T x, T y) { return y < x ? y : x; }); break;
    case reduce_op::max: loop([](T x, T y) { return x < y ? y : x; }); break;
    case reduce_op::prod: loop([](T x, T y) { return static_cast<T>(x * y); }); break;
    case reduce_op::sum:
    case reduce_op::avg: loop([](T x, T y) { return static_cast<T>(x + y); }); break;
  }
}

/// `out` = `a` op `b`, element-wise (avg as sum), over three distinct
/// buffers, in blocks of 16 elements, which GCC and Clang vectorise at -O2.
template <element T>
void shm_combine(T* __restrict out, const T* __restrict a, const T* __restrict b, std::size_t n,
                 reduce_op op) noexcept {
  if constexpr (std::same_as<T, float16> || std::same_as<T, bfloat16>) {
    std::memcpy(out, a, n * sizeof(T));
    reduce_host(out, b, n, op);
  } else {
    shm_with_op<T>(op, [&](auto f) {
      std::size_t i = 0;
      for (; i + 16 <= n; i += 16) {
        for (std::size_t j = 0; j < 16; ++j) out[i + j] = f(a[i + j], b[i + j]);
      }
      for (; i < n; ++i) out[i] = f(a[i], b[i]);
    });
  }
}

/// `inout` op= `in`, element-wise (avg as sum), as shm_combine.
template <element T>
void shm_reduce(T* __restrict inout, const T* __restrict in, std::size_t n, reduce_op op) noexcept {
  if constexpr (std::same_as<T, float16> || std::same_as<T, bfloat16>) {
    reduce_host(inout, in, n, op);
  } else {
    shm_with_op<T>(op, [&](auto f) {
      std::size_t i = 0;
      for (; i + 16 <= n; i += 16) {
        for (std::size_t j = 0; j < 16; ++j) inout[i + j] = f(inout[i + j], in[i + j]);
      }
      for (; i < n; ++i) inout[i] = f(inout[i], in[i]);
    });
  }
}

#if DTRAIN_HAS_SHM()

/// One mapped segment, as one rank of the group sees it. Move-only; unmaps,
/// closes (dropping this rank's lock) and never unlinks on destruction.
class shm_segment {
 public:
  static constexpr std::uint64_t magic = 0x31'6d'68'73'6e'72'74'64ULL;  // "dtrnshm1"

  shm_segment() = default;
  shm_segment(shm_segment&& o) noexcept { swap(o); }
  shm_segment& operator=(shm_segment&& o) noexcept {
    shm_segment(std::move(o)).swap(*this);
    return *this;
  }
  shm_segment(const shm_segment&) = delete;
  shm_segment& operator=(const shm_segment&) = delete;
  ~shm_segment();

  /// Rank 0: makes the segment `name` ("/dtrain-..."), which must not exist,
  /// for `size` ranks. Throws shm_failure (not timed out) saying which call failed.
  static shm_segment create(const std::string& name, int size);

  /// Every other rank: opens the segment rank 0 made and checks that it was
  /// made for `size` ranks. Throws shm_failure (not timed out).
  static shm_segment open(const std::string& name, int rank, int size);

  /// Removes the name (every rank keeps its mapping). Rank 0, once all have opened it.
  static void unlink(const std::string& name) noexcept { ::shm_unlink(name.c_str()); }

  [[nodiscard]] bool valid() const noexcept { return base_ != nullptr; }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] std::size_t slot_bytes() const noexcept { return slot_; }

  /// `out` (count elements) becomes the reduction of every rank's `in` (in
  /// place when they are the same). Every rank of the group must call it with
  /// the same count, type and op, in the same order among its allreduces. avg
  /// sums, then divides each element once by the group's size. The result is
  /// the same bits on every rank: element i is reduced by one rank, in rank
  /// order. Throws shm_failure: timed out when a peer did not come within
  /// `timeout` (for the whole call), not timed out when one died or gave up.
  /// Either way the segment is then unusable, and so are the peers' copies.
  template <element T>
  void allreduce(const T* in, T* out, std::size_t count, reduce_op op,
                 std::chrono::milliseconds timeout) {
    if (!base_) throw shm_failure("the shared-memory segment is not mapped", false);
    if (size_ == 1) {  // a group of one (the Gloo communicator never makes one)
      if (in != out && count > 0) std::memcpy(out, in, count * sizeof(T));
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    const std::size_t chunk = slot_ / sizeof(T);
    const auto ranks = static_cast<std::size_t>(size_);
    const auto me = static_cast<std::size_t>(rank_);
    const std::size_t chunks = (count + chunk - 1) / chunk;
    for (std::size_t c = 0; c < chunks; ++c) {
      const std::size_t offset = c * chunk;
      const std::size_t n = count - offset < chunk ? count - offset : chunk;
      const std::uint32_t k = ++chunk_;
      // This rank reduces elements [lo, hi) of the chunk; the others, the rest.
      const std::size_t lo = n * me / ranks, hi = n * (me + 1) / ranks;
      const T* own = in + offset;
      // 1. The parts the others reduce, into this rank's slot (its own part
      //    it reads where it is). Every rank finished reading the slots of
      //    the previous chunk before it announced that chunk reduced.
      std::memcpy(slot<T>(me), own, lo * sizeof(T));
      std::memcpy(slot<T>(me) + hi, own + hi, (n - hi) * sizeof(T));
      publish(flags(rank_).arrived, k);
      wait_all(&rank_flags::arrived, k, deadline, timeout, "copy in", c, chunks);
      // 2. This rank's part, over every rank's data in rank order, into the
      //    result slot and into `out` (in place too: nobody reads this part
      //    of `in` after this). Every rank finished copying the previous
      //    chunk's result out before it announced this chunk's input.
      if (hi > lo) {
        const auto from = [&](std::size_t q) { return (q == me ? own : slot<T>(q)) + lo; };
        T* result = slot<T>(ranks) + lo;
        shm_combine(result, from(0), from(1), hi - lo, op);
        for (std::size_t q = 2; q < ranks; ++q) shm_reduce(result, from(q), hi - lo, op);
        if (op == reduce_op::avg) divide_host(buffer{result, hi - lo, dtype_of<T>}, size_);
        std::memcpy(out + offset + lo, result, (hi - lo) * sizeof(T));
      }
      publish(flags(rank_).reduced, k);
      wait_all(&rank_flags::reduced, k, deadline, timeout, "reduce", c, chunks);
      // 3. The other ranks' parts of the result out.
      std::memcpy(out + offset, slot<T>(ranks), lo * sizeof(T));
      std::memcpy(out + offset + hi, slot<T>(ranks) + hi, (n - hi) * sizeof(T));
    }
  }

  /// `out` (size() x `bytes`) becomes every rank's `in` (`bytes` each), in
  /// rank order; `in` may be this rank's block of `out`. Every rank calls it
  /// with the same `bytes`, in the same order among its collectives on the
  /// segment. In chunks of a slot: each rank copies its chunk into its slot,
  /// and, once all have, every slot out. Throws shm_failure as allreduce.
  void allgather(const void* in, void* out, std::size_t bytes, std::chrono::milliseconds timeout) {
    if (!base_) throw shm_failure("the shared-memory segment is not mapped", false);
    const auto ranks = static_cast<std::size_t>(size_);
    const auto me = static_cast<std::size_t>(rank_);
    const auto* from = static_cast<const unsigned char*>(in);
    auto* to = static_cast<unsigned char*>(out);
    if (size_ == 1) {
      if (from != to && bytes > 0) std::memcpy(to, from, bytes);
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    const std::size_t chunks = (bytes + slot_ - 1) / slot_;
    for (std::size_t c = 0; c < chunks; ++c) {
      const std::size_t offset = c * slot_;
      const std::size_t n = bytes - offset < slot_ ? bytes - offset : slot_;
      const std::uint32_t k = ++chunk_;
      // 1. This rank's chunk into its slot. Every rank finished reading the
      //    slots of the previous chunk before it announced that chunk copied out.
      std::memcpy(slot<unsigned char>(me), from + offset, n);
      publish(flags(rank_).arrived, k);
      wait_all(&rank_flags::arrived, k, deadline, timeout, "copy in", c, chunks);
      // 2. Every rank's chunk out (this rank's own from `in`, unless it is there already).
      for (std::size_t q = 0; q < ranks; ++q) {
        unsigned char* place = to + q * bytes + offset;
        if (q == me) {
          if (place != from + offset) std::memcpy(place, from + offset, n);
        } else {
          std::memcpy(place, slot<unsigned char>(q), n);
        }
      }
      publish(flags(rank_).reduced, k);
      wait_all(&rank_flags::reduced, k, deadline, timeout, "copy out", c, chunks);
    }
  }

  /// Tells the peers that this rank gave up, and `why`, waking any that wait.
  /// The first rank to give up is the one they name; `timed_out` (it gave up
  /// at the timeout) makes their failures timeouts too.
  void abandon(std::string_view why = {}, bool timed_out = false) noexcept;

 private:
  /// A futex word and the count of ranks sleeping on it (so that a rank that
  /// announces progress makes a system call only when someone sleeps).
  struct alignas(64) flag {
    std::atomic<std::uint32_t> value{0};
    std::atomic<std::uint32_t> sleepers{0};
  };
  /// One rank's progress: the last chunk it copied in, and the last it reduced.
  struct rank_flags {
    flag arrived;
    flag reduced;
  };
  struct alignas(64) control {
    std::uint64_t magic = 0;
    std::uint64_t slot_bytes = 0;
    std::uint32_t size = 0;
    std::atomic<std::uint32_t> claimed{0};       // 1 once a rank gives up
    std::atomic<std::uint32_t> abandoned_by{0};  // then 1 + that rank, once `why` is written
    std::atomic<std::uint32_t> timed_out{0};     // written before abandoned_by: 1 for a timeout
    char why[236] = {};
  };
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t) &&
                std::atomic<std::uint32_t>::is_always_lock_free);

  static constexpr std::size_t data_offset(int size) noexcept {
    const std::size_t end = sizeof(control) + static_cast<std::size_t>(size) * sizeof(rank_flags);
    return (end + 4095) / 4096 * 4096;
  }

  [[noreturn]] static void fail_call(const std::string& call) {
    throw shm_failure(call + ": " + std::strerror(errno), false);
  }

  void map(const std::string& name);

  // An open-file-description lock on byte `rank` of the file: it lives as
  // long as this mapping's descriptor, and no longer than the process.
  void lock_own_byte(const std::string& name);

  // False only when the peer's lock is gone: it exited. True when unsure.
  [[nodiscard]] bool alive(int peer) const noexcept;

  [[nodiscard]] control& head() const noexcept {
    return *std::launder(static_cast<control*>(base_));
  }
  [[nodiscard]] rank_flags& flags(int r) const noexcept;
  // Slot q of the ranks; slot `size` is the result.
  template <class T>
  [[nodiscard]] T* slot(std::size_t q) const noexcept {
    return reinterpret_cast<T*>(static_cast<unsigned char*>(base_) + data_offset(size_) +
                                q * slot_);
  }

  static long futex(std::atomic<std::uint32_t>& word, int op, std::uint32_t value,
                    const timespec* wait) noexcept;
  static void wake(flag& f) noexcept {
    futex(f.value, FUTEX_WAKE, static_cast<std::uint32_t>(INT_MAX), nullptr);
  }
  static void publish(flag& f, std::uint32_t k) noexcept;
  static bool reached(std::uint32_t value, std::uint32_t k) noexcept {
    return static_cast<std::int32_t>(value - k) >= 0;  // counts wrap after 2^32 chunks
  }

  // Waits until every rank's `which` reached chunk k: spins briefly (the peer
  // is often on another core, a few microseconds away), then sleeps on the
  // futex in slices, checking between them for a peer that gave up or died
  // and for the deadline.
  void wait_all(flag rank_flags::*which, std::uint32_t k,
                std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds timeout,
                const char* phase, std::size_t c, std::size_t chunks);

  [[nodiscard]] std::string where(int q, const char* phase, std::size_t c,
                                  std::size_t chunks) const;

  void swap(shm_segment& o) noexcept;

  void* base_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t slot_ = 0;
  int fd_ = -1;
  int rank_ = 0;
  int size_ = 1;
  std::uint32_t chunk_ = 0;  // chunks this rank has run: the same count on every rank
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE shm_segment::~shm_segment() {
  if (base_) ::munmap(base_, bytes_);
  if (fd_ >= 0) ::close(fd_);
}

DTRAIN_DETAIL_INLINE shm_segment shm_segment::create(const std::string& name, int size) {
  shm_segment s;
  s.rank_ = 0;
  s.size_ = size;
  s.slot_ = shm_slot_bytes(size);
  s.bytes_ = data_offset(size) + (static_cast<std::size_t>(size) + 1) * s.slot_;
  s.fd_ = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, S_IRUSR | S_IWUSR);
  if (s.fd_ < 0) fail_call("shm_open(" + name + ", O_CREAT | O_EXCL, 0600)");
  try {
    // Reserve every page now: a tmpfs that is full (a container's 64 MiB
    // /dev/shm) fails here, not with SIGBUS on a later write.
    if (const int e = ::posix_fallocate(s.fd_, 0, static_cast<off_t>(s.bytes_)); e != 0) {
      errno = e;
      fail_call("posix_fallocate(" + name + ", " + std::to_string(s.bytes_) + " bytes)");
    }
    s.map(name);
    auto* c = new (s.base_) control{};
    c->size = static_cast<std::uint32_t>(size);
    c->slot_bytes = s.slot_;
    for (int r = 0; r < size; ++r) new (&s.flags(r)) rank_flags{};
    c->magic = magic;  // last: a segment with the magic is complete
    s.lock_own_byte(name);
  } catch (...) {
    unlink(name);  // nothing of a segment that failed stays behind
    throw;
  }
  return s;
}

DTRAIN_DETAIL_INLINE shm_segment shm_segment::open(const std::string& name, int rank, int size) {
  shm_segment s;
  s.rank_ = rank;
  s.size_ = size;
  s.slot_ = shm_slot_bytes(size);
  s.bytes_ = data_offset(size) + (static_cast<std::size_t>(size) + 1) * s.slot_;
  s.fd_ = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (s.fd_ < 0) fail_call("shm_open(" + name + ", O_RDWR)");
  struct stat st {};
  if (::fstat(s.fd_, &st) != 0) fail_call("fstat(" + name + ")");
  if (static_cast<std::size_t>(st.st_size) != s.bytes_) {
    throw shm_failure("segment " + name + " holds " + std::to_string(st.st_size) +
                          " bytes, not the " + std::to_string(s.bytes_) + " of a group of " +
                          std::to_string(size),
                      false);
  }
  s.map(name);
  const control& c = s.head();
  if (c.magic != magic || c.size != static_cast<std::uint32_t>(size) || c.slot_bytes != s.slot_) {
    throw shm_failure(
        "segment " + name + " was not made by dtrain for a group of " + std::to_string(size),
        false);
  }
  s.lock_own_byte(name);
  return s;
}

DTRAIN_DETAIL_INLINE void shm_segment::abandon(std::string_view why, bool timed_out) noexcept {
  if (!base_) return;
  control& c = head();
  if (c.claimed.exchange(1) == 0) {
    const std::size_t n = why.size() < sizeof c.why - 1 ? why.size() : sizeof c.why - 1;
    std::memcpy(c.why, why.data(), n);
    c.why[n] = '\0';
    c.timed_out.store(timed_out ? 1 : 0, std::memory_order_relaxed);
    c.abandoned_by.store(static_cast<std::uint32_t>(rank_) + 1, std::memory_order_release);
  }
  for (int r = 0; r < size_; ++r) {
    wake(flags(r).arrived);
    wake(flags(r).reduced);
  }
}

DTRAIN_DETAIL_INLINE void shm_segment::map(const std::string& name) {
  void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) fail_call("mmap(" + name + ")");
  base_ = p;
}

DTRAIN_DETAIL_INLINE void shm_segment::lock_own_byte(const std::string& name) {
  struct flock l {};
  l.l_type = F_WRLCK;
  l.l_whence = SEEK_SET;
  l.l_start = rank_;
  l.l_len = 1;
  if (::fcntl(fd_, F_OFD_SETLK, &l) != 0) fail_call("fcntl(" + name + ", F_OFD_SETLK)");
}

DTRAIN_DETAIL_INLINE bool shm_segment::alive(int peer) const noexcept {
  struct flock l {};
  l.l_type = F_WRLCK;
  l.l_whence = SEEK_SET;
  l.l_start = peer;
  l.l_len = 1;
  if (::fcntl(fd_, F_OFD_GETLK, &l) != 0) return true;
  return l.l_type != F_UNLCK;
}

DTRAIN_DETAIL_INLINE auto shm_segment::flags(int r) const noexcept -> rank_flags& {
  auto* p = static_cast<unsigned char*>(base_) + sizeof(control) +
            static_cast<std::size_t>(r) * sizeof(rank_flags);
  return *std::launder(reinterpret_cast<rank_flags*>(p));
}

DTRAIN_DETAIL_INLINE long shm_segment::futex(std::atomic<std::uint32_t>& word, int op,
                                             std::uint32_t value, const timespec* wait) noexcept {
  return ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), op, value, wait, nullptr, 0);
}

DTRAIN_DETAIL_INLINE void shm_segment::publish(flag& f, std::uint32_t k) noexcept {
  f.value.store(k, std::memory_order_seq_cst);
  if (f.sleepers.load(std::memory_order_seq_cst) != 0) wake(f);
}

DTRAIN_DETAIL_INLINE void shm_segment::wait_all(flag rank_flags::*which, std::uint32_t k,
                                                std::chrono::steady_clock::time_point deadline,
                                                std::chrono::milliseconds timeout,
                                                const char* phase, std::size_t c,
                                                std::size_t chunks) {
  for (int q = 0; q < size_; ++q) {
    flag& f = flags(q).*which;
    for (int spin = 0; spin < 256 && !reached(f.value.load(std::memory_order_acquire), k); ++spin) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
    while (!reached(f.value.load(std::memory_order_acquire), k)) {
      // The rank waited for first: its death is the cause, another's giving up a consequence.
      if (!alive(q)) {
        std::string why = where(q, phase, c, chunks) + ": rank " + std::to_string(q) +
                          " exited or closed its communicator (its lock on the segment is "
                          "gone)";
        abandon(why);
        throw shm_failure(why, false);
      }
      if (const std::uint32_t by = head().abandoned_by.load(std::memory_order_acquire); by != 0) {
        const char* why = head().why;
        throw shm_failure("rank " + std::to_string(by - 1) + " gave up on this allreduce: " +
                              std::string(why, ::strnlen(why, sizeof head().why)),
                          head().timed_out.load(std::memory_order_relaxed) != 0);
      }
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        std::string why = where(q, phase, c, chunks) + ": rank " + std::to_string(q) +
                          " did not come within the timeout (" + std::to_string(timeout.count()) +
                          " ms): timed out";
        abandon(why, true);
        throw shm_failure(why, true);
      }
      const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now);
      const auto slice = left < std::chrono::milliseconds(20)
                             ? left
                             : std::chrono::nanoseconds(std::chrono::milliseconds(20));
      const timespec wait{static_cast<time_t>(slice.count() / 1'000'000'000),
                          static_cast<long>(slice.count() % 1'000'000'000)};
      f.sleepers.fetch_add(1, std::memory_order_seq_cst);
      const std::uint32_t seen = f.value.load(std::memory_order_seq_cst);
      if (!reached(seen, k)) futex(f.value, FUTEX_WAIT, seen, &wait);
      f.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
}

DTRAIN_DETAIL_INLINE std::string shm_segment::where(int q, const char* phase, std::size_t c,
                                                    std::size_t chunks) const {
  return "shared memory, rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
         " waiting for rank " + std::to_string(q) + " to " + phase + " chunk " +
         std::to_string(c + 1) + " of " + std::to_string(chunks);
}

DTRAIN_DETAIL_INLINE void shm_segment::swap(shm_segment& o) noexcept {
  std::swap(base_, o.base_);
  std::swap(bytes_, o.bytes_);
  std::swap(slot_, o.slot_);
  std::swap(fd_, o.fd_);
  std::swap(rank_, o.rank_);
  std::swap(size_, o.size_);
  std::swap(chunk_, o.chunk_);
}
#endif  // DTRAIN_DETAIL_BODIES()

#endif  // DTRAIN_HAS_SHM()

}  // namespace dtrain::detail
// ---- end dtrain/backend/shm.hpp ----

#if DTRAIN_HAS_GLOO()

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/logging.h>
#include <gloo/context.h>
#include <gloo/math.h>
#include <gloo/transport/device.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::detail {

template <class T>
inline constexpr bool is_half_float = std::same_as<T, float16> || std::same_as<T, bfloat16>;

/// Gloo's element-wise reduction (c = a op b; c may be a or b) for T and op.
/// Gloo's own functions for native types; reduce_host for our 16-bit floats,
/// which Gloo does not know. avg reduces as sum; the caller divides.
template <element T>
::gloo::AllreduceOptions::Func gloo_reduce_function(reduce_op op) {
  if constexpr (is_half_float<T>) {
    return [op](void* c, const void* a, const void* b, std::size_t n) {
      auto* out = static_cast<T*>(c);
      const auto* x = static_cast<const T*>(a);
      const auto* y = static_cast<const T*>(b);
      if (out == y) {  // every reduce_op commutes
        reduce_host(out, x, n, op);
        return;
      }
      if (out != x) std::memcpy(out, x, n * sizeof(T));
      reduce_host(out, y, n, op);
    };
  } else {
    using function = void (*)(void*, const void*, const void*, std::size_t);
    switch (op) {
      case reduce_op::min: return static_cast<function>(&::gloo::min<T>);
      case reduce_op::max: return static_cast<function>(&::gloo::max<T>);
      case reduce_op::prod: return static_cast<function>(&::gloo::product<T>);
      case reduce_op::sum:
      case reduce_op::avg: break;
    }
    return static_cast<function>(&::gloo::sum<T>);
  }
}

struct gloo_state;

/// What the worker runs for one collective: Gloo's call for `call`, with
/// Gloo's timeout for this run. Each collective of gloo_communicator is one.
using gloo_runner = void (*)(gloo_state& s, const collective_call& call,
                             std::chrono::milliseconds timeout);

class gloo_work;

/// What the communicator, its worker thread and its work handles share.
struct gloo_state {
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{};
  bool check = false;
  std::shared_ptr<::gloo::transport::Device> device;
  std::shared_ptr<::gloo::Context> context;
#if DTRAIN_HAS_SHM()
  shm_segment shm;  // valid: every rank runs on this host, and allreduces go through it
#endif
  std::string shm_text = "off";  // for describe(): "on (...)" or "off (why)"

  /// One queued collective: plain fields (the buffers stay the caller's).
  struct task {
    std::shared_ptr<gloo_work> work;
    signature sig{};
    collective_call call{};
    gloo_runner run = nullptr;
  };
  std::mutex mutex;
  std::condition_variable wake;      // the worker: a task to run, or stop
  std::condition_variable finished;  // waiters: a task finished
  std::deque<task> queue;            // guarded by mutex
  bool running = false;              // guarded by mutex: a task is running (worker or waiter)
  bool stopping = false;             // guarded by mutex
  // Numbers the collectives; issued under mutex, so the numbers follow the queue.
  std::shared_ptr<collective_ring> ring = std::make_shared<collective_ring>();
  std::atomic<bool> unusable{false};
  failure_cause failure;  // guarded by mutex: the first failure

  /// Records the first failure without allocating: the timeout hook and
  /// gloo_execute, both noexcept, call these.
  void mark_unusable(std::exception_ptr why) noexcept;
  void mark_unusable(const collective_info& call, const char* how) noexcept;
  [[nodiscard]] std::string unusable_text();
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void gloo_state::mark_unusable(std::exception_ptr why) noexcept {
  std::lock_guard lock(mutex);
  if (!unusable.exchange(true)) failure.set(std::move(why));
}

DTRAIN_DETAIL_INLINE void gloo_state::mark_unusable(const collective_info& call,
                                                    const char* how) noexcept {
  std::lock_guard lock(mutex);
  if (!unusable.exchange(true)) failure.set(call, how);
}

DTRAIN_DETAIL_INLINE std::string gloo_state::unusable_text() {
  std::lock_guard lock(mutex);
  return "the communicator is unusable since an earlier failure (" + failure.text() +
         "); ranks cannot fall back into step after a failed collective, so make a new "
         "communicator";
}
#endif  // DTRAIN_DETAIL_BODIES()

DTRAIN_DETAIL_INLINE void gloo_execute(gloo_state& s, gloo_state::task& t,
                                       std::chrono::milliseconds timeout) noexcept;

class gloo_work final : public work_state {
 public:
  gloo_work(const collective_info& info, std::chrono::milliseconds timeout,
            std::weak_ptr<gloo_state> owner)
      : work_state(info, timeout), owner_(std::move(owner)) {}

  bool poll() override { return done_.load(std::memory_order_acquire); }

  // Gloo cannot abort a collective in flight; its own timeout (the same
  // length) ends it. Until then nothing else may run on this communicator.
  void on_timeout() noexcept override {
    if (auto s = owner_.lock()) s->mark_unusable(info(), "did not finish within its timeout");
  }

  /// Blocks until finished or `deadline`; true when finished. When this
  /// collective is next in line and nothing runs, runs it on the calling
  /// thread (with the time left as Gloo's timeout) rather than waking the
  /// worker: submit-then-wait then costs no thread hand-off. Otherwise sleeps
  /// until a collective finishes. Overrides work_state's wait hook, so waiting
  /// sleeps instead of taking the CPU from Gloo's threads.
  bool wait_until(std::chrono::steady_clock::time_point deadline) override;

  void finish(std::exception_ptr e) noexcept;

 private:
  std::atomic<bool> done_{false};
  std::weak_ptr<gloo_state> owner_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE bool gloo_work::wait_until(std::chrono::steady_clock::time_point deadline) {
  auto s = owner_.lock();
  if (!s) return poll();
  std::unique_lock lock(s->mutex);
  for (;;) {
    if (poll()) return true;
    const auto now = std::chrono::steady_clock::now();
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
    if (left.count() <= 0) return poll();
    if (!s->running && !s->queue.empty() && s->queue.front().work.get() == this) {
      gloo_state::task t = std::move(s->queue.front());
      s->queue.pop_front();
      s->running = true;
      lock.unlock();
      gloo_execute(*s, t, std::min(left, s->timeout));
      lock.lock();
      s->running = false;
      lock.unlock();
      s->wake.notify_one();
      s->finished.notify_all();
      return true;
    }
    s->finished.wait_until(lock, deadline);
  }
}

DTRAIN_DETAIL_INLINE void gloo_work::finish(std::exception_ptr e) noexcept {
  if (e) fail(std::move(e));
  done_.store(true, std::memory_order_release);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// A failure inside a call into Gloo, with the call as written, file:line
/// and Gloo's message; gloo_failure() turns it into dtrain's errors.
class gloo_exception : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <class F>
void gloo_checked(F&& call, const char* text, const char* file, int line) {
  try {
    call();
  } catch (const error&) {
    throw;  // dtrain's own (the store under connectFullMesh), already with context
  } catch (const ::gloo::EnforceNotMet& e) {  // not a gloo::Exception
    throw gloo_exception(std::string(text) + " (" + file + ":" + std::to_string(line) +
                         "): " + e.what());
  } catch (const std::exception& e) {
    throw gloo_exception(std::string(text) + " (" + file + ":" + std::to_string(line) +
                         "): " + e.what());
  }
}

}  // namespace dtrain::detail

/// Evaluates a call into Gloo, which reports failures by throwing; rethrows
/// them as detail::gloo_exception naming the call, file:line and Gloo's message.
#define DTRAIN_GLOO_CHECK(...) \
  ::dtrain::detail::gloo_checked([&] { __VA_ARGS__; }, #__VA_ARGS__, __FILE__, __LINE__)

namespace dtrain::detail {

/// An exception from Gloo as dtrain's: timeout_error for Gloo's timeouts,
/// backend_error (engine code 0: Gloo has no codes) with Gloo's message otherwise.
DTRAIN_DETAIL_INLINE std::exception_ptr gloo_failure(const std::exception_ptr& e,
                                                     const std::string& what);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::exception_ptr gloo_failure(const std::exception_ptr& e,
                                                     const std::string& what) {
  std::string message;
  try {
    std::rethrow_exception(e);
  } catch (const error&) {
    return e;  // already dtrain's (a signature mismatch), with its context
  } catch (const shm_failure& x) {
    if (x.timed_out()) {
      return std::make_exception_ptr(
          timeout_error(what + " timed out (" + x.what() +
                        "); a peer is slow, dead or called a different collective "
                        "(DTRAIN_CHECK_COLLECTIVES=1 compares what every rank passed)"));
    }
    return std::make_exception_ptr(backend_error(
        what + " failed (" + x.what() + "); look for the first error on the other ranks", 0));
  } catch (const std::exception& x) {
    message = x.what();
  } catch (...) {
    message = "an exception that is not a std::exception";
  }
  std::string lower = message;
  for (auto& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower.find("timed out") != std::string::npos || lower.find("timeout") != std::string::npos) {
    return std::make_exception_ptr(
        timeout_error(what + " timed out in Gloo (" + message +
                      "); a peer is slow, dead or called a different collective "
                      "(DTRAIN_CHECK_COLLECTIVES=1 compares what "
                      "every rank passed)"));
  }
  return std::make_exception_ptr(
      backend_error(what + " failed in Gloo: " + message +
                        "; a peer rank may have died or closed its communicator: look for the "
                        "first error on the other ranks",
                    0));
}
#endif  // DTRAIN_DETAIL_BODIES()

// The collectives on host memory, with Gloo's timeout for this run. A world
// of one never calls Gloo. When every rank runs on this host, allreduces and
// allgathers go through the communicator's shared-memory segment
// (backend/shm.hpp) instead.

/// Up to this many bytes an allreduce over TCP on 3 or more ranks uses Gloo's BCUBE
/// algorithm instead of its ring: recursive halving and doubling, 2·log2(n)
/// sequential steps where the ring takes 2(n−1) (4 against 6 on 4 ranks; a
/// direct exchange in 2 steps when n has no factor 2), with the same bytes
/// per rank on a power of two. Small buckets are all latency, and on a
/// machine with fewer cores than ranks every step waits for a process to be
/// scheduled. Above it the ring, which pipelines 1 MiB segments (BCUBE also
/// allocates a buffer-sized scratch per call), and below one element per rank
/// (the ring then skips its empty hops). Every rank decides alike: the rule
/// depends on the element count, its size and the world size only.
inline constexpr std::size_t gloo_bcube_max_bytes = std::size_t{1} << 20;

template <element T>
void gloo_run_allreduce(gloo_state& s, buffer in, buffer out, reduce_op op,
                        std::chrono::milliseconds timeout) {
#if DTRAIN_HAS_SHM()
  if (s.shm.valid()) {  // every rank on this host: no TCP (avg divides inside)
    s.shm.allreduce(static_cast<const T*>(in.data), static_cast<T*>(out.data), out.count, op,
                    timeout);
    return;
  }
#endif
  if (s.size > 1) {
    ::gloo::AllreduceOptions opts(s.context);
    if (s.size > 2 && out.count > static_cast<std::size_t>(s.size) &&
        out.bytes() <= gloo_bcube_max_bytes)
      opts.setAlgorithm(::gloo::AllreduceOptions::Algorithm::BCUBE);
    if (in.data != out.data) opts.setInput(static_cast<T*>(in.data), in.count);
    opts.setOutput(static_cast<T*>(out.data), out.count);
    opts.setReduceFunction(gloo_reduce_function<T>(op));
    opts.setTimeout(timeout);
    DTRAIN_GLOO_CHECK(::gloo::allreduce(opts));
    if (op == reduce_op::avg) divide_host(out, s.size);
  } else if (in.data != out.data) {
    std::memcpy(out.data, in.data, in.bytes());
  }
}

DTRAIN_DETAIL_INLINE void gloo_run_broadcast(gloo_state& s, buffer b, int root,
                                             std::chrono::milliseconds timeout);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void gloo_run_broadcast(gloo_state& s, buffer b, int root,
                                             std::chrono::milliseconds timeout) {
  if (s.size == 1) return;
  ::gloo::BroadcastOptions opts(s.context);
  opts.setOutput(static_cast<std::uint8_t*>(b.data), b.bytes());
  opts.setRoot(root);
  opts.setTimeout(timeout);
  DTRAIN_GLOO_CHECK(::gloo::broadcast(opts));
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Over Gloo's TCP pairs (setting up the shared-memory segment uses this one:
/// a rank may hold the segment before every rank has agreed to use it).
DTRAIN_DETAIL_INLINE void gloo_run_allgather_tcp(gloo_state& s, buffer in, buffer out,
                                                 std::chrono::milliseconds timeout);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void gloo_run_allgather_tcp(gloo_state& s, buffer in, buffer out,
                                                 std::chrono::milliseconds timeout) {
  auto* block =
      static_cast<std::uint8_t*>(out.data) + static_cast<std::size_t>(s.rank) * in.bytes();
  if (s.size == 1) {
    if (in.data != block) std::memcpy(block, in.data, in.bytes());
    return;
  }
  ::gloo::AllgatherOptions opts(s.context);
  if (in.data != block) opts.setInput(static_cast<std::uint8_t*>(in.data), in.bytes());
  opts.setOutput(static_cast<std::uint8_t*>(out.data), out.bytes());
  opts.setTimeout(timeout);
  DTRAIN_GLOO_CHECK(::gloo::allgather(opts));
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Through the shared-memory segment when there is one, else over TCP.
DTRAIN_DETAIL_INLINE void gloo_run_allgather(gloo_state& s, buffer in, buffer out,
                                             std::chrono::milliseconds timeout);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void gloo_run_allgather(gloo_state& s, buffer in, buffer out,
                                             std::chrono::milliseconds timeout) {
#if DTRAIN_HAS_SHM()
  if (s.size > 1 && s.shm.valid()) {  // every rank on this host: no TCP
    s.shm.allgather(in.data, out.data, in.bytes(), timeout);
    return;
  }
#endif
  gloo_run_allgather_tcp(s, in, out, timeout);
}
#endif  // DTRAIN_DETAIL_BODIES()

DTRAIN_DETAIL_INLINE void gloo_run_barrier(gloo_state& s, std::chrono::milliseconds timeout);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void gloo_run_barrier(gloo_state& s, std::chrono::milliseconds timeout) {
  if (s.size == 1) return;
  ::gloo::BarrierOptions opts(s.context);
  opts.setTimeout(timeout);
  DTRAIN_GLOO_CHECK(::gloo::barrier(opts));
}
#endif  // DTRAIN_DETAIL_BODIES()

// Gloo 0.5.0's only reduce-scatter is the older ReduceScatterHalvingDoubling,
// and on 3 ranks it returned corrupted blocks when two ran back to back (a
// race between consecutive instances: a barrier before or after each one hid
// it). So this is an allreduce of the whole input into a scratch buffer and a
// copy of this rank's block: correct, at twice the traffic of a real
// reduce-scatter (2(n-1)/n of the input per rank instead of (n-1)/n) and one
// input-sized allocation. On one host the allreduce goes through shared memory.
template <element T>
void gloo_run_reduce_scatter(gloo_state& s, buffer in, buffer out, reduce_op op,
                             std::chrono::milliseconds timeout) {
  const std::size_t n = out.count;
  const std::size_t offset = static_cast<std::size_t>(s.rank) * n;
  if (s.size == 1) {
    std::memcpy(out.data, in.data, in.bytes());
    return;
  }
  std::vector<T> scratch(in.count);
  const reduce_op sum_op = op == reduce_op::avg ? reduce_op::sum : op;  // divide this block only
  gloo_run_allreduce<T>(s, in, buffer{scratch.data(), scratch.size(), in.type}, sum_op, timeout);
  std::memcpy(out.data, scratch.data() + offset, n * sizeof(T));
  if (op == reduce_op::avg) divide_host(out, s.size);
}

/// Check mode: compares what every rank passed, over an allgather that is not itself checked.
DTRAIN_DETAIL_INLINE void gloo_check_signature(gloo_state& s, const signature& sig,
                                               const collective_info& what,
                                               std::chrono::milliseconds timeout);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void gloo_check_signature(gloo_state& s, const signature& sig,
                                               const collective_info& what,
                                               std::chrono::milliseconds timeout) {
  compare_signatures(
      sig, s.rank, s.size, what,
      [&](std::span<const std::int64_t> mine, std::span<std::int64_t> all) {
        buffer in{const_cast<std::int64_t*>(mine.data()), mine.size(), dtype::int64, memory::host};
        buffer out{all.data(), all.size(), dtype::int64, memory::host};
        gloo_run_allgather_tcp(s, in, out, timeout);
      });
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Runs one task's collective (its signature first, in check mode). Throws
/// what failed as dtrain's error (gloo_failure), and tells peers waiting in
/// the shared-memory segment to stop, with a timeout if this was one.
DTRAIN_DETAIL_INLINE void gloo_run_task(gloo_state& s, const gloo_state::task& t,
                                        std::chrono::milliseconds timeout);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void gloo_run_task(gloo_state& s, const gloo_state::task& t,
                                        std::chrono::milliseconds timeout) {
  try {
    if (s.unusable.load()) {
      throw backend_error(t.work->description() + " was not run: " + s.unusable_text(), 0);
    }
    if (s.check) gloo_check_signature(s, t.sig, t.work->info(), timeout);
    if (t.call.moves_data()) t.run(s, t.call, timeout);
  } catch (...) {
    const std::exception_ptr failure =
        gloo_failure(std::current_exception(), t.work->description());
#if DTRAIN_HAS_SHM()
    bool timed_out = false;
    try {
      std::rethrow_exception(failure);
    } catch (const timeout_error&) {
      timed_out = true;
    } catch (...) {
    }
    s.shm.abandon(message_of(failure), timed_out);
#endif
    std::rethrow_exception(failure);
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Runs one task (on the worker, or on a thread waiting for it) and completes
/// its work. A failure, whatever it is (out of memory while putting one into
/// words too), reaches the work's wait() and makes the communicator unusable;
/// so does running after one. Allocates nothing itself: everything that may
/// is inside gloo_run_task, whose exception it catches.
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void gloo_execute(gloo_state& s, gloo_state::task& t,
                                       std::chrono::milliseconds timeout) noexcept {
  std::exception_ptr failure;
  try {
    gloo_run_task(s, t, timeout);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    s.mark_unusable(failure);
#if DTRAIN_HAS_SHM()
    s.shm.abandon();  // peers waiting in the segment stop (a no-op once gloo_run_task did)
#endif
  }
  t.work->finish(std::move(failure));
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The worker: runs the queue in order until the communicator stops and the queue is empty.
DTRAIN_DETAIL_INLINE void gloo_serve(const std::shared_ptr<gloo_state>& s);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void gloo_serve(const std::shared_ptr<gloo_state>& s) {
  for (;;) {
    gloo_state::task t;
    {
      std::unique_lock lock(s->mutex);
      s->wake.wait(lock, [&] {
        return (s->stopping && s->queue.empty()) || (!s->running && !s->queue.empty());
      });
      if (s->queue.empty()) return;
      t = std::move(s->queue.front());
      s->queue.pop_front();
      s->running = true;
    }
    gloo_execute(*s, t, s->timeout);
    {
      std::lock_guard lock(s->mutex);
      s->running = false;
    }
    s->finished.notify_all();
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail

#endif  // DTRAIN_HAS_GLOO()
// ---- end dtrain/backend/gloo_worker.hpp ----
// ---- begin dtrain/rendezvous/security.hpp ----
/// @file
/// Who may talk to a job's store, and where it listens: a fresh random token
/// per job, handed to the ranks without a command line or a log, and the one
/// interface that MASTER_ADDR names. See docs/launching.md, "Security".

// ---- begin dtrain/rendezvous/client.hpp ----
/// @file
/// store_client: a blocking client of store_server, safe to share between
/// threads (requests are serialised on one connection).

// ---- begin dtrain/rendezvous/options.hpp ----
/// @file
/// Options of the rendezvous store, server and client alike. Each default is
/// defined here once; each can be overridden by the option and by an
/// environment variable (store_options::from_env).


#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace dtrain {

/// Default for every blocking store operation (connect, get, wait, barrier),
/// as c10d's store: 300 s. Environment: DTRAIN_STORE_TIMEOUT (seconds).
inline constexpr std::chrono::milliseconds default_store_timeout{300'000};

/// How long the server gives a new connection to complete its handshake, and
/// a started request frame to arrive whole. Environment: DTRAIN_STORE_IO_TIMEOUT.
inline constexpr std::chrono::milliseconds default_store_io_timeout{30'000};

/// How long the server keeps a connection that sends nothing after its
/// handshake, unless it is in a get / wait it asked for. A client reconnects
/// by itself on its next request. Environment: DTRAIN_STORE_IDLE_TIMEOUT.
inline constexpr std::chrono::milliseconds default_store_idle_timeout{600'000};

/// How often a rank that waits at rendezvous says so: a client still trying
/// to connect, and rank 0 waiting for the others to join (who has, who has
/// not). Environment: DTRAIN_RENDEZVOUS_PROGRESS (seconds).
inline constexpr std::chrono::milliseconds default_rendezvous_progress_interval{5'000};

/// Wire and resource limits, checked before anything is allocated. The
/// defaults fit a 10,000-rank job (two connections per rank, one per agent,
/// a few KiB stored per rank) and bound what a flood can make the server hold
/// to about max_stored_bytes + max_buffered_bytes.
struct store_limits {
  std::uint32_t max_key_size = 4096;          ///< bytes per key
  std::uint32_t max_value_size = 64u << 20;   ///< bytes per value (64 MiB)
  std::uint32_t max_keys_per_request = 4096;  ///< keys in one wait/check: a connection's waiters
  std::uint32_t max_token_size = 1024;        ///< bytes of the shared token
  /// Open connections; more are accepted and closed at once, and the server
  /// also keeps below the process's descriptor limit (RLIMIT_NOFILE), which it
  /// raises towards the hard limit. Environment: DTRAIN_STORE_MAX_CONNECTIONS.
  std::uint32_t max_connections = 32768;
  /// Keys and values held; a set beyond it is refused with an error reply.
  /// Environment: DTRAIN_STORE_MAX_BYTES.
  std::uint64_t max_stored_bytes = std::uint64_t{1} << 30;
  /// Request and reply bytes held for all connections together (a frame in
  /// flight, a reply not yet read, the keys of a pending wait). A connection
  /// that would pass it waits, at most the io timeout, for others to finish.
  std::uint64_t max_buffered_bytes = std::uint64_t{256} << 20;

  /// The largest request frame these limits allow; a larger length prefix
  /// closes the connection before a byte of it is buffered.
  [[nodiscard]] std::uint64_t max_frame_size() const noexcept;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::uint64_t store_limits::max_frame_size() const noexcept {
  std::uint64_t keys = std::uint64_t{max_keys_per_request} * (4u + max_key_size);
  std::uint64_t one = 2u * (4u + std::uint64_t{max_value_size}) + 4u + max_key_size;
  return 64u + (keys > one ? keys : one);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Options of a store server or client. Aggregate: use designated initialisers,
/// e.g. `{.timeout = 30s, .token = "secret"}`.
struct store_options {
  /// Default timeout of connect, get, wait and barrier.
  std::chrono::milliseconds timeout = default_store_timeout;
  /// Server: limit for a handshake or a started frame. Client: how long a
  /// reply may take beyond the operation's own timeout before the server is
  /// presumed dead.
  std::chrono::milliseconds io_timeout = default_store_io_timeout;
  /// Server: how long a connection may stay silent between requests.
  std::chrono::milliseconds idle_timeout = default_store_idle_timeout;
  /// Shared secret; the server serves nothing to a client whose token differs.
  /// Environment: DTRAIN_STORE_TOKEN. dtrain::run and the node agent set one
  /// for every job (see docs/launching.md, "Security"); empty here means none.
  std::string token{};
  store_limits limits{};
  /// Server: where it reports closed connections and their reasons. Empty:
  /// one line on stderr each.
  std::function<void(std::string_view)> log{};
  /// Client and rendezvous: how often a wait that is still going on is
  /// reported; zero (or less) reports nothing.
  std::chrono::milliseconds progress_interval = default_rendezvous_progress_interval;
  /// Client and rendezvous: where such a report goes ("still trying to connect
  /// to the store at HOST:PORT ..."). Empty: one line on stderr, `dtrain: <text>`.
  std::function<void(std::string_view)> progress{};

  /// These options with DTRAIN_STORE_TIMEOUT, DTRAIN_STORE_IO_TIMEOUT,
  /// DTRAIN_RENDEZVOUS_PROGRESS and DTRAIN_STORE_TOKEN from `env` applied on
  /// top (and DTRAIN_STORE_MAX_CONNECTIONS, DTRAIN_STORE_MAX_BYTES): the environment wins, as
  /// NCCL's does, so an operator can tune a job without rebuilding it. Throws
  /// config_error naming the variable on a malformed value.
  [[nodiscard]] store_options with_env(const environment& env) const;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE store_options store_options::with_env(const environment& env) const {
  store_options out = *this;
  if (auto t = detail::read_seconds(env, store_timeout_variable)) out.timeout = *t;
  if (auto t = detail::read_seconds(env, store_io_timeout_variable)) out.io_timeout = *t;
  if (auto t = detail::read_seconds(env, store_idle_timeout_variable)) out.idle_timeout = *t;
  if (auto t = detail::read_seconds(env, rendezvous_progress_variable)) {
    out.progress_interval = *t;
  }
  if (auto n = detail::read_int(env, store_max_connections_variable)) {
    if (n->value < 1) throw config_error(n->origin + " must be at least 1");
    out.limits.max_connections = static_cast<std::uint32_t>(n->value);
  }
  if (auto n = detail::read_int(env, store_max_bytes_variable)) {
    if (n->value < 1) throw config_error(n->origin + " must be at least 1");
    out.limits.max_stored_bytes = static_cast<std::uint64_t>(n->value);
  }
  if (auto secret = env.get(store_token_variable)) out.token = std::string(*secret);
  if (out.token.size() > out.limits.max_token_size) {
    throw config_error(std::string(store_token_variable) + " / token is " +
                       std::to_string(out.token.size()) + " bytes; the limit is " +
                       std::to_string(out.limits.max_token_size));
  }
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

namespace detail {

/// A duration in whole seconds, as progress reports count them: "12 s".
inline std::string whole_seconds(std::chrono::milliseconds t) {
  return std::to_string(std::chrono::duration_cast<std::chrono::seconds>(t).count()) + " s";
}

/// Hands a progress report to `sink` (store_options::progress), or prints it
/// on stderr as `dtrain: <text>` when there is none.
DTRAIN_DETAIL_INLINE void say(const std::function<void(std::string_view)>& sink,
                              const std::string& text);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void say(const std::function<void(std::string_view)>& sink,
                              const std::string& text) {
  if (sink) {
    sink(text);
  } else {
    std::fprintf(stderr, "dtrain: %s\n", text.c_str());
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail

}  // namespace dtrain
// ---- end dtrain/rendezvous/options.hpp ----
// ---- begin dtrain/rendezvous/protocol.hpp ----
/// @file
/// The store's wire protocol. All integers are little-endian.
///
///   handshake   client → server: magic u32 "DTRZ", version u16, token: bytes16
///               server → client: status u8, version u16
///   request     length u32 (of the body), body: op u8, then the op's fields
///   response    length u32, body: status u8, then the payload
///
/// bytes16 / bytes32 are a u16 / u32 length followed by that many bytes. A
/// length beyond the configured limits closes the connection before anything
/// is allocated for it.


#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::detail::wire {

inline constexpr std::uint32_t magic = 0x5a525444;  // "DTRZ" as little-endian bytes
inline constexpr std::uint16_t version = 1;

enum class op : std::uint8_t {
  set = 1,          ///< key, value → ok
  get = 2,          ///< key, timeout_ms u64 → ok + value | timeout
  add = 3,          ///< key, delta i64 → ok + new value i64
  compare_set = 4,  ///< key, expected, desired → ok + current value
  wait = 5,         ///< count u32, keys, timeout_ms u64 → ok | timeout
  check = 6,        ///< count u32, keys → ok + u8 (all present)
  erase = 7,        ///< key → ok + u8 (existed)
  num_keys = 8,     ///< → ok + u64
  ping = 9,         ///< → ok
};

enum class status : std::uint8_t {
  ok = 0,
  timeout = 1,        ///< a wait expired on the server
  error = 2,          ///< the request was understood and refused; bytes32 message follows
  shutting_down = 3,  ///< the server is stopping; bytes32 message follows
  bad_version = 4,    ///< handshake only
  bad_token = 5,      ///< handshake only
};

/// A frame: u32 length, then the body.
DTRAIN_DETAIL_INLINE std::string frame(const std::string& body);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string frame(const std::string& body) {
  std::string out;
  writer(out).u32(static_cast<std::uint32_t>(body.size()));
  out += body;
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The decoded u32 at the start of `header` (4 bytes).
inline std::uint32_t frame_length(std::string_view header) {
  return reader(header).u32("frame length");
}

/// Keys of a wait/check request, bounded by the limits.
DTRAIN_DETAIL_INLINE std::vector<std::string_view> read_keys(reader& r, const store_limits& limits);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::vector<std::string_view> read_keys(reader& r,
                                                             const store_limits& limits) {
  std::uint32_t n = r.u32("key count");
  if (n > limits.max_keys_per_request) {
    throw violation("key count " + std::to_string(n) + " exceeds the limit of " +
                    std::to_string(limits.max_keys_per_request));
  }
  std::vector<std::string_view> keys;  // grows with keys actually present, not with n
  for (std::uint32_t i = 0; i < n; ++i) keys.push_back(r.bytes32("key", limits.max_key_size));
  return keys;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail::wire
// ---- end dtrain/rendezvous/protocol.hpp ----
// ---- begin dtrain/rendezvous/socket.hpp ----
/// @file
/// The few socket helpers the store's server and client share.


#include <cerrno>
#include <cstdint>
#include <string>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

namespace dtrain::detail {

/// "host:port", with brackets for IPv6 ("[::1]:29500").
DTRAIN_DETAIL_INLINE std::string endpoint_text(const std::string& host, int port);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string endpoint_text(const std::string& host, int port) {
  bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The numeric address and port of a socket address.
DTRAIN_DETAIL_INLINE std::string endpoint_text(const sockaddr* sa);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string endpoint_text(const sockaddr* sa) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (sa->sa_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
    port = ntohs(in->sin_port);
  } else if (sa->sa_family == AF_INET6) {
    auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
    port = ntohs(in6->sin6_port);
  }
  return endpoint_text(host, port);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Disables Nagle: the store's requests are small and latency-bound.
DTRAIN_DETAIL_INLINE void set_no_delay(int fd);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void set_no_delay(int fd) {
  int one = 1;
  DTRAIN_SYSCALL(::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one));
}
#endif  // DTRAIN_DETAIL_BODIES()

/// getaddrinfo with its result owned.
struct address_list {
  addrinfo* head = nullptr;
  address_list() = default;
  address_list(const address_list&) = delete;
  address_list& operator=(const address_list&) = delete;
  ~address_list() {
    if (head) ::freeaddrinfo(head);
  }
};

/// Resolves host:port; returns the gai error code (0 on success).
DTRAIN_DETAIL_INLINE int resolve(const std::string& host, int port, bool passive,
                                 address_list& out);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE int resolve(const std::string& host, int port, bool passive,
                                 address_list& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  std::string service = std::to_string(port);
  return ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &out.head);
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/rendezvous/socket.hpp ----

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>

namespace dtrain {

/// A connection to a store_server. Every blocking call has a timeout: the
/// options' `timeout` unless the call takes one. Throws timeout_error when it
/// expires (naming what it waited for and how long), rendezvous_error when the
/// server cannot be reached, refuses the client, or goes away (token_error
/// when it refuses the client's token), and config_error at once when its
/// host name does not resolve (a temporary resolver failure, EAI_AGAIN, is
/// retried for 5 s first).
///
/// Thread-safe, but requests on one client run one at a time: a thread blocked
/// in get / wait / barrier holds the connection, so a thread that must set the
/// awaited key meanwhile needs a store_client of its own. A get or wait that
/// the server ends at its timeout leaves the client usable; after a reply that
/// never came or a lost connection it is not (the reply stream cannot be
/// trusted): make a new one. The one exception: a connection the server closed
/// because it was idle (store_options::idle_timeout) is reopened, once, by the
/// next request; the server closes only connections with no request in flight.
class store_client {
 public:
  using milliseconds = std::chrono::milliseconds;

  /// Connects to host:port, retrying with backoff until `options.timeout`:
  /// workers often start before the server does. While it retries it says so
  /// every `options.progress_interval` (options.progress).
  store_client(std::string host, int port, store_options options = {})
      : host_(std::move(host)), port_(port), options_(std::move(options)) {
    connect();
  }

  [[nodiscard]] std::string endpoint() const { return detail::endpoint_text(host_, port_); }
  [[nodiscard]] const store_options& options() const noexcept { return options_; }

  /// Sets key to value, waking everyone waiting for the key.
  void set(std::string_view key, std::string_view value);

  /// The value of `key`, waiting until it exists. Throws timeout_error naming
  /// the key and how long it waited; never returns a sentinel.
  [[nodiscard]] std::string get(std::string_view key) { return get(key, options_.timeout); }
  [[nodiscard]] std::string get(std::string_view key, milliseconds timeout);

  /// Adds `delta` to the integer at key (0 when absent) and returns the new value.
  std::int64_t add(std::string_view key, std::int64_t delta);

  /// Sets key to `desired` if it holds `expected` (a missing key matches an
  /// empty `expected`). Returns the value afterwards; empty if the key does not exist.
  std::string compare_set(std::string_view key, std::string_view expected,
                          std::string_view desired);

  /// Waits until every key exists.
  void wait(std::span<const std::string> keys) { wait(keys, options_.timeout); }
  void wait(std::span<const std::string> keys, milliseconds timeout);

  /// Whether every key exists, without waiting.
  [[nodiscard]] bool check(std::span<const std::string> keys);

  /// Removes key; returns whether it existed.
  bool erase(std::string_view key);

  /// Number of keys in the store (all prefixes).
  [[nodiscard]] std::int64_t num_keys();

  /// Blocks until `count` callers have entered barrier `name`. A name can be
  /// reused: each group of `count` arrivals is one generation. On timeout the
  /// timeout_error says how many had arrived.
  void barrier(std::string_view name, int count) { barrier(name, count, options_.timeout); }
  void barrier(std::string_view name, int count, milliseconds timeout);

  /// Round trip without effect; a liveness check.
  void ping() { call(begin(detail::wire::op::ping), milliseconds(0), "ping()"); }

 private:
  static std::string begin(detail::wire::op o) { return std::string(1, static_cast<char>(o)); }

  static std::uint64_t as_ms(milliseconds t) {
    return static_cast<std::uint64_t>(std::max<std::int64_t>(t.count(), 0));
  }

  static std::string seconds(milliseconds t);

  static std::string key_list(std::span<const std::string> keys);

  using steady = std::chrono::steady_clock;

  /// How long a temporary resolver failure (EAI_AGAIN) is retried.
  static constexpr milliseconds resolver_retry{5'000};

  void connect() { connect(options_.timeout); }

  void connect(milliseconds patience);

  // The handshake; returns why the connection was lost during it (empty on
  // success). A refusal (token, version) throws: knocking again cannot help.
  std::string try_handshake(steady::time_point deadline);

  // One attempt; returns the reason it failed, empty on success, and the
  // resolver's error code in `resolver_rc` when the name did not resolve.
  std::string try_connect(steady::time_point deadline, int& resolver_rc);

  static int remaining_ms(steady::time_point deadline);

  void handshake(steady::time_point connect_deadline);

  // Sends a request and returns the reply payload; nullopt when the server
  // reports that the wait timed out.
  std::optional<std::string> call(const std::string& body, milliseconds server_wait,
                                  const std::string& what);

  [[nodiscard]] bool closed_by_server() const;

  // A new connection within the io timeout; the old one is dropped unread.
  void reopen(const std::string& what);

  std::optional<std::string> exchange(const std::string& body, milliseconds server_wait,
                                      const std::string& what);

  void send_all(std::string_view data, steady::time_point deadline, const std::string& what);

  std::string recv_exact(std::size_t size, steady::time_point deadline, const std::string& what);

  void await(short events, steady::time_point deadline, const std::string& what);

  [[noreturn]] void lost(const std::string& what, const std::string& why);

  std::string host_;
  int port_;
  store_options options_;
  std::mutex mutex_;
  detail::unique_fd fd_;
  bool broken_ = false;
  bool refused_ = false;        // the server answered the handshake with a refusal
  bool reply_started_ = false;  // a byte of the current reply (or the handshake's) arrived
  steady::time_point last_reply_ = steady::now();
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void store_client::set(std::string_view key, std::string_view value) {
  std::string body = begin(detail::wire::op::set);
  detail::wire::writer(body).bytes32(key).bytes32(value);
  call(body, milliseconds(0), "set(\"" + std::string(key) + "\")");
}

DTRAIN_DETAIL_INLINE std::string store_client::get(std::string_view key, milliseconds timeout) {
  std::string body = begin(detail::wire::op::get);
  detail::wire::writer(body).bytes32(key).u64(as_ms(timeout));
  auto what = "get(\"" + std::string(key) + "\")";
  auto reply = call(body, timeout, what);
  if (!reply)
    throw timeout_error(what + " on the store at " + endpoint() + " waited " + seconds(timeout) +
                        " and the key was never set");
  detail::wire::reader r(*reply);
  auto value = r.bytes32("value", UINT32_MAX);
  return std::string(value);
}

DTRAIN_DETAIL_INLINE std::int64_t store_client::add(std::string_view key, std::int64_t delta) {
  std::string body = begin(detail::wire::op::add);
  detail::wire::writer(body).bytes32(key).i64(delta);
  auto reply = call(body, milliseconds(0), "add(\"" + std::string(key) + "\")");
  return detail::wire::reader(*reply).i64("counter");
}

DTRAIN_DETAIL_INLINE std::string store_client::compare_set(std::string_view key,
                                                           std::string_view expected,
                                                           std::string_view desired) {
  std::string body = begin(detail::wire::op::compare_set);
  detail::wire::writer(body).bytes32(key).bytes32(expected).bytes32(desired);
  auto reply = call(body, milliseconds(0), "compare_set(\"" + std::string(key) + "\")");
  detail::wire::reader r(*reply);
  return std::string(r.bytes32("value", UINT32_MAX));
}

DTRAIN_DETAIL_INLINE void store_client::wait(std::span<const std::string> keys,
                                             milliseconds timeout) {
  std::string body = begin(detail::wire::op::wait);
  detail::wire::writer w(body);
  w.u32(static_cast<std::uint32_t>(keys.size()));
  for (const auto& k : keys) w.bytes32(k);
  w.u64(as_ms(timeout));
  auto what = "wait(" + key_list(keys) + ")";
  if (!call(body, timeout, what)) {
    throw timeout_error(what + " on the store at " + endpoint() + " waited " + seconds(timeout) +
                        "; missing keys are never set, or their setters are slow or dead");
  }
}

DTRAIN_DETAIL_INLINE bool store_client::check(std::span<const std::string> keys) {
  std::string body = begin(detail::wire::op::check);
  detail::wire::writer w(body);
  w.u32(static_cast<std::uint32_t>(keys.size()));
  for (const auto& k : keys) w.bytes32(k);
  auto reply = call(body, milliseconds(0), "check(" + key_list(keys) + ")");
  return detail::wire::reader(*reply).u8("present") != 0;
}

DTRAIN_DETAIL_INLINE bool store_client::erase(std::string_view key) {
  std::string body = begin(detail::wire::op::erase);
  detail::wire::writer(body).bytes32(key);
  auto reply = call(body, milliseconds(0), "erase(\"" + std::string(key) + "\")");
  return detail::wire::reader(*reply).u8("existed") != 0;
}

DTRAIN_DETAIL_INLINE std::int64_t store_client::num_keys() {
  auto reply = call(begin(detail::wire::op::num_keys), milliseconds(0), "num_keys()");
  return static_cast<std::int64_t>(detail::wire::reader(*reply).u64("count"));
}

DTRAIN_DETAIL_INLINE void store_client::barrier(std::string_view name, int count,
                                                milliseconds timeout) {
  if (count < 1)
    throw config_error("barrier(\"" + std::string(name) + "\") count " + std::to_string(count) +
                       " must be at least 1");
  const std::string arrived = std::string(name) + "/arrived";
  std::int64_t n = add(arrived, 1);
  std::int64_t generation = (n - 1) / count;
  const std::string done = std::string(name) + "/done/" + std::to_string(generation);
  if (n % count == 0) set(done, "1");
  try {
    std::string keys[] = {done};
    wait(keys, timeout);
  } catch (const timeout_error&) {
    std::int64_t now = add(arrived, 0) - generation * count;
    throw timeout_error("barrier(\"" + std::string(name) + "\") on the store at " + endpoint() +
                        " timed out after " + seconds(timeout) + ": " +
                        std::to_string(std::min<std::int64_t>(now, count)) + " of " +
                        std::to_string(count) + " arrived");
  }
}

DTRAIN_DETAIL_INLINE std::string store_client::seconds(milliseconds t) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", static_cast<double>(t.count()) / 1000.0);
  return text;
}

DTRAIN_DETAIL_INLINE std::string store_client::key_list(std::span<const std::string> keys) {
  std::string out;
  for (std::size_t i = 0; i < keys.size() && i < 3; ++i)
    out += (i ? ", \"" : "\"") + keys[i] + "\"";
  if (keys.size() > 3) out += ", ... (" + std::to_string(keys.size()) + " keys)";
  return out;
}

DTRAIN_DETAIL_INLINE void store_client::connect(milliseconds patience) {
  const auto deadline = steady::now() + patience;
  std::minstd_rand jitter(
      static_cast<unsigned>(std::hash<std::thread::id>{}(std::this_thread::get_id()) ^
                            static_cast<unsigned>(steady::now().time_since_epoch().count())));
  milliseconds backoff(10);
  std::string last_error;
  // A name the resolver does not know will not appear by waiting: fail at
  // once. A temporary resolver failure (EAI_AGAIN) gets a few seconds.
  const auto start = steady::now();
  const auto resolve_deadline = std::min(deadline, start + resolver_retry);
  auto next_report = start + options_.progress_interval;
  for (;;) {
    int resolver_rc = 0;
    last_error = try_connect(deadline, resolver_rc);
    if (resolver_rc != 0 && (resolver_rc != EAI_AGAIN || steady::now() >= resolve_deadline)) {
      throw config_error("cannot resolve \"" + host_ + "\", the host of the store at " +
                         endpoint() + ": " + ::gai_strerror(resolver_rc) +
                         "; check MASTER_ADDR (dtrun --master-addr)");
    }
    // A server at its connection cap closes newcomers unanswered: knock again.
    if (last_error.empty()) last_error = try_handshake(deadline);
    if (last_error.empty()) return;
    const auto now = steady::now();
    auto left = deadline - now;
    if (left <= steady::duration::zero()) {
      throw timeout_error("could not reach the store at " + endpoint() + " within " +
                          seconds(patience) + " (last error: " + last_error +
                          "); check that the process hosting it (rank 0, or the node-0 agent) "
                          "is running, that MASTER_ADDR and MASTER_PORT are the same on every "
                          "rank, and that no firewall blocks the port");
    }
    if (options_.progress_interval > milliseconds::zero() && now >= next_report) {
      detail::say(options_.progress,
                  "still trying to connect to the store at " + endpoint() + " (" +
                      detail::whole_seconds(std::chrono::duration_cast<milliseconds>(now - start)) +
                      " of " + detail::whole_seconds(patience) + "; last error: " + last_error +
                      ")");
      next_report = now + options_.progress_interval;
    }
    // Jittered exponential backoff, so a thousand workers do not knock in step.
    auto pause =
        backoff / 2 + milliseconds(jitter() % static_cast<unsigned>(backoff.count() / 2 + 1));
    std::this_thread::sleep_for(std::min<steady::duration>(pause, left));
    backoff = std::min(backoff * 2, milliseconds(1000));
  }
}

DTRAIN_DETAIL_INLINE std::string store_client::try_handshake(steady::time_point deadline) {
  try {
    handshake(deadline);
    return {};
  } catch (const error& e) {  // lost, or no answer in time
    if (refused_) throw;
    fd_.reset();
    broken_ = false;
    return e.what();
  }
}

DTRAIN_DETAIL_INLINE std::string store_client::try_connect(steady::time_point deadline,
                                                           int& resolver_rc) {
  detail::address_list addrs;
  if (int rc = detail::resolve(host_, port_, false, addrs); rc != 0) {
    resolver_rc = rc;
    return std::string("cannot resolve ") + host_ + ": " + ::gai_strerror(rc);
  }
  std::string why;
  for (const addrinfo* a = addrs.head; a; a = a->ai_next) {
    detail::unique_fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) {
      why = std::strerror(errno);
      continue;
    }
    if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        why = std::strerror(errno);
        continue;
      }
      pollfd p{fd.get(), POLLOUT, 0};
      int left = remaining_ms(deadline);
      if (::poll(&p, 1, std::min(left, 5000)) <= 0) {
        why = "connect timed out";
        continue;
      }
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        why = std::strerror(err);
        continue;
      }
    }
    detail::set_no_delay(fd.get());
    fd_ = std::move(fd);
    return {};
  }
  return why.empty() ? "no address" : why;
}

DTRAIN_DETAIL_INLINE int store_client::remaining_ms(steady::time_point deadline) {
  auto left = std::chrono::ceil<milliseconds>(deadline - steady::now()).count();
  return static_cast<int>(std::clamp<std::int64_t>(left, 0, 1 << 30));
}

DTRAIN_DETAIL_INLINE void store_client::handshake(steady::time_point connect_deadline) {
  std::string hello;
  detail::wire::writer(hello)
      .u32(detail::wire::magic)
      .u16(detail::wire::version)
      .bytes16(options_.token);
  auto deadline = std::min(connect_deadline, steady::now() + options_.io_timeout);
  send_all(hello, deadline, "the handshake");
  std::string reply = recv_exact(3, deadline, "the handshake reply");
  detail::wire::reader r(reply);
  auto s = static_cast<detail::wire::status>(r.u8("status"));
  auto version = r.u16("version");
  refused_ = s != detail::wire::status::ok;
  if (s == detail::wire::status::bad_token) {
    broken_ = true;
    throw token_error("the store at " + endpoint() +
                      " rejected this client's token; set the same DTRAIN_STORE_TOKEN (or "
                      "token option) on every rank");
  }
  if (s == detail::wire::status::bad_version) {
    broken_ = true;
    throw rendezvous_error("the store at " + endpoint() + " speaks protocol version " +
                           std::to_string(version) + ", this client " +
                           std::to_string(detail::wire::version) +
                           "; build every rank with the same dtrain");
  }
  if (s != detail::wire::status::ok) {
    broken_ = true;
    throw rendezvous_error("the store at " + endpoint() + " answered the handshake with status " +
                           std::to_string(static_cast<int>(s)));
  }
}

DTRAIN_DETAIL_INLINE std::optional<std::string> store_client::call(const std::string& body,
                                                                   milliseconds server_wait,
                                                                   const std::string& what) {
  std::lock_guard lock(mutex_);
  if (broken_)
    throw rendezvous_error(what + ": the connection to the store at " + endpoint() +
                           " was lost earlier");
  // After a silence the server may have closed the connection as idle:
  // reopen it rather than fail. If it closes just as this request leaves,
  // no reply byte arrives, and the request is sent again once.
  const bool was_idle = steady::now() - last_reply_ > milliseconds(100);
  if (closed_by_server()) reopen(what);
  try {
    auto reply = exchange(body, server_wait, what);
    last_reply_ = steady::now();
    return reply;
  } catch (const rendezvous_error&) {
    if (!was_idle || reply_started_ || !broken_) throw;
    reopen(what);
    auto reply = exchange(body, server_wait, what);
    last_reply_ = steady::now();
    return reply;
  }
}

DTRAIN_DETAIL_INLINE bool store_client::closed_by_server() const {
  char byte;
  ssize_t n = ::recv(fd_.get(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

DTRAIN_DETAIL_INLINE void store_client::reopen(const std::string& what) {
  fd_.reset();
  broken_ = false;
  try {
    connect(options_.io_timeout);
  } catch (const error& e) {
    broken_ = true;
    throw rendezvous_error(what + ": the store at " + endpoint() +
                           " closed this idle connection and cannot be reached again: " + e.what());
  }
}

DTRAIN_DETAIL_INLINE std::optional<std::string> store_client::exchange(const std::string& body,
                                                                       milliseconds server_wait,
                                                                       const std::string& what) {
  reply_started_ = false;
  // The reply may take the server-side wait, plus the io timeout before the server is presumed
  // dead.
  auto deadline = steady::now() + server_wait + options_.io_timeout;
  try {
    send_all(detail::wire::frame(body), deadline, what);
    std::string head = recv_exact(4, deadline, what);
    std::uint32_t length = detail::wire::frame_length(head);
    if (length == 0 || length > options_.limits.max_frame_size()) {
      throw rendezvous_error(what + ": the store at " + endpoint() + " sent a reply of " +
                             std::to_string(length) + " bytes");
    }
    std::string reply = recv_exact(length, deadline, what);
    auto s = static_cast<detail::wire::status>(static_cast<unsigned char>(reply[0]));
    std::string_view payload = std::string_view(reply).substr(1);
    switch (s) {
      case detail::wire::status::ok: return std::string(payload);
      case detail::wire::status::timeout: return std::nullopt;
      case detail::wire::status::error:
      case detail::wire::status::shutting_down: {
        detail::wire::reader r(payload);
        auto message = std::string(r.bytes32("message", UINT32_MAX));
        if (s == detail::wire::status::shutting_down) broken_ = true;
        throw rendezvous_error(what + " on the store at " + endpoint() + ": " + message);
      }
      default:
        throw rendezvous_error(what + ": the store at " + endpoint() +
                               " answered with unknown status " +
                               std::to_string(static_cast<int>(s)));
    }
  } catch (const detail::wire::violation& e) {
    broken_ = true;
    throw rendezvous_error(what + ": malformed reply from the store at " + endpoint() + ": " +
                           e.what());
  } catch (const timeout_error&) {
    broken_ = true;  // a reply may still arrive; the stream can no longer be trusted
    throw;
  }
}

DTRAIN_DETAIL_INLINE void store_client::send_all(std::string_view data, steady::time_point deadline,
                                                 const std::string& what) {
  while (!data.empty()) {
    ssize_t n = ::send(fd_.get(), data.data(), data.size(), MSG_NOSIGNAL);
    if (n > 0) {
      data.remove_prefix(static_cast<std::size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) lost(what, std::strerror(errno));
    await(POLLOUT, deadline, what);
  }
}

DTRAIN_DETAIL_INLINE std::string store_client::recv_exact(std::size_t size,
                                                          steady::time_point deadline,
                                                          const std::string& what) {
  std::string out;
  char chunk[16384];
  while (out.size() < size) {
    ssize_t n = ::recv(fd_.get(), chunk, std::min(sizeof chunk, size - out.size()), 0);
    if (n > 0) {
      out.append(chunk, static_cast<std::size_t>(n));
      reply_started_ = true;
      continue;
    }
    if (n == 0) lost(what, "the server closed the connection");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) lost(what, std::strerror(errno));
    await(POLLIN, deadline, what);
  }
  return out;
}

DTRAIN_DETAIL_INLINE void store_client::await(short events, steady::time_point deadline,
                                              const std::string& what) {
  pollfd p{fd_.get(), events, 0};
  for (;;) {
    int left = remaining_ms(deadline);
    int rc = ::poll(&p, 1, left);
    if (rc > 0) return;
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) lost(what, std::strerror(errno));
    broken_ = true;
    throw timeout_error(what + ": no reply from the store at " + endpoint() +
                        " in time; the server is overloaded, hung or unreachable");
  }
}

DTRAIN_DETAIL_INLINE void store_client::lost(const std::string& what, const std::string& why) {
  broken_ = true;
  throw rendezvous_error(what + ": lost the connection to the store at " + endpoint() + " (" + why +
                         "); did the process hosting it exit?");
}
#endif  // DTRAIN_DETAIL_BODIES()

// The client is a store, alone and under a prefix (checked here, next to it:
// the concept's header does not include an implementation).
static_assert(store<store_client>);
static_assert(store<prefix_store<store_client>>);

}  // namespace dtrain
// ---- end dtrain/rendezvous/client.hpp ----

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <thread>

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

namespace dtrain {

namespace detail {

/// 128 random bits from the kernel, as 32 hex digits.
DTRAIN_DETAIL_INLINE std::string new_store_token();
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string new_store_token() {
  unsigned char bytes[16];
  std::size_t got = 0;
  while (got < sizeof bytes) {
    ssize_t n = ::getrandom(bytes + got, sizeof bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      throw error(std::string("cannot draw a store token: getrandom: ") + std::strerror(errno));
    got += static_cast<std::size_t>(n);
  }
  std::string out;
  for (unsigned char b : bytes) {
    char hex[3];
    std::snprintf(hex, sizeof hex, "%02x", b);
    out += hex;
  }
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Where the store of a job whose ranks meet at `master` listens: DTRAIN_STORE_BIND
/// if set, else the local address that `master` names. Every interface ("0.0.0.0")
/// only when that name is not an address of this host, or when it resolves to
/// loopback here but the job spans nodes (Debian's /etc/hosts maps the host's
/// own name to 127.0.1.1, which other nodes cannot reach).
DTRAIN_DETAIL_INLINE std::string store_bind_address(const environment& env,
                                                    const std::string& master, bool multi_node);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string store_bind_address(const environment& env,
                                                    const std::string& master, bool multi_node) {
  if (auto bind = env.get(store_bind_variable); bind && !bind->empty()) return std::string(*bind);
  const resolved names = resolve(master);
  if (!names.error.empty() || names.addresses.empty()) return master;  // listen_on reports it
  bool all_loopback = true;
  for (const auto& a : names.addresses) all_loopback = all_loopback && is_loopback_address(a);
  if (all_loopback) return multi_node ? "0.0.0.0" : names.addresses.front();
  const auto locals = interface_addresses();
  for (const auto& a : names.addresses) {
    for (const auto& local : locals) {
      if (local.address == a) return a;
    }
  }
  return "0.0.0.0";
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The address a client on the store's own host uses to reach it.
inline std::string local_store_address(const std::string& bound) {
  return bound == "0.0.0.0" || bound == "::" ? "127.0.0.1" : bound;
}

/// A token shared through a file only this user can read, for ranks on one
/// host that no dtrain process launched (torchrun, mpirun with Gloo): rank 0
/// writes it, the others read it. The file is named after the store's port,
/// in $XDG_RUNTIME_DIR or /tmp/dtrain-<uid> (mode 0700, checked).
class token_file {
 public:
  token_file(const environment& env, int port);
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

  /// Rank 0: writes `token` (replacing a stale file atomically).
  void publish(const std::string& token);

  /// The token in the file now, or nullopt if there is none yet.
  [[nodiscard]] std::optional<std::string> read() const;

  token_file(const token_file&) = delete;
  token_file& operator=(const token_file&) = delete;
  ~token_file() {
    if (published_) ::unlink(path_.c_str());
  }

 private:
  [[noreturn]] void fail(const char* what, int err) const;
  std::string dir_;
  std::string path_;
  bool published_ = false;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE token_file::token_file(const environment& env, int port) {
  std::string dir;
  if (auto runtime = env.get("XDG_RUNTIME_DIR"); runtime && !runtime->empty()) {
    dir = std::string(*runtime) + "/dtrain";
  } else {
    dir = "/tmp/dtrain-" + std::to_string(::getuid());
  }
  dir_ = dir;
  path_ = dir + "/store-" + std::to_string(port) + ".token";
}

DTRAIN_DETAIL_INLINE void token_file::publish(const std::string& token) {
  if (::mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST) fail("cannot create", errno);
  struct stat st {};
  if (::lstat(dir_.c_str(), &st) != 0) fail("cannot inspect", errno);
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::getuid() || (st.st_mode & 077) != 0) {
    throw config_error(dir_ +
                       " must be a directory that only this user can open (mode 0700) "
                       "to hold the store token; remove it, or set DTRAIN_STORE_TOKEN");
  }
  const std::string temp = path_ + "." + std::to_string(::getpid());
  int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) fail("cannot write", errno);
  bool ok = ::write(fd, token.data(), token.size()) == static_cast<ssize_t>(token.size());
  ok = ::close(fd) == 0 && ok;
  if (!ok || ::rename(temp.c_str(), path_.c_str()) != 0) {
    int err = errno;
    ::unlink(temp.c_str());
    fail("cannot write", err);
  }
  published_ = true;
}

DTRAIN_DETAIL_INLINE std::optional<std::string> token_file::read() const {
  int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return std::nullopt;
  char text[128];
  ssize_t n = ::read(fd, text, sizeof text);
  ::close(fd);
  if (n <= 0) return std::nullopt;
  return std::string(text, static_cast<std::size_t>(n));
}

DTRAIN_DETAIL_INLINE void token_file::fail(const char* what, int err) const {
  throw config_error(std::string(what) + " " + path_ + " for the store token: " +
                     std::strerror(err) + "; set DTRAIN_STORE_TOKEN instead");
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Connects `client` to the store at host:port with the token in `file`,
/// reading the file again while the store refuses it (token_error: a file
/// left by an earlier job on the same port, which rank 0 has not replaced
/// yet, or no file yet), within `options.timeout`; then `options.token` is
/// the accepted token. Other failures are thrown as they come. Throws
/// timeout_error naming the file when no valid token appears in time.
DTRAIN_DETAIL_INLINE void connect_with_token_file(std::optional<store_client>& client,
                                                  const token_file& file, const std::string& host,
                                                  int port, store_options& options, int rank);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void connect_with_token_file(std::optional<store_client>& client,
                                                  const token_file& file, const std::string& host,
                                                  int port, store_options& options, int rank) {
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  for (;;) {
    if (auto token = file.read()) {
      options.token = *token;
      try {
        client.emplace(host, port, options);
        return;
      } catch (const token_error&) {
        // A stale file: read it again.
      }
    }
    if (std::chrono::steady_clock::now() > deadline) {
      throw timeout_error("rank " + std::to_string(rank) + " found no valid store token in " +
                          file.path() +
                          " within the store timeout; is rank 0 running "
                          "on this host? (set DTRAIN_STORE_TOKEN on every rank to skip the file)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail
}  // namespace dtrain
// ---- end dtrain/rendezvous/security.hpp ----

#if DTRAIN_HAS_GLOO()

#include <gloo/context.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <pthread.h>
#include <unistd.h>

namespace dtrain {

/// Options of a gloo_communicator. Aggregate: use designated initialisers,
/// `{.collectives = {.timeout = 30s}, .interface = "eth0"}`.
struct gloo_options {
  /// Timeout (also Gloo's own, so a dead or stuck peer makes Gloo fail) and check mode.
  collective_options collectives{};
  /// Network interface Gloo's TCP transport binds to ("eth0"). Empty:
  /// DTRAIN_GLOO_IFNAME, else GLOO_SOCKET_IFNAME (from `env`), else the
  /// interface whose address reaches `master_addr`.
  std::string interface {};
  /// The host whose route chooses the interface when none is named. Empty:
  /// MASTER_ADDR (from `env`).
  std::string master_addr{};
  /// Where the communicator's keys live in the store. The n-th communicator a
  /// rank makes with one prefix uses `prefix/n`, so every rank must make its
  /// communicators in the same order (as it runs its collectives).
  std::string prefix = "dtrain/gloo";
  /// Allreduces (and reduce_scatters, allgathers) through one shared-memory segment when
  /// every rank of the communicator runs on this host (backend/shm.hpp), not
  /// through TCP over loopback. true: required (making the communicator fails
  /// when it cannot be used); false: off. Unset: DTRAIN_GLOO_SHM from `env`
  /// (1 required, 0 off), else used wherever it can be. Every rank must
  /// allow it, or none uses it; describe() says which, and why not.
  std::optional<bool> shared_memory{};
  /// The environment snapshot DTRAIN_GLOO_IFNAME, GLOO_SOCKET_IFNAME,
  /// MASTER_ADDR and MASTER_PORT are read from; the communicator never reads
  /// the process's own. dtrain::run passes its snapshot; empty: none is set.
  environment env{};
};

namespace detail {

/// Blocks SIGPIPE in the calling thread while it lives, and in the threads it starts meanwhile.
class sigpipe_blocked {
 public:
  sigpipe_blocked() noexcept;
  ~sigpipe_blocked() { ::pthread_sigmask(SIG_SETMASK, &previous_, nullptr); }
  sigpipe_blocked(const sigpipe_blocked&) = delete;
  sigpipe_blocked& operator=(const sigpipe_blocked&) = delete;

 private:
  sigset_t previous_{};
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE sigpipe_blocked::sigpipe_blocked() noexcept {
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  ::pthread_sigmask(SIG_BLOCK, &pipe, &previous_);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The file mapped at `address` in this process (/proc/self/maps), or empty.
DTRAIN_DETAIL_INLINE std::string mapped_file_of(const void* address);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string mapped_file_of(const void* address) {
  std::FILE* maps = std::fopen("/proc/self/maps", "r");
  if (!maps) return {};
  const auto at = reinterpret_cast<std::uintptr_t>(address);
  std::string found;
  char line[4096];
  while (found.empty() && std::fgets(line, sizeof line, maps)) {
    unsigned long long begin = 0, end = 0;
    int path_at = 0;
    if (std::sscanf(line, "%llx-%llx %*s %*s %*s %*s %n", &begin, &end, &path_at) < 2) continue;
    if (at < begin || at >= end || path_at <= 0) continue;
    found = line + path_at;
    while (!found.empty() && (found.back() == '\n' || found.back() == ' ')) found.pop_back();
  }
  std::fclose(maps);
  return found;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Refuses, naming the library, a process where Gloo's functions resolve to
/// a LibTorch's own copy of Gloo (pytorch.org's and PyPI's LibTorch export
/// one) rather than to the libgloo whose headers dtrain was compiled
/// against: another version, whose calls crash. It happens when LibTorch
/// comes before libgloo on the link line.
DTRAIN_DETAIL_INLINE void check_gloo_library(int rank);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void check_gloo_library(int rank) {
  using create_device =
      std::shared_ptr<::gloo::transport::Device> (*)(const ::gloo::transport::tcp::attr&);
  const create_device create = &::gloo::transport::tcp::CreateDevice;
  const void* code = nullptr;
  std::memcpy(&code, &create, sizeof code);
  const std::string file = mapped_file_of(code);
  const std::string base = file.substr(file.find_last_of('/') + 1);
  if (!base.starts_with("libtorch")) return;
  throw config_error(
      "gloo_communicator on rank " + std::to_string(rank) + ": Gloo's functions resolve to " +
      file +
      ", the copy of Gloo inside LibTorch, not to the libgloo dtrain was compiled against "
      "(another version: its calls would crash). Link libgloo before LibTorch (CMake: list "
      "dtrain::gloo before the torch libraries), or use dtrain's MPI or NCCL engine with this "
      "LibTorch");
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Whether a communicator may use shared memory: off, where it can, or required.
enum class shm_mode : char { off = '0', automatic = 'a', required = '1' };

DTRAIN_DETAIL_INLINE shm_mode shm_mode_of(const gloo_options& o);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE shm_mode shm_mode_of(const gloo_options& o) {
  std::optional<bool> on = o.shared_memory;
  if (!on) on = read_flag(o.env, gloo_shm_variable);
  if (!on) return shm_mode::automatic;
  return *on ? shm_mode::required : shm_mode::off;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// What tells this host apart from the ranks' point of view: the boot, the
/// host name, and the network and mount namespaces (ranks in other ones, as
/// on hosts simulated with network namespaces, are other hosts: their
/// traffic is what is being tested, and /dev/shm may differ).
DTRAIN_DETAIL_INLINE std::string shm_host_identity();
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string shm_host_identity() {
  std::string id;
  if (std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char boot[64] = {};
    if (std::fgets(boot, sizeof boot, f)) id += boot;
    std::fclose(f);
  }
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) == 0) id += host;
  for (const char* ns : {"/proc/self/ns/net", "/proc/self/ns/mnt"}) {
    char link[128] = {};
    const auto n = ::readlink(ns, link, sizeof link - 1);
    id += "|";
    if (n > 0) id.append(link, static_cast<std::size_t>(n));
  }
  return id;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// A fixed-size record of text for Gloo's allgather and broadcast: a status
/// byte, then text cut at `record_bytes` - 2.
inline constexpr std::size_t shm_record_bytes = 256;
DTRAIN_DETAIL_INLINE void shm_put(std::uint8_t* record, char status, const std::string& text);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void shm_put(std::uint8_t* record, char status, const std::string& text) {
  std::memset(record, 0, shm_record_bytes);
  record[0] = static_cast<std::uint8_t>(status);
  std::memcpy(record + 1, text.data(), std::min(text.size(), shm_record_bytes - 2));
}
#endif  // DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string shm_text_of(const std::uint8_t* record);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string shm_text_of(const std::uint8_t* record) {
  const char* text = reinterpret_cast<const char*>(record + 1);
  return std::string(text, ::strnlen(text, shm_record_bytes - 1));
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Sets up s.shm over the freshly connected Gloo context, collectively (every
/// rank calls it; all reach the same decision from the same allgathered
/// records), and returns the describe() text. Throws config_error when a
/// rank requires shared memory and it cannot be used.
DTRAIN_DETAIL_INLINE std::string gloo_join_shm(gloo_state& s, shm_mode mode);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string gloo_join_shm(gloo_state& s, shm_mode mode) {
  if (s.size == 1) return "off (a world of one)";
#if !DTRAIN_HAS_SHM()
  if (mode == shm_mode::required) {
    throw config_error("DTRAIN_GLOO_SHM=1 (or gloo_options::shared_memory) on rank " +
                       std::to_string(s.rank) + ": this platform has no shared-memory path");
  }
  return "off (not on this platform)";
#else
  const auto ranks = static_cast<std::size_t>(s.size);
  const auto everyone = [&](const std::uint8_t* own, std::vector<std::uint8_t>& into) {
    into.assign(ranks * shm_record_bytes, 0);
    gloo_run_allgather_tcp(s,
                           buffer{const_cast<std::uint8_t*>(own), shm_record_bytes, dtype::uint8},
                           buffer{into.data(), into.size(), dtype::uint8}, s.timeout);
  };
  const auto record = [&](const std::vector<std::uint8_t>& records, int r) {
    return records.data() + static_cast<std::size_t>(r) * shm_record_bytes;
  };
  std::uint8_t mine[shm_record_bytes];
  std::vector<std::uint8_t> all;
  // 1. Does every rank allow it, and run on this host?
  shm_put(mine, static_cast<char>(mode), shm_host_identity());
  everyone(mine, all);
  int required_by = -1;
  std::string why_not;
  for (int r = 0; r < s.size; ++r) {
    const auto m = static_cast<shm_mode>(record(all, r)[0]);
    if (m == shm_mode::required && required_by < 0) required_by = r;
    if (m == shm_mode::off && why_not.empty())
      why_not =
          "DTRAIN_GLOO_SHM=0 or gloo_options::shared_memory = false on rank " + std::to_string(r);
  }
  for (int r = 1; r < s.size && why_not.empty(); ++r) {
    if (shm_text_of(record(all, r)) != shm_text_of(record(all, 0)))
      why_not = "ranks 0 and " + std::to_string(r) + " run on different hosts";
  }
  // 2. Rank 0 makes the segment and tells the others its name, or why not.
  if (why_not.empty()) {
    if (s.rank == 0) {
      try {
        const std::string name = "/dtrain-gloo-" + new_store_token();
        s.shm = shm_segment::create(name, s.size);
        shm_put(mine, 'y', name);
      } catch (const shm_failure& e) {
        shm_put(mine, 'n', std::string("rank 0: ") + e.what());
      }
    }
    gloo_run_broadcast(s, buffer{mine, shm_record_bytes, dtype::uint8}, 0, s.timeout);
    if (mine[0] != 'y') why_not = shm_text_of(mine);
  }
  // 3. The others open it; every rank hears how each fared; rank 0 unlinks.
  if (why_not.empty()) {
    const std::string made = shm_text_of(mine);
    std::uint8_t status[shm_record_bytes];
    shm_put(status, 'y', "");
    if (s.rank != 0) {
      try {
        s.shm = shm_segment::open(made, s.rank, s.size);
      } catch (const shm_failure& e) {
        shm_put(status, 'n', "rank " + std::to_string(s.rank) + ": " + e.what());
      }
    }
    everyone(status, all);
    if (s.rank == 0) shm_segment::unlink(made);
    for (int r = 0; r < s.size && why_not.empty(); ++r) {
      if (record(all, r)[0] != 'y') why_not = shm_text_of(record(all, r));
    }
  }
  if (!why_not.empty()) {
    s.shm = shm_segment{};
    if (required_by >= 0) {
      throw config_error("DTRAIN_GLOO_SHM=1 (or gloo_options::shared_memory = true) on rank " +
                         std::to_string(required_by) +
                         ", but shared memory cannot be used: " + why_not);
    }
    return "off (" + why_not + ")";
  }
  return "on (" + std::to_string(s.shm.bytes() >> 10) + " KiB segment, " +
         std::to_string(s.shm.slot_bytes() >> 10) + " KiB slots)";
#endif
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Everything a gloo_communicator owns; one allocation, so the communicator moves cheaply.
struct gloo_self {
  std::shared_ptr<gloo_state> state;
  std::thread worker;
  std::shared_ptr<const gloo_store_ref> store;
  gloo_options options;
  gloo_endpoint endpoint;
  std::string keys;         // this communicator's namespace in the store
  std::int64_t splits = 0;  // split() calls so far: names the children's namespaces

  gloo_self() = default;
  gloo_self(const gloo_self&) = delete;
  gloo_self& operator=(const gloo_self&) = delete;
  // Runs what is queued (the peers expect it), then stops the worker. A
  // collective stuck on a hung peer ends with Gloo's timeout.
  ~gloo_self();
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE gloo_self::~gloo_self() {
  if (state) {
    {
      std::lock_guard lock(state->mutex);
      state->stopping = true;
    }
    state->wake.notify_all();
  }
  if (worker.joinable()) worker.join();
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail

/// A communicator on Gloo (TCP), on host memory. Every call returns at once
/// with a work handle; the collective runs on this communicator's worker
/// thread after those submitted before it. Buffers must stay alive and
/// untouched until the work completes. Calls may come from several threads;
/// every rank must still make them in the same order.
///
/// Errors: config_error for arguments (thrown by the call); from work::wait,
/// backend_error with Gloo's message (a peer died: at once) and timeout_error
/// (Gloo's own timeout, the collective timeout). After any failure or timeout
/// the communicator is unusable: later calls throw backend_error saying so.
/// Destruction runs what is still queued and waits for the collective in
/// flight, which Gloo cannot abort: at most its timeout.
///
/// float16 and bfloat16 reduce through dtrain's own element-wise functions
/// (Gloo knows neither of dtrain's types); reduce_scatter is an allreduce and
/// a copy (see gloo_run_reduce_scatter).
class gloo_communicator {
 public:
  static constexpr bool reaches_device_memory = false;
  static constexpr bool reaches_host_memory = true;
  static constexpr std::string_view name = "gloo";

  /// Joins the group of `size` ranks that meet in `store`, which must outlive
  /// this communicator and every split of it. Blocks until every rank has
  /// connected; the store's waits use the collective timeout. Throws
  /// config_error (rank, size, interface), timeout_error or rendezvous_error
  /// (the store), backend_error (Gloo could not connect).
  template <store S>
  gloo_communicator(S& store, int rank, int size, gloo_options options = {})
      : gloo_communicator(std::make_shared<const detail::gloo_store_ref>(store), rank, size,
                          std::move(options)) {}

  gloo_communicator(gloo_communicator&&) noexcept = default;
  gloo_communicator& operator=(gloo_communicator&&) noexcept = default;
  ~gloo_communicator() = default;

  /// -1 and 0 for a rank that split() left out (negative color).
  [[nodiscard]] int rank() const noexcept { return self_ ? self_->state->rank : -1; }
  [[nodiscard]] int size() const noexcept { return self_ ? self_->state->size : 0; }
  /// False when moved from, or when split() left this rank out.
  [[nodiscard]] bool valid() const noexcept { return self_ != nullptr; }
  /// Only while valid().
  [[nodiscard]] const gloo_options& options() const noexcept { return self_->options; }
  /// This communicator's last collectives, for desync diagnostics (null when not valid()).
  [[nodiscard]] std::shared_ptr<detail::collective_ring> ring() const noexcept {
    return self_ ? self_->state->ring : nullptr;
  }

  /// Where it runs, for logs: "gloo rank 1 of 4, tcp, pci=, iface=lo, speed=-1, addr=[127.0.0.1]
  /// (the address that reaches MASTER_ADDR=127.0.0.1 (127.0.0.1)), keys under dtrain/gloo/0,
  /// shared memory on (3076 KiB segment, 1024 KiB slots)", or "shared memory off (why)".
  [[nodiscard]] std::string describe() const;

  /// Gloo's context, for interop and benchmarks against raw Gloo calls. Use
  /// it only while no work of this communicator is outstanding.
  [[nodiscard]] std::shared_ptr<::gloo::Context> gloo_context() const {
    return self_ ? self_->state->context : nullptr;
  }

  /// `out` becomes the reduction of every rank's `in` (in place when they are the same buffer).
  work allreduce(buffer in, buffer out, reduce_op op);

  /// `data` on every rank becomes root's.
  work broadcast(buffer data, int root);

  /// `out` (size() × in.count elements) becomes every rank's `in`, in rank order.
  work allgather(buffer in, buffer out) {
    return collective(detail::collective_call::allgather(in, out), &run_allgather);
  }

  /// `in` (size() × out.count elements) is reduced over ranks; rank r receives block r.
  work reduce_scatter(buffer in, buffer out, reduce_op op);

  /// Completes once every rank has called barrier().
  work barrier();

  /// A communicator of the ranks that pass the same `color`, ranked by
  /// (key, rank here). Collective over this communicator: every rank calls it,
  /// in the same place among its collectives. Blocks until the new group has
  /// connected, through the same store, under a namespace of its own. A
  /// negative color leaves this rank out: it gets a communicator with valid()
  /// false (see the `communicator` concept).
  gloo_communicator split(int color, int key);

 private:
  struct left_out_tag {};
  explicit gloo_communicator(left_out_tag) noexcept : left_out_(true) {}

  // A new group: chooses the endpoint, then takes the next namespace under the prefix.
  gloo_communicator(std::shared_ptr<const detail::gloo_store_ref> store, int rank, int size,
                    gloo_options options);

  gloo_communicator(std::shared_ptr<const detail::gloo_store_ref> store, int rank, int size,
                    gloo_options options, detail::gloo_endpoint endpoint, std::string keys) {
    connect(std::move(store), rank, size, std::move(options), std::move(endpoint), std::move(keys));
  }

  void connect(std::shared_ptr<const detail::gloo_store_ref> store, int rank, int size,
               gloo_options options, detail::gloo_endpoint endpoint, std::string keys);

  using ms = std::chrono::milliseconds;

  static void run_allgather(detail::gloo_state& s, const detail::collective_call& c, ms timeout) {
    detail::gloo_run_allgather(s, c.in, c.out, timeout);
  }

  static constexpr detail::memory_reach host_memory{
      .host = true,
      .device = false,
      .rule =
          "gloo reduces host memory only: copy device data to the host first, or use "
          "backend::nccl"};

  // Every collective, in this order: a left-out rank fails first; then the
  // argument checks every engine shares; a broken communicator; the ring's
  // number and the signature check mode compares (on the worker, before the
  // collective); then the queue, in submission order. Nothing moves for a
  // zero-length call: complete at once, except in check mode.
  work collective(const detail::collective_call& call, detail::gloo_runner run);

  std::unique_ptr<detail::gloo_self> self_;
  bool left_out_ = false;  // split() gave this rank a negative color
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string gloo_communicator::describe() const {
  if (!self_) return left_out_ ? "gloo, this rank left out by split()" : "gloo, moved from";
  return "gloo rank " + std::to_string(rank()) + " of " + std::to_string(size()) + ", " +
         self_->state->device->str() + " (" + self_->endpoint.origin + "), keys under " +
         self_->keys + ", shared memory " + self_->state->shm_text;
}

DTRAIN_DETAIL_INLINE work gloo_communicator::allreduce(buffer in, buffer out, reduce_op op) {
  return collective(detail::collective_call::allreduce(in, out, op),
                    [](detail::gloo_state& s, const detail::collective_call& c, ms timeout) {
                      detail::visit(c.in.type, [&]<class T>() {
                        detail::gloo_run_allreduce<T>(s, c.in, c.out, reduce_op(c.op), timeout);
                      });
                    });
}

DTRAIN_DETAIL_INLINE work gloo_communicator::broadcast(buffer data, int root) {
  return collective(detail::collective_call::broadcast(data, root),
                    [](detail::gloo_state& s, const detail::collective_call& c, ms timeout) {
                      detail::gloo_run_broadcast(s, c.out, c.root, timeout);
                    });
}

DTRAIN_DETAIL_INLINE work gloo_communicator::reduce_scatter(buffer in, buffer out, reduce_op op) {
  return collective(detail::collective_call::reduce_scatter(in, out, op),
                    [](detail::gloo_state& s, const detail::collective_call& c, ms timeout) {
                      detail::visit(c.in.type, [&]<class T>() {
                        detail::gloo_run_reduce_scatter<T>(s, c.in, c.out, reduce_op(c.op),
                                                           timeout);
                      });
                    });
}

DTRAIN_DETAIL_INLINE work gloo_communicator::barrier() {
  return collective(detail::collective_call::barrier(),
                    [](detail::gloo_state& s, const detail::collective_call&, ms timeout) {
                      detail::gloo_run_barrier(s, timeout);
                    });
}

DTRAIN_DETAIL_INLINE gloo_communicator gloo_communicator::split(int color, int key) {
  std::int64_t mine[2] = {color, key};
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(size()));
  buffer in{mine, 2, dtype::int64, memory::host};
  buffer out{all.data(), all.size(), dtype::int64, memory::host};
  // An allgather of (color, key), told apart from a user's in check mode.
  // Throws when not valid().
  const detail::collective_call exchange{
      .kind = detail::collective_kind::split, .in = in, .out = out};
  collective(exchange, &run_allgather).wait();
  // Every rank counts the split, left out or not: the next one's keys must agree.
  const auto number = self_->splits++;
  if (color < 0) return gloo_communicator(left_out_tag{});
  std::vector<std::pair<std::int64_t, int>> members;  // (key, rank here)
  for (int r = 0; r < size(); ++r) {
    if (all[2 * static_cast<std::size_t>(r)] == color)
      members.emplace_back(all[2 * static_cast<std::size_t>(r) + 1], r);
  }
  std::sort(members.begin(), members.end());
  int new_rank = 0;
  while (members[static_cast<std::size_t>(new_rank)].second != rank()) ++new_rank;
  std::string keys = self_->keys + "/split/" + std::to_string(number) + "/" + std::to_string(color);
  gloo_communicator child(self_->store, new_rank, static_cast<int>(members.size()), self_->options,
                          self_->endpoint, std::move(keys));
  child.self_->state->ring = self_->state->ring->make_child(color);
  return child;
}

DTRAIN_DETAIL_INLINE gloo_communicator::gloo_communicator(
    std::shared_ptr<const detail::gloo_store_ref> store, int rank, int size, gloo_options options) {
  if (size < 1)
    throw config_error("gloo_communicator: size " + std::to_string(size) + " must be at least 1");
  if (rank < 0 || rank >= size) {
    throw config_error("gloo_communicator: rank " + std::to_string(rank) + " is not below size " +
                       std::to_string(size));
  }
  (void)detail::shm_mode_of(options);  // a bad DTRAIN_GLOO_SHM fails before the store counts
  auto endpoint =
      detail::choose_gloo_endpoint(options.interface, options.master_addr, options.env, size);
  // Every rank counts the communicators it made under this prefix, so the
  // n-th one of every rank meets under the same namespace.
  const std::int64_t n = store->add(options.prefix + "/made/" + std::to_string(rank), 1) - 1;
  std::string keys = options.prefix + "/" + std::to_string(n);
  connect(std::move(store), rank, size, std::move(options), std::move(endpoint), std::move(keys));
}

DTRAIN_DETAIL_INLINE void gloo_communicator::connect(
    std::shared_ptr<const detail::gloo_store_ref> store, int rank, int size, gloo_options options,
    detail::gloo_endpoint endpoint, std::string keys) {
  // Gloo 0.5 writes to its sockets without MSG_NOSIGNAL: a peer that died
  // would kill this process with SIGPIPE. Its threads and the worker start
  // with SIGPIPE blocked (threads inherit the mask); such a write then fails
  // with EPIPE, which Gloo reports as an error.
  detail::sigpipe_blocked quiet;
  detail::check_gloo_library(rank);
  const detail::shm_mode shm = detail::shm_mode_of(options);  // DTRAIN_GLOO_SHM=bad fails here
  auto state = std::make_shared<detail::gloo_state>();
  state->rank = rank;
  state->size = size;
  state->timeout = options.collectives.timeout;
  state->check = options.collectives.check;
  const std::string where = "connecting gloo rank " + std::to_string(rank) + " of " +
                            std::to_string(size) + " (interface: " + endpoint.origin +
                            "; store keys under " + keys + "/): ";
  try {
    ::gloo::transport::tcp::attr attr;
    if (!endpoint.iface.empty()) {
      attr.iface = endpoint.iface;
    } else {
      attr.hostname = endpoint.hostname;
    }
    DTRAIN_GLOO_CHECK(state->device = ::gloo::transport::tcp::CreateDevice(attr));
    auto context = std::make_shared<::gloo::rendezvous::Context>(rank, size);
    context->setTimeout(state->timeout);
    detail::gloo_store_adapter adapter(*store, keys, state->timeout);
    DTRAIN_GLOO_CHECK(context->connectFullMesh(adapter, state->device));
    state->context = context;
    // Once every rank has connected, every rank has read every address: a
    // barrier proves it, and the addresses can leave the store.
    detail::gloo_run_barrier(*state, state->timeout);
    for (const auto& key : adapter.written()) store->erase(key);
    state->shm_text = detail::gloo_join_shm(*state, shm);
  } catch (const timeout_error& e) {
    throw timeout_error(where + e.what());
  } catch (const rendezvous_error& e) {
    throw rendezvous_error(where + e.what());
  } catch (const error&) {
    throw;
  } catch (const std::exception& e) {  // Gloo's, through DTRAIN_GLOO_CHECK
    throw backend_error(where + "Gloo: " + e.what(), 0);
  }
  self_ = std::make_unique<detail::gloo_self>();
  self_->state = state;
  self_->store = std::move(store);
  self_->options = std::move(options);
  self_->endpoint = std::move(endpoint);
  self_->keys = std::move(keys);
  self_->worker = std::thread([state] { detail::gloo_serve(state); });
}

DTRAIN_DETAIL_INLINE work gloo_communicator::collective(const detail::collective_call& call,
                                                        detail::gloo_runner run) {
  const detail::collective_info what = call.info(name, rank(), size());
  if (!self_) detail::throw_invalid(detail::describe(what), left_out_);
  detail::check_arguments(call, what, host_memory);
  detail::gloo_state& s = *self_->state;
  if (s.unusable.load()) throw backend_error(detail::describe(what) + ": " + s.unusable_text(), 0);
  std::unique_lock lock(s.mutex);
  const std::int64_t seq = detail::record(*s.ring, what);
  if (!call.moves_data() && !s.check) {
    s.ring->settle(seq, detail::call_state::completed);
    return work{};
  }
  auto w = std::make_shared<detail::gloo_work>(what, s.timeout, self_->state);
  w->track(s.ring, seq);
  s.queue.push_back({w, detail::signature_of(seq, what), call, run});
  const bool idle = !s.running;
  lock.unlock();
  if (idle) s.wake.notify_one();
  return work(std::move(w));
}
#endif  // DTRAIN_DETAIL_BODIES()

static_assert(communicator<gloo_communicator>);

}  // namespace dtrain

#endif  // DTRAIN_HAS_GLOO()
// ---- end dtrain/backend/gloo.hpp ----
// ---- begin dtrain/backend/memory.hpp ----
/// @file
/// Memory spaces: where a backend's data lives and the few operations
/// DistributedDataParallel needs there (allocate zeroed, free, copy, zero, the
/// 16-bit casts of gradient compression, and waiting for a stream). `host_memory`
/// is plain memory handled on the calling thread; `cuda_memory` is one CUDA
/// device, every operation ordered on a stream. A backend names its space in
/// its backend_traits, so the algorithm that uses them reads the same for all.


#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#if DTRAIN_HAS_CUDA()
#include <cuda_runtime.h>
#endif
#if defined(__CUDACC__) && DTRAIN_HAS_CUDA()
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace dtrain {

namespace detail {

inline constexpr std::string_view device_casts_missing =
    "gradient compression of GPU buckets needs CUDA kernels, and no translation unit of this "
    "program was compiled by nvcc: include <dtrain/dtrain.hpp> in at least one .cu file that is "
    "linked into the program (any one: the kernels are shared)";

/// The 16-bit casts as plain loops: out[i] = Half(in[i] * scale), and back.
DTRAIN_DETAIL_INLINE void host_compress(void* out, const float* in, std::size_t n, float scale,
                                        dtype wire);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void host_compress(void* out, const float* in, std::size_t n, float scale,
                                        dtype wire) {
  visit(wire, [&]<class Half>() {
    if constexpr (std::same_as<Half, float16> || std::same_as<Half, bfloat16>) {
      auto* o = static_cast<Half*>(out);
      for (std::size_t i = 0; i < n; ++i) o[i] = Half(in[i] * scale);
    }
  });
}
#endif  // DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void host_decompress(float* out, const void* in, std::size_t n, dtype wire);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void host_decompress(float* out, const void* in, std::size_t n, dtype wire) {
  visit(wire, [&]<class Half>() {
    if constexpr (std::same_as<Half, float16> || std::same_as<Half, bfloat16>) {
      const auto* i16 = static_cast<const Half*>(in);
      for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(i16[i]);
    }
  });
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail

/// Host memory: allocation with operator new, memcpy, loops. The `stream`
/// arguments are there so the code above reads the same for every space.
struct host_memory {
  using stream_type = std::nullptr_t;
  static constexpr memory where = memory::host;
  /// Buckets travel on a communication thread: the host is the device.
  static constexpr bool on_stream = false;

  [[nodiscard]] static void* allocate(std::size_t bytes, int /*device*/, stream_type) {
    return ::operator new(bytes == 0 ? 1 : bytes);  // aligned for every element type
  }
  static void release(void* data, int /*device*/, stream_type) noexcept { ::operator delete(data); }
  static void zero(void* data, std::size_t bytes, int /*device*/, stream_type) {
    if (bytes) std::memset(data, 0, bytes);
  }
  static void copy(void* dst, const void* src, std::size_t bytes, int /*device*/, stream_type) {
    if (dst != src && bytes) std::memcpy(dst, src, bytes);
  }
  /// From host memory into this space, and back (here: copies).
  static void upload(void* dst, const void* host, std::size_t bytes, int device, stream_type s) {
    copy(dst, host, bytes, device, s);
  }
  static void download(void* host, const void* src, std::size_t bytes, int device, stream_type s) {
    copy(host, src, bytes, device, s);
  }
  static void compress(void* out, const float* in, std::size_t n, float scale, dtype wire,
                       int /*device*/, stream_type) {
    detail::host_compress(out, in, n, scale, wire);
  }
  static void decompress(float* out, const void* in, std::size_t n, dtype wire, int /*device*/,
                         stream_type) {
    detail::host_decompress(out, in, n, wire);
  }
  /// Everything above has happened by the time it returns.
  static void synchronize(int /*device*/, stream_type) noexcept {}
  /// Whether compress() and decompress() can run here.
  [[nodiscard]] static bool casts_available() noexcept { return true; }
  static void check_stream(int /*device*/, stream_type) noexcept {}
  static void order_after(int /*device*/, stream_type, stream_type) noexcept {}
};

#if DTRAIN_HAS_CUDA()

namespace detail {

/// The CUDA kernels of gradient compression. They exist only where a
/// translation unit is compiled by nvcc: such a unit registers them here once
/// at start-up, so every unit (g++ or nvcc) calls the same code through this
/// one slot, and no function has two bodies (a g++ and an nvcc one).
struct device_casts {
  void (*compress)(void* out, const float* in, std::size_t n, float scale, dtype wire,
                   cudaStream_t stream);
  void (*decompress)(float* out, const void* in, std::size_t n, dtype wire, cudaStream_t stream);
};

[[nodiscard]] DTRAIN_DETAIL_INLINE std::atomic<const device_casts*>& device_casts_slot() noexcept;
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::atomic<const device_casts*>& device_casts_slot() noexcept {
  static std::atomic<const device_casts*> slot{nullptr};
  return slot;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The registered kernels; config_error when no unit of the program was built by nvcc.
[[nodiscard]] DTRAIN_DETAIL_INLINE const device_casts& registered_device_casts();
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE const device_casts& registered_device_casts() {
  if (const device_casts* casts = device_casts_slot().load(std::memory_order_acquire))
    return *casts;
  throw config_error(std::string(device_casts_missing));
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail

/// One CUDA device; every operation is ordered on `stream` (the compute
/// stream) and runs with the device current, so that no other thread's
/// device and no other device's context is touched.
struct cuda_memory {
  using stream_type = cudaStream_t;
  static constexpr memory where = memory::device;
  /// Buckets travel on CUDA streams, ordered by events; the host does not wait.
  static constexpr bool on_stream = true;

  /// Stream-ordered: allocated on `stream` (cudaMallocAsync where the device
  /// has memory pools, else cudaMalloc), then zeroed there (never on the
  /// legacy default stream, which a non-blocking compute stream would not
  /// wait for). The host never waits, so a rebuild of the buckets does not
  /// stall behind a busy compute stream.
  [[nodiscard]] static void* allocate(std::size_t bytes, int device, stream_type stream);
  /// Frees on `stream` once everything before it there is done (cudaFreeAsync;
  /// cudaFree, which waits for the device, without memory pools). Call it on
  /// a stream ordered after the last use on any stream.
  static void release(void* data, int device, stream_type stream) noexcept;
  static void zero(void* data, std::size_t bytes, int device, stream_type stream);
  static void copy(void* dst, const void* src, std::size_t bytes, int device, stream_type stream);
  /// From (pageable) host memory to the device, on `stream`; `host` may be
  /// reused when this returns.
  static void upload(void* dst, const void* host, std::size_t bytes, int device,
                     stream_type stream);
  /// From the device to host memory, on `stream`: complete after synchronize(device, stream).
  static void download(void* host, const void* src, std::size_t bytes, int device,
                       stream_type stream);
  static void compress(void* out, const float* in, std::size_t n, float scale, dtype wire,
                       int device, stream_type stream);
  static void decompress(float* out, const void* in, std::size_t n, dtype wire, int device,
                         stream_type stream);
  /// The kernels exist when some unit of the program was compiled by nvcc.
  [[nodiscard]] static bool casts_available() noexcept;
  /// Blocks the host until everything on `stream` is done.
  static void synchronize(int device, stream_type stream);
  /// Work enqueued on `waiter` from now on runs after everything on `before` so far.
  static void order_after(int device, stream_type waiter, stream_type before);
  /// Whether `device` has stream-ordered memory pools (cudaMallocAsync).
  [[nodiscard]] static bool pools(int device) noexcept;
  /// A stream being captured into a CUDA graph cannot take DDP's work (its
  /// events and host waits): config_error saying so.
  static void check_stream(int device, stream_type stream);
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void* cuda_memory::allocate(std::size_t bytes, int device,
                                                 stream_type stream) {
  detail::device_guard on(device);
  void* data = nullptr;
  const std::size_t n = bytes == 0 ? 1 : bytes;
  if (pools(device)) {
    DTRAIN_CUDA_CHECK(cudaMallocAsync(&data, n, stream));
  } else {
    DTRAIN_CUDA_CHECK(cudaMalloc(&data, n));
  }
  if (const cudaError_t rc = cudaMemsetAsync(data, 0, n, stream); rc != cudaSuccess) {
    release(data, device, stream);
    detail::throw_cuda_error(rc, "cudaMemsetAsync(data, 0, bytes, stream)", __FILE__, __LINE__);
  }
  return data;
}

DTRAIN_DETAIL_INLINE void cuda_memory::release(void* data, int device,
                                               stream_type stream) noexcept {
  detail::device_guard on(device, std::nothrow);
  if (pools(device) && cudaFreeAsync(data, stream) == cudaSuccess) return;
  (void)cudaGetLastError();
  (void)cudaFree(data);
}

DTRAIN_DETAIL_INLINE void cuda_memory::zero(void* data, std::size_t bytes, int device,
                                            stream_type stream) {
  if (!bytes) return;
  detail::device_guard on(device);
  DTRAIN_CUDA_CHECK(cudaMemsetAsync(data, 0, bytes, stream));
}

DTRAIN_DETAIL_INLINE void cuda_memory::copy(void* dst, const void* src, std::size_t bytes,
                                            int device, stream_type stream) {
  if (dst == src || !bytes) return;
  detail::device_guard on(device);
  DTRAIN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
}

DTRAIN_DETAIL_INLINE void cuda_memory::upload(void* dst, const void* host, std::size_t bytes,
                                              int device, stream_type stream) {
  if (!bytes) return;
  detail::device_guard on(device);
  DTRAIN_CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream));
}

DTRAIN_DETAIL_INLINE void cuda_memory::download(void* host, const void* src, std::size_t bytes,
                                                int device, stream_type stream) {
  if (!bytes) return;
  detail::device_guard on(device);
  DTRAIN_CUDA_CHECK(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream));
}

DTRAIN_DETAIL_INLINE void cuda_memory::compress(void* out, const float* in, std::size_t n,
                                                float scale, dtype wire, int device,
                                                stream_type stream) {
  const detail::device_casts& casts = detail::registered_device_casts();
  detail::device_guard on(device);
  casts.compress(out, in, n, scale, wire, stream);
}

DTRAIN_DETAIL_INLINE void cuda_memory::decompress(float* out, const void* in, std::size_t n,
                                                  dtype wire, int device, stream_type stream) {
  const detail::device_casts& casts = detail::registered_device_casts();
  detail::device_guard on(device);
  casts.decompress(out, in, n, wire, stream);
}

DTRAIN_DETAIL_INLINE void cuda_memory::synchronize(int device, stream_type stream) {
  detail::device_guard on(device);
  DTRAIN_CUDA_CHECK(cudaStreamSynchronize(stream));
}

DTRAIN_DETAIL_INLINE void cuda_memory::order_after(int device, stream_type waiter,
                                                   stream_type before) {
  if (waiter == before) return;
  detail::device_guard on(device);
  const detail::cuda_event done = detail::cuda_event::create();
  DTRAIN_CUDA_CHECK(cudaEventRecord(done.get(), before));
  DTRAIN_CUDA_CHECK(cudaStreamWaitEvent(waiter, done.get(), 0));
}

DTRAIN_DETAIL_INLINE bool cuda_memory::pools(int device) noexcept {
  int supported = 0;
  if (cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return supported != 0;
}

DTRAIN_DETAIL_INLINE void cuda_memory::check_stream(int device, stream_type stream) {
  detail::device_guard on(device);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  DTRAIN_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusNone) {
    throw config_error(
        "DistributedDataParallel: the compute stream is being captured into a CUDA graph; DDP "
        "records events, polls them from the host and launches NCCL work that must not be "
        "replayed, so run the DDP step outside the capture (capture the forward and backward "
        "only)");
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

#endif  // DTRAIN_HAS_CUDA()

namespace detail {

// What differs between a g++ and an nvcc translation unit lives in an inline
// namespace named after the compiler: no symbol has two bodies (CCCL's rule).
#if defined(__CUDACC__)
inline namespace nvcc {
#else
inline namespace host_compiler {
#endif

/// "nvcc" or "host": which compiler built this translation unit's copy of
/// dtrain (the mixed g++/nvcc link test asks each unit).
[[nodiscard]] constexpr std::string_view compiled_by() noexcept {
#if defined(__CUDACC__)
  return "nvcc";
#else
  return "host";
#endif
}

#if defined(__CUDACC__) && DTRAIN_HAS_CUDA()
// The runtime's own conversions (round to nearest even), on the bits of dtrain's 16-bit types.
template <class Half>
__device__ std::uint16_t dtrain_to_half_bits(float x) {
  if constexpr (std::is_same_v<Half, bfloat16>)
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  else
    return __half_as_ushort(__float2half_rn(x));
}
template <class Half>
__device__ float dtrain_from_half_bits(std::uint16_t b) {
  if constexpr (std::is_same_v<Half, bfloat16>)
    return __bfloat162float(__ushort_as_bfloat16(b));
  else
    return __half2float(__ushort_as_half(b));
}
template <class Half>
__global__ void dtrain_compress_kernel(std::uint16_t* out, const float* in, std::size_t n,
                                       float scale) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    out[i] = dtrain_to_half_bits<Half>(in[i] * scale);
  }
}
template <class Half>
__global__ void dtrain_decompress_kernel(float* out, const std::uint16_t* in, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    out[i] = dtrain_from_half_bits<Half>(in[i]);
  }
}
inline unsigned cast_blocks(std::size_t n) {
  return static_cast<unsigned>(n / 256 + 1 > 4096 ? 4096 : n / 256 + 1);
}
inline void launch_compress(void* out, const float* in, std::size_t n, float scale, dtype wire,
                            cudaStream_t stream) {
  if (n == 0) return;
  auto* o = static_cast<std::uint16_t*>(out);
  if (wire == dtype::bfloat16)
    dtrain_compress_kernel<bfloat16><<<cast_blocks(n), 256, 0, stream>>>(o, in, n, scale);
  else
    dtrain_compress_kernel<float16><<<cast_blocks(n), 256, 0, stream>>>(o, in, n, scale);
  DTRAIN_CUDA_CHECK(cudaGetLastError());
}
inline void launch_decompress(float* out, const void* in, std::size_t n, dtype wire,
                              cudaStream_t stream) {
  if (n == 0) return;
  const auto* i16 = static_cast<const std::uint16_t*>(in);
  if (wire == dtype::bfloat16)
    dtrain_decompress_kernel<bfloat16><<<cast_blocks(n), 256, 0, stream>>>(out, i16, n);
  else
    dtrain_decompress_kernel<float16><<<cast_blocks(n), 256, 0, stream>>>(out, i16, n);
  DTRAIN_CUDA_CHECK(cudaGetLastError());
}
inline constexpr device_casts nvcc_device_casts{&launch_compress, &launch_decompress};
/// Registers the kernels at start-up in every program with an nvcc unit.
inline const bool nvcc_device_casts_registered =
    (device_casts_slot().store(&nvcc_device_casts, std::memory_order_release), true);
#endif

}  // inline namespace nvcc / host_compiler

/// Whether the program can cast GPU buckets (some unit was built by nvcc).
[[nodiscard]] DTRAIN_DETAIL_INLINE bool device_casts_available() noexcept;
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE bool device_casts_available() noexcept {
#if DTRAIN_HAS_CUDA()
  return device_casts_slot().load(std::memory_order_acquire) != nullptr;
#else
  return false;
#endif
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail

#if DTRAIN_HAS_CUDA()
inline bool cuda_memory::casts_available() noexcept { return detail::device_casts_available(); }
#endif
}  // namespace dtrain
// ---- end dtrain/backend/memory.hpp ----
// ---- begin dtrain/backend/mpi.hpp ----
/// @file
/// The MPI backend: nonblocking MPI-3 collectives on communicators dtrain
/// owns (MPI_ERRORS_RETURN, so every failure is reported, not fatal).


#if DTRAIN_HAS_MPI()

#include <mpi.h>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI's MPIX_Query_cuda_support
#endif
#include <array>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain {

namespace detail {

DTRAIN_DETAIL_INLINE std::string mpi_error_text(int code);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS)
    return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(length));
}
#endif  // DTRAIN_DETAIL_BODIES()

DTRAIN_DETAIL_INLINE std::string mpi_thread_level_name(int level);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string mpi_thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
  }
  return "thread level " + std::to_string(level);
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail

/// Evaluates an MPI call; throws backend_error with file:line, the call, what
/// it was for and MPI's message and code when it does not return MPI_SUCCESS.
#define DTRAIN_MPI_CHECK(call, what)                                                             \
  do {                                                                                           \
    int dtrain_mpi_rc_ = (call);                                                                 \
    if (dtrain_mpi_rc_ != MPI_SUCCESS) {                                                         \
      throw ::dtrain::backend_error(::dtrain::detail::what_text(what) + ": " #call " failed: " + \
                                        ::dtrain::detail::mpi_error_text(dtrain_mpi_rc_) +       \
                                        " (at " __FILE__ ":" + std::to_string(__LINE__) + ")",   \
                                    dtrain_mpi_rc_);                                             \
    }                                                                                            \
  } while (0)

/// Options of the MPI backend.
struct mpi_options {
  collective_options collectives{};
  /// The thread level dtrain requires: DDP's communication thread calls MPI
  /// while other threads may too. Initialising MPI asks for MULTIPLE.
  int required_thread_level = MPI_THREAD_MULTIPLE;
  /// When dtrain initialises Open MPI and the user set no
  /// OMPI_MCA_coll_libnbc_iallreduce_algorithm, ask for the ring algorithm:
  /// Open MPI's default for the nonblocking allreduce dtrain uses is about
  /// twice as slow as its blocking one from 4 KiB up (bench/allreduce_mpi).
  bool tune_open_mpi = true;
  /// Device buffers go to MPI as they are (blocking collectives, since Open
  /// MPI's nonblocking ones do not take CUDA memory), instead of being staged
  /// through pooled pinned host memory. Opt-in, and only for an MPI built
  /// with CUDA support (MPIX_Query_cuda_support(); otherwise a config_error).
  /// A blocking call cannot be bounded by the collective timeout.
  bool cuda_aware_direct = false;

  /// These options for a job whose environment snapshot is `env`: no tuning
  /// when the user chose OMPI_MCA_coll_libnbc_iallreduce_algorithm there.
  [[nodiscard]] mpi_options with_env(const environment& env) const;
  static constexpr const char* open_mpi_iallreduce_variable =
      "OMPI_MCA_coll_libnbc_iallreduce_algorithm";
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE mpi_options mpi_options::with_env(const environment& env) const {
  mpi_options out = *this;
  if (env.contains(open_mpi_iallreduce_variable)) out.tune_open_mpi = false;
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Owns MPI's initialisation when dtrain did it: initialises only if nobody
/// has, and then finalizes when the last communicator is gone.
class mpi_environment {
 public:
  explicit mpi_environment(int required_level, bool tune_open_mpi = true);
  mpi_environment(const mpi_environment&) = delete;
  mpi_environment& operator=(const mpi_environment&) = delete;
  /// Finalizes MPI if this object initialised it, except while an exception
  /// unwinds (MPI_Finalize would wait for peers that wait for this rank, so
  /// MPI is left up for dtrain::run to report the failure and MPI_Abort).
  ~mpi_environment();
  [[nodiscard]] bool owned() const noexcept { return owned_; }

  /// Whether this MPI passes device pointers itself (Open MPI's CUDA support).
  [[nodiscard]] static bool cuda_aware() noexcept;

 private:
  bool owned_ = false;
  int unwinding_ = 0;  // exceptions in flight when it was made
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE mpi_environment::mpi_environment(int required_level, bool tune_open_mpi)
    : unwinding_(std::uncaught_exceptions()) {
  int initialized = 0;
  DTRAIN_MPI_CHECK(MPI_Initialized(&initialized), "checking whether MPI is initialised");
  int provided = MPI_THREAD_SINGLE;
  if (!initialized) {
    // The one write to the process's environment in dtrain, and why: Open MPI
    // takes MCA parameters at MPI_Init_thread from the environment (or
    // parameter files) only; MPI_Init_thread has no argument for them, and
    // MPI_T can write this one only where an Open MPI version registers it
    // as settable. Set just before dtrain itself initialises MPI, never when
    // the user's environment (options.with_env) or the process has it already.
    if (tune_open_mpi) ::setenv(mpi_options::open_mpi_iallreduce_variable, "1", 0);
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS)
      throw backend_error("MPI_Init_thread failed: " + detail::mpi_error_text(rc), rc);
    owned_ = true;
  } else {
    DTRAIN_MPI_CHECK(MPI_Query_thread(&provided), "querying MPI's thread level");
  }
  if (provided < required_level) {
    throw backend_error(
        "MPI provides " + detail::mpi_thread_level_name(provided) + " but dtrain needs " +
            detail::mpi_thread_level_name(required_level) +
            (owned_ ? "; use an MPI built with thread support"
                    : "; initialise MPI with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...)"),
        provided);
  }
}

DTRAIN_DETAIL_INLINE mpi_environment::~mpi_environment() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owned_ && !finalized && std::uncaught_exceptions() <= unwinding_) MPI_Finalize();
}

DTRAIN_DETAIL_INLINE bool mpi_environment::cuda_aware() noexcept {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}
#endif  // DTRAIN_DETAIL_BODIES()

/// A communicator over MPI. Host memory always; device memory (compiled when
/// CUDA is available) staged through pooled pinned host blocks: copied out
/// after the work queued on the caller's stream, reduced by MPI, copied back
/// before the work completes. With mpi_options::cuda_aware_direct and a
/// CUDA-aware MPI, device pointers go to MPI's blocking collectives instead.
/// float16 and bfloat16 reduce through dtrain's own MPI_Op (MPI has no such
/// types): converted to float, reduced, rounded back at each step.
class mpi_communicator {
 public:
  static constexpr std::string_view name = "mpi";
  static constexpr bool reaches_device_memory = DTRAIN_HAS_CUDA() != 0;
  static constexpr bool reaches_host_memory = true;

  /// Every process of MPI_COMM_WORLD (initialising MPI if nobody has).
  static mpi_communicator world(mpi_options options = {});

  /// Wraps a duplicate of `comm` (MPI already initialised by the caller).
  static mpi_communicator from(MPI_Comm comm, mpi_options options = {});

  mpi_communicator(mpi_communicator&& other) noexcept
      : env_(std::move(other.env_)),
        comm_(std::exchange(other.comm_, MPI_COMM_NULL)),
        rank_(other.rank_),
        size_(other.size_),
        options_(other.options_),
        ring_(std::move(other.ring_)),
        ops_(std::exchange(other.ops_, no_ops())),
        health_(std::move(other.health_)),
        staging_(std::move(other.staging_)) {}
  mpi_communicator& operator=(mpi_communicator&&) = delete;
  mpi_communicator(const mpi_communicator&) = delete;
  mpi_communicator& operator=(const mpi_communicator&) = delete;
  ~mpi_communicator();

  /// -1 and 0 for a rank that split() left out (negative color).
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  /// False when moved from, or when split() left this rank out.
  [[nodiscard]] bool valid() const noexcept { return comm_ != MPI_COMM_NULL; }
  [[nodiscard]] MPI_Comm native() const noexcept { return comm_; }
  /// This communicator's last collectives, for desync diagnostics.
  [[nodiscard]] std::shared_ptr<detail::collective_ring> ring() const noexcept { return ring_; }

  /// Pinned host bytes this communicator holds for staging device buffers
  /// (in use and free for reuse); 0 without CUDA.
  [[nodiscard]] std::size_t staging_bytes() const;

  // Device buffers: `stream` is the caller's stream whose work produced the
  // input (null: the legacy default stream). The host waits for it before MPI
  // reads the data; the output is on the device when the work completes.

  work allreduce(buffer in, buffer out, reduce_op op, stream_handle stream = nullptr);

  work broadcast(buffer data, int root, stream_handle stream = nullptr);

  work allgather(buffer in, buffer out, stream_handle stream = nullptr);

  work reduce_scatter(buffer in, buffer out, reduce_op op, stream_handle stream = nullptr);

  work barrier();

  /// The ranks with the same color, ordered by key (then by rank). Collective.
  /// A negative color leaves this rank out (MPI_UNDEFINED): it gets a
  /// communicator with valid() false (see the `communicator` concept).
  mpi_communicator split(int color, int key);

 private:
  struct health {
    bool broken = false;
    bool abandoned = false;     // a request was given up while MPI may still progress it
    detail::failure_cause why;  // the first failure (recorded without allocating)
  };

  // How device buffers travel (CUDA builds): the pinned pool, and whether the
  // MPI takes device pointers itself (mpi_options::cuda_aware_direct).
  struct staging {
#if DTRAIN_HAS_CUDA()
    detail::pinned_pool pool;
#endif
    bool direct = false;
  };

  // One outstanding MPI request, with the staging and the avg division it needs when done.
  struct request : detail::work_state {
    request(const detail::collective_info& what, std::chrono::milliseconds timeout,
            std::shared_ptr<health> h, std::shared_ptr<staging> st)
        : work_state(what, timeout), health_(std::move(h)), staging_(std::move(st)) {}
    ~request() override;

    /// Chooses where MPI reads and writes: the user's buffers (host memory;
    /// device memory when the MPI takes it directly and no host arithmetic is
    /// needed), or pooled pinned copies of device buffers, filled once the
    /// work queued on `stream` is done. Host arithmetic: avg's division and
    /// the 16-bit floats' MPI_Op.
    void stage([[maybe_unused]] buffer in, buffer out, [[maybe_unused]] bool host_math,
               [[maybe_unused]] stream_handle stream);

    bool poll() override;

    void on_timeout() noexcept override { abandon(); }

    // MPI cannot cancel a collective: the communicator is unusable from now on.
    // Allocates nothing (a timeout hook, and the destructor, call it).
    void abandon() noexcept;

    MPI_Request req = MPI_REQUEST_NULL;
    buffer src{}, dst{}, user_out{};
    int divide_by = 0;
    int device = -1;      // of the staged device buffers
    bool staged = false;  // src/dst are pinned blocks from the pool
    bool direct = false;  // device pointers to a blocking call: complete at launch
    bool finished = false;
    bool abandoned = false;

   private:
    struct block {
      void* data = nullptr;
      std::size_t bytes = 0;
    };
#if DTRAIN_HAS_CUDA()
    void* take(std::size_t bytes, block& b) {
      b.data = staging_->pool.take(bytes);
      b.bytes = bytes;
      return b.data;
    }
#endif
    // Blocks go back to the pool for the next call (never while MPI may still
    // write into them: an abandoned request keeps them).
    void release_staging() noexcept;
    block src_block, dst_block;
    std::shared_ptr<health> health_;
    std::shared_ptr<staging> staging_;
  };

  // Every collective, in this order: a left-out rank fails first; then the
  // argument checks every engine shares; a broken communicator; the ring's
  // number (check mode: every rank's signature compared); staging (device
  // buffers through pinned host memory, and the avg division on completion);
  // last the engine's call, `submit(request, what)`, unless nothing moves.
  template <class Submit>
  work collective(const detail::collective_call& call, stream_handle stream, Submit&& submit) {
    const detail::collective_info what = call.info(name, rank_, size_);
    if (!valid()) detail::throw_invalid(detail::describe(what), rank_ < 0);
    detail::check_arguments(call, what, detail::memory_reach{});
    usable(what);
    const std::int64_t seq = verify(what);
    auto w = std::make_shared<request>(what, options_.collectives.timeout, health_, staging_);
    w->track(ring_, seq);
    const bool avg = call.op == static_cast<int>(reduce_op::avg);
    // avg's division and the 16-bit floats' MPI_Op run on the host.
    w->stage(call.in, call.out, avg || (call.op >= 0 && !native(call.out.type)), stream);
    w->divide_by = avg ? size_ : 0;
    if (call.moves_data()) submit(*w, what);
    return work(std::move(w));
  }

  mpi_communicator(std::shared_ptr<mpi_environment> env, MPI_Comm base, mpi_options options);

  // A left-out (or moved-from) communicator: what split() returns to a rank
  // that passed a negative color.
  mpi_communicator(std::shared_ptr<mpi_environment> env, mpi_options options)
      : env_(std::move(env)),
        rank_(-1),
        size_(0),
        options_(std::move(options)),
        health_(std::make_shared<health>()),
        staging_(std::make_shared<staging>()) {}

  template <class What>
  void usable(const What& what) const {
    if (health_->broken) {
      throw backend_error(
          detail::what_text(what) + ": this MPI communicator is unusable since " +
              health_->why.text() +
              " (MPI cannot cancel a collective); end the job, or continue only on other "
              "communicators",
          0);
    }
  }

  static int count(const buffer& b, const detail::collective_info& what);

  // Whether MPI reduces the type itself (the 16-bit floats go through dtrain's MPI_Op).
  static bool native(dtype t) noexcept { return t != dtype::float16 && t != dtype::bfloat16; }

  static MPI_Datatype datatype(dtype t);

  template <class T, reduce_op Op>
  static void reduce_16bit(void* in, void* inout, int* len, MPI_Datatype*) {
    detail::reduce_host<T>(static_cast<T*>(inout), static_cast<const T*>(in),
                           static_cast<std::size_t>(*len), Op);
  }

  MPI_Op mpi_op(reduce_op op, dtype t);

  // Numbers the collective in the ring; check mode: every rank passed the same call, count, type,
  // op/root.
  std::int64_t verify(const detail::collective_info& info);

  std::shared_ptr<mpi_environment> env_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  mpi_options options_;
  std::shared_ptr<detail::collective_ring> ring_ = std::make_shared<detail::collective_ring>();
  // MPI_OP_NULL is not a null pointer in every MPI (Open MPI: an object's address).
  static std::array<MPI_Op, 8> no_ops() noexcept;
  std::array<MPI_Op, 8> ops_ = no_ops();
  std::shared_ptr<health> health_;
  std::shared_ptr<staging> staging_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE mpi_communicator mpi_communicator::world(mpi_options options) {
  auto env =
      std::make_shared<mpi_environment>(options.required_thread_level, options.tune_open_mpi);
  return mpi_communicator(std::move(env), MPI_COMM_WORLD, std::move(options));
}

DTRAIN_DETAIL_INLINE mpi_communicator mpi_communicator::from(MPI_Comm comm, mpi_options options) {
  auto env = std::make_shared<mpi_environment>(options.required_thread_level);
  return mpi_communicator(std::move(env), comm, std::move(options));
}

DTRAIN_DETAIL_INLINE mpi_communicator::~mpi_communicator() {
  int finalized = 1;
  MPI_Finalized(&finalized);
  if (finalized) return;
  for (MPI_Op& op : ops_) {
    if (op != MPI_OP_NULL) MPI_Op_free(&op);
  }
  // A request given up after a timeout may still be progressed by MPI: keep
  // the communicator allocated for it (a deliberate leak of a dead communicator).
  if (comm_ != MPI_COMM_NULL && !(health_ && health_->abandoned)) MPI_Comm_free(&comm_);
}

DTRAIN_DETAIL_INLINE std::size_t mpi_communicator::staging_bytes() const {
#if DTRAIN_HAS_CUDA()
  return staging_->pool.held_bytes();
#else
  return 0;
#endif
}

DTRAIN_DETAIL_INLINE work mpi_communicator::allreduce(buffer in, buffer out, reduce_op op,
                                                      stream_handle stream) {
  return collective(
      detail::collective_call::allreduce(in, out, op), stream,
      [&](request& w, const detail::collective_info& what) {
        const void* send = w.src.data == w.dst.data ? MPI_IN_PLACE : w.src.data;
        if (w.direct) {
          DTRAIN_MPI_CHECK(MPI_Allreduce(send, w.dst.data, count(out, what), datatype(out.type),
                                         mpi_op(op, out.type), comm_),
                           what);
        } else {
          DTRAIN_MPI_CHECK(MPI_Iallreduce(send, w.dst.data, count(out, what), datatype(out.type),
                                          mpi_op(op, out.type), comm_, &w.req),
                           what);
        }
      });
}

DTRAIN_DETAIL_INLINE work mpi_communicator::broadcast(buffer data, int root, stream_handle stream) {
  return collective(
      detail::collective_call::broadcast(data, root), stream,
      [&](request& w, const detail::collective_info& what) {
        if (w.direct) {
          DTRAIN_MPI_CHECK(
              MPI_Bcast(w.dst.data, count(data, what), datatype(data.type), root, comm_), what);
        } else {
          DTRAIN_MPI_CHECK(
              MPI_Ibcast(w.dst.data, count(data, what), datatype(data.type), root, comm_, &w.req),
              what);
        }
      });
}

DTRAIN_DETAIL_INLINE work mpi_communicator::allgather(buffer in, buffer out, stream_handle stream) {
  return collective(detail::collective_call::allgather(in, out), stream,
                    [&](request& w, const detail::collective_info& what) {
                      const int n = count(in, what);
                      if (w.direct) {
                        DTRAIN_MPI_CHECK(MPI_Allgather(w.src.data, n, datatype(in.type), w.dst.data,
                                                       n, datatype(in.type), comm_),
                                         what);
                      } else {
                        DTRAIN_MPI_CHECK(
                            MPI_Iallgather(w.src.data, n, datatype(in.type), w.dst.data, n,
                                           datatype(in.type), comm_, &w.req),
                            what);
                      }
                    });
}

DTRAIN_DETAIL_INLINE work mpi_communicator::reduce_scatter(buffer in, buffer out, reduce_op op,
                                                           stream_handle stream) {
  return collective(
      detail::collective_call::reduce_scatter(in, out, op), stream,
      [&](request& w, const detail::collective_info& what) {
        if (w.direct) {
          DTRAIN_MPI_CHECK(
              MPI_Reduce_scatter_block(w.src.data, w.dst.data, count(out, what), datatype(out.type),
                                       mpi_op(op, out.type), comm_),
              what);
        } else {
          DTRAIN_MPI_CHECK(
              MPI_Ireduce_scatter_block(w.src.data, w.dst.data, count(out, what),
                                        datatype(out.type), mpi_op(op, out.type), comm_, &w.req),
              what);
        }
      });
}

DTRAIN_DETAIL_INLINE work mpi_communicator::barrier() {
  return collective(detail::collective_call::barrier(), nullptr,
                    [&](request& w, const detail::collective_info& what) {
                      DTRAIN_MPI_CHECK(MPI_Ibarrier(comm_, &w.req), what);
                    });
}

DTRAIN_DETAIL_INLINE mpi_communicator mpi_communicator::split(int color, int key) {
  auto what =
      detail::describe("split", "color " + std::to_string(color) + ", key " + std::to_string(key),
                       rank_, size_, name);
  if (!valid()) detail::throw_invalid(what, rank_ < 0);
  usable(what);
  MPI_Comm child = MPI_COMM_NULL;
  DTRAIN_MPI_CHECK(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &child), what);
  if (child == MPI_COMM_NULL) return mpi_communicator(env_, options_);
  mpi_communicator out(env_, child, options_);
  out.ring_ = ring_->make_child(color);
  MPI_Comm_free(&child);  // `out` holds its own duplicate
  return out;
}

DTRAIN_DETAIL_INLINE mpi_communicator::request::~request() {
  int finalized = 1;
  MPI_Finalized(&finalized);
  if (req != MPI_REQUEST_NULL && !finalized && !abandoned) {
    // A handle dropped before completion: MPI still writes into the
    // buffers, so finish it, for at most the timeout, rather than leave
    // MPI holding freed memory.
    auto deadline = std::chrono::steady_clock::now() + timeout();
    int flag = 0;
    while (!flag && MPI_Test(&req, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS &&
           std::chrono::steady_clock::now() < deadline) {
    }
    if (!flag) abandon();
  }
  if (!abandoned) release_staging();  // an abandoned request may still write into them
}

DTRAIN_DETAIL_INLINE void mpi_communicator::request::stage([[maybe_unused]] buffer in, buffer out,
                                                           [[maybe_unused]] bool host_math,
                                                           [[maybe_unused]] stream_handle stream) {
  user_out = out;
  src = in;
  dst = out;
#if DTRAIN_HAS_CUDA()
  if (out.where != memory::device) return;
  try {
    device = out.device;
    if (device < 0) DTRAIN_CUDA_CHECK(cudaGetDevice(&device));
    detail::device_guard on(device);
    if (staging_->direct && !host_math) {
      direct = true;  // MPI reads the device memory now: the caller's work first
      DTRAIN_CUDA_CHECK(cudaStreamSynchronize(stream));
      return;
    }
    staged = true;
    const bool same = in.data == out.data;
    dst.data = take(out.bytes(), dst_block);
    dst.where = memory::host;
    src.data = same ? dst.data : take(in.bytes(), src_block);
    src.where = memory::host;
    if (in.bytes() > 0) {
      DTRAIN_CUDA_CHECK(cudaMemcpyAsync(src.data, in.data, in.bytes(), cudaMemcpyDefault, stream));
      DTRAIN_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
  } catch (const backend_error& e) {
    throw backend_error(
        description() + ": staging the device buffer through pinned host memory: " + e.what(),
        e.engine_code());
  }
#endif
}

DTRAIN_DETAIL_INLINE bool mpi_communicator::request::poll() {
  if (finished) return true;
  if (req != MPI_REQUEST_NULL) {
    int flag = 0;
    int rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      fail(std::make_exception_ptr(
          backend_error(description() + ": " + detail::mpi_error_text(rc), rc)));
      health_->broken = true;
      health_->why.set(info(), "failed");
      finished = true;
      return true;
    }
    if (!flag) return false;
  }
  try {
    if (divide_by > 0) detail::divide_host(dst, divide_by);
#if DTRAIN_HAS_CUDA()
    if (staged && user_out.bytes() > 0) {
      detail::device_guard on(device);
      cudaStream_t copy = staging_->pool.copy_stream(device);
      DTRAIN_CUDA_CHECK(
          cudaMemcpyAsync(user_out.data, dst.data, user_out.bytes(), cudaMemcpyDefault, copy));
      DTRAIN_CUDA_CHECK(cudaStreamSynchronize(copy));
    }
#endif
  } catch (const backend_error& e) {
    fail(std::make_exception_ptr(backend_error(
        description() + ": copying the result back to the device: " + e.what(), e.engine_code())));
  } catch (...) {
    fail(std::current_exception());
  }
  release_staging();
  finished = true;
  return true;
}

DTRAIN_DETAIL_INLINE void mpi_communicator::request::abandon() noexcept {
  abandoned = true;
  health_->abandoned = true;
  health_->broken = true;
  health_->why.set(info(), "timed out");
}

DTRAIN_DETAIL_INLINE void mpi_communicator::request::release_staging() noexcept {
#if DTRAIN_HAS_CUDA()
  staging_->pool.give(std::exchange(src_block.data, nullptr), src_block.bytes);
  staging_->pool.give(std::exchange(dst_block.data, nullptr), dst_block.bytes);
#endif
}

DTRAIN_DETAIL_INLINE mpi_communicator::mpi_communicator(std::shared_ptr<mpi_environment> env,
                                                        MPI_Comm base, mpi_options options)
    : env_(std::move(env)),
      options_(std::move(options)),
      health_(std::make_shared<health>()),
      staging_(std::make_shared<staging>()) {
  if (options_.cuda_aware_direct) {
    if (!DTRAIN_HAS_CUDA() || !mpi_environment::cuda_aware()) {
      throw config_error(
          "mpi_options::cuda_aware_direct is set, but " +
          std::string(DTRAIN_HAS_CUDA()
                          ? "this MPI is not CUDA-aware (MPIX_Query_cuda_support() is not 1)"
                          : "dtrain is built without CUDA") +
          ": unset it, and device buffers are staged through pinned host memory");
    }
    staging_->direct = true;
  }
  DTRAIN_MPI_CHECK(MPI_Comm_dup(base, &comm_), "duplicating the MPI communicator");
  DTRAIN_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "setting MPI_ERRORS_RETURN");
  DTRAIN_MPI_CHECK(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  DTRAIN_MPI_CHECK(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
}

DTRAIN_DETAIL_INLINE int mpi_communicator::count(const buffer& b,
                                                 const detail::collective_info& what) {
  if (b.count > static_cast<std::size_t>(INT_MAX)) {
    throw config_error(detail::describe(what) + ": " + std::to_string(b.count) +
                       " elements exceed MPI's int count; split the buffer");
  }
  return static_cast<int>(b.count);
}

DTRAIN_DETAIL_INLINE MPI_Datatype mpi_communicator::datatype(dtype t) {
  switch (t) {
    case dtype::float32: return MPI_FLOAT;
    case dtype::float64: return MPI_DOUBLE;
    case dtype::int32: return MPI_INT32_T;
    case dtype::int64: return MPI_INT64_T;
    case dtype::uint8: return MPI_UINT8_T;
    case dtype::float16:
    case dtype::bfloat16: return MPI_UINT16_T;  // reduced by dtrain's own MPI_Op
  }
  return MPI_DATATYPE_NULL;
}

DTRAIN_DETAIL_INLINE MPI_Op mpi_communicator::mpi_op(reduce_op op, dtype t) {
  if (t != dtype::float16 && t != dtype::bfloat16) {
    switch (op) {
      case reduce_op::sum:
      case reduce_op::avg: return MPI_SUM;
      case reduce_op::min: return MPI_MIN;
      case reduce_op::max: return MPI_MAX;
      case reduce_op::prod: return MPI_PROD;
    }
  }
  // Custom ops for the 16-bit floats, created on first use: [type][sum, min, max, prod].
  const std::size_t slot = (t == dtype::bfloat16 ? 4u : 0u) + (op == reduce_op::min    ? 1u
                                                               : op == reduce_op::max  ? 2u
                                                               : op == reduce_op::prod ? 3u
                                                                                       : 0u);
  if (ops_[slot] == MPI_OP_NULL) {
    static MPI_User_function* const functions[8] = {
        &reduce_16bit<float16, reduce_op::sum>,  &reduce_16bit<float16, reduce_op::min>,
        &reduce_16bit<float16, reduce_op::max>,  &reduce_16bit<float16, reduce_op::prod>,
        &reduce_16bit<bfloat16, reduce_op::sum>, &reduce_16bit<bfloat16, reduce_op::min>,
        &reduce_16bit<bfloat16, reduce_op::max>, &reduce_16bit<bfloat16, reduce_op::prod>};
    DTRAIN_MPI_CHECK(MPI_Op_create(functions[slot], 1, &ops_[slot]),
                     "creating the 16-bit float MPI_Op");
  }
  return ops_[slot];
}

DTRAIN_DETAIL_INLINE std::int64_t mpi_communicator::verify(const detail::collective_info& info) {
  const std::int64_t sequence = detail::record(*ring_, info);
  if (!options_.collectives.check) return sequence;
  detail::compare_signatures(
      detail::signature_of(sequence, info), rank_, size_, info,
      [&](std::span<const std::int64_t> in, std::span<std::int64_t> out) {
        DTRAIN_MPI_CHECK(MPI_Allgather(in.data(), static_cast<int>(in.size()), MPI_INT64_T,
                                       out.data(), static_cast<int>(in.size()), MPI_INT64_T, comm_),
                         detail::describe(info) + " (check mode)");
      });
  return sequence;
}

DTRAIN_DETAIL_INLINE std::array<MPI_Op, 8> mpi_communicator::no_ops() noexcept {
  std::array<MPI_Op, 8> ops;
  ops.fill(MPI_OP_NULL);
  return ops;
}
#endif  // DTRAIN_DETAIL_BODIES()

static_assert(communicator<mpi_communicator>);

namespace detail {

/// An MPI broadcast from `root` over `comm` as broadcast_or_fail's channel
/// (rendezvous/broadcast.hpp), usable before any store exists: the message's
/// length, then its bytes, so no rank guesses a buffer size. Every rank of
/// `comm` calls it. MPI errors are reported only where `comm` returns them
/// (MPI_ERRORS_RETURN, as on every communicator dtrain creates).
class mpi_relay {
 public:
  explicit mpi_relay(MPI_Comm comm, int root = 0);

  void carry(std::string& message, const std::string& what);
  [[nodiscard]] int root() const noexcept { return root_; }
  [[nodiscard]] bool is_root() const noexcept { return rank_ == root_; }
  [[nodiscard]] std::string where() const {
    return "rank " + std::to_string(root_) + "'s MPI broadcast";
  }

 private:
  static constexpr std::uint64_t max_length = std::uint64_t{1} << 20;
  MPI_Comm comm_;
  int root_;
  int rank_ = -1;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE mpi_relay::mpi_relay(MPI_Comm comm, int root) : comm_(comm), root_(root) {
  DTRAIN_MPI_CHECK(MPI_Comm_rank(comm_, &rank_),
                   "MPI_Comm_rank for a broadcast from rank " + std::to_string(root));
}

DTRAIN_DETAIL_INLINE void mpi_relay::carry(std::string& message, const std::string& what) {
  std::uint64_t length = message.size();
  DTRAIN_MPI_CHECK(MPI_Bcast(&length, 1, MPI_UINT64_T, root_, comm_), what);
  if (length > max_length) {
    throw backend_error(what + ": rank " + std::to_string(root_) + " sent a value of " +
                            std::to_string(length) + " bytes, more than the 1 MiB allowed",
                        0);
  }
  message.resize(static_cast<std::size_t>(length));
  if (length > 0) {
    DTRAIN_MPI_CHECK(MPI_Bcast(message.data(), static_cast<int>(length), MPI_BYTE, root_, comm_),
                     what);
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail

}  // namespace dtrain

#endif  // DTRAIN_HAS_MPI()
// ---- end dtrain/backend/mpi.hpp ----
// ---- begin dtrain/backend/nccl.hpp ----
/// @file
/// The NCCL backend: `nccl_communicator` runs collectives on device memory, on
/// a CUDA stream of its own that is ordered after the caller's stream with
/// events. Host C++ only (nccl.h and the CUDA runtime API): g++ builds it, and
/// so does nvcc. Compiles to nothing unless DTRAIN_HAS_NCCL().

// ---- begin dtrain/backend/nccl_engine.hpp ----
/// @file
/// NCCL as the nccl backend drives it: its options, the mapping of dtrain's
/// types and ops onto NCCL's, where it finds buffers, and the state a
/// communicator shares with its work handles (the NCCL communicator, its
/// stream, scratch memory, whether and why it was aborted, the in-flight
/// bound). The calls go through the runtime `Api` (nccl_library.hpp: the
/// seam, and DTRAIN_NCCL_CHECK). `basic_nccl_communicator` itself is in
/// nccl.hpp. Everything NCCL compiles to nothing unless DTRAIN_HAS_NCCL().

// ---- begin dtrain/backend/nccl_library.hpp ----
/// @file
/// NCCL as one narrow seam: DTRAIN_NCCL_CHECK, and `nccl_library`, every
/// CUDA and NCCL call the NCCL engine makes as static members of the same
/// names. The engine's classes (nccl_engine.hpp, nccl.hpp) take such a
/// runtime as their template argument `Api`: this one in production, a host
/// fake in the tests of NCCL at several ranks (tests/engines/fake_nccl.hpp).
/// Compiles to nothing unless DTRAIN_HAS_NCCL().


#include <cstddef>
#include <string>

#if DTRAIN_HAS_NCCL()
#include <cuda_runtime.h>
#include <nccl.h>

namespace dtrain::detail {

/// "NCCL call `ncclAllReduce(...)` failed: invalid usage (...); NCCL's last
/// error: ... (ncclResult_t 5, at file:line)".
DTRAIN_DETAIL_INLINE std::string nccl_error_text(ncclResult_t code, const char* call,
                                                 const char* file, int line);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string nccl_error_text(ncclResult_t code, const char* call,
                                                 const char* file, int line) {
  std::string text =
      "NCCL call `" + call_as_written(call) + "` failed: " + ncclGetErrorString(code);
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && *last != '\0') text += std::string("; NCCL's last error: ") + last;
  return text + " (ncclResult_t " + std::to_string(static_cast<int>(code)) + ", at " + file + ":" +
         std::to_string(line) + ")";
}
#endif  // DTRAIN_DETAIL_BODIES()

[[noreturn]] inline void throw_nccl_error(ncclResult_t code, const char* call, const char* file,
                                          int line) {
  throw backend_error(nccl_error_text(code, call, file, line), static_cast<int>(code));
}

}  // namespace dtrain::detail

/// Evaluates `call` (an NCCL function) and yields its ncclResult_t. Throws
/// dtrain::backend_error with the call as written, file:line, NCCL's error
/// string and last error, and the code (backend_error::engine_code()), unless
/// the result is ncclSuccess or ncclInProgress (a non-blocking communicator
/// still working in the background: poll ncclCommGetAsyncError).
#define DTRAIN_NCCL_CHECK(call)                                                           \
  ([&]() -> ncclResult_t {                                                                \
    const ncclResult_t dtrain_nccl_status_ = (call);                                      \
    if (dtrain_nccl_status_ != ncclSuccess && dtrain_nccl_status_ != ncclInProgress)      \
      ::dtrain::detail::throw_nccl_error(dtrain_nccl_status_, #call, __FILE__, __LINE__); \
    return dtrain_nccl_status_;                                                           \
  }())

namespace dtrain::detail {

/// The NCCL calls the engine makes, with the CUDA runtime's (cuda_library):
/// the seam that tests replace with a host fake (tests/engines/fake_nccl.hpp).
/// Each member is the NCCL function of the same name and signature; error
/// texts (ncclGetErrorString, ncclGetLastError) are not part of the seam.
struct nccl_library : cuda_library {
  static ncclResult_t ncclGetUniqueId(ncclUniqueId* id) { return ::ncclGetUniqueId(id); }
  static ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int size, ncclUniqueId id, int rank,
                                             ncclConfig_t* config) {
    return ::ncclCommInitRankConfig(comm, size, id, rank, config);
  }
  static ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
    return ::ncclCommGetAsyncError(comm, state);
  }
  static ncclResult_t ncclCommAbort(ncclComm_t comm) { return ::ncclCommAbort(comm); }
  static ncclResult_t ncclCommFinalize(ncclComm_t comm) { return ::ncclCommFinalize(comm); }
  static ncclResult_t ncclCommDestroy(ncclComm_t comm) { return ::ncclCommDestroy(comm); }
  static ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* out,
                                    ncclConfig_t* config) {
    return ::ncclCommSplit(comm, color, key, out, config);
  }
  static ncclResult_t ncclCommUserRank(ncclComm_t comm, int* rank) {
    return ::ncclCommUserRank(comm, rank);
  }
  static ncclResult_t ncclCommCount(ncclComm_t comm, int* count) {
    return ::ncclCommCount(comm, count);
  }
  static ncclResult_t ncclAllReduce(const void* in, void* out, std::size_t count,
                                    ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                    cudaStream_t stream) {
    return ::ncclAllReduce(in, out, count, type, op, comm, stream);
  }
  static ncclResult_t ncclBroadcast(const void* in, void* out, std::size_t count,
                                    ncclDataType_t type, int root, ncclComm_t comm,
                                    cudaStream_t stream) {
    return ::ncclBroadcast(in, out, count, type, root, comm, stream);
  }
  static ncclResult_t ncclAllGather(const void* in, void* out, std::size_t count,
                                    ncclDataType_t type, ncclComm_t comm, cudaStream_t stream) {
    return ::ncclAllGather(in, out, count, type, comm, stream);
  }
  static ncclResult_t ncclReduceScatter(const void* in, void* out, std::size_t count,
                                        ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                        cudaStream_t stream) {
    return ::ncclReduceScatter(in, out, count, type, op, comm, stream);
  }
  static ncclResult_t ncclGroupStart() { return ::ncclGroupStart(); }
  static ncclResult_t ncclGroupEnd() { return ::ncclGroupEnd(); }
};

}  // namespace dtrain::detail

#endif  // DTRAIN_HAS_NCCL()
// ---- end dtrain/backend/nccl_library.hpp ----

#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace dtrain {

/// Default limit for creating an NCCL communicator (ncclCommInitRankConfig,
/// ncclCommSplit): every rank must have joined by then. Environment:
/// DTRAIN_NCCL_INIT_TIMEOUT (seconds).
inline constexpr std::chrono::milliseconds default_nccl_init_timeout{300'000};

/// Default store key of the NCCL unique id.
inline constexpr std::string_view default_nccl_store_key = "nccl/unique_id";

/// Options of an NCCL communicator. Aggregate: use designated initialisers,
/// `{.collectives = {.timeout = 30s}, .init_timeout = 60s}`.
struct nccl_options {
  /// Collective timeout (work::wait() without an argument; also bounds the
  /// destructor's wait) and check mode.
  collective_options collectives{};
  /// Limit for ncclCommInitRankConfig and ncclCommSplit.
  std::chrono::milliseconds init_timeout = default_nccl_init_timeout;
  /// NCCL's blocking mode. Off (the default), dtrain polls NCCL, so that init
  /// and enqueueing time out too; on, only completion can time out. NCCL's own
  /// NCCL_COMM_BLOCKING overrides either.
  bool blocking = false;
  /// How many collectives the host may enqueue ahead of the oldest one the
  /// device has not finished: the next one waits for it (at most the
  /// collective timeout, then timeout_error and abort), so that a dead peer
  /// stops the host within a bounded number of steps instead of letting it
  /// queue work for ever. At least 1.
  int max_in_flight = 64;
  /// Where rank 0 publishes the unique id. Must differ for every communicator
  /// made from one store: give each job and restart round its own
  /// prefix_store, or each communicator its own key. split() needs no store.
  std::string store_key{default_nccl_store_key};
  /// CUDA_VISIBLE_DEVICES as the job's environment set it (with_env() fills
  /// it), for the message when a rank wants a device it cannot see.
  std::optional<std::string> cuda_visible_devices{};

  /// These options with DTRAIN_NCCL_INIT_TIMEOUT, DTRAIN_COLLECTIVE_TIMEOUT and
  /// DTRAIN_CHECK_COLLECTIVES applied on top, and CUDA_VISIBLE_DEVICES kept.
  /// Throws config_error naming the variable and its value when one is malformed.
  [[nodiscard]] nccl_options with_env(const environment& env) const;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE nccl_options nccl_options::with_env(const environment& env) const {
  nccl_options out = *this;
  out.collectives = collectives.with_env(env);
  if (auto t = detail::read_seconds(env, nccl_init_timeout_variable)) out.init_timeout = *t;
  if (auto v = env.get("CUDA_VISIBLE_DEVICES")) out.cuda_visible_devices = std::string(*v);
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain

#if DTRAIN_HAS_NCCL()
#include <cuda_runtime.h>
#include <nccl.h>

namespace dtrain::detail {

/// NCCL's name for each element type; all seven are native.
[[nodiscard]] constexpr ncclDataType_t nccl_type(dtype t) noexcept {
  switch (t) {
    case dtype::float32: return ncclFloat32;
    case dtype::float64: return ncclFloat64;
    case dtype::float16: return ncclFloat16;
    case dtype::bfloat16: return ncclBfloat16;
    case dtype::int32: return ncclInt32;
    case dtype::int64: return ncclInt64;
    case dtype::uint8: return ncclUint8;
  }
  return ncclFloat32;
}

/// NCCL's op for each reduction over `ranks` ranks; avg is ncclAvg (NCCL
/// divides, in the type), except on one rank, where the mean is the input and
/// ncclSum gives it: NCCL 2.28.3's one-rank ncclAvg left every element from
/// the 2^20th on unwritten out of place (seen on an H100).
[[nodiscard]] constexpr ncclRedOp_t nccl_op(reduce_op op, int ranks) noexcept {
  switch (op) {
    case reduce_op::sum: return ncclSum;
    case reduce_op::avg: return ranks == 1 ? ncclSum : ncclAvg;
    case reduce_op::min: return ncclMin;
    case reduce_op::max: return ncclMax;
    case reduce_op::prod: return ncclProd;
  }
  return ncclSum;
}

/// Prefixes an engine error with the operation it interrupted (once).
[[nodiscard]] DTRAIN_DETAIL_INLINE backend_error nccl_with_context(const std::string& what,
                                                                   const backend_error& e);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE backend_error nccl_with_context(const std::string& what,
                                                     const backend_error& e) {
  if (std::string_view(e.what()).starts_with(what)) return e;
  return backend_error(what + ": " + e.what(), e.engine_code());
}
#endif  // DTRAIN_DETAIL_BODIES()

// What a new communicator's rank, size and device must be, before any CUDA or NCCL call.

DTRAIN_DETAIL_INLINE void nccl_check_rank(int rank, int size);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void nccl_check_rank(int rank, int size) {
  if (size < 1)
    throw config_error("NCCL communicator size " + std::to_string(size) + " is not at least 1");
  if (rank < 0 || rank >= size) {
    throw config_error("NCCL rank " + std::to_string(rank) + " is not in 0.." +
                       std::to_string(size - 1) + " (size " + std::to_string(size) + ")");
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

DTRAIN_DETAIL_INLINE void nccl_check_placement(int rank, int size, int device);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void nccl_check_placement(int rank, int size, int device) {
  nccl_check_rank(rank, size);
  if (device < 0) {
    throw config_error("CUDA device " + std::to_string(device) + " of NCCL rank " +
                       std::to_string(rank) + " is negative; pass the local rank");
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Where NCCL's collectives find their buffers (check_arguments).
inline constexpr memory_reach nccl_memory{
    .host = false,
    .device = true,
    .rule =
        "NCCL reduces device memory only: pass GPU memory (device_span, or a buffer with where "
        "= memory::device), or reduce host data with the mpi or gloo backend"};

/// The id rank 0 put in the store. Throws rendezvous_error if it is not one.
[[nodiscard]] DTRAIN_DETAIL_INLINE ncclUniqueId nccl_unique_id_from(const std::string& value,
                                                                    std::string_view key);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE ncclUniqueId nccl_unique_id_from(const std::string& value,
                                                      std::string_view key) {
  ncclUniqueId id{};
  if (value.size() != sizeof id.internal) {
    throw rendezvous_error("the value under store key \"" + std::string(key) + "\" has " +
                           std::to_string(value.size()) + " bytes, but an NCCL unique id has " +
                           std::to_string(sizeof id.internal) +
                           ": something else wrote that key; give each communicator its own key "
                           "(nccl_options::store_key) or prefix_store");
  }
  value.copy(id.internal, sizeof id.internal);
  return id;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Checks that `device` exists, then makes it current. `visible` is
/// CUDA_VISIBLE_DEVICES as the job's environment set it, for the message.
template <class Api>
void nccl_select_device(int device, int rank, int size, const std::optional<std::string>& visible) {
  int count = 0;
  if (const cudaError_t found = Api::cudaGetDeviceCount(&count); found != cudaSuccess) {
    (void)Api::cudaGetLastError();
    throw backend_error(
        "no usable CUDA device: " +
            cuda_error_text(found, "cudaGetDeviceCount(&count)", __FILE__, __LINE__) +
            "; NCCL needs a GPU and its driver (does nvidia-smi list one?)",
        static_cast<int>(found));
  }
  if (device >= count) {
    throw config_error(
        "NCCL rank " + std::to_string(rank) + " of " + std::to_string(size) +
        " wants CUDA device " + std::to_string(device) + ", but this process sees " +
        std::to_string(count) + " (CUDA_VISIBLE_DEVICES=" + visible.value_or("<unset>") +
        "); pass the local rank, and start no more ranks on a node than it has GPUs");
  }
  DTRAIN_CUDA_CHECK(Api::cudaSetDevice(device));
}

DTRAIN_DETAIL_INLINE std::string nccl_seconds(std::chrono::milliseconds t);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string nccl_seconds(std::chrono::milliseconds t) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", static_cast<double>(t.count()) / 1000.0);
  return text;
}
#endif  // DTRAIN_DETAIL_BODIES()

inline constexpr std::string_view nccl_timeout_hint =
    "a peer is slow, dead or called a different collective (DTRAIN_CHECK_COLLECTIVES=1 compares "
    "what every "
    "rank passed)";

/// Polling back-off for work the GPU finishes: sleeps grow to 1 ms.
struct nccl_backoff : backoff {
  nccl_backoff() : backoff{.longest = std::chrono::microseconds(1000)} {}
};

/// Whether everything on `stream` has finished; throws backend_error on a CUDA error.
template <class Api>
[[nodiscard]] bool nccl_stream_idle(cudaStream_t stream) {
  const cudaError_t e = Api::cudaStreamQuery(stream);
  if (e == cudaErrorNotReady) return false;
  if (e != cudaSuccess) throw_cuda_error(e, "cudaStreamQuery(stream)", __FILE__, __LINE__);
  return true;
}

/// Whether `event` has completed; throws backend_error on a CUDA error.
template <class Api>
[[nodiscard]] bool nccl_event_done(cudaEvent_t event) {
  const cudaError_t e = Api::cudaEventQuery(event);
  if (e == cudaErrorNotReady) return false;
  if (e != cudaSuccess) throw_cuda_error(e, "cudaEventQuery(event)", __FILE__, __LINE__);
  return true;
}

/// What a communicator and its work handles share: the NCCL communicator, its
/// stream and scratch memory, and whether (and why) it was aborted.
///
/// Locking: `mutex` guards dtrain's bookkeeping only (the handle `comm`, the
/// abort state) and is never held across a CUDA or NCCL call that can block.
/// The thread that issues collectives takes the handle under the lock, makes
/// its calls without it, and checks `aborted` again after every call returns
/// (call()). An abort (a timeout on a watchdog thread, abort(), an NCCL error
/// seen by any poll) takes the handle under the lock and calls ncclCommAbort
/// outside it, so that it never waits for the thread it is meant to free: a
/// thread blocked inside an enqueue (a full launch queue, a peer that never
/// connects) is released by the abort, as NCCL's abort flag intends and as
/// PyTorch's watchdog does. Quick queries (ncclCommGetAsyncError) run under
/// the lock, so that an abort cannot free the communicator under them.
template <class Api>
struct nccl_shared {
  // Set before anyone else can see this state, and then only read:
  int rank = 0;
  int size = 0;
  int device = 0;
  nccl_options options{};
  basic_cuda_stream<Api> stream;         // every collective runs here
  void* scratch = nullptr;               // device: the check table, then the barrier word
  std::int64_t* device_table = nullptr;  // check mode: signature::fields int64 per rank
  std::int64_t* barrier_word = nullptr;
  ncclComm_t split_slot = nullptr;  // ncclCommSplit writes the child here when it completes

  std::mutex mutex;
  ncclComm_t comm = nullptr;  // null once aborted (and before it exists)
  bool aborted = false;
  bool abort_timed_out = false;  // the abort came from a timeout: later calls say timeout_error
  failure_cause abort_reason;    // recorded without allocating (abort() and timeouts are noexcept)
  int abort_code = 0;

  nccl_shared() = default;
  nccl_shared(const nccl_shared&) = delete;
  nccl_shared& operator=(const nccl_shared&) = delete;

  /// The stream and scratch memory of a communicator on the current device; `comm` comes later.
  [[nodiscard]] static std::shared_ptr<nccl_shared> create(int rank, int size, int device,
                                                           nccl_options options) {
    if (options.max_in_flight < 1) {
      throw config_error("nccl_options::max_in_flight is " + std::to_string(options.max_in_flight) +
                         " on NCCL rank " + std::to_string(rank) + "; it must be at least 1");
    }
    auto s = std::make_shared<nccl_shared>();
    s->rank = rank;
    s->size = size;
    s->device = device;
    s->options = std::move(options);
    s->stream = basic_cuda_stream<Api>::non_blocking();
    const std::size_t words = signature::fields * static_cast<std::size_t>(size) + 1;
    DTRAIN_CUDA_CHECK(Api::cudaMalloc(&s->scratch, words * sizeof(std::int64_t)));
    s->device_table = static_cast<std::int64_t*>(s->scratch);
    s->barrier_word = s->device_table + signature::fields * static_cast<std::size_t>(size);
    return s;
  }

  [[nodiscard]] ncclConfig_t config() const noexcept {
    ncclConfig_t out = NCCL_CONFIG_INITIALIZER;
    out.blocking = options.blocking ? 1 : 0;
    return out;
  }

  /// Pinned host memory for the check table (allocated on first use).
  std::int64_t* host_table() {
    if (!host_table_)
      DTRAIN_CUDA_CHECK(Api::cudaMallocHost(
          reinterpret_cast<void**>(&host_table_),
          signature::fields * static_cast<std::size_t>(size) * sizeof(std::int64_t)));
    return host_table_;
  }

  /// Makes `engine_call(comm)` (one CUDA or NCCL call, or a few that form one
  /// step) without holding the lock: throws if the communicator was aborted
  /// before, and again if it was aborted while the call ran (another thread's
  /// abort is what frees a call that blocked). `what` names the operation.
  template <class What, class Call>
  void call(const What& what, Call&& engine_call) {
    ncclComm_t handle = nullptr;
    {
      std::lock_guard lock(mutex);
      throw_if_aborted(what);
      handle = comm;
    }
    try {
      engine_call(handle);
    } catch (const backend_error&) {
      check_not_aborted(what);  // a call an abort interrupted fails as the abort says
      throw;
    }
    check_not_aborted(what);
  }

  /// Throws what throw_if_aborted throws, taking the lock.
  template <class What>
  void check_not_aborted(const What& what) {
    std::lock_guard lock(mutex);
    throw_if_aborted(what);
  }

  /// NCCL's asynchronous state: ncclSuccess, ncclInProgress (still
  /// enqueueing or initialising), or an error. Call with `mutex` held.
  [[nodiscard]] ncclResult_t async_state() const noexcept {
    if (!comm) return ncclSuccess;
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = Api::ncclCommGetAsyncError(comm, &state);
    return r != ncclSuccess ? r : state;
  }

  /// Throws, when the communicator was aborted, timeout_error (the abort
  /// came from a timeout) or backend_error, naming `what` and the first
  /// reason. Call with `mutex` held.
  template <class What>
  void throw_if_aborted(const What& what) const {
    if (!aborted) return;
    std::string text =
        what_text(what) + ": the communicator was aborted (" + abort_reason.text() +
        "); its collectives cannot run any more: create a new communicator (restart the job)";
    if (abort_timed_out) throw timeout_error(text);
    throw backend_error(text, abort_code);
  }

  /// ncclCommAbort, once, from any thread, without waiting for a thread that
  /// is inside a CUDA or NCCL call; later calls see `aborted`, `abort_code`
  /// and the first reason, `why`: what failure_cause::set takes (a text moved
  /// in, a collective and how it ended, what was done on which rank).
  /// Allocates nothing, as abort() and the timeout hook need. Call WITHOUT
  /// `mutex` held.
  template <class... Why>
  void abort(int code, bool timed_out, Why&&... why) noexcept {
    ncclComm_t handle = nullptr;
    {
      std::lock_guard lock(mutex);
      handle = std::exchange(comm, nullptr);
      if (!aborted) {
        aborted = true;
        abort_timed_out = timed_out;
        abort_code = code;
        abort_reason.set(std::forward<Why>(why)...);
      }
    }
    if (handle) {
      basic_device_guard<Api> guard(device, std::nothrow);
      (void)Api::ncclCommAbort(handle);
    }
  }

  /// Polls until NCCL is idle (not in progress) and `finished()` holds. An
  /// NCCL error aborts and throws backend_error; running past `limit` aborts
  /// and throws timeout_error, with `hint` for the person reading it; an
  /// abort by another thread throws what throw_if_aborted does. Takes the
  /// lock for each look at NCCL's state only; `finished()` runs without it.
  /// `what` names the operation (what_text()), put into words only on failure.
  template <class What, class Finished>
  void wait(const What& what, std::chrono::milliseconds limit, std::string_view hint,
            Finished&& finished) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    nccl_backoff pause;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      {
        std::lock_guard lock(mutex);
        throw_if_aborted(what);
        state = async_state();
      }
      if (state != ncclSuccess && state != ncclInProgress) {
        std::string why = what_text(what) + " failed: NCCL reports " + async_text(state);
        abort(static_cast<int>(state), false, std::string(why));
        throw backend_error(why, static_cast<int>(state));
      }
      if (state == ncclSuccess && finished()) return;
      if (std::chrono::steady_clock::now() >= deadline) {
        std::string why = what_text(what) + " did not finish within " + nccl_seconds(limit);
        abort(0, true, std::string(why));
        throw timeout_error(why + "; " + std::string(hint) + ". The communicator is aborted");
      }
      pause();
    }
  }

  [[nodiscard]] static std::string async_text(ncclResult_t state) {
    std::string text = ncclGetErrorString(state);
    const char* last = ncclGetLastError(nullptr);
    if (last != nullptr && *last != '\0') text += std::string("; NCCL's last error: ") + last;
    return text + " (ncclResult_t " + std::to_string(static_cast<int>(state)) + ")";
  }

  /// Before the issuing thread enqueues a collective: when max_in_flight
  /// collectives are still unfinished on the device, waits (the collective
  /// timeout at most) for the oldest of them. With the fence recorded after
  /// the enqueue (fenced()), the host runs at most max_in_flight collectives
  /// ahead of the device. Issuing thread only.
  template <class What>
  void make_room(const What& what) {
    const auto slots = static_cast<std::size_t>(options.max_in_flight);
    if (fences_.size() < slots) return;  // a fence is made per slot as collectives are issued
    cudaEvent_t oldest = fences_[issued_ % slots];
    wait(
        [&] {
          return what_text(what) + " (waiting for the collective enqueued " +
                 std::to_string(slots) +
                 " before it: at most nccl_options::max_in_flight = " + std::to_string(slots) +
                 " unfinished)";
        },
        options.collectives.timeout, nccl_timeout_hint,
        [&] { return nccl_event_done<Api>(oldest); });
  }

  /// After the issuing thread enqueued a collective: records its fence.
  void fenced() {
    const auto slots = static_cast<std::size_t>(options.max_in_flight);
    if (fences_.size() < slots) {
      fences_.reserve(slots);
      fences_.push_back(basic_cuda_event<Api>::create().release());
    }
    cudaEvent_t fence = fences_[issued_ % slots];
    DTRAIN_CUDA_CHECK(Api::cudaEventRecord(fence, stream.get()));
    ++issued_;
  }

  /// A completion event from the pool (created on the current device when the
  /// pool is empty). The pool makes room for every event it hands out, so that
  /// release_event() never allocates.
  [[nodiscard]] cudaEvent_t acquire_event() {
    std::lock_guard lock(events_mutex_);
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
    free_events_.reserve(events_made_ + 1);
    cudaEvent_t e = basic_cuda_event<Api>::create().release();
    ++events_made_;
    return e;
  }

  /// Returns an event to the pool. A stream that waited on it keeps the point
  /// it waited for, so it can be recorded again at once. Allocates nothing:
  /// the pool holds at most the events made, and has room for them all.
  void release_event(cudaEvent_t e) noexcept {
    std::lock_guard lock(events_mutex_);
    free_events_.push_back(e);
  }

  /// Lets the collectives finish (at most the collective timeout), then
  /// ncclCommFinalize + ncclCommDestroy; ncclCommAbort when they do not, and
  /// at once while an exception unwinds (a peer may be gone: waiting could
  /// take the whole timeout). An aborted communicator has nothing left.
  ~nccl_shared() {
    basic_device_guard<Api> guard(device, std::nothrow);
    if (comm && std::uncaught_exceptions() > 0) {
      (void)Api::ncclCommAbort(comm);
      comm = nullptr;
    }
    if (comm) {
      const auto deadline = std::chrono::steady_clock::now() + options.collectives.timeout;
      // Finalize only a communicator that is idle and healthy; anything else is aborted.
      bool clean = settle(deadline, [&] {
        const cudaError_t e = Api::cudaStreamQuery(stream.get());
        return e == cudaSuccess         ? settled::done
               : e == cudaErrorNotReady ? settled::pending
                                        : settled::failed;
      });
      clean = clean && async_state() == ncclSuccess;
      if (clean) {
        const ncclResult_t r = Api::ncclCommFinalize(comm);
        clean = (r == ncclSuccess || r == ncclInProgress) && settle(deadline, [&] {
                  const ncclResult_t state = async_state();
                  return state == ncclSuccess      ? settled::done
                         : state == ncclInProgress ? settled::pending
                                                   : settled::failed;
                });
      }
      if (clean) {
        (void)Api::ncclCommDestroy(comm);
      } else {
        (void)Api::ncclCommAbort(comm);
      }
      comm = nullptr;
    }
    if (host_table_) (void)Api::cudaFreeHost(host_table_);
    if (scratch) (void)Api::cudaFree(scratch);
    for (cudaEvent_t e : free_events_) (void)Api::cudaEventDestroy(e);
    for (cudaEvent_t e : fences_) (void)Api::cudaEventDestroy(e);
  }

 private:
  enum class settled { done, pending, failed };

  // Polls `query` until it is done (true), fails, or the deadline passes (false).
  template <class Query>
  static bool settle(std::chrono::steady_clock::time_point deadline, Query query) noexcept {
    nccl_backoff pause;
    for (;;) {
      const settled state = query();
      if (state == settled::done) return true;
      if (state == settled::failed || std::chrono::steady_clock::now() >= deadline) return false;
      try {
        pause();
      } catch (...) {
        return false;
      }
    }
  }

  std::int64_t* host_table_ = nullptr;
  std::mutex events_mutex_;
  std::vector<cudaEvent_t> free_events_;  // capacity >= events_made_
  std::size_t events_made_ = 0;
  std::vector<cudaEvent_t> fences_;  // the issuing thread's: one per slot of max_in_flight
  std::size_t issued_ = 0;           // collectives fenced so far
};

/// An event from the pool for one scope (or released to a work).
template <class Api>
class nccl_pooled_event {
 public:
  explicit nccl_pooled_event(nccl_shared<Api>& shared)
      : shared_(shared), event_(shared.acquire_event()) {}
  nccl_pooled_event(const nccl_pooled_event&) = delete;
  nccl_pooled_event& operator=(const nccl_pooled_event&) = delete;
  ~nccl_pooled_event() {
    if (event_) shared_.release_event(event_);
  }
  [[nodiscard]] cudaEvent_t get() const noexcept { return event_; }
  [[nodiscard]] cudaEvent_t release() noexcept { return std::exchange(event_, nullptr); }

 private:
  nccl_shared<Api>& shared_;
  cudaEvent_t event_;
};

/// One collective in flight: done when its completion event is; failed when
/// NCCL reports an asynchronous error (the communicator is then aborted, as
/// NCCL asks) or the communicator was aborted.
template <class Api>
class nccl_work final : public work_state {
 public:
  nccl_work(const collective_info& what, std::chrono::milliseconds timeout,
            std::shared_ptr<nccl_shared<Api>> shared, cudaEvent_t done)
      : work_state(what, timeout), shared_(std::move(shared)), done_(done) {}
  ~nccl_work() override { shared_->release_event(done_); }

  // Runs on any thread that waits (the watchdog's included): the CUDA calls
  // go to the communicator's device, never to a context on GPU 0. The lock is
  // held for NCCL's error state only, never across the event query.
  bool poll() override {
    ncclResult_t state = ncclSuccess;
    {
      std::lock_guard lock(shared_->mutex);
      if (shared_->aborted) {
        std::string text = description() + " did not complete: the communicator was aborted (" +
                           shared_->abort_reason.text() + ")";
        if (shared_->abort_timed_out) {
          fail(std::make_exception_ptr(timeout_error(text)));
        } else {
          fail(std::make_exception_ptr(backend_error(text, shared_->abort_code)));
        }
        return true;
      }
      state = shared_->async_state();
    }
    if (state != ncclSuccess && state != ncclInProgress) {
      std::string why =
          description() + " failed: NCCL reports " + nccl_shared<Api>::async_text(state);
      shared_->abort(static_cast<int>(state), false, std::string(why));
      fail(std::make_exception_ptr(backend_error(why, static_cast<int>(state))));
      return true;
    }
    basic_device_guard<Api> guard(shared_->device, std::nothrow);
    const cudaError_t e = Api::cudaEventQuery(done_);
    if (e == cudaErrorNotReady) return false;
    if (e != cudaSuccess) {
      (void)Api::cudaGetLastError();
      fail(std::make_exception_ptr(backend_error(
          description() + " failed on the device: " + cudaGetErrorName(e) + ": " +
              cudaGetErrorString(e) + " (cudaError_t " + std::to_string(static_cast<int>(e)) + ")",
          static_cast<int>(e))));
    }
    return true;
  }

  // Called by whoever waited (a watchdog thread included): aborts at once,
  // without waiting for a thread that may be blocked inside an NCCL call.
  void on_timeout() noexcept override { shared_->abort(0, true, info(), "timed out"); }

 private:
  std::shared_ptr<nccl_shared<Api>> shared_;
  cudaEvent_t done_;
};

}  // namespace dtrain::detail

#endif  // DTRAIN_HAS_NCCL()
// ---- end dtrain/backend/nccl_engine.hpp ----
// ---- begin dtrain/rendezvous/broadcast.hpp ----
/// @file
/// broadcast_or_fail: one rank produces a value that every rank needs to
/// start (the store's address, the store token, an NCCL unique id), and every
/// rank returns it; or, when that rank fails to produce it, every rank fails
/// at once with that rank's own message instead of waiting out a timeout for
/// a value that never comes. The channel (a relay) is the caller's: a key of
/// the store (store_relay, here), or an MPI broadcast before any store exists
/// (backend/mpi.hpp's mpi_relay). The message is a wire::outcome, whatever
/// the channel.


#include <chrono>
#include <concepts>
#include <exception>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

namespace dtrain::detail {

/// What carries broadcast_or_fail's message: `carry(message, what)` sends
/// `message` on the root and replaces it with the root's on every other rank
/// (`what` names the broadcast in the channel's own errors); `root()` is the
/// producing rank, `is_root()` whether this is it, and `where()` names the
/// channel in errors ("store key dtrain/job/nccl/unique_id").
template <class R>
concept broadcast_relay = requires(R& r, std::string& message, const std::string& what) {
  r.carry(message, what);
  { r.root() } -> std::convertible_to<int>;
  { r.is_root() } -> std::convertible_to<bool>;
  { r.where() } -> std::convertible_to<std::string>;
};

/// A key of the store as broadcast_or_fail's channel: the root sets it, every
/// other rank gets it, waiting at most the store's timeout. Give each value
/// its own key: the key is never erased (a late rank still finds it).
///
/// A root that failed may host the store (rank 0 under per-process launch):
/// when it exits, its failure goes with it, and a rank that had not read it
/// yet hears only that the store is gone. So after carrying a failure, the
/// root waits until the `size - 1` others have read it (each counts itself
/// under "<key>/failure_read"), at most `linger`.
template <store Store>
class store_relay {
 public:
  static constexpr std::chrono::milliseconds default_linger{10'000};

  store_relay(Store& store, std::string key, int rank, int size, int root = 0,
              std::chrono::milliseconds linger = default_linger)
      : store_(store),
        key_(std::move(key)),
        rank_(rank),
        size_(size),
        root_(root),
        linger_(linger) {}
  void carry(std::string& message, const std::string& /*what*/) {
    if (is_root()) {
      store_.set(key_, message);
    } else {
      message = store_.get(key_);
    }
  }
  /// On a rank other than the root that read the root's failure.
  void failure_read() { (void)store_.add(read_key(), 1); }
  /// On the root, after carrying its failure: waits for the others to read it
  /// (at most `linger`). Never throws: the root's own failure is what counts.
  void failure_carried() noexcept {
    try {
      const auto deadline = std::chrono::steady_clock::now() + linger_;
      while (store_.add(read_key(), 0) < size_ - 1 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    } catch (...) {
      // The store is gone or failing: nobody can read the failure any more.
    }
  }
  [[nodiscard]] int root() const noexcept { return root_; }
  [[nodiscard]] bool is_root() const noexcept { return rank_ == root_; }
  [[nodiscard]] std::string where() const { return "store key \"" + key_ + "\""; }

 private:
  [[nodiscard]] std::string read_key() const { return key_ + "/failure_read"; }

  Store& store_;
  std::string key_;
  int rank_;
  int size_;
  int root_;
  std::chrono::milliseconds linger_;
};

/// Rank `relay.root()` calls `produce()` (which returns the value as a
/// std::string) and every rank returns that value. Every rank calls it, as a
/// collective, whatever it holds.
///
/// When `produce()` throws, the root sends its message in place of the value
/// and then rethrows its own exception, unchanged; every other rank throws
/// rendezvous_error "rank R could not provide <what>: <R's message>". A
/// message that is not a wire::outcome is a rendezvous_error naming `where()`
/// and `what`; a failure of the channel itself (the store's timeout, an MPI
/// error) propagates, except on a root that has failed already, which throws
/// its own failure.
template <broadcast_relay Relay, class Produce>
[[nodiscard]] std::string broadcast_or_fail(Relay&& relay, std::string_view what,
                                            Produce&& produce) {
  const std::string about(what);
  std::string message;
  std::exception_ptr failure;
  if (relay.is_root()) {
    try {
      message = wire::outcome{true, std::forward<Produce>(produce)()}.encode();
    } catch (...) {
      failure = std::current_exception();
      message = wire::outcome{false, current_failure().second}.encode();
    }
  }
  try {
    relay.carry(message, "broadcasting " + about);
  } catch (...) {
    if (failure) std::rethrow_exception(failure);
    throw;
  }
  if (failure) {
    // A relay that can say so lets the root stay until the others have read its failure.
    if constexpr (requires { relay.failure_carried(); }) relay.failure_carried();
    std::rethrow_exception(failure);
  }
  wire::outcome got = wire::outcome::decode(relay.where(), message, about);
  if (!got.ok) {
    if constexpr (requires { relay.failure_read(); }) {
      try {
        relay.failure_read();
      } catch (...) {
        // The root's message is what this rank reports, whatever the channel does now.
      }
    }
    throw rendezvous_error("rank " + std::to_string(relay.root()) + " could not provide " + about +
                           ": " + got.text);
  }
  return std::move(got.text);
}

}  // namespace dtrain::detail
// ---- end dtrain/rendezvous/broadcast.hpp ----

#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if DTRAIN_HAS_NCCL()
#include <cuda_runtime.h>
#include <nccl.h>

namespace dtrain {

namespace detail {
/// An id's bytes as broadcast_or_fail carries them; nccl_unique_id_from reads them back.
inline std::string nccl_unique_id_text(const ncclUniqueId& id) {
  return std::string(id.internal, sizeof id.internal);
}
/// What creating a communicator is called in its errors.
DTRAIN_DETAIL_INLINE std::string nccl_creating(int rank, int size, int device);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string nccl_creating(int rank, int size, int device) {
  return "creating the NCCL communicator of rank " + std::to_string(rank) + " of " +
         std::to_string(size) + " on CUDA device " + std::to_string(device);
}
#endif  // DTRAIN_DETAIL_BODIES()
/// Checks `device` and makes it current, as creating the communicator does
/// (and with the same errors).
template <class Api>
void nccl_claim_device(int rank, int size, int device, const std::optional<std::string>& visible) {
  nccl_check_placement(rank, size, device);
  try {
    nccl_select_device<Api>(device, rank, size, visible);
  } catch (const backend_error& e) {
    throw nccl_with_context(nccl_creating(rank, size, device), e);
  }
}

/// Where a rank's GPU is, as the check that no two ranks share one compares it.
struct nccl_gpu {
  std::string uuid;  ///< "GPU-...", as nvidia-smi -L prints it
  std::string pci_bus;
  std::string host;
  int device = -1;      ///< the CUDA ordinal this rank used
  std::string visible;  ///< its CUDA_VISIBLE_DEVICES, or "<unset>"

  [[nodiscard]] std::string encode() const;
  [[nodiscard]] static nccl_gpu decode(std::string_view where, std::string_view value);
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string nccl_gpu::encode() const {
  std::string out;
  wire::writer(out).bytes32(uuid).bytes32(pci_bus).bytes32(host).i64(device).bytes32(visible);
  return out;
}

DTRAIN_DETAIL_INLINE nccl_gpu nccl_gpu::decode(std::string_view where, std::string_view value) {
  return wire::decode_value(where, value, "a rank's GPU", [](wire::reader& r) {
    nccl_gpu g;
    g.uuid = std::string(r.bytes32("the GPU's UUID"));
    g.pci_bus = std::string(r.bytes32("its PCI bus id"));
    g.host = std::string(r.bytes32("the host name"));
    g.device = static_cast<int>(r.i64("the CUDA device"));
    g.visible = std::string(r.bytes32("CUDA_VISIBLE_DEVICES"));
    return g;
  });
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The first two ranks of `gpus` (indexed by rank) on one GPU, as a
/// config_error's text; empty when every rank has its own.
DTRAIN_DETAIL_INLINE std::string nccl_shared_gpu_problem(const std::vector<nccl_gpu>& gpus);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string nccl_shared_gpu_problem(const std::vector<nccl_gpu>& gpus) {
  for (std::size_t a = 0; a < gpus.size(); ++a) {
    for (std::size_t b = a + 1; b < gpus.size(); ++b) {
      if (gpus[a].uuid != gpus[b].uuid) continue;
      auto as = [&](std::size_t r) {
        return "rank " + std::to_string(r) + " as CUDA device " + std::to_string(gpus[r].device) +
               " (CUDA_VISIBLE_DEVICES=" + gpus[r].visible + ")";
      };
      return "ranks " + std::to_string(a) + " and " + std::to_string(b) + " on host " +
             gpus[a].host + " both use GPU " + gpus[a].uuid + " (PCI bus " + gpus[a].pci_bus +
             "): " + as(a) + ", " + as(b) +
             "; NCCL needs a GPU of its own for every rank: start no more ranks on a node than it "
             "has GPUs, and give each its own device (the local rank, or a CUDA_VISIBLE_DEVICES "
             "of its own)";
    }
  }
  return {};
}
#endif  // DTRAIN_DETAIL_BODIES()
}  // namespace detail

/// A group of ranks, one CUDA device each, that runs NCCL collectives.
///
/// Every collective takes device buffers (a host buffer is a config_error) and
/// an optional `stream` of the caller's (default 0, the default stream as the
/// calling translation unit sees it). It is enqueued on this communicator's own
/// non-blocking stream after everything already on `stream`, and returns at
/// once with a work handle whose test() / wait() poll a completion event and
/// NCCL's asynchronous error state. The caller's stream does not wait for the
/// result: call `stream_wait(stream)` (no host block) or `work.wait()` (host
/// block) before using it. A wait that times out aborts the communicator
/// (ncclCommAbort): later calls throw backend_error, and work still on the
/// device for it is lost; create a new communicator (in practice: restart).
///
/// Check mode (options.collectives.check, DTRAIN_CHECK_COLLECTIVES=1): before
/// each collective the ranks gather what each passed (operation, count, type,
/// op or root) with an unchecked ncclAllGather of 4 int64 per rank through
/// device scratch memory, and the host waits for it (within the collective
/// timeout). A difference throws backend_error on every rank, naming the first
/// rank that differs, and the collective does not run. allreduce_many is
/// compared as one call (op, total elements, first type).
///
/// Use one communicator from one thread at a time, like NCCL's own; work
/// handles may be tested and waited on from any thread. Not for CUDA graph
/// capture. Move-only.
template <class Api>
class basic_nccl_communicator {
 public:
  static constexpr bool reaches_device_memory = true;
  /// NCCL reads and writes GPU memory only: host data goes over the host control plane.
  static constexpr bool reaches_host_memory = false;
  static constexpr std::string_view name = "nccl";
  /// Collectives are enqueued on stream(), ordered after the caller's stream:
  /// a topology can enqueue the steps of one collective at once, each after the last.
  static constexpr bool stream_ordered = true;

  /// Creates the communicator of `rank` of `size` on CUDA `device` (normally
  /// the local rank; it becomes the calling thread's current device). Rank 0
  /// selects its device and creates the NCCL unique id, and sets it in `store`
  /// under `options.store_key` (broadcast_or_fail); the others get it, waiting
  /// as long as the store's timeout allows. Then ncclCommInitRankConfig,
  /// non-blocking, waited for at most `options.init_timeout`.
  ///
  /// Before NCCL starts, every rank publishes which GPU it has (UUID, PCI
  /// bus id, host) and rank 0 compares them: two ranks on one GPU are a
  /// config_error on every rank that names the GPU, both ranks and their
  /// CUDA_VISIBLE_DEVICES (NCCL would refuse them later, or run them slowly).
  ///
  /// Throws config_error for a bad rank, size or device, and for a GPU
  /// shared by two ranks; timeout_error (the store's, or the init's) when a
  /// rank does not show up; rendezvous_error for a malformed id in the
  /// store, and on every other rank at once when rank 0 cannot select its
  /// device or create the id (with rank 0's own message); backend_error for
  /// CUDA and NCCL failures.
  template <store Store>
  basic_nccl_communicator(Store& store, int rank, int size, int device, nccl_options options = {})
      // `options` is copied, not moved: the arguments are evaluated in no set order.
      // Rank 0 claims its device first: if it has none, nobody waits for its id.
      : basic_nccl_communicator(meet(store, rank, size, device, options), rank, size, device,
                                options) {}

  /// Creates the communicator from an id every rank already has (from
  /// new_unique_id() on one rank, shared by any means: broadcast_nccl_unique_id
  /// under MPI). Throws as the constructor above.
  basic_nccl_communicator(const ncclUniqueId& id, int rank, int size, int device,
                          nccl_options options = {})
      : rank_(rank), size_(size) {
    detail::nccl_claim_device<Api>(rank, size, device, options.cuda_visible_devices);
    const std::string what = detail::nccl_creating(rank, size, device);
    try {
      auto s = detail::nccl_shared<Api>::create(rank, size, device, std::move(options));
      ncclConfig_t config = s->config();
      try {
        DTRAIN_NCCL_CHECK(Api::ncclCommInitRankConfig(&s->comm, size, id, rank, &config));
      } catch (...) {
        if (s->comm) (void)Api::ncclCommAbort(s->comm);
        s->comm = nullptr;
        throw;
      }
      // Non-blocking: NCCL connects the ranks in the background; a rank that
      // never comes would otherwise hang this call for ever.
      s->wait(what, s->options.init_timeout,
              "every rank must start and reach the others' network "
              "interfaces (NCCL_SOCKET_IFNAME); NCCL_DEBUG=INFO shows where it stopped",
              [] { return true; });
      shared_ = std::move(s);
    } catch (const backend_error& e) {
      throw detail::nccl_with_context(what, e);
    }
  }

  basic_nccl_communicator(basic_nccl_communicator&&) noexcept = default;
  basic_nccl_communicator& operator=(basic_nccl_communicator&&) noexcept = default;
  basic_nccl_communicator(const basic_nccl_communicator&) = delete;
  basic_nccl_communicator& operator=(const basic_nccl_communicator&) = delete;
  /// Waits for this communicator's collectives (at most the collective
  /// timeout, then aborts), then ncclCommFinalize + ncclCommDestroy. Work
  /// handles still alive keep the communicator alive until they go.
  ~basic_nccl_communicator() = default;

  /// A new NCCL unique id (ncclGetUniqueId; needs no GPU). Throws backend_error.
  [[nodiscard]] static ncclUniqueId new_unique_id() {
    ncclUniqueId id{};
    DTRAIN_NCCL_CHECK(Api::ncclGetUniqueId(&id));
    return id;
  }

  /// Rank 0 calls `prepare()`, creates an id and sets it under `key`; every
  /// other rank gets it (the store's timeout applies). When rank 0 fails (in
  /// `prepare`, or creating the id), it sets its error under `key` instead
  /// and throws it; every other rank throws rendezvous_error at once, with
  /// rank 0's message (broadcast_or_fail, rendezvous/broadcast.hpp). Throws
  /// config_error for a bad rank, rendezvous_error for a value that is not an
  /// id, and what the store throws.
  template <store Store, class Prepare = void (*)()>
  [[nodiscard]] static ncclUniqueId exchange_unique_id(
      Store& store, int rank, int size, std::string_view key = default_nccl_store_key,
      Prepare&& prepare = [] {}) {
    detail::nccl_check_rank(rank, size);
    const std::string value = detail::broadcast_or_fail(
        detail::store_relay<Store>(store, std::string(key), rank, size), "the NCCL unique id", [&] {
          prepare();
          return detail::nccl_unique_id_text(new_unique_id());
        });
    return detail::nccl_unique_id_from(value, key);
  }

  /// -1 and 0 for a rank that split() left out (negative color).
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  /// False when moved from, or when split() left this rank out.
  [[nodiscard]] bool valid() const noexcept { return shared_ != nullptr; }
  [[nodiscard]] int device() const noexcept { return shared_ ? shared_->device : -1; }
  /// The stream every collective runs on (to order more work after them on the device).
  [[nodiscard]] cudaStream_t stream() const noexcept {
    return shared_ ? shared_->stream.get() : nullptr;
  }
  /// The NCCL communicator, for calls dtrain does not wrap (and benchmarks against the raw engine).
  [[nodiscard]] ncclComm_t native_handle() const noexcept {
    if (!shared_) return nullptr;
    std::lock_guard lock(shared_->mutex);
    return shared_->comm;
  }
  /// Whether a timeout, an engine error or abort() ended this communicator.
  [[nodiscard]] bool aborted() const {
    if (!shared_) return false;
    std::lock_guard lock(shared_->mutex);
    return shared_->aborted;
  }

  /// ncclCommAbort now: pending collectives end (their work fails) and every
  /// later call throws. For a rank that learns a peer is gone, or that failed
  /// itself (run() does this when the training function throws). Safe from
  /// any thread, while another is inside a collective: it does not wait for
  /// that call, which the abort ends.
  void abort() noexcept {
    if (!shared_) return;
    shared_->abort(0, false, "abort() was called", rank_);
  }

  /// In place or out of place (`in` and `out` may be the same buffer): `out`
  /// becomes the reduction over all ranks of `in`. avg is ncclAvg.
  work allreduce(buffer in, buffer out, reduce_op op, cudaStream_t stream = nullptr) {
    return collective(detail::collective_call::allreduce(in, out, op), stream,
                      [&](ncclComm_t comm, cudaStream_t own) {
                        DTRAIN_NCCL_CHECK(Api::ncclAllReduce(
                            in.data, out.data, in.count, detail::nccl_type(in.type),
                            detail::nccl_op(op, size_), comm, own));
                      });
  }

  /// `data` on every rank becomes root's.
  work broadcast(buffer data, int root, cudaStream_t stream = nullptr) {
    return collective(
        detail::collective_call::broadcast(data, root), stream,
        [&](ncclComm_t comm, cudaStream_t own) {
          DTRAIN_NCCL_CHECK(Api::ncclBroadcast(data.data, data.data, data.count,
                                               detail::nccl_type(data.type), root, comm, own));
        });
  }

  /// `out` (size() × in.count elements) becomes every rank's `in`, in rank
  /// order. In place when `in` is this rank's block of `out`.
  work allgather(buffer in, buffer out, cudaStream_t stream = nullptr) {
    return collective(detail::collective_call::allgather(in, out), stream,
                      [&](ncclComm_t comm, cudaStream_t own) {
                        DTRAIN_NCCL_CHECK(Api::ncclAllGather(
                            in.data, out.data, in.count, detail::nccl_type(in.type), comm, own));
                      });
  }

  /// `in` (size() × out.count elements) is reduced over ranks; rank r gets block r in `out`.
  work reduce_scatter(buffer in, buffer out, reduce_op op, cudaStream_t stream = nullptr) {
    return collective(detail::collective_call::reduce_scatter(in, out, op), stream,
                      [&](ncclComm_t comm, cudaStream_t own) {
                        DTRAIN_NCCL_CHECK(Api::ncclReduceScatter(
                            in.data, out.data, out.count, detail::nccl_type(out.type),
                            detail::nccl_op(op, size_), comm, own));
                      });
  }

  /// Completes once every rank has reached it (and this rank's earlier
  /// collectives, and its work on `stream` before the call, are done): an
  /// allreduce of one int on the device.
  work barrier(cudaStream_t stream = nullptr) {
    return collective(
        detail::collective_call::barrier(), stream, [&](ncclComm_t comm, cudaStream_t own) {
          std::int64_t* word = shared_->barrier_word;
          DTRAIN_NCCL_CHECK(Api::ncclAllReduce(word, word, 1, ncclInt32, ncclSum, comm, own));
        });
  }

  /// Reduces each buffer in place, in one NCCL group (ncclGroupStart/End):
  /// one launch for many buffers, one work for all. Buffers may differ in type.
  /// Check mode compares the op, the number of elements and the first type.
  work allreduce_many(std::span<const buffer> buffers, reduce_op op,
                      cudaStream_t stream = nullptr) {
    return collective(detail::collective_call::allreduce_many(buffers, op), stream,
                      [&](ncclComm_t comm, cudaStream_t own) {
                        DTRAIN_NCCL_CHECK(Api::ncclGroupStart());
                        try {
                          for (const buffer& b : buffers) {
                            if (b.count == 0) continue;
                            DTRAIN_NCCL_CHECK(Api::ncclAllReduce(
                                b.data, b.data, b.count, detail::nccl_type(b.type),
                                detail::nccl_op(op, size_), comm, own));
                          }
                        } catch (...) {
                          (void)Api::ncclGroupEnd();  // a group left open would swallow this
                                                      // thread's next NCCL calls
                          throw;
                        }
                        DTRAIN_NCCL_CHECK(Api::ncclGroupEnd());
                      });
  }

  /// Makes `stream` wait, on the device and without blocking the host, for
  /// every collective enqueued on this communicator so far.
  void stream_wait(cudaStream_t stream) {
    const auto what = [this] { return describe("stream_wait", ""); };  // on failure only
    detail::nccl_shared<Api>& s = usable(what);
    try {
      detail::basic_device_guard<Api> guard(s.device);
      detail::nccl_pooled_event<Api> done(s);
      s.call(what, [&](ncclComm_t) {
        DTRAIN_CUDA_CHECK(Api::cudaEventRecord(done.get(), s.stream.get()));
        DTRAIN_CUDA_CHECK(Api::cudaStreamWaitEvent(stream, done.get(), 0));
      });
    } catch (const backend_error& e) {
      throw detail::nccl_with_context(what(), e);
    }
  }

  /// ncclCommSplit: ranks passing the same `color` form a communicator, ordered
  /// by `key` (then by rank here). A negative color leaves this rank out: it
  /// gets a communicator with valid() false. Collective over this communicator;
  /// waits for this communicator's collectives first (NCCL requires it), and
  /// for the split itself at most options().init_timeout.
  [[nodiscard]] basic_nccl_communicator split(int color, int key) {
    const std::string what =
        describe("split", "color " + std::to_string(color) + ", key " + std::to_string(key));
    detail::nccl_shared<Api>& s = usable(what);
    s.check_not_aborted(what);
    // Numbered in the ring like any collective (as Gloo's split), so that check
    // mode and the desync table name it alike.
    const detail::collective_info call{
        "split", name, rank_, size_, 0, static_cast<std::uint8_t>(dtype::int32), -1, -1};
    const detail::signature sig = detail::signature_of(detail::record(*ring_, call), call);
    auto settle = [&](detail::call_state state) { ring_->settle(sig.seq, state); };
    try {
      detail::basic_device_guard<Api> guard(s.device);
      if (s.options.collectives.check) check_signature(s, sig, what);
      s.wait(what + " (waiting for earlier collectives)", s.options.collectives.timeout,
             detail::nccl_timeout_hint,
             [&] { return detail::nccl_stream_idle<Api>(s.stream.get()); });
      // The child's stream and scratch exist before the child does, so that no
      // failure can strand a live NCCL communicator.
      auto child = detail::nccl_shared<Api>::create(0, s.size, s.device, s.options);
      ncclConfig_t config = s.config();
      s.split_slot =
          nullptr;  // written by NCCL when the split completes, maybe after the call returns
      s.call(what, [&](ncclComm_t comm) {
        DTRAIN_NCCL_CHECK(Api::ncclCommSplit(comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key,
                                             &s.split_slot, &config));
      });
      s.wait(what, s.options.init_timeout, detail::nccl_timeout_hint, [] { return true; });
      child->comm = s.split_slot;
      s.split_slot = nullptr;
      if (!child->comm) {
        settle(detail::call_state::completed);
        return basic_nccl_communicator(nullptr, -1, 0);
      }
      child->wait(what, s.options.init_timeout, detail::nccl_timeout_hint, [] { return true; });
      DTRAIN_NCCL_CHECK(Api::ncclCommUserRank(child->comm, &child->rank));
      DTRAIN_NCCL_CHECK(Api::ncclCommCount(child->comm, &child->size));
      const int child_rank = child->rank, child_size = child->size;
      basic_nccl_communicator out(std::move(child), child_rank, child_size);
      out.ring_ = ring_->make_child(color);
      settle(detail::call_state::completed);
      return out;
    } catch (const backend_error& e) {
      settle(detail::call_state::failed);
      throw detail::nccl_with_context(what, e);
    } catch (...) {
      settle(detail::call_state::failed);
      throw;
    }
  }

  /// This communicator's last collectives, for desync diagnostics.
  [[nodiscard]] std::shared_ptr<detail::collective_ring> ring() const noexcept { return ring_; }

  [[nodiscard]] const nccl_options& options() const {
    static const nccl_options none{};
    return shared_ ? shared_->options : none;
  }

 private:
  basic_nccl_communicator(std::shared_ptr<detail::nccl_shared<Api>> shared, int rank,
                          int size) noexcept
      : shared_(std::move(shared)), rank_(rank), size_(size) {}

  // The store constructor's meeting: the id from rank 0 (which claims its
  // device first: if it has none, nobody waits for its id), then the check
  // that no two ranks share a GPU.
  template <store Store>
  static ncclUniqueId meet(Store& store, int rank, int size, int device,
                           const nccl_options& options) {
    const ncclUniqueId id = exchange_unique_id(store, rank, size, options.store_key, [&] {
      detail::nccl_claim_device<Api>(rank, size, device, options.cuda_visible_devices);
    });
    check_own_gpus(store, rank, size, device, options);
    return id;
  }

  // Each rank sets its GPU, or why it has none, under "<store_key>/gpu/<rank>";
  // rank 0 reads them all and says (broadcast_or_fail) which two share one.
  template <store Store>
  static void check_own_gpus(Store& store, int rank, int size, int device,
                             const nccl_options& options) {
    const std::string base = options.store_key + "/gpu/";
    std::exception_ptr failed;
    std::string record;
    try {
      detail::nccl_claim_device<Api>(rank, size, device, options.cuda_visible_devices);
      detail::nccl_gpu gpu{.uuid = {},
                           .pci_bus = {},
                           .host = detail::host_name().value_or("<unknown host>"),
                           .device = device,
                           .visible = options.cuda_visible_devices.value_or("<unset>")};
      DTRAIN_CUDA_CHECK(Api::device_identity(device, gpu.uuid, gpu.pci_bus));
      record = detail::wire::outcome{true, gpu.encode()}.encode();
    } catch (...) {
      failed = std::current_exception();
      record = detail::wire::outcome{false, detail::current_failure().second}.encode();
    }
    store.set(base + std::to_string(rank), record);
    detail::store_relay<Store> relay(store, base + "verdict", rank, size);
    // A rank other than the root fails now (the root reads why); the root
    // fails through the verdict, so that nobody waits for it.
    if (failed && !relay.is_root()) {
      relay.failure_read();  // the root need not stay for this rank: it knows
      std::rethrow_exception(failed);
    }
    const std::string problem =
        detail::broadcast_or_fail(relay, "the check that every rank has a GPU of its own", [&] {
          if (failed) std::rethrow_exception(failed);
          // The ranks publish their GPU as they create their communicator: a
          // rank that never comes is an init that does not finish (init_timeout).
          std::vector<std::string> keys;
          for (int r = 0; r < size; ++r) keys.push_back(base + std::to_string(r));
          try {
            store.wait(keys, options.init_timeout);
          } catch (const timeout_error& e) {
            throw timeout_error("creating the NCCL communicator on rank " + std::to_string(rank) +
                                " of " + std::to_string(size) + " did not finish within " +
                                detail::nccl_seconds(options.init_timeout) +
                                ": not every rank published its GPU (a rank that never started, "
                                "or is slower than nccl_options::init_timeout, " +
                                std::string(nccl_init_timeout_variable) + "): " + e.what());
          }
          std::vector<detail::nccl_gpu> gpus;
          for (int r = 0; r < size; ++r) {
            const std::string key = base + std::to_string(r);
            const detail::wire::outcome got = detail::wire::outcome::decode(
                "store key \"" + key + "\"", store.get(key), "a rank's GPU");
            if (!got.ok)
              throw rendezvous_error("rank " + std::to_string(r) +
                                     " cannot use its GPU: " + got.text);
            gpus.push_back(detail::nccl_gpu::decode("store key \"" + key + "\"", got.text));
          }
          return detail::nccl_shared_gpu_problem(gpus);
        });
    if (problem.empty()) return;
    // Every rank fails with the same config_error; rank 0, which may host the
    // store, stays until the others have read it.
    if (relay.is_root()) {
      relay.failure_carried();
    } else {
      relay.failure_read();
    }
    throw config_error(problem);
  }

  [[nodiscard]] std::string describe(std::string_view what, std::string_view args) const {
    return detail::describe(what, args, rank_, size_, name);
  }

  // A left-out (or moved-from) communicator fails here, before anything else.
  template <class What>
  detail::nccl_shared<Api>& usable(const What& what) const {
    if (shared_) return *shared_;
    detail::throw_invalid(detail::what_text(what), rank_ < 0);
  }

  // Check mode: every rank's signature, gathered by an (unchecked) ncclAllGather
  // of signature::fields int64 per rank through device scratch memory and a pinned host copy.
  // The host waits for it (at most the collective timeout).
  template <class What>
  void check_signature(detail::nccl_shared<Api>& s, const detail::signature& mine,
                       const What& what) {
    const auto checking = [&] {
      return "checking what every rank passed to " + detail::what_text(what);
    };
    detail::compare_signatures(
        mine, s.rank, s.size, what,
        [&](std::span<const std::int64_t> fields, std::span<std::int64_t> all) {
          try {
            std::int64_t* host = s.host_table();
            constexpr std::size_t width = detail::signature::fields;
            const std::size_t row = static_cast<std::size_t>(s.rank) * width;
            std::memcpy(host + row, fields.data(), width * sizeof(std::int64_t));
            s.call(checking, [&](ncclComm_t comm) {
              DTRAIN_CUDA_CHECK(Api::cudaMemcpyAsync(s.device_table + row, host + row,
                                                     width * sizeof(std::int64_t),
                                                     cudaMemcpyHostToDevice, s.stream.get()));
              DTRAIN_NCCL_CHECK(Api::ncclAllGather(s.device_table + row, s.device_table, width,
                                                   ncclInt64, comm, s.stream.get()));
            });
            s.wait(checking, s.options.collectives.timeout, detail::nccl_timeout_hint,
                   [] { return true; });
            detail::nccl_pooled_event<Api> done(s);
            s.call(checking, [&](ncclComm_t) {
              DTRAIN_CUDA_CHECK(Api::cudaMemcpyAsync(host, s.device_table,
                                                     all.size() * sizeof(std::int64_t),
                                                     cudaMemcpyDeviceToHost, s.stream.get()));
              DTRAIN_CUDA_CHECK(Api::cudaEventRecord(done.get(), s.stream.get()));
            });
            s.wait(checking, s.options.collectives.timeout,
                   "a rank did not call this collective, or called fewer collectives than this one",
                   [&] { return detail::nccl_event_done<Api>(done.get()); });
            std::memcpy(all.data(), host, all.size() * sizeof(std::int64_t));
          } catch (const backend_error& e) {
            throw detail::nccl_with_context(checking(), e);
          }
        });
  }

  // Every collective, in this order: a left-out rank fails first; then the
  // argument checks every engine shares; an aborted communicator; the ring's
  // number (check mode: every rank's signature compared); the stream order
  // (the own stream waits for what `caller` holds now); last the engine's
  // call, `enqueue(comm, own stream)`, and the event the work polls. Nothing
  // is built into words here: `what` describes the call on failure only.
  template <class Enqueue>
  work collective(const detail::collective_call& call, cudaStream_t caller, Enqueue&& enqueue) {
    const detail::collective_info what = call.info(name, rank_, size_);
    detail::nccl_shared<Api>& s = usable(what);
    detail::check_arguments(call, what, detail::nccl_memory);
    s.check_not_aborted(what);
    const std::int64_t seq = detail::record(*ring_, what);
    const bool moves = call.moves_data();
    if (!moves && !s.options.collectives.check) {
      ring_->settle(seq, detail::call_state::completed);
      return work();  // nothing to move, nothing to order
    }
    try {
      detail::basic_device_guard<Api> guard(s.device);
      if (s.options.collectives.check) check_signature(s, detail::signature_of(seq, what), what);
      if (!moves) {
        ring_->settle(seq, detail::call_state::completed);
        return work();
      }
      // At most max_in_flight collectives ahead of the device: a dead peer
      // stops the host here (within the collective timeout), not never.
      s.make_room(what);
      // No lock is held across these calls: any of them can block (a full
      // launch queue, NCCL's work FIFO, a connection to a peer), and an abort
      // from another thread (a watchdog's timeout) is what ends such a call.
      {
        detail::nccl_pooled_event<Api> ready(s);
        s.call(what, [&](ncclComm_t) {
          DTRAIN_CUDA_CHECK(Api::cudaEventRecord(ready.get(), caller));
          DTRAIN_CUDA_CHECK(Api::cudaStreamWaitEvent(s.stream.get(), ready.get(), 0));
        });
      }  // the wait holds the recorded point; the event can be reused at once
      s.call(what, [&](ncclComm_t comm) { enqueue(comm, s.stream.get()); });
      // A non-blocking NCCL may still be enqueueing in the background; nothing
      // may be added to its stream until it is done.
      s.wait(what, s.options.collectives.timeout, detail::nccl_timeout_hint, [] { return true; });
      detail::nccl_pooled_event<Api> done(s);
      s.call(what, [&](ncclComm_t) {
        DTRAIN_CUDA_CHECK(Api::cudaEventRecord(done.get(), s.stream.get()));
        s.fenced();
      });
      auto w = std::make_shared<detail::nccl_work<Api>>(what, s.options.collectives.timeout,
                                                        shared_, done.release());
      w->track(ring_, seq);
      return work(std::move(w));
    } catch (const backend_error& e) {
      throw detail::nccl_with_context(detail::describe(what), e);
    }
  }

  std::shared_ptr<detail::nccl_shared<Api>> shared_;
  std::shared_ptr<detail::collective_ring> ring_ = std::make_shared<detail::collective_ring>();
  int rank_ = -1;
  int size_ = 0;
};

/// The NCCL backend's communicator, on the CUDA runtime and NCCL themselves.
using nccl_communicator = basic_nccl_communicator<detail::nccl_library>;

static_assert(communicator<nccl_communicator>);

#if DTRAIN_HAS_MPI()
/// Rank `root` of `comm` creates an NCCL unique id and MPI_Bcasts it to every
/// rank of `comm` (collective; returns the same id everywhere), for jobs
/// started by mpirun that have no store. If the root cannot create an id, it
/// throws its own error and every other rank throws rendezvous_error with
/// the root's message, rather than waiting (broadcast_or_fail). MPI errors
/// are checked only if `comm` returns them (MPI_ERRORS_RETURN).
DTRAIN_DETAIL_INLINE ncclUniqueId broadcast_nccl_unique_id(MPI_Comm comm, int root = 0);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE ncclUniqueId broadcast_nccl_unique_id(MPI_Comm comm, int root) {
  detail::mpi_relay relay(comm, root);
  const std::string value = detail::broadcast_or_fail(relay, "the NCCL unique id", [] {
    return detail::nccl_unique_id_text(nccl_communicator::new_unique_id());
  });
  return detail::nccl_unique_id_from(value, relay.where());
}
#endif  // DTRAIN_DETAIL_BODIES()
#endif  // DTRAIN_HAS_MPI()

}  // namespace dtrain

#endif  // DTRAIN_HAS_NCCL()
// ---- end dtrain/backend/nccl.hpp ----
// ---- begin dtrain/backend/watchdog.hpp ----
/// @file
/// `watchdog`: a host thread that follows work nobody waits for on the host
/// (collectives on CUDA streams), as ProcessGroupNCCL's watchdog does. Each
/// piece of work must finish within its collective timeout counted from when
/// it was handed over; past it the watchdog calls the engine's timeout hook
/// (NCCL: abort the communicator, which frees the stuck stream) and keeps the
/// timeout_error naming the collective for the owner to report.


#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace dtrain {

class watchdog {
 public:
  using clock = std::chrono::steady_clock;

  watchdog() = default;
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;
  /// Waits for the work still watched (each within what is left of its
  /// timeout), then stops the thread.
  ~watchdog();

  /// Follows `w` from now on: it must finish within its timeout (work::timeout()).
  /// Work is waited for in the order it was handed over (one stream runs it in order).
  void watch(work w);

  /// The first failure seen (a timeout_error naming the collective, or the
  /// engine's error), or null. Never blocks on the work.
  [[nodiscard]] std::exception_ptr failure() const;

  /// Blocks until every piece of work handed over so far has finished, or
  /// until one has failed (each bounded by its timeout); returns failure().
  std::exception_ptr drain();

 private:
  struct entry {
    work handle;
    clock::time_point deadline;
    std::chrono::milliseconds timeout;
  };

  void follow();

  void settle(std::exception_ptr failed);

  mutable std::mutex mutex_;
  std::condition_variable wake_;     // work to follow, or stop
  std::condition_variable settled_;  // a piece of work finished
  std::deque<entry> queue_;
  std::uint64_t watched_ = 0;
  std::uint64_t finished_ = 0;
  bool stopping_ = false;
  std::exception_ptr failure_;
  std::thread thread_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE watchdog::~watchdog() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

DTRAIN_DETAIL_INLINE void watchdog::watch(work w) {
  const std::chrono::milliseconds timeout = w.timeout();
  {
    std::lock_guard lock(mutex_);
    queue_.push_back({std::move(w), clock::now() + timeout, timeout});
    ++watched_;
    if (!thread_.joinable()) thread_ = std::thread([this] { follow(); });
  }
  wake_.notify_all();
}

DTRAIN_DETAIL_INLINE std::exception_ptr watchdog::failure() const {
  std::lock_guard lock(mutex_);
  return failure_;
}

DTRAIN_DETAIL_INLINE std::exception_ptr watchdog::drain() {
  std::unique_lock lock(mutex_);
  const std::uint64_t target = watched_;
  settled_.wait(lock, [&] { return finished_ >= target || failure_; });
  return failure_;
}

DTRAIN_DETAIL_INLINE void watchdog::follow() {
  for (;;) {
    entry next;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      next = std::move(queue_.front());
      queue_.pop_front();
    }
    const auto left =
        std::max(std::chrono::milliseconds(0),
                 std::chrono::ceil<std::chrono::milliseconds>(next.deadline - clock::now()));
    std::exception_ptr failed;
    bool timed_out = false;
    try {
      if (next.handle.finish_within(left)) {
        failed = next.handle.exception();
      } else {
        timed_out = true;
        try {
          std::rethrow_exception(next.handle.timeout_exception(next.timeout));
        } catch (const timeout_error& e) {
          failed = std::make_exception_ptr(
              timeout_error(std::string("watchdog: ") + e.what() + ", counted from launch"));
        }
      }
    } catch (...) {
      failed = std::current_exception();
    }
    // The failure is known before the abort: an abort may wait on a device
    // that never frees (a stream held by the host), and the owner must hear.
    settle(failed);
    if (timed_out) {
      try {
        next.handle.give_up(next.timeout);
      } catch (...) {
        // Reported above.
      }
    }
  }
}

DTRAIN_DETAIL_INLINE void watchdog::settle(std::exception_ptr failed) {
  {
    std::lock_guard lock(mutex_);
    if (failed && !failure_) failure_ = failed;
    ++finished_;
  }
  settled_.notify_all();
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
// ---- end dtrain/backend/watchdog.hpp ----
// ---- begin dtrain/compiled.hpp ----
/// @file
/// Separate compilation: the policy-dependent code of dtrain (context, run's
/// agent and worker, DistributedDataParallel's machinery, and with them the
/// store, the agent and the engine glue) compiled once in a library instead of
/// in every translation unit that calls dtrain::run. This header does nothing
/// unless DTRAIN_SEPARATE_COMPILATION=1 is defined.
///
/// With DTRAIN_SEPARATE_COMPILATION=1, every TU that includes this header (as
/// dtrain.hpp does) declares `extern template` for the standard policies below,
/// and the program must link their instantiations:
///   - CMake: dtrain::dtrain, dtrain::gloo, dtrain::mpi and dtrain::nccl are
///     that library (src/*.cpp, cmake/dtrain_compiled.cmake), built with the
///     target's engines, and define the macro for their users (the default;
///     dtrain::header_only, or DTRAIN_HEADER_ONLY=ON, is the header-only form);
///   - by hand (e.g. with the single header): compile every TU with
///     -DDTRAIN_SEPARATE_COMPILATION=1 and, in one of them, `#define
///     DTRAIN_COMPILED_DEFINITIONS 1` before the #include and put
///     `DTRAIN_INSTANTIATE_COMPILED_POLICIES()` after it.
/// In such a TU (and in a user's, with CMake) dtrain's non-template functions
/// are declared, not defined (DTRAIN_DETAIL_BODIES(), config.hpp): the
/// library's definitions TU (src/core.cpp; by hand, the one above) compiles
/// them once.
/// Policies not in the list (a backend of one's own) are compiled in the TU
/// that uses them, as in header-only mode. Every TU and the library must agree
/// on the engines (DTRAIN_WITH_GLOO/MPI/NCCL): dtrain/detail/link_check.hpp
/// makes a mismatch a link error that names it.

// ---- begin dtrain/context.hpp ----
/// @file
/// dtrain::context<Policy>: what a worker's training function is handed by
/// dtrain::run — the complete world, the rendezvous store, the communicator —
/// and owns, torn down in reverse order of construction.

// ---- begin dtrain/diagnostics.hpp ----
/// @file
/// Desync and hang diagnostics. When a collective times out or fails, or a
/// user sends SIGUSR1 to a rank (or to its node agent, which forwards it),
/// every live rank publishes its communicator's ring of last collectives
/// through the store; the rank that asked gathers them for a bounded time and
/// one rank prints one table naming the rank that is behind, the collective
/// it is missing, mismatched calls, and the ranks that did not answer.

// ---- begin dtrain/launch/protocol.hpp ----
/// @file
/// The job's protocol: the variables a node agent hands its workers
/// (agent_store_variable, restart_count_variable and store_token_variable,
/// named in env/names.hpp, next to torchrun's), the store keys that the agents,
/// the workers (context.hpp) and the diagnostics share, and the format of
/// every value under them. Every value is written and read here (or by the
/// codec next to its type: rank_report and placements in env/placement.hpp,
/// rings in backend/desync.hpp), through detail::wire; a malformed one is a
/// rendezvous_error naming the key.
///
///   agent keys (unprefixed; one store per job, outliving restarts)
///     dtrain/agent/node/<n>         nproc i64, max_restarts i64, host bytes32, pid i64
///     dtrain/agent/joined, left     counters (store add)
///     dtrain/agent/beat/<n>         counter: node n's heartbeat
///     dtrain/agent/<r>/worker_port  i64: MASTER_PORT of round r's workers
///     dtrain/agent/<r>/failure      status i64, kind u8 (0 restartable, 1 final, 2 regroup),
///                                   message bytes32, rank i64, collective i64,
///                                   communicator bytes32
///   and in elastic jobs (dtrun --nnodes MIN:MAX; node 0 forms each round):
///     dtrain/agent/<r>/ready        counter: nodes ready for round r
///     dtrain/agent/<r>/ready/<n>    i64 1: node n is ready for round r
///     dtrain/agent/<r>/members      n u32, n x node i64 (ascending): round r's nodes
///     dtrain/agent/current_round    i64: the newest round formed
///     dtrain/agent/<r>/exited       rank i64, label bytes32, n u32, n x (communicator
///                                   bytes32, collectives i64): the first worker of round r
///                                   that ended well
///     dtrain/agent/<r>/stopped      counter: agents that stopped round r
///     dtrain/agent/<r>/succeeded    counter: agents whose workers all succeeded
///   worker keys (under context.hpp's job_store_prefix)
///     world/<rank>                  rank_report (env/placement.hpp)
///     world/joined                  counter: ranks whose report is set
///     world/joined/all              i64 1, once every rank has joined
///     world/placement               placement table (env/placement.hpp)
///     nccl/unique_id                outcome: the NCCL unique id (nccl_options::store_key)
///     finished                      counter
///     finished/all                  i64 1, once every rank is done
///   diagnostics keys (under the job prefix + "diag/", diagnostics.hpp)
///     round                         counter
///     open/<n>, <n>/printer         i64: a rank
///     <n>/reason                    bytes32
///     <n>/ring/<rank>               rings (backend/desync.hpp)
///     <n>/closed                    i64 1
///   broadcasts from rank 0 over MPI, before any store (traits' pre_store_relay)
///     the store token               outcome: the token's bytes
///     the store's address           outcome: store_address (host bytes32, port i64)
///
/// An "outcome" (wire::outcome, detail/wire.hpp) is what broadcast_or_fail
/// sends (rendezvous/broadcast.hpp): u8 1 and the value as bytes32, or u8 0
/// and rank 0's error as bytes32, so that every rank fails at once with rank
/// 0's message when rank 0 cannot produce the value.

// ---- begin dtrain/env/world.hpp ----
/// @file
/// `dtrain::world`: who this process is in the job, as the launcher told it.
/// A plain value; discover_world() (env/discover.hpp) builds it.

// ---- begin dtrain/detail/json.hpp ----
/// @file
/// A small strict JSON reader (RFC 8259) for TF_CONFIG, and a string writer
/// for the files dtrain writes. A whole JSON library as a dependency of a
/// single-header library, for one variable, is not worth it.
/// Errors are config_errors that quote the input's name and the position.


#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::detail::json {

struct member;

/// A parsed JSON value. Numbers keep their text; as_index() reads the integers
/// that TF_CONFIG needs without a round trip through double.
struct value {
  enum class kind { null, boolean, number, string, array, object };

  kind type = kind::null;
  bool boolean = false;
  std::string text;  // the string's content, or the number as written
  std::vector<value> items;
  std::vector<member> members;  // in document order; keys are unique

  [[nodiscard]] const value* find(std::string_view key) const;
  [[nodiscard]] bool is(kind k) const noexcept { return type == k; }
};

struct member {
  std::string key;
  value val;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE const value* value::find(std::string_view key) const {
  for (const auto& m : members) {
    if (m.key == key) return &m.val;
  }
  return nullptr;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The name of a kind, for messages ("expected an array, found a string").
DTRAIN_DETAIL_INLINE const char* kind_name(value::kind k);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE const char* kind_name(value::kind k) {
  switch (k) {
    case value::kind::null: return "null";
    case value::kind::boolean: return "a boolean";
    case value::kind::number: return "a number";
    case value::kind::string: return "a string";
    case value::kind::array: return "an array";
    case value::kind::object: return "an object";
  }
  return "a value";
}
#endif  // DTRAIN_DETAIL_BODIES()

namespace impl {

class reader {
 public:
  reader(std::string_view text, std::string_view what) : text_(text), what_(what) {}

  value document();

 private:
  static constexpr int max_depth = 64;

  [[noreturn]] void fail(const std::string& why) const;

  void skip_blanks();

  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return text_[pos_]; }

  void expect_word(std::string_view word);

  value parse_value(int depth);

  void parse_object(value& v, int depth);

  void parse_array(value& v, int depth);

  std::string parse_number();

  unsigned read_hex4();

  static void append_utf8(std::string& out, std::uint32_t cp);

  std::string parse_string();

  std::string_view text_;
  std::string_view what_;
  std::size_t pos_ = 0;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE value reader::document() {
  skip_blanks();
  value v = parse_value(0);
  skip_blanks();
  if (pos_ != text_.size()) fail("unexpected text after the JSON value");
  return v;
}

DTRAIN_DETAIL_INLINE void reader::fail(const std::string& why) const {
  std::size_t line = 1, column = 1;
  for (std::size_t i = 0; i < pos_ && i < text_.size(); ++i) {
    if (text_[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  std::string near(text_.substr(pos_ < text_.size() ? pos_ : text_.size(), 16));
  for (char& c : near) {
    if (static_cast<unsigned char>(c) < 0x20) c = ' ';
  }
  throw config_error(
      std::string(what_) + " is not valid JSON: " + why + " at offset " + std::to_string(pos_) +
      " (line " + std::to_string(line) + ", column " + std::to_string(column) + ")" +
      (near.empty() ? std::string(", at the end of the text") : ", near '" + near + "'"));
}

DTRAIN_DETAIL_INLINE void reader::skip_blanks() {
  while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' ||
                                 text_[pos_] == '\r')) {
    ++pos_;
  }
}

DTRAIN_DETAIL_INLINE void reader::expect_word(std::string_view word) {
  if (text_.substr(pos_, word.size()) != word) fail("expected '" + std::string(word) + "'");
  pos_ += word.size();
}

DTRAIN_DETAIL_INLINE value reader::parse_value(int depth) {
  if (depth > max_depth) fail("nesting deeper than " + std::to_string(max_depth) + " levels");
  if (at_end()) fail("expected a value");
  value v;
  switch (peek()) {
    case '{': parse_object(v, depth); break;
    case '[': parse_array(v, depth); break;
    case '"':
      v.type = value::kind::string;
      v.text = parse_string();
      break;
    case 't':
      expect_word("true");
      v.type = value::kind::boolean;
      v.boolean = true;
      break;
    case 'f':
      expect_word("false");
      v.type = value::kind::boolean;
      break;
    case 'n': expect_word("null"); break;
    default:
      if (peek() == '-' || (peek() >= '0' && peek() <= '9')) {
        v.type = value::kind::number;
        v.text = parse_number();
      } else {
        fail("expected a value");
      }
  }
  return v;
}

DTRAIN_DETAIL_INLINE void reader::parse_object(value& v, int depth) {
  v.type = value::kind::object;
  ++pos_;  // '{'
  skip_blanks();
  if (!at_end() && peek() == '}') {
    ++pos_;
    return;
  }
  for (;;) {
    skip_blanks();
    if (at_end() || peek() != '"') fail("expected a string key");
    std::size_t key_pos = pos_;
    std::string key = parse_string();
    if (v.find(key) != nullptr) {
      pos_ = key_pos;
      fail("duplicate key \"" + key + "\"");
    }
    skip_blanks();
    if (at_end() || peek() != ':') fail("expected ':' after an object key");
    ++pos_;
    skip_blanks();
    value item = parse_value(depth + 1);
    v.members.push_back(member{std::move(key), std::move(item)});
    skip_blanks();
    if (at_end()) fail("expected ',' or '}'");
    if (peek() == ',') {
      ++pos_;
      continue;
    }
    if (peek() == '}') {
      ++pos_;
      return;
    }
    fail("expected ',' or '}'");
  }
}

DTRAIN_DETAIL_INLINE void reader::parse_array(value& v, int depth) {
  v.type = value::kind::array;
  ++pos_;  // '['
  skip_blanks();
  if (!at_end() && peek() == ']') {
    ++pos_;
    return;
  }
  for (;;) {
    skip_blanks();
    v.items.push_back(parse_value(depth + 1));
    skip_blanks();
    if (at_end()) fail("expected ',' or ']'");
    if (peek() == ',') {
      ++pos_;
      continue;
    }
    if (peek() == ']') {
      ++pos_;
      return;
    }
    fail("expected ',' or ']'");
  }
}

DTRAIN_DETAIL_INLINE std::string reader::parse_number() {
  std::size_t start = pos_;
  auto digits = [&] {
    std::size_t first = pos_;
    while (!at_end() && peek() >= '0' && peek() <= '9') ++pos_;
    return pos_ - first;
  };
  if (peek() == '-') ++pos_;
  if (at_end()) fail("expected a digit");
  if (peek() == '0') {
    ++pos_;
    if (!at_end() && peek() >= '0' && peek() <= '9') fail("leading zeros are not allowed");
  } else if (digits() == 0) {
    fail("expected a digit");
  }
  if (!at_end() && peek() == '.') {
    ++pos_;
    if (digits() == 0) fail("expected a digit after '.'");
  }
  if (!at_end() && (peek() == 'e' || peek() == 'E')) {
    ++pos_;
    if (!at_end() && (peek() == '+' || peek() == '-')) ++pos_;
    if (digits() == 0) fail("expected a digit in the exponent");
  }
  return std::string(text_.substr(start, pos_ - start));
}

DTRAIN_DETAIL_INLINE unsigned reader::read_hex4() {
  if (text_.size() - pos_ < 4) fail("expected four hex digits after \\u");
  unsigned code = 0;
  for (int i = 0; i < 4; ++i) {
    char c = text_[pos_++];
    code <<= 4;
    if (c >= '0' && c <= '9') {
      code |= static_cast<unsigned>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      code |= static_cast<unsigned>(c - 'a' + 10);
    } else if (c >= 'A' && c <= 'F') {
      code |= static_cast<unsigned>(c - 'A' + 10);
    } else {
      --pos_;
      fail("expected four hex digits after \\u");
    }
  }
  return code;
}

DTRAIN_DETAIL_INLINE void reader::append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

DTRAIN_DETAIL_INLINE std::string reader::parse_string() {
  ++pos_;  // opening quote
  std::string out;
  for (;;) {
    if (at_end()) fail("unterminated string");
    char c = text_[pos_];
    if (c == '"') {
      ++pos_;
      return out;
    }
    if (static_cast<unsigned char>(c) < 0x20) fail("unescaped control character in a string");
    if (c != '\\') {
      out += c;
      ++pos_;
      continue;
    }
    ++pos_;
    if (at_end()) fail("unterminated escape");
    char e = text_[pos_++];
    switch (e) {
      case '"': out += '"'; break;
      case '\\': out += '\\'; break;
      case '/': out += '/'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'u': {
        std::uint32_t cp = read_hex4();
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          if (text_.substr(pos_, 2) != "\\u") fail("a high surrogate must be followed by \\u");
          pos_ += 2;
          std::uint32_t low = read_hex4();
          if (low < 0xDC00 || low > 0xDFFF) fail("invalid low surrogate");
          cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
        } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
          fail("a low surrogate without a high one");
        }
        append_utf8(out, cp);
        break;
      }
      default: --pos_; fail(std::string("invalid escape '\\") + e + "'");
    }
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace impl

/// Parses one JSON document. `what` names the input in messages ("TF_CONFIG").
/// Throws config_error quoting the offset, line and column of the first error.
inline value parse(std::string_view text, std::string_view what) {
  return impl::reader(text, what).document();
}

/// Appends `text` to `out` as a JSON string, quoted and escaped (for the
/// files dtrain writes, such as the DDP timeline).
DTRAIN_DETAIL_INLINE void write_string(std::string& out, std::string_view text);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void write_string(std::string& out, std::string_view text) {
  out += '"';
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          constexpr char hex[] = "0123456789abcdef";
          out += "\\u00";
          out += hex[(c >> 4) & 0xF];
          out += hex[c & 0xF];
        } else {
          out += c;
        }
    }
  }
  out += '"';
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail::json
// ---- end dtrain/detail/json.hpp ----

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace dtrain {

/// The launcher whose variables identified this process.
enum class launcher {
  none,       ///< no launcher variables: a single process
  env,        ///< env:// (torchrun, dtrun, Azure ML PyTorch, Kubeflow, Lightning-style NODE_RANK)
  open_mpi,   ///< Open MPI's mpirun (OMPI_COMM_WORLD_*)
  hydra,      ///< MPICH / Intel MPI Hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID)
  slurm,      ///< srun (SLURM_PROCID, SLURM_NTASKS, ...)
  horovod,    ///< horovodrun (HOROVOD_RANK, ...)
  tf_config,  ///< TF_CONFIG (Kubeflow TFJob, Azure ML TensorFlow jobs)
};

/// The launcher's name as whoami and describe() print it.
[[nodiscard]] constexpr std::string_view to_string(launcher l) noexcept {
  switch (l) {
    case launcher::none: return "none";
    case launcher::env: return "env";
    case launcher::open_mpi: return "open_mpi";
    case launcher::hydra: return "hydra";
    case launcher::slurm: return "slurm";
    case launcher::horovod: return "horovod";
    case launcher::tf_config: return "tf_config";
  }
  return "unknown";
}

/// What this process is in the job. Only workers hold a data-parallel rank.
enum class process_role {
  worker,            ///< a data-parallel rank
  node_agent,        ///< a per-node launcher process that starts the workers of its node
  parameter_server,  ///< TF_CONFIG task type "ps"
  evaluator,         ///< TF_CONFIG task type "evaluator"
};

[[nodiscard]] constexpr std::string_view to_string(process_role r) noexcept {
  switch (r) {
    case process_role::worker: return "worker";
    case process_role::node_agent: return "agent";
    case process_role::parameter_server: return "ps";
    case process_role::evaluator: return "evaluator";
  }
  return "unknown";
}

/// The most ranks a dtrain job may have (1,048,576): sizes from options and
/// the environment are checked against it before anything is allocated for
/// them or multiplied, so that a typo is a config_error, not bad_alloc.
inline constexpr int max_world_size = 1 << 20;

/// Who this process is. A field the environment does not determine is
/// nullopt — unknown, never guessed; the runtime completes the node fields at
/// rendezvous by grouping ranks by host name.
struct world {
  std::optional<int> rank;              ///< 0 .. world_size-1; unknown for agents, ps, evaluators
  std::optional<int> world_size;        ///< number of data-parallel workers in the job
  std::optional<int> local_rank;        ///< rank among the workers on this node
  std::optional<int> local_world_size;  ///< workers on this node
  std::optional<int> node_rank;         ///< index of this node, 0 .. num_nodes-1
  std::optional<int> num_nodes;         ///< nodes in the job
  std::optional<std::string> master_addr;  ///< where the rendezvous store listens
  std::optional<int> master_port;
  launcher source = launcher::none;
  process_role role = process_role::worker;

  /// The fields, in the order describe() and to_json() print them.
  enum class field : std::size_t {
    rank,
    world_size,
    local_rank,
    local_world_size,
    node_rank,
    num_nodes,
    master_addr,
    master_port,
  };
  static constexpr std::size_t field_count = 8;
  static constexpr std::array<std::string_view, field_count> field_names{
      "rank",      "world_size", "local_rank",  "local_world_size",
      "node_rank", "num_nodes",  "master_addr", "master_port"};

  /// Where each known field came from, e.g. "RANK=3" or
  /// "SLURM_STEP_TASKS_PER_NODE=2(x3),1 at SLURM_NODEID=3"; empty when unknown.
  std::array<std::string, field_count> origins{};
  /// Remarks for logs: outer launchers seen, variables deliberately not used.
  std::string notes;

  [[nodiscard]] const std::string& origin(field f) const {
    return origins[static_cast<std::size_t>(f)];
  }

  /// True when every rank and node field is known (master fields excluded:
  /// a single process needs none, and mpirun jobs agree on one through MPI).
  [[nodiscard]] bool complete() const noexcept {
    return rank && world_size && local_rank && local_world_size && node_rank && num_nodes;
  }

  /// One or two lines for logs: each field with the variable it came from.
  [[nodiscard]] std::string describe() const;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string world::describe() const {
  std::string out = "dtrain world from ";
  out += to_string(source);
  if (role != process_role::worker) {
    out += " (";
    out += to_string(role);
    out += ')';
  }
  out += ':';
  std::array<std::string, field_count> values;
  const std::array<const std::optional<int>*, 6> numbers{
      &rank, &world_size, &local_rank, &local_world_size, &node_rank, &num_nodes};
  for (std::size_t i = 0; i < numbers.size(); ++i) {
    values[i] = *numbers[i] ? std::to_string(**numbers[i]) : "?";
  }
  values[6] = master_addr.value_or("?");
  values[7] = master_port ? std::to_string(*master_port) : "?";
  // Consecutive fields with one origin share one parenthesis.
  for (std::size_t i = 0; i < field_count; ++i) {
    out += i == 0 ? " " : ", ";
    out += field_names[i];
    out += '=';
    out += values[i];
    if (i + 1 == field_count || origins[i + 1] != origins[i]) {
      out += origins[i].empty() ? std::string(" (unknown)") : " (" + origins[i] + ")";
    }
  }
  if (!notes.empty()) {
    out += "\n  note: ";
    out += notes;
  }
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The world as one JSON object on one line (no newline), with the keys rank,
/// world_size, local_rank, local_world_size, node_rank, num_nodes,
/// master_addr, master_port (null when unknown), source, and role when the
/// process is not a plain worker. This is what `dtrain_whoami` prints.
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string to_json(const world& w);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string to_json(const world& w) {
  std::string out = "{";
  auto key = [&](std::string_view name) {
    if (out.size() > 1) out += ',';
    detail::json::write_string(out, name);
    out += ':';
  };
  auto number = [&](std::string_view name, const std::optional<int>& v) {
    key(name);
    out += v ? std::to_string(*v) : "null";
  };
  number("rank", w.rank);
  number("world_size", w.world_size);
  number("local_rank", w.local_rank);
  number("local_world_size", w.local_world_size);
  number("node_rank", w.node_rank);
  number("num_nodes", w.num_nodes);
  key("master_addr");
  if (w.master_addr) {
    detail::json::write_string(out, *w.master_addr);
  } else {
    out += "null";
  }
  number("master_port", w.master_port);
  key("source");
  detail::json::write_string(out, to_string(w.source));
  if (w.role != process_role::worker) {
    key("role");
    detail::json::write_string(out, to_string(w.role));
  }
  out += '}';
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
// ---- end dtrain/env/world.hpp ----

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain {
namespace detail {

/// The agents' keys (see the table above).
struct agent_keys {
  /// Key `what` of restart round `restart`: "dtrain/agent/3/failure".
  static std::string of_round(int restart, std::string_view what) {
    return "dtrain/agent/" + std::to_string(restart) + "/" + std::string(what);
  }
  static std::string failure(int restart) { return of_round(restart, "failure"); }
  static std::string worker_port(int restart) { return of_round(restart, "worker_port"); }
  static std::string stopped(int restart) { return of_round(restart, "stopped"); }
  static std::string succeeded(int restart) { return of_round(restart, "succeeded"); }
  static std::string exited(int restart) { return of_round(restart, "exited"); }
  // Elastic jobs (dtrun --nnodes MIN:MAX): the nodes ready for a round (a
  // counter, and one key per node), the members node 0 chose ("0,2"), and
  // the newest round formed.
  static std::string ready(int restart) { return of_round(restart, "ready"); }
  static std::string ready_node(int restart, int node) {
    return of_round(restart, "ready/" + std::to_string(node));
  }
  static std::string members(int restart) { return of_round(restart, "members"); }
  static constexpr std::string_view current_round = "dtrain/agent/current_round";
  static std::string node(int node) { return "dtrain/agent/node/" + std::to_string(node); }
  static std::string beat(int node) { return "dtrain/agent/beat/" + std::to_string(node); }
  static constexpr std::string_view joined = "dtrain/agent/joined";
  static constexpr std::string_view left = "dtrain/agent/left";
};

/// The workers' keys under the job prefix (see the table above).
struct job_keys {
  static std::string report(int rank) { return std::string("world/").append(std::to_string(rank)); }
  static constexpr std::string_view joined = "world/joined";
  static constexpr std::string_view joined_all = "world/joined/all";
  static constexpr std::string_view placement = "world/placement";
  static constexpr std::string_view finished = "finished";
  static constexpr std::string_view finished_all = "finished/all";
};

/// The store keys of the diagnostics rounds, under the job's prefix + "diag/":
/// "round" counts the rounds, "open/<n>" elects the rank that opens round n,
/// "<n>/ring/<rank>" holds a rank's rings (encode_rings), "<n>/reason" why it
/// was asked, "<n>/printer" the rank that prints, "<n>/closed" once printed.
struct diagnostics_keys {
  static std::string open(std::int64_t round) { return "open/" + std::to_string(round); }
  static std::string ring(std::int64_t round, int rank) {
    return std::to_string(round) + "/ring/" + std::to_string(rank);
  }
  static std::string of(std::int64_t round, std::string_view what) {
    return std::to_string(round) + "/" + std::string(what);
  }
};

/// The value of a key that only has to exist ("finished/all", "<n>/closed").
inline std::string present_value() { return wire::encode_int(1); }

/// The first failure of a restart round, as the agents and the workers record it.
struct failure_record {
  int status = 1;               ///< exit status for the job
  bool final = false;           ///< no restart: a signal or a lost peer ended the job
  std::string message;          ///< who failed how
  int rank = -1;                ///< the worker that recorded it; -1: an agent
  std::int64_t collective = 0;  ///< its first collective that failed or timed out (#N); 0: none
  std::string communicator{};   ///< the ring name of that collective's communicator ("world")
  /// Not a failure: an elastic job's nodes change (a node waits to join), so
  /// every node stops its workers and the next round is formed; no restart is counted.
  bool regroup = false;

  [[nodiscard]] std::string encode() const;
  [[nodiscard]] static failure_record decode(const std::string& key, std::string_view value);
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string failure_record::encode() const {
  std::string out;
  wire::writer(out)
      .i64(status)
      .u8(regroup ? 2
          : final ? 1
                  : 0)
      .bytes32(message)
      .i64(rank)
      .i64(collective)
      .bytes32(communicator);
  return out;
}

DTRAIN_DETAIL_INLINE failure_record failure_record::decode(const std::string& key,
                                                           std::string_view value) {
  return wire::decode_value("store key " + key, value, "a failure record", [](wire::reader& r) {
    failure_record f;
    const std::int64_t code = r.i64("the exit status");
    if (code < 0 || code > 255) {
      throw wire::violation("the exit status " + std::to_string(code) + " is not in 0..255");
    }
    f.status = static_cast<int>(code);
    const std::uint8_t flag = r.u8("the kind");
    if (flag > 2) {
      throw wire::violation("the kind is " + std::to_string(flag) +
                            ", not 0 (restartable), 1 (final) or 2 (regroup)");
    }
    f.final = flag == 1;
    f.regroup = flag == 2;
    f.message = r.bytes32("the message");
    const std::int64_t raw_rank = r.i64("the rank");
    if (raw_rank < -1 || raw_rank > INT32_MAX)
      throw wire::violation("the rank " + std::to_string(raw_rank) + " is not a rank or -1");
    f.rank = static_cast<int>(raw_rank);
    f.collective = r.i64("the collective");
    if (f.collective < 0)
      throw wire::violation("the collective #" + std::to_string(f.collective) + " is negative");
    f.communicator = r.bytes32("the communicator");
    return f;
  });
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Records a failure of round `restart` unless one is recorded already: the
/// first one is the root cause, later ones are usually its consequences.
template <store Store>
void record_failure(Store& store, int restart, const failure_record& failure) {
  store.compare_set(agent_keys::failure(restart), "", failure.encode());
}

/// A worker whose training function returned 0, and how many collectives it
/// had issued on each communicator: when a peer then fails in a later
/// collective, the agents name this worker first (it left early), not the
/// peer that waited for it.
struct exit_record {
  int rank = 0;
  std::string label;  ///< worker_label()
  /// Collectives issued, by communicator (its ring's name: "world", "world/split 1 (color 0)").
  std::vector<std::pair<std::string, std::int64_t>> issued;

  /// The collectives issued on `communicator` (0 when it had none).
  [[nodiscard]] std::int64_t issued_on(std::string_view communicator) const;

  [[nodiscard]] std::string encode() const;
  [[nodiscard]] static exit_record decode(const std::string& key, std::string_view value);
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::int64_t exit_record::issued_on(std::string_view communicator) const {
  for (const auto& [name, count] : issued) {
    if (name == communicator) return count;
  }
  return 0;
}

DTRAIN_DETAIL_INLINE std::string exit_record::encode() const {
  std::string out;
  wire::writer w(out);
  w.i64(rank).bytes32(label).u32(static_cast<std::uint32_t>(issued.size()));
  for (const auto& [name, count] : issued) w.bytes32(name).i64(count);
  return out;
}

DTRAIN_DETAIL_INLINE exit_record exit_record::decode(const std::string& key,
                                                     std::string_view value) {
  return wire::decode_value("store key " + key, value, "a worker's exit", [](wire::reader& r) {
    exit_record e;
    const std::int64_t raw_rank = r.i64("the rank");
    if (raw_rank < 0 || raw_rank > INT32_MAX)
      throw wire::violation("the rank " + std::to_string(raw_rank) + " is not a rank");
    e.rank = static_cast<int>(raw_rank);
    e.label = r.bytes32("the worker");
    const std::uint32_t n = r.u32("the communicator count");
    if (n > 1024) throw wire::violation(std::to_string(n) + " communicators is more than 1024");
    for (std::uint32_t i = 0; i < n; ++i) {
      std::string name(r.bytes32("a communicator"));
      const std::int64_t count = r.i64("its collectives");
      if (count < 0) throw wire::violation(std::to_string(count) + " collectives is negative");
      e.issued.emplace_back(std::move(name), count);
    }
    return e;
  });
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Records that a worker of round `restart` ended well, unless one did already:
/// the first one is the one that may have left its peers waiting.
template <store Store>
void record_exit(Store& store, int restart, const exit_record& exit) {
  store.compare_set(agent_keys::exited(restart), "", exit.encode());
}

/// What a node agent says about itself when it joins: every node must run
/// the same number of workers and allow the same restarts.
struct node_record {
  std::int64_t nproc = 0;
  std::int64_t max_restarts = 0;
  std::string host;
  std::int64_t pid = 0;

  /// "host:pid", how messages name the agent.
  [[nodiscard]] std::string who() const { return host + ":" + std::to_string(pid); }

  [[nodiscard]] std::string encode() const;
  [[nodiscard]] static node_record decode(const std::string& key, std::string_view value);
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string node_record::encode() const {
  std::string out;
  wire::writer(out).i64(nproc).i64(max_restarts).bytes32(host).i64(pid);
  return out;
}

DTRAIN_DETAIL_INLINE node_record node_record::decode(const std::string& key,
                                                     std::string_view value) {
  return wire::decode_value("store key " + key, value, "a node agent's record",
                            [](wire::reader& r) {
                              node_record n;
                              n.nproc = r.i64("nproc");
                              n.max_restarts = r.i64("max_restarts");
                              n.host = r.bytes32("the host name");
                              n.pid = r.i64("the pid");
                              return n;
                            });
}
#endif  // DTRAIN_DETAIL_BODIES()

/// A port, as the agents share the workers' MASTER_PORT.
inline std::string encode_port(int port) { return wire::encode_int(port); }
DTRAIN_DETAIL_INLINE int decode_port(const std::string& key, std::string_view value);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE int decode_port(const std::string& key, std::string_view value) {
  return wire::decode_value("store key " + key, value, "a port", [](wire::reader& r) {
    const std::int64_t port = r.i64("the port");
    if (port < 1 || port > 65535) {
      throw wire::violation("the port " + std::to_string(port) + " is not in 1..65535");
    }
    return static_cast<int>(port);
  });
}
#endif  // DTRAIN_DETAIL_BODIES()

/// An elastic round's members: node ranks, ascending, each below `nnodes`.
DTRAIN_DETAIL_INLINE std::string encode_members(const std::vector<int>& nodes);
DTRAIN_DETAIL_INLINE std::vector<int> decode_members(const std::string& key, std::string_view value,
                                                     int nnodes);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string encode_members(const std::vector<int>& nodes) {
  std::string out;
  wire::writer w(out);
  w.u32(static_cast<std::uint32_t>(nodes.size()));
  for (const int n : nodes) w.i64(n);
  return out;
}

DTRAIN_DETAIL_INLINE std::vector<int> decode_members(const std::string& key, std::string_view value,
                                                     int nnodes) {
  return wire::decode_value("store key " + key, value, "a round's nodes", [&](wire::reader& r) {
    const std::uint32_t count = r.u32("the number of nodes");
    if (count == 0 || count > static_cast<std::uint32_t>(nnodes)) {
      throw wire::violation(std::to_string(count) + " nodes, not 1.." + std::to_string(nnodes));
    }
    std::vector<int> nodes;
    for (std::uint32_t i = 0; i < count; ++i) {
      const std::int64_t n = r.i64("a node rank");
      if (n < 0 || n >= nnodes || (!nodes.empty() && n <= nodes.back())) {
        throw wire::violation("node " + std::to_string(n) + " is not in 0.." +
                              std::to_string(nnodes - 1) + " or not ascending");
      }
      nodes.push_back(static_cast<int>(n));
    }
    return nodes;
  });
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Where rank 0 serves the store, as it tells the other ranks through the
/// backend's pre-store channel when no MASTER_ADDR does (inside an outcome).
struct store_address {
  std::string host;  ///< rank 0's host name
  int port = 0;      ///< the port it listens on

  [[nodiscard]] std::string encode() const;
  [[nodiscard]] static store_address decode(std::string_view value);
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string store_address::encode() const {
  std::string out;
  wire::writer(out).bytes32(host).i64(port);
  return out;
}

DTRAIN_DETAIL_INLINE store_address store_address::decode(std::string_view value) {
  return wire::decode_value(
      "rank 0's broadcast", value, "the store's address", [](wire::reader& r) {
        store_address a;
        a.host = r.bytes32("the host name");
        const std::int64_t number = r.i64("the port");
        if (number < 1 || number > 65535) {
          throw wire::violation("the port " + std::to_string(number) + " is not in 1..65535");
        }
        a.port = static_cast<int>(number);
        return a;
      });
}
#endif  // DTRAIN_DETAIL_BODIES()

/// How a worker prefixes the lines it prints: "[rank 3/8]", or what is known of it.
DTRAIN_DETAIL_INLINE std::string rank_label(const world* w);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string rank_label(const world* w) {
  if (w == nullptr || !w->rank) return "[rank ?]";
  return "[rank " + std::to_string(*w->rank) + "/" +
         (w->world_size ? std::to_string(*w->world_size) : "?") + "]";
}
#endif  // DTRAIN_DETAIL_BODIES()

/// How one worker is named in failure messages, by its agent and by itself.
DTRAIN_DETAIL_INLINE std::string worker_label(int rank, int node_rank, int local_rank, long pid);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string worker_label(int rank, int node_rank, int local_rank, long pid) {
  return "rank " + std::to_string(rank) + " (node " + std::to_string(node_rank) + ", local rank " +
         std::to_string(local_rank) + ", pid " + std::to_string(pid) + ")";
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail
}  // namespace dtrain
// ---- end dtrain/launch/protocol.hpp ----

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

namespace dtrain {

/// Options of the diagnostics every rank runs. Aggregate; each field also has
/// an environment variable, which wins.
struct diagnostics_options {
  /// Run the diagnostics thread and catch SIGUSR1. Environment: DTRAIN_DIAGNOSTICS=0 turns it off.
  bool enabled = true;
  /// How long the rank that asked waits for the other rings before it prints
  /// without them (their ranks are then named as not answering).
  /// Environment: DTRAIN_DIAGNOSTICS_WAIT (seconds).
  std::chrono::milliseconds wait{5000};
  /// How often each rank's thread looks for a request in the store.
  std::chrono::milliseconds poll{200};

  [[nodiscard]] diagnostics_options with_env(const environment& env) const;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE diagnostics_options
diagnostics_options::with_env(const environment& env) const {
  diagnostics_options out = *this;
  if (auto on = detail::read_flag(env, diagnostics_variable)) out.enabled = *on;
  if (auto t = detail::read_seconds(env, diagnostics_wait_variable)) out.wait = *t;
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

namespace detail {

/// The eventfd that SIGUSR1 wakes (-1: none). A plain atomic int, so the
/// handler only loads it and writes 8 bytes: both async-signal-safe.
inline std::atomic<int> diagnostics_signal_fd{-1};

DTRAIN_DETAIL_INLINE void on_diagnostics_signal(int);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void on_diagnostics_signal(int) {
  const int saved = errno;
  const int fd = diagnostics_signal_fd.load();
  const std::uint64_t one = 1;
  if (fd >= 0) (void)!::write(fd, &one, sizeof one);
  errno = saved;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// One rank's part: a thread that publishes this rank's ring whenever a round
/// is asked for, and explain(), which asks for one and returns its summary.
/// Owns its own store connection: the context's may be blocked in a long wait.
class rank_diagnostics {
 public:
  /// Connects to the store at host:port (keys under `prefix`), starts the
  /// thread and catches SIGUSR1 until destroyed. `name` says which
  /// communicator the ring is ("gloo"). Throws what connecting throws.
  rank_diagnostics(const std::string& host, int port, store_options store, std::string prefix,
                   int rank, int size, std::shared_ptr<collective_ring> ring, std::string name,
                   diagnostics_options options);
  rank_diagnostics(const rank_diagnostics&) = delete;
  rank_diagnostics& operator=(const rank_diagnostics&) = delete;
  /// Stops the thread: at most one store operation, each bounded by the wait.
  /// SIGUSR1 reaches the newest instance; instances end in reverse order
  /// (one per context), and one that is not the newest leaves the signal alone.
  ~rank_diagnostics();

  /// Whether a collective of this rank failed or timed out (the ring says so):
  /// only such a failure is worth a round; a store timeout, say, is not.
  [[nodiscard]] bool collective_failed() const;

  /// Asks every rank for its ring (joining the round another rank opened, if
  /// one is open), waits for them at most options.wait, and returns the
  /// analysis' summary line; one rank of the round prints the whole table on
  /// stderr. `reason` goes in the table's header ("a timeout on rank 0").
  /// Never throws: a store that is gone makes the summary say so.
  std::string explain(const std::string& reason) noexcept;

 private:
  static store_options bounded(store_options o, std::chrono::milliseconds wait);

  void wake() noexcept;

  // The open round, or a new one; one rank opens each round, the others join it.
  std::int64_t join_round();

  void publish(std::int64_t round);

  // Every rank's ring that arrives within the wait; the others did not answer.
  std::vector<rank_publication> gather(std::int64_t round);

  // Publishes the ring for every new round; explains on SIGUSR1. A store that
  // stops answering (its host is gone) ends the polling, not the process.
  void serve();

  store_client client_;
  prefix_store<store_client> store_;
  int rank_;
  int size_;
  std::shared_ptr<collective_ring> ring_;
  std::string name_;
  diagnostics_options options_;
  int wake_ = -1;
  int previous_fd_ = -1;
  struct sigaction previous_action_ {};
  std::atomic<bool> stopping_{false};
  std::atomic<std::int64_t> published_{0};
  std::thread thread_;  // last: starts once everything above exists
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE rank_diagnostics::rank_diagnostics(
    const std::string& host, int port, store_options store, std::string prefix, int rank, int size,
    std::shared_ptr<collective_ring> ring, std::string name, diagnostics_options options)
    : client_(host, port, bounded(std::move(store), options.wait)),
      store_(client_, std::move(prefix)),
      rank_(rank),
      size_(size),
      ring_(std::move(ring)),
      name_(std::move(name)),
      options_(options) {
  wake_ = DTRAIN_SYSCALL(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  previous_fd_ = diagnostics_signal_fd.exchange(wake_);
  struct sigaction sa {};
  sa.sa_handler = on_diagnostics_signal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGUSR1, &sa, &previous_action_);
  thread_ = std::thread([this] { serve(); });
}

DTRAIN_DETAIL_INLINE rank_diagnostics::~rank_diagnostics() {
  int mine = wake_;
  if (diagnostics_signal_fd.compare_exchange_strong(mine, previous_fd_)) {
    ::sigaction(SIGUSR1, &previous_action_, nullptr);
  }
  stopping_ = true;
  wake();
  thread_.join();
  ::close(wake_);
}

DTRAIN_DETAIL_INLINE bool rank_diagnostics::collective_failed() const {
  for (const auto& entry : ring_->snapshot_all()) {
    for (const call_record& c : entry.second) {
      if (c.state == call_state::failed || c.state == call_state::timed_out) return true;
    }
  }
  return false;
}

DTRAIN_DETAIL_INLINE std::string rank_diagnostics::explain(const std::string& reason) noexcept {
  try {
    const std::int64_t round = join_round();
    const std::string reason_key = diagnostics_keys::of(round, "reason");
    const std::string why = wire::decode_text(
        "store key " + store_.prefix() + reason_key,
        store_.compare_set(reason_key, "", wire::encode_text(reason)), "a diagnostics reason");
    publish(round);
    const desync_report report = analyse_job(gather(round));
    const std::string header = "collective diagnostics, round " + std::to_string(round) +
                               ", after " + why + " (" + name_ + ", " + std::to_string(size_) +
                               " ranks; printed by rank " + std::to_string(rank_) + ")";
    const std::string table = format_report(header, report);
    const std::string closed = diagnostics_keys::of(round, "closed");
    const std::string me = wire::encode_int(rank_);
    if (store_.compare_set(diagnostics_keys::of(round, "printer"), "", me) == me) {
      std::fputs(table.c_str(), stderr);
      std::fflush(stderr);
      store_.set(closed, present_value());
    } else {
      // This rank may exit next, and a launcher stop the others: not before the table is out.
      store_.wait(std::span<const std::string>(&closed, 1), options_.wait);
    }
    return report.summary;
  } catch (const std::exception& e) {
    return std::string("no diagnostics: ") + e.what();
  }
}

DTRAIN_DETAIL_INLINE store_options rank_diagnostics::bounded(store_options o,
                                                             std::chrono::milliseconds wait) {
  o.timeout = std::min(o.timeout, wait);
  o.io_timeout = std::min(o.io_timeout, wait);
  return o;
}

DTRAIN_DETAIL_INLINE void rank_diagnostics::wake() noexcept {
  const std::uint64_t one = 1;
  (void)!::write(wake_, &one, sizeof one);
}

DTRAIN_DETAIL_INLINE std::int64_t rank_diagnostics::join_round() {
  const std::int64_t current = store_.add("round", 0);
  const std::string closed = diagnostics_keys::of(current, "closed");
  if (current > 0 && !store_.check(std::span<const std::string>(&closed, 1))) return current;
  const std::int64_t next = current + 1;
  const std::string me = wire::encode_int(rank_);
  if (store_.compare_set(diagnostics_keys::open(next), "", me) == me) {
    store_.add("round", 1);  // every rank's thread now publishes for it
  }
  return next;
}

DTRAIN_DETAIL_INLINE void rank_diagnostics::publish(std::int64_t round) {
  store_.set(diagnostics_keys::ring(round, rank_), encode_rings(ring_->snapshot_all()));
  published_ = std::max(published_.load(), round);
}

DTRAIN_DETAIL_INLINE std::vector<rank_publication> rank_diagnostics::gather(std::int64_t round) {
  std::vector<std::string> keys;
  for (int r = 0; r < size_; ++r) keys.push_back(diagnostics_keys::ring(round, r));
  try {
    store_.wait(keys, options_.wait);
  } catch (const timeout_error&) {
    // Some rank is silent: analysed as such below.
  }
  std::vector<rank_publication> ranks;
  for (int r = 0; r < size_; ++r) {
    rank_publication p{r, false, {}};
    const std::string& key = keys[static_cast<std::size_t>(r)];
    if (store_.check(std::span<const std::string>(&key, 1))) {
      if (auto rings = decode_rings(store_.get(key))) {
        p.answered = true;
        p.rings = std::move(*rings);
      }
    }
    ranks.push_back(std::move(p));
  }
  return ranks;
}

DTRAIN_DETAIL_INLINE void rank_diagnostics::serve() {
  pollfd p{wake_, POLLIN, 0};
  bool store_ok = true;
  while (!stopping_) {
    const int ready = ::poll(&p, 1, static_cast<int>(options_.poll.count()));
    if (stopping_) return;
    if (ready > 0) {
      std::uint64_t count = 0;
      (void)!::read(wake_, &count, sizeof count);
      if (!stopping_ && store_ok) {
        const std::string summary = explain("SIGUSR1 on rank " + std::to_string(rank_));
        std::fprintf(stderr, "[rank %d/%d] dtrain: SIGUSR1: %s\n", rank_, size_, summary.c_str());
        std::fflush(stderr);
      }
    }
    if (!store_ok) continue;
    try {
      const std::int64_t round = store_.add("round", 0);
      if (round > published_) publish(round);
    } catch (const std::exception&) {
      store_ok = false;
    }
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail
}  // namespace dtrain
// ---- end dtrain/diagnostics.hpp ----
// ---- begin dtrain/env/device.hpp ----
/// @file
/// Which CUDA device a rank uses: a pure function of its local rank, the
/// number of ranks on its node and the devices it can see, so every launcher
/// and GPU binding is unit-testable without a GPU.


#include <optional>
#include <string>
#include <string_view>

namespace dtrain {

/// The CUDA device of local rank `local_rank` of `local_world_size` when the
/// process sees `visible` devices:
/// - the local rank, when at least one device per local rank is visible (one
///   process per GPU with every GPU visible: torchrun, mpirun, dtrun);
/// - device 0, when exactly one is visible (per-task binding: SLURM
///   `--gpus-per-task`, Kubernetes, CUDA_VISIBLE_DEVICES set per rank);
/// - otherwise config_error naming CUDA_VISIBLE_DEVICES (`cuda_visible_devices`,
///   as the environment has it, or unset), the local rank and the counts.
[[nodiscard]] DTRAIN_DETAIL_INLINE int select_device(
    int local_rank, int local_world_size, int visible,
    std::optional<std::string_view> cuda_visible_devices);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE int select_device(int local_rank, int local_world_size, int visible,
                                       std::optional<std::string_view> cuda_visible_devices) {
  const std::string cvd = cuda_visible_devices
                              ? "CUDA_VISIBLE_DEVICES=" + std::string(*cuda_visible_devices)
                              : std::string("CUDA_VISIBLE_DEVICES unset");
  if (local_rank < 0 || local_world_size < 1 || local_rank >= local_world_size) {
    throw config_error("local rank " + std::to_string(local_rank) + " of " +
                       std::to_string(local_world_size) +
                       " ranks on this node cannot pick a GPU (" + cvd + ")");
  }
  if (visible >= local_world_size) return local_rank;
  if (visible == 1) return 0;
  if (visible <= 0) {
    throw config_error("local rank " + std::to_string(local_rank) +
                       " needs a GPU, but this process sees none (" + cvd +
                       "); check the driver (nvidia-smi) and what the launcher exposes");
  }
  throw config_error(
      "local rank " + std::to_string(local_rank) + " of " + std::to_string(local_world_size) +
      " ranks on this node sees " + std::to_string(visible) + " GPUs (" + cvd +
      "): expose one GPU per rank (the launcher's per-task binding) or all of them, or "
      "start no more ranks per node than it has GPUs");
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
// ---- end dtrain/env/device.hpp ----
// ---- begin dtrain/env/discover.hpp ----
/// @file
/// discover_world(): who this process is, as a pure function of (environment,
/// argv, options). See docs/launching.md's launcher table for what each launcher
/// sets and how dtrain reads it.

// ---- begin dtrain/env/launchers.hpp ----
/// @file
/// One reader per launcher. Each turns that launcher's variables into an
/// `observation`: what it says about this process, each value with the
/// variable that said it. discover_world() (env/discover.hpp) reconciles them.

// ---- begin dtrain/detail/hostlist.hpp ----
/// @file
/// Slurm's compressed notations: host lists (`gpu-[01-03,07],cpu5`) and task
/// counts per node (`2(x3),1`). Parsed without expanding, so a hostile or
/// enormous list costs nothing until someone asks for its hosts.


#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::detail {

/// A parsed Slurm host list.
class hostlist {
 public:
  /// Parses `text`; `what` names it in messages (`SLURM_STEP_NODELIST=...`).
  static hostlist parse(std::string_view text, const std::string& what);

  /// Number of hosts, saturating at SIZE_MAX for absurd lists.
  [[nodiscard]] std::size_t size() const;

  /// The first host: what Slurm-aware launchers use as the master.
  [[nodiscard]] std::string front() const;

  /// All hosts in order; config_error past `limit` hosts.
  [[nodiscard]] std::vector<std::string> expand(std::size_t limit = 1u << 20) const;

 private:
  struct range {
    std::uint64_t first;
    std::uint64_t last;
    std::size_t width;  // digits of the lower bound as written: "01-10" pads to 2

    [[nodiscard]] std::string format(std::uint64_t n) const;
    [[nodiscard]] std::size_t count() const { return static_cast<std::size_t>(last - first + 1); }
  };
  // A piece is literal text, or a bracket of ranges when `ranges` is not empty.
  struct piece {
    std::string literal;
    std::vector<range> ranges;
  };
  using pattern = std::vector<piece>;

  static std::size_t saturating_add(std::size_t a, std::size_t b);
  static std::size_t saturating_mul(std::size_t a, std::size_t b);
  static std::size_t pattern_size(const pattern& p);

  static std::uint64_t parse_bound(std::string_view digits, const std::string& what);

  static pattern parse_pattern(std::string_view text, const std::string& what);

  std::vector<pattern> patterns_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE hostlist hostlist::parse(std::string_view text, const std::string& what) {
  hostlist list;
  if (text.empty()) throw config_error(what + " is an empty host list");
  std::size_t start = 0;
  int depth = 0;
  for (std::size_t i = 0; i <= text.size(); ++i) {
    if (i < text.size() && text[i] == '[') {
      if (++depth > 1) throw config_error(what + " has nested '[' at offset " + std::to_string(i));
    } else if (i < text.size() && text[i] == ']') {
      if (--depth < 0)
        throw config_error(what + " has ']' without '[' at offset " + std::to_string(i));
    } else if (i == text.size() || (text[i] == ',' && depth == 0)) {
      if (depth != 0) throw config_error(what + " has '[' without ']'");
      list.patterns_.push_back(parse_pattern(text.substr(start, i - start), what));
      start = i + 1;
    }
  }
  return list;
}

DTRAIN_DETAIL_INLINE std::size_t hostlist::size() const {
  std::size_t total = 0;
  for (const auto& p : patterns_) total = saturating_add(total, pattern_size(p));
  return total;
}

DTRAIN_DETAIL_INLINE std::string hostlist::front() const {
  std::string host;
  for (const auto& pc : patterns_.front()) {
    host += pc.ranges.empty() ? pc.literal : pc.ranges.front().format(pc.ranges.front().first);
  }
  return host;
}

DTRAIN_DETAIL_INLINE std::vector<std::string> hostlist::expand(std::size_t limit) const {
  if (size() > limit) {
    throw config_error("host list of " + std::to_string(size()) + " hosts exceeds the limit of " +
                       std::to_string(limit));
  }
  std::vector<std::string> hosts;
  for (const auto& p : patterns_) {
    std::vector<std::string> partial{""};
    for (const auto& pc : p) {
      std::vector<std::string> next;
      if (pc.ranges.empty()) {
        for (auto& s : partial) next.push_back(s + pc.literal);
      } else {
        for (auto& s : partial) {
          for (const auto& r : pc.ranges) {
            for (std::uint64_t n = r.first; n <= r.last; ++n) next.push_back(s + r.format(n));
          }
        }
      }
      partial = std::move(next);
    }
    hosts.insert(hosts.end(), partial.begin(), partial.end());
  }
  return hosts;
}

DTRAIN_DETAIL_INLINE std::string hostlist::range::format(std::uint64_t n) const {
  std::string digits = std::to_string(n);
  if (digits.size() < width) digits.insert(0, width - digits.size(), '0');
  return digits;
}

DTRAIN_DETAIL_INLINE std::size_t hostlist::saturating_add(std::size_t a, std::size_t b) {
  return a > std::numeric_limits<std::size_t>::max() - b ? std::numeric_limits<std::size_t>::max()
                                                         : a + b;
}

DTRAIN_DETAIL_INLINE std::size_t hostlist::saturating_mul(std::size_t a, std::size_t b) {
  return b != 0 && a > std::numeric_limits<std::size_t>::max() / b
             ? std::numeric_limits<std::size_t>::max()
             : a * b;
}

DTRAIN_DETAIL_INLINE std::size_t hostlist::pattern_size(const pattern& p) {
  std::size_t n = 1;
  for (const auto& pc : p) {
    if (pc.ranges.empty()) continue;
    std::size_t in_bracket = 0;
    for (const auto& r : pc.ranges) in_bracket = saturating_add(in_bracket, r.count());
    n = saturating_mul(n, in_bracket);
  }
  return n;
}

DTRAIN_DETAIL_INLINE std::uint64_t hostlist::parse_bound(std::string_view digits,
                                                         const std::string& what) {
  if (digits.empty() || digits.size() > 18 ||
      digits.find_first_not_of("0123456789") != std::string_view::npos) {
    throw config_error(what + " has a bad range bound '" + std::string(digits) + "'");
  }
  return std::stoull(std::string(digits));
}

DTRAIN_DETAIL_INLINE auto hostlist::parse_pattern(std::string_view text, const std::string& what)
    -> pattern {
  if (text.empty()) throw config_error(what + " has an empty host name");
  pattern p;
  std::size_t i = 0;
  while (i < text.size()) {
    if (text[i] != '[') {
      auto next = text.find('[', i);
      p.push_back(piece{std::string(text.substr(i, next - i)), {}});
      i = next == std::string_view::npos ? text.size() : next;
      continue;
    }
    auto close = text.find(']', i);
    auto body = text.substr(i + 1, close - i - 1);
    if (body.empty()) throw config_error(what + " has an empty '[]'");
    piece bracket;
    std::size_t s = 0;
    while (s <= body.size()) {
      auto comma = body.find(',', s);
      auto item =
          body.substr(s, comma == std::string_view::npos ? std::string_view::npos : comma - s);
      auto dash = item.find('-');
      auto lo = item.substr(0, dash);
      auto hi = dash == std::string_view::npos ? lo : item.substr(dash + 1);
      range r{parse_bound(lo, what), parse_bound(hi, what), lo.size()};
      if (r.last < r.first) {
        throw config_error(what + " has a descending range '" + std::string(item) + "'");
      }
      bracket.ranges.push_back(r);
      if (comma == std::string_view::npos) break;
      s = comma + 1;
    }
    p.push_back(std::move(bracket));
    i = close + 1;
  }
  return p;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Expands Slurm's tasks-per-node notation (`2(x3),1` → 2,2,2,1). `what`
/// names it in messages; config_error past `limit` nodes.
DTRAIN_DETAIL_INLINE std::vector<int> parse_tasks_per_node(std::string_view text,
                                                           const std::string& what,
                                                           std::size_t limit = 1u << 20);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::vector<int> parse_tasks_per_node(std::string_view text,
                                                           const std::string& what,
                                                           std::size_t limit) {
  std::vector<int> counts;
  if (text.empty()) throw config_error(what + " is empty");
  std::size_t start = 0;
  while (start <= text.size()) {
    auto comma = text.find(',', start);
    auto item = text.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    int repeat = 1;
    auto paren = item.find('(');
    if (paren != std::string_view::npos) {
      if (item.size() < paren + 4 || item.substr(paren, 2) != "(x" || item.back() != ')') {
        throw config_error(what + " has a malformed item '" + std::string(item) +
                           "' (expected N or N(xM))");
      }
      repeat = parse_non_negative(what + " (repeat count in '" + std::string(item) + "')",
                                  item.substr(paren + 2, item.size() - paren - 3));
      item = item.substr(0, paren);
    }
    int count = parse_non_negative(what + " (task count '" + std::string(item) + "')", item);
    if (repeat == 0 || count == 0) {
      throw config_error(what + " lists a node with zero tasks or a zero repeat");
    }
    if (counts.size() + static_cast<std::size_t>(repeat) > limit) {
      throw config_error(what + " describes more than " + std::to_string(limit) + " nodes");
    }
    counts.insert(counts.end(), static_cast<std::size_t>(repeat), count);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return counts;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/detail/hostlist.hpp ----

#include <array>
#include <cstddef>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain {

/// Port used when a launcher names a master host but no port, and
/// MASTER_PORT is unset (torchrun's default). Under Slurm the default is
/// slurm_default_port(SLURM_JOB_ID) instead, so two jobs sharing a node differ.
inline constexpr int default_master_port = 29500;

/// 20000 + job id mod 10000: a port that two Slurm jobs on one node are unlikely to share.
[[nodiscard]] constexpr int slurm_default_port(long long job_id) noexcept {
  return 20000 + static_cast<int>(job_id % 10000);
}

namespace detail {

using field = world::field;
constexpr std::size_t count_fields = 6;  // rank .. num_nodes

/// What one launcher (or one loose variable) says about this process.
struct observation {
  launcher source = launcher::none;
  std::array<std::optional<sourced_int>, count_fields> counts{};
  // A master derived from a host list (TF_CONFIG, Slurm): used only when no
  // variable names the master explicitly.
  std::optional<sourced_text> fallback_addr;
  std::optional<sourced_int> fallback_port;
  process_role role = process_role::worker;
  std::string note;

  std::optional<sourced_int>& operator[](field f) { return counts[static_cast<std::size_t>(f)]; }
  const std::optional<sourced_int>& operator[](field f) const {
    return counts[static_cast<std::size_t>(f)];
  }
  /// A launcher, as opposed to loose variables like LOCAL_RANK alone: it says how many processes
  /// there are.
  [[nodiscard]] bool is_launcher() const { return (*this)[field::world_size].has_value(); }
};

/// Reads NAME_RANK/NAME_SIZE-style pairs: both or neither.
DTRAIN_DETAIL_INLINE void read_rank_and_size(const environment& env, observation& o,
                                             std::string_view rank_var, std::string_view size_var);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void read_rank_and_size(const environment& env, observation& o,
                                             std::string_view rank_var, std::string_view size_var) {
  o[field::rank] = read_int(env, rank_var);
  o[field::world_size] = read_int(env, size_var);
  if (o[field::rank].has_value() != o[field::world_size].has_value()) {
    const auto& set = o[field::rank] ? o[field::rank] : o[field::world_size];
    throw config_error(set->origin + " is set but " +
                       std::string(o[field::rank] ? size_var : rank_var) +
                       " is not; the launcher sets both");
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Stores `v` in `slot`, or checks that it agrees with what is there.
DTRAIN_DETAIL_INLINE void agree(std::optional<sourced_int>& slot,
                                const std::optional<sourced_int>& v, std::string_view what);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void agree(std::optional<sourced_int>& slot,
                                const std::optional<sourced_int>& v, std::string_view what) {
  if (!v) return;
  if (!slot) {
    slot = v;
  } else if (slot->value != v->value) {
    throw config_error(slot->origin + " and " + v->origin + " disagree about " + std::string(what));
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

/// env:// — torchrun, dtrun, Azure ML PyTorch jobs, Kubeflow PyTorchJob. Also
/// loose LOCAL_RANK / NODE_RANK, which other launchers' users often export.
DTRAIN_DETAIL_INLINE observation read_env_url(const environment& env);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE observation read_env_url(const environment& env) {
  observation o;
  o.source = launcher::env;
  read_rank_and_size(env, o, "RANK", "WORLD_SIZE");
  o[field::local_rank] = read_int(env, "LOCAL_RANK");
  o[field::local_world_size] = read_int(env, "LOCAL_WORLD_SIZE");
  o[field::node_rank] = read_int(env, "GROUP_RANK");  // torchrun's name for the node index
  agree(o[field::node_rank], read_int(env, "NODE_RANK"), "the node rank");
  o[field::num_nodes] = read_int(env, "GROUP_WORLD_SIZE");
  const auto& ws = o[field::world_size];
  const auto& nodes = o[field::num_nodes];
  const auto& local = o[field::local_world_size];
  // torchrun starts the same number of workers on every node.
  if (ws && nodes && nodes->value > 0 && ws->value % nodes->value != 0) {
    throw config_error(ws->origin + " is not divisible into " + nodes->origin +
                       " nodes with the same number of workers each");
  }
  if (ws && nodes && local && ws->value != nodes->value * local->value) {
    throw config_error(ws->origin + " is not " + local->origin + " workers per node times " +
                       nodes->origin + " nodes");
  }
  return o;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Hugging Face style `--local_rank=N`, `--local_rank N`, `--local-rank=N`,
/// `--local-rank N` (the old torch.distributed.launch without --use_env).
/// `args` excludes the program name; scanning stops at `--`.
DTRAIN_DETAIL_INLINE std::optional<sourced_int> read_argv_local_rank(
    std::span<const std::string_view> args);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<sourced_int> read_argv_local_rank(
    std::span<const std::string_view> args) {
  std::optional<sourced_int> found;
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string_view a = args[i];
    if (a == "--") break;
    for (std::string_view flag :
         {std::string_view("--local_rank"), std::string_view("--local-rank")}) {
      std::optional<std::string_view> text;
      std::string origin;
      if (a == flag) {
        if (i + 1 >= args.size()) throw config_error("argv " + std::string(flag) + " has no value");
        text = args[i + 1];
        origin = "argv " + std::string(flag) + " " + std::string(*text);
      } else if (a.size() > flag.size() && a.substr(0, flag.size()) == flag &&
                 a[flag.size()] == '=') {
        text = a.substr(flag.size() + 1);
        origin = "argv " + std::string(a);
      }
      if (!text) continue;
      agree(found, sourced_int{parse_non_negative(origin, *text), origin}, "the local rank");
    }
  }
  return found;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The variables of a launcher that states rank, size, local rank and local size.
struct rank_variables {
  std::string_view rank, size, local_rank, local_size;
};

/// Reads a launcher that states rank, size, local rank and local size.
DTRAIN_DETAIL_INLINE observation read_ranks(const environment& env, launcher source,
                                            const rank_variables& names);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE observation read_ranks(const environment& env, launcher source,
                                            const rank_variables& names) {
  observation o;
  o.source = source;
  read_rank_and_size(env, o, names.rank, names.size);
  o[field::local_rank] = read_int(env, names.local_rank);
  o[field::local_world_size] = read_int(env, names.local_size);
  return o;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Open MPI's mpirun. OMPI_COMM_WORLD_NODE_RANK is deliberately not read: it
/// is the rank among this node's processes (like the local rank), not the
/// node's index, and Open MPI gives no node index at all. Open MPI 4 exports
/// the number of nodes in the job's map as OMPI_MCA_orte_num_nodes.
DTRAIN_DETAIL_INLINE observation read_open_mpi(const environment& env);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE observation read_open_mpi(const environment& env) {
  observation o = read_ranks(env, launcher::open_mpi,
                             {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                              "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"});
  if (o[field::rank]) o[field::num_nodes] = read_int(env, "OMPI_MCA_orte_num_nodes");
  return o;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// MPICH / Intel MPI (Hydra). No node index or node count.
DTRAIN_DETAIL_INLINE observation read_hydra(const environment& env);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE observation read_hydra(const environment& env) {
  return read_ranks(env, launcher::hydra,
                    {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"});
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The first of `names` that is set, with its name.
DTRAIN_DETAIL_INLINE std::optional<std::pair<std::string_view, std::string_view>> first_set(
    const environment& env, std::initializer_list<std::string_view> names);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<std::pair<std::string_view, std::string_view>> first_set(
    const environment& env, std::initializer_list<std::string_view> names) {
  for (auto name : names) {
    if (auto v = env.get(name)) return std::pair{name, *v};
  }
  return std::nullopt;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// srun. Only inside a job step (SLURM_STEP_ID set): a batch script carries
/// the allocation's SLURM_NTASKS too, but it is one process, and believing
/// otherwise would wait forever for ranks that never start. Step-level
/// variables win over job-level ones, which describe the whole allocation.
DTRAIN_DETAIL_INLINE observation read_slurm(const environment& env);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE observation read_slurm(const environment& env) {
  observation o;
  o.source = launcher::slurm;
  if (!env.contains("SLURM_PROCID")) return o;
  if (!env.contains("SLURM_STEP_ID") && !env.contains("SLURM_STEPID")) {
    o.source = launcher::none;
    o.note =
        "SLURM_PROCID is set without SLURM_STEP_ID: a Slurm batch script, not an srun task; "
        "its allocation was not taken as this process's world";
    return o;
  }
  o[field::rank] = read_int(env, "SLURM_PROCID");
  auto ntasks_var = first_set(env, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"});
  if (!ntasks_var) {
    throw config_error(o[field::rank]->origin +
                       " is set but none of SLURM_STEP_NUM_TASKS, SLURM_NTASKS, SLURM_NPROCS is");
  }
  o[field::world_size] = read_int(env, ntasks_var->first);
  o[field::local_rank] = read_int(env, "SLURM_LOCALID");
  o[field::node_rank] = read_int(env, "SLURM_NODEID");
  if (auto nn = first_set(env, {"SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"})) {
    o[field::num_nodes] = read_int(env, nn->first);
  }
  if (auto tpn = first_set(env, {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"})) {
    auto what = assignment(tpn->first, tpn->second);
    auto counts = parse_tasks_per_node(tpn->second, what);
    long long total = 0;
    for (int c : counts) total += c;
    const auto& ws = o[field::world_size];
    if (total != ws->value) {
      throw config_error(what + " adds up to " + std::to_string(total) + " tasks, not " +
                         ws->origin);
    }
    if (const auto& nn = o[field::num_nodes];
        nn && counts.size() != static_cast<std::size_t>(nn->value)) {
      throw config_error(what + " lists " + std::to_string(counts.size()) + " nodes, not " +
                         nn->origin);
    }
    if (const auto& node = o[field::node_rank]) {
      if (static_cast<std::size_t>(node->value) >= counts.size()) {
        throw config_error(node->origin + " is not below the " + std::to_string(counts.size()) +
                           " nodes of " + what);
      }
      o[field::local_world_size] =
          sourced_int{counts[static_cast<std::size_t>(node->value)], what + " at " + node->origin};
    }
  }
  if (auto list = first_set(env, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"})) {
    auto what = assignment(list->first, list->second);
    auto hosts = hostlist::parse(list->second, what);
    if (const auto& nn = o[field::num_nodes]; nn && list->first == "SLURM_STEP_NODELIST" &&
                                              hosts.size() != static_cast<std::size_t>(nn->value)) {
      throw config_error(what + " names " + std::to_string(hosts.size()) + " hosts, not " +
                         nn->origin);
    }
    o.fallback_addr = sourced_text{hosts.front(), "first host of " + what};
    if (auto job = read_int(env, "SLURM_JOB_ID")) {
      o.fallback_port = sourced_int{slurm_default_port(job->value), "default for " + job->origin};
    } else {
      o.fallback_port = sourced_int{default_master_port, "default"};
    }
  }
  return o;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// horovodrun. HOROVOD_CROSS_RANK is the rank among the processes that share
/// this local rank; it is the node index only for local rank 0, or when
/// every node runs the same number of processes (SIZE = LOCAL_SIZE × CROSS_SIZE).
DTRAIN_DETAIL_INLINE observation read_horovod(const environment& env);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE observation read_horovod(const environment& env) {
  observation o =
      read_ranks(env, launcher::horovod,
                 {"HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"});
  auto cross_rank = read_int(env, "HOROVOD_CROSS_RANK");
  auto cross_size = read_int(env, "HOROVOD_CROSS_SIZE");
  const auto& ws = o[field::world_size];
  const auto& lr = o[field::local_rank];
  const auto& ls = o[field::local_world_size];
  bool homogeneous = ws && ls && cross_size && ws->value == ls->value * cross_size->value;
  if ((lr && lr->value == 0) || homogeneous) {
    o[field::node_rank] = cross_rank;
    o[field::num_nodes] = cross_size;
  } else if (cross_rank || cross_size) {
    o.note =
        "HOROVOD_CROSS_RANK/CROSS_SIZE not used as node fields: nodes run different numbers "
        "of processes and this is not local rank 0";
  }
  return o;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The member `key` of `obj` when it has the expected kind; nullptr when absent.
DTRAIN_DETAIL_INLINE const json::value* json_member(const json::value& obj, std::string_view key,
                                                    json::value::kind kind,
                                                    const std::string& where);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE const json::value* json_member(const json::value& obj, std::string_view key,
                                                    json::value::kind kind,
                                                    const std::string& where) {
  const json::value* v = obj.find(key);
  if (v && !v->is(kind)) {
    throw config_error("TF_CONFIG " + where + "\"" + std::string(key) + "\" is " +
                       json::kind_name(v->type) + ", expected " + json::kind_name(kind));
  }
  return v;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// TF_CONFIG: {"cluster": {"chief": [...], "worker": [...], "ps": [...],
/// "evaluator": [...]}, "task": {"type": ..., "index": ...}}. Data-parallel
/// ranks are the chief (TF1's "master" too) then the workers; ps and
/// evaluator tasks get their role and no rank.
DTRAIN_DETAIL_INLINE observation read_tf_config(const environment& env);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE observation read_tf_config(const environment& env) {
  observation o;
  auto text = env.get("TF_CONFIG");
  if (!text) return o;
  o.source = launcher::tf_config;
  auto doc = json::parse(*text, "TF_CONFIG");
  if (!doc.is(json::value::kind::object)) throw config_error("TF_CONFIG is not a JSON object");
  const auto* cluster = json_member(doc, "cluster", json::value::kind::object, "");
  const auto* task = json_member(doc, "task", json::value::kind::object, "");
  if (!cluster) throw config_error("TF_CONFIG has no \"cluster\" object");
  if (!task) throw config_error("TF_CONFIG has no \"task\" object");

  auto hosts = [&](std::string_view key) -> std::vector<std::string> {
    std::vector<std::string> out;
    if (const auto* list = json_member(*cluster, key, json::value::kind::array, "cluster.")) {
      for (const auto& item : list->items) {
        if (!item.is(json::value::kind::string) || item.text.empty()) {
          throw config_error("TF_CONFIG cluster.\"" + std::string(key) +
                             "\" must list \"host:port\" strings");
        }
        out.push_back(item.text);
      }
    }
    return out;
  };
  auto chief = hosts("chief");
  auto master = hosts("master");  // TF1 Estimator's name for the chief
  if (!chief.empty() && !master.empty()) {
    throw config_error("TF_CONFIG lists both cluster.\"chief\" and cluster.\"master\"");
  }
  if (chief.empty()) chief = master;
  if (chief.size() > 1)
    throw config_error("TF_CONFIG lists " + std::to_string(chief.size()) +
                       " chiefs; at most one is allowed");
  auto workers = hosts("worker");
  auto ps = hosts("ps");
  auto evaluators = hosts("evaluator");

  const auto* type = json_member(*task, "type", json::value::kind::string, "task.");
  const auto* index = json_member(*task, "index", json::value::kind::number, "task.");
  if (!type) throw config_error("TF_CONFIG task has no \"type\"");
  std::string_view kind = type->text;
  int idx = 0;
  if (index) {
    idx = parse_non_negative("TF_CONFIG task.index=" + index->text, index->text);
  } else if (kind != "chief" && kind != "master" && kind != "evaluator") {
    throw config_error("TF_CONFIG task of type \"" + type->text + "\" has no \"index\"");
  }
  const std::string task_text =
      "TF_CONFIG task {type: " + type->text + ", index: " + std::to_string(idx) + "}";
  const int world_size = static_cast<int>(chief.size() + workers.size());
  if (world_size == 0) throw config_error("TF_CONFIG cluster has no \"chief\" and no \"worker\"");
  o[field::world_size] =
      sourced_int{world_size, "TF_CONFIG chief + worker count " + std::to_string(world_size)};

  auto check_index = [&](const std::vector<std::string>& list, std::string_view list_name) {
    if (static_cast<std::size_t>(idx) >= list.size()) {
      throw config_error(task_text + " is not below the " + std::to_string(list.size()) +
                         " entries of cluster.\"" + std::string(list_name) + "\"");
    }
  };
  if (kind == "chief" || kind == "master") {
    check_index(chief, kind);
    o[field::rank] = sourced_int{0, task_text};
  } else if (kind == "worker") {
    check_index(workers, "worker");
    o[field::rank] = sourced_int{static_cast<int>(chief.size()) + idx, task_text};
  } else if (kind == "ps") {
    check_index(ps, "ps");
    o.role = process_role::parameter_server;
  } else if (kind == "evaluator") {
    if (!evaluators.empty()) check_index(evaluators, "evaluator");
    o.role = process_role::evaluator;
  } else {
    throw config_error(task_text +
                       " has an unknown type (expected chief, master, worker, ps or evaluator)");
  }
  const std::string& first = chief.empty() ? workers.front() : chief.front();
  const std::string what =
      "TF_CONFIG " + std::string(chief.empty() ? "worker[0]" : "chief[0]") + "=" + first;
  auto hp = split_host_port(what, first);
  o.fallback_addr = sourced_text{hp.host, what};
  if (hp.port) o.fallback_port = sourced_int{*hp.port, what};
  return o;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The master named outright: MASTER_ADDR / MASTER_PORT, Azure's
/// AZ_BATCH_MASTER_NODE (addr:port, multi-node) and AZ_BATCHAI_MPI_MASTER_NODE
/// (addr, single node). Every source that is set must agree.
struct explicit_master {
  std::optional<sourced_text> addr;
  std::optional<sourced_int> port;
};

DTRAIN_DETAIL_INLINE explicit_master read_explicit_master(const environment& env);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE explicit_master read_explicit_master(const environment& env) {
  explicit_master m;
  auto take_addr = [&](std::optional<sourced_text> v) {
    if (!v) return;
    if (!m.addr) {
      m.addr = std::move(v);
    } else if (m.addr->value != v->value) {
      throw config_error(m.addr->origin + " and " + v->origin +
                         " disagree about the master address");
    }
  };
  take_addr(read_text(env, "MASTER_ADDR"));
  m.port = read_port(env, "MASTER_PORT");
  if (auto batch = read_text(env, "AZ_BATCH_MASTER_NODE")) {
    auto hp = split_host_port(batch->origin, batch->value);
    if (!hp.port) throw config_error(batch->origin + " has no port; expected addr:port");
    take_addr(sourced_text{hp.host, batch->origin});
    agree(m.port, sourced_int{*hp.port, batch->origin}, "the master port");
  }
  take_addr(read_text(env, "AZ_BATCHAI_MPI_MASTER_NODE"));
  return m;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail
}  // namespace dtrain
// ---- end dtrain/env/launchers.hpp ----

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain {

/// Whether the process being described is a worker started by the outside
/// launcher, or a per-node agent that starts the workers of its node.
enum class launch_mode { per_process, per_node };

/// What the caller knows beyond the environment. Values given here are
/// checked against the environment like any other source.
struct discover_options {
  launch_mode mode = launch_mode::per_process;
  std::optional<int> nproc_per_node{};  ///< per_node: workers this agent starts
  std::optional<int> nnodes{};          ///< per_node: number of nodes (agents)
  std::optional<int> node_rank{};       ///< per_node: this agent's node
};

namespace detail {

inline constexpr std::array<std::string_view, count_fields> field_phrases{
    "the rank",      "the world size",     "the local rank", "the local world size",
    "the node rank", "the number of nodes"};

inline void agree(observation& into, field f, const std::optional<sourced_int>& v) {
  agree(into[f], v, field_phrases[static_cast<std::size_t>(f)]);
}

/// Every launcher present, innermost first. env:// comes first because it is
/// what an agent (torchrun, dtrun) sets for its workers, or what a user's
/// script copied from the outer launcher; Slurm comes last because mpirun and
/// mpiexec start their daemons through srun inside an allocation.
DTRAIN_DETAIL_INLINE std::vector<observation> read_launchers(const environment& env,
                                                             const observation& env_url,
                                                             std::string& notes);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::vector<observation> read_launchers(const environment& env,
                                                             const observation& env_url,
                                                             std::string& notes) {
  std::vector<observation> found;
  auto keep = [&](observation o) {
    if (!o.note.empty()) notes += (notes.empty() ? "" : "; ") + o.note;
    if (o.is_launcher()) found.push_back(std::move(o));
  };
  keep(env_url);
  keep(read_tf_config(env));
  keep(read_horovod(env));
  keep(read_open_mpi(env));
  keep(read_hydra(env));
  keep(read_slurm(env));
  return found;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Reconciles the launchers: the first is this process's own; another with
/// the same process count must agree field by field; one with a different
/// count is accepted only as an outer launcher that ran one process per node
/// (torchrun under srun, a node agent under mpirun), and is then not used.
DTRAIN_DETAIL_INLINE observation reconcile(std::vector<observation> launchers, std::string& notes);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE observation reconcile(std::vector<observation> launchers, std::string& notes) {
  observation primary = std::move(launchers.front());
  for (std::size_t i = 1; i < launchers.size(); ++i) {
    const observation& other = launchers[i];
    if (other[field::world_size]->value == primary[field::world_size]->value) {
      for (std::size_t f = 0; f < count_fields; ++f) agree(primary, field(f), other.counts[f]);
      if (!primary.fallback_addr) {
        primary.fallback_addr = other.fallback_addr;
        primary.fallback_port = other.fallback_port;
      }
      continue;
    }
    const auto& local = other[field::local_world_size];
    if (local && local->value == 1) {
      notes += std::string(notes.empty() ? "" : "; ") + "outer launcher " +
               std::string(to_string(other.source)) + " ran one process per node (" +
               other[field::world_size]->origin +
               "); its variables describe that process, not this one";
      continue;
    }
    throw config_error(
        primary[field::world_size]->origin + " (" + std::string(to_string(primary.source)) +
        ") and " + other[field::world_size]->origin + " (" + std::string(to_string(other.source)) +
        ") disagree about the world size; an outer launcher is accepted only with the "
        "same process count or with one process per node");
  }
  return primary;
}
#endif  // DTRAIN_DETAIL_BODIES()

DTRAIN_DETAIL_INLINE void fill_master(world& w, const environment& env, const observation& primary);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void fill_master(world& w, const environment& env,
                                      const observation& primary) {
  auto m = read_explicit_master(env);
  auto addr = m.addr ? m.addr : primary.fallback_addr;
  auto port = m.port ? m.port : primary.fallback_port;
  if (addr) {
    w.master_addr = addr->value;
    w.origins[static_cast<std::size_t>(field::master_addr)] = addr->origin;
  }
  if (port) {
    w.master_port = port->value;
    w.origins[static_cast<std::size_t>(field::master_port)] = port->origin;
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

inline std::string not_below(const sourced_int& lower, const sourced_int& upper) {
  return lower.origin + " is not below " + upper.origin;
}

/// Derives what follows for certain and checks what must hold.
DTRAIN_DETAIL_INLINE void complete_and_check(observation& o);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void complete_and_check(observation& o) {
  const auto& ws = o[field::world_size];
  const auto& ls = o[field::local_world_size];
  // Every process is on this node: one node, and the local rank is the rank.
  if (ws && ls && ws->value == ls->value) {
    std::string why = "all " + ws->origin + " processes are local: " + ls->origin;
    agree(o, field::node_rank, sourced_int{0, why});
    agree(o, field::num_nodes, sourced_int{1, why});
    agree(o, field::local_rank, o[field::rank]);
  }
  // As many nodes as processes: one process per node, whose node rank is its rank.
  if (const auto& nn = o[field::num_nodes]; ws && nn && ws->value == nn->value) {
    std::string why = "one process per node: " + nn->origin + " nodes for " + ws->origin;
    agree(o, field::local_rank, sourced_int{0, why});
    agree(o, field::local_world_size, sourced_int{1, why});
    if (const auto& r = o[field::rank]) agree(o, field::node_rank, sourced_int{r->value, why});
  }
  for (field size : {field::world_size, field::local_world_size, field::num_nodes}) {
    if (const auto& s = o[size]; s && s->value < 1)
      throw config_error(s->origin + " must be at least 1");
  }
  auto check_below = [&](field lower, field upper) {
    if (o[lower] && o[upper] && o[lower]->value >= o[upper]->value) {
      throw config_error(not_below(*o[lower], *o[upper]));
    }
  };
  check_below(field::rank, field::world_size);
  check_below(field::local_rank, field::local_world_size);
  check_below(field::node_rank, field::num_nodes);
  if (ls && ws && ls->value > ws->value) {
    throw config_error(ls->origin + " is larger than " + ws->origin);
  }
  if (const auto& nn = o[field::num_nodes]; nn && ws && nn->value > ws->value) {
    throw config_error(nn->origin + " is larger than " + ws->origin);
  }
  if (const auto& nn = o[field::num_nodes];
      nn && nn->value == 1 && ls && ws && ls->value != ws->value) {
    throw config_error(nn->origin + " says one node, but " + ls->origin + " differs from " +
                       ws->origin);
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

DTRAIN_DETAIL_INLINE world to_world(const observation& o);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE world to_world(const observation& o) {
  world w;
  w.source = o.source;
  w.role = o.role;
  std::array<std::optional<int>*, count_fields> slots{
      &w.rank, &w.world_size, &w.local_rank, &w.local_world_size, &w.node_rank, &w.num_nodes};
  for (std::size_t f = 0; f < count_fields; ++f) {
    if (o.counts[f]) {
      *slots[f] = o.counts[f]->value;
      w.origins[f] = o.counts[f]->origin;
    }
  }
  return w;
}
#endif  // DTRAIN_DETAIL_BODIES()

DTRAIN_DETAIL_INLINE world discover_per_process(const environment& env,
                                                std::span<const std::string_view> args,
                                                std::string& notes);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE world discover_per_process(const environment& env,
                                                std::span<const std::string_view> args,
                                                std::string& notes) {
  observation loose = read_env_url(env);
  std::vector<observation> launchers = read_launchers(env, loose, notes);

  observation o;
  if (launchers.empty()) {
    if (loose[field::node_rank] && loose[field::node_rank]->value != 0) {
      throw config_error(
          loose[field::node_rank]->origin +
          " is set, but nothing gives this process's rank and world size (RANK and "
          "WORLD_SIZE, OMPI_COMM_WORLD_*, PMI_*, SLURM_* under srun, HOROVOD_*, "
          "TF_CONFIG). A Lightning-style per-node job needs launch::per_node (dtrun), "
          "which starts the workers of the node");
    }
    const std::string single = "a single process: no launcher variables";
    for (std::size_t f = 0; f < count_fields; ++f) {
      bool is_size = field(f) == field::world_size || field(f) == field::local_world_size ||
                     field(f) == field::num_nodes;
      o.counts[f] = sourced_int{is_size ? 1 : 0, single};
    }
  } else {
    o = reconcile(std::move(launchers), notes);
  }
  // Loose variables (LOCAL_RANK, NODE_RANK, ... without RANK) must agree with the launcher.
  if (!loose.is_launcher()) {
    for (std::size_t f = 0; f < count_fields; ++f) agree(o, field(f), loose.counts[f]);
  }
  agree(o, field::local_rank, read_argv_local_rank(args));
  complete_and_check(o);
  world w = to_world(o);
  fill_master(w, env, o);
  return w;
}
#endif  // DTRAIN_DETAIL_BODIES()

DTRAIN_DETAIL_INLINE world discover_per_node(const environment& env,
                                             std::span<const std::string_view> args,
                                             const discover_options& opt, std::string& notes);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE world discover_per_node(const environment& env,
                                             std::span<const std::string_view> args,
                                             const discover_options& opt, std::string& notes) {
  if (auto local = read_argv_local_rank(args)) {
    throw config_error(local->origin +
                       " is a worker's argument; a per-node agent assigns local ranks itself");
  }
  observation loose = read_env_url(env);
  std::vector<observation> launchers = read_launchers(env, loose, notes);

  // The agents' own launcher ran one agent per node: its ranks are node ranks.
  observation node;
  node.role = process_role::node_agent;
  if (!launchers.empty()) {
    observation agents = reconcile(std::move(launchers), notes);
    if (const auto& local = agents[field::local_world_size]; local && local->value != 1) {
      throw config_error("per-node launch runs one agent per node, but " + local->origin);
    }
    if (const auto& lr = agents[field::local_rank]; lr && lr->value != 0) {
      throw config_error("per-node launch runs one agent per node, but " + lr->origin);
    }
    node.source = agents.source;
    node.fallback_addr = agents.fallback_addr;
    node.fallback_port = agents.fallback_port;
    agree(node, field::node_rank, agents[field::rank]);
    agree(node, field::node_rank, agents[field::node_rank]);
    agree(node, field::num_nodes, agents[field::world_size]);
    agree(node, field::num_nodes, agents[field::num_nodes]);
  }
  if (!loose.is_launcher()) {
    if (loose[field::local_rank]) {
      throw config_error(loose[field::local_rank]->origin +
                         " is a worker's variable; a per-node agent assigns local ranks itself");
    }
    agree(node, field::node_rank, loose[field::node_rank]);
    agree(node, field::num_nodes, loose[field::num_nodes]);
    if (node.source == launcher::none && (loose[field::node_rank] || loose[field::num_nodes])) {
      node.source = launcher::env;
    }
  }
  auto option = [](std::string_view name,
                   const std::optional<int>& v) -> std::optional<sourced_int> {
    if (!v) return std::nullopt;
    std::string origin = "option " + std::string(name) + "=" + std::to_string(*v);
    if (*v < 0) throw config_error(origin + " is negative");
    return sourced_int{*v, origin};
  };
  agree(node, field::node_rank, option("node_rank", opt.node_rank));
  agree(node, field::num_nodes, option("nnodes", opt.nnodes));
  agree(node, field::local_world_size, option("nproc_per_node", opt.nproc_per_node));
  if (!node[field::node_rank] && !node[field::num_nodes] && node.source == launcher::none) {
    const std::string single = "a single node: no launcher variables";
    node[field::node_rank] = sourced_int{0, single};
    node[field::num_nodes] = sourced_int{1, single};
  }
  if (node[field::local_world_size] && node[field::num_nodes]) {
    const auto& per = *node[field::local_world_size];
    const auto& nn = *node[field::num_nodes];
    const std::int64_t size = std::int64_t{per.value} * nn.value;  // two ints: no overflow here
    if (size > max_world_size) {
      throw config_error(per.origin + " × " + nn.origin + " = " + std::to_string(size) +
                         " ranks, more than dtrain's limit of " + std::to_string(max_world_size) +
                         " (max_world_size)");
    }
    node[field::world_size] = sourced_int{static_cast<int>(size), per.origin + " × " + nn.origin};
  }
  complete_and_check(node);
  world w = to_world(node);
  fill_master(w, env, node);
  return w;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail

/// Who this process is, from `env` and `args` (argv without the program
/// name). Throws config_error naming every variable involved, with its value,
/// when a value is malformed or two sources disagree. Never blocks.
[[nodiscard]] DTRAIN_DETAIL_INLINE world discover_world(const environment& env,
                                                        std::span<const std::string_view> args = {},
                                                        const discover_options& options = {});
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE world discover_world(const environment& env,
                                          std::span<const std::string_view> args,
                                          const discover_options& options) {
  std::string notes;
  world w = options.mode == launch_mode::per_node
                ? detail::discover_per_node(env, args, options, notes)
                : detail::discover_per_process(env, args, notes);
  w.notes = std::move(notes);
  return w;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Same, from the process's own environment and main()'s argc/argv.
[[nodiscard]] DTRAIN_DETAIL_INLINE world discover_world(int argc, const char* const* argv,
                                                        const discover_options& options = {});
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE world discover_world(int argc, const char* const* argv,
                                          const discover_options& options) {
  std::vector<std::string_view> args;
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  return discover_world(environment::from_process(), args, options);
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
// ---- end dtrain/env/discover.hpp ----
// ---- begin dtrain/env/placement.hpp ----
/// @file
/// Completing the world at rendezvous: every rank reports what its launcher
/// told it and the name of its node; ranks that share a node name share a
/// node. Open MPI and Hydra give no node index (and with `--map-by node`
/// rank arithmetic is wrong), so this is how those fields become known.
/// Pure functions and the codecs of the reports and the table; the runtime
/// (context.hpp) carries them through the store.


#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain {

/// This process's node name: DTRAIN_NODE_NAME, else the host name.
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string node_name(const environment& env);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string node_name(const environment& env) {
  if (auto name = env.get(node_name_variable); name && !name->empty()) return std::string(*name);
  auto host = detail::host_name();
  if (!host) throw error("gethostname failed; set DTRAIN_NODE_NAME");
  return *host;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// What one rank says about itself at rendezvous.
struct rank_report {
  std::string node_name;
  world self;  ///< as discovered: fields may be unknown

  // The fields a report carries, in wire order (the world's own order).
  static constexpr std::array<world::field, 5> fields{
      world::field::world_size, world::field::local_rank, world::field::local_world_size,
      world::field::node_rank, world::field::num_nodes};
  template <class W>
  static auto slots(W& w) {
    return std::array{&w.world_size, &w.local_rank, &w.local_world_size, &w.node_rank,
                      &w.num_nodes};
  }

  /// The report as a store value (detail/wire.hpp): node name bytes32, then
  /// per field a known flag u8, the value i64 when known, its origin bytes32.
  [[nodiscard]] std::string encode() const;

  /// The inverse of encode(); `where` names the input ("store key world/3") in
  /// the rendezvous_error a malformed value gives.
  [[nodiscard]] static rank_report decode(std::string_view text, const std::string& where);

  /// Whether the launcher placed this rank fully (its node and its place there).
  [[nodiscard]] bool placed() const noexcept {
    return self.local_rank && self.local_world_size && self.node_rank && self.num_nodes;
  }
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string rank_report::encode() const {
  std::string out;
  detail::wire::writer w(out);
  w.bytes32(node_name);
  const auto numbers = slots(self);
  for (std::size_t i = 0; i < numbers.size(); ++i) {
    w.u8(*numbers[i] ? 1 : 0);
    if (*numbers[i]) w.i64(**numbers[i]);
    w.bytes32(self.origin(fields[i]));
  }
  return out;
}

DTRAIN_DETAIL_INLINE rank_report rank_report::decode(std::string_view text,
                                                     const std::string& where) {
  return detail::wire::decode_value(where, text, "a rank report", [](detail::wire::reader& in) {
    rank_report r;
    r.node_name = in.bytes32("the node name");
    const auto numbers = slots(r.self);
    for (std::size_t i = 0; i < numbers.size(); ++i) {
      const char* name = world::field_names[static_cast<std::size_t>(fields[i])].data();
      const std::uint8_t known = in.u8(name);
      if (known > 1)
        throw detail::wire::violation(std::string(name) + "'s known flag is not 0 or 1");
      if (known == 1) {
        const std::int64_t value = in.i64(name);
        if (value < 0 || value > max_world_size) {
          throw detail::wire::violation(std::string(name) + " " + std::to_string(value) +
                                        " is not in 0.." + std::to_string(max_world_size));
        }
        *numbers[i] = static_cast<int>(value);
      }
      r.self.origins[static_cast<std::size_t>(fields[i])] = in.bytes32(name);
    }
    return r;
  });
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Where one rank sits.
struct placement {
  int node_rank = 0;
  int num_nodes = 1;
  int local_rank = 0;
  int local_world_size = 1;

  friend bool operator==(const placement&, const placement&) = default;
};

/// The placement table rank 0 publishes: u8 1 and, for every rank, node_rank,
/// num_nodes, local_rank, local_world_size as i64; or u8 0 and the
/// config_error that placing the ranks gave (bytes32), for every rank to throw.
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string encode_placements(
    const std::vector<placement>& ranks);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string encode_placements(const std::vector<placement>& ranks) {
  std::string out;
  detail::wire::writer w(out);
  w.u8(1).u32(static_cast<std::uint32_t>(ranks.size()));
  for (const placement& p : ranks)
    w.i64(p.node_rank).i64(p.num_nodes).i64(p.local_rank).i64(p.local_world_size);
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string encode_placement_error(std::string_view message);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string encode_placement_error(std::string_view message) {
  std::string out;
  detail::wire::writer(out).u8(0).bytes32(message);
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Rank `rank`'s entry of a table of `size` ranks; throws rank 0's
/// config_error when placing failed there, and a rendezvous_error naming
/// `where` ("store key dtrain/job/world/placement") when the value is malformed.
[[nodiscard]] DTRAIN_DETAIL_INLINE placement decode_placement(const std::string& where,
                                                              std::string_view value, int rank,
                                                              int size);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE placement decode_placement(const std::string& where, std::string_view value,
                                                int rank, int size) {
  std::optional<std::string> failure;
  placement mine =
      detail::wire::decode_value(where, value, "a placement table", [&](detail::wire::reader& in) {
        placement out;
        if (in.u8("the ok flag") == 0) {
          failure = in.bytes32("rank 0's error");
          return out;
        }
        const std::uint32_t n = in.u32("the rank count");
        if (static_cast<std::int64_t>(n) != size) {
          throw detail::wire::violation("it places " + std::to_string(n) + " ranks, not " +
                                        std::to_string(size));
        }
        for (std::uint32_t r = 0; r < n; ++r) {
          std::int64_t f[4];
          for (std::int64_t& v : f) {
            v = in.i64("a placement");
            if (v < 0 || v > max_world_size)
              throw detail::wire::violation("a placement field is " + std::to_string(v));
          }
          if (static_cast<int>(r) == rank) {
            out = {static_cast<int>(f[0]), static_cast<int>(f[1]), static_cast<int>(f[2]),
                   static_cast<int>(f[3])};
          }
        }
        return out;
      });
  if (failure) throw config_error(*failure);
  return mine;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Places every rank (reports[i] is rank i). When every report is complete,
/// each keeps what its launcher said. Otherwise ranks are grouped by node
/// name: nodes are numbered in the order of their lowest rank, local ranks
/// follow the rank order within a node. Throws config_error, naming the
/// ranks and variables, when the ranks disagree about the world size or a
/// known field contradicts the grouping.
[[nodiscard]] DTRAIN_DETAIL_INLINE std::vector<placement> place_ranks(
    const std::vector<rank_report>& reports);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::vector<placement> place_ranks(const std::vector<rank_report>& reports) {
  const int n = static_cast<int>(reports.size());
  for (std::size_t r = 0; r < reports.size(); ++r) {
    const auto& ws = reports[r].self.world_size;
    if (ws && *ws != n) {
      throw config_error("rank " + std::to_string(r) + " says the world has " +
                         std::to_string(*ws) + " ranks (" +
                         reports[r].self.origin(world::field::world_size) + "), but " +
                         std::to_string(n) + " ranks met at rendezvous");
    }
  }
  std::vector<placement> out(static_cast<std::size_t>(n));
  bool all_complete = true;
  for (const auto& r : reports) all_complete = all_complete && r.placed();
  if (all_complete) {
    for (std::size_t r = 0; r < reports.size(); ++r) {
      const world& w = reports[r].self;
      out[r] = {*w.node_rank, *w.num_nodes, *w.local_rank, *w.local_world_size};
    }
    return out;
  }
  std::map<std::string, int> node_of;  // node name -> node index
  std::vector<int> node_size;
  for (std::size_t r = 0; r < reports.size(); ++r) {
    auto [it, fresh] =
        node_of.try_emplace(reports[r].node_name, static_cast<int>(node_size.size()));
    if (fresh) node_size.push_back(0);
    out[r].node_rank = it->second;
    out[r].local_rank = node_size[static_cast<std::size_t>(it->second)]++;
  }
  for (std::size_t r = 0; r < reports.size(); ++r) {
    out[r].num_nodes = static_cast<int>(node_size.size());
    out[r].local_world_size = node_size[static_cast<std::size_t>(out[r].node_rank)];
  }
  // A field the launcher did give must match: otherwise the node names are wrong.
  for (std::size_t r = 0; r < reports.size(); ++r) {
    const world& w = reports[r].self;
    auto check = [&](world::field f, const std::optional<int>& known, int grouped,
                     std::string_view what) {
      if (known && *known != grouped) {
        throw config_error("rank " + std::to_string(r) + ": " + w.origin(f) + " gives " +
                           std::string(what) + " " + std::to_string(*known) +
                           ", but grouping the ranks by node name (\"" + reports[r].node_name +
                           "\", the host name unless DTRAIN_NODE_NAME is set) gives " +
                           std::to_string(grouped) +
                           "; give every node a distinct DTRAIN_NODE_NAME, or set NODE_RANK");
      }
    };
    check(world::field::local_rank, w.local_rank, out[r].local_rank, "local rank");
    check(world::field::local_world_size, w.local_world_size, out[r].local_world_size,
          "local world size");
    check(world::field::node_rank, w.node_rank, out[r].node_rank, "node rank");
    check(world::field::num_nodes, w.num_nodes, out[r].num_nodes, "node count");
  }
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
// ---- end dtrain/env/placement.hpp ----
// ---- begin dtrain/launch/join.hpp ----
/// @file
/// How a worker waits for the others at rendezvous, and says so. Every rank
/// sets its report and counts itself in (launch/protocol.hpp's job_keys);
/// rank 0 waits until everyone has joined and then places them. While a rank
/// waits it says every few seconds who has joined and who has not ("1 of 2
/// ranks joined; waiting for rank 1"), and at its timeout it names the ranks
/// that never came and the likely causes, instead of a store key.


#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain::detail {

/// One rank's wait at rendezvous, through `Store` (the job's prefix store).
template <store Store>
class rendezvous_wait {
 public:
  using milliseconds = std::chrono::milliseconds;

  struct setup {
    std::string endpoint;  ///< "host:port" of the store, for messages
    int rank = 0;
    int size = 1;
    milliseconds timeout{};                       ///< how long a rank waits for the others
    milliseconds interval{};                      ///< how often it says so
    std::function<void(std::string_view)> say{};  ///< where it says so (detail::say)
    std::string world_size_origin;                ///< "WORLD_SIZE=4", for the likely causes
  };

  rendezvous_wait(Store& store, setup s) : store_(store), s_(std::move(s)) {}

  /// Sets this rank's report and counts it in; the last rank to join marks
  /// everyone joined.
  void join(std::string_view report) {
    store_.set(job_keys::report(s_.rank), report);
    if (store_.add(job_keys::joined, 1) == s_.size) {
      store_.set(job_keys::joined_all, present_value());
    }
  }

  /// Rank 0: waits until every rank has joined, saying who is missing every
  /// interval. Throws timeout_error naming the missing ranks and the likely
  /// causes after the timeout.
  void await_everyone() {
    const std::string all(job_keys::joined_all);
    if (!await(all, true)) throw timeout_error(never_joined());
  }

  /// Every other rank: the value of `key` (rank 0's answer), once set. While
  /// rank 0 itself has not joined, says who is missing every interval (rank 0
  /// says it otherwise). Throws timeout_error after the timeout, naming the
  /// missing ranks, or rank 0 when everyone joined but no answer came.
  [[nodiscard]] std::string await_answer(std::string_view key) {
    const std::string wanted(key);
    if (await(wanted, false)) return store_.get(wanted);
    if (joined() < s_.size) throw timeout_error(never_joined());
    throw timeout_error(prefix() + " timed out after " + whole_seconds(s_.timeout) +
                        ": every rank joined, but rank 0 did not answer (store key \"" + wanted +
                        "\"); see rank 0's output for why");
  }

  /// What the wait looks like now: "1 of 2 ranks joined; waiting for rank 1".
  [[nodiscard]] std::string progress() {
    const std::int64_t count = joined();
    const std::vector<int> missing = missing_ranks();
    std::string out = std::to_string(count) + " of " + std::to_string(s_.size) + " ranks joined";
    if (!missing.empty()) out += "; waiting for " + rank_list(missing, s_.size - count);
    return out;
  }

 private:
  using steady = std::chrono::steady_clock;

  /// The most ranks a message names.
  static constexpr std::size_t named_ranks = 8;
  /// The most keys one check() asks for (the store's default limit is 4096).
  static constexpr int keys_per_check = 1024;

  // Waits for `key` in slices of the interval; reports between slices (rank
  // 0 always, the others while rank 0 is missing). False at the timeout.
  bool await(const std::string& key, bool report_always) {
    const auto start = steady::now();
    const auto deadline = start + s_.timeout;
    const std::string keys[] = {key};
    for (;;) {
      const auto left = std::chrono::ceil<milliseconds>(deadline - steady::now());
      if (left <= milliseconds::zero()) return false;
      try {
        store_.wait(keys, s_.interval > milliseconds::zero() ? std::min(left, s_.interval) : left);
        return true;
      } catch (const timeout_error&) {
        // The store ended this slice of the wait; the connection stays sound.
      }
      const auto now = steady::now();
      if (now >= deadline) return false;
      if (report_always || !store_.check(std::vector<std::string>{job_keys::report(0)})) {
        say(s_.say, prefix() + ": " + progress() + " (" +
                        whole_seconds(std::chrono::duration_cast<milliseconds>(now - start)) +
                        " of " + whole_seconds(s_.timeout) + ")");
      }
    }
  }

  [[nodiscard]] std::string prefix() const { return "rendezvous at " + s_.endpoint; }

  [[nodiscard]] std::int64_t joined() { return store_.add(job_keys::joined, 0); }

  // The first named_ranks ranks whose report is missing, found by halving
  // ranges whose check() fails: a few requests when few are missing.
  [[nodiscard]] std::vector<int> missing_ranks() {
    std::vector<int> out;
    find_missing(0, s_.size, out);
    return out;
  }
  void find_missing(int lo, int hi, std::vector<int>& out) {
    if (lo >= hi || out.size() >= named_ranks) return;
    if (hi - lo <= keys_per_check) {
      std::vector<std::string> keys;
      for (int r = lo; r < hi; ++r) keys.push_back(job_keys::report(r));
      if (store_.check(keys)) return;
      if (hi - lo == 1) {
        out.push_back(lo);
        return;
      }
    }
    const int mid = lo + (hi - lo) / 2;
    find_missing(lo, mid, out);
    find_missing(mid, hi, out);
  }

  // "rank 1", "ranks 1, 3", "998 ranks, among them 1, 2, ..., 8".
  static std::string rank_list(const std::vector<int>& ranks, std::int64_t total) {
    std::string names;
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      names += (i ? ", " : "") + std::to_string(ranks[i]);
    }
    if (total > static_cast<std::int64_t>(ranks.size())) {
      return std::to_string(total) + " ranks, among them " + names;
    }
    return (ranks.size() == 1 ? "rank " : "ranks ") + names;
  }

  [[nodiscard]] std::string never_joined() {
    const std::int64_t count = joined();
    const std::vector<int> missing = missing_ranks();
    const std::string who = rank_list(missing, s_.size - count);
    const bool one = s_.size - count == 1;
    return prefix() + " timed out after " + whole_seconds(s_.timeout) + ": " +
           std::to_string(count) + " of " + std::to_string(s_.size) + " ranks joined; " + who +
           " never did. Likely causes: MASTER_ADDR or MASTER_PORT differ between ranks (this rank "
           "met at " +
           s_.endpoint + "), a firewall blocks that port, " + (one ? "that rank" : "those ranks") +
           " never started or failed before joining (see " + (one ? "its" : "their") +
           " output), or the world size (" + s_.world_size_origin +
           ") is larger than the number of ranks started";
  }

  Store& store_;
  setup s_;
};

}  // namespace dtrain::detail
// ---- end dtrain/launch/join.hpp ----
// ---- begin dtrain/launch/options.hpp ----
/// @file
/// agent_options: what a per-node agent (launch::per_node, dtrun) is told.
/// Every option can also come from an environment variable; see with_env().


#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace dtrain {

/// How long stopped workers get between SIGTERM and SIGKILL (torchrun: 30 s).
/// Environment: DTRAIN_GRACE_PERIOD (seconds).
inline constexpr std::chrono::milliseconds default_grace_period{10'000};

/// How long an agent may go without beating its heartbeat in the store before
/// the other agents declare its node lost and end the job. Environment:
/// DTRAIN_HEARTBEAT_TIMEOUT (seconds).
inline constexpr std::chrono::milliseconds default_heartbeat_timeout{10'000};

namespace detail {
/// Parses a node count as dtrun's --nnodes takes it: "N", or "MIN:MAX" for
/// an elastic job (1 <= MIN <= MAX). Returns {MIN, MAX}; MIN is unset for
/// "N" and for "N:N" (not elastic). `origin` names the value in errors.
DTRAIN_DETAIL_INLINE std::pair<std::optional<int>, int> parse_node_count(const std::string& origin,
                                                                         std::string_view text);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::pair<std::optional<int>, int> parse_node_count(const std::string& origin,
                                                                         std::string_view text) {
  const std::size_t colon = text.find(':');
  if (colon == std::string_view::npos) {
    const int n = parse_non_negative(origin, text);
    if (n < 1) throw config_error(origin + " must be at least 1 (nodes)");
    return {std::nullopt, n};
  }
  const int least = parse_non_negative(origin + " (MIN)", text.substr(0, colon));
  const int most = parse_non_negative(origin + " (MAX)", text.substr(colon + 1));
  if (least < 1 || least > most) {
    throw config_error(origin + ": MIN:MAX needs 1 <= MIN <= MAX (nodes; e.g. 1:4)");
  }
  return {least < most ? std::optional<int>(least) : std::nullopt, most};
}
#endif  // DTRAIN_DETAIL_BODIES()
}  // namespace detail

/// Options of the node agent. Aggregate: `{.nproc_per_node = 4, .max_restarts = 2}`.
/// Unset values come from the environment or the outer launcher (see
/// discover_world in per-node mode): NODE_RANK, OMPI_COMM_WORLD_RANK,
/// SLURM_NODEID, MASTER_ADDR, MASTER_PORT.
struct agent_options {
  /// Workers this agent starts. Environment: DTRAIN_NPROC_PER_NODE. Default:
  /// the number of visible CUDA devices for backend::nccl, else 1.
  std::optional<int> nproc_per_node{};
  /// Nodes (agents) in the job; in an elastic job, the most. Environment:
  /// DTRAIN_NNODES (N, or MIN:MAX). Default: from the outer launcher, else 1.
  std::optional<int> nnodes{};
  /// An elastic job (dtrun --nnodes MIN:MAX, as torchrun's): the fewest nodes
  /// it runs on. When a node is lost, the others go on without it (at least
  /// this many), and a node that comes (back) joins at the next round, up to
  /// nnodes; each change restarts every worker with the new world size
  /// (resume from a checkpoint: docs/checkpoints.md). Unset: exactly nnodes.
  std::optional<int> min_nnodes{};
  /// This agent's node. Environment: DTRAIN_NODE_RANK (NODE_RANK is read too,
  /// and must agree).
  std::optional<int> node_rank{};
  /// Where node 0's agent serves the rendezvous store. Default: MASTER_ADDR,
  /// else 127.0.0.1 on a single node; required with several nodes.
  std::optional<std::string> master_addr{};
  /// Its port. Default: MASTER_PORT, else a free port on a single node and
  /// 29500 with several. 0 picks a free port (single node only).
  std::optional<int> master_port{};
  /// Times the whole job is restarted after a worker fails. Environment: DTRAIN_MAX_RESTARTS.
  int max_restarts = 0;
  /// SIGTERM → SIGKILL delay when workers are stopped.
  /// Environment: DTRAIN_GRACE_PERIOD (seconds).
  std::chrono::milliseconds grace_period = default_grace_period;
  /// A node whose agent is silent this long is lost: the others end the job.
  /// Environment: DTRAIN_HEARTBEAT_TIMEOUT (seconds).
  std::chrono::milliseconds heartbeat_timeout = default_heartbeat_timeout;
  /// Prefix every line the workers print with `[rank N] ` (torchrun's --tee).
  /// Environment: DTRAIN_TEE=1.
  bool tee = false;
  /// When set, each worker's output (stdout and stderr) also goes to
  /// `<log_dir>/restart_<k>/rank_<N>.log`. Environment: DTRAIN_LOG_DIR.
  std::string log_dir{};
  /// Pass `--local_rank=N` as the workers' first argument, as
  /// torch.distributed.launch did for Hugging Face style scripts.
  /// Environment: DTRAIN_LOCAL_RANK_ARG=1.
  bool local_rank_arg = false;

  /// These options with DTRAIN_NPROC_PER_NODE, DTRAIN_NNODES,
  /// DTRAIN_NODE_RANK, DTRAIN_MAX_RESTARTS, DTRAIN_GRACE_PERIOD,
  /// DTRAIN_HEARTBEAT_TIMEOUT, DTRAIN_TEE,
  /// DTRAIN_LOG_DIR and DTRAIN_LOCAL_RANK_ARG applied on top: the environment
  /// wins, as for every dtrain option, so an operator can change a job without
  /// rebuilding it. Throws config_error naming the variable and its value.
  [[nodiscard]] agent_options with_env(const environment& env) const;

  /// Throws config_error when an option is out of range.
  void check() const;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE agent_options agent_options::with_env(const environment& env) const {
  agent_options out = *this;
  auto count = [&](std::string_view name, std::optional<int>& into, int least) {
    if (auto v = detail::read_int(env, name)) {
      if (v->value < least) {
        throw config_error(v->origin + " must be at least " + std::to_string(least));
      }
      into = v->value;
    }
  };
  count(nproc_per_node_variable, out.nproc_per_node, 1);
  if (auto text = env.get(nnodes_variable)) {
    const auto [least, most] =
        detail::parse_node_count(detail::assignment(nnodes_variable, *text), *text);
    out.nnodes = most;
    out.min_nnodes = least;
  }
  count(node_rank_variable, out.node_rank, 0);
  if (auto v = detail::read_int(env, max_restarts_variable)) out.max_restarts = v->value;
  if (auto t = detail::read_seconds(env, grace_period_variable)) out.grace_period = *t;
  if (auto t = detail::read_seconds(env, heartbeat_timeout_variable)) out.heartbeat_timeout = *t;
  if (auto f = detail::read_flag(env, tee_variable)) out.tee = *f;
  if (auto dir = env.get(log_dir_variable); dir && !dir->empty()) out.log_dir = std::string(*dir);
  if (auto f = detail::read_flag(env, local_rank_arg_variable)) out.local_rank_arg = *f;
  out.check();
  return out;
}

DTRAIN_DETAIL_INLINE void agent_options::check() const {
  auto at_least = [](const char* name, const std::optional<int>& v, int least) {
    if (v && *v < least) {
      throw config_error("option " + std::string(name) + "=" + std::to_string(*v) +
                         " must be at least " + std::to_string(least));
    }
  };
  at_least("nproc_per_node", nproc_per_node, 1);
  at_least("nnodes", nnodes, 1);
  at_least("min_nnodes", min_nnodes, 1);
  if (min_nnodes && (!nnodes || *min_nnodes > *nnodes)) {
    throw config_error("option min_nnodes=" + std::to_string(*min_nnodes) +
                       (nnodes ? " is more than nnodes=" + std::to_string(*nnodes)
                               : " needs nnodes (the most nodes)"));
  }
  at_least("node_rank", node_rank, 0);
  auto at_most = [](const char* name, const std::optional<int>& v) {
    if (v && *v > max_world_size) {
      throw config_error("option " + std::string(name) + "=" + std::to_string(*v) +
                         " is more than dtrain's limit of " + std::to_string(max_world_size) +
                         " ranks (max_world_size)");
    }
  };
  at_most("nproc_per_node", nproc_per_node);
  at_most("nnodes", nnodes);
  if (max_restarts < 0) {
    throw config_error("option max_restarts=" + std::to_string(max_restarts) + " is negative");
  }
  if (grace_period.count() < 0) throw config_error("option grace_period is negative");
  if (heartbeat_timeout.count() <= 0) {
    throw config_error("option heartbeat_timeout=" + std::to_string(heartbeat_timeout.count()) +
                       " ms must be positive");
  }
  if (master_port && *master_port != 0) {
    detail::check_port("option master_port=" + std::to_string(*master_port), *master_port);
  }
  if (master_addr && master_addr->empty()) throw config_error("option master_addr is empty");
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
// ---- end dtrain/launch/options.hpp ----
// ---- begin dtrain/launch/worker.hpp ----
/// @file
/// How a worker process ends its part in a job so that the job ends too:
/// it ignores SIGPIPE (a write to a dead peer becomes an error that names
/// the peer instead of a silent death), and a failed rank under MPI calls
/// MPI_Abort, so that mpirun ends every rank at once instead of leaving the
/// failed one blocked in MPI_Finalize while its peers wait out their timeout.
/// It also tells its agent how far its communicator got (collective_progress),
/// so that the agent can name a rank that left its peers waiting.


#include <csignal>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#if DTRAIN_HAS_MPI()
#include <mpi.h>
#endif

namespace dtrain::detail {

/// Ignores SIGPIPE in this process: a peer that dies mid-write gives EPIPE,
/// which the engines and the store turn into an error naming the peer. Under
/// an agent, a worker killed by SIGPIPE would otherwise be blamed as the
/// root cause of a failure it only witnessed.
inline void ignore_sigpipe() noexcept { std::signal(SIGPIPE, SIG_IGN); }

/// Whether MPI is initialised and not yet finalised in this process (by
/// dtrain's MPI backend or by the user); false in a build without MPI.
DTRAIN_DETAIL_INLINE bool mpi_is_running() noexcept;
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE bool mpi_is_running() noexcept {
#if DTRAIN_HAS_MPI()
  int initialized = 0;
  int finalized = 0;
  if (MPI_Initialized(&initialized) != MPI_SUCCESS || initialized == 0) return false;
  return MPI_Finalized(&finalized) == MPI_SUCCESS && finalized == 0;
#else
  return false;
#endif
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Ends the whole MPI job with `status` as MPI_Abort's error code (Open MPI's
/// mpirun exits with it) when MPI is running and `status` is not 0; returns
/// otherwise. Call it after the failure's one-line report: the report is
/// flushed first, since MPI_Abort does not return.
DTRAIN_DETAIL_INLINE void abort_mpi_job(int status) noexcept;
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void abort_mpi_job(int status) noexcept {
  if (status == 0 || !mpi_is_running()) return;
  std::fflush(stdout);
  std::fflush(stderr);
#if DTRAIN_HAS_MPI()
  MPI_Abort(MPI_COMM_WORLD, status);
#endif
}
#endif  // DTRAIN_DETAIL_BODIES()

/// How far a worker's communicators got, as its agent reports it. Each is
/// named by its ring ("world", "world/split 1 (color 0)"): every rank that
/// splits in the same order gives the same split the same name, so counts
/// of the same name compare across ranks.
struct collective_progress {
  std::vector<std::pair<std::string, std::int64_t>> issued;  ///< collectives issued, by ring
  std::string failed_on;       ///< the ring of the first collective that failed or timed out
  std::int64_t failed_at = 0;  ///< that collective's number (#N); 0: none failed
};

/// The progress of `communicator` and its kept splits; nothing when there is
/// no communicator yet, or its engine keeps no ring of its collectives.
template <class Communicator>
collective_progress progress_of(const std::optional<Communicator>& communicator) {
  collective_progress p;
  if constexpr (requires { communicator->ring(); }) {
    const auto ring = communicator ? communicator->ring() : nullptr;
    if (!ring) return p;
    for (auto& [name, calls] : ring->snapshot_all()) {
      p.issued.emplace_back(name, calls.empty() ? 0 : calls.back().seq);
      for (const call_record& c : calls) {
        if (p.failed_at != 0) break;
        if (c.state == call_state::failed || c.state == call_state::timed_out) {
          p.failed_on = name;
          p.failed_at = c.seq;
        }
      }
    }
  }
  return p;
}

}  // namespace dtrain::detail
// ---- end dtrain/launch/worker.hpp ----
// ---- begin dtrain/policy.hpp ----
/// @file
/// dtrain::policy<Launch, Backend, Topology>: the compile-time choices of a
/// job. Each slot is a small tag type; a combination that cannot work is a
/// static_assert that says why, not a run-time surprise.

// ---- begin dtrain/topology/flat.hpp ----
/// @file
/// topology::flat: every collective runs on one communicator over the world.
/// The other model of the slot is topology::hierarchical (hierarchical.hpp).

// ---- begin dtrain/topology/layout.hpp ----
/// @file
/// Where each rank sits among the nodes, as a topology needs it: the
/// `node_layout` of one rank, every rank's gathered over the host control
/// plane, and the check that the nodes are alike enough for a hierarchical
/// collective (every node the same number of ranks, local ranks 0..L-1).


#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain {

/// One rank's place among the nodes: what topology::hierarchical groups by.
struct node_layout {
  int node_rank = 0;
  int num_nodes = 1;
  int local_rank = 0;
  int local_size = 1;

  /// The layout of a complete world (as dtrain::run hands it over); nullopt
  /// when a field is unknown.
  [[nodiscard]] static std::optional<node_layout> of(const world& w);
  friend bool operator==(const node_layout&, const node_layout&) = default;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<node_layout> node_layout::of(const world& w) {
  if (!w.node_rank || !w.num_nodes || !w.local_rank || !w.local_world_size) return std::nullopt;
  return node_layout{*w.node_rank, *w.num_nodes, *w.local_rank, *w.local_world_size};
}
#endif  // DTRAIN_DETAIL_BODIES()

namespace detail {

/// Why `table` (table[r]: rank r's layout) cannot run hierarchically, or an
/// empty string when it can: N nodes of L ranks each, node ranks 0..N-1,
/// local ranks 0..L-1 once per node, every rank agreeing on N and L, N > 1
/// and L > 1 (with one node, or one rank per node, the hierarchy is flat).
[[nodiscard]] DTRAIN_DETAIL_INLINE std::string hierarchy_problem(
    std::span<const node_layout> table);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string hierarchy_problem(std::span<const node_layout> table) {
  const auto rank = [](std::size_t r) { return "rank " + std::to_string(r); };
  if (table.empty()) return "no ranks";
  std::map<int, std::vector<int>> nodes;  // node rank -> the local ranks seen there
  for (std::size_t r = 0; r < table.size(); ++r) {
    const node_layout& l = table[r];
    if (l.num_nodes != table[0].num_nodes) {
      return rank(r) + " says there are " + std::to_string(l.num_nodes) + " nodes, rank 0 " +
             std::to_string(table[0].num_nodes);
    }
    if (l.node_rank < 0 || l.node_rank >= l.num_nodes || l.local_rank < 0 ||
        l.local_rank >= l.local_size) {
      return rank(r) + " has node rank " + std::to_string(l.node_rank) + " of " +
             std::to_string(l.num_nodes) + " and local rank " + std::to_string(l.local_rank) +
             " of " + std::to_string(l.local_size);
    }
    nodes[l.node_rank].push_back(l.local_rank);
  }
  const int n = table[0].num_nodes;
  if (static_cast<int>(nodes.size()) != n) {
    return std::to_string(nodes.size()) + " of the " + std::to_string(n) + " nodes have ranks";
  }
  const std::size_t first = nodes.begin()->second.size();
  for (const auto& [node, locals] : nodes) {
    if (locals.size() != first) {
      return "uneven nodes: node " + std::to_string(nodes.begin()->first) + " has " +
             std::to_string(first) + " ranks, node " + std::to_string(node) + " has " +
             std::to_string(locals.size()) +
             " (hierarchical needs the same number of ranks on every node)";
    }
    std::vector<char> seen(first, 0);
    for (int local : locals) {
      if (static_cast<std::size_t>(local) >= first || seen[static_cast<std::size_t>(local)]) {
        return "node " + std::to_string(node) + " does not number its " + std::to_string(first) +
               " ranks 0.." + std::to_string(first - 1) + " (local rank " + std::to_string(local) +
               ")";
      }
      seen[static_cast<std::size_t>(local)] = 1;
    }
  }
  for (std::size_t r = 0; r < table.size(); ++r) {
    if (static_cast<std::size_t>(table[r].local_size) != first) {
      return rank(r) + " says its node has " + std::to_string(table[r].local_size) +
             " ranks, but " + std::to_string(first) + " met there";
    }
  }
  if (n == 1) return "one node: nothing crosses nodes";
  if (first == 1) return "one rank per node: the cross-node communicator would be the world";
  return {};
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Every rank's layout, in rank order, over `control` (collective).
[[nodiscard]] DTRAIN_DETAIL_INLINE std::vector<node_layout> gather_layouts(control_plane& control,
                                                                           const node_layout& mine);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::vector<node_layout> gather_layouts(control_plane& control,
                                                             const node_layout& mine) {
  const std::int64_t fields[4] = {mine.node_rank, mine.num_nodes, mine.local_rank, mine.local_size};
  std::vector<std::int64_t> all(4 * static_cast<std::size_t>(control.size()));
  control.allgather(fields, all);
  std::vector<node_layout> table(static_cast<std::size_t>(control.size()));
  for (std::size_t r = 0; r < table.size(); ++r) {
    const std::int64_t* f = &all[4 * r];
    table[r] = {static_cast<int>(f[0]), static_cast<int>(f[1]), static_cast<int>(f[2]),
                static_cast<int>(f[3])};
  }
  return table;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The layout of every rank from its node name alone (FNV-1a of it, gathered
/// over `control`), placed by place_ranks() as dtrain::run completes a world:
/// nodes numbered by their lowest rank, local ranks in rank order. For
/// communicators made without a context, which knows the launcher's own placement.
[[nodiscard]] DTRAIN_DETAIL_INLINE node_layout layout_from_node_names(control_plane& control,
                                                                      std::string_view node_name);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE node_layout layout_from_node_names(control_plane& control,
                                                        std::string_view node_name) {
  std::uint64_t hash = 1469598103934665603ull;
  for (char c : node_name) hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  const std::int64_t mine[1] = {static_cast<std::int64_t>(hash)};
  std::vector<std::int64_t> all(static_cast<std::size_t>(control.size()));
  control.allgather(mine, all);
  std::vector<rank_report> reports(all.size());
  for (std::size_t r = 0; r < all.size(); ++r) reports[r].node_name = std::to_string(all[r]);
  const placement p = place_ranks(reports)[static_cast<std::size_t>(control.rank())];
  return {p.node_rank, p.num_nodes, p.local_rank, p.local_world_size};
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace detail
}  // namespace dtrain
// ---- end dtrain/topology/layout.hpp ----
// ---- begin dtrain/topology/sequence.hpp ----
/// @file
/// How a topology runs one collective as several on different communicators:
/// `detail::work_sequence`, one work for the steps, and the calls that pass a
/// stream only to engines that take one. Steps on engines that order their
/// collectives on CUDA streams are all enqueued at once, each after the
/// previous one's stream; on host engines each step starts when the one
/// before it has finished, inside test() / wait() of the sequence.


#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::detail {

/// Whether C enqueues its collectives on a device stream of its own, ordered
/// after the stream passed in (NCCL: `stream_ordered`, and `stream()`): the
/// steps of a sequence can then all be enqueued at once.
template <class C>
concept stream_ordered = requires(const C& c) {
  requires C::stream_ordered;
  { c.stream() } -> std::convertible_to<stream_handle>;
};

/// The stream that the next step must follow after a step on `c`: its own
/// stream where it has one, else none (the step has finished on the host).
template <communicator C>
stream_handle stream_after(const C& c) noexcept {
  if constexpr (stream_ordered<C>) {
    return c.stream();
  } else {
    (void)c;
    return nullptr;
  }
}

// The collectives with the caller's stream, for the engines that take one
// (NCCL, MPI with device buffers); the others never see it.
template <communicator C>
work allreduce_on(C& c, buffer in, buffer out, reduce_op op, stream_handle stream) {
  if constexpr (requires { c.allreduce(in, out, op, stream); }) {
    return c.allreduce(in, out, op, stream);
  } else {
    (void)stream;
    return c.allreduce(in, out, op);
  }
}
template <communicator C>
work reduce_scatter_on(C& c, buffer in, buffer out, reduce_op op, stream_handle stream) {
  if constexpr (requires { c.reduce_scatter(in, out, op, stream); }) {
    return c.reduce_scatter(in, out, op, stream);
  } else {
    (void)stream;
    return c.reduce_scatter(in, out, op);
  }
}
template <communicator C>
work allgather_on(C& c, buffer in, buffer out, stream_handle stream) {
  if constexpr (requires { c.allgather(in, out, stream); }) {
    return c.allgather(in, out, stream);
  } else {
    (void)stream;
    return c.allgather(in, out);
  }
}

/// One work for several collectives. `steps[i]` starts collective i and
/// returns its work; it runs on communicator `lane` and needs step `after`
/// finished first (`chain`: the step before it; -1: nothing). Steps of one
/// lane start in list order, whatever finishes when, so every rank issues the
/// same collectives on every communicator in the same order: a lane is a
/// queue, and independent lanes overlap (a pipeline: step k+1 on one
/// communicator while step k runs on another).
///
/// Eager: every step is started now, in list order (engines that order
/// collectives on streams). Otherwise a step starts once it may, from
/// whichever thread tests or waits on the sequence: drive a rank's sequences
/// from one thread, in one order, as it issues collectives. The first failure
/// ends the sequence, with `label` (the whole collective) and the step in its
/// message. A timeout gives up every step still running (NCCL: aborts their
/// communicators).
class work_sequence final : public work_state {
 public:
  static constexpr int chain = -2;
  struct step {
    std::string name;             ///< "cross-node allreduce", for messages
    std::function<work()> start;  ///< starts the collective; may throw
    int lane = 0;                 ///< the communicator it runs on
    int after = chain;            ///< the step it waits for: an index, chain, or -1
  };

  /// Starts what may start now (eager: every step); what a start throws
  /// reaches the caller. The sequence's timeout is its steps' (the
  /// communicators' collective timeout), counted for the whole sequence.
  work_sequence(std::string label, std::vector<step> steps, bool eager,
                std::shared_ptr<void> keep_alive = {});

  bool poll() override;

  bool wait_until(std::chrono::steady_clock::time_point deadline) override;

  void on_timeout() noexcept override;

 private:
  // What the sequence knows of one step.
  struct slot {
    step what;
    work handle;
    bool started = false;
    bool finished = false;
  };

  void start(std::size_t i);

  // Starts, in list order, every step whose predecessor has finished and
  // whose lane has started everything listed before it.
  void start_ready();

  // The one step in flight when exactly one is.
  std::optional<work> only_running_locked();

  // True once every step has finished or one has failed; starts the steps
  // that finished ones let start.
  bool advance_locked();

  // The step's error, with the sequence and the step named; same exception type.
  bool end(const std::exception_ptr& e, std::size_t i);

  std::mutex mutex_;  // the watchdog and the owner may poll at once
  std::vector<slot> slots_;
  std::shared_ptr<void> keep_alive_;  // scratch memory the steps use
  call_label call_label_;             // the caller's, for the steps started later
  bool finished_ = false;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE work_sequence::work_sequence(std::string label, std::vector<step> steps,
                                                  bool eager, std::shared_ptr<void> keep_alive)
    : work_state(std::move(label), std::chrono::milliseconds(0)),
      keep_alive_(std::move(keep_alive)),
      call_label_(current_call_label()) {
  if (steps.empty()) throw dtrain::error("work_sequence: no steps (" + description() + ")");
  for (std::size_t i = 0; i < steps.size(); ++i) {
    int& a = steps[i].after;
    if (a == chain) a = static_cast<int>(i) - 1;
    if (a >= static_cast<int>(i)) {
      throw dtrain::error("work_sequence: step " + std::to_string(i) + " waits for a later one (" +
                          description() + ")");
    }
    slots_.push_back({std::move(steps[i]), {}, false, false});
  }
  if (eager) {
    for (std::size_t i = 0; i < slots_.size(); ++i) start(i);
  } else {
    start_ready();
  }
}

DTRAIN_DETAIL_INLINE bool work_sequence::poll() {
  std::lock_guard lock(mutex_);
  return advance_locked();
}

DTRAIN_DETAIL_INLINE bool work_sequence::wait_until(
    std::chrono::steady_clock::time_point deadline) {
  backoff pause;
  for (;;) {
    std::optional<work> only;
    {
      std::lock_guard lock(mutex_);
      if (advance_locked()) return true;
      only = only_running_locked();
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      std::lock_guard lock(mutex_);
      return advance_locked();
    }
    if (only) {
      // One step in flight, and nothing else can start before it ends: the
      // engine's own wait (Gloo runs a collective that is next in line on
      // this thread; MPI progresses inside its test).
      (void)only->finish_within(left);
    } else {
      pause();  // several in flight: poll them all, so that each finished one lets the next start
    }
  }
}

DTRAIN_DETAIL_INLINE void work_sequence::on_timeout() noexcept {
  std::lock_guard lock(mutex_);
  for (slot& s : slots_) {
    if (!s.started || s.handle.test()) continue;
    try {
      s.handle.give_up(s.handle.timeout());  // the engine's abort
    } catch (...) {
    }
  }
}

DTRAIN_DETAIL_INLINE void work_sequence::start(std::size_t i) {
  slot& s = slots_[i];
  label_scope label(
      call_label_);  // a later step, started by whichever thread polls, keeps the caller's label
  s.handle = s.what.start();
  s.started = true;
  // A step that completed at once (nothing to move) has no limit of its own.
  if (s.handle.timeout() > timeout()) set_timeout(s.handle.timeout());
}

DTRAIN_DETAIL_INLINE void work_sequence::start_ready() {
  std::vector<char> lane_blocked;
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    const auto lane = static_cast<std::size_t>(slots_[i].what.lane);
    if (lane >= lane_blocked.size()) lane_blocked.resize(lane + 1, 0);
    if (slots_[i].started) continue;
    const int a = slots_[i].what.after;
    const bool ready = a < 0 || slots_[static_cast<std::size_t>(a)].finished;
    if (ready && !lane_blocked[lane]) {
      start(i);
    } else {
      lane_blocked[lane] = 1;
    }
  }
}

DTRAIN_DETAIL_INLINE std::optional<work> work_sequence::only_running_locked() {
  std::optional<work> found;
  int running = 0;
  for (const slot& s : slots_) {
    if (s.started && !s.finished) {
      found = s.handle;
      ++running;
    }
  }
  if (running != 1) return std::nullopt;
  return found;
}

DTRAIN_DETAIL_INLINE bool work_sequence::advance_locked() {
  if (finished_) return true;
  for (;;) {
    bool progress = false;
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      slot& s = slots_[i];
      if (!s.started || s.finished || !s.handle.test()) continue;
      if (auto e = s.handle.exception()) return end(e, i);
      s.finished = true;
      progress = true;
    }
    if (std::all_of(slots_.begin(), slots_.end(), [](const slot& s) { return s.finished; })) {
      finished_ = true;
      return true;
    }
    if (!progress) return false;
    try {
      start_ready();
    } catch (...) {
      std::size_t failed = 0;
      while (failed < slots_.size() && slots_[failed].started) ++failed;
      return end(std::current_exception(), failed);
    }
  }
}

DTRAIN_DETAIL_INLINE bool work_sequence::end(const std::exception_ptr& e, std::size_t i) {
  const std::string where = description() + ", step " + std::to_string(i + 1) + " of " +
                            std::to_string(slots_.size()) + " (" + slots_[i].what.name + "): ";
  try {
    std::rethrow_exception(e);
  } catch (const config_error& x) {
    fail(std::make_exception_ptr(config_error(where + x.what())));
  } catch (const timeout_error& x) {
    fail(std::make_exception_ptr(timeout_error(where + x.what())));
  } catch (const backend_error& x) {
    fail(std::make_exception_ptr(backend_error(where + x.what(), x.engine_code())));
  } catch (const rendezvous_error& x) {
    fail(std::make_exception_ptr(rendezvous_error(where + x.what())));
  } catch (const std::exception& x) {
    fail(std::make_exception_ptr(dtrain::error(where + x.what())));
  } catch (...) {
    fail(e);
  }
  finished_ = true;
  return true;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/topology/sequence.hpp ----

#include <cstddef>
#include <string>
#include <string_view>

namespace dtrain::topology {

/// One communicator over the world; collectives go to it unchanged.
struct flat {
  static constexpr std::string_view name = "flat";

  /// How this topology runs an allreduce on `world`: directly.
  template <communicator C>
  static work allreduce(C& world, buffer in, buffer out, reduce_op op) {
    return world.allreduce(in, out, op);
  }
  template <communicator C>
  static work broadcast(C& world, buffer data, int root) {
    return world.broadcast(data, root);
  }

  /// The communicators a topology runs its collectives on, made once per
  /// user (DistributedDataParallel makes one). Flat: the world itself.
  template <communicator C>
  class group {
   public:
    /// Nothing collective happens: flat needs no layout and no new communicator.
    group(C& world, control_plane /*control*/, const node_layout& /*mine*/) noexcept
        : world_(&world) {}

    [[nodiscard]] C& world() noexcept { return *world_; }
    /// Whether collectives run hierarchically (never, here).
    [[nodiscard]] static constexpr bool hierarchical() noexcept { return false; }
    /// A buffer whose length is a multiple of this many elements needs no extra collective.
    [[nodiscard]] static constexpr std::size_t granularity() noexcept { return 1; }
    /// Elements of scratch (`shard`) an allreduce of `count` elements needs: none.
    [[nodiscard]] static constexpr std::size_t shard_count(std::size_t /*count*/) noexcept {
      return 0;
    }
    /// "flat (gloo, 4 ranks)"
    [[nodiscard]] std::string describe() const {
      return "flat (" + std::string(C::name) + ", " + std::to_string(world_->size()) + " ranks)";
    }

    /// In place on `data`, ordered after `stream` where the engine takes one.
    work allreduce(buffer data, buffer /*shard*/, reduce_op op, stream_handle stream = nullptr) {
      return detail::allreduce_on(*world_, data, data, op, stream);
    }
    /// The same without scratch (flat needs none).
    work allreduce(buffer data, reduce_op op) { return world_->allreduce(data, data, op); }
    /// Makes `stream` wait for every collective so far (engines on streams).
    void stream_wait(stream_handle stream) requires requires(C& c, stream_handle s) {
      c.stream_wait(s);
    }
    { world_->stream_wait(stream); }

   private:
    C* world_;
  };
};

}  // namespace dtrain::topology
// ---- end dtrain/topology/flat.hpp ----
// ---- begin dtrain/topology/hierarchical.hpp ----
/// @file
/// topology::hierarchical: an allreduce runs as a node-local reduce-scatter,
/// a cross-node allreduce of each shard (one communicator per local rank),
/// and a node-local allgather. Only 1/L of the data crosses the network per
/// rank (L ranks per node), and the links between nodes carry each shard
/// once per node rather than once per rank: the slow links carry (n-1)/n of
/// what a flat ring of n ranks puts on them, n = N nodes instead of N x L ranks.


#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain::topology {

/// Node-local and cross-node communicators, split from the world.
struct hierarchical {
  static constexpr std::string_view name = "hierarchical";
  /// On host engines, a buffer of more than this many bytes travels in chunks
  /// of about this size (at most 8), pipelined: a chunk's node-local steps run
  /// while another chunk crosses the nodes. 0: one piece.
  static constexpr std::size_t default_chunk_bytes = std::size_t{2} << 20;

  /// The communicators of one user (DistributedDataParallel makes one):
  /// `local` (the ranks of this node, by local rank) and `cross` (the ranks
  /// with this local rank, one per node, by node rank), or the world alone
  /// when the nodes do not allow a hierarchy (see hierarchical()).
  template <communicator C>
  class group {
   public:
    /// Collective over `world`: every rank's layout is gathered over
    /// `control`; when every node holds the same number L > 1 of ranks and
    /// there are N > 1 nodes, `world` is split into `local` (color: node rank,
    /// key: local rank) and `cross` (color: local rank, key: node rank).
    /// Otherwise collectives run flat on `world`, and rank 0 prints one line
    /// saying why. `world` must outlive the group. `chunk_bytes`: see
    /// default_chunk_bytes (every rank must pass the same). Throws what
    /// split() throws, and backend_error when a split does not give the expected size.
    group(C& world, control_plane control, const node_layout& mine,
          std::size_t chunk_bytes = default_chunk_bytes)
        : world_(&world), chunk_bytes_(chunk_bytes) {
      const std::vector<node_layout> table = detail::gather_layouts(control, mine);
      why_flat_ = detail::hierarchy_problem(table);
      if (!why_flat_.empty()) {
        if (world.rank() == 0) {
          std::fprintf(stderr, "dtrain: topology::hierarchical runs flat on %d ranks: %s\n",
                       world.size(), why_flat_.c_str());
          std::fflush(stderr);
        }
        return;
      }
      local_.emplace(world.split(mine.node_rank, mine.local_rank));
      cross_.emplace(world.split(mine.local_rank, mine.node_rank));
      if (local_->size() != mine.local_size || local_->rank() != mine.local_rank ||
          cross_->size() != mine.num_nodes || cross_->rank() != mine.node_rank) {
        throw backend_error(
            "topology::hierarchical on rank " + std::to_string(world.rank()) + ": splitting " +
                std::string(C::name) + " gave local rank " + std::to_string(local_->rank()) +
                " of " + std::to_string(local_->size()) + " and cross rank " +
                std::to_string(cross_->rank()) + " of " + std::to_string(cross_->size()) +
                ", the layout says " + std::to_string(mine.local_rank) + " of " +
                std::to_string(mine.local_size) + " and " + std::to_string(mine.node_rank) +
                " of " + std::to_string(mine.num_nodes),
            0);
      }
    }
    group(const group&) = delete;
    group& operator=(const group&) = delete;

    [[nodiscard]] C& world() noexcept { return *world_; }
    /// Whether collectives run hierarchically; false when they run flat (why_flat() says why).
    [[nodiscard]] bool hierarchical() const noexcept { return local_.has_value(); }
    [[nodiscard]] const std::string& why_flat() const noexcept { return why_flat_; }
    /// The node-local communicator; only when hierarchical().
    [[nodiscard]] C& local() { return *local_; }
    /// The cross-node communicator of this local rank; only when hierarchical().
    [[nodiscard]] C& cross() { return *cross_; }

    /// A buffer whose length is a multiple of this many elements (the ranks
    /// per node) needs no extra collectives for a remainder.
    [[nodiscard]] std::size_t granularity() const noexcept {
      return local_ ? static_cast<std::size_t>(local_->size()) : 1;
    }
    /// Elements of scratch (`shard`) an allreduce of `count` elements needs.
    [[nodiscard]] std::size_t shard_count(std::size_t count) const noexcept {
      return local_ ? count / granularity() : 0;
    }
    /// "hierarchical (gloo): 2 nodes x 2 ranks", or "flat (gloo, 3 ranks): uneven nodes: ..."
    [[nodiscard]] std::string describe() const {
      if (!local_) {
        return "flat (" + std::string(C::name) + ", " + std::to_string(world_->size()) +
               " ranks): " + why_flat_;
      }
      return "hierarchical (" + std::string(C::name) + "): " + std::to_string(cross_->size()) +
             " nodes x " + std::to_string(local_->size()) + " ranks";
    }

    /// In place on `data`: the reduction over every rank. `shard` is scratch
    /// of at least shard_count(data.count) elements of data's type in the
    /// same memory, untouched by anyone else until the work completes (one
    /// per collective in flight). Steps: node-local reduce_scatter of the
    /// first L x q elements (q = count / L) into `shard`, cross-node allreduce
    /// of `shard`, node-local allgather back into `data`; the last count - L x q
    /// elements (fewer than L) are reduced by a node-local and a cross-node
    /// allreduce of their own. avg is avg at each step (sum / L, then / N).
    /// On an engine that orders collectives on streams (NCCL) every step is
    /// enqueued now, the first after `stream`; otherwise each step starts when
    /// the previous one has finished, inside test() / wait() of the returned
    /// work, so drive it from the thread that issues this group's collectives.
    /// Throws config_error for a `shard` of the wrong type, memory or size.
    work allreduce(buffer data, buffer shard, reduce_op op, stream_handle stream = nullptr) {
      return run(data, shard, op, stream, nullptr);
    }

    /// The same for host memory, with scratch of its own (held by the work).
    work allreduce(buffer data, reduce_op op) {
      if (!local_ || data.count < granularity()) return run(data, {}, op, nullptr, nullptr);
      if (data.where != memory::host) {
        throw config_error(describe_call(data, op) +
                           ": device memory needs a shard buffer of the caller's "
                           "(allreduce(data, shard, op, stream))");
      }
      auto scratch =
          std::make_shared<std::vector<std::byte>>(shard_count(data.count) * size_of(data.type));
      buffer shard{scratch->data(), shard_count(data.count), data.type, memory::host};
      return run(data, shard, op, nullptr, std::move(scratch));
    }

    /// Makes `stream` wait, on the device, for every collective so far (engines on streams).
    void stream_wait(stream_handle stream) requires requires(C& c, stream_handle s) {
      c.stream_wait(s);
    }
    {
      world_->stream_wait(stream);
      if (local_) {
        local_->stream_wait(stream);
        cross_->stream_wait(stream);
      }
    }

   private:
    [[nodiscard]] std::string describe_call(const buffer& data, reduce_op op) const {
      return detail::describe("hierarchical allreduce",
                              std::string(to_string(op)) + ", " + detail::shape(data),
                              world_->rank(), world_->size(), C::name);
    }

    work run(buffer data, buffer shard, reduce_op op, stream_handle stream,
             std::shared_ptr<void> keep_alive) {
      const std::size_t per_node = granularity();
      const std::size_t q = local_ ? data.count / per_node : 0;
      if (q == 0) return detail::allreduce_on(*world_, data, data, op, stream);
      detail::argument_check check{describe_call(data, op)};
      check.same_type(data, shard);
      if (shard.count < q) {
        check.fail("shard has " + std::to_string(shard.count) + " elements, needs " +
                   std::to_string(q) + " (shard_count(" + std::to_string(data.count) + "))");
      }
      check.op_fits(op, data.type);
      buffer head = data;
      head.count = q * per_node;
      buffer part = shard;
      part.count = q;
      buffer rest = data;
      rest.data = static_cast<std::byte*>(data.data) + head.bytes();
      rest.count = data.count - head.count;

      C& local = *local_;
      C& cross = *cross_;
      // Lanes: the communicators, each a queue of its own. On a host engine a
      // large buffer travels in chunks, so that a chunk's node-local
      // reduce-scatter overlaps the previous chunk's cross-node allreduce
      // (bound by the slow link) and its allgather the next one's.
      enum : int { on_local = 1, on_cross = 2 };
      const std::size_t chunks = detail::stream_ordered<C> ? 1 : chunk_count(head.bytes());
      std::vector<detail::work_sequence::step> rs, cross_steps, ag;
      for (std::size_t c = 0, begin = 0; c < chunks; ++c) {
        const std::size_t n = q / chunks + (c < q % chunks ? 1 : 0);  // shard elements of chunk c
        buffer in = head, mine = part;
        in.data = static_cast<std::byte*>(head.data) + begin * per_node * size_of(head.type);
        in.count = n * per_node;
        mine.data = static_cast<std::byte*>(part.data) + begin * size_of(part.type);
        mine.count = n;
        begin += n;
        const std::string which =
            chunks > 1 ? " (chunk " + std::to_string(c + 1) + " of " + std::to_string(chunks) + ")"
                       : "";
        rs.push_back(
            {"node-local reduce_scatter over " + std::to_string(local.size()) + " ranks" + which,
             [&local, in, mine, op, stream] {
               return detail::reduce_scatter_on(local, in, mine, op, stream);
             },
             on_local, -1});
        cross_steps.push_back(
            {"cross-node allreduce over " + std::to_string(cross.size()) + " nodes" + which,
             [&local, &cross, mine, op] {
               return detail::allreduce_on(cross, mine, mine, op, detail::stream_after(local));
             },
             on_cross, -1});
        ag.push_back(
            {"node-local allgather over " + std::to_string(local.size()) + " ranks" + which,
             [&local, &cross, mine, in] {
               return detail::allgather_on(local, mine, in, detail::stream_after(cross));
             },
             on_local, -1});
      }
      if (rest.count > 0) {
        rs.push_back(
            {"node-local allreduce of the last " + std::to_string(rest.count) + " elements",
             [&local, rest, op] {
               return detail::allreduce_on(local, rest, rest, op, detail::stream_after(local));
             },
             on_local, -1});
        cross_steps.push_back(
            {"cross-node allreduce of the last " + std::to_string(rest.count) + " elements",
             [&cross, rest, op] {
               return detail::allreduce_on(cross, rest, rest, op, detail::stream_after(cross));
             },
             on_cross, -1});
      }
      // List order is each lane's order: every reduce-scatter, then the
      // cross-node steps, then the allgathers; each waits for its own chunk's step before.
      std::vector<detail::work_sequence::step> steps;
      const int crosses = static_cast<int>(rs.size());
      for (auto& x : rs) steps.push_back(std::move(x));
      for (std::size_t i = 0; i < cross_steps.size(); ++i) {
        cross_steps[i].after = static_cast<int>(i);
        steps.push_back(std::move(cross_steps[i]));
      }
      for (std::size_t i = 0; i < ag.size(); ++i) {
        ag[i].after = crosses + static_cast<int>(i);
        steps.push_back(std::move(ag[i]));
      }
      return work(std::make_shared<detail::work_sequence>(describe_call(data, op), std::move(steps),
                                                          detail::stream_ordered<C>,
                                                          std::move(keep_alive)));
    }

    // Chunks of a host buffer of `bytes`: about chunk_bytes_ each, at most 8.
    [[nodiscard]] std::size_t chunk_count(std::size_t bytes) const noexcept {
      if (chunk_bytes_ == 0) return 1;
      return std::clamp<std::size_t>(bytes / chunk_bytes_, 1, 8);
    }

    C* world_;
    std::optional<C> local_;
    std::optional<C> cross_;
    std::string why_flat_;
    std::size_t chunk_bytes_;
  };
};

}  // namespace dtrain::topology
// ---- end dtrain/topology/hierarchical.hpp ----

#include <concepts>
#include <string>
#include <string_view>
#include <type_traits>

namespace dtrain {

namespace launch {
/// Every process was started by the outside launcher (mpirun, srun, torchrun).
struct per_process {
  static constexpr launch_mode mode = launch_mode::per_process;
};
/// This process is its node's agent and starts the node's workers.
struct per_node {
  static constexpr launch_mode mode = launch_mode::per_node;
};
}  // namespace launch

namespace backend {
/// MPI (host memory; device memory too when CUDA is available).
struct mpi {
  static constexpr bool available = DTRAIN_HAS_MPI() != 0;
  static constexpr std::string_view name = "mpi";
  static constexpr std::string_view missing =
      "dtrain was built without MPI: install Open MPI (Debian: libopenmpi-dev) and link "
      "dtrain::dtrain, "
      "or define DTRAIN_WITH_MPI=1 and link MPI yourself";
};
/// Gloo over TCP (host memory).
struct gloo {
  static constexpr bool available = DTRAIN_HAS_GLOO() != 0;
  static constexpr std::string_view name = "gloo";
  static constexpr std::string_view missing =
      "dtrain was built without Gloo: install it (Debian: libgloo-dev) and link dtrain::dtrain, or "
      "define "
      "DTRAIN_WITH_GLOO=1 and link gloo yourself";
};
/// NCCL (device memory).
struct nccl {
  static constexpr bool available = DTRAIN_HAS_NCCL() != 0;
  static constexpr std::string_view name = "nccl";
  static constexpr std::string_view missing =
      "dtrain was built without NCCL: install the CUDA toolkit with NCCL and link dtrain::dtrain, "
      "or define "
      "DTRAIN_WITH_NCCL=1 and link nccl and cudart yourself";
};

}  // namespace backend

/// What a context hands a backend to build its communicator from.
template <class Store>
struct communicator_setup {
  Store* store = nullptr;  ///< the job's store; null where the backend needs none (MPI)
  int rank = 0;
  int size = 1;
  int device = -1;  ///< the CUDA device of this rank (backends that use GPUs), else -1
  collective_options collectives{};
  std::string master_addr;  ///< MASTER_ADDR as discovered, or empty
  const environment* env = nullptr;
};

/// Everything a backend implies, in one place: its communicator, the memory
/// space DistributedDataParallel keeps gradients in (which also decides how
/// buckets travel: a host thread, or CUDA streams), whether ranks use GPUs,
/// whether the communicator needs the store (needs_store), how it is made,
/// and, optionally, a channel that works before any store exists
/// (pre_store_relay, see detail::has_pre_store_relay). Adding an engine adds
/// one specialisation here. A backend of one's own (tests do) specialises it
/// too; what it does not declare is off.
template <class Backend>
struct backend_traits;

namespace detail {
/// Whether backend traits `T` can broadcast before the store exists:
/// `T::pre_store_relay(communicator&)` returns a broadcast_relay from rank 0
/// (rendezvous/broadcast.hpp). With it, rank 0 sends the others the store
/// token and, without MASTER_ADDR, the store's address; the communicator is
/// then made before the store (needs_store = false). MPI has one.
template <class T>
concept has_pre_store_relay = requires(typename T::communicator& c) {
  { T::pre_store_relay(c) } -> broadcast_relay;
};
}  // namespace detail

#if DTRAIN_HAS_MPI()
template <>
struct backend_traits<backend::mpi> {
  using communicator = mpi_communicator;
  using memory_space = host_memory;
  static constexpr bool uses_gpus = false;
  /// MPI knows its world before any store exists...
  static constexpr bool needs_store = false;
  template <class Store>
  static communicator make(const communicator_setup<Store>& s) {
    mpi_options options{.collectives = s.collectives};
    if (s.env) options = options.with_env(*s.env);
    return mpi_communicator::world(std::move(options));
  }
  /// ... and carries rank 0's store token and address to every rank.
  static detail::mpi_relay pre_store_relay(communicator& c) {
    return detail::mpi_relay(c.native(), 0);
  }
};
#endif
#if DTRAIN_HAS_GLOO()
template <>
struct backend_traits<backend::gloo> {
  using communicator = gloo_communicator;
  using memory_space = host_memory;
  static constexpr bool uses_gpus = false;
  static constexpr bool needs_store = true;
  template <class Store>
  static communicator make(const communicator_setup<Store>& s) {
    return gloo_communicator(*s.store, s.rank, s.size,
                             gloo_options{.collectives = s.collectives,
                                          .master_addr = s.master_addr,
                                          .env = s.env ? *s.env : environment{}});
  }
};
#endif
#if DTRAIN_HAS_NCCL()
template <>
struct backend_traits<backend::nccl> {
  using communicator = nccl_communicator;
  using memory_space = cuda_memory;
  static constexpr bool uses_gpus = true;
  static constexpr bool needs_store = true;
  template <class Store>
  static communicator make(const communicator_setup<Store>& s) {
    return nccl_communicator(*s.store, s.rank, s.size, s.device,
                             nccl_options{.collectives = s.collectives}.with_env(*s.env));
  }
};
#endif

namespace detail {
/// What policy<> uses in place of backend_traits<B> when B is not compiled in:
/// a communicator that is only declared, so that the policy's static_assert
/// is the one error, not the first of many. Nothing here is ever defined.
struct missing_backend_traits {
  struct communicator {
    static constexpr bool reaches_device_memory = false;
    static constexpr bool reaches_host_memory = true;
    static constexpr std::string_view name = "not compiled in";
    int rank() const;
    int size() const;
    bool valid() const;
    work allreduce(buffer, buffer, reduce_op);
    work broadcast(buffer, int);
    work allgather(buffer, buffer);
    work reduce_scatter(buffer, buffer, reduce_op);
    work barrier();
    communicator split(int, int);
  };
  using memory_space = host_memory;
  static constexpr bool uses_gpus = false;
  static constexpr bool needs_store = false;
  template <class Store>
  static communicator make(const communicator_setup<Store>&);
};
}  // namespace detail

template <class T>
concept launch_policy =
    std::is_same_v<T, launch::per_process> || std::is_same_v<T, launch::per_node>;
/// A backend tag: backend::mpi, backend::gloo, backend::nccl, or one's own
/// with a backend_traits specialisation.
template <class T>
concept backend_policy = requires {
  { T::name } -> std::convertible_to<std::string_view>;
  { T::available } -> std::convertible_to<bool>;
};
/// A topology tag: topology::flat or topology::hierarchical.
template <class T>
concept topology_policy =
    std::is_same_v<T, topology::flat> || std::is_same_v<T, topology::hierarchical>;

/// The choices of a job, e.g. policy<launch::per_node, backend::nccl, topology::flat>.
template <launch_policy Launch, backend_policy Backend, topology_policy Topology = topology::flat>
struct policy {
  static_assert(
      Backend::available,
      "the backend of this dtrain::policy is not compiled in: see the backend's `missing` text "
      "(backend::mpi needs DTRAIN_WITH_MPI, backend::gloo DTRAIN_WITH_GLOO, backend::nccl "
      "DTRAIN_WITH_NCCL)");
  static_assert(!(std::is_same_v<Launch, launch::per_node> &&
                  std::is_same_v<Backend, backend::mpi>),
                "launch::per_node starts the workers itself, but MPI processes must be started by "
                "mpirun or srun: use launch::per_process with backend::mpi, or backend::gloo / "
                "backend::nccl with launch::per_node");
  using launch_type = Launch;
  using backend_type = Backend;
  using topology_type = Topology;
  // A backend that is not compiled in has no traits: a stand-in keeps the
  // static_assert above the only error, instead of the first of many.
  using traits = std::conditional_t<Backend::available, backend_traits<Backend>,
                                    detail::missing_backend_traits>;
  using communicator_type = typename traits::communicator;
  static_assert(communicator<communicator_type>);
  static_assert(!detail::has_pre_store_relay<traits> || !traits::needs_store,
                "a backend whose traits have a pre_store_relay carries values before the store "
                "exists, so its communicator must be made without one: set needs_store = false");
  /// Where DistributedDataParallel keeps gradients: host_memory or cuda_memory.
  using memory_space = typename traits::memory_space;
  /// Whether gradients may live on the GPU with this backend.
  static constexpr bool reaches_device_memory = communicator_type::reaches_device_memory;
  static_assert(!std::is_same_v<Topology, topology::hierarchical> || !memory_space::on_stream ||
                    detail::stream_ordered<communicator_type>,
                "topology::hierarchical enqueues its three steps on streams at once, each after "
                "the last: a backend whose buckets travel on streams needs a communicator that "
                "orders its collectives after the stream it is given (stream_ordered and "
                "stream(), as nccl_communicator)");
};

}  // namespace dtrain
// ---- end dtrain/policy.hpp ----
// ---- begin dtrain/rendezvous/server.hpp ----
/// @file
/// store_server: the key-value store every rank meets at. It admits
/// connections (caps, eviction of strangers, the token handshake), reads each
/// request, hands it to the handler of its operation, and writes the reply:
/// one coroutine per connection (server_connection.hpp) on an epoll reactor,
/// on one background thread. What the store holds and what its operations
/// mean is kv_state (kv_state.hpp).

// ---- begin dtrain/rendezvous/operations.hpp ----
/// @file
/// The store's operations as the wire carries them (protocol.hpp): one
/// handler per operation code, each of which parses its request's fields,
/// asks the state (kv_state.hpp) and builds the reply. A get or wait on a
/// missing key suspends its connection until the key is set, the deadline
/// passes or the client goes away. Runs on the server's reactor thread.

// ---- begin dtrain/rendezvous/kv_state.hpp ----
/// @file
/// What the store holds and what its operations mean, apart from how clients
/// reach it: the keys and values, who waits for which key, and the cap on the
/// bytes stored. The server (server.hpp) parses a request and calls one
/// function here; no socket, coroutine or reactor is involved, so the store's
/// meaning is tested without a connection (tests/unit/test_kv_state.cpp).
/// Like the server's reactor, it is used from one thread.


#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

namespace dtrain::detail {

/// A request the store understood and refused (a counter that is not a
/// number, a value past the cap). The message goes to the client in an error
/// reply, and its connection stays open.
class store_refusal : public rendezvous_error {
 public:
  using rendezvous_error::rendezvous_error;
};

/// Whoever waits for keys to be set: called once a key it watches is set.
/// The server's resumes the waiting connection.
using kv_waiter = std::function<void()>;

/// The store's keys and values, their waiters and the stored-bytes cap.
class kv_state {
  // Transparent hashing: look keys up by string_view without copying them.
  struct key_hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept {
      return std::hash<std::string_view>{}(s);
    }
  };
  template <class T>
  using by_key = std::unordered_map<std::string, T, key_hash, std::equal_to<>>;

 public:
  /// A state that refuses to hold more than `max_stored_bytes` of keys and
  /// values (store_limits::max_stored_bytes).
  explicit kv_state(std::uint64_t max_stored_bytes) : cap_(max_stored_bytes) {}
  kv_state(const kv_state&) = delete;
  kv_state& operator=(const kv_state&) = delete;

  /// A waiter's registration for keys; it ends, and the waiter is forgotten,
  /// when this is destroyed (the wait is over or its client went away).
  class watch {
   public:
    watch(kv_state& state, const kv_waiter& waiter, std::vector<std::string> keys)
        : state_(&state), waiter_(&waiter), keys_(std::move(keys)) {
      for (const auto& k : keys_) state_->waiters_[k].push_back(waiter_);
    }
    watch(const watch&) = delete;
    watch& operator=(const watch&) = delete;
    ~watch();
    /// The keys watched, in the order given.
    [[nodiscard]] const std::vector<std::string>& keys() const noexcept { return keys_; }

   private:
    kv_state* state_;
    const kv_waiter* waiter_;
    std::vector<std::string> keys_;
  };

  /// The value at `key`, or null; valid until the next change.
  [[nodiscard]] const std::string* find(std::string_view key) const;

  /// Which of `keys` are not set, in their order.
  [[nodiscard]] std::vector<std::string> missing(std::span<const std::string_view> keys) const;

  /// Whether every one of `keys` is set (true for none).
  [[nodiscard]] bool check(std::span<const std::string_view> keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](auto k) { return data_.contains(k); });
  }

  /// Sets `key` to `value` and wakes its waiters. Throws store_refusal,
  /// changing nothing, when the stored bytes would pass the cap.
  void set(std::string_view key, std::string_view value) {
    if (!store(key, value)) throw over_capacity("set", key, value.size());
  }

  /// Adds `delta` to the decimal integer at `key` (0 when missing) and returns
  /// the sum. Throws store_refusal when the key holds something else, the sum
  /// would overflow, or the cap would be passed.
  std::int64_t add(std::string_view key, std::int64_t delta);

  /// Sets `key` to `desired` if it holds `expected` (a missing key matches an
  /// empty `expected`), and returns what it holds then (empty when missing),
  /// valid until the next change. Throws store_refusal as set() does.
  std::string_view compare_set(std::string_view key, std::string_view expected,
                               std::string_view desired);

  /// Removes `key`; false if it was not set. Its waiters go on waiting.
  bool erase(std::string_view key);

  /// Keys set.
  [[nodiscard]] std::size_t size() const noexcept { return data_.size(); }
  /// Bytes of the keys and values held, the figure the cap bounds.
  [[nodiscard]] std::uint64_t stored_bytes() const noexcept { return stored_; }
  /// Keys that someone waits for.
  [[nodiscard]] std::size_t watched_keys() const noexcept { return waiters_.size(); }

 private:
  // Sets key to value and wakes its waiters; false, changing nothing, when the
  // stored bytes would pass the cap (a change that does not grow them always passes).
  bool store(std::string_view key, std::string_view value);

  store_refusal over_capacity(const char* what, std::string_view key, std::size_t value_size) const;

  std::uint64_t cap_;
  std::uint64_t stored_ = 0;
  by_key<std::string> data_;
  by_key<std::vector<const kv_waiter*>> waiters_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE kv_state::watch::~watch() {
  for (const auto& k : keys_) {
    auto it = state_->waiters_.find(k);
    if (it == state_->waiters_.end()) continue;  // set meanwhile: its waiters were woken
    std::erase(it->second, waiter_);
    if (it->second.empty()) state_->waiters_.erase(it);
  }
}

DTRAIN_DETAIL_INLINE const std::string* kv_state::find(std::string_view key) const {
  auto it = data_.find(key);
  return it == data_.end() ? nullptr : &it->second;
}

DTRAIN_DETAIL_INLINE std::vector<std::string> kv_state::missing(
    std::span<const std::string_view> keys) const {
  std::vector<std::string> out;
  for (auto k : keys) {
    if (!data_.contains(k)) out.emplace_back(k);
  }
  return out;
}

DTRAIN_DETAIL_INLINE std::int64_t kv_state::add(std::string_view key, std::int64_t delta) {
  std::int64_t current = 0;
  if (const std::string* text = find(key)) {
    auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), current);
    if (ec != std::errc() || end != text->data() + text->size()) {
      throw store_refusal("add(\"" + std::string(key) +
                          "\"): the key holds a value that is not an integer");
    }
  }
  std::int64_t next = 0;
  if (__builtin_add_overflow(current, delta, &next)) {
    throw store_refusal("add(\"" + std::string(key) + "\"): the counter would overflow");
  }
  if (!store(key, std::to_string(next))) throw over_capacity("add", key, 20);
  return next;
}

DTRAIN_DETAIL_INLINE std::string_view kv_state::compare_set(std::string_view key,
                                                            std::string_view expected,
                                                            std::string_view desired) {
  const std::string* current = find(key);
  const bool matches = current ? *current == expected : expected.empty();
  if (matches && !store(key, desired)) throw over_capacity("compare_set", key, desired.size());
  current = find(key);
  return current ? std::string_view(*current) : std::string_view{};
}

DTRAIN_DETAIL_INLINE bool kv_state::erase(std::string_view key) {
  auto it = data_.find(key);
  if (it == data_.end()) return false;
  stored_ -= it->first.size() + it->second.size();
  data_.erase(it);
  return true;
}

DTRAIN_DETAIL_INLINE bool kv_state::store(std::string_view key, std::string_view value) {
  auto it = data_.find(key);
  const std::uint64_t before = it == data_.end() ? 0 : key.size() + it->second.size();
  const std::uint64_t after = stored_ - before + key.size() + value.size();
  if (after > cap_ && after > stored_) return false;
  stored_ = after;
  if (it != data_.end()) {
    it->second.assign(value);
  } else {
    data_.emplace(std::string(key), std::string(value));
  }
  if (auto w = waiters_.find(key); w != waiters_.end()) {
    auto woken = std::move(w->second);
    waiters_.erase(w);
    for (const kv_waiter* waiter : woken) (*waiter)();
  }
  return true;
}

DTRAIN_DETAIL_INLINE store_refusal kv_state::over_capacity(const char* what, std::string_view key,
                                                           std::size_t value_size) const {
  return store_refusal(std::string(what) + "(\"" + std::string(key.substr(0, 200)) + "\") of " +
                       std::to_string(value_size) + " bytes: the store holds " +
                       std::to_string(stored_) + " bytes and its cap is " + std::to_string(cap_) +
                       " (store_limits::max_stored_bytes, DTRAIN_STORE_MAX_BYTES)");
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/rendezvous/kv_state.hpp ----
// ---- begin dtrain/rendezvous/reactor.hpp ----
/// @file
/// A small epoll reactor for C++20 coroutines, and the task type the store's
/// server is written in. One thread runs the reactor; every coroutine runs on
/// it, so the server's state needs no locks.


#include <algorithm>
#include <atomic>
#include <chrono>
#include <coroutine>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include <sys/epoll.h>
#include <sys/eventfd.h>

namespace dtrain::detail {

using steady = std::chrono::steady_clock;

/// A lazily started coroutine returning T, awaitable from another task.
///
/// Awaiting a task runs it at once on the awaiter's stack, as a call would.
/// If it finishes without suspending, its frame has returned before the
/// awaiter goes on, so a loop over requests that never suspend (a client
/// pipelining thousands of them) keeps a bounded stack. This does not rest
/// on the compiler turning symmetric transfer into a tail call, which GCC
/// does only at -O2: the store must not crash at -O0 or under sanitizers.
/// Only a task that suspended (on the reactor) resumes its awaiter from its
/// final suspension, one frame deep per level of nesting.
template <class T = void>
class task;

namespace task_impl {

struct promise_base {
  std::coroutine_handle<> continuation{};
  std::exception_ptr error{};
  bool running_inline = false;  // started by an awaiter that is still on the stack below it

  struct final_awaiter {
    bool await_ready() const noexcept { return false; }
    template <class P>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<P> h) const noexcept {
      const promise_base& p = h.promise();
      // Finished inline: the awaiter's await_suspend is below us and goes on by returning.
      if (p.running_inline || !p.continuation) return std::noop_coroutine();
      return p.continuation;
    }
    void await_resume() const noexcept {}
  };

  std::suspend_always initial_suspend() const noexcept { return {}; }
  final_awaiter final_suspend() const noexcept { return {}; }
  void unhandled_exception() noexcept { error = std::current_exception(); }
};

template <class T>
struct promise : promise_base {
  std::optional<T> value{};
  task<T> get_return_object() noexcept;
  void return_value(T v) { value = std::move(v); }
  T take() {
    if (error) std::rethrow_exception(error);
    return std::move(*value);
  }
};

template <>
struct promise<void> : promise_base {
  task<void> get_return_object() noexcept;
  void return_void() const noexcept {}
  void take() const {
    if (error) std::rethrow_exception(error);
  }
};

}  // namespace task_impl

template <class T>
class task {
 public:
  using promise_type = task_impl::promise<T>;
  using handle_type = std::coroutine_handle<promise_type>;

  task() = default;
  explicit task(handle_type h) noexcept : h_(h) {}
  task(task&& other) noexcept : h_(std::exchange(other.h_, {})) {}
  task& operator=(task&& other) noexcept {
    if (this != &other) {
      if (h_) h_.destroy();
      h_ = std::exchange(other.h_, {});
    }
    return *this;
  }
  task(const task&) = delete;
  task& operator=(const task&) = delete;
  ~task() {
    if (h_) h_.destroy();
  }

  /// Runs a top-level task until its first suspension.
  void start() { h_.resume(); }
  [[nodiscard]] bool done() const noexcept { return !h_ || h_.done(); }
  /// The exception a finished top-level task ended with, if any.
  [[nodiscard]] std::exception_ptr error() const noexcept {
    return h_ ? h_.promise().error : nullptr;
  }

  auto operator co_await() && noexcept {
    struct awaiter {
      handle_type h;
      bool await_ready() const noexcept { return false; }
      // Runs the task now; true (stay suspended) only if it suspended before finishing.
      bool await_suspend(std::coroutine_handle<> caller) noexcept {
        auto& p = h.promise();
        p.continuation = caller;
        p.running_inline = true;
        h.resume();
        if (h.done()) return false;
        p.running_inline = false;  // from now on its final suspension resumes the caller
        return true;
      }
      T await_resume() { return h.promise().take(); }
    };
    return awaiter{h_};
  }

 private:
  handle_type h_{};
};

namespace task_impl {
template <class T>
task<T> promise<T>::get_return_object() noexcept {
  return task<T>(std::coroutine_handle<promise<T>>::from_promise(*this));
}
inline task<void> promise<void>::get_return_object() noexcept {
  return task<void>(std::coroutine_handle<promise<void>>::from_promise(*this));
}
}  // namespace task_impl

/// Why a suspended coroutine was resumed.
enum class wake { none, io, timeout, event, stop };

/// The pending wait of one coroutine chain (one connection, or the acceptor).
struct wait_slot {
  std::coroutine_handle<> handle{};
  wake reason = wake::none;
  int fd = -1;
  bool io_armed = false;
  bool has_timer = false;
  std::multimap<steady::time_point, wait_slot*>::iterator timer{};
};

/// epoll, a timer queue and a ready queue. Not thread-safe except
/// request_stop(); everything else is called on the thread that runs it.
class reactor {
 public:
  reactor();
  reactor(const reactor&) = delete;
  reactor& operator=(const reactor&) = delete;

  /// Watches `fd` for `slot` (disarmed until a wait arms it).
  void add(int fd, wait_slot& slot);

  /// Stops watching the slot's fd and forgets the slot; pending events for it are dropped.
  void remove(wait_slot& slot);

  /// Awaitable: suspends until `slot`'s fd has `events` (0: none), the
  /// deadline passes, wake_up(slot) is called, or the reactor stops.
  struct until {
    reactor& r;
    wait_slot& slot;
    std::uint32_t events;
    std::optional<steady::time_point> deadline;

    bool await_ready() const noexcept { return r.stopping_; }
    void await_suspend(std::coroutine_handle<> h);
    wake await_resume();
  };

  until wait(wait_slot& slot, std::uint32_t events, std::optional<steady::time_point> deadline) {
    return until{*this, slot, events, deadline};
  }

  /// Resumes a suspended slot with wake::event, after the running coroutine suspends.
  void wake_up(wait_slot& slot) { make_ready(slot, wake::event); }
  /// Resumes a suspended slot with wake::stop, as stop_all does for one slot.
  void cancel(wait_slot& slot) { make_ready(slot, wake::stop); }

  /// One round: resume what is ready, wait for I/O or the next timer (at most
  /// `cap`), dispatch. Returns false once a stop was requested.
  bool run_once(std::chrono::milliseconds cap);

  /// Thread-safe: makes run_once return false soon.
  void request_stop() noexcept;
  [[nodiscard]] bool stop_requested() const noexcept { return stop_flag_.load(); }

  /// After a stop: every await completes at once with wake::stop, and every
  /// suspended slot is resumed so its coroutine can say goodbye and finish.
  void stop_all(const std::vector<wait_slot*>& suspended);

 private:
  void arm(wait_slot& slot, std::uint32_t events);

  void disarm(wait_slot& slot);

  void make_ready(wait_slot& slot, wake why);

  void drain_ready();

  unique_fd epoll_;
  unique_fd wakeup_;
  std::atomic<bool> stop_flag_{false};
  bool stopping_ = false;
  std::uint64_t next_id_ = 1;
  std::unordered_map<std::uint64_t, wait_slot*> slots_;
  std::unordered_map<const wait_slot*, std::uint64_t> ids_;
  std::multimap<steady::time_point, wait_slot*> timers_;
  std::deque<wait_slot*> ready_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE reactor::reactor()
    : epoll_(DTRAIN_SYSCALL(::epoll_create1(EPOLL_CLOEXEC))),
      wakeup_(DTRAIN_SYSCALL(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK))) {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;  // id 0 is the wakeup eventfd
  DTRAIN_SYSCALL(::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, wakeup_.get(), &ev));
}

DTRAIN_DETAIL_INLINE void reactor::add(int fd, wait_slot& slot) {
  slot.fd = fd;
  std::uint64_t id = next_id_++;
  ids_[&slot] = id;
  slots_[id] = &slot;
  epoll_event ev{};
  ev.events = EPOLLONESHOT;
  ev.data.u64 = id;
  DTRAIN_SYSCALL(::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev));
}

DTRAIN_DETAIL_INLINE void reactor::remove(wait_slot& slot) {
  disarm(slot);
  if (slot.fd >= 0) ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, slot.fd, nullptr);
  if (auto it = ids_.find(&slot); it != ids_.end()) {
    slots_.erase(it->second);
    ids_.erase(it);
  }
  std::erase(ready_, &slot);
}

DTRAIN_DETAIL_INLINE void reactor::until::await_suspend(std::coroutine_handle<> h) {
  slot.handle = h;
  slot.reason = wake::none;
  if (events != 0) r.arm(slot, events);
  if (deadline) {
    slot.timer = r.timers_.emplace(*deadline, &slot);
    slot.has_timer = true;
  }
}

DTRAIN_DETAIL_INLINE wake reactor::until::await_resume() {
  if (r.stopping_) {
    r.disarm(slot);
    return wake::stop;
  }
  r.disarm(slot);
  return slot.reason;
}

DTRAIN_DETAIL_INLINE bool reactor::run_once(std::chrono::milliseconds cap) {
  drain_ready();
  if (stop_requested()) return false;
  int timeout = static_cast<int>(cap.count());
  if (!timers_.empty()) {
    auto until_next =
        std::chrono::ceil<std::chrono::milliseconds>(timers_.begin()->first - steady::now());
    timeout = static_cast<int>(std::clamp<std::int64_t>(until_next.count(), 0, timeout));
  }
  epoll_event events[256];
  int n = ::epoll_wait(epoll_.get(), events, 256, timeout);
  if (n < 0 && errno != EINTR) DTRAIN_SYSCALL(n);
  for (int i = 0; i < n; ++i) {
    if (events[i].data.u64 == 0) {
      std::uint64_t drained = 0;
      (void)!::read(wakeup_.get(), &drained, sizeof drained);
      continue;
    }
    auto it = slots_.find(events[i].data.u64);
    if (it == slots_.end()) continue;
    it->second->io_armed = false;  // EPOLLONESHOT disarmed it
    make_ready(*it->second, wake::io);
  }
  auto now = steady::now();
  while (!timers_.empty() && timers_.begin()->first <= now) {
    wait_slot* slot = timers_.begin()->second;
    timers_.erase(timers_.begin());
    slot->has_timer = false;
    make_ready(*slot, wake::timeout);
  }
  drain_ready();
  return !stop_requested();
}

DTRAIN_DETAIL_INLINE void reactor::request_stop() noexcept {
  stop_flag_.store(true);
  std::uint64_t one = 1;
  (void)!::write(wakeup_.get(), &one, sizeof one);
}

DTRAIN_DETAIL_INLINE void reactor::stop_all(const std::vector<wait_slot*>& suspended) {
  stopping_ = true;
  for (wait_slot* s : suspended) make_ready(*s, wake::stop);
  drain_ready();
}

DTRAIN_DETAIL_INLINE void reactor::arm(wait_slot& slot, std::uint32_t events) {
  epoll_event ev{};
  ev.events = events | EPOLLONESHOT;
  ev.data.u64 = ids_.at(&slot);
  DTRAIN_SYSCALL(::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, slot.fd, &ev));
  slot.io_armed = true;
}

DTRAIN_DETAIL_INLINE void reactor::disarm(wait_slot& slot) {
  if (slot.io_armed) {
    epoll_event ev{};
    ev.events = EPOLLONESHOT;
    ev.data.u64 = ids_.at(&slot);
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, slot.fd, &ev);
    slot.io_armed = false;
  }
  if (slot.has_timer) {
    timers_.erase(slot.timer);
    slot.has_timer = false;
  }
}

DTRAIN_DETAIL_INLINE void reactor::make_ready(wait_slot& slot, wake why) {
  if (!slot.handle || slot.reason != wake::none) return;  // not waiting, or already woken
  slot.reason = why;
  ready_.push_back(&slot);
}

DTRAIN_DETAIL_INLINE void reactor::drain_ready() {
  while (!ready_.empty()) {
    wait_slot* slot = ready_.front();
    ready_.pop_front();
    auto h = std::exchange(slot->handle, {});
    if (h) h.resume();
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/rendezvous/reactor.hpp ----
// ---- begin dtrain/rendezvous/server_connection.hpp ----
/// @file
/// One client's connection on the store server: its socket, the slot its
/// coroutine waits on, and the reads and writes of that coroutine, each
/// bounded by a deadline, with the bytes it buffers taken from the budget
/// that every connection shares. Runs on the server's reactor thread.

// ---- begin dtrain/rendezvous/server_limits.hpp ----
/// @file
/// What keeps the store server's resources bounded: a byte budget shared by
/// its connections, a spare descriptor for refusing connections when the
/// process has run out, and a log that summarises floods instead of writing
/// a line per rejected connection. All run on the server's reactor thread.


#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

namespace dtrain::detail {

/// Bytes that connections may hold at once. A connection that cannot take
/// what it needs waits (server_connection::reserve); give_back wakes the waiters.
class byte_budget {
 public:
  explicit byte_budget(std::uint64_t cap) : cap_(cap) {}

  [[nodiscard]] bool try_take(std::uint64_t n);
  void give_back(reactor& r, std::uint64_t n);
  void wait_here(wait_slot& s) { waiters_.push_back(&s); }
  void stop_waiting(wait_slot& s) { std::erase(waiters_, &s); }
  [[nodiscard]] std::uint64_t cap() const noexcept { return cap_; }
  /// Bytes held now. Unlike the rest, callable from any thread (for stats()).
  [[nodiscard]] std::uint64_t used() const noexcept { return used_.load(); }

 private:
  std::uint64_t cap_;
  // Changed on the reactor thread only; atomic so that stats() can read it from others.
  std::atomic<std::uint64_t> used_{0};
  std::deque<wait_slot*> waiters_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE bool byte_budget::try_take(std::uint64_t n) {
  const std::uint64_t used = used_.load();
  if (n > cap_ - used) return false;
  used_.store(used + n);
  return true;
}

DTRAIN_DETAIL_INLINE void byte_budget::give_back(reactor& r, std::uint64_t n) {
  const std::uint64_t used = used_.load();
  used_.store(used - std::min(n, used));
  for (wait_slot* s : waiters_) r.wake_up(*s);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The connections the server can hold: its option, lowered to what the
/// descriptor limit leaves after `reserve` descriptors for everything else.
/// Raises the soft RLIMIT_NOFILE towards the hard limit first, as servers
/// that expect thousands of clients do.
DTRAIN_DETAIL_INLINE std::size_t connection_capacity(std::size_t wanted, std::size_t reserve = 64);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::size_t connection_capacity(std::size_t wanted, std::size_t reserve) {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return wanted;
  const rlim_t need = static_cast<rlim_t>(wanted + reserve);
  if (lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < need) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max == RLIM_INFINITY ? need : std::min(need, lim.rlim_max);
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  if (lim.rlim_cur == RLIM_INFINITY) return wanted;
  const auto limit = static_cast<std::size_t>(lim.rlim_cur);
  return std::min(wanted, limit > reserve ? limit - reserve : std::size_t{1});
}
#endif  // DTRAIN_DETAIL_BODIES()

/// One descriptor kept open so that, when accept() fails for lack of
/// descriptors, the server can still take the pending connection off the
/// queue and close it, instead of leaving it to spin on the listen socket.
class spare_descriptor {
 public:
  spare_descriptor() { open(); }
  /// Accepts one pending connection on `listener` and closes it; true if one was.
  bool refuse_one(int listener);

 private:
  void open() { fd_.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC)); }
  unique_fd fd_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE bool spare_descriptor::refuse_one(int listener) {
  fd_.reset();
  int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd >= 0) ::close(fd);
  open();
  return fd >= 0;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Why the server closed or refused a connection.
enum class rejection : std::uint8_t {
  over_connection_cap,
  out_of_descriptors,
  handshake,  ///< wrong token, version or magic, or too slow
  protocol,   ///< a malformed or oversized request
  idle,
  broken,  ///< a client's connection broke (a reset) while it waited
  count_
};

DTRAIN_DETAIL_INLINE const char* describe(rejection r);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE const char* describe(rejection r) {
  switch (r) {
    case rejection::over_connection_cap: return "over the connection cap";
    case rejection::out_of_descriptors: return "out of file descriptors";
    case rejection::handshake: return "failed handshake";
    case rejection::protocol: return "protocol violation";
    case rejection::idle: return "idle";
    case rejection::broken: return "broken while waiting";
    case rejection::count_: break;
  }
  return "?";
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Logs the first few rejections of each period in full and the rest as one
/// summary line per period, so a flood costs a few lines, not one per
/// connection (a fuzzer once made 28.5 MB of log in ten minutes).
class rejection_log {
 public:
  using clock = std::chrono::steady_clock;
  static constexpr std::chrono::seconds period{10};
  static constexpr std::uint64_t detailed_per_period = 5;

  /// Counts one; true when it should be logged in full.
  bool note(rejection r);

  /// Once per period, the summary of what was not logged in full (if any).
  std::optional<std::string> summary(clock::time_point now);

 private:
  std::array<std::uint64_t, static_cast<std::size_t>(rejection::count_)> counts_{};
  std::uint64_t total_ = 0;
  std::uint64_t detailed_ = 0;
  clock::time_point since_ = clock::now();
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE bool rejection_log::note(rejection r) {
  ++counts_[static_cast<std::size_t>(r)];
  ++total_;
  return r != rejection::idle && ++detailed_ <= detailed_per_period;
}

DTRAIN_DETAIL_INLINE std::optional<std::string> rejection_log::summary(clock::time_point now) {
  if (now - since_ < period) return std::nullopt;
  std::optional<std::string> out;
  const std::uint64_t hidden = total_ - std::min(detailed_, detailed_per_period) -
                               counts_[static_cast<std::size_t>(rejection::idle)];
  if (hidden > 0) {
    std::string text =
        "refused or closed " + std::to_string(total_) + " connections in the last " +
        std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now - since_).count()) +
        " s:";
    const char* sep = " ";
    for (std::size_t i = 0; i < counts_.size(); ++i) {
      if (counts_[i] == 0) continue;
      text += sep + std::to_string(counts_[i]) + " " + describe(static_cast<rejection>(i));
      sep = ", ";
    }
    out = text + " (the first " + std::to_string(detailed_per_period) + " were logged in full)";
  }
  counts_.fill(0);
  total_ = 0;
  detailed_ = 0;
  since_ = now;
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/rendezvous/server_limits.hpp ----

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <sys/epoll.h>
#include <sys/socket.h>

namespace dtrain::detail {

/// Why a connection's coroutine ends, thrown from its I/O; none is a protocol violation.
struct client_gone {         ///< the client closed its end, or its connection broke
  std::string broken_while;  ///< what the server was doing when it broke ("" when closed)
};
struct server_stopping {};  ///< the server is stopping, or closed this connection to make room
struct client_idle {};      ///< nothing arrived within the idle (or handshake) timeout

/// Bytes a request holds against the shared budget, given back when it ends.
class held_bytes {
 public:
  held_bytes(byte_budget& budget, reactor& r) : budget_(budget), reactor_(r) {}
  held_bytes(const held_bytes&) = delete;
  held_bytes& operator=(const held_bytes&) = delete;
  ~held_bytes() { release(); }
  void add(std::uint64_t n) { n_ += n; }
  void release();

 private:
  byte_budget& budget_;
  reactor& reactor_;
  std::uint64_t n_ = 0;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void held_bytes::release() {
  if (n_ == 0) return;
  budget_.give_back(reactor_, n_);
  n_ = 0;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// What a look at a waiting client's socket found.
enum class hangup {
  none,     ///< nothing arrived
  request,  ///< bytes arrived: a new request while one is pending
  orderly,  ///< the client closed its end (it exited, or gave up the wait)
  broken,   ///< the connection was reset or failed
};

/// The socket of one accepted client and its I/O on the reactor.
class server_connection {
 public:
  using steady = detail::steady;

  /// Watches `fd` (from accept) on `r`; `peer` is its address for messages.
  server_connection(reactor& r, byte_budget& budget, unique_fd fd, std::string peer,
                    std::chrono::milliseconds io_timeout);
  server_connection(const server_connection&) = delete;
  server_connection& operator=(const server_connection&) = delete;
  ~server_connection() { reactor_.remove(slot_); }

  [[nodiscard]] const std::string& peer() const noexcept { return peer_; }
  [[nodiscard]] wait_slot& slot() noexcept { return slot_; }
  /// This connection as a waiter for keys (kv_state::watch): resumes its coroutine.
  [[nodiscard]] const kv_waiter& waiter() const noexcept { return waiter_; }
  [[nodiscard]] steady::time_point io_deadline() const { return steady::now() + io_timeout_; }

  /// Suspends until the socket has `events`, the deadline passes, the slot is
  /// woken, or the server stops.
  reactor::until wait(std::uint32_t events, std::optional<steady::time_point> deadline) {
    return reactor_.wait(slot_, events, deadline);
  }

  /// Appends exactly `n` bytes from the client to `out`. Returns false on a
  /// clean end of stream before the first byte when `eof_ok` (a request
  /// boundary); throws client_idle when nothing came by the deadline there.
  task<bool> read_exact(std::string& out, std::size_t n, std::optional<steady::time_point> deadline,
                        bool eof_ok, const char* what);

  /// Sends all of `data` within the io timeout.
  task<void> write_all(std::string_view data);

  /// Takes `n` bytes from the shared budget for `held`, waiting until the
  /// deadline for other connections to give some back. `what` names the
  /// bytes in the violation thrown when they never come.
  task<void> reserve(held_bytes& held, std::uint64_t n, steady::time_point deadline,
                     const std::string& what);

  /// Looks, without reading, at the socket of a client that waits for a reply.
  [[nodiscard]] hangup peek() const;

  /// Best effort, without waiting: a client blocked in get / wait learns why
  /// the server went away.
  void say_goodbye();

 private:
  reactor& reactor_;
  byte_budget& budget_;
  unique_fd fd_;
  wait_slot slot_;
  std::string peer_;
  std::chrono::milliseconds io_timeout_;
  kv_waiter waiter_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE server_connection::server_connection(reactor& r, byte_budget& budget,
                                                          unique_fd fd, std::string peer,
                                                          std::chrono::milliseconds io_timeout)
    : reactor_(r),
      budget_(budget),
      fd_(std::move(fd)),
      peer_(std::move(peer)),
      io_timeout_(io_timeout),
      waiter_([this] { reactor_.wake_up(slot_); }) {
  int one = 1;
  ::setsockopt(fd_.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  reactor_.add(fd_.get(), slot_);
}

DTRAIN_DETAIL_INLINE task<bool> server_connection::read_exact(
    std::string& out, std::size_t n, std::optional<steady::time_point> deadline, bool eof_ok,
    const char* what) {
  const std::size_t start = out.size();
  char chunk[16384];
  while (out.size() - start < n) {
    std::size_t want = std::min(sizeof chunk, n - (out.size() - start));
    ssize_t got = ::recv(fd_.get(), chunk, want, 0);
    if (got > 0) {
      // Grows with what arrives, not with what was declared.
      out.append(chunk, static_cast<std::size_t>(got));
      continue;
    }
    if (got == 0) {
      if (eof_ok && out.size() == start) co_return false;
      throw wire::violation(
          std::string(what) + " cut short: the client closed the connection after " +
          std::to_string(out.size() - start) + " of " + std::to_string(n) + " bytes");
    }
    if (errno == EINTR) continue;
    if (errno == ECONNRESET && eof_ok && out.size() == start) co_return false;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      throw std::system_error(errno, std::generic_category(), std::string("reading ") + what);
    }
    auto w = co_await wait(EPOLLIN | EPOLLRDHUP, deadline);
    if (w == wake::stop) throw server_stopping{};
    if (w == wake::timeout && eof_ok && out.size() == start) throw client_idle{};
    if (w == wake::timeout) {
      throw wire::violation(
          std::string(what) + " not complete within " + std::to_string(io_timeout_.count()) +
          " ms (" + std::to_string(out.size() - start) + " of " + std::to_string(n) + " bytes)");
    }
  }
  co_return true;
}

DTRAIN_DETAIL_INLINE task<void> server_connection::write_all(std::string_view data) {
  auto deadline = io_deadline();
  while (!data.empty()) {
    ssize_t sent = ::send(fd_.get(), data.data(), data.size(), MSG_NOSIGNAL);
    if (sent > 0) {
      data.remove_prefix(static_cast<std::size_t>(sent));
      continue;
    }
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0 && (errno == EPIPE || errno == ECONNRESET)) throw client_gone{};
    if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      throw std::system_error(errno, std::generic_category(), "sending a reply");
    }
    auto w = co_await wait(EPOLLOUT, deadline);
    if (w == wake::stop) throw server_stopping{};
    if (w == wake::timeout)
      throw wire::violation("the client did not read its reply within the io timeout");
  }
}

DTRAIN_DETAIL_INLINE task<void> server_connection::reserve(held_bytes& held, std::uint64_t n,
                                                           steady::time_point deadline,
                                                           const std::string& what) {
  if (n > budget_.cap()) {
    throw wire::violation(what + " exceeds the store's buffer cap of " +
                          std::to_string(budget_.cap()) +
                          " bytes (store_limits::max_buffered_bytes)");
  }
  while (!budget_.try_take(n)) {
    budget_.wait_here(slot_);
    auto w = co_await wait(0, deadline);
    budget_.stop_waiting(slot_);
    if (w == wake::stop) throw server_stopping{};
    if (w == wake::timeout) {
      throw wire::violation(
          what + " waited for the store's buffer (" + std::to_string(budget_.used()) + " of " +
          std::to_string(budget_.cap()) + " bytes held by other connections) past the io timeout");
    }
  }
  held.add(n);
}

DTRAIN_DETAIL_INLINE hangup server_connection::peek() const {
  char byte;
  ssize_t n = ::recv(fd_.get(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n > 0) return hangup::request;
  if (n == 0) return hangup::orderly;
  return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? hangup::none : hangup::broken;
}

DTRAIN_DETAIL_INLINE void server_connection::say_goodbye() {
  std::string body;
  wire::writer(body)
      .u8(static_cast<std::uint8_t>(wire::status::shutting_down))
      .bytes32("the store server is shutting down");
  auto frame = wire::frame(body);
  (void)!::send(fd_.get(), frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/rendezvous/server_connection.hpp ----

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <sys/epoll.h>

namespace dtrain::detail {

/// One request on its way through a handler: its connection, the bytes it
/// holds against the budget, and its fields after the operation code.
struct store_request {
  server_connection& c;
  held_bytes& held;
  wire::reader& fields;
};

/// The store's state and the handlers of its operations.
class store_operations {
 public:
  explicit store_operations(const store_limits& limits)
      : limits_(limits), state_(limits.max_stored_bytes) {}
  store_operations(const store_operations&) = delete;
  store_operations& operator=(const store_operations&) = delete;

  /// The reply body to the request whose body `q.fields` reads, from the
  /// handler of its operation code. Throws wire::violation for an unknown or
  /// malformed request (the connection is closed), store_refusal for one the
  /// state refused (an error reply), and what the connection's I/O throws.
  task<std::string> handle(store_request& q);

  /// Bytes of the keys and values held. Callable from any thread.
  [[nodiscard]] std::uint64_t stored_bytes() const noexcept { return stored_bytes_.load(); }
  /// Connections suspended in a get or wait. Callable from any thread.
  [[nodiscard]] std::size_t waiting() const noexcept { return waiting_.load(); }

  /// The reply that tells a client the store refused its request.
  static std::string refusal(std::string_view message);

 private:
  using handler = task<std::string> (store_operations::*)(store_request&);
  using op = wire::op;
  using status = wire::status;

  // The handler of each operation code; null for codes that name none. Made
  // once at run time by a plain function, not by a constexpr lambda: under
  // nvcc's --expt-relaxed-constexpr (PyTorch's CUDA flags) constexpr code is
  // compiled for the device too, where these member functions do not exist.
  static const std::array<handler, 256>& handlers();
  static std::array<handler, 256> make_handlers();

  static std::string reply(status s) { return std::string(1, static_cast<char>(s)); }

  // status::ok followed by what `fill` writes.
  template <class Fill>
  static std::string ok(Fill&& fill) {
    std::string out = reply(status::ok);
    wire::writer w(out);
    std::forward<Fill>(fill)(w);
    return out;
  }

  static steady::time_point deadline_after(std::uint64_t ms);

  std::string_view read_key(store_request& q) {
    return q.fields.bytes32("key", limits_.max_key_size);
  }

  // Every handler that changes the state ends here, for stored_bytes().
  void changed() { stored_bytes_ = state_.stored_bytes(); }

  task<std::string> set(store_request& q);

  task<std::string> get(store_request& q);

  task<std::string> add(store_request& q);

  task<std::string> compare_set(store_request& q);

  task<std::string> wait(store_request& q);

  task<std::string> check(store_request& q);

  task<std::string> erase(store_request& q);

  task<std::string> num_keys(store_request& q);

  task<std::string> ping(store_request& q);

  // Reserves, before a reply that copies the value at `key` is built, what
  // that reply will hold until the client reads it. False when the key is
  // gone meanwhile. Loops because the value may change while it waits.
  task<bool> reserve_value(store_request& q, std::string_view key, std::uint64_t& reserved);

  // Waits until every key exists (true) or the deadline passes (false).
  // Watches the connection meanwhile: a client that goes away ends the wait,
  // quietly when it closed its end (it exited, or gave up), with a reason to
  // log when its connection broke.
  task<bool> wait_for(store_request& q, std::span<const std::string_view> keys,
                      steady::time_point deadline);

  const store_limits limits_;
  kv_state state_;
  // Mirrors for the server's stats(), read from other threads: written here, never read here.
  std::atomic<std::uint64_t> stored_bytes_{0};  // state_.stored_bytes() after the last change
  std::atomic<std::size_t> waiting_{0};         // connections suspended in wait_for
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE task<std::string> store_operations::handle(
    store_request& q) {  // not a coroutine: runs the handler's
  const std::uint8_t code = q.fields.u8("op");
  const handler h = handlers()[code];
  if (h == nullptr) throw wire::violation("unknown operation " + std::to_string(code));
  return (this->*h)(q);
}

DTRAIN_DETAIL_INLINE std::string store_operations::refusal(std::string_view message) {
  std::string body;
  wire::writer(body).u8(static_cast<std::uint8_t>(wire::status::error)).bytes32(message);
  return body;
}

DTRAIN_DETAIL_INLINE auto store_operations::handlers() -> const std::array<handler, 256>& {
  static const std::array<handler, 256> table = make_handlers();
  return table;
}

DTRAIN_DETAIL_INLINE auto store_operations::make_handlers() -> std::array<handler, 256> {
  std::array<handler, 256> t{};
  t[static_cast<std::uint8_t>(op::set)] = &store_operations::set;
  t[static_cast<std::uint8_t>(op::get)] = &store_operations::get;
  t[static_cast<std::uint8_t>(op::add)] = &store_operations::add;
  t[static_cast<std::uint8_t>(op::compare_set)] = &store_operations::compare_set;
  t[static_cast<std::uint8_t>(op::wait)] = &store_operations::wait;
  t[static_cast<std::uint8_t>(op::check)] = &store_operations::check;
  t[static_cast<std::uint8_t>(op::erase)] = &store_operations::erase;
  t[static_cast<std::uint8_t>(op::num_keys)] = &store_operations::num_keys;
  t[static_cast<std::uint8_t>(op::ping)] = &store_operations::ping;
  return t;
}

DTRAIN_DETAIL_INLINE steady::time_point store_operations::deadline_after(std::uint64_t ms) {
  constexpr std::uint64_t ten_years = 10ull * 365 * 24 * 3600 * 1000;
  return steady::now() + std::chrono::milliseconds(std::min(ms, ten_years));
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::set(store_request& q) {
  auto key = read_key(q);
  auto value = q.fields.bytes32("value", limits_.max_value_size);
  q.fields.finish("set request");
  state_.set(key, value);
  changed();
  co_return reply(status::ok);
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::get(store_request& q) {
  auto key = read_key(q);
  auto ms = q.fields.u64("timeout");
  q.fields.finish("get request");
  const std::array<std::string_view, 1> keys{key};
  const auto deadline = deadline_after(ms);
  std::uint64_t reserved = 0;
  do {
    if (!co_await wait_for(q, keys, deadline)) co_return reply(status::timeout);
  } while (!co_await reserve_value(q, key, reserved));
  co_return ok([&](wire::writer& w) { w.bytes32(*state_.find(key)); });
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::add(store_request& q) {
  auto key = read_key(q);
  auto delta = q.fields.i64("delta");
  q.fields.finish("add request");
  const std::int64_t sum = state_.add(key, delta);
  changed();
  co_return ok([&](wire::writer& w) { w.i64(sum); });
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::compare_set(store_request& q) {
  auto key = read_key(q);
  auto expected = q.fields.bytes32("expected value", limits_.max_value_size);
  auto desired = q.fields.bytes32("desired value", limits_.max_value_size);
  q.fields.finish("compare_set request");
  std::uint64_t reserved = 0;
  (void)co_await reserve_value(q, key, reserved);  // the reply may copy the value
  const std::string_view now = state_.compare_set(key, expected, desired);
  changed();
  co_return ok([&](wire::writer& w) { w.bytes32(now); });
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::wait(store_request& q) {
  auto keys = wire::read_keys(q.fields, limits_);
  auto ms = q.fields.u64("timeout");
  q.fields.finish("wait request");
  if (!co_await wait_for(q, keys, deadline_after(ms))) co_return reply(status::timeout);
  co_return reply(status::ok);
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::check(store_request& q) {
  auto keys = wire::read_keys(q.fields, limits_);
  q.fields.finish("check request");
  const bool all = state_.check(keys);
  co_return ok([&](wire::writer& w) { w.u8(all ? 1 : 0); });
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::erase(store_request& q) {
  auto key = read_key(q);
  q.fields.finish("erase request");
  const bool existed = state_.erase(key);
  changed();
  co_return ok([&](wire::writer& w) { w.u8(existed ? 1 : 0); });
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::num_keys(store_request& q) {
  q.fields.finish("num_keys request");
  co_return ok([&](wire::writer& w) { w.u64(state_.size()); });
}

DTRAIN_DETAIL_INLINE task<std::string> store_operations::ping(store_request& q) {
  q.fields.finish("ping request");
  co_return reply(status::ok);
}

DTRAIN_DETAIL_INLINE task<bool> store_operations::reserve_value(store_request& q,
                                                                std::string_view key,
                                                                std::uint64_t& reserved) {
  for (;;) {
    const std::string* value = state_.find(key);
    if (value == nullptr) co_return false;
    const std::uint64_t size = value->size();
    if (size <= reserved) co_return true;
    co_await q.c.reserve(q.held, size - reserved, q.c.io_deadline(),
                         "a reply of " + std::to_string(size) + " bytes");
    reserved = size;
  }
}

DTRAIN_DETAIL_INLINE task<bool> store_operations::wait_for(store_request& q,
                                                           std::span<const std::string_view> keys,
                                                           steady::time_point deadline) {
  bool charged = false;
  for (;;) {
    std::vector<std::string> missing = state_.missing(keys);
    if (missing.empty()) co_return true;
    if (!charged) {
      // A wait holds a copy of each missing key twice (here and in the state's waiters).
      std::uint64_t bytes = 0;
      for (const auto& k : missing) bytes += 2 * (k.size() + 64);
      co_await q.c.reserve(q.held, bytes, q.c.io_deadline(),
                           "a wait on " + std::to_string(missing.size()) + " keys");
      charged = true;
      continue;  // keys may have been set while it waited for the budget
    }
    const kv_state::watch watching(state_, q.c.waiter(), std::move(missing));
    ++waiting_;
    const wake w = co_await q.c.wait(EPOLLIN | EPOLLRDHUP, deadline);
    --waiting_;
    switch (w) {
      case wake::event:
      case wake::none: continue;
      case wake::timeout: co_return false;
      case wake::stop: throw server_stopping{};
      case wake::io: break;
    }
    switch (q.c.peek()) {
      case hangup::none: continue;
      case hangup::request: throw wire::violation("sent a new request while its wait was pending");
      case hangup::orderly: throw client_gone{};
      case hangup::broken: throw client_gone{"waiting for \"" + watching.keys().front() + "\""};
    }
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/rendezvous/operations.hpp ----

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <sys/epoll.h>
#include <sys/socket.h>

namespace dtrain {

/// A snapshot of what the server is doing, for tests and diagnostics.
struct store_server_stats {
  std::size_t connections = 0;         ///< open connections, handshaken or not
  std::size_t waiting = 0;             ///< connections blocked in get / wait
  std::uint64_t closed_for_cause = 0;  ///< connections closed for bad input or timeouts
  std::uint64_t refused = 0;           ///< connections closed at accept (caps, descriptors)
  std::uint64_t closed_idle = 0;       ///< connections closed after the idle timeout
  std::uint64_t stored_bytes = 0;      ///< keys and values held
  std::uint64_t buffered_bytes = 0;    ///< requests, replies and waits in flight
};

/// Serves the store on `address:port` from a background thread until stop()
/// or destruction. Construction binds and listens, so a port in use is a
/// rendezvous_error thrown here; port 0 picks a free port (see port()).
/// Bad input from a client closes that connection with a logged reason;
/// everyone else is still served. stop() answers every pending get / wait
/// with an error and closes every connection.
///
/// What clients can make it hold is capped (store_limits): connections,
/// stored bytes, bytes in flight, keys in a wait. Connections silent for
/// the idle timeout are closed. Rejections are logged a few in full, then as
/// one summary line every 10 s. The address is the interface to listen on:
/// dtrain::run and the node agent pass the one MASTER_ADDR names (loopback
/// for a single-node job), not every interface.
class store_server {
 public:
  explicit store_server(std::string address = "127.0.0.1", int port = 0,
                        store_options options = {});
  store_server(const store_server&) = delete;
  store_server& operator=(const store_server&) = delete;
  ~store_server() { stop(); }

  /// The port it listens on (the one picked when constructed with 0).
  [[nodiscard]] int port() const noexcept { return port_; }
  [[nodiscard]] const std::string& address() const noexcept { return address_; }
  [[nodiscard]] std::string endpoint() const { return detail::endpoint_text(address_, port_); }

  /// Callable from any thread.
  [[nodiscard]] store_server_stats stats() const noexcept;

  /// Wakes every waiter with an error, closes every connection, joins the thread. Idempotent.
  void stop();

 private:
  using steady = detail::steady;
  using status = detail::wire::status;
  using violation = detail::wire::violation;

  /// A client's connection: its I/O, and where it stands in admission.
  struct connection {
    connection(store_server& s, detail::unique_fd fd, std::string peer)
        : io(s.reactor_, s.budget_, std::move(fd), std::move(peer), s.options_.io_timeout) {}
    detail::server_connection io;
    bool in_request = false;
    bool authenticated = false;
    bool evicted = false;
    bool listed = false;  // in unproven_, at `unproven`, until the handshake succeeds
    std::list<connection*>::iterator unproven{};
    detail::task<void> job;
  };

  void log(const std::string& message) const;

  // ---- admission: listening, accepting, the caps, the handshake ----------

  void listen_on(int port);

  void serve_until_stopped();

  // Destroys the connections whose coroutine has finished (it cannot free its own frame).
  void reap();

  detail::task<void> accept_loop();

  /// Starts serving an accepted connection, or refuses it at the cap. At the
  /// cap, a connection that has not proven its token yet makes room: a flood
  /// of strangers cannot lock the job's own ranks out.
  void admit(detail::unique_fd fd, const sockaddr* peer);

  // A connection's whole life: the handshake, then its requests until it goes.
  detail::task<void> serve(connection& c);

  detail::task<bool> handshake(connection& c);

  // Compares without an early exit, so timing does not reveal the token.
  static bool same_secret(std::string_view a, std::string_view b);

  // The handshake's answer: a status and the server's protocol version. (A
  // function, not a lambda: a coroutine frame that holds a lambda's type
  // trips -Wsubobject-linkage where the body is compiled out of line.)
  static std::string reply(status s) {
    std::string body;
    detail::wire::writer(body).u8(static_cast<std::uint8_t>(s)).u16(detail::wire::version);
    return body;
  }

  // ---- requests: read one, hand it to its operation's handler, write the reply ----

  detail::task<bool> serve_one(connection& c);

  std::string address_;
  store_options options_;
  int port_ = 0;
  detail::reactor reactor_;
  detail::unique_fd listen_;
  detail::wait_slot accept_slot_;
  detail::store_operations operations_;
  detail::byte_budget budget_;
  std::size_t connection_cap_;
  detail::spare_descriptor spare_;
  detail::rejection_log rejections_;
  // After the reactor, the operations and the budget, which they use: destroyed first.
  std::unordered_map<connection*, std::unique_ptr<connection>> connections_;
  std::vector<connection*> finished_;
  std::list<connection*> unproven_;  // connections before their handshake, oldest first
  // Counts that stats() reads from other threads (the other figures come from
  // operations_ and budget_): with the reactor's stop request, all that the
  // threads share. The reactor thread writes each after the change it reports
  // (a connection is uncounted before its socket closes) and never reads them.
  struct {
    std::atomic<std::size_t> connections{0};         // accepted and not yet finished
    std::atomic<std::uint64_t> refused{0};           // refused at accept, or evicted unproven
    std::atomic<std::uint64_t> closed_idle{0};       // closed after the idle timeout
    std::atomic<std::uint64_t> closed_for_cause{0};  // closed for bad input or a timeout
  } published_;
  std::thread thread_;  // last: starts once everything above exists
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE store_server::store_server(std::string address, int port,
                                                store_options options)
    : address_(std::move(address)),
      options_(std::move(options)),
      operations_(options_.limits),
      budget_(options_.limits.max_buffered_bytes),
      connection_cap_(detail::connection_capacity(options_.limits.max_connections)) {
  listen_on(port);
  thread_ = std::thread([this] { serve_until_stopped(); });
}

DTRAIN_DETAIL_INLINE store_server_stats store_server::stats() const noexcept {
  return {published_.connections.load(),
          operations_.waiting(),
          published_.closed_for_cause.load(),
          published_.refused.load(),
          published_.closed_idle.load(),
          operations_.stored_bytes(),
          budget_.used()};
}

DTRAIN_DETAIL_INLINE void store_server::stop() {
  reactor_.request_stop();
  if (thread_.joinable()) thread_.join();
}

DTRAIN_DETAIL_INLINE void store_server::log(const std::string& message) const {
  std::string line = "[dtrain store " + endpoint() + "] " + message;
  if (options_.log) {
    options_.log(line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

DTRAIN_DETAIL_INLINE void store_server::listen_on(int port) {
  detail::address_list addrs;
  if (int rc = detail::resolve(address_, port, true, addrs); rc != 0) {
    throw rendezvous_error("cannot listen on " + detail::endpoint_text(address_, port) + ": " +
                           ::gai_strerror(rc));
  }
  const addrinfo* a = addrs.head;
  detail::unique_fd fd(
      DTRAIN_SYSCALL(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)));
  int one = 1;
  DTRAIN_SYSCALL(::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one));
  if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
    int err = errno;
    throw rendezvous_error(
        "cannot listen on " + detail::endpoint_text(address_, port) + ": " + std::strerror(err) +
        (err == EADDRINUSE ? " (another store or program holds the port: pick another "
                             "MASTER_PORT, or port 0 for a free one)"
                           : ""));
  }
  DTRAIN_SYSCALL(::listen(fd.get(), 65535));  // the kernel caps it at somaxconn
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  DTRAIN_SYSCALL(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len));
  port_ = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                      : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  listen_ = std::move(fd);
  reactor_.add(listen_.get(), accept_slot_);
}

DTRAIN_DETAIL_INLINE void store_server::serve_until_stopped() {
  detail::task<void> acceptor = accept_loop();
  acceptor.start();
  try {
    while (reactor_.run_once(std::chrono::milliseconds(1000))) {
      reap();
      if (auto line = rejections_.summary(steady::now())) log(*line);
    }
  } catch (const std::exception& e) {
    log(std::string("reactor failed, stopping: ") + e.what());
  }
  std::vector<detail::wait_slot*> suspended{&accept_slot_};
  for (auto& [raw, c] : connections_) suspended.push_back(&c->io.slot());
  reactor_.stop_all(suspended);
  reap();
  connections_.clear();
  published_.connections = 0;
  reactor_.remove(accept_slot_);
  listen_.reset();
}

DTRAIN_DETAIL_INLINE void store_server::reap() {
  for (connection* c : finished_) connections_.erase(c);
  finished_.clear();
}

DTRAIN_DETAIL_INLINE detail::task<void> store_server::accept_loop() {
  for (std::uint64_t accepted = 1;; ++accepted) {
    // Now and then, let the reactor run a round (and reap what was closed)
    // before the next accept, so that a backlog of thousands cannot starve it.
    if (accepted % 64 == 0 &&
        co_await reactor_.wait(accept_slot_, EPOLLIN, std::nullopt) == detail::wake::stop) {
      co_return;
    }
    sockaddr_storage peer{};
    socklen_t len = sizeof peer;
    int fd = ::accept4(listen_.get(), reinterpret_cast<sockaddr*>(&peer), &len,
                       SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      admit(detail::unique_fd(fd), reinterpret_cast<sockaddr*>(&peer));
      continue;
    }
    int err = errno;
    if (err == EINTR || err == ECONNABORTED) continue;
    detail::wake w;
    if ((err == EMFILE || err == ENFILE) && spare_.refuse_one(listen_.get())) {
      // Keep the queue moving: the client learns at once instead of hanging in it.
      ++published_.refused;
      if (rejections_.note(detail::rejection::out_of_descriptors)) {
        log(std::string("refused a connection: ") + std::strerror(err));
      }
      continue;
    }
    if (err == EAGAIN || err == EWOULDBLOCK) {
      w = co_await reactor_.wait(accept_slot_, EPOLLIN, std::nullopt);
    } else {
      // Out of descriptors or memory: say so, and try again shortly instead of spinning.
      log(std::string("cannot accept a connection: ") + std::strerror(err) +
          "; retrying in 100 ms");
      w = co_await reactor_.wait(accept_slot_, 0, steady::now() + std::chrono::milliseconds(100));
    }
    if (w == detail::wake::stop) co_return;
  }
}

DTRAIN_DETAIL_INLINE void store_server::admit(detail::unique_fd fd, const sockaddr* peer) {
  if (connections_.size() >= connection_cap_) {
    if (unproven_.empty()) {
      fd.reset();
      ++published_.refused;
      if (rejections_.note(detail::rejection::over_connection_cap)) {
        log("refused a connection from " + detail::endpoint_text(peer) + ": " +
            std::to_string(connection_cap_) +
            " connections are open (store_limits::max_connections, "
            "DTRAIN_STORE_MAX_CONNECTIONS, or the descriptor limit)");
      }
      return;
    }
    connection* oldest = unproven_.front();
    unproven_.pop_front();
    oldest->listed = false;
    oldest->evicted = true;
    reactor_.cancel(oldest->io.slot());
  }
  auto owned = std::make_unique<connection>(*this, std::move(fd), detail::endpoint_text(peer));
  connection* c = owned.get();
  connections_.emplace(c, std::move(owned));
  c->unproven = unproven_.insert(unproven_.end(), c);
  c->listed = true;
  ++published_.connections;
  c->job = serve(*c);
  c->job.start();
}

DTRAIN_DETAIL_INLINE detail::task<void> store_server::serve(connection& c) {
  std::string reason;  // why the server closed it, to log
  bool idle = false;
  try {
    if (co_await handshake(c)) {
      while (co_await serve_one(c)) {
      }
    }
  } catch (const detail::client_gone& gone) {
    if (!gone.broken_while.empty() && rejections_.note(detail::rejection::broken)) {
      log("client " + c.io.peer() + " disconnected while " + gone.broken_while);
    }
  } catch (const detail::server_stopping&) {
    if (c.evicted) {
      ++published_.refused;
      if (rejections_.note(detail::rejection::over_connection_cap)) {
        log("closed connection from " + c.io.peer() + " before its handshake: " +
            std::to_string(connection_cap_) + " connections are open and a new one came");
      }
    } else if (c.in_request) {
      c.io.say_goodbye();
    }
  } catch (const detail::client_idle&) {
    if (c.authenticated) {
      idle = true;
      rejections_.note(detail::rejection::idle);
    } else {
      reason = "handshake not complete within " + std::to_string(options_.io_timeout.count()) +
               " ms (nothing was sent)";
    }
  } catch (const violation& e) {
    reason = std::string("protocol violation: ") + e.what();
  } catch (const std::exception& e) {
    reason = e.what();
  }
  // First: whoever sees it counted as closed, or its socket closed (at the
  // reap), sees the connection count without it.
  --published_.connections;
  if (idle) ++published_.closed_idle;
  if (!reason.empty()) {
    ++published_.closed_for_cause;
    if (rejections_.note(c.authenticated ? detail::rejection::protocol
                                         : detail::rejection::handshake)) {
      log("closed connection from " + c.io.peer() + ": " + reason);
    }
  }
  if (std::exchange(c.listed, false)) unproven_.erase(c.unproven);
  finished_.push_back(&c);
}

DTRAIN_DETAIL_INLINE detail::task<bool> store_server::handshake(connection& c) {
  auto deadline = c.io.io_deadline();
  std::string hello;
  if (!co_await c.io.read_exact(hello, 8, deadline, true, "handshake")) co_return false;
  detail::wire::reader r(hello);
  auto magic = r.u32("magic");
  if (magic != detail::wire::magic) {
    char hex[16];
    std::snprintf(hex, sizeof hex, "0x%08x", magic);
    throw violation(std::string("bad magic ") + hex + ": not a dtrain store client");
  }
  auto version = r.u16("version");
  auto token_size = r.u16("token length");
  if (token_size > options_.limits.max_token_size) {
    throw violation("token of " + std::to_string(token_size) + " bytes exceeds the limit of " +
                    std::to_string(options_.limits.max_token_size));
  }
  std::string token;
  co_await c.io.read_exact(token, token_size, deadline, false, "token");
  if (version != detail::wire::version) {
    co_await c.io.write_all(reply(status::bad_version));
    throw violation("client speaks protocol version " + std::to_string(version) + ", this server " +
                    std::to_string(detail::wire::version));
  }
  if (!same_secret(token, options_.token)) {
    co_await c.io.write_all(reply(status::bad_token));
    throw violation("wrong token (DTRAIN_STORE_TOKEN differs)");
  }
  co_await c.io.write_all(reply(status::ok));
  c.authenticated = true;
  if (std::exchange(c.listed, false)) unproven_.erase(c.unproven);
  co_return true;
}

DTRAIN_DETAIL_INLINE bool store_server::same_secret(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

DTRAIN_DETAIL_INLINE detail::task<bool> store_server::serve_one(connection& c) {
  std::string head;
  if (!co_await c.io.read_exact(head, 1, steady::now() + options_.idle_timeout, true, "request"))
    co_return false;
  auto deadline = c.io.io_deadline();
  co_await c.io.read_exact(head, 3, deadline, false, "request length");
  std::uint32_t length = detail::wire::frame_length(head);
  if (length == 0) throw violation("empty request frame");
  if (length > options_.limits.max_frame_size()) {
    throw violation("request frame of " + std::to_string(length) + " bytes exceeds the limit of " +
                    std::to_string(options_.limits.max_frame_size()));
  }
  detail::held_bytes held(budget_, reactor_);
  co_await c.io.reserve(held, length, deadline,
                        "a request of " + std::to_string(length) + " bytes");
  std::string body;
  co_await c.io.read_exact(body, length, deadline, false, "request body");
  detail::wire::reader fields(body);
  detail::store_request q{c.io, held, fields};
  std::string reply;
  c.in_request = true;
  try {
    reply = co_await operations_.handle(q);
  } catch (const detail::store_refusal& e) {
    reply = detail::store_operations::refusal(e.what());  // the connection stays
  }
  c.in_request = false;
  co_await c.io.write_all(detail::wire::frame(reply));
  co_return true;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
// ---- end dtrain/rendezvous/server.hpp ----

#include <algorithm>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <unistd.h>

#if DTRAIN_HAS_CUDA()
#include <cuda_runtime.h>
#endif

namespace dtrain {

/// Options of dtrain::run. Aggregate: `{.agent = {.nproc_per_node = 4}}`.
/// Each part also reads its environment variables (the environment wins).
struct run_options {
  agent_options agent{};              ///< launch::per_node only
  store_options store{};              ///< DTRAIN_STORE_TIMEOUT, DTRAIN_STORE_TOKEN, ...
  collective_options collectives{};   ///< DTRAIN_COLLECTIVE_TIMEOUT, DTRAIN_CHECK_COLLECTIVES
  diagnostics_options diagnostics{};  ///< DTRAIN_DIAGNOSTICS, DTRAIN_DIAGNOSTICS_WAIT
};

/// Where the store prefix of a job lives; a restart round gets its own.
inline constexpr std::string_view job_store_prefix = "dtrain/job";

/// A worker's view of the job. Built by dtrain::run; not copyable or movable
/// (the communicator and store it owns are shared with no one else).
template <class Policy>
class context {
 public:
  using policy_type = Policy;
  using communicator_type = typename Policy::communicator_type;
  using store_type = prefix_store<store_client>;

  /// Joins the job described by `w` (a worker's world, as discovered): starts
  /// or joins the store, completes the world by grouping ranks by node name,
  /// selects the GPU (NCCL), and builds the communicator. Every wait is bound
  /// by the store or collective timeout. Throws config_error for bad input,
  /// rendezvous_error / backend_error / timeout_error when a peer fails.
  context(dtrain::world w, const dtrain::environment& env, const run_options& options);
  ~context();
  context(const context&) = delete;
  context& operator=(const context&) = delete;

  /// The complete world, agreed by every rank.
  [[nodiscard]] const dtrain::world& world() const noexcept { return world_; }
  /// The environment this rank was started with: the snapshot run() took,
  /// from which every dtrain variable is read (DistributedDataParallel's too).
  [[nodiscard]] const dtrain::environment& environment() const noexcept { return environment_; }
  [[nodiscard]] int rank() const noexcept { return *world_.rank; }
  [[nodiscard]] int size() const noexcept { return *world_.world_size; }
  [[nodiscard]] int local_rank() const noexcept { return *world_.local_rank; }
  [[nodiscard]] int local_size() const noexcept { return *world_.local_world_size; }
  [[nodiscard]] int node_rank() const noexcept { return *world_.node_rank; }
  [[nodiscard]] int num_nodes() const noexcept { return *world_.num_nodes; }
  /// Rank 0: the one that logs, evaluates and saves checkpoints.
  [[nodiscard]] bool is_main() const noexcept { return rank() == 0; }
  /// Local rank 0: the one that prepares data once per node.
  [[nodiscard]] bool is_local_main() const noexcept { return local_rank() == 0; }
  /// How many times a per-node agent has restarted the job (0 at first).
  [[nodiscard]] int restart_count() const noexcept { return restart_count_; }
  /// The CUDA device this rank uses with a backend on GPUs (NCCL), chosen by
  /// select_device(): its local rank, or 0 when it sees one GPU; -1 otherwise.
  [[nodiscard]] int device() const noexcept { return device_; }

  /// The rendezvous store, under this job's (and restart round's) prefix.
  [[nodiscard]] store_type& store() noexcept { return *store_; }
  [[nodiscard]] communicator_type& communicator() noexcept { return *communicator_; }
  /// The host control plane: small blocking collectives through the store,
  /// for metadata that must not travel on a device engine (DistributedDataParallel's
  /// model agreement and bucket order; your own checksums). Every rank calls the
  /// same operations in the same order; each waits at most the store timeout.
  [[nodiscard]] dtrain::control_plane control_plane() noexcept;

  /// Waits until every rank has called barrier(), at most the collective
  /// timeout (DTRAIN_COLLECTIVE_TIMEOUT); throws timeout_error after it.
  void barrier();

  /// Asks every rank for its ring of last collectives (what SIGUSR1 does) and
  /// returns the analysis' first line ("rank 2 is at #41 ...: rank 2 never
  /// started #42"); one rank prints the whole table on stderr. Waits at most
  /// DTRAIN_DIAGNOSTICS_WAIT for the rings. Never throws.
  std::string explain_stall(const std::string& reason);

  /// Called by run() when this rank fails: a collective that timed out or
  /// failed (a peer is stuck, behind, gone or called differently) is
  /// explained; other failures (a store timeout) are not.
  std::optional<std::string> explain_failure(const std::exception_ptr& failure);

  /// Called by run() when this rank fails (an exception, or a non-zero status
  /// from the user's function), before anything is torn down: under a node
  /// agent the failure is recorded in the agent's store while the peers still
  /// run, so the agent names this rank, not a peer that failed because of it.
  void record_failure(int status, const std::string& what) noexcept;

  /// Called by run() when this rank fails, after its report: aborts the
  /// communicator where the engine can (NCCL: ncclCommAbort), so that its
  /// collectives still waiting for peers end now. Without it, the
  /// communicator's clean close would wait for them, up to the collective
  /// timeout, and a failed rank would linger that long before its process
  /// exits and the launcher can end the job (ProcessGroupNCCL aborts too
  /// unless shut down cleanly). Later collectives on this context throw.
  void abort_communicator() noexcept {
    if constexpr (requires { communicator_->abort(); }) {
      if (communicator_) communicator_->abort();
    }
  }

  /// Called by run() after the user's function returned normally: the store's
  /// host (rank 0 under per-process launch) waits, at most the store timeout,
  /// until every rank is done with the store before it stops serving.
  void finish();

 private:
  /// Agent's store (per-node workers), else rank 0 hosts one at MASTER_ADDR:MASTER_PORT.
  void open_store(const dtrain::environment& env) {
    if (auto agent = env.get(agent_store_variable)) {
      auto where =
          detail::split_host_port(detail::assignment(agent_store_variable, *agent), *agent);
      if (!where.port) {
        throw config_error(detail::assignment(agent_store_variable, *agent) + " has no port");
      }
      client_.emplace(where.host, *where.port, store_options_);
      store_endpoint_ = {where.host, *where.port};
      store_.emplace(*client_,
                     std::string(job_store_prefix) + "/" + std::to_string(restart_count_));
      under_agent_ = true;
      return;
    }
    std::optional<std::string> host = world_.master_addr;
    // Without an address nobody else can be told a fixed port either: rank 0
    // picks a free one (and the pre-store channel carries it), unless MASTER_PORT names one.
    int port = world_.master_port.value_or(host ? default_master_port : 0);
    if (!host && size() == 1) host = "127.0.0.1";  // a single process hosts its own store
    const bool one_node = single_node(host);
    choose_token(env, host, port, one_node);
    const std::string bind = detail::store_bind_address(env, host.value_or("0.0.0.0"), !one_node);
    auto serve = [&] {
      if (token_file_) token_file_->publish(store_options_.token);
      server_.emplace(bind, port, store_options_);
      port = server_->port();
    };
    if (!host) {
      host = agree_store_address(serve, port);
    } else if (rank() == 0) {
      serve();
    }
    const std::string where = rank() == 0 ? detail::local_store_address(bind) : *host;
    store_endpoint_ = {where, port};
    if (token_file_ && rank() != 0) {
      detail::connect_with_token_file(client_, *token_file_, where, port, store_options_, rank());
    } else {
      client_.emplace(where, port, store_options_);
    }
    store_.emplace(*client_, std::string(job_store_prefix));
  }

  /// Whether every rank is known to run on this host: one process, a node
  /// count or local size that says so, or a loopback MASTER_ADDR (127.x, ::1, localhost).
  [[nodiscard]] bool single_node(const std::optional<std::string>& host) const {
    if (size() == 1 || world_.num_nodes == 1) return true;
    if (world_.local_world_size && *world_.local_world_size == size()) return true;
    // Only a loopback address itself: a host name that resolves to loopback
    // here (Debian's 127.0.1.1) may name this host for the other nodes.
    return host && (*host == "localhost" || detail::is_loopback_address(*host));
  }

  /// Chooses this rank's store token. The first that applies wins:
  ///  1. its own: DTRAIN_STORE_TOKEN, or store_options::token;
  ///  2. rank 0's, sent through the backend's pre-store channel (MPI): rank 0
  ///     sends its own or one it draws. Every rank takes part in that
  ///     broadcast, whatever it holds (a collective must not depend on the
  ///     environment), and one with a token of its own keeps it: the store
  ///     refuses it by name if it differs from rank 0's;
  ///  3. one it draws, in a world of one;
  ///  4. rank 0's through a file only this user can read, when every rank
  ///     runs on this host and the store's address is known: rank 0 draws it,
  ///     the others read it (detail::connect_with_token_file);
  ///  5. none yet when the store's address is unknown: open_store says so.
  /// Otherwise the job may span hosts that none of these reach: config_error,
  /// asking for DTRAIN_STORE_TOKEN.
  void choose_token(const dtrain::environment& env, const std::optional<std::string>& host,
                    int port, bool one_node) {
    std::optional<std::string> from_rank0;
    if constexpr (detail::has_pre_store_relay<traits>) {
      if (size() > 1) {
        from_rank0 = detail::broadcast_or_fail(
            traits::pre_store_relay(*communicator_), "the store token", [&] {
              return store_options_.token.empty() ? detail::new_store_token()
                                                  : store_options_.token;
            });
      }
    }
    if (!store_options_.token.empty()) return;
    if (from_rank0) {
      store_options_.token = std::move(*from_rank0);
      return;
    }
    if (size() == 1) {
      store_options_.token = detail::new_store_token();
      return;
    }
    if (one_node && host) {
      token_file_.emplace(env, port);
      if (rank() == 0) store_options_.token = detail::new_store_token();
      return;
    }
    if (!host) return;  // open_store reports the missing address first
    throw config_error(
        "rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
        ": this job may span several hosts and no dtrain launcher started it, so its store "
        "needs a shared secret: set DTRAIN_STORE_TOKEN to the same value on every rank (e.g. "
        "mpirun -x DTRAIN_STORE_TOKEN, or export it in the srun / torchrun job script; "
        "`openssl rand -hex 16` makes one), or use the MPI backend, or dtrun (" +
        world_.describe() + ")");
  }

  /// Without MASTER_ADDR: rank 0 starts the store (`serve`, which sets `port`)
  /// and tells every rank where, through the backend's pre-store channel (or
  /// its failure, which every rank then throws). Returns rank 0's host name.
  /// Without such a channel nobody can know: config_error on every rank.
  template <class Serve>
  std::string agree_store_address(Serve& serve, int& port) {
    if constexpr (detail::has_pre_store_relay<traits>) {
      const detail::store_address got = detail::store_address::decode(detail::broadcast_or_fail(
          traits::pre_store_relay(*communicator_), "the store's address", [&] {
            serve();
            return detail::store_address{detail::host_name().value_or("?"), port}.encode();
          }));
      port = got.port;
      return got.host;
    } else {
      (void)serve;
      (void)port;
      throw config_error(
          "rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
          " does not know where rank 0's rendezvous store is: set MASTER_ADDR (and MASTER_PORT) to "
          "an address of rank 0's host, or AZ_BATCH_MASTER_NODE=host:port (" +
          world_.describe() + ")");
    }
  }

  /// Every rank reports; rank 0 waits for them all (saying who is missing
  /// every progress interval), places them and publishes the result.
  void complete_world(const dtrain::environment& env) {
    detail::rendezvous_wait<store_type> waiting(
        *store_, {.endpoint = client_->endpoint(),
                  .rank = rank(),
                  .size = size(),
                  .timeout = store_options_.timeout,
                  .interval = store_options_.progress_interval,
                  .say = store_options_.progress,
                  .world_size_origin = world_.origin(dtrain::world::field::world_size)});
    waiting.join(rank_report{node_name(env), world_}.encode());
    const std::string table_key(detail::job_keys::placement);
    std::string table;
    if (rank() == 0) {
      waiting.await_everyone();
      try {
        std::vector<rank_report> reports;
        for (int r = 0; r < size(); ++r) {
          const std::string key = detail::job_keys::report(r);
          reports.push_back(rank_report::decode(store_->get(key), "store key " + key));
        }
        table = encode_placements(place_ranks(reports));
      } catch (const config_error& e) {
        store_->set(table_key, encode_placement_error(e.what()));
        throw;
      }
      store_->set(table_key, table);
    } else {
      table = waiting.await_answer(table_key);
    }
    const placement p =
        decode_placement("store key " + store_->prefix() + table_key, table, rank(), size());
    const std::string grouped = "grouped by node name at rendezvous";
    auto fill = [&](std::optional<int>& field, dtrain::world::field f, int value) {
      if (!field) world_.origins[static_cast<std::size_t>(f)] = grouped;
      field = value;
    };
    fill(world_.node_rank, dtrain::world::field::node_rank, p.node_rank);
    fill(world_.num_nodes, dtrain::world::field::num_nodes, p.num_nodes);
    fill(world_.local_rank, dtrain::world::field::local_rank, p.local_rank);
    fill(world_.local_world_size, dtrain::world::field::local_world_size, p.local_world_size);
  }

  void make_communicator(const dtrain::environment& env) {
    if constexpr (traits::uses_gpus) device_ = gpu_of_this_rank(env);
    communicator_setup<store_type> setup{.store = store_ ? &*store_ : nullptr,
                                         .rank = rank(),
                                         .size = size(),
                                         .device = device(),
                                         .collectives = collectives_,
                                         .master_addr = world_.master_addr.value_or(""),
                                         .env = &env};
    communicator_.emplace(traits::make(setup));
    if (communicator_->size() != size() || communicator_->rank() != rank()) {
      throw config_error(std::string(Policy::backend_type::name) + "'s world has rank " +
                         std::to_string(communicator_->rank()) + " of " +
                         std::to_string(communicator_->size()) +
                         ", but the environment says rank " + std::to_string(rank()) + " of " +
                         std::to_string(size()) + " (" + world_.origin(dtrain::world::field::rank) +
                         ", " + world_.origin(dtrain::world::field::world_size) +
                         "); start MPI jobs with mpirun or srun");
    }
  }

  /// Every rank watches for diagnostics rounds on a connection of its own.
  void start_diagnostics(const diagnostics_options& options) {
    if constexpr (requires { communicator_->ring(); }) {
      if (!options.enabled) return;
      std::string prefix = store_->prefix();
      diagnostics_.emplace(store_endpoint_.first, store_endpoint_.second, store_options_,
                           prefix + "diag", rank(), size(), communicator_->ring(),
                           std::string(Policy::backend_type::name), options);
    } else {
      (void)options;
    }
  }

  using traits = typename Policy::traits;

  /// select_device() with the devices this process sees. When CUDA cannot count
  /// them, the local rank: the communicator then reports CUDA's own error.
  int gpu_of_this_rank(const dtrain::environment& env) const {
#if DTRAIN_HAS_CUDA()
    int visible = 0;
    if (cudaGetDeviceCount(&visible) != cudaSuccess) {
      (void)cudaGetLastError();
      return local_rank();
    }
    try {
      return select_device(local_rank(), local_size(), visible, env.get("CUDA_VISIBLE_DEVICES"));
    } catch (const config_error& e) {
      throw config_error("rank " + std::to_string(rank()) + ": " + e.what());
    }
#else
    (void)env;
    return local_rank();
#endif
  }

  dtrain::world world_;
  dtrain::environment environment_;
  store_options store_options_;
  collective_options collectives_;
  int restart_count_ = 0;
  int device_ = -1;
  bool under_agent_ = false;
  // Declared in the order they are built, so they are torn down in reverse.
  std::optional<detail::token_file> token_file_;
  std::optional<store_server> server_;
  std::optional<store_client> client_;
  std::optional<store_type> store_;
  std::optional<communicator_type> communicator_;
  std::optional<store_channel<store_type>> control_;
  std::pair<std::string, int> store_endpoint_;  // for the diagnostics' own connection
  std::optional<detail::rank_diagnostics> diagnostics_;
};

// What builds, uses and tears down the job is defined out of the class and not
// inline: under `extern template class context<P>` (dtrain/compiled.hpp) none of
// it, nor the store, agent and engine code it calls, is compiled in a user's TU.

template <class Policy>
context<Policy>::context(dtrain::world w, const dtrain::environment& env,
                         const run_options& options)
    : world_(std::move(w)),
      environment_(env),
      store_options_(options.store.with_env(env)),
      collectives_(options.collectives.with_env(env)) {
  if (!world_.rank || !world_.world_size) {
    throw config_error("dtrain::run needs a worker's rank and world size; this process is a " +
                       std::string(to_string(world_.role)) + " (" + world_.describe() + ")");
  }
  if (auto r = detail::read_int(env, restart_count_variable)) restart_count_ = r->value;
  if (!store_options_.progress) {
    // Rendezvous progress goes where this rank's failures go: a rank-prefixed line on stderr.
    store_options_.progress = [label = detail::rank_label(&world_)](std::string_view text) {
      std::fprintf(stderr, "%s dtrain: %.*s\n", label.c_str(), static_cast<int>(text.size()),
                   text.data());
    };
  }
  if constexpr (!traits::needs_store) {
    // MPI knows its world already, and can tell every rank where rank 0's store is.
    make_communicator(env);
    open_store(env);
    complete_world(env);
  } else {
    open_store(env);
    complete_world(env);
    make_communicator(env);
  }
  control_.emplace(*store_, rank(), size(), "control");
  start_diagnostics(options.diagnostics.with_env(env));
}

template <class Policy>
context<Policy>::~context() = default;

// Out of the class, so that a TU that only declares context<Policy> (separate
// compilation) does not compile the store channel behind it.
template <class Policy>
dtrain::control_plane context<Policy>::control_plane() noexcept {
  return dtrain::control_plane(*control_);
}

template <class Policy>
void context<Policy>::barrier() {
  communicator_->barrier().wait(collectives_.timeout);
}

template <class Policy>
std::string context<Policy>::explain_stall(const std::string& reason) {
  if (!diagnostics_) return "no diagnostics (DTRAIN_DIAGNOSTICS=0, or this backend keeps no ring)";
  return diagnostics_->explain(reason);
}

template <class Policy>
std::optional<std::string> context<Policy>::explain_failure(const std::exception_ptr& failure) {
  if (!diagnostics_ || !diagnostics_->collective_failed()) return std::nullopt;
  try {
    std::rethrow_exception(failure);
  } catch (const timeout_error&) {
    return explain_stall("a timeout on rank " + std::to_string(rank()));
  } catch (const backend_error&) {
    return explain_stall("a failed collective on rank " + std::to_string(rank()));
  } catch (...) {
  }
  return std::nullopt;
}

template <class Policy>
void context<Policy>::record_failure(int status, const std::string& what) noexcept {
  if (!under_agent_ || !client_) return;
  try {
    const detail::collective_progress progress = detail::progress_of(communicator_);
    detail::record_failure(
        *client_, restart_count_,
        {status, false,
         detail::worker_label(rank(), node_rank(), local_rank(), ::getpid()) +
             " exited with status " + std::to_string(status) + (what.empty() ? "" : ": " + what),
         rank(), progress.failed_at, progress.failed_on});
  } catch (...) {
    // The agent still sees the exit status; the reason is only lost from its message.
  }
}

template <class Policy>
void context<Policy>::finish() {
  // Before the communicator closes: a peer that fails because of it finds this record.
  if (under_agent_ && client_) {
    detail::record_exit(
        *client_, restart_count_,
        {rank(), detail::worker_label(rank(), node_rank(), local_rank(), ::getpid()),
         detail::progress_of(communicator_).issued});
  }
  communicator_.reset();
  if (!client_) return;
  const std::string all(detail::job_keys::finished_all);
  if (store_->add(detail::job_keys::finished, 1) == size())
    store_->set(all, detail::present_value());
  if (server_) {
    const std::string keys[] = {all};
    store_->wait(keys);
  }
}

}  // namespace dtrain
// ---- end dtrain/context.hpp ----
// ---- begin dtrain/ddp/basic_ddp.hpp ----
/// @file
/// basic_ddp<Policy>: the one core of DistributedDataParallel (c10d's Reducer
/// is the model). It owns each parameter's and each bucket's state
/// (ddp/state.hpp) under one lock, and averages the gradients over the ranks
/// while the backward pass is still running: the moment a bucket's last
/// gradient is marked ready its allreduce starts, on a communication thread
/// for host memory (MPI, Gloo) or on the communicator's stream after the
/// compute stream (NCCL), followed by a watchdog (ddp/runner.hpp). Metadata
/// (model agreement, the rebuild order) goes over the host control plane.
/// DistributedDataParallel<Model, Policy> and dtrain::torch's wrapper are thin
/// layers over it: they feed it parameters and marks, and ask it the rest.
///
/// Every member that is more than a line or two is defined out of the class
/// (here, in ddp/basic_ddp_buckets.hpp and in ddp/basic_ddp_step.hpp), as a
/// non-inline template member: a compiled library may then hold `template
/// class dtrain::basic_ddp<P>;` and its users `extern template class
/// dtrain::basic_ddp<P>;`, and none of those bodies is compiled again in the
/// users' translation units (GCC instantiates in-class members of an extern
/// template at -O2 anyway, out-of-class ones not).

// ---- begin dtrain/ddp/agreement.hpp ----
/// @file
/// What every rank must agree on before DistributedDataParallel averages
/// anything: the same parameters (names, counts, types) in the same order,
/// and rank 0's values of them.

// ---- begin dtrain/ddp/bucket.hpp ----
/// @file
/// Which gradients travel together: the bucket assignment of
/// DistributedDataParallel, as pure functions of the parameters and the
/// order in which their gradients are expected to become ready.

// ---- begin dtrain/ddp/parameter.hpp ----
/// @file
/// `dtrain::parameter`: how a model shows DistributedDataParallel its
/// parameters — name, values, gradient, element count and type, device —
/// without dtrain knowing the model's types. Models return a range of them
/// from `parameters()` (and, for state that is not trained but must match
/// across ranks, from `buffers()`).


#include <concepts>
#include <cstddef>
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
  /// The dimensions the model gives the values (a tensor's sizes), for
  /// messages: a model that differs across ranks is named by them
  /// (`[64, 16]` against `[65, 16]`). Empty: a flat list of values.count.
  std::vector<std::size_t> shape = {};

  [[nodiscard]] bool rebindable() const noexcept {
    return gradient_slot != nullptr && rebind != nullptr;
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
// ---- end dtrain/ddp/parameter.hpp ----

#include <algorithm>
#include <cstddef>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace dtrain {

/// One bucket: gradients of one element type on one device, laid out
/// contiguously in `parameters` order and reduced by one collective.
struct bucket_info {
  std::vector<std::size_t> parameters;  ///< indices into the model's parameters(), in layout order
  std::vector<std::size_t>
      offsets;  ///< bytes into the bucket of each (GPU: bucket_alignment apart)
  dtype type = dtype::float32;
  int device = -1;        ///< -1: host memory
  std::size_t count = 0;  ///< elements the collective moves: the slots and the padding between them
  std::size_t bytes = 0;  ///< count x the element size
};

/// Every parameter's slot in a GPU bucket starts on this boundary (bytes):
/// views into the bucket are aligned for vectorised kernels and NCCL's fast
/// paths. The padding between slots is zero and stays zero (its mean is
/// zero); the collective moves it too (bucket_info::count includes it).
inline constexpr std::size_t bucket_alignment = 256;

/// Bytes of a size given in MiB (the unit of bucket_cap_mb), at least 1.
[[nodiscard]] DTRAIN_DETAIL_INLINE std::size_t mib_to_bytes(double mib, std::string_view option);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::size_t mib_to_bytes(double mib, std::string_view option) {
  if (!(mib > 0) || mib > 1e9) {
    throw config_error("ddp_options::" + std::string(option) + " = " + std::to_string(mib) +
                       " is not a bucket size in MiB (it must be above 0)");
  }
  return std::max<std::size_t>(1, static_cast<std::size_t>(mib * 1024.0 * 1024.0));
}
#endif  // DTRAIN_DETAIL_BODIES()

namespace detail {

/// n-1, n-2, ..., 0: gradients of the last layers are produced first.
[[nodiscard]] DTRAIN_DETAIL_INLINE std::vector<std::size_t> reverse_order(std::size_t n);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::vector<std::size_t> reverse_order(std::size_t n) {
  std::vector<std::size_t> order(n);
  for (std::size_t i = 0; i < n; ++i) order[i] = n - 1 - i;
  return order;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Throws unless `order` names each of the n parameters exactly once.
DTRAIN_DETAIL_INLINE void check_order(std::span<const std::size_t> order, std::size_t n,
                                      std::string_view what);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void check_order(std::span<const std::size_t> order, std::size_t n,
                                      std::string_view what) {
  std::vector<char> seen(n, 0);
  if (order.size() != n) {
    throw backend_error(std::string(what) + " lists " + std::to_string(order.size()) +
                            " parameters, the model has " + std::to_string(n),
                        0);
  }
  for (std::size_t i : order) {
    if (i >= n || seen[i]) {
      throw backend_error(std::string(what) + " names parameter #" + std::to_string(i) +
                              (i >= n ? " of " + std::to_string(n) : " twice"),
                          0);
    }
    seen[i] = 1;
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Groups the parameters, taken in `order` (a permutation of their indices),
/// into buckets per (element type, device), as PyTorch DDP's
/// compute_bucket_assignment_by_size does: each parameter joins its group's
/// open bucket, and the bucket closes as soon as it holds at least its cap
/// (`first_cap` for a group's first bucket, `cap` after). So a bucket closes
/// after the parameter that passes the cap, never before it, and only a
/// group's last bucket may hold less than its cap. Buckets are returned in the
/// order of their first parameter in `order`, which is the launch order.
template <parameter_list Params>
[[nodiscard]] std::vector<bucket_info> assign_buckets(const Params& params,
                                                      std::span<const std::size_t> order,
                                                      std::size_t first_cap, std::size_t cap) {
  check_order(order, std::ranges::size(params), "the bucket order");
  struct open_bucket {
    bucket_info bucket;
    std::size_t first_position = 0;
    bool first = true;  // still the group's first bucket
  };
  std::map<std::pair<int, int>, open_bucket> open;  // (type, device) -> its bucket being filled
  std::vector<std::pair<std::size_t, bucket_info>> closed;  // (position of first parameter, bucket)
  for (std::size_t position = 0; position < order.size(); ++position) {
    const parameter& p = parameter_at(params, order[position]);
    auto [it, fresh] = open.try_emplace({static_cast<int>(p.values.type), p.device});
    open_bucket& b = it->second;
    if (b.bucket.parameters.empty()) {
      b.bucket.type = p.values.type;
      b.bucket.device = p.device;
      b.first_position = position;
    }
    // GPU slots start on bucket_alignment; host slots are packed.
    const std::size_t align = p.device >= 0 ? bucket_alignment : 1;
    const std::size_t at = (b.bucket.bytes + align - 1) / align * align;
    b.bucket.parameters.push_back(order[position]);
    b.bucket.offsets.push_back(at);
    b.bucket.bytes = at + p.values.bytes();
    b.bucket.count = b.bucket.bytes / size_of(p.values.type);
    if (b.bucket.bytes >= (b.first ? first_cap : cap)) {
      closed.emplace_back(b.first_position, std::move(b.bucket));
      b.bucket = bucket_info{};
      b.first = false;
    }
  }
  for (auto& [key, b] : open) {
    if (!b.bucket.parameters.empty()) closed.emplace_back(b.first_position, std::move(b.bucket));
  }
  std::ranges::sort(closed, {}, &std::pair<std::size_t, bucket_info>::first);
  std::vector<bucket_info> buckets;
  buckets.reserve(closed.size());
  for (auto& [position, b] : closed) buckets.push_back(std::move(b));
  return buckets;
}

}  // namespace detail
}  // namespace dtrain
// ---- end dtrain/ddp/bucket.hpp ----
// ---- begin dtrain/ddp/options.hpp ----
/// @file
/// What a user chooses about DistributedDataParallel: ddp_options, gradient
/// compression, and the bucket a communication hook is handed.


#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace dtrain {

/// How DistributedDataParallel sends float32 gradients.
enum class gradient_compression : std::uint8_t {
  none,      ///< as they are
  float16,   ///< IEEE half: 10-bit mantissa, range ±65504 (scale losses that overflow)
  bfloat16,  ///< float32's range with an 8-bit mantissa
};

[[nodiscard]] constexpr std::string_view to_string(gradient_compression c) noexcept {
  switch (c) {
    case gradient_compression::none: return "none";
    case gradient_compression::float16: return "float16";
    case gradient_compression::bfloat16: return "bfloat16";
  }
  return "unknown";
}

/// What DistributedDataParallel shards across the ranks (ZeRO's stages, as
/// DeepSpeed numbers them; PyTorch: ZeroRedundancyOptimizer is stage 1, FSDP's
/// SHARD_GRAD_OP stage 2). Each bucket is cut into `size()` equal contiguous
/// shards (zeros pad the bucket); rank r owns shard r of every bucket: the
/// optimizer updates only those values (DistributedDataParallel::shard(),
/// optimizer_step()), with state the size of the shard, and the updated
/// values are allgathered.
enum class sharding : std::uint8_t {
  none = 0,       ///< DDP: every rank holds and updates everything
  optimizer = 1,  ///< stage 1: the gradients are averaged whole (an allreduce)
  /// Stage 2: each bucket is reduce-scattered as soon as it is ready, and a
  /// rank keeps only its shard of the averaged gradients (the optimizer
  /// state too, as stage 1).
  gradients = 2,
};

[[nodiscard]] constexpr std::string_view to_string(sharding s) noexcept {
  switch (s) {
    case sharding::none: return "none";
    case sharding::optimizer: return "optimizer";
    case sharding::gradients: return "gradients";
  }
  return "unknown";
}

/// One piece of the shard a rank owns (DistributedDataParallel::shard()):
/// the part of one parameter that falls in one bucket's shard. An
/// elementwise optimizer updates `values` from `gradients` (the mean over
/// ranks), with its state at `state_offset` of an array of shard_elements().
struct shard_piece {
  std::size_t parameter = 0;     ///< index into parameters()
  std::size_t offset = 0;        ///< its first element within that parameter
  std::size_t state_offset = 0;  ///< its first element within the rank's shard (the state's index)
  std::size_t bucket = 0;        ///< the bucket it belongs to
  buffer values;                 ///< the parameter's values (the model's memory)
  buffer gradients;              ///< their averaged gradients (DDP's memory), same count
};

/// One range of a sharded array that this rank holds (DistributedDataParallel::
/// shard_ranges(), checkpoint::add_sharded): `count` elements starting at
/// `global` in the whole array, at `local` in this rank's own.
struct shard_range {
  std::uint64_t global = 0;
  std::uint64_t local = 0;
  std::uint64_t count = 0;
};

/// The memory DistributedDataParallel holds itself, per rank, in bytes
/// (DistributedDataParallel::memory_use()); the model's values, and its own
/// gradient buffers where they are not bucket views, are the model's.
struct ddp_memory_use {
  std::size_t buckets = 0;  ///< the gradient buckets (views point into them), padding included
  std::size_t shards = 0;   ///< sharding: this rank's shard of each bucket
  std::size_t scratch = 0;  ///< compression's 16-bit copies, the hierarchical topology's scratch
  [[nodiscard]] std::size_t total() const noexcept { return buckets + shards + scratch; }
};

/// Options of DistributedDataParallel, PyTorch DDP's names where they exist.
/// Aggregate: `{.bucket_cap_mb = 4, .find_unused_parameters = true}`.
struct ddp_options {
  /// The bucket rule is PyTorch DDP's: gradients join the open bucket of
  /// their (type, device) in the order they become ready, and a bucket closes
  /// right after the gradient that brings it to its cap, however large that
  /// gradient is. A bucket is never closed early to keep a large gradient out,
  /// so only the last bucket of each (type, device) holds less than its cap.
  /// The cap of every bucket after the first, in MiB.
  double bucket_cap_mb = 25;
  /// The cap of the first bucket (the last layers' gradients, ready first):
  /// small, so that communication starts early in the backward pass.
  double first_bucket_cap_mb = 1;
  /// Point rebindable gradients (param() with a pointer) into the buckets:
  /// no copies. false: copy every gradient in and the mean back out.
  bool gradient_as_bucket_view = true;
  /// Parameters never marked in a step contribute zero instead of being an
  /// error (for models whose steps skip parts of the network). "Unused"
  /// means "not marked": dtrain has no autograd graph to find them.
  bool find_unused_parameters = false;
  /// With find_unused_parameters: name, once, on rank 0's stderr the
  /// parameters that no rank marked in the first steps (a forgotten
  /// mark_ready looks just like an unused parameter). false: silent.
  bool report_unused_parameters = true;
  /// After the first step, lay the buckets out once more in the order the
  /// gradients actually became ready (rank 0's order, sent to every rank).
  bool rebuild_buckets = true;
  /// Construction copies rank 0's parameters and buffers to every rank.
  bool broadcast_parameters = true;
  /// Send float32 gradients as 16-bit floats (cast, reduce, cast back).
  gradient_compression compression = gradient_compression::none;
  /// false: nothing is sent before synchronize() (for measuring what overlap buys).
  bool overlap = true;
  /// At world size 1 DDP communicates nothing: the mean over one rank is its
  /// gradient, so no collective is issued, no thread woken, no copy made
  /// (compression still rounds, as it would on more ranks; a comm hook still
  /// runs). true: reduce every bucket as on more ranks (to exercise an
  /// engine's path with one GPU).
  bool always_reduce = false;
  /// A Chrome trace of every step (steps, mark_ready per parameter, buckets,
  /// the waits in synchronize()) goes to this file, the rank inserted
  /// (trace.json -> trace.rank0.json); empty: none. DTRAIN_TIMELINE wins.
  std::string timeline = {};
  /// Backends on CUDA streams (NCCL): the compute stream, the one that wrote
  /// the parameters and will run the backward pass (a cudaStream_t). The first
  /// broadcast of rank 0's values is ordered after it, so that values written
  /// on it (initialised, loaded, copied) are the ones sent and are not written
  /// over what arrives; set_stream() changes it later. Null: the legacy default
  /// stream. Host backends (Gloo, MPI) have no stream: leave it null.
  stream_handle stream = nullptr;
  /// Shard the optimizer state (and the averaged gradients) across the ranks:
  /// ZeRO stage 1 or 2 (see dtrain::sharding). The bucket layout is then the
  /// first one (no rebuild): a rank's shard, and its optimizer state, stay
  /// where they are. Not with compression or a comm hook at stage 2.
  dtrain::sharding sharding = dtrain::sharding::none;
};

/// One bucket, as a communication hook sees it.
struct gradient_bucket {
  std::size_t index = 0;  ///< launch order, 0 first
  buffer data;            ///< the flat gradients: reduce them in place
  int world_size = 1;
  std::span<const std::size_t> parameters;  ///< indices into parameters(), in layout order
  /// Backends on CUDA streams (NCCL): the compute stream the bucket is ordered
  /// after; enqueue the reduction after it. Null for host backends.
  stream_handle stream = nullptr;
};

}  // namespace dtrain
// ---- end dtrain/ddp/options.hpp ----

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace dtrain::detail {

/// "parameter fc1.weight (1024 x float32 on the host)", or with a shape
/// "parameter fc1.weight ([64, 16] float32 on the host)": what must match across ranks.
DTRAIN_DETAIL_INLINE std::string parameter_entry(const parameter& p, std::string_view kind);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string parameter_entry(const parameter& p, std::string_view kind) {
  std::string entry = std::string(kind) + " " + p.name + " (";
  if (p.shape.empty()) {
    entry += std::to_string(p.values.count) + " x ";
  } else {
    entry += "[";
    for (std::size_t d = 0; d < p.shape.size(); ++d) {
      if (d > 0) entry += ", ";
      entry += std::to_string(p.shape[d]);
    }
    entry += "] ";
  }
  entry += to_string(p.values.type);
  entry += p.values.where == memory::host ? " on the host)" : " on a GPU)";
  return entry;
}
#endif  // DTRAIN_DETAIL_BODIES()

DTRAIN_DETAIL_INLINE std::vector<std::string> model_entries(std::span<const parameter> params,
                                                            std::span<const parameter> buffers);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::vector<std::string> model_entries(std::span<const parameter> params,
                                                            std::span<const parameter> buffers) {
  std::vector<std::string> entries;
  for (const parameter& p : params) entries.push_back(parameter_entry(p, "parameter"));
  for (const parameter& b : buffers) entries.push_back(parameter_entry(b, "buffer"));
  return entries;
}
#endif  // DTRAIN_DETAIL_BODIES()

DTRAIN_DETAIL_INLINE std::int64_t fnv1a(const std::vector<std::string>& entries);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::int64_t fnv1a(const std::vector<std::string>& entries) {
  std::uint64_t h = 1469598103934665603ull;
  for (const std::string& e : entries) {
    for (char c : e) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    h = (h ^ 0x0au) * 1099511628211ull;
  }
  return static_cast<std::int64_t>(h >> 1);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// What one rank alone can find wrong with its model and options, as a
/// message naming the parameter and the rank; empty when nothing is.
DTRAIN_DETAIL_INLINE std::string model_problem(std::span<const parameter> params,
                                               std::span<const parameter> buffers,
                                               const ddp_options& options, int rank,
                                               std::string_view backend, bool on_device,
                                               int device);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string model_problem(std::span<const parameter> params,
                                               std::span<const parameter> buffers,
                                               const ddp_options& options, int rank,
                                               std::string_view backend, bool on_device,
                                               int device) {
  const std::string who = "DistributedDataParallel on rank " + std::to_string(rank) + ": ";
  std::unordered_map<std::string_view, std::size_t> names;
  std::unordered_map<const void*, std::size_t> data;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const parameter& p = params[i];
    const std::string what = "parameter #" + std::to_string(i) + " '" + p.name + "'";
    if (p.name.empty()) return who + what + " has no name";
    if (auto [it, fresh] = names.emplace(p.name, i); !fresh) {
      return who + "two parameters are called '" + p.name + "' (#" + std::to_string(it->second) +
             " and #" + std::to_string(i) + ")";
    }
    if (!p.values.data || p.values.count == 0) return who + what + " has no values";
    if (!data.emplace(p.values.data, i).second)
      return who + what + " shares its values with another parameter";
    if (!is_floating(p.values.type)) {
      return who + what + " is " + std::string(to_string(p.values.type)) +
             ": only floating-point parameters have gradients to average (declare it in buffers())";
    }
    if (!p.gradient && !p.rebindable()) return who + what + " has no gradient buffer";
    if (!p.gradient && !options.gradient_as_bucket_view) {
      return who + what +
             " has a null gradient pointer, which needs ddp_options::gradient_as_bucket_view";
    }
    if (on_device && p.values.where != memory::device) {
      return who + what +
             " is in host memory, but backend::nccl reduces GPU memory: use dtrain::device_param";
    }
    if (on_device && p.device != device) {
      return who + what + " is on GPU " + std::to_string(p.device) +
             ", but this rank's NCCL communicator is on GPU " + std::to_string(device);
    }
    if (!on_device && p.values.where != memory::host) {
      return who + what + " is in GPU memory, but backend " + std::string(backend) +
             " reduces host memory: keep gradients on the host, or use backend::nccl";
    }
  }
  for (const parameter& b : buffers) {
    if (!b.values.data && b.values.count) return who + "buffer '" + b.name + "' has no values";
    if (b.values.where == memory::device && !on_device) {
      return who + "buffer '" + b.name + "' is in GPU memory, but backend " + std::string(backend) +
             " reaches host memory only";
    }
  }
  if (options.sharding == sharding::gradients &&
      options.compression != gradient_compression::none) {
    return who + "ddp_options::sharding is gradients and ddp_options::compression is " +
           std::string(to_string(options.compression)) +
           ": a compressed reduce-scatter is not there yet (use sharding::optimizer, or no "
           "compression)";
  }
  if (options.sharding != sharding::none && options.sharding != sharding::optimizer &&
      options.sharding != sharding::gradients) {
    return who + "ddp_options::sharding is " + std::to_string(static_cast<int>(options.sharding)) +
           ", not none (0), optimizer (1) or gradients (2)";
  }
  try {
    (void)mib_to_bytes(options.bucket_cap_mb, "bucket_cap_mb");
    (void)mib_to_bytes(options.first_bucket_cap_mb, "first_bucket_cap_mb");
  } catch (const config_error& e) {
    return who + e.what();
  }
  return {};
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Collective over the host control plane: every rank learns whether all
/// ranks hold the same parameters and buffers. Throws config_error on every
/// rank when not — naming the first differing entry and the ranks — or when
/// some rank's own check failed (`local_problem`, which that rank reports in
/// its own words). `settings`, when given, is one more entry that must match
/// (DDP's options that change what travels: "ddp_options::sharding = gradients").
DTRAIN_DETAIL_INLINE void agree_on_model(control_plane& comm, std::span<const parameter> params,
                                         std::span<const parameter> buffers,
                                         const std::string& local_problem,
                                         std::string_view settings = {});
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void agree_on_model(control_plane& comm, std::span<const parameter> params,
                                         std::span<const parameter> buffers,
                                         const std::string& local_problem,
                                         std::string_view settings) {
  const int size = comm.size();
  std::vector<std::string> entries = model_entries(params, buffers);
  if (!settings.empty()) entries.emplace_back(settings);  // options every rank must share
  const std::int64_t mine[3] = {local_problem.empty() ? 0 : 1,
                                static_cast<std::int64_t>(entries.size()), fnv1a(entries)};
  std::vector<std::int64_t> all(static_cast<std::size_t>(size) * 3);
  comm.allgather(mine, all);

  std::vector<int> troubled;
  for (int r = 0; r < size; ++r) {
    if (all[static_cast<std::size_t>(r) * 3] != 0) troubled.push_back(r);
  }
  if (!local_problem.empty()) throw config_error(local_problem);
  if (!troubled.empty()) {
    throw config_error("DistributedDataParallel: rank " + std::to_string(troubled.front()) +
                       " rejected its model (its own message says why), so every rank stops");
  }
  bool same = true;
  for (int r = 1; r < size; ++r) {
    same = same && std::equal(&all[0], &all[3], &all[static_cast<std::size_t>(r) * 3]);
  }
  if (same) return;

  // Rank 0's list to everyone; each rank finds where it departs from it.
  std::string joined;
  for (const std::string& e : entries) joined += e + '\n';
  std::int64_t length = static_cast<std::int64_t>(joined.size());
  std::uint8_t length_bytes[sizeof length];
  std::memcpy(length_bytes, &length, sizeof length);
  comm.broadcast(length_bytes, 0);
  std::memcpy(&length, length_bytes, sizeof length);
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(length));
  if (comm.rank() == 0) std::memcpy(bytes.data(), joined.data(), bytes.size());
  comm.broadcast(bytes, 0);
  std::vector<std::string> reference;
  std::string current;
  for (std::uint8_t c : bytes) {
    if (c == '\n') {
      reference.push_back(std::move(current));
      current.clear();
    } else {
      current += static_cast<char>(c);
    }
  }
  std::int64_t first = -1;
  for (std::size_t i = 0; i < std::max(reference.size(), entries.size()); ++i) {
    if (i >= reference.size() || i >= entries.size() || reference[i] != entries[i]) {
      first = static_cast<std::int64_t>(i);
      break;
    }
  }
  std::vector<std::int64_t> firsts(static_cast<std::size_t>(size));
  comm.allgather(std::span<const std::int64_t>(&first, 1), firsts);
  int culprit = -1;
  std::string differing;
  for (int r = 0; r < size; ++r) {
    if (firsts[static_cast<std::size_t>(r)] < 0) continue;
    if (culprit < 0) culprit = r;
    differing += (differing.empty() ? "" : ", ") + std::to_string(r);
  }
  if (culprit < 0) return;  // equal lists after all (a hash collision)
  const auto at = static_cast<std::size_t>(firsts[static_cast<std::size_t>(culprit)]);
  // The culprit's entry to everyone, so that every rank prints the same message.
  std::vector<std::uint8_t> text(512, 0);
  if (comm.rank() == culprit) {
    const std::string e = at < entries.size() ? entries[at] : "nothing";
    std::memcpy(text.data(), e.data(), std::min(e.size(), text.size() - 1));
  }
  comm.broadcast(text, culprit);
  const std::string theirs(reinterpret_cast<const char*>(text.data()));
  const std::string ours = at < reference.size() ? reference[at] : "nothing";
  throw config_error("DistributedDataParallel: the models differ across ranks at entry #" +
                     std::to_string(at) + ": rank 0 has " + ours + ", rank " +
                     std::to_string(culprit) + " has " + theirs +
                     " (ranks that differ from rank 0: " + differing +
                     "); every rank must build the same model in the same order");
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Collective over the host control plane: every rank gets rank 0's `order`
/// of the n parameters (the order its gradients became ready, for the bucket
/// rebuild). Each rank passes an order of the same length; what arrives is
/// checked to name each parameter once (backend_error otherwise).
DTRAIN_DETAIL_INLINE std::vector<std::size_t> agree_on_order(control_plane& control,
                                                             std::span<const std::size_t> order,
                                                             std::size_t n);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::vector<std::size_t> agree_on_order(control_plane& control,
                                                             std::span<const std::size_t> order,
                                                             std::size_t n) {
  std::string text;
  wire::writer w(text);
  for (std::size_t i : order) w.u64(i);
  std::vector<std::uint8_t> bytes(text.begin(), text.end());
  if (control.size() > 1) control.broadcast(bytes, 0);
  const std::string where =
      "rank 0's ready order (sent to rank " + std::to_string(control.rank()) + ")";
  std::vector<std::size_t> agreed = wire::decode_value(
      where, std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
      "a list of parameter indices", [](wire::reader& r) {
        std::vector<std::size_t> out;
        while (!r.at_end()) out.push_back(static_cast<std::size_t>(r.u64("a parameter index")));
        return out;
      });
  check_order(agreed, n, where);
  return agreed;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// broadcast_values' scratch by default: the host values travel in windows of this many bytes.
inline constexpr std::size_t broadcast_window_bytes = std::size_t{64} << 20;

/// Collective: every rank's parameter and buffer values become rank 0's.
/// Host values travel packed over the control plane, a window at a time;
/// device values one by one through `device_broadcast(buffer)`, which returns
/// once the broadcast is complete (the device engine: the only device
/// traffic besides the buckets).
template <class DeviceBroadcast>
void broadcast_values(control_plane& control, std::span<const parameter> params,
                      std::span<const parameter> buffers, DeviceBroadcast&& device_broadcast,
                      std::size_t window = broadcast_window_bytes) {
  std::vector<const parameter*> host, device;
  for (auto list : {params, buffers}) {
    for (const parameter& p : list) (p.values.where == memory::host ? host : device).push_back(&p);
  }
  std::size_t total = 0;
  for (const parameter* p : host) total += p->bytes();
  // The host values as one stream of bytes, broadcast a window at a time:
  // a model's worth of scratch would double its memory at construction.
  std::vector<std::uint8_t> packed(std::min(total, std::max<std::size_t>(window, 1)));
  for (std::size_t begin = 0; begin < total; begin += packed.size()) {
    const std::size_t end = std::min(total, begin + packed.size());
    // Copies bytes [begin, end) of the stream between the parameters and `packed`.
    auto move_window = [&](bool into_packed) {
      std::size_t at = 0;  // the parameter's first byte in the stream
      for (const parameter* p : host) {
        const std::size_t lo = std::max(begin, at), hi = std::min(end, at + p->bytes());
        if (lo < hi) {
          auto* mine = static_cast<std::uint8_t*>(p->values.data) + (lo - at);
          std::uint8_t* theirs = packed.data() + (lo - begin);
          if (into_packed) {
            std::memcpy(theirs, mine, hi - lo);
          } else {
            std::memcpy(mine, theirs, hi - lo);
          }
        }
        at += p->bytes();
        if (at >= end) break;
      }
    };
    move_window(true);
    control.broadcast(std::span<std::uint8_t>(packed.data(), end - begin), 0);
    move_window(false);
  }
  for (const parameter* p : device) {
    if (p->values.count > 0) device_broadcast(p->values);
  }
}

}  // namespace dtrain::detail
// ---- end dtrain/ddp/agreement.hpp ----
// ---- begin dtrain/ddp/runner.hpp ----
/// @file
/// How DistributedDataParallel's buckets travel, chosen from the memory space
/// of the backend: `thread_runner` for host memory (a communication thread
/// reduces buckets while the caller computes; the caller takes over what is
/// left once it waits), `stream_runner` for CUDA
/// streams (the caller enqueues, the device orders, a watchdog follows).
/// Both call the same three steps of their owner: prepare_bucket(b) (copy-in,
/// compression), reduce(b) (the collective, a work), finish_bucket(b)
/// (decompression, copy-out), and for streams order_after_buckets().


#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

namespace dtrain::detail {

/// Buckets are reduced one at a time, in launch order: each is prepared,
/// reduced and waited for (within the collective timeout), then finished.
/// A thread of its own takes the buckets launched while the caller is still
/// computing. Once the caller is in complete(), the queue is the caller's: it
/// reduces what is left on its own thread (after the bucket the thread holds,
/// if any), and the thread takes nothing more. The last buckets of a step
/// (launched as the backward pass ends) then cost no thread wake-up, which on
/// a loaded machine can cost more than the collective.
template <class Owner>
class thread_runner {
 public:
  explicit thread_runner(Owner& owner) : owner_(owner), thread_([this] { serve(); }) {}
  thread_runner(const thread_runner&) = delete;
  thread_runner& operator=(const thread_runner&) = delete;
  /// Finishes what is queued (each bounded by its timeout), then joins.
  ~thread_runner() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  /// Queues `bucket`; `wake` false leaves the thread asleep, for a bucket the
  /// caller is about to reduce itself in complete() (launched by
  /// mark_all_ready() or synchronize(): nothing left to overlap with).
  void launch(std::size_t bucket, bool wake = true) {
    bool idle = false;
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(bucket);
      idle = !busy_;
    }
    if (idle && wake) wake_.notify_one();  // a busy thread takes it next by itself
  }

  /// Waits until the `count` buckets of this step are done, reducing queued
  /// ones on the calling thread while the runner's thread is idle; then the
  /// next step starts counting from zero. Returns the first failure, or null.
  std::exception_ptr complete(std::size_t count) {
    std::unique_lock lock(mutex_);
    completing_ = true;
    while (done_ != count) {
      if (!busy_ && !queue_.empty()) {
        run_front(lock);
      } else {
        done_wake_.wait(lock);
      }
    }
    completing_ = false;
    done_ = 0;
    return failure_;
  }

 private:
  void serve() {
    std::unique_lock lock(mutex_);
    for (;;) {
      if (!completing_ && !busy_ && !queue_.empty()) {
        run_front(lock);
      } else if (stopping_ && queue_.empty() && !busy_) {
        return;  // nothing left in flight
      } else {
        wake_.wait(lock);
      }
    }
  }

  /// Reduces the bucket at the front of the queue; `lock` is held on entry
  /// and on return, and released while the bucket travels.
  void run_front(std::unique_lock<std::mutex>& lock) {
    const std::size_t b = queue_.front();
    queue_.pop_front();
    std::exception_ptr failed;
    if (!failure_) {  // once the communicator failed, do not wait for it again
      busy_ = true;
      lock.unlock();
      try {
        owner_.prepare_bucket(b);
        work w = owner_.reduce(b);
        w.wait();  // bounded by the collective timeout
        owner_.finish_bucket(b);
      } catch (...) {
        failed = std::current_exception();
      }
      lock.lock();
      busy_ = false;
    }
    if (failed && !failure_) failure_ = failed;
    ++done_;
    // Once the caller waits in complete(), the queue is the caller's: the
    // thread finishes the bucket it holds and hands over (one wake-up).
    if (completing_) done_wake_.notify_one();
  }

  Owner& owner_;
  std::mutex mutex_;
  std::condition_variable wake_;       // the thread: a bucket to reduce, or stop
  std::condition_variable done_wake_;  // the caller in complete(): the thread let go of a bucket
  std::deque<std::size_t> queue_;
  std::size_t done_ = 0;
  bool busy_ = false;        // a bucket is being reduced (by the thread or the caller)
  bool completing_ = false;  // the caller is in complete(): the queue is its own
  bool stopping_ = false;
  std::exception_ptr failure_;
  std::thread thread_;  // last: starts once everything above exists
};

/// The caller's thread enqueues each bucket on the device (after the compute
/// stream); the host never waits for a bucket. A watchdog follows every
/// collective and, past its timeout, aborts the communicator (which frees
/// the stream) and keeps the timeout_error; complete() and the next
/// launch() report it.
template <class Owner>
class stream_runner {
 public:
  explicit stream_runner(Owner& owner) : owner_(owner) {}

  /// Enqueues `bucket` on the device now (`wake` is the thread runner's:
  /// there is no thread to wake here).
  void launch(std::size_t bucket, bool /*wake*/ = true) {
    if (auto e = watchdog_.failure()) std::rethrow_exception(e);
    owner_.prepare_bucket(bucket);
    watchdog_.watch(owner_.reduce(bucket));
  }

  /// Orders the compute stream after every bucket and enqueues their
  /// finishing work there; the host does not wait. Returns the watchdog's
  /// failure so far, or null.
  std::exception_ptr complete(std::size_t count) {
    if (auto e = watchdog_.failure()) return e;
    try {
      owner_.order_after_buckets();
      for (std::size_t b = 0; b < count; ++b) owner_.finish_bucket(b);
    } catch (...) {
      // The watchdog's timeout says more than the aborted communicator's error it
      // causes; it is recorded just after the abort, so let the watchdog settle.
      if (auto e = watchdog_.drain()) return e;
      return std::current_exception();
    }
    return watchdog_.failure();
  }

  /// Blocks until every bucket launched so far has completed on the device
  /// (each within its timeout); returns the first failure, or null.
  std::exception_ptr drain() { return watchdog_.drain(); }

 private:
  Owner& owner_;
  watchdog watchdog_;
};

}  // namespace dtrain::detail
// ---- end dtrain/ddp/runner.hpp ----
// ---- begin dtrain/ddp/state.hpp ----
/// @file
/// What DistributedDataParallel keeps per parameter and per bucket, each in
/// one struct (c10d's Reducer: VariableIndex and Bucket): where a gradient
/// sits in its bucket, and what the current step has done with it.

// ---- begin dtrain/ddp/storage.hpp ----
/// @file
/// The flat memory DistributedDataParallel keeps its buckets in, in the
/// memory space of its backend (host_memory, cuda_memory, ...).


#include <cstddef>
#include <utility>

namespace dtrain::detail {

/// Zeroed bytes in `Memory` on `device`, owned. Allocation and zeroing are
/// ordered on the stream given at construction, the release on the stream
/// set last (set_stream): the owner keeps that stream ordered after every
/// use on any stream (see DistributedDataParallel::lay_out).
template <class Memory>
class flat_storage {
 public:
  flat_storage() = default;
  flat_storage(std::size_t bytes, int device, typename Memory::stream_type stream)
      : data_(Memory::allocate(bytes, device, stream)),
        bytes_(bytes),
        device_(device),
        stream_(stream) {
    if constexpr (!Memory::on_stream) Memory::zero(data_, bytes, device, stream);
  }
  flat_storage(flat_storage&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        device_(other.device_),
        stream_(other.stream_) {}
  flat_storage& operator=(flat_storage&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      device_ = other.device_;
      stream_ = other.stream_;
    }
    return *this;
  }
  flat_storage(const flat_storage&) = delete;
  flat_storage& operator=(const flat_storage&) = delete;
  ~flat_storage() { release(); }

  [[nodiscard]] std::byte* data() const noexcept { return static_cast<std::byte*>(data_); }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  /// The stream the release is ordered on from now on.
  void set_stream(typename Memory::stream_type stream) noexcept { stream_ = stream; }

 private:
  void release() noexcept {
    if (data_) Memory::release(data_, device_, stream_);
    data_ = nullptr;
  }

  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  int device_ = -1;
  typename Memory::stream_type stream_{};
};

/// The element type float32 gradients travel as under `kind` (not none).
[[nodiscard]] constexpr dtype wire_type(gradient_compression kind) noexcept {
  return kind == gradient_compression::float16 ? dtype::float16 : dtype::bfloat16;
}

}  // namespace dtrain::detail
// ---- end dtrain/ddp/storage.hpp ----

#include <compare>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <vector>

namespace dtrain::detail {

/// One parameter as DDP holds it.
struct ddp_variable {
  parameter param;  ///< as the model showed it; `param.gradient` is where the gradient is now
  void* original = nullptr;  ///< the model's own gradient pointer, given back at the end
  std::size_t bucket = 0;    ///< its bucket in the current layout
  std::size_t offset = 0;    ///< bytes into that bucket
  bool view = false;         ///< the gradient lives in the bucket (no copy in or out)
  // The current step; reset when it completes.
  bool marked = false;   ///< ready: counted in its bucket's pending count
  bool touched = false;  ///< this rank gave it a gradient (a mark, or one inside no_sync())
  bool zeroed = false;   ///< contributes zero: its bucket slice was zeroed, nothing to copy in
  bool unused = false;   ///< prepare_for_backward() said the coming backward pass does not reach it
  // Across steps.
  bool touched_last = false;  ///< `touched` in the last completed step (used_anywhere())
  bool used = false;          ///< some rank used it in the steps reported on (report_unused)
};

/// One bucket: its layout, its storage in the memory space of the backend,
/// and where the current step is with it.
template <class Memory>
struct ddp_bucket {
  bucket_info info;
  flat_storage<Memory> grads;  ///< the gradients, laid out as `info` says
  flat_storage<Memory> wire;   ///< their 16-bit copy, with gradient compression
  flat_storage<Memory> shard;  ///< the topology's scratch (hierarchical)
  /// With sharding, over more than one rank: this rank's shard of the bucket
  /// (`owned_count` elements), where a reduce-scatter leaves the averaged
  /// gradients (stage 2) and the updated values wait for the allgather.
  flat_storage<Memory> owned;
  std::size_t owned_count = 0;
  std::size_t moved = 0;    ///< elements the collective moves: the slots, padded to the topology
  std::size_t pending = 0;  ///< its parameters not yet marked in this step
  bool ready = false;       ///< every parameter marked: may be launched in its turn
  std::uint64_t span = 0;   ///< its timeline span, from launch to completion
  std::int64_t span_reduce = 0;  ///< when its reduction started (timeline on)
};

/// The parameters of `variables`, as a random-access view (basic_ddp::parameters()).
/// Written out rather than a std::ranges::transform_view, which clang 14 cannot
/// compile against libstdc++ 12.
class parameter_view {
 public:
  class iterator {
   public:
    using iterator_concept = std::random_access_iterator_tag;
    using iterator_category = std::random_access_iterator_tag;
    using value_type = parameter;
    using difference_type = std::ptrdiff_t;
    using pointer = const parameter*;
    using reference = const parameter&;

    iterator() = default;
    explicit iterator(const ddp_variable* at) noexcept : at_(at) {}

    reference operator*() const noexcept { return at_->param; }
    pointer operator->() const noexcept { return &at_->param; }
    reference operator[](difference_type n) const noexcept { return at_[n].param; }
    iterator& operator++() noexcept { return ++at_, *this; }
    iterator operator++(int) noexcept { return iterator(at_++); }
    iterator& operator--() noexcept { return --at_, *this; }
    iterator operator--(int) noexcept { return iterator(at_--); }
    iterator& operator+=(difference_type n) noexcept { return at_ += n, *this; }
    iterator& operator-=(difference_type n) noexcept { return at_ -= n, *this; }
    friend iterator operator+(iterator i, difference_type n) noexcept { return i += n; }
    friend iterator operator+(difference_type n, iterator i) noexcept { return i += n; }
    friend iterator operator-(iterator i, difference_type n) noexcept { return i -= n; }
    friend difference_type operator-(iterator a, iterator b) noexcept { return a.at_ - b.at_; }
    friend bool operator==(iterator a, iterator b) noexcept { return a.at_ == b.at_; }
    friend auto operator<=>(iterator a, iterator b) noexcept { return a.at_ <=> b.at_; }

   private:
    const ddp_variable* at_ = nullptr;
  };

  explicit parameter_view(const std::vector<ddp_variable>& variables) noexcept
      : first_(variables.data()), size_(variables.size()) {}

  [[nodiscard]] iterator begin() const noexcept { return iterator(first_); }
  [[nodiscard]] iterator end() const noexcept { return iterator(first_ + size_); }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  [[nodiscard]] const parameter& operator[](std::size_t i) const noexcept {
    return first_[i].param;
  }

 private:
  const ddp_variable* first_;
  std::size_t size_;
};

[[nodiscard]] inline parameter_view parameters_of(const std::vector<ddp_variable>& variables) {
  return parameter_view(variables);
}

}  // namespace dtrain::detail
// ---- end dtrain/ddp/state.hpp ----
// ---- begin dtrain/ddp/timeline.hpp ----
/// @file
/// DistributedDataParallel's timeline: a Chrome trace (JSON that Perfetto and
/// chrome://tracing open) of one rank's steps, mark_ready calls, buckets and
/// waits, written when DTRAIN_TIMELINE (or ddp_options::timeline) names a file.
/// Off, a recorder is one null pointer: no allocation and no clock read, one
/// branch per recording point. On, spans go into a buffer per track, each
/// with its own (uncontended: one thread per track) mutex, and the file is
/// written at the end, so nothing is formatted or written during a step.


#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain::detail {

/// The file rank `rank` writes for DTRAIN_TIMELINE=`path`: the rank goes before
/// the extension of the file name (trace.json -> trace.rank3.json), or is
/// appended with ".json" when the name has none (trace -> trace.rank3.json).
DTRAIN_DETAIL_INLINE std::string timeline_file(std::string_view path, int rank);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string timeline_file(std::string_view path, int rank) {
  const std::size_t slash = path.rfind('/');
  const std::size_t name = slash == std::string_view::npos ? 0 : slash + 1;
  const std::size_t dot = path.rfind('.');
  const std::string tag = ".rank" + std::to_string(rank);
  if (dot == std::string_view::npos || dot <= name) return std::string(path) + tag + ".json";
  return std::string(path.substr(0, dot)) + tag + std::string(path.substr(dot));
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The timeline's path: DTRAIN_TIMELINE wins over the option; an empty value
/// (`DTRAIN_TIMELINE=`) turns an option's timeline off.
DTRAIN_DETAIL_INLINE std::string timeline_setting(const environment& env,
                                                  const std::string& option);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string timeline_setting(const environment& env,
                                                  const std::string& option) {
  if (auto v = env.get(timeline_variable)) return std::string(*v);
  return option;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// One rank's recorder. Default-constructed it is off and records nothing.
/// Recording is thread-safe; write() must not race with recording of the same
/// step (call it between steps, or after the communication thread is joined).
class timeline {
 public:
  /// The tracks, as Chrome trace threads of the rank's process.
  enum class track : std::uint8_t { training = 1, communication = 2 };

  timeline() noexcept = default;

  /// On: records for `rank` of `size` and writes timeline_file(path, rank).
  /// Creates the file now, so that a path that cannot be written is a
  /// config_error before training starts (naming the path and the rank).
  timeline(std::string_view path, int rank, int size, std::vector<std::string> parameter_names);

  /// The recorder DistributedDataParallel gets: on when DTRAIN_TIMELINE in
  /// `env` (which wins) or `option` names a file, naming the spans of `params`
  /// by their names.
  template <class Parameters>
  static timeline of(const environment& env, const std::string& option, int rank, int size,
                     const Parameters& params) {
    const std::string path = timeline_setting(env, option);
    if (path.empty()) return {};
    std::vector<std::string> names;
    for (const auto& p : params) names.push_back(p.name);
    return timeline(path, rank, size, std::move(names));
  }

  [[nodiscard]] bool on() const noexcept { return state_ != nullptr; }
  /// The file this rank writes; empty when off.
  [[nodiscard]] std::string_view file() const noexcept {
    return state_ ? std::string_view(state_->file) : std::string_view();
  }

  /// Nanoseconds on the steady clock (shared by the processes of a host, so
  /// that their traces line up when merged).
  [[nodiscard]] static std::int64_t now() noexcept;

  /// A span from its construction to its destruction; nothing when off.
  class scope {
   public:
    scope(timeline& t, void (timeline::*done)(std::int64_t, std::uint64_t, std::uint64_t),
          std::uint64_t index, std::uint64_t detail = 0) noexcept
        : t_(t.on() ? &t : nullptr), done_(done), index_(index), detail_(detail) {
      if (t_) start_ = now();
    }
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;
    ~scope() {
      if (t_) (t_->*done_)(start_, index_, detail_);
    }

   private:
    timeline* t_;
    void (timeline::*done_)(std::int64_t, std::uint64_t, std::uint64_t);
    std::uint64_t index_;
    std::uint64_t detail_;
    std::int64_t start_ = 0;
  };

  /// mark_ready of parameter `index` (in `bucket`), on the training track. The
  /// first mark of a step opens the step's span.
  [[nodiscard]] scope mark_ready(std::size_t index, std::size_t bucket) noexcept {
    return scope(*this, &timeline::mark_done, index, bucket);
  }
  /// synchronize() of step `step`; when it ends, the step's span ends too.
  [[nodiscard]] scope synchronize(std::size_t step) noexcept {
    return scope(*this, &timeline::synchronize_done, step);
  }
  /// The wait for the buckets inside synchronize().
  [[nodiscard]] scope wait(std::size_t buckets) noexcept {
    return scope(*this, &timeline::wait_done, buckets);
  }

  /// Bucket `bucket` of `elements` is launched: returns the id of its span
  /// (0 when off), which bucket_done() closes.
  std::uint64_t bucket_launched(std::size_t bucket, std::size_t elements);
  /// The reduction of bucket `bucket` (span `id`) ran from `started` (prepare)
  /// to now (finished); `on_thread`: on the communication thread, which gets a
  /// span of its own (on CUDA streams the host only enqueues, so no such span).
  void bucket_done(std::size_t bucket, std::uint64_t id, std::int64_t started, bool on_thread);

  /// Writes the file (everything recorded so far). Throws dtrain::error naming
  /// the file and the rank when it cannot be written.
  void write() const;
  /// write(), for destructors: a failure is one line on stderr, never an exception.
  void write_at_exit() const noexcept;

  /// At most this many events per track are kept (about 48 MiB); the rest are
  /// counted, and the file says how many were dropped.
  static constexpr std::size_t max_events = std::size_t{1} << 20;
  static constexpr std::size_t chunk_events = 4096;

 private:
  enum class kind : std::uint8_t {
    step,
    mark,
    synchronize,
    wait,
    reduce,
    bucket_begin,
    bucket_end
  };

  struct event {
    kind what = kind::step;
    std::int64_t start = 0;  // ns, steady clock
    std::int64_t end = 0;
    std::uint64_t index = 0;   // step, parameter or bucket
    std::uint64_t detail = 0;  // mark: its bucket; bucket_begin: elements; wait: buckets
    std::uint64_t id = 0;      // bucket_begin / bucket_end
  };

  struct buffer {
    mutable std::mutex mutex;
    // Fixed chunks, not one vector: growing never copies what was recorded
    // (a doubling vector costs a step its whole history once in a while).
    std::vector<std::vector<event>> chunks;
    std::size_t count = 0;
    std::size_t dropped = 0;
  };

  struct state {
    std::string file;
    std::string setting;
    int rank = 0;
    int size = 1;
    std::vector<std::string> names;
    std::array<buffer, 2> tracks;
    std::int64_t step_start = -1;  // training thread only
    std::uint64_t launches = 0;    // training thread only
  };

  void append(track t, const event& e);

  void mark_done(std::int64_t start, std::uint64_t index, std::uint64_t bucket);
  void wait_done(std::int64_t start, std::uint64_t, std::uint64_t buckets) {
    append(track::training, {.what = kind::wait, .start = start, .end = now(), .detail = buckets});
  }
  void synchronize_done(std::int64_t start, std::uint64_t step, std::uint64_t);

  static void microseconds(std::string& out, std::int64_t ns);

  std::string name_of(const event& e) const;

  static const char* category_of(kind k);

  void render_event(std::string& out, track t, const event& e) const;

  void metadata(std::string& out, const char* what, int tid, std::string_view name) const;

  std::string render() const;

  std::unique_ptr<state> state_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE timeline::timeline(std::string_view path, int rank, int size,
                                        std::vector<std::string> parameter_names)
    : state_(std::make_unique<state>()) {
  state_->file = timeline_file(path, rank);
  state_->setting = std::string(timeline_variable) + "=" + std::string(path);
  state_->rank = rank;
  state_->size = size;
  state_->names = std::move(parameter_names);
  if (std::FILE* f = std::fopen(state_->file.c_str(), "w")) {
    std::fclose(f);
  } else {
    throw config_error(state_->setting + ": rank " + std::to_string(rank) + " cannot write " +
                       state_->file + ": " + std::strerror(errno));
  }
}

DTRAIN_DETAIL_INLINE std::int64_t timeline::now() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

DTRAIN_DETAIL_INLINE std::uint64_t timeline::bucket_launched(std::size_t bucket,
                                                             std::size_t elements) {
  if (!state_) return 0;
  const std::uint64_t id = ++state_->launches;
  append(
      track::training,
      {.what = kind::bucket_begin, .start = now(), .index = bucket, .detail = elements, .id = id});
  return id;
}

DTRAIN_DETAIL_INLINE void timeline::bucket_done(std::size_t bucket, std::uint64_t id,
                                                std::int64_t started, bool on_thread) {
  if (!state_) return;
  const std::int64_t end = now();
  if (on_thread) {
    append(track::communication,
           {.what = kind::reduce, .start = started, .end = end, .index = bucket});
  }
  append(track::communication, {.what = kind::bucket_end, .start = end, .index = bucket, .id = id});
}

DTRAIN_DETAIL_INLINE void timeline::write() const {
  if (!state_) return;
  const std::string text = render();
  std::FILE* f = std::fopen(state_->file.c_str(), "w");
  bool ok = f != nullptr && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const int code = errno;
  if (f != nullptr && std::fclose(f) != 0) ok = false;
  if (!ok) {
    throw error("rank " + std::to_string(state_->rank) + " could not write its timeline to " +
                state_->file + " (" + state_->setting + "): " + std::strerror(code));
  }
}

DTRAIN_DETAIL_INLINE void timeline::write_at_exit() const noexcept {
  try {
    write();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] dtrain: %s\n", state_->rank, e.what());
  }
}

DTRAIN_DETAIL_INLINE void timeline::append(track t, const event& e) {
  buffer& b = state_->tracks[static_cast<std::size_t>(t) - 1];
  std::lock_guard lock(b.mutex);
  if (b.count < max_events) {
    if (b.chunks.empty() || b.chunks.back().size() == chunk_events) {
      b.chunks.emplace_back().reserve(chunk_events);
    }
    b.chunks.back().push_back(e);
    ++b.count;
  } else {
    ++b.dropped;
  }
}

DTRAIN_DETAIL_INLINE void timeline::mark_done(std::int64_t start, std::uint64_t index,
                                              std::uint64_t bucket) {
  if (state_->step_start < 0) state_->step_start = start;
  append(track::training,
         {.what = kind::mark, .start = start, .end = now(), .index = index, .detail = bucket});
}

DTRAIN_DETAIL_INLINE void timeline::synchronize_done(std::int64_t start, std::uint64_t step,
                                                     std::uint64_t) {
  const std::int64_t end = now();
  append(track::training, {.what = kind::synchronize, .start = start, .end = end, .index = step});
  // A step runs from its first mark_ready (or synchronize(), when it marked them all) to here.
  const std::int64_t from =
      state_->step_start >= 0 && state_->step_start < start ? state_->step_start : start;
  append(track::training, {.what = kind::step, .start = from, .end = end, .index = step});
  state_->step_start = -1;
}

DTRAIN_DETAIL_INLINE void timeline::microseconds(std::string& out, std::int64_t ns) {
  char text[32];
  std::snprintf(text, sizeof text, "%lld.%03lld", static_cast<long long>(ns / 1000),
                static_cast<long long>(ns % 1000));
  out += text;
}

DTRAIN_DETAIL_INLINE std::string timeline::name_of(const event& e) const {
  switch (e.what) {
    case kind::step: return "step " + std::to_string(e.index);
    case kind::mark:
      return e.index < state_->names.size() ? state_->names[e.index]
                                            : "parameter #" + std::to_string(e.index);
    case kind::synchronize: return "synchronize";
    case kind::wait: return "wait for buckets";
    case kind::reduce: return "allreduce bucket " + std::to_string(e.index);
    case kind::bucket_begin:
    case kind::bucket_end: return "bucket " + std::to_string(e.index);
  }
  return "?";
}

DTRAIN_DETAIL_INLINE const char* timeline::category_of(kind k) {
  switch (k) {
    case kind::step: return "step";
    case kind::mark: return "mark_ready";
    case kind::synchronize:
    case kind::wait: return "synchronize";
    case kind::reduce:
    case kind::bucket_begin:
    case kind::bucket_end: return "bucket";
  }
  return "?";
}

DTRAIN_DETAIL_INLINE void timeline::render_event(std::string& out, track t, const event& e) const {
  out += ",\n{\"name\":";
  json::write_string(out, name_of(e));
  out += ",\"cat\":\"";
  out += category_of(e.what);
  out += "\",\"pid\":" + std::to_string(state_->rank) +
         ",\"tid\":" + std::to_string(static_cast<int>(t)) + ",\"ts\":";
  microseconds(out, e.start);
  if (e.what == kind::bucket_begin || e.what == kind::bucket_end) {
    out += e.what == kind::bucket_begin ? ",\"ph\":\"b\"" : ",\"ph\":\"e\"";
    out += ",\"id\":" + std::to_string(e.id);
  } else {
    out += ",\"ph\":\"X\",\"dur\":";
    microseconds(out, e.end - e.start);
  }
  switch (e.what) {
    case kind::mark:
      out += ",\"args\":{\"index\":" + std::to_string(e.index) +
             ",\"bucket\":" + std::to_string(e.detail) + "}";
      break;
    case kind::bucket_begin:
      out += ",\"args\":{\"elements\":" + std::to_string(e.detail) + "}";
      break;
    case kind::wait: out += ",\"args\":{\"buckets\":" + std::to_string(e.detail) + "}"; break;
    default: break;
  }
  out += "}";
}

DTRAIN_DETAIL_INLINE void timeline::metadata(std::string& out, const char* what, int tid,
                                             std::string_view name) const {
  out += ",\n{\"name\":\"";
  out += what;
  out += "\",\"ph\":\"M\",\"pid\":" + std::to_string(state_->rank) +
         ",\"tid\":" + std::to_string(tid) + ",\"args\":{\"name\":";
  json::write_string(out, name);
  out += "}}";
}

DTRAIN_DETAIL_INLINE std::string timeline::render() const {
  std::string out = "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"generator\":\"dtrain\",";
  std::size_t dropped = 0;
  for (const buffer& b : state_->tracks) {
    std::lock_guard lock(b.mutex);
    dropped += b.dropped;
  }
  out += "\"rank\":" + std::to_string(state_->rank) +
         ",\"world_size\":" + std::to_string(state_->size) +
         ",\"dropped_events\":" + std::to_string(dropped) + "},\n\"traceEvents\":[";
  out += "\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" + std::to_string(state_->rank) +
         ",\"tid\":0,\"args\":{\"sort_index\":" + std::to_string(state_->rank) + "}}";
  metadata(out, "process_name", 0, "rank " + std::to_string(state_->rank));
  metadata(out, "thread_name", static_cast<int>(track::training), "training");
  metadata(out, "thread_name", static_cast<int>(track::communication), "communication");
  for (std::size_t t = 0; t < state_->tracks.size(); ++t) {
    const buffer& b = state_->tracks[t];
    std::lock_guard lock(b.mutex);
    for (const std::vector<event>& chunk : b.chunks) {
      for (const event& e : chunk) render_event(out, static_cast<track>(t + 1), e);
    }
  }
  out += "\n]}\n";
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/ddp/timeline.hpp ----

#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

namespace dtrain {

/// What a DDP takes its communicator, host control plane and world from:
/// dtrain::context<Policy>. A concept, so that DDP does not include the
/// runtime (agent, store server) that context.hpp brings. A context with an
/// `environment()` (the snapshot dtrain::context took at start) gives DDP
/// the variables it reads (DTRAIN_TIMELINE).
template <class C, class Policy>
concept ddp_context = requires(C& c) {
  { c.communicator() } -> std::same_as<typename Policy::communicator_type&>;
  { c.control_plane() } -> std::convertible_to<control_plane>;
  { c.world() } -> std::convertible_to<const world&>;
};

namespace detail {
/// The environment snapshot of `ctx`, or (a context without one) of the process now.
template <class Context>
environment environment_of(Context& ctx) {
  if constexpr (requires {
                  { ctx.environment() } -> std::convertible_to<const environment&>;
                }) {
    return ctx.environment();
  } else {
    return environment::from_process();
  }
}
}  // namespace detail

/// The model-free core of DistributedDataParallel, over the communicator of
/// `Policy`, built from the parameters (and buffers) as dtrain sees them.
///
/// Per step: mark each parameter ready (mark_ready) as soon as its gradient
/// is final, or all at once after the backward pass (mark_all_ready), then
/// synchronize(); gradients then hold the mean over ranks. Every member may
/// be called from any thread (autograd's hooks mark from theirs): one lock
/// serialises them. Between mark_ready and synchronize() a gradient belongs
/// to dtrain: do not touch it.
template <class Policy>
class basic_ddp {
 public:
  using communicator_type = typename Policy::communicator_type;
  /// The communicators a bucket's allreduce runs on (topology::flat::group,
  /// topology::hierarchical::group), split from DDP's own communicator.
  using topology_group =
      typename Policy::topology_type::template group<typename Policy::communicator_type>;
  /// Where gradients and buckets live: host_memory, or cuda_memory for NCCL.
  using memory_space = typename Policy::memory_space;
  /// The compute stream's type (cudaStream_t for CUDA; a null placeholder on the host).
  using stream_type = typename memory_space::stream_type;
  /// A user reduction: must leave the mean over ranks in `bucket.data` once
  /// the returned work completes (e.g. `return comm.allreduce(b.data, b.data, reduce_op::avg);`).
  using comm_hook = std::function<work(communicator_type&, gradient_bucket&)>;
  static constexpr bool on_device = memory_space::where == memory::device;
  /// With ddp_options::find_unused_parameters, the parameters that no rank
  /// marked in this many first synchronized steps are named once on rank 0's
  /// stderr (ddp_options::report_unused_parameters = false silences it).
  static constexpr std::size_t unused_report_steps = 2;

  /// Collective over ctx's communicator (a dtrain::context<Policy>); metadata
  /// goes over ctx's control plane where the communicator cannot carry host
  /// data (NCCL). The policy's topology groups the ranks by ctx.world()'s
  /// nodes; DTRAIN_TIMELINE is read from ctx's environment snapshot.
  template <ddp_context<Policy> Context>
  basic_ddp(Context& ctx, std::vector<parameter> parameters, std::vector<parameter> buffers = {},
            ddp_options options = {})
      : basic_ddp(ctx.communicator(), ctx.control_plane(), std::move(parameters),
                  std::move(buffers), std::move(options), node_layout::of(ctx.world()),
                  detail::environment_of(ctx)) {}

  /// Collective over `comm`, which carries the metadata too (MPI, Gloo: a
  /// communicator that reaches host memory). A device-only backend (NCCL)
  /// needs the constructor with a control plane. Without a context, the
  /// variables DDP reads (DTRAIN_TIMELINE, DTRAIN_NODE_NAME) come from a
  /// snapshot of the process environment taken here.
  /// (A template only so that an explicit instantiation of the class for NCCL
  /// does not trip the static_assert.)
  template <std::same_as<communicator_type> Comm>
  basic_ddp(Comm& comm, std::vector<parameter> parameters, std::vector<parameter> buffers = {},
            ddp_options options = {})
      : basic_ddp(comm, nullptr, std::move(parameters), std::move(buffers), std::move(options),
                  std::nullopt, environment::from_process()) {
    static_assert(std::same_as<Comm, communicator_type> && communicator_type::reaches_host_memory,
                  "this backend moves device memory only, and DistributedDataParallel's metadata "
                  "(model agreement, bucket order) is host data: construct it from the context, "
                  "or pass a control plane: DistributedDataParallel(comm, "
                  "dtrain::control_plane(channel), model) with a dtrain::store_channel");
  }

  /// Collective: checks that every rank holds the same parameters (names,
  /// counts, types; config_error naming the first difference and the ranks)
  /// over `control`, copies rank 0's values to all (complete when this
  /// returns), lays the gradients out in buckets, and starts the bucket
  /// runner. Buckets travel on a split of `comm` of their own: the caller may
  /// use `comm` at any time. `control` carries the metadata when `comm` cannot
  /// (device-only backends; otherwise DDP's own split of `comm` does), and must
  /// outlive this object. With topology::hierarchical and no context, ranks
  /// are grouped into nodes by node name (DTRAIN_NODE_NAME, else the host name).
  basic_ddp(communicator_type& comm, control_plane control, std::vector<parameter> parameters,
            std::vector<parameter> buffers = {}, ddp_options options = {})
      : basic_ddp(comm, &control, std::move(parameters), std::move(buffers), std::move(options),
                  std::nullopt, environment::from_process()) {}

  basic_ddp(const basic_ddp&) = delete;
  basic_ddp& operator=(const basic_ddp&) = delete;

  /// Waits for buckets still in flight (each within its timeout), then gives
  /// the model its gradients back: bucket views are copied to the model's own
  /// buffers (or set to null where it had none), since the buckets go with
  /// this object.
  ~basic_ddp();

  /// Marks parameter `index` (its position in parameters()) ready for this
  /// step. Throws dtrain::error naming it when it was marked already.
  void mark_ready(std::size_t index) {
    if (index >= vars_.size()) no_such_index(index);
    mark(index);
  }
  /// Marks the parameter called `name` ready.
  void mark_ready(std::string_view name) {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) no_such_name(name);
    mark(it->second);
  }
  /// Marks `p` ready, found by its values' address.
  void mark_ready(const parameter& p) {
    auto it = by_data_.find(p.values.data);
    if (it == by_data_.end()) not_a_parameter(p);
    mark(it->second);
  }
  /// Marks each of a braced list ready: `mark_ready({"fc2.w", "fc2.b"})`.
  /// (Without these, `{"a", "b"}` would build one string_view from the two
  /// pointers as an iterator range.)
  void mark_ready(std::initializer_list<std::string_view> names) {
    for (std::string_view n : names) mark_ready(n);
  }
  /// `mark_ready({4, 5})`: by index.
  void mark_ready(std::initializer_list<std::size_t> indices) {
    for (std::size_t i : indices) mark_ready(i);
  }
  /// `mark_ready({p, q})`: by parameter.
  void mark_ready(std::initializer_list<std::reference_wrapper<const parameter>> params) {
    for (const parameter& p : params) mark_ready(p);
  }
  /// Marks each of `params` ready: parameters, indices or names.
  template <std::ranges::input_range R>
  requires(!std::convertible_to<R, std::string_view>) void mark_ready(R&& params) {
    for (auto&& p : params) mark_ready(p);
  }
  /// Marks every parameter not yet marked in this step, last parameter
  /// first (the order a backward pass finishes them). After the whole
  /// backward pass, `ddp.mark_all_ready(); ddp.synchronize();` is the minimal
  /// correct step (no overlap: the buckets are queued here without waking the
  /// communication thread, and synchronize() reduces them on its own thread).
  void mark_all_ready();

  /// Completes the step: launches what is left and leaves the mean over ranks
  /// in every gradient. Host memory: waits until every bucket is averaged
  /// (bounded by the collective timeout). CUDA: the host waits for nothing;
  /// the compute stream waits for the averaged gradients, and a watchdog
  /// bounds every bucket by the collective timeout (its timeout_error is
  /// thrown here or by the next call). Throws dtrain::error naming the
  /// parameters that were never marked (unless find_unused_parameters), or
  /// the engine's error. Inside no_sync() it does nothing.
  void synchronize();

  /// Writes the timeline (DTRAIN_TIMELINE, ddp_options::timeline) recorded so
  /// far; the destructor writes it too. Call it between steps. Throws
  /// dtrain::error naming the file and the rank when it cannot be written.
  void flush_timeline() const { timeline_.write(); }

  /// The stream the backward pass runs on (CUDA; default: ddp_options::stream,
  /// whose null is the legacy default stream). Set it before a step, not between mark_ready and
  /// synchronize() (config_error): buckets launched in a step are ordered after it.
  void set_stream(stream_type compute) requires(memory_space::on_stream) {
    const std::lock_guard lock(mutex_);
    change_stream(compute);
  }
  /// set_stream(compute), then synchronize().
  void synchronize(stream_type compute) requires(memory_space::on_stream) {
    synchronize_on(compute);
  }
  /// Blocks the host until every bucket launched so far has been averaged
  /// on the device (each within the collective timeout): for measuring, or
  /// before reading gradients on the host. Throws what a bucket failed with.
  void wait();

  /// While alive, mark_ready only records and nothing is communicated;
  /// gradients accumulate as the caller adds into them, and the next
  /// synchronized step averages the sums. Made only by no_sync(), which
  /// refuses to start one in the middle of a step.
  class no_sync_guard {
   public:
    no_sync_guard(no_sync_guard&& other) noexcept : ddp_(std::exchange(other.ddp_, nullptr)) {}
    no_sync_guard(const no_sync_guard&) = delete;
    no_sync_guard& operator=(const no_sync_guard&) = delete;
    no_sync_guard& operator=(no_sync_guard&&) = delete;
    ~no_sync_guard() {
      if (!ddp_) return;
      const std::lock_guard lock(ddp_->mutex_);
      --ddp_->no_sync_depth_;
    }

   private:
    friend class basic_ddp;
    explicit no_sync_guard(basic_ddp& ddp) noexcept : ddp_(&ddp) {}  // the lock is held
    basic_ddp* ddp_;
  };
  /// Gradient accumulation: `{ auto g = ddp.no_sync(); forward; backward; }`.
  /// Throws dtrain::error in the middle of a step (after mark_ready, before synchronize()).
  [[nodiscard]] no_sync_guard no_sync();

  /// Sets every gradient to zero (between steps only).
  void zero_grad();

  /// Replaces the allreduce of each bucket by `hook` (all ranks must register
  /// the same). Not with gradient compression, which is itself such a reduction.
  void register_comm_hook(comm_hook hook);

  /// What a wrapper that finds the unused parameters itself tells the core
  /// (dtrain::torch walks autograd's graph, as c10d's prepare_for_backward
  /// does): with find_unused_parameters, the parameters listed (indices into
  /// parameters()) are not reached by the coming backward pass. They are
  /// marked ready, contributing zero (or what no_sync() accumulated), as soon
  /// as the step's first other parameter is marked; marking one of them is an
  /// error. The last call before a step counts; between steps only
  /// (dtrain::error otherwise, or without find_unused_parameters).
  void prepare_for_backward(std::span<const std::size_t> unused);

  /// `callback` runs on the marking thread, after the lock is released, when
  /// mark_ready() marks the last parameter of a step outside no_sync() (not
  /// when mark_all_ready() or synchronize() do). dtrain::torch queues
  /// autograd's final callback there, which completes the step.
  void on_all_marked(std::function<void()> callback);

  /// Collective over DDP's communicator, on every rank after the same
  /// synchronize(): per parameter, whether some rank used it (marked it, or
  /// accumulated into it in no_sync()) in the step just completed. One small
  /// sum, computed once per step and only with find_unused_parameters;
  /// without it, or at world size 1, nothing is communicated.
  [[nodiscard]] std::vector<bool> used_anywhere();

  // Sharding (ddp_options::sharding, ZeRO stages 1 and 2; ddp/basic_ddp_shards.hpp).
  // The same calls work without sharding, where a rank's shard is every parameter.

  /// The pieces of the parameters this rank updates, with their averaged
  /// gradients: after synchronize(), an elementwise optimizer updates each
  /// piece's values (state at piece.state_offset), then gather_parameters().
  /// Without sharding (or on one rank): every parameter, whole.
  [[nodiscard]] std::span<const shard_piece> shard() const noexcept { return pieces_; }
  /// This rank's shard as ranges of the whole model's elements (the
  /// parameters concatenated in index order): `global` where a piece starts
  /// there, `local` its state_offset. For checkpoint::add_sharded, which
  /// re-cuts sharded optimizer state for another world size.
  [[nodiscard]] std::vector<shard_range> shard_ranges() const {
    std::vector<std::uint64_t> first(vars_.size() + 1, 0);
    for (std::size_t i = 0; i < vars_.size(); ++i)
      first[i + 1] = first[i] + vars_[i].param.values.count;
    std::vector<shard_range> out;
    out.reserve(pieces_.size());
    for (const shard_piece& p : pieces_)
      out.push_back({first[p.parameter] + p.offset, p.state_offset, p.values.count});
    return out;
  }
  /// Elements of the whole model (every parameter's), the `total` of shard_ranges().
  [[nodiscard]] std::uint64_t model_elements() const noexcept {
    std::uint64_t n = 0;
    for (const variable& v : vars_) n += v.param.values.count;
    return n;
  }
  /// What DDP holds itself on this rank (buckets, shards, scratch), in bytes.
  [[nodiscard]] ddp_memory_use memory_use() const {
    ddp_memory_use use;
    for (const bucket& b : buckets_) {
      use.buckets += b.grads.bytes();
      use.shards += b.owned.bytes();
      use.scratch += b.wire.bytes() + b.shard.bytes();
    }
    return use;
  }
  /// Elements of this rank's shard: the size of an elementwise optimizer's
  /// state array (per state: Adam keeps two).
  [[nodiscard]] std::size_t shard_elements() const noexcept { return shard_elements_; }
  /// The optimizer's step over this rank's shard, then the values' allgather:
  /// `update(piece)` for each piece of shard(), then gather_parameters().
  /// Once after each synchronize() (dtrain::error otherwise, naming the rank:
  /// a step on gradients that were not averaged would be silently wrong).
  /// Sharded, each bucket's allgather starts as soon as its pieces are
  /// updated, while the update goes on with the next bucket's.
  template <class Update>
  requires std::invocable<Update&, const shard_piece&>
  void optimizer_step(Update&& update) {
    {
      const std::lock_guard lock(mutex_);
      check_usable_locked();
      check_updatable("optimizer_step()");
    }
    std::vector<work> gathers;
    std::size_t k = 0;  // pieces_ are in bucket order
    try {
      for (std::size_t b = 0; b < buckets_.size(); ++b) {
        for (; k < pieces_.size() && pieces_[k].bucket == b; ++k) update(pieces_[k]);
        if (sharded() && size_ > 1) gathers.push_back(launch_gather(b));
      }
      for (; k < pieces_.size(); ++k) update(pieces_[k]);
    } catch (...) {
      // The update failed on this rank: what was launched completes (or
      // fails), and this DDP is not usable for another step.
      abandon_gathers(gathers);
      throw;
    }
    finish_gather(gathers);
  }
  /// Collective: every rank's updated shard to every rank (an allgather per
  /// bucket), so that every rank holds all the values again; DDP's gradient
  /// buckets are its scratch and are zeroed after. Once after each
  /// synchronize(), after this rank's update of its shard. Nothing to send
  /// without sharding or on one rank.
  void gather_parameters();
  /// The L2 norm of the averaged gradients of the whole model, the same on
  /// every rank (collective with sharding: each rank sums its shard's
  /// squares). For clipping: scale the pieces' gradients by max_norm / norm.
  /// After synchronize(), before gather_parameters(). float32 and float64.
  [[nodiscard]] double gradient_norm();
  /// Collective: whether `mine` is true on any rank, on every rank (to skip a
  /// step together when some rank found an inf or a NaN).
  [[nodiscard]] bool any_rank(bool mine);

  /// Throws dtrain::error naming the failure after which this DDP cannot be
  /// used (an engine's error, a timeout); nothing when it is usable.
  void check_usable() const {
    const std::lock_guard lock(mutex_);
    check_usable_locked();
  }

  /// The state of the current step: whether parameter i is marked ready in it.
  [[nodiscard]] bool marked(std::size_t i) const;
  /// Whether prepare_for_backward() listed parameter i for the current step.
  [[nodiscard]] bool declared_unused(std::size_t i) const;
  /// Parameters not yet marked ready in the current step.
  [[nodiscard]] std::size_t unmarked() const;
  /// Some parameter was marked ready outside no_sync() and the step is not
  /// complete: no_sync(), zero_grad() and the next step must wait for synchronize().
  [[nodiscard]] bool step_open() const;
  /// Nothing was marked or accumulated since the last completed step.
  [[nodiscard]] bool idle() const;
  /// Inside no_sync().
  [[nodiscard]] bool accumulating() const;

  // What DDP is: these never wait for the lock, so that a communication hook
  // (which runs while synchronize() holds it) may ask them. The layout and
  // gradient pointers change only in synchronize(), at the first step's rebuild.

  /// The buckets, in launch order (a copy of the current layout).
  [[nodiscard]] std::vector<bucket_info> buckets() const;
  /// Whether the one rebuild from the observed ready order has happened.
  [[nodiscard]] bool buckets_rebuilt() const noexcept {
    return rebuilt_.load(std::memory_order_relaxed);
  }
  /// The parameters as dtrain sees them, gradient pointers current: a
  /// random-access view (`parameters()[i].name`, `.size()`, range-for).
  [[nodiscard]] detail::parameter_view parameters() const noexcept {
    return detail::parameters_of(vars_);
  }
  /// Synchronized steps completed.
  [[nodiscard]] std::size_t steps() const noexcept {
    return steps_.load(std::memory_order_relaxed);
  }
  /// The options DDP was built with.
  [[nodiscard]] const ddp_options& options() const noexcept { return options_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  /// The communicator the buckets travel on: DDP's own split of the user's.
  [[nodiscard]] communicator_type& communicator() noexcept { return comm_; }
  /// How buckets are reduced: the policy's topology over communicator()
  /// (describe(), and for topology::hierarchical hierarchical() and why_flat()).
  [[nodiscard]] const topology_group& topology() const noexcept { return topo_; }
  /// Whether float32 buckets can be compressed here: always on the host; on
  /// a GPU when some translation unit of the program was compiled by nvcc.
  [[nodiscard]] static bool compression_available() noexcept {
    return memory_space::casts_available();
  }

 protected:
  // For DistributedDataParallel's context constructor (the layout from the world).
  basic_ddp(communicator_type& comm, control_plane control, std::vector<parameter> parameters,
            std::vector<parameter> buffers, ddp_options options, std::optional<node_layout> layout,
            const environment& env)
      : basic_ddp(comm, &control, std::move(parameters), std::move(buffers), std::move(options),
                  layout, env) {}

 private:
  template <class>
  friend class detail::thread_runner;
  template <class>
  friend class detail::stream_runner;

  using variable = detail::ddp_variable;
  using bucket = detail::ddp_bucket<memory_space>;
  using runner_type = std::conditional_t<memory_space::on_stream, detail::stream_runner<basic_ddp>,
                                         detail::thread_runner<basic_ddp>>;
  // The control plane DDP makes for itself over its own communicator (host backends).
  using own_channel_type =
      std::conditional_t<communicator_type::reaches_host_memory,
                         communicator_channel<communicator_type>, std::monostate>;

  basic_ddp(communicator_type& comm, control_plane* given, std::vector<parameter> parameters,
            std::vector<parameter> buffers, ddp_options options, std::optional<node_layout> layout,
            const environment& env);

  own_channel_type make_own_channel();
  control_plane control_for(control_plane* given);
  node_layout layout_of(const std::optional<node_layout>& given, const environment& env);
  static int device_of(communicator_type& comm);
  void lay_out(std::span<const std::size_t> order);

  bool compressed(const bucket_info& b) const noexcept {
    return options_.compression != gradient_compression::none && b.type == dtype::float32;
  }

  // Marking (ddp/basic_ddp_step.hpp). mark() takes the lock and runs the
  // all-marked callback after releasing it; the others run under the lock.
  void mark(std::size_t i);
  bool ready(std::size_t i);
  void record_mark(std::size_t i, bool by_rank);
  [[noreturn]] void no_such_index(std::size_t index) const;
  [[noreturn]] void no_such_name(std::string_view name) const;
  [[noreturn]] void not_a_parameter(const parameter& p) const;
  [[noreturn]] void marked_twice(std::size_t i) const;
  void check_between_steps(const char* what) const;

  bool recording() const noexcept {
    return options_.rebuild_buckets && !sharded() && !rebuilt_ && steps_ == 0;
  }
  bool sharded() const noexcept { return options_.sharding != sharding::none; }
  /// Stage 2 over a flat group: buckets are reduce-scattered into `owned`.
  bool scattered() const noexcept {
    return options_.sharding == sharding::gradients && size_ > 1 && !topo_.hierarchical();
  }
  void make_pieces();
  void check_updatable(const char* what) const;
  work launch_gather(std::size_t b);
  void finish_gather(std::vector<work>& gathers);
  void abandon_gathers(std::vector<work>& gathers);
  /// World size 1 without a hook: nothing to send (ddp_options::always_reduce).
  bool alone() const noexcept { return size_ == 1 && !hook_ && !options_.always_reduce; }

  void change_stream(stream_type compute);
  std::string take_stream();
  void synchronize_on(stream_type compute);
  void synchronize_locked();
  void launch_ready();
  void finish_alone(std::size_t b);
  void complete_marks();
  std::vector<bool> used_anywhere_locked();
  void report_unused();
  void zero_contribution(std::size_t i);

  // The runner's steps (detail::thread_runner, detail::stream_runner). They
  // run without the lock: they touch only bucket b and its parameters'
  // places, which nothing changes while b is in flight.
  void prepare_bucket(std::size_t b);
  work reduce(std::size_t b);
  void finish_bucket(std::size_t b);
  /// Streams: the compute stream waits (on the device) for every collective so far.
  void order_after_buckets() {
    if constexpr (memory_space::on_stream) topo_.stream_wait(stream_);
  }
  /// `data` summed over DDP's communicator in place, ordered after the compute stream.
  work sum_in_place(const buffer& data) {
    if constexpr (memory_space::on_stream) {
      return comm_.allreduce(data, data, reduce_op::sum, stream_);
    } else {
      return comm_.allreduce(data, data, reduce_op::sum);
    }
  }

  // The compute stream for engines that order after it; null for host memory.
  stream_handle on_stream_or_null() const noexcept {
    if constexpr (memory_space::on_stream) {
      return stream_;
    } else {
      return nullptr;
    }
  }

  std::exception_ptr complete_buckets();
  std::exception_ptr runner_drain();
  void end_step();
  std::vector<std::size_t> layout_order() const;
  void reset_step();

  void check_usable_locked() const {
    if (broken_) unusable();
  }
  [[noreturn]] void unusable() const;
  [[noreturn]] void fail(std::exception_ptr e);

  // A communicator of its own (a split of the user's), so that collectives the
  // user issues during a step cannot interleave with the buckets' differently on different ranks.
  communicator_type comm_;
  own_channel_type own_channel_;
  control_plane control_;
  topology_group topo_;  // after control_: made over it
  ddp_options options_;
  int rank_;
  int size_;
  int device_ = -1;
  std::vector<variable> vars_;  // never resized after construction: parameters() views it
  std::vector<parameter> buffers_;
  std::unordered_map<std::string_view, std::size_t> by_name_;
  std::unordered_map<const void*, std::size_t> by_data_;
  std::vector<bucket> buckets_;
  // The current step.
  std::vector<std::size_t> ready_order_;  // recorded for the rebuild
  std::size_t next_launch_ = 0;
  std::size_t unmarked_ = 0;
  bool any_marked_ = false;      // outside no_sync()
  bool any_touched_ = false;     // marked or accumulated since the last completed step
  bool unused_pending_ = false;  // prepare_for_backward() listed some, not yet marked
  int no_sync_depth_ = 0;
  bool in_bulk_ = false;  // mark_all_ready() or synchronize() launching: no thread wake-up
  // Across steps.
  std::atomic<std::size_t> steps_ = 0;  // read without the lock: steps()
  std::atomic<bool> rebuilt_ = false;
  std::vector<std::int32_t> used_counts_;  // used_anywhere() of step used_step_
  std::size_t used_step_ = 0;              // 0: none yet (a step's count is taken after it)
  bool broken_ = false;
  std::string broken_message_;
  // Sharding: this rank's pieces (whole parameters without it), and whether
  // the last step was synchronized and not yet updated (optimizer_step()).
  std::vector<shard_piece> pieces_;
  std::size_t shard_elements_ = 0;
  bool updatable_ = false;
  comm_hook hook_;
  std::function<void()> all_marked_;
  stream_type stream_ = nullptr;
  detail::timeline timeline_;          // off unless DTRAIN_TIMELINE or options_.timeline
  mutable std::mutex mutex_;           // everything above that changes during a step
  std::optional<runner_type> runner_;  // last: it calls back into everything above
};

// ---------------------------------------------------------------------------
// Out of class: see the file comment. Construction here; the buckets' layout
// and journey in ddp/basic_ddp_buckets.hpp; the step's state machine in
// ddp/basic_ddp_step.hpp.

template <class Policy>
basic_ddp<Policy>::basic_ddp(communicator_type& comm, control_plane* given,
                             std::vector<parameter> parameters, std::vector<parameter> buffers,
                             ddp_options options, std::optional<node_layout> layout,
                             const environment& env)
    : comm_(comm.split(0, comm.rank())),
      own_channel_(make_own_channel()),
      control_(control_for(given)),
      topo_(comm_, control_, layout_of(layout, env)),
      options_(std::move(options)),
      rank_(comm.rank()),
      size_(comm.size()),
      buffers_(std::move(buffers)) {
  device_ = device_of(comm_);
  std::string problem = take_stream();
  if (problem.empty() && options_.compression != gradient_compression::none &&
      !compression_available()) {
    // Every rank of the same program sees the same; the agreement below stops them all alike.
    problem = "DistributedDataParallel on rank " + std::to_string(rank_) + ": " +
              std::string(detail::device_casts_missing);
  }
  try {
    timeline_ = detail::timeline::of(env, options_.timeline, rank_, size_, parameters);
  } catch (const config_error& e) {
    if (problem.empty()) problem = e.what();  // the agreement stops every rank
  }
  detail::agree_on_model(control_, parameters, buffers_,
                         problem.empty()
                             ? detail::model_problem(parameters, buffers_, options_, rank_,
                                                     communicator_type::name, on_device, device_)
                             : problem,
                         "ddp_options::sharding = " + std::string(to_string(options_.sharding)));
  if (options_.broadcast_parameters) {
    detail::broadcast_values(control_, parameters, buffers_, [&](const buffer& values) {
      if constexpr (memory_space::on_stream) {
        comm_.broadcast(values, 0, stream_).wait();
      } else {
        comm_.broadcast(values, 0).wait();
      }
    });
  }
  vars_.reserve(parameters.size());
  for (parameter& p : parameters) {
    void* original = p.gradient;
    vars_.push_back({.param = std::move(p), .original = original});
  }
  for (std::size_t i = 0; i < vars_.size(); ++i) {
    by_name_.emplace(vars_[i].param.name, i);
    by_data_.emplace(vars_[i].param.values.data, i);
  }
  used_counts_.assign(vars_.size(), 0);  // no step yet: nothing used
  lay_out(detail::reverse_order(vars_.size()));
  // The buckets were zeroed and filled on the compute stream: complete before the first step.
  memory_space::synchronize(device_, stream_);
  runner_.emplace(*this);
}

template <class Policy>
basic_ddp<Policy>::~basic_ddp() {
  runner_.reset();  // joins the thread, or waits out the watchdog
  timeline_.write_at_exit();
  try {
    for (variable& v : vars_) {
      if (!v.view) continue;
      parameter& p = v.param;
      if (v.original) memory_space::copy(v.original, p.gradient, p.bytes(), p.device, stream_);
      p.rebind(p.gradient_slot, v.original);
    }
    memory_space::synchronize(device_, stream_);  // before the buckets are freed
  } catch (...) {
    // A device that failed already reported it; the model's pointers are what they are.
  }
}

template <class Policy>
typename basic_ddp<Policy>::own_channel_type basic_ddp<Policy>::make_own_channel() {
  if constexpr (communicator_type::reaches_host_memory) {
    return own_channel_type(comm_);
  } else {
    return {};
  }
}

// A communicator that reaches host memory carries the metadata itself (no
// store traffic, and packed host values of any size); a device-only one uses `given`.
template <class Policy>
control_plane basic_ddp<Policy>::control_for([[maybe_unused]] control_plane* given) {
  if constexpr (communicator_type::reaches_host_memory) {
    return control_plane(own_channel_);
  } else {
    return *given;  // the constructors without one do not compile for such a communicator
  }
}

// The nodes as the launcher placed them, or (no context) as node names group them.
template <class Policy>
node_layout basic_ddp<Policy>::layout_of(const std::optional<node_layout>& given,
                                         [[maybe_unused]] const environment& env) {
  if constexpr (std::is_same_v<typename Policy::topology_type, topology::flat>) {
    return given.value_or(node_layout{});  // flat needs none: nothing collective
  } else {
    if (given) return *given;
    return detail::layout_from_node_names(control_, node_name(env));
  }
}

template <class Policy>
int basic_ddp<Policy>::device_of(communicator_type& comm) {
  if constexpr (on_device) {
    return comm.device();
  } else {
    (void)comm;
    return -1;
  }
}

}  // namespace dtrain

// ---- begin dtrain/ddp/basic_ddp_buckets.hpp ----
/// @file
/// basic_ddp's buckets: how the gradients are laid out in them (and laid out
/// again at the rebuild), and each bucket's journey once its turn comes:
/// launched in order, prepared (copy-in, compression), reduced by the
/// topology or the user's hook, finished (decompression, copy-out), by the
/// runner of the memory space (ddp/runner.hpp). Out-of-class members of
/// basic_ddp (see ddp/basic_ddp.hpp for why out of class).


#include <cstddef>
#include <cstdint>
#include <exception>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

namespace dtrain {

template <class Policy>
std::vector<bucket_info> basic_ddp<Policy>::buckets() const {
  std::vector<bucket_info> out;
  out.reserve(buckets_.size());
  for (const bucket& b : buckets_) out.push_back(b.info);
  return out;
}

/// Lays the gradients out in buckets filled in `order`, moving each
/// bucket-view gradient (and its values) to its new place. The old buckets
/// are freed only once the copies out of them are complete.
template <class Policy>
void basic_ddp<Policy>::lay_out(std::span<const std::size_t> order) {
  std::vector<bucket_info> layout = detail::assign_buckets(
      parameters(), order, mib_to_bytes(options_.first_bucket_cap_mb, "first_bucket_cap_mb"),
      mib_to_bytes(options_.bucket_cap_mb, "bucket_cap_mb"));
  std::vector<bucket> buckets(layout.size());
  for (std::size_t b = 0; b < layout.size(); ++b) {
    bucket& s = buckets[b];
    s.info = std::move(layout[b]);
    const bucket_info& info = s.info;
    // A hierarchical topology splits a bucket into equal shards, one per
    // rank of a node: zeros at the end make the count divide (GPU: every
    // shard on bucket_alignment too). The padding stays zero.
    std::size_t unit = topo_.granularity();
    if (unit > 1 && info.device >= 0) unit *= bucket_alignment / size_of(info.type);
    // Sharded: size() equal shards, each on bucket_alignment on a GPU.
    if (sharded() && size_ > 1) {
      const std::size_t shard_unit = info.device >= 0 ? bucket_alignment / size_of(info.type) : 1;
      unit = std::lcm(unit, shard_unit * static_cast<std::size_t>(size_));
    }
    s.moved = (info.count + unit - 1) / unit * unit;
    if (sharded() && size_ > 1) {
      s.owned_count = s.moved / static_cast<std::size_t>(size_);
      s.owned = detail::flat_storage<memory_space>(s.owned_count * size_of(info.type), info.device,
                                                   stream_);
    }
    s.grads =
        detail::flat_storage<memory_space>(s.moved * size_of(info.type), info.device, stream_);
    if (compressed(info))
      s.wire = detail::flat_storage<memory_space>(
          s.moved * size_of(detail::wire_type(options_.compression)), info.device, stream_);
    if (const std::size_t shard = topo_.shard_count(s.moved); shard > 0)
      s.shard =
          detail::flat_storage<memory_space>(shard * size_of(info.type), info.device, stream_);
    for (std::size_t k = 0; k < info.parameters.size(); ++k) {
      variable& v = vars_[info.parameters[k]];
      parameter& p = v.param;
      v.bucket = b;
      v.offset = info.offsets[k];
      v.view = options_.gradient_as_bucket_view && p.rebindable();
      if (v.view) {
        void* place = s.grads.data() + v.offset;
        if (p.gradient) memory_space::copy(place, p.gradient, p.bytes(), p.device, stream_);
        p.gradient = place;
        p.rebind(p.gradient_slot, place);
      }
    }
  }
  // The old buckets are released on the compute stream, after the copies
  // out of them and (streams) after every collective on them: the compute
  // stream waits for those already (order_after_buckets). The host does not
  // wait, with CUDA as without.
  buckets_ = std::move(buckets);
  make_pieces();
  reset_step();
}

/// Launches, in bucket order, every bucket whose turn it is and is ready.
template <class Policy>
void basic_ddp<Policy>::launch_ready() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready) {
    const std::size_t b = next_launch_++;
    try {
      buckets_[b].span = timeline_.bucket_launched(b, buckets_[b].info.count);
      if (alone()) {
        finish_alone(b);
      } else {
        runner_->launch(b, !in_bulk_);
      }
    } catch (...) {
      fail(std::current_exception());
    }
  }
}

/// World size 1: the bucket's mean is its gradients. Only compression has
/// something to do (round through the wire type, as on more ranks), on the
/// caller's thread or the compute stream; the timeline still sees the bucket.
template <class Policy>
void basic_ddp<Policy>::finish_alone(std::size_t b) {
  if (compressed(buckets_[b].info)) {
    prepare_bucket(b);
    finish_bucket(b);
  } else if (timeline_.on()) {
    timeline_.bucket_done(b, buckets_[b].span, detail::timeline::now(), false);
  }
}

template <class Policy>
void basic_ddp<Policy>::zero_contribution(std::size_t i) {
  variable& v = vars_[i];
  parameter& p = v.param;
  if (v.view || (alone() && !compressed(buckets_[v.bucket].info))) {
    // World size 1 leaves a copy-mode gradient where it is: zero it there.
    memory_space::zero(p.gradient, p.bytes(), p.device, stream_);
  } else {
    // Copy-mode: the bucket's slice is what travels; the model's buffer gets the mean after.
    memory_space::zero(buckets_[v.bucket].grads.data() + v.offset, p.bytes(), p.device, stream_);
    v.zeroed = true;
  }
}

/// Copy-in and compression: what must happen before the collective.
template <class Policy>
void basic_ddp<Policy>::prepare_bucket(std::size_t b) {
  bucket& s = buckets_[b];
  if (timeline_.on()) s.span_reduce = detail::timeline::now();
  for (std::size_t i : s.info.parameters) {
    const variable& v = vars_[i];
    if (v.view || v.zeroed) continue;
    memory_space::copy(s.grads.data() + v.offset, v.param.gradient, v.param.bytes(), s.info.device,
                       stream_);
  }
  if (!compressed(s.info)) return;
  const float scale = 1.0f / static_cast<float>(size_);  // pre-divide: the sum is the mean
  memory_space::compress(s.wire.data(), reinterpret_cast<const float*>(s.grads.data()),
                         s.info.count, scale, detail::wire_type(options_.compression),
                         s.info.device, stream_);
}

/// The collective of bucket b (or the user's hook), ordered after the compute stream.
template <class Policy>
work basic_ddp<Policy>::reduce(std::size_t b) {
  detail::label_scope label("bucket",
                            static_cast<std::int64_t>(b));  // names it in desync diagnostics
  bucket& s = buckets_[b];
  buffer data{s.grads.data(), s.moved, s.info.type, memory_space::where, s.grads.device()};
  reduce_op op = reduce_op::avg;
  if (compressed(s.info)) {
    data = {s.wire.data(), s.moved, detail::wire_type(options_.compression), memory_space::where,
            s.grads.device()};
    op = reduce_op::sum;
  }
  if (hook_) {
    gradient_bucket view{.index = b,
                         .data = data,
                         .world_size = size_,
                         .parameters = s.info.parameters,
                         .stream = stream_};
    view.data.count = s.info.count;  // the hook sees the slots, not the topology's padding
    return hook_(comm_, view);
  }
  if (scattered()) {  // stage 2: this rank keeps the mean of its shard only
    const buffer mine{s.owned.data(), s.owned_count, data.type, memory_space::where,
                      s.grads.device()};
    return detail::reduce_scatter_on(comm_, data, mine, op, on_stream_or_null());
  }
  const buffer shard{s.shard.data(), topo_.shard_count(s.moved), data.type, memory_space::where,
                     s.grads.device()};
  return topo_.allreduce(data, shard, op, on_stream_or_null());
}

/// Decompression and copy-out: what must happen after the collective.
template <class Policy>
void basic_ddp<Policy>::finish_bucket(std::size_t b) {
  bucket& s = buckets_[b];
  if (compressed(s.info)) {
    memory_space::decompress(reinterpret_cast<float*>(s.grads.data()), s.wire.data(), s.info.count,
                             detail::wire_type(options_.compression), s.info.device, stream_);
  }
  // Stage 2 averaged only this rank's shard (shard() has it): the model's
  // own gradients keep what this rank computed.
  for (std::size_t i : s.info.parameters) {
    const variable& v = vars_[i];
    if (v.view || scattered()) continue;
    memory_space::copy(v.param.gradient, s.grads.data() + v.offset, v.param.bytes(), s.info.device,
                       stream_);
  }
  timeline_.bucket_done(b, s.span, s.span_reduce, !memory_space::on_stream);
}

template <class Policy>
std::exception_ptr basic_ddp<Policy>::complete_buckets() {
  if (alone()) return nullptr;  // each bucket was finished as it was launched
  const auto span = timeline_.wait(buckets_.size());
  return runner_->complete(buckets_.size());
}

template <class Policy>
std::exception_ptr basic_ddp<Policy>::runner_drain() {
  if constexpr (memory_space::on_stream) {
    return runner_->drain();
  } else {
    return nullptr;  // synchronize() waited already
  }
}

/// The parameters in the order the current buckets hold them.
template <class Policy>
std::vector<std::size_t> basic_ddp<Policy>::layout_order() const {
  std::vector<std::size_t> order;
  for (const bucket& b : buckets_)
    order.insert(order.end(), b.info.parameters.begin(), b.info.parameters.end());
  return order;
}

}  // namespace dtrain
// ---- end dtrain/ddp/basic_ddp_buckets.hpp ----
// ---- begin dtrain/ddp/basic_ddp_shards.hpp ----
/// @file
/// basic_ddp's sharding (ddp_options::sharding: ZeRO stages 1 and 2): the
/// pieces of the parameters a rank owns, the allgather of the updated values,
/// and the two helpers every trainer needs beside them (the global gradient
/// norm, a decision all ranks take together). Out-of-class members of
/// basic_ddp (see ddp/basic_ddp.hpp for why out of class).
///
/// A bucket of `moved` elements (padded so that `size()` divides it, each
/// shard on bucket_alignment on a GPU) has `moved / size()` per shard; rank r
/// owns elements [r q, (r + 1) q). A parameter may straddle shards: each rank
/// gets the piece of it that falls in its own. Stage 1 averages whole buckets
/// (an allreduce in place, as DDP); stage 2 reduce-scatters each bucket into
/// the rank's `owned` buffer the moment it is ready. After the optimizer has
/// updated its pieces (in the model's own memory), each rank copies them into
/// `owned`, and an allgather per bucket brings every rank's into the bucket's
/// gradient storage (free once the optimizer has read the gradients), from
/// where every parameter's values are copied back; the bucket is then zeroed
/// for the next step's gradients.


#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace dtrain {

template <class Policy>
void basic_ddp<Policy>::make_pieces() {
  pieces_.clear();
  shard_elements_ = 0;
  if (!sharded() || size_ == 1) {  // every parameter is this rank's, its gradient where it is
    for (std::size_t i = 0; i < vars_.size(); ++i) {
      const parameter& p = vars_[i].param;
      pieces_.push_back({.parameter = i,
                         .offset = 0,
                         .state_offset = shard_elements_,
                         .bucket = vars_[i].bucket,
                         .values = p.values,
                         .gradients = {p.gradient, p.values.count, p.values.type, p.values.where,
                                       p.values.device}});
      shard_elements_ += p.values.count;
    }
    return;
  }
  const auto rank = static_cast<std::size_t>(rank_);
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    bucket& s = buckets_[b];
    const std::size_t elem = size_of(s.info.type);
    const std::size_t first = rank * s.owned_count, last = first + s.owned_count;
    for (std::size_t k = 0; k < s.info.parameters.size(); ++k) {
      const std::size_t i = s.info.parameters[k];
      const parameter& p = vars_[i].param;
      const std::size_t at = s.info.offsets[k] / elem;  // the parameter's first element
      const std::size_t lo = std::max(at, first), hi = std::min(at + p.values.count, last);
      if (lo >= hi) continue;
      buffer values = p.values;
      values.data = static_cast<std::byte*>(p.values.data) + (lo - at) * elem;
      values.count = hi - lo;
      std::byte* gradients =
          scattered() ? s.owned.data() + (lo - first) * elem : s.grads.data() + lo * elem;
      pieces_.push_back(
          {.parameter = i,
           .offset = lo - at,
           .state_offset = shard_elements_,
           .bucket = b,
           .values = values,
           .gradients = {gradients, hi - lo, p.values.type, p.values.where, p.values.device}});
      shard_elements_ += hi - lo;
    }
  }
}

template <class Policy>
void basic_ddp<Policy>::check_updatable(const char* what) const {
  if (updatable_) return;
  throw error("DistributedDataParallel::" + std::string(what) + " on rank " +
              std::to_string(rank_) + " with no averaged gradients to use: " +
              (any_touched_ ? "step " + std::to_string(steps_) + " is not synchronized yet"
                            : "step " + std::to_string(steps_) +
                                  " has not started, and the one "
                                  "before was updated already") +
              " (sharding " + std::string(to_string(options_.sharding)) +
              "). Call synchronize() after the backward pass, then the optimizer once");
}

template <class Policy>
void basic_ddp<Policy>::gather_parameters() {
  {
    const std::lock_guard lock(mutex_);
    check_usable_locked();
    check_updatable("gather_parameters()");
  }
  std::vector<work> gathers;
  if (sharded() && size_ > 1) {
    try {
      for (std::size_t b = 0; b < buckets_.size(); ++b) gathers.push_back(launch_gather(b));
    } catch (...) {
      abandon_gathers(gathers);
      throw;
    }
  }
  finish_gather(gathers);
}

/// This rank's updated values of bucket b into its shard, and the
/// allgather of every rank's into the bucket (its gradients are used up),
/// ordered after the compute stream where the engine takes one.
template <class Policy>
work basic_ddp<Policy>::launch_gather(std::size_t b) {
  bucket& s = buckets_[b];
  const std::size_t elem = size_of(s.info.type);
  const std::size_t first = static_cast<std::size_t>(rank_) * s.owned_count;
  for (std::size_t k = 0; k < pieces_.size(); ++k) {
    const shard_piece& piece = pieces_[k];
    if (piece.bucket != b) continue;
    const std::size_t at = vars_[piece.parameter].offset / elem + piece.offset - first;
    memory_space::copy(s.owned.data() + at * elem, piece.values.data, piece.values.bytes(),
                       s.info.device, stream_);
  }
  const detail::label_scope label("parameters of bucket", static_cast<std::int64_t>(b));
  const buffer mine{s.owned.data(), s.owned_count, s.info.type, memory_space::where,
                    s.grads.device()};
  const buffer all{s.grads.data(), s.moved, s.info.type, memory_space::where, s.grads.device()};
  return detail::allgather_on(comm_, mine, all, on_stream_or_null());
}

/// Waits for the allgathers (each within the collective timeout), then
/// copies every parameter's values that other ranks updated out of the
/// buckets, and zeroes the buckets for the next step's gradients.
template <class Policy>
void basic_ddp<Policy>::finish_gather(std::vector<work>& gathers) {
  const std::lock_guard lock(mutex_);
  updatable_ = false;
  if (!sharded() || size_ == 1) return;
  try {
    for (work& w : gathers) w.wait();
    order_after_buckets();
    const auto rank = static_cast<std::size_t>(rank_);
    for (const variable& v : vars_) {
      const bucket& s = buckets_[v.bucket];
      const std::size_t elem = size_of(s.info.type);
      // The parameter's elements [lo, hi) in the bucket, but for this rank's shard [first, last).
      const std::size_t lo = v.offset / elem, hi = lo + v.param.values.count;
      const std::size_t first = rank * s.owned_count, last = first + s.owned_count;
      auto copy_out = [&](std::size_t from, std::size_t to) {
        if (from >= to) return;
        memory_space::copy(static_cast<std::byte*>(v.param.values.data) + (from - lo) * elem,
                           s.grads.data() + from * elem, (to - from) * elem, s.info.device,
                           stream_);
      };
      copy_out(lo, std::min(hi, first));
      copy_out(std::max(lo, last), hi);
    }
    for (bucket& s : buckets_)
      memory_space::zero(s.grads.data(), s.grads.bytes(), s.grads.device(), stream_);
  } catch (...) {
    fail(std::current_exception());
  }
}

template <class Policy>
void basic_ddp<Policy>::abandon_gathers(std::vector<work>& gathers) {
  for (work& w : gathers) {
    try {
      w.wait();
    } catch (...) {  // the update's exception is the one to report
    }
  }
  const std::lock_guard lock(mutex_);
  updatable_ = false;
  broken_ = true;
  broken_message_ = "the optimizer's update threw on rank " + std::to_string(rank_) +
                    " in the middle of optimizer_step(): the ranks' values may differ";
}

template <class Policy>
double basic_ddp<Policy>::gradient_norm() {
  {
    const std::lock_guard lock(mutex_);
    check_usable_locked();
    check_updatable("gradient_norm()");
  }
  // Streams: the buckets' collectives are done before the host reads what they wrote.
  if constexpr (memory_space::on_stream) wait();
  double squares = 0;
  std::vector<std::byte> staged;
  for (const shard_piece& piece : pieces_) {
    const buffer& g = piece.gradients;
    const void* data = g.data;
    if (g.where == memory::device) {
      staged.resize(g.bytes());
      memory_space::download(staged.data(), g.data, g.bytes(), device_, stream_);
      memory_space::synchronize(device_, stream_);
      data = staged.data();
    }
    if (g.type == dtype::float32) {
      for (const float x : std::span(static_cast<const float*>(data), g.count))
        squares += static_cast<double>(x) * static_cast<double>(x);
    } else if (g.type == dtype::float64) {
      for (const double x : std::span(static_cast<const double*>(data), g.count)) squares += x * x;
    } else {
      throw config_error("DistributedDataParallel::gradient_norm on rank " + std::to_string(rank_) +
                         ": parameter '" + vars_[piece.parameter].param.name + "' is " +
                         std::string(to_string(g.type)) + "; the norm reads float32 and float64");
    }
  }
  if (sharded() && size_ > 1) {
    // Every rank's sum, added in rank order: the same norm on every rank.
    const std::int64_t mine = std::bit_cast<std::int64_t>(squares);
    std::vector<std::int64_t> all(static_cast<std::size_t>(size_));
    control_.allgather(std::span<const std::int64_t>(&mine, 1), all);
    squares = 0;
    for (const std::int64_t s : all) squares += std::bit_cast<double>(s);
  }
  return std::sqrt(squares);
}

template <class Policy>
bool basic_ddp<Policy>::any_rank(bool mine) {
  check_usable();
  const std::int64_t flag = mine ? 1 : 0;
  std::vector<std::int64_t> all(static_cast<std::size_t>(size_));
  control_.allgather(std::span<const std::int64_t>(&flag, 1), all);
  for (const std::int64_t f : all) {
    if (f != 0) return true;
  }
  return false;
}

}  // namespace dtrain
// ---- end dtrain/ddp/basic_ddp_shards.hpp ----
// ---- begin dtrain/ddp/basic_ddp_step.hpp ----
/// @file
/// basic_ddp's step, as a state machine under its lock: parameters are marked
/// ready (by the user, by autograd's hooks, or as unused), buckets launch in
/// turn, synchronize() completes the step, the first step's order rebuilds the
/// buckets once, and no_sync() accumulates instead. Out-of-class members of
/// basic_ddp (see ddp/basic_ddp.hpp for why out of class).


#include <cstdio>
#include <mutex>

namespace dtrain {

template <class Policy>
void basic_ddp<Policy>::mark(std::size_t i) {
  bool last = false;
  {
    const std::lock_guard lock(mutex_);
    last = ready(i);
  }
  if (last && all_marked_) all_marked_();
}

/// The hot path of mark_ready, under the lock. Returns whether it marked the
/// step's last parameter outside no_sync().
template <class Policy>
bool basic_ddp<Policy>::ready(std::size_t i) {
  check_usable_locked();
  variable& v = vars_[i];
  const auto span = timeline_.mark_ready(i, v.bucket);
  any_touched_ = true;
  updatable_ = false;  // a new step: the last one's update (if any) is behind
  if (no_sync_depth_ > 0) {
    v.touched = true;
    return false;
  }
  if (v.unused) {
    throw error("DistributedDataParallel::mark_ready: parameter '" + v.param.name + "' on rank " +
                std::to_string(rank_) +
                " was marked ready after prepare_for_backward() listed it as not reached by "
                "step " +
                std::to_string(steps_) + " (it is sent as zero)");
  }
  if (v.marked) marked_twice(i);
  if (!any_marked_ && unused_pending_) {
    // The step's first gradient: what the backward pass does not reach is ready now
    // (c10d's Reducer), with a zero contribution or what no_sync() accumulated.
    unused_pending_ = false;
    for (std::size_t k = 0; k < vars_.size(); ++k) {
      if (!vars_[k].unused) continue;
      if (!vars_[k].touched) zero_contribution(k);
      record_mark(k, false);
    }
  }
  record_mark(i, true);
  return unmarked_ == 0;
}

/// Parameter i is ready: counted in its bucket, which launches in its turn.
/// `by_rank`: this rank gave it a gradient (not a zero for an unused one).
template <class Policy>
void basic_ddp<Policy>::record_mark(std::size_t i, bool by_rank) {
  variable& v = vars_[i];
  v.marked = true;
  if (by_rank) v.touched = true;
  any_marked_ = true;
  --unmarked_;
  if (recording()) ready_order_.push_back(i);
  bucket& b = buckets_[v.bucket];
  if (--b.pending == 0) {
    b.ready = true;
    if (options_.overlap) launch_ready();
  }
}

template <class Policy>
void basic_ddp<Policy>::no_such_index(std::size_t index) const {
  throw error("DistributedDataParallel::mark_ready: parameter #" + std::to_string(index) +
              " does not exist on rank " + std::to_string(rank_) + " (the model has " +
              std::to_string(vars_.size()) + ")");
}

template <class Policy>
void basic_ddp<Policy>::no_such_name(std::string_view name) const {
  throw error("DistributedDataParallel::mark_ready: rank " + std::to_string(rank_) +
              " has no parameter named '" + std::string(name) + "'");
}

template <class Policy>
void basic_ddp<Policy>::not_a_parameter(const parameter& p) const {
  throw error("DistributedDataParallel::mark_ready: parameter '" + p.name + "' on rank " +
              std::to_string(rank_) +
              " is not one of the model's parameters (its values are elsewhere)");
}

template <class Policy>
void basic_ddp<Policy>::marked_twice(std::size_t i) const {
  throw error("DistributedDataParallel::mark_ready: parameter '" + vars_[i].param.name + "' (#" +
              std::to_string(i) + ") was marked ready twice in step " + std::to_string(steps_) +
              " on rank " + std::to_string(rank_) +
              "; mark each gradient once per step (accumulate inside no_sync())");
}

/// What may only happen between steps (after synchronize(), before the next mark).
template <class Policy>
void basic_ddp<Policy>::check_between_steps(const char* what) const {
  if (any_marked_ && no_sync_depth_ == 0) {
    throw error("DistributedDataParallel::" + std::string(what) + " on rank " +
                std::to_string(rank_) +
                " in the middle of a step (after mark_ready, before synchronize())");
  }
}

template <class Policy>
void basic_ddp<Policy>::mark_all_ready() {
  // Last first, as a backward pass finishes them and as the first layout
  // fills the buckets: recorded for the rebuild, this order changes nothing.
  // The backward pass is over: the caller reduces these buckets itself in
  // synchronize(), without waking the communication thread.
  const std::lock_guard lock(mutex_);
  in_bulk_ = true;
  try {
    for (std::size_t i = vars_.size(); i-- > 0;) {
      if (!vars_[i].marked && !vars_[i].unused) ready(i);
    }
  } catch (...) {
    in_bulk_ = false;
    throw;
  }
  in_bulk_ = false;
}

template <class Policy>
void basic_ddp<Policy>::synchronize() {
  const std::lock_guard lock(mutex_);
  synchronize_locked();
}

template <class Policy>
void basic_ddp<Policy>::synchronize_locked() {
  if (no_sync_depth_ > 0) return;
  {
    const auto span = timeline_.synchronize(steps_);
    check_usable_locked();
    complete_marks();
    if (auto e = complete_buckets()) fail(e);
    end_step();
  }
  if (options_.find_unused_parameters && options_.report_unused_parameters &&
      steps_ <= unused_report_steps)
    report_unused();
}

/// ddp_options::stream becomes the compute stream, as set_stream() makes one
/// (the first broadcast is ordered after it); what is wrong with it, for the
/// agreement to stop every rank.
template <class Policy>
std::string basic_ddp<Policy>::take_stream() {
  const std::string what =
      "DistributedDataParallel on rank " + std::to_string(rank_) + ": ddp_options::stream";
  if constexpr (memory_space::on_stream) {
    static_assert(std::is_same_v<stream_type, stream_handle>,
                  "a memory space on streams takes ddp_options::stream (a stream_handle)");
    try {
      change_stream(options_.stream);
    } catch (const config_error& e) {
      return what + ": " + e.what();
    }
  } else if (options_.stream != nullptr) {
    return what + " is set, but " + std::string(communicator_type::name) +
           " reduces host memory and orders after no stream: leave it null";
  }
  return {};
}

template <class Policy>
void basic_ddp<Policy>::change_stream(stream_type compute) {
  if (compute == stream_) return;
  if (any_marked_) {
    throw config_error("DistributedDataParallel::set_stream on rank " + std::to_string(rank_) +
                       " in the middle of step " + std::to_string(steps_) +
                       " (after mark_ready, before synchronize()): buckets already launched "
                       "are ordered after the old stream; set the stream before the step");
  }
  memory_space::check_stream(device_, compute);
  // What the old stream still does with the buckets comes first; their
  // storage is released on the new one from now on.
  memory_space::order_after(device_, compute, stream_);
  for (bucket& b : buckets_) {
    b.grads.set_stream(compute);
    b.wire.set_stream(compute);
    b.shard.set_stream(compute);
    b.owned.set_stream(compute);
  }
  stream_ = compute;
}

template <class Policy>
void basic_ddp<Policy>::synchronize_on(stream_type compute) {
  const std::lock_guard lock(mutex_);
  if (compute != stream_ && (any_marked_ || next_launch_ > 0) && no_sync_depth_ == 0) {
    throw config_error("DistributedDataParallel::synchronize(stream) on rank " +
                       std::to_string(rank_) + " with a stream other than the one step " +
                       std::to_string(steps_) +
                       " was marked on: call set_stream(stream) before the step instead");
  }
  change_stream(compute);
  synchronize_locked();
}

template <class Policy>
void basic_ddp<Policy>::wait() {
  const std::lock_guard lock(mutex_);
  if (auto e = runner_drain()) fail(e);
  memory_space::synchronize(device_, stream_);
}

template <class Policy>
typename basic_ddp<Policy>::no_sync_guard basic_ddp<Policy>::no_sync() {
  const std::lock_guard lock(mutex_);
  if (any_marked_) {
    throw error("DistributedDataParallel::no_sync() on rank " + std::to_string(rank_) +
                " in the middle of a synchronized step (after mark_ready, before synchronize())");
  }
  ++no_sync_depth_;
  return no_sync_guard(*this);
}

template <class Policy>
void basic_ddp<Policy>::zero_grad() {
  const std::lock_guard lock(mutex_);
  check_between_steps("zero_grad()");
  for (bucket& b : buckets_)
    memory_space::zero(b.grads.data(), b.grads.bytes(), b.grads.device(), stream_);
  for (const variable& v : vars_) {
    if (!v.view) memory_space::zero(v.param.gradient, v.param.bytes(), v.param.device, stream_);
  }
}

template <class Policy>
void basic_ddp<Policy>::register_comm_hook(comm_hook hook) {
  const std::lock_guard lock(mutex_);
  if (any_marked_ || next_launch_ > 0) {
    throw config_error("DistributedDataParallel::register_comm_hook on rank " +
                       std::to_string(rank_) + " in the middle of step " + std::to_string(steps_) +
                       " (after mark_ready, before synchronize()): register it between steps");
  }
  if (options_.sharding == sharding::gradients) {
    throw config_error("DistributedDataParallel::register_comm_hook on rank " +
                       std::to_string(rank_) +
                       ": ddp_options::sharding is gradients, whose buckets are reduce-scattered, "
                       "not allreduced; a hook replaces an allreduce (use sharding::optimizer)");
  }
  if (options_.compression != gradient_compression::none) {
    throw config_error("DistributedDataParallel::register_comm_hook: ddp_options::compression is " +
                       std::string(to_string(options_.compression)) +
                       "; a hook replaces the reduction, so compress inside the hook instead");
  }
  hook_ = std::move(hook);
}

template <class Policy>
void basic_ddp<Policy>::prepare_for_backward(std::span<const std::size_t> unused) {
  const std::lock_guard lock(mutex_);
  if (!options_.find_unused_parameters) {
    throw config_error("DistributedDataParallel::prepare_for_backward on rank " +
                       std::to_string(rank_) +
                       " without ddp_options::find_unused_parameters: set it to leave parameters "
                       "out of a step");
  }
  check_between_steps("prepare_for_backward()");
  for (variable& v : vars_) v.unused = false;
  for (std::size_t i : unused) {
    if (i >= vars_.size()) no_such_index(i);
    vars_[i].unused = true;
  }
  unused_pending_ = !unused.empty();
}

template <class Policy>
void basic_ddp<Policy>::on_all_marked(std::function<void()> callback) {
  const std::lock_guard lock(mutex_);
  all_marked_ = std::move(callback);
}

template <class Policy>
bool basic_ddp<Policy>::marked(std::size_t i) const {
  const std::lock_guard lock(mutex_);
  return i < vars_.size() && vars_[i].marked;
}

template <class Policy>
bool basic_ddp<Policy>::declared_unused(std::size_t i) const {
  const std::lock_guard lock(mutex_);
  return i < vars_.size() && vars_[i].unused;
}

template <class Policy>
std::size_t basic_ddp<Policy>::unmarked() const {
  const std::lock_guard lock(mutex_);
  return unmarked_;
}

template <class Policy>
bool basic_ddp<Policy>::step_open() const {
  const std::lock_guard lock(mutex_);
  return any_marked_;
}

template <class Policy>
bool basic_ddp<Policy>::idle() const {
  const std::lock_guard lock(mutex_);
  return !any_touched_;
}

template <class Policy>
bool basic_ddp<Policy>::accumulating() const {
  const std::lock_guard lock(mutex_);
  return no_sync_depth_ > 0;
}

template <class Policy>
std::vector<bool> basic_ddp<Policy>::used_anywhere() {
  const std::lock_guard lock(mutex_);
  check_usable_locked();
  return used_anywhere_locked();
}

/// The counts of the last completed step: this rank's `touched_last`, summed
/// over the ranks once (in the memory space of the engine, which may reach
/// device memory only), then kept for that step.
template <class Policy>
std::vector<bool> basic_ddp<Policy>::used_anywhere_locked() {
  if (!options_.find_unused_parameters) return std::vector<bool>(vars_.size(), true);
  if (used_step_ != steps_) {
    std::vector<std::int32_t> counts(vars_.size());
    for (std::size_t i = 0; i < vars_.size(); ++i) counts[i] = vars_[i].touched_last ? 1 : 0;
    if (size_ > 1 && !counts.empty()) {
      const detail::label_scope label("parameters used in step",
                                      static_cast<std::int64_t>(steps_) - 1);
      const std::size_t bytes = counts.size() * sizeof(std::int32_t);
      if constexpr (memory_space::where == memory::host) {
        sum_in_place({counts.data(), counts.size(), dtype::int32, memory::host, -1}).wait();
      } else {
        const detail::flat_storage<memory_space> staged(bytes, device_, stream_);
        memory_space::upload(staged.data(), counts.data(), bytes, device_, stream_);
        sum_in_place({staged.data(), counts.size(), dtype::int32, memory::device, device_}).wait();
        memory_space::download(counts.data(), staged.data(), bytes, device_, stream_);
        memory_space::synchronize(device_, stream_);
      }
    }
    used_counts_ = std::move(counts);
    used_step_ = steps_;
  }
  std::vector<bool> used(vars_.size());
  for (std::size_t i = 0; i < used.size(); ++i) used[i] = used_counts_[i] > 0;
  return used;
}

/// The unmarked parameters of this step: an error, or (find_unused_parameters)
/// zero contributions, marked now in index order on every rank.
template <class Policy>
void basic_ddp<Policy>::complete_marks() {
  if (unmarked_ > 0 && !options_.find_unused_parameters) {
    const std::string names =
        detail::pick_names(parameters(), [&](std::size_t i) { return !vars_[i].marked; }).names;
    throw error("DistributedDataParallel::synchronize: rank " + std::to_string(rank_) +
                " never marked " + std::to_string(unmarked_) + " of " +
                std::to_string(vars_.size()) + " parameters ready in step " +
                std::to_string(steps_) + ": " + names +
                "; call mark_ready for every parameter (or mark_all_ready() after the backward "
                "pass), or set ddp_options::find_unused_parameters");
  }
  for (std::size_t i = 0; i < vars_.size(); ++i) {
    if (vars_[i].marked) continue;
    // Nothing accumulated in no_sync() either: this rank contributes zero.
    if (!vars_[i].touched) zero_contribution(i);
    const auto span = timeline_.mark_ready(i, vars_[i].bucket);
    record_mark(i, false);
  }
  for (bucket& b : buckets_) b.ready = true;
  in_bulk_ = true;  // synchronize() reduces these on the caller's thread next
  launch_ready();
  in_bulk_ = false;
}

/// After each of the first unused_report_steps steps, what some rank used
/// (used_anywhere(), collective: every rank reaches it in the same step);
/// after the last of them, rank 0 names the parameters that no rank marked.
template <class Policy>
void basic_ddp<Policy>::report_unused() {
  const std::vector<bool> used = used_anywhere_locked();
  for (std::size_t i = 0; i < vars_.size(); ++i) vars_[i].used = vars_[i].used || used[i];
  if (steps_ != unused_report_steps || rank_ != 0) return;
  const auto [names, count] =
      detail::pick_names(parameters(), [&](std::size_t i) { return !vars_[i].used; });
  if (count == 0) return;
  std::fprintf(
      stderr,
      "[rank 0/%d] dtrain: DistributedDataParallel: no rank marked %s %s ready in the first "
      "%zu steps; with find_unused_parameters %s treated as unused and %s zeroed. If a "
      "mark_ready was forgotten, add it (or call mark_all_ready() after the backward "
      "pass); if the parameter is unused on purpose, set "
      "ddp_options::report_unused_parameters = false to silence this\n",
      size_, count == 1 ? "parameter" : "parameters", names.c_str(), unused_report_steps,
      count == 1 ? "it is" : "they are", count == 1 ? "its gradient" : "their gradients");
  std::fflush(stderr);
}

/// After every bucket is averaged: the one rebuild, then a fresh step.
template <class Policy>
void basic_ddp<Policy>::end_step() {
  const bool rebuild = recording();
  ++steps_;
  updatable_ = true;  // shard() holds the mean: the optimizer may run once
  for (variable& v : vars_) v.touched_last = v.touched;
  if (rebuild) {
    // Rank 0's order wins, so that every rank lays its buckets out alike.
    const std::vector<std::size_t> agreed =
        detail::agree_on_order(control_, ready_order_, vars_.size());
    rebuilt_ = true;
    // The buckets of this step are done with (host memory) or ordered
    // before everything that follows on the compute stream (streams), where
    // lay_out() copies out of them and releases them.
    if (agreed != layout_order()) lay_out(agreed);
  }
  reset_step();
}

template <class Policy>
void basic_ddp<Policy>::reset_step() {
  for (variable& v : vars_) v.marked = v.touched = v.zeroed = v.unused = false;
  for (bucket& b : buckets_) {
    b.pending = b.info.parameters.size();
    b.ready = false;
  }
  ready_order_.clear();
  next_launch_ = 0;
  unmarked_ = vars_.size();
  any_marked_ = any_touched_ = unused_pending_ = false;
}

template <class Policy>
void basic_ddp<Policy>::unusable() const {
  throw error("DistributedDataParallel on rank " + std::to_string(rank_) +
              " is unusable after an earlier failure: " + broken_message_);
}

template <class Policy>
void basic_ddp<Policy>::fail(std::exception_ptr e) {
  broken_ = true;
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    broken_message_ = x.what();
    throw;
  }
}

}  // namespace dtrain
// ---- end dtrain/ddp/basic_ddp_step.hpp ----
// ---- end dtrain/ddp/basic_ddp.hpp ----
// ---- begin dtrain/detail/link_check.hpp ----
/// @file
/// The link check of separate compilation: a program links dtrain's compiled
/// code for one set of engines, the one its translation units were compiled
/// with, or it does not link.
///
/// The engines change what dtrain's code does (with NCCL, CUDA is compiled in
/// and the MPI engine reaches device memory; with MPI, a failed rank ends the
/// MPI job), so a library built with other engines than a TU would hand that
/// TU other bodies than the ones it expects, and link order would pick one.
/// Two symbols make either mistake a link error that names it:
///   - every TU compiled in separate mode, and every object of the library,
///     refers to `library_built_with_engines_<set>`, which only the library of
///     that set defines: a missing or other library is an undefined reference;
///   - each library (and DTRAIN_INSTANTIATE_COMPILED_POLICIES()) defines
///     `every_unit_must_use_the_same_dtrain_engines`, not weak: objects of two
///     sets in one program (a TU on dtrain::gloo beside one on dtrain::dtrain)
///     are a multiple definition.
/// Header-only TUs take no part. Shared libraries that each link a static
/// dtrain escape the second check (the dynamic linker lets one interpose).


#if DTRAIN_HAS_GLOO()
#define DTRAIN_DETAIL_LINK_GLOO _gloo
#else
#define DTRAIN_DETAIL_LINK_GLOO
#endif
#if DTRAIN_HAS_MPI()
#define DTRAIN_DETAIL_LINK_MPI _mpi
#else
#define DTRAIN_DETAIL_LINK_MPI
#endif
#if DTRAIN_HAS_NCCL()
#define DTRAIN_DETAIL_LINK_NCCL _nccl
#elif DTRAIN_HAS_CUDA()  // DTRAIN_WITH_CUDA=1 alone: the CUDA runtime without NCCL
#define DTRAIN_DETAIL_LINK_NCCL _cuda
#else
#define DTRAIN_DETAIL_LINK_NCCL
#endif
#if !DTRAIN_HAS_GLOO() && !DTRAIN_HAS_MPI() && !DTRAIN_HAS_CUDA()
#define DTRAIN_DETAIL_LINK_NONE _none
#else
#define DTRAIN_DETAIL_LINK_NONE
#endif

#define DTRAIN_DETAIL_LINK_PASTE(a, b, c, d, e) a##b##c##d##e
#define DTRAIN_DETAIL_LINK_NAME(a, b, c, d, e) DTRAIN_DETAIL_LINK_PASTE(a, b, c, d, e)
/// library_built_with_engines_gloo_mpi_nccl, ..._gloo, ..._none: this TU's engines.
#define DTRAIN_DETAIL_LINK_SYMBOL                                              \
  DTRAIN_DETAIL_LINK_NAME(library_built_with_engines, DTRAIN_DETAIL_LINK_GLOO, \
                          DTRAIN_DETAIL_LINK_MPI, DTRAIN_DETAIL_LINK_NCCL,     \
                          DTRAIN_DETAIL_LINK_NONE)

namespace dtrain::detail::link_check {
/// Defined by the compiled library built with this TU's engines, and only there.
extern const int DTRAIN_DETAIL_LINK_SYMBOL;
/// Defined, not weak, by each compiled library: two in one program do not link.
extern const int every_unit_must_use_the_same_dtrain_engines;
}  // namespace dtrain::detail::link_check

/// The library's half (src/link_check.cpp, DTRAIN_INSTANTIATE_COMPILED_POLICIES()),
/// at namespace scope, without a semicolon.
#define DTRAIN_DETAIL_DEFINE_LINK_CHECK()                           \
  namespace dtrain::detail::link_check {                            \
  extern const int DTRAIN_DETAIL_LINK_SYMBOL = 1;                   \
  extern const int every_unit_must_use_the_same_dtrain_engines = 1; \
  }

/// The TU's half: a reference that the linker must resolve, kept even when
/// nothing else in the TU uses dtrain (`used`). GCC and Clang only.
#if defined(__GNUC__)
#define DTRAIN_DETAIL_REQUIRE_LINK_CHECK()                                                 \
  namespace dtrain::detail::link_check {                                                   \
  namespace {                                                                              \
  [[gnu::used]] const int* const this_unit_needs_its_library = &DTRAIN_DETAIL_LINK_SYMBOL; \
  }                                                                                        \
  }
#else
#define DTRAIN_DETAIL_REQUIRE_LINK_CHECK()
#endif
// ---- end dtrain/detail/link_check.hpp ----
// ---- begin dtrain/run.hpp ----
/// @file
/// dtrain::run<Policy>(argc, argv, fn): the whole life of a process in a job.
/// A worker discovers its world, joins the rendezvous, builds the
/// communicator, runs `fn(context&)` and tears down; under launch::per_node
/// the process first started is the node agent, which re-executes the
/// program as the node's workers. Every failure becomes one rank-prefixed
/// line on stderr and a non-zero exit status.

// ---- begin dtrain/launch/agent.hpp ----
/// @file
/// node_agent: the per-node launcher (launch::per_node, dtrun). It starts the
/// node's workers with torchrun's environment, hosts the rendezvous store on
/// node 0, supervises the workers, stops the whole job on the first failure
/// (on every node), restarts it up to a limit, and forwards signals. Each
/// restart round is an agent_round (launch/round.hpp); the agents meet
/// through agent_store (launch/agent_store.hpp).

// ---- begin dtrain/launch/agent_store.hpp ----
/// @file
/// The node agents' side of the job's store: node 0's agent serves it, every
/// agent joins it, meets the others there between restart rounds, beats its
/// heartbeat, records and reads how a round failed (naming the worker that
/// went wrong), and leaves. The keys and the format of their values are
/// launch/protocol.hpp's.

// ---- begin dtrain/launch/signals.hpp ----
/// @file
/// The signals a node agent catches while it runs: SIGINT, SIGTERM and SIGHUP
/// end the job (forwarded to the workers), SIGUSR1 asks the workers for desync
/// diagnostics and stops nothing. The handlers only record the signal; the
/// agent's loop and its waits read it.


#include <array>
#include <csignal>
#include <cstddef>

namespace dtrain::detail {

/// The last signal that asks the agent to end the job (0: none).
inline volatile std::sig_atomic_t agent_signal = 0;

inline void record_agent_signal(int sig) { agent_signal = sig; }

/// SIGUSR1s the agent received and has not forwarded yet: they ask the
/// workers for desync diagnostics and stop nothing.
inline volatile std::sig_atomic_t agent_diagnostics_requests = 0;

inline void record_diagnostics_request(int) { agent_diagnostics_requests = 1; }

/// The signal that ends the job, if one arrived (0: none).
[[nodiscard]] inline int pending_agent_signal() noexcept { return agent_signal; }

/// Takes a pending SIGUSR1 request: true once per request.
[[nodiscard]] DTRAIN_DETAIL_INLINE bool take_diagnostics_request() noexcept;
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE bool take_diagnostics_request() noexcept {
  if (agent_diagnostics_requests == 0) return false;
  agent_diagnostics_requests = 0;
  return true;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Catches SIGINT, SIGTERM and SIGHUP while the agent runs, so it can forward
/// them to the workers, and SIGUSR1, which it forwards without stopping them
/// (desync diagnostics); restores the previous handlers afterwards.
class agent_signal_scope {
 public:
  agent_signal_scope();
  agent_signal_scope(const agent_signal_scope&) = delete;
  agent_signal_scope& operator=(const agent_signal_scope&) = delete;
  ~agent_signal_scope();
  static constexpr std::array<int, 3> signals{SIGINT, SIGTERM, SIGHUP};

 private:
  std::array<struct sigaction, 3> previous_{};
  struct sigaction previous_usr1_ {};
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE agent_signal_scope::agent_signal_scope() {
  agent_signal = 0;
  struct sigaction sa {};
  sa.sa_handler = record_agent_signal;
  sigemptyset(&sa.sa_mask);
  for (std::size_t i = 0; i < signals.size(); ++i) ::sigaction(signals[i], &sa, &previous_[i]);
  agent_diagnostics_requests = 0;
  sa.sa_handler = record_diagnostics_request;
  ::sigaction(SIGUSR1, &sa, &previous_usr1_);
}

DTRAIN_DETAIL_INLINE agent_signal_scope::~agent_signal_scope() {
  for (std::size_t i = 0; i < signals.size(); ++i) ::sigaction(signals[i], &previous_[i], nullptr);
  ::sigaction(SIGUSR1, &previous_usr1_, nullptr);
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/launch/signals.hpp ----

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <netinet/in.h>
#include <sys/socket.h>

namespace dtrain::detail {

/// How often an agent looks at its workers and the store while it waits.
inline constexpr std::chrono::milliseconds agent_poll_interval{20};

/// A port nobody listens on now (it may be taken before it is used: the
/// same race torchrun accepts for --standalone).
DTRAIN_DETAIL_INLINE int pick_free_port();
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE int pick_free_port() {
  unique_fd fd(DTRAIN_SYSCALL(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof addr;
  DTRAIN_SYSCALL(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr));
  DTRAIN_SYSCALL(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len));
  return ntohs(addr.sin_port);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// "2" for 2 s, "0.5" for 500 ms: a duration as a user would have written it.
DTRAIN_DETAIL_INLINE std::string seconds_text(std::chrono::milliseconds t);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string seconds_text(std::chrono::milliseconds t) {
  std::string text = std::to_string(t.count() / 1000);
  if (auto ms = t.count() % 1000; ms != 0) {
    std::string frac = std::to_string(1000 + ms).substr(1);
    while (frac.back() == '0') frac.pop_back();
    text += "." + frac;
  }
  return text;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The agents' summary of a round's first failure. When the failing worker
/// gave up a collective that a worker which had already ended well never
/// issued, that worker comes first: it left early (it skipped a step, say),
/// and the failure is the consequence.
DTRAIN_DETAIL_INLINE std::string describe_failure(const failure_record& failure,
                                                  const std::optional<exit_record>& first_exit);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string describe_failure(const failure_record& failure,
                                                  const std::optional<exit_record>& first_exit) {
  if (!first_exit || failure.rank < 0 || failure.collective <= 0 ||
      first_exit->rank == failure.rank) {
    return failure.message;
  }
  const std::int64_t issued = first_exit->issued_on(failure.communicator);
  if (issued >= failure.collective) return failure.message;
  return first_exit->label + " exited with status 0 after " + std::to_string(issued) +
         " collective" + (issued == 1 ? "" : "s") +
         (failure.communicator == "world" ? "" : " on communicator " + failure.communicator) +
         " while rank " + std::to_string(failure.rank) + " waited in collective #" +
         std::to_string(failure.collective) + "; then " + failure.message;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Every agent bumps its counter about once a second and watches the
/// others': a node whose agent died (and with it its workers) is noticed
/// even while the other nodes' workers are busy computing.
class heartbeat {
 public:
  /// Watches `nodes` (node ranks; this agent's own is skipped).
  explicit heartbeat(std::vector<int> nodes)
      : nodes_(std::move(nodes)),
        seen_(nodes_.size(), -1),
        since_(nodes_.size(), std::chrono::steady_clock::now()) {}

  /// About once a second, reads the others' beats (this agent beats its own
  /// through agent_store::beat()); returns the first node silent for longer than `limit`.
  std::optional<int> check(store_client& store, int me, std::chrono::milliseconds limit);

  /// How many nodes the last check() found silent.
  [[nodiscard]] int silent() const noexcept { return silent_; }

 private:
  std::vector<int> nodes_;
  std::vector<std::int64_t> seen_;
  std::vector<std::chrono::steady_clock::time_point> since_;
  std::chrono::steady_clock::time_point last_{};
  int silent_ = 0;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<int> heartbeat::check(store_client& store, int me,
                                                         std::chrono::milliseconds limit) {
  auto now = std::chrono::steady_clock::now();
  if (now - last_ < std::chrono::seconds(1)) return std::nullopt;
  last_ = now;
  std::optional<int> first;
  silent_ = 0;
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    const int n = nodes_[i];
    if (n == me) continue;
    std::int64_t beat = store.add(agent_keys::beat(n), 0);
    if (beat != seen_[i]) {
      seen_[i] = beat;
      since_[i] = now;
    } else if (now - since_[i] > limit) {
      if (!first) first = n;
      ++silent_;
    }
  }
  return first;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// One agent's connection to the job's store, which node 0's agent also
/// serves. Every wait is bounded by the store timeout and ends early when a
/// signal asks the agent to stop. Store operations throw rendezvous_error
/// when the store is gone.
class agent_store {
 public:
  /// Node 0 serves the store on `bind`:`port` (0: a free port) and connects
  /// to it; the other nodes connect to `master_addr`:`port`.
  agent_store(int node_rank, int nnodes, const std::string& bind, const std::string& master_addr,
              int port, const store_options& options)
      : node_rank_(node_rank),
        nnodes_(nnodes),
        round_size_(nnodes),
        timeout_(options.timeout),
        server_(node_rank == 0 ? std::optional<store_server>(std::in_place, bind, port, options)
                               : std::nullopt),
        port_(server_ ? server_->port() : port),
        client_(node_rank == 0 ? local_store_address(bind) : master_addr, port_, options) {}
  agent_store(const agent_store&) = delete;
  agent_store& operator=(const agent_store&) = delete;

  /// The port of the store (node 0's choice when it was 0).
  [[nodiscard]] int port() const noexcept { return port_; }
  [[nodiscard]] store_client& client() noexcept { return client_; }

  /// Waits, polling, until `done()`; throws error when a signal asks the
  /// agent to stop, timeout_error after the store timeout.
  template <class Done>
  void wait_for(Done done, const std::string& what) {
    if (!poll_until(std::chrono::steady_clock::now() + timeout_, done, what)) {
      throw timeout_error("the node agent waited " + std::to_string(timeout_.count() / 1000) +
                          " s for " + what + " (DTRAIN_STORE_TIMEOUT)");
    }
  }

  /// Polls `done()` until it holds (true) or `until` passes (false), beating
  /// this node's heartbeat meanwhile (a waiting agent is alive too) unless
  /// `beat` is false; throws error when a signal asks the agent to stop.
  template <class Done>
  bool poll_until(std::chrono::steady_clock::time_point until, Done done, const std::string& what,
                  bool beat = true) {
    while (!done()) {
      if (beat) this->beat();
      if (const int sig = pending_agent_signal(); sig != 0) {
        throw error("received signal " + std::to_string(sig) + " while waiting for " + what);
      }
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(agent_poll_interval);
    }
    return true;
  }

  /// Beats this node's heartbeat (agent_keys::beat) if a second has passed
  /// since it last did: the agents watch each other's (class heartbeat).
  void beat() {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_beat_ < std::chrono::seconds(1)) return;
    last_beat_ = now;
    client_.add(agent_keys::beat(node_rank_), 1);
  }

  /// A barrier of all agents that a signal can interrupt.
  void meet(const std::string& key, const std::string& what);

  /// Registers this node, waits for every node, and checks that they all
  /// run the same job shape (config_error naming the node that differs).
  void join(const node_record& me);

  /// The MASTER_PORT of round `restart`'s workers: node 0 picks a free port,
  /// every node reads it.
  int worker_port(int restart);

  /// Records a failure of round `restart` unless one is recorded already.
  void record_failure(int restart, int status, bool final, const std::string& message) {
    detail::record_failure(client_, restart, {status, final, message});
  }

  /// Round `restart`'s first failure, if one is recorded, with its message
  /// as the agents print it (describe_failure). A record that cannot be read
  /// ends the job with its own reason.
  std::optional<failure_record> failure(int restart);

  /// Reports that this node's workers of round `restart` all succeeded.
  void report_success(int restart) { client_.add(agent_keys::succeeded(restart), 1); }
  /// Whether every node reported success for round `restart`.
  [[nodiscard]] bool all_succeeded(int restart) {
    return client_.add(agent_keys::succeeded(restart), 0) >= round_size_;
  }

  /// Nodes found silent (their agents will never leave()): node 0 does not wait for them.
  void lose_nodes(int nodes) noexcept { lost_nodes_ = nodes; }

  // ---- elastic jobs (dtrun --nnodes MIN:MAX) ----------------------------

  /// Registers this node without waiting for the others (a node may come
  /// and go), after checking that it runs the job's shape (node 0's record;
  /// config_error naming what differs). A node that comes back takes its old
  /// place once the agent that held it is found silent for `window` (its
  /// heartbeat, which every agent beats while it waits or runs a round); an
  /// agent still beating holds it, and this one is refused by name.
  void join_elastic(const node_record& me,
                    std::chrono::milliseconds window = std::chrono::milliseconds(2500));

  /// The round a node that starts now joins: the one after the newest round
  /// formed, or round 0.
  int first_round();

  /// Says that this node is ready for round `restart` and returns the
  /// round's nodes (ascending), which node 0 chooses: once at least
  /// `min_nodes` are ready, every node ready within `last_call` after that
  /// (at once when all nnodes are). Every agent counts the round's nodes from
  /// then on (success, leaving). A node not among them joins a later round.
  std::vector<int> form_round(int restart, int min_nodes, std::chrono::milliseconds last_call);

  /// Whether a node is ready for the round after `restart`: one waits to join.
  [[nodiscard]] bool node_waiting(int restart) {
    return client_.add(agent_keys::ready(restart + 1), 0) > 0;
  }

  /// Says this agent is done. Node 0 keeps the store up until every agent
  /// has read how the job ended, at most `grace` + 10 s.
  void leave(std::chrono::milliseconds grace);

 private:
  // config_error when node `n`'s record (`other`) runs another job shape than `me`.
  static void check_same_shape(int n, const node_record& other, const node_record& me);

  // The first worker of the round that ended well; a record that cannot be
  // read only loses that hint.
  std::optional<exit_record> first_exit(int restart);

  int node_rank_;
  int nnodes_;      // of the job (the most, in an elastic one)
  int round_size_;  // nodes of the round under way: nnodes_ unless elastic
  std::chrono::milliseconds timeout_;
  std::optional<store_server> server_;
  int port_;
  store_client client_;
  int lost_nodes_ = 0;
  std::chrono::steady_clock::time_point last_beat_{};
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void agent_store::meet(const std::string& key, const std::string& what) {
  client_.add(key, 1);
  wait_for([&] { return client_.add(key, 0) >= round_size_; }, what);
}

DTRAIN_DETAIL_INLINE void agent_store::join_elastic(const node_record& me,
                                                    std::chrono::milliseconds window) {
  if (node_rank_ != 0) {  // the job's shape first: a refused agent takes no place
    const std::string key = agent_keys::node(0);
    wait_for([&] { return client_.check(std::span<const std::string>(&key, 1)); },
             "node 0's agent to register");
    check_same_shape(0, node_record::decode(key, client_.get(key)), me);
  }
  const std::string mine = agent_keys::node(node_rank_);
  const std::string holder = client_.compare_set(mine, "", me.encode());
  if (holder == me.encode()) return;
  // Held before: by an agent of this node that is gone (it comes back), or
  // by another agent started with this node rank, which still beats.
  const node_record other = node_record::decode(mine, holder);
  const std::string beats = agent_keys::beat(node_rank_);
  const std::int64_t before = client_.add(beats, 0);
  // Without beating: only the holder's beats may move the count.
  poll_until(
      std::chrono::steady_clock::now() + window, [] { return false; },
      "the agent that held node_rank " + std::to_string(node_rank_) + " to beat", false);
  if (client_.add(beats, 0) != before) {
    throw config_error("node_rank " + std::to_string(node_rank_) + " is held by the agent " +
                       other.who() + ", which is running, and this one (" + me.who() +
                       ") asks for it too; give each agent its own --node-rank / NODE_RANK");
  }
  client_.set(mine, me.encode());
}

DTRAIN_DETAIL_INLINE int agent_store::first_round() {
  const std::string key(agent_keys::current_round);
  if (!client_.check(std::span<const std::string>(&key, 1))) return 0;
  const std::int64_t newest = wire::decode_int("store key " + key, client_.get(key), "a round");
  if (newest < 0 || newest > INT32_MAX - 1) {
    throw rendezvous_error("store key " + key + " holds round " + std::to_string(newest));
  }
  return static_cast<int>(newest) + 1;
}

DTRAIN_DETAIL_INLINE std::vector<int> agent_store::form_round(int restart, int min_nodes,
                                                              std::chrono::milliseconds last_call) {
  client_.set(agent_keys::ready_node(restart, node_rank_), wire::encode_int(1));
  client_.add(agent_keys::ready(restart), 1);
  const std::string members_key = agent_keys::members(restart);
  const std::string round = "round " + std::to_string(restart);
  if (node_rank_ == 0) {
    auto ready = [&] { return client_.add(agent_keys::ready(restart), 0); };
    wait_for([&] { return ready() >= min_nodes; }, "at least " + std::to_string(min_nodes) +
                                                       " of " + std::to_string(nnodes_) +
                                                       " nodes to be ready for " + round);
    // The last call: a time-out here is no failure, the round is who came.
    static_cast<void>(poll_until(
        std::chrono::steady_clock::now() + last_call, [&] { return ready() >= nnodes_; },
        "the other nodes to be ready for " + round));
    std::vector<int> nodes;
    for (int n = 0; n < nnodes_; ++n) {
      const std::string key = agent_keys::ready_node(restart, n);
      if (client_.check(std::span<const std::string>(&key, 1))) nodes.push_back(n);
    }
    client_.set(members_key, encode_members(nodes));
    client_.set(std::string(agent_keys::current_round), wire::encode_int(restart));
  } else {
    wait_for([&] { return client_.check(std::span<const std::string>(&members_key, 1)); },
             "node 0 to form " + round);
  }
  std::vector<int> nodes = decode_members(members_key, client_.get(members_key), nnodes_);
  round_size_ = static_cast<int>(nodes.size());
  lost_nodes_ = 0;  // of an earlier round: not among these
  return nodes;
}

DTRAIN_DETAIL_INLINE void agent_store::join(const node_record& me) {
  const std::string key = agent_keys::node(node_rank_);
  const std::string holder = client_.compare_set(key, "", me.encode());
  if (holder != me.encode()) {
    throw config_error("node_rank " + std::to_string(node_rank_) +
                       " is taken twice: by the agent " + node_record::decode(key, holder).who() +
                       " and by this one (" + me.who() +
                       "); give each agent its own --node-rank / NODE_RANK");
  }
  meet(std::string(agent_keys::joined), "all " + std::to_string(nnodes_) + " node agents to join");
  for (int n = 0; n < nnodes_; ++n) {
    const std::string other_key = agent_keys::node(n);
    check_same_shape(n, node_record::decode(other_key, client_.get(other_key)), me);
  }
}

DTRAIN_DETAIL_INLINE void agent_store::check_same_shape(int n, const node_record& other,
                                                        const node_record& me) {
  if (other.nproc != me.nproc) {
    throw config_error("node " + std::to_string(n) + " (" + other.who() + ") runs " +
                       std::to_string(other.nproc) + " workers, this node " +
                       std::to_string(me.nproc) + "; every node must run the same nproc_per_node");
  }
  if (other.max_restarts != me.max_restarts) {
    throw config_error("node " + std::to_string(n) + " (" + other.who() + ") allows " +
                       std::to_string(other.max_restarts) + " restarts, this node " +
                       std::to_string(me.max_restarts) +
                       "; every node must use the same max_restarts");
  }
}

DTRAIN_DETAIL_INLINE int agent_store::worker_port(int restart) {
  const std::string key = agent_keys::worker_port(restart);
  if (node_rank_ == 0) client_.set(key, encode_port(pick_free_port()));
  wait_for([&] { return client_.check(std::span<const std::string>(&key, 1)); },
           "node 0 to pick the workers' port");
  return decode_port(key, client_.get(key));
}

DTRAIN_DETAIL_INLINE std::optional<failure_record> agent_store::failure(int restart) {
  const std::string key = agent_keys::failure(restart);
  if (!client_.check(std::span<const std::string>(&key, 1))) return std::nullopt;
  const std::string value = client_.get(key);
  failure_record f;
  try {
    f = failure_record::decode(key, value);
  } catch (const rendezvous_error& e) {
    return failure_record{1, true, e.what()};
  }
  f.message = describe_failure(f, first_exit(restart));
  return f;
}

DTRAIN_DETAIL_INLINE void agent_store::leave(std::chrono::milliseconds grace) {
  const std::string key(agent_keys::left);
  try {
    client_.add(key, 1);
    if (!server_) return;
    const auto deadline = std::chrono::steady_clock::now() + grace + std::chrono::seconds(10);
    while (client_.add(key, 0) < round_size_ - lost_nodes_ &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(agent_poll_interval);
    }
  } catch (const rendezvous_error&) {
    // The job has ended; a peer that cannot be told is not a new failure.
  }
}

DTRAIN_DETAIL_INLINE std::optional<exit_record> agent_store::first_exit(int restart) {
  const std::string key = agent_keys::exited(restart);
  if (!client_.check(std::span<const std::string>(&key, 1))) return std::nullopt;
  try {
    return exit_record::decode(key, client_.get(key));
  } catch (const rendezvous_error&) {
    return std::nullopt;
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/launch/agent_store.hpp ----
// ---- begin dtrain/launch/process.hpp ----
/// @file
/// The node agent's processes: starting a worker (fork + exec, dying with the
/// agent), stopping a group (SIGTERM, grace period, SIGKILL), the warden and
/// subreaper that take what the workers started with them, and carrying
/// the workers' output with a `[rank N] ` prefix and into per-rank log files.


#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#include <pthread.h>
#include <unistd.h>

namespace dtrain::detail {

/// Exit status of a job whose program is missing, or is not executable (the shell's).
inline constexpr int program_missing_status = 127;
inline constexpr int program_not_executable_status = 126;

/// "exited with status 3", "was killed by SIGKILL (signal 9)".
DTRAIN_DETAIL_INLINE std::string describe_wait_status(int status);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string describe_wait_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return "was killed by " + (name ? "SIG" + std::string(name) : std::string("a signal")) +
           " (signal " + std::to_string(sig) + ")";
  }
  return "stopped with wait status " + std::to_string(status);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The shell's convention: the exit status, or 128 + the signal.
DTRAIN_DETAIL_INLINE int exit_code_of(int status);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Finds `program` on PATH the way execvp would, before fork (execvp itself
/// is not async-signal-safe). Returns it unchanged when it has a '/'. Throws
/// program_error (127 missing, 126 not executable) naming the program.
DTRAIN_DETAIL_INLINE std::string find_program(const std::string& program,
                                              std::optional<std::string_view> path_var);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string find_program(const std::string& program,
                                              std::optional<std::string_view> path_var) {
  if (program.find('/') != std::string::npos) {
    std::error_code ec;
    if (!std::filesystem::exists(program, ec)) {
      throw program_error("cannot run \"" + program + "\": no such file", program_missing_status);
    }
    if (std::filesystem::is_directory(program, ec) || ::access(program.c_str(), X_OK) != 0) {
      throw program_error("cannot run \"" + program + "\": it is not an executable file",
                          program_not_executable_status);
    }
    return program;
  }
  std::string path(path_var.value_or("/usr/local/bin:/usr/bin:/bin"));
  std::size_t start = 0;
  while (start <= path.size()) {
    std::size_t end = path.find(':', start);
    if (end == std::string::npos) end = path.size();
    std::string dir = path.substr(start, end - start);
    std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  throw program_error("cannot run \"" + program + "\": not found on PATH=" + path,
                      program_missing_status);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Carries the workers' output to the agent's stdout/stderr, each line
/// prefixed with `[rank N] ` when `tee` is on, and to per-rank log files.
/// One thread polls every pipe; lines are written whole, so ranks never
/// interleave within a line.
class output_relay {
 public:
  struct stream {
    unique_fd pipe;  // read end
    int rank = 0;
    bool is_stderr = false;
    std::string partial;
    std::shared_ptr<std::FILE> log;  ///< this round's rank_<N>.log, or null
  };

  output_relay(bool tee, std::string log_dir) : tee_(tee), log_dir_(std::move(log_dir)) {}
  output_relay(const output_relay&) = delete;
  output_relay& operator=(const output_relay&) = delete;
  ~output_relay() { finish(std::chrono::milliseconds(0)); }

  /// Whether output passes through the relay at all (else workers inherit the agent's).
  [[nodiscard]] bool active() const noexcept { return tee_ || !log_dir_.empty(); }

  /// Opens the log files of one restart round: `<log_dir>/restart_<k>/rank_<N>.log`.
  void open_logs(int restart, const std::vector<int>& ranks);

  /// Hands the read ends of one worker's pipes to the relay thread.
  void add(int rank, unique_fd out, unique_fd err);

  /// Waits up to `drain` for the pipes to reach end-of-file (the workers are
  /// gone, but their children may hold the pipes), then stops the thread.
  void finish(std::chrono::milliseconds drain);

 private:
  void pump();

  void emit_lines(stream& s, bool at_end);

  void write_line(const stream& s, std::string_view line);

  bool tee_;
  std::string log_dir_;
  std::mutex mutex_;
  std::vector<stream> pending_;
  std::map<int, std::shared_ptr<std::FILE>> logs_;  // the current round's, by rank
  std::atomic<bool> stop_{false};
  std::atomic<std::size_t> open_streams_{0};
  std::thread thread_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void output_relay::open_logs(int restart, const std::vector<int>& ranks) {
  if (log_dir_.empty()) return;
  std::filesystem::path dir =
      std::filesystem::path(log_dir_) / ("restart_" + std::to_string(restart));
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    throw config_error("cannot create the log directory " + dir.string() + ": " + ec.message());
  std::lock_guard lock(mutex_);
  logs_.clear();
  for (int rank : ranks) {
    auto path = dir / ("rank_" + std::to_string(rank) + ".log");
    // "e": O_CLOEXEC, so the workers started later do not inherit the file.
    std::shared_ptr<std::FILE> file(std::fopen(path.c_str(), "we"), [](std::FILE* f) {
      if (f) std::fclose(f);
    });
    if (!file) throw config_error("cannot write the log file " + path.string());
    logs_[rank] = std::move(file);
  }
}

DTRAIN_DETAIL_INLINE void output_relay::add(int rank, unique_fd out, unique_fd err) {
  std::lock_guard lock(mutex_);
  // Each stream keeps the log file of its own round: output of a round that
  // is still being drained never lands in the next round's files.
  auto it = logs_.find(rank);
  std::shared_ptr<std::FILE> log = it == logs_.end() ? nullptr : it->second;
  pending_.push_back(stream{std::move(out), rank, false, {}, log});
  pending_.push_back(stream{std::move(err), rank, true, {}, log});
  if (!thread_.joinable()) {
    stop_ = false;
    thread_ = std::thread([this] { pump(); });
  }
}

DTRAIN_DETAIL_INLINE void output_relay::finish(std::chrono::milliseconds drain) {
  if (!thread_.joinable()) return;
  auto deadline = std::chrono::steady_clock::now() + drain;
  while (std::chrono::steady_clock::now() < deadline && open_streams_.load() > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  stop_ = true;
  thread_.join();
}

DTRAIN_DETAIL_INLINE void output_relay::pump() {
  std::vector<stream> streams;
  std::vector<char> buffer(1 << 16);
  while (true) {
    {
      std::lock_guard lock(mutex_);
      for (auto& s : pending_) streams.push_back(std::move(s));
      pending_.clear();
      open_streams_ = streams.size();
    }
    if (stop_ && streams.empty()) break;
    std::vector<pollfd> fds;
    for (auto& s : streams) fds.push_back(pollfd{s.pipe.get(), POLLIN, 0});
    int ready = ::poll(fds.data(), fds.size(), 20);
    if (ready < 0 && errno != EINTR) break;
    for (std::size_t i = 0; i < streams.size(); ++i) {
      if (fds[i].revents == 0) continue;
      ssize_t n = ::read(streams[i].pipe.get(), buffer.data(), buffer.size());
      if (n > 0) {
        streams[i].partial.append(buffer.data(), static_cast<std::size_t>(n));
        emit_lines(streams[i], false);
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        emit_lines(streams[i], true);
        streams[i].pipe.reset();
      }
    }
    if (stop_) {
      for (auto& s : streams) emit_lines(s, true);
      streams.clear();
    }
    std::erase_if(streams, [](const stream& s) { return !s.pipe && s.partial.empty(); });
  }
  open_streams_ = 0;
}

DTRAIN_DETAIL_INLINE void output_relay::emit_lines(stream& s, bool at_end) {
  std::size_t start = 0;
  std::lock_guard lock(mutex_);
  for (std::size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos; start = nl + 1) {
    write_line(s, std::string_view(s.partial).substr(start, nl + 1 - start));
  }
  s.partial.erase(0, start);
  if (at_end && !s.partial.empty()) {
    write_line(s, s.partial + "\n");
    s.partial.clear();
  }
}

DTRAIN_DETAIL_INLINE void output_relay::write_line(const stream& s, std::string_view line) {
  std::FILE* to = s.is_stderr ? stderr : stdout;
  if (tee_) {
    std::fprintf(to, "[rank %d] %.*s", s.rank, static_cast<int>(line.size()), line.data());
    std::fflush(to);
  }
  if (s.log) {
    std::fwrite(line.data(), 1, line.size(), s.log.get());
    std::fflush(s.log.get());
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

/// One started worker.
struct worker_process {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  unique_fd exit_fd;          ///< a pidfd: readable once the worker exits (Linux 5.3+)
  std::optional<int> status;  ///< wait status, once reaped
};

/// What a worker is started with: argv[0] is the program (found on PATH).
struct worker_command {
  std::vector<std::string> argv;
  std::vector<std::string> env;  ///< NAME=value entries, the whole environment
};

/// Starts a worker. The child asks for SIGKILL when the agent's thread that
/// forked it dies (PR_SET_PDEATHSIG), so no worker outlives its agent, and
/// starts with every signal unblocked and default. Only async-signal-safe
/// calls happen between fork and exec; everything is prepared before.
DTRAIN_DETAIL_INLINE pid_t spawn_worker(const worker_command& cmd, output_relay* relay, int rank);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE pid_t spawn_worker(const worker_command& cmd, output_relay* relay, int rank) {
  std::vector<char*> argv;
  for (const auto& a : cmd.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (const auto& e : cmd.env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);

  int out[2] = {-1, -1};
  int err[2] = {-1, -1};
  if (relay != nullptr) {
    DTRAIN_SYSCALL(::pipe2(out, O_CLOEXEC));
    DTRAIN_SYSCALL(::pipe2(err, O_CLOEXEC));
  }
  unique_fd out_read(out[0]), out_write(out[1]), err_read(err[0]), err_write(err[1]);
  // A failed exec reports its errno through this pipe; it closes on a successful exec.
  int report[2];
  DTRAIN_SYSCALL(::pipe2(report, O_CLOEXEC));
  unique_fd report_read(report[0]), report_write(report[1]);
  const pid_t parent = ::getpid();
  // Signals stay blocked until the child has its default handlers back: a
  // SIGTERM forwarded right after fork must not run the agent's handler in it.
  sigset_t forwarded, previous;
  sigemptyset(&forwarded);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&forwarded, sig);
  ::pthread_sigmask(SIG_BLOCK, &forwarded, &previous);

  pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the agent died before prctl took effect
    // Its own process group, so that stopping the worker stops what it started too.
    ::setpgid(0, 0);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) ::signal(sig, SIG_DFL);
    // A SIGUSR1 the agent forwards (desync diagnostics) must not end a worker
    // that has not installed dtrain's handler yet: ignored until it does (exec keeps SIG_IGN).
    ::signal(SIGUSR1, SIG_IGN);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    if (relay != nullptr &&
        (::dup2(out[1], STDOUT_FILENO) < 0 || ::dup2(err[1], STDERR_FILENO) < 0)) {
      int e = errno;
      (void)!::write(report[1], &e, sizeof e);
      ::_exit(127);
    }
    ::execve(argv[0], argv.data(), envp.data());
    int e = errno;
    (void)!::write(report[1], &e, sizeof e);
    ::_exit(127);
  }
  const int fork_errno = errno;
  ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  if (pid < 0) {
    throw error("cannot start rank " + std::to_string(rank) +
                ": fork: " + std::strerror(fork_errno));
  }
  ::setpgid(pid, pid);  // also here: whichever runs first, the group exists before any kill
  report_write.reset();
  int child_errno = 0;
  ssize_t n;
  do {
    n = ::read(report_read.get(), &child_errno, sizeof child_errno);
  } while (n < 0 && errno == EINTR);
  if (n == static_cast<ssize_t>(sizeof child_errno)) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    const std::string what = "cannot start rank " + std::to_string(rank) + " (" + cmd.argv[0] +
                             "): " + std::strerror(child_errno);
    if (child_errno == ENOENT || child_errno == ENOTDIR) {
      throw program_error(what, program_missing_status);
    }
    if (child_errno == EACCES || child_errno == EPERM || child_errno == ENOEXEC ||
        child_errno == EISDIR) {
      throw program_error(what, program_not_executable_status);
    }
    throw error(what);
  }
  if (relay != nullptr) relay->add(rank, std::move(out_read), std::move(err_read));
  return pid;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Makes this process the reaper of its descendants' orphans (Linux 3.4+;
/// elsewhere nothing): what a worker started and left behind stays below the
/// agent, which kills and reaps it, instead of escaping to init.
DTRAIN_DETAIL_INLINE void become_subreaper() noexcept;
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void become_subreaper() noexcept {
#ifdef PR_SET_CHILD_SUBREAPER
  (void)::prctl(PR_SET_CHILD_SUBREAPER, 1);
#endif
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Kills what is left of each worker's process group (the workers are
/// reaped) and reaps those of them that were orphaned to this subreaper,
/// waiting at most `limit` for SIGKILL to take effect.
DTRAIN_DETAIL_INLINE void kill_leftovers(std::vector<worker_process>& workers,
                                         std::chrono::milliseconds limit);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void kill_leftovers(std::vector<worker_process>& workers,
                                         std::chrono::milliseconds limit) {
  for (auto& w : workers) {
    if (w.pid > 0) ::killpg(w.pid, SIGKILL);
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (auto& w : workers) {
    if (w.pid <= 0) continue;
    int status = 0;
    while (true) {
      pid_t r = ::waitpid(-w.pid, &status, WNOHANG);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 || std::chrono::steady_clock::now() > deadline) break;  // ECHILD: all reaped
      if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

/// A small child of the agent that outlives it by a moment: when the agent
/// dies, even by SIGKILL, the pipe to it reaches end-of-file and it SIGKILLs
/// every worker's process group. PR_SET_PDEATHSIG reaches only the workers
/// themselves; this reaches what they started. One per restart round
/// (agent_round), forked before the round's relay starts its thread; the
/// child only ever makes async-signal-safe calls, so the store's thread may
/// run in the agent meanwhile.
class worker_warden {
 public:
  /// Starts the warden for up to `slots` workers at a time (one per local rank).
  explicit worker_warden(int slots);
  worker_warden(const worker_warden&) = delete;
  worker_warden& operator=(const worker_warden&) = delete;
  /// The agent ends normally: it stopped its workers itself, so the warden
  /// goes without killing anything (a group id may be reused by now).
  ~worker_warden();

  /// Tells the warden that local rank `slot` now runs in process group `pgid`.
  void guard(int slot, pid_t pgid) noexcept;

 private:
  // The agent's other descriptors, the store's sockets among them (the warden
  // is forked while the store runs): held here, a connection the store closes
  // would stay open for its peer until the round ends. Kernels before 5.9 keep them.
  static void close_inherited(int keep) noexcept;

  [[noreturn]] void watch(int fd) noexcept;

  std::vector<pid_t> groups_;  // allocated before fork: the child only writes into it
  pid_t pid_ = -1;
  unique_fd pipe_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE worker_warden::worker_warden(int slots)
    : groups_(static_cast<std::size_t>(slots), 0) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return;  // no warden: PDEATHSIG still ends the workers
  unique_fd read_end(fds[0]), write_end(fds[1]);
  pid_t pid = ::fork();
  if (pid == 0) {
    write_end.reset();
    close_inherited(read_end.get());
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) ::signal(sig, SIG_IGN);
    watch(read_end.get());
  }
  if (pid > 0) {
    pid_ = pid;
    pipe_ = std::move(write_end);
  }
}

DTRAIN_DETAIL_INLINE worker_warden::~worker_warden() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
}

DTRAIN_DETAIL_INLINE void worker_warden::guard(int slot, pid_t pgid) noexcept {
  if (!pipe_ || slot < 0 || static_cast<std::size_t>(slot) >= groups_.size()) return;
  const std::int32_t message[2] = {slot, static_cast<std::int32_t>(pgid)};
  (void)!::write(pipe_.get(), message, sizeof message);  // 8 bytes: atomic on a pipe
}

DTRAIN_DETAIL_INLINE void worker_warden::close_inherited(int keep) noexcept {
#ifdef SYS_close_range
  const auto fd = static_cast<unsigned>(keep);
  if (fd > 3) (void)::syscall(SYS_close_range, 3U, fd - 1, 0U);
  (void)::syscall(SYS_close_range, fd + 1, ~0U, 0U);
#else
  (void)keep;
#endif
}

DTRAIN_DETAIL_INLINE void worker_warden::watch(int fd) noexcept {
  std::int32_t message[2];
  while (true) {
    ssize_t n = ::read(fd, message, sizeof message);
    if (n < 0 && errno == EINTR) continue;
    if (n != static_cast<ssize_t>(sizeof message)) break;  // end-of-file: the agent is gone
    if (message[0] >= 0 && static_cast<std::size_t>(message[0]) < groups_.size())
      groups_[static_cast<std::size_t>(message[0])] = message[1];
  }
  for (pid_t pgid : groups_) {
    if (pgid > 0) ::killpg(pgid, SIGKILL);
  }
  ::_exit(0);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// A pidfd for `pid`, or an empty one where the kernel has none.
inline unique_fd open_exit_fd(pid_t pid) {
  return unique_fd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
}

/// Waits up to `timeout` for a worker to exit and reaps whichever have.
/// Returns the workers reaped in this call, in the order their exits were
/// seen: the agent wakes the moment the first one exits, so the first
/// failure reported is the root cause, not a peer that failed because of it.
DTRAIN_DETAIL_INLINE std::vector<worker_process*> reap_exited(std::vector<worker_process>& workers,
                                                              std::chrono::milliseconds timeout);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::vector<worker_process*> reap_exited(std::vector<worker_process>& workers,
                                                              std::chrono::milliseconds timeout) {
  std::vector<pollfd> fds;
  bool polled = true;
  for (auto& w : workers) {
    if (w.status || w.pid <= 0) continue;
    if (!w.exit_fd) polled = false;
    fds.push_back(pollfd{w.exit_fd.get(), POLLIN, 0});
  }
  if (fds.empty()) return {};
  if (polled) {
    if (::poll(fds.data(), fds.size(), static_cast<int>(timeout.count())) <= 0) return {};
  } else {
    std::this_thread::sleep_for(timeout);
  }
  std::vector<worker_process*> reaped;
  for (auto& w : workers) {
    if (w.status || w.pid <= 0) continue;
    int status = 0;
    if (::waitpid(w.pid, &status, WNOHANG) == w.pid) {
      w.status = status;
      w.exit_fd.reset();
      reaped.push_back(&w);
    }
  }
  return reaped;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Signals a worker's process group (the worker and what it started), or the
/// worker alone if it has left its group.
inline void signal_group(pid_t pid, int sig) {
  if (::killpg(pid, sig) != 0) ::kill(pid, sig);
}

/// Sends `sig` to the live workers, waits up to `grace` for them to exit,
/// then SIGKILLs the rest and reaps everyone. Afterwards no worker is alive.
DTRAIN_DETAIL_INLINE void stop_workers(std::vector<worker_process>& workers, int sig,
                                       std::chrono::milliseconds grace);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void stop_workers(std::vector<worker_process>& workers, int sig,
                                       std::chrono::milliseconds grace) {
  // Exited workers too: what they started may still run in their group.
  for (auto& w : workers) {
    if (w.pid > 0) signal_group(w.pid, sig);
  }
  auto deadline = std::chrono::steady_clock::now() + grace;
  auto alive = [&] {
    return std::any_of(workers.begin(), workers.end(),
                       [](const worker_process& w) { return !w.status && w.pid > 0; });
  };
  while (alive() && std::chrono::steady_clock::now() < deadline)
    reap_exited(workers, std::chrono::milliseconds(10));
  for (auto& w : workers) {
    if (w.status || w.pid <= 0) continue;
    signal_group(w.pid, SIGKILL);
    int status = 0;
    while (::waitpid(w.pid, &status, 0) < 0 && errno == EINTR) {
    }
    w.status = status;
  }
  for (auto& w : workers) {
    if (w.pid > 0) ::killpg(w.pid, SIGKILL);  // stragglers of the groups
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/launch/process.hpp ----
// ---- begin dtrain/launch/round.hpp ----
/// @file
/// One restart round of a node agent: the node's workers, the warden that
/// takes their process groups down if the agent dies, and the relay that
/// carries their output. The round owns all three. It starts the workers,
/// supervises them until the round ends on every node, and stops them once:
/// when it ends, or when it is destroyed early (an exception, a signal during
/// a wait), whichever comes first.


#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/types.h>

namespace dtrain::detail {

/// Prints one line of node `node_rank`'s agent on stderr: "[dtrain agent node 0/2] ...".
DTRAIN_DETAIL_INLINE void agent_say(int node_rank, int nnodes, const std::string& text);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void agent_say(int node_rank, int nnodes, const std::string& text) {
  std::fprintf(stderr, "[dtrain agent node %d/%d] %s\n", node_rank, nnodes, text.c_str());
  std::fflush(stderr);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// How a restart round ended.
struct round_end {
  bool succeeded = false;
  int status = 0;        ///< exit status for the agent when the job ends here
  bool final = false;    ///< no restart: a signal or a lost peer ended the job
  bool regroup = false;  ///< elastic: the nodes change; the next round, no restart counted
  std::string message;   ///< who failed how
};

/// One worker of a round: its place in the job and what it runs.
struct worker_start {
  int rank = 0;
  int local_rank = 0;
  worker_command command;
};

/// What an agent tells each of its rounds.
struct round_settings {
  int restart = 0;
  int node_rank = 0;
  int nnodes = 1;
  int nproc = 1;
  /// The round's nodes (node ranks, ascending): every node of the job,
  /// unless elastic (min_nodes set), where node 0 chose them for this round.
  std::vector<int> members{};
  /// Elastic (dtrun --nnodes MIN:MAX): a lost node fails the round, not the
  /// job, and node 0 ends the round when a node waits to join (a regroup).
  bool elastic = false;
  bool tee = false;     ///< prefix the workers' lines with `[rank N] `
  std::string log_dir;  ///< also write <log_dir>/restart_<k>/rank_<N>.log
  std::chrono::milliseconds grace_period{};
  std::chrono::milliseconds heartbeat_timeout{};
};

/// One restart round: starting → running → stopping → ended. start() starts
/// the workers, supervise() watches them, the store and the signals until
/// the round ends on every node, stops what is left and says how it ended.
/// Destroyed before it ended, the round stops its workers with the signal
/// the agent received (SIGTERM if none), drains their output and ends its
/// warden: every resource is released once, on every path.
class agent_round {
 public:
  enum class state { starting, running, stopping, ended };

  /// Forks the warden, before the relay starts a thread. The warden's child
  /// makes only async-signal-safe calls, so other threads (the store's) may run.
  explicit agent_round(round_settings settings)
      : settings_(std::move(settings)),
        warden_(settings_.nproc),
        relay_(settings_.tee, settings_.log_dir),
        beats_(settings_.members) {}
  agent_round(const agent_round&) = delete;
  agent_round& operator=(const agent_round&) = delete;
  ~agent_round();

  [[nodiscard]] state current() const noexcept { return state_; }
  /// The workers started so far (each with its wait status once reaped).
  [[nodiscard]] const std::vector<worker_process>& workers() const noexcept { return workers_; }

  /// Starts the workers (starting → running). Throws program_error when one
  /// cannot be started, config_error when its log file cannot be written;
  /// the workers already started are stopped when the round is destroyed.
  void start(const std::vector<worker_start>& workers);

  /// Supervises the running workers until the round ends on every node
  /// (running → ended): the first failure anywhere, a signal to the agent or
  /// a lost node stops them; success waits for every node's workers. Throws
  /// rendezvous_error when the store is gone.
  round_end supervise(agent_store& store);

 private:
  void say(const std::string& text) const {
    agent_say(settings_.node_rank, settings_.nnodes, text);
  }

  // A node whose agent went silent fails the round for everyone (read by on_failure).
  void watch_peers(agent_store& store);
  // Elastic, node 0: a node waiting for the next round ends this one (a regroup).
  void watch_joiners(agent_store& store);

  // A signal to the agent ends the job: forwarded to the workers, and told to the other nodes.
  std::optional<round_end> on_signal(agent_store& store);

  void forward_diagnostics_requests();

  // Waits a moment for a worker to exit; the first that failed is recorded. A
  // dtrain worker has recorded its own failure, with its reason, before it exits.
  void note_exits(agent_store& store);

  std::optional<round_end> on_failure(agent_store& store);

  std::optional<round_end> on_success(agent_store& store);

  // Sends `sig` to the workers' groups (0: none, they are done), kills and
  // reaps what is left, and drains their output. Once: later calls do nothing.
  void stop(int sig);

  round_settings settings_;
  worker_warden warden_;  // before the relay: forked before its thread starts
  output_relay relay_;
  std::vector<worker_process> workers_;
  heartbeat beats_;
  std::chrono::steady_clock::time_point last_join_check_{};
  bool reported_success_ = false;
  state state_ = state::starting;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE agent_round::~agent_round() {
  try {
    const int sig = pending_agent_signal();
    stop(sig != 0 ? sig : SIGTERM);
  } catch (...) {
    // Out of memory while stopping: the warden still kills the groups when it ends.
  }
}

DTRAIN_DETAIL_INLINE void agent_round::start(const std::vector<worker_start>& workers) {
  if (relay_.active()) {
    std::vector<int> ranks;
    for (const worker_start& w : workers) ranks.push_back(w.rank);
    relay_.open_logs(settings_.restart, ranks);
  }
  workers_.reserve(workers.size());
  for (const worker_start& w : workers) {
    const pid_t pid = spawn_worker(w.command, relay_.active() ? &relay_ : nullptr, w.rank);
    worker_process& p = workers_.emplace_back();
    p.rank = w.rank;
    p.local_rank = w.local_rank;
    p.pid = pid;
    p.exit_fd = open_exit_fd(pid);
    warden_.guard(w.local_rank, pid);
  }
  state_ = state::running;
}

DTRAIN_DETAIL_INLINE round_end agent_round::supervise(agent_store& store) {
  while (true) {
    watch_peers(store);
    watch_joiners(store);
    if (auto end = on_signal(store)) return *end;
    forward_diagnostics_requests();
    note_exits(store);
    if (auto end = on_failure(store)) return *end;
    if (auto end = on_success(store)) return *end;
  }
}

DTRAIN_DETAIL_INLINE void agent_round::watch_peers(agent_store& store) {
  store.beat();
  const auto silent =
      beats_.check(store.client(), settings_.node_rank, settings_.heartbeat_timeout);
  if (!silent) return;
  store.lose_nodes(beats_.silent());
  // Elastic: the round ends, and the next one is formed of the nodes present.
  store.record_failure(
      settings_.restart, 1, !settings_.elastic,
      "node " + std::to_string(*silent) + "'s agent stopped responding: no heartbeat for " +
          seconds_text(settings_.heartbeat_timeout) + " s (DTRAIN_HEARTBEAT_TIMEOUT)");
}

DTRAIN_DETAIL_INLINE void agent_round::watch_joiners(agent_store& store) {
  if (!settings_.elastic || settings_.node_rank != 0 ||
      settings_.members.size() >= static_cast<std::size_t>(settings_.nnodes)) {
    return;
  }
  const auto now = std::chrono::steady_clock::now();
  if (now - last_join_check_ < std::chrono::seconds(1)) return;
  last_join_check_ = now;
  if (!store.node_waiting(settings_.restart)) return;
  failure_record regroup{0, false,
                         "a node is ready to join: every node stops its workers, and the next "
                         "round is formed with it (no restart counted)"};
  regroup.regroup = true;
  detail::record_failure(store.client(), settings_.restart, regroup);
}

DTRAIN_DETAIL_INLINE std::optional<round_end> agent_round::on_signal(agent_store& store) {
  const int sig = pending_agent_signal();
  if (sig == 0) return std::nullopt;
  const std::string message = "node " + std::to_string(settings_.node_rank) +
                              "'s agent received signal " + std::to_string(sig) +
                              " and stopped its workers";
  stop(sig);
  try {
    store.record_failure(settings_.restart, 128 + sig, true, message);
  } catch (const rendezvous_error&) {
    // Node 0 is gone: nobody is left to tell.
  }
  return round_end{false, 128 + sig, true, false, message};
}

DTRAIN_DETAIL_INLINE void agent_round::forward_diagnostics_requests() {
  if (!take_diagnostics_request()) return;
  for (const worker_process& w : workers_) {
    if (!w.status) (void)::kill(w.pid, SIGUSR1);  // the worker only, not what it started
  }
  say("forwarded SIGUSR1 to the workers: each prints its part of the desync diagnostics");
}

DTRAIN_DETAIL_INLINE void agent_round::note_exits(agent_store& store) {
  for (const worker_process* w : reap_exited(workers_, agent_poll_interval)) {
    if (*w->status == 0) continue;
    store.record_failure(settings_.restart, exit_code_of(*w->status), false,
                         worker_label(w->rank, settings_.node_rank, w->local_rank, w->pid) + " " +
                             describe_wait_status(*w->status));
    break;
  }
}

DTRAIN_DETAIL_INLINE std::optional<round_end> agent_round::on_failure(agent_store& store) {
  const auto failure = store.failure(settings_.restart);
  if (!failure) return std::nullopt;
  stop(SIGTERM);
  return round_end{false, failure->status, failure->final, failure->regroup, failure->message};
}

DTRAIN_DETAIL_INLINE std::optional<round_end> agent_round::on_success(agent_store& store) {
  const bool all_done = std::all_of(workers_.begin(), workers_.end(),
                                    [](const worker_process& w) { return w.status.has_value(); });
  if (!all_done) return std::nullopt;
  if (!reported_success_) {
    store.report_success(settings_.restart);
    reported_success_ = true;
  }
  if (store.all_succeeded(settings_.restart)) {
    stop(0);  // what the workers left running
    return round_end{true, 0, false, false, {}};
  }
  std::this_thread::sleep_for(agent_poll_interval);
  return std::nullopt;
}

DTRAIN_DETAIL_INLINE void agent_round::stop(int sig) {
  if (state_ == state::stopping || state_ == state::ended) return;
  state_ = state::stopping;
  if (sig != 0) stop_workers(workers_, sig, settings_.grace_period);
  kill_leftovers(workers_, settings_.grace_period);
  relay_.finish(std::chrono::milliseconds(200));
  state_ = state::ended;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/launch/round.hpp ----

#include <algorithm>
#include <chrono>
#include <csignal>
#include <exception>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <unistd.h>

namespace dtrain {

/// The agent of one node. run() starts `nproc_per_node` workers running
/// `command`, and returns the exit status the agent should exit with: 0 when
/// every worker of every node succeeded, else the failing worker's status
/// (128 + signal for a killed one). Throws config_error on bad options.
/// The summary it prints names the worker that went wrong: the first failure,
/// or, when that was a collective that a worker which had already ended well
/// never issued, that worker first (it left its peers waiting).
///
/// Each worker gets torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE,
/// LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK,
/// ROLE_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT,
/// TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, plus
/// DTRAIN_RESTART_COUNT and DTRAIN_AGENT_STORE. MASTER_PORT is a port that
/// node 0's agent picks for the workers in each round (a PyTorch worker's
/// rank 0 binds its own store there); dtrain workers meet at the agent's
/// store instead, which outlives restarts.
class node_agent {
 public:
  /// `command` is the worker's argv; `env` the environment the workers
  /// inherit (and where NODE_RANK, MASTER_ADDR, ... are read); `options` are
  /// final (apply with_env() before).
  node_agent(std::vector<std::string> command, agent_options options,
             environment env = environment::from_process(), store_options store = {});

  /// The node as the agent sees it (node_rank, num_nodes, nproc as local_world_size).
  [[nodiscard]] const world& node() const noexcept { return node_; }

  /// Runs the job to the end; see the class comment for the exit status.
  int run();

 private:
  [[nodiscard]] int node_rank() const { return *node_.node_rank; }
  [[nodiscard]] int nnodes() const { return *node_.num_nodes; }
  /// dtrun --nnodes MIN:MAX (agent_options::min_nnodes): rounds of the nodes present.
  [[nodiscard]] bool elastic() const { return options_.min_nnodes.has_value(); }

  void say(const std::string& text, bool verbose = false) const;

  /// Runs restart rounds until one succeeds, or one fails with no restart
  /// left; returns the job's exit status. `restart` follows the round under way.
  int run_rounds(detail::agent_store& store, int& restart);
  /// The same for an elastic job: node 0 forms each round of the nodes that
  /// are ready (at least min_nnodes); a lost node or a node that comes ends
  /// the round, and the next is formed. Only failures count as restarts.
  int run_elastic_rounds(detail::agent_store& store, int& restart);
  /// Whether a round's failure `end` ends the job (final, or `used` restarts
  /// are all of max_restarts); says so when it does.
  bool ends_job(const detail::round_end& end, int used) const;

  /// Starts this node's workers for one round of `members` (the round's
  /// nodes, ascending) and supervises them until the round ends on every
  /// node. The round stops them on every way out.
  detail::round_end run_round(detail::agent_store& store, int restart,
                              const std::vector<int>& members);

  /// The environment of a worker: `group` is this node's place among the
  /// round's `groups` nodes (its node rank, unless elastic).
  std::vector<std::string> worker_environment(int rank, int local_rank, int restart,
                                              int worker_port, int group, int groups) const;

  std::vector<std::string> command_;
  agent_options options_;
  environment env_;
  store_options store_options_;
  world node_;
  int nproc_ = 1;
  std::string master_addr_;
  int master_port_ = 0;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE node_agent::node_agent(std::vector<std::string> command, agent_options options,
                                            environment env, store_options store)
    : command_(std::move(command)),
      options_(std::move(options)),
      env_(std::move(env)),
      store_options_(std::move(store)) {
  if (command_.empty()) throw config_error("node_agent: no worker command to run");
  options_.check();
  node_ = discover_world(env_, {},
                         discover_options{.mode = launch_mode::per_node,
                                          .nproc_per_node = options_.nproc_per_node.value_or(1),
                                          .nnodes = options_.nnodes,
                                          .node_rank = options_.node_rank});
  if (!node_.node_rank || !node_.num_nodes) {
    throw config_error(
        "the node agent cannot tell which node it is: give node_rank and nnodes "
        "(--node-rank, --nnodes; NODE_RANK) or start one agent per node with "
        "mpirun or srun");
  }
  nproc_ = *node_.local_world_size;
  const bool single = *node_.num_nodes == 1;
  if (options_.master_addr) {
    master_addr_ = *options_.master_addr;
  } else if (node_.master_addr) {
    master_addr_ = *node_.master_addr;
  } else if (single) {
    master_addr_ = "127.0.0.1";
  } else {
    throw config_error("a job of " + std::to_string(*node_.num_nodes) +
                       " nodes needs the address of node 0: set MASTER_ADDR or --master-addr");
  }
  if (options_.master_port) {
    master_port_ = *options_.master_port;
  } else if (node_.master_port) {
    master_port_ = *node_.master_port;
  } else {
    master_port_ = single ? 0 : default_master_port;
  }
  if (master_port_ == 0 && !single) {
    throw config_error(
        "master_port 0 (a free port) works only on a single node: the other "
        "nodes cannot learn which port node 0 picked; give --master-port or MASTER_PORT");
  }
}

DTRAIN_DETAIL_INLINE int node_agent::run() {
  if (store_options_.token.empty()) {
    // One node: a fresh token, which reaches the workers only through their
    // environment. Several: the agents must already share one.
    if (nnodes() > 1) {
      throw config_error(
          "a job of " + std::to_string(nnodes()) +
          " nodes needs DTRAIN_STORE_TOKEN: the same secret in every node agent's environment "
          "(e.g. `export DTRAIN_STORE_TOKEN=$(openssl rand -hex 16)` where the job is "
          "submitted); it authenticates every connection to node 0's store");
    }
    store_options_.token = detail::new_store_token();
  }
  detail::agent_signal_scope signals;
  // Orphans of the workers come to this agent, which kills and reaps them.
  detail::become_subreaper();
  detail::agent_store store(node_rank(), nnodes(),
                            detail::store_bind_address(env_, master_addr_, nnodes() > 1),
                            master_addr_, master_port_, store_options_);
  master_port_ = store.port();
  say("node " + std::to_string(node_rank()) + " of " + std::to_string(nnodes()) + ", " +
          std::to_string(nproc_) + " workers, store at " +
          detail::endpoint_text(master_addr_, master_port_),
      true);
  int restart = 0;  // the round under way, for a failure outside it
  try {
    const detail::node_record me{nproc_, options_.max_restarts, detail::host_name().value_or("?"),
                                 ::getpid()};
    if (elastic()) {
      store.join_elastic(me);
    } else {
      store.join(me);
    }
    const int status = elastic() ? run_elastic_rounds(store, restart) : run_rounds(store, restart);
    store.leave(options_.grace_period);
    return status;
  } catch (const rendezvous_error& e) {
    say(std::string("lost the rendezvous store (node 0's agent) at ") +
        detail::endpoint_text(master_addr_, master_port_) + ": " + e.what());
    return 1;
  } catch (...) {
    // The round (if one ran) has stopped its workers while unwinding. A
    // signal that interrupted a wait ends the job like one during the run.
    const int sig = detail::pending_agent_signal();
    auto [status, what] = sig != 0 ? std::pair(128 + sig, "received signal " + std::to_string(sig))
                                   : detail::current_failure();
    // Tell the other nodes, so that they end too instead of waiting for this one.
    try {
      store.record_failure(restart, status, true,
                           "node " + std::to_string(node_rank()) + "'s agent failed: " + what);
      store.leave(options_.grace_period);
    } catch (...) {
      // The store is gone too: the other agents notice that themselves.
    }
    if (sig == 0) throw;
    say(what + "; stopped this node's workers");
    return status;
  }
}

DTRAIN_DETAIL_INLINE void node_agent::say(const std::string& text, bool verbose) const {
  if (verbose && !options_.tee) return;
  detail::agent_say(node_rank(), nnodes(), text);
}

DTRAIN_DETAIL_INLINE bool node_agent::ends_job(const detail::round_end& end, int used) const {
  if (!end.final && used < options_.max_restarts) return false;
  say(end.message + "; ending the job" +
      (end.final ? std::string()
                 : " (restarts used: " + std::to_string(used) + " of " +
                       std::to_string(options_.max_restarts) + ")"));
  return true;
}

DTRAIN_DETAIL_INLINE int node_agent::run_rounds(detail::agent_store& store, int& restart) {
  std::vector<int> everyone(static_cast<std::size_t>(nnodes()));
  for (int n = 0; n < nnodes(); ++n) everyone[static_cast<std::size_t>(n)] = n;
  for (restart = 0;; ++restart) {
    const detail::round_end end = run_round(store, restart, everyone);
    if (end.succeeded) return 0;
    if (ends_job(end, restart)) return end.status;
    say(end.message + "; restarting every node's workers (restart " + std::to_string(restart + 1) +
        " of " + std::to_string(options_.max_restarts) + ")");
    store.meet(detail::agent_keys::stopped(restart), "every node to stop its workers");
  }
}

DTRAIN_DETAIL_INLINE int node_agent::run_elastic_rounds(detail::agent_store& store, int& restart) {
  // How long node 0 waits, once enough nodes are ready, for the others.
  constexpr std::chrono::milliseconds last_call{2000};
  int failures = 0;
  for (restart = store.first_round();; ++restart) {
    const std::vector<int> members = store.form_round(restart, *options_.min_nnodes, last_call);
    std::string names;
    for (const int n : members) names += (names.empty() ? "" : ", ") + std::to_string(n);
    if (std::find(members.begin(), members.end(), node_rank()) == members.end()) {
      say("round " + std::to_string(restart) + " was formed of nodes " + names +
          " before this one was ready: joining the next");
      continue;
    }
    say("round " + std::to_string(restart) + ": nodes " + names + " (" +
        std::to_string(members.size()) + " of at most " + std::to_string(nnodes()) + "), " +
        std::to_string(members.size() * static_cast<std::size_t>(nproc_)) + " workers");
    const detail::round_end end = run_round(store, restart, members);
    if (end.succeeded) return 0;
    if (end.regroup) {
      say(end.message);
      continue;
    }
    if (ends_job(end, failures)) return end.status;
    ++failures;
    say(end.message + "; forming the next round of the nodes present (restart " +
        std::to_string(failures) + " of " + std::to_string(options_.max_restarts) + ")");
  }
}

DTRAIN_DETAIL_INLINE detail::round_end node_agent::run_round(detail::agent_store& store,
                                                             int restart,
                                                             const std::vector<int>& members) {
  const int group =
      static_cast<int>(std::find(members.begin(), members.end(), node_rank()) - members.begin());
  const int groups = static_cast<int>(members.size());
  const int worker_port = store.worker_port(restart);
  const std::string program = detail::find_program(command_.front(), env_.get("PATH"));
  std::vector<detail::worker_start> workers;
  for (int local = 0; local < nproc_; ++local) {
    detail::worker_start& w = workers.emplace_back();
    w.rank = group * nproc_ + local;
    w.local_rank = local;
    w.command.argv = command_;
    w.command.argv.front() = program;
    if (options_.local_rank_arg)
      w.command.argv.insert(w.command.argv.begin() + 1, "--local_rank=" + std::to_string(local));
    w.command.env = worker_environment(w.rank, local, restart, worker_port, group, groups);
  }
  detail::agent_round round({.restart = restart,
                             .node_rank = node_rank(),
                             .nnodes = nnodes(),
                             .nproc = nproc_,
                             .members = members,
                             .elastic = elastic(),
                             .tee = options_.tee,
                             .log_dir = options_.log_dir,
                             .grace_period = options_.grace_period,
                             .heartbeat_timeout = options_.heartbeat_timeout});
  round.start(workers);
  return round.supervise(store);
}

DTRAIN_DETAIL_INLINE std::vector<std::string> node_agent::worker_environment(
    int rank, int local_rank, int restart, int worker_port, int group, int groups) const {
  const int world_size = groups * nproc_;
  auto vars = env_.vars();
  auto set = [&](std::string name, const std::string& value) {
    vars.insert_or_assign(std::move(name), value);
  };
  set("RANK", std::to_string(rank));
  set("LOCAL_RANK", std::to_string(local_rank));
  set("WORLD_SIZE", std::to_string(world_size));
  set("LOCAL_WORLD_SIZE", std::to_string(nproc_));
  set("GROUP_RANK", std::to_string(group));
  set("GROUP_WORLD_SIZE", std::to_string(groups));
  set("ROLE_RANK", std::to_string(rank));
  set("ROLE_WORLD_SIZE", std::to_string(world_size));
  set("ROLE_NAME", "default");
  set("NODE_RANK", std::to_string(group));
  set("MASTER_ADDR", master_addr_);
  set("MASTER_PORT", std::to_string(worker_port));
  set("TORCHELASTIC_RESTART_COUNT", std::to_string(restart));
  set("TORCHELASTIC_MAX_RESTARTS", std::to_string(options_.max_restarts));
  set(std::string(restart_count_variable), std::to_string(restart));
  set(std::string(agent_store_variable), detail::endpoint_text(master_addr_, master_port_));
  // The token goes in the environment only: never on argv or in a log.
  set(std::string(store_token_variable), store_options_.token);
  // As torchrun: one thread per worker unless the user chose, so N workers
  // do not each start one OpenMP thread per core.
  if (nproc_ > 1 && !vars.contains("OMP_NUM_THREADS")) set("OMP_NUM_THREADS", "1");
  std::vector<std::string> out;
  out.reserve(vars.size());
  for (const auto& [name, value] : vars) out.push_back(name + "=" + value);
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
// ---- end dtrain/launch/agent.hpp ----
// ---- begin dtrain/launch/command_line.hpp ----
/// @file
/// dtrun's flags, read by one parser for the two programs that take them:
/// dtrun itself (its flags, then the program to run), and a self-launching
/// program (dtrain::run under launch::per_node), which finds them among its
/// own arguments. Each flag sets an agent option (`--standalone` four); a bad
/// value is a config_error naming the flag as it was typed and its value.


#include <bitset>
#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::detail {

/// The agent options that flags set.
enum class agent_field : unsigned {
  nproc_per_node,
  nnodes,
  min_nnodes,  // set with nnodes: --nnodes MIN:MAX
  node_rank,
  master_addr,
  master_port,
  max_restarts,
  grace_period,
  heartbeat_timeout,
  tee,
  log_dir,
  local_rank_arg,
  count
};

/// Calls `fn(&agent_options::<option>)` and returns what it returns.
template <class Fn>
decltype(auto) visit_field(agent_field option, Fn&& fn) {
  switch (option) {
    case agent_field::nproc_per_node: return fn(&agent_options::nproc_per_node);
    case agent_field::nnodes: return fn(&agent_options::nnodes);
    case agent_field::min_nnodes: return fn(&agent_options::min_nnodes);
    case agent_field::node_rank: return fn(&agent_options::node_rank);
    case agent_field::master_addr: return fn(&agent_options::master_addr);
    case agent_field::master_port: return fn(&agent_options::master_port);
    case agent_field::max_restarts: return fn(&agent_options::max_restarts);
    case agent_field::grace_period: return fn(&agent_options::grace_period);
    case agent_field::heartbeat_timeout: return fn(&agent_options::heartbeat_timeout);
    case agent_field::tee: return fn(&agent_options::tee);
    case agent_field::log_dir: return fn(&agent_options::log_dir);
    case agent_field::local_rank_arg:
    case agent_field::count: break;
  }
  return fn(&agent_options::local_rank_arg);
}

/// dtrun's flags as found on one command line (argv without the program's
/// name), and for dtrun the program after them. Flags take their value as
/// `--flag value` or `--flag=value`; `_` may replace `-` in their names
/// (torchrun's `--nproc_per_node`); of a flag given twice, the last counts.
class agent_flags {
 public:
  /// dtrun's command line: flags first; `--`, or the first argument that is
  /// not a flag, begins the program, which gets every argument after it. An
  /// unknown flag is a config_error; `--help` (or `-h`) ends the parsing.
  [[nodiscard]] static agent_flags of_launcher(std::span<const std::string_view> args);

  /// A self-launching program's command line: dtrun's flags wherever they
  /// are before `--`, except `--help` and `--no-python`, which stay the
  /// program's. Every other argument is the program's own and is skipped.
  [[nodiscard]] static agent_flags of_program(std::span<const std::string_view> args);

  /// Sets every option that a flag gave: the flags win (dtrun).
  void apply(agent_options& options) const {
    for_each_given([&](auto member) { options.*member = values_.*member; });
  }

  /// Sets the options that a flag gave and `options` leaves at agent_options'
  /// defaults: options set in the program's code win (dtrain::run).
  void fill(agent_options& options) const;

  /// The options as the flags set them (the others at their defaults).
  [[nodiscard]] const agent_options& values() const noexcept { return values_; }
  /// Whether a flag set `option`.
  [[nodiscard]] bool given(agent_field option) const noexcept {
    return given_.test(static_cast<std::size_t>(option));
  }
  /// dtrun: `--help` or `-h` was given.
  [[nodiscard]] bool help() const noexcept { return help_; }
  /// dtrun: `--no-python` was given (run a .py program directly).
  [[nodiscard]] bool no_python() const noexcept { return no_python_; }
  /// dtrun: the program and its arguments.
  [[nodiscard]] const std::vector<std::string>& program() const noexcept { return program_; }

 private:
  template <class Fn>
  void for_each_given(Fn fn) const {
    for (std::size_t f = 0; f < static_cast<std::size_t>(agent_field::count); ++f) {
      if (given_.test(f)) visit_field(static_cast<agent_field>(f), fn);
    }
  }

  void set(agent_field option) { given_.set(static_cast<std::size_t>(option)); }

  // Reads the flag at args[i] (and its value, moving i past it); false when it is not dtrun's.
  bool read(std::span<const std::string_view> args, std::size_t& i, bool launcher);

  struct valued {
    std::string_view name;
    agent_field field;
    std::string_view what;
    std::string_view example;
  };

  static const valued* find(std::string_view name);

  void take(agent_field option, const std::string& origin, std::string_view value);

  agent_options values_{};
  std::bitset<static_cast<std::size_t>(agent_field::count)> given_{};
  bool help_ = false;
  bool no_python_ = false;
  std::vector<std::string> program_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE agent_flags agent_flags::of_launcher(std::span<const std::string_view> args) {
  agent_flags flags;
  std::size_t i = 0;
  for (; i < args.size(); ++i) {
    if (args[i] == "--") {
      ++i;
      break;
    }
    if (!args[i].starts_with("--") && args[i] != "-h") break;
    if (!flags.read(args, i, true)) {
      throw config_error("unknown option " + std::string(args[i]) + " (see dtrun --help)");
    }
    if (flags.help_) return flags;
  }
  for (; i < args.size(); ++i) flags.program_.emplace_back(args[i]);
  return flags;
}

DTRAIN_DETAIL_INLINE agent_flags agent_flags::of_program(std::span<const std::string_view> args) {
  agent_flags flags;
  for (std::size_t i = 0; i < args.size() && args[i] != "--"; ++i) {
    if (args[i].starts_with("--")) (void)flags.read(args, i, false);
  }
  return flags;
}

DTRAIN_DETAIL_INLINE void agent_flags::fill(agent_options& options) const {
  const agent_options defaults{};
  for_each_given([&](auto member) {
    if (options.*member == defaults.*member) options.*member = values_.*member;
  });
}

DTRAIN_DETAIL_INLINE bool agent_flags::read(std::span<const std::string_view> args, std::size_t& i,
                                            bool launcher) {
  const std::string_view arg = args[i];
  const std::size_t eq = arg.find('=');
  const std::string_view typed = arg.substr(0, eq);
  std::string name(typed);
  for (char& c : name) {
    if (c == '_') c = '-';
  }
  if (launcher && (name == "--help" || name == "-h")) return help_ = true;
  if (launcher && name == "--no-python") return no_python_ = true;
  if (name == "--standalone" || name == "--tee" || name == "--pass-local-rank") {
    if (eq != std::string_view::npos) {
      throw config_error(std::string(arg) + " on the command line: " + std::string(typed) +
                         " takes no value");
    }
    if (name == "--tee") {
      values_.tee = true;
      set(agent_field::tee);
    } else if (name == "--pass-local-rank") {
      values_.local_rank_arg = true;
      set(agent_field::local_rank_arg);
    } else {
      values_.nnodes = 1;
      values_.min_nnodes = std::nullopt;
      values_.node_rank = 0;
      values_.master_addr = "127.0.0.1";
      values_.master_port = 0;
      for (auto f : {agent_field::nnodes, agent_field::min_nnodes, agent_field::node_rank,
                     agent_field::master_addr, agent_field::master_port})
        set(f);
    }
    return true;
  }
  const valued* flag = find(name);
  if (flag == nullptr) return false;
  std::string_view value;
  if (eq != std::string_view::npos) {
    value = arg.substr(eq + 1);
  } else if (i + 1 < args.size()) {
    value = args[++i];
  } else {
    throw config_error(std::string(typed) + " on the command line needs a value (" +
                       std::string(flag->what) + ", e.g. " + std::string(typed) + " " +
                       std::string(flag->example) + ")");
  }
  const std::string origin = std::string(typed) + "=" + std::string(value) + " on the command line";
  take(flag->field, origin, value);
  set(flag->field);
  return true;
}

DTRAIN_DETAIL_INLINE auto agent_flags::find(std::string_view name) -> const valued* {
  static constexpr valued flags[] = {
      {"--nproc-per-node", agent_field::nproc_per_node, "workers per node", "4"},
      {"--nnodes", agent_field::nnodes, "nodes in the job (MIN:MAX: elastic)", "2"},
      {"--node-rank", agent_field::node_rank, "this node's index", "0"},
      {"--master-addr", agent_field::master_addr, "node 0's address", "node0"},
      {"--master-port", agent_field::master_port, "node 0's store port", "29500"},
      {"--max-restarts", agent_field::max_restarts, "restarts after a failure", "1"},
      {"--grace-period", agent_field::grace_period, "seconds from SIGTERM to SIGKILL", "10"},
      {"--heartbeat-timeout", agent_field::heartbeat_timeout, "seconds", "10"},
      {"--log-dir", agent_field::log_dir, "a directory", "logs"},
  };
  for (const valued& f : flags) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

DTRAIN_DETAIL_INLINE void agent_flags::take(agent_field option, const std::string& origin,
                                            std::string_view value) {
  auto at_least = [&](int least, const char* unit) {
    const int n = parse_non_negative(origin, value);
    if (n < least) {
      throw config_error(origin + " must be at least " + std::to_string(least) + " (" + unit + ")");
    }
    return n;
  };
  auto text = [&] {
    if (value.empty()) throw config_error(origin + " is empty");
    return std::string(value);
  };
  switch (option) {
    case agent_field::nproc_per_node:
      values_.nproc_per_node = at_least(1, "workers per node");
      break;
    case agent_field::nnodes: {
      const auto [least, most] = parse_node_count(origin, value);
      values_.nnodes = most;
      values_.min_nnodes = least;
      set(agent_field::min_nnodes);  // "--nnodes N" after "--nnodes 1:2" is not elastic
      break;
    }
    case agent_field::node_rank: values_.node_rank = parse_non_negative(origin, value); break;
    case agent_field::master_addr: values_.master_addr = text(); break;
    case agent_field::master_port: {
      const int port = parse_non_negative(origin, value);
      if (port != 0) check_port(origin, port);  // 0: a free port (one node only)
      values_.master_port = port;
      break;
    }
    case agent_field::max_restarts: values_.max_restarts = parse_non_negative(origin, value); break;
    case agent_field::grace_period:
      values_.grace_period = std::chrono::seconds(parse_non_negative(origin, value));
      break;
    case agent_field::heartbeat_timeout:
      values_.heartbeat_timeout = std::chrono::seconds(at_least(1, "seconds"));
      break;
    case agent_field::log_dir: values_.log_dir = text(); break;
    case agent_field::min_nnodes:  // comes with --nnodes
    case agent_field::tee:
    case agent_field::local_rank_arg:
    case agent_field::count: break;
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
// ---- end dtrain/launch/command_line.hpp ----

#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

#if DTRAIN_HAS_CUDA()
#include <cuda_runtime.h>
#endif

namespace dtrain {

namespace detail {

/// Prints `<who> dtrain: <what>` as one line on stderr and returns the status.
DTRAIN_DETAIL_INLINE int report_failure(const std::string& who,
                                        const std::pair<int, std::string>& failure);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE int report_failure(const std::string& who,
                                        const std::pair<int, std::string>& failure) {
  std::fprintf(stderr, "%s dtrain: %s\n", who.c_str(), failure.second.c_str());
  return failure.first;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// This program's own path, for an agent that re-executes it.
DTRAIN_DETAIL_INLINE std::string own_executable();
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string own_executable() {
  std::vector<char> path(4096);
  ssize_t n = DTRAIN_SYSCALL(::readlink("/proc/self/exe", path.data(), path.size() - 1));
  return std::string(path.data(), static_cast<std::size_t>(n));
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Default workers per node: one per visible GPU for backends that use GPUs (NCCL), else one.
template <class Policy>
int default_nproc_per_node() {
#if DTRAIN_HAS_CUDA()
  if constexpr (Policy::traits::uses_gpus) {
    int count = 0;
    if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) return count;
    (void)cudaGetLastError();
  }
#endif
  return 1;
}

/// The workers per node that the command line asks for, torchrun's way:
/// `--nproc-per-node N`, `--nproc-per-node=N`, or the same with
/// `--nproc_per_node`; the last one counts, and nothing after `--`. Nullopt
/// when absent; config_error naming the flag when its value is not a positive
/// integer, or when another of dtrun's flags has a bad value (agent_flags).
[[nodiscard]] inline std::optional<int> nproc_per_node_from_args(
    std::span<const std::string_view> args) {
  return agent_flags::of_program(args).values().nproc_per_node;
}

/// What run() accepts: called as fn(context<Policy>&), returning void or an int.
template <class Fn, class Policy>
concept training_function_for = requires(Fn& fn, context<Policy>& ctx) {
  fn(ctx);
};

/// The training function as run_process sees it: one signature, whatever the
/// lambda, so run_process depends on the policy only (and can be compiled once,
/// dtrain/compiled.hpp). Refers to `fn`, which must outlive it.
template <class Policy>
class training_function {
 public:
  template <class Fn>
  explicit training_function(Fn& fn) noexcept
      : fn_(const_cast<void*>(static_cast<const void*>(std::addressof(fn)))), call_(&call<Fn>) {}
  /// Calls fn(ctx): its int result, or 0 when it returns void.
  int operator()(context<Policy>& ctx) const { return call_(fn_, ctx); }

 private:
  template <class Fn>
  static int call(void* fn, context<Policy>& ctx) {
    if constexpr (std::is_void_v<std::invoke_result_t<Fn&, context<Policy>&>>) {
      (*static_cast<Fn*>(fn))(ctx);
      return 0;
    } else {
      return static_cast<int>((*static_cast<Fn*>(fn))(ctx));
    }
  }

  void* fn_;
  int (*call_)(void*, context<Policy>&);
};

/// dtrain::run without the function's type: the agent, or a worker that runs `fn`.
template <class Policy>
int run_process(int argc, char** argv, training_function<Policy> fn, const run_options& options);

}  // namespace detail

/// Runs `fn` as one worker of a data-parallel job and returns the process's
/// exit status, for `return dtrain::run<Policy>(argc, argv, fn);` in main.
///
/// `fn` is called as `fn(context<Policy>&)` and may return void (exit 0) or
/// an int (the exit status). Under launch::per_node the process started by
/// the user is the node agent: it starts `nproc_per_node` copies of this
/// program (the same argv, unchanged) as workers and returns the job's
/// status (see node_agent). Workers are recognised by DTRAIN_AGENT_STORE in
/// their environment.
///
/// The agent takes dtrun's flags from the program's command line, as torchrun
/// users expect: `./train --nproc-per-node 2 --max-restarts 1 --epochs 3`.
/// Every flag of `dtrun --help` is read (`--nproc-per-node`, `--nnodes`,
/// `--node-rank`, `--master-addr`, `--master-port`, `--standalone`,
/// `--max-restarts`, `--grace-period`, `--heartbeat-timeout`, `--tee`,
/// `--log-dir`, `--pass-local-rank`; `--flag value` or `--flag=value`, `_`
/// for `-`), except `--help` and `--no-python`, which stay the program's.
/// Every other argument is the program's own; nothing after `--` is read; the
/// workers get the whole argv unchanged. Each option comes from, first to
/// last: its environment variable (DTRAIN_NPROC_PER_NODE, ...; see
/// agent_options::with_env), run_options::agent when it differs from
/// agent_options' default, the flag, then the default (for nproc_per_node:
/// one per visible GPU for NCCL, else 1). A bad value is a config_error
/// naming its source, e.g. `--master-port=70000 on the command line is
/// outside the port range 1-65535` (exit status 2).
///
/// Any exception ends the process's part in the job: one line on stderr,
/// `[rank 3/8] dtrain: <what>`, and exit status 2 for a config_error, else 1.
/// A worker ignores SIGPIPE (a dead peer is an error, not a silent death).
/// When MPI is running (the MPI backend, or MPI initialised by the caller), a
/// failed worker, or one whose `fn` returned non-zero, calls MPI_Abort with
/// its exit status after its report, so mpirun ends the whole job at once.
template <class Policy, detail::training_function_for<Policy> Fn>
int run(int argc, char** argv, Fn&& fn, const run_options& options = {}) {
  if constexpr (std::is_function_v<std::remove_reference_t<Fn>>) {
    auto* function = &fn;  // a function is no object: it is called through a pointer
    return detail::run_process<Policy>(argc, argv, detail::training_function<Policy>(function),
                                       options);
  } else {
    return detail::run_process<Policy>(argc, argv, detail::training_function<Policy>(fn), options);
  }
}

// Not inline: under `extern template` (dtrain/compiled.hpp) the agent, the store
// and the engine stay out of the user's translation unit.
template <class Policy>
int detail::run_process(int argc, char** argv, training_function<Policy> fn,
                        const run_options& options) {
  const environment env = environment::from_process();
  std::vector<std::string_view> args;
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  const bool agent =
      Policy::launch_type::mode == launch_mode::per_node && !env.contains(agent_store_variable);

  if (agent) {
    std::string who = "[agent]";
    try {
      agent_options opts = options.agent;
      // The environment (with_env) wins over the program's options, which win over its argv.
      detail::agent_flags::of_program(args).fill(opts);
      if (!opts.nproc_per_node) opts.nproc_per_node = detail::default_nproc_per_node<Policy>();
      opts = opts.with_env(env);
      std::vector<std::string> command{detail::own_executable()};
      for (int i = 1; i < argc; ++i) command.emplace_back(argv[i]);
      node_agent node(std::move(command), opts, env, options.store.with_env(env));
      who = "[agent node " + std::to_string(*node.node().node_rank) + "/" +
            std::to_string(*node.node().num_nodes) + "]";
      return node.run();
    } catch (...) {
      return detail::report_failure(who, detail::current_failure());
    }
  }

  detail::ignore_sigpipe();
  std::optional<world> w;
  try {
    w = discover_world(env, args);
    context<Policy> ctx(*w, env, options);
    w = ctx.world();
    int status = 0;
    try {
      status = fn(ctx);
    } catch (...) {
      auto failure = detail::current_failure();
      if (auto summary = ctx.explain_failure(std::current_exception()))
        failure.second += "; diagnostics: " + *summary;
      ctx.record_failure(failure.first, failure.second);
      const int code = detail::report_failure(detail::rank_label(&*w), failure);
      detail::abort_mpi_job(code);
      ctx.abort_communicator();  // exit now, not after the collectives peers will never join
      return code;
    }
    if (status != 0) {
      ctx.record_failure(status, {});
      ctx.abort_communicator();
      if (detail::mpi_is_running()) {
        detail::report_failure(detail::rank_label(&*w),
                               {status, "the training function returned " + std::to_string(status) +
                                            "; aborting the MPI job"});
        detail::abort_mpi_job(status);
      }
      return status;
    }
    ctx.finish();
    return 0;
  } catch (...) {
    const int code =
        detail::report_failure(detail::rank_label(w ? &*w : nullptr), detail::current_failure());
    detail::abort_mpi_job(code);  // MPI initialised by the caller, with peers still waiting
    return code;
  }
}

}  // namespace dtrain
// ---- end dtrain/run.hpp ----

// The policies compiled in the library, per engine: X(policy type) for each.
#define DTRAIN_DETAIL_POLICY(L, B, T) \
  ::dtrain::policy<::dtrain::launch::L, ::dtrain::backend::B, ::dtrain::topology::T>
#if DTRAIN_HAS_GLOO()
#define DTRAIN_FOR_EACH_GLOO_POLICY(X)                  \
  X(DTRAIN_DETAIL_POLICY(per_node, gloo, flat))         \
  X(DTRAIN_DETAIL_POLICY(per_node, gloo, hierarchical)) \
  X(DTRAIN_DETAIL_POLICY(per_process, gloo, flat))      \
  X(DTRAIN_DETAIL_POLICY(per_process, gloo, hierarchical))
#else
#define DTRAIN_FOR_EACH_GLOO_POLICY(X)
#endif
#if DTRAIN_HAS_MPI()  // launch::per_node cannot start MPI processes (policy.hpp)
#define DTRAIN_FOR_EACH_MPI_POLICY(X)             \
  X(DTRAIN_DETAIL_POLICY(per_process, mpi, flat)) \
  X(DTRAIN_DETAIL_POLICY(per_process, mpi, hierarchical))
#else
#define DTRAIN_FOR_EACH_MPI_POLICY(X)
#endif
#if DTRAIN_HAS_NCCL()
#define DTRAIN_FOR_EACH_NCCL_POLICY(X)                  \
  X(DTRAIN_DETAIL_POLICY(per_node, nccl, flat))         \
  X(DTRAIN_DETAIL_POLICY(per_node, nccl, hierarchical)) \
  X(DTRAIN_DETAIL_POLICY(per_process, nccl, flat))      \
  X(DTRAIN_DETAIL_POLICY(per_process, nccl, hierarchical))
#else
#define DTRAIN_FOR_EACH_NCCL_POLICY(X)
#endif
/// Every standard policy whose engine is compiled in.
#define DTRAIN_FOR_EACH_COMPILED_POLICY(X) \
  DTRAIN_FOR_EACH_GLOO_POLICY(X) DTRAIN_FOR_EACH_MPI_POLICY(X) DTRAIN_FOR_EACH_NCCL_POLICY(X)

/// The templates compiled once per policy, the one list of them: `EXTERN` is
/// `extern` (a declaration, in every user TU) or empty (the definition, in the
/// library). A class template here must define its heavy members out of the
/// class and not inline, or GCC still compiles them in every TU (basic_ddp is
/// DistributedDataParallel's Model-free part, which holds all its machinery).
#define DTRAIN_DETAIL_COMPILED_TEMPLATES(EXTERN, ...)                \
  EXTERN template class ::dtrain::context<__VA_ARGS__>;              \
  EXTERN template class ::dtrain::basic_ddp<__VA_ARGS__>;            \
  EXTERN template int ::dtrain::detail::run_process<__VA_ARGS__>(    \
      int, char**, ::dtrain::detail::training_function<__VA_ARGS__>, \
      const ::dtrain::run_options&);

#define DTRAIN_DETAIL_DECLARE_COMPILED(...) DTRAIN_DETAIL_COMPILED_TEMPLATES(extern, __VA_ARGS__)
#define DTRAIN_DETAIL_DEFINE_COMPILED(...) DTRAIN_DETAIL_COMPILED_TEMPLATES(, __VA_ARGS__)

/// Instantiates, in the one TU that writes it (at namespace scope, after the
/// #include), everything the other TUs declared `extern template`, and
/// defines the link check's symbols for this TU's engines (link_check.hpp).
/// Not beside a dtrain library: the link check refuses two definitions.
#define DTRAIN_INSTANTIATE_COMPILED_POLICIES()                                                   \
  static_assert(DTRAIN_DETAIL_BODIES(),                                                          \
                "DTRAIN_INSTANTIATE_COMPILED_POLICIES(): #define DTRAIN_COMPILED_DEFINITIONS 1 " \
                "before including dtrain in this file (and DTRAIN_SEPARATE_COMPILATION=1)");     \
  DTRAIN_FOR_EACH_COMPILED_POLICY(DTRAIN_DETAIL_DEFINE_COMPILED)                                 \
  DTRAIN_DETAIL_DEFINE_LINK_CHECK()

#if DTRAIN_HAS_SEPARATE_COMPILATION()
DTRAIN_FOR_EACH_COMPILED_POLICY(DTRAIN_DETAIL_DECLARE_COMPILED)
// An undefined reference to link_check::library_built_with_engines_<set> from
// this line: no dtrain library built for this TU's engines is linked (see
// dtrain/detail/link_check.hpp; with CMake, link the same dtrain target everywhere).
DTRAIN_DETAIL_REQUIRE_LINK_CHECK()
#endif
// ---- end dtrain/compiled.hpp ----
// ---- begin dtrain/ddp/ddp.hpp ----
/// @file
/// DistributedDataParallel<Model, Policy>: averages a model's gradients over
/// the ranks while the backward pass is still running. A thin layer over
/// basic_ddp<Policy> (ddp/basic_ddp.hpp), which does the work and does not
/// depend on the model's type: this one asks the model for its parameters()
/// (and buffers()) and keeps it for module().


#include <concepts>
#include <utility>
#include <vector>

namespace dtrain {

/// Data-parallel training of `Model` (anything with `parameters()`, see
/// trainable_model) over the communicator of `Policy`.
///
/// Per step: mark each parameter ready (mark_ready) as soon as its gradient
/// is final, or all of them after the backward pass (mark_all_ready), then
/// synchronize(); gradients then hold the mean over ranks. Everything but
/// the constructors and module() is basic_ddp<Policy>'s.
template <class Model, class Policy>
class DistributedDataParallel : public basic_ddp<Policy> {
  static_assert(
      trainable_model<Model>,
      "DistributedDataParallel<Model, Policy>: Model needs parameters() returning a range of "
      "dtrain::parameter (see dtrain::param)");
  using base = basic_ddp<Policy>;

 public:
  using typename base::communicator_type;

  /// Collective over ctx's communicator (ctx: the dtrain::context<Policy>
  /// that dtrain::run hands over); metadata goes over ctx's control plane
  /// where the communicator cannot carry host data (NCCL). The policy's
  /// topology groups the ranks by ctx.world()'s nodes.
  template <ddp_context<Policy> Context>
  DistributedDataParallel(Context& ctx, Model& model, ddp_options options = {})
      : base(ctx, parameters_of(model), buffers_of(model), std::move(options)), model_(model) {}

  /// Collective over `comm`, which carries the metadata too (MPI, Gloo: a
  /// communicator that reaches host memory). A device-only backend (NCCL)
  /// needs the constructor with a control plane (a static_assert says so).
  template <std::same_as<Model> M>
  DistributedDataParallel(communicator_type& comm, M& model, ddp_options options = {})
      : base(comm, parameters_of(model), buffers_of(model), std::move(options)), model_(model) {}

  /// Collective over `comm`, metadata over `control` (see basic_ddp).
  DistributedDataParallel(communicator_type& comm, control_plane control, Model& model,
                          ddp_options options = {})
      : base(comm, control, parameters_of(model), buffers_of(model), std::move(options)),
        model_(model) {}

  [[nodiscard]] Model& module() noexcept { return model_; }

 private:
  static std::vector<parameter> parameters_of(Model& model) {
    std::vector<parameter> out;
    if constexpr (trainable_model<Model>) {
      for (auto&& p : model.parameters()) out.push_back(static_cast<parameter>(p));
    }
    return out;
  }
  static std::vector<parameter> buffers_of([[maybe_unused]] Model& model) {
    std::vector<parameter> out;
    if constexpr (model_with_buffers<Model>) {
      for (auto&& b : model.buffers()) out.push_back(static_cast<parameter>(b));
    }
    return out;
  }

  Model& model_;
};

}  // namespace dtrain
// ---- end dtrain/ddp/ddp.hpp ----
// ---- begin dtrain/ddp/sampler.hpp ----
/// @file
/// distributed_sampler: each rank's share of a dataset's indices, as
/// torch.utils.data.DistributedSampler — disjoint, shuffled by seed and
/// epoch the same way on every rank, and equally long on every rank.


#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

namespace dtrain {

/// Options of distributed_sampler. Aggregate: `{.seed = 42, .drop_last = true}`.
struct sampler_options {
  bool shuffle = true;     ///< a new permutation every epoch (seed + epoch)
  std::uint64_t seed = 0;  ///< must be the same on every rank
  /// Drop the tail that does not divide evenly among the ranks, instead of
  /// padding with indices from the start (which repeats a few samples).
  bool drop_last = false;
};

/// Where a sampler stands in the global sample order: the epoch, and how many
/// samples of that epoch's permutation the ranks together have been handed.
/// Independent of the world size, so a job that changes size continues the
/// same global order.
struct sampler_position {
  std::uint64_t epoch = 0;
  std::uint64_t offset = 0;
};

/// Splits the indices 0..dataset_size-1 among the ranks.
class distributed_sampler {
 public:
  /// This rank's share, with rank and world size from `w`. Throws
  /// config_error when `w` lacks them or drop_last leaves a rank nothing.
  distributed_sampler(std::size_t dataset_size, const world& w, sampler_options options = {})
      : distributed_sampler(dataset_size, w.rank.value_or(-1), w.world_size.value_or(0), options) {}

  distributed_sampler(std::size_t dataset_size, int rank, int world_size,
                      sampler_options options = {});

  /// Reshuffles for `epoch` (with shuffle on): every rank computes the same
  /// permutation from seed + epoch, then takes every world_size-th index.
  /// Starts the epoch from its beginning (position {epoch, 0}).
  void set_epoch(std::uint64_t epoch) { set_position({.epoch = epoch, .offset = 0}); }

  /// Continues `p.epoch` after its first `p.offset` samples of the global
  /// order (what position() said, on this world or another): the rest of the
  /// epoch's permutation is dealt among this world's ranks, padded (or, with
  /// drop_last, cut) to the same count on every rank. With the same world
  /// size, the ranks get exactly the indices they had left.
  void set_position(sampler_position p);

  /// Where this epoch stands: samples of the global order handed out by
  /// next_batch() on all ranks together (what a checkpoint saves).
  [[nodiscard]] sampler_position position() const noexcept;

  /// This rank's next batch of at most `batch_size` indices, empty once the
  /// epoch is done; moves position() on. Every rank gets batches of the same sizes.
  [[nodiscard]] std::span<const std::size_t> next_batch(std::size_t batch_size);

  /// This rank's indices for the current epoch (from the position set, all
  /// of them: next_batch() does not shorten them); size() of them.
  [[nodiscard]] std::span<const std::size_t> indices() const noexcept { return indices_; }
  /// Samples per rank in this epoch (from the position set): the same on
  /// every rank, so every rank runs the same steps.
  [[nodiscard]] std::size_t size() const noexcept { return indices_.size(); }
  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }

  /// indices() cut into batches of `batch_size` (the last one may be shorter;
  /// every rank gets the same number of batches of the same sizes).
  [[nodiscard]] std::vector<std::span<const std::size_t>> batches(std::size_t batch_size) const;

 private:
  // Fisher-Yates driven by splitmix64: the same permutation with every
  // standard library (std::shuffle's algorithm is unspecified).
  static void shuffle(std::vector<std::size_t>& v, std::uint64_t seed);

  std::size_t dataset_size_;
  int rank_;
  int world_size_;
  sampler_options options_;
  std::uint64_t epoch_ = 0;
  std::size_t start_ = 0;   // samples of the global order before this rank's indices_
  std::size_t cursor_ = 0;  // indices_ handed out by next_batch()
  std::vector<std::size_t> indices_;
};

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE distributed_sampler::distributed_sampler(std::size_t dataset_size, int rank,
                                                              int world_size,
                                                              sampler_options options)
    : dataset_size_(dataset_size), rank_(rank), world_size_(world_size), options_(options) {
  if (world_size <= 0 || rank < 0 || rank >= world_size) {
    throw config_error("distributed_sampler: rank " + std::to_string(rank) + " of world size " +
                       std::to_string(world_size) + " is not a rank of a world");
  }
  const auto n = static_cast<std::size_t>(world_size);
  const std::size_t per_rank = options.drop_last ? dataset_size / n : (dataset_size + n - 1) / n;
  if (per_rank == 0) {
    throw config_error("distributed_sampler: " + std::to_string(dataset_size) + " samples for " +
                       std::to_string(world_size) + " ranks leaves rank " + std::to_string(rank) +
                       " nothing" + (options.drop_last ? " with drop_last" : ""));
  }
  set_epoch(0);
}

DTRAIN_DETAIL_INLINE void distributed_sampler::set_position(sampler_position p) {
  std::vector<std::size_t> all(dataset_size_);
  std::iota(all.begin(), all.end(), std::size_t{0});
  if (options_.shuffle) shuffle(all, options_.seed + p.epoch);
  const auto n = static_cast<std::size_t>(world_size_);
  const std::size_t start =
      static_cast<std::size_t>(std::min<std::uint64_t>(p.offset, dataset_size_));
  std::size_t left = dataset_size_ - start;
  // Padding repeats the start of the permutation, as often as needed (tiny datasets).
  std::size_t total = options_.drop_last ? left / n * n : (left + n - 1) / n * n;
  indices_.clear();
  for (std::size_t i = static_cast<std::size_t>(rank_); i < total; i += n) {
    const std::size_t at = start + i;
    indices_.push_back(at < dataset_size_ ? all[at] : all[(at - dataset_size_) % dataset_size_]);
  }
  epoch_ = p.epoch;
  start_ = start;
  cursor_ = 0;
}

DTRAIN_DETAIL_INLINE sampler_position distributed_sampler::position() const noexcept {
  const std::size_t dealt = start_ + cursor_ * static_cast<std::size_t>(world_size_);
  return {.epoch = epoch_, .offset = std::min(dealt, dataset_size_)};
}

DTRAIN_DETAIL_INLINE std::span<const std::size_t> distributed_sampler::next_batch(
    std::size_t batch_size) {
  if (batch_size == 0) throw config_error("distributed_sampler::next_batch: batch_size is 0");
  const std::span<const std::size_t> rest = std::span<const std::size_t>(indices_).subspan(cursor_);
  const std::span<const std::size_t> batch = rest.first(std::min(batch_size, rest.size()));
  cursor_ += batch.size();
  return batch;
}

DTRAIN_DETAIL_INLINE std::vector<std::span<const std::size_t>> distributed_sampler::batches(
    std::size_t batch_size) const {
  if (batch_size == 0) throw config_error("distributed_sampler::batches: batch_size is 0");
  std::vector<std::span<const std::size_t>> out;
  std::span<const std::size_t> all = indices();
  for (std::size_t at = 0; at < all.size(); at += batch_size) {
    out.push_back(all.subspan(at, std::min(batch_size, all.size() - at)));
  }
  return out;
}

DTRAIN_DETAIL_INLINE void distributed_sampler::shuffle(std::vector<std::size_t>& v,
                                                       std::uint64_t seed) {
  std::uint64_t state = seed;
  auto next = [&state] {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  for (std::size_t i = v.size(); i > 1; --i) {
    auto j = static_cast<std::size_t>(next() % i);  // bias below 2^-40 for any real dataset
    std::swap(v[i - 1], v[j]);
  }
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain
// ---- end dtrain/ddp/sampler.hpp ----
// ---- end dtrain/dtrain.hpp ----
// ---- begin dtrain/checkpoint.hpp ----
/// @file
/// dtrain::checkpoint: one step's state of every rank saved consistently, and
/// resumed from (docs/checkpoints.md).
///
///   #include <dtrain/checkpoint.hpp>
///   dtrain::checkpoint ckpt(ctx, {.dir = "ckpt", .every = 100});
///
/// Not included by dtrain.hpp: it would add about 0.8 s to every translation
/// unit that includes dtrain (its file system and thread code), and only the
/// file with the training loop needs it. The single header has it.

// ---- begin dtrain/checkpoint/checkpoint.hpp ----
/// @file
/// dtrain::checkpoint: one step's state of every rank, saved consistently and
/// resumed from. Register the state once (parameters, optimizer state, the
/// sampler, anything else); then restore() on start and step() after each
/// training step:
///
///   dtrain::checkpoint ckpt(ctx, {.dir = "ckpt", .every = 100});
///   ckpt.add(ddp.parameters()).add("momentum", velocity).add(sampler);
///   ckpt.restore();                        // the newest whole checkpoint, if any
///   for (; sampler.epoch() < epochs; sampler.set_epoch(sampler.epoch() + 1))
///     for (auto batch = sampler.next_batch(32); !batch.empty(); batch = sampler.next_batch(32)) {
///       ... forward, backward, synchronize, optimizer step ...
///       ckpt.step();                       // saves every 100th step
///     }
///
/// A save is a two-phase commit over the control plane: every rank writes its
/// part into DIR/step-<N>.partial (fsync'd, checksummed), the ranks agree that
/// all parts were written, and only then rank 0 writes the manifest and
/// renames the directory to DIR/step-<N>; the older checkpoints beyond `keep`
/// are removed after that. A rank that dies or fails during a save leaves no
/// committed step. restore() takes the newest step whose manifest and files
/// check out (naming each one it skips), checks that its entries are the
/// registered ones (names, types, shapes), and only then changes memory.
/// Every rank must see the same DIR (one machine, or a shared file system).

// ---- begin dtrain/checkpoint/format.hpp ----
/// @file
/// What a checkpoint is on disk, and the file operations that make writing it
/// atomic. dtrain::checkpoint (checkpoint/checkpoint.hpp) uses these; they take
/// no part in the protocol between ranks.
///
///   DIR/step-<N>/MANIFEST          written last: what the step holds (below)
///   DIR/step-<N>/replicated.dtck   the state every rank has alike (rank 0 writes it)
///   DIR/step-<N>/rank-<r>.dtck     rank r's own state (only when there is some)
///   DIR/step-<N>.partial/          a save in progress: never read
///
/// A part file (.dtck): the magic "dtrainck", u32 format version, u32 entry
/// count, then per entry: u32 name length, the name, u8 kind (0 values, 1
/// bytes), u8 dtype, u16 zero, u32 dimensions, u64 per dimension, u64
/// payload bytes, the payload. Integers are in the host's byte order (a
/// checkpoint moves between hosts of the same byte order, as the weights'
/// floats must anyway).
///
/// The MANIFEST is text: "dtrain checkpoint 1", "step N", "world_size W",
/// one "file NAME BYTES CHECKSUM" per part, and "end CHECKSUM" over the lines
/// before it, so that a torn manifest is seen as one. Checksums are
/// detail::ckpt::checksum64 in 16 hex digits.
///
/// Every file is written as NAME.part, fsync'd and renamed; the step's
/// directory is written as step-<N>.partial and renamed to step-<N> once
/// every rank's part and the manifest are in it (the commit), and the parent
/// directory is fsync'd after each rename.


#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace dtrain::detail::ckpt {

inline constexpr std::string_view manifest_name = "MANIFEST";
inline constexpr std::string_view replicated_name = "replicated.dtck";
inline constexpr std::string_view partial_suffix = ".partial";
inline constexpr std::string_view magic = "dtrainck";
inline constexpr std::uint32_t format_version = 1;
/// Bounds a reader trusts before it allocates: a name, dimensions, entries.
inline constexpr std::uint32_t max_name = 4096;
inline constexpr std::uint32_t max_dims = 32;
inline constexpr std::uint32_t max_entries = 1u << 20;

/// A sharded entry's payload: the whole array's element count, the ranges
/// this rank held (global first element, count), then their values packed in
/// range order. `values_at`: where the values start in the payload.
struct sharded_payload {
  std::uint64_t total = 0;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;  // (global, count)
  std::size_t values_at = 0;
};

/// Reads a sharded entry's payload of elements of `element` bytes; throws
/// checkpoint_error naming `what` (the file and the entry) when it is not one.
inline sharded_payload parse_sharded(std::string_view payload, std::size_t element,
                                     const std::string& what) {
  auto fail = [&](const std::string& why) -> void {
    throw checkpoint_error("checkpoint: " + what + " is not a sharded entry: " + why);
  };
  auto word = [&](std::size_t at) {
    std::uint64_t v = 0;
    std::memcpy(&v, payload.data() + at, sizeof v);
    return v;
  };
  sharded_payload out;
  if (payload.size() < 16) fail(std::to_string(payload.size()) + " bytes");
  out.total = word(0);
  const std::uint64_t n = word(8);
  if (n > (payload.size() - 16) / 16)
    fail(std::to_string(n) + " ranges in " + std::to_string(payload.size()) + " bytes");
  std::uint64_t elements = 0;
  for (std::uint64_t r = 0; r < n; ++r) {
    const std::uint64_t global = word(16 + 16 * r), count = word(24 + 16 * r);
    if (global > out.total || count > out.total - global)
      fail("range " + std::to_string(global) + "+" + std::to_string(count) + " of " +
           std::to_string(out.total));
    out.ranges.emplace_back(global, count);
    elements += count;
  }
  out.values_at = static_cast<std::size_t>(16 + 16 * n);
  if (elements > (payload.size() - out.values_at) / element ||
      elements * element != payload.size() - out.values_at)
    fail(std::to_string(elements) + " elements in " +
         std::to_string(payload.size() - out.values_at) + " bytes");
  return out;
}

/// Seconds from `start` to now.
[[nodiscard]] inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// Memory for an asynchronous save's copy of one entry, kept for the next
/// save: allocated (not filled) when it grows.
class staging {
 public:
  void* reserve(std::size_t bytes) {
    if (bytes > capacity_) {
      data_.reset();
      data_ = std::make_unique_for_overwrite<std::byte[]>(bytes);
      capacity_ = bytes;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<std::byte[]> data_;
  std::size_t capacity_ = 0;
};

/// One memcpy of an asynchronous save's copy.
struct copy_job {
  void* to = nullptr;
  const void* from = nullptr;
  std::size_t bytes = 0;
};

/// Runs `jobs` as one copy of their total bytes cut into `threads` equal
/// ranges (a range may span jobs): the calling thread copies the first, a
/// thread each of the others. Fewer threads when a range would be under 1 MiB.
inline void copy_parallel(std::span<const copy_job> jobs, int threads) {
  std::size_t total = 0;
  for (const copy_job& j : jobs) total += j.bytes;
  constexpr std::size_t min_range = std::size_t{1} << 20;
  const std::size_t ranges =
      std::clamp<std::size_t>(total / min_range, 1, static_cast<std::size_t>(std::max(1, threads)));
  // Copies bytes [begin, end) of the concatenation of `jobs`.
  auto copy_range = [jobs](std::size_t begin, std::size_t end) {
    std::size_t offset = 0;  // of the job below in the concatenation
    for (const copy_job& j : jobs) {
      const std::size_t lo = std::max(begin, offset), hi = std::min(end, offset + j.bytes);
      if (lo < hi) {
        std::memcpy(static_cast<char*>(j.to) + (lo - offset),
                    static_cast<const char*>(j.from) + (lo - offset), hi - lo);
      }
      offset += j.bytes;
      if (offset >= end) break;
    }
  };
  const std::size_t per = (total + ranges - 1) / ranges;
  std::vector<std::jthread> helpers;
  helpers.reserve(ranges - 1);
  for (std::size_t r = 1; r < ranges; ++r) {
    helpers.emplace_back(copy_range, std::min(total, r * per), std::min(total, (r + 1) * per));
  }
  copy_range(0, std::min(total, per));
}

/// "rank-<r>.dtck"
[[nodiscard]] inline std::string rank_part_name(int rank) {
  return "rank-" + std::to_string(rank) + ".dtck";
}
/// "step-<N>"
[[nodiscard]] inline std::string step_name(std::uint64_t step) {
  return "step-" + std::to_string(step);
}
/// The step of a directory named "step-<N>" (digits only), else nullopt.
[[nodiscard]] inline std::optional<std::uint64_t> step_of(std::string_view name) {
  constexpr std::string_view prefix = "step-";
  if (!name.starts_with(prefix) || name.size() == prefix.size() || name.size() > prefix.size() + 19)
    return std::nullopt;
  name.remove_prefix(prefix.size());
  std::uint64_t step = 0;
  auto [end, ec] = std::from_chars(name.data(), name.data() + name.size(), step);
  if (ec != std::errc{} || end != name.data() + name.size()) return std::nullopt;
  return step;
}

/// A fast 64-bit checksum of a byte stream, fed in pieces of any size (the
/// same value however the stream is cut). Four lanes of 8-byte words, each
/// multiplied and rotated, folded and mixed at the end with the length: it
/// finds truncation, torn writes and flipped bits, not an attacker.
class checksum64 {
 public:
  void update(const void* data, std::size_t n) noexcept {
    const auto* p = static_cast<const unsigned char*>(data);
    total_ += n;
    if (pending_ > 0) {
      const std::size_t take = std::min(n, block - pending_);
      std::memcpy(buffer_.data() + pending_, p, take);
      pending_ += take;
      p += take;
      n -= take;
      if (pending_ < block) return;
      consume(buffer_.data());
      pending_ = 0;
    }
    for (; n >= block; p += block, n -= block) consume(p);
    std::memcpy(buffer_.data(), p, n);
    pending_ = n;
  }
  [[nodiscard]] std::uint64_t value() const noexcept {
    std::uint64_t h = std::rotl(lanes_[0], 1) + std::rotl(lanes_[1], 7) + std::rotl(lanes_[2], 12) +
                      std::rotl(lanes_[3], 18);
    h ^= total_ * prime_a;
    for (std::size_t i = 0; i < pending_; ++i) h = std::rotl(h ^ buffer_[i], 11) * prime_a;
    h ^= h >> 33;
    h *= prime_b;
    h ^= h >> 29;
    h *= prime_a;
    return h ^ (h >> 32);
  }
  [[nodiscard]] static std::uint64_t of(const void* data, std::size_t n) noexcept {
    checksum64 c;
    c.update(data, n);
    return c.value();
  }

 private:
  static constexpr std::size_t block = 32;
  static constexpr std::uint64_t prime_a = 0x9e3779b185ebca87ull;
  static constexpr std::uint64_t prime_b = 0xc2b2ae3d27d4eb4full;
  void consume(const unsigned char* p) noexcept {
    for (std::size_t lane = 0; lane < 4; ++lane) {
      std::uint64_t word = 0;
      std::memcpy(&word, p + 8 * lane, 8);
      lanes_[lane] = std::rotl(lanes_[lane] + word * prime_b, 31) * prime_a;
    }
  }
  std::array<std::uint64_t, 4> lanes_{0x60ea27eeadc0b5d6ull, 0xc2b2ae3d27d4eb4full, 0x1ull,
                                      0x61c8864e7a143579ull};
  std::array<unsigned char, block> buffer_{};
  std::size_t pending_ = 0;
  std::uint64_t total_ = 0;
};

/// 16 lowercase hex digits.
[[nodiscard]] inline std::string hex64(std::uint64_t v) {
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4)
    out[static_cast<std::size_t>(i)] = "0123456789abcdef"[v & 15];
  return out;
}

/// "what PATH: strerror (errno N)" as a checkpoint_error.
[[noreturn]] inline void fail_os(const std::string& what, const std::filesystem::path& path,
                                 int err) {
  throw checkpoint_error("checkpoint: " + what + " " + path.string() + ": " + std::strerror(err) +
                         " (errno " + std::to_string(err) + ")");
}

/// fsync of a directory, so that the renames in it are on disk.
inline void sync_directory(const std::filesystem::path& dir) {
  unique_fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) fail_os("cannot open directory", dir, errno);
  if (::fsync(fd.get()) != 0 && errno != EINVAL) fail_os("cannot sync directory", dir, errno);
}

/// rename(2), with the error naming both paths.
inline void rename_path(const std::filesystem::path& from, const std::filesystem::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    const int err = errno;
    throw checkpoint_error("checkpoint: cannot rename " + from.string() + " to " + to.string() +
                           ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")");
  }
}

/// What a written file is: its size and checksum, as the manifest lists it.
struct file_record {
  std::string name;
  std::uint64_t bytes = 0;
  std::uint64_t checksum = 0;
};

/// Writes one file atomically: to PATH.part, fsync'd, then renamed to PATH by
/// finish(). Everything written goes through the checksum. Destroyed before
/// finish(), it removes PATH.part.
class atomic_file {
 public:
  explicit atomic_file(std::filesystem::path path)
      : path_(std::move(path)), part_(path_.string() + ".part") {
    fd_.reset(::open(part_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd_) fail_os("cannot create", part_, errno);
  }
  atomic_file(const atomic_file&) = delete;
  atomic_file& operator=(const atomic_file&) = delete;
  ~atomic_file() {
    if (fd_) {
      fd_.reset();
      ::unlink(part_.c_str());
    }
  }

  /// Small pieces (headers) gather in a buffer; large ones go straight out.
  void write(const void* data, std::size_t n) {
    checksum_.update(data, n);
    bytes_ += n;
    if (pending_.size() + n <= buffer_limit) {
      pending_.append(static_cast<const char*>(data), n);
      return;
    }
    flush();
    write_all(data, n);
  }
  template <class T>
  void write_value(const T& v) {
    write(&v, sizeof v);
  }

  /// Flushes, fsyncs, closes and renames to the final name.
  file_record finish() {
    flush();
    if (::fsync(fd_.get()) != 0) fail_os("cannot sync", part_, errno);
    if (::close(fd_.get()) != 0) {
      const int err = errno;
      static_cast<void>(fd_.release());
      fail_os("cannot close", part_, err);
    }
    static_cast<void>(fd_.release());
    rename_path(part_, path_);
    return {path_.filename().string(), bytes_, checksum_.value()};
  }

 private:
  static constexpr std::size_t buffer_limit = 1u << 16;
  void flush() {
    if (pending_.empty()) return;
    write_all(pending_.data(), pending_.size());
    pending_.clear();
  }
  void write_all(const void* data, std::size_t n) {
    const auto* p = static_cast<const char*>(data);
    while (n > 0) {
      const ::ssize_t w = ::write(fd_.get(), p, std::min<std::size_t>(n, 1u << 30));
      if (w < 0) {
        if (errno == EINTR) continue;
        fail_os("cannot write", part_, errno);
      }
      p += w;
      n -= static_cast<std::size_t>(w);
    }
  }

  std::filesystem::path path_, part_;
  unique_fd fd_;
  std::string pending_;
  checksum64 checksum_;
  std::uint64_t bytes_ = 0;
};

/// What a part file says about one entry.
enum class entry_kind : std::uint8_t { values = 0, bytes = 1, sharded = 2 };
struct entry_header {
  std::string name;
  entry_kind kind = entry_kind::values;
  dtype type = dtype::uint8;
  std::vector<std::uint64_t> shape;
  std::uint64_t bytes = 0;   ///< of the payload
  std::uint64_t offset = 0;  ///< of the payload in the file
};

/// Writes a part file's header; then entry() once per entry, in order.
inline void write_part_header(atomic_file& file, std::uint32_t entries) {
  file.write(magic.data(), magic.size());
  file.write_value(format_version);
  file.write_value(entries);
}
inline void write_entry(atomic_file& file, std::string_view name, entry_kind kind, dtype type,
                        std::span<const std::uint64_t> shape, const void* payload,
                        std::uint64_t bytes) {
  file.write_value(static_cast<std::uint32_t>(name.size()));
  file.write(name.data(), name.size());
  file.write_value(static_cast<std::uint8_t>(kind));
  file.write_value(static_cast<std::uint8_t>(type));
  file.write_value(std::uint16_t{0});
  file.write_value(static_cast<std::uint32_t>(shape.size()));
  for (std::uint64_t d : shape) file.write_value(d);
  file.write_value(bytes);
  if (bytes > 0) file.write(payload, static_cast<std::size_t>(bytes));
}

/// A part file read through once: its entries (payloads not kept), size and
/// checksum. Throws checkpoint_error naming the file and what is wrong with it.
struct part_contents {
  std::vector<entry_header> entries;
  std::uint64_t bytes = 0;
  std::uint64_t checksum = 0;
};

/// Sequential reads that checksum what they read and know where they are.
class checked_reader {
 public:
  explicit checked_reader(std::filesystem::path path) : path_(std::move(path)) {
    fd_.reset(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd_) fail_os("cannot open", path_, errno);
    struct ::stat st {};
    if (::fstat(fd_.get(), &st) != 0) fail_os("cannot stat", path_, errno);
    size_ = static_cast<std::uint64_t>(st.st_size);
  }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }
  [[nodiscard]] std::uint64_t offset() const noexcept { return offset_; }
  [[nodiscard]] std::uint64_t checksum() const noexcept { return checksum_.value(); }

  /// Reads exactly n bytes into out (nullptr: checksummed and dropped); a
  /// file that ends first is "truncated" (naming what was being read).
  void read(void* out, std::uint64_t n, std::string_view what) {
    if (n > size_ - offset_) {
      throw checkpoint_error("checkpoint: " + path_.string() + " is truncated: it ends at byte " +
                             std::to_string(size_) + " inside " + std::string(what) +
                             " (which needs " + std::to_string(n) + " bytes from byte " +
                             std::to_string(offset_) + ")");
    }
    std::array<char, 1 << 16> scratch{};
    auto* dst = static_cast<char*>(out);
    while (n > 0) {
      const std::size_t want = std::min<std::uint64_t>(n, dst ? (1u << 30) : scratch.size());
      char* into = dst ? dst : scratch.data();
      const ::ssize_t r = ::read(fd_.get(), into, want);
      if (r < 0) {
        if (errno == EINTR) continue;
        fail_os("cannot read", path_, errno);
      }
      if (r == 0) {
        throw checkpoint_error("checkpoint: " + path_.string() + " ended early at byte " +
                               std::to_string(offset_) + " (changed while being read?)");
      }
      checksum_.update(into, static_cast<std::size_t>(r));
      offset_ += static_cast<std::uint64_t>(r);
      n -= static_cast<std::uint64_t>(r);
      if (dst) dst += r;
    }
  }
  template <class T>
  T value(std::string_view what) {
    T v{};
    read(&v, sizeof v, what);
    return v;
  }
  [[noreturn]] void malformed(const std::string& why) const {
    throw checkpoint_error("checkpoint: " + path_.string() + " is not a dtrain checkpoint part: " +
                           why + " (at byte " + std::to_string(offset_) + ")");
  }

 private:
  std::filesystem::path path_;
  unique_fd fd_;
  std::uint64_t size_ = 0, offset_ = 0;
  checksum64 checksum_;
};

/// Reads the whole part file: its structure and its checksum. With `sink`,
/// each entry's payload is handed to sink(header, reader) to read (exactly
/// header.bytes); without, payloads are read and dropped.
template <class Sink>
part_contents read_part(const std::filesystem::path& path, Sink&& sink) {
  checked_reader in(path);
  std::array<char, magic.size()> head{};
  in.read(head.data(), head.size(), "the magic");
  if (std::string_view(head.data(), head.size()) != magic) in.malformed("its magic is wrong");
  const auto version = in.value<std::uint32_t>("the format version");
  if (version != format_version) {
    in.malformed("format version " + std::to_string(version) + ", this dtrain reads " +
                 std::to_string(format_version));
  }
  const auto count = in.value<std::uint32_t>("the entry count");
  if (count > max_entries) in.malformed(std::to_string(count) + " entries");
  part_contents out;
  out.entries.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i) {
    entry_header e;
    const auto name_length = in.value<std::uint32_t>("an entry's name length");
    if (name_length > max_name)
      in.malformed("an entry name of " + std::to_string(name_length) + " bytes");
    e.name.resize(name_length);
    in.read(e.name.data(), name_length, "an entry's name");
    const auto kind = in.value<std::uint8_t>("entry '" + e.name + "'");
    const auto type = in.value<std::uint8_t>("entry '" + e.name + "'");
    static_cast<void>(in.value<std::uint16_t>("entry '" + e.name + "'"));
    if (kind > 2 || type > static_cast<std::uint8_t>(dtype::uint8))
      in.malformed("entry '" + e.name + "' has kind " + std::to_string(kind) + ", type " +
                   std::to_string(type));
    e.kind = static_cast<entry_kind>(kind);
    e.type = static_cast<dtype>(type);
    const auto dims = in.value<std::uint32_t>("entry '" + e.name + "'");
    if (dims > max_dims)
      in.malformed("entry '" + e.name + "' has " + std::to_string(dims) + " dimensions");
    for (std::uint32_t d = 0; d < dims; ++d) e.shape.push_back(in.value<std::uint64_t>("a shape"));
    e.bytes = in.value<std::uint64_t>("entry '" + e.name + "'");
    e.offset = in.offset();
    if (e.bytes > in.size() - in.offset()) {
      in.read(nullptr, e.bytes, "the values of entry '" + e.name + "'");  // throws: truncated
    }
    sink(e, in);
    if (in.offset() != e.offset + e.bytes) in.malformed("entry '" + e.name + "' was read short");
    out.entries.push_back(std::move(e));
  }
  if (in.offset() != in.size()) {
    in.malformed(std::to_string(in.size() - in.offset()) + " bytes after the last entry");
  }
  out.bytes = in.size();
  out.checksum = in.checksum();
  return out;
}
inline part_contents read_part(const std::filesystem::path& path) {
  return read_part(path, [](const entry_header& e, checked_reader& in) {
    in.read(nullptr, e.bytes, "the values of entry '" + e.name + "'");
  });
}

/// The manifest: what one committed step holds.
struct manifest {
  std::uint64_t step = 0;
  int world_size = 0;
  std::vector<file_record> files;

  [[nodiscard]] const file_record* find(std::string_view name) const {
    for (const file_record& f : files)
      if (f.name == name) return &f;
    return nullptr;
  }
};

[[nodiscard]] inline std::string render(const manifest& m) {
  std::string body = "dtrain checkpoint " + std::to_string(format_version) + "\nstep " +
                     std::to_string(m.step) + "\nworld_size " + std::to_string(m.world_size) + "\n";
  for (const file_record& f : m.files) {
    body += "file " + f.name + " " + std::to_string(f.bytes) + " " + hex64(f.checksum) + "\n";
  }
  return body + "end " + hex64(checksum64::of(body.data(), body.size())) + "\n";
}

/// Parses a manifest's text; throws checkpoint_error naming `path` and the line.
[[nodiscard]] inline manifest parse_manifest(std::string_view text,
                                             const std::filesystem::path& path) {
  auto bad = [&](const std::string& why) -> checkpoint_error {
    return checkpoint_error("checkpoint: " + path.string() + " is torn or not a manifest: " + why);
  };
  const std::size_t end_at = text.rfind("end ");
  if (end_at == std::string_view::npos || (end_at > 0 && text[end_at - 1] != '\n'))
    throw bad("it has no end line (a save that stopped while writing it)");
  const std::string_view body = text.substr(0, end_at);
  const std::string_view end_line = text.substr(end_at + 4);
  if (end_line != hex64(checksum64::of(body.data(), body.size())) + "\n")
    throw bad("its end line does not match its checksum");
  manifest m;
  bool have_step = false, have_world = false;
  std::size_t line_number = 0;
  for (std::size_t at = 0; at < body.size();) {
    const std::size_t nl = body.find('\n', at);
    const std::string_view line = body.substr(at, nl - at);
    at = nl + 1;
    ++line_number;
    std::vector<std::string_view> words;
    for (std::size_t w = 0; w < line.size();) {
      const std::size_t sp = std::min(line.find(' ', w), line.size());
      words.push_back(line.substr(w, sp - w));
      w = sp + 1;
    }
    auto number = [&](std::string_view s, int base = 10) {
      std::uint64_t v = 0;
      auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v, base);
      if (ec != std::errc{} || p != s.data() + s.size())
        throw bad("line " + std::to_string(line_number) + ": '" + std::string(s) +
                  "' is not a number");
      return v;
    };
    if (line_number == 1) {
      if (line != "dtrain checkpoint " + std::to_string(format_version))
        throw bad("its first line is '" + std::string(line) + "'");
    } else if (words.size() == 2 && words[0] == "step") {
      m.step = number(words[1]);
      have_step = true;
    } else if (words.size() == 2 && words[0] == "world_size") {
      const std::uint64_t w = number(words[1]);
      if (w == 0 || w > 1u << 24) throw bad("world_size " + std::to_string(w));
      m.world_size = static_cast<int>(w);
      have_world = true;
    } else if (words.size() == 4 && words[0] == "file" && words[3].size() == 16) {
      m.files.push_back({std::string(words[1]), number(words[2]), number(words[3], 16)});
    } else {
      throw bad("line " + std::to_string(line_number) + " is '" + std::string(line) + "'");
    }
  }
  if (!have_step || !have_world) throw bad("it lacks its step or world_size line");
  return m;
}

/// Reads a small file whole (a manifest).
[[nodiscard]] inline std::string read_small_file(const std::filesystem::path& path,
                                                 std::size_t limit = 1u << 24) {
  checked_reader in(path);
  if (in.size() > limit) {
    throw checkpoint_error("checkpoint: " + path.string() + " has " + std::to_string(in.size()) +
                           " bytes, more than a manifest can");
  }
  std::string text(static_cast<std::size_t>(in.size()), '\0');
  in.read(text.data(), text.size(), "the file");
  return text;
}

/// A step directory's manifest, read and parsed.
[[nodiscard]] inline manifest read_manifest(const std::filesystem::path& step_dir) {
  const std::filesystem::path manifest_path = step_dir / manifest_name;
  return parse_manifest(read_small_file(manifest_path), manifest_path);
}

/// Reads `file` whole and checks it against the manifest's `record`: its size
/// and checksum. Returns what it holds; throws checkpoint_error naming the file.
inline part_contents read_checked_part(const std::filesystem::path& file,
                                       const file_record& record) {
  part_contents got = read_part(file);
  if (got.bytes != record.bytes) {
    throw checkpoint_error("checkpoint: " + file.string() + " has " + std::to_string(got.bytes) +
                           " bytes, its manifest says " + std::to_string(record.bytes) +
                           " (truncated or overwritten)");
  }
  if (got.checksum != record.checksum) {
    throw checkpoint_error("checkpoint: " + file.string() + " has checksum " + hex64(got.checksum) +
                           ", its manifest says " + hex64(record.checksum) + " (corrupt)");
  }
  return got;
}

/// Checks a committed step directory against its manifest: every listed file
/// present, of its size and checksum. Returns the manifest; throws
/// checkpoint_error naming the first file that is wrong.
inline manifest verify_step(const std::filesystem::path& step_dir) {
  manifest m = read_manifest(step_dir);
  for (const file_record& f : m.files) static_cast<void>(read_checked_part(step_dir / f.name, f));
  return m;
}

}  // namespace dtrain::detail::ckpt
// ---- end dtrain/checkpoint/format.hpp ----

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace dtrain {

/// Whose state an entry is: the same on every rank (written once, by rank 0,
/// and loaded by every rank, whatever the world size) or each rank's own.
enum class checkpoint_scope : std::uint8_t { replicated, per_rank };

/// Options of dtrain::checkpoint. Aggregate: `{.dir = "ckpt", .every = 100}`.
struct checkpoint_options {
  /// Where the checkpoints go (created if missing). Every rank must see the
  /// same directory: one machine, or a file system that every node shares.
  std::filesystem::path dir;
  /// step() saves after every `every`-th step; 0: only save() saves.
  std::uint64_t every = 0;
  /// Committed checkpoints kept (at least 1); older ones are removed once a
  /// newer one is committed. With 2 or more, a newest checkpoint damaged on
  /// disk still leaves one to resume from.
  int keep = 2;
  /// No line on rank 0's stderr per save and restore.
  bool quiet = false;
  /// save() copies the state (host memory: the size of the checkpoint) and
  /// returns; a thread writes the files beside the next steps, and the
  /// checkpoint is committed at the next save(), restore() or wait(), or when
  /// the checkpoint object is destroyed. Until then the one before it is the
  /// newest.
  bool asynchronous = false;
  /// Threads that copy the state at an asynchronous save (the training
  /// thread is one of them); a copy under 1 MiB per thread is not split.
  /// 0: automatic, the machine's cores per local rank when built from a
  /// dtrain::context (at most 8), else 1.
  int copy_threads = 0;
};

/// Where a checkpoint's time on the training thread went, summed over its
/// saves on this rank (dtrain::checkpoint::timings()).
struct checkpoint_timings {
  std::uint64_t saves = 0;  ///< save() calls
  /// In save() (and, for an asynchronous checkpoint, in wait()): what the
  /// training waited for in all.
  double blocked_seconds = 0;
  /// The asynchronous save's copy of the state (its "staging").
  double copy_seconds = 0;
  /// Committing the save before: waiting for its writer, and the
  /// control-plane rounds of its commit.
  double commit_seconds = 0;
  /// Of commit_seconds, the wait for an asynchronous save's writer, which was
  /// still writing when the next save() came: more than a little means saves
  /// come faster than the disk takes them (rank 0 says so once).
  double writer_wait_seconds = 0;
};

/// A committed checkpoint found on disk.
struct checkpoint_found {
  std::uint64_t step = 0;
  std::filesystem::path path;  ///< DIR/step-<N>
  int world_size = 0;          ///< of the job that wrote it
};

/// The newest checkpoint in `dir` whose manifest and files check out (sizes
/// and checksums), or nullopt. Each newer one that does not is skipped, with a
/// line naming the file and what is wrong appended to `skipped` when given.
/// Throws checkpoint_error when `dir` exists but cannot be read.
inline std::optional<checkpoint_found> latest_checkpoint(
    const std::filesystem::path& dir, std::vector<std::string>* skipped = nullptr) {
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec)) return std::nullopt;
  std::vector<std::pair<std::uint64_t, std::filesystem::path>> steps;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) {
    throw checkpoint_error("checkpoint: cannot read directory " + dir.string() + ": " +
                           ec.message());
  }
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
    if (ec) break;
    if (auto step = detail::ckpt::step_of(it->path().filename().string())) {
      if (it->is_directory(ec)) steps.emplace_back(*step, it->path());
    }
  }
  if (ec) {
    throw checkpoint_error("checkpoint: cannot read directory " + dir.string() + ": " +
                           ec.message());
  }
  std::sort(steps.begin(), steps.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [step, path] : steps) {
    try {
      const detail::ckpt::manifest m = detail::ckpt::verify_step(path);
      if (m.step != step) {
        throw checkpoint_error("checkpoint: " + (path / detail::ckpt::manifest_name).string() +
                               " says step " + std::to_string(m.step) +
                               " in a directory for step " + std::to_string(step));
      }
      return checkpoint_found{step, path, m.world_size};
    } catch (const checkpoint_error& e) {
      if (skipped) skipped->push_back(std::string(e.what()) + "; skipped");
    }
  }
  return std::nullopt;
}

/// One step's state of every rank: saved consistently, resumed from. See the
/// file's comment. Every rank constructs it, registers the same entries (per
/// scope) in the same way, and calls restore(), step() and save() together.
class checkpoint {
 public:
  checkpoint(dtrain::control_plane plane, checkpoint_options options)
      : plane_(plane), options_(std::move(options)) {
    if (options_.dir.empty()) {
      throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) +
                         ": checkpoint_options::dir is empty");
    }
    if (options_.keep < 1) {
      throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) +
                         ": checkpoint_options::keep is " + std::to_string(options_.keep) +
                         "; at least 1 checkpoint must be kept");
    }
    if (options_.copy_threads < 0) {
      throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) +
                         ": checkpoint_options::copy_threads is " +
                         std::to_string(options_.copy_threads) + "; 0 (automatic) or more");
    }
    if (options_.copy_threads == 0) options_.copy_threads = 1;
    add_values("dtrain.step", {&steps_, 1, dtype::int64, memory::host},
               checkpoint_scope::replicated, {});
  }
  /// From a dtrain::context (its control plane).
  template <class Context>
  requires requires(Context& c) {
    { c.control_plane() } -> std::same_as<dtrain::control_plane>;
  }
  checkpoint(Context& ctx, checkpoint_options options)
      : checkpoint(ctx.control_plane(), with_copy_threads(std::move(options), ctx)) {}

  checkpoint(const checkpoint&) = delete;
  checkpoint& operator=(const checkpoint&) = delete;
  checkpoint(checkpoint&&) = delete;  // its step entry points into it
  checkpoint& operator=(checkpoint&&) = delete;

  /// Values in host memory, restored in place: `name` must be unique.
  checkpoint& add(std::string name, buffer values,
                  checkpoint_scope scope = checkpoint_scope::replicated,
                  std::vector<std::size_t> shape = {}) {
    std::vector<std::uint64_t> dims(shape.begin(), shape.end());
    return add_values(std::move(name), values, scope, std::move(dims));
  }
  /// A contiguous range of elements (std::vector<float>, std::span<double>, ...).
  template <class R>
  requires detail::element_range<R> checkpoint& add(
      std::string name, R& values, checkpoint_scope scope = checkpoint_scope::replicated) {
    using T = detail::range_element<R>;
    return add(std::move(name),
               host_buffer(std::span<T>(std::ranges::data(values), std::ranges::size(values))),
               scope);
  }
  /// One value of a trivially copyable type (a counter, an RNG's state), as its bytes.
  template <class T>
  requires(std::is_trivially_copyable_v<T> && !std::ranges::range<T> && !std::same_as<T, buffer> &&
           !std::same_as<T, distributed_sampler>)
      checkpoint& add(std::string name, T& value,
                      checkpoint_scope scope = checkpoint_scope::replicated) {
    return add_values(
        std::move(name),
        {static_cast<void*>(std::addressof(value)), sizeof(T), dtype::uint8, memory::host}, scope,
        {});
  }
  /// Every parameter's values, under its name (replicated: DDP keeps them equal).
  template <class Params>
  requires detail::parameter_list<Params> checkpoint& add(const Params& params) {
    for (std::size_t i = 0; i < std::ranges::size(params); ++i) {
      const parameter& p = detail::parameter_at(params, i);
      add(p.name, p.values, checkpoint_scope::replicated, p.shape);
    }
    return *this;
  }
  /// A sharded array (the optimizer state of a sharded DDP): this rank holds
  /// `values` (host memory), its `ranges` of a whole array of `total`
  /// elements. Each rank saves its ranges; restore() gives each rank the
  /// ranges it holds now, whatever the world size and the cut the
  /// checkpoint was written with (it reads every rank's part when the world
  /// size differs), and refuses by name a checkpoint whose ranks did not hold
  /// every element it needs.
  checkpoint& add_sharded(std::string name, buffer values, std::vector<shard_range> ranges,
                          std::uint64_t total) {
    for (const shard_range& r : ranges) {
      if (r.local > values.count || r.count > values.count - r.local || r.global > total ||
          r.count > total - r.global) {
        throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) +
                           ": sharded entry '" + name + "': range " + std::to_string(r.global) +
                           "+" + std::to_string(r.count) + " (at " + std::to_string(r.local) +
                           " here) does not fit " + std::to_string(values.count) +
                           " values of a whole of " + std::to_string(total));
      }
    }
    add_values(name, values, checkpoint_scope::per_rank, {});
    entry& e = entries_.back();
    e.kind = detail::ckpt::entry_kind::sharded;
    e.ranges = std::move(ranges);
    e.total = total;
    return *this;
  }
  /// A sharded DDP's optimizer state (`values`: an array of ddp.shard_elements()
  /// elements indexed by shard_piece::state_offset), cut as `ddp.shard()` is.
  template <class R, class DDP>
  requires detail::element_range<R> && requires(const DDP& d) {
    { d.shard_ranges() } -> std::convertible_to<std::vector<shard_range>>;
    { d.model_elements() } -> std::convertible_to<std::uint64_t>;
  }
  checkpoint& add_sharded(std::string name, R& values, const DDP& ddp) {
    using T = detail::range_element<R>;
    return add_sharded(
        std::move(name),
        host_buffer(std::span<T>(std::ranges::data(values), std::ranges::size(values))),
        ddp.shard_ranges(), ddp.model_elements());
  }

  /// The sampler's position in the global order (replicated: it is the same
  /// on every rank, and a job of another size continues it).
  checkpoint& add(distributed_sampler& sampler, std::string name = "sampler") {
    return add(
        std::move(name),
        [&sampler] {
          const sampler_position p = sampler.position();
          std::string out(2 * sizeof(std::uint64_t), '\0');
          std::memcpy(out.data(), &p.epoch, sizeof p.epoch);
          std::memcpy(out.data() + sizeof p.epoch, &p.offset, sizeof p.offset);
          return out;
        },
        [&sampler](std::string_view bytes) {
          sampler_position p;
          if (bytes.size() != sizeof p.epoch + sizeof p.offset) {
            throw checkpoint_error("checkpoint: the sampler's position has " +
                                   std::to_string(bytes.size()) + " bytes, not 16");
          }
          std::memcpy(&p.epoch, bytes.data(), sizeof p.epoch);
          std::memcpy(&p.offset, bytes.data() + sizeof p.epoch, sizeof p.offset);
          sampler.set_position(p);
        });
  }
  /// State the program serialises itself (an optimizer's, a data loader's):
  /// save() returns its bytes at a save; load(bytes) gets them back at restore().
  checkpoint& add(std::string name, std::function<std::string()> save,
                  std::function<void(std::string_view)> load,
                  checkpoint_scope scope = checkpoint_scope::replicated) {
    if (!save || !load) {
      throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) + ": entry '" +
                         name + "' needs both a save and a load function");
    }
    entry e;
    e.name = std::move(name);
    e.scope = scope;
    e.kind = detail::ckpt::entry_kind::bytes;
    e.save = std::move(save);
    e.load = std::move(load);
    return push(std::move(e));
  }

  /// Loads the newest whole checkpoint of dir, on every rank, and returns its
  /// step; nullopt (and nothing changed) when there is none. Throws
  /// checkpoint_error, on every rank and with nothing changed, when it does
  /// not fit what is registered here (another model, or per-rank state from
  /// another world size).
  std::optional<std::uint64_t> restore() {
    wait();
    // Rank 0 finds the newest checkpoint whose files check out; every rank hears the verdict.
    std::int64_t chosen = no_checkpoint;
    std::string problem;
    if ((plane_.rank() == 0)) {
      try {
        std::vector<std::string> skipped;
        const auto found = latest_checkpoint(options_.dir, &skipped);
        for (const std::string& line : skipped) say(line);
        if (found) chosen = static_cast<std::int64_t>(found->step);
      } catch (const std::exception& e) {
        chosen = failed;
        problem = e.what();
      }
    }
    broadcast_value(chosen);
    if (chosen == failed) {
      throw checkpoint_error((plane_.rank() == 0)
                                 ? problem
                                 : "checkpoint: rank 0 could not look for checkpoints in " +
                                       options_.dir.string() + " (its error says why)");
    }
    if (chosen == no_checkpoint) {
      say("no checkpoint in " + options_.dir.string() + ": starting from the beginning");
      return std::nullopt;
    }
    const auto step = static_cast<std::uint64_t>(chosen);
    const std::filesystem::path step_dir = options_.dir / detail::ckpt::step_name(step);

    // Each rank checks what it will read against what it registered; all agree before anything
    // changes.
    std::vector<std::filesystem::path> files;
    std::int64_t ok = 1;
    try {
      files = check_for_load(step_dir);
    } catch (const std::exception& e) {
      ok = 0;
      problem = e.what();
    }
    agree(ok, problem, "load " + step_dir.string());

    ok = 1;
    try {
      recut_.clear();
      for (const std::filesystem::path& file : files) apply(file);
      check_recut();
    } catch (const std::exception& e) {
      ok = 0;
      problem = std::string(e.what()) + " (while loading: this rank's state is now partly loaded)";
    }
    agree(ok, problem, "load " + step_dir.string());
    steps_ = static_cast<std::int64_t>(step);
    say("resumed from " + step_dir.string() + " (step " + std::to_string(step) + ")");
    return step;
  }

  /// Counts a finished training step; saves when `every` divides the count.
  /// Returns whether it saved.
  bool step() {
    ++steps_;
    if (options_.every > 0 && static_cast<std::uint64_t>(steps_) % options_.every == 0) {
      save();
      return true;
    }
    return false;
  }

  /// Saves now, as step steps(): on every rank, together. Throws
  /// checkpoint_error on every rank when any rank's part could not be written
  /// or the commit failed; the checkpoints already committed stay as they were.
  /// With checkpoint_options::asynchronous, it copies the state and returns:
  /// a thread writes the files beside the next steps, and the checkpoint is
  /// committed at the next save(), restore() or wait(), or when this object
  /// is destroyed (errors of the write are thrown there).
  void save() {
    const auto start = std::chrono::steady_clock::now();
    ++timings_.saves;
    // What the training thread spends here, whatever way it leaves.
    struct blocked_clock {
      checkpoint_timings& t;
      std::chrono::steady_clock::time_point start;
      ~blocked_clock() { t.blocked_seconds += detail::ckpt::seconds_since(start); }
    } blocked{timings_, start};
    wait_pending(true);
    const auto step = static_cast<std::uint64_t>(steps_);
    pending_ = std::make_unique<pending_save>();
    pending_save& p = *pending_;
    p.step = step;
    p.start = start;
    p.partial =
        options_.dir / (detail::ckpt::step_name(step) + std::string(detail::ckpt::partial_suffix));

    // 1. Every rank makes the partial directory (a save of this step that
    // died before may have left it: its files are overwritten, and the
    // manifest lists only this save's).
    try {
      make_directory(p.partial, false);
    } catch (const std::exception& e) {
      p.problem = e.what();
    }

    // 2. Every rank writes its part (now, or from a copy on a thread).
    try {
      if (p.problem.empty()) {
        p.per_rank = snapshot(checkpoint_scope::per_rank, options_.asynchronous);
        if (plane_.rank() == 0)
          p.replicated = snapshot(checkpoint_scope::replicated, options_.asynchronous);
      }
    } catch (const std::exception& e) {
      p.problem = e.what();
    }
    if (options_.asynchronous && p.problem.empty()) {
      p.writer = std::thread([&p, rank = plane_.rank()] { write_parts(p, rank); });
      return;
    }
    if (p.problem.empty()) write_parts(p, plane_.rank());
    commit();
  }

  /// Commits the save in flight (checkpoint_options::asynchronous), if any,
  /// on every rank together; throws as save() does.
  void wait() {
    const auto start = std::chrono::steady_clock::now();
    wait_pending();
    timings_.blocked_seconds += detail::ckpt::seconds_since(start);
  }

  /// Where this rank's training thread spent its time in save() and wait().
  [[nodiscard]] const checkpoint_timings& timings() const noexcept { return timings_; }

  ~checkpoint() {
    finish_pending();
    if (committer_.joinable()) committer_.join();
    if (!commit_failure_.empty()) {
      std::fprintf(stderr, "dtrain checkpoint on rank %d: %s\n", plane_.rank(),
                   commit_failure_.c_str());
    }
    if (cleaner_.joinable()) cleaner_.join();
  }

 private:
  void finish_pending() noexcept {
    if (!pending_) return;
    // Unwinding (this rank failed): the other ranks are not here to agree,
    // so the save in flight is left uncommitted; the next save removes it.
    if (std::uncaught_exceptions() > 0) {
      if (pending_->writer.joinable()) pending_->writer.join();
      return;
    }
    try {
      commit();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dtrain checkpoint on rank %d: %s\n", plane_.rank(), e.what());
    }
  }

 public:
  /// Steps counted by step() (and restored by restore()).
  [[nodiscard]] std::uint64_t steps() const noexcept { return static_cast<std::uint64_t>(steps_); }
  [[nodiscard]] const checkpoint_options& options() const noexcept { return options_; }

 private:
  template <class Context>
  static checkpoint_options with_copy_threads(checkpoint_options options, Context& ctx) {
    if (options.copy_threads == 0) {
      const int cores = static_cast<int>(std::thread::hardware_concurrency());
      options.copy_threads = std::clamp(cores / std::max(1, ctx.local_size()), 1, 8);
    }
    return options;
  }
  void wait_pending(bool next_save = false) {
    const auto start = std::chrono::steady_clock::now();
    if (pending_) commit(next_save);
    join_committer();
    timings_.commit_seconds += detail::ckpt::seconds_since(start);
  }

  static constexpr std::int64_t no_checkpoint = -1;
  static constexpr std::int64_t failed = -2;

  struct entry {
    std::string name;
    checkpoint_scope scope = checkpoint_scope::replicated;
    detail::ckpt::entry_kind kind = detail::ckpt::entry_kind::values;
    buffer values;
    std::vector<std::uint64_t> shape;
    std::function<std::string()> save;
    std::function<void(std::string_view)> load;
    detail::ckpt::staging staged;     // an asynchronous save's copy of `values`
    std::vector<shard_range> ranges;  // a sharded entry's: what this rank holds
    std::uint64_t total = 0;          // of the whole sharded array
  };

  checkpoint& add_values(std::string name, buffer values, checkpoint_scope scope,
                         std::vector<std::uint64_t> shape) {
    if (values.where != memory::host) {
      throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) + ": entry '" +
                         name +
                         "' is in device memory; checkpoints hold host memory (copy it to the host "
                         "and add that copy)");
    }
    if (values.count > 0 && values.data == nullptr) {
      throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) + ": entry '" +
                         name + "' has " + std::to_string(values.count) + " values and no data");
    }
    entry e;
    e.name = std::move(name);
    e.scope = scope;
    e.values = values;
    e.shape = std::move(shape);
    return push(std::move(e));
  }
  checkpoint& push(entry e) {
    if (e.name.empty() || e.name.size() > detail::ckpt::max_name) {
      throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) +
                         ": an entry's name must have 1 to " +
                         std::to_string(detail::ckpt::max_name) + " bytes");
    }
    for (const entry& other : entries_) {
      if (other.name == e.name) {
        throw config_error("checkpoint on rank " + std::to_string(plane_.rank()) + ": entry '" +
                           e.name + "' is added twice");
      }
    }
    entries_.push_back(std::move(e));
    return *this;
  }
  [[nodiscard]] bool has_scope(checkpoint_scope scope) const {
    return std::ranges::any_of(entries_, [&](const entry& e) { return e.scope == scope; });
  }

  /// One entry's bytes to write: the live memory, or a copy of it.
  struct part_record {
    std::string_view name;
    detail::ckpt::entry_kind kind = detail::ckpt::entry_kind::values;
    dtype type = dtype::uint8;
    std::span<const std::uint64_t> shape;
    const void* data = nullptr;
    std::uint64_t bytes = 0;
  };
  /// What one rank writes for one scope: the records, and what they point into.
  struct part_snapshot {
    std::vector<part_record> records;
    std::vector<std::string> owned;  // bytes entries' save() results
  };
  /// A save from its start to its commit.
  struct pending_save {
    std::uint64_t step = 0;
    std::chrono::steady_clock::time_point start;
    std::filesystem::path partial;
    part_snapshot per_rank, replicated;
    std::optional<detail::ckpt::file_record> per_rank_file, replicated_file;
    std::string problem;  // this rank's, from its snapshot or its write
    std::thread writer;
  };

  /// The records of `scope`'s entries; `copy`: into owned memory (an
  /// asynchronous save, whose training goes on while the files are written).
  part_snapshot snapshot(checkpoint_scope scope, bool copy) {
    part_snapshot out;
    std::size_t owned = 0;
    for (const entry& e : entries_) owned += e.scope == scope ? 1 : 0;
    out.owned.reserve(owned);  // the records point into these strings: no reallocation
    std::vector<detail::ckpt::copy_job> copies;
    for (entry& e : entries_) {
      if (e.scope != scope) continue;
      part_record r{e.name, e.kind, e.values.type, e.shape, e.values.data, e.values.bytes()};
      if (e.kind == detail::ckpt::entry_kind::bytes) {
        r.type = dtype::uint8;
        out.owned.push_back(e.save());
        r.data = out.owned.back().data();
        r.bytes = out.owned.back().size();
      } else if (e.kind == detail::ckpt::entry_kind::sharded) {
        out.owned.push_back(sharded_payload(e));
        r.data = out.owned.back().data();
        r.bytes = out.owned.back().size();
      } else if (copy && r.bytes > 0) {
        // The entry's own copy, reused by each save (one is in flight at a
        // time): its pages are touched once per job, not at every save.
        void* to = e.staged.reserve(e.values.bytes());
        copies.push_back({to, e.values.data, e.values.bytes()});
        r.data = to;
      }
      out.records.push_back(r);
    }
    if (!copies.empty()) {
      const auto start = std::chrono::steady_clock::now();
      detail::ckpt::copy_parallel(copies, options_.copy_threads);
      timings_.copy_seconds += detail::ckpt::seconds_since(start);
    }
    return out;
  }
  /// A sharded entry as it is written: the whole's size, the ranges, their values.
  static std::string sharded_payload(const entry& e) {
    const std::size_t element = size_of(e.values.type);
    std::string out;
    auto word = [&](std::uint64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); };
    word(e.total);
    word(e.ranges.size());
    for (const shard_range& r : e.ranges) {
      word(r.global);
      word(r.count);
    }
    for (const shard_range& r : e.ranges) {
      out.append(static_cast<const char*>(e.values.data) + r.local * element,
                 static_cast<std::size_t>(r.count * element));
    }
    return out;
  }

  static detail::ckpt::file_record write_part(const std::filesystem::path& path,
                                              const part_snapshot& part) {
    detail::ckpt::atomic_file file(path);
    detail::ckpt::write_part_header(file, static_cast<std::uint32_t>(part.records.size()));
    for (const part_record& r : part.records) {
      detail::ckpt::write_entry(file, r.name, r.kind, r.type, r.shape, r.data, r.bytes);
    }
    return file.finish();
  }
  /// Writes this rank's files of `p` (on the training thread, or the writer's).
  static void write_parts(pending_save& p, int rank) {
    try {
      if (!p.per_rank.records.empty()) {
        p.per_rank_file = write_part(p.partial / detail::ckpt::rank_part_name(rank), p.per_rank);
      }
      if (rank == 0)
        p.replicated_file = write_part(p.partial / detail::ckpt::replicated_name, p.replicated);
    } catch (const std::exception& e) {
      p.problem = e.what();
    }
  }

  /// Phases 2 and 3 of the save in flight: all ranks learn what every rank
  /// wrote; rank 0 commits it (manifest, rename) or removes it; all hear which.
  /// `next_save`: called by save() (the wait for the writer is then the
  /// training's; at wait(), restore() or the end it is expected).
  void commit(bool next_save = false) {
    std::unique_ptr<pending_save> owned = std::move(pending_);
    pending_save& p = *owned;
    if (p.writer.joinable()) {
      const auto start = std::chrono::steady_clock::now();
      p.writer.join();
      const double waited = detail::ckpt::seconds_since(start);
      if (next_save) timings_.writer_wait_seconds += waited;
      if (next_save && waited > 0.001 && !warned_slow_writer_ && plane_.rank() == 0) {
        warned_slow_writer_ = true;
        std::fprintf(stderr,
                     "dtrain checkpoint: the asynchronous save of step %llu was still being "
                     "written when the next save came; the training waited %.0f ms "
                     "for it. Saves come faster than %s takes them: save less often "
                     "(checkpoint_options::every is %llu). Said once; "
                     "checkpoint::timings().writer_wait_seconds counts them all\n",
                     static_cast<unsigned long long>(p.step), 1e3 * waited,
                     options_.dir.string().c_str(),
                     static_cast<unsigned long long>(options_.every));
      }
    }
    join_committer();  // rank 0: the save before this one is committed (or this throws)
    const std::filesystem::path step_dir = options_.dir / detail::ckpt::step_name(p.step);
    const std::string what = "save step " + std::to_string(p.step) + " to " + step_dir.string();
    std::array<std::int64_t, 4> mine{1, 0, 0, 0};  // ok, has a file, bytes, checksum
    if (!p.problem.empty()) {
      mine[0] = 0;
    } else if (p.per_rank_file) {
      mine = {1, 1, static_cast<std::int64_t>(p.per_rank_file->bytes),
              std::bit_cast<std::int64_t>(p.per_rank_file->checksum)};
    }
    const auto size = static_cast<std::size_t>(plane_.size());
    std::vector<std::int64_t> all(4 * size);
    plane_.allgather(mine, all);
    std::string failed_ranks;
    for (std::size_t r = 0; r < size; ++r) {
      if (all[4 * r] == 0) failed_ranks += (failed_ranks.empty() ? "" : ", ") + std::to_string(r);
    }

    if (plane_.rank() != 0) {
      if (options_.asynchronous) return;  // rank 0 commits beside the training; it reports
      std::int64_t committed = 0;
      broadcast_value(committed);
      if (!committed) {
        throw checkpoint_error(!p.problem.empty()
                                   ? p.problem + " (rank " + std::to_string(plane_.rank()) + ")"
                                   : not_committed(what, failed_ranks));
      }
      return;
    }
    // Rank 0: the manifest and the rename, then the checkpoints beyond `keep`.
    auto finish = [this, owned = std::move(owned), all = std::move(all), failed_ranks,
                   what]() -> std::string {
      pending_save& q = *owned;
      std::string problem = q.problem;
      try {
        if (failed_ranks.empty()) {
          const std::uint64_t bytes = commit_on_disk(q, all);
          prune(q.step);
          const std::chrono::duration<double> took = std::chrono::steady_clock::now() - q.start;
          char line[160];
          std::snprintf(line, sizeof line, " (%llu bytes, %.3f s%s)",
                        static_cast<unsigned long long>(bytes), took.count(),
                        options_.asynchronous ? " until committed" : "");
          say("saved " + (options_.dir / detail::ckpt::step_name(q.step)).string() + line);
          return "";
        }
        remove_tree(q.partial);
      } catch (const std::exception& e) {
        if (problem.empty()) problem = e.what();
        static_cast<void>(detail::remove_tree(q.partial.c_str()));
      }
      return !problem.empty() ? problem + " (rank 0)" : not_committed(what, failed_ranks);
    };
    if (options_.asynchronous) {
      committer_ =
          std::thread([this, finish = std::move(finish)]() mutable { commit_failure_ = finish(); });
      return;
    }
    const std::string problem = finish();
    std::int64_t committed = problem.empty() ? 1 : 0;
    broadcast_value(committed);
    if (!committed) throw checkpoint_error(problem);
  }

  static std::string not_committed(const std::string& what, const std::string& failed_ranks) {
    return "checkpoint: could not " + what +
           (failed_ranks.empty() ? ": rank 0 could not commit it"
                                 : ": rank(s) " + failed_ranks + " could not write their part") +
           " (their error says why); the checkpoints before it are kept";
  }

  /// Rank 0: the manifest into the partial directory, which is renamed to
  /// step-<N> (the commit), each fsync'd. Returns the checkpoint's bytes.
  std::uint64_t commit_on_disk(const pending_save& p, const std::vector<std::int64_t>& all) {
    const std::filesystem::path step_dir = options_.dir / detail::ckpt::step_name(p.step);
    detail::ckpt::manifest m{p.step, plane_.size(), {*p.replicated_file}};
    std::uint64_t bytes = p.replicated_file->bytes;
    for (std::size_t r = 0; 4 * r < all.size(); ++r) {
      if (all[4 * r + 1] == 0) continue;
      m.files.push_back({detail::ckpt::rank_part_name(static_cast<int>(r)),
                         static_cast<std::uint64_t>(all[4 * r + 2]),
                         std::bit_cast<std::uint64_t>(all[4 * r + 3])});
      bytes += static_cast<std::uint64_t>(all[4 * r + 2]);
    }
    const std::string text = detail::ckpt::render(m);
    detail::ckpt::atomic_file manifest(p.partial / detail::ckpt::manifest_name);
    manifest.write(text.data(), text.size());
    static_cast<void>(manifest.finish());
    detail::ckpt::sync_directory(p.partial);
    if (std::filesystem::exists(step_dir)) {  // an older run's (its newest was damaged)
      const std::filesystem::path aside = step_dir.string() + ".replaced";
      remove_tree(aside);
      detail::ckpt::rename_path(step_dir, aside);
      remove_tree(aside);
    }
    detail::ckpt::rename_path(p.partial, step_dir);
    detail::ckpt::sync_directory(options_.dir);
    return bytes;
  }

  /// Waits for rank 0's commit of the last asynchronous save; throws what it could not do.
  void join_committer() {
    if (committer_.joinable()) committer_.join();
    if (!commit_failure_.empty())
      throw checkpoint_error(std::exchange(commit_failure_, std::string()));
  }

  /// Rank 0's value reaches every rank.
  void broadcast_value(std::int64_t& value) {
    std::array<std::uint8_t, sizeof(std::int64_t)> bytes{};
    std::memcpy(bytes.data(), &value, sizeof value);
    plane_.broadcast(bytes, 0);
    std::memcpy(&value, bytes.data(), sizeof value);
  }

  /// "[64, 16] float32" (or "1024 float32" without a shape).
  static std::string describe(detail::ckpt::entry_kind kind, dtype type,
                              const std::vector<std::uint64_t>& shape, std::uint64_t bytes) {
    if (kind == detail::ckpt::entry_kind::bytes)
      return std::to_string(bytes) + " bytes of its own format";
    std::string out;
    if (shape.empty()) {
      out = std::to_string(bytes / size_of(type));
    } else {
      out = "[";
      for (std::size_t i = 0; i < shape.size(); ++i)
        out += (i ? ", " : "") + std::to_string(shape[i]);
      out += "]";
    }
    return out + " " + std::string(to_string(type));
  }

  /// The files this rank loads from `step_dir`, checked: the manifest, each
  /// file's size and checksum, and every entry against the registered ones.
  std::vector<std::filesystem::path> check_for_load(const std::filesystem::path& step_dir) {
    const detail::ckpt::manifest m = detail::ckpt::read_manifest(step_dir);
    std::vector<std::pair<std::string, checkpoint_scope>> wanted{
        {std::string(detail::ckpt::replicated_name), checkpoint_scope::replicated}};
    if (has_scope(checkpoint_scope::per_rank)) {
      if (m.world_size != plane_.size()) {
        // Sharded entries are re-cut from every rank's part; other per-rank state cannot be.
        std::string names;
        for (const entry& e : entries_) {
          if (e.scope == checkpoint_scope::per_rank && e.kind != detail::ckpt::entry_kind::sharded)
            names += (names.empty() ? "'" : ", '") + e.name + "'";
        }
        if (!names.empty()) {
          throw checkpoint_error("checkpoint: " + step_dir.string() + " was written by " +
                                 std::to_string(m.world_size) + " ranks and this job has " +
                                 std::to_string(plane_.size()) + "; its per-rank state (" + names +
                                 ") cannot be re-cut for another world size");
        }
        for (int r = 0; r < m.world_size; ++r)
          wanted.emplace_back(detail::ckpt::rank_part_name(r), checkpoint_scope::per_rank);
      } else {
        wanted.emplace_back(detail::ckpt::rank_part_name(plane_.rank()),
                            checkpoint_scope::per_rank);
      }
    }
    std::vector<std::filesystem::path> files;
    std::string problems;
    for (const auto& [name, scope] : wanted) {
      const std::filesystem::path path = step_dir / name;
      const detail::ckpt::file_record* record = m.find(name);
      if (!record)
        throw checkpoint_error("checkpoint: " + (step_dir / detail::ckpt::manifest_name).string() +
                               " lists no " + name);
      const detail::ckpt::part_contents got = detail::ckpt::read_checked_part(path, *record);
      std::vector<bool> matched(got.entries.size(), false);
      for (const entry& e : entries_) {
        if (e.scope != scope) continue;
        const auto it = std::ranges::find(got.entries, e.name, &detail::ckpt::entry_header::name);
        if (it == got.entries.end()) {
          problems += "\n  '" + e.name + "' is registered here and not in the checkpoint";
          continue;
        }
        matched[static_cast<std::size_t>(it - got.entries.begin())] = true;
        const bool same_kind = it->kind == e.kind;
        const bool same_values =
            e.kind == detail::ckpt::entry_kind::bytes ||
            (e.kind == detail::ckpt::entry_kind::sharded && it->type == e.values.type) ||
            (it->type == e.values.type && it->bytes == e.values.bytes() &&
             (it->shape.empty() || e.shape.empty() || it->shape == e.shape));
        if (!same_kind || !same_values) {
          problems += "\n  '" + e.name + "' is " +
                      describe(it->kind, it->type, it->shape, it->bytes) +
                      " in the checkpoint and " +
                      describe(e.kind, e.values.type, e.shape,
                               e.kind == detail::ckpt::entry_kind::bytes ? 0 : e.values.bytes()) +
                      " here";
        }
      }
      for (std::size_t i = 0; i < got.entries.size(); ++i) {
        if (!matched[i]) {
          problems +=
              "\n  '" + got.entries[i].name + "' is in the checkpoint and not registered here";
        }
      }
      files.push_back(path);
    }
    if (!problems.empty()) {
      throw checkpoint_error("checkpoint: " + step_dir.string() + " does not fit what rank " +
                             std::to_string(plane_.rank()) +
                             " registered (another model, or other state):" + problems);
    }
    return files;
  }

  /// Reads a checked file into the registered entries.
  void apply(const std::filesystem::path& path) {
    detail::ckpt::read_part(
        path, [&](const detail::ckpt::entry_header& h, detail::ckpt::checked_reader& in) {
          const auto it = std::ranges::find(entries_, h.name, &entry::name);
          if (it == entries_.end()) {
            in.read(nullptr, h.bytes, "entry '" + h.name + "'");
            return;
          }
          if (it->kind == detail::ckpt::entry_kind::bytes) {
            std::string bytes(static_cast<std::size_t>(h.bytes), '\0');
            in.read(bytes.data(), h.bytes, "entry '" + h.name + "'");
            it->load(bytes);
          } else if (it->kind == detail::ckpt::entry_kind::sharded) {
            std::string bytes(static_cast<std::size_t>(h.bytes), '\0');
            in.read(bytes.data(), h.bytes, "entry '" + h.name + "'");
            recut(*it, bytes, path);
          } else {
            in.read(it->values.data, h.bytes, "entry '" + h.name + "'");
          }
        });
  }

  /// The parts of a saved sharded entry (`payload`, from `file`) that fall in
  /// the ranges this rank holds, copied into its values; counted in `recut_`.
  void recut(entry& e, std::string_view payload, const std::filesystem::path& file) {
    const std::size_t element = size_of(e.values.type);
    const detail::ckpt::sharded_payload saved =
        detail::ckpt::parse_sharded(payload, element, "entry '" + e.name + "' of " + file.string());
    if (saved.total != e.total) {
      throw checkpoint_error("checkpoint: sharded entry '" + e.name + "' of " + file.string() +
                             " is a whole of " + std::to_string(saved.total) +
                             " elements, and here of " + std::to_string(e.total));
    }
    auto& covered = recut_[e.name];    // the global intervals of this rank's elements it got
    std::size_t at = saved.values_at;  // the saved range's values in the payload
    for (const auto& [global, count] : saved.ranges) {
      for (const shard_range& mine : e.ranges) {
        const std::uint64_t lo = std::max(global, mine.global);
        const std::uint64_t hi = std::min(global + count, mine.global + mine.count);
        if (lo >= hi) continue;
        std::memcpy(static_cast<char*>(e.values.data) + (mine.local + lo - mine.global) * element,
                    payload.data() + at + (lo - global) * element, (hi - lo) * element);
        covered.emplace_back(lo, hi);
      }
      at += static_cast<std::size_t>(count * element);
    }
  }
  /// After every part is read: each sharded entry got every element this rank holds.
  void check_recut() const {
    for (const entry& e : entries_) {
      if (e.kind != detail::ckpt::entry_kind::sharded) continue;
      std::uint64_t needed = 0;
      for (const shard_range& r : e.ranges) needed += r.count;
      // Saved ranges may overlap (every rank held everything): count each element once.
      std::uint64_t got = 0;
      if (auto it = recut_.find(e.name); it != recut_.end()) {
        auto intervals = it->second;
        std::ranges::sort(intervals);
        std::uint64_t reached = 0;
        for (const auto& [lo, hi] : intervals) {
          const std::uint64_t from = std::max(lo, reached);
          if (hi > from) got += hi - from;
          reached = std::max(reached, hi);
        }
      }
      if (got != needed) {
        throw checkpoint_error("checkpoint: sharded entry '" + e.name +
                               "': the checkpoint's ranks held " + std::to_string(got) +
                               " of the " + std::to_string(needed) + " elements rank " +
                               std::to_string(plane_.rank()) +
                               " holds now (saved with another cut of the same whole?)");
      }
    }
  }

  /// All ranks learn whether every rank could `what`; throws on every rank if not.
  void agree(std::int64_t ok, const std::string& problem, const std::string& what) {
    std::vector<std::int64_t> all(static_cast<std::size_t>(plane_.size()));
    plane_.allgather(std::span<const std::int64_t>(&ok, 1), all);
    std::string failed_ranks;
    for (std::size_t r = 0; r < all.size(); ++r) {
      if (all[r] == 0) failed_ranks += (failed_ranks.empty() ? "" : ", ") + std::to_string(r);
    }
    if (failed_ranks.empty()) return;
    if (!ok) throw checkpoint_error(problem + " (rank " + std::to_string(plane_.rank()) + ")");
    throw checkpoint_error("checkpoint: rank(s) " + failed_ranks + " could not " + what +
                           " (their error says why); nothing was loaded on rank " +
                           std::to_string(plane_.rank()));
  }

  /// Creates `dir` (and its parents); with `fresh`, `dir` itself must not exist yet.
  static void make_directory(const std::filesystem::path& dir, bool fresh) {
    std::error_code ec;
    if (fresh) {
      if (!std::filesystem::create_directory(dir, ec) && !ec) {
        ec = std::make_error_code(std::errc::file_exists);
      }
    } else {
      std::filesystem::create_directories(dir, ec);
    }
    if (ec) {
      throw checkpoint_error("checkpoint: cannot create directory " + dir.string() + ": " +
                             ec.message());
    }
  }
  static void remove_tree(const std::filesystem::path& path) {
    if (const int err = detail::remove_tree(path.c_str()); err != 0) {
      throw checkpoint_error("checkpoint: cannot remove " + path.string() + ": " +
                             std::strerror(err));
    }
  }

  /// Removes what no resume can use any more: committed steps beyond the
  /// newest `keep` up to `newest`, steps numbered after it (left by a run
  /// that this one resumed before), and directories of saves that died. Each
  /// is renamed to NAME.removing at once (so no resume reads it) and removed
  /// by a thread beside the training (joined at the next prune, or at the
  /// end). A failure here is reported, not thrown: the new checkpoint is committed.
  void prune(std::uint64_t newest) {
    if (cleaner_.joinable()) cleaner_.join();
    std::vector<std::uint64_t> kept;
    std::vector<std::filesystem::path> stale;
    std::error_code ec;
    for (std::filesystem::directory_iterator it(options_.dir, ec), end; !ec && it != end;
         it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (auto step = detail::ckpt::step_of(name)) {
        if (*step > newest) {
          stale.push_back(it->path());
        } else {
          kept.push_back(*step);
        }
      } else if (name.ends_with(".replaced") || name.ends_with(".removing")) {
        if (name.starts_with("step-")) stale.push_back(it->path());
      } else if (name.ends_with(detail::ckpt::partial_suffix)) {
        // A save that died; not one in flight (an asynchronous save's next
        // step is being written by the other ranks while this runs).
        const auto of = detail::ckpt::step_of(
            std::string_view(name).substr(0, name.size() - detail::ckpt::partial_suffix.size()));
        if (of && *of <= newest) stale.push_back(it->path());
      }
    }
    std::sort(kept.begin(), kept.end(), std::greater<>());
    for (std::size_t i = static_cast<std::size_t>(options_.keep); i < kept.size(); ++i) {
      stale.push_back(options_.dir / detail::ckpt::step_name(kept[i]));
    }
    std::vector<std::filesystem::path> doomed;
    for (const std::filesystem::path& path : stale) {
      if (path.string().ends_with(".removing")) {
        doomed.push_back(path);
        continue;
      }
      const std::filesystem::path renamed = path.string() + ".removing";
      std::filesystem::rename(path, renamed, ec);
      if (ec) {
        say("could not remove " + path.string() + ": " + ec.message());
      } else {
        doomed.push_back(renamed);
      }
    }
    if (doomed.empty()) return;
    cleaner_ = std::thread([this, doomed = std::move(doomed)] {
      for (const std::filesystem::path& path : doomed) {
        if (const int err = detail::remove_tree(path.c_str()); err != 0) {
          say("could not remove " + path.string() + ": " + std::strerror(err));
        }
      }
    });
  }

  void say(const std::string& line) const {
    if (options_.quiet || !(plane_.rank() == 0)) return;
    std::fprintf(stderr, "dtrain checkpoint: %s\n", line.c_str());
    std::fflush(stderr);
  }

  dtrain::control_plane plane_;
  checkpoint_options options_;
  std::vector<entry> entries_;
  std::int64_t steps_ = 0;
  std::unique_ptr<pending_save> pending_;  // a save not yet committed (asynchronous)
  std::thread cleaner_;                    // removes what prune() renamed
  std::thread committer_;                  // rank 0's commit of an asynchronous save
  checkpoint_timings timings_;
  bool warned_slow_writer_ = false;
  // restore(): the global intervals each sharded entry got, of the elements this rank holds
  std::map<std::string, std::vector<std::pair<std::uint64_t, std::uint64_t>>> recut_;
  std::string commit_failure_;  // what it could not do
};

}  // namespace dtrain
// ---- end dtrain/checkpoint/checkpoint.hpp ----
// ---- end dtrain/checkpoint.hpp ----

#endif  // DTRAIN_SINGLE_INCLUDE_DTRAIN_HPP
