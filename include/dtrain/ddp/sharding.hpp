#pragma once
/// @file
/// DDP's sharding part (ddp_options::sharding: none, and ZeRO stages 1, 2
/// and 3), behind the one seam of the reduction: what happens to a bucket
/// once it is ready (reduce(): an allreduce, or a reduce-scatter into this
/// rank's shard), and at the step's end (step_end_locked(): the shard may
/// be updated once; stage 3's values are dropped and its pass recorded). The
/// core (basic_ddp) keeps the buckets, their overlap, no_sync() and the
/// step's marks, and asks this part the few things a stage changes (how a
/// bucket is padded, where its gradients live, whether the mean comes back
/// whole), never which stage it is: no stage adds a branch to the core.
///
/// What the part holds: this rank's pieces of the parameters (shard()),
/// each bucket's shard (bucket_shard: the averaged gradients at stage 2, the
/// values at stage 3, and stage 3's whole values while gathered), the
/// allgather of the updated values after the optimizer's step, and stage 3's
/// gathers with their prefetch in the order the first pass recorded. It
/// reads the core's layout (buckets, variables, topology) and uses its lock,
/// runner and stream; the runner's thread calls only reduce() (through the
/// core) and the allgathers the part posts, and never takes the lock.
///
/// Bodies out of class in ddp/sharding_part.hpp (see ddp/basic_ddp.hpp for
/// why: the compiled library instantiates this class with basic_ddp).

#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/ddp/fence.hpp>
#include <dtrain/ddp/options.hpp>
#include <dtrain/ddp/runner.hpp>
#include <dtrain/ddp/state.hpp>
#include <dtrain/ddp/storage.hpp>
#include <dtrain/topology/accumulate.hpp>

#include <array>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace dtrain {

template <class Policy>
class basic_ddp;

namespace detail {

/// What the sharding part holds of one bucket, beside the core's ddp_bucket.
template <class Memory>
struct bucket_shard {
  /// This rank's shard of the bucket (`owned_count` elements), where a
  /// reduce-scatter leaves the averaged gradients (stage 2) and the updated
  /// values wait for the allgather (stages 1 and 2, over more than one rank).
  flat_storage<Memory> owned;
  std::size_t owned_count = 0;
  /// Stage 3: this rank's shard of the values (`owned_count` elements, all
  /// of them on one rank), the master copy the optimizer updates; and, while
  /// gather() holds the bucket (`holders` > 0) or the prefetch window wants
  /// it, the whole values, allgathered, which the model's value pointers
  /// point into while held.
  flat_storage<Memory> owned_values;
  flat_storage<Memory> unsharded;
  std::size_t holders = 0;
  /// Stage 3: the allgather into `unsharded`, posted to the runner (a
  /// prefetch runs while the model computes); null once waited for.
  std::shared_ptr<posted_task> gathering;
  /// Stage 3: in the prefetch window (the units expected next): kept whole
  /// when its last guard goes, instead of freed.
  bool wanted = false;
  bool ahead = false;  ///< stage 3: prefetched, and no guard has held it since
};

/// The sharding part of basic_ddp<Policy> (see the file comment). Made and
/// owned by the core, which it refers to. The core calls a member with its
/// lock held where the name ends in `_locked` (and add_memory(),
/// gather_counts()), without it otherwise; reduce() runs on the runner's
/// thread or enqueues on the streams, and reads only bucket b's shard.
template <class Policy>
class ddp_sharding {
 public:
  using core_type = basic_ddp<Policy>;
  using memory_space = typename Policy::memory_space;
  using storage = flat_storage<memory_space>;

  explicit ddp_sharding(core_type& core) noexcept : core_(core) {}
  /// No model pointer is left at the fence it takes along (a DDP whose
  /// constructor threw after take_values()).
  ~ddp_sharding() {
    if (fence_) give_back_values();
  }
  ddp_sharding(const ddp_sharding&) = delete;
  ddp_sharding& operator=(const ddp_sharding&) = delete;

  /// sharding::parameters (ZeRO stage 3): while one lives, the values of the
  /// buckets it holds are whole on this rank, and the model's value pointers
  /// point at them; when the last one holding a bucket goes, the pointers
  /// point at the fence (fence.hpp; null on a GPU) and the memory is given
  /// back. Made by gather().
  class held_values {
   public:
    held_values(held_values&& other) noexcept
        : part_(std::exchange(other.part_, nullptr)), buckets_(std::move(other.buckets_)) {}
    held_values(const held_values&) = delete;
    held_values& operator=(const held_values&) = delete;
    held_values& operator=(held_values&&) = delete;
    ~held_values() {
      if (part_) part_->release(buckets_);
    }

   private:
    friend class ddp_sharding;
    held_values(ddp_sharding& part, std::vector<std::size_t> buckets) noexcept
        : part_(&part), buckets_(std::move(buckets)) {}
    ddp_sharding* part_;
    std::vector<std::size_t> buckets_;
  };

