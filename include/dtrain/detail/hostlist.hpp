#pragma once
/// @file
/// Slurm's compressed notations: host lists (`gpu-[01-03,07],cpu5`) and task
/// counts per node (`2(x3),1`). Parsed without expanding, so a hostile or
/// enormous list costs nothing until someone asks for its hosts.

#include <dtrain/config.hpp>
#include <dtrain/detail/parse.hpp>
#include <dtrain/error.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::detail {

/// A parsed Slurm host list.
class hostlist {
 public:
  /// Parses `text`; `what` names it in messages (`SLURM_STEP_NODELIST=...`).
  static hostlist parse(std::string_view text, const std::string& what);

  /// Number of hosts, saturating at SIZE_MAX for absurd lists.
  [[nodiscard]] std::size_t size() const;

  /// The first host: what Slurm-aware launchers use as the master.
  [[nodiscard]] std::string front() const;

  /// All hosts in order; config_error past `limit` hosts.
  [[nodiscard]] std::vector<std::string> expand(std::size_t limit = 1u << 20) const;

 private:
  struct range {
    std::uint64_t first;
    std::uint64_t last;
    std::size_t width;  // digits of the lower bound as written: "01-10" pads to 2

    [[nodiscard]] std::string format(std::uint64_t n) const;
    [[nodiscard]] std::size_t count() const { return static_cast<std::size_t>(last - first + 1); }
  };
  // A piece is literal text, or a bracket of ranges when `ranges` is not empty.
  struct piece {
    std::string literal;
    std::vector<range> ranges;
  };
  using pattern = std::vector<piece>;

  static std::size_t saturating_add(std::size_t a, std::size_t b);
  static std::size_t saturating_mul(std::size_t a, std::size_t b);
  static std::size_t pattern_size(const pattern& p);

  static std::uint64_t parse_bound(std::string_view digits, const std::string& what);

  static pattern parse_pattern(std::string_view text, const std::string& what);

  std::vector<pattern> patterns_;
};

/// Expands Slurm's tasks-per-node notation (`2(x3),1` → 2,2,2,1). `what`
/// names it in messages; config_error past `limit` nodes.
DTRAIN_DETAIL_INLINE std::vector<int> parse_tasks_per_node(std::string_view text,
                                                           const std::string& what,
                                                           std::size_t limit = 1u << 20);

}  // namespace dtrain::detail

#if DTRAIN_DETAIL_BODIES()
#include <dtrain/detail/hostlist-inl.hpp>
#endif
