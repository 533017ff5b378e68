// dtrain_run_peer: a worker program built on dtrain::run, for the launch
// tests (tests/launch/cases.sh). The first argument picks the policy:
//
//   dtrain_run_peer node-gloo [options]      launch::per_node, backend::gloo (the agent re-executes
//   it) dtrain_run_peer process-gloo [options]   launch::per_process, backend::gloo
//   (dtrain_test_launch) dtrain_run_peer process-mpi [options]    launch::per_process, backend::mpi
//   (mpirun)
//
// Options (agent options go into run_options; workers see the same argv):
//   --nproc-per-node N --nnodes N --node-rank N --master-port P --max-restarts K --grace-period S
//   --nproc-from-argv   leave --nproc-per-node out of run_options: dtrain::run reads argv itself
//   --agent-flags-from-argv  leave every agent option out of run_options: dtrain::run reads
//                       dtrun's flags (--nproc-per-node, --master-port, --max-restarts, ...) itself
//   --fail-rank R       that rank exits with --fail-code (default 3) ...
//   --fail-restarts A   ... only while the restart count is below A (default: always)
//   --throw-rank R      that rank throws std::runtime_error("peer failure on purpose")
//   --hang DIR          every other rank writes DIR/<rank>.pid and sleeps until killed
//   --ignore-term       hanging ranks ignore SIGTERM (the agent must SIGKILL them)
//   --skip-rank R       that rank skips the allreduce (one collective fewer) and returns 0
//   --die-rank R        that rank SIGKILLs itself after the barrier, while the others stream
//                       allreduces to it (a peer dying mid-collective)
//   --broken-pipe       every rank writes to a pipe nobody reads and prints what write() said
//   --fork-child DIR    every rank first starts `sleep 300` and writes its pid to
//   DIR/child<rank>.pid
//
// Each worker prints `peer <world json> restart=<k>` and, after a barrier and
// an allreduce whose result it checks, `peer rank <r> done sum=<s>`.

#include <dtrain/dtrain.hpp>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <unistd.h>

namespace {

struct peer_options {
  dtrain::run_options run{};
  int fail_rank = -1;
  int fail_code = 3;
  int fail_restarts = 1 << 30;
  int throw_rank = -1;
  std::string hang_dir;
  bool ignore_term = false;
  int die_rank = -1;
  bool broken_pipe = false;
  std::string child_dir;
  bool nproc_from_argv = false;
  bool agent_flags_from_argv = false;
  int skip_rank = -1;
};

peer_options parse(int argc, char** argv) {
  peer_options o;
  for (int i = 1; i < argc; ++i)
    o.agent_flags_from_argv |= std::string_view(argv[i]) == "--agent-flags-from-argv";
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "dtrain_run_peer: %s needs a value\n", argv[i]);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--nproc-from-argv")
      o.nproc_from_argv = true;
    else if (a == "--agent-flags-from-argv")
      continue;  // read above
    else if (a == "--skip-rank")
      o.skip_rank = std::stoi(next());
    else if (a == "--nproc-per-node" || a == "--nproc_per_node")
      o.run.agent.nproc_per_node = std::stoi(next());
    else if (a.starts_with("--nproc-per-node=") || a.starts_with("--nproc_per_node="))
      continue;  // only dtrain::run reads these (--nproc-from-argv)
    else if (a == "--nnodes")
      o.run.agent.nnodes = std::stoi(next());
    else if (a == "--node-rank")
      o.run.agent.node_rank = std::stoi(next());
    else if (a == "--master-port")
      o.run.agent.master_port = std::stoi(next());
    else if (a == "--max-restarts")
      o.run.agent.max_restarts = std::stoi(next());
    else if (a == "--grace-period")
      o.run.agent.grace_period = std::chrono::milliseconds(std::stoi(next()) * 1000);
    else if (a == "--fail-rank")
      o.fail_rank = std::stoi(next());
    else if (a == "--fail-code")
      o.fail_code = std::stoi(next());
    else if (a == "--fail-restarts")
      o.fail_restarts = std::stoi(next());
    else if (a == "--throw-rank")
      o.throw_rank = std::stoi(next());
    else if (a == "--hang")
      o.hang_dir = next();
    else if (a == "--ignore-term")
      o.ignore_term = true;
    else if (a == "--die-rank")
      o.die_rank = std::stoi(next());
    else if (a == "--broken-pipe")
      o.broken_pipe = true;
    else if (a == "--fork-child")
      o.child_dir = next();
    else if (a.starts_with("--local_rank"))
      continue;  // checked by discovery against LOCAL_RANK
    else if (!a.starts_with("--"))
      continue;  // the mode
    else if (o.agent_flags_from_argv)
      continue;  // dtrun's flags (--tee, --master-port=P, ...): dtrain::run reads them
    else {
      std::fprintf(stderr, "dtrain_run_peer: unknown option %s\n", argv[i]);
      std::exit(2);
    }
  }
  if (o.nproc_from_argv) o.run.agent.nproc_per_node.reset();
  if (o.agent_flags_from_argv) o.run.agent = {};
  return o;
}

