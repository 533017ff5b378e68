#pragma once
/// @file
/// The bodies of DDP's sharding part (ddp/sharding.hpp): ddp_options::sharding
/// none and ZeRO stages 1, 2 and 3. Out-of-class members of
/// detail::ddp_sharding (see ddp/basic_ddp.hpp for why out of class).
///
/// A bucket of `moved` elements (padded so that `size()` divides it, each
/// shard on bucket_alignment on a GPU) has `moved / size()` per shard; rank r
/// owns elements [r q, (r + 1) q). A parameter may straddle shards: each rank
/// gets the piece of it that falls in its own. Without sharding, and at stage
/// 1, reduce() averages whole buckets (an allreduce in place, as DDP); at
/// stage 2 it reduce-scatters each bucket into the rank's `owned` buffer the
/// moment it is ready. After the optimizer has updated its pieces (in the
/// model's own memory), each rank copies them into `owned`, and an allgather
/// per bucket brings every rank's into the bucket's gradient storage (free
/// once the optimizer has read the gradients), from where every parameter's
/// values are copied back; the bucket is then zeroed for the next step's
/// gradients.

#include <dtrain/ddp/basic_ddp.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace dtrain::detail {

// ---- What a stage is ---------------------------------------------------------

template <class Policy>
bool ddp_sharding<Policy>::shards_optimizer_state() const noexcept {
  return core_.options_.sharding != sharding::none;
}

template <class Policy>
bool ddp_sharding<Policy>::shards_parameters() const noexcept {
  return core_.options_.sharding == sharding::parameters;
}

template <class Policy>
bool ddp_sharding<Policy>::shards_gradients() const noexcept {
  return (core_.options_.sharding == sharding::gradients || shards_parameters()) && core_.size_ > 1;
}

template <class Policy>
bool ddp_sharding<Policy>::owns_bucket_shards() const noexcept {
  return shards_optimizer_state() && (core_.size_ > 1 || shards_parameters());
}

template <class Policy>
bool ddp_sharding<Policy>::transient_buckets() const noexcept {
  return shards_gradients() && pages_droppable<memory_space>;
}

template <class Policy>
std::size_t ddp_sharding<Policy>::shard_first(std::size_t b) const {
  return core_.topo_.shard_position() * shards_[b].owned_count;
}

template <class Policy>
std::size_t ddp_sharding<Policy>::spare_whole_most() const noexcept {
  return core_.options_.prefetch_units + 1;
}

// ---- The layout ----------------------------------------------------------------

template <class Policy>
std::string ddp_sharding<Policy>::agreed_options() const {
  std::string agreed = "ddp_options::sharding = " + std::string(to_string(core_.options_.sharding));
  if (shards_parameters()) {
    agreed += ", ddp_options::prefetch_units = " + std::to_string(core_.options_.prefetch_units);
  }
  if (core_.options_.master_weights) agreed += ", ddp_options::master_weights = true";
  return agreed;
}

template <class Policy>
std::size_t ddp_sharding<Policy>::padding(const bucket_info& info, std::size_t unit) const {
  if (!owns_bucket_shards()) return unit;
  const std::size_t shard_unit = info.device >= 0 ? bucket_alignment / size_of(info.type) : 1;
  return std::lcm(unit, shard_unit * static_cast<std::size_t>(core_.size_));
}

template <class Policy>
typename ddp_sharding<Policy>::storage ddp_sharding<Policy>::gradient_storage(std::size_t bytes,
                                                                              int device) const {
  if (transient_buckets()) return storage(bytes, device, core_.stream_, droppable_pages);
  return storage(bytes, device, core_.stream_);
}

/// Each bucket's shard (its `owned_count`: `moved` split in size() equal
/// parts), the staging buffers of stage 2's allgathers, and this rank's pieces.
template <class Policy>
void ddp_sharding<Policy>::laid_out() {
  std::vector<shard> shards(core_.buckets_.size());
  for (std::size_t b = 0; b < shards.size(); ++b) {
    const bucket& s = core_.buckets_[b];
    shard& mine = shards[b];
    if (!owns_bucket_shards()) continue;
    const std::size_t elem = size_of(s.info.type);
    mine.owned_count = s.moved / static_cast<std::size_t>(core_.size_);
    // Stage 3 on one rank averages nothing: its gradients stay in the bucket.
    if (!shards_parameters() || shards_gradients())
      mine.owned = storage(mine.owned_count * elem, s.info.device, core_.stream_);
    if (shards_parameters())
      mine.owned_values = storage(mine.owned_count * elem, s.info.device, core_.stream_);
  }
  shards_ = std::move(shards);
  if (transient_buckets() && !shards_parameters()) {  // stage 2's allgathers land there
    std::size_t largest = 0;
    for (const bucket& s : core_.buckets_) largest = std::max(largest, s.grads.bytes());
    for (auto& staged : staging_) staged = storage(largest, -1, core_.stream_);
  }
  gathered_.assign(core_.vars_.size(), false);
  make_pieces();
  add_master();
}

template <class Policy>
void ddp_sharding<Policy>::check_hook() const {
  if (core_.options_.sharding != sharding::gradients && !shards_parameters()) return;
  throw config_error("DistributedDataParallel::register_comm_hook on rank " +
                     std::to_string(core_.rank_) + ": ddp_options::sharding is " +
                     std::string(to_string(core_.options_.sharding)) +
                     ", whose buckets are reduce-scattered, not allreduced; "
                     "a hook replaces an allreduce (use sharding::optimizer)");
}

// ---- The step --------------------------------------------------------------------

