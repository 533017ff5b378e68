// dtrun as torchrun's drop-in (issue 45): torchrun's PET_* variables (Kubeflow
// Trainer's) read as dtrun's own, `--nproc-per-node gpu|cpu|auto`, the c10d
// rendezvous flags mapped onto the store, the other backends refused, and `-m`.
// The processes are tested in tests/launch/cases.sh (pet_variables, torchrun_flags).

#include "support.hpp"

#include <string>
#include <string_view>
#include <vector>

using dtrain::agent_options;
using dtrain::environment;
using dtrain::detail::agent_flags;
using dtrain::detail::parse_nproc_per_node;
using dtrain_test::config_error_text;

namespace {

using torchrun_args = std::vector<std::string_view>;

dtrain::local_devices four_gpus() { return {.gpus = 4, .cpus = 16}; }
dtrain::local_devices no_gpu() { return {.gpus = 0, .cpus = 6}; }

}  // namespace

TEST_CASE("PET_* variables: Kubeflow Trainer's environment sets the agent's options") {
  const auto o = agent_options{}.with_env({{"PET_NNODES", "2"},
                                           {"PET_NPROC_PER_NODE", "3"},
                                           {"PET_NODE_RANK", "1"},
                                           {"PET_MASTER_ADDR", "job-node-0-0.job"},
                                           {"PET_MASTER_PORT", "29400"},
                                           {"PET_RDZV_ID", "job"}});
  CHECK(o.nnodes == 2);
  CHECK_FALSE(o.min_nnodes);
  CHECK(o.nproc_per_node == 3);
  CHECK(o.node_rank == 1);
  CHECK(o.master_addr == "job-node-0-0.job");
  CHECK(o.master_port == 29400);
  CHECK(o.rdzv_id == "job");
  // MIN:MAX (a PyTorchJob's elastic policy), and a c10d endpoint without a port: 29400.
  const auto elastic = agent_options{}.with_env(
      {{"PET_NNODES", "1:3"}, {"PET_RDZV_BACKEND", "c10d"}, {"PET_RDZV_ENDPOINT", "job-master-0"}});
  CHECK(elastic.nnodes == 3);
  CHECK(elastic.min_nnodes == 1);
  CHECK(elastic.master_addr == "job-master-0");
  CHECK(elastic.master_port == dtrain::default_rdzv_port);
  // Sources that agree are fine, whatever their number.
  const auto same = agent_options{}.with_env({{"PET_NNODES", "2"},
                                              {"DTRAIN_NNODES", "2"},
                                              {"PET_NODE_RANK", "1"},
                                              {"NODE_RANK", "1"},
                                              {"PET_MASTER_ADDR", "h"},
                                              {"MASTER_ADDR", "h"},
                                              {"PET_RDZV_ENDPOINT", "h:6105"},
                                              {"MASTER_PORT", "6105"}});
  CHECK(same.nnodes == 2);
  CHECK(same.node_rank == 1);
  CHECK(same.master_addr == "h");
  CHECK(same.master_port == 6105);
  // Without PET_* nothing changes: MASTER_ADDR and NODE_RANK stay discovery's.
  const auto plain = agent_options{}.with_env({{"MASTER_ADDR", "h"}, {"NODE_RANK", "1"}});
  CHECK_FALSE(plain.master_addr);
  CHECK_FALSE(plain.node_rank);
}

