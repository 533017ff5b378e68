// bench/torch_gpu: what dtrain::torch::DistributedDataParallel adds to a
// LibTorch training step on one GPU. The CNN of dtrain_train_torch
// (examples/torch_cnn.hpp) on cuda:0, world size 1 over NCCL with
// ddp_options::always_reduce (every bucket goes through ncclAllReduce, as
// PyTorch's DDP sends its buckets at world size 1), against the same loop
// without DDP (forward, backward, the optimizer's step).
//
//   build/bench/torch_gpu [--batch-size N] [--channels N] [--hidden N]
//       [--steps N] [--warmup N] [--rounds N] [--bucket-cap-mb MB]
//       [--first-bucket-cap-mb MB] [--threads N] [--layers N] [--sharding 0|1|2|3]
//
// --layers N: instead of the CNN, a torch::nn::Sequential of N
// Linear(--hidden, --hidden) layers with ReLU between and a last
// Linear(--hidden, 4) (the model of a ZeRO-3 / FSDP comparison: each Linear
// a unit). --sharding 1, 2 or 3: dtrain's ZeRO stage instead of DDP (the
// optimizer on shard_parameters(), ddp.step(optimizer)); at stage 3 each
// child of the Sequential is a unit (one unit for the CNN), with the default
// prefetch of one unit and reshard_after_forward.
//
// The loops alternate, in rounds of --steps steps (50) after --warmup steps
// (10) each; a round is timed from a device synchronize to the next, and the
// table shows the median over --rounds rounds (7). overhead = DDP / plain - 1;
// the goal (at most PyTorch's over its own plain loop, on the same GPU) is
// what bench/vs_pytorch_gpu.py measures: it runs this program and the same
// model in PyTorch, and prints both side by side. The last line is for it:
// "figures: plain_us=.. ddp_us=.. parameters=.. buckets=..".
// Defaults: the example's model (--channels 16, --hidden 128, --batch-size 32)
// and DDP's bucket caps (25 MiB, the first 1 MiB: PyTorch's). Timings never
// fail the run. Without a GPU (or a LibTorch without CUDA): "SKIPPED: ..."
// and exit 77.
//
// Built when LibTorch has CUDA and NCCL is found (bench/CMakeLists.txt).
// DTRAIN_BENCH_TORCH_GPU_ON_CPU=1 builds the same loops over Gloo on the CPU
// (a check that the program compiles and runs where LibTorch is CPU-only).

#include "flags.hpp"
#include "torch_bench.hpp"
#include "torch_cnn.hpp"

#include <dtrain/torch.hpp>

#if !DTRAIN_BENCH_TORCH_GPU_ON_CPU
#include <torch/cuda.h>
#endif

#include <chrono>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace {

#if DTRAIN_BENCH_TORCH_GPU_ON_CPU
using Policy = dtrain::policy<dtrain::launch::per_process, dtrain::backend::gloo>;
constexpr bool on_gpu = false;
#else
using Policy = dtrain::policy<dtrain::launch::per_process, dtrain::backend::nccl>;
constexpr bool on_gpu = true;
#endif

struct settings : cnn::loop_settings {
  settings() {
    steps = 50;
    warmup = 10;
    rounds = 7;
  }
  int threads = 1;
  std::int64_t layers = 0;  // 0: the CNN
  int sharding = 0;
};

constexpr const char* usage =
    "usage: torch_gpu [--batch-size N] [--channels N] [--hidden N] [--steps N] [--warmup N]\n"
    "          [--rounds N] [--bucket-cap-mb MB] [--first-bucket-cap-mb MB] [--threads N]\n"
    "          [--layers N] [--sharding 0|1|2|3]\n"
    "  (see the comment at the top of bench/torch_gpu.cpp)\n";

