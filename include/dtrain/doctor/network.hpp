#pragma once
/// @file
/// What the engines will find on this host: network interfaces (sysfs
/// class/net, with addresses from getifaddrs), RDMA / InfiniBand ports
/// (sysfs class/infiniband), NVIDIA GPUs on the PCI bus (sysfs bus/pci) and
/// the driver's version, read under a sysfs root that tests replace with a
/// tree of their own; and which interface Gloo, NCCL and Open MPI would use,
/// by each engine's own rules and variables. dtrain_doctor prints it; the
/// engines do not read it (dtrain.hpp does not include it).

#include <dtrain/backend/gloo/store.hpp>
#include <dtrain/detail/net.hpp>
#include <dtrain/detail/parse.hpp>
#include <dtrain/env/environment.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain {

/// One network interface as sysfs and getifaddrs describe it.
struct network_interface {
  std::string name;                    ///< "eth0"
  std::string state;                   ///< operstate: "up", "down", "unknown" (lo)
  std::vector<std::string> addresses;  ///< numeric, IPv4 first
  int mtu = -1;                        ///< -1: unknown
  int speed_mbps = -1;                 ///< -1: unknown (virtual links report none)
  bool loopback = false;
  [[nodiscard]] bool up() const { return state == "up" || (loopback && state == "unknown"); }
};

/// One port of an RDMA device (InfiniBand, RoCE, iWARP).
struct rdma_port {
  std::string device;  ///< "mlx5_0"
  int port = 1;
  std::string state;       ///< "ACTIVE", "DOWN", "INIT", ... (sysfs "4: ACTIVE")
  std::string phys_state;  ///< "LinkUp", "Disabled", ... (sysfs "5: LinkUp")
  std::string rate;        ///< "200 Gb/sec (4X HDR)"
  std::string link_layer;  ///< "InfiniBand" or "Ethernet" (RoCE)
  [[nodiscard]] bool active() const { return state == "ACTIVE"; }
};

/// The host as the engines will find it.
struct host_network {
  std::string sysfs;  ///< the root it was read from ("/sys")
  std::vector<network_interface> interfaces;
  std::vector<rdma_port> rdma;
  int nvidia_gpus = 0;        ///< NVIDIA display/3D controllers on the PCI bus
  std::string nvidia_driver;  ///< module/nvidia/version, or empty
  [[nodiscard]] const network_interface* find(std::string_view name) const {
    for (const auto& i : interfaces) {
      if (i.name == name) return &i;
    }
    return nullptr;
  }
  [[nodiscard]] bool rdma_active() const {
    return std::any_of(rdma.begin(), rdma.end(), [](const rdma_port& p) { return p.active(); });
  }
};

