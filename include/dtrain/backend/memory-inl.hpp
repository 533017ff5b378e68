#pragma once
/// @file
/// The non-template bodies of dtrain/backend/memory.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/backend/memory.hpp, not this file.

#include <dtrain/backend/memory.hpp>

namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE void host_compress(void* out, const float* in, std::size_t n, float scale,
                                        dtype wire) {
  visit(wire, [&]<class Half>() {
    if constexpr (std::same_as<Half, float16> || std::same_as<Half, bfloat16>) {
      auto* o = static_cast<Half*>(out);
      for (std::size_t i = 0; i < n; ++i) o[i] = Half(in[i] * scale);
    }
  });
}

DTRAIN_DETAIL_INLINE void host_decompress(float* out, const void* in, std::size_t n, dtype wire) {
  visit(wire, [&]<class Half>() {
    if constexpr (std::same_as<Half, float16> || std::same_as<Half, bfloat16>) {
      const auto* i16 = static_cast<const Half*>(in);
      for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(i16[i]);
    }
  });
}

DTRAIN_DETAIL_INLINE void host_accumulate(void* out, dtype out_type, const void* in, dtype in_type,
                                          std::size_t blocks, std::size_t count, float divisor) {
  const auto load = [&](std::size_t i) -> float {
    switch (in_type) {
      case dtype::bfloat16: return static_cast<float>(static_cast<const bfloat16*>(in)[i]);
      case dtype::float16: return static_cast<float>(static_cast<const float16*>(in)[i]);
      default: return static_cast<const float*>(in)[i];
    }
  };
  // Each partial sum a float32, in block order (no reassociation: not -ffast-math).
  for (std::size_t j = 0; j < count; ++j) {
    float acc = load(j);
    for (std::size_t i = 1; i < blocks; ++i) acc = acc + load(i * count + j);
    const float mean = acc / divisor;
    switch (out_type) {
      case dtype::bfloat16: static_cast<bfloat16*>(out)[j] = bfloat16(mean); break;
      case dtype::float16: static_cast<float16*>(out)[j] = float16(mean); break;
      default: static_cast<float*>(out)[j] = mean; break;
    }
  }
}
}  // namespace detail
}  // namespace dtrain

#if DTRAIN_HAS_CUDA()
namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE std::atomic<const device_casts*>& device_casts_slot() noexcept {
  static std::atomic<const device_casts*> slot{nullptr};
  return slot;
}

DTRAIN_DETAIL_INLINE const device_casts& registered_device_casts() {
  if (const device_casts* casts = device_casts_slot().load(std::memory_order_acquire))
    return *casts;
  throw config_error(std::string(device_casts_missing));
}
}  // namespace detail
}  // namespace dtrain
#endif

#if DTRAIN_HAS_CUDA()
namespace dtrain {

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

DTRAIN_DETAIL_INLINE void cuda_memory::accumulate(void* out, dtype out_type, const void* in,
                                                  dtype in_type, std::size_t blocks,
                                                  std::size_t count, float divisor, int device,
                                                  stream_type stream) {
  const detail::device_casts& casts = detail::registered_device_casts();
  detail::device_guard on(device);
  casts.accumulate(out, out_type, in, in_type, blocks, count, divisor, stream);
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
        "DistributedDataParallel: the compute stream is being captured into a CUDA graph; "
        "DDP records events, "
        "polls them from the host and launches NCCL work that must not be replayed, "
        "so run the DDP step outside the capture (capture the forward and backward only)");
  }
}
}  // namespace dtrain
#endif

namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE bool device_casts_available() noexcept {
#if DTRAIN_HAS_CUDA()
  return device_casts_slot().load(std::memory_order_acquire) != nullptr;
#else
  return false;
#endif
}

}  // namespace detail
}  // namespace dtrain
