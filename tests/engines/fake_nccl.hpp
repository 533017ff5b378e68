// A host fake of the CUDA runtime and NCCL, as the NCCL engine calls them
// through its seam (dtrain::detail::nccl_library): with it,
// dtrain::basic_nccl_communicator<fake_nccl::api> runs at 2-4 ranks on a
// machine without a GPU, under DistributedDataParallel (fake_nccl::memory is
// its device memory space), and the failures that only a peer causes happen
// on purpose. What it keeps of the real semantics:
//   - streams run their work in order on a thread each (fake_device::fake_stream);
//     events mark a point on a stream; cudaStreamWaitEvent orders one stream
//     after another;
//   - "device memory" is host memory that cudaMalloc / cudaMallocAsync handed
//     out: a collective on any other pointer fails (ncclInvalidArgument, with
//     a line on stderr), as NCCL does on host memory; cudaFree (and
//     cudaFreeHost) wait for the whole device, as CUDA's do: for every
//     collective running on any stream, a spinning one included;
//     cudaFreeAsync frees in stream order;
//   - a communicator created non-blocking (ncclConfig_t::blocking = 0, unless
//     NCCL_COMM_BLOCKING=1 overrides it, as in NCCL) says
//     ncclInProgress from its init until every rank has joined (a peer that
//     never arrives leaves it in progress for ever), and from each enqueue,
//     group and split until its launch completes; a call on it before that
//     is NCCL's invalid usage (ncclInvalidUsage, and a line on stderr);
//   - a collective is a task on the stream that meets the other ranks' in a
//     directory (FAKE_NCCL_DIR: every rank writes its part as a file and
//     waits for the others'); it never completes while a peer is missing,
//     and spins (a running kernel) until its communicator is aborted;
//   - between ncclGroupStart and ncclGroupEnd, collectives are deferred to
//     ncclGroupEnd, which launches them;
//   - ncclCommSplit meets the ranks in the parent's directory and makes the
//     children (NCCL_SPLIT_NOCOLOR: none), in the background when non-blocking;
//   - float16 and bfloat16 reduce in their own precision, each partial sum
//     rounded in rank order, and avg is NCCL's PreMulSum: every element times
//     1/n rounded to the type, then the sum (bf16(1/3) = 0.333984);
//   - FAKE_NCCL_ONE_COMM_AT_A_TIME=1: a collective that starts while another
//     communicator's runs (kernels of two communicators at once on one GPU,
//     which NCCL's guide says can deadlock) ends the process with a message;
//   - an enqueue blocks, in the calling thread, while FAKE_NCCL_LAUNCH_QUEUE
//     collectives are unfinished on the stream (NCCL's work FIFO, CUDA's
//     launch queue), until they finish or the communicator is revoked or aborted,
//     then looks its communicator up again (a freed one: use after free);
//   - ncclCommRevoke stops a communicator's collectives (spinning ones end,
//     blocked enqueues return) and frees nothing; ncclCommAbort stops them,
//     then waits for the device (any communicator's running collective, as
//     NCCL's own stream synchronization does), takes FAKE_NCCL_ABORT_MS
//     (default 20) more, and frees the communicator: a later call with its
//     handle is a use after free, which ends the process with a message
//     (SIGABRT);
//   - FAKE_NCCL_ABORT_HANGS=1: ncclCommRevoke and ncclCommAbort never return;
//   - FAKE_NCCL_ASYNC_ERROR_AT=k: the k-th collective (from 1) raises an
//     asynchronous error (ncclRemoteError, a peer's network went away)
//     instead of completing;
//   - FAKE_NCCL_COLLECTIVE_MS=n: each collective takes n ms more on its
//     stream (a slow link), and every collective that completes is logged
//     with its times on the host's steady clock (registry::ran), for the
//     timeline's device spans to be checked against;
//   - timing events: cudaEventRecord stamps the host's steady clock when the
//     stream reaches the event, cudaEventElapsedTime subtracts the stamps;
//   - FAKE_NCCL_ID_FAILS=1: ncclGetUniqueId fails (ncclSystemError);
//   - FAKE_NCCL_INIT_FAILS_RANK=r: on the process whose RANK is r,
//     ncclCommInitRankConfig fails (ncclSystemError) and the rank never joins;
//   - FAKE_CUDA_NO_DEVICE_RANK=r: the process whose RANK is r sees no device;
//   - FAKE_CUDA_IDENTITY_FAILS_RANK=r: that process cannot read its GPU's
//     properties (an uncorrectable ECC error);
//   - FAKE_CUDA_GPUS: the node's GPUs (default 4); CUDA_VISIBLE_DEVICES maps
//     a rank's device ordinals onto them, so that two ranks can be shown the
//     same GPU; each GPU's UUID is "GPU-fake<index>-<node>" (the node:
//     DTRAIN_NODE_NAME where dtrain_test_launch simulates nodes, else the host).
// Everything the fake counts or meets on lives in the process, except the
// meeting directory, which the test gives each run (and removes).
#pragma once

#include <dtrain/dtrain.hpp>

#include "../support/fake_stream.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace fake_nccl {

inline int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}
inline std::string env_text(const char* name, std::string fallback = {}) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : fallback;
}

/// NCCL's invalid usage, said on stderr too (the engine must never cause it).
inline ncclResult_t misuse(const std::string& what) {
  std::fprintf(stderr, "fake NCCL: invalid usage: %s\n", what.c_str());
  return ncclInvalidUsage;
}

using clock = std::chrono::steady_clock;

