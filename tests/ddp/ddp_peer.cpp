// dtrain_ddp_peer: DistributedDataParallel across ranks, one doctest case per
// job, run in every rank through dtrain::run (tests/support/multirank.hpp):
//
//   mpirun -n N dtrain_ddp_peer --engine=mpi --test-case=<case>
//   dtrain_test_launch N dtrain_ddp_peer --engine=gloo [--topology=hierarchical] --test-case=<case>
//
// With --topology=hierarchical the policy's topology is topology::hierarchical
// (run the ranks as several nodes: dtrain_test_launch --nodes 2,2, or a
// simulated cluster); every case must give the same results as with the flat
// topology. tests/ddp/ddp.cmake registers each case (dtrain_add_multirank_test).
//
// Cases that must pass (every rank prints what it checked):
//   mean      gradients equal the exact mean over ranks, for several bucket caps,
//             ready orders and steps (the rebuild included), both gradient modes;
//             rank 0's parameters and buffers everywhere after construction; zero_grad
//   features  no_sync accumulation, bf16/fp16 compression, find_unused_parameters
//             (and rank 0's one-line report of what no rank marked), a communication hook
//   interleaved  the user's own allreduce on the same communicator between
//             mark_ready calls (buckets in flight): both results must be right
//   many_buckets  a bucket per parameter: the exact mean after every step
//   topology  the policy's topology group on its own: allreduce of every op and
//             element type, counts that divide by the ranks per node and counts
//             that leave a remainder, in one piece and (hierarchical, above
//             64 KiB) in pipelined chunks, equal to the same allreduce run flat
// Cases whose training function must fail: the job ends with dtrain::run's exit
// status, and the test checks it and what the ranks printed (tests/scripts/check_job.cmake):
//   twice           a parameter marked ready twice
//   unmarked        synchronize() with a parameter never marked
//   unknown         mark_ready of a name the model does not have
//   mismatch-name   the last rank names parameter 7 differently
//   mismatch-shape  the last rank's parameter 4 has one element more
//
// Gradients are integers chosen so that every sum and mean is exact in float
// (and in bf16/fp16 for the compression cases): results are compared with ==.

#include "../support/multirank.hpp"

#include <dtrain/dtrain.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <unistd.h>

namespace {

enum class kind : std::uint8_t { view_f, copy_f, view_d, copy_d };

struct spec {
  kind k;
  std::size_t count;
  std::string name;
};

constexpr std::size_t parameter_count = 38;

/// The model's layout: mostly float parameters whose gradient is a pointer dtrain
/// may move (view), every fifth one a gradient buffer the model keeps (copy), and
/// two double parameters (a second element type, hence a second bucket group).
std::vector<spec> layout(int rank, int size, std::string_view mutation) {
  std::vector<spec> specs;
  for (std::size_t p = 0; p < parameter_count; ++p) {
    kind k = p == 6       ? kind::view_d
             : p == 17    ? kind::copy_d
             : p % 5 == 1 ? kind::copy_f
                          : kind::view_f;
    std::size_t count = 1 + (p * p * 37 + 11 * p) % 700;
    if (p % 9 == 4) count = 3000 + p;  // a few large ones: alone in their buckets at small caps
    if (p == 2) count = 1;
    const char* label = k == kind::view_f   ? "view"
                        : k == kind::copy_f ? "copy"
                        : k == kind::view_d ? "view64"
                                            : "copy64";
    char name[32];
    std::snprintf(name, sizeof name, "layer%02zu.%s", p, label);
    specs.push_back({k, count, name});
  }
  const bool last = rank == size - 1;
  if (last && mutation == "mismatch-name") specs[7].name = "layer07.renamed";
  if (last && mutation == "mismatch-shape") specs[4].count += 1;
  return specs;
}

float value_init(int rank, std::size_t p, std::size_t i) {
  return static_cast<float>(rank * 100000 + static_cast<int>(p) * 100 + static_cast<int>(i % 100));
}
float grad_init(int rank, std::size_t p, std::size_t i) {
  return static_cast<float>(rank * 3 + static_cast<int>(p) + static_cast<int>(i % 5));
}

/// A toy model: values, gradients and buffers, shown to dtrain through parameters() and buffers().
struct toy_model {
  std::vector<spec> specs;
  std::vector<std::vector<float>> fvalues;
  std::vector<std::vector<double>> dvalues;
  std::vector<float*> fptr;  // view-mode gradients (may be repointed by dtrain)
  std::vector<double*> dptr;
  std::vector<std::vector<float>> fgrad;  // copy-mode gradients, or a view's initial storage
  std::vector<std::vector<double>> dgrad;
  std::vector<bool> had_storage;  // the view started with a gradient of the model's own
  std::vector<float> running;
  std::vector<std::int64_t> counter;

  /// `null_gradients`: every third view parameter starts with a null gradient pointer.
  toy_model(int rank, int size, bool null_gradients, std::string_view mutation = {})
      : specs(layout(rank, size, mutation)),
        fvalues(parameter_count),
        dvalues(parameter_count),
        fptr(parameter_count, nullptr),
        dptr(parameter_count, nullptr),
        fgrad(parameter_count),
        dgrad(parameter_count),
        had_storage(parameter_count, false),
        running(50),
        counter{rank * 7 + 1} {
    for (std::size_t p = 0; p < parameter_count; ++p) {
      const spec& s = specs[p];
      const bool is_double = s.k == kind::view_d || s.k == kind::copy_d;
      const bool is_view = s.k == kind::view_f || s.k == kind::view_d;
      const bool storage = !is_view || !null_gradients || p % 3 != 0;
      for (std::size_t i = 0; i < s.count; ++i) {
        if (is_double) {
          dvalues[p].push_back(value_init(rank, p, i));
          if (storage) dgrad[p].push_back(grad_init(rank, p, i));
        } else {
          fvalues[p].push_back(value_init(rank, p, i));
          if (storage) fgrad[p].push_back(grad_init(rank, p, i));
        }
      }
      if (is_view && storage) {
        had_storage[p] = true;
        if (is_double)
          dptr[p] = dgrad[p].data();
        else
          fptr[p] = fgrad[p].data();
      }
    }
    for (std::size_t i = 0; i < running.size(); ++i)
      running[i] = static_cast<float>(rank * 1000 + static_cast<int>(i));
  }

