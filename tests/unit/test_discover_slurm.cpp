#include "support.hpp"

using dtrain::environment;
using dtrain::launcher;
using dtrain_test::discover;
using dtrain_test::discover_agent;
using dtrain_test::discover_error;

namespace {
// srun -n 7 over gpu-01..03 (2 tasks each) and cpu5 (1 task), inside a job
// whose allocation also holds gpu-07: task 6 runs alone on cpu5.
environment srun_task_6() {
  return {{"SLURM_JOB_ID", "4242"},
          {"SLURM_JOBID", "4242"},
          {"SLURM_JOB_NODELIST", "gpu-[01-03,07],cpu5"},
          {"SLURM_JOB_NUM_NODES", "5"},
          {"SLURM_NNODES", "4"},
          {"SLURM_TASKS_PER_NODE", "2(x3),1"},
          {"SLURM_STEP_ID", "0"},
          {"SLURM_STEPID", "0"},
          {"SLURM_STEP_NODELIST", "gpu-[01-03],cpu5"},
          {"SLURM_STEP_NUM_NODES", "4"},
          {"SLURM_STEP_NUM_TASKS", "7"},
          {"SLURM_STEP_TASKS_PER_NODE", "2(x3),1"},
          {"SLURM_NTASKS", "7"},
          {"SLURM_NPROCS", "7"},
          {"SLURM_PROCID", "6"},
          {"SLURM_LOCALID", "0"},
          {"SLURM_NODEID", "3"},
          {"SLURMD_NODENAME", "cpu5"},
          {"SLURM_CPUS_ON_NODE", "8"},
          {"SLURM_GTIDS", "6"}};
}
}  // namespace

TEST_CASE("Slurm: nodes with different task counts, master = first host of the step's node list") {
  auto w = discover(srun_task_6());
  CHECK(w.source == launcher::slurm);
  CHECK(w.rank == 6);
  CHECK(w.world_size == 7);
  CHECK(w.local_rank == 0);
  CHECK(w.local_world_size == 1);  // cpu5 holds one task
  CHECK(w.node_rank == 3);
  CHECK(w.num_nodes == 4);
  CHECK(w.master_addr == "gpu-01");
  CHECK(w.master_port == dtrain::slurm_default_port(4242));
  CHECK(w.master_port == 24242);
  CHECK(w.origin(dtrain::world::field::master_addr) ==
        "first host of SLURM_STEP_NODELIST=gpu-[01-03],cpu5");
  CHECK(w.origin(dtrain::world::field::local_world_size) ==
        "SLURM_STEP_TASKS_PER_NODE=2(x3),1 at SLURM_NODEID=3");

  auto first =
      srun_task_6().with("SLURM_PROCID", "1").with("SLURM_LOCALID", "1").with("SLURM_NODEID", "0");
  CHECK(discover(first).local_world_size == 2);
}

TEST_CASE("Slurm: MASTER_ADDR / MASTER_PORT win over the node list and the default port") {
  auto w = discover(srun_task_6().with("MASTER_PORT", "12345"));
  CHECK(w.master_addr == "gpu-01");
  CHECK(w.master_port == 12345);
  // An IP address for the same host is not a disagreement: the node list is only a fallback.
  w = discover(srun_task_6().with("MASTER_ADDR", "10.3.0.1"));
  CHECK(w.master_addr == "10.3.0.1");
  CHECK(w.master_port == 24242);
  CHECK(discover(srun_task_6().without("SLURM_JOB_ID")).master_port == dtrain::default_master_port);
}

TEST_CASE("Slurm: the step's variables win over the allocation's") {
  // Without the step list, the job list is the fallback (and its size is not checked against the
  // step).
  auto w = discover(srun_task_6().without("SLURM_STEP_NODELIST"));
  CHECK(w.master_addr == "gpu-01");
  CHECK(w.num_nodes == 4);
}

TEST_CASE("Slurm: a batch script without srun is one process, and says why") {
  environment batch{{"SLURM_JOB_ID", "4242"},
                    {"SLURM_JOB_NODELIST", "gnode[10,20,25,37]"},
                    {"SLURM_NNODES", "4"},
                    {"SLURM_NTASKS", "4"},
                    {"SLURM_TASKS_PER_NODE", "1(x4)"},
                    {"SLURM_PROCID", "0"},
                    {"SLURM_LOCALID", "0"},
                    {"SLURM_NODEID", "0"}};
  auto w = discover(batch);
  CHECK(w.source == launcher::none);
  CHECK(w.world_size == 1);
  CHECK_CONTAINS(w.notes, "SLURM_PROCID is set without SLURM_STEP_ID");
  CHECK_CONTAINS(w.describe(), "note: SLURM_PROCID is set without SLURM_STEP_ID");
}

