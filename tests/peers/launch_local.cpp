// dtrain_test_launch: starts N local ranks of a program with a torchrun-style
// environment, for tests of engines that meet through the store (no mpirun).
//
//   dtrain_test_launch [--no-kill] [--nodes A,B,...] N program [args...]
//
// Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK=0,
// GROUP_WORLD_SIZE=1, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT; other
// launchers' variables are removed. --nodes A,B,...: the ranks play nodes
// of A, B, ... ranks (in rank order): each gets DTRAIN_NODE_NAME=test-node<i>
// and no LOCAL_* / GROUP_* variables, so the runtime groups them by node name
// as it does under mpirun. Exits with the worst status (128+signal
// for a killed rank). When a rank fails the others are stopped, unless
// --no-kill (tests that check how the survivors react to a dead peer).

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace {

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::perror("dtrain_test_launch: finding a free port");
    std::exit(1);
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

void drop_launcher_variables() {
  static const char* const prefixes[] = {"OMPI_COMM_WORLD", "PMI_",     "PMIX_RANK",
                                         "MPI_LOCAL",       "SLURM_",   "HOROVOD_",
                                         "TF_CONFIG",       "AZ_BATCH", "NODE_RANK"};
  std::vector<std::string> names;
  for (char** e = environ; *e; ++e) {
    std::string entry(*e);
    std::string name = entry.substr(0, entry.find('='));
    for (const char* p : prefixes) {
      if (name.rfind(p, 0) == 0) names.push_back(name);
    }
  }
  for (const auto& n : names) ::unsetenv(n.c_str());
}

int status_of(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

int main(int argc, char** argv) {
  int arg = 1;
  bool kill_on_failure = true;
  std::vector<int> node_of;  // --nodes: the node of each rank
  for (;;) {
    if (arg < argc && std::string(argv[arg]) == "--no-kill") {
      kill_on_failure = false;
      ++arg;
    } else if (arg + 1 < argc && std::string(argv[arg]) == "--nodes") {
      std::string sizes = argv[arg + 1];
      for (std::size_t at = 0, node = 0; at <= sizes.size(); ++node) {
        const std::size_t comma = std::min(sizes.find(',', at), sizes.size());
        const int count = std::atoi(sizes.substr(at, comma - at).c_str());
        if (count < 1) {
          std::fprintf(stderr, "dtrain_test_launch: --nodes %s: '%s' is not a positive count\n",
                       sizes.c_str(), sizes.substr(at, comma - at).c_str());
          return 2;
        }
        node_of.insert(node_of.end(), static_cast<std::size_t>(count), static_cast<int>(node));
        at = comma + 1;
      }
      arg += 2;
    } else {
      break;
    }
  }
  if (argc - arg < 2) {
    std::fprintf(stderr,
                 "usage: dtrain_test_launch [--no-kill] [--nodes A,B,...] N program [args...]\n");
    return 2;
  }
  const int n = std::atoi(argv[arg]);
  if (n < 1) {
    std::fprintf(stderr, "dtrain_test_launch: N=%s is not a positive count\n", argv[arg]);
    return 2;
  }
  if (!node_of.empty() && node_of.size() != static_cast<std::size_t>(n)) {
    std::fprintf(stderr, "dtrain_test_launch: --nodes places %zu ranks, N is %d\n", node_of.size(),
                 n);
    return 2;
  }
  char** program = argv + arg + 1;
  drop_launcher_variables();
  const std::string port = std::to_string(free_port());
  std::vector<pid_t> ranks;
  for (int r = 0; r < n; ++r) {
    pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("dtrain_test_launch: fork");
      return 1;
    }
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("GROUP_RANK", "0", 1);
      ::setenv("GROUP_WORLD_SIZE", "1", 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      if (!node_of.empty()) {
        for (const char* name :
             {"LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"}) {
          ::unsetenv(name);
        }
        const int node = node_of[static_cast<std::size_t>(r)];
        ::setenv("DTRAIN_NODE_NAME", ("test-node" + std::to_string(node)).c_str(), 1);
      }
      ::execvp(program[0], program);
      std::fprintf(stderr, "dtrain_test_launch: cannot run %s: %s\n", program[0],
                   std::strerror(errno));
      std::_Exit(127);
    }
    ranks.push_back(pid);
  }
  int worst = 0;
  std::size_t left = ranks.size();
  while (left > 0) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    --left;
    int code = status_of(status);
    auto rank = std::find(ranks.begin(), ranks.end(), pid) - ranks.begin();
    if (code != 0)
      std::fprintf(stderr, "dtrain_test_launch: rank %ld exited with status %d\n",
                   static_cast<long>(rank), code);
    worst = std::max(worst, code);
    if (code != 0 && kill_on_failure) {
      for (pid_t p : ranks) ::kill(p, SIGTERM);
    }
  }
  return worst;
}
