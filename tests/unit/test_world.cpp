#include "support.hpp"

#include <cstdlib>

using dtrain::environment;
using dtrain_test::discover;

TEST_CASE(
    "to_json: one line, fixed key order, null for unknown fields, role only when not a worker") {
  auto w = discover({{"OMPI_COMM_WORLD_RANK", "1"},
                     {"OMPI_COMM_WORLD_SIZE", "4"},
                     {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                     {"AZ_BATCH_MASTER_NODE", "10.0.0.4:6000"},
                     {"MASTER_PORT", "6105"}});
  CHECK(
      dtrain::to_json(w) ==
      R"({"rank":1,"world_size":4,"local_rank":1,"local_world_size":2,"node_rank":null,"num_nodes":null,)"
      R"("master_addr":"10.0.0.4","master_port":6105,"source":"open_mpi"})");
  auto agent = dtrain_test::discover_agent({}, {.nproc_per_node = 2});
  CHECK(
      dtrain::to_json(agent) ==
      R"({"rank":null,"world_size":2,"local_rank":null,"local_world_size":2,"node_rank":0,"num_nodes":1,)"
      R"("master_addr":null,"master_port":null,"source":"none","role":"agent"})");
}

TEST_CASE("to_json: strings are escaped") {
  dtrain::world w;
  w.master_addr = "we\"ird\\host\n\x01";
  // detail::json::write_string, the one JSON string writer: short escapes where JSON has them.
  CHECK_CONTAINS(dtrain::to_json(w), R"("master_addr":"we\"ird\\host\n\u0001")");
  auto parsed = dtrain::detail::json::parse(dtrain::to_json(w), "to_json");
  CHECK(parsed.find("master_addr")->text == "we\"ird\\host\n\x01");
}

TEST_CASE("describe: each field with the variable it came from, unknown ones marked") {
  auto w = discover({{"RANK", "5"},
                     {"WORLD_SIZE", "8"},
                     {"LOCAL_RANK", "1"},
                     {"MASTER_ADDR", "10.0.0.4"},
                     {"MASTER_PORT", "29500"}});
  auto text = w.describe();
  CHECK_CONTAINS(text, "dtrain world from env:");
  CHECK_CONTAINS(text, "rank=5 (RANK=5)");
  CHECK_CONTAINS(text, "world_size=8 (WORLD_SIZE=8)");
  CHECK_CONTAINS(text, "local_world_size=?, node_rank=?, num_nodes=? (unknown)");
  CHECK_CONTAINS(text, "master_addr=10.0.0.4 (MASTER_ADDR=10.0.0.4)");
  CHECK(text.find('\n') == std::string::npos);
  CHECK_CONTAINS(discover({}).describe(), "num_nodes=1 (a single process: no launcher variables)");
}

TEST_CASE("environment: from_process sees setenv, empty values are kept, with/without copy") {
  ::setenv("DTRAIN_TEST_VAR", "", 1);
  auto env = environment::from_process();
  REQUIRE(env.get("DTRAIN_TEST_VAR").has_value());
  CHECK(env.get("DTRAIN_TEST_VAR")->empty());
  ::unsetenv("DTRAIN_TEST_VAR");
  CHECK_FALSE(environment::from_process().contains("DTRAIN_TEST_VAR"));
  environment base{{"A", "1"}};
  auto more = base.with("B", "2").with("A", "3");
  CHECK(base.get("A") == "1");
  CHECK_FALSE(base.contains("B"));
  CHECK(more.get("A") == "3");
  CHECK_FALSE(more.without("A").contains("A"));
}

namespace {
// The process running the tests may itself be under a launcher (ctest under
// mpirun or srun): drop every variable discovery reads before setting our own.
void clear_launcher_variables() {
  static constexpr std::string_view prefixes[] = {
      "RANK",   "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
      "GROUP_", "MASTER_",    "TF_CONFIG",  "AZ_BATCH",         "OMPI_COMM_WORLD",
      "PMI_",   "MPI_LOCAL",  "SLURM_",     "HOROVOD_"};
  std::vector<std::string> names;
  const auto env = environment::from_process();
  for (const auto& [name, value] : env.vars()) {
    for (auto prefix : prefixes) {
      if (name.rfind(prefix, 0) == 0) names.push_back(name);
    }
  }
  for (const auto& name : names) ::unsetenv(name.c_str());
}
}  // namespace

TEST_CASE("discover_world(argc, argv) reads the process environment and skips the program name") {
  clear_launcher_variables();
  ::setenv("RANK", "2", 1);
  ::setenv("WORLD_SIZE", "3", 1);
  const char* argv[] = {"--local_rank=9", "--local_rank=0"};  // argv[0] is the program name
  auto w = dtrain::discover_world(2, argv);
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  CHECK(w.rank == 2);
  CHECK(w.world_size == 3);
  CHECK(w.local_rank == 0);
}
