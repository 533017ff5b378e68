// The program every consumer project builds: it must compile and link against
// dtrain however dtrain was obtained. Run without a launcher, it is world size 1.
#include <dtrain/dtrain.hpp>

#include <iostream>

#if DTRAIN_CONSUMER_GLOO_ONLY  // linked to dtrain::gloo alone
static_assert(DTRAIN_HAS_GLOO() && !DTRAIN_HAS_MPI() && !DTRAIN_HAS_NCCL(),
              "dtrain::gloo must switch on Gloo and nothing else");
#endif
// Set by common.cmake: 1 for dtrain::dtrain and dtrain::<engine> (compiled by
// default), 0 for dtrain::header_only and for a dtrain built with DTRAIN_HEADER_ONLY=ON.
static_assert(DTRAIN_HAS_SEPARATE_COMPILATION() == DTRAIN_CONSUMER_EXPECT_SEPARATE,
              "this target gave the other form of dtrain (compiled or header-only)");

int main(int argc, char** argv) {
  auto w = dtrain::discover_world(argc, argv);
  std::cout << DTRAIN_VERSION_STRING << ' ' << dtrain::to_json(w) << '\n';
  return (w.world_size && *w.world_size == 1) ? 0 : 1;
}
