// env:// launchers: torchrun, Azure ML PyTorch jobs, Kubeflow PyTorchJob,
// Hugging Face --local_rank, Lightning-style per-node jobs.
#include "support.hpp"

using dtrain::environment;
using dtrain::launcher;
using dtrain_test::discover;
using dtrain_test::discover_agent;
using dtrain_test::discover_error;

namespace {
// What torchrun --nnodes 2 --nproc-per-node 4 gives worker 5 (node 1, local 1).
environment torchrun_worker_5() {
  return {{"PATH", "/usr/bin:/bin"},
          {"HOME", "/home/alice"},
          {"MASTER_ADDR", "10.0.0.4"},
          {"MASTER_PORT", "29500"},
          {"WORLD_SIZE", "8"},
          {"RANK", "5"},
          {"LOCAL_RANK", "1"},
          {"LOCAL_WORLD_SIZE", "4"},
          {"GROUP_RANK", "1"},
          {"GROUP_WORLD_SIZE", "2"},
          {"ROLE_RANK", "5"},
          {"ROLE_NAME", "default"},
          {"ROLE_WORLD_SIZE", "8"},
          {"TORCHELASTIC_RESTART_COUNT", "0"},
          {"TORCHELASTIC_MAX_RESTARTS", "0"},
          {"TORCHELASTIC_RUN_ID", "none"},
          {"TORCHELASTIC_USE_AGENT_STORE", "True"},
          {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"},
          {"OMP_NUM_THREADS", "1"}};
}
}  // namespace

TEST_CASE("env://: a torchrun worker on the second of two nodes") {
  auto w = discover(torchrun_worker_5());
  CHECK(w.source == launcher::env);
  CHECK(w.role == dtrain::process_role::worker);
  CHECK(w.rank == 5);
  CHECK(w.world_size == 8);
  CHECK(w.local_rank == 1);
  CHECK(w.local_world_size == 4);
  CHECK(w.node_rank == 1);
  CHECK(w.num_nodes == 2);
  CHECK(w.master_addr == "10.0.0.4");
  CHECK(w.master_port == 29500);
  CHECK(w.complete());
  CHECK(w.origin(dtrain::world::field::node_rank) == "GROUP_RANK=1");
  CHECK(w.origin(dtrain::world::field::num_nodes) == "GROUP_WORLD_SIZE=2");
}

TEST_CASE(
    "env://: an Azure ML PyTorch per-process job (NODE_RANK, MASTER_PORT=6105, no "
    "LOCAL_WORLD_SIZE)") {
  environment env{{"AZUREML_RUN_ID", "exp_1700000000_abcd"},
                  {"AZ_BATCH_MASTER_NODE", "10.0.0.4:6000"},  // its port: Azure Batch's own
                  {"MASTER_ADDR", "10.0.0.4"},
                  {"MASTER_PORT", "6105"},
                  {"WORLD_SIZE", "16"},
                  {"RANK", "9"},
                  {"LOCAL_RANK", "1"},
                  {"NODE_RANK", "1"},
                  {"NCCL_SOCKET_IFNAME", "eth0"}};
  auto w = discover(env);
  CHECK(w.source == launcher::env);
  CHECK(w.rank == 9);
  CHECK(w.world_size == 16);
  CHECK(w.local_rank == 1);
  CHECK(w.node_rank == 1);
  CHECK_FALSE(w.local_world_size.has_value());  // not stated: unknown, not guessed
  CHECK_FALSE(w.num_nodes.has_value());
  CHECK_FALSE(w.complete());
  CHECK(w.master_addr == "10.0.0.4");
  CHECK(w.master_port == 6105);
}

TEST_CASE("env://: a Kubeflow PyTorchJob pod (one process per pod, no local variables)") {
  environment env{{"KUBERNETES_SERVICE_HOST", "10.96.0.1"},
                  {"MASTER_ADDR", "mnist-master-0"},
                  {"MASTER_PORT", "23456"},
                  {"WORLD_SIZE", "3"},
                  {"RANK", "2"},
                  {"PYTHONUNBUFFERED", "0"}};
  auto w = discover(env);
  CHECK(w.rank == 2);
  CHECK(w.world_size == 3);
  CHECK_FALSE(w.local_rank.has_value());
  CHECK_FALSE(w.node_rank.has_value());
  CHECK(w.master_addr == "mnist-master-0");
  CHECK(w.master_port == 23456);
}

TEST_CASE("env://: all processes local means one node, whatever launcher said it") {
  auto w = discover(
      {{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "4"}});
  CHECK(w.node_rank == 0);
  CHECK(w.num_nodes == 1);
  CHECK(w.complete());
  CHECK_FALSE(w.master_addr.has_value());
  CHECK_FALSE(w.master_port.has_value());
}

TEST_CASE("env://: errors name every variable involved and its value") {
  CHECK(discover_error({{"RANK", "7"}, {"WORLD_SIZE", "4"}}) == "RANK=7 is not below WORLD_SIZE=4");
  CHECK(discover_error({{"RANK", "abc"}, {"WORLD_SIZE", "4"}}) ==
        "RANK=abc is not a non-negative integer");
  CHECK(discover_error({{"RANK", "-1"}, {"WORLD_SIZE", "4"}}) ==
        "RANK=-1 is negative: ranks, sizes and indices count from 0");
  CHECK(discover_error({{"RANK", "0"}, {"WORLD_SIZE", "0"}}) == "WORLD_SIZE=0 must be at least 1");
  CHECK(discover_error({{"RANK", "3"}}) ==
        "RANK=3 is set but WORLD_SIZE is not; the launcher sets both");
  CHECK(discover_error({{"WORLD_SIZE", "3"}}) ==
        "WORLD_SIZE=3 is set but RANK is not; the launcher sets both");
  CHECK(discover_error(
            {{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}}) ==
        "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2");
  CHECK(discover_error({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "8"}}) ==
        "LOCAL_WORLD_SIZE=8 is larger than WORLD_SIZE=4");
  CHECK(discover_error(
            {{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}}) ==
        "MASTER_PORT=70000 is outside the port range 1-65535");
  CHECK(discover_error({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"MASTER_PORT", "http"}}) ==
        "MASTER_PORT=http is not a non-negative integer");
  CHECK(discover_error({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", ""}}) ==
        "MASTER_ADDR is set but empty");
  CHECK(discover_error(
            {{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"GROUP_RANK", "1"}, {"NODE_RANK", "0"}}) ==
        "GROUP_RANK=1 and NODE_RANK=0 disagree about the node rank");
  CHECK(discover_error({{"RANK", "1"}, {"WORLD_SIZE", "10"}, {"GROUP_WORLD_SIZE", "4"}}) ==
        "WORLD_SIZE=10 is not divisible into GROUP_WORLD_SIZE=4 nodes with the same number of "
        "workers each");
  CHECK(discover_error({{"RANK", "1"},
                        {"WORLD_SIZE", "12"},
                        {"LOCAL_WORLD_SIZE", "4"},
                        {"GROUP_WORLD_SIZE", "2"}}) ==
        "WORLD_SIZE=12 is not LOCAL_WORLD_SIZE=4 workers per node times GROUP_WORLD_SIZE=2 nodes");
  CHECK(discover_error(
            {{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"NODE_RANK", "2"}, {"GROUP_WORLD_SIZE", "2"}}) ==
        "NODE_RANK=2 is not below GROUP_WORLD_SIZE=2");
  CHECK(discover_error(
            {{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "4"}, {"NODE_RANK", "1"}}) ==
        "NODE_RANK=1 and all WORLD_SIZE=4 processes are local: LOCAL_WORLD_SIZE=4 disagree about "
        "the node rank");
  CHECK(discover_error({{"RANK", "1"},
                        {"WORLD_SIZE", "4"},
                        {"LOCAL_WORLD_SIZE", "2"},
                        {"GROUP_WORLD_SIZE", "1"}}) ==
        "WORLD_SIZE=4 is not LOCAL_WORLD_SIZE=2 workers per node times GROUP_WORLD_SIZE=1 nodes");
  // torchrun numbers its workers node by node.
  CHECK(discover_error({{"RANK", "5"},
                        {"WORLD_SIZE", "8"},
                        {"LOCAL_RANK", "1"},
                        {"LOCAL_WORLD_SIZE", "4"},
                        {"GROUP_RANK", "0"},
                        {"GROUP_WORLD_SIZE", "2"}}) ==
        "RANK=5 is not GROUP_RANK=0 × LOCAL_WORLD_SIZE=4 + LOCAL_RANK=1 (torchrun numbers the "
        "ranks node by node)");
  // Without a local size or a node count (Azure ML's PyTorch jobs), still below the world size.
  CHECK(discover_error({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "8"}}) ==
        "LOCAL_RANK=8 is not below WORLD_SIZE=8");
  CHECK(discover_error({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"NODE_RANK", "9"}}) ==
        "NODE_RANK=9 is not below WORLD_SIZE=8");
  // MASTER_ADDR is a host: a port is MASTER_PORT's; an IPv6 address loses its brackets.
  CHECK(discover_error({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "10.0.0.4:6105"}}) ==
        "MASTER_ADDR=10.0.0.4:6105 is not a host name or an address (a port goes in MASTER_PORT)");
  CHECK(discover_error({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "[fd00::4]:6105"}}) ==
        "MASTER_ADDR=[fd00::4]:6105 is not a host name or an address (a port goes in "
        "MASTER_PORT)");
  CHECK(discover({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "[fd00::4]"}}).master_addr ==
        "fd00::4");
  CHECK(discover({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "fd00::4"}}).master_addr ==
        "fd00::4");
}

