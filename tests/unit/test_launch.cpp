// The pure parts of launching: agent options from the environment, the
// node agent's view of its node, and completing the world by node name.
// The processes themselves are tested in tests/launch/cases.sh.

#include "support.hpp"

#include <atomic>
#include <chrono>
#include <csignal>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <sys/types.h>

using namespace std::chrono_literals;
using dtrain::agent_options;
using dtrain::environment;
using dtrain::placement;
using dtrain::rank_report;
using dtrain_test::config_error_text;

TEST_CASE("agent options: every option has an environment variable, and the environment wins") {
  agent_options coded{.nproc_per_node = 4, .max_restarts = 1};
  auto tuned = coded.with_env({{"DTRAIN_NPROC_PER_NODE", "2"},
                               {"DTRAIN_NNODES", "3"},
                               {"DTRAIN_NODE_RANK", "1"},
                               {"DTRAIN_MAX_RESTARTS", "5"},
                               {"DTRAIN_GRACE_PERIOD", "0.5"},
                               {"DTRAIN_TEE", "1"},
                               {"DTRAIN_LOG_DIR", "/tmp/logs"},
                               {"DTRAIN_LOCAL_RANK_ARG", "yes"}});
  CHECK(tuned.nproc_per_node == 2);
  CHECK(tuned.nnodes == 3);
  CHECK(tuned.node_rank == 1);
  CHECK(tuned.max_restarts == 5);
  CHECK(tuned.grace_period == 500ms);
  CHECK(tuned.tee);
  CHECK(tuned.log_dir == "/tmp/logs");
  CHECK(tuned.local_rank_arg);
  auto same = coded.with_env({});
  CHECK(same.nproc_per_node == 4);
  CHECK(same.max_restarts == 1);
  CHECK(same.grace_period == dtrain::default_grace_period);
  CHECK_FALSE(same.tee);
}

TEST_CASE("agent options: bad values name the variable or option") {
  CHECK(config_error_text([] {
          (void)agent_options{}.with_env({{"DTRAIN_NPROC_PER_NODE", "0"}});
        }) == "DTRAIN_NPROC_PER_NODE=0 must be at least 1 (workers per node)");
  CHECK(config_error_text([] {
          (void)agent_options{}.with_env({{"DTRAIN_NNODES", "two"}});
        }) == "DTRAIN_NNODES=two is not a non-negative integer");
  CHECK(config_error_text([] {
          (void)agent_options{}.with_env({{"DTRAIN_TEE", "maybe"}});
        }) == "DTRAIN_TEE=maybe is not 0, 1, true, false, yes, no, on or off");
  CHECK(config_error_text([] {
          (void)agent_options{}.with_env({{"DTRAIN_GRACE_PERIOD", "0"}});
        }) == "DTRAIN_GRACE_PERIOD=0 is not a positive number of seconds");
  CHECK(config_error_text([] { agent_options{.max_restarts = -1}.check(); }) ==
        "option max_restarts=-1 is negative");
  CHECK(config_error_text([] { agent_options{.master_port = 70000}.check(); }) ==
        "option master_port=70000 is outside the port range 1-65535");
  CHECK(config_error_text([] { agent_options{.nproc_per_node = 0}.check(); }) ==
        "option nproc_per_node=0 must be at least 1");
  CHECK(config_error_text([] {
          (void)agent_options{}.with_env({{"DTRAIN_HEARTBEAT_TIMEOUT", "0"}});
        }) == "DTRAIN_HEARTBEAT_TIMEOUT=0 is not a positive number of seconds");
}

