// Must NOT compile, and with one kind of error only: a whole program (run<>,
// a collective, DDP) whose engine was not compiled in (no DTRAIN_WITH_GLOO).
// The test compile.fail.run_without_engine expects the policy's static_assert
// and fails on any follow-on error (an incomplete type, a missing member).
#include <dtrain/dtrain.hpp>

#include <span>
#include <vector>

#if DTRAIN_HAS_GLOO()
#error "this check needs a build without Gloo (it links dtrain::core)"
#endif

namespace {
struct one_weight {
  std::vector<float> w{1};
  float* grad = nullptr;
  std::vector<dtrain::parameter> parameters() { return {dtrain::param("w", w, grad)}; }
};
}  // namespace

int main(int argc, char** argv) {
  using Policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>;
  return dtrain::run<Policy>(argc, argv, [](dtrain::context<Policy>& ctx) {
    std::vector<float> v{1.0f};
    dtrain::allreduce(ctx.communicator(), std::span<float>(v), dtrain::reduce_op::sum).wait();
    one_weight model;
    dtrain::DistributedDataParallel<one_weight, Policy> ddp(ctx, model);
    ddp.synchronize();
    return 0;
  });
}
