// dtrain_doctor's host inspection and checks (dtrain/doctor/), which
// dtrain.hpp does not include: what the network report reads from a sysfs
// tree, which interface each engine would use, and the doctor's traps. Part of
// dtrain_unit (its cases are unit.network: and unit.doctor:), not of the
// single-header build, which has no doctor.
#include "../unit/support.hpp"

#include <dtrain/doctor/diagnose.hpp>
#include <dtrain/doctor/network.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

dtrain::host_network sample_host() {
  dtrain::host_network h;
  h.interfaces = {{"lo", "unknown", {"127.0.0.1"}, 65536, -1, true},
                  {"eth0", "up", {"10.1.0.4"}, 1500, 25000, false},
                  {"docker0", "up", {"172.17.0.1"}, 1500, -1, false},
                  {"ib0", "up", {"192.168.50.4"}, 2044, 200000, false}};
  h.rdma = {{"mlx5_0", 1, "ACTIVE", "LinkUp", "200 Gb/sec (4X HDR)", "InfiniBand"}};
  h.nvidia_gpus = 4;
  return h;
}

}  // namespace

TEST_CASE("network: each engine's interface by its own rules and variables") {
  const dtrain::host_network h = sample_host();
  auto nccl = dtrain::nccl_interface(h, {});
  CHECK(nccl.choice == "ib0");  // NCCL prefers ib* by default
  CHECK(nccl.why.find("data over RDMA (NET/IB) on mlx5_0:1") != std::string::npos);
  nccl = dtrain::nccl_interface(h, {{"NCCL_SOCKET_IFNAME", "eth"}, {"NCCL_IB_DISABLE", "1"}});
  CHECK(nccl.choice == "eth0");
  CHECK(nccl.why == "NCCL_SOCKET_IFNAME=eth; data over TCP sockets (NCCL_IB_DISABLE=1)");
  CHECK(dtrain::nccl_interface(h, {{"NCCL_SOCKET_IFNAME", "^docker,lo"}}).choice == "eth0, ib0");
  CHECK(dtrain::nccl_interface(h, {{"NCCL_SOCKET_IFNAME", "=eth"}}).missing ==
        std::vector<std::string>{"eth"});
  CHECK(dtrain::nccl_interface(h, {{"NCCL_SOCKET_IFNAME", "enp,eth"}}).missing ==
        std::vector<std::string>{"enp"});

  auto gloo = dtrain::gloo_interface(h, {{"MASTER_ADDR", "node1"}}, "10.1.0.4");
  CHECK(gloo.choice == "eth0");
  CHECK(gloo.why == "the interface whose address reaches MASTER_ADDR=node1 (10.1.0.4)");
  gloo = dtrain::gloo_interface(h, {{"GLOO_SOCKET_IFNAME", "eth7,eth0"}}, "");
  CHECK(gloo.choice == "eth7");
  CHECK(gloo.missing == std::vector<std::string>{"eth7"});

  auto mpi = dtrain::mpi_interface(h, {});
  CHECK(mpi.choice == "eth0, docker0, ib0");
  CHECK(mpi.why.find("UCX") != std::string::npos);
  mpi = dtrain::mpi_interface(h, {{"OMPI_MCA_btl_tcp_if_include", "eth1,10.1.0.0/16"}});
  CHECK(mpi.missing == std::vector<std::string>{"eth1"});
}

TEST_CASE("network: interfaces, RDMA ports and GPUs are read from a sysfs tree") {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("dtrain-sysfs-" + std::to_string(::getpid()));
  auto write = [&](const fs::path& file, const std::string& text) {
    fs::create_directories((root / file).parent_path());
    std::ofstream(root / file) << text << "\n";
  };
  write("class/net/lo/operstate", "unknown");
  write("class/net/lo/type", "772");
  write("class/net/eth0/operstate", "up");
  write("class/net/eth0/mtu", "9000");
  write("class/net/eth0/speed", "100000");
  write("class/net/eth0/type", "1");
  write("class/infiniband/mlx5_1/ports/1/state", "1: DOWN");
  write("class/infiniband/mlx5_1/ports/1/phys_state", "3: Disabled");
  write("class/infiniband/mlx5_1/ports/1/rate", "10 Gb/sec (4X SDR)");
  write("class/infiniband/mlx5_1/ports/1/link_layer", "Ethernet");
  write("bus/pci/devices/0000:17:00.0/vendor", "0x10de");
  write("bus/pci/devices/0000:17:00.0/class", "0x030200");
  write("bus/pci/devices/0000:17:00.1/vendor", "0x10de");
  write("bus/pci/devices/0000:17:00.1/class", "0x040300");  // the GPU's audio function
  write("bus/pci/devices/0000:00:1f.0/vendor", "0x8086");
  write("bus/pci/devices/0000:00:1f.0/class", "0x030000");
  write("module/nvidia/version", "580.159.04");
  const dtrain::host_network h = dtrain::read_host_network(root.string(), false);
  fs::remove_all(root);
  REQUIRE(h.interfaces.size() == 2);
  CHECK(h.interfaces[0].name == "eth0");
  CHECK(h.interfaces[0].up());
  CHECK(h.interfaces[0].mtu == 9000);
  CHECK(h.interfaces[0].speed_mbps == 100000);
  CHECK(h.interfaces[1].loopback);
  REQUIRE(h.rdma.size() == 1);
  CHECK(h.rdma[0].device == "mlx5_1");
  CHECK(h.rdma[0].state == "DOWN");
  CHECK(h.rdma[0].phys_state == "Disabled");
  CHECK(h.rdma[0].link_layer == "Ethernet");
  CHECK_FALSE(h.rdma_active());
  CHECK(h.nvidia_gpus == 1);
  CHECK(h.nvidia_driver == "580.159.04");
}