  std::vector<dtrain::parameter> parameters() {
    std::vector<dtrain::parameter> out;
    for (std::size_t p = 0; p < parameter_count; ++p) {
      const spec& s = specs[p];
      switch (s.k) {
        case kind::view_f: out.push_back(dtrain::param(s.name, fvalues[p], fptr[p])); break;
        case kind::copy_f: out.push_back(dtrain::param(s.name, fvalues[p], fgrad[p])); break;
        case kind::view_d: out.push_back(dtrain::param(s.name, dvalues[p], dptr[p])); break;
        case kind::copy_d: out.push_back(dtrain::param(s.name, dvalues[p], dgrad[p])); break;
      }
    }
    return out;
  }
  std::vector<dtrain::parameter> buffers() {
    return {dtrain::param("bn.running_mean", running), dtrain::param("steps", counter)};
  }

  /// The gradient as the model sees it now (through its own pointer or buffer).
  double grad(std::size_t p, std::size_t i) const {
    switch (specs[p].k) {
      case kind::view_f: return fptr[p][i];
      case kind::copy_f: return fgrad[p][i];
      case kind::view_d: return dptr[p][i];
      case kind::copy_d: return dgrad[p][i];
    }
    return 0;
  }
  void set_grad(std::size_t p, std::size_t i, double v) {
    switch (specs[p].k) {
      case kind::view_f: fptr[p][i] = static_cast<float>(v); break;
      case kind::copy_f: fgrad[p][i] = static_cast<float>(v); break;
      case kind::view_d: dptr[p][i] = v; break;
      case kind::copy_d: dgrad[p][i] = v; break;
    }
  }
  double value(std::size_t p, std::size_t i) const {
    return specs[p].k == kind::view_d || specs[p].k == kind::copy_d ? dvalues[p][i] : fvalues[p][i];
  }
  std::size_t count(std::size_t p) const { return specs[p].count; }
  bool is_float(std::size_t p) const {
    return specs[p].k == kind::view_f || specs[p].k == kind::copy_f;
  }
  bool is_view(std::size_t p) const {
    return specs[p].k == kind::view_f || specs[p].k == kind::view_d;
  }
};

/// Collects mismatches; prints the first few, then a count.
struct checker {
  int rank;
  std::string where;
  std::size_t failures = 0;
  std::size_t checked = 0;

  void expect(bool ok, const std::string& what) {
    ++checked;
    if (ok) return;
    if (++failures <= 8) FAIL_CHECK("rank " << rank << ": " << where << ": " << what);
  }
  void equal(double got, double expected, const std::string& what) {
    ++checked;
    if (got == expected) return;
    if (++failures <= 8) {
      char numbers[64];
      std::snprintf(numbers, sizeof numbers, "%.9g, expected %.9g", got, expected);
      FAIL_CHECK("rank " << rank << ": " << where << ": " << what << " is " << numbers);
    }
  }
};

/// Collects what this process writes to stderr (fd 2) from construction to end().
class stderr_capture {
 public:
  stderr_capture() {
    std::fflush(stderr);
    std::snprintf(path_, sizeof path_, "%s", "/tmp/dtrain-ddp-peer-stderr.XXXXXX");
    file_ = ::mkstemp(path_);
    saved_ = ::dup(2);
    if (file_ >= 0) ::dup2(file_, 2);
  }
  stderr_capture(const stderr_capture&) = delete;
  stderr_capture& operator=(const stderr_capture&) = delete;
  ~stderr_capture() { (void)end(); }
  std::string end() {
    if (saved_ < 0) return text_;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
    if (file_ >= 0) {
      char chunk[4096];
      ::lseek(file_, 0, SEEK_SET);
      for (ssize_t n; (n = ::read(file_, chunk, sizeof chunk)) > 0;)
        text_.append(chunk, static_cast<std::size_t>(n));
      ::close(file_);
      ::unlink(path_);
    }
    return text_;
  }

