#pragma once
/// @file
/// The checks dtrain_doctor runs for a multi-node job that will not start or
/// is slow: known traps, each with the setting that fixes it. A pure function
/// of what was gathered (environment, world, host network, resolver answers,
/// GPU count), so every check is unit-tested with facts of its own. Only the
/// doctor includes it: dtrain.hpp does not, so no training program compiles it.

#include <dtrain/detail/net.hpp>
#include <dtrain/detail/parse.hpp>
#include <dtrain/doctor/network.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/names.hpp>
#include <dtrain/env/world.hpp>

#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

namespace dtrain {

/// What the doctor looked at.
struct doctor_facts {
  environment env;
  std::optional<world> self;        ///< as discovered; nullopt when discovery failed
  std::string world_error;          ///< discovery's error, when it failed
  host_network host;                ///< interfaces, RDMA ports, GPUs on the bus
  std::string host_name;            ///< gethostname()
  detail::resolved host_addresses;  ///< what the host name resolves to
  std::optional<detail::resolved> master_addresses;  ///< MASTER_ADDR's, when it is set
  std::string route_to_master;  ///< the local address that reaches MASTER_ADDR, or empty
  int visible_gpus = -1;        ///< CUDA's device count; -1: CUDA could not say
};

/// A trap found: what is wrong, and the setting that fixes it.
struct doctor_finding {
  std::string problem;
  std::string fix;
};

namespace detail {

inline std::optional<int> positive_variable(const environment& env, std::string_view name) {
  auto v = env.get(name);
  if (!v) return std::nullopt;
  char* end = nullptr;
  const std::string text(*v);
  const long n = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || n < 1 || n > 1'000'000) return std::nullopt;
  return static_cast<int>(n);
}

/// Whether the job spans several nodes, as far as the facts tell.
inline bool multi_node(const doctor_facts& f) {
  if (f.self) {
    if (f.self->num_nodes && *f.self->num_nodes > 1) return true;
    if (f.self->world_size && f.self->local_world_size &&
        *f.self->world_size > *f.self->local_world_size)
      return true;
  }
  for (std::string_view var : std::initializer_list<std::string_view>{
           nnodes_variable, "NNODES", "SLURM_NNODES", "OMPI_MCA_orte_num_nodes", "GROUP_WORLD_SIZE",
           "HOROVOD_CROSS_SIZE"}) {
    if (auto n = positive_variable(f.env, var); n && *n > 1) return true;
  }
  return false;
}

/// Whether a launcher placed this process (else the doctor runs on its own, to check a node).
inline bool launched(const doctor_facts& f) { return f.self && f.self->source != launcher::none; }

/// GPUs this process may use: CUDA's count, else the NVIDIA GPUs on the bus
/// limited by CUDA_VISIBLE_DEVICES; -1 when neither is known.
inline int usable_gpus(const doctor_facts& f) {
  if (f.visible_gpus >= 0) return f.visible_gpus;
  int bus = f.host.nvidia_gpus;
  if (auto v = f.env.get("CUDA_VISIBLE_DEVICES")) {
    int listed = 0;
    for (const std::string& device : list_entries(*v)) {
      if (device.front() != '-') ++listed;  // "-1" hides every device
    }
    bus = std::min(bus, listed);
  }
  return bus;
}

inline bool all_loopback(const std::vector<std::string>& addresses) {
  if (addresses.empty()) return false;
  for (const auto& a : addresses) {
    if (!is_loopback_address(a)) return false;
  }
  return true;
}

}  // namespace detail