TEST_CASE("PET_* variables: dtrun's flags win over them, and the agent sees the result") {
  agent_options o = agent_options{}.with_env({{"PET_NPROC_PER_NODE", "3"},
                                              {"PET_NNODES", "2"},
                                              {"PET_NODE_RANK", "1"},
                                              {"PET_MASTER_ADDR", "a"},
                                              {"PET_MASTER_PORT", "29400"}});
  agent_flags::of_launcher(torchrun_args{"--nproc-per-node", "2", "--node-rank", "0",
                                         "--master-addr", "b", "--master-port=29501", "t"})
      .apply(o);
  CHECK(o.nproc_per_node == 2);
  CHECK(o.nnodes == 2);
  CHECK(o.node_rank == 0);
  CHECK(o.master_addr == "b");
  CHECK(o.master_port == 29501);
  // The node agent takes them: node 1 of 2 from PET_* alone, node 0 with the flag.
  const environment trainer{{"PET_NNODES", "2"},
                            {"PET_NPROC_PER_NODE", "2"},
                            {"PET_NODE_RANK", "1"},
                            {"PET_MASTER_ADDR", "10.0.0.1"},
                            {"PET_MASTER_PORT", "29400"}};
  const dtrain::node_agent one({"true"}, agent_options{}.with_env(trainer), trainer);
  CHECK(one.node().node_rank == 1);
  CHECK(one.node().num_nodes == 2);
  CHECK(one.node().world_size == 4);
  agent_options flagged = agent_options{}.with_env(trainer);
  agent_flags::of_launcher(torchrun_args{"--node-rank", "0", "t"}).apply(flagged);
  const dtrain::node_agent zero({"true"}, flagged, trainer);
  CHECK(zero.node().node_rank == 0);
}

TEST_CASE("PET_* variables: two sources that disagree are an error naming both") {
  auto with = [](environment env) { (void)agent_options{}.with_env(env); };
  CHECK(config_error_text([&] {
          with({{"PET_NNODES", "2"}, {"DTRAIN_NNODES", "3"}});
        }) == "DTRAIN_NNODES=3 and PET_NNODES=2 disagree about the number of nodes");
  CHECK(config_error_text([&] {
          with({{"PET_NNODES", "2"}, {"DTRAIN_NNODES", "1:2"}});
        }) == "DTRAIN_NNODES=1:2 and PET_NNODES=2 disagree about the number of nodes");
  CHECK(config_error_text([&] {
          with({{"PET_NPROC_PER_NODE", "3"}, {"DTRAIN_NPROC_PER_NODE", "2"}});
        }) ==
        "DTRAIN_NPROC_PER_NODE=2 and PET_NPROC_PER_NODE=3 disagree about the workers per node");
  CHECK(config_error_text([&] {
          with({{"PET_NODE_RANK", "1"}, {"NODE_RANK", "0"}});
        }) == "PET_NODE_RANK=1 and NODE_RANK=0 disagree about the node rank");
  CHECK(config_error_text([&] {
          with({{"PET_NODE_RANK", "1"}, {"DTRAIN_NODE_RANK", "2"}});
        }) == "DTRAIN_NODE_RANK=2 and PET_NODE_RANK=1 disagree about the node rank");
  CHECK(config_error_text([&] {
          with({{"PET_MASTER_ADDR", "a"}, {"MASTER_ADDR", "b"}});
        }) == "PET_MASTER_ADDR=a and MASTER_ADDR=b disagree about node 0's address");
  CHECK(config_error_text([&] {
          with({{"PET_MASTER_PORT", "29400"}, {"MASTER_PORT", "6105"}});
        }) == "PET_MASTER_PORT=29400 and MASTER_PORT=6105 disagree about node 0's port");
  // Azure's AZ_BATCH_MASTER_NODE is the outer job's (its port Azure Batch's own): not compared.
  const agent_options azure = agent_options{}.with_env({{"PET_MASTER_ADDR", "node-0"},
                                                        {"PET_MASTER_PORT", "29400"},
                                                        {"AZ_BATCH_MASTER_NODE", "10.0.0.4:6000"}});
  CHECK(azure.master_addr == "node-0");
  CHECK(azure.master_port == 29400);
  CHECK(config_error_text([&] {
          with({{"PET_MASTER_ADDR", "a"}, {"PET_RDZV_ENDPOINT", "b:29400"}});
        }) == "PET_MASTER_ADDR=a and PET_RDZV_ENDPOINT=b:29400 disagree about node 0's address");
  CHECK(config_error_text([&] {
          with({{"PET_RDZV_ENDPOINT", "a"}, {"MASTER_PORT", "29500"}});
        }) ==
        "PET_RDZV_ENDPOINT=a (c10d's default port 29400) and MASTER_PORT=29500 disagree about "
        "node 0's port");
}

