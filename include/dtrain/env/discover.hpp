#pragma once
/// @file
/// discover_world(): who this process is, as a pure function of (environment,
/// argv, options). See docs/launching.md's launcher table for what each launcher
/// sets and how dtrain reads it.

#include <dtrain/config.hpp>
#include <dtrain/detail/parse.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/launchers.hpp>
#include <dtrain/env/world.hpp>
#include <dtrain/error.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain {

/// Whether the process being described is a worker started by the outside
/// launcher, or a per-node agent that starts the workers of its node.
enum class launch_mode { per_process, per_node };

/// What the caller knows beyond the environment. Values given here are
/// checked against the environment like any other source.
struct discover_options {
  launch_mode mode = launch_mode::per_process;
  std::optional<int> nproc_per_node{};  ///< per_node: workers this agent starts
  std::optional<int> nnodes{};          ///< per_node: number of nodes (agents)
  std::optional<int> node_rank{};       ///< per_node: this agent's node
};

namespace detail {

inline constexpr std::array<std::string_view, count_fields> field_phrases{
    "the rank",      "the world size",     "the local rank", "the local world size",
    "the node rank", "the number of nodes"};

inline void agree(observation& into, field f, const std::optional<sourced_int>& v) {
  agree(into[f], v, field_phrases[static_cast<std::size_t>(f)]);
}

/// Every launcher present, innermost first. env:// comes first because it is
/// what an agent (torchrun, dtrun) sets for its workers, or what a user's
/// script copied from the outer launcher; Slurm comes last because mpirun and
/// mpiexec start their daemons through srun inside an allocation.
DTRAIN_DETAIL_INLINE std::vector<observation> read_launchers(const environment& env,
                                                             const observation& env_url,
                                                             std::string& notes);

/// Reconciles the launchers: the first is this process's own; another with
/// the same process count must agree field by field; one with a different
/// count is accepted only as an outer launcher that ran one process per node
/// (torchrun under srun, a node agent under mpirun), and is then not used.
DTRAIN_DETAIL_INLINE observation reconcile(std::vector<observation> launchers, std::string& notes);

/// The master's address and port (read_explicit_master(), else the
/// launcher's own); a note on which was used is added to `notes`.
DTRAIN_DETAIL_INLINE void fill_master(world& w, const environment& env, const observation& primary,
                                      std::string& notes);

inline std::string not_below(const sourced_int& lower, const sourced_int& upper) {
  return lower.origin + " is not below " + upper.origin;
}

/// Derives what follows for certain and checks what must hold.
DTRAIN_DETAIL_INLINE void complete_and_check(observation& o);

DTRAIN_DETAIL_INLINE world to_world(const observation& o);

DTRAIN_DETAIL_INLINE world discover_per_process(const environment& env,
                                                std::span<const std::string_view> args,
                                                std::string& notes);

DTRAIN_DETAIL_INLINE world discover_per_node(const environment& env,
                                             std::span<const std::string_view> args,
                                             const discover_options& opt, std::string& notes);

}  // namespace detail

/// Who this process is, from `env` and `args` (argv without the program
/// name). Throws config_error naming every variable involved, with its value,
/// when a value is malformed or two sources disagree. Never blocks.
[[nodiscard]] DTRAIN_DETAIL_INLINE world discover_world(const environment& env,
                                                        std::span<const std::string_view> args = {},
                                                        const discover_options& options = {});

/// Same, from the process's own environment and main()'s argc/argv.
[[nodiscard]] DTRAIN_DETAIL_INLINE world discover_world(int argc, const char* const* argv,
                                                        const discover_options& options = {});

}  // namespace dtrain

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/env/discover-inl.hpp>
#endif