template <class Policy>
void ddp_sharding<Policy>::on_mark_locked(std::size_t i, bool bulk) {
  // Stage 3: a gradient the user marks must come from values a gather()
  // held (mark_all_ready() marks the rest too: a part no pass used gives zero).
  if (shards_parameters() && !gathered_[i] && !bulk) not_gathered(i);
  updatable_ = false;  // a new step: the last one's update (if any) is behind
}

template <class Policy>
void ddp_sharding<Policy>::not_gathered(std::size_t i) const {
  throw error("DistributedDataParallel::mark_ready: parameter '" + core_.vars_[i].param.name +
              "' (#" + std::to_string(i) + ") on rank " + std::to_string(core_.rank_) +
              " has a gradient, but no gather() held its values in step " +
              std::to_string(core_.steps_) +
              " (ddp_options::sharding = parameters: they are null outside one, so the pass "
              "that computed the gradient did not read them); hold ddp.gather() of its part "
              "around the part's forward and backward");
}

/// The seam. Stage 2 (and 3): this rank keeps the mean of its shard only,
/// reduce-scattered by the topology (hierarchical: node-local first); else
/// the whole bucket is averaged in place.
template <class Policy>
work ddp_sharding<Policy>::reduce(std::size_t b, const buffer& data, const buffer& scratch,
                                  reduce_op op, const detail::accumulate_sum* accumulate) {
  const stream_handle stream = core_.on_stream_or_null();
  if (shards_gradients()) {
    const buffer mine{shards_[b].owned.data(), shards_[b].owned_count, core_.buckets_[b].info.type,
                      memory_space::where, data.device};
    if (accumulate)
      return core_.topo_.reduce_scatter_accumulated(data, scratch, mine, op, stream, *accumulate);
    return core_.topo_.reduce_scatter(data, scratch, mine, op, stream);
  }
  if (accumulate) return core_.topo_.allreduce_accumulated(data, scratch, op, stream, *accumulate);
  return core_.topo_.allreduce(data, scratch, op, stream);
}

template <class Policy>
void ddp_sharding<Policy>::reduced(std::size_t b) {
  // A transient bucket's pages go back now: its gradients read zero from here on.
  if (transient_buckets()) core_.buckets_[b].grads.clear(core_.stream_);
}

template <class Policy>
void ddp_sharding<Policy>::step_end_locked() {
  updatable_ = true;  // shard() holds the mean: the optimizer may run once
  if (shards_parameters()) end_gather_pass_locked();  // before the values change
}

// ---- For DDP's users -----------------------------------------------------------

template <class Policy>
void ddp_sharding<Policy>::add_memory(ddp_memory_use& use) const {
  for (const shard& s : shards_) {
    use.shards += s.owned.bytes();
    use.values += s.owned_values.bytes();
    use.gathered += s.unsharded.bytes();
  }
  use.scratch += staging_[0].bytes() + staging_[1].bytes();
  for (const storage& spare : spare_whole_) use.scratch += spare.bytes();
  use.master += master_.bytes();
  use.transient_buckets = transient_buckets();
}

template <class Policy>
void ddp_sharding<Policy>::set_stream(typename memory_space::stream_type compute) {
  for (shard& s : shards_) {
    s.owned.set_stream(compute);
    s.owned_values.set_stream(compute);
    s.unsharded.set_stream(compute);
  }
  for (storage& staged : staging_) staged.set_stream(compute);
  master_.set_stream(compute);
}

template <class Policy>
void ddp_sharding<Policy>::give_back_values() noexcept {
  if (!shards_parameters()) return;
  for (ddp_variable& v : core_.vars_) v.param.rebind_values(v.param.values_slot, nullptr);
}

template <class Policy>
template <class Update>
void ddp_sharding<Policy>::update_and_gather(const char* what, Update& update) {
  {
    const std::lock_guard lock(core_.mutex_);
    core_.check_usable_locked();
    check_updatable(what);
    // Stage 3: no whole copy outlives the values it was gathered from
    // (a prefetch posted since the step's end), no allgather reads them.
    if (shards_parameters()) drop_whole_locked();
  }
  adopt_changed_values();  // before the update reads the master
  std::vector<work> gathers;
  std::size_t k = 0;          // pieces_ are in bucket order
  std::size_t completed = 0;  // buckets whose allgather is copied out already
  try {
    for (std::size_t b = 0; b < core_.buckets_.size(); ++b) {
      const std::size_t first = k;
      for (; k < pieces_.size() && pieces_[k].bucket == b; ++k) update(pieces_[k]);
      round_master(std::span(pieces_).subspan(first, k - first));  // before its allgather
      if (owns_bucket_shards() && !shards_parameters()) {          // stage 3 keeps its shard
        gathers.push_back(launch_gather(b));
        if (transient_buckets() && b > 0) {
          gathers[b - 1].wait();
          complete_gather(b - 1);
          completed = b;
        }
      }
    }
    const std::size_t rest = k;
    for (; k < pieces_.size(); ++k) update(pieces_[k]);
    round_master(std::span(pieces_).subspan(rest));
  } catch (const std::exception& e) {
    // The update (or an allgather) failed on this rank: what was launched
    // completes (or fails), and this DDP is not usable for another step.
    abandon_gathers(gathers, e.what());
    throw;
  } catch (...) {
    abandon_gathers(gathers, "an exception that is not a std::exception");
    throw;
  }
  finish_gather(gathers, completed);
}

