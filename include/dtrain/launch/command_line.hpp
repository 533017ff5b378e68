#pragma once
/// @file
/// dtrun's flags, read by one parser for the two programs that take them:
/// dtrun itself (its flags, then the program to run), and a self-launching
/// program (dtrain::run under launch::per_node), which finds them among its
/// own arguments. Each flag sets an agent option (`--standalone` four,
/// `--rdzv-endpoint` two); a bad value is a config_error naming the flag as it
/// was typed and its value. torchrun's flags that dtrun has no use for are
/// refused by name, with the dtrun flags that say the same.

#include <dtrain/config.hpp>
#include <dtrain/detail/parse.hpp>
#include <dtrain/error.hpp>
#include <dtrain/launch/options.hpp>

#include <bitset>
#include <chrono>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::detail {

/// The agent options that flags set.
enum class agent_field : unsigned {
  nproc_per_node,
  nnodes,
  min_nnodes,  // set with nnodes: --nnodes MIN:MAX
  node_rank,
  master_addr,
  master_port,
  max_restarts,
  grace_period,
  heartbeat_timeout,
  tee,
  log_dir,
  local_rank_arg,
  rdzv_id,
  count
};

/// Calls `fn(&agent_options::<option>)` and returns what it returns.
template <class Fn>
decltype(auto) visit_field(agent_field option, Fn&& fn) {
  switch (option) {
    case agent_field::nproc_per_node: return fn(&agent_options::nproc_per_node);
    case agent_field::nnodes: return fn(&agent_options::nnodes);
    case agent_field::min_nnodes: return fn(&agent_options::min_nnodes);
    case agent_field::node_rank: return fn(&agent_options::node_rank);
    case agent_field::master_addr: return fn(&agent_options::master_addr);
    case agent_field::master_port: return fn(&agent_options::master_port);
    case agent_field::max_restarts: return fn(&agent_options::max_restarts);
    case agent_field::grace_period: return fn(&agent_options::grace_period);
    case agent_field::heartbeat_timeout: return fn(&agent_options::heartbeat_timeout);
    case agent_field::tee: return fn(&agent_options::tee);
    case agent_field::log_dir: return fn(&agent_options::log_dir);
    case agent_field::rdzv_id: return fn(&agent_options::rdzv_id);
    case agent_field::local_rank_arg:
    case agent_field::count: break;
  }
  return fn(&agent_options::local_rank_arg);
}

/// dtrun's flags as found on one command line (argv without the program's
/// name), and for dtrun the program after them. Flags take their value as
/// `--flag value` or `--flag=value`; `_` may replace `-` in their names
/// (torchrun's `--nproc_per_node`); of a flag given twice, the last counts.
/// Node 0's store is `--master-addr`/`--master-port` (or `--standalone`), or
/// torchrun's `--rdzv-endpoint HOST[:PORT]` (with `--rdzv-backend c10d`): the
/// two ways must agree when both are given.
class agent_flags {
 public:
  /// dtrun's command line: flags first; `--`, or the first argument that is
  /// not a flag, begins the program, which gets every argument after it. An
  /// unknown flag is a config_error; `--help` (or `-h`) ends the parsing.
  [[nodiscard]] static agent_flags of_launcher(std::span<const std::string_view> args);

  /// A self-launching program's command line: dtrun's flags wherever they
  /// are before `--`, except `--help`, `--no-python` and `-m`/`--module`,
  /// which stay the program's. Every other argument is the program's own and
  /// is skipped.
  [[nodiscard]] static agent_flags of_program(std::span<const std::string_view> args);

  /// Sets every option that a flag gave: the flags win (dtrun).
  void apply(agent_options& options) const {
    for_each_given([&](auto member) { options.*member = values_.*member; });
  }

  /// Sets the options that a flag gave and `options` leaves at agent_options'
  /// defaults: options set in the program's code win (dtrain::run).
  void fill(agent_options& options) const;

  /// The options as the flags set them (the others at their defaults).
  [[nodiscard]] const agent_options& values() const noexcept { return values_; }
  /// Whether a flag set `option`.
  [[nodiscard]] bool given(agent_field option) const noexcept {
    return given_.test(static_cast<std::size_t>(option));
  }
  /// dtrun: `--help` or `-h` was given.
  [[nodiscard]] bool help() const noexcept { return help_; }
  /// dtrun: `--no-python` was given (run a .py program directly).
  [[nodiscard]] bool no_python() const noexcept { return no_python_; }
  /// dtrun: `-m` or `--module` was given (the program is a Python module).
  [[nodiscard]] bool module() const noexcept { return module_; }
  /// dtrun: the program and its arguments.
  [[nodiscard]] const std::vector<std::string>& program() const noexcept { return program_; }
  /// dtrun: the workers' command, as torchrun runs it: the program under
  /// `python3 -u` when it is a `.py` file (unless `--no-python`), as
  /// `python3 -u -m MODULE args...` with `-m`, else as given.
  [[nodiscard]] std::vector<std::string> command() const;

 private:
  template <class Fn>
  void for_each_given(Fn fn) const {
    for (std::size_t f = 0; f < static_cast<std::size_t>(agent_field::count); ++f) {
      if (given_.test(f)) visit_field(static_cast<agent_field>(f), fn);
    }
  }

  void set(agent_field option) { given_.set(static_cast<std::size_t>(option)); }

  // Reads the flag at args[i] (and its value, moving i past it); false when it is not dtrun's.
  bool read(std::span<const std::string_view> args, std::size_t& i, bool launcher);

  struct valued {
    std::string_view name;
    agent_field field;
    std::string_view what;
    std::string_view example;
  };

  static const valued* find(std::string_view name);

  void take(agent_field option, const std::string& origin, std::string_view value);
  // --rdzv-backend, --rdzv-endpoint, --rdzv-conf: no option of their own.
  void take_rdzv(std::string_view name, const std::string& origin, std::string_view value);

  // Which flag set node 0's address or port, and whether it was --rdzv-endpoint.
  struct store_source {
    std::string origin;
    bool endpoint = false;
  };
  // Sets master_addr or master_port; --rdzv-endpoint and the other flags must agree.
  template <class T>
  void set_store(std::optional<T> agent_options::*member, agent_field option, T value,
                 std::optional<store_source>& source, store_source from, std::string_view what);

  agent_options values_{};
  std::bitset<static_cast<std::size_t>(agent_field::count)> given_{};
  bool help_ = false;
  bool no_python_ = false;
  bool module_ = false;
  std::optional<store_source> addr_from_;
  std::optional<store_source> port_from_;
  std::vector<std::string> program_;
};

template <class T>
void agent_flags::set_store(std::optional<T> agent_options::*member, agent_field option, T value,
                            std::optional<store_source>& source, store_source from,
                            std::string_view what) {
  if (source && source->endpoint != from.endpoint && values_.*member != value) {
    throw config_error(source->origin + " and " + from.origin + " disagree about " +
                       std::string(what) + "; give one of them");
  }
  values_.*member = std::move(value);
  source = std::move(from);
  set(option);
}

#if DTRAIN_DETAIL_BODIES()
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
    if (flags.help_) return flags;
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
#endif  // DTRAIN_DETAIL_BODIES()

}  // namespace dtrain::detail