  // ---- What the core asks while it lays the buckets out --------------------

  /// The options every rank must agree on, as the model agreement prints them.
  std::string agreed_options() const;
  /// Stage 3: no bucket holds two units (a unit's gather makes no other whole).
  bool buckets_by_unit() const noexcept { return shards_parameters(); }
  /// The elements a bucket of `info` is padded to a multiple of, from the
  /// topology's `unit`: sharded, size() equal shards (each on
  /// bucket_alignment on a GPU).
  std::size_t padding(const bucket_info& info, std::size_t unit) const;
  /// A bucket's gradient storage: transient (stage 2 on the host: pages given
  /// back once reduced) or held.
  storage gradient_storage(std::size_t bytes, int device) const;
  /// The core's buckets are new (construction, the rebuild): each bucket's
  /// shard, the staging buffers and this rank's pieces.
  void laid_out();
  /// Construction, after the first layout: stage 3 takes the values into
  /// its shards (the model's value pointers are null from here on); the
  /// master weights start as the values in float32.
  void take_values();
  /// The layout stays as built (no rebuild moves a shard): stages 1-3, and
  /// master weights at any stage (the pieces an optimizer holds, LibTorch's
  /// shard_parameters() with their gradients, stay where they are).
  bool fixed_layout() const noexcept {
    return shards_optimizer_state() || core_.options_.master_weights;
  }
  /// Stage 3: a parameter is found by name, its values' address moves.
  bool values_move() const noexcept { return shards_parameters(); }
  /// A comm hook replaces an allreduce: refused where buckets are reduce-scattered.
  void check_hook() const;

  // ---- The step -------------------------------------------------------------

  /// Parameter i is marked (under the lock; `bulk`: by mark_all_ready() or
  /// synchronize(), which mark what no pass used). Stage 3: refused when no
  /// gather() held its values in this step. A new step: the last one's
  /// update is behind.
  void on_mark_locked(std::size_t i, bool bulk);
  /// Transient buckets: a backward pass that outruns the buckets waits
  /// (runner::throttle) so that at most this many launched buckets hold pages.
  bool throttles() const noexcept { return transient_buckets(); }
  static constexpr std::size_t in_flight = 2;
  /// The seam: bucket b's gradients (`data`, `moved` elements; `scratch` the
  /// topology's) reduced over the ranks: averaged in place, or
  /// reduce-scattered into this rank's shard (in the bucket's type). With
  /// `accumulate` (ddp_options::accumulate), summed in float32 by the
  /// topology's accumulated reductions, `scratch` their bytes. Runner thread
  /// or stream; no lock.
  work reduce(std::size_t b, const buffer& data, const buffer& scratch, reduce_op op,
              const detail::accumulate_sum* accumulate);
  /// Whether reduce() leaves the whole mean in the bucket (else only this
  /// rank's shard, in shard()), for the copy-out to copy-mode gradients.
  bool mean_is_whole() const noexcept { return !shards_gradients(); }
  /// Bucket b's mean is copied out: a transient bucket gives its pages back.
  void reduced(std::size_t b);
  /// Every bucket is averaged (under the lock): the shard may be updated
  /// once; stage 3 drops what is whole and keeps the pass's order.
  void step_end_locked();

  // ---- What DDP's users call through the core ------------------------------

  std::span<const shard_piece> pieces() const noexcept { return pieces_; }
  std::size_t shard_elements() const noexcept { return shard_elements_; }
  /// Whether some piece has a float32 master copy apart from its values.
  bool has_master() const noexcept { return master_.bytes() > 0; }
  /// Sums that each rank made over its own pieces must be added over the ranks.
  bool partial() const noexcept { return owns_bucket_shards(); }
  void add_memory(ddp_memory_use& use) const;                                      // under the lock
  dtrain::gather_counts gather_counts() const noexcept { return gather_counts_; }  // under the lock
  void download_values(std::span<std::byte> out);
  void upload_values(std::span<const std::byte> in);
  void whole_bucket_to_host(std::size_t b, std::vector<std::byte>& host, bool here);
  double gradient_norm();
  /// Streams: the part's storage is released on `compute` from now on.
  void set_stream(typename memory_space::stream_type compute);
  /// The destructor: stage 3's values go with DDP; the model's pointers are null.
  void give_back_values() noexcept;
  /// optimizer_step() and gather_parameters(): `update(piece)` for each
  /// piece, bucket by bucket, each bucket's allgather launched once its
  /// pieces are updated (transient buckets: the one before completed while
  /// it travels, so that at most two hold their pages at once), then the rest.
  template <class Update>
  void update_and_gather(const char* what, Update& update);
  /// Stage 3's gather() of parameters `indices` (checked); other stages: a
  /// guard that holds nothing.
  held_values gather(std::span<const std::size_t> indices);

