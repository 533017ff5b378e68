// bench/precision: the memory a 16-bit model takes per parameter with
// ddp_options::master_weights (float32 master weights of the rank's shard)
// and Adam, at ZeRO stages 0-3, measured, beside ZeRO's and Megatron's
// published figures (issue 49). Its own per-node launcher with Gloo workers
// (4 by default; DTRAIN_NPROC_PER_NODE=N for N):
//
//   build/bench/precision [--layers 32] [--floats 65536]
//
// The model: L layers of P elements, bfloat16 values and gradients, trained 2
// steps with Adam (two float32 moments per element of the rank's shard)
// against the pieces' float32 master (shard_piece::master); the same model in
// float32 (no master copy: the values are their own) for comparison. Groups
// of 1, 2 and 4 ranks (8 with DTRAIN_NPROC_PER_NODE=8) are splits of the
// workers' communicator, so every row comes from the same run.
//
// Per row, rank 0's bytes per parameter: counted (the model's values, DDP's
// memory held between steps, memory_use().held(), with its master copy, and
// Adam's state) and measured (the growth of the process's peak resident
// memory while the model was built and trained). Beside them ZeRO's mixed
// precision figures (2 bytes of 16-bit parameters + 2 of 16-bit gradients +
// 12 of float32 master and Adam moments: 16 under DDP, 4 + 12/N at stage 1,
// 2 + 14/N at stage 2, 16/N at stage 3) and, for the float32 model, 16, 4 +
// 4 + 8/N, 4 + 12/N, 16/N. Megatron's distributed optimizer keeps float32
// gradients (18 bytes a parameter, 6 + 12/d sharded); dtrain's gradients are
// the model's type (its 16-bit buckets), so the 16-bit rows are ZeRO's.
// Figures only: no goal is checked here.

#include <dtrain/dtrain.hpp>

#include "flags.hpp"
#include "layered.hpp"

#include <malloc.h>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace {

using Policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>;
using dtrain::sharding;

struct settings {
  std::size_t layers = 32;
  std::size_t floats = 65536;  // elements per layer, a bucket each
};

const dtrain_bench::flag_reader flags{"dtrain_bench_precision"};

settings parse(int argc, char** argv) {
  settings s;
  flags.each(argc, argv, "usage: dtrain_bench_precision [--layers 32] [--floats 65536]",
             [&](std::string_view flag, std::string_view value) {
               if (flag == "--layers") {
                 s.layers = flags.positive<std::size_t>(flag, value);
                 return true;
               }
               if (flag == "--floats") {
                 s.floats = flags.positive<std::size_t>(flag, value);
                 return true;
               }
               return false;
             });
  return s;
}

using dtrain_bench::adam;
using dtrain_bench::layered_model;

struct row {
  std::size_t counted = 0;  ///< model values + DDP held (master included) + Adam
  std::size_t master = 0;   ///< memory_use().master
  std::size_t peak = 0;     ///< measured peak resident growth (0: not measured)
};

/// Builds a T model of `mode` (master weights for 16-bit T) over `comm` and
/// trains it 2 steps with Adam; its bytes.
template <class T>
row train(dtrain::gloo_communicator& comm, sharding mode, const settings& s) {
  const bool measured = dtrain_bench::reset_peak_resident();
  const std::size_t before = dtrain_bench::peak_resident();
  const bool stage3 = mode == sharding::parameters;
  layered_model<T> model(s.layers, s.floats, stage3);
  const double cap = static_cast<double>(s.floats * sizeof(T)) / (1 << 20);
  dtrain::basic_ddp<Policy> ddp(comm, model.parameters(), {},
                                {.bucket_cap_mb = cap,
                                 .first_bucket_cap_mb = cap,
                                 .sharding = mode,
                                 .master_weights = !std::is_same_v<T, float>});
  if (stage3) {  // deferred: the initial values into this rank's shard (its master too)
    for (const dtrain::shard_piece& p : ddp.shard()) {
      std::fill_n(static_cast<T*>(p.values.data), p.values.count, T(0.5f));
      if (p.master.data != p.values.data)
        std::fill_n(static_cast<float*>(p.master.data), p.master.count, 0.5f);
    }
  }
  adam<T> opt(ddp.shard_elements());
  for (int step = 0; step < 2; ++step) {
    for (std::size_t l = s.layers; l-- > 0;) {
      const auto held = ddp.gather({l});  // stage 3: the layer's values whole
      std::fill_n(model.grads[l], s.floats, T(1e-3f * static_cast<float>(l + 1)));
      ddp.mark_ready(l);
    }
    ddp.synchronize();
    ++opt.t;
    ddp.optimizer_step([&](const dtrain::shard_piece& p) { opt.update(p); });
  }
  const dtrain::ddp_memory_use use = ddp.memory_use();
  return {model.bytes() + use.held() + opt.bytes(), use.master,
          measured ? dtrain_bench::peak_resident() - before : 0};
}

