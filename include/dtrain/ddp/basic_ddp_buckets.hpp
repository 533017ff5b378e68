#pragma once
/// @file
/// basic_ddp's buckets: how the gradients are laid out in them (and laid out
/// again at the rebuild), and each bucket's journey once its turn comes:
/// launched in order, prepared (copy-in, compression), reduced by the
/// topology or the user's hook, finished (decompression, copy-out), by the
/// runner of the memory space (ddp/runner.hpp). Out-of-class members of
/// basic_ddp (see ddp/basic_ddp.hpp for why out of class).

#include <dtrain/ddp/basic_ddp.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

namespace dtrain {

template <class Policy>
std::vector<bucket_info> basic_ddp<Policy>::buckets() const {
  std::vector<bucket_info> out;
  out.reserve(buckets_.size());
  for (const bucket& b : buckets_) out.push_back(b.info);
  return out;
}

/// Lays the gradients out in buckets filled in `order`, moving each
/// bucket-view gradient (and its values) to its new place. The old buckets
/// are freed only once the copies out of them are complete.
template <class Policy>
void basic_ddp<Policy>::lay_out(std::span<const std::size_t> order) {
  std::vector<bucket_info> layout = detail::assign_buckets(
      parameters(), order, mib_to_bytes(options_.first_bucket_cap_mb, "first_bucket_cap_mb"),
      mib_to_bytes(options_.bucket_cap_mb, "bucket_cap_mb"), shards_.buckets_by_unit());
  std::vector<bucket> buckets(layout.size());
  for (std::size_t b = 0; b < layout.size(); ++b) {
    bucket& s = buckets[b];
    s.info = std::move(layout[b]);
    const bucket_info& info = s.info;
    // A hierarchical topology splits a bucket into equal shards, one per
    // rank of a node: zeros at the end make the count divide (GPU: every
    // shard on bucket_alignment too). The padding stays zero.
    std::size_t unit = topo_.granularity();
    if (unit > 1 && info.device >= 0) unit *= bucket_alignment / size_of(info.type);
    // Float32 accumulation exchanges size() equal parts.
    if (accumulated(info)) unit = std::lcm(unit, static_cast<std::size_t>(size_));
    unit = shards_.padding(info, unit);  // sharded: size() equal shards
    s.moved = (info.count + unit - 1) / unit * unit;
    try {
      s.grads = shards_.gradient_storage(s.moved * size_of(info.type), info.device);
    } catch (const backend_error& e) {
      throw backend_error("DistributedDataParallel on rank " + std::to_string(rank_) +
                              ": the gradients of bucket " + std::to_string(b) + ": " + e.what(),
                          e.engine_code());
    }
    if (compressed(info))
      s.wire = detail::flat_storage<memory_space>(
          s.moved * size_of(detail::wire_type(options_.compression)), info.device, stream_);
    if (accumulated(info)) {
      s.accumulate = detail::flat_storage<memory_space>(
          topo_.accumulate_scratch_bytes(s.moved, wire_type(info)), info.device, stream_);
    }
    if (const std::size_t shard = topo_.shard_count(s.moved); shard > 0)  // also the allgathers'
      s.shard =
          detail::flat_storage<memory_space>(shard * size_of(info.type), info.device, stream_);
    for (std::size_t k = 0; k < info.parameters.size(); ++k) {
      variable& v = vars_[info.parameters[k]];
      parameter& p = v.param;
      v.bucket = b;
      v.offset = info.offsets[k];
      v.view = options_.gradient_as_bucket_view && p.rebindable();
      if (v.view) {
        void* place = s.grads.data() + v.offset;
        if (p.gradient) memory_space::copy(place, p.gradient, p.bytes(), p.device, stream_);
        p.gradient = place;
        p.rebind(p.gradient_slot, place);
      }
    }
  }
  // The old buckets are released on the compute stream, after the copies
  // out of them and (streams) after every collective on them: the compute
  // stream waits for those already (order_after_buckets). The host does not
  // wait, with CUDA as without.
  buckets_ = std::move(buckets);
  shards_.laid_out();
  reset_step();
}

/// Launches, in bucket order, every bucket whose turn it is and is ready.
template <class Policy>
void basic_ddp<Policy>::launch_ready() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].ready) {
    const std::size_t b = next_launch_++;
    try {
      buckets_[b].span = timeline_.bucket_launched(b, buckets_[b].info.count);
      if (sends_nothing()) {
        finish_alone(b);
      } else {
        runner_->launch(b, !in_bulk_);
      }
    } catch (...) {
      fail(std::current_exception());
    }
  }
}

/// World size 1: the bucket's mean is its gradients. Only compression has
/// something to do (round through the wire type, as on more ranks), on the
/// caller's thread or the compute stream; the timeline still sees the bucket.
template <class Policy>
void basic_ddp<Policy>::finish_alone(std::size_t b) {
  if (compressed(buckets_[b].info)) {
    prepare_bucket(b);
    finish_bucket(b);
  } else if (timeline_.on()) {
    timeline_.bucket_done(b, buckets_[b].span, detail::timeline::now(), false);
  }
}

