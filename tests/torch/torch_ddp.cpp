// dtrain::torch::DistributedDataParallel on N ranks (Gloo under
// dtrain_test_launch, or MPI under mpirun) against one process on the full
// batch: a conv + batch-norm + linear LibTorch model must end with the same
// weights, plainly, with no_sync() accumulation, with an unused branch and
// find_unused_parameters, and with bf16 compression (within its rounding).
// backward() alone completes each step, as in PyTorch; synchronize() after it
// changes nothing, and completes a step that backward() could not.
// Also: every .grad() is a view of the buckets, the buffers are broadcast,
// the first bucket's allreduce starts before backward() returns, and a
// module that differs across ranks, or that one rank cannot take, is refused
// on every rank, naming the parameter; a step left incomplete (parameters
// without a gradient) is an error naming them; an undefined gradient is a
// zero contribution. dtrain::loss_scaler over the module skips a step with an
// inf on one rank on every rank (check_loss_scaler); a bfloat16 module with
// ddp_options::master_weights steps float32 masters and holds them rounded,
// at every stage (check_master_weights).
//
// One doctest case, "ddp", run in every rank (tests/support/multirank.hpp;
// tests/torch/torch.cmake registers it): a failed check fails the rank.

#include "../support/multirank.hpp"

#include <dtrain/torch.hpp>

#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <dlfcn.h>
#include <execinfo.h>
#include <pthread.h>
#include <ucontext.h>
#include <unistd.h>

namespace {

#if DTRAIN_TEST_TORCH_MPI
using Policy = dtrain::policy<dtrain::launch::per_process, dtrain::backend::mpi>;
#elif DTRAIN_TEST_TORCH_NCCL
using Policy = dtrain::policy<dtrain::launch::per_process, dtrain::backend::nccl>;
#else
using Policy = dtrain::policy<dtrain::launch::per_process, dtrain::backend::gloo>;
#endif

constexpr std::int64_t global_batch = 32;  // divides among 1, 2 and 4 ranks
constexpr int steps = 4;                   // the bucket rebuild happens after the first
// CUDA tensors over NCCL (one GPU, so one rank: always_reduce sends the
// buckets through NCCL all the same); CPU tensors over Gloo and MPI.
constexpr bool on_gpu = Policy::memory_space::where == dtrain::memory::device;
torch::Device device() {
  return on_gpu ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
}

struct NetImpl : torch::nn::Module {
  explicit NetImpl(std::int64_t classes = 10, bool branches = false) {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)));
    bn = register_module("bn", torch::nn::BatchNorm2d(4));
    fc = register_module("fc", torch::nn::Linear(4 * 8 * 8, classes));
    if (branches) {
      aux = register_module("aux", torch::nn::Linear(classes, classes));
      never = register_module("never", torch::nn::Linear(classes, classes));
    }
    bn->eval();  // running statistics (buffers) normalise: per sample, as on the full batch
  }
  // `aux` adds to the samples that `mask` selects, and is not called at all
  // when it selects none; `never` is never used.
  torch::Tensor forward(torch::Tensor x, torch::Tensor mask = {}, bool gate = false);

  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear fc{nullptr}, aux{nullptr}, never{nullptr};
};
TORCH_MODULE(Net);

// The overlap check: a layer whose backward waits (at most 10 s) until the
// first bucket's allreduce has started. It sits after the convolution, so its
// backward runs after fc's gradients (bucket 0) and before conv's.
std::atomic<bool> bucket_started{false};
std::atomic<bool> started_in_backward{false};
std::chrono::steady_clock::time_point bucket_start_time, backward_end_time;

struct gate : torch::autograd::Function<gate> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, torch::Tensor x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!bucket_started.load() && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    started_in_backward = bucket_started.load();
    return grads;
  }
};

torch::Tensor NetImpl::forward(torch::Tensor x, torch::Tensor mask, bool with_gate) {
  torch::Tensor h = conv(x);
  if (with_gate) h = gate::apply(h);
  h = torch::relu(bn(h)).flatten(1);
  h = fc(h);
  if (mask.defined() && mask.any().item<bool>()) h = h + aux(torch::tanh(h)) * mask.unsqueeze(1);
  return h;
}

struct batch {
  torch::Tensor x, y;
};
batch data(int step, int micro) {
  torch::manual_seed(static_cast<std::uint64_t>(7000 + 17 * step + micro));
  return {torch::randn({global_batch, 1, 8, 8}).to(device()),
          torch::randint(0, 10, {global_batch}).to(device())};
}

Net make_net(std::uint64_t seed, bool branches = false, std::int64_t classes = 10) {
  torch::manual_seed(seed);
  Net net(classes, branches);
  torch::NoGradGuard no_grad;
  net->bn->running_mean.uniform_(-0.5, 0.5);
  net->bn->running_var.uniform_(0.5, 2.0);
  net->to(device());
  return net;
}

struct variant {
  const char* name;
  int micro = 1;  // micro-batches per step (all but the last under no_sync())
  bool branches = false;
  dtrain::gradient_compression compression = dtrain::gradient_compression::none;
  // How gradients are cleared after each step: the optimizer's zero_grad()
  // (LibTorch 1.13 zeroes them in place, 2.x drops them), ddp.zero_grad(), or
  // dropped by hand (set to none: autograd then writes new tensors, which DDP
  // must copy into its buckets, and an unused parameter's stale bucket slot
  // must not be sent).
  enum { optimizer, ddp, none } zeroing = optimizer;
  // How each step is completed: by backward() alone (as in PyTorch), by
  // synchronize() after it as well, or (with `ddp->forward(x)`, which walks
  // no graph for unused parameters) by synchronize() only.
  enum { by_backward, synchronize_after, forward_without_walk } completion = by_backward;
  double tolerance = 1e-5;
};

// The reference's part: as the variant clears gradients (ddp.zero_grad()
// keeps them, zeroed in place, whatever the LibTorch version).
void clear(const variant& v, torch::optim::Optimizer& opt, Net& net) {
  if (v.zeroing == variant::none) {
    for (torch::Tensor& p : net->parameters()) p.mutable_grad() = torch::Tensor();
  } else if (v.zeroing == variant::ddp) {
    torch::NoGradGuard no_grad;
    for (torch::Tensor& p : net->parameters()) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
  } else {
    opt.zero_grad();
  }
}

// Which samples of the global batch `aux` adds to in `step` (undefined: none).
// Odd steps: none, so no rank uses it. Even steps: one rank's shard only, a
// different rank's each time, so the others do not use it locally and must
// send zeros (and not the stale mean still in its bucket slot).
torch::Tensor branch_of(const variant& v, int step, int size) {
  if (!v.branches || step % 2 == 1) return {};
  const std::int64_t shard = global_batch / size, user = (step / 2) % size;
  return (torch::arange(global_batch).div(shard, "floor") == user).to(device(), torch::kFloat);
}

// One process on the full batch: the reference.
Net train_reference(const variant& v, int size) {
  Net net = make_net(1000, v.branches);
  torch::optim::SGD opt(net->parameters(),
                        torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-3));
  for (int step = 0; step < steps; ++step) {
    for (int m = 0; m < v.micro; ++m) {
      const batch b = data(step, m);
      torch::nn::functional::cross_entropy(net->forward(b.x, branch_of(v, step, size)), b.y)
          .backward();
    }
    opt.step();
    clear(v, opt, net);
  }
  return net;
}

int failures = 0;
void check(bool ok, int rank, const std::string& what) {
  if (!ok) {
    ++failures;
    FAIL_CHECK("rank " << rank << ": " << what);
  }
}