 private:
  char path_[64];
  int file_ = -1;
  int saved_ = -1;
  std::string text_;
};

std::string at(const toy_model& m, std::size_t p, std::size_t i) {
  return m.specs[p].name + "[" + std::to_string(i) + "]";
}

/// Rank r's gradient in step s: ((i + 7p + 3s) % 13 + 1) * (r + 1) * N, whose mean
/// over ranks is the integer ((i + 7p + 3s) % 13 + 1) * N(N+1)/2.
double local_grad(int rank, int size, std::size_t p, std::size_t i, int step) {
  return static_cast<double>(((i + 7 * p + 3 * static_cast<std::size_t>(step)) % 13 + 1) *
                             static_cast<std::size_t>(rank + 1) * static_cast<std::size_t>(size));
}
double mean_grad(int size, std::size_t p, std::size_t i, int step) {
  return static_cast<double>(((i + 7 * p + 3 * static_cast<std::size_t>(step)) % 13 + 1) *
                             static_cast<std::size_t>(size * (size + 1) / 2));
}

template <class DDP>
void check_buckets(DDP& ddp, checker& c) {
  std::vector<int> seen(parameter_count, 0);
  for (const auto& b : ddp.buckets()) {
    for (std::size_t p : b.parameters) {
      if (p < parameter_count) ++seen[p];
      c.expect(p < parameter_count && ddp.parameters()[p].values.type == b.type,
               "bucket of " + std::string(dtrain::to_string(b.type)) + " holds parameter #" +
                   std::to_string(p));
    }
  }
  for (std::size_t p = 0; p < parameter_count; ++p) {
    c.expect(seen[p] == 1,
             "parameter #" + std::to_string(p) + " is in " + std::to_string(seen[p]) + " buckets");
  }
}

/// The order the gradients of step `step` become ready in: kind 0 reverse (as a
/// backward pass), 1 shuffled alike on every rank, 2 shuffled differently on
/// every rank, 3 forward.
std::vector<std::size_t> ready_order(int kind, int step, int rank) {
  std::vector<std::size_t> order(parameter_count);
  std::iota(order.begin(), order.end(), std::size_t{0});
  switch (kind % 4) {
    case 0: std::reverse(order.begin(), order.end()); break;  // as backward produces them
    case 1:
      std::shuffle(order.begin(), order.end(), std::mt19937(100u + static_cast<unsigned>(step)));
      break;
    case 2:  // every rank its own order: buckets still launch in bucket order
      std::shuffle(order.begin(), order.end(),
                   std::mt19937(200u + static_cast<unsigned>(step * 31 + rank * 7919)));
      break;
    default: break;  // forward
  }
  return order;
}

/// After step s's synchronize(): every gradient is the mean over the ranks, times `scale`.
void check_means(const toy_model& m, int size, int s, checker& c, double scale = 1) {
  for (std::size_t p = 0; p < parameter_count; ++p) {
    for (std::size_t i = 0; i < m.count(p); ++i) {
      c.equal(m.grad(p, i), mean_grad(size, p, i, s) * scale,
              "step " + std::to_string(s) + ": gradient " + at(m, p, i));
    }
  }
}

/// One synchronized step: writes each gradient, marks it (through a different
/// mark_ready overload per step), synchronizes, and checks the mean.
template <class DDP>
void step(DDP& ddp, toy_model& m, int rank, int size, int s, int order_kind, checker& c) {
  const auto order = ready_order(order_kind, s, rank);
  std::vector<std::size_t> group;
  for (std::size_t k = 0; k < order.size(); ++k) {
    const std::size_t p = order[k];
    for (std::size_t i = 0; i < m.count(p); ++i) m.set_grad(p, i, local_grad(rank, size, p, i, s));
    switch (s % 4) {
      case 0: ddp.mark_ready(p); break;
      case 1: ddp.mark_ready(m.specs[p].name); break;
      case 2: ddp.mark_ready(ddp.parameters()[p]); break;
      default:
        group.push_back(p);
        if (group.size() == 5 || k + 1 == order.size()) {
          ddp.mark_ready(group);
          group.clear();
        }
    }
  }
  ddp.synchronize();
  check_means(m, size, s, c);
}

struct mean_config {
  const char* label;
  dtrain::ddp_options options;
  int first_order = 1;  // the ready order of step 0, which the rebuild follows (see ready_order)
  bool null_gradients = true;
  bool through_communicator = false;
};

template <class Policy>
int mean_case(dtrain::context<Policy>& ctx) {
  const int rank = ctx.rank(), size = ctx.size();
  const mean_config configs[] = {
      {"cap 0.0001 MiB", {.bucket_cap_mb = 0.0001, .first_bucket_cap_mb = 0.0001}},
      {"cap 0.01 MiB, first 0.002 MiB, from the communicator",
       {.bucket_cap_mb = 0.01, .first_bucket_cap_mb = 0.002},
       1,
       true,
       true},
      {"cap 0.01 MiB, first 0.002 MiB, step 0 in a different order on every rank",
       {.bucket_cap_mb = 0.01, .first_bucket_cap_mb = 0.002},
       2},
      {"default options (cap 25 MiB), backward order", {}, 0},
      {"gradient_as_bucket_view=false, cap 0.05 MiB",
       {.bucket_cap_mb = 0.05, .first_bucket_cap_mb = 0.01, .gradient_as_bucket_view = false},
       1,
       false},
      {"overlap=false, cap 0.01 MiB",
       {.bucket_cap_mb = 0.01, .first_bucket_cap_mb = 0.002, .overlap = false}},
      {"rebuild_buckets=false, broadcast_parameters=false, cap 0.01 MiB",
       {.bucket_cap_mb = 0.01,
        .first_bucket_cap_mb = 0.002,
        .rebuild_buckets = false,
        .broadcast_parameters = false}},
  };
  std::size_t failures = 0;
  for (const mean_config& config : configs) {
    checker c{rank, config.label};
    toy_model m(rank, size, config.null_gradients);
    constexpr int steps = 5;
    std::size_t initial_buckets = 0, final_buckets = 0;
    {
      auto make = [&] {
        if (config.through_communicator) {
          return std::make_unique<dtrain::DistributedDataParallel<toy_model, Policy>>(
              ctx.communicator(), m, config.options);
        }
        return std::make_unique<dtrain::DistributedDataParallel<toy_model, Policy>>(ctx, m,
                                                                                    config.options);
      };
      auto ddp_owner = make();
      auto& ddp = *ddp_owner;
      c.expect(&ddp.module() == &m, "module() is the model");
      c.expect(ddp.parameters().size() == parameter_count,
               "parameters() has " + std::to_string(ddp.parameters().size()) + " entries");
      initial_buckets = ddp.buckets().size();
      check_buckets(ddp, c);

      // Rank 0's values and buffers everywhere (or each rank's own without broadcast_parameters).
      const int source = config.options.broadcast_parameters ? 0 : rank;
      for (std::size_t p = 0; p < parameter_count; ++p) {
        for (std::size_t i = 0; i < m.count(p); ++i) {
          c.equal(m.value(p, i), value_init(source, p, i),
                  "value " + at(m, p, i) + " after construction");
          // A gradient keeps its values when dtrain moves it; a null one starts at zero.
          const double g0 = m.is_view(p) && !m.had_storage[p] ? 0.0 : grad_init(rank, p, i);
          c.equal(m.grad(p, i), g0, "gradient " + at(m, p, i) + " after construction");
        }
      }
      for (std::size_t i = 0; i < m.running.size(); ++i) {
        c.equal(m.running[i], source * 1000 + static_cast<int>(i),
                "buffer bn.running_mean[" + std::to_string(i) + "]");
      }
      c.equal(static_cast<double>(m.counter[0]), source * 7 + 1, "buffer steps[0]");

      for (int s = 0; s < steps - 1; ++s) {
        step(ddp, m, rank, size, s, config.first_order + s, c);
        if (s == 0 && config.options.rebuild_buckets) {
          // Rebuilt along rank 0's ready order of step 0, the same on every rank.
          const auto expected = dtrain::detail::assign_buckets(
              ddp.parameters(), ready_order(config.first_order, 0, 0),
              dtrain::mib_to_bytes(config.options.first_bucket_cap_mb, "first_bucket_cap_mb"),
              dtrain::mib_to_bytes(config.options.bucket_cap_mb, "bucket_cap_mb"));
          bool same = expected.size() == ddp.buckets().size();
          for (std::size_t b = 0; same && b < expected.size(); ++b) {
            same = expected[b].parameters == ddp.buckets()[b].parameters;
          }
          c.expect(same, "after step 0 the buckets follow rank 0's ready order");
        }
        c.expect(ddp.steps() == static_cast<std::size_t>(s + 1),
                 "steps() is " + std::to_string(ddp.steps()) + " after " + std::to_string(s + 1) +
                     " steps");
        c.expect(ddp.buckets_rebuilt() == config.options.rebuild_buckets,
                 std::string("buckets_rebuilt() is ") + (ddp.buckets_rebuilt() ? "true" : "false") +
                     " after step " + std::to_string(s));
      }
      check_buckets(ddp, c);
      final_buckets = ddp.buckets().size();

      ddp.zero_grad();
      for (std::size_t p = 0; p < parameter_count; ++p) {
        for (std::size_t i = 0; i < m.count(p); ++i)
          c.equal(m.grad(p, i), 0.0, "after zero_grad(): gradient " + at(m, p, i));
      }
      step(ddp, m, rank, size, steps - 1, config.first_order + steps - 1, c);
      // Values are the optimizer's business: synchronize() never touches them.
      for (std::size_t p = 0; p < parameter_count; ++p) {
        c.equal(m.value(p, m.count(p) - 1), value_init(source, p, m.count(p) - 1),
                "value " + at(m, p, m.count(p) - 1));
      }
    }
    // After DistributedDataParallel is gone, the model's own gradient buffers hold the last mean.
    for (std::size_t p = 0; p < parameter_count; ++p) {
      if (m.is_view(p) && !m.had_storage[p]) {
        c.expect((m.is_float(p) ? static_cast<void*>(m.fptr[p]) : static_cast<void*>(m.dptr[p])) ==
                     nullptr,
                 "after destruction the gradient pointer of " + m.specs[p].name + " is null again");
        continue;
      }
      for (std::size_t i = 0; i < m.count(p); ++i) {
        c.equal(m.grad(p, i), mean_grad(size, p, i, steps - 1),
                "after destruction: gradient " + at(m, p, i));
      }
    }
    failures += c.failures;
    std::printf(
        "rank %d: %s: %zu parameters, %zu buckets (%zu after the rebuild), %d steps: %s (%zu "
        "checks)\n",
        rank, config.label, parameter_count, initial_buckets, final_buckets, steps,
        c.failures ? "FAILED" : "gradients equal the mean, values and buffers are rank 0's",
        c.checked);
    std::fflush(stdout);
  }
  return failures ? 1 : 0;
}

// ---------------------------------------------------------------------------

template <class Policy>
std::size_t no_sync_case(dtrain::context<Policy>& ctx) {
  const int rank = ctx.rank(), size = ctx.size();
  checker c{rank, "no_sync"};
  toy_model m(rank, size, true);
  dtrain::DistributedDataParallel<toy_model, Policy> ddp(
      ctx, m, {.bucket_cap_mb = 0.01, .first_bucket_cap_mb = 0.002});
  for (int cycle = 0; cycle < 2; ++cycle) {  // before and after the rebuild
    const int a = 10 + 2 * cycle, b = 11 + 2 * cycle;
    {
      auto guard = ddp.no_sync();
      for (std::size_t p : ready_order(0, 0, rank)) {
        for (std::size_t i = 0; i < m.count(p); ++i)
          m.set_grad(p, i, local_grad(rank, size, p, i, a));
        ddp.mark_ready(p);
      }
      ddp.synchronize();  // does nothing inside no_sync()
      for (std::size_t p = 0; p < parameter_count; ++p) {
        for (std::size_t i = 0; i < m.count(p); ++i) {
          c.equal(m.grad(p, i), local_grad(rank, size, p, i, a),
                  "cycle " + std::to_string(cycle) + ": inside no_sync() gradient " + at(m, p, i) +
                      " (local)");
        }
      }
    }
    for (std::size_t p : ready_order(1, 1, rank)) {
      for (std::size_t i = 0; i < m.count(p); ++i)
        m.set_grad(p, i, m.grad(p, i) + local_grad(rank, size, p, i, b));
      ddp.mark_ready(p);
    }
    ddp.synchronize();
    for (std::size_t p = 0; p < parameter_count; ++p) {
      for (std::size_t i = 0; i < m.count(p); ++i) {
        c.equal(m.grad(p, i), mean_grad(size, p, i, a) + mean_grad(size, p, i, b),
                "cycle " + std::to_string(cycle) + ": gradient " + at(m, p, i) +
                    " after accumulating two micro-steps");
      }
    }
    c.expect(ddp.steps() == static_cast<std::size_t>(cycle + 1),
             "steps() is " + std::to_string(ddp.steps()) + " after " + std::to_string(cycle + 1) +
                 " synchronized steps");
  }
  c.expect(ddp.buckets_rebuilt(), "buckets rebuilt after the first synchronized step");
  std::printf("rank %d: no_sync: 2 accumulation cycles of 2 micro-steps: %s (%zu checks)\n", rank,
              c.failures ? "FAILED" : "local inside no_sync(), then the mean of the sums",
              c.checked);
  return c.failures;
}

/// Compression-friendly gradients: ((i + p + s) % 4) * (r + 1) * N. Every value,
/// every partial sum (at most 3 * N(N+1)/2 * N <= 120 for 4 ranks) and every
/// mean is a small integer, exact in bf16 and fp16 whether the ranks pre-divide or not.
double small_grad(int rank, int size, std::size_t p, std::size_t i, int s) {
  return static_cast<double>((i + p + static_cast<std::size_t>(s)) % 4) * (rank + 1) * size;
}
double small_mean(int size, std::size_t p, std::size_t i, int s) {
  return static_cast<double>((i + p + static_cast<std::size_t>(s)) % 4) * size * (size + 1) / 2;
}

template <class Policy>
std::size_t compression_case(dtrain::context<Policy>& ctx, dtrain::gradient_compression how) {
  const int rank = ctx.rank(), size = ctx.size();
  const std::string name = std::string("compression ") + std::string(dtrain::to_string(how));
  checker c{rank, name};
  toy_model m(rank, size, true);
  dtrain::DistributedDataParallel<toy_model, Policy> ddp(
      ctx, m, {.bucket_cap_mb = 0.01, .compression = how});
  const float probe = 1.0f + 0x1p-12f;   // not a bf16 nor an fp16 value
  const double probe64 = 1.0 + 0x1p-40;  // float64 buckets are never compressed
  float probe_result = 0;
  for (int s = 0; s < 3; ++s) {
    for (std::size_t p : ready_order(s, s, rank)) {
      for (std::size_t i = 0; i < m.count(p); ++i)
        m.set_grad(p, i, small_grad(rank, size, p, i, s));
      if (p == 0) m.set_grad(0, 0, probe);
      if (p == 6) m.set_grad(6, 0, probe64);
      ddp.mark_ready(p);
    }
    ddp.synchronize();
    for (std::size_t p = 0; p < parameter_count; ++p) {
      for (std::size_t i = 0; i < m.count(p); ++i) {
        if ((p == 0 || p == 6) && i == 0) continue;
        c.equal(m.grad(p, i), small_mean(size, p, i, s),
                "step " + std::to_string(s) + ": gradient " + at(m, p, i));
      }
    }
    c.equal(m.grad(6, 0), probe64,
            "step " + std::to_string(s) + ": float64 gradient " + at(m, 6, 0));
    probe_result = static_cast<float>(m.grad(0, 0));
    c.expect(std::fabs(probe_result - 1.0f) < 0.01f,
             "step " + std::to_string(s) + ": " + at(m, 0, 0) + " is " +
                 std::to_string(probe_result) + ", expected about 1");
    if (size > 1) {  // with one rank nothing need travel, so nothing need be rounded
      c.expect(probe_result != probe,
               "step " + std::to_string(s) + ": " + at(m, 0, 0) +
                   " kept float32 precision (1 + 2^-12): the gradients were not compressed");
    }
  }
  // A hook replaces the reduction, so it cannot be combined with compression.
  try {
    ddp.register_comm_hook([](auto& comm, dtrain::gradient_bucket& b) {
      return comm.allreduce(b.data, b.data, dtrain::reduce_op::avg);
    });
    c.expect(false, "register_comm_hook with compression on was accepted");
  } catch (const dtrain::config_error& e) {
    c.expect(std::string(e.what()).find("compression") != std::string::npos,
             std::string("the hook's config_error names compression: ") + e.what());
  }
  std::printf("rank %d: %s: %zu buckets, 3 steps: %s, %s = %.9g (%zu checks)\n", rank, name.c_str(),
              ddp.buckets().size(), c.failures ? "FAILED" : "exact means, float64 uncompressed",
              at(m, 0, 0).c_str(), probe_result, c.checked);
  return c.failures;
}

template <class Policy>
std::size_t unused_case(dtrain::context<Policy>& ctx) {
  const int rank = ctx.rank(), size = ctx.size();
  checker c{rank, "find_unused_parameters"};
  toy_model m(rank, size, true);
  dtrain::DistributedDataParallel<toy_model, Policy> ddp(
      ctx, m,
      {.bucket_cap_mb = 0.01, .first_bucket_cap_mb = 0.002, .find_unused_parameters = true});
  // layer05.view and layer16.copy: unused on odd ranks; layer09.view: unused everywhere.
  auto odd_unused = [](std::size_t p) { return p == 5 || p == 16; };
  const std::size_t never = 9;
  double even_ranks = 0;  // sum of (r + 1) over the ranks that use layer05 and layer16
  for (int r = 0; r < size; r += 2) even_ranks += r + 1;
  // After step 1 (unused_report_steps = 2) rank 0 names the parameters that
  // no rank marked: layer09 only (layer05 and layer16 are used on even ranks).
  stderr_capture report;
  for (int s = 0; s < 3; ++s) {
    ddp.zero_grad();
    for (std::size_t p : ready_order(s, s, rank)) {
      const bool unused = p == never || (odd_unused(p) && rank % 2 == 1);
      if (unused) {
        // Step 2: a stale value in an unmarked gradient must not travel either.
        if (s == 2) {
          for (std::size_t i = 0; i < m.count(p); ++i) m.set_grad(p, i, 12345);
        }
        continue;
      }
      for (std::size_t i = 0; i < m.count(p); ++i)
        m.set_grad(p, i, local_grad(rank, size, p, i, s));
      ddp.mark_ready(p);
    }
    ddp.synchronize();
    for (std::size_t p = 0; p < parameter_count; ++p) {
      for (std::size_t i = 0; i < m.count(p); ++i) {
        double expected = mean_grad(size, p, i, s);
        if (p == never) expected = 0;
        if (odd_unused(p))
          expected = local_grad(0, size, p, i, s) / size * even_ranks;  // zeros from odd ranks
        c.equal(m.grad(p, i), expected, "step " + std::to_string(s) + ": gradient " + at(m, p, i));
      }
    }
  }
  const std::string text = report.end();
  const auto lines = std::count(text.begin(), text.end(), '\n');
  if (rank == 0) {
    c.expect(lines == 1 && text.find("[rank 0/" + std::to_string(size) +
                                     "] dtrain: DistributedDataParallel: no rank marked "
                                     "parameter 'layer09.view' ready in the first 2 steps") !=
                               std::string::npos,
             "rank 0's report of the unused parameters, once: got \"" + text + "\"");
  } else {
    c.expect(text.empty(), "only rank 0 reports; got \"" + text + "\"");
  }
  std::fputs(text.c_str(), stderr);  // as the user would see it
  std::printf(
      "rank %d: find_unused_parameters: layer05/layer16 unused on odd ranks, layer09 on all, 3 "
      "steps: %s (%zu checks)\n",
      rank, c.failures ? "FAILED" : "unused gradients count as zeros, the same mean on every rank",
      c.checked);
  return c.failures;
}

template <class Policy>
std::size_t hook_case(dtrain::context<Policy>& ctx) {
  const int rank = ctx.rank(), size = ctx.size();
  checker c{rank, "register_comm_hook"};
  toy_model m(rank, size, true);
  dtrain::DistributedDataParallel<toy_model, Policy> ddp(
      ctx, m, {.bucket_cap_mb = 0.01, .first_bucket_cap_mb = 0.002});
  std::atomic<int> calls{0}, bad_world{0}, bad_count{0};
  const auto params = ddp.parameters();
  ddp.register_comm_hook([&](typename Policy::communicator_type& comm, dtrain::gradient_bucket& b) {
    ++calls;
    if (b.world_size != size) ++bad_world;
    std::size_t count = 0;
    for (std::size_t p : b.parameters) count += params[p].values.count;
    if (count != b.data.count) ++bad_count;
    return comm.allreduce(b.data, b.data,
                          dtrain::reduce_op::sum);  // the sum, not the mean: visible
  });
  for (int s = 0; s < 3; ++s) {
    calls = 0;
    for (std::size_t p : ready_order(s, s, rank)) {
      for (std::size_t i = 0; i < m.count(p); ++i)
        m.set_grad(p, i, local_grad(rank, size, p, i, s));
      ddp.mark_ready(p);
    }
    ddp.synchronize();
    c.expect(calls == static_cast<int>(ddp.buckets().size()),
             "step " + std::to_string(s) + ": the hook ran " + std::to_string(calls.load()) +
                 " times for " + std::to_string(ddp.buckets().size()) + " buckets");
    check_means(m, size, s, c, size);  // the hook sums
  }
  c.expect(bad_world == 0, "gradient_bucket::world_size differed from the world size");
  c.expect(bad_count == 0,
           "gradient_bucket::data.count differed from its parameters' element count");
  std::printf("rank %d: register_comm_hook: %zu buckets, 3 steps: %s (%zu checks)\n", rank,
              ddp.buckets().size(),
              c.failures ? "FAILED" : "the hook ran once per bucket and its sum replaced the mean",
              c.checked);
  return c.failures;
}

template <class Policy>
int features_case(dtrain::context<Policy>& ctx) {
  std::size_t failures = no_sync_case(ctx);
  failures += compression_case(ctx, dtrain::gradient_compression::bfloat16);
  failures += compression_case(ctx, dtrain::gradient_compression::float16);
  failures += unused_case(ctx);
  failures += hook_case(ctx);
  std::fflush(stdout);
  return failures ? 1 : 0;
}

/// A collective of the user's own on the same communicator in the middle of a
/// step (a loss allreduce while buckets are in flight): both results must be right.
template <class Policy>
int interleaved_case(dtrain::context<Policy>& ctx) {
  const int rank = ctx.rank(), size = ctx.size();
  checker c{rank, "user collective mid-step"};
  toy_model m(rank, size, true);
  dtrain::DistributedDataParallel<toy_model, Policy> ddp(
      ctx, m, {.bucket_cap_mb = 0.0001, .first_bucket_cap_mb = 0.0001});
  for (int s = 0; s < 6; ++s) {
    const auto order = ready_order(s, s, rank);
    for (std::size_t k = 0; k < order.size(); ++k) {
      const std::size_t p = order[k];
      for (std::size_t i = 0; i < m.count(p); ++i)
        m.set_grad(p, i, local_grad(rank, size, p, i, s));
      ddp.mark_ready(p);
      if (k == order.size() / 2) {
        // Ranks reach their own collective at different times relative to the buckets in flight.
        if ((rank + s) % 2 == 1) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        std::vector<double> loss{static_cast<double>(rank + 1), static_cast<double>(s)};
        dtrain::allreduce(ctx.communicator(), std::span<double>(loss), dtrain::reduce_op::sum)
            .wait();
        c.equal(loss[0], size * (size + 1) / 2.0,
                "step " + std::to_string(s) + ": the user's allreduce of rank + 1");
        c.equal(loss[1], static_cast<double>(s) * size,
                "step " + std::to_string(s) + ": the user's allreduce of the step");
      }
    }
    ddp.synchronize();
    check_means(m, size, s, c);
  }
  std::printf("rank %d: user collective mid-step: %zu buckets, 6 steps: %s (%zu checks)\n", rank,
              ddp.buckets().size(),
              c.failures ? "FAILED" : "the user's allreduce and the gradients are right",
              c.checked);
  std::fflush(stdout);
  return c.failures ? 1 : 0;
}

// ---------------------------------------------------------------------------
// The failing cases: the exception leaves through dtrain::run, which prints
// "[rank r/n] dtrain: <what>" and exits 1 (2 for a config_error).

template <class Policy>
int error_case(dtrain::context<Policy>& ctx, std::string_view which) {
  const int rank = ctx.rank(), size = ctx.size();
  toy_model m(rank, size, true, which);
  dtrain::DistributedDataParallel<toy_model, Policy> ddp(ctx, m, {.bucket_cap_mb = 0.01});
  std::printf("rank %d: %s: constructed\n", rank, std::string(which).c_str());
  std::fflush(stdout);
  const auto order = ready_order(0, 0, rank);
  if (which == "twice") {
    for (std::size_t k = 0; k < order.size() / 2; ++k)
      ddp.mark_ready(order[k]);  // some buckets are in flight
    ddp.mark_ready(std::string_view("layer03.view"));
    ddp.mark_ready(std::string_view("layer03.view"));
  } else if (which == "unmarked") {
    for (std::size_t p : order) {
      if (p != 5) ddp.mark_ready(p);
    }
    ddp.synchronize();
  } else if (which == "unknown") {
    try {
      ddp.mark_ready(std::size_t{999});
      std::fprintf(stderr, "rank %d: mark_ready(999) was accepted\n", rank);
      return 1;
    } catch (const dtrain::error& e) {
      std::printf("rank %d: mark_ready(999): %s\n", rank, e.what());
    }
    ddp.mark_ready(std::string_view("no.such.parameter"));
  }
  std::fprintf(stderr, "rank %d: %s: nothing was thrown\n", rank, std::string(which).c_str());
  return 1;
}

/// The topology group of the policy on its own, against the flat allreduce of
/// the same data on the world communicator: every op (sum, avg, min, max,
/// prod) on float32, avg on float64 and float16, sum on int32; counts that
/// divide by the ranks per node, that leave a remainder, and that are smaller
/// than the ranks per node. Values are small integers: every result is exact.
template <class Policy>
int topology_case(dtrain::context<Policy>& ctx) {
  using group_type =
      typename Policy::topology_type::template group<typename Policy::communicator_type>;
  const int rank = ctx.rank(), size = ctx.size();
  checker c{rank, "topology group"};
  auto comm = ctx.communicator().split(0, rank);
  dtrain::communicator_channel channel(comm);
  // Hierarchical: chunks of 64 KiB, so that the larger counts run pipelined.
  auto make_group = [&] {
    if constexpr (std::is_same_v<typename Policy::topology_type, dtrain::topology::hierarchical>) {
      return std::make_unique<group_type>(comm, dtrain::control_plane(channel),
                                          *dtrain::node_layout::of(ctx.world()), 64 * 1024);
    } else {
      return std::make_unique<group_type>(comm, dtrain::control_plane(channel),
                                          *dtrain::node_layout::of(ctx.world()));
    }
  };
  const auto owner = make_group();
  group_type& group = *owner;
  const std::size_t per_node = group.granularity();
  const std::size_t n = per_node;
  const std::size_t counts[] = {1,         n > 1 ? n - 1 : 2, n,      6 * n,
                                6 * n + 1, 1000 * n + n - 1,  250001, 400000};
  std::size_t runs = 0;
  auto check_one = [&]<class T>(std::size_t n, dtrain::reduce_op op, T) {
    auto value = [&](std::size_t i, int r) {
      // prod stays small: only every 7th element differs from 1
      const int v = op == dtrain::reduce_op::prod
                        ? (i % 7 == 0 ? (r % 2) + 1 : 1)
                        : static_cast<int>((i * 13 + static_cast<std::size_t>(r) * 5) % 11) * size;
      return T(static_cast<float>(v));
    };
    std::vector<T> mine(n), flat(n);
    for (std::size_t i = 0; i < n; ++i) mine[i] = flat[i] = value(i, rank);
    const dtrain::buffer data = dtrain::host_buffer(std::span<T>(mine));
    group.allreduce(data, op).wait();
    dtrain::allreduce(comm, std::span<T>(flat), op).wait();
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (!(mine[i] == flat[i])) ++wrong;
    }
    c.expect(wrong == 0, std::to_string(wrong) + " of " + std::to_string(n) + " elements of " +
                             std::string(dtrain::to_string(data.type)) + " " +
                             std::string(dtrain::to_string(op)) +
                             " differ from the flat allreduce");
    ++runs;
  };
  for (std::size_t count : counts) {
    for (dtrain::reduce_op op :
         {dtrain::reduce_op::sum, dtrain::reduce_op::avg, dtrain::reduce_op::min,
          dtrain::reduce_op::max, dtrain::reduce_op::prod}) {
      check_one(count, op, float{});
    }
    check_one(count, dtrain::reduce_op::avg, double{});
    check_one(count, dtrain::reduce_op::avg, dtrain::float16{});
    check_one(count, dtrain::reduce_op::sum, std::int32_t{});
  }
  // Caller's scratch: too small a shard is refused, naming the sizes.
  if (group.hierarchical()) {
    std::vector<float> data(4 * per_node), shard(3);
    try {
      (void)group.allreduce(dtrain::host_buffer(std::span<float>(data)),
                            dtrain::host_buffer(std::span<float>(shard)), dtrain::reduce_op::sum);
      c.expect(false,
               "a shard of 3 elements for 4 x " + std::to_string(per_node) + " was accepted");
    } catch (const dtrain::config_error& e) {
      c.expect(std::string(e.what()).find("needs 4") != std::string::npos,
               std::string("the shard's config_error names what it needs: ") + e.what());
    }
  }
  std::printf("rank %d: topology group: %s: %zu allreduces: %s (%zu checks)\n", rank,
              group.describe().c_str(), runs,
              c.failures ? "FAILED" : "every result equals the flat allreduce's", c.checked);
  std::fflush(stdout);
  return c.failures ? 1 : 0;
}

