// Data-parallel training equals single-process training: N ranks, each with
// its own share of every global batch and DistributedDataParallel averaging
// the gradients, must end with the weights ONE process gets from training on
// the whole global batch at each step (up to float rounding).
//
// Every rank recomputes that single-process reference itself (the data, the
// initial weights and the sampler are deterministic), so the reference needs
// no communication. Variants: gradient accumulation under no_sync(), bucket
// rebuild on and off, copied (not bucket-view) gradients without overlap,
// and ranks that start from different weights (DDP must broadcast rank 0's).
// A small bucket cap gives several buckets.
//
// Built twice: with MPI (under mpirun) and with Gloo (under dtrain_test_launch).
// Prints what it compared; exit status 1 when any variant differs by more than
// the tolerance.

#include "mlp.hpp"

#include <dtrain/dtrain.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

namespace {

#if DTRAIN_TEST_TRAINING_GLOO
using Policy = dtrain::policy<dtrain::launch::per_process, dtrain::backend::gloo>;
#else
using Policy = dtrain::policy<dtrain::launch::per_process, dtrain::backend::mpi>;
#endif

constexpr mlp::problem problem{.features = 16, .classes = 4, .seed = 7};
const std::vector<std::size_t> widths{16, 24, 24, 4};
constexpr std::uint64_t init_seed = 11;
constexpr std::size_t samples = 256;
constexpr std::size_t batch_per_rank = 8;  // two micro-batches of 4 when accumulating
constexpr std::size_t epochs = 2, steps_per_epoch = 3;
constexpr double lr = 0.1, momentum = 0.9;
constexpr double tolerance = 1e-5;
// Tiny caps, so that each layer's weight and bias share a bucket of their own:
// {fc3.bias, fc3.weight}, {fc2.bias, fc2.weight}, {fc1.bias, fc1.weight}. Backward
// marks a layer's weight before its bias, so the rebuild (from the observed
// order) gives another layout: {fc3.w}, {fc3.b, fc2.w}, {fc2.b, fc1.w}, {fc1.b}.
constexpr dtrain::ddp_options small_buckets{.bucket_cap_mb = 128.0 / (1 << 20),
                                            .first_bucket_cap_mb = 256.0 / (1 << 20)};

constexpr dtrain::sampler_options sampling{.shuffle = true, .seed = 3};

struct variant {
  const char* name;
  bool accumulate = false;      // two micro-batches per step, the first under no_sync()
  bool rebuild = true;          // ddp_options::rebuild_buckets
  bool bucket_view = true;      // ddp_options::gradient_as_bucket_view
  bool overlap = true;          // ddp_options::overlap
  bool different_init = false;  // ranks other than 0 start from other weights
};

const variant variants[] = {
    {.name = "plain"},
    {.name = "no bucket rebuild", .rebuild = false},
    {.name = "no_sync accumulation", .accumulate = true},
    {.name = "no_sync accumulation, no bucket rebuild", .accumulate = true, .rebuild = false},
    {.name = "copied gradients, no overlap, different initial weights",
     .bucket_view = false,
     .overlap = false,
     .different_init = true},
};

/// Every weight and bias of `m`, in forward order.
std::vector<float> flatten(const mlp::model& m) {
  std::vector<float> out;
  for (const mlp::linear& l : m.layers()) {
    out.insert(out.end(), l.weight.begin(), l.weight.end());
    out.insert(out.end(), l.bias.begin(), l.bias.end());
  }
  return out;
}

double max_abs_difference(std::span<const float> a, std::span<const float> b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  }
  return worst;
}

/// The global batch of step `step`: every rank's local batch, concatenated.
std::vector<std::size_t> global_batch(const std::vector<dtrain::distributed_sampler>& samplers,
                                      std::size_t step) {
  std::vector<std::size_t> out;
  for (const auto& s : samplers) {
    auto batch = s.batches(batch_per_rank).at(step);
    out.insert(out.end(), batch.begin(), batch.end());
  }
  return out;
}

/// "{5,4} {3,2} {1,0}": the parameter indices of each bucket.
std::string describe(const std::vector<std::vector<std::size_t>>& layout) {
  std::string out;
  for (const auto& bucket : layout) {
    out += out.empty() ? "{" : " {";
    for (std::size_t i = 0; i < bucket.size(); ++i) {
      if (i) out += ",";
      out += std::to_string(bucket[i]);
    }
    out += "}";
  }
  return out;
}

struct reference_run {
  std::vector<float> initial{}, final{};
  double first_loss = 0, last_loss = 0;
};

/// ONE process training on the full global batch of every step.
reference_run train_single_process(const mlp::dataset& data, int world_size) {
  mlp::model model(widths, init_seed);
  mlp::sgd optimizer(lr, momentum);
  std::vector<dtrain::distributed_sampler> samplers;
  for (int r = 0; r < world_size; ++r) samplers.emplace_back(data.size(), r, world_size, sampling);
  reference_run run{.initial = flatten(model)};
  for (std::size_t epoch = 0; epoch < epochs; ++epoch) {
    for (auto& s : samplers) s.set_epoch(epoch);
    for (std::size_t step = 0; step < steps_per_epoch; ++step) {
      const auto batch = global_batch(samplers, step);
      const double loss = model.forward(data, batch).loss;
      if (epoch == 0 && step == 0) run.first_loss = loss;
      run.last_loss = loss;
      model.backward([](std::size_t) {});
      optimizer.step(model);
      model.zero_grad();
    }
  }
  run.final = flatten(model);
  return run;
}