template <class Policy>
void ddp_sharding<Policy>::make_pieces() {
  pieces_.clear();
  shard_elements_ = 0;
  if (!owns_bucket_shards()) {  // every parameter is this rank's, its gradient where it is
    for (std::size_t i = 0; i < core_.vars_.size(); ++i) {
      const parameter& p = core_.vars_[i].param;
      pieces_.push_back({.parameter = i,
                         .offset = 0,
                         .state_offset = shard_elements_,
                         .bucket = core_.vars_[i].bucket,
                         .values = p.values,
                         .gradients = {p.gradient, p.values.count, p.values.type, p.values.where,
                                       p.values.device},
                         .master = p.values});
      shard_elements_ += p.values.count;
    }
    return;
  }
  for (std::size_t b = 0; b < core_.buckets_.size(); ++b) {
    const bucket& s = core_.buckets_[b];
    shard& mine = shards_[b];
    const std::size_t elem = size_of(s.info.type);
    const std::size_t first = shard_first(b), last = first + mine.owned_count;
    for (std::size_t k = 0; k < s.info.parameters.size(); ++k) {
      const std::size_t i = s.info.parameters[k];
      const parameter& p = core_.vars_[i].param;
      const std::size_t at = s.info.offsets[k] / elem;  // the parameter's first element
      const std::size_t lo = std::max(at, first), hi = std::min(at + p.values.count, last);
      if (lo >= hi) continue;
      buffer values = p.values;
      // Stage 3: the shard of the values is DDP's (owned_values), not the model's.
      values.data = shards_parameters() ? mine.owned_values.data() + (lo - first) * elem
                                        : static_cast<std::byte*>(p.values.data) + (lo - at) * elem;
      values.count = hi - lo;
      std::byte* gradients =
          shards_gradients() ? mine.owned.data() + (lo - first) * elem : s.grads.data() + lo * elem;
      pieces_.push_back(
          {.parameter = i,
           .offset = lo - at,
           .state_offset = shard_elements_,
           .bucket = b,
           .values = values,
           .gradients = {gradients, hi - lo, p.values.type, p.values.where, p.values.device},
           .master = values});
      shard_elements_ += hi - lo;
    }
  }
}

/// The pieces' element size, once checked that they have one type and
/// that `bytes` holds shard_elements() of them.
template <class Policy>
std::size_t ddp_sharding<Policy>::shard_value_size(const char* what, std::size_t bytes) const {
  const dtype type = pieces_.empty() ? dtype::float32 : pieces_.front().master.type;
  for (const shard_piece& piece : pieces_) {
    if (piece.master.type != type) {
      throw config_error("DistributedDataParallel::" + std::string(what) + " on rank " +
                         std::to_string(core_.rank_) + ": the shard holds " +
                         std::string(to_string(type)) + " and " +
                         std::string(to_string(piece.master.type)) + " (parameter '" +
                         core_.vars_[piece.parameter].param.name + "'); it copies one type");
    }
  }
  if (bytes != shard_elements_ * size_of(type)) {
    throw config_error("DistributedDataParallel::" + std::string(what) + " on rank " +
                       std::to_string(core_.rank_) + ": " + std::to_string(bytes) +
                       " bytes given for a shard of " + std::to_string(shard_elements_) + " " +
                       std::string(to_string(type)) + " elements");
  }
  return size_of(type);
}

template <class Policy>
void ddp_sharding<Policy>::download_values(std::span<std::byte> out) {
  const std::size_t elem = shard_value_size("download_shard_values()", out.size());
  for (const shard_piece& p : pieces_) {
    memory_space::download(out.data() + p.state_offset * elem, p.master.data, p.master.bytes(),
                           core_.device_, core_.stream_);
  }
  if constexpr (memory_space::on_stream) memory_space::synchronize(core_.device_, core_.stream_);
}

template <class Policy>
void ddp_sharding<Policy>::upload_values(std::span<const std::byte> in) {
  const std::size_t elem = shard_value_size("upload_shard_values()", in.size());
  if (shards_parameters()) {
    // The values change: no whole copy of the old ones may outlive this
    // (a prefetched bucket), and none may be held.
    const std::lock_guard lock(core_.mutex_);
    core_.check_usable_locked();
    for (std::size_t b = 0; b < shards_.size(); ++b) {
      if (shards_[b].holders == 0) continue;
      throw config_error("DistributedDataParallel::upload_shard_values() on rank " +
                         std::to_string(core_.rank_) + " while a gather() guard holds parameter '" +
                         core_.vars_[core_.buckets_[b].info.parameters.front()].param.name +
                         "': its whole values would be stale; let the guards go first");
    }
    drop_whole_locked();
  }
  for (const shard_piece& p : pieces_) {
    memory_space::upload(p.master.data, in.data() + p.state_offset * elem, p.master.bytes(),
                         core_.device_, core_.stream_);
  }
  round_master(pieces_);  // the 16-bit values from the master weights loaded
  if constexpr (memory_space::on_stream) memory_space::synchronize(core_.device_, core_.stream_);
}