void train_data_parallel(dtrain::context<Policy>& ctx, const variant& v) {
  const int rank = ctx.rank(), size = ctx.size();
  const std::int64_t shard = global_batch / size;
  // Each rank starts elsewhere: DDP must broadcast rank 0's parameters and buffers.
  Net net = make_net(1000 + static_cast<std::uint64_t>(rank), v.branches);
  dtrain::torch::DistributedDataParallel ddp(ctx, net,
                                             {.bucket_cap_mb = 2.0 / 1024,
                                              .first_bucket_cap_mb = 1.0 / 1024,
                                              .find_unused_parameters = v.branches,
                                              .compression = v.compression,
                                              .always_reduce = on_gpu});
  torch::optim::SGD opt(net->parameters(),
                        torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-3));
  for (int step = 0; step < steps; ++step) {
    // The next ddp(x) must undo this (ddp->forward(x) broadcasts no buffers).
    if (step == 1 && rank != 0 && v.completion != variant::forward_without_walk) {
      torch::NoGradGuard no_grad;
      net->bn->running_mean.add_(1.0);
    }
    for (int m = 0; m < v.micro; ++m) {
      const batch b = data(step, m);
      auto x = b.x.narrow(0, rank * shard, shard), y = b.y.narrow(0, rank * shard, shard);
      torch::Tensor mask = branch_of(v, step, size);
      if (mask.defined()) mask = mask.narrow(0, rank * shard, shard);
      auto loss = [&] {
        return torch::nn::functional::cross_entropy(
            v.completion == variant::forward_without_walk ? ddp->forward(x, mask) : ddp(x, mask),
            y);
      };
      if (m + 1 < v.micro) {
        auto guard = ddp.no_sync();
        loss().backward();
      } else {
        loss().backward();
      }
    }
    if (v.completion != variant::by_backward) ddp.synchronize();
    if (step == 1 && v.completion != variant::forward_without_walk) {
      const auto ref = make_net(1000, v.branches);
      check(torch::equal(net->bn->running_mean, ref->bn->running_mean), rank,
            std::string(v.name) + ": bn.running_mean was not rank 0's after forward()");
    }
    // Every gradient (of a parameter some rank used) is a view of the buckets.
    const auto params = ddp.core().parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const torch::Tensor p = net->named_parameters()[params[i].name];
      if (!p.grad().defined()) continue;
      check(p.grad().data_ptr() == params[i].gradient, rank,
            std::string(v.name) + ": the .grad() of '" + params[i].name +
                "' is not its bucket view after step " + std::to_string(step));
    }
    opt.step();
    if (v.zeroing == variant::ddp) {
      ddp.zero_grad();
    } else {
      clear(v, opt, net);
    }
  }
  const Net ref = train_reference(v, size);
  for (const auto& item : ref->named_parameters()) {
    const torch::Tensor mine = net->named_parameters()[item.key()];
    const double diff = (mine - item.value()).abs().max().item<double>();
    check(diff <= v.tolerance, rank,
          std::string(v.name) + ": parameter '" + item.key() + "' differs from one process on " +
              "the full batch by " + std::to_string(diff));
    check(mine.grad().defined() == item.value().grad().defined(), rank,
          std::string(v.name) + ": the .grad() of '" + item.key() + "' is " +
              (mine.grad().defined() ? "defined" : "undefined") + ", in one process it is not");
  }
  if (rank == 0) {
    std::printf("%-28s %d ranks: %zu buckets (rebuilt: %s), weights match one process\n", v.name,
                size, ddp.buckets().size(), ddp.core().buckets_rebuilt() ? "yes" : "no");
  }
}

// The first bucket's allreduce starts while backward() is still running.
// With `unused`, bucket 0 also holds the parameters of `aux` and `never`,
// which this step does not use: forward() must find them (find_unused_parameters).
void check_overlap(dtrain::context<Policy>& ctx, bool unused) {
  bucket_started = false;
  started_in_backward = false;
  Net net = make_net(1000, unused);
  dtrain::torch::DistributedDataParallel ddp(ctx, net,
                                             {.bucket_cap_mb = 2.0 / 1024,
                                              .first_bucket_cap_mb = 1.0 / 1024,
                                              .find_unused_parameters = unused,
                                              .always_reduce = on_gpu});
  ddp.register_comm_hook([](auto& comm, dtrain::gradient_bucket& b) {
    if (b.index == 0 && !bucket_started.exchange(true))
      bucket_start_time = std::chrono::steady_clock::now();
    if constexpr (on_gpu) {
      return comm.allreduce(b.data, b.data, dtrain::reduce_op::avg, b.stream);
    } else {
      return comm.allreduce(b.data, b.data, dtrain::reduce_op::avg);
    }
  });
  const batch b = data(0, 0);
  const auto start = std::chrono::steady_clock::now();
  torch::nn::functional::cross_entropy(ddp(b.x, torch::Tensor(), true), b.y).backward();
  backward_end_time = std::chrono::steady_clock::now();
  ddp.synchronize();
  const auto us = [&](auto t) {
    return std::chrono::duration_cast<std::chrono::microseconds>(t - start).count();
  };
  check(started_in_backward.load(), ctx.rank(),
        std::string("overlap") + (unused ? " (unused parameters)" : "") +
            ": bucket 0's allreduce had not started when conv's backward was reached");
  check(bucket_start_time < backward_end_time, ctx.rank(),
        std::string("overlap") + (unused ? " (unused parameters)" : "") +
            ": bucket 0's allreduce started after backward() returned");
  if (ctx.rank() == 0) {
    std::printf(
        "overlap%s: bucket 0 (%zu parameters) started %lld us into backward(), which "
        "returned at %lld us\n",
        unused ? " (unused parameters in it)" : "", ddp.buckets()[0].parameters.size(),
        static_cast<long long>(us(bucket_start_time)),
        static_cast<long long>(us(backward_end_time)));
  }
}

// With find_unused_parameters, a gradient for a parameter that the graph walk
// after ddp(x) found unused (here: used only in the loss) stops backward()
// with an error naming it, rather than being dropped.
void check_walk_error(dtrain::context<Policy>& ctx) {
  Net net = make_net(1000, true);
  dtrain::torch::DistributedDataParallel ddp(ctx, net, {.find_unused_parameters = true});
  const batch b = data(0, 0);
  try {
    auto loss = torch::nn::functional::cross_entropy(ddp(b.x), b.y) + net->never->bias.sum();
    loss.backward();
    check(false, ctx.rank(), "walk: a gradient for a parameter found unused was accepted");
  } catch (const std::exception& e) {
    const std::string what = e.what();
    check(what.find("'never.bias'") != std::string::npos &&
              what.find("graph walk") != std::string::npos,
          ctx.rank(), "walk: the error does not name 'never.bias' and the graph walk: " + what);
    if (ctx.rank() == 0) std::printf("gradient of a parameter found unused: refused\n");
  }
}

// Tied weights: a module registered twice holds one parameter per tensor
// (under its first name), whose gradient sums both uses, as in one process.
void check_tied(dtrain::context<Policy>& ctx) {
  torch::manual_seed(5);
  torch::nn::Linear lin(6, 6);
  torch::nn::Sequential seq(lin, torch::nn::Tanh(), lin);  // "0.*" and "2.*" are the same tensors
  seq->to(device());
  torch::manual_seed(6);
  const torch::Tensor x = torch::randn({global_batch, 6}).to(device());
  seq->forward(x).square().mean().backward();  // one process, the full batch
  std::vector<torch::Tensor> expected;
  for (torch::Tensor& p : lin->parameters()) {
    expected.push_back(p.grad().clone());
    p.mutable_grad() = torch::Tensor();
  }
  dtrain::torch::DistributedDataParallel ddp(ctx, seq, {.always_reduce = on_gpu});
  const std::int64_t shard = global_batch / ctx.size();
  ddp(x.narrow(0, ctx.rank() * shard, shard)).square().mean().backward();
  ddp.synchronize();
  check(ddp.core().parameters().size() == 2, ctx.rank(),
        "tied: " + std::to_string(ddp.core().parameters().size()) + " parameters, expected 2");
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const double diff = (lin->parameters()[i].grad() - expected[i]).abs().max().item<double>();
    check(diff <= 1e-6, ctx.rank(),
          "tied: gradient " + std::to_string(i) + " differs from one process by " +
              std::to_string(diff));
  }
  if (ctx.rank() == 0) std::printf("tied weights: one parameter each, gradients match\n");
}

