#pragma once
/// @file
/// The non-template bodies of dtrain/backend/gloo/store.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/backend/gloo/store.hpp, not this file.

#include <dtrain/backend/gloo/store.hpp>

namespace dtrain::detail {

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
}  // namespace dtrain::detail

#if DTRAIN_HAS_GLOO()
namespace dtrain::detail {

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

}  // namespace dtrain::detail
#endif