/// export_parameters()' step for bucket b: its values whole in `host` at
/// their bucket offsets, where `here` (the root); at stage 3 allgathered
/// alone (no prefetch, the recorded order untouched) and freed after,
/// unless a guard or the prefetch window holds it.
template <class Policy>
void ddp_sharding<Policy>::whole_bucket_to_host(std::size_t b, std::vector<std::byte>& host,
                                                bool here) {
  const bucket& s = core_.buckets_[b];
  std::size_t bytes = 0;
  for (const std::size_t i : s.info.parameters)
    bytes = std::max(bytes, core_.vars_[i].offset + core_.vars_[i].param.values.bytes());
  if (here) host.resize(std::max(host.size(), bytes));
  if (!shards_parameters()) {  // the values are whole, in the model's memory
    if (!here) return;
    for (const std::size_t i : s.info.parameters) {
      const parameter& p = core_.vars_[i].param;
      memory_space::download(host.data() + core_.vars_[i].offset, p.values.data, p.values.bytes(),
                             core_.device_, core_.stream_);
    }
    if constexpr (memory_space::on_stream) memory_space::synchronize(core_.device_, core_.stream_);
    return;
  }
  bool posted = false;
  {
    const std::lock_guard lock(core_.mutex_);
    core_.check_usable_locked();
    if (shards_[b].unsharded.data() == nullptr) {
      post_gather_locked(b, false);
      posted = true;
    }
  }
  settle_gather(b);
  if (here) {
    memory_space::download(host.data(), shards_[b].unsharded.data(), bytes, core_.device_,
                           core_.stream_);
    if constexpr (memory_space::on_stream) memory_space::synchronize(core_.device_, core_.stream_);
  }
  if (posted) {
    const std::lock_guard lock(core_.mutex_);
    shard& mine = shards_[b];
    if (mine.holders == 0 && !mine.wanted) free_whole_locked(mine);
  }
}

template <class Policy>
void ddp_sharding<Policy>::check_updatable(const char* what) const {
  if (updatable_) return;
  throw error("DistributedDataParallel::" + std::string(what) + " on rank " +
              std::to_string(core_.rank_) + " with no averaged gradients to use: " +
              (core_.any_touched_
                   ? "step " + std::to_string(core_.steps_) + " is not synchronized yet"
                   : "step " + std::to_string(core_.steps_) +
                         " has not started, and the one before was updated already") +
              " (sharding " + std::string(to_string(core_.options_.sharding)) +
              "). Call synchronize() after the backward pass, then the optimizer once");
}

/// This rank's updated values of bucket b into its shard, and the
/// allgather of every rank's into the bucket (its gradients are used up),
/// ordered after the compute stream where the engine takes one.
template <class Policy>
work ddp_sharding<Policy>::launch_gather(std::size_t b) {
  const bucket& s = core_.buckets_[b];
  shard& mine = shards_[b];
  const std::size_t elem = size_of(s.info.type);
  const std::size_t first = shard_first(b);
  for (std::size_t k = 0; k < pieces_.size(); ++k) {
    const shard_piece& piece = pieces_[k];
    if (piece.bucket != b) continue;
    const std::size_t at = core_.vars_[piece.parameter].offset / elem + piece.offset - first;
    memory_space::copy(mine.owned.data() + at * elem, piece.values.data, piece.values.bytes(),
                       s.info.device, core_.stream_);
  }
  const label_scope label("parameters of bucket", static_cast<std::int64_t>(b));
  return allgather_bucket(b, mine.owned.data(), gathered(b));
}

/// Every rank's `owned_count` elements of bucket b at `mine` into `all`
/// (the whole bucket, `moved` elements, in shard order), through the
/// topology, ordered after the compute stream where the engine takes one.
template <class Policy>
work ddp_sharding<Policy>::allgather_bucket(std::size_t b, std::byte* mine, std::byte* all) {
  const bucket& s = core_.buckets_[b];
  const int device = s.grads.device();
  return core_.topo_.allgather(
      buffer{mine, shards_[b].owned_count, s.info.type, memory_space::where, device},
      buffer{s.shard.data(), core_.topo_.shard_count(s.moved), s.info.type, memory_space::where,
             device},
      buffer{all, s.moved, s.info.type, memory_space::where, device}, core_.on_stream_or_null());
}

/// Where bucket b's allgather lands: the bucket itself (its gradients are
/// used up), or with transient buckets, whose pages were given back after
/// the reduce-scatter, one of two staging buffers, taken in turn (a bucket's
/// is free again once the bucket two before it is complete).
template <class Policy>
std::byte* ddp_sharding<Policy>::gathered(std::size_t b) {
  return transient_buckets() ? staging_[b % 2].data() : core_.buckets_[b].grads.data();
}

/// Bucket b's allgather is complete (and, on streams, the compute stream
/// ordered after it): the values other ranks updated are copied out of where
/// it landed into the parameters, and the bucket is zeroed for the next
/// step's gradients.
template <class Policy>
void ddp_sharding<Policy>::complete_gather(std::size_t b) {
  bucket& s = core_.buckets_[b];
  const std::size_t elem = size_of(s.info.type);
  const std::size_t first = shard_first(b), last = first + shards_[b].owned_count;
  for (const std::size_t i : s.info.parameters) {
    const ddp_variable& v = core_.vars_[i];
    // The parameter's elements [lo, hi) in the bucket, but for this rank's shard [first, last).
    const std::size_t lo = v.offset / elem, hi = lo + v.param.values.count;
    auto copy_out = [&](std::size_t from, std::size_t to) {
      if (from >= to) return;
      memory_space::copy(static_cast<std::byte*>(v.param.values.data) + (from - lo) * elem,
                         gathered(b) + from * elem, (to - from) * elem, s.info.device,
                         core_.stream_);
    };
    copy_out(lo, std::min(hi, first));
    copy_out(std::max(lo, last), hi);
  }
  // The next step's gradients start from zero (a transient bucket's pages
  // were given back after its reduce-scatter; its staging buffer is
  // overwritten whole by the next allgather).
  if (!transient_buckets()) s.grads.clear(core_.stream_);
}

