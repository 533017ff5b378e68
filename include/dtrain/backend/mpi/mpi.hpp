#pragma once
/// @file
/// The MPI backend: nonblocking MPI-3 collectives on communicators dtrain
/// owns (MPI_ERRORS_RETURN, so every failure is reported, not fatal).

#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/cuda.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/config.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/error.hpp>

#if DTRAIN_HAS_MPI()

#include <mpi.h>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI's MPIX_Query_cuda_support
#endif
#include <array>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain {

namespace detail {

DTRAIN_DETAIL_INLINE std::string mpi_error_text(int code);

DTRAIN_DETAIL_INLINE std::string mpi_thread_level_name(int level);

}  // namespace detail

/// Evaluates an MPI call; throws backend_error with file:line, the call, what
/// it was for and MPI's message and code when it does not return MPI_SUCCESS.
#define DTRAIN_MPI_CHECK(call, what)                                                             \
  do {                                                                                           \
    int dtrain_mpi_rc_ = (call);                                                                 \
    if (dtrain_mpi_rc_ != MPI_SUCCESS) {                                                         \
      throw ::dtrain::backend_error(::dtrain::detail::what_text(what) + ": " #call " failed: " + \
                                        ::dtrain::detail::mpi_error_text(dtrain_mpi_rc_) +       \
                                        " (at " __FILE__ ":" + std::to_string(__LINE__) + ")",   \
                                    dtrain_mpi_rc_);                                             \
    }                                                                                            \
  } while (0)

/// Options of the MPI backend.
struct mpi_options {
  collective_options collectives{};
  /// The thread level dtrain requires: DDP's communication thread calls MPI
  /// while other threads may too. Initialising MPI asks for MULTIPLE.
  int required_thread_level = MPI_THREAD_MULTIPLE;
  /// When dtrain initialises Open MPI and the user set no
  /// OMPI_MCA_coll_libnbc_iallreduce_algorithm, ask for the ring algorithm:
  /// Open MPI's default for the nonblocking allreduce dtrain uses is about
  /// twice as slow as its blocking one from 4 KiB up (bench/allreduce_mpi).
  bool tune_open_mpi = true;
  /// Device buffers go to MPI as they are (blocking collectives, since Open
  /// MPI's nonblocking ones do not take CUDA memory), instead of being staged
  /// through pooled pinned host memory. Opt-in, and only for an MPI built
  /// with CUDA support (MPIX_Query_cuda_support(); otherwise a config_error).
  /// A blocking call cannot be bounded by the collective timeout.
  bool cuda_aware_direct = false;

  /// These options for a job whose environment snapshot is `env`: no tuning
  /// when the user chose OMPI_MCA_coll_libnbc_iallreduce_algorithm there.
  [[nodiscard]] mpi_options with_env(const environment& env) const;
  static constexpr const char* open_mpi_iallreduce_variable =
      "OMPI_MCA_coll_libnbc_iallreduce_algorithm";
};

/// Owns MPI's initialisation when dtrain did it: initialises only if nobody
/// has, and then finalizes when the last communicator is gone.
class mpi_environment {
 public:
  explicit mpi_environment(int required_level, bool tune_open_mpi = true);
  mpi_environment(const mpi_environment&) = delete;
  mpi_environment& operator=(const mpi_environment&) = delete;
  /// Finalizes MPI if this object initialised it, except while an exception
  /// unwinds (MPI_Finalize would wait for peers that wait for this rank, so
  /// MPI is left up for dtrain::run to report the failure and MPI_Abort).
  ~mpi_environment();
  [[nodiscard]] bool owned() const noexcept { return owned_; }

  /// Whether this MPI passes device pointers itself (Open MPI's CUDA support).
  [[nodiscard]] static bool cuda_aware() noexcept;

 private:
  bool owned_ = false;
  int unwinding_ = 0;  // exceptions in flight when it was made
};

/// A communicator over MPI. Host memory always; device memory (compiled when
/// CUDA is available) staged through pooled pinned host blocks: copied out
/// after the work queued on the caller's stream, reduced by MPI, copied back
/// before the work completes. With mpi_options::cuda_aware_direct and a
/// CUDA-aware MPI, device pointers go to MPI's blocking collectives instead.
/// float16 and bfloat16 reduce through dtrain's own MPI_Op (MPI has no such
/// types): converted to float, reduced, rounded back at each step.
class mpi_communicator {
 public:
  static constexpr std::string_view name = "mpi";
  static constexpr bool reaches_device_memory = DTRAIN_HAS_CUDA() != 0;
  static constexpr bool reaches_host_memory = true;

  /// Every process of MPI_COMM_WORLD (initialising MPI if nobody has).
  static mpi_communicator world(mpi_options options = {});

  /// Wraps a duplicate of `comm` (MPI already initialised by the caller).
  static mpi_communicator from(MPI_Comm comm, mpi_options options = {});

