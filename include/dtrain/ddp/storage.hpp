#pragma once
/// @file
/// The flat memory DistributedDataParallel keeps its buckets in, on the host
/// or on a CUDA device, and the few operations it needs on it: zero, copy,
/// and the 16-bit casts of gradient compression.

#include <dtrain/backend/cuda.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/config.hpp>
#include <dtrain/ddp/options.hpp>
#include <dtrain/error.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#if DTRAIN_HAS_CUDA()
#include <cuda_runtime.h>
#endif
#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace dtrain {

namespace detail {

#if DTRAIN_HAS_CUDA()
using compute_stream = cudaStream_t;
#else
using compute_stream = void*;
#endif

[[noreturn]] inline void no_cuda(const char* what) {
  throw config_error(std::string(what) + " is in GPU memory, but dtrain was built without CUDA");
}

/// Zeroed bytes on the host (device < 0) or on a CUDA device; owned.
class flat_storage {
 public:
  flat_storage() = default;
  flat_storage(std::size_t bytes, int device) : bytes_(bytes), device_(device) {
    if (device < 0) {
      host_.reset(
          new std::byte[bytes == 0 ? 1 : bytes]());  // operator new: aligned for any element type
      data_ = host_.get();
      return;
    }
#if DTRAIN_HAS_CUDA()
    device_guard on(device);
    DTRAIN_CUDA_CHECK(cudaMalloc(&data_, bytes == 0 ? 1 : bytes));
    DTRAIN_CUDA_CHECK(cudaMemset(data_, 0, bytes == 0 ? 1 : bytes));
#else
    no_cuda("a gradient bucket");
#endif
  }
  flat_storage(flat_storage&& other) noexcept
      : host_(std::move(other.host_)),
        data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        device_(other.device_) {}
  flat_storage& operator=(flat_storage&& other) noexcept {
    if (this != &other) {
      release();
      host_ = std::move(other.host_);
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      device_ = other.device_;
    }
    return *this;
  }
  flat_storage(const flat_storage&) = delete;
  flat_storage& operator=(const flat_storage&) = delete;
  ~flat_storage() { release(); }

  [[nodiscard]] std::byte* data() const noexcept { return static_cast<std::byte*>(data_); }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] int device() const noexcept { return device_; }

 private:
  void release() noexcept {
#if DTRAIN_HAS_CUDA()
    if (device_ >= 0 && data_) {
      device_guard on(device_, std::nothrow);
      (void)cudaFree(data_);  // waits for the device: no copy from it is left in flight
    }
#endif
    data_ = nullptr;
  }

  std::unique_ptr<std::byte[]> host_;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  int device_ = -1;
};

/// dst = src (bytes), on the host or, for device memory, ordered on `stream`.
inline void copy_bytes(void* dst, const void* src, std::size_t bytes, int device,
                       compute_stream stream) {
  if (dst == src || bytes == 0) return;
  if (device < 0) {
    std::memcpy(dst, src, bytes);
    return;
  }
#if DTRAIN_HAS_CUDA()
  DTRAIN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
#else
  (void)stream;
  no_cuda("a gradient");
#endif
}

inline void zero_bytes(void* dst, std::size_t bytes, int device, compute_stream stream) {
  if (bytes == 0) return;
  if (device < 0) {
    std::memset(dst, 0, bytes);
    return;
  }
#if DTRAIN_HAS_CUDA()
  DTRAIN_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream));
#else
  (void)stream;
  no_cuda("a gradient");
#endif
}

#if defined(__CUDACC__)
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
#endif

/// Whether 16-bit casts of device memory are compiled in: they are CUDA
/// kernels, so only where the including translation unit is built by nvcc.
[[nodiscard]] constexpr bool device_casts_compiled() noexcept {
#if defined(__CUDACC__)
  return true;
#else
  return false;
#endif
}

[[noreturn]] inline void no_device_casts() {
  throw config_error(
      "gradient compression of GPU buckets needs the code that constructs "
      "DistributedDataParallel compiled by nvcc (its casts are CUDA kernels)");
}

/// out[i] = Half(in[i] * scale): the pre-divided 16-bit copy of a float32 bucket.
template <class Half>
void compress(Half* out, const float* in, std::size_t n, float scale, int device,
              compute_stream stream) {
  if (device < 0) {
    for (std::size_t i = 0; i < n; ++i) out[i] = Half(in[i] * scale);
    return;
  }
#if defined(__CUDACC__)
  dtrain_compress_kernel<Half>
      <<<cast_blocks(n), 256, 0, stream>>>(reinterpret_cast<std::uint16_t*>(out), in, n, scale);
  DTRAIN_CUDA_CHECK(cudaGetLastError());
#else
  (void)out, (void)in, (void)n, (void)scale, (void)stream;
  no_device_casts();
#endif
}

/// out[i] = float(in[i]).
template <class Half>
void decompress(float* out, const Half* in, std::size_t n, int device, compute_stream stream) {
  if (device < 0) {
    for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
    return;
  }
#if defined(__CUDACC__)
  dtrain_decompress_kernel<Half>
      <<<cast_blocks(n), 256, 0, stream>>>(out, reinterpret_cast<const std::uint16_t*>(in), n);
  DTRAIN_CUDA_CHECK(cudaGetLastError());
#else
  (void)out, (void)in, (void)n, (void)stream;
  no_device_casts();
#endif
}

/// The element type float32 gradients travel as under `kind` (not none).
[[nodiscard]] constexpr dtype wire_type(gradient_compression kind) noexcept {
  return kind == gradient_compression::float16 ? dtype::float16 : dtype::bfloat16;
}

/// compress() into the 16-bit type `kind` names.
inline void compress(void* out, const float* in, std::size_t n, float scale,
                     gradient_compression kind, int device, compute_stream stream) {
  if (kind == gradient_compression::float16) {
    compress(static_cast<float16*>(out), in, n, scale, device, stream);
  } else {
    compress(static_cast<bfloat16*>(out), in, n, scale, device, stream);
  }
}

/// decompress() from the 16-bit type `kind` names.
inline void decompress(float* out, const void* in, std::size_t n, gradient_compression kind,
                       int device, compute_stream stream) {
  if (kind == gradient_compression::float16) {
    decompress(out, static_cast<const float16*>(in), n, device, stream);
  } else {
    decompress(out, static_cast<const bfloat16*>(in), n, device, stream);
  }
}

}  // namespace detail
}  // namespace dtrain
