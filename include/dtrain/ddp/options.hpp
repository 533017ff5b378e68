#pragma once
/// @file
/// What a user chooses about DistributedDataParallel: ddp_options, gradient
/// compression, and the bucket a communication hook is handed.

#include <dtrain/backend/types.hpp>
#include <dtrain/config.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace dtrain {

/// How DistributedDataParallel sends float32 gradients.
enum class gradient_compression : std::uint8_t {
  none,      ///< as they are
  float16,   ///< IEEE half: 10-bit mantissa, range ±65504 (scale losses that overflow)
  bfloat16,  ///< float32's range with an 8-bit mantissa
};

[[nodiscard]] constexpr std::string_view to_string(gradient_compression c) noexcept {
  switch (c) {
    case gradient_compression::none: return "none";
    case gradient_compression::float16: return "float16";
    case gradient_compression::bfloat16: return "bfloat16";
  }
  return "unknown";
}

/// Where the sums of a 16-bit reduction are kept: in 16 bits (the engine's
/// own reduction, every partial sum rounded: the error of the mean grows with
/// the number of ranks), or in float32 (Megatron-LM's reduce-scatter with
/// float32 accumulation).
enum class accumulation : std::uint8_t {
  wire,     ///< in the type on the wire: the engine's allreduce or reduce-scatter
  float32,  ///< every rank sums the 16-bit blocks of its part in float32, rounded once
};

[[nodiscard]] constexpr std::string_view to_string(accumulation a) noexcept {
  switch (a) {
    case accumulation::wire: return "wire";
    case accumulation::float32: return "float32";
  }
  return "unknown";
}

/// What DistributedDataParallel shards across the ranks (ZeRO's stages, as
/// DeepSpeed numbers them; PyTorch: ZeroRedundancyOptimizer is stage 1, FSDP's
/// SHARD_GRAD_OP stage 2). Each bucket is cut into `size()` equal contiguous
/// shards (zeros pad the bucket); rank r owns shard r of every bucket: the
/// optimizer updates only those values (DistributedDataParallel::shard(),
/// optimizer_step()), with state the size of the shard, and the updated
/// values are allgathered.
enum class sharding : std::uint8_t {
  none = 0,       ///< DDP: every rank holds and updates everything
  optimizer = 1,  ///< stage 1: the gradients are averaged whole (an allreduce)
  /// Stage 2: each bucket is reduce-scattered as soon as it is ready, and a
  /// rank keeps only its shard of the averaged gradients (the optimizer
  /// state too, as stage 1).
  gradients = 2,
  /// Stage 3 (FSDP's FULL_SHARD): as stage 2, and between uses a rank holds
  /// only its shard of the parameters' values too. The model declares its
  /// values with param(name, T*& values, count, T*& gradient), and holds
  /// DistributedDataParallel::gather(...) around each part's forward and
  /// backward: the values are whole (allgathered) while the guard lives, and
  /// the model's pointers are null otherwise. The optimizer updates the
  /// shard; nothing is allgathered after it. Host memory (Gloo, MPI) only.
  parameters = 3,
};

[[nodiscard]] constexpr std::string_view to_string(sharding s) noexcept {
  switch (s) {
    case sharding::none: return "none";
    case sharding::optimizer: return "optimizer";
    case sharding::gradients: return "gradients";
    case sharding::parameters: return "parameters";
  }
  return "unknown";
}

/// One piece of the shard a rank owns (DistributedDataParallel::shard()):
/// the part of one parameter that falls in one bucket's shard. An
/// elementwise optimizer updates `master` from `gradients` (the mean over
/// ranks), with its state at `state_offset` of an array of shard_elements().
struct shard_piece {
  std::size_t parameter = 0;     ///< index into parameters()
  std::size_t offset = 0;        ///< its first element within that parameter
  std::size_t state_offset = 0;  ///< its first element within the rank's shard (the state's index)
  std::size_t bucket = 0;        ///< the bucket it belongs to
  buffer values;                 ///< the parameter's values (the model's memory)
  buffer gradients;              ///< their averaged gradients (DDP's memory), same count
  /// What the optimizer updates: `values` itself, or (ddp_options::
  /// master_weights, a bfloat16 or float16 parameter) a float32 copy of them
  /// in DDP's memory, rounded into `values` once the piece is updated.
  buffer master;
};

/// One range of a sharded array that this rank holds (DistributedDataParallel::
/// shard_ranges(), checkpoint::add_sharded): `count` elements starting at
/// `global` in the whole array, at `local` in this rank's own.
struct shard_range {
  std::uint64_t global = 0;
  std::uint64_t local = 0;
  std::uint64_t count = 0;
};