/// A communicator of the fake: where its ranks meet, and its abort flag.
struct comm_state {
  std::string id;   // the unique id's text (a split child's: its parent's and more)
  std::string dir;  // FAKE_NCCL_DIR/<id>
  int rank = 0;
  int size = 1;
  bool blocking = true;
  std::atomic<bool> aborted{false};  // revoked or aborted: collectives stop
  std::atomic<int> async_error{ncclSuccess};
  std::atomic<int> running{0};     // collectives running on a stream now (spinning ones too)
  std::atomic<int> background{0};  // a split still working (non-blocking)
  std::atomic<clock::rep> launch_until{0};  // a non-blocking launch completes at this time
  std::uint64_t issued = 0;                 // collectives enqueued (the caller's thread only)
  int splits = 0;                           // splits made from it (the caller's thread only)

  [[nodiscard]] bool everyone_joined() const {
    for (int r = 0; r < size; ++r)
      if (!std::filesystem::exists(dir + "/join." + std::to_string(r))) return false;
    return true;
  }
  [[nodiscard]] bool launching() const {
    return clock::now().time_since_epoch().count() < launch_until;
  }
  /// A non-blocking call returned ncclInProgress: its launch completes shortly.
  void launched() {
    launch_until = (clock::now() + std::chrono::microseconds(300)).time_since_epoch().count();
  }
};

/// The process's fake objects, found from the handles the engine holds.
struct registry {
  std::mutex mutex;
  std::map<const void*, std::shared_ptr<comm_state>> comms;
  std::map<const void*, std::shared_ptr<comm_state>> freed;  // by ncclCommAbort/Destroy
  std::map<const void*, std::shared_ptr<fake_device::fake_stream>> streams;
  std::map<const char*, std::size_t, std::less<>> device;  // device allocations: start, bytes
  struct event_state {
    std::weak_ptr<fake_device::fake_stream> stream;
    std::uint64_t count = 0;
    std::atomic<std::int64_t> stamp{-1};    // steady ns when the stream reached it; -1: not yet
    std::atomic<std::uint64_t> records{0};  // a stamp is the latest record's only
  };
  std::map<const void*, std::shared_ptr<event_state>> events;
  /// A collective that completed on a stream (FAKE_NCCL_COLLECTIVE_MS).
  struct collective_run {
    int kind;
    std::int64_t start, end;  // steady ns
  };
  std::vector<collective_run> ran;
  std::shared_ptr<fake_device::fake_stream> legacy = std::make_shared<fake_device::fake_stream>();

