// bench/sharding: what ddp_options::sharding (ZeRO stages 1, 2 and 3) saves
// and costs against DDP (issues 34 and 48). Its own per-node launcher with Gloo workers
// (4 by default; DTRAIN_NPROC_PER_NODE=N for N):
//
//   build/bench/sharding [--layers 32] [--floats 65536] [--compute-us 500]
//                        [--steps 8] [--rounds 5] [--budget-mib 256]
//
// The model: L layers of P float32 each, trained with Adam (fp32: two moments
// per element) written against DistributedDataParallel::shard(). Groups of 1,
// 2 and 4 ranks (and 8 with DTRAIN_NPROC_PER_NODE=8) are splits of the
// workers' communicator (the ranks outside a group wait), so every figure of
// a table comes from the same run.
//
// Table 1, memory per rank: the parameters (the model's), DDP's own memory
// held between steps (DistributedDataParallel::memory_use().held(): the
// gradient buckets, padding included, and the shards; at stage 2 the buckets'
// pages are given back after each reduce-scatter and allgather, so they are
// not held; at stage 3 the rank's shard of the values, the model holding
// none: it is built without values, and each rank writes its shard's
// initial values through shard()) and the optimizer state, in bytes, for sharding none, optimizer
// (stage 1), gradients (stage 2) and parameters (stage 3), at 1, 2, 4 (and 8)
// ranks; beside them,
// what the run really took: the growth of the process's peak resident memory
// (VmHWM) while the model was built and trained 2 steps. Goal: stage 2's
// optimizer state at most DDP's / N plus the padding.
//
// Table 2, step time (2 ranks and more): a step is each layer's forward (half
// of `--compute-us` of sleep: a GPU computing while the CPU is free), each
// layer's backward (`--compute-us`), marking it ready, synchronize(), then
// Adam on the rank's shard and (stages 1 and 2) the allgather of the updated
// values; at stage 3 each layer is gathered (an allgather of its values)
// around its forward and its backward, the next layer's allgather prefetched
// (ddp_options::prefetch_units = 1), and once more with prefetch off. Rounds
// interleave the five; the median of the slowest rank's mean step. ratio =
// step / DDP's; goal at stage 3 (with prefetch) at most 1.1.
//
// Table 4, bytes into a rank per step at stage 3 (its allgathers counted by
// gather_counts(), its reduce-scatter as a ring moves it) against DDP's
// allreduce: ZeRO-3 moves 1.5x.
//
// Table 3, the largest model within --budget-mib per rank (the largest
// group): from the measured bytes per parameter of table 1 (peak resident
// growth), the most parameters that fit for DDP, stage 2 and stage 3 (ZeRO's
// bounds for Adam in fp32 printed beside: 16 / (4 + 12/N) and N); each is then
// built and trained 2 steps and rescaled by the peak it took, three times,
// and the last size and its peak resident growth are printed beside the
// budget.

#include <dtrain/dtrain.hpp>

#include "flags.hpp"
#include "layered.hpp"

#include <malloc.h>
#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace {

using Policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>;
using clock_type = std::chrono::steady_clock;
using dtrain::sharding;

struct settings {
  std::size_t layers = 32;
  std::size_t floats = 65536;  // per layer: 256 KiB, a bucket each
  double compute_us = 500;
  int steps = 8;
  int rounds = 5;
  std::size_t budget_mib = 256;
};

const dtrain_bench::flag_reader flags{"dtrain_bench_sharding"};

settings parse(int argc, char** argv) {
  settings s;
  flags.each(argc, argv,
             "usage: dtrain_bench_sharding [--layers 32] [--floats 65536] [--compute-us 500] "
             "[--steps 8] [--rounds 5] [--budget-mib 256]",
             [&](std::string_view flag, std::string_view value) {
               if (flag == "--layers") {
                 s.layers = flags.positive<std::size_t>(flag, value);
                 return true;
               }
               if (flag == "--floats") {
                 s.floats = flags.positive<std::size_t>(flag, value);
                 return true;
               }
               if (flag == "--compute-us") {
                 s.compute_us = flags.positive<double>(flag, value);
                 return true;
               }
               if (flag == "--steps") {
                 s.steps = flags.positive<int>(flag, value);
                 return true;
               }
               if (flag == "--rounds") {
                 s.rounds = flags.positive<int>(flag, value);
                 return true;
               }
               if (flag == "--budget-mib") {
                 s.budget_mib = flags.positive<std::size_t>(flag, value);
                 return true;
               }
               return false;
             });
  return s;
}

using dtrain_bench::adam;
using dtrain_bench::layered_model;

using ddp_type = dtrain::basic_ddp<Policy>;

