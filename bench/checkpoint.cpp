// bench/checkpoint: what dtrain::checkpoint costs (issue 33). Its own per-node
// launcher with Gloo workers (2 by default; DTRAIN_NPROC_PER_NODE=N for N):
//
//   build/bench/dtrain_bench_checkpoint [--dir DIR] [--sizes 1,16,64] [--rounds 5]
//                                      [--step-ms 20] [--steps 60] [--every 10]
//                                      [--compute sleep|spin] [--copy-threads N]
//
// Table 1, save throughput: each rank holds S MiB of its own state
// (checkpoint_scope::per_rank) and saves it; against the same bytes written by
// each rank to a file of its own with write() and fsync(), with a barrier
// before and after each, as the baseline. Times are rank 0's, barrier to
// barrier, the median of the rounds. ratio = baseline / save (throughput
// relative to raw; goal at least 0.8). Then the restore of each save, by a
// checkpoint made anew (as a restarted job's), against each rank reading its
// own file back with read(): ratio = baseline / restore (every rank checks
// and reads the files it loads, and no other rank's).
//
// Table 2, a save beside training: steps of --step-ms of compute and an
// allreduce (`--compute sleep`, the default, sleeps: a GPU computing while the
// CPU is free, as bench/ddp_overlap; `spin` keeps a core busy, and then the
// writer thread competes with the training for the cores), --steps of them, a save every --every
// steps of the largest S; the mean step time without checkpoints, with synchronous saves and with
// asynchronous ones. ratio = step time / without (goal for asynchronous: at
// most 1.05). Also the steps that did not save (with asynchronous saves, those
// beside the writer thread) against the same steps without checkpoints, and
// where a save's time on the training thread went (checkpoint::timings(): the
// copy on --copy-threads threads, default automatic, and the commit of the
// save before).
// The last rows: the memory tier (checkpoint_options::memory_every = 1), a
// copy of the state into the node agent's directory in /dev/shm at every
// step, written on the training thread, (asynchronous) copied on it and
// written beside it, and (memory_beside_step) read and written beside the
// next step, which calls checkpoint::before_update() before it changes the
// state; and, the last, a copy every step of the same state registered as
// replicated (checkpoint_scope::replicated, as a DDP's), which the node's
// ranks write a slice each.
//
// Table 3, what a small copy costs: a state of --small-kib KiB per rank (a
// values entry and a bytes entry, half each, as the demo's weights and
// optimizer), --small-steps steps that spin --small-step-us each (no
// collective: the copy alone), without checkpoints, with a memory copy every
// step on the training thread, read beside the step, and as often as a budget
// of 3% of the step allows (checkpoint_options::memory_budget, memory_every
// 100: the interval the ranks agreed on is printed, and the first 150 steps,
// which settle it, are not timed); microseconds per step
// and per step() (checkpoint::timings().memory_seconds), rank 0's.
//
// DIR defaults to a new directory under TMPDIR (or /tmp); what the table
// measures is that file system, with its page cache: say which in a report.

#include <dtrain/checkpoint.hpp>
#include <dtrain/dtrain.hpp>

#include "flags.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