struct ddp_run {
  std::vector<float> final{};
  std::vector<std::vector<std::size_t>> layout_before{}, layout_after{};  // parameters per bucket
  bool rebuilt = false;
  std::size_t steps = 0;
};

/// The same training with DistributedDataParallel: this rank's share of each batch.
ddp_run train_data_parallel(dtrain::context<Policy>& ctx, const mlp::dataset& data,
                            const variant& v) {
  const std::uint64_t seed = v.different_init && ctx.rank() != 0
                                 ? init_seed + 1000 + static_cast<std::uint64_t>(ctx.rank())
                                 : init_seed;
  mlp::model model(widths, seed);
  dtrain::ddp_options options = small_buckets;
  options.rebuild_buckets = v.rebuild;
  options.gradient_as_bucket_view = v.bucket_view;
  options.overlap = v.overlap;
  dtrain::DistributedDataParallel<mlp::model, Policy> ddp(ctx, model, options);
  auto layout = [&ddp] {
    std::vector<std::vector<std::size_t>> out;
    for (const dtrain::bucket_info& b : ddp.buckets()) out.push_back(b.parameters);
    return out;
  };
  ddp_run run{.layout_before = layout()};

  mlp::sgd optimizer(lr, momentum);
  dtrain::distributed_sampler sampler(data.size(), ctx.world(), sampling);
  auto mark_layer = [&](std::size_t layer) {
    ddp.mark_ready(mlp::model::parameter_indices(layer));
  };
  for (std::size_t epoch = 0; epoch < epochs; ++epoch) {
    sampler.set_epoch(epoch);
    const auto batches = sampler.batches(batch_per_rank);
    for (std::size_t step = 0; step < steps_per_epoch; ++step) {
      const auto batch = batches.at(step);
      if (v.accumulate) {
        // Each micro-batch's gradient is divided by the whole local batch, so
        // the sum of the two is the local batch's mean, as without accumulation.
        const std::size_t half = batch.size() / 2;
        {
          auto accumulating = ddp.no_sync();
          model.forward(data, batch.first(half));
          model.backward(mark_layer, batch.size());
        }
        model.forward(data, batch.subspan(half));
        model.backward(mark_layer, batch.size());
      } else {
        model.forward(data, batch);
        model.backward(mark_layer);
      }
      ddp.synchronize();
      optimizer.step(model);
      ddp.zero_grad();
    }
  }
  run.final = flatten(model);
  run.rebuilt = ddp.buckets_rebuilt();
  run.layout_after = layout();
  run.steps = ddp.steps();
  return run;
}

int check_equivalence(dtrain::context<Policy>& ctx) {
  const mlp::dataset data = mlp::dataset::generate(problem, samples);
  const reference_run reference = train_single_process(data, ctx.size());
  const double moved = max_abs_difference(reference.initial, reference.final);
  const std::size_t steps = epochs * steps_per_epoch;
  bool ok = true;
  auto fail = [&](const std::string& what) {
    std::printf("FAIL [rank %d/%d] %s\n", ctx.rank(), ctx.size(), what.c_str());
    std::fflush(stdout);
    ok = false;
  };
  if (ctx.is_main()) {
    std::printf(
        "single-process reference: %zu steps on global batches of %zu (%d ranks x %zu), "
        "loss %.4f -> %.4f, weights moved up to %.3g from their start\n",
        steps, batch_per_rank * static_cast<std::size_t>(ctx.size()), ctx.size(), batch_per_rank,
        reference.first_loss, reference.last_loss, moved);
  }
  // A reference that does not train would make every comparison vacuous.
  if (!(moved > 1e-2) || !(reference.last_loss < reference.first_loss)) {
    fail("the single-process reference did not train (moved " + std::to_string(moved) + ")");
  }

  for (const variant& v : variants) {
    const ddp_run run = train_data_parallel(ctx, data, v);
    const double difference = max_abs_difference(run.final, reference.final);
    if (ctx.is_main()) {
      std::printf(
          "%-56s %d ranks, %zu steps, buckets %s%s: max |ddp - single process| = %.3g over %zu "
          "weights (limit %g)\n",
          (std::string(v.name) + ":").c_str(), ctx.size(), run.steps,
          describe(run.layout_before).c_str(),
          run.rebuilt ? (" rebuilt as " + describe(run.layout_after)).c_str() : "", difference,
          run.final.size(), tolerance);
      std::fflush(stdout);
    }
    if (!(difference <= tolerance)) {
      fail(std::string(v.name) + ": max |ddp - single process| = " + std::to_string(difference) +
           " exceeds " + std::to_string(tolerance));
    }
    if (run.steps != steps) {
      fail(std::string(v.name) + ": ddp.steps() is " + std::to_string(run.steps) + ", expected " +
           std::to_string(steps));
    }
    if (run.layout_before.size() < 3) {
      fail(std::string(v.name) + ": buckets " + describe(run.layout_before) +
           "; the small bucket cap should give at least 3");
    }
    if (run.rebuilt != v.rebuild) {
      fail(std::string(v.name) + ": buckets_rebuilt() is " + (run.rebuilt ? "true" : "false"));
    }
    // Without a rebuild the layout stays; with one it follows the marking order.
    if (v.rebuild == (run.layout_after == run.layout_before)) {
      fail(std::string(v.name) + ": buckets " + describe(run.layout_before) + " became " +
           describe(run.layout_after) +
           (v.rebuild ? ", expected another layout" : ", expected no change"));
    }
  }
  if (ok && ctx.is_main()) std::printf("PASS: every variant matches single-process training\n");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) { return dtrain::run<Policy>(argc, argv, check_equivalence); }