TEST_CASE("agent options: sizes are checked against max_world_size before anything is allocated") {
  CHECK(config_error_text([] { agent_options{.nproc_per_node = 2'000'000'000}.check(); }) ==
        "option nproc_per_node=2000000000 is more than dtrain's limit of 1048576 ranks "
        "(max_world_size)");
  CHECK(config_error_text([] {
          (void)agent_options{}.with_env({{"DTRAIN_NNODES", "1048577"}});
        }) ==
        "option nnodes=1048577 is more than dtrain's limit of 1048576 ranks (max_world_size)");
  agent_options{.nproc_per_node = dtrain::max_world_size, .nnodes = 1}.check();  // the limit itself
  // Each fits, the product does not (it would overflow an int): discovery names both factors.
  CHECK(dtrain_test::discover_error(
            {{"NODE_RANK", "1"}, {"MASTER_ADDR", "10.0.0.1"}}, {},
            {.mode = dtrain::launch_mode::per_node, .nproc_per_node = 65536, .nnodes = 65536}) ==
        "option nproc_per_node=65536 × option nnodes=65536 = 4294967296 ranks, more than dtrain's "
        "limit of 1048576 (max_world_size)");
}

TEST_CASE("agent options: the heartbeat timeout has its own option and variable") {
  CHECK(agent_options{}.heartbeat_timeout == dtrain::default_heartbeat_timeout);
  CHECK(agent_options{}.with_env({{"DTRAIN_HEARTBEAT_TIMEOUT", "2.5"}}).heartbeat_timeout ==
        2500ms);
}

TEST_CASE("node agent: node, master and port come from options, NODE_RANK or the outer launcher") {
  using dtrain::node_agent;
  SUBCASE("a single node needs nothing: 127.0.0.1 and a free port") {
    node_agent agent({"true"}, {.nproc_per_node = 3}, environment{});
    CHECK(agent.node().node_rank == 0);
    CHECK(agent.node().num_nodes == 1);
    CHECK(agent.node().local_world_size == 3);
    CHECK(agent.node().world_size == 3);
  }
  SUBCASE("Lightning / Azure ML style NODE_RANK with options") {
    node_agent agent(
        {"true"}, {.nproc_per_node = 2, .nnodes = 4},
        environment{{"NODE_RANK", "2"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "6105"}});
    CHECK(agent.node().node_rank == 2);
    CHECK(agent.node().world_size == 8);
  }
  SUBCASE("one agent per node under mpirun: the MPI rank is the node rank") {
    node_agent agent({"true"}, {.nproc_per_node = 2},
                     environment{{"OMPI_COMM_WORLD_RANK", "1"},
                                 {"OMPI_COMM_WORLD_SIZE", "2"},
                                 {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                 {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"},
                                 {"MASTER_ADDR", "node0"}});
    CHECK(agent.node().node_rank == 1);
    CHECK(agent.node().num_nodes == 2);
  }
  SUBCASE("several nodes without an address is an error that says what to set") {
    CHECK(config_error_text([] {
            node_agent({"true"}, {.nnodes = 2, .node_rank = 0}, environment{});
          }) == "a job of 2 nodes needs the address of node 0: set MASTER_ADDR or --master-addr");
  }
  SUBCASE("a free port cannot be shared with other nodes") {
    CHECK_CONTAINS(config_error_text([] {
                     node_agent({"true"},
                                {.nnodes = 2, .node_rank = 1, .master_addr = "h", .master_port = 0},
                                environment{});
                   }),
                   "master_port 0 (a free port) works only on a single node");
  }
  SUBCASE("NODE_RANK and the option must agree") {
    CHECK_CONTAINS(config_error_text([] {
                     node_agent({"true"}, {.nnodes = 2, .node_rank = 0},
                                environment{{"NODE_RANK", "1"}, {"MASTER_ADDR", "h"}});
                   }),
                   "NODE_RANK=1");
  }
  SUBCASE("no command") {
    CHECK(config_error_text([] { node_agent({}, {}, environment{}); }) ==
          "node_agent: no worker command to run");
  }
}

namespace {

rank_report report(std::string node, std::optional<int> local_rank = {},
                   std::optional<int> local_size = {}, std::optional<int> node_rank = {},
                   std::optional<int> nodes = {}, std::optional<int> size = {}) {
  rank_report r;
  r.node_name = std::move(node);
  r.self.world_size = size;
  r.self.local_rank = local_rank;
  r.self.local_world_size = local_size;
  r.self.node_rank = node_rank;
  r.self.num_nodes = nodes;
  auto at = [](dtrain::world::field f) { return static_cast<std::size_t>(f); };
  if (local_rank)
    r.self.origins[at(dtrain::world::field::local_rank)] =
        "OMPI_COMM_WORLD_LOCAL_RANK=" + std::to_string(*local_rank);
  if (local_size)
    r.self.origins[at(dtrain::world::field::local_world_size)] =
        "OMPI_COMM_WORLD_LOCAL_SIZE=" + std::to_string(*local_size);
  if (size)
    r.self.origins[at(dtrain::world::field::world_size)] =
        "OMPI_COMM_WORLD_SIZE=" + std::to_string(*size);
  return r;
}

}  // namespace

TEST_CASE("placement: ranks are grouped by node name, nodes numbered by their lowest rank") {
  // `mpirun --map-by node` on hosts b and a: ranks alternate between them.
  std::vector<rank_report> reports{report("b"), report("a"), report("b"), report("a"), report("b")};
  auto placed = dtrain::place_ranks(reports);
  REQUIRE(placed.size() == 5);
  CHECK(placed[0] == placement{0, 2, 0, 3});
  CHECK(placed[1] == placement{1, 2, 0, 2});
  CHECK(placed[2] == placement{0, 2, 1, 3});
  CHECK(placed[3] == placement{1, 2, 1, 2});
  CHECK(placed[4] == placement{0, 2, 2, 3});
}

TEST_CASE("placement: fields the launcher gave must match the grouping") {
  std::vector<rank_report> ok{report("x", 0, 2), report("y", 0, 2), report("x", 1, 2),
                              report("y", 1, 2)};
  CHECK(dtrain::place_ranks(ok)[3] == placement{1, 2, 1, 2});
  // One host name for all (containers that share it): LOCAL_SIZE=2 contradicts 4 on one node.
  std::vector<rank_report> same{report("c", 0, 2), report("c", 1, 2), report("c", 0, 2),
                                report("c", 1, 2)};
  CHECK(config_error_text([&] { (void)dtrain::place_ranks(same); }) ==
        "rank 0: OMPI_COMM_WORLD_LOCAL_SIZE=2 gives local world size 2, but grouping the ranks by "
        "node name "
        "(\"c\", the host name unless DTRAIN_NODE_NAME is set) gives 4; give every node a distinct "
        "DTRAIN_NODE_NAME, or set NODE_RANK");
}

TEST_CASE("placement: complete reports are kept, even on one host (agents playing nodes)") {
  std::vector<rank_report> agents{report("h", 0, 2, 0, 2), report("h", 1, 2, 0, 2),
                                  report("h", 0, 2, 1, 2), report("h", 1, 2, 1, 2)};
  auto placed = dtrain::place_ranks(agents);
  CHECK(placed[2] == placement{1, 2, 0, 2});
}

TEST_CASE("placement: ranks that disagree about the world size are named") {
  std::vector<rank_report> reports{report("a", {}, {}, {}, {}, 2), report("a", {}, {}, {}, {}, 3)};
  CHECK(
      config_error_text([&] { (void)dtrain::place_ranks(reports); }) ==
      "rank 1 says the world has 3 ranks (OMPI_COMM_WORLD_SIZE=3), but 2 ranks met at rendezvous");
}

TEST_CASE("rank report: survives the store with its origins, and garbage is refused") {
  rank_report r = report("node:7 with spaces", 1, 4, {}, {}, 8);
  rank_report back = rank_report::decode(r.encode(), "key");
  CHECK(back.node_name == r.node_name);
  CHECK(back.self.local_rank == 1);
  CHECK(back.self.local_world_size == 4);
  CHECK_FALSE(back.self.node_rank);
  CHECK(back.self.world_size == 8);
  CHECK(back.self.origin(dtrain::world::field::local_world_size) == "OMPI_COMM_WORLD_LOCAL_SIZE=4");
  std::string bad_flag = r.encode();
  bad_flag[4 + r.node_name.size()] = 7;  // world_size's known flag
  for (const std::string& bad : std::vector<std::string>{
           "", "3:ab", "x:abc", "1:a", r.encode() + "0:", r.encode().substr(0, 20), bad_flag}) {
    CHECK_THROWS_WITH_AS((void)rank_report::decode(bad, "store key world/3"),
                         doctest::Contains("store key world/3 does not hold a rank report"),
                         dtrain::rendezvous_error);
  }
}

TEST_CASE("node name: DTRAIN_NODE_NAME overrides the host name") {
  CHECK(dtrain::node_name(environment{{"DTRAIN_NODE_NAME", "rack4-node2"}}) == "rack4-node2");
  CHECK_FALSE(dtrain::node_name(environment{}).empty());
}

TEST_CASE("placement table: survives the store, carries rank 0's error, and garbage is refused") {
  const std::vector<placement> table{{0, 2, 0, 2}, {1, 2, 0, 1}, {0, 2, 1, 2}};
  const std::string value = dtrain::encode_placements(table);
  for (int r = 0; r < 3; ++r) {
    CHECK(dtrain::decode_placement("store key world/placement", value, r, 3) ==
          table[static_cast<std::size_t>(r)]);
  }
  CHECK_THROWS_WITH_AS(
      (void)dtrain::decode_placement("k", dtrain::encode_placement_error("RANK=7 is bad"), 0, 3),
      "RANK=7 is bad", dtrain::config_error);
  CHECK_THROWS_WITH_AS(
      (void)dtrain::decode_placement("store key dtrain/job/world/placement", value, 0, 4),
      doctest::Contains("store key dtrain/job/world/placement does not hold a placement "
                        "table (101 bytes): it places 3 ranks, not 4"),
      dtrain::rendezvous_error);
  CHECK_THROWS_AS((void)dtrain::decode_placement("k", "ok 0,1,0,1", 0, 1),
                  dtrain::rendezvous_error);
}

TEST_CASE("agent protocol: failure and node records survive the store, garbage names its key") {
  using dtrain::detail::failure_record;
  using dtrain::detail::node_record;
  const failure_record f{127, true, "cannot run \"x\": no such file"};
  const failure_record back = failure_record::decode("k", f.encode());
  CHECK(back.status == 127);
  CHECK(back.final);
  CHECK(back.message == f.message);
  CHECK_THROWS_WITH_AS(
      (void)failure_record::decode("dtrain/agent/0/failure", "3 0 old format"),
      doctest::Contains("store key dtrain/agent/0/failure does not hold a failure record"),
      dtrain::rendezvous_error);
  const node_record n{4, 2, "host-a", 1234, "job-7", "10.0.0.2:41234", 3};
  const node_record m = node_record::decode("k", n.encode());
  CHECK(m.nproc == 4);
  CHECK(m.max_restarts == 2);
  CHECK(m.who() == "host-a:1234");
  CHECK(m.rdzv_id == "job-7");
  CHECK(m.buddy == "10.0.0.2:41234");
  CHECK(m.round == 3);
  CHECK_THROWS_WITH_AS(
      (void)node_record::decode("dtrain/agent/node/1",
                                node_record{4, 2, "host-a", 1234, "", "", -1}.encode()),
      doctest::Contains("store key dtrain/agent/node/1 does not hold a node agent's record"),
      dtrain::rendezvous_error);
  CHECK_THROWS_AS((void)node_record::decode("k", n.encode() + "!"), dtrain::rendezvous_error);
  CHECK(dtrain::detail::decode_port("k", dtrain::detail::encode_port(29500)) == 29500);
  CHECK_THROWS_WITH_AS((void)dtrain::detail::decode_port("dtrain/agent/0/worker_port",
                                                         dtrain::detail::wire::encode_int(70000)),
                       doctest::Contains("the port 70000 is not in 1..65535"),
                       dtrain::rendezvous_error);
  const auto a =
      dtrain::detail::store_address::decode(dtrain::detail::store_address{"h", 5}.encode());
  CHECK((a.host == "h" && a.port == 5));
  CHECK_THROWS_WITH_AS((void)dtrain::detail::store_address::decode("host 29500"),
                       doctest::Contains("rank 0's broadcast does not hold the store's address"),
                       dtrain::rendezvous_error);
  CHECK_THROWS_WITH_AS(
      (void)dtrain::detail::store_address::decode(dtrain::detail::store_address{"h", 0}.encode()),
      doctest::Contains("the port 0 is not in 1..65535"), dtrain::rendezvous_error);
}

namespace {

/// A relay between two threads in one process, as MPI's broadcast is between
/// two processes: rank 1 receives what rank 0 sends.
struct thread_relay {
  struct line {
    std::promise<std::string> sent;
    std::shared_future<std::string> received = sent.get_future().share();
  };
  std::shared_ptr<line> shared;
  int rank;
  void carry(std::string& message, const std::string&) {
    if (rank == 0) {
      shared->sent.set_value(message);
    } else {
      message = shared->received.get();
    }
  }
  [[nodiscard]] int root() const { return 0; }
  [[nodiscard]] bool is_root() const { return rank == 0; }
  [[nodiscard]] std::string where() const { return "rank 0's broadcast"; }
};

}  // namespace

TEST_CASE("store address: rank 0's failure to start the store reaches the others in its words") {
  // What context does without MASTER_ADDR, through the backend's pre-store channel.
  auto shared = std::make_shared<thread_relay::line>();
  std::string rank1;
  std::thread other([&] {
    try {
      (void)dtrain::detail::broadcast_or_fail(thread_relay{shared, 1}, "the store's address",
                                              [] { return std::string(); });
    } catch (const dtrain::rendezvous_error& e) {
      rank1 = e.what();
    }
  });
  CHECK_THROWS_WITH_AS(
      (void)dtrain::detail::broadcast_or_fail(thread_relay{shared, 0}, "the store's address",
                                              []() -> std::string {
                                                throw dtrain::config_error(
                                                    "cannot listen on 0.0.0.0:80: Permission "
                                                    "denied");
                                              }),
      "cannot listen on 0.0.0.0:80: Permission denied", dtrain::config_error);
  other.join();
  CHECK(rank1 ==
        "rank 0 could not provide the store's address: cannot listen on 0.0.0.0:80: Permission "
        "denied");
  // And when it serves, every rank learns where.
  auto next = std::make_shared<thread_relay::line>();
  std::string heard;
  std::thread listener([&] {
    heard = dtrain::detail::broadcast_or_fail(thread_relay{next, 1}, "the store's address",
                                              [] { return std::string(); });
  });
  (void)dtrain::detail::broadcast_or_fail(thread_relay{next, 0}, "the store's address", [] {
    return dtrain::detail::store_address{"node-a", 29500}.encode();
  });
  listener.join();
  const auto where = dtrain::detail::store_address::decode(heard);
  CHECK((where.host == "node-a" && where.port == 29500));
}

namespace {

using job_store = dtrain::prefix_store<dtrain::store_client>;

/// A rendezvous_wait of `rank` of `size` on `store`, whose reports land in `lines`.
dtrain::detail::rendezvous_wait<job_store> waiting(job_store& store, int rank, int size,
                                                   std::vector<std::string>& lines,
                                                   std::chrono::milliseconds timeout) {
  return {store,
          {.endpoint = "127.0.0.1:29541",
           .rank = rank,
           .size = size,
           .timeout = timeout,
           .interval = timeout / 20,
           .say = [&lines](std::string_view line) { lines.emplace_back(line); },
           .world_size_origin = "WORLD_SIZE=" + std::to_string(size)}};
}

/// A store and a connection to it under the job's prefix.
struct job_on_store {
  dtrain::store_server server{"127.0.0.1", 0, {.timeout = 30s, .log = [](std::string_view) {}}};
  dtrain::store_client client{"127.0.0.1", server.port(), {.timeout = 30s}};
  job_store job{client, "dtrain/job"};
};

}  // namespace

TEST_CASE("rendezvous: rank 0 says who has joined and who has not, then names who never came") {
  job_on_store store;
  auto& job = store.job;
  dtrain::store_client other_client("127.0.0.1", store.server.port(), {.timeout = 30s});
  job_store other(other_client, "dtrain/job");
  std::vector<std::string> lines, unused;
  // Ranks 0 and 2 of 4 join; 1 and 3 never do.
  auto rank0 = waiting(job, 0, 4, lines, 2s);
  rank0.join("report of rank 0");
  waiting(other, 2, 4, unused, 2s).join("report of rank 2");
  CHECK(rank0.progress() == "2 of 4 ranks joined; waiting for ranks 1, 3");
  try {
    rank0.await_everyone();
    FAIL("rank 0 stopped waiting while ranks 1 and 3 are missing");
  } catch (const dtrain::timeout_error& e) {
    CHECK(std::string(e.what()) ==
          "rendezvous at 127.0.0.1:29541 timed out after 2 s: 2 of 4 ranks joined; ranks 1, 3 "
          "never did. Likely causes: MASTER_ADDR or MASTER_PORT differ between ranks (this rank "
          "met at 127.0.0.1:29541), a firewall blocks that port, those ranks never started or "
          "failed before joining (see their output), or the world size (WORLD_SIZE=4) is larger "
          "than the number of ranks started");
  }
  REQUIRE(!lines.empty());  // every 0.1 s of 2 s
  CHECK(lines.front().starts_with(
      "rendezvous at 127.0.0.1:29541: 2 of 4 ranks joined; waiting for ranks 1, 3 ("));
  CHECK(lines.front().ends_with(" of 2 s)"));
  CHECK(unused.empty());
}

TEST_CASE(
    "rendezvous: the last rank to join ends rank 0's wait, and many missing ranks are counted") {
  job_on_store store;
  auto& job = store.job;
  std::vector<std::string> lines;
  auto rank0 = waiting(job, 0, 2000, lines, 30s);
  rank0.join("r0");
  for (int r : {1, 2, 3, 5, 7, 8, 9, 10, 11, 12}) waiting(job, r, 2000, lines, 30s).join("r");
  CHECK(rank0.progress() ==
        "11 of 2000 ranks joined; waiting for 1989 ranks, among them 4, 6, 13, 14, 15, 16, 17, 18");
  // The others join from another thread; rank 0 returns once the last has.
  std::thread rest([&] {
    dtrain::store_client mine("127.0.0.1", store.server.port(), {.timeout = 30s});
    job_store theirs(mine, "dtrain/job");
    std::vector<std::string> ignored;
    for (int r = 4; r < 2000; ++r) {
      if (r == 5 || (r >= 7 && r <= 12)) continue;
      waiting(theirs, r, 2000, ignored, 30s).join("r");
    }
  });
  rank0.await_everyone();
  rest.join();
  CHECK(rank0.progress() == "2000 of 2000 ranks joined");
}

TEST_CASE("rendezvous: a rank waiting for rank 0's answer is quiet while rank 0 has joined") {
  job_on_store store;
  auto& job = store.job;
  std::vector<std::string> lines;
  // Rank 0 has not joined: rank 1 says so, and names it at its timeout.
  auto rank1 = waiting(job, 1, 2, lines, 1s);
  rank1.join("r1");
  CHECK_THROWS_WITH_AS((void)rank1.await_answer("world/placement"),
                       doctest::Contains("1 of 2 ranks joined; rank 0 never did"),
                       dtrain::timeout_error);
  REQUIRE(!lines.empty());
  CHECK_CONTAINS(lines.front(), "1 of 2 ranks joined; waiting for rank 0 (");
  // Rank 0 joined but never answers: rank 1 says nothing until its timeout, which names rank 0.
  lines.clear();
  waiting(job, 0, 2, lines, 1s).join("r0");
  CHECK_THROWS_WITH_AS((void)rank1.await_answer("world/placement"),
                       "rendezvous at 127.0.0.1:29541 timed out after 1 s: every rank joined, but "
                       "rank 0 did not answer (store key \"world/placement\"); see rank 0's "
                       "output for why",
                       dtrain::timeout_error);
  CHECK(lines.empty());
  // An answer ends the wait.
  job.set("world/placement", "table");
  CHECK(rank1.await_answer("world/placement") == "table");
}

TEST_CASE("rendezvous: a progress interval of zero reports nothing, and the timeout still holds") {
  job_on_store store;
  std::vector<std::string> lines;
  dtrain::detail::rendezvous_wait<job_store> rank0(
      store.job, {.endpoint = "127.0.0.1:29541",
                  .rank = 0,
                  .size = 2,
                  .timeout = 300ms,
                  .interval = 0ms,
                  .say = [&lines](std::string_view line) { lines.emplace_back(line); },
                  .world_size_origin = "WORLD_SIZE=2"});
  rank0.join("r0");
  CHECK_THROWS_WITH_AS(rank0.await_everyone(), doctest::Contains("rank 1 never did"),
                       dtrain::timeout_error);
  CHECK(lines.empty());
  // Nor does a client that cannot connect.
  CHECK_THROWS_AS(dtrain::store_client(
                      "127.0.0.1", 1,
                      {.timeout = 300ms,
                       .progress_interval = 0ms,
                       .progress = [&lines](std::string_view line) { lines.emplace_back(line); }}),
                  dtrain::timeout_error);
  CHECK(lines.empty());
}

TEST_CASE("store client: while it cannot connect it says so every progress interval") {
  std::vector<std::string> lines;
  try {
    dtrain::store_client(
        "127.0.0.1", 1,
        {.timeout = 1s, .progress_interval = 100ms, .progress = [&lines](std::string_view line) {
           lines.emplace_back(line);
         }});
    FAIL("connected to port 1");
  } catch (const dtrain::timeout_error& e) {
    CHECK_CONTAINS(e.what(), "could not reach the store at 127.0.0.1:1 within 1.0 s");
    CHECK_CONTAINS(e.what(), "that MASTER_ADDR and MASTER_PORT are the same on every rank");
  }
  REQUIRE(!lines.empty());
  CHECK(lines.front().starts_with("still trying to connect to the store at 127.0.0.1:1 ("));
  CHECK(lines.front().ends_with(" of 1 s; last error: Connection refused)"));
}

TEST_CASE("agent protocol: a failure keeps its rank and collective, a clean exit its counts") {
  using dtrain::detail::exit_record;
  using dtrain::detail::failure_record;
  const failure_record f{1, false, "rank 0 (...) exited with status 1: timeout", 0, 42, "world"};
  const failure_record back = failure_record::decode("k", f.encode());
  CHECK(back.rank == 0);
  CHECK(back.collective == 42);
  CHECK(back.communicator == "world");
  const exit_record e{
      1, "rank 1 (node 0, local rank 1, pid 7)", {{"world", 2}, {"world/split 1", 41}}};
  const exit_record same = exit_record::decode("k", e.encode());
  CHECK(same.rank == 1);
  CHECK(same.label == e.label);
  CHECK(same.issued_on("world/split 1") == 41);
  CHECK(same.issued_on("world") == 2);
  CHECK(same.issued_on("world/split 2") == 0);
  CHECK_THROWS_WITH_AS((void)exit_record::decode("dtrain/agent/0/exited", "1 41"),
                       doctest::Contains("store key dtrain/agent/0/exited does not hold a "
                                         "worker's exit"),
                       dtrain::rendezvous_error);
  CHECK_THROWS_WITH_AS(
      (void)failure_record::decode("k", failure_record{1, false, "x", -2, 0, ""}.encode()),
      doctest::Contains("the rank -2 is not a rank or -1"), dtrain::rendezvous_error);
}

TEST_CASE("agent summary: a rank that exited well before its peers' collective is named first") {
  using dtrain::detail::describe_failure;
  using dtrain::detail::exit_record;
  using dtrain::detail::failure_record;
  const failure_record timeout{1,
                               false,
                               "rank 0 (node 0, local rank 0, pid 5) exited with status 1: "
                               "allreduce timed out",
                               0,
                               42,
                               "world"};
  const exit_record early{1, "rank 1 (node 0, local rank 1, pid 6)", {{"world", 41}}};
  CHECK(describe_failure(timeout, early) ==
        "rank 1 (node 0, local rank 1, pid 6) exited with status 0 after 41 collectives while "
        "rank 0 waited in collective #42; then rank 0 (node 0, local rank 0, pid 5) exited with "
        "status 1: allreduce timed out");
  CHECK_CONTAINS(describe_failure(timeout, exit_record{1, "rank 1", {{"world", 1}}}),
                 "rank 1 exited with status 0 after 1 collective while");
  // DDP's buckets travel on a split of the world: the counts of that communicator compare.
  failure_record on_split = timeout;
  on_split.communicator = "world/split 1 (color 0)";
  on_split.collective = 8;
  CHECK_CONTAINS(
      describe_failure(on_split,
                       exit_record{1, "rank 1", {{"world", 3}, {on_split.communicator, 7}}}),
      "rank 1 exited with status 0 after 7 collectives on communicator world/split 1 (color 0) "
      "while rank 0 waited in collective #8; then ");
  // Not its doing: no clean exit, one that got as far, the same rank, or a failure outside a
  // collective (a user's exception, an agent's record).
  CHECK(describe_failure(timeout, std::nullopt) == timeout.message);
  CHECK(describe_failure(timeout, exit_record{1, "rank 1", {{"world", 42}}}) == timeout.message);
  CHECK(describe_failure(timeout, exit_record{0, "rank 0", {{"world", 3}}}) == timeout.message);
  CHECK(describe_failure(failure_record{1, false, "threw", 0, 0, ""}, early) == "threw");
  CHECK(describe_failure(failure_record{137, true, "node 1's agent"}, early) == "node 1's agent");
}

namespace {

using dtrain::detail::agent_flags;
using sv_args = std::vector<std::string_view>;

}  // namespace

TEST_CASE("dtrun's flags: dtrun reads its flags, then the program after them") {
  auto flags = agent_flags::of_launcher(sv_args{
      "--nproc_per_node=4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "node0",
      "--master-port=29400", "--tee", "--max-restarts", "3", "--", "./train", "--tee", "x"});
  dtrain::agent_options o;
  flags.apply(o);
  CHECK(o.nproc_per_node == 4);
  CHECK(o.nnodes == 2);
  CHECK(o.node_rank == 1);
  CHECK(o.master_addr == "node0");
  CHECK(o.master_port == 29400);
  CHECK(o.tee);
  CHECK(o.max_restarts == 3);
  CHECK(flags.program() == std::vector<std::string>{"./train", "--tee", "x"});
  // The first argument that is not a flag starts the program; --standalone sets four options.
  flags = agent_flags::of_launcher(
      sv_args{"--standalone", "--grace-period", "0", "--no-python", "t.py", "--nnodes", "9"});
  CHECK(flags.program() == std::vector<std::string>{"t.py", "--nnodes", "9"});
  CHECK(flags.no_python());
  CHECK(flags.values().nnodes == 1);
  CHECK(flags.values().master_addr == "127.0.0.1");
  CHECK(flags.values().master_port == 0);
  CHECK(flags.values().grace_period == 0ms);
  CHECK(agent_flags::of_launcher(sv_args{"--log-dir", "d", "-h", "--nnodes=x"}).help());
  CHECK(config_error_text([] {
          (void)agent_flags::of_launcher(sv_args{"--nprocs", "2", "t"});
        }) == "unknown option --nprocs (see dtrun --help)");
  CHECK(config_error_text([] {
          (void)agent_flags::of_launcher(sv_args{"--tee=1", "t"});
        }) == "--tee=1 on the command line: --tee takes no value");
}

TEST_CASE("dtrun's flags: --nnodes MIN:MAX is an elastic job, as torchrun's") {
  dtrain::agent_options o;
  agent_flags::of_launcher(sv_args{"--nnodes", "1:4", "t"}).apply(o);
  CHECK(o.nnodes == 4);
  CHECK(o.min_nnodes == 1);
  // N, and N:N, are not elastic; the last --nnodes counts, range or not.
  agent_flags::of_launcher(sv_args{"--nnodes=1:3", "--nnodes", "2", "t"}).apply(o);
  CHECK(o.nnodes == 2);
  CHECK_FALSE(o.min_nnodes.has_value());
  agent_flags::of_launcher(sv_args{"--nnodes", "3:3", "t"}).apply(o);
  CHECK(o.nnodes == 3);
  CHECK_FALSE(o.min_nnodes.has_value());
  CHECK(config_error_text([] {
          (void)agent_flags::of_launcher(sv_args{"--nnodes=3:2", "t"});
        }) == "--nnodes=3:2 on the command line: MIN:MAX needs 1 <= MIN <= MAX (nodes; e.g. 1:4)");
  CHECK(config_error_text([] {
          (void)agent_flags::of_launcher(sv_args{"--nnodes=0:2", "t"});
        }) == "--nnodes=0:2 on the command line: MIN:MAX needs 1 <= MIN <= MAX (nodes; e.g. 1:4)");
  CHECK(config_error_text([] {
          (void)agent_flags::of_launcher(sv_args{"--nnodes=1:x", "t"});
        }).find("--nnodes=1:x on the command line (MAX)") == 0);
  // The environment's DTRAIN_NNODES takes the same forms.
  const auto from_env = dtrain::agent_options{}.with_env({{"DTRAIN_NNODES", "2:5"}});
  CHECK(from_env.nnodes == 5);
  CHECK(from_env.min_nnodes == 2);
  CHECK(config_error_text([] {
          (void)dtrain::agent_options{}.with_env({{"DTRAIN_NNODES", "5:2"}});
        }) == "DTRAIN_NNODES=5:2: MIN:MAX needs 1 <= MIN <= MAX (nodes; e.g. 1:4)");
  CHECK(config_error_text([] { dtrain::agent_options{.nnodes = 2, .min_nnodes = 3}.check(); }) ==
        "option min_nnodes=3 is more than nnodes=2");
}

TEST_CASE("elastic rounds: the members and a regroup travel through the store intact") {
  using dtrain::detail::decode_members;
  using dtrain::detail::encode_members;
  using dtrain::detail::failure_record;
  CHECK(decode_members("k", encode_members({0, 2, 3}), 4) == std::vector<int>{0, 2, 3});
  CHECK(decode_members("k", encode_members({}), 4).empty());  // a round passed over
  // Out of range, not ascending, or more than nnodes: refused, naming the key.
  for (const std::vector<int>& bad : {std::vector<int>{0, 4}, std::vector<int>{1, 0},
                                      std::vector<int>{0, 1, 2, 3, 3}, std::vector<int>{2, 2}}) {
    CHECK_THROWS_WITH_AS((void)decode_members("dtrain/agent/3/members", encode_members(bad), 4),
                         doctest::Contains("store key dtrain/agent/3/members"),
                         dtrain::rendezvous_error);
  }
  failure_record regroup{0, false, "a node is ready to join"};
  regroup.regroup = true;
  const failure_record back = failure_record::decode("k", regroup.encode());
  CHECK(back.regroup);
  CHECK_FALSE(back.final);
  CHECK(back.status == 0);
  CHECK_FALSE(failure_record::decode("k", failure_record{1, true, "x"}.encode()).regroup);
}

TEST_CASE("dtrun's flags: a self-launching program's own arguments pass, dtrun's are read") {
  const auto flags = agent_flags::of_program(
      sv_args{"--epochs", "3", "--master-port", "29501", "data/", "--max_restarts=2", "--help",
              "--no-python", "--nproc-per-node", "2", "--nproc-per-node=3", "--", "--nnodes", "x"});
  CHECK(flags.values().master_port == 29501);
  CHECK(flags.values().max_restarts == 2);
  CHECK(flags.values().nproc_per_node == 3);                      // the last one counts
  CHECK_FALSE(flags.given(dtrain::detail::agent_field::nnodes));  // after `--`
  CHECK_FALSE(flags.help());                                      // the program's
  CHECK_FALSE(flags.no_python());
  CHECK(flags.program().empty());
  CHECK(config_error_text([] {
          (void)agent_flags::of_program(sv_args{"--lr", "0.1", "--master-port", "70000"});
        }) == "--master-port=70000 on the command line is outside the port range 1-65535");
  CHECK(config_error_text([] { (void)agent_flags::of_program(sv_args{"--nnodes=0"}); }) ==
        "--nnodes=0 on the command line must be at least 1 (nodes)");
  CHECK(config_error_text([] {
          (void)agent_flags::of_program(sv_args{"--max-restarts", "-1"});
        }) ==
        "--max-restarts=-1 on the command line is negative: ranks, sizes and indices count from 0");
  CHECK(config_error_text([] { (void)agent_flags::of_program(sv_args{"--master-addr="}); }) ==
        "--master-addr= on the command line is empty");
  CHECK(config_error_text([] { (void)agent_flags::of_program(sv_args{"--log-dir"}); }) ==
        "--log-dir on the command line needs a value (a directory, e.g. --log-dir logs)");
  CHECK(config_error_text([] {
          (void)agent_flags::of_program(sv_args{"--heartbeat-timeout", "0"});
        }) == "--heartbeat-timeout=0 on the command line must be at least 1 (seconds)");
}

TEST_CASE("dtrun's flags: dtrun's win over what is set, a program's code wins over its flags") {
  const auto flags = agent_flags::of_program(
      sv_args{"--nproc-per-node", "2", "--max-restarts", "1", "--grace-period", "3", "--tee"});
  dtrain::agent_options coded{.nproc_per_node = 4, .grace_period = 5s};
  dtrain::agent_options filled = coded;
  flags.fill(filled);
  CHECK(filled.nproc_per_node == 4);  // set in the code
  CHECK(filled.grace_period == 5s);   // set in the code (not the default)
  CHECK(filled.max_restarts == 1);    // left at the default
  CHECK(filled.tee);
  CHECK_FALSE(filled.nnodes);  // no flag
  dtrain::agent_options applied = coded;
  flags.apply(applied);
  CHECK(applied.nproc_per_node == 2);
  CHECK(applied.grace_period == 3s);
}

namespace {

// A store served here, and node 0's agent side of it, for rounds run in this process.
struct one_node_store {
  dtrain::store_options options{.timeout = 20s, .token = "unit-test-agent-round"};
  dtrain::detail::agent_store store{0, 1, "127.0.0.1", "127.0.0.1", 0, options};
};

dtrain::detail::round_settings settings_of(int nproc) {
  return {.restart = 0,
          .node_rank = 0,
          .nnodes = 1,
          .nproc = nproc,
          .tee = false,
          .log_dir = {},
          .grace_period = 2s,
          .heartbeat_timeout = 10s};
}

dtrain::detail::worker_start shell(int rank, std::string script) {
  dtrain::detail::worker_start w;
  w.rank = rank;
  w.local_rank = rank;
  w.command.argv = {"/bin/sh", "-c", std::move(script)};
  w.command.env = {"PATH=/usr/bin:/bin"};
  return w;
}

bool alive(pid_t pid) { return ::kill(pid, 0) == 0; }

/// What `join` throws while `holder` beats node 1's heartbeat, as a running agent does.
std::string refused_while_beating(dtrain::detail::agent_store& holder,
                                  const std::function<void()>& join) {
  std::atomic<bool> beating = true;
  std::thread heart([&] {
    while (beating) {
      holder.client().add(dtrain::detail::agent_keys::beat(1), 1);
      std::this_thread::sleep_for(20ms);
    }
  });
  std::string text = config_error_text(join);
  beating = false;
  heart.join();
  return text;
}

}  // namespace

TEST_CASE("elastic join: a node's place goes to an agent that comes back, not to a second one") {
  using dtrain::detail::agent_keys;
  using dtrain::detail::agent_store;
  using dtrain::detail::node_record;
  const dtrain::store_options options{.timeout = 20s, .token = "unit-test-elastic-join"};
  agent_store node0{0, 2, "127.0.0.1", "127.0.0.1", 0, options};
  node0.join_elastic({2, 1, "host-0", 100});
  const node_record first{2, 1, "host-1", 200}, second{2, 1, "host-1b", 300};
  {
    agent_store a{1, 2, "127.0.0.1", "127.0.0.1", node0.port(), options};
    a.join_elastic(first);  // the first to ask: no wait
    // While `a` beats (as it does waiting or in a round), its place is taken.
    agent_store b{1, 2, "127.0.0.1", "127.0.0.1", node0.port(), options};
    CHECK(refused_while_beating(a, [&] { b.join_elastic(second, 300ms); }) ==
          "node_rank 1 is held by the agent host-1:200, which is running, and this one "
          "(host-1b:300) asks for it too; give each agent its own --node-rank / NODE_RANK");
  }
  // Silent now (its agent is gone): an agent of node 1 that comes back takes the place.
  agent_store back{1, 2, "127.0.0.1", "127.0.0.1", node0.port(), options};
  back.join_elastic(second, 300ms);
  CHECK(node_record::decode("k", back.client().get(agent_keys::node(1))).pid == 300);
  // Another shape than node 0's is refused by name, and takes no place.
  agent_store odd{1, 2, "127.0.0.1", "127.0.0.1", node0.port(), options};
  CHECK(config_error_text([&] {
          odd.join_elastic({4, 1, "host-1c", 400}, 100ms);
        })
            .find("node 0 (host-0:100) runs 2 workers, this node 4; every node must run the "
                  "same nproc_per_node") != std::string::npos);
  CHECK(node_record::decode("k", back.client().get(agent_keys::node(1))).pid == 300);
}

TEST_CASE(
    "elastic rounds: an agent back from a lost store raises the round, node 0 forms the next") {
  using dtrain::detail::agent_keys;
  using dtrain::detail::agent_store;
  using dtrain::detail::decode_members;
  const dtrain::store_options options{.timeout = 20s, .token = "unit-test-elastic-new-store"};
  // A new node 0's store: it knows no round, and waits for 2 nodes in round 0.
  agent_store node0{0, 2, "127.0.0.1", "127.0.0.1", 0, options};
  node0.join_elastic({1, 1, "host-0b", 100});
  CHECK(node0.first_round() == 0);
  int round0 = node0.first_round();
  std::vector<int> members0;
  std::thread forming([&] { members0 = node0.form_round(round0, 2, 2s); });
  // Node 1's agent comes back from round 1: the rounds go on from there.
  agent_store node1{1, 2, "127.0.0.1", "127.0.0.1", node0.port(), options};
  node1.join_elastic({1, 1, "host-1", 200, "", "", 2});
  CHECK(node1.first_round() == 2);
  node1.raise_round(0);  // never lowered
  CHECK(node1.first_round() == 2);
  int round1 = node1.first_round();
  const std::vector<int> members1 = node1.form_round(round1, 2, 2s);
  forming.join();
  CHECK(round0 == 2);
  CHECK(round1 == 2);
  CHECK(members0 == std::vector<int>{0, 1});
  CHECK(members1 == std::vector<int>{0, 1});
  // Round 0 was passed over: a node that waited for it finds no members.
  const std::string passed = agent_keys::members(0);
  CHECK(decode_members(passed, node1.client().get(passed), 2).empty());
  CHECK(node0.first_round() == 3);
}

TEST_CASE("fixed join: agents that come back to a new node 0's store go on with their next round") {
  using dtrain::detail::agent_store;
  const dtrain::store_options options{.timeout = 20s, .token = "unit-test-new-store"};
  std::optional<agent_store> node0(std::in_place, 0, 3, "127.0.0.1", "127.0.0.1", 0, options);
  const int port = node0->port();
  {
    // A new job: every record comes into round 0.
    agent_store node1{1, 3, "127.0.0.1", "127.0.0.1", port, options};
    agent_store node2{2, 3, "127.0.0.1", "127.0.0.1", port, options};
    std::thread join1([&] { node1.join({1, 2, "host-1", 200}); });
    std::thread join2([&] { node2.join({1, 2, "host-2", 300}); });
    node0->join({1, 2, "host-0", 100});
    join1.join();
    join2.join();
    CHECK(node0->resume_round() == 0);
    CHECK(node1.resume_round() == 0);
    const std::uint64_t old = node1.client().instance();
    // Node 0's agent is gone with its store, and a new one serves a store at
    // the same address: another instance, which the old clients do not join.
    node0.reset();
    CHECK_THROWS_AS(node1.client().ping(), dtrain::rendezvous_error);
    node0.emplace(0, 3, "127.0.0.1", "127.0.0.1", port, options);
    CHECK(node0->client().instance() != old);
  }
  // Nodes 1 and 2 come back from round 1 (the new node 0 knows no round):
  // every agent goes on with round 2.
  agent_store node1{1, 3, "127.0.0.1", "127.0.0.1", port, options};
  agent_store node2{2, 3, "127.0.0.1", "127.0.0.1", port, options};
  std::thread join1([&] { node1.join({1, 2, "host-1", 200, "", "", 2}); });
  std::thread join2([&] { node2.join({1, 2, "host-2", 300, "", "", 2}); });
  node0->join({1, 2, "host-0b", 400});
  join1.join();
  join2.join();
  CHECK(node0->resume_round() == 2);
  CHECK(node1.resume_round() == 2);
  CHECK(node2.resume_round() == 2);
  CHECK_FALSE(node0->replacing());
}

TEST_CASE(
    "fixed join: a replacement takes the place of an agent that is gone, not of one that runs") {
  using dtrain::detail::agent_keys;
  using dtrain::detail::agent_store;
  using dtrain::detail::node_record;
  const dtrain::store_options options{.timeout = 20s, .token = "unit-test-fixed-join"};
  agent_store node0{0, 2, "127.0.0.1", "127.0.0.1", 0, options};
  std::thread join0([&] { node0.join({2, 1, "host-0", 100}); });
  const node_record first{2, 1, "host-1", 200}, second{2, 1, "host-1b", 300};
  {
    agent_store a{1, 2, "127.0.0.1", "127.0.0.1", node0.port(), options};
    a.join(first);
    join0.join();
    CHECK_FALSE(a.replacing());
    CHECK_FALSE(node0.replacing());
    agent_store b{1, 2, "127.0.0.1", "127.0.0.1", node0.port(), options};
    CHECK(refused_while_beating(a, [&] { b.join(second, 300ms); }) ==
          "node_rank 1 is held by the agent host-1:200, which is running, and this one "
          "(host-1b:300) asks for it too; give each agent its own --node-rank / NODE_RANK");
  }
  // `a`'s connection closed (its agent was killed): its lease is gone, and an
  // agent started with its node rank takes the place at once, without a new join round.
  for (int i = 0; i < 500 && node0.gone_nodes({0, 1}).empty(); ++i)
    std::this_thread::sleep_for(10ms);  // the store sees the connection close
  CHECK(node0.gone_nodes({0, 1}) == std::vector<int>{1});
  agent_store replacement{1, 2, "127.0.0.1", "127.0.0.1", node0.port(), options};
  replacement.join(second, 300ms);
  CHECK(replacement.replacing());
  CHECK(node_record::decode("k", replacement.client().get(agent_keys::node(1))).pid == 300);
  CHECK(node0.gone_nodes({0, 1}).empty());
}

TEST_CASE(
    "fixed join: an agent whose place was taken while it was silent is told so, and leaves the "
    "place to the other") {
  using dtrain::detail::agent_keys;
  using dtrain::detail::agent_store;
  using dtrain::detail::node_record;
  const dtrain::store_options options{.timeout = 20s, .token = "unit-test-frozen-agent"};
  agent_store node0{0, 2, "127.0.0.1", "127.0.0.1", 0, options};
  std::thread join0([&] { node0.join({2, 1, "host-0", 100}); });
  std::optional<agent_store> frozen(std::in_place, 1, 2, "127.0.0.1", "127.0.0.1", node0.port(),
                                    options);
  frozen->join({2, 1, "host-1", 200});
  join0.join();
  frozen->check_place();  // its own
  // It does not beat (frozen, its connection open): a replacement takes the place.
  agent_store replacement{1, 2, "127.0.0.1", "127.0.0.1", node0.port(), options};
  replacement.join({2, 1, "host-1b", 300}, 300ms);
  CHECK(replacement.replacing());
  replacement.check_place();
  node0.check_place();
  std::string told;
  try {
    frozen->check_place();  // it wakes up
  } catch (const dtrain::detail::agent_replaced& e) {
    told = e.what();
  }
  CHECK(told ==
        "node 1's place was taken by the agent host-1b:300 while this agent (host-1:200) did not "
        "respond (frozen, or cut off from the store): the job goes on with that agent, and this "
        "one stops its workers and leaves");
  // Its connection closes: the replacement's lease stays, node 1 is not gone.
  frozen.reset();
  std::this_thread::sleep_for(200ms);
  CHECK(node0.gone_nodes({0, 1}).empty());
  CHECK(node_record::decode("k", node0.client().get(agent_keys::alive(1))).pid == 300);
}

TEST_CASE("agent round: starting, running, ended, and how it ended") {
  using state = dtrain::detail::agent_round::state;
  one_node_store s;
  SUBCASE("a worker fails: the others are stopped, the round names it") {
    dtrain::detail::agent_round round(settings_of(2));
    CHECK(round.current() == state::starting);
    round.start({shell(0, "exec sleep 30"), shell(1, "exit 3")});
    CHECK(round.current() == state::running);
    const auto end = round.supervise(s.store);
    CHECK(round.current() == state::ended);
    CHECK_FALSE(end.succeeded);
    CHECK(end.status == 3);
    CHECK_FALSE(end.final);
    CHECK_CONTAINS(end.message, "rank 1 (node 0, local rank 1, pid ");
    CHECK_CONTAINS(end.message, ") exited with status 3");
    for (const auto& w : round.workers()) CHECK_FALSE(alive(w.pid));
  }
  SUBCASE("every worker succeeds") {
    dtrain::detail::agent_round round(settings_of(2));
    round.start({shell(0, "true"), shell(1, "true")});
    const auto end = round.supervise(s.store);
    CHECK(end.succeeded);
    CHECK(end.status == 0);
    CHECK(round.current() == state::ended);
  }
}

TEST_CASE("agent round: one destroyed before it ended stops what it started, once") {
  one_node_store s;
  pid_t started = -1;
  {
    dtrain::detail::agent_round round(settings_of(2));
    dtrain::detail::worker_start missing = shell(1, "");
    missing.command.argv = {"/nonexistent/program"};
    CHECK_THROWS_AS(round.start({shell(0, "exec sleep 30"), missing}), dtrain::program_error);
    REQUIRE(round.workers().size() == 1);
    started = round.workers()[0].pid;
    CHECK(alive(started));
    CHECK(round.current() == dtrain::detail::agent_round::state::starting);
  }
  CHECK_FALSE(alive(started));  // stopped and reaped: not even a zombie
}