settings parse(int argc, char** argv) {
  const mlp::command_line line("dtrain_bench_torch_gpu", "", "");
  settings s;
  line.each_flag(argc, argv, usage, [&](std::string_view flag, auto& value) {
    if (cnn::read_loop_flag(line, s, flag, value)) return true;
    if (flag == "--threads") {
      s.threads = line.number<int>(flag, value(), 1);
    } else if (flag == "--layers") {
      s.layers = line.number<std::int64_t>(flag, value(), 0);
    } else if (flag == "--sharding") {
      s.sharding = line.number<int>(flag, value(), 0);
      if (s.sharding > 3) {
        line.bad_flag(std::string(flag) + " is 0 (DDP) or a ZeRO stage, 1 to 3, not " +
                      std::to_string(s.sharding));
      }
    } else {
      return false;
    }
    return true;
  });
  return s;
}

void wait_for_device() {
#if !DTRAIN_BENCH_TORCH_GPU_ON_CPU
  torch::cuda::synchronize();
#endif
}

// The --layers model: a Sequential of Linear(hidden, hidden) with ReLU
// between, then Linear(hidden, classes).
torch::nn::Sequential make_mlp(const settings& s) {
  torch::nn::Sequential mlp;
  for (std::int64_t l = 0; l < s.layers; ++l) {
    mlp->push_back(torch::nn::Linear(s.hidden, s.hidden));
    mlp->push_back(torch::nn::ReLU());
  }
  mlp->push_back(torch::nn::Linear(s.hidden, cnn::classes));
  return mlp;
}

// Times the wrapped `model` against `plain` (the same model, unwrapped) on
// the batches xs/ys (8 of them, batch_size each).
template <class Module>
int measure_model(dtrain::context<Policy>& ctx, const settings& s, Module model, Module plain,
                  const torch::Tensor& xs, const torch::Tensor& ys, const std::string& what) {
  const auto stage = static_cast<dtrain::sharding>(s.sharding);
  const bool sharded = stage != dtrain::sharding::none;
  auto ddp = dtrain::torch::DistributedDataParallel(ctx, model,
                                                    {.bucket_cap_mb = s.bucket_cap_mb,
                                                     .first_bucket_cap_mb = s.first_bucket_cap_mb,
                                                     .always_reduce = true,
                                                     .sharding = stage});
  torch::optim::SGD optimizer(sharded ? ddp.shard_parameters() : model->parameters(),
                              torch::optim::SGDOptions(0.01).momentum(0.9));
  torch::optim::SGD plain_optimizer(plain->parameters(),
                                    torch::optim::SGDOptions(0.01).momentum(0.9));
  std::int64_t at = 0;
  auto batch = [&] {
    at = (at + 1) % 8;
    return std::pair{xs.narrow(0, at * s.batch_size, s.batch_size),
                     ys.narrow(0, at * s.batch_size, s.batch_size)};
  };
  auto ddp_step = [&] {
    const auto [x, y] = batch();
    torch::nn::functional::cross_entropy(ddp(x), y).backward();  // returns with averaged grads
    if (sharded) {
      ddp.step(optimizer);  // the optimizer on the shard, then (stage 2) the allgather
      ddp.zero_grad();
    } else {
      optimizer.step();
      optimizer.zero_grad();
    }
  };
  auto plain_step = [&] {
    const auto [x, y] = batch();
    torch::nn::functional::cross_entropy(plain->forward(x), y).backward();
    plain_optimizer.step();
    plain_optimizer.zero_grad();
  };
  auto round = [&](auto step) {
    wait_for_device();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < s.steps; ++i) step();
    wait_for_device();
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
               .count() /
           s.steps;
  };
  for (int i = 0; i < s.warmup; ++i) {
    ddp_step();
    plain_step();
  }
  std::vector<double> ours, alone;
  for (int r = 0; r < s.rounds; ++r) {
    if (r % 2 == 0) {  // who goes first alternates
      ours.push_back(round(ddp_step));
      alone.push_back(round(plain_step));
    } else {
      alone.push_back(round(plain_step));
      ours.push_back(round(ddp_step));
    }
  }
  std::size_t floats = 0;
  for (const torch::Tensor& p : plain->parameters()) floats += static_cast<std::size_t>(p.numel());
  const double a = dtrain_bench::median(alone), d = dtrain_bench::median(ours);
  const std::string wrapper = sharded ? "ZeRO stage " + std::to_string(s.sharding) : "DDP";
  std::printf(
      "LibTorch %s %s (%zu parameters), batch %lld, on %s, dtrain %s over %s at world size %d "
      "with always_reduce (%zu buckets); step time in us, median of %d rounds of %d steps\n",
      TORCH_VERSION, what.c_str(), floats, static_cast<long long>(s.batch_size),
      on_gpu ? "cuda:0" : "the CPU", wrapper.c_str(), on_gpu ? "NCCL" : "Gloo", ctx.size(),
      ddp.buckets().size(), s.rounds, s.steps);
  if (stage == dtrain::sharding::parameters) {
    const auto counts = ddp.core().gather_counts();
    std::printf("stage 3: gathers %llu on demand, %llu prefetched\n",
                static_cast<unsigned long long>(counts.on_demand),
                static_cast<unsigned long long>(counts.prefetched));
  }
  std::printf("| loop | step (us) | over plain |\n|---|---:|---:|\n");
  std::printf("| plain (no DDP) | %.1f | |\n", a);
  std::printf("| dtrain %s | %.1f | %+.1f%% |\n", wrapper.c_str(), d, 100 * (d / a - 1));
  std::printf("rounds (us): plain");
  for (double v : alone) std::printf(" %.1f", v);
  std::printf("; dtrain %s", wrapper.c_str());
  for (double v : ours) std::printf(" %.1f", v);
  std::printf("\nfigures: plain_us=%.3f ddp_us=%.3f parameters=%zu buckets=%zu\n", a, d, floats,
              ddp.buckets().size());
  std::fflush(stdout);
  return 0;
}

