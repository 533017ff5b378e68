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
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::vector<interface_address> interface_addresses() {
  std::vector<interface_address> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6))
      continue;
    const socklen_t length =
        i->ifa_addr->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    char text[NI_MAXHOST] = {};
    if (::getnameinfo(i->ifa_addr, length, text, sizeof text, nullptr, 0, NI_NUMERICHOST) != 0)
      continue;
    out.push_back({i->ifa_name, text, i->ifa_addr->sa_family == AF_INET6});
  }
  ::freeifaddrs(list);
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Names of the interfaces that carry an IPv4 or IPv6 address, each once.
DTRAIN_DETAIL_INLINE std::vector<std::string> interfaces_with_address();
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::vector<std::string> interfaces_with_address() {
  std::vector<std::string> names;
  for (const auto& a : interface_addresses()) {
    bool seen = false;
    for (const auto& n : names) seen = seen || n == a.name;
    if (!seen) names.push_back(a.name);
  }
  return names;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The numeric addresses `host` resolves to (getaddrinfo), or the resolver's
/// error in `error`.
struct resolved {
  std::vector<std::string> addresses;
  std::string error;  ///< empty on success
};
DTRAIN_DETAIL_INLINE resolved resolve(const std::string& host);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE resolved resolve(const std::string& host) {
  resolved out;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found); rc != 0) {
    out.error = ::gai_strerror(rc);
    return out;
  }
  for (addrinfo* a = found; a; a = a->ai_next) {
    char text[NI_MAXHOST] = {};
    if (::getnameinfo(a->ai_addr, a->ai_addrlen, text, sizeof text, nullptr, 0, NI_NUMERICHOST) !=
        0)
      continue;
    bool seen = false;
    for (const auto& s : out.addresses) seen = seen || s == text;
    if (!seen) out.addresses.emplace_back(text);
  }
  ::freeaddrinfo(found);
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The local address this host sends from to reach host:port (a UDP socket
/// connected there, asked for its own name; nothing is sent), or why not in `error`.
struct route_source {
  std::string address;
  std::string error;  ///< "cannot be resolved (...)" or the socket's error; empty on success
};
DTRAIN_DETAIL_INLINE route_source local_address_to(const std::string& host, int port);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE route_source local_address_to(const std::string& host, int port) {
  route_source out;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port > 0 ? port : 9);
  if (int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    out.error = std::string("cannot be resolved (") + ::gai_strerror(rc) + ")";
    return out;
  }
  std::string why = "no address";
  for (addrinfo* a = found; a && out.address.empty(); a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    sockaddr_storage local{};
    socklen_t length = sizeof local;
    char text[NI_MAXHOST] = {};
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      why = std::strerror(errno);
    } else if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) != 0) {
      why = std::strerror(errno);
    } else if (int rc = ::getnameinfo(reinterpret_cast<sockaddr*>(&local), length, text,
                                      sizeof text, nullptr, 0, NI_NUMERICHOST);
               rc != 0) {
      why = ::gai_strerror(rc);
    } else {
      out.address = text;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  if (out.address.empty()) out.error = "no local address reaches it (" + why + ")";
  return out;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Whether a numeric address is a loopback address (127.0.0.0/8, ::1).
inline bool is_loopback_address(const std::string& address) {
  return address.rfind("127.", 0) == 0 || address == "::1" || address.rfind("::ffff:127.", 0) == 0;
}

}  // namespace dtrain::detail
