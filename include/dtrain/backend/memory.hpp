#pragma once
/// @file
/// Memory spaces: where a backend's data lives and the few operations
/// DistributedDataParallel needs there (allocate zeroed, free, copy, zero, the
/// 16-bit casts of gradient compression, and waiting for a stream). `host_memory`
/// is plain memory handled on the calling thread; `cuda_memory` is one CUDA
/// device, every operation ordered on a stream. A backend names its space in
/// its backend_traits, so the algorithm that uses them reads the same for all.

#include <dtrain/backend/cuda.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/config.hpp>
#include <dtrain/detail/sys.hpp>
#include <dtrain/error.hpp>

#include <sys/mman.h>

#include <atomic>
#include <cerrno>
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
    "the 16-bit casts of GPU memory (gradient compression, ddp_options::master_weights) need "
    "CUDA kernels, "
    "and no translation unit of this program was compiled by nvcc: "
    "include <dtrain/dtrain.hpp> in at least one .cu file that is linked into the program "
    "(any one: the kernels are shared)";

/// The 16-bit casts as plain loops: out[i] = Half(in[i] * scale), and back.
DTRAIN_DETAIL_INLINE void host_compress(void* out, const float* in, std::size_t n, float scale,
                                        dtype wire);
DTRAIN_DETAIL_INLINE void host_decompress(float* out, const void* in, std::size_t n, dtype wire);

/// The float32 sum of a reduction with float32 accumulation: out[j] =
/// Out(acc_j / divisor), acc_j = float(in[j]) + float(in[count + j]) + ...
/// over `blocks` blocks of `count` elements, added in block order in float32;
/// `in` and `out` float32, float16 or bfloat16 (one rounding to Out, none
/// for float32). `out` may be `in`'s first block (each element is read
/// before it is written).
DTRAIN_DETAIL_INLINE void host_accumulate(void* out, dtype out_type, const void* in, dtype in_type,
                                          std::size_t blocks, std::size_t count, float divisor);

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
  /// Memory whose pages can be given back to the system while its addresses
  /// stay valid: whole pages mapped for `bytes`, zero, and resident only once
  /// written. backend_error when the system refuses the mapping (its code is
  /// errno): the memory is short, not the options wrong.
  [[nodiscard]] static void* allocate_pages(std::size_t bytes) {
    void* data = ::mmap(nullptr, bytes == 0 ? 1 : bytes, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data == MAP_FAILED) {
      const int err = errno;
      throw backend_error(detail::os_error_text("mmap(" + std::to_string(bytes) +
                                                    " bytes of gradient memory, anonymous)",
                                                err, __FILE__, __LINE__),
                          err);
    }
#ifdef MADV_HUGEPAGE
    // Huge pages where the system offers them: one fault per 2 MiB written.
    if (bytes >= (std::size_t{2} << 20)) static_cast<void>(::madvise(data, bytes, MADV_HUGEPAGE));
#endif
    return data;
  }
  /// Gives the pages of [data, data + bytes) back (memory from allocate_pages):
  /// they read zero and hold no memory until written again.
  static void drop_pages(void* data, std::size_t bytes) noexcept {
    if (bytes && ::madvise(data, bytes, MADV_DONTNEED) != 0) std::memset(data, 0, bytes);
  }
  static void release_pages(void* data, std::size_t bytes) noexcept {
    ::munmap(data, bytes == 0 ? 1 : bytes);
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
  /// detail::host_accumulate: `blocks` blocks summed in float32, in order, into `out`.
  static void accumulate(void* out, dtype out_type, const void* in, dtype in_type,
                         std::size_t blocks, std::size_t count, float divisor, int /*device*/,
                         stream_type) {
    detail::host_accumulate(out, out_type, in, in_type, blocks, count, divisor);
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
  /// out[i] = Half(float(in[i]) / divisor), 16-bit `type` (in place or not):
  /// the NCCL engine's average of 16-bit data (each element divided, then summed).
  void (*divide)(void* out, const void* in, std::size_t n, dtype type, float divisor,
                 cudaStream_t stream);
  /// detail::host_accumulate's sum on the device (the same bits).
  void (*accumulate)(void* out, dtype out_type, const void* in, dtype in_type, std::size_t blocks,
                     std::size_t count, float divisor, cudaStream_t stream);
};

[[nodiscard]] DTRAIN_DETAIL_INLINE std::atomic<const device_casts*>& device_casts_slot() noexcept;

/// The registered kernels; config_error when no unit of the program was built by nvcc.
[[nodiscard]] DTRAIN_DETAIL_INLINE const device_casts& registered_device_casts();

}  // namespace detail