/// Every parameter in a bucket of its own (a cap below the smallest
/// parameter): as many buckets as parameters, and the exact mean after every step.
template <class Policy>
int many_buckets_case(dtrain::context<Policy>& ctx) {
  const int rank = ctx.rank(), size = ctx.size();
  checker c{rank, "a bucket per parameter"};
  toy_model m(rank, size, true);
  dtrain::DistributedDataParallel<toy_model, Policy> ddp(
      ctx, m, {.bucket_cap_mb = 1e-9, .first_bucket_cap_mb = 1e-9});
  for (int s = 0; s < 4; ++s) {
    step(ddp, m, rank, size, s, 0, c);
    c.expect(ddp.buckets().size() == parameter_count,
             "step " + std::to_string(s) + ": " + std::to_string(ddp.buckets().size()) +
                 " buckets for " + std::to_string(parameter_count) + " parameters");
  }
  std::printf("rank %d: a bucket per parameter: %zu buckets, 4 steps: %s (%zu checks)\n", rank,
              ddp.buckets().size(), c.failures ? "FAILED" : "every mean is exact", c.checked);
  return c.failures ? 1 : 0;
}

/// Runs `body` on this job's engine and topology (rank 0 says which topology).
template <class Body>
int run_case(Body body) {
  return dtrain_test::run_job([&](auto& ctx) -> int {
    if constexpr (dtrain_test::is_hierarchical<std::remove_reference_t<decltype(ctx)>>) {
      if (ctx.is_main()) {
        std::printf("rank 0: topology::hierarchical, world of %d ranks on %d nodes\n", ctx.size(),
                    ctx.num_nodes());
      }
    }
    return body(ctx);
  });
}

}  // namespace

