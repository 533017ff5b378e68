#pragma once
/// @file
/// The non-template bodies of dtrain/backend/cuda.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/backend/cuda.hpp, not this file.

#include <dtrain/backend/cuda.hpp>

#if DTRAIN_HAS_CUDA()
namespace dtrain::detail {

DTRAIN_DETAIL_INLINE std::string call_as_written(std::string_view call) {
  if (call.starts_with("Api::")) call.remove_prefix(5);
  return std::string(call);
}

DTRAIN_DETAIL_INLINE std::string cuda_error_text(cudaError_t code, const char* call,
                                                 const char* file, int line) {
  return "CUDA call `" + call_as_written(call) + "` failed: " + cudaGetErrorName(code) + ": " +
         cudaGetErrorString(code) + " (cudaError_t " + std::to_string(static_cast<int>(code)) +
         ", at " + file + ":" + std::to_string(line) + ")";
}

DTRAIN_DETAIL_INLINE void throw_cuda_error(cudaError_t code, const char* call, const char* file,
                                           int line) {
  // Clear a non-sticky error, so that the next unrelated call does not report it again.
  (void)cudaGetLastError();
  throw backend_error(cuda_error_text(code, call, file, line), static_cast<int>(code));
}

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

}  // namespace dtrain::detail
#endif
