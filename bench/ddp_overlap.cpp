// bench/ddp_overlap: how much of DistributedDataParallel's communication the
// backward pass hides, and what bucketing saves over one allreduce per
// parameter (DESIGN.md, Performance model). Run as 2 ranks, either engine:
//
//   [OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (as root)]
//     mpirun -np 2 --oversubscribe build/bench/ddp_overlap --backend mpi [options]
//   build/bench/ddp_overlap --backend gloo [options]
//     (the process is a node agent that starts 2 Gloo workers; DTRAIN_NPROC_PER_NODE=N for N)
//
// Table 1, a layered model: L layers of P float32 each; a layer's backward is
// a "compute" of a chosen duration, then its gradient is final. Measured in
// the same run, rounds interleaved (the order rotates), each figure the median
// over rounds of the slowest rank's step:
//   compute only   the backward without DDP (nothing marked);
//   communication  every gradient marked ready at once, then synchronize();
//   overlap on     mark_ready after each layer, then synchronize();
//   overlap off    the same with ddp_options{.overlap = false}.
// exposed = (step - compute) / communication: 0 is perfect overlap, 1 none.
// `--compute sleep` (the default) sleeps: a GPU computing while the CPU is
// free. `--compute spin` runs CPU arithmetic calibrated to the duration, and
// then competes with the communication threads for the cores. Unless
// --compute-us is given, a layer's compute is communication / L (compute ≈
// communication), measured at start-up. A shared machine's load can move both
// after calibration: when the rounds find the compute (spin) or the
// communication over 30% off, they are run again, recalibrated (3 passes at most).
// DDP_OVERLAP_DEBUG=1 prints every step's time (mpirun: add -x DDP_OVERLAP_DEBUG).
//
// Table 2, bucketing: N small parameters (default 1,000 x 256 float32), one
// waited dtrain::allreduce per parameter against DDP with its default caps.
//
// Table 3, the hand-off: an MLP's gradients (--mlp, default the demo's
// 32,64,64,8, with the demo's caps) marked ready at once, then synchronize(),
// against the raw engine allreduces of the same buckets one after the other.
// Goal: DDP / engine at most 1.1.
//
// Table 4, world size 1: each rank alone (a split of one rank), the same MLP's
// backward as --solo-compute-us of CPU arithmetic per step, with DDP marking
// each layer and synchronizing, against the same loop without DDP. Goal: at
// most 1% over it.
//
// `--backend nccl`: DDP's own cost on a GPU, world size 1 (one GPU cannot host
// two NCCL ranks). The same layered model on the device; a layer's backward is
// device-to-device copies on the compute stream calibrated to --compute-us
// (default 1000); the loop without DDP against the same loop with mark_ready
// after each layer and synchronize(stream). Goal: at most 2% overhead. Without
// a GPU it prints "SKIPPED: no CUDA device" and exits 77.
//
// Options: --backend mpi|gloo|nccl, --compute sleep|spin, --compute-us US (per
// layer), --layers L (16), --floats P (1048576), --bucket-cap-mb MB (4: about
// one layer per bucket), --first-bucket-cap-mb MB (1), --steps N (9),
// --warmup N (2), --small-params N (1000), --small-floats N (256), --mlp W,W,...
// (32,64,64,8), --solo-compute-us US (100), --tables overlap,buckets,handoff,solo
// (all four).
// Goals are printed with the measured values; timings never fail the run.

#include <dtrain/dtrain.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace {

using steady = std::chrono::steady_clock;

struct bench_options {
  std::string backend;  // "mpi" or "gloo"; empty: mpi under mpirun, else gloo
  bool spin = false;
  double compute_us = -1;  // per layer; < 0: communication / layers
  std::size_t layers = 16;
  std::size_t floats = std::size_t{1} << 20;
  double bucket_cap_mb = 4;
  double first_bucket_cap_mb = 1;
  int steps = 9;
  int warmup = 2;
  std::size_t small_params = 1000;
  std::size_t small_floats = 256;
  std::vector<std::size_t> mlp{32, 64, 64, 8};  // tables 3 and 4: the demo's model
  double solo_compute_us = 100;                 // table 4: a step's compute
  std::string tables = "overlap,buckets,handoff,solo";
  [[nodiscard]] bool wants(std::string_view table) const;
};

// "a,b,,c" -> {"a", "b", "", "c"}: a flag's comma-separated values, empty ones kept.
std::vector<std::string> comma_list(std::string_view text) {
  std::vector<std::string> parts;
  for (std::size_t at = 0; at <= text.size();) {
    std::size_t end = text.find(',', at);
    if (end == std::string_view::npos) end = text.size();
    parts.emplace_back(text.substr(at, end - at));
    at = end + 1;
  }
  return parts;
}

bool bench_options::wants(std::string_view table) const {
  const std::vector<std::string> listed = comma_list(tables);
  return std::ranges::find(listed, table) != listed.end();
}

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(
      stderr,
      "ddp_overlap: %s\nusage: ddp_overlap [--backend mpi|gloo|nccl] [--compute sleep|spin] "
      "[--compute-us US] [--layers L] [--floats P] [--bucket-cap-mb MB] "
      "[--first-bucket-cap-mb MB] [--steps N] [--warmup N] [--small-params N] "
      "[--small-floats N] [--mlp W,W,...] [--solo-compute-us US] [--tables LIST]\n",
      why.c_str());
  std::exit(2);
}