TEST_CASE(
    "Azure ML's Lightning recipe under MPI: WORLD_SIZE, LOCAL_RANK and NODE_RANK without RANK "
    "agree with OMPI_COMM_WORLD_*") {
  // The guide's set_environment_variables_for_mpi(): no RANK; MASTER_PORT its own.
  const environment recipe{{"OMPI_COMM_WORLD_RANK", "5"},
                           {"OMPI_COMM_WORLD_SIZE", "8"},
                           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                           {"AZ_BATCH_MASTER_NODE", "10.0.0.4:6000"},
                           {"MASTER_ADDR", "10.0.0.4"},
                           {"MASTER_PORT", "6105"},
                           {"MASTER_ADDRESS", "10.0.0.4"},
                           {"NODE_RANK", "1"},
                           {"LOCAL_RANK", "1"},
                           {"WORLD_SIZE", "8"}};
  const auto w = discover(recipe);
  CHECK(w.source == launcher::open_mpi);
  CHECK(w.rank == 5);
  CHECK(w.world_size == 8);
  CHECK(w.node_rank == 1);
  CHECK(w.master_addr == "10.0.0.4");
  CHECK(w.master_port == 6105);
  CHECK(discover_error(recipe.with("WORLD_SIZE", "16")) ==
        "OMPI_COMM_WORLD_SIZE=8 and WORLD_SIZE=16 disagree about the world size");
  // With no launcher, WORLD_SIZE alone is still an error.
  CHECK(discover_error({{"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}}) ==
        "WORLD_SIZE=8 is set but RANK is not; the launcher sets both");
}

TEST_CASE("Hugging Face: --local_rank on argv supplies or must agree with LOCAL_RANK") {
  environment launch_without_use_env{{"MASTER_ADDR", "127.0.0.1"},
                                     {"MASTER_PORT", "29500"},
                                     {"WORLD_SIZE", "2"},
                                     {"RANK", "1"},
                                     {"OMP_NUM_THREADS", "1"}};
  for (std::vector<std::string_view> args :
       {std::vector<std::string_view>{"--local_rank=1", "--model", "bert"},
        std::vector<std::string_view>{"--model", "bert", "--local_rank", "1"},
        std::vector<std::string_view>{"--local-rank=1"},
        std::vector<std::string_view>{"--local-rank", "1"}}) {
    CAPTURE(args[0]);
    auto w = discover(launch_without_use_env, args);
    CHECK(w.local_rank == 1);
    CHECK(w.origin(dtrain::world::field::local_rank).rfind("argv --local", 0) == 0);
  }
  auto agreeing = launch_without_use_env.with("LOCAL_RANK", "1");
  CHECK(discover(agreeing, {"--local_rank=1"}).local_rank == 1);
  CHECK(discover_error(launch_without_use_env.with("LOCAL_RANK", "0"), {"--local_rank=1"}) ==
        "LOCAL_RANK=0 and argv --local_rank=1 disagree about the local rank");
  CHECK(discover_error(launch_without_use_env, {"--local_rank=x"}) ==
        "argv --local_rank=x is not a non-negative integer");
  CHECK(discover_error(launch_without_use_env, {"--local_rank"}) ==
        "argv --local_rank has no value");
  CHECK(discover_error(launch_without_use_env, {"--local_rank=0", "--local-rank=1"}) ==
        "argv --local_rank=0 and argv --local-rank=1 disagree about the local rank");
  // After "--" the arguments belong to someone else; a look-alike flag is not ours.
  CHECK(discover(launch_without_use_env, {"--", "--local_rank=7"}).local_rank == std::nullopt);
  CHECK(discover(launch_without_use_env, {"--local_ranks=3"}).local_rank == std::nullopt);
}

TEST_CASE("no launcher variables: a single process") {
  auto w = discover({{"PATH", "/usr/bin"}, {"HOME", "/root"}, {"TERM", "xterm"}});
  CHECK(w.source == launcher::none);
  CHECK(w.rank == 0);
  CHECK(w.world_size == 1);
  CHECK(w.local_rank == 0);
  CHECK(w.local_world_size == 1);
  CHECK(w.node_rank == 0);
  CHECK(w.num_nodes == 1);
  CHECK_FALSE(w.master_addr.has_value());
  CHECK(discover(environment{}).world_size == 1);
  // Loose variables that agree with one process are fine; others are errors.
  CHECK(discover({{"LOCAL_RANK", "0"}, {"MASTER_ADDR", "localhost"}, {"MASTER_PORT", "1234"}})
            .master_port == 1234);
  CHECK(discover_error({{"LOCAL_RANK", "2"}}) ==
        "a single process: no launcher variables and LOCAL_RANK=2 disagree about the local rank");
}

TEST_CASE("Lightning-style per-node job: NODE_RANK without RANK") {
  environment lightning_node_1{
      {"MASTER_ADDR", "10.1.0.5"}, {"MASTER_PORT", "6105"}, {"NODE_RANK", "1"}};
  auto e = discover_error(lightning_node_1);
  CHECK_CONTAINS(e, "NODE_RANK=1 is set, but nothing gives this process's rank and world size");
  CHECK_CONTAINS(e, "launch::per_node");

  auto agent = discover_agent(lightning_node_1, {.nproc_per_node = 4, .nnodes = 2});
  CHECK(agent.role == dtrain::process_role::node_agent);
  CHECK(agent.source == launcher::env);
  CHECK(agent.node_rank == 1);
  CHECK(agent.num_nodes == 2);
  CHECK(agent.local_world_size == 4);
  CHECK(agent.world_size == 8);  // processes per node x nodes
  CHECK_FALSE(agent.rank.has_value());
  CHECK_FALSE(agent.local_rank.has_value());
  CHECK(agent.master_addr == "10.1.0.5");
  CHECK(agent.master_port == 6105);
  CHECK(agent.origin(dtrain::world::field::world_size) ==
        "option nproc_per_node=4 × option nnodes=2");
}
