#pragma once
/// @file
/// The flat memory DistributedDataParallel keeps its buckets in, in the
/// memory space of its backend (host_memory, cuda_memory, ...).

#include <dtrain/backend/memory.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/ddp/options.hpp>

#include <cstddef>
#include <utility>

namespace dtrain::detail {

/// Zeroed bytes in `Memory` on `device`, owned. Zeroing is ordered on the
/// stream given at construction; the owner frees it only after its last use
/// on any stream is complete (see DistributedDataParallel::lay_out).
template <class Memory>
class flat_storage {
 public:
  flat_storage() = default;
  flat_storage(std::size_t bytes, int device, typename Memory::stream_type stream)
      : data_(Memory::allocate(bytes, device, stream)), bytes_(bytes), device_(device) {
    if constexpr (!Memory::on_stream) Memory::zero(data_, bytes, device, stream);
  }
  flat_storage(flat_storage&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        device_(other.device_) {}
  flat_storage& operator=(flat_storage&& other) noexcept {
    if (this != &other) {
      release();
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
    if (data_) Memory::release(data_, device_);
    data_ = nullptr;
  }

  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  int device_ = -1;
};

/// The element type float32 gradients travel as under `kind` (not none).
[[nodiscard]] constexpr dtype wire_type(gradient_compression kind) noexcept {
  return kind == gradient_compression::float16 ? dtype::float16 : dtype::bfloat16;
}

}  // namespace dtrain::detail
