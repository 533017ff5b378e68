// dtrain_ddp_shard: the sharding test (ddp_options::sharding, ZeRO stages 1,
// 2 and 3), doctest case "sharding" run in every rank through dtrain::run
// (tests/support/multirank.hpp; tests/ddp/ddp.cmake registers it):
//
//   mpirun -n N dtrain_ddp_shard --engine=mpi --test-case=sharding
//   dtrain_test_launch N dtrain_ddp_shard --engine=gloo [--topology=hierarchical]
//   --test-case=sharding
//
// A linear least-squares model of 7 parameters (5,209 floats: sizes that no
// world size divides, one of 3,001 that is larger than a shard on 2 ranks and
// more, one that keeps its own gradient buffer, one that no rank ever marks)
// trains 6 steps on each rank's own samples, step 3 accumulating two
// micro-batches in no_sync(), with gradient clipping by the global norm. It
// is trained with DDP (sharding none), stages 1, 2 and 3 (at stage 3 the
// values are DDP's: the model's pointers point at DDP's fence, no memory,
// outside ddp.gather(), which holds them around the backward pass and the
// marks), each with
// SGD-momentum and with Adam written against shard() (state of
// shard_elements()), and by one process on the whole batch in double. Each
// variant's weights must match DDP's within 1e-5 and the single process's
// within 1e-4; the norms too. Then: the shard pieces of all ranks cover the
// model exactly once; optimizer_step() without a synchronized step is an
// error naming the rank. Stage 3 layer by layer (train_layered: each
// parameter gathered around its forward and its backward, evaluation passes,
// one step in another order), with ddp_options::prefetch_units 0, 1 and 2 and
// deferred values, must give the one-unit stage 3's bits and prefetch (fewer
// allgathers on demand). Refused by name: stages or prefetch_units that
// differ across ranks, null values below stage 3. Prints one line per rank;
// what differs fails the case.
//
// Case "loss_scaler" (--test-case=loss_scaler, issue 49): the same model at
// every stage under dtrain::loss_scaler, with an inf before the average and
// a NaN after it on the last rank only: both steps skipped on every rank,
// the scale's schedule, and the weights bit-identical to the run without
// the scaler that skips those steps by hand (run_scaled).
//
// Cases "outside-read" and "outside-write" (issue 48): a stage-3 parameter
// used outside a gather() ends the rank with status 1 and a line that names
// the parameter, its unit and the rank (tests/ddp/ddp.cmake checks it), not
// a bare segmentation fault; a fault elsewhere still reaches the handler
// that was installed before DDP's (run_outside).
//
// Case "master_weights" (--test-case=master_weights, issue 49): a model of
// bfloat16 (then float16) parameters with ddp_options::master_weights at
// every stage, SGD on the pieces' float32 master: the master within 2e-4 of
// the exact SGD, the 16-bit values the master rounded once and the same on
// every rank, every value moved; the shard's master taken at step 3 and put
// back gives the same bits again (run_master). Without master weights the
// same bfloat16 SGD does not move a value (the stall they fix). Values the
// program writes between steps are adopted: the next step starts from them.

#include "../support/multirank.hpp"
#include "accumulate_case.hpp"

#include <dtrain/checkpoint.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

namespace {

constexpr std::size_t sizes[] = {1, 700, 3001, 33, 257, 5, 1212};
constexpr std::size_t parameter_count = std::size(sizes);
constexpr std::size_t copy_mode = 3;  // keeps its own gradient buffer (no view)
constexpr std::size_t unused = 5;     // never marked: find_unused_parameters sends zero
constexpr int steps = 6;
constexpr int accumulating_step = 3;  // two micro-batches, the first inside no_sync()
constexpr std::size_t batch = 3;      // samples per rank per micro-batch
constexpr double max_norm = 40.0;     // clipping

/// A deterministic value in [-1, 1) from two integers.
double hash_unit(std::uint64_t a, std::uint64_t b) {
  std::uint64_t x = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<double>(x >> 11) / static_cast<double>(1ull << 52) - 1.0;
}

/// Sample s: features x[d] over the whole model's elements, target t.
double feature(std::uint64_t s, std::size_t d) { return hash_unit(s, d); }
double target(std::uint64_t s) { return 3.0 * hash_unit(s, 1u << 30); }

/// The samples of (step, micro-batch) on `rank` of `size`.
std::uint64_t sample(int step, int micro, int rank, int size, std::size_t k) {
  return ((static_cast<std::uint64_t>(step) * 2 + static_cast<std::uint64_t>(micro)) *
              static_cast<std::uint64_t>(size) +
          static_cast<std::uint64_t>(rank)) *
             batch +
         k;
}

struct linear_model {
  std::vector<std::vector<float>> w;
  std::vector<float*> view;  // gradients dtrain repoints into its buckets
  std::vector<float> own = std::vector<float>(sizes[copy_mode]);  // the copy-mode gradient
  /// Stage 3 (sharding::parameters): the values as pointers DDP holds
  /// (at its fence outside gather()); w keeps the initial values it copies.
  bool values_held = false;
  std::vector<float*> held;
  bool units = false;  // each parameter a unit of its own (parameter::unit)

  explicit linear_model(bool stage3 = false)
      : w(parameter_count), view(parameter_count, nullptr), values_held(stage3) {
    for (std::size_t p = 0; p < parameter_count; ++p) {
      for (std::size_t i = 0; i < sizes[p]; ++i)
        w[p].push_back(static_cast<float>(0.1 * hash_unit(p, i)));
      held.push_back(w[p].data());
    }
  }
  std::vector<dtrain::parameter> parameters() {
    std::vector<dtrain::parameter> out;
    for (std::size_t p = 0; p < parameter_count; ++p) {
      std::string name = "w";  // (not "w" + to_string: GCC 12's -Wrestrict misfires at -O2)
      name += std::to_string(p);
      if (values_held) {
        out.push_back(dtrain::param(name, held[p], sizes[p], view[p]));
        if (units) out.back().unit = static_cast<std::int64_t>(p);
      } else if (p == copy_mode) {
        out.push_back(dtrain::param(name, w[p], own));
      } else {
        out.push_back(dtrain::param(name, w[p], view[p]));
      }
    }
    return out;
  }
  float* grad(std::size_t p) { return p == copy_mode && !values_held ? own.data() : view[p]; }
  const float* values(std::size_t p) const { return values_held ? held[p] : w[p].data(); }