bench_options parse(int argc, char** argv) {
  bench_options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(std::string(arg) + " needs a value");
      return argv[++i];
    };
    auto number = [&] {
      const std::string v = value();
      char* end = nullptr;
      const double d = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0' || d < 0)
        usage(std::string(arg) + " " + v + " is not a number >= 0");
      return d;
    };
    if (arg == "--backend") {
      o.backend = value();
      if (o.backend != "mpi" && o.backend != "gloo" && o.backend != "nccl")
        usage("--backend is mpi, gloo or nccl, not " + o.backend);
    } else if (arg == "--compute") {
      const std::string v = value();
      if (v != "spin" && v != "sleep") usage("--compute is spin or sleep, not " + v);
      o.spin = v == "spin";
    } else if (arg == "--compute-us") {
      o.compute_us = number();
    } else if (arg == "--layers") {
      o.layers = static_cast<std::size_t>(number());
    } else if (arg == "--floats") {
      o.floats = static_cast<std::size_t>(number());
    } else if (arg == "--bucket-cap-mb") {
      o.bucket_cap_mb = number();
    } else if (arg == "--first-bucket-cap-mb") {
      o.first_bucket_cap_mb = number();
    } else if (arg == "--steps") {
      o.steps = static_cast<int>(number());
    } else if (arg == "--warmup") {
      o.warmup = static_cast<int>(number());
    } else if (arg == "--small-params") {
      o.small_params = static_cast<std::size_t>(number());
    } else if (arg == "--small-floats") {
      o.small_floats = static_cast<std::size_t>(number());
    } else if (arg == "--mlp") {
      o.mlp.clear();
      const std::string v = value();
      for (const std::string& part : comma_list(v)) {
        char* stop = nullptr;
        const unsigned long width = std::strtoul(part.c_str(), &stop, 10);
        if (part.empty() || *stop != '\0' || width == 0)
          usage("--mlp " + v + ": widths are numbers >= 1, separated by commas");
        o.mlp.push_back(width);
      }
      if (o.mlp.size() < 2) usage("--mlp " + v + " needs two widths at least (inputs,outputs)");
    } else if (arg == "--solo-compute-us") {
      o.solo_compute_us = number();
    } else if (arg == "--tables") {
      o.tables = value();
      for (const std::string& t : comma_list(o.tables)) {
        if (t != "overlap" && t != "buckets" && t != "handoff" && t != "solo")
          usage("--tables " + o.tables + ": the tables are overlap, buckets, handoff, solo");
      }
    } else if (arg.starts_with("--local-rank") || arg.starts_with("--local_rank")) {
      if (arg.find('=') == std::string_view::npos) ++i;  // the launcher's, read by dtrain
    } else {
      usage("unknown argument " + std::string(arg));
    }
  }
  if (o.layers < 1 || o.floats < 2 || o.steps < 1 || o.small_params < 1 || o.small_floats < 1) {
    usage("--layers, --steps, --small-params and --small-floats must be >= 1, --floats >= 2");
  }
  return o;
}

// A layer's backward: sleeping (a GPU at work, the CPU free) or spinning on
// dependent arithmetic calibrated once, before any communication thread runs.
class compute_model {
 public:
  explicit compute_model(bool spin) : spin_(spin) {
    if (!spin_) return;
    constexpr long probe = 2'000'000;
    std::vector<double> rates;
    for (int i = 0; i < 7; ++i) {
      const auto start = steady::now();
      arithmetic(probe);
      const double us = std::chrono::duration<double, std::micro>(steady::now() - start).count();
      rates.push_back(static_cast<double>(probe) / us);
    }
    std::ranges::sort(rates);
    iterations_per_us_ = rates[rates.size() / 2];
  }

  void run(double us) const {
    if (us <= 0) return;
    if (spin_) {
      arithmetic(static_cast<long>(us * iterations_per_us_));
    } else {
      std::this_thread::sleep_until(steady::now() + std::chrono::duration<double, std::micro>(us));
    }
  }

  // The arithmetic ran `factor` times too fast (under 1: too slow) for the time asked.
  void rescale(double factor) noexcept { iterations_per_us_ *= factor; }
  [[nodiscard]] bool spin() const noexcept { return spin_; }
  [[nodiscard]] double iterations_per_us() const noexcept { return iterations_per_us_; }

 private:
  static void arithmetic(long iterations) {
    double x = 1.0;
    for (long i = 0; i < iterations; ++i) x = x * 0.999999937 + 1e-7;  // a dependent chain
    sink_ = x;
  }
  static inline volatile double sink_ = 0;
  bool spin_;
  double iterations_per_us_ = 0;
};

// L parameters of P floats; gradients are pointers DDP points into its buckets.
struct layered_model {
  std::vector<std::vector<float>> weights;
  std::vector<float*> gradients;  // sized once: DDP keeps the addresses of these slots

  layered_model(std::size_t layers, std::size_t floats)
      : weights(layers, std::vector<float>(floats, 0.5f)), gradients(layers, nullptr) {}

  std::vector<dtrain::parameter> parameters() {
    std::vector<dtrain::parameter> out;
    out.reserve(weights.size());
    for (std::size_t i = 0; i < weights.size(); ++i) {
      out.push_back(
          dtrain::param("layer" + std::to_string(i) + ".weight", weights[i], gradients[i]));
    }
    return out;
  }

  // The backward's own writes: two elements, a known value per rank and layer
  // (the rest of the gradient stays as the last reduction left it).
  void write_gradient(std::size_t layer, int rank) {
    const float v = static_cast<float>(rank + 1) + static_cast<float>(layer);
    gradients[layer][0] = v;
    gradients[layer][weights[layer].size() - 1] = v;
  }

