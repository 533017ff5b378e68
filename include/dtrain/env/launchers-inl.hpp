#pragma once
/// @file
/// The non-template bodies of dtrain/env/launchers.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/env/launchers.hpp, not this file.

#include <dtrain/env/launchers.hpp>

namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE void read_rank_and_size(const environment& env, observation& o,
                                             std::string_view rank_var, std::string_view size_var) {
  o[field::rank] = read_int(env, rank_var);
  o[field::world_size] = read_int(env, size_var);
  if (o[field::rank].has_value() != o[field::world_size].has_value()) {
    const auto& set = o[field::rank] ? o[field::rank] : o[field::world_size];
    throw config_error(set->origin + " is set but " +
                       std::string(o[field::rank] ? size_var : rank_var) +
                       " is not; the launcher sets both");
  }
}

DTRAIN_DETAIL_INLINE observation read_env_url(const environment& env) {
  observation o;
  o.source = launcher::env;
  o[field::rank] = read_int(env, "RANK");
  if (auto size = read_int(env, "WORLD_SIZE"); size && !o[field::rank]) {
    o.world_size_alone = std::move(size);  // the launcher's must agree (discover_*)
  } else if (!size && o[field::rank]) {
    throw config_error(o[field::rank]->origin +
                       " is set but WORLD_SIZE is not; the launcher sets both");
  } else {
    o[field::world_size] = std::move(size);
  }
  o[field::local_rank] = read_int(env, "LOCAL_RANK");
  o[field::local_world_size] = read_int(env, "LOCAL_WORLD_SIZE");
  o[field::node_rank] = read_int(env, "GROUP_RANK");  // torchrun's name for the node index
  // torchrun numbers its workers node by node, the same count on each.
  const auto& group = o[field::node_rank];
  const auto& rank = o[field::rank];
  const auto& local_rank = o[field::local_rank];
  const auto& local_size = o[field::local_world_size];
  if (group && rank && local_rank && local_size &&
      std::int64_t{group->value} * local_size->value + local_rank->value != rank->value) {
    throw config_error(rank->origin + " is not " + group->origin + " × " + local_size->origin +
                       " + " + local_rank->origin + " (torchrun numbers the ranks node by node)");
  }
  agree(o[field::node_rank], read_int(env, "NODE_RANK"), "the node rank");
  o[field::num_nodes] = read_int(env, "GROUP_WORLD_SIZE");
  const auto& ws = o[field::world_size];
  const auto& nodes = o[field::num_nodes];
  const auto& local = o[field::local_world_size];
  // torchrun starts the same number of workers on every node.
  if (ws && nodes && nodes->value > 0 && ws->value % nodes->value != 0) {
    throw config_error(ws->origin + " is not divisible into " + nodes->origin +
                       " nodes with the same number of workers each");
  }
  if (ws && nodes && local && ws->value != nodes->value * local->value) {
    throw config_error(ws->origin + " is not " + local->origin + " workers per node times " +
                       nodes->origin + " nodes");
  }
  return o;
}

DTRAIN_DETAIL_INLINE std::optional<sourced_int> read_argv_local_rank(
    std::span<const std::string_view> args) {
  std::optional<sourced_int> found;
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string_view a = args[i];
    if (a == "--") break;
    for (std::string_view flag :
         {std::string_view("--local_rank"), std::string_view("--local-rank")}) {
      std::optional<std::string_view> text;
      std::string origin;
      if (a == flag) {
        if (i + 1 >= args.size()) throw config_error("argv " + std::string(flag) + " has no value");
        text = args[i + 1];
        origin = "argv " + std::string(flag) + " " + std::string(*text);
      } else if (a.size() > flag.size() && a.substr(0, flag.size()) == flag &&
                 a[flag.size()] == '=') {
        text = a.substr(flag.size() + 1);
        origin = "argv " + std::string(a);
      }
      if (!text) continue;
      agree(found, sourced_int{parse_non_negative(origin, *text), origin}, "the local rank");
    }
  }
  return found;
}

