// A host fake of the CUDA runtime and NCCL, as the NCCL engine calls them
// through its seam (dtrain::detail::nccl_library): with it,
// dtrain::basic_nccl_communicator<fake_nccl::api> runs at 2-4 ranks on a
// machine without a GPU, and the failures that only a peer causes happen on
// purpose. What it keeps of the real semantics:
//   - streams run their work in order on a thread each (fake_device::fake_stream);
//     events mark a point on a stream; cudaStreamWaitEvent orders one stream
//     after another; "device memory" is host memory;
//   - a communicator is created non-blocking: ncclCommInitRankConfig returns
//     ncclInProgress and ncclCommGetAsyncError says so until every rank has
//     joined (a peer that never arrives leaves it in progress for ever);
//   - a collective is a task on the stream that meets the other ranks' in a
//     directory (FAKE_NCCL_DIR: every rank writes its part as a file and
//     waits for the others'); it never completes while a peer is missing;
//   - an enqueue blocks, in the calling thread, while FAKE_NCCL_LAUNCH_QUEUE
//     collectives are unfinished on the stream (NCCL's work FIFO, CUDA's
//     launch queue), until they finish or the communicator is aborted;
//   - ncclCommAbort, from any thread, ends every blocked enqueue and every
//     waiting collective of that communicator; calls then fail;
//   - FAKE_NCCL_ASYNC_ERROR_AT=k: the k-th collective (from 1) raises an
//     asynchronous error (ncclRemoteError, a peer's network went away)
//     instead of completing;
//   - FAKE_NCCL_ID_FAILS=1: ncclGetUniqueId fails (ncclSystemError);
//   - FAKE_NCCL_INIT_FAILS_RANK=r: on the process whose RANK is r,
//     ncclCommInitRankConfig fails (ncclSystemError) and the rank never joins;
//   - FAKE_CUDA_NO_DEVICE_RANK=r: the process whose RANK is r sees no device;
//   - FAKE_CUDA_IDENTITY_FAILS_RANK=r: that process cannot read its GPU's
//     properties (an uncorrectable ECC error);
//   - FAKE_CUDA_GPUS: the node's GPUs (default 4); CUDA_VISIBLE_DEVICES maps
//     a rank's device ordinals onto them, so that two ranks can be shown the
//     same GPU; each GPU's UUID is "GPU-fake<index>-<hostname>".
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
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
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

/// A communicator of the fake: where its ranks meet, and its abort flag.
struct comm_state {
  std::string dir;  // FAKE_NCCL_DIR/<id>
  int rank = 0;
  int size = 1;
  std::atomic<bool> aborted{false};
  std::atomic<int> async_error{ncclSuccess};
  std::uint64_t issued = 0;  // collectives enqueued (the caller's thread only)
  std::shared_ptr<fake_device::fake_stream> last_stream;

  [[nodiscard]] bool everyone_joined() const {
    for (int r = 0; r < size; ++r)
      if (!std::filesystem::exists(dir + "/join." + std::to_string(r))) return false;
    return true;
  }
};

/// The process's fake objects, found from the handles the engine holds.
struct registry {
  std::mutex mutex;
  std::map<const void*, std::shared_ptr<comm_state>> comms;
  std::map<const void*, std::shared_ptr<fake_device::fake_stream>> streams;
  struct event_state {
    std::weak_ptr<fake_device::fake_stream> stream;
    std::uint64_t count = 0;
  };
  std::map<const void*, std::shared_ptr<event_state>> events;
  std::shared_ptr<fake_device::fake_stream> legacy = std::make_shared<fake_device::fake_stream>();

