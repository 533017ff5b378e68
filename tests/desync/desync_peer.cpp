// dtrain_desync_peer: a job in which one rank (rank 2) misbehaves, for the
// desync diagnostics tests (tests/desync/desync.cmake). Every rank trains a
// two-layer toy model with DistributedDataParallel for three steps; on the
// last one rank 2:
//
//   skip    skips the step (never starts its buckets' allreduces) and waits
//           elsewhere (for a store key nobody sets) until the job ends;
//   sleep   sleeps past the collective timeout before the step;
//   stall   stalls past the collective timeout in the middle of the step,
//           between its two buckets (bucket 0 has travelled, bucket 1 waits);
//   size    (after the steps) calls a user allreduce with 0 elements, not 1000
//           (an empty batch), then waits as skip does;
//   gone    exits (its process is gone) before the step; under mpirun, which
//           would stop the job at once, it freezes (SIGSTOP) instead;
//   signal  sends itself SIGUSR1, then does what skip does;
//   exit    skips the step and returns 0: its training function ends well, one
//           step short (for the agent's summary under dtrun, tests/launch/cases.sh).
//
//   dtrain_desync_peer mpi|gloo|nccl skip|sleep|stall|size|gone|signal|exit
//
// nccl is the NCCL engine over its host fake (tests/engines/fake_nccl.hpp, its
// directory in FAKE_NCCL_DIR), the model in the fake's device memory; size is
// not run there (NCCL has no answer for a size mismatch but a hang or
// garbage, and an empty call launches nothing).
//
// The job must fail, and one table must name rank 2 and what it did.

#include <dtrain/dtrain.hpp>
#if DTRAIN_HAS_NCCL()
#include "../engines/fake_nccl.hpp"
#endif

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include <unistd.h>

namespace {

constexpr std::size_t layer0_size = 262144, layer1_size = 65536;

/// Two layers in host memory (MPI, Gloo).
struct toy_model {
  std::vector<float> w0 = std::vector<float>(layer0_size, 1.0f),
                     g0 = std::vector<float>(layer0_size);
  std::vector<float> w1 = std::vector<float>(layer1_size, 1.0f),
                     g1 = std::vector<float>(layer1_size);

  std::vector<dtrain::parameter> parameters() {
    return {dtrain::param("layer0.weight", w0, g0), dtrain::param("layer1.weight", w1, g1)};
  }
  void set_gradients(float value) {
    std::fill(g0.begin(), g0.end(), value);
    std::fill(g1.begin(), g1.end(), value);
  }
};

#if DTRAIN_HAS_NCCL()
/// The same in the fake's device memory (NCCL through its host fake), through
/// the fake's memory space: the gradients are uploaded on the legacy stream,
/// which DDP's collectives follow.
struct device_toy_model {
  using space = fake_nccl::memory;
  int device = 0;
  float* w0 = alloc(layer0_size);
  float* g0 = alloc(layer0_size);
  float* w1 = alloc(layer1_size);
  float* g1 = alloc(layer1_size);

  explicit device_toy_model(int dev) : device(dev) {
    upload(w0, layer0_size, 1.0f);
    upload(w1, layer1_size, 1.0f);
  }
  device_toy_model(const device_toy_model&) = delete;
  device_toy_model& operator=(const device_toy_model&) = delete;
  // Not freed: a rank that fails leaves collectives that may still read them
  // until its communicators are aborted.
  ~device_toy_model() = default;

  std::vector<dtrain::parameter> parameters() {
    return {dtrain::device_param("layer0.weight", w0, g0, layer0_size, device),
            dtrain::device_param("layer1.weight", w1, g1, layer1_size, device)};
  }
  void set_gradients(float value) {
    upload(g0, layer0_size, value);
    upload(g1, layer1_size, value);
  }

