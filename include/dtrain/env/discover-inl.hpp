#pragma once
/// @file
/// The non-template bodies of dtrain/env/discover.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/env/discover.hpp, not this file.

#include <dtrain/env/discover.hpp>

namespace dtrain {
namespace detail {

DTRAIN_DETAIL_INLINE std::vector<observation> read_launchers(const environment& env,
                                                             const observation& env_url,
                                                             std::string& notes) {
  std::vector<observation> found;
  auto keep = [&](observation o) {
    if (!o.note.empty()) notes += (notes.empty() ? "" : "; ") + o.note;
    if (o.is_launcher()) found.push_back(std::move(o));
  };
  keep(env_url);
  keep(read_tf_config(env));
  keep(read_horovod(env));
  keep(read_open_mpi(env));
  keep(read_hydra(env));
  keep(read_slurm(env));
  return found;
}

DTRAIN_DETAIL_INLINE observation reconcile(std::vector<observation> launchers, std::string& notes) {
  observation primary = std::move(launchers.front());
  for (std::size_t i = 1; i < launchers.size(); ++i) {
    const observation& other = launchers[i];
    if (other[field::world_size]->value == primary[field::world_size]->value) {
      for (std::size_t f = 0; f < count_fields; ++f) agree(primary, field(f), other.counts[f]);
      if (!primary.fallback_addr) {
        primary.fallback_addr = other.fallback_addr;
        primary.fallback_port = other.fallback_port;
      }
      continue;
    }
    const auto& local = other[field::local_world_size];
    if (local && local->value == 1) {
      notes += std::string(notes.empty() ? "" : "; ") + "outer launcher " +
               std::string(to_string(other.source)) + " ran one process per node (" +
               other[field::world_size]->origin +
               "); its variables describe that process, not this one";
      continue;
    }
    throw config_error(
        primary[field::world_size]->origin + " (" + std::string(to_string(primary.source)) +
        ") and " + other[field::world_size]->origin + " (" + std::string(to_string(other.source)) +
        ") disagree about the world size; "
        "an outer launcher is accepted only with the same process count or with one process per "
        "node");
  }
  return primary;
}

DTRAIN_DETAIL_INLINE void fill_master(world& w, const environment& env, const observation& primary,
                                      std::string& notes) {
  auto m = read_explicit_master(env);
  if (!m.note.empty()) notes += (notes.empty() ? "" : "; ") + m.note;
  auto addr = m.addr ? m.addr : primary.fallback_addr;
  auto port = m.port ? m.port : primary.fallback_port;
  if (addr) {
    w.master_addr = addr->value;
    w.origins[static_cast<std::size_t>(field::master_addr)] = addr->origin;
  }
  if (port) {
    w.master_port = port->value;
    w.origins[static_cast<std::size_t>(field::master_port)] = port->origin;
  }
}

DTRAIN_DETAIL_INLINE void complete_and_check(observation& o) {
  const auto& ws = o[field::world_size];
  const auto& ls = o[field::local_world_size];
  // Every process is on this node: one node, and the local rank is the rank.
  if (ws && ls && ws->value == ls->value) {
    std::string why = "all " + ws->origin + " processes are local: " + ls->origin;
    agree(o, field::node_rank, sourced_int{0, why});
    agree(o, field::num_nodes, sourced_int{1, why});
    agree(o, field::local_rank, o[field::rank]);
  }
  // As many nodes as processes: one process per node, whose node rank is its rank.
  if (const auto& nn = o[field::num_nodes]; ws && nn && ws->value == nn->value) {
    std::string why = "one process per node: " + nn->origin + " nodes for " + ws->origin;
    agree(o, field::local_rank, sourced_int{0, why});
    agree(o, field::local_world_size, sourced_int{1, why});
    if (const auto& r = o[field::rank]) agree(o, field::node_rank, sourced_int{r->value, why});
  }
  for (field size : {field::world_size, field::local_world_size, field::num_nodes}) {
    if (const auto& s = o[size]; s && s->value < 1)
      throw config_error(s->origin + " must be at least 1");
  }
  auto check_below = [&](field lower, field upper) {
    if (o[lower] && o[upper] && o[lower]->value >= o[upper]->value) {
      throw config_error(not_below(*o[lower], *o[upper]));
    }
  };
  check_below(field::rank, field::world_size);
  check_below(field::local_rank, field::local_world_size);
  check_below(field::node_rank, field::num_nodes);
  // Without a local size or a node count (Azure ML's PyTorch jobs set
  // neither), a local rank or node rank is at least below the world size.
  check_below(field::local_rank, field::world_size);
  check_below(field::node_rank, field::world_size);
  if (ls && ws && ls->value > ws->value) {
    throw config_error(ls->origin + " is larger than " + ws->origin);
  }
  if (const auto& nn = o[field::num_nodes]; nn && ws && nn->value > ws->value) {
    throw config_error(nn->origin + " is larger than " + ws->origin);
  }
  if (const auto& nn = o[field::num_nodes];
      nn && nn->value == 1 && ls && ws && ls->value != ws->value) {
    throw config_error(nn->origin + " says one node, but " + ls->origin + " differs from " +
                       ws->origin);
  }
}

DTRAIN_DETAIL_INLINE world to_world(const observation& o) {
  world w;
  w.source = o.source;
  w.role = o.role;
  std::array<std::optional<int>*, count_fields> slots{
      &w.rank, &w.world_size, &w.local_rank, &w.local_world_size, &w.node_rank, &w.num_nodes};
  for (std::size_t f = 0; f < count_fields; ++f) {
    if (o.counts[f]) {
      *slots[f] = o.counts[f]->value;
      w.origins[f] = o.counts[f]->origin;
    }
  }
  return w;
}

DTRAIN_DETAIL_INLINE world discover_per_process(const environment& env,
                                                std::span<const std::string_view> args,
                                                std::string& notes) {
  observation loose = read_env_url(env);
  std::vector<observation> launchers = read_launchers(env, loose, notes);

  observation o;
  if (launchers.empty()) {
    if (loose.world_size_alone) {
      throw config_error(loose.world_size_alone->origin +
                         " is set but RANK is not; the launcher sets both");
    }
    if (loose[field::node_rank] && loose[field::node_rank]->value != 0) {
      throw config_error(
          loose[field::node_rank]->origin +
          " is set, but nothing gives this process's rank and world size (RANK and WORLD_SIZE, "
          "OMPI_COMM_WORLD_*, PMI_*, SLURM_* under srun, HOROVOD_*, TF_CONFIG). "
          "A Lightning-style per-node job needs launch::per_node (dtrun), "
          "which starts the workers of the node");
    }
    const std::string single = "a single process: no launcher variables";
    for (std::size_t f = 0; f < count_fields; ++f) {
      bool is_size = field(f) == field::world_size || field(f) == field::local_world_size ||
                     field(f) == field::num_nodes;
      o.counts[f] = sourced_int{is_size ? 1 : 0, single};
    }
  } else {
    o = reconcile(std::move(launchers), notes);
  }
  // Loose variables (LOCAL_RANK, NODE_RANK, ... without RANK) must agree with the launcher.
  if (!loose.is_launcher()) {
    for (std::size_t f = 0; f < count_fields; ++f) agree(o, field(f), loose.counts[f]);
    agree(o, field::world_size, loose.world_size_alone);
  }
  agree(o, field::local_rank, read_argv_local_rank(args));
  complete_and_check(o);
  world w = to_world(o);
  fill_master(w, env, o, notes);
  return w;
}

DTRAIN_DETAIL_INLINE world discover_per_node(const environment& env,
                                             std::span<const std::string_view> args,
                                             const discover_options& opt, std::string& notes) {
  if (auto local = read_argv_local_rank(args)) {
    throw config_error(local->origin +
                       " is a worker's argument; a per-node agent assigns local ranks itself");
  }
  observation loose = read_env_url(env);
  std::vector<observation> launchers = read_launchers(env, loose, notes);

  // The agents' own launcher ran one agent per node: its ranks are node ranks.
  observation node;
  node.role = process_role::node_agent;
  if (!launchers.empty()) {
    observation agents = reconcile(std::move(launchers), notes);
    if (const auto& local = agents[field::local_world_size]; local && local->value != 1) {
      throw config_error("per-node launch runs one agent per node, but " + local->origin);
    }
    if (const auto& lr = agents[field::local_rank]; lr && lr->value != 0) {
      throw config_error("per-node launch runs one agent per node, but " + lr->origin);
    }
    node.source = agents.source;
    node.fallback_addr = agents.fallback_addr;
    node.fallback_port = agents.fallback_port;
    agree(node, field::node_rank, agents[field::rank]);
    agree(node, field::node_rank, agents[field::node_rank]);
    agree(node, field::num_nodes, agents[field::world_size]);
    agree(node, field::num_nodes, agents[field::num_nodes]);
  }
  if (!loose.is_launcher()) {
    if (loose[field::local_rank]) {
      throw config_error(loose[field::local_rank]->origin +
                         " is a worker's variable; a per-node agent assigns local ranks itself");
    }
    agree(node, field::node_rank, loose[field::node_rank]);
    agree(node, field::num_nodes, loose[field::num_nodes]);
    if (node.source == launcher::none && (loose[field::node_rank] || loose[field::num_nodes])) {
      node.source = launcher::env;
    }
  }
  auto option = [](std::string_view name,
                   const std::optional<int>& v) -> std::optional<sourced_int> {
    if (!v) return std::nullopt;
    std::string origin = "option " + std::string(name) + "=" + std::to_string(*v);
    if (*v < 0) throw config_error(origin + " is negative");
    return sourced_int{*v, origin};
  };
  agree(node, field::node_rank, option("node_rank", opt.node_rank));
  agree(node, field::num_nodes, option("nnodes", opt.nnodes));
  agree(node, field::local_world_size, option("nproc_per_node", opt.nproc_per_node));
  if (!node[field::node_rank] && !node[field::num_nodes] && node.source == launcher::none) {
    const std::string single = "a single node: no launcher variables";
    node[field::node_rank] = sourced_int{0, single};
    node[field::num_nodes] = sourced_int{1, single};
  }
  if (node[field::local_world_size] && node[field::num_nodes]) {
    const auto& per = *node[field::local_world_size];
    const auto& nn = *node[field::num_nodes];
    const std::int64_t size = std::int64_t{per.value} * nn.value;  // two ints: no overflow here
    if (size > max_world_size) {
      throw config_error(per.origin + " × " + nn.origin + " = " + std::to_string(size) +
                         " ranks, more than dtrain's limit of " + std::to_string(max_world_size) +
                         " (max_world_size)");
    }
    node[field::world_size] = sourced_int{static_cast<int>(size), per.origin + " × " + nn.origin};
    agree(node, field::world_size, loose.world_size_alone);  // a recipe's WORLD_SIZE: the workers
  }
  complete_and_check(node);
  world w = to_world(node);
  fill_master(w, env, node, notes);
  return w;
}
}  // namespace detail
}  // namespace dtrain

namespace dtrain {

DTRAIN_DETAIL_INLINE world discover_world(const environment& env,
                                          std::span<const std::string_view> args,
                                          const discover_options& options) {
  std::string notes;
  world w = options.mode == launch_mode::per_node
                ? detail::discover_per_node(env, args, options, notes)
                : detail::discover_per_process(env, args, notes);
  w.notes = std::move(notes);
  return w;
}

DTRAIN_DETAIL_INLINE world discover_world(int argc, const char* const* argv,
                                          const discover_options& options) {
  std::vector<std::string_view> args;
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  return discover_world(environment::from_process(), args, options);
}

}  // namespace dtrain