TEST_CASE("PET_* variables: a bad value is an error naming the variable") {
  auto with = [](environment env) { (void)agent_options{}.with_env(env); };
  CHECK(config_error_text([&] {
          with({{"PET_NPROC_PER_NODE", "abc"}});
        }) == "PET_NPROC_PER_NODE=abc is not a number of workers, gpu, cpu or auto");
  CHECK(config_error_text([&] {
          with({{"PET_NPROC_PER_NODE", "0"}});
        }) == "PET_NPROC_PER_NODE=0 must be at least 1 (workers per node)");
  CHECK(config_error_text([&] {
          with({{"PET_MASTER_PORT", "70000"}});
        }) == "PET_MASTER_PORT=70000 is outside the port range 1-65535");
  CHECK(config_error_text([&] {
          with({{"PET_NODE_RANK", "-1"}});
        }) == "PET_NODE_RANK=-1 is negative: ranks, sizes and indices count from 0");
  CHECK(config_error_text([&] {
          with({{"PET_NNODES", "0"}});
        }) == "PET_NNODES=0 must be at least 1 (nodes)");
  CHECK(config_error_text([&] {
          with({{"PET_MASTER_ADDR", ""}});
        }) == "PET_MASTER_ADDR is set but empty");
  CHECK(config_error_text([&] {
          with({{"PET_RDZV_ENDPOINT", "h:x"}});
        }).find("PET_RDZV_ENDPOINT=h:x (port 'x') is not a non-negative integer") == 0);
  CHECK_CONTAINS(
      config_error_text([&] {
        with({{"PET_RDZV_BACKEND", "etcd-v2"}});
      }),
      "PET_RDZV_BACKEND=etcd-v2: dtrun has no etcd rendezvous; its agents meet at a "
      "store that node 0's agent serves (torchrun's c10d): give --rdzv-backend c10d "
      "--rdzv-endpoint HOST:PORT, or --master-addr HOST --master-port PORT --node-rank N");
}

TEST_CASE("--nproc-per-node gpu|cpu|auto: torchrun's meanings, counted once") {
  CHECK(parse_nproc_per_node("x", "gpu", &four_gpus).value == 4);
  CHECK(parse_nproc_per_node("x", "gpu", &four_gpus).origin == "x (4 GPUs)");
  CHECK(parse_nproc_per_node("x", "cpu", &four_gpus).value == 16);
  CHECK(parse_nproc_per_node("x", "auto", &four_gpus).value == 4);
  CHECK(parse_nproc_per_node("x", "auto", &no_gpu).value == 6);
  CHECK(parse_nproc_per_node("x", "auto", &no_gpu).origin == "x (6 CPU cores)");
  CHECK(parse_nproc_per_node("x", "7", &no_gpu).value == 7);
  CHECK(config_error_text([] {
          (void)parse_nproc_per_node("--nproc-per-node=gpu on the command line", "gpu", &no_gpu);
        }) ==
        "--nproc-per-node=gpu on the command line: this process sees no CUDA device (no "
        "driver, or CUDA_VISIBLE_DEVICES hides them); give a number of workers, or cpu");
  CHECK(config_error_text([] { (void)parse_nproc_per_node("N=GPU", "GPU", &four_gpus); }) ==
        "N=GPU is not a number of workers, gpu, cpu or auto");
  // This process's count: what the flags and the variables use.
  const dtrain::local_devices here = dtrain::count_local_devices();
  CHECK(here.cpus >= 1);
  CHECK(here.gpus >= 0);
  CHECK(agent_flags::of_launcher(torchrun_args{"--nproc-per-node", "cpu", "t"})
            .values()
            .nproc_per_node == here.cpus);
  CHECK(agent_options{}.with_env({{"DTRAIN_NPROC_PER_NODE", "cpu"}}).nproc_per_node == here.cpus);
  CHECK(agent_options{}.with_env({{"PET_NPROC_PER_NODE", "auto"}}).nproc_per_node ==
        (here.gpus > 0 ? here.gpus : here.cpus));
  if (here.gpus == 0) {
    CHECK(config_error_text([] {
            (void)agent_flags::of_program(torchrun_args{"--epochs", "2", "--nproc_per_node=gpu"});
          }).find("--nproc_per_node=gpu on the command line: this process sees no CUDA device") ==
          0);
  } else {
    CHECK(agent_flags::of_launcher(torchrun_args{"--nproc-per-node=gpu", "t"})
              .values()
              .nproc_per_node == here.gpus);
  }
  // A keyword and a number that differ: both named, with what the keyword counted.
  const std::string more = std::to_string(here.cpus + 1);
  CHECK(config_error_text([&] {
          (void)agent_options{}.with_env(
              {{"DTRAIN_NPROC_PER_NODE", more}, {"PET_NPROC_PER_NODE", "cpu"}});
        }) == "DTRAIN_NPROC_PER_NODE=" + more + " and PET_NPROC_PER_NODE=cpu (" +
                  std::to_string(here.cpus) + " CPU cores) disagree about the workers per node");
}