// A module that differs across ranks is refused on every rank, naming the parameter.
void check_mismatch(dtrain::context<Policy>& ctx) {
  if (ctx.size() < 2) return;
  Net net = make_net(1000, false, ctx.rank() == 1 ? 11 : 10);  // rank 1: fc has 11 outputs
  try {
    dtrain::torch::DistributedDataParallel ddp(ctx, net);
    check(false, ctx.rank(), "mismatch: a module that differs across ranks was accepted");
  } catch (const dtrain::config_error& e) {
    const std::string what = e.what();
    check(what.find("fc.weight") != std::string::npos, ctx.rank(),
          "mismatch: the error does not name 'fc.weight': " + what);
    // In a torch user's terms: the shapes, not the element counts.
    check(what.find("fc.weight ([10, ") != std::string::npos &&
              what.find("fc.weight ([11, ") != std::string::npos,
          ctx.rank(), "mismatch: the error does not give fc.weight's shapes: " + what);
    if (ctx.rank() == 0) std::printf("mismatch refused: %s\n", e.what());
  }
}

// The no_sync() guard is made only by no_sync(), which refuses the middle of
// a step: one built directly would let zero_grad() race the buckets still
// travelling.
void check_no_sync_guard(dtrain::context<Policy>& ctx) {
  using ddp_type = dtrain::torch::DistributedDataParallel<Policy, Net>;
  check(!std::is_constructible_v<ddp_type::no_sync_guard, ddp_type&>, ctx.rank(),
        "no_sync: a guard can be built without no_sync()");
}

// A module that one rank cannot take (there: a parameter that is not
// contiguous) is refused on every rank: that rank names the parameter, the
// others name that rank (before, they waited in the model agreement for a
// rank that had gone on without them).
void check_local_refusal(dtrain::context<Policy>& ctx) {
  if (ctx.size() < 2) return;
  Net net = make_net(1000);
  if (ctx.rank() == 1) {
    const torch::NoGradGuard no_grad;
    net->fc->weight.set_data(net->fc->weight.detach().t().contiguous().t());
  }
  try {
    dtrain::torch::DistributedDataParallel ddp(ctx, net);
    check(false, ctx.rank(), "local refusal: a non-contiguous parameter was accepted");
  } catch (const dtrain::config_error& e) {
    const std::string what = e.what();
    const std::string expected = ctx.rank() == 1 ? "'fc.weight' is not contiguous" : "rank 1";
    check(what.find(expected) != std::string::npos, ctx.rank(),
          "local refusal: the error does not say \"" + expected + "\": " + what);
    if (ctx.rank() == 0) std::printf("a rank's refusal stops every rank: %s\n", e.what());
  }
}

// ZeRO stage 3 on modules (issue 48). A torch::nn::Sequential of uneven
// layers (each child a unit), and Net (not a Sequential: one unit), trained
// with Adam over shard_parameters() at stage 3 end bit-identical to stage 2
// (the same reduce-scatters and the same update on the same shard) and
// within float noise of one process on the whole batch; with
// reshard_after_forward on and off, prefetch 0-2, no_sync() accumulation.
// Between steps no rank holds a parameter's values (the tensors' storage is
// empty), the shard of the values is about 1/N of the model, and from the
// second step on the gathers are prefetched (prefetch_units > 0).
torch::nn::Sequential make_layers(std::uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential seq(torch::nn::Linear(12, 20), torch::nn::Tanh(), torch::nn::Linear(20, 33),
                            torch::nn::Tanh(), torch::nn::Linear(33, 6));
  seq->to(device());
  return seq;
}

struct stage3_case {
  const char* name;
  dtrain::sharding stage = dtrain::sharding::parameters;
  bool reshard = true;
  std::size_t prefetch = 1;
  int micro = 1;
  bool default_buckets = false;  // 25 MiB: every unit's own bucket only because units cut them
};

// The parameters' values after `steps` Adam steps on `module` (a Sequential
// of make_layers(), or Net: one unit), gathered whole at stage 3.
template <class Module>
std::vector<torch::Tensor> train_sharded(dtrain::context<Policy>& ctx, Module module,
                                         const stage3_case& c) {
  const int rank = ctx.rank(), size = ctx.size();
  const std::int64_t shard = global_batch / size;
  const bool stage3 = c.stage == dtrain::sharding::parameters;
  // A bucket per parameter (a unit is several), or the defaults (at stage 3
  // a bucket per unit: no bucket holds two).
  dtrain::ddp_options options{.bucket_cap_mb = 1.0 / 8192,
                              .first_bucket_cap_mb = 1.0 / 8192,
                              .sharding = c.stage,
                              .prefetch_units = c.prefetch};
  if (c.default_buckets) options = {.sharding = c.stage, .prefetch_units = c.prefetch};
  auto ddp = dtrain::torch::DistributedDataParallel(ctx, module, options,
                                                    {.reshard_after_forward = c.reshard});
  if (stage3 && !std::is_same_v<Module, Net>) {
    // No bucket holds parameters of two units (children of the Sequential).
    for (const dtrain::bucket_info& b : ddp.buckets()) {
      const std::string first = ddp.core().parameters()[b.parameters.front()].name;
      for (const std::size_t i : b.parameters) {
        const std::string name = ddp.core().parameters()[i].name;
        check(name.substr(0, name.find('.')) == first.substr(0, first.find('.')), rank,
              std::string(c.name) + ": a bucket holds '" + first + "' and '" + name + "'");
      }
    }
  }
  torch::optim::Adam opt(ddp.shard_parameters(), torch::optim::AdamOptions(0.01));
  for (int step = 0; step < steps; ++step) {
    for (int m = 0; m < c.micro; ++m) {
      torch::manual_seed(static_cast<std::uint64_t>(9000 + 31 * step + m));
      const torch::Tensor x = torch::randn({global_batch, 12}).to(device());
      const torch::Tensor y = torch::randint(0, 6, {global_batch}).to(device());
      auto loss = [&] {
        torch::Tensor in = x.narrow(0, rank * shard, shard);
        if constexpr (std::is_same_v<Module, Net>)
          in = in.narrow(1, 0, 1).repeat({1, 64}).view({shard, 1, 8, 8});
        return torch::nn::functional::cross_entropy(ddp(in), y.narrow(0, rank * shard, shard));
      };
      if (m + 1 < c.micro) {
        auto guard = ddp.no_sync();
        loss().backward();
      } else {
        loss().backward();
      }
    }
    ddp.step(opt);
    ddp.zero_grad();
    if (stage3) {
      for (const auto& p : ddp->parameters()) {
        // Between gathers: at DDP's fence on the host (a read there is named), null on a GPU.
        const void* at = p.storage().data();
        check(p.numel() > 0 && (on_gpu ? at == nullptr : dtrain::detail::value_fence::holds(at)),
              rank, std::string(c.name) + ": a parameter holds values between steps");
      }
    }
  }
  if (stage3) {
    const auto use = ddp.core().memory_use();
    const std::size_t whole = ddp.core().model_elements() * sizeof(float);
    check(use.values * static_cast<std::size_t>(size) <= whole + 64 * 1024, rank,
          std::string(c.name) + ": the shard of the values is " + std::to_string(use.values) +
              " bytes of a model of " + std::to_string(whole));
    check(use.gathered == 0, rank, std::string(c.name) + ": values stay whole past the step");
    const auto counts = ddp.core().gather_counts();
    const bool one_unit = std::is_same_v<Module, Net>;  // nothing ahead to prefetch
    check(size == 1 || c.prefetch == 0 || one_unit || counts.prefetched > 0, rank,
          std::string(c.name) + ": no gather was prefetched (" + std::to_string(counts.on_demand) +
              " on demand)");
    check(c.prefetch > 0 || counts.prefetched == 0, rank,
          std::string(c.name) + ": prefetched with prefetch_units = 0");
    if (rank == 0 && c.micro == 1) {
      std::printf("%-40s %d ranks: gathers %llu on demand, %llu prefetched, %llu unused\n", c.name,
                  size, static_cast<unsigned long long>(counts.on_demand),
                  static_cast<unsigned long long>(counts.prefetched),
                  static_cast<unsigned long long>(counts.unused));
    }
  }
  auto all = ddp.core().gather(ddp.core().parameters());
  std::vector<torch::Tensor> out;
  for (const auto& p : ddp->parameters()) out.push_back(p.detach().clone().cpu());
  return out;
}

