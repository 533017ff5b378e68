#pragma once
/// @file
/// The few socket helpers the store's server and client share.

#include <dtrain/config.hpp>
#include <dtrain/detail/sys.hpp>
#include <dtrain/error.hpp>

#include <cerrno>
#include <cstdint>
#include <string>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

namespace dtrain::detail {

/// "host:port", with brackets for IPv6 ("[::1]:29500").
DTRAIN_DETAIL_INLINE std::string endpoint_text(const std::string& host, int port);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string endpoint_text(const std::string& host, int port) {
  bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The numeric address and port of a socket address.
DTRAIN_DETAIL_INLINE std::string endpoint_text(const sockaddr* sa);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string endpoint_text(const sockaddr* sa) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (sa->sa_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
    port = ntohs(in->sin_port);
  } else if (sa->sa_family == AF_INET6) {
    auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
    port = ntohs(in6->sin6_port);
  }
  return endpoint_text(host, port);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Disables Nagle: the store's requests are small and latency-bound.
DTRAIN_DETAIL_INLINE void set_no_delay(int fd);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void set_no_delay(int fd) {
  int one = 1;
  DTRAIN_SYSCALL(::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one));
}
#endif  // DTRAIN_DETAIL_BODIES()

/// getaddrinfo with its result owned.
struct address_list {
  addrinfo* head = nullptr;
  address_list() = default;
  address_list(const address_list&) = delete;
  address_list& operator=(const address_list&) = delete;
  ~address_list() {
    if (head) ::freeaddrinfo(head);
  }
};

/// Resolves host:port; returns the gai error code (0 on success).
DTRAIN_DETAIL_INLINE int resolve(const std::string& host, int port, bool passive,
                                 address_list& out);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE int resolve(const std::string& host, int port, bool passive,
                                 address_list& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  std::string service = std::to_string(port);
  return ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &out.head);
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
