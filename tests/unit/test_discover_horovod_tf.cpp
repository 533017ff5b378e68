#include "support.hpp"

using dtrain::environment;
using dtrain::launcher;
using dtrain::process_role;
using dtrain_test::discover;
using dtrain_test::discover_agent;
using dtrain_test::discover_error;

TEST_CASE("Horovod: horovodrun -np 8 -H a:4,b:4, rank 6") {
  environment env{{"HOROVOD_RANK", "6"},
                  {"HOROVOD_SIZE", "8"},
                  {"HOROVOD_LOCAL_RANK", "2"},
                  {"HOROVOD_LOCAL_SIZE", "4"},
                  {"HOROVOD_CROSS_RANK", "1"},
                  {"HOROVOD_CROSS_SIZE", "2"},
                  {"HOROVOD_HOSTNAME", "b"},
                  {"HOROVOD_GLOO_RENDEZVOUS_ADDR", "10.0.0.1"},
                  {"HOROVOD_GLOO_RENDEZVOUS_PORT", "44123"},
                  {"HOROVOD_CONTROLLER", "gloo"},
                  {"HOROVOD_CPU_OPERATIONS", "gloo"}};
  auto w = discover(env);
  CHECK(w.source == launcher::horovod);
  CHECK(w.rank == 6);
  CHECK(w.world_size == 8);
  CHECK(w.local_rank == 2);
  CHECK(w.local_world_size == 4);
  CHECK(w.node_rank == 1);
  CHECK(w.num_nodes == 2);
  // Horovod's own rendezvous server is the driver's, not a master for dtrain.
  CHECK_FALSE(w.master_addr.has_value());
  CHECK(discover_error(env.with("HOROVOD_LOCAL_RANK", "4")) ==
        "HOROVOD_LOCAL_RANK=4 is not below HOROVOD_LOCAL_SIZE=4");
}

TEST_CASE("Horovod: uneven nodes (-H a:2,b:1) give the node index only to local rank 0") {
  // Rank 1 is local rank 1 on a; only a has a local rank 1, so CROSS_RANK=0 of CROSS_SIZE=1.
  environment local1{{"HOROVOD_RANK", "1"},       {"HOROVOD_SIZE", "3"},
                     {"HOROVOD_LOCAL_RANK", "1"}, {"HOROVOD_LOCAL_SIZE", "2"},
                     {"HOROVOD_CROSS_RANK", "0"}, {"HOROVOD_CROSS_SIZE", "1"}};
  auto w = discover(local1);
  CHECK_FALSE(w.node_rank.has_value());
  CHECK_FALSE(w.num_nodes.has_value());
  CHECK_CONTAINS(w.notes, "HOROVOD_CROSS_RANK/CROSS_SIZE not used");
  environment on_b{{"HOROVOD_RANK", "2"},       {"HOROVOD_SIZE", "3"},
                   {"HOROVOD_LOCAL_RANK", "0"}, {"HOROVOD_LOCAL_SIZE", "1"},
                   {"HOROVOD_CROSS_RANK", "1"}, {"HOROVOD_CROSS_SIZE", "2"}};
  w = discover(on_b);
  CHECK(w.node_rank == 1);
  CHECK(w.num_nodes == 2);
}

namespace {
const char* const tf_cluster =
    R"({"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222", "host3:2222"],
                    "ps": ["host4:2222", "host5:2222"], "evaluator": ["host6:2222"]},
        "task": {"type": "%TYPE%", "index": %INDEX%}, "environment": "cloud"})";

environment tf_task(std::string type, int index) {
  std::string text = tf_cluster;
  text.replace(text.find("%TYPE%"), 6, type);
  text.replace(text.find("%INDEX%"), 7, std::to_string(index));
  return {{"TF_CONFIG", text}, {"PATH", "/usr/bin"}};
}
}  // namespace

TEST_CASE("TF_CONFIG: the chief then the workers are the data-parallel ranks") {
  auto chief = discover(tf_task("chief", 0));
  CHECK(chief.source == launcher::tf_config);
  CHECK(chief.role == process_role::worker);
  CHECK(chief.rank == 0);
  CHECK(chief.world_size == 4);
  CHECK(chief.master_addr == "host0");
  CHECK(chief.master_port == 2222);
  CHECK_FALSE(chief.local_rank.has_value());
  CHECK_FALSE(chief.node_rank.has_value());

  auto worker = discover(tf_task("worker", 2));
  CHECK(worker.rank == 3);
  CHECK(worker.world_size == 4);
  CHECK(worker.origin(dtrain::world::field::rank) == "TF_CONFIG task {type: worker, index: 2}");
  CHECK(worker.origin(dtrain::world::field::master_addr) == "TF_CONFIG chief[0]=host0:2222");
}

