#pragma once
/// @file
/// NCCL as the nccl backend drives it: its options, the mapping of dtrain's
/// types and ops onto NCCL's, where it finds buffers, and the state a
/// communicator shares with its work handles (the NCCL communicator, its
/// stream, scratch memory, whether and why it was aborted, the in-flight
/// bound). The calls go through the runtime `Api` (library.hpp: the
/// seam, and DTRAIN_NCCL_CHECK). `basic_nccl_communicator` itself is in
/// nccl.hpp. Everything NCCL compiles to nothing unless DTRAIN_HAS_NCCL().

#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/cuda.hpp>
#include <dtrain/backend/nccl/library.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/config.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/variables.hpp>
#include <dtrain/error.hpp>

#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace dtrain {

/// Default limit for creating an NCCL communicator (ncclCommInitRankConfig,
/// ncclCommSplit): every rank must have joined by then. Environment:
/// DTRAIN_NCCL_INIT_TIMEOUT (seconds).
inline constexpr std::chrono::milliseconds default_nccl_init_timeout{300'000};

/// Default store key of the NCCL unique id.
inline constexpr std::string_view default_nccl_store_key = "nccl/unique_id";

/// Options of an NCCL communicator. Aggregate: use designated initialisers,
/// `{.collectives = {.timeout = 30s}, .init_timeout = 60s}`.
struct nccl_options {
  /// Collective timeout (work::wait() without an argument; also bounds the
  /// destructor's wait) and check mode.
  collective_options collectives{};
  /// Limit for ncclCommInitRankConfig and ncclCommSplit.
  std::chrono::milliseconds init_timeout = default_nccl_init_timeout;
  /// NCCL's blocking mode. Off (the default), dtrain polls NCCL, so that init
  /// and enqueueing time out too; on, only completion can time out. NCCL's own
  /// NCCL_COMM_BLOCKING overrides either.
  bool blocking = false;
  /// How many collectives the host may enqueue ahead of the oldest one the
  /// device has not finished: the next one waits for it (at most the
  /// collective timeout, then timeout_error and abort), so that a dead peer
  /// stops the host within a bounded number of steps instead of letting it
  /// queue work for ever. At least 1.
  int max_in_flight = 64;
  /// Where rank 0 publishes the unique id. Must differ for every communicator
  /// made from one store: give each job and restart round its own
  /// prefix_store, or each communicator its own key. split() needs no store.
  std::string store_key{default_nccl_store_key};
  /// CUDA_VISIBLE_DEVICES as the job's environment set it (with_env() fills
  /// it), for the message when a rank wants a device it cannot see.
  std::optional<std::string> cuda_visible_devices{};

  /// These options with DTRAIN_NCCL_INIT_TIMEOUT, DTRAIN_COLLECTIVE_TIMEOUT and
  /// DTRAIN_CHECK_COLLECTIVES applied on top, and CUDA_VISIBLE_DEVICES kept.
  /// Throws config_error naming the variable and its value when one is malformed.
  [[nodiscard]] nccl_options with_env(const environment& env) const;
};

}  // namespace dtrain

#if DTRAIN_HAS_NCCL()
#include <cuda_runtime.h>
#include <nccl.h>