  // After a synchronized step: is every gradient the mean over ranks?
  [[nodiscard]] bool averaged(int size) const {
    for (std::size_t l = 0; l < weights.size(); ++l) {
      const float expected = static_cast<float>(size + 1) / 2.0f + static_cast<float>(l);
      if (gradients[l][0] != expected || gradients[l][weights[l].size() - 1] != expected)
        return false;
    }
    return true;
  }
};

// An MLP's parameters without its arithmetic: weights (out x in) and biases,
// fc1 first; gradients start in storage of the model's own.
struct shaped_model {
  std::vector<std::string> names;
  std::vector<std::vector<float>> values, own;
  std::vector<float*> gradients;  // sized once: DDP keeps the addresses of these slots

  explicit shaped_model(const std::vector<std::size_t>& widths) {
    for (std::size_t l = 0; l + 1 < widths.size(); ++l) {
      add("fc" + std::to_string(l + 1) + ".weight", widths[l] * widths[l + 1]);
      add("fc" + std::to_string(l + 1) + ".bias", widths[l + 1]);
    }
    for (std::size_t i = 0; i < values.size(); ++i) gradients.push_back(own[i].data());
  }

  std::vector<dtrain::parameter> parameters() {
    std::vector<dtrain::parameter> out;
    for (std::size_t i = 0; i < values.size(); ++i)
      out.push_back(dtrain::param(names[i], values[i], gradients[i]));
    return out;
  }
  [[nodiscard]] std::size_t layers() const noexcept { return values.size() / 2; }

  // Layer l's backward writes its whole gradient: a known value per rank and parameter.
  void write_layer(std::size_t l, int rank) {
    for (std::size_t i : {2 * l, 2 * l + 1}) {
      const float v = static_cast<float>(rank + 1) + static_cast<float>(i);
      std::fill_n(gradients[i], values[i].size(), v);
    }
  }
  void zero() {
    for (std::size_t i = 0; i < values.size(); ++i)
      std::fill_n(gradients[i], values[i].size(), 0.0f);
  }
  [[nodiscard]] bool averaged(int size) const {
    for (std::size_t i = 0; i < values.size(); ++i) {
      const float expected = static_cast<float>(size + 1) / 2.0f + static_cast<float>(i);
      if (gradients[i][0] != expected || gradients[i][values[i].size() - 1] != expected)
        return false;
    }
    return true;
  }

 private:
  void add(std::string name, std::size_t count) {
    names.push_back(std::move(name));
    values.emplace_back(count, 0.5f);
    own.emplace_back(count, 0.0f);
  }
};

std::string widths_text(const std::vector<std::size_t>& widths) {
  std::string s;
  for (std::size_t w : widths) {
    if (!s.empty()) s += '-';
    s += std::to_string(w);
  }
  return s;
}

double median(std::vector<double> v) {
  std::ranges::sort(v);
  return v[v.size() / 2];
}

template <class Comm>
double slowest(Comm& comm, double mine) {
  double value = mine;
  dtrain::allreduce(comm, std::span<double>(&value, 1), dtrain::reduce_op::max).wait();
  return value;
}

// One step's seconds on the slowest rank, the ranks released together.
template <class Context>
double timed_step(Context& ctx, const std::function<void()>& step) {
  ctx.barrier();
  const auto start = steady::now();
  step();
  return slowest(ctx.communicator(), std::chrono::duration<double>(steady::now() - start).count());
}

// "15 x (1 param, 4096 KiB), 1 x (2 params, 8 KiB)": runs of equal buckets, in launch order.
std::string bucket_layout(const std::vector<dtrain::bucket_info>& buckets) {
  std::string s;
  for (std::size_t b = 0; b < buckets.size();) {
    std::size_t e = b;
    while (e < buckets.size() && buckets[e].parameters.size() == buckets[b].parameters.size() &&
           buckets[e].bytes == buckets[b].bytes) {
      ++e;
    }
    if (!s.empty()) s += ", ";
    s += std::to_string(e - b) + " x (" + std::to_string(buckets[b].parameters.size()) +
         (buckets[b].parameters.size() == 1 ? " param, " : " params, ") +
         std::to_string(buckets[b].bytes >> 10) + " KiB)";
    b = e;
  }
  return s;
}

// The demo's bucket caps (examples/train_mlp.cpp): 16 KiB, the first 4 KiB.
const dtrain::ddp_options demo_caps{.bucket_cap_mb = 16.0 / 1024,
                                    .first_bucket_cap_mb = 4.0 / 1024};

