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
  metrics_port,
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
    case agent_field::metrics_port: return fn(&agent_options::metrics_port);
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
  /// unknown flag is a config_error; `--help` (or `-h`) and
  /// `--flight-records DIR` end the parsing.
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
  /// dtrun: the directory of `--flight-records DIR` (read a job's flight
  /// records and print its diagnostics table); empty when not given.
  [[nodiscard]] const std::string& flight_records() const noexcept { return flight_records_; }
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
  std::string flight_records_;
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

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/launch/command_line-inl.hpp>
#endif
