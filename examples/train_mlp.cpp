// dtrain_train_mlp: data-parallel training of a small MLP (examples/mlp.hpp)
// on a synthetic classification problem, with DistributedDataParallel.
//
//   dtrain_train_mlp --nproc-per-node 4 --epochs 5       (the node agent: starts 4 Gloo workers)
//   mpirun -np 4 dtrain_train_mlp_mpi --epochs 5         (the MPI build: one rank per process)
//
// Every rank trains on its own shard of each epoch (distributed_sampler);
// after each layer's backward its gradients are marked ready, so their
// averaging overlaps the rest of backward. Rank 0 prints loss, accuracy and
// throughput per epoch. At the end every rank compares a checksum of its
// weights with every other rank's: data parallelism must keep them identical.
//
// With --checkpoint-dir DIR it resumes from DIR's newest checkpoint on start
// and, with --checkpoint-every N, saves one every N steps (dtrain::checkpoint:
// the weights, the optimizer's velocities, the sampler's place and the step).
// A job whose worker died and was restarted (--max-restarts, or a rerun
// after mpirun ended the job) ends with the weights of one that never stopped.
//
// With --precision bf16 or fp16 the model's values and gradients, as
// DistributedDataParallel sees them, are 16-bit: averaged in 16 bits on the
// wire with float32 sums (ddp_options::accumulate), and updated through
// float32 master weights of the rank's shard (ddp_options::master_weights);
// fp16 scales the loss (dtrain::loss_scaler). The MLP computes in float32
// from the 16-bit values, as a GPU's 16-bit kernels accumulate in float32.
//
// Exit status: 0; 1 when the ranks' weights differ or a rank fails; 2 for a
// bad flag or environment.

#include "mlp.hpp"
#include "train_program.hpp"

#include <dtrain/checkpoint.hpp>
#include <dtrain/dtrain.hpp>

#include <array>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// The MPI build (target dtrain_train_mlp_mpi) runs under mpirun; the default
// build is its own per-node launcher over Gloo.
#if DTRAIN_TRAIN_MLP_MPI
using Policy = dtrain::policy<dtrain::launch::per_process, dtrain::backend::mpi>;
constexpr std::string_view program = "dtrain_train_mlp_mpi";
#else
using Policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>;
constexpr std::string_view program = "dtrain_train_mlp";
#endif

// This program's own flag; command_line describes and parses the shared ones.
constexpr const char* own_synopsis =
    " [--nproc-per-node N]\n          [--optimizer sgd|adam] [--sharding 0|1|2|3]\n"
    "          [--precision fp32|bf16|fp16]\n"
    "          [--checkpoint-dir DIR [--checkpoint-every N]\n"
    "           [--memory-every N [--memory-budget X] [--memory-beside-step]]]\n"
    "          [--sample-log DIR]\n";
constexpr const char* own_options_first =
    "  --nproc-per-node N  workers the node agent starts (DTRAIN_NPROC_PER_NODE wins; 4);\n"
    "                      not in the MPI build, where mpirun starts the ranks\n"
    "  --optimizer sgd|adam  SGD with --momentum, or Adam (torch's defaults; give it a\n"
    "                      smaller --lr, e.g. 0.003) (sgd)\n"
    "  --sharding 0|1|2|3  ZeRO stage: 0 DDP, 1 the optimizer state sharded across the\n"
    "                      ranks, 2 the averaged gradients too, 3 the values too\n"
    "                      (ddp_options::sharding) (0)\n"
    "  --precision fp32|bf16|fp16  the values and gradients DDP averages and updates:\n"
    "                      float32, or 16-bit with float32 sums and float32 master\n"
    "                      weights (fp16 with a loss scaler) (fp32)\n";
// (then mlp::checkpoint_help, the flags the LibTorch example takes too)
constexpr const char* own_options_last =
    "  --memory-beside-step  the memory copy reads the weights beside the next step's\n"
    "                      forward and backward, not in step() (checkpoint_options::\n"
    "                      memory_beside_step)\n"
    "  --sample-log DIR    each rank writes the samples of each step it begins to\n"
    "                      DIR/round-R-rank-N.txt (\"step epoch index...\"), R the\n"
    "                      agent's round: to count them across restarts\n";

/// The shared settings and this program's own.
struct demo_settings {
  mlp::settings s;
  mlp::checkpoint_flags checkpoint;
  bool memory_beside_step = false;
  std::string sample_log;
  mlp::optimizer::kind optimizer = mlp::optimizer::kind::sgd;
  dtrain::sharding sharding = dtrain::sharding::none;
  dtrain::dtype precision = dtrain::dtype::float32;
};