void check_stage3(dtrain::context<Policy>& ctx) {
  const int rank = ctx.rank();
  auto same = [&](const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                  const std::string& what, double tolerance) {
    bool ok = a.size() == b.size();
    for (std::size_t i = 0; ok && i < a.size(); ++i)
      ok = tolerance == 0 ? torch::equal(a[i], b[i])
                          : (a[i] - b[i]).abs().max().item<double>() <= tolerance;
    check(ok, rank, what);
  };
  const std::vector<torch::Tensor> stage2 = train_sharded(
      ctx, make_layers(77), {.name = "stage 2", .stage = dtrain::sharding::gradients});
  {
    // One process on the whole batch (SGD's reference, with Adam).
    torch::nn::Sequential ref = make_layers(77);
    torch::optim::Adam opt(ref->parameters(), torch::optim::AdamOptions(0.01));
    for (int step = 0; step < steps; ++step) {
      torch::manual_seed(static_cast<std::uint64_t>(9000 + 31 * step));
      const torch::Tensor x = torch::randn({global_batch, 12}).to(device());
      const torch::Tensor y = torch::randint(0, 6, {global_batch}).to(device());
      torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
      opt.step();
      opt.zero_grad();
    }
    std::vector<torch::Tensor> whole;
    for (const auto& p : ref->parameters()) whole.push_back(p.detach().clone().cpu());
    same(stage2, whole, "stage 2 is not one process's Adam", 1e-5);
  }
  const double exact = on_gpu ? 1e-6 : 0;
  const stage3_case cases[] = {
      {.name = "stage 3"},
      {.name = "stage 3, reshard_after_forward = false", .reshard = false},
      {.name = "stage 3, prefetch 0", .prefetch = 0},
      {.name = "stage 3, prefetch 2", .prefetch = 2},
  };
  for (const stage3_case& c : cases) {
    same(train_sharded(ctx, make_layers(77 + static_cast<std::uint64_t>(rank)), c), stage2,
         std::string(c.name) + " does not end with stage 2's values", exact);
  }
  // Other buckets: other reduce-scatters, so float noise apart from stage 2's.
  same(train_sharded(ctx, make_layers(77),
                     {.name = "stage 3, default bucket sizes", .default_buckets = true}),
       stage2, "stage 3 with the default bucket sizes does not end near stage 2's values", 1e-5);
  same(
      train_sharded(ctx, make_layers(77), {.name = "stage 3, no_sync", .micro = 2}),
      train_sharded(ctx, make_layers(77),
                    {.name = "stage 2, no_sync", .stage = dtrain::sharding::gradients, .micro = 2}),
      "stage 3 with no_sync() does not end with stage 2's values", exact);
  // Net is no Sequential: one unit, gathered for its forward and kept for its backward.
  same(
      train_sharded(ctx, make_net(1001), {.name = "stage 3, one unit"}),
      train_sharded(ctx, make_net(1001), {.name = "stage 2", .stage = dtrain::sharding::gradients}),
      "stage 3 on a module of one unit does not end with stage 2's values", exact);
  {
    torch::nn::Sequential seq = make_layers(5);
    auto ddp = dtrain::torch::DistributedDataParallel(ctx, seq,
                                                      {.sharding = dtrain::sharding::parameters});
    // Evaluation unit by unit (every rank, no gradients) gives the whole model's output.
    const torch::Tensor x = torch::randn({4, 12}).to(device());
    torch::Tensor by_units, whole;
    {
      const torch::NoGradGuard no_grad;
      by_units = ddp(x);
      auto all = ddp.core().gather(ddp.core().parameters());
      whole = ddp->forward(x);
    }
    check(torch::equal(by_units, whole), rank,
          "stage 3: ddp(x) unit by unit differs from the whole model's forward");
    check(ddp.core().memory_use().gathered == 0, rank, "stage 3: evaluation left values whole");
    // The module alone has no values to save: refused by name.
    dtrain::checkpoint ckpt(ctx, {.dir = "unused-stage3-ckpt", .quiet = true});
    try {
      dtrain::torch::add_module(ckpt, seq);
      check(false, rank, "stage 3: add_module(ckpt, module) took a module without values");
    } catch (const dtrain::config_error& e) {
      check(std::string(e.what()).find("tensor '0.weight' has no values on this rank") !=
                std::string::npos,
            rank, std::string("stage 3: add_module's refusal: ") + e.what());
    }
  }
  {
    // A parameter over another tensor's storage cannot give its storage to DDP.
    torch::nn::Sequential seq = make_layers(6);
    {
      const torch::NoGradGuard no_grad;
      torch::Tensor& w = seq[0]->as<torch::nn::Linear>()->weight;
      w.set_data(torch::cat({w.flatten(), w.flatten()}).narrow(0, 0, w.numel()).view(w.sizes()));
    }
    try {
      dtrain::torch::DistributedDataParallel ddp(ctx, seq,
                                                 {.sharding = dtrain::sharding::parameters});
      check(false, rank, "stage 3: a parameter over a shared storage was taken");
    } catch (const dtrain::config_error& e) {
      check(std::string(e.what()).find("'0.weight' shares its storage") != std::string::npos, rank,
            std::string("stage 3: the shared storage refusal: ") + e.what());
    }
  }
  if (rank == 0) std::printf("ZeRO stage 3 on a Sequential and on a module: stage 2's values\n");
}

// `call` must throw dtrain::error with every one of `words` in its message.
template <class Call>
void expect_error(int rank, const std::string& what, Call&& call,
                  std::initializer_list<const char*> words) {
  try {
    call();
    check(false, rank, what + ": no error");
  } catch (const dtrain::error& e) {
    const std::string message = e.what();
    for (const char* word : words) {
      check(message.find(word) != std::string::npos, rank,
            what + ": the error does not say \"" + word + "\": " + message);
    }
    if (rank == 0) std::printf("%s: %s\n", what.c_str(), e.what());
  }
}

