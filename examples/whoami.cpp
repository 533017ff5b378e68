// dtrain_whoami: prints the world this process sees as one JSON line.
//
// Run it under your cluster's launcher to see what dtrain sees:
//   mpirun -np 4 dtrain_whoami
//   torchrun --nproc-per-node 2 --no-python dtrain_whoami
//   srun -N 2 --ntasks-per-node 4 dtrain_whoami
//   dtrain_whoami --per-node --nproc-per-node 4     (a per-node agent's view)
//   dtrain_whoami --describe                         (also where each field came from, on stderr)
//
// Exit status: 0, or 2 on a bad environment or bad arguments (message on stderr).

#include <dtrain/dtrain.hpp>

#include <charconv>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace {

struct cli {
  dtrain::discover_options options;
  bool describe = false;
  std::vector<std::string_view> rest;  // handed to discovery (e.g. --local_rank=N)
};

int count_option(std::string_view flag, std::string_view text) {
  int value = -1;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 0) {
    throw dtrain::config_error("dtrain_whoami " + std::string(flag) + " " + std::string(text) +
                               ": expected a non-negative integer");
  }
  return value;
}

cli parse_cli(int argc, char** argv) {
  cli c;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    auto value = [&](std::string_view flag) -> std::string_view {
      if (i + 1 >= argc)
        throw dtrain::config_error("dtrain_whoami " + std::string(flag) + " needs a value");
      return argv[++i];
    };
    if (a == "--per-node") {
      c.options.mode = dtrain::launch_mode::per_node;
    } else if (a == "--nproc-per-node") {
      c.options.nproc_per_node = count_option(a, value(a));
    } else if (a == "--nnodes") {
      c.options.nnodes = count_option(a, value(a));
    } else if (a == "--node-rank") {
      c.options.node_rank = count_option(a, value(a));
    } else if (a == "--describe") {
      c.describe = true;
    } else if (a == "--help" || a == "-h") {
      std::cout
          << "usage: dtrain_whoami [--describe] [--per-node [--nproc-per-node N] [--nnodes N] "
             "[--node-rank N]]\nPrints the world this process sees as one JSON line.\n";
      std::exit(0);
    } else {
      c.rest.push_back(a);
    }
  }
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    cli c = parse_cli(argc, argv);
    dtrain::world w =
        dtrain::discover_world(dtrain::environment::from_process(), c.rest, c.options);
    if (c.describe) std::cerr << w.describe() << '\n';
    std::cout << dtrain::to_json(w) << '\n' << std::flush;
    return 0;
  } catch (const dtrain::config_error& e) {
    std::cerr << "dtrain_whoami: " << e.what() << '\n';
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "dtrain_whoami: " << e.what() << '\n';
    return 1;
  }
}