demo_settings parse_flags(int argc, char** argv) {
  static const std::string own_options =
      std::string(own_options_first) + mlp::checkpoint_help + own_options_last;
  const mlp::command_line line(program, own_synopsis, own_options.c_str());
  demo_settings d;
  line.parse(argc, argv, d.s, [&](std::string_view flag, auto& value) {
    if (d.checkpoint.take(line, flag, value)) return true;
    if (flag == "--memory-beside-step") {
      d.memory_beside_step = true;
      return true;
    }
    if (flag == "--optimizer") {
      const std::string_view name = value();
      if (name != "sgd" && name != "adam")
        line.bad_flag("--optimizer " + std::string(name) + ": sgd or adam");
      d.optimizer = name == "adam" ? mlp::optimizer::kind::adam : mlp::optimizer::kind::sgd;
      return true;
    }
    if (flag == "--sharding") {
      const std::string_view stage = value();
      if (stage != "0" && stage != "1" && stage != "2" && stage != "3")
        line.bad_flag("--sharding " + std::string(stage) + ": 0 (DDP), 1, 2 or 3 (ZeRO's stages)");
      d.sharding = static_cast<dtrain::sharding>(stage[0] - '0');
      return true;
    }
    if (flag == "--precision") {
      const std::string_view name = value();
      if (name == "fp32") {
        d.precision = dtrain::dtype::float32;
      } else if (name == "bf16") {
        d.precision = dtrain::dtype::bfloat16;
      } else if (name == "fp16") {
        d.precision = dtrain::dtype::float16;
      } else {
        line.bad_flag("--precision " + std::string(name) + ": fp32, bf16 or fp16");
      }
      return true;
    }
    if (flag == "--sample-log") {
      d.sample_log = std::string(value());
      if (d.sample_log.empty()) line.bad_flag("--sample-log needs a directory");
      return true;
    }
    if (Policy::launch_type::mode != dtrain::launch_mode::per_node ||
        (flag != "--nproc-per-node" && flag != "--nproc_per_node")) {
      return false;
    }
    d.s.nproc_per_node = line.number<int>(flag, value(), 1);
    return true;
  });
  d.checkpoint.check(line);
  if (d.memory_beside_step && d.checkpoint.memory_every == 0) {
    line.bad_flag("--memory-beside-step needs --memory-every N (a memory copy to read)");
  }
  return d;
}

/// --precision bf16|fp16: what DistributedDataParallel sees of the MLP, in
/// 16 bits (Half): each weight and bias as a 16-bit copy of values and
/// gradients. The MLP computes in float32 from the 16-bit values (to_model():
/// widened before each layer's use), and its float32 gradients are rounded
/// into the 16-bit ones as each layer finishes (from_model()), times the
/// loss scale.
template <class Half>
struct half_model {
  mlp::model& m;
  std::vector<std::vector<Half>> values, gradients;
  std::vector<Half*> held, grads;  // pointers DDP may repoint (buckets; stage 3's values)
  explicit half_model(mlp::model& model) : m(model) {
    for (mlp::linear& l : m.layers()) {
      for (const auto& [from, count] :
           {std::pair{l.weight_values, l.in * l.out}, std::pair{l.bias_values, l.out}}) {
        values.emplace_back(count);
        for (std::size_t i = 0; i < count; ++i) values.back()[i] = Half(from[i]);
        gradients.emplace_back(count, Half(0.0f));
      }
    }
    for (std::size_t p = 0; p < values.size(); ++p) {
      held.push_back(values[p].data());
      grads.push_back(gradients[p].data());
    }
  }
  std::vector<dtrain::parameter> parameters() {
    std::vector<dtrain::parameter> out;
    const std::vector<dtrain::parameter> names = m.parameters();
    for (std::size_t p = 0; p < held.size(); ++p)
      out.push_back(dtrain::param(names[p].name, held[p], values[p].size(), grads[p]));
    return out;
  }
  /// Layer l's float32 values from its 16-bit ones (wherever DDP keeps them).
  void to_model(std::size_t l) {
    mlp::linear& layer = m.layers()[l];
    const auto [w, b] = mlp::model::parameter_indices(l);
    for (std::size_t i = 0; i < layer.in * layer.out; ++i)
      layer.weight_values[i] = static_cast<float>(held[w][i]);
    for (std::size_t i = 0; i < layer.out; ++i)
      layer.bias_values[i] = static_cast<float>(held[b][i]);
  }
  /// Layer l's float32 gradients, times `scale`, rounded into its 16-bit ones.
  void from_model(std::size_t l, float scale) {
    const mlp::linear& layer = m.layers()[l];
    const auto [w, b] = mlp::model::parameter_indices(l);
    for (std::size_t i = 0; i < layer.in * layer.out; ++i)
      grads[w][i] = Half(layer.grad_weight[i] * scale);
    for (std::size_t i = 0; i < layer.out; ++i) grads[b][i] = Half(layer.grad_bias[i] * scale);
  }
};