// A step that backward() cannot complete (parameters that got no gradient)
// is an error naming them at whatever would begin the next step: ddp(x),
// the next backward() (after ddp->forward(x)), zero_grad(); and, without
// find_unused_parameters, at synchronize(). With it, synchronize() completes
// the step with zeros for them.
void check_incomplete_step(dtrain::context<Policy>& ctx) {
  const batch b = data(0, 0);
  const std::int64_t shard = global_batch / ctx.size();
  const auto x = b.x.narrow(0, ctx.rank() * shard, shard);
  const auto y = b.y.narrow(0, ctx.rank() * shard, shard);
  {
    Net net = make_net(1000, true);  // aux and never are not used
    dtrain::torch::DistributedDataParallel ddp(ctx, net, {.always_reduce = on_gpu});
    torch::nn::functional::cross_entropy(ddp(x), y).backward();
    const auto words = {"step 0 is not complete", "no gradient to 4 of 10 parameters",
                        "'aux.weight', 'aux.bias', 'never.weight', 'never.bias'",
                        "find_unused_parameters = true"};
    expect_error(
        ctx.rank(), "ddp(x) after an incomplete step", [&] { ddp(x); }, words);
    expect_error(
        ctx.rank(), "zero_grad() in an incomplete step", [&] { ddp.zero_grad(); }, words);
    expect_error(
        ctx.rank(), "synchronize() without find_unused_parameters", [&] { ddp.synchronize(); },
        words);
  }
  {
    Net net = make_net(1000, true);
    dtrain::torch::DistributedDataParallel ddp(
        ctx, net, {.find_unused_parameters = true, .always_reduce = on_gpu});
    auto step = [&] { torch::nn::functional::cross_entropy(ddp->forward(x), y).backward(); };
    step();
    expect_error(ctx.rank(), "a second backward() after ddp->forward(x)", step,
                 {"step 0 is not complete", "autograd wrote the gradient of 'fc.bias'",
                  "'aux.weight', 'aux.bias', 'never.weight', 'never.bias'", "through ddp(x)",
                  "ddp.synchronize()"});
    ddp.synchronize();  // completes step 0 (zeros for aux and never)
    check(ddp.steps() == 1, ctx.rank(),
          "incomplete step: synchronize() with find_unused_parameters did not complete it");
  }
  {
    // Two forward passes before one backward(): the graph walk of the last one counts, as in
    // PyTorch (the first finds aux unused, the second uses it).
    Net net = make_net(1000, true);
    dtrain::torch::DistributedDataParallel ddp(
        ctx, net, {.find_unused_parameters = true, .always_reduce = on_gpu});
    (void)ddp(x);
    torch::nn::functional::cross_entropy(ddp(x, torch::ones({shard}, device())), y).backward();
    check(ddp.steps() == 1 && net->aux->weight.grad().defined(), ctx.rank(),
          "two forwards: the step after the second forward's walk did not complete with aux used");
  }
}

// Autograd may reach a parameter's accumulator with no gradient at all (a
// function whose backward returns an undefined tensor). Its .grad() then
// contributes zero, as in PyTorch's DDP, and not what its bucket slot held
// from the step before.
struct no_gradient : torch::autograd::Function<no_gradient> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, torch::Tensor x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    return {torch::Tensor()};
  }
};
struct PairImpl : torch::nn::Module {
  PairImpl() {
    a = register_module("a", torch::nn::Linear(6, 3));
    b = register_module("b", torch::nn::Linear(6, 3));
  }
  torch::Tensor forward(torch::Tensor x, bool drop_b) {
    const torch::Tensor h = b(x);
    return a(x) + (drop_b ? no_gradient::apply(h) : h);
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Pair);

void check_undefined_gradient(dtrain::context<Policy>& ctx) {
  torch::manual_seed(9);
  Pair pair;
  pair->to(device());
  dtrain::torch::DistributedDataParallel ddp(ctx, pair, {.always_reduce = on_gpu});
  torch::manual_seed(10 + static_cast<std::uint64_t>(ctx.rank()));
  const torch::Tensor x = torch::randn({4, 6}).to(device());
  ddp(x, false).square().mean().backward();  // b's bucket slots now hold its mean gradient
  for (torch::Tensor& p : pair->parameters()) p.mutable_grad() = torch::Tensor();
  ddp(x, true).square().mean().backward();
  for (const torch::Tensor& g : {pair->b->weight.grad(), pair->b->bias.grad()}) {
    check(g.defined() && g.abs().max().item<double>() == 0.0, ctx.rank(),
          "undefined gradient: b's .grad() is not zero after a backward() that gave it none");
  }
  if (ctx.rank() == 0) std::printf("an undefined gradient contributes zero\n");
}

// What fails while backward() completes the step (here a communication hook,
// on every rank alike) is thrown by backward(), with its type and message;
// the wrapper then refuses further steps, naming that failure.
void check_failure_in_backward(dtrain::context<Policy>& ctx) {
  Net net = make_net(1000);
  dtrain::torch::DistributedDataParallel ddp(ctx, net, {.always_reduce = on_gpu});
  ddp.register_comm_hook([](auto&, dtrain::gradient_bucket&) -> dtrain::work {
    throw dtrain::backend_error("test: the communication hook fails", 7);
  });
  const batch b = data(0, 0);
  const std::int64_t shard = global_batch / ctx.size();
  auto step = [&] {
    torch::nn::functional::cross_entropy(ddp(b.x.narrow(0, ctx.rank() * shard, shard)),
                                         b.y.narrow(0, ctx.rank() * shard, shard))
        .backward();
  };
  try {
    step();
    check(false, ctx.rank(), "failure in backward(): backward() returned");
  } catch (const dtrain::backend_error& e) {
    check(std::string(e.what()).find("the communication hook fails") != std::string::npos,
          ctx.rank(), std::string("failure in backward(): another message: ") + e.what());
  }
  expect_error(ctx.rank(), "the step after a failed one", step, {"the communication hook fails"});
}

// The torch::data sampler: next() walks this rank's shard, reset() starts over.
void check_sampler(int rank) {
  dtrain::torch::distributed_sampler sampler(37, 1, 4, {.seed = 3});
  std::vector<std::size_t> got;
  while (auto b = sampler.next(4)) got.insert(got.end(), b->begin(), b->end());
  const auto shard = sampler.shard().indices();
  check(got == std::vector<std::size_t>(shard.begin(), shard.end()) && got.size() == 10, rank,
        "sampler: next() did not walk the shard of 10 indices");
  sampler.reset(torch::nullopt);
  check(sampler.next(100)->size() == 10, rank, "sampler: reset() did not start the epoch over");
  sampler.set_epoch(1);
  const auto again = sampler.shard().indices();
  check(std::vector<std::size_t>(again.begin(), again.end()) != got, rank,
        "sampler: set_epoch(1) did not reshuffle");
  sampler.reset(8);
  check(sampler.size() == 2 && sampler.next(100)->size() == 2, rank,
        "sampler: reset(8) did not lay out 8 samples over 4 ranks");
}

// Each sample is its own index, so a data loader's batches show the order it drew.
struct index_dataset : torch::data::datasets::Dataset<index_dataset> {
  torch::data::Example<> get(std::size_t i) override {
    return {torch::tensor(static_cast<std::int64_t>(i)), torch::tensor(0)};
  }
  torch::optional<std::size_t> size() const override { return 37; }
};

// With torch::data::make_data_loader, which keeps a copy of the sampler: each
// epoch is this rank's shard, and set_epoch() on the caller's sampler
// reshuffles the loader's (with and without worker threads).
void check_sampler_in_loader(int rank) {
  for (const std::size_t workers : {0, 2}) {
    dtrain::torch::distributed_sampler sampler(37, 1, 4, {.seed = 3});
    auto loader = torch::data::make_data_loader(
        index_dataset{}.map(torch::data::transforms::Stack<>()), sampler,
        torch::data::DataLoaderOptions().batch_size(4).workers(workers));
    std::vector<std::size_t> previous;
    for (std::uint64_t epoch = 0; epoch < 3; ++epoch) {
      sampler.set_epoch(epoch);
      std::vector<std::size_t> drawn;
      for (const auto& batch : *loader) {
        for (std::int64_t k = 0; k < batch.data.size(0); ++k)
          drawn.push_back(static_cast<std::size_t>(batch.data[k].item<std::int64_t>()));
      }
      const auto shard = sampler.shard().indices();
      const std::string where = "sampler in a data loader (" + std::to_string(workers) +
                                " workers), epoch " + std::to_string(epoch);
      check(drawn == std::vector<std::size_t>(shard.begin(), shard.end()), rank,
            where + ": the loader did not draw this epoch's shard");
      check(drawn != previous, rank, where + ": the same order as the epoch before");
      previous = drawn;
    }
  }
  if (rank == 0) std::printf("sampler in torch::data::make_data_loader: reshuffled per epoch\n");
}

/// This rank's share of step `step`'s batch through `ddp`, and its loss.
template <class DDP>
torch::Tensor rank_loss(DDP& ddp, int step, int rank, int size) {
  const batch b = data(step, 0);
  const std::int64_t shard = global_batch / size;
  const torch::Tensor x = b.x.narrow(0, rank * shard, shard),
                      y = b.y.narrow(0, rank * shard, shard);
  return torch::nn::functional::cross_entropy(ddp(x), y);
}

/// One temporary directory for every rank: `prefix` and rank 0's pid.
std::filesystem::path shared_temp_dir(dtrain::context<Policy>& ctx, const std::string& prefix) {
  std::array<std::int64_t, 1> id{static_cast<std::int64_t>(::getpid())};
  std::vector<std::int64_t> ids(static_cast<std::size_t>(ctx.size()));
  ctx.control_plane().allgather(id, ids);  // host memory on every engine (NCCL too)
  return std::filesystem::temp_directory_path() / (prefix + std::to_string(ids[0]));
}

// dtrain::torch's checkpoint helpers (issue 33): a module (parameters and
// batch-norm buffers; on a GPU through the host), an SGD optimizer with
// momentum and the sampler saved, changed by a step, and restored: the
// module is back, and the next step gives what it gave before (so the
// momentum came back too). A module of another shape is refused by name.
void check_checkpoint(dtrain::context<Policy>& ctx) {
  const int rank = ctx.rank();
  const std::filesystem::path dir = shared_temp_dir(ctx, "dtrain-torch-ckpt-");
  Net net = make_net(11);
  auto ddp = dtrain::torch::DistributedDataParallel(ctx, net);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  dtrain::torch::distributed_sampler sampler(64, ctx.world(), {.seed = 3});
  auto train_step = [&](int step) {
    rank_loss(ddp, step, rank, ctx.size()).backward();
    opt.step();
    ddp.zero_grad();
  };
  auto snapshot = [&] {
    std::vector<torch::Tensor> out;
    for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
    for (const auto& b : net->buffers()) out.push_back(b.detach().clone());
    return out;
  };
  // Bit for bit on the CPU; on a GPU within float noise (cuDNN's convolution
  // backward may sum in another order from one call to the next).
  auto same = [](const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i) {
      const bool equal = on_gpu && a[i].is_floating_point()
                             ? torch::allclose(a[i], b[i], /*rtol=*/1e-5, /*atol=*/1e-6)
                             : torch::equal(a[i], b[i]);
      if (!equal) return false;
    }
    return true;
  };
  try {
    dtrain::checkpoint ckpt(ctx, {.dir = dir, .quiet = true});
    dtrain::torch::add_module(ckpt, net);
    dtrain::torch::add_optimizer(ckpt, opt);
    dtrain::torch::add_sampler(ckpt, sampler);
    train_step(0);
    static_cast<void>(sampler.next(8));
    ckpt.step();
    ckpt.save();
    const std::vector<torch::Tensor> saved = snapshot();
    const dtrain::sampler_position where = sampler.shard().position();
    train_step(1);
    const std::vector<torch::Tensor> after_one = snapshot();
    static_cast<void>(sampler.next(8));
    if (rank == 0) std::printf("checkpoint: saved step 1, restoring\n");
    check(ckpt.restore() == 1u, rank, "torch checkpoint: restore() did not find step 1");
    check(same(snapshot(), saved), rank, "torch checkpoint: the module did not come back");
    check(sampler.shard().position().offset == where.offset, rank,
          "torch checkpoint: the sampler did not come back");
    train_step(1);
    check(same(snapshot(), after_one), rank,
          "torch checkpoint: the step after restore() differs (the optimizer's momentum?)");
    if (rank == 0) std::printf("checkpoint: restored, and the next step agrees\n");
    if (!on_gpu) {
      Net other = make_net(11, false, 12);  // fc has 12 outputs, not 10
      const std::vector<torch::Tensor> before = [&] {
        std::vector<torch::Tensor> out;
        for (const auto& p : other->parameters()) out.push_back(p.detach().clone());
        return out;
      }();
      dtrain::checkpoint wrong(ctx, {.dir = dir, .quiet = true});
      dtrain::torch::add_module(wrong, other);
      try {
        wrong.restore();
        check(false, rank, "torch checkpoint: another model was loaded");
      } catch (const dtrain::checkpoint_error& e) {
        check(std::string(e.what()).find("'fc.weight' is [10, 256] float32 in the checkpoint and "
                                         "[12, 256] float32 here") != std::string::npos,
              rank,
              std::string("torch checkpoint: the refusal does not name fc.weight: ") + e.what());
        std::size_t i = 0;
        for (const auto& p : other->parameters())
          check(torch::equal(p, before[i++]), rank,
                "torch checkpoint: a refused load changed the module");
      }
    }
  } catch (const std::exception& e) {
    check(false, rank, std::string("torch checkpoint: ") + e.what());
  }
  if (rank == 0) std::printf("checkpoint: its objects are gone\n");
  std::vector<std::int64_t> done(static_cast<std::size_t>(ctx.size()));
  ctx.control_plane().allgather(std::array<std::int64_t, 1>{1}, done);  // every rank is past it
  if (rank == 0) std::printf("checkpoint: every rank is done\n");
  if (rank == 0) {
    // Not std::filesystem::remove_all: PyTorch's wheels export their own from
    // libtorch.so, which crashed here (a null call) on CUDA (detail/sys.hpp).
    check(dtrain::detail::remove_tree(dir.c_str()) == 0, rank,
          "torch checkpoint: cannot remove " + dir.string());
    std::printf("checkpoint of a module, an optimizer and the sampler: restored exactly\n");
  }
}