/// Waits for the allgathers from `completed` on (each within the collective
/// timeout), then completes each (complete_gather).
template <class Policy>
void ddp_sharding<Policy>::finish_gather(std::vector<work>& gathers, std::size_t completed) {
  const std::lock_guard lock(core_.mutex_);
  updatable_ = false;
  if (!shards_optimizer_state()) return;
  try {
    if (core_.size_ == 1) {  // nothing to gather; the gradients are cleared as on more ranks
      for (bucket& s : core_.buckets_) s.grads.clear(core_.stream_);
      return;
    }
    for (std::size_t b = completed; b < gathers.size(); ++b) gathers[b].wait();
    core_.order_after_buckets();
    for (std::size_t b = completed; b < gathers.size(); ++b) complete_gather(b);
  } catch (...) {
    core_.fail(std::current_exception());
  }
}

template <class Policy>
void ddp_sharding<Policy>::abandon_gathers(std::vector<work>& gathers, const std::string& why) {
  // The update failed on this rank: its peers wait for gathers it will not
  // send. NCCL aborts the communicators now (work::abandon), so that these
  // waits end at once, not after the collective timeout.
  for (work& w : gathers) w.abandon();
  for (work& w : gathers) {
    try {
      w.wait();
    } catch (...) {  // the update's exception is the one to report
    }
  }
  const std::lock_guard lock(core_.mutex_);
  updatable_ = false;
  core_.broken_ = true;
  core_.broken_message_ =
      "the optimizer's step failed on rank " + std::to_string(core_.rank_) + " (" + why +
      ") in the middle of its update and allgathers: the ranks' values may differ";
}

// ---- Stage 3 (sharding::parameters) -----------------------------------------
// Each bucket's values live as this rank's shard in owned_values (the pieces'
// values: the optimizer updates them there); gather() allgathers a bucket's
// shards into `unsharded`, the whole values, and points the model's value
// pointers into it; the last guard's release frees it and points them at
// their places in the fence (fence.hpp: a use there is named; null on a GPU).
// The allgathers run on the bucket runner, in order with the buckets'
// reduce-scatters (post_in_order): every rank issues its collectives in the
// same order, whichever thread runs them. Prefetch: the gather() calls of a
// step are recorded, and from the next step on each call also posts the
// allgathers of the next prefetch_units units, which the runner's thread
// runs while the model computes; a bucket in that window stays whole when
// its guard goes (the last layer's forward, then its backward).
// On streams (NCCL, GPU memory) the allgathers are enqueued at once on DDP's
// communicator, after the compute stream (the optimizer's update of the
// shard), under the runner's watchdog; gather() orders the compute stream
// after its allgathers alone (their events, no host wait; not after the
// reduce-scatters enqueued since) before the unit computes, and the
// whole values come from the stream-ordered allocator (cudaMallocAsync's
// pool) and go back on the compute stream after the last kernel that reads
// them: at most the held units plus the window are allocated at once.

/// Construction: this rank's shard of the values (rank 0's, broadcast) into
/// owned_values, where make_pieces() put the pieces' values (a parameter
/// declared without values starts at zero there); the model's value
/// pointers point at the fence from here on (null on a GPU).
template <class Policy>
void ddp_sharding<Policy>::take_values() {
  // The master weights start as the values (at stage 3 the shard just taken).
  auto start_master = [this] {
    for (const shard_piece& p : pieces_) {
      if (p.master.data == p.values.data) continue;
      memory_space::decompress(static_cast<float*>(p.master.data), p.values.data, p.values.count,
                               p.values.type, core_.device_, core_.stream_);
    }
  };
  if (!shards_parameters()) {
    start_master();
    return;
  }
  if constexpr (memory_space::where == memory::host) {
    std::vector<value_fence::place> places;
    for (const ddp_variable& v : core_.vars_) {
      places.push_back({.name = v.param.name,
                        .unit = v.param.unit,
                        .bytes = v.param.values.bytes(),
                        .element = size_of(v.param.values.type)});
    }
    fence_ = std::make_unique<value_fence>(std::move(places), core_.rank_, core_.size_);
  }
  for (const shard_piece& piece : pieces_) {
    const parameter& p = core_.vars_[piece.parameter].param;
    if (!p.values.data) continue;  // deferred: the shard starts at zero
    memory_space::copy(
        piece.values.data,
        static_cast<const std::byte*>(p.values.data) + piece.offset * size_of(p.values.type),
        piece.values.bytes(), p.device, core_.stream_);
  }
  for (std::size_t b = 0; b < core_.buckets_.size(); ++b) point_values(b, nullptr);
  start_master();
}

/// ddp_options::master_weights: a float32 copy for each piece of a 16-bit
/// parameter (shard_piece::master), one after another in master_; kept
/// where it has the size already (a rebuild without sharding: the same
/// pieces, whole parameters in index order).
template <class Policy>
void ddp_sharding<Policy>::add_master() {
  if (!core_.options_.master_weights) return;
  auto sixteen = [](dtype t) { return t == dtype::bfloat16 || t == dtype::float16; };
  std::size_t count = 0;
  for (const shard_piece& p : pieces_) count += sixteen(p.values.type) ? p.values.count : 0;
  if (master_.bytes() != count * sizeof(float))
    master_ = count == 0 ? storage() : storage(count * sizeof(float), core_.device_, core_.stream_);
  std::size_t at = 0;
  for (shard_piece& p : pieces_) {
    if (!sixteen(p.values.type)) continue;
    p.master = buffer{master_.data() + at * sizeof(float), p.values.count, dtype::float32,
                      p.values.where, p.values.device};
    at += p.values.count;
  }
}