 private:
  static float* alloc(std::size_t n) {
    return static_cast<float*>(space::allocate(n * sizeof(float), 0, nullptr));
  }
  void upload(float* to, std::size_t n, float value) const {
    const std::vector<float> v(n, value);
    space::upload(to, v.data(), n * sizeof(float), device, nullptr);
    space::synchronize(device, nullptr);
  }
};
#endif

template <class Model, class Context>
Model make_model(Context& ctx) {
  if constexpr (std::is_constructible_v<Model, int>) {
    return Model(ctx.device());
  } else {
    return Model{};
  }
}

template <class Model, class Policy>
int job(dtrain::context<Policy>& ctx, std::string_view which) {
  constexpr int faulty = 2;
  const bool me = ctx.rank() == faulty;
  Model model = make_model<Model>(ctx);
  // Caps below either layer (256 KiB and 1 MiB), so each layer closes a bucket of its own.
  dtrain::DistributedDataParallel<Model, Policy> ddp(
      ctx, model, {.bucket_cap_mb = 0.125, .first_bucket_cap_mb = 0.125});
  constexpr int steps = 3;
  for (int step = 0; step < steps; ++step) {
    const bool last = step == steps - 1;
    if (last && me) {
      if (which == "signal") ::kill(::getpid(), SIGUSR1);
      if (which == "skip" || which == "signal") {
        std::fprintf(stderr, "[rank %d] skipped the last step; waiting elsewhere\n", ctx.rank());
        // Stuck elsewhere (a data loader, say): a store key nobody sets, until
        // the job ends or 12 s (3 collective timeouts) pass.
        (void)ctx.store().get("desync-test/never-set", std::chrono::seconds(12));
        return 0;
      }
      if (which == "exit") {
        std::fprintf(stderr, "[rank %d] skipped the last step; returning 0\n", ctx.rank());
        return 0;
      }
      if (which == "gone") {
        // mpirun stops the whole job the moment a rank exits, before anyone
        // could notice: under MPI rank 2 freezes instead, which the others
        // see the same way (no answer). mpirun kills it with the job.
        if constexpr (std::is_same_v<typename Policy::backend_type, dtrain::backend::mpi>)
          ::raise(SIGSTOP);
        std::_Exit(1);
      }
      if (which == "sleep") {
        std::fprintf(stderr, "[rank %d] sleeping past the collective timeout\n", ctx.rank());
        std::this_thread::sleep_for(std::chrono::seconds(12));
      }
    }
    model.set_gradients(static_cast<float>(ctx.rank()));
    ddp.mark_ready("layer1.weight");  // backward: the last layer first
    if (last && me && which == "stall") {
      // Mid-bucket: bucket 0 (layer1) travels, bucket 1 waits for this rank.
      std::fprintf(stderr, "[rank %d] stalls between its buckets past the collective timeout\n",
                   ctx.rank());
      std::this_thread::sleep_for(std::chrono::seconds(12));
    }
    ddp.mark_ready("layer0.weight");
    ddp.synchronize();
  }
  if constexpr (std::is_same_v<Model, toy_model>) {  // host memory
    if (which == "size") {
      // Gloo aborts the process on a size mismatch that moves data (an enforce
      // on its I/O thread); an empty call moves nothing, so the others stall.
      std::vector<float> values(me ? 0 : 1000, 1.0f);
      dtrain::allreduce(ctx.communicator(), std::span<float>(values)).wait();
      if (me) (void)ctx.store().get("desync-test/never-set", std::chrono::seconds(12));
    }
  }
  return 0;
}

template <class Backend, class Model = toy_model>
int start(int argc, char** argv, std::string_view which) {
  using Policy = dtrain::policy<dtrain::launch::per_process, Backend>;
  return dtrain::run<Policy>(argc, argv,
                             [&](dtrain::context<Policy>& ctx) { return job<Model>(ctx, which); });
}

}  // namespace

int main(int argc, char** argv) {
  const std::string_view backend = argc > 1 ? argv[1] : "";
  const std::string_view which = argc > 2 ? argv[2] : "";
  constexpr std::string_view cases[] = {"skip", "sleep", "stall", "size", "gone", "signal", "exit"};
  if (std::find(std::begin(cases), std::end(cases), which) == std::end(cases) ||
      (backend == "nccl" && which == "size")) {
    std::fprintf(stderr,
                 "usage: dtrain_desync_peer mpi|gloo|nccl skip|sleep|stall|size|gone|signal|exit "
                 "(size: not on nccl)\n");
    return 2;
  }
#if DTRAIN_HAS_MPI()
  if (backend == "mpi") return start<dtrain::backend::mpi>(argc, argv, which);
#endif
#if DTRAIN_HAS_GLOO()
  if (backend == "gloo") return start<dtrain::backend::gloo>(argc, argv, which);
#endif
#if DTRAIN_HAS_NCCL()
  if (backend == "nccl") return start<fake_nccl::backend, device_toy_model>(argc, argv, which);
#endif
  std::fprintf(stderr, "dtrain_desync_peer: backend '%s' is not in this build\n",
               std::string(backend).c_str());
  return 2;
}