  static registry& get() {
    static registry* r =
        new registry();  // never destroyed: stream threads may outlive main's locals
    return *r;
  }
  std::shared_ptr<comm_state> comm(ncclComm_t c) {
    std::lock_guard lock(mutex);
    auto it = comms.find(c);
    return it == comms.end() ? nullptr : it->second;
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
};

inline thread_local int current_device = 0;

inline std::string host_name() {
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
    const auto marker = s->now(s);
    std::lock_guard lock(registry::get().mutex);
    e->stream = s;
    e->count = marker.count;
    return cudaSuccess;
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
    *data = std::calloc(1, bytes ? bytes : 1);
    return *data ? cudaSuccess : cudaErrorMemoryAllocation;
  }
  static cudaError_t cudaFree(void* data) {
    std::free(data);
    return cudaSuccess;
  }
  static cudaError_t cudaMallocHost(void** data, std::size_t bytes) {
    return cudaMalloc(data, bytes);
  }
  static cudaError_t cudaFreeHost(void* data) { return cudaFree(data); }
  static cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind,
                                     cudaStream_t stream) {
    auto s = registry::get().stream(stream);
    if (!s) return cudaErrorInvalidResourceHandle;
    s->enqueue({}, [=] { std::memcpy(dst, src, bytes); });
    return cudaSuccess;
  }

  // --- NCCL ---
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
    auto c = std::make_shared<comm_state>();
    c->dir = base + "/" + std::string(id.internal);
    c->rank = rank;
    c->size = size;
    std::error_code ec;
    std::filesystem::create_directories(c->dir, ec);
    std::ofstream(c->dir + "/join." + std::to_string(rank)) << rank;
    *comm = reinterpret_cast<ncclComm_t>(c.get());
    {
      std::lock_guard lock(registry::get().mutex);
      registry::get().comms.emplace(c.get(), c);
    }
    if (config && config->blocking == 0) return ncclInProgress;
    while (!c->everyone_joined()) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    return ncclSuccess;
  }
  static ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
    auto c = registry::get().comm(comm);
    if (!c) return ncclInvalidArgument;
    if (c->async_error.load() != ncclSuccess) {
      *state = static_cast<ncclResult_t>(c->async_error.load());
    } else {
      *state = c->everyone_joined() ? ncclSuccess : ncclInProgress;
    }
    return ncclSuccess;
  }
  static ncclResult_t ncclCommAbort(ncclComm_t comm) {
    std::shared_ptr<comm_state> c;
    {
      std::lock_guard lock(registry::get().mutex);
      auto it = registry::get().comms.find(comm);
      if (it == registry::get().comms.end()) return ncclInvalidArgument;
      c = std::move(it->second);
      registry::get().comms.erase(it);
    }
    c->aborted = true;
    return ncclSuccess;
  }
  static ncclResult_t ncclCommFinalize(ncclComm_t comm) {
    return registry::get().comm(comm) ? ncclSuccess : ncclInvalidArgument;
  }
  static ncclResult_t ncclCommDestroy(ncclComm_t comm) { return ncclCommAbort(comm); }
  static ncclResult_t ncclCommSplit(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*) {
    return ncclInvalidUsage;  // not faked: the tests use topology::flat
  }
  static ncclResult_t ncclCommUserRank(ncclComm_t comm, int* rank) {
    auto c = registry::get().comm(comm);
    if (!c) return ncclInvalidArgument;
    *rank = c->rank;
    return ncclSuccess;
  }
  static ncclResult_t ncclCommCount(ncclComm_t comm, int* count) {
    auto c = registry::get().comm(comm);
    if (!c) return ncclInvalidArgument;
    *count = c->size;
    return ncclSuccess;
  }
  static ncclResult_t ncclGroupStart() { return ncclSuccess; }
  static ncclResult_t ncclGroupEnd() { return ncclSuccess; }

  enum class kind { allreduce, broadcast, allgather, reduce_scatter };
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

 private:
  // The enqueue as NCCL's: blocks the caller while the launch queue is full
  // (until it drains or the communicator is aborted), then puts the
  // collective on the stream.
  static ncclResult_t enqueue(kind k, const void* in, void* out, std::size_t count,
                              ncclDataType_t type, ncclRedOp_t op, int root, ncclComm_t comm,
                              cudaStream_t stream) {
    auto c = registry::get().comm(comm);
    auto s = registry::get().stream(stream);
    if (!c || !s) return ncclInvalidArgument;
    if (!c->everyone_joined()) return ncclInvalidUsage;
    const int queue = env_int("FAKE_NCCL_LAUNCH_QUEUE", 0);
    while (queue > 0 && s->pending() >= static_cast<std::uint64_t>(queue)) {
      if (c->aborted) return ncclSystemError;  // the abort ends a blocked enqueue
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (c->aborted) return ncclSystemError;
    const std::uint64_t seq = ++c->issued;
    const std::size_t width = type_size(type);
    const std::size_t in_bytes =
        (k == kind::reduce_scatter ? count * static_cast<std::size_t>(c->size) : count) * width;
    const int error_at = env_int("FAKE_NCCL_ASYNC_ERROR_AT", 0);
    s->enqueue({}, [=] {
      if (c->aborted) return;
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
      }
    });
    return ncclSuccess;
  }
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
  using memory_space = dtrain::host_memory;  // the tests move buffers themselves; no DDP
  static constexpr bool uses_gpus = true;
  static constexpr bool needs_store = true;
  template <class Store>
  static communicator make(const communicator_setup<Store>& s) {
    return communicator(*s.store, s.rank, s.size, s.device,
                        dtrain::nccl_options{.collectives = s.collectives}.with_env(*s.env));
  }
};