/// Host memory: where a piece's 16-bit value is no longer its master
/// rounded (written since by the program: a restore of the values alone,
/// an initialisation through shard()), the master starts again from the
/// value, element by element: the values the program wrote are never
/// rounded over by a stale master. (GPU memory: not checked; write the
/// master too, or upload_shard_values().)
template <class Policy>
void ddp_sharding<Policy>::adopt_changed_values() {
  if constexpr (memory_space::where == memory::host) {
    for (const shard_piece& p : pieces_) {
      if (p.master.data == p.values.data) continue;
      visit(p.values.type, [&]<class Half>() {
        if constexpr (std::same_as<Half, float16> || std::same_as<Half, bfloat16>) {
          auto* master = static_cast<float*>(p.master.data);
          const auto* values = static_cast<const Half*>(p.values.data);
          for (std::size_t i = 0; i < p.values.count; ++i) {
            if (!(Half(master[i]) == values[i])) master[i] = static_cast<float>(values[i]);
          }
        }
      });
    }
  }
}

/// The updated master weights of `pieces` into their 16-bit values, rounded
/// once (to nearest even), on the compute stream: before a bucket's
/// allgather reads them, and before the model's next forward.
template <class Policy>
void ddp_sharding<Policy>::round_master(std::span<const shard_piece> pieces) {
  for (const shard_piece& p : pieces) {
    if (p.master.data == p.values.data) continue;
    memory_space::compress(p.values.data, static_cast<const float*>(p.master.data), p.values.count,
                           1.0f, p.values.type, core_.device_, core_.stream_);
  }
}

/// The model's values of bucket b's parameters at `whole` (their places in
/// the bucket's layout), or null.
template <class Policy>
void ddp_sharding<Policy>::point_values(std::size_t b, std::byte* whole) noexcept {
  for (const std::size_t i : core_.buckets_[b].info.parameters) {
    parameter& p = core_.vars_[i].param;
    p.values.data = whole ? whole + core_.vars_[i].offset : nullptr;
    // Between gathers the model's pointer is the fence's place (a use there
    // is named), or null; DDP's own record stays null.
    p.rebind_values(p.values_slot, whole ? p.values.data : fence_ ? fence_->at(i) : nullptr);
  }
}

template <class Policy>
typename ddp_sharding<Policy>::held_values ddp_sharding<Policy>::gather(
    std::span<const std::size_t> indices) {
  if (!shards_parameters()) return held_values(*this, {});
  std::vector<std::size_t> held;
  for (const std::size_t i : indices) held.push_back(core_.vars_[i].bucket);
  std::sort(held.begin(), held.end());
  held.erase(std::unique(held.begin(), held.end()), held.end());
  std::vector<std::size_t> unwanted;
  std::optional<held_values> guard;
  {
    const std::lock_guard lock(core_.mutex_);
    core_.check_usable_locked();
    guard.emplace(held_values(*this, held));                  // releases the counts if this throws
    for (const std::size_t i : indices) gathered_[i] = true;  // for mark_ready's check
    for (const std::size_t b : held) {
      shards_[b].holders++;
      shards_[b].ahead = false;
    }
    // Every rank posts the same allgathers in the same order: this unit's
    // buckets not yet whole (nor on their way), then the window's.
    for (const std::size_t b : held) {
      if (shards_[b].unsharded.data() == nullptr) post_gather_locked(b, false);
    }
    follow_order_locked(held);
    unwanted = refresh_window_locked();
  }
  for (const std::size_t b : held) settle_gather(b);
  drop_unwanted(unwanted);
  {
    const std::lock_guard lock(core_.mutex_);
    core_.check_usable_locked();
    for (const std::size_t b : held) point_values(b, shards_[b].unsharded.data());
  }
  return std::move(*guard);
}

/// Bucket b's values whole into `unsharded`: on the host a spare buffer of
/// its size or fresh pages (no memset: the allgather writes them all),
/// kept as a spare or unmapped when dropped (free_whole_locked); on one
/// rank a copy, elsewhere an allgather posted to the runner, in order with
/// the buckets' reduce-scatters.
template <class Policy>
void ddp_sharding<Policy>::post_gather_locked(std::size_t b, bool ahead) {
  const bucket& layout = core_.buckets_[b];
  shard& s = shards_[b];
  const std::size_t elem = size_of(layout.info.type);
  ++(ahead ? gather_counts_.prefetched : gather_counts_.on_demand);
  if (core_.size_ > 1) gather_counts_.bytes += (layout.moved - s.owned_count) * elem;
  s.ahead = ahead;
  s.unsharded = whole_buffer_locked(layout.moved * elem, layout.info.device);
  if (core_.size_ == 1) {
    memory_space::copy(s.unsharded.data(), s.owned_values.data(), layout.moved * elem,
                       layout.info.device, core_.stream_);
    return;
  }
  std::byte* mine = s.owned_values.data();
  std::byte* all = s.unsharded.data();
  try {
    s.gathering = core_.runner_->post_in_order([this, b, mine, all] {
      const label_scope label("values of bucket", static_cast<std::int64_t>(b));
      return allgather_bucket(b, mine, all);
    });
  } catch (...) {
    core_.fail(std::current_exception());  // the ranks' collectives are out of step: unusable
  }
}

