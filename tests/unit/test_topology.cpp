// The topology layer on the host alone: when nodes allow a hierarchy, how a
// sequence of collectives runs (lazily on host engines, at once on streams,
// the step that failed named). The doctor's checks: tests/doctor/test_doctor.cpp.
#include "support.hpp"

#include <dtrain/dtrain.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {

std::vector<dtrain::node_layout> nodes_of(std::vector<int> sizes) {
  std::vector<dtrain::node_layout> table;
  for (int n = 0; n < static_cast<int>(sizes.size()); ++n) {
    for (int l = 0; l < sizes[static_cast<std::size_t>(n)]; ++l)
      table.push_back({n, static_cast<int>(sizes.size()), l, sizes[static_cast<std::size_t>(n)]});
  }
  return table;
}

}  // namespace

TEST_CASE("topology: the nodes allow a hierarchy only when they are alike") {
  using dtrain::detail::hierarchy_problem;
  CHECK(hierarchy_problem(nodes_of({2, 2})).empty());
  CHECK(hierarchy_problem(nodes_of({4, 4, 4})).empty());
  CHECK(hierarchy_problem(nodes_of({2, 1})) ==
        "uneven nodes: node 0 has 2 ranks, node 1 has 1 (hierarchical needs the same number of "
        "ranks on every node)");
  CHECK(hierarchy_problem(nodes_of({4})) == "one node: nothing crosses nodes");
  CHECK(hierarchy_problem(nodes_of({1, 1, 1})) ==
        "one rank per node: the cross-node communicator would be the world");
  auto twice = nodes_of({2, 2});
  twice[1].local_rank = 0;  // two local rank 0 on node 0
  CHECK(hierarchy_problem(twice) == "node 0 does not number its 2 ranks 0..1 (local rank 0)");
  auto disagree = nodes_of({2, 2});
  disagree[3].num_nodes = 3;
  CHECK(hierarchy_problem(disagree) == "rank 3 says there are 3 nodes, rank 0 2");
  auto missing = nodes_of({2, 2});
  for (auto& l : missing) l.num_nodes = 3;
  CHECK(hierarchy_problem(missing) == "2 of the 3 nodes have ranks");
}

TEST_CASE("topology: a node layout comes from a complete world only") {
  dtrain::world w;
  CHECK_FALSE(dtrain::node_layout::of(w).has_value());
  w.node_rank = 1;
  w.num_nodes = 2;
  w.local_rank = 0;
  w.local_world_size = 4;
  CHECK(dtrain::node_layout::of(w) == dtrain::node_layout{1, 2, 0, 4});
}

namespace {

/// A collective that finishes when the test says so; counts the engine's timeout hook.
class manual_work final : public dtrain::detail::work_state {
 public:
  explicit manual_work(std::string what)
      : work_state(std::move(what), std::chrono::milliseconds(5000)) {}
  bool poll() override { return done; }
  void on_timeout() noexcept override { ++aborted; }
  void finish(std::exception_ptr e = nullptr) {
    if (e) fail(e);
    done = true;
  }
  std::atomic<bool> done{false};
  std::atomic<int> aborted{0};
};

struct recorder {
  std::vector<std::shared_ptr<manual_work>> started;
  dtrain::detail::work_sequence::step step(const std::string& name) {
    return {name, [this, name] {
              started.push_back(std::make_shared<manual_work>(name));
              return dtrain::work(started.back());
            }};
  }
};

}  // namespace

TEST_CASE("topology: a sequence on a host engine starts each step when the last has finished") {
  recorder r;
  dtrain::work w(std::make_shared<dtrain::detail::work_sequence>(
      "hierarchical allreduce",
      std::vector{r.step("reduce_scatter"), r.step("allreduce"), r.step("allgather")}, false));
  REQUIRE(r.started.size() == 1);
  CHECK_FALSE(w.test());
  CHECK(r.started.size() == 1);
  r.started[0]->finish();
  CHECK_FALSE(w.test());  // the test started step 2
  REQUIRE(r.started.size() == 2);
  r.started[1]->finish();
  CHECK_FALSE(w.test());
  REQUIRE(r.started.size() == 3);
  r.started[2]->finish();
  CHECK(w.test());
  CHECK_FALSE(w.exception());
  CHECK(w.timeout() == 5000ms);
}