namespace dtrain::detail {

/// NCCL's name for each element type; all seven are native.
[[nodiscard]] constexpr ncclDataType_t nccl_type(dtype t) noexcept {
  switch (t) {
    case dtype::float32: return ncclFloat32;
    case dtype::float64: return ncclFloat64;
    case dtype::float16: return ncclFloat16;
    case dtype::bfloat16: return ncclBfloat16;
    case dtype::int32: return ncclInt32;
    case dtype::int64: return ncclInt64;
    case dtype::uint8: return ncclUint8;
  }
  return ncclFloat32;
}

/// NCCL's op for each reduction over `ranks` ranks; avg is ncclAvg (NCCL
/// divides, in the type), except on one rank, where the mean is the input and
/// ncclSum gives it: NCCL 2.28.3's one-rank ncclAvg left every element from
/// the 2^20th on unwritten out of place (seen on an H100).
[[nodiscard]] constexpr ncclRedOp_t nccl_op(reduce_op op, int ranks) noexcept {
  switch (op) {
    case reduce_op::sum: return ncclSum;
    case reduce_op::avg: return ranks == 1 ? ncclSum : ncclAvg;
    case reduce_op::min: return ncclMin;
    case reduce_op::max: return ncclMax;
    case reduce_op::prod: return ncclProd;
  }
  return ncclSum;
}

/// Whether the average of `type` over `ranks` divides each element first and
/// then sums (as PyTorch's Reducer), instead of ncclAvg: NCCL averages a
/// 16-bit type by multiplying each element by 1/n rounded to that type
/// (bf16(1/3) = 0.333984, +0.195 %; fp16 up to 2^-11), so the mean would
/// depend on the job size. Exact, and left to ncclAvg, where n is a power of two.
[[nodiscard]] constexpr bool nccl_divides_first(reduce_op op, dtype type, int ranks) noexcept {
  return op == reduce_op::avg && (type == dtype::float16 || type == dtype::bfloat16) && ranks > 1 &&
         (ranks & (ranks - 1)) != 0;
}

/// The config_error when a 16-bit average needs dtrain's divide kernel and
/// the program has none.
[[nodiscard]] DTRAIN_DETAIL_INLINE config_error nccl_no_divide(const std::string& what, dtype type,
                                                               int ranks);

/// Prefixes an engine error with the operation it interrupted (once).
[[nodiscard]] DTRAIN_DETAIL_INLINE backend_error nccl_with_context(const std::string& what,
                                                                   const backend_error& e);

// What a new communicator's rank, size and device must be, before any CUDA or NCCL call.

DTRAIN_DETAIL_INLINE void nccl_check_rank(int rank, int size);

DTRAIN_DETAIL_INLINE void nccl_check_placement(int rank, int size, int device);

/// Where NCCL's collectives find their buffers (check_arguments).
inline constexpr memory_reach nccl_memory{
    .host = false,
    .device = true,
    .rule =
        "NCCL reduces device memory only: pass GPU memory (device_span, "
        "or a buffer with where = memory::device), "
        "or reduce host data with the mpi or gloo backend"};

/// The id rank 0 put in the store. Throws rendezvous_error if it is not one.
[[nodiscard]] DTRAIN_DETAIL_INLINE ncclUniqueId nccl_unique_id_from(const std::string& value,
                                                                    std::string_view key);

/// Checks that `device` exists, then makes it current. `visible` is
/// CUDA_VISIBLE_DEVICES as the job's environment set it, for the message.
template <class Api>
void nccl_select_device(int device, int rank, int size, const std::optional<std::string>& visible) {
  int count = 0;
  if (const cudaError_t found = Api::cudaGetDeviceCount(&count); found != cudaSuccess) {
    (void)Api::cudaGetLastError();
    throw backend_error(
        "no usable CUDA device: " +
            cuda_error_text(found, "cudaGetDeviceCount(&count)", __FILE__, __LINE__) +
            "; NCCL needs a GPU and its driver (does nvidia-smi list one?)",
        static_cast<int>(found));
  }
  if (device >= count) {
    throw config_error(
        "NCCL rank " + std::to_string(rank) + " of " + std::to_string(size) +
        " wants CUDA device " + std::to_string(device) + ", but this process sees " +
        std::to_string(count) + " (CUDA_VISIBLE_DEVICES=" + visible.value_or("<unset>") +
        "); pass the local rank, and start no more ranks on a node than it has GPUs");
  }
  DTRAIN_CUDA_CHECK(Api::cudaSetDevice(device));
}

DTRAIN_DETAIL_INLINE std::string nccl_seconds(std::chrono::milliseconds t);

inline constexpr std::string_view nccl_timeout_hint =
    "a peer is slow, dead or called a different collective "
    "(DTRAIN_CHECK_COLLECTIVES=1 compares what every rank passed)";

/// Polling back-off for work the GPU finishes: sleeps grow to 1 ms.
struct nccl_backoff : backoff {
  nccl_backoff() : backoff{.longest = std::chrono::microseconds(1000)} {}
};

/// Whether everything on `stream` has finished; throws backend_error on a CUDA error.
template <class Api>
[[nodiscard]] bool nccl_stream_idle(cudaStream_t stream) {
  const cudaError_t e = Api::cudaStreamQuery(stream);
  if (e == cudaErrorNotReady) return false;
  if (e != cudaSuccess) throw_cuda_error(e, "cudaStreamQuery(stream)", __FILE__, __LINE__);
  return true;
}

/// Whether `event` has completed; throws backend_error on a CUDA error.
template <class Api>
[[nodiscard]] bool nccl_event_done(cudaEvent_t event) {
  const cudaError_t e = Api::cudaEventQuery(event);
  if (e == cudaErrorNotReady) return false;
  if (e != cudaSuccess) throw_cuda_error(e, "cudaEventQuery(event)", __FILE__, __LINE__);
  return true;
}

template <class Api>
struct nccl_shared;

/// Every live NCCL communicator of the process (of one runtime `Api`): they
/// fail as one family. An abort in NCCL is not local to its communicator:
/// ncclCommAbort synchronizes NCCL's device stream, which follows the user's
/// streams, and cudaFree waits for the whole device; with two communicators
/// busy on one GPU (the hierarchical topology's local and cross, DDP's beside
/// a user's), aborting one can wait for ever behind the other's kernel
/// spinning on a dead peer. So the first failure (a timeout, an asynchronous
/// error, abort(), a rank that gives up) marks every member aborted, then
/// stops each one's work (ncclCommRevoke where NCCL has it; otherwise one
/// ncclCommAbort per member, on threads of their own, so that none waits for
/// another's kernels to be told), and only then frees them.
template <class Api>
class nccl_family {
 public:
  static nccl_family& get() noexcept {
    static nccl_family* family = new nccl_family();  // never destroyed: aborts come at exit too
    return *family;
  }

