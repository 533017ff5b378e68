// bench/torch_sharding: what ZeRO stage 3 (ddp_options::sharding =
// parameters) saves and costs a LibTorch model (issue 48), against DDP and
// stage 2: a torch::nn::Sequential of --layers Linear(--width, --width)
// layers (with Tanh between), trained with torch::optim::Adam (on the
// module's parameters for DDP, on shard_parameters() for stages 2 and 3),
// batch --batch-size per rank, over Gloo on --ranks workers (4).
//
//   build/bench/torch_sharding [--ranks 4] [--layers 8] [--width 512]
//                              [--batch-size 32] [--steps 10] [--rounds 5]
//
// Each stage runs in a process tree of its own (the program starts itself
// as a node agent with that many workers), so that memory freed by one stage
// is not reused by the next. Per stage, rank 0's row:
// - memory: the growth of the process's peak resident memory (VmHWM) over
//   the steps after the first (the model built, wrapped and stepped once:
//   what training holds), and over construction and all the steps (the
//   model is built whole on every rank first: LibTorch has no deferred
//   initialisation here);
// - DDP's own memory counted by memory_use() (at stage 3 `values`, the
//   rank's shard of the values) and the optimizer state (Adam's moments);
// - step time: the median over --rounds rounds of the slowest rank's mean
//   step (forward, backward, step, zero_grad), and its ratio to DDP's.
// Timings never fail the run.

#include "flags.hpp"
#include "train_program.hpp"

#include <dtrain/torch.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace {

using Policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>;

struct settings {
  int ranks = 4;
  std::int64_t layers = 8;
  std::int64_t width = 512;
  std::int64_t batch_size = 32;
  int steps = 10;
  int rounds = 5;
  int stage = -1;  // internal: the stage this process tree measures
};

constexpr const char* usage =
    "usage: torch_sharding [--ranks N] [--layers N] [--width N] [--batch-size N] [--steps N]\n"
    "          [--rounds N]\n"
    "  (see the comment at the top of bench/torch_sharding.cpp)\n";

settings parse(int argc, char** argv) {
  const mlp::command_line line("dtrain_bench_torch_sharding", "", "");
  settings s;
  line.each_flag(argc, argv, usage, [&](std::string_view flag, auto& value) {
    if (flag == "--ranks") {
      s.ranks = line.number<int>(flag, value(), 1);
    } else if (flag == "--layers") {
      s.layers = line.number<std::int64_t>(flag, value(), 1);
    } else if (flag == "--width") {
      s.width = line.number<std::int64_t>(flag, value(), 1);
    } else if (flag == "--batch-size") {
      s.batch_size = line.number<std::int64_t>(flag, value(), 1);
    } else if (flag == "--steps") {
      s.steps = line.number<int>(flag, value(), 1);
    } else if (flag == "--rounds") {
      s.rounds = line.number<int>(flag, value(), 1);
    } else if (flag == "--stage") {
      s.stage = line.number<int>(flag, value(), 0);
    } else {
      return false;
    }
    return true;
  });
  return s;
}

using dtrain_bench::peak_resident;
using dtrain_bench::reset_peak_resident;

int measure(dtrain::context<Policy>& ctx, const settings& s) {
  torch::set_num_threads(1);
  const auto stage = static_cast<dtrain::sharding>(s.stage);
  const bool measured = reset_peak_resident();
  const std::size_t at_start = peak_resident();
  torch::manual_seed(1);
  torch::nn::Sequential model;
  for (std::int64_t l = 0; l < s.layers; ++l) {
    model->push_back(torch::nn::Linear(s.width, s.width));
    if (l + 1 < s.layers) model->push_back(torch::nn::Tanh());
  }
  auto ddp = dtrain::torch::DistributedDataParallel(ctx, model, {.sharding = stage});
  torch::optim::Adam adam(
      stage == dtrain::sharding::none ? model->parameters() : ddp.shard_parameters(),
      torch::optim::AdamOptions(1e-4));
  const torch::Tensor x = torch::randn({s.batch_size, s.width});
  const torch::Tensor y = torch::randn({s.batch_size, s.width});
  auto step = [&] {
    torch::nn::functional::mse_loss(ddp(x), y).backward();
    if (stage == dtrain::sharding::none) {
      adam.step();
    } else {
      ddp.step(adam);
    }
    ddp.zero_grad();
  };
  step();  // Adam's moments exist from here on
  const std::size_t built = peak_resident();
  const bool training_measured = reset_peak_resident();
  const std::size_t before_training = peak_resident();
  auto& comm = ctx.communicator();
  std::vector<double> means;
  for (int r = 0; r < s.rounds; ++r) {
    ctx.barrier();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < s.steps; ++i) step();
    std::array<double, 1> mean{
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count() /
        s.steps};
    dtrain::allreduce(comm, mean, dtrain::reduce_op::max).wait();
    means.push_back(mean[0]);
  }
  const std::size_t training_peak = peak_resident();
  std::size_t state = 0;
  for (const auto& item : adam.state()) {
    const auto& moments = static_cast<const torch::optim::AdamParamState&>(*item.second);
    state += moments.exp_avg().nbytes() + moments.exp_avg_sq().nbytes();
  }
  const auto use = ddp.core().memory_use();
  if (ctx.is_main()) {
    const std::size_t whole = ddp.core().model_elements() * sizeof(float);
    const std::size_t values = stage == dtrain::sharding::parameters ? use.values : whole;
    auto growth = [](bool ok, std::size_t from, std::size_t to) {
      return ok && to >= from ? std::to_string(to - from) : std::string("n/a");
    };
    std::printf("| %d | %s | %zu | %zu | %zu | %s | %s | %.2f |\n", ctx.size(),
                std::string(dtrain::to_string(stage)).c_str(), values, use.held(), state,
                growth(training_measured, before_training, training_peak).c_str(),
                growth(measured, at_start, std::max(built, training_peak)).c_str(),
                dtrain_bench::median(means));
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const settings s = parse(argc, argv);
  if (s.stage >= 0) {
    dtrain::run_options options;
    options.agent.nproc_per_node = s.ranks;
    return dtrain::run<Policy>(
        argc, argv, [&](dtrain::context<Policy>& ctx) { return measure(ctx, s); }, options);
  }
  const std::int64_t parameters = s.layers * (s.width * s.width + s.width);
  std::printf(
      "LibTorch %s: Sequential of %lld Linear(%lld, %lld) (%lld parameters, %lld bytes), Adam, "
      "batch %lld per rank, %d Gloo ranks; step in ms, median of %d rounds of %d steps\n",
      TORCH_VERSION, static_cast<long long>(s.layers), static_cast<long long>(s.width),
      static_cast<long long>(s.width), static_cast<long long>(parameters),
      static_cast<long long>(parameters * 4), static_cast<long long>(s.batch_size), s.ranks,
      s.rounds, s.steps);
  std::printf(
      "| ranks | sharding | parameters held between steps | DDP's held (memory_use) | "
      "optimizer state | peak resident growth, training | peak resident growth, from "
      "construction | step (ms) |\n"
      "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  std::fflush(stdout);
  int status = 0;
  for (const int stage : {0, 2, 3}) {
    const int rc = dtrain_bench::run_self("dtrain_bench_torch_sharding", argc, argv,
                                          "--stage " + std::to_string(stage));
    if (rc < 0) return 1;
    if (rc != 0) {
      std::fprintf(stderr, "dtrain_bench_torch_sharding: stage %d failed (status %d)\n", stage, rc);
      status = 1;
    }
  }
  return status;
}