/// The memory DistributedDataParallel holds itself, per rank, in bytes
/// (DistributedDataParallel::memory_use()); the model's values, and its own
/// gradient buffers where they are not bucket views, are the model's.
struct ddp_memory_use {
  std::size_t buckets = 0;  ///< the gradient buckets (views point into them), padding included
  std::size_t shards = 0;   ///< sharding: this rank's shard of each bucket
  std::size_t scratch = 0;  ///< compression's 16-bit copies, the hierarchical topology's scratch
  /// Stage 3 (sharding::parameters): this rank's shard of the values (the
  /// model holds none).
  std::size_t values = 0;
  /// Stage 3: the whole values of the buckets whole now (those gather()
  /// holds, and the prefetched ones: at most prefetch_units units more).
  std::size_t gathered = 0;
  /// ddp_options::master_weights: the float32 copy of this rank's pieces of
  /// 16-bit parameters.
  std::size_t master = 0;
  /// Stage 2 on the host: the buckets' pages are resident only while a
  /// bucket is being filled or is in flight (given back after its
  /// reduce-scatter and after its allgather), so `buckets` is address space
  /// and held() leaves it out.
  bool transient_buckets = false;
  [[nodiscard]] std::size_t total() const noexcept {
    return buckets + shards + scratch + values + gathered + master;
  }
  /// What stays allocated between steps.
  [[nodiscard]] std::size_t held() const noexcept {
    return total() - (transient_buckets ? buckets : 0);
  }
};

/// Stage 3's allgathers of values on this rank since construction
/// (DistributedDataParallel::gather_counts()), counted in buckets.
struct gather_counts {
  std::uint64_t on_demand = 0;   ///< where a gather() asked for them
  std::uint64_t prefetched = 0;  ///< ahead of the gather() that used them (prefetch_units)
  std::uint64_t unused = 0;      ///< of those, freed unused (a pass in another order)
  std::uint64_t bytes = 0;       ///< arrived: the whole buckets, less this rank's shard
};

/// Straggler detection while training is healthy: which rank the others
/// wait for (DistributedDataParallel::stragglers(), ddp/straggler.hpp).
/// Aggregate: `{.stragglers = {.every = 1, .threshold = 0.2}}`.
struct straggler_options {
  /// false: nothing recorded, nothing exchanged (DTRAIN_STRAGGLERS=off too).
  bool enabled = true;
  /// Steps between the ranks' exchanges of their records (one allgather of
  /// two numbers per rank and step). 0: automatic, the fewest steps that keep
  /// an exchange under 0.5 % of the time they span (at most 50), chosen again
  /// at each exchange from what the last one cost. DTRAIN_STRAGGLERS (a
  /// number, "auto" or "off") wins. The same on every rank.
  std::size_t every = 0;
  /// A rank is slow when it was late in each of the last `steps` steps (by
  /// at least half this share of the median step time, their median above
  /// it), or when the median of its delay over the last 3 times `steps` steps
  /// is above it; it keeps pace again when the median of the last `steps` is below
  /// half of it. The collectives are slow when their median time after the
  /// last rank's arrival, over 3 times `steps`, is this share of a step above its lowest.
  double threshold = 0.1;
  /// The steps each judgement looks back over (3 to 1000): a rank late in
  /// each of them is named; one late in most is named after 3 times as many.
  std::size_t steps = 5;
  /// Delays (and collectives' extra time) shorter than this are never
  /// reported, whatever their share: on steps of a fraction of a
  /// millisecond, the host's scheduler alone makes them.
  std::chrono::microseconds min_delay{1000};
  /// Rank 0 says on stderr when a rank becomes slow and when it keeps pace
  /// again (false: only stragglers() tells).
  bool report = true;
};