  /// `member` fails with the others from now on.
  void join(const std::shared_ptr<nccl_shared<Api>>& member) {
    std::lock_guard lock(mutex_);
    std::erase_if(members_, [](const std::weak_ptr<nccl_shared<Api>>& m) { return m.expired(); });
    members_.push_back(member);
  }

  /// Aborts every member, `origin` first with `why` (what
  /// failure_cause::set takes), the others saying that `origin` failed.
  /// From any thread, once or many times (a member aborts once).
  template <class... Why>
  void abort_all(nccl_shared<Api>& origin, int code, bool timed_out, Why&&... why) noexcept {
    std::lock_guard lock(mutex_);  // a second failure waits for the first abort
    origin.mark_aborted(&origin, code, timed_out, std::forward<Why>(why)...);
    for_others(origin, [&](nccl_shared<Api>& m) { m.mark_aborted(&origin, code, timed_out); });
    // Every member is marked (its callers throw, its waits end) before NCCL hears of any.
    if constexpr (Api::has_revoke) {
      origin.stop();
      for_others(origin, [](nccl_shared<Api>& m) { m.stop(); });
      origin.release();
      for_others(origin, [](nccl_shared<Api>& m) { m.release(); });
    } else {
      std::vector<std::thread> aborts;
      auto release_apart = [&](nccl_shared<Api>& m) {
        try {
          aborts.emplace_back([keep = m.shared_from_this()] { keep->release(); });
        } catch (...) {
          m.release();  // no thread: in turn
        }
      };
      for_others(origin, release_apart);
      origin.release();
      for (std::thread& t : aborts) t.join();
    }
    origin.finish_abort();
    for_others(origin, [](nccl_shared<Api>& m) { m.finish_abort(); });
  }

 private:
  template <class Each>
  void for_others(const nccl_shared<Api>& origin, Each&& each) noexcept {
    for (const std::weak_ptr<nccl_shared<Api>>& weak : members_) {
      const std::shared_ptr<nccl_shared<Api>> m = weak.lock();
      if (m && m.get() != &origin) each(*m);
    }
  }

