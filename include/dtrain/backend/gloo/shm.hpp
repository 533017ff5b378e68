#pragma once
/// @file
/// The same-host path of the Gloo communicator: an allreduce through one
/// shared-memory segment that every rank of a communicator maps, for when all
/// of them run on one host. Gloo has no shared-memory transport (NCCL and
/// Open MPI have theirs), so between processes on one host it sends every
/// byte through TCP over loopback, across the kernel twice per hop. Here each
/// rank copies into its slot the parts of its input that the others reduce,
/// reduces its own part over every rank's data (in rank order) into the
/// result slot and its output, and copies the others' parts of the result
/// out: about two passes over memory, and two waits for the slowest rank.
///
/// The segment (shm_open) is made by rank 0 under a random name with mode
/// 0600 and is unlinked once every rank has opened it (backend/gloo/gloo.hpp runs
/// that over Gloo); its size is fixed when it is made: (ranks + 1) slots of
/// shm_slot_bytes(ranks). Ranks wait for each other on futexes, never by
/// spinning for long. Every rank holds a lock on one byte of the segment's
/// file while it lives, which the kernel drops when the process dies: so a
/// waiting rank tells a dead peer from a slow one (and, unlike a pid, in any
/// pid namespace). A rank that gives up (timeout, dead peer) says so in the
/// segment, and the others stop waiting at once. Linux only; this header
/// needs neither Gloo nor MPI, so the unit tests run it between forked
/// processes.

#include <dtrain/config.hpp>

#include <dtrain/backend/types.hpp>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#if defined(__linux__)
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#define DTRAIN_HAS_SHM() 1
#else
#define DTRAIN_HAS_SHM() 0
#endif

namespace dtrain::detail {

/// A failure on the shared-memory path: a peer that died, gave up or did not
/// come within the timeout (`timed_out`), or a segment that cannot be made.
class shm_failure : public std::runtime_error {
 public:
  shm_failure(const std::string& what, bool timed_out)
      : std::runtime_error(what), timed_out_(timed_out) {}
  [[nodiscard]] bool timed_out() const noexcept { return timed_out_; }

 private:
  bool timed_out_;
};

/// The bytes of one slot for a group of `ranks`: 1 MiB, less when the
/// (ranks + 1) slots would pass 16 MiB (so 15 ranks or more), never below
/// 4 KiB. A larger allreduce runs as a sequence of slot-sized chunks.
[[nodiscard]] constexpr std::size_t shm_slot_bytes(int ranks) noexcept {
  constexpr std::size_t most = std::size_t{1} << 20;
  constexpr std::size_t budget = std::size_t{16} << 20;
  constexpr std::size_t page = 4096;
  const std::size_t share = budget / (static_cast<std::size_t>(ranks < 1 ? 1 : ranks) + 1);
  const std::size_t slot = share < most ? share / page * page : most;
  return slot < page ? page : slot;
}

/// Calls `loop(f)` with f(x, y) the element-wise `op` on T (avg as sum), so
/// that the op is chosen once per call, not per element.
template <element T, class Loop>
void shm_with_op(reduce_op op, Loop&& loop) {
  switch (op) {
    case reduce_op::min: loop([](T x, T y) { return y < x ? y : x; }); break;
    case reduce_op::max: loop([](T x, T y) { return x < y ? y : x; }); break;
    case reduce_op::prod: loop([](T x, T y) { return static_cast<T>(x * y); }); break;
    case reduce_op::sum:
    case reduce_op::avg: loop([](T x, T y) { return static_cast<T>(x + y); }); break;
  }
}

/// `out` = `a` op `b`, element-wise (avg as sum), over three distinct
/// buffers, in blocks of 16 elements, which GCC and Clang vectorise at -O2.
template <element T>
void shm_combine(T* __restrict out, const T* __restrict a, const T* __restrict b, std::size_t n,
                 reduce_op op) noexcept {
  if constexpr (std::same_as<T, float16> || std::same_as<T, bfloat16>) {
    std::memcpy(out, a, n * sizeof(T));
    reduce_host(out, b, n, op);
  } else {
    shm_with_op<T>(op, [&](auto f) {
      std::size_t i = 0;
      for (; i + 16 <= n; i += 16) {
        for (std::size_t j = 0; j < 16; ++j) out[i + j] = f(a[i + j], b[i + j]);
      }
      for (; i < n; ++i) out[i] = f(a[i], b[i]);
    });
  }
}

/// `inout` op= `in`, element-wise (avg as sum), as shm_combine.
template <element T>
void shm_reduce(T* __restrict inout, const T* __restrict in, std::size_t n, reduce_op op) noexcept {
  if constexpr (std::same_as<T, float16> || std::same_as<T, bfloat16>) {
    reduce_host(inout, in, n, op);
  } else {
    shm_with_op<T>(op, [&](auto f) {
      std::size_t i = 0;
      for (; i + 16 <= n; i += 16) {
        for (std::size_t j = 0; j < 16; ++j) inout[i + j] = f(inout[i + j], in[i + j]);
      }
      for (; i < n; ++i) inout[i] = f(inout[i], in[i]);
    });
  }
}

#if DTRAIN_HAS_SHM()

/// One mapped segment, as one rank of the group sees it. Move-only; unmaps,
/// closes (dropping this rank's lock) and never unlinks on destruction.
class shm_segment {
 public:
  static constexpr std::uint64_t magic = 0x31'6d'68'73'6e'72'74'64ULL;  // "dtrnshm1"

