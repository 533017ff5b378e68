// bench/scaling: how a data-parallel job scales over nodes, flat against
// hierarchical. bench/scaling.sh runs it on a simulated cluster (1, 2 and 4
// nodes joined at 1 Gbit/s) and prints the tables and the plot; by hand, run
// it on every node with DTRAIN_NNODES, DTRAIN_NODE_RANK, MASTER_ADDR and
// MASTER_PORT set, as the demo.
//
//   scaling --what allreduce [--mib 64] [--rounds 7] [--chunk-mib 8]
//       the allreduce of one bucket, flat (the world communicator) and
//       hierarchical (topology::hierarchical's group), alternating in one
//       run; prints the median of each and hierarchical / flat.
//   scaling --what train --topology flat|hierarchical --mode strong|weak
//       [--layers 6 --width 1024] [--global-batch 256 | --batch 64]
//       [--steps 8] [--epochs 2] [--compute device|cpu] [--sample-us 6000]
//       DistributedDataParallel training of `layers` dense layers of
//       width x width float32 weights (6 x 1024 x 1024: a 24 MiB gradient)
//       for `steps` steps per epoch. strong: a fixed global batch, shared by
//       the ranks; weak: a fixed batch per rank. Gradients of each layer are
//       marked ready as backward produces them, so buckets travel while
//       backward runs. Prints the last epoch's time.
//
// Compute per sample: `device` (default) stands for each rank's own
// accelerator: the host sleeps sample-us per sample (a third in forward, the
// rest in backward), so that N simulated nodes compute as N machines would;
// the nodes of a simulated cluster share this machine's cores, which could
// not run N nodes' worth of CPU compute at once. `cpu` does the layers'
// matrix-vector products on the CPU instead (real compute that scales only
// as far as there are cores).
//
// Every line it prints on rank 0 that starts with `{` is one JSON result.
// Its own node agent over Gloo: --nproc-per-node N (DTRAIN_NPROC_PER_NODE wins).

#include <dtrain/dtrain.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace {

using Flat =
    dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo, dtrain::topology::flat>;
using Hierarchical =
    dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo, dtrain::topology::hierarchical>;

struct settings {
  std::string what = "train";
  std::string topology = "hierarchical";
  std::string mode = "strong";
  std::string compute = "device";
  int layers = 6;
  int width = 1024;
  int global_batch = 256;
  int batch = 64;
  int steps = 8;
  int epochs = 2;
  int sample_us = 6000;
  double mib = 64;
  int chunk_mib = static_cast<int>(dtrain::topology::hierarchical::default_chunk_bytes >> 20);
  int rounds = 7;
  int nproc_per_node = 2;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(
      stderr,
      "scaling: %s\n"
      "usage: scaling --what allreduce [--mib M] [--rounds R] [--chunk-mib C]\n"
      "       scaling --what train --topology flat|hierarchical --mode strong|weak\n"
      "               [--layers L] [--width W] [--global-batch B] [--batch b] [--steps S]\n"
      "               [--epochs E] [--compute device|cpu] [--sample-us U]\n"
      "       [--nproc-per-node N]\n",
      why.c_str());
  std::exit(2);
}

settings parse(int argc, char** argv) {
  settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--help" || flag == "-h") usage("data-parallel scaling, flat against hierarchical");
    if (i + 1 >= argc) usage(std::string(flag) + " needs a value");
    const std::string value = argv[++i];
    auto number = [&](int low) {
      char* end = nullptr;
      const long v = std::strtol(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0' || v < low || v > 1'000'000'000) {
        usage(std::string(flag) + " " + value + " is not a whole number of at least " +
              std::to_string(low));
      }
      return static_cast<int>(v);
    };
    auto word = [&](std::initializer_list<std::string_view> allowed) {
      if (std::find(allowed.begin(), allowed.end(), value) == allowed.end())
        usage(std::string(flag) + " " + value + " is not one of the choices");
      return value;
    };
    if (flag == "--what")
      s.what = word({"train", "allreduce"});
    else if (flag == "--topology")
      s.topology = word({"flat", "hierarchical"});
    else if (flag == "--mode")
      s.mode = word({"strong", "weak"});
    else if (flag == "--compute")
      s.compute = word({"device", "cpu"});
    else if (flag == "--layers")
      s.layers = number(1);
    else if (flag == "--width")
      s.width = number(1);
    else if (flag == "--global-batch")
      s.global_batch = number(1);
    else if (flag == "--batch")
      s.batch = number(1);
    else if (flag == "--steps")
      s.steps = number(1);
    else if (flag == "--epochs")
      s.epochs = number(1);
    else if (flag == "--sample-us")
      s.sample_us = number(0);
    else if (flag == "--mib")
      s.mib = number(1);
    else if (flag == "--rounds")
      s.rounds = number(1);
    else if (flag == "--chunk-mib")
      s.chunk_mib = number(0);
    else if (flag == "--nproc-per-node" || flag == "--nproc_per_node")
      s.nproc_per_node = number(1);
    else
      usage("unknown flag " + std::string(flag));
  }
  return s;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The slowest rank's value (outside every timed region).