namespace {

using Policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>;
using clock_type = std::chrono::steady_clock;

struct settings {
  std::filesystem::path dir;
  std::vector<std::size_t> sizes_mib{1, 16, 64};
  int rounds = 5;
  double step_ms = 20;
  int steps = 60;
  int every = 10;
  bool spin = false;
  int copy_threads = 0;  // checkpoint_options::copy_threads of the asynchronous saves
  std::size_t small_kib = 56;
  int small_steps = 2000;
  double small_step_us = 40;
};

const dtrain_bench::flag_reader flags{"dtrain_bench_checkpoint"};

settings parse(int argc, char** argv) {
  settings s;
  flags.each(
      argc, argv,
      "usage: dtrain_bench_checkpoint [--dir DIR] [--sizes 1,16,64] [--rounds 5] "
      "[--step-ms 20] [--steps 60] [--every 10] [--compute sleep|spin] [--copy-threads N] "
      "[--small-kib 56] [--small-steps 2000] [--small-step-us 40]",
      [&](std::string_view flag, std::string_view value) {
        if (flag == "--dir") {
          s.dir = value;
          return true;
        }
        if (flag == "--sizes") {
          s.sizes_mib.clear();
          for (std::size_t at = 0; at <= value.size();) {
            const std::size_t comma = std::min(value.find(',', at), value.size());
            s.sizes_mib.push_back(flags.positive<std::size_t>(flag, value.substr(at, comma - at)));
            at = comma + 1;
          }
          return true;
        }
        if (flag == "--rounds") {
          s.rounds = flags.positive<int>(flag, value);
          return true;
        }
        if (flag == "--step-ms") {
          s.step_ms = flags.positive<double>(flag, value);
          return true;
        }
        if (flag == "--steps") {
          s.steps = flags.positive<int>(flag, value);
          return true;
        }
        if (flag == "--every") {
          s.every = flags.positive<int>(flag, value);
          return true;
        }
        if (flag == "--copy-threads") {
          s.copy_threads = flags.positive<int>(flag, value);
          return true;
        }
        if (flag == "--small-kib") {
          s.small_kib = flags.positive<std::size_t>(flag, value);
          return true;
        }
        if (flag == "--small-steps") {
          s.small_steps = flags.positive<int>(flag, value);
          return true;
        }
        if (flag == "--small-step-us") {
          s.small_step_us = flags.positive<double>(flag, value);
          return true;
        }
        if (flag == "--compute") {
          if (value != "sleep" && value != "spin") flags.fail("--compute takes sleep or spin");
          s.spin = value == "spin";
          return true;
        }
        return false;
      });
  return s;
}

double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

using dtrain_bench::median;

/// The baseline: these bytes to a file of this rank's own, written and fsync'd.
void raw_write(const std::filesystem::path& path, const std::vector<float>& data) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) flags.fail("cannot create " + path.string());
  const char* p = reinterpret_cast<const char*>(data.data());
  std::size_t left = data.size() * sizeof(float);
  while (left > 0) {
    const ::ssize_t w = ::write(fd, p, left);
    if (w <= 0) flags.fail("cannot write " + path.string());
    p += w;
    left -= static_cast<std::size_t>(w);
  }
  if (::fsync(fd) != 0) flags.fail("cannot fsync " + path.string());
  ::close(fd);
}

/// The restore's baseline: the bytes of a file of this rank's own, read whole.
void raw_read(const std::filesystem::path& path, std::vector<float>& into) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) flags.fail("cannot open " + path.string());
  char* p = reinterpret_cast<char*>(into.data());
  std::size_t left = into.size() * sizeof(float);
  while (left > 0) {
    const ::ssize_t r = ::read(fd, p, left);
    if (r <= 0) flags.fail("cannot read " + path.string());
    p += r;
    left -= static_cast<std::size_t>(r);
  }
  ::close(fd);
}

/// CPU work for about `ms` milliseconds (a training step's compute).
void spin(double ms) {
  const auto until = clock_type::now() + std::chrono::duration<double, std::milli>(ms);
  volatile double x = 1.0;
  while (clock_type::now() < until) {
    for (int i = 0; i < 10; ++i) x = x * 1.0000001 + 1e-9;
  }
}

