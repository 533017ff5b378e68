#pragma once
/// @file
/// The non-template bodies of dtrain/detail/net.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/detail/net.hpp, not this file.

#include <dtrain/detail/net.hpp>

namespace dtrain::detail {

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

DTRAIN_DETAIL_INLINE std::vector<std::string> interfaces_with_address() {
  std::vector<std::string> names;
  for (const auto& a : interface_addresses()) {
    bool seen = false;
    for (const auto& n : names) seen = seen || n == a.name;
    if (!seen) names.push_back(a.name);
  }
  return names;
}

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

}  // namespace dtrain::detail