// ---- table 3: the hand-off ---------------------------------------------------
// What DDP adds to the engine: the MLP's gradients marked ready at once, then
// synchronize(), against the raw engine allreduces of the same buckets, one
// after the other on the calling thread (submit, wait), in the same run.
template <class Policy>
bool handoff_table(dtrain::context<Policy>& ctx, const bench_options& o) {
  using ddp_type = dtrain::DistributedDataParallel<shaped_model, Policy>;
  const int rank = ctx.rank();
  shaped_model model(o.mlp);
  ddp_type ddp(ctx, model, demo_caps);
  auto step = [&] {
    for (std::size_t l = model.layers(); l-- > 0;) model.write_layer(l, rank);
    ddp.mark_all_ready();
    ddp.synchronize();
  };
  step();  // the first step rebuilds the buckets
  step();
  std::vector<std::vector<float>> raw;
  for (const dtrain::bucket_info& b : ddp.buckets()) raw.emplace_back(b.count, 1.0f);
  auto engine = [&] {
    for (auto& r : raw)
      dtrain::allreduce(ddp.communicator(), std::span<float>(r), dtrain::reduce_op::avg).wait();
  };
  const bool ok = slowest(ctx.communicator(), model.averaged(ctx.size()) ? 0.0 : 1.0) == 0;
  // Each figure: a block of steps, timed on the slowest rank; the median block.
  constexpr int block = 50;
  auto timed_block = [&](const std::function<void()>& f) {
    return timed_step(ctx,
                      [&] {
                        for (int i = 0; i < block; ++i) f();
                      }) /
           block;
  };
  for (int i = 0; i < 5; ++i) {
    engine();
    step();
  }
  std::vector<double> t_engine, t_ddp;
  for (int round = 0; round < std::max(o.steps, 9); ++round) {
    if (round % 2 == 0) {
      t_engine.push_back(timed_block(engine));
      t_ddp.push_back(timed_block(step));
    } else {
      t_ddp.push_back(timed_block(step));
      t_engine.push_back(timed_block(engine));
    }
  }
  const double engine_s = median(t_engine), ddp_s = median(t_ddp);
  if (ctx.is_main()) {
    std::printf("hand-off: %d ranks, backend %s, a %s MLP, the demo's caps (16 KiB, first 4 KiB)\n",
                ctx.size(), std::string(Policy::backend_type::name).c_str(),
                widths_text(o.mlp).c_str());
    std::printf("buckets: %zu: %s; gradients %s\n", ddp.buckets().size(),
                bucket_layout(ddp.buckets()).c_str(),
                ok ? "the mean over ranks (checked)" : "WRONG (not the mean over ranks)");
    std::printf("time per step: median of %d alternating blocks of %d steps, slowest rank\n",
                std::max(o.steps, 9), block);
    std::printf("%-44s %10s\n", "", "us/step");
    std::printf("%-44s %10.1f\n", "engine allreduces of the buckets, one by one", engine_s * 1e6);
    std::printf("%-44s %10.1f\n", "DDP: mark_all_ready(), synchronize()", ddp_s * 1e6);
    std::printf("DDP / engine = %.3f; goal: at most 1.1\n\n", ddp_s / engine_s);
    std::fflush(stdout);
  }
  return ok;
}