namespace detail {

// The first line of a sysfs file, trimmed; nullopt when it cannot be read.
inline std::optional<std::string> sysfs_line(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r' || line.back() == ' '))
    line.pop_back();
  return line;
}

inline int sysfs_int(const std::filesystem::path& file) {
  auto text = sysfs_line(file);
  if (!text || text->empty()) return -1;
  char* end = nullptr;
  const long v = std::strtol(text->c_str(), &end, 0);
  return (*end == '\0' && v >= -1 && v < 1'000'000'000) ? static_cast<int>(v) : -1;
}

// "4: ACTIVE" -> "ACTIVE"
inline std::string after_colon(const std::string& text) {
  auto colon = text.find(':');
  std::string out = colon == std::string::npos ? text : text.substr(colon + 1);
  while (!out.empty() && out.front() == ' ') out.erase(out.begin());
  return out;
}

inline std::vector<std::filesystem::path> sorted_entries(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace detail

/// Reads the host under `sysfs` (normally "/sys"). Addresses come from
/// getifaddrs only when `live` (the real system); a test's tree has none.
/// Never throws: what cannot be read is left out.
[[nodiscard]] inline host_network read_host_network(const std::string& sysfs = "/sys",
                                                    bool live = true) {
  namespace fs = std::filesystem;
  host_network h;
  h.sysfs = sysfs;
  const fs::path root(sysfs);
  const auto addresses =
      live ? detail::interface_addresses() : std::vector<detail::interface_address>{};
  for (const fs::path& dir : detail::sorted_entries(root / "class" / "net")) {
    network_interface i;
    i.name = dir.filename().string();
    i.state = detail::sysfs_line(dir / "operstate").value_or("unknown");
    i.mtu = detail::sysfs_int(dir / "mtu");
    i.speed_mbps = detail::sysfs_int(dir / "speed");
    i.loopback = detail::sysfs_int(dir / "type") == 772;  // ARPHRD_LOOPBACK
    for (bool v6 : {false, true}) {
      for (const auto& a : addresses) {
        if (a.name == i.name && a.ipv6 == v6) i.addresses.push_back(a.address);
      }
    }
    h.interfaces.push_back(std::move(i));
  }
  for (const fs::path& dev : detail::sorted_entries(root / "class" / "infiniband")) {
    for (const fs::path& port : detail::sorted_entries(dev / "ports")) {
      rdma_port p;
      p.device = dev.filename().string();
      p.port = std::atoi(port.filename().string().c_str());
      p.state = detail::after_colon(detail::sysfs_line(port / "state").value_or("?"));
      p.phys_state = detail::after_colon(detail::sysfs_line(port / "phys_state").value_or("?"));
      p.rate = detail::sysfs_line(port / "rate").value_or("?");
      p.link_layer = detail::sysfs_line(port / "link_layer").value_or("InfiniBand");
      h.rdma.push_back(std::move(p));
    }
  }
  for (const fs::path& dev : detail::sorted_entries(root / "bus" / "pci" / "devices")) {
    // NVIDIA's vendor id; class 0x03xxxx: a display or 3D controller (not its audio function).
    const auto vendor = detail::sysfs_line(dev / "vendor");
    const auto cls = detail::sysfs_line(dev / "class");
    if (vendor == "0x10de" && cls && cls->rfind("0x03", 0) == 0) ++h.nvidia_gpus;
  }
  h.nvidia_driver = detail::sysfs_line(root / "module" / "nvidia" / "version").value_or("");
  return h;
}

/// Which interface an engine will use, and why.
struct engine_interface {
  std::string engine;  ///< "gloo", "nccl", "mpi"
  std::string choice;  ///< "eth0", "eth0, eth1", or "?" when it cannot tell
  std::string
      why;  ///< "NCCL_SOCKET_IFNAME=eth", "the interface that reaches MASTER_ADDR=node1 (10.0.0.1)"
  std::vector<std::string> missing;  ///< names the engine's variable asks for that this host lacks
};

namespace detail {

/// The non-empty entries of a comma list ("eth0,,eth1" -> eth0, eth1).
inline std::vector<std::string> list_entries(std::string_view text) {
  std::vector<std::string> out = split(text, ',');
  std::erase_if(out, [](const std::string& e) { return e.empty(); });
  return out;
}

/// NCCL_SOCKET_IFNAME's rules: a comma list of prefixes, `^` excludes them,
/// `=` makes them exact names. Returns the matching interfaces; `missing`
/// gets entries (of an including list) that match none.
inline std::vector<std::string> match_interface_list(const host_network& h, std::string_view spec,
                                                     std::vector<std::string>* missing) {
  bool exclude = false;
  if (!spec.empty() && spec.front() == '^') {
    exclude = true;
    spec.remove_prefix(1);
  }
  bool exact = false;
  if (!spec.empty() && spec.front() == '=') {
    exact = true;
    spec.remove_prefix(1);
  }
  const std::vector<std::string> entries = list_entries(spec);
  auto matches = [&](const std::string& name, const std::string& entry) {
    return exact ? name == entry : name.rfind(entry, 0) == 0;
  };
  std::vector<std::string> out;
  for (const auto& i : h.interfaces) {
    bool any = false;
    for (const auto& e : entries) any = any || matches(i.name, e);
    if (any != exclude) out.push_back(i.name);
  }
  if (missing && !exclude) {
    for (const auto& e : entries) {
      bool found = false;
      for (const auto& i : h.interfaces) found = found || matches(i.name, e);
      if (!found) missing->push_back(e);
    }
  }
  return out;
}

inline std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "none" : out;
}

/// The interface that holds `address`, or empty.
inline std::string interface_holding(const host_network& h, const std::string& address) {
  for (const auto& i : h.interfaces) {
    for (const auto& a : i.addresses) {
      if (a == address) return i.name;
    }
  }
  return {};
}

}  // namespace detail

/// Gloo's interface as dtrain chooses it: DTRAIN_GLOO_IFNAME, else
/// GLOO_SOCKET_IFNAME (its first entry), else the interface whose address
/// reaches MASTER_ADDR (`route`: the local address towards it, from
/// detail::local_address_to; empty when unknown).
[[nodiscard]] inline engine_interface gloo_interface(const host_network& h, const environment& env,
                                                     const std::string& route) {
  engine_interface e{"gloo", "?", "", {}};
  if (auto named = detail::gloo_interface_variable(env)) {
    e.choice = named->name;
    e.why = named->origin;
    if (!h.find(named->name)) e.missing.push_back(named->name);
    return e;
  }
  const auto master = env.get("MASTER_ADDR");
  if (master && !master->empty()) {
    const std::string holder = route.empty() ? "" : detail::interface_holding(h, route);
    e.choice = holder.empty() ? (route.empty() ? "?" : route) : holder;
    e.why = "the interface whose address reaches MASTER_ADDR=" + std::string(*master) +
            (route.empty() ? " (no route found)" : " (" + route + ")");
    return e;
  }
  e.why = "no MASTER_ADDR and no DTRAIN_GLOO_IFNAME: the address the host name resolves to";
  return e;
}

/// NCCL's socket interface: NCCL_SOCKET_IFNAME's list, else (NCCL's
/// default) interfaces named ib* first, then any but lo and docker*. Its
/// data goes over RDMA (NET/IB) when an active port exists and
/// NCCL_IB_DISABLE is not 1; that is said in `why`.
[[nodiscard]] inline engine_interface nccl_interface(const host_network& h,
                                                     const environment& env) {
  engine_interface e{"nccl", "?", "", {}};
  const auto spec = env.get("NCCL_SOCKET_IFNAME");
  std::vector<std::string> chosen;
  if (spec && !spec->empty()) {
    chosen = detail::match_interface_list(h, *spec, &e.missing);
    e.why = "NCCL_SOCKET_IFNAME=" + std::string(*spec);
  } else {
    for (const auto& i : h.interfaces) {
      if (i.name.rfind("ib", 0) == 0 && i.up()) chosen.push_back(i.name);
    }
    if (chosen.empty()) {
      for (const auto& i : h.interfaces) {
        if (i.up() && !i.loopback && i.name.rfind("docker", 0) != 0 && i.name.rfind("lo", 0) != 0)
          chosen.push_back(i.name);
      }
    }
    e.why = "NCCL's default (NCCL_SOCKET_IFNAME unset: ib* first, then any but lo and docker*)";
  }
  e.choice = chosen.empty() ? "none" : detail::joined(chosen);
  const auto ib_disable = env.get("NCCL_IB_DISABLE");
  const auto hca = env.get("NCCL_IB_HCA");
  const bool disabled = ib_disable && *ib_disable == "1";
  if (h.rdma_active() && !disabled) {
    std::string ports;
    for (const auto& p : h.rdma) {
      if (p.active())
        ports += (ports.empty() ? "" : ", ") + p.device + ":" + std::to_string(p.port);
    }
    e.why += "; data over RDMA (NET/IB) on " + ports +
             (hca ? " filtered by NCCL_IB_HCA=" + std::string(*hca) : "");
  } else {
    e.why += disabled ? "; data over TCP sockets (NCCL_IB_DISABLE=1)"
                      : "; data over TCP sockets (no active RDMA port)";
  }
  return e;
}

/// Open MPI's TCP interfaces: OMPI_MCA_btl_tcp_if_include, else every
/// interface but those in OMPI_MCA_btl_tcp_if_exclude (default: loopback).
/// With RDMA ports present, an Open MPI built with UCX uses them (UCX_NET_DEVICES).
[[nodiscard]] inline engine_interface mpi_interface(const host_network& h, const environment& env) {
  engine_interface e{"mpi", "?", "", {}};
  std::vector<std::string> chosen;
  if (auto inc = env.get("OMPI_MCA_btl_tcp_if_include"); inc && !inc->empty()) {
    for (const std::string& name : detail::list_entries(*inc)) {
      // An entry may be a subnet (10.0.0.0/24), which sysfs cannot check.
      if (name.find('/') == std::string::npos && !h.find(name)) e.missing.push_back(name);
      chosen.push_back(name);
    }
    e.why = "OMPI_MCA_btl_tcp_if_include=" + std::string(*inc);
  } else {
    std::vector<std::string> excluded{"lo"};
    if (auto exc = env.get("OMPI_MCA_btl_tcp_if_exclude"); exc && !exc->empty()) {
      excluded = detail::list_entries(*exc);
      e.why = "OMPI_MCA_btl_tcp_if_exclude=" + std::string(*exc);
    } else {
      e.why = "Open MPI's default (every interface but loopback)";
    }
    for (const auto& i : h.interfaces) {
      if (i.loopback && excluded.size() == 1 && excluded[0] == "lo") continue;
      if (std::find(excluded.begin(), excluded.end(), i.name) == excluded.end() && i.up())
        chosen.push_back(i.name);
    }
  }
  e.choice = detail::joined(chosen);
  if (!h.rdma.empty()) {
    const auto ucx = env.get("UCX_NET_DEVICES");
    e.why += "; RDMA ports are present: an Open MPI built with UCX uses them" +
             (ucx ? " (UCX_NET_DEVICES=" + std::string(*ucx) + ")" : std::string());
  }
  return e;
}

}  // namespace dtrain