template <class Policy>
int work(dtrain::context<Policy>& ctx, const peer_options& o) {
  std::printf("peer %s restart=%d\n", dtrain::to_json(ctx.world()).c_str(), ctx.restart_count());
  std::fflush(stdout);
  if (!o.child_dir.empty()) {
    pid_t child = ::fork();
    if (child == 0) {
      ::execlp("sleep", "sleep", "300", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    std::ofstream(o.child_dir + "/child" + std::to_string(ctx.rank()) + ".pid") << child << '\n';
  }
  if (o.broken_pipe) {
    int fds[2];
    if (::pipe(fds) != 0) return 1;
    ::close(fds[0]);
    const char byte = 'x';
    const bool wrote = ::write(fds[1], &byte, 1) == 1;
    std::printf("peer rank %d: write to a closed pipe: %s\n", ctx.rank(),
                wrote ? "succeeded" : std::strerror(errno));
    std::fflush(stdout);
    ::close(fds[1]);
  }
  if (ctx.rank() == o.throw_rank) throw std::runtime_error("peer failure on purpose");
  if (ctx.rank() == o.fail_rank && ctx.restart_count() < o.fail_restarts) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let the others start waiting
    // When it fails, for bench/failure_to_exit.sh (milliseconds since the epoch).
    std::fprintf(stderr, "peer rank %d fails at %lld ms\n", ctx.rank(),
                 static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                            std::chrono::system_clock::now().time_since_epoch())
                                            .count()));
    std::fflush(stderr);
    return o.fail_code;
  }
  if (!o.hang_dir.empty()) {
    if (o.ignore_term) std::signal(SIGTERM, SIG_IGN);
    std::ofstream(o.hang_dir + "/" + std::to_string(ctx.rank()) + ".pid") << ::getpid() << '\n';
    while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  ctx.barrier();
  if (ctx.rank() == o.skip_rank) {
    // Leaves early, as a rank that skipped a backward(): its peers wait in the allreduce.
    std::printf("peer rank %d skips the allreduce\n", ctx.rank());
    std::fflush(stdout);
    return 0;
  }
  if (o.die_rank >= 0) {
    if (ctx.rank() == o.die_rank) ::raise(SIGKILL);
    // Enough traffic that the survivors write to the dead rank's sockets.
    std::vector<float> big(1 << 20, 1.0f);
    for (int i = 0; i < 10000; ++i)
      dtrain::allreduce(ctx.communicator(), std::span<float>(big)).wait();
    return 0;  // not reached: the dead rank's peers fail
  }
  std::vector<std::int64_t> value{ctx.rank() + 1};
  dtrain::allreduce(ctx.communicator(), std::span<std::int64_t>(value)).wait();
  const std::int64_t n = ctx.size();
  if (value[0] != n * (n + 1) / 2) {
    std::fprintf(stderr, "peer rank %d: allreduce gave %lld, expected %lld\n", ctx.rank(),
                 static_cast<long long>(value[0]), static_cast<long long>(n * (n + 1) / 2));
    return 1;
  }
  std::printf("peer rank %d done sum=%lld\n", ctx.rank(), static_cast<long long>(value[0]));
  return 0;
}

template <class Policy>
int start(int argc, char** argv) {
  const peer_options o = parse(argc, argv);
  return dtrain::run<Policy>(
      argc, argv, [&](dtrain::context<Policy>& ctx) { return work(ctx, o); }, o.run);
}

}  // namespace

int main(int argc, char** argv) {
  // An agent with local_rank_arg puts --local_rank=N first, as torch.distributed.launch did.
  const std::string_view first = argc > 1 ? argv[1] : "";
  const std::string_view mode = first.starts_with("--local_rank") && argc > 2 ? argv[2] : first;
#if DTRAIN_HAS_GLOO()
  if (mode == "node-gloo")
    return start<dtrain::policy<dtrain::launch::per_node, dtrain::backend::gloo>>(argc, argv);
  if (mode == "process-gloo")
    return start<dtrain::policy<dtrain::launch::per_process, dtrain::backend::gloo>>(argc, argv);
#endif
#if DTRAIN_HAS_MPI()
  if (mode == "process-mpi")
    return start<dtrain::policy<dtrain::launch::per_process, dtrain::backend::mpi>>(argc, argv);
#endif
  std::fprintf(stderr,
               "usage: dtrain_run_peer node-gloo|process-gloo|process-mpi [options] (this build "
               "lacks %s?)\n",
               argc > 1 ? argv[1] : "a mode");
  return 2;
}
