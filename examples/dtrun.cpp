// dtrun: dtrain's per-node agent for any program, with torchrun's flag names.
//
//   dtrun --nproc-per-node 4 -- ./train args...
//   dtrun --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 --nproc-per-node 8 --
//   ./train dtrun --nproc-per-node 2 -- script.py args...        (a .py script runs under python3
//   -u, as torchrun)
//
// Workers get torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
// NODE_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...), so PyTorch scripts using
// init_process_group(init_method="env://") and dtrain programs both run under it. Each flag can
// also be given as an environment variable (the flag wins): see `dtrun --help` and the README.
//
// Exit status: 0 when every worker of every node succeeded; the failing worker's status (128 +
// signal when killed) otherwise; 2 on bad flags or environment.

#include <dtrain/dtrain.hpp>

#include <charconv>
#include <cstdio>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr std::string_view usage = R"(usage: dtrun [options] [--] program [args...]

Starts the workers of one node and supervises them (dtrain's per-node agent).
Options (torchrun's names; `_` may replace `-`; environment variable in brackets):
  --nproc-per-node N    workers on this node                   [DTRAIN_NPROC_PER_NODE] (1)
  --nnodes N            nodes in the job                       [DTRAIN_NNODES]
                        (1, or the outer launcher's)
  --node-rank N         this node's index                      [DTRAIN_NODE_RANK, NODE_RANK]
  --master-addr HOST    node 0's address                       [MASTER_ADDR] (127.0.0.1 on one node)
  --master-port PORT    node 0's agent store port; 0 = free    [MASTER_PORT]
                        (free on one node, else 29500)
  --standalone          one node, a free port on 127.0.0.1
  --max-restarts K      restart the workers of every node up to K times after a failure
                                                               [DTRAIN_MAX_RESTARTS] (0)
  --grace-period S      seconds between SIGTERM and SIGKILL    [DTRAIN_GRACE_PERIOD] (10)
  --heartbeat-timeout S seconds of silence after which another node's agent is lost
                                                               [DTRAIN_HEARTBEAT_TIMEOUT] (10)
  --tee                 prefix each output line with [rank N]  [DTRAIN_TEE=1]
  --log-dir DIR         also write DIR/restart_K/rank_N.log    [DTRAIN_LOG_DIR]
  --pass-local-rank     give workers --local_rank=N (Hugging Face / torch.distributed.launch style)
                                                               [DTRAIN_LOCAL_RANK_ARG=1]
  --no-python           run a .py program directly instead of under python3 -u
)";

int number(std::string_view flag, std::string_view text) {
  int value = -1;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 0) {
    throw dtrain::config_error("dtrun " + std::string(flag) + " " + std::string(text) +
                               ": expected a non-negative integer");
  }
  return value;
}

struct cli {
  dtrain::agent_options options;
  std::vector<std::string> command;
  bool no_python = false;
};

cli parse(int argc, char** argv, const dtrain::environment& env) {
  cli c;
  c.options = dtrain::agent_options{}.with_env(env);
  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (!arg.starts_with("--")) break;  // the program
    std::string flag = arg;
    std::string value;
    bool inline_value = false;
    if (auto eq = arg.find('='); eq != std::string::npos) {
      flag = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      inline_value = true;
    }
    for (char& ch : flag) {
      if (ch == '_') ch = '-';
    }
    auto take = [&]() -> std::string {
      if (inline_value) return value;
      if (i + 1 >= argc) throw dtrain::config_error("dtrun " + flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--help" || flag == "-h") {
      std::cout << usage;
      std::exit(0);
    } else if (flag == "--nproc-per-node") {
      c.options.nproc_per_node = number(flag, take());
    } else if (flag == "--nnodes") {
      c.options.nnodes = number(flag, take());
    } else if (flag == "--node-rank") {
      c.options.node_rank = number(flag, take());
    } else if (flag == "--master-addr") {
      c.options.master_addr = take();
    } else if (flag == "--master-port") {
      c.options.master_port = number(flag, take());
    } else if (flag == "--standalone") {
      c.options.nnodes = 1;
      c.options.node_rank = 0;
      c.options.master_addr = "127.0.0.1";
      c.options.master_port = 0;
    } else if (flag == "--max-restarts") {
      c.options.max_restarts = number(flag, take());
    } else if (flag == "--grace-period") {
      c.options.grace_period = std::chrono::seconds(number(flag, take()));
    } else if (flag == "--heartbeat-timeout") {
      c.options.heartbeat_timeout = std::chrono::seconds(number(flag, take()));
    } else if (flag == "--tee") {
      c.options.tee = true;
    } else if (flag == "--log-dir") {
      c.options.log_dir = take();
    } else if (flag == "--pass-local-rank") {
      c.options.local_rank_arg = true;
    } else if (flag == "--no-python") {
      c.no_python = true;
    } else {
      throw dtrain::config_error("dtrun: unknown option " + arg + " (see dtrun --help)");
    }
  }
  for (; i < argc; ++i) c.command.emplace_back(argv[i]);
  if (c.command.empty()) throw dtrain::config_error("dtrun: no program to run (see dtrun --help)");
  if (!c.no_python && c.command.front().ends_with(".py")) {
    c.command.insert(c.command.begin(), {"python3", "-u"});
  }
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