  std::mutex mutex_;
  std::vector<std::weak_ptr<nccl_shared<Api>>> members_;
};

/// What a communicator and its work handles share: the NCCL communicator, its
/// stream and scratch memory, and whether (and why) it was aborted.
///
/// Locking: `mutex` guards dtrain's bookkeeping only (the handle `comm`, the
/// abort state, the callers inside NCCL) and is never held across a CUDA or
/// NCCL call that can block. A thread that makes calls (call()) counts itself
/// in under the lock, makes them without it, and counts itself out; an abort
/// (a timeout on a watchdog thread, abort(), an NCCL error seen by any poll,
/// a sibling's failure: nccl_family) marks the communicator aborted under the
/// lock, stops its work (ncclCommRevoke, which frees a thread blocked inside
/// an enqueue), and frees it with ncclCommAbort only once no caller is inside
/// NCCL: the last caller to leave does it otherwise. So an abort never waits
/// for the thread it is meant to free, and never frees the communicator
/// under a call. Quick queries (ncclCommGetAsyncError) run under the lock.
template <class Api>
struct nccl_shared : std::enable_shared_from_this<nccl_shared<Api>> {
  // Set before anyone else can see this state, and then only read:
  int rank = 0;
  int size = 0;
  int device = 0;
  nccl_options options{};
  basic_cuda_stream<Api> stream;         // every collective runs here
  void* scratch = nullptr;               // device: the check table, then the barrier word
  std::int64_t* device_table = nullptr;  // check mode: signature::fields int64 per rank
  std::int64_t* barrier_word = nullptr;
  ncclComm_t split_slot = nullptr;  // ncclCommSplit writes the child here when it completes

  std::mutex mutex;
  ncclComm_t comm = nullptr;  // null once aborted (and before it exists)
  bool aborted = false;
  bool abort_timed_out = false;  // the abort came from a timeout: later calls say timeout_error
  failure_cause abort_reason;    // recorded without allocating (abort() and timeouts are noexcept)
  int abort_code = 0;
  std::weak_ptr<nccl_shared> abort_origin;  // the family member whose failure aborted this one

  nccl_shared() = default;
  nccl_shared(const nccl_shared&) = delete;
  nccl_shared& operator=(const nccl_shared&) = delete;

  /// The stream and scratch memory of a communicator on the current device; `comm` comes later.
  [[nodiscard]] static std::shared_ptr<nccl_shared> create(int rank, int size, int device,
                                                           nccl_options options) {
    if (options.max_in_flight < 1) {
      throw config_error("nccl_options::max_in_flight is " + std::to_string(options.max_in_flight) +
                         " on NCCL rank " + std::to_string(rank) + "; it must be at least 1");
    }
    auto s = std::make_shared<nccl_shared>();
    s->rank = rank;
    s->size = size;
    s->device = device;
    s->options = std::move(options);
    s->stream = basic_cuda_stream<Api>::non_blocking();
    const std::size_t words = signature::fields * static_cast<std::size_t>(size) + 1;
    DTRAIN_CUDA_CHECK(Api::cudaMalloc(&s->scratch, words * sizeof(std::int64_t)));
    s->device_table = static_cast<std::int64_t*>(s->scratch);
    s->barrier_word = s->device_table + signature::fields * static_cast<std::size_t>(size);
    return s;
  }

  [[nodiscard]] ncclConfig_t config() const noexcept {
    ncclConfig_t out = NCCL_CONFIG_INITIALIZER;
    out.blocking = options.blocking ? 1 : 0;
    return out;
  }

  /// Pinned host memory for the check table (allocated on first use).
  std::int64_t* host_table() {
    if (!host_table_)
      DTRAIN_CUDA_CHECK(Api::cudaMallocHost(
          reinterpret_cast<void**>(&host_table_),
          signature::fields * static_cast<std::size_t>(size) * sizeof(std::int64_t)));
    return host_table_;
  }

  /// Makes `engine_call(comm)` (one CUDA or NCCL call, or a few that form one
  /// step) without holding the lock: throws if the communicator was aborted
  /// before, and again if it was aborted while the call ran (another thread's
  /// abort is what frees a call that blocked). While it runs, an abort stops
  /// the communicator but does not free it: the last caller to leave does.
  /// `what` names the operation.
  template <class What, class Call>
  void call(const What& what, Call&& engine_call) {
    ncclComm_t handle = nullptr;
    {
      std::lock_guard lock(mutex);
      throw_if_aborted(what);
      handle = comm;
      ++callers_;
    }
    struct leave {
      nccl_shared& s;
      ~leave() { s.leave_call(); }
    } counted{*this};
    try {
      engine_call(handle);
    } catch (const backend_error&) {
      check_not_aborted(what);  // a call an abort interrupted fails as the abort says
      throw;
    }
    check_not_aborted(what);
  }

