// dtrain_doctor: what to run on a node when a multi-node job will not start
// or is slow. It prints the world this process sees and the launcher it came
// from, the GPUs with the CUDA and NCCL versions, the RDMA / InfiniBand ports
// and their state, the network interfaces and the one Gloo, NCCL and Open MPI
// would use, whether MPI is CUDA-aware, and then every known trap it finds,
// each with the setting that fixes it.
//
//   dtrain_doctor                      on a node, or under the job's launcher:
//   mpirun -np 8 --hostfile H dtrain_doctor
//   dtrun --nnodes 2 --node-rank 0 --master-addr node1 --nproc-per-node 4 -- dtrain_doctor
//   dtrain_doctor --sysfs DIR          read interfaces, RDMA ports and GPUs under DIR
//                                      instead of /sys (DTRAIN_SYSFS_ROOT, too): a
//                                      captured tree, or a test's
//
// Exit status: 0 when no trap was found, 1 when some were (each printed with
// its fix), 2 for bad arguments.

#include <dtrain/doctor/diagnose.hpp>
#include <dtrain/doctor/network.hpp>
#include <dtrain/dtrain.hpp>

#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#if DTRAIN_HAS_CUDA()
#include <cuda_runtime.h>
#endif
#if DTRAIN_HAS_NCCL()
#include <nccl.h>
#endif

namespace {

[[maybe_unused]] std::string version_text(int v) {  // CUDA's 13000 -> 13.0
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

// What CUDA says about the GPUs: lines to print, and the count (-1: unknown).
int cuda_report(std::vector<std::string>& lines) {
#if DTRAIN_HAS_CUDA()
  int runtime = 0, driver = 0;
  (void)cudaRuntimeGetVersion(&runtime);
  (void)cudaDriverGetVersion(&driver);
  lines.push_back(
      "CUDA runtime " + version_text(runtime) + ", driver " +
      (driver > 0 ? "supports CUDA " + version_text(driver) : std::string("not loaded")));
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    lines.push_back(std::string("no usable GPU: cudaGetDeviceCount: ") + cudaGetErrorString(e));
    (void)cudaGetLastError();
    return -1;
  }
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, d) != cudaSuccess) continue;
    char bus[32];
    std::snprintf(bus, sizeof bus, "%04x:%02x:%02x", p.pciDomainID, p.pciBusID, p.pciDeviceID);
    lines.push_back("GPU " + std::to_string(d) + ": " + p.name + ", " +
                    std::to_string(p.totalGlobalMem >> 20) + " MiB, compute capability " +
                    std::to_string(p.major) + "." + std::to_string(p.minor) + ", PCI " + bus);
  }
  return count;
#else
  lines.push_back("CUDA: not compiled in (this build has no CUDA toolkit)");
  return -1;
#endif
}

std::string nccl_version() {
#if DTRAIN_HAS_NCCL()
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "NCCL: ncclGetVersion failed";
  return "NCCL " + std::to_string(v / 10000) + "." + std::to_string((v / 100) % 100) + "." +
         std::to_string(v % 100) + " (library), built against " + std::to_string(NCCL_MAJOR) + "." +
         std::to_string(NCCL_MINOR) + "." + std::to_string(NCCL_PATCH);
#else
  return "NCCL: not compiled in";
#endif
}