  static registry& get() {
    static registry* r =
        new registry();  // never destroyed: stream threads may outlive main's locals
    return *r;
  }
  /// The communicator behind `c`; a freed one ends the process (a use after free).
  std::shared_ptr<comm_state> comm(ncclComm_t c, const char* call) {
    std::lock_guard lock(mutex);
    auto it = comms.find(c);
    if (it != comms.end()) return it->second;
    if (freed.count(c)) {
      std::fprintf(stderr,
                   "fake NCCL: %s on a communicator that ncclCommAbort or ncclCommDestroy "
                   "has freed (a use after free)\n",
                   call);
      std::abort();
    }
    return nullptr;
  }
  std::shared_ptr<fake_device::fake_stream> stream(cudaStream_t s) {
    std::lock_guard lock(mutex);
    if (!s) return legacy;
    auto it = streams.find(s);
    return it == streams.end() ? nullptr : it->second;
  }
  std::shared_ptr<event_state> event(cudaEvent_t e) {
    std::lock_guard lock(mutex);
    auto it = events.find(e);
    return it == events.end() ? nullptr : it->second;
  }
  /// Whether [p, p + bytes) lies in one device allocation.
  bool on_device(const void* p, std::size_t bytes) {
    std::lock_guard lock(mutex);
    const char* c = static_cast<const char*>(p);
    auto it = device.upper_bound(c);
    if (it == device.begin()) return false;
    --it;
    return c >= it->first && c + bytes <= it->first + it->second;
  }
  /// FAKE_NCCL_ONE_COMM_AT_A_TIME=1: a collective of `c` starts while one of
  /// another communicator runs on this GPU, which NCCL's guide says can
  /// deadlock: the process ends with a message.
  void check_alone(const comm_state& c) {
    std::lock_guard lock(mutex);
    for (const auto& [handle, other] : comms) {
      if (other.get() != &c && other->running > 0 && !other->aborted) {
        std::fprintf(stderr,
                     "fake NCCL: collectives of two communicators (%s and %s) run at once on one "
                     "GPU, which can deadlock\n",
                     c.id.c_str(), other->id.c_str());
        std::abort();
      }
    }
  }
  /// Waits until no collective of any communicator is running: what a
  /// device-wide synchronization waits for.
  void wait_for_device() {
    for (;;) {
      bool busy = false;
      {
        std::lock_guard lock(mutex);
        for (const auto& [handle, c] : comms) busy = busy || c->running > 0;
        for (const auto& [handle, c] : freed) busy = busy || c->running > 0;
      }
      if (!busy) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
};

inline thread_local int current_device = 0;

/// The collectives of an open group (ncclGroupStart), launched by ncclGroupEnd.
struct group_state {
  int depth = 0;
  std::vector<std::function<ncclResult_t()>> deferred;
  std::vector<std::shared_ptr<comm_state>> comms;
};
inline thread_local group_state group;

/// The node: a simulated one's name (dtrain_test_launch --nodes), else the host's.
inline std::string host_name() {
  if (const char* node = std::getenv("DTRAIN_NODE_NAME"); node && *node) return node;
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  return name;
}

/// The node's GPU index behind this process's device ordinal `device`.
inline int physical_gpu(int device) {
  const std::string visible = env_text("CUDA_VISIBLE_DEVICES");
  if (visible.empty()) return device;
  std::vector<int> ids;
  std::size_t start = 0;
  while (start <= visible.size()) {
    const std::size_t comma = visible.find(',', start);
    ids.push_back(std::atoi(visible.substr(start, comma - start).c_str()));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return device < static_cast<int>(ids.size()) ? ids[static_cast<std::size_t>(device)] : -1;
}

inline int visible_devices() {
  if (env_int("FAKE_CUDA_NO_DEVICE_RANK", -1) == env_int("RANK", -2)) return 0;
  const int gpus = env_int("FAKE_CUDA_GPUS", 4);
  const std::string visible = env_text("CUDA_VISIBLE_DEVICES");
  if (visible.empty()) return gpus;
  return static_cast<int>(std::count(visible.begin(), visible.end(), ',')) + 1;
}

// 16-bit floats as NCCL's kernels round them (to nearest, ties to even).
inline float from_bf16(std::uint16_t b) { return std::bit_cast<float>(std::uint32_t{b} << 16); }
inline std::uint16_t to_bf16(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // NaN
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float from_fp16(std::uint16_t b) { return static_cast<float>(std::bit_cast<_Float16>(b)); }
inline std::uint16_t to_fp16(float x) {
  return std::bit_cast<std::uint16_t>(static_cast<_Float16>(x));
}

// Element-wise reduction of the ranks' parts, in double (exact for the tests' values).
template <class T>
void reduce_into(void* out, const std::vector<std::string>& parts, std::size_t offset,
                 std::size_t count, ncclRedOp_t op) {
  auto* o = static_cast<T*>(out);
  for (std::size_t i = 0; i < count; ++i) {
    double acc = 0;
    for (std::size_t r = 0; r < parts.size(); ++r) {
      T v;
      std::memcpy(&v, parts[r].data() + (offset + i) * sizeof(T), sizeof(T));
      const double x = static_cast<double>(v);
      if (r == 0) {
        acc = x;
      } else if (op == ncclSum || op == ncclAvg) {
        acc += x;
      } else if (op == ncclProd) {
        acc *= x;
      } else if (op == ncclMin) {
        acc = std::min(acc, x);
      } else {
        acc = std::max(acc, x);
      }
    }
    if (op == ncclAvg) acc /= static_cast<double>(parts.size());
    o[i] = static_cast<T>(acc);
  }
}

// A 16-bit reduction as NCCL's: in the type's precision, each partial rounded,
// in rank order; avg multiplies each element by 1/n rounded to the type first.
inline void reduce_16(bool bf16, void* out, const std::vector<std::string>& parts,
                      std::size_t offset, std::size_t count, ncclRedOp_t op) {
  auto from = [&](std::uint16_t b) { return bf16 ? from_bf16(b) : from_fp16(b); };
  auto to = [&](float x) { return bf16 ? to_bf16(x) : to_fp16(x); };
  const float scale = from(to(1.0f / static_cast<float>(parts.size())));
  auto* o = static_cast<std::uint16_t*>(out);
  for (std::size_t i = 0; i < count; ++i) {
    float acc = 0;
    for (std::size_t r = 0; r < parts.size(); ++r) {
      std::uint16_t b;
      std::memcpy(&b, parts[r].data() + (offset + i) * 2, 2);
      float x = from(b);
      if (op == ncclAvg) x = from(to(x * scale));
      if (r == 0) {
        acc = x;
      } else if (op == ncclSum || op == ncclAvg) {
        acc = from(to(acc + x));
      } else if (op == ncclProd) {
        acc = from(to(acc * x));
      } else if (op == ncclMin) {
        acc = std::min(acc, x);
      } else {
        acc = std::max(acc, x);
      }
    }
    o[i] = to(acc);
  }
}

inline std::size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclFloat64:
    case ncclInt64:
    case ncclUint64: return 8;
    case ncclFloat32:
    case ncclInt32:
    case ncclUint32: return 4;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    default: return 1;
  }
}

inline void reduce_typed(ncclDataType_t t, void* out, const std::vector<std::string>& parts,
                         std::size_t offset, std::size_t count, ncclRedOp_t op) {
  switch (t) {
    case ncclFloat64: return reduce_into<double>(out, parts, offset, count, op);
    case ncclFloat32: return reduce_into<float>(out, parts, offset, count, op);
    case ncclInt64: return reduce_into<std::int64_t>(out, parts, offset, count, op);
    case ncclInt32: return reduce_into<std::int32_t>(out, parts, offset, count, op);
    case ncclUint8: return reduce_into<std::uint8_t>(out, parts, offset, count, op);
    case ncclFloat16: return reduce_16(false, out, parts, offset, count, op);
    case ncclBfloat16: return reduce_16(true, out, parts, offset, count, op);
    default: std::abort();  // the tests use the types above
  }
}

/// The fake runtime: the members dtrain::detail::nccl_library has.
struct api {
  // --- CUDA ---
  static cudaError_t cudaGetDeviceCount(int* count) {
    *count = visible_devices();
    return *count == 0 ? cudaErrorNoDevice : cudaSuccess;
  }
  static cudaError_t cudaGetDevice(int* device) {
    *device = current_device;
    return cudaSuccess;
  }
  static cudaError_t cudaSetDevice(int device) {
    if (device < 0 || device >= visible_devices()) return cudaErrorInvalidDevice;
    current_device = device;
    return cudaSuccess;
  }
  static cudaError_t device_identity(int device, std::string& uuid, std::string& pci_bus) {
    if (device < 0 || device >= visible_devices()) return cudaErrorInvalidDevice;
    if (env_int("FAKE_CUDA_IDENTITY_FAILS_RANK", -1) == env_int("RANK", -2))
      return cudaErrorECCUncorrectable;
    const int gpu = physical_gpu(device);
    uuid = "GPU-fake" + std::to_string(gpu) + "-" + host_name();
    pci_bus = "00000000:" + std::to_string(10 + gpu) + ":00.0";
    return cudaSuccess;
  }
  static bool thread_has_context() noexcept { return true; }
  static cudaError_t cudaGetLastError() { return cudaSuccess; }
  static cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
    auto s = std::make_shared<fake_device::fake_stream>();
    *stream = reinterpret_cast<cudaStream_t>(s.get());
    std::lock_guard lock(registry::get().mutex);
    registry::get().streams.emplace(s.get(), std::move(s));
    return cudaSuccess;
  }
  static cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    std::shared_ptr<fake_device::fake_stream> s;
    {
      std::lock_guard lock(registry::get().mutex);
      auto it = registry::get().streams.find(stream);
      if (it == registry::get().streams.end()) return cudaErrorInvalidResourceHandle;
      s = std::move(it->second);
      registry::get().streams.erase(it);
    }
    // As CUDA: the work left on it still runs. The thread ends when it has.
    std::thread([s = std::move(s)]() mutable { s.reset(); }).detach();
    return cudaSuccess;
  }
  static cudaError_t cudaStreamQuery(cudaStream_t stream) {
    auto s = registry::get().stream(stream);
    if (!s) return cudaErrorInvalidResourceHandle;
    return s->pending() == 0 ? cudaSuccess : cudaErrorNotReady;
  }
  static cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    auto s = registry::get().stream(stream);
    if (!s) return cudaErrorInvalidResourceHandle;
    static const std::atomic<bool> never{false};
    s->synchronize(never);
    return cudaSuccess;
  }
  static cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned) {
    auto s = registry::get().stream(stream);
    auto e = registry::get().event(event);
    if (!s || !e) return cudaErrorInvalidResourceHandle;
    auto before = e->stream.lock();
    const std::uint64_t count = e->count;
    s->enqueue({}, [before, count] {
      static const std::atomic<bool> never{false};
      if (before) before->reached(count, never);
    });
    return cudaSuccess;
  }
  static cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned) {
    auto e = std::make_shared<registry::event_state>();
    *event = reinterpret_cast<cudaEvent_t>(e.get());
    std::lock_guard lock(registry::get().mutex);
    registry::get().events.emplace(e.get(), std::move(e));
    return cudaSuccess;
  }
  static cudaError_t cudaEventDestroy(cudaEvent_t event) {
    std::lock_guard lock(registry::get().mutex);
    return registry::get().events.erase(event) ? cudaSuccess : cudaErrorInvalidResourceHandle;
  }
  static cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    auto s = registry::get().stream(stream);
    auto e = registry::get().event(event);
    if (!s || !e) return cudaErrorInvalidResourceHandle;
    e->stamp = -1;
    s->enqueue({}, [e, record = ++e->records] {
      if (e->records == record) e->stamp = steady_ns();
    });
    const auto marker = s->now(s);
    std::lock_guard lock(registry::get().mutex);
    e->stream = s;
    e->count = marker.count;
    return cudaSuccess;
  }
  static cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
    auto a = registry::get().event(start);
    auto b = registry::get().event(end);
    if (!a || !b) return cudaErrorInvalidResourceHandle;
    const std::int64_t from = a->stamp, to = b->stamp;
    if (from < 0 || to < 0) return cudaErrorNotReady;
    *ms = static_cast<float>(static_cast<double>(to - from) / 1e6);
    return cudaSuccess;
  }
  static std::int64_t steady_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now().time_since_epoch())
        .count();
  }
  static cudaError_t cudaEventQuery(cudaEvent_t event) {
    auto e = registry::get().event(event);
    if (!e) return cudaErrorInvalidResourceHandle;
    std::shared_ptr<fake_device::fake_stream> s;
    std::uint64_t count = 0;
    {
      std::lock_guard lock(registry::get().mutex);
      s = e->stream.lock();
      count = e->count;
    }
    return !s || s->has_reached(count) ? cudaSuccess : cudaErrorNotReady;
  }
  static cudaError_t cudaMalloc(void** data, std::size_t bytes) {
    const std::size_t n = bytes ? bytes : 1;
    *data = std::calloc(1, n);
    if (!*data) return cudaErrorMemoryAllocation;
    std::lock_guard lock(registry::get().mutex);
    registry::get().device.emplace(static_cast<const char*>(*data), n);
    return cudaSuccess;
  }
  static cudaError_t cudaMallocAsync(void** data, std::size_t bytes, cudaStream_t) {
    return cudaMalloc(data, bytes);
  }
  /// As CUDA's: waits for the whole device first.
  static cudaError_t cudaFree(void* data) {
    registry::get().wait_for_device();
    return free_now(data);
  }
  static cudaError_t cudaFreeAsync(void* data, cudaStream_t stream) {
    auto s = registry::get().stream(stream);
    if (!s) return cudaErrorInvalidResourceHandle;
    s->enqueue({}, [data] { (void)free_now(data); });
    return cudaSuccess;
  }
  static cudaError_t cudaMallocHost(void** data, std::size_t bytes) {
    *data = std::calloc(1, bytes ? bytes : 1);
    return *data ? cudaSuccess : cudaErrorMemoryAllocation;
  }
  static cudaError_t cudaFreeHost(void* data) {
    registry::get().wait_for_device();
    std::free(data);
    return cudaSuccess;
  }
  static cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind,
                                     cudaStream_t stream) {
    auto s = registry::get().stream(stream);
    if (!s) return cudaErrorInvalidResourceHandle;
    s->enqueue({}, [=] { std::memcpy(dst, src, bytes); });
    return cudaSuccess;
  }
  static cudaError_t cudaMemsetAsync(void* data, int value, std::size_t bytes,
                                     cudaStream_t stream) {
    auto s = registry::get().stream(stream);
    if (!s) return cudaErrorInvalidResourceHandle;
    s->enqueue({}, [=] { std::memset(data, value, bytes); });
    return cudaSuccess;
  }

  /// dtrain's divide kernel (nccl_library::divide), on the stream.
  static cudaError_t divide(void* out, const void* in, std::size_t count, dtrain::dtype type,
                            float divisor, cudaStream_t stream) {
    auto s = registry::get().stream(stream);
    if (!s) return cudaErrorInvalidResourceHandle;
    const bool bf16 = type == dtrain::dtype::bfloat16;
    s->enqueue({}, [=] {
      for (std::size_t i = 0; i < count; ++i) {
        std::uint16_t b;
        std::memcpy(&b, static_cast<const char*>(in) + 2 * i, 2);
        const float x = (bf16 ? from_bf16(b) : from_fp16(b)) / divisor;
        b = bf16 ? to_bf16(x) : to_fp16(x);
        std::memcpy(static_cast<char*>(out) + 2 * i, &b, 2);
      }
    });
    return cudaSuccess;
  }
  [[nodiscard]] static bool can_divide() noexcept { return true; }

  // --- NCCL ---
  static constexpr bool has_revoke = true;

  static ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    if (env_int("FAKE_NCCL_ID_FAILS", 0) == 1) return ncclSystemError;
    std::random_device random;
    const std::string token = "c" + std::to_string(random()) + std::to_string(random());
    std::memset(id->internal, 0, sizeof id->internal);
    token.copy(id->internal, sizeof id->internal - 1);
    return ncclSuccess;
  }
  static ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int size, ncclUniqueId id, int rank,
                                             ncclConfig_t* config) {
    if (env_int("FAKE_NCCL_INIT_FAILS_RANK", -1) == env_int("RANK", -2)) return ncclSystemError;
    const std::string base = env_text("FAKE_NCCL_DIR");
    if (base.empty()) return ncclInvalidUsage;
    auto c = join(std::string(id.internal), rank, size, blocking(config));
    *comm = reinterpret_cast<ncclComm_t>(c.get());
    if (!c->blocking) return ncclInProgress;
    while (!c->everyone_joined()) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    return ncclSuccess;
  }
  static ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
    auto c = registry::get().comm(comm, "ncclCommGetAsyncError");
    if (!c) return ncclInvalidArgument;
    if (c->async_error.load() != ncclSuccess) {
      *state = static_cast<ncclResult_t>(c->async_error.load());
    } else {
      *state = c->everyone_joined() && !c->launching() && c->background == 0 ? ncclSuccess
                                                                             : ncclInProgress;
    }
    return ncclSuccess;
  }
  /// Stops the communicator's collectives; frees nothing.
  static ncclResult_t ncclCommRevoke(ncclComm_t comm, int flags) {
    stuck_if_asked();
    auto c = registry::get().comm(comm, "ncclCommRevoke");
    if (!c || flags != 0) return ncclInvalidArgument;
    c->aborted = true;
    return ncclSuccess;
  }
  /// Stops its collectives, waits for the device (every running collective,
  /// as NCCL's stream synchronization does), then frees the communicator.
  static ncclResult_t ncclCommAbort(ncclComm_t comm) {
    stuck_if_asked();
    auto c = registry::get().comm(comm, "ncclCommAbort");
    if (!c) return ncclInvalidArgument;
    c->aborted = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(env_int("FAKE_NCCL_ABORT_MS", 20)));
    registry::get().wait_for_device();
    std::lock_guard lock(registry::get().mutex);
    registry::get().comms.erase(comm);
    registry::get().freed.emplace(comm, std::move(c));
    return ncclSuccess;
  }
  static ncclResult_t ncclCommFinalize(ncclComm_t comm) {
    auto c = registry::get().comm(comm, "ncclCommFinalize");
    if (!c) return ncclInvalidArgument;
    if (!c->blocking && c->launching())
      return misuse("ncclCommFinalize while a launch is in progress");
    return ncclSuccess;
  }
  static ncclResult_t ncclCommDestroy(ncclComm_t comm) { return ncclCommAbort(comm); }
  static ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* out,
                                    ncclConfig_t* config) {
    auto c = registry::get().comm(comm, "ncclCommSplit");
    if (!c) return ncclInvalidArgument;
    if (!c->blocking && c->launching())
      return misuse("ncclCommSplit while a launch is in progress");
    const int k = ++c->splits;
    const bool blocking = api::blocking(config);
    const std::string stem = c->dir + "/split" + std::to_string(k) + ".r";
    {
      std::ofstream f(stem + std::to_string(c->rank) + ".tmp");
      f << color << ' ' << key;
    }
    std::filesystem::rename(stem + std::to_string(c->rank) + ".tmp",
                            stem + std::to_string(c->rank));
    // The ranks' colors and keys, then this rank's child (a background task
    // when non-blocking: the parent is in progress until it is done).
    auto meet = [c, k, stem, color, key, out, blocking] {
      std::vector<std::pair<int, int>> keys;  // (key, rank) of my color
      for (int r = 0; r < c->size; ++r) {
        const std::string path = stem + std::to_string(r);
        while (!std::filesystem::exists(path)) {
          if (c->aborted) return;
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        int their_color = 0, their_key = 0;
        std::ifstream(path) >> their_color >> their_key;
        if (their_color == color && color != NCCL_SPLIT_NOCOLOR) keys.emplace_back(their_key, r);
      }
      if (color == NCCL_SPLIT_NOCOLOR) {
        *out = nullptr;
        return;
      }
      std::sort(keys.begin(), keys.end());
      const auto mine = std::find(keys.begin(), keys.end(), std::pair{key, c->rank});
      auto child =
          join(c->id + "-s" + std::to_string(k) + "c" + std::to_string(color),
               static_cast<int>(mine - keys.begin()), static_cast<int>(keys.size()), blocking);
      *out = reinterpret_cast<ncclComm_t>(child.get());
    };
    *out = nullptr;
    if (c->blocking) {
      meet();
      return c->aborted ? ncclSystemError : ncclSuccess;
    }
    ++c->background;
    std::thread([c, meet] {
      meet();
      --c->background;
    }).detach();
    return ncclInProgress;
  }
  static ncclResult_t ncclCommUserRank(ncclComm_t comm, int* rank) {
    auto c = registry::get().comm(comm, "ncclCommUserRank");
    if (!c) return ncclInvalidArgument;
    *rank = c->rank;
    return ncclSuccess;
  }
  static ncclResult_t ncclCommCount(ncclComm_t comm, int* count) {
    auto c = registry::get().comm(comm, "ncclCommCount");
    if (!c) return ncclInvalidArgument;
    *count = c->size;
    return ncclSuccess;
  }
  static ncclResult_t ncclGroupStart() {
    ++group.depth;
    return ncclSuccess;
  }
  /// Launches the group's collectives; ncclInProgress on a non-blocking
  /// communicator until the launch completes.
  static ncclResult_t ncclGroupEnd() {
    if (group.depth == 0) return misuse("ncclGroupEnd without ncclGroupStart");
    if (--group.depth > 0) return ncclSuccess;
    auto deferred = std::move(group.deferred);
    auto comms = std::move(group.comms);
    group = {};
    ncclResult_t result = ncclSuccess;
    for (auto& launch : deferred) {
      const ncclResult_t r = launch();
      if (r != ncclSuccess && r != ncclInProgress && result == ncclSuccess) result = r;
    }
    bool in_progress = false;
    for (auto& c : comms) {
      if (!c->blocking) {
        c->launched();
        in_progress = true;
      }
    }
    return result == ncclSuccess && in_progress ? ncclInProgress : result;
  }

  enum class kind { allreduce, broadcast, allgather, reduce_scatter, alltoall };
  static ncclResult_t ncclAllReduce(const void* in, void* out, std::size_t count,
                                    ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                    cudaStream_t stream) {
    return enqueue(kind::allreduce, in, out, count, type, op, 0, comm, stream);
  }
  static ncclResult_t ncclBroadcast(const void* in, void* out, std::size_t count,
                                    ncclDataType_t type, int root, ncclComm_t comm,
                                    cudaStream_t stream) {
    return enqueue(kind::broadcast, in, out, count, type, ncclSum, root, comm, stream);
  }
  static ncclResult_t ncclAllGather(const void* in, void* out, std::size_t count,
                                    ncclDataType_t type, ncclComm_t comm, cudaStream_t stream) {
    return enqueue(kind::allgather, in, out, count, type, ncclSum, 0, comm, stream);
  }
  static ncclResult_t ncclReduceScatter(const void* in, void* out, std::size_t count,
                                        ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                        cudaStream_t stream) {
    return enqueue(kind::reduce_scatter, in, out, count, type, op, 0, comm, stream);
  }
  /// The engine's seam for alltoall (the real one groups ncclSend/ncclRecv):
  /// one meeting, `count` elements per block.
  static ncclResult_t alltoall(const void* in, void* out, std::size_t count, ncclDataType_t type,
                               std::size_t /*width*/, int /*size*/, ncclComm_t comm,
                               cudaStream_t stream) {
    return enqueue(kind::alltoall, in, out, count, type, ncclSum, 0, comm, stream);
  }

 private:
  /// FAKE_NCCL_ABORT_HANGS=1: revoke and abort never return (NCCL's threads stuck).
  static void stuck_if_asked() {
    if (env_int("FAKE_NCCL_ABORT_HANGS", 0) != 1) return;
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }

  /// NCCL_COMM_BLOCKING overrides the config, as in NCCL.
  static bool blocking(const ncclConfig_t* config) {
    const int forced = env_int("NCCL_COMM_BLOCKING", -1);
    if (forced >= 0) return forced != 0;
    return !config || config->blocking != 0;
  }

  static cudaError_t free_now(void* data) {
    {
      std::lock_guard lock(registry::get().mutex);
      registry::get().device.erase(static_cast<const char*>(data));
    }
    std::free(data);
    return cudaSuccess;
  }

  /// This rank's communicator `id`, joined (its file in the meeting directory).
  static std::shared_ptr<comm_state> join(const std::string& id, int rank, int size,
                                          bool blocking) {
    auto c = std::make_shared<comm_state>();
    c->id = id;
    c->dir = env_text("FAKE_NCCL_DIR") + "/" + id;
    c->rank = rank;
    c->size = size;
    c->blocking = blocking;
    std::error_code ec;
    std::filesystem::create_directories(c->dir, ec);
    std::ofstream(c->dir + "/join." + std::to_string(rank)) << rank;
    std::lock_guard lock(registry::get().mutex);
    registry::get().comms.emplace(c.get(), c);
    return c;
  }

  // The enqueue as NCCL's: checks the buffers are device memory, defers to
  // ncclGroupEnd inside a group, blocks the caller while the launch queue is
  // full (until it drains or the communicator is stopped), then puts the
  // collective on the stream; non-blocking, the launch completes shortly after.
  static ncclResult_t enqueue(kind k, const void* in, void* out, std::size_t count,
                              ncclDataType_t type, ncclRedOp_t op, int root, ncclComm_t comm,
                              cudaStream_t stream) {
    auto c = registry::get().comm(comm, "a collective");
    auto s = registry::get().stream(stream);
    if (!c || !s) return ncclInvalidArgument;
    if (!c->everyone_joined()) return misuse("a collective before the communicator is ready");
    if (!c->blocking && c->launching())
      return misuse("a collective while the previous call's launch is in progress");
    const std::size_t width = type_size(type);
    const std::size_t ranks = static_cast<std::size_t>(c->size);
    const bool blocks_in = k == kind::reduce_scatter || k == kind::alltoall;
    const std::size_t in_bytes = (blocks_in ? count * ranks : count) * width;
    const std::size_t out_bytes =
        (k == kind::allgather || k == kind::alltoall ? count * ranks : count) * width;
    if (!registry::get().on_device(in, in_bytes) || !registry::get().on_device(out, out_bytes)) {
      std::fprintf(stderr, "fake NCCL: a collective's buffer is not device memory\n");
      return ncclInvalidArgument;
    }
    if (group.depth > 0) {
      group.deferred.push_back(
          [=] { return launch(c, s, k, in, out, count, type, op, root, comm); });
      group.comms.push_back(c);
      return ncclSuccess;
    }
    const ncclResult_t r = launch(c, s, k, in, out, count, type, op, root, comm);
    if (r != ncclSuccess || c->blocking) return r;
    c->launched();
    return ncclInProgress;
  }

  static ncclResult_t launch(const std::shared_ptr<comm_state>& c,
                             const std::shared_ptr<fake_device::fake_stream>& s, kind k,
                             const void* in, void* out, std::size_t count, ncclDataType_t type,
                             ncclRedOp_t op, int root, ncclComm_t handle) {
    const int queue = env_int("FAKE_NCCL_LAUNCH_QUEUE", 0);
    if (queue > 0 && s->pending() >= static_cast<std::uint64_t>(queue)) {
      while (s->pending() >= static_cast<std::uint64_t>(queue) && !c->aborted)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      // As NCCL's: the call goes on with the communicator it was given, which
      // an abort must not have freed meanwhile (a use after free ends the
      // process). It takes longer to notice than the abort takes to free.
      std::this_thread::sleep_for(
          std::chrono::milliseconds(2 * env_int("FAKE_NCCL_ABORT_MS", 20) + 50));
      (void)registry::get().comm(handle, "a collective that waited for its launch queue");
    }
    if (c->aborted) return ncclSystemError;
    const std::uint64_t seq = ++c->issued;
    const std::size_t width = type_size(type);
    const std::size_t in_bytes = (k == kind::reduce_scatter || k == kind::alltoall
                                      ? count * static_cast<std::size_t>(c->size)
                                      : count) *
                                 width;
    const int error_at = env_int("FAKE_NCCL_ASYNC_ERROR_AT", 0);
    const int slow_ms = env_int("FAKE_NCCL_COLLECTIVE_MS", 0);
    s->enqueue({}, [=] {
      const std::int64_t started = steady_ns();
      ++c->running;
      struct done {
        comm_state& c;
        ~done() { --c.running; }
      } running{*c};
      if (c->aborted) return;
      if (env_int("FAKE_NCCL_ONE_COMM_AT_A_TIME", 0) == 1) registry::get().check_alone(*c);
      if (error_at > 0 && seq == static_cast<std::uint64_t>(error_at)) {
        c->async_error = ncclRemoteError;
        while (!c->aborted) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        return;
      }
      // This rank's part, then everyone's (a file each, renamed into place whole).
      const std::string stem = c->dir + "/c" + std::to_string(seq) + ".r";
      const std::string mine = stem + std::to_string(c->rank);
      {
        std::ofstream f(mine + ".tmp", std::ios::binary);
        f.write(static_cast<const char*>(in), static_cast<std::streamsize>(in_bytes));
      }
      std::filesystem::rename(mine + ".tmp", mine);
      std::vector<std::string> parts(static_cast<std::size_t>(c->size));
      for (int r = 0; r < c->size; ++r) {
        const std::string path = stem + std::to_string(r);
        while (!std::filesystem::exists(path)) {
          if (c->aborted) return;  // the peer never came: only an abort ends this
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        std::ifstream f(path, std::ios::binary);
        parts[static_cast<std::size_t>(r)].assign(std::istreambuf_iterator<char>(f), {});
      }
      // Every rank wrote this collective's part, so every rank has read the
      // last one's: this rank's part of it can go.
      std::error_code ec;
      std::filesystem::remove(
          c->dir + "/c" + std::to_string(seq - 1) + ".r" + std::to_string(c->rank), ec);
      switch (k) {
        case kind::allreduce: reduce_typed(type, out, parts, 0, count, op); break;
        case kind::broadcast:
          std::memcpy(out, parts[static_cast<std::size_t>(root)].data(), count * width);
          break;
        case kind::allgather:
          for (std::size_t r = 0; r < parts.size(); ++r)
            std::memcpy(static_cast<char*>(out) + r * count * width, parts[r].data(),
                        count * width);
          break;
        case kind::reduce_scatter:
          reduce_typed(type, out, parts, static_cast<std::size_t>(c->rank) * count, count, op);
          break;
        case kind::alltoall:
          for (std::size_t r = 0; r < parts.size(); ++r)
            std::memcpy(static_cast<char*>(out) + r * count * width,
                        parts[r].data() + static_cast<std::size_t>(c->rank) * count * width,
                        count * width);
          break;
      }
      if (slow_ms > 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
        std::lock_guard lock(registry::get().mutex);
        registry::get().ran.push_back({static_cast<int>(k), started, steady_ns()});
      }
    });
    return ncclSuccess;
  }
};

/// DistributedDataParallel's memory space over the fake: cuda_memory's
/// operations, on the fake's streams and device memory.
struct memory {
  using stream_type = cudaStream_t;
  static constexpr dtrain::memory where = dtrain::memory::device;
  static constexpr bool on_stream = true;
  /// cuda_memory's timer, on the fake's events (stamped by the host's clock).
  using device_timer = dtrain::detail::basic_device_timer<api>;

  [[nodiscard]] static void* allocate(std::size_t bytes, int, stream_type stream) {
    void* data = nullptr;
    DTRAIN_CUDA_CHECK(api::cudaMallocAsync(&data, bytes == 0 ? 1 : bytes, stream));
    DTRAIN_CUDA_CHECK(api::cudaMemsetAsync(data, 0, bytes == 0 ? 1 : bytes, stream));
    return data;
  }
  static void release(void* data, int, stream_type stream) noexcept {
    (void)api::cudaFreeAsync(data, stream);
  }
  static void zero(void* data, std::size_t bytes, int, stream_type stream) {
    if (bytes) DTRAIN_CUDA_CHECK(api::cudaMemsetAsync(data, 0, bytes, stream));
  }
  static void copy(void* dst, const void* src, std::size_t bytes, int, stream_type stream) {
    if (dst != src && bytes)
      DTRAIN_CUDA_CHECK(api::cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  }
  static void upload(void* dst, const void* host, std::size_t bytes, int, stream_type stream) {
    // As CUDA's from pageable memory: `host` may be reused when this returns.
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(host),
                                                      static_cast<const char*>(host) + bytes);
    auto s = registry::get().stream(stream);
    if (!s) throw dtrain::backend_error("fake CUDA: upload on an unknown stream", 400);
    s->enqueue({}, [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
  }
  static void download(void* host, const void* src, std::size_t bytes, int, stream_type stream) {
    if (bytes)
      DTRAIN_CUDA_CHECK(api::cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream));
  }
  static void compress(void* out, const float* in, std::size_t n, float scale, dtrain::dtype wire,
                       int, stream_type stream) {
    auto s = registry::get().stream(stream);
    s->enqueue({}, [=] { dtrain::detail::host_compress(out, in, n, scale, wire); });
  }
  static void decompress(float* out, const void* in, std::size_t n, dtrain::dtype wire, int,
                         stream_type stream) {
    auto s = registry::get().stream(stream);
    s->enqueue({}, [=] { dtrain::detail::host_decompress(out, in, n, wire); });
  }
  static void accumulate(void* out, dtrain::dtype out_type, const void* in, dtrain::dtype in_type,
                         std::size_t blocks, std::size_t count, float divisor, int,
                         stream_type stream) {
    auto s = registry::get().stream(stream);
    s->enqueue({}, [=] {
      dtrain::detail::host_accumulate(out, out_type, in, in_type, blocks, count, divisor);
    });
  }
  [[nodiscard]] static bool casts_available() noexcept { return true; }
  static void synchronize(int, stream_type stream) {
    DTRAIN_CUDA_CHECK(api::cudaStreamSynchronize(stream));
  }
  static void order_after(int, stream_type waiter, stream_type before) {
    if (waiter == before) return;
    cudaEvent_t done = nullptr;
    DTRAIN_CUDA_CHECK(api::cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    DTRAIN_CUDA_CHECK(api::cudaEventRecord(done, before));
    DTRAIN_CUDA_CHECK(api::cudaStreamWaitEvent(waiter, done, 0));
    DTRAIN_CUDA_CHECK(api::cudaEventDestroy(done));
  }
  static void check_stream(int, stream_type) noexcept {}
};

/// The backend tag of a policy whose communicator is the NCCL engine over this fake.
struct backend {
  static constexpr bool available = true;
  static constexpr std::string_view name = "nccl-fake";
};

using communicator = dtrain::basic_nccl_communicator<api>;

}  // namespace fake_nccl

template <>
struct dtrain::backend_traits<fake_nccl::backend> {
  using communicator = fake_nccl::communicator;
  using memory_space = fake_nccl::memory;
  static constexpr bool uses_gpus = true;
  static constexpr bool needs_store = true;
  template <class Store>
  static communicator make(const communicator_setup<Store>& s) {
    return communicator(*s.store, s.rank, s.size, s.device,
                        dtrain::nccl_options{.collectives = s.collectives}.with_env(*s.env));
  }
};
