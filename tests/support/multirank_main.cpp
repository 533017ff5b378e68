// main() of every multi-rank test program (tests/support/multirank.hpp): takes
// --engine= and --topology= off the command line and runs the doctest cases it
// selects (--test-case=<name>) in this rank.
#define DOCTEST_CONFIG_IMPLEMENT
#include "multirank.hpp"

#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace {
dtrain_test::job_choice the_job;
}

const dtrain_test::job_choice& dtrain_test::job() { return the_job; }

int main(int argc, char** argv) {
  std::vector<char*> doctest_args;
  if (argc > 0) the_job.program = argv[0];
  for (int i = 0; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.starts_with("--engine=")) {
      the_job.engine = arg.substr(9);
    } else if (arg.starts_with("--topology=")) {
      the_job.topology = arg.substr(11);
    } else {
      doctest_args.push_back(argv[i]);
    }
  }
  if (the_job.topology != "flat" && the_job.topology != "hierarchical") {
    std::fprintf(stderr, "%s: --topology=%s: flat or hierarchical\n", the_job.program.c_str(),
                 the_job.topology.c_str());
    return 2;
  }
  doctest::Context context(static_cast<int>(doctest_args.size()), doctest_args.data());
  return context.run();
}
