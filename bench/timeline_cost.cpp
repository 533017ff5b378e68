// bench/timeline_cost: what DistributedDataParallel's timeline (DTRAIN_TIMELINE,
// ddp_options::timeline) costs, measured against the same DDP without it in
// the same run (DESIGN.md, Performance model). Run as 2 ranks:
//
//   build/bench/timeline_cost [--params N] [--floats P] [--steps S] [--marks M]
//     (a node agent that starts 2 Gloo workers; DTRAIN_NPROC_PER_NODE=N for N)
//
// Two DDP objects over the same model shape, one recording (ddp_options::timeline
// into $TMPDIR), one not; DTRAIN_TIMELINE must be unset (it would turn both on).
//   mark_ready alone   M calls of mark_ready inside no_sync(): nothing is sent,
//                      so this is the recording cost per call with no noise
//                      from communication (median over rounds);
//   DDP step           N parameters of P float32 marked one by one, then
//                      synchronize(): median of S steps each, on and off
//                      interleaved (the order alternates), slowest rank;
//   write              the time to write the file at the end, and its size.
// Ratios (on / off) are the figures; timings never fail the run.
//
// Then the straggler watch (ddp_options::stragglers, on by default; issue 51):
// steps of --compute-ms of "compute" (a sleep: a GPU computing while the CPU is
// free) then the marks and synchronize(), with the watch off, automatic (the
// default) and exchanging every step, interleaved; the mean of S steps each,
// slowest rank; the added time as a share of the step (goal: at most 1 %).
// The timeline's DDPs above have the watch off.

#include <dtrain/dtrain.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace {

using steady = std::chrono::steady_clock;
using policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>;

struct bench_options {
  std::size_t params = 200;
  std::size_t floats = 256;
  int steps = 200;
  std::size_t marks = 100000;
  int compute_ms = 10;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "timeline_cost: %s\nusage: timeline_cost [--params N] [--floats P] [--steps S] "
               "[--marks M] [--compute-ms C]\n",
               why.c_str());
  std::exit(2);
}

bench_options parse(int argc, char** argv) {
  bench_options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.starts_with("--local-rank") || arg.starts_with("--local_rank")) {
      if (arg.find('=') == std::string_view::npos) ++i;  // the launcher's, read by dtrain
      continue;
    }
    if (i + 1 >= argc) usage(std::string(arg) + " needs a value");
    const std::string v = argv[++i];
    char* end = nullptr;
    const unsigned long long n = std::strtoull(v.c_str(), &end, 10);
    if (end == v.c_str() || *end != '\0' || n < 1) usage(arg.data() + (" " + v) + " is not >= 1");
    if (arg == "--params") {
      o.params = n;
    } else if (arg == "--floats") {
      o.floats = n;
    } else if (arg == "--steps") {
      o.steps = static_cast<int>(n);
    } else if (arg == "--marks") {
      o.marks = n;
    } else if (arg == "--compute-ms") {
      o.compute_ms = static_cast<int>(n);
    } else {
      usage("unknown argument " + std::string(arg));
    }
  }
  return o;
}

struct flat_model {
  std::vector<std::vector<float>> weights;
  std::vector<float*> gradients;  // sized once: DDP keeps the addresses of these slots

  flat_model(std::size_t n, std::size_t floats)
      : weights(n, std::vector<float>(floats, 0.5f)), gradients(n, nullptr) {}

