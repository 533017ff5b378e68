#pragma once
/// @file
/// What every rank must agree on before DistributedDataParallel averages
/// anything: the same parameters (names, counts, types) in the same order,
/// and rank 0's values of them.

#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/config.hpp>
#include <dtrain/control/plane.hpp>
#include <dtrain/ddp/bucket.hpp>
#include <dtrain/ddp/options.hpp>
#include <dtrain/ddp/parameter.hpp>
#include <dtrain/detail/wire.hpp>
#include <dtrain/error.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace dtrain::detail {

/// "parameter fc1.weight (1024 x float32 on the host)", or with a shape
/// "parameter fc1.weight ([64, 16] float32 on the host)": what must match across ranks.
DTRAIN_DETAIL_INLINE std::string parameter_entry(const parameter& p, std::string_view kind);

DTRAIN_DETAIL_INLINE std::vector<std::string> model_entries(std::span<const parameter> params,
                                                            std::span<const parameter> buffers);

DTRAIN_DETAIL_INLINE std::int64_t fnv1a(const std::vector<std::string>& entries);

/// What one rank alone can find wrong with its model and options, as a
/// message naming the parameter and the rank; empty when nothing is.
DTRAIN_DETAIL_INLINE std::string model_problem(std::span<const parameter> params,
                                               std::span<const parameter> buffers,
                                               const ddp_options& options, int rank,
                                               std::string_view backend, bool on_device,
                                               int device);

/// Collective over the host control plane: every rank learns whether all
/// ranks hold the same parameters and buffers. Throws config_error on every
/// rank when not, naming the first differing entry and the ranks. Each
/// rank's own check (model_problem) comes before, in a verdict
/// (agree_or_throw). `settings`, when given, is one more entry that must match
/// (DDP's options that change what travels: "ddp_options::sharding = gradients").
DTRAIN_DETAIL_INLINE void agree_on_model(control_plane& comm, std::span<const parameter> params,
                                         std::span<const parameter> buffers,
                                         std::string_view settings = {});

/// Collective over the host control plane: every rank gets rank 0's `order`
/// of the n parameters (the order its gradients became ready, for the bucket
/// rebuild). Each rank passes an order of the same length; what arrives is
/// checked to name each parameter once (backend_error otherwise).
DTRAIN_DETAIL_INLINE std::vector<std::size_t> agree_on_order(control_plane& control,
                                                             std::span<const std::size_t> order,
                                                             std::size_t n);

/// broadcast_values' scratch by default: the host values travel in windows of this many bytes.
inline constexpr std::size_t broadcast_window_bytes = std::size_t{64} << 20;

/// Collective: every rank's parameter and buffer values become rank 0's.
/// Host values travel packed over the control plane, a window at a time;
/// device values one by one through `device_broadcast(buffer)`, which returns
/// once the broadcast is complete (the device engine: the only device
/// traffic besides the buckets).
template <class DeviceBroadcast>
void broadcast_values(control_plane& control, std::span<const parameter> params,
                      std::span<const parameter> buffers, DeviceBroadcast&& device_broadcast,
                      std::size_t window = broadcast_window_bytes) {
  std::vector<const parameter*> host, device;
  for (auto list : {params, buffers}) {
    for (const parameter& p : list) {
      if (!p.values.data) continue;  // stage 3's deferred values: written through shard()
      (p.values.where == memory::host ? host : device).push_back(&p);
    }
  }
  std::size_t total = 0;
  for (const parameter* p : host) total += p->bytes();
  // The host values as one stream of bytes, broadcast a window at a time:
  // a model's worth of scratch would double its memory at construction.
  std::vector<std::uint8_t> packed(std::min(total, std::max<std::size_t>(window, 1)));
  for (std::size_t begin = 0; begin < total; begin += packed.size()) {
    const std::size_t end = std::min(total, begin + packed.size());
    // Copies bytes [begin, end) of the stream between the parameters and `packed`.
    auto move_window = [&](bool into_packed) {
      std::size_t at = 0;  // the parameter's first byte in the stream
      for (const parameter* p : host) {
        const std::size_t lo = std::max(begin, at), hi = std::min(end, at + p->bytes());
        if (lo < hi) {
          auto* mine = static_cast<std::uint8_t*>(p->values.data) + (lo - at);
          std::uint8_t* theirs = packed.data() + (lo - begin);
          if (into_packed) {
            std::memcpy(theirs, mine, hi - lo);
          } else {
            std::memcpy(mine, theirs, hi - lo);
          }
        }
        at += p->bytes();
        if (at >= end) break;
      }
    };
    move_window(true);
    control.broadcast(std::span<std::uint8_t>(packed.data(), end - begin), 0);
    move_window(false);
  }
  for (const parameter* p : device) {
    if (p->values.count > 0) device_broadcast(p->values);
  }
}

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/ddp/agreement-inl.hpp>
#endif
