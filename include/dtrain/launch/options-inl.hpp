#pragma once
/// @file
/// The non-template bodies of dtrain/launch/options.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/launch/options.hpp, not this file.

#include <dtrain/launch/options.hpp>

namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE std::pair<std::optional<int>, int> parse_node_count(const std::string& origin,
                                                                         std::string_view text) {
  const std::size_t colon = text.find(':');
  if (colon == std::string_view::npos) {
    const int n = parse_non_negative(origin, text);
    if (n < 1) throw config_error(origin + " must be at least 1 (nodes)");
    return {std::nullopt, n};
  }
  const int least = parse_non_negative(origin + " (MIN)", text.substr(0, colon));
  const int most = parse_non_negative(origin + " (MAX)", text.substr(colon + 1));
  if (least < 1 || least > most) {
    throw config_error(origin + ": MIN:MAX needs 1 <= MIN <= MAX (nodes; e.g. 1:4)");
  }
  return {least < most ? std::optional<int>(least) : std::nullopt, most};
}

DTRAIN_DETAIL_INLINE sourced_int parse_nproc_per_node(const std::string& origin,
                                                      std::string_view text,
                                                      local_devices (*count)()) {
  if (text == "gpu" || text == "cpu" || text == "auto") {
    const local_devices here = count();
    if (text == "cpu" || (text == "auto" && here.gpus == 0)) {
      return {here.cpus, origin + " (" + std::to_string(here.cpus) + " CPU cores)"};
    }
    if (here.gpus == 0) {
      throw config_error(origin +
                         ": this process sees no CUDA device (no driver, "
                         "or CUDA_VISIBLE_DEVICES hides them); give a number of workers, or cpu");
    }
    return {here.gpus, origin + " (" + std::to_string(here.gpus) + " GPUs)"};
  }
  if (text.empty() || text.find_first_not_of("0123456789") != std::string_view::npos) {
    throw config_error(origin + " is not a number of workers, gpu, cpu or auto");
  }
  const int n = parse_non_negative(origin, text);
  if (n < 1) throw config_error(origin + " must be at least 1 (workers per node)");
  return {n, origin};
}

DTRAIN_DETAIL_INLINE void check_rdzv_backend(const std::string& origin, std::string_view text) {
  if (text == "c10d") return;
  const std::string instead =
      "its agents meet at a store that node 0's agent serves (torchrun's c10d): "
      "give --rdzv-backend c10d --rdzv-endpoint HOST:PORT, "
      "or --master-addr HOST --master-port PORT --node-rank N (PET_MASTER_ADDR, PET_MASTER_PORT, "
      "PET_NODE_RANK)";
  if (text == "static") {
    throw config_error(origin + ": dtrun has no static rendezvous of its own; " + instead);
  }
  if (text == "etcd" || text == "etcd-v2") {
    throw config_error(origin + ": dtrun has no etcd rendezvous; " + instead);
  }
  throw config_error(origin + " is not a rendezvous backend of dtrun's; " + instead);
}

DTRAIN_DETAIL_INLINE std::pair<sourced_text, sourced_int> parse_rdzv_endpoint(
    const std::string& origin, std::string_view text) {
  const host_port hp = split_host_port(origin, text);
  return {sourced_text{hp.host, origin},
          hp.port ? sourced_int{*hp.port, origin}
                  : sourced_int{default_rdzv_port, origin + " (c10d's default port " +
                                                       std::to_string(default_rdzv_port) + ")"}};
}
}  // namespace detail
}  // namespace dtrain

