#pragma once
/// @file
/// The non-template bodies of dtrain/launch/command_line.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/launch/command_line.hpp, not this file.

#include <dtrain/launch/command_line.hpp>

namespace dtrain::detail {

DTRAIN_DETAIL_INLINE agent_flags agent_flags::of_launcher(std::span<const std::string_view> args) {
  agent_flags flags;
  std::size_t i = 0;
  for (; i < args.size(); ++i) {
    if (args[i] == "--") {
      ++i;
      break;
    }
    if (!args[i].starts_with("--") && args[i] != "-h" && args[i] != "-m") break;
    if (!flags.read(args, i, true)) {
      throw config_error("unknown option " + std::string(args[i]) + " (see dtrun --help)");
    }
    if (flags.help_ || !flags.flight_records_.empty()) return flags;
  }
  for (; i < args.size(); ++i) flags.program_.emplace_back(args[i]);
  if (flags.module_ && flags.no_python_) {
    throw config_error(
        "-m (--module) and --no-python on the command line exclude each other: "
        "-m runs the module under python3 -u -m, --no-python runs the program without python3");
  }
  return flags;
}

DTRAIN_DETAIL_INLINE std::vector<std::string> agent_flags::command() const {
  std::vector<std::string> argv;
  if (module_) {
    argv = {"python3", "-u", "-m"};
  } else if (!no_python_ && !program_.empty() && program_.front().ends_with(".py")) {
    argv = {"python3", "-u"};
  }
  argv.insert(argv.end(), program_.begin(), program_.end());
  return argv;
}

DTRAIN_DETAIL_INLINE agent_flags agent_flags::of_program(std::span<const std::string_view> args) {
  agent_flags flags;
  for (std::size_t i = 0; i < args.size() && args[i] != "--"; ++i) {
    if (args[i].starts_with("--")) (void)flags.read(args, i, false);
  }
  return flags;
}

DTRAIN_DETAIL_INLINE void agent_flags::fill(agent_options& options) const {
  const agent_options defaults{};
  for_each_given([&](auto member) {
    if (options.*member == defaults.*member) options.*member = values_.*member;
  });
}

DTRAIN_DETAIL_INLINE bool agent_flags::read(std::span<const std::string_view> args, std::size_t& i,
                                            bool launcher) {
  const std::string_view arg = args[i];
  const std::size_t eq = arg.find('=');
  const std::string_view typed = arg.substr(0, eq);
  std::string name(typed);
  for (char& c : name) {
    if (c == '_') c = '-';
  }
  if (launcher && (name == "--help" || name == "-h")) return help_ = true;
  if (launcher && name == "--no-python") return no_python_ = true;
  if (launcher && name == "--flight-records") {
    if (eq != std::string_view::npos) {
      flight_records_ = std::string(arg.substr(eq + 1));
    } else if (i + 1 < args.size()) {
      flight_records_ = std::string(args[++i]);
    }
    if (flight_records_.empty()) {
      throw config_error(std::string(arg) +
                         " on the command line: needs a directory (--flight-records DIR)");
    }
    return true;
  }
  if (launcher && (name == "-m" || name == "--module")) {
    if (eq != std::string_view::npos) {
      throw config_error(std::string(arg) + " on the command line: " + std::string(typed) +
                         " takes no value (the module is the program: -m pkg.train args...)");
    }
    return module_ = true;
  }
  if (name == "--standalone" || name == "--tee" || name == "--pass-local-rank") {
    if (eq != std::string_view::npos) {
      throw config_error(std::string(arg) + " on the command line: " + std::string(typed) +
                         " takes no value");
    }
    if (name == "--tee") {
      values_.tee = true;
      set(agent_field::tee);
    } else if (name == "--pass-local-rank") {
      values_.local_rank_arg = true;
      set(agent_field::local_rank_arg);
    } else {
      values_.nnodes = 1;
      values_.min_nnodes = std::nullopt;
      values_.node_rank = 0;
      for (auto f : {agent_field::nnodes, agent_field::min_nnodes, agent_field::node_rank}) set(f);
      const store_source standalone{"--standalone (127.0.0.1, a free port)", false};
      set_store(&agent_options::master_addr, agent_field::master_addr, std::string("127.0.0.1"),
                addr_from_, standalone, "node 0's address");
      set_store(&agent_options::master_port, agent_field::master_port, 0, port_from_, standalone,
                "node 0's port");
    }
    return true;
  }
  const valued* flag = find(name);
  if (flag == nullptr) return false;
  std::string_view value;
  if (eq != std::string_view::npos) {
    value = arg.substr(eq + 1);
  } else if (i + 1 < args.size()) {
    value = args[++i];
  } else {
    throw config_error(std::string(typed) + " on the command line needs a value (" +
                       std::string(flag->what) + ", e.g. " + std::string(typed) + " " +
                       std::string(flag->example) + ")");
  }
  const std::string origin = std::string(typed) + "=" + std::string(value) + " on the command line";
  if (flag->field == agent_field::count) {
    take_rdzv(flag->name, origin, value);
  } else {
    take(flag->field, origin, value);
    set(flag->field);
  }
  return true;
}

DTRAIN_DETAIL_INLINE auto agent_flags::find(std::string_view name) -> const valued* {
  static constexpr valued flags[] = {
      {"--nproc-per-node", agent_field::nproc_per_node, "workers per node", "4"},
      {"--nnodes", agent_field::nnodes, "nodes in the job (MIN:MAX: elastic)", "2"},
      {"--node-rank", agent_field::node_rank, "this node's index", "0"},
      {"--master-addr", agent_field::master_addr, "node 0's address", "node0"},
      {"--master-port", agent_field::master_port, "node 0's store port", "29500"},
      {"--max-restarts", agent_field::max_restarts, "restarts after a failure", "1"},
      {"--grace-period", agent_field::grace_period, "seconds from SIGTERM to SIGKILL", "10"},
      {"--heartbeat-timeout", agent_field::heartbeat_timeout, "seconds", "10"},
      {"--log-dir", agent_field::log_dir, "a directory", "logs"},
      {"--rdzv-id", agent_field::rdzv_id, "the job's id, the same on every node", "job42"},
      {"--metrics-port", agent_field::metrics_port, "the metrics endpoint's port", "9400"},
      // No option of their own (agent_field::count): take_rdzv() reads them.
      {"--rdzv-backend", agent_field::count, "c10d: node 0's store", "c10d"},
      {"--rdzv-endpoint", agent_field::count, "node 0's store as HOST[:PORT]", "node0:29400"},
      {"--rdzv-conf", agent_field::count, "KEY=VALUE,...", "join_timeout=600"},
  };
  for (const valued& f : flags) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

DTRAIN_DETAIL_INLINE void agent_flags::take(agent_field option, const std::string& origin,
                                            std::string_view value) {
  auto at_least = [&](int least, const char* unit) {
    const int n = parse_non_negative(origin, value);
    if (n < least) {
      throw config_error(origin + " must be at least " + std::to_string(least) + " (" + unit + ")");
    }
    return n;
  };
  auto text = [&] {
    if (value.empty()) throw config_error(origin + " is empty");
    return std::string(value);
  };
  switch (option) {
    case agent_field::nproc_per_node:
      values_.nproc_per_node = parse_nproc_per_node(origin, value).value;
      break;
    case agent_field::nnodes: {
      const auto [least, most] = parse_node_count(origin, value);
      values_.nnodes = most;
      values_.min_nnodes = least;
      set(agent_field::min_nnodes);  // "--nnodes N" after "--nnodes 1:2" is not elastic
      break;
    }
    case agent_field::node_rank: values_.node_rank = parse_non_negative(origin, value); break;
    case agent_field::master_addr:
      set_store(&agent_options::master_addr, option, text(), addr_from_, {origin, false},
                "node 0's address");
      break;
    case agent_field::master_port: {
      const int port = parse_non_negative(origin, value);
      if (port != 0) check_port(origin, port);  // 0: a free port (one node only)
      set_store(&agent_options::master_port, option, port, port_from_, {origin, false},
                "node 0's port");
      break;
    }
    case agent_field::max_restarts: values_.max_restarts = parse_non_negative(origin, value); break;
    case agent_field::grace_period:
      values_.grace_period = std::chrono::seconds(parse_non_negative(origin, value));
      break;
    case agent_field::heartbeat_timeout:
      values_.heartbeat_timeout = std::chrono::seconds(at_least(1, "seconds"));
      break;
    case agent_field::log_dir: values_.log_dir = text(); break;
    case agent_field::rdzv_id: values_.rdzv_id = text(); break;
    case agent_field::metrics_port: {
      const int port = parse_non_negative(origin, value);
      if (port != 0) check_port(origin, port);  // 0: a free one
      values_.metrics_port = port;
      break;
    }
    case agent_field::min_nnodes:  // comes with --nnodes
    case agent_field::tee:
    case agent_field::local_rank_arg:
    case agent_field::count: break;
  }
}

DTRAIN_DETAIL_INLINE void agent_flags::take_rdzv(std::string_view name, const std::string& origin,
                                                 std::string_view value) {
  if (name == "--rdzv-backend") {
    check_rdzv_backend(origin, value);
  } else if (name == "--rdzv-endpoint") {
    auto [host, port] = parse_rdzv_endpoint(origin, value);
    set_store(&agent_options::master_addr, agent_field::master_addr, std::move(host.value),
              addr_from_, {origin, true}, "node 0's address");
    set_store(&agent_options::master_port, agent_field::master_port, port.value, port_from_,
              {port.origin, true}, "node 0's port");
  } else {
    throw config_error(origin +
                       ": dtrun has no rendezvous settings of torchrun's; "
                       "its waits are bounded by DTRAIN_STORE_TIMEOUT (join_timeout, timeout), "
                       "and nodes are lost after --heartbeat-timeout");
  }
}

}  // namespace dtrain::detail