// ---- table 4: world size 1 ---------------------------------------------------
// Each rank alone (a split of one rank): the MLP's backward (spinning CPU
// arithmetic, then each layer's gradient written whole) with DDP marking each
// layer and synchronizing, against the same loop without DDP.
template <class Policy>
bool solo_table(dtrain::context<Policy>& ctx, const bench_options& o) {
  using ddp_type = dtrain::DistributedDataParallel<shaped_model, Policy>;
  const int rank = ctx.rank();
  auto alone = ctx.communicator().split(rank, 0);
  compute_model compute(true);
  shaped_model plain(o.mlp), model(o.mlp);
  ddp_type ddp(alone, model, demo_caps);
  const std::size_t layers = model.layers();
  double layer_us = o.solo_compute_us / static_cast<double>(layers);
  auto without = [&] {
    for (std::size_t l = layers; l-- > 0;) {
      compute.run(layer_us);
      plain.write_layer(l, rank);
    }
    plain.zero();
  };
  auto with = [&] {
    for (std::size_t l = layers; l-- > 0;) {
      compute.run(layer_us);
      model.write_layer(l, rank);
      ddp.mark_ready({2 * l, 2 * l + 1});
    }
    ddp.synchronize();
    ddp.zero_grad();
  };
  const int block = std::max(1, static_cast<int>(20'000 / std::max(o.solo_compute_us, 1.0)));
  auto timed_block = [&](const std::function<void()>& f) {
    const auto start = steady::now();
    for (int i = 0; i < block; ++i) f();
    return std::chrono::duration<double>(steady::now() - start).count() / block;
  };
  for (int i = 0; i < 3; ++i) {
    without();
    with();
  }
  // The step's gradients, once more, as DDP leaves them at world size 1: untouched.
  for (std::size_t l = layers; l-- > 0;) {
    model.write_layer(l, rank);
    ddp.mark_ready({2 * l, 2 * l + 1});
  }
  ddp.synchronize();
  bool ok = true;
  for (std::size_t i = 0; i < model.values.size(); ++i) {
    const float expected = static_cast<float>(rank + 1) + static_cast<float>(i);
    ok = ok && model.gradients[i][0] == expected;
  }
  ddp.zero_grad();
  std::vector<double> t_without, t_with;
  const int rounds = std::max(o.steps, 15);
  for (int round = 0; round < rounds; ++round) {
    if (round % 2 == 0) {
      t_without.push_back(timed_block(without));
      t_with.push_back(timed_block(with));
    } else {
      t_with.push_back(timed_block(with));
      t_without.push_back(timed_block(without));
    }
  }
  const double without_s = median(t_without), with_s = median(t_with);
  const double mine = (with_s - without_s) / without_s;
  const double worst = slowest(ctx.communicator(), mine);
  // The same two loops without the arithmetic: DDP's own cost per step, in
  // absolute terms, free of the compute's noise (which is ~1% on a shared machine).
  const double compute_layer_us = layer_us;
  layer_us = 0;
  std::vector<double> bare_without, bare_with;
  for (int round = 0; round < rounds; ++round) {
    bare_without.push_back(timed_block(without));
    bare_with.push_back(timed_block(with));
  }
  layer_us = compute_layer_us;
  const double own_s = median(bare_with) - median(bare_without);
  ok = slowest(ctx.communicator(), ok ? 0.0 : 1.0) == 0;
  if (ctx.is_main()) {
    std::printf(
        "world size 1: every rank alone (a split of one rank), backend %s, a %s MLP, the demo's "
        "caps\n",
        std::string(Policy::backend_type::name).c_str(), widths_text(o.mlp).c_str());
    std::printf("a step: %.0f us of CPU arithmetic, each layer's gradient written whole; %s\n",
                o.solo_compute_us,
                ok ? "gradients untouched by DDP (checked)" : "gradients CHANGED by DDP (wrong)");
    std::printf("time per step: median of %d alternating blocks of %d steps (rank 0)\n", rounds,
                block);
    std::printf("%-44s %10s %10s\n", "", "us/step", "overhead");
    std::printf("%-44s %10.2f %10s\n", "the loop without DDP", without_s * 1e6, "-");
    std::printf("%-44s %10.2f %9.2f%%\n", "DDP: mark_ready per layer, synchronize()", with_s * 1e6,
                mine * 100);
    std::printf("%-44s %10.2f %10s\n", "  the same loops without arithmetic: without",
                median(bare_without) * 1e6, "");
    std::printf("%-44s %10.2f %9.2f%%\n", "  with DDP (DDP's own cost per step)",
                median(bare_with) * 1e6, own_s / without_s * 100);
    std::printf(
        "goal: DDP at most 1%% over the loop without it; measured %.2f%% (worst rank %.2f%%; "
        "timing noise between blocks is about 1%% here); DDP's own cost %.2f us a step = "
        "%.2f%% of it\n",
        mine * 100, worst * 100, own_s * 1e6, own_s / without_s * 100);
    std::fflush(stdout);
  }
  return ok;
}

template <class Policy>
int bench(dtrain::context<Policy>& ctx, const bench_options& o) {
  using ddp_type = dtrain::DistributedDataParallel<layered_model, Policy>;
  const int rank = ctx.rank();
  const int size = ctx.size();
  const bool main = ctx.is_main();
  compute_model compute(o.spin);
  const std::size_t layers = o.layers;

  bool ok = true;
  // ---- table 1: overlap -----------------------------------------------------
  if (o.wants("overlap")) {
    layered_model model_on(layers, o.floats), model_off(layers, o.floats);
    const dtrain::ddp_options caps{.bucket_cap_mb = o.bucket_cap_mb,
                                   .first_bucket_cap_mb = o.first_bucket_cap_mb};
    dtrain::ddp_options no_overlap = caps;
    no_overlap.overlap = false;
    ddp_type ddp_on(ctx, model_on, caps);
    ddp_type ddp_off(ctx, model_off, no_overlap);

    std::vector<std::size_t> all(layers);
    std::iota(all.rbegin(), all.rend(), std::size_t{0});  // L-1, ..., 0: the backward's order
    double layer_us = 0;
    auto backward = [&](layered_model& m, ddp_type* ddp) {
      for (std::size_t l = layers; l-- > 0;) {
        compute.run(layer_us);
        m.write_gradient(l, rank);
        if (ddp) ddp->mark_ready(l);
      }
    };
    auto compute_only = [&] { backward(model_on, nullptr); };
    auto communication = [&] {
      for (std::size_t l = 0; l < layers; ++l) model_on.write_gradient(l, rank);
      ddp_on.mark_ready(all);
      ddp_on.synchronize();
    };
    auto step_on = [&] {
      backward(model_on, &ddp_on);
      ddp_on.synchronize();
    };
    auto step_off = [&] {
      backward(model_off, &ddp_off);
      ddp_off.synchronize();
    };

    // Warm-up (the first steps rebuild the buckets), then check the averages once.
    for (int i = 0; i < std::max(o.warmup, 1); ++i) {
      step_on();
      step_off();
      communication();
    }
    step_on();
    step_off();
    const bool averaged =
        slowest(ctx.communicator(),
                model_on.averaged(size) && model_off.averaged(size) ? 0.0 : 1.0) == 0;

    std::vector<double> probe;
    for (int i = 0; i < std::max(o.steps, 5); ++i) probe.push_back(timed_step(ctx, communication));
    const double comm_probe = median(probe);
    const bool auto_compute = o.compute_us < 0;
    layer_us = auto_compute ? comm_probe * 1e6 / static_cast<double>(layers) : o.compute_us;
    std::vector<double> t_compute, t_comm, t_on, t_off;
    const std::function<void()> kinds[4] = {compute_only, communication, step_on, step_off};
    std::vector<double>* results[4] = {&t_compute, &t_comm, &t_on, &t_off};
    // A loaded machine can change the communication time between the probe and
    // the rounds: then the rounds are measured once more, calibrated on them.
    int calibrations = 0;
    for (;;) {
      ++calibrations;
      step_on();  // one untimed step at the chosen compute
      step_off();
      for (auto* r : results) r->clear();
      for (int round = 0; round < o.steps; ++round) {
        for (int k = 0; k < 4; ++k) {
          const int kind = (round + k) % 4;
          results[kind]->push_back(timed_step(ctx, kinds[kind]));
        }
      }
      if (calibrations == 3) break;
      bool again = false;
      // Spinning: other load on the cores slows the arithmetic down after its calibration.
      const double wanted = layer_us * static_cast<double>(layers) * 1e-6;
      if (compute.spin() && wanted > 0 && std::abs(median(t_compute) - wanted) > 0.3 * wanted) {
        compute.rescale(wanted / median(t_compute));  // the same on every rank
        again = true;
      }
      const double measured = median(t_comm) * 1e6 / static_cast<double>(layers);
      if (auto_compute && std::abs(measured - layer_us) > 0.3 * measured) {
        layer_us = measured;
        again = true;
      }
      if (!again) break;
    }
    if (std::getenv("DDP_OVERLAP_DEBUG") && main) {
      for (auto* v : {&probe, &t_compute, &t_comm, &t_on, &t_off}) {
        for (double t : *v) std::printf("%.1f ", t * 1e3);
        std::printf("\n");
      }
    }
    const double compute_s = median(t_compute), comm_s = median(t_comm), on_s = median(t_on),
                 off_s = median(t_off);
    const double exposed_on = (on_s - compute_s) / comm_s,
                 exposed_off = (off_s - compute_s) / comm_s;

    if (main) {
      const double layer_mib = static_cast<double>(o.floats * sizeof(float)) / (1 << 20);
      std::printf(
          "DDP overlap: %d ranks, backend %s, %zu layers x %zu float32 (%.1f MiB each, %.1f MiB in "
          "all)\n",
          size, std::string(Policy::backend_type::name).c_str(), layers, o.floats, layer_mib,
          layer_mib * static_cast<double>(layers));
      std::printf("buckets: %zu (bucket_cap_mb %g, first_bucket_cap_mb %g): %s\n",
                  ddp_on.buckets().size(), o.bucket_cap_mb, o.first_bucket_cap_mb,
                  bucket_layout(ddp_on.buckets()).c_str());
      if (compute.spin()) {
        std::printf(
            "compute: spin (CPU arithmetic, %.0f iterations/us; competes with the communication "
            "threads for the cores)\n",
            compute.iterations_per_us());
      } else {
        std::printf("compute: sleep (models a GPU computing while the CPU is free)\n");
      }
      std::printf("per-layer compute: %.0f us (%s)\n", layer_us,
                  auto_compute ? "auto: communication / layers, so compute ~ communication"
                               : "--compute-us");
      if (auto_compute) {
        std::printf("  calibrated on communication = %.2f ms (median of %zu steps)%s\n",
                    comm_probe * 1e3, probe.size(), calibrations > 1 ? " at first" : "");
      }
      if (calibrations > 1) {
        std::printf(
            "  measured %d times: the compute or the communication of a pass was over 30%% "
            "off its calibration, so the next pass was recalibrated on it (the last is shown)\n",
            calibrations);
      }
      std::printf("gradients after a step: %s\n",
                  averaged ? "the mean over ranks (checked)" : "WRONG (not the mean over ranks)");
      std::printf(
          "time per step: median of %d interleaved rounds after %d warm-up steps, slowest rank\n",
          o.steps, o.warmup);
      std::printf("%-34s %10s %9s\n", "", "ms/step", "exposed");
      std::printf("%-34s %10.2f %9s\n",
                  compute.spin() ? "compute only (spin)" : "compute only (sleep)", compute_s * 1e3,
                  "");
      std::printf("%-34s %10.2f %9s\n", "communication only (all ready)", comm_s * 1e3, "");
      std::printf("%-34s %10.2f %9.3f\n", "step, overlap on", on_s * 1e3, exposed_on);
      std::printf("%-34s %10.2f %9.3f\n", "step, overlap off", off_s * 1e3, exposed_off);
      std::printf(
          "exposed = (step - compute) / communication; goal with overlap on: <= 0.25, measured "
          "%.3f "
          "(off: %.3f)\n\n",
          exposed_on, exposed_off);
      std::fflush(stdout);
    }

    ok = ok && averaged;
  }

  // ---- table 2: one allreduce per parameter vs buckets -----------------------
  if (o.wants("buckets")) {
    layered_model small(o.small_params, o.small_floats);
    std::vector<std::vector<float>> raw(o.small_params, std::vector<float>(o.small_floats, 1.0f));
    ddp_type ddp(ctx, small, dtrain::ddp_options{});
    std::vector<std::size_t> order(o.small_params);
    std::iota(order.rbegin(), order.rend(), std::size_t{0});
    auto per_parameter = [&] {
      for (std::size_t i : order) {
        dtrain::allreduce(ctx.communicator(), std::span<float>(raw[i]), dtrain::reduce_op::avg)
            .wait();
      }
    };
    auto bucketed = [&] {
      for (std::size_t i : order) small.write_gradient(i, rank);
      ddp.mark_ready(order);
      ddp.synchronize();
    };
    for (int i = 0; i < std::max(o.warmup, 1); ++i) {
      per_parameter();
      bucketed();
    }
    const bool small_ok = slowest(ctx.communicator(), small.averaged(size) ? 0.0 : 1.0) == 0;
    ok = ok && small_ok;
    std::vector<double> t_raw, t_bucket;
    for (int round = 0; round < o.steps; ++round) {
      if (round % 2 == 0) {
        t_raw.push_back(timed_step(ctx, per_parameter));
        t_bucket.push_back(timed_step(ctx, bucketed));
      } else {
        t_bucket.push_back(timed_step(ctx, bucketed));
        t_raw.push_back(timed_step(ctx, per_parameter));
      }
    }
    const double raw_s = median(t_raw), bucket_s = median(t_bucket);
    if (main) {
      std::printf(
          "bucketing: %d ranks, backend %s, %zu parameters x %zu float32 (%.1f KiB in all)\n", size,
          std::string(Policy::backend_type::name).c_str(), o.small_params, o.small_floats,
          static_cast<double>(o.small_params * o.small_floats * sizeof(float)) / 1024);
      std::printf("DDP with default caps (25 MiB, first 1 MiB): %zu bucket(s); gradients %s\n",
                  ddp.buckets().size(),
                  small_ok ? "the mean over ranks (checked)" : "WRONG (not the mean over ranks)");
      std::printf("time per step: median of %d alternating rounds, slowest rank\n", o.steps);
      std::printf("%-34s %10s %10s\n", "", "ms/step", "us/param");
      std::printf("%-34s %10.2f %10.2f\n", "one allreduce per parameter", raw_s * 1e3,
                  raw_s * 1e6 / static_cast<double>(o.small_params));
      std::printf("%-34s %10.2f %10.2f\n", "DDP buckets", bucket_s * 1e3,
                  bucket_s * 1e6 / static_cast<double>(o.small_params));
      std::printf("per-parameter / buckets = %.1fx; goal: buckets >= 5x faster, measured %.1fx\n",
                  raw_s / bucket_s, raw_s / bucket_s);
      std::fflush(stdout);
    }
  }
  if (o.wants("handoff")) ok = handoff_table(ctx, o) && ok;
  if (o.wants("solo")) ok = solo_table(ctx, o) && ok;
  return ok ? 0 : 1;
}

#if DTRAIN_HAS_NCCL()
// ---- --backend nccl: DDP's overhead on one GPU -------------------------------

// L layers of P float32 on GPU 0; gradients are device pointers DDP points into its buckets.
struct device_layered_model {
  std::vector<float*> weights, gradients, owned;

  device_layered_model(std::size_t layers, std::size_t floats)
      : weights(layers), gradients(layers), floats_(floats) {
    for (std::size_t i = 0; i < layers; ++i) {
      DTRAIN_CUDA_CHECK(cudaMalloc(&weights[i], floats * sizeof(float)));
      DTRAIN_CUDA_CHECK(cudaMalloc(&gradients[i], floats * sizeof(float)));
      DTRAIN_CUDA_CHECK(cudaMemset(weights[i], 0, floats * sizeof(float)));
      DTRAIN_CUDA_CHECK(cudaMemset(gradients[i], 0, floats * sizeof(float)));
      owned.push_back(weights[i]);
      owned.push_back(gradients[i]);
    }
  }
  device_layered_model(const device_layered_model&) = delete;
  device_layered_model& operator=(const device_layered_model&) = delete;
  ~device_layered_model() {
    for (float* p : owned) (void)cudaFree(p);
  }

  std::vector<dtrain::parameter> parameters() {
    std::vector<dtrain::parameter> out;
    for (std::size_t i = 0; i < weights.size(); ++i) {
      out.push_back(dtrain::device_param("layer" + std::to_string(i) + ".weight", weights[i],
                                         gradients[i], floats_, 0));
    }
    return out;
  }

 private:
  std::size_t floats_;
};

int bench_nccl(const bench_options& o) {
  using namespace std::chrono_literals;
  int devices = 0;
  const cudaError_t found = cudaGetDeviceCount(&devices);
  if (found != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (%s)\n",
                found != cudaSuccess ? cudaGetErrorString(found) : "cudaGetDeviceCount found 0");
    return 77;
  }
  DTRAIN_CUDA_CHECK(cudaSetDevice(0));
  using policy = dtrain::policy<dtrain::launch::per_process, dtrain::backend::nccl>;
  using store_type = dtrain::prefix_store<dtrain::store_client>;
  dtrain::store_server server("127.0.0.1", 0, {.timeout = 60s, .log = [](std::string_view) {}});
  dtrain::store_client client("127.0.0.1", server.port(), {.timeout = 60s});
  store_type store(client, "ddp-overlap");
  dtrain::store_channel<store_type> channel(store, 0, 1);
  dtrain::nccl_communicator comm(store, 0, 1, 0, {});

  // The compute stream outlives the DDPs below (their destructors use it).
  struct owned_stream {
    owned_stream() { DTRAIN_CUDA_CHECK(cudaStreamCreateWithFlags(&get, cudaStreamNonBlocking)); }
    owned_stream(const owned_stream&) = delete;
    owned_stream& operator=(const owned_stream&) = delete;
    ~owned_stream() { (void)cudaStreamDestroy(get); }
    cudaStream_t get = nullptr;
  } owned;
  cudaStream_t stream = owned.get;
  // A layer's backward: copies of a 64 MiB scratch buffer, as many as fit in --compute-us.
  constexpr std::size_t scratch_bytes = std::size_t{64} << 20;
  void* scratch[2] = {nullptr, nullptr};
  DTRAIN_CUDA_CHECK(cudaMalloc(&scratch[0], scratch_bytes));
  DTRAIN_CUDA_CHECK(cudaMalloc(&scratch[1], scratch_bytes));
  cudaEvent_t begin = nullptr, end = nullptr;
  DTRAIN_CUDA_CHECK(cudaEventCreate(&begin));
  DTRAIN_CUDA_CHECK(cudaEventCreate(&end));
  auto copy = [&] {
    DTRAIN_CUDA_CHECK(
        cudaMemcpyAsync(scratch[1], scratch[0], scratch_bytes, cudaMemcpyDeviceToDevice, stream));
  };
  std::vector<double> copy_us;
  for (int i = 0; i < 9; ++i) {
    DTRAIN_CUDA_CHECK(cudaEventRecord(begin, stream));
    copy();
    DTRAIN_CUDA_CHECK(cudaEventRecord(end, stream));
    DTRAIN_CUDA_CHECK(cudaEventSynchronize(end));
    float ms = 0;
    DTRAIN_CUDA_CHECK(cudaEventElapsedTime(&ms, begin, end));
    copy_us.push_back(static_cast<double>(ms) * 1e3);
  }
  const double one_copy_us = median(copy_us);
  const double compute_us = o.compute_us >= 0 ? o.compute_us : 1000.0;
  const int copies = std::max(1, static_cast<int>(std::lround(compute_us / one_copy_us)));

  device_layered_model model(o.layers, o.floats), model_off(o.layers, o.floats);
  using ddp_type = dtrain::DistributedDataParallel<device_layered_model, policy>;
  ddp_type ddp(comm, dtrain::control_plane(channel), model,
               {.bucket_cap_mb = o.bucket_cap_mb, .first_bucket_cap_mb = o.first_bucket_cap_mb});
  ddp_type ddp_off(comm, dtrain::control_plane(channel), model_off,
                   {.bucket_cap_mb = o.bucket_cap_mb,
                    .first_bucket_cap_mb = o.first_bucket_cap_mb,
                    .overlap = false});
  ddp.set_stream(stream);
  ddp_off.set_stream(stream);

  auto backward = [&](ddp_type* d) {
    for (std::size_t l = o.layers; l-- > 0;) {
      for (int c = 0; c < copies; ++c) copy();
      if (d) d->mark_ready(l);
    }
    if (d) d->synchronize(stream);
    DTRAIN_CUDA_CHECK(cudaStreamSynchronize(stream));
  };
  auto timed = [&](ddp_type* d) {
    const auto start = steady::now();
    backward(d);
    return std::chrono::duration<double>(steady::now() - start).count();
  };
  for (int i = 0; i < std::max(o.warmup, 2); ++i) {  // the first step rebuilds the buckets
    backward(nullptr);
    backward(&ddp);
    backward(&ddp_off);
  }
  std::vector<double> t_plain, t_ddp, t_off;
  for (int round = 0; round < o.steps; ++round) {
    switch (round % 3) {  // the order rotates, so that drift hits every row alike
      case 0:
        t_plain.push_back(timed(nullptr));
        t_ddp.push_back(timed(&ddp));
        t_off.push_back(timed(&ddp_off));
        break;
      case 1:
        t_ddp.push_back(timed(&ddp));
        t_off.push_back(timed(&ddp_off));
        t_plain.push_back(timed(nullptr));
        break;
      default:
        t_off.push_back(timed(&ddp_off));
        t_plain.push_back(timed(nullptr));
        t_ddp.push_back(timed(&ddp));
        break;
    }
  }
  const double plain = median(t_plain), with = median(t_ddp), off = median(t_off);
  cudaDeviceProp prop{};
  DTRAIN_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("DDP over NCCL on one GPU (%s), world size 1: %zu layers x %zu float32 (%.1f MiB)\n",
              prop.name, o.layers, o.floats,
              static_cast<double>(o.layers * o.floats * sizeof(float)) / (1 << 20));
  std::printf(
      "a layer's backward: %d copies of 64 MiB on the compute stream (%.0f us each; "
      "%.0f us asked)\n",
      copies, one_copy_us, compute_us);
  std::printf("buckets: %zu (%s); time per step: median of %d rotating rounds\n",
              ddp.buckets().size(), bucket_layout(ddp.buckets()).c_str(), o.steps);
  std::printf("%-34s %10s %10s\n", "", "ms/step", "overhead");
  std::printf("%-34s %10.3f %10s\n", "backward without DDP", plain * 1e3, "-");
  std::printf("%-34s %10.3f %9.2f%%\n", "DDP, overlap on", with * 1e3,
              (with - plain) / plain * 100);
  std::printf("%-34s %10.3f %9.2f%%\n", "DDP, overlap off", off * 1e3, (off - plain) / plain * 100);
  std::printf("goal: DDP (overlap on) at most 2%% over the loop without it; measured %.2f%%\n",
              (with - plain) / plain * 100);
  std::fflush(stdout);
  DTRAIN_CUDA_CHECK(cudaEventDestroy(begin));
  DTRAIN_CUDA_CHECK(cudaEventDestroy(end));
  DTRAIN_CUDA_CHECK(cudaFree(scratch[0]));
  DTRAIN_CUDA_CHECK(cudaFree(scratch[1]));
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const bench_options o = parse(argc, argv);
  std::string backend = o.backend;
  if (backend.empty()) {
    const bool under_mpirun =
        std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
    backend = under_mpirun && DTRAIN_HAS_MPI() ? "mpi" : "gloo";
  }
  if (backend == "nccl") {
#if DTRAIN_HAS_NCCL()
    try {
      return bench_nccl(o);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ddp_overlap: %s\n", e.what());
      return 1;
    }
#else
    usage("this build has no NCCL (DTRAIN_WITH_NCCL is OFF)");
#endif
  }
  if (backend == "mpi") {
#if DTRAIN_HAS_MPI()
    using mpi_policy = dtrain::policy<dtrain::launch::per_process, dtrain::backend::mpi>;
    return dtrain::run<mpi_policy>(argc, argv,
                                   [&](dtrain::context<mpi_policy>& ctx) { return bench(ctx, o); });
#else
    usage("this build has no MPI (DTRAIN_WITH_MPI is OFF)");
#endif
  }
#if DTRAIN_HAS_GLOO()
  using gloo_policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>;
  return dtrain::run<gloo_policy>(argc, argv,
                                  [&](dtrain::context<gloo_policy>& ctx) { return bench(ctx, o); },
                                  {.agent = {.nproc_per_node = 2}});
#else
  usage("this build has no Gloo (DTRAIN_WITH_GLOO is OFF)");
#endif
}
