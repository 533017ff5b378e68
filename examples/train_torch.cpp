// dtrain_train_torch: data-parallel training of a LibTorch CNN with
// dtrain::torch::DistributedDataParallel, on a synthetic image set that the
// program generates (the same on every rank).
//
//   dtrain_train_torch --nproc-per-node 4 --epochs 5    (the node agent: starts 4 Gloo workers)
//
// Each image is 16x16 with one of 4 patterns (horizontal or vertical stripes,
// a diagonal, a centred square) at a random phase, under noise. Every rank
// trains on its own shard of each epoch (dtrain::torch::distributed_sampler);
// autograd marks each gradient ready as backward() writes it, so the buckets
// are averaged while the rest of backward() runs. Rank 0 prints loss, accuracy
// and throughput per epoch, as dtrain_train_mlp does; at the end every rank
// compares a checksum of its weights with every other rank's.
//
// With --checkpoint-dir DIR it resumes from DIR's newest checkpoint on start
// and, with --checkpoint-every N, saves one every N steps: the module's
// parameters and batch-norm buffers, the optimizer's momentum and the
// sampler's place (dtrain::torch::add_module, add_optimizer, add_sampler).
// With --memory-every N (and --memory-budget X) it also saves them into the
// node agent's memory (the memory tier), from which a restarted worker resumes.
//
// Exit status: 0; 1 when the ranks' weights differ or a rank fails; 2 for a
// bad flag or environment.

#include "torch_cnn.hpp"
#include "train_program.hpp"

#include <dtrain/torch.hpp>

#include <array>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace {

using Policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>;
constexpr std::string_view program = "dtrain_train_torch";
using cnn::classes;
using cnn::side;

struct settings {
  std::size_t epochs = 5;
  std::size_t batch_size = 32;  // per rank
  double lr = 0.02;
  double momentum = 0.9;
  std::size_t samples = 4096;
  std::uint64_t seed = 1;
  std::int64_t channels = 16;  // of the last two convolution blocks; the first two have half
  std::int64_t hidden = 128;   // the fully connected layer
  int nproc_per_node = 4;
  mlp::checkpoint_flags checkpoint;
  dtrain::sharding sharding = dtrain::sharding::none;
  torch::Dtype precision = torch::kFloat;
};

constexpr const char* usage_first =
    "usage: dtrain_train_torch [--nproc-per-node N] [--epochs N] [--batch-size N] [--lr X]\n"
    "          [--momentum X] [--samples N] [--seed N] [--channels N] [--hidden N]\n"
    "          [--checkpoint-dir DIR [--checkpoint-every N]\n"
    "           [--memory-every N [--memory-budget X]]] [--sharding 0|1|2|3]\n"
    "          [--precision fp32|bf16|fp16]\n"
    "  --nproc-per-node N  workers the node agent starts (DTRAIN_NPROC_PER_NODE wins; 4)\n"
    "  --epochs N          passes over the training set (5)\n"
    "  --batch-size N      images per step on each rank (32)\n"
    "  --lr X              SGD learning rate (0.02)\n"
    "  --momentum X        SGD momentum (0.9)\n"
    "  --samples N         training images; a quarter as many again for testing (4096)\n"
    "  --seed N            seeds the images, the weights and the shuffling (1)\n"
    "  --channels N        channels of the last two convolution blocks, N/2 in the first two (16)\n"
    "  --hidden N          width of the fully connected layer (128)\n";
// (then mlp::checkpoint_help, the flags the demo takes too)
constexpr const char* usage_last =
    "  --sharding 0|1|2|3  ZeRO stage: 0 DDP, 1 the optimizer state sharded across the\n"
    "                      ranks, 2 the averaged gradients too, 3 the parameters' values\n"
    "                      too (ddp_options::sharding) (0)\n"
    "  --precision fp32|bf16|fp16  the module's values and gradients: float32, or\n"
    "                      16-bit, averaged with float32 sums and updated through\n"
    "                      float32 master weights (fp16 with a loss scaler) (fp32)\n";