  shm_segment() = default;
  shm_segment(shm_segment&& o) noexcept { swap(o); }
  shm_segment& operator=(shm_segment&& o) noexcept {
    shm_segment(std::move(o)).swap(*this);
    return *this;
  }
  shm_segment(const shm_segment&) = delete;
  shm_segment& operator=(const shm_segment&) = delete;
  ~shm_segment();

  /// Rank 0: makes the segment `name` ("/dtrain-..."), which must not exist,
  /// for `size` ranks. Throws shm_failure (not timed out) saying which call failed.
  static shm_segment create(const std::string& name, int size);

  /// Every other rank: opens the segment rank 0 made and checks that it was
  /// made for `size` ranks. Throws shm_failure (not timed out).
  static shm_segment open(const std::string& name, int rank, int size);

  /// Removes the name (every rank keeps its mapping). Rank 0, once all have opened it.
  static void unlink(const std::string& name) noexcept { ::shm_unlink(name.c_str()); }

  [[nodiscard]] bool valid() const noexcept { return base_ != nullptr; }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] std::size_t slot_bytes() const noexcept { return slot_; }

  /// `out` (count elements) becomes the reduction of every rank's `in` (in
  /// place when they are the same). Every rank of the group must call it with
  /// the same count, type and op, in the same order among its allreduces. avg
  /// sums, then divides each element once by the group's size. The result is
  /// the same bits on every rank: element i is reduced by one rank, in rank
  /// order. Throws shm_failure: timed out when a peer did not come within
  /// `timeout` (for the whole call), not timed out when one died or gave up.
  /// Either way the segment is then unusable, and so are the peers' copies.
  template <element T>
  void allreduce(const T* in, T* out, std::size_t count, reduce_op op,
                 std::chrono::milliseconds timeout) {
    if (!base_) throw shm_failure("the shared-memory segment is not mapped", false);
    if (size_ == 1) {  // a group of one (the Gloo communicator never makes one)
      if (in != out && count > 0) std::memcpy(out, in, count * sizeof(T));
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    const std::size_t chunk = slot_ / sizeof(T);
    const auto ranks = static_cast<std::size_t>(size_);
    const auto me = static_cast<std::size_t>(rank_);
    const std::size_t chunks = (count + chunk - 1) / chunk;
    for (std::size_t c = 0; c < chunks; ++c) {
      const std::size_t offset = c * chunk;
      const std::size_t n = count - offset < chunk ? count - offset : chunk;
      const std::uint32_t k = ++chunk_;
      // This rank reduces elements [lo, hi) of the chunk; the others, the rest.
      const std::size_t lo = n * me / ranks, hi = n * (me + 1) / ranks;
      const T* own = in + offset;
      // 1. The parts the others reduce, into this rank's slot (its own part
      //    it reads where it is). Every rank finished reading the slots of
      //    the previous chunk before it announced that chunk reduced.
      std::memcpy(slot<T>(me), own, lo * sizeof(T));
      std::memcpy(slot<T>(me) + hi, own + hi, (n - hi) * sizeof(T));
      arrive(k, shape_word(collective::allreduce, dtype_of<T>, op, count), deadline, timeout, c,
             chunks);
      // 2. This rank's part, over every rank's data in rank order, into the
      //    result slot and into `out` (in place too: nobody reads this part
      //    of `in` after this). Every rank finished copying the previous
      //    chunk's result out before it announced this chunk's input.
      if (hi > lo) {
        const auto from = [&](std::size_t q) { return (q == me ? own : slot<T>(q)) + lo; };
        T* result = slot<T>(ranks) + lo;
        shm_combine(result, from(0), from(1), hi - lo, op);
        for (std::size_t q = 2; q < ranks; ++q) shm_reduce(result, from(q), hi - lo, op);
        if (op == reduce_op::avg) divide_host(buffer{result, hi - lo, dtype_of<T>}, size_);
        std::memcpy(out + offset + lo, result, (hi - lo) * sizeof(T));
      }
      publish(flags(rank_).reduced, k);
      wait_all(&rank_flags::reduced, k, deadline, timeout, "reduce", c, chunks);
      // 3. The other ranks' parts of the result out.
      std::memcpy(out + offset, slot<T>(ranks), lo * sizeof(T));
      std::memcpy(out + offset + hi, slot<T>(ranks) + hi, (n - hi) * sizeof(T));
    }
  }

  /// `out` (`block` elements) becomes the reduction of every rank's block
  /// `rank()` of `in` (size() x `block` elements): a reduce-scatter, with the
  /// same bits as allreduce() gives that block (each element reduced in rank
  /// order) and half its copies. Every rank calls it with the same block,
  /// type and op, in the same order among its collectives on the segment.
  /// In chunks: each rank copies the part of every other rank's block into
  /// its slot, and once all have, reduces its own block's part from the
  /// slots into `out`. Throws shm_failure as allreduce.
  template <element T>
  void reduce_scatter(const T* in, T* out, std::size_t block, reduce_op op,
                      std::chrono::milliseconds timeout) {
    if (!base_) throw shm_failure("the shared-memory segment is not mapped", false);
    if (size_ == 1) {
      if (in != out && block > 0) std::memcpy(out, in, block * sizeof(T));
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    const auto ranks = static_cast<std::size_t>(size_);
    const auto me = static_cast<std::size_t>(rank_);
    const std::size_t chunk = std::max<std::size_t>(1, slot_ / sizeof(T) / ranks);  // per block
    const std::size_t chunks = (block + chunk - 1) / chunk;
    for (std::size_t c = 0; c < chunks; ++c) {
      const std::size_t offset = c * chunk;
      const std::size_t n = block - offset < chunk ? block - offset : chunk;
      const std::uint32_t k = ++chunk_;
      // 1. This chunk of every other rank's block into this rank's slot, at
      //    q x n. Every rank finished reading the slots of the previous chunk
      //    before it announced that chunk reduced.
      for (std::size_t q = 0; q < ranks; ++q) {
        if (q != me) std::memcpy(slot<T>(me) + q * n, in + q * block + offset, n * sizeof(T));
      }
      arrive(k, shape_word(collective::reduce_scatter, dtype_of<T>, op, block), deadline, timeout,
             c, chunks);
      // 2. This rank's block, over every rank's data in rank order.
      const auto from = [&](std::size_t q) {
        return q == me ? in + me * block + offset : slot<T>(q) + me * n;
      };
      T* result = out + offset;
      if (out == in + me * block) {
        // `out` is this rank's block of `in` (in place): combine through the result slot.
        T* staged = slot<T>(ranks) + me * n;
        shm_combine(staged, from(0), from(1), n, op);
        for (std::size_t q = 2; q < ranks; ++q) shm_reduce(staged, from(q), n, op);
        std::memcpy(result, staged, n * sizeof(T));
      } else {
        shm_combine(result, from(0), from(1), n, op);
        for (std::size_t q = 2; q < ranks; ++q) shm_reduce(result, from(q), n, op);
      }
      if (op == reduce_op::avg) divide_host(buffer{result, n, dtype_of<T>}, size_);
      publish(flags(rank_).reduced, k);
      wait_all(&rank_flags::reduced, k, deadline, timeout, "reduce", c, chunks);
    }
  }

  /// `out` (size() x `bytes`) becomes every rank's `in` (`bytes` each), in
  /// rank order; `in` may be this rank's block of `out`. Every rank calls it
  /// with the same `bytes`, in the same order among its collectives on the
  /// segment. In chunks of a slot: each rank copies its chunk into its slot,
  /// and, once all have, every slot out. Throws shm_failure as allreduce.
  void allgather(const void* in, void* out, std::size_t bytes, std::chrono::milliseconds timeout) {
    if (!base_) throw shm_failure("the shared-memory segment is not mapped", false);
    const auto ranks = static_cast<std::size_t>(size_);
    const auto me = static_cast<std::size_t>(rank_);
    const auto* from = static_cast<const unsigned char*>(in);
    auto* to = static_cast<unsigned char*>(out);
    if (size_ == 1) {
      if (from != to && bytes > 0) std::memcpy(to, from, bytes);
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    const std::size_t chunks = (bytes + slot_ - 1) / slot_;
    for (std::size_t c = 0; c < chunks; ++c) {
      const std::size_t offset = c * slot_;
      const std::size_t n = bytes - offset < slot_ ? bytes - offset : slot_;
      const std::uint32_t k = ++chunk_;
      // 1. This rank's chunk into its slot. Every rank finished reading the
      //    slots of the previous chunk before it announced that chunk copied out.
      std::memcpy(slot<unsigned char>(me), from + offset, n);
      arrive(k, shape_word(collective::allgather, dtype::uint8, reduce_op::sum, bytes), deadline,
             timeout, c, chunks);
      // 2. Every rank's chunk out (this rank's own from `in`, unless it is there already).
      for (std::size_t q = 0; q < ranks; ++q) {
        unsigned char* place = to + q * bytes + offset;
        if (q == me) {
          if (place != from + offset) std::memcpy(place, from + offset, n);
        } else {
          std::memcpy(place, slot<unsigned char>(q), n);
        }
      }
      publish(flags(rank_).reduced, k);
      wait_all(&rank_flags::reduced, k, deadline, timeout, "copy out", c, chunks);
    }
  }

  /// Block j of `in` (size() blocks of `block` bytes) to rank j, and rank i's
  /// block for this rank into block i of `out` (out of place). Every rank
  /// calls it with the same `block`, in the same order among its collectives
  /// on the segment. In chunks: each rank copies its chunk of every other
  /// rank's block into its slot (at q x n, as reduce_scatter() does), and once
  /// all have, its own chunk out of every slot. Throws shm_failure as allreduce.
  void alltoall(const void* in, void* out, std::size_t block, std::chrono::milliseconds timeout) {
    if (!base_) throw shm_failure("the shared-memory segment is not mapped", false);
    const auto* from = static_cast<const unsigned char*>(in);
    auto* to = static_cast<unsigned char*>(out);
    const auto ranks = static_cast<std::size_t>(size_);
    const auto me = static_cast<std::size_t>(rank_);
    if (block > 0) std::memcpy(to + me * block, from + me * block, block);  // its own block
    if (size_ == 1) return;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    const std::size_t chunk = std::max<std::size_t>(1, slot_ / ranks);  // bytes per block
    const std::size_t chunks = (block + chunk - 1) / chunk;
    for (std::size_t c = 0; c < chunks; ++c) {
      const std::size_t offset = c * chunk;
      const std::size_t n = block - offset < chunk ? block - offset : chunk;
      const std::uint32_t k = ++chunk_;
      // 1. This chunk of every other rank's block into this rank's slot, at
      //    q x n. Every rank finished reading the slots of the previous chunk
      //    before it announced that chunk copied out.
      for (std::size_t q = 0; q < ranks; ++q) {
        if (q != me) std::memcpy(slot<unsigned char>(me) + q * n, from + q * block + offset, n);
      }
      arrive(k, shape_word(collective::alltoall, dtype::uint8, reduce_op::sum, block), deadline,
             timeout, c, chunks);
      // 2. What every other rank put there for this one.
      for (std::size_t q = 0; q < ranks; ++q) {
        if (q != me) std::memcpy(to + q * block + offset, slot<unsigned char>(q) + me * n, n);
      }
      publish(flags(rank_).reduced, k);
      wait_all(&rank_flags::reduced, k, deadline, timeout, "copy out", c, chunks);
    }
  }

  /// Tells the peers that this rank gave up, and `why`, waking any that wait.
  /// The first rank to give up is the one they name; `timed_out` (it gave up
  /// at the timeout) makes their failures timeouts too.
  void abandon(std::string_view why = {}, bool timed_out = false) noexcept;

 private:
  /// A futex word and the count of ranks sleeping on it (so that a rank that
  /// announces progress makes a system call only when someone sleeps).
  struct alignas(64) flag {
    std::atomic<std::uint32_t> value{0};
    std::atomic<std::uint32_t> sleepers{0};
  };
  /// One rank's progress: the last chunk it copied in, and the last it
  /// reduced; and what it called (shape_word()), written before `arrived`.
  struct rank_flags {
    flag arrived;
    flag reduced;
    std::atomic<std::uint64_t> shape{0};
  };
  enum class collective : std::uint8_t { allreduce, reduce_scatter, allgather, alltoall };
  /// A collective, its type, op and count (elements; bytes for allgather and
  /// alltoall) in one word that every rank of the chunk must have alike.
  static constexpr std::uint64_t shape_word(collective kind, dtype type, reduce_op op,
                                            std::size_t count) noexcept {
    return (std::uint64_t{static_cast<std::uint8_t>(kind)} << 60) |
           (std::uint64_t{static_cast<std::uint8_t>(type)} << 52) |
           (std::uint64_t{static_cast<std::uint8_t>(op)} << 48) |
           (static_cast<std::uint64_t>(count) & ((std::uint64_t{1} << 48) - 1));
  }
  /// "allreduce(1000 x float32, sum)"
  static std::string describe_shape(std::uint64_t shape);
  struct alignas(64) control {
    std::uint64_t magic = 0;
    std::uint64_t slot_bytes = 0;
    std::uint32_t size = 0;
    std::atomic<std::uint32_t> claimed{0};       // 1 once a rank gives up
    std::atomic<std::uint32_t> abandoned_by{0};  // then 1 + that rank, once `why` is written
    std::atomic<std::uint32_t> timed_out{0};     // written before abandoned_by: 1 for a timeout
    char why[236] = {};
  };
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t) &&
                std::atomic<std::uint32_t>::is_always_lock_free);

  static constexpr std::size_t data_offset(int size) noexcept {
    const std::size_t end = sizeof(control) + static_cast<std::size_t>(size) * sizeof(rank_flags);
    return (end + 4095) / 4096 * 4096;
  }

  [[noreturn]] static void fail_call(const std::string& call) {
    throw shm_failure(call + ": " + std::strerror(errno), false);
  }

  void map(const std::string& name);

  // An open-file-description lock on byte `rank` of the file: it lives as
  // long as this mapping's descriptor, and no longer than the process.
  void lock_own_byte(const std::string& name);

  // False only when the peer's lock is gone: it exited. True when unsure.
  [[nodiscard]] bool alive(int peer) const noexcept;

  [[nodiscard]] control& head() const noexcept {
    return *std::launder(static_cast<control*>(base_));
  }
  [[nodiscard]] rank_flags& flags(int r) const noexcept;
  // Slot q of the ranks; slot `size` is the result.
  template <class T>
  [[nodiscard]] T* slot(std::size_t q) const noexcept {
    return reinterpret_cast<T*>(static_cast<unsigned char*>(base_) + data_offset(size_) +
                                q * slot_);
  }

  static long futex(std::atomic<std::uint32_t>& word, int op, std::uint32_t value,
                    const timespec* wait) noexcept;
  static void wake(flag& f) noexcept {
    futex(f.value, FUTEX_WAKE, static_cast<std::uint32_t>(INT_MAX), nullptr);
  }
  static void publish(flag& f, std::uint32_t k) noexcept;
  static bool reached(std::uint32_t value, std::uint32_t k) noexcept {
    return static_cast<std::int32_t>(value - k) >= 0;  // counts wrap after 2^32 chunks
  }

  // Waits until every rank's `which` reached chunk k: spins briefly (the peer
  // is often on another core, a few microseconds away), then sleeps on the
  // futex in slices, checking between them for a peer that gave up or died
  // and for the deadline.
  void wait_all(flag rank_flags::*which, std::uint32_t k,
                std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds timeout,
                const char* phase, std::size_t c, std::size_t chunks);

  [[nodiscard]] std::string where(int q, const char* phase, std::size_t c,
                                  std::size_t chunks) const;

  // This rank's chunk k is in its slot: says so with its `shape`, waits for
  // every rank's, and throws shm_failure (after abandon(), so that every rank
  // stops) when some rank called another collective, type, op or count. Where
  // TCP's Gloo would fail on the lengths (or not at all), the slots here would
  // be reduced as they are.
  void arrive(std::uint32_t k, std::uint64_t shape, std::chrono::steady_clock::time_point deadline,
              std::chrono::milliseconds timeout, std::size_t c, std::size_t chunks);

  void swap(shm_segment& o) noexcept;

  void* base_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t slot_ = 0;
  int fd_ = -1;
  int rank_ = 0;
  int size_ = 1;
  std::uint32_t chunk_ = 0;  // chunks this rank has run: the same count on every rank
};

#endif  // DTRAIN_HAS_SHM()

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/backend/gloo/shm-inl.hpp>
#endif