  /// Throws what throw_if_aborted throws, taking the lock.
  template <class What>
  void check_not_aborted(const What& what) {
    std::lock_guard lock(mutex);
    throw_if_aborted(what);
  }

  /// NCCL's asynchronous state: ncclSuccess, ncclInProgress (still
  /// enqueueing or initialising), or an error. Call with `mutex` held.
  [[nodiscard]] ncclResult_t async_state() const noexcept {
    if (!comm) return ncclSuccess;
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = Api::ncclCommGetAsyncError(comm, &state);
    return r != ncclSuccess ? r : state;
  }

  /// Throws, when the communicator was aborted, timeout_error (the abort
  /// came from a timeout) or backend_error, naming `what` and the first
  /// reason. Call with `mutex` held.
  template <class What>
  void throw_if_aborted(const What& what) const {
    if (!aborted) return;
    std::string text =
        what_text(what) + ": the communicator was aborted (" + abort_text() +
        "); its collectives cannot run any more: create a new communicator (restart the job)";
    if (abort_timed_out) throw timeout_error(text);
    throw backend_error(text, abort_code);
  }

  /// Why this communicator was aborted: its own first reason, or its
  /// family's. Call with `mutex` held.
  [[nodiscard]] std::string abort_text() const {
    if (const std::shared_ptr<nccl_shared> origin = abort_origin.lock()) {
      std::lock_guard lock(origin->mutex);
      return "another NCCL communicator of this process failed first: " +
             origin->abort_reason.text();
    }
    if (by_sibling_) return "another NCCL communicator of this process failed first";
    return abort_reason.text();
  }

  /// Aborts this communicator and every other of the process (nccl_family),
  /// once, from any thread, without waiting for a thread that is inside a
  /// CUDA or NCCL call; later calls see `aborted`, `abort_code` and the first
  /// reason, `why`: what failure_cause::set takes (a text moved in, a
  /// collective and how it ended, what was done on which rank). Allocates
  /// nothing on the way, as abort() and the timeout hook need. Call WITHOUT
  /// `mutex` held.
  template <class... Why>
  void abort(int code, bool timed_out, Why&&... why) noexcept {
    nccl_family<Api>::get().abort_all(*this, code, timed_out, std::forward<Why>(why)...);
  }

  // The steps of a family abort (nccl_family::abort_all), each on every
  // member before the next.

  /// 1. Later calls throw, waits end; `why` is the reason, or (none given)
  /// `origin` failed first.
  template <class... Why>
  void mark_aborted(nccl_shared* origin, int code, bool timed_out, Why&&... why) noexcept {
    std::lock_guard lock(mutex);
    if (aborted) return;
    aborted = true;
    abort_timed_out = timed_out;
    abort_code = code;
    if constexpr (sizeof...(Why) == 0) {
      abort_origin = origin->weak_from_this();
      by_sibling_ = true;
    } else {
      abort_reason.set(std::forward<Why>(why)...);
    }
    doomed_ = std::exchange(comm, nullptr);
    aborting_ = true;  // the family frees it; a caller leaving meanwhile does not
  }

  /// 2. NCCL stops this communicator's work (ncclCommRevoke): its kernels
  /// end, and a thread blocked inside an enqueue returns. Frees nothing.
  void stop() noexcept {
    ncclComm_t handle = nullptr;
    {
      std::lock_guard lock(mutex);
      handle = doomed_;
    }
    if constexpr (Api::has_revoke) {
      if (handle) {
        basic_device_guard<Api> guard(device, std::nothrow);
        (void)Api::ncclCommRevoke(handle, 0);
      }
    }
  }

  /// 3. ncclCommAbort, unless a caller is still inside NCCL with the handle:
  /// the last one to leave frees it (leave_call()).
  void release() noexcept {
    ncclComm_t handle = nullptr;
    {
      std::lock_guard lock(mutex);
      if (callers_ == 0) handle = std::exchange(doomed_, nullptr);
    }
    if (handle) {
      basic_device_guard<Api> guard(device, std::nothrow);
      (void)Api::ncclCommAbort(handle);
    }
  }