/// One CUDA device; every operation is ordered on `stream` (the compute
/// stream) and runs with the device current, so that no other thread's
/// device and no other device's context is touched.
struct cuda_memory {
  using stream_type = cudaStream_t;
  static constexpr memory where = memory::device;
  /// Buckets travel on CUDA streams, ordered by events; the host does not wait.
  static constexpr bool on_stream = true;
  /// The timeline's device time (timing events; a stream that waits for collectives).
  using device_timer = detail::device_timer;

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
  /// detail::host_accumulate as a kernel on `stream`.
  static void accumulate(void* out, dtype out_type, const void* in, dtype in_type,
                         std::size_t blocks, std::size_t count, float divisor, int device,
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
template <class Half>
__global__ void dtrain_divide_kernel(std::uint16_t* out, const std::uint16_t* in, std::size_t n,
                                     float divisor) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    out[i] = dtrain_to_half_bits<Half>(dtrain_from_half_bits<Half>(in[i]) / divisor);
  }
}
// An element of a float32, float16 or bfloat16 array as float32, and back (rounded once).
__device__ inline float dtrain_load_float(const void* p, std::size_t i, dtype t) {
  if (t == dtype::float32) return static_cast<const float*>(p)[i];
  const std::uint16_t b = static_cast<const std::uint16_t*>(p)[i];
  return t == dtype::bfloat16 ? dtrain_from_half_bits<bfloat16>(b)
                              : dtrain_from_half_bits<float16>(b);
}
__device__ inline void dtrain_store_float(void* p, std::size_t i, dtype t, float x) {
  if (t == dtype::float32) {
    static_cast<float*>(p)[i] = x;
  } else {
    static_cast<std::uint16_t*>(p)[i] =
        t == dtype::bfloat16 ? dtrain_to_half_bits<bfloat16>(x) : dtrain_to_half_bits<float16>(x);
  }
}
// A template (as the other kernels), so that every nvcc unit that includes
// this header may define it: one kernel, whatever the number of .cu files.
template <int = 0>
__global__ void dtrain_accumulate_kernel(void* out, dtype out_type, const void* in, dtype in_type,
                                         std::size_t blocks, std::size_t count, float divisor) {
  for (std::size_t j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; j < count;
       j += static_cast<std::size_t>(blockDim.x) * gridDim.x) {
    float acc = dtrain_load_float(in, j, in_type);
    for (std::size_t i = 1; i < blocks; ++i)
      acc = __fadd_rn(acc, dtrain_load_float(in, i * count + j, in_type));
    dtrain_store_float(out, j, out_type, __fdiv_rn(acc, divisor));
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
inline void launch_divide(void* out, const void* in, std::size_t n, dtype type, float divisor,
                          cudaStream_t stream) {
  if (n == 0) return;
  auto* o = static_cast<std::uint16_t*>(out);
  const auto* i16 = static_cast<const std::uint16_t*>(in);
  if (type == dtype::bfloat16)
    dtrain_divide_kernel<bfloat16><<<cast_blocks(n), 256, 0, stream>>>(o, i16, n, divisor);
  else
    dtrain_divide_kernel<float16><<<cast_blocks(n), 256, 0, stream>>>(o, i16, n, divisor);
  DTRAIN_CUDA_CHECK(cudaGetLastError());
}
inline void launch_accumulate(void* out, dtype out_type, const void* in, dtype in_type,
                              std::size_t blocks, std::size_t count, float divisor,
                              cudaStream_t stream) {
  if (count == 0) return;
  dtrain_accumulate_kernel<0>
      <<<cast_blocks(count), 256, 0, stream>>>(out, out_type, in, in_type, blocks, count, divisor);
  DTRAIN_CUDA_CHECK(cudaGetLastError());
}
inline constexpr device_casts nvcc_device_casts{&launch_compress, &launch_decompress,
                                                &launch_divide, &launch_accumulate};
/// Registers the kernels at start-up in every program with an nvcc unit.
inline const bool nvcc_device_casts_registered =
    (device_casts_slot().store(&nvcc_device_casts, std::memory_order_release), true);
#endif

}  // inline namespace nvcc / host_compiler

/// Whether the program can cast GPU buckets (some unit was built by nvcc).
[[nodiscard]] DTRAIN_DETAIL_INLINE bool device_casts_available() noexcept;

}  // namespace detail

#if DTRAIN_HAS_CUDA()
inline bool cuda_memory::casts_available() noexcept { return detail::device_casts_available(); }
#endif
}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/backend/memory-inl.hpp>
#endif