  mpi_communicator(mpi_communicator&& other) noexcept
      : env_(std::move(other.env_)),
        comm_(std::exchange(other.comm_, MPI_COMM_NULL)),
        rank_(other.rank_),
        size_(other.size_),
        options_(other.options_),
        ring_(std::move(other.ring_)),
        ops_(std::exchange(other.ops_, no_ops())),
        health_(std::move(other.health_)),
        staging_(std::move(other.staging_)) {}
  mpi_communicator& operator=(mpi_communicator&&) = delete;
  mpi_communicator(const mpi_communicator&) = delete;
  mpi_communicator& operator=(const mpi_communicator&) = delete;
  ~mpi_communicator();

  /// -1 and 0 for a rank that split() left out (negative color).
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  /// False when moved from, or when split() left this rank out.
  [[nodiscard]] bool valid() const noexcept { return comm_ != MPI_COMM_NULL; }
  [[nodiscard]] MPI_Comm native() const noexcept { return comm_; }
  /// This communicator's last collectives, for desync diagnostics.
  [[nodiscard]] std::shared_ptr<detail::collective_ring> ring() const noexcept { return ring_; }

  /// Pinned host bytes this communicator holds for staging device buffers
  /// (in use and free for reuse); 0 without CUDA.
  [[nodiscard]] std::size_t staging_bytes() const;

  // Device buffers: `stream` is the caller's stream whose work produced the
  // input (null: the legacy default stream). The host waits for it before MPI
  // reads the data; the output is on the device when the work completes.

  work allreduce(buffer in, buffer out, reduce_op op, stream_handle stream = nullptr);

  work broadcast(buffer data, int root, stream_handle stream = nullptr);

  work allgather(buffer in, buffer out, stream_handle stream = nullptr);

  work reduce_scatter(buffer in, buffer out, reduce_op op, stream_handle stream = nullptr);

  /// Block j of `in` (size() blocks) to rank j; block i of `out` from rank i
  /// (MPI_Ialltoall; out of place).
  work alltoall(buffer in, buffer out, stream_handle stream = nullptr);

  work barrier();

  /// The ranks with the same color, ordered by key (then by rank). Collective.
  /// A negative color leaves this rank out (MPI_UNDEFINED): it gets a
  /// communicator with valid() false (see the `communicator` concept).
  mpi_communicator split(int color, int key);

 private:
  struct health {
    bool broken = false;
    bool abandoned = false;     // a request was given up while MPI may still progress it
    detail::failure_cause why;  // the first failure (recorded without allocating)
  };

  // How device buffers travel (CUDA builds): the pinned pool, and whether the
  // MPI takes device pointers itself (mpi_options::cuda_aware_direct).
  struct staging {
#if DTRAIN_HAS_CUDA()
    detail::pinned_pool pool;
#endif
    bool direct = false;
  };

  // One outstanding MPI request, with the staging and the avg division it needs when done.
  struct request : detail::work_state {
    request(const detail::collective_info& what, std::chrono::milliseconds timeout,
            std::shared_ptr<health> h, std::shared_ptr<staging> st)
        : work_state(what, timeout), health_(std::move(h)), staging_(std::move(st)) {}
    ~request() override;

    /// Chooses where MPI reads and writes: the user's buffers (host memory;
    /// device memory when the MPI takes it directly and no host arithmetic is
    /// needed), or pooled pinned copies of device buffers, filled once the
    /// work queued on `stream` is done. Host arithmetic: avg's division and
    /// the 16-bit floats' MPI_Op.
    void stage([[maybe_unused]] buffer in, buffer out, [[maybe_unused]] bool host_math,
               [[maybe_unused]] stream_handle stream);

    bool poll() override;

    void on_timeout() noexcept override { abandon(); }

    // MPI cannot cancel a collective: the communicator is unusable from now on.
    // Allocates nothing (a timeout hook, and the destructor, call it).
    void abandon() noexcept;

    MPI_Request req = MPI_REQUEST_NULL;
    buffer src{}, dst{}, user_out{};
    int divide_by = 0;
    int device = -1;      // of the staged device buffers
    bool staged = false;  // src/dst are pinned blocks from the pool
    bool direct = false;  // device pointers to a blocking call: complete at launch
    bool finished = false;
    bool abandoned = false;

   private:
    struct block {
      void* data = nullptr;
      std::size_t bytes = 0;
    };
#if DTRAIN_HAS_CUDA()
    void* take(std::size_t bytes, block& b) {
      b.data = staging_->pool.take(bytes);
      b.bytes = bytes;
      return b.data;
    }
#endif
    // Blocks go back to the pool for the next call (never while MPI may still
    // write into them: an abandoned request keeps them).
    void release_staging() noexcept;
    block src_block, dst_block;
    std::shared_ptr<health> health_;
    std::shared_ptr<staging> staging_;
  };

