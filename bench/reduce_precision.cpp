// bench/reduce_precision: what ddp_options::accumulate = float32 buys and
// costs (issue 49), in one run over Gloo workers on this host (16 by default;
// DTRAIN_NPROC_PER_NODE=N for N):
//
//   build/bench/reduce_precision [--elements 262144] [--cost-elements 4194304] [--reps 5]
//
// Numerics: every rank's float32 gradients (a per-element scale spread over
// four decades, a shared signal and a per-rank noise twice its size) are
// averaged by DistributedDataParallel in groups of 2, 4, 8 and 16 ranks
// (splits of the workers' communicator), three ways: float32 as it is, 16-bit
// compression as it was (each gradient divided by n, rounded to bfloat16,
// summed in bfloat16 by the engine) and bfloat16 on the wire with float32
// accumulation. Printed: the relative error of the mean, |mean - exact| /
// |exact| over all elements (the exact mean in double), against one bfloat16
// rounding (2^-8); the goal is that the last does not grow with n.
//
// Cost: a step (mark every parameter, synchronize) of the same float32 model
// sent as bfloat16, at 4 and 8 ranks: compression with 16-bit sums against
// 16-bit wire with float32 accumulation (goal: at most 1.15x), and float32
// as it is; the median of --reps steps, and the bytes each rank sends per
// element by each algorithm (ring allreduce 2(n-1)/n x the element; alltoall
// plus allgather (n-1)/n x 2 bytes each). Gloo reduces through shared memory
// on one host; DTRAIN_GLOO_SHM=0 sends the same over TCP on loopback.

#include <dtrain/dtrain.hpp>

#include "flags.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace {

using Policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>;

struct settings {
  std::size_t elements = std::size_t{1} << 18;       // numerics
  std::size_t cost_elements = std::size_t{1} << 22;  // cost: 16 MiB of float32 gradients
  int reps = 5;
};

const dtrain_bench::flag_reader flags{"dtrain_bench_reduce_precision"};

settings parse(int argc, char** argv) {
  settings s;
  flags.each(argc, argv,
             "usage: dtrain_bench_reduce_precision [--elements 262144] [--cost-elements "
             "4194304] [--reps 5]",
             [&](std::string_view flag, std::string_view value) {
               if (flag == "--elements") {
                 s.elements = flags.positive<std::size_t>(flag, value);
                 return true;
               }
               if (flag == "--cost-elements") {
                 s.cost_elements = flags.positive<std::size_t>(flag, value);
                 return true;
               }
               if (flag == "--reps") {
                 s.reps = flags.positive<int>(flag, value);
                 return true;
               }
               return false;
             });
  return s;
}

/// A uniform number in [0, 1) from (a, b, c).
double unit(std::uint64_t a, std::uint64_t b, std::uint64_t c) {
  std::uint64_t x = (a + 1) * 0x9E3779B97F4A7C15ull ^ (b + 1) * 0xBF58476D1CE4E5B9ull ^
                    (c + 1) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 32;
  return static_cast<double>(x >> 11) / 9007199254740992.0;
}

/// Rank r's gradient of element i: scale_i x (signal_i + 2 noise_ri), the
/// scale log-uniform over [1e-4, 1], signal and noise uniform in [-1, 1].
float gradient(int rank, std::size_t i) {
  const double scale = std::pow(10.0, -4.0 * unit(i, 0, 1));
  const double signal = 2 * unit(i, 0, 2) - 1;
  const double noise = 2 * unit(i, static_cast<std::uint64_t>(rank) + 1, 3) - 1;
  return static_cast<float>(scale * (signal + 2 * noise));
}

/// One float32 parameter of `n` elements, its gradient a pointer DDP repoints.
struct flat_model {
  std::vector<float> values;
  float* held = nullptr;
  float* grad = nullptr;
  explicit flat_model(std::size_t n) : values(n, 0.0f), held(values.data()) {}
  std::vector<dtrain::parameter> parameters() {
    return {dtrain::param("w", held, values.size(), grad)};
  }
};

struct way {
  const char* name;
  dtrain::gradient_compression compression;
  dtrain::accumulation accumulate;
};
constexpr way ways[] = {
    {"float32", dtrain::gradient_compression::none, dtrain::accumulation::wire},
    {"bfloat16 compression (16-bit sums)", dtrain::gradient_compression::bfloat16,
     dtrain::accumulation::wire},
    {"bfloat16 wire, float32 accumulation", dtrain::gradient_compression::bfloat16,
     dtrain::accumulation::float32},
};

dtrain::ddp_options options_of(const way& w, std::size_t n) {
  const double cap = static_cast<double>(n * sizeof(float)) / (1 << 20);
  return {.bucket_cap_mb = cap,
          .first_bucket_cap_mb = cap,
          .broadcast_parameters = false,
          .compression = w.compression,
          .accumulate = w.accumulate};
}