/// Every known trap the facts show, most fundamental first.
[[nodiscard]] inline std::vector<doctor_finding> diagnose(const doctor_facts& f) {
  std::vector<doctor_finding> out;
  const bool multi = detail::multi_node(f);
  if (!f.world_error.empty()) {
    out.push_back({"the launcher's environment is inconsistent: " + f.world_error,
                   "fix or unset the variable it names; `dtrain_whoami` shows what dtrain reads"});
  }

  // Debian maps a machine's own name to 127.0.1.1: what other nodes are told
  // by name, or what a process binds by name, is then a loopback address.
  if ((multi || !detail::launched(f)) && detail::all_loopback(f.host_addresses.addresses)) {
    out.push_back({"the host name " + f.host_name + " resolves to " +
                       detail::joined(f.host_addresses.addresses) +
                       " (Debian's /etc/hosts maps a machine's own name to 127.0.1.1): "
                       "other nodes cannot reach this node by its name, "
                       "and whatever binds to it listens on loopback only",
                   "map " + f.host_name +
                       " to this node's routable address in /etc/hosts (or DNS); "
                       "set MASTER_ADDR to a routable address of node 0, not its name; "
                       "and name the interface: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME / "
                       "OMPI_MCA_btl_tcp_if_include=<eth0 or ib0>"});
  }

  if (auto master = f.env.get("MASTER_ADDR"); master && f.master_addresses) {
    if (!f.master_addresses->error.empty()) {
      out.push_back({"MASTER_ADDR=" + std::string(*master) + " cannot be resolved (" +
                         f.master_addresses->error + "): no rank can reach the store",
                     "set MASTER_ADDR to node 0's address or a name this node resolves "
                     "(getent hosts " +
                         std::string(*master) + ")"});
    } else if (multi && detail::all_loopback(f.master_addresses->addresses)) {
      out.push_back(
          {"MASTER_ADDR=" + std::string(*master) + " resolves to " +
               detail::joined(f.master_addresses->addresses) +
               " (loopback) in a job of several nodes: "
               "ranks on other nodes would reach their own machine, not node 0",
           "set MASTER_ADDR to node 0's routable address (e.g. its eth0 or ib0 address)"});
    }
  }

  const auto ib = f.env.get("NCCL_IB_DISABLE");
  if (ib && *ib == "1" && f.host.rdma_active()) {
    std::string ports;
    for (const auto& p : f.host.rdma) {
      if (p.active())
        ports += (ports.empty() ? "" : ", ") + p.device + ":" + std::to_string(p.port) + " (" +
                 p.link_layer + ", " + p.rate + ")";
    }
    out.push_back(
        {"NCCL_IB_DISABLE=1 while RDMA ports are active (" + ports +
             "): NCCL moves data over TCP sockets instead, many times slower",
         "unset NCCL_IB_DISABLE (or set it to 0); pick ports with NCCL_IB_HCA if needed"});
  }
  if (!f.host.rdma.empty() && !f.host.rdma_active()) {
    std::string ports;
    for (const auto& p : f.host.rdma)
      ports += (ports.empty() ? "" : ", ") + p.device + ":" + std::to_string(p.port) + " " +
               p.state + "/" + p.phys_state;
    out.push_back({"RDMA devices are present but no port is ACTIVE (" + ports +
                       "): NCCL and MPI fall back to TCP",
                   "check the cable and the subnet manager (ibstat; "
                   "`opensm` on one node of an InfiniBand fabric), or the RoCE link"});
  }

  for (const engine_interface& e : {gloo_interface(f.host, f.env, f.route_to_master),
                                    nccl_interface(f.host, f.env), mpi_interface(f.host, f.env)}) {
    for (const auto& name : e.missing) {
      std::string known;
      for (const auto& i : f.host.interfaces) known += (known.empty() ? "" : ", ") + i.name;
      out.push_back({e.why.substr(0, e.why.find(';')) + " names " + name +
                         ", which this host does not have (interfaces: " +
                         (known.empty() ? std::string("none") : known) + "): " + e.engine +
                         " cannot start, or picks another network",
                     "name an interface this node has, or unset the variable"});
    }
  }

  std::optional<int> local;
  if (f.self && f.self->local_world_size) local = *f.self->local_world_size;
  for (std::string_view var : {nproc_per_node_variable, std::string_view("LOCAL_WORLD_SIZE")}) {
    if (!local) local = detail::positive_variable(f.env, var);
  }
  const int gpus = detail::usable_gpus(f);
  if (local && gpus >= 1 && gpus < *local) {
    out.push_back({std::to_string(*local) + " ranks on this node but " + std::to_string(gpus) +
                       " visible GPU" + (gpus == 1 ? "" : "s") +
                       ": NCCL needs a GPU of its own for every rank "
                       "(NCCL before 2.30 rejects a shared one)",
                   "start " + std::to_string(gpus) + (gpus == 1 ? " worker" : " workers") +
                       " per node (--nproc-per-node " + std::to_string(gpus) +
                       "), or make more GPUs visible (CUDA_VISIBLE_DEVICES)"});
  }
  return out;
}

}  // namespace dtrain
