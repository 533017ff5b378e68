// Built once per engine with -Wall -Wextra -Wpedantic -Wshadow -Wconversion
// -Wsign-conversion -Werror and dtrain's headers NOT as system headers
// (compile.strict_<engine>): user code with strict warnings must stay quiet.
// It touches what a training program touches: run<>, context, DDP, the
// sampler, the free collectives and the node agent.
#include <dtrain/checkpoint.hpp>  // what dtrain.hpp leaves out is checked too
#include <dtrain/dtrain.hpp>

#include <span>
#include <vector>

#if DTRAIN_STRICT_ENGINE_MPI
using strict_backend = dtrain::backend::mpi;
using strict_launch = dtrain::launch::per_process;
#elif DTRAIN_STRICT_ENGINE_GLOO
using strict_backend = dtrain::backend::gloo;
using strict_launch = dtrain::launch::per_node;
#elif DTRAIN_STRICT_ENGINE_NCCL
using strict_backend = dtrain::backend::nccl;
using strict_launch = dtrain::launch::per_node;
#else
#error "define one of DTRAIN_STRICT_ENGINE_MPI, _GLOO, _NCCL"
#endif

namespace {

struct strict_model {
  std::vector<float> w{1, 2};
  float* grad = nullptr;
  std::vector<float> running{0};
  std::vector<dtrain::parameter> parameters() { return {dtrain::param("w", w, grad)}; }
  std::vector<dtrain::parameter> buffers() { return {dtrain::param("running", running)}; }
};

template <class Policy>
int train(dtrain::context<Policy>& ctx) {
  strict_model model;
  dtrain::DistributedDataParallel<strict_model, Policy> ddp(ctx, model);
  dtrain::distributed_sampler sampler(100, ctx.world());
  for (std::size_t epoch = 0; epoch < 2; ++epoch) {
    sampler.set_epoch(epoch);
    for (std::span<const std::size_t> batch : sampler.batches(8)) {
      (void)batch;
      if (epoch == 0) {
        ddp.mark_ready(std::vector<std::size_t>{0});
      } else {
        ddp.mark_ready({"w"});
      }
      ddp.mark_all_ready();  // marks what is left: nothing here
      ddp.synchronize();
      ddp.zero_grad();
    }
  }
  if constexpr (Policy::communicator_type::reaches_host_memory) {
    std::vector<double> loss{1.0};
    dtrain::allreduce(ctx.communicator(), loss, dtrain::reduce_op::avg).wait();
  }
  return 0;
}

}  // namespace

template class dtrain::DistributedDataParallel<
    strict_model, dtrain::policy<strict_launch, strict_backend, dtrain::topology::hierarchical>>;

int main(int argc, char** argv) {
  using Policy = dtrain::policy<strict_launch, strict_backend>;
  dtrain::run_options options;
  options.agent.nproc_per_node = 2;
  return dtrain::run<Policy>(
      argc, argv, [](dtrain::context<Policy>& ctx) { return train(ctx); }, options);
}
