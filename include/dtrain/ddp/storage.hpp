#pragma once
/// @file
/// The flat memory DistributedDataParallel keeps its buckets in, in the
/// memory space of its backend (host_memory, cuda_memory, ...).

#include <dtrain/backend/memory.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/ddp/options.hpp>

#include <concepts>
#include <cstddef>
#include <utility>

namespace dtrain::detail {

/// Zeroed bytes in `Memory` on `device`, owned. Allocation and zeroing are
/// ordered on the stream given at construction, the release on the stream
/// set last (set_stream): the owner keeps that stream ordered after every
/// use on any stream (see DistributedDataParallel::lay_out).
/// flat_storage's request for memory whose pages clear() gives back.
struct droppable_pages_t {};
inline constexpr droppable_pages_t droppable_pages{};

/// Whether `Memory` can give pages back while their addresses stay valid.
template <class Memory>
concept pages_droppable = requires(void* p, std::size_t n) {
  { Memory::allocate_pages(n) } -> std::same_as<void*>;
  Memory::drop_pages(p, n);
  Memory::release_pages(p, n);
};

template <class Memory>
class flat_storage {
 public:
  flat_storage() = default;
  /// Zero bytes whose pages clear() gives back to the system (host memory:
  /// they are resident only while written). Elsewhere as the constructor below.
  flat_storage(std::size_t bytes, int device, typename Memory::stream_type stream,
               droppable_pages_t)
      : bytes_(bytes), device_(device), stream_(stream) {
    if constexpr (pages_droppable<Memory>) {
      data_ = Memory::allocate_pages(bytes);
      pages_ = true;
    } else {
      data_ = Memory::allocate(bytes, device, stream);
      if constexpr (!Memory::on_stream) Memory::zero(data_, bytes, device, stream);
    }
  }
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
        stream_(other.stream_),
        pages_(std::exchange(other.pages_, false)) {}
  flat_storage& operator=(flat_storage&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      device_ = other.device_;
      stream_ = other.stream_;
      pages_ = std::exchange(other.pages_, false);
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
  /// Whether clear() gives the pages back (droppable_pages, where the memory can).
  [[nodiscard]] bool drops_pages() const noexcept { return pages_; }
  /// Every byte zero again, on `stream`: droppable pages are given back
  /// (they read zero, resident again once written), other memory is zeroed.
  void clear(typename Memory::stream_type stream) {
    if constexpr (pages_droppable<Memory>) {
      if (pages_) {
        Memory::drop_pages(data_, bytes_);
        return;
      }
    }
    Memory::zero(data_, bytes_, device_, stream);
  }

 private:
  void release() noexcept {
    if constexpr (pages_droppable<Memory>) {
      if (data_ && pages_) {
        Memory::release_pages(data_, bytes_);
        data_ = nullptr;
        return;
      }
    }
    if (data_) Memory::release(data_, device_, stream_);
    data_ = nullptr;
  }

  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  int device_ = -1;
  typename Memory::stream_type stream_{};
  bool pages_ = false;  // from Memory::allocate_pages
};

/// The element type float32 gradients travel as under `kind` (not none).
[[nodiscard]] constexpr dtype wire_type(gradient_compression kind) noexcept {
  return kind == gradient_compression::float16 ? dtype::float16 : dtype::bfloat16;
}

}  // namespace dtrain::detail