namespace {

dtrain::doctor_facts launched_facts(dtrain::environment env) {
  dtrain::doctor_facts f;
  f.env = env;
  f.self = dtrain_test::discover(env);
  f.host = sample_host();
  f.host_name = "node1";
  f.host_addresses.addresses = {"10.1.0.4"};
  return f;
}

bool has(const std::vector<dtrain::doctor_finding>& found, const std::string& text) {
  for (const auto& f : found) {
    if ((f.problem + " / " + f.fix).find(text) != std::string::npos) return true;
  }
  return false;
}

const dtrain::environment two_nodes{{"RANK", "0"},
                                    {"WORLD_SIZE", "8"},
                                    {"LOCAL_RANK", "0"},
                                    {"LOCAL_WORLD_SIZE", "4"},
                                    {"GROUP_RANK", "0"},
                                    {"GROUP_WORLD_SIZE", "2"},
                                    {"MASTER_ADDR", "node1"},
                                    {"MASTER_PORT", "29500"}};

}  // namespace

TEST_CASE("doctor: a healthy node of a two-node job has no finding") {
  auto f = launched_facts(two_nodes);
  f.master_addresses = dtrain::detail::resolved{{"10.1.0.4"}, {}};
  CHECK(dtrain::diagnose(f).empty());
}

TEST_CASE("doctor: each known trap, with the setting that fixes it") {
  SUBCASE("the host name on 127.0.1.1") {
    auto f = launched_facts(two_nodes);
    f.host_addresses.addresses = {"127.0.1.1"};
    const auto found = dtrain::diagnose(f);
    REQUIRE(found.size() == 1);
    CHECK(has(found, "the host name node1 resolves to 127.0.1.1"));
    CHECK(has(found, "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME"));
    // A single-node job under a launcher never leaves the machine: no finding.
    auto single = launched_facts({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"}});
    single.host_addresses.addresses = {"127.0.1.1"};
    CHECK(dtrain::diagnose(single).empty());
  }
  SUBCASE("MASTER_ADDR on loopback, or unresolvable") {
    auto f = launched_facts(two_nodes);
    f.master_addresses = dtrain::detail::resolved{{"127.0.0.1"}, {}};
    CHECK(has(dtrain::diagnose(f),
              "MASTER_ADDR=node1 resolves to 127.0.0.1 (loopback) in a job of several nodes"));
    f.master_addresses = dtrain::detail::resolved{{}, "Name or service not known"};
    CHECK(has(dtrain::diagnose(f),
              "MASTER_ADDR=node1 cannot be resolved (Name or service not known)"));
  }
  SUBCASE("NCCL_IB_DISABLE with an active InfiniBand port") {
    auto env = two_nodes;
    env = env.with("NCCL_IB_DISABLE", "1");
    const auto found = dtrain::diagnose(launched_facts(env));
    CHECK(has(found,
              "NCCL_IB_DISABLE=1 while RDMA ports are active (mlx5_0:1 (InfiniBand, 200 Gb/sec (4X "
              "HDR)))"));
    CHECK(has(found, "unset NCCL_IB_DISABLE"));
  }
  SUBCASE("an interface variable naming a missing interface") {
    auto env = two_nodes;
    env = env.with("NCCL_SOCKET_IFNAME", "enp5s0");
    env = env.with("GLOO_SOCKET_IFNAME", "bond0");
    const auto found = dtrain::diagnose(launched_facts(env));
    CHECK(has(found,
              "NCCL_SOCKET_IFNAME=enp5s0 names enp5s0, which this host does not have (interfaces: "
              "lo, eth0, docker0, ib0)"));
    CHECK(has(found, "GLOO_SOCKET_IFNAME=bond0 names bond0"));
  }
  SUBCASE("fewer visible GPUs than local ranks") {
    auto f = launched_facts(two_nodes);
    f.visible_gpus = 2;
    CHECK(has(dtrain::diagnose(f), "4 ranks on this node but 2 visible GPUs"));
    f.visible_gpus = -1;  // CUDA cannot say: the bus has 4, CUDA_VISIBLE_DEVICES lists 3
    f.env = f.env.with("CUDA_VISIBLE_DEVICES", "0,1,2");
    CHECK(has(dtrain::diagnose(f), "4 ranks on this node but 3 visible GPUs"));
    f.env = f.env.with("CUDA_VISIBLE_DEVICES", "0,1,2,3");
    CHECK(dtrain::diagnose(f).empty());
  }
  SUBCASE("RDMA devices without an active port") {
    auto f = launched_facts(two_nodes);
    f.host.rdma[0].state = "DOWN";
    f.host.rdma[0].phys_state = "Polling";
    CHECK(has(dtrain::diagnose(f), "no port is ACTIVE (mlx5_0:1 DOWN/Polling)"));
  }
  SUBCASE("an inconsistent launcher environment") {
    dtrain::doctor_facts f;
    f.world_error = "RANK=7 is not below WORLD_SIZE=4";
    f.host = sample_host();
    CHECK(has(dtrain::diagnose(f), "RANK=7 is not below WORLD_SIZE=4"));
  }
}
