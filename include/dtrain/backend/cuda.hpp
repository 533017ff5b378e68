#pragma once
/// @file
/// The CUDA runtime as the NCCL backend uses it: DTRAIN_CUDA_CHECK, and owners
/// of a stream, an event and the current device. Host C++ only (the runtime
/// API, never a kernel), so it builds with g++ and with nvcc alike. Compiles
/// to nothing unless DTRAIN_HAS_CUDA().

#include <dtrain/config.hpp>
#include <dtrain/error.hpp>

#include <cstddef>
#include <cstdio>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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

/// "CUDA call `cudaSetDevice(3)` failed: cudaErrorInvalidDevice: invalid device ordinal
/// (cudaError_t 101, at file:line)".
DTRAIN_DETAIL_INLINE std::string cuda_error_text(cudaError_t code, const char* call,
                                                 const char* file, int line);

[[noreturn]] DTRAIN_DETAIL_INLINE void throw_cuda_error(cudaError_t code, const char* call,
                                                        const char* file, int line);

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
  static cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
    return ::cudaEventElapsedTime(ms, start, end);
  }
  static cudaError_t cudaMalloc(void** data, std::size_t bytes) {
    return ::cudaMalloc(data, bytes);
  }
  static cudaError_t cudaFree(void* data) { return ::cudaFree(data); }
  static cudaError_t cudaMallocHost(void** data, std::size_t bytes) {
    return ::cudaMallocHost(data, bytes);
  }
  static cudaError_t cudaFreeHost(void* data) { return ::cudaFreeHost(data); }
  /// Stream-ordered: unlike cudaFree, does not wait for the whole device.
  static cudaError_t cudaFreeAsync(void* data, cudaStream_t stream) {
    return ::cudaFreeAsync(data, stream);
  }
  static cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes,
                                     cudaMemcpyKind kind, cudaStream_t stream) {
    return ::cudaMemcpyAsync(dst, src, bytes, kind, stream);
  }
};

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

/// Device time for DistributedDataParallel's timeline (DTRAIN_TIMELINE):
/// timing events, recorded on the caller's streams or on a stream of the
/// timer's own that waits for a collective's completion event (so that the
/// completion is timed without the compute stream waiting for it). Events are
/// pooled; every call runs with `device` current. For one thread (the one that
/// enqueues DDP's buckets).
template <class Api = cuda_library>
class basic_device_timer {
 public:
  using stream_type = cudaStream_t;
  using event = cudaEvent_t;

  explicit basic_device_timer(int device) : device_(device) {
    basic_device_guard<Api> guard(device_);
    stream_ = basic_cuda_stream<Api>::non_blocking();
  }
  basic_device_timer(const basic_device_timer&) = delete;
  basic_device_timer& operator=(const basic_device_timer&) = delete;
  /// Events still out (not given back) are the caller's to release first.
  ~basic_device_timer() {
    basic_device_guard<Api> guard(device_, std::nothrow);
    for (event e : free_) (void)Api::cudaEventDestroy(e);
  }

  /// The timer's own stream, for work::stream_wait().
  [[nodiscard]] stream_type stream() const noexcept { return stream_.get(); }

  /// A timing event recorded on `on` now: the device reaches it once
  /// everything enqueued there before it is done.
  [[nodiscard]] event record(stream_type on) {
    basic_device_guard<Api> guard(device_);
    event e = nullptr;
    if (free_.empty()) {
      DTRAIN_CUDA_CHECK(Api::cudaEventCreateWithFlags(&e, cudaEventDefault));
    } else {
      e = free_.back();
      free_.pop_back();
    }
    const cudaError_t status = Api::cudaEventRecord(e, on);
    if (status != cudaSuccess) {
      free_.push_back(e);
      throw_cuda_error(status, "cudaEventRecord(event, stream)", __FILE__, __LINE__);
    }
    return e;
  }
  /// Whether the device reached `e` (never blocks).
  [[nodiscard]] bool reached(event e) {
    basic_device_guard<Api> guard(device_);
    const cudaError_t status = Api::cudaEventQuery(e);
    if (status == cudaErrorNotReady) return false;
    if (status != cudaSuccess)
      throw_cuda_error(status, "cudaEventQuery(event)", __FILE__, __LINE__);
    return true;
  }
  /// Nanoseconds on the device's clock from `from` to `to`, both reached
  /// (about 0.5 us resolution; negative when `to` came first).
  [[nodiscard]] double elapsed_ns(event from, event to) {
    basic_device_guard<Api> guard(device_);
    float ms = 0;
    DTRAIN_CUDA_CHECK(Api::cudaEventElapsedTime(&ms, from, to));
    return static_cast<double>(ms) * 1e6;
  }
  /// Gives `e` back to the pool.
  void release(event e) noexcept {
    if (e) free_.push_back(e);
  }

 private:
  int device_;
  basic_cuda_stream<Api> stream_;
  std::vector<event> free_;
};
using device_timer = basic_device_timer<>;

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

}  // namespace dtrain::detail

#endif  // DTRAIN_HAS_CUDA()

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/backend/cuda-inl.hpp>
#endif