  /// Adds this micro-batch's mean gradient of 0.5 (w.x - t)^2 into the gradients.
  void backward(int step, int micro, int rank, int size) {
    for (std::size_t k = 0; k < batch; ++k) {
      const std::uint64_t s = sample(step, micro, rank, size, k);
      double y = 0;
      for (std::size_t p = 0, d = 0; p < parameter_count; d += sizes[p], ++p) {
        if (p == unused) continue;
        const float* v = values(p);
        for (std::size_t i = 0; i < sizes[p]; ++i)
          y += static_cast<double>(v[i]) * feature(s, d + i);
      }
      const double r = (y - target(s)) / static_cast<double>(batch);
      for (std::size_t p = 0, d = 0; p < parameter_count; d += sizes[p], ++p) {
        if (p == unused) continue;
        float* g = grad(p);
        for (std::size_t i = 0; i < sizes[p]; ++i)
          g[i] += static_cast<float>(r * feature(s, d + i));
      }
    }
  }
};

enum class optimizer_kind { sgd, adam };

/// An elementwise optimizer over a state array of `elements`.
struct optimizer {
  optimizer_kind kind;
  std::vector<float> m, v;
  int t = 0;
  optimizer(optimizer_kind k, std::size_t elements) : kind(k), m(elements), v(elements) {}
  void begin_step() { ++t; }
  /// values[k] from gradients[k] * scale, state at offset + k.
  void update(float* values, const float* gradients, std::size_t count, std::size_t offset,
              float scale) {
    for (std::size_t k = 0; k < count; ++k) {
      const float g = gradients[k] * scale;
      float& mk = m[offset + k];
      if (kind == optimizer_kind::sgd) {
        mk = t == 1 ? g : 0.9f * mk + g;
        values[k] -= 0.05f * mk;
      } else {
        float& vk = v[offset + k];
        mk = 0.9f * mk + 0.1f * g;
        vk = 0.999f * vk + 0.001f * g * g;
        const float mh = mk / (1.0f - std::pow(0.9f, static_cast<float>(t)));
        const float vh = vk / (1.0f - std::pow(0.999f, static_cast<float>(t)));
        values[k] -= 0.01f * mh / (std::sqrt(vh) + 1e-8f);
      }
    }
  }
};

float clip_scale(double norm) {
  return norm > max_norm ? static_cast<float>(max_norm / norm) : 1.0f;
}

struct result {
  std::vector<std::vector<float>> w;
  std::vector<double> norms;
  std::size_t shard_elements = 0;
  std::string topology;  ///< how the buckets travelled (ddp.topology().describe())
  /// Stage 2 on the host: after each synchronize(), the pages of w2's
  /// gradient (in its bucket) were not resident (checked with mincore).
  bool pages_returned = false;
  std::string page_problem;  ///< why not, when they should have been
};

/// export_parameters() to rank 0, one bucket at a time: every parameter
/// once, equal to `w` (the values whole), nothing on other ranks, nothing
/// left whole after. Returns what went wrong, or "".
template <class DDP>
std::string check_export(DDP& ddp, const std::vector<std::vector<float>>& w, int rank) {
  std::vector<int> seen(parameter_count, 0);
  std::string problem;
  ddp.export_parameters([&](const dtrain::parameter& p, std::span<const std::byte> bytes) {
    const std::size_t k = std::stoul(p.name.substr(1));  // "w<k>"
    ++seen[k];
    if (bytes.size() != w[k].size() * sizeof(float) ||
        std::memcmp(bytes.data(), w[k].data(), bytes.size()) != 0)
      problem = "export_parameters(): " + p.name + " differs from the gathered values";
  });
  for (std::size_t k = 0; k < parameter_count && problem.empty(); ++k) {
    if (seen[k] != (rank == 0 ? 1 : 0))
      problem = "export_parameters(): w" + std::to_string(k) + " visited " +
                std::to_string(seen[k]) + " times on rank " + std::to_string(rank);
  }
  if (problem.empty() && ddp.memory_use().gathered != 0)
    problem = "export_parameters() left values whole";
  // A visit that throws: rethrown on rank 0 once every bucket went round, so
  // that no rank is left waiting in an allgather (the collectives after this
  // one would be out of step otherwise).
  int calls = 0;
  bool threw = false;
  try {
    ddp.export_parameters([&](const dtrain::parameter&, std::span<const std::byte>) {
      if (++calls == 2) throw std::runtime_error("visit fails on purpose");
    });
  } catch (const std::runtime_error& e) {
    threw = std::string(e.what()) == "visit fails on purpose";
  }
  if (problem.empty() && (threw != (rank == 0) || calls != (rank == 0 ? 2 : 0)))
    problem = "export_parameters() with a throwing visit: rethrown " + std::to_string(threw) +
              ", visits " + std::to_string(calls) + " on rank " + std::to_string(rank);
  return problem;
}

/// After synchronize(): the global norm into `out`, then the optimizer on
/// the shard with the gradients clipped to max_norm.
template <class DDP>
void clipped_step(DDP& ddp, optimizer& opt, result& out) {
  const double norm = ddp.gradient_norm();
  out.norms.push_back(norm);
  opt.begin_step();
  const float scale = clip_scale(norm);
  ddp.optimizer_step([&](const dtrain::shard_piece& piece) {
    opt.update(static_cast<float*>(piece.values.data),
               static_cast<const float*>(piece.gradients.data), piece.values.count,
               piece.state_offset, scale);
  });
}

/// Whether none of the whole pages inside [data, data + bytes) is resident.
bool pages_gone(const void* data, std::size_t bytes, std::string& why) {
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = (reinterpret_cast<std::uintptr_t>(data) + page - 1) / page * page;
  const auto end = (reinterpret_cast<std::uintptr_t>(data) + bytes) / page * page;
  if (end <= begin) {
    why = "the gradient spans no whole page";
    return false;
  }
  std::vector<unsigned char> resident((end - begin) / page);
  // NOLINTNEXTLINE(performance-no-int-to-ptr): the page boundary of `data`
  if (::mincore(reinterpret_cast<void*>(begin), end - begin, resident.data()) != 0) {
    why = std::string("mincore: ") + std::strerror(errno);
    return false;
  }
  for (const unsigned char r : resident) {
    if (r & 1u) {
      why = "a page of the gradient bucket is still resident after synchronize()";
      return false;
    }
  }
  return true;
}

/// Buckets of a few KiB (several buckets, parameters across their edges),
/// w5 never marked, at `sharding`.
dtrain::ddp_options small_buckets(dtrain::sharding sharding) {
  return {.bucket_cap_mb = 0.004,
          .first_bucket_cap_mb = 0.002,
          .find_unused_parameters = true,
          .report_unused_parameters = false,
          .sharding = sharding};
}

template <class Context>
result train(Context& ctx, dtrain::sharding sharding, optimizer_kind kind) {
  using Policy = typename Context::policy_type;
  const bool stage3 = sharding == dtrain::sharding::parameters;
  linear_model model(stage3);
  dtrain::DistributedDataParallel<linear_model, Policy> ddp(ctx, model, small_buckets(sharding));
  optimizer opt(kind, ddp.shard_elements());
  result out;
  out.shard_elements = ddp.shard_elements();
  out.topology = ddp.topology().describe();
  const bool transient = sharding != dtrain::sharding::none &&
                         sharding != dtrain::sharding::optimizer && ctx.size() > 1;
  if (stage3 && !std::all_of(model.held.begin(), model.held.end(),
                             [](float* v) { return dtrain::detail::value_fence::holds(v); })) {
    out.page_problem = "stage 3: a value pointer is not in DDP's fence outside gather()";
  }
  if (ddp.memory_use().transient_buckets != transient) {
    out.page_problem = "memory_use().transient_buckets is wrong";
  }
  out.pages_returned = transient;
  for (int step = 0; step < steps; ++step) {
    for (std::size_t p = 0; p < parameter_count; ++p) {
      if (p != unused) std::fill_n(model.grad(p), sizes[p], 0.0f);
    }
    {
      // Stage 3: the values are whole while `held` lives (the model is one
      // part: its backward reads every parameter); elsewhere it does nothing.
      auto held = ddp.gather(ddp.parameters());
      if (step == accumulating_step) {
        auto guard = ddp.no_sync();
        model.backward(step, 1, ctx.rank(), ctx.size());
      }
      model.backward(step, 0, ctx.rank(), ctx.size());
      for (std::size_t p = parameter_count; p-- > 0;) {
        if (p != unused) ddp.mark_ready(p);
      }
    }
    if (stage3 && !dtrain::detail::value_fence::holds(model.held[0])) {
      out.page_problem = "stage 3: the value pointers are not in the fence once the guard is gone";
    }
    ddp.synchronize();
    // Stage 2 on the host: the buckets' pages went back after their reduce-scatter.
    if (transient && out.pages_returned) {
      out.pages_returned = pages_gone(model.grad(2), sizes[2] * sizeof(float), out.page_problem);
    }
    clipped_step(ddp, opt, out);
  }
  if (stage3) {
    // The parameters' values are DDP's shards at stage 3: adding them whole
    // to a checkpoint is refused by name when they are added (add_sharded(
    // "parameters", ddp) is the way), not a crash at the first save.
    dtrain::checkpoint ck(ctx.control_plane(), {.dir = "unused"});
    try {
      ck.add(ddp.parameters());
      out.page_problem = "stage 3: checkpoint::add took parameters without values";
    } catch (const dtrain::config_error& e) {
      if (std::string(e.what()).find("parameter 'w0' has no values here") == std::string::npos)
        out.page_problem = std::string("stage 3: checkpoint::add said: ") + e.what();
    }
  }
  if (stage3) {  // the whole model, gathered, as an export for inference would take it
    auto held = ddp.gather(ddp.parameters());
    out.w.assign(parameter_count, {});
    for (std::size_t p = 0; p < parameter_count; ++p)
      out.w[p].assign(model.held[p], model.held[p] + sizes[p]);
  } else {
    out.w = model.w;
  }
  if (const std::string e = check_export(ddp, out.w, ctx.rank()); !e.empty()) out.page_problem = e;

  // The pieces of every rank cover each parameter once (without sharding,
  // each rank's cover it whole).
  const std::int64_t copies = sharding == dtrain::sharding::none ? ctx.size() : 1;
  std::vector<std::int64_t> covered(ddp.parameters().size(), 0);
  for (const dtrain::shard_piece& piece : ddp.shard()) {
    covered[piece.parameter] += static_cast<std::int64_t>(piece.values.count);
  }
  dtrain::allreduce(ctx.communicator(), covered, dtrain::reduce_op::sum).wait();
  for (std::size_t p = 0; p < parameter_count; ++p) {
    if (covered[p] != copies * static_cast<std::int64_t>(sizes[p])) {
      std::fprintf(stderr,
                   "rank %d: sharding %s: the ranks' pieces hold %lld of w%zu's %zu elements\n",
                   ctx.rank(), std::string(dtrain::to_string(sharding)).c_str(),
                   static_cast<long long>(covered[p]), p, sizes[p]);
      out.w.clear();
    }
  }
  // A second optimizer step without a synchronized step is refused, by name.
  try {
    ddp.optimizer_step([](const dtrain::shard_piece&) {});
    std::fprintf(stderr, "rank %d: optimizer_step() without synchronize() did not throw\n",
                 ctx.rank());
    out.w.clear();
  } catch (const dtrain::error& e) {
    if (std::string(e.what()).find("optimizer_step() on rank " + std::to_string(ctx.rank())) ==
        std::string::npos) {
      std::fprintf(stderr, "rank %d: unexpected message: %s\n", ctx.rank(), e.what());
      out.w.clear();
    }
  }
  return out;
}

/// Stage 3 as a layered model would run it: each parameter a unit gathered
/// around its forward (its share of every sample's prediction) and again
/// around its backward (its gradient, then its mark), in reverse; step 2
/// runs the backward in another order once; an evaluation pass (forward
/// only) after steps 1 and 4; step 3 accumulates a micro-batch in no_sync().
/// The float operations are train()'s at stage 3 in the same order, so the
/// weights must be the same bits, whatever `prefetch`, and `deferred` (no
/// values at construction, each rank's shard written through shard()) too.
/// `counts` gets
/// gather_counts(); `problem` what went wrong besides the weights.
template <class Context>
result train_layered(Context& ctx, optimizer_kind kind, std::size_t prefetch, bool deferred,
                     dtrain::gather_counts& counts, std::string& problem) {
  using Policy = typename Context::policy_type;
  linear_model model(true);
  // Deferred: no values at construction (no rank holds the model whole);
  // each rank writes the initial values of its shard through shard().
  if (deferred) std::fill(model.held.begin(), model.held.end(), nullptr);
  dtrain::DistributedDataParallel<linear_model, Policy> ddp(
      ctx, model,
      {.bucket_cap_mb = 0.004,
       .first_bucket_cap_mb = 0.002,
       .find_unused_parameters = true,
       .report_unused_parameters = false,
       .sharding = dtrain::sharding::parameters,
       .prefetch_units = prefetch});
  if (deferred) {
    for (const dtrain::shard_piece& piece : ddp.shard()) {
      auto* v = static_cast<float*>(piece.values.data);
      for (std::size_t k = 0; k < piece.values.count; ++k)
        v[k] = static_cast<float>(0.1 * hash_unit(piece.parameter, piece.offset + k));
    }
  }
  // A gradient marked while no gather() held its part's values in the step
  // (a layer computed outside its guard) is refused by name, before the
  // mark counts: the steps below run as if it had not been tried.
  try {
    ddp.mark_ready(std::size_t{1});
    problem = "mark_ready of a parameter no gather() held was taken";
  } catch (const dtrain::error& e) {
    const std::string said = e.what();
    if (said.find("parameter 'w1' (#1) on rank " + std::to_string(ctx.rank()) +
                  " has a gradient, but no gather() held its values in step 0") ==
        std::string::npos)
      problem = "mark_ready without a gather() said: " + said;
  }
  optimizer opt(kind, ddp.shard_elements());
  result out;
  std::vector<double> y(batch);
  auto forward = [&](int step, int micro) {
    std::fill(y.begin(), y.end(), 0.0);
    for (std::size_t p = 0, d = 0; p < parameter_count; d += sizes[p], ++p) {
      auto held = ddp.gather({p});
      if (p == unused) continue;
      const float* v = model.values(p);
      if (v == nullptr) {
        problem = "a gathered parameter's values are null";
        return;
      }
      for (std::size_t k = 0; k < batch; ++k) {
        const std::uint64_t s = sample(step, micro, ctx.rank(), ctx.size(), k);
        for (std::size_t i = 0; i < sizes[p]; ++i)
          y[k] += static_cast<double>(v[i]) * feature(s, d + i);
      }
    }
  };
  std::size_t offsets[parameter_count] = {};
  for (std::size_t p = 1; p < parameter_count; ++p) offsets[p] = offsets[p - 1] + sizes[p - 1];
  auto backward = [&](int step, int micro, bool shuffled, bool mark) {
    constexpr std::size_t reverse[] = {6, 5, 4, 3, 2, 1, 0};
    constexpr std::size_t other[] = {6, 4, 5, 1, 3, 2, 0};
    for (const std::size_t p : shuffled ? other : reverse) {
      auto held = ddp.gather({p});
      if (p == unused) continue;
      float* g = model.grad(p);
      for (std::size_t k = 0; k < batch; ++k) {
        const std::uint64_t s = sample(step, micro, ctx.rank(), ctx.size(), k);
        const double r = (y[k] - target(s)) / static_cast<double>(batch);
        for (std::size_t i = 0; i < sizes[p]; ++i)
          g[i] += static_cast<float>(r * feature(s, offsets[p] + i));
      }
      if (mark) ddp.mark_ready(p);
    }
  };
  for (int step = 0; step < steps; ++step) {
    for (std::size_t p = 0; p < parameter_count; ++p) {
      if (p != unused) std::fill_n(model.grad(p), sizes[p], 0.0f);
    }
    if (step == accumulating_step) {
      auto guard = ddp.no_sync();
      forward(step, 1);
      backward(step, 1, false, false);
    }
    forward(step, 0);
    backward(step, 0, step == 2, true);
    ddp.synchronize();
    if (ddp.memory_use().gathered != 0) problem = "values stayed whole after synchronize()";
    clipped_step(ddp, opt, out);
    if (step == 1 || step == 4) forward(steps + step, 0);  // an evaluation pass
  }
  {
    auto held = ddp.gather(ddp.parameters());
    out.w.assign(parameter_count, {});
    for (std::size_t p = 0; p < parameter_count; ++p)
      out.w[p].assign(model.held[p], model.held[p] + sizes[p]);
  }
  if (const std::string e = check_export(ddp, out.w, ctx.rank()); !e.empty()) problem = e;
  counts = ddp.gather_counts();
  return out;
}

/// One process on the whole batch (every rank's samples), in double.
result reference(int size, optimizer_kind kind) {
  linear_model model;
  std::size_t total = 0;
  for (std::size_t s : sizes) total += s;
  std::vector<double> w(total), g(total);
  for (std::size_t p = 0, d = 0; p < parameter_count; d += sizes[p], ++p) {
    for (std::size_t i = 0; i < sizes[p]; ++i) w[d + i] = model.w[p][i];
  }
  std::vector<double> m(total), v(total);
  result out;
  for (int step = 0; step < steps; ++step) {
    std::fill(g.begin(), g.end(), 0.0);
    const int micros = step == accumulating_step ? 2 : 1;
    for (int rank = 0; rank < size; ++rank) {
      for (int micro = 0; micro < micros; ++micro) {
        for (std::size_t k = 0; k < batch; ++k) {
          const std::uint64_t s = sample(step, micro, rank, size, k);
          double y = 0;
          for (std::size_t p = 0, d = 0; p < parameter_count; d += sizes[p], ++p) {
            if (p == unused) continue;
            for (std::size_t i = 0; i < sizes[p]; ++i) y += w[d + i] * feature(s, d + i);
          }
          const double r = (y - target(s)) / static_cast<double>(batch) / size;
          for (std::size_t p = 0, d = 0; p < parameter_count; d += sizes[p], ++p) {
            if (p == unused) continue;
            for (std::size_t i = 0; i < sizes[p]; ++i) g[d + i] += r * feature(s, d + i);
          }
        }
      }
    }
    double norm = 0;
    for (double x : g) norm += x * x;
    norm = std::sqrt(norm);
    out.norms.push_back(norm);
    const double scale = norm > max_norm ? max_norm / norm : 1.0;
    const int t = step + 1;
    for (std::size_t e = 0; e < total; ++e) {
      const double gs = g[e] * scale;
      if (kind == optimizer_kind::sgd) {
        m[e] = t == 1 ? gs : 0.9 * m[e] + gs;
        w[e] -= 0.05 * m[e];
      } else {
        m[e] = 0.9 * m[e] + 0.1 * gs;
        v[e] = 0.999 * v[e] + 0.001 * gs * gs;
        const double mh = m[e] / (1 - std::pow(0.9, t)), vh = v[e] / (1 - std::pow(0.999, t));
        w[e] -= 0.01 * mh / (std::sqrt(vh) + 1e-8);
      }
    }
  }
  out.w.assign(parameter_count, {});
  for (std::size_t p = 0, d = 0; p < parameter_count; d += sizes[p], ++p) {
    for (std::size_t i = 0; i < sizes[p]; ++i) out.w[p].push_back(static_cast<float>(w[d + i]));
  }
  return out;
}

/// The largest difference, relative to max(1, |expected|), or a large number when shapes differ.
double distance(const result& got, const result& expected) {
  if (got.w.size() != expected.w.size() || got.norms.size() != expected.norms.size()) return 1e9;
  double worst = 0;
  for (std::size_t p = 0; p < got.w.size(); ++p) {
    if (got.w[p].size() != expected.w[p].size()) return 1e9;
    for (std::size_t i = 0; i < got.w[p].size(); ++i) {
      const double e = expected.w[p][i];
      worst = std::max(worst, std::abs(got.w[p][i] - e) / std::max(1.0, std::abs(e)));
    }
  }
  for (std::size_t s = 0; s < got.norms.size(); ++s) {
    worst = std::max(worst, std::abs(got.norms[s] - expected.norms[s]) /
                                std::max(1.0, std::abs(expected.norms[s])));
  }
  return worst;
}

template <class Context>
int run_case(Context& ctx, std::string_view topology) {
  int failures = 0;
  {
    // Refused by name on every rank: at stage 3 a parameter that gives its
    // values as storage (stage 3 holds them itself), null values below stage
    // 3, and ranks that differ in the stage or in prefetch_units (their
    // allgathers would not pair up).
    using Policy = typename Context::policy_type;
    using stage = dtrain::sharding;
    const bool first = ctx.rank() == 0;
    const std::string on_rank = "on rank " + std::to_string(ctx.rank()) + ": ";
    enum class values { storage, pointers, first_null, units_on_others };
    struct refusal {
      stage mine;
      std::size_t prefetch;
      values given;
      std::string expected;
      double bucket_cap_mb = 25;
    };
    std::vector<refusal> refusals{
        {stage::parameters, 1, values::storage,
         on_rank + "parameter 'w0' gives its values as storage"},
        {stage::gradients, 1, values::first_null,
         on_rank + "parameter #0 'w0' has no values (null values are for ddp_options::sharding = "
                   "parameters"}};
    if (ctx.size() > 1) {
      refusals.push_back({first ? stage::parameters : stage::gradients, 1, values::pointers,
                          "the ranks' options differ: rank 0 has ddp_options::sharding = "
                          "parameters, ddp_options::prefetch_units = 1, "});
      refusals.push_back({first ? stage::parameters : stage::gradients, 1, values::pointers,
                          "; rank 1 has ddp_options::sharding = gradients, "});
      refusals.push_back({stage::parameters, first ? std::size_t{1} : std::size_t{2},
                          values::pointers,
                          "; rank 1 has ddp_options::sharding = parameters, "
                          "ddp_options::prefetch_units = 2, "});
      // Other bucket caps would send other counts (unchecked in Gloo's shared memory).
      refusals.push_back({stage::none, 1, values::pointers,
                          "; rank 1 has ddp_options::sharding = none, ddp_options::bucket_cap_mb = "
                          "524288 bytes, first_bucket_cap_mb = 1048576 bytes",
                          first ? 25.0 : 0.5});
      // Units that differ would lay the buckets out differently.
      refusals.push_back(
          {stage::parameters, 1, values::units_on_others, "float32 on the host, unit 0)"});
    }
    for (const refusal& r : refusals) {
      linear_model model(r.given != values::storage);
      if (r.given == values::first_null) model.held[0] = nullptr;
      model.units = r.given == values::units_on_others && !first;
      std::string what = "nothing was thrown";
      try {
        dtrain::DistributedDataParallel<linear_model, Policy> ddp(
            ctx, model,
            {.bucket_cap_mb = r.bucket_cap_mb, .sharding = r.mine, .prefetch_units = r.prefetch});
      } catch (const dtrain::config_error& e) {
        what = e.what();
      }
      const bool named = what.find(r.expected) != std::string::npos;
      CHECK_MESSAGE(named,
                    "rank " << ctx.rank() << ": expected \"" << r.expected << "\", got: " << what);
      failures += named ? 0 : 1;
    }
  }
  for (const optimizer_kind kind : {optimizer_kind::sgd, optimizer_kind::adam}) {
    const char* name = kind == optimizer_kind::sgd ? "sgd-momentum" : "adam";
    const result ddp = train(ctx, dtrain::sharding::none, kind);
    const result single = reference(ctx.size(), kind);
    const double to_single = distance(ddp, single);
    CHECK_MESSAGE(to_single <= 1e-4, "rank " << ctx.rank() << ": " << name
                                             << ": DDP differs from one process by " << to_single);
    if (!(to_single <= 1e-4)) ++failures;
    for (const dtrain::sharding stage :
         {dtrain::sharding::optimizer, dtrain::sharding::gradients, dtrain::sharding::parameters}) {
      const result sharded = train(ctx, stage, kind);
      const double to_ddp = distance(sharded, ddp), to_one = distance(sharded, single);
      // A hierarchical job must really run hierarchically (2 nodes x 2 ranks).
      const bool layered = topology != "hierarchical" ||
                           sharded.topology.find("2 nodes x 2 ranks") != std::string::npos;
      const bool transient = stage != dtrain::sharding::optimizer && ctx.size() > 1;
      const bool ok = layered && to_ddp <= 1e-5 && to_one <= 1e-4 &&
                      (ctx.size() == 1 || sharded.shard_elements < ddp.shard_elements) &&
                      sharded.page_problem.empty() && sharded.pages_returned == transient;
      if (!sharded.page_problem.empty())
        std::fprintf(stderr, "rank %d: %s\n", ctx.rank(), sharded.page_problem.c_str());
      std::printf(
          "rank %d of %d (%s): %s, sharding %s: weights and norms within %.2g of DDP, "
          "%.2g of one process; optimizer state for %zu of %zu elements%s%s\n",
          ctx.rank(), ctx.size(), sharded.topology.c_str(), name,
          std::string(dtrain::to_string(stage)).c_str(), to_ddp, to_one, sharded.shard_elements,
          ddp.shard_elements, sharded.pages_returned ? "; gradient pages given back" : "",
          ok ? "" : ": FAILED");
      CHECK_MESSAGE(ok, "rank " << ctx.rank() << ": " << name << ", sharding "
                                << dtrain::to_string(stage) << " (the line above)");
      failures += ok ? 0 : 1;
    }
  }
  // Stage 3 layer by layer, prefetch off and on: the same bits as the
  // one-unit stage 3 above; prefetch must gather ahead, and on demand less.
  for (const optimizer_kind kind : {optimizer_kind::sgd, optimizer_kind::adam}) {
    const char* name = kind == optimizer_kind::sgd ? "sgd-momentum" : "adam";
    const result whole = train(ctx, dtrain::sharding::parameters, kind);
    std::uint64_t on_demand_without = 0;
    for (const std::size_t prefetch : {std::size_t{0}, std::size_t{1}, std::size_t{2}}) {
      dtrain::gather_counts counts;
      std::string problem;
      // Prefetch 2 also starts from deferred values, written through shard().
      const bool deferred = prefetch == 2;
      const result layered = train_layered(ctx, kind, prefetch, deferred, counts, problem);
      const double to_whole = distance(layered, whole);
      if (prefetch == 0) on_demand_without = counts.on_demand;
      const bool ahead = ctx.size() == 1 ? counts.prefetched == 0
                         : prefetch == 0
                             ? counts.prefetched == 0
                             : counts.prefetched > 0 && counts.on_demand < on_demand_without;
      const bool ok = to_whole == 0 && problem.empty() && ahead;
      std::printf(
          "rank %d of %d: %s, stage 3 layer by layer, prefetch_units %zu%s: weights %s the "
          "one-unit run's; allgathers on demand %llu, ahead %llu (unused %llu), %llu bytes in%s%s%s\n",
          ctx.rank(), ctx.size(), name, prefetch, deferred ? ", values deferred" : "",
          to_whole == 0 ? "bit-identical to" : "differ from",
          static_cast<unsigned long long>(counts.on_demand),
          static_cast<unsigned long long>(counts.prefetched),
          static_cast<unsigned long long>(counts.unused),
          static_cast<unsigned long long>(counts.bytes), problem.empty() ? "" : "; ",
          problem.c_str(), ok ? "" : ": FAILED");
      CHECK_MESSAGE(ok, "rank " << ctx.rank() << ": " << name << ", layered stage 3, prefetch "
                                << prefetch << " (the line above)");
      failures += ok ? 0 : 1;
    }
  }
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}

/// fp16-style training under dtrain::loss_scaler (issue 49), for `sharding`:
/// the gradients leave backward multiplied by the scale (as a scaled loss
/// makes them), unscale() divides the averaged ones back. At step 1 the last
/// rank's own gradient of w0 is inf before synchronize() (the average spreads
/// it); at step 4 its averaged gradient (its first piece) is NaN after
/// synchronize(), which only it sees (any_rank() must tell the others).
/// With `scaled` false: no scaler, no inf, steps 1 and 4 skipped by hand, the
/// reference: the scales are powers of 2, so the weights must be its bits.
/// `decisions` gets unscale()'s answer per step, `scales` the scale before
/// each step and after the last.
template <class Context>
std::vector<std::vector<float>> train_scaled(Context& ctx, dtrain::sharding sharding, bool scaled,
                                             std::vector<bool>& decisions,
                                             std::vector<double>& scales, std::string& topology) {
  using Policy = typename Context::policy_type;
  constexpr int scaled_steps = 7;
  const bool stage3 = sharding == dtrain::sharding::parameters;
  const bool last = ctx.rank() == ctx.size() - 1;
  linear_model model(stage3);
  dtrain::DistributedDataParallel<linear_model, Policy> ddp(ctx, model, small_buckets(sharding));
  topology = ddp.topology().describe();
  dtrain::loss_scaler scaler({.init_scale = 1024, .growth_interval = 2, .enabled = scaled});
  optimizer opt(optimizer_kind::sgd, ddp.shard_elements());
  for (int step = 0; step < scaled_steps; ++step) {
    scales.push_back(scaler.scale());
    for (std::size_t p = 0; p < parameter_count; ++p) {
      if (p != unused) std::fill_n(model.grad(p), sizes[p], 0.0f);
    }
    {
      auto held = ddp.gather(ddp.parameters());
      model.backward(step, 0, ctx.rank(), ctx.size());
      const auto factor = static_cast<float>(scaler.scale());
      for (std::size_t p = 0; p < parameter_count; ++p) {
        if (p == unused) continue;
        for (std::size_t i = 0; i < sizes[p]; ++i) model.grad(p)[i] *= factor;
      }
      if (scaled && step == 1 && last) model.grad(0)[0] = std::numeric_limits<float>::infinity();
      for (std::size_t p = parameter_count; p-- > 0;) {
        if (p != unused) ddp.mark_ready(p);
      }
    }
    ddp.synchronize();
    if (scaled && step == 4 && last && !ddp.shard().empty())
      static_cast<float*>(ddp.shard()[0].gradients.data)[0] =
          std::numeric_limits<float>::quiet_NaN();
    const bool take = scaled ? scaler.unscale(ddp) : step != 1 && step != 4;
    decisions.push_back(take);
    if (take) {
      opt.begin_step();
      ddp.optimizer_step([&](const dtrain::shard_piece& piece) {
        opt.update(static_cast<float*>(piece.values.data),
                   static_cast<const float*>(piece.gradients.data), piece.values.count,
                   piece.state_offset, 1.0f);
      });
    } else {
      ddp.gather_parameters();  // the step skipped: the values stay
    }
    if (scaled) scaler.update();
  }
  scales.push_back(scaler.scale());
  if (!stage3) return model.w;
  auto held = ddp.gather(ddp.parameters());
  std::vector<std::vector<float>> w(parameter_count);
  for (std::size_t p = 0; p < parameter_count; ++p)
    w[p].assign(model.held[p], model.held[p] + sizes[p]);
  return w;
}

template <class Context>
int run_scaled(Context& ctx) {
  int failures = 0;
  const std::vector<bool> want_decisions = {true, false, true, true, false, true, true};
  const std::vector<double> want_scales = {1024, 1024, 512, 512, 1024, 512, 512, 1024};
  for (const dtrain::sharding stage : {dtrain::sharding::none, dtrain::sharding::optimizer,
                                       dtrain::sharding::gradients, dtrain::sharding::parameters}) {
    std::vector<bool> decisions, unused_decisions;
    std::vector<double> scales, unused_scales;
    std::string topology;
    const auto got = train_scaled(ctx, stage, true, decisions, scales, topology);
    const auto want = train_scaled(ctx, stage, false, unused_decisions, unused_scales, topology);
    const bool same = got == want;
    // Every rank the same weights: the sum of each rank's bits over the ranks
    // equals size() times this rank's.
    std::vector<std::int64_t> checksum = {0};
    for (const auto& w : got)
      for (const float x : w) checksum[0] += std::bit_cast<std::int32_t>(x);
    const std::int64_t mine = checksum[0];
    dtrain::allreduce(ctx.communicator(), checksum, dtrain::reduce_op::sum).wait();
    const bool everywhere = checksum[0] == mine * ctx.size();
    const bool ok = same && everywhere && decisions == want_decisions && scales == want_scales;
    std::string trace;
    for (const double x : scales) {  // (not " " + to_string: GCC 12's -Wrestrict misfires)
      trace += ' ';
      trace += std::to_string(static_cast<int>(x));
    }
    std::printf(
        "rank %d of %d: loss_scaler, sharding %s, %s: steps 1 and 4 %s, scales%s; weights %s "
        "the unscaled run's with those steps skipped%s%s\n",
        ctx.rank(), ctx.size(), std::string(dtrain::to_string(stage)).c_str(), topology.c_str(),
        decisions == want_decisions ? "skipped on this rank, the others taken"
                                    : "NOT skipped as they should be",
        trace.c_str(), same ? "bit-identical to" : "differ from",
        everywhere ? "" : "; the ranks' weights differ", ok ? "" : ": FAILED");
    CHECK_MESSAGE(ok, "rank " << ctx.rank() << ": loss_scaler, sharding "
                              << dtrain::to_string(stage) << " (the line above)");
    failures += ok ? 0 : 1;
  }
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}

// ---- Case "master_weights" (issue 49): 16-bit models with float32 master weights.

/// A model of 16-bit parameters (bfloat16 or float16; sizes no world size
/// divides, one larger than a shard), every value 1.0 at the start; at
/// stage 3 the value pointers are DDP's (at its fence outside a gather()).
template <class T>
struct half_model {
  static constexpr std::size_t half_sizes[] = {1, 700, 3001, 33};
  std::vector<std::vector<T>> w, g;
  std::vector<T*> values, grads;
  half_model() {
    for (const std::size_t n : half_sizes) {
      w.emplace_back(n, T(1.0f));
      g.emplace_back(n, T(0.0f));
    }
    for (std::size_t p = 0; p < w.size(); ++p) {
      values.push_back(w[p].data());
      grads.push_back(g[p].data());
    }
  }
  std::vector<dtrain::parameter> parameters() {
    std::vector<dtrain::parameter> out;
    for (std::size_t p = 0; p < w.size(); ++p) {
      std::string name = "h";  // (not "h" + to_string: GCC 12's -Wrestrict misfires at -O2)
      name += std::to_string(p);
      out.push_back(dtrain::param(name, values[p], half_sizes[p], grads[p]));
    }
    return out;
  }
};

/// Rank r's gradient of element i at `step`: 0.5, 0.75, 1 or 1.25 (exact in 16 bits).
float half_gradient(std::size_t i, int rank, int step) {
  return 0.5f +
         0.25f * static_cast<float>(
                     (i + static_cast<std::size_t>(rank) + static_cast<std::size_t>(step)) % 4);
}

constexpr int half_steps = 7;           // not a whole number of the gradients' 4-step cycle
constexpr float half_lr = 1.0f / 1024;  // below half a bfloat16 step at 1.0: 16-bit SGD stalls

/// Element i after `steps` SGD steps on the exact mean (double): what
/// float32 master weights must follow.
double half_reference(std::size_t i, int size, int steps) {
  double v = 1.0;
  for (int step = 0; step < steps; ++step) {
    double sum = 0;
    for (int r = 0; r < size; ++r) sum += half_gradient(i, r, step);
    v -= static_cast<double>(half_lr) * (sum / size);
  }
  return v;
}

/// One step of a half_model: each rank's gradients of `step` (inside a
/// gather(), as stage 3 needs), the mean, then SGD on each piece's float32
/// master, or (no master copy) on its 16-bit values.
template <class Context, class DDP, class T>
void half_step(Context& ctx, DDP& ddp, half_model<T>& model, int step) {
  {
    auto held = ddp.gather(ddp.parameters());
    for (std::size_t p = 0; p < model.g.size(); ++p) {
      for (std::size_t i = 0; i < model.g[p].size(); ++i)
        model.grads[p][i] = T(half_gradient(i, ctx.rank(), step));
    }
    for (std::size_t p = model.g.size(); p-- > 0;) ddp.mark_ready(p);
  }
  ddp.synchronize();
  ddp.optimizer_step([&](const dtrain::shard_piece& piece) {
    const T* mean = static_cast<const T*>(piece.gradients.data);
    if (piece.master.type == dtrain::dtype::float32) {
      float* w = static_cast<float*>(piece.master.data);
      for (std::size_t i = 0; i < piece.master.count; ++i)
        w[i] -= half_lr * static_cast<float>(mean[i]);
    } else {  // no master copy: SGD in 16 bits
      T* w = static_cast<T*>(piece.values.data);
      for (std::size_t i = 0; i < piece.values.count; ++i)
        w[i] = T(static_cast<float>(w[i]) - half_lr * static_cast<float>(mean[i]));
    }
  });
}

struct half_result {
  std::vector<std::vector<std::uint16_t>> values;  // every parameter, whole, as bits
  std::vector<float> master;                       // this rank's pieces', in shard order
  std::size_t master_bytes = 0;
  double worst = 0;     // the largest |master - reference| over this rank's pieces
  bool rounded = true;  // every piece's values are its master rounded once
  std::string topology;
};

/// Trains a half_model<T> `half_steps` steps at `sharding`, master weights
/// on or off (off: SGD on the 16-bit values themselves). `restart_at` >= 0:
/// a checkpoint (dtrain::checkpoint: the shard's master weights,
/// add_sharded("master", ddp), and below stage 3 the model's 16-bit values)
/// is saved after that many steps, the run goes on to the end, the model's
/// values are zeroed, the checkpoint restored and the steps after it run
/// again: the result must be the same bits.
template <class T, class Context>
half_result train_half(Context& ctx, dtrain::sharding sharding, bool master, int restart_at) {
  using Policy = typename Context::policy_type;
  const bool stage3 = sharding == dtrain::sharding::parameters;
  half_model<T> model;
  dtrain::ddp_options options = small_buckets(sharding);
  options.master_weights = master;
  dtrain::DistributedDataParallel<half_model<T>, Policy> ddp(ctx, model, options);
  half_result out;
  out.topology = ddp.topology().describe();
  out.master_bytes = ddp.memory_use().master;
  auto run = [&](int from, int to) {
    for (int step = from; step < to; ++step) half_step(ctx, ddp, model, step);
  };
  auto whole_values = [&] {
    std::vector<std::vector<T>> whole(model.w.size());
    auto held = ddp.gather(ddp.parameters());
    for (std::size_t p = 0; p < whole.size(); ++p)
      whole[p].assign(model.values[p], model.values[p] + model.w[p].size());
    return whole;
  };
  if (restart_at < 0) {
    run(0, half_steps);
  } else {
    // A checkpoint as a 16-bit job writes one: the master weights of the
    // shard (float32, sharded) and, below stage 3, the model's values.
    std::array<std::int64_t, 1> id{static_cast<std::int64_t>(::getpid())};
    std::vector<std::int64_t> ids(static_cast<std::size_t>(ctx.size()));
    ctx.control_plane().allgather(id, ids);
    std::string dir = "/tmp/dtrain-master-";  // (one piece at a time: GCC 12's -Wrestrict)
    dir += std::to_string(ids[0]);
    dir += '-';
    dir += dtrain::to_string(sharding);
    dir += '-';
    dir += std::to_string(sizeof(T));
    {
      dtrain::checkpoint ckpt(ctx.control_plane(), {.dir = dir, .quiet = true});
      if (!stage3) ckpt.add(model.parameters());
      ckpt.add_sharded("master", ddp);
      run(0, restart_at);
      ckpt.save();
      run(restart_at, half_steps);
      for (auto& w : model.w) std::fill(w.begin(), w.end(), T(0.0f));  // what the restore replaces
      CHECK(ckpt.restore().has_value());
      run(restart_at, half_steps);
    }
    ctx.barrier();
    if (ctx.rank() == 0) std::filesystem::remove_all(dir);
  }
  for (const auto& whole : whole_values()) {
    out.values.emplace_back();
    for (const T x : whole) out.values.back().push_back(x.bits);
  }
  for (const dtrain::shard_piece& piece : ddp.shard()) {
    const T* v = static_cast<const T*>(piece.values.data);
    for (std::size_t i = 0; i < piece.values.count; ++i) {
      const float m = piece.master.type == dtrain::dtype::float32
                          ? static_cast<const float*>(piece.master.data)[i]
                          : static_cast<float>(v[i]);
      out.master.push_back(m);
      out.rounded = out.rounded && T(m) == v[i];
      const double want = half_reference(piece.offset + i, ctx.size(), half_steps);
      out.worst = std::max(out.worst, std::fabs(static_cast<double>(m) - want));
    }
  }
  return out;
}

template <class T, class Context>
int run_half(Context& ctx, const char* type_name) {
  int failures = 0;
  constexpr double tolerance = 2e-4;  // 7 steps of a mean rounded in 16 bits, times half_lr
  for (const dtrain::sharding stage : {dtrain::sharding::none, dtrain::sharding::optimizer,
                                       dtrain::sharding::gradients, dtrain::sharding::parameters}) {
    const half_result got = train_half<T>(ctx, stage, true, -1);
    const half_result again = train_half<T>(ctx, stage, true, half_steps / 2);
    // Every rank the same values: the sum of each rank's bits over the ranks
    // equals size() times this rank's.
    std::vector<std::int64_t> checksum = {0};
    std::size_t moved = 0, total = 0;
    for (const auto& w : got.values) {
      for (const std::uint16_t x : w) {
        checksum[0] += x;
        moved += x != T(1.0f).bits ? 1 : 0;
        ++total;
      }
    }
    const std::int64_t mine = checksum[0];
    dtrain::allreduce(ctx.communicator(), checksum, dtrain::reduce_op::sum).wait();
    const bool everywhere = checksum[0] == mine * ctx.size();
    const bool resumed = again.values == got.values && again.master == got.master;
    const bool ok = got.worst <= tolerance && got.rounded && everywhere && resumed &&
                    moved == total && got.master_bytes > 0;
    std::printf(
        "rank %d of %d: master_weights, %s, sharding %s, %s: master %zu bytes, within %.2g of "
        "the exact SGD (tolerance %.0e), values %s, %zu of %zu moved from 1.0%s; resumed from "
        "step %d: %s%s\n",
        ctx.rank(), ctx.size(), type_name, std::string(dtrain::to_string(stage)).c_str(),
        got.topology.c_str(), got.master_bytes, got.worst, tolerance,
        got.rounded ? "the master rounded once" : "NOT the master rounded", moved, total,
        everywhere ? ", the same on every rank" : ", DIFFERENT across ranks", half_steps / 2,
        resumed ? "the same bits" : "DIFFERENT bits", ok ? "" : ": FAILED");
    CHECK_MESSAGE(ok, "rank " << ctx.rank() << ": master_weights, " << type_name << ", sharding "
                              << dtrain::to_string(stage) << " (the line above)");
    failures += ok ? 0 : 1;
  }
  return failures;
}

/// Values written by the program between steps (a restore of the 16-bit
/// values alone, an initialisation through shard()) are adopted on the
/// host: after 3 steps every value of the rank's pieces is set to 2.0, and
/// one more step must start from it (the master 2 - lr * mean, the value
/// 2.0 again), not from the stale master near 0.99.
template <class Context>
bool adopts_written_values(Context& ctx, dtrain::sharding sharding) {
  using Policy = typename Context::policy_type;
  using T = dtrain::bfloat16;
  half_model<T> model;
  dtrain::ddp_options options = small_buckets(sharding);
  options.master_weights = true;
  dtrain::DistributedDataParallel<half_model<T>, Policy> ddp(ctx, model, options);
  for (int s = 0; s < 3; ++s) half_step(ctx, ddp, model, s);
  for (const dtrain::shard_piece& piece : ddp.shard())
    std::fill_n(static_cast<T*>(piece.values.data), piece.values.count, T(2.0f));
  half_step(ctx, ddp, model, 3);
  bool ok = true;
  for (const dtrain::shard_piece& piece : ddp.shard()) {
    const auto* w = static_cast<const float*>(piece.master.data);
    const auto* v = static_cast<const T*>(piece.values.data);
    for (std::size_t i = 0; i < piece.values.count; ++i) {
      double sum = 0;
      for (int r = 0; r < ctx.size(); ++r) sum += half_gradient(piece.offset + i, r, 3);
      const double want = 2.0 - static_cast<double>(half_lr) * sum / ctx.size();
      ok = ok && std::fabs(static_cast<double>(w[i]) - want) <= 1e-5 && v[i] == T(2.0f);
    }
  }
  return ok;
}

template <class Context>
int run_master(Context& ctx) {
  int failures =
      run_half<dtrain::bfloat16>(ctx, "bfloat16") + run_half<dtrain::float16>(ctx, "float16");
  // Why: the same SGD on bfloat16 values without a master copy never moves
  // them (each update is below half a bfloat16 step at 1.0, and rounds away).
  const half_result stalled =
      train_half<dtrain::bfloat16>(ctx, dtrain::sharding::gradients, false, -1);
  std::size_t moved = 0;
  for (const auto& w : stalled.values)
    for (const std::uint16_t x : w) moved += x != dtrain::bfloat16(1.0f).bits ? 1 : 0;
  const bool stalls = moved == 0 && stalled.master_bytes == 0;
  std::printf("rank %d of %d: without master_weights, bfloat16 SGD moved %zu values from 1.0%s\n",
              ctx.rank(), ctx.size(), moved, stalls ? " (as expected: it stalls)" : ": UNEXPECTED");
  CHECK_MESSAGE(stalls, "rank " << ctx.rank() << ": bfloat16 without master weights");
  failures += stalls ? 0 : 1;
  for (const dtrain::sharding stage : {dtrain::sharding::none, dtrain::sharding::optimizer,
                                       dtrain::sharding::gradients, dtrain::sharding::parameters}) {
    const bool adopted = adopts_written_values(ctx, stage);
    std::printf("rank %d of %d: master_weights, sharding %s: values written between steps %s\n",
                ctx.rank(), ctx.size(), std::string(dtrain::to_string(stage)).c_str(),
                adopted ? "adopted (the master starts again from them)"
                        : "NOT adopted: a stale master rounded over them");
    CHECK_MESSAGE(adopted, "rank " << ctx.rank() << ": written values, sharding "
                                   << dtrain::to_string(stage));
    failures += adopted ? 0 : 1;
  }
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}

// ---- Cases "outside-read" and "outside-write" (issue 48) ---------------------

sigjmp_buf back_from_fault;
volatile sig_atomic_t armed = 0;  // the next fault is the one expected
volatile sig_atomic_t faults_before = 0;

/// The program's own handler: the expected fault returns to the jump;
/// any other dies of it as it would have (a test that fails, not a loop).
extern "C" void note_fault_and_return(int sig, siginfo_t*, void*) {
  if (!armed) {
    std::signal(sig, SIG_DFL);
    return;
  }
  armed = 0;
  faults_before = faults_before + 1;
  siglongjmp(back_from_fault, 1);
}

/// A fault on a page of the program's own goes to the handler installed
/// before DDP's; then a stage-3 parameter read (or written) outside a gather()
/// ends the rank by name. Returns only if it did not.
template <class Context>
int run_outside(Context& ctx, bool write) {
  using Policy = typename Context::policy_type;
  struct sigaction mine {};
  mine.sa_sigaction = note_fault_and_return;
  mine.sa_flags = SA_SIGINFO;
  sigemptyset(&mine.sa_mask);
  ::sigaction(SIGSEGV, &mine, nullptr);
  linear_model model(true);
  model.units = true;  // parameter p is unit p
  dtrain::DistributedDataParallel<linear_model, Policy> ddp(
      ctx, model, {.sharding = dtrain::sharding::parameters});
  {
    auto held = ddp.gather({std::size_t{1}});
    const volatile float* inside = model.held[1];
    if (!(inside[3] == static_cast<float>(0.1 * hash_unit(1, 3)))) {
      std::printf("rank %d: a gathered value is wrong\n", ctx.rank());
      return 1;
    }
  }
  void* page = ::mmap(nullptr, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED) return 1;
  if (sigsetjmp(back_from_fault, 1) == 0) {
    armed = 1;
    [[maybe_unused]] const float x = *static_cast<const volatile float*>(page);
  }
  ::munmap(page, 4096);
  std::printf("rank %d: a fault elsewhere reached the handler installed before DDP's (%d)\n",
              ctx.rank(), static_cast<int>(faults_before));
  std::fflush(stdout);
  volatile float* outside = model.held[1];
  if (write) {
    outside[3] = 1.0f;
  } else {
    std::printf("rank %d: read %g\n", ctx.rank(), static_cast<double>(outside[3]));
  }
  std::printf("rank %d: a value outside a gather() was %s unnamed\n", ctx.rank(),
              write ? "written" : "read");
  return 1;
}

}  // namespace

TEST_CASE("outside-read") {
  dtrain_test::end_job(dtrain_test::run_job([](auto& ctx) { return run_outside(ctx, false); }));
}

TEST_CASE("outside-write") {
  dtrain_test::end_job(dtrain_test::run_job([](auto& ctx) { return run_outside(ctx, true); }));
}

TEST_CASE("sharding") {
  CHECK(dtrain_test::run_job(
            [](auto& ctx) { return run_case(ctx, dtrain_test::job().topology); }) == 0);
}

TEST_CASE("loss_scaler") {
  CHECK(dtrain_test::run_job([](auto& ctx) { return run_scaled(ctx); }) == 0);
}

TEST_CASE("accumulate") {
  CHECK(dtrain_test::run_job([](auto& ctx) {
          return dtrain_test::accumulate_case(
              ctx, {}, dtrain_test::job().topology == "hierarchical",
              {dtrain::sharding::none, dtrain::sharding::optimizer, dtrain::sharding::gradients,
               dtrain::sharding::parameters});
        }) == 0);
}

TEST_CASE("master_weights") {
  CHECK(dtrain_test::run_job([](auto& ctx) { return run_master(ctx); }) == 0);
}