 private:
  using bucket = detail::ddp_bucket<memory_space>;
  using shard = bucket_shard<memory_space>;

  /// Stage 1 or 2: the optimizer updates this rank's pieces (shard()), and
  /// the bucket layout stays as built (no rebuild moves a shard).
  bool shards_optimizer_state() const noexcept;
  /// Stage 3: DDP holds each bucket's values as this rank's shard
  /// (owned_values), whole only while gather() holds the bucket.
  bool shards_parameters() const noexcept;
  /// Stage 2 over more than one rank: this rank's averaged gradients are its
  /// shard's only, in `owned` (buckets are reduce-scattered there by the
  /// topology: hierarchical, node-local first).
  bool shards_gradients() const noexcept;
  /// Sharding over more than one rank (or stage 3): each rank owns a shard
  /// of every bucket (padded to size() equal shards), and the updated values
  /// come back by allgather.
  bool owns_bucket_shards() const noexcept;
  /// Stage 2 where memory can give pages back (the host): each bucket's
  /// gradient pages are returned once it is reduce-scattered, and again once
  /// its allgather is copied out, so that gradients take memory only while a
  /// bucket is being filled or is in flight (ZeRO stage 2's gradient memory).
  bool transient_buckets() const noexcept;
  /// The first element of this rank's shard in bucket b: its part is the
  /// topology's shard_position() (the rank, flat; local rank x nodes + node
  /// rank, hierarchical), where a two-level reduce-scatter leaves it.
  std::size_t shard_first(std::size_t b) const;
  /// Stage 3 on the host: freed whole-value buffers kept for reuse, at most
  /// the prefetch window's worth and one more.
  std::size_t spare_whole_most() const noexcept;

  void make_pieces();
  void add_master();
  void round_master(std::span<const shard_piece> pieces);
  void adopt_changed_values();
  std::size_t shard_value_size(const char* what, std::size_t bytes) const;
  void check_updatable(const char* what) const;
  work launch_gather(std::size_t b);
  work allgather_bucket(std::size_t b, std::byte* mine, std::byte* all);
  std::byte* gathered(std::size_t b);
  void complete_gather(std::size_t b);
  void finish_gather(std::vector<work>& gathers, std::size_t completed);
  void abandon_gathers(std::vector<work>& gathers, const std::string& why);
  [[noreturn]] void not_gathered(std::size_t i) const;

  // Stage 3.
  void release(std::span<const std::size_t> buckets) noexcept;
  void point_values(std::size_t b, std::byte* whole) noexcept;
  void post_gather_locked(std::size_t b, bool ahead);
  void settle_gather(std::size_t b);
  void order_after_gather(detail::posted_task& posted);
  void follow_order_locked(const std::vector<std::size_t>& unit);
  std::vector<std::size_t> refresh_window_locked();
  void drop_unwanted(std::span<const std::size_t> candidates);
  void end_gather_pass_locked();
  void drop_whole_locked();
  void free_whole_locked(shard& s) noexcept;
  storage whole_buffer_locked(std::size_t bytes, int device);

  core_type& core_;
  // Stage 3 on the host: where the model's value pointers point between
  // gathers (null on a GPU, or where no address space could be reserved).
  // DDP's destructor sets the pointers to null before it goes.
  std::unique_ptr<value_fence> fence_;
  std::vector<shard> shards_;  // per bucket of the core's current layout
  /// Transient buckets: where the allgathers land, two in turn (the largest bucket's size).
  std::array<storage, 2> staging_;
  std::vector<storage> spare_whole_;  // stage 3, host: under the core's lock
  // This rank's pieces (whole parameters without sharding), and whether the
  // last step was synchronized and not yet updated (optimizer_step()).
  std::vector<shard_piece> pieces_;
  std::size_t shard_elements_ = 0;
  /// ddp_options::master_weights: the float32 copies of the 16-bit pieces,
  /// one after another (kept across a rebuild: the pieces are then whole
  /// parameters in index order, whatever the buckets).
  storage master_;
  bool updatable_ = false;
  std::vector<bool> gathered_;  // stage 3: a gather() asked for parameter i in this step
  /// Stage 3's prefetch: the units (each gather() call's buckets) of the
  /// last pass through the model, in order, and where this pass is in them.
  /// A pass is a step, or the calls from the recorded first unit on (an
  /// evaluation, a no_sync() micro-batch). Touched under the lock.
  struct gather_order {
    std::vector<std::vector<std::size_t>> recorded;
    std::vector<std::vector<std::size_t>> current;  ///< this pass's units so far
    std::size_t next = 0;   ///< the position in `recorded` of the unit expected next
    bool in_order = true;   ///< this pass has followed `recorded` so far
    bool overflow = false;  ///< this pass made more calls than are kept
  } order_;
  dtrain::gather_counts gather_counts_;
};

}  // namespace detail
}  // namespace dtrain