  std::vector<dtrain::parameter> parameters() {
    std::vector<dtrain::parameter> out;
    for (std::size_t i = 0; i < weights.size(); ++i) {
      std::string name = "p";  // not "p" + to_string(i): GCC 12's -Wrestrict false positive
      name += std::to_string(i);
      out.push_back(dtrain::param(std::move(name), weights[i], gradients[i]));
    }
    return out;
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// The straggler watch's cost: `off` (the watch off) against the same model
/// with it automatic and every step, each step after --compute-ms of sleep.
template <class DDP, class Model, class Step>
int stragglers(dtrain::context<policy>& ctx, const bench_options& o, DDP& off, const Model&,
               Step& step) {
  Model model_auto(o.params, o.floats), model_every(o.params, o.floats);
  DDP automatic(ctx, model_auto);
  DDP every(ctx, model_every, {.stragglers = {.every = 1}});
  const auto compute = std::chrono::milliseconds(o.compute_ms);
  auto timed = [&](DDP& d) {
    std::this_thread::sleep_for(compute);
    return step(d) + std::chrono::duration<double>(compute).count();
  };
  for (int i = 0; i < 3; ++i) {
    step(automatic);
    step(every);
  }
  std::vector<double> t_off, t_auto, t_every;
  for (int s = 0; s < o.steps; ++s) {  // the order turns, so that none always goes first
    DDP* order[3] = {&off, &automatic, &every};
    std::vector<double>* into[3] = {&t_off, &t_auto, &t_every};
    for (int k = 0; k < 3; ++k) {
      const int i = (k + s) % 3;
      into[i]->push_back(timed(*order[i]));
    }
  }
  if (ctx.is_main()) {
    // The mean, not the median: an exchange every few steps is in the mean only.
    auto mean = [](const std::vector<double>& v) {
      double sum = 0;
      for (double x : v) sum += x;
      return sum / static_cast<double>(v.size());
    };
    const double base = mean(t_off) * 1e3;
    std::printf(
        "\nstraggler watch, Gloo, %d ranks: steps of %d ms of compute (a sleep), then the "
        "marks and synchronize(); mean of %d steps, slowest rank\n",
        ctx.size(), o.compute_ms, o.steps);
    std::printf(
        "| watch | exchanges | step | added | share of the step |\n| --- | ---: | ---: | ---: | ---: |\n");
    std::printf("| off | 0 | %.3f ms | | |\n", base);
    const std::pair<const char*, std::pair<DDP*, std::vector<double>*>> rows[] = {
        {"automatic (the default)", {&automatic, &t_auto}}, {"every step", {&every, &t_every}}};
    for (const auto& [name, row] : rows) {
      const double t = mean(*row.second) * 1e3;
      const dtrain::straggler_figures f = row.first->stragglers();
      std::printf("| %s (every %zu) | %llu | %.3f ms | %+.3f ms | %+.2f %% |\n", name, f.every,
                  static_cast<unsigned long long>(f.exchanges), t, t - base,
                  (t - base) / base * 100);
    }
    std::fflush(stdout);
  }
  return 0;
}

int bench(dtrain::context<policy>& ctx, const bench_options& o) {
  if (std::getenv("DTRAIN_TIMELINE") != nullptr) {
    std::fprintf(stderr, "timeline_cost: unset DTRAIN_TIMELINE (it would turn both DDPs on)\n");
    return 2;
  }
  const std::filesystem::path dir = std::filesystem::temp_directory_path();
  const std::string trace = (dir / "dtrain_timeline_cost.json").string();
  flat_model model_on(o.params, o.floats), model_off(o.params, o.floats);
  using ddp_type = dtrain::DistributedDataParallel<flat_model, policy>;
  ddp_type on(ctx, model_on, {.timeline = trace, .stragglers = {.enabled = false}});
  ddp_type off(ctx, model_off, {.stragglers = {.enabled = false}});
  auto& comm = ctx.communicator();

  auto step = [&](ddp_type& d) {
    const auto start = steady::now();
    for (std::size_t i = o.params; i-- > 0;) d.mark_ready(i);
    d.synchronize();
    double t = std::chrono::duration<double>(steady::now() - start).count();
    dtrain::allreduce(comm, std::span<double>(&t, 1), dtrain::reduce_op::max).wait();
    return t;
  };
  // mark_ready under no_sync(): only bookkeeping and (on) recording.
  auto marks = [&](ddp_type& d) {
    auto guard = d.no_sync();
    const auto start = steady::now();
    for (std::size_t k = 0; k < o.marks; ++k) d.mark_ready(k % o.params);
    return std::chrono::duration<double>(steady::now() - start).count() /
           static_cast<double>(o.marks);
  };

  for (int i = 0; i < 3; ++i) {  // the first step rebuilds the buckets
    step(on);
    step(off);
  }
  std::vector<double> mark_on, mark_off, step_on, step_off;
  for (int round = 0; round < 5; ++round) {
    if (round % 2 == 0) {
      mark_on.push_back(marks(on));
      mark_off.push_back(marks(off));
    } else {
      mark_off.push_back(marks(off));
      mark_on.push_back(marks(on));
    }
  }
  for (int s = 0; s < o.steps; ++s) {
    if (s % 2 == 0) {
      step_on.push_back(step(on));
      step_off.push_back(step(off));
    } else {
      step_off.push_back(step(off));
      step_on.push_back(step(on));
    }
  }
  const auto write_start = steady::now();
  on.flush_timeline();
  const double write_s = std::chrono::duration<double>(steady::now() - write_start).count();
  const std::string file = dtrain::detail::timeline_file(trace, ctx.rank());
  const auto bytes = std::filesystem::file_size(file);
  std::filesystem::remove(file);

  if (ctx.is_main()) {
    const double m_on = median(mark_on) * 1e9, m_off = median(mark_off) * 1e9;
    const double s_on = median(step_on) * 1e6, s_off = median(step_off) * 1e6;
    std::printf("DDP timeline cost, Gloo, %d ranks: %zu parameters x %zu float32, %zu buckets\n",
                ctx.size(), o.params, o.floats, on.buckets().size());
    std::printf("%-44s %12s %12s %8s\n", "", "off", "on", "on/off");
    std::printf("%-44s %9.1f ns %9.1f ns %8.3f\n", "mark_ready inside no_sync() (median of 5)",
                m_off, m_on, m_on / m_off);
    std::printf("%-44s %9.1f us %9.1f us %8.3f\n",
                ("DDP step, slowest rank (median of " + std::to_string(o.steps) + ")").c_str(),
                s_off, s_on, s_on / s_off);
    std::printf("recording: %.1f ns per mark_ready; %.1f us per step (%.2f%%)\n", m_on - m_off,
                s_on - s_off, (s_on - s_off) / s_off * 100);
    std::printf(
        "write at the end: %.1f ms for %.1f MiB (rank 0; every event of the run, "
        "%zu marks included)\n",
        write_s * 1e3, static_cast<double>(bytes) / (1 << 20), 5 * o.marks);
    std::fflush(stdout);
  }
  return stragglers(ctx, o, off, model_off, step);
}

}  // namespace

int main(int argc, char** argv) {
  const bench_options o = parse(argc, argv);
  return dtrain::run<policy>(argc, argv,
                             [&](dtrain::context<policy>& ctx) { return bench(ctx, o); },
                             {.agent = {.nproc_per_node = 2}});
}