/// The relative error of the mean DDP computes over `comm` (rank 0's).
double mean_error(dtrain::gloo_communicator& comm, const way& w, std::size_t n) {
  flat_model model(n);
  dtrain::basic_ddp<Policy> ddp(comm, model.parameters(), {}, options_of(w, n));
  for (std::size_t i = 0; i < n; ++i) model.grad[i] = gradient(comm.rank(), i);
  ddp.mark_ready(0);
  ddp.synchronize();
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < n; ++i) {
    double exact = 0;
    for (int r = 0; r < comm.size(); ++r) exact += static_cast<double>(gradient(r, i));
    exact /= comm.size();
    const double d = static_cast<double>(model.grad[i]) - exact;
    diff += d * d;
    norm += exact * exact;
  }
  return std::sqrt(diff / norm);
}

/// The median seconds of a step (every rank's gradients set, marked, synchronized).
double step_seconds(dtrain::gloo_communicator& comm, const way& w, std::size_t n, int reps) {
  flat_model model(n);
  dtrain::basic_ddp<Policy> ddp(comm, model.parameters(), {}, options_of(w, n));
  std::vector<double> times;
  for (int rep = 0; rep <= reps; ++rep) {
    for (std::size_t i = 0; i < n; ++i) model.grad[i] = 1e-3f * static_cast<float>(i % 7);
    comm.barrier().wait();
    const auto start = std::chrono::steady_clock::now();
    ddp.mark_ready(0);
    ddp.synchronize();
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    if (rep > 0) times.push_back(took.count());  // the first lays out and warms up
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

/// Bytes each rank sends per element of the bucket, by algorithm.
double wire_bytes(const way& w, int n) {
  const double share = static_cast<double>(n - 1) / n;
  if (w.compression == dtrain::gradient_compression::none) return 2 * share * 4;
  return 2 * share * 2;  // ring of 16-bit elements, or alltoall + allgather of 16-bit parts
}

int bench(dtrain::context<Policy>& ctx, const settings& s) {
  std::vector<int> sizes;
  for (const int n : {2, 4, 8, 16}) {
    if (n <= ctx.size()) sizes.push_back(n);
  }
  std::vector<dtrain::gloo_communicator> groups;
  for (const int n : sizes)
    groups.push_back(ctx.communicator().split(ctx.rank() < n ? 0 : -1, ctx.rank()));
  const bool shm = ctx.environment().get("DTRAIN_GLOO_SHM") != "0";
  if (ctx.is_main()) {
    std::printf(
        "Numerics: %zu float32 gradients per rank (scales over 1e-4..1, noise twice the "
        "signal), averaged by DDP over Gloo (%s); relative error of the mean against the "
        "exact one (double), rank 0:\n\n| ranks | %s | %s | %s | one bfloat16 rounding "
        "|\n| ---: | ---: | ---: | ---: | ---: |\n",
        s.elements, shm ? "shared memory" : "TCP", ways[0].name, ways[1].name, ways[2].name);
  }
  for (std::size_t g = 0; g < sizes.size(); ++g) {
    double error[3] = {0, 0, 0};
    for (int k = 0; k < 3; ++k) {
      if (groups[g].valid()) error[k] = mean_error(groups[g], ways[k], s.elements);
    }
    ctx.barrier();
    if (ctx.is_main()) {
      std::printf("| %d | %.2e | %.2e | %.2e | %.2e |\n", sizes[g], error[0], error[1], error[2],
                  std::ldexp(1.0, -8));
      std::fflush(stdout);
    }
  }
  if (ctx.is_main()) {
    std::printf(
        "\nCost: a step of %zu float32 gradients (%.0f MiB) as one bucket, median of %d "
        "(rank 0); bytes each rank sends per element:\n\n| ranks | way | bytes/element | "
        "step (ms) | vs 16-bit sums |\n| ---: | --- | ---: | ---: | ---: |\n",
        s.cost_elements, static_cast<double>(s.cost_elements * sizeof(float)) / (1 << 20), s.reps);
  }
  for (std::size_t g = 0; g < sizes.size(); ++g) {
    if (sizes[g] != 4 && sizes[g] != 8) continue;
    double seconds[3] = {0, 0, 0};
    for (const int k : {1, 2, 0}) {
      if (groups[g].valid()) seconds[k] = step_seconds(groups[g], ways[k], s.cost_elements, s.reps);
    }
    ctx.barrier();
    if (!ctx.is_main()) continue;
    for (const int k : {0, 1, 2}) {
      std::printf("| %d | %s | %.2f | %.1f | %.2fx |\n", sizes[g], ways[k].name,
                  wire_bytes(ways[k], sizes[g]), seconds[k] * 1e3, seconds[k] / seconds[1]);
    }
    std::fflush(stdout);
  }
  ctx.barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const settings s = parse(argc, argv);
  dtrain::run_options options;
  options.agent.nproc_per_node = 16;
  return dtrain::run<Policy>(
      argc, argv, [&](dtrain::context<Policy>& ctx) { return bench(ctx, s); }, options);
}