DTRAIN_DETAIL_INLINE observation read_ranks(const environment& env, launcher source,
                                            const rank_variables& names) {
  observation o;
  o.source = source;
  read_rank_and_size(env, o, names.rank, names.size);
  o[field::local_rank] = read_int(env, names.local_rank);
  o[field::local_world_size] = read_int(env, names.local_size);
  return o;
}

DTRAIN_DETAIL_INLINE observation read_open_mpi(const environment& env) {
  observation o = read_ranks(env, launcher::open_mpi,
                             {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                              "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"});
  if (o[field::rank]) o[field::num_nodes] = read_int(env, "OMPI_MCA_orte_num_nodes");
  return o;
}

DTRAIN_DETAIL_INLINE observation read_hydra(const environment& env) {
  return read_ranks(env, launcher::hydra,
                    {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"});
}

DTRAIN_DETAIL_INLINE std::optional<std::pair<std::string_view, std::string_view>> first_set(
    const environment& env, std::initializer_list<std::string_view> names) {
  for (auto name : names) {
    if (auto v = env.get(name)) return std::pair{name, *v};
  }
  return std::nullopt;
}

DTRAIN_DETAIL_INLINE observation read_slurm(const environment& env) {
  observation o;
  o.source = launcher::slurm;
  if (!env.contains("SLURM_PROCID")) return o;
  if (!env.contains("SLURM_STEP_ID") && !env.contains("SLURM_STEPID")) {
    o.source = launcher::none;
    o.note =
        "SLURM_PROCID is set without SLURM_STEP_ID: a Slurm batch script, not an srun task; "
        "its allocation was not taken as this process's world";
    return o;
  }
  o[field::rank] = read_int(env, "SLURM_PROCID");
  auto ntasks_var = first_set(env, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"});
  if (!ntasks_var) {
    throw config_error(o[field::rank]->origin +
                       " is set but none of SLURM_STEP_NUM_TASKS, SLURM_NTASKS, SLURM_NPROCS is");
  }
  o[field::world_size] = read_int(env, ntasks_var->first);
  o[field::local_rank] = read_int(env, "SLURM_LOCALID");
  o[field::node_rank] = read_int(env, "SLURM_NODEID");
  if (auto nn = first_set(env, {"SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"})) {
    o[field::num_nodes] = read_int(env, nn->first);
  }
  if (auto tpn = first_set(env, {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"})) {
    auto what = assignment(tpn->first, tpn->second);
    auto counts = parse_tasks_per_node(tpn->second, what);
    long long total = 0;
    for (int c : counts) total += c;
    const auto& ws = o[field::world_size];
    if (total != ws->value) {
      throw config_error(what + " adds up to " + std::to_string(total) + " tasks, not " +
                         ws->origin);
    }
    if (const auto& nn = o[field::num_nodes];
        nn && counts.size() != static_cast<std::size_t>(nn->value)) {
      throw config_error(what + " lists " + std::to_string(counts.size()) + " nodes, not " +
                         nn->origin);
    }
    if (const auto& node = o[field::node_rank]) {
      if (static_cast<std::size_t>(node->value) >= counts.size()) {
        throw config_error(node->origin + " is not below the " + std::to_string(counts.size()) +
                           " nodes of " + what);
      }
      o[field::local_world_size] =
          sourced_int{counts[static_cast<std::size_t>(node->value)], what + " at " + node->origin};
    }
  }
  if (auto list = first_set(env, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"})) {
    auto what = assignment(list->first, list->second);
    auto hosts = hostlist::parse(list->second, what);
    if (const auto& nn = o[field::num_nodes]; nn && list->first == "SLURM_STEP_NODELIST" &&
                                              hosts.size() != static_cast<std::size_t>(nn->value)) {
      throw config_error(what + " names " + std::to_string(hosts.size()) + " hosts, not " +
                         nn->origin);
    }
    o.fallback_addr = sourced_text{hosts.front(), "first host of " + what};
    if (auto job = read_int(env, "SLURM_JOB_ID")) {
      o.fallback_port = sourced_int{slurm_default_port(job->value), "default for " + job->origin};
    } else {
      o.fallback_port = sourced_int{default_master_port, "default"};
    }
  }
  return o;
}

DTRAIN_DETAIL_INLINE observation read_horovod(const environment& env) {
  observation o =
      read_ranks(env, launcher::horovod,
                 {"HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"});
  auto cross_rank = read_int(env, "HOROVOD_CROSS_RANK");
  auto cross_size = read_int(env, "HOROVOD_CROSS_SIZE");
  const auto& ws = o[field::world_size];
  const auto& lr = o[field::local_rank];
  const auto& ls = o[field::local_world_size];
  bool homogeneous = ws && ls && cross_size && ws->value == ls->value * cross_size->value;
  if ((lr && lr->value == 0) || homogeneous) {
    o[field::node_rank] = cross_rank;
    o[field::num_nodes] = cross_size;
  } else if (cross_rank || cross_size) {
    o.note =
        "HOROVOD_CROSS_RANK/CROSS_SIZE not used as node fields: "
        "nodes run different numbers of processes and this is not local rank 0";
  }
  return o;
}

DTRAIN_DETAIL_INLINE const json::value* json_member(const json::value& obj, std::string_view key,
                                                    json::value::kind kind,
                                                    const std::string& where) {
  const json::value* v = obj.find(key);
  if (v && !v->is(kind)) {
    throw config_error("TF_CONFIG " + where + "\"" + std::string(key) + "\" is " +
                       json::kind_name(v->type) + ", expected " + json::kind_name(kind));
  }
  return v;
}

DTRAIN_DETAIL_INLINE observation read_tf_config(const environment& env) {
  observation o;
  auto text = env.get("TF_CONFIG");
  if (!text) return o;
  o.source = launcher::tf_config;
  auto doc = json::parse(*text, "TF_CONFIG");
  if (!doc.is(json::value::kind::object)) throw config_error("TF_CONFIG is not a JSON object");
  const auto* cluster = json_member(doc, "cluster", json::value::kind::object, "");
  const auto* task = json_member(doc, "task", json::value::kind::object, "");
  if (!cluster) throw config_error("TF_CONFIG has no \"cluster\" object");
  if (!task) throw config_error("TF_CONFIG has no \"task\" object");

  auto hosts = [&](std::string_view key) -> std::vector<std::string> {
    std::vector<std::string> out;
    if (const auto* list = json_member(*cluster, key, json::value::kind::array, "cluster.")) {
      for (const auto& item : list->items) {
        if (!item.is(json::value::kind::string) || item.text.empty()) {
          throw config_error("TF_CONFIG cluster.\"" + std::string(key) +
                             "\" must list \"host:port\" strings");
        }
        out.push_back(item.text);
      }
    }
    return out;
  };
  auto chief = hosts("chief");
  auto master = hosts("master");  // TF1 Estimator's name for the chief
  if (!chief.empty() && !master.empty()) {
    throw config_error("TF_CONFIG lists both cluster.\"chief\" and cluster.\"master\"");
  }
  if (chief.empty()) chief = master;
  if (chief.size() > 1)
    throw config_error("TF_CONFIG lists " + std::to_string(chief.size()) +
                       " chiefs; at most one is allowed");
  auto workers = hosts("worker");
  auto ps = hosts("ps");
  auto evaluators = hosts("evaluator");

  const auto* type = json_member(*task, "type", json::value::kind::string, "task.");
  const auto* index = json_member(*task, "index", json::value::kind::number, "task.");
  if (!type) throw config_error("TF_CONFIG task has no \"type\"");
  std::string_view kind = type->text;
  int idx = 0;
  if (index) {
    idx = parse_non_negative("TF_CONFIG task.index=" + index->text, index->text);
  } else if (kind != "chief" && kind != "master" && kind != "evaluator") {
    throw config_error("TF_CONFIG task of type \"" + type->text + "\" has no \"index\"");
  }
  const std::string task_text =
      "TF_CONFIG task {type: " + type->text + ", index: " + std::to_string(idx) + "}";
  const int world_size = static_cast<int>(chief.size() + workers.size());
  if (world_size == 0) throw config_error("TF_CONFIG cluster has no \"chief\" and no \"worker\"");
  o[field::world_size] =
      sourced_int{world_size, "TF_CONFIG chief + worker count " + std::to_string(world_size)};

  auto check_index = [&](const std::vector<std::string>& list, std::string_view list_name) {
    if (static_cast<std::size_t>(idx) >= list.size()) {
      throw config_error(task_text + " is not below the " + std::to_string(list.size()) +
                         " entries of cluster.\"" + std::string(list_name) + "\"");
    }
  };
  if (kind == "chief" || kind == "master") {
    check_index(chief, kind);
    o[field::rank] = sourced_int{0, task_text};
  } else if (kind == "worker") {
    check_index(workers, "worker");
    o[field::rank] = sourced_int{static_cast<int>(chief.size()) + idx, task_text};
  } else if (kind == "ps") {
    check_index(ps, "ps");
    o.role = process_role::parameter_server;
  } else if (kind == "evaluator") {
    if (!evaluators.empty()) check_index(evaluators, "evaluator");
    o.role = process_role::evaluator;
  } else {
    throw config_error(task_text +
                       " has an unknown type (expected chief, master, worker, ps or evaluator)");
  }
  const std::string& first = chief.empty() ? workers.front() : chief.front();
  const std::string what =
      "TF_CONFIG " + std::string(chief.empty() ? "worker[0]" : "chief[0]") + "=" + first;
  auto hp = split_host_port(what, first);
  o.fallback_addr = sourced_text{hp.host, what};
  if (hp.port) o.fallback_port = sourced_int{*hp.port, what};
  return o;
}

DTRAIN_DETAIL_INLINE explicit_master read_explicit_master(const environment& env) {
  explicit_master m;
  m.addr = read_text(env, "MASTER_ADDR");
  if (m.addr) {
    // A host name or an address, as torch takes it: no port (MASTER_PORT's),
    // an IPv6 address with or without its brackets.
    std::string& a = m.addr->value;
    if (a.size() > 2 && a.front() == '[' && a.back() == ']') a = a.substr(1, a.size() - 2);
    const std::size_t colon = a.find(':');
    if (a.find_first_of("[]") != std::string::npos ||
        (colon != std::string::npos && a.find(':', colon + 1) == std::string::npos)) {
      throw config_error(m.addr->origin +
                         " is not a host name or an address (a port goes in MASTER_PORT)");
    }
  }
  m.port = read_port(env, "MASTER_PORT");
  // Azure's: the address only. AZ_BATCH_MASTER_NODE's port is the Batch
  // service's own ("do not use the port specified here for MPI or NCCL
  // communication ... use the variable MASTER_PORT instead": Azure Batch's
  // list of its variables), as DeepSpeed's and Azure ML's own recipes take it.
  // MASTER_ADDR, set by the launcher inside the Azure job (torchrun, Azure
  // ML's PyTorch jobs, a recipe), wins: it may name the same host otherwise.
  std::optional<sourced_text> azure;
  if (auto batch = read_text(env, "AZ_BATCH_MASTER_NODE")) {
    const std::string& v = batch->value;
    if (v.front() != '[' && std::ranges::count(v, ':') > 1) {
      throw config_error(batch->origin + ": an IPv6 address with a port is written [address]:port");
    }
    azure = sourced_text{split_host_port(batch->origin, v).host, batch->origin};
  } else {
    azure = read_text(env, "AZ_BATCHAI_MPI_MASTER_NODE");
  }
  if (azure && !m.addr) {
    m.addr = azure;
  } else if (azure && m.addr->value != azure->value) {
    m.note = m.addr->origin + " names the master, not " + azure->origin + " (the Azure job's)";
  }
  return m;
}

}  // namespace detail
}  // namespace dtrain
