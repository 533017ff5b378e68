// bench/allreduce_nccl: dtrain's NCCL allreduce against the raw ncclAllReduce,
// on one GPU (world size 1: one GPU cannot host two NCCL ranks), float32 sum
// in place, from 4 KiB to 1 GiB (--max-mib to stop earlier).
//
//   build/bench/allreduce_nccl [--max-mib M] [--reps R]
//
// Both run on the same GPU in the same process, their rounds interleaved.
// raw: ncclAllReduce on the caller's stream, N calls between two CUDA events.
// dtrain: nccl_communicator::allreduce(..., stream) N times, then the caller's
// stream waits for them (stream_wait), between the same events: what dtrain
// adds is the ordering (an event recorded on the caller's stream, waited on by
// its own), the work handle and its completion event. Each figure is the
// median over R rounds of the time per call. algbw = bytes / time; busbw =
// algbw x 2(n-1)/n, NCCL's bus bandwidth for allreduce, which is 0 at n = 1
// (nothing crosses a link): at world size 1 the table measures dtrain's
// per-call overhead, not the interconnect. Without a GPU: "SKIPPED: no CUDA
// device", exit 77.

#include <dtrain/dtrain.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#if DTRAIN_HAS_NCCL()
#include <cuda_runtime.h>
#include <nccl.h>

namespace {

using namespace std::chrono_literals;

#define BENCH_NCCL_CHECK(call)                                                          \
  do {                                                                                  \
    const ncclResult_t bench_nccl_status_ = (call);                                     \
    if (bench_nccl_status_ != ncclSuccess) {                                            \
      throw dtrain::backend_error(                                                      \
          std::string("`" #call "` failed: ") + ncclGetErrorString(bench_nccl_status_), \
          static_cast<int>(bench_nccl_status_));                                        \
    }                                                                                   \
  } while (false)

double median(std::vector<double> v) {
  std::ranges::sort(v);
  return v[v.size() / 2];
}

// Seconds per call of `calls` calls of `body` on `stream`, by CUDA events.
template <class Body>
double per_call(cudaStream_t stream, int calls, Body&& body) {
  cudaEvent_t begin = nullptr, end = nullptr;
  DTRAIN_CUDA_CHECK(cudaEventCreate(&begin));
  DTRAIN_CUDA_CHECK(cudaEventCreate(&end));
  DTRAIN_CUDA_CHECK(cudaEventRecord(begin, stream));
  for (int i = 0; i < calls; ++i) body();
  DTRAIN_CUDA_CHECK(cudaEventRecord(end, stream));
  DTRAIN_CUDA_CHECK(cudaEventSynchronize(end));
  float ms = 0;
  DTRAIN_CUDA_CHECK(cudaEventElapsedTime(&ms, begin, end));
  DTRAIN_CUDA_CHECK(cudaEventDestroy(begin));
  DTRAIN_CUDA_CHECK(cudaEventDestroy(end));
  return static_cast<double>(ms) * 1e-3 / calls;
}

std::string size_text(std::size_t bytes) {
  if (bytes >= (std::size_t{1} << 30)) return std::to_string(bytes >> 30) + " GiB";
  if (bytes >= (std::size_t{1} << 20)) return std::to_string(bytes >> 20) + " MiB";
  return std::to_string(bytes >> 10) + " KiB";
}

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "allreduce_nccl: %s\nusage: allreduce_nccl [--max-mib M] [--reps R]\n",
               why.c_str());
  std::exit(2);
}

