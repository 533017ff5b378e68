#include "support.hpp"

using dtrain::detail::hostlist;
using dtrain::detail::parse_tasks_per_node;
using dtrain_test::config_error_text;

TEST_CASE("hostlist: the first host of a compressed Slurm node list") {
  CHECK(hostlist::parse("gpu-[01-03,07],cpu5", "L").front() == "gpu-01");
  CHECK(hostlist::parse("cpu5,gpu-[01-03]", "L").front() == "cpu5");
  CHECK(hostlist::parse("node17", "L").front() == "node17");
  CHECK(hostlist::parse("rack[2-3]-n[008-010]", "L").front() == "rack2-n008");
  CHECK(hostlist::parse("n[7,3-4]", "L").front() == "n7");
}

TEST_CASE("hostlist: expansion keeps zero padding and order, size counts without expanding") {
  auto list = hostlist::parse("gpu-[01-03,07],cpu5", "L");
  CHECK(list.size() == 5);
  CHECK(list.expand() == std::vector<std::string>{"gpu-01", "gpu-02", "gpu-03", "gpu-07", "cpu5"});
  CHECK(hostlist::parse("n[8-10]", "L").expand() == std::vector<std::string>{"n8", "n9", "n10"});
  CHECK(hostlist::parse("r[1-2]-n[1-2]", "L").expand() ==
        std::vector<std::string>{"r1-n1", "r1-n2", "r2-n1", "r2-n2"});
  auto huge = hostlist::parse("n[0-999999999],m[0-999999999]", "L");
  CHECK(huge.size() == 2000000000u);
  CHECK(huge.front() == "n0");
  CHECK_CONTAINS(config_error_text([&] { (void)huge.expand(1000); }), "exceeds the limit of 1000");
}

TEST_CASE("hostlist: malformed lists name the variable") {
  auto err = [](std::string_view text) {
    return config_error_text(
        [&] { (void)hostlist::parse(text, "SLURM_STEP_NODELIST=" + std::string(text)); });
  };
  CHECK_CONTAINS(err(""), "SLURM_STEP_NODELIST= is an empty host list");
  CHECK_CONTAINS(err("gpu-[01-03"), "'[' without ']'");
  CHECK_CONTAINS(err("gpu-01]"), "']' without '['");
  CHECK_CONTAINS(err("a[[1]]"), "nested '['");
  CHECK_CONTAINS(err("a[]"), "empty '[]'");
  CHECK_CONTAINS(err("a[3-1]"), "descending range '3-1'");
  CHECK_CONTAINS(err("a[x-2]"), "bad range bound 'x'");
  CHECK_CONTAINS(err("a,,b"), "empty host name");
}

TEST_CASE("tasks per node: N and N(xM), nodes may differ") {
  CHECK(parse_tasks_per_node("2(x3),1", "T") == std::vector<int>{2, 2, 2, 1});
  CHECK(parse_tasks_per_node("4", "T") == std::vector<int>{4});
  CHECK(parse_tasks_per_node("1,3(x2)", "T") == std::vector<int>{1, 3, 3});
  auto err = [](std::string_view text) {
    return config_error_text(
        [&] { (void)parse_tasks_per_node(text, "SLURM_TASKS_PER_NODE=" + std::string(text)); });
  };
  CHECK_CONTAINS(err(""), "is empty");
  CHECK_CONTAINS(err("2(3)"), "malformed item '2(3)'");
  CHECK_CONTAINS(err("2(x)"), "malformed item");
  CHECK_CONTAINS(err("a"), "task count 'a'");
  CHECK_CONTAINS(err("0"), "zero tasks");
  CHECK_CONTAINS(err("1(x9999999)"), "more than");
}
