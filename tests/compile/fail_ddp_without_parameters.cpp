// Must NOT compile: DistributedDataParallel wraps a model through its
// parameters(). The test compile.fail.ddp_without_parameters expects the message.
#include <dtrain/dtrain.hpp>

#include <vector>

struct weights_only {
  std::vector<float> w;
};
using job = dtrain::policy<dtrain::launch::per_process, dtrain::backend::mpi>;
void train(dtrain::context<job>& ctx, weights_only& model) {
  dtrain::DistributedDataParallel<weights_only, job> ddp(ctx, model);
}