std::string mpi_report() {
#if DTRAIN_HAS_MPI()
  char version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int length = 0;
  MPI_Get_library_version(version, &length);
  std::string text(version, static_cast<std::size_t>(length));
  text = text.substr(0, text.find_first_of(",\n"));
  return text + "; CUDA-aware: " +
         (dtrain::mpi_environment::cuda_aware()
              ? "yes (MPIX_Query_cuda_support)"
              : "no (device buffers are staged through pinned host memory)");
#else
  return "not compiled in";
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const auto env = dtrain::environment::from_process();
  std::string sysfs = std::string(env.get("DTRAIN_SYSFS_ROOT").value_or("/sys"));
  std::vector<std::string_view> rest;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("usage: dtrain_doctor [--sysfs DIR]\n");
      return 0;
    }
    if (a == "--sysfs") {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "dtrain_doctor: --sysfs needs a directory\n");
        return 2;
      }
      sysfs = argv[++i];
    } else {
      rest.push_back(a);  // a launcher's own arguments (--local_rank=N)
    }
  }
  dtrain::doctor_facts f;
  f.env = env;
  try {
    f.self = dtrain::discover_world(env, rest);
  } catch (const dtrain::config_error& e) {
    f.world_error = e.what();
  }
  const bool live = sysfs == "/sys";
  f.host = dtrain::read_host_network(sysfs, live);
  f.host_name = dtrain::detail::host_name().value_or("?");
  f.host_addresses = dtrain::detail::resolve(f.host_name);
  if (auto master = env.get("MASTER_ADDR"); master && !master->empty()) {
    f.master_addresses = dtrain::detail::resolve(std::string(*master));
    int port = 0;
    if (auto p = env.get("MASTER_PORT")) port = std::atoi(std::string(*p).c_str());
    f.route_to_master = dtrain::detail::local_address_to(std::string(*master), port).address;
  }
  std::vector<std::string> gpu_lines;
  f.visible_gpus = cuda_report(gpu_lines);

  const bool launched = f.self && f.self->source != dtrain::launcher::none && f.self->rank;
  const std::string who = launched ? "rank " + std::to_string(*f.self->rank) + ": " : "";
  std::printf("%sdtrain_doctor on %s (resolves to %s)\n", who.c_str(), f.host_name.c_str(),
              f.host_addresses.error.empty()
                  ? dtrain::detail::joined(f.host_addresses.addresses).c_str()
                  : ("nothing: " + f.host_addresses.error).c_str());
  std::printf("world: %s\n",
              f.self ? f.self->describe().c_str() : ("unknown: " + f.world_error).c_str());
  std::printf("GPUs: %d NVIDIA on the PCI bus (%s/bus/pci)%s\n", f.host.nvidia_gpus, sysfs.c_str(),
              f.host.nvidia_driver.empty() ? "" : (", driver " + f.host.nvidia_driver).c_str());
  for (const auto& line : gpu_lines) std::printf("  %s\n", line.c_str());
  std::printf("  %s\n", nccl_version().c_str());
  std::printf("RDMA / InfiniBand (%s/class/infiniband):%s\n", sysfs.c_str(),
              f.host.rdma.empty() ? " none" : "");
  for (const auto& p : f.host.rdma) {
    std::printf("  %s port %d: %s, %s, %s, %s\n", p.device.c_str(), p.port, p.state.c_str(),
                p.phys_state.c_str(), p.rate.c_str(), p.link_layer.c_str());
  }
  std::printf("network interfaces (%s/class/net):%s\n", sysfs.c_str(),
              f.host.interfaces.empty() ? " none" : "");
  for (const auto& i : f.host.interfaces) {
    std::string speed = i.speed_mbps > 0 ? ", " + std::to_string(i.speed_mbps) + " Mb/s" : "";
    std::printf("  %-10s %-8s mtu %-6d %s%s\n", i.name.c_str(), i.state.c_str(), i.mtu,
                i.addresses.empty() ? "(no address)" : dtrain::detail::joined(i.addresses).c_str(),
                speed.c_str());
  }
  std::printf("the engines would use:\n");
  for (const auto& e : {dtrain::gloo_interface(f.host, env, f.route_to_master),
                        dtrain::nccl_interface(f.host, env), dtrain::mpi_interface(f.host, env)}) {
    std::printf("  %-4s %s: %s\n", e.engine.c_str(), e.choice.c_str(), e.why.c_str());
  }
  std::printf("  MPI: %s\n", mpi_report().c_str());

  const auto findings = dtrain::diagnose(f);
  if (findings.empty()) {
    std::printf("no known trap found\n");
    return 0;
  }
  std::printf("%zu problem%s:\n", findings.size(), findings.size() == 1 ? "" : "s");
  for (const auto& x : findings) {
    std::printf("  ! %s\n    fix: %s\n", x.problem.c_str(), x.fix.c_str());
  }
  std::fflush(stdout);
  return 1;
}
