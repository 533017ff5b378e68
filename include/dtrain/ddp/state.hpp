#pragma once
/// @file
/// What DistributedDataParallel keeps per parameter and per bucket, each in
/// one struct (c10d's Reducer: VariableIndex and Bucket): where a gradient
/// sits in its bucket, and what the current step has done with it.

#include <dtrain/ddp/bucket.hpp>
#include <dtrain/ddp/parameter.hpp>
#include <dtrain/ddp/storage.hpp>

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
  /// The scratch of a reduction with float32 accumulation (ddp_options::accumulate).
  flat_storage<Memory> accumulate;
  // What a sharding stage keeps per bucket is the sharding part's
  // (detail::bucket_shard, ddp/sharding.hpp).
  std::size_t moved = 0;    ///< elements the collective moves: the slots, padded to the topology
  std::size_t pending = 0;  ///< its parameters not yet marked in this step
  bool ready = false;       ///< every parameter marked: may be launched in its turn
  std::uint64_t span = 0;   ///< its timeline span, from launch to completion
  std::int64_t span_reduce = 0;  ///< when its reduction started (timeline on)
  bool span_on_device = false;   ///< its span ends with its device time (ddp/device_spans.hpp)
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
