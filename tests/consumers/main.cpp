// The program every consumer project builds: it must compile and link against
// dtrain however dtrain was obtained. Run without a launcher, it is world size 1.
#include <dtrain/dtrain.hpp>

#include <iostream>

int main(int argc, char** argv) {
  auto w = dtrain::discover_world(argc, argv);
  std::cout << DTRAIN_VERSION_STRING << ' ' << dtrain::to_json(w) << '\n';
  return (w.world_size && *w.world_size == 1) ? 0 : 1;
}