// A sharded DDP's optimizer (issue 34: Adam over shard_parameters(), its
// moments and step count registered by add_optimizer(ckpt, opt, ddp) as
// sharded entries): saved after a step, changed by the next, restored; the
// step after restore() gives what it gave before, bit for bit on the CPU,
// which it would not without the moments. An optimizer that is not on the
// shard is refused by name.
void check_sharded_checkpoint(dtrain::context<Policy>& ctx) {
  const int rank = ctx.rank();
  const auto failures_before = failures;
  const std::filesystem::path dir = shared_temp_dir(ctx, "dtrain-torch-sharded-ckpt-");
  Net net = make_net(13);
  auto ddp = dtrain::torch::DistributedDataParallel(
      ctx, net, {.bucket_cap_mb = 0.01, .sharding = dtrain::sharding::gradients});
  torch::optim::Adam opt(ddp.shard_parameters(), torch::optim::AdamOptions(0.01));
  auto train_step = [&](int step) {
    rank_loss(ddp, step, rank, ctx.size()).backward();
    ddp.step(opt);
  };
  auto snapshot = [&] {
    std::vector<torch::Tensor> out;
    for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
    return out;
  };
  auto same = [](const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
    for (std::size_t i = 0; i < a.size(); ++i) {
      const bool equal =
          on_gpu ? torch::allclose(a[i], b[i], 1e-5, 1e-6) : torch::equal(a[i], b[i]);
      if (!equal) return false;
    }
    return a.size() == b.size();
  };
  try {
    dtrain::checkpoint ckpt(ctx, {.dir = dir, .quiet = true});
    dtrain::torch::add_module(ckpt, net);
    dtrain::torch::add_optimizer(ckpt, opt, ddp);
    // After backward(), the shard's tensors hold their pieces' means: their
    // norm over every rank is the whole model's (what clipping needs).
    rank_loss(ddp, 0, rank, ctx.size()).backward();
    double squares = 0;
    for (const torch::Tensor& p : ddp.shard_parameters()) {
      check(p.grad().defined(), rank, "sharded: a shard tensor has no gradient after backward()");
      if (p.grad().defined()) squares += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
    }
    std::vector<std::int64_t> every(static_cast<std::size_t>(ctx.size()));
    ctx.control_plane().allgather(std::array<std::int64_t, 1>{std::bit_cast<std::int64_t>(squares)},
                                  every);
    double total = 0;
    for (const std::int64_t x : every) total += std::bit_cast<double>(x);
    const double norm = ddp.core().gradient_norm();
    check(std::abs(std::sqrt(total) - norm) <= 1e-5 * norm, rank,
          "sharded: the shard tensors' gradient norm " + std::to_string(std::sqrt(total)) +
              " is not gradient_norm() " + std::to_string(norm));
    ddp.step(opt);
    train_step(1);
    ckpt.step();
    ckpt.save();
    const std::vector<torch::Tensor> saved = snapshot();
    train_step(2);
    const std::vector<torch::Tensor> after = snapshot();
    train_step(3);  // the moments move on
    check(ckpt.restore() == 1u, rank, "sharded torch checkpoint: restore() did not find step 1");
    check(same(snapshot(), saved), rank, "sharded torch checkpoint: the module did not come back");
    train_step(2);
    check(same(snapshot(), after), rank,
          "sharded torch checkpoint: the step after restore() differs (Adam's moments?)");
    torch::optim::Adam other(net->parameters(), torch::optim::AdamOptions(0.01));
    try {
      dtrain::torch::add_optimizer(ckpt, other, ddp, "other");
      check(false, rank, "sharded torch checkpoint: an optimizer off the shard was taken");
    } catch (const dtrain::config_error& e) {
      check(std::string(e.what()).find("optimizer 'other' holds") != std::string::npos, rank,
            std::string("sharded torch checkpoint: the refusal does not name it: ") + e.what());
    }
  } catch (const std::exception& e) {
    check(false, rank, std::string("sharded torch checkpoint: ") + e.what());
  }
  std::vector<std::int64_t> done(static_cast<std::size_t>(ctx.size()));
  ctx.control_plane().allgather(std::array<std::int64_t, 1>{1}, done);
  if (rank == 0) {
    check(dtrain::detail::remove_tree(dir.c_str()) == 0, rank,
          "sharded torch checkpoint: cannot remove " + dir.string());
    if (failures == failures_before)
      std::printf("checkpoint of a sharded Adam (ZeRO stage 2): restored exactly\n");
  }
}

