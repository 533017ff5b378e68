// dtrain_whoami: prints the world this process sees as one JSON line.
//
// Run it under your cluster's launcher to see what dtrain sees:
//   mpirun -np 4 dtrain_whoami
//   torchrun --nproc-per-node 2 --no-python dtrain_whoami
//   srun -N 2 --ntasks-per-node 4 dtrain_whoami
//   dtrain_whoami --per-node --nproc-per-node 4     (a per-node agent's view)
//   dtrain_whoami --describe                         (also where each field came from, on stderr)
//   mpirun -np 8 --hostfile H dtrain_whoami --rendezvous
//   dtrun --nnodes 2 --node-rank 0 --master-addr node1 --nproc-per-node 4 --
//         dtrain_whoami --rendezvous
//
// --rendezvous: every rank joins the job as a training program does (the store,
// then the communicator: MPI under an MPI launcher, else Gloo; --backend picks
// one) and prints the world completed there, with node ranks and local ranks
// grouped by host name, and its host: one JSON line per rank.
//
// Exit status: 0, or 2 on a bad environment or bad arguments (message on stderr);
// with --rendezvous, what dtrain::run returns (1 when a peer or the store fails).

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
  bool rendezvous = false;
  std::string backend;  // "mpi", "gloo", or empty: MPI under an MPI launcher, else Gloo
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
    } else if (a == "--rendezvous") {
      c.rendezvous = true;
    } else if (a == "--backend") {
      c.backend = value(a);
      if (c.backend != "mpi" && c.backend != "gloo") {
        throw dtrain::config_error("dtrain_whoami --backend " + c.backend +
                                   ": expected mpi or gloo");
      }
    } else if (a == "--help" || a == "-h") {
      std::cout
          << "usage: dtrain_whoami [--describe] [--per-node [--nproc-per-node N] [--nnodes N] "
             "[--node-rank N]]\n       dtrain_whoami --rendezvous [--backend mpi|gloo] "
             "[--describe]\nPrints the world this process sees as one JSON line; "
             "with --rendezvous, after meeting the other ranks, with the node fields completed.\n";
      std::exit(0);
    } else {
      c.rest.push_back(a);
    }
  }
  return c;
}

/// The completed world as to_json() prints it, with this process's host name.
std::string completed_json(const dtrain::world& w) {
  std::string json = dtrain::to_json(w);
  json.pop_back();  // '}'
  json += ",\"host\":";
  dtrain::detail::json::write_string(json, dtrain::detail::host_name().value_or("?"));
  return json + "}";
}

template <class Backend>
int meet(int argc, char** argv, bool describe) {
  using policy = dtrain::policy<dtrain::launch::per_process, Backend>;
  return dtrain::run<policy>(argc, argv, [&](dtrain::context<policy>& ctx) {
    if (describe) std::cerr << ctx.world().describe() + "\n" << std::flush;
    std::cout << completed_json(ctx.world()) + "\n" << std::flush;
    ctx.barrier();  // every rank has met before any leaves
  });
}

/// Joins the job and prints the completed world (one line per rank).
int rendezvous(int argc, char** argv, const cli& c, const dtrain::world& w) {
  if (c.options.mode == dtrain::launch_mode::per_node) {
    throw dtrain::config_error(
        "dtrain_whoami --rendezvous runs as a worker: start it under a per-node agent instead, "
        "e.g. dtrun --nproc-per-node 4 -- dtrain_whoami --rendezvous");
  }
  const bool mpi_launcher =
      w.source == dtrain::launcher::open_mpi || w.source == dtrain::launcher::hydra;
  std::string backend = c.backend;
  if (backend.empty()) backend = mpi_launcher && DTRAIN_HAS_MPI() ? "mpi" : "gloo";
#if DTRAIN_HAS_MPI()
  if (backend == "mpi") return meet<dtrain::backend::mpi>(argc, argv, c.describe);
#endif
#if DTRAIN_HAS_GLOO()
  if (backend == "gloo") return meet<dtrain::backend::gloo>(argc, argv, c.describe);
#endif
  (void)argc;
  (void)argv;
  throw dtrain::config_error("dtrain_whoami --rendezvous: this dtrain_whoami was built without " +
                             backend + " (see the engines line of cmake's output)");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    cli c = parse_cli(argc, argv);
    dtrain::world w =
        dtrain::discover_world(dtrain::environment::from_process(), c.rest, c.options);
    if (c.rendezvous) return rendezvous(argc, argv, c, w);
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