settings parse_flags(int argc, char** argv) {
  const mlp::command_line line(program, "", "");
  settings s;
  const std::string usage = std::string(usage_first) + mlp::checkpoint_help + usage_last;
  line.each_flag(argc, argv, usage, [&](std::string_view flag, auto& value) {
    if (flag == "--nproc-per-node" || flag == "--nproc_per_node") {
      s.nproc_per_node = line.number<int>(flag, value(), 1);
    } else if (flag == "--epochs") {
      s.epochs = line.number<std::size_t>(flag, value(), 1);
    } else if (flag == "--batch-size") {
      s.batch_size = line.number<std::size_t>(flag, value(), 1);
    } else if (flag == "--lr") {
      s.lr = line.number<double>(flag, value(), 0.0);
    } else if (flag == "--momentum") {
      s.momentum = line.number<double>(flag, value(), 0.0);
    } else if (flag == "--samples") {
      s.samples = line.number<std::size_t>(flag, value(), 4);
    } else if (flag == "--seed") {
      s.seed = line.number<std::uint64_t>(flag, value(), 0);
    } else if (flag == "--channels") {
      s.channels = line.number<std::int64_t>(flag, value(), 2);
    } else if (flag == "--hidden") {
      s.hidden = line.number<std::int64_t>(flag, value(), 1);
    } else if (s.checkpoint.take(line, flag, value)) {
      return true;
    } else if (flag == "--precision") {
      const std::string_view name = value();
      if (name == "fp32") {
        s.precision = torch::kFloat;
      } else if (name == "bf16") {
        s.precision = torch::kBFloat16;
      } else if (name == "fp16") {
        s.precision = torch::kHalf;
      } else {
        line.bad_flag("--precision " + std::string(name) + ": fp32, bf16 or fp16");
      }
    } else if (flag == "--sharding") {
      const std::string_view stage = value();
      if (stage != "0" && stage != "1" && stage != "2" && stage != "3")
        line.bad_flag("--sharding " + std::string(stage) + ": 0 (DDP), 1, 2 or 3 (ZeRO's stages)");
      s.sharding = static_cast<dtrain::sharding>(stage[0] - '0');
    } else {
      return false;
    }
    return true;
  });
  if (s.momentum >= 1.0)
    line.bad_flag("--momentum " + std::to_string(s.momentum) + ": must be below 1");
  s.checkpoint.check(line);
  return s;
}

/// LibTorch builds whose CPU kernels lack a 16-bit type (1.13 has no float16
/// convolution on the CPU) fail in the first forward pass; say so up front,
/// naming the flag, with LibTorch's own first line.
void check_precision(const settings& s) {
  if (s.precision == torch::kFloat) return;
  try {
    torch::NoGradGuard no_grad;
    cnn::Cnn probe(2, 4);
    probe->to(s.precision);
    (void)probe->forward(torch::zeros({1, 1, side, side}).to(s.precision));
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    throw dtrain::config_error("--precision " +
                               std::string(s.precision == torch::kHalf ? "fp16" : "bf16") +
                               ": this LibTorch cannot run the CNN in that type on the CPU (" +
                               what.substr(0, what.find('\n')) + "); use bf16 or fp32");
  }
}