template <class Policy>
void basic_ddp<Policy>::zero_contribution(std::size_t i) {
  variable& v = vars_[i];
  parameter& p = v.param;
  if (v.view || (sends_nothing() && !compressed(buckets_[v.bucket].info))) {
    // World size 1 leaves a copy-mode gradient where it is: zero it there.
    memory_space::zero(p.gradient, p.bytes(), p.device, stream_);
  } else {
    // Copy-mode: the bucket's slice is what travels; the model's buffer gets the mean after.
    memory_space::zero(buckets_[v.bucket].grads.data() + v.offset, p.bytes(), p.device, stream_);
    v.zeroed = true;
  }
}

/// Copy-in and compression: what must happen before the collective.
template <class Policy>
void basic_ddp<Policy>::prepare_bucket(std::size_t b) {
  bucket& s = buckets_[b];
  if (timeline_.on()) s.span_reduce = detail::timeline::now();
  // Streams: the gradients are ready on the compute stream from here.
  if (!sends_nothing()) device_spans_.begin(b, stream_);
  for (std::size_t i : s.info.parameters) {
    const variable& v = vars_[i];
    if (v.view || v.zeroed) continue;
    memory_space::copy(s.grads.data() + v.offset, v.param.gradient, v.param.bytes(), s.info.device,
                       stream_);
  }
  if (!compressed(s.info)) return;
  // Pre-divide, so that the 16-bit sum is the mean and cannot overflow; a
  // float32 accumulation divides its sum instead.
  const float scale = accumulated(s.info) ? 1.0f : 1.0f / static_cast<float>(size_);
  memory_space::compress(s.wire.data(), reinterpret_cast<const float*>(s.grads.data()),
                         s.info.count, scale, detail::wire_type(options_.compression),
                         s.info.device, stream_);
}

/// The collective of bucket b (or the user's hook), ordered after the compute stream.
template <class Policy>
work basic_ddp<Policy>::reduce(std::size_t b) {
  detail::label_scope label("bucket",
                            static_cast<std::int64_t>(b));  // names it in desync diagnostics
  bucket& s = buckets_[b];
  buffer data{s.grads.data(), s.moved, s.info.type, memory_space::where, s.grads.device()};
  reduce_op op = reduce_op::avg;
  if (compressed(s.info)) {
    data = {s.wire.data(), s.moved, detail::wire_type(options_.compression), memory_space::where,
            s.grads.device()};
    if (!accumulated(s.info)) op = reduce_op::sum;  // pre-divided
  }
  if (hook_) {
    gradient_bucket view{.index = b,
                         .data = data,
                         .world_size = size_,
                         .parameters = s.info.parameters,
                         .stream = stream_};
    view.data.count = s.info.count;  // the hook sees the slots, not the topology's padding
    return hook_(comm_, view);
  }
  if (accumulated(s.info)) {
    const buffer scratch{s.accumulate.data(), s.accumulate.bytes(), dtype::uint8,
                         memory_space::where, s.grads.device()};
    const detail::accumulate_sum sum = accumulate_sum();
    return shards_.reduce(b, data, scratch, op, &sum);  // the seam, summed in float32
  }
  const buffer scratch{s.shard.data(), topo_.shard_count(s.moved), data.type, memory_space::where,
                       s.grads.device()};
  return shards_.reduce(b, data, scratch, op, nullptr);  // the seam: averaged, or reduce-scattered
}

/// Decompression and copy-out: what must happen after the collective.
template <class Policy>
void basic_ddp<Policy>::finish_bucket(std::size_t b) {
  bucket& s = buckets_[b];
  // Stage 2 averaged only this rank's shard (shard() has it): the model's
  // own gradients keep what this rank computed.
  const bool whole = shards_.mean_is_whole();
  if (compressed(s.info) && whole) {
    memory_space::decompress(reinterpret_cast<float*>(s.grads.data()), s.wire.data(), s.info.count,
                             detail::wire_type(options_.compression), s.info.device, stream_);
  }
  for (std::size_t i : s.info.parameters) {
    const variable& v = vars_[i];
    if (v.view || !whole) continue;
    memory_space::copy(v.param.gradient, s.grads.data() + v.offset, v.param.bytes(), s.info.device,
                       stream_);
  }
  shards_.reduced(b);
  // Timed on the device, the span ends when the device says (device_spans_.poll()).
  if (!std::exchange(s.span_on_device, false))
    timeline_.bucket_done(b, s.span, s.span_reduce, !memory_space::on_stream);
}

template <class Policy>
void basic_ddp<Policy>::reduce_enqueued(std::size_t b, work& w) {
  buckets_[b].span_on_device = device_spans_.end(b, buckets_[b].span, w);
}

template <class Policy>
std::exception_ptr basic_ddp<Policy>::complete_buckets() {
  if (sends_nothing()) return nullptr;  // each bucket was finished as it was launched
  const auto span = timeline_.wait(buckets_.size());
  return runner_->complete(buckets_.size());
}

template <class Policy>
std::exception_ptr basic_ddp<Policy>::runner_drain() {
  if constexpr (memory_space::on_stream) {
    return runner_->drain();
  } else {
    return nullptr;  // synchronize() waited already
  }
}

/// The parameters in the order the current buckets hold them.
template <class Policy>
std::vector<std::size_t> basic_ddp<Policy>::layout_order() const {
  std::vector<std::size_t> order;
  for (const bucket& b : buckets_)
    order.insert(order.end(), b.info.parameters.begin(), b.info.parameters.end());
  return order;
}

}  // namespace dtrain