  /// 4. The family is done with this one: a caller leaving from now on frees
  /// what is left.
  void finish_abort() noexcept {
    {
      std::lock_guard lock(mutex);
      aborting_ = false;
    }
    release();
  }

  /// A caller leaves NCCL (call()): the last one frees an aborted
  /// communicator that the family left to it.
  void leave_call() noexcept {
    ncclComm_t handle = nullptr;
    {
      std::lock_guard lock(mutex);
      if (--callers_ == 0 && !aborting_) handle = std::exchange(doomed_, nullptr);
    }
    if (handle) {
      basic_device_guard<Api> guard(device, std::nothrow);
      (void)Api::ncclCommAbort(handle);
    }
  }

  /// Polls until NCCL is idle (not in progress) and `finished()` holds. An
  /// NCCL error aborts and throws backend_error; running past `limit` aborts
  /// and throws timeout_error, with `hint` for the person reading it; an
  /// abort by another thread throws what throw_if_aborted does. Takes the
  /// lock for each look at NCCL's state only; `finished()` runs without it.
  /// `what` names the operation (what_text()), put into words only on failure.
  template <class What, class Finished>
  void wait(const What& what, std::chrono::milliseconds limit, std::string_view hint,
            Finished&& finished) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    nccl_backoff pause;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      {
        std::lock_guard lock(mutex);
        throw_if_aborted(what);
        state = async_state();
      }
      if (state != ncclSuccess && state != ncclInProgress) {
        std::string why = what_text(what) + " failed: NCCL reports " + async_text(state);
        abort(static_cast<int>(state), false, std::string(why));
        throw backend_error(why, static_cast<int>(state));
      }
      if (state == ncclSuccess && finished()) return;
      if (std::chrono::steady_clock::now() >= deadline) {
        std::string why = what_text(what) + " did not finish within " + nccl_seconds(limit);
        abort(0, true, std::string(why));
        throw timeout_error(why + "; " + std::string(hint) + ". The communicator is aborted");
      }
      pause();
    }
  }

  [[nodiscard]] static std::string async_text(ncclResult_t state) {
    std::string text = ncclGetErrorString(state);
    const char* last = ncclGetLastError(nullptr);
    if (last != nullptr && *last != '\0') text += std::string("; NCCL's last error: ") + last;
    return text + " (ncclResult_t " + std::to_string(static_cast<int>(state)) + ")";
  }

  /// Before the issuing thread enqueues a collective: when max_in_flight
  /// collectives are still unfinished on the device, waits (the collective
  /// timeout at most) for the oldest of them. With the fence recorded after
  /// the enqueue (fenced()), the host runs at most max_in_flight collectives
  /// ahead of the device. Issuing thread only.
  template <class What>
  void make_room(const What& what) {
    const auto slots = static_cast<std::size_t>(options.max_in_flight);
    if (fences_.size() < slots) return;  // a fence is made per slot as collectives are issued
    cudaEvent_t oldest = fences_[issued_ % slots];
    wait(
        [&] {
          return what_text(what) + " (waiting for the collective enqueued " +
                 std::to_string(slots) +
                 " before it: at most nccl_options::max_in_flight = " + std::to_string(slots) +
                 " unfinished)";
        },
        options.collectives.timeout, nccl_timeout_hint,
        [&] { return nccl_event_done<Api>(oldest); });
  }

  /// After the issuing thread enqueued a collective: records its fence.
  void fenced() {
    const auto slots = static_cast<std::size_t>(options.max_in_flight);
    if (fences_.size() < slots) {
      fences_.reserve(slots);
      fences_.push_back(basic_cuda_event<Api>::create().release());
    }
    cudaEvent_t fence = fences_[issued_ % slots];
    DTRAIN_CUDA_CHECK(Api::cudaEventRecord(fence, stream.get()));
    ++issued_;
  }

  /// A completion event from the pool (created on the current device when the
  /// pool is empty). The pool makes room for every event it hands out, so that
  /// release_event() never allocates.
  [[nodiscard]] cudaEvent_t acquire_event() {
    std::lock_guard lock(events_mutex_);
    if (!free_events_.empty()) {
      cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
    free_events_.reserve(events_made_ + 1);
    cudaEvent_t e = basic_cuda_event<Api>::create().release();
    ++events_made_;
    return e;
  }

  /// Returns an event to the pool. A stream that waited on it keeps the point
  /// it waited for, so it can be recorded again at once. Allocates nothing:
  /// the pool holds at most the events made, and has room for them all.
  void release_event(cudaEvent_t e) noexcept {
    std::lock_guard lock(events_mutex_);
    free_events_.push_back(e);
  }

  /// Lets the collectives finish (at most the collective timeout), then
  /// ncclCommFinalize + ncclCommDestroy; aborts (with the whole family:
  /// nccl_family) when they do not, and at once while an exception unwinds
  /// (a peer may be gone: waiting could take the whole timeout). An aborted
  /// communicator has nothing left. The scratch memory is freed on the
  /// communicator's stream, not with cudaFree, which would wait for the whole
  /// device (another communicator's kernel spinning on a dead peer included).
  ~nccl_shared() {
    basic_device_guard<Api> guard(device, std::nothrow);
    if (comm && std::uncaught_exceptions() > 0) {
      abort(0, false, "the communicator was destroyed while an exception unwound", rank);
    }
    if (comm) {
      const auto deadline = std::chrono::steady_clock::now() + options.collectives.timeout;
      // Finalize only a communicator that is idle and healthy; anything else is aborted.
      bool clean = settle(deadline, [&] {
        const cudaError_t e = Api::cudaStreamQuery(stream.get());
        return e == cudaSuccess         ? settled::done
               : e == cudaErrorNotReady ? settled::pending
                                        : settled::failed;
      });
      clean = clean && async_state() == ncclSuccess;
      if (clean) {
        const ncclResult_t r = Api::ncclCommFinalize(comm);
        clean = (r == ncclSuccess || r == ncclInProgress) && settle(deadline, [&] {
                  const ncclResult_t state = async_state();
                  return state == ncclSuccess      ? settled::done
                         : state == ncclInProgress ? settled::pending
                                                   : settled::failed;
                });
      }
      if (clean) {
        (void)Api::ncclCommDestroy(std::exchange(comm, nullptr));
      } else {
        abort(0, true, "its collectives did not finish before it was destroyed", rank);
      }
    }
    // Pinned host memory is freed only where nothing was aborted: cudaFreeHost
    // waits for the device, which a sibling's stuck kernel may hold for ever.
    if (host_table_ && !aborted) (void)Api::cudaFreeHost(host_table_);
    if (scratch && Api::cudaFreeAsync(scratch, stream.get()) != cudaSuccess) {
      (void)Api::cudaGetLastError();
      if (!aborted) (void)Api::cudaFree(scratch);
    }
    for (cudaEvent_t e : free_events_) (void)Api::cudaEventDestroy(e);
    for (cudaEvent_t e : fences_) (void)Api::cudaEventDestroy(e);
  }

 private:
  enum class settled { done, pending, failed };

  // Polls `query` until it is done (true), fails, or the deadline passes (false).
  template <class Query>
  static bool settle(std::chrono::steady_clock::time_point deadline, Query query) noexcept {
    nccl_backoff pause;
    for (;;) {
      const settled state = query();
      if (state == settled::done) return true;
      if (state == settled::failed || std::chrono::steady_clock::now() >= deadline) return false;
      try {
        pause();
      } catch (...) {
        return false;
      }
    }
  }

  std::int64_t* host_table_ = nullptr;
  int callers_ = 0;              // threads inside call() (mutex)
  ncclComm_t doomed_ = nullptr;  // aborted, not yet freed: a caller was inside NCCL (mutex)
  bool aborting_ = false;        // a family abort is under way: it frees doomed_ (mutex)
  bool by_sibling_ = false;      // aborted for abort_origin's failure (mutex)
  std::mutex events_mutex_;
  std::vector<cudaEvent_t> free_events_;  // capacity >= events_made_
  std::size_t events_made_ = 0;
  std::vector<cudaEvent_t> fences_;  // the issuing thread's: one per slot of max_in_flight
  std::size_t issued_ = 0;           // collectives fenced so far
};