/// Table 3 (the file's comment): rank 0 prints it.
void small_copies(dtrain::context<Policy>& ctx, const settings& s) {
  const std::size_t half = s.small_kib * 1024 / 2;
  std::vector<float> values(half / sizeof(float), 1.0f);
  std::string optimizer(half, 'm');
  struct row {
    double step_us = 0, copy_us = 0;
    std::uint64_t interval = 0;
  };
  // mode 0: none; 1: a copy every step; 2: read beside the step; 3: a budget of 3%.
  auto run_mode = [&](int mode) {
    std::optional<dtrain::checkpoint> c;
    if (mode > 0) {
      c.emplace(ctx,
                dtrain::checkpoint_options{.dir = s.dir / "table3-disk",
                                           .quiet = true,
                                           .memory_every = mode == 3 ? 100u : 1u,
                                           .memory_budget = mode == 3 ? 0.03 : 0,
                                           .memory_beside_step = mode == 2,
                                           .memory_dir = std::getenv("DTRAIN_MEMORY_CHECKPOINT_DIR")
                                                             ? std::filesystem::path()
                                                             : s.dir / "table3-memory"});
      c->add("values", values)
          .add(
              "optimizer", [&] { return optimizer; }, [&](std::string_view) {});
      c->step();  // the first copy makes the files: not timed
      c->before_update();
      c->step();
      c->before_update();
      // A budget: its first agreements, which measure and settle the
      // interval, are not timed either.
      for (int step = 0; mode == 3 && step < 3 * 50; ++step) {
        spin(s.small_step_us / 1e3);
        c->step();
      }
    }
    ctx.barrier();
    const double copy_before = c ? c->timings().memory_seconds : 0;
    const auto start = clock_type::now();
    for (int step = 0; step < s.small_steps; ++step) {
      spin(s.small_step_us / 1e3);
      if (c) c->before_update();
      values[static_cast<std::size_t>(step) % values.size()] += 1.0f;
      if (c) c->step();
    }
    row out;
    out.step_us = 1e6 * seconds_since(start) / s.small_steps;
    if (c) out.copy_us = 1e6 * (c->timings().memory_seconds - copy_before) / s.small_steps;
    if (c) out.interval = c->memory_interval();
    ctx.barrier();
    return out;
  };
  std::array<std::vector<row>, 4> rows;
  for (int round = 0; round < std::max(1, s.rounds / 2); ++round) {
    for (int mode = 0; mode < 4; ++mode)
      rows[static_cast<std::size_t>(mode)].push_back(run_mode(mode));
  }
  if (!ctx.is_main()) return;
  auto pick = [](const std::vector<row>& runs, double row::*field) {
    std::vector<double> v;
    for (const row& r : runs) v.push_back(r.*field);
    return median(v);
  };
  const double none = pick(rows[0], &row::step_us);
  std::printf(
      "\nA small state's memory copy: %zu KiB per rank, %d steps of %.0f us (spin), no "
      "collective:\n\n| checkpoints | step time | ratio | step() |\n| --- | ---: | ---: | ---: |\n",
      s.small_kib, s.small_steps, s.small_step_us);
  std::printf("| none | %.1f us | 1.00 | |\n", none);
  const char* names[] = {"", "memory tier, a copy every step", "memory tier, read beside the step",
                         "memory tier, memory_budget 3% (memory_every 100)"};
  for (std::size_t mode = 1; mode < 4; ++mode) {
    const double t = pick(rows[mode], &row::step_us);
    std::string name = names[mode];
    if (mode == 3) {
      name += ": a copy every";
      for (const row& r : rows[mode]) {
        name.push_back(' ');
        name.append(std::to_string(r.interval));
      }
      name += " steps";
    }
    std::printf("| %s | %.1f us | %.3f | %.1f us |\n", name.c_str(), t, t / none,
                pick(rows[mode], &row::copy_us));
  }
}