struct memory_row {
  std::size_t parameters = 0, ddp = 0, optimizer = 0;
  std::size_t peak = 0;  ///< measured: peak resident growth over the run (0: not measured)
  [[nodiscard]] std::size_t total() const { return parameters + ddp + optimizer; }
};

using dtrain_bench::peak_resident;
using dtrain_bench::reset_peak_resident;

/// One DDP of `mode` over `comm` on a model of layers x floats; `steps` steps;
/// returns the mean step time and the memory.
struct run_result {
  double step_seconds = 0;
  memory_row memory;
};

run_result train(dtrain::gloo_communicator& comm, sharding mode, std::size_t layers,
                 std::size_t floats, double compute_us, int steps, std::size_t prefetch = 1,
                 dtrain::gather_counts* counts = nullptr) {
  const bool measured = reset_peak_resident();
  const std::size_t before = peak_resident();
  const bool stage3 = mode == sharding::parameters;
  layered_model<float> model(layers, floats, stage3);
  ddp_type ddp(comm, model.parameters(), {},
               {.bucket_cap_mb = static_cast<double>(floats * sizeof(float)) / (1 << 20),
                .first_bucket_cap_mb = static_cast<double>(floats * sizeof(float)) / (1 << 20),
                .sharding = mode,
                .prefetch_units = prefetch});
  if (stage3) {
    // The initial values, written into this rank's shard (deferred).
    for (const dtrain::shard_piece& p : ddp.shard())
      std::fill_n(static_cast<float*>(p.values.data), p.values.count, 0.5f);
  }
  adam<float> opt(ddp.shard_elements());
  auto step = [&] {
    // The forward pass (half a layer's backward each): at stage 3 each
    // layer's values are whole while it computes (gather() does nothing below).
    for (std::size_t l = 0; l < layers; ++l) {
      const auto held = ddp.gather({l});
      std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(compute_us / 2));
    }
    for (std::size_t l = layers; l-- > 0;) {
      const auto held = ddp.gather({l});  // nothing below stage 3
      std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(compute_us));
      std::fill_n(model.grads[l], floats, 1e-3f * static_cast<float>(l + 1));
      ddp.mark_ready(l);
    }
    ddp.synchronize();
    ++opt.t;
    ddp.optimizer_step([&](const dtrain::shard_piece& p) { opt.update(p); });
  };
  step();  // the first step touches the optimizer state and the buckets
  comm.barrier().wait();
  const dtrain::gather_counts first = ddp.gather_counts();
  const auto start = clock_type::now();
  for (int s = 0; s < steps; ++s) step();
  run_result out;
  if (counts) {
    *counts = ddp.gather_counts();  // the timed steps' only
    counts->on_demand -= first.on_demand;
    counts->prefetched -= first.prefetched;
    counts->unused -= first.unused;
    counts->bytes -= first.bytes;
  }
  out.step_seconds = std::chrono::duration<double>(clock_type::now() - start).count() / steps;
  out.memory = {model.bytes(), ddp.memory_use().held(), opt.bytes(),
                measured ? peak_resident() - before : 0};
  return out;
}

using dtrain_bench::median;

const char* name_of(sharding mode) {
  return mode == sharding::none        ? "DDP (none)"
         : mode == sharding::optimizer ? "stage 1 (optimizer)"
         : mode == sharding::gradients ? "stage 2 (gradients)"
                                       : "stage 3 (parameters)";
}