int bench(std::size_t max_bytes, int reps) {
  int devices = 0;
  const cudaError_t found = cudaGetDeviceCount(&devices);
  if (found != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (%s)\n",
                found != cudaSuccess ? cudaGetErrorString(found) : "cudaGetDeviceCount found 0");
    return 77;
  }
  DTRAIN_CUDA_CHECK(cudaSetDevice(0));
  constexpr int n = 1;  // ranks

  // Raw NCCL: one rank, its own communicator.
  ncclUniqueId id;
  BENCH_NCCL_CHECK(ncclGetUniqueId(&id));
  ncclComm_t raw = nullptr;
  BENCH_NCCL_CHECK(ncclCommInitRank(&raw, n, id, 0));

  // dtrain: the same, through a store on loopback.
  using store_type = dtrain::prefix_store<dtrain::store_client>;
  dtrain::store_server server("127.0.0.1", 0, {.timeout = 60s, .log = [](std::string_view) {}});
  dtrain::store_client client("127.0.0.1", server.port(), {.timeout = 60s});
  store_type store(client, "allreduce-nccl");
  dtrain::nccl_communicator comm(store, 0, n, 0, {});

  cudaStream_t stream = nullptr;
  DTRAIN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  float* data = nullptr;
  DTRAIN_CUDA_CHECK(cudaMalloc(&data, max_bytes));
  DTRAIN_CUDA_CHECK(cudaMemset(data, 0, max_bytes));

  cudaDeviceProp prop{};
  DTRAIN_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  int nccl_version = 0;
  BENCH_NCCL_CHECK(ncclGetVersion(&nccl_version));
  std::printf("allreduce float32 sum in place, %d rank(s) on %s, NCCL %d; median of %d rounds\n", n,
              prop.name, nccl_version, reps);
  std::printf("%10s %12s %12s %8s %12s %12s %12s\n", "size", "raw us", "dtrain us", "ratio",
              "algbw GB/s", "busbw GB/s", "dtrain algbw");
  double worst_ratio = 0;
  for (std::size_t bytes = std::size_t{4} << 10; bytes <= max_bytes; bytes *= 4) {
    const std::size_t count = bytes / sizeof(float);
    const int calls = static_cast<int>(
        std::clamp<std::size_t>((std::size_t{4} << 30) / bytes, std::size_t{5}, std::size_t{200}));
    auto raw_call = [&] {
      BENCH_NCCL_CHECK(ncclAllReduce(data, data, count, ncclFloat32, ncclSum, raw, stream));
    };
    const dtrain::buffer b{data, count, dtrain::dtype::float32, dtrain::memory::device, 0};
    std::vector<dtrain::work> works;
    works.reserve(static_cast<std::size_t>(calls));
    auto dtrain_call = [&] {
      works.push_back(comm.allreduce(b, b, dtrain::reduce_op::sum, stream));
    };
    auto dtrain_calls = [&] {
      for (int i = 0; i < calls; ++i) dtrain_call();
      comm.stream_wait(stream);
    };
    // Warm-up, then interleaved rounds.
    (void)per_call(stream, 2, raw_call);
    (void)per_call(stream, 1, [&] {
      dtrain_call();
      comm.stream_wait(stream);
    });
    for (auto& w : works) w.wait(60s);
    works.clear();
    std::vector<double> t_raw, t_dtrain;
    for (int r = 0; r < reps; ++r) {
      t_raw.push_back(per_call(stream, calls, raw_call));
      t_dtrain.push_back(per_call(stream, 1, dtrain_calls) / calls);
      for (auto& w : works) w.wait(60s);
      works.clear();
    }
    const double raw_s = median(t_raw), dtrain_s = median(t_dtrain);
    const double algbw = static_cast<double>(bytes) / raw_s / 1e9;
    const double busbw = algbw * 2.0 * (n - 1) / n;
    const double ratio = dtrain_s / raw_s;
    worst_ratio = std::max(worst_ratio, ratio);
    std::printf("%10s %12.2f %12.2f %8.2f %12.2f %12.2f %12.2f\n", size_text(bytes).c_str(),
                raw_s * 1e6, dtrain_s * 1e6, ratio, algbw, busbw,
                static_cast<double>(bytes) / dtrain_s / 1e9);
    std::fflush(stdout);
  }
  std::printf("dtrain / raw: at most %.2fx over the sizes (1.00 = no overhead)\n", worst_ratio);
  DTRAIN_CUDA_CHECK(cudaFree(data));
  DTRAIN_CUDA_CHECK(cudaStreamDestroy(stream));
  BENCH_NCCL_CHECK(ncclCommDestroy(raw));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t max_mib = 1024;
  int reps = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if ((arg == "--max-mib" || arg == "--reps") && i + 1 < argc) {
      char* end = nullptr;
      const long v = std::strtol(argv[++i], &end, 10);
      if (*end != '\0' || v < 1) usage(std::string(arg) + " " + argv[i] + " is not a number >= 1");
      if (arg == "--max-mib") {
        max_mib = static_cast<std::size_t>(v);
      } else {
        reps = static_cast<int>(v);
      }
    } else {
      usage("unknown argument " + std::string(arg));
    }
  }
  try {
    return bench(max_mib << 20, reps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allreduce_nccl: %s\n", e.what());
    return 1;
  }
}

#else

int main() {
  std::printf("SKIPPED: dtrain was built without NCCL (DTRAIN_WITH_NCCL is OFF)\n");
  return 77;
}

#endif