// dtrain::loss_scaler over a LibTorch module (issue 49): the loss times
// scale() before backward(); after it, the last rank's averaged gradient of
// the first parameter is made inf at step 1 (only that rank sees it), so
// every rank must skip that step, and the scale halve. On the CPU
// unscale(ddp.core()) divides the .grad() tensors (they are the core's
// pieces); on a GPU, check() decides and the program divides with mul_.
// Against the same run without the scaler that skips step 1 by hand: the
// same weights (bit for bit on the CPU: the scales are powers of 2).
void check_loss_scaler(dtrain::context<Policy>& ctx) {
  const int rank = ctx.rank();
  const bool last = rank == ctx.size() - 1;
  std::vector<std::vector<torch::Tensor>> weights;
  std::vector<bool> taken;
  std::vector<double> scales;
  for (const bool scaled : {true, false}) {
    Net net = make_net(13);
    auto ddp = dtrain::torch::DistributedDataParallel(ctx, net);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    dtrain::loss_scaler scaler({.init_scale = 1024, .growth_interval = 2, .enabled = scaled});
    for (int step = 0; step < 5; ++step) {
      (rank_loss(ddp, step, rank, ctx.size()) * scaler.scale()).backward();
      if (scaled && step == 1 && last) {
        torch::NoGradGuard no_grad;
        net->parameters()[0].mutable_grad().view(-1)[0].fill_(
            std::numeric_limits<float>::infinity());
      }
      bool take = step != 1;
      if (scaled && on_gpu) {
        take = scaler.check(ddp.core());
        torch::NoGradGuard no_grad;
        if (take)
          for (auto& p : net->parameters()) p.mutable_grad().mul_(1.0 / scaler.scale());
      } else if (scaled) {
        take = scaler.unscale(ddp.core());
      }
      if (scaled) {
        taken.push_back(take);
        scaler.update();
        scales.push_back(scaler.scale());
      }
      if (take) opt.step();
      ddp.zero_grad();
    }
    std::vector<torch::Tensor> w;
    for (const auto& p : net->parameters()) w.push_back(p.detach().clone());
    weights.push_back(std::move(w));
  }
  bool same = weights[0].size() == weights[1].size();
  for (std::size_t i = 0; same && i < weights[0].size(); ++i)
    same = on_gpu ? torch::allclose(weights[0][i], weights[1][i], 1e-5, 1e-6)
                  : torch::equal(weights[0][i], weights[1][i]);
  const bool schedule = taken == std::vector<bool>{true, false, true, true, true} &&
                        scales == std::vector<double>{1024, 512, 512, 1024, 1024};
  check(same && schedule, rank,
        "loss_scaler: an inf on the last rank at step 1 skips it on every rank (" +
            std::string(schedule ? "as it should" : "NOT as it should") + "), weights " +
            (same ? "equal to" : "differ from") + " the run that skips it by hand");
  if (rank == 0 && same && schedule)
    std::printf("loss_scaler: step 1 skipped on every rank, the weights %s\n",
                on_gpu ? "within 1e-5" : "bit-identical");
}

// ddp_options::master_weights over a LibTorch module in bfloat16 (issue 49),
// at every stage: shard_parameters() are float32 master copies (with a
// float32 .grad()), SGD steps them, and after each step the module's
// bfloat16 values are the master rounded once, piece by piece; the master
// moved from where it started; every stage ends near stage 0 (the same
// bfloat16 means, summed in another order at stages 2 and 3).
void check_master_weights(dtrain::context<Policy>& ctx) {
  const int rank = ctx.rank(), size = ctx.size();
  const std::int64_t shard = global_batch / size;
  std::vector<torch::Tensor> reference;
  for (const dtrain::sharding stage : {dtrain::sharding::none, dtrain::sharding::optimizer,
                                       dtrain::sharding::gradients, dtrain::sharding::parameters}) {
    const std::string name = "master_weights, sharding " + std::string(dtrain::to_string(stage));
    torch::nn::Sequential layers = make_layers(31);
    layers->to(torch::kBFloat16);
    auto ddp = dtrain::torch::DistributedDataParallel(ctx, layers,
                                                      {.bucket_cap_mb = 1.0 / 8192,
                                                       .first_bucket_cap_mb = 1.0 / 8192,
                                                       .sharding = stage,
                                                       .master_weights = true});
    std::vector<torch::Tensor> start;
    for (const torch::Tensor& t : ddp.shard_parameters()) {
      check(t.scalar_type() == torch::kFloat, rank, name + ": a shard tensor is not float32");
      start.push_back(t.detach().clone());
    }
    torch::optim::SGD opt(ddp.shard_parameters(), torch::optim::SGDOptions(1.0 / 1024));
    for (int step = 0; step < steps; ++step) {
      torch::manual_seed(static_cast<std::uint64_t>(7000 + 31 * step));
      const torch::Tensor x = torch::randn({global_batch, 12}).to(device());
      const torch::Tensor y = torch::randint(0, 6, {global_batch}).to(device());
      const torch::Tensor out =
          ddp(x.narrow(0, rank * shard, shard).to(torch::kBFloat16)).to(torch::kFloat);
      torch::nn::functional::cross_entropy(out, y.narrow(0, rank * shard, shard)).backward();
      ddp.step(opt);
      ddp.zero_grad();
    }
    bool rounded = true, moved = start.empty();
    const auto pieces = ddp.core().shard();
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      const torch::Tensor master = dtrain::torch::detail::tensor_over(pieces[k].master);
      const torch::Tensor values = dtrain::torch::detail::tensor_over(pieces[k].values);
      rounded = rounded && torch::equal(master.to(torch::kBFloat16), values);
      moved = moved || !torch::equal(master, start[k]);
    }
    check(rounded, rank, name + ": the module's values are not the master rounded once");
    check(moved, rank, name + ": the master weights did not move");
    auto all = ddp.core().gather(ddp.core().parameters());
    std::vector<torch::Tensor> got;
    for (const auto& p : ddp->parameters()) got.push_back(p.detach().to(torch::kFloat).cpu());
    if (reference.empty()) reference = got;
    bool near = got.size() == reference.size();
    for (std::size_t i = 0; near && i < got.size(); ++i)
      near = torch::allclose(got[i], reference[i], 1e-2, 1e-3);
    check(near, rank, name + ": the values are far from stage 0's");
    if (rank == 0 && rounded && moved && near)
      std::printf("%-40s %d ranks: float32 master, values rounded from it, near stage 0\n",
                  name.c_str(), size);
  }
}