/// Waits for bucket b's posted allgather, if any (the caller does not hold
/// the lock); on streams the compute stream is ordered after it instead
/// (an event, no host wait): the unit's compute, and the stream-ordered
/// free of its whole values, come after the allgather that wrote them. A
/// failure makes DDP unusable and is thrown.
template <class Policy>
void ddp_sharding<Policy>::settle_gather(std::size_t b) {
  std::shared_ptr<posted_task> posted;
  {
    const std::lock_guard lock(core_.mutex_);
    posted = shards_[b].gathering;
  }
  if (!posted) return;
  try {
    core_.runner_->wait(posted);
    order_after_gather(*posted);
  } catch (...) {
    const std::lock_guard lock(core_.mutex_);
    if (core_.broken_) core_.unusable();
    core_.fail(std::current_exception());
  }
  const std::lock_guard lock(core_.mutex_);
  if (shards_[b].gathering == posted) shards_[b].gathering.reset();
}

/// Streams: the compute stream waits, on the device, for the posted
/// allgather alone (an event recorded after it), not for the reduce-scatters
/// enqueued since (a backward pass's part then overlaps the reduce-scatter
/// of the part before it); where the engine cannot, for every collective so
/// far. Host memory: the runner waited for it already.
template <class Policy>
void ddp_sharding<Policy>::order_after_gather(posted_task& posted) {
  if constexpr (memory_space::on_stream) {
    if (!posted.collective.stream_wait(core_.stream_)) core_.order_after_buckets();
  }
}

/// This pass's place in the recorded order, after a gather() of `unit`.
template <class Policy>
void ddp_sharding<Policy>::follow_order_locked(const std::vector<std::size_t>& unit) {
  gather_order& o = order_;
  // A pass keeps at most this many units (an evaluation of many batches is
  // one long pass until it starts over at the recorded first unit).
  const std::size_t most = 64 * core_.buckets_.size() + 1024;
  if (o.current.size() < most) {
    o.current.push_back(unit);
  } else {
    o.overflow = true;
  }
  if (o.recorded.empty()) return;  // the first pass: recording only
  if (o.in_order && o.next < o.recorded.size() && o.recorded[o.next] == unit) {
    ++o.next;
  } else if (o.recorded.front() == unit) {
    // A new pass from the first unit (the next batch of an evaluation, a
    // no_sync() micro-batch): follow the order from there.
    o.next = 1;
    o.in_order = true;
    o.current.assign(1, unit);
    o.overflow = false;
  } else {
    o.in_order = false;  // on demand until the pass starts over
  }
}

/// Marks the buckets of the next prefetch_units recorded units (the window)
/// wanted, posts the allgathers of those not whole yet, in order, and
/// returns the buckets whole, unheld and no longer wanted (to drop).
template <class Policy>
std::vector<std::size_t> ddp_sharding<Policy>::refresh_window_locked() {
  const gather_order& o = order_;
  std::vector<std::size_t> window;  // in the recorded order: the order of the posts
  std::vector<bool> in_window(core_.buckets_.size(), false);
  if (core_.size_ > 1 && o.in_order && !o.recorded.empty()) {
    const std::size_t end = std::min(o.recorded.size(), o.next + core_.options_.prefetch_units);
    for (std::size_t u = o.next; u < end; ++u) {
      for (const std::size_t b : o.recorded[u]) {
        if (!in_window[b]) window.push_back(b);
        in_window[b] = true;
      }
    }
  }
  std::vector<std::size_t> unwanted;
  for (std::size_t b = 0; b < shards_.size(); ++b) {
    shard& s = shards_[b];
    s.wanted = in_window[b];
    if (s.holders == 0 && s.unsharded.data() != nullptr && !s.wanted) unwanted.push_back(b);
  }
  for (const std::size_t b : window) {
    if (shards_[b].unsharded.data() == nullptr) post_gather_locked(b, true);
  }
  return unwanted;
}

/// Frees the whole values of `candidates` still unheld and unwanted, once
/// their allgathers are done (the caller does not hold the lock).
template <class Policy>
void ddp_sharding<Policy>::drop_unwanted(std::span<const std::size_t> candidates) {
  for (const std::size_t b : candidates) {
    settle_gather(b);
    const std::lock_guard lock(core_.mutex_);
    shard& s = shards_[b];
    if (s.holders == 0 && !s.wanted) free_whole_locked(s);
  }
}

/// The end of a step (under the lock): the values are about to change
/// (optimizer_step()), so nothing stays whole but what a guard holds; the
/// pass just ended is the order followed from here on, unless it followed
/// the recorded one to its end.
template <class Policy>
void ddp_sharding<Policy>::end_gather_pass_locked() {
  gather_order& o = order_;
  const bool followed = !o.recorded.empty() && o.in_order && o.next == o.recorded.size();
  if (!followed && !o.overflow && !o.current.empty()) o.recorded = std::move(o.current);
  o.current.clear();
  o.next = 0;
  o.in_order = true;
  o.overflow = false;
  gathered_.assign(gathered_.size(), false);  // the next step's passes gather them again
  drop_whole_locked();
}

/// Frees the whole values of every bucket no guard holds (the window's
/// too), once their allgathers are done: before the values change.
template <class Policy>
void ddp_sharding<Policy>::drop_whole_locked() {
  for (shard& s : shards_) {
    s.wanted = false;
    if (s.holders > 0 || s.unsharded.data() == nullptr) continue;
    if (s.gathering) {
      try {
        core_.runner_->wait(s.gathering);  // the runner's tasks never take this lock
        order_after_gather(*s.gathering);  // streams: the free is ordered after the allgather
      } catch (...) {
        core_.fail(std::current_exception());
      }
      s.gathering.reset();
    }
    free_whole_locked(s);
  }
}