int measure(dtrain::context<Policy>& ctx, const settings& s) {
  torch::set_num_threads(s.threads);
  const torch::Device device = on_gpu ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  const auto n = s.batch_size * 8;
  if (s.layers > 0) {
    torch::manual_seed(2);
    const torch::Tensor xs = torch::randn({n, s.hidden}).to(device);
    const torch::Tensor ys = torch::randint(0, cnn::classes, {n}).to(device);
    // Two models from the same start: one wrapped, one not.
    torch::manual_seed(1);
    torch::nn::Sequential model = make_mlp(s);
    model->to(device);
    torch::manual_seed(1);
    torch::nn::Sequential plain = make_mlp(s);
    plain->to(device);
    const std::string what = "Sequential of " + std::to_string(s.layers) + " Linear(" +
                             std::to_string(s.hidden) + ", " + std::to_string(s.hidden) +
                             ") + ReLU, Linear(" + std::to_string(s.hidden) + ", " +
                             std::to_string(cnn::classes) + ")";
    return measure_model(ctx, s, model, plain, xs, ys, what);
  }
  const cnn::images host = cnn::generate(static_cast<std::size_t>(n), 1);
  const torch::Tensor xs = host.x.to(device), ys = host.y.to(device);
  torch::manual_seed(1);
  cnn::Cnn model(s.channels, s.hidden);
  model->to(device);
  torch::manual_seed(1);
  cnn::Cnn plain(s.channels, s.hidden);
  plain->to(device);
  const std::string what = "CNN (4 conv blocks " + std::to_string(s.channels / 2) + "-" +
                           std::to_string(s.channels) + ", fc " + std::to_string(s.hidden) + "-" +
                           std::to_string(cnn::classes) + ")";
  return measure_model(ctx, s, model, plain, xs, ys, what);
}

}  // namespace

int main(int argc, char** argv) {
  const settings s = parse(argc, argv);
#if !DTRAIN_BENCH_TORCH_GPU_ON_CPU
  if (!torch::cuda::is_available()) {
    std::printf("SKIPPED: no CUDA device (LibTorch %s sees none)\n", TORCH_VERSION);
    return 77;
  }
#endif
  return dtrain::run<Policy>(argc, argv,
                             [&](dtrain::context<Policy>& ctx) { return measure(ctx, s); });
}