/// Trains with the values and gradients DDP averages in T: float (the MLP's
/// own arrays), or a 16-bit type (a half_model over them).
template <class T>
int train(dtrain::context<Policy>& ctx, const demo_settings& d) {
  constexpr bool sixteen = !std::is_same_v<T, float>;
  const mlp::settings& s = d.s;
  mlp::flush_denormals();  // this thread does (and, one BLAS thread per rank, has) the arithmetic
  const mlp::problem problem{.features = s.features, .classes = s.classes, .seed = s.seed};
  const mlp::dataset train_set = mlp::dataset::generate(problem, s.samples, 0);
  const mlp::dataset test_set = mlp::dataset::generate(problem, s.samples / 4, 1);

  // Every rank builds the same model; DDP broadcasts rank 0's weights anyway.
  mlp::model model(s.widths(), s.seed);
  using Trained = std::conditional_t<sixteen, half_model<T>, mlp::model>;
  std::optional<half_model<T>> half;  // 16-bit: what DDP sees
  if constexpr (sixteen) half.emplace(model);
  auto trained = [&]() -> Trained& {
    if constexpr (sixteen) {
      return *half;
    } else {
      return model;
    }
  };
  // 16-bit below stage 3: the MLP's float32 values, widened from DDP's 16-bit ones.
  auto widen_all = [&] {
    if constexpr (sixteen) {
      for (std::size_t l = 0; l < model.layers().size(); ++l) trained().to_model(l);
    }
  };
  // A model this small fits one default (25 MiB) bucket; small buckets let the
  // last layers' gradients travel while backward is still busy, as in a real model.
  // 16-bit: float32 sums of the 16-bit gradients, float32 master weights.
  dtrain::DistributedDataParallel<Trained, Policy> ddp(
      ctx, trained(),
      {.bucket_cap_mb = 16.0 / 1024,
       .first_bucket_cap_mb = 4.0 / 1024,
       .accumulate = sixteen ? dtrain::accumulation::float32 : dtrain::accumulation::wire,
       .sharding = d.sharding,
       .master_weights = sixteen});
  // ZeRO stage 3: DDP holds this rank's shard of the values, whole only while a
  // layer computes (hold); the model's own copy of the initial values can go
  // (16-bit: the MLP keeps its float32 working copy, widened from DDP's values).
  const bool stage3 = d.sharding == dtrain::sharding::parameters;
  if (stage3 && !sixteen) model.drop_initial_values();
  auto hold = [&](std::size_t layer) {
    auto held = ddp.gather(mlp::model::parameter_indices(layer));
    if constexpr (sixteen) trained().to_model(layer);  // the 16-bit values, widened
    return held;
  };
  // fp16 scales the loss (so that small gradients do not flush to zero) and
  // skips a step whose gradients overflowed on any rank; off otherwise.
  dtrain::loss_scaler scaler({.enabled = std::is_same_v<T, dtrain::float16>});
  // Its state covers this rank's shard (ddp.shard(): every parameter without sharding).
  mlp::optimizer optimizer(d.optimizer, s.lr, s.momentum);
  dtrain::distributed_sampler sampler(train_set.size(), ctx.world(), {.seed = s.seed});

  if (ctx.is_main()) {
    std::printf(
        "training a %s MLP on %zu samples: %d ranks x batch %zu (global batch %zu), lr %g, "
        "momentum %g, %zu gradient buckets, backend %s, matrix products: %s\n",
        s.widths_text().c_str(), train_set.size(), ctx.size(), s.batch_size,
        s.batch_size * static_cast<std::size_t>(ctx.size()), s.lr, s.momentum, ddp.buckets().size(),
        Policy::backend_type::name.data(), mlp::gemm_engine());
    if (d.optimizer != mlp::optimizer::kind::sgd || d.sharding != dtrain::sharding::none) {
      std::printf(
          "optimizer %s, sharding %s (ZeRO stage %d): "
          "this rank updates %zu of the model's values\n",
          d.optimizer == mlp::optimizer::kind::adam ? "adam" : "sgd",
          std::string(dtrain::to_string(d.sharding)).c_str(), static_cast<int>(d.sharding),
          ddp.shard_elements());
    }
    if (sixteen) {
      std::printf(
          "precision %s: 16-bit values and gradients, averaged with float32 sums, "
          "float32 master weights (%zu bytes on this rank)%s\n",
          std::string(dtrain::to_string(dtrain::dtype_of<T>)).c_str(), ddp.memory_use().master,
          std::is_same_v<T, dtrain::float16> ? ", loss scaling" : "");
    }
    std::fflush(stdout);
  }

  // What a resumed job needs to continue exactly: weights, velocities, the
  // sampler's place and the step (the data and the model are made from --seed).
  std::optional<dtrain::checkpoint> checkpoint;
  if (!d.checkpoint.dir.empty()) {
    checkpoint.emplace(ctx, dtrain::checkpoint_options{.dir = d.checkpoint.dir,
                                                       .every = d.checkpoint.every,
                                                       .memory_every = d.checkpoint.memory_every,
                                                       .memory_budget = d.checkpoint.memory_budget,
                                                       .memory_beside_step = d.memory_beside_step});
    if (d.sharding == dtrain::sharding::parameters) {
      // ZeRO stage 3: only DDP holds the values, each rank its shard: saved
      // so, and re-cut for another number of ranks, as the optimizer state
      // (16-bit: the float32 master weights, from which the values are rounded).
      checkpoint->add_sharded("parameters", ddp);
    } else {
      checkpoint->add(ddp.parameters());
      if (sixteen) checkpoint->add_sharded("master", ddp);  // float32, the 16-bit values' source
    }
    if (sixteen) checkpoint->add(scaler);
    checkpoint->add(sampler);
    if (d.sharding == dtrain::sharding::none) {
      checkpoint->add(
          "optimizer", [&] { return optimizer.state(); },
          [&](std::string_view bytes) { optimizer.load_state(bytes); });
    } else {
      // Sharded, each rank holds its shard of the optimizer state: saved so,
      // and re-cut when the job resumes on another number of ranks.
      optimizer.reserve(ddp.shard_elements());
      checkpoint->add("optimizer.steps", optimizer.step_count());
      if (!optimizer.first_moment().empty())
        checkpoint->add_sharded("optimizer.first", optimizer.first_moment(), ddp);
      if (!optimizer.second_moment().empty())
        checkpoint->add_sharded("optimizer.second", optimizer.second_moment(), ddp);
    }
    if (const auto step = checkpoint->restore(); step && ctx.is_main()) {
      std::printf("resumed at step %llu: epoch %llu, %llu samples into it\n",
                  static_cast<unsigned long long>(*step),
                  static_cast<unsigned long long>(sampler.epoch() + 1),
                  static_cast<unsigned long long>(sampler.position().offset));
      std::fflush(stdout);
    }
  }

  // --sample-log: what this rank trains, step by step, in a file of this round's.
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> sample_log(nullptr, &std::fclose);
  if (!d.sample_log.empty()) {
    const std::string path = d.sample_log + "/round-" + std::to_string(ctx.restart_count()) +
                             "-rank-" + std::to_string(ctx.rank()) + ".txt";
    sample_log.reset(std::fopen(path.c_str(), "w"));
    if (!sample_log) {
      throw dtrain::config_error("--sample-log: cannot write " + path + " (rank " +
                                 std::to_string(ctx.rank()) + ")");
    }
  }
  std::uint64_t steps = checkpoint ? checkpoint->steps() : 0;
  if (!stage3) widen_all();    // the values rank 0 sent, or the checkpoint's
  std::vector<float> widened;  // a 16-bit piece's mean gradients, as float32

  for (; sampler.epoch() < s.epochs; sampler.set_epoch(sampler.epoch() + 1)) {
    const std::size_t epoch = sampler.epoch();
    const auto start = std::chrono::steady_clock::now();
    std::array<double, 3> totals{};  // summed loss, correct predictions, samples
    for (auto batch = sampler.next_batch(s.batch_size); !batch.empty();
         batch = sampler.next_batch(s.batch_size)) {
      if (sample_log) {
        // Before the step: a rank killed after the step, before a line written
        // after it, would leave a step that the job kept (its checkpoint has
        // it) and no line for it; a step begun and lost is trained again.
        std::string text = std::to_string(steps + 1) + " " + std::to_string(epoch);
        for (const std::size_t i : batch) {
          text += ' ';  // (not " " + to_string: GCC 12's -Wrestrict misfires on it at -O2)
          text += std::to_string(i);
        }
        text += "\n";
        std::fputs(text.c_str(), sample_log.get());
        std::fflush(sample_log.get());
      }
      const mlp::batch_result r = model.forward(train_set, batch, hold);
      model.backward(
          [&](std::size_t layer) {
            if constexpr (sixteen) trained().from_model(layer, static_cast<float>(scaler.scale()));
            ddp.mark_ready(mlp::model::parameter_indices(layer));
          },
          0, hold);
      ddp.synchronize();  // gradients now hold the mean over every rank's batch
      // The state changes from here: a memory copy read beside this step has read it.
      if (checkpoint) checkpoint->before_update();
      if (scaler.unscale(ddp)) {  // (fp16: unless an inf or a NaN came out on some rank)
        optimizer.begin_step();
        ddp.optimizer_step([&](const dtrain::shard_piece& piece) {  // this rank's shard, then
          std::span<const float> mean(static_cast<const float*>(piece.gradients.data),
                                      piece.gradients.count);  // the allgather of the updated
          if constexpr (sixteen) {                             // values (sharding)
            const auto* g = static_cast<const T*>(piece.gradients.data);
            widened.assign(piece.gradients.count, 0.0f);
            for (std::size_t i = 0; i < widened.size(); ++i) widened[i] = static_cast<float>(g[i]);
            mean = widened;
          }
          // piece.master: the float32 master weights (16-bit), or the values themselves
          optimizer.update({static_cast<float*>(piece.master.data), piece.master.count}, mean,
                           piece.state_offset);
        });
      } else {
        ddp.gather_parameters();  // skipped on every rank: the values stay as they were
      }
      scaler.update();
      ddp.zero_grad();
      if constexpr (sixteen) {
        model.zero_grad();         // the MLP's own float32 gradients (DDP's are the 16-bit ones)
        if (!stage3) widen_all();  // the updated values
      }
      totals[0] += r.loss * static_cast<double>(r.count);
      totals[1] += static_cast<double>(r.correct);
      totals[2] += static_cast<double>(r.count);
      ++steps;
      if (checkpoint) checkpoint->step();
    }
    dtrain::allreduce(ctx.communicator(), totals, dtrain::reduce_op::sum).wait();
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    // Stage 3: every rank gathers each layer (collective), so every rank evaluates.
    const mlp::batch_result test =
        stage3 || ctx.is_main() ? model.evaluate(test_set, hold) : mlp::batch_result{};
    if (ctx.is_main()) {
      std::printf(
          "epoch %zu/%zu  loss %.4f  train accuracy %5.1f%%  test accuracy %5.1f%%  %.0f "
          "samples/s (all ranks)\n",
          epoch + 1, s.epochs, totals[0] / totals[2], 100.0 * totals[1] / totals[2],
          100.0 * static_cast<double>(test.correct) / static_cast<double>(test.count),
          totals[2] / elapsed.count());
      std::fflush(stdout);
    }
  }

  if (ctx.is_main()) {
    // The values this rank holds between steps: stage 3's shard, else the whole model.
    const std::size_t values = stage3 ? ddp.memory_use().values : ddp.model_elements() * sizeof(T);
    std::printf("optimizer state per rank: %zu bytes\nparameters per rank: %zu bytes\n",
                optimizer.state_bytes(), values);
    if (checkpoint && d.checkpoint.memory_budget > 0) {
      std::printf("memory copies every %llu steps at the end (--memory-budget %g)\n",
                  static_cast<unsigned long long>(checkpoint->memory_interval()),
                  d.checkpoint.memory_budget);
    }
    std::fflush(stdout);
  }
  // Same data-parallel steps from the same start: the weights must be bit-identical
  // (stage 3: the whole model gathered for it, as an export would; 16-bit: the
  // values widened, as the MLP reads them).
  const auto whole = ddp.gather(ddp.parameters());
  widen_all();
  const auto mine = std::bit_cast<std::int64_t>(mlp::checksum(model));
  std::vector<std::int64_t> all(static_cast<std::size_t>(ctx.size()));
  dtrain::allgather(ctx.communicator(), std::array{mine}, all).wait();
  return mlp::weights_agree(program, ctx.is_main(), all) ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const demo_settings d = parse_flags(argc, argv);
  dtrain::run_options options;
  options.agent.nproc_per_node = d.s.nproc_per_node.value_or(4);
  return dtrain::run<Policy>(
      argc, argv,
      [&](dtrain::context<Policy>& ctx) {
        switch (d.precision) {
          case dtrain::dtype::bfloat16: return train<dtrain::bfloat16>(ctx, d);
          case dtrain::dtype::float16: return train<dtrain::float16>(ctx, d);
          default: return train<float>(ctx, d);
        }
      },
      options);
}