  // Every collective, in this order: a left-out rank fails first; then the
  // argument checks every engine shares; a broken communicator; the ring's
  // number (check mode: every rank's signature compared); staging (device
  // buffers through pinned host memory, and the avg division on completion);
  // last the engine's call, `submit(request, what)`, unless nothing moves.
  template <class Submit>
  work collective(const detail::collective_call& call, stream_handle stream, Submit&& submit) {
    const detail::collective_info what = call.info(name, rank_, size_);
    if (!valid()) detail::throw_invalid(detail::describe(what), rank_ < 0);
    detail::check_arguments(call, what, detail::memory_reach{});
    usable(what);
    const std::int64_t seq = verify(what);
    auto w = std::make_shared<request>(what, options_.collectives.timeout, health_, staging_);
    w->track(ring_, seq);
    const bool avg = call.op == static_cast<int>(reduce_op::avg);
    // avg's division and the 16-bit floats' MPI_Op run on the host.
    w->stage(call.in, call.out, avg || (call.op >= 0 && !native(call.out.type)), stream);
    w->divide_by = avg ? size_ : 0;
    if (call.moves_data()) submit(*w, what);
    return work(std::move(w));
  }

  mpi_communicator(std::shared_ptr<mpi_environment> env, MPI_Comm base, mpi_options options);

  // A left-out (or moved-from) communicator: what split() returns to a rank
  // that passed a negative color.
  mpi_communicator(std::shared_ptr<mpi_environment> env, mpi_options options)
      : env_(std::move(env)),
        rank_(-1),
        size_(0),
        options_(std::move(options)),
        health_(std::make_shared<health>()),
        staging_(std::make_shared<staging>()) {}

  template <class What>
  void usable(const What& what) const {
    if (health_->broken) {
      throw backend_error(detail::what_text(what) + ": this MPI communicator is unusable since " +
                              health_->why.text() +
                              " (MPI cannot cancel a collective); end the job, "
                              "or continue only on other communicators",
                          0);
    }
  }

  static int count(const buffer& b, const detail::collective_info& what);

  // Whether MPI reduces the type itself (the 16-bit floats go through dtrain's MPI_Op).
  static bool native(dtype t) noexcept { return t != dtype::float16 && t != dtype::bfloat16; }

  static MPI_Datatype datatype(dtype t);

  template <class T, reduce_op Op>
  static void reduce_16bit(void* in, void* inout, int* len, MPI_Datatype*) {
    detail::reduce_host<T>(static_cast<T*>(inout), static_cast<const T*>(in),
                           static_cast<std::size_t>(*len), Op);
  }

  MPI_Op mpi_op(reduce_op op, dtype t);

  // Numbers the collective in the ring; check mode: every rank passed the same call, count, type,
  // op/root.
  std::int64_t verify(const detail::collective_info& info);

  std::shared_ptr<mpi_environment> env_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  mpi_options options_;
  std::shared_ptr<detail::collective_ring> ring_ = std::make_shared<detail::collective_ring>();
  // MPI_OP_NULL is not a null pointer in every MPI (Open MPI: an object's address).
  static std::array<MPI_Op, 8> no_ops() noexcept;
  std::array<MPI_Op, 8> ops_ = no_ops();
  std::shared_ptr<health> health_;
  std::shared_ptr<staging> staging_;
};

static_assert(communicator<mpi_communicator>);

namespace detail {

/// An MPI broadcast from `root` over `comm` as broadcast_or_fail's channel
/// (rendezvous/broadcast.hpp), usable before any store exists: the message's
/// length, then its bytes, so no rank guesses a buffer size. Every rank of
/// `comm` calls it. MPI errors are reported only where `comm` returns them
/// (MPI_ERRORS_RETURN, as on every communicator dtrain creates).
class mpi_relay {
 public:
  explicit mpi_relay(MPI_Comm comm, int root = 0);

  void carry(std::string& message, const std::string& what);
  [[nodiscard]] int root() const noexcept { return root_; }
  [[nodiscard]] bool is_root() const noexcept { return rank_ == root_; }
  [[nodiscard]] std::string where() const {
    return "rank " + std::to_string(root_) + "'s MPI broadcast";
  }

 private:
  static constexpr std::uint64_t max_length = std::uint64_t{1} << 20;
  MPI_Comm comm_;
  int root_;
  int rank_ = -1;
};

/// This process's rank in `comm`, and `comm`'s size (throw backend_error
/// where `comm` returns errors).
DTRAIN_DETAIL_INLINE int mpi_rank(MPI_Comm comm);
DTRAIN_DETAIL_INLINE int mpi_size(MPI_Comm comm);

/// Every rank's `mine`, gathered to `root` in rank order (MPI_Gather of the
/// lengths, then MPI_Gatherv); empty on the other ranks. Every rank of `comm`
/// calls it; `what` names it in errors.
DTRAIN_DETAIL_INLINE std::vector<std::string> mpi_gather_text(MPI_Comm comm,
                                                              const std::string& mine, int root,
                                                              const std::string& what);

}  // namespace detail

}  // namespace dtrain

#endif  // DTRAIN_HAS_MPI()

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/backend/mpi/mpi-inl.hpp>
#endif