TEST_CASE("Slurm: inconsistent variables are errors naming them") {
  CHECK(discover_error(srun_task_6().with("SLURM_STEP_TASKS_PER_NODE", "2(x3),2")) ==
        "SLURM_STEP_TASKS_PER_NODE=2(x3),2 adds up to 8 tasks, not SLURM_STEP_NUM_TASKS=7");
  CHECK(discover_error(srun_task_6().with("SLURM_STEP_TASKS_PER_NODE", "3,2,2")) ==
        "SLURM_STEP_TASKS_PER_NODE=3,2,2 lists 3 nodes, not SLURM_STEP_NUM_NODES=4");
  CHECK(discover_error(srun_task_6().with("SLURM_STEP_NODELIST", "gpu-[01-03]")) ==
        "SLURM_STEP_NODELIST=gpu-[01-03] names 3 hosts, not SLURM_STEP_NUM_NODES=4");
  CHECK(discover_error(srun_task_6().with("SLURM_PROCID", "7")) ==
        "SLURM_PROCID=7 is not below SLURM_STEP_NUM_TASKS=7");
  CHECK(discover_error(srun_task_6().with("SLURM_LOCALID", "1")) ==
        "SLURM_LOCALID=1 is not below SLURM_STEP_TASKS_PER_NODE=2(x3),1 at SLURM_NODEID=3");
  CHECK(discover_error(srun_task_6().with("SLURM_NODEID", "4")) ==
        "SLURM_NODEID=4 is not below the 4 nodes of SLURM_STEP_TASKS_PER_NODE=2(x3),1");
  CHECK_CONTAINS(discover_error(srun_task_6().with("SLURM_STEP_NODELIST", "gpu-[01-03")),
                 "'[' without ']'");
  CHECK(discover_error(srun_task_6()
                           .without("SLURM_STEP_NUM_TASKS")
                           .without("SLURM_NTASKS")
                           .without("SLURM_NPROCS")) ==
        "SLURM_PROCID=6 is set but none of SLURM_STEP_NUM_TASKS, SLURM_NTASKS, SLURM_NPROCS is");
}

TEST_CASE("Slurm: torchrun under srun (one task per node) is an outer launcher, not a conflict") {
  // srun -N 2 --ntasks-per-node 1 torchrun --nproc-per-node 4: worker 6 inherits the task's
  // SLURM_*.
  environment env{{"SLURM_JOB_ID", "77"},
                  {"SLURM_STEP_ID", "0"},
                  {"SLURM_STEP_NODELIST", "n[1-2]"},
                  {"SLURM_STEP_NUM_NODES", "2"},
                  {"SLURM_STEP_NUM_TASKS", "2"},
                  {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"},
                  {"SLURM_NTASKS", "2"},
                  {"SLURM_PROCID", "1"},
                  {"SLURM_LOCALID", "0"},
                  {"SLURM_NODEID", "1"},
                  {"MASTER_ADDR", "n1"},
                  {"MASTER_PORT", "29400"},
                  {"WORLD_SIZE", "8"},
                  {"RANK", "6"},
                  {"LOCAL_RANK", "2"},
                  {"LOCAL_WORLD_SIZE", "4"},
                  {"GROUP_RANK", "1"},
                  {"GROUP_WORLD_SIZE", "2"}};
  auto w = discover(env);
  CHECK(w.source == launcher::env);
  CHECK(w.rank == 6);
  CHECK(w.local_rank == 2);
  CHECK(w.node_rank == 1);
  CHECK(w.master_addr == "n1");
  CHECK(w.master_port == 29400);
  CHECK_CONTAINS(w.notes, "outer launcher slurm ran one process per node (SLURM_STEP_NUM_TASKS=2)");

  // With several tasks per node, a different count is a real conflict.
  auto clash = env.with("SLURM_STEP_NUM_TASKS", "3")
                   .with("SLURM_STEP_TASKS_PER_NODE", "2,1")
                   .with("SLURM_NODEID", "0")
                   .with("SLURM_PROCID", "0");
  CHECK_CONTAINS(
      discover_error(clash),
      "WORLD_SIZE=8 (env) and SLURM_STEP_NUM_TASKS=3 (slurm) disagree about the world size");
}

TEST_CASE("Slurm per-node launch: one agent per node") {
  environment env{{"SLURM_JOB_ID", "77"},
                  {"SLURM_STEP_ID", "0"},
                  {"SLURM_STEP_NODELIST", "n[1-3]"},
                  {"SLURM_STEP_NUM_NODES", "3"},
                  {"SLURM_STEP_NUM_TASKS", "3"},
                  {"SLURM_STEP_TASKS_PER_NODE", "1(x3)"},
                  {"SLURM_PROCID", "2"},
                  {"SLURM_LOCALID", "0"},
                  {"SLURM_NODEID", "2"}};
  auto w = discover_agent(env, {.nproc_per_node = 4});
  CHECK(w.node_rank == 2);
  CHECK(w.num_nodes == 3);
  CHECK(w.world_size == 12);
  CHECK(w.master_addr == "n1");
  CHECK(w.master_port == 20077);
  auto two_per_node = env.with("SLURM_STEP_NUM_TASKS", "6")
                          .with("SLURM_STEP_TASKS_PER_NODE", "2(x3)")
                          .with("SLURM_PROCID", "4");
  CHECK(dtrain_test::config_error_text([&] { (void)discover_agent(two_per_node, {}); }) ==
        "per-node launch runs one agent per node, but SLURM_STEP_TASKS_PER_NODE=2(x3) at "
        "SLURM_NODEID=2");
}