/// Options of DistributedDataParallel, PyTorch DDP's names where they exist.
/// Aggregate: `{.bucket_cap_mb = 4, .find_unused_parameters = true}`.
struct ddp_options {
  /// The bucket rule is PyTorch DDP's: gradients join the open bucket of
  /// their (type, device) in the order they become ready, and a bucket closes
  /// right after the gradient that brings it to its cap, however large that
  /// gradient is. A bucket is never closed early to keep a large gradient out,
  /// so only the last bucket of each (type, device) holds less than its cap.
  /// The cap of every bucket after the first, in MiB.
  double bucket_cap_mb = 25;
  /// The cap of the first bucket (the last layers' gradients, ready first):
  /// small, so that communication starts early in the backward pass.
  double first_bucket_cap_mb = 1;
  /// Point rebindable gradients (param() with a pointer) into the buckets:
  /// no copies. false: copy every gradient in and the mean back out.
  bool gradient_as_bucket_view = true;
  /// Parameters never marked in a step contribute zero instead of being an
  /// error (for models whose steps skip parts of the network). "Unused"
  /// means "not marked": dtrain has no autograd graph to find them.
  bool find_unused_parameters = false;
  /// With find_unused_parameters: name, once, on rank 0's stderr the
  /// parameters that no rank marked in the first steps (a forgotten
  /// mark_ready looks just like an unused parameter). false: silent.
  bool report_unused_parameters = true;
  /// After the first step, lay the buckets out once more in the order the
  /// gradients actually became ready (rank 0's order, sent to every rank).
  bool rebuild_buckets = true;
  /// Construction copies rank 0's parameters and buffers to every rank.
  bool broadcast_parameters = true;
  /// Send float32 gradients as 16-bit floats (cast, reduce, cast back).
  gradient_compression compression = gradient_compression::none;
  /// Where the sums of 16-bit gradients (a bfloat16 or float16 model's, or
  /// float32 ones sent compressed) are kept. `wire`: the engine's reduction
  /// in 16 bits (compression divides each gradient by the world size first,
  /// so that the sum cannot overflow). `float32`: the 16-bit blocks of each
  /// rank's part of a bucket are exchanged all-to-all, summed in float32 in
  /// rank order (hierarchical topology: node-local order on each node, then
  /// node order, the partial sums crossing the nodes in float32), divided by
  /// the world size and rounded once; the parts travel back in 16 bits (an
  /// allgather; stages 2 and 3 keep their part, unrounded where the
  /// gradients are float32). 16-bit bytes on the wire, one rounding whatever
  /// the world size, the same bits on every rank; buckets are padded to a
  /// multiple of the world size, and each holds scratch for the exchange
  /// (memory_use().scratch). Allows compression at stages 2 and 3. float32
  /// and float64 buckets without compression are reduced as they are. The
  /// same on every rank.
  accumulation accumulate = accumulation::wire;
  /// false: nothing is sent before synchronize() (for measuring what overlap buys).
  bool overlap = true;
  /// At world size 1 DDP communicates nothing: the mean over one rank is its
  /// gradient, so no collective is issued, no thread woken, no copy made
  /// (compression still rounds, as it would on more ranks; a comm hook still
  /// runs). true: reduce every bucket as on more ranks (to exercise an
  /// engine's path with one GPU).
  bool always_reduce = false;
  /// A Chrome trace of every step (steps, mark_ready per parameter, buckets,
  /// the waits in synchronize(); on CUDA streams each bucket's device time)
  /// goes to this file, the rank inserted (trace.json -> trace.rank0.json);
  /// empty: none. DTRAIN_TIMELINE wins.
  std::string timeline = {};
  /// A directory where each rank writes its metrics (dtrain_rank<R>.prom, the
  /// Prometheus text format that node-exporter's textfile collector reads) at
  /// the end of a step, at most once a second, and at destruction; empty:
  /// none. DTRAIN_METRICS_DIR wins.
  std::string metrics_dir = {};
  /// Backends on CUDA streams (NCCL): the compute stream, the one that wrote
  /// the parameters and will run the backward pass (a cudaStream_t). The first
  /// broadcast of rank 0's values is ordered after it, so that values written
  /// on it (initialised, loaded, copied) are the ones sent and are not written
  /// over what arrives; set_stream() changes it later. Null: the legacy default
  /// stream. Host backends (Gloo, MPI) have no stream: leave it null.
  stream_handle stream = nullptr;
  /// Shard the optimizer state (and the averaged gradients, and the values)
  /// across the ranks: ZeRO stage 1, 2 or 3 (see dtrain::sharding). The
  /// bucket layout is then the first one (no rebuild): a rank's shard, and
  /// its optimizer state, stay where they are. Not with a comm hook at
  /// stages 2 and 3, nor compression there without accumulate = float32.
  dtrain::sharding sharding = dtrain::sharding::none;
  /// Stage 3: how many units (gather() calls) ahead of the one in use DDP
  /// allgathers while the model computes, in the order of gather() calls
  /// recorded in the step before (FSDP's forward and backward prefetch; at
  /// most 1 + prefetch_units units whole at once besides those the model
  /// holds). A step whose order differs gathers on demand from where it
  /// differs, and is the order followed from the next step. 0: on demand
  /// only. The same on every rank.
  std::size_t prefetch_units = 1;
  /// 16-bit models (bfloat16, float16 parameters and gradients): DDP keeps a
  /// float32 copy of this rank's shard of their values (the master weights;
  /// every parameter without sharding or on one rank), which the optimizer
  /// updates (shard_piece::master) and which DDP rounds into the 16-bit
  /// values, once, before they are gathered: updates too small for 16 bits
  /// add up (Megatron's and DeepSpeed's fp32 main parameters, FSDP's sharded
  /// fp32 parameters). float32 and float64 parameters are their own master.
  /// Checkpoints of the shard (checkpoint::add_sharded(name, ddp)) hold the
  /// master copy. The bucket layout is then the first one (no rebuild), as
  /// with sharding. The same on every rank.
  bool master_weights = false;
  /// Which rank is slow while training is healthy (straggler_options).
  straggler_options stragglers = {};
};

/// One bucket, as a communication hook sees it.
struct gradient_bucket {
  std::size_t index = 0;  ///< launch order, 0 first
  buffer data;            ///< the flat gradients: reduce them in place
  int world_size = 1;
  std::span<const std::size_t> parameters;  ///< indices into parameters(), in layout order
  /// Backends on CUDA streams (NCCL): the compute stream the bucket is ordered
  /// after; enqueue the reduction after it. Null for host backends.
  stream_handle stream = nullptr;
};

}  // namespace dtrain