TEST_CASE("mean") {
  CHECK(run_case([](auto& ctx) { return mean_case(ctx); }) == 0);
}
TEST_CASE("features") {
  CHECK(run_case([](auto& ctx) { return features_case(ctx); }) == 0);
}
TEST_CASE("interleaved") {
  CHECK(run_case([](auto& ctx) { return interleaved_case(ctx); }) == 0);
}
TEST_CASE("many_buckets") {
  CHECK(run_case([](auto& ctx) { return many_buckets_case(ctx); }) == 0);
}
TEST_CASE("topology") {
  CHECK(run_case([](auto& ctx) { return topology_case(ctx); }) == 0);
}

// The training function throws: dtrain::run prints "[rank r/n] dtrain: <what>",
// and the rank ends with its status, 1 (2 for a config_error, as a model the
// ranks disagree on is): the test checks the job's status and what it printed.
TEST_CASE("twice") {
  dtrain_test::end_job(run_case([](auto& ctx) { return error_case(ctx, "twice"); }));
}
TEST_CASE("unmarked") {
  dtrain_test::end_job(run_case([](auto& ctx) { return error_case(ctx, "unmarked"); }));
}
TEST_CASE("unknown") {
  dtrain_test::end_job(run_case([](auto& ctx) { return error_case(ctx, "unknown"); }));
}
TEST_CASE("mismatch-name") {
  dtrain_test::end_job(run_case([](auto& ctx) { return error_case(ctx, "mismatch-name"); }));
}
TEST_CASE("mismatch-shape") {
  dtrain_test::end_job(run_case([](auto& ctx) { return error_case(ctx, "mismatch-shape"); }));
}