int train(dtrain::context<Policy>& ctx, const settings& s) {
  torch::set_num_threads(1);  // one rank per core; LibTorch would start a thread per core in each
  check_precision(s);
  const cnn::images train_set = cnn::generate(s.samples, s.seed);
  const cnn::images test_set = cnn::generate(s.samples / 4, s.seed + 1);

  torch::manual_seed(s.seed);  // every rank builds the same model; DDP broadcasts rank 0's anyway
  cnn::Cnn model(s.channels, s.hidden);
  // 16-bit (--precision bf16|fp16): the module in that type; DDP sums its
  // gradients in float32 and keeps float32 master weights of the shard.
  const bool sixteen = s.precision != torch::kFloat;
  if (sixteen) model->to(s.precision);
  auto ddp = dtrain::torch::DistributedDataParallel(
      ctx, model,
      {.bucket_cap_mb = 0.25,
       .first_bucket_cap_mb = 0.05,
       .accumulate = sixteen ? dtrain::accumulation::float32 : dtrain::accumulation::wire,
       .sharding = s.sharding,
       .master_weights = sixteen});
  // Sharded (--sharding 1|2|3), the optimizer holds state for this rank's shard only;
  // at 3 DDP holds this rank's shard of the values too (the CNN, not a
  // torch::nn::Sequential, is one unit: gathered whole for each step). 16-bit:
  // the optimizer updates the float32 masters (shard_parameters()), whole without sharding.
  const bool sharded = s.sharding != dtrain::sharding::none;
  const bool on_shard = sharded || sixteen;
  torch::optim::SGD optimizer(on_shard ? ddp.shard_parameters() : model->parameters(),
                              torch::optim::SGDOptions(s.lr).momentum(s.momentum));
  // fp16 scales the loss and skips a step whose gradients overflowed on any rank.
  dtrain::loss_scaler scaler({.enabled = s.precision == torch::kHalf});
  dtrain::torch::distributed_sampler sampler(s.samples, ctx.world(), {.seed = s.seed});

  if (ctx.is_main()) {
    std::printf(
        "training a CNN (4 conv blocks %lld-%lld, fc %lld-%lld) on %zu images of %lldx%lld: "
        "%d ranks x batch %zu (global batch %zu), lr %g, momentum %g, %zu gradient buckets, "
        "backend %s, LibTorch %s\n",
        static_cast<long long>(s.channels / 2), static_cast<long long>(s.channels),
        static_cast<long long>(s.hidden), static_cast<long long>(classes), s.samples,
        static_cast<long long>(side), static_cast<long long>(side), ctx.size(), s.batch_size,
        s.batch_size * static_cast<std::size_t>(ctx.size()), s.lr, s.momentum, ddp.buckets().size(),
        Policy::backend_type::name.data(), TORCH_VERSION);
    if (sixteen) {
      std::printf(
          "precision %s: 16-bit values and gradients, averaged with float32 sums, "
          "float32 master weights%s\n",
          s.precision == torch::kHalf ? "float16" : "bfloat16",
          s.precision == torch::kHalf ? ", loss scaling" : "");
    }
    std::fflush(stdout);
  }

  std::optional<dtrain::checkpoint> checkpoint;
  if (!s.checkpoint.dir.empty()) {
    checkpoint.emplace(ctx,
                       dtrain::checkpoint_options{.dir = s.checkpoint.dir,
                                                  .every = s.checkpoint.every,
                                                  .memory_every = s.checkpoint.memory_every,
                                                  .memory_budget = s.checkpoint.memory_budget});
    dtrain::torch::add_module(*checkpoint, ddp);  // stage 3: the values' shards
    // Sharded, each rank saves its shard of the momentum; a job of another
    // size re-cuts it (without sharding: the optimizer, replicated).
    dtrain::torch::add_optimizer(*checkpoint, optimizer, ddp);
    dtrain::torch::add_sampler(*checkpoint, sampler);
    if (sixteen) checkpoint->add(scaler);
    if (const auto step = checkpoint->restore(); step && ctx.is_main()) {
      std::printf("resumed at step %llu: epoch %llu, %llu samples into it\n",
                  static_cast<unsigned long long>(*step),
                  static_cast<unsigned long long>(sampler.epoch() + 1),
                  static_cast<unsigned long long>(sampler.shard().position().offset));
      std::fflush(stdout);
    }
  }

  for (; sampler.epoch() < s.epochs; sampler.set_epoch(sampler.epoch() + 1)) {
    const std::size_t epoch = sampler.epoch();
    const auto start = std::chrono::steady_clock::now();
    std::array<double, 3> totals{};  // summed loss, correct predictions, samples
    while (auto indices = sampler.next(s.batch_size)) {
      const torch::Tensor index =
          torch::tensor(std::vector<std::int64_t>(indices->begin(), indices->end()));
      const torch::Tensor x = train_set.x.index_select(0, index).to(s.precision),
                          y = train_set.y.index_select(0, index);
      // 16-bit: the logits widened for the loss, as autocast does.
      const torch::Tensor logits = ddp(x).to(torch::kFloat);
      const torch::Tensor loss = torch::nn::functional::cross_entropy(logits, y);
      // Buckets are averaged as autograd finishes their gradients; when backward() returns,
      // every .grad() holds the mean over every rank's batch, as with PyTorch's DDP.
      (loss * scaler.scale()).backward();
      if (!scaler.unscale(ddp.core())) {  // fp16: an inf or a NaN on some rank skips the step
        ddp.core().gather_parameters();
      } else if (on_shard) {
        ddp.step(optimizer);  // this rank's shard (its masters), then the allgather of the values
      } else {
        optimizer.step();
      }
      scaler.update();
      ddp.zero_grad();
      totals[0] += loss.item<double>() * static_cast<double>(x.size(0));
      totals[1] += logits.argmax(1).eq(y).sum().item<double>();
      totals[2] += static_cast<double>(x.size(0));
      if (checkpoint) checkpoint->step();
    }
    dtrain::allreduce(ctx.communicator(), totals, dtrain::reduce_op::sum).wait();
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    // Stage 3: every rank gathers the whole model (collective) for rank 0's evaluation.
    const auto whole = ddp.core().gather(ddp.core().parameters());
    if (ctx.is_main()) {
      torch::NoGradGuard no_grad;
      model->eval();  // batch norm: the running statistics, which every rank shares (rank 0's)
      const double correct =
          model->forward(test_set.x.to(s.precision)).argmax(1).eq(test_set.y).sum().item<double>();
      std::printf(
          "epoch %zu/%zu  loss %.4f  train accuracy %5.1f%%  test accuracy %5.1f%%  %.0f "
          "samples/s (all ranks)\n",
          epoch + 1, s.epochs, totals[0] / totals[2], 100.0 * totals[1] / totals[2],
          100.0 * correct / static_cast<double>(test_set.x.size(0)), totals[2] / elapsed.count());
      model->train();
      std::fflush(stdout);
    }
  }

  if (ctx.is_main()) {
    // What this rank holds between steps: stage 3's shard of the values, else the whole model.
    std::size_t state = 0;
    for (const auto& item : optimizer.state()) {
      const auto& momentum = static_cast<const torch::optim::SGDParamState&>(*item.second);
      if (momentum.momentum_buffer().defined()) state += momentum.momentum_buffer().nbytes();
    }
    const std::size_t values = s.sharding == dtrain::sharding::parameters
                                   ? ddp.core().memory_use().values
                                   : ddp.core().model_elements() * c10::elementSize(s.precision);
    std::printf("optimizer state per rank: %zu bytes\nparameters per rank: %zu bytes\n", state,
                values);
    std::fflush(stdout);
  }
  // Same data-parallel steps from the same start: the weights must be bit-identical
  // (stage 3: the whole model gathered for it, as an export would).
  const auto whole = ddp.core().gather(ddp.core().parameters());
  const auto mine = std::bit_cast<std::int64_t>(cnn::checksum(model));
  std::vector<std::int64_t> all(static_cast<std::size_t>(ctx.size()));
  dtrain::allgather(ctx.communicator(), std::array{mine}, all).wait();
  return mlp::weights_agree(program, ctx.is_main(), all) ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const settings s = parse_flags(argc, argv);
  dtrain::run_options options;
  options.agent.nproc_per_node = s.nproc_per_node;
  return dtrain::run<Policy>(
      argc, argv, [&](dtrain::context<Policy>& ctx) { return train(ctx, s); }, options);
}
