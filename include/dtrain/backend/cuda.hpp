#pragma once
/// @file
/// The CUDA runtime as the NCCL backend uses it: DTRAIN_CUDA_CHECK, and owners
/// of a stream, an event and the current device. Host C++ only (the runtime
/// API, never a kernel), so it builds with g++ and with nvcc alike. Compiles
/// to nothing unless DTRAIN_HAS_CUDA().

#include <dtrain/config.hpp>
#include <dtrain/error.hpp>

#include <new>
#include <string>
#include <utility>

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

/// Makes `device` current for a scope and restores the previous one after it.
/// Switches only when needed (a cudaSetDevice costs more than a cudaGetDevice).
class device_guard {
 public:
  explicit device_guard(int device) {
    DTRAIN_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) {
      DTRAIN_CUDA_CHECK(cudaSetDevice(device));
      switched_ = true;
    }
  }
  /// For destructors and other noexcept paths: failures are ignored.
  device_guard(int device, std::nothrow_t) noexcept {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    if (previous_ != device) switched_ = cudaSetDevice(device) == cudaSuccess;
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

}  // namespace dtrain::detail

#endif  // DTRAIN_HAS_CUDA()