template <class Comm>
double slowest(Comm& comm, double mine) {
  dtrain::allreduce(comm, std::span<double>(&mine, 1), dtrain::reduce_op::max).wait();
  return mine;
}

// One collective's time on the slowest rank, started together after a barrier.
template <class Comm, class Start>
double seconds_of(Comm& world, Start&& start) {
  world.barrier().wait();
  const auto begin = std::chrono::steady_clock::now();
  start().wait();
  return slowest(world,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
}

// --what allreduce: one bucket, flat and hierarchical alternating.
int allreduce_bench(dtrain::context<Flat>& ctx, const settings& s) {
  auto& world = ctx.communicator();
  dtrain::communicator_channel channel(world);
  auto layout = *dtrain::node_layout::of(ctx.world());
  dtrain::topology::hierarchical::group<dtrain::gloo_communicator> hier(
      world, dtrain::control_plane(channel), layout, static_cast<std::size_t>(s.chunk_mib) << 20);
  const std::size_t count = static_cast<std::size_t>(s.mib * 1024 * 1024 / sizeof(float));
  std::vector<float> data(count, 1.0f), shard(hier.shard_count(count));
  const dtrain::buffer whole = dtrain::host_buffer(std::span<float>(data));
  const dtrain::buffer scratch = dtrain::host_buffer(std::span<float>(shard));
  std::vector<double> flat_s, hier_s;
  for (int round = 0; round < s.rounds + 1; ++round) {  // round 0 warms up
    for (int which = 0; which < 2; ++which) {
      const bool flat_first = round % 2 == 0;
      const bool flat = (which == 0) == flat_first;
      const double took = seconds_of(world, [&] {
        return flat ? world.allreduce(whole, whole, dtrain::reduce_op::avg)
                    : hier.allreduce(whole, scratch, dtrain::reduce_op::avg);
      });
      if (round > 0) (flat ? flat_s : hier_s).push_back(took);
    }
  }
  // Where the hierarchical time goes: each step alone, on the group's communicators.
  double rs_s = 0, cross_s = 0, ag_s = 0;
  if (hier.hierarchical()) {
    const std::size_t q = hier.shard_count(count);
    dtrain::buffer head = whole, part = scratch;
    head.count = q * hier.granularity();
    part.count = q;
    auto timed = [&](auto&& step) {
      std::vector<double> runs;
      for (int round = 0; round < std::max(3, s.rounds / 2); ++round)
        runs.push_back(seconds_of(world, step));
      return median(runs);
    };
    rs_s = timed([&] { return hier.local().reduce_scatter(head, part, dtrain::reduce_op::avg); });
    cross_s = timed([&] { return hier.cross().allreduce(part, part, dtrain::reduce_op::avg); });
    ag_s = timed([&] { return hier.local().allgather(part, head); });
  }
  if (data[count / 2] != 1.0f) {
    std::fprintf(stderr, "scaling: rank %d: the mean of ones is %g\n", ctx.rank(),
                 static_cast<double>(data[count / 2]));
    return 1;
  }
  if (ctx.is_main()) {
    const double f = median(flat_s), h = median(hier_s);
    std::printf(
        "{\"what\": \"allreduce\", \"mib\": %g, \"nodes\": %d, \"ranks\": %d, \"hierarchy\": "
        "\"%s\", \"flat_s\": %.4f, \"hierarchical_s\": %.4f, \"ratio\": %.3f, \"rounds\": %d, "
        "\"chunk_mib\": %d, "
        "\"local_reduce_scatter_s\": %.4f, \"cross_allreduce_s\": %.4f, \"local_allgather_s\": "
        "%.4f}\n",
        s.mib, ctx.num_nodes(), ctx.size(), hier.describe().c_str(), f, h, h / f, s.rounds,
        s.chunk_mib, rs_s, cross_s, ag_s);
    std::fflush(stdout);
  }
  return 0;
}

// The model: `layers` dense layers, each a width x width weight and its gradient.
struct dense_model {
  int width;
  std::vector<std::vector<float>> weights, grads;
  dense_model(int layers, int w)
      : width(w),
        weights(
            static_cast<std::size_t>(layers),
            std::vector<float>(static_cast<std::size_t>(w) * static_cast<std::size_t>(w), 0.01f)),
        grads(weights.size(), std::vector<float>(weights.front().size(), 0.0f)) {}
  std::vector<dtrain::parameter> parameters() {
    std::vector<dtrain::parameter> out;
    for (std::size_t l = 0; l < weights.size(); ++l)
      out.push_back(dtrain::param("layer" + std::to_string(l), weights[l], grads[l]));
    return out;
  }
};

// One layer's share of a batch: forward (part 0, a third of the time) or backward.
void compute(dense_model& m, std::size_t layer, int samples, bool backward, const settings& s,
             std::vector<float>& x, std::vector<float>& y) {
  const auto n = static_cast<std::size_t>(m.width);
  if (s.compute == "device") {
    const double share = (backward ? 2.0 : 1.0) / 3.0 / static_cast<double>(m.weights.size());
    std::this_thread::sleep_for(
        std::chrono::microseconds(static_cast<long>(share * s.sample_us * samples)));
    return;
  }
  const float* w = m.weights[layer].data();
  float* g = m.grads[layer].data();
  for (int sample = 0; sample < samples; ++sample) {
    for (std::size_t i = 0; i < n; ++i)
      x[i] = 0.001f * static_cast<float>((i + static_cast<std::size_t>(sample)) % 7);
    if (!backward) {
      for (std::size_t r = 0; r < n; ++r) {
        float acc = 0;
        for (std::size_t c = 0; c < n; ++c) acc += w[r * n + c] * x[c];
        y[r] = acc;
      }
    } else {
      for (std::size_t r = 0; r < n; ++r) {  // grad += dy x^T, dx = W^T dy
        const float dy = x[r];
        for (std::size_t c = 0; c < n; ++c) g[r * n + c] += dy * x[c];
      }
      for (std::size_t c = 0; c < n; ++c) y[c] = 0;
      for (std::size_t r = 0; r < n; ++r) {
        for (std::size_t c = 0; c < n; ++c) y[c] += w[r * n + c] * x[r];
      }
    }
  }
}

template <class DdpPolicy>
int train_bench(dtrain::context<Flat>& ctx, const settings& s) {
  dense_model model(s.layers, s.width);
  // The DDP of DdpPolicy on the context's communicator: the nodes come from node names.
  dtrain::DistributedDataParallel<dense_model, DdpPolicy> ddp(
      ctx.communicator(), model, {.bucket_cap_mb = 8, .first_bucket_cap_mb = 4});
  const int per_rank = s.mode == "strong" ? std::max(1, s.global_batch / ctx.size()) : s.batch;
  std::vector<float> x(static_cast<std::size_t>(s.width)), y(x.size());
  std::vector<double> epochs;
  for (int epoch = 0; epoch < s.epochs; ++epoch) {
    ctx.barrier();
    const auto start = std::chrono::steady_clock::now();
    for (int step = 0; step < s.steps; ++step) {
      for (std::size_t l = 0; l < model.weights.size(); ++l)
        compute(model, l, per_rank, false, s, x, y);
      for (std::size_t l = model.weights.size(); l-- > 0;) {
        compute(model, l, per_rank, true, s, x, y);
        ddp.mark_ready(l);
      }
      ddp.synchronize();
      ddp.zero_grad();
    }
    epochs.push_back(
        slowest(ctx.communicator(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()));
  }
  if (ctx.is_main()) {
    const double last = epochs.back();
    const double grad_mib = static_cast<double>(s.layers) * s.width * s.width * 4 / 1048576.0;
    std::printf(
        "{\"what\": \"train\", \"mode\": \"%s\", \"topology\": \"%s\", \"runs_as\": \"%s\", "
        "\"compute\": \"%s\", \"nodes\": %d, \"ranks\": %d, \"per_rank_batch\": %d, "
        "\"global_batch\": %d, \"steps\": %d, \"grad_mib\": %.1f, \"buckets\": %zu, "
        "\"epoch_s\": %.4f, \"samples_per_s\": %.1f}\n",
        s.mode.c_str(), s.topology.c_str(), ddp.topology().describe().c_str(), s.compute.c_str(),
        ctx.num_nodes(), ctx.size(), per_rank, per_rank * ctx.size(), s.steps, grad_mib,
        ddp.buckets().size(), last, static_cast<double>(per_rank) * ctx.size() * s.steps / last);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const settings s = parse(argc, argv);
  dtrain::run_options options;
  options.agent.nproc_per_node = s.nproc_per_node;
  return dtrain::run<Flat>(
      argc, argv,
      [&](dtrain::context<Flat>& ctx) {
        if (s.what == "allreduce") return allreduce_bench(ctx, s);
        if (s.topology == "hierarchical") return train_bench<Hierarchical>(ctx, s);
        return train_bench<Flat>(ctx, s);
      },
      options);
}