int bench(dtrain::context<Policy>& ctx, const settings& s) {
  const bool main = ctx.is_main();
  const std::filesystem::path dir = s.dir;
  std::filesystem::create_directories(dir);
  if (main) {
    std::printf("bench/checkpoint: %d ranks (Gloo), directory %s\n\n", ctx.size(), dir.c_str());
    std::printf(
        "| state per rank | raw write + fsync | dtrain save | ratio (raw / save) | raw read | "
        "dtrain restore | ratio (raw / restore) |\n");
    std::printf("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  }
  for (std::size_t mib : s.sizes_mib) {
    std::vector<float> state(mib * (1u << 20) / sizeof(float), static_cast<float>(ctx.rank()));
    dtrain::checkpoint ckpt(
        ctx, {.dir = dir / ("table1-" + std::to_string(mib)), .keep = 1, .quiet = true});
    ckpt.add("state", state, dtrain::checkpoint_scope::per_rank);
    // A restore reads it back into another array, by a checkpoint made anew
    // (a restarted job's), against each rank reading its own file back.
    std::vector<float> back(state.size());
    std::vector<double> raw, saved, raw_back, restored;
    for (int round = 0; round < s.rounds; ++round) {
      state[0] = static_cast<float>(round);
      const std::filesystem::path raw_file = dir / ("raw-" + std::to_string(ctx.rank()) + ".bin");
      ctx.barrier();
      auto start = clock_type::now();
      raw_write(raw_file, state);
      ctx.barrier();
      raw.push_back(seconds_since(start));
      start = clock_type::now();
      ckpt.step();
      ckpt.save();
      ctx.barrier();
      saved.push_back(seconds_since(start));
      start = clock_type::now();
      raw_read(raw_file, back);
      ctx.barrier();
      raw_back.push_back(seconds_since(start));
      dtrain::checkpoint again(
          ctx, {.dir = dir / ("table1-" + std::to_string(mib)), .keep = 1, .quiet = true});
      again.add("state", back, dtrain::checkpoint_scope::per_rank);
      ctx.barrier();
      start = clock_type::now();
      const auto step = again.restore();
      ctx.barrier();
      restored.push_back(seconds_since(start));
      if (!step || back != state) flags.fail("the restore did not give back the state saved");
    }
    std::filesystem::remove(dir / ("raw-" + std::to_string(ctx.rank()) + ".bin"));
    if (main) {
      const double r = median(raw), d = median(saved), rr = median(raw_back), dr = median(restored);
      const double all = static_cast<double>(mib) * ctx.size();
      std::printf(
          "| %zu MiB | %.1f ms (%.0f MiB/s) | %.1f ms (%.0f MiB/s) | %.2f | %.1f ms (%.0f MiB/s) | "
          "%.1f ms (%.0f MiB/s) | %.2f |\n",
          mib, 1e3 * r, all / r, 1e3 * d, all / d, r / d, 1e3 * rr, all / rr, 1e3 * dr, all / dr,
          rr / dr);
      std::fflush(stdout);
    }
  }

  // Table 2: steps beside saves of the largest state.
  const std::size_t mib = s.sizes_mib.back();
  std::vector<float> state(mib * (1u << 20) / sizeof(float), 1.0f);
  std::array<double, 1> sync_value{};
  // The steps' mean time. Before them, one save that is not timed (an
  // asynchronous save's first copy allocates its buffers, once per job);
  // after them, the last save's completion is not timed either: it happens
  // once, at the end of a job, not in its steps.
  // A run's step times: the mean of all, the mean of the steps that did not
  // save (with an asynchronous save: the steps beside its writer), and where
  // the training thread's time in the checkpoint went (rank 0's, per save).
  struct run_result {
    double all = 0, between = 0;
    dtrain::checkpoint_timings timings;
  };
  auto run_steps = [&](dtrain::checkpoint* ckpt) {
    if (ckpt) {
      ckpt->save();
      ckpt->wait();
    }
    const dtrain::checkpoint_timings before = ckpt ? ckpt->timings() : dtrain::checkpoint_timings{};
    ctx.barrier();
    const auto start = clock_type::now();
    double between = 0;
    int between_steps = 0;
    for (int step = 0; step < s.steps; ++step) {
      const auto step_start = clock_type::now();
      if (s.spin) {
        spin(s.step_ms);
      } else {
        std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(s.step_ms));
      }
      if (ckpt) ckpt->before_update();  // a no-op unless the memory copy is read beside the step
      state[static_cast<std::size_t>(step) % state.size()] += 1.0f;
      dtrain::allreduce(ctx.communicator(), sync_value, dtrain::reduce_op::sum).wait();
      if (!ckpt || !ckpt->step()) {
        between += seconds_since(step_start);
        ++between_steps;
      }
    }
    run_result out;
    out.all = seconds_since(start) / s.steps;
    out.between = between / std::max(1, between_steps);
    if (ckpt) {
      const dtrain::checkpoint_timings& after = ckpt->timings();
      const auto saves =
          static_cast<double>(std::max<std::uint64_t>(1, after.saves - before.saves));
      out.timings.saves = after.saves - before.saves;
      out.timings.blocked_seconds = (after.blocked_seconds - before.blocked_seconds) / saves;
      out.timings.copy_seconds = (after.copy_seconds - before.copy_seconds) / saves;
      out.timings.commit_seconds = (after.commit_seconds - before.commit_seconds) / saves;
      out.timings.writer_wait_seconds =
          (after.writer_wait_seconds - before.writer_wait_seconds) / saves;
      ckpt->wait();
    }
    ctx.barrier();
    return out;
  };
  const auto every = static_cast<std::uint64_t>(s.every);
  std::vector<run_result> none, sync, async, memory, memory_async, memory_beside, memory_replicated;
  for (int round = 0; round < std::max(1, s.rounds / 2); ++round) {
    none.push_back(run_steps(nullptr));
    {
      dtrain::checkpoint c(ctx,
                           {.dir = dir / "table2-sync", .every = every, .keep = 1, .quiet = true});
      c.add("state", state, dtrain::checkpoint_scope::per_rank);
      sync.push_back(run_steps(&c));
    }
    {
      dtrain::checkpoint c(ctx, {.dir = dir / "table2-async",
                                 .every = every,
                                 .keep = 1,
                                 .quiet = true,
                                 .asynchronous = true,
                                 .copy_threads = s.copy_threads});
      c.add("state", state, dtrain::checkpoint_scope::per_rank);
      async.push_back(run_steps(&c));
    }
    for (std::vector<run_result>* runs :
         {&memory, &memory_async, &memory_beside, &memory_replicated}) {
      // The memory tier, a copy every step (in the agent's directory in /dev/shm).
      dtrain::checkpoint c(
          ctx, {.dir = dir / "table2-memory-disk",
                .keep = 1,
                .quiet = true,
                .asynchronous = runs == &memory_async,
                .copy_threads = s.copy_threads,
                .memory_every = 1,
                .memory_beside_step = runs == &memory_beside,
                .memory_dir = std::getenv("DTRAIN_MEMORY_CHECKPOINT_DIR") ? std::filesystem::path()
                                                                          : dir / "table2-memory"});
      // The last row's state is replicated (a DDP's): the node's ranks write a slice each.
      c.add("state", state,
            runs == &memory_replicated ? dtrain::checkpoint_scope::replicated
                                       : dtrain::checkpoint_scope::per_rank);
      runs->push_back(run_steps(&c));
    }
  }
  if (main) {
    auto pick = [](const std::vector<run_result>& runs, auto field) {
      std::vector<double> v;
      for (const run_result& r : runs) v.push_back(field(r));
      return median(v);
    };
    auto all = [](const run_result& r) { return r.all; };
    auto between = [](const run_result& r) { return r.between; };
    const double n = pick(none, all), y = pick(sync, all), a = pick(async, all);
    const double nb = pick(none, between), ab = pick(async, between);
    std::printf(
        "\n%d steps of %.0f ms (%s) + an allreduce, a save of %zu MiB per rank every %d steps"
        " (%d ranks, asynchronous copy on %d threads):\n\n",
        s.steps, s.step_ms, s.spin ? "spin" : "sleep", mib, s.every, ctx.size(),
        s.copy_threads > 0 ? s.copy_threads
                           : std::clamp(static_cast<int>(std::thread::hardware_concurrency()) /
                                            std::max(1, ctx.local_size()),
                                        1, 8));
    std::printf("| checkpoints | step time | ratio |\n| --- | ---: | ---: |\n");
    std::printf("| none | %.2f ms | 1.00 |\n", 1e3 * n);
    std::printf("| synchronous save | %.2f ms | %.3f |\n", 1e3 * y, y / n);
    std::printf("| asynchronous save | %.2f ms | %.3f |\n", 1e3 * a, a / n);
    std::printf("| asynchronous, the steps beside its writer | %.2f ms | %.3f |\n", 1e3 * ab,
                ab / nb);
    const double m = pick(memory, all), ma = pick(memory_async, all), mb = pick(memory_beside, all);
    std::printf("| memory tier, a copy every step | %.2f ms | %.3f |\n", 1e3 * m, m / n);
    std::printf("| memory tier, a copy every step, asynchronous | %.2f ms | %.3f |\n", 1e3 * ma,
                ma / n);
    std::printf("| memory tier, a copy every step, read beside the step | %.2f ms | %.3f |\n",
                1e3 * mb, mb / n);
    const double mr = pick(memory_replicated, all);
    std::printf(
        "| memory tier, a copy every step, the state replicated (in slices) | %.2f ms | %.3f |\n",
        1e3 * mr, mr / n);
    auto ms = [&](const std::vector<run_result>& runs, auto field) {
      return 1e3 * pick(runs, [&](const run_result& r) { return field(r.timings); });
    };
    auto blocked = [](const dtrain::checkpoint_timings& t) { return t.blocked_seconds; };
    auto copied = [](const dtrain::checkpoint_timings& t) { return t.copy_seconds; };
    auto commit = [](const dtrain::checkpoint_timings& t) { return t.commit_seconds; };
    auto writer = [](const dtrain::checkpoint_timings& t) { return t.writer_wait_seconds; };
    std::printf(
        "\nThe training thread in a save (rank 0, per save, dtrain::checkpoint::timings()):\n\n"
        "| save | blocked | copy | commit of the one before | of which waiting for its writer |\n"
        "| --- | ---: | ---: | ---: | ---: |\n");
    std::printf("| synchronous | %.2f ms | | | |\n", ms(sync, blocked));
    std::printf("| asynchronous | %.2f ms | %.2f ms | %.2f ms | %.2f ms |\n", ms(async, blocked),
                ms(async, copied), ms(async, commit), ms(async, writer));
  }
  ctx.barrier();
  small_copies(ctx, s);
  ctx.barrier();
  if (main) std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  settings s = parse(argc, argv);
  if (s.dir.empty()) {
    // The first process (the node agent) picks it; its workers inherit it.
    if (const char* picked = std::getenv("DTRAIN_BENCH_CHECKPOINT_DIR")) {
      s.dir = picked;
    } else {
      const char* tmp = std::getenv("TMPDIR");
      s.dir = std::filesystem::path(tmp && *tmp ? tmp : "/tmp") /
              ("dtrain-bench-checkpoint-" + std::to_string(::getpid()));
      ::setenv("DTRAIN_BENCH_CHECKPOINT_DIR", s.dir.c_str(), 1);
    }
  }
  dtrain::run_options options;
  options.agent.nproc_per_node = 2;
  return dtrain::run<Policy>(
      argc, argv, [&](dtrain::context<Policy>& ctx) { return bench(ctx, s); }, options);
}