TEST_CASE("topology: a failed step ends the sequence, named, with its exception type") {
  recorder r;
  dtrain::work w(std::make_shared<dtrain::detail::work_sequence>(
      "hierarchical allreduce(sum, 8 x float32) on rank 1 of 4 (gloo)",
      std::vector{r.step("node-local reduce_scatter"), r.step("cross-node allreduce"),
                  r.step("node-local allgather")},
      false));
  r.started[0]->finish();
  (void)w.test();
  REQUIRE(r.started.size() == 2);
  r.started[1]->finish(std::make_exception_ptr(dtrain::backend_error("peer rank 1 died", 7)));
  try {
    w.wait(1s);
    FAIL("wait() did not throw");
  } catch (const dtrain::backend_error& e) {
    CHECK(std::string(e.what()) ==
          "hierarchical allreduce(sum, 8 x float32) on rank 1 of 4 (gloo), step 2 of 3 "
          "(cross-node allreduce): peer rank 1 died");
    CHECK(e.engine_code() == 7);
  }
  CHECK(r.started.size() == 2);  // the allgather never started
}

TEST_CASE(
    "topology: a sequence on streams enqueues every step at once, and a timeout gives each up") {
  recorder r;
  dtrain::work w(std::make_shared<dtrain::detail::work_sequence>(
      "hierarchical allreduce", std::vector{r.step("a"), r.step("b"), r.step("c")}, true));
  REQUIRE(r.started.size() == 3);
  r.started[0]->finish();
  CHECK_FALSE(w.test());
  CHECK_THROWS_AS(w.wait(30ms), dtrain::timeout_error);
  CHECK(r.started[0]->aborted == 0);  // finished: nothing to give up
  CHECK(r.started[1]->aborted == 1);
  CHECK(r.started[2]->aborted == 1);
}

TEST_CASE("topology: lanes start in list order, and independent lanes overlap (a pipeline)") {
  // Two chunks: reduce_scatter 1, 2 on lane 1; allreduce 1, 2 on lane 2 (each
  // after its reduce_scatter); allgather 1, 2 on lane 1 (each after its allreduce).
  std::vector<std::string> order;
  std::vector<std::shared_ptr<manual_work>> work_of;
  auto step = [&](std::string name, int lane, int after) {
    return dtrain::detail::work_sequence::step{
        name,
        [&, name] {
          order.push_back(name);
          work_of.push_back(std::make_shared<manual_work>(name));
          return dtrain::work(work_of.back());
        },
        lane, after};
  };
  dtrain::work w(std::make_shared<dtrain::detail::work_sequence>(
      "pipeline",
      std::vector{step("rs1", 1, -1), step("rs2", 1, -1), step("ar1", 2, 0), step("ar2", 2, 1),
                  step("ag1", 1, 2), step("ag2", 1, 3)},
      false));
  auto named = [&](const std::string& name) {
    for (auto& x : work_of) {
      if (x->description() == name) return x;
    }
    FAIL("no step " << name);
    return work_of.front();
  };
  CHECK(order == std::vector<std::string>{"rs1", "rs2"});  // both queued at once on lane 1
  named("rs2")->finish();  // finishing out of order does not let ar2 pass ar1 on lane 2
  CHECK_FALSE(w.test());
  CHECK(order == std::vector<std::string>{"rs1", "rs2"});
  named("rs1")->finish();
  CHECK_FALSE(w.test());
  CHECK(order == std::vector<std::string>{"rs1", "rs2", "ar1", "ar2"});
  named("ar2")->finish();  // ag2 waits behind ag1 on lane 1
  CHECK_FALSE(w.test());
  CHECK(order.size() == 4);
  named("ar1")->finish();
  CHECK_FALSE(w.test());
  CHECK(order == std::vector<std::string>{"rs1", "rs2", "ar1", "ar2", "ag1", "ag2"});
  named("ag1")->finish();
  named("ag2")->finish();
  CHECK(w.test());
  CHECK_FALSE(w.exception());
}

TEST_CASE("topology: a sequence waits through its steps' own waits") {
  recorder r;
  dtrain::work w(std::make_shared<dtrain::detail::work_sequence>(
      "s", std::vector{r.step("a"), r.step("b")}, false));
  std::thread finisher([&] {
    r.started[0]->finish();
    while (r.started.size() < 2) std::this_thread::sleep_for(1ms);
    r.started[1]->finish();
  });
  w.wait(10s);
  finisher.join();
  CHECK(w.test());
}