namespace dtrain {

DTRAIN_DETAIL_INLINE agent_options agent_options::with_env(const environment& env) const {
  agent_options out = *this;
  if (auto n = detail::read_agreeing<int>(
          env, {nproc_per_node_variable, pet_nproc_per_node_variable}, "the workers per node",
          [](const std::string& origin, std::string_view text) {
            return detail::parse_nproc_per_node(origin, text);
          })) {
    out.nproc_per_node = n->value;
  }
  if (auto n = detail::read_agreeing<std::pair<std::optional<int>, int>>(
          env, {nnodes_variable, pet_nnodes_variable}, "the number of nodes",
          &detail::parse_node_count)) {
    out.min_nnodes = n->value.first;
    out.nnodes = n->value.second;
  }
  // NODE_RANK is discovery's (beside GROUP_RANK and the launchers'); checked here against ours.
  if (env.contains(node_rank_variable) || env.contains(pet_node_rank_variable)) {
    out.node_rank =
        detail::read_agreeing<int>(env, {node_rank_variable, pet_node_rank_variable, "NODE_RANK"},
                                   "the node rank", &detail::parse_non_negative)
            ->value;
  }
  // Node 0's store: torchrun's variables, which must agree with MASTER_ADDR and MASTER_PORT.
  if (auto backend = detail::read_text(env, pet_rdzv_backend_variable)) {
    detail::check_rdzv_backend(backend->origin, backend->value);
  }
  std::optional<detail::sourced_text> addr = detail::read_text(env, pet_master_addr_variable);
  std::optional<detail::sourced_int> port = detail::read_port(env, pet_master_port_variable);
  if (auto endpoint = detail::read_text(env, pet_rdzv_endpoint_variable)) {
    const auto [host, at] = detail::parse_rdzv_endpoint(endpoint->origin, endpoint->value);
    detail::agree(addr, host, "node 0's address");
    detail::agree(port, at, "node 0's port");
  }
  if (addr || port) {
    // (Not against Azure's AZ_BATCH_MASTER_NODE: the outer job's, which
    // MASTER_ADDR overrides too; its port is never used: read_explicit_master().)
    detail::agree(addr, detail::read_text(env, "MASTER_ADDR"), "node 0's address");
    detail::agree(port, detail::read_port(env, "MASTER_PORT"), "node 0's port");
    if (addr) out.master_addr = addr->value;
    if (port) out.master_port = port->value;
  }
  if (auto id = detail::read_text(env, pet_rdzv_id_variable)) out.rdzv_id = id->value;
  if (auto v = detail::read_int(env, max_restarts_variable)) out.max_restarts = v->value;
  if (auto t = detail::read_seconds(env, grace_period_variable)) out.grace_period = *t;
  if (auto t = detail::read_seconds(env, heartbeat_timeout_variable)) out.heartbeat_timeout = *t;
  if (auto f = detail::read_flag(env, tee_variable)) out.tee = *f;
  if (auto dir = env.get(log_dir_variable); dir && !dir->empty()) out.log_dir = std::string(*dir);
  if (auto f = detail::read_flag(env, local_rank_arg_variable)) out.local_rank_arg = *f;
  if (auto v = detail::read_int(env, metrics_port_variable)) out.metrics_port = v->value;
  out.check();
  return out;
}

DTRAIN_DETAIL_INLINE void agent_options::check() const {
  auto at_least = [](const char* name, const std::optional<int>& v, int least) {
    if (v && *v < least) {
      throw config_error("option " + std::string(name) + "=" + std::to_string(*v) +
                         " must be at least " + std::to_string(least));
    }
  };
  at_least("nproc_per_node", nproc_per_node, 1);
  at_least("nnodes", nnodes, 1);
  at_least("min_nnodes", min_nnodes, 1);
  if (min_nnodes && (!nnodes || *min_nnodes > *nnodes)) {
    throw config_error("option min_nnodes=" + std::to_string(*min_nnodes) +
                       (nnodes ? " is more than nnodes=" + std::to_string(*nnodes)
                               : " needs nnodes (the most nodes)"));
  }
  at_least("node_rank", node_rank, 0);
  auto at_most = [](const char* name, const std::optional<int>& v) {
    if (v && *v > max_world_size) {
      throw config_error("option " + std::string(name) + "=" + std::to_string(*v) +
                         " is more than dtrain's limit of " + std::to_string(max_world_size) +
                         " ranks (max_world_size)");
    }
  };
  at_most("nproc_per_node", nproc_per_node);
  at_most("nnodes", nnodes);
  if (max_restarts < 0) {
    throw config_error("option max_restarts=" + std::to_string(max_restarts) + " is negative");
  }
  if (grace_period.count() < 0) throw config_error("option grace_period is negative");
  if (heartbeat_timeout.count() <= 0) {
    throw config_error("option heartbeat_timeout=" + std::to_string(heartbeat_timeout.count()) +
                       " ms must be positive");
  }
  if (master_port && *master_port != 0) {
    detail::check_port("option master_port=" + std::to_string(*master_port), *master_port);
  }
  if (master_addr && master_addr->empty()) throw config_error("option master_addr is empty");
  if (metrics_port && *metrics_port != 0) {
    detail::check_port("option metrics_port=" + std::to_string(*metrics_port), *metrics_port);
  }
}

}  // namespace dtrain
