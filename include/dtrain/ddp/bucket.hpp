#pragma once
/// @file
/// Which gradients travel together: the bucket assignment of
/// DistributedDataParallel, as pure functions of the parameters and the
/// order in which their gradients are expected to become ready.

#include <dtrain/backend/types.hpp>
#include <dtrain/config.hpp>
#include <dtrain/ddp/parameter.hpp>
#include <dtrain/error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace dtrain {

/// One bucket: gradients of one element type on one device, laid out
/// contiguously in `parameters` order and reduced by one collective.
struct bucket_info {
  std::vector<std::size_t> parameters;  ///< indices into the model's parameters(), in layout order
  std::vector<std::size_t>
      offsets;  ///< bytes into the bucket of each (GPU: bucket_alignment apart)
  dtype type = dtype::float32;
  int device = -1;        ///< -1: host memory
  std::size_t count = 0;  ///< elements the collective moves: the slots and the padding between them
  std::size_t bytes = 0;  ///< count x the element size
};

/// Every parameter's slot in a GPU bucket starts on this boundary (bytes):
/// views into the bucket are aligned for vectorised kernels and NCCL's fast
/// paths. The padding between slots is zero and stays zero (its mean is
/// zero); the collective moves it too (bucket_info::count includes it).
inline constexpr std::size_t bucket_alignment = 256;

/// Bytes of a size given in MiB (the unit of bucket_cap_mb), at least 1.
[[nodiscard]] DTRAIN_DETAIL_INLINE std::size_t mib_to_bytes(double mib, std::string_view option);

namespace detail {

/// n-1, n-2, ..., 0: gradients of the last layers are produced first.
[[nodiscard]] DTRAIN_DETAIL_INLINE std::vector<std::size_t> reverse_order(std::size_t n);

/// Throws unless `order` names each of the n parameters exactly once.
DTRAIN_DETAIL_INLINE void check_order(std::span<const std::size_t> order, std::size_t n,
                                      std::string_view what);

/// Groups the parameters, taken in `order` (a permutation of their indices),
/// into buckets per (element type, device), as PyTorch DDP's
/// compute_bucket_assignment_by_size does: each parameter joins its group's
/// open bucket, and the bucket closes as soon as it holds at least its cap
/// (`first_cap` for a group's first bucket, `cap` after). So a bucket closes
/// after the parameter that passes the cap, never before it, and only a
/// group's last bucket may hold less than its cap. Buckets are returned in the
/// order of their first parameter in `order`, which is the launch order.
/// `by_unit` (ZeRO stage 3): a bucket also closes before a parameter of
/// another unit than its last one's (parameter::unit), so that no bucket
/// holds two units.
template <parameter_list Params>
[[nodiscard]] std::vector<bucket_info> assign_buckets(const Params& params,
                                                      std::span<const std::size_t> order,
                                                      std::size_t first_cap, std::size_t cap,
                                                      bool by_unit = false) {
  check_order(order, std::ranges::size(params), "the bucket order");
  struct open_bucket {
    bucket_info bucket;
    std::size_t first_position = 0;
    bool first = true;       // still the group's first bucket
    std::int64_t unit = -1;  // its last parameter's (by_unit)
  };
  std::map<std::pair<int, int>, open_bucket> open;  // (type, device) -> its bucket being filled
  std::vector<std::pair<std::size_t, bucket_info>> closed;  // (position of first parameter, bucket)
  for (std::size_t position = 0; position < order.size(); ++position) {
    const parameter& p = parameter_at(params, order[position]);
    auto [it, fresh] = open.try_emplace({static_cast<int>(p.values.type), p.device});
    open_bucket& b = it->second;
    if (by_unit && !b.bucket.parameters.empty() && b.unit != p.unit) {
      closed.emplace_back(b.first_position, std::move(b.bucket));
      b.bucket = bucket_info{};
      b.first = false;
    }
    b.unit = p.unit;
    if (b.bucket.parameters.empty()) {
      b.bucket.type = p.values.type;
      b.bucket.device = p.device;
      b.first_position = position;
    }
    // GPU slots start on bucket_alignment; host slots are packed.
    const std::size_t align = p.device >= 0 ? bucket_alignment : 1;
    const std::size_t at = (b.bucket.bytes + align - 1) / align * align;
    b.bucket.parameters.push_back(order[position]);
    b.bucket.offsets.push_back(at);
    b.bucket.bytes = at + p.values.bytes();
    b.bucket.count = b.bucket.bytes / size_of(p.values.type);
    if (b.bucket.bytes >= (b.first ? first_cap : cap)) {
      closed.emplace_back(b.first_position, std::move(b.bucket));
      b.bucket = bucket_info{};
      b.first = false;
    }
  }
  for (auto& [key, b] : open) {
    if (!b.bucket.parameters.empty()) closed.emplace_back(b.first_position, std::move(b.bucket));
  }
  std::ranges::sort(closed, {}, &std::pair<std::size_t, bucket_info>::first);
  std::vector<bucket_info> buckets;
  buckets.reserve(closed.size());
  for (auto& [position, b] : closed) buckets.push_back(std::move(b));
  return buckets;
}

}  // namespace detail
}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/ddp/bucket-inl.hpp>
#endif
