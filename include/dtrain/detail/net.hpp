#pragma once
/// @file
/// What this host's network looks like to a process: its interfaces and
/// their addresses (getifaddrs), what a name resolves to, and which local
/// address reaches a host. Plain facts for the engines' interface choice
/// (backend/gloo/store.hpp) and for the network report (doctor/network.hpp).

#include <dtrain/config.hpp>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace dtrain::detail {

/// One address of one interface.
struct interface_address {
  std::string name;     ///< "eth0"
  std::string address;  ///< numeric: "10.0.0.4", "fe80::1"
  bool ipv6 = false;
};

/// Every IPv4 and IPv6 address of every interface (getifaddrs); empty when it fails.
DTRAIN_DETAIL_INLINE std::vector<interface_address> interface_addresses();

/// Names of the interfaces that carry an IPv4 or IPv6 address, each once.
DTRAIN_DETAIL_INLINE std::vector<std::string> interfaces_with_address();

/// The numeric addresses `host` resolves to (getaddrinfo), or the resolver's
/// error in `error`.
struct resolved {
  std::vector<std::string> addresses;
  std::string error;  ///< empty on success
};
DTRAIN_DETAIL_INLINE resolved resolve(const std::string& host);

/// The local address this host sends from to reach host:port (a UDP socket
/// connected there, asked for its own name; nothing is sent), or why not in `error`.
struct route_source {
  std::string address;
  std::string error;  ///< "cannot be resolved (...)" or the socket's error; empty on success
};
DTRAIN_DETAIL_INLINE route_source local_address_to(const std::string& host, int port);

/// Whether a numeric address is a loopback address (127.0.0.0/8, ::1).
inline bool is_loopback_address(const std::string& address) {
  return address.rfind("127.", 0) == 0 || address == "::1" || address.rfind("::ffff:127.", 0) == 0;
}

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/detail/net-inl.hpp>
#endif