/// An event from the pool for one scope (or released to a work).
template <class Api>
class nccl_pooled_event {
 public:
  explicit nccl_pooled_event(nccl_shared<Api>& shared)
      : shared_(shared), event_(shared.acquire_event()) {}
  nccl_pooled_event(const nccl_pooled_event&) = delete;
  nccl_pooled_event& operator=(const nccl_pooled_event&) = delete;
  ~nccl_pooled_event() {
    if (event_) shared_.release_event(event_);
  }
  [[nodiscard]] cudaEvent_t get() const noexcept { return event_; }
  [[nodiscard]] cudaEvent_t release() noexcept { return std::exchange(event_, nullptr); }

 private:
  nccl_shared<Api>& shared_;
  cudaEvent_t event_;
};

/// One collective in flight: done when its completion event is; failed when
/// NCCL reports an asynchronous error (the communicator is then aborted, as
/// NCCL asks) or the communicator was aborted.
template <class Api>
class nccl_work final : public work_state {
 public:
  nccl_work(const collective_info& what, std::chrono::milliseconds timeout,
            std::shared_ptr<nccl_shared<Api>> shared, cudaEvent_t done)
      : work_state(what, timeout), shared_(std::move(shared)), done_(done) {}
  ~nccl_work() override { shared_->release_event(done_); }

