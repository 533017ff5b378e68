// A separate process for the store tests.
//   dtrain_store_peer serve               serve on 127.0.0.1 (free port), print the port, wait to
//                                         be killed
//   dtrain_store_peer work PORT RANK N    one of N ranks: meet, exchange, elect; exit 0
//                                         when all checks hold
//   dtrain_store_peer lease PORT KEY      lease KEY (value "held"), print "leased", wait to be
//                                         killed
#include <dtrain/dtrain.hpp>

#include "store_workload.hpp"

#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>

#include <unistd.h>

using namespace std::chrono_literals;

namespace {

int work(int port, int rank, int world) {
  dtrain::store_client client("127.0.0.1", port, {.timeout = 60s});
  dtrain::prefix_store job(client, "job");
  auto failure = dtrain_test::store_workload(job, rank, world);
  if (failure.empty()) return 0;
  std::cerr << "rank " << rank << ": " << failure << '\n';
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "serve") {
      // DTRAIN_STORE_TOKEN, DTRAIN_STORE_IDLE_TIMEOUT, ... apply (bench/store_attack.py).
      dtrain::store_server server(
          "127.0.0.1", 0, dtrain::store_options{}.with_env(dtrain::environment::from_process()));
      std::printf("%d\n", server.port());
      std::fflush(stdout);
      for (;;) ::pause();
    }
    if (mode == "lease" && argc == 4) {
      dtrain::store_client client("127.0.0.1", std::stoi(argv[2]), {.timeout = 60s});
      client.lease(argv[3], "held");
      std::printf("leased\n");
      std::fflush(stdout);
      for (;;) ::pause();
    }
    if (mode == "work" && argc == 5)
      return work(std::stoi(argv[2]), std::stoi(argv[3]), std::stoi(argv[4]));
    std::cerr << "usage: dtrain_store_peer serve | work PORT RANK N | lease PORT KEY\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "dtrain_store_peer: " << e.what() << '\n';
    return 1;
  }
}