TEST_CASE("TF_CONFIG: ps and evaluator tasks get their role and no rank") {
  auto ps = discover(tf_task("ps", 1));
  CHECK(ps.role == process_role::parameter_server);
  CHECK_FALSE(ps.rank.has_value());
  CHECK(ps.world_size == 4);
  CHECK(dtrain::to_json(ps).find(R"("role":"ps")") != std::string::npos);
  auto eval = discover(tf_task("evaluator", 0));
  CHECK(eval.role == process_role::evaluator);
  CHECK_FALSE(eval.rank.has_value());
}

TEST_CASE("TF_CONFIG: workers only, TF1 'master', key order and whitespace do not matter") {
  environment workers{
      {"TF_CONFIG",
       R"({"task":{"index":1,"type":"worker"},"cluster":{"worker":["w0:20000","w1:20000"]}})"}};
  auto w = discover(workers);
  CHECK(w.rank == 1);
  CHECK(w.world_size == 2);
  CHECK(w.master_addr == "w0");
  CHECK(w.master_port == 20000);
  environment tf1{{"TF_CONFIG",
                   "{\n \"cluster\" : {\"master\" : [\"m:1\"], \"worker\" : [\"w:1\"]},\n \"task\" "
                   ": {\"type\" : \"master\", \"index\" : 0}\n}"}};
  CHECK(discover(tf1).rank == 0);
  CHECK(discover(tf1).world_size == 2);
  // MASTER_ADDR / MASTER_PORT name the master outright and win over the cluster list.
  auto over = discover(workers.with("MASTER_ADDR", "10.0.0.7").with("MASTER_PORT", "3000"));
  CHECK(over.master_addr == "10.0.0.7");
  CHECK(over.master_port == 3000);
}

TEST_CASE("TF_CONFIG: bad documents are errors that say what is wrong") {
  auto err = [](std::string text) { return discover_error({{"TF_CONFIG", text}}); };
  CHECK_CONTAINS(
      err(R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1}})"),
      "TF_CONFIG task {type: worker, index: 1} is not below the 1 entries of cluster.\"worker\"");
  CHECK_CONTAINS(err(R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "driver", "index": 0}})"),
                 "has an unknown type");
  CHECK_CONTAINS(err(R"({"cluster": {"worker": ["a:1"]}})"), "TF_CONFIG has no \"task\" object");
  CHECK_CONTAINS(err(R"({"task": {"type": "worker", "index": 0}})"),
                 "TF_CONFIG has no \"cluster\" object");
  CHECK_CONTAINS(err(R"({"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 0}})"),
                 "no \"chief\" and no \"worker\"");
  CHECK_CONTAINS(err(R"({"cluster": {"worker": "a:1"}, "task": {"type": "worker", "index": 0}})"),
                 "cluster.\"worker\" is a string, expected an array");
  CHECK_CONTAINS(
      err(R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "0"}})"),
      "task.\"index\" is a string, expected a number");
  CHECK_CONTAINS(
      err(R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}})"),
      "TF_CONFIG task.index=-1 is negative");
  CHECK_CONTAINS(err(R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}})"),
                 "has no \"index\"");
  CHECK_CONTAINS(
      err(R"({"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief", "index": 0}})"),
      "2 chiefs");
  CHECK_CONTAINS(
      err(R"({"cluster": {"worker": ["a:99999"]}, "task": {"type": "worker", "index": 0}})"),
      "outside the port range");
  CHECK_CONTAINS(err(R"({"cluster": {"worker": [1]}, "task": {"type": "worker", "index": 0}})"),
                 "must list \"host:port\" strings");
  CHECK_CONTAINS(err(R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0})"),
                 "TF_CONFIG is not valid JSON: expected ',' or '}' at offset 71");
  CHECK_CONTAINS(err("[]"), "TF_CONFIG is not a JSON object");
}

TEST_CASE("TF_CONFIG with RANK: the same job must agree") {
  auto env = tf_task("worker", 0).with("RANK", "1").with("WORLD_SIZE", "4");
  CHECK(discover(env).rank == 1);
  CHECK(discover_error(env.with("RANK", "2")) ==
        "RANK=2 and TF_CONFIG task {type: worker, index: 0} disagree about the rank");
}