/// Frees bucket `s`'s whole values (its allgather done), counting a
/// prefetch no guard used.
template <class Policy>
void ddp_sharding<Policy>::free_whole_locked(shard& s) noexcept {
  if (s.ahead) ++gather_counts_.unused;
  s.ahead = false;
  // Host memory: kept for the next gather of a bucket this size (up to
  // spare_whole_most of them), whose allgather writes over it, rather than
  // unmapped and faulted in again page by page. GPU memory comes from the
  // stream-ordered allocator's pool already.
  if constexpr (pages_droppable<memory_space>) {
    if (s.unsharded.data() && spare_whole_.size() < spare_whole_most()) {
      spare_whole_.push_back(std::move(s.unsharded));
      return;
    }
  }
  s.unsharded = {};
}

/// Memory for a bucket's whole values of `bytes`: a spare one of that size
/// (host memory), or fresh.
template <class Policy>
typename ddp_sharding<Policy>::storage ddp_sharding<Policy>::whole_buffer_locked(std::size_t bytes,
                                                                                 int device) {
  for (auto it = spare_whole_.begin(); it != spare_whole_.end(); ++it) {
    if (it->bytes() != bytes) continue;
    flat_storage<memory_space> reused = std::move(*it);
    spare_whole_.erase(it);
    return reused;
  }
  if (spare_whole_.size() >= spare_whole_most() && !spare_whole_.empty())
    spare_whole_.erase(spare_whole_.begin());  // none of this size: the oldest goes
  return flat_storage<memory_space>(bytes, device, core_.stream_, droppable_pages);
}

template <class Policy>
void ddp_sharding<Policy>::release(std::span<const std::size_t> held) noexcept {
  const std::lock_guard lock(core_.mutex_);
  for (const std::size_t b : held) {
    shard& s = shards_[b];
    if (s.holders == 0 || --s.holders > 0) continue;
    point_values(b, nullptr);
    if (s.wanted) continue;  // the next units need it: kept whole
    // An allgather that failed may not have settled: its buffer stays until DDP goes.
    if (s.gathering && !core_.runner_->settled(s.gathering)) continue;
    if (s.gathering) {  // a guard whose gather() threw before settling it
      try {
        order_after_gather(*s.gathering);  // streams: the free after the allgather, or none
      } catch (...) {
        continue;
      }
    }
    s.gathering.reset();
    free_whole_locked(s);
  }
}

template <class Policy>
double ddp_sharding<Policy>::gradient_norm() {
  {
    const std::lock_guard lock(core_.mutex_);
    core_.check_usable_locked();
    check_updatable("gradient_norm()");
  }
  for (const shard_piece& piece : pieces_) {
    const buffer& g = piece.gradients;
    if (g.type != dtype::float32 && g.type != dtype::float64 && g.type != dtype::bfloat16 &&
        g.type != dtype::float16) {
      throw config_error("DistributedDataParallel::gradient_norm on rank " +
                         std::to_string(core_.rank_) + ": parameter '" +
                         core_.vars_[piece.parameter].param.name + "' is " +
                         std::string(to_string(g.type)) +
                         "; the norm reads float32, float64, bfloat16 and float16");
    }
  }
  // Streams: the buckets' collectives are done before the host reads what they
  // wrote; every piece is downloaded, then the host waits once.
  if constexpr (memory_space::on_stream) core_.wait();
  std::vector<std::byte> staged;
  std::vector<std::size_t> at(pieces_.size(), 0);
  for (std::size_t k = 0; k < pieces_.size(); ++k) {
    if (pieces_[k].gradients.where != memory::device) continue;
    at[k] = staged.size();
    staged.resize(staged.size() + pieces_[k].gradients.bytes());
  }
  if (!staged.empty()) {
    for (std::size_t k = 0; k < pieces_.size(); ++k) {
      const buffer& g = pieces_[k].gradients;
      if (g.where == memory::device)
        memory_space::download(staged.data() + at[k], g.data, g.bytes(), core_.device_,
                               core_.stream_);
    }
    memory_space::synchronize(core_.device_, core_.stream_);
  }
  // Squares summed in double whatever the type: a 16-bit gradient's square
  // is not rounded to 16 bits, and no square goes past float32's range.
  double squares = 0;
  auto add_squares = [&squares](auto values, auto to_double) {
    for (const auto x : values) {
      const double d = to_double(x);
      squares += d * d;
    }
  };
  for (std::size_t k = 0; k < pieces_.size(); ++k) {
    const buffer& g = pieces_[k].gradients;
    const void* data = g.where == memory::device ? staged.data() + at[k] : g.data;
    const auto bits = std::span(static_cast<const std::uint16_t*>(data), g.count);
    switch (g.type) {
      case dtype::float32:
        add_squares(std::span(static_cast<const float*>(data), g.count),
                    [](float x) { return double{x}; });
        break;
      case dtype::bfloat16:
        add_squares(bits, [](std::uint16_t x) { return double{bfloat16::to_float(x)}; });
        break;
      case dtype::float16:
        add_squares(bits, [](std::uint16_t x) { return double{float16::to_float(x)}; });
        break;
      default:  // float64 (checked above)
        add_squares(std::span(static_cast<const double*>(data), g.count),
                    [](double x) { return x; });
        break;
    }
  }
  if (partial()) {
    // Every rank's sum, added in rank order: the same norm on every rank.
    const std::vector<std::int64_t> all = core_.gather_scalar(std::bit_cast<std::int64_t>(squares));
    squares = 0;
    for (const std::int64_t s : all) squares += std::bit_cast<double>(s);
  }
  return std::sqrt(squares);
}

}  // namespace dtrain::detail