TEST_CASE("--rdzv-endpoint: node 0's store, as torchrun's c10d rendezvous") {
  auto flags = agent_flags::of_launcher(torchrun_args{"--rdzv-backend", "c10d", "--rdzv-endpoint",
                                                      "node0:29401", "--rdzv_id=job7", "t"});
  CHECK(flags.values().master_addr == "node0");
  CHECK(flags.values().master_port == 29401);
  CHECK(flags.values().rdzv_id == "job7");
  agent_options o;
  flags.apply(o);
  CHECK(o.master_addr == "node0");
  CHECK(o.rdzv_id == "job7");
  // No port: c10d's 29400. IPv6 in brackets. The same values as --master-* agree.
  CHECK(
      agent_flags::of_launcher(torchrun_args{"--rdzv-endpoint=node0", "t"}).values().master_port ==
      29400);
  flags = agent_flags::of_launcher(torchrun_args{"--rdzv-endpoint", "[fd00::1]:5", "t"});
  CHECK(flags.values().master_addr == "fd00::1");
  CHECK(flags.values().master_port == 5);
  flags = agent_flags::of_launcher(
      torchrun_args{"--master-addr", "n", "--master-port", "29400", "--rdzv-endpoint", "n", "t"});
  CHECK(flags.values().master_addr == "n");
  // Read by a self-launching program too.
  CHECK(agent_flags::of_program(torchrun_args{"--lr", "1", "--rdzv-endpoint", "h:9"})
            .values()
            .master_port == 9);
}