int bench(dtrain::context<Policy>& ctx, const settings& s) {
  const bool main = ctx.is_main();
  constexpr std::array modes{sharding::none, sharding::optimizer, sharding::gradients,
                             sharding::parameters};
  std::vector<int> sizes;
  for (int n : {1, 2, 4, 8}) {
    if (n <= ctx.size()) sizes.push_back(n);
  }
  // Groups of the first n ranks; the others get an invalid communicator.
  std::vector<dtrain::gloo_communicator> groups;
  for (int n : sizes)
    groups.push_back(ctx.communicator().split(ctx.rank() < n ? 0 : -1, ctx.rank()));

  // Table 1.
  std::vector<std::array<memory_row, modes.size()>> memory(sizes.size());
  for (std::size_t g = 0; g < sizes.size(); ++g) {
    for (std::size_t m = 0; m < modes.size(); ++m) {
      if (groups[g].valid())
        memory[g][m] = train(groups[g], modes[m], s.layers, s.floats, s.compute_us, 1).memory;
      ctx.barrier();
    }
  }
  const double mib = 1 << 20;
  if (main) {
    std::printf(
        "%zu layers x %zu float32 (%.1f MiB of parameters), Adam (fp32), Gloo; rank 0's "
        "bytes:\n\n",
        s.layers, s.floats, static_cast<double>(s.layers * s.floats * 4) / mib);
    std::printf(
        "| ranks | sharding | parameters | DDP's buckets + shards (held) | optimizer state | "
        "total | measured: peak resident growth | optimizer state / DDP's | peak / DDP's |\n"
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for (std::size_t g = 0; g < sizes.size(); ++g) {
      for (std::size_t m = 0; m < modes.size(); ++m) {
        const memory_row& r = memory[g][m];
        std::printf("| %d | %s | %zu | %zu | %zu | %zu | %zu | %.3f | %.3f |\n", sizes[g],
                    name_of(modes[m]), r.parameters, r.ddp, r.optimizer, r.total(), r.peak,
                    static_cast<double>(r.optimizer) / static_cast<double>(memory[g][0].optimizer),
                    static_cast<double>(r.peak) / static_cast<double>(memory[g][0].peak));
      }
    }
    std::fflush(stdout);
  }

  // Table 2: the four modes, and stage 3 without prefetch.
  struct variant {
    sharding mode;
    std::size_t prefetch;
    [[nodiscard]] const char* name() const {
      return prefetch == 0 ? "stage 3, prefetch off" : name_of(mode);
    }
  };
  constexpr std::array variants{variant{sharding::none, 1}, variant{sharding::optimizer, 1},
                                variant{sharding::gradients, 1}, variant{sharding::parameters, 1},
                                variant{sharding::parameters, 0}};
  if (main) {
    std::printf(
        "\nStep time (%zu layers, %.0f us of backward each, sleep), median of %d rounds "
        "of %d steps, the slowest rank:\n\n| ranks | sharding | step | ratio to DDP |\n"
        "| ---: | --- | ---: | ---: |\n",
        s.layers, s.compute_us, s.rounds, s.steps);
  }
  std::vector<std::string> traffic;  // table 4's rows
  for (std::size_t g = 0; g < sizes.size(); ++g) {
    if (sizes[g] < 2) continue;
    std::array<std::vector<double>, variants.size()> times;
    dtrain::gather_counts stage3_counts;
    for (int round = 0; round < s.rounds; ++round) {
      for (std::size_t k = 0; k < variants.size(); ++k) {
        const std::size_t m = (k + static_cast<std::size_t>(round)) % variants.size();
        std::array<double, 1> t{0};
        if (groups[g].valid()) {
          t[0] = train(groups[g], variants[m].mode, s.layers, s.floats, s.compute_us, s.steps,
                       variants[m].prefetch, m == 3 ? &stage3_counts : nullptr)
                     .step_seconds;
        }
        dtrain::allreduce(ctx.communicator(), t, dtrain::reduce_op::max).wait();
        times[m].push_back(t[0]);
      }
    }
    if (main) {
      const double base = median(times[0]);
      for (std::size_t m = 0; m < variants.size(); ++m) {
        std::printf("| %d | %s | %.2f ms | %.3f |\n", sizes[g], variants[m].name(),
                    1e3 * median(times[m]), median(times[m]) / base);
      }
      std::fflush(stdout);
      // Bytes into rank 0 per step: stage 3's allgathers as gather_counts()
      // counted them, its reduce-scatter and DDP's allreduce as a ring moves
      // them ((n-1)/n of the gradients, and twice that).
      const double n = sizes[g];
      const double grads = static_cast<double>(s.layers * s.floats * sizeof(float));
      const double gathered = static_cast<double>(stage3_counts.bytes) / s.steps;
      const double scattered = grads * (n - 1) / n, allreduce = 2 * grads * (n - 1) / n;
      char row[256];
      std::snprintf(row, sizeof row, "| %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", sizes[g],
                    allreduce / mib, gathered / mib, scattered / mib, (gathered + scattered) / mib,
                    (gathered + scattered) / allreduce,
                    static_cast<double>(stage3_counts.prefetched) /
                        static_cast<double>(stage3_counts.prefetched + stage3_counts.on_demand));
      traffic.emplace_back(row);
    }
  }
  if (main && !traffic.empty()) {
    std::printf(
        "\nBytes into a rank per step, MiB (stage 3: its allgathers as gather_counts() "
        "counted them in the timed steps; the reduce-scatter and DDP's allreduce as a ring "
        "moves them):\n\n| ranks | DDP allreduce | stage 3 allgathers | stage 3 "
        "reduce-scatter | stage 3 total | stage 3 / DDP | allgathers prefetched |\n"
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for (const std::string& row : traffic) std::printf("%s", row.c_str());
    std::printf("ZeRO-3 moves 1.5x an allreduce (two allgathers and a reduce-scatter)\n");
    std::fflush(stdout);
  }

  // Table 3: the largest model within the budget, on the largest group.
  const std::size_t g = sizes.size() - 1;
  const double elements = static_cast<double>(s.layers * s.floats);
  const auto budget = static_cast<double>(s.budget_mib) * mib;
  // DDP, stage 2 and stage 3: their modes and rows of table 1.
  constexpr std::array<sharding, 3> largest{sharding::none, sharding::gradients,
                                            sharding::parameters};
  constexpr std::array<std::size_t, 3> row{0, 2, 3};
  std::array<std::size_t, 3> fits{};  // floats per layer
  // Bytes per parameter as measured (peak resident growth); as counted where
  // the peak could not be measured.
  auto per_element = [&](const memory_row& r) {
    return static_cast<double>(r.peak > 0 ? r.peak : r.total()) / elements;
  };
  for (std::size_t k = 0; k < largest.size(); ++k) {
    // Every rank the same model: the most bytes per parameter any rank took.
    std::array<double, 1> most{groups[g].valid() ? per_element(memory[g][row[k]]) : 0.0};
    dtrain::allreduce(ctx.communicator(), most, dtrain::reduce_op::max).wait();
    fits[k] = static_cast<std::size_t>(budget / most[0] / static_cast<double>(s.layers));
  }
  // Measured, a model's bytes per parameter depend a little on its size (the
  // buckets in flight, the allocator): each size is trained and rescaled to
  // the budget by what it took, three times, and the last is reported.
  std::array<std::size_t, 3> grown{};
  for (std::size_t k = 0; k < largest.size(); ++k) {
    for (int attempt = 0; attempt < 3; ++attempt) {
      std::array<double, 1> growth{0};
      if (groups[g].valid()) {
        const run_result r = train(groups[g], largest[k], s.layers, fits[k], s.compute_us, 1);
        growth[0] = r.memory.peak > 0 ? static_cast<double>(r.memory.peak) : -1;
      }
      dtrain::allreduce(ctx.communicator(), growth, dtrain::reduce_op::max).wait();
      if (growth[0] <= 0) {
        grown[k] = static_cast<std::size_t>(-1);
        break;
      }
      grown[k] = static_cast<std::size_t>(growth[0]);
      if (attempt < 2) {
        fits[k] = static_cast<std::size_t>(static_cast<double>(fits[k]) * budget / growth[0]);
      }
    }
  }
  if (main) {
    std::printf(
        "\nThe largest model within %zu MiB per rank, %d ranks, Adam (fp32):\n\n"
        "| sharding | parameters | bytes per parameter (measured) | peak resident growth, "
        "trained 2 steps |\n| --- | ---: | ---: | ---: |\n",
        s.budget_mib, sizes[g]);
    for (std::size_t k = 0; k < largest.size(); ++k) {
      const std::string growth = grown[k] == static_cast<std::size_t>(-1)
                                     ? std::string("n/a (no /proc/self/clear_refs)")
                                     : std::to_string(grown[k] >> 20) + " MiB";
      std::printf("| %s | %zu | %.2f | %s |\n", name_of(largest[k]), fits[k] * s.layers,
                  grown[k] == static_cast<std::size_t>(-1)
                      ? 0.0
                      : static_cast<double>(grown[k]) / static_cast<double>(fits[k] * s.layers),
                  growth.c_str());
    }
    // ZeRO's bound with Adam in fp32: 16 bytes a parameter under DDP, 4 + 12/N
    // at stage 2, 16/N at stage 3 (plus the buckets in flight and gathered).
    const auto n = static_cast<double>(sizes[g]);
    std::printf("\nratio (stage 2 / DDP): %.2f (ZeRO's bound %.2f)\n",
                static_cast<double>(fits[1]) / static_cast<double>(fits[0]), 16 / (4 + 12 / n));
    std::printf("ratio (stage 3 / DDP): %.2f (ZeRO's bound %.2f)\n",
                static_cast<double>(fits[2]) / static_cast<double>(fits[0]), n);
    std::fflush(stdout);
  }
  ctx.barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Large blocks from their own mappings, returned at free: a run's peak
  // resident memory is its own, not what an earlier run left in the heap.
  mallopt(M_MMAP_THRESHOLD, 64 * 1024);
  mallopt(M_TRIM_THRESHOLD, 64 * 1024);
  const settings s = parse(argc, argv);
  dtrain::run_options options;
  options.agent.nproc_per_node = 4;
  return dtrain::run<Policy>(
      argc, argv, [&](dtrain::context<Policy>& ctx) { return bench(ctx, s); }, options);
}
