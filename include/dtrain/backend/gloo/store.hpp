#pragma once
/// @file
/// How a gloo_communicator bootstraps: dtrain's store behind Gloo's store
/// interface, and the choice of the network interface Gloo's TCP transport
/// binds to. Used by backend/gloo/gloo.hpp; without Gloo only the rule for the
/// interface variables is left (doctor/network.hpp reports it).

#include <dtrain/config.hpp>
#include <dtrain/detail/net.hpp>
#include <dtrain/detail/sys.hpp>

#include <dtrain/env/environment.hpp>
#include <dtrain/env/variables.hpp>
#include <dtrain/error.hpp>
#include <dtrain/rendezvous/store.hpp>

#include <optional>
#include <string>

namespace dtrain::detail {

/// An interface named by a variable, with the variable as it was set.
struct named_interface {
  std::string name;    ///< "eth0"
  std::string origin;  ///< "GLOO_SOCKET_IFNAME=eth0,eth1"
};

/// The interface the environment tells Gloo to use: DTRAIN_GLOO_IFNAME, else
/// the first entry of GLOO_SOCKET_IFNAME (Gloo's TCP device takes one); nullopt
/// when neither is set (then the interface that reaches MASTER_ADDR is used).
DTRAIN_DETAIL_INLINE std::optional<named_interface> gloo_interface_variable(const environment& env);

}  // namespace dtrain::detail

#if DTRAIN_HAS_GLOO()

#include <gloo/rendezvous/store.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace dtrain::detail {

/// Any dtrain store, seen through the calls the Gloo backend makes, so that
/// gloo_communicator is one type whatever store bootstrapped it (its splits
/// bootstrap through the same store later). Refers to the store, which must
/// outlive every communicator made from it.
class gloo_store_ref {
 public:
  using milliseconds = std::chrono::milliseconds;

  template <store S>
  explicit gloo_store_ref(S& s)
      : set_([p = &s](std::string_view key, std::string_view value) { p->set(key, value); }),
        get_([p = &s](std::string_view key, milliseconds timeout) {
          return std::string(p->get(key, timeout));
        }),
        wait_([p = &s](std::span<const std::string> keys, milliseconds timeout) {
          p->wait(keys, timeout);
        }),
        add_([p = &s](std::string_view key, std::int64_t delta) {
          return std::int64_t(p->add(key, delta));
        }),
        erase_([p = &s](std::string_view key) { p->erase(key); }) {}

  void set(std::string_view key, std::string_view value) const { set_(key, value); }
  [[nodiscard]] std::string get(std::string_view key, milliseconds timeout) const {
    return get_(key, timeout);
  }
  void wait(std::span<const std::string> keys, milliseconds timeout) const { wait_(keys, timeout); }
  std::int64_t add(std::string_view key, std::int64_t delta) const { return add_(key, delta); }
  void erase(std::string_view key) const { erase_(key); }

 private:
  std::function<void(std::string_view, std::string_view)> set_;
  std::function<std::string(std::string_view, milliseconds)> get_;
  std::function<void(std::span<const std::string>, milliseconds)> wait_;
  std::function<std::int64_t(std::string_view, std::int64_t)> add_;
  std::function<void(std::string_view)> erase_;
};

/// Gloo's five-method store on top of a dtrain store, every key under
/// `prefix/`. Remembers the keys it wrote, so that they can be erased once
/// every rank has connected (a full mesh of N ranks leaves N values of
/// O(N) addresses each).
class gloo_store_adapter final : public ::gloo::rendezvous::Store {
 public:
  gloo_store_adapter(const gloo_store_ref& store, std::string prefix,
                     std::chrono::milliseconds timeout)
      : store_(store), prefix_(std::move(prefix) + "/"), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override;

  std::vector<char> get(const std::string& key) override;

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  [[nodiscard]] const std::vector<std::string>& written() const noexcept { return written_; }

 private:
  const gloo_store_ref& store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
  std::vector<std::string> written_;
};

/// Where Gloo's TCP transport listens: a named interface, or an address.
struct gloo_endpoint {
  std::string iface;     ///< network interface name ("eth0"), or empty
  std::string hostname;  ///< numeric address to bind, when no interface is named
  std::string origin;    ///< how it was chosen, for messages: "DTRAIN_GLOO_IFNAME=eth0"
};

/// Throws config_error naming `origin` when no interface `name` with an address exists here.
DTRAIN_DETAIL_INLINE void require_interface(const std::string& name, const std::string& origin);

/// The local address this host sends from to reach host:port; config_error
/// naming `origin` when there is none.
DTRAIN_DETAIL_INLINE std::string local_address_towards(const std::string& host, int port,
                                                       const std::string& origin);

/// Chooses Gloo's endpoint: the `interface` option, else DTRAIN_GLOO_IFNAME,
/// else GLOO_SOCKET_IFNAME (its first entry when a list), else the local
/// address that reaches the master (`master_addr` option, else MASTER_ADDR),
/// else 127.0.0.1 for a world of one and the host name otherwise. A named
/// interface that does not exist is a config_error naming it.
DTRAIN_DETAIL_INLINE gloo_endpoint choose_gloo_endpoint(const std::string& interface_option,
                                                        const std::string& master_option,
                                                        const environment& env, int size);

}  // namespace dtrain::detail

#endif  // DTRAIN_HAS_GLOO()

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/backend/gloo/store-inl.hpp>
#endif