int run_checks(dtrain::context<Policy>& ctx) {
  torch::set_num_threads(1);
  const variant variants[] = {
      {.name = "plain"},
      {.name = "plain, synchronize()", .completion = variant::synchronize_after},
      {.name = "plain, ddp.zero_grad()", .zeroing = variant::ddp},
      {.name = "plain, grads set to none", .zeroing = variant::none},
      {.name = "no_sync (2 micro-batches)", .micro = 2},
      {.name = "unused branch", .branches = true},
      {.name = "unused branch + no_sync", .micro = 2, .branches = true},
      {.name = "unused, grads set to none", .branches = true, .zeroing = variant::none},
      {.name = "unused, ddp->forward(x)",
       .branches = true,
       .completion = variant::forward_without_walk},
      {.name = "bf16 compression",
       .compression = dtrain::gradient_compression::bfloat16,
       .tolerance = 2e-2},
  };
  for (const variant& v : variants) {
#if !DTRAIN_TEST_TORCH_CUDA_KERNELS
    // GPU buckets are compressed by dtrain's kernels, which only an nvcc unit brings.
    if (on_gpu && v.compression != dtrain::gradient_compression::none) {
      if (ctx.rank() == 0) std::printf("%-28s skipped: no nvcc unit in this program\n", v.name);
      continue;
    }
#endif
    train_data_parallel(ctx, v);
  }
  check_overlap(ctx, false);
  check_overlap(ctx, true);
  check_walk_error(ctx);
  check_tied(ctx);
  check_mismatch(ctx);
  check_no_sync_guard(ctx);
  check_local_refusal(ctx);
  check_stage3(ctx);
  check_incomplete_step(ctx);
  check_undefined_gradient(ctx);
  check_failure_in_backward(ctx);
  check_sampler(ctx.rank());
  check_sampler_in_loader(ctx.rank());
  check_checkpoint(ctx);
  check_sharded_checkpoint(ctx);
  check_loss_scaler(ctx);
#if !DTRAIN_TEST_TORCH_CUDA_KERNELS
  // GPU master weights are rounded by dtrain's kernels, which only an nvcc unit brings.
  if (on_gpu) {
    if (ctx.rank() == 0) std::printf("master_weights skipped: no nvcc unit in this program\n");
  } else {
    check_master_weights(ctx);
  }
#else
  check_master_weights(ctx);
#endif
  std::vector<std::int64_t> all(static_cast<std::size_t>(ctx.size()));
  ctx.control_plane().allgather(std::array<std::int64_t, 1>{failures},
                                all);  // host memory, every engine
  std::int64_t total = 0;
  for (auto f : all) total += f;
  if (ctx.rank() == 0) {
    std::printf(total == 0 ? "PASS: LibTorch %s, %d ranks\n" : "FAILED: LibTorch %s, %d ranks\n",
                TORCH_VERSION, ctx.size());
  }
  return total == 0 ? 0 : 1;
}

}  // namespace

// A crash says where it happened before the process dies of its signal as it
// would have: the thread (its name, and whether it is the main one), the
// faulting instruction and address, the word at the stack pointer (after a
// call through a bad pointer: the caller's return address), each with the
// object it lies in and the offset there (for addr2line), then the frames.
void say_where(const char* what, const void* at) {
  char line[512];
  ::Dl_info info{};
  int n = 0;
  if (at != nullptr && ::dladdr(at, &info) != 0 && info.dli_fname != nullptr) {
    n = std::snprintf(line, sizeof line, "torch_ddp: %s %p = %s+0x%lx (%s)\n", what, at,
                      info.dli_fname,
                      static_cast<unsigned long>(static_cast<const char*>(at) -
                                                 static_cast<const char*>(info.dli_fbase)),
                      info.dli_sname != nullptr ? info.dli_sname : "?");
  } else {
    n = std::snprintf(line, sizeof line, "torch_ddp: %s %p (in no loaded object)\n", what, at);
  }
  if (n > 0) [[maybe_unused]]
    auto w = ::write(2, line, static_cast<std::size_t>(n));
}

extern "C" void print_frames_and_die(int sig, siginfo_t* info, void* context) {
  char name[32] = "?";
  ::pthread_getname_np(::pthread_self(), name, sizeof name);
  char line[160];
  const int n = std::snprintf(line, sizeof line, "torch_ddp: fatal signal %d in thread '%s' (%s)\n",
                              sig, name, ::gettid() == ::getpid() ? "the main thread" : "not main");
  if (n > 0) [[maybe_unused]]
    auto w = ::write(2, line, static_cast<std::size_t>(n));
  say_where("faulting address", info->si_addr);
#if defined(__x86_64__)
  const auto* uc = static_cast<const ucontext_t*>(context);
  say_where("instruction", reinterpret_cast<const void*>(uc->uc_mcontext.gregs[REG_RIP]));
  const auto* sp = reinterpret_cast<void* const*>(uc->uc_mcontext.gregs[REG_RSP]);
  for (int i = 0; i < 4; ++i) say_where("word at the stack pointer", sp[i]);
#else
  (void)context;
#endif
  void* frames[64];
  ::backtrace_symbols_fd(frames, ::backtrace(frames, 64), 2);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

// A module called around the wrapper at ZeRO stage 3 (`ddp->forward(x)`
// outside a gather) reads values no rank holds: the rank ends with status 1
// and a line that names the parameter, its unit and the rank (issue 48; the
// crash handler above is installed first, as a program's own would be, and
// is not what speaks). tests/torch/torch.cmake checks the line.
TEST_CASE("outside") {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  struct sigaction fatal {};
  fatal.sa_sigaction = print_frames_and_die;
  fatal.sa_flags = SA_SIGINFO;
  ::sigaction(SIGSEGV, &fatal, nullptr);
  if (on_gpu) {  // device memory: the values are null between gathers, no fence
    std::printf("SKIPPED: on a GPU a value outside a gather() is a null pointer\n");
    dtrain_test::end_job(77);
  }
  dtrain_test::end_job(dtrain_test::run_with<Policy>([](dtrain::context<Policy>& ctx) {
    torch::nn::Sequential seq = make_layers(7);
    auto ddp = dtrain::torch::DistributedDataParallel(ctx, seq,
                                                      {.sharding = dtrain::sharding::parameters});
    const torch::Tensor x = torch::randn({4, 12});
    {
      const torch::NoGradGuard no_grad;
      (void)ddp(x);  // through the wrapper: unit by unit
    }
    std::printf("rank %d: ddp(x) ran unit by unit\n", ctx.rank());
    const torch::Tensor y = ddp->forward(x);  // around it: no values
    std::printf("rank %d: ddp->forward(x) gave %g, unnamed\n", ctx.rank(), y.sum().item<double>());
    return 1;
  }));
}

TEST_CASE("ddp") {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line as it is printed (a crash keeps them)
  struct sigaction fatal {};
  fatal.sa_sigaction = print_frames_and_die;
  fatal.sa_flags = SA_SIGINFO;
  for (const int sig : {SIGSEGV, SIGBUS, SIGILL}) ::sigaction(sig, &fatal, nullptr);
  if (on_gpu && !torch::cuda::is_available()) {
    std::printf("SKIPPED: no CUDA device (LibTorch %s sees none)\n", TORCH_VERSION);
    dtrain_test::end_job(77);
  }
  CHECK(dtrain_test::run_with<Policy>(
            [](dtrain::context<Policy>& ctx) { return run_checks(ctx); }) == 0);
}
