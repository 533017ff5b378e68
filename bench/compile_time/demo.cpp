// The program of issue 14: run<> over Gloo and a DistributedDataParallel, the
// translation unit whose compile time bench/compile_time.sh measures.
#include <dtrain/dtrain.hpp>

#include <vector>

using Policy = dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>;

struct net {
  std::vector<float> w1, b1, g1, gb1;
  std::vector<dtrain::parameter> parameters() {
    return {dtrain::param("w1", w1, g1), dtrain::param("b1", b1, gb1)};
  }
};

int main(int argc, char** argv) {
  return dtrain::run<Policy>(argc, argv, [](dtrain::context<Policy>& ctx) {
    net m;
    dtrain::DistributedDataParallel<net, Policy> ddp(ctx, m);
    ddp.mark_ready("w1");
    ddp.synchronize();
    return 0;
  });
}