TEST_CASE("--rdzv-*: a conflict with --master-* names both flags, other backends are refused") {
  CHECK(config_error_text([] {
          (void)agent_flags::of_launcher(
              torchrun_args{"--rdzv-endpoint", "a:5", "--master-addr", "b", "t"});
        }) ==
        "--rdzv-endpoint=a:5 on the command line and --master-addr=b on the command line "
        "disagree about node 0's address; give one of them");
  CHECK(config_error_text([] {
          (void)agent_flags::of_launcher(
              torchrun_args{"--master-port", "29500", "--rdzv-endpoint", "a", "t"});
        }) ==
        "--master-port=29500 on the command line and --rdzv-endpoint=a on the command line "
        "(c10d's default port 29400) disagree about node 0's port; give one of them");
  CHECK(config_error_text([] {
          (void)agent_flags::of_launcher(
              torchrun_args{"--standalone", "--rdzv-endpoint", "127.0.0.1:29400", "t"});
        }) ==
        "--standalone (127.0.0.1, a free port) and --rdzv-endpoint=127.0.0.1:29400 on the "
        "command line disagree about node 0's port; give one of them");
  for (std::string_view backend : {"etcd", "etcd-v2", "static", "zookeeper"}) {
    CAPTURE(backend);
    const std::string text = config_error_text([&] {
      (void)agent_flags::of_launcher(torchrun_args{"--rdzv-backend", backend, "t"});
    });
    CHECK(text.find("--rdzv-backend=" + std::string(backend) + " on the command line") == 0);
    CHECK_CONTAINS(text, "--master-addr HOST --master-port PORT --node-rank N");
  }
  CHECK_CONTAINS(config_error_text([] {
                   (void)agent_flags::of_launcher(torchrun_args{"--rdzv-backend=static", "t"});
                 }),
                 "--rdzv-backend=static on the command line: dtrun has no static rendezvous");
  CHECK(config_error_text([] {
          (void)agent_flags::of_launcher(torchrun_args{"--rdzv-conf", "join_timeout=900", "t"});
        }) ==
        "--rdzv-conf=join_timeout=900 on the command line: dtrun has no rendezvous settings "
        "of torchrun's; its waits are bounded by DTRAIN_STORE_TIMEOUT (join_timeout, "
        "timeout), and nodes are lost after --heartbeat-timeout");
  CHECK(config_error_text([] { (void)agent_flags::of_launcher(torchrun_args{"--rdzv-id="}); }) ==
        "--rdzv-id= on the command line is empty");
}

TEST_CASE("-m: a Python module runs as python3 -u -m, as torchrun's") {
  auto flags = agent_flags::of_launcher(
      torchrun_args{"--nproc-per-node", "2", "-m", "pkg.train", "--epochs", "3"});
  CHECK(flags.module());
  CHECK(flags.values().nproc_per_node == 2);
  CHECK(flags.command() ==
        std::vector<std::string>{"python3", "-u", "-m", "pkg.train", "--epochs", "3"});
  CHECK(agent_flags::of_launcher(torchrun_args{"--module", "--", "pkg.train"}).command() ==
        std::vector<std::string>{"python3", "-u", "-m", "pkg.train"});
  // Without -m: a .py file under python3 -u (not with --no-python), anything else as given.
  CHECK(agent_flags::of_launcher(torchrun_args{"train.py", "-m"}).command() ==
        std::vector<std::string>{"python3", "-u", "train.py", "-m"});
  CHECK(agent_flags::of_launcher(torchrun_args{"--no-python", "train.py"}).command() ==
        std::vector<std::string>{"train.py"});
  CHECK(agent_flags::of_launcher(torchrun_args{"./train", "-m", "x"}).command() ==
        std::vector<std::string>{"./train", "-m", "x"});
  CHECK(config_error_text([] {
          (void)agent_flags::of_launcher(torchrun_args{"-m", "--no-python", "pkg.train"});
        }) ==
        "-m (--module) and --no-python on the command line exclude each other: -m runs the "
        "module under python3 -u -m, --no-python runs the program without python3");
  CHECK(config_error_text([] {
          (void)agent_flags::of_launcher(torchrun_args{"--module=pkg", "t"});
        }) ==
        "--module=pkg on the command line: --module takes no value (the module is the "
        "program: -m pkg.train args...)");
  // A self-launching program's -m and --module are its own.
  CHECK_FALSE(agent_flags::of_program(torchrun_args{"-m", "x", "--module"}).module());
}

TEST_CASE("--rdzv-id: the agents' records carry it, so that nodes of two jobs do not mix") {
  using dtrain::detail::node_record;
  const node_record n{4, 2, "host-a", 1234, "job7"};
  CHECK(node_record::decode("k", n.encode()).rdzv_id == "job7");
  CHECK(node_record::decode("k", node_record{4, 2, "host-a", 1234, ""}.encode()).rdzv_id.empty());
}