  // Runs on any thread that waits (the watchdog's included): the CUDA calls
  // go to the communicator's device, never to a context on GPU 0. The lock is
  // held for NCCL's error state only, never across the event query.
  bool poll() override {
    ncclResult_t state = ncclSuccess;
    {
      std::lock_guard lock(shared_->mutex);
      if (shared_->aborted) {
        std::string text = description() + " did not complete: the communicator was aborted (" +
                           shared_->abort_text() + ")";
        if (shared_->abort_timed_out) {
          fail(std::make_exception_ptr(timeout_error(text)));
        } else {
          fail(std::make_exception_ptr(backend_error(text, shared_->abort_code)));
        }
        return true;
      }
      state = shared_->async_state();
    }
    if (state != ncclSuccess && state != ncclInProgress) {
      std::string why =
          description() + " failed: NCCL reports " + nccl_shared<Api>::async_text(state);
      shared_->abort(static_cast<int>(state), false, std::string(why));
      fail(std::make_exception_ptr(backend_error(why, static_cast<int>(state))));
      return true;
    }
    basic_device_guard<Api> guard(shared_->device, std::nothrow);
    const cudaError_t e = Api::cudaEventQuery(done_);
    if (e == cudaErrorNotReady) return false;
    if (e != cudaSuccess) {
      (void)Api::cudaGetLastError();
      fail(std::make_exception_ptr(backend_error(
          description() + " failed on the device: " + cudaGetErrorName(e) + ": " +
              cudaGetErrorString(e) + " (cudaError_t " + std::to_string(static_cast<int>(e)) + ")",
          static_cast<int>(e))));
    }
    return true;
  }

  // Called by whoever waited (a watchdog thread included): aborts at once,
  // without waiting for a thread that may be blocked inside an NCCL call.
  void on_timeout() noexcept override { shared_->abort(0, true, info(), "timed out"); }

  // The rank failed with this collective in flight: the communicators are
  // aborted now, not after the collective timeout (a peer may never join it).
  void on_abandon() noexcept override {
    shared_->abort(0, false, info(), "was abandoned: its rank failed while it was in flight");
  }

  // `stream` waits for the event recorded after this collective (and for
  // nothing enqueued on the communicator's stream since).
  bool stream_wait(stream_handle stream) override {
    {
      std::lock_guard lock(shared_->mutex);
      if (shared_->aborted) {
        throw backend_error(
            description() + ": the communicator was aborted (" + shared_->abort_text() + ")",
            shared_->abort_code);
      }
    }
    basic_device_guard<Api> guard(shared_->device);
    DTRAIN_CUDA_CHECK(Api::cudaStreamWaitEvent(stream, done_, 0));
    return true;
  }

 private:
  std::shared_ptr<nccl_shared<Api>> shared_;
  cudaEvent_t done_;
};

}  // namespace dtrain::detail

#endif  // DTRAIN_HAS_NCCL()

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/backend/nccl/engine-inl.hpp>
#endif
