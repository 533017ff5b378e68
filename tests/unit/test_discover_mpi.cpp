// Open MPI (mpirun, Azure ML MPI jobs) and MPICH / Intel MPI (Hydra).
#include "support.hpp"

using dtrain::environment;
using dtrain::launcher;
using dtrain_test::discover;
using dtrain_test::discover_agent;
using dtrain_test::discover_error;

namespace {
// What mpirun -np 8 --map-by node on two hosts gives rank 5: ranks alternate
// between the hosts, so rank 5 is the third process of the second host.
environment open_mpi_rank_5_of_8_by_node() {
  return {{"PATH", "/usr/bin"},
          {"OMPI_COMMAND", "train"},
          {"OMPI_ARGV", ""},
          {"OMPI_COMM_WORLD_RANK", "5"},
          {"OMPI_COMM_WORLD_SIZE", "8"},
          {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
          {"OMPI_COMM_WORLD_NODE_RANK", "2"},
          {"OMPI_UNIVERSE_SIZE", "8"},
          {"OMPI_FILE_LOCATION", "/tmp/ompi.node1.0/pid.4242/1/5"},
          {"PMIX_RANK", "5"},
          {"PMIX_NAMESPACE", "1628962817"},
          {"PMIX_HOSTNAME", "node1"}};
}
}  // namespace

TEST_CASE("Open MPI: rank and local fields, the node index is unknown, never guessed") {
  auto w = discover(open_mpi_rank_5_of_8_by_node());
  CHECK(w.source == launcher::open_mpi);
  CHECK(w.rank == 5);
  CHECK(w.world_size == 8);
  CHECK(w.local_rank == 2);
  CHECK(w.local_world_size == 4);
  // rank / local size = 1 would be right for --map-by slot and is wrong here;
  // OMPI_COMM_WORLD_NODE_RANK=2 is the rank among this node's processes.
  CHECK_FALSE(w.node_rank.has_value());
  CHECK_FALSE(w.num_nodes.has_value());
  CHECK_FALSE(w.master_addr.has_value());
  CHECK(w.origin(dtrain::world::field::node_rank).empty());
  CHECK_CONTAINS(w.describe(), "node_rank=?");
}

TEST_CASE("Open MPI: single-node mpirun -np 4 is one node") {
  environment env{{"OMPI_COMM_WORLD_RANK", "2"},
                  {"OMPI_COMM_WORLD_SIZE", "4"},
                  {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                  {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                  {"OMPI_COMM_WORLD_NODE_RANK", "2"}};
  auto w = discover(env);
  CHECK(w.node_rank == 0);
  CHECK(w.num_nodes == 1);
  CHECK(w.complete());
}

TEST_CASE(
    "Open MPI 4: OMPI_MCA_orte_num_nodes gives the node count, and the node index stays unknown") {
  environment env = open_mpi_rank_5_of_8_by_node();
  env = env.with("OMPI_MCA_orte_num_nodes", "2");
  auto w = discover(env);
  CHECK(w.num_nodes == 2);
  CHECK(w.origin(dtrain::world::field::num_nodes) == "OMPI_MCA_orte_num_nodes=2");
  CHECK_FALSE(w.node_rank.has_value());  // completed at rendezvous by host name
  CHECK(w.local_rank == 2);

  env = env.with("OMPI_MCA_orte_num_nodes", "9");
  CHECK(discover_error(env) == "OMPI_MCA_orte_num_nodes=9 is larger than OMPI_COMM_WORLD_SIZE=8");
  env = env.with("OMPI_MCA_orte_num_nodes", "0");
  CHECK(discover_error(env) == "OMPI_MCA_orte_num_nodes=0 must be at least 1");
}

TEST_CASE("as many nodes as processes: one process per node, and the node rank is the rank") {
  // mpirun --map-by node -np 3 on a 3-node hostfile, rank 2 (Open MPI 4).
  environment env{{"OMPI_COMM_WORLD_RANK", "2"},
                  {"OMPI_COMM_WORLD_SIZE", "3"},
                  {"OMPI_MCA_orte_num_nodes", "3"}};
  auto w = discover(env);
  CHECK(w.node_rank == 2);
  CHECK(w.num_nodes == 3);
  CHECK(w.local_rank == 0);
  CHECK(w.local_world_size == 1);
  CHECK(w.complete());
  CHECK_CONTAINS(w.origin(dtrain::world::field::node_rank), "one process per node");

  // A local size that contradicts it is refused, naming both.
  env = env.with("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
  env = env.with("OMPI_COMM_WORLD_LOCAL_RANK", "1");
  CHECK_CONTAINS(discover_error(env), "disagree");
}

TEST_CASE(
    "Azure ML MPI job: the master's address from AZ_BATCH_MASTER_NODE (not its port, Azure "
    "Batch's own), or AZ_BATCHAI_MPI_MASTER_NODE on one node, and MASTER_ADDR and MASTER_PORT "
    "win") {
  // Azure Batch's example value: its port is the Batch service's, which no job may use.
  auto multi = open_mpi_rank_5_of_8_by_node().with("AZ_BATCH_MASTER_NODE", "10.0.0.4:6000");
  auto w = discover(multi);
  CHECK(w.master_addr == "10.0.0.4");
  CHECK_FALSE(w.master_port.has_value());  // the job's default, not 6000
  CHECK(w.origin(dtrain::world::field::master_addr) == "AZ_BATCH_MASTER_NODE=10.0.0.4:6000");
  CHECK(discover(open_mpi_rank_5_of_8_by_node().with("AZ_BATCH_MASTER_NODE", "10.0.0.4"))
            .master_addr == "10.0.0.4");

  // DeepSpeed's and Azure ML's recipes: MASTER_ADDR from it, MASTER_PORT of their own (6105).
  auto recipe = multi.with("MASTER_ADDR", "10.0.0.4").with("MASTER_PORT", "6105");
  w = discover(recipe);
  CHECK(w.master_addr == "10.0.0.4");
  CHECK(w.master_port == 6105);
  CHECK(w.origin(dtrain::world::field::master_port) == "MASTER_PORT=6105");
  CHECK(w.notes.find("AZ_BATCH") == std::string::npos);

  // An inner launcher's MASTER_ADDR (torchrun's host name) names the master, with a note.
  w = discover(multi.with("MASTER_ADDR", "node-0").with("MASTER_PORT", "29400"));
  CHECK(w.master_addr == "node-0");
  CHECK(w.master_port == 29400);
  CHECK_CONTAINS(w.notes,
                 "MASTER_ADDR=node-0 names the master, not AZ_BATCH_MASTER_NODE=10.0.0.4:6000");

  auto single = open_mpi_rank_5_of_8_by_node().with("AZ_BATCHAI_MPI_MASTER_NODE", "10.0.0.4");
  w = discover(single);
  CHECK(w.master_addr == "10.0.0.4");
  CHECK_FALSE(w.master_port.has_value());
  CHECK(discover(single.with("MASTER_PORT", "54965")).master_port == 54965);
  // Both Azure variables: the multi-node one.
  CHECK(discover(multi.with("AZ_BATCHAI_MPI_MASTER_NODE", "node-0")).master_addr == "10.0.0.4");

  CHECK(discover_error(open_mpi_rank_5_of_8_by_node().with("AZ_BATCH_MASTER_NODE", ":6000")) ==
        "AZ_BATCH_MASTER_NODE=:6000 has an empty host");
  CHECK_CONTAINS(
      discover_error(open_mpi_rank_5_of_8_by_node().with("AZ_BATCH_MASTER_NODE", "10.0.0.4:x")),
      "AZ_BATCH_MASTER_NODE=10.0.0.4:x");
}

TEST_CASE(
    "Open MPI: a script that copied OMPI_* into RANK / WORLD_SIZE agrees, a stale copy is caught") {
  auto copied = open_mpi_rank_5_of_8_by_node()
                    .with("RANK", "5")
                    .with("WORLD_SIZE", "8")
                    .with("LOCAL_RANK", "2");
  auto w = discover(copied);
  CHECK(w.source == launcher::env);
  CHECK(w.rank == 5);
  CHECK(w.local_world_size == 4);  // filled in from OMPI_COMM_WORLD_LOCAL_SIZE
  CHECK(discover_error(open_mpi_rank_5_of_8_by_node().with("RANK", "1").with("WORLD_SIZE", "8")) ==
        "RANK=1 and OMPI_COMM_WORLD_RANK=5 disagree about the rank");
  CHECK(discover_error(open_mpi_rank_5_of_8_by_node().with("LOCAL_RANK", "0")) ==
        "OMPI_COMM_WORLD_LOCAL_RANK=2 and LOCAL_RANK=0 disagree about the local rank");
  auto e =
      discover_error(open_mpi_rank_5_of_8_by_node().with("RANK", "5").with("WORLD_SIZE", "16"));
  CHECK_CONTAINS(
      e, "WORLD_SIZE=16 (env) and OMPI_COMM_WORLD_SIZE=8 (open_mpi) disagree about the world size");
}

TEST_CASE("Open MPI: malformed values and half-set pairs") {
  CHECK(discover_error({{"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "4"}}) ==
        "OMPI_COMM_WORLD_RANK=4 is not below OMPI_COMM_WORLD_SIZE=4");
  CHECK(discover_error({{"OMPI_COMM_WORLD_RANK", "1"}}) ==
        "OMPI_COMM_WORLD_RANK=1 is set but OMPI_COMM_WORLD_SIZE is not; the launcher sets both");
  CHECK(discover_error({{"OMPI_COMM_WORLD_RANK", "1"},
                        {"OMPI_COMM_WORLD_SIZE", "2"},
                        {"OMPI_COMM_WORLD_LOCAL_SIZE", "two"}}) ==
        "OMPI_COMM_WORLD_LOCAL_SIZE=two is not a non-negative integer");
}

TEST_CASE("Open MPI per-node launch: one agent per node, OMPI_COMM_WORLD_RANK is the node rank") {
  environment agent_env{
      {"OMPI_COMM_WORLD_RANK", "2"},       {"OMPI_COMM_WORLD_SIZE", "3"},
      {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"},
      {"OMPI_COMM_WORLD_NODE_RANK", "0"},  {"AZ_BATCH_MASTER_NODE", "10.0.0.4:6000"}};
  auto w = discover_agent(agent_env, {.nproc_per_node = 8});
  CHECK(w.role == dtrain::process_role::node_agent);
  CHECK(w.source == launcher::open_mpi);
  CHECK(w.node_rank == 2);
  CHECK(w.num_nodes == 3);
  CHECK(w.local_world_size == 8);
  CHECK(w.world_size == 24);
  CHECK_FALSE(w.rank.has_value());
  CHECK(w.master_addr == "10.0.0.4");
  CHECK_FALSE(w.master_port.has_value());  // the agent's default, not Azure Batch's port
  CHECK(w.origin(dtrain::world::field::node_rank) == "OMPI_COMM_WORLD_RANK=2");

  CHECK(discover_agent(agent_env.with("NODE_RANK", "2"), {}).node_rank == 2);
  CHECK(dtrain_test::config_error_text([&] {
          (void)discover_agent(agent_env.with("NODE_RANK", "1"), {});
        }) == "OMPI_COMM_WORLD_RANK=2 and NODE_RANK=1 disagree about the node rank");
  CHECK(dtrain_test::config_error_text([&] { (void)discover_agent(agent_env, {.nnodes = 4}); }) ==
        "OMPI_COMM_WORLD_SIZE=3 and option nnodes=4 disagree about the number of nodes");
  auto four_per_node = agent_env.with("OMPI_COMM_WORLD_LOCAL_SIZE", "4");
  CHECK(dtrain_test::config_error_text([&] { (void)discover_agent(four_per_node, {}); }) ==
        "per-node launch runs one agent per node, but OMPI_COMM_WORLD_LOCAL_SIZE=4");
}

TEST_CASE("Hydra (MPICH / Intel MPI): PMI_* and MPI_LOCAL*, node fields unknown") {
  environment env{{"PMI_RANK", "6"},        {"PMI_SIZE", "8"},
                  {"PMI_FD", "7"},          {"MPI_LOCALRANKID", "2"},
                  {"MPI_LOCALNRANKS", "4"}, {"I_MPI_ROOT", "/opt/intel/mpi"},
                  {"HYDRA_CONTROL_FD", "9"}};
  auto w = discover(env);
  CHECK(w.source == launcher::hydra);
  CHECK(w.rank == 6);
  CHECK(w.world_size == 8);
  CHECK(w.local_rank == 2);
  CHECK(w.local_world_size == 4);
  CHECK_FALSE(w.node_rank.has_value());
  CHECK_FALSE(w.num_nodes.has_value());
  CHECK(discover_error(env.with("MPI_LOCALRANKID", "4")) ==
        "MPI_LOCALRANKID=4 is not below MPI_LOCALNRANKS=4");
  CHECK(discover_error(env.with("OMPI_COMM_WORLD_RANK", "5").with("OMPI_COMM_WORLD_SIZE", "8")) ==
        "OMPI_COMM_WORLD_RANK=5 and PMI_RANK=6 disagree about the rank");
}
