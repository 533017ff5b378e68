// dtrun: dtrain's per-node agent for any program, with torchrun's flag names.
//
//   dtrun --nproc-per-node 4 -- ./train args...
//   dtrun --nnodes 2 --node-rank 0 --master-addr node0 --nproc-per-node 8 -- ./train
//   dtrun --nproc-per-node 2 -- script.py args...   (runs under python3 -u, as torchrun)
//   dtrun --nproc-per-node gpu -m pkg.train args... (python3 -u -m pkg.train, one per GPU)
//   dtrun --flight-records DIR   (a failed job's diagnostics table, from its ranks' flight records)
//
// A program built on dtrain::run with launch::per_node takes the same flags on its own command
// line (./train --nproc-per-node 2 --epochs 3): both read them with dtrain's one parser.
//
// Workers get torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
// NODE_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...), so PyTorch scripts using
// init_process_group(init_method="env://") and dtrain programs both run under it. Each flag can
// also be given as an environment variable, dtrain's (DTRAIN_*) or torchrun's (PET_*, as Kubeflow
// Trainer sets them; the flag wins): see `dtrun --help` and docs/reference.md.
//
// Exit status: 0 when every worker of every node succeeded; the failing worker's status (128 +
// signal when killed) otherwise; 2 on bad flags or environment.

#include <dtrain/dtrain.hpp>

#include <cstdio>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr std::string_view usage = R"(usage: dtrun [options] [--] program [args...]
       dtrun [options] -m module [args...]
       dtrun --flight-records DIR

Starts the workers of one node and supervises them (dtrain's per-node agent).
Options (torchrun's names; `_` may replace `-`; environment variables in brackets,
the flag wins over them; two variables that are set must agree):
  --nproc-per-node N|gpu|cpu|auto
                        workers on this node; gpu: one per visible GPU (an error
                        without one), cpu: one per usable core, auto: gpu if
                        there are GPUs, else cpu
                                              [DTRAIN_NPROC_PER_NODE, PET_NPROC_PER_NODE] (1)
  --nnodes N|MIN:MAX    nodes in the job; MIN:MAX: elastic, it goes on with
                        at least MIN when nodes are lost and takes up to MAX
                                                               [DTRAIN_NNODES, PET_NNODES]
                        (1, or the outer launcher's)
  --node-rank N         this node's index    [DTRAIN_NODE_RANK, PET_NODE_RANK, NODE_RANK]
  --master-addr HOST    node 0's address     [MASTER_ADDR, PET_MASTER_ADDR] (127.0.0.1 on one node)
  --master-port PORT    node 0's agent store port; 0 = free    [MASTER_PORT, PET_MASTER_PORT]
                        (free on one node, else 29500)
  --rdzv-endpoint HOST[:PORT]
                        node 0's store, as torchrun's c10d endpoint (port 29400 if none);
                        must agree with --master-addr/--master-port [PET_RDZV_ENDPOINT]
  --rdzv-backend c10d   accepted (dtrun's store is c10d's way); etcd, etcd-v2 and
                        static are refused                     [PET_RDZV_BACKEND]
  --rdzv-id ID          the job's id: every node must give the same one; workers get
                        it as TORCHELASTIC_RUN_ID              [PET_RDZV_ID]
  --rdzv-conf           refused: dtrun's waits are DTRAIN_STORE_TIMEOUT and --heartbeat-timeout
  --standalone          one node, a free port on 127.0.0.1
  --max-restarts K      restart the workers of every node up to K times after a failure
                                                               [DTRAIN_MAX_RESTARTS] (0)
  --grace-period S      seconds between SIGTERM and SIGKILL    [DTRAIN_GRACE_PERIOD] (10)
  --heartbeat-timeout S seconds of silence after which another node's agent is lost
                                                               [DTRAIN_HEARTBEAT_TIMEOUT] (10)
  --tee                 prefix each output line with [rank N]  [DTRAIN_TEE=1]
  --log-dir DIR         also write DIR/restart_K/rank_N.log    [DTRAIN_LOG_DIR]
                        (and the ranks' flight records there, for --flight-records)
  --metrics-port PORT   serve the workers' metrics (DTRAIN_METRICS_DIR) for Prometheus at
                        http://127.0.0.1:PORT/metrics; 0: a free port. Another address
                        (DTRAIN_METRICS_BIND) needs DTRAIN_METRICS_TOKEN  [DTRAIN_METRICS_PORT]
  --pass-local-rank     give workers --local_rank=N (Hugging Face / torch.distributed.launch style)
                                                               [DTRAIN_LOCAL_RANK_ARG=1]
  --no-python           run a .py program directly instead of under python3 -u
  --module, -m          the program is a Python module: python3 -u -m module args...
  --flight-records DIR  start nothing: print the collective diagnostics table
                        from the flight records a job's ranks wrote in DIR
                        (DTRAIN_DIAGNOSTICS_DIR; --log-dir's restart_K) on a
                        timeout, a failed collective or SIGUSR1. Exit status 0,
                        or 2 when a record could not be used or none was found
)";

struct cli {
  dtrain::agent_options options;
  std::vector<std::string> command;
};

// dtrun --flight-records DIR: the table, the files not used, and the exit status.
int print_flight_records(const std::string& dir) {
  const dtrain::detail::flight_reading read = dtrain::detail::read_flight_records(dir);
  std::cout << read.table << std::flush;
  for (const std::string& problem : read.problems) std::cerr << "dtrun: " << problem << '\n';
  if (read.table.empty()) {
    std::cerr << "dtrun: no flight record (dtrain_flight_rank<R>.bin) in " << dir
              << ": the ranks write them where DTRAIN_DIAGNOSTICS_DIR says, when a diagnostics "
                 "round runs\n";
  }
  return read.table.empty() || !read.problems.empty() ? 2 : 0;
}

// The flags are dtrain's own parser's (dtrain/launch/command_line.hpp), the one a self-launching
// program (dtrain::run under launch::per_node) reads its command line with.
cli parse(int argc, char** argv, const dtrain::environment& env) {
  const std::vector<std::string_view> args(argv + 1, argv + argc);
  const auto flags = dtrain::detail::agent_flags::of_launcher(args);
  if (flags.help()) {
    std::cout << usage;
    std::exit(0);
  }
  if (!flags.flight_records().empty()) std::exit(print_flight_records(flags.flight_records()));
  cli c;
  c.options = dtrain::agent_options{}.with_env(env);
  flags.apply(c.options);  // the flags win over the environment
  if (flags.program().empty()) {
    throw dtrain::config_error(flags.module() ? "-m needs a module to run (see dtrun --help)"
                                              : "no program to run (see dtrun --help)");
  }
  c.command = flags.command();
  c.options.check();
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  const dtrain::environment env = dtrain::environment::from_process();
  std::string who = "dtrun";
  try {
    cli c = parse(argc, argv, env);
    dtrain::node_agent agent(std::move(c.command), c.options, env,
                             dtrain::store_options{}.with_env(env));
    who = "dtrun node " + std::to_string(*agent.node().node_rank);
    return agent.run();
  } catch (...) {  // 127 missing, 126 not executable (as shells), 2 bad input, else 1
    const auto [status, what] = dtrain::detail::current_failure();
    std::cerr << who << ": " << what << '\n';
    return status;
  }
}