/// ZeRO's bytes per parameter with Adam: `p` bytes of parameters and of
/// gradients (16-bit: 2 and 2 with a float32 master, K = 12; float32: 4 and
/// 4, K = 8), sharded by stage over n ranks.
double zero_bytes(bool sixteen, sharding mode, double n) {
  const double p = sixteen ? 2 : 4, g = p, k = sixteen ? 12 : 8;
  switch (mode) {
    case sharding::none: return p + g + k;
    case sharding::optimizer: return p + g + k / n;
    case sharding::gradients: return p + (g + k) / n;
    default: return (p + g + k) / n;
  }
}

const char* name_of(sharding mode) {
  return mode == sharding::none        ? "DDP (none)"
         : mode == sharding::optimizer ? "stage 1"
         : mode == sharding::gradients ? "stage 2"
                                       : "stage 3";
}

int bench(dtrain::context<Policy>& ctx, const settings& s) {
  constexpr std::array modes{sharding::none, sharding::optimizer, sharding::gradients,
                             sharding::parameters};
  std::vector<int> sizes;
  for (const int n : {1, 2, 4, 8}) {
    if (n <= ctx.size()) sizes.push_back(n);
  }
  std::vector<dtrain::gloo_communicator> groups;
  for (const int n : sizes)
    groups.push_back(ctx.communicator().split(ctx.rank() < n ? 0 : -1, ctx.rank()));
  const double elements = static_cast<double>(s.layers * s.floats);
  if (ctx.is_main()) {
    std::printf(
        "%zu layers x %zu elements (%.1f M parameters), Adam (float32 moments), Gloo; rank 0's "
        "bytes per parameter (counted: values + DDP's held memory + Adam; measured: peak resident "
        "growth):\n\n| ranks | model | sharding | master copy (bytes) | counted | measured | "
        "ZeRO's figure |\n| ---: | --- | --- | ---: | ---: | ---: | ---: |\n",
        s.layers, s.floats, elements / 1e6);
  }
  for (std::size_t g = 0; g < sizes.size(); ++g) {
    for (const bool sixteen : {true, false}) {
      for (const sharding mode : modes) {
        row r;
        if (groups[g].valid())
          r = sixteen ? train<dtrain::bfloat16>(groups[g], mode, s)
                      : train<float>(groups[g], mode, s);
        ctx.barrier();
        if (!ctx.is_main()) continue;
        const std::string measured =
            r.peak > 0 ? std::to_string(static_cast<double>(r.peak) / elements).substr(0, 5)
                       : std::string("n/a");
        std::printf("| %d | %s | %s | %zu | %.2f | %s | %.2f |\n", sizes[g],
                    sixteen ? "bfloat16, float32 master" : "float32", name_of(mode), r.master,
                    static_cast<double>(r.counted) / elements, measured.c_str(),
                    zero_bytes(sixteen, mode, sizes[g]));
        std::fflush(stdout);
      }
    }
  }
  if (ctx.is_main()) {
    std::printf(
        "\nZeRO (mixed precision, Adam): 16-bit parameters 2 + 16-bit gradients 2 + float32 "
        "master and moments 12 bytes a parameter, sharded by stage. Megatron's distributed "
        "optimizer keeps float32 gradients: 18 bytes, 6 + 12/d sharded over d ranks (dtrain's "
        "gradients are the model's 16-bit type).\n");
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
