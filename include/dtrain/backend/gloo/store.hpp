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
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::optional<named_interface> gloo_interface_variable(
    const environment& env) {
  if (auto v = env.get(gloo_ifname_variable); v && !v->empty()) {
    return named_interface{std::string(*v), assignment(gloo_ifname_variable, *v)};
  }
  if (auto v = env.get("GLOO_SOCKET_IFNAME"); v && !v->empty()) {
    return named_interface{std::string(v->substr(0, v->find(','))),
                           "GLOO_SOCKET_IFNAME=" + std::string(*v)};
  }
  return std::nullopt;
}
#endif  // DTRAIN_DETAIL_BODIES()

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

#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void gloo_store_adapter::set(const std::string& key,
                                                  const std::vector<char>& data) {
  store_.set(prefix_ + key, std::string_view(data.data(), data.size()));
  written_.push_back(prefix_ + key);
}

DTRAIN_DETAIL_INLINE std::vector<char> gloo_store_adapter::get(const std::string& key) {
  std::string value = store_.get(prefix_ + key, timeout_);
  return {value.begin(), value.end()};
}

DTRAIN_DETAIL_INLINE void gloo_store_adapter::wait(const std::vector<std::string>& keys,
                                                   const std::chrono::milliseconds& timeout) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const auto& k : keys) full.push_back(prefix_ + k);
  // Gloo passes kNoTimeout (0) to mean "the default".
  store_.wait(full, timeout.count() > 0 ? timeout : timeout_);
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Where Gloo's TCP transport listens: a named interface, or an address.
struct gloo_endpoint {
  std::string iface;     ///< network interface name ("eth0"), or empty
  std::string hostname;  ///< numeric address to bind, when no interface is named
  std::string origin;    ///< how it was chosen, for messages: "DTRAIN_GLOO_IFNAME=eth0"
};

/// Throws config_error naming `origin` when no interface `name` with an address exists here.
DTRAIN_DETAIL_INLINE void require_interface(const std::string& name, const std::string& origin);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE void require_interface(const std::string& name, const std::string& origin) {
  auto names = interfaces_with_address();
  for (const auto& n : names) {
    if (n == name) return;
  }
  std::string known;
  for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
  throw config_error(
      origin + " names no network interface with an IP address on this host (interfaces: " +
      (known.empty() ? std::string("none") : known) +
      "); name one of them, or unset it to use the interface that reaches MASTER_ADDR");
}
#endif  // DTRAIN_DETAIL_BODIES()

/// The local address this host sends from to reach host:port; config_error
/// naming `origin` when there is none.
DTRAIN_DETAIL_INLINE std::string local_address_towards(const std::string& host, int port,
                                                       const std::string& origin);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE std::string local_address_towards(const std::string& host, int port,
                                                       const std::string& origin) {
  const route_source route = local_address_to(host, port);
  if (route.error.rfind("cannot be resolved", 0) == 0) {
    throw config_error(origin + " " + route.error +
                       ", so no interface for Gloo can be chosen from it; set DTRAIN_GLOO_IFNAME");
  }
  if (!route.error.empty()) {
    throw config_error(origin + ": " + route.error + "; set DTRAIN_GLOO_IFNAME");
  }
  return route.address;
}
#endif  // DTRAIN_DETAIL_BODIES()

/// Chooses Gloo's endpoint: the `interface` option, else DTRAIN_GLOO_IFNAME,
/// else GLOO_SOCKET_IFNAME (its first entry when a list), else the local
/// address that reaches the master (`master_addr` option, else MASTER_ADDR),
/// else 127.0.0.1 for a world of one and the host name otherwise. A named
/// interface that does not exist is a config_error naming it.
DTRAIN_DETAIL_INLINE gloo_endpoint choose_gloo_endpoint(const std::string& interface_option,
                                                        const std::string& master_option,
                                                        const environment& env, int size);
#if DTRAIN_DETAIL_BODIES()
DTRAIN_DETAIL_INLINE gloo_endpoint choose_gloo_endpoint(const std::string& interface_option,
                                                        const std::string& master_option,
                                                        const environment& env, int size) {
  auto named = [](std::string name, std::string origin) {
    require_interface(name, origin);
    return gloo_endpoint{std::move(name), {}, std::move(origin)};
  };
  if (!interface_option.empty())
    return named(interface_option, "gloo_options::interface=" + interface_option);
  if (auto variable = gloo_interface_variable(env)) {
    return named(std::move(variable->name), std::move(variable->origin));
  }
  std::string master = master_option;
  std::string origin = "gloo_options::master_addr=" + master_option;
  if (master.empty()) {
    if (auto v = env.get("MASTER_ADDR"); v && !v->empty()) {
      master = std::string(*v);
      origin = "MASTER_ADDR=" + master;
    }
  }
  if (!master.empty()) {
    const int port = read_port(env, "MASTER_PORT").value_or(sourced_int{0, {}}).value;
    std::string address = local_address_towards(master, port, origin);
    return {{}, address, "the address that reaches " + origin + " (" + address + ")"};
  }
  if (size == 1) return {{}, "127.0.0.1", "127.0.0.1 (a world of one, no MASTER_ADDR)"};
  const std::string host = host_name().value_or("");
  return {{}, host, "the host name " + host + " (no interface named and no MASTER_ADDR)"};
}
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail

#endif  // DTRAIN_HAS_GLOO()
