// bench/allreduce_gloo: dtrain's Gloo allreduce against the raw Gloo call on
// the same buffer, same context and same options, in the same run. With every
// rank on one host, dtrain's goes through shared memory (backend/gloo/shm.hpp) and
// the raw one through Gloo's TCP; DTRAIN_GLOO_SHM=0 makes both TCP, for
// dtrain's own overhead on Gloo.
//
//   dtrain_test_launch N build/bench/allreduce_gloo [max_bytes]
//   (or RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set by hand; rank 0
//   hosts the store on MASTER_PORT)
//
// For float32 buffers of 4 B .. 256 MiB (x4 steps), in-place sum. Each round
// times a batch of back-to-back calls of one kind, dtrain::allreduce(...).wait()
// or gloo::allreduce(opts), alternating which goes first; a size's time is the
// median over rounds of the per-call mean, taken on the slowest rank. Prints,
// on rank 0, time per call, algbw = bytes / time and busbw = algbw x 2(n-1)/n
// (nccl-tests' definition) for dtrain, and dtrain / raw as ratio and difference.

#include <dtrain/backend/gloo/gloo.hpp>
#include <dtrain/dtrain.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/config.h>
#include <gloo/math.h>

namespace {

using reduce_fn = void (*)(void*, const void*, const void*, std::size_t);

void raw_barrier(const std::shared_ptr<gloo::Context>& context) {
  gloo::BarrierOptions opts(context);
  gloo::barrier(opts);
}

// The slowest rank's value, through raw Gloo (outside any timed region).
double slowest(const std::shared_ptr<gloo::Context>& context, double mine) {
  double value = mine;
  if (context->size > 1) {
    gloo::AllreduceOptions opts(context);
    opts.setOutput(&value, 1);
    opts.setReduceFunction(static_cast<reduce_fn>(&gloo::max<double>));
    gloo::allreduce(opts);
  }
  return value;
}

double mean_seconds(const std::shared_ptr<gloo::Context>& context, int calls,
                    const std::function<void()>& call) {
  raw_barrier(context);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) call();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / calls;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const auto env = dtrain::environment::from_process();
    const dtrain::world w = dtrain::discover_world(env);
    const int rank = w.rank.value_or(0);
    const int size = w.world_size.value_or(1);
    const std::string host = w.master_addr.value_or("127.0.0.1");
    int port = w.master_port.value_or(0);
    std::unique_ptr<dtrain::store_server> server;
    if (rank == 0) {
      // Every address of this host, as dtrain::run's store: MASTER_ADDR may name
      // this host by a loopback address (Debian maps its own name to 127.0.1.1),
      // which other nodes cannot reach.
      server = std::make_unique<dtrain::store_server>("0.0.0.0", port);
      port = server->port();
    }
    dtrain::store_client store(rank == 0 ? std::string("127.0.0.1") : host, port);
    dtrain::gloo_communicator comm(
        store, rank, size, {.collectives = dtrain::collective_options{}.with_env(env), .env = env});
    const auto context = comm.gloo_context();
    const auto timeout = comm.options().collectives.timeout;
    const std::size_t max_bytes =
        argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (std::size_t{256} << 20);

    if (rank == 0) {
      std::printf("allreduce (sum, float32, in place), %d ranks, Gloo %d.%d.%d TCP (%s)\n", size,
                  GLOO_VERSION_MAJOR, GLOO_VERSION_MINOR, GLOO_VERSION_PATCH,
                  comm.describe().c_str());
      std::printf(
          "time per call: median over rounds of a batch's mean, slowest rank; rounds alternate "
          "which goes first\n");
      std::printf("%10s %6s | %11s %11s | %9s %9s | %8s %9s\n", "bytes", "calls", "dtrain",
                  "raw gloo", "algbw", "busbw", "dtrain/", "dtrain-");
      std::printf("%10s %6s | %11s %11s | %9s %9s | %8s %9s\n", "", "xround", "us", "us", "GB/s",
                  "GB/s", "raw", "raw us");
    }
    // Zeros: a sum that stays finite however many rounds run.
    std::vector<float> data(max_bytes / sizeof(float) + 1, 0.0f);
    for (std::size_t bytes = 4; bytes <= max_bytes; bytes *= 4) {
      const std::size_t count = bytes / sizeof(float);
      std::span<float> buffer(data.data(), count);
      // Short batches (at most 20 calls, about 2 MiB), many rounds: the median
      // then shrugs off a noisy neighbour. Fewer rounds at the largest sizes.
      const int calls =
          static_cast<int>(std::clamp<std::size_t>((std::size_t{2} << 20) / bytes, 1, 20));
      const int rounds = bytes >= (std::size_t{64} << 20) ? 5
                         : bytes > (std::size_t{1} << 20) ? 9
                                                          : 11;

      auto through_dtrain = [&] { dtrain::allreduce(comm, buffer).wait(); };
      auto raw = [&] {
        gloo::AllreduceOptions opts(context);
        opts.setOutput(buffer.data(), buffer.size());
        opts.setReduceFunction(static_cast<reduce_fn>(&gloo::sum<float>));
        opts.setTimeout(timeout);
        gloo::allreduce(opts);
      };
      through_dtrain();  // warm up: connections, allocations, caches
      raw();
      std::vector<double> ours, theirs;
      for (int round = 0; round < rounds; ++round) {
        if (round % 2 == 0) {
          ours.push_back(mean_seconds(context, calls, through_dtrain));
          theirs.push_back(mean_seconds(context, calls, raw));
        } else {
          theirs.push_back(mean_seconds(context, calls, raw));
          ours.push_back(mean_seconds(context, calls, through_dtrain));
        }
      }
      const double t_ours = slowest(context, median(ours));
      const double t_raw = slowest(context, median(theirs));
      if (rank == 0) {
        const double algbw = static_cast<double>(bytes) / t_ours / 1e9;
        const double busbw = algbw * 2.0 * (size - 1) / size;
        std::printf("%10zu %6d | %11.1f %11.1f | %9.3f %9.3f | %8.3f %9.1f\n", bytes, calls,
                    t_ours * 1e6, t_raw * 1e6, algbw, busbw, t_ours / t_raw,
                    (t_ours - t_raw) * 1e6);
        std::fflush(stdout);
      }
    }
    raw_barrier(context);  // rank 0 hosts the store: leave together
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allreduce_gloo: %s\n", e.what());
    return 1;
  }
}
