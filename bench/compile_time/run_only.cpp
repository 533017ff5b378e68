// run<> over Gloo without a DistributedDataParallel: what a TU costs before any DDP.
#include <dtrain/dtrain.hpp>

using Policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>;

int main(int argc, char** argv) {
  return dtrain::run<Policy>(argc, argv, [](dtrain::context<Policy>& ctx) {
    ctx.barrier();
    return 0;
  });
}
