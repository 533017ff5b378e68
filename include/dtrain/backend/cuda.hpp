#pragma once
/// @file
/// The CUDA runtime as the NCCL backend uses it: DTRAIN_CUDA_CHECK, and owners
/// of a stream, an event and the current device. Host C++ only (the runtime
/// API, never a kernel), so it builds with g++ and with nvcc alike. Compiles
/// to nothing unless DTRAIN_HAS_CUDA().

#include <dtrain/config.hpp>
#include <dtrain/error.hpp>

#include <cstddef>
#include <map>
#include <mutex>
#include <new>
#include <string>
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

/// "CUDA call `cudaSetDevice(3)` failed: cudaErrorInvalidDevice: invalid device ordinal
/// (cudaError_t 101, at file:line)".
inline std::string cuda_error_text(cudaError_t code, const char* call, const char* file, int line) {
  return std::string("CUDA call `") + call + "` failed: " + cudaGetErrorName(code) + ": " +
         cudaGetErrorString(code) + " (cudaError_t " + std::to_string(static_cast<int>(code)) +
         ", at " + file + ":" + std::to_string(line) + ")";
}

[[noreturn]] inline void throw_cuda_error(cudaError_t code, const char* call, const char* file,
                                          int line) {
  // Clear a non-sticky error, so that the next unrelated call does not report it again.
  (void)cudaGetLastError();
  throw backend_error(cuda_error_text(code, call, file, line), static_cast<int>(code));
}

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

/// An owned CUDA stream, destroyed with its owner. cudaStreamDestroy does not
/// wait: work still queued on the stream completes, then the stream goes.
class cuda_stream {
 public:
  cuda_stream() = default;
  cuda_stream(cuda_stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  cuda_stream& operator=(cuda_stream&& other) noexcept {
    if (this != &other) {
      reset();
      stream_ = std::exchange(other.stream_, nullptr);
    }
    return *this;
  }
  cuda_stream(const cuda_stream&) = delete;
  cuda_stream& operator=(const cuda_stream&) = delete;
  ~cuda_stream() { reset(); }

  /// A stream on the current device that does not synchronise with the legacy
  /// default stream: ordering with the caller's streams is explicit (events).
  [[nodiscard]] static cuda_stream non_blocking() {
    cuda_stream s;
    DTRAIN_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream_, cudaStreamNonBlocking));
    return s;
  }

  [[nodiscard]] cudaStream_t get() const noexcept { return stream_; }
  [[nodiscard]] explicit operator bool() const noexcept { return stream_ != nullptr; }
  /// Gives up ownership.
  [[nodiscard]] cudaStream_t release() noexcept { return std::exchange(stream_, nullptr); }

 private:
  void reset() noexcept {
    if (stream_) (void)cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
};

/// An owned CUDA event without timing (the cheap kind, for ordering and completion).
class cuda_event {
 public:
  cuda_event() = default;
  explicit cuda_event(cudaEvent_t adopted) noexcept : event_(adopted) {}
  cuda_event(cuda_event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  cuda_event& operator=(cuda_event&& other) noexcept {
    if (this != &other) {
      reset();
      event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
  }
  cuda_event(const cuda_event&) = delete;
  cuda_event& operator=(const cuda_event&) = delete;
  ~cuda_event() { reset(); }

  [[nodiscard]] static cuda_event create() {
    cudaEvent_t e = nullptr;
    DTRAIN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return cuda_event(e);
  }

  [[nodiscard]] cudaEvent_t get() const noexcept { return event_; }
  /// Gives up ownership.
  [[nodiscard]] cudaEvent_t release() noexcept { return std::exchange(event_, nullptr); }

 private:
  void reset() noexcept {
    if (event_) (void)cudaEventDestroy(event_);
    event_ = nullptr;
  }
  cudaEvent_t event_ = nullptr;
};

/// Whether this thread has a current CUDA context, asked of the driver
/// (cuCtxGetCurrent, found through the runtime, so nothing links libcuda).
/// The runtime's cudaGetDevice answers 0 on a thread that never used a GPU,
/// and a cudaSetDevice(0) there would create a context on GPU 0 (about half a
/// GiB) for a rank that does not use it. True when the driver cannot say.
[[nodiscard]] inline bool thread_has_cuda_context() noexcept {
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

/// Makes `device` current for a scope, and restores the previous device
/// after it only where this thread had a context: on a fresh thread (a
/// watchdog, a communication thread) the device stays `device`, so that no
/// context is created on a GPU the rank does not use. Switches only when
/// needed (a cudaSetDevice costs more than a cudaGetDevice).
class device_guard {
 public:
  explicit device_guard(int device) {
    DTRAIN_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) {
      const bool restore = thread_has_cuda_context();
      DTRAIN_CUDA_CHECK(cudaSetDevice(device));
      switched_ = restore;
    }
  }
  /// For destructors and other noexcept paths: failures are ignored.
  device_guard(int device, std::nothrow_t) noexcept {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    if (previous_ != device) {
      const bool restore = thread_has_cuda_context();
      switched_ = cudaSetDevice(device) == cudaSuccess && restore;
    }
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() {
    if (switched_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool switched_ = false;
};

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
  ~pinned_pool() {
    for (auto& [bytes, block] : free_) (void)cudaFreeHost(block);
    for (auto& [device, stream] : streams_) {
      device_guard on(device, std::nothrow);
      (void)cudaStreamDestroy(stream);
    }
  }

  /// A block of staging_block_bytes(bytes) (null for 0 bytes); give it back with give().
  /// Call under a device_guard for the device being staged.
  [[nodiscard]] void* take(std::size_t bytes) {
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

  /// Returns a block from take(bytes) for reuse.
  void give(void* block, std::size_t bytes) noexcept {
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

  /// The pool's copy stream on `device` (created on first use, under a guard).
  [[nodiscard]] cudaStream_t copy_stream(int device) {
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

  /// Pinned bytes allocated and not freed: blocks in use and free ones.
  [[nodiscard]] std::size_t held_bytes() const {
    std::lock_guard lock(mutex_);
    return held_;
  }

 private:
  mutable std::mutex mutex_;
  std::multimap<std::size_t, void*> free_;
  std::map<int, cudaStream_t> streams_;
  std::size_t held_ = 0;
};

}  // namespace dtrain::detail

#endif  // DTRAIN_HAS_CUDA()
