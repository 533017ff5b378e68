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

/// The numeric address and port of a socket address.
DTRAIN_DETAIL_INLINE std::string endpoint_text(const sockaddr* sa);

/// Disables Nagle: the store's requests are small and latency-bound.
DTRAIN_DETAIL_INLINE void set_no_delay(int fd);

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

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/rendezvous/socket-inl.hpp>
#endif
